//! The times a sliding log or a semaphore holds, in order, as runs: the
//! hits of one request share one entry, so a bucket grows by at most one
//! entry per request admitted whatever its `hits` (a single check of a
//! million hits held a million timestamps).

use std::collections::VecDeque;

/// Times in order, each with how many hits it holds, and their sum.
#[derive(Clone, Debug, Default)]
pub(super) struct Runs {
    runs: VecDeque<(u64, u64)>,
    total: u64,
}

impl Runs {
    /// Hits held.
    pub fn len(&self) -> u64 {
        self.total
    }

    /// Drops the runs from the front while `gone(time)` holds.
    pub fn expire(&mut self, gone: impl Fn(u64) -> bool) {
        while let Some(&(t, n)) = self.runs.front() {
            if !gone(t) {
                break;
            }
            self.runs.pop_front();
            self.total -= n;
        }
    }

    /// Takes back the `n` oldest hits (or all of them).
    pub fn take_oldest(&mut self, mut n: u64) {
        while n > 0 {
            let Some(front) = self.runs.front_mut() else {
                break;
            };
            let took = front.1.min(n);
            front.1 -= took;
            (n, self.total) = (n - took, self.total - took);
            if front.1 == 0 {
                self.runs.pop_front();
            }
        }
    }

    /// Adds `n` hits at `t`, or at the newest time held if that is later:
    /// callers read the clock before they take the bucket's lock, so a
    /// later charge may come first, and the log must stay in order (expiry
    /// takes from the front, and `newest` is when the key is fresh again).
    pub fn push(&mut self, t: u64, n: u64) {
        if n == 0 {
            return;
        }
        let t = t.max(self.newest().unwrap_or(0));
        match self.runs.back_mut() {
            Some(back) if back.0 == t => back.1 += n,
            _ => self.runs.push_back((t, n)),
        }
        self.total += n;
    }

    /// Entries held (runs, not hits).
    #[cfg(test)]
    pub fn entries(&self) -> usize {
        self.runs.len()
    }

    /// The newest time held.
    pub fn newest(&self) -> Option<u64> {
        self.runs.back().map(|&(t, _)| t)
    }

    /// How long from `now` until `wanted` more fit under `cap`, each hit
    /// leaving at its time plus `life`: 0 if they fit now (or none is
    /// held), the time the hit that makes room leaves, or, for more than
    /// `cap` at once (never), until the last leaves.
    pub fn until_room(&self, life: u64, cap: u64, wanted: u64, now: u64) -> u64 {
        let must_leave = (self.total + wanted).saturating_sub(cap).min(self.total);
        if must_leave == 0 {
            return 0;
        }
        let mut left = 0;
        for &(t, n) in &self.runs {
            left += n;
            if left >= must_leave {
                return (t + life).saturating_sub(now);
            }
        }
        0
    }
}

#[cfg(test)]
mod tests {
    use super::Runs;

    /// A charge whose clock was read before a later one took the lock is
    /// logged at the later time: the log stays in order.
    #[test]
    fn a_charge_that_comes_late_keeps_the_log_in_order() {
        let mut r = Runs::default();
        r.push(105, 1);
        r.push(100, 1);
        assert_eq!(r.newest(), Some(105));
        r.expire(|t| t + 60 <= 164);
        assert_eq!(r.total, 2, "neither has expired at 164");
        r.expire(|t| t + 60 <= 165);
        assert_eq!(r.total, 0);
    }

    #[test]
    fn runs_count_hits_and_give_back_the_oldest() {
        let mut r = Runs::default();
        r.push(10, 3);
        r.push(10, 2);
        r.push(20, 1_000_000);
        assert_eq!(
            (r.len(), r.runs.len()),
            (1_000_005, 2),
            "a request's hits are one entry"
        );
        assert_eq!(
            r.until_room(100, 1_000_005, 1, 0),
            110,
            "one more: the oldest run must leave"
        );
        assert_eq!(
            r.until_room(100, 1_000_005, 6, 0),
            120,
            "six more: into the second run"
        );
        assert_eq!(r.until_room(100, 2_000_000, 6, 0), 0, "room now");
        r.take_oldest(4);
        assert_eq!(
            (r.len(), r.runs.front().copied()),
            (1_000_001, Some((10, 1)))
        );
        r.expire(|t| t < 15);
        assert_eq!((r.len(), r.newest()), (1_000_000, Some(20)));
        r.take_oldest(u64::MAX);
        assert_eq!((r.len(), r.newest()), (0, None));
    }
}
