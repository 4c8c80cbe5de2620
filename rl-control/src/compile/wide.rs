//! Wide-cell counts per rule in fact: the rule ids the datapath installs
//! (see [`part_wide_counts`]), and the pairs of rules left sharing one.

use std::collections::{BTreeMap, BTreeSet, HashMap};

use rl_common::RuleEntry;

/// Gives each rule new to the rule tables an id whose wide-cell count
/// ([`rl_common::MAP_WIDE_COUNT`]: 1,024 entries per family, by a hash of
/// the id) no other rule's shares, so that a wide flood under one rule
/// never makes another's newcomers start drained. `entries` come from
/// [`compile`] (each id *natural*: a hash of the rule's definition);
/// `held` maps each id the datapath's two rule tables hold (the rules in
/// force and those they replaced, whose cells live until the collector's
/// next walk after they leave both) to its natural id
/// ([`rl_common::natural_id`]).
///
/// A rule whose natural id the tables hold under some id keeps that id,
/// and so its buckets, whatever else changed (only its own: natural ids
/// are unique in a set); so does a cluster rule its natural id (its sync
/// knows it by that). Any other rule takes, along its natural id's probe
/// sequence (plus 8, 16, …: the next entry each), the first id that no
/// other rule has or will have and whose entry is free, else its natural
/// id, or the first along it no other rule has (more than 1,024 entries'
/// worth of rules). The steps are kept in its flags
/// ([`rl_common::RULE_STEPS_MASK`]), for the next install; entries parted
/// before may be given again.
pub fn part_wide_counts(entries: &mut [RuleEntry], held: &BTreeMap<u32, u32>) {
    use rl_common::{steps_between, wide_entry, RULE_STEPS_MASK, RULE_STEPS_SHIFT};
    let entry_of = |id: u32| wide_entry(id, 0);
    let mut held_as: HashMap<u32, u32> = HashMap::new();
    for (&id, &natural) in held {
        held_as.entry(natural).or_insert(id);
    }
    // (Entries parted before give their natural ids back.)
    for e in entries.iter_mut() {
        e.id = rl_common::natural_id(e.id, e.flags);
        e.flags &= !RULE_STEPS_MASK;
    }
    let natural: BTreeSet<u32> = entries.iter().map(|e| e.id).collect();
    let mut taken: BTreeSet<u32> = held.keys().map(|&id| entry_of(id)).collect();
    let mut claimed = BTreeSet::new();
    fn claim(
        e: &mut RuleEntry,
        own: u32,
        id: u32,
        (taken, claimed): (&mut BTreeSet<u32>, &mut BTreeSet<u32>),
    ) {
        e.flags = (e.flags & !RULE_STEPS_MASK) | steps_between(own, id) << RULE_STEPS_SHIFT;
        e.id = id;
        taken.insert(rl_common::wide_entry(id, 0));
        claimed.insert(id);
    }
    let mut open = Vec::new();
    // Cluster rules first (their ids are fixed), then the rules the tables
    // hold (their own ids only, unless a cluster rule's is the same), then
    // the new ones.
    let fixed =
        |e: &RuleEntry| e.flags & rl_common::RULE_CLUSTER != 0 || !rl_common::is_rule_id(e.id);
    for e in entries.iter_mut().filter(|e| fixed(e)) {
        let own = e.id;
        claim(e, own, own, (&mut taken, &mut claimed));
    }
    for (i, e) in entries.iter_mut().enumerate().filter(|(_, e)| !fixed(e)) {
        let own = e.id;
        match held_as.get(&own) {
            Some(&id) if !claimed.contains(&id) => {
                claim(e, own, id, (&mut taken, &mut claimed));
            }
            _ => open.push(i),
        }
    }
    for i in open {
        let own = entries[i].id;
        // The steps the flags can keep: 32 times round the entries.
        let chain =
            |steps: u32| (0..steps).map(move |k| own.wrapping_add(8 * k) & rl_common::RULE_ID_MASK);
        // No other rule's id, now or in the tables; its entry free if any
        // is (once round), else any (the tables hold at most 2,050 ids).
        let unused = |id: u32| {
            rl_common::is_rule_id(id)
                && !held.contains_key(&id)
                && !claimed.contains(&id)
                && (id == own || !natural.contains(&id))
        };
        let id = chain(rl_common::WIDE_RULE_SLOTS)
            .find(|&id| unused(id) && !taken.contains(&entry_of(id)))
            .or_else(|| chain((RULE_STEPS_MASK >> RULE_STEPS_SHIFT) + 1).find(|&id| unused(id)));
        claim(
            &mut entries[i],
            own,
            id.unwrap_or(own),
            (&mut taken, &mut claimed),
        );
    }
}

/// Pairs of rules (by name; `names` indexed like `entries`) whose
/// wide-cell counts still share an entry, where one of them may make wide
/// cells (not a cluster rule, `flood_wide_cells` on): its cells count
/// toward the other's quarter, so a wide flood under either makes the
/// newcomers of both start drained. [`part_wide_counts`] leaves such pairs
/// only among rules the tables held so (from builds before it), and past
/// 1,024 entries' worth of rules.
pub fn wide_count_sharers<'a>(
    entries: &[RuleEntry],
    names: &'a [String],
) -> Vec<(&'a str, &'a str)> {
    let may_make =
        |e: &RuleEntry| e.flags & (rl_common::RULE_CLUSTER | rl_common::RULE_NO_WIDE) == 0;
    let mut by_entry: HashMap<u32, Vec<usize>> = HashMap::new();
    for (i, e) in entries
        .iter()
        .enumerate()
        .filter(|(_, e)| rl_common::is_rule_id(e.id))
    {
        by_entry
            .entry(rl_common::wide_entry(e.id, 0))
            .or_default()
            .push(i);
    }
    let mut pairs = Vec::new();
    for group in by_entry.values() {
        for (n, &a) in group.iter().enumerate() {
            for &b in &group[n + 1..] {
                if may_make(&entries[a]) || may_make(&entries[b]) {
                    pairs.push((a.min(b), a.max(b)));
                }
            }
        }
    }
    pairs.sort_unstable();
    pairs
        .into_iter()
        .filter_map(|(a, b)| Some((names.get(a)?.as_str(), names.get(b)?.as_str())))
        .collect()
}

/// One line per pair of [`wide_count_sharers`]: what it does and how to
/// part them.
pub fn wide_count_notes(entries: &[RuleEntry], names: &[String]) -> Vec<String> {
    wide_count_sharers(entries, names)
        .into_iter()
        .map(|(a, b)| {
            format!(
                "rules {a} and {b} share a wide-cell count (kept from an older build, or past 1,024 rules): a \
                 flood under either that goes wide makes the newcomers of both start drained at /16 (IPv6 /32); \
                 to part them, rename one (a renamed rule starts its buckets fresh), or set flood_wide_cells = \
                 false on the rule to spare"
            )
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::{compile::compile, config::Config};

    fn config(text: &str) -> Config {
        Config::from_str(text, "x").unwrap()
    }

    /// Two rules, alike but for their names, whose ids fall on the same
    /// wide-count entry (searched: ids are hashes of the definitions).
    fn sharing_names() -> (String, String) {
        let rule = |n: usize| {
            format!("[[rule]]\nname = \"r{n}\"\nproto = \"udp\"\ndst_ports = [53]\nrate = 1\n")
        };
        let all: String = (0..200).map(rule).collect();
        let c = compile(&config(&format!("[default]\nrate = 5\n{all}")));
        let mut seen = HashMap::new();
        for (i, e) in c.rules.entries.iter().enumerate().skip(1) {
            if let Some(j) = seen.insert(rl_common::wide_entry(e.id, 0), i) {
                return (c.rules.names[j].clone(), c.rules.names[i].clone());
            }
        }
        panic!("200 rules on 1,024 entries with no two sharing one: the ids no longer spread as hashes");
    }

    fn ids(entries: &[RuleEntry]) -> Vec<u32> {
        entries.iter().map(|e| e.id).collect()
    }

    /// What the tables hold after installing `entries`: id ➜ natural id.
    fn held(entries: &[RuleEntry]) -> BTreeMap<u32, u32> {
        entries
            .iter()
            .map(|e| (e.id, rl_common::natural_id(e.id, e.flags)))
            .collect()
    }

    fn entry_of(e: &RuleEntry) -> u32 {
        rl_common::wide_entry(e.id, 0)
    }

    /// A pair whose ids share a wide count: each rule new to the tables
    /// gets one apart (the later in the file moves), every install of the
    /// same rules gives the same ids, and rules the tables hold keep
    /// theirs, sharing or not (said by the notes).
    #[test]
    fn rules_new_to_the_tables_get_wide_counts_of_their_own() {
        let (a, b) = sharing_names();
        let text = |extra: &str| {
            format!(
                "[default]\nrate = 5\n[[rule]]\nname = \"{a}\"\nproto = \"udp\"\ndst_ports = [53]\nrate = 1\n{extra}\
                 [[rule]]\nname = \"{b}\"\nproto = \"udp\"\ndst_ports = [53]\nrate = 1\n{extra}"
            )
        };
        let natural = compile(&config(&text(""))).rules;
        assert_eq!(entry_of(&natural.entries[1]), entry_of(&natural.entries[2]));
        assert_eq!(
            wide_count_sharers(&natural.entries, &natural.names),
            [(a.as_str(), b.as_str())]
        );

        // A fresh datapath: the later rule moves to the next free entry.
        let mut fresh = natural.entries.clone();
        part_wide_counts(&mut fresh, &BTreeMap::new());
        assert_eq!(
            fresh[..2],
            natural.entries[..2],
            "[default] and the first rule keep their ids"
        );
        assert_ne!(entry_of(&fresh[1]), entry_of(&fresh[2]));
        assert_eq!(
            fresh[2].id,
            natural.entries[2].id + 8,
            "one step along (the next entry is free)"
        );
        assert!(wide_count_sharers(&fresh, &natural.names).is_empty());
        let steps = rl_common::RULE_STEPS_MASK;
        assert!(
            fresh.iter().zip(&natural.entries).all(|(p, n)| RuleEntry {
                id: n.id,
                flags: p.flags & !steps,
                ..*p
            } == *n),
            "only ids change"
        );
        assert_eq!(
            rl_common::natural_id(fresh[2].id, fresh[2].flags),
            natural.entries[2].id,
            "the steps are kept"
        );

        // Installed again (the second table, a reload, a restart onto the
        // pins): the same ids, from the natural ones or the parted ones.
        let held = held(&fresh);
        for start in [&natural.entries, &fresh] {
            let mut again = start.clone();
            part_wide_counts(&mut again, &held);
            assert_eq!(ids(&again), ids(&fresh));
        }
        // The first rule removed and added back: the second keeps its id.
        let mut back = natural.entries.clone();
        part_wide_counts(
            &mut back,
            &held
                .iter()
                .filter(|(&id, _)| id != fresh[1].id)
                .map(|(&a, &b)| (a, b))
                .collect(),
        );
        assert_eq!(
            ids(&back),
            ids(&fresh),
            "the second rule kept its id; the first went back to its own"
        );
        let mut back = natural.entries.clone();
        back.swap(1, 2);
        part_wide_counts(&mut back, &held);
        assert_eq!(
            (back[1].id, back[2].id),
            (fresh[2].id, fresh[1].id),
            "moving rules in the file changes no id"
        );

        // Rules the tables hold keep their ids even when they share (an
        // older build's): the notes name them and say what to do.
        let held = super::tests::held(&natural.entries);
        let mut kept = natural.entries.clone();
        part_wide_counts(&mut kept, &held);
        assert_eq!(ids(&kept), ids(&natural.entries));
        let notes = wide_count_notes(&kept, &natural.names);
        assert_eq!(notes.len(), 1);
        assert!(
            notes[0].starts_with(&format!("rules {a} and {b} share a wide-cell count"))
                && notes[0].contains("rename one"),
            "{}",
            notes[0]
        );

        // A new rule beside a held one it collides with: the new one moves.
        let mut added = natural.entries.clone();
        part_wide_counts(
            &mut added,
            &held
                .iter()
                .filter(|(&id, _)| id != natural.entries[1].id)
                .map(|(&a, &b)| (a, b))
                .collect(),
        );
        assert_eq!(
            (added[2].id, added[1].id),
            (natural.entries[2].id, natural.entries[1].id + 8)
        );

        // A cluster rule keeps its id (its sync knows it by that): the other moves.
        let mut cluster = natural.entries.clone();
        cluster[2].flags |= rl_common::RULE_CLUSTER;
        part_wide_counts(&mut cluster, &BTreeMap::new());
        assert_eq!(
            (cluster[2].id, cluster[1].id),
            (natural.entries[2].id, natural.entries[1].id + 8)
        );

        // Neither may make wide cells: a shared count harms neither.
        let off = compile(&config(&text("flood_wide_cells = false\n"))).rules;
        assert_eq!(
            ids(&off.entries),
            ids(&natural.entries),
            "the setting is not part of a rule's id"
        );
        assert!(wide_count_sharers(&off.entries, &off.names).is_empty());
    }

    /// With every entry taken (more rules than entries), a rule keeps its
    /// own id if no other rule has it, else the next one no rule has.
    #[test]
    fn past_1024_entries_ids_stay_unique() {
        let held: BTreeMap<u32, u32> = (0..rl_common::WIDE_RULE_SLOTS)
            .map(|k| (0x1000_0000 + 8 * k, 0x1000_0000 + 8 * k))
            .collect();
        let mut e = [RuleEntry {
            id: 0x2000_0000,
            ..Default::default()
        }];
        part_wide_counts(&mut e, &held);
        assert_eq!(e[0].id, 0x2000_0000);
        // Its own id is another rule's (one moved onto it): the next free id.
        let mut e = [RuleEntry {
            id: 0x1000_0000,
            ..Default::default()
        }];
        let mut moved = held.clone();
        moved.insert(0x1000_0000, 0x0fff_fff8);
        part_wide_counts(&mut e, &moved);
        assert!(
            !moved.contains_key(&e[0].id) && rl_common::is_rule_id(e[0].id),
            "{:#x}",
            e[0].id
        );
    }

    /// A rule keeps the id the tables hold for it and takes no other's:
    /// not a moved rule's that its own probe sequence passes (a rule added
    /// before it in the file), nor a removed rule's that the moved rule's
    /// sequence passes.
    #[test]
    fn a_rule_takes_only_its_own_held_id() {
        let e = |id: u32| RuleEntry {
            id,
            ..Default::default()
        };
        let (x, v) = (0x0100_0000, 0x0100_0000 - 3 * 8);
        // x was moved two steps (past r = x + 8, a rule since removed).
        let moved = x + 16;
        let mut x_entry = e(x);
        x_entry.flags = 2 << rl_common::RULE_STEPS_SHIFT;
        assert_eq!(rl_common::natural_id(moved, x_entry.flags), x);
        let mut held: BTreeMap<u32, u32> = [(moved, x), (x + 8, x + 8)].into_iter().collect();
        // Removed rules hold the entries of v, v + 8 and v + 16 (ids 2²⁰
        // apart share an entry), so v's sequence goes on past x's ids.
        for k in 0..3 {
            let other = v + 8 * k + (1 << 20);
            assert_eq!(
                rl_common::wide_entry(other, 0),
                rl_common::wide_entry(v + 8 * k, 0)
            );
            held.insert(other, other);
        }
        // v is new and comes first: it takes the first id past them all.
        let mut set = [e(v), e(x)];
        part_wide_counts(&mut set, &held);
        assert_eq!(set[1].id, moved, "x keeps its id");
        assert_eq!(
            set[0].id,
            x + 24,
            "v takes none of theirs (x's natural id, the removed one's, x's): {:#x}",
            set[0].id
        );
        // x alone: its own held id, not the removed rule's.
        let mut alone = [e(x)];
        part_wide_counts(&mut alone, &held);
        assert_eq!(alone[0].id, moved);
    }
}
