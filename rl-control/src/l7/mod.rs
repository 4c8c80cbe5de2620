//! Request (layer 7) decisions from the same limiter: `[[l7.rule]]`s match
//! Envoy-style descriptors and charge request buckets with rl-common's
//! arithmetic (plus the sliding log and the semaphore), answered over
//! Envoy's rate-limit service (gRPC) and a plain HTTP check
//! (`POST /v1/check`).

pub mod engine;
pub mod grpc;
pub mod http;
pub mod rules;
