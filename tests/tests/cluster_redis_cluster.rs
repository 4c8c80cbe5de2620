//! Cluster rules on a real 3-master Redis Cluster (3 replicas, loopback-free:
//! in the test's hub namespace behind a bridge), two daemons: keys spread
//! over the masters (each decision's keys in one slot, redirections handled
//! by the client) share exact limits; a master killed during traffic is
//! replaced by its replica, every check is answered meanwhile, and the
//! limits are exact again afterwards with the failed master's buckets kept.

use std::{
    sync::atomic::{AtomicBool, AtomicU64, Ordering},
    time::{Duration, Instant},
};

use rl_tests::{
    daemon::{write, Daemon},
    frames::{eth, ipv4, udp, ETH_P_IP, UDP},
    http::{get, request_tcp},
    lab::{Lab, VA},
    redis::{Hub, RedisCluster},
    traffic::{forged, join},
};
use serde_json::json;

const CHECK: &str = "127.0.0.1:8082";
const LIMIT: u64 = 6;
const MASTERS: usize = 3;

fn config(seeds: &[String], node: &str) -> String {
    let redis: Vec<String> = seeds.iter().map(|s| format!("\"{s}\"")).collect();
    format!(
        "[default]\nrate = 1000\n\
         [cluster]\nredis = [{}]\nnode = \"{node}\"\nsync_interval = \"100ms\"\ntimeout = \"300ms\"\non_failure = \"closed\"\n\
         [l7]\nhttp_listen = \"{CHECK}\"\n\
         [[l7.rule]]\nname = \"tb\"\ndomain = \"d\"\ndescriptor = [{{ key = \"user\" }}]\nrate = 1\nper = \"1h\"\nburst = {LIMIT}\nscope = \"cluster\"\n\
         [[l7.rule]]\nname = \"log\"\ndomain = \"d\"\ndescriptor = [{{ key = \"ip\" }}]\nrate = {LIMIT}\nper = \"1m\"\nalgorithm = \"sliding_log\"\nscope = \"cluster\"\n\
         [[rule]]\nname = \"udp\"\nproto = \"udp\"\ndst_ports = [9000]\nrate = 200\nburst = 20\nscope = \"cluster\"\n",
        redis.join(", ")
    )
}

fn check(lab: &Lab, key: &str, value: &str) -> u16 {
    let body = json!({"domain": "d", "descriptors": [[{"key": key, "value": value}]]});
    request_tcp(
        &lab.b,
        CHECK,
        "POST",
        "/v1/check",
        Some(("application/json", serde_json::to_vec(&body).unwrap())),
        None,
    )
    .map_or(0, |a| a.status)
}

/// Alternating checks on both hosts: which of `2 × LIMIT` passed.
fn alternating(labs: &[&Lab; 2], key: &str, value: &str) -> Vec<u64> {
    (0..2 * LIMIT)
        .filter(|&i| check(labs[(i % 2) as usize], key, value) == 200)
        .collect()
}

fn state(lab: &Lab) -> serde_json::Value {
    get(&lab.b, "/v1/status").json()["cluster"]["state"].clone()
}

#[test]
fn a_redis_cluster_shares_limits_and_survives_a_master_failover_during_traffic() {
    let mut hub = Hub::new(100 + std::process::id() % 50).unwrap();
    let (l1, l2) = (Lab::new().unwrap(), Lab::new().unwrap());
    hub.join_lab(&l1).unwrap();
    hub.join_lab(&l2).unwrap();
    let mut cluster = RedisCluster::start(&hub, 7000, MASTERS, 1).unwrap();
    let seeds = cluster.seeds(MASTERS);
    let dir = tempfile::tempdir().unwrap();
    let d1 = Daemon::serving(&l1, &write(&dir, "h1.toml", &config(&seeds, "host-1")), &[]).unwrap();
    let d2 = Daemon::serving(&l2, &write(&dir, "h2.toml", &config(&seeds, "host-2")), &[]).unwrap();
    assert!(
        d1.log()
            .contains("joined the cluster: 3 cluster rules shared"),
        "{}",
        d1.log()
    );
    let labs = [&l1, &l2];

    // A packet rule over the Redis Cluster: 64 forged sources (spread over
    // the slots) flood both hosts at once; each source is held to one limit
    // within the bound R·τ + N·B + (N−1)·R·(T+δ) + N·θ.
    let frame = eth(
        &[],
        ETH_P_IP,
        &ipv4([198, 51, 100, 0], UDP, &[], &udp(9000)),
    );
    let src = |i: u64| [198, 51, 100, (i % 64) as u8];
    let floods: Vec<_> = labs
        .iter()
        .map(|lab| forged(&lab.a, VA, frame.clone(), 64 * 1000, 32_000, None, src))
        .collect();
    let took = floods
        .into_iter()
        .map(|h| join(h).unwrap().seconds())
        .fold(0.0, f64::max);
    std::thread::sleep(Duration::from_millis(300));
    let passed: u64 = labs
        .iter()
        .map(|lab| {
            get(&lab.b, "/v1/stats").json()["rules"]["udp"]["passed_packets"]
                .as_u64()
                .unwrap()
        })
        .sum();
    let per_source = passed as f64 / 64.0;
    let bound = 200.0 * took + 2.0 * 20.0 + 200.0 * 0.11 + 2.0 * 5.0;
    eprintln!("packet rule over the Redis Cluster: {per_source:.0} passed per source in {took:.2} s; bound {bound:.0}; each host alone {:.0}", 2.0 * (200.0 * took + 20.0));
    assert!(
        per_source <= bound,
        "{per_source:.0} passed per source, over the bound {bound:.0}"
    );
    assert!(
        per_source >= 200.0 * took * 0.8,
        "{per_source:.0} passed per source: starved"
    );
    let slots: std::collections::HashSet<usize> = (0..cluster.nodes.len())
        .filter(|&n| {
            let node = &cluster.nodes[n];
            node.cli(&["ROLE"]).is_ok_and(|r| r.starts_with("master"))
                && node
                    .cli(&["KEYS", "rl:p:*"])
                    .is_ok_and(|k| !k.trim().is_empty())
        })
        .collect();
    assert!(
        slots.len() > 1,
        "the packet buckets spread over the masters: {slots:?}"
    );

    // Keys over every master, exact for both algorithms.
    for i in 0..8 {
        for rule in ["user", "ip"] {
            let v = format!("v{i}");
            assert_eq!(
                alternating(&labs, rule, &v),
                (0..LIMIT).collect::<Vec<_>>(),
                "{rule}={v}"
            );
        }
    }
    let holders: Vec<usize> = (0..cluster.nodes.len())
        .filter(|&n| {
            let node = &cluster.nodes[n];
            node.cli(&["ROLE"]).is_ok_and(|r| r.starts_with("master"))
                && node
                    .cli(&["KEYS", "rl:l7:*"])
                    .is_ok_and(|k| !k.trim().is_empty())
        })
        .collect();
    assert_eq!(
        holders.len(),
        MASTERS,
        "the buckets spread over all {MASTERS} masters: {holders:?}"
    );

    // Traffic on both hosts while a master dies.
    let stop = AtomicBool::new(false);
    let (unanswered, answered) = (AtomicU64::new(0), AtomicU64::new(0));
    let mut victim = usize::MAX;
    let mut recovered = Duration::ZERO;
    std::thread::scope(|scope| {
        for lab in labs {
            let (stop, unanswered, answered) = (&stop, &unanswered, &answered);
            scope.spawn(move || {
                let mut i = 0u64;
                while !stop.load(Ordering::Relaxed) {
                    match check(lab, "user", &format!("t{}", i % 50)) {
                        200 | 429 => answered.fetch_add(1, Ordering::Relaxed),
                        _ => unanswered.fetch_add(1, Ordering::Relaxed),
                    };
                    i += 1;
                    std::thread::sleep(Duration::from_millis(5));
                }
            });
        }
        std::thread::sleep(Duration::from_millis(500));
        // The master holding the token-bucket rule's buckets.
        victim = cluster
            .master_holding("rl:l7:{tb:*")
            .expect("a master holds the tb buckets");
        let t = Instant::now();
        cluster.nodes[victim].kill();
        let settled = cluster.wait_failover(victim, Duration::from_secs(20));
        let deadline = Instant::now() + Duration::from_secs(20);
        while settled.is_ok()
            && (state(&l1) != "ok" || state(&l2) != "ok")
            && Instant::now() < deadline
        {
            std::thread::sleep(Duration::from_millis(100));
        }
        recovered = t.elapsed();
        std::thread::sleep(Duration::from_millis(500));
        stop.store(true, Ordering::Relaxed);
        settled.unwrap();
    });
    let live = (0..cluster.nodes.len()).find(|&n| n != victim).unwrap();
    assert!(
        state(&l1) == "ok" && state(&l2) == "ok",
        "the daemons did not recover from the failover: {}\n{}{}",
        get(&l1.b, "/v1/status").json()["cluster"],
        cluster.nodes[live]
            .cli(&["CLUSTER", "NODES"])
            .unwrap_or_default(),
        cluster.nodes[live]
            .cli(&["CLUSTER", "INFO"])
            .unwrap_or_default()
    );
    eprintln!(
        "failover: master {victim} killed, replica in charge and both daemons shared again after {recovered:?}; {} checks answered, {} not",
        answered.load(Ordering::Relaxed),
        unanswered.load(Ordering::Relaxed)
    );
    assert_eq!(
        unanswered.load(Ordering::Relaxed),
        0,
        "every check is answered during the failover"
    );

    // After the failover: exhausted keys stay exhausted (the replica had
    // them), fresh keys are exact again.
    for i in 0..8 {
        assert_eq!(
            check(&l1, "user", &format!("v{i}")),
            429,
            "user=v{i} kept its state through the failover"
        );
    }
    for i in 20..26 {
        assert_eq!(
            alternating(&labs, "user", &format!("v{i}")),
            (0..LIMIT).collect::<Vec<_>>(),
            "user=v{i} after the failover"
        );
    }
    for (d, name) in [(d1, "host 1"), (d2, "host 2")] {
        let (status, log) = d.stop(libc::SIGTERM).unwrap();
        assert!(status.success(), "{name}: {log}");
    }
}
