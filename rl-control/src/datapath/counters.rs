//! The rules' packet and byte counters across installs: where a rule
//! stays in place (same id and name at the same entry) its counters stay
//! with it, in the pinned tables; the rest go to the daemon's totals by
//! name before the entry is rewritten, or, for a slot whose contents are
//! unknown (adopted, or left by a failed install), by the id found there.

use aya::maps::{MapData, PerCpuArray};
use rl_common::*;

use super::{read::add_stats, *};

impl Datapath {
    /// The totals this process keeps of rules its installs retired (their
    /// map entries were zeroed and reused), by name.
    pub fn retired_totals(&self) -> &StdHashMap<String, RuleStats> {
        &self.retired
    }

    /// Adds totals an earlier daemon kept of the rules it retired from
    /// this same pinned datapath (see `daemon::kept`).
    pub fn restore_retired(&mut self, kept: impl IntoIterator<Item = (String, RuleStats)>) {
        for (name, r) in kept {
            add_stats(self.retired.entry(name).or_default(), [r].iter());
        }
        self.fold_retired();
    }

    /// Past [`MAX_RETIRED_NAMES`], the totals of names no slot holds go
    /// into one [`RETIRED_FOLDED`]: automation that adds and deletes
    /// uniquely named rules must not grow the totals, `/metrics` and the
    /// kept file for good. Every count stays in the sums.
    fn fold_retired(&mut self) {
        let held: std::collections::HashSet<&str> = self
            .slots
            .iter()
            .flat_map(|c| c.names.iter().map(String::as_str))
            .collect();
        fold_absent(&mut self.retired, &held);
    }

    /// The kernel id of the rule counters' map: which pinned datapath the
    /// counters belong to (an id is not reused while the map lives).
    pub fn counters_map_id(&self) -> Result<u32, DatapathError> {
        let map = self.map_ref(MAP_RULE_STATS)?.open()?;
        Ok(map.info().map_err(|e| map_error(MAP_RULE_STATS, e))?.id())
    }

    /// Before a slot whose contents are unknown is cleared (adopted from a
    /// daemon that stopped, or left by a failed install), for each entry
    /// it `held` (read from the map) with the id of a rule of `entries` (a
    /// rule's id is a hash of its definition, its name included): where
    /// that rule stays in place, its counters stay with it (noted in
    /// `stayed`, with its name: the clearing keeps them), so they go on in
    /// the pinned tables across any number of restarts; elsewhere they go
    /// to its name (`names`) in this process's totals. Other counters are
    /// lost, as are the totals the process before kept of rule sets it
    /// retired.
    pub(super) fn retire_found_stats(
        &mut self,
        slot: u32,
        held: &[RuleEntry],
        (entries, names): (&[RuleEntry], &[String]),
        stayed: &mut Vec<(u32, String)>,
    ) -> Result<(), DatapathError> {
        let base = slot * RULE_SLOTS;
        // Entries are written from the first on: none past one never written.
        for (i, held) in held.iter().enumerate().take_while(|(_, e)| e.id != 0) {
            if !is_rule_id(held.id) {
                continue;
            }
            let idx = base + i as u32;
            if let Some(name) = entries.get(i).filter(|e| e.id == held.id).and(names.get(i)) {
                stayed.push((idx, name.clone()));
            } else if let Some((_, name)) = entries.iter().zip(names).find(|(e, _)| e.id == held.id)
            {
                self.retire_counters(idx, name.clone())?;
            }
        }
        self.failpoint("found")
    }

    /// Counters of the rules a slot held (`names`, `old` if known) go to
    /// their names' totals, but for a rule that stays in place (the same id
    /// and name in `entries`, `new_names`): its counters stay with it
    /// (noted in `stayed` as they are left, so that a failure half-way
    /// still knows them). A retire that fails notes itself and the rest in
    /// `stayed` too: the failed install retires them all (one already
    /// retired reads zero), where they would be left in a slot no one
    /// reads, and the totals would go down.
    pub(super) fn retire_stats(
        &mut self,
        base: u32,
        (names, old): (&[String], Option<&[RuleEntry]>),
        (entries, new_names): (&[RuleEntry], &[String]),
        stayed: &mut Vec<(u32, String)>,
    ) -> Result<(), DatapathError> {
        for (i, name) in names.iter().enumerate() {
            let same_id = old
                .and_then(|o| o.get(i))
                .zip(entries.get(i))
                .is_some_and(|(o, e)| o.id == e.id);
            if same_id && new_names.get(i) == Some(name) {
                stayed.push((base + i as u32, name.clone()));
                continue;
            }
            let retired = self
                .failpoint("retiring")
                .and_then(|()| self.retire_counters(base + i as u32, name.clone()));
            if let Err(e) = retired {
                stayed.extend((i..names.len()).map(|j| (base + j as u32, names[j].clone())));
                return Err(e);
            }
        }
        Ok(())
    }

    /// The counters of rule-table entry `idx` go to `name`'s totals: read,
    /// zeroed, then added, so that a failure on the way loses them rather
    /// than have the next install (whose slot is then unknown) count them
    /// twice.
    pub(super) fn retire_counters(&mut self, idx: u32, name: String) -> Result<(), DatapathError> {
        let per_cpu = {
            let stats: PerCpuArray<&MapData, RuleStats> = map_ref(&self.ebpf, MAP_RULE_STATS)?;
            stats
                .get(&idx, 0)
                .map_err(|e| map_error(MAP_RULE_STATS, e))?
        };
        // As if the zeroing write failed.
        self.failpoint("zeroing")?;
        self.zero_counters(idx)?;
        add_stats(self.retired.entry(name).or_default(), per_cpu.iter());
        self.fold_retired();
        Ok(())
    }

    /// Zeroes the counters of `slot`'s entries but those `kept`.
    pub(super) fn clear_counters(&mut self, slot: u32, kept: &[u32]) -> Result<(), DatapathError> {
        for idx in (slot * RULE_SLOTS..(slot + 1) * RULE_SLOTS).filter(|i| !kept.contains(i)) {
            self.zero_counters(idx)?;
        }
        Ok(())
    }

    /// Zeroes entry `idx`'s counters on every CPU.
    fn zero_counters(&mut self, idx: u32) -> Result<(), DatapathError> {
        let zero = aya::maps::PerCpuValues::try_from(vec![RuleStats::default(); self.cpus])
            .map_err(|e| map_error(MAP_RULE_STATS, e))?;
        let mut stats: PerCpuArray<&mut MapData, RuleStats> =
            map_mut(&mut self.ebpf, MAP_RULE_STATS)?;
        stats
            .set(idx, zero, 0)
            .map_err(|e| map_error(MAP_RULE_STATS, e))
    }
}

/// Retired rule names kept apart in the totals before the absent ones are
/// folded into [`RETIRED_FOLDED`].
pub const MAX_RETIRED_NAMES: usize = 1024;
/// The name the totals of folded retired rules go under.
pub const RETIRED_FOLDED: &str = "(retired)";

/// Past [`MAX_RETIRED_NAMES`] names, moves the totals of every name not in
/// `held` into [`RETIRED_FOLDED`].
fn fold_absent(
    retired: &mut StdHashMap<String, RuleStats>,
    held: &std::collections::HashSet<&str>,
) {
    if retired.len() <= MAX_RETIRED_NAMES {
        return;
    }
    let absent: Vec<String> = retired
        .keys()
        .filter(|n| !held.contains(n.as_str()) && *n != RETIRED_FOLDED)
        .cloned()
        .collect();
    let mut folded = retired.remove(RETIRED_FOLDED).unwrap_or_default();
    for name in absent {
        if let Some(r) = retired.remove(&name) {
            add_stats(&mut folded, [r].iter());
        }
    }
    retired.insert(RETIRED_FOLDED.to_string(), folded);
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Past the cap, absent names fold into one entry; held names stay;
    /// no count is lost.
    #[test]
    fn retired_names_past_the_cap_fold_into_one() {
        let one = RuleStats {
            passed_pkts: 1,
            dropped_pkts: 2,
            ..Default::default()
        };
        let mut retired: StdHashMap<String, RuleStats> = (0..MAX_RETIRED_NAMES)
            .map(|i| (format!("r{i}"), one))
            .collect();
        let held: std::collections::HashSet<&str> = ["r0", "r7"].into_iter().collect();
        fold_absent(&mut retired, &held);
        assert_eq!(retired.len(), MAX_RETIRED_NAMES, "at the cap: kept apart");
        retired.insert("one-more".into(), one);
        fold_absent(&mut retired, &held);
        assert_eq!(retired.len(), 3, "{:?}", retired.keys());
        assert_eq!(retired["r0"], one);
        let f = retired[RETIRED_FOLDED];
        assert_eq!(
            (f.passed_pkts, f.dropped_pkts),
            (
                MAX_RETIRED_NAMES as u64 - 1,
                2 * (MAX_RETIRED_NAMES as u64 - 1)
            )
        );
    }
}
