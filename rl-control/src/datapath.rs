//! The XDP datapath through aya: load the embedded object, write its maps,
//! attach and detach, read counters, and run packets through `TestRun`.
//!
//! Every map is reached only through the methods here, so a layout mismatch
//! between the object and rl-common fails at start-up, not at lookup.

use std::{
    collections::HashMap as StdHashMap,
    error::Error as StdError,
    ffi::CString,
    fmt, io,
    net::IpAddr,
    time::{Duration, Instant},
};

use aya::{
    maps::{Array, HashMap, MapData, PerCpuArray, RingBuf},
    programs::{ProgramError, TestRun, TestRunOptions, Xdp, XdpMode},
    Ebpf, EbpfLoader,
};
use aya_log::EbpfLogger;
use rl_common::{
    Bucket, DatapathConfig, Key4, Key6, MAP_EVENTS, RuleEntry, RuleStats, Stats, TickClock, MAP_CONFIG,
    DIR16_LEN, MAP_DECIDE, MAP_DIR16, MAP_L4, MAP_LPM_V4, MAP_LPM_V6, MAP_RULES, MAP_RULE_STATS, MAP_SOURCES_V4,
    MAP_SOURCES_V6, MAP_STATS, RSTAT_ALLOW, RSTAT_DENY, RULE_SLOTS,
    PROG_CLOCK, PROG_FLOOR, PROG_LIMITER, STAT_COUNT, STAT_NAMES,
};
use thiserror::Error;
use tracing::warn;

use crate::compile::{Compiled, RuleSet};

/// The XDP object, built by `cargo xtask build` and embedded at compile time.
static OBJECT: &[u8] = aya::include_bytes_aligned!(env!("RL_EBPF_OBJ"));

/// How to attach to the interface.
#[derive(Clone, Copy, Debug, PartialEq, Eq, clap::ValueEnum)]
pub enum AttachMode {
    /// Native (driver) mode if the driver supports it, else skb mode with a warning.
    Auto,
    /// Native (driver) mode only: fastest, fails if the driver lacks XDP support.
    Native,
    /// Generic (skb) mode: works on any interface, runs after skb allocation.
    Skb,
}

impl fmt::Display for AttachMode {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            AttachMode::Auto => "auto",
            AttachMode::Native => "native",
            AttachMode::Skb => "skb",
        })
    }
}

const PRIVILEGE_HINT: &str =
    "run rl-control as root (or with CAP_BPF, CAP_NET_ADMIN and CAP_PERFMON)";

#[derive(Debug, Error)]
pub enum DatapathError {
    #[error("permission denied while {doing}: {PRIVILEGE_HINT}")]
    NoPrivilege { doing: &'static str },
    #[error("interface `{0}` does not exist: check the name with `ip link`")]
    UnknownInterface(String),
    #[error(
        "interface `{0}` already has an XDP program attached: remove it first \
         (`ip link set dev {0} xdp off`) or choose another interface"
    )]
    InterfaceBusy(String),
    #[error("loading the XDP object failed: {0}")]
    Load(String),
    #[error("attaching to `{iface}` in {mode} mode failed: {cause}")]
    Attach {
        iface: String,
        mode: AttachMode,
        cause: String,
    },
    #[error("map {map}: {cause}")]
    Map { map: &'static str, cause: String },
    #[error("test run of program {program} failed: {cause}")]
    TestRun { program: &'static str, cause: String },
}

/// The OS error number anywhere in an error's chain, if there is one.
fn errno(e: &(dyn StdError + 'static)) -> Option<i32> {
    let mut cur = Some(e);
    while let Some(err) = cur {
        if let Some(io) = err.downcast_ref::<io::Error>() {
            if let Some(n) = io.raw_os_error() {
                return Some(n);
            }
        }
        cur = err.source();
    }
    None
}

/// The whole chain of an error on one line.
fn chain(e: &(dyn StdError + 'static)) -> String {
    let mut out = e.to_string();
    let mut cur = e.source();
    while let Some(err) = cur {
        out.push_str(": ");
        out.push_str(&err.to_string());
        cur = err.source();
    }
    out
}

fn classify(doing: &'static str, e: &(dyn StdError + 'static)) -> Option<DatapathError> {
    matches!(errno(e), Some(libc::EPERM) | Some(libc::EACCES))
        .then_some(DatapathError::NoPrivilege { doing })
}

fn map_error(map: &'static str, e: impl StdError + 'static) -> DatapathError {
    classify("using a BPF map", &e).unwrap_or_else(|| DatapathError::Map {
        map,
        cause: chain(&e),
    })
}

/// Checks that `iface` exists in the current network namespace.
pub fn interface_index(iface: &str) -> Result<u32, DatapathError> {
    let name = CString::new(iface).map_err(|_| DatapathError::UnknownInterface(iface.into()))?;
    match unsafe { libc::if_nametoindex(name.as_ptr()) } {
        0 => Err(DatapathError::UnknownInterface(iface.into())),
        i => Ok(i),
    }
}

/// Counter values summed over all CPUs, indexed by `rl_common::STAT_*`.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Counters(pub [u64; STAT_COUNT as usize]);

impl Counters {
    pub fn get(&self, stat: u32) -> u64 {
        self.0[stat as usize]
    }

    /// `self - earlier`, counter by counter.
    pub fn since(&self, earlier: &Counters) -> Counters {
        let mut out = *self;
        for (o, e) in out.0.iter_mut().zip(earlier.0) {
            *o = o.wrapping_sub(e);
        }
        out
    }
}

impl fmt::Display for Counters {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        for (i, (name, v)) in STAT_NAMES.iter().zip(self.0).enumerate() {
            if i > 0 {
                f.write_str(" ")?;
            }
            write!(f, "{name}={v}")?;
        }
        Ok(())
    }
}

fn map_ref<'a, M>(ebpf: &'a Ebpf, name: &'static str) -> Result<M, DatapathError>
where
    M: TryFrom<&'a aya::maps::Map, Error = aya::maps::MapError>,
{
    let map = ebpf
        .map(name)
        .ok_or_else(|| DatapathError::Load(format!("map {name} is missing")))?;
    M::try_from(map).map_err(|e| map_error(name, e))
}

fn map_mut<'a, M>(ebpf: &'a mut Ebpf, name: &'static str) -> Result<M, DatapathError>
where
    M: TryFrom<&'a mut aya::maps::Map, Error = aya::maps::MapError>,
{
    let map = ebpf
        .map_mut(name)
        .ok_or_else(|| DatapathError::Load(format!("map {name} is missing")))?;
    M::try_from(map).map_err(|e| map_error(name, e))
}

/// An LPM key's data: the slot byte, then the address.
fn slot_key<const N: usize>(slot: u32, addr: &[u8]) -> [u8; N] {
    let mut data = [0u8; N];
    data[0] = slot as u8;
    data[1..].copy_from_slice(addr);
    data
}

/// Inserts (`Some`) or removes (`None`) one trie entry.
fn lpm_set<const N: usize>(
    ebpf: &mut Ebpf,
    name: &'static str,
    prefix: u32,
    data: [u8; N],
    value: Option<u32>,
) -> Result<(), DatapathError>
where
    [u8; N]: aya::Pod,
{
    use aya::maps::lpm_trie::{Key, LpmTrie};
    let mut trie: LpmTrie<&mut MapData, [u8; N], u32> = map_mut(ebpf, name)?;
    let key = Key::new(prefix, data);
    match value {
        Some(v) => trie.insert(&key, v, 0),
        None => trie.remove(&key),
    }
    .map_err(|e| map_error(name, e))
}

/// Unix-epoch time minus `CLOCK_MONOTONIC` (the clock `bpf_ktime_get_ns`
/// reads), in ns, modulo 2⁶⁴.
fn epoch_offset_ns() -> u64 {
    let mono = monotonic_ns();
    let real = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_nanos() as u64);
    real.wrapping_sub(mono)
}

/// Adds one rule's counts to the totals (shadow drops were passed).
fn add_rule_totals(c: &mut Counters, r: &RuleStats) {
    use rl_common::{STAT_DROPPED_BYTES, STAT_DROPPED_PKTS, STAT_PASSED_BYTES, STAT_PASSED_PKTS};
    c.0[STAT_PASSED_PKTS as usize] += r.passed_pkts + r.shadow_pkts;
    c.0[STAT_PASSED_BYTES as usize] += r.passed_bytes + r.shadow_bytes;
    c.0[STAT_DROPPED_PKTS as usize] += r.dropped_pkts;
    c.0[STAT_DROPPED_BYTES as usize] += r.dropped_bytes;
}

fn add_stats<'a>(into: &mut RuleStats, from: impl Iterator<Item = &'a RuleStats>) {
    for s in from {
        into.passed_pkts += s.passed_pkts;
        into.passed_bytes += s.passed_bytes;
        into.dropped_pkts += s.dropped_pkts;
        into.dropped_bytes += s.dropped_bytes;
        into.shadow_pkts += s.shadow_pkts;
        into.shadow_bytes += s.shadow_bytes;
    }
}

/// One bucket: a source (masked to its aggregation prefix) under one limit.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Source {
    pub addr: IpAddr,
    pub rule: u32,
    pub bucket: Bucket,
}

/// Load-time knobs of the XDP object.
#[derive(Clone, Copy, Debug, Default)]
pub struct LoadOptions {
    /// Benchmarks only: treat every packet as coming from a new source, to
    /// time the LRU insert path with one repeated frame.
    pub bench_new_sources: bool,
}

const GLOBAL_BENCH_NEW_SOURCES: &str = "RL_BENCH_NEW_SOURCES";

/// Where the limiter is attached.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Attachment {
    pub iface: String,
    /// The mode actually in use (never `Auto`).
    pub mode: AttachMode,
}

/// The loaded XDP object. Dropping it detaches the program and frees its maps.
pub struct Datapath {
    ebpf: Ebpf,
    attachment: Option<Attachment>,
    clock: TickClock,
    /// Unix-epoch ns minus ktime ns, for epoch-aligned windows.
    epoch_offset_ns: u64,
    /// The slot packets read now (`None` before the first install).
    active: Option<u32>,
    /// When the last flip happened: a slot is rewritten only after packets
    /// that read the old value have surely finished.
    flipped_at: Instant,
    /// What each slot holds, to write only differences and to attribute
    /// counters to rule names.
    slots: [SlotContents; 2],
    /// Counters of rule names from slots since rewritten.
    retired: StdHashMap<String, RuleStats>,
}

/// A slot's tables as last written.
#[derive(Default)]
struct SlotContents {
    names: Vec<String>,
    /// `RuleEntry::id` of each rule, indexed like `names`.
    ids: Vec<u32>,
    l4: Vec<u32>,
    lpm: Vec<(crate::units::Cidr, u32)>,
    dir16: Vec<u32>,
    decide: Vec<u64>,
}

/// XDP programs finish within microseconds; waiting this long after a flip
/// before rewriting the old slot leaves a wide margin.
const SLOT_GRACE: Duration = Duration::from_millis(20);

impl Datapath {
    /// Loads the object, sizes the source map and writes the configuration.
    /// Nothing is attached yet.
    pub fn load(compiled: &Compiled) -> Result<Datapath, DatapathError> {
        Datapath::load_with(compiled, LoadOptions::default())
    }

    /// [`Datapath::load`] with load-time knobs.
    pub fn load_with(compiled: &Compiled, opts: LoadOptions) -> Result<Datapath, DatapathError> {
        let ebpf = EbpfLoader::new()
            .map_max_entries(MAP_SOURCES_V4, compiled.max_sources)
            .map_max_entries(MAP_SOURCES_V6, compiled.max_sources)
            .override_global(GLOBAL_BENCH_NEW_SOURCES, &u32::from(opts.bench_new_sources), true)
            .load(OBJECT)
            .map_err(|e| {
                classify("loading the XDP object", &e)
                    .unwrap_or_else(|| DatapathError::Load(chain(&e)))
            })?;
        let mut dp = Datapath {
            ebpf,
            attachment: None,
            clock: TickClock::default(),
            epoch_offset_ns: 0,
            active: None,
            flipped_at: Instant::now(),
            slots: Default::default(),
            retired: StdHashMap::new(),
        };
        dp.load_program(PROG_LIMITER)?;
        dp.clock = dp.calibrate_clock()?;
        dp.epoch_offset_ns = epoch_offset_ns();
        dp.install(&compiled.rules)?;
        // Fail now, not later, if the object's maps do not match rl-common.
        dp.counters()?;
        dp.sources()?;
        Ok(dp)
    }

    fn load_program(&mut self, name: &'static str) -> Result<(), DatapathError> {
        let prog: &mut Xdp = self
            .ebpf
            .program_mut(name)
            .ok_or_else(|| DatapathError::Load(format!("program {name} is missing")))?
            .try_into()
            .map_err(|e: ProgramError| DatapathError::Load(chain(&e)))?;
        prog.load().map_err(|e| {
            // The verifier rejects unsafe programs with EACCES: that is a
            // bug in the program, not missing privileges, and its log says why.
            let text = chain(&e);
            if text.contains("erifier") && unsafe { libc::geteuid() } == 0 {
                return DatapathError::Load(format!("program {name}: {text}"));
            }
            classify("loading the XDP program", &e)
                .unwrap_or_else(|| DatapathError::Load(format!("program {name}: {text}")))
        })
    }

    fn program(&self, name: &'static str) -> Result<&Xdp, DatapathError> {
        let prog = self
            .ebpf
            .program(name)
            .ok_or_else(|| DatapathError::Load(format!("program {name} is missing")))?;
        prog.try_into()
            .map_err(|e: ProgramError| DatapathError::Load(chain(&e)))
    }

    /// Starts forwarding the program's aya-log records to the `log` crate.
    /// The caller must call [`EbpfLogger::flush`] when its fd is readable.
    pub fn take_logger(&mut self) -> Option<EbpfLogger<&'static dyn log::Log>> {
        match EbpfLogger::init(&mut self.ebpf) {
            Ok(l) => Some(l),
            Err(e) => {
                warn!("kernel-side logging is unavailable: {}", chain(&e));
                None
            }
        }
    }

    /// Takes the ring buffer of "limited" events (see [`Event`]); the
    /// caller drains it when its fd is readable.
    pub fn take_events(&mut self) -> Result<RingBuf<MapData>, DatapathError> {
        let map = self
            .ebpf
            .take_map(MAP_EVENTS)
            .ok_or_else(|| DatapathError::Load(format!("map {MAP_EVENTS} is missing")))?;
        RingBuf::try_from(map).map_err(|e| map_error(MAP_EVENTS, e))
    }

    /// The rule name of a bucket key's `rule` (`id | limit index`), looked
    /// up in both slots (an event may come from the rule set just replaced).
    pub fn rule_name_of_key(&self, key_rule: u32) -> Option<&str> {
        let id = key_rule & !7;
        let active = self.active.unwrap_or(0) as usize;
        [active, active ^ 1].into_iter().find_map(|slot| {
            let c = &self.slots[slot];
            c.ids.iter().position(|&i| i == id).and_then(|i| c.names.get(i)).map(String::as_str)
        })
    }

    /// Unix-epoch ns minus ktime ns, as measured at load.
    pub fn epoch_offset_ns(&self) -> u64 {
        self.epoch_offset_ns
    }

    /// The tick clock measured at load (`tick_ns` 0 if it could not be).
    pub fn clock(&self) -> TickClock {
        self.clock
    }

    /// Measures the kernel tick against ktime with the `rl_clock` program:
    /// the (jiffies, ktime) pairs read just after two ticks ~40 ms apart give
    /// `1e9 / HZ` and the offset between the clocks. Takes about 50 ms. If the
    /// tick cannot be measured, every limit uses ktime (slower, still exact).
    fn calibrate_clock(&mut self) -> Result<TickClock, DatapathError> {
        self.load_program(PROG_CLOCK)?;
        let prog = self.program(PROG_CLOCK)?;
        let sample = || -> Result<(u64, u64), DatapathError> {
            let frame = [0u8; 64];
            let mut out = [0u8; 64];
            prog.test_run(TestRunOptions {
                data_in: Some(&frame),
                data_out: Some(&mut out),
                ..TestRunOptions::new()
            })
            .map_err(|e| {
                classify("measuring the kernel tick", &e).unwrap_or_else(|| DatapathError::TestRun {
                    program: PROG_CLOCK,
                    cause: chain(&e),
                })
            })?;
            let word = |i: usize| u64::from_ne_bytes(out[i..i + 8].try_into().expect("8 bytes"));
            Ok((word(0), word(8)))
        };
        // The first reading after jiffies change: within a few µs of the tick.
        let edge = || -> Result<Option<(u64, u64)>, DatapathError> {
            let start = Instant::now();
            let (j0, _) = sample()?;
            while start.elapsed() < Duration::from_millis(200) {
                let s = sample()?;
                if s.0 != j0 {
                    return Ok(Some(s));
                }
            }
            Ok(None)
        };
        let first = edge()?;
        std::thread::sleep(Duration::from_millis(40));
        let second = edge()?;
        match first.zip(second).and_then(|(a, b)| TickClock::from_edges(a, b)) {
            Some(clock) => {
                tracing::debug!(tick_ns = clock.tick_ns, "kernel tick measured");
                Ok(clock)
            }
            None => {
                warn!("could not measure the kernel tick; every limit reads bpf_ktime_get_ns (exact, a little slower)");
                Ok(TickClock::default())
            }
        }
    }

    /// Makes `rules` the active rule set: writes every table of the inactive
    /// slot, then flips `slot` in the config entry with one map write, so
    /// each packet sees the old rule set or the new one, never a mix, and
    /// there is no instant without limits. Buckets are keyed by rule ids that
    /// only change when a rule does, so unchanged rules keep their state.
    pub fn install(&mut self, rules: &RuleSet) -> Result<(), DatapathError> {
        let slot = self.active.map_or(0, |s| s ^ 1);
        let since = self.flipped_at.elapsed();
        if since < SLOT_GRACE {
            std::thread::sleep(SLOT_GRACE - since);
        }
        let base = slot * RULE_SLOTS;

        // Counters of the rules this slot held go to their names' totals.
        let old = std::mem::take(&mut self.slots[slot as usize]);
        {
            let mut stats: PerCpuArray<&mut MapData, RuleStats> = map_mut(&mut self.ebpf, MAP_RULE_STATS)?;
            let cpus = aya::util::nr_cpus().map_err(|(_, e)| map_error(MAP_RULE_STATS, e))?;
            let zero = || {
                aya::maps::PerCpuValues::try_from(vec![RuleStats::default(); cpus]).map_err(|e| map_error(MAP_RULE_STATS, e))
            };
            for (i, name) in old.names.iter().enumerate() {
                let idx = base + i as u32;
                let per_cpu = stats.get(&idx, 0).map_err(|e| map_error(MAP_RULE_STATS, e))?;
                add_stats(self.retired.entry(name.clone()).or_default(), per_cpu.iter());
                stats.set(idx, zero()?, 0).map_err(|e| map_error(MAP_RULE_STATS, e))?;
            }
        }

        let entries: Vec<RuleEntry> = rules
            .entries
            .iter()
            .map(|e| {
                let mut e = *e;
                for l in e.limits.iter_mut() {
                    *l = l.with_clock(&self.clock);
                }
                e.pool = e.pool.with_clock(&self.clock);
                e
            })
            .collect();
        let keys: Vec<u32> = (0..entries.len() as u32).map(|i| base + i).collect();
        update_batch(self.array_fd(MAP_RULES)?, &keys, &entries).map_err(|e| map_error(MAP_RULES, e))?;

        let l4_base = slot * rl_common::L4_SLOT_LEN;
        self.write_u32_diff(MAP_L4, l4_base, &old.l4, &rules.l4)?;

        // Trie first, then the first level that points into it.
        for (c, _) in &old.lpm {
            self.lpm_write(slot, c, None)?;
        }
        for (c, v) in &rules.lpm {
            self.lpm_write(slot, c, Some(*v))?;
        }
        self.write_u32_diff(MAP_DIR16, slot * DIR16_LEN, &old.dir16, &rules.dir16)?;

        let mut decide: HashMap<&mut MapData, u64, u32> = map_mut(&mut self.ebpf, MAP_DECIDE)?;
        for k in &old.decide {
            let _ = decide.remove(k);
        }
        let mut keys = Vec::with_capacity(rules.decide.len());
        for ((l4c, srcc), rule) in &rules.decide {
            let k = rl_common::decide_key(slot, *l4c, *srcc);
            decide.insert(k, rule, 0).map_err(|e| map_error(MAP_DECIDE, e))?;
            keys.push(k);
        }

        let cfg = DatapathConfig {
            clock: self.clock,
            epoch_offset_ns: self.epoch_offset_ns,
            enabled: 1,
            slot,
            flags: rules.flags,
            _pad: 0,
        };
        let mut config: Array<&mut MapData, DatapathConfig> = map_mut(&mut self.ebpf, MAP_CONFIG)?;
        config.set(0, cfg, 0).map_err(|e| map_error(MAP_CONFIG, e))?;
        self.active = Some(slot);
        self.flipped_at = Instant::now();
        self.slots[slot as usize] = SlotContents {
            names: rules.names.clone(),
            ids: rules.entries.iter().map(|e| e.id).collect(),
            l4: rules.l4.clone(),
            lpm: rules.lpm.clone(),
            dir16: rules.dir16.clone(),
            decide: keys,
        };
        Ok(())
    }

    /// Writes the entries of a `u32` array at `base..` where `new` differs
    /// from `old` (missing entries are 0), in one batched syscall: a rule
    /// for "any UDP port" changes 65,536 entries, and one syscall each took
    /// about 100 ms.
    fn write_u32_diff(&mut self, name: &'static str, base: u32, old: &[u32], new: &[u32]) -> Result<(), DatapathError> {
        let len = old.len().max(new.len());
        let (mut keys, mut values) = (Vec::new(), Vec::new());
        for i in 0..len {
            let v = new.get(i).copied().unwrap_or(0);
            if old.get(i).copied().unwrap_or(0) != v {
                keys.push(base + i as u32);
                values.push(v);
            }
        }
        if keys.is_empty() {
            return Ok(());
        }
        update_batch(self.array_fd(name)?, &keys, &values).map_err(|e| map_error(name, e))
    }

    /// The fd of the array map `name`, for batched writes.
    fn array_fd(&self, name: &'static str) -> Result<std::os::fd::RawFd, DatapathError> {
        use std::os::fd::{AsFd, AsRawFd};
        match self.ebpf.map(name) {
            Some(aya::maps::Map::Array(data)) => Ok(data.fd().as_fd().as_raw_fd()),
            _ => Err(DatapathError::Load(format!("map {name} is missing or not an array"))),
        }
    }

    fn lpm_write(&mut self, slot: u32, c: &crate::units::Cidr, value: Option<u32>) -> Result<(), DatapathError> {
        let prefix = 8 + c.len as u32;
        match c.addr {
            IpAddr::V4(a) => lpm_set(&mut self.ebpf, MAP_LPM_V4, prefix, slot_key::<5>(slot, &a.octets()), value),
            IpAddr::V6(a) => lpm_set(&mut self.ebpf, MAP_LPM_V6, prefix, slot_key::<17>(slot, &a.octets()), value),
        }
    }

    /// Packets and bytes per rule name (plus `allow` and `deny`), summed
    /// over CPUs and over every rule set the name has been in since load.
    pub fn rule_stats(&self) -> Result<std::collections::BTreeMap<String, RuleStats>, DatapathError> {
        let stats: PerCpuArray<&MapData, RuleStats> = map_ref(&self.ebpf, MAP_RULE_STATS)?;
        let mut out: std::collections::BTreeMap<String, RuleStats> =
            self.retired.iter().map(|(k, v)| (k.clone(), *v)).collect();
        // Both slots: the inactive one keeps its counts until it is rewritten.
        for slot in 0..2u32 {
            for (i, name) in self.slots[slot as usize].names.iter().enumerate() {
                let per_cpu = stats.get(&(slot * RULE_SLOTS + i as u32), 0).map_err(|e| map_error(MAP_RULE_STATS, e))?;
                add_stats(out.entry(name.clone()).or_default(), per_cpu.iter());
            }
        }
        for (name, idx) in [("allow", RSTAT_ALLOW), ("deny", RSTAT_DENY)] {
            let per_cpu = stats.get(&idx, 0).map_err(|e| map_error(MAP_RULE_STATS, e))?;
            add_stats(out.entry(name.to_string()).or_default(), per_cpu.iter());
        }
        Ok(out)
    }

    /// Rule `index` (0 = `[default]`) of the active rule set, as the
    /// datapath reads it.
    pub fn active_rule(&self, index: u32) -> Result<RuleEntry, DatapathError> {
        let arr: Array<&MapData, RuleEntry> = map_ref(&self.ebpf, MAP_RULES)?;
        arr.get(&(self.active.unwrap_or(0) * RULE_SLOTS + index), 0)
            .map_err(|e| map_error(MAP_RULES, e))
    }

    /// The configuration the datapath is reading now.
    pub fn config(&self) -> Result<DatapathConfig, DatapathError> {
        let arr: Array<&MapData, DatapathConfig> = map_ref(&self.ebpf, MAP_CONFIG)?;
        arr.get(&0, 0).map_err(|e| map_error(MAP_CONFIG, e))
    }

    /// Attaches the limiter to `iface`. In `Auto` mode, native is tried first;
    /// if the driver refuses it, skb mode is used and a warning says so.
    pub fn attach(&mut self, iface: &str, mode: AttachMode) -> Result<Attachment, DatapathError> {
        interface_index(iface)?;
        let used = match mode {
            AttachMode::Auto => match self.attach_as(iface, AttachMode::Native) {
                Ok(()) => AttachMode::Native,
                Err(e @ (DatapathError::InterfaceBusy(_) | DatapathError::NoPrivilege { .. })) => {
                    return Err(e)
                }
                Err(e) => {
                    warn!("native XDP is unavailable on {iface} ({e}); using skb (generic) mode, which is slower");
                    self.attach_as(iface, AttachMode::Skb)?;
                    AttachMode::Skb
                }
            },
            m => {
                self.attach_as(iface, m)?;
                m
            }
        };
        let a = Attachment {
            iface: iface.to_string(),
            mode: used,
        };
        self.attachment = Some(a.clone());
        Ok(a)
    }

    fn attach_as(&mut self, iface: &str, mode: AttachMode) -> Result<(), DatapathError> {
        let flags = match mode {
            AttachMode::Native => XdpMode::Driver,
            AttachMode::Skb => XdpMode::Skb,
            AttachMode::Auto => unreachable!("auto is resolved by attach"),
        };
        let prog: &mut Xdp = self
            .ebpf
            .program_mut(PROG_LIMITER)
            .expect("loaded in Datapath::load")
            .try_into()
            .expect("an XDP program");
        prog.attach(iface, flags).map(|_| ()).map_err(|e| match errno(&e) {
            Some(libc::EBUSY) | Some(libc::EEXIST) => DatapathError::InterfaceBusy(iface.into()),
            Some(libc::EPERM) | Some(libc::EACCES) => DatapathError::NoPrivilege {
                doing: "attaching the XDP program",
            },
            _ => match e {
                ProgramError::UnknownInterface { .. } => DatapathError::UnknownInterface(iface.into()),
                e => DatapathError::Attach {
                    iface: iface.into(),
                    mode,
                    cause: chain(&e),
                },
            },
        })
    }

    /// Where the limiter is attached, if it is.
    pub fn attachment(&self) -> Option<&Attachment> {
        self.attachment.as_ref()
    }

    /// Counters summed over all CPUs.
    pub fn counters(&self) -> Result<Counters, DatapathError> {
        let mut out = Counters::default();
        for cpu in self.counters_per_cpu()? {
            for (o, v) in out.0.iter_mut().zip(cpu.0) {
                *o += v;
            }
        }
        // Counts of rule sets since replaced (their map entries were reset).
        for r in self.retired.values() {
            add_rule_totals(&mut out, r);
        }
        Ok(out)
    }

    /// Counters of each possible CPU, indexed by CPU number.
    pub fn counters_per_cpu(&self) -> Result<Vec<Counters>, DatapathError> {
        let arr: PerCpuArray<&MapData, Stats> = map_ref(&self.ebpf, MAP_STATS)?;
        let values = arr.get(&0, 0).map_err(|e| map_error(MAP_STATS, e))?;
        let mut out: Vec<Counters> = values.iter().map(|s| Counters(s.0)).collect();
        // IP packets are counted once, in their rule's entry: add them all.
        let rules: PerCpuArray<&MapData, RuleStats> = map_ref(&self.ebpf, MAP_RULE_STATS)?;
        // Entries in use (the others are zero: `install` retires and
        // clears a slot's counters before rewriting it).
        let used = (0..2u32)
            .flat_map(|slot| (0..self.slots[slot as usize].names.len() as u32).map(move |i| slot * RULE_SLOTS + i))
            .chain([RSTAT_ALLOW, RSTAT_DENY]);
        for idx in used {
            let per_cpu = rules.get(&idx, 0).map_err(|e| map_error(MAP_RULE_STATS, e))?;
            for (o, r) in out.iter_mut().zip(per_cpu.iter()) {
                add_rule_totals(o, r);
            }
        }
        Ok(out)
    }

    /// Every bucket the datapath holds, IPv4 then IPv6.
    pub fn sources(&self) -> Result<Vec<Source>, DatapathError> {
        scan_buckets(self.source_map_ids()?)
    }

    /// The quota of `addr` under every limit of the active rule set in which
    /// it has a bucket (rule index, limit index, quota), as HTTP rate-limit
    /// headers would state it. For limits on the tick clock the datapath's
    /// time trails ktime by up to one tick, so waits are lengthened by a
    /// tick: a client that waits `retry_after` is never early.
    pub fn source_quotas(&self, addr: IpAddr) -> Result<Vec<(u32, u32, rl_common::Quota)>, DatapathError> {
        let Some(slot) = self.active else { return Ok(Vec::new()) };
        let names = &self.slots[slot as usize].names;
        let rules: Array<&MapData, RuleEntry> = map_ref(&self.ebpf, MAP_RULES)?;
        let v4: HashMap<&MapData, Key4, Bucket> = map_ref(&self.ebpf, MAP_SOURCES_V4)?;
        let v6: HashMap<&MapData, Key6, Bucket> = map_ref(&self.ebpf, MAP_SOURCES_V6)?;
        let now = monotonic_ns();
        let mut out = Vec::new();
        for i in 0..names.len() as u32 {
            let rule = rules.get(&(slot * RULE_SLOTS + i), 0).map_err(|e| map_error(MAP_RULES, e))?;
            for which in 0..rule.n_limits.min(rl_common::MAX_LIMITS as u32) {
                let bucket = match addr {
                    IpAddr::V4(a) => v4.get(&rule.key4(which, u32::from_ne_bytes(a.octets())), 0).ok(),
                    IpAddr::V6(a) => {
                        let o = a.octets();
                        let words = [0, 4, 8, 12].map(|j| u32::from_ne_bytes([o[j], o[j + 1], o[j + 2], o[j + 3]]));
                        v6.get(&rule.key6(which, &words), 0).ok()
                    }
                };
                let Some(bucket) = bucket else { continue };
                let limit = &rule.limits[which as usize];
                let mut q = rl_common::quota(limit, bucket.tat_ns, now, self.epoch_offset_ns);
                if limit.kind & rl_common::LIMIT_COARSE != 0 {
                    let tick = self.clock.tick_ns;
                    q.retry_after_ns += if q.retry_after_ns > 0 { tick } else { 0 };
                    q.reset_ns += if q.reset_ns > 0 { tick } else { 0 };
                }
                out.push((i, which, q));
            }
        }
        Ok(out)
    }

    /// The name of rule `index` in the active rule set.
    pub fn rule_name(&self, index: u32) -> Option<&str> {
        self.slots[self.active? as usize].names.get(index as usize).map(String::as_str)
    }

    /// The kernel ids of the source maps (IPv4, IPv6), for [`scan_buckets`].
    pub fn source_map_ids(&self) -> Result<(u32, u32), DatapathError> {
        let id = |name: &'static str| -> Result<u32, DatapathError> {
            match self.ebpf.map(name) {
                Some(aya::maps::Map::LruHashMap(d)) => Ok(d.info().map_err(|e| map_error(name, e))?.id()),
                _ => Err(DatapathError::Load(format!("map {name} is missing or not an LRU hash"))),
            }
        };
        Ok((id(MAP_SOURCES_V4)?, id(MAP_SOURCES_V6)?))
    }

    /// The kernel's id of the limiter program (as `bpftool prog` shows it).
    pub fn program_id(&self) -> Option<u32> {
        self.program(PROG_LIMITER).ok()?.info().ok().map(|i| i.id())
    }

    /// Runs `frame` through the limiter `repeat` times with
    /// `BPF_PROG_TEST_RUN`: returns the last verdict and the mean time per run.
    pub fn test_run(&self, frame: &[u8], repeat: u32) -> Result<(u32, Duration), DatapathError> {
        run(self.program(PROG_LIMITER)?, PROG_LIMITER, frame, repeat)
    }

    /// Like [`Datapath::test_run`] for the bare `XDP_DROP` program, the floor
    /// every benchmark is compared with.
    pub fn test_run_floor(&mut self, frame: &[u8], repeat: u32) -> Result<(u32, Duration), DatapathError> {
        if self.program(PROG_FLOOR)?.fd().is_err() {
            self.load_program(PROG_FLOOR)?;
        }
        run(self.program(PROG_FLOOR)?, PROG_FLOOR, frame, repeat)
    }
}

fn run(prog: &Xdp, name: &'static str, frame: &[u8], repeat: u32) -> Result<(u32, Duration), DatapathError> {
    let r = prog
        .test_run(TestRunOptions {
            data_in: Some(frame),
            repeat,
            ..TestRunOptions::new()
        })
        .map_err(|e| {
            classify("running a test packet", &e).unwrap_or_else(|| DatapathError::TestRun {
                program: name,
                cause: chain(&e),
            })
        })?;
    Ok((r.return_value, r.duration))
}

/// `CLOCK_MONOTONIC` in ns: the clock `bpf_ktime_get_ns` reads.
pub fn monotonic_ns() -> u64 {
    let mut ts = libc::timespec { tv_sec: 0, tv_nsec: 0 };
    unsafe { libc::clock_gettime(libc::CLOCK_MONOTONIC, &mut ts) };
    ts.tv_sec as u64 * 1_000_000_000 + ts.tv_nsec as u64
}

/// Every bucket in the source maps with these ids, IPv4 then IPv6, through
/// handles of the caller's own (a walk of a million buckets never needs a
/// [`Datapath`] or its lock), with one `BPF_MAP_LOOKUP_BATCH` per 16,384
/// buckets.
pub fn scan_buckets(ids: (u32, u32)) -> Result<Vec<Source>, DatapathError> {
    use std::os::fd::{AsFd, AsRawFd};
    fn scan<K: aya::Pod + Default>(id: u32, name: &'static str) -> Result<Vec<(K, Bucket)>, DatapathError> {
        let data = MapData::from_id(id).map_err(|e| map_error(name, e))?;
        // The kernel writes key_size and value_size bytes per entry into
        // our buffers: they must be exactly K and Bucket.
        let info = data.info().map_err(|e| map_error(name, e))?;
        let sizes = (info.key_size() as usize, info.value_size() as usize);
        if sizes != (std::mem::size_of::<K>(), std::mem::size_of::<Bucket>()) {
            return Err(DatapathError::Load(format!(
                "map {name} has {}-byte keys and {}-byte values, rl-common expects {} and {}: rebuild both with `cargo xtask build`",
                sizes.0,
                sizes.1,
                std::mem::size_of::<K>(),
                std::mem::size_of::<Bucket>()
            )));
        }
        let fd = data.fd().as_fd().as_raw_fd();
        lookup_batch::<K, Bucket>(fd).map_err(|e| map_error(name, e))
    }
    let v4 = scan::<Key4>(ids.0, MAP_SOURCES_V4)?;
    let v6 = scan::<Key6>(ids.1, MAP_SOURCES_V6)?;
    Ok(v4
        .into_iter()
        .map(|(k, bucket)| Source { addr: IpAddr::from(k.addr_bytes()), rule: k.rule, bucket })
        .chain(v6.into_iter().map(|(k, bucket)| Source { addr: IpAddr::from(k.addr_bytes()), rule: k.rule, bucket }))
        .collect())
}

/// The attribute block of the batch commands (`union bpf_attr`'s `batch`).
#[repr(C)]
#[derive(Default)]
struct BatchAttr {
    in_batch: u64,
    out_batch: u64,
    keys: u64,
    values: u64,
    count: u32,
    map_fd: u32,
    elem_flags: u64,
    flags: u64,
}

fn bpf_batch(cmd: libc::c_long, attr: &mut BatchAttr) -> std::io::Result<()> {
    let rc = unsafe { libc::syscall(libc::SYS_bpf, cmd, attr as *mut BatchAttr, std::mem::size_of::<BatchAttr>() as u32) };
    if rc != 0 {
        return Err(std::io::Error::last_os_error());
    }
    Ok(())
}

/// `BPF_MAP_LOOKUP_BATCH` over a whole hash map.
fn lookup_batch<K: aya::Pod + Default, V: aya::Pod + Default>(fd: std::os::fd::RawFd) -> std::io::Result<Vec<(K, V)>> {
    const BPF_MAP_LOOKUP_BATCH: libc::c_long = 24;
    const CHUNK: usize = 16_384;
    let mut out = Vec::new();
    let (mut keys, mut values) = (vec![K::default(); CHUNK], vec![V::default(); CHUNK]);
    let (mut token_in, mut token_out) = (0u64, 0u64);
    let mut first = true;
    loop {
        let mut attr = BatchAttr {
            in_batch: if first { 0 } else { &token_in as *const u64 as u64 },
            out_batch: &mut token_out as *mut u64 as u64,
            keys: keys.as_mut_ptr() as u64,
            values: values.as_mut_ptr() as u64,
            count: CHUNK as u32,
            map_fd: fd as u32,
            ..Default::default()
        };
        let r = bpf_batch(BPF_MAP_LOOKUP_BATCH, &mut attr);
        let n = attr.count as usize;
        out.extend(keys[..n].iter().copied().zip(values[..n].iter().copied()));
        match r {
            Ok(()) => {}
            Err(e) if e.raw_os_error() == Some(libc::ENOENT) => return Ok(out),
            Err(e) => return Err(e),
        }
        token_in = token_out;
        first = false;
    }
}

/// `BPF_MAP_UPDATE_BATCH` of an array's `u32` keys and their values (aya
/// 0.14 has no batch API). Arrays accept batches since Linux 5.6.
fn update_batch<V: aya::Pod>(fd: std::os::fd::RawFd, keys: &[u32], values: &[V]) -> std::io::Result<()> {
    assert_eq!(keys.len(), values.len());
    const BPF_MAP_UPDATE_BATCH: libc::c_long = 26;
    let mut done = 0;
    while done < keys.len() {
        let mut attr = BatchAttr {
            keys: keys[done..].as_ptr() as u64,
            values: values[done..].as_ptr() as u64,
            count: (keys.len() - done) as u32,
            map_fd: fd as u32,
            ..Default::default()
        };
        bpf_batch(BPF_MAP_UPDATE_BATCH, &mut attr)?;
        // The kernel reports how many it wrote in `count`.
        if attr.count == 0 {
            return Err(std::io::Error::other("the kernel wrote no entries"));
        }
        done += attr.count as usize;
    }
    Ok(())
}
