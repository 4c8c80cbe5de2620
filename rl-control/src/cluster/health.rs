//! When a degraded cluster is healthy again: a circuit breaker with
//! backoff, so that a Redis that answers the probe but fails again soon
//! (a Redis Cluster with a master down, timeouts now and then) does not
//! flip every host between shared and `on_failure` every `sync_interval`,
//! filling the event log and resetting the degraded alert's `for:`.
//!
//! Any failed call degrades at once (decisions then stop waiting on
//! Redis). Recovery takes `needed` probes answered in a row: 1, doubled
//! each time the cluster degrades again within [`FLAP_WINDOW`] of its
//! last recovery, up to [`MAX_WAIT`] worth of probes; back to 1 once a
//! recovery has held for that window.

use std::time::{Duration, Instant};

/// A recovery that fails again sooner than this was a flap.
pub const FLAP_WINDOW: Duration = Duration::from_secs(60);
/// The longest run of answered probes a recovery waits for.
pub const MAX_WAIT: Duration = Duration::from_secs(30);

#[derive(Debug)]
pub struct Breaker {
    /// Answered probes in a row a recovery needs now.
    needed: u32,
    /// Answered probes in a row so far in this degraded spell.
    good: u32,
    /// The most probes a recovery waits for (`MAX_WAIT` of them).
    cap: u32,
    recovered_at: Option<Instant>,
}

impl Breaker {
    /// A breaker for probes every `interval`.
    pub fn new(interval: Duration) -> Breaker {
        let cap = (MAX_WAIT.as_millis() / interval.as_millis().max(1))
            .clamp(1, u128::from(u32::MAX)) as u32;
        Breaker {
            needed: 1,
            good: 0,
            cap,
            recovered_at: None,
        }
    }

    /// The cluster went from healthy to degraded at `now`.
    pub fn degraded(&mut self, now: Instant) {
        let flap = self
            .recovered_at
            .is_some_and(|t| now.saturating_duration_since(t) < FLAP_WINDOW);
        self.needed = if flap {
            self.needed.saturating_mul(2).min(self.cap)
        } else {
            1
        };
        self.good = 0;
    }

    /// A call failed while degraded: the run of answers starts over.
    pub fn failed(&mut self) {
        self.good = 0;
    }

    /// A probe answered while degraded: whether the cluster is healthy
    /// again. A spell never announced (the start's, until its first probe)
    /// was no recovery: a failure soon after is no flap.
    pub fn answered(&mut self, now: Instant, announced: bool) -> bool {
        self.good += 1;
        if self.good < self.needed {
            return false;
        }
        self.good = 0;
        self.recovered_at = announced.then_some(now);
        true
    }

    /// Answers still needed before the cluster is healthy again.
    pub fn to_go(&self) -> u32 {
        self.needed - self.good.min(self.needed)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const T: Duration = Duration::from_millis(100);

    /// A Redis that answers each probe and fails the next call, 20 times
    /// over 4 s: it recovers ever more slowly instead of every round.
    #[test]
    fn a_flapping_redis_recovers_ever_more_slowly() {
        let (mut b, t0) = (Breaker::new(T), Instant::now());
        let mut now = t0;
        let mut recoveries = 0;
        b.degraded(now);
        for _ in 0..40 {
            now += T;
            if b.answered(now, true) {
                recoveries += 1;
                // The next call fails again at once.
                b.degraded(now);
            }
        }
        // Needed 1, 2, 4, 8, 16: five recoveries in 40 rounds, not 40.
        assert_eq!(recoveries, 5, "{b:?}");
        assert_eq!(b.to_go(), 32 - 9, "{b:?}");
    }

    #[test]
    fn a_failure_starts_the_run_over_and_a_held_recovery_resets_the_backoff() {
        let (mut b, mut now) = (Breaker::new(T), Instant::now());
        b.degraded(now);
        assert!(
            b.answered(now, true),
            "a first spell recovers at the first answer"
        );
        b.degraded(now + T);
        assert!(
            !b.answered(now + 2 * T, true),
            "degraded again within the window: 2 answers needed"
        );
        b.failed();
        assert!(
            !b.answered(now + 3 * T, true),
            "a failure started the run over"
        );
        assert!(b.answered(now + 4 * T, true));
        // Held for the window: the next spell recovers at once again.
        now += FLAP_WINDOW + 5 * T;
        b.degraded(now);
        assert_eq!(b.to_go(), 1);
        // The start's first answer (no spell announced) is no recovery.
        let mut b = Breaker::new(T);
        assert!(b.answered(now, false));
        b.degraded(now + T);
        assert_eq!(b.to_go(), 1, "a failure soon after the start is no flap");
        // Never more than MAX_WAIT worth of probes.
        let mut b = Breaker::new(T);
        for _ in 0..20 {
            b.degraded(now);
            while !b.answered(now, true) {}
        }
        b.degraded(now);
        assert_eq!(b.to_go(), 300);
    }
}
