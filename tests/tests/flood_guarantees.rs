//! Spoofed-source floods against a small table (TestRun, because the
//! frames carry forged sources): the README's guarantees (a)–(d) in one run.

use rl_common::{STAT_FALLBACK, STAT_NEW_SOURCES};
use rl_tests::{datapath, frames::*, lab::require_root, offer, traffic::spoofed_source as spoofed};

const MAX_SOURCES: u32 = 1024;

fn config() -> String {
    rl_tests::flood_rules(MAX_SOURCES as u64)
}

fn to(src: [u8; 4], port: u16) -> Vec<u8> {
    eth(&[], ETH_P_IP, &ipv4(src, UDP, &[], &udp(port)))
}

#[test]
fn a_spoofed_flood_neither_resets_nor_bypasses_a_limit_nor_touches_others() {
    require_root();
    let dp = datapath(&config()).unwrap();
    let (known, limited, other, allowed) = ([192, 0, 2, 10], [192, 0, 2, 20], [192, 0, 2, 30], [203, 0, 113, 7]);

    // Before the flood.
    assert_eq!(offer(&dp, &to(known, 5000), 10), (10, 0), "a well-behaved source under [default]");
    assert_eq!(offer(&dp, &to(limited, 9999), 3), (1, 2), "1 per hour: the 2nd and 3rd drop");
    assert_eq!(offer(&dp, &to(other, 7777), 2), (2, 0));

    // The flood: 10 × max_sources distinct spoofed sources to the
    // 1-per-hour port, each sending twice (a second round after all).
    let n = 10 * MAX_SOURCES;
    let mut seed = 0x9e37_79b9u32;
    let sources: Vec<[u8; 4]> = (0..n).map(|_| spoofed(&mut seed)).collect();
    let distinct = sources.iter().collect::<std::collections::HashSet<_>>().len() as u32;
    let mut passed = 0;
    for round in 0..2 {
        for s in &sources {
            passed += offer(&dp, &to(*s, 9999), 1).0;
        }
        // (a) the rule never passes more than one packet per distinct key.
        assert!(passed <= distinct, "round {round}: {passed} passed from {distinct} keys allowed 1 each");
    }
    let c = dp.counters().unwrap();
    assert!(c.get(STAT_FALLBACK) > 0, "the flood was charged to fallbacks: {c}");
    assert!(
        c.get(STAT_NEW_SOURCES) < 2 * MAX_SOURCES as u64,
        "flood mode stopped creating buckets: {} created",
        c.get(STAT_NEW_SOURCES)
    );

    // (b) the limited source got nothing back.
    assert_eq!(offer(&dp, &to(limited, 9999), 3), (0, 3), "a limited key stays limited through the flood");
    // (c) the known source kept its bucket and keeps passing.
    assert_eq!(offer(&dp, &to(known, 5000), 10), (10, 0));
    assert!(dp.sources().unwrap().iter().any(|s| s.addr == std::net::IpAddr::from(known)), "the known source's bucket survived");
    // (d) another rule's source and allowed sources are untouched.
    assert_eq!(offer(&dp, &to(other, 7777), 3), (3, 0), "5 per hour: 2 before + 3 now");
    assert_eq!(offer(&dp, &to(other, 7777), 1), (0, 1), "and the 6th drops");
    assert_eq!(offer(&dp, &to(allowed, 9999), 5), (5, 0));
}

#[test]
fn a_full_table_fails_closed_and_newcomers_share_their_prefix_cell() {
    require_root();
    // Flood mode never trips: the table itself fills.
    let dp = datapath(&config().replace("flood_new_keys_per_sec = 2000", "flood_new_keys_per_sec = 1000000000")).unwrap();
    let mut seed = 0x1234_5678u32;
    let mut passed = 0;
    // More keys than the whole table holds (own buckets, cells and the
    // last resorts' room).
    let n = 16 * MAX_SOURCES;
    for _ in 0..n {
        passed += offer(&dp, &to(spoofed(&mut seed), 9999), 1).0;
    }
    assert!(passed <= n, "{passed} of {n}");
    let c = dp.counters().unwrap();
    assert!(c.get(rl_common::STAT_TABLE_FULL) > 0, "inserts were refused once full: {c}");
    // Two newcomers of one /24 beyond the table share its cell: one passes.
    let (x, y) = ([172, 16, 9, 1], [172, 16, 9, 2]);
    let got = offer(&dp, &to(x, 9999), 1).0 + offer(&dp, &to(y, 9999), 1).0;
    assert!(got <= 1, "newcomers in one /24 share its 1-per-hour cell: {got} passed");
}
