//! Pressure on the bucket tables: the collector that deletes buckets whose
//! state is fresh again (so the tables never fill with state that says
//! nothing), table occupancy, and flood mode as the datapath reports it.
//! Runs on handles of its own: a walk of a million buckets never holds the
//! daemon's lock.

use std::collections::HashMap as StdHashMap;

use aya::maps::{Map, MapData, PerCpuArray};
use rl_common::*;

use super::{
    batch::delete_batch,
    cells::{CellArray, Mapped},
    known::{KnownFilter, RUN_GRACE},
    moves::FamilyMove,
    read::{scan_table_each, BucketKey, ChargedCell},
    *,
};

/// The tables the collector walks and the flood detector.
#[derive(Clone, Debug)]
pub struct TableMaps {
    pub tables: (MapRef, MapRef),
    /// The prefix-cell arrays (IPv4, IPv6), their key arrays and their
    /// claimed counts.
    pub cells: (MapRef, MapRef),
    pub cell_keys: (MapRef, MapRef),
    pub cell_seed: MapRef,
    pub cell_count: MapRef,
    /// The wide cells' counts (`rl_common::MAP_WIDE_COUNT`).
    pub wide_count: MapRef,
    /// The own buckets' counts and cap (`rl_common::MAP_OWNED`).
    pub owned: MapRef,
    pub flood: MapRef,
    pub known: MapRef,
}

impl TableMaps {
    /// Both families' cell arrays, mapped.
    pub fn cell_arrays(&self) -> Result<(CellArray<Key4>, CellArray<Key6>), DatapathError> {
        let seed = super::cells::cell_seed(&self.cell_seed)?;
        Ok((
            CellArray::open(
                (&self.cells.0, &self.cell_keys.0),
                (MAP_CELLS_V4, MAP_CELL_KEYS_V4),
                seed,
            )?,
            CellArray::open(
                (&self.cells.1, &self.cell_keys.1),
                (MAP_CELLS_V6, MAP_CELL_KEYS_V6),
                seed,
            )?,
        ))
    }
}

/// A bucket must have been fresh for this long before it is collected, so
/// a source that is still sending now and then keeps its bucket.
pub const COLLECT_IDLE_NS: u64 = 1_000_000_000;

/// What one pass found.
#[derive(Clone, Debug, Default)]
pub struct Pass {
    /// The source buckets left after the pass that have dropped packets
    /// (IPv4 then IPv6): all that ranking the top sources needs, so a pass
    /// over a million well-behaved sources holds none of them.
    pub sources: Vec<Source>,
    /// Buckets left per family (IPv4, IPv6): sources' own, prefix cells.
    pub own: (u64, u64),
    pub cells: (u64, u64),
    /// Of `cells`, the wide ones (`rl_common::pressure`), per family: the
    /// sums of `wide_rules`.
    pub wide: (u64, u64),
    /// Those wide cells by the rule they charge (`RuleEntry::id`), per
    /// family: whose floods went wide.
    pub wide_rules: std::collections::BTreeMap<u32, (u64, u64)>,
    /// Buckets deleted by this pass because they were fresh (or their
    /// rule is gone from both slots).
    pub collected: u64,
    /// Sources' buckets the pass found fresh, then kept when it decided
    /// again under the cluster records' lock (charged or raised meanwhile).
    pub kept_on_second_look: u64,
    /// The share of the known-keys filter's bits set after the pass's
    /// rebuild, per family (see `rl_common::known`).
    pub known_fill: (f64, f64),
    /// The cells left holding a charge, the most limiting first.
    pub charged_cells: super::read::ChargedCells,
}

/// The limits a bucket's key may name (`RuleEntry::id | index`), from both
/// slots: a snapshot taken after the walk, so every bucket it saw belongs
/// to a rule in it unless that rule is gone from both rule sets.
pub type LimitsByKey = StdHashMap<u32, LimitEntry>;

impl Datapath {
    /// The maps the collector, the flood reader and the cluster sync open.
    pub fn table_maps(&self) -> Result<TableMaps, DatapathError> {
        Ok(TableMaps {
            tables: self.source_maps()?,
            cells: (self.map_ref(MAP_CELLS_V4)?, self.map_ref(MAP_CELLS_V6)?),
            cell_keys: (
                self.map_ref(MAP_CELL_KEYS_V4)?,
                self.map_ref(MAP_CELL_KEYS_V6)?,
            ),
            cell_seed: self.map_ref(MAP_CELL_SEED)?,
            cell_count: self.map_ref(MAP_CELL_COUNT)?,
            wide_count: self.map_ref(MAP_WIDE_COUNT)?,
            owned: self.map_ref(MAP_OWNED)?,
            flood: self.map_ref(MAP_FLOOD)?,
            known: self.map_ref(MAP_KNOWN)?,
        })
    }

    /// The program's counts of wide cells (IPv4, IPv6; summed over the
    /// rules' entries of `rl_common::MAP_WIDE_COUNT`): never below the wide
    /// cells there are.
    pub fn wide_counts(&self) -> Result<(u64, u64), DatapathError> {
        let m = Mapped::open(&self.map_ref(MAP_WIDE_COUNT)?, MAP_WIDE_COUNT, 8)?;
        let sum = |family: u32| -> u64 {
            wide_entries(family)
                .map(|e| {
                    m.word(e as usize * 8)
                        .load(std::sync::atomic::Ordering::Acquire)
                })
                .sum()
        };
        Ok((sum(0), sum(1)))
    }

    /// Every limit of both slots by bucket key.
    pub fn limits_by_key(&self) -> Result<LimitsByKey, DatapathError> {
        let mut out = LimitsByKey::new();
        for slot in 0..2u32 {
            let contents = &self.slots[slot as usize];
            // Unknown (adopted, before this process's first installs; or
            // left by a failed install): as the map holds it.
            let read;
            let entries = if contents.unknown {
                read = self.slot_entries(slot)?;
                &read
            } else {
                &contents.entries
            };
            for r in entries.iter().filter(|r| is_rule_id(r.id)) {
                for which in 0..r.n_limits.min(MAX_LIMITS as u32) {
                    out.insert(r.id | which, r.limits[which as usize]);
                }
                if r.flags & RULE_ELASTIC != 0 {
                    out.insert(r.id | POOL_INDEX, r.pool);
                }
            }
        }
        Ok(out)
    }
}

/// Walks both bucket tables a chunk at a time (memory stays bounded by a
/// chunk and the sources with drops), deleting the buckets that have been
/// fresh for [`COLLECT_IDLE_NS`] (see `rl_common::pressure`: forgetting them
/// changes no verdict), and every bucket of a rule gone from both slots. A
/// live rule's last resorts are kept (they are few, and a full table could
/// not take them back). `limits` must stay exact for the whole walk: the
/// caller holds rule changes off (a limit id names one definition forever,
/// but a rule installed during the walk would look gone).
///
/// The walk also rebuilds the known-keys filter: only a walk that completes
/// flips it, so a failed one leaves the old half in use (stale bits cost
/// lookups, never verdicts). Then it frees the prefix cells that are fresh
/// (or whose rule is gone) in the cell arrays.
pub fn collect(
    ids: &TableMaps,
    epoch_offset_ns: u64,
    limits: &LimitsByKey,
    known: &KnownFilter,
) -> Result<Pass, DatapathError> {
    collect_handing(ids, epoch_offset_ns, limits, known, None)
}

/// [`collect`], recording in `handoff` the deletes of the limits it names
/// (the cluster rules': see [`Collected`](super::share::Collected)).
pub fn collect_handing(
    ids: &TableMaps,
    epoch_offset_ns: u64,
    limits: &LimitsByKey,
    known: &KnownFilter,
    handoff: Option<&super::share::Collected>,
) -> Result<Pass, DatapathError> {
    let mut pass = Pass::default();
    let half = known.begin();
    let (cells4, cells6) = ids.cell_arrays()?;
    let owned = Mapped::open(&ids.owned, MAP_OWNED, 8)?;
    let mut walk = Walk {
        limits,
        epoch_offset_ns,
        known,
        half,
        own: 0,
        moved: 0,
        handoff,
    };
    let before = walk.owned_before(&owned, OWNED_V4);
    scan_table_each::<Key4>(&ids.tables.0, MAP_SOURCES_V4, |k, b| {
        walk.sweep(&ids.tables.0, MAP_SOURCES_V4, &cells4, k, b, &mut pass)
    })?;
    pass.own.0 = walk.owned_after(&owned, OWNED_V4, before);
    let before = walk.owned_before(&owned, OWNED_V6);
    scan_table_each::<Key6>(&ids.tables.1, MAP_SOURCES_V6, |k, b| {
        walk.sweep(&ids.tables.1, MAP_SOURCES_V6, &cells6, k, b, &mut pass)
    })?;
    pass.own.1 = walk.owned_after(&owned, OWNED_V6, before);
    let counts = Mapped::open(&ids.wide_count, MAP_WIDE_COUNT, 8)?;
    pass.cells = (
        walk.cells(&cells4, &counts, 0, &mut pass),
        walk.cells(&cells6, &counts, 1, &mut pass),
    );
    pass.wide = pass
        .wide_rules
        .values()
        .fold((0, 0), |(a, b), (w4, w6)| (a + w4, b + w6));
    pass.charged_cells.settle();
    known.finish(half);
    pass.known_fill = (known.fill(0), known.fill(1));
    let count = Mapped::open(&ids.cell_count, MAP_CELL_COUNT, 8)?;
    count
        .word(0)
        .store(pass.cells.0, std::sync::atomic::Ordering::Relaxed);
    count
        .word(8)
        .store(pass.cells.1, std::sync::atomic::Ordering::Relaxed);
    if walk.moved > 0 {
        tracing::info!(cells = walk.moved, "moved the prefix cells an older build kept in the sources' tables into the cell arrays");
    }
    Ok(pass)
}

/// One walk's settings and counts.
struct Walk<'a> {
    limits: &'a LimitsByKey,
    epoch_offset_ns: u64,
    known: &'a KnownFilter,
    /// The filter half being rebuilt.
    half: u32,
    /// Own buckets the sweep of one family kept.
    own: u64,
    /// Cells found in the sources' tables (left by an older build) and moved.
    moved: u64,
    /// Where deletes of cluster rules' buckets are recorded.
    handoff: Option<&'a super::share::Collected>,
}

impl Walk<'_> {
    /// The program's count of a family's own buckets (`MAP_OWNED` entry
    /// `family`) as its sweep starts.
    fn owned_before(&mut self, owned: &Mapped, family: u32) -> u64 {
        self.own = 0;
        owned
            .word(family as usize * 8)
            .load(std::sync::atomic::Ordering::Acquire)
    }

    /// After a family's sweep: sets the program's count to the own
    /// buckets the sweep kept plus those inserted since it started (the
    /// program's count moved by them meanwhile), so it follows the
    /// sweep's deletes and mends any drift (pins adopted from a build
    /// without the count). An insert the sweep also saw stays counted
    /// twice until the next walk: the safe side, the cap bites early by
    /// that many. Returns the own buckets kept.
    fn owned_after(&mut self, owned: &Mapped, family: u32, before: u64) -> u64 {
        owned.word(family as usize * 8).fetch_add(
            self.own.wrapping_sub(before),
            std::sync::atomic::Ordering::AcqRel,
        );
        self.own
    }

    /// Deletes the fresh (or orphaned) buckets of one chunk of a table;
    /// counts the rest, marks them in the filter and keeps the sources
    /// among them that have dropped packets.
    #[allow(clippy::too_many_arguments)]
    fn sweep<K: BucketKey + KnownKey + PartialEq>(
        &mut self,
        id: &MapRef,
        name: &'static str,
        cells: &CellArray<K>,
        keys: &[K],
        buckets: &[Bucket],
        pass: &mut Pass,
    ) -> Result<(), DatapathError> {
        use std::os::fd::{AsFd, AsRawFd};
        let mut dead = Vec::new();
        // Read after the chunk: no word in it is of a later window.
        let now = monotonic_ns();
        for (k, b) in keys.iter().zip(buckets) {
            if key_kind(k.rule()) == KeyKind::Cell {
                // An older build's cell: into the array (merged into the
                // copy moved before the program swap, see `move_old_cells`).
                let to = FamilyMove {
                    table: id,
                    name,
                    cells,
                    limits: self.limits,
                    epoch_offset_ns: self.epoch_offset_ns,
                };
                self.moved += to.found([(*k, *b)])?;
                dead.push((*k, *b));
                continue;
            }
            // A last resort goes only with its rule: it is the parent of
            // its rule's every key.
            let gone = match key_kind(k.rule()) {
                KeyKind::LastResort => !self.limits.contains_key(&limit_of_key(k.rule())),
                _ => self.gone_at(k, b, now),
            };
            if gone {
                dead.push((*k, *b));
            } else if key_kind(k.rule()) == KeyKind::Own {
                self.keep_own(k, b, pass);
            }
        }
        if dead.is_empty() {
            return Ok(());
        }
        let data = id.open()?;
        let fd = data.fd().as_fd().as_raw_fd();
        let Some(handoff) = self.handoff else {
            let keys: Vec<K> = dead.iter().map(|(k, _)| *k).collect();
            delete_batch(fd, &keys).map_err(|e| map_error(name, e))?;
            pass.collected += keys.len() as u64;
            return Ok(());
        };
        // Under the lock from the decision to the records (see
        // `Collected`): the buckets of shared limits are decided again
        // (the sync may have raised one since the chunk was read), and if
        // taking the lock waited out a sync's walk, every source's bucket
        // is: one charged meanwhile stays.
        let (mut records, waited) = handoff.lock_noting_wait();
        let again = |k: &K| {
            key_kind(k.rule()) == KeyKind::Own
                && (waited || records.limits.contains(&limit_of_key(k.rule())))
        };
        if dead.iter().any(|(k, _)| again(k)) {
            let table: aya::maps::HashMap<MapData, K, Bucket> =
                aya::maps::HashMap::try_from(aya::maps::Map::HashMap(id.open()?))
                    .map_err(|e| map_error(name, e))?;
            let now = monotonic_ns();
            let mut still = Vec::with_capacity(dead.len());
            for (k, b) in dead {
                if !again(&k) {
                    still.push((k, b));
                    continue;
                }
                match table.get(&k, 0) {
                    Ok(b) if self.gone_at(&k, &b, now) => still.push((k, b)),
                    Ok(b) => {
                        self.keep_own(&k, &b, pass);
                        pass.kept_on_second_look += 1;
                    }
                    Err(_) => {}
                }
            }
            dead = still;
        }
        let keys: Vec<K> = dead.iter().map(|(k, _)| *k).collect();
        if let Err(e) = delete_batch(fd, &keys) {
            // Some may be gone unrecorded: the sync falls back for a round.
            records.dropped += keys.len() as u64;
            return Err(map_error(name, e));
        }
        for (k, b) in dead
            .iter()
            .filter(|(k, _)| key_kind(k.rule()) == KeyKind::Own)
        {
            records.record(k.id(), b);
        }
        pass.collected += keys.len() as u64;
        Ok(())
    }

    /// Counts a source's own bucket the sweep keeps, marks it in the
    /// filter half being rebuilt and keeps it among the sources with drops.
    fn keep_own<K: BucketKey + KnownKey>(&mut self, k: &K, b: &Bucket, pass: &mut Pass) {
        self.own += 1;
        self.known.mark(self.half, k);
        if b.dropped > 0 {
            pass.sources.push(Source::of(k, *b));
        }
    }
}

impl Walk<'_> {
    /// Frees the cells of one array that are fresh (or whose rule is gone)
    /// and marks the rest in the filter half being rebuilt; returns how
    /// many are left, and counts the wide ones by rule in `pass`. Freeing takes two
    /// steps with a grace between them (`rl_common::cells`): a cell charged
    /// meanwhile is kept, not lost. Then sets the program's counts per rule
    /// (`rl_common::MAP_WIDE_COUNT`, this `family`'s entries) as
    /// [`owned_after`](Self::owned_after) does own buckets': the cells kept
    /// plus those claimed since the walk began, so a rule's wide count is
    /// never below the wide cells it has. A walk that met a slot whose key
    /// cannot be told (being written, or its key not yet written) leaves
    /// the counts as they are (they only grew meanwhile).
    fn cells<K: BucketKey + KnownKey + PartialEq>(
        &self,
        cells: &CellArray<K>,
        counts: &Mapped,
        family: u32,
        pass: &mut Pass,
    ) -> u64 {
        let entries: Vec<u32> = wide_entries(family).flat_map(|e| [e, e + 1]).collect();
        let word = |e: u32| counts.word(e as usize * 8);
        let before: Vec<u64> = entries
            .iter()
            .map(|&e| word(e).load(std::sync::atomic::Ordering::Acquire))
            .collect();
        let mut kept = vec![0u64; WIDE_ENTRIES as usize];
        let (left, unknown) = self.free_cells(cells, family, &mut kept, pass);
        if !unknown {
            for (&e, b) in entries.iter().zip(before) {
                word(e).fetch_add(
                    kept[e as usize].wrapping_sub(b),
                    std::sync::atomic::Ordering::AcqRel,
                );
            }
        }
        left
    }

    /// [`cells`](Self::cells)' walk: the cells left, each counted in `kept`
    /// at its rule's entry, and whether some slot's key could not be told.
    fn free_cells<K: BucketKey + KnownKey + PartialEq>(
        &self,
        cells: &CellArray<K>,
        family: u32,
        kept: &mut [u64],
        pass: &mut Pass,
    ) -> (u64, bool) {
        // Held from the first step of each free until its record is in (a
        // dying cell is in no walk of the sync: gone for it from then on),
        // when the sync shares some limit.
        let mut records = self
            .handoff
            .map(super::share::Collected::lock)
            .filter(|r| !r.limits.is_empty());
        let (mut left, mut unknown) = (0, false);
        let (wide_rules, charged, now) = (
            &mut pass.wide_rules,
            &mut pass.charged_cells,
            monotonic_ns(),
        );
        let mut keep = |k: &K| {
            let e = wide_entry(k.rule(), family) + u32::from(!is_wide(k.rule()));
            kept[e as usize] += 1;
            if is_wide(k.rule()) {
                let n = wide_rules.entry(k.rule() & RULE_ID_MASK).or_default();
                *if family == 0 { &mut n.0 } else { &mut n.1 } += 1;
            }
        };
        let (mut dying, mut writing) = (Vec::new(), Vec::new());
        for i in 0..cells.slots() {
            let c = cells.get(i);
            match c.claim & 3 {
                // Free.
                _ if c.claim == 0 => {}
                // Dying: a daemon stopped between the two steps of a free.
                2 if c.claim == cell_dying(cells.claim_of(&c.key)) => dying.push((i, c.key)),
                // Claimed for its key.
                1 if cells.holds_its_key(&c) => {
                    if self.gone(&c.key, &c.bucket) && cells.begin_free(i, &c.key) {
                        dying.push((i, c.key));
                    } else {
                        self.known.mark(self.half, &c.key);
                        keep(&c.key);
                        left += 1;
                        if let Some(l) = self.limits.get(&limit_of_key(c.key.rule())) {
                            let (wide, word) = (is_wide(c.key.rule()), c.bucket.tat_ns);
                            let cell = ChargedCell {
                                limit: limit_of_key(c.key.rule()),
                                addr: c.key.addr(),
                                wide,
                                drained: false,
                                room_eighths: 0,
                                word,
                            };
                            charged.offer(family, l, cell, now, self.epoch_offset_ns);
                        }
                    }
                }
                // Being claimed this instant (the program marked it before
                // claiming, in both halves: its run began after the
                // rebuild's flag, `KnownFilter::begin`): only a daemon that
                // stopped in the middle of a move leaves it so for longer.
                3 => writing.push((i, c.claim)),
                // Claimed for a key whose key is not written yet.
                _ => {
                    unknown = true;
                    left += 1;
                }
            }
        }
        if dying.is_empty() && writing.is_empty() {
            return (left, unknown);
        }
        super::grace::wait(RUN_GRACE);
        for (i, claim) in writing {
            // Still the same word a grace later: no program run is writing it.
            if cells.release_writing(i, claim) {
                pass.collected += 1;
            } else {
                unknown = true;
                left += 1;
            }
        }
        for (i, key) in dying {
            let counts = cells.get(i).bucket;
            if cells.finish_free(i, &key, |b| self.gone(&key, b)) {
                if let Some(r) = records.as_mut() {
                    r.record(key.id(), &counts);
                }
                pass.collected += 1;
            } else {
                self.known.mark(self.half, &key);
                keep(&key);
                left += 1;
            }
        }
        (left, unknown)
    }

    /// Whether cell `key` holding `b` (read just before) may go: idle and
    /// fresh, or its rule is gone.
    fn gone<K: BucketKey>(&self, key: &K, b: &Bucket) -> bool {
        self.gone_at(key, b, monotonic_ns())
    }

    /// Whether bucket `key` holding `b`, read before `now`, may go: idle
    /// and fresh, or its rule is gone.
    fn gone_at<K: BucketKey>(&self, key: &K, b: &Bucket, now: u64) -> bool {
        match self.limits.get(&limit_of_key(key.rule())) {
            None => true,
            Some(l) => self.idle(l, b, now),
        }
    }

    /// Whether bucket `b` of `limit`, read before `now`, has been fresh
    /// since [`COLLECT_IDLE_NS`] before `now`: a source still sending now
    /// and then keeps its bucket, and a window counts as over only that
    /// long after its end, whatever tick the datapath's coarse clock lags
    /// by. A word of a window after that time (charged since) is never
    /// fresh (`LimitEntry::is_fresh`).
    fn idle(&self, limit: &LimitEntry, b: &Bucket, now: u64) -> bool {
        limit.is_fresh(
            b.tat_ns,
            now.saturating_sub(COLLECT_IDLE_NS),
            self.epoch_offset_ns,
        )
    }
}

/// The `rl_common::MAP_WIDE_COUNT` entries of `family`'s wide-cell counts,
/// one per rule slot (each rule's count of other cells is the next entry).
fn wide_entries(family: u32) -> impl Iterator<Item = u32> {
    (0..WIDE_RULE_SLOTS).map(move |r| wide_entry(r << 3, family))
}

/// Flood mode as the datapath's per-CPU detectors report it.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct FloodReading {
    /// Some CPU charged an unseen key to a fallback in flood mode within
    /// the last [`FLOOD_REPORT_HOLD_NS`].
    pub on: bool,
    /// Of the CPUs, how many are so: each measures its own share of
    /// `flood_new_keys_per_sec`, so one CPU alone in flood mode under a
    /// low host-wide rate points at uneven receive queues.
    pub cpus_on: u32,
    /// The online CPUs, which share the rate (by [`flood_mode`]; the
    /// detectors read, by [`FloodReading::of`]).
    pub cpus: u32,
    /// Keys the CPUs found no bucket for in the last whole flood window
    /// (about 67 ms), summed.
    pub unseen_last_window: u64,
}

/// How long flood mode is still reported after the last key charged to a
/// fallback in flood mode: two seconds, so that a flood with short lulls
/// (the detector's windows are 67 ms) is one episode, not a flapping
/// signal, and a flood-mode spell between two of the daemon's readings (a
/// second apart, give or take a walk) is still seen by the next one.
pub const FLOOD_REPORT_HOLD_NS: u64 = 2_000_000_000;

/// Reads the flood detectors.
pub fn flood_mode(ids: &TableMaps) -> Result<FloodReading, DatapathError> {
    let data = ids.flood.open()?;
    let arr: PerCpuArray<MapData, FloodState> =
        PerCpuArray::try_from(Map::PerCpuArray(data)).map_err(|e| map_error(MAP_FLOOD, e))?;
    let per_cpu = arr.get(&0, 0).map_err(|e| map_error(MAP_FLOOD, e))?;
    let r = FloodReading::of(per_cpu.iter(), coarse_monotonic_ns());
    // The CPUs that share the rate: the online ones, not every possible one.
    Ok(FloodReading {
        cpus: aya::util::online_cpus().map_or(r.cpus, |c| c.len() as u32),
        ..r
    })
}

impl FloodReading {
    /// What the CPUs' detectors say at `now` (ns on their clock).
    fn of<'a>(per_cpu: impl Iterator<Item = &'a FloodState>, now: u64) -> Self {
        let current = now >> FLOOD_WINDOW_SHIFT;
        let mut r = FloodReading::default();
        for s in per_cpu {
            let on = s.flooding(now, FLOOD_REPORT_HOLD_NS);
            r.on |= on;
            r.cpus_on += u32::from(on);
            r.cpus += 1;
            // The last whole window: `unseen` if the CPU has not moved on
            // since, else `prev_unseen` if it moved on just now.
            r.unseen_last_window += if s.window + 1 == current {
                s.unseen
            } else if s.window == current {
                s.prev_unseen
            } else {
                0
            };
        }
        r
    }
}

/// `CLOCK_MONOTONIC_COARSE` in ns: within a tick of the clock the flood
/// detectors keep (jiffies on the ktime scale, `TickClock::at`).
fn coarse_monotonic_ns() -> u64 {
    let mut ts = libc::timespec {
        tv_sec: 0,
        tv_nsec: 0,
    };
    unsafe { libc::clock_gettime(libc::CLOCK_MONOTONIC_COARSE, &mut ts) };
    ts.tv_sec as u64 * 1_000_000_000 + ts.tv_nsec as u64
}

#[cfg(test)]
mod tests {
    use super::*;

    const W: u64 = 1 << FLOOD_WINDOW_SHIFT;

    fn cpu(last_flood_ns: u64, window: u64, unseen: u64, prev_unseen: u64) -> FloodState {
        FloodState {
            window,
            unseen,
            prev_unseen,
            full_window: 0,
            last_flood_ns,
        }
    }

    #[test]
    fn flood_mode_is_held_two_seconds_past_the_detectors_short_windows() {
        let now = 1000 * W + 5;
        // 1.9 s since the last flood-mode charge: over two dozen windows,
        // but one episode still.
        let lull = [cpu(now - 1_900_000_000, 972, 0, 0), cpu(0, 0, 0, 0)];
        let r = FloodReading::of(lull.iter(), now);
        assert!(r.on && (r.cpus_on, r.cpus) == (1, 2), "{r:?}");
        let both = [
            cpu(now - 5, 1000, 0, 0),
            cpu(now - 1_000_000_000, 985, 0, 0),
            cpu(0, 0, 0, 0),
        ];
        assert_eq!(FloodReading::of(both.iter(), now).cpus_on, 2);
        let ended = [cpu(now - 2_100_000_000, 969, 0, 0), cpu(0, 0, 0, 0)];
        let r = FloodReading::of(ended.iter(), now);
        assert!(!r.on && r.cpus_on == 0, "two seconds and more after: ended");
        assert!(
            !FloodReading::of([cpu(0, 1000, 5, 5)].iter(), now).on,
            "never flooded"
        );
    }

    #[test]
    fn the_unseen_rate_sums_each_cpus_last_whole_window() {
        let now = 1000 * W + 5;
        let cpus = [
            cpu(0, 999, 300, 7),  // not moved on since: its current count
            cpu(0, 1000, 9, 200), // moved on just now: the one before
            cpu(0, 990, 50, 50),  // idle since: nothing
        ];
        assert_eq!(FloodReading::of(cpus.iter(), now).unseen_last_window, 500);
    }
}
