//! The XDP datapath through aya: load the embedded object, write its maps,
//! attach and detach, read counters, and run packets through `TestRun`.
//!
//! Every map is reached only through the methods here, so a layout mismatch
//! between the object and rl-common fails at start-up, not at lookup.

use std::{
    error::Error as StdError,
    ffi::CString,
    fmt, io,
    net::IpAddr,
    time::{Duration, Instant},
};

use aya::{
    maps::{Array, HashMap, MapData, PerCpuArray},
    programs::{ProgramError, TestRun, TestRunOptions, Xdp, XdpMode},
    Ebpf, EbpfLoader,
};
use aya_log::EbpfLogger;
use rl_common::{
    Bucket, DatapathConfig, Key4, Key6, Stats, TickClock, MAP_CONFIG, MAP_SOURCES_V4, MAP_SOURCES_V6, MAP_STATS,
    PROG_CLOCK, PROG_FLOOR, PROG_LIMITER, STAT_COUNT, STAT_NAMES,
};
use thiserror::Error;
use tracing::warn;

use crate::compile::Compiled;

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
}

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
        };
        dp.load_program(PROG_LIMITER)?;
        dp.clock = dp.calibrate_clock()?;
        dp.set_config(&compiled.datapath)?;
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
            classify("loading the XDP program", &e)
                .unwrap_or_else(|| DatapathError::Load(format!("program {name}: {}", chain(&e))))
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

    /// Replaces the configuration the datapath reads on every packet. One map
    /// update: each packet sees the old entry or the new one. The measured
    /// tick clock is filled in here.
    pub fn set_config(&mut self, cfg: &DatapathConfig) -> Result<(), DatapathError> {
        let cfg = &cfg.with_clock(self.clock);
        let map = self
            .ebpf
            .map_mut(MAP_CONFIG)
            .ok_or_else(|| DatapathError::Load(format!("map {MAP_CONFIG} is missing")))?;
        let mut arr: Array<&mut MapData, DatapathConfig> =
            Array::try_from(map).map_err(|e| map_error(MAP_CONFIG, e))?;
        arr.set(0, cfg, 0).map_err(|e| map_error(MAP_CONFIG, e))
    }

    /// The configuration the datapath is reading now.
    pub fn config(&self) -> Result<DatapathConfig, DatapathError> {
        let map = self
            .ebpf
            .map(MAP_CONFIG)
            .ok_or_else(|| DatapathError::Load(format!("map {MAP_CONFIG} is missing")))?;
        let arr: Array<&MapData, DatapathConfig> =
            Array::try_from(map).map_err(|e| map_error(MAP_CONFIG, e))?;
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
        Ok(out)
    }

    /// Counters of each possible CPU, indexed by CPU number.
    pub fn counters_per_cpu(&self) -> Result<Vec<Counters>, DatapathError> {
        let map = self
            .ebpf
            .map(MAP_STATS)
            .ok_or_else(|| DatapathError::Load(format!("map {MAP_STATS} is missing")))?;
        let arr: PerCpuArray<&MapData, Stats> =
            PerCpuArray::try_from(map).map_err(|e| map_error(MAP_STATS, e))?;
        let values = arr.get(&0, 0).map_err(|e| map_error(MAP_STATS, e))?;
        Ok(values.iter().map(|s| Counters(s.0)).collect())
    }

    /// Every bucket the datapath holds, IPv4 then IPv6.
    pub fn sources(&self) -> Result<Vec<Source>, DatapathError> {
        let mut out = Vec::new();
        let v4: HashMap<&MapData, Key4, Bucket> = self.source_map(MAP_SOURCES_V4)?;
        for entry in v4.iter() {
            let (k, bucket) = entry.map_err(|e| map_error(MAP_SOURCES_V4, e))?;
            out.push(Source { addr: IpAddr::from(k.addr_bytes()), rule: k.rule, bucket });
        }
        let v6: HashMap<&MapData, Key6, Bucket> = self.source_map(MAP_SOURCES_V6)?;
        for entry in v6.iter() {
            let (k, bucket) = entry.map_err(|e| map_error(MAP_SOURCES_V6, e))?;
            out.push(Source { addr: IpAddr::from(k.addr_bytes()), rule: k.rule, bucket });
        }
        Ok(out)
    }

    fn source_map<K: aya::Pod>(&self, name: &'static str) -> Result<HashMap<&MapData, K, Bucket>, DatapathError> {
        let map = self
            .ebpf
            .map(name)
            .ok_or_else(|| DatapathError::Load(format!("map {name} is missing")))?;
        HashMap::try_from(map).map_err(|e| map_error(name, e))
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
