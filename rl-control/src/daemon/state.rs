//! The running daemon's state, shared by the signal loop and the admin API.
//! It changes only through [`crate::daemon::apply`], which holds its lock briefly.

use std::{
    collections::BTreeMap,
    path::{Path, PathBuf},
    sync::{Arc, Mutex, MutexGuard},
    time::SystemTime,
};

use serde::Serialize;

use crate::{
    config::Config,
    datapath::{Attachment, Datapath},
};

/// What identifies a version of the config file on disk.
pub type FileStamp = (SystemTime, u64, u64);

/// The stamp of `path` now, if it exists.
pub fn file_stamp(path: &Path) -> Option<FileStamp> {
    use std::os::unix::fs::MetadataExt;
    let m = std::fs::metadata(path).ok()?;
    Some((m.modified().ok()?, m.len(), m.ino()))
}

/// The outcome of the last reload or API change.
#[derive(Clone, Debug, Serialize, utoipa::ToSchema)]
pub struct ReloadRecord {
    /// Unix time (seconds).
    pub at: u64,
    pub ok: bool,
    /// What asked for it: `SIGHUP`, `file change`, `api`, …
    pub trigger: String,
    /// The summary of the rules now enforced, or why the change was refused.
    pub message: String,
}

/// Why a change was not applied. The running rules are unchanged either way.
#[derive(Debug, Clone)]
pub enum ApplyError {
    /// The new rules are invalid (the message has line and column).
    Invalid(String),
    /// The datapath or the config file could not be updated.
    Failed(String),
    /// The config file changed on disk since the daemon last read or wrote
    /// it: writing this change back would lose the operator's edit.
    Conflict(String),
    /// The daemon is stopping: no change starts any more.
    Stopping(String),
    /// The config file could not be written (read-only, full): nothing
    /// changed.
    Unwritable(String),
}

impl std::fmt::Display for ApplyError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            ApplyError::Invalid(m)
            | ApplyError::Failed(m)
            | ApplyError::Conflict(m)
            | ApplyError::Stopping(m)
            | ApplyError::Unwritable(m) => f.write_str(m),
        }
    }
}

pub struct State {
    pub dp: Datapath,
    /// The request limiter ([[l7.rule]]s), swapped on every change.
    pub l7: crate::l7::http::Shared,
    /// The shared Redis of `scope = "cluster"` rules (`[cluster]`).
    pub cluster: Option<Arc<crate::cluster::Cluster>>,
    /// The collector's deletes of cluster rules' buckets, for the sync.
    pub collected: Arc<crate::datapath::share::Collected>,
    /// The `on_failure` variant of the packet rules installed while the
    /// cluster is degraded (`None`: the rules as written).
    pub failure_mode: Option<crate::cluster::OnFailure>,
    /// Shared, so a change can read them without holding the lock.
    pub config: Arc<Config>,
    /// The text `config` was read from: what the API edits and writes back.
    pub text: Arc<str>,
    /// The config file (`None`: the embedded default, nothing to persist).
    pub path: Option<PathBuf>,
    /// The file's stamp as the running rules stand: when the daemon last
    /// applied it or wrote it. An API change refuses to write over a file
    /// whose stamp differs (an edit not applied).
    pub stamp: Option<FileStamp>,
    /// The file's stamp when the daemon last read it, applied or refused:
    /// the watcher reloads when the file's differs.
    pub seen: Option<FileStamp>,
    /// Every interface the limiter is attached to, and its mode.
    pub attachments: Vec<Attachment>,
    pub program_id: Option<u32>,
    pub started: std::time::Instant,
    pub last_reload: Option<ReloadRecord>,
    pub reloads_ok: u64,
    pub reloads_failed: u64,
    /// Pressure on the bucket tables, refreshed in the background.
    pub pressure: Pressure,
    /// Admin API requests by (route, status).
    pub api_requests: BTreeMap<(String, u16), u64>,
    /// The sources with the most drops over the last scan interval.
    pub top: Top,
    /// The prefix cells holding a charge, as the last pass read them.
    pub cells: Cells,
    /// The most recent events.
    pub events: EventLog,
}

/// The events `GET /v1/events` shows, in two rings: "limited" events, and
/// apart from them those of the host, its rules and the cluster (flood
/// mode, full tables, wide cells, Redis), so that the thousands a long
/// flood raises of the first kind never push out when it began.
#[derive(Default)]
pub struct EventLog {
    limited: std::collections::VecDeque<EventView>,
    notices: std::collections::VecDeque<EventView>,
}

impl EventLog {
    /// Keeps a "limited" event (dropping the oldest beyond [`EVENTS_KEPT`]).
    pub fn limited(&mut self, event: EventView) {
        keep(&mut self.limited, event, EVENTS_KEPT);
    }

    /// Keeps a host, rule or cluster event (dropping the oldest beyond
    /// [`NOTICES_KEPT`]).
    pub fn notice(&mut self, event: EventView) {
        keep(&mut self.notices, event, NOTICES_KEPT);
    }

    /// The latest `n` events of both kinds, newest first.
    pub fn latest(&self, n: usize) -> Vec<EventView> {
        let (mut a, mut b) = (
            self.limited.iter().rev().peekable(),
            self.notices.iter().rev().peekable(),
        );
        let mut out = Vec::with_capacity(n.min(EVENTS_KEPT + NOTICES_KEPT));
        while out.len() < n {
            let next = match (a.peek(), b.peek()) {
                (Some(x), Some(y)) if x.at_unix_ms > y.at_unix_ms => a.next(),
                (_, Some(_)) => b.next(),
                (Some(_), None) => a.next(),
                (None, None) => break,
            };
            out.extend(next.cloned());
        }
        out
    }
}

fn keep(ring: &mut std::collections::VecDeque<EventView>, event: EventView, kept: usize) {
    if ring.len() == kept {
        ring.pop_front();
    }
    ring.push_back(event);
}

/// The rule file a daemon starts with: parsed, as written, where from.
pub struct Loaded {
    pub config: Config,
    pub text: String,
    /// `None`: the embedded default.
    pub path: Option<PathBuf>,
    /// The file's stamp, taken before it was read.
    pub stamp: Option<FileStamp>,
}

impl State {
    /// A started daemon's state: `dp` enforcing `file`'s rules on
    /// `attachments`, nothing reloaded or counted yet.
    pub fn new(
        dp: Datapath,
        file: Loaded,
        l7: crate::l7::http::Shared,
        cluster: Option<Arc<crate::cluster::Cluster>>,
        attachments: Vec<Attachment>,
    ) -> State {
        State {
            l7,
            cluster,
            collected: Default::default(),
            failure_mode: None,
            program_id: dp.program_id(),
            dp,
            config: Arc::new(file.config),
            text: Arc::from(file.text),
            path: file.path,
            stamp: file.stamp,
            seen: file.stamp,
            attachments,
            started: std::time::Instant::now(),
            last_reload: None,
            reloads_ok: 0,
            reloads_failed: 0,
            pressure: Default::default(),
            api_requests: Default::default(),
            top: Default::default(),
            cells: Default::default(),
            events: Default::default(),
        }
    }
}

/// A rule with wide cells, and how many per family.
#[derive(Clone, Debug, Default, Serialize, utoipa::ToSchema, PartialEq, Eq)]
pub struct WideCellRule {
    pub rule: String,
    pub ipv4: u64,
    pub ipv6: u64,
}

/// How the daemon's background readers behind `pressure` are doing. A
/// reader whose pass fails tries again every second; until one works, its
/// figures stay as they last were (and say nothing of now).
#[derive(Clone, Debug, Default, Serialize, utoipa::ToSchema, PartialEq, Eq)]
pub struct CollectorHealth {
    /// The tables' walk: occupancy, cells, wide cells, `/v1/cells`, the
    /// top sources, and the collection of fresh buckets (without it the
    /// tables fill, and new sources share their prefix cells).
    pub walk: ReaderHealth,
    /// The flood detectors' reading: `flood_mode`, `flood_mode_cpus`,
    /// `unseen_keys_per_sec` and the flood events.
    pub flood_reading: ReaderHealth,
    /// The datapath's "limited" events feed (`/v1/events`, the logs): fed
    /// by the kernel as sources start being limited, so `last_ok_unix_ms`
    /// is when it last delivered (or started), not a pass a second.
    pub events: ReaderHealth,
}

/// One background reader's health.
#[derive(Clone, Debug, Default, Serialize, utoipa::ToSchema, PartialEq, Eq)]
pub struct ReaderHealth {
    /// When its last pass completed (Unix ms).
    pub last_ok_unix_ms: Option<u64>,
    /// Why its passes fail, while they do.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub error: Option<String>,
    /// When they started failing (Unix ms), while they do.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub failing_since_unix_ms: Option<u64>,
}

/// What a reader's pass changed in its health: what to log and raise as an
/// event (once, not at every pass).
#[derive(Debug, PartialEq, Eq)]
pub enum Went {
    Unchanged,
    /// It fails, for the first time or for another reason than before.
    Failing,
    /// It works again.
    Recovered,
}

impl ReaderHealth {
    /// Records a pass at `now_unix_ms`.
    pub fn went(&mut self, outcome: Result<(), String>, now_unix_ms: u64) -> Went {
        match outcome {
            Ok(()) => {
                self.last_ok_unix_ms = Some(now_unix_ms);
                self.failing_since_unix_ms = None;
                match self.error.take() {
                    Some(_) => Went::Recovered,
                    None => Went::Unchanged,
                }
            }
            Err(e) => {
                self.failing_since_unix_ms.get_or_insert(now_unix_ms);
                let new = self.error.as_deref() != Some(e.as_str());
                self.error = Some(e);
                if new {
                    Went::Failing
                } else {
                    Went::Unchanged
                }
            }
        }
    }

    /// Whether its passes fail now.
    pub fn failing(&self) -> bool {
        self.error.is_some()
    }
}

/// Pressure on the bucket tables (see README, "Floods"), as of the last
/// collector pass (every second; every 5 s while under 1% full).
#[derive(Clone, Debug, Default, Serialize, utoipa::ToSchema)]
pub struct Pressure {
    /// Per-source buckets held, per family.
    pub buckets_ipv4: u64,
    pub buckets_ipv6: u64,
    /// Capacity of each family's bucket table (`datapath.max_sources`).
    pub bucket_capacity: u32,
    /// Prefix cells held, per family.
    pub cells_ipv4: u64,
    pub cells_ipv6: u64,
    /// Of those, wide cells (a prefix 8 bits shorter, IPv6 16), per family:
    /// made while a rule's flood holds a quarter of the cells' slots (half
    /// of `flood_prefixes` rounded up to a power of two) or more
    /// (`datapath.flood_wide_cells`).
    pub wide_cells_ipv4: u64,
    pub wide_cells_ipv6: u64,
    /// The rules those wide cells charge: whose floods went wide, so whose
    /// newcomers in a flooded prefix start drained (README, "Floods: wide
    /// cells"). Events `wide_cells_made` and `wide_cells_gone`, naming the
    /// rule, mark a rule's first one and its last one's freeing.
    pub wide_cell_rules: Vec<WideCellRule>,
    /// Cells each family's array takes before it is full
    /// (`rl_common::cell_room` of `datapath.flood_prefixes`): from then on,
    /// a prefix without a cell shares its rule's last resort.
    pub cell_capacity: u32,
    /// Share of the known-keys filter's bits set, per family: how often a
    /// key that owns no bucket still pays a table lookup (see README,
    /// "Floods"; rebuilt by each collector walk).
    pub known_filter_fill_ipv4: f64,
    pub known_filter_fill_ipv6: f64,
    /// Keys the datapath found no bucket for, per second (the last whole
    /// flood window, 67 ms): new sources, and in flood mode every packet of
    /// an unseen one.
    pub unseen_keys_per_sec: f64,
    /// Buckets created per second over the last pass.
    pub new_buckets_per_sec: f64,
    /// Since load: inserts refused because a table was full.
    pub table_full_refusals: u64,
    /// Inserts were refused since the last pass and the table has had no
    /// room since (`max_sources` own buckets): new sources share their
    /// prefix cells. Events `table_full` and `table_room` mark the changes.
    pub table_full: bool,
    /// A family's cells reached `cell_capacity` at a walk, and have not
    /// fallen back below 15/16 of it since: a prefix without a cell shares
    /// its rule's last resort. Events `cells_full` and `cells_room` mark
    /// the changes.
    pub cells_full: bool,
    /// Since load: packets charged to a prefix cell or a last resort.
    pub fallback_packets: u64,
    /// Since load: buckets the collector deleted because they were fresh.
    pub collected_buckets: u64,
    /// Flood mode: unseen keys are charged to their prefix cells (held for
    /// two seconds after the last such charge, so a flood with lulls is one).
    pub flood_mode: bool,
    /// When the current flood mode started (Unix ms), if it is on.
    pub flood_since_unix_ms: Option<u64>,
    /// Of the online CPUs, how many are in flood mode now or were within
    /// the last two seconds (each measures its own share of
    /// `flood_new_keys_per_sec`: one alone under a low host-wide rate
    /// points at uneven receive queues), and how many are online.
    pub flood_mode_cpus: u32,
    pub cpus: u32,
    /// Whether the readers behind these figures work (a failing one's
    /// figures are as it last read them).
    pub collector: CollectorHealth,
}

/// "Limited" events kept for `GET /v1/events`.
pub const EVENTS_KEPT: usize = 1_000;
/// Host, rule and cluster events kept for `GET /v1/events`, beside them.
pub const NOTICES_KEPT: usize = 256;

/// A source's drops under one rule over the last interval.
#[derive(Clone, Debug, Serialize, serde::Deserialize, utoipa::ToSchema)]
pub struct TopSource {
    /// The source as the rule keys it (masked to its prefix).
    pub source: String,
    pub rule: String,
    pub drops: u64,
    pub drops_per_sec: f64,
    /// Packets per second the rule saw from it (passed and dropped).
    pub rate_seen_pps: f64,
}

/// The last scan's top list.
#[derive(Clone, Debug, Default, Serialize, utoipa::ToSchema)]
pub struct Top {
    /// Length of the interval the counts cover (0 before two scans).
    pub interval_secs: f64,
    /// Most drops first; at most [`TOP_KEPT`].
    pub sources: Vec<TopSource>,
}

/// A prefix cell or wide cell holding a charge (`GET /v1/cells`): where a
/// flood charged to shared cells shows, since its sources have no buckets
/// of their own to rank.
#[derive(Clone, Debug, Serialize, serde::Deserialize, utoipa::ToSchema)]
pub struct CellView {
    pub rule: String,
    /// Which of the rule's limits (0-based).
    pub limit_index: u32,
    /// The prefix it charges every unseen source of (in flood mode), e.g.
    /// `10.1.2.0/24`, or `10.1.0.0/16` for a wide cell.
    pub prefix: String,
    /// `prefix_cell` or `wide_cell`.
    pub kind: String,
    pub limit: u64,
    pub remaining: u64,
    pub retry_after_ms: u64,
    pub reset_ms: u64,
}

/// The cells the last collector pass found holding a charge.
#[derive(Clone, Debug, Default, Serialize, utoipa::ToSchema)]
pub struct Cells {
    /// When the pass read them (Unix ms; 0 before the first): the waits
    /// are from then.
    pub read_at_unix_ms: u64,
    /// Cells with no room left, per family: one more packet charged to
    /// them is over the limit (dropped, unless its rule is a shadow or an
    /// elastic one with room in its pool). Every such cell is counted,
    /// including those of a rule no longer in either rule table (left
    /// until the collector frees them), which `cells` leaves out.
    pub drained_ipv4: u64,
    pub drained_ipv6: u64,
    /// The most limiting first: no room left, then wide cells, then the
    /// least room left in eighths of each limit (at most 100).
    pub cells: Vec<CellView>,
}

/// Entries kept in [`Top`].
pub const TOP_KEPT: usize = 1_000;

/// An event: `limited` ("this source started being limited under this
/// limit of this rule"), or one of the host's (flood mode, full tables,
/// the collector's readers), a rule's (wide cells: `rule` names it) or the
/// cluster's, which name no limit and no source.
#[derive(Clone, Debug, Serialize, serde::Deserialize, utoipa::ToSchema)]
pub struct EventView {
    /// Unix time in milliseconds.
    pub at_unix_ms: u64,
    pub event: String,
    /// The rule, for `limited` and a rule's events (else empty).
    pub rule: String,
    /// Which of the rule's limits (0-based), for `limited` (else 0).
    pub limit_index: u32,
    /// The source as the rule keys it (masked to its prefix), for
    /// `limited` (else empty).
    pub source: String,
    /// Why, for the cluster's events (the Redis error of
    /// `cluster_degraded`), else empty.
    #[serde(default)]
    pub detail: String,
}

impl State {
    /// Keeps `event` for `GET /v1/events` (dropping the oldest beyond
    /// [`EVENTS_KEPT`]).
    pub fn push_event(&mut self, event: EventView) {
        self.events.limited(event);
    }

    /// Keeps a host, rule or cluster event for `GET /v1/events`.
    pub fn push_notice(&mut self, event: EventView) {
        self.events.notice(event);
    }

    /// Records a host-wide event (flood mode, a full table) at `at_unix_ms`:
    /// no rule, no source.
    pub fn push_host_event(&mut self, event: &str, at_unix_ms: u64) {
        self.push_rule_event(event, "", at_unix_ms);
    }

    /// Records an event of one rule's (its wide cells) at `at_unix_ms`.
    pub fn push_rule_event(&mut self, event: &str, rule: &str, at_unix_ms: u64) {
        self.push_notice(EventView {
            at_unix_ms,
            event: event.into(),
            rule: rule.into(),
            limit_index: 0,
            source: String::new(),
            detail: String::new(),
        });
    }
}

pub type Shared = Arc<Mutex<State>>;

/// Locks the state. A panic while holding the lock cannot leave the rules
/// half-changed (they change with one map write), so a poisoned lock is
/// still usable.
pub fn lock(shared: &Shared) -> MutexGuard<'_, State> {
    shared.lock().unwrap_or_else(|e| e.into_inner())
}

/// What a change is computed from: the running config and its text (read
/// without holding the state lock).
pub struct Running {
    pub config: Arc<Config>,
    pub text: Arc<str>,
    pub path: Option<PathBuf>,
}

impl Running {
    /// How errors in the running text are located.
    pub fn origin(&self) -> String {
        self.path
            .as_ref()
            .map_or("<embedded default>".into(), |p| p.display().to_string())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn event(at_unix_ms: u64, event: &str) -> EventView {
        EventView {
            at_unix_ms,
            event: event.into(),
            rule: String::new(),
            limit_index: 0,
            source: String::new(),
            detail: String::new(),
        }
    }

    /// A long flood's "limited" events do not push out when it began, and
    /// both kinds come back merged, newest first.
    #[test]
    fn limited_events_never_push_out_the_hosts() {
        let mut log = EventLog::default();
        log.notice(event(1, "flood_started"));
        for t in 2..(2 + 3 * EVENTS_KEPT as u64) {
            log.limited(event(t, "limited"));
        }
        let last = 1 + 3 * EVENTS_KEPT as u64;
        log.notice(event(last, "wide_cells_made"));
        let all = log.latest(EVENTS_KEPT + NOTICES_KEPT);
        assert_eq!(all.len(), EVENTS_KEPT + 2);
        // The notice raised at the same millisecond as the newest "limited" one comes first.
        assert_eq!(
            (all[0].at_unix_ms, all[0].event.as_str()),
            (last, "wide_cells_made")
        );
        assert_eq!(
            (all[1].at_unix_ms, all[1].event.as_str()),
            (last, "limited")
        );
        assert_eq!(
            all.last().map(|e| e.event.as_str()),
            Some("flood_started"),
            "the flood's start was pushed out"
        );
        assert!(
            all.windows(2).all(|w| w[0].at_unix_ms >= w[1].at_unix_ms),
            "not newest first"
        );
        assert_eq!(
            all.iter().filter(|e| e.event == "limited").count(),
            EVENTS_KEPT,
            "the oldest limited ones go"
        );
        assert_eq!(log.latest(3).len(), 3);
        // The notices' ring is bounded too.
        for t in 0..(2 * NOTICES_KEPT as u64) {
            log.notice(event(last + 1 + t, "table_full"));
        }
        assert_eq!(
            log.latest(usize::MAX)
                .iter()
                .filter(|e| e.event != "limited")
                .count(),
            NOTICES_KEPT
        );
    }

    /// A failing reader is reported once per reason, keeps when it started
    /// failing across reasons, and is reported again when it works.
    #[test]
    fn a_readers_failure_is_reported_once_per_reason_and_its_recovery_once() {
        let mut h = ReaderHealth::default();
        assert_eq!(h.went(Ok(()), 1_000), Went::Unchanged);
        assert_eq!((h.last_ok_unix_ms, h.failing()), (Some(1_000), false));
        assert_eq!(h.went(Err("the map is gone".into()), 2_000), Went::Failing);
        assert_eq!(
            h.went(Err("the map is gone".into()), 3_000),
            Went::Unchanged,
            "the same reason: not again"
        );
        assert_eq!(
            h.went(Err("a walk panicked".into()), 4_000),
            Went::Failing,
            "another reason"
        );
        assert_eq!(
            (h.failing_since_unix_ms, h.last_ok_unix_ms),
            (Some(2_000), Some(1_000)),
            "failing since the first"
        );
        assert_eq!(h.went(Ok(()), 5_000), Went::Recovered);
        assert_eq!(
            (h.failing(), h.failing_since_unix_ms, h.last_ok_unix_ms),
            (false, None, Some(5_000))
        );
        assert_eq!(h.went(Ok(()), 6_000), Went::Unchanged);
    }
}
