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
    io,
    pin::Pin,
    sync::atomic::{AtomicU64, AtomicUsize, Ordering::Relaxed},
    task::{Context, Poll},
    time::Duration,
};

use anyhow::Context as _;
use tokio::{
    io::{AsyncRead, AsyncWrite, ReadBuf},
    net::{TcpListener, TcpStream},
};
use tonic::transport::server::{Connected, TcpConnectInfo};
use tracing::{error, warn};

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
/// the accepting task on the current runtime.
pub fn serve(listener: TcpListener, threads: usize, make: impl Fn() -> grpc::Service) -> anyhow::Result<()> {
    let mut queues = Vec::with_capacity(threads);
    for i in 0..threads {
        let (tx, rx) = tokio::sync::mpsc::unbounded_channel::<std::net::TcpStream>();
        let svc = grpc::server(make());
        let rt = tokio::runtime::Builder::new_current_thread().enable_all().build().context("a runtime for a gRPC thread")?;
        std::thread::Builder::new()
            .name(format!("rl-grpc-{i}"))
            .spawn(move || {
                rt.block_on(async move {
                    let incoming = tokio_stream::StreamExt::filter_map(tokio_stream::wrappers::UnboundedReceiverStream::new(rx), move |s| {
                        match TcpStream::from_std(s) {
                            Ok(s) => Some(Ok::<_, io::Error>(Counted::new(s, i))),
                            Err(e) => {
                                warn!("a gRPC connection could not join thread {i}: {e}");
                                None
                            }
                        }
                    });
                    if let Err(e) = tonic::transport::Server::builder().add_service(svc).serve_with_incoming(incoming).await {
                        error!("Envoy's rate-limit service (l7 gRPC) thread {i} stopped: {e}");
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

/// A connection, counted in [`CONNECTIONS`] while open.
struct Counted {
    s: TcpStream,
    thread: usize,
}

impl Counted {
    fn new(s: TcpStream, thread: usize) -> Self {
        CONNECTIONS[thread].fetch_add(1, Relaxed);
        Counted { s, thread }
    }
}

impl Drop for Counted {
    fn drop(&mut self) {
        CONNECTIONS[self.thread].fetch_sub(1, Relaxed);
    }
}

impl Connected for Counted {
    type ConnectInfo = TcpConnectInfo;
    fn connect_info(&self) -> TcpConnectInfo {
        self.s.connect_info()
    }
}

impl AsyncRead for Counted {
    fn poll_read(mut self: Pin<&mut Self>, cx: &mut Context<'_>, buf: &mut ReadBuf<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.s).poll_read(cx, buf)
    }
}

impl AsyncWrite for Counted {
    fn poll_write(mut self: Pin<&mut Self>, cx: &mut Context<'_>, buf: &[u8]) -> Poll<io::Result<usize>> {
        Pin::new(&mut self.s).poll_write(cx, buf)
    }
    fn poll_write_vectored(mut self: Pin<&mut Self>, cx: &mut Context<'_>, bufs: &[io::IoSlice<'_>]) -> Poll<io::Result<usize>> {
        Pin::new(&mut self.s).poll_write_vectored(cx, bufs)
    }
    fn is_write_vectored(&self) -> bool {
        self.s.is_write_vectored()
    }
    fn poll_flush(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.s).poll_flush(cx)
    }
    fn poll_shutdown(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.s).poll_shutdown(cx)
    }
}
