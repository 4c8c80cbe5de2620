//! `rl-control`: attach rl's XDP rate limiter to an interface and run it.

use std::{path::PathBuf, process::ExitCode, time::Duration};

use clap::{Parser, Subcommand};
use rl_control::{cli, config::Config, daemon, datapath::AttachMode};

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

/// How the client commands reach the daemon: its Unix socket by default
/// (root only), or TCP with a token.
#[derive(clap::Args, Clone)]
struct Remote {
    /// The daemon's runtime directory; its admin socket is `api.sock` there.
    #[arg(long, value_name = "DIR", default_value = rl_control::cli::DEFAULT_RUNTIME_DIR, env = "RL_RUNTIME_DIR")]
    runtime_dir: PathBuf,
    /// Use the daemon's TCP admin API instead (`HOST:PORT` or a URL: its
    /// `--api` / `[api] listen`), with --token-file.
    #[arg(long, value_name = "ADDR", env = "RL_API")]
    api: Option<String>,
    /// A file holding the API's bearer token (the daemon's `[api] token_file`).
    #[arg(long, value_name = "FILE", env = "RL_TOKEN_FILE")]
    token_file: Option<PathBuf>,
    /// Print the API's JSON instead of a table.
    #[arg(long)]
    json: bool,
}

#[derive(Subcommand)]
enum Command {
    /// Attach the limiter to an interface and enforce the config.
    ///
    /// The datapath (program, link and every map) is pinned under
    /// `<pin dir>/<IFACE>/` and outlives the daemon: after SIGTERM, a crash
    /// or `kill -9` the program stays attached, enforcing the last rule set
    /// with every bucket. `run` on an interface that carries rl's pins adopts
    /// them: buckets kept, the program replaced atomically (an upgrade has no
    /// gap). `rl-control detach --iface IFACE` removes it all;
    /// `--detach-on-exit` removes it when the daemon stops.
    ///
    /// The config is validated before the interface is touched. The config
    /// file is reloaded on SIGHUP, on `rl-control reload`, and when the file
    /// changes on disk: a valid file replaces the rules atomically (unchanged
    /// rules keep their buckets), an invalid one is logged with its line and
    /// column and changes nothing.
    ///
    /// Example: rl-control run --iface eth0 --config /etc/rl/rules.toml
    /// Example: rl-control run --iface eth0 --iface eth1 --config /etc/rl/rules.toml
    Run {
        /// Interface to protect (see `ip link`); repeat it for several (one
        /// program, one rule set and one set of buckets for all of them).
        /// Default: `[datapath] interfaces`.
        #[arg(long = "iface", short = 'i', value_name = "IFACE")]
        ifaces: Vec<String>,
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
        /// Runtime directory: the admin API's Unix socket (`api.sock`, mode
        /// 0600: root only) and the pid file go here.
        #[arg(long, value_name = "DIR", default_value = rl_control::cli::DEFAULT_RUNTIME_DIR, env = "RL_RUNTIME_DIR")]
        runtime_dir: PathBuf,
        /// Where to write the daemon's process id, for `rl-control reload
        /// --pid-file` (default: `rl-control.pid` in the runtime directory).
        #[arg(long, value_name = "FILE")]
        pid_file: Option<PathBuf>,
        /// Do not reload when the config file changes on disk (SIGHUP and
        /// `rl-control reload` still do).
        #[arg(long)]
        no_watch: bool,
        /// Also serve the admin API over TCP here (default `[api] listen`;
        /// none unless set). Needs `[api] token_file`, on loopback too.
        #[arg(long, value_name = "ADDR")]
        api: Option<std::net::SocketAddr>,
        /// Pin the datapath here, in `<DIR>/<IFACE>/` (default
        /// `[datapath] pin_dir`, else /sys/fs/bpf/rl; bpffs is mounted if absent).
        #[arg(long, value_name = "DIR")]
        pin_dir: Option<PathBuf>,
        /// On SIGINT/SIGTERM, detach and remove the pins instead of leaving
        /// the datapath enforcing (for trying rl interactively).
        #[arg(long)]
        detach_on_exit: bool,
    },
    /// Remove rl from an interface for good: detach the program (even while
    /// a daemon still runs) and remove its link and map pins. An interface
    /// of a group (`run --iface eth0 --iface eth1`) takes the whole group:
    /// one program and one set of buckets serve them all. Exits 0 when done,
    /// and when nothing was pinned there.
    ///
    /// Example: rl-control detach --iface eth0
    Detach {
        /// The interface rl protects.
        #[arg(long, short = 'i', value_name = "IFACE")]
        iface: String,
        /// The pin directory the daemon used (`--pin-dir` / `[datapath] pin_dir`).
        #[arg(long, value_name = "DIR", default_value = rl_control::config::DEFAULT_PIN_DIR)]
        pin_dir: PathBuf,
    },
    /// Ask the running daemon to reload its config file, through the admin
    /// API (the answer says whether the file was valid), or with
    /// `--pid-file` by sending SIGHUP (the daemon's log says the result).
    ///
    /// Example: rl-control reload
    Reload {
        /// Signal the process named in this pid file instead of using the API.
        #[arg(long, value_name = "FILE", conflicts_with = "json")]
        pid_file: Option<PathBuf>,
        #[command(flatten)]
        remote: Remote,
    },
    /// The running daemon: interface, XDP mode, rules, sources tracked, last reload.
    ///
    /// Exits 0 when all is well, 3 when the daemon runs but something is
    /// wrong (an interface no longer attached, the config file as last
    /// read refused, a background reader failing, the cluster degraded or
    /// its sync failing: said on stderr), 1 when the daemon cannot be
    /// reached.
    ///
    /// Example: rl-control status
    /// Example: rl-control status --json
    Status {
        #[command(flatten)]
        remote: Remote,
    },
    /// The rules in force.
    ///
    /// Example: rl-control rules --json
    Rules {
        #[command(flatten)]
        remote: Remote,
    },
    /// Packets and bytes passed, dropped and shadow-dropped, per rule.
    ///
    /// Example: rl-control stats
    Stats {
        #[command(flatten)]
        remote: Remote,
    },
    /// The sources with the most drops over the last 5 seconds.
    ///
    /// Example: rl-control top -n 20
    Top {
        /// How many (1 ..= 1000).
        #[arg(short = 'n', long, default_value_t = 10, value_parser = clap::value_parser!(u16).range(1..=1000))]
        count: u16,
        #[command(flatten)]
        remote: Remote,
    },
    /// The prefix cells (and wide cells) holding a charge, the most limiting first: where a flood of
    /// forged sources shows, by rule and prefix (those sources have no buckets of their own to rank
    /// in `top`).
    Cells {
        /// How many (1 ..= 100).
        #[arg(short = 'n', long, default_value_t = 10, value_parser = clap::value_parser!(u16).range(1..=100))]
        count: u16,
        #[command(flatten)]
        remote: Remote,
    },
    /// The most recent events, newest first: "source started being limited under rule R", and the
    /// host's (flood mode, full tables, wide cells by rule, the cluster's health), which the first
    /// kind never pushes out.
    Events {
        /// How many (1 ..= 1256).
        #[arg(short = 'n', long, default_value_t = 20, value_parser = clap::value_parser!(u16).range(1..=1256))]
        count: u16,
        #[command(flatten)]
        remote: Remote,
    },
    /// One source's quota under each rule that holds a charge for it:
    /// limit, remaining, retry-after and reset, as HTTP rate-limit headers
    /// would say, and the bucket that charges it. That is its own bucket,
    /// or, for a source a flood or a full table left without one, the
    /// bucket it shares: its prefix cell, its wide cell, or its rule's last
    /// resort. A shared bucket's figures are its whole prefix's.
    ///
    /// Example: rl-control source 198.51.100.7
    Source {
        /// An IPv4 or IPv6 address.
        ip: String,
        #[command(flatten)]
        remote: Remote,
    },
    /// A request key's state under its [[l7.rule]]: what the next request
    /// with that descriptor would meet (nothing is charged).
    ///
    /// Example: rl-control l7-state --domain auth auth_type=login remote_address=192.0.2.7
    L7State {
        /// The rate-limit domain.
        #[arg(long)]
        domain: String,
        /// The descriptor's entries, in order: key=value.
        #[arg(required = true, value_name = "KEY=VALUE")]
        entries: Vec<String>,
        #[command(flatten)]
        remote: Remote,
    },
    /// Drop everything from a prefix for a while. The ban lifts by itself
    /// at its end (in the kernel too: also while no daemon runs), is kept
    /// in the rule file across restarts, and an `[[allow]]` CIDR still wins
    /// over it. A ban of a prefix banned longer already keeps the longer
    /// end: unban it first to shorten it.
    ///
    /// Example: rl-control ban 198.51.100.0/24 --ttl 10m --reason "scanner"
    /// Example: rl-control ban 2001:db8:bad::/48 --ttl 1d
    Ban {
        /// An IPv4 or IPv6 prefix (an address alone is its /32 or /128).
        cidr: String,
        /// How long: "90s", "10m", "1h", "1d" (at most 366d).
        #[arg(long, value_name = "DURATION", value_parser = parse_ttl)]
        ttl: u64,
        /// Why (shown by `rl-control bans` and kept in the rule file; at
        /// most 1,024 bytes).
        #[arg(long, default_value = "")]
        reason: String,
        /// Ban a prefix broader than /8 (IPv4) or /16 (IPv6), which drops
        /// most of the Internet, this host's management traffic included
        /// unless an `[[allow]]` covers it.
        #[arg(long)]
        force: bool,
        #[command(flatten)]
        remote: Remote,
    },
    /// The bans in force: prefix, time left, end and reason.
    ///
    /// Example: rl-control bans
    Bans {
        #[command(flatten)]
        remote: Remote,
    },
    /// Lift a ban now (a prefix as `rl-control bans` lists it).
    ///
    /// Example: rl-control unban 198.51.100.0/24
    Unban {
        /// The banned prefix.
        cidr: String,
        #[command(flatten)]
        remote: Remote,
    },
    /// Validate a config file and exit: 0 if valid, 1 with `file:line:column: error` if not.
    ///
    /// Runs exactly the loader `run` uses. A valid file may get `note:` lines for what is worth
    /// knowing before it runs, e.g. two rules that share a wide-cell count (the daemon logs them too).
    ///
    /// Example: rl-control check-config /etc/rl/rules.toml
    CheckConfig {
        /// Rule file (TOML).
        file: PathBuf,
    },
}

/// `--ttl`: a duration ("10m"), at most 366 days, in seconds.
fn parse_ttl(text: &str) -> Result<u64, String> {
    let secs = rl_control::config::units::parse_duration(text)?;
    if !(1..=366 * 86_400).contains(&secs) {
        return Err("a ban lasts 1s ..= 366d".into());
    }
    Ok(secs)
}

/// One API call, printed as a table or JSON.
fn remote_call(
    remote: &Remote,
    method: &str,
    path: &str,
    body: Option<&serde_json::Value>,
    human: fn(&serde_json::Value) -> String,
) -> anyhow::Result<()> {
    let c = cli::Client::new(
        &remote.runtime_dir,
        remote.api.as_deref(),
        remote.token_file.as_ref(),
    )?;
    let v = c.call(method, path, body)?;
    cli::print(&v, remote.json, human);
    Ok(())
}

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
            .map_err(anyhow::Error::from)
            .and_then(|c| {
                // As a fresh datapath would install them.
                let mut rules = rl_control::compile::compile(&c).rules;
                rl_control::datapath::fits(&rules)
                    .map_err(|e| anyhow::anyhow!("{}: {e}", file.display()))?;
                let mut out = format!(
                    "{}: ok ({}; up to {} sources)\n",
                    file.display(),
                    c.summary(),
                    c.datapath.max_sources
                );
                rl_control::compile::part_wide_counts(&mut rules.entries, &Default::default());
                for note in rl_control::compile::wide_count_notes(&rules.entries, &rules.names) {
                    out += &format!("note: {note}\n");
                }
                // A reader gone (`| head`) ends it quietly.
                let _ = std::io::Write::write_all(&mut std::io::stdout().lock(), out.as_bytes());
                Ok(())
            }),
        Command::Reload {
            pid_file: Some(pid_file),
            ..
        } => daemon::signal_reload(&pid_file),
        Command::Reload {
            pid_file: None,
            remote,
        } => remote_call(&remote, "POST", "/v1/reload", None, cli::applied),
        Command::Status { remote } => {
            let shown = cli::Client::new(
                &remote.runtime_dir,
                remote.api.as_deref(),
                remote.token_file.as_ref(),
            )
            .and_then(|c| c.call("GET", "/v1/status", None));
            match shown {
                Ok(v) => {
                    cli::print(&v, remote.json, cli::status);
                    let wrong = cli::unhealthy(&v);
                    if !wrong.is_empty() {
                        // For health checks: running, but not all is well.
                        eprintln!("rl-control status: {}", wrong.join("; "));
                        return ExitCode::from(3);
                    }
                    Ok(())
                }
                Err(e) => Err(e),
            }
        }
        Command::Rules { remote } => remote_call(&remote, "GET", "/v1/rules", None, cli::rules),
        Command::Stats { remote } => remote_call(&remote, "GET", "/v1/stats", None, cli::stats),
        Command::Top { count, remote } => remote_call(
            &remote,
            "GET",
            &format!("/v1/sources?top={count}"),
            None,
            cli::top,
        ),
        Command::Cells { count, remote } => remote_call(
            &remote,
            "GET",
            &format!("/v1/cells?top={count}"),
            None,
            cli::cells,
        ),
        Command::Events { count, remote } => remote_call(
            &remote,
            "GET",
            &format!("/v1/events?limit={count}"),
            None,
            cli::events,
        ),
        Command::Source { ip, remote } => remote_call(
            &remote,
            "GET",
            &format!("/v1/sources/{}", cli::encode_segment(&ip)),
            None,
            cli::source,
        ),
        Command::Ban {
            cidr,
            ttl,
            reason,
            force,
            remote,
        } => {
            let body = serde_json::json!({ "cidr": cidr, "ttl_secs": ttl, "reason": reason, "force": force });
            remote_call(&remote, "POST", "/v1/bans", Some(&body), cli::ban)
        }
        Command::Bans { remote } => remote_call(&remote, "GET", "/v1/bans", None, cli::bans),
        Command::Unban { cidr, remote } => remote_call(
            &remote,
            "DELETE",
            &format!("/v1/bans/{}", cli::encode_segment(&cidr)),
            None,
            cli::applied,
        ),
        Command::L7State {
            domain,
            entries,
            remote,
        } => {
            let mut q = format!("/v1/l7/state?domain={}", cli::encode_segment(&domain));
            let mut bad = None;
            for e in &entries {
                match e.split_once('=') {
                    Some((k, v)) => {
                        q += &format!("&{}={}", cli::encode_segment(k), cli::encode_segment(v))
                    }
                    None => bad = Some(e.clone()),
                }
            }
            match bad {
                Some(e) => Err(anyhow::anyhow!(
                    "{e:?} is not key=value: give the descriptor's entries as key=value, in order"
                )),
                None => remote_call(&remote, "GET", &q, None, cli::l7_state),
            }
        }
        Command::Detach { iface, pin_dir } => daemon::detach(&iface, &pin_dir),
        Command::Run {
            ifaces,
            config,
            mode,
            stats_interval,
            runtime_dir,
            pid_file,
            no_watch,
            api,
            pin_dir,
            detach_on_exit,
        } => {
            let opts = daemon::RunOptions {
                ifaces,
                config,
                mode,
                stats_interval: Duration::from_secs(stats_interval),
                pid_file: Some(pid_file.unwrap_or_else(|| runtime_dir.join("rl-control.pid"))),
                runtime_dir,
                watch: !no_watch,
                api,
                pin_dir,
                detach_on_exit,
            };
            tokio::runtime::Builder::new_multi_thread()
                .worker_threads(2)
                // aya learns the number of possible CPUs once per thread,
                // from a file, at the thread's first read of a per-CPU map:
                // learnt at each thread's start, a daemon out of file
                // descriptors still reads its counters (/metrics, stats).
                .on_thread_start(|| {
                    let _ = aya::util::nr_cpus();
                })
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
