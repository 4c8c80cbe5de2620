//! Prefix cells: where an unseen key is charged when it gets no bucket of
//! its own (see [`crate::pressure`]), kept in a fixed array per family
//! rather than in the sources' hash table.
//!
//! A random-source flood charges every packet to some cell, so the cell's
//! lookup is the flood's per-packet cost. In the sources' table it was a
//! hash-table walk (a call, the hash, the bucket head and the element: two
//! cache misses in memory sized for a million sources); here it is one
//! load of the cell's 64-byte line, at an index the program computes
//! (array lookups are inlined by the verifier).
//!
//! The array is set-associative: a cell key may sit in either of the
//! [`CELL_WAYS`] slots of its set. A slot is free while its `claim` word is
//! 0. The program claims a free slot with a compare-and-swap, then writes
//! the bucket (a copy of what the key mapped to until then: its rule's last
//! resort) and last the key; a key is charged to a slot only if the slot is
//! claimed and holds that very key. A key whose set is full of other cells
//! is charged to its rule's last resort, as when the cells' room is spent.
//! The daemon frees slots whose bucket is fresh again (the same rule as for
//! any bucket), through the array's mapped memory, in two steps so that no
//! charge is lost: it turns a fresh cell's claim into [`cell_dying`] (no
//! program run finds the cell from then on), waits out every run in flight
//! (one may have found the cell just before), and reads the bucket again:
//! still fresh, it clears the key and then the claim (the slot is free);
//! charged meanwhile, it turns the claim back and the cell lives on.
//!
//! What a program run makes of a way of the key's set ([`cell_way`]):
//!
//! | claim word | key | meaning | the run |
//! | --- | --- | --- | --- |
//! | `cell_claim(key)` | `key` | the key's cell | charges it |
//! | `cell_claim(key)` | other | being claimed (key not written yet) or cleared | charges the parent, claims nothing |
//! | `cell_dying(key)` | any | the key's cell, being freed | charges the parent, claims nothing |
//! | 0 | any | free | may claim it |
//! | other | any | another key's cell | looks at the next way |
//!
//! "Claims nothing" keeps one cell per key: a second run that claimed the
//! other way while the first cell is being written (or freed, and then
//! turned back) would split the key's charges over two buckets.

use crate::{Bucket, Key4, Key6, KnownKey};

/// IPv4 cells: `Array<Cell<Key4>>`, [`cell_slots`] entries, mappable.
pub const MAP_CELLS_V4: &str = "RL_CELL4";
/// IPv6 cells: `Array<Cell<Key6>>`, [`cell_slots`] entries, mappable.
pub const MAP_CELLS_V6: &str = "RL_CELL6";

/// Cells claimed per family (`Array<u64>`, entries 0 IPv4 and 1 IPv6,
/// mappable): the program adds one per claim, the collector stores the
/// exact count after each pass. Only a hint (see [`cells_saturated`]).
pub const MAP_CELL_COUNT: &str = "RL_CELLN";

/// Whether an array of `slots` holding `claimed` cells is so full that a
/// cell key the known-keys filter does not hold skips reading its set:
/// with two ways at half load, a set is full for one new prefix in four,
/// and a flood over more prefixes than that would pay a set read (a miss
/// in memory sized for `2 × flood_prefixes` lines) only to learn that its
/// cell does not exist and cannot be made. Such keys go to their rule's
/// last resort, as when the cells' room is spent. The program sets a cell
/// key's filter bits before it claims, so the filter never hides a cell.
#[inline(always)]
pub fn cells_saturated(claimed: u64, slots: u32) -> bool {
    claimed.saturating_mul(2) >= slots as u64
}

/// Slots a cell key may use.
pub const CELL_WAYS: u32 = 2;

/// One slot: 64 bytes, one cache line.
#[repr(C, align(64))]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Cell<K> {
    /// 0: free. Otherwise [`cell_claim`] of the key it holds (or is being
    /// given: the key is written after the bucket).
    pub claim: u64,
    pub bucket: Bucket,
    /// The cell key (`KEY_CELL` set, the address masked to the cell prefix).
    pub key: K,
}
const _: () = assert!(core::mem::size_of::<Cell<Key4>>() == 64);
const _: () = assert!(core::mem::size_of::<Cell<Key6>>() == 64);
/// Byte offset of [`Cell::claim`] (the daemon's atomics reach it in mapped memory).
pub const CELL_CLAIM_OFFSET: usize = 0;
/// Byte offset of the bucket's state word.
pub const CELL_TAT_OFFSET: usize = 8;

/// Slots per family for `datapath.flood_prefixes`: twice that, rounded up to
/// a power of two, so that sets rarely overflow while the cells in use stay
/// within `flood_prefixes`.
pub const fn cell_slots(flood_prefixes: u32) -> u32 {
    let want = if flood_prefixes < 1 << 24 { flood_prefixes } else { 1 << 24 };
    let n = (want as u64 * 2).next_power_of_two();
    if n < CELL_WAYS as u64 {
        CELL_WAYS
    } else {
        n as u32
    }
}

/// The first slot of `key`'s set in an array of `slots` (a power of two).
#[inline(always)]
pub fn cell_set<K: KnownKey>(key: &K, slots: u32) -> u32 {
    // The high half: the known-keys filter takes its bits from the low one.
    ((key.known_hash() >> 32) as u32 & (slots - 1)) & !(CELL_WAYS - 1)
}

/// The nonzero claim word of a slot holding `key`.
#[inline(always)]
pub fn cell_claim<K: KnownKey>(key: &K) -> u64 {
    key.known_hash() | 1
}

/// The claim word of `key`'s cell while the daemon frees it: even, so never
/// a claim, and never 0, so never free.
#[inline(always)]
pub fn cell_dying<K: KnownKey>(key: &K) -> u64 {
    (cell_claim(key) & !3) | 2
}

/// What one way of a set is to a key (see the module doc).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Way {
    /// The key's cell: charge it.
    Holds,
    /// The key's cell is being claimed or freed: charge the parent, claim
    /// nothing.
    Busy,
    /// Free: the key may claim it.
    Free,
    /// Another key's cell.
    Other,
}

/// Classifies a way whose claim word reads `held` and whose key equals the
/// key's (`key_matches`, read after `held`) for a key with claim `claim`
/// and dying word `dying`.
#[inline(always)]
pub fn cell_way(held: u64, key_matches: bool, claim: u64, dying: u64) -> Way {
    if held == claim {
        if key_matches {
            Way::Holds
        } else {
            Way::Busy
        }
    } else if held == dying {
        Way::Busy
    } else if held == 0 {
        Way::Free
    } else {
        Way::Other
    }
}

#[cfg(feature = "user")]
mod pod {
    unsafe impl aya::Pod for super::Cell<super::Key4> {}
    unsafe impl aya::Pod for super::Cell<super::Key6> {}
}

#[cfg(test)]
mod tests {
    extern crate std;
    use super::*;
    use crate::KEY_CELL;

    #[test]
    fn saturation_is_half_the_slots() {
        assert!(!cells_saturated(0, 2) && cells_saturated(1, 2));
        assert!(!cells_saturated(65_535, 131_072) && cells_saturated(65_536, 131_072));
        assert!(cells_saturated(u64::MAX, u32::MAX));
    }

    #[test]
    fn slots_are_twice_the_prefixes_in_a_power_of_two() {
        assert_eq!(cell_slots(1), 2);
        assert_eq!(cell_slots(256), 512);
        assert_eq!(cell_slots(65_536), 131_072);
        assert_eq!(cell_slots(100_000), 262_144);
        assert_eq!(cell_slots(16_777_216), 33_554_432);
        assert_eq!(cell_slots(u32::MAX), 33_554_432);
    }

    #[test]
    fn a_random_flood_of_as_many_prefixes_as_configured_mostly_finds_room() {
        // 65,536 /24 cells of one rule into cell_slots(65,536): the share
        // that finds its set full (charged to the last resort instead).
        let slots = cell_slots(65_536);
        let mut used = std::vec![0u8; slots as usize / CELL_WAYS as usize];
        let mut overflow = 0;
        for i in 0..65_536u32 {
            let k = Key4 { rule: 8 | KEY_CELL, addr: (10 << 24 | i << 8).to_be() };
            let set = cell_set(&k, slots);
            assert_eq!(set % CELL_WAYS, 0);
            assert!(set < slots);
            let u = &mut used[(set / CELL_WAYS) as usize];
            if u32::from(*u) < CELL_WAYS {
                *u += 1;
            } else {
                overflow += 1;
            }
        }
        // Two ways at half load: about 10% expected.
        assert!(overflow < 65_536 / 8, "{overflow} of 65,536 found no room");
        assert!(cell_claim(&Key6::default()) != 0);
    }

    #[test]
    fn a_dying_word_is_never_free_nor_any_key_claim() {
        for i in 0..100_000u32 {
            let k = Key4 { rule: 8 | KEY_CELL, addr: i.wrapping_mul(0x9e37_79b9) };
            let d = cell_dying(&k);
            assert!(d != 0 && d % 2 == 0 && d != cell_claim(&k));
        }
    }

    #[test]
    fn a_way_is_the_keys_only_when_claimed_with_its_key_written() {
        let (c, d) = (0x1234_5679, 0x1234_567a);
        assert_eq!(cell_way(c, true, c, d), Way::Holds);
        assert_eq!(cell_way(c, false, c, d), Way::Busy, "claimed, key not written yet");
        assert_eq!(cell_way(d, true, c, d), Way::Busy, "being freed");
        assert_eq!(cell_way(d, false, c, d), Way::Busy);
        assert_eq!(cell_way(0, true, c, d), Way::Free, "a freed slot's stale key does not count");
        assert_eq!(cell_way(0x77, true, c, d), Way::Other);
    }
}

