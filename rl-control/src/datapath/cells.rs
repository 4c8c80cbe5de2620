//! The daemon's side of the prefix-cell arrays (`rl_common::cells`): mapped
//! read-write, so that freeing a cell and raising its state are
//! compare-and-swaps on the very words the XDP program swaps.

use std::{
    os::fd::{AsFd, AsRawFd},
    sync::atomic::{AtomicU64, Ordering},
};

use aya::maps::MapData;
use rl_common::{cell_claim, cell_dying, cell_set, cell_way, Bucket, Cell, KnownKey, Way, CELL_CLAIM_OFFSET, CELL_TAT_OFFSET, CELL_WAYS};

use super::{map_error, DatapathError};

/// An mmapable array map, mapped read-write.
pub(super) struct Mapped {
    base: *mut u8,
    bytes: usize,
    /// Entries.
    pub len: u32,
    _map: MapData,
}

// Shared memory reached only through atomics and volatile reads.
unsafe impl Send for Mapped {}
unsafe impl Sync for Mapped {}

impl Mapped {
    /// Maps array `name` (kernel id `id`) after checking its value size.
    pub fn open(id: u32, name: &'static str, value_size: usize) -> Result<Mapped, DatapathError> {
        let map = MapData::from_id(id).map_err(|e| map_error(name, e))?;
        let info = map.info().map_err(|e| map_error(name, e))?;
        if info.value_size() as usize != value_size {
            return Err(DatapathError::Load(format!(
                "map {name} holds values of {} bytes, rl-common expects {value_size}: rebuild both with `cargo xtask build`",
                info.value_size()
            )));
        }
        let len = info.max_entries();
        let bytes = (len as usize * value_size).next_multiple_of(page_size());
        let fd = map.fd().as_fd().as_raw_fd();
        let p = unsafe { libc::mmap(std::ptr::null_mut(), bytes, libc::PROT_READ | libc::PROT_WRITE, libc::MAP_SHARED, fd, 0) };
        if p == libc::MAP_FAILED {
            let e = std::io::Error::last_os_error();
            return Err(DatapathError::Load(format!("cannot map {name} (created without BPF_F_MMAPABLE by an older build?): {e}")));
        }
        Ok(Mapped { base: p as *mut u8, bytes, len, _map: map })
    }

    /// The 64-bit word at byte `offset` (8-aligned, inside the mapping).
    pub fn word(&self, offset: usize) -> &AtomicU64 {
        assert!(offset % 8 == 0 && offset + 8 <= self.bytes);
        unsafe { &*(self.base.add(offset) as *const AtomicU64) }
    }

    /// A copy of entry `i` of type `T` (volatile: the program may be writing it).
    fn read<T: Copy>(&self, i: u32) -> T {
        assert!((i as usize + 1) * std::mem::size_of::<T>() <= self.bytes);
        unsafe { std::ptr::read_volatile(self.base.add(i as usize * std::mem::size_of::<T>()) as *const T) }
    }
}

impl Drop for Mapped {
    fn drop(&mut self) {
        unsafe { libc::munmap(self.base as *mut libc::c_void, self.bytes) };
    }
}

pub(super) fn page_size() -> usize {
    (unsafe { libc::sysconf(libc::_SC_PAGESIZE) }).max(4096) as usize
}

/// One family's cell array.
pub struct CellArray<K> {
    mem: Mapped,
    _key: std::marker::PhantomData<K>,
}

const CELL: usize = std::mem::size_of::<Cell<rl_common::Key4>>();

impl<K: KnownKey + Copy + PartialEq + Default> CellArray<K> {
    pub(super) fn open(id: u32, name: &'static str) -> Result<CellArray<K>, DatapathError> {
        let mem = Mapped::open(id, name, CELL)?;
        if !mem.len.is_power_of_two() || mem.len < CELL_WAYS {
            return Err(DatapathError::Load(format!("map {name} holds {} cells, not a power of two of at least {CELL_WAYS}", mem.len)));
        }
        Ok(CellArray { mem, _key: std::marker::PhantomData })
    }

    pub fn slots(&self) -> u32 {
        self.mem.len
    }

    /// A copy of slot `i`.
    pub fn get(&self, i: u32) -> Cell<K> {
        self.mem.read(i)
    }

    fn claim_word(&self, i: u32) -> &AtomicU64 {
        self.mem.word(i as usize * CELL + CELL_CLAIM_OFFSET)
    }

    fn tat_word(&self, i: u32) -> &AtomicU64 {
        self.mem.word(i as usize * CELL + CELL_TAT_OFFSET)
    }

    /// The slot holding `key`, if any.
    pub fn find(&self, key: &K) -> Option<u32> {
        let set = cell_set(key, self.slots());
        (set..set + CELL_WAYS).find(|&i| self.way(i, key) == Way::Holds)
    }

    /// What slot `i` is to `key` (as the program sees it: `rl_common::cell_way`).
    fn way(&self, i: u32, key: &K) -> Way {
        let c = self.get(i);
        cell_way(c.claim, c.claim == cell_claim(key) && c.key == *key, cell_claim(key), cell_dying(key))
    }

    /// First step of freeing slot `i`, held by `key` with `claim`: from now
    /// on no program run finds the cell (see `rl_common::cells`). `false`:
    /// the slot changed since it was read, leave it.
    pub fn begin_free(&self, i: u32, key: &K, claim: u64) -> bool {
        self.claim_word(i).compare_exchange(claim, cell_dying(key), Ordering::AcqRel, Ordering::Relaxed).is_ok()
    }

    /// Second step, once every program run that could have found the cell
    /// before [`begin_free`](Self::begin_free) is over: if `fresh` still
    /// holds for its bucket the slot is freed (the key cleared first, so
    /// that a run finding the slot claimed again before its new key is
    /// written sees "busy", never a stale match); otherwise the cell lives
    /// on with what was charged to it. Returns whether it was freed.
    pub fn finish_free(&self, i: u32, key: &K, fresh: impl Fn(&Bucket) -> bool) -> bool {
        let dying = cell_dying(key);
        if fresh(&self.get(i).bucket) {
            let at = self.slot_ptr(i);
            unsafe { std::ptr::write_volatile(&raw mut (*at).key, K::default()) };
            if self.claim_word(i).compare_exchange(dying, 0, Ordering::AcqRel, Ordering::Relaxed).is_ok() {
                return true;
            }
        }
        // Charged meanwhile (or, impossibly, changed): the cell lives on.
        unsafe { std::ptr::write_volatile(&raw mut (*self.slot_ptr(i)).key, *key) };
        let _ = self.claim_word(i).compare_exchange(dying, cell_claim(key), Ordering::AcqRel, Ordering::Relaxed);
        false
    }

    /// Clears the key a free slot `i` still holds (`key`, left by a build
    /// that freed slots without clearing it), holding the slot as dying
    /// meanwhile so that no program run claims it under the write.
    pub fn clear_stale_key(&self, i: u32, key: &K) {
        let dying = cell_dying(key);
        if self.claim_word(i).compare_exchange(0, dying, Ordering::AcqRel, Ordering::Relaxed).is_ok() {
            unsafe { std::ptr::write_volatile(&raw mut (*self.slot_ptr(i)).key, K::default()) };
            let _ = self.claim_word(i).compare_exchange(dying, 0, Ordering::AcqRel, Ordering::Relaxed);
        }
    }

    /// Frees slot `i`, left dying (`claim`) with its key already cleared by
    /// a daemon that stopped between the two stores of
    /// [`finish_free`](Self::finish_free): it had found the cell fresh.
    pub fn release_abandoned(&self, i: u32, claim: u64) -> bool {
        claim & 1 == 0 && self.claim_word(i).compare_exchange(claim, 0, Ordering::AcqRel, Ordering::Relaxed).is_ok()
    }

    fn slot_ptr(&self, i: u32) -> *mut Cell<K> {
        assert!(i < self.slots());
        unsafe { self.mem.base.add(i as usize * CELL) as *mut Cell<K> }
    }

    /// Moves the state word of `key`'s cell up to `tat_ns` if it is
    /// earlier (never down): token buckets only (cluster rules are). `None`:
    /// there is no such cell; else whether it moved.
    pub fn raise(&self, key: &K, tat_ns: u64) -> Option<bool> {
        let i = self.find(key)?;
        Some(self.tat_word(i).fetch_max(tat_ns, Ordering::AcqRel) < tat_ns)
    }

    /// Gives `key` a cell holding `bucket` (a cell pinned by an older build,
    /// moved here), or, if it has one, merges `bucket`'s state into it with
    /// `merge` (`LimitEntry::merge`: never more allowance than either).
    /// `false`: its set has no room (or its cell is being written or freed).
    pub fn adopt(&self, key: &K, bucket: Bucket, merge: impl Fn(u64, u64) -> u64) -> bool {
        // A few rounds: a program run may be claiming a way of the set this
        // very moment (perhaps for this key: then merge into that cell).
        for _ in 0..8 {
            if let Some(i) = self.find(key) {
                let word = self.tat_word(i);
                let _ = word.fetch_update(Ordering::AcqRel, Ordering::Acquire, |cur| Some(merge(cur, bucket.tat_ns)));
                return true;
            }
            let set = cell_set(key, self.slots());
            if (set..set + CELL_WAYS).any(|i| self.way(i, key) == Way::Busy) {
                std::thread::yield_now();
                continue;
            }
            let Some(i) = (set..set + CELL_WAYS).find(|&i| self.get(i).claim == 0) else {
                // Full, unless a run just claimed a way for this key.
                if self.find(key).is_none() && !(set..set + CELL_WAYS).any(|i| self.way(i, key) == Way::Busy) {
                    return false;
                }
                continue;
            };
            if self.claim_word(i).compare_exchange(0, cell_claim(key), Ordering::AcqRel, Ordering::Relaxed).is_err() {
                continue;
            }
            // As the program does: the bucket first, the key last.
            let at = self.slot_ptr(i);
            unsafe {
                std::ptr::write_volatile(&raw mut (*at).bucket, bucket);
                std::sync::atomic::fence(Ordering::Release);
                std::ptr::write_volatile(&raw mut (*at).key, *key);
            }
            return true;
        }
        false
    }
}

impl super::Datapath {
    /// This datapath's IPv4 prefix cells, mapped.
    pub fn cells_v4(&self) -> Result<CellArray<rl_common::Key4>, DatapathError> {
        CellArray::open(self.map_id(rl_common::MAP_CELLS_V4)?, rl_common::MAP_CELLS_V4)
    }
}
