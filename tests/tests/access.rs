//! Only root changes the limiter: the admin API listens on a Unix socket
//! (mode 0600) in the runtime directory; TCP needs a token, loopback
//! included; a metrics-only listener serves scrapers. Tested against the
//! running daemon, as root and as uid 65534.

use std::os::unix::fs::PermissionsExt;

use rl_tests::{
    daemon::{binary, run_once, write, Daemon},
    http::{get, json, request_tcp},
    lab::{Lab, VB},
};
use serde_json::{json, Value};

const TOKEN: &str = "s3cret-token";

/// `rl-control args…` in the lab's protected namespace as uid/gid 65534.
fn as_nobody(lab: &Lab, args: &[&str]) -> (i32, String) {
    let out = std::process::Command::new("ip")
        .args([
            "netns",
            "exec",
            &lab.b.name,
            "setpriv",
            "--reuid",
            "65534",
            "--regid",
            "65534",
            "--clear-groups",
        ])
        .arg(binary())
        .args(args)
        .env("RL_RUNTIME_DIR", lab.b.runtime_dir())
        .output()
        .expect("setpriv (util-linux)");
    (
        out.status.code().unwrap_or(-1),
        format!(
            "{}{}",
            String::from_utf8_lossy(&out.stdout),
            String::from_utf8_lossy(&out.stderr)
        ),
    )
}

/// Every route that changes something, with a body where it needs one.
fn changing_routes() -> Vec<(&'static str, &'static str, Option<Value>)> {
    vec![
        ("PUT", "/v1/rules", Some(json!({"default": {"rate": 1}}))),
        ("POST", "/v1/rules", Some(json!({"name": "x", "rate": 1}))),
        ("DELETE", "/v1/rules/x", None),
        (
            "POST",
            "/v1/bans",
            Some(json!({"cidr": "10.0.0.0/8", "ttl_secs": 60})),
        ),
        ("DELETE", "/v1/bans/10.0.0.0%2F8", None),
        ("POST", "/v1/reload", None),
    ]
}

#[test]
fn the_socket_is_root_only_and_tcp_needs_a_token() {
    let lab = Lab::new().unwrap();
    let dir = tempfile::tempdir().unwrap();
    let cfg = write(&dir, "rules.toml", "[default]\nrate = 100\n");
    let d = Daemon::serving(&lab, &cfg, &[]).unwrap();
    let sock = lab.b.runtime_dir().join("api.sock");
    let mode = std::fs::metadata(&sock).unwrap().permissions().mode() & 0o777;
    assert_eq!(mode, 0o600, "the admin socket's mode");

    // Root's CLI works over the socket, no token.
    for cmd in [
        vec!["status"],
        vec!["rules"],
        vec!["stats"],
        vec!["source", "10.1.2.3"],
        vec!["reload"],
    ] {
        let (status, out) = run_once(Some(&lab.b), &cmd).unwrap();
        assert!(status.success(), "{cmd:?}: {out}");
        let mut args = cmd.clone();
        args.push("--json");
        let (status, out) = run_once(Some(&lab.b), &args).unwrap();
        let json_start = out
            .find(['{', '['])
            .unwrap_or_else(|| panic!("{cmd:?}: no JSON in {out}"));
        assert!(
            status.success() && serde_json::from_str::<Value>(&out[json_start..]).is_ok(),
            "{cmd:?} --json: {out}"
        );
    }
    let (_, out) = run_once(Some(&lab.b), &["status"]).unwrap();
    assert!(out.contains("interface:       vb (XDP native"), "{out}");

    // Anyone else: every command refused, the rules unchanged.
    for cmd in [
        vec!["status"],
        vec!["ban", "10.0.0.0/8", "--ttl", "1h"],
        vec!["unban", "10.0.0.0/8"],
        vec!["reload"],
        vec!["rules"],
    ] {
        let (code, out) = as_nobody(&lab, &cmd);
        assert_eq!(code, 1, "{cmd:?} as uid 65534: {out}");
        assert!(
            out.contains("Permission denied") && out.contains("only root may use the admin socket"),
            "{cmd:?}: {out}"
        );
    }
    assert_eq!(
        get(&lab.b, "/v1/bans").json().as_array().unwrap().len(),
        0,
        "a ban got through"
    );
    let (status, log) = d.stop(libc::SIGTERM).unwrap();
    assert!(status.success(), "{log}");
    assert!(
        !lab.b.runtime_dir().join("api.sock").exists(),
        "the socket is removed on exit"
    );

    // No daemon: one clear error, exit 1.
    let (status, out) = run_once(Some(&lab.b), &["status"]).unwrap();
    assert_eq!(status.code(), Some(1), "{out}");
    assert!(
        out.contains("cannot reach rl-control at") && out.contains("is rl-control running?"),
        "{out}"
    );
}

#[test]
fn tcp_is_refused_without_a_private_token_and_guards_every_change_with_it() {
    let lab = Lab::new().unwrap();
    let dir = tempfile::tempdir().unwrap();
    let open = write(&dir, "open.toml", "[default]\nrate = 100\n");
    // TCP without a token: refused, loopback included, before anything is attached.
    let (status, out) = run_once(
        Some(&lab.b),
        &[
            "run",
            "--iface",
            VB,
            "--config",
            open.to_str().unwrap(),
            "--api",
            "127.0.0.1:9100",
        ],
    )
    .unwrap();
    assert_eq!(status.code(), Some(1), "{out}");
    assert!(
        out.contains("refusing to serve the admin API on 127.0.0.1:9100 without a token"),
        "{out}"
    );
    assert!(!lab.xdp_attached().unwrap());

    // A token file others can read: refused.
    let token = write(&dir, "token", &format!("{TOKEN}\n"));
    std::fs::set_permissions(&token, std::fs::Permissions::from_mode(0o644)).unwrap();
    let cfg = write(&dir, "rules.toml", &format!(
        "[default]\nrate = 100\n[api]\nlisten = \"127.0.0.1:9100\"\nmetrics_listen = \"127.0.0.1:9101\"\ntoken_file = \"{}\"\n",
        token.display()
    ));
    let (status, out) = run_once(
        Some(&lab.b),
        &["run", "--iface", VB, "--config", cfg.to_str().unwrap()],
    )
    .unwrap();
    assert_eq!(status.code(), Some(1), "{out}");
    assert!(
        out.contains("can be read or written by group or others (mode 644)")
            && out.contains("chmod 600"),
        "{out}"
    );
    assert!(!lab.xdp_attached().unwrap());
    // One others may write (they could put their own token in), or one
    // another user owns (whoever owns it holds the API): refused too.
    std::fs::set_permissions(&token, std::fs::Permissions::from_mode(0o622)).unwrap();
    let (status, out) = run_once(
        Some(&lab.b),
        &["run", "--iface", VB, "--config", cfg.to_str().unwrap()],
    )
    .unwrap();
    assert_eq!(status.code(), Some(1), "{out}");
    assert!(
        out.contains("can be read or written by group or others (mode 622)"),
        "{out}"
    );
    std::fs::set_permissions(&token, std::fs::Permissions::from_mode(0o600)).unwrap();
    std::os::unix::fs::chown(&token, Some(65534), None).unwrap();
    let (status, out) = run_once(
        Some(&lab.b),
        &["run", "--iface", VB, "--config", cfg.to_str().unwrap()],
    )
    .unwrap();
    assert_eq!(status.code(), Some(1), "{out}");
    assert!(
        out.contains("is owned by uid 65534, not this daemon's user (0)"),
        "{out}"
    );
    assert!(!lab.xdp_attached().unwrap());
    std::os::unix::fs::chown(&token, Some(0), None).unwrap();

    // The API's port is taken: one clear error, nothing attached.
    std::fs::set_permissions(&token, std::fs::Permissions::from_mode(0o600)).unwrap();
    let squatter = lab
        .b
        .run(|| Ok(std::net::TcpListener::bind("127.0.0.1:9100")?))
        .unwrap();
    let (status, out) = run_once(
        Some(&lab.b),
        &["run", "--iface", VB, "--config", cfg.to_str().unwrap()],
    )
    .unwrap();
    assert_eq!(status.code(), Some(1), "{out}");
    assert!(
        out.contains("cannot listen on 127.0.0.1:9100 for the admin API"),
        "{out}"
    );
    assert!(!lab.xdp_attached().unwrap());
    drop(squatter);

    let d = Daemon::serving(&lab, &cfg, &[]).unwrap();
    let tcp = |method: &str, path: &str, body: Option<&Value>, token: Option<&str>| {
        request_tcp(
            &lab.b,
            "127.0.0.1:9100",
            method,
            path,
            body.and_then(json),
            token,
        )
        .unwrap()
    };
    assert_eq!(
        tcp("GET", "/healthz", None, None).status,
        200,
        "probes need no token"
    );
    assert_eq!(
        tcp("GET", "/metrics", None, None).status,
        200,
        "scrapers need no token"
    );
    let a = tcp("GET", "/v1/status", None, None);
    assert_eq!(a.status, 401);
    assert!(a.json()["error"].as_str().unwrap().contains("bearer token"));
    for (method, path, body) in changing_routes() {
        assert_eq!(
            tcp(method, path, body.as_ref(), None).status,
            401,
            "{method} {path} without a token"
        );
        assert_eq!(
            tcp(method, path, body.as_ref(), Some("wrong")).status,
            401,
            "{method} {path} with a wrong token"
        );
    }
    assert_eq!(tcp("GET", "/v1/status", None, Some(TOKEN)).status, 200);
    assert_eq!(
        get(&lab.b, "/v1/rules").json()["rules"]
            .as_array()
            .unwrap()
            .len(),
        0,
        "a refused change got through"
    );

    // The CLI over TCP: 401 without the token, fine with it.
    let (status, out) = run_once(Some(&lab.b), &["status", "--api", "127.0.0.1:9100"]).unwrap();
    assert_eq!(status.code(), Some(1), "{out}");
    assert!(out.contains("401") && out.contains("--token-file"), "{out}");
    let (status, out) = run_once(
        Some(&lab.b),
        &[
            "status",
            "--api",
            "127.0.0.1:9100",
            "--token-file",
            token.to_str().unwrap(),
        ],
    )
    .unwrap();
    assert!(
        status.success() && out.contains("interface:       vb"),
        "{out}"
    );

    // The metrics listener serves /metrics and /healthz, nothing else.
    let m = |method: &str, path: &str| {
        request_tcp(&lab.b, "127.0.0.1:9101", method, path, None, None)
            .unwrap()
            .status
    };
    assert_eq!(m("GET", "/metrics"), 200);
    assert_eq!(m("GET", "/healthz"), 200);
    for (method, path, _) in changing_routes() {
        assert_eq!(
            m(method, path),
            404,
            "{method} {path} on the metrics listener"
        );
    }
    assert_eq!(m("GET", "/v1/status"), 404);
    // Whoever reaches the port cannot take the daemon's open files: past
    // 256 open connections a new one is closed at once, and served again
    // once some close.
    let mut idle = lab
        .b
        .run(|| {
            (0..256)
                .map(|_| Ok(std::net::TcpStream::connect("127.0.0.1:9101")?))
                .collect::<anyhow::Result<Vec<_>>>()
        })
        .unwrap();
    std::thread::sleep(std::time::Duration::from_millis(300));
    let over = request_tcp(&lab.b, "127.0.0.1:9101", "GET", "/metrics", None, None);
    assert!(
        over.as_ref().map_or(true, |a| a.status != 200),
        "a connection past the cap was served"
    );
    assert_eq!(
        tcp("GET", "/healthz", None, None).status,
        200,
        "the admin port has its own cap"
    );
    idle.truncate(200);
    std::thread::sleep(std::time::Duration::from_millis(300));
    assert_eq!(m("GET", "/metrics"), 200, "served again once some closed");
    drop(idle);
    let log = d.log();
    assert!(
        log.contains("256 connections open: closing new ones"),
        "{log}"
    );
    assert!(!log.contains(TOKEN), "the token appears in the log:\n{log}");
    let (status, log) = d.stop(libc::SIGTERM).unwrap();
    assert!(status.success(), "{log}");
}

/// The capabilities `dist/rl-control.service` grants, as `setpriv`'s
/// `--bounding-set` argument (`-all,+bpf,+net_admin,…`).
fn unit_capabilities() -> String {
    let unit = std::fs::read_to_string(concat!(
        env!("CARGO_MANIFEST_DIR"),
        "/../dist/rl-control.service"
    ))
    .unwrap();
    let line = unit
        .lines()
        .find_map(|l| l.strip_prefix("CapabilityBoundingSet="))
        .expect("the unit sets CapabilityBoundingSet");
    let caps: Vec<String> = line
        .split_whitespace()
        .map(|c| format!("+{}", c.trim_start_matches("CAP_").to_lowercase()))
        .collect();
    assert!(caps.len() >= 3, "{line}");
    format!("-all,{}", caps.join(","))
}

/// The shipped service runs as root with only the unit's capabilities:
/// with them the daemon loads, attaches and pins, and its readers (the
/// collector's walk and flood reading, the sources and cells scans, which
/// open the maps a handle of their own) work too, also after a restart
/// that adopts the pins.
#[test]
fn the_service_units_capabilities_run_everything() {
    let lab = Lab::new().unwrap();
    let pins = rl_tests::lab::BpfFs::new().unwrap();
    let dir = tempfile::tempdir().unwrap();
    let cfg = write(&dir, "rules.toml", "[datapath]\nmax_sources = 1024\n[default]\nrate = 100\n[[rule]]\nname = \"slow\"\nproto = \"any\"\nrate = 1\nper = \"1h\"\n");
    let caps = unit_capabilities();
    let wrapper = [
        "setpriv",
        "--bounding-set",
        caps.as_str(),
        "--inh-caps=-all",
    ];
    let args = [
        "run",
        "--iface",
        VB,
        "--config",
        cfg.to_str().unwrap(),
        "--no-watch",
        "--pin-dir",
        pins.arg(),
    ];
    for round in ["first start", "restart on the pins"] {
        let mut d = Daemon::spawn_under(&lab.b, &wrapper, &args).unwrap();
        d.wait_for("admin API on", std::time::Duration::from_secs(20))
            .unwrap();
        let pid = d.pid();
        let status = std::fs::read_to_string(format!("/proc/{pid}/status")).unwrap();
        let eff = status
            .lines()
            .find_map(|l| l.strip_prefix("CapEff:"))
            .unwrap()
            .trim()
            .to_string();
        assert_ne!(
            eff, "000001ffffffffff",
            "{round}: setpriv left every capability"
        );
        assert_eq!(
            u64::from_str_radix(&eff, 16).unwrap() & (1 << 21),
            0,
            "{round}: CAP_SYS_ADMIN is not the unit's"
        );
        rl_tests::traffic::join(rl_tests::traffic::flood(
            &lab.a,
            lab.v4(1),
            lab.v4(2),
            std::time::Duration::from_millis(300),
            None,
        ))
        .unwrap();
        let start = std::time::Instant::now();
        loop {
            let v = get(&lab.b, "/v1/status").json();
            let h = &v["pressure"]["collector"];
            let ok = |r: &Value| r["last_ok_unix_ms"].is_u64() && r.get("error").is_none();
            if ok(&h["walk"])
                && ok(&h["flood_reading"])
                && ok(&h["events"])
                && v["pressure"]["buckets_ipv4"].as_u64() > Some(0)
            {
                break;
            }
            assert!(
                start.elapsed() < std::time::Duration::from_secs(10),
                "{round}: the collector's readers fail: {h}\n{}",
                d.log()
            );
            std::thread::sleep(std::time::Duration::from_millis(200));
        }
        let s = get(&lab.b, &format!("/v1/sources/{}", lab.v4(1)));
        assert_eq!(s.status, 200, "{round}: {}", s.body);
        assert!(
            s.body.contains("\"own\""),
            "{round}: the sender's own bucket is not found: {}",
            s.body
        );
        let start = std::time::Instant::now();
        while !get(&lab.b, "/v1/sources?top=5")
            .body
            .contains(&lab.v4(1).to_string())
        {
            assert!(
                start.elapsed() < std::time::Duration::from_secs(12),
                "{round}: the sources scan never lists the sender:\n{}",
                d.log()
            );
            std::thread::sleep(std::time::Duration::from_millis(300));
        }
        let c = get(&lab.b, "/v1/cells");
        assert_eq!(c.status, 200, "{round}: {}", c.body);
        let (status, log) = d.stop(libc::SIGTERM).unwrap();
        assert!(status.success(), "{round}: {log}");
        assert!(!log.contains("Operation not permitted"), "{round}: {log}");
    }
    // Not root: refused with why, not "nothing to detach" and exit 0,
    // whether the pin directory (0700, as /sys/fs/bpf is) or only the
    // interface's own is out of reach.
    for mode in [0o755, 0o700] {
        std::fs::set_permissions(pins.arg(), std::fs::Permissions::from_mode(mode)).unwrap();
        let (code, out) = as_nobody(&lab, &["detach", "--iface", VB, "--pin-dir", pins.arg()]);
        assert_eq!(code, 1, "{mode:o}: {out}");
        assert!(
            out.contains("permission denied while reading")
                && out.contains("run rl-control")
                && out.contains("as root"),
            "{mode:o}: {out}"
        );
        assert!(lab.xdp_attached().unwrap(), "{mode:o}: still attached");
    }
    let (status, out) = run_once(
        Some(&lab.b),
        &["detach", "--iface", VB, "--pin-dir", pins.arg()],
    )
    .unwrap();
    assert!(
        status.success() && out.contains("detached rl from"),
        "{out}"
    );
    assert!(!lab.xdp_attached().unwrap());
}
