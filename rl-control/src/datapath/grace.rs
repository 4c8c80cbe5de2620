//! Waiting out XDP program runs in progress: before the daemon rewrites
//! what a run may still be reading (the inactive rule slot after a flip, a
//! rule entry being renamed, a filter half or a cell being freed), every
//! run that began earlier must be over.
//!
//! Runs take microseconds, so a short sleep covers them in practice, but
//! not when the hypervisor stops the vCPU in the middle of one (steal) or
//! on a PREEMPT_RT kernel. The kernel's own guarantee is an RCU grace
//! period: non-sleepable BPF programs, XDP among them, run inside an RCU
//! read-side section, and an update of an `ARRAY_OF_MAPS` map returns only
//! after `synchronize_rcu()` (the kernel waits so that no program still
//! uses the inner map replaced). [`wait`] sleeps as before, then makes
//! such an update on a one-slot map of its own: both bounds hold.

use super::bpf::bpf;
use std::{
    os::fd::{AsRawFd, FromRawFd, OwnedFd},
    sync::OnceLock,
    time::{Duration, Instant},
};

const BPF_MAP_CREATE: libc::c_long = 0;
const BPF_MAP_UPDATE_ELEM: libc::c_long = 2;
const BPF_MAP_TYPE_ARRAY: u32 = 2;
const BPF_MAP_TYPE_ARRAY_OF_MAPS: u32 = 12;

/// A one-slot `ARRAY_OF_MAPS` and the array it holds: each update of its
/// slot is a grace period.
struct Barrier {
    outer: OwnedFd,
    inner: OwnedFd,
}

impl Barrier {
    fn new() -> std::io::Result<Barrier> {
        let map = |map_type: u32, inner_fd: u32| {
            // map_type, key_size; value_size, max_entries; map_flags,
            // inner_map_fd: 4-byte keys and values, one entry.
            let mut attr = [0u64; 16];
            attr[0] = u64::from(map_type) | 4 << 32;
            attr[1] = 4 | 1 << 32;
            attr[2] = u64::from(inner_fd) << 32;
            bpf(BPF_MAP_CREATE, &mut attr)
                // SAFETY: a new file descriptor the kernel gave us.
                .map(|fd| unsafe { OwnedFd::from_raw_fd(fd as i32) })
        };
        let inner = map(BPF_MAP_TYPE_ARRAY, 0)?;
        let outer = map(BPF_MAP_TYPE_ARRAY_OF_MAPS, inner.as_raw_fd() as u32)?;
        Ok(Barrier { outer, inner })
    }

    /// Returns once every BPF program run that began before the call is
    /// over.
    fn wait(&self) -> std::io::Result<()> {
        let key = 0u32;
        let value = self.inner.as_raw_fd() as u32;
        // map_fd (and pad), key, value, flags (0: any).
        let mut attr = [0u64; 16];
        attr[0] = self.outer.as_raw_fd() as u32 as u64;
        attr[1] = &key as *const u32 as u64;
        attr[2] = &value as *const u32 as u64;
        bpf(BPF_MAP_UPDATE_ELEM, &mut attr).map(drop)
    }
}

/// The process's barrier; `None` if the kernel refused one (warned once:
/// the sleeps alone then bound the waits).
fn barrier() -> Option<&'static Barrier> {
    static B: OnceLock<Option<Barrier>> = OnceLock::new();
    B.get_or_init(|| match Barrier::new() {
        Ok(b) => Some(b),
        Err(e) => {
            tracing::warn!("cannot make the BPF map that waits out XDP runs in progress ({e}): waits after a reload are timed sleeps only");
            None
        }
    })
    .as_ref()
}

/// When the latest completed grace period began: one that began at or
/// after a wait's `t` covers that wait too.
static LAST: std::sync::Mutex<Option<Instant>> = std::sync::Mutex::new(None);

/// Sleeps until `t` (at once if past), then waits for an RCU grace period
/// that began at `t` or later (none if one already completed: an
/// install's waits under the state lock follow the same waits made
/// without it, and take no time): every XDP run that began before `t` is
/// over.
pub fn wait_until(t: Instant) {
    if let Some(left) = t.checked_duration_since(Instant::now()) {
        std::thread::sleep(left);
    }
    let last = || LAST.lock().unwrap_or_else(|e| e.into_inner());
    if last().is_some_and(|l| l >= t) {
        return;
    }
    let Some(b) = barrier() else {
        return;
    };
    let began = Instant::now();
    match b.wait() {
        Ok(()) => {
            let mut l = last();
            *l = Some(l.map_or(began, |l| l.max(began)));
        }
        Err(e) => {
            static WARNED: std::sync::atomic::AtomicBool =
                std::sync::atomic::AtomicBool::new(false);
            if !WARNED.swap(true, std::sync::atomic::Ordering::Relaxed) {
                tracing::warn!("waiting out XDP runs in progress failed ({e}): this wait was a timed sleep only");
            }
        }
    }
}

/// [`wait_until`] `d` from now.
pub fn wait(d: Duration) {
    wait_until(Instant::now() + d)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The barrier is made and waits (as root: CI runs the tests so; a
    /// non-root run fails here, saying so).
    #[test]
    fn the_kernel_makes_the_barrier_and_each_wait_is_a_grace_period() {
        let b = Barrier::new().unwrap_or_else(|e| {
            panic!("making an ARRAY_OF_MAPS failed ({e}): the tests need root and BPF")
        });
        let t = Instant::now();
        for _ in 0..3 {
            b.wait().expect("an update of the outer map");
        }
        // synchronize_rcu() takes at least a scheduler tick or so: three
        // updates that return at once would be no grace period at all.
        assert!(
            t.elapsed() > Duration::from_micros(100),
            "{:?}",
            t.elapsed()
        );
    }

    /// A wait whose time a completed grace period began after is over at
    /// once (the waits an install repeats under the state lock cost
    /// nothing); a later time gets a grace period of its own.
    #[test]
    fn a_grace_period_begun_after_a_waits_time_covers_it() {
        let t = Instant::now();
        wait_until(t);
        let again = Instant::now();
        wait_until(t);
        assert!(
            again.elapsed() < Duration::from_micros(500),
            "{:?}",
            again.elapsed()
        );
        let later = Instant::now();
        wait_until(later);
        assert!(
            LAST.lock().unwrap().is_some_and(|l| l >= later),
            "a grace period began at or after the later time"
        );
    }
}
