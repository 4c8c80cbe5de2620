//! The admin API and the CLI client against a really running daemon
//! attached in a veth lab, over real HTTP, with real packets.

use std::time::Duration;

use rl_tests::{
    daemon::{run_once, write, Daemon},
    http::{get, json, parse_prometheus, request, request_headers},
    lab::Lab,
    traffic::{join, paced, Receiver},
};
use serde_json::{json, Value};

fn start(lab: &Lab, cfg: &std::path::Path, extra: &[&str]) -> Daemon {
    Daemon::serving(lab, cfg, extra).unwrap()
}

fn stop(d: Daemon) {
    let (status, log) = d.stop(libc::SIGTERM).unwrap();
    assert!(status.success(), "{log}");
}

/// Sends `n` UDP packets from `src` at once (10,000 pps) and returns how
/// many the receiver got.
fn burst_of(lab: &Lab, src: std::net::IpAddr, n: u64) -> u64 {
    let rx = Receiver::start(&lab.b).unwrap();
    join(paced(&lab.a, src, lab.v4(2), 10_000, n)).unwrap();
    rx.finish().unwrap().get(&src).copied().unwrap_or(0)
}

/// Every route the router serves (method, OpenAPI path).
const ROUTES: [(&str, &str); 17] = [
    ("get", "/healthz"),
    ("get", "/metrics"),
    ("get", "/v1/status"),
    ("get", "/v1/rules"),
    ("put", "/v1/rules"),
    ("post", "/v1/rules"),
    ("delete", "/v1/rules/{name}"),
    ("get", "/v1/stats"),
    ("get", "/v1/sources/{ip}"),
    ("get", "/v1/sources"),
    ("get", "/v1/cells"),
    ("get", "/v1/events"),
    ("get", "/v1/bans"),
    ("post", "/v1/bans"),
    ("delete", "/v1/bans/{cidr}"),
    ("post", "/v1/reload"),
    ("get", "/v1/l7/state"),
];

#[test]
fn every_route_answers_metrics_equal_stats_and_the_openapi_document_is_complete() {
    let lab = Lab::new().unwrap();
    let dir = tempfile::tempdir().unwrap();
    let cfg = write(&dir, "rules.toml", "[default]\nrate = 1000\n[[allow]]\ncidr = \"192.0.2.0/24\"\n[[rule]]\nname = \"udp-7777\"\nproto = \"udp\"\ndst_ports = [7777]\nrate = 20\nper = \"1m\"\nburst = 10\n");
    let d = start(&lab, &cfg, &[]);
    assert_eq!(get(&lab.b, "/healthz").json(), json!({"status": "ok"}));

    // Traffic: 50 packets at once, 10 pass the rule.
    assert_eq!(burst_of(&lab, lab.v4(1), 50), 10);

    let st = get(&lab.b, "/v1/status").json();
    assert_eq!(
        (
            st["iface"].as_str(),
            st["xdp_mode"].as_str(),
            st["rules"].as_u64()
        ),
        (Some("vb"), Some("native"), Some(1))
    );
    assert!(st["program_id"].as_u64().unwrap() > 0);
    let rules = get(&lab.b, "/v1/rules").json();
    assert_eq!(rules["rules"][0]["name"], "udp-7777");
    assert_eq!(rules["allow"][0]["cidr"], "192.0.2.0/24");

    let stats = get(&lab.b, "/v1/stats").json();
    let r = &stats["rules"]["udp-7777"];
    assert_eq!(
        (r["passed_packets"].as_u64(), r["dropped_packets"].as_u64()),
        (Some(10), Some(40)),
        "{stats}"
    );
    for name in ["default", "allow", "deny"] {
        assert!(stats["rules"][name].is_object(), "{stats}");
    }

    let m = get(&lab.b, "/metrics");
    assert_eq!(m.status, 200);
    let samples = parse_prometheus(&m.body);
    for (name, c) in stats["rules"].as_object().unwrap() {
        for (verdict, key) in [
            ("passed", "passed"),
            ("dropped", "dropped"),
            ("shadow_dropped", "shadow_dropped"),
        ] {
            let series = format!("rl_packets_total{{rule=\"{name}\",verdict=\"{verdict}\"}}");
            assert_eq!(
                samples[&series] as u64,
                c[format!("{key}_packets")].as_u64().unwrap(),
                "{series}"
            );
            let series = format!("rl_bytes_total{{rule=\"{name}\",verdict=\"{verdict}\"}}");
            assert_eq!(
                samples[&series] as u64,
                c[format!("{key}_bytes")].as_u64().unwrap(),
                "{series}"
            );
        }
    }
    assert_eq!(samples["rl_source_capacity"], 1_048_576.0);
    assert_eq!(samples["rl_active_bans"], 0.0);
    assert!(
        samples
            .keys()
            .any(|k| k.starts_with("rl_api_requests_total{route=\"/v1/stats\",status=\"200\"}")),
        "{}",
        m.body
    );

    // The OpenAPI document: every route, every operation answers something,
    // and every schema reference resolves.
    let doc = get(&lab.b, "/openapi.json").json();
    assert!(doc["openapi"].as_str().unwrap().starts_with("3."), "{doc}");
    for (method, path) in ROUTES {
        let op = &doc["paths"][path][method];
        assert!(
            op.is_object(),
            "{method} {path} missing from the OpenAPI document"
        );
        assert!(
            op["responses"].as_object().is_some_and(|r| !r.is_empty()),
            "{method} {path} has no responses"
        );
    }
    let text = doc.to_string();
    for r in text.split("\"$ref\":\"").skip(1) {
        let target = r.split('"').next().unwrap();
        let name = target
            .strip_prefix("#/components/schemas/")
            .unwrap_or_else(|| panic!("odd $ref {target}"));
        assert!(
            doc["components"]["schemas"][name].is_object(),
            "$ref {target} does not resolve"
        );
    }
    // And the reference validator agrees (installed by `cargo xtask test`).
    let file = dir.path().join("openapi.json");
    std::fs::write(&file, doc.to_string()).unwrap();
    let out = std::process::Command::new("python3")
        .args(["-m", "openapi_spec_validator"])
        .arg(&file)
        .output()
        .expect("python3 is needed to validate the OpenAPI document: run `cargo xtask test`, which installs it");
    let text = format!(
        "{}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(
        !text.contains("No module named"),
        "openapi-spec-validator is missing: run `cargo xtask test`, which installs it\n{text}"
    );
    assert!(
        out.status.success() && text.contains("OK"),
        "the OpenAPI document does not validate:\n{text}"
    );
    // Every /v1 operation needs the token; every change may answer 409
    // (an edit of the file not applied yet; not a reload), 422 and 503, as
    // the daemon does; a read of the datapath's maps, 500.
    for (method, path) in ROUTES.iter().filter(|(_, p)| p.starts_with("/v1/")) {
        let op = &doc["paths"][path][method];
        assert_eq!(
            op["security"][0]["bearer"],
            serde_json::json!([]),
            "{method} {path} does not say it needs the token"
        );
        assert!(
            op["responses"]["401"].is_object(),
            "{method} {path}: no 401"
        );
        if *method != "get" {
            for code in ["409", "422", "500", "503"] {
                // A reload writes nothing back: it cannot conflict.
                let promised = !(code == "409" && *path == "/v1/reload");
                assert_eq!(
                    op["responses"][code].is_object(),
                    promised,
                    "{method} {path}: {code}"
                );
            }
        } else {
            // The reads of the datapath's maps may fail; the others cannot.
            let reads_maps = ["/v1/stats", "/v1/sources/{ip}"].contains(path);
            assert_eq!(
                op["responses"]["500"].is_object(),
                reads_maps,
                "{method} {path}: 500"
            );
        }
    }
    let paths = doc["paths"].as_object().unwrap().len();
    assert_eq!(
        paths,
        14,
        "paths in the document: {:?}",
        doc["paths"].as_object().unwrap().keys().collect::<Vec<_>>()
    );

    // Errors are JSON with the right status.
    let a = get(&lab.b, "/v1/nope");
    assert_eq!(a.status, 404);
    assert!(a.json()["error"].is_string());
    let a = request(&lab.b, "PATCH", "/v1/rules", None, None).unwrap();
    assert_eq!(a.status, 405);
    assert!(a.json()["error"].is_string());
    // A path parameter that is not UTF-8 once decoded: JSON too.
    for path in ["/v1/sources/%FF", "/v1/bans/%FF", "/v1/rules/%FF"] {
        let method = if path.starts_with("/v1/sources") {
            "GET"
        } else {
            "DELETE"
        };
        let a = request(&lab.b, method, path, None, None).unwrap();
        assert_eq!(a.status, 400, "{path}: {}", a.body);
        assert!(
            a.json()["error"]
                .as_str()
                .is_some_and(|e| e.starts_with("the path")),
            "{path}: {}",
            a.body
        );
    }
    // Probes of routes that do not exist, and wrong methods, are counted
    // (once each).
    let samples = parse_prometheus(&get(&lab.b, "/metrics").body);
    assert_eq!(
        samples.get("rl_api_requests_total{route=\"unmatched\",status=\"404\"}"),
        Some(&1.0),
        "{samples:?}"
    );
    assert_eq!(
        samples.get("rl_api_requests_total{route=\"/v1/rules\",status=\"405\"}"),
        Some(&1.0),
        "{samples:?}"
    );
    stop(d);
}

#[test]
fn rule_changes_are_validated_atomic_enforced_and_survive_a_restart_and_a_file_reload() {
    let lab = Lab::new().unwrap();
    let dir = tempfile::tempdir().unwrap();
    let original = "# operator's comment\n[default]\nrate = 1000\n";
    let cfg = write(&dir, "rules.toml", original);
    let d = start(&lab, &cfg, &[]);

    // POST a rule: it is enforced at once, and written back with the comment kept.
    let rule = json!({"name": "slow-udp", "proto": "udp", "dst_ports": ["7000-7999"], "rate": 5, "per": "1m", "burst": 3});
    let a = request(&lab.b, "POST", "/v1/rules", json(&rule), None).unwrap();
    assert_eq!(a.status, 201, "{}", a.body);
    assert_eq!(burst_of(&lab, lab.v4(1), 20), 3);
    let file = std::fs::read_to_string(&cfg).unwrap();
    assert!(
        file.contains("# operator's comment") && file.contains("slow-udp"),
        "{file}"
    );

    // Conflicts, absent names, bad bodies and invalid rules change nothing.
    assert_eq!(
        request(&lab.b, "POST", "/v1/rules", json(&rule), None)
            .unwrap()
            .status,
        409
    );
    assert_eq!(
        request(&lab.b, "DELETE", "/v1/rules/absent", None, None)
            .unwrap()
            .status,
        404
    );
    let a = request(
        &lab.b,
        "POST",
        "/v1/rules",
        Some(("application/json", b"{not json".to_vec())),
        None,
    )
    .unwrap();
    assert_eq!(a.status, 400);
    assert!(a.json()["error"]
        .as_str()
        .unwrap()
        .contains("not valid JSON"));
    let a = request(
        &lab.b,
        "POST",
        "/v1/rules",
        json(&json!({"name": "bad", "proto": "sctp", "rate": 1})),
        None,
    )
    .unwrap();
    assert_eq!(a.status, 422);
    assert!(
        a.json()["error"].as_str().unwrap().contains("proto"),
        "{}",
        a.body
    );
    let a = request(
        &lab.b,
        "PUT",
        "/v1/rules",
        Some(("application/toml", b"[default]\nrate = 0\n".to_vec())),
        None,
    )
    .unwrap();
    assert_eq!(a.status, 422);
    assert!(
        a.json()["error"]
            .as_str()
            .unwrap()
            .contains(":2:8: default.rate = 0 is out of range"),
        "{}",
        a.body
    );
    let big = vec![b' '; 17 << 20];
    let a = request(
        &lab.b,
        "PUT",
        "/v1/rules",
        Some(("application/json", big)),
        None,
    )
    .unwrap();
    assert_eq!(a.status, 413);
    assert!(a.json()["error"].is_string());
    assert!(
        std::fs::read_to_string(&cfg).unwrap().contains("slow-udp"),
        "a refused change left the file alone"
    );
    assert_eq!(
        get(&lab.b, "/healthz").status,
        200,
        "bad input did not stop the daemon"
    );

    // PUT the whole set as JSON: old rule gone, new one in.
    let set = json!({"default": {"rate": 1000}, "rules": [{"name": "udp-2", "proto": "udp", "rate": 2, "per": "1m", "burst": 2}]});
    let a = request(&lab.b, "PUT", "/v1/rules", json(&set), None).unwrap();
    assert_eq!(a.status, 200, "{}", a.body);
    assert_eq!(burst_of(&lab, lab.v4(1), 10), 2);
    assert_eq!(
        request(&lab.b, "DELETE", "/v1/rules/udp-2", None, None)
            .unwrap()
            .status,
        200
    );
    let a = request(
        &lab.b,
        "POST",
        "/v1/rules",
        json(&json!({"name": "kept", "proto": "udp", "rate": 4, "per": "1m", "burst": 4})),
        None,
    )
    .unwrap();
    assert_eq!(a.status, 201);
    stop(d);

    // A restart keeps the API's changes, and a file reload does not undo them.
    let d = start(&lab, &cfg, &[]);
    let names: Vec<Value> = get(&lab.b, "/v1/rules").json()["rules"]
        .as_array()
        .unwrap()
        .iter()
        .map(|r| r["name"].clone())
        .collect();
    assert_eq!(names, vec![json!("kept")]);
    assert_eq!(
        request(&lab.b, "POST", "/v1/reload", None, None)
            .unwrap()
            .status,
        200
    );
    assert_eq!(burst_of(&lab, lab.v4(1), 10), 4);
    let st = get(&lab.b, "/v1/status").json();
    assert_eq!(
        (st["rules"].as_u64(), st["last_reload"]["ok"].as_bool()),
        (Some(1), Some(true)),
        "{st}"
    );
    stop(d);
}

#[test]
fn an_edit_with_if_match_of_rules_changed_since_is_refused_and_changes_nothing() {
    let lab = Lab::new().unwrap();
    let dir = tempfile::tempdir().unwrap();
    let cfg = write(&dir, "rules.toml", "[default]\nrate = 1000\n");
    let d = start(&lab, &cfg, &[]);
    let etag = || {
        let (a, tag) = request_headers(&lab.b, "GET", "/v1/rules", None, &[], "etag").unwrap();
        assert_eq!(a.status, 200, "{}", a.body);
        tag.expect("GET /v1/rules carries an ETag")
    };
    let names = || -> Vec<Value> {
        get(&lab.b, "/v1/rules").json()["rules"]
            .as_array()
            .map(|a| a.iter().map(|r| r["name"].clone()).collect())
            .unwrap_or_default()
    };
    let first = etag();
    assert!(first.starts_with('"') && first.ends_with('"'), "{first}");
    assert_eq!(etag(), first, "the same rules, the same tag");
    let rule = |name: &str| json(&json!({"name": name, "proto": "udp", "rate": 5}));
    let edit_tagged = |method: &str, path: &str, body, tags: &[&str]| {
        let extra: Vec<(&str, &str)> = tags.iter().map(|t| ("If-Match", *t)).collect();
        request_headers(&lab.b, method, path, body, &extra, "etag").unwrap()
    };
    let edit =
        |method: &str, path: &str, body, tag: &str| edit_tagged(method, path, body, &[tag]).0;
    // A tag that matches: applied, and the answer carries the new tag.
    let (a, returned) = edit_tagged("POST", "/v1/rules", rule("a"), &[&first]);
    assert_eq!(a.status, 201, "{}", a.body);
    let second = etag();
    assert_ne!(second, first, "the rules changed");
    assert_eq!(
        returned,
        Some(second.clone()),
        "the tag of the rules it made"
    );
    // Each edit on the old tag: refused, with what to do, and nothing changed.
    let set = json(&json!({"default": {"rate": 1000}, "rules": []}));
    for (method, path, body) in [
        ("POST", "/v1/rules", rule("b")),
        ("PUT", "/v1/rules", set.clone()),
        ("DELETE", "/v1/rules/a", None),
    ] {
        let a = edit(method, path, body, &first);
        assert_eq!(a.status, 412, "{method} {path}: {}", a.body);
        assert!(a.body.contains("GET /v1/rules again"), "{}", a.body);
    }
    assert_eq!((names(), etag()), (vec![json!("a")], second.clone()));
    // A header that holds no tag matches nothing: the edit was meant to be
    // conditional.
    let a = edit("DELETE", "/v1/rules/a", None, ",");
    assert_eq!(a.status, 412, "{}", a.body);
    // A weak tag never matches (strong comparison).
    let a = edit("DELETE", "/v1/rules/a", None, &format!("W/{second}"));
    assert_eq!(a.status, 412, "{}", a.body);
    // The current tag, one of several (in one header, or in several), or
    // `*`: applied.
    let (a, third) = edit_tagged("POST", "/v1/rules", rule("c"), &["\"0\"", &second]);
    assert_eq!(a.status, 201, "{}", a.body);
    let third = third.expect("the new tag");
    let a = edit("DELETE", "/v1/rules/a", None, &format!("\"0\", {third}"));
    assert_eq!(a.status, 200, "{}", a.body);
    let a = edit("PUT", "/v1/rules", set, "*");
    assert_eq!(a.status, 200, "{}", a.body);
    assert!(names().is_empty());
    stop(d);
}

#[test]
fn source_quota_agrees_with_what_the_datapath_lets_through_next() {
    let lab = Lab::new().unwrap();
    let dir = tempfile::tempdir().unwrap();
    // 1 packet/s, burst 3: a token every second, so a slow machine's
    // scheduling delays (tens of ms) cannot refill one unnoticed.
    let cfg = write(&dir, "rules.toml", "[default]\nrate = 1\nburst = 3\n");
    let d = start(&lab, &cfg, &[]);
    let src = lab.v4(1);
    let quota = || {
        let v = get(&lab.b, &format!("/v1/sources/{src}")).json();
        let l = v["limits"].as_array().unwrap().clone();
        assert!(l.len() <= 1, "{v}");
        l.first().cloned()
    };
    assert_eq!(quota(), None, "no state before the first packet");
    assert_eq!(burst_of(&lab, src, 1), 1);
    let q = quota().unwrap();
    assert_eq!(
        (
            q["rule"].as_str(),
            q["limit"].as_u64(),
            q["remaining"].as_u64()
        ),
        (Some("default"), Some(3), Some(2)),
        "{q}"
    );
    assert_eq!(q["retry_after_ms"], 0);
    // Its own bucket (no flood), keyed by the source as `ipv4_prefix` (32)
    // aggregates it.
    assert_eq!(
        (q["charged_to"].as_str(), q["prefix"].as_str()),
        (Some("own"), Some(format!("{src}/32").as_str())),
        "{q}"
    );
    // `remaining` pass, one more drops.
    assert_eq!(burst_of(&lab, src, 3), 2);
    let q = quota().unwrap();
    assert_eq!(q["remaining"], 0, "{q}");
    let wait = q["retry_after_ms"].as_u64().unwrap();
    assert!(
        (1..=1020).contains(&wait),
        "retry after {wait} ms for a 1 s refill: {q}"
    );
    assert!(q["reset_ms"].as_u64().unwrap() >= 2000, "{q}");
    // After `retry_after_ms` one passes, and the next drops.
    std::thread::sleep(Duration::from_millis(wait));
    assert_eq!(burst_of(&lab, src, 2), 1);
    // After `reset_ms` the full limit is back: exactly `limit` pass.
    let q = quota().unwrap();
    std::thread::sleep(Duration::from_millis(q["reset_ms"].as_u64().unwrap()));
    let q = quota().unwrap();
    assert_eq!(q["remaining"], 3, "{q}");
    assert_eq!(burst_of(&lab, src, 5), 3);
    assert_eq!(get(&lab.b, "/v1/sources/not-an-ip").status, 400);
    stop(d);
}

#[test]
fn a_ban_drops_at_once_lifts_after_its_ttl_and_is_kept_across_a_restart() {
    let lab = Lab::new().unwrap();
    let dir = tempfile::tempdir().unwrap();
    let cfg = write(&dir, "rules.toml", "[default]\nrate = 100000\n");
    let d = start(&lab, &cfg, &[]);
    let cidr = format!("{}/32", lab.v4(1));
    assert_eq!(burst_of(&lab, lab.v4(1), 10), 10);

    // Through the CLI, with --json.
    let (status, out) = run_once(
        Some(&lab.b),
        &["ban", &cidr, "--ttl", "3s", "--reason", "test", "--json"],
    )
    .unwrap();
    assert!(status.success(), "{out}");
    let v: Value = serde_json::from_str(out.trim()).unwrap();
    assert_eq!(
        (v["cidr"].as_str(), v["ttl_secs"].as_u64()),
        (Some(cidr.as_str()), Some(3))
    );
    let banned_at = std::time::Instant::now();
    assert_eq!(burst_of(&lab, lab.v4(1), 10), 0, "a ban drops at once");
    let bans = get(&lab.b, "/v1/bans").json();
    assert_eq!(bans[0]["cidr"], cidr.as_str());
    assert_eq!(bans[0]["reason"], "test");
    let (status, out) = run_once(Some(&lab.b), &["bans"]).unwrap();
    assert!(
        status.success() && out.contains(&cidr) && out.contains("test"),
        "{out}"
    );
    // Bad input stops at the CLI (exit 2) before the daemon is asked.
    let (status, out) = run_once(Some(&lab.b), &["ban", &cidr, "--ttl", "400d"]).unwrap();
    assert_eq!(status.code(), Some(2), "{out}");
    assert!(std::fs::read_to_string(&cfg).unwrap().contains("[[ban]]"));
    assert_eq!(
        parse_prometheus(&get(&lab.b, "/metrics").body)["rl_active_bans"],
        1.0
    );
    let stats = get(&lab.b, "/v1/stats").json();
    assert_eq!(
        stats["rules"]["deny"]["dropped_packets"], 10,
        "bans count as deny: {stats}"
    );

    // It lifts by itself (in the kernel at its end, and the daemon checks
    // every second) and leaves the file: not
    // before its TTL (whole seconds: 2 s at least), and within about a
    // second after it (a collector walk may hold changes off a moment).
    std::thread::sleep(Duration::from_millis(1800).saturating_sub(banned_at.elapsed()));
    assert_eq!(burst_of(&lab, lab.v4(1), 10), 0, "lifted before its TTL");
    while burst_of(&lab, lab.v4(1), 10) == 0 {
        assert!(
            banned_at.elapsed() < Duration::from_secs(6),
            "the ban did not lift within 3 s of its TTL:\n{}",
            d.log()
        );
        std::thread::sleep(Duration::from_millis(200));
    }
    // The kernel ends it at its time; the daemon's lift (every second)
    // then takes it out of the file.
    assert_eq!(get(&lab.b, "/v1/bans").json(), json!([]));
    while std::fs::read_to_string(&cfg).unwrap().contains("[[ban]]") {
        assert!(
            banned_at.elapsed() < Duration::from_secs(7),
            "the daemon did not lift the ended ban:\n{}",
            d.log()
        );
        std::thread::sleep(Duration::from_millis(200));
    }

    // A ban outlives a restart; unban lifts it; bad input is refused.
    let a = request(
        &lab.b,
        "POST",
        "/v1/bans",
        json(&json!({"cidr": cidr, "ttl_secs": 600})),
        None,
    )
    .unwrap();
    assert_eq!(a.status, 201, "{}", a.body);
    // A shorter ban of the same prefix (an automated tool's) keeps the
    // longer one's end and reason, and says so.
    let a = request(
        &lab.b,
        "POST",
        "/v1/bans",
        json(&json!({"cidr": cidr, "ttl_secs": 5, "reason": "again"})),
        None,
    )
    .unwrap();
    assert_eq!(a.status, 201, "{}", a.body);
    assert!(
        a.json()["ttl_secs"].as_u64() >= Some(590) && a.json()["reason"] != "again",
        "{}",
        a.body
    );
    let bans = get(&lab.b, "/v1/bans").json();
    assert!(
        bans[0]["ttl_secs"].as_u64() >= Some(590)
            && bans[0].get("reason").is_none_or(|r| r != "again"),
        "{bans}"
    );
    for bad in [
        json!({"cidr": "10.0.0.1/33", "ttl_secs": 5}),
        json!({"cidr": "10.0.0.0/8", "ttl_secs": 0}),
        json!({"cidr": "10.0.0.0/8"}),
        json!({"cidr": "10.0.0.0/8", "ttl_secs": 5, "reason": "x".repeat(1025)}),
        // Most of the Internet, the host's own management included: only
        // with force.
        json!({"cidr": "0.0.0.0/0", "ttl_secs": 5}),
        json!({"cidr": "10.0.0.0/7", "ttl_secs": 5}),
        json!({"cidr": "::/0", "ttl_secs": 5}),
        json!({"cidr": "2001::/15", "ttl_secs": 5}),
    ] {
        let a = request(&lab.b, "POST", "/v1/bans", json(&bad), None).unwrap();
        assert_eq!(a.status, 400, "{bad}: {}", a.body);
    }
    let (status, out) = run_once(Some(&lab.b), &["ban", "0.0.0.0/0", "--ttl", "5s"]).unwrap();
    assert!(status.code() == Some(1) && out.contains("--force"), "{out}");
    stop(d);
    let d = start(&lab, &cfg, &[]);
    assert_eq!(
        burst_of(&lab, lab.v4(1), 10),
        0,
        "the ban survived the restart"
    );
    // A PUT of rules that say nothing of bans (a config manager's file)
    // keeps the bans in force.
    let a = request(
        &lab.b,
        "PUT",
        "/v1/rules",
        Some(("application/toml", b"[default]\nrate = 100001\n".to_vec())),
        None,
    )
    .unwrap();
    assert_eq!(a.status, 200, "{}", a.body);
    assert_eq!(
        burst_of(&lab, lab.v4(1), 10),
        0,
        "kept by a PUT without bans"
    );
    assert_eq!(get(&lab.b, "/v1/bans").json()[0]["cidr"], cidr.as_str());
    let (status, out) = run_once(Some(&lab.b), &["unban", &cidr]).unwrap();
    assert!(status.success(), "{out}");
    assert_eq!(burst_of(&lab, lab.v4(1), 10), 10);
    let a = request(
        &lab.b,
        "DELETE",
        &format!("/v1/bans/{}", cidr.replace('/', "%2F")),
        None,
        None,
    )
    .unwrap();
    assert_eq!(a.status, 404);
    stop(d);
}

#[test]
fn top_sources_and_limited_events_name_the_flooder() {
    let lab = Lab::new().unwrap();
    let dir = tempfile::tempdir().unwrap();
    let cfg = write(&dir, "rules.toml", "[default]\nrate = 100000\n[[rule]]\nname = \"udp-flood\"\nproto = \"udp\"\nrate = 50\nburst = 10\n");
    let d = start(&lab, &cfg, &[]);
    let flooder =
        rl_tests::traffic::flood(&lab.a, lab.v4(1), lab.v4(2), Duration::from_secs(7), None);
    // Sources are scanned every 5 s; the top list covers the last interval.
    let deadline = std::time::Instant::now() + Duration::from_secs(14);
    let top = loop {
        std::thread::sleep(Duration::from_millis(500));
        let top = get(&lab.b, "/v1/sources?top=5").json();
        if top["sources"].as_array().is_some_and(|s| !s.is_empty())
            || std::time::Instant::now() > deadline
        {
            break top;
        }
    };
    let sent = join(flooder).unwrap();
    let first = &top["sources"][0];
    assert_eq!(
        (first["source"].as_str(), first["rule"].as_str()),
        (Some(lab.v4(1).to_string().as_str()), Some("udp-flood")),
        "{top}"
    );
    let (drops, dps, seen) = (
        first["drops"].as_u64().unwrap(),
        first["drops_per_sec"].as_f64().unwrap(),
        first["rate_seen_pps"].as_f64().unwrap(),
    );
    assert!(drops > 0 && dps > 50.0, "{top}");
    assert!(
        seen > dps && seen - dps < 60.0,
        "seen {seen} pkt/s = drops {dps}/s + about 50/s passed: {top}"
    );
    assert!(sent.packets > drops, "{top}");

    // One "limited" event for the flood's one episode, naming source and rule.
    let ev = get(&lab.b, "/v1/events").json();
    let mine: Vec<&Value> = ev["events"]
        .as_array()
        .unwrap()
        .iter()
        .filter(|e| e["source"] == lab.v4(1).to_string().as_str())
        .collect();
    assert_eq!(mine.len(), 1, "{ev}");
    assert_eq!(
        (
            mine[0]["event"].as_str(),
            mine[0]["rule"].as_str(),
            mine[0]["limit_index"].as_u64()
        ),
        (Some("limited"), Some("udp-flood"), Some(0))
    );
    let now_ms = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .unwrap()
        .as_millis() as u64;
    let at = mine[0]["at_unix_ms"].as_u64().unwrap();
    assert!(
        at <= now_ms && now_ms - at < 20_000,
        "event time {at} vs now {now_ms}"
    );
    let m = parse_prometheus(&get(&lab.b, "/metrics").body);
    assert!(m["rl_datapath_events_total{event=\"events\"}"] >= 1.0);

    // Bad queries are 400 with JSON; the CLI shows both lists.
    for q in [
        "/v1/sources?top=0",
        "/v1/sources?top=abc",
        "/v1/events?limit=0",
        "/v1/events?bogus=1",
    ] {
        let a = get(&lab.b, q);
        assert_eq!(a.status, 400, "{q}: {}", a.body);
        assert!(a.json()["error"].is_string());
    }
    for cmd in [["top", "--json"], ["events", "--json"]] {
        let (status, out) = run_once(Some(&lab.b), &cmd).unwrap();
        assert!(status.success(), "{out}");
        serde_json::from_str::<Value>(out.trim()).unwrap_or_else(|e| panic!("{cmd:?}: {e}: {out}"));
    }
    let (_, out) = run_once(Some(&lab.b), &["events"]).unwrap();
    assert!(
        out.contains("limited") && out.contains("udp-flood"),
        "{out}"
    );
    stop(d);
}
