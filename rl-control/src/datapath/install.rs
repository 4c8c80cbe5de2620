//! Installing a rule set: every table of the inactive slot, then one flip.

use std::net::IpAddr;

use aya::maps::{Array, HashMap, MapData};
use rl_common::*;
use tracing::warn;

use super::{batch::update_batch, *};

/// An install worked out against one state of the datapath: the
/// differences to write into the inactive slot. Making it needs only a
/// snapshot ([`Datapath::plan`]), so a caller can do it without holding
/// the datapath, then [`Datapath::execute`] it.
pub struct Plan {
    slot: u32,
    generation: u64,
    /// When [`Datapath::prepare`] marked the entries whose rule changes:
    /// no program run in flight reads them as before after this.
    unnamed_until: Option<Instant>,
    /// The entries it marked (indices within the slot).
    unnamed: Vec<u32>,
    /// The slot's contents are unknown: clear it whole first.
    clear: bool,
    old_names: Vec<String>,
    /// The rule entries the slot holds: its record's, or, if its contents
    /// are not known, read from the map by [`Datapath::prepare`] (`None`
    /// until then).
    old_entries: Option<Vec<RuleEntry>>,
    entries: Vec<RuleEntry>,
    l4: (Vec<u32>, Vec<u32>),
    dir16: (Vec<u32>, Vec<u32>),
    lpm_remove: Vec<crate::config::units::Cidr>,
    lpm_insert: Vec<(crate::config::units::Cidr, u32)>,
    /// The bans' trie: entries to remove, and to write (ends in ktime ns).
    bans_remove: Vec<crate::config::units::Cidr>,
    bans_insert: Vec<(crate::config::units::Cidr, u64)>,
    decide_remove: Vec<u64>,
    decide_insert: Vec<(u64, u32)>,
    /// The offset the bans' ends were converted with.
    ban_offset_ns: u64,
    /// The config entry after the flip, but its slot word.
    config: DatapathConfig,
    /// The `CFG_*` bits of the rule set.
    flags: u32,
    next: SlotContents,
}

/// What a plan is made from: the slot to write and what it holds.
pub struct Basis {
    slot: u32,
    generation: u64,
    old: Arc<SlotContents>,
    clock: TickClock,
    epoch_offset_ns: u64,
    /// The offset the bans' ends are converted with ([`ban_offset`]).
    ban_offset_ns: u64,
    cell_slots_log2: u16,
    /// Possible CPUs (the per-CPU maps' width).
    cpus: usize,
    /// The rule ids both rule tables hold, each with its natural id.
    held: Arc<std::collections::BTreeMap<u32, u32>>,
}

impl Datapath {
    /// Makes `rules` the active rule set: writes every table of the inactive
    /// slot, then flips `slot` in the config entry with one map write, so
    /// each packet sees the old rule set or the new one, never a mix, and
    /// there is no instant without limits. Buckets are keyed by rule ids that
    /// only change when a rule does, so unchanged rules keep their state.
    /// Only differences are written: a ban touches that ban's entries.
    ///
    /// All or nothing: if a step fails, the active rule set stays in force
    /// and the slot being written is marked unknown, so the next install
    /// clears it whole instead of writing differences against a record that
    /// no longer says what the maps hold.
    pub fn install(&mut self, rules: &RuleSet) -> Result<(), DatapathError> {
        let plan = Plan::new(self.basis(), rules)?;
        self.execute(plan)
    }

    /// A snapshot to make a [`Plan`] from (cheap: no map is read).
    pub fn basis(&self) -> Basis {
        let slot = self.active.map_or(0, |s| s ^ 1);
        Basis {
            slot,
            generation: self.generation,
            old: self.slots[slot as usize].clone(),
            clock: self.clock,
            epoch_offset_ns: self.epoch_offset_ns,
            ban_offset_ns: ban_offset(self.ban_offset_ns, super::load::epoch_offset_ns()),
            cell_slots_log2: self.cell_slots_log2,
            cpus: self.cpus,
            held: self.held_ids.clone(),
        }
    }

    /// The rule ids the rule tables' maps hold (both slots), each with its
    /// natural id.
    pub(super) fn read_held_ids(
        &self,
    ) -> Result<std::collections::BTreeMap<u32, u32>, DatapathError> {
        let mut held = held_ids(&self.slot_entries(0)?);
        held.extend(held_ids(&self.slot_entries(1)?));
        Ok(held)
    }

    /// The notes on the wide-cell counts of the rules in force, with the
    /// ids the tables hold ([`crate::compile::wide_count_notes`]).
    pub fn wide_count_notes(&self) -> Vec<String> {
        match self.active {
            Some(slot) => {
                let c = &self.slots[slot as usize];
                crate::compile::wide_count_notes(&c.entries, &c.names)
            }
            None => Vec::new(),
        }
    }

    /// Writes `plan` and flips to it. A plan made before another install
    /// is refused ([`DatapathError::Stale`]).
    pub fn execute(&mut self, mut plan: Plan) -> Result<(), DatapathError> {
        let until = match plan
            .unnamed_until
            .filter(|_| plan.generation == self.generation)
        {
            Some(t) => t,
            None => self.prepare(&mut plan)?,
        };
        sleep_until(until);
        let slot = plan.slot;
        self.generation += 1;
        self.slots[slot as usize] = Arc::new(SlotContents {
            unknown: true,
            ..Default::default()
        });
        let mut stayed = Vec::new();
        // Then the flip.
        let written = self
            .write_slot(&plan, &mut stayed)
            .and_then(|()| self.flip(&plan));
        if written.is_err() {
            // The slot is unknown now, and its names with it: counters left
            // in place for the rules that stay would be read by no one, and
            // lost at the next clearing. They go to the totals.
            for (idx, name) in stayed {
                if let Err(e) = self.retire_counters(idx, name.clone()) {
                    warn!(rule = %name, "a failed install could not move this rule's counters to the daemon's totals ({e}): they stay uncounted until an install succeeds");
                }
            }
        }
        // What the tables hold now, or may (this slot half-written).
        let other = &self.slots[slot as usize ^ 1];
        let mut held = held_ids(&plan.entries);
        if other.unknown || written.is_err() {
            for (&id, &natural) in self.held_ids.iter() {
                held.entry(id).or_insert(natural);
            }
        }
        if !other.unknown {
            held.extend(held_ids(&other.entries));
        }
        self.held_ids = Arc::new(held);
        written?;
        self.active = Some(slot);
        self.ban_offset_ns = plan.ban_offset_ns;
        self.flipped_at = Instant::now();
        self.slots[slot as usize] = Arc::new(plan.next);
        Ok(())
    }

    /// Writes every table of `plan`'s slot (all but the flip), noting in
    /// `stayed` the counters it leaves in place for the rules that stay.
    fn write_slot(
        &mut self,
        plan: &Plan,
        stayed: &mut Vec<(u32, String)>,
    ) -> Result<(), DatapathError> {
        let slot = plan.slot;
        let base = slot * RULE_SLOTS;
        if plan.clear {
            self.retire_found_stats(
                slot,
                plan.old_entries.as_deref().unwrap_or_default(),
                (&plan.entries, &plan.next.names),
                stayed,
            )?;
            let kept: Vec<u32> = stayed.iter().map(|&(idx, _)| idx).collect();
            self.clear_slot(slot, &kept)?;
        }
        self.retire_stats(
            base,
            (&plan.old_names, plan.old_entries.as_deref()),
            (&plan.entries, &plan.next.names),
            stayed,
        )?;

        self.rewrite_unnamed(slot, &plan.unnamed, &plan.entries)?;
        let keys: Vec<u32> = (0..plan.entries.len() as u32).map(|i| base + i).collect();
        update_batch(self.array_fd(MAP_RULES)?, &keys, &plan.entries)
            .map_err(|e| map_error(MAP_RULES, e))?;
        self.failpoint("rules")?;
        self.write_u32s(MAP_L4, &plan.l4)?;
        self.failpoint("l4")?;
        // The bans' ends before the entries that read them; the trie, then
        // the first level that points into it.
        for (c, end) in &plan.bans_insert {
            self.trie_write(MAPS_BANS, slot, c, Some(*end))?;
        }
        for c in &plan.lpm_remove {
            self.lpm_write(slot, c, None)?;
        }
        for (c, v) in &plan.lpm_insert {
            self.lpm_write(slot, c, Some(*v))?;
        }
        self.failpoint("lpm")?;
        self.write_u32s(MAP_DIR16, &plan.dir16)?;
        // Ends no entry reads any more.
        for c in &plan.bans_remove {
            self.trie_write::<u64>(MAPS_BANS, slot, c, None)?;
        }
        let mut decide: HashMap<&mut MapData, u64, u32> = map_mut(&mut self.ebpf, MAP_DECIDE)?;
        for k in &plan.decide_remove {
            // Absent already is what is wanted; any other failure fails
            // the install (the slot is then unknown, and cleared whole by
            // the next), or a stale decision would outlive its rule.
            absent_ok(decide.remove(k)).map_err(|e| map_error(MAP_DECIDE, e))?;
        }
        for (k, rule) in &plan.decide_insert {
            decide
                .insert(k, rule, 0)
                .map_err(|e| map_error(MAP_DECIDE, e))?;
        }
        self.failpoint("decide")?;

        Ok(())
    }

    /// The first step of `plan`, made apart so that a caller can wait out
    /// its grace without holding a lock: refuses a stale plan, waits until
    /// the slot is no longer read as the active one ([`ready_at`]: no wait
    /// for a caller that waited for it), marks the entries whose rule
    /// changes (see [`Datapath::unname_changed_rules`]) and returns when the
    /// program runs that read them before are surely over. [`execute`]
    /// waits for that time itself, and makes this step if it was not.
    ///
    /// [`execute`]: Datapath::execute
    /// [`ready_at`]: Datapath::ready_at
    pub fn prepare(&mut self, plan: &mut Plan) -> Result<Instant, DatapathError> {
        if plan.generation != self.generation {
            return Err(DatapathError::Stale);
        }
        sleep_until(self.ready_at());
        let old = match plan.old_entries.take() {
            Some(old) => old,
            None => self.slot_entries(plan.slot)?,
        };
        let (until, unnamed) = self.unname_changed_rules(plan.slot, &old, &plan.entries)?;
        plan.old_entries = Some(old);
        self.failpoint("unnamed")?;
        (plan.unnamed_until, plan.unnamed) = (Some(until), unnamed);
        Ok(until)
    }

    /// Before anything of the inactive `slot` is rewritten: the entries
    /// whose rule changes (another rule, or the same rule changed: a
    /// failure mode of the cluster keeps ids) or goes (`held` is what they
    /// hold) are marked [`RULE_UNNAMED`], the rest of each entry
    /// kept; returns when the program runs in flight that read them before
    /// are over (now if none changed). A fragment verdict remembered from
    /// such an entry (through one rule change, see `rl_common::rule_tag`)
    /// is then an orphan until the entry holds its rule again (the same
    /// id: see [`Datapath::rewrite_unnamed`]), never counted under another
    /// rule nor read half-written; a run that took it before the mark
    /// charges the whole rule it checked. One from an entry that keeps its
    /// rule unchanged stands. Also returns the entries to write under the
    /// mark ([`Datapath::rewrite_unnamed`]): those marked (among them any
    /// found marked by an install that stopped half-way whose contents
    /// change now) and those that held no rule and get one.
    fn unname_changed_rules(
        &mut self,
        slot: u32,
        held: &[RuleEntry],
        entries: &[RuleEntry],
    ) -> Result<(Instant, Vec<u32>), DatapathError> {
        let base = slot * RULE_SLOTS;
        // A rule's entry (marked or not) whose contents change: marked.
        // So is an emptied entry without the mark (emptied by an older
        // build, whose mark was the id alone), found in a slot whose every
        // entry was read: filled in one write, now or by a later change,
        // its id and flags would change at once.
        let changing: Vec<u32> = (0..held.len() as u32)
            .filter(|&i| {
                let e = &held[i as usize];
                match e.id {
                    NO_RULE_ID => e.flags & RULE_UNNAMED == 0,
                    id => {
                        is_rule_id(id)
                            && entries.get(i as usize)
                                != Some(&RuleEntry {
                                    flags: e.flags & !RULE_UNNAMED,
                                    ..*e
                                })
                    }
                }
            })
            .collect();
        // An entry that holds no rule (emptied, or never written) and gets
        // one: written under the mark too, so that no run reads it taken
        // for its new rule before it holds it whole.
        let filled = (0..entries.len() as u32)
            .filter(|&i| held.get(i as usize).is_none_or(|e| !is_rule_id(e.id)));
        let mut unnamed: Vec<u32> = changing.iter().copied().chain(filled).collect();
        unnamed.sort_unstable();
        unnamed.dedup();
        if changing.is_empty() {
            return Ok((Instant::now(), unnamed));
        }
        let (keys, marked): (Vec<u32>, Vec<RuleEntry>) = changing
            .iter()
            .map(|&i| {
                (
                    base + i,
                    RuleEntry {
                        flags: held[i as usize].flags | RULE_UNNAMED,
                        ..held[i as usize]
                    },
                )
            })
            .unzip();
        update_batch(self.array_fd(MAP_RULES)?, &keys, &marked)
            .map_err(|e| map_error(MAP_RULES, e))?;
        Ok((Instant::now() + super::known::RUN_GRACE, unnamed))
    }

    /// After the grace of [`Datapath::unname_changed_rules`], before the
    /// slot's rules are written: each marked entry past the end of the new
    /// rules is emptied (`NO_RULE_ID`, which older builds heed too, with
    /// the mark on), and each within (or one that held no rule) gets its
    /// new rule with the mark on, so that the write of the rules, which
    /// lifts the mark, changes one flag only: no run reads an entry
    /// half-written, taken for a rule it does not hold whole.
    fn rewrite_unnamed(
        &mut self,
        slot: u32,
        unnamed: &[u32],
        entries: &[RuleEntry],
    ) -> Result<(), DatapathError> {
        if unnamed.is_empty() {
            return self.failpoint("rewritten");
        }
        let (keys, values): (Vec<u32>, Vec<RuleEntry>) = unnamed
            .iter()
            .map(|&i| {
                let value = match entries.get(i as usize) {
                    Some(e) => RuleEntry {
                        flags: e.flags | RULE_UNNAMED,
                        ..*e
                    },
                    None => RuleEntry {
                        id: NO_RULE_ID,
                        flags: RULE_UNNAMED,
                        ..Default::default()
                    },
                };
                (slot * RULE_SLOTS + i, value)
            })
            .unzip();
        update_batch(self.array_fd(MAP_RULES)?, &keys, &values)
            .map_err(|e| map_error(MAP_RULES, e))?;
        self.failpoint("rewritten")
    }

    /// Writes `(keys, values)` of a `u32` array in one batched syscall.
    fn write_u32s(
        &mut self,
        name: &'static str,
        (keys, values): &(Vec<u32>, Vec<u32>),
    ) -> Result<(), DatapathError> {
        if keys.is_empty() {
            return Ok(());
        }
        update_batch(self.array_fd(name)?, keys, values).map_err(|e| map_error(name, e))
    }

    /// Tests only: makes the next install fail after `step` ("unnamed":
    /// the marking of changed rule entries, "found": the retiring of an
    /// unknown slot's counters, "retiring": before the first counters of a
    /// rule that does not stay go to the totals, "zeroing": between reading
    /// a rule's counters and zeroing them, "rewritten": the changed
    /// entries' new contents under the mark, "rules", "l4", "lpm",
    /// "decide", "flip": between the flip's two writes), as a failed map
    /// write there would; or, at "swap", the
    /// next swap of a pinned link's program, as if the kernel refused it
    /// (`EPERM`).
    #[doc(hidden)]
    pub fn fail_next_install_at(&mut self, step: &'static str) {
        self.fail_install_at(step, 0);
    }

    /// Tests only: [`Datapath::fail_next_install_at`], passing `step`
    /// `skip` times first.
    #[doc(hidden)]
    pub fn fail_install_at(&mut self, step: &'static str, skip: u32) {
        self.failpoint = Some((step, skip));
    }

    /// Makes `plan`'s slot the active one in two writes of the config
    /// entry ([`DatapathConfig::flip_words`]): no packet sees one slot with
    /// the other's flags. The second also brings `plan`'s settings.
    fn flip(&mut self, plan: &Plan) -> Result<(), DatapathError> {
        let now = self.config()?;
        let [first, last] = DatapathConfig::flip_words(now.slot_flags, plan.slot, plan.flags);
        self.write_config(DatapathConfig {
            slot_flags: first,
            ..now
        })?;
        self.failpoint("flip")?;
        self.write_config(DatapathConfig {
            slot_flags: last,
            ..plan.config
        })
    }

    /// Writes the config entry (the program reads it whole per packet).
    pub(super) fn write_config(&mut self, config: DatapathConfig) -> Result<(), DatapathError> {
        let mut map: Array<&mut MapData, DatapathConfig> = map_mut(&mut self.ebpf, MAP_CONFIG)?;
        map.set(0, config, 0).map_err(|e| map_error(MAP_CONFIG, e))
    }

    /// The rule entries `slot` holds, read from the map in one batch: for
    /// a slot whose contents are unknown.
    pub(super) fn slot_entries(&self, slot: u32) -> Result<Vec<RuleEntry>, DatapathError> {
        super::batch::lookup_array(self.array_fd(MAP_RULES)?, slot * RULE_SLOTS, RULE_SLOTS)
            .map_err(|e| map_error(MAP_RULES, e))
    }

    pub(super) fn failpoint(&mut self, step: &'static str) -> Result<(), DatapathError> {
        match &mut self.failpoint {
            Some((at, 0)) if *at == step => {
                self.failpoint = None;
                return Err(DatapathError::Map {
                    map: "failpoint",
                    cause: format!("injected failure after step {step}"),
                });
            }
            Some((at, skip)) if *at == step => *skip -= 1,
            _ => {}
        }
        Ok(())
    }

    /// Empties every table of `slot` whose contents are unknown: the L4 and
    /// first-level arrays, its tries and decision entries, its rule counters
    /// but those of the entries `kept`. (Rule entries are left: nothing
    /// points at them any more.)
    pub(super) fn clear_slot(&mut self, slot: u32, kept: &[u32]) -> Result<(), DatapathError> {
        let zeros = |n: u32| vec![0u32; n as usize];
        let l4_keys: Vec<u32> = (slot * L4_SLOT_LEN..(slot + 1) * L4_SLOT_LEN).collect();
        update_batch(self.array_fd(MAP_L4)?, &l4_keys, &zeros(L4_SLOT_LEN))
            .map_err(|e| map_error(MAP_L4, e))?;
        let dir_keys: Vec<u32> = (slot * DIR16_LEN..(slot + 1) * DIR16_LEN).collect();
        update_batch(self.array_fd(MAP_DIR16)?, &dir_keys, &zeros(DIR16_LEN))
            .map_err(|e| map_error(MAP_DIR16, e))?;
        clear_trie::<5, u32>(&mut self.ebpf, MAP_LPM_V4, slot)?;
        clear_trie::<17, u32>(&mut self.ebpf, MAP_LPM_V6, slot)?;
        clear_trie::<5, u64>(&mut self.ebpf, MAPS_BANS[0], slot)?;
        clear_trie::<17, u64>(&mut self.ebpf, MAPS_BANS[1], slot)?;
        let mut decide: HashMap<&mut MapData, u64, u32> = map_mut(&mut self.ebpf, MAP_DECIDE)?;
        let stale: Vec<u64> = decide
            .keys()
            .filter(|k| k.as_ref().map_or(true, |k| k >> 48 == slot as u64))
            .collect::<Result<_, _>>()
            .map_err(|e| map_error(MAP_DECIDE, e))?;
        for k in stale {
            decide.remove(&k).map_err(|e| map_error(MAP_DECIDE, e))?;
        }
        self.clear_counters(slot, kept)
    }

    /// The fd of the array map `name`, for batched writes.
    fn array_fd(&self, name: &'static str) -> Result<std::os::fd::RawFd, DatapathError> {
        use std::os::fd::{AsFd, AsRawFd};
        match self.ebpf.map(name) {
            Some(aya::maps::Map::Array(data)) => Ok(data.fd().as_fd().as_raw_fd()),
            _ => Err(DatapathError::Load(format!(
                "map {name} is missing or not an array"
            ))),
        }
    }

    fn lpm_write(
        &mut self,
        slot: u32,
        c: &crate::config::units::Cidr,
        value: Option<u32>,
    ) -> Result<(), DatapathError> {
        self.trie_write([MAP_LPM_V4, MAP_LPM_V6], slot, c, value)
    }

    /// Inserts (`Some`) or removes (`None`) `c`'s entry of `slot` in the
    /// trie of its family among `[v4, v6]`.
    fn trie_write<V: aya::Pod>(
        &mut self,
        [v4, v6]: [&'static str; 2],
        slot: u32,
        c: &crate::config::units::Cidr,
        value: Option<V>,
    ) -> Result<(), DatapathError> {
        let prefix = 8 + c.len as u32;
        match c.addr {
            IpAddr::V4(a) => lpm_set(
                &mut self.ebpf,
                v4,
                prefix,
                slot_key::<5>(slot, &a.octets()),
                value,
            ),
            IpAddr::V6(a) => lpm_set(
                &mut self.ebpf,
                v6,
                prefix,
                slot_key::<17>(slot, &a.octets()),
                value,
            ),
        }
    }
}

impl Basis {
    /// The config entry of this process's settings (`tuning`, its clock,
    /// offset and cell arrays) with the active slot and its flags
    /// `slot_flags`.
    pub(super) fn config(&self, t: &crate::compile::Tuning, slot_flags: u64) -> DatapathConfig {
        DatapathConfig {
            clock: self.clock,
            epoch_offset_ns: self.epoch_offset_ns,
            enabled: 1,
            flags: t.flags,
            cell_slots_log2: self.cell_slots_log2,
            slot_flags,
            flood_cap: flood_cap_per_cpu(t.flood_new_keys_per_sec, online_cpus(self.cpus)),
            cell_mask4: t.cell_mask4,
            frag_ttl_ms: t.fragment_ttl_ms,
            frag_orphans: t.fragment_orphans,
            cell_mask6: t.cell_mask6,
        }
    }
}

impl Plan {
    /// The differences between what `basis`'s slot holds and `rules`.
    pub fn new(basis: Basis, rules: &RuleSet) -> Result<Plan, DatapathError> {
        fits(rules)?;
        let slot = basis.slot;
        let empty = SlotContents::default();
        let old: &SlotContents = if basis.old.unknown {
            &empty
        } else {
            &basis.old
        };
        // Rules new to the tables get wide-cell counts of their own.
        let mut parted = rules.entries.clone();
        crate::compile::part_wide_counts(&mut parted, &basis.held);
        let entries: Vec<RuleEntry> = parted
            .iter()
            .map(|e| {
                let mut e = *e;
                for l in e.limits.iter_mut() {
                    *l = l.with_clock(&basis.clock);
                }
                e.pool = e.pool.with_clock(&basis.clock);
                e
            })
            .collect();
        let mut lpm = rules.lpm.clone();
        lpm.sort_unstable_by_key(|(c, _)| *c);
        let (lpm_remove, lpm_insert) = sorted_diff(&old.lpm, &lpm);
        let bans: Vec<_> = rules
            .bans
            .iter()
            .map(|&(c, until)| (c, ktime_of(until, basis.ban_offset_ns)))
            .collect();
        let (bans_remove, bans_insert) = sorted_diff(&old.bans, &bans);
        let mut decide: Vec<(u64, u32)> = rules
            .decide
            .iter()
            .map(|((l4c, srcc), rule)| (rl_common::decide_key(slot, *l4c, *srcc), *rule))
            .collect();
        decide.sort_unstable();
        let (decide_remove, decide_insert) = sorted_diff(&old.decide, &decide);
        let config = basis.config(&rules.tuning, 0);
        Ok(Plan {
            slot,
            generation: basis.generation,
            unnamed_until: None,
            unnamed: Vec::new(),
            clear: basis.old.unknown,
            old_names: old.names.clone(),
            old_entries: (!basis.old.unknown).then(|| old.entries.clone()),
            entries: entries.clone(),
            l4: u32_diff(slot * L4_SLOT_LEN, &old.l4, &rules.l4),
            dir16: u32_diff(slot * DIR16_LEN, &old.dir16, &rules.dir16),
            lpm_remove,
            lpm_insert,
            bans_remove,
            bans_insert,
            decide_remove,
            decide_insert,
            ban_offset_ns: basis.ban_offset_ns,
            config,
            flags: rules.flags,
            next: SlotContents {
                unknown: false,
                names: rules.names.clone(),
                entries,
                l4: rules.l4.clone(),
                lpm,
                dir16: rules.dir16.clone(),
                decide,
                bans,
            },
        })
    }
}

/// Each rule id of `entries` with its natural id.
fn held_ids(entries: &[RuleEntry]) -> std::collections::BTreeMap<u32, u32> {
    entries
        .iter()
        .filter(|e| is_rule_id(e.id))
        .map(|e| (e.id, natural_id(e.id, e.flags)))
        .collect()
}

/// The keys and values of a `u32` array at `base..` where `new` differs
/// from `old` (missing entries are 0): a rule for "any UDP port" changes
/// 65,536 entries, written in one batched syscall.
fn u32_diff(base: u32, old: &[u32], new: &[u32]) -> (Vec<u32>, Vec<u32>) {
    let (mut keys, mut values) = (Vec::new(), Vec::new());
    for i in 0..old.len().max(new.len()) {
        let v = new.get(i).copied().unwrap_or(0);
        if old.get(i).copied().unwrap_or(0) != v {
            keys.push(base + i as u32);
            values.push(v);
        }
    }
    (keys, values)
}

/// Between two key-sorted lists: the keys to remove (in `old` only) and the
/// entries to write (new, or with another value).
fn sorted_diff<K: Ord + Copy, V: PartialEq + Copy>(
    old: &[(K, V)],
    new: &[(K, V)],
) -> (Vec<K>, Vec<(K, V)>) {
    let (mut remove, mut write) = (Vec::new(), Vec::new());
    let (mut i, mut j) = (0, 0);
    while i < old.len() || j < new.len() {
        match (old.get(i), new.get(j)) {
            (Some(o), Some(n)) if o.0 == n.0 => {
                if o.1 != n.1 {
                    write.push(*n);
                }
                i += 1;
                j += 1;
            }
            (Some(o), Some(n)) if o.0 < n.0 => {
                remove.push(o.0);
                i += 1;
            }
            (Some(o), None) => {
                remove.push(o.0);
                i += 1;
            }
            (_, Some(n)) => {
                write.push(*n);
                j += 1;
            }
            (None, None) => unreachable!(),
        }
    }
    (remove, write)
}

/// Refuses a rule set the slot's tables cannot hold, before anything is
/// written (and in `check-config`).
pub fn fits(rules: &RuleSet) -> Result<(), DatapathError> {
    let v4 = rules.lpm.iter().filter(|(c, _)| c.addr.is_ipv4()).count();
    let v6 = rules.lpm.len() - v4;
    let hint = "list fewer CIDRs (merge them into shorter prefixes)";
    for (what, needed, capacity, hint) in [
        ("IPv4 CIDR", v4, LPM_SLOT_LEN, hint),
        ("IPv6 CIDR", v6, LPM_SLOT_LEN, hint),
        (
            "rule decision",
            rules.decide.len(),
            DECIDE_SLOT_LEN,
            "give fewer rules `src` lists, or fewer distinct ones",
        ),
    ] {
        if needed > capacity as usize {
            return Err(DatapathError::TooLarge {
                what,
                needed,
                capacity,
                hint,
            });
        }
    }
    Ok(())
}

/// Removes every entry of `slot` from the trie `name`.
fn clear_trie<const N: usize, V: aya::Pod>(
    ebpf: &mut Ebpf,
    name: &'static str,
    slot: u32,
) -> Result<(), DatapathError>
where
    [u8; N]: aya::Pod,
{
    use aya::maps::lpm_trie::LpmTrie;
    let mut trie: LpmTrie<&mut MapData, [u8; N], V> = map_mut(ebpf, name)?;
    let stale: Vec<_> = trie
        .keys()
        .filter(|k| k.as_ref().map_or(true, |k| k.data()[0] == slot as u8))
        .collect::<Result<_, _>>()
        .map_err(|e| map_error(name, e))?;
    for k in stale {
        trie.remove(&k).map_err(|e| map_error(name, e))?;
    }
    Ok(())
}

/// An LPM key's data: the slot byte, then the address.
fn slot_key<const N: usize>(slot: u32, addr: &[u8]) -> [u8; N] {
    let mut data = [0u8; N];
    data[0] = slot as u8;
    data[1..].copy_from_slice(addr);
    data
}

/// Inserts (`Some`) or removes (`None`) one trie entry.
fn lpm_set<const N: usize, V: aya::Pod>(
    ebpf: &mut Ebpf,
    name: &'static str,
    prefix: u32,
    data: [u8; N],
    value: Option<V>,
) -> Result<(), DatapathError>
where
    [u8; N]: aya::Pod,
{
    use aya::maps::lpm_trie::{Key, LpmTrie};
    let mut trie: LpmTrie<&mut MapData, [u8; N], V> = map_mut(ebpf, name)?;
    let key = Key::new(prefix, data);
    match value {
        Some(v) => trie.insert(&key, v, 0),
        None => trie.remove(&key),
    }
    .map_err(|e| map_error(name, e))
}

/// The bans' tries, IPv4 then IPv6.
const MAPS_BANS: [&str; 2] = [rl_common::MAP_BANS_V4, rl_common::MAP_BANS_V6];

/// The offset to convert bans' ends with: the one in use, unless the wall
/// clock has stepped more than a second away from it (`fresh`, measured
/// now). Jitter alone never changes it, so an install rewrites no end that
/// did not change.
pub(super) fn ban_offset(in_use: u64, fresh: u64) -> u64 {
    if (fresh.wrapping_sub(in_use) as i64).unsigned_abs() > 1_000_000_000 {
        fresh
    } else {
        in_use
    }
}

/// The ktime (ns) at Unix time `secs`, by the datapath's offset; 0 for a
/// time before ktime's start, `u64::MAX` past its range.
fn ktime_of(secs: u64, epoch_offset_ns: u64) -> u64 {
    secs.checked_mul(1_000_000_000)
        .map_or(u64::MAX, |ns| ns.saturating_sub(epoch_offset_ns))
}

/// The online CPUs, among which the flood rate is shared: counted by every
/// plan (outside the state lock), so a reload follows CPUs brought online
/// since. Not the possible CPUs (`possible`, the per-CPU maps' width, and
/// the answer should sysfs not give one), which a VM may declare by the
/// hundred: sharing the rate among those would leave each a sliver.
fn online_cpus(possible: usize) -> usize {
    aya::util::online_cpus().map_or(possible, |c| c.len().max(1))
}

/// One CPU's share of the host-wide unseen-key rate, per flood window
/// (2²⁶ ns, about 67 ms), rounded up and at least 1; 0 stays 0 (always
/// flood).
pub(super) fn flood_cap_per_cpu(per_sec: u32, cpus: usize) -> u32 {
    if per_sec == 0 {
        return 0;
    }
    let per_window = (per_sec as u64 * (1u64 << FLOOD_WINDOW_SHIFT)).div_ceil(1_000_000_000);
    per_window.div_ceil(cpus.max(1) as u64).min(u32::MAX as u64) as u32
}

/// `r`, with "no such key" taken as done (a removal of what is gone).
fn absent_ok(r: Result<(), aya::maps::MapError>) -> Result<(), aya::maps::MapError> {
    match r {
        Err(aya::maps::MapError::SyscallError(e))
            if e.io_error.raw_os_error() == Some(libc::ENOENT) =>
        {
            Ok(())
        }
        r => r,
    }
}

#[cfg(test)]
mod tests {
    use super::{ban_offset, flood_cap_per_cpu, ktime_of, sorted_diff};

    /// A ban's end follows a step of the wall clock, never its jitter.
    #[test]
    fn ban_ends_follow_a_stepped_wall_clock_only() {
        let t = 1_700_000_000_000_000_000u64;
        assert_eq!(ban_offset(t, t + 900_000_000), t, "jitter: kept");
        assert_eq!(ban_offset(t, t - 900_000_000), t);
        assert_eq!(
            ban_offset(t, t + 5_000_000_000),
            t + 5_000_000_000,
            "stepped"
        );
        assert_eq!(ban_offset(t, t - 600_000_000_000), t - 600_000_000_000);
        // 10 minutes from now, converted by a clock stepped back 10 minutes,
        // ends 10 minutes later in ktime.
        let until = 1_700_000_600;
        assert_eq!(
            ktime_of(until, t - 600_000_000_000) - ktime_of(until, t),
            600_000_000_000
        );
    }

    #[test]
    fn a_sorted_diff_removes_what_went_and_writes_what_came_or_changed() {
        let old = [(1, 'a'), (3, 'c'), (5, 'e'), (7, 'g')];
        let new = [(2, 'b'), (3, 'c'), (5, 'E'), (8, 'h')];
        assert_eq!(
            sorted_diff(&old, &new),
            (vec![1, 7], vec![(2, 'b'), (5, 'E'), (8, 'h')])
        );
        assert_eq!(sorted_diff::<u8, u8>(&[], &[]), (vec![], vec![]));
        assert_eq!(sorted_diff(&[(1, 1)], &[]), (vec![1], vec![]));
    }

    #[test]
    fn the_flood_rate_is_shared_among_cpus_per_window() {
        assert_eq!(flood_cap_per_cpu(0, 2), 0);
        // 100,000/s over a 67.1 ms window on 2 CPUs: 6,711 per window.
        assert_eq!(flood_cap_per_cpu(100_000, 2), 3_356);
        // A rate under one key per window still leaves every CPU one: 0
        // would mean "always flood".
        assert_eq!(flood_cap_per_cpu(1, 64), 1);
        assert_eq!(flood_cap_per_cpu(10, 1), 1);
        // The largest rate does not overflow: 2³² − 1 keys/s × 2²⁶ ns.
        assert_eq!(flood_cap_per_cpu(u32::MAX, 1), 288_230_377);
    }
}
