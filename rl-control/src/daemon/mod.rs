//! The run loop: validate, load, attach, report, reload on SIGHUP, detach on
//! SIGINT/SIGTERM.

pub mod apply;
pub mod cluster;
mod collect;
mod floods;
mod kept;
pub mod state;

use std::{
    net::SocketAddr,
    path::PathBuf,
    sync::{Arc, Mutex},
    time::Duration,
};

use anyhow::{Context, Result};
use tokio::{
    io::unix::AsyncFd,
    signal::unix::{signal, SignalKind},
};
use tracing::{info, warn};

use crate::{
    api,
    compile::compile,
    config::units::bytes_to_addr,
    config::{Config, EMBEDDED_DEFAULT},
    daemon::state::{file_stamp, lock, Loaded, Shared, State},
    datapath::{interface_index, AttachMode, Datapath, LoadOptions},
};

/// What `rl-control run` needs.
#[derive(Clone, Debug)]
pub struct RunOptions {
    /// Interfaces to protect (overrides `[datapath] interfaces`).
    pub ifaces: Vec<String>,
    pub config: Option<PathBuf>,
    pub mode: AttachMode,
    pub stats_interval: Duration,
    /// Written after attaching, removed on exit; `rl-control reload` reads it.
    pub pid_file: Option<PathBuf>,
    /// Reload when the config file changes on disk.
    pub watch: bool,
    /// Admin API TCP address (overrides `[api] listen`; needs a token).
    pub api: Option<SocketAddr>,
    /// Holds the admin socket `api.sock` (and, by default, the pid file).
    pub runtime_dir: PathBuf,
    /// Pin directory (overrides `[datapath] pin_dir`).
    pub pin_dir: Option<PathBuf>,
    /// Detach and unpin on SIGINT/SIGTERM instead of leaving rl enforcing.
    pub detach_on_exit: bool,
}

/// `rl-control detach`: removes rl's program, links and pins from `iface`
/// and from the interfaces that share its datapath.
pub fn detach(iface: &str, pin_dir: &std::path::Path) -> Result<()> {
    let dirs = crate::datapath::pin_dirs_with(pin_dir, iface).map_err(|e| match e.kind() {
        std::io::ErrorKind::PermissionDenied => anyhow::anyhow!(
            "permission denied while reading the pin directory {}: run rl-control detach as root",
            pin_dir.display()
        ),
        _ => anyhow::anyhow!("cannot read the pin directory {}: {e}", pin_dir.display()),
    })?;
    if dirs.is_empty() {
        println!(
            "nothing of rl is pinned for {iface} in {}: nothing to detach",
            pin_dir.display()
        );
    }
    for dir in dirs {
        crate::datapath::detach_pinned(&dir)?;
        let name = dir
            .file_name()
            .map(|n| n.to_string_lossy().replace('+', ", "))
            .unwrap_or_default();
        println!(
            "detached rl from {name} and removed its pins in {}",
            dir.display()
        );
    }
    Ok(())
}

/// How often the config file is checked for changes.
const WATCH_INTERVAL: Duration = Duration::from_secs(1);

/// `rl-control reload`: SIGHUP to the daemon named in `pid_file`.
pub fn signal_reload(pid_file: &std::path::Path) -> Result<()> {
    let text = std::fs::read_to_string(pid_file).with_context(|| {
        format!(
            "cannot read {}: is rl-control running? (its --pid-file must match)",
            pid_file.display()
        )
    })?;
    let pid: libc::pid_t = text
        .trim()
        .parse()
        .with_context(|| format!("{} does not hold a process id", pid_file.display()))?;
    if pid <= 0 {
        anyhow::bail!("{} holds {pid}, not a process id: check the file, or reload through the API (`rl-control reload`)", pid_file.display());
    }
    // A pid file a killed daemon left may now name another process:
    // SIGHUP would stop most programs.
    let name = |exe: std::path::PathBuf| {
        exe.file_name().map(|n| {
            n.to_string_lossy()
                .trim_end_matches(" (deleted)")
                .to_string()
        })
    };
    let theirs = std::fs::read_link(format!("/proc/{pid}/exe"))
        .ok()
        .and_then(name);
    let ours = std::env::current_exe().ok().and_then(name);
    match (&theirs, &ours) {
        (Some(t), Some(o)) if t == o => {}
        (None, _) if !std::path::Path::new(&format!("/proc/{pid}")).exists() => {
            anyhow::bail!("no process {pid} (from {}): is rl-control running? A daemon that was killed leaves its pid file behind", pid_file.display())
        }
        (None, _) => anyhow::bail!("cannot tell which program process {pid} (from {}) runs: run rl-control reload as root", pid_file.display()),
        (Some(t), _) => anyhow::bail!(
            "process {pid} (from {}) is {t}, not rl-control: the pid file is stale (a killed daemon leaves it); not signalled",
            pid_file.display()
        ),
    }
    if unsafe { libc::kill(pid, libc::SIGHUP) } != 0 {
        let e = std::io::Error::last_os_error();
        anyhow::bail!(
            "cannot signal rl-control (pid {pid} from {}): {e}; is it still running?",
            pid_file.display()
        );
    }
    println!("asked rl-control (pid {pid}) to reload; its log shows the result");
    Ok(())
}

/// Removes the pid file when the daemon exits, however it exits.
struct PidFile(PathBuf);

impl PidFile {
    /// Writes this process's id to `path`; a failure is only warned about.
    fn write(path: &std::path::Path) -> Option<Self> {
        match std::fs::write(path, format!("{}\n", std::process::id())) {
            Ok(()) => Some(PidFile(path.to_path_buf())),
            Err(e) => {
                warn!("cannot write the pid file {}: {e}; `rl-control reload --pid-file` will not find this daemon (SIGHUP and the API still work)", path.display());
                None
            }
        }
    }
}

impl Drop for PidFile {
    fn drop(&mut self) {
        let _ = std::fs::remove_file(&self.0);
    }
}

/// Loads the config named by `path` (with its text), or the embedded default.
pub fn load_config(path: Option<&PathBuf>) -> Result<(Config, String)> {
    match path {
        Some(p) => {
            let text = std::fs::read_to_string(p)
                .with_context(|| format!("cannot read the config file {}", p.display()))?;
            Ok((Config::from_str(&text, &p.display().to_string())?, text))
        }
        None => Ok((Config::embedded_default(), EMBEDDED_DEFAULT.to_string())),
    }
}

/// Large allocations (the request store's tables, 1 MiB a shard at a
/// million keys) always get their own mapping, returned to the system when
/// freed. glibc otherwise raises this threshold after each such free, so a
/// table outgrown during a fill stayed in the heap as spare memory: the
/// daemon's memory per request key read 93–115 bytes from run to run.
fn large_allocations_mapped() {
    #[cfg(target_env = "gnu")]
    // SAFETY: mallopt only changes the allocator's tuning; any value is valid.
    unsafe {
        libc::mallopt(libc::M_MMAP_THRESHOLD, 128 << 10);
    }
}

pub async fn run(opts: RunOptions) -> Result<()> {
    large_allocations_mapped();
    // Handlers first: a signal that arrives while starting (a SIGHUP right
    // after "attached", say) must be handled, not kill the process with
    // the program attached. They are acted on once the loop runs.
    let signals = Signals::install()?;
    // The file's stamp is taken before it is read: a change after this
    // point, even during start-up, triggers a reload.
    let watched = opts.config.clone().filter(|_| opts.watch);
    // Taken whether or not the file is watched: an API change checks it
    // before writing back, so an unapplied edit on disk is never lost.
    let stamp = opts.config.as_deref().and_then(file_stamp);
    // Everything that can be checked is checked before the interface is touched.
    let (config, text) = load_config(opts.config.as_ref())?;
    if opts.config.is_none() {
        info!(
            "no --config given: using the embedded default ({} packets/s, burst {} per source)",
            config.default.rate, config.default.burst
        );
    }
    let listeners = api::listen::bind(&opts.runtime_dir, opts.api, &config).await?;
    if let Some(p) = &opts.config {
        apply::remove_stale_staged(p);
    }
    let l7_listener = api::listen::bind_tcp(
        config.l7.http_listen,
        "the request check",
        "[l7] http_listen",
    )
    .await?;
    let grpc_listener = api::listen::bind_tcp(
        config.l7.grpc_listen,
        "Envoy's rate-limit service",
        "[l7] grpc_listen",
    )
    .await?;
    let ifaces = if opts.ifaces.is_empty() {
        config.datapath.interfaces.clone()
    } else {
        opts.ifaces.clone()
    };
    if ifaces.is_empty() {
        anyhow::bail!("no interface to protect: pass --iface IFACE (repeat it for several) or set [datapath] interfaces");
    }
    for iface in &ifaces {
        interface_index(iface)?;
    }
    let cluster = cluster::join(&config).await?;
    let pin_dir = opts
        .pin_dir
        .clone()
        .unwrap_or_else(|| config.datapath.pin_dir.clone());
    let pins = pin_dir.join(crate::datapath::pin_group(&ifaces));
    // The request threads before anything is attached: a start that
    // fails after attaching leaves it attached with no daemon.
    let threads = request_threads(&config, l7_listener.is_some() || grpc_listener.is_some())?;
    let (mut dp, attachments) = enforce(&config, &ifaces, opts.mode, &pin_dir, &pins)?;
    kept::restore(&mut dp, &opts.runtime_dir);
    let on = log_attached(&config, &attachments);
    if let Some(logger) = dp.take_logger() {
        tokio::spawn(forward_kernel_logs(logger));
    }
    let maps = dp.table_maps();
    let events = dp.take_events();
    let l7: crate::l7::http::Shared = Arc::new(std::sync::RwLock::new(Arc::new(
        crate::l7::engine::Engine::new(&config.l7, dp.epoch_offset_ns(), None)
            .with_cluster(cluster.clone()),
    )));
    let _threads = serve_requests(&config, &l7, threads, l7_listener, grpc_listener);
    let file = Loaded {
        config,
        text,
        path: opts.config.clone(),
        stamp,
    };
    let state: Shared = Arc::new(Mutex::new(State::new(
        dp,
        file,
        l7,
        cluster.clone(),
        attachments.clone(),
    )));
    let (servers, _socket_file) = api::listen::serve(listeners, state.clone());
    let counter = spawn_jobs(&state, maps, events, cluster);
    let keeper = tokio::spawn(kept::keep(state.clone(), opts.runtime_dir.clone()));
    let _pid_file = opts.pid_file.as_ref().and_then(|p| PidFile::write(p));
    let signals = until_stopped(&state, signals, watched, opts.stats_interval).await?;
    signals.exit_on_second();
    let stopping = Stopping {
        servers,
        counter,
        pins,
        detach: opts.detach_on_exit,
        on,
        first: attachments[0].iface.clone(),
        runtime_dir: opts.runtime_dir.clone(),
        keeper,
    };
    stopping.stop(state).await
}

/// Says what the limiter now holds, and where; returns the interfaces
/// with their modes, for the stop's messages.
fn log_attached(config: &Config, attachments: &[crate::datapath::Attachment]) -> String {
    let on: Vec<String> = attachments
        .iter()
        .map(|a| format!("{} ({})", a.iface, a.mode))
        .collect();
    let on = on.join(", ");
    info!(
        ifaces = %on,
        mode = %attachments[0].mode,
        "attached: every source held to {} packets/s, burst {} (IPv4 /{}, IPv6 /{}), tracking up to {} sources",
        config.default.rate,
        config.default.burst,
        config.datapath.ipv4_prefix,
        config.datapath.ipv6_prefix,
        config.datapath.max_sources,
    );
    on
}

/// Starts the daemon's background jobs: the tables' collector and the
/// flood detectors' reader (returned: they are stopped before the datapath
/// is let go), the request store's
/// sweep, the cluster's links, and the "limited" events' feed.
fn spawn_jobs(
    state: &Shared,
    maps: Result<crate::datapath::TableMaps, crate::datapath::DatapathError>,
    events: Result<aya::maps::RingBuf<aya::maps::MapData>, crate::datapath::DatapathError>,
    cluster: Option<Arc<crate::cluster::Cluster>>,
) -> Option<tokio::task::JoinHandle<()>> {
    tokio::spawn(collect::sweep_requests(lock(state).l7.clone()));
    if let Some(c) = cluster {
        tokio::spawn(cluster::keep_in_touch(state.clone(), c.clone()));
        tokio::spawn(cluster::sync_packets(state.clone(), c.clone()));
        tokio::spawn(cluster::sync_requests(state.clone(), c));
    }
    match events {
        Ok(ring) => {
            tokio::spawn(forward_events(state.clone(), ring));
        }
        Err(e) => collect::tried(
            &mut lock(state),
            collect::Reader::Events,
            Err(format!("the events map: {e}")),
        ),
    }
    match maps {
        Ok(ids) => {
            let state = state.clone();
            Some(tokio::spawn(async move {
                // Each reader loops for good; one that panics is reported
                // failing and started again, never left dead while its
                // health says all is well.
                use futures_util::FutureExt;
                let watch = |reader: collect::Reader| {
                    let (state, ids) = (state.clone(), ids.clone());
                    async move {
                        loop {
                            let run = match reader {
                                collect::Reader::Walk => {
                                    collect::watch_pressure(state.clone(), ids.clone()).boxed()
                                }
                                _ => floods::watch_floods(state.clone(), ids.clone()).boxed(),
                            };
                            let ended = std::panic::AssertUnwindSafe(run).catch_unwind().await;
                            let why = match ended {
                                Err(_) => "panicked",
                                Ok(()) => "returned",
                            };
                            collect::tried(
                                &mut lock(&state),
                                reader,
                                Err(format!("the reader {why}: started again in 1 s")),
                            );
                            tokio::time::sleep(Duration::from_secs(1)).await;
                        }
                    }
                };
                tokio::join!(
                    watch(collect::Reader::Walk),
                    watch(collect::Reader::FloodReading)
                );
            }))
        }
        Err(e) => {
            // Reported as failing readers, in /v1/status and /metrics too.
            let mut s = lock(state);
            let error = format!("the datapath's tables cannot be opened: {e}");
            collect::tried(&mut s, collect::Reader::Walk, Err(error.clone()));
            collect::tried(&mut s, collect::Reader::FloodReading, Err(error));
            None
        }
    }
}

/// What the daemon stops when it is told to.
struct Stopping {
    servers: Vec<tokio::task::JoinHandle<()>>,
    counter: Option<tokio::task::JoinHandle<()>>,
    pins: PathBuf,
    detach: bool,
    /// The interfaces, for the last log line.
    on: String,
    first: String,
    /// Where the retired rules' counters are kept ([`kept`]), and the task
    /// that keeps them (stopped before the last write: an older snapshot of
    /// its must not land after it).
    runtime_dir: PathBuf,
    keeper: tokio::task::JoinHandle<()>,
}

impl Stopping {
    /// Stops serving, then detaches and unpins (`--detach-on-exit`) or
    /// leaves the pinned datapath enforcing.
    async fn stop(self, state: Shared) -> Result<()> {
        // Stop serving first: the API's handlers hold the state (and with it
        // the datapath) only while a request runs.
        for server in self.servers {
            server.abort();
            let _ = server.await;
        }
        if let Some(c) = self.counter {
            c.abort();
            let _ = c.await;
        }
        // The counters' keeper (its older snapshot must not land after the
        // last write below).
        self.keeper.abort();
        let _ = self.keeper.await;
        // A change under way finishes (its client sees the answer) before
        // the datapath is left or taken off; one still waiting is refused.
        let _changes = crate::daemon::apply::stop_changes();
        let (totals, gone) = {
            let s = lock(&state);
            let totals =
                s.dp.counters()
                    .map_or_else(|e| format!("unavailable ({e})"), |t| t.to_string());
            (totals, s.dp.not_attached())
        };
        if self.detach {
            // Detaches at once, whoever still holds the link.
            crate::datapath::detach_pinned(&self.pins)?;
        }
        kept::at_stop(&state, &self.runtime_dir, self.detach);
        // The maps and program are freed with the last reference; pinned, the
        // link keeps the program attached.
        drop(state);
        if self.detach {
            info!(ifaces = %self.on, "detached and unpinned; final counters: {totals}");
        } else if !gone.is_empty() {
            let list = crate::datapath::Datapath::listed(&gone);
            warn!(ifaces = %self.on, "stopped; rl's program was no longer attached to {list}: nothing limits that traffic until rl-control runs there again; final counters: {totals}");
        } else {
            info!(
                ifaces = %self.on,
                pins = %self.pins.display(),
                "left attached and enforcing the last rule set (`rl-control detach --iface {}` removes it); final counters: {totals}",
                self.first
            );
        }
        Ok(())
    }
}

/// The signals the daemon acts on.
struct Signals {
    int: tokio::signal::unix::Signal,
    term: tokio::signal::unix::Signal,
    hup: tokio::signal::unix::Signal,
}

impl Signals {
    /// Once stopping: a second SIGINT or SIGTERM exits at once (a stop
    /// waits for a change under way, which a large rule set makes slow),
    /// leaving the datapath as it is: pinned, it keeps enforcing.
    fn exit_on_second(mut self) {
        tokio::spawn(async move {
            let which = tokio::select! {
                _ = self.int.recv() => "SIGINT",
                _ = self.term.recv() => "SIGTERM",
            };
            warn!("a second {which} while stopping: exiting now; the datapath stays as it is, pinned and enforcing (with --detach-on-exit it may be half taken off: run `rl-control detach` to finish)");
            std::process::exit(1);
        });
    }

    fn install() -> Result<Self> {
        Ok(Signals {
            int: signal(SignalKind::interrupt()).context("installing the SIGINT handler")?,
            term: signal(SignalKind::terminate()).context("installing the SIGTERM handler")?,
            hup: signal(SignalKind::hangup()).context("installing the SIGHUP handler")?,
        })
    }
}

/// Puts `config`'s rules in force on `ifaces`: loads (or adopts) the
/// datapath pinned in `pins` and takes the interfaces over with this
/// build's program (see [`Datapath::take_over`]: an adopted datapath's
/// rules are written only after the swap). If attaching fails, nothing
/// attached afresh stays attached, and a datapath pinned just now is
/// unpinned; an adopted one keeps enforcing its pinned rules, under this
/// build's program where a pinned link was taken over (see
/// [`Datapath::take_over`]).
fn enforce(
    config: &Config,
    ifaces: &[String],
    mode: AttachMode,
    pin_dir: &std::path::Path,
    pins: &std::path::Path,
) -> Result<(Datapath, Vec<crate::datapath::Attachment>)> {
    let compiled = compile(config);
    crate::datapath::prepare_pins(pin_dir, pins)?;
    let mut dp = Datapath::load_with(
        &compiled,
        LoadOptions {
            pin: Some(pins.to_path_buf()),
            layout_at_attach: true,
            ..Default::default()
        },
    )?;
    let adopted = dp.adopted();
    let attachments = match dp.take_over(&compiled.rules, ifaces, mode) {
        Ok(a) => a,
        Err(e) => {
            if !adopted {
                // Unpinned while this start still holds the pins' lock:
                // another start must not adopt them half made.
                let _ = crate::datapath::detach_pinned(pins);
                drop(dp);
            }
            return Err(e.into());
        }
    };
    if adopted {
        info!(pins = %pins.display(), "adopted the pinned datapath: buckets kept, program replaced atomically, then the rules written");
    }
    for note in dp.wide_count_notes() {
        warn!("{note}");
    }
    Ok((dp, attachments))
}

/// Serves request decisions (the HTTP check and Envoy's rate-limit
/// service), thread per core, both on the same threads, if either listens;
/// returns the threads, kept for the daemon's life.
/// The request front ends' threads, if any listener needs them.
fn request_threads(config: &Config, needed: bool) -> Result<Option<crate::l7::threads::Threads>> {
    if !needed {
        return Ok(None);
    }
    Ok(Some(crate::l7::threads::Threads::start(
        crate::l7::threads::thread_count(config.l7.grpc_threads),
    )?))
}

fn serve_requests(
    config: &Config,
    l7: &crate::l7::http::Shared,
    threads: Option<crate::l7::threads::Threads>,
    http: Option<tokio::net::TcpListener>,
    grpc: Option<tokio::net::TcpListener>,
) -> Option<crate::l7::threads::Threads> {
    let threads = threads?;
    if let Some(listener) = http {
        let addr = listener.local_addr().ok();
        crate::l7::http::serve(listener, &threads, l7.clone(), config.l7.max_connections);
        info!("request check on http://{} (POST /v1/check, forward auth on /v1/forward-auth/{{domain}}; {} l7 rules)", addr.map(|a| a.to_string()).unwrap_or_default(), config.l7.rules.len());
    }
    if let Some(listener) = grpc {
        let addr = listener.local_addr().ok();
        let draft_headers = config.l7.draft_headers;
        crate::l7::grpc_threads::serve(listener, &threads, config.l7.max_connections, || {
            crate::l7::grpc::Service {
                l7: l7.clone(),
                draft_headers,
            }
        });
        info!(
            "Envoy rate-limit service on {} (envoy.service.ratelimit.v3, {} threads)",
            addr.map(|a| a.to_string()).unwrap_or_default(),
            threads.count()
        );
    }
    Some(threads)
}

/// The datapath's counters for the stats line: a failed read costs a
/// warning and that line, never the daemon.
fn counters_or_warn(state: &Shared) -> Option<crate::datapath::Counters> {
    lock(state)
        .dp
        .counters()
        .map_err(|e| warn!("reading the counters failed ({e}): the stats line skips a tick"))
        .ok()
}

/// The daemon's loop until SIGINT or SIGTERM: reloads on SIGHUP and when
/// the `watched` file changes, expires bans, and logs the traffic every
/// `stats_interval`.
async fn until_stopped(
    state: &Shared,
    mut signals: Signals,
    watched: Option<PathBuf>,
    stats_interval: Duration,
) -> Result<Signals> {
    let mut tick = tokio::time::interval(stats_interval);
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    tick.tick().await;
    let mut last = counters_or_warn(state).map(|c| (c, std::time::Instant::now()));
    let mut watch = tokio::time::interval(WATCH_INTERVAL);
    watch.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    // Whether the watched file was gone at the last look (warned once).
    let mut missing = false;
    // The reload or file check running (on a blocking thread, which a slow
    // disk or a long collector walk may hold): polled beside the signals,
    // never waited for, so SIGTERM is acted on at once. `Some(missing)`
    // from a file check.
    let mut job: Option<tokio::task::JoinHandle<Option<bool>>> = None;
    let mut hup = false;
    loop {
        if hup && job.is_none() {
            hup = false;
            let st = state.clone();
            job = Some(tokio::task::spawn_blocking(move || {
                let _ = crate::daemon::apply::reload_file(&st, "SIGHUP");
                None
            }));
        }
        tokio::select! {
            _ = signals.int.recv() => { info!("SIGINT received: stopping"); return Ok(signals); }
            _ = signals.term.recv() => { info!("SIGTERM received: stopping"); return Ok(signals); }
            _ = signals.hup.recv() => {
                info!("SIGHUP received: reloading");
                hup = true;
            }
            done = async { job.as_mut().expect("polled only while set").await }, if job.is_some() => {
                job = None;
                match done {
                    Ok(Some(m)) => missing = m,
                    Ok(None) => {}
                    Err(e) => {
                        // A panic: not retried every second on the same file.
                        let now = watched.as_deref().and_then(file_stamp);
                        lock(state).seen = now;
                        tracing::error!("a reload or file check failed ({e}): the rules in force stay; tried again when the file changes or on SIGHUP");
                    }
                }
            }
            _ = watch.tick(), if job.is_none() => {
                let st = state.clone();
                let watched = watched.clone();
                let was_missing = missing;
                job = Some(tokio::task::spawn_blocking(move || {
                    // Apart: a panic lifting bans must not stop file reloads.
                    let lift = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
                        crate::daemon::apply::expire_bans(&st)
                    }));
                    if lift.is_err() {
                        crate::daemon::apply::ban_change_failed();
                    }
                    let Some(path) = watched else { return Some(false) };
                    // (An API change records what it writes before it
                    // renames it into place: its own write is not an edit.)
                    let now = file_stamp(&path);
                    if now.is_none() {
                        if !was_missing {
                            warn!(config = %path.display(), "the config file is gone: the rules in force stay; restore it (it is reloaded when it returns)");
                        }
                        return Some(true);
                    }
                    if now != lock(&st).seen || was_missing {
                        info!("the config file changed on disk: reloading");
                        let _ = crate::daemon::apply::reload_file(&st, "file change");
                    }
                    Some(false)
                }));
            }
            _ = tick.tick() => {
                let Some(now) = counters_or_warn(state) else { continue };
                let at = std::time::Instant::now();
                if let Some((last, then)) = &last {
                    let d = now.since(last);
                    // The time that passed, not the interval: a stalled
                    // tick must not overstate the rate.
                    let secs = (at - *then).as_secs_f64().max(1e-3);
                    info!(
                        "last {:.0}s: passed {:.0} pkt/s, dropped {:.0} pkt/s; totals: {now}",
                        secs,
                        d.get(rl_common::STAT_PASSED_PKTS) as f64 / secs,
                        d.get(rl_common::STAT_DROPPED_PKTS) as f64 / secs,
                    );
                }
                last = Some((now, at));
            }
        }
    }
}

/// Drains the datapath's "limited" events: each is logged as a structured
/// `tracing` event and kept for `GET /v1/events`.
async fn forward_events(state: Shared, ring: aya::maps::RingBuf<aya::maps::MapData>) {
    // SAFETY: the ring buffer owns its map fd for its whole life, and the
    // AsyncFd owns the ring buffer.
    let registered =
        unsafe { AsyncFd::register_with_interest(ring, tokio::io::Interest::READABLE) };
    let feed = |outcome: Result<(), String>| {
        collect::tried(&mut lock(&state), collect::Reader::Events, outcome)
    };
    let mut fd = match registered {
        Ok(fd) => fd,
        Err(e) => return feed(Err(format!("watching the events ring: {e}"))),
    };
    feed(Ok(()));
    loop {
        let mut guard = match fd.readable_mut().await {
            Ok(g) => g,
            Err(e) => return feed(Err(format!("reading the events ring: {e}"))),
        };
        let ring = guard.get_inner_mut();
        let mut got = Vec::new();
        while let Some(item) = ring.next() {
            got.extend(rl_common::Event::read(&item));
        }
        guard.clear_ready();
        if got.is_empty() {
            continue;
        }
        let mut s = lock(&state);
        collect::tried(&mut s, collect::Reader::Events, Ok(()));
        // Dated by the wall clock as it reads now, as the host's notices
        // are: they sort together even after a step of the clock.
        let offset = crate::datapath::Datapath::wall_offset_ns();
        for e in got {
            let view = crate::daemon::state::EventView {
                at_unix_ms: e.at_ns.wrapping_add(offset) / 1_000_000,
                event: "limited".into(),
                rule: s
                    .dp
                    .rule_name_of_key(e.rule)
                    .unwrap_or("(replaced rule)")
                    .to_string(),
                limit_index: e.rule & 7,
                source: bytes_to_addr(if e.family == 4 {
                    &e.addr[..4]
                } else {
                    &e.addr[..]
                })
                .to_string(),
                detail: String::new(),
            };
            info!(event = "limited", rule = %view.rule, limit = view.limit_index, source = %view.source, "source started being limited");
            s.push_event(view);
        }
    }
}

/// Drains aya-log records from the XDP program whenever its ring buffer has data.
async fn forward_kernel_logs(logger: aya_log::EbpfLogger<&'static dyn log::Log>) {
    // SAFETY: the logger owns its ring buffer fd for its whole life, and the
    // AsyncFd owns the logger.
    let registered =
        unsafe { AsyncFd::register_with_interest(logger, tokio::io::Interest::READABLE) };
    let mut fd = match registered {
        Ok(fd) => fd,
        Err(e) => {
            warn!("kernel-side logging is unavailable: {e}");
            return;
        }
    };
    loop {
        let Ok(mut guard) = fd.readable_mut().await else {
            return;
        };
        guard.get_inner_mut().flush();
        guard.clear_ready();
    }
}
