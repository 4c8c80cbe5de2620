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
    sync::Arc,
    time::{Duration, Instant},
};

use aya::maps::Array;
use aya::{
    maps::{MapData, RingBuf},
    programs::{links::FdLink, ProgramError, TestRun, TestRunOptions, Xdp},
    Ebpf, EbpfLoader,
};
use aya_log::EbpfLogger;
use rl_common::{
    DatapathConfig, RuleStats, TickClock, KNOWN_VALID, LAYOUT_VERSION, MAP_EVENTS, MAP_KNOWN,
    MAP_LAYOUT, MAP_SOURCES_V4, MAP_SOURCES_V6, PROG_CLOCK, PROG_FLOOR, PROG_LIMITER, RULE_SLOTS,
    STAT_COUNT, STAT_NAMES,
};
use thiserror::Error;
use tracing::warn;

use crate::compile::{Compiled, RuleSet};

mod attach;
mod batch;
mod bpf;
mod cells;
mod counters;
mod grace;
mod install;
mod known;
mod load;
mod moves;
mod netlink;
mod pin;
mod read;
pub mod share;

mod pressure;

pub use cells::CellArray;
pub use install::{fits, Plan};
pub use known::KnownFilter;
pub use load::{table_capacity, LoadOptions, BENCH_NEW_SOURCES, LAST_RESORT_ROOM};
pub use pin::{
    detach as detach_pinned, dirs_with as pin_dirs_with, group_name as pin_group,
    prepare as prepare_pins,
};
pub use pressure::{
    collect, collect_handing, flood_mode, FloodReading, LimitsByKey, Pass, TableMaps,
    COLLECT_IDLE_NS,
};
pub use read::{
    scan_buckets, ChargedBy, ChargedCell, ChargedCells, MapRef, Source, SourceQuota,
    CHARGED_CELLS_KEPT,
};

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
         (`ip link set dev {0} xdp off`, or with the tool that attached it) or choose another interface"
    )]
    InterfaceBusy(String),
    #[error(
        "interface `{iface}` carries rl's datapath pinned for another set of interfaces in {}: \
         to protect another set, take that one off first with `rl-control detach --iface {iface}` (it drops that datapath's buckets), then start again",
        .dir.display()
    )]
    PinnedElsewhere {
        iface: String,
        dir: std::path::PathBuf,
    },
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
    #[error("another change was installed while this one was being prepared: nothing of it was applied; send it again")]
    Stale,
    #[error(
        "the datapath pinned in {} does not fit this rl-control: {what}; keep its buckets by running the \
         rl-control and settings that pinned it, or drop it with `rl-control detach --iface {} --pin-dir {}`",
        dir.display(), dir.file_name().map_or(String::new(), |n| n.to_string_lossy().into_owned()),
        dir.parent().map_or(String::new(), |p| p.display().to_string())
    )]
    Layout {
        dir: std::path::PathBuf,
        what: String,
    },
    #[error("another rl-control is running on the datapath pinned in {}: stop it first (its pid is in its runtime directory)", .0.display())]
    Held(std::path::PathBuf),
    #[error("pinning at {}: {cause} (pins need bpffs; set [datapath] pin_dir or --pin-dir to a directory on one)", at.display())]
    Pin {
        at: std::path::PathBuf,
        cause: String,
    },
    #[error("the rule set needs {needed}{} {what} entries, more than the {capacity} a slot holds: {hint}", if *needed > *capacity as usize + 1 { "" } else { " or more" })]
    TooLarge {
        what: &'static str,
        needed: usize,
        capacity: u32,
        hint: &'static str,
    },
    #[error("test run of program {program} failed: {cause}")]
    TestRun {
        program: &'static str,
        cause: String,
    },
    #[error(
        "writing the rules failed after this build's program was attached ({0}): where it took a pinned XDP \
         link over it enforces the rule set that was pinned, buckets kept, and where it was attached afresh it \
         was detached again; fix the cause and start rl-control again"
    )]
    AfterSwap(Box<DatapathError>),
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

/// A `BPF_PROG_TEST_RUN` of `program` that failed while `doing`.
fn test_run_error(
    doing: &'static str,
    program: &'static str,
    e: impl StdError + 'static,
) -> DatapathError {
    classify(doing, &e).unwrap_or_else(|| DatapathError::TestRun {
        program,
        cause: chain(&e),
    })
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
    /// Where the limiter is attached, in attach order.
    attachments: Vec<Attachment>,
    clock: TickClock,
    /// Unix-epoch ns minus ktime ns, for epoch-aligned windows.
    epoch_offset_ns: u64,
    /// The same, as measured when the bans' ends in the active slot were
    /// converted to ktime (fresh: the wall clock may have stepped since
    /// load, and a ban ends by the wall clock).
    ban_offset_ns: u64,
    /// The slot packets read now (`None` before the first install).
    active: Option<u32>,
    /// When the last flip happened: a slot is rewritten only after packets
    /// that read the old value have surely finished.
    flipped_at: Instant,
    /// What each slot holds, to write only differences and to attribute
    /// counters to rule names.
    slots: [Arc<SlotContents>; 2],
    /// Bumped by every install: a [`Plan`] made against another one is stale.
    generation: u64,
    /// The rule ids both rule tables hold (read from the maps when adopted),
    /// each with its natural id: each rule keeps its own, and rules new to
    /// the tables get wide-cell counts of their own
    /// ([`crate::compile::part_wide_counts`]).
    held_ids: Arc<std::collections::BTreeMap<u32, u32>>,
    /// Counters of rule names from slots since rewritten.
    retired: StdHashMap<String, RuleStats>,
    /// Log₂ of each cell array's slots (sized at load).
    cell_slots_log2: u16,
    /// Possible CPUs (the per-CPU maps' width).
    cpus: usize,
    /// The pin directory, if pinned.
    pins: Option<std::path::PathBuf>,
    /// Whether the maps were adopted from an earlier process.
    adopted: bool,
    /// Adopted with a rule set in force that this process has not written
    /// over yet: the config entry as it was found. The pinned program goes
    /// on enforcing those rules until this build's replaces it, and only
    /// then are the rules written (see [`Datapath::take_over`]).
    pinned_config: Option<DatapathConfig>,
    /// Adopted: the known-keys filter's control word as found (put back,
    /// with the config entry, by a start that fails before its swap).
    pinned_known: Option<u64>,
    /// This process has swapped its program into a pinned link.
    took_over: bool,
    /// Adopted from a build without cell arrays, or from a daemon stopped
    /// before it moved that build's cells: they are in the sources' tables
    /// (see [`Datapath::move_old_cells`]).
    cells_from_tables: bool,
    /// Adopted from a build whose cells were 64 bytes (`rl_common::OldCell`),
    /// still pinned (see [`Datapath::move_old_cells`]).
    old_arrays: bool,
    /// The pinned XDP links, held once attached (pinned setups only).
    links: Vec<FdLink>,
    /// The lock on the pin directory (one daemon per pinned datapath).
    _held: Option<std::os::fd::OwnedFd>,
    /// The pins' layout version is still to be written, just before the
    /// first link is pinned ([`LoadOptions::layout_at_attach`]).
    layout_pending: bool,
    /// Tests only: the install step that fails next, after passing it
    /// this many times (see [`Datapath::fail_install_at`]).
    failpoint: Option<(&'static str, u32)>,
}

/// A slot's tables as last written. `unknown`: what the slot holds is not
/// known (an install into it failed half-way, or the maps were adopted from
/// another process), so the next install clears it whole first.
#[derive(Default)]
pub(super) struct SlotContents {
    unknown: bool,
    names: Vec<String>,
    /// The rule entries as written, indexed like `names`.
    entries: Vec<rl_common::RuleEntry>,
    l4: Vec<u32>,
    /// Sorted by CIDR.
    lpm: Vec<(crate::config::units::Cidr, u32)>,
    dir16: Vec<u32>,
    /// Sorted by key.
    decide: Vec<(u64, u32)>,
    /// The bans' trie, ends in ktime ns; sorted by CIDR.
    bans: Vec<(crate::config::units::Cidr, u64)>,
}

/// XDP programs finish within microseconds; waiting this long after a flip
/// before rewriting the old slot leaves a wide margin (and `sleep_until`
/// then waits for an RCU grace period, the kernel's bound).
const SLOT_GRACE: Duration = Duration::from_millis(20);

/// Sleeps until `t` (at once if it is past), then waits out every XDP
/// run that began before `t` (an RCU grace period, see `grace`): the waits
/// of an install, which its callers make without holding a lock (repeated
/// under it, they find the grace period done).
pub fn sleep_until(t: Instant) {
    grace::wait_until(t)
}

impl Datapath {
    /// How many instructions the verifier walked to accept the limiter
    /// (of its 1,000,000 limit): the headroom left for new datapath code.
    pub fn verified_instructions(&self) -> Option<u32> {
        self.program(PROG_LIMITER)
            .ok()?
            .info()
            .ok()?
            .verified_instruction_count()
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
        self.rule_of_id(key_rule & !7).and_then(|(_, name)| name)
    }

    /// The rule entry with `id` and its name, from the active slot, else
    /// the one it replaced.
    pub(super) fn rule_of_id(&self, id: u32) -> Option<(&rl_common::RuleEntry, Option<&str>)> {
        let active = self.active.unwrap_or(0) as usize;
        [active, active ^ 1].into_iter().find_map(|slot| {
            let c = &self.slots[slot];
            let i = c.entries.iter().position(|e| e.id == id)?;
            Some((&c.entries[i], c.names.get(i).map(String::as_str)))
        })
    }

    /// Unix-epoch ns minus ktime ns, as measured at load.
    pub fn epoch_offset_ns(&self) -> u64 {
        self.epoch_offset_ns
    }

    /// Unix-epoch ns minus ktime ns, measured now: to date a kernel time by
    /// the wall clock as it reads now (it may have stepped since load).
    pub fn wall_offset_ns() -> u64 {
        load::epoch_offset_ns()
    }

    /// The wall clock has stepped by more than a second since the bans' ends
    /// in force were converted to ktime: they end off by that much, until
    /// an install converts them again.
    pub fn ban_clock_stepped(&self) -> bool {
        let holds_bans = self
            .active
            .is_some_and(|a| !self.slots[a as usize].bans.is_empty());
        holds_bans
            && install::ban_offset(self.ban_offset_ns, load::epoch_offset_ns())
                != self.ban_offset_ns
    }

    /// The tick clock measured at load (`tick_ns` 0 if it could not be).
    pub fn clock(&self) -> TickClock {
        self.clock
    }

    /// When the next install may rewrite the inactive slot without waiting
    /// (packets that read it before the last flip are surely done): a
    /// caller that sleeps until then holds no lock while it waits.
    pub fn ready_at(&self) -> Instant {
        self.flipped_at + SLOT_GRACE
    }

    /// Whether the maps were adopted from an earlier daemon's pins.
    pub fn adopted(&self) -> bool {
        self.adopted
    }

    /// Whether the adopted pins came from a build that kept prefix cells in
    /// the sources' tables: then [`Datapath::move_old_cells`] must run
    /// before this build's program is swapped in.
    pub fn cells_in_tables(&self) -> bool {
        self.cells_from_tables
    }

    /// Whether the adopted pins hold an older build's 64-byte cell arrays:
    /// then too [`Datapath::move_old_cells`] must run before the swap.
    pub fn cells_in_old_arrays(&self) -> bool {
        self.old_arrays
    }

    /// The directory the datapath is pinned in, if it is.
    pub fn pin_dir(&self) -> Option<&std::path::Path> {
        self.pins.as_deref()
    }

    /// Where the limiter is attached, if it is.
    pub fn attachments(&self) -> &[Attachment] {
        &self.attachments
    }

    /// The interfaces this datapath was attached to that no longer run its
    /// program (detached by hand, `rl-control detach` while the daemon
    /// runs, the interface gone), each with why: what the kernel says now,
    /// not what the daemon did. One netlink query per interface.
    pub fn not_attached(&self) -> Vec<(String, String)> {
        let Some(prog) = self.program_id() else {
            return self
                .attachments
                .iter()
                .map(|a| (a.iface.clone(), "the limiter program has no id".to_string()))
                .collect();
        };
        self.attachments
            .iter()
            .filter_map(|a| {
                let why = match interface_index(&a.iface) {
                    Err(_) => "the interface is gone".to_string(),
                    Ok(index) => match netlink::xdp_programs(index) {
                        Ok(ids) if ids.contains(&prog) => return None,
                        Ok(ids) if ids.is_empty() => "it runs no XDP program".to_string(),
                        Ok(ids) => format!("it runs XDP program {ids:?}, not rl's {prog}"),
                        Err(e) => format!("asking the kernel failed: {e}"),
                    },
                };
                Some((a.iface.clone(), why))
            })
            .collect()
    }

    /// [`Datapath::not_attached`]'s interfaces as one list, each with why:
    /// `eth0 (it runs no XDP program), eth1 (the interface is gone)`.
    pub fn listed(gone: &[(String, String)]) -> String {
        gone.iter()
            .map(|(i, why)| format!("{i} ({why})"))
            .collect::<Vec<_>>()
            .join(", ")
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
    pub fn test_run_floor(
        &mut self,
        frame: &[u8],
        repeat: u32,
    ) -> Result<(u32, Duration), DatapathError> {
        if self.program(PROG_FLOOR)?.fd().is_err() {
            self.load_program(PROG_FLOOR)?;
        }
        run(self.program(PROG_FLOOR)?, PROG_FLOOR, frame, repeat)
    }
}

fn run(
    prog: &Xdp,
    name: &'static str,
    frame: &[u8],
    repeat: u32,
) -> Result<(u32, Duration), DatapathError> {
    let r = prog
        .test_run(TestRunOptions {
            data_in: Some(frame),
            repeat,
            ..TestRunOptions::new()
        })
        .map_err(|e| test_run_error("running a test packet", name, e))?;
    Ok((r.return_value, r.duration))
}

/// `CLOCK_MONOTONIC` in ns: the clock `bpf_ktime_get_ns` reads.
pub fn monotonic_ns() -> u64 {
    let mut ts = libc::timespec {
        tv_sec: 0,
        tv_nsec: 0,
    };
    unsafe { libc::clock_gettime(libc::CLOCK_MONOTONIC, &mut ts) };
    ts.tv_sec as u64 * 1_000_000_000 + ts.tv_nsec as u64
}
