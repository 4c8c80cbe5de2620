//! What a key may still send under one limit, in the terms of HTTP
//! rate-limit headers (`X-RateLimit-Limit`, `X-RateLimit-Remaining`,
//! `Retry-After`), read from the state word the datapath keeps.
//!
//! The answers are defined by the datapath's own step functions
//! ([`LimitEntry::step`]): `remaining` more packets pass now and one more
//! would not; at `retry_after_ns` from now a packet passes and one
//! nanosecond earlier it would not. The host tests check exactly that.

use crate::limit_entry::{LimitEntry, LIMIT_BYTES, LIMIT_GCRA};

/// One limit's quota for one key, at one moment.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Quota {
    /// Units (packets, or bytes for a byte limit) a fresh key may send at
    /// once: the burst, or the window's cap.
    pub limit: u64,
    /// Units that pass now, one after another.
    pub remaining: u64,
    /// Wait before one more unit passes (0 when `remaining > 0`).
    pub retry_after_ns: u64,
    /// Wait until the key is back to a full `limit`.
    pub reset_ns: u64,
}

/// A wait in whole milliseconds, rounded up (for headers and the API):
/// waiting that long is never too early.
pub const fn ceil_ms(ns: u64) -> u64 {
    ns.div_ceil(1_000_000)
}

/// Units that pass one after another at `now` from state `word`.
fn remaining(l: &LimitEntry, word: u64, now: u64, epoch_offset_ns: u64) -> u64 {
    let shift = l.shift & 63;
    if l.kind & 0xff == LIMIT_GCRA {
        // The k-th unit passes while the TAT stays within the burst span.
        let base = if word > now { word } else { now };
        let room = l.b.saturating_sub(base - now) as u128;
        if l.kind & LIMIT_BYTES != 0 {
            // k bytes cost (k × a) >> shift ns.
            let k = (((room + 1) << shift) - 1) / (l.a as u128).max(1);
            return k.min(u64::MAX as u128) as u64;
        }
        let per = ((l.a >> shift) as u128).max(1);
        return (room / per) as u64;
    }
    // Windows: how much the cap still holds, by stepping the real function
    // (a binary search over the count: steps of one unit are monotone).
    let fits = |n: u64| n == 0 || l.window_step(word, now, epoch_offset_ns, n).is_some();
    let (mut lo, mut hi) = (0u64, l.b.saturating_mul(1 << shift).saturating_add(1));
    while lo + 1 < hi {
        let mid = lo + (hi - lo) / 2;
        if fits(mid) {
            lo = mid;
        } else {
            hi = mid;
        }
    }
    lo
}

/// Units a fresh key may send at once under `limit` at `now`: the burst,
/// or the window's cap ([`Quota::limit`]).
pub fn capacity(limit: &LimitEntry, now: u64, epoch_offset_ns: u64) -> u64 {
    remaining(limit, 0, now, epoch_offset_ns)
}

/// How much room state `word` leaves at `now`, in eighths of `capacity`
/// (0 ..= 8, rounded down): the largest `e` for which `capacity × e / 8`
/// units (rounded up) still pass. Three or four steps of the limit's own
/// arithmetic, so state words of unlike limits (token buckets, windows,
/// other rates) compare by what they leave, at a cost a walk over a
/// flood's cells can pay.
pub fn room_eighths(
    limit: &LimitEntry,
    word: u64,
    now: u64,
    epoch_offset_ns: u64,
    capacity: u64,
) -> u8 {
    let fits = |e: u64| {
        let units = (capacity.saturating_mul(e)).div_ceil(8);
        units == 0 || limit.step(word, now, epoch_offset_ns, units).is_some()
    };
    let (mut lo, mut hi) = (0u64, 9u64);
    while lo + 1 < hi {
        let mid = (lo + hi) / 2;
        if fits(mid) {
            lo = mid;
        } else {
            hi = mid;
        }
    }
    lo as u8
}

/// The smallest wait `d` (0 ..= `horizon`) after which `ok(now + d)` holds,
/// for an `ok` that, once true, stays true.
fn first_time(now: u64, horizon: u64, ok: impl Fn(u64) -> bool) -> u64 {
    if ok(now) {
        return 0;
    }
    let (mut lo, mut hi) = (0u64, horizon);
    while lo + 1 < hi {
        let mid = lo + (hi - lo) / 2;
        if ok(now.saturating_add(mid)) {
            hi = mid;
        } else {
            lo = mid;
        }
    }
    hi
}

/// How long from `now` until `units` more fit at once under `limit` from
/// state `word` (0 if they fit now): a request of several hits over the
/// limit while some room is left ([`Quota::retry_after_ns`] is for one).
/// More than the limit ever holds: the wait until it is full again.
pub fn wait_for(limit: &LimitEntry, word: u64, now: u64, epoch_offset_ns: u64, units: u64) -> u64 {
    let horizon = if limit.kind & 0xff == LIMIT_GCRA {
        limit.b
    } else {
        limit.a.saturating_mul(2)
    }
    .saturating_add(1);
    let want = units.min(capacity(limit, now, epoch_offset_ns).max(1));
    first_time(now, horizon, |t| {
        remaining(limit, word, t, epoch_offset_ns) >= want
    })
}

/// The quota of `limit` for a key in state `word` at `now` (ktime ns; the
/// limit's windows are aligned with `epoch_offset_ns`, as in the datapath).
pub fn quota(limit: &LimitEntry, word: u64, now: u64, epoch_offset_ns: u64) -> Quota {
    if limit.kind & 0xff == LIMIT_GCRA && limit.kind & LIMIT_BYTES == 0 {
        return packet_bucket(limit, word, now);
    }
    searched(limit, word, now, epoch_offset_ns)
}

/// [`quota`] of a packet (or request) token bucket in closed form: the
/// searches below, solved. `remaining(t)` is the room the TAT leaves at `t`,
/// `b - max(0, word - t)`, over the cost of one unit; it reaches `need` ns
/// of room once the TAT is no more than `b - need` ahead. (The property
/// test checks it against the searches.)
fn packet_bucket(l: &LimitEntry, word: u64, now: u64) -> Quota {
    let per = (l.a >> (l.shift & 63)).max(1);
    let ahead = word.saturating_sub(now);
    let horizon = l.b.saturating_add(1);
    let wait = |need: u64| {
        if need == 0 {
            0
        } else if need > l.b {
            horizon
        } else {
            ahead.saturating_sub(l.b - need).min(horizon)
        }
    };
    let limit = l.b / per;
    Quota {
        limit,
        remaining: l.b.saturating_sub(ahead) / per,
        retry_after_ns: wait(per),
        reset_ns: wait(limit * per),
    }
}

/// [`quota`] by searching the step functions: windows, byte buckets.
fn searched(limit: &LimitEntry, word: u64, now: u64, epoch_offset_ns: u64) -> Quota {
    let rem = |t: u64| remaining(limit, word, t, epoch_offset_ns);
    let full = remaining(limit, 0, now, epoch_offset_ns).max(rem(now));
    // A token bucket refills within its burst span, a window within two windows.
    let horizon = if limit.kind & 0xff == LIMIT_GCRA {
        limit.b
    } else {
        limit.a.saturating_mul(2)
    }
    .saturating_add(1);
    Quota {
        limit: full,
        remaining: rem(now),
        retry_after_ns: first_time(now, horizon, |t| rem(t) >= 1),
        reset_ns: first_time(now, horizon, |t| rem(t) >= full),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::limit_entry::{LIMIT_FIXED, LIMIT_SLIDING};
    use proptest::prelude::*;

    const S: u64 = 1_000_000_000;

    fn gcra(rate_per_s: u64, burst: u64) -> LimitEntry {
        let interval = S / rate_per_s;
        LimitEntry {
            kind: LIMIT_GCRA,
            shift: 0,
            a: interval,
            b: burst * interval,
        }
    }

    /// Sends `n` packets at `t`; returns the state and how many passed.
    fn send(l: &LimitEntry, mut word: u64, t: u64, n: u64, off: u64) -> (u64, u64) {
        let mut passed = 0;
        for _ in 0..n {
            if let Some(w) = l.step(word, t, off, 1) {
                word = w;
                passed += 1;
            }
        }
        (word, passed)
    }

    /// The definition: `remaining` pass and one more does not; after
    /// `retry_after` one passes and a nanosecond earlier none does.
    fn check(l: &LimitEntry, word: u64, now: u64, off: u64) {
        let q = quota(l, word, now, off);
        let (_, passed) = send(l, word, now, q.remaining + 1, off);
        assert_eq!(passed, q.remaining, "{q:?}");
        assert_eq!(q.retry_after_ns == 0, q.remaining > 0, "{q:?}");
        if q.retry_after_ns > 0 {
            assert!(
                l.step(word, now + q.retry_after_ns, off, 1).is_some(),
                "{q:?}"
            );
            assert!(
                l.step(word, now + q.retry_after_ns - 1, off, 1).is_none(),
                "{q:?}"
            );
        }
        assert_eq!(
            quota(l, word, now + q.reset_ns, off).remaining,
            q.limit,
            "{q:?}"
        );
        assert!(q.reset_ns >= q.retry_after_ns);
    }

    #[test]
    fn a_fresh_bucket_has_its_burst_and_an_empty_one_waits_one_interval() {
        let l = gcra(10, 5);
        let q = quota(&l, 0, 100 * S, 0);
        assert_eq!(
            q,
            Quota {
                limit: 5,
                remaining: 5,
                retry_after_ns: 0,
                reset_ns: 0
            }
        );
        let (word, passed) = send(&l, 0, 100 * S, 10, 0);
        assert_eq!(passed, 5);
        let q = quota(&l, word, 100 * S, 0);
        assert_eq!(
            (q.remaining, q.retry_after_ns, q.reset_ns),
            (0, S / 10, S / 2)
        );
        check(&l, word, 100 * S, 0);
    }

    /// Several units wait for room for all of them: at 1/s with burst 10,
    /// 8 spent, 5 more fit in 3 s; past the burst, until it is full.
    #[test]
    fn several_units_wait_for_room_for_all() {
        let l = gcra(1, 10);
        let (word, _) = send(&l, 0, 100 * S, 8, 0);
        assert_eq!(wait_for(&l, word, 100 * S, 0, 5), 3 * S);
        assert_eq!(wait_for(&l, word, 100 * S, 0, 2), 0);
        assert_eq!(
            wait_for(&l, word, 100 * S, 0, 50),
            8 * S,
            "more than the burst: until full"
        );
        let w = LimitEntry {
            kind: LIMIT_FIXED,
            shift: 0,
            a: 10 * S,
            b: 3,
        };
        let (word, _) = send(&w, 0, 104 * S, 2, 0);
        assert_eq!(wait_for(&w, word, 104 * S, 0, 2), 6 * S, "the next window");
    }

    #[test]
    fn a_fixed_window_resets_at_its_boundary() {
        let l = LimitEntry {
            kind: LIMIT_FIXED,
            shift: 0,
            a: 10 * S,
            b: 3,
        };
        let (word, _) = send(&l, 0, 104 * S, 3, 0);
        let q = quota(&l, word, 104 * S, 0);
        assert_eq!(
            (q.limit, q.remaining, q.retry_after_ns, q.reset_ns),
            (3, 0, 6 * S, 6 * S)
        );
        check(&l, word, 104 * S, 0);
    }

    proptest! {
        /// The quota is what the datapath's steps let through; its room in
        /// eighths is the quota rounded down: `remaining` holds at least
        /// `room` eighths of the limit and fewer than `room + 1`.
        #[test]
        fn quota_and_its_eighths_match_the_datapath_steps(
            kind in prop_oneof![Just(LIMIT_GCRA), Just(LIMIT_FIXED), Just(LIMIT_SLIDING)],
            rate in 1u64..50, burst in 1u64..50,
            sent in 0u64..120, gap_ms in 0u64..3000, start in 0u64..1_000_000_000_000u64,
            off in 0u64..1_000_000_000_000u64,
        ) {
            let l = match kind {
                LIMIT_GCRA => gcra(rate, burst),
                k => LimitEntry { kind: k, shift: 0, a: S, b: rate },
            };
            let (word, _) = send(&l, 0, start, sent, off);
            let now = start + gap_ms * 1_000_000;
            check(&l, word, now, off);
            let (q, cap) = (quota(&l, word, now, off), capacity(&l, now, off));
            prop_assert_eq!(cap, q.limit);
            let room = u64::from(room_eighths(&l, word, now, off, cap));
            prop_assert!(room <= 8);
            prop_assert!(q.remaining * 8 >= room * cap, "{:?}: room {} of 8", q, room);
            prop_assert!(room == 8 || q.remaining * 8 < (room + 1) * cap, "{:?}: room {} of 8", q, room);
        }

        #[test]
        fn the_packet_buckets_closed_form_is_the_search(
            a in 1u64..10_000_000_000, b in 0u64..100_000_000_000, shift in 0u32..12,
            ahead in 0u64..200_000_000_000, behind in 0u64..2, now in 0u64..1_000_000_000_000_000,
        ) {
            let l = LimitEntry { kind: LIMIT_GCRA, shift, a, b };
            // The TAT ahead of the clock, or (behind) in the past.
            let word = if behind == 1 { now.saturating_sub(ahead) } else { now + ahead };
            prop_assert_eq!(packet_bucket(&l, word, now), searched(&l, word, now, 0));
        }
    }
}
