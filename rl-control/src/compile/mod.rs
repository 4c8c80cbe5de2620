//! Config ➜ map entries: the only place that knows both the rule file and the
//! datapath's layouts.
//!
//! Classification is precomputed so the datapath's per-packet cost does not
//! grow with the number of rules or CIDRs:
//! - one LPM lookup of the source gives allow/deny and the source's *class*
//!   (which rules' `src` lists contain it); for IPv4 an array indexed by the
//!   source's /16 answers first, and the trie is walked only for sources in
//!   a /16 that holds longer CIDRs;
//! - one array lookup by (protocol, port, SYN) gives the first rule without a
//!   `src` list that matches, and an *L4 class* when rules with `src` lists
//!   come before it;
//! - only then, one hash lookup of (L4 class, source class) picks the rule.

use std::{
    collections::{BTreeMap, BTreeSet, HashMap},
    hash::{Hash, Hasher},
    net::IpAddr,
};

use rl_common::{
    prefix_mask_words, CidrEntry, L4Entry, LimitEntry, RuleEntry, CFG_LPM_V4, CFG_LPM_V6,
    CFG_RULES, DIR16_LEN, DIR16_LOOKUP, L4_ICMP, L4_ICMPV6, L4_OTHER, L4_SLOT_LEN, L4_TCP, L4_TCP_SYN, L4_UDP, LIMIT_BYTES,
    LIMIT_FIXED, LIMIT_GCRA, LIMIT_SLIDING, LIST_ALLOW, LIST_DENY, LIST_NONE, MAX_LIMITS, RULE_ELASTIC,
    RULE_SHADOW,
};

use crate::{
    config::rules::{Action, Algorithm, KeyScope, Mode, Proto, Rate, Rule, Unit},
    config::units::Cidr,
    config::{Config, FragmentOrphans},
};

const NS: u128 = 1_000_000_000;

/// What the datapath needs from a [`Config`].
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Compiled {
    /// Capacity of each family's bucket table (fixed at load time).
    pub max_sources: u32,
    /// Capacity of each family's prefix-cell table (fixed at load time).
    pub flood_prefixes: u32,
    pub rules: RuleSet,
}

/// The runtime knobs of flood mode, written with each rule set.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Tuning {
    /// Host-wide unseen keys per second before flood mode (the daemon
    /// divides it among CPUs).
    pub flood_new_keys_per_sec: u32,
    pub cell_mask4: u32,
    pub cell_mask6: [u32; 4],
    /// `rl_common::DP_*` bits (`datapath.flood_wide_cells`).
    pub flags: u8,
    pub fragment_ttl_ms: u16,
    /// `rl_common::FRAG_ORPHANS_*`.
    pub fragment_orphans: u16,
}

/// One slot's worth of classification tables and rule entries.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct RuleSet {
    /// `CFG_*` bits.
    pub flags: u32,
    pub tuning: Tuning,
    /// Index 0 is `[default]`, then the rules in file order.
    pub entries: Vec<RuleEntry>,
    /// Names, indexed like `entries` (`"default"` first).
    pub names: Vec<String>,
    /// [`L4_SLOT_LEN`] packed [`L4Entry`] values.
    pub l4: Vec<u32>,
    /// Trie entries and their packed [`CidrEntry`] values.
    pub lpm: Vec<(Cidr, u32)>,
    /// The IPv4 first level ([`rl_common::MAP_DIR16`]): [`DIR16_LEN`]
    /// values, or none when no IPv4 CIDR is listed.
    pub dir16: Vec<u32>,
    /// (L4 class, source class) ➜ rule index.
    pub decide: Vec<((u16, u16), u32)>,
}

impl RuleSet {
    /// The rule index the datapath picks for a packet: the same lookups, in
    /// the same order, from the compiled tables. Host tests compare it with
    /// a direct reading of the precedence rules.
    pub fn classify(&self, src: IpAddr, l4_index: u32) -> Verdict {
        let trie = || {
            self.lpm
                .iter()
                .filter(|(c, _)| c.covers(&Cidr::host(src)))
                .max_by_key(|(c, _)| c.len)
                .map_or(0, |(_, v)| *v)
        };
        let v = match src {
            IpAddr::V4(a) if !self.dir16.is_empty() => match self.dir16[(u32::from(a) >> 16) as usize] {
                v if v & DIR16_LOOKUP != 0 => trie(),
                v => v,
            },
            _ => trie(),
        };
        let (list, src_class) = (CidrEntry::list(v), CidrEntry::src_class(v));
        match list {
            LIST_ALLOW => return Verdict::Allow,
            LIST_DENY => return Verdict::Deny,
            _ => {}
        }
        let e = self.l4[l4_index as usize];
        let mut rule = L4Entry::first(e) as u32;
        if L4Entry::class(e) != 0 {
            if let Some((_, r)) = self.decide.iter().find(|(k, _)| *k == (L4Entry::class(e), src_class)) {
                rule = *r;
            }
        }
        Verdict::Rule(rule)
    }
}

/// Where a packet goes.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Verdict {
    Allow,
    Deny,
    /// Charged to this rule index (0 = `[default]`).
    Rule(u32),
}

/// `rules` (compiled from `config`) as they stand while the cluster is
/// degraded with `on_failure = mode`: every `scope = "cluster"` packet rule
/// passes everything and counts it as shadow (`open`) or drops everything
/// (`closed`: no burst, no rate). Rule ids are kept, so the buckets are
/// where they were when Redis answers again; `local` changes nothing.
pub fn with_failure_mode(config: &Config, mut rules: RuleSet, mode: crate::cluster::OnFailure) -> RuleSet {
    use crate::cluster::OnFailure;
    for (entry, rule) in rules.entries.iter_mut().skip(1).zip(&config.rules) {
        if rule.scope != crate::config::rules::Scope::Cluster {
            continue;
        }
        match mode {
            OnFailure::Local => {}
            OnFailure::Open => entry.flags |= rl_common::RULE_SHADOW,
            OnFailure::Closed => {
                for l in entry.limits.iter_mut().take(entry.n_limits as usize) {
                    // A packet costs more than the bucket can ever hold.
                    (l.a, l.b, l.shift) = (u64::MAX / 4, 0, 0);
                }
            }
        }
    }
    rules
}

pub fn compile(config: &Config) -> Compiled {
    Compiled {
        max_sources: config.datapath.max_sources,
        flood_prefixes: config.datapath.flood_prefixes,
        rules: compile_rules(config),
    }
}

fn compile_rules(config: &Config) -> RuleSet {
    let d = &config.datapath;
    let mut entries = Vec::with_capacity(config.rules.len() + 1);
    let mut names = vec!["default".to_string()];
    let default_rate = Rate { amount: config.default.rate, per_secs: 1, burst: config.default.burst };
    entries.push(RuleEntry {
        id: stable_id(&("default", default_rate, d.ipv4_prefix, d.ipv6_prefix)),
        n_limits: 1,
        v4_mask: prefix_mask_words::<1>(d.ipv4_prefix)[0],
        v6_mask: prefix_mask_words::<4>(d.ipv6_prefix),
        limits: [gcra(Unit::Packets, &default_rate), LimitEntry::default(), LimitEntry::default(), LimitEntry::default()],
        ..RuleEntry::default()
    });
    for r in &config.rules {
        names.push(r.name.clone());
        entries.push(rule_entry(r, d.ipv4_prefix, d.ipv6_prefix));
    }
    // Wide cells, per rule: its own `flood_wide_cells`, else [datapath]'s.
    let wide: Vec<bool> = std::iter::once(d.flood_wide_cells).chain(config.rules.iter().map(|r| r.wide_cells.0.unwrap_or(d.flood_wide_cells))).collect();
    for (e, &on) in entries.iter_mut().zip(&wide) {
        if !on {
            e.flags |= rl_common::RULE_NO_WIDE;
        }
    }
    // Unique ids within the set (a collision would make two rules share buckets).
    let mut used = BTreeSet::new();
    for e in entries.iter_mut() {
        while !used.insert(e.id) {
            // Within the id bits: the key-kind bits above stay clear.
            e.id = e.id.wrapping_add(8) & rl_common::RULE_ID_MASK;
        }
    }

    let (lpm, src_classes) = compile_sources(config);
    let (l4, decide) = compile_l4(&config.rules, &src_classes);
    let mut flags = 0;
    let mut dir16 = Vec::new();
    if lpm.iter().any(|(c, _)| c.addr.is_ipv4()) {
        flags |= CFG_LPM_V4;
        dir16 = compile_dir16(&lpm);
    }
    if lpm.iter().any(|(c, _)| c.addr.is_ipv6()) {
        flags |= CFG_LPM_V6;
    }
    if !config.rules.is_empty() {
        flags |= CFG_RULES;
    }
    let d = &config.datapath;
    let tuning = Tuning {
        flood_new_keys_per_sec: d.flood_new_keys_per_sec,
        cell_mask4: prefix_mask_words::<1>(d.flood_prefix_v4)[0],
        cell_mask6: prefix_mask_words::<4>(d.flood_prefix_v6),
        // (Read by programs before per-rule settings: none may go wide.)
        flags: if wide.contains(&true) { 0 } else { rl_common::DP_NO_WIDE_CELLS },
        fragment_ttl_ms: d.fragment_ttl_ms,
        fragment_orphans: match d.fragment_orphans {
            FragmentOrphans::Drop => rl_common::FRAG_ORPHANS_DROP,
            FragmentOrphans::Source => rl_common::FRAG_ORPHANS_SOURCE,
        },
    };
    RuleSet { flags, tuning, entries, names, l4, lpm, dir16, decide }
}

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
    fn claim(e: &mut RuleEntry, own: u32, id: u32, (taken, claimed): (&mut BTreeSet<u32>, &mut BTreeSet<u32>)) {
        e.flags = (e.flags & !RULE_STEPS_MASK) | steps_between(own, id) << RULE_STEPS_SHIFT;
        e.id = id;
        taken.insert(rl_common::wide_entry(id, 0));
        claimed.insert(id);
    }
    let mut open = Vec::new();
    // Cluster rules first (their ids are fixed), then the rules the tables
    // hold (their own ids only, unless a cluster rule's is the same), then
    // the new ones.
    let fixed = |e: &RuleEntry| e.flags & rl_common::RULE_CLUSTER != 0 || !rl_common::is_rule_id(e.id);
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
        let chain = |steps: u32| (0..steps).map(move |k| own.wrapping_add(8 * k) & rl_common::RULE_ID_MASK);
        // No other rule's id, now or in the tables; its entry free if any
        // is (once round), else any (the tables hold at most 2,050 ids).
        let unused = |id: u32| {
            rl_common::is_rule_id(id) && !held.contains_key(&id) && !claimed.contains(&id) && (id == own || !natural.contains(&id))
        };
        let id = chain(rl_common::WIDE_RULE_SLOTS)
            .find(|&id| unused(id) && !taken.contains(&entry_of(id)))
            .or_else(|| chain((RULE_STEPS_MASK >> RULE_STEPS_SHIFT) + 1).find(|&id| unused(id)));
        claim(&mut entries[i], own, id.unwrap_or(own), (&mut taken, &mut claimed));
    }
}

/// Pairs of rules (by name; `names` indexed like `entries`) whose
/// wide-cell counts still share an entry, where one of them may make wide
/// cells (not a cluster rule, `flood_wide_cells` on): its cells count
/// toward the other's quarter, so a wide flood under either makes the
/// newcomers of both start drained. [`part_wide_counts`] leaves such pairs
/// only among rules the tables held so (from builds before it), and past
/// 1,024 entries' worth of rules.
pub fn wide_count_sharers<'a>(entries: &[RuleEntry], names: &'a [String]) -> Vec<(&'a str, &'a str)> {
    let may_make = |e: &RuleEntry| e.flags & (rl_common::RULE_CLUSTER | rl_common::RULE_NO_WIDE) == 0;
    let mut by_entry: HashMap<u32, Vec<usize>> = HashMap::new();
    for (i, e) in entries.iter().enumerate().filter(|(_, e)| rl_common::is_rule_id(e.id)) {
        by_entry.entry(rl_common::wide_entry(e.id, 0)).or_default().push(i);
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
    pairs.into_iter().filter_map(|(a, b)| Some((names.get(a)?.as_str(), names.get(b)?.as_str()))).collect()
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

/// A 32-bit id of a definition, low 3 bits 0. Stable across processes and
/// builds (FNV-1a over the derived `Hash` stream, not `DefaultHasher`,
/// whose algorithm may change): a restarted or upgraded daemon that adopts
/// pinned maps finds each unchanged rule's buckets under the same id.
fn stable_id(what: &impl Hash) -> u32 {
    let v = stable_hash(what, 0);
    ((v ^ (v >> 32)) as u32) & rl_common::RULE_ID_MASK
}

/// A 64-bit hash that every process, build and host computes alike
/// (FNV-1a from its offset basis xor `seed` over the derived `Hash`
/// stream): rule ids, and the names cluster rules and buckets have in Redis.
pub fn stable_hash(what: &impl Hash, seed: u64) -> u64 {
    let mut h = Fnv1a(0xcbf2_9ce4_8422_2325 ^ seed);
    what.hash(&mut h);
    h.finish()
}

/// 64-bit FNV-1a.
struct Fnv1a(u64);

impl Hasher for Fnv1a {
    fn finish(&self) -> u64 {
        self.0
    }
    fn write(&mut self, bytes: &[u8]) {
        for b in bytes {
            self.0 = (self.0 ^ *b as u64).wrapping_mul(0x0100_0000_01b3);
        }
    }
}

mod classify;
mod entries;

use classify::{compile_dir16, compile_l4, compile_sources};
use entries::gcra;
pub use entries::{limit_entry, rule_entry};

#[cfg(test)]
mod tests {
    use super::{classify::l4_ranges, *};
    use proptest::prelude::*;

    fn config(text: &str) -> Config {
        Config::from_str(text, "x").unwrap()
    }

    #[test]
    fn compiles_the_default_limit_and_masks() {
        let c = compile(&config("[datapath]\nipv4_prefix = 24\nipv6_prefix = 48\n[default]\nrate = 100\nburst = 7\n"));
        let d = &c.rules.entries[0];
        assert_eq!((d.limits[0].a, d.limits[0].b, d.n_limits), (10_000_000, 70_000_000, 1));
        assert_eq!(d.v4_mask.to_ne_bytes(), [255, 255, 255, 0]);
        assert_eq!(d.v6_mask[1].to_ne_bytes(), [255, 255, 0, 0]);
        assert_eq!(c.rules.flags, 0, "no rules, no CIDRs: the datapath skips classification");
        assert_eq!(c.max_sources, 1 << 20);
    }

    #[test]
    fn unchanged_rules_keep_their_ids_and_changed_ones_do_not() {
        let a = compile(&config("[default]\nrate = 5\n[[rule]]\nname = \"a\"\nrate = 1\n[[rule]]\nname = \"b\"\nrate = 2\n"));
        let b = compile(&config("[default]\nrate = 5\n[[rule]]\nname = \"b\"\nrate = 2\n[[rule]]\nname = \"a\"\nrate = 3\n"));
        assert_eq!(a.rules.entries[0].id, b.rules.entries[0].id, "default unchanged");
        assert_eq!(a.rules.entries[2].id, b.rules.entries[1].id, "rule b unchanged (moved)");
        assert_ne!(a.rules.entries[1].id, b.rules.entries[2].id, "rule a changed its rate");
        assert!(a.rules.entries.iter().all(|e| e.id & 7 == 0));
    }

    /// Two rules, alike but for their names, whose ids fall on the same
    /// wide-count entry (searched: ids are hashes of the definitions).
    fn sharing_names() -> (String, String) {
        let rule = |n: usize| format!("[[rule]]\nname = \"r{n}\"\nproto = \"udp\"\ndst_ports = [53]\nrate = 1\n");
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
        entries.iter().map(|e| (e.id, rl_common::natural_id(e.id, e.flags))).collect()
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
        assert_eq!(wide_count_sharers(&natural.entries, &natural.names), [(a.as_str(), b.as_str())]);

        // A fresh datapath: the later rule moves to the next free entry.
        let mut fresh = natural.entries.clone();
        part_wide_counts(&mut fresh, &BTreeMap::new());
        assert_eq!(fresh[..2], natural.entries[..2], "[default] and the first rule keep their ids");
        assert_ne!(entry_of(&fresh[1]), entry_of(&fresh[2]));
        assert_eq!(fresh[2].id, natural.entries[2].id + 8, "one step along (the next entry is free)");
        assert!(wide_count_sharers(&fresh, &natural.names).is_empty());
        let steps = rl_common::RULE_STEPS_MASK;
        assert!(fresh.iter().zip(&natural.entries).all(|(p, n)| RuleEntry { id: n.id, flags: p.flags & !steps, ..*p } == *n), "only ids change");
        assert_eq!(rl_common::natural_id(fresh[2].id, fresh[2].flags), natural.entries[2].id, "the steps are kept");

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
        part_wide_counts(&mut back, &held.iter().filter(|(&id, _)| id != fresh[1].id).map(|(&a, &b)| (a, b)).collect());
        assert_eq!(ids(&back), ids(&fresh), "the second rule kept its id; the first went back to its own");
        let mut back = natural.entries.clone();
        back.swap(1, 2);
        part_wide_counts(&mut back, &held);
        assert_eq!((back[1].id, back[2].id), (fresh[2].id, fresh[1].id), "moving rules in the file changes no id");

        // Rules the tables hold keep their ids even when they share (an
        // older build's): the notes name them and say what to do.
        let held = super::tests::held(&natural.entries);
        let mut kept = natural.entries.clone();
        part_wide_counts(&mut kept, &held);
        assert_eq!(ids(&kept), ids(&natural.entries));
        let notes = wide_count_notes(&kept, &natural.names);
        assert_eq!(notes.len(), 1);
        assert!(notes[0].starts_with(&format!("rules {a} and {b} share a wide-cell count")) && notes[0].contains("rename one"), "{}", notes[0]);

        // A new rule beside a held one it collides with: the new one moves.
        let mut added = natural.entries.clone();
        part_wide_counts(&mut added, &held.iter().filter(|(&id, _)| id != natural.entries[1].id).map(|(&a, &b)| (a, b)).collect());
        assert_eq!((added[2].id, added[1].id), (natural.entries[2].id, natural.entries[1].id + 8));

        // A cluster rule keeps its id (its sync knows it by that): the other moves.
        let mut cluster = natural.entries.clone();
        cluster[2].flags |= rl_common::RULE_CLUSTER;
        part_wide_counts(&mut cluster, &BTreeMap::new());
        assert_eq!((cluster[2].id, cluster[1].id), (natural.entries[2].id, natural.entries[1].id + 8));

        // Neither may make wide cells: a shared count harms neither.
        let off = compile(&config(&text("flood_wide_cells = false\n"))).rules;
        assert_eq!(ids(&off.entries), ids(&natural.entries), "the setting is not part of a rule's id");
        assert!(wide_count_sharers(&off.entries, &off.names).is_empty());
    }

    /// With every entry taken (more rules than entries), a rule keeps its
    /// own id if no other rule has it, else the next one no rule has.
    #[test]
    fn past_1024_entries_ids_stay_unique() {
        let held: BTreeMap<u32, u32> = (0..rl_common::WIDE_RULE_SLOTS).map(|k| (0x1000_0000 + 8 * k, 0x1000_0000 + 8 * k)).collect();
        let mut e = [RuleEntry { id: 0x2000_0000, ..Default::default() }];
        part_wide_counts(&mut e, &held);
        assert_eq!(e[0].id, 0x2000_0000);
        // Its own id is another rule's (one moved onto it): the next free id.
        let mut e = [RuleEntry { id: 0x1000_0000, ..Default::default() }];
        let mut moved = held.clone();
        moved.insert(0x1000_0000, 0x0fff_fff8);
        part_wide_counts(&mut e, &moved);
        assert!(!moved.contains_key(&e[0].id) && rl_common::is_rule_id(e[0].id), "{:#x}", e[0].id);
    }

    /// A rule keeps the id the tables hold for it and takes no other's:
    /// not a moved rule's that its own probe sequence passes (a rule added
    /// before it in the file), nor a removed rule's that the moved rule's
    /// sequence passes.
    #[test]
    fn a_rule_takes_only_its_own_held_id() {
        let e = |id: u32| RuleEntry { id, ..Default::default() };
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
            assert_eq!(rl_common::wide_entry(other, 0), rl_common::wide_entry(v + 8 * k, 0));
            held.insert(other, other);
        }
        // v is new and comes first: it takes the first id past them all.
        let mut set = [e(v), e(x)];
        part_wide_counts(&mut set, &held);
        assert_eq!(set[1].id, moved, "x keeps its id");
        assert_eq!(set[0].id, x + 24, "v takes none of theirs (x's natural id, the removed one's, x's): {:#x}", set[0].id);
        // x alone: its own held id, not the removed rule's.
        let mut alone = [e(x)];
        part_wide_counts(&mut alone, &held);
        assert_eq!(alone[0].id, moved);
    }

    #[test]
    fn rule_ids_do_not_depend_on_the_process_or_the_build() {
        // A restarted or upgraded daemon adopts the pinned buckets by these
        // ids: if this value changes, every upgrade resets every bucket.
        let c = compile(&config("[default]\nrate = 5\n[[rule]]\nname = \"a\"\nproto = \"udp\"\ndst_ports = [53]\nrate = 1\n"));
        let ids: Vec<u32> = c.rules.entries.iter().map(|e| e.id).collect();
        assert_eq!(ids, [0x1931_c660, 0x2047_19f0]);
    }

    #[test]
    fn a_rules_flood_wide_cells_wins_over_the_datapaths_and_keeps_its_id() {
        let rules = "[[rule]]\nname = \"a\"\nrate = 1\n[[rule]]\nname = \"b\"\nrate = 1\nflood_wide_cells = false\n[[rule]]\nname = \"c\"\nrate = 1\nflood_wide_cells = true\n";
        let no_wide = |c: &Compiled| c.rules.entries.iter().map(|e| e.flags & rl_common::RULE_NO_WIDE != 0).collect::<Vec<_>>();
        let on = compile(&config(&format!("[default]\nrate = 5\n{rules}")));
        assert_eq!(no_wide(&on), [false, false, true, false], "[default], a, b, c");
        assert_eq!(on.rules.tuning.flags & rl_common::DP_NO_WIDE_CELLS, 0);
        let off = compile(&config(&format!("[datapath]\nflood_wide_cells = false\n[default]\nrate = 5\n{rules}")));
        assert_eq!(no_wide(&off), [true, true, true, false]);
        assert_eq!(off.rules.tuning.flags & rl_common::DP_NO_WIDE_CELLS, 0, "c may still go wide");
        let none = compile(&config("[datapath]\nflood_wide_cells = false\n[default]\nrate = 5\n[[rule]]\nname = \"a\"\nrate = 1\n"));
        assert_eq!(none.rules.tuning.flags, rl_common::DP_NO_WIDE_CELLS, "none may: programs that read only the datapath's flag");
        // Not part of a rule's state: the same ids with or without it.
        let plain = compile(&config("[default]\nrate = 5\n[[rule]]\nname = \"a\"\nrate = 1\n[[rule]]\nname = \"b\"\nrate = 1\n[[rule]]\nname = \"c\"\nrate = 1\n"));
        let ids = |c: &Compiled| c.rules.entries.iter().map(|e| e.id).collect::<Vec<_>>();
        assert_eq!(ids(&on), ids(&plain));
    }

    #[test]
    fn limits_compile_per_algorithm_and_unit() {
        let c = compile(&config(
            "[default]\nrate = 5\n[[rule]]\nname = \"a\"\nbytes = \"1MB\"\nbyte_burst = \"2MB\"\n\
             [[rule]]\nname = \"b\"\nrate = 100\nper = \"10s\"\nalgorithm = \"sliding_window\"\n\
             [[rule]]\nname = \"c\"\nrate = 10\nburst = 20\nmode = \"soft\"\nsoft_percent = 50\n",
        ));
        let a = c.rules.entries[1].limits[0];
        assert_eq!(a.kind, LIMIT_GCRA | LIMIT_BYTES);
        // 1 MB/s = 1000 ns per byte; a 1000-byte packet costs 1 ms.
        assert_eq!((1000 * a.a) >> a.shift, 1_000_000);
        assert_eq!(a.b, 2_000_000_000, "2 MB of burst lasts 2 s");
        let b = c.rules.entries[2].limits[0];
        assert_eq!((b.kind, b.a, b.b, b.shift), (LIMIT_SLIDING, 10_000_000_000, 100, 0));
        let soft = c.rules.entries[3].limits[0];
        assert_eq!((soft.a, soft.b), (66_666_667, 66_666_667 * 30), "15/s, burst 30");
        // Packet limits compile to exactly rl_common::Limit's interval and span.
        for (amount, per, burst) in [(7, 1, 3), (3, 1, 1), (200, 10, 1000), (1_000_000_000, 1, 5)] {
            let l = gcra(Unit::Packets, &Rate { amount, per_secs: per, burst });
            let want = rl_common::Limit::new(amount, per * 1_000_000_000, burst).unwrap();
            assert_eq!((l.a, l.b, l.shift), (want.interval_ns, want.burst_span_ns, 0), "{amount}/{per}s burst {burst}");
        }
    }

    /// The precedence rules read directly from the config: allow, deny, the
    /// first matching rule in file order, the default.
    fn reference(config: &Config, src: IpAddr, l4_index: u32) -> Verdict {
        let host = Cidr::host(src);
        if config.allow.iter().any(|c| c.covers(&host)) {
            return Verdict::Allow;
        }
        if config.deny.iter().any(|c| c.covers(&host)) {
            return Verdict::Deny;
        }
        for (i, r) in config.rules.iter().enumerate() {
            let l4 = l4_ranges(r).iter().any(|&(a, b)| a <= l4_index && l4_index <= b);
            let src_ok = r.src.is_empty() || r.src.iter().any(|c| c.covers(&host));
            if l4 && src_ok {
                return Verdict::Rule(i as u32 + 1);
            }
        }
        Verdict::Rule(0)
    }

    #[test]
    fn allow_wins_over_a_longer_deny_and_deny_over_rules() {
        let c = config(
            "[default]\nrate = 5\n[[allow]]\ncidr = \"10.0.0.0/8\"\n[[deny]]\ncidr = \"10.1.0.0/16\"\n\
             [[deny]]\ncidr = \"192.0.2.0/24\"\n[[rule]]\nname = \"r\"\nsrc = [\"192.0.2.0/25\"]\nrate = 1\n",
        );
        let rs = compile(&c).rules;
        let ip = |s: &str| s.parse::<IpAddr>().unwrap();
        assert_eq!(rs.classify(ip("10.1.2.3"), L4_UDP + 53), Verdict::Allow);
        assert_eq!(rs.classify(ip("192.0.2.9"), L4_UDP + 53), Verdict::Deny);
        assert_eq!(rs.classify(ip("198.51.100.1"), L4_UDP + 53), Verdict::Rule(0));
    }

    #[test]
    fn the_ipv4_first_level_answers_whole_16s_and_defers_to_the_trie_inside_refined_ones() {
        let c = config(
            "[default]\nrate = 5\n[[allow]]\ncidr = \"10.0.0.0/8\"\n[[deny]]\ncidr = \"10.1.2.0/24\"\n\
             [[deny]]\ncidr = \"192.0.2.0/24\"\n[[rule]]\nname = \"r\"\nsrc = [\"0.0.0.0/0\"]\nrate = 1\n",
        );
        let rs = compile(&c).rules;
        let ip = |s: &str| s.parse::<IpAddr>().unwrap();
        let at = |a: &str| rs.dir16[(u32::from(a.parse::<std::net::Ipv4Addr>().unwrap()) >> 16) as usize];
        assert_eq!(rs.dir16.len(), DIR16_LEN as usize);
        assert_eq!(CidrEntry::list(at("10.200.0.1")), LIST_ALLOW, "a /8 fills its 256 /16s");
        assert_eq!(at("10.1.0.0"), DIR16_LOOKUP, "a /24 inside sends its /16 to the trie");
        assert_eq!(at("192.0.0.0"), DIR16_LOOKUP);
        let anywhere = at("203.0.113.1");
        assert_eq!((CidrEntry::list(anywhere), CidrEntry::src_class(anywhere) != 0), (LIST_NONE, true), "/0 src list");
        assert_eq!(rs.classify(ip("10.1.2.3"), L4_UDP + 53), Verdict::Allow);
        assert_eq!(rs.classify(ip("10.1.9.9"), L4_UDP + 53), Verdict::Allow);
        assert_eq!(rs.classify(ip("192.0.2.1"), L4_UDP + 53), Verdict::Deny);
        assert_eq!(rs.classify(ip("192.0.3.1"), L4_UDP + 53), Verdict::Rule(1));
        assert_eq!(rs.classify(ip("203.0.113.1"), L4_UDP + 53), Verdict::Rule(1));
        // IPv6 only: no first level.
        let v6 = compile(&config("[default]\nrate = 5\n[[deny]]\ncidr = \"2001:db8::/32\"\n")).rules;
        assert!(v6.dir16.is_empty());
    }

    fn arb_rule(i: usize) -> impl Strategy<Value = String> {
        let proto = prop_oneof![Just("any"), Just("tcp"), Just("udp"), Just("icmp"), Just("icmpv6")];
        let ports = proptest::option::of(proptest::collection::vec((1u16..40, 0u16..5), 1..3));
        let syn = any::<bool>();
        let src = proptest::option::of(proptest::collection::vec((0u8..4, prop_oneof![Just(8u8), Just(16), Just(24)]), 1..3));
        (proto, ports, syn, src).prop_map(move |(proto, ports, syn, src)| {
            let mut s = format!("[[rule]]\nname = \"r{i}\"\nrate = 1\nproto = \"{proto}\"\n");
            if let (Some(p), false) = (&ports, proto.starts_with("icmp")) {
                let list: Vec<String> = p.iter().map(|(a, w)| format!("\"{}-{}\"", a, a + w)).collect();
                s += &format!("dst_ports = [{}]\n", list.join(", "));
            }
            if syn && proto == "tcp" {
                s += "tcp_flags = \"syn\"\n";
            }
            if let Some(src) = src {
                let list: Vec<String> = src
                    .iter()
                    .map(|(n, len)| {
                        let net = crate::config::units::mask(&[10, *n, *n, 0], *len);
                        format!("\"{}.{}.{}.{}/{len}\"", net[0], net[1], net[2], net[3])
                    })
                    .collect();
                s += &format!("src = [{}]\n", list.join(", "));
            }
            s
        })
    }

    proptest! {
        #![proptest_config(ProptestConfig::with_cases(64))]
        /// The compiled tables pick exactly the verdict the precedence rules
        /// give, for random rule sets and packets.
        #[test]
        fn compiled_classification_equals_first_match(
            rules in proptest::collection::vec(0usize..1, 0..8).prop_flat_map(|v| {
                v.iter().enumerate().map(|(i, _)| arb_rule(i)).collect::<Vec<_>>()
            }),
            allow in proptest::option::of((0u8..4, 0u8..4)),
            deny in proptest::option::of((0u8..4, 0u8..4)),
            packets in proptest::collection::vec((0u8..4, 0u8..4, 0u32..6, 0u16..45), 1..60),
        ) {
            let mut text = String::from("[default]\nrate = 5\n");
            if let Some((a, b)) = allow { text += &format!("[[allow]]\ncidr = \"10.{a}.{b}.0/24\"\n"); }
            if let Some((a, _)) = deny { text += &format!("[[deny]]\ncidr = \"10.{a}.0.0/16\"\n"); }
            text += &rules.concat();
            let c = config(&text);
            let rs = compile(&c).rules;
            for (a, b, kind, port) in packets {
                let src = IpAddr::from([10, a, b, 7]);
                let l4 = match kind {
                    0 => L4_TCP + port as u32,
                    1 => L4_TCP_SYN + port as u32,
                    2 => L4_UDP + port as u32,
                    3 => L4_ICMP,
                    4 => L4_ICMPV6,
                    _ => L4_OTHER,
                };
                prop_assert_eq!(rs.classify(src, l4), reference(&c, src, l4), "{} at {}\n{}", src, l4, text);
            }
        }
    }
}
