//! One compiled limit as the datapath applies it: its algorithm, its
//! parameters, and what the daemon may do with its state words (merge two,
//! tell a fresh one from a charged one). The arithmetic itself is in
//! [`crate::limiter`] and [`crate::window`].

use core::mem::size_of;

use crate::{
    clock::TickClock,
    limiter::gcra_cost,
    window::{fixed_window, sliding_window, MERGE_SETTLE_NS},
};

/// `LimitEntry::kind` values (low byte) and flags.
pub const LIMIT_GCRA: u32 = 0;
pub const LIMIT_FIXED: u32 = 1;
pub const LIMIT_SLIDING: u32 = 2;
/// Counts bytes instead of packets.
pub const LIMIT_BYTES: u32 = 1 << 8;
/// Reads the tick clock instead of ktime (see [`TickClock::suits`]).
pub const LIMIT_COARSE: u32 = 1 << 9;

/// The largest frame a byte limit is judged by when it picks its clock
/// ([`LimitEntry::with_clock`]): a jumbo frame.
pub const MAX_FRAME_BYTES: u64 = 9_216;

/// One compiled limit.
///
/// - GCRA: `a` = ns per counted unit in fixed point (`<< shift`), `b` =
///   burst span in ns; a packet costs `(units × a) >> shift` ns.
/// - Windows: `a` = window length in ns, `b` = cap per window in units of
///   `2^shift` bytes (packets: `shift = 0`).
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct LimitEntry {
    pub kind: u32,
    pub shift: u32,
    pub a: u64,
    pub b: u64,
}
const _: () = assert!(size_of::<LimitEntry>() == 24);

impl LimitEntry {
    /// A token-bucket step (GCRA): `units` cost `units × a >> shift` ns of a
    /// bucket holding `b` ns. `now` is ktime.
    #[inline(always)]
    pub fn gcra_step(&self, word: u64, now: u64, units: u64) -> Option<u64> {
        gcra_cost(word, now, (units * self.a) >> (self.shift & 63), self.b)
    }

    /// [`gcra_step`](Self::gcra_step) for a count of units that may be
    /// large (a request's hits, up to millions): a cost that does not fit
    /// 64 bits never passes (the plain step's product would wrap, and a
    /// wrapped cost could fit the burst).
    #[inline(always)]
    pub fn gcra_step_checked(&self, word: u64, now: u64, units: u64) -> Option<u64> {
        units.checked_mul(self.a)?;
        self.gcra_step(word, now, units)
    }

    /// Gives `units` back to state `word` at `now` (ktime) (a request
    /// refunded, Envoy's `is_negative_hits`): a token bucket's time moves
    /// back by their cost, never before `now` (it holds no more than its
    /// burst); a window's current count drops by them, never below 0 (a
    /// word of another window than now's and the next is left as it is:
    /// what it counted no longer limits).
    pub fn refund(&self, word: u64, now: u64, epoch_offset_ns: u64, units: u64) -> u64 {
        if self.kind & 0xff == LIMIT_GCRA {
            let cost = units.saturating_mul(self.a) >> (self.shift & 63);
            return word.saturating_sub(cost).max(now.min(word));
        }
        let shift = self.shift & 63;
        let cost = units.saturating_add((1 << shift) - 1) >> shift;
        let epoch_ns = now.wrapping_add(epoch_offset_ns);
        if self.kind & 0xff == LIMIT_FIXED {
            crate::window::fixed_refund(word, epoch_ns, self.a, cost)
        } else {
            crate::window::sliding_refund(word, epoch_ns, self.a, cost)
        }
    }

    /// Whether a packet of `units` drops at every time up to `latest`
    /// (ktime) with state `word`: a token bucket only, whose room only
    /// grows with time, so a drop at `latest` is a drop at any earlier
    /// time. (A window may roll over in between; it is never sure.)
    #[inline(always)]
    pub fn drops_until(&self, word: u64, latest: u64, units: u64) -> bool {
        self.kind & 0xff == LIMIT_GCRA && self.gcra_step(word, latest, units).is_none()
    }

    /// A window step: the count is in `2^shift`-unit steps, rounded up, and
    /// windows are aligned to the Unix epoch (`now + epoch_offset_ns`).
    #[inline(always)]
    pub fn window_step(
        &self,
        word: u64,
        now: u64,
        epoch_offset_ns: u64,
        units: u64,
    ) -> Option<u64> {
        let shift = self.shift & 63;
        let cost = (units + (1 << shift) - 1) >> shift;
        let epoch_ns = now.wrapping_add(epoch_offset_ns);
        if self.kind & 0xff == LIMIT_FIXED {
            fixed_window(word, epoch_ns, self.a, self.b, cost)
        } else {
            sliding_window(word, epoch_ns, self.a, self.b, cost)
        }
    }

    /// One step of whichever algorithm this limit uses: the new state word
    /// if `units` more fit at `now` (ktime), else `None`.
    #[inline(always)]
    pub fn step(&self, word: u64, now: u64, epoch_offset_ns: u64, units: u64) -> Option<u64> {
        if self.kind & 0xff == LIMIT_GCRA {
            self.gcra_step(word, now, units)
        } else {
            self.window_step(word, now, epoch_offset_ns, units)
        }
    }

    /// The state word of a bucket of this limit that holds nothing at
    /// `now` (this limit's clock) and, from then on, no more than any word
    /// charged at or before `now`: a token bucket whose time is a whole
    /// burst ahead, a window whose count is its cap (a sliding window's
    /// previous count too). What a wide cell starts from (see
    /// [`crate::pressure`]).
    #[inline(always)]
    pub fn drained(&self, now: u64, epoch_offset_ns: u64) -> u64 {
        if self.kind & 0xff == LIMIT_GCRA {
            return now.saturating_add(self.b);
        }
        let epoch_ns = now.wrapping_add(epoch_offset_ns);
        if self.kind & 0xff == LIMIT_FIXED {
            crate::window::fixed_drained(epoch_ns, self.a, self.b)
        } else {
            crate::window::sliding_drained(epoch_ns, self.a, self.b)
        }
    }

    /// Two state words of this limit (say a prefix cell an older build kept
    /// and the one this build made since) as one that allows no more than
    /// either, now (`now`, ktime) and at every later time: merging buckets
    /// never hands out an allowance. Windows read the clock only to tell
    /// which of two words is the later once their indexes have wrapped
    /// (see `window::fixed_merge`).
    pub fn merge(&self, a: u64, b: u64, now: u64, epoch_offset_ns: u64) -> u64 {
        let epoch_ns = now.wrapping_add(epoch_offset_ns);
        match self.kind & 0xff {
            LIMIT_GCRA => a.max(b),
            LIMIT_FIXED => crate::window::fixed_merge(a, b, epoch_ns, self.a),
            _ => crate::window::sliding_merge(a, b, epoch_ns, self.a),
        }
    }

    /// Whether `word` behaves like a new bucket (`0`) at `now` and at every
    /// later time: forgetting it then changes no verdict, so the daemon may
    /// delete it (see [`crate::pressure`]).
    pub fn is_fresh(&self, word: u64, now: u64, epoch_offset_ns: u64) -> bool {
        if self.kind & 0xff == LIMIT_GCRA {
            // max(tat, t) = t for every t ≥ now.
            return word <= now;
        }
        // Only a window strictly behind `now`'s is over: a word of a later
        // window (charged after `now` was read, or on a clock a tick ahead)
        // is current at some later time.
        let epoch_ns = now.wrapping_add(epoch_offset_ns);
        if self.kind & 0xff == LIMIT_FIXED {
            crate::window::fixed_is_over(word, epoch_ns, self.a)
        } else {
            crate::window::sliding_is_over(word, epoch_ns, self.a)
        }
    }

    /// How long the daemon waits before it merges two words of this limit
    /// at `now` (ktime): a window's first [`MERGE_SETTLE_NS`], where a
    /// datapath on the tick clock may still be in the window before.
    pub fn merge_wait_ns(&self, now: u64, epoch_offset_ns: u64) -> u64 {
        if self.kind & 0xff == LIMIT_GCRA || self.a == 0 {
            return 0;
        }
        let into = now.wrapping_add(epoch_offset_ns) % self.a;
        MERGE_SETTLE_NS.saturating_sub(into)
    }

    /// This limit reading the tick clock exactly when `clock` suits it
    /// (a token bucket by its tolerance after its largest packet,
    /// [`MAX_FRAME_BYTES`] for a byte limit, or by its smallest packet's
    /// cost, one byte for a byte limit; a window by its length).
    pub fn with_clock(mut self, clock: &TickClock) -> Self {
        let suits = if self.kind & 0xff == LIMIT_GCRA {
            let cost = |units: u64| units.saturating_mul(self.a) >> (self.shift & 63);
            let (most, least) = if self.kind & LIMIT_BYTES != 0 {
                (MAX_FRAME_BYTES, 1)
            } else {
                (1, 1)
            };
            clock.suits_bucket(self.b, cost(most), cost(least))
        } else {
            clock.suits_span(self.a)
        };
        self.kind &= !LIMIT_COARSE;
        if suits {
            self.kind |= LIMIT_COARSE;
        }
        self
    }
}

#[cfg(feature = "user")]
unsafe impl aya::Pod for LimitEntry {}

#[cfg(test)]
mod tests {
    extern crate std;
    use super::*;
    use proptest::prelude::*;

    #[test]
    fn a_byte_limit_reads_the_tick_clock_only_with_tolerance_after_a_jumbo_frame() {
        let clock = TickClock {
            tick_ns: 4_000_000,
            offset_ns: 0,
        };
        let coarse = |l: LimitEntry| l.with_clock(&clock).kind & LIMIT_COARSE != 0;
        // 2 KB/s: 500 µs a byte.
        let bytes = |burst: u64| LimitEntry {
            kind: LIMIT_GCRA | LIMIT_BYTES,
            shift: 0,
            a: 500_000,
            b: burst * 500_000,
        };
        assert!(
            !coarse(bytes(1_500)),
            "a burst under a jumbo frame: no tolerance for large packets"
        );
        assert!(!coarse(bytes(MAX_FRAME_BYTES)));
        assert!(
            coarse(bytes(MAX_FRAME_BYTES + 64)),
            "32 ms of tolerance after a jumbo frame"
        );
        // Packets: 8/s with burst 1 has no tolerance and costs 125 ms.
        let packets = |burst: u64| LimitEntry {
            kind: LIMIT_GCRA,
            shift: 0,
            a: 125_000_000,
            b: burst * 125_000_000,
        };
        assert!(!coarse(packets(1)) && coarse(packets(2)));
        // Windows of 1 s and more always suit; a merge waits out their first tick.
        let window = LimitEntry {
            kind: LIMIT_SLIDING,
            shift: 0,
            a: 1_000_000_000,
            b: 5,
        };
        assert!(coarse(window));
        assert_eq!(
            window.merge_wait_ns(7_000_000_000 + 4_000_000, 0),
            MERGE_SETTLE_NS - 4_000_000
        );
        assert_eq!(window.merge_wait_ns(7_000_000_000 + MERGE_SETTLE_NS, 0), 0);
        assert_eq!(packets(1).merge_wait_ns(7_000_000_000, 0), 0);
    }

    proptest! {
        /// A drop sure by `latest` is a drop at every earlier time, and
        /// only token buckets are ever sure.
        #[test]
        fn a_sure_drop_drops_at_every_earlier_time(
            kind in prop_oneof![Just(LIMIT_GCRA), Just(LIMIT_FIXED), Just(LIMIT_SLIDING)],
            a in 1u64..5_000_000_000, b in 1u64..30, units in 1u64..10_000, shift in 0u32..20,
            word in prop_oneof![0u64..2_000_000_000_000, (u64::MAX - 3_000_000_000_000)..=u64::MAX],
            latest in prop_oneof![0u64..2_000_000_000_000, (u64::MAX - 2_000_000_000_000)..=u64::MAX],
            back in proptest::collection::vec(0u64..200_000_000_000, 1..20),
        ) {
            // Byte limits cost `units × a >> shift` ns; times near 2⁶⁴
            // reach the step's saturation.
            let l = LimitEntry { kind, shift, a, b: if kind == LIMIT_GCRA { a * b } else { b } };
            if l.drops_until(word, latest, units) {
                prop_assert_eq!(kind, LIMIT_GCRA);
                for d in back {
                    let now = latest.saturating_sub(d);
                    prop_assert!(l.step(word, now, 0, units).is_none(), "sure by {} yet passed at {}", latest, now);
                }
            }
            // And it is sure whenever the step at `latest` drops.
            if kind == LIMIT_GCRA {
                prop_assert_eq!(l.drops_until(word, latest, units), l.step(word, latest, 0, units).is_none());
            }
        }

        /// A merged word passes a packet only where both words would, at
        /// the merge and at every later time.
        #[test]
        fn a_merge_allows_no_more_than_either_word(
            kind in prop_oneof![Just(LIMIT_GCRA), Just(LIMIT_FIXED), Just(LIMIT_SLIDING)],
            a in 1u64..5_000_000_000, b in 1u64..30,
            start in 0u64..1_000_000_000_000, off in 0u64..1_000_000_000_000,
            sent in (0u64..40, 0u64..40), skew in (0u64..600_000_000_000, 0u64..600_000_000_000),
            gaps in proptest::collection::vec(0u64..3_000_000_000, 1..40), lag in 0u64..MERGE_SETTLE_NS,
        ) {
            let l = match kind {
                LIMIT_GCRA => LimitEntry { kind, shift: 0, a, b: a * b },
                // Windows are whole seconds in the rule language; skews of
                // up to 600 of them wrap the sliding window's 8-bit index.
                _ => LimitEntry { kind, shift: 0, a: a.max(1_000_000_000), b },
            };
            // Two histories of the same limit, then a merge at `now`.
            let fill = |n: u64, t: u64| (0..n).fold(0u64, |w, _| l.step(w, t, off, 1).unwrap_or(w));
            let (mut x, mut y) = (fill(sent.0, start), fill(sent.1, start + skew.0));
            let mut now = start + skew.0.max(skew.1);
            // The daemon merges on a clock up to a tick ahead of the
            // datapath's (`now`), after waiting out its window's first tick.
            prop_assume!(l.merge_wait_ns(now + lag, off) == 0);
            // A sliding word exactly 255 windows old (mod 256) reads, to the
            // step, as the next window's and limits its key more than it
            // did (`window::sliding_window`); the merge rightly takes it as
            // stale: such a word is not a history to compare with.
            let aliased = |w: u64| kind == LIMIT_SLIDING && w != 0 && ((w >> 56).wrapping_sub((now + off) / l.a) & 0xff) == 1;
            prop_assume!(!aliased(x) && !aliased(y));
            let mut m = l.merge(x, y, now + lag, off);
            // Each bucket takes what it passes; the merge never passes more
            // than either word, counted from the merge on.
            let (mut px, mut py, mut pm) = (0, 0, 0);
            for g in gaps {
                for (w, p) in [(&mut x, &mut px), (&mut y, &mut py), (&mut m, &mut pm)] {
                    if let Some(n) = l.step(*w, now, off, 1) {
                        *w = n;
                        *p += 1;
                    }
                }
                prop_assert!(pm <= px && pm <= py, "the merge passed {} where the words passed {} and {}", pm, px, py);
                now += g;
            }
        }

        /// A drained word passes nothing at its time, and from then on no
        /// more than any word charged at or before it.
        #[test]
        fn a_drained_word_allows_no_more_than_any_charged_before_it(
            kind in prop_oneof![Just(LIMIT_GCRA), Just(LIMIT_FIXED), Just(LIMIT_SLIDING)],
            a in 1u64..5_000_000_000, b in 1u64..30, units in 1u64..4,
            start in 0u64..1_000_000_000_000, off in 0u64..1_000_000_000_000,
            sent in 0u64..40, lag in 0u64..20_000_000_000,
            gaps in proptest::collection::vec(0u64..3_000_000_000, 1..60),
        ) {
            let l = match kind {
                LIMIT_GCRA => LimitEntry { kind, shift: 0, a, b: a * b },
                _ => LimitEntry { kind, shift: 0, a: a.max(1_000_000_000), b },
            };
            // Some own bucket, charged up to `start`; drained at `now`.
            let mut x = (0..sent).fold(0u64, |w, _| l.step(w, start, off, 1).unwrap_or(w));
            let mut now = start + lag;
            let mut d = l.drained(now, off);
            prop_assert!(l.step(d, now, off, units).is_none(), "a drained word passed at its time");
            // Both take the same packets; the drained one never passes more.
            let (mut px, mut pd) = (0, 0);
            for g in gaps {
                for (w, p) in [(&mut x, &mut px), (&mut d, &mut pd)] {
                    if let Some(n) = l.step(*w, now, off, units) {
                        *w = n;
                        *p += 1;
                    }
                }
                prop_assert!(pd <= px, "drained passed {} where the charged word passed {}", pd, px);
                now += g;
            }
            // And it is never taken for fresh while it holds nothing.
            prop_assert!(!l.is_fresh(l.drained(now, off), now, off));
        }

        /// A bucket the daemon may delete is one whose every future verdict
        /// equals a new bucket's: deleting it hands out nothing.
        #[test]
        fn fresh_words_behave_like_new_buckets(
            kind in prop_oneof![Just(LIMIT_GCRA), Just(LIMIT_FIXED), Just(LIMIT_SLIDING)],
            a in 1u64..5_000_000_000, b in 1u64..50,
            start in 0u64..1_000_000_000_000, off in 0u64..1_000_000_000_000,
            sent in 0u64..60, gaps in proptest::collection::vec(0u64..10_000_000_000, 1..8),
        ) {
            let l = match kind {
                LIMIT_GCRA => LimitEntry { kind, shift: 0, a, b: a * b },
                _ => LimitEntry { kind, shift: 0, a, b },
            };
            // Some state: `sent` packets offered at `start`.
            let mut word = 0;
            for _ in 0..sent {
                if let Some(w) = l.step(word, start, off, 1) { word = w; }
            }
            // Read at a time before the word was charged (the collector read
            // its clock, then the packet came), it is not fresh either.
            let window = if kind == LIMIT_GCRA { 1 } else { a };
            for back in [1, window / 2 + 1, window, 3 * window, 100 * window] {
                if sent > 0 && back <= start {
                    let charged = (0..sent).fold(0u64, |w, _| l.step(w, start, off, 1).unwrap_or(w));
                    prop_assert!(!l.is_fresh(charged, start - back, off), "a word charged at {} read as fresh at {} ns before", start, back);
                }
            }
            let mut now = start;
            for g in gaps {
                now += g;
                if l.is_fresh(word, now, off) {
                    // Same verdicts as a new bucket over a run of packets.
                    let (mut w0, mut w1) = (0u64, word);
                    for i in 0..(b + 2) {
                        let t = now + i * (a / 7 + 1);
                        let (s0, s1) = (l.step(w0, t, off, 1), l.step(w1, t, off, 1));
                        prop_assert_eq!(s0.is_some(), s1.is_some(), "diverged at packet {}", i);
                        if let (Some(x), Some(y)) = (s0, s1) { w0 = x; w1 = y; }
                    }
                }
            }
            // And a bucket that just passed a packet is never fresh.
            if let Some(w) = l.step(0, now, off, 1) {
                prop_assert!(!l.is_fresh(w, now, off));
            }
        }
    }
}
