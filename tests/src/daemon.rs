//! The real `rl-control` binary, run in a lab namespace, killed on drop.

use std::{
    io::{BufRead, BufReader},
    path::PathBuf,
    process::{Child, Command, ExitStatus, Stdio},
    sync::{Arc, Mutex},
    time::{Duration, Instant},
};

use anyhow::{bail, Context, Result};

use crate::lab::Netns;

/// The `rl-control` binary next to the running test or tool (same profile),
/// or `$RL_CONTROL_BIN`.
pub fn binary() -> PathBuf {
    if let Some(p) = std::env::var_os("RL_CONTROL_BIN") {
        return p.into();
    }
    let exe = std::env::current_exe().expect("current_exe");
    for dir in exe.ancestors().skip(1).take(2) {
        let candidate = dir.join("rl-control");
        if candidate.is_file() {
            return candidate;
        }
    }
    panic!(
        "rl-control binary not found next to {}: build it first (`cargo xtask test` does)",
        exe.display()
    );
}

/// A new lab with a daemon serving the rules `toml` (see
/// [`Daemon::serving`]); the rule file lives as long as this.
pub struct Served {
    pub d: Daemon,
    pub cfg: PathBuf,
    pub lab: crate::lab::Lab,
    /// Holds the rule file: bind it (`dir: _dir`) while the daemon runs.
    pub dir: tempfile::TempDir,
}

/// [`Served`] with `toml`.
pub fn served(toml: &str) -> Result<Served> {
    let lab = crate::lab::Lab::new()?;
    let dir = tempfile::tempdir()?;
    let cfg = write(&dir, "rl.toml", toml);
    let d = Daemon::serving(&lab, &cfg, &[])?;
    Ok(Served { d, cfg, lab, dir })
}

/// Writes `text` to `name` in `dir` (a config or token file for the daemon).
pub fn write(dir: &tempfile::TempDir, name: &str, text: &str) -> PathBuf {
    let p = dir.path().join(name);
    std::fs::write(&p, text).unwrap();
    p
}

/// Runs `rl-control args…` inside `ns` (or the current namespace) to completion.
pub fn run_once(ns: Option<&Netns>, args: &[&str]) -> Result<(ExitStatus, String)> {
    let out = command(ns, &[], args)
        .output()
        .context("running rl-control")?;
    let mut text = String::from_utf8_lossy(&out.stdout).into_owned();
    text.push_str(&String::from_utf8_lossy(&out.stderr));
    Ok((out.status, text))
}

/// `rl-control args…` in `ns`, run through `wrapper` (e.g. `setpriv …`)
/// when it is not empty.
fn command(ns: Option<&Netns>, wrapper: &[&str], args: &[&str]) -> Command {
    let bin = binary();
    let mut line: Vec<&std::ffi::OsStr> = Vec::new();
    if let Some(ns) = ns {
        line.extend(["ip", "netns", "exec", ns.name.as_str()].map(std::ffi::OsStr::new));
    }
    line.extend(wrapper.iter().map(std::ffi::OsStr::new));
    line.push(bin.as_os_str());
    let mut c = Command::new(line[0]);
    c.args(&line[1..]);
    c.args(args).env("RUST_LOG", "info");
    if let Some(ns) = ns {
        c.env("RL_RUNTIME_DIR", ns.runtime_dir());
    }
    c
}

/// A running daemon. Its stderr is collected line by line.
pub struct Daemon {
    child: Child,
    log: Arc<Mutex<String>>,
}

impl Daemon {
    /// Starts `rl-control args…` in `ns` (`ip netns exec` execs it, so the
    /// child's pid is the daemon's).
    pub fn spawn(ns: &Netns, args: &[&str]) -> Result<Daemon> {
        Daemon::spawn_under(ns, &[], args)
    }

    /// [`Daemon::spawn`] through `wrapper` (a command that execs the rest
    /// of its arguments, e.g. `setpriv --bounding-set …`): the child's pid
    /// is still the daemon's.
    pub fn spawn_under(ns: &Netns, wrapper: &[&str], args: &[&str]) -> Result<Daemon> {
        let mut child = command(Some(ns), wrapper, args)
            .stdout(Stdio::null())
            .stderr(Stdio::piped())
            .spawn()
            .context("starting rl-control")?;
        let log = Arc::new(Mutex::new(String::new()));
        let stderr = child.stderr.take().unwrap();
        let sink = log.clone();
        std::thread::spawn(move || {
            for line in BufReader::new(stderr).lines().map_while(Result::ok) {
                let mut l = sink.lock().unwrap();
                l.push_str(&line);
                l.push('\n');
            }
        });
        Ok(Daemon { child, log })
    }

    /// Runs the daemon on the lab's protected interface with the config
    /// file `cfg` (not watched, detached on exit) and `extra` arguments;
    /// returns once its admin API is up.
    pub fn serving(lab: &crate::lab::Lab, cfg: &std::path::Path, extra: &[&str]) -> Result<Daemon> {
        let mut args = vec!["--detach-on-exit"];
        args.extend_from_slice(extra);
        Daemon::on_lab(lab, cfg, &args)
    }

    /// Like [`Daemon::serving`], pinned in `pins` (a [`crate::lab::BpfFs`])
    /// and left attached on exit, as in production.
    pub fn pinned(
        lab: &crate::lab::Lab,
        cfg: &std::path::Path,
        pins: &crate::lab::BpfFs,
        extra: &[&str],
    ) -> Result<Daemon> {
        let mut args = vec!["--pin-dir", pins.arg()];
        args.extend_from_slice(extra);
        Daemon::on_lab(lab, cfg, &args)
    }

    fn on_lab(lab: &crate::lab::Lab, cfg: &std::path::Path, extra: &[&str]) -> Result<Daemon> {
        let pid = cfg.with_extension("pid");
        let (cfg, pid) = (
            cfg.to_str().context("config path")?,
            pid.to_str().context("pid path")?,
        );
        let mut args = vec![
            "run",
            "--iface",
            crate::lab::VB,
            "--config",
            cfg,
            "--pid-file",
            pid,
            "--no-watch",
        ];
        args.extend_from_slice(extra);
        let mut d = Daemon::spawn(&lab.b, &args)?;
        d.wait_for("admin API on", Duration::from_secs(20))?;
        Ok(d)
    }

    /// The daemon's process id.
    pub fn pid(&self) -> u32 {
        self.child.id()
    }

    pub fn log(&self) -> String {
        self.log.lock().unwrap().clone()
    }

    /// Waits until the log contains `needle`, or fails with the log so far.
    pub fn wait_for(&mut self, needle: &str, timeout: Duration) -> Result<()> {
        let deadline = Instant::now() + timeout;
        while Instant::now() < deadline {
            if self.log().contains(needle) {
                return Ok(());
            }
            if let Some(status) = self.child.try_wait()? {
                std::thread::sleep(Duration::from_millis(100));
                bail!(
                    "rl-control exited ({status}) before logging {needle:?}:\n{}",
                    self.log()
                );
            }
            std::thread::sleep(Duration::from_millis(20));
        }
        bail!(
            "rl-control did not log {needle:?} within {timeout:?}:\n{}",
            self.log()
        )
    }

    /// Sends `signal` to the daemon.
    pub fn signal(&self, signal: libc::c_int) {
        unsafe { libc::kill(self.child.id() as i32, signal) };
    }

    /// Sends `signal` and waits for exit; returns the status and full log.
    pub fn stop(mut self, signal: libc::c_int) -> Result<(ExitStatus, String)> {
        self.signal(signal);
        let deadline = Instant::now() + Duration::from_secs(10);
        loop {
            if let Some(status) = self.child.try_wait()? {
                // Let the reader thread take the last lines.
                std::thread::sleep(Duration::from_millis(100));
                return Ok((status, self.log()));
            }
            if Instant::now() > deadline {
                bail!(
                    "rl-control did not exit within 10 s of signal {signal}:\n{}",
                    self.log()
                );
            }
            std::thread::sleep(Duration::from_millis(20));
        }
    }
}

impl Drop for Daemon {
    fn drop(&mut self) {
        if let Ok(None) = self.child.try_wait() {
            let _ = self.child.kill();
            let _ = self.child.wait();
        }
    }
}

/// Parses `name=value` from the daemon's final counters line.
pub fn final_counter(log: &str, name: &str) -> Option<u64> {
    let line = log.lines().rev().find(|l| l.contains("final counters:"))?;
    let key = format!("{name}=");
    line.split_whitespace()
        .find_map(|w| w.strip_prefix(&key))
        .and_then(|v| v.parse().ok())
}
