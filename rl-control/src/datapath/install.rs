//! Installing a rule set: every table of the inactive slot, then one flip.

use std::net::IpAddr;

use aya::maps::{Array, HashMap, MapData, PerCpuArray};
use rl_common::*;

use super::{batch::update_batch, read::add_stats, *};

impl Datapath {
    /// Makes `rules` the active rule set: writes every table of the inactive
    /// slot, then flips `slot` in the config entry with one map write, so
    /// each packet sees the old rule set or the new one, never a mix, and
    /// there is no instant without limits. Buckets are keyed by rule ids that
    /// only change when a rule does, so unchanged rules keep their state.
    ///
    /// All or nothing: if a step fails, the active rule set stays in force
    /// and the slot being written is marked unknown, so the next install
    /// clears it whole instead of writing differences against a record that
    /// no longer says what the maps hold.
    pub fn install(&mut self, rules: &RuleSet) -> Result<(), DatapathError> {
        fits(rules)?;
        let slot = self.active.map_or(0, |s| s ^ 1);
        let since = self.flipped_at.elapsed();
        if since < SLOT_GRACE {
            std::thread::sleep(SLOT_GRACE - since);
        }
        let base = slot * RULE_SLOTS;

        let old = std::mem::replace(&mut self.slots[slot as usize], SlotContents { unknown: true, ..Default::default() });
        let old = if old.unknown {
            self.clear_slot(slot)?;
            SlotContents::default()
        } else {
            old
        };
        // Counters of the rules this slot held go to their names' totals.
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
        self.failpoint("rules")?;

        let l4_base = slot * rl_common::L4_SLOT_LEN;
        self.write_u32_diff(MAP_L4, l4_base, &old.l4, &rules.l4)?;
        self.failpoint("l4")?;

        // Trie first, then the first level that points into it.
        for (c, _) in &old.lpm {
            self.lpm_write(slot, c, None)?;
        }
        for (c, v) in &rules.lpm {
            self.lpm_write(slot, c, Some(*v))?;
        }
        self.failpoint("lpm")?;
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
        self.failpoint("decide")?;

        let t = &rules.tuning;
        let cfg = DatapathConfig {
            clock: self.clock,
            epoch_offset_ns: self.epoch_offset_ns,
            enabled: 1,
            slot_flags: DatapathConfig::pack_slot_flags(slot, rules.flags),
            flood_cap: flood_cap_per_cpu(t.flood_new_keys_per_sec, self.cpus),
            cell_mask4: t.cell_mask4,
            frag_ttl_ms: t.fragment_ttl_ms,
            frag_orphans: t.fragment_orphans,
            cell_mask6: t.cell_mask6,
        };
        let mut config: Array<&mut MapData, DatapathConfig> = map_mut(&mut self.ebpf, MAP_CONFIG)?;
        config.set(0, cfg, 0).map_err(|e| map_error(MAP_CONFIG, e))?;
        self.active = Some(slot);
        self.flipped_at = Instant::now();
        self.slots[slot as usize] = SlotContents {
            unknown: false,
            names: rules.names.clone(),
            ids: rules.entries.iter().map(|e| e.id).collect(),
            l4: rules.l4.clone(),
            lpm: rules.lpm.clone(),
            dir16: rules.dir16.clone(),
            decide: keys,
        };
        Ok(())
    }

    /// Tests only: makes the next install fail after `step` ("rules", "l4",
    /// "lpm", "decide"), as a failed map write there would.
    #[doc(hidden)]
    pub fn fail_next_install_at(&mut self, step: &'static str) {
        self.failpoint = Some(step);
    }

    fn failpoint(&mut self, step: &'static str) -> Result<(), DatapathError> {
        if self.failpoint == Some(step) {
            self.failpoint = None;
            return Err(DatapathError::Map { map: "failpoint", cause: format!("injected failure after writing {step}") });
        }
        Ok(())
    }

    /// Empties every table of `slot` whose contents are unknown: the L4 and
    /// first-level arrays, its trie and decision entries, its rule counters.
    /// (Rule entries are left: nothing points at them any more.)
    pub(super) fn clear_slot(&mut self, slot: u32) -> Result<(), DatapathError> {
        let zeros = |n: u32| vec![0u32; n as usize];
        let l4_keys: Vec<u32> = (slot * L4_SLOT_LEN..(slot + 1) * L4_SLOT_LEN).collect();
        update_batch(self.array_fd(MAP_L4)?, &l4_keys, &zeros(L4_SLOT_LEN)).map_err(|e| map_error(MAP_L4, e))?;
        let dir_keys: Vec<u32> = (slot * DIR16_LEN..(slot + 1) * DIR16_LEN).collect();
        update_batch(self.array_fd(MAP_DIR16)?, &dir_keys, &zeros(DIR16_LEN)).map_err(|e| map_error(MAP_DIR16, e))?;
        clear_trie::<5>(&mut self.ebpf, MAP_LPM_V4, slot)?;
        clear_trie::<17>(&mut self.ebpf, MAP_LPM_V6, slot)?;
        let mut decide: HashMap<&mut MapData, u64, u32> = map_mut(&mut self.ebpf, MAP_DECIDE)?;
        let stale: Vec<u64> = decide.keys().filter_map(Result::ok).filter(|k| k >> 48 == slot as u64).collect();
        for k in stale {
            decide.remove(&k).map_err(|e| map_error(MAP_DECIDE, e))?;
        }
        let mut stats: PerCpuArray<&mut MapData, RuleStats> = map_mut(&mut self.ebpf, MAP_RULE_STATS)?;
        for idx in slot * RULE_SLOTS..(slot + 1) * RULE_SLOTS {
            let zero = aya::maps::PerCpuValues::try_from(vec![RuleStats::default(); self.cpus])
                .map_err(|e| map_error(MAP_RULE_STATS, e))?;
            stats.set(idx, zero, 0).map_err(|e| map_error(MAP_RULE_STATS, e))?;
        }
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
}

/// Refuses a rule set the slot's tables cannot hold, before anything is written.
fn fits(rules: &RuleSet) -> Result<(), DatapathError> {
    let v4 = rules.lpm.iter().filter(|(c, _)| c.addr.is_ipv4()).count();
    let v6 = rules.lpm.len() - v4;
    let hint = "list fewer CIDRs (merge them into shorter prefixes)";
    for (what, needed, capacity, hint) in [
        ("IPv4 CIDR", v4, LPM_SLOT_LEN, hint),
        ("IPv6 CIDR", v6, LPM_SLOT_LEN, hint),
        ("rule decision", rules.decide.len(), DECIDE_SLOT_LEN, "give fewer rules `src` lists, or fewer distinct ones"),
    ] {
        if needed > capacity as usize {
            return Err(DatapathError::TooLarge { what, needed, capacity, hint });
        }
    }
    Ok(())
}

/// Removes every entry of `slot` from the trie `name`.
fn clear_trie<const N: usize>(ebpf: &mut Ebpf, name: &'static str, slot: u32) -> Result<(), DatapathError>
where
    [u8; N]: aya::Pod,
{
    use aya::maps::lpm_trie::LpmTrie;
    let mut trie: LpmTrie<&mut MapData, [u8; N], u32> = map_mut(ebpf, name)?;
    let stale: Vec<_> = trie.keys().filter_map(Result::ok).filter(|k| k.data()[0] == slot as u8).collect();
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

/// One CPU's share of the host-wide unseen-key rate, per flood window
/// (2³⁰ ns, a little over a second), rounded up; 0 stays 0 (always flood).
pub(super) fn flood_cap_per_cpu(per_sec: u32, cpus: usize) -> u32 {
    if per_sec == 0 {
        return 0;
    }
    let per_window = per_sec as u64 * (1u64 << FLOOD_WINDOW_SHIFT) / 1_000_000_000;
    per_window.div_ceil(cpus.max(1) as u64).min(u32::MAX as u64) as u32
}

#[cfg(test)]
mod tests {
    use super::flood_cap_per_cpu;

    #[test]
    fn the_flood_rate_is_shared_among_cpus_per_window() {
        assert_eq!(flood_cap_per_cpu(0, 2), 0);
        // 100,000/s over a 1.0737 s window on 2 CPUs.
        assert_eq!(flood_cap_per_cpu(100_000, 2), 53_687);
        assert_eq!(flood_cap_per_cpu(1, 64), 1);
        assert_eq!(flood_cap_per_cpu(u32::MAX, 1), u32::MAX, "saturates");
    }
}
