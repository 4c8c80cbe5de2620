//! The rl test lab: network namespaces, veth pairs, real traffic, hand-built
//! frames, and a guard for the `rl-control` daemon. Used by the end-to-end
//! tests, `cargo xtask demo` and `cargo xtask bench`.

pub mod alerts;
pub mod cluster_lab;
pub mod daemon;
pub mod envoy;
pub mod frames;
pub mod gateway;
pub mod http;
pub mod http_load;
pub mod lab;
pub mod redis;
pub mod reference;
pub mod rls;
pub mod rls_load;
pub mod traffic;

use anyhow::{Context, Result};
use rl_control::{compile::compile, config::Config, datapath::Datapath};

/// One rule's counters, by name (zero if it has none yet).
pub fn rule_stats(dp: &Datapath, name: &str) -> rl_common::RuleStats {
    dp.rule_stats()
        .unwrap()
        .get(name)
        .copied()
        .unwrap_or_default()
}

/// Loads the limiter with the config in `toml` (not attached).
pub fn datapath(toml: &str) -> Result<Datapath> {
    let config = Config::from_str(toml, "<test>")?;
    Datapath::load(&compile(&config)).context("loading the datapath")
}

/// `compiled`'s datapath pinned in `dir` (a directory of a
/// [`lab::BpfFs`]), as the daemon loads it: adopted if pinned there before.
pub fn load_pinned(compiled: &rl_control::compile::Compiled, dir: &std::path::Path) -> Datapath {
    let opts = rl_control::datapath::LoadOptions {
        pin: Some(dir.to_path_buf()),
        ..Default::default()
    };
    Datapath::load_with(compiled, opts).expect("loading the pinned datapath")
}

/// One pass of the daemon's collector over `dp`'s tables, as the daemon
/// runs it every second.
pub fn collector_pass(dp: &Datapath) -> rl_control::datapath::Pass {
    let limits = dp.limits_by_key().expect("the limits of both slots");
    rl_control::datapath::collect(
        &dp.table_maps().expect("table maps"),
        dp.epoch_offset_ns(),
        &limits,
        &dp.known_filter().expect("the known-keys filter"),
    )
    .expect("a collector pass")
}

/// Loads the limiter with `toml` and attaches it to the lab's protected
/// interface in `mode`.
pub fn attach(
    lab: &lab::Lab,
    toml: &str,
    mode: rl_control::datapath::AttachMode,
) -> Result<Datapath> {
    let mut dp = datapath(toml)?;
    // Attaching resolves the interface name in the protected namespace; the
    // link is an fd and stays attached wherever the Datapath goes.
    lab.b.run(move || {
        dp.attach(lab::VB, mode)?;
        Ok(dp)
    })
}

/// The spoofed-flood lab's rules (issue 8's example): `max_sources`
/// sources, flood mode above 2,000 unseen keys/s with 256 prefix cells,
/// 1,000/s by default, `203.0.113.0/24` allowed, rule "calm" (UDP 7777, 5
/// per hour) and rule "once" (UDP 9999, 1 per hour).
pub fn flood_rules(max_sources: u64) -> String {
    format!(
        "[datapath]\nmax_sources = {max_sources}\nflood_new_keys_per_sec = 2000\nflood_prefixes = 256\n\
         [default]\nrate = 1000\nburst = 1000\n\
         [[allow]]\ncidr = \"203.0.113.0/24\"\n\
         [[rule]]\nname = \"calm\"\nproto = \"udp\"\ndst_ports = [7777]\nrate = 5\nper = \"1h\"\nburst = 5\n\
         [[rule]]\nname = \"once\"\nproto = \"udp\"\ndst_ports = [9999]\nrate = 1\nper = \"1h\"\nburst = 1\n"
    )
}

/// The name (`prefix` and a number) of a rule `x(name)` whose id, compiled
/// beside `base` (a rule file with fewer than 24 rules) and the rule text
/// `y`, shares `y`'s
/// wide-cell count (`rl_common::wide_entry`): searched among candidate
/// names, since ids are hashes of the definitions (not of their place in
/// the file), each sharing with odds of 1 in 1,024.
pub fn sharing_a_wide_count(
    base: &str,
    prefix: &str,
    x: impl Fn(&str) -> String,
    y: &str,
) -> String {
    (0..10)
        .find_map(|batch| {
            let names: Vec<String> = (batch * 1000..(batch + 1) * 1000)
                .map(|n| format!("{prefix}{n}"))
                .collect();
            let text = format!(
                "{base}{}{y}",
                names.iter().map(|n| x(n)).collect::<String>()
            );
            let set = compile(&Config::from_str(&text, "<test>").expect("a valid rule file")).rules;
            let at = |i: usize| rl_common::wide_entry(set.entries[i].id, 0);
            let (first, last) = (set.entries.len() - 1 - names.len(), set.entries.len() - 1);
            (first..last)
                .find(|&i| at(i) == at(last))
                .map(|i| names[i - first].clone())
        })
        .expect("among 10,000 candidates one shares y's wide count")
}

/// `burst + rate × seconds`, the packets a limiter passes from a flood.
pub fn expected_passed(rate: u64, burst: u64, seconds: f64) -> f64 {
    burst as f64 + rate as f64 * seconds
}

/// The accuracy every flood test holds to: ±1% or ±2 packets, whichever is larger.
pub fn tolerance(expected: f64) -> f64 {
    (expected * 0.01).max(2.0)
}

/// XDP verdicts as `BPF_PROG_TEST_RUN` returns them.
pub const XDP_DROP: u32 = 1;
pub const XDP_PASS: u32 = 2;

/// Runs `frame` through the limiter `n` times, one test run each; returns
/// (passed, dropped).
pub fn offer(dp: &Datapath, frame: &[u8], n: u32) -> (u32, u32) {
    let mut out = (0, 0);
    for _ in 0..n {
        match dp.test_run(frame, 1).expect("test run").0 {
            XDP_PASS => out.0 += 1,
            XDP_DROP => out.1 += 1,
            v => panic!("unexpected verdict {v}"),
        }
    }
    out
}

/// CPU time the hypervisor gave to other guests (steal) against all CPU
/// time, from `/proc/stat`: take one reading before a benchmark and pass it
/// to [`StealMeter::report`] after.
pub struct StealMeter {
    steal: u64,
    total: u64,
}

/// A `kB` field of `/proc/PID/status` (`VmRSS`, `VmHWM`), in KiB.
pub fn proc_status_kib(pid: u32, field: &str) -> Result<u64> {
    let status = std::fs::read_to_string(format!("/proc/{pid}/status"))?;
    status
        .lines()
        .find_map(|l| l.strip_prefix(field)?.strip_prefix(':'))
        .and_then(|v| v.trim().trim_end_matches("kB").trim().parse().ok())
        .with_context(|| format!("no {field} in /proc/{pid}/status"))
}

/// CPU time process `pid` has used (user + system), in seconds.
pub fn process_cpu_secs(pid: u32) -> Result<f64> {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat"))?;
    // Fields after the command (in parentheses, which may hold spaces).
    let rest = stat
        .rsplit_once(')')
        .map(|(_, r)| r)
        .context("a /proc/PID/stat line")?;
    let f: Vec<&str> = rest.split_whitespace().collect();
    let ticks: u64 = f.get(11).and_then(|v| v.parse().ok()).unwrap_or(0)
        + f.get(12).and_then(|v| v.parse::<u64>().ok()).unwrap_or(0);
    let hz = unsafe { libc::sysconf(libc::_SC_CLK_TCK) }.max(1) as f64;
    Ok(ticks as f64 / hz)
}

/// The first (all-CPU) line of `/proc/stat` in clock ticks: user, nice,
/// system, idle, iowait, irq, softirq, steal, …
pub fn cpu_ticks() -> Vec<u64> {
    let stat = std::fs::read_to_string("/proc/stat").unwrap_or_default();
    stat.lines()
        .next()
        .unwrap_or("")
        .split_whitespace()
        .skip(1)
        .filter_map(|v| v.parse().ok())
        .collect()
}

/// Busy CPU time over all CPUs between [`BusyClock::start`] and
/// [`BusyClock::busy_ns`]: wall time × CPUs less the time the CPUs spent
/// idle, by cpuidle's per-state residency (µs). `/proc/stat` counts busy
/// time by sampling each CPU at every tick (250 Hz here): over a run of a
/// second, a partly busy CPU's sampling error alone is about 1% of the
/// figure. Without a cpuidle driver on every online CPU it falls back to
/// those ticks. Two differences from the ticks: time the hypervisor
/// steals counts as busy (the benches report steal apart), and on a
/// halting idle state (haltpoll, ACPI HLT) an interrupt that wakes the CPU
/// is handled before the state's residency ends, so it counts as idle (the
/// veth benches do their work on the sender's CPU, in its softirq).
pub struct BusyClock {
    at: std::time::Instant,
    idle_us: Option<u64>,
    ticks: Vec<u64>,
}

/// The online CPUs (`/sys/devices/system/cpu/online`, e.g. `0-3,6`).
fn online_cpus() -> Vec<usize> {
    let list = std::fs::read_to_string("/sys/devices/system/cpu/online").unwrap_or_default();
    let mut cpus = Vec::new();
    for part in list.trim().split(',').filter(|p| !p.is_empty()) {
        let (a, b) = part.split_once('-').unwrap_or((part, part));
        if let (Ok(a), Ok(b)) = (a.parse::<usize>(), b.parse::<usize>()) {
            cpus.extend(a..=b);
        }
    }
    cpus
}

/// Restores the calling thread's CPU affinity when dropped.
struct Affinity(libc::cpu_set_t);

impl Affinity {
    fn save() -> Option<Affinity> {
        let mut set: libc::cpu_set_t = unsafe { std::mem::zeroed() };
        let ok =
            unsafe { libc::sched_getaffinity(0, std::mem::size_of::<libc::cpu_set_t>(), &mut set) }
                == 0;
        ok.then_some(Affinity(set))
    }
}

impl Drop for Affinity {
    fn drop(&mut self) {
        unsafe { libc::sched_setaffinity(0, std::mem::size_of::<libc::cpu_set_t>(), &self.0) };
    }
}

/// All online CPUs' idle residency, µs, or `None` if one of them has no
/// cpuidle states or cannot be visited. A CPU in the middle of an idle
/// period has not added that period yet, so the reading thread runs on
/// every CPU first (running there ends its idle period).
fn idle_us() -> Option<u64> {
    let cpus = online_cpus();
    if cpus.is_empty() {
        return None;
    }
    let _restore = Affinity::save()?;
    let mut total = 0;
    for &cpu in &cpus {
        lab::pin_to_cpu(cpu).ok()?;
        let dir = format!("/sys/devices/system/cpu/cpu{cpu}/cpuidle");
        let mut states = 0;
        for entry in std::fs::read_dir(&dir).ok()?.flatten() {
            if !entry.file_name().to_string_lossy().starts_with("state") {
                continue;
            }
            let time = std::fs::read_to_string(entry.path().join("time")).ok()?;
            total += time.trim().parse::<u64>().ok()?;
            states += 1;
        }
        if states == 0 {
            return None;
        }
    }
    Some(total)
}

impl BusyClock {
    pub fn start() -> BusyClock {
        let at = std::time::Instant::now();
        BusyClock {
            at,
            idle_us: idle_us(),
            ticks: cpu_ticks(),
        }
    }

    /// Busy ns over all CPUs since [`BusyClock::start`].
    pub fn busy_ns(&self) -> f64 {
        let after = idle_us();
        // Wall time from before the first reading to after the last: the
        // readings' own idle time is in both terms.
        let wall = self.at.elapsed().as_nanos() as f64;
        match (self.idle_us, after) {
            (Some(before), Some(after)) if after >= before => {
                wall * online_cpus().len() as f64 - (after - before) as f64 * 1e3
            }
            // No cpuidle, or a CPU went offline and back (its counts restart).
            _ => busy_ns_since(&self.ticks),
        }
    }

    /// How busy time is measured, for a benchmark's header.
    pub fn source() -> &'static str {
        if idle_us().is_some() {
            "wall time × CPUs less cpuidle residency"
        } else {
            "busy ticks in /proc/stat (no cpuidle driver: about 1% sampling noise)"
        }
    }
}

/// CPU time spent busy (user, nice, system, irq, softirq) since `before`
/// (a [`cpu_ticks`] reading), in ns, over all CPUs.
pub fn busy_ns_since(before: &[u64]) -> f64 {
    let now = cpu_ticks();
    let busy = |t: &[u64]| {
        [0, 1, 2, 5, 6]
            .iter()
            .map(|&i| t.get(i).copied().unwrap_or(0))
            .sum::<u64>()
    };
    let hz = unsafe { libc::sysconf(libc::_SC_CLK_TCK) }.max(1) as f64;
    (busy(&now) - busy(before)) as f64 * 1e9 / hz
}

impl StealMeter {
    fn read() -> (u64, u64) {
        let cpu = cpu_ticks();
        (cpu.get(7).copied().unwrap_or(0), cpu.iter().sum())
    }

    pub fn start() -> StealMeter {
        let (steal, total) = StealMeter::read();
        StealMeter { steal, total }
    }

    /// The share of CPU time stolen since `start`, and a line saying
    /// whether the figures can be trusted (over 1% they cannot).
    pub fn report(&self) -> (f64, String) {
        let (steal, total) = StealMeter::read();
        let share = (steal - self.steal) as f64 / (total - self.total).max(1) as f64;
        let verdict = if share > 0.01 {
            format!(
                "WARNING: the hypervisor took {:.1}% of this VM's CPU time during the run (steal in /proc/stat): \
                 the figures above are disturbed; rerun when it is quiet",
                share * 100.0
            )
        } else {
            format!(
                "CPU steal during the run: {:.2}% (quiet enough to trust the figures)",
                share * 100.0
            )
        };
        (share, verdict)
    }
}

/// Reads what `tcp` holds into `room` (after `tcp.readable()`): `Some(n)`
/// bytes (0: the peer closed), or `None` when nothing was there. A read
/// that does not fill `room` took all there was, so it clears the
/// readiness (by answering WouldBlock, as tokio does for its own reads)
/// rather than leaving a read that only says EAGAIN for later; data that
/// comes after is a new event.
pub fn read_available(
    tcp: &tokio::net::TcpStream,
    room: &mut [u8],
) -> std::io::Result<Option<usize>> {
    use std::os::fd::AsRawFd;
    let (want, mut got) = (room.len(), 0);
    let read = tcp.try_io(tokio::io::Interest::READABLE, || {
        // SAFETY: room is valid for writes of its length.
        let n = unsafe { libc::read(tcp.as_raw_fd(), room.as_mut_ptr().cast(), want) };
        if n < 0 {
            return Err(std::io::Error::last_os_error());
        }
        got = n as usize;
        if got > 0 && got < want {
            return Err(std::io::ErrorKind::WouldBlock.into());
        }
        Ok(())
    });
    match read {
        Ok(()) => Ok(Some(got)),
        Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => Ok((got > 0).then_some(got)),
        Err(e) => Err(e),
    }
}
