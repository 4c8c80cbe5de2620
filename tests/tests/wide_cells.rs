//! Wide cells (`rl_common::pressure`), through TestRun: once a rule's
//! flood in flood mode has claimed cells in a quarter of the cell array's
//! slots, an unseen key of that rule whose wide cell (its /16; IPv6 /32)
//! does not exist makes it, drained; while the rule has wide cells, its
//! unseen keys look for theirs first and are charged to it; other rules'
//! newcomers keep cells of their own prefix; a key limited in its /24's
//! cell stays limited when its /16 goes wide; a source's own bucket made while its wide cell
//! exists starts as a copy of it; the collector frees wide cells once
//! fresh and counts the rest, and keys then go to their /24 cells again;
//! a wide cell being freed claims nothing; `flood_wide_cells = false` and
//! cluster rules make none; `GET /v1/sources/{ip}` reads a source's quota
//! from the bucket that charges it.

use std::net::IpAddr;

use rl_common::{Key4, Key6, KEY_CELL, KEY_WIDE, STAT_NEW_CELLS};
use rl_control::{
    compile::compile,
    config::Config,
    datapath::{CellArray, ChargedBy, Datapath, Pass, SourceQuota, COLLECT_IDLE_NS},
};
use rl_tests::{datapath, frames::*, lab::require_root, offer};

fn to(src: [u8; 4], port: u16) -> Vec<u8> {
    eth(&[], ETH_P_IP, &ipv4(src, UDP, &[], &udp(port)))
}

/// `flood_rules` (256 prefixes: 512 slots, wide at 128 cells) with flood
/// mode always on, and `extra` appended.
fn rules(extra: &str) -> String {
    rl_tests::flood_rules(1024).replace(
        "flood_new_keys_per_sec = 2000",
        "flood_new_keys_per_sec = 0",
    ) + extra
}

/// The wide cell (/16) and the cell (/24) keys of `src` under limit 0 of
/// rule `index` (0 `[default]`, 2 "once") of `toml`.
fn keys(toml: &str, index: usize, src: [u8; 4]) -> (Key4, Key4) {
    let compiled = compile(&Config::from_str(toml, "<test>").unwrap());
    let k = compiled.rules.entries[index].key4(0, u32::from_ne_bytes(src));
    (
        Key4 {
            rule: k.rule | KEY_WIDE,
            addr: k.addr & u32::from_ne_bytes([255, 255, 0, 0]),
        },
        Key4 {
            rule: k.rule | KEY_CELL,
            addr: k.addr & u32::from_ne_bytes([255, 255, 255, 0]),
        },
    )
}

/// Claims cells for /24s of 10.200-203/16 under the rule of `port` (5000:
/// `[default]`, 1,000/s, fresh again within a second or two; 9999:
/// "once") until, with the `has` cells it held before, it holds 128: a
/// quarter of the 512 slots, where the rule's flood goes wide (its next
/// new prefix makes a wide cell). Some prefixes find their set full (and
/// go to the rule's last resort); the loop goes on until enough cells are
/// claimed.
fn widen(dp: &Datapath, port: u16, has: u64) {
    let (start, mut i) = (dp.counters().unwrap().get(STAT_NEW_CELLS), 0u32);
    while dp.counters().unwrap().get(STAT_NEW_CELLS) < start + 128 - has {
        assert!(i < 1024, "128 cells claimed from 1,024 prefixes");
        offer(dp, &to([10, 200 + (i >> 8) as u8, i as u8, 1], port), 1);
        i += 1;
    }
}

fn pass(dp: &Datapath) -> Pass {
    rl_tests::collector_pass(dp)
}

/// Whether a bucket state word is ahead of now: charged (or drained), for
/// a limit of one per hour.
fn ahead(tat_ns: u64) -> bool {
    tat_ns > rl_control::datapath::monotonic_ns()
}

/// The first of `bs` for which `key(b)` has room in `cells` (its cell, or
/// a free way): at a quarter's load a set is full of others about one
/// time in eleven (the seed is random), and such a key goes elsewhere.
fn roomy(
    cells: &CellArray<Key4>,
    bs: impl IntoIterator<Item = u8>,
    key: impl Fn(u8) -> Key4,
) -> u8 {
    bs.into_iter()
        .find(|&b| cells.room_for(&key(b)))
        .expect("some candidate's set has room")
}

/// Installs `toml`'s rules and settings on `dp`, as a reload does.
fn reload(dp: &mut Datapath, toml: &str) {
    dp.install(&compile(&Config::from_str(toml, "<test>").unwrap()).rules)
        .unwrap();
}

/// A datapath of `toml` where "once"'s flood went wide and a source of
/// 10.b.1.0/24 made its /16's wide cell, drained: the datapath, its cells
/// and `b`.
fn one_wide(toml: &str) -> (Datapath, CellArray<Key4>, u8) {
    require_root();
    let dp = datapath(toml).unwrap();
    let cells = dp.cells_v4().unwrap();
    widen(&dp, 9999, 0);
    let b = roomy(&cells, 1..=60, |b| keys(toml, 2, [10, b, 0, 0]).0);
    assert_eq!(
        offer(&dp, &to([10, b, 1, 1], 9999), 1),
        (0, 1),
        "the /16's wide cell, drained"
    );
    assert!(cells.find(&keys(toml, 2, [10, b, 0, 0]).0).is_some());
    (dp, cells, b)
}

#[test]
fn a_wide_flood_makes_drained_wide_cells_and_a_key_limited_in_its_cell_stays_limited() {
    require_root();
    let toml = rules("");
    let dp = datapath(&toml).unwrap();
    let cells: CellArray<Key4> = dp.cells_v4().unwrap();
    // Below a quarter: "once" (1 per hour) limits 10.b.1.0/24 in its cell,
    // for eight /16s.
    for b in 1..=8 {
        assert_eq!(
            offer(&dp, &to([10, b, 1, 1], 9999), 2),
            (1, 1),
            "the /24's hour: one packet"
        );
        let (wide, cell) = keys(&toml, 2, [10, b, 1, 1]);
        assert!(
            cells.find(&cell).is_some() && cells.find(&wide).is_none(),
            "a cell per /24 below a quarter"
        );
    }
    assert_eq!(dp.wide_counts().unwrap(), (0, 0));
    widen(&dp, 9999, 8);
    let b = roomy(&cells, 1..=8, |b| keys(&toml, 2, [10, b, 0, 0]).0);
    let (wide, _) = keys(&toml, 2, [10, b, 1, 1]);
    // A newcomer of another /24 of 10.b/16 makes the /16's wide cell,
    // drained: where a copy of the fresh last resort would pass it.
    let made = dp.counters().unwrap().get(STAT_NEW_CELLS);
    assert_eq!(
        offer(&dp, &to([10, b, 2, 1], 9999), 1),
        (0, 1),
        "a wide cell starts drained"
    );
    let w = cells.find(&wide).expect("the /16's wide cell was made");
    assert!(
        ahead(cells.get(w).bucket.tat_ns),
        "drained for the hour: {:?}",
        cells.get(w)
    );
    assert_eq!(
        dp.counters().unwrap().get(STAT_NEW_CELLS),
        made + 1,
        "one wide cell, no /24 cell"
    );
    assert!(
        cells.find(&keys(&toml, 2, [10, b, 2, 1]).1).is_none(),
        "no cell for 10.b.2.0/24"
    );
    assert_eq!(
        dp.wide_counts().unwrap(),
        (1, 0),
        "counted before it could be found"
    );
    // (b): the /24 that used its hour gets nothing from the wide cell.
    assert_eq!(
        offer(&dp, &to([10, b, 1, 9], 9999), 3),
        (0, 3),
        "no fresh allowance for a limited /24"
    );
    // Its wide cell charges it before its cell, and is what
    // `GET /v1/sources/{ip}` reads.
    let q = quota_of(&dp, [10, b, 1, 10], 2).expect("charged");
    assert_eq!(
        (q.by, q.prefix, q.quota.remaining),
        (
            ChargedBy::WideCell,
            Some((IpAddr::from([10, b, 0, 0]), 16)),
            0
        ),
        "{q:?}"
    );
    // Every unseen key of 10.b/16, in any /24, is charged to it.
    for x in [3u8, 77, 250] {
        assert_eq!(offer(&dp, &to([10, b, x, 1], 9999), 1), (0, 1));
    }
    assert_eq!(
        dp.counters().unwrap().get(STAT_NEW_CELLS),
        made + 1,
        "no cell made for them"
    );
    // Another /16 gets its own wide cell (drained too).
    let b2 = roomy(&cells, 20..=60, |b| keys(&toml, 2, [10, b, 0, 0]).0);
    assert_eq!(offer(&dp, &to([10, b2, 1, 1], 9999), 1), (0, 1));
    assert!(cells.find(&keys(&toml, 2, [10, b2, 0, 0]).0).is_some());
    assert_eq!(dp.wide_counts().unwrap(), (2, 0));
    // (d): the flood is "once"'s; a newcomer of 10.b/16 under [default]
    // gets its /24's cell, a copy of [default]'s fresh last resort.
    let x = roomy(&cells, 100..=200, |x| keys(&toml, 0, [10, b, x, 1]).1);
    assert_eq!(
        offer(&dp, &to([10, b, x, 1], 5000), 3),
        (3, 0),
        "another rule's newcomer keeps its burst"
    );
    let (dwide, dcell) = keys(&toml, 0, [10, b, x, 1]);
    assert!(
        cells.find(&dcell).is_some() && cells.find(&dwide).is_none(),
        "[default]'s flood is not wide"
    );
    let p = pass(&dp);
    assert_eq!(p.wide, (2, 0), "the walk counts the wide cells: {p:?}");
    assert_eq!(
        dp.wide_counts().unwrap(),
        (2, 0),
        "and sets the program's count to them"
    );
    // By rule: all "once"'s, named as the daemon reports them.
    let once = keys(&toml, 2, [10, b, 0, 0]).1.rule & rl_common::RULE_ID_MASK;
    assert_eq!(
        p.wide_rules.clone().into_iter().collect::<Vec<_>>(),
        vec![(once, (2, 0))]
    );
    // The walk lists the cells holding a charge, the most limiting first:
    // the drained wide cells of "once", then its /24 cells (each a wait of
    // about an hour), each with its prefix.
    let charged = &p.charged_cells;
    assert!(
        charged.drained.0 >= 2 + 8 && charged.drained.1 == 0,
        "{charged:?}"
    );
    let quotas = dp.cell_quotas(&charged.cells).unwrap();
    let listed: Vec<_> = charged
        .cells
        .iter()
        .zip(&quotas)
        .map(|(c, q)| (c, q.expect("each listed cell's rule is in force")))
        .collect();
    let (w, (wq, wp)) = listed
        .iter()
        .find(|(c, _)| c.wide && c.addr == IpAddr::from([10, b, 0, 0]))
        .expect("the drained wide cell is listed");
    assert_eq!((w.limit, w.drained, wq.remaining), (once, true, 0), "{w:?}");
    assert!(wq.retry_after_ns > 3_000 * 1_000_000_000, "{wq:?}");
    assert_eq!(*wp, (IpAddr::from([10, b, 0, 0]), 16));
    let kinds: Vec<bool> = charged.cells.iter().map(|c| c.wide).collect();
    assert!(
        kinds.windows(2).all(|x| x[0] >= x[1]) && kinds[..2] == [true, true],
        "the wide cells first: {kinds:?}"
    );
    let (cell, (q, prefix)) = listed
        .iter()
        .find(|(c, _)| !c.wide)
        .expect("a /24 cell among them");
    let IpAddr::V4(a) = cell.addr else {
        panic!("{cell:?}")
    };
    assert_eq!(
        (cell.limit, cell.drained, q.remaining, a.octets()[3]),
        (once, true, 0, 0),
        "{cell:?}"
    );
    assert_eq!(*prefix, (cell.addr, 24));
    assert!(
        listed
            .iter()
            .all(|(c, (q, _))| q.remaining < q.limit && c.drained == (q.remaining == 0)),
        "only cells holding a charge, drained as their quota says"
    );
    assert_eq!(
        dp.rule_names_by_id()
            .unwrap()
            .get(&once)
            .map(String::as_str),
        Some("once")
    );
}

#[test]
fn the_collector_frees_fresh_wide_cells_and_keys_go_to_their_own_prefix_again() {
    require_root();
    let toml = rules("");
    let dp = datapath(&toml).unwrap();
    let cells = dp.cells_v4().unwrap();
    widen(&dp, 5000, 0);
    // [default] (1,000/s, burst 1,000: a second's span): drained, a wide
    // cell is fresh again a second after it is made, and collected a
    // second after that.
    let b = roomy(&cells, 30..=90, |b| keys(&toml, 0, [10, b, 0, 0]).0);
    let (wide, cell) = keys(&toml, 0, [10, b, 1, 1]);
    assert_eq!(
        offer(&dp, &to([10, b, 1, 1], 5000), 1).1,
        1,
        "drained: the first packet drops"
    );
    assert!(cells.find(&wide).is_some() && cells.find(&cell).is_none());
    std::thread::sleep(std::time::Duration::from_millis(20));
    assert_eq!(
        offer(&dp, &to([10, b, 1, 2], 5000), 1),
        (1, 0),
        "tokens come back at the rule's rate"
    );
    assert_eq!(pass(&dp).wide, (1, 0), "not fresh yet");
    std::thread::sleep(std::time::Duration::from_nanos(
        2 * COLLECT_IDLE_NS + 300_000_000,
    ));
    let p = pass(&dp);
    assert_eq!(
        (p.wide, p.cells),
        ((0, 0), (0, 0)),
        "every [default] cell, wide or not, is fresh and freed: {p:?}"
    );
    assert!(cells.find(&wide).is_none());
    assert_eq!(
        dp.wide_counts().unwrap(),
        (0, 0),
        "the count follows the frees"
    );
    // Below a quarter again: a newcomer of 10.b/16 gets its /24's cell.
    assert_eq!(offer(&dp, &to([10, b, 1, 3], 5000), 1), (1, 0));
    assert!(
        cells.find(&cell).is_some() && cells.find(&wide).is_none(),
        "a cell per /24 again"
    );
}

#[test]
fn a_source_that_gets_its_own_bucket_while_its_wide_cell_exists_starts_from_it() {
    let toml = rules("");
    let (mut dp, _cells, b) = one_wide(&toml);
    // Flood mode off (the same rules, a generous detector): newcomers of
    // 10.b/16 get buckets of their own, copies of the wide cell they map
    // to, so drained for the hour; under [default], whose flood is not
    // wide, a fresh one.
    reload(
        &mut dp,
        &toml.replace(
            "flood_new_keys_per_sec = 0",
            "flood_new_keys_per_sec = 1000000",
        ),
    );
    let own = dp.counters().unwrap().get(rl_common::STAT_NEW_SOURCES);
    assert_eq!(
        offer(&dp, &to([10, b, 9, 9], 9999), 2),
        (0, 2),
        "its own bucket starts drained, like the wide cell"
    );
    assert_eq!(
        offer(&dp, &to([10, b, 9, 9], 5000), 2),
        (2, 0),
        "[default]: a fresh bucket of its own"
    );
    assert_eq!(
        dp.counters().unwrap().get(rl_common::STAT_NEW_SOURCES),
        own + 2,
        "both got buckets of their own"
    );
}

#[test]
fn a_wide_cell_being_freed_sends_its_keys_to_their_prefix_cell_and_claims_nothing() {
    require_root();
    let toml = rules("");
    let dp = datapath(&toml).unwrap();
    let cells = dp.cells_v4().unwrap();
    // 10.b.7.0/24 used its hour in its cell, before the flood went wide.
    for b in 1..=8 {
        assert_eq!(offer(&dp, &to([10, b, 7, 1], 9999), 1), (1, 0));
    }
    widen(&dp, 9999, 8);
    let b = roomy(&cells, 1..=8, |b| keys(&toml, 2, [10, b, 0, 0]).0);
    assert_eq!(offer(&dp, &to([10, b, 8, 1], 9999), 1), (0, 1));
    let (wide, cell) = keys(&toml, 2, [10, b, 7, 1]);
    let w = cells.find(&wide).expect("the wide cell");
    assert!(cells.begin_free(w, &wide));
    let made = dp.counters().unwrap().get(STAT_NEW_CELLS);
    // Its keys go to their /24's cell (10.b.7.0/24: limited) or, without
    // one, claim nothing wide while it is dying.
    assert_eq!(
        offer(&dp, &to([10, b, 7, 2], 9999), 1),
        (0, 1),
        "the limited /24's cell, not a fresh bucket"
    );
    assert!(cells.find(&cell).is_some());
    assert!(
        cells.find(&wide).is_none(),
        "no second wide cell while the first is dying"
    );
    let _ = offer(&dp, &to([10, b, 9, 1], 9999), 1);
    assert!(cells.find(&wide).is_none());
    assert!(
        dp.counters().unwrap().get(STAT_NEW_CELLS) <= made + 1,
        "at most a /24 cell for 10.b.9.0/24"
    );
    // Turned back (not fresh): its keys find it again.
    assert!(!cells.finish_free(w, &wide, |_| false));
    assert_eq!(cells.find(&wide), Some(w));
    assert_eq!(offer(&dp, &to([10, b, 200, 1], 9999), 1), (0, 1));
}

#[test]
fn without_wide_cells_and_for_cluster_rules_every_prefix_keeps_a_cell_of_its_own() {
    require_root();
    for (what, toml, index, port) in [
        ("flood_wide_cells = false", rules("").replace("flood_prefixes = 256", "flood_prefixes = 256\nflood_wide_cells = false"), 2, 9999),
        ("the rule's flood_wide_cells = false", rules("").replace("name = \"once\"", "name = \"once\"\nflood_wide_cells = false"), 2, 9999),
        (
            "a cluster rule",
            rules(
                "[cluster]\nredis = [\"redis://127.0.0.1:1\"]\nnode = \"test\"\n\
                 [[rule]]\nname = \"shared\"\nproto = \"udp\"\ndst_ports = [6666]\nrate = 1\nper = \"1h\"\nburst = 1\nscope = \"cluster\"\n",
            ),
            3,
            6666,
        ),
    ] {
        let dp = datapath(&toml).unwrap();
        let cells = dp.cells_v4().unwrap();
        widen(&dp, port, 0);
        // Twenty newcomers' /24s past a quarter: cells of their own (but for
        // a set full of others: about one in eleven at a quarter's load, so
        // 9 or more of 20 one run in 100,000), never a wide one.
        let with_cell = (0..20u8)
            .filter(|&x| {
                offer(&dp, &to([10, 9, x, 1], port), 1);
                let (wide, cell) = keys(&toml, index, [10, 9, x, 1]);
                assert!(cells.find(&wide).is_none(), "{what}: no wide cell");
                cells.find(&cell).is_some()
            })
            .count();
        assert!(with_cell >= 12, "{what}: {with_cell} of 20 newcomers' /24s got a cell");
        assert_eq!(dp.wide_counts().unwrap(), (0, 0), "{what}");
    }
}

/// A rule's own `flood_wide_cells` wins over `[datapath]`'s, both ways,
/// and turning it off at a reload keeps the wide cells it made limiting.
#[test]
fn a_rules_own_flood_wide_cells_wins_over_the_datapaths() {
    require_root();
    let toml = rules("")
        .replace(
            "flood_prefixes = 256",
            "flood_prefixes = 256\nflood_wide_cells = false",
        )
        .replace(
            "name = \"once\"",
            "name = \"once\"\nflood_wide_cells = true",
        );
    let (mut dp, cells, b) = one_wide(&toml);
    // The setting is not part of the rule's state: the same bucket ids.
    let plain = compile(&Config::from_str(&rules(""), "<test>").unwrap());
    assert_eq!(
        compile(&Config::from_str(&toml, "<test>").unwrap())
            .rules
            .entries[2]
            .id,
        plain.rules.entries[2].id
    );
    turned_off_at_a_reload(
        &mut dp,
        &cells,
        &toml,
        b,
        &toml.replace("flood_wide_cells = true", "flood_wide_cells = false"),
    );
}

#[test]
fn ipv6_wide_cells_are_slash_32s() {
    require_root();
    let toml = rules("");
    let dp = datapath(&toml).unwrap();
    let six = |b: [u8; 4], port: u16| {
        let mut src = [0x20, 0x01, 0x0d, 0xb8, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 1];
        src[2..6].copy_from_slice(&b);
        eth(&[], ETH_P_IPV6, &ipv6(src, UDP, &udp(port)))
    };
    // 128 /48s under "once" make a quarter of the IPv6 slots.
    let mut i = 0u32;
    while dp.counters().unwrap().get(STAT_NEW_CELLS) < 128 {
        assert!(i < 1024);
        offer(
            &dp,
            &six([0x0d, 0xb8, (i >> 8) as u8 + 1, i as u8], 9999),
            1,
        );
        i += 1;
    }
    // A /32 (2001:0dXX::/32) under "once": its wide cell, drained; every
    // /48 of it shares it.
    let compiled = compile(&Config::from_str(&toml, "<test>").unwrap());
    let wide = |b: u8| {
        let k = compiled.rules.entries[2]
            .key6(0, &[u32::from_ne_bytes([0x20, 0x01, 0x0d, b]), 0, 0, 0]);
        Key6 {
            rule: k.rule | KEY_WIDE,
            addr: k.addr,
        }
    };
    let cells = dp.table_maps().unwrap().cell_arrays().unwrap().1;
    let b = (0xb9..=0xff)
        .find(|&b| cells.room_for(&wide(b)))
        .expect("a /32 whose set has room");
    assert_eq!(offer(&dp, &six([0x0d, b, 0, 1], 9999), 1), (0, 1));
    assert_eq!(offer(&dp, &six([0x0d, b, 0x77, 1], 9999), 1), (0, 1));
    assert!(cells.find(&wide(b)).is_some(), "the /32's wide cell");
    assert_eq!(
        pass(&dp).wide_rules.into_iter().collect::<Vec<_>>(),
        vec![(compiled.rules.entries[2].id, (0, 1))]
    );
    // `GET /v1/sources/{ip}` reads another source of the /32 from it.
    let other = [0x20, 0x01, 0x0d, b, 0x42, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 9];
    let q = dp
        .source_quotas(IpAddr::from(other))
        .unwrap()
        .into_iter()
        .find(|q| q.rule == 2)
        .expect("the drained wide cell");
    let prefix: IpAddr = format!("2001:d{b:02x}::").parse().unwrap();
    assert_eq!(
        (q.by, q.prefix, q.quota.remaining),
        (ChargedBy::WideCell, Some((prefix, 32)), 0),
        "{q:?}"
    );
    assert_eq!(dp.wide_counts().unwrap(), (0, 1));
    assert_eq!(pass(&dp).wide, (0, 1));
}

/// What `GET /v1/sources/{ip}` reads for `src` under limit 0 of rule
/// `index`.
fn quota_of(dp: &Datapath, src: [u8; 4], index: u32) -> Option<SourceQuota> {
    dp.source_quotas(IpAddr::from(src))
        .unwrap()
        .into_iter()
        .find(|q| q.rule == index && q.which == 0)
}

/// `GET /v1/sources/{ip}` (`Datapath::source_quotas`) reads a source
/// without a bucket of its own from the one that charges it now, as the
/// program finds it: its wide cell, else its /24's cell, else its rule's
/// last resort, each named with its prefix; a fallback still fresh is not
/// reported (the source has its full limit). Each reading is checked
/// against what the program then passes. (A source's own bucket: the api
/// test `source_quota_agrees_with_what_the_datapath_lets_through_next`.)
#[test]
fn a_sources_quota_is_that_of_the_bucket_that_charges_it() {
    let toml = rules("");
    let (dp, cells, b) = one_wide(&toml);
    const HOUR_NS: u64 = 3_600_000_000_000;
    // "once" (1 per hour): a source of 10.b/16 never seen, in its /16's
    // drained wide cell.
    let q = quota_of(&dp, [10, b, 9, 9], 2).expect("the wide cell holds a charge");
    assert_eq!(
        (q.by, q.prefix),
        (ChargedBy::WideCell, Some((IpAddr::from([10, b, 0, 0]), 16))),
        "{q:?}"
    );
    assert_eq!((q.quota.limit, q.quota.remaining), (1, 0), "{q:?}");
    assert!(
        q.quota.retry_after_ns > HOUR_NS - 60_000_000_000,
        "drained for the hour: {q:?}"
    );
    assert_eq!(
        offer(&dp, &to([10, b, 9, 9], 9999), 1),
        (0, 1),
        "and it drops"
    );
    // "calm" (5 per hour, burst 5; its flood is not wide): nothing charged
    // yet, so nothing to report for a source of a /24 without a cell.
    assert_eq!(
        quota_of(&dp, [10, 230, 0, 1], 1),
        None,
        "no fallback of the rule holds a charge"
    );
    // A /24 whose set has room: its cell, charged twice (a copy of the
    // rule's last resort, made fresh for it).
    let x = roomy(&cells, 0..=255, |x| keys(&toml, 1, [10, 231, x, 0]).1);
    assert_eq!(offer(&dp, &to([10, 231, x, 1], 7777), 2), (2, 0));
    assert_eq!(
        quota_of(&dp, [10, 230, 0, 1], 1),
        None,
        "a fresh last resort leaves the full limit: not listed"
    );
    let q = quota_of(&dp, [10, 231, x, 77], 1).expect("the /24's cell holds two charges");
    assert_eq!(
        (q.by, q.prefix),
        (
            ChargedBy::PrefixCell,
            Some((IpAddr::from([10, 231, x, 0]), 24))
        ),
        "{q:?}"
    );
    assert_eq!((q.quota.limit, q.quota.remaining), (5, 3), "{q:?}");
    assert_eq!(
        offer(&dp, &to([10, 231, x, 77], 7777), 5),
        (3, 2),
        "its remaining pass, no more"
    );
    // A /24 whose set is full of other cells: its rule's last resort.
    let y = (0..=255u8)
        .find(|&y| !cells.room_for(&keys(&toml, 1, [10, 232, y, 0]).1))
        .expect("a /24 whose set is full");
    assert_eq!(offer(&dp, &to([10, 232, y, 1], 7777), 1), (1, 0));
    let q = quota_of(&dp, [10, 232, y, 50], 1).expect("the last resort holds a charge");
    assert_eq!(
        (q.by, q.prefix, q.quota.remaining),
        (ChargedBy::LastResort, None, 4),
        "{q:?}"
    );
    // (A source whose /24 has room would claim a cell, a copy of it.)
    assert_eq!(
        quota_of(&dp, [10, 230, 0, 1], 1).map(|q| (q.by, q.quota.remaining)),
        Some((ChargedBy::LastResort, 4))
    );
    assert_eq!(
        offer(&dp, &to([10, 232, y, 50], 7777), 5),
        (4, 1),
        "its remaining pass, no more"
    );
}

#[test]
fn wide_cells_made_keep_limiting_after_a_reload_turns_them_off() {
    let toml = rules("");
    let (mut dp, cells, b) = one_wide(&toml);
    turned_off_at_a_reload(
        &mut dp,
        &cells,
        &toml,
        b,
        &toml.replace(
            "flood_prefixes = 256",
            "flood_prefixes = 256\nflood_wide_cells = false",
        ),
    );
}

/// After [`one_wide`] (`toml`, 10.b/16's wide cell made), a reload to
/// `off`, where "once" may make no more: the one made keeps its /16's
/// unseen keys (a fresh /24 cell would pass), and another /16's newcomer
/// gets a cell of its /24, no wide cell.
fn turned_off_at_a_reload(
    dp: &mut Datapath,
    cells: &CellArray<Key4>,
    toml: &str,
    b: u8,
    off: &str,
) {
    reload(dp, off);
    assert_eq!(
        offer(dp, &to([10, b, 2, 1], 9999), 1),
        (0, 1),
        "still charged to the wide cell"
    );
    assert!(cells.find(&keys(toml, 2, [10, b, 2, 1]).1).is_none());
    // (That cell copies the rule's last resort, which the widening flood's
    // prefixes without room have drained.)
    let b2 = roomy(cells, 61..=120, |b| keys(toml, 2, [10, b, 1, 1]).1);
    offer(dp, &to([10, b2, 1, 1], 9999), 1);
    assert!(
        cells.find(&keys(toml, 2, [10, b2, 1, 1]).1).is_some(),
        "another /16: a cell of its /24"
    );
    assert!(
        cells.find(&keys(toml, 2, [10, b2, 0, 0]).0).is_none(),
        "no wide cell made once they are off"
    );
    assert_eq!(dp.wide_counts().unwrap(), (1, 0));
}

/// "1 per hour" rules on UDP 7001 and 7002 whose ids, as compiled, share
/// a wide-cell count.
fn sharing_pair() -> String {
    let rule = |name: &str, port: u16| {
        format!("[[rule]]\nname = \"{name}\"\nproto = \"udp\"\ndst_ports = [{port}]\nrate = 1\nper = \"1h\"\nburst = 1\n")
    };
    let x = rl_tests::sharing_a_wide_count(&rules(""), "x", |n| rule(n, 7001), &rule("y", 7002));
    rule(&x, 7001) + &rule("y", 7002)
}

/// Two rules whose ids, as compiled, would share a wide-cell count get
/// counts of their own when installed (`compile::part_wide_counts`), so a
/// wide flood under one leaves the other's newcomers with cells of their
/// own prefix, their burst whole (d).
#[test]
fn rules_whose_ids_would_share_a_wide_count_are_parted_and_a_flood_under_one_leaves_the_other_alone(
) {
    require_root();
    let toml = rules(&sharing_pair());
    let natural = compile(&Config::from_str(&toml, "<test>").unwrap()).rules;
    let (x, y) = (&natural.entries[3], &natural.entries[4]);
    assert_eq!(
        rl_common::wide_entry(x.id, 0),
        rl_common::wide_entry(y.id, 0),
        "compiled, they share"
    );
    let dp = datapath(&toml).unwrap();
    let slot = dp.active_slot().unwrap();
    let installed = |i: u32| {
        dp.rule_table_entry(slot * rl_common::RULE_SLOTS + i)
            .unwrap()
    };
    let (ix, iy) = (installed(3), installed(4));
    assert_eq!(ix.id, x.id, "the first in the file keeps its id");
    assert_ne!(
        rl_common::wide_entry(ix.id, 0),
        rl_common::wide_entry(iy.id, 0),
        "installed, they do not share"
    );
    assert!(
        dp.wide_count_notes().is_empty(),
        "{:?}",
        dp.wide_count_notes()
    );
    let key = |e: &rl_common::RuleEntry, src: [u8; 4]| {
        let k = e.key4(0, u32::from_ne_bytes(src));
        (
            Key4 {
                rule: k.rule | KEY_WIDE,
                addr: k.addr & u32::from_ne_bytes([255, 255, 0, 0]),
            },
            Key4 {
                rule: k.rule | KEY_CELL,
                addr: k.addr & u32::from_ne_bytes([255, 255, 255, 0]),
            },
        )
    };
    let cells: CellArray<Key4> = dp.cells_v4().unwrap();
    // x's flood goes wide: its newcomer in a new /16 makes a drained wide cell.
    widen(&dp, 7001, 0);
    let b = roomy(&cells, 1..=60, |b| key(&ix, [10, b, 0, 0]).0);
    assert_eq!(
        offer(&dp, &to([10, b, 1, 1], 7001), 1),
        (0, 1),
        "x's wide cell, drained"
    );
    assert!(cells.find(&key(&ix, [10, b, 0, 0]).0).is_some());
    // y's newcomer (another /16) gets its /24's cell and its burst: y did
    // not go wide with x (with a shared count it would have made a drained
    // wide cell and dropped this packet).
    let b2 = roomy(&cells, 100..=200, |b| key(&iy, [10, b, 1, 0]).1);
    assert_eq!(
        offer(&dp, &to([10, b2, 1, 1], 7002), 2),
        (1, 1),
        "y's newcomer keeps its burst of 1"
    );
    let (wide, cell) = key(&iy, [10, b2, 1, 1]);
    assert!(
        cells.find(&cell).is_some() && cells.find(&wide).is_none(),
        "y's flood is not wide"
    );
    // Installed again (a reload of the same rules into the other table):
    // the same ids.
    let mut dp = dp;
    reload(&mut dp, &toml);
    let slot2 = dp.active_slot().unwrap();
    assert_ne!(slot2, slot);
    let again = |i: u32| {
        dp.rule_table_entry(slot2 * rl_common::RULE_SLOTS + i)
            .unwrap()
            .id
    };
    assert_eq!(
        (again(3), again(4)),
        (ix.id, iy.id),
        "a reload keeps the parted ids (and so the buckets)"
    );
}
