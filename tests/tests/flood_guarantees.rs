//! Spoofed-source floods against a small table (TestRun, because the
//! frames carry forged sources): the README's guarantees (a)–(d) in one run;
//! a full table (`max_sources` own buckets) failing closed with room left
//! for the rules' last resorts; the own buckets' count following the
//! collector, and adopted from pins that lack it; the flood detector's
//! 67 ms window.

use rl_common::{STAT_FALLBACK, STAT_NEW_SOURCES};
use rl_tests::{datapath, frames::*, lab::require_root, offer, traffic::spoofed_source as spoofed};

const MAX_SOURCES: u32 = 1024;

fn config() -> String {
    rl_tests::flood_rules(MAX_SOURCES as u64)
}

/// [`config`]'s rules for a table of `max_sources`, flood mode never on:
/// only a full table stops inserts.
fn no_flood_mode(max_sources: u32) -> String {
    rl_tests::flood_rules(max_sources as u64).replace(
        "flood_new_keys_per_sec = 2000",
        "flood_new_keys_per_sec = 1000000000",
    )
}

fn to(src: [u8; 4], port: u16) -> Vec<u8> {
    eth(&[], ETH_P_IP, &ipv4(src, UDP, &[], &udp(port)))
}

/// Offers each of `sources` twice (a second round after all) to the
/// 1-per-hour rule through `frame`, and checks (a) after each round: the
/// rule never passes more than one packet per distinct key (`what` names
/// them); then that the flood went to fallbacks and flood mode stopped
/// creating buckets.
fn flood_twice<S: Copy + Eq + std::hash::Hash>(
    dp: &rl_control::datapath::Datapath,
    sources: &[S],
    frame: impl Fn(S) -> Vec<u8>,
    what: &str,
) {
    let distinct = sources
        .iter()
        .collect::<std::collections::HashSet<_>>()
        .len() as u32;
    let mut passed = 0;
    for round in 0..2 {
        for s in sources {
            passed += offer(dp, &frame(*s), 1).0;
        }
        assert!(
            passed <= distinct,
            "round {round}: {passed} passed from {distinct} {what} allowed 1 each"
        );
    }
    let c = dp.counters().unwrap();
    assert!(
        c.get(STAT_FALLBACK) > 0,
        "the flood was charged to fallbacks: {c}"
    );
    // Flood mode, not the full table, stopped the inserts: a CPU's share
    // of one 67 ms window (2,000/s: 134 host-wide), far from max_sources.
    assert!(
        c.get(STAT_NEW_SOURCES) < MAX_SOURCES as u64 / 4,
        "flood mode stopped creating buckets early: {c}"
    );
    assert_eq!(
        c.get(rl_common::STAT_TABLE_FULL),
        0,
        "no insert was refused: the table never filled: {c}"
    );
    let flood = rl_control::datapath::flood_mode(&dp.table_maps().unwrap()).unwrap();
    assert!(flood.on, "the flood detector reports flood mode: {flood:?}");
}

#[test]
fn a_spoofed_flood_neither_resets_nor_bypasses_a_limit_nor_touches_others() {
    require_root();
    let dp = datapath(&config()).unwrap();
    let (known, limited, other, allowed) = (
        [192, 0, 2, 10],
        [192, 0, 2, 20],
        [192, 0, 2, 30],
        [203, 0, 113, 7],
    );

    // Before the flood.
    assert_eq!(
        offer(&dp, &to(known, 5000), 10),
        (10, 0),
        "a well-behaved source under [default]"
    );
    assert_eq!(
        offer(&dp, &to(limited, 9999), 3),
        (1, 2),
        "1 per hour: the 2nd and 3rd drop"
    );
    assert_eq!(offer(&dp, &to(other, 7777), 2), (2, 0));

    // The flood: 10 × max_sources distinct spoofed sources to the
    // 1-per-hour port, each sending twice (a second round after all).
    let n = 10 * MAX_SOURCES;
    let mut seed = 0x9e37_79b9u32;
    let sources: Vec<[u8; 4]> = (0..n).map(|_| spoofed(&mut seed)).collect();
    flood_twice(&dp, &sources, |s| to(s, 9999), "keys");

    // (b) the limited source got nothing back.
    assert_eq!(
        offer(&dp, &to(limited, 9999), 3),
        (0, 3),
        "a limited key stays limited through the flood"
    );
    // (c) the known source kept its bucket and keeps passing.
    assert_eq!(offer(&dp, &to(known, 5000), 10), (10, 0));
    assert!(
        dp.sources()
            .unwrap()
            .iter()
            .any(|s| s.addr == std::net::IpAddr::from(known)),
        "the known source's bucket survived"
    );
    // (d) another rule's source and allowed sources are untouched.
    assert_eq!(
        offer(&dp, &to(other, 7777), 3),
        (3, 0),
        "5 per hour: 2 before + 3 now"
    );
    assert_eq!(offer(&dp, &to(other, 7777), 1), (0, 1), "and the 6th drops");
    assert_eq!(offer(&dp, &to(allowed, 9999), 5), (5, 0));
}

#[test]
fn a_full_table_fails_closed_and_newcomers_share_their_prefix_cell() {
    require_root();
    // Flood mode never trips: the table itself fills.
    let dp = datapath(&no_flood_mode(MAX_SOURCES)).unwrap();
    let mut seed = 0x1234_5678u32;
    let mut passed = 0;
    // More keys than the whole table holds (own buckets, cells and the
    // last resorts' room).
    let n = 16 * MAX_SOURCES;
    for _ in 0..n {
        passed += offer(&dp, &to(spoofed(&mut seed), 9999), 1).0;
    }
    // Each key passes at most once (1 per hour), and only while it can
    // have fresh state: its own bucket (max_sources, and one over per
    // CPU racing the cap), a prefix cell claimed while the last resort it
    // copies was fresh (at most the cell array's slots), the last resort.
    let cpus = aya::util::online_cpus().unwrap().len() as u32;
    let bound = MAX_SOURCES + cpus + rl_common::cell_slots(256) + 1;
    assert!(
        passed <= bound,
        "{passed} of {n} passed: more than fresh state allows ({bound})"
    );
    let c = dp.counters().unwrap();
    assert!(
        c.get(rl_common::STAT_TABLE_FULL) > 0,
        "inserts were refused once full: {c}"
    );
    // Full means `max_sources` own buckets: the rest of the table is the
    // last resorts' room, so a rule first hit now still gets one (and its
    // newcomers share it), rather than finding no state at all.
    let own = dp
        .sources()
        .unwrap()
        .iter()
        .filter(|s| s.addr.is_ipv4())
        .count();
    assert_eq!(own, MAX_SOURCES as usize, "own buckets held at max_sources");
    assert_eq!(
        offer(&dp, &to([198, 51, 100, 1], 7777), 6),
        (5, 1),
        "a rule first hit in a full table: its last resort's 5"
    );
    assert_eq!(
        dp.counters().unwrap().get(rl_common::STAT_NO_STATE),
        0,
        "no packet found no state"
    );
    // Two newcomers of one /24 beyond the table share its cell: one passes.
    let (x, y) = ([172, 16, 9, 1], [172, 16, 9, 2]);
    let got = offer(&dp, &to(x, 9999), 1).0 + offer(&dp, &to(y, 9999), 1).0;
    assert!(
        got <= 1,
        "newcomers in one /24 share its 1-per-hour cell: {got} passed"
    );
}

/// The program's count of own buckets (`RL_OWNED`, IPv4): what the cap reads.
fn owned_v4(dp: &rl_control::datapath::Datapath) -> aya::maps::Array<aya::maps::MapData, u64> {
    let data = dp.table_maps().unwrap().owned.open().unwrap();
    aya::maps::Array::try_from(aya::maps::Map::Array(data)).unwrap()
}

#[test]
fn the_collector_keeps_the_own_bucket_count_true_so_the_cap_neither_sticks_nor_leaks() {
    require_root();
    use rl_control::datapath::COLLECT_IDLE_NS;
    const CAP: u32 = 64;
    // Only the cap refuses. [default] (1000/s) buckets are fresh again a
    // millisecond after their packet.
    let dp = datapath(&no_flood_mode(CAP)).unwrap();
    let walk = rl_tests::collector_pass;
    let new_sources = |n: u8, from: u8| {
        for i in 0..n {
            assert_eq!(offer(&dp, &to([192, 0, from, i], 5000), 1), (1, 0));
        }
    };
    let stat = |i| dp.counters().unwrap().get(i);
    new_sources(CAP as u8, 1);
    assert_eq!(owned_v4(&dp).get(&0, 0).unwrap(), CAP as u64);
    new_sources(1, 2);
    assert_eq!(
        (stat(STAT_NEW_SOURCES), stat(rl_common::STAT_TABLE_FULL)),
        (CAP as u64, 1),
        "the 65th is refused"
    );

    // Collected once fresh and idle: the count goes down with them, and
    // new sources get buckets of their own again.
    std::thread::sleep(std::time::Duration::from_nanos(
        COLLECT_IDLE_NS + 200_000_000,
    ));
    let pass = walk(&dp);
    assert_eq!(pass.own.0, 0, "{pass:?}");
    assert_eq!(
        owned_v4(&dp).get(&0, 0).unwrap(),
        0,
        "the count follows the collector's deletes"
    );
    new_sources(CAP as u8, 3);
    assert_eq!(
        stat(STAT_NEW_SOURCES),
        2 * CAP as u64,
        "a collected table takes new sources again"
    );

    // A count that lost track (pins adopted from a build without it) is
    // set right by the next walk, and the cap holds again.
    let mut owned = owned_v4(&dp);
    owned.set(0, 0, 0).unwrap();
    let pass = walk(&dp);
    assert_eq!(
        (pass.own.0, owned.get(&0, 0).unwrap()),
        (CAP as u64, CAP as u64)
    );
    let full = stat(rl_common::STAT_TABLE_FULL);
    new_sources(1, 4);
    assert_eq!(
        stat(rl_common::STAT_TABLE_FULL),
        full + 1,
        "the cap holds after the walk"
    );
}

#[test]
fn pins_of_a_build_without_the_own_bucket_count_are_adopted_and_counted_at_the_first_walk() {
    require_root();
    use rl_control::{
        compile::compile,
        config::Config,
        datapath::{Datapath, LoadOptions},
    };
    const CAP: u32 = 64;
    let compiled = compile(&Config::from_str(&no_flood_mode(CAP), "<test>").unwrap());
    let pins = rl_tests::lab::BpfFs::new().unwrap();
    let dir = pins.path().join("owned");
    rl_control::datapath::prepare_pins(pins.path(), &dir).unwrap();
    let load = || {
        Datapath::load_with(
            &compiled,
            LoadOptions {
                pin: Some(dir.clone()),
                ..Default::default()
            },
        )
        .unwrap()
    };
    // "calm" (5 per hour): buckets no walk collects.
    let calm = |dp: &Datapath, from: u8, n: u8| {
        (0..n)
            .map(|i| offer(dp, &to([192, 0, from, i], 7777), 1).0)
            .sum::<u32>()
    };
    assert_eq!(calm(&load(), 1, CAP as u8), CAP);
    std::fs::remove_file(dir.join(rl_common::MAP_OWNED)).unwrap();
    let dp = load();
    assert!(dp.adopted());
    assert_eq!(owned_v4(&dp).get(&0, 0).unwrap(), 0, "a fresh count");
    assert_eq!(
        calm(&dp, 2, 1),
        1,
        "until the first walk the count is behind: a 65th bucket is made"
    );
    let pass = rl_tests::collector_pass(&dp);
    assert_eq!(
        (pass.own.0, owned_v4(&dp).get(&0, 0).unwrap()),
        (CAP as u64 + 1, CAP as u64 + 1)
    );
    let full = dp.counters().unwrap().get(rl_common::STAT_TABLE_FULL);
    calm(&dp, 3, 1);
    assert_eq!(
        dp.counters().unwrap().get(rl_common::STAT_TABLE_FULL),
        full + 1,
        "then the cap holds"
    );
}

#[test]
fn an_ipv6_spoofed_flood_neither_resets_nor_bypasses_a_limit_nor_touches_others() {
    require_root();
    let dp = datapath(&format!(
        "{}[[allow]]\ncidr = \"2001:db8:aaaa::/48\"\n",
        config()
    ))
    .unwrap();
    // Sources are keyed by /64 (cells by /48): each forged source its own /64.
    let v6 = |a: u16, b: u16, c: u16| {
        let mut s = [0x20, 0x01, 0x0d, 0xb8, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 1];
        s[4..6].copy_from_slice(&a.to_be_bytes());
        s[6..8].copy_from_slice(&b.to_be_bytes());
        s[15] = c as u8;
        s
    };
    let to6 = |src: [u8; 16], port: u16| eth(&[], ETH_P_IPV6, &ipv6(src, UDP, &udp(port)));
    let (known, limited, other) = (v6(0xffff, 1, 1), v6(0xffff, 2, 1), v6(0xffff, 3, 1));
    assert_eq!(offer(&dp, &to6(known, 5000), 10), (10, 0));
    assert_eq!(offer(&dp, &to6(limited, 9999), 3), (1, 2));
    assert_eq!(offer(&dp, &to6(other, 7777), 2), (2, 0));
    let n = 10 * MAX_SOURCES;
    let mut seed = 0x2545_f491u32;
    let sources: Vec<[u8; 16]> = (0..n)
        .map(|_| {
            let s = spoofed(&mut seed);
            v6(
                u16::from_be_bytes([s[1], s[2]]) & 0x7fff,
                u16::from(s[3]),
                1,
            )
        })
        .collect();
    flood_twice(&dp, &sources, |s| to6(s, 9999), "/64s");
    assert_eq!(
        offer(&dp, &to6(limited, 9999), 3),
        (0, 3),
        "a limited /64 stays limited through the flood"
    );
    assert_eq!(
        offer(&dp, &to6(known, 5000), 10),
        (10, 0),
        "the known /64 keeps passing"
    );
    let listed = |mut src: [u8; 16]| {
        src[8..].fill(0);
        dp.sources()
            .unwrap()
            .iter()
            .any(|s| s.addr == std::net::IpAddr::from(src))
    };
    assert!(
        listed(known) && listed(other),
        "the known /64s' buckets survived"
    );
    assert_eq!(
        offer(&dp, &to6(other, 7777), 3),
        (3, 0),
        "another rule's /64: 2 before + 3 now of 5"
    );
    assert_eq!(offer(&dp, &to6(other, 7777), 1), (0, 1));
    let allowed = v6(0xaaaa, 0, 7);
    assert_eq!(
        offer(&dp, &to6(allowed, 9999), 5),
        (5, 0),
        "an allowed IPv6 CIDR passes through the flood"
    );
}

/// The detector measures the unseen-key rate over 67 ms windows: a flood
/// trips it after a CPU's share of one window (not of a second), and the
/// CPU makes buckets of its own again within two windows of the flood's
/// end (not two seconds). 954 keys/s is 65 a window host-wide, 1,024 a
/// ~1.07 s window.
#[test]
fn the_flood_detector_trips_within_a_67_ms_window_and_lets_go_within_two() {
    detector_window(false);
}

/// The same where the kernel tick could not be measured at load: the
/// detector then reads ktime (the tick clock would stand at 0, and the
/// first window would never end).
#[test]
fn without_a_measured_tick_the_flood_detector_still_keeps_time() {
    detector_window(true);
}

fn detector_window(without_tick: bool) {
    use rl_control::{
        compile::compile,
        config::Config,
        datapath::{Datapath, LoadOptions},
    };
    require_root();
    rl_tests::lab::pin_to_cpu(0).unwrap();
    let cfg = config().replace(
        "flood_new_keys_per_sec = 2000",
        "flood_new_keys_per_sec = 954",
    );
    let compiled = compile(&Config::from_str(&cfg, "<test>").unwrap());
    let dp = Datapath::load_with(
        &compiled,
        LoadOptions {
            without_tick,
            ..Default::default()
        },
    )
    .unwrap();
    // The rate is shared among the online CPUs.
    let cpus = aya::util::online_cpus().unwrap().len() as u64;
    let share = 65u64.div_ceil(cpus);
    let src = |i: u32| [10, 9, (i >> 8) as u8, i as u8];
    // 400 unseen sources on one CPU, as fast as TestRun takes them: at most
    // its share of each window they span (and one more, should they
    // straddle a boundary).
    let start = std::time::Instant::now();
    for i in 0..400 {
        offer(&dp, &to(src(i), 5000), 1);
    }
    let spanned = start.elapsed().as_nanos() as u64 / (1 << rl_common::FLOOD_WINDOW_SHIFT) + 2;
    assert!(
        spanned * share < 400,
        "400 TestRuns took {:?}: too slow to tell windows apart",
        start.elapsed()
    );
    let c = dp.counters().unwrap();
    let made = c.get(STAT_NEW_SOURCES);
    assert!(
        (share..=spanned * share).contains(&made),
        "{made} own buckets for 400 unseen sources over {spanned} windows: expected at most {share} a window ({cpus} CPUs)"
    );
    assert!(
        c.get(STAT_FALLBACK) >= 400 - made,
        "the rest were charged to their cells: {c}"
    );
    // Two windows after the flood's last packet the CPU is calm again.
    std::thread::sleep(std::time::Duration::from_millis(300));
    offer(&dp, &to(src(1000), 5000), 1);
    assert_eq!(
        dp.counters().unwrap().get(STAT_NEW_SOURCES),
        made + 1,
        "a newcomer 300 ms after the flood owns a bucket"
    );
}

/// A datapath with flood mode on on this thread's CPU (0): [`config`] at
/// 954 keys/s, 65 a 67 ms window host-wide, then 200 unseen sources, far
/// more than the CPU's share of that window.
fn in_flood_mode() -> rl_control::datapath::Datapath {
    require_root();
    rl_tests::lab::pin_to_cpu(0).unwrap();
    let dp = datapath(&config().replace(
        "flood_new_keys_per_sec = 2000",
        "flood_new_keys_per_sec = 954",
    ))
    .unwrap();
    for i in 0..200u32 {
        offer(&dp, &to([10, 9, (i >> 8) as u8, i as u8], 5000), 1);
    }
    dp
}

/// A source first seen in flood mode that keeps sending faster than the
/// detector's share once the flood is over is offered a bucket of its own
/// (the key just past a window's share is), and flood mode ends: every
/// packet of a key without a bucket counts as unseen, so it held its CPU
/// in flood mode for as long as it sent (and the daemon reported a flood
/// that was over).
#[test]
fn a_source_that_keeps_sending_after_a_flood_gets_its_bucket_and_flood_mode_ends() {
    let dp = in_flood_mode();
    let stat = |i| dp.counters().unwrap().get(i);
    assert!(
        rl_control::datapath::flood_mode(&dp.table_maps().unwrap())
            .unwrap()
            .on,
        "the flood tripped flood mode"
    );
    // For half a second (7 windows), 500 packets every 20 ms from one
    // source: far over this CPU's share (33 a window).
    let heavy = [172, 16, 7, 1];
    for _ in 0..25 {
        offer(&dp, &to(heavy, 5000), 500);
        std::thread::sleep(std::time::Duration::from_millis(20));
    }
    assert!(
        dp.sources()
            .unwrap()
            .iter()
            .any(|s| s.addr == std::net::IpAddr::from(heavy)),
        "it owns a bucket"
    );
    let fallback = stat(STAT_FALLBACK);
    offer(&dp, &to(heavy, 5000), 500);
    assert_eq!(
        stat(STAT_FALLBACK),
        fallback,
        "flood mode is over: nothing is charged to a fallback"
    );
    let made = stat(STAT_NEW_SOURCES);
    offer(&dp, &to([172, 16, 8, 1], 5000), 1);
    assert_eq!(
        stat(STAT_NEW_SOURCES),
        made + 1,
        "a newcomer owns a bucket again"
    );
}

/// Guarantee (b) across the move from a shared bucket to one of its own: a
/// key first seen in flood mode is charged to its /24's cell and limited
/// there; once the flood is over it gets a bucket of its own, which starts
/// as a copy of that cell, so it stays limited (a fresh bucket would hand
/// it a new allowance). A newcomer of another /24 passes, as a control.
#[test]
fn a_key_limited_in_its_prefix_cell_stays_limited_in_its_own_bucket() {
    // Then the key, still in the flood's window.
    let dp = in_flood_mode();
    let stat = |i| dp.counters().unwrap().get(i);
    let key = [172, 16, 5, 1];
    let made = stat(STAT_NEW_SOURCES);
    assert_eq!(
        offer(&dp, &to(key, 9999), 3),
        (1, 2),
        "1 per hour, charged to the key's /24 cell"
    );
    assert_eq!(
        stat(STAT_NEW_SOURCES),
        made,
        "in flood mode: no bucket of its own yet"
    );
    // Two windows later the flood is over: the key gets its own bucket.
    std::thread::sleep(std::time::Duration::from_millis(300));
    assert_eq!(
        offer(&dp, &to(key, 9999), 2),
        (0, 2),
        "its own bucket carries the cell's state: still limited"
    );
    assert_eq!(
        stat(STAT_NEW_SOURCES),
        made + 1,
        "the key owns a bucket now"
    );
    assert!(
        dp.sources()
            .unwrap()
            .iter()
            .any(|s| s.addr == std::net::IpAddr::from(key)),
        "and it is listed"
    );
    assert_eq!(
        offer(&dp, &to([172, 16, 6, 1], 9999), 2),
        (1, 1),
        "a newcomer of another /24 has its own allowance"
    );
}
