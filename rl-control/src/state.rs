//! The running daemon's state, shared by the signal loop and the admin API,
//! and the one way to change the running rule set: [`State::apply`].
//!
//! Every change (file reload, `PUT`/`POST`/`DELETE /v1/rules`, bans) goes
//! through the same steps: validate the new text with the file loader,
//! compile, install atomically (double-buffered, see [`Datapath::install`]),
//! and for API changes write the text back to the config file (write, fsync,
//! rename), so a restart or a later file reload keeps them.

use std::{
    collections::BTreeMap,
    path::{Path, PathBuf},
    sync::{Arc, Mutex, MutexGuard},
    time::SystemTime,
};

use serde::Serialize;
use tracing::{error, info, warn};

use crate::{
    compile::compile,
    config::{unix_now, Config},
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
}

impl std::fmt::Display for ApplyError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            ApplyError::Invalid(m) | ApplyError::Failed(m) => f.write_str(m),
        }
    }
}

pub struct State {
    pub dp: Datapath,
    pub config: Config,
    /// The text `config` was read from: what the API edits and writes back.
    pub text: String,
    /// The config file (`None`: the embedded default, nothing to persist).
    pub path: Option<PathBuf>,
    /// The file's stamp when last read or written by the daemon.
    pub stamp: Option<FileStamp>,
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
    /// The most recent "limited" events, oldest first.
    pub events: std::collections::VecDeque<EventView>,
}

/// Pressure on the bucket tables (see README, "Floods"), as of the last
/// collector pass (every second).
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
    /// Capacity of each family's cell table (`datapath.flood_prefixes`).
    pub cell_capacity: u32,
    /// Keys the datapath found no bucket for, per second (the last flood
    /// window): new sources, and in flood mode every packet of an unseen one.
    pub unseen_keys_per_sec: f64,
    /// Buckets created per second over the last pass.
    pub new_buckets_per_sec: f64,
    /// Since load: inserts refused because a table was full.
    pub table_full_refusals: u64,
    /// Since load: packets charged to a prefix cell or a last resort.
    pub fallback_packets: u64,
    /// Since load: buckets the collector deleted because they were fresh.
    pub collected_buckets: u64,
    /// Flood mode: unseen keys are charged to their prefix cells.
    pub flood_mode: bool,
    /// When the current flood mode started (Unix ms), if it is on.
    pub flood_since_unix_ms: Option<u64>,
}

/// Events kept for `GET /v1/events`.
pub const EVENTS_KEPT: usize = 1_000;

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

/// Entries kept in [`Top`].
pub const TOP_KEPT: usize = 1_000;

/// "This source started being limited under this rule."
#[derive(Clone, Debug, Serialize, serde::Deserialize, utoipa::ToSchema)]
pub struct EventView {
    /// Unix time in milliseconds.
    pub at_unix_ms: u64,
    pub event: String,
    pub rule: String,
    /// Which of the rule's limits (0-based).
    pub limit_index: u32,
    /// The source as the rule keys it (masked to its prefix).
    pub source: String,
}

impl State {
    /// Keeps `event` for `GET /v1/events` (dropping the oldest beyond
    /// [`EVENTS_KEPT`]).
    pub fn push_event(&mut self, event: EventView) {
        if self.events.len() == EVENTS_KEPT {
            self.events.pop_front();
        }
        self.events.push_back(event);
    }
}

pub type Shared = Arc<Mutex<State>>;

/// Locks the state. A panic while holding the lock cannot leave the rules
/// half-changed (they change with one map write), so a poisoned lock is
/// still usable.
pub fn lock(shared: &Shared) -> MutexGuard<'_, State> {
    shared.lock().unwrap_or_else(|e| e.into_inner())
}

/// Writes `text` to `path` so that readers see the old file or the new one,
/// never a mix, even across a crash: a temporary file in the same
/// directory, fsync, rename, fsync of the directory.
pub fn write_atomic(path: &Path, text: &str) -> std::io::Result<()> {
    use std::io::Write;
    let dir = path.parent().filter(|d| !d.as_os_str().is_empty()).unwrap_or(Path::new("."));
    let name = path.file_name().map(|n| n.to_string_lossy().into_owned()).unwrap_or_default();
    let tmp = dir.join(format!(".{name}.rl-tmp"));
    let mut f = std::fs::File::create(&tmp)?;
    if let Ok(m) = std::fs::metadata(path) {
        let _ = f.set_permissions(m.permissions());
    }
    f.write_all(text.as_bytes())?;
    f.sync_all()?;
    drop(f);
    std::fs::rename(&tmp, path).inspect_err(|_| {
        let _ = std::fs::remove_file(&tmp);
    })?;
    std::fs::File::open(dir)?.sync_all()
}

impl State {
    /// Validates `text` and makes it the running rule set; with `persist`,
    /// also writes it to the config file. All or nothing: when any step
    /// fails, the old rules keep running and the file is unchanged.
    pub fn apply(&mut self, text: String, origin: &str, trigger: &str, persist: bool) -> Result<String, ApplyError> {
        let result = self.try_apply(text, origin, persist);
        let message = match &result {
            Ok(summary) => summary.clone(),
            Err(e) => e.to_string(),
        };
        match &result {
            Ok(_) => {
                self.reloads_ok += 1;
                info!("{trigger}: reloaded, now enforcing {message}");
            }
            Err(_) => {
                self.reloads_failed += 1;
                error!("{trigger}: reload rejected, keeping the running config: {message}");
            }
        }
        self.last_reload = Some(ReloadRecord { at: unix_now(), ok: result.is_ok(), trigger: trigger.into(), message });
        result
    }

    fn try_apply(&mut self, text: String, origin: &str, persist: bool) -> Result<String, ApplyError> {
        let t0 = std::time::Instant::now();
        let new = Config::from_str(&text, origin).map_err(|e| ApplyError::Invalid(e.to_string()))?;
        if new.datapath.max_sources != self.config.datapath.max_sources {
            warn!(
                "datapath.max_sources changes only on restart; keeping {}",
                self.config.datapath.max_sources
            );
        }
        let failed = |what: &str, e: &dyn std::fmt::Display| ApplyError::Failed(format!("{what}: {e}"));
        let compiled = compile(&new);
        let t1 = std::time::Instant::now();
        self.dp.install(&compiled.rules).map_err(|e| failed("installing the rules", &e))?;
        let t2 = std::time::Instant::now();
        if persist {
            if let Some(path) = self.path.clone() {
                if let Err(e) = write_atomic(&path, &text) {
                    // Put the old rules back: the file and the datapath agree.
                    let _ = self.dp.install(&compile(&self.config).rules);
                    return Err(failed(
                        &format!("cannot write {} (nothing changed; check its directory is writable)", path.display()),
                        &e,
                    ));
                }
                self.stamp = file_stamp(&path);
            } else {
                warn!("running on the embedded default: this change lasts until the daemon stops (start with --config to keep changes)");
            }
        }
        let ms = |d: std::time::Duration| d.as_secs_f64() * 1e3;
        let summary = format!(
            "{} (enforced after {:.1} ms: validated and compiled in {:.1}, installed in {:.1}; file written in {:.1})",
            new.summary(),
            ms(t2 - t0),
            ms(t1 - t0),
            ms(t2 - t1),
            ms(t2.elapsed())
        );
        self.config = new;
        self.text = text;
        Ok(summary)
    }

    /// Applies an edit of the running text (one rule or ban added or
    /// removed) and writes it back: errors are located in the config file.
    pub fn apply_edit(&mut self, text: String, trigger: &str) -> Result<String, ApplyError> {
        let origin = self.origin();
        self.apply(text, &origin, trigger, true)
    }

    /// Re-reads the config file and applies it.
    pub fn reload_file(&mut self, trigger: &str) -> Result<String, ApplyError> {
        let Some(path) = self.path.clone() else {
            let e = ApplyError::Invalid("running on the embedded default: there is no file to reload".into());
            warn!("{trigger}: {e}");
            return Err(e);
        };
        self.stamp = file_stamp(&path);
        match std::fs::read_to_string(&path) {
            Ok(text) => self.apply(text, &path.display().to_string(), trigger, false),
            Err(e) => {
                let e = ApplyError::Failed(format!("cannot read {}: {e}", path.display()));
                self.reloads_failed += 1;
                error!("{trigger}: reload rejected, keeping the running config: {e}");
                self.last_reload =
                    Some(ReloadRecord { at: unix_now(), ok: false, trigger: trigger.into(), message: e.to_string() });
                Err(e)
            }
        }
    }

    /// Lifts bans whose time is up (written back to the file).
    pub fn expire_bans(&mut self) {
        let now = unix_now();
        if !self.config.bans.iter().any(|b| b.until <= now) {
            return;
        }
        match crate::document::remove_bans(&self.text, |_, until| until <= now) {
            Ok((text, n)) => {
                let _ = self.apply_edit(text, &format!("{n} ban(s) expired"));
            }
            Err(e) => error!("cannot lift expired bans: {e:?}"),
        }
    }

    /// How errors in the running text are located.
    pub fn origin(&self) -> String {
        self.path.as_ref().map_or("<embedded default>".into(), |p| p.display().to_string())
    }
}
