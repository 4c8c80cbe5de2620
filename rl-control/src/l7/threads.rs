//! Thread per core for the l7 listeners: `[l7] grpc_threads` threads
//! (default one per CPU the daemon may run on), each a single-threaded
//! runtime that owns the connections dealt to it. Envoy's gRPC service and
//! the HTTP check share them; each listener has a task that accepts and
//! deals its connections out in turn.
//!
//! Why: on tokio's shared runtime a request hopped between worker threads
//! (the connection's task, the handler, the wake-ups between them, a
//! parked worker woken through a futex), and on a 2-CPU host that cost as
//! much CPU as the decision's transport itself, and more in the tail. With
//! each connection on one thread a request never leaves it.

use std::{
    future::Future,
    sync::{
        atomic::{AtomicU64, AtomicUsize, Ordering::Relaxed},
        Arc,
    },
    time::Duration,
};

use anyhow::Context as _;
use tokio::{
    net::{TcpListener, TcpStream},
    sync::mpsc::UnboundedSender,
};
use tracing::warn;

use super::rules::MAX_GRPC_THREADS;

/// One listener's connections: how many are open, how many it may hold,
/// how many it closed unserved.
#[derive(Debug, Default)]
pub struct Limits {
    pub max: usize,
    pub open: AtomicUsize,
    pub refused: AtomicU64,
}

/// Every listener's limits, by its `api` label, for `/metrics`.
pub static LISTENERS: std::sync::Mutex<Vec<(&'static str, Arc<Limits>)>> =
    std::sync::Mutex::new(Vec::new());

impl Limits {
    /// The limits of the listener labelled `api` (`grpc`, `http`), listed
    /// for `/metrics`.
    pub fn new(api: &'static str, max: u32) -> Arc<Limits> {
        let l = Arc::new(Limits {
            max: max as usize,
            ..Limits::default()
        });
        let mut all = LISTENERS.lock().unwrap_or_else(|e| e.into_inner());
        all.retain(|(a, _)| *a != api);
        all.push((api, l.clone()));
        l
    }
}

/// One open connection, counted in its listener's [`Limits`] until dropped.
struct Open(Arc<Limits>);

impl Open {
    fn take(limits: &Arc<Limits>) -> Option<Open> {
        limits
            .open
            .fetch_update(Relaxed, Relaxed, |n| (n < limits.max).then_some(n + 1))
            .ok()?;
        Some(Open(limits.clone()))
    }
}

impl Drop for Open {
    fn drop(&mut self) {
        self.0.open.fetch_sub(1, Relaxed);
    }
}

/// Work for one serving thread: runs there, inside its runtime.
type Job = Box<dyn FnOnce() + Send>;

/// The serving threads.
pub struct Threads {
    queues: Vec<UnboundedSender<Job>>,
}

/// The threads for `[l7] grpc_threads` (`None`: one per CPU).
pub fn thread_count(configured: Option<u32>) -> usize {
    let n = configured.map(|n| n as usize).unwrap_or_else(|| {
        std::thread::available_parallelism()
            .map(|n| n.get())
            .unwrap_or(1)
    });
    n.clamp(1, MAX_GRPC_THREADS)
}

impl Threads {
    /// Starts `n` threads, named `rl-l7-0`….
    pub fn start(n: usize) -> anyhow::Result<Threads> {
        anyhow::ensure!(n > 0, "at least one l7 serving thread");
        let mut queues = Vec::with_capacity(n);
        for i in 0..n {
            let (tx, mut rx) = tokio::sync::mpsc::unbounded_channel::<Job>();
            let rt = tokio::runtime::Builder::new_current_thread()
                .enable_all()
                .build()
                .context("a runtime for an l7 serving thread")?;
            std::thread::Builder::new()
                .name(format!("rl-l7-{i}"))
                .spawn(move || {
                    rt.block_on(async move {
                        while let Some(job) = rx.recv().await {
                            job();
                        }
                    })
                })
                .context("starting an l7 serving thread")?;
            queues.push(tx);
        }
        Ok(Threads { queues })
    }

    /// How many threads serve.
    pub fn count(&self) -> usize {
        self.queues.len()
    }

    /// Accepts on `listener` (a task on the current runtime) and deals each
    /// connection to the threads in turn, where `conn(stream, thread)`
    /// serves it. Past `limits.max` open connections a new one is closed at
    /// once and counted: clients cannot take the daemon's open files (which
    /// its map readers need too).
    pub fn serve<F, Fut>(
        &self,
        listener: TcpListener,
        what: &'static str,
        limits: Arc<Limits>,
        conn: F,
    ) where
        F: Fn(TcpStream, usize) -> Fut + Send + Sync + 'static,
        Fut: Future<Output = ()> + Send + 'static,
    {
        let (queues, conn) = (self.queues.clone(), Arc::new(conn));
        tokio::spawn(async move {
            let mut next = 0usize;
            let mut warned: Option<std::time::Instant> = None;
            loop {
                match listener.accept().await {
                    Ok((s, peer)) => {
                        let Some(open) = Open::take(&limits) else {
                            limits.refused.fetch_add(1, Relaxed);
                            if warned.is_none_or(|t| t.elapsed() >= Duration::from_secs(60)) {
                                warned = Some(std::time::Instant::now());
                                warn!("{what}: {} connections open, [l7] max_connections: closing new ones (this one from {peer}) until some close; rl_l7_connections_refused_total counts them", limits.max);
                            }
                            drop(s);
                            continue;
                        };
                        // No Nagle delay on answers.
                        let _ = s.set_nodelay(true);
                        let s = match s.into_std() {
                            Ok(s) => s,
                            Err(e) => {
                                warn!("a {what} connection could not be handed to a thread: {e}");
                                continue;
                            }
                        };
                        let i = next % queues.len();
                        next = next.wrapping_add(1);
                        let conn = conn.clone();
                        let job: Job = Box::new(move || match TcpStream::from_std(s) {
                            Ok(s) => {
                                let served = conn(s, i);
                                tokio::spawn(async move {
                                    served.await;
                                    drop(open);
                                });
                            }
                            Err(e) => warn!("a {what} connection could not join thread {i}: {e}"),
                        });
                        if queues[i].send(job).is_err() {
                            warn!("l7 serving thread {i} has stopped: a {what} connection was closed unserved");
                        }
                    }
                    Err(e) => {
                        // Out of file descriptors, say: keep serving the open
                        // connections and try again shortly.
                        warn!("accepting a {what} connection failed: {e}; retrying in 100 ms");
                        tokio::time::sleep(Duration::from_millis(100)).await;
                    }
                }
            }
        });
    }
}
