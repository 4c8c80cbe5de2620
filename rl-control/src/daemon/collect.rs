//! The collectors: every second they free what is fresh again (buckets in
//! the datapath's tables, keys in the request store), and the tables' walk
//! records the pressure on them, raises the flood and full-table events
//! and ranks the top sources.

use std::{
    collections::BTreeMap,
    net::IpAddr,
    sync::Arc,
    time::{Duration, Instant},
};

use tracing::{info, warn};

use crate::{
    config::unix_now_ms,
    daemon::state::{lock, Pressure, Shared, State, WideCellRule},
    datapath::{DatapathError, KnownFilter, Pass, TableMaps},
};

/// How often the collector walks the bucket tables.
const COLLECT_INTERVAL: Duration = Duration::from_secs(1);
/// How often the top-sources list is ranked (every this many passes).
const TOP_EVERY: u32 = 5;

/// Sweeps the request-bucket store's shards in turn, one every
/// `COLLECT_INTERVAL / SHARDS`: every key is looked at once per interval,
/// and no sweep takes a CPU or a shard lock for long (a million keys in one
/// go took ~20 ms of a CPU, which showed as a tail in the answers).
pub(super) async fn sweep_requests(l7: crate::l7::http::Shared) {
    let shards = crate::l7::engine::Engine::SHARDS;
    let mut every = tokio::time::interval(COLLECT_INTERVAL / shards as u32);
    every.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    for i in (0..shards).cycle() {
        every.tick().await;
        let l7 = l7.clone();
        let _ = tokio::task::spawn_blocking(move || {
            // The rules in force for the whole sweep: a bucket of a rule
            // that a change just added is unknown to the engine before it,
            // and would be dropped as if its rule were gone.
            let _changes = crate::daemon::apply::hold_changes();
            let engine = l7.read().unwrap_or_else(|e| e.into_inner()).clone();
            engine.collect_shard(i)
        })
        .await;
    }
}

/// Walks the bucket tables every second (every TOP_EVERY seconds while they
/// are under 1% full, never while empty) through handles of its own, so a
/// walk of a million buckets never holds the state lock: deletes buckets
/// that are fresh again, records the pressure on the tables, and every few
/// passes ranks sources by their drops. A pass that fails is reported
/// (`pressure.collector.walk`, a `walk_failing` event) and tried again a
/// second later: the collector never stops for good while the daemon runs.
pub(super) async fn watch_pressure(state: Shared, ids: TableMaps) {
    let mut every = tokio::time::interval(COLLECT_INTERVAL);
    every.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    let mut collector = Collector::default();
    let mut known: Option<Arc<KnownFilter>> = None;
    loop {
        every.tick().await;
        let walk = collector.plan(&state);
        let (st, filter, ids) = (state.clone(), known.clone(), ids.clone());
        let walked = tokio::task::spawn_blocking(move || {
            let filter = match filter {
                Some(f) => f,
                None => Arc::new(KnownFilter::open(&ids.known)?),
            };
            // No rule change during the walk: its limits stay exact.
            let _changes = crate::daemon::apply::hold_changes();
            let pass = match walk {
                Some(offset) => {
                    let (limits, collected) = {
                        let s = lock(&st);
                        (s.dp.limits_by_key()?, s.collected.clone())
                    };
                    Some(crate::datapath::collect_handing(
                        &ids,
                        offset,
                        &limits,
                        &filter,
                        Some(&collected),
                    )?)
                }
                None => None,
            };
            Ok::<_, DatapathError>((pass, filter))
        })
        .await;
        let walked = outcome(walked);
        let ranked = match &walked {
            Ok((pass, _)) => collector.rank(pass.as_ref()),
            Err(_) => None,
        };
        let mut s = lock(&state);
        match walked {
            Ok((pass, filter)) => {
                known = Some(filter);
                collector.record(&mut s, pass, ranked);
                tried(&mut s, Reader::Walk, Ok(()));
            }
            Err(e) => {
                // Walk the next time whatever the tables hold.
                collector.left = u64::MAX;
                tried(&mut s, Reader::Walk, Err(e));
            }
        }
    }
}

/// A reader's pass as run on the blocking pool: its error, or how the
/// pass ended abnormally (a panic), as the one line its health keeps.
pub(super) fn outcome<T>(
    joined: Result<Result<T, DatapathError>, tokio::task::JoinError>,
) -> Result<T, String> {
    match joined {
        Ok(r) => r.map_err(|e| e.to_string()),
        Err(e) => Err(format!("the pass ended abnormally: {e}")),
    }
}

/// The daemon's background readers.
#[derive(Clone, Copy, Debug)]
pub(super) enum Reader {
    Walk,
    FloodReading,
    Events,
}

/// Records how a reader's pass went: a new failure, or a recovery, is
/// logged and raised as an event (`walk_failing`, `walk_recovered`,
/// `flood_reading_failing`, `flood_reading_recovered`, `events_failing`,
/// `events_recovered`) once.
pub(super) fn tried(s: &mut State, reader: Reader, outcome: Result<(), String>) {
    use crate::daemon::state::Went;
    let now = unix_now_ms();
    let (health, name, stale) = match reader {
        Reader::Walk => (
            &mut s.pressure.collector.walk,
            "walk",
            "buckets are not collected (the tables fill, and new sources share their prefix cells), and occupancy, cells and the top lists stay as last read",
        ),
        Reader::FloodReading => (
            &mut s.pressure.collector.flood_reading,
            "flood_reading",
            "flood mode, its CPUs and unseen keys per second stay as last read, and no flood event is raised",
        ),
        Reader::Events => (
            &mut s.pressure.collector.events,
            "events",
            "sources that start being limited are not recorded (/v1/events, the logs); the datapath limits them as before",
        ),
    };
    let error = outcome.as_ref().err().cloned().unwrap_or_default();
    match health.went(outcome, now) {
        Went::Unchanged => {}
        Went::Failing => {
            let event = format!("{name}_failing");
            warn!(event, %error, "the collector's {} fails: {error}; tried again every second; until then {stale}", name.replace('_', " "));
            s.push_host_event(&event, now);
        }
        Went::Recovered => {
            let event = format!("{name}_recovered");
            info!(
                event,
                "the collector's {} works again",
                name.replace('_', " ")
            );
            s.push_host_event(&event, now);
        }
    }
}

/// What the tables' collector keeps from one pass to the next.
struct Collector {
    top: TopRanker,
    /// When the last pass was recorded, and the buckets created by then.
    last: Option<(Instant, u64)>,
    passes: u32,
    /// Buckets the last walk left, and the datapath's inserts before it.
    left: u64,
    inserted_at_walk: u64,
    /// The refusals at the last good reading (the counters are pinned and
    /// count across restarts: the first reading is a baseline, no event),
    /// and when the last new one was seen.
    refusals: Option<u64>,
    refused_at: Option<Instant>,
}

impl Default for Collector {
    fn default() -> Self {
        Collector {
            top: TopRanker::default(),
            last: None,
            passes: 0,
            left: u64::MAX,
            inserted_at_walk: 0,
            refusals: None,
            refused_at: None,
        }
    }
}

impl Collector {
    /// Whether this pass walks the tables: `Some(epoch offset)` to walk.
    ///
    /// A walk visits every bucket of the tables' capacity: milliseconds of
    /// CPU for a million, in one system call, even when they are empty.
    /// Empty with nothing inserted since: nothing to walk. Under 1% full:
    /// only when the top sources are ranked (every TOP_EVERY passes); the
    /// few fresh buckets can wait, the room is there.
    fn plan(&mut self, state: &Shared) -> Option<u64> {
        let (offset, inserted, capacity) = {
            let s = lock(state);
            let c = s.dp.counters().unwrap_or_default();
            let inserted = c.get(rl_common::STAT_NEW_SOURCES) + c.get(rl_common::STAT_NEW_CELLS);
            (
                s.dp.epoch_offset_ns(),
                inserted,
                2 * u64::from(s.config.datapath.max_sources),
            )
        };
        let new = inserted.saturating_sub(self.inserted_at_walk);
        let empty = self.left == 0 && new == 0;
        let low = self.left.saturating_add(new) < capacity / 100;
        let ranking = (self.passes + 1) % TOP_EVERY == 1;
        let walk = !empty && (!low || ranking);
        if walk {
            self.inserted_at_walk = inserted;
        }
        walk.then_some(offset)
    }

    /// Records a pass (`pass` if the tables were walked): the pressure
    /// figures, the events of what changed, and every TOP_EVERY passes the
    /// top sources.
    fn record(&mut self, s: &mut State, pass: Option<Pass>, ranked: Option<Ranked>) {
        let now = Instant::now();
        if let Some(pass) = &pass {
            self.left = pass.own.0 + pass.own.1 + pass.cells.0 + pass.cells.1;
        }
        let full = self.figures(
            &mut s.pressure,
            s.dp.counters().ok(),
            pass.as_ref(),
            now,
            s.config.datapath.max_sources,
        );
        if let Some(full) = full {
            s.pressure.table_full = full;
            let event = if full { "table_full" } else { "table_room" };
            if full {
                let max_sources = s.config.datapath.max_sources;
                warn!(event, max_sources, "the sources' table is full: new sources are charged to their prefix cells until the collector frees room (raise datapath.max_sources if this is not a flood)");
            } else {
                info!(
                    event,
                    "the sources' table has room again: new sources get buckets of their own"
                );
            }
            s.push_host_event(event, unix_now_ms());
        }
        if let Some(pass) = &pass {
            wide_rules(s, pass);
            if let Some(cells) = charged_cells(s, pass) {
                s.cells = cells;
            }
        }
        let room = rl_common::cell_room(s.config.datapath.flood_prefixes);
        if let Some(full) = pass
            .as_ref()
            .and_then(|pass| cells_full(s.pressure.cells_full, pass.cells, room))
        {
            s.pressure.cells_full = full;
            let event = if full { "cells_full" } else { "cells_room" };
            if full {
                warn!(event, room, "the prefix cells are full: a prefix without a cell shares its rule's last resort until the collector frees cells (raise datapath.flood_prefixes if floods span more prefixes)");
            } else {
                info!(
                    event,
                    "the prefix cells have room again: new prefixes get cells of their own"
                );
            }
            s.push_host_event(event, unix_now_ms());
        }
        self.passes += 1;
        if let Some(ranked) = ranked {
            s.top = ranked.named(s);
        }
    }

    /// The top sources of `pass`, counted and ranked without the state lock
    /// when this pass ranks them (every TOP_EVERY passes).
    fn rank(&mut self, pass: Option<&Pass>) -> Option<Ranked> {
        let pass = pass.filter(|_| (self.passes + 1) % TOP_EVERY == 1)?;
        self.top.rank(&pass.sources, Instant::now())
    }

    /// Updates the pressure figures from the walk and the datapath's
    /// counters (`None`: unreadable this pass, and the figures from them
    /// stay as they were); returns whether the table turned full or has
    /// room again ([`table_full`]).
    fn figures(
        &mut self,
        p: &mut Pressure,
        read: Option<crate::datapath::Counters>,
        pass: Option<&Pass>,
        now: Instant,
        max_sources: u32,
    ) -> Option<bool> {
        if let Some(pass) = pass {
            p.buckets_ipv4 = pass.own.0;
            p.buckets_ipv6 = pass.own.1;
            p.cells_ipv4 = pass.cells.0;
            p.cells_ipv6 = pass.cells.1;
            (p.wide_cells_ipv4, p.wide_cells_ipv6) = pass.wide;
            (p.known_filter_fill_ipv4, p.known_filter_fill_ipv6) = pass.known_fill;
            p.collected_buckets += pass.collected;
        }
        let counters = read?;
        p.table_full_refusals = counters.get(rl_common::STAT_TABLE_FULL);
        p.fallback_packets = counters.get(rl_common::STAT_FALLBACK);
        let created = counters.get(rl_common::STAT_NEW_SOURCES);
        if let Some((then, before)) = self.last {
            p.new_buckets_per_sec =
                created.saturating_sub(before) as f64 / (now - then).as_secs_f64().max(1e-3);
        }
        self.last = Some((now, created));
        let before = self.refusals.replace(p.table_full_refusals)?;
        if p.table_full_refusals > before {
            self.refused_at = Some(now);
        }
        table_full(p, self.refused_at, now, max_sources)
    }
}

/// How long no insert may have been refused before a full table is said to
/// have room again: longer than a CPU that found the table full waits to
/// try again (the rest of its 67 ms flood window), and two of the
/// daemon's passes, so that refusals now and then are one spell, not
/// `table_full` and `table_room` by turns.
const TABLE_ROOM_QUIET: Duration = Duration::from_secs(2);

/// Whether the sources' table turned full (`Some(true)`: an insert was
/// refused since the last pass) or has room again (`Some(false)`: none
/// refused for [`TABLE_ROOM_QUIET`] and both families under `max_sources`
/// own buckets at the last walk), or neither (`None`).
fn table_full(
    p: &Pressure,
    refused_at: Option<Instant>,
    now: Instant,
    max_sources: u32,
) -> Option<bool> {
    let refused_now = refused_at == Some(now);
    let room = refused_at.is_none_or(|t| now - t > TABLE_ROOM_QUIET)
        && p.buckets_ipv4.max(p.buckets_ipv6) < u64::from(max_sources);
    match p.table_full {
        false if refused_now => Some(true),
        true if room => Some(false),
        _ => None,
    }
}

/// Whether a walk that found `cells` (IPv4, IPv6) turns the cells full
/// (`Some(true)`: a family at `room`, where the program stops claiming) or
/// gives them room again (`Some(false)`: both families under 15/16 of it,
/// so that cells freed and claimed at the edge are one spell), or neither.
fn cells_full(was: bool, cells: (u64, u64), room: u32) -> Option<bool> {
    let held = cells.0.max(cells.1);
    match was {
        false if held >= u64::from(room) => Some(true),
        true if held * 16 < u64::from(room) * 15 => Some(false),
        _ => None,
    }
}

/// Ranks sources by their drops between two walks.
#[derive(Default)]
struct TopRanker {
    /// When the previous ranking was made, and its counts.
    previous: Option<(Instant, Counts)>,
}

/// (key address, key rule) ➜ (seen, dropped).
type Counts = std::collections::HashMap<(IpAddr, u32), (u64, u64)>;

/// The sources ranked by drops over `secs` (key, drops, packets seen), not
/// yet named: counted without the state lock.
struct Ranked {
    secs: f64,
    sources: Vec<((IpAddr, u32), u64, u64)>,
}

impl TopRanker {
    /// Counts and ranks (every bucket of the walk: not under the state
    /// lock, which `/healthz` and `/metrics` need meanwhile).
    fn rank(&mut self, buckets: &[crate::datapath::Source], now: Instant) -> Option<Ranked> {
        let counts: Counts = buckets
            .iter()
            .map(|b| {
                (
                    (b.addr, b.rule),
                    (b.bucket.passed + b.bucket.dropped, b.bucket.dropped),
                )
            })
            .collect();
        let previous = self.previous.replace((now, counts));
        let (then, before) = previous?;
        let counts = &self.previous.as_ref()?.1;
        let secs = (now - then).as_secs_f64().max(1e-3);
        let mut ranked: Vec<((IpAddr, u32), u64, u64)> = counts
            .iter()
            .filter_map(|(k, &(seen, dropped))| {
                // A bucket collected and created again starts from 0.
                let (s0, d0) = before
                    .get(k)
                    .copied()
                    .filter(|&(s0, _)| s0 <= seen)
                    .unwrap_or((0, 0));
                let drops = dropped.saturating_sub(d0);
                (drops > 0).then_some((*k, drops, seen - s0))
            })
            .collect();
        ranked.sort_by_key(|r| std::cmp::Reverse(r.1));
        ranked.truncate(crate::daemon::state::TOP_KEPT);
        Some(Ranked {
            secs,
            sources: ranked,
        })
    }
}

impl Ranked {
    /// The ranking with its rules' names (under the state lock: at most
    /// TOP_KEPT lookups).
    fn named(self, s: &State) -> crate::daemon::state::Top {
        let secs = self.secs;
        crate::daemon::state::Top {
            interval_secs: secs,
            sources: self
                .sources
                .into_iter()
                .map(
                    |((addr, rule), drops, seen)| crate::daemon::state::TopSource {
                        source: addr.to_string(),
                        rule: s
                            .dp
                            .rule_name_of_key(rule)
                            .unwrap_or("(replaced rule)")
                            .to_string(),
                        drops,
                        drops_per_sec: drops as f64 / secs,
                        rate_seen_pps: seen as f64 / secs,
                    },
                )
                .collect(),
        }
    }
}

/// The cells a walk found holding a charge, named, with their quotas now
/// (left as they were if the datapath cannot be read this pass).
fn charged_cells(s: &State, pass: &Pass) -> Option<crate::daemon::state::Cells> {
    let c = &pass.charged_cells;
    let quotas = s.dp.cell_quotas(&c.cells).ok()?;
    let cells = c
        .cells
        .iter()
        .zip(quotas)
        .filter_map(|(cell, q)| {
            let (quota, (addr, bits)) = q?;
            Some(crate::daemon::state::CellView {
                rule: s
                    .dp
                    .rule_name_of_key(cell.limit)
                    .unwrap_or("(replaced rule)")
                    .to_string(),
                limit_index: cell.limit & 7,
                prefix: format!("{addr}/{bits}"),
                kind: if cell.wide {
                    "wide_cell"
                } else {
                    "prefix_cell"
                }
                .into(),
                limit: quota.limit,
                remaining: quota.remaining,
                retry_after_ms: rl_common::quota::ceil_ms(quota.retry_after_ns),
                reset_ms: rl_common::quota::ceil_ms(quota.reset_ns),
            })
        })
        .collect();
    Some(crate::daemon::state::Cells {
        read_at_unix_ms: unix_now_ms(),
        drained_ipv4: c.drained.0,
        drained_ipv6: c.drained.1,
        cells,
    })
}

/// Sets the rules with wide cells from a walk, and raises
/// `wide_cells_made` for each rule that has its first and
/// `wide_cells_gone` for each whose last was freed. (A rule gone from both
/// rule sets has its cells freed: not listed. Rules unreadable this pass:
/// the list stays as it was.)
fn wide_rules(s: &mut State, pass: &Pass) {
    let names = match pass.wide_rules.is_empty() {
        true => Default::default(),
        false => match s.dp.rule_names_by_id() {
            Ok(names) => names,
            Err(_) => return,
        },
    };
    let now = by_name(&pass.wide_rules, &names);
    let had = |list: &[WideCellRule], rule: &str| list.iter().any(|w| w.rule == rule);
    let (at, before) = (
        unix_now_ms(),
        std::mem::take(&mut s.pressure.wide_cell_rules),
    );
    for w in now.iter().filter(|w| !had(&before, &w.rule)) {
        let event = "wide_cells_made";
        warn!(event, rule = %w.rule, ipv4 = w.ipv4, ipv6 = w.ipv6, "rule {}'s flood holds a quarter of the prefix cells' slots (half of datapath.flood_prefixes rounded up to a power of two): its unseen sources are charged to wide cells (prefixes 8 bits shorter than a cell's, IPv6 16; a new one starts drained) until those are fresh again", w.rule);
        s.push_rule_event(event, &w.rule, at);
    }
    for w in before.into_iter().filter(|w| !had(&now, &w.rule)) {
        let event = "wide_cells_gone";
        info!(event, rule = %w.rule, "rule {}'s last wide cell was freed: its unseen sources are charged to their own prefix's cell again", w.rule);
        s.push_rule_event(event, &w.rule, at);
    }
    s.pressure.wide_cell_rules = now;
}

/// Wide cells per rule name from counts per rule id: a rule changed under
/// the same name has a new id, and its old id's cells live on while the
/// other rule set holds it; one name is one entry (one metric series).
fn by_name(per_id: &BTreeMap<u32, (u64, u64)>, names: &BTreeMap<u32, String>) -> Vec<WideCellRule> {
    let mut out: BTreeMap<&str, (u64, u64)> = BTreeMap::new();
    for (id, &(ipv4, ipv6)) in per_id {
        if let Some(name) = names.get(id) {
            let e = out.entry(name).or_default();
            (e.0, e.1) = (e.0 + ipv4, e.1 + ipv6);
        }
    }
    out.into_iter()
        .map(|(rule, (ipv4, ipv6))| WideCellRule {
            rule: rule.to_string(),
            ipv4,
            ipv6,
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::{by_name, cells_full, table_full};

    #[test]
    fn a_rule_changed_under_its_name_has_one_entry_of_wide_cells() {
        let per_id = [(1, (1, 0)), (2, (2, 1)), (3, (0, 4)), (9, (5, 5))]
            .into_iter()
            .collect();
        let names = [
            (1, "x".to_string()),
            (2, "x".to_string()),
            (3, "y".to_string()),
        ]
        .into_iter()
        .collect();
        let got: Vec<(String, u64, u64)> = by_name(&per_id, &names)
            .into_iter()
            .map(|w| (w.rule, w.ipv4, w.ipv6))
            .collect();
        assert_eq!(
            got,
            [("x".to_string(), 3, 1), ("y".to_string(), 0, 4)],
            "an id no rule set names is left out"
        );
    }
    use std::time::{Duration, Instant};

    #[test]
    fn a_full_table_has_room_again_only_after_two_quiet_seconds() {
        let t0 = Instant::now();
        let mut p = crate::daemon::state::Pressure::default();
        assert_eq!(
            table_full(&p, Some(t0), t0, 64),
            Some(true),
            "an insert refused since the last pass"
        );
        (p.table_full, p.buckets_ipv4) = (true, 10);
        assert_eq!(
            table_full(&p, Some(t0), t0 + Duration::from_secs(1), 64),
            None,
            "one quiet pass: the same spell"
        );
        assert_eq!(
            table_full(&p, Some(t0), t0 + Duration::from_millis(2100), 64),
            Some(false),
            "two quiet seconds"
        );
        p.buckets_ipv4 = 64;
        assert_eq!(
            table_full(&p, Some(t0), t0 + Duration::from_secs(3), 64),
            None,
            "still max_sources own buckets"
        );
    }

    #[test]
    fn cells_turn_full_at_their_room_and_have_room_again_below_fifteen_sixteenths() {
        assert_eq!(cells_full(false, (255, 3), 256), None);
        assert_eq!(
            cells_full(false, (12, 256), 256),
            Some(true),
            "either family"
        );
        assert_eq!(
            cells_full(true, (250, 0), 256),
            None,
            "freed at the edge: the same spell"
        );
        assert_eq!(cells_full(true, (240, 0), 256), None, "15/16 exactly");
        assert_eq!(cells_full(true, (239, 239), 256), Some(false));
        assert_eq!(cells_full(false, (239, 0), 256), None);
    }
}
