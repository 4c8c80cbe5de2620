//! Envoy's rate-limit service served thread per core: `[l7] grpc_threads`
//! threads (default one per CPU the daemon may run on), each a
//! single-threaded runtime that owns the connections handed to it. One
//! task accepts and deals connections out in turn.
//!
//! Why: on tokio's shared runtime a call hopped between worker threads
//! (the connection's task, the handler task, the wake-ups between them),
//! and on a 2-CPU host that cost as much CPU as the decision's transport
//! itself. With each connection on one thread a call never leaves it, and
//! answers to calls that arrive together go out in one write. Envoy holds
//! one connection per worker, so a busy Envoy spreads over the threads.
//! `rl_l7_grpc_connections{thread}` shows the spread.

use std::{
    sync::atomic::{AtomicU64, AtomicUsize, Ordering::Relaxed},
    time::Duration,
};

use anyhow::Context as _;
use envoy_types::pb::envoy::service::ratelimit::v3::rate_limit_service_server::RateLimitServiceServer;
use hyper_util::{
    rt::{TokioExecutor, TokioIo, TokioTimer},
    service::TowerToHyperService,
};
use tokio::net::{TcpListener, TcpStream};
use tracing::{debug, warn};

use super::{grpc, rules::MAX_GRPC_THREADS};

/// Open connections per serving thread.
pub static CONNECTIONS: [AtomicU64; MAX_GRPC_THREADS] = [const { AtomicU64::new(0) }; MAX_GRPC_THREADS];
/// Serving threads started (0 without `[l7] grpc_listen`).
pub static THREADS: AtomicUsize = AtomicUsize::new(0);

/// The threads for `[l7] grpc_threads` (`None`: one per CPU).
pub fn thread_count(configured: Option<u32>) -> usize {
    let n = configured.map(|n| n as usize).unwrap_or_else(|| std::thread::available_parallelism().map(|n| n.get()).unwrap_or(1));
    n.clamp(1, MAX_GRPC_THREADS)
}

/// Starts `threads` serving threads with a service from `make` each, and
/// the accepting task on the current runtime. Each connection is served by
/// hyper's HTTP/2 with the generated service directly: tonic's router,
/// error recovery and connection-info layers moved every call's future
/// around for nothing (one service, no TLS).
pub fn serve(listener: TcpListener, threads: usize, make: impl Fn() -> grpc::Service) -> anyhow::Result<()> {
    let mut queues = Vec::with_capacity(threads);
    for i in 0..threads {
        let (tx, mut rx) = tokio::sync::mpsc::unbounded_channel::<std::net::TcpStream>();
        let svc = grpc::server(make());
        let rt = tokio::runtime::Builder::new_current_thread().enable_all().build().context("a runtime for a gRPC thread")?;
        std::thread::Builder::new()
            .name(format!("rl-grpc-{i}"))
            .spawn(move || {
                rt.block_on(async move {
                    while let Some(s) = rx.recv().await {
                        match TcpStream::from_std(s) {
                            Ok(s) => {
                                tokio::spawn(connection(s, i, svc.clone()));
                            }
                            Err(e) => warn!("a gRPC connection could not join thread {i}: {e}"),
                        }
                    }
                })
            })
            .context("starting a gRPC thread")?;
        queues.push(tx);
    }
    THREADS.store(threads, Relaxed);
    tokio::spawn(async move {
        let mut next = 0usize;
        loop {
            match listener.accept().await {
                Ok((s, _)) => {
                    // No Nagle delay on answers.
                    let _ = s.set_nodelay(true);
                    match s.into_std() {
                        Ok(s) => {
                            let _ = queues[next % queues.len()].send(s);
                            next = next.wrapping_add(1);
                        }
                        Err(e) => warn!("a gRPC connection could not be handed to a thread: {e}"),
                    }
                }
                Err(e) => {
                    // Out of file descriptors, say: keep serving the open
                    // connections and try again shortly.
                    warn!("accepting a gRPC connection failed: {e}; retrying in 100 ms");
                    tokio::time::sleep(Duration::from_millis(100)).await;
                }
            }
        }
    });
    Ok(())
}

/// Serves one connection on this thread until it closes, counted in
/// [`CONNECTIONS`] meanwhile.
async fn connection(s: TcpStream, thread: usize, svc: RateLimitServiceServer<grpc::Service>) {
    CONNECTIONS[thread].fetch_add(1, Relaxed);
    let served = hyper::server::conn::http2::Builder::new(TokioExecutor::new())
        .timer(TokioTimer::new())
        .serve_connection(TokioIo::new(s), TowerToHyperService::new(svc))
        .await;
    CONNECTIONS[thread].fetch_sub(1, Relaxed);
    if let Err(e) = served {
        debug!("a gRPC connection on thread {thread} ended: {e}");
    }
}
