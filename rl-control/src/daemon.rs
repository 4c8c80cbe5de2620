//! The run loop: validate, load, attach, report, reload on SIGHUP, detach on
//! SIGINT/SIGTERM.

use std::{path::PathBuf, time::Duration};

use anyhow::{Context, Result};
use tokio::{
    io::unix::AsyncFd,
    signal::unix::{signal, SignalKind},
};
use tracing::{error, info, warn};

use crate::{
    compile::compile,
    config::Config,
    datapath::{interface_index, AttachMode, Datapath},
};

/// What `rl-control run` needs.
#[derive(Clone, Debug)]
pub struct RunOptions {
    pub iface: String,
    pub config: Option<PathBuf>,
    pub mode: AttachMode,
    pub stats_interval: Duration,
    /// Written after attaching, removed on exit; `rl-control reload` reads it.
    pub pid_file: Option<PathBuf>,
    /// Reload when the config file changes on disk.
    pub watch: bool,
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

/// What identifies a version of the config file on disk.
fn file_stamp(path: &std::path::Path) -> Option<(std::time::SystemTime, u64, u64)> {
    use std::os::unix::fs::MetadataExt;
    let m = std::fs::metadata(path).ok()?;
    Some((m.modified().ok()?, m.len(), m.ino()))
}

/// Removes the pid file when the daemon exits, however it exits.
struct PidFile(PathBuf);

impl Drop for PidFile {
    fn drop(&mut self) {
        let _ = std::fs::remove_file(&self.0);
    }
}

/// Loads the config named by `path`, or the embedded default.
pub fn load_config(path: Option<&PathBuf>) -> Result<Config> {
    match path {
        Some(p) => Ok(Config::from_file(p)?),
        None => Ok(Config::embedded_default()),
    }
}

pub async fn run(opts: RunOptions) -> Result<()> {
    // The file's stamp is taken before it is read: a change after this
    // point, even during start-up, triggers a reload.
    let watched = opts.config.as_ref().filter(|_| opts.watch);
    let mut stamp = watched.and_then(|p| file_stamp(p));
    // Everything that can be checked is checked before the interface is touched.
    let config = load_config(opts.config.as_ref())?;
    if opts.config.is_none() {
        info!(
            "no --config given: using the embedded default ({} packets/s, burst {} per source)",
            config.default.rate, config.default.burst
        );
    }
    interface_index(&opts.iface)?;
    let compiled = compile(&config);
    let mut dp = Datapath::load(&compiled)?;
    let attachment = dp.attach(&opts.iface, opts.mode)?;
    info!(
        iface = %attachment.iface,
        mode = %attachment.mode,
        "attached: every source held to {} packets/s, burst {} (IPv4 /{}, IPv6 /{}), tracking up to {} sources",
        config.default.rate,
        config.default.burst,
        config.datapath.ipv4_prefix,
        config.datapath.ipv6_prefix,
        config.datapath.max_sources,
    );

    let _pid_file = match &opts.pid_file {
        Some(p) => match std::fs::write(p, format!("{}\n", std::process::id())) {
            Ok(()) => Some(PidFile(p.clone())),
            Err(e) => {
                warn!("cannot write the pid file {}: {e}; `rl-control reload` will not find this daemon (SIGHUP still works)", p.display());
                None
            }
        },
        None => None,
    };

    if let Some(logger) = dp.take_logger() {
        tokio::spawn(forward_kernel_logs(logger));
    }

    let mut sigint = signal(SignalKind::interrupt()).context("installing the SIGINT handler")?;
    let mut sigterm = signal(SignalKind::terminate()).context("installing the SIGTERM handler")?;
    let mut sighup = signal(SignalKind::hangup()).context("installing the SIGHUP handler")?;
    let mut tick = tokio::time::interval(opts.stats_interval);
    tick.tick().await;
    let mut last = dp.counters()?;
    let mut current = config;
    let mut watch = tokio::time::interval(WATCH_INTERVAL);
    loop {
        tokio::select! {
            _ = sigint.recv() => { info!("SIGINT received: detaching"); break; }
            _ = sigterm.recv() => { info!("SIGTERM received: detaching"); break; }
            _ = sighup.recv() => {
                info!("SIGHUP received: reloading");
                // Stamp first, as at start: a change during the reload is seen next tick.
                stamp = watched.and_then(|p| file_stamp(p));
                reload(&mut dp, &opts, &mut current);
            }
            _ = watch.tick(), if watched.is_some() => {
                let now = watched.and_then(|p| file_stamp(p));
                if now.is_some() && now != stamp {
                    stamp = now;
                    info!("the config file changed on disk: reloading");
                    reload(&mut dp, &opts, &mut current);
                }
            }
            _ = tick.tick() => {
                let now = dp.counters()?;
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
    let totals = dp.counters()?;
    drop(dp);
    info!(iface = %attachment.iface, "detached; final counters: {totals}");
    Ok(())
}

/// Re-reads the config file. A valid file replaces the rule set atomically
/// (unchanged rules keep their buckets); an invalid one changes nothing and
/// its error, with line and column, goes to the log.
fn reload(dp: &mut Datapath, opts: &RunOptions, current: &mut Config) {
    let Some(path) = &opts.config else {
        warn!("reload: running on the embedded default, there is no file to reload");
        return;
    };
    let new = match Config::from_file(path) {
        Ok(c) => c,
        Err(e) => {
            error!("reload rejected, keeping the running config: {e}");
            return;
        }
    };
    if new.datapath.max_sources != current.datapath.max_sources {
        warn!(
            "reload: datapath.max_sources changes only on restart; keeping {}",
            current.datapath.max_sources
        );
    }
    let compiled = compile(&new);
    match dp.install(&compiled.rules) {
        Ok(()) => {
            info!("reloaded {}: {}", path.display(), new.summary());
            *current = new;
        }
        Err(e) => error!("reload failed, keeping the running config: {e}"),
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
