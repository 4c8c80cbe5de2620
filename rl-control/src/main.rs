//! `rl-control`: attach rl's XDP rate limiter to an interface and run it.

use std::{path::PathBuf, process::ExitCode, time::Duration};

use clap::{Parser, Subcommand};
use rl_control::{config::Config, daemon, datapath::AttachMode};

/// rl: per-source rate limiting in XDP, before the kernel stack spends anything
/// on a packet.
///
/// Every source address (IPv4 and IPv6, aggregated to a configurable prefix)
/// is held to a packet rate and burst; excess packets are dropped at the driver.
#[derive(Parser)]
#[command(name = "rl-control", version, propagate_version = true)]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(Subcommand)]
enum Command {
    /// Attach the limiter to an interface and enforce the config until SIGINT or SIGTERM.
    ///
    /// The config is validated before the interface is touched. The config
    /// file is reloaded on SIGHUP, on `rl-control reload`, and when the file
    /// changes on disk: a valid file replaces the rules atomically (unchanged
    /// rules keep their buckets), an invalid one is logged with its line and
    /// column and changes nothing.
    ///
    /// Example: rl-control run --iface eth0 --config /etc/rl/rules.toml
    Run {
        /// Interface to protect (see `ip link`).
        #[arg(long, short = 'i', value_name = "IFACE")]
        iface: String,
        /// Rule file (TOML). Without it, an embedded default holds every
        /// source to 1000 packets/s with a burst of 2000.
        #[arg(long, short = 'c', value_name = "FILE")]
        config: Option<PathBuf>,
        /// XDP attach mode.
        #[arg(long, value_enum, default_value_t = AttachMode::Auto)]
        mode: AttachMode,
        /// Seconds between counter reports in the log.
        #[arg(long, value_name = "SECS", default_value_t = 10, value_parser = clap::value_parser!(u64).range(1..=86400))]
        stats_interval: u64,
        /// Where to write the daemon's process id, for `rl-control reload`.
        #[arg(long, value_name = "FILE", default_value = DEFAULT_PID_FILE)]
        pid_file: PathBuf,
        /// Do not reload when the config file changes on disk (SIGHUP and
        /// `rl-control reload` still do).
        #[arg(long)]
        no_watch: bool,
    },
    /// Ask the running daemon to reload its config file (sends SIGHUP to the
    /// process named in the pid file). Check the daemon's log for the result.
    ///
    /// Example: rl-control reload
    Reload {
        /// The daemon's pid file (as given to `run --pid-file`).
        #[arg(long, value_name = "FILE", default_value = DEFAULT_PID_FILE)]
        pid_file: PathBuf,
    },
    /// Validate a config file and exit: 0 if valid, 1 with `file:line:column: error` if not.
    ///
    /// Runs exactly the loader `run` uses.
    ///
    /// Example: rl-control check-config /etc/rl/rules.toml
    CheckConfig {
        /// Rule file (TOML).
        file: PathBuf,
    },
}

const DEFAULT_PID_FILE: &str = "/run/rl-control.pid";

fn main() -> ExitCode {
    let cli = Cli::parse();
    tracing_subscriber::fmt()
        .with_env_filter(
            tracing_subscriber::EnvFilter::try_from_default_env()
                .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new("info")),
        )
        .with_ansi(std::io::IsTerminal::is_terminal(&std::io::stderr()))
        .with_writer(std::io::stderr)
        .init();

    let result = match cli.command {
        Command::CheckConfig { file } => Config::from_file(&file)
            .map(|c| {
                println!("{}: ok ({}; up to {} sources)", file.display(), c.summary(), c.datapath.max_sources)
            })
            .map_err(anyhow::Error::from),
        Command::Reload { pid_file } => daemon::signal_reload(&pid_file),
        Command::Run { iface, config, mode, stats_interval, pid_file, no_watch } => {
            let opts = daemon::RunOptions {
                iface,
                config,
                mode,
                stats_interval: Duration::from_secs(stats_interval),
                pid_file: Some(pid_file),
                watch: !no_watch,
            };
            tokio::runtime::Builder::new_current_thread()
                .enable_all()
                .build()
                .map_err(anyhow::Error::from)
                .and_then(|rt| rt.block_on(daemon::run(opts)))
        }
    };
    match result {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("error: {e:#}");
            ExitCode::FAILURE
        }
    }
}
