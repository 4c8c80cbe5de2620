//! The filter of keys that own a bucket: one bit per hashed key, small
//! enough to stay in the CPU's cache, so that a key the bucket tables do not
//! hold costs one cached load instead of a hash-table miss in memory sized
//! for `max_sources` (a random-source flood makes every such lookup a miss).
//!
//! A clear bit is a promise: "no bucket of this key exists" (a source's own
//! bucket or a prefix cell; last resorts are always looked up). A set bit
//! promises nothing (hash collisions, buckets deleted since). So the XDP
//! program may skip the table lookup of a key whose bit is clear, and must
//! look up the rest. The promise is kept by:
//!
//! - the XDP program setting the key's bit, in both halves, *before* it
//!   inserts a bucket; the daemon never inserts buckets;
//! - the daemon rebuilding the half the program does not read, during the
//!   collector's walk: it zeroes that half, waits out every program run in
//!   flight, sets the bit of every bucket the walk keeps, then flips the
//!   halves. A bucket inserted during the walk has its bit set by the
//!   program in the half being rebuilt; one present before is found by the
//!   walk. Deleted buckets' bits go away with the rebuild.
//! - a control word that starts at 0 ("not valid": look everything up) in a
//!   fresh map, until the daemon's first complete walk.
//!
//! Layout of [`MAP_KNOWN`] (`Array<u64>`, `BPF_F_MMAPABLE`, so the daemon
//! sets bits with atomic ORs on mapped memory, never losing one the program
//! sets in the same word): word 0 is the control word ([`KNOWN_VALID`] | the
//! half read), then four regions of [`KNOWN_WORDS`] words: IPv4 half 0,
//! IPv4 half 1, IPv6 half 0, IPv6 half 1.

use crate::{Key4, Key6};

/// The filter (see the module doc).
pub const MAP_KNOWN: &str = "RL_KNOWN";
/// Log₂ of the bits per family and half: 2,097,152 bits, 256 KiB, which a
/// server core's L2 cache holds. With k own buckets and cells in a family,
/// a key without one finds its bit set (and pays the lookup anyway) with
/// probability 1 − e^(−k / 2,097,152): 4.7% for 100,000 buckets, 39% for a
/// full default table of 1,048,576.
pub const KNOWN_BITS_LOG2: u32 = 21;
/// Words per family and half.
pub const KNOWN_WORDS: u32 = 1 << (KNOWN_BITS_LOG2 - 6);
/// Entries of [`MAP_KNOWN`].
pub const KNOWN_ENTRIES: u32 = 1 + 4 * KNOWN_WORDS;
/// Control-word bit: the filter has been rebuilt by a complete walk since
/// the map was created, so clear bits may be trusted.
pub const KNOWN_VALID: u64 = 2;
/// Control-word bit: the half the program reads.
pub const KNOWN_HALF: u64 = 1;

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
    /// The key's bit, `0..1 << KNOWN_BITS_LOG2`.
    fn known_bit(&self) -> u32;
}

impl KnownKey for Key4 {
    const FAMILY: u32 = 0;
    #[inline(always)]
    fn known_bit(&self) -> u32 {
        (fmix((self.rule as u64) << 32 | self.addr as u64) >> (64 - KNOWN_BITS_LOG2)) as u32
    }
}

impl KnownKey for Key6 {
    const FAMILY: u32 = 1;
    #[inline(always)]
    fn known_bit(&self) -> u32 {
        let a = &self.addr;
        let x = fmix(self.rule as u64 ^ ((a[0] as u64) << 32 | a[1] as u64));
        (fmix(x ^ ((a[2] as u64) << 32 | a[3] as u64)) >> (64 - KNOWN_BITS_LOG2)) as u32
    }
}

/// The [`MAP_KNOWN`] index of the word holding `bit` of `family`'s `half`.
#[inline(always)]
pub const fn known_word(family: u32, half: u32, bit: u32) -> u32 {
    1 + (family * 2 + (half & 1)) * KNOWN_WORDS + (bit >> 6)
}

/// `bit`'s mask within its word.
#[inline(always)]
pub const fn known_mask(bit: u32) -> u64 {
    1 << (bit & 63)
}

#[cfg(test)]
mod tests {
    extern crate std;
    use super::*;

    #[test]
    fn words_stay_inside_the_map_and_families_and_halves_do_not_overlap() {
        let last = (1u32 << KNOWN_BITS_LOG2) - 1;
        let mut seen = [(0u32, 0u32); 4];
        for family in 0..2 {
            for half in 0..2 {
                let r = (known_word(family, half, 0), known_word(family, half, last));
                assert!(r.0 >= 1 && r.1 < KNOWN_ENTRIES);
                assert_eq!(r.1 - r.0 + 1, KNOWN_WORDS);
                seen[(family * 2 + half) as usize] = r;
            }
        }
        for w in seen.windows(2) {
            assert_eq!(w[0].1 + 1, w[1].0);
        }
    }

    #[test]
    fn sequential_and_prefix_keys_spread_over_the_bits() {
        // The TestRun bench salts the low bits; a flood sweeps /24s. Both
        // must spread, or the filter says "maybe" for most unseen keys.
        let mut bits = std::collections::HashSet::new();
        // Addresses are network order read as native words: the bytes
        // that vary sit in the low bits, the high bits or the middle.
        for i in 0..65_536u32 {
            bits.insert(Key4 { rule: 8, addr: i }.known_bit());
            bits.insert(Key4 { rule: 8, addr: 0x4d0a | i << 16 }.known_bit());
            bits.insert(Key4 { rule: 8 | crate::KEY_CELL, addr: i << 8 }.known_bit());
            bits.insert(Key6 { rule: 8, addr: [0x2001_0db8, i, 0, 0] }.known_bit());
            bits.insert(Key6 { rule: 8, addr: [0xb80d_0120, i << 16, 0, 0] }.known_bit());
        }
        // A random function would hit m(1 − e^(−n/m)) distinct bits.
        let (n, m) = (5.0 * 65_536.0, (1u64 << KNOWN_BITS_LOG2) as f64);
        let random = m * (1.0 - (-n / m).exp());
        assert!(bits.len() as f64 > 0.99 * random, "{} distinct bits, a random hash would give {random:.0}", bits.len());
        assert!(bits.iter().all(|b| *b < 1 << KNOWN_BITS_LOG2));
    }
}
