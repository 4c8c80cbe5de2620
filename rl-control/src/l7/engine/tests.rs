//! The request engine's tests: matching, each algorithm's bound with
//! threads racing, refunds, the overflow bucket, reloads.

use super::*;
use crate::config::Config;

const S: u64 = NS;

fn engine(rules: &str) -> Engine {
    let c = Config::from_str(
        &format!("[default]\nrate = 1\n[l7]\nmax_keys = 8\n{rules}"),
        "t",
    )
    .unwrap();
    Engine::new(&c.l7, 0, None)
}

pub(super) fn d(pairs: &[(&str, &str)]) -> Vec<DescriptorEntry> {
    pairs
        .iter()
        .map(|(k, v)| DescriptorEntry {
            key: k.to_string(),
            value: v.to_string(),
        })
        .collect()
}

const LOGIN: &str = "[[l7.rule]]\nname = \"login\"\ndomain = \"auth\"\n\
    descriptor = [{ key = \"auth_type\", value = \"login\" }, { key = \"remote_address\" }]\n\
    rate = 5\nper = \"1m\"\nalgorithm = \"sliding_log\"\n";

#[test]
fn descriptors_match_by_keys_in_order_and_given_values_and_each_value_has_its_bucket() {
    let e = engine(LOGIN);
    let ip = |a: &str| d(&[("auth_type", "login"), ("remote_address", a)]);
    for _ in 0..5 {
        assert_eq!(e.decide_at("auth", &ip("192.0.2.7"), 1, 10 * S).code, "ok");
    }
    assert_eq!(
        e.decide_at("auth", &ip("192.0.2.7"), 1, 10 * S).code,
        "over_limit"
    );
    assert_eq!(
        e.decide_at("auth", &ip("192.0.2.8"), 1, 10 * S).code,
        "ok",
        "another value, another bucket"
    );
    for other in [
        d(&[("auth_type", "signup"), ("remote_address", "x")]),
        d(&[("remote_address", "x"), ("auth_type", "login")]),
        d(&[("auth_type", "login")]),
    ] {
        assert_eq!(
            e.decide_at("auth", &other, 1, 10 * S).code,
            "unmatched",
            "{other:?}"
        );
    }
    assert_eq!(
        e.decide_at("other", &ip("192.0.2.7"), 1, 10 * S).code,
        "unmatched",
        "another domain"
    );
    assert_eq!(e.unmatched.load(Ordering::Relaxed), 4);
}

/// Hits whose cost does not fit 64 bits are over the limit: on "1 a
/// day", 213,504 hits' cost wrapped to 1,526 s, inside the day's burst
/// span, and passed.
#[test]
fn hits_whose_cost_would_wrap_are_over_the_limit() {
    let e = engine("[[l7.rule]]\nname = \"daily\"\ndomain = \"api\"\ndescriptor = [{ key = \"user\" }]\nrate = 1\nper = \"1d\"\n");
    let user = d(&[("user", "u")]);
    assert_eq!(
        e.decide_at("api", &user, 213_504, 10 * S).code,
        "over_limit"
    );
    assert_eq!(
        e.decide_at("api", &user, 1, 10 * S).code,
        "ok",
        "and nothing was charged"
    );
    assert_eq!(e.decide_at("api", &user, 1, 10 * S).code, "over_limit");
}

/// A refund (negative hits, Envoy's `is_negative_hits`) gives hits back
/// to every algorithm, never past a full bucket, and makes no bucket
/// for a key without one.
#[test]
fn a_refund_gives_hits_back_and_never_more_than_a_full_bucket() {
    for algorithm in [
        "token_bucket",
        "fixed_window",
        "sliding_window",
        "sliding_log",
    ] {
        let e = engine(&format!("[[l7.rule]]\nname = \"r\"\ndomain = \"api\"\ndescriptor = [{{ key = \"user\" }}]\nrate = 10\nper = \"1m\"\nalgorithm = \"{algorithm}\"\n"));
        let user = d(&[("user", "u")]);
        let t = 600 * S + S / 2;
        assert_eq!(e.decide_at("api", &user, 10, t).code, "ok", "{algorithm}");
        assert_eq!(
            e.decide_at("api", &user, 1, t).code,
            "over_limit",
            "{algorithm}"
        );
        let refunded = e.decide_at("api", &user, -5, t);
        assert_eq!(
            (refunded.code, refunded.remaining),
            ("ok", 5),
            "{algorithm}"
        );
        assert_eq!(
            e.decide_at("api", &user, 5, t).code,
            "ok",
            "{algorithm}: the 5 given back"
        );
        assert_eq!(
            e.decide_at("api", &user, 1, t).code,
            "over_limit",
            "{algorithm}: and no more"
        );
        // Never past a full bucket: a refund of 100 on an empty key.
        let other = d(&[("user", "v")]);
        let keys = e.keys.load(Ordering::Relaxed);
        assert_eq!(e.decide_at("api", &other, -100, t).code, "ok");
        assert_eq!(
            e.keys.load(Ordering::Relaxed),
            keys,
            "{algorithm}: no bucket made for a refund"
        );
        assert_eq!(e.decide_at("api", &other, 10, t).code, "ok", "{algorithm}");
        assert_eq!(
            e.decide_at("api", &other, -100, t).remaining,
            10,
            "{algorithm}: full, not more"
        );
        assert_eq!(
            e.decide_at("api", &other, 11, t).code,
            "over_limit",
            "{algorithm}"
        );
    }
}

/// With the store full (8 keys here), new keys share the rule's
/// overflow bucket, and each such charge is counted for the metrics.
#[test]
fn charges_to_the_overflow_bucket_are_counted() {
    // 100 a day: nothing refills while the test runs on the real clock
    // (`peek` reads it).
    let e = engine("[[l7.rule]]\nname = \"r\"\ndomain = \"api\"\ndescriptor = [{ key = \"user\" }]\nrate = 100\nper = \"1d\"\n");
    let t = now_ns();
    for i in 0..8 {
        assert_eq!(
            e.decide_at("api", &d(&[("user", &i.to_string())]), 1, t)
                .code,
            "ok"
        );
    }
    let (_, c) = e.counters().next().unwrap();
    assert_eq!(c.overflow.load(Ordering::Relaxed), 0);
    for i in 8..11 {
        e.decide_at("api", &d(&[("user", &i.to_string())]), 1, t);
    }
    let (_, c) = e.counters().next().unwrap();
    assert_eq!(
        c.overflow.load(Ordering::Relaxed),
        3,
        "3 keys past max_keys, charged to the overflow bucket"
    );
    // A key that would be charged to the overflow bucket reads its
    // state: 3 of its 100 spent.
    assert_eq!(e.peek("api", &d(&[("user", "new")])).remaining, 97);
    // So does a refund for such a key: it gives nothing back, and its
    // answer is the overflow bucket's, not a fresh bucket's whole limit.
    let refund = e.decide_at("api", &d(&[("user", "new")]), -1, t);
    assert_eq!((refund.code, refund.remaining), ("ok", 97));
    assert_eq!(
        e.peek("api", &d(&[("user", "0")])).remaining,
        99,
        "a key with its own bucket reads its own"
    );
}

/// A refund gives back the log's oldest entry (which hits it gives
/// back is not known; the newest would free room a request still in
/// the window had taken), and a refund for a key without a bucket
/// gives nothing back, even to the overflow bucket, whose permits may
/// be other keys'.
#[test]
fn refunds_err_on_the_side_of_the_limit() {
    let e = engine("[[l7.rule]]\nname = \"r\"\ndomain = \"api\"\ndescriptor = [{ key = \"user\" }]\nrate = 2\nper = \"1m\"\nalgorithm = \"sliding_log\"\n");
    let user = d(&[("user", "u")]);
    for t in [0, 50] {
        assert_eq!(e.decide_at("api", &user, 1, (600 + t) * S).code, "ok");
    }
    e.decide_at("api", &user, -1, 655 * S);
    assert_eq!(
        e.decide_at("api", &user, 1, 661 * S).code,
        "ok",
        "the entry of 600 s given back; 650 s's stays"
    );
    assert_eq!(
        e.decide_at("api", &user, 1, 661 * S).code,
        "over_limit",
        "2 in the minute from 650 s"
    );

    let e = engine("[[l7.rule]]\nname = \"c\"\ndomain = \"api\"\ndescriptor = [{ key = \"user\" }]\nalgorithm = \"concurrency\"\nmax = 2\n");
    for i in 0..8 {
        assert_eq!(
            e.decide_at("api", &d(&[("user", &i.to_string())]), 1, 10 * S)
                .code,
            "ok"
        );
    }
    // The store is full: new keys share the overflow bucket's 2 permits.
    for y in ["y1", "y2"] {
        assert_eq!(e.decide_at("api", &d(&[("user", y)]), 1, 10 * S).code, "ok");
    }
    e.decide_at("api", &d(&[("user", "x")]), -1, 10 * S);
    assert_eq!(
        e.decide_at("api", &d(&[("user", "y3")]), 1, 10 * S).code,
        "over_limit",
        "x's refund freed no one's permit"
    );
}

/// Over the limit for `hits` while some room is left, the retry time
/// is when `hits` fit, not 0 (which the check sent as Retry-After: 1).
#[test]
fn the_retry_time_of_several_hits_is_when_they_fit() {
    let e = engine(LOGIN);
    let key = d(&[("auth_type", "login"), ("remote_address", "a")]);
    for t in [10, 20, 30] {
        assert_eq!(e.decide_at("auth", &key, 1, t * S).code, "ok");
    }
    // 2 left of 5 a minute; 4 more fit once the first 2 leave, at 80 s.
    let st = e.decide_at("auth", &key, 4, 40 * S);
    assert_eq!(
        (st.code, st.remaining, st.retry_after_ms),
        ("over_limit", 2, 40_000)
    );
    let st = e.decide_at("auth", &key, 2, 40 * S);
    assert_eq!(
        (st.code, st.retry_after_ms),
        ("ok", 30_000),
        "2 fit now; the next one once the first leaves, at 70 s"
    );
    // A token bucket at 1/s with burst 10, 8 spent: 5 more in 3 s.
    let e = engine("[[l7.rule]]\nname = \"r\"\ndomain = \"api\"\ndescriptor = [{ key = \"user\" }]\nrate = 1\nburst = 10\n");
    let user = d(&[("user", "u")]);
    assert_eq!(e.decide_at("api", &user, 8, 100 * S).code, "ok");
    let st = e.decide_at("api", &user, 5, 100 * S);
    assert_eq!(
        (st.code, st.remaining, st.retry_after_ms),
        ("over_limit", 2, 3_000)
    );
}

/// Two limits out of room at once: the retry time is when both have room
/// again, not when the first listed does (a client retrying then is
/// refused again).
#[test]
fn the_retry_time_waits_for_every_limit_out_of_room() {
    for algorithm in [
        "token_bucket",
        "fixed_window",
        "sliding_window",
        "sliding_log",
    ] {
        let e = engine(&format!(
            "[[l7.rule]]\nname = \"r\"\ndomain = \"api\"\ndescriptor = [{{ key = \"user\" }}]\nalgorithm = \"{algorithm}\"\n\
             limits = [{{ rate = 2, per = \"10s\" }}, {{ rate = 2, per = \"1h\" }}]\n"
        ));
        let user = d(&[("user", "u")]);
        // Windows align to the epoch: start one second into an hour.
        let t0 = 3601 * S;
        assert_eq!(e.decide_at("api", &user, 2, t0).code, "ok", "{algorithm}");
        let st = e.decide_at("api", &user, 1, t0);
        assert_eq!(st.code, "over_limit", "{algorithm}");
        // The hour's: at least 30 minutes for every algorithm (the 10 s
        // limit's is 5 to 15 s).
        assert!(
            st.retry_after_ms >= 1_800_000,
            "{algorithm}: the hour's limit is out of room too, yet retry after {} ms",
            st.retry_after_ms
        );
        // Out of room without being over: the wait for one more is the hour's too.
        assert!(
            e.decide_at("api", &d(&[("user", "v")]), 2, t0)
                .retry_after_ms
                >= 1_800_000,
            "{algorithm}"
        );
    }
}

#[test]
fn the_sliding_log_never_allows_more_than_rate_in_any_window() {
    let e = engine(LOGIN);
    let key = d(&[("auth_type", "login"), ("remote_address", "a")]);
    // Requests at pseudo-random moments over 10 minutes.
    let mut t = 1_000 * S;
    let mut seed = 12345u64;
    let mut allowed = Vec::new();
    for _ in 0..5_000 {
        seed = seed
            .wrapping_mul(6364136223846793005)
            .wrapping_add(1442695040888963407);
        t += (seed >> 33) % (300 * 1_000_000); // up to 0.3 s apart
        if e.decide_at("auth", &key, 1, t).code == "ok" {
            allowed.push(t);
        }
    }
    for (i, &start) in allowed.iter().enumerate() {
        let in_window = allowed[i..]
            .iter()
            .take_while(|&&x| x < start + 60 * S)
            .count();
        assert!(
            in_window <= 5,
            "{in_window} allowed in the minute from {start}"
        );
    }
    assert!(
        allowed.len() >= 5 * 9,
        "the log let too few through: {}",
        allowed.len()
    );
}

#[test]
fn concurrency_never_has_more_than_max_out_with_8_threads_racing() {
    let e = Arc::new(engine("[[l7.rule]]\nname = \"uploads\"\ndomain = \"api\"\ndescriptor = [{ key = \"user\" }]\nalgorithm = \"concurrency\"\nmax = 3\n"));
    let out = Arc::new(AtomicU64::new(0));
    let peak = Arc::new(AtomicU64::new(0));
    let threads: Vec<_> = (0..8)
        .map(|_| {
            let (e, out, peak) = (e.clone(), out.clone(), peak.clone());
            std::thread::spawn(move || {
                let key = d(&[("user", "alice")]);
                for _ in 0..2_000 {
                    if e.decide("api", &key, 1).code == "ok" {
                        let n = out.fetch_add(1, Ordering::SeqCst) + 1;
                        peak.fetch_max(n, Ordering::SeqCst);
                        std::hint::spin_loop();
                        out.fetch_sub(1, Ordering::SeqCst);
                        assert_eq!(e.decide("api", &key, -1).code, "ok");
                    }
                }
            })
        })
        .collect();
    for t in threads {
        t.join().unwrap();
    }
    let p = peak.load(Ordering::SeqCst);
    assert!((1..=3).contains(&p), "peak {p} permits out, max 3");
}

#[test]
fn every_algorithm_holds_its_bound_with_8_threads_racing_on_one_key() {
    // Within one hour, each rule allows exactly its amount, however the
    // threads interleave.
    for (algorithm, extra, allowed) in [
        ("token_bucket", "burst = 100\n", 100),
        ("fixed_window", "", 100),
        ("sliding_window", "", 100),
        ("sliding_log", "", 100),
    ] {
        let e = Arc::new(engine(&format!(
            "[[l7.rule]]\nname = \"r\"\ndomain = \"d\"\ndescriptor = [{{ key = \"k\" }}]\nrate = 100\nper = \"1h\"\n{extra}algorithm = \"{algorithm}\"\n"
        )));
        let ok = Arc::new(AtomicU64::new(0));
        let threads: Vec<_> = (0..8)
            .map(|_| {
                let (e, ok) = (e.clone(), ok.clone());
                std::thread::spawn(move || {
                    for _ in 0..500 {
                        if e.decide("d", &d(&[("k", "same")]), 1).code == "ok" {
                            ok.fetch_add(1, Ordering::Relaxed);
                        }
                    }
                })
            })
            .collect();
        for t in threads {
            t.join().unwrap();
        }
        let got = ok.load(Ordering::Relaxed);
        // A window that began just before the run may let the rest of
        // its count through; 100 per hour from one start is the bound.
        if algorithm == "fixed_window" {
            assert!(got <= 2 * allowed && got >= 1, "{algorithm}: {got}");
        } else {
            assert_eq!(
                got, allowed,
                "{algorithm}: {got} of 4,000 racing requests passed"
            );
        }
    }
}

#[test]
fn an_elastic_rule_lends_its_pool_to_keys_over_their_own_limit() {
    let e = engine("[[l7.rule]]\nname = \"el\"\ndomain = \"api\"\ndescriptor = [{ key = \"u\" }]\nrate = 1\nper = \"1h\"\nmode = \"elastic\"\npool_rate = 3\npool_per = \"1h\"\n");
    let codes = |who: &str, n: usize| {
        (0..n)
            .map(|_| e.decide_at("api", &d(&[("u", who)]), 1, S).code)
            .collect::<Vec<_>>()
    };
    let remaining = |who: &str, n: usize| {
        (0..n)
            .map(|_| e.decide_at("api", &d(&[("u", who)]), 1, S))
            .map(|st| (st.code, st.remaining))
            .collect::<Vec<_>>()
    };
    // What is left is the key's own, then the pool's; a check of 0 hits
    // reads the pool too.
    assert_eq!(e.decide_at("api", &d(&[("u", "a")]), 0, S).remaining, 1);
    assert_eq!(
        remaining("a", 3),
        [("ok", 0), ("ok", 2), ("ok", 1)],
        "1 own, then the pool's left"
    );
    let check = e.decide_at("api", &d(&[("u", "a")]), 0, S);
    assert_eq!(
        (check.code, check.remaining),
        ("ok", 1),
        "the pool has one left"
    );
    assert_eq!(
        codes("a", 2),
        ["ok", "over_limit"],
        "1 own, 3 from the pool"
    );
    assert_eq!(
        codes("b", 2),
        ["ok", "over_limit"],
        "its own, and the pool is spent"
    );
    assert_eq!(e.keys(), 2, "the pool is not a key");
}

#[test]
fn leases_expire_and_refunds_release() {
    let e = engine("[[l7.rule]]\nname = \"c\"\ndomain = \"api\"\ndescriptor = [{ key = \"u\" }]\nalgorithm = \"concurrency\"\nmax = 2\nlease = \"10s\"\n");
    let k = d(&[("u", "x")]);
    assert_eq!(e.decide_at("api", &k, 1, S).code, "ok");
    assert_eq!(e.decide_at("api", &k, 1, S).code, "ok");
    let over = e.decide_at("api", &k, 1, 2 * S);
    assert_eq!(
        (over.code, over.remaining, over.retry_after_ms),
        ("over_limit", 0, 9_000)
    );
    assert_eq!(e.decide_at("api", &k, -1, 3 * S).code, "ok");
    assert_eq!(
        e.decide_at("api", &k, 1, 3 * S).code,
        "ok",
        "a refund released a permit"
    );
    assert_eq!(
        e.decide_at("api", &k, 1, 12 * S).code,
        "ok",
        "leaked permits expired after 10 s"
    );
}

/// A bucket grows by one entry per request admitted, whatever its hits:
/// one check of a million hits held a million timestamps (8 MB a key,
/// and `max_keys` bounded the keys, not the memory).
#[test]
fn a_request_of_many_hits_is_one_entry_in_a_log_or_a_semaphore() {
    let e = engine(
        "[[l7.rule]]\nname = \"c\"\ndomain = \"api\"\ndescriptor = [{ key = \"u\" }]\nalgorithm = \"concurrency\"\nmax = 1000000\nlease = \"10s\"\n\
         [[l7.rule]]\nname = \"l\"\ndomain = \"api\"\ndescriptor = [{ key = \"v\" }]\nalgorithm = \"sliding_log\"\nrate = 10000\nper = \"1h\"\n",
    );
    let (c, l) = (d(&[("u", "x")]), d(&[("v", "x")]));
    assert_eq!(e.decide_at("api", &c, 1_000_000, S).remaining, 0);
    assert_eq!(e.decide_at("api", &l, 5_000, S).remaining, 5_000);
    assert_eq!(
        e.decide_at("api", &l, 5_000, S).remaining,
        0,
        "the same instant: the same entry"
    );
    let entries: usize = e
        .shards
        .iter()
        .flat_map(|s| {
            s.lock()
                .unwrap()
                .values()
                .map(|b| match b {
                    Bucket::Leases(r) => r.entries(),
                    Bucket::Log(logs) => logs.iter().map(|r| r.entries()).sum(),
                    _ => 0,
                })
                .collect::<Vec<_>>()
        })
        .sum();
    assert_eq!(entries, 2);
    // Refunds and expiry work on the runs.
    assert_eq!(e.decide_at("api", &c, -999_999, 2 * S).remaining, 999_999);
    assert_eq!(
        e.decide_at("api", &c, 1, 12 * S).remaining,
        999_999,
        "the last permit expired after 10 s"
    );
}

#[test]
fn token_buckets_pass_their_burst_and_shadow_rules_only_count() {
    let e = engine("[[l7.rule]]\nname = \"tb\"\ndomain = \"api\"\ndescriptor = [{ key = \"u\" }]\nrate = 10\nburst = 3\n\
        [[l7.rule]]\nname = \"sh\"\ndomain = \"api\"\ndescriptor = [{ key = \"s\" }]\nrate = 1\naction = \"shadow\"\n");
    let k = d(&[("u", "x")]);
    let codes: Vec<&str> = (0..5)
        .map(|_| e.decide_at("api", &k, 1, 5 * S).code)
        .collect();
    assert_eq!(codes, ["ok", "ok", "ok", "over_limit", "over_limit"]);
    let s = e.decide_at("api", &k, 1, 5 * S + S / 10);
    assert_eq!(s.code, "ok", "a token every 100 ms");
    let sh = d(&[("s", "y")]);
    for _ in 0..5 {
        assert_eq!(e.decide_at("api", &sh, 1, 5 * S).code, "ok");
    }
    let (_, c) = e.counters().find(|(n, _)| *n == "sh").unwrap();
    assert_eq!(
        (
            c.ok.load(Ordering::Relaxed),
            c.shadow_over.load(Ordering::Relaxed)
        ),
        (1, 4)
    );
}

#[test]
fn a_full_store_charges_newcomers_to_the_overflow_bucket_and_never_evicts_a_limited_key() {
    let e = engine("[[l7.rule]]\nname = \"one\"\ndomain = \"api\"\ndescriptor = [{ key = \"u\" }]\nrate = 1\nper = \"1h\"\n");
    let k = |i: u32| d(&[("u", &i.to_string())]);
    assert_eq!(e.decide_at("api", &k(0), 1, S).code, "ok");
    assert_eq!(e.decide_at("api", &k(0), 1, S).code, "over_limit");
    // max_keys = 8: 7 more keys fit, then newcomers share one bucket.
    let passed = (1..100)
        .filter(|&i| e.decide_at("api", &k(i), 1, S).code == "ok")
        .count();
    assert_eq!(
        passed,
        7 + 1,
        "7 own buckets, then one pass from the shared overflow bucket"
    );
    assert_eq!(e.keys(), 8);
    assert_eq!(
        e.decide_at("api", &k(0), 1, 2 * S).code,
        "over_limit",
        "the limited key kept its state"
    );
    assert_eq!(e.collect_at(2 * S), 0, "nothing fresh within the hour");
    assert_eq!(e.keys(), 8);
    assert_eq!(e.collect_at(2 * 3600 * S), 8, "all fresh after two hours");
    assert_eq!(e.keys(), 0);
    assert_eq!(
        e.decide_at("api", &k(50), 1, 2 * 3600 * S).code,
        "ok",
        "room again: a bucket of its own"
    );
}

#[test]
fn a_reload_keeps_the_buckets_of_unchanged_rules() {
    let e = engine(LOGIN);
    let k = d(&[("auth_type", "login"), ("remote_address", "a")]);
    for _ in 0..5 {
        e.decide_at("auth", &k, 1, S);
    }
    let same = Config::from_str(
        &format!("[default]\nrate = 1\n[l7]\nmax_keys = 8\n{LOGIN}"),
        "t",
    )
    .unwrap();
    let e2 = Engine::new(&same.l7, 0, Some(&e));
    assert_eq!(
        e2.decide_at("auth", &k, 1, 2 * S).code,
        "over_limit",
        "unchanged rule, same bucket"
    );
    let changed = Config::from_str(
        &format!(
            "[default]\nrate = 1\n[l7]\nmax_keys = 8\n{}",
            LOGIN.replace("rate = 5", "rate = 6")
        ),
        "t",
    )
    .unwrap();
    let e3 = Engine::new(&changed.l7, 0, Some(&e2));
    assert_eq!(
        e3.decide_at("auth", &k, 1, 3 * S).code,
        "ok",
        "a changed rule starts fresh"
    );
    assert_eq!(e3.keys(), 1);
}

/// The exported counters are Prometheus counters: a reload (any rule or
/// ban change) must not take them back to 0, a changed rule's included
/// (its metrics are by name), and a decision the old engine makes after
/// the swap still counts.
#[test]
fn a_reload_keeps_counting_where_the_counters_were() {
    let e = engine(LOGIN);
    let k = d(&[("auth_type", "login"), ("remote_address", "a")]);
    for _ in 0..7 {
        e.decide_at("auth", &k, 1, S);
    }
    e.decide_at("other", &k, 1, S);
    let changed = Config::from_str(
        &format!(
            "[default]\nrate = 1\n[l7]\nmax_keys = 8\n{}",
            LOGIN.replace("rate = 5", "rate = 6")
        ),
        "t",
    )
    .unwrap();
    let e2 = Engine::new(&changed.l7, 0, Some(&e));
    e.decide_at("auth", &k, 1, S);
    e2.decide_at("auth", &k, 1, 2 * S);
    e2.decide_at("other", &k, 1, 2 * S);
    let (_, c) = e2.counters().next().unwrap();
    // The old engine's decision after the swap finds its bucket gone (the
    // changed rule's slot was swept): ok, and counted.
    assert_eq!(
        (c.ok.load(Ordering::Relaxed), c.over.load(Ordering::Relaxed)),
        (7, 2),
        "5 ok + 2 over, then one on each engine"
    );
    assert_eq!(e2.unmatched.load(Ordering::Relaxed), 2);
}

/// A check of 0 hits (Envoy's "check only") is over the limit when nothing
/// is left, for every algorithm, and keeps no bucket for a key that has
/// none.
#[test]
fn a_check_of_zero_hits_is_over_when_nothing_is_left_and_keeps_no_bucket() {
    let mut rules = String::new();
    for (name, algo) in [
        ("tb", "token_bucket"),
        ("fw", "fixed_window"),
        ("sw", "sliding_window"),
        ("log", "sliding_log"),
    ] {
        rules += &format!("[[l7.rule]]\nname = \"{name}\"\ndomain = \"d\"\ndescriptor = [{{ key = \"{name}\" }}]\nrate = 2\nper = \"1h\"\nalgorithm = \"{algo}\"\n");
    }
    rules += "[[l7.rule]]\nname = \"sem\"\ndomain = \"d\"\ndescriptor = [{ key = \"sem\" }]\nalgorithm = \"concurrency\"\nmax = 2\n";
    let e = engine(&rules);
    for rule in ["tb", "fw", "sw", "log", "sem"] {
        let k = d(&[(rule, "u")]);
        let keys = e.keys();
        let st = e.decide_at("d", &k, 0, 10 * S);
        assert_eq!((st.code, st.remaining), ("ok", 2), "{rule}");
        assert_eq!(e.keys(), keys, "{rule}: a check of 0 hits made a bucket");
        assert_eq!(e.decide_at("d", &k, 2, 10 * S).code, "ok", "{rule}");
        let st = e.decide_at("d", &k, 0, 10 * S);
        assert_eq!(
            (st.code, st.remaining),
            ("over_limit", 0),
            "{rule}: nothing left"
        );
        assert!(st.retry_after_ms > 0, "{rule}: {st:?}");
    }
}

/// `drain_over_limit`: a charge over the limit (usage known only after the
/// fact, such as an LLM's tokens) empties the key's bucket, so the next
/// check of 0 hits says over; without it the charge changes nothing.
#[test]
fn drain_over_limit_empties_the_bucket_on_a_charge_over_it() {
    let mut rules = String::new();
    for (name, algo) in [
        ("tb", "token_bucket"),
        ("fw", "fixed_window"),
        ("sw", "sliding_window"),
        ("log", "sliding_log"),
    ] {
        for drain in [true, false] {
            rules += &format!("[[l7.rule]]\nname = \"{name}-{drain}\"\ndomain = \"d\"\ndescriptor = [{{ key = \"{name}-{drain}\" }}]\nrate = 100\nper = \"1h\"\nalgorithm = \"{algo}\"\ndrain_over_limit = {drain}\n");
        }
    }
    let e = engine(&rules);
    for rule in ["tb", "fw", "sw", "log"] {
        for drain in [true, false] {
            let k = d(&[(&format!("{rule}-{drain}"), "u")]);
            assert_eq!(e.decide_at("d", &k, 90, 10 * S).code, "ok");
            let st = e.decide_at("d", &k, 50, 11 * S);
            assert_eq!(st.code, "over_limit", "{rule} {drain}");
            let check = e.decide_at("d", &k, 0, 12 * S);
            if drain {
                assert_eq!(
                    (check.code, check.remaining),
                    ("over_limit", 0),
                    "{rule}: drained"
                );
                assert_eq!(
                    e.decide_at("d", &k, 1, 12 * S).code,
                    "over_limit",
                    "{rule}: drained"
                );
            } else {
                assert_eq!(
                    (check.code, check.remaining),
                    ("ok", 10),
                    "{rule}: the charge over the limit changed nothing"
                );
            }
        }
    }
    // Drained, never refilled: a bucket further behind stays so.
    let k = d(&[("tb-true", "v")]);
    assert_eq!(e.decide_at("d", &k, 100, 10 * S).code, "ok");
    assert_eq!(e.decide_at("d", &k, 100, 10 * S).code, "over_limit");
    assert_eq!(e.decide_at("d", &k, 0, 10 * S).remaining, 0);
}

/// Threads making new keys at once never take more than max_keys places
/// (a check and an increment apart let each thread see one place left).
#[test]
fn threads_making_keys_at_once_never_overshoot_max_keys() {
    let e = Arc::new(engine(
        "[[l7.rule]]\nname = \"r\"\ndomain = \"api\"\ndescriptor = [{ key = \"user\" }]\nrate = 100\nper = \"1d\"\n",
    ));
    for round in 0..200 {
        let start = Arc::new(std::sync::Barrier::new(8));
        let t = now_ns();
        let threads: Vec<_> = (0..8)
            .map(|i| {
                let (e, start) = (e.clone(), start.clone());
                std::thread::spawn(move || {
                    start.wait();
                    for k in 0..4 {
                        let user = format!("{round}-{i}-{k}");
                        e.decide_at("api", &d(&[("user", &user)]), 1, t);
                    }
                })
            })
            .collect();
        for t in threads {
            t.join().unwrap();
        }
        assert!(e.keys() <= 8, "round {round}: {} keys held", e.keys());
    }
}
