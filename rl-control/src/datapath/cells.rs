//! The daemon's side of the prefix-cell arrays (`rl_common::cells`): mapped
//! read-write, so that freeing a cell and raising its state are
//! compare-and-swaps on the very words the XDP program swaps.

use std::{
    os::fd::{AsFd, AsRawFd},
    sync::atomic::{AtomicU64, Ordering},
};

use aya::maps::MapData;
use rl_common::{
    cell_claim, cell_dying, cell_set, cell_way, cell_writing, Bucket, Cell, CellKey, KnownKey,
    OldCell, Way, CELL_CLAIM_OFFSET, CELL_TAT_OFFSET, CELL_WAYS,
};

use super::{map_error, DatapathError, MapRef};

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
    pub fn open(
        id: &MapRef,
        name: &'static str,
        value_size: usize,
    ) -> Result<Mapped, DatapathError> {
        let map = id.open()?;
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
        let p = unsafe {
            libc::mmap(
                std::ptr::null_mut(),
                bytes,
                libc::PROT_READ | libc::PROT_WRITE,
                libc::MAP_SHARED,
                fd,
                0,
            )
        };
        if p == libc::MAP_FAILED {
            let e = std::io::Error::last_os_error();
            return Err(DatapathError::Load(format!(
                "cannot map {name} (created without BPF_F_MMAPABLE by an older build?): {e}"
            )));
        }
        Ok(Mapped {
            base: p as *mut u8,
            bytes,
            len,
            _map: map,
        })
    }

    /// The 64-bit word at byte `offset` (8-aligned, inside the mapping).
    pub fn word(&self, offset: usize) -> &AtomicU64 {
        assert!(offset.is_multiple_of(8) && offset + 8 <= self.bytes);
        unsafe { &*(self.base.add(offset) as *const AtomicU64) }
    }

    /// A copy of entry `i` of type `T` (volatile: the program may be writing it).
    fn read<T: Copy>(&self, i: u32) -> T {
        assert!((i as usize + 1) * std::mem::size_of::<T>() <= self.bytes);
        unsafe {
            std::ptr::read_volatile(self.base.add(i as usize * std::mem::size_of::<T>()) as *const T)
        }
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

/// What the daemon reads of one slot: the claim word, the bucket (the
/// state from the hot array, the counts and the key from the key array:
/// valid while the claim is not 0).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct CellView<K> {
    pub claim: u64,
    pub key: K,
    pub bucket: Bucket,
}

/// One family's cell array and its key array.
pub struct CellArray<K> {
    hot: Mapped,
    keys: Mapped,
    /// The datapath's cell seed (`rl_common::MAP_CELL_SEED`).
    seed: u64,
    _key: std::marker::PhantomData<K>,
}

const CELL: usize = std::mem::size_of::<Cell>();

impl<K: KnownKey + Copy + PartialEq + Default> CellArray<K> {
    pub(super) fn open(
        ids: (&MapRef, &MapRef),
        names: (&'static str, &'static str),
        seed: u64,
    ) -> Result<CellArray<K>, DatapathError> {
        let hot = Mapped::open(ids.0, names.0, CELL)?;
        if !hot.len.is_power_of_two() || hot.len < CELL_WAYS {
            return Err(DatapathError::Load(format!(
                "map {} holds {} cells, not a power of two of at least {CELL_WAYS}",
                names.0, hot.len
            )));
        }
        let keys = Mapped::open(ids.1, names.1, std::mem::size_of::<CellKey<K>>())?;
        if keys.len != hot.len {
            return Err(DatapathError::Load(format!(
                "map {} holds {} slots, {} holds {}: rebuild both with `cargo xtask build`",
                names.1, keys.len, names.0, hot.len
            )));
        }
        Ok(CellArray {
            hot,
            keys,
            seed,
            _key: std::marker::PhantomData,
        })
    }

    pub fn slots(&self) -> u32 {
        self.hot.len
    }

    /// The claim word of a slot holding `key` (`rl_common::cell_claim`).
    pub fn claim_of(&self, key: &K) -> u64 {
        cell_claim(key, self.seed)
    }

    /// Whether copy `c` of a slot is claimed, for the key written in it
    /// (not free, dying or being written, nor claimed for a key whose key
    /// is not written yet).
    pub fn holds_its_key(&self, c: &CellView<K>) -> bool {
        c.claim == self.claim_of(&c.key)
    }

    fn set_of(&self, key: &K) -> u32 {
        cell_set(key, self.seed, self.slots())
    }

    /// A copy of slot `i`: the claim read first, so that a claimed slot's
    /// key is the one written before the claim.
    pub fn get(&self, i: u32) -> CellView<K> {
        let c: Cell = self.hot.read(i);
        std::sync::atomic::fence(Ordering::Acquire);
        let k: CellKey<K> = self.keys.read(i);
        CellView {
            claim: c.claim,
            key: k.key,
            bucket: Bucket {
                tat_ns: c.tat_ns,
                ..k.counts
            },
        }
    }

    /// The claim word of slot `i` (tests set it to the states a program
    /// run or a stopped daemon leaves).
    pub fn claim_word(&self, i: u32) -> &AtomicU64 {
        self.hot.word(i as usize * CELL + CELL_CLAIM_OFFSET)
    }

    fn tat_word(&self, i: u32) -> &AtomicU64 {
        self.hot.word(i as usize * CELL + CELL_TAT_OFFSET)
    }

    /// The slot holding `key`, if any.
    pub fn find(&self, key: &K) -> Option<u32> {
        let set = self.set_of(key);
        (set..set + CELL_WAYS).find(|&i| self.way(i, key) == Way::Holds)
    }

    /// Whether `key` has its cell here or a free way to claim one (a set
    /// full of other keys' cells sends it to its parent).
    pub fn room_for(&self, key: &K) -> bool {
        let set = self.set_of(key);
        (set..set + CELL_WAYS).any(|i| matches!(self.way(i, key), Way::Holds | Way::Free))
    }

    /// What slot `i` is to `key` (as the program sees it: `rl_common::cell_way`).
    fn way(&self, i: u32, key: &K) -> Way {
        cell_way(
            self.claim_word(i).load(Ordering::Acquire),
            self.claim_of(key),
        )
    }

    /// First step of freeing slot `i`, held by `key`: from now on no
    /// program run finds the cell (see `rl_common::cells`). `false`: the
    /// slot changed since it was read, leave it.
    pub fn begin_free(&self, i: u32, key: &K) -> bool {
        let claim = self.claim_of(key);
        self.claim_word(i)
            .compare_exchange(
                claim,
                cell_dying(claim),
                Ordering::AcqRel,
                Ordering::Relaxed,
            )
            .is_ok()
    }

    /// Second step, once every program run that could have found the cell
    /// before [`begin_free`](Self::begin_free) is over (or for a slot a
    /// stopped daemon left dying): if `fresh` still holds for its bucket
    /// the slot is freed; otherwise the cell lives on with what was charged
    /// to it. Returns whether it was freed.
    pub fn finish_free(&self, i: u32, key: &K, fresh: impl Fn(&Bucket) -> bool) -> bool {
        let claim = self.claim_of(key);
        let to = if fresh(&self.get(i).bucket) { 0 } else { claim };
        self.claim_word(i)
            .compare_exchange(cell_dying(claim), to, Ordering::AcqRel, Ordering::Relaxed)
            .is_ok()
            && to == 0
    }

    /// Frees slot `i` if its claim word still reads `claim`, a *writing*
    /// word read at least a grace before: a program run writes a cell in
    /// microseconds, so only a daemon stopped in the middle of
    /// [`adopt`](Self::adopt) leaves one for that long. Returns whether it
    /// was freed.
    pub fn release_writing(&self, i: u32, claim: u64) -> bool {
        claim & 3 == 3
            && self
                .claim_word(i)
                .compare_exchange(claim, 0, Ordering::AcqRel, Ordering::Relaxed)
                .is_ok()
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
        let claim = self.claim_of(key);
        let set = self.set_of(key);
        // A program run may be claiming a way of the set this very moment
        // (perhaps for this key: then merge into that cell once it is
        // written); a run writes a cell in microseconds.
        let deadline = std::time::Instant::now() + std::time::Duration::from_millis(20);
        while std::time::Instant::now() < deadline {
            // Each way's word read once, so that one reading decides.
            let ways: Vec<(u32, Way)> = (set..set + CELL_WAYS)
                .map(|i| {
                    (
                        i,
                        cell_way(self.claim_word(i).load(Ordering::Acquire), claim),
                    )
                })
                .collect();
            if let Some(&(i, _)) = ways.iter().find(|w| w.1 == Way::Holds) {
                let word = self.tat_word(i);
                let _ = word.fetch_update(Ordering::AcqRel, Ordering::Acquire, |cur| {
                    Some(merge(cur, bucket.tat_ns))
                });
                return true;
            }
            if ways.iter().any(|w| w.1 == Way::Busy) {
                std::thread::yield_now();
                continue;
            }
            // No free way: the set is full of other keys' cells (only the
            // collector, this thread's caller, frees one).
            let Some(&(i, _)) = ways.iter().find(|w| w.1 == Way::Free) else {
                return false;
            };
            if self
                .claim_word(i)
                .compare_exchange(0, cell_writing(claim), Ordering::AcqRel, Ordering::Relaxed)
                .is_err()
            {
                continue;
            }
            // As the program does: the state and the key first, the claim last.
            self.tat_word(i).store(bucket.tat_ns, Ordering::Relaxed);
            let at = self.key_ptr(i);
            unsafe {
                std::ptr::write_volatile(
                    at,
                    CellKey {
                        key: *key,
                        counts: Bucket {
                            tat_ns: 0,
                            ..bucket
                        },
                    },
                )
            };
            self.claim_word(i).store(claim, Ordering::Release);
            return true;
        }
        false
    }

    fn key_ptr(&self, i: u32) -> *mut CellKey<K> {
        assert!(i < self.slots());
        unsafe {
            self.keys
                .base
                .add(i as usize * std::mem::size_of::<CellKey<K>>()) as *mut CellKey<K>
        }
    }
}

/// An older build's 64-byte cell array (`rl_common::OldCell`), pinned at
/// `path`: its live cells, to be moved into this build's arrays.
pub(super) fn old_cells<K: KnownKey + Copy + PartialEq>(
    path: &std::path::Path,
    name: &'static str,
) -> Result<Vec<(K, Bucket)>, DatapathError> {
    let map = MapData::from_pin(path).map_err(|e| map_error(name, e))?;
    let mem = Mapped::open(
        &MapRef::of(&map, name)?,
        name,
        std::mem::size_of::<OldCell<K>>(),
    )?;
    Ok((0..mem.len)
        .map(|i| mem.read::<OldCell<K>>(i))
        .filter(|c| c.live())
        .map(|c| (c.key, c.bucket))
        .collect())
}

/// The cell seed in the map with kernel id `id`.
pub(super) fn cell_seed(id: &MapRef) -> Result<u64, DatapathError> {
    let name = rl_common::MAP_CELL_SEED;
    let map = id.open()?;
    let arr: aya::maps::Array<MapData, u64> =
        aya::maps::Array::try_from(aya::maps::Map::Array(map)).map_err(|e| map_error(name, e))?;
    arr.get(&0, 0).map_err(|e| map_error(name, e))
}

impl super::Datapath {
    /// This datapath's IPv4 prefix cells, mapped.
    pub fn cells_v4(&self) -> Result<CellArray<rl_common::Key4>, DatapathError> {
        Ok(self.table_maps()?.cell_arrays()?.0)
    }

    /// Gives the cells a random seed if theirs is 0 (just created); a
    /// pinned one is kept, since the cells are found by it. Before the
    /// program is attached.
    pub(super) fn seed_cells(&mut self) -> Result<(), DatapathError> {
        let name = rl_common::MAP_CELL_SEED;
        let map = self
            .ebpf
            .map_mut(name)
            .ok_or_else(|| DatapathError::Load(format!("map {name} is missing")))?;
        let mut arr: aya::maps::Array<&mut MapData, u64> =
            aya::maps::Array::try_from(map).map_err(|e| map_error(name, e))?;
        if arr.get(&0, 0).map_err(|e| map_error(name, e))? != 0 {
            return Ok(());
        }
        let mut seed = 0u64;
        while seed == 0 {
            let n = unsafe { libc::getrandom(&raw mut seed as *mut libc::c_void, 8, 0) };
            if n != 8 {
                return Err(DatapathError::Load(format!(
                    "cannot draw the cell seed: {}",
                    std::io::Error::last_os_error()
                )));
            }
        }
        arr.set(0, seed, 0).map_err(|e| map_error(name, e))
    }
}
