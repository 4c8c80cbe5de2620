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
    collections::{BTreeSet, HashMap},
    hash::{Hash, Hasher},
    net::IpAddr,
};

use rl_common::{
    prefix_mask_words, CidrEntry, L4Entry, LimitEntry, RuleEntry, CFG_LPM_V4, CFG_LPM_V6,
    CFG_RULES, DIR16_LEN, DIR16_LOOKUP, L4_ICMP, L4_ICMPV6, L4_OTHER, L4_SLOT_LEN, L4_TCP,
    L4_TCP_SYN, L4_UDP, LIMIT_BYTES, LIMIT_FIXED, LIMIT_GCRA, LIMIT_SLIDING, LIST_ALLOW, LIST_DENY,
    LIST_NONE, MAX_LIMITS, RULE_ELASTIC, RULE_SHADOW,
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
    /// The bans' trie: each ban's CIDR and the latest end (Unix seconds)
    /// of the bans covering it; sorted by CIDR.
    pub bans: Vec<(Cidr, u64)>,
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
            IpAddr::V4(a) if !self.dir16.is_empty() => {
                match self.dir16[(u32::from(a) >> 16) as usize] {
                    v if v & DIR16_LOOKUP != 0 => trie(),
                    v => v,
                }
            }
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
            if let Some((_, r)) = self
                .decide
                .iter()
                .find(|(k, _)| *k == (L4Entry::class(e), src_class))
            {
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
pub fn with_failure_mode(
    config: &Config,
    mut rules: RuleSet,
    mode: crate::cluster::OnFailure,
) -> RuleSet {
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

/// The ids of `config`'s rules as the datapath holds them (`[default]`'s
/// first, then the rules' in file order): each a hash of its definition,
/// made unique within the set (a collision would make two rules share
/// buckets) by [`unique_ids`].
pub fn rule_ids(config: &Config) -> Vec<u32> {
    let d = &config.datapath;
    let (mut ids, mut tiebreaks) = (
        vec![stable_id(&default_definition(config))],
        vec![stable_hash(&default_definition(config), ID_TIEBREAK_SEED)],
    );
    for r in &config.rules {
        let def = rule_definition(r, d.ipv4_prefix, d.ipv6_prefix);
        ids.push(stable_id(&def));
        tiebreaks.push(stable_hash(&def, ID_TIEBREAK_SEED));
    }
    unique_ids(&mut ids, &tiebreaks);
    ids
}

/// What `[default]`'s buckets mean, hashed into its id.
fn default_definition(config: &Config) -> (&'static str, Rate, u8, u8) {
    let rate = Rate {
        amount: config.default.rate,
        per_secs: 1,
        burst: config.default.burst,
    };
    (
        "default",
        rate,
        config.datapath.ipv4_prefix,
        config.datapath.ipv6_prefix,
    )
}

/// The seed of the second hash that orders rules whose ids collide.
const ID_TIEBREAK_SEED: u64 = 0x7469_6562_7265_616b;

/// Makes `ids` unique, independently of their order: each id goes to the
/// definition with the smallest `tiebreaks` hash among those that have it,
/// and only then are the others moved along (plus 8, 16, …, within the id
/// bits) to ids no one has. So moving a rule in the file, or adding one
/// whose id collides with it or with one moved next to it, never hands a
/// rule's id (its buckets) to another.
fn unique_ids(ids: &mut [u32], tiebreaks: &[u64]) {
    let mut order: Vec<usize> = (0..ids.len()).collect();
    order.sort_unstable_by_key(|&i| (ids[i], tiebreaks[i], i));
    let mut used = BTreeSet::new();
    let losers: Vec<usize> = order
        .into_iter()
        .filter(|&i| !used.insert(ids[i]))
        .collect();
    for i in losers {
        while !used.insert(ids[i]) {
            // Within the id bits: the key-kind bits above stay clear.
            ids[i] = ids[i].wrapping_add(8) & rl_common::RULE_ID_MASK;
        }
    }
}

fn compile_rules(config: &Config) -> RuleSet {
    let d = &config.datapath;
    let mut entries = Vec::with_capacity(config.rules.len() + 1);
    let mut names = vec!["default".to_string()];
    let default_rate = Rate {
        amount: config.default.rate,
        per_secs: 1,
        burst: config.default.burst,
    };
    entries.push(RuleEntry {
        id: stable_id(&default_definition(config)),
        n_limits: 1,
        v4_mask: prefix_mask_words::<1>(d.ipv4_prefix)[0],
        v6_mask: prefix_mask_words::<4>(d.ipv6_prefix),
        limits: [
            gcra(Unit::Packets, &default_rate),
            LimitEntry::default(),
            LimitEntry::default(),
            LimitEntry::default(),
        ],
        ..RuleEntry::default()
    });
    for r in &config.rules {
        names.push(r.name.clone());
        entries.push(rule_entry(r, d.ipv4_prefix, d.ipv6_prefix));
    }
    // Wide cells, per rule: its own `flood_wide_cells`, else [datapath]'s.
    let wide: Vec<bool> = std::iter::once(d.flood_wide_cells)
        .chain(
            config
                .rules
                .iter()
                .map(|r| r.wide_cells.0.unwrap_or(d.flood_wide_cells)),
        )
        .collect();
    for (e, &on) in entries.iter_mut().zip(&wide) {
        if !on {
            e.flags |= rl_common::RULE_NO_WIDE;
        }
    }
    for (e, id) in entries.iter_mut().zip(rule_ids(config)) {
        e.id = id;
    }

    let classify::Sources {
        lpm,
        classes: src_classes,
        bans,
    } = compile_sources(config);
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
        flags: if wide.contains(&true) {
            0
        } else {
            rl_common::DP_NO_WIDE_CELLS
        },
        fragment_ttl_ms: d.fragment_ttl_ms,
        fragment_orphans: match d.fragment_orphans {
            FragmentOrphans::Drop => rl_common::FRAG_ORPHANS_DROP,
            FragmentOrphans::Source => rl_common::FRAG_ORPHANS_SOURCE,
        },
    };
    RuleSet {
        flags,
        tuning,
        entries,
        names,
        l4,
        lpm,
        dir16,
        decide,
        bans,
    }
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
mod wide;

use classify::{compile_dir16, compile_l4, compile_sources};
use entries::{gcra, rule_definition};
pub use entries::{key_prefixes, limit_entry, rule_entry};
pub use wide::{part_wide_counts, wide_count_notes, wide_count_sharers};

#[cfg(test)]
mod tests {
    use super::{classify::l4_ranges, *};
    use proptest::prelude::*;

    fn config(text: &str) -> Config {
        Config::from_str(text, "x").unwrap()
    }

    /// Each ban's trie entry carries the latest end of the bans covering
    /// it; the sources' trie marks what bans alone deny (a `[[deny]]` over
    /// a ban never ends, an `[[allow]]` over one always wins).
    #[test]
    fn bans_carry_the_latest_end_around_them_and_only_ban_denials_are_marked() {
        let cidr = |s: &str| crate::config::units::parse_cidr(s).unwrap();
        let ends = classify::compile_bans(&[
            (cidr("10.0.0.0/8"), 50),
            (cidr("10.1.0.0/16"), 20),
            (cidr("10.1.2.0/24"), 90),
            (cidr("10.1.2.0/24"), 30),
            (cidr("192.0.2.0/24"), 10),
            (cidr("2001:db8::/32"), 70),
            (cidr("2001:db8:1::/48"), 40),
        ]);
        assert_eq!(
            ends,
            vec![
                (cidr("10.0.0.0/8"), 50),
                (cidr("10.1.0.0/16"), 50),
                (cidr("10.1.2.0/24"), 90),
                (cidr("192.0.2.0/24"), 10),
                (cidr("2001:db8::/32"), 70),
                (cidr("2001:db8:1::/48"), 70),
            ]
        );
        let far = crate::config::unix_now() + 3_600;
        let c = compile(&config(&format!(
            "[default]\nrate = 5\n[[deny]]\ncidr = \"192.0.2.0/24\"\n[[allow]]\ncidr = \"198.51.100.0/26\"\n\
             [[ban]]\ncidr = \"192.0.2.0/25\"\nuntil = {far}\n[[ban]]\ncidr = \"198.51.100.0/24\"\nuntil = {far}\n\
             [[ban]]\ncidr = \"203.0.113.0/24\"\nuntil = 1\n"
        )));
        let v = |s: &str| {
            c.rules
                .lpm
                .iter()
                .find(|(k, _)| *k == cidr(s))
                .map(|(_, v)| *v)
        };
        assert_eq!(
            v("192.0.2.0/25"),
            Some(LIST_DENY),
            "under a deny: never ends"
        );
        assert_eq!(
            v("198.51.100.0/24"),
            Some(LIST_DENY | rl_common::DENY_BY_BANS)
        );
        assert_eq!(v("198.51.100.0/26"), Some(rl_common::LIST_ALLOW));
        assert_eq!(v("203.0.113.0/24"), None, "an ended ban is left out");
        assert_eq!(
            c.rules.bans,
            vec![(cidr("192.0.2.0/25"), far), (cidr("198.51.100.0/24"), far)]
        );
    }

    #[test]
    fn compiles_the_default_limit_and_masks() {
        let c = compile(&config(
            "[datapath]\nipv4_prefix = 24\nipv6_prefix = 48\n[default]\nrate = 100\nburst = 7\n",
        ));
        let d = &c.rules.entries[0];
        assert_eq!(
            (d.limits[0].a, d.limits[0].b, d.n_limits),
            (10_000_000, 70_000_000, 1)
        );
        assert_eq!(d.v4_mask.to_ne_bytes(), [255, 255, 255, 0]);
        assert_eq!(d.v6_mask[1].to_ne_bytes(), [255, 255, 0, 0]);
        assert_eq!(
            c.rules.flags, 0,
            "no rules, no CIDRs: the datapath skips classification"
        );
        assert_eq!(c.max_sources, 1 << 20);
    }

    /// Two rules whose ids collide (found among names r0, r1, …) keep
    /// their ids, and so their buckets, in either order in the file.
    #[test]
    fn rules_whose_ids_collide_keep_them_whatever_their_order() {
        let base = config("[default]\nrate = 5\n[[rule]]\nname = \"x\"\nrate = 1\n");
        let (v4, v6) = (base.datapath.ipv4_prefix, base.datapath.ipv6_prefix);
        let mut seen = std::collections::HashMap::new();
        let (a, b) = (0..1_000_000)
            .find_map(|i| {
                let mut r = base.rules[0].clone();
                r.name = format!("r{i}");
                seen.insert(entries::rule_entry(&r, v4, v6).id, r.name.clone())
                    .map(|earlier| (earlier, r.name))
            })
            .expect("a collision among a million names");
        let file = |x: &str, y: &str| {
            compile(&config(&format!("[default]\nrate = 5\n[[rule]]\nname = \"{x}\"\nrate = 1\n[[rule]]\nname = \"{y}\"\nrate = 1\n")))
        };
        let (ab, ba) = (file(&a, &b), file(&b, &a));
        assert_ne!(
            ab.rules.entries[1].id, ab.rules.entries[2].id,
            "made unique"
        );
        assert_eq!(
            ab.rules.entries[1].id, ba.rules.entries[2].id,
            "{a} keeps its id"
        );
        assert_eq!(
            ab.rules.entries[2].id, ba.rules.entries[1].id,
            "{b} keeps its id"
        );
    }

    /// A rule keeps its own id when two others collide on the id before
    /// it: the loser moves along only once every id has gone to its winner.
    #[test]
    fn a_rule_keeps_its_id_when_others_collide_next_to_it() {
        let x = 0x1000;
        let mut ids = [x, x, x + 8];
        unique_ids(&mut ids, &[1, 2, 3]);
        assert_eq!(
            ids,
            [x, x + 16, x + 8],
            "the third keeps x + 8; the loser takes x + 16"
        );
        let mut ids = [x + 8, x, x];
        unique_ids(&mut ids, &[3, 2, 1]);
        assert_eq!(ids, [x + 8, x + 16, x], "in any order");
    }

    #[test]
    fn unchanged_rules_keep_their_ids_and_changed_ones_do_not() {
        let a = compile(&config("[default]\nrate = 5\n[[rule]]\nname = \"a\"\nrate = 1\n[[rule]]\nname = \"b\"\nrate = 2\n"));
        let b = compile(&config("[default]\nrate = 5\n[[rule]]\nname = \"b\"\nrate = 2\n[[rule]]\nname = \"a\"\nrate = 3\n"));
        assert_eq!(
            a.rules.entries[0].id, b.rules.entries[0].id,
            "default unchanged"
        );
        assert_eq!(
            a.rules.entries[2].id, b.rules.entries[1].id,
            "rule b unchanged (moved)"
        );
        assert_ne!(
            a.rules.entries[1].id, b.rules.entries[2].id,
            "rule a changed its rate"
        );
        assert!(a.rules.entries.iter().all(|e| e.id & 7 == 0));
    }

    /// A file within every documented limit whose port classes × source
    /// classes need more decision entries than a slot holds (100 port
    /// rules with a /16 each, 105 portless rules with a /24 in each of
    /// those: 101 × 10,600 classes; 250 of each made 15.7M and compiled for
    /// minutes) is
    /// refused by `fits` (and `check-config`), and compiling it stops at
    /// one entry past the slot instead of building all of them.
    #[test]
    fn a_decision_table_past_the_slot_is_cut_short_and_refused() {
        let mut text = String::from("[default]\nrate = 5\n");
        for x in 0..100 {
            text += &format!("[[rule]]\nname = \"p{x}\"\nproto = \"udp\"\ndst_ports = [{}]\nsrc = [\"10.{x}.0.0/16\"]\nrate = 1\n", 1000 + x);
        }
        for y in 0..105 {
            let src: Vec<String> = (0..100).map(|x| format!("\"10.{x}.{y}.0/24\"")).collect();
            text += &format!(
                "[[rule]]\nname = \"q{y}\"\nsrc = [{}]\nrate = 1\n",
                src.join(", ")
            );
        }
        let rules = compile(&config(&text)).rules;
        assert_eq!(rules.decide.len(), rl_common::DECIDE_SLOT_LEN as usize + 1);
        let e = crate::datapath::fits(&rules).unwrap_err().to_string();
        assert!(e.contains("1048577 or more rule decision entries"), "{e}");
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
        let no_wide = |c: &Compiled| {
            c.rules
                .entries
                .iter()
                .map(|e| e.flags & rl_common::RULE_NO_WIDE != 0)
                .collect::<Vec<_>>()
        };
        let on = compile(&config(&format!("[default]\nrate = 5\n{rules}")));
        assert_eq!(
            no_wide(&on),
            [false, false, true, false],
            "[default], a, b, c"
        );
        assert_eq!(on.rules.tuning.flags & rl_common::DP_NO_WIDE_CELLS, 0);
        let off = compile(&config(&format!(
            "[datapath]\nflood_wide_cells = false\n[default]\nrate = 5\n{rules}"
        )));
        assert_eq!(no_wide(&off), [true, true, true, false]);
        assert_eq!(
            off.rules.tuning.flags & rl_common::DP_NO_WIDE_CELLS,
            0,
            "c may still go wide"
        );
        let none = compile(&config("[datapath]\nflood_wide_cells = false\n[default]\nrate = 5\n[[rule]]\nname = \"a\"\nrate = 1\n"));
        assert_eq!(
            none.rules.tuning.flags,
            rl_common::DP_NO_WIDE_CELLS,
            "none may: programs that read only the datapath's flag"
        );
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
        assert_eq!(
            (b.kind, b.a, b.b, b.shift),
            (LIMIT_SLIDING, 10_000_000_000, 100, 0)
        );
        let soft = c.rules.entries[3].limits[0];
        assert_eq!(
            (soft.a, soft.b),
            (66_666_667, 66_666_667 * 30),
            "15/s, burst 30"
        );
        // Packet limits compile to exactly rl_common::Limit's interval and span.
        for (amount, per, burst) in [(7, 1, 3), (3, 1, 1), (200, 10, 1000), (1_000_000_000, 1, 5)] {
            let l = gcra(
                Unit::Packets,
                &Rate {
                    amount,
                    per_secs: per,
                    burst,
                },
            );
            let want = rl_common::Limit::new(amount, per * 1_000_000_000, burst).unwrap();
            assert_eq!(
                (l.a, l.b, l.shift),
                (want.interval_ns, want.burst_span_ns, 0),
                "{amount}/{per}s burst {burst}"
            );
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
            let l4 = l4_ranges(r)
                .iter()
                .any(|&(a, b)| a <= l4_index && l4_index <= b);
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
        assert_eq!(
            rs.classify(ip("198.51.100.1"), L4_UDP + 53),
            Verdict::Rule(0)
        );
    }

    #[test]
    fn the_ipv4_first_level_answers_whole_16s_and_defers_to_the_trie_inside_refined_ones() {
        let c = config(
            "[default]\nrate = 5\n[[allow]]\ncidr = \"10.0.0.0/8\"\n[[deny]]\ncidr = \"10.1.2.0/24\"\n\
             [[deny]]\ncidr = \"192.0.2.0/24\"\n[[rule]]\nname = \"r\"\nsrc = [\"0.0.0.0/0\"]\nrate = 1\n",
        );
        let rs = compile(&c).rules;
        let ip = |s: &str| s.parse::<IpAddr>().unwrap();
        let at = |a: &str| {
            rs.dir16[(u32::from(a.parse::<std::net::Ipv4Addr>().unwrap()) >> 16) as usize]
        };
        assert_eq!(rs.dir16.len(), DIR16_LEN as usize);
        assert_eq!(
            CidrEntry::list(at("10.200.0.1")),
            LIST_ALLOW,
            "a /8 fills its 256 /16s"
        );
        assert_eq!(
            at("10.1.0.0"),
            DIR16_LOOKUP,
            "a /24 inside sends its /16 to the trie"
        );
        assert_eq!(at("192.0.0.0"), DIR16_LOOKUP);
        let anywhere = at("203.0.113.1");
        assert_eq!(
            (
                CidrEntry::list(anywhere),
                CidrEntry::src_class(anywhere) != 0
            ),
            (LIST_NONE, true),
            "/0 src list"
        );
        assert_eq!(rs.classify(ip("10.1.2.3"), L4_UDP + 53), Verdict::Allow);
        assert_eq!(rs.classify(ip("10.1.9.9"), L4_UDP + 53), Verdict::Allow);
        assert_eq!(rs.classify(ip("192.0.2.1"), L4_UDP + 53), Verdict::Deny);
        assert_eq!(rs.classify(ip("192.0.3.1"), L4_UDP + 53), Verdict::Rule(1));
        assert_eq!(
            rs.classify(ip("203.0.113.1"), L4_UDP + 53),
            Verdict::Rule(1)
        );
        // IPv6 only: no first level.
        let v6 = compile(&config(
            "[default]\nrate = 5\n[[deny]]\ncidr = \"2001:db8::/32\"\n",
        ))
        .rules;
        assert!(v6.dir16.is_empty());
    }

    fn arb_rule(i: usize) -> impl Strategy<Value = String> {
        let proto = prop_oneof![
            Just("any"),
            Just("tcp"),
            Just("udp"),
            Just("icmp"),
            Just("icmpv6")
        ];
        let ports = proptest::option::of(proptest::collection::vec((1u16..40, 0u16..5), 1..3));
        let syn = any::<bool>();
        let src = proptest::option::of(proptest::collection::vec(
            (0u8..4, prop_oneof![Just(8u8), Just(16), Just(24)]),
            1..3,
        ));
        (proto, ports, syn, src).prop_map(move |(proto, ports, syn, src)| {
            let mut s = format!("[[rule]]\nname = \"r{i}\"\nrate = 1\nproto = \"{proto}\"\n");
            if let (Some(p), false) = (&ports, proto.starts_with("icmp")) {
                let list: Vec<String> = p
                    .iter()
                    .map(|(a, w)| format!("\"{}-{}\"", a, a + w))
                    .collect();
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
        /// A token bucket charges each unit at least `per / rate` (rounded
        /// up): whatever the rate it never passes more than written.
        /// (Rounded to nearest, 95,238,096/s cost 10 ns and passed 100M/s.)
        #[test]
        fn a_token_bucket_is_never_looser_than_written(
            amount in prop_oneof![1u64..=1_000, 1u64..=crate::config::rules::MAX_RULE_RATE, 1u64..=crate::config::rules::MAX_RULE_BYTES],
            per_secs in prop_oneof![Just(1u64), 1u64..=3_600, 1u64..=366 * 86_400],
            bytes in any::<bool>(),
        ) {
            let (unit, per_ns) = (if bytes { Unit::Bytes } else { Unit::Packets }, per_secs as u128 * 1_000_000_000);
            // What validation accepts: packets at most one per ns, bytes
            // at least one per 2^47 ns.
            prop_assume!(if bytes { per_ns < (amount as u128) << 47 } else { amount <= crate::config::rules::MAX_RULE_RATE && per_ns >= amount as u128 });
            let l = gcra(unit, &Rate { amount, per_secs, burst: amount });
            prop_assert!(l.a as u128 * amount as u128 >= per_ns << l.shift, "{amount} per {per_secs}s: a = {}, shift {}", l.a, l.shift);
        }
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
