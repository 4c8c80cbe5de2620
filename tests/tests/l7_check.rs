//! The request check (`POST /v1/check` on `[l7] http_listen`) against the
//! running daemon over real HTTP: 200 up to the limit, then 429 with the
//! rate-limit headers; shadow rules never 429; bad input 400; a reload keeps
//! the buckets of unchanged rules; decisions in `/metrics`.

use rl_tests::{
    daemon::{served, write, Daemon, Served},
    http::{get, parse_prometheus, request, request_tcp, Answer},
    lab::Lab,
};
use serde_json::{json, Value};

const CHECK: &str = "127.0.0.1:8082";

fn config(login_rate: u32) -> String {
    format!(
        "[default]\nrate = 1000\n[l7]\nhttp_listen = \"{CHECK}\"\n\
         [[l7.rule]]\nname = \"login-per-ip\"\ndomain = \"auth\"\n\
         descriptor = [{{ key = \"auth_type\", value = \"login\" }}, {{ key = \"remote_address\" }}]\n\
         rate = {login_rate}\nper = \"1m\"\nalgorithm = \"sliding_log\"\n\
         [[l7.rule]]\nname = \"per-user\"\ndomain = \"auth\"\ndescriptor = [{{ key = \"user\" }}]\nrate = 1\nper = \"1h\"\n\
         [[l7.rule]]\nname = \"reads\"\ndomain = \"api\"\ndescriptor = [{{ key = \"user\" }}]\nrate = 2\nper = \"1h\"\naction = \"shadow\"\n"
    )
}

fn check(lab: &Lab, body: &Value) -> Answer {
    request_tcp(
        &lab.b,
        CHECK,
        "POST",
        "/v1/check",
        Some(("application/json", serde_json::to_vec(body).unwrap())),
        None,
    )
    .unwrap()
}

fn login(ip: &str) -> Value {
    json!({"domain": "auth", "descriptors": [[{"key": "auth_type", "value": "login"}, {"key": "remote_address", "value": ip}]]})
}

#[test]
fn the_check_answers_429_with_rate_limit_headers_past_the_limit() {
    let lab = Lab::new().unwrap();
    let dir = tempfile::tempdir().unwrap();
    let cfg = write(&dir, "rl.toml", &config(5));
    let d = Daemon::serving(&lab, &cfg, &[]).unwrap();
    assert!(
        d.log().contains("request check on http://127.0.0.1:8082"),
        "{}",
        d.log()
    );
    // The window opens at the first request, made after this: the waits
    // reported below are 60 s less at most this much time.
    let t0 = std::time::Instant::now();

    for i in 0..5 {
        let a = check(&lab, &login("192.0.2.7"));
        assert_eq!(a.status, 200, "request {i}: {}", a.body);
        let s = &a.json()["statuses"][0];
        assert_eq!(
            (
                s["code"].as_str(),
                s["rule"].as_str(),
                s["remaining"].as_u64()
            ),
            (Some("ok"), Some("login-per-ip"), Some(4 - i))
        );
    }
    let a = check(&lab, &login("192.0.2.7"));
    assert_eq!(a.status, 429, "{}", a.body);
    let v = a.json();
    assert_eq!(v["overall"], "over_limit");
    assert_eq!(v["statuses"][0]["code"], "over_limit");
    let retry = v["statuses"][0]["retry_after_ms"].as_u64().unwrap();
    let least = 60_000u64.saturating_sub(t0.elapsed().as_millis() as u64);
    assert!(
        (least..=60_000).contains(&retry),
        "the oldest of the 5 leaves the window 60 s after it was made: {retry} ms"
    );
    assert_eq!(
        check(&lab, &login("192.0.2.8")).status,
        200,
        "another address has its own bucket"
    );

    // The key's state through the admin API and the CLI, charging nothing.
    let state = |ip: &str| {
        get(
            &lab.b,
            &format!("/v1/l7/state?domain=auth&auth_type=login&remote_address={ip}"),
        )
        .json()
    };
    let s = state("192.0.2.7");
    assert_eq!(
        (
            s["code"].as_str(),
            s["remaining"].as_u64(),
            s["rule"].as_str()
        ),
        (Some("over_limit"), Some(0), Some("login-per-ip")),
        "{s}"
    );
    let s = state("192.0.2.99");
    assert_eq!(
        (s["code"].as_str(), s["remaining"].as_u64()),
        (Some("ok"), Some(5)),
        "{s}"
    );
    assert_eq!(
        state("192.0.2.99")["remaining"],
        5,
        "looking charged nothing"
    );
    let (status, out) = rl_tests::daemon::run_once(
        Some(&lab.b),
        &[
            "l7-state",
            "--domain",
            "auth",
            "auth_type=login",
            "remote_address=192.0.2.7",
        ],
    )
    .unwrap();
    assert!(
        status.success() && out.contains("over the limit") && out.contains("login-per-ip"),
        "{out}"
    );
    // A value with `+`, `&`, `=` and a space reaches the daemon as given.
    let odd = "a+b&c=d e";
    assert_eq!(check(&lab, &login(odd)).status, 200);
    let (status, out) = rl_tests::daemon::run_once(
        Some(&lab.b),
        &[
            "l7-state",
            "--domain",
            "auth",
            "auth_type=login",
            &format!("remote_address={odd}"),
        ],
    )
    .unwrap();
    assert!(
        status.success() && out.contains("remaining:   4"),
        "the CLI looked up another key than {odd:?}: {out}"
    );
    assert_eq!(get(&lab.b, "/v1/l7/state?auth_type=login").status, 400);
    // Unmatched descriptors are not limited.
    let a = check(
        &lab,
        &json!({"domain": "auth", "descriptors": [[{"key": "auth_type", "value": "signup"}]]}),
    );
    assert_eq!(
        (a.status, a.json()["statuses"][0]["code"].as_str()),
        (200, Some("unmatched"))
    );

    // Headers: the same request again, answered with headers this time.
    let h = headers_of(&lab, &login("192.0.2.7"));
    assert_eq!(h.status, 429);
    assert_eq!(h.get("x-ratelimit-limit"), "5");
    assert_eq!(h.get("x-ratelimit-remaining"), "0");
    let least = 59u64.saturating_sub(t0.elapsed().as_secs());
    let reset: u64 = h.get("x-ratelimit-reset").parse().unwrap();
    assert!((least..=60).contains(&reset), "x-ratelimit-reset {reset}");
    let retry: u64 = h.get("retry-after").parse().unwrap();
    assert!((least..=60).contains(&retry), "retry-after {retry}");
    assert_eq!(h.get("ratelimit-policy"), "\"login-per-ip\";q=5;w=60");
    assert!(
        h.get("ratelimit").starts_with("\"login-per-ip\";r=0;t="),
        "{}",
        h.get("ratelimit")
    );

    // A shadow rule never answers 429, and counts what it would have limited.
    for _ in 0..5 {
        let a = check(
            &lab,
            &json!({"domain": "api", "descriptors": [[{"key": "user", "value": "alice"}]]}),
        );
        assert_eq!(a.status, 200, "{}", a.body);
    }
    let m = parse_prometheus(&get(&lab.b, "/metrics").body);
    assert_eq!(
        m["rl_l7_decisions_total{rule=\"reads\",result=\"shadow_over\"}"],
        3.0
    );
    assert_eq!(
        m["rl_l7_decisions_total{rule=\"reads\",result=\"ok\"}"],
        2.0
    );
    assert_eq!(
        m["rl_l7_decisions_total{rule=\"login-per-ip\",result=\"over\"}"],
        2.0
    );
    assert_eq!(m["rl_l7_unmatched_total"], 1.0);
    assert_eq!(
        m["rl_l7_overflow_total{rule=\"login-per-ip\"}"], 0.0,
        "the store has room"
    );
    assert!(m["rl_l7_keys"] >= 3.0);
    let answered = m["rl_l7_request_seconds_count{api=\"http\"}"];
    assert!(answered >= 14.0, "{answered} checks timed");
    assert_eq!(
        m["rl_l7_request_seconds_bucket{api=\"http\",le=\"+Inf\"}"],
        answered
    );
    assert!(m["rl_l7_request_seconds_bucket{api=\"http\",le=\"0.05\"}"] <= answered);

    // A reload that changes another rule keeps this rule's buckets.
    let text = config(5).replace("rate = 2\nper = \"1h\"", "rate = 3\nper = \"1h\"");
    std::fs::write(&cfg, text).unwrap();
    assert_eq!(
        request(&lab.b, "POST", "/v1/reload", None, None)
            .unwrap()
            .status,
        200
    );
    assert_eq!(
        check(&lab, &login("192.0.2.7")).status,
        429,
        "the unchanged rule kept its log"
    );

    // Two descriptors over their limits: Retry-After is when the request
    // passes under both (the hour's), not the first's minute.
    let both = |user: &str| {
        json!({"domain": "auth", "descriptors": [
            [{"key": "auth_type", "value": "login"}, {"key": "remote_address", "value": "192.0.2.7"}],
            [{"key": "user", "value": user}],
        ]})
    };
    assert_eq!(
        check(
            &lab,
            &json!({"domain": "auth", "descriptors": [[{"key": "user", "value": "bob"}]]})
        )
        .status,
        200
    );
    let h = headers_of(&lab, &both("bob"));
    assert_eq!(h.status, 429);
    assert_eq!(
        h.get("ratelimit-policy"),
        "\"login-per-ip\";q=5;w=60",
        "the first over-limit descriptor speaks"
    );
    let retry: u64 = h.get("retry-after").parse().unwrap();
    assert!(
        retry > 3000,
        "retry-after {retry} s: a retry then meets the hour's limit again"
    );

    // The largest valid check (16 descriptors of 16 entries of 256-byte
    // keys and values, about 140 KB) is decided; a body past 1 MiB gets a
    // JSON 413.
    let entry = |i: usize| json!({"key": format!("{i:0>256}"), "value": "v".repeat(256)});
    let big =
        json!({"domain": "big", "descriptors": vec![(0..16).map(entry).collect::<Vec<_>>(); 16]});
    let a = check(&lab, &big);
    assert_eq!(
        (a.status, a.json()["overall"].as_str()),
        (200, Some("ok")),
        "{}",
        &a.body[..a.body.len().min(200)]
    );
    let huge =
        json!({"domain": "big", "descriptors": [[{"key": "k", "value": "\u{1}".repeat(200_000)}]]});
    let a = check(&lab, &huge);
    assert_eq!(a.status, 413);
    assert!(
        a.json()["error"]
            .as_str()
            .is_some_and(|e| e.contains("at most 1048576 bytes")),
        "{}",
        a.body
    );

    // Values and hits come from the caller's clients: a long user (1 per
    // hour) is decided, fitted to a bucket of its own, and hits past any
    // limit are over it, never a 400.
    let long = "u".repeat(5000);
    let answers: Vec<u16> = [(&long, 1), (&long, 1), (&format!("{long}2"), 2_000_000), (&format!("{long}2"), 1)]
        .iter()
        .map(|(user, hits)| check(&lab, &json!({"domain": "auth", "descriptors": [[{"key": "user", "value": user}]], "hits": hits})).status)
        .collect();
    assert_eq!(answers, [200, 429, 429, 200]);

    // Bad input: 400 with a message, never a decision, and counted.
    let refused = || {
        parse_prometheus(&get(&lab.b, "/metrics").body)
            ["rl_l7_refused_total{api=\"http\",code=\"400\"}"]
    };
    let before = refused();
    for bad in [
        json!({"domain": "auth"}),
        json!({"domain": "", "descriptors": [[{"key": "k", "value": "v"}]]}),
        json!({"domain": "auth", "descriptors": []}),
        json!({"domain": "auth", "descriptors": [[]]}),
        json!({"domain": "auth", "descriptors": [[{"key": "", "value": "v"}]]}),
        json!({"domain": "auth", "descriptors": vec![vec![json!({"key": "k", "value": "v"})]; 17]}),
        json!({"domain": "auth", "descriptors": [[{"key": "k", "value": "v"}]], "extra": 1}),
    ] {
        let a = check(&lab, &bad);
        assert_eq!(a.status, 400, "{bad}: {}", a.body);
        assert!(a.json()["error"].is_string());
    }
    let a = request_tcp(
        &lab.b,
        CHECK,
        "POST",
        "/v1/check",
        Some(("application/json", b"{not json".to_vec())),
        None,
    )
    .unwrap();
    assert_eq!(a.status, 400);
    assert_eq!(refused() - before, 8.0, "each refused check is counted");
    // The check cannot change anything: no admin routes there.
    assert_eq!(
        request_tcp(&lab.b, CHECK, "POST", "/v1/bans", None, None)
            .unwrap()
            .status,
        404
    );
    // A body that never arrives in full holds its connection 10 s at most:
    // then 408, and the connection closes.
    let (answer, waited) = lab
        .b
        .run(|| {
            use std::io::{Read, Write};
            let mut s = std::net::TcpStream::connect(CHECK)?;
            s.set_read_timeout(Some(std::time::Duration::from_secs(20)))?;
            let t = std::time::Instant::now();
            s.write_all(b"POST /v1/check HTTP/1.1\r\nHost: rl\r\nContent-Type: application/json\r\nContent-Length: 100\r\n\r\n{\"domain\"")?;
            let mut out = Vec::new();
            let _ = s.read_to_end(&mut out);
            Ok((String::from_utf8_lossy(&out).into_owned(), t.elapsed()))
        })
        .unwrap();
    assert!(
        answer.starts_with("HTTP/1.1 408") && answer.contains("did not arrive within 10s"),
        "{answer}"
    );
    assert!(
        waited >= std::time::Duration::from_secs(9) && waited < std::time::Duration::from_secs(15),
        "{waited:?}"
    );
    let (status, log) = d.stop(libc::SIGTERM).unwrap();
    assert!(status.success(), "{log}");
}

struct Headers {
    status: u16,
    map: std::collections::HashMap<String, String>,
}

impl Headers {
    fn get(&self, name: &str) -> &str {
        self.map
            .get(name)
            .map(String::as_str)
            .unwrap_or_else(|| panic!("no {name} header in {:?}", self.map))
    }
}

fn headers_of(lab: &Lab, body: &Value) -> Headers {
    let body = serde_json::to_vec(body).unwrap();
    lab.b
        .run(move || {
            let agent = ureq::AgentBuilder::new().build();
            let r = match agent
                .post(&format!("http://{CHECK}/v1/check"))
                .set("Content-Type", "application/json")
                .send_bytes(&body)
            {
                Ok(r) => r,
                Err(ureq::Error::Status(_, r)) => r,
                Err(e) => return Err(e.into()),
            };
            let map = r
                .headers_names()
                .into_iter()
                .filter_map(|n| {
                    r.header(&n)
                        .map(|v| (n.to_ascii_lowercase(), v.to_string()))
                })
                .collect();
            Ok(Headers {
                status: r.status(),
                map,
            })
        })
        .unwrap()
}

/// The daemon sweeps the request store's shards in turn, each once a
/// second: buckets that are fresh again go (whatever shard they hashed
/// to), limited ones stay.
#[test]
fn the_daemon_drops_request_buckets_that_are_fresh_again_and_keeps_limited_ones() {
    let Served { lab, d, dir: _dir, .. } = served(&format!(
        "[default]\nrate = 1000\n[l7]\nhttp_listen = \"{CHECK}\"\n\
         [[l7.rule]]\nname = \"fast\"\ndomain = \"api\"\ndescriptor = [{{ key = \"user\" }}]\nrate = 1\nper = \"5s\"\n\
         [[l7.rule]]\nname = \"slow\"\ndomain = \"auth\"\ndescriptor = [{{ key = \"user\" }}]\nrate = 1\nper = \"1h\"\n"
    ))
    .unwrap();
    let keys = || parse_prometheus(&get(&lab.b, "/metrics").body)["rl_l7_keys"];
    // 200 keys spread over every shard, fresh again 5 s after their one
    // request (making them takes well under that, even on a busy runner);
    // 3 keys limited for an hour.
    for u in 0..200 {
        assert_eq!(check(&lab, &json!({"domain": "api", "descriptors": [[{"key": "user", "value": format!("u{u}")}]]})).status, 200);
    }
    for u in 0..3 {
        let body =
            json!({"domain": "auth", "descriptors": [[{"key": "user", "value": format!("s{u}")}]]});
        assert_eq!(check(&lab, &body).status, 200);
        assert_eq!(check(&lab, &body).status, 429);
    }
    assert_eq!(keys(), 203.0, "keys held right after they were made");
    let started = std::time::Instant::now();
    while keys() > 3.0 && started.elapsed() < std::time::Duration::from_secs(9) {
        std::thread::sleep(std::time::Duration::from_millis(100));
    }
    assert_eq!(
        keys(),
        3.0,
        "fresh buckets still held {:?} after the first request",
        started.elapsed()
    );
    for u in 0..3 {
        let body =
            json!({"domain": "auth", "descriptors": [[{"key": "user", "value": format!("s{u}")}]]});
        assert_eq!(
            check(&lab, &body).status,
            429,
            "a limited key was dropped by the sweep"
        );
    }
    d.stop(libc::SIGTERM).unwrap();
}

/// Over real HTTP: negative hits give hits back (a refund, as Envoy's
/// `is_negative_hits`), 0 hits is a check, and hits whose cost would not fit 64 bits on a
/// slow rule are over the limit (on "1 a day" 213,504 hits wrapped to a
/// cost inside the burst and passed).
#[test]
fn a_refund_gives_hits_back_a_check_charges_nothing_and_hits_too_costly_to_count_are_over_the_limit(
) {
    let lab = Lab::new().unwrap();
    let dir = tempfile::tempdir().unwrap();
    let cfg = write(
        &dir,
        "rl.toml",
        &format!(
            "[default]\nrate = 1000\n[l7]\nhttp_listen = \"{CHECK}\"\n\
             [[l7.rule]]\nname = \"daily\"\ndomain = \"api\"\ndescriptor = [{{ key = \"user\" }}]\nrate = 10\nper = \"1d\"\n"
        ),
    );
    let _d = Daemon::serving(&lab, &cfg, &[]).unwrap();
    let hits = |user: &str, n: i64| {
        let a = check(
            &lab,
            &json!({"domain": "api", "descriptors": [[{"key": "user", "value": user}]], "hits": n}),
        );
        (a.status, a.json()["statuses"][0]["remaining"].as_u64())
    };
    assert_eq!(hits("a", 10), (200, Some(0)));
    assert_eq!(hits("a", 1).0, 429);
    assert_eq!(hits("a", -4), (200, Some(4)), "4 given back");
    // 0 hits is a check, as a descriptor's `hits_addend` 0 is over gRPC.
    for _ in 0..3 {
        assert_eq!(hits("a", 0), (200, Some(4)), "a check charges nothing");
    }
    assert_eq!(hits("a", 4), (200, Some(0)));
    assert_eq!(hits("a", 1).0, 429, "and no more");
    assert_eq!(
        hits("a", 0).0,
        429,
        "a check says over when nothing is left"
    );
    assert_eq!(
        hits("b", 213_504).0,
        429,
        "a cost past 64 bits never passes"
    );
    assert_eq!(hits("b", 10), (200, Some(0)), "and charged nothing");
}
