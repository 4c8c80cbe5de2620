//! The daemon's side of the prefix-cell arrays (`rl_common::cells`): mapped
//! read-write, so that freeing a cell and raising its state are
//! compare-and-swaps on the very words the XDP program swaps.

use std::{
    os::fd::{AsFd, AsRawFd},
    sync::atomic::{AtomicU64, Ordering},
};

use aya::maps::MapData;
use rl_common::{cell_claim, cell_set, Bucket, Cell, KnownKey, CELL_CLAIM_OFFSET, CELL_TAT_OFFSET, CELL_WAYS};

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

impl<K: KnownKey + Copy + PartialEq> CellArray<K> {
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
        (set..set + CELL_WAYS).find(|&i| {
            let c = self.get(i);
            c.claim == cell_claim(key) && c.key == *key
        })
    }

    /// Frees slot `i` if it is still claimed with `claim` (the program may
    /// claim it again at once).
    pub fn free(&self, i: u32, claim: u64) -> bool {
        self.claim_word(i).compare_exchange(claim, 0, Ordering::AcqRel, Ordering::Relaxed).is_ok()
    }

    /// Moves the state word of `key`'s cell up to `tat_ns` if it is
    /// earlier (never down). `None`: there is no such cell; else whether
    /// it moved.
    pub fn raise(&self, key: &K, tat_ns: u64) -> Option<bool> {
        let i = self.find(key)?;
        Some(self.tat_word(i).fetch_max(tat_ns, Ordering::AcqRel) < tat_ns)
    }

    /// Gives `key` a cell holding `bucket` (a cell pinned by an older build,
    /// moved here), or raises its cell to it if it has one. `false`: its set
    /// is full.
    pub fn adopt(&self, key: &K, bucket: Bucket) -> bool {
        if self.raise(key, bucket.tat_ns).is_some() {
            return true;
        }
        let set = cell_set(key, self.slots());
        for i in set..set + CELL_WAYS {
            if self.claim_word(i).compare_exchange(0, cell_claim(key), Ordering::AcqRel, Ordering::Relaxed).is_ok() {
                // As the program does: the bucket first, the key last.
                let at = unsafe { self.mem.base.add(i as usize * CELL) as *mut Cell<K> };
                unsafe {
                    std::ptr::write_volatile(&raw mut (*at).bucket, bucket);
                    std::sync::atomic::fence(Ordering::Release);
                    std::ptr::write_volatile(&raw mut (*at).key, *key);
                }
                return true;
            }
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
