//! Developer and CI commands for rl. Run through the cargo alias:
//! `cargo xtask <command>`.

mod bootstrap;

use std::{path::PathBuf, process::Command};

use anyhow::{bail, Context, Result};
use clap::{Parser, Subcommand};

/// Prints one progress line.
#[macro_export]
macro_rules! step {
    ($($t:tt)*) => { eprintln!("xtask: {}", format!($($t)*)) };
}

#[derive(Parser)]
#[command(name = "cargo xtask", about = "Build, test, demo and benchmark rl")]
struct Cli {
    #[command(subcommand)]
    command: Cmd,
}

#[derive(Subcommand)]
enum Cmd {
    /// Install what a fresh machine lacks: rust-src for nightly, bpf-linker, test packages.
    Bootstrap,
    /// Bootstrap, then build the XDP object and the host binaries.
    Build {
        /// Optimised host binaries.
        #[arg(long)]
        release: bool,
    },
    /// Bootstrap, build, then run every test (unit, TestRun and end-to-end; needs root).
    Test,
    /// Build, then run the veth lab demo: floods from several sources against the embedded default.
    Demo,
    /// Fuzz for longer than `test` does: the packet fuzz test (frames through the
    /// real XDP program against the userspace reference) and the config fuzz
    /// properties with many more cases. Needs root.
    Fuzz {
        /// Frames for the packet fuzz test (`cargo xtask test` runs 1,000,000).
        #[arg(long, default_value_t = 20_000_000)]
        frames: u64,
        /// Seed for the packet fuzz test (default: from the clock, printed).
        #[arg(long)]
        seed: Option<u64>,
        /// Cases per config fuzz property (`cargo xtask test` runs 256).
        #[arg(long, default_value_t = 100_000)]
        config_cases: u32,
    },
    /// Build (release), then measure: ns/packet of each XDP path with BPF_PROG_TEST_RUN against an
    /// XDP_DROP floor; CPU ns/packet of a random-source veth flood with rl, a bare XDP_PASS and
    /// nftables' dynset limit side by side; the admin API's latency and rule-swap time; packets lost
    /// across a daemon restart, /metrics under ban churn and the daemon's RSS with 1M sources.
    Bench {
        /// Repetitions per measurement (BPF_PROG_TEST_RUN `repeat`).
        #[arg(long, default_value_t = 1_000_000)]
        repeat: u32,
        /// Frames per phase of each veth flood run (its first frames from empty tables, then as many
        /// of the same, sustained flood; 5 rounds × 4 filters).
        #[arg(long, default_value_t = 1_000_000)]
        frames: u64,
    },
}

fn main() {
    let cli = Cli::parse();
    // rustup's proxies (`rustc +nightly`, `cargo +stable`) would download a
    // missing toolchain silently, and bpf-linker is tied to the installed
    // nightly's LLVM: a missing one must stop with bootstrap's message.
    std::env::set_var("RUSTUP_AUTO_INSTALL", "0");
    let result = match cli.command {
        Cmd::Bootstrap => bootstrap::bootstrap(),
        Cmd::Build { release } => build(release),
        Cmd::Test => test(),
        Cmd::Demo => demo(),
        Cmd::Bench { repeat, frames } => bench(repeat, frames),
        Cmd::Fuzz {
            frames,
            seed,
            config_cases,
        } => fuzz(frames, seed, config_cases),
    };
    if let Err(e) = result {
        eprintln!("xtask: error: {e:#}");
        std::process::exit(1);
    }
}

/// Runs `cmd`, failing with its exit status.
pub fn run(cmd: &mut Command) -> Result<()> {
    let status = cmd.status().with_context(|| format!("starting {cmd:?}"))?;
    if !status.success() {
        bail!("{cmd:?} failed ({status})");
    }
    Ok(())
}

fn workspace_root() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
        .parent()
        .unwrap()
        .to_path_buf()
}

/// The host cargo that runs xtask.
fn cargo() -> Command {
    let mut c = Command::new(std::env::var_os("CARGO").unwrap_or_else(|| "cargo".into()));
    c.current_dir(workspace_root());
    c
}

/// Builds the XDP object with nightly into target/bpf.
fn build_ebpf() -> Result<()> {
    step!(
        "building the XDP program (rl-ebpf, {} toolchain)",
        bootstrap::nightly()
    );
    let root = workspace_root();
    run(Command::new("rustup")
        .args([
            "run",
            &bootstrap::nightly(),
            "cargo",
            "build",
            "--locked",
            "--release",
        ])
        .args(["--target", "bpfel-unknown-none", "-Z", "build-std=core"])
        .arg("--target-dir")
        .arg(root.join("target/bpf"))
        .current_dir(root.join("rl-ebpf"))
        .env("PATH", bootstrap::path_with_cargo_bin())
        // BPF CPU v3: 64-bit atomic compare-and-swap for the shared buckets.
        .env("CARGO_ENCODED_RUSTFLAGS", "-Ctarget-cpu=v3")
        .env_remove("RUSTFLAGS")
        .env_remove("RUSTC")
        .env_remove("RUSTC_WRAPPER")
        .env_remove("RUSTC_WORKSPACE_WRAPPER")
        .env_remove("RUSTUP_TOOLCHAIN")
        .env_remove("CARGO_TARGET_DIR"))
}

fn build(release: bool) -> Result<()> {
    disk_space()?;
    bootstrap::bootstrap()?;
    build_ebpf()?;
    step!(
        "building host binaries ({})",
        if release { "release" } else { "debug" }
    );
    let mut c = cargo();
    c.args(["build", "--locked", "--workspace", "--bins"]);
    if release {
        c.arg("--release");
    }
    run(&mut c)
}

/// A full-disk build fails deep inside rustc ("No space left on device"
/// on some rlib): say so up front, with the figure and what to do.
fn disk_space() -> Result<()> {
    let target = workspace_root().join("target");
    let probe = if target.exists() {
        target.clone()
    } else {
        workspace_root()
    };
    let path =
        std::ffi::CString::new(probe.as_os_str().as_encoded_bytes()).context("target path")?;
    let mut st: libc::statvfs = unsafe { std::mem::zeroed() };
    if unsafe { libc::statvfs(path.as_ptr(), &mut st) } != 0 {
        return Err(std::io::Error::last_os_error())
            .with_context(|| format!("statvfs {}", probe.display()));
    }
    let free = st.f_bavail as u64 * st.f_frsize as u64;
    enough_disk(free, target.join("debug/deps").exists(), &target)
}

/// What a build from scratch takes (debug and test binaries, the XDP object
/// and release benches: about 7.5 GiB), and what an incremental one keeps
/// needing.
const FRESH_BUILD_BYTES: u64 = 9 << 30;
const INCREMENTAL_BUILD_BYTES: u64 = 2 << 30;

fn enough_disk(free: u64, built_before: bool, target: &std::path::Path) -> Result<()> {
    let need = if built_before {
        INCREMENTAL_BUILD_BYTES
    } else {
        FRESH_BUILD_BYTES
    };
    if free < need {
        bail!(
            "only {:.1} GiB free on the disk holding {}; a {} build needs about {} GiB: free space \
             (`cargo clean` in old checkouts, stale clones under /tmp) and rerun",
            free as f64 / (1u64 << 30) as f64,
            target.display(),
            if built_before { "further" } else { "first" },
            need >> 30
        );
    }
    Ok(())
}

fn require_root(what: &str) -> Result<()> {
    if unsafe { libc::geteuid() } != 0 {
        bail!("{what} needs root (network namespaces, XDP attach, BPF maps): run it as root, e.g. `sudo -E cargo xtask {what}`");
    }
    Ok(())
}

fn test() -> Result<()> {
    build(false)?;
    step!("unit and property tests (rl-common, rl-control)");
    run(cargo().args(["test", "--locked", "--workspace", "--exclude", "rl-tests"]))?;
    require_root("test")?;
    stale_labs();
    step!(
        "XDP tests: TestRun packets and end-to-end floods in network namespaces (about 14 minutes)"
    );
    run_test_binaries()?;
    step!("all tests passed");
    Ok(())
}

/// How long one test binary of rl-tests may run before it is killed
/// (`RL_TEST_TIMEOUT_SECS`): the slowest takes under two minutes, and a
/// hang must not use up CI's 90.
const TEST_BINARY_TIMEOUT_SECS: u64 = 600;

/// Builds rl-tests' test binaries, then runs each one at a time (floods
/// share two CPUs and their timing is the measurement), each under a time
/// limit, all of them even after a failure; prints each one's time and
/// fails naming every binary that failed.
fn run_test_binaries() -> Result<()> {
    let out = cargo()
        .args([
            "test",
            "--locked",
            "-p",
            "rl-tests",
            "--no-run",
            "--message-format=json-render-diagnostics",
        ])
        .stderr(std::process::Stdio::inherit())
        .output()
        .context("building the rl-tests binaries")?;
    if !out.status.success() {
        bail!("building the rl-tests binaries failed ({})", out.status);
    }
    let mut binaries = test_executables(&String::from_utf8_lossy(&out.stdout));
    binaries.sort();
    if binaries.is_empty() {
        bail!("cargo built no rl-tests test binary");
    }
    let limit = std::env::var("RL_TEST_TIMEOUT_SECS")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(TEST_BINARY_TIMEOUT_SECS);
    let (mut failed, mut times) = (Vec::new(), Vec::new());
    for (name, exe) in &binaries {
        if INTERRUPTED.load(std::sync::atomic::Ordering::SeqCst) {
            bail!("interrupted: the remaining test binaries did not run");
        }
        let start = std::time::Instant::now();
        let result = run_limited(
            Command::new(exe)
                .arg("--test-threads=1")
                .current_dir(workspace_root().join("tests")),
            limit,
        );
        let secs = start.elapsed().as_secs_f64();
        match result {
            Ok(()) => step!("{name}: passed in {secs:.1} s"),
            Err(e) => {
                step!("{name}: FAILED in {secs:.1} s: {e:#}");
                failed.push(name.clone());
            }
        }
        times.push((secs, name.clone()));
    }
    times.sort_by(|a, b| b.0.total_cmp(&a.0));
    let total: f64 = times.iter().map(|t| t.0).sum();
    let slowest: Vec<String> = times
        .iter()
        .take(5)
        .map(|(s, n)| format!("{n} {s:.0} s"))
        .collect();
    step!(
        "{} test binaries in {total:.0} s; slowest: {}",
        times.len(),
        slowest.join(", ")
    );
    if !failed.is_empty() {
        bail!("{} of {} test binaries failed: {} (rerun one: `cargo test -p rl-tests --test NAME -- --test-threads=1`; `--lib` for rl_tests)", failed.len(), binaries.len(), failed.join(", "));
    }
    Ok(())
}

/// (name, path) of each test executable in cargo's JSON messages.
fn test_executables(messages: &str) -> Vec<(String, PathBuf)> {
    let field = |line: &str, key: &str| -> Option<String> {
        let at = line.find(&format!("\"{key}\":\""))? + key.len() + 4;
        Some(line[at..].split('"').next()?.to_string())
    };
    messages
        .lines()
        .filter(|l| l.contains("\"reason\":\"compiler-artifact\""))
        .filter_map(|l| {
            let exe = field(l, "executable")?;
            // Test harnesses live in deps/; the plain binaries beside them
            // are tools (benches, the demo).
            if !exe.contains("/deps/") {
                return None;
            }
            let name = l
                .find("\"target\":")
                .and_then(|at| field(&l[at..], "name"))
                .unwrap_or_else(|| exe.clone());
            Some((name, PathBuf::from(exe)))
        })
        .collect()
}

/// The process group of the test binary running now (0: none), for
/// [`forward`]: in a group of its own, it does not get the terminal's
/// Ctrl-C itself.
static RUNNING_GROUP: std::sync::atomic::AtomicI32 = std::sync::atomic::AtomicI32::new(0);
static INTERRUPTED: std::sync::atomic::AtomicBool = std::sync::atomic::AtomicBool::new(false);

/// SIGINT/SIGTERM to xtask: passed on to the running test binary's group,
/// and no further binary starts.
extern "C" fn forward(signal: libc::c_int) {
    INTERRUPTED.store(true, std::sync::atomic::Ordering::SeqCst);
    let group = RUNNING_GROUP.load(std::sync::atomic::Ordering::SeqCst);
    if group > 0 {
        unsafe { libc::kill(-group, signal) };
    }
}

/// Runs `cmd`, killing it (and what it started in its process group) after
/// `secs` seconds.
fn run_limited(cmd: &mut Command, secs: u64) -> Result<()> {
    use std::os::unix::process::CommandExt;
    if INTERRUPTED.load(std::sync::atomic::Ordering::SeqCst) {
        bail!("interrupted");
    }
    unsafe {
        libc::signal(
            libc::SIGINT,
            forward as extern "C" fn(libc::c_int) as libc::sighandler_t,
        );
        libc::signal(
            libc::SIGTERM,
            forward as extern "C" fn(libc::c_int) as libc::sighandler_t,
        );
    }
    let mut child = cmd
        .process_group(0)
        .spawn()
        .with_context(|| format!("starting {cmd:?}"))?;
    RUNNING_GROUP.store(child.id() as i32, std::sync::atomic::Ordering::SeqCst);
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(secs);
    loop {
        if let Some(status) = child.try_wait()? {
            RUNNING_GROUP.store(0, std::sync::atomic::Ordering::SeqCst);
            if INTERRUPTED.load(std::sync::atomic::Ordering::SeqCst) {
                bail!("interrupted");
            }
            return if status.success() {
                Ok(())
            } else {
                Err(anyhow::anyhow!("{status}"))
            };
        }
        if std::time::Instant::now() >= deadline {
            unsafe { libc::kill(-(child.id() as i32), libc::SIGKILL) };
            let _ = child.wait();
            RUNNING_GROUP.store(0, std::sync::atomic::Ordering::SeqCst);
            bail!(
                "still running after {secs} s (RL_TEST_TIMEOUT_SECS): killed; the network namespaces it made are removed by a later \
                 `cargo xtask test` once an hour old, or now with `ip netns delete`"
            );
        }
        std::thread::sleep(std::time::Duration::from_millis(200));
    }
}

/// Labs a killed run left behind (a test's cleanup runs on panic, not on
/// SIGKILL): network namespaces named as the lab names them, with no
/// process in them, and the lab's bpffs mounts under the temp dir, each
/// unchanged for an hour (a run going on beside this one keeps its own).
fn stale_labs() {
    let Ok(list) = std::process::Command::new("ip")
        .args(["netns", "list"])
        .output()
    else {
        return;
    };
    for name in String::from_utf8_lossy(&list.stdout)
        .lines()
        .filter_map(|l| l.split_whitespace().next())
    {
        if !(name.starts_with("rl-lab") || name.starts_with("rl-hub")) {
            continue;
        }
        // `ip netns pids` sees processes, not threads a lab moved into the
        // namespace: only an hour-old one is taken for left behind.
        if !hour_old(&std::path::Path::new("/run/netns").join(name)) {
            continue;
        }
        let pids = std::process::Command::new("ip")
            .args(["netns", "pids", name])
            .output();
        if pids.is_ok_and(|p| p.status.success() && p.stdout.is_empty()) {
            step!("removing network namespace {name}, left behind by an earlier run");
            let _ = std::process::Command::new("ip")
                .args(["netns", "delete", name])
                .status();
        }
    }
    let mounts = std::fs::read_to_string("/proc/self/mounts").unwrap_or_default();
    let tmp = std::env::temp_dir();
    for at in mounts.lines().filter_map(|l| {
        let mut f = l.split_whitespace();
        let (_, at, kind) = (f.next()?, f.next()?, f.next()?);
        (kind == "bpf"
            && std::path::Path::new(at).parent() == Some(tmp.as_path())
            && at.contains("rl-bpffs-"))
        .then(|| at.to_string())
    }) {
        // Not one a run going on now (a bench beside the tests) uses.
        if !hour_old(std::path::Path::new(&at)) {
            continue;
        }
        step!("unmounting {at}, left behind by an earlier run");
        let _ = std::process::Command::new("umount").arg(&at).status();
        let _ = std::fs::remove_dir(&at);
    }
}

/// Whether `path` has not changed for an hour.
fn hour_old(path: &std::path::Path) -> bool {
    let age = std::fs::metadata(path)
        .and_then(|m| m.modified())
        .ok()
        .and_then(|t| t.elapsed().ok());
    age.is_some_and(|a| a >= std::time::Duration::from_secs(3600))
}

fn fuzz(frames: u64, seed: Option<u64>, config_cases: u32) -> Result<()> {
    build(false)?;
    step!("config fuzz: {config_cases} cases per property");
    run(cargo()
        .args(["test", "-p", "rl-control", "--test", "config_fuzz"])
        .env("PROPTEST_CASES", config_cases.to_string()))?;
    require_root("fuzz")?;
    let seed = seed.unwrap_or_else(|| {
        std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map_or(1, |d| d.as_nanos() as u64)
    });
    step!("packet fuzz: {frames} frames, seed {seed} (repeat a failure with --seed {seed})");
    run(cargo()
        .args([
            "test",
            "--release",
            "-p",
            "rl-tests",
            "--test",
            "packet_fuzz",
            "--",
            "--nocapture",
        ])
        .env("RL_FUZZ_FRAMES", frames.to_string())
        .env("RL_FUZZ_SEED", seed.to_string()))
}

fn demo() -> Result<()> {
    build(false)?;
    require_root("demo")?;
    run(cargo().args(["run", "--quiet", "-p", "rl-tests", "--bin", "rl-demo"]))
}

fn bench(repeat: u32, frames: u64) -> Result<()> {
    build(true)?;
    require_root("bench")?;
    run(cargo()
        .args([
            "run",
            "--quiet",
            "--release",
            "-p",
            "rl-tests",
            "--bin",
            "rl-bench",
            "--",
        ])
        .arg(repeat.to_string()))?;
    step!(
        "veth: CPU ns per packet of a random-source flood, rl against bare XDP_PASS and nftables"
    );
    run(cargo()
        .args([
            "run",
            "--quiet",
            "--release",
            "-p",
            "rl-tests",
            "--bin",
            "rl-veth-bench",
            "--",
        ])
        .arg(frames.to_string()))?;
    step!(
        "admin API: latency at 1,000 requests/s and rule-swap time, against a daemon in a veth lab"
    );
    run(cargo().args([
        "run",
        "--quiet",
        "--release",
        "-p",
        "rl-tests",
        "--bin",
        "rl-api-bench",
    ]))?;
    step!(
        "daemon: packets lost across a restart, /metrics under ban churn, peak RSS with 1M sources"
    );
    run(cargo().args([
        "run",
        "--quiet",
        "--release",
        "-p",
        "rl-tests",
        "--bin",
        "rl-daemon-bench",
    ]))?;
    step!("request decisions: gRPC and HTTP latency at 20,000/s with 1 and 1M keys, gRPC saturation, memory per key");
    run(cargo().args([
        "run",
        "--quiet",
        "--release",
        "-p",
        "rl-tests",
        "--bin",
        "rl-l7-bench",
    ]))?;
    step!("cluster: decisions through Redis against local and raw EVALSHA, the packet-rule sync's Redis cost, overshoot of 3 hosts against the bound");
    run(cargo().args([
        "run",
        "--quiet",
        "--release",
        "-p",
        "rl-tests",
        "--bin",
        "rl-cluster-bench",
    ]))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_first_build_needs_room_for_everything_a_later_one_less() {
        let t = std::path::Path::new("/x/target");
        let err = enough_disk(600 << 20, false, t).unwrap_err().to_string();
        assert!(
            err.starts_with(
                "only 0.6 GiB free on the disk holding /x/target; a first build needs about 9 GiB"
            ),
            "{err}"
        );
        assert!(enough_disk(5 << 30, false, t).is_err());
        assert!(enough_disk(5 << 30, true, t).is_ok());
        assert!(enough_disk(1 << 30, true, t).is_err());
        assert!(enough_disk(10 << 30, false, t).is_ok());
    }
}
