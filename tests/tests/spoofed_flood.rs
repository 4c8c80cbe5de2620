//! A spoofed-source flood through real veth into the running daemon: forged
//! frames from 10 × `max_sources` random sources, with the README's
//! guarantees (a)–(d) checked on what actually reached the protected side,
//! and flood mode seen in `/metrics`, `/v1/status`, `rl-control status`,
//! the events and the shipped alerts (`dist/rl-alerts.yml`).

use std::{
    collections::HashMap,
    net::IpAddr,
    time::{Duration, Instant},
};

use rl_tests::{
    alerts,
    daemon::{run_once, write, Daemon},
    frames::{eth, ipv4, udp, ETH_P_IP, UDP},
    http::{get, parse_prometheus},
    lab::{Lab, VA, VB},
    traffic::{forged, join, spoofed_source, Receiver},
};

const MAX_SOURCES: u64 = 1024;
const FLOOD_PPS: u64 = 8000;

fn config() -> String {
    rl_tests::flood_rules(MAX_SOURCES)
}

/// Sends `n` frames from `src` to `port` at 1000 pps and waits for them.
fn send(lab: &Lab, src: [u8; 4], port: u16, n: u64) {
    join(forged(
        &lab.a,
        VA,
        eth(&[], ETH_P_IP, &ipv4(src, UDP, &[], &udp(port))),
        n,
        1000,
        None,
        move |_| src,
    ))
    .unwrap();
}

fn count(got: &HashMap<IpAddr, u64>, src: [u8; 4]) -> u64 {
    got.get(&IpAddr::from(src)).copied().unwrap_or(0)
}

fn events(lab: &Lab, kind: &str) -> usize {
    let ev = get(&lab.b, "/v1/events?limit=1000").json();
    ev["events"]
        .as_array()
        .unwrap()
        .iter()
        .filter(|e| e["event"] == kind)
        .count()
}

#[test]
fn a_spoofed_flood_through_the_daemon_neither_resets_nor_bypasses_a_limit_and_is_reported() {
    let lab = Lab::new().unwrap();
    let dir = tempfile::tempdir().unwrap();
    let cfg = write(&dir, "rl.toml", &config());
    let daemon = Daemon::serving(&lab, &cfg, &[]).unwrap();
    let tap = Receiver::tap(&lab.b, VB).unwrap();
    let (known, limited, other, allowed) = (
        [192, 0, 2, 10],
        [192, 0, 2, 20],
        [192, 0, 2, 30],
        [203, 0, 113, 7],
    );

    // Before the flood: a well-behaved source, one that used its 1 per hour,
    // one under another rule.
    send(&lab, known, 5000, 10);
    send(&lab, limited, 9999, 3);
    send(&lab, other, 7777, 2);

    // The flood: 10 × max_sources distinct forged sources to the 1-per-hour
    // port, twice over, at 8,000 pps (flood mode trips at 2,000 new keys/s);
    // meanwhile the known source keeps sending, well within [default].
    let n = 10 * MAX_SOURCES;
    let mut seed = 0x9e37_79b9u32;
    let sources: Vec<[u8; 4]> = (0..n).map(|_| spoofed_source(&mut seed)).collect();
    let distinct: std::collections::HashSet<[u8; 4]> = sources.iter().copied().collect();
    assert!(
        distinct.len() as u64 >= 10 * MAX_SOURCES - 10,
        "the generator repeats itself"
    );
    let flood_frame = eth(&[], ETH_P_IP, &ipv4([0; 4], UDP, &[], &udp(9999)));
    let list = sources.clone();
    let flood = forged(&lab.a, VA, flood_frame, 2 * n, FLOOD_PPS, None, move |i| {
        list[(i % n) as usize]
    });
    let steady_n = 2 * n * 200 / FLOOD_PPS;
    let steady = forged(
        &lab.a,
        VA,
        eth(&[], ETH_P_IP, &ipv4(known, UDP, &[], &udp(5000))),
        steady_n,
        200,
        None,
        move |_| known,
    );

    // While it lasts, the pressure shows in /metrics, /v1/status and the CLI.
    let (mut metrics_on, mut status_on, mut cli_on, mut alert_on) = (false, false, false, false);
    let mut cpus_on = 0u64;
    let (mut fallbacks_seen, mut cells_seen) = (0.0f64, (0.0f64, 0u64));
    while !flood.is_finished() {
        std::thread::sleep(Duration::from_millis(250));
        let m = parse_prometheus(&get(&lab.b, "/metrics").body);
        metrics_on |= m["rl_flood_mode"] == 1.0 && m["rl_unseen_keys_per_second"] > 2000.0;
        alert_on |=
            alerts::check(&m, &["daemon", "datapath", "l7"]).contains(&"RlFloodMode".to_string());
        fallbacks_seen =
            fallbacks_seen.max(m["rl_datapath_events_total{event=\"fallback_packets\"}"]);
        cells_seen.0 = cells_seen
            .0
            .max(m["rl_table_occupancy_ratio{table=\"cells\",family=\"ipv4\"}"]);
        let p = &get(&lab.b, "/v1/status").json()["pressure"];
        status_on |= p["flood_mode"] == true && p["unseen_keys_per_sec"].as_f64().unwrap() > 2000.0;
        // The CPUs in flood mode: at least one while it is on, none of more than there are.
        let (on, of) = (
            p["flood_mode_cpus"].as_u64().unwrap(),
            p["cpus"].as_u64().unwrap(),
        );
        assert!(
            of >= 1 && on <= of && (p["flood_mode"] == false || on >= 1),
            "{p}"
        );
        cpus_on = cpus_on.max(on);
        cells_seen.1 = cells_seen.1.max(p["cells_ipv4"].as_u64().unwrap());
        // Own buckets stop at max_sources (one over per CPU racing for the last).
        // (Possible CPUs: XDP runs on any of them, whatever this test's affinity.)
        let (own, cpus) = (
            p["buckets_ipv4"].as_u64().unwrap(),
            aya::util::nr_cpus().map_or(1, |n| n as u64),
        );
        assert!(
            own <= MAX_SOURCES + cpus,
            "{own} sources tracked of {MAX_SOURCES}"
        );
        if !cli_on {
            let (_, out) = run_once(Some(&lab.b), &["status"]).unwrap();
            cli_on = out.lines().any(|l| {
                l.starts_with("flood mode:") && l.contains("ON since") && l.contains(" CPUs (")
            });
        }
    }
    let sent = join(flood).unwrap();
    join(steady).unwrap();
    eprintln!("flood: {} frames in {:.2} s", sent.packets, sent.seconds());

    // After the flood.
    send(&lab, limited, 9999, 3);
    send(&lab, other, 7777, 4);
    send(&lab, allowed, 9999, 5);
    let got = tap.finish().unwrap();

    // (a) no spoofed key passed more than its one packet, however evicted.
    let spoofed_passed: u64 = distinct.iter().map(|s| count(&got, *s)).sum();
    let over: Vec<_> = distinct
        .iter()
        .filter(|s| count(&got, **s) > 1)
        .take(5)
        .collect();
    assert!(
        over.is_empty(),
        "spoofed keys passed more than 1 per hour: {over:?}"
    );
    assert!(
        spoofed_passed <= distinct.len() as u64,
        "{spoofed_passed} passed from {} keys",
        distinct.len()
    );
    eprintln!(
        "spoofed: {spoofed_passed} of {} frames passed ({} distinct keys)",
        2 * n,
        distinct.len()
    );
    // (b) the limited source got nothing after the flood: its 1 before, only.
    assert_eq!(
        count(&got, limited),
        1,
        "a limited key stays limited through the flood"
    );
    // (c) the known source lost nothing before, during or after.
    assert_eq!(
        count(&got, known),
        10 + steady_n,
        "the well-behaved known source passed everything"
    );
    // (d) another rule's source: 5 per hour, 2 before + 3 after, the 6th drops;
    // allowed sources always pass.
    assert_eq!(count(&got, other), 5, "the other rule's limit is its own");
    assert_eq!(count(&got, allowed), 5, "allow CIDRs pass");

    // Reported: flood mode on while it lasted, fallbacks counted, and both
    // events once it ended.
    assert!(
        metrics_on,
        "rl_flood_mode never read 1 with rl_unseen_keys_per_second > 2000 during the flood"
    );
    assert!(
        cells_seen.0 > 0.0 && cells_seen.1 > 0,
        "the flood's prefix cells never showed (metrics, status): {cells_seen:?}"
    );
    assert!(
        status_on,
        "/v1/status never showed flood mode with > 2000 unseen keys/s"
    );
    assert!(cli_on, "`rl-control status` never said flood mode ON");
    assert!(
        alert_on,
        "the shipped alert RlFloodMode never held during the flood"
    );
    assert!(fallbacks_seen > 0.0, "no packet was charged to a fallback");
    let deadline = Instant::now() + Duration::from_secs(6);
    while events(&lab, "flood_ended") == 0 && Instant::now() < deadline {
        std::thread::sleep(Duration::from_millis(200));
    }
    assert_eq!(events(&lab, "flood_started"), 1, "one flood_started event");
    assert_eq!(
        events(&lab, "flood_ended"),
        1,
        "flood_ended within 6 s of the flood's end"
    );
    let m = parse_prometheus(&get(&lab.b, "/metrics").body);
    assert_eq!(m["rl_flood_mode"], 0.0);
    assert!(cpus_on >= 1, "/v1/status never counted a CPU in flood mode");
    assert_eq!(
        (
            m["rl_flood_mode_cpus"],
            get(&lab.b, "/v1/status").json()["pressure"]["flood_mode_cpus"].as_u64()
        ),
        (0.0, Some(0)),
        "after the flood"
    );
    let firing = alerts::check(&m, &["daemon", "datapath", "l7"]);
    assert!(
        !firing.contains(&"RlFloodMode".to_string()) && !firing.contains(&"RlDown".to_string()),
        "after the flood: {firing:?}"
    );
    assert!(
        firing.contains(&"RlWideCells".to_string()),
        "\"once\"'s wide cells stay drained for the hour: {firing:?}"
    );
    assert!(m["rl_table_occupancy_ratio{table=\"sources\",family=\"ipv4\"}"] > 0.0);
    // The walks rebuilt the known-keys filter from the buckets they kept.
    let fill = m["rl_known_filter_fill_ratio{family=\"ipv4\"}"];
    assert!(fill > 0.0 && fill < 0.01, "known-keys filter fill {fill}");
    let (_, out) = run_once(Some(&lab.b), &["status"]).unwrap();
    assert!(
        out.lines()
            .any(|l| l.starts_with("lookup filter:") && !l.contains(" 0.000% of IPv4")),
        "{out}"
    );
    // The flood spanned far more /24s than `flood_prefixes = 256` make room
    // for (its cells, charged for the hour, stay): full, and said to be,
    // so that an operator does not read half the slots as room left.
    let cells = m["rl_table_occupancy_ratio{table=\"cells\",family=\"ipv4\"}"];
    assert!(
        cells >= 1.0,
        "IPv4 cells occupancy {cells} after a flood over thousands of /24s"
    );
    let full = "prefix cells:    FULL at 256: a prefix without a cell shares its rule's last resort (datapath.flood_prefixes)";
    assert!(
        out.lines().any(|l| l == full),
        "`rl-control status` lacks {full:?}:\n{out}"
    );
    assert_eq!(m["rl_cells_full"], 1.0);
    assert_eq!(events(&lab, "cells_full"), 1, "one cells_full event");
    // Its cells filled a quarter of the slots: the rest of it went to wide
    // cells (/16s of 10/8, drained for the hour), seen in all three.
    let wide = m["rl_wide_cells{family=\"ipv4\"}"];
    assert!(
        wide >= 16.0,
        "{wide} wide cells after a flood over all of 10/8"
    );
    assert_eq!(
        events(&lab, "wide_cells_made"),
        1,
        "one wide_cells_made event"
    );
    let wide_line = format!(
        "prefix cells:    IPv4 {}, IPv6 0 of 256 per family; wide: IPv4 {wide}, IPv6 0",
        m["rl_prefix_cells{family=\"ipv4\"}"]
    );
    assert!(
        out.lines().any(|l| l == wide_line),
        "`rl-control status` lacks {wide_line:?}:\n{out}"
    );
    // All of them "once"'s, and named so: its newcomers are the ones that
    // now start drained.
    assert_eq!(
        m.get("rl_rule_wide_cells{rule=\"once\",family=\"ipv4\"}"),
        Some(&wide),
        "/metrics names the rule"
    );
    assert_eq!(
        wide_events(&lab, "wide_cells_made"),
        ["once"],
        "the event names the rule"
    );
    let rules_line = format!("wide cells of:   once (IPv4 {wide}, IPv6 0) (their newcomers in a flooded prefix start drained)");
    assert!(
        out.lines().any(|l| l == rules_line),
        "`rl-control status` lacks {rules_line:?}:\n{out}"
    );
    // A source's quota names the bucket that charges it: the limited
    // source its own, used up for the hour; an address of 10/8 the flood
    // never sent from, its /16's drained wide cell, in the API and the CLI.
    let own = &get(&lab.b, "/v1/sources/192.0.2.20").json()["limits"];
    let once = own
        .as_array()
        .unwrap()
        .iter()
        .find(|l| l["rule"] == "once")
        .unwrap_or_else(|| panic!("{own}"));
    assert_eq!(
        (
            once["charged_to"].as_str(),
            once["prefix"].as_str(),
            once["remaining"].as_u64()
        ),
        (Some("own"), Some("192.0.2.20/32"), Some(0)),
        "{own}"
    );
    let unsent = (0..=255u8)
        .map(|b| [10, b, 250, 251])
        .filter(|a| !distinct.contains(a));
    let (addr, q) = unsent
        .filter_map(|a| {
            let v = get(&lab.b, &format!("/v1/sources/{}", IpAddr::from(a))).json();
            let q = v["limits"]
                .as_array()?
                .iter()
                .find(|l| l["rule"] == "once" && l["charged_to"] == "wide_cell")?
                .clone();
            Some((a, q))
        })
        .next()
        .expect("a /16 of 10/8 in a wide cell");
    // An allowed source is never limited: listed as such, no limits.
    let allowed_state = get(&lab.b, "/v1/sources/203.0.113.7").json();
    assert_eq!(
        (
            allowed_state["listed"].as_str(),
            allowed_state["limits"].as_array().map(Vec::len)
        ),
        (Some("allow"), Some(0)),
        "{allowed_state}"
    );
    let (_, said) = run_once(Some(&lab.b), &["source", "203.0.113.7"]).unwrap();
    assert_eq!(said, "203.0.113.7: in an allow CIDR (never limited)\n");
    let prefix = format!("10.{}.0.0/16", addr[1]);
    assert_eq!(
        (q["prefix"].as_str(), q["remaining"].as_u64()),
        (Some(prefix.as_str()), Some(0)),
        "{q}"
    );
    assert!(
        q["retry_after_ms"].as_u64().unwrap() > 3_000_000,
        "drained for the hour: {q}"
    );
    let (_, said) = run_once(Some(&lab.b), &["source", &IpAddr::from(addr).to_string()]).unwrap();
    assert!(
        said.lines()
            .any(|l| l.starts_with("once ") && l.ends_with(&format!("wide cell {prefix}"))),
        "`rl-control source`:\n{said}"
    );
    // Where the flood is: the cells it drained, by rule and prefix, its
    // wide /16s first (a collector pass after the flood read them).
    let c = get(&lab.b, "/v1/cells?top=100").json();
    let cells = c["cells"].as_array().unwrap_or_else(|| panic!("{c}"));
    assert!(
        c["drained_ipv4"].as_u64().unwrap() >= wide as u64 && c["drained_ipv6"] == 0,
        "{c}"
    );
    assert_eq!(cells.len(), 100, "{c}");
    assert!(
        cells.iter().all(|x| x["rule"] == "once"
            && x["remaining"] == 0
            && x["retry_after_ms"].as_u64().unwrap() > 3_000_000),
        "{c}"
    );
    let wide_first: Vec<bool> = cells.iter().map(|x| x["kind"] == "wide_cell").collect();
    assert!(
        wide_first.windows(2).all(|w| w[0] >= w[1]) && wide_first[0],
        "the wide cells first: {wide_first:?}"
    );
    // Every wide cell is listed, or the list is all wide cells.
    match cells.iter().find(|x| x["prefix"] == prefix.as_str()) {
        Some(ours) => assert_eq!(ours["kind"], "wide_cell", "{ours}"),
        None => assert!(
            wide > 100.0 && wide_first.iter().all(|&w| w),
            "{prefix} is not listed: {c}"
        ),
    }
    assert!(get(&lab.b, "/v1/cells?top=101").status == 400);
    let (_, said) = run_once(Some(&lab.b), &["cells", "-n", "3"]).unwrap();
    assert!(
        said.starts_with(&format!(
            "cells with no room left: IPv4 {}, IPv6 0 (read ",
            c["drained_ipv4"]
        )),
        "`rl-control cells`:\n{said}"
    );
    assert_eq!(
        said.lines()
            .filter(|l| l.starts_with("10.") && l.contains(" once ") && l.contains(" 0/1 "))
            .count(),
        3,
        "`rl-control cells`:\n{said}"
    );
    // With no traffic left, the three surfaces agree on the counts since load.
    let p = get(&lab.b, "/v1/status").json()["pressure"].clone();
    let (fallbacks, refused) = (
        p["fallback_packets"].as_u64().unwrap(),
        p["table_full_refusals"].as_u64().unwrap(),
    );
    assert!(fallbacks > 0, "{p}");
    assert_eq!(
        m["rl_datapath_events_total{event=\"fallback_packets\"}"], fallbacks as f64,
        "/metrics and /v1/status: {p}"
    );
    assert_eq!(
        m["rl_datapath_events_total{event=\"table_full_refusals\"}"], refused as f64,
        "/metrics and /v1/status: {p}"
    );
    let line = format!("fallbacks:       {fallbacks} packets charged to a cell or last resort; {refused} inserts refused (table full)");
    assert!(
        out.lines().any(|l| l == line),
        "`rl-control status` lacks {line:?}:\n{out}"
    );
    // Occupancy per family and table, in both (IPv6 holds at most the lab's
    // own link-local chatter).
    for family in ["ipv4", "ipv6"] {
        for table in ["sources", "cells"] {
            let r =
                m[&format!("rl_table_occupancy_ratio{{table=\"{table}\",family=\"{family}\"}}")];
            assert!(r.is_finite() && r >= 0.0, "{table} {family}: {r}");
        }
    }
    assert!(m["rl_table_occupancy_ratio{table=\"sources\",family=\"ipv4\"}"] > 0.0);
    assert!(
        p["buckets_ipv6"].as_u64().unwrap() < 16 && p["cells_ipv6"].as_u64() == Some(0),
        "{p}"
    );
    assert!(
        p["cell_capacity"] == 256 && p["cells_ipv4"].as_u64().unwrap() >= 256,
        "{p}"
    );
    assert!(
        p["wide_cells_ipv4"].as_u64().unwrap() >= 16 && p["wide_cells_ipv6"] == 0,
        "{p}"
    );
    assert_eq!(
        p["wide_cell_rules"],
        serde_json::json!([{ "rule": "once", "ipv4": wide as u64, "ipv6": 0 }]),
        "{p}"
    );
    // (The collector may have taken fresh buckets between the two reads.)
    let tracked = |l: &str| {
        l.starts_with("sources tracked: IPv4 ")
            && l.contains(", IPv6 ")
            && l.ends_with(" of 1024 per family")
    };
    assert!(out.lines().any(tracked), "{out}");
    let (status, log) = daemon.stop(libc::SIGTERM).unwrap();
    assert!(status.success(), "{log}");
    assert!(
        log.contains("flood_started") && log.contains("flood_ended"),
        "the log names both events:\n{log}"
    );
    assert!(
        log.contains("wide_cells_made"),
        "the log names the wide cells' event:\n{log}"
    );
}

/// The rules named by the events of `kind`, oldest first.
fn wide_events(lab: &Lab, kind: &str) -> Vec<String> {
    let ev = get(&lab.b, "/v1/events?limit=1000").json();
    let mut rules: Vec<String> = ev["events"]
        .as_array()
        .unwrap()
        .iter()
        .filter(|e| e["event"] == kind)
        .map(|e| e["rule"].as_str().unwrap_or("").to_string())
        .collect();
    rules.reverse();
    rules
}

/// A flood under "surge" (1/s, burst 5) goes wide: the event,
/// `/v1/status`, `/metrics`, the alert and the CLI name the rule; its wide
/// cells, drained for 5 s, are fresh again soon after, and their freeing
/// is reported by rule too.
#[test]
fn a_rules_wide_cells_are_named_and_so_is_their_end() {
    let lab = Lab::new().unwrap();
    let dir = tempfile::tempdir().unwrap();
    // Flood mode always on; 256 prefixes' room: wide at 128 cells.
    let rules = config().replace(
        "flood_new_keys_per_sec = 2000",
        "flood_new_keys_per_sec = 0",
    )
        + "[[rule]]\nname = \"surge\"\nproto = \"udp\"\ndst_ports = [6000]\nrate = 1\nburst = 5\n";
    let cfg = write(&dir, "rl.toml", &rules);
    let daemon = Daemon::serving(&lab, &cfg, &[]).unwrap();
    let mut seed = 0x005e_ed0f_u32;
    let list: Vec<[u8; 4]> = (0..1000).map(|_| spoofed_source(&mut seed)).collect();
    let frame = eth(&[], ETH_P_IP, &ipv4([0; 4], UDP, &[], &udp(6000)));
    join(forged(&lab.a, VA, frame, 1000, 2000, None, move |i| {
        list[i as usize]
    }))
    .unwrap();

    assert!(
        wait_events(&lab, "wide_cells_made", 1, 4),
        "no wide_cells_made event after a flood over 1,000 /24s"
    );
    assert_eq!(wide_events(&lab, "wide_cells_made"), ["surge"]);
    let p = get(&lab.b, "/v1/status").json()["pressure"].clone();
    let rules = p["wide_cell_rules"].as_array().unwrap().clone();
    assert!(
        rules.len() == 1 && rules[0]["rule"] == "surge" && rules[0]["ipv4"].as_u64().unwrap() >= 1,
        "{p}"
    );
    let m = parse_prometheus(&get(&lab.b, "/metrics").body);
    assert!(
        m.get("rl_rule_wide_cells{rule=\"surge\",family=\"ipv4\"}")
            .is_some_and(|&n| n >= 1.0),
        "/metrics names the rule"
    );
    assert!(
        alerts::check(&m, &["daemon", "datapath", "l7"]).contains(&"RlWideCells".to_string()),
        "RlWideCells holds"
    );
    let (_, out) = run_once(Some(&lab.b), &["status"]).unwrap();
    assert!(
        out.lines()
            .any(|l| l.starts_with("wide cells of:   surge (IPv4 ")),
        "{out}"
    );

    // Refilled 5 s after their making, collected a second or two later.
    assert!(
        wait_events(&lab, "wide_cells_gone", 1, 15),
        "no wide_cells_gone event once surge's wide cells were fresh"
    );
    assert_eq!(wide_events(&lab, "wide_cells_gone"), ["surge"]);
    let p = get(&lab.b, "/v1/status").json()["pressure"].clone();
    assert_eq!(
        (p["wide_cell_rules"].clone(), p["wide_cells_ipv4"].as_u64()),
        (serde_json::json!([]), Some(0)),
        "{p}"
    );
    let m = parse_prometheus(&get(&lab.b, "/metrics").body);
    assert!(
        !m.keys().any(|k| k.starts_with("rl_rule_wide_cells")),
        "no rule has wide cells"
    );
    assert!(
        !alerts::check(&m, &["daemon", "datapath", "l7"]).contains(&"RlWideCells".to_string()),
        "RlWideCells clears"
    );
    let (_, out) = run_once(Some(&lab.b), &["status"]).unwrap();
    assert!(!out.contains("wide cells of:"), "{out}");
    let (status, log) = daemon.stop(libc::SIGTERM).unwrap();
    assert!(status.success(), "{log}");
    assert!(
        log.contains("rule surge's flood holds a quarter")
            && log.contains("rule surge's last wide cell was freed"),
        "the log names the rule:\n{log}"
    );
}

/// Waits up to `secs` for `n` events of `kind`.
fn wait_events(lab: &Lab, kind: &str, n: usize, secs: u64) -> bool {
    let deadline = Instant::now() + Duration::from_secs(secs);
    while events(lab, kind) < n && Instant::now() < deadline {
        std::thread::sleep(Duration::from_millis(200));
    }
    events(lab, kind) >= n
}

#[test]
fn a_full_sources_table_and_full_prefix_cells_are_reported_and_so_is_their_room_again() {
    let lab = Lab::new().unwrap();
    let dir = tempfile::tempdir().unwrap();
    // No flood mode: only the table's size stops inserts, and the 136
    // sources it refuses go to their /24s' cells, of which there is room
    // for 16 (no wide cells: a wide cell of this rule starts drained, and
    // would be fresh only 21 s later; the first test sees them made). The
    // flood's buckets and cells are fresh eight seconds after their packet,
    // collectable a second later: after the pass that finds the table and
    // the cells full, and the reads of them below (see the race below).
    let cfg = write(
        &dir,
        "rl.toml",
        "[datapath]\nmax_sources = 64\nflood_new_keys_per_sec = 1000000000\nflood_prefixes = 16\nflood_wide_cells = false\n[default]\nrate = 1000\n\
         [[rule]]\nname = \"flood\"\nproto = \"udp\"\ndst_ports = [5000]\nrate = 2\nper = \"16s\"\nburst = 10\n",
    );
    let pins = rl_tests::lab::BpfFs::new().unwrap();
    let daemon = Daemon::pinned(&lab, &cfg, &pins, &[]).unwrap();
    let mut seed = 0x1234_5678u32;
    let list: Vec<[u8; 4]> = (0..200).map(|_| spoofed_source(&mut seed)).collect();
    let frame = eth(&[], ETH_P_IP, &ipv4([0; 4], UDP, &[], &udp(5000)));
    join(forged(
        &lab.a,
        VA,
        frame.clone(),
        200,
        1000,
        None,
        move |i| list[i as usize],
    ))
    .unwrap();

    assert!(
        wait_events(&lab, "table_full", 1, 5),
        "no table_full event after 136 sources beyond max_sources"
    );
    // A walk that sweeps while the flood inserts may find a bucket just
    // made (a copy of its fresh cell, not yet charged) fresh and delete it:
    // that packet goes to its cell, and the table holds 63 until the next
    // walk sets the program's count right (CI saw 63 and 54 of 64). Eight
    // more sources after that walk fill such a slot, and their refusals
    // keep the episode going (without the race all eight are refused).
    std::thread::sleep(Duration::from_millis(1500));
    let mut seed = 0x0bad_cafe_u32;
    let more: Vec<[u8; 4]> = (0..8).map(|_| spoofed_source(&mut seed)).collect();
    join(forged(&lab.a, VA, frame, 8, 1000, None, move |i| {
        more[i as usize]
    }))
    .unwrap();
    // The next pass, within a second, counts them all (the buckets stay
    // for 9 s).
    let deadline = std::time::Instant::now() + Duration::from_millis(2500);
    let p = loop {
        let p = get(&lab.b, "/v1/status").json()["pressure"].clone();
        if p["buckets_ipv4"].as_u64() == Some(64) || std::time::Instant::now() > deadline {
            break p;
        }
        std::thread::sleep(Duration::from_millis(100));
    };
    // One insert refused per CPU and window: the rest go to their cells.
    assert!(
        p["table_full"] == true && p["table_full_refusals"].as_u64().unwrap() >= 1,
        "{p}"
    );
    assert!(
        p["fallback_packets"].as_u64().unwrap() >= 100 && p["buckets_ipv4"].as_u64() == Some(64),
        "{p}"
    );
    let m = parse_prometheus(&get(&lab.b, "/metrics").body);
    assert_eq!(m["rl_table_full"], 1.0);
    assert!(
        alerts::check(&m, &["daemon", "datapath", "l7"])
            .contains(&"RlSourcesTableFull".to_string()),
        "the table full"
    );
    let (_, out) = run_once(Some(&lab.b), &["status"]).unwrap();
    assert!(
        out.contains("sources table:   FULL at 64 own buckets"),
        "{out}"
    );
    assert!(
        wait_events(&lab, "cells_full", 1, 5),
        "no cells_full event after 136 newcomers over 16 cells' room"
    );
    let m = parse_prometheus(&get(&lab.b, "/metrics").body);
    assert_eq!(m["rl_cells_full"], 1.0);
    let firing = alerts::check(&m, &["daemon", "datapath", "l7"]);
    assert!(
        firing.contains(&"RlPrefixCellsFull".to_string()),
        "the cells full: {firing:?}"
    );
    assert!(
        firing.contains(&"RlTableNearlyFull".to_string()),
        "the cells full: {firing:?}"
    );
    let (_, out) = run_once(Some(&lab.b), &["status"]).unwrap();
    assert!(out.contains("prefix cells:    FULL at 16"), "{out}");

    // Collected once idle, and no refusal for two seconds: room again. The
    // cells, fresh as soon, are freed by the same walks.
    assert!(
        wait_events(&lab, "table_room", 1, 20),
        "no table_room event once the buckets were collected"
    );
    assert!(
        wait_events(&lab, "cells_room", 1, 5),
        "no cells_room event once the cells were freed"
    );
    let m = parse_prometheus(&get(&lab.b, "/metrics").body);
    assert_eq!((m["rl_table_full"], m["rl_cells_full"]), (0.0, 0.0));
    let firing = alerts::check(&m, &["daemon", "datapath", "l7"]);
    assert!(
        !firing
            .iter()
            .any(|a| a == "RlSourcesTableFull" || a == "RlPrefixCellsFull"),
        "room again: {firing:?}"
    );
    assert!(m["rl_table_occupancy_ratio{table=\"cells\",family=\"ipv4\"}"] < 15.0 / 16.0);
    let (_, out) = run_once(Some(&lab.b), &["status"]).unwrap();
    assert!(
        !out.contains("sources table:") && !out.contains("prefix cells:    FULL"),
        "{out}"
    );
    assert_eq!(events(&lab, "table_full"), 1, "one episode, one event");
    assert_eq!(
        events(&lab, "cells_full"),
        1,
        "one episode of full cells, one event"
    );
    let (status, log) = daemon.stop(libc::SIGTERM).unwrap();
    assert!(status.success(), "{log}");
    assert!(
        log.contains("the sources' table is full") && log.contains("has room again"),
        "the log says both:\n{log}"
    );
    assert!(
        log.contains("the prefix cells are full") && log.contains("cells have room again"),
        "the log says both:\n{log}"
    );

    // A restart adopts the pinned counters, refusals and all: a baseline,
    // not a new episode.
    let daemon = Daemon::pinned(&lab, &cfg, &pins, &[]).unwrap();
    std::thread::sleep(Duration::from_millis(3500));
    let episodes =
        ["table_full", "table_room", "cells_full", "cells_room"].map(|e| events(&lab, e));
    assert_eq!(episodes, [0; 4], "no episode after a restart");
    let (status, log) = daemon.stop(libc::SIGTERM).unwrap();
    assert!(
        status.success() && !log.contains("the sources' table is full"),
        "{log}"
    );
}
