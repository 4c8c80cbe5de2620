//! Request rules with `scope = "cluster"` across two daemons (two labs) and
//! one real Redis in a namespace of the test's own, reached through a
//! bridge: alternating checks share one exact limit for every algorithm; a
//! host defining a rule differently is refused; Redis hung (SIGSTOP) makes
//! each `on_failure` mode act within `timeout`, the status degraded; a
//! daemon started while Redis hangs says so; after SIGCONT the decisions
//! are shared again without double counting, and a charge Redis ran after
//! its caller gave up was not applied.

use std::time::{Duration, Instant};

use rl_tests::{
    daemon::{run_once, write, Daemon},
    http::{get, parse_prometheus, request_tcp},
    lab::Lab,
    redis::{Hub, Redis},
};
use serde_json::{json, Value};

const CHECK: &str = "127.0.0.1:8082";
const LIMIT: u64 = 6;

fn config(redis: &str, node: &str, on_failure: &str, tb_burst: u64) -> String {
    format!(
        "[default]\nrate = 1000\n\
         [cluster]\nredis = [\"{redis}\"]\nnode = \"{node}\"\nsync_interval = \"100ms\"\ntimeout = \"300ms\"\non_failure = \"{on_failure}\"\n\
         [l7]\nhttp_listen = \"{CHECK}\"\n\
         [[l7.rule]]\nname = \"tb\"\ndomain = \"d\"\ndescriptor = [{{ key = \"tb\" }}]\nrate = 1\nper = \"1h\"\nburst = {tb_burst}\nscope = \"cluster\"\n\
         [[l7.rule]]\nname = \"fw\"\ndomain = \"d\"\ndescriptor = [{{ key = \"fw\" }}]\nrate = {LIMIT}\nper = \"1h\"\nalgorithm = \"fixed_window\"\nscope = \"cluster\"\n\
         [[l7.rule]]\nname = \"sw\"\ndomain = \"d\"\ndescriptor = [{{ key = \"sw\" }}]\nrate = {LIMIT}\nper = \"1h\"\nalgorithm = \"sliding_window\"\nscope = \"cluster\"\n\
         [[l7.rule]]\nname = \"log\"\ndomain = \"d\"\ndescriptor = [{{ key = \"log\" }}]\nrate = {LIMIT}\nper = \"1m\"\nalgorithm = \"sliding_log\"\nscope = \"cluster\"\n\
         [[l7.rule]]\nname = \"sem\"\ndomain = \"d\"\ndescriptor = [{{ key = \"sem\" }}]\nalgorithm = \"concurrency\"\nmax = 3\nscope = \"cluster\"\n\
         [[l7.rule]]\nname = \"bt\"\ndomain = \"d\"\ndescriptor = [{{ key = \"bt\" }}]\nrate = 20\nper = \"1s\"\nburst = 5\nscope = \"cluster\"\nbatch = \"20ms\"\n\
         [[l7.rule]]\nname = \"two\"\ndomain = \"d\"\ndescriptor = [{{ key = \"two\" }}]\nlimits = [{{ rate = 2, per = \"10s\" }}, {{ rate = 2, per = \"1h\" }}]\nscope = \"cluster\"\n\
         [[l7.rule]]\nname = \"here\"\ndomain = \"d\"\ndescriptor = [{{ key = \"here\" }}]\nrate = 1\nper = \"1h\"\nburst = 2\n"
    )
}

fn check(lab: &Lab, key: &str, value: &str, hits: i64) -> (u16, Value) {
    let body =
        json!({"domain": "d", "descriptors": [[{"key": key, "value": value}]], "hits": hits});
    let a = request_tcp(
        &lab.b,
        CHECK,
        "POST",
        "/v1/check",
        Some(("application/json", serde_json::to_vec(&body).unwrap())),
        None,
    )
    .unwrap();
    let v = a.json();
    (a.status, v)
}

fn cluster_state(lab: &Lab) -> Value {
    get(&lab.b, "/v1/status").json()["cluster"].clone()
}

fn wait_state(lab: &Lab, want: &str, within: Duration) -> Value {
    let deadline = Instant::now() + within;
    loop {
        let c = cluster_state(lab);
        if c["state"] == want {
            return c;
        }
        assert!(
            Instant::now() < deadline,
            "the cluster state did not become {want} within {within:?}: {c}"
        );
        std::thread::sleep(Duration::from_millis(50));
    }
}

/// Waits (up to 2 s: a sync interval and a timeout) for `event` in the log.
fn wait_event(lab: &Lab, event: &str) -> serde_json::Value {
    let deadline = Instant::now() + Duration::from_secs(2);
    loop {
        let ev = get(&lab.b, "/v1/events").json();
        if let Some(e) = ev["events"]
            .as_array()
            .and_then(|a| a.iter().find(|e| e["event"] == event))
        {
            return e.clone();
        }
        assert!(
            Instant::now() < deadline,
            "no {event} event within 2 s: {ev}"
        );
        std::thread::sleep(Duration::from_millis(50));
    }
}

/// Seconds to the next whole hour: windows of `per = "1h"` restart there.
fn clear_of_the_hour() {
    let now = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .unwrap()
        .as_secs();
    let left = 3600 - now % 3600;
    if left < 60 {
        std::thread::sleep(Duration::from_secs(left + 1));
    }
}

#[test]
fn two_daemons_share_one_exact_limit_and_each_failure_mode_does_what_it_says() {
    let mut hub = Hub::new(200 + std::process::id() % 50).unwrap();
    let (l1, l2) = (Lab::new().unwrap(), Lab::new().unwrap());
    hub.join_lab(&l1).unwrap();
    hub.join_lab(&l2).unwrap();
    let mut redis = Redis::start(&hub, 6379).unwrap();
    let dir = tempfile::tempdir().unwrap();
    let c1 = write(
        &dir,
        "h1.toml",
        &config(&redis.url(), "host-1", "open", LIMIT),
    );
    let c2 = write(
        &dir,
        "h2.toml",
        &config(&redis.url(), "host-2", "closed", LIMIT),
    );
    let bad = write(
        &dir,
        "bad.toml",
        &config(&redis.url(), "host-2", "closed", LIMIT + 1),
    );
    clear_of_the_hour();
    let d1 = Daemon::serving(&l1, &c1, &[]).unwrap();
    assert!(
        d1.log()
            .contains("joined the cluster: 7 cluster rules shared"),
        "{}",
        d1.log()
    );

    // Another definition of "tb" is refused, before anything is attached.
    let (status, out) = run_once(
        Some(&l2.b),
        &[
            "run",
            "--iface",
            "vb",
            "--config",
            bad.to_str().unwrap(),
            "--no-watch",
            "--detach-on-exit",
        ],
    )
    .unwrap();
    assert!(!status.success(), "{out}");
    assert!(
        out.contains("cluster rule \"l7:tb\" is defined differently by another host"),
        "{out}"
    );
    assert!(
        !l2.xdp_attached().unwrap(),
        "a refused start leaves nothing attached"
    );

    let d2 = Daemon::serving(&l2, &c2, &[]).unwrap();
    let (_, out) = run_once(Some(&l2.b), &["status"]).unwrap();
    assert!(
        out.contains("cluster:         ok, node host-2 on redis://"),
        "{out}"
    );
    assert_eq!(cluster_state(&l1)["state"], "ok");
    assert_eq!(cluster_state(&l2)["state"], "ok");

    // Alternating checks share one limit exactly, for every algorithm.
    for rule in ["tb", "fw", "sw", "log"] {
        let mut oks = Vec::new();
        for i in 0..2 * LIMIT {
            let lab = if i % 2 == 0 { &l1 } else { &l2 };
            let (status, v) = check(lab, rule, "k1", 1);
            let s = &v["statuses"][0];
            if status == 200 {
                assert_eq!(
                    s["remaining"].as_u64(),
                    Some(LIMIT - 1 - oks.len() as u64),
                    "{rule} #{i}: {v}"
                );
                oks.push(i);
            } else {
                assert_eq!(status, 429, "{rule} #{i}: {v}");
                assert!(
                    s["retry_after_ms"].as_u64().unwrap() > 0,
                    "{rule} #{i}: {v}"
                );
            }
        }
        assert_eq!(
            oks,
            (0..LIMIT).collect::<Vec<_>>(),
            "{rule}: exactly the first {LIMIT} of {} alternating checks pass",
            2 * LIMIT
        );
        // The key's state is Redis', whichever host is asked: spent.
        for lab in [&l1, &l2] {
            let s = get(&lab.b, &format!("/v1/l7/state?domain=d&{rule}=k1")).json();
            assert_eq!(
                (s["code"].as_str(), s["remaining"].as_u64()),
                (Some("over_limit"), Some(0)),
                "{rule}: {s}"
            );
        }
        let s = get(&l1.b, &format!("/v1/l7/state?domain=d&{rule}=fresh")).json();
        assert_eq!(
            (s["code"].as_str(), s["remaining"].as_u64()),
            (Some("ok"), Some(LIMIT)),
            "{rule}: {s}"
        );
    }
    // A refund on one host gives its hits back to the shared bucket: 2
    // more pass on the other host, then none.
    for rule in ["tb", "fw", "sw", "log"] {
        assert_eq!(check(&l1, rule, "k1", -2).0, 200, "{rule}");
        let after: Vec<u16> = (0..3).map(|_| check(&l2, rule, "k1", 1).0).collect();
        assert_eq!(
            after,
            [200, 200, 429],
            "{rule}: a refund of 2 gives back exactly 2"
        );
    }
    // Both limits of "two" out of room: the retry time is the hour's
    // (the 10 s limit frees up first, and a retry then is refused again).
    assert_eq!(check(&l1, "two", "k1", 2).0, 200);
    let (status, v) = check(&l2, "two", "k1", 1);
    assert_eq!(status, 429, "{v}");
    assert!(
        v["statuses"][0]["retry_after_ms"].as_u64().unwrap() > 10_000,
        "the retry waits for the hour's limit: {v}"
    );
    // The semaphore: 3 in flight over both hosts; a refund on the other
    // host frees one.
    let sem: Vec<u16> = (0..4)
        .map(|i| check(if i % 2 == 0 { &l1 } else { &l2 }, "sem", "job", 1).0)
        .collect();
    assert_eq!(sem, [200, 200, 200, 429]);
    assert_eq!(check(&l2, "sem", "job", -1).0, 200);
    assert_eq!(
        check(&l1, "sem", "job", 1).0,
        200,
        "the refund on host 2 freed a permit for host 1"
    );
    assert_eq!(check(&l2, "sem", "job", 1).0, 429);
    // A batched token bucket (20/s, burst 5, batch 20 ms): decided on each
    // host, the hits exchanged every 20 ms; checks alternating between the
    // hosts for 2 s stay within R·τ + N·B + (N−1)·R·(T+δ); two hosts each
    // on their own would allow 2·(R·τ + B).
    let start = Instant::now();
    let mut ok = 0u64;
    let mut i = 0u64;
    while start.elapsed() < Duration::from_secs(2) {
        if check(if i.is_multiple_of(2) { &l1 } else { &l2 }, "bt", "k", 1).0 == 200 {
            ok += 1;
        }
        i += 1;
    }
    let tau = start.elapsed().as_secs_f64();
    let bound = 20.0 * tau + 2.0 * 5.0 + 20.0 * (0.02 + 0.01);
    eprintln!("batched: {ok} of {i} checks passed in {tau:.2} s; bound {bound:.1}; two hosts on their own: {:.0}", 2.0 * (20.0 * tau + 5.0));
    assert!(
        (ok as f64) <= bound,
        "{ok} passed in {tau:.2} s, over the batched bound {bound:.1}"
    );
    assert!(
        (ok as f64) >= 20.0 * tau * 0.8,
        "{ok} passed in {tau:.2} s: batching starved the key"
    );
    assert!(i > 100, "only {i} checks in 2 s");

    // A local rule stays per host.
    for lab in [&l1, &l2] {
        assert_eq!(
            [
                check(lab, "here", "x", 1).0,
                check(lab, "here", "x", 1).0,
                check(lab, "here", "x", 1).0
            ],
            [200, 200, 429]
        );
    }

    // Redis hangs: within `timeout` host 1 (open) passes an exhausted key,
    // host 2 (closed) refuses a fresh one; both say degraded.
    redis.signal(libc::SIGSTOP);
    let t = Instant::now();
    let (status, v) = check(&l1, "tb", "k1", 1);
    let waited = t.elapsed();
    assert_eq!(status, 200, "open: {v}");
    assert!(
        waited < Duration::from_millis(300 + 400),
        "a decision waited {waited:?} with timeout 300 ms"
    );
    let t = Instant::now();
    let (status, v) = check(&l2, "tb", "fresh", 1);
    assert_eq!(status, 429, "closed: {v}");
    assert!(
        t.elapsed() < Duration::from_millis(300 + 400),
        "a decision waited {:?} with timeout 300 ms",
        t.elapsed()
    );
    for lab in [&l1, &l2] {
        let c = wait_state(lab, "degraded", Duration::from_secs(2));
        let (ok, out) = run_once(Some(&lab.b), &["status"]).unwrap();
        // Exit 3: running, not all well (for health checks).
        assert!(
            ok.code() == Some(3)
                && out.contains("cluster:         DEGRADED since")
                && out.contains("on_failure ="),
            "{out}"
        );
        assert!(c["degraded_since_unix_ms"].as_u64().is_some(), "{c}");
        let m = parse_prometheus(&get(&lab.b, "/metrics").body);
        assert!(
            m.keys()
                .any(|k| k.starts_with("rl_cluster_degraded{") && m[k] == 1.0),
            "{m:?}"
        );
        let firing = rl_tests::alerts::check(&m, &["daemon", "datapath", "l7", "cluster"]);
        assert!(
            firing.contains(&"RlClusterDegraded".to_string()),
            "Redis hung: {firing:?}"
        );
        assert!(
            get(&lab.b, "/healthz").status == 200,
            "health stays 200 while degraded"
        );
        let e = wait_event(lab, "cluster_degraded");
        // The Redis error is the event's detail, not its rule.
        assert_eq!(e["rule"], "", "{e}");
        assert!(e["detail"].as_str().is_some_and(|d| !d.is_empty()), "{e}");
    }
    // Local rules are never slowed by Redis.
    let t = Instant::now();
    for _ in 0..5 {
        check(&l1, "here", "fast", 1);
    }
    assert!(
        t.elapsed() < Duration::from_millis(250),
        "5 local decisions took {:?} with Redis hung",
        t.elapsed()
    );
    // Degraded, decisions no longer wait at all.
    let t = Instant::now();
    for _ in 0..5 {
        assert_eq!(check(&l1, "fw", "k1", 1).0, 200);
    }
    assert!(
        t.elapsed() < Duration::from_millis(250),
        "5 open decisions took {:?}",
        t.elapsed()
    );

    // Host 2 restarts while Redis hangs, now with on_failure = "local": it
    // starts, says so, and enforces each rule's own limit by itself.
    drop(d2);
    let c2 = write(
        &dir,
        "h2.toml",
        &config(&redis.url(), "host-2", "local", LIMIT),
    );
    let d2 = Daemon::serving(&l2, &c2, &[]).unwrap();
    assert!(
        d2.log().contains("is unreachable") && d2.log().contains("on_failure = \"local\""),
        "{}",
        d2.log()
    );
    assert_eq!(cluster_state(&l2)["state"], "degraded");
    let local: Vec<u16> = (0..LIMIT + 1)
        .map(|_| check(&l2, "fw", "k2", 1).0)
        .collect();
    assert_eq!(
        local.iter().filter(|&&s| s == 200).count() as u64,
        LIMIT,
        "{local:?}"
    );

    // Redis resumes: both hosts share again within a few sync intervals,
    // and what Redis held is neither lost nor counted twice.
    redis.signal(libc::SIGCONT);
    for lab in [&l1, &l2] {
        wait_state(lab, "ok", Duration::from_secs(3));
        wait_event(lab, "cluster_recovered");
    }
    for (lab, rule) in [(&l1, "tb"), (&l2, "tb"), (&l1, "log"), (&l2, "fw")] {
        let (status, v) = check(lab, rule, "k1", 1);
        assert_eq!(
            status, 429,
            "{rule} stays exhausted in Redis after the outage: {v}"
        );
    }
    let (status, v) = check(&l2, "log", "k3", 1);
    assert_eq!(
        (status, v["statuses"][0]["remaining"].as_u64()),
        (200, Some(LIMIT - 1)),
        "{v}"
    );

    // A decision that reaches Redis after its caller gave up is not
    // applied: Redis hangs, a check waits `timeout` and passes (open);
    // Redis resumes and runs the call it had queued, which finds its
    // deadline past. The key's permits are all free, none held by a
    // request nobody admitted through Redis.
    redis.signal(libc::SIGSTOP);
    assert_eq!(check(&l1, "sem", "late", 1).0, 200, "open");
    redis.signal(libc::SIGCONT);
    wait_state(&l1, "ok", Duration::from_secs(3));
    let s = get(&l1.b, "/v1/l7/state?domain=d&sem=late").json();
    assert_eq!(
        s["remaining"].as_u64(),
        Some(3),
        "a charge Redis ran after its caller gave up holds a permit: {s}"
    );

    // Redis killed: decisions keep answering within `timeout`.
    redis.kill();
    let t = Instant::now();
    assert_eq!(check(&l1, "tb", "k9", 1).0, 200, "open");
    assert!(
        t.elapsed() < Duration::from_millis(700),
        "{:?}",
        t.elapsed()
    );
    wait_state(&l1, "degraded", Duration::from_secs(2));
    redis.restart().unwrap();
    wait_state(&l1, "ok", Duration::from_secs(5));
    wait_state(&l2, "ok", Duration::from_secs(5));
    // Empty, Redis has forgotten every request bucket: an exhausted key
    // gets one burst again, no more (the documented R·τ + 2B).
    let again: Vec<u64> = (0..2 * LIMIT)
        .filter(|&i| check(if i % 2 == 0 { &l1 } else { &l2 }, "tb", "k1", 1).0 == 200)
        .collect();
    assert_eq!(
        again,
        (0..LIMIT).collect::<Vec<_>>(),
        "after an empty restart"
    );
    assert!(
        redis
            .cli(&["HGETALL", "rl:def:{l7:tb}"])
            .unwrap()
            .contains("host-1"),
        "registrations come back after an empty restart"
    );

    // A flapping Redis (hung 400 ms of every 800, 10 times): each failure
    // degrades at once, but each recovery soon after one waits for more
    // answered probes, so the hosts do not flip every sync interval.
    let spells = |lab: &Lab| cluster_state(lab)["degraded_spells"].as_u64().unwrap();
    let before = spells(&l1);
    let mut waiting = 0;
    for _ in 0..10 {
        redis.signal(libc::SIGSTOP);
        std::thread::sleep(Duration::from_millis(400));
        redis.signal(libc::SIGCONT);
        std::thread::sleep(Duration::from_millis(400));
        waiting = waiting.max(cluster_state(&l1)["probes_to_recover"].as_u64().unwrap());
    }
    let flaps = spells(&l1) - before;
    assert!(
        (1..=6).contains(&flaps),
        "{flaps} degraded spells over 10 hangs of 400 ms in 8 s"
    );
    assert!(
        waiting > 1,
        "a recovery soon after a failure waits for more than one answered probe"
    );
    wait_state(&l1, "ok", Duration::from_secs(5));

    for (d, name) in [(d1, "host 1"), (d2, "host 2")] {
        let (status, log) = d.stop(libc::SIGTERM).unwrap();
        assert!(status.success(), "{name}: {log}");
    }
}
