//! A packet rule with `scope = "cluster"` across three hosts: each host is a
//! lab with its own veth, XDP and `rl-control`, all three reach one real
//! Redis through a bridge in the test's own namespace. Forged frames from
//! one source flood all three at once, then move from host to host, then
//! stay under the limit together; the passes are checked against the
//! documented bound `R·τ + N·B + (N−1)·R·(T+δ) + N·θ` (cluster/packets.rs)
//! and against what three unsynchronised hosts would pass.

use std::time::Duration;

use rl_tests::{
    cluster_lab::{ClusterLab, BURST, RATE},
    http::{get, parse_prometheus},
    traffic::join,
};

/// What each host enforces while Redis is away.
const ON_FAILURE: [&str; 3] = ["local", "open", "closed"];
const HOSTS: usize = ON_FAILURE.len();

#[test]
fn three_hosts_hold_one_source_to_one_limit_within_the_documented_bound() {
    let mut c = ClusterLab::new(150 + std::process::id() % 50, &ON_FAILURE).unwrap();
    for d in &c.daemons {
        assert!(
            d.log()
                .contains("joined the cluster: 1 cluster rules shared"),
            "{}",
            d.log()
        );
    }

    // 1. One source floods all three hosts at once: 1,000 pps each for 3 s.
    let secs = 3.0;
    let (p, took) = c.flood_all(3000, 1000).unwrap();
    let alone = HOSTS as f64 * (RATE as f64 * took + BURST as f64);
    let bound = c.bound(took);
    eprintln!("flood on all hosts for {took:.2} s: {p} passed; bound {bound:.0}; three unsynchronised hosts would pass about {alone:.0}");
    assert!(
        (p as f64) <= bound,
        "{p} passed in {took:.2} s, over the documented bound {bound:.0}"
    );
    assert!(
        (p as f64) >= RATE as f64 * secs * 0.8,
        "{p} passed: the cluster starves the source below its limit"
    );
    assert_eq!(
        c.redis.cli(&["KEYS", "rl:p:*"]).unwrap().lines().count(),
        1,
        "one flooding source, one cluster bucket in Redis"
    );
    let m = parse_prometheus(&get(&c.labs[0].b, "/metrics").body);
    assert!(
        m["rl_cluster_raised_buckets_total"] > 0.0,
        "host 0 was charged other hosts' packets: {m:?}"
    );
    // Every shipped alert reads series a cluster daemon exports, and none holds.
    let firing = rl_tests::alerts::check(&m, &["daemon", "datapath", "l7", "cluster"]);
    assert!(firing.is_empty(), "a healthy cluster: {firing:?}");
    // Again once the buckets went idle and were collected (the kernel's
    // counts start over; the reports must not). Under 1% full, the
    // collector walks every 5 s.
    std::thread::sleep(Duration::from_millis(6500));
    let (p, took) = c.flood_all(1000, 1000).unwrap();
    let bound = c.bound(took);
    eprintln!("again after 6.5 s idle, 1 s: {p} passed; bound {bound:.0}");
    assert!(
        (p as f64) <= bound,
        "{p} passed in {took:.2} s after the buckets were collected, over the bound {bound:.0}"
    );

    // 2. The demand moves: host 0 alone for 1 s, then host 1 alone, then
    // host 2 alone. Each new host starts without history; it converges
    // within one sync interval and a round trip.
    std::thread::sleep(Duration::from_secs(1));
    let before = c.total();
    let mut took = 0.0;
    for i in 0..HOSTS {
        let b = c.passed(i);
        took += join(c.flood(i, 1000, 1000)).unwrap().seconds();
        std::thread::sleep(Duration::from_millis(150));
        let here = c.passed(i) - b;
        eprintln!("moved: {here} passed on host {i}");
        // Not starved by the others' earlier usage: about B + R·1 s.
        assert!(
            here as f64 >= RATE as f64 * 0.8,
            "{here} passed on host {i} flooding alone for 1 s"
        );
    }
    std::thread::sleep(Duration::from_millis(300));
    let moved = c.total() - before;
    // The second since phase 1 refilled the bucket: its span is counted.
    let bound = c.bound(took + 1.0);
    eprintln!("moving flood over {took:.2} s: {moved} passed; bound {bound:.0}");
    assert!(
        (moved as f64) <= bound,
        "{moved} passed while the flood moved, over the bound {bound:.0}"
    );

    // 3. Aggregate demand under the limit is never dropped: 3 × 50 pps = 150
    // of 200 per second, for 2 s, after the debt has cleared.
    std::thread::sleep(Duration::from_secs(2));
    let drops_before: u64 = (0..HOSTS).map(|i| c.dropped(i)).sum();
    let (p, _) = c.flood_all(100, 50).unwrap();
    let drops: u64 = (0..HOSTS).map(|i| c.dropped(i)).sum::<u64>() - drops_before;
    assert_eq!(
        (drops, p),
        (0, 300),
        "demand under the cluster limit was dropped"
    );
    let st = get(&c.labs[0].b, "/v1/status").json();
    assert_eq!(st["cluster"]["state"], "ok", "{st}");

    // 4. Redis hangs: every host notices within the timeout and a sync
    // interval, says degraded, and enforces its on_failure: host 0 (local)
    // its own limit in XDP, host 1 (open) passes everything, host 2
    // (closed) drops everything. Redis back: the limits as written again.
    std::thread::sleep(Duration::from_secs(1));
    c.redis.signal(libc::SIGSTOP);
    let t = std::time::Instant::now();
    for lab in &c.labs {
        while get(&lab.b, "/v1/status").json()["cluster"]["state"] != "degraded" {
            assert!(
                t.elapsed() < Duration::from_millis(300 + 200 + 500),
                "{} not degraded {:?} after SIGSTOP",
                lab.b.name,
                t.elapsed()
            );
            std::thread::sleep(Duration::from_millis(20));
        }
    }
    eprintln!(
        "degraded on every host {:?} after SIGSTOP (timeout 300 ms)",
        t.elapsed()
    );
    std::thread::sleep(Duration::from_millis(200));
    let before: Vec<u64> = (0..HOSTS).map(|i| c.passed(i)).collect();
    let (_, took) = c.flood_all(1000, 1000).unwrap();
    let got: Vec<u64> = (0..HOSTS).map(|i| c.passed(i) - before[i]).collect();
    eprintln!("Redis hung, 1,000 frames per host: passed {got:?} (local, open, closed)");
    let local = RATE as f64 * took + BURST as f64;
    assert!(
        (got[0] as f64) <= local * 1.1 + 5.0 && (got[0] as f64) >= local * 0.8,
        "local: {} passed, its own limit allows {local:.0}",
        got[0]
    );
    assert_eq!(got[1], 1000, "open passes everything");
    assert_eq!(got[2], 0, "closed drops everything");
    c.redis.signal(libc::SIGCONT);
    let deadline = std::time::Instant::now() + Duration::from_secs(3);
    for lab in &c.labs {
        while get(&lab.b, "/v1/status").json()["cluster"]["state"] != "ok" {
            assert!(
                std::time::Instant::now() < deadline,
                "{} did not recover within 3 s of SIGCONT",
                lab.b.name
            );
            std::thread::sleep(Duration::from_millis(50));
        }
    }
    // What the outage left is charged capped (2·R·T + B per host): gone
    // after a second.
    std::thread::sleep(Duration::from_secs(1));
    for i in 1..HOSTS {
        let b = c.passed(i);
        join(c.flood(i, 100, 1000)).unwrap();
        std::thread::sleep(Duration::from_millis(100));
        let p = c.passed(i) - b;
        assert!(
            p < 100 && p > 0,
            "host {i}: {p} of 100 passed: the limit as written is back"
        );
    }
    for (i, d) in std::mem::take(&mut c.daemons).into_iter().enumerate() {
        let (status, log) = d.stop(libc::SIGTERM).unwrap();
        assert!(status.success(), "host {i}: {log}");
    }
}

/// `sync.lua`'s ledger on a real Redis: how much of a report it charges to
/// a bucket, read from the bucket's `t` (µs, 1,000 µs a packet; far ahead
/// of now, so the backdating never applies).
#[test]
fn the_ledger_charges_each_packet_once_and_never_more_than_its_host_has_unacknowledged() {
    let hub = rl_tests::redis::Hub::new(250 + std::process::id() % 5).unwrap();
    let redis = rl_tests::redis::Redis::start(&hub, 6390).unwrap();
    const SYNC: &str = include_str!("../../rl-control/src/cluster/sync.lua");
    const K: &str = "rl:p:{r:0:0:0}:0a000001";
    let t = || -> f64 {
        redis
            .cli(&["HGET", K, "t"])
            .unwrap()
            .trim()
            .parse()
            .unwrap()
    };
    let report = |me: &str, cum: u64, delta: u64| -> f64 {
        let before = redis
            .cli(&["HGET", K, "t"])
            .unwrap()
            .trim()
            .parse::<f64>()
            .unwrap_or(0.0);
        let (cum, delta) = (cum.to_string(), delta.to_string());
        redis
            .cli(&[
                "EVAL", SYNC, "1", K, me, "1000", "100000", "600000", &cum, &delta,
            ])
            .unwrap();
        (t() - before) / 1000.0
    };
    // Far ahead of Redis' clock: 100,000 packets.
    report("a", 100_000, 100_000);
    assert_eq!(report("a", 102_000, 2_000), 2_000.0, "new packets charged");
    assert_eq!(
        report("a", 102_000, 2_000),
        0.0,
        "a report applied twice is charged once"
    );
    assert_eq!(
        report("a", 102_500, 2_500),
        500.0,
        "a retry of a timed-out report: only what is new"
    );
    // The host forgot the bucket (idle past its forget time) while another
    // host kept the hash alive: it counts on from all it reported this run
    // (the daemon's base), above its old count, and its delta is charged.
    report("b", 10, 10);
    assert_eq!(
        report("a", 150_000, 300),
        300.0,
        "a bucket tracked anew: its delta, never the gap to the ledger"
    );
    assert_eq!(
        report("a", 150_100, 100),
        100.0,
        "and from there on as before"
    );
    assert_eq!(
        report("a", 149_000, 50),
        0.0,
        "a stale report (applied after a newer one) is charged nothing"
    );
    assert_eq!(
        report("a", 150_200, 100),
        100.0,
        "and leaves the ledger where it was"
    );
    // Redis back from an older snapshot: its ledger is behind the host's
    // acknowledged count. Only the packets not acknowledged are charged.
    redis.cli(&["HSET", K, "c:a", "100"]).unwrap();
    assert_eq!(
        report("a", 150_300, 100),
        100.0,
        "a stale ledger charges what was acknowledged again"
    );
    // 70 daemon runs quiet for the keep-alive (restarted hosts): dropped
    // once the hash holds more than 64 runs; the live ones stay.
    for i in 0..70 {
        redis
            .cli(&[
                "HSET",
                K,
                &format!("c:old{i}"),
                "5",
                &format!("a:old{i}"),
                "0",
            ])
            .unwrap();
    }
    report("a", 150_400, 100);
    let fields = redis.cli(&["HKEYS", K]).unwrap();
    let mut fields: Vec<&str> = fields.lines().collect();
    fields.sort();
    assert_eq!(
        fields,
        ["a:a", "a:b", "c:a", "c:b", "t"],
        "the quiet runs dropped, the live ones kept"
    );

    // A slow rule (1 packet/s here) whose bucket is ahead of now for far
    // longer than keep-alive (10 s): the key lives while it carries the
    // charges, then keep-alive more. (It expired after keep-alive: every
    // host then passed its full rate again.)
    const SLOW: &str = "rl:p:{r:0:0:1}:0a000001";
    redis
        .cli(&[
            "EVAL", SYNC, "1", SLOW, "a", "1000000", "100000", "10000", "100", "100",
        ])
        .unwrap();
    let ahead_ms = (redis
        .cli(&["HGET", SLOW, "t"])
        .unwrap()
        .trim()
        .parse::<f64>()
        .unwrap()
        / 1000.0) as i64
        - redis_now_ms(&redis);
    let ttl: i64 = redis.cli(&["PTTL", SLOW]).unwrap().trim().parse().unwrap();
    assert!(ahead_ms > 90_000, "{ahead_ms} ms ahead");
    assert!(
        ttl >= ahead_ms + 9_000,
        "the key expires in {ttl} ms while its bucket is {ahead_ms} ms ahead"
    );
}

/// `decide.lua` on a real Redis whose clock is behind the window a bucket
/// was opened in (a failover to a replica with a slower clock): the window
/// is charged as it stands, not opened a second time with a fresh count.
#[test]
fn a_window_opened_on_a_clock_ahead_is_never_opened_again() {
    let hub = rl_tests::redis::Hub::new(245 + std::process::id() % 5).unwrap();
    let redis = rl_tests::redis::Redis::start(&hub, 6391).unwrap();
    const DECIDE: &str = include_str!("../../rl-control/src/cluster/decide.lua");
    let per_us: i64 = 60_000_000;
    for algo in ["fixed", "sliding"] {
        let k = format!("rl:l7:{{w:{algo}}}");
        let next = redis_now_ms(&redis) * 1000 / per_us + 1;
        // The next window, full (5 of 5), opened on a clock a minute ahead.
        redis
            .cli(&["HSET", &k, "w0", &next.to_string(), "c0", "5", "p0", "0"])
            .unwrap();
        let out = redis
            .cli(&[
                "EVAL",
                DECIDE,
                "1",
                &k,
                algo,
                "1",
                "1",
                "0",
                "5",
                &per_us.to_string(),
                "0",
            ])
            .unwrap();
        assert_eq!(
            out.lines().next().map(str::trim),
            Some("0"),
            "{algo}: a full window was opened again: {out}"
        );
        assert_eq!(
            redis.cli(&["HGET", &k, "w0"]).unwrap().trim(),
            next.to_string(),
            "{algo}: the window went back"
        );
    }
    // A sliding window's previous count weighs in full at a time before
    // the window (as rl-common weighs it), not by where that time falls in
    // its own window: 5 of 5 in the previous window leave no room.
    let k = "rl:l7:{w:prev}";
    let next = redis_now_ms(&redis) * 1000 / per_us + 1;
    redis
        .cli(&["HSET", k, "w0", &next.to_string(), "c0", "0", "p0", "5"])
        .unwrap();
    let per = per_us.to_string();
    let out = redis
        .cli(&[
            "EVAL", DECIDE, "1", k, "sliding", "1", "1", "0", "5", &per, "0",
        ])
        .unwrap();
    let lines: Vec<&str> = out.lines().map(str::trim).collect();
    assert_eq!(
        lines[0], "0",
        "the previous count weighed less than in full: {out}"
    );
    assert_ne!(lines[4], "0", "refused, yet told to retry at once: {out}");
}

/// `decide.lua` on a real Redis: a charge whose deadline has passed (its
/// caller gave up) changes nothing and says so; a refund past it, or a
/// charge with time left, is applied; a check or a refund for a key
/// without state writes nothing.
#[test]
fn a_charge_past_its_deadline_is_not_applied() {
    let hub = rl_tests::redis::Hub::new(245 + std::process::id() % 5).unwrap();
    let redis = rl_tests::redis::Redis::start(&hub, 6391).unwrap();
    const DECIDE: &str = include_str!("../../rl-control/src/cluster/decide.lua");
    let decide = |k: &str, algo: &str, hits: i64, deadline_us: i64| {
        let limit = if algo == "sem" {
            ["3", "60000000", "0"]
        } else {
            ["3", "3600000000", "3"]
        };
        let mut args = vec!["EVAL", DECIDE];
        let z = format!("{k}:z0");
        let (hits, deadline) = (hits.to_string(), deadline_us.to_string());
        args.extend(["2", k, &z, algo, &hits, "1", &deadline]);
        args.extend(limit);
        redis.cli(&args).unwrap()
    };
    // How many of a bucket's keys (its hash, its sorted set) exist.
    let held = |k: &str| {
        redis
            .cli(&["EXISTS", k, &format!("{k}:z0")])
            .unwrap()
            .trim()
            .to_string()
    };
    for algo in ["gcra", "fixed", "sliding", "log", "sem"] {
        // A check or a refund for a key without state reads a fresh bucket
        // and writes nothing: checks of random values do not grow Redis.
        let k = format!("rl:l7:{{check:{algo}}}");
        for hits in [0, -1] {
            let out = decide(&k, algo, hits, 0);
            assert_eq!(
                out.lines().next().map(str::trim),
                Some("1"),
                "{algo}: {out}"
            );
            assert_eq!(held(&k), "0", "{algo}: {hits} hits made a key");
        }
        let k = format!("rl:l7:{{late:{algo}}}");
        let now_us = redis_now_ms(&redis) * 1000;
        let out = decide(&k, algo, 1, now_us - 5_000);
        assert!(
            out.contains("LATE") && out.contains("after its caller gave up"),
            "{algo}: {out}"
        );
        assert_eq!(held(&k), "0", "{algo}: a late charge was applied");
        let out = decide(&k, algo, 1, now_us + 10_000_000);
        assert_eq!(
            out.lines().map(str::trim).collect::<Vec<_>>()[..3],
            ["1", "0", "2"],
            "{algo}: in time: {out}"
        );
        let out = decide(&k, algo, -1, now_us - 5_000);
        assert_eq!(
            out.lines().map(str::trim).collect::<Vec<_>>()[..3],
            ["1", "0", "3"],
            "{algo}: a late refund is applied: {out}"
        );
        // The largest refund the daemon sends (hits clamped to
        // MAX_LUA_HITS: Lua prints larger counts in exponent form, which
        // ZPOPMIN refuses, and a script error degrades the cluster).
        let most = rl_control::cluster::requests::MAX_LUA_HITS;
        let out = decide(&k, algo, -most, 0);
        assert!(
            out.lines().next().map(str::trim) == Some("1"),
            "{algo}: a refund of {most}: {out}"
        );
    }
}

/// Redis' clock (ms).
fn redis_now_ms(redis: &rl_tests::redis::Redis) -> i64 {
    let t = redis.cli(&["TIME"]).unwrap();
    let mut f = t.lines().map(|l| l.trim().parse::<i64>().unwrap());
    let (s, us) = (f.next().unwrap(), f.next().unwrap());
    s * 1000 + us / 1000
}

/// `register.lua` on a real Redis: a registration is alive for its own
/// host's ttl (hosts with another `sync_interval` have another), so a host
/// with a short one cannot take a slower host's entry for stale, register
/// another definition and stop the rule being shared everywhere.
#[test]
fn a_host_with_a_shorter_ttl_cannot_push_a_live_definition_out() {
    let hub = rl_tests::redis::Hub::new(245 + std::process::id() % 5).unwrap();
    let redis = rl_tests::redis::Redis::start(&hub, 6391).unwrap();
    const REGISTER: &str = include_str!("../../rl-control/src/cluster/register.lua");
    const K: &str = "rl:def:{packet:r}";
    const T: &str = "rl:def:{packet:r}:ttl";
    let register = |node: &str, def: &str, ttl_ms: u64| {
        redis
            .cli(&["EVAL", REGISTER, "2", K, T, node, def, &ttl_ms.to_string()])
            .unwrap()
    };
    let time = redis.cli(&["TIME"]).unwrap();
    let mut parts = time.lines().map(|l| l.trim().parse::<u64>().unwrap());
    let now_ms = parts.next().unwrap() * 1000 + parts.next().unwrap() / 1000;
    // a1 renews every 8 s or so (ttl 30 s); its entry is 5 s old.
    redis
        .cli(&["HSET", K, "a1", &format!("00aa:{}", now_ms - 5000)])
        .unwrap();
    redis.cli(&["HSET", T, "a1", "30000"]).unwrap();
    redis.cli(&["PEXPIRE", K, "30000"]).unwrap();
    assert_eq!(
        register("b", "00bb", 3000).trim(),
        "a1",
        "b (ttl 3 s, another definition) must be refused"
    );
    assert!(
        redis.cli(&["HGET", K, "a1"]).unwrap().starts_with("00aa:"),
        "a1's entry stays"
    );
    // Same definition, shorter ttl: registered, and a1's entry keeps its life.
    assert_eq!(
        register("c", "00aa", 3000).trim(),
        "",
        "c defines the rule as a1 does"
    );
    let pttl: u64 = redis.cli(&["PTTL", K]).unwrap().trim().parse().unwrap();
    assert!(
        pttl > 20_000,
        "c's short ttl cut the hash's life to {pttl} ms"
    );
    // An entry past its own ttl is stale, whoever looks.
    redis
        .cli(&["HSET", K, "a2", &format!("00dd:{}", now_ms - 5000)])
        .unwrap();
    redis.cli(&["HSET", T, "a2", "2000"]).unwrap();
    assert_eq!(
        register("d", "00aa", 30000).trim(),
        "",
        "a2 is 5 s past a 2 s ttl: gone"
    );
    assert_eq!(redis.cli(&["HEXISTS", K, "a2"]).unwrap().trim(), "0");
    assert_eq!(redis.cli(&["HEXISTS", T, "a2"]).unwrap().trim(), "0");
    // An entry of an older rl (no ttl of its own) is judged by the caller's.
    redis
        .cli(&["HSET", K, "old", &format!("00ee:{}", now_ms - 5000)])
        .unwrap();
    assert_eq!(
        register("e", "00aa", 3000).trim(),
        "",
        "old is 5 s past e's 3 s: gone"
    );
}
