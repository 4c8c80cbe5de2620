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
    http::{get, request_tcp},
    lab::Lab,
    redis::{Hub, RedisCluster},
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
         [[l7.rule]]\nname = \"log\"\ndomain = \"d\"\ndescriptor = [{{ key = \"ip\" }}]\nrate = {LIMIT}\nper = \"1m\"\nalgorithm = \"sliding_log\"\nscope = \"cluster\"\n",
        redis.join(", ")
    )
}

fn check(lab: &Lab, key: &str, value: &str) -> u16 {
    let body = json!({"domain": "d", "descriptors": [[{"key": key, "value": value}]]});
    request_tcp(&lab.b, CHECK, "POST", "/v1/check", Some(("application/json", serde_json::to_vec(&body).unwrap())), None).map_or(0, |a| a.status)
}

/// Alternating checks on both hosts: which of `2 × LIMIT` passed.
fn alternating(labs: &[&Lab; 2], key: &str, value: &str) -> Vec<u64> {
    (0..2 * LIMIT).filter(|&i| check(labs[(i % 2) as usize], key, value) == 200).collect()
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
    assert!(d1.log().contains("joined the cluster: 2 cluster rules shared"), "{}", d1.log());
    let labs = [&l1, &l2];

    // Keys over every master, exact for both algorithms.
    for i in 0..8 {
        for rule in ["user", "ip"] {
            let v = format!("v{i}");
            assert_eq!(alternating(&labs, rule, &v), (0..LIMIT).collect::<Vec<_>>(), "{rule}={v}");
        }
    }
    let holders: Vec<usize> = (0..cluster.nodes.len())
        .filter(|&n| {
            let node = &cluster.nodes[n];
            node.cli(&["ROLE"]).is_ok_and(|r| r.starts_with("master")) && node.cli(&["KEYS", "rl:l7:*"]).is_ok_and(|k| !k.trim().is_empty())
        })
        .collect();
    assert_eq!(holders.len(), MASTERS, "the buckets spread over all {MASTERS} masters: {holders:?}");

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
        victim = cluster.master_holding("rl:l7:{tb:*").expect("a master holds the tb buckets");
        let t = Instant::now();
        cluster.nodes[victim].kill();
        let settled = cluster.wait_failover(victim, Duration::from_secs(20));
        let deadline = Instant::now() + Duration::from_secs(20);
        while settled.is_ok() && (state(&l1) != "ok" || state(&l2) != "ok") && Instant::now() < deadline {
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
        cluster.nodes[live].cli(&["CLUSTER", "NODES"]).unwrap_or_default(),
        cluster.nodes[live].cli(&["CLUSTER", "INFO"]).unwrap_or_default()
    );
    eprintln!(
        "failover: master {victim} killed, replica in charge and both daemons shared again after {recovered:?}; {} checks answered, {} not",
        answered.load(Ordering::Relaxed),
        unanswered.load(Ordering::Relaxed)
    );
    assert_eq!(unanswered.load(Ordering::Relaxed), 0, "every check is answered during the failover");

    // After the failover: exhausted keys stay exhausted (the replica had
    // them), fresh keys are exact again.
    for i in 0..8 {
        assert_eq!(check(&l1, "user", &format!("v{i}")), 429, "user=v{i} kept its state through the failover");
    }
    for i in 20..26 {
        assert_eq!(alternating(&labs, "user", &format!("v{i}")), (0..LIMIT).collect::<Vec<_>>(), "user=v{i} after the failover");
    }
    for (d, name) in [(d1, "host 1"), (d2, "host 2")] {
        let (status, log) = d.stop(libc::SIGTERM).unwrap();
        assert!(status.success(), "{name}: {log}");
    }
}
