//! The contract between rl's XDP program and its daemon.
//!
//! Everything here compiles for `bpfel-unknown-none` (no_std, no allocation)
//! and for the host: the map layouts both sides agree on, and the limiter
//! arithmetic. The XDP program runs [`limiter::admit_with`] with the GCRA or
//! window steps on every packet; the host runs the very same functions in
//! unit, property and threaded tests.
//!
//! With the `user` feature the map types implement `aya::Pod`, so the daemon
//! can read and write them directly.
#![no_std]

pub mod cells;
pub mod clock;
pub mod known;
pub mod limit_entry;
pub mod limiter;
pub mod maps;
pub mod pressure;
pub mod quota;
pub mod window;

pub use cells::*;
pub use clock::TickClock;
pub use known::*;
pub use limit_entry::*;
pub use limiter::{admit_with, gcra, gcra_cost, Admit, Limit, SharedWord};
pub use maps::*;
pub use pressure::*;
pub use quota::{quota, Quota};
