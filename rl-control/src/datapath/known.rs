//! The daemon's side of the known-keys filter (`rl_common::known`): it maps
//! the filter's memory and rebuilds the half the XDP program does not read
//! during the collector's walk, so the bits of deleted buckets go away
//! without ever clearing the bit of a bucket that exists.

use std::{
    os::fd::{AsFd, AsRawFd},
    sync::atomic::{AtomicU64, Ordering},
    time::Duration,
};

use aya::maps::MapData;
use rl_common::{known_holds, known_mask, known_region, known_word, KnownKey, KNOWN_ENTRIES, KNOWN_HALF, KNOWN_VALID, KNOWN_WORDS, MAP_KNOWN};

use super::{map_error, DatapathError};

/// Every XDP program run that could have set a bit before the half was
/// zeroed has inserted its bucket long before this (runs take microseconds
/// and cannot sleep), so the walk that follows finds it.
const RUN_GRACE: Duration = Duration::from_millis(2);

/// [`MAP_KNOWN`], mapped read-write.
pub struct KnownFilter {
    words: *const AtomicU64,
    len: usize,
    _map: MapData,
}

// The mapping is shared memory reached only through atomics.
unsafe impl Send for KnownFilter {}
unsafe impl Sync for KnownFilter {}

impl KnownFilter {
    /// Maps the filter of the map with kernel id `id`.
    pub fn open(id: u32) -> Result<KnownFilter, DatapathError> {
        let map = MapData::from_id(id).map_err(|e| map_error(MAP_KNOWN, e))?;
        let info = map.info().map_err(|e| map_error(MAP_KNOWN, e))?;
        if (info.value_size(), info.max_entries()) != (8, KNOWN_ENTRIES) {
            return Err(DatapathError::Load(format!(
                "map {MAP_KNOWN} holds {} values of {} bytes, rl-common expects {KNOWN_ENTRIES} of 8: rebuild both with `cargo xtask build`",
                info.max_entries(),
                info.value_size()
            )));
        }
        let len = KNOWN_ENTRIES as usize;
        let bytes = (len * 8).next_multiple_of(page_size());
        let fd = map.fd().as_fd().as_raw_fd();
        let p = unsafe { libc::mmap(std::ptr::null_mut(), bytes, libc::PROT_READ | libc::PROT_WRITE, libc::MAP_SHARED, fd, 0) };
        if p == libc::MAP_FAILED {
            let e = std::io::Error::last_os_error();
            return Err(DatapathError::Load(format!("cannot map {MAP_KNOWN} (created without BPF_F_MMAPABLE by an older build?): {e}")));
        }
        Ok(KnownFilter { words: p as *const AtomicU64, len, _map: map })
    }

    fn word(&self, i: u32) -> &AtomicU64 {
        assert!((i as usize) < self.len);
        unsafe { &*self.words.add(i as usize) }
    }

    /// The control word: [`KNOWN_VALID`] | the half the program reads.
    pub fn control(&self) -> u64 {
        self.word(0).load(Ordering::Acquire)
    }

    /// Starts a rebuild: zeroes the half the program does not read (both
    /// families) and waits out the program runs in flight. Returns that half.
    pub fn begin(&self) -> u32 {
        let half = ((self.control() & KNOWN_HALF) ^ 1) as u32;
        for family in 0..2 {
            let first = known_region(family, half);
            for i in first..first + KNOWN_WORDS {
                self.word(i).store(0, Ordering::Relaxed);
            }
        }
        std::sync::atomic::fence(Ordering::SeqCst);
        std::thread::sleep(RUN_GRACE);
        half
    }

    /// Sets `key`'s bits in `half` (a bucket the walk keeps).
    pub fn mark<K: KnownKey>(&self, half: u32, key: &K) {
        let hash = key.known_hash();
        self.word(known_word(K::FAMILY, half, hash)).fetch_or(known_mask(hash), Ordering::Relaxed);
    }

    /// Whether both of `key`'s bits are set in `half` (what the program
    /// tests).
    pub fn has<K: KnownKey>(&self, half: u32, key: &K) -> bool {
        let hash = key.known_hash();
        known_holds(self.word(known_word(K::FAMILY, half, hash)).load(Ordering::Relaxed), hash)
    }

    /// Ends a rebuild that marked every bucket a complete walk kept: the
    /// program reads `half` from now on, and trusts its clear bits.
    pub fn finish(&self, half: u32) {
        self.word(0).store(KNOWN_VALID | u64::from(half & 1), Ordering::Release);
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
        let ones: u64 = (first..first + KNOWN_WORDS).map(|i| u64::from(self.word(i).load(Ordering::Relaxed).count_ones())).sum();
        ones as f64 / (u64::from(KNOWN_WORDS) * 64) as f64
    }
}

impl super::Datapath {
    /// This datapath's known-keys filter, mapped (see [`KnownFilter::open`]).
    pub fn known_filter(&self) -> Result<KnownFilter, DatapathError> {
        KnownFilter::open(self.map_id(MAP_KNOWN)?)
    }
}

impl Drop for KnownFilter {
    fn drop(&mut self) {
        let bytes = (self.len * 8).next_multiple_of(page_size());
        unsafe { libc::munmap(self.words as *mut libc::c_void, bytes) };
    }
}

fn page_size() -> usize {
    (unsafe { libc::sysconf(libc::_SC_PAGESIZE) }).max(4096) as usize
}
