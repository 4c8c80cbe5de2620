//! Loading: the embedded object with its maps sized, pinned or adopted
//! (`pin::check` first), the configuration and the own buckets' cap
//! written, the programs loaded and the kernel tick measured.

use super::*;

/// Unix-epoch time minus `CLOCK_MONOTONIC` (the clock `bpf_ktime_get_ns`
/// reads), in ns, modulo 2⁶⁴.
pub(super) fn epoch_offset_ns() -> u64 {
    let mono = monotonic_ns();
    let real = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_nanos() as u64);
    real.wrapping_sub(mono)
}

/// Load-time knobs of the XDP object.
#[derive(Clone, Debug, Default)]
pub struct LoadOptions {
    /// Benchmarks only: salt every packet's source with a per-CPU counter
    /// under this mask, to time paths over many sources with one repeated
    /// frame ([`BENCH_NEW_SOURCES`]: a new source every packet; `0xffff`:
    /// 65,536 sources in turn). 0: off.
    pub bench_salt_mask: u32,
    /// Pin the maps (and, once attached, the link) in this directory on a
    /// bpffs (`<pin_dir>/<iface>`, see [`prepare_pins`]); adopt what is
    /// pinned there already. `None`: nothing outlives the `Datapath`.
    pub pin: Option<std::path::PathBuf>,
    /// Tests only: leave the kernel tick unmeasured, as when its
    /// measurement fails; every clock then reads `bpf_ktime_get_ns`.
    pub without_tick: bool,
    /// Pinned afresh: write the pins' layout version (what tells a later
    /// start that a datapath was in force here, to adopt) just before the
    /// first link is pinned, not at load. The daemon's way: a start killed
    /// between its load and its attach leaves pins the next start clears,
    /// whatever its settings. (Without it, a load alone is adoptable, as
    /// tests and tools that never attach need.)
    pub layout_at_attach: bool,
}

const GLOBAL_BENCH_SALT_MASK: &str = "RL_BENCH_SALT_MASK";

/// [`LoadOptions::bench_salt_mask`] for a new source every packet.
pub const BENCH_NEW_SOURCES: u32 = u32::MAX;

/// Room in each family's bucket table for last resorts: both slots' rules,
/// four limits and a pool each.
pub const LAST_RESORT_ROOM: u32 = 2 * RULE_SLOTS * 5;

/// Entries of each family's bucket table: the sources' own buckets and the
/// last resorts share it (see `rl_common::pressure`). It keeps the room of
/// `flood_prefixes` too: the prefix cells lived here before they had arrays
/// of their own (`rl_common::cells`), and tables pinned then stay adoptable.
pub fn table_capacity(c: &Compiled) -> u32 {
    c.max_sources
        .saturating_add(c.flood_prefixes)
        .saturating_add(LAST_RESORT_ROOM)
}

/// The maps sized at load: the sources' tables and the cell arrays (of
/// `cell_slots` each).
fn sized_maps(compiled: &Compiled, cell_slots: u32) -> [(&'static str, u32); 6] {
    let capacity = table_capacity(compiled);
    [
        (MAP_SOURCES_V4, capacity),
        (MAP_SOURCES_V6, capacity),
        (rl_common::MAP_CELLS_V4, cell_slots),
        (rl_common::MAP_CELLS_V6, cell_slots),
        (rl_common::MAP_CELL_KEYS_V4, cell_slots),
        (rl_common::MAP_CELL_KEYS_V6, cell_slots),
    ]
}

/// What the pins in a directory hold, worked out before anything is
/// loaded or pinned beside them, so that a refusal leaves them as they
/// were.
#[derive(Default)]
struct PinPlan {
    /// Pins of this layout are there: adopt them.
    adopted: bool,
    /// The pinned rule set's config, when one is in force.
    pinned: Option<DatapathConfig>,
    /// The cells are still in the sources' tables (RL_CELLN is pinned only
    /// once they are in the arrays, see `move_old_cells`: a daemon stopped
    /// before that moves them again).
    cells_from_tables: bool,
    /// 64-byte cell arrays are pinned (unpinned once moved, see `cells_moved`).
    old_arrays: bool,
}

impl PinPlan {
    fn of(
        dir: &std::path::Path,
        specs: &[pin::MapSpec],
        compiled: &Compiled,
    ) -> Result<PinPlan, DatapathError> {
        let adopted = pin::check(dir, specs)?;
        if !adopted {
            return Ok(PinPlan::default());
        }
        // max_sources and flood_prefixes size the tables, which another
        // pair can size alike: the pinned cap of own buckets tells.
        if let Some(cap) =
            pin::owned_cap(dir)?.filter(|&c| c != 0 && c != u64::from(compiled.max_sources))
        {
            return Err(DatapathError::Layout {
                dir: dir.to_path_buf(),
                what: format!("the datapath was made with max_sources = {cap}, this configuration says {} (datapath.max_sources changed?)", compiled.max_sources),
            });
        }
        let pinned = pin::config(dir)?.filter(|c| c.enabled != 0);
        if let Some(cfg) = &pinned {
            cells_fit(cfg, &compiled.rules.tuning).map_err(|what| DatapathError::Layout {
                dir: dir.to_path_buf(),
                what,
            })?;
        }
        Ok(PinPlan {
            adopted,
            pinned,
            cells_from_tables: !dir.join(rl_common::MAP_CELL_COUNT).exists(),
            old_arrays: [rl_common::MAP_OLD_CELLS_V4, rl_common::MAP_OLD_CELLS_V6]
                .iter()
                .any(|n| dir.join(n).exists()),
        })
    }
}

/// The object loaded with its maps sized and, with pins, pinned or adopted
/// by name (the cell count only once the cells are in the arrays).
fn load_object(
    sized: &[(&str, u32)],
    specs: &[pin::MapSpec],
    opts: &LoadOptions,
    plan: &PinPlan,
) -> Result<Ebpf, DatapathError> {
    let bench = opts.bench_salt_mask;
    let mut loader = EbpfLoader::new();
    for (name, n) in sized {
        loader.map_max_entries(name, *n);
    }
    loader.override_global(GLOBAL_BENCH_SALT_MASK, &bench, true);
    if let Some(dir) = &opts.pin {
        for s in specs {
            if !(plan.cells_from_tables && s.name == rl_common::MAP_CELL_COUNT) {
                loader.map_pin_path(s.name.as_str(), dir.join(&s.name));
            }
        }
    }
    loader.load(OBJECT).map_err(|e| {
        classify("loading the XDP object", &e).unwrap_or_else(|| DatapathError::Load(chain(&e)))
    })
}

impl Datapath {
    /// Loads the object, sizes the source map and writes the configuration.
    /// Nothing is attached yet.
    pub fn load(compiled: &Compiled) -> Result<Datapath, DatapathError> {
        Datapath::load_with(compiled, LoadOptions::default())
    }

    /// [`Datapath::load`] with load-time knobs. Pins that hold a rule set
    /// in force are adopted without writing a rule: only this process's
    /// settings go into their config entry, and the pinned rules stay in
    /// force until an install ([`Datapath::take_over`] makes it after its
    /// swap).
    pub fn load_with(compiled: &Compiled, opts: LoadOptions) -> Result<Datapath, DatapathError> {
        let cell_slots = rl_common::cell_slots(compiled.flood_prefixes);
        let sized = sized_maps(compiled, cell_slots);
        let specs = pin::specs(OBJECT, &sized)?;
        let held = opts.pin.as_deref().map(pin::hold).transpose()?;
        if let Some(dir) = &opts.pin {
            if pin::clear_interrupted(dir)? {
                tracing::warn!(pins = %dir.display(), "removed the pins of a start that was stopped before its datapath was in force (no link, no layout version): starting afresh, no bucket lost");
            }
        }
        let plan = match &opts.pin {
            Some(dir) => PinPlan::of(dir, &specs, compiled)?,
            None => PinPlan::default(),
        };
        let fresh = opts.pin.clone().filter(|_| !plan.adopted);
        // The lock outlives a failed load until its pins are gone: another
        // start must not adopt them meanwhile (a duplicate holds the flock).
        let still_held = held.as_ref().and_then(|fd| fd.try_clone().ok());
        let loaded =
            Datapath::load_planned(compiled, &opts, &sized, &specs, plan, cell_slots, held);
        if let (Err(_), Some(dir)) = (&loaded, &fresh) {
            // Nothing was in force there before: leave no pins that the next
            // start would take for a datapath to keep.
            let _ = pin::remove_pins(dir);
        }
        drop(still_held);
        loaded
    }

    /// [`Datapath::load_with`] once the pins are held and planned.
    fn load_planned(
        compiled: &Compiled,
        opts: &LoadOptions,
        sized: &[(&str, u32)],
        specs: &[pin::MapSpec],
        plan: PinPlan,
        cell_slots: u32,
        held: Option<std::os::fd::OwnedFd>,
    ) -> Result<Datapath, DatapathError> {
        let ebpf = load_object(sized, specs, opts, &plan)?;
        let mut dp = Datapath {
            ebpf,
            attachments: Vec::new(),
            clock: TickClock::default(),
            epoch_offset_ns: 0,
            ban_offset_ns: epoch_offset_ns(),
            active: None,
            flipped_at: Instant::now(),
            slots: Default::default(),
            generation: 0,
            held_ids: Default::default(),
            retired: StdHashMap::new(),
            cell_slots_log2: cell_slots.trailing_zeros() as u16,
            cpus: aya::util::nr_cpus()
                .map_err(|(_, e)| DatapathError::Load(format!("cannot count the CPUs: {e}")))?,
            pins: opts.pin.clone(),
            adopted: plan.adopted,
            pinned_config: None,
            pinned_known: None,
            took_over: false,
            cells_from_tables: plan.cells_from_tables,
            old_arrays: plan.old_arrays,
            links: Vec::new(),
            _held: held,
            layout_pending: opts.layout_at_attach && opts.pin.is_some() && !plan.adopted,
            failpoint: None,
        };
        dp.seed_cells()?;
        dp.load_program(PROG_LIMITER)?;
        // Adopted, the pinned clock is kept for good: one measured again
        // reads up to a tick (more if this start was preempted at the
        // tick's edge) from it, or switches between ticks and ktime, and a
        // clock that steps back moves window limits into the window before
        // (README, "Restarts").
        dp.clock = match &plan.pinned {
            Some(p) => p.clock,
            None if !opts.without_tick => dp.calibrate_clock()?,
            None => TickClock::default(),
        };
        // Adopted, window limits count in windows of the wall clock as the
        // pinned offset placed them: a clock stepped since would move every
        // window (a fixed one would read as a new one).
        dp.epoch_offset_ns = plan
            .pinned
            .as_ref()
            .map_or_else(epoch_offset_ns, |p| p.epoch_offset_ns);
        if plan.adopted {
            // The running program reads the active slot; what either slot
            // holds is not known here, so the install clears before writing.
            dp.active = plan.pinned.as_ref().map(|p| p.slot_flags().0);
            dp.slots = [
                Arc::new(SlotContents {
                    unknown: true,
                    ..Default::default()
                }),
                Arc::new(SlotContents {
                    unknown: true,
                    ..Default::default()
                }),
            ];
            dp.held_ids = Arc::new(dp.read_held_ids()?);
        }
        if plan.pinned.is_none() {
            dp.install(&compiled.rules)?;
        }
        dp.first_writes(compiled, opts.pin.is_some())?;
        if let Some(p) = plan.pinned {
            // The pinned program reads the pinned rules until this build's
            // replaces it: no rule is written before then
            // (`Datapath::take_over`). Last: a failure above leaves the
            // config entry as it was.
            dp.refresh_config(&p, &compiled.rules.tuning)?;
            dp.pinned_config = Some(p);
        }
        Ok(dp)
    }

    /// Marks the pins as holding a datapath of this layout (in force).
    pub(super) fn write_layout(&mut self) -> Result<(), DatapathError> {
        let mut layout: Array<&mut MapData, u32> = map_mut(&mut self.ebpf, MAP_LAYOUT)?;
        layout
            .set(0, LAYOUT_VERSION, 0)
            .map_err(|e| map_error(MAP_LAYOUT, e))?;
        self.layout_pending = false;
        Ok(())
    }

    /// What a loaded datapath writes before its program first runs: the
    /// own buckets' cap, a fresh filter's validity and the pins' layout
    /// version; then a read of the counters and sources, so that maps that
    /// do not match rl-common fail now, not later.
    fn first_writes(&mut self, compiled: &Compiled, pinned: bool) -> Result<(), DatapathError> {
        // The own buckets' cap (adopted: the same, `max_sources` being
        // part of the tables' size).
        let mut owned: Array<&mut MapData, u64> = map_mut(&mut self.ebpf, rl_common::MAP_OWNED)?;
        owned
            .set(rl_common::OWNED_CAP, u64::from(compiled.max_sources), 0)
            .map_err(|e| map_error(rl_common::MAP_OWNED, e))?;
        // Fresh, empty tables: every clear bit is true. Adopted ones wait
        // for the collector's first walk (rl_common::known), whatever
        // their control word says: another build may have run them since
        // it was set (one without the filter, or with another hash, inserts
        // buckets without their bits), and a bucket whose bits are clear is
        // skipped in a flood: a limited key would start afresh.
        let mut known: Array<&mut MapData, u64> = map_mut(&mut self.ebpf, MAP_KNOWN)?;
        if self.adopted {
            self.pinned_known = known.get(&0, 0).ok();
        }
        // Adopted: off, in the half the pinned program marks (it runs until
        // the swap; a failed start puts the word back, its marks where the
        // word says).
        let word = match self.pinned_known {
            Some(w) => w & rl_common::KNOWN_HALF,
            None if self.adopted => 0,
            None => KNOWN_VALID,
        };
        known.set(0, word, 0).map_err(|e| map_error(MAP_KNOWN, e))?;
        let checked = self.first_checks(pinned);
        if checked.is_err() {
            // The pinned program runs on: its filter as it was.
            self.put_back_known();
        }
        checked
    }

    /// The layout version (pinned afresh), then a read of the counters and
    /// sources: maps that do not match rl-common fail now, not later.
    fn first_checks(&mut self, pinned: bool) -> Result<(), DatapathError> {
        if pinned && !self.layout_pending {
            self.write_layout()?;
        }
        self.counters()?;
        self.sources()?;
        Ok(())
    }

    /// Writes `config` back into the config entry (a start that failed
    /// before its swap leaves the pinned program's as it was).
    pub(super) fn put_back_config(&mut self, config: DatapathConfig) {
        if let Err(e) = self.write_config(config) {
            warn!("could not put the pinned config entry back after a failed start ({e}): the pinned program runs with this build's settings");
        }
        self.put_back_known();
    }

    /// The pinned program's filter, valid again (its own inserts set its
    /// bits), after a start that failed.
    fn put_back_known(&mut self) {
        if let Some(word) = self.pinned_known {
            let put = map_mut::<Array<&mut MapData, u64>>(&mut self.ebpf, MAP_KNOWN)
                .and_then(|mut k| k.set(0, word, 0).map_err(|e| map_error(MAP_KNOWN, e)));
            if let Err(e) = put {
                warn!("could not put the pinned known-keys filter back after a failed start ({e}): it is off until a daemon's first walk (a flood costs table lookups)");
            }
        }
    }

    /// Adopted: this process's settings in the pinned config entry, its
    /// slot, flags and clock kept (the pinned rules' limits were set for
    /// that clock), before this build's program first reads it. An older
    /// build's entry may lack fields (the cell arrays' size was carved from
    /// its `enabled`) or count its flood cap over another window, and
    /// lacks the per-slot bytes of `CFG_*` bits this program reads.
    pub(super) fn refresh_config(
        &mut self,
        pinned: &DatapathConfig,
        tuning: &crate::compile::Tuning,
    ) -> Result<(), DatapathError> {
        self.write_config(DatapathConfig {
            clock: pinned.clock,
            ..self.basis().config(
                tuning,
                DatapathConfig::upgrade_slot_flags(pinned.slot_flags),
            )
        })
    }

    pub(super) fn load_program(&mut self, name: &'static str) -> Result<(), DatapathError> {
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
            .map_err(|e| test_run_error("measuring the kernel tick", PROG_CLOCK, e))?;
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
        match first
            .zip(second)
            .and_then(|(a, b)| TickClock::from_edges(a, b))
        {
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
}

/// Whether the pinned datapath's prefix cells (`pinned`'s masks) are the
/// ones `tuning` asks for; if not, what differs. Cells keyed by another
/// length would not be found: a source limited in its cell would get a
/// fresh one.
fn cells_fit(pinned: &DatapathConfig, tuning: &crate::compile::Tuning) -> Result<(), String> {
    let bits6 = |m: &[u32; 4]| m.iter().map(|w| w.count_ones()).sum::<u32>();
    let (was, want) = (
        (pinned.cell_mask4.count_ones(), bits6(&pinned.cell_mask6)),
        (tuning.cell_mask4.count_ones(), bits6(&tuning.cell_mask6)),
    );
    if was == want {
        return Ok(());
    }
    Err(format!(
        "its prefix cells are IPv4 /{} and IPv6 /{} (datapath.flood_prefix_v4/v6), this configuration's /{} and /{}: \
         a source limited in its cell would find a fresh one",
        was.0, was.1, want.0, want.1
    ))
}
