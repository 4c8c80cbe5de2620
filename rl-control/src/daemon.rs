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
}

/// Loads the config named by `path`, or the embedded default.
pub fn load_config(path: Option<&PathBuf>) -> Result<Config> {
    match path {
        Some(p) => Ok(Config::from_file(p)?),
        None => Ok(Config::embedded_default()),
    }
}

pub async fn run(opts: RunOptions) -> Result<()> {
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
    loop {
        tokio::select! {
            _ = sigint.recv() => { info!("SIGINT received: detaching"); break; }
            _ = sigterm.recv() => { info!("SIGTERM received: detaching"); break; }
            _ = sighup.recv() => reload(&mut dp, &opts, &mut current),
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

/// Re-reads the config file: a valid file replaces the limits in one map
/// update (bucket state is kept); an invalid one changes nothing.
fn reload(dp: &mut Datapath, opts: &RunOptions, current: &mut Config) {
    let Some(path) = &opts.config else {
        warn!("SIGHUP: running on the embedded default, there is no file to reload");
        return;
    };
    let new = match Config::from_file(path) {
        Ok(c) => c,
        Err(e) => {
            error!("reload rejected, keeping the running config: {e}");
            return;
        }
    };
    let mut compiled = compile(&new);
    if new.datapath.max_sources != current.datapath.max_sources {
        warn!(
            "reload: datapath.max_sources changes only on restart; keeping {}",
            current.datapath.max_sources
        );
        compiled.max_sources = current.datapath.max_sources;
    }
    match dp.install(&compiled.rules) {
        Ok(()) => {
            info!(
                "reloaded {}: every source held to {} packets/s, burst {}",
                path.display(),
                new.default.rate,
                new.default.burst
            );
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
