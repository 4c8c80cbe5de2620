//! The run loop: validate, load, attach, report, reload on SIGHUP, detach on
//! SIGINT/SIGTERM.

pub mod cluster;

use std::{
    net::{IpAddr, SocketAddr},
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
    config::{unix_now, Config, EMBEDDED_DEFAULT},
    datapath::{interface_index, AttachMode, Datapath, LoadOptions, TableIds},
    state::{file_stamp, lock, Shared, State},
    units::bytes_to_addr,
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
    let dirs = crate::datapath::pin_dirs_with(pin_dir, iface);
    if dirs.is_empty() {
        println!("nothing of rl is pinned for {iface} in {}: nothing to detach", pin_dir.display());
    }
    for dir in dirs {
        crate::datapath::detach_pinned(&dir)?;
        let name = dir.file_name().map(|n| n.to_string_lossy().replace('+', ", ")).unwrap_or_default();
        println!("detached rl from {name} and removed its pins in {}", dir.display());
    }
    Ok(())
}

/// How often the config file is checked for changes.
const WATCH_INTERVAL: Duration = Duration::from_secs(1);

/// `rl-control reload`: SIGHUP to the daemon named in `pid_file`.
pub fn signal_reload(pid_file: &std::path::Path) -> Result<()> {
    let text = std::fs::read_to_string(pid_file).with_context(|| {
        format!("cannot read {}: is rl-control running? (its --pid-file must match)", pid_file.display())
    })?;
    let pid: libc::pid_t = text
        .trim()
        .parse()
        .with_context(|| format!("{} does not hold a process id", pid_file.display()))?;
    if unsafe { libc::kill(pid, libc::SIGHUP) } != 0 {
        let e = std::io::Error::last_os_error();
        anyhow::bail!("cannot signal rl-control (pid {pid} from {}): {e}; is it still running?", pid_file.display());
    }
    println!("asked rl-control (pid {pid}) to reload; its log shows the result");
    Ok(())
}

/// Removes the pid file when the daemon exits, however it exits.
struct PidFile(PathBuf);

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
    let mut sigint = signal(SignalKind::interrupt()).context("installing the SIGINT handler")?;
    let mut sigterm = signal(SignalKind::terminate()).context("installing the SIGTERM handler")?;
    let mut sighup = signal(SignalKind::hangup()).context("installing the SIGHUP handler")?;
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
    let l7_listener = api::listen::bind_tcp(config.l7.http_listen, "the request check", "[l7] http_listen").await?;
    let grpc_listener = api::listen::bind_tcp(config.l7.grpc_listen, "Envoy's rate-limit service", "[l7] grpc_listen").await?;
    let ifaces = if opts.ifaces.is_empty() { config.datapath.interfaces.clone() } else { opts.ifaces.clone() };
    if ifaces.is_empty() {
        anyhow::bail!("no interface to protect: pass --iface IFACE (repeat it for several) or set [datapath] interfaces");
    }
    for iface in &ifaces {
        interface_index(iface)?;
    }
    let cluster = cluster::join(&config).await?;
    let compiled = compile(&config);
    let pin_dir = opts.pin_dir.clone().unwrap_or_else(|| config.datapath.pin_dir.clone());
    let pins = pin_dir.join(crate::datapath::pin_group(&ifaces));
    crate::datapath::prepare_pins(&pin_dir, &pins)?;
    let mut dp = Datapath::load_with(&compiled, LoadOptions { pin: Some(pins.clone()), ..Default::default() })?;
    // The same rules into the other slot too: from now on every change
    // writes only its differences (a ban, its entries), never the whole set.
    dp.install(&compiled.rules)?;
    let adopted = dp.adopted();
    if dp.cells_in_tables() || dp.cells_in_old_arrays() {
        // Before the swap: the new program looks for cells in its arrays only.
        let moved = dp.move_old_cells()?;
        if moved > 0 {
            info!(cells = moved, "copied the prefix cells an older build kept in the sources' tables or its 64-byte arrays into the cell arrays");
        }
    }
    let attachments = match dp.attach_all(&ifaces, opts.mode) {
        Ok(a) => a,
        Err(e) => {
            // Nothing attached stays; a datapath pinned just now goes too
            // (an adopted one keeps enforcing as it was).
            if !adopted {
                drop(dp);
                let _ = crate::datapath::detach_pinned(&pins);
            }
            return Err(e.into());
        }
    };
    // This build's program is in: the older build's cells are in the arrays
    // (and what it charged to its arrays since the copy is merged in).
    let merged = dp.cells_moved()?;
    if merged > 0 {
        info!(cells = merged, "merged what the older build charged since the copy into the cell arrays, and unpinned its 64-byte arrays");
    }
    if adopted {
        info!(pins = %pins.display(), "adopted the pinned datapath: buckets kept, program replaced atomically");
    }
    let on: Vec<String> = attachments.iter().map(|a| format!("{} ({})", a.iface, a.mode)).collect();
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
    if let Some(logger) = dp.take_logger() {
        tokio::spawn(forward_kernel_logs(logger));
    }
    let map_ids = dp.table_ids();
    let events = dp.take_events();
    let l7: crate::l7::http::Shared =
        Arc::new(std::sync::RwLock::new(Arc::new(crate::l7::engine::Engine::new(&config.l7, dp.epoch_offset_ns(), None).with_cluster(cluster.clone()))));
    // Both l7 listeners are served thread per core, on the same threads.
    let threads = match l7_listener.is_some() || grpc_listener.is_some() {
        true => Some(crate::l7::threads::Threads::start(crate::l7::threads::thread_count(config.l7.grpc_threads))?),
        false => None,
    };
    if let (Some(listener), Some(threads)) = (l7_listener, &threads) {
        let addr = listener.local_addr().ok();
        crate::l7::http::serve(listener, threads, l7.clone());
        info!("request check on http://{} (POST /v1/check, forward auth on /v1/forward-auth/{{domain}}; {} l7 rules)", addr.map(|a| a.to_string()).unwrap_or_default(), config.l7.rules.len());
    }
    if let (Some(listener), Some(threads)) = (grpc_listener, &threads) {
        let addr = listener.local_addr().ok();
        let draft_headers = config.l7.draft_headers;
        crate::l7::grpc_threads::serve(listener, threads, || crate::l7::grpc::Service { l7: l7.clone(), draft_headers });
        info!("Envoy rate-limit service on {} (envoy.service.ratelimit.v3, {} threads)", addr.map(|a| a.to_string()).unwrap_or_default(), threads.count());
    }
    let state: Shared = Arc::new(Mutex::new(State {
        l7,
        cluster: cluster.clone(),
        failure_mode: None,
        program_id: dp.program_id(),
        dp,
        config: Arc::new(config),
        text: Arc::from(text),
        path: opts.config.clone(),
        stamp,
        attachments: attachments.clone(),
        started: std::time::Instant::now(),
        last_reload: None,
        reloads_ok: 0,
        reloads_failed: 0,
        pressure: Default::default(),
        api_requests: Default::default(),
        top: Default::default(),
        events: Default::default(),
    }));
    let (servers, _socket_file) = api::listen::serve(listeners, state.clone());
    let counter = match map_ids {
        Ok(ids) => Some(tokio::spawn(watch_pressure(state.clone(), ids))),
        Err(e) => {
            warn!("the bucket collector cannot start ({e}): buckets are never collected, so the tables fill and new sources share their prefix cells");
            None
        }
    };
    tokio::spawn(sweep_requests(lock(&state).l7.clone()));
    if let Some(c) = cluster {
        tokio::spawn(cluster::keep_in_touch(state.clone(), c.clone()));
        tokio::spawn(cluster::sync_packets(state.clone(), c.clone()));
        tokio::spawn(cluster::sync_requests(state.clone(), c));
    }
    match events {
        Ok(ring) => {
            tokio::spawn(forward_events(state.clone(), ring));
        }
        Err(e) => warn!("\"limited\" events are unavailable: {e}"),
    }

    let _pid_file = match &opts.pid_file {
        Some(p) => match std::fs::write(p, format!("{}\n", std::process::id())) {
            Ok(()) => Some(PidFile(p.clone())),
            Err(e) => {
                warn!("cannot write the pid file {}: {e}; `rl-control reload --pid-file` will not find this daemon (SIGHUP and the API still work)", p.display());
                None
            }
        },
        None => None,
    };

    let mut tick = tokio::time::interval(opts.stats_interval);
    tick.tick().await;
    let mut last = lock(&state).dp.counters()?;
    let mut watch = tokio::time::interval(WATCH_INTERVAL);
    loop {
        tokio::select! {
            _ = sigint.recv() => { info!("SIGINT received: stopping"); break; }
            _ = sigterm.recv() => { info!("SIGTERM received: stopping"); break; }
            _ = sighup.recv() => {
                info!("SIGHUP received: reloading");
                let st = state.clone();
                let _ = tokio::task::spawn_blocking(move || crate::apply::reload_file(&st, "SIGHUP")).await;
            }
            _ = watch.tick() => {
                let st = state.clone();
                let watched = watched.clone();
                let _ = tokio::task::spawn_blocking(move || {
                    crate::apply::expire_bans(&st);
                    let now = watched.as_deref().and_then(file_stamp);
                    if now.is_some() && now != lock(&st).stamp {
                        info!("the config file changed on disk: reloading");
                        let _ = crate::apply::reload_file(&st, "file change");
                    }
                }).await;
            }
            _ = tick.tick() => {
                let now = lock(&state).dp.counters()?;
                let d = now.since(&last);
                let secs = opts.stats_interval.as_secs_f64();
                info!(
                    "last {:.0}s: passed {:.0} pkt/s, dropped {:.0} pkt/s; totals: {now}",
                    secs,
                    d.get(rl_common::STAT_PASSED_PKTS) as f64 / secs,
                    d.get(rl_common::STAT_DROPPED_PKTS) as f64 / secs,
                );
                last = now;
            }
        }
    }
    // Stop serving first: the API's handlers hold the state (and with it
    // the datapath) only while a request runs.
    for server in servers {
        server.abort();
        let _ = server.await;
    }
    if let Some(c) = counter {
        c.abort();
        let _ = c.await;
    }
    let totals = lock(&state).dp.counters()?;
    if opts.detach_on_exit {
        // Detaches at once, whoever still holds the link.
        crate::datapath::detach_pinned(&pins)?;
    }
    // The maps and program are freed with the last reference; pinned, the
    // link keeps the program attached.
    drop(state);
    if opts.detach_on_exit {
        info!(ifaces = %on, "detached and unpinned; final counters: {totals}");
    } else {
        info!(
            ifaces = %on,
            pins = %pins.display(),
            "left attached and enforcing the last rule set (`rl-control detach --iface {}` removes it); final counters: {totals}",
            attachments[0].iface
        );
    }
    Ok(())
}

/// How often the collector walks the bucket tables.
const COLLECT_INTERVAL: Duration = Duration::from_secs(1);
/// How often the top-sources list is ranked (every this many passes).
const TOP_EVERY: u32 = 5;

/// Sweeps the request-bucket store's shards in turn, one every
/// `COLLECT_INTERVAL / SHARDS`: every key is looked at once per interval,
/// and no sweep takes a CPU or a shard lock for long (a million keys in one
/// go took ~20 ms of a CPU, which showed as a tail in the answers).
async fn sweep_requests(l7: crate::l7::http::Shared) {
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
            let _changes = crate::apply::hold_changes();
            let engine = l7.read().unwrap_or_else(|e| e.into_inner()).clone();
            engine.collect_shard(i)
        })
        .await;
    }
}

/// Walks the bucket tables every second (every TOP_EVERY seconds while they
/// are under 1% full, never while empty) through handles of its own, so a
/// walk of a million buckets never holds the state lock: deletes buckets
/// that are fresh again, records the pressure on the tables, raises flood
/// events, and every few passes ranks sources by their drops.
async fn watch_pressure(state: Shared, ids: TableIds) {
    let mut every = tokio::time::interval(COLLECT_INTERVAL);
    let mut top = TopRanker::default();
    let mut last: Option<(std::time::Instant, u64)> = None;
    let mut pass_no = 0u32;
    // Buckets the last walk left, and the datapath's inserts before it.
    let mut left = u64::MAX;
    let mut inserted_at_walk = 0u64;
    // The refusals at the last good reading (the counters are pinned and
    // count across restarts: the first reading is a baseline, no event),
    // and when the last new one was seen.
    let mut refusals: Option<u64> = None;
    let mut refused_at: Option<std::time::Instant> = None;
    let known = match crate::datapath::KnownFilter::open(ids.known) {
        Ok(k) => std::sync::Arc::new(k),
        Err(e) => {
            warn!("the bucket collector cannot start: {e}; buckets are not collected, so the tables fill and new sources share their prefix cells");
            return;
        }
    };
    loop {
        every.tick().await;
        let st = state.clone();
        let filter = known.clone();
        let (offset, inserted, capacity) = {
            let s = lock(&state);
            let c = s.dp.counters().unwrap_or_default();
            let inserted = c.get(rl_common::STAT_NEW_SOURCES) + c.get(rl_common::STAT_NEW_CELLS);
            (s.dp.epoch_offset_ns(), inserted, 2 * u64::from(s.config.datapath.max_sources))
        };
        // A walk visits every bucket of the tables' capacity: milliseconds
        // of CPU for a million, in one system call, even when they are
        // empty. Empty with nothing inserted since: nothing to walk. Under
        // 1% full: only when the top sources are ranked (every TOP_EVERY
        // passes); the few fresh buckets can wait, the room is there.
        let new = inserted.saturating_sub(inserted_at_walk);
        let empty = left == 0 && new == 0;
        let low = left.saturating_add(new) < capacity / 100;
        let ranking = (pass_no + 1) % TOP_EVERY == 1;
        let walk = !empty && (!low || ranking);
        if walk {
            inserted_at_walk = inserted;
        }
        let walked = tokio::task::spawn_blocking(move || {
            // No rule change during the walk: its limits stay exact.
            let _changes = crate::apply::hold_changes();
            let pass = if walk {
                let limits = lock(&st).dp.limits_by_key()?;
                Some(crate::datapath::collect(ids, offset, &limits, &filter)?)
            } else {
                None
            };
            Ok::<_, crate::datapath::DatapathError>((pass, crate::datapath::flood_mode(ids)?))
        })
        .await;
        let (pass, flood) = match walked {
            Ok(Ok(x)) => x,
            Ok(Err(e)) => {
                warn!("the bucket collector stopped: {e}; buckets are no longer collected, so the tables fill and new sources share their prefix cells");
                return;
            }
            Err(_) => return,
        };
        if let Some(pass) = &pass {
            left = pass.own.0 + pass.own.1 + pass.cells.0 + pass.cells.1;
        }
        let now = std::time::Instant::now();
        let mut s = lock(&state);
        let read = s.dp.counters();
        let counters = read.as_ref().map_or_else(|_| Default::default(), |c| *c);
        let created = counters.get(rl_common::STAT_NEW_SOURCES);
        let max_sources = s.config.datapath.max_sources;
        let p = &mut s.pressure;
        if let Some(pass) = &pass {
            p.buckets_ipv4 = pass.own.0;
            p.buckets_ipv6 = pass.own.1;
            p.cells_ipv4 = pass.cells.0;
            p.cells_ipv6 = pass.cells.1;
            (p.known_filter_fill_ipv4, p.known_filter_fill_ipv6) = pass.known_fill;
            p.collected_buckets += pass.collected;
        }
        p.table_full_refusals = counters.get(rl_common::STAT_TABLE_FULL);
        let full = match (&read, refusals) {
            (Ok(_), Some(before)) => {
                if p.table_full_refusals > before {
                    refused_at = Some(now);
                }
                table_full(p, refused_at, now, max_sources)
            }
            _ => None,
        };
        if read.is_ok() {
            refusals = Some(p.table_full_refusals);
        }
        p.fallback_packets = counters.get(rl_common::STAT_FALLBACK);
        p.unseen_keys_per_sec = flood.unseen_last_window as f64 * 1e9 / (1u64 << rl_common::FLOOD_WINDOW_SHIFT) as f64;
        if let Some((then, before)) = last {
            p.new_buckets_per_sec = created.saturating_sub(before) as f64 / (now - then).as_secs_f64().max(1e-3);
        }
        last = Some((now, created));
        if flood.on != p.flood_mode {
            p.flood_mode = flood.on;
            p.flood_since_unix_ms = flood.on.then(|| unix_now() * 1000);
            let (event, unseen) = (if flood.on { "flood_started" } else { "flood_ended" }, p.unseen_keys_per_sec);
            if flood.on {
                warn!(event, unseen_keys_per_sec = unseen, "flood mode: unseen sources are charged to their prefix cells");
            } else {
                info!(event, "flood mode ended: new sources get buckets of their own again");
            }
            s.push_host_event(event, unix_now() * 1000);
        }
        if let Some(full) = full {
            s.pressure.table_full = full;
            let event = if full { "table_full" } else { "table_room" };
            if full {
                warn!(event, max_sources, "the sources' table is full: new sources are charged to their prefix cells until the collector frees room (raise datapath.max_sources if this is not a flood)");
            } else {
                info!(event, "the sources' table has room again: new sources get buckets of their own");
            }
            s.push_host_event(event, unix_now() * 1000);
        }
        pass_no += 1;
        if let Some(pass) = pass.as_ref().filter(|_| pass_no % TOP_EVERY == 1) {
            if let Some(t) = top.rank(&pass.sources, now, &s) {
                s.top = t;
            }
        }
    }
}

/// How long no insert may have been refused before a full table is said to
/// have room again: longer than a CPU that found the table full waits to
/// try again (the rest of its 67 ms flood window), and two of the
/// daemon's passes, so that refusals now and then are one spell, not
/// `table_full` and `table_room` by turns.
const TABLE_ROOM_QUIET: std::time::Duration = std::time::Duration::from_secs(2);

/// Whether the sources' table turned full (`Some(true)`: an insert was
/// refused since the last pass) or has room again (`Some(false)`: none
/// refused for [`TABLE_ROOM_QUIET`] and both families under `max_sources`
/// own buckets at the last walk), or neither (`None`).
fn table_full(p: &crate::state::Pressure, refused_at: Option<std::time::Instant>, now: std::time::Instant, max_sources: u32) -> Option<bool> {
    let refused_now = refused_at == Some(now);
    let room = refused_at.is_none_or(|t| now - t > TABLE_ROOM_QUIET) && p.buckets_ipv4.max(p.buckets_ipv6) < u64::from(max_sources);
    match p.table_full {
        false if refused_now => Some(true),
        true if room => Some(false),
        _ => None,
    }
}

/// Ranks sources by their drops between two walks.
#[derive(Default)]
struct TopRanker {
    /// When the previous ranking was made, and its counts.
    previous: Option<(std::time::Instant, Counts)>,
}

/// (key address, key rule) ➜ (seen, dropped).
type Counts = std::collections::HashMap<(IpAddr, u32), (u64, u64)>;

impl TopRanker {
    fn rank(&mut self, buckets: &[crate::datapath::Source], now: std::time::Instant, s: &State) -> Option<crate::state::Top> {
        let counts: std::collections::HashMap<(IpAddr, u32), (u64, u64)> = buckets
            .iter()
            .map(|b| ((b.addr, b.rule), (b.bucket.passed + b.bucket.dropped, b.bucket.dropped)))
            .collect();
        let previous = self.previous.replace((now, counts));
        let (then, before) = previous?;
        let counts = &self.previous.as_ref()?.1;
        let secs = (now - then).as_secs_f64().max(1e-3);
        let mut ranked: Vec<((IpAddr, u32), u64, u64)> = counts
            .iter()
            .filter_map(|(k, &(seen, dropped))| {
                // A bucket collected and created again starts from 0.
                let (s0, d0) = before.get(k).copied().filter(|&(s0, _)| s0 <= seen).unwrap_or((0, 0));
                let drops = dropped.saturating_sub(d0);
                (drops > 0).then_some((*k, drops, seen - s0))
            })
            .collect();
        ranked.sort_by_key(|r| std::cmp::Reverse(r.1));
        ranked.truncate(crate::state::TOP_KEPT);
        Some(crate::state::Top {
            interval_secs: secs,
            sources: ranked
                .into_iter()
                .map(|((addr, rule), drops, seen)| crate::state::TopSource {
                    source: addr.to_string(),
                    rule: s.dp.rule_name_of_key(rule).unwrap_or("(replaced rule)").to_string(),
                    drops,
                    drops_per_sec: drops as f64 / secs,
                    rate_seen_pps: seen as f64 / secs,
                })
                .collect(),
        })
    }
}

/// Drains the datapath's "limited" events: each is logged as a structured
/// `tracing` event and kept for `GET /v1/events`.
async fn forward_events(state: Shared, ring: aya::maps::RingBuf<aya::maps::MapData>) {
    // SAFETY: the ring buffer owns its map fd for its whole life, and the
    // AsyncFd owns the ring buffer.
    let registered = unsafe { AsyncFd::register_with_interest(ring, tokio::io::Interest::READABLE) };
    let mut fd = match registered {
        Ok(fd) => fd,
        Err(e) => {
            warn!("\"limited\" events are unavailable: {e}");
            return;
        }
    };
    loop {
        let Ok(mut guard) = fd.readable_mut().await else {
            return;
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
        let offset = s.dp.epoch_offset_ns();
        for e in got {
            let view = crate::state::EventView {
                at_unix_ms: e.at_ns.wrapping_add(offset) / 1_000_000,
                event: "limited".into(),
                rule: s.dp.rule_name_of_key(e.rule).unwrap_or("(replaced rule)").to_string(),
                limit_index: e.rule & 7,
                source: bytes_to_addr(if e.family == 4 { &e.addr[..4] } else { &e.addr[..] }).to_string(),
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

#[cfg(test)]
mod tests {
    use super::table_full;
    use std::time::{Duration, Instant};

    #[test]
    fn a_full_table_has_room_again_only_after_two_quiet_seconds() {
        let t0 = Instant::now();
        let mut p = crate::state::Pressure::default();
        assert_eq!(table_full(&p, Some(t0), t0, 64), Some(true), "an insert refused since the last pass");
        (p.table_full, p.buckets_ipv4) = (true, 10);
        assert_eq!(table_full(&p, Some(t0), t0 + Duration::from_secs(1), 64), None, "one quiet pass: the same spell");
        assert_eq!(table_full(&p, Some(t0), t0 + Duration::from_millis(2100), 64), Some(false), "two quiet seconds");
        p.buckets_ipv4 = 64;
        assert_eq!(table_full(&p, Some(t0), t0 + Duration::from_secs(3), 64), None, "still max_sources own buckets");
    }
}
