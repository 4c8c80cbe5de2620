//! Window counters, each kept in one `u64` so that one compare-and-swap
//! updates it exactly from any number of CPUs (like GCRA's TAT word).
//!
//! Times are nanoseconds since the Unix epoch (ktime plus the offset the
//! daemon measures), so windows start at whole multiples of their length:
//! a `per = "1m"` window starts at every minute of the wall clock.

/// Fixed window: `[window index mod 2²⁴ : 24 | count : 40]`.
const FIXED_COUNT_BITS: u32 = 40;
const FIXED_COUNT_MASK: u64 = (1 << FIXED_COUNT_BITS) - 1;
const FIXED_INDEX_BITS: u32 = 24;
const FIXED_INDEX_MASK: u64 = (1 << FIXED_INDEX_BITS) - 1;

/// Largest per-window cap a fixed window holds (in counted units).
pub const FIXED_MAX: u64 = FIXED_COUNT_MASK;

/// One fixed-window step: the new word if `cost` more units fit in the
/// current window's cap `max`, else `None`. The count restarts at every
/// window boundary: a sender may pass `max` at the end of one window and
/// `max` again at the start of the next.
///
/// A word of the window *after* `now`'s is charged as it stands, in its own
/// window: the time a bucket has seen never goes back. Another CPU that read
/// the clock a little later may have opened the next window before this
/// packet's compare-and-swap, and a restarted daemon's clock may read a
/// tick behind the one it replaced; read as "another window", either would
/// restart the count (one window's cap handed out again). (With indexes
/// kept mod 2²⁴, a word 2²⁴ − 1 windows old reads as the next window's:
/// it limits more, never less.)
#[inline(always)]
pub fn fixed_window(word: u64, now: u64, window_ns: u64, max: u64, cost: u64) -> Option<u64> {
    if window_ns == 0 {
        return None;
    }
    // Nothing to charge (a later fragment on a packet limit: its datagram
    // was counted at its first): passes and changes nothing.
    if cost == 0 {
        return Some(word);
    }
    let now_w = (now / window_ns) & FIXED_INDEX_MASK;
    let idx = word >> FIXED_COUNT_BITS;
    // (One test, so that the verifier's walk stays about as it was.)
    let (w, count) = if window_from(idx, now_w, FIXED_INDEX_MASK, word, FIXED_COUNT_MASK) <= 1 {
        (idx, word & FIXED_COUNT_MASK)
    } else {
        (now_w, 0)
    };
    let next = count + cost;
    if next > max {
        return None;
    }
    Some(w << FIXED_COUNT_BITS | next)
}

/// A fixed-window word with `cost` units given back: its count less them
/// (not below 0) if it is of `now`'s window or the next (as
/// [`fixed_window`] reads it), else the word as it is.
pub fn fixed_refund(word: u64, now: u64, window_ns: u64, cost: u64) -> u64 {
    let now_w = (now / window_ns.max(1)) & FIXED_INDEX_MASK;
    let idx = word >> FIXED_COUNT_BITS;
    if window_from(idx, now_w, FIXED_INDEX_MASK, word, FIXED_COUNT_MASK) > 1 {
        return word;
    }
    idx << FIXED_COUNT_BITS | (word & FIXED_COUNT_MASK).saturating_sub(cost)
}

/// A sliding-window word with `cost` units given back: its current count
/// less them (not below 0) if it is of `now`'s window or the next, else
/// the word as it is (a word of the window before keeps its count, which
/// now weighs as the previous window's: what passed then stays passed).
/// While the word's previous count is not 0 its current count stays at
/// least 1 (one unit not given back): a current count of 0 marks a word
/// of no window ([`window_from`]), which would forget the previous one.
pub fn sliding_refund(word: u64, now: u64, window_ns: u64, cost: u64) -> u64 {
    let now_w = (now / window_ns.max(1)) & 0xff;
    let idx = word >> (2 * SLIDE_BITS);
    if window_from(idx, now_w, 0xff, word, SLIDE_MASK) > 1 {
        return word;
    }
    let keep = u64::from((word >> SLIDE_BITS) & SLIDE_MASK != 0);
    (word & !SLIDE_MASK) | (word & SLIDE_MASK).saturating_sub(cost).max(keep)
}

/// The fixed-window word of a bucket that used its cap `max` in the window
/// of `now` (epoch ns): nothing more fits before the next window.
#[inline(always)]
pub fn fixed_drained(now: u64, window_ns: u64, max: u64) -> u64 {
    if window_ns == 0 {
        return 0;
    }
    let w = (now / window_ns) & FIXED_INDEX_MASK;
    w << FIXED_COUNT_BITS
        | if max < FIXED_COUNT_MASK {
            max
        } else {
            FIXED_COUNT_MASK
        }
}

/// Where window index `idx` of state `word` lies from now's window `now_w`
/// (indexes kept mod `mask + 1`): 0 now's, 1 the next one, `mask` the one
/// before, else another. A word whose current count (`count_mask`) is 0,
/// the never-charged word 0 above all, is never now's or the next:
/// without that, index 0 would read as the next window's once per wrap of
/// the index. (Every charge leaves a count of at least 1, and a sliding
/// refund keeps 1 while the previous count is not 0.) Without a branch:
/// BPF has no conditional move, and each branch here multiplies the
/// verifier's walk (the whole-word test `word == 0` walked 128,000 more
/// instructions than this one).
#[inline(always)]
const fn window_from(idx: u64, now_w: u64, mask: u64, word: u64, count_mask: u64) -> u64 {
    let never_charged = (word & count_mask).wrapping_sub(1) >> 63;
    (idx.wrapping_sub(now_w) & mask) | never_charged << 1
}

/// Sliding window: `[window index mod 2⁸ : 8 | previous : 28 | current : 28]`.
const SLIDE_BITS: u32 = 28;
const SLIDE_MASK: u64 = (1 << SLIDE_BITS) - 1;

/// Largest per-window cap a sliding window holds (in counted units; byte
/// limits are counted in units of `2^shift` bytes to fit).
pub const SLIDING_MAX: u64 = SLIDE_MASK;

/// One sliding-window step (the two-window weighted counter): the estimate
/// is `previous × (time left in the current window / window) + current`,
/// rounded up, and the packet passes if the estimate plus `cost` stays
/// within `max`.
///
/// As for [`fixed_window`], a word of the window after `now`'s is charged
/// in its own window, its previous count weighing in full (`now` is before
/// that window starts): time never goes back for a bucket. (With indexes
/// kept mod 2⁸, a word exactly 255 windows old reads so, and limits its
/// key for up to two windows more than it should, never less: own buckets
/// and cells are collected two windows after their last charge while a
/// daemon runs, but a rule's last resort lives as long as its rule.)
#[inline(always)]
pub fn sliding_window(word: u64, now: u64, window_ns: u64, max: u64, cost: u64) -> Option<u64> {
    if window_ns == 0 {
        return None;
    }
    // Nothing to charge (a later fragment on a packet limit) passes and
    // changes nothing: written, the first charge of a window would have
    // left a current count of 0, which reads as never charged, and the
    // previous window's count would have been forgotten.
    if cost == 0 {
        return Some(word);
    }
    let full = now / window_ns;
    let into = now - full * window_ns;
    let now_w = full & 0xff;
    let idx = word >> (2 * SLIDE_BITS);
    // Of now's window, of the next one (then all of its window is still
    // ahead: `into` 0), of the one before (255), or another.
    let d = window_from(idx, now_w, 0xff, word, SLIDE_MASK);
    let (w, prev, cur, into) = if d <= 1 {
        (
            idx,
            (word >> SLIDE_BITS) & SLIDE_MASK,
            word & SLIDE_MASK,
            into * (d ^ 1),
        )
    } else if d == 0xff {
        (now_w, word & SLIDE_MASK, 0, into)
    } else {
        (now_w, 0, 0, into)
    };
    // Fraction of the window still ahead, in 1/65536. Both terms are scaled
    // down for windows over 2⁴⁷ ns (39 h) so the shift cannot overflow.
    let s = if window_ns >> 47 != 0 { 16 } else { 0 };
    let left = (((window_ns - into) >> s) << 16) / (window_ns >> s).max(1);
    let weighted = (prev * left + 0xffff) >> 16;
    let next = cur + cost;
    if weighted + next > max {
        return None;
    }
    Some(w << (2 * SLIDE_BITS) | prev << SLIDE_BITS | next)
}

/// The sliding-window word of a bucket that used its cap `max` in the
/// window of `now` (epoch ns) and in the one before: nothing more fits
/// before the next window, where the previous count weighs in full.
#[inline(always)]
pub fn sliding_drained(now: u64, window_ns: u64, max: u64) -> u64 {
    if window_ns == 0 {
        return 0;
    }
    let w = (now / window_ns) & 0xff;
    let m = if max < SLIDE_MASK { max } else { SLIDE_MASK };
    w << (2 * SLIDE_BITS) | m << SLIDE_BITS | m
}

/// The window index `idx` names relative to index `current`, both kept mod
/// `2^bits`: the nearest such window, in `[-2^(bits-1), 2^(bits-1))`
/// windows (positive: after `current`).
#[inline(always)]
fn offset(current: u64, idx: u64, bits: u32) -> i64 {
    let half = 1i64 << (bits - 1);
    let d = (idx.wrapping_sub(current) & ((1 << bits) - 1)) as i64;
    if d < half {
        d
    } else {
        d - 2 * half
    }
}

/// How many windows index `idx` is behind index `now` when indexes are
/// kept mod `2^bits`: half that range or more, it is taken to be ahead
/// (`None`), a word of a later window than the one `now` names.
#[inline(always)]
fn behind(now: u64, idx: u64, bits: u32) -> Option<u64> {
    let o = offset(now, idx, bits);
    (o <= 0 && o > -(1i64 << (bits - 1))).then_some(o.unsigned_abs())
}

/// Whether a fixed-window word is over at `now` (epoch ns) and at every
/// later time: empty, or of a window strictly before `now`'s.
pub fn fixed_is_over(word: u64, now: u64, window_ns: u64) -> bool {
    let current = now / window_ns.max(1);
    word & FIXED_COUNT_MASK == 0
        || behind(current, word >> FIXED_COUNT_BITS, FIXED_INDEX_BITS).is_some_and(|d| d != 0)
}

/// Whether a sliding-window word is over at `now` (epoch ns) and at every
/// later time: empty, or of a window before the one before `now`'s (the
/// counts of such windows are never read).
pub fn sliding_is_over(word: u64, now: u64, window_ns: u64) -> bool {
    let current = now / window_ns.max(1);
    word & ((1 << (2 * SLIDE_BITS)) - 1) == 0
        || behind(current, word >> (2 * SLIDE_BITS), 8).is_some_and(|d| d >= 2)
}

/// How far the datapath's clock may lag the daemon's `CLOCK_MONOTONIC`: a
/// tick (10 ms at `HZ=100`) for limits on the tick clock. A merge of window
/// words waits until this long into its window
/// (`LimitEntry::merge_wait_ns`), so that the datapath is in the window the
/// daemon reads; and the daemon reads its clock after the words, so no word
/// is of a later window than that.
pub const MERGE_SETTLE_NS: u64 = 10_000_000;

/// Which of two words' windows (`ia`, `ib`, kept mod `2^bits`) is the later
/// in real time, judged at `now` (epoch ns, read after both words, at least
/// [`MERGE_SETTLE_NS`] into its window): each index is taken as the window
/// nearest `now`'s, and one that would lie after `now`'s is a stale word
/// whose index wrapped around: its window is long over. Returns `(a is the
/// later, windows between them)`, the distance `None` when one of them is
/// such a stale word or both are. (A stale word that wraps to `now`'s window
/// or the one before is taken as live, as the datapath reads it: it limits
/// more, never less.)
fn later_window(ia: u64, ib: u64, now: u64, window_ns: u64, bits: u32) -> (bool, Option<u64>) {
    let current = now / window_ns.max(1);
    let (oa, ob) = (offset(current, ia, bits), offset(current, ib, bits));
    match (oa <= 0, ob <= 0) {
        (true, true) => (oa >= ob, Some(oa.abs_diff(ob))),
        (a_real, _) => (a_real, None),
    }
}

/// Two fixed-window words of one limit, judged at `now` (epoch ns), as one
/// that allows no more than either, now and later: of one window, the larger
/// count; of two, the later window's word (the other's count is never read
/// again once the datapath is in the later window, and it is: it wrote that
/// word). The clock (see [`later_window`]) tells which window is the later
/// when indexes have wrapped.
pub fn fixed_merge(a: u64, b: u64, now: u64, window_ns: u64) -> u64 {
    let count = |x: u64| x & FIXED_COUNT_MASK;
    if count(a) == 0 || count(b) == 0 {
        return if count(a) == 0 { b } else { a };
    }
    let (ia, ib) = (a >> FIXED_COUNT_BITS, b >> FIXED_COUNT_BITS);
    if ia == ib {
        return ia << FIXED_COUNT_BITS | count(a).max(count(b));
    }
    if later_window(ia, ib, now, window_ns, FIXED_INDEX_BITS).0 {
        a
    } else {
        b
    }
}

/// [`fixed_merge`] for sliding-window words: of one window, the larger of
/// each count; one window apart, the later window's word with the earlier
/// one's count as its previous where that is larger; further apart, the
/// later word.
pub fn sliding_merge(a: u64, b: u64, now: u64, window_ns: u64) -> u64 {
    let live = |x: u64| x & ((1 << (2 * SLIDE_BITS)) - 1) != 0;
    if !live(a) || !live(b) {
        return if live(a) { a } else { b };
    }
    let split = |x: u64| {
        (
            x >> (2 * SLIDE_BITS),
            (x >> SLIDE_BITS) & SLIDE_MASK,
            x & SLIDE_MASK,
        )
    };
    let ((ia, pa, ca), (ib, pb, cb)) = (split(a), split(b));
    let word = |i: u64, p: u64, c: u64| i << (2 * SLIDE_BITS) | p << SLIDE_BITS | c;
    if ia == ib {
        return word(ia, pa.max(pb), ca.max(cb));
    }
    match later_window(ia, ib, now, window_ns, 8) {
        (true, Some(1)) => word(ia, pa.max(cb), ca),
        (false, Some(1)) => word(ib, pb.max(ca), cb),
        (true, _) => a,
        (false, _) => b,
    }
}

#[cfg(test)]
mod tests {
    extern crate std;
    use super::*;
    use proptest::prelude::*;
    use std::vec::Vec;

    const SEC: u64 = 1_000_000_000;

    fn run(step: impl Fn(u64, u64) -> Option<u64>, times: &[u64]) -> Vec<u64> {
        let mut word = 0;
        let mut passed = Vec::new();
        for &t in times {
            if let Some(w) = step(word, t) {
                word = w;
                passed.push(t);
            }
        }
        passed
    }

    #[test]
    fn fixed_window_resets_on_epoch_aligned_boundaries() {
        let times: Vec<u64> = (0..100)
            .map(|i| 1_000 * SEC + 990_000_000 + i * 1_000_000)
            .collect();
        // 10 ms before the boundary at 1001 s, then 90 ms after it.
        let passed = run(|w, t| fixed_window(w, t, SEC, 5, 1), &times);
        assert_eq!(passed.len(), 10, "5 before the boundary, 5 after");
        assert!(
            passed[5] >= 1_001 * SEC,
            "the 6th passes only in the new window"
        );
        assert_eq!(
            fixed_window(0, 7 * SEC, SEC, 4, 5),
            None,
            "a cost above the cap never passes"
        );
    }

    #[test]
    fn sliding_window_weights_the_previous_window() {
        // 100 passed in window 10; at 10.5 windows half of them still count.
        let w = sliding_window(0, 10 * SEC, SEC, 100, 100).unwrap();
        let mut word = w;
        let mut n = 0;
        while let Some(next) = sliding_window(word, 11 * SEC + SEC / 2, SEC, 100, 1) {
            word = next;
            n += 1;
        }
        assert_eq!(n, 50);
        // Two windows later nothing of it counts.
        assert!(sliding_window(w, 12 * SEC + 1, SEC, 100, 100).is_some());
    }

    proptest! {
        /// A step of cost 0 (a later fragment on a packet limit) passes and
        /// changes nothing, whatever the word and the time: as the first
        /// charge of a window it wrote a current count of 0, which reads
        /// as never charged, so the previous window's count was forgotten.
        #[test]
        fn a_step_of_cost_zero_changes_nothing(word in any::<u64>(), now in 0u64..1 << 62, window in 1u64..1 << 40, max in 0u64..1 << 20) {
            prop_assert_eq!(sliding_window(word, now, window, max, 0), Some(word));
            prop_assert_eq!(fixed_window(word, now, window, max, 0), Some(word));
        }
    }

    #[test]
    fn a_later_fragment_never_forgets_the_previous_window() {
        // 100 in window 10; a zero-cost step early in window 11; the next
        // packets still meet window 10's count at about 99%.
        let w = sliding_window(0, 10 * SEC, SEC, 100, 100).unwrap();
        let w = sliding_window(w, 11 * SEC + SEC / 100, SEC, 100, 0).unwrap();
        assert_eq!(sliding_window(w, 11 * SEC + SEC / 100, SEC, 100, 2), None);
    }

    #[test]
    fn a_clock_read_a_little_behind_never_restarts_a_windows_count() {
        // Window 11 used up (another CPU, or the clock before a restart),
        // then a read 2 ms before it starts: charged against window 11.
        let (max, at, behind) = (5, 11 * SEC + 1_000_000, 11 * SEC - 2_000_000);
        let full = (0..max).fold(0, |w, _| fixed_window(w, at, SEC, max, 1).unwrap());
        assert_eq!(
            fixed_window(full, behind, SEC, max, 1),
            None,
            "fixed: the count of window 11 stands"
        );
        let one = fixed_window(0, at, SEC, max, 1).unwrap();
        let two = fixed_window(one, behind, SEC, max, 1).unwrap();
        assert_eq!(two >> FIXED_COUNT_BITS, 11, "fixed: still window 11's word");
        assert_eq!(two & FIXED_COUNT_MASK, 2);
        assert!(
            fixed_window(full, 12 * SEC, SEC, max, 1).is_some(),
            "fixed: window 12 starts afresh"
        );
        let full = (0..max).fold(0, |w, _| sliding_window(w, at, SEC, max, 1).unwrap());
        assert_eq!(
            sliding_window(full, behind, SEC, max, 1),
            None,
            "sliding: the count of window 11 stands"
        );
        // Ahead, its previous count weighs in full: 3 of window 10 and 2
        // more in window 11 (charged early) leave none for the 6th.
        let w = sliding_window(0, 10 * SEC + 1, SEC, max, 3).unwrap();
        let w = sliding_window(w, at, SEC, max, 2).unwrap();
        assert_eq!(
            sliding_window(w, behind, SEC, max, 1),
            None,
            "sliding: window 10's 3 weigh in full"
        );
        // A word never charged is of no window, even where its index 0
        // is the next window's: its first charge counts in now's window.
        let first = fixed_window(0, ((1 << 24) - 1) * SEC, SEC, max, max).unwrap();
        assert_eq!(first >> FIXED_COUNT_BITS, (1 << 24) - 1);
        let first = sliding_window(0, 255 * SEC, SEC, max, max).unwrap();
        assert_eq!(first >> (2 * SLIDE_BITS), 255);
    }

    /// A refund never forgets a sliding word's previous count: with it
    /// not 0, the current count stays at least 1.
    #[test]
    fn a_sliding_refund_keeps_the_previous_windows_count() {
        let w = sliding_window(0, 10 * SEC, SEC, 10, 8).unwrap();
        let w = sliding_window(w, 11 * SEC, SEC, 10, 2).unwrap();
        let refunded = sliding_refund(w, 11 * SEC, SEC, 5);
        assert_eq!(
            (refunded >> SLIDE_BITS) & SLIDE_MASK,
            8,
            "window 10's 8 kept"
        );
        assert_eq!(
            refunded & SLIDE_MASK,
            1,
            "one unit kept so the word stays of window 11"
        );
        assert_eq!(
            sliding_window(refunded, 11 * SEC, SEC, 10, 2),
            None,
            "8 + 1 of 10: 2 more do not fit"
        );
        assert_eq!(
            fixed_refund(
                fixed_window(0, 11 * SEC, SEC, 10, 3).unwrap(),
                11 * SEC,
                SEC,
                5
            ) & FIXED_COUNT_MASK,
            0
        );
    }

    #[test]
    fn a_merge_takes_the_later_window_when_indexes_wrapped() {
        // A 1 s sliding window: 129 windows keep an index 127 windows
        // "ahead" mod 256, and 255 windows one "ahead". The later word is
        // the one just charged.
        let w = SEC;
        let now = 1_000 * SEC + SEC / 2;
        let new = sliding_window(0, now, w, 1, 1).unwrap();
        for back in [129, 255, 256 + 2] {
            let old = sliding_window(0, now - back * w, w, 1, 1).unwrap();
            assert_eq!(sliding_merge(old, new, now, w), new, "{back} windows back");
            assert_eq!(sliding_merge(new, old, now, w), new, "{back} windows back");
        }
        // The daemon reads its clock after the words: one of a later
        // window than its clock's is a stale word wrapped around.
        let ahead = sliding_window(0, now + w, w, 1, 1).unwrap();
        assert_eq!(sliding_merge(ahead, new, now, w), new);
        assert_eq!(sliding_merge(new, ahead, now, w), new);
        // A 20 ms window (the arithmetic takes any length).
        let w = 20_000_000;
        let now = 1_000 * SEC;
        let old = sliding_window(0, now - 129 * w, w, 1, 1).unwrap();
        let new = sliding_window(0, now, w, 1, 1).unwrap();
        assert_eq!(sliding_merge(old, new, now, w), new);
        assert_eq!(sliding_merge(new, old, now, w), new);
        assert!(
            sliding_window(sliding_merge(old, new, now, w), now + 1, w, 1, 1).is_none(),
            "the merge still holds the limit"
        );
        // One window apart, the earlier count becomes the previous one.
        let prev = sliding_window(0, now - w, w, 5, 3).unwrap();
        let m = sliding_merge(new, prev, now, w);
        assert_eq!((m >> SLIDE_BITS) & SLIDE_MASK, 3);
        assert_eq!(m & SLIDE_MASK, 1);
        // Fixed windows of 1 µs wrap their 24-bit index every 16.8 s.
        let w = 1_000;
        let old = fixed_window(0, now - (1 << 23) * w - 5 * w, w, 1, 1).unwrap();
        let new = fixed_window(0, now, w, 1, 1).unwrap();
        assert_eq!(fixed_merge(old, new, now, w), new);
        assert_eq!(fixed_merge(new, old, now, w), new);
    }

    proptest! {
        /// Fixed window: no window ever passes more than `max`.
        #[test]
        fn fixed_window_never_exceeds_its_cap(
            max in 1u64..500,
            gaps in proptest::collection::vec(0u64..20_000_000, 1..3000),
        ) {
            let mut t = 1_700_000_000 * SEC;
            let times: Vec<u64> = gaps.iter().map(|g| { t += g; t }).collect();
            let passed = run(|w, t| fixed_window(w, t, SEC, max, 1), &times);
            let mut per_window = std::collections::BTreeMap::new();
            for p in passed { *per_window.entry(p / SEC).or_insert(0u64) += 1; }
            prop_assert!(per_window.values().all(|&n| n <= max));
        }

        /// Clocks read a little out of order (CPUs racing at a boundary, a
        /// restart's clock a few ms behind): a word's window never goes
        /// back, so no window is opened twice and none passes more than
        /// `max`.
        #[test]
        fn windows_never_go_back_for_a_clock_read_out_of_order(
            max in 1u64..50,
            steps in proptest::collection::vec((0u64..20_000_000, 0u64..5_000_000), 1..3000),
            sliding in any::<bool>(),
        ) {
            let mut t = 1_700_000_000 * SEC;
            let (mut word, mut last, mut per_window) = (0u64, 0u64, std::collections::BTreeMap::new());
            let idx_bits = if sliding { 2 * SLIDE_BITS } else { FIXED_COUNT_BITS };
            for (gap, jitter) in steps {
                t += gap;
                let read = t - jitter;
                let next = if sliding { sliding_window(word, read, SEC, max, 1) } else { fixed_window(word, read, SEC, max, 1) };
                if let Some(w) = next {
                    // The word's window, as an absolute index near `t`'s.
                    let low = (t / SEC).wrapping_sub(1);
                    let mask = (1u64 << (64 - idx_bits)) - 1;
                    let abs = low + (((w >> idx_bits) & mask).wrapping_sub(low) & mask);
                    prop_assert!(abs >= last, "window {} after {}", abs, last);
                    last = abs;
                    *per_window.entry(abs).or_insert(0u64) += 1;
                    word = w;
                }
            }
            prop_assert!(per_window.values().all(|&n| n <= max));
        }

        /// Sliding window, the documented bound: every fixed window passes at
        /// most `max`, so any span of one window length passes at most
        /// `2 × max`; and for a steady flood far above the limit, each window
        /// passes `max` within 1% (+1).
        #[test]
        fn sliding_window_meets_its_bounds(
            max in 10u64..2000,
            offered_per_window in 2u64..6,
            windows in 3u64..6,
        ) {
            let start = 1_700_000_000 * SEC;
            let n = max * offered_per_window * windows;
            let gap = windows * SEC / n;
            let times: Vec<u64> = (0..n).map(|i| start + i * gap).collect();
            let passed = run(|w, t| sliding_window(w, t, SEC, max, 1), &times);
            // Any span of one window, starting at each passed packet.
            let mut end = 0;
            for (i, &t) in passed.iter().enumerate() {
                while end < passed.len() && passed[end] < t + SEC { end += 1; }
                let inside = (end - i) as u64;
                prop_assert!(inside <= 2 * max, "{} in one window span, max {}", inside, max);
            }
            // Steady state: after the first window, each window passes ≈ max.
            for w in 1..windows {
                let k = passed.iter().filter(|&&t| (t - start) / SEC == w).count() as u64;
                prop_assert!(k.abs_diff(max) <= max / 100 + 1, "window {}: {} passed, max {}", w, k, max);
            }
        }
    }
}
