//! Classification tables: the sources' trie and /16 array (allow, deny,
//! source classes) and the L4 table with its decision entries.

use super::*;

/// The sources' tables: every CIDR the trie needs, with its list and
/// source class; each class's set of rule indices (class 0: the empty
/// set); and the bans' ends ([`compile_bans`]).
pub(super) struct Sources {
    pub lpm: Vec<(Cidr, u32)>,
    pub classes: Vec<BTreeSet<u32>>,
    pub bans: Vec<(Cidr, u64)>,
}

pub(super) fn compile_sources(config: &Config) -> Sources {
    // Bans in force are deny entries (so `allow` still wins over them),
    // marked when no `[[deny]]` covers them: they end in the kernel.
    let bans: Vec<(Cidr, u64)> = config
        .active_bans(crate::config::unix_now())
        .map(|b| (b.cidr, b.until))
        .collect();
    let ban_list: Vec<Cidr> = bans.iter().map(|(c, _)| *c).collect();
    let mut prefixes: BTreeSet<Cidr> = BTreeSet::new();
    prefixes.extend(config.allow.iter().copied());
    prefixes.extend(config.deny.iter().copied());
    prefixes.extend(ban_list.iter().copied());
    let mut src_of: HashMap<Cidr, Vec<u32>> = HashMap::new();
    for (i, r) in config.rules.iter().enumerate() {
        for c in &r.src {
            prefixes.insert(*c);
            src_of.entry(*c).or_default().push(i as u32 + 1);
        }
    }
    let allow: HashMap<(bool, u8), BTreeSet<Vec<u8>>> = by_len(&config.allow);
    let deny = by_len(&config.deny);
    let banned = by_len(&ban_list);
    let src_list: Vec<Cidr> = src_of.keys().copied().collect();
    let srcs = by_len(&src_list);
    // Whether any CIDR in `set` covers `c`: one probe per length present.
    let covered_by = |set: &HashMap<(bool, u8), BTreeSet<Vec<u8>>>, c: &Cidr| -> Vec<Cidr> {
        let v4 = c.addr.is_ipv4();
        set.iter()
            .filter(|((fam, len), _)| *fam == v4 && *len <= c.len)
            .filter_map(|((_, len), nets)| {
                let m = crate::config::units::mask(&c.octets(), *len);
                nets.contains(&m).then(|| Cidr {
                    addr: crate::config::units::bytes_to_addr(&m),
                    len: *len,
                })
            })
            .collect()
    };
    let mut classes: Vec<BTreeSet<u32>> = vec![BTreeSet::new()];
    let mut class_ids: HashMap<BTreeSet<u32>, u16> = HashMap::from([(BTreeSet::new(), 0)]);
    let mut out = Vec::with_capacity(prefixes.len());
    for c in prefixes {
        let list = if !covered_by(&allow, &c).is_empty() {
            LIST_ALLOW
        } else if !covered_by(&deny, &c).is_empty() {
            LIST_DENY
        } else if !covered_by(&banned, &c).is_empty() {
            LIST_DENY | rl_common::DENY_BY_BANS
        } else {
            LIST_NONE
        };
        let set: BTreeSet<u32> = covered_by(&srcs, &c)
            .iter()
            .flat_map(|n| src_of[n].iter().copied())
            .collect();
        let next = classes.len() as u16;
        let class = *class_ids.entry(set.clone()).or_insert_with(|| {
            classes.push(set);
            next
        });
        out.push((c, CidrEntry::pack(list, class)));
    }
    Sources {
        lpm: out,
        classes,
        bans: compile_bans(&bans),
    }
}

/// The bans' trie ([`rl_common::MAP_BANS_V4`]): each ban's CIDR with the
/// latest end (Unix seconds) of the bans covering it, itself included, so
/// that the longest ban matching a source ends when the last ban covering
/// it does. Sorted by CIDR.
pub(super) fn compile_bans(bans: &[(Cidr, u64)]) -> Vec<(Cidr, u64)> {
    // Each ban's own end, by family and length: one probe per length.
    let mut own: HashMap<(bool, u8), HashMap<Vec<u8>, u64>> = HashMap::new();
    for &(c, until) in bans {
        let e = own
            .entry((c.addr.is_ipv4(), c.len))
            .or_default()
            .entry(c.octets())
            .or_insert(until);
        *e = (*e).max(until);
    }
    let mut out: Vec<(Cidr, u64)> = own
        .iter()
        .flat_map(|(&(v4, len), nets)| {
            let own = &own;
            nets.keys().map(move |net| {
                let end = own
                    .iter()
                    .filter(|((fam, l), _)| *fam == v4 && *l <= len)
                    .filter_map(|((_, l), outer)| outer.get(&crate::config::units::mask(net, *l)))
                    .max()
                    .copied()
                    .unwrap_or(0);
                let addr = crate::config::units::bytes_to_addr(net);
                (Cidr { addr, len }, end)
            })
        })
        .collect();
    out.sort_unstable();
    out
}

/// The IPv4 first level: each /16 takes the value of the longest CIDR of at
/// most 16 bits covering it (the trie's answer for every address in it),
/// unless a longer CIDR lies inside it: then [`DIR16_LOOKUP`].
pub(super) fn compile_dir16(lpm: &[(Cidr, u32)]) -> Vec<u32> {
    let mut dir = vec![0u32; DIR16_LEN as usize];
    let mut v4: Vec<(u32, u8, u32)> = lpm
        .iter()
        .filter_map(|(c, v)| match c.addr {
            IpAddr::V4(a) => Some((u32::from(a), c.len, *v)),
            IpAddr::V6(_) => None,
        })
        .collect();
    // Shorter prefixes first, so longer ones overwrite what they refine.
    v4.sort_by_key(|&(_, len, _)| len);
    for (addr, len, v) in v4 {
        let first = (addr >> 16) as usize;
        if len <= 16 {
            let n = 1usize << (16 - len);
            dir[first..first + n].fill(v);
        } else {
            dir[first] = DIR16_LOOKUP;
        }
    }
    dir
}

pub(super) fn by_len(cidrs: &[Cidr]) -> HashMap<(bool, u8), BTreeSet<Vec<u8>>> {
    let mut m: HashMap<(bool, u8), BTreeSet<Vec<u8>>> = HashMap::new();
    for c in cidrs {
        m.entry((c.addr.is_ipv4(), c.len))
            .or_default()
            .insert(c.octets());
    }
    m
}

/// Which L4 table indices a rule matches.
pub(super) fn l4_ranges(r: &Rule) -> Vec<(u32, u32)> {
    let ports: Vec<(u32, u32)> = if r.dst_ports.is_empty() {
        vec![(0, 65_535)]
    } else {
        r.dst_ports
            .iter()
            .map(|&(a, b)| (a as u32, b as u32))
            .collect()
    };
    let at = |base: u32| ports.iter().map(move |&(a, b)| (base + a, base + b));
    let mut out = Vec::new();
    let tcp = |out: &mut Vec<(u32, u32)>| {
        if !r.syn_only {
            out.extend(at(L4_TCP));
        }
        out.extend(at(L4_TCP_SYN));
    };
    match r.proto {
        Proto::Tcp => tcp(&mut out),
        Proto::Udp => out.extend(at(L4_UDP)),
        Proto::Icmp => out.push((L4_ICMP, L4_ICMP)),
        Proto::Icmpv6 => out.push((L4_ICMPV6, L4_ICMPV6)),
        Proto::Any => {
            tcp(&mut out);
            out.extend(at(L4_UDP));
            if r.dst_ports.is_empty() {
                out.push((L4_ICMP, L4_OTHER));
            }
        }
    }
    out
}

/// Decision entries: (L4 slot class, source class) ➜ rule list index.
type Decisions = Vec<((u16, u16), u32)>;

/// The L4 table and the decision entries.
pub(super) fn compile_l4(rules: &[Rule], src_classes: &[BTreeSet<u32>]) -> (Vec<u32>, Decisions) {
    // Elementary intervals: the matching rule list is constant between
    // consecutive range boundaries.
    let ranges: Vec<Vec<(u32, u32)>> = rules.iter().map(l4_ranges).collect();
    let mut cuts: BTreeSet<u32> = BTreeSet::from([0, L4_SLOT_LEN]);
    for rs in &ranges {
        for &(a, b) in rs {
            cuts.insert(a);
            cuts.insert(b + 1);
        }
    }
    let cuts: Vec<u32> = cuts.into_iter().collect();
    let mut l4 = vec![0u32; L4_SLOT_LEN as usize];
    let mut class_ids: HashMap<Vec<u32>, u16> = HashMap::new();
    let mut classes: Vec<Vec<u32>> = Vec::new();
    for w in cuts.windows(2) {
        let (lo, hi) = (w[0], w[1]);
        let mut pre = Vec::new();
        let mut first = 0;
        for (i, rs) in ranges.iter().enumerate() {
            if !rs.iter().any(|&(a, b)| a <= lo && lo <= b) {
                continue;
            }
            if rules[i].src.is_empty() {
                first = i as u32 + 1;
                break;
            }
            pre.push(i as u32 + 1);
        }
        let class = if pre.is_empty() {
            0
        } else {
            let next = classes.len() as u16 + 1;
            *class_ids.entry(pre.clone()).or_insert_with(|| {
                classes.push(pre);
                next
            })
        };
        for x in lo..hi {
            l4[x as usize] = L4Entry::pack(class, first as u16);
        }
    }
    // Up to one entry more than a slot holds: a rule set past that is
    // refused (`fits`), and building all of it could take minutes (port
    // classes × source classes, up to millions of each).
    let mut decide = Vec::new();
    'classes: for (ci, pre) in classes.iter().enumerate() {
        for (si, set) in src_classes.iter().enumerate() {
            if let Some(r) = pre.iter().find(|r| set.contains(r)) {
                decide.push(((ci as u16 + 1, si as u16), *r));
                if decide.len() > rl_common::DECIDE_SLOT_LEN as usize {
                    break 'classes;
                }
            }
        }
    }
    (l4, decide)
}
