//! The one way to change the running rule set. Every change (file reload,
//! `PUT`/`POST`/`DELETE /v1/rules`, bans, expiring bans) goes through
//! [`apply`]: validate the new text with the file loader, compile, install
//! atomically (double-buffered, see [`crate::datapath::Datapath::install`]),
//! and for API changes write the text back to the config file, so a restart
//! or a later reload keeps them.
//!
//! Readers never wait for a change: changes are serialised by their own
//! lock, and the state lock is held only to read the running text, to write
//! the differences into the maps and to publish the result; validation,
//! compilation and file writes happen outside it.

use std::{
    path::{Path, PathBuf},
    sync::{Arc, Mutex},
    time::{Duration, Instant},
};

use tracing::{error, info, warn};

use crate::{
    compile::compile,
    config::{unix_now, Config},
    daemon::state::{file_stamp, lock, ApplyError, ReloadRecord, Running, Shared},
    datapath::{sleep_until, Plan},
};

/// One change at a time, each computed from the state it read.
static WRITER: Mutex<()> = Mutex::new(());

/// Holds rule changes off while the guard lives (the bucket collector's
/// walk, which must see one rule set).
pub fn hold_changes() -> std::sync::MutexGuard<'static, ()> {
    WRITER.lock().unwrap_or_else(|e| e.into_inner())
}

/// Set once the daemon stops: a change still waiting for [`WRITER`] (an
/// open connection outlives the server's task) is refused, not applied
/// after the daemon said it stopped.
static STOPPING: std::sync::atomic::AtomicBool = std::sync::atomic::AtomicBool::new(false);

fn refuse_if_stopping() -> Result<(), ApplyError> {
    match STOPPING.load(std::sync::atomic::Ordering::SeqCst) {
        true => Err(ApplyError::Stopping(
            "the daemon is stopping: nothing changed; repeat this once it runs again".into(),
        )),
        false => Ok(()),
    }
}

/// Refuses every change from now on; waits for one under way.
pub fn stop_changes() -> std::sync::MutexGuard<'static, ()> {
    let guard = hold_changes();
    STOPPING.store(true, std::sync::atomic::Ordering::SeqCst);
    guard
}

/// A change, computed from the running state.
pub struct Change {
    /// The new rule file text.
    pub text: String,
    /// How to locate errors in it.
    pub origin: String,
    /// Write it back to the config file.
    pub persist: bool,
    /// The stamp of the config file the text was read from (a reload).
    pub read_as: Option<crate::daemon::state::FileStamp>,
}

/// Applies the change `make` computes from the running state. All or
/// nothing: when a step fails, the old rules keep running and the file is
/// unchanged.
pub fn apply<E: From<ApplyError>>(
    shared: &Shared,
    trigger: &str,
    make: impl FnOnce(&Running) -> Result<Change, E>,
) -> Result<String, E> {
    let _writer = WRITER.lock().unwrap_or_else(|e| e.into_inner());
    refuse_if_stopping()?;
    let (running, stamp) = {
        let s = lock(shared);
        (
            Running {
                config: s.config.clone(),
                text: s.text.clone(),
                path: s.path.clone(),
            },
            s.stamp,
        )
    };
    // The change itself (a document edit of a large file, say) runs
    // outside the lock.
    let change = make(&running)?;
    let path = running.path.clone();
    let (persist, read_as) = (change.persist, change.read_as);
    let result = install(shared, change, path.as_deref(), stamp);
    // The request limiter too, keeping the buckets of unchanged l7 rules:
    // built outside the state lock (dropping a changed rule's buckets
    // walks every request key), swapped in under it.
    let engine = result.as_ref().ok().map(|(_, config, _, _)| {
        let (old, offset, cluster) = {
            let s = lock(shared);
            let old = s.l7.read().unwrap_or_else(|e| e.into_inner()).clone();
            (old, s.dp.epoch_offset_ns(), s.cluster.clone())
        };
        crate::l7::engine::Engine::new(&config.l7, offset, Some(&old)).with_cluster(cluster)
    });
    let on_disk = match (&result, &path) {
        (Err(ApplyError::Conflict(_)), Some(p)) => Some(file_stamp(p)),
        _ => None,
    };
    let mut s = lock(shared);
    if let (Some(on_disk), Some(p)) = (on_disk, &path) {
        if on_disk == s.seen {
            // Read already, and refused: not an edit waiting to be applied.
            // Counted, but the last reload's record keeps why the file was
            // refused.
            let e = ApplyError::Conflict(format!(
                "{} does not load (`rl-control status` shows why), so the daemon runs the rules it had before: fix the file, then repeat this change",
                p.display()
            ));
            s.reloads_failed += 1;
            error!("{trigger}: refused: {e}");
            return Err(e.into());
        }
    }
    record(
        &mut s,
        trigger,
        result.as_ref().map(|(summary, _, _, _)| summary.as_str()),
    );
    if let Some(st) = read_as {
        // Read and refused, the file is not what runs: an API change must
        // not write over it (and the watcher need not read it again).
        s.seen = Some(st);
        if result.is_ok() {
            s.stamp = Some(st);
        }
    }
    let (summary, config, text, written) = result?;
    if persist && path.is_some() {
        // The stamp of the file as written (an edit after it is seen by
        // the watcher).
        s.stamp = written;
        s.seen = s.stamp;
    }
    if let Some(engine) = engine {
        *s.l7.write().unwrap_or_else(|e| e.into_inner()) = Arc::new(engine);
    }
    s.config = Arc::new(config);
    s.text = Arc::from(text);
    Ok(summary)
}

/// Logs and counts a change's outcome (`Ok`: the rules now enforced).
fn record(s: &mut crate::daemon::state::State, trigger: &str, result: Result<&str, &ApplyError>) {
    let message = match result {
        Ok(summary) => {
            s.reloads_ok += 1;
            info!("{trigger}: reloaded, now enforcing {summary}");
            summary.to_string()
        }
        Err(e) => {
            s.reloads_failed += 1;
            error!("{trigger}: reload rejected, keeping the running config: {e}");
            e.to_string()
        }
    };
    s.last_reload = Some(ReloadRecord {
        at: unix_now(),
        ok: result.is_ok(),
        trigger: trigger.into(),
        message,
    });
}

/// `config` compiled as it stands: as written, or in its `on_failure`
/// variant while the cluster is degraded (`mode`).
fn compiled_for(
    config: &Config,
    mode: Option<crate::cluster::OnFailure>,
) -> crate::compile::Compiled {
    let mut compiled = compile(config);
    if let Some(m) = mode {
        compiled.rules = crate::compile::with_failure_mode(config, compiled.rules, m);
    }
    compiled
}

/// The first step of an install, its waits made without the state lock:
/// the old slot's grace (until `ready`), then that of the rule entries
/// [`crate::datapath::Datapath::prepare`] marks as changing.
fn prepare_unlocked(
    shared: &Shared,
    plan: &mut Plan,
    ready: Instant,
) -> Result<(), crate::datapath::DatapathError> {
    sleep_until(ready);
    let unnamed = lock(shared).dp.prepare(plan)?;
    sleep_until(unnamed);
    Ok(())
}

/// Installs the running rules as they stand while the cluster is degraded
/// with `mode` (see [`crate::compile::with_failure_mode`]), or as written
/// (`None`), unless they stand so already.
pub fn set_failure_mode(
    shared: &Shared,
    mode: Option<crate::cluster::OnFailure>,
) -> Result<(), ApplyError> {
    let _writer = WRITER.lock().unwrap_or_else(|e| e.into_inner());
    // Stopped, the datapath is left with the rules it had.
    refuse_if_stopping()?;
    let (config, basis, ready) = {
        let s = lock(shared);
        if s.failure_mode == mode {
            return Ok(());
        }
        (s.config.clone(), s.dp.basis(), s.dp.ready_at())
    };
    let compiled = compiled_for(&config, mode);
    let failed = |e: &dyn std::fmt::Display| {
        ApplyError::Failed(format!("installing the on_failure rules: {e}"))
    };
    let mut plan = Plan::new(basis, &compiled.rules).map_err(|e| failed(&e))?;
    prepare_unlocked(shared, &mut plan, ready).map_err(|e| failed(&e))?;
    let mut s = lock(shared);
    s.dp.execute(plan).map_err(|e| failed(&e))?;
    s.failure_mode = mode;
    match mode {
        Some(m) => warn!(
            "cluster degraded: cluster packet rules now enforce on_failure = \"{}\"",
            m.name()
        ),
        None => info!("cluster healthy: cluster packet rules enforce their limits again"),
    }
    Ok(())
}

/// Refuses a change of what the datapath was made with: the tables' sizes
/// (`max_sources`, `flood_prefixes`: the program's cap and the status
/// figures would read the new ones over tables of the old) and the prefix
/// cells' lengths (a source limited in its /24 cell would find a fresh cell
/// under another length).
fn sized_at_load(
    new: &crate::config::Datapath,
    running: &crate::config::Datapath,
) -> Result<(), ApplyError> {
    let refuse = |what: &str, new: String, old: String, why: &str| {
        Err(ApplyError::Invalid(format!(
            "datapath.{what} = {new} differ from the running {old}: {why}, so they change only with a fresh \
             datapath: restore them (or drop all limiter state with `rl-control detach` and start again)"
        )))
    };
    let (n, r) = (
        (new.max_sources, new.flood_prefixes),
        (running.max_sources, running.flood_prefixes),
    );
    if n != r {
        let why = "the sources' table and the prefix cells are sized when the datapath is made";
        return refuse(
            "max_sources/flood_prefixes",
            format!("{}/{}", n.0, n.1),
            format!("{}/{}", r.0, r.1),
            why,
        );
    }
    let (n, r) = (
        (new.flood_prefix_v4, new.flood_prefix_v6),
        (running.flood_prefix_v4, running.flood_prefix_v6),
    );
    if n != r {
        let why =
            "a source limited in its prefix cell would find a fresh cell under the new length";
        return refuse(
            "flood_prefix_v4/v6",
            format!("{}/{}", n.0, n.1),
            format!("{}/{}", r.0, r.1),
            why,
        );
    }
    if (&new.pin_dir, &new.interfaces) != (&running.pin_dir, &running.interfaces) {
        return Err(ApplyError::Invalid(
            "datapath.pin_dir and datapath.interfaces are read when the daemon starts, and a reload cannot apply them: \
             restore them in the file, or restart the daemon to apply them (its --pin-dir and --iface flags, if given, win; \
             a changed set of interfaces first takes the old set's datapath off with `rl-control detach`)"
                .into(),
        ));
    }
    Ok(())
}

/// Warns of a reload that gives keys a fresh start: the aggregation
/// prefixes key every `key = "source"` rule's buckets and `[default]`'s.
fn warn_fresh_keys(new: &crate::config::Datapath, running: &crate::config::Datapath) {
    let (n, r) = (
        (new.ipv4_prefix, new.ipv6_prefix),
        (running.ipv4_prefix, running.ipv6_prefix),
    );
    if n != r {
        warn!(
            "datapath.ipv4_prefix/ipv6_prefix change from /{}//{} to /{}//{}: every key = \"source\" rule and [default] keys its sources anew, \
             so each starts with its limit's full burst (once, now)",
            r.0, r.1, n.0, n.1
        );
    }
}

/// Validates, compiles (no lock), installs (the state lock held for the
/// map writes only) and persists (no lock) one change.
fn install(
    shared: &Shared,
    change: Change,
    path: Option<&Path>,
    stamp: Option<crate::daemon::state::FileStamp>,
) -> Result<
    (
        String,
        Config,
        String,
        Option<crate::daemon::state::FileStamp>,
    ),
    ApplyError,
> {
    let t0 = Instant::now();
    let new = Config::from_str(&change.text, &change.origin)
        .map_err(|e| ApplyError::Invalid(e.to_string()))?;
    let running = lock(shared).config.clone();
    sized_at_load(&new.datapath, &running.datapath)?;
    if new.api != running.api {
        return Err(ApplyError::Invalid(
            "[api] differs from the running daemon's: its listeners and token are set up at start, so a reload cannot apply them \
             (a token rotated here would leave the old one working): restore it in the file, or restart the daemon to apply it"
                .into(),
        ));
    }
    if new.cluster != running.cluster {
        return Err(ApplyError::Invalid(
            "[cluster] differs from the running daemon's, and it changes only on restart: \
             restore it in the file (or restart the daemon to join another Redis)"
                .into(),
        ));
    }
    let (l7, was) = (&new.l7, &running.l7);
    if (
        l7.grpc_listen,
        l7.http_listen,
        l7.grpc_threads,
        l7.draft_headers,
        l7.max_connections,
    ) != (
        was.grpc_listen,
        was.http_listen,
        was.grpc_threads,
        was.draft_headers,
        was.max_connections,
    ) {
        return Err(ApplyError::Invalid(
            "[l7] grpc_listen, http_listen, grpc_threads, draft_headers or max_connections differ from the running daemon's: they are set up at start, \
             so a reload cannot apply them: restore them in the file, or restart the daemon to apply them ([l7] rules and max_keys reload)"
                .into(),
        ));
    }
    // The flip is the install's last write: whatever failed before it,
    // the rules in force stay in force.
    let failed = |what: &str, e: &dyn std::fmt::Display| {
        ApplyError::Failed(format!(
            "{what}: {e}; the rules in force before stay in force (retry the change; if it fails again, the daemon's log says why)"
        ))
    };
    let conflict = |p: &Path| {
        format!(
            "{} changed on disk since the daemon last read it, and that edit is not applied: \
             apply it first (`rl-control reload`), then repeat this change",
            p.display()
        )
    };
    // Written beside the file before anything is installed: a write that
    // fails changes nothing.
    let staged = match (change.persist, path) {
        (true, Some(p)) => {
            if file_stamp(p) != stamp {
                return Err(ApplyError::Conflict(conflict(p)));
            }
            let staged = Staged::write(p, &change.text).map_err(|e| {
                ApplyError::Unwritable(format!(
                    "cannot write {} (nothing changed; check its directory is writable): {e}",
                    p.display()
                ))
            })?;
            Some((p, staged))
        }
        (true, None) => {
            warn!("running on the embedded default: this change lasts until the daemon stops (start with --config to keep changes)");
            None
        }
        (false, _) => None,
    };
    let failure_mode = lock(shared).failure_mode;
    let compiled = compiled_for(&new, failure_mode);
    // The differences are worked out against a snapshot, outside the lock;
    // the lock is held to write them and flip.
    let (basis, ready) = {
        let s = lock(shared);
        (s.dp.basis(), s.dp.ready_at())
    };
    let mut plan =
        Plan::new(basis, &compiled.rules).map_err(|e| failed("installing the rules", &e))?;
    let t1 = Instant::now();
    prepare_unlocked(shared, &mut plan, ready).map_err(|e| failed("installing the rules", &e))?;
    let notes = {
        let mut s = lock(shared);
        s.dp.execute(plan)
            .map_err(|e| failed("installing the rules", &e))?;
        s.dp.wide_count_notes()
    };
    let t2 = Instant::now();
    for note in notes {
        warn!("{note}");
    }
    let mut written = None;
    if let Some((p, staged)) = staged {
        // An edit that landed while this change was installed is not
        // written over: the file keeps it, and the old rules go back.
        let placed = match file_stamp(p) == stamp {
            true => {
                // Seen (and in force: installed above) before it is in
                // place, so the watcher never reads this change's own write
                // as an edit on disk, nor the status a refused file.
                let before = {
                    let mut s = lock(shared);
                    let before = (s.seen, s.stamp);
                    (s.seen, s.stamp) = (staged.stamp(), staged.stamp());
                    before
                };
                staged.commit().map_err(|e| {
                    let mut s = lock(shared);
                    (s.seen, s.stamp) = before;
                    ApplyError::Unwritable(format!("cannot write {}: {e}", p.display()))
                })
            }
            false => Err(ApplyError::Conflict(conflict(p))),
        };
        match placed {
            Ok(st) => written = Some(st),
            Err(e) => {
                let back = match put_back(shared) {
                    Ok(()) => "the old rules are back in force".to_string(),
                    Err(back) => format!(
                        "putting the old rules back failed ({back}): the datapath enforces the new rules \
                         while the status and the file show the old ones, until the next reload"
                    ),
                };
                return Err(match e {
                    ApplyError::Conflict(m) => ApplyError::Conflict(format!("{m} ({back})")),
                    ApplyError::Unwritable(m) => ApplyError::Unwritable(format!("{m} ({back})")),
                    other => ApplyError::Failed(format!("{other} ({back})")),
                });
            }
        }
    }
    warn_fresh_keys(&new.datapath, &running.datapath);
    let ms = |d: std::time::Duration| d.as_secs_f64() * 1e3;
    let summary = format!(
        "{} (enforced after {:.1} ms: validated and compiled in {:.1}, installed in {:.1}; file written in {:.1})",
        new.summary(),
        ms(t2 - t0),
        ms(t1 - t0),
        ms(t2 - t1),
        ms(t2.elapsed())
    );
    Ok((summary, new, change.text, written.flatten()))
}

/// Puts the running config's rules back in force after an install whose
/// file could not be put in place (waits made without the state lock).
fn put_back(shared: &Shared) -> Result<(), crate::datapath::DatapathError> {
    let (config, mode, basis, ready) = {
        let s = lock(shared);
        (
            s.config.clone(),
            s.failure_mode,
            s.dp.basis(),
            s.dp.ready_at(),
        )
    };
    let old = compiled_for(&config, mode);
    let mut plan = Plan::new(basis, &old.rules)?;
    prepare_unlocked(shared, &mut plan, ready)?;
    lock(shared).dp.execute(plan)?;
    Ok(())
}

/// Applies an edit of the running text (one rule or ban added or removed)
/// and writes it back: errors are located in the config file.
pub fn apply_edit<E: From<ApplyError>>(
    shared: &Shared,
    trigger: &str,
    edit: impl FnOnce(&Running) -> Result<String, E>,
) -> Result<String, E> {
    apply(shared, trigger, |s| {
        Ok(Change {
            text: edit(s)?,
            origin: s.origin(),
            persist: true,
            read_as: None,
        })
    })
}

/// Re-reads the config file and applies it. The file is read under the
/// change lock (a change confirmed meanwhile is in what it reads), its
/// stamp first: valid or not, a later edit triggers the next reload.
pub fn reload_file(shared: &Shared, trigger: &str) -> Result<String, ApplyError> {
    let Some(path) = lock(shared).path.clone() else {
        let e = ApplyError::Invalid(
            "running on the embedded default: there is no file to reload".into(),
        );
        warn!("{trigger}: {e}");
        return Err(e);
    };
    apply(shared, trigger, |_| {
        let read_as = file_stamp(&path);
        match std::fs::read_to_string(&path) {
            Ok(text) => Ok(Change {
                text,
                origin: path.display().to_string(),
                persist: false,
                read_as,
            }),
            Err(e) => {
                let e = ApplyError::Failed(format!(
                    "cannot read {}: {e} (restore the file, then reload)",
                    path.display()
                ));
                let mut s = lock(shared);
                s.seen = read_as;
                record(&mut s, trigger, Err(&e));
                Err(e)
            }
        }
    })
}

/// Lifts bans whose time is up, written back to the file; while the file
/// holds an edit not applied yet, in the datapath only (the file's expired
/// ban is inert, and the edit is not overwritten).
pub fn expire_bans(shared: &Shared) {
    if !ban_retry().due() {
        return;
    }
    let now = unix_now();
    let (expired, stepped, path, stamp) = {
        let s = lock(shared);
        let expired = s.config.bans.iter().any(|b| b.until <= now);
        let stepped = !expired && s.dp.ban_clock_stepped();
        (expired, stepped, s.path.clone(), s.stamp)
    };
    if !expired {
        if stepped {
            // The kernel ends bans by ktime, converted from the wall
            // clock: after a step, convert them again.
            let r = apply(
                shared,
                "the wall clock stepped: the bans' ends rewritten",
                |s| {
                    Ok::<_, ApplyError>(Change {
                        text: s.text.to_string(),
                        origin: s.origin(),
                        persist: false,
                        read_as: None,
                    })
                },
            );
            ban_retry().after(r.is_ok());
        }
        return;
    }
    // Read without the state lock: a slow disk must not stall /healthz.
    let pending = path.as_deref().is_some_and(|p| file_stamp(p) != stamp);
    let trigger = if pending {
        "ban(s) expired (lifted, the config file not written: it holds an edit not applied yet)"
    } else {
        "ban(s) expired"
    };
    let lift = |persist: bool| {
        move |s: &Running| {
            let text = crate::config::document::remove_bans(&s.text, |_, until| until <= now)
                .map(|(text, _)| text)
                .map_err(|e| {
                    ApplyError::Failed(format!("cannot lift expired bans: {}", edit_message(&e)))
                })?;
            Ok::<_, ApplyError>(Change {
                text,
                origin: s.origin(),
                persist,
                read_as: None,
            })
        }
    };
    // A failure is logged and recorded by `apply`.
    let r = apply(shared, trigger, lift(!pending));
    // The file cannot be written (read-only, full): lift them in the
    // datapath anyway, once, or the same failure would repeat every second.
    if matches!(r, Err(ApplyError::Unwritable(_))) {
        let trigger = "ban(s) expired (lifted, the config file not written: writing it failed)";
        let r = apply(shared, trigger, lift(false));
        ban_retry().after(r.is_ok());
        return;
    }
    ban_retry().after(r.is_ok());
    // A failure before the install (the edit itself) is on no record: said
    // once per reason, since it is tried again every second and the
    // expired bans keep dropping meanwhile.
    static SAID: Mutex<Option<String>> = Mutex::new(None);
    let mut said = SAID.lock().unwrap_or_else(|e| e.into_inner());
    match r {
        Err(e) if said.as_deref() != Some(e.to_string().as_str()) => {
            tracing::error!("expired bans cannot be lifted ({e}): the kernel ended them at their time, but the rules in force and the file still list them until this is fixed (edit the file, then `rl-control reload`); tried again, backing off to once a minute");
            *said = Some(e.to_string());
        }
        Ok(_) => *said = None,
        Err(_) => {}
    }
}

/// The periodic ban change panicked: tried again after a back-off, as
/// after a failure.
pub fn ban_change_failed() {
    tracing::error!("lifting expired bans panicked: the kernel ends them at their time; tried again, backing off to once a minute");
    ban_retry().after(false);
}

/// When the periodic ban change may be tried next: after a failure, 1 s
/// doubling to a minute, so a lasting failure (maps that refuse writes) is
/// not logged and recorded as a failed reload every second.
static BAN_RETRY: Mutex<Backoff> = Mutex::new(Backoff {
    next: None,
    delay: Duration::from_secs(1),
});

fn ban_retry() -> std::sync::MutexGuard<'static, Backoff> {
    BAN_RETRY.lock().unwrap_or_else(|e| e.into_inner())
}

struct Backoff {
    next: Option<Instant>,
    delay: Duration,
}

impl Backoff {
    fn due(&self) -> bool {
        self.next.is_none_or(|t| Instant::now() >= t)
    }

    fn after(&mut self, ok: bool) {
        if ok {
            (self.next, self.delay) = (None, Duration::from_secs(1));
        } else {
            self.next = Some(Instant::now() + self.delay);
            self.delay = (self.delay * 2).min(Duration::from_secs(60));
        }
    }
}

fn edit_message(e: &crate::config::document::EditError) -> &str {
    use crate::config::document::EditError::*;
    match e {
        Invalid(m) | Conflict(m) | NotFound(m) => m,
    }
}

/// `text` written beside the file it will replace, synced, not yet in
/// place: readers see the old file or the new one, never a mix, even across
/// a crash. A uniquely named temporary file next to the real file (a
/// symlink is followed), with its mode and owner; [`Staged::commit`]
/// renames it over the file and syncs the directory; dropped uncommitted,
/// it is removed.
pub struct Staged {
    tmp: PathBuf,
    real: PathBuf,
    stamp: Option<crate::daemon::state::FileStamp>,
    committed: bool,
}

impl Staged {
    pub fn write(path: &Path, text: &str) -> std::io::Result<Staged> {
        use std::{
            io::Write,
            os::unix::fs::MetadataExt,
            sync::atomic::{AtomicU64, Ordering},
        };
        static SEQ: AtomicU64 = AtomicU64::new(0);
        let real = real_path(path);
        let dir = dir_of(&real);
        let name = real
            .file_name()
            .map(|n| n.to_string_lossy().into_owned())
            .unwrap_or_default();
        let tmp = dir.join(format!(
            ".{name}.rl-tmp.{}.{}",
            std::process::id(),
            SEQ.fetch_add(1, Ordering::Relaxed)
        ));
        use std::os::unix::fs::OpenOptionsExt;
        // Made 0600 (then given the file's own mode): the text it will hold
        // (a Redis password, say) is never readable by others meanwhile.
        let mut f = std::fs::OpenOptions::new()
            .write(true)
            .create_new(true)
            .mode(0o600)
            .open(&tmp)?;
        // From here the guard removes the file on any failure.
        let mut staged = Staged {
            tmp,
            real,
            stamp: None,
            committed: false,
        };
        if let Ok(m) = std::fs::metadata(&staged.real) {
            f.set_permissions(m.permissions())?;
            if let Err(e) = std::os::unix::fs::fchown(&f, Some(m.uid()), Some(m.gid())) {
                warn!(
                    "{} keeps its mode but not its owner {}:{} ({e}: the daemon lacks CAP_CHOWN)",
                    staged.real.display(),
                    m.uid(),
                    m.gid()
                );
            }
        }
        f.write_all(text.as_bytes())?;
        f.sync_all()?;
        // What the file's stamp will be once renamed (a rename keeps the
        // inode, size and mtime): taken from the file written, not read
        // back from the path, where an edit may land after the rename.
        staged.stamp = crate::daemon::state::file_stamp(&staged.tmp);
        Ok(staged)
    }

    /// What the file's stamp will be once committed.
    pub fn stamp(&self) -> Option<crate::daemon::state::FileStamp> {
        self.stamp
    }

    /// Puts the text in place of the file; its stamp.
    pub fn commit(mut self) -> std::io::Result<Option<crate::daemon::state::FileStamp>> {
        std::fs::rename(&self.tmp, &self.real)?;
        self.committed = true;
        // Renamed, the file holds the new text: a failed sync of the
        // directory only leaves the rename less durable across a crash.
        let dir = dir_of(&self.real);
        if let Err(e) = std::fs::File::open(dir).and_then(|d| d.sync_all()) {
            warn!(
                "{} written, but syncing {} failed ({e}): a crash now may bring back the old file",
                self.real.display(),
                dir.display()
            );
        }
        Ok(self.stamp)
    }
}

/// The config file a path names (a symlink followed).
fn real_path(path: &Path) -> PathBuf {
    std::fs::canonicalize(path).unwrap_or_else(|_| path.to_path_buf())
}

/// The directory holding `file` (`.` for a bare name).
fn dir_of(file: &Path) -> &Path {
    file.parent()
        .filter(|d| !d.as_os_str().is_empty())
        .unwrap_or(Path::new("."))
}

/// Removes what a change killed mid-way (SIGKILL, OOM) left beside the
/// config file: temporary files of processes that no longer run.
pub fn remove_stale_staged(path: &Path) {
    let real = real_path(path);
    let dir = dir_of(&real);
    let Some(name) = real.file_name().map(|n| n.to_string_lossy().into_owned()) else {
        return;
    };
    let prefix = format!(".{name}.rl-tmp.");
    let Ok(entries) = std::fs::read_dir(dir) else {
        return;
    };
    for e in entries.flatten() {
        let file = e.file_name().to_string_lossy().into_owned();
        let Some(pid) = file
            .strip_prefix(&prefix)
            .and_then(|rest| rest.split('.').next())
            .and_then(|p| p.parse::<u32>().ok())
        else {
            continue;
        };
        if pid != std::process::id() && !Path::new(&format!("/proc/{pid}")).exists() {
            match std::fs::remove_file(e.path()) {
                Ok(()) => info!(
                    "removed {}, left by a change that was killed mid-way",
                    e.path().display()
                ),
                Err(err) => warn!(
                    "cannot remove {}, left by a change that was killed mid-way: {err}",
                    e.path().display()
                ),
            }
        }
    }
}

impl Drop for Staged {
    fn drop(&mut self) {
        if !self.committed {
            let _ = std::fs::remove_file(&self.tmp);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A failing periodic change is tried again after 1, 2, 4 … s, at most
    /// a minute apart, and at once after it works again.
    #[test]
    fn a_failing_ban_change_backs_off_to_a_minute() {
        let mut b = Backoff {
            next: None,
            delay: Duration::from_secs(1),
        };
        assert!(b.due());
        let mut waits = Vec::new();
        for _ in 0..8 {
            b.after(false);
            assert!(!b.due(), "due again at once after a failure");
            waits.push((b.next.unwrap() - Instant::now()).as_secs_f64().round() as u64);
        }
        assert_eq!(waits, [1, 2, 4, 8, 16, 32, 60, 60]);
        b.after(true);
        assert!(b.due());
        b.after(false);
        assert_eq!(
            b.delay,
            Duration::from_secs(2),
            "back to 1 s after a success"
        );
    }
}
