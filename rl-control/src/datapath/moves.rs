//! Moving the prefix cells of an older build (kept in the sources' tables,
//! or in 64-byte arrays) into this build's cell arrays when its pins are
//! adopted, before the program swap and in the collector's first pass.

use aya::maps::Map;
use rl_common::*;

use super::{
    cells::{old_cells, CellArray},
    known::RUN_GRACE,
    pressure::LimitsByKey,
    read::{scan_table_each, BucketKey},
    *,
};

/// Where one family's cells from an older build go: its cell array, and,
/// for a cell whose set has no room, its rule's last resort in the
/// family's table (`table`, `name`).
pub(super) struct FamilyMove<'a, K> {
    pub(super) table: &'a MapRef,
    pub(super) name: &'static str,
    pub(super) cells: &'a CellArray<K>,
    pub(super) limits: &'a LimitsByKey,
    pub(super) epoch_offset_ns: u64,
}

impl<K: BucketKey + KnownKey + PartialEq> FamilyMove<'_, K> {
    /// Moves the cells among `found`, as (key, state), each as
    /// [`FamilyMove::one`] does (a cell whose rule is gone is left);
    /// returns how many.
    pub(super) fn found(
        &self,
        found: impl IntoIterator<Item = (K, Bucket)>,
    ) -> Result<u64, DatapathError> {
        let mut moved = 0;
        for (k, b) in found {
            if let (KeyKind::Cell, Some(l)) =
                (key_kind(k.rule()), self.limits.get(&(k.rule() & !KEY_CELL)))
            {
                self.one(&k, &b, l)?;
                moved += 1;
            }
        }
        Ok(moved)
    }

    /// The cells an older build kept in the family's table
    /// ([`Datapath::move_old_cells`]).
    fn table_cells(&self) -> Result<u64, DatapathError> {
        let mut moved = 0;
        scan_table_each::<K>(self.table, self.name, |keys, buckets| {
            moved += self.found(keys.iter().copied().zip(buckets.iter().copied()))?;
            Ok(())
        })?;
        Ok(moved)
    }

    /// Moves cell `k` of an older build, with state `b` under `limit`, into
    /// the cell array, merged with the cell there if there is one; if its
    /// set has no room, merges it into its rule's last resort. Never
    /// forgotten, never handed a fresh allowance. The old copy is left for
    /// its owner to delete.
    fn one(&self, k: &K, b: &Bucket, limit: &LimitEntry) -> Result<(), DatapathError> {
        // In a window's first tick a datapath on the tick clock may still be in
        // the window before: merge after it, on a clock read after the words.
        std::thread::sleep(std::time::Duration::from_nanos(
            limit.merge_wait_ns(monotonic_ns(), self.epoch_offset_ns),
        ));
        let merge = |x, y| limit.merge(x, y, monotonic_ns(), self.epoch_offset_ns);
        if self.cells.adopt(k, *b, merge) {
            return Ok(());
        }
        let data = self.table.open()?;
        let mut table: aya::maps::HashMap<MapData, K, Bucket> =
            aya::maps::HashMap::try_from(Map::HashMap(data))
                .map_err(|e| map_error(self.name, e))?;
        let last = k.last_resort();
        let l = table.get(&last, 0).unwrap_or_default();
        let tat_ns = merge(l.tat_ns, b.tat_ns);
        // Written only if it moves: a plain write may forget a charge the
        // program makes between the read and it (a hash map's value has no
        // compare-and-swap from userspace).
        if tat_ns == l.tat_ns {
            return Ok(());
        }
        table
            .insert(last, Bucket { tat_ns, ..l }, 0)
            .map_err(|e| map_error(self.name, e))
    }
}

/// The tables, the limits and the cell arrays a move of an older build's
/// cells writes to.
struct MoveTargets {
    ids: TableMaps,
    limits: LimitsByKey,
    cells: (CellArray<Key4>, CellArray<Key6>),
}

impl MoveTargets {
    fn v4(&self, epoch_offset_ns: u64) -> FamilyMove<'_, Key4> {
        let (table, name) = (&self.ids.tables.0, MAP_SOURCES_V4);
        FamilyMove {
            table,
            name,
            cells: &self.cells.0,
            limits: &self.limits,
            epoch_offset_ns,
        }
    }

    fn v6(&self, epoch_offset_ns: u64) -> FamilyMove<'_, Key6> {
        let (table, name) = (&self.ids.tables.1, MAP_SOURCES_V6);
        FamilyMove {
            table,
            name,
            cells: &self.cells.1,
            limits: &self.limits,
            epoch_offset_ns,
        }
    }
}

impl Datapath {
    /// On adopting pins from a build that kept prefix cells elsewhere (in
    /// the sources' tables, or in 64-byte arrays): copies those cells into
    /// this build's cell arrays before its program is swapped in, so that
    /// no prefix finds its cell missing and is charged a copy of its rule's
    /// last resort instead (a fresh allowance). The old program charges the
    /// old copies until the swap: the collector's first pass merges the
    /// tables' in and deletes them, [`Datapath::cells_moved`] the arrays'.
    /// Returns how many cells were copied.
    pub fn move_old_cells(&self) -> Result<u64, DatapathError> {
        let to = self.move_targets()?;
        let mut moved = 0;
        if self.cells_from_tables {
            moved += to.v4(self.epoch_offset_ns).table_cells()?
                + to.v6(self.epoch_offset_ns).table_cells()?;
        }
        Ok(moved + self.move_old_arrays(&to)?)
    }

    /// What a move of an older build's cells writes to, opened once.
    fn move_targets(&self) -> Result<MoveTargets, DatapathError> {
        let ids = self.table_maps()?;
        Ok(MoveTargets {
            limits: self.limits_by_key()?,
            cells: ids.cell_arrays()?,
            ids,
        })
    }

    /// The cells of the 64-byte arrays still pinned, if any, into this
    /// build's arrays; returns how many.
    fn move_old_arrays(&self, to: &MoveTargets) -> Result<u64, DatapathError> {
        let (true, Some(dir)) = (self.old_arrays, &self.pins) else {
            return Ok(0);
        };
        // An older build pinned both arrays; a family's may be gone if a
        // daemon stopped while unpinning them.
        let old = |name| {
            let path = dir.join(name);
            path.exists().then_some(path)
        };
        let mut moved = 0;
        if let Some(path) = old(MAP_OLD_CELLS_V4) {
            moved += to
                .v4(self.epoch_offset_ns)
                .found(old_cells::<Key4>(&path, MAP_OLD_CELLS_V4)?)?;
        }
        if let Some(path) = old(MAP_OLD_CELLS_V6) {
            moved += to
                .v6(self.epoch_offset_ns)
                .found(old_cells::<Key6>(&path, MAP_OLD_CELLS_V6)?)?;
        }
        Ok(moved)
    }

    /// Marks the move of an older build's cells done, once this build's
    /// program is attached. Cells from the sources' tables: pins `RL_CELLN`
    /// (until then a restart moves them again: the old program may have
    /// kept charging and making cells in the tables if the swap failed).
    /// Cells from 64-byte arrays: once the old program's last runs are
    /// over, merges in what it charged since the copy, then unpins the old
    /// arrays. Returns how many old cells that merge saw.
    pub fn cells_moved(&mut self) -> Result<u64, DatapathError> {
        let mut merged = 0;
        if let (true, Some(dir)) = (self.old_arrays, self.pins.clone()) {
            super::grace::wait(RUN_GRACE);
            merged = self.move_old_arrays(&self.move_targets()?)?;
            for name in [MAP_OLD_CELLS_V4, MAP_OLD_CELLS_V6] {
                let path = dir.join(name);
                if path.exists() {
                    std::fs::remove_file(&path).map_err(|e| {
                        DatapathError::Load(format!("unpinning {}: {e}", path.display()))
                    })?;
                }
            }
            self.old_arrays = false;
        }
        if let (true, Some(dir)) = (self.cells_from_tables, &self.pins) {
            let path = dir.join(MAP_CELL_COUNT);
            let map = self
                .ebpf
                .map(MAP_CELL_COUNT)
                .ok_or_else(|| DatapathError::Load(format!("map {MAP_CELL_COUNT} is missing")))?;
            map.pin(&path)
                .map_err(|e| DatapathError::Load(format!("pinning {}: {e}", path.display())))?;
        }
        self.cells_from_tables = false;
        Ok(merged)
    }
}
