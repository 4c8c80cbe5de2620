//! What the cluster sync reads from and writes to the bucket tables: the
//! buckets of cluster rules with their pass and drop counts, and a raise of
//! a bucket's theoretical arrival time to the cluster's (usage charged by
//! other hosts), through handles of the caller's own.

use aya::maps::{HashMap, MapData};
use rl_common::*;

use super::{
    read::{scan_table_each, BucketKey},
    *,
};

/// A bucket's key in either table.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum BucketId {
    V4(Key4),
    V6(Key6),
}

impl BucketId {
    /// `RuleEntry::id | limit index` (and the key-kind bits).
    pub fn rule(&self) -> u32 {
        match self {
            BucketId::V4(k) => k.rule,
            BucketId::V6(k) => k.rule,
        }
    }

    /// Its limit (`RuleEntry::id | index`).
    pub fn limit(&self) -> u32 {
        limit_of_key(self.rule())
    }

    /// The bytes every host computes alike for this bucket (the rule id
    /// part excluded: hosts may number rules differently).
    pub fn addr_bytes(&self) -> Vec<u8> {
        match self {
            BucketId::V4(k) => k.addr_bytes().to_vec(),
            BucketId::V6(k) => k.addr_bytes().to_vec(),
        }
    }
}

/// One bucket of a cluster rule, as read.
#[derive(Clone, Copy, Debug)]
pub struct SharedBucket {
    pub id: BucketId,
    pub bucket: Bucket,
}

/// The buckets and cells of cluster rules the collector deletes, handed
/// to the cluster sync with their last counts: a bucket made again counts
/// from zero in the kernel, and without the record the sync could tell its
/// new count from its old one only when the new one is lower.
///
/// One lock for both sides. The collector holds it from a delete until its
/// record is in; the sync from taking the records through its scan of the
/// tables. So a bucket is either missing from (or made again in) a scan and
/// recorded for that round, or in the scan as it was and recorded for a
/// later round: never read as made again without its record.
#[derive(Default)]
pub struct Collected(std::sync::Mutex<CollectedRecords>);

/// What [`Collected`] guards.
#[derive(Default)]
pub struct CollectedRecords {
    /// The limits whose deletes are recorded (`RuleEntry::id | index`),
    /// as the sync last set them (none: nothing is recorded).
    pub limits: std::collections::HashSet<u32>,
    /// The deletes since the sync last took them, with the counts read
    /// just before.
    pub deleted: Vec<SharedBucket>,
    /// Deletes not recorded because [`COLLECTED_MAX`] were waiting.
    pub dropped: u64,
}

/// Most records waiting for the sync (a sync stopped for long, say):
/// past them the sync falls back to telling a bucket made again by its
/// count.
pub const COLLECTED_MAX: usize = 1 << 20;

impl Collected {
    pub fn lock(&self) -> std::sync::MutexGuard<'_, CollectedRecords> {
        self.0.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// The lock, and whether taking it had to wait.
    pub fn lock_noting_wait(&self) -> (std::sync::MutexGuard<'_, CollectedRecords>, bool) {
        match self.try_lock() {
            Some(g) => (g, false),
            None => (self.lock(), true),
        }
    }

    /// The lock if it is free now.
    fn try_lock(&self) -> Option<std::sync::MutexGuard<'_, CollectedRecords>> {
        match self.0.try_lock() {
            Ok(g) => Some(g),
            Err(std::sync::TryLockError::Poisoned(e)) => Some(e.into_inner()),
            Err(std::sync::TryLockError::WouldBlock) => None,
        }
    }
}

impl CollectedRecords {
    /// Records `id`'s delete if its limit is shared.
    pub fn record(&mut self, id: BucketId, bucket: &Bucket) {
        if !self.limits.contains(&id.limit()) {
            return;
        }
        if self.deleted.len() >= COLLECTED_MAX {
            self.dropped += 1;
            return;
        }
        self.deleted.push(SharedBucket {
            id,
            bucket: *bucket,
        });
    }
}

/// Every own bucket and prefix cell whose limit `wanted` accepts (by
/// `RuleEntry::id | index`, kind bits cleared), IPv4 then IPv6, a chunk at
/// a time, then the cells.
pub fn scan_shared(
    ids: &TableMaps,
    wanted: impl Fn(u32) -> bool,
) -> Result<Vec<SharedBucket>, DatapathError> {
    let mut out = Vec::new();
    let keep = |rule: u32| key_kind(rule) == KeyKind::Own && wanted(rule);
    scan_table_each::<Key4>(&ids.tables.0, MAP_SOURCES_V4, |k, b| {
        out.extend(
            k.iter()
                .zip(b)
                .filter(|(k, _)| keep(k.rule))
                .map(|(k, b)| SharedBucket {
                    id: BucketId::V4(*k),
                    bucket: *b,
                }),
        );
        Ok(())
    })?;
    scan_table_each::<Key6>(&ids.tables.1, MAP_SOURCES_V6, |k, b| {
        out.extend(
            k.iter()
                .zip(b)
                .filter(|(k, _)| keep(k.rule))
                .map(|(k, b)| SharedBucket {
                    id: BucketId::V6(*k),
                    bucket: *b,
                }),
        );
        Ok(())
    })?;
    let tables = Tables::open(ids)?;
    let cell_wanted = |rule: u32| wanted(rule & !KEY_CELL);
    out.extend(
        cells_of(&tables.cells4, cell_wanted)
            .into_iter()
            .map(|(k, bucket)| SharedBucket {
                id: BucketId::V4(k),
                bucket,
            }),
    );
    out.extend(
        cells_of(&tables.cells6, cell_wanted)
            .into_iter()
            .map(|(k, bucket)| SharedBucket {
                id: BucketId::V6(k),
                bucket,
            }),
    );
    Ok(out)
}

/// The cells of an array whose limit `wanted` accepts.
fn cells_of<K: KnownKey + PartialEq + BucketKey>(
    cells: &CellArray<K>,
    wanted: impl Fn(u32) -> bool,
) -> Vec<(K, Bucket)> {
    (0..cells.slots())
        .map(|i| cells.get(i))
        .filter(|c| cells.holds_its_key(c) && wanted(c.key.rule()))
        .map(|c| (c.key, c.bucket))
        .collect()
}

/// Handles on both tables and both cell arrays for [`Tables::raise`].
pub struct Tables {
    v4: HashMap<MapData, Key4, Bucket>,
    v6: HashMap<MapData, Key6, Bucket>,
    cells4: CellArray<Key4>,
    cells6: CellArray<Key6>,
}

impl Tables {
    pub fn open(ids: &TableMaps) -> Result<Tables, DatapathError> {
        let (t4, t6) = &ids.tables;
        let v4 = HashMap::try_from(aya::maps::Map::HashMap(t4.open()?))
            .map_err(|e| map_error(MAP_SOURCES_V4, e))?;
        let v6 = HashMap::try_from(aya::maps::Map::HashMap(t6.open()?))
            .map_err(|e| map_error(MAP_SOURCES_V6, e))?;
        let (cells4, cells6) = ids.cell_arrays()?;
        Ok(Tables {
            v4,
            v6,
            cells4,
            cells6,
        })
    }

    /// Moves the bucket's theoretical arrival time up to `tat_ns` (ktime)
    /// if it is earlier, keeping its counters. Returns whether it moved.
    ///
    /// Userspace cannot compare-and-swap a hash map's value: a packet
    /// charged by the kernel between this read and write is overwritten,
    /// so each raise of a source's own bucket may forget the packets of one
    /// syscall's span (a term of the documented bound). Cells are raised
    /// with an atomic maximum on their mapped word, losing nothing.
    pub fn raise(&mut self, id: &BucketId, tat_ns: u64) -> bool {
        let flags = 2; // BPF_EXIST: a bucket collected meanwhile stays gone.
        match id {
            BucketId::V4(k) if key_kind(k.rule) == KeyKind::Cell => {
                self.cells4.raise(k, tat_ns) == Some(true)
            }
            BucketId::V6(k) if key_kind(k.rule) == KeyKind::Cell => {
                self.cells6.raise(k, tat_ns) == Some(true)
            }
            BucketId::V4(k) => match self.v4.get(k, 0) {
                Ok(b) if b.tat_ns < tat_ns => {
                    self.v4.insert(k, Bucket { tat_ns, ..b }, flags).is_ok()
                }
                _ => false,
            },
            BucketId::V6(k) => match self.v6.get(k, 0) {
                Ok(b) if b.tat_ns < tat_ns => {
                    self.v6.insert(k, Bucket { tat_ns, ..b }, flags).is_ok()
                }
                _ => false,
            },
        }
    }
}
