//! The filter of keys that own a bucket: one bit per hashed key, small
//! enough to stay in the CPU's cache, so that a key the bucket tables do not
//! hold costs one cached load instead of a hash-table miss in memory sized
//! for `max_sources` (a random-source flood makes every such lookup a miss).
//!
//! A clear bit is a promise: "no bucket of this key exists" (a source's own
//! bucket or a prefix cell, see [`crate::cells`]; last resorts are always
//! looked up). A set bit
//! promises nothing (hash collisions, buckets deleted since). So the XDP
//! program may skip the table lookup of a key whose bit is clear, and must
//! look up the rest. The promise is kept by:
//!
//! - the XDP program setting the key's bit *before* it inserts a bucket
//!   (the daemon never inserts buckets): in the half it reads, and while a
//!   rebuild is under way ([`KNOWN_REBUILDING`]) in the other half too;
//! - the daemon rebuilding the half the program does not read, during the
//!   collector's walk: it sets [`KNOWN_REBUILDING`], zeroes that half,
//!   waits out every program run in flight, sets the bit of every bucket
//!   the walk keeps, then flips the halves (which clears the flag). A
//!   bucket inserted during the walk has its bit set by the program in the
//!   half being rebuilt; one present before is found by the walk, and so is
//!   one whose run read the control word before the flag (it ended within
//!   the wait). Deleted buckets' bits go away with the rebuild. Outside a
//!   rebuild the other half is never read and is zeroed before it is built,
//!   so the program leaves it alone: an insert or a cell's claim touches
//!   one line of the filter, not two (in a flood's first second, about
//!   60,000 claims, each of whose second line was a miss in memory).
//! - a control word that starts at 0 ("not valid": look everything up) in a
//!   fresh map, until the daemon's first complete walk.
//!
//! Layout of [`MAP_KNOWN`] (`Array<u64>`, `BPF_F_MMAPABLE`, so the daemon
//! sets bits with atomic ORs on mapped memory, never losing one the program
//! sets in the same word): word 0 is the control word ([`KNOWN_VALID`] | the
//! half read), then four regions of [`KNOWN_WORDS`] words: IPv4 half 0,
//! IPv4 half 1, IPv6 half 0, IPv6 half 1. A key owns two bits of one word.

use crate::{Key4, Key6};

/// The filter (see the module doc).
pub const MAP_KNOWN: &str = "RL_KNOWN";
/// Log₂ of the 64-bit words per family and half: 65,536 words, 4,194,304
/// bits, 512 KiB. Each key sets two bits of one word (a word-blocked Bloom
/// filter: one memory access, fewer false "maybe"s than one bit per key).
/// With k own buckets and cells in a family, about 2k of the bits are set,
/// and a key without a bucket still pays the lookup with probability about
/// (2k / 4,194,304)²: 0.2% for 100,000 buckets, 25% for a full default
/// table of 1,048,576 (then the filter saves less, and costs one load).
pub const KNOWN_WORDS_LOG2: u32 = 16;
/// Words per family and half.
pub const KNOWN_WORDS: u32 = 1 << KNOWN_WORDS_LOG2;
/// Entries of [`MAP_KNOWN`].
pub const KNOWN_ENTRIES: u32 = 1 + 4 * KNOWN_WORDS;
/// Control-word bit: the filter has been rebuilt by a complete walk since
/// the map was created, so clear bits may be trusted.
pub const KNOWN_VALID: u64 = 2;
/// Control-word bit: the half the program reads.
pub const KNOWN_HALF: u64 = 1;
/// Control-word bit: the daemon is rebuilding the other half, so the
/// program sets a new key's bits in both halves.
pub const KNOWN_REBUILDING: u64 = 4;

/// The halves the program sets a new key's bits in, under control word
/// `ctl`: the one it reads, and the other one during a rebuild.
#[inline(always)]
pub const fn known_marked_halves(ctl: u64) -> u32 {
    if ctl & KNOWN_REBUILDING != 0 {
        2
    } else {
        1
    }
}

/// MurmurHash3's 64-bit finalizer: every input bit moves every output bit,
/// whatever the keys' structure (multiplicative hashing alone collided on
/// addresses that differ only in their high bytes).
#[inline(always)]
const fn fmix(mut x: u64) -> u64 {
    x ^= x >> 33;
    x = x.wrapping_mul(0xff51_afd7_ed55_8ccd);
    x ^= x >> 33;
    x = x.wrapping_mul(0xc4ce_b9fe_1a85_ec53);
    x ^ (x >> 33)
}

/// A bucket key the filter covers.
pub trait KnownKey {
    /// 0 for IPv4, 1 for IPv6.
    const FAMILY: u32;
    /// The key's hash: its word is the top bits, its two bits the low 12.
    fn known_hash(&self) -> u64;
    /// The hash a prefix cell's slot and claim word come from
    /// (`rl_common::cells`), keyed by the datapath's secret `seed`: the
    /// claim word alone names the cell's key, so no one who does not know
    /// the seed may make two keys share it (or fill a key's set).
    fn cell_hash(&self, seed: u64) -> u64;
}

impl KnownKey for Key4 {
    const FAMILY: u32 = 0;
    #[inline(always)]
    fn known_hash(&self) -> u64 {
        fmix((self.rule as u64) << 32 | self.addr as u64)
    }

    /// A bijection of the key for any seed: no two keys share it.
    #[inline(always)]
    fn cell_hash(&self, seed: u64) -> u64 {
        fmix(((self.rule as u64) << 32 | self.addr as u64) ^ seed)
    }
}

impl KnownKey for Key6 {
    const FAMILY: u32 = 1;
    #[inline(always)]
    fn known_hash(&self) -> u64 {
        let a = &self.addr;
        let x = fmix(self.rule as u64 ^ ((a[0] as u64) << 32 | a[1] as u64));
        fmix(x ^ ((a[2] as u64) << 32 | a[3] as u64))
    }

    /// The address through the seeded rounds first, the rule last: in
    /// `known_hash` the rule and the address's second word are XORed
    /// first, so `(r, w)` and `(r ^ d, w ^ d)` collide (a filter's false
    /// "maybe", harmless; a cell's claim, not), and without a secret seed
    /// any such chain of invertible rounds yields collisions on demand.
    #[inline(always)]
    fn cell_hash(&self, seed: u64) -> u64 {
        let a = &self.addr;
        let x = fmix(((a[0] as u64) << 32 | a[1] as u64) ^ seed);
        let x = fmix(x ^ ((a[2] as u64) << 32 | a[3] as u64));
        fmix(x ^ self.rule as u64 ^ seed.rotate_left(32))
    }
}

/// The first [`MAP_KNOWN`] index of `family`'s `half`.
#[inline(always)]
pub const fn known_region(family: u32, half: u32) -> u32 {
    1 + (family * 2 + (half & 1)) * KNOWN_WORDS
}

/// The [`MAP_KNOWN`] index of the word of the key with `hash` in
/// `family`'s `half`.
#[inline(always)]
pub const fn known_word(family: u32, half: u32, hash: u64) -> u32 {
    known_region(family, half) + (hash >> (64 - KNOWN_WORDS_LOG2)) as u32
}

/// The key's two bits within its word.
#[inline(always)]
pub const fn known_mask(hash: u64) -> u64 {
    1 << (hash & 63) | 1 << ((hash >> 6) & 63)
}

/// Whether `word` holds both bits of the key with `hash`: false means the
/// key surely owns no bucket (the one test the program and the daemon make).
#[inline(always)]
pub const fn known_holds(word: u64, hash: u64) -> bool {
    let mask = known_mask(hash);
    word & mask == mask
}

#[cfg(test)]
mod tests {
    extern crate std;
    use super::*;

    #[test]
    fn words_stay_inside_the_map_and_families_and_halves_do_not_overlap() {
        let mut seen = [(0u32, 0u32); 4];
        for family in 0..2 {
            for half in 0..2 {
                let r = (
                    known_word(family, half, 0),
                    known_word(family, half, u64::MAX),
                );
                assert!(r.0 >= 1 && r.1 < KNOWN_ENTRIES);
                assert_eq!(r.0, known_region(family, half));
                assert_eq!(r.1 - r.0 + 1, KNOWN_WORDS);
                seen[(family * 2 + half) as usize] = r;
            }
        }
        for w in seen.windows(2) {
            assert_eq!(w[0].1 + 1, w[1].0);
        }
    }

    #[test]
    fn sequential_and_prefix_keys_spread_over_the_words_and_bits() {
        // The TestRun bench salts the low bits; a flood sweeps /24s.
        // Addresses are network order read as native words: the bytes
        // that vary sit in the low bits, the high bits or the middle. Each
        // must spread, or the filter says "maybe" for most unseen keys.
        let mut places = std::collections::HashSet::new();
        let place = |h: u64| (h >> (64 - KNOWN_WORDS_LOG2), known_mask(h));
        for i in 0..65_536u32 {
            places.insert(place(Key4 { rule: 8, addr: i }.known_hash()));
            places.insert(place(
                Key4 {
                    rule: 8,
                    addr: 0x4d0a | i << 16,
                }
                .known_hash(),
            ));
            places.insert(place(
                Key4 {
                    rule: 8 | crate::KEY_CELL,
                    addr: i << 8,
                }
                .known_hash(),
            ));
            places.insert(place(
                Key6 {
                    rule: 8,
                    addr: [0x2001_0db8, i, 0, 0],
                }
                .known_hash(),
            ));
            places.insert(place(
                Key6 {
                    rule: 8,
                    addr: [0xb80d_0120, i << 16, 0, 0],
                }
                .known_hash(),
            ));
        }
        // A random function would hit m(1 − e^(−n/m)) distinct places
        // (word, two bits: about 2¹⁶ × 2¹² of them).
        let (n, m) = (5.0 * 65_536.0, (1u64 << (KNOWN_WORDS_LOG2 + 12)) as f64);
        let random = m * (1.0 - (-n / m).exp());
        assert!(
            places.len() as f64 > 0.99 * random,
            "{} distinct places, a random hash would give {random:.0}",
            places.len()
        );
        let words: std::collections::HashSet<_> = places.iter().map(|p| p.0).collect();
        assert!(
            words.len() as u32 > KNOWN_WORDS * 99 / 100,
            "{} of {KNOWN_WORDS} words used",
            words.len()
        );
    }
}
