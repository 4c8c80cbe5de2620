//! Which clock a limit reads: the kernel tick counter when it is precise
//! enough, nanosecond ktime otherwise.
//!
//! Why: on the per-packet path `bpf_ktime_get_ns` is a real helper call (tens
//! of nanoseconds on CPUs with return-stack mitigations), while
//! `bpf_jiffies64` is inlined by the verifier into one load. Jiffies advance
//! once per tick (4 ms at `HZ=250`), so a limit read through them behaves as
//! GCRA in time rounded down to the last tick. That costs at most
//! `rate × tick` packets of accuracy over any span (plus one), in either
//! direction, which is negligible for a limit whose burst lasts many ticks and
//! wrong for one that does not: [`TickClock::suits`] draws the line.

use crate::limiter::Limit;

/// A limit uses the tick clock only when its burst lasts at least this many
/// ticks beyond one packet's cost (its tolerance), so the rounding error is
/// at most 1/8 of the burst.
pub const COARSE_MIN_TICKS: u64 = 8;

/// ... or when one packet's cost spans at least this many ticks. A bucket
/// without tolerance restarts from the (rounded down) clock at every pass,
/// so each pass may move by up to a tick: the limit passes up to
/// `tick / cost` more or fewer, at most 0.1% here (+1). With tolerance the
/// state word runs ahead of the clock and nothing accumulates. A property
/// test found the difference: a limit of 8/s with burst 1 passed 2.4% fewer
/// on the tick clock, which an 8-tick burst alone had let through.
pub const COARSE_MIN_COST_TICKS: u64 = 1_000;

/// How late the jiffies update [`TickClock::latest`] allows for: five
/// ticks, and at least 8 ms. The kernel forces a stalled jiffies update
/// after five ticks (`MAX_STALLED_JIFFIES` in `kernel/time/tick-sched.c`:
/// a timekeeping CPU in `stop_machine()` or held in a VM exit). Later
/// still, a token bucket on ktime decides a packet due within that much
/// more of its time as if it came that much earlier: it drops it, never
/// passes one early.
pub const LATE_TICKS: u64 = 5;
/// See [`LATE_TICKS`].
pub const LATE_NS_MIN: u64 = 8_000_000;

/// Maps the kernel's `jiffies64` onto ktime nanoseconds: `jiffies × tick_ns +
/// offset_ns` (wrapping), measured by the daemon at load from a ktime read
/// just after a tick's edge: the time of a tick is never before its edge,
/// and lags ktime by less than one tick (plus that read's delay, a few µs,
/// which puts it ahead of the edge), so buckets may move between the two
/// clocks without losing their meaning.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct TickClock {
    /// Nanoseconds per jiffy (`1e9 / HZ`); 0 when unknown, which disables it.
    pub tick_ns: u64,
    /// ktime at jiffy 0, modulo 2⁶⁴.
    pub offset_ns: u64,
}

/// The values `CONFIG_HZ` can take.
pub const KERNEL_HZ: [u64; 4] = [100, 250, 300, 1000];

impl TickClock {
    /// The clock from two (jiffies, ktime) readings taken right after a tick.
    pub fn from_edges(a: (u64, u64), b: (u64, u64)) -> Option<TickClock> {
        let ticks = b.0.checked_sub(a.0).filter(|&t| t > 0)?;
        let measured = b.1.checked_sub(a.1)? / ticks;
        // Snap to the HZ the kernel can be built with: its tick is exactly
        // 1e9 / HZ. A busy machine sees each edge a little late, so the
        // measurement is off by up to a few percent; anything further from
        // every known HZ is not trusted (limits then read ktime).
        let tick_ns = KERNEL_HZ
            .iter()
            .map(|hz| 1_000_000_000 / hz)
            .find(|&t| measured.abs_diff(t) <= t / 20)?;
        Some(TickClock {
            tick_ns,
            offset_ns: a.1.wrapping_sub(a.0.wrapping_mul(tick_ns)),
        })
    }

    /// Nanoseconds at `jiffies` on the ktime scale.
    #[inline(always)]
    pub fn at(&self, jiffies: u64) -> u64 {
        jiffies
            .wrapping_mul(self.tick_ns)
            .wrapping_add(self.offset_ns)
    }

    /// The latest ktime a reading of `jiffies` may stand for: the end of
    /// its tick, plus [`LATE_TICKS`] (at least [`LATE_NS_MIN`]) for a
    /// jiffies update held back. A bucket whose packet drops
    /// even at that time drops at the exact time too (see
    /// [`crate::LimitEntry::drops_until`]), so such a drop needs no ktime
    /// read.
    #[inline(always)]
    pub fn latest(&self, jiffies: u64) -> u64 {
        let late = (LATE_TICKS * self.tick_ns).max(LATE_NS_MIN);
        self.at(jiffies.wrapping_add(1)).wrapping_add(late)
    }

    /// Whether `limit` stays accurate when read through this clock.
    pub fn suits(&self, limit: &Limit) -> bool {
        self.suits_bucket(limit.burst_span_ns, limit.interval_ns, limit.interval_ns)
    }

    /// Whether a token bucket holding `span_ns` whose packets cost from
    /// `least_ns` to `most_ns` stays accurate on this clock: its tolerance
    /// after the largest (`span_ns - most_ns`) lasts [`COARSE_MIN_TICKS`],
    /// or, without that, the smallest packet's cost lasts
    /// [`COARSE_MIN_COST_TICKS`].
    pub fn suits_bucket(&self, span_ns: u64, most_ns: u64, least_ns: u64) -> bool {
        self.suits_span(span_ns.saturating_sub(most_ns))
            || (self.tick_ns != 0 && least_ns >= self.tick_ns.saturating_mul(COARSE_MIN_COST_TICKS))
    }

    /// Whether a window of `span_ns` (or a bucket's tolerance) stays
    /// accurate on this clock.
    pub fn suits_span(&self, span_ns: u64) -> bool {
        self.tick_ns != 0 && span_ns >= self.tick_ns.saturating_mul(COARSE_MIN_TICKS)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::limiter::gcra;
    use proptest::prelude::*;

    #[test]
    fn edges_give_the_kernel_tick() {
        // HZ=250, readings a few µs after each tick.
        let c = TickClock::from_edges(
            (4_294_967_296, 10_000_003_000),
            (4_294_967_306, 10_040_004_500),
        )
        .unwrap();
        assert_eq!(c.tick_ns, 4_000_000);
        assert_eq!(c.at(4_294_967_296), 10_000_003_000);
        assert_eq!(c.at(4_294_967_297), 10_004_003_000);
        let c = TickClock::from_edges((7, 1_000_000), (107, 101_000_900)).unwrap();
        assert_eq!(c.tick_ns, 1_000_000, "HZ=1000");
        assert_eq!(TickClock::from_edges((7, 5), (7, 9)), None, "no tick seen");
        // Seen 16 µs late on a busy machine (measured in CI): still HZ=250.
        let c = TickClock::from_edges((10, 0), (11, 4_016_064)).unwrap();
        assert_eq!(c.tick_ns, 4_000_000);
        assert_eq!(
            TickClock::from_edges((10, 0), (11, 7_000_000)),
            None,
            "no HZ near 7 ms"
        );
    }

    #[test]
    fn only_limits_with_long_bursts_use_ticks() {
        let c = TickClock {
            tick_ns: 4_000_000,
            offset_ns: 0,
        };
        assert!(c.suits(&Limit::per_second(1000, 2000).unwrap()));
        assert!(
            c.suits(&Limit::per_second(10_000, 321).unwrap()),
            "32 ms beyond one packet"
        );
        assert!(!c.suits(&Limit::per_second(10_000, 320).unwrap()));
        assert!(
            !c.suits(&Limit::per_second(8, 1).unwrap()),
            "burst 1: 125 ms per packet, no tolerance"
        );
        assert!(
            c.suits(&Limit::new(1, 3_600_000_000_000, 1).unwrap()),
            "1 per hour: a pass loses at most a tick of an hour"
        );
        assert!(!c.suits(&Limit::new(1, 3_999_000_000, 1).unwrap()));
        assert!(!TickClock::default().suits(&Limit::per_second(1, 1000).unwrap()));
    }

    #[test]
    fn the_latest_time_a_tick_stands_for_allows_five_late_ticks_and_8_ms() {
        for (tick, late) in [
            (1_000_000, 8_000_000),
            (4_000_000, 20_000_000),
            (10_000_000, 50_000_000),
        ] {
            let c = TickClock {
                tick_ns: tick,
                offset_ns: 123,
            };
            // Any ktime within the tick of jiffy 7, up to `late` after its
            // end, is at or before the latest: a jiffies update the kernel
            // let stall for its five ticks is still covered.
            assert_eq!(c.latest(7), c.at(8) + late, "tick {tick}");
            assert!(c.latest(7) >= c.at(7 + 1 + 5), "tick {tick}");
        }
    }

    proptest! {
        /// A flood read through the tick clock passes within `rate × tick + 1`
        /// packets of the same flood read through ktime.
        #[test]
        fn tick_clock_error_is_at_most_rate_times_tick(
            rate in 1u64..200_000,
            burst_ticks in COARSE_MIN_TICKS..400,
            step in 1_000u64..2_000_000,
            packets in 1usize..20_000,
            phase in 0u64..4_000_000,
        ) {
            let tick = 4_000_000u64;
            let clock = TickClock { tick_ns: tick, offset_ns: 0 };
            let interval = 1_000_000_000 / rate;
            let burst = (burst_ticks * tick).div_ceil(interval) + 1;
            let limit = Limit::per_second(rate, burst).unwrap();
            prop_assert!(clock.suits(&limit));
            let (mut fine, mut coarse) = ((0u64, 0u64), (0u64, 0u64));
            let mut now = 1_000_000_000_000 + phase;
            for _ in 0..packets {
                if let Some(t) = gcra(fine.0, now, &limit) { fine = (t, fine.1 + 1); }
                if let Some(t) = gcra(coarse.0, clock.at(now / tick), &limit) { coarse = (t, coarse.1 + 1); }
                now += step;
            }
            let bound = rate * tick / 1_000_000_000 + 1;
            prop_assert!(fine.1.abs_diff(coarse.1) <= bound, "exact {} coarse {} bound {}", fine.1, coarse.1, bound);
        }

        /// A limit without tolerance on the tick clock passes within 0.1%
        /// (+1) of what it passes on exact time over any flood (packets at
        /// most a tick apart), and whatever the traffic never more than its
        /// rate with the interval a tick shorter allows (+1). (Sparser
        /// traffic moves a tolerance-free bucket by a whole packet gap
        /// whenever a pass's time moves by a tick across a packet, on any
        /// clock with jitter; that is GCRA with burst 1, not the clock.)
        #[test]
        fn a_limit_without_tolerance_loses_at_most_a_tick_per_pass(
            interval_ticks in COARSE_MIN_COST_TICKS..3_000,
            step in 1_000u64..50_000_000,
            phase in 0u64..4_000_000,
        ) {
            let tick = 4_000_000u64;
            let clock = TickClock { tick_ns: tick, offset_ns: 0 };
            let limit = Limit::new(1, interval_ticks * tick + phase % tick, 1).unwrap();
            prop_assert!(clock.suits(&limit));
            // Packets every `step` over 2,000 intervals. A dropped packet
            // leaves the state as it was, so each run jumps to the first
            // packet its next pass can be (then steps one at a time).
            let start = 1_000_000_000_000 + phase;
            let end = start + 2_000 * limit.interval_ns;
            let first_from = |t: u64| t.saturating_sub(start).div_ceil(step);
            let run = |read: &dyn Fn(u64) -> u64, due: &dyn Fn(u64) -> u64| {
                let (mut tat, mut passed, mut i) = (0u64, 0u64, 0u64);
                while start + i * step < end {
                    match gcra(tat, read(start + i * step), &limit) {
                        Some(t) => {
                            tat = t;
                            passed += 1;
                            i = first_from(due(t)).max(i + 1);
                        }
                        None => i += 1,
                    }
                }
                passed
            };
            let fine = run(&|now| now, &|tat| tat);
            let coarse = run(&|now| clock.at(now / tick), &|tat| tat.div_ceil(tick) * tick);
            if step <= tick {
                prop_assert!(fine.abs_diff(coarse) <= fine / 1000 + 1, "coarse {} exact {}", coarse, fine);
            }
            let most = 2_000 * limit.interval_ns / (limit.interval_ns - tick) + 1;
            prop_assert!(coarse <= most, "coarse {} over {}", coarse, most);
        }
    }
}
