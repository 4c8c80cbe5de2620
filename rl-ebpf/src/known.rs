//! The filter of keys that own a bucket (`rl_common::known`): a clear bit
//! lets an unseen key skip its table lookup, the miss a random-source flood
//! pays on every packet.

use core::intrinsics::{atomic_or, AtomicOrdering};

use aya_ebpf::{bindings::BPF_F_MMAPABLE, macros::map, maps::Array};
use rl_common::{known_holds, known_marked_halves, known_mask, known_word, KnownKey, KNOWN_ENTRIES, KNOWN_HALF, KNOWN_VALID};

/// rl_common::MAP_KNOWN. Mappable: the daemon rebuilds it with atomic ORs.
#[map(name = "RL_KNOWN")]
static RL_KNOWN: Array<u64> = Array::with_max_entries(KNOWN_ENTRIES, BPF_F_MMAPABLE);

/// False only if `key` surely owns no bucket: the filter is valid and one
/// of its two bits is clear in the half the daemon last rebuilt.
#[inline(always)]
pub fn maybe<K: KnownKey>(key: &K) -> bool {
    let Some(ctl) = RL_KNOWN.get_ptr(0) else { return true };
    let ctl = unsafe { core::ptr::read_volatile(ctl) };
    if ctl & KNOWN_VALID == 0 {
        return true;
    }
    let hash = key.known_hash();
    match RL_KNOWN.get_ptr(known_word(K::FAMILY, (ctl & KNOWN_HALF) as u32, hash)) {
        Some(w) => known_holds(unsafe { core::ptr::read_volatile(w) }, hash),
        None => true,
    }
}

/// Sets `key`'s bits in the half the program reads, and during a rebuild
/// in the other half too: call before inserting its bucket.
#[inline(always)]
pub fn mark<K: KnownKey>(key: &K) {
    let hash = key.known_hash();
    let Some(ctl) = RL_KNOWN.get_ptr(0) else { return };
    let ctl = unsafe { core::ptr::read_volatile(ctl) };
    for i in 0..2 {
        if i >= known_marked_halves(ctl) {
            break;
        }
        let half = (ctl & KNOWN_HALF) as u32 ^ i;
        if let Some(w) = RL_KNOWN.get_ptr_mut(known_word(K::FAMILY, half, hash)) {
            unsafe { atomic_or::<u64, u64, { AtomicOrdering::Relaxed }>(w, known_mask(hash)) };
        }
    }
}
