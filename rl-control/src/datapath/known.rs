//! The daemon's side of the known-keys filter (`rl_common::known`): it maps
//! the filter's memory and rebuilds the half the XDP program does not read
//! during the collector's walk, so the bits of deleted buckets go away
//! without ever clearing the bit of a bucket that exists.

use std::{
    sync::atomic::{AtomicU64, Ordering},
    time::Duration,
};

use rl_common::{
    known_holds, known_mask, known_region, known_word, KnownKey, KNOWN_ENTRIES, KNOWN_HALF,
    KNOWN_REBUILDING, KNOWN_VALID, KNOWN_WORDS, MAP_KNOWN,
};

use super::{cells::Mapped, DatapathError, MapRef};

/// Every XDP program run that could have set a bit before the half was
/// zeroed has inserted its bucket long before this (runs take microseconds
/// and cannot sleep), so the walk that follows finds it; `grace` then also
/// waits for an RCU grace period, which bounds runs that the hypervisor
/// (or a real-time kernel) held up longer.
pub(super) const RUN_GRACE: Duration = Duration::from_millis(2);

/// [`MAP_KNOWN`], mapped read-write.
pub struct KnownFilter {
    mem: Mapped,
}

impl KnownFilter {
    /// Maps the filter of the map with kernel id `id`.
    pub fn open(id: &MapRef) -> Result<KnownFilter, DatapathError> {
        let mem = Mapped::open(id, MAP_KNOWN, 8)?;
        if mem.len != KNOWN_ENTRIES {
            return Err(DatapathError::Load(format!(
                "map {MAP_KNOWN} holds {} words, rl-common expects {KNOWN_ENTRIES}: rebuild both with `cargo xtask build`",
                mem.len
            )));
        }
        Ok(KnownFilter { mem })
    }

    fn word(&self, i: u32) -> &AtomicU64 {
        self.mem.word(i as usize * 8)
    }

    /// The control word: [`KNOWN_VALID`] | the half the program reads |
    /// [`KNOWN_REBUILDING`] during a rebuild.
    pub fn control(&self) -> u64 {
        self.word(0).load(Ordering::Acquire)
    }

    /// Starts a rebuild: tells the program to mark new keys in both halves
    /// ([`KNOWN_REBUILDING`], cleared by [`finish`](Self::finish)), zeroes
    /// the half it does not read (both families) and waits out the program
    /// runs in flight. Returns that half. A rebuild that never finishes
    /// leaves the flag set: the program then marks both halves, as it
    /// must for the next one.
    pub fn begin(&self) -> u32 {
        let half =
            ((self.word(0).fetch_or(KNOWN_REBUILDING, Ordering::SeqCst) & KNOWN_HALF) ^ 1) as u32;
        for family in 0..2 {
            let first = known_region(family, half);
            for i in first..first + KNOWN_WORDS {
                self.word(i).store(0, Ordering::Relaxed);
            }
        }
        std::sync::atomic::fence(Ordering::SeqCst);
        super::grace::wait(RUN_GRACE);
        half
    }

    /// Sets `key`'s bits in `half` (a bucket the walk keeps).
    pub fn mark<K: KnownKey>(&self, half: u32, key: &K) {
        let hash = key.known_hash();
        self.word(known_word(K::FAMILY, half, hash))
            .fetch_or(known_mask(hash), Ordering::Relaxed);
    }

    /// Whether both of `key`'s bits are set in `half` (what the program
    /// tests).
    pub fn has<K: KnownKey>(&self, half: u32, key: &K) -> bool {
        let hash = key.known_hash();
        known_holds(
            self.word(known_word(K::FAMILY, half, hash))
                .load(Ordering::Relaxed),
            hash,
        )
    }

    /// Ends a rebuild that marked every bucket a complete walk kept: the
    /// program reads `half` from now on, trusts its clear bits, and marks
    /// new keys in it alone.
    pub fn finish(&self, half: u32) {
        self.word(0)
            .store(KNOWN_VALID | u64::from(half & 1), Ordering::Release);
    }

    /// Benchmarks only: the program looks every key up again, as before
    /// the filter existed, until the next rebuild.
    pub fn disable(&self) {
        self.word(0).store(0, Ordering::Release);
    }

    /// The share of `family`'s bits set in the half the program reads (a
    /// key owning no bucket still pays the table lookup with about its
    /// square as probability).
    pub fn fill(&self, family: u32) -> f64 {
        let half = (self.control() & KNOWN_HALF) as u32;
        let first = known_region(family, half);
        let ones: u64 = (first..first + KNOWN_WORDS)
            .map(|i| u64::from(self.word(i).load(Ordering::Relaxed).count_ones()))
            .sum();
        ones as f64 / (u64::from(KNOWN_WORDS) * 64) as f64
    }
}

impl super::Datapath {
    /// This datapath's known-keys filter, mapped (see [`KnownFilter::open`]).
    pub fn known_filter(&self) -> Result<KnownFilter, DatapathError> {
        KnownFilter::open(&self.map_ref(MAP_KNOWN)?)
    }
}
