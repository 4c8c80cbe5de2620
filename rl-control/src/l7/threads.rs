//! Request decisions served thread per core: `[l7] threads` threads
//! (default one per CPU the daemon may run on), each a single-threaded
//! runtime that owns the connections handed to it, from both front ends
//! (Envoy's gRPC service and the HTTP check). One task per listener
//! accepts and deals connections out in turn.
//!
//! Why: on tokio's shared runtime a call hopped between worker threads
//! (the connection's task, the handler task, the wake-ups between them),
//! and on a 2-CPU host that cost as much CPU as the decision's transport
//! itself. With each connection on one thread a call never leaves it, and
//! answers to calls that arrive together go out in one write. Envoy holds
//! one connection per worker, so a busy Envoy spreads over the threads.
//! `rl_l7_connections{api, thread}` shows the spread.

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

use super::{grpc, rules::MAX_THREADS};

/// The front ends, as labelled in metrics: Envoy's gRPC service and the
/// HTTP check.
pub const APIS: [&str; 2] = ["grpc", "http"];
const GRPC: usize = 0;
const HTTP: usize = 1;

/// Open connections per front end and serving thread.
pub static CONNECTIONS: [[AtomicU64; MAX_THREADS]; 2] = [const { [const { AtomicU64::new(0) }; MAX_THREADS] }; 2];
/// Serving threads started (0 without an l7 listener).
pub static THREADS: AtomicUsize = AtomicUsize::new(0);

/// The threads for `[l7] threads` (`None`: one per CPU).
pub fn thread_count(configured: Option<u32>) -> usize {
    let n = configured.map(|n| n as usize).unwrap_or_else(|| std::thread::available_parallelism().map(|n| n.get()).unwrap_or(1));
    n.clamp(1, MAX_THREADS)
}

/// A connection for a serving thread, by front end.
enum Handed {
    Grpc(std::net::TcpStream),
    Http(std::net::TcpStream),
}

/// Starts `threads` serving threads for the listeners given (the gRPC one
/// with a service from `make` per thread), and an accepting task per
/// listener on the current runtime. Each connection is served by hyper
/// with the service directly: HTTP/2 and the generated gRPC service (tonic's
/// router, error recovery and connection-info layers moved every call's
/// future around for nothing), HTTP/1.1 and the check's router.
pub fn serve(
    threads: usize,
    grpc: Option<(TcpListener, &dyn Fn() -> grpc::Service)>,
    http: Option<(TcpListener, axum::Router)>,
) -> anyhow::Result<()> {
    if grpc.is_none() && http.is_none() {
        return Ok(());
    }
    let mut queues = Vec::with_capacity(threads);
    for i in 0..threads {
        let (tx, mut rx) = tokio::sync::mpsc::unbounded_channel::<Handed>();
        let svc = grpc.as_ref().map(|(_, make)| grpc::server(make()));
        let router = http.as_ref().map(|(_, r)| r.clone());
        let rt = tokio::runtime::Builder::new_current_thread().enable_all().build().context("a runtime for a request thread")?;
        std::thread::Builder::new()
            .name(format!("rl-l7-{i}"))
            .spawn(move || {
                rt.block_on(async move {
                    while let Some(h) = rx.recv().await {
                        match h {
                            Handed::Grpc(s) => {
                                if let (Some(s), Some(svc)) = (joined(s, i), &svc) {
                                    tokio::spawn(grpc_connection(s, i, svc.clone()));
                                }
                            }
                            Handed::Http(s) => {
                                if let (Some(s), Some(router)) = (joined(s, i), &router) {
                                    tokio::spawn(http_connection(s, i, router.clone()));
                                }
                            }
                        }
                    }
                })
            })
            .context("starting a request thread")?;
        queues.push(tx);
    }
    THREADS.store(threads, Relaxed);
    if let Some((listener, _)) = grpc {
        tokio::spawn(deal(listener, queues.clone(), Handed::Grpc));
    }
    if let Some((listener, _)) = http {
        tokio::spawn(deal(listener, queues, Handed::Http));
    }
    Ok(())
}

/// Accepts on `listener` and hands connections to the threads in turn.
async fn deal(listener: TcpListener, queues: Vec<tokio::sync::mpsc::UnboundedSender<Handed>>, wrap: fn(std::net::TcpStream) -> Handed) {
    let mut next = 0usize;
    loop {
        match listener.accept().await {
            Ok((s, _)) => {
                // No Nagle delay on answers.
                let _ = s.set_nodelay(true);
                match s.into_std() {
                    Ok(s) => {
                        let _ = queues[next % queues.len()].send(wrap(s));
                        next = next.wrapping_add(1);
                    }
                    Err(e) => warn!("a request connection could not be handed to a thread: {e}"),
                }
            }
            Err(e) => {
                // Out of file descriptors, say: keep serving the open
                // connections and try again shortly.
                warn!("accepting a request connection failed: {e}; retrying in 100 ms");
                tokio::time::sleep(Duration::from_millis(100)).await;
            }
        }
    }
}

/// A handed connection on this thread's runtime.
fn joined(s: std::net::TcpStream, thread: usize) -> Option<TcpStream> {
    TcpStream::from_std(s).map_err(|e| warn!("a request connection could not join thread {thread}: {e}")).ok()
}

/// Serves one gRPC connection on this thread until it closes.
async fn grpc_connection(s: TcpStream, thread: usize, svc: RateLimitServiceServer<grpc::Service>) {
    CONNECTIONS[GRPC][thread].fetch_add(1, Relaxed);
    let served = hyper::server::conn::http2::Builder::new(TokioExecutor::new())
        .timer(TokioTimer::new())
        .serve_connection(TokioIo::new(s), TowerToHyperService::new(svc))
        .await;
    CONNECTIONS[GRPC][thread].fetch_sub(1, Relaxed);
    if let Err(e) = served {
        debug!("a gRPC connection on thread {thread} ended: {e}");
    }
}

/// Serves one HTTP check connection on this thread until it closes.
async fn http_connection(s: TcpStream, thread: usize, router: axum::Router) {
    CONNECTIONS[HTTP][thread].fetch_add(1, Relaxed);
    let served = hyper::server::conn::http1::Builder::new()
        .timer(TokioTimer::new())
        .serve_connection(TokioIo::new(s), TowerToHyperService::new(router))
        .await;
    CONNECTIONS[HTTP][thread].fetch_sub(1, Relaxed);
    if let Err(e) = served {
        debug!("an HTTP check connection on thread {thread} ended: {e}");
    }
}
