//! Request (layer 7) decisions from the same limiter: `[[l7.rule]]`s match
//! Envoy-style descriptors and charge request buckets with rl-common's
//! arithmetic (plus the sliding log and the semaphore), answered over
//! Envoy's rate-limit service (gRPC) and a plain HTTP check
//! (`POST /v1/check`, and `/v1/forward-auth/{domain}` for forward-auth
//! gateways).

mod charge;
pub mod engine;
pub mod forward;
pub mod grpc;
pub mod grpc_threads;
pub mod http;
pub mod rules;
mod runs;
mod scoped;
pub mod threads;

use std::sync::atomic::{AtomicU64, Ordering::Relaxed};

/// Upper bounds (seconds) of the request-latency histogram's buckets.
pub const LATENCY_BOUNDS: [f64; 8] = [0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.05];

/// How long the service took to answer (decode, decide, encode), per front
/// end: a Prometheus histogram, process-wide (it outlives reloads).
pub struct Latency {
    buckets: [AtomicU64; LATENCY_BOUNDS.len() + 1],
    sum_ns: AtomicU64,
}

impl Latency {
    const fn new() -> Latency {
        Latency {
            buckets: [const { AtomicU64::new(0) }; LATENCY_BOUNDS.len() + 1],
            sum_ns: AtomicU64::new(0),
        }
    }

    /// Records one answer that took `d`.
    pub fn record(&self, d: std::time::Duration) {
        let s = d.as_secs_f64();
        let i = LATENCY_BOUNDS
            .iter()
            .position(|b| s <= *b)
            .unwrap_or(LATENCY_BOUNDS.len());
        self.buckets[i].fetch_add(1, Relaxed);
        self.sum_ns.fetch_add(d.as_nanos() as u64, Relaxed);
    }

    /// Cumulative counts per bound (the last is +Inf, the count), and the sum
    /// in seconds.
    pub fn snapshot(&self) -> (Vec<u64>, f64) {
        let mut acc = 0;
        let counts = self.buckets.iter().map(|b| {
            acc += b.load(Relaxed);
            acc
        });
        (counts.collect(), self.sum_ns.load(Relaxed) as f64 / 1e9)
    }
}

/// Answers of the HTTP check.
pub static HTTP_LATENCY: Latency = Latency::new();
/// Answers of Envoy's rate-limit service.
pub static GRPC_LATENCY: Latency = Latency::new();
/// Descriptors whose Envoy `limit` override rl did not apply (the matching
/// rule's limits decided; see `engine::overrides`).
pub static OVERRIDES_IGNORED: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(0);

/// Calls refused without a decision: gRPC by status code (index), HTTP
/// checks answered 400. Envoy lets a request through when its call fails
/// (`failure_mode_deny = false`, its default), so each is a request that
/// went unlimited.
pub static GRPC_REFUSED: [AtomicU64; 17] = [const { AtomicU64::new(0) }; 17];
/// See [`GRPC_REFUSED`].
pub static HTTP_REFUSED: AtomicU64 = AtomicU64::new(0);

/// Counts a refused call of front end `api` ("grpc" with its `code`, or
/// "http") and warns at most once a minute per front end, with the reason.
pub fn refused(api: &'static str, code: u8, why: &str) {
    static WARNED_AT: [AtomicU64; 2] = [const { AtomicU64::new(0) }; 2];
    let (slot, counter) = match api {
        "grpc" => (0, &GRPC_REFUSED[(code as usize).min(16)]),
        _ => (1, &HTTP_REFUSED),
    };
    static START: std::sync::OnceLock<std::time::Instant> = std::sync::OnceLock::new();
    counter.fetch_add(1, Relaxed);
    // Seconds on the monotonic clock, from 60 so the first warns.
    let now = 60
        + START
            .get_or_init(std::time::Instant::now)
            .elapsed()
            .as_secs();
    let last = WARNED_AT[slot].load(Relaxed);
    if now >= last + 60
        && WARNED_AT[slot]
            .compare_exchange(last, now, Relaxed, Relaxed)
            .is_ok()
    {
        tracing::warn!(
            api,
            code,
            "a request-limit call was refused without a decision: {why}. A gateway that lets requests through when the call fails (Envoy's default) does not limit them: fix the caller (rl_l7_refused_total counts these; this warning repeats at most once a minute)"
        );
    }
}
