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
        .args(["netns", "exec", &lab.b.name, "setpriv", "--reuid", "65534", "--regid", "65534", "--clear-groups"])
        .arg(binary())
        .args(args)
        .env("RL_RUNTIME_DIR", lab.b.runtime_dir())
        .output()
        .expect("setpriv (util-linux)");
    (out.status.code().unwrap_or(-1), format!("{}{}", String::from_utf8_lossy(&out.stdout), String::from_utf8_lossy(&out.stderr)))
}

/// Every route that changes something, with a body where it needs one.
fn changing_routes() -> Vec<(&'static str, &'static str, Option<Value>)> {
    vec![
        ("PUT", "/v1/rules", Some(json!({"default": {"rate": 1}}))),
        ("POST", "/v1/rules", Some(json!({"name": "x", "rate": 1}))),
        ("DELETE", "/v1/rules/x", None),
        ("POST", "/v1/bans", Some(json!({"cidr": "10.0.0.0/8", "ttl_secs": 60}))),
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
    for cmd in [vec!["status"], vec!["rules"], vec!["stats"], vec!["source", "10.1.2.3"], vec!["reload"]] {
        let (status, out) = run_once(Some(&lab.b), &cmd).unwrap();
        assert!(status.success(), "{cmd:?}: {out}");
        let mut args = cmd.clone();
        args.push("--json");
        let (status, out) = run_once(Some(&lab.b), &args).unwrap();
        let json_start = out.find(['{', '[']).unwrap_or_else(|| panic!("{cmd:?}: no JSON in {out}"));
        assert!(status.success() && serde_json::from_str::<Value>(&out[json_start..]).is_ok(), "{cmd:?} --json: {out}");
    }
    let (_, out) = run_once(Some(&lab.b), &["status"]).unwrap();
    assert!(out.contains("interface:       vb (XDP native"), "{out}");

    // Anyone else: every command refused, the rules unchanged.
    for cmd in [vec!["status"], vec!["ban", "10.0.0.0/8", "--ttl", "1h"], vec!["unban", "10.0.0.0/8"], vec!["reload"], vec!["rules"]] {
        let (code, out) = as_nobody(&lab, &cmd);
        assert_eq!(code, 1, "{cmd:?} as uid 65534: {out}");
        assert!(out.contains("Permission denied") && out.contains("only root may use the admin socket"), "{cmd:?}: {out}");
    }
    assert_eq!(get(&lab.b, "/v1/bans").json().as_array().unwrap().len(), 0, "a ban got through");
    let (status, log) = d.stop(libc::SIGTERM).unwrap();
    assert!(status.success(), "{log}");
    assert!(!lab.b.runtime_dir().join("api.sock").exists(), "the socket is removed on exit");

    // No daemon: one clear error, exit 1.
    let (status, out) = run_once(Some(&lab.b), &["status"]).unwrap();
    assert_eq!(status.code(), Some(1), "{out}");
    assert!(out.contains("cannot reach rl-control at") && out.contains("is rl-control running?"), "{out}");
}

#[test]
fn tcp_is_refused_without_a_private_token_and_guards_every_change_with_it() {
    let lab = Lab::new().unwrap();
    let dir = tempfile::tempdir().unwrap();
    let open = write(&dir, "open.toml", "[default]\nrate = 100\n");
    // TCP without a token: refused, loopback included, before anything is attached.
    let (status, out) = run_once(Some(&lab.b), &["run", "--iface", VB, "--config", open.to_str().unwrap(), "--api", "127.0.0.1:9100"]).unwrap();
    assert_eq!(status.code(), Some(1), "{out}");
    assert!(out.contains("refusing to serve the admin API on 127.0.0.1:9100 without a token"), "{out}");
    assert!(!lab.xdp_attached().unwrap());

    // A token file others can read: refused.
    let token = write(&dir, "token", &format!("{TOKEN}\n"));
    std::fs::set_permissions(&token, std::fs::Permissions::from_mode(0o644)).unwrap();
    let cfg = write(&dir, "rules.toml", &format!(
        "[default]\nrate = 100\n[api]\nlisten = \"127.0.0.1:9100\"\nmetrics_listen = \"127.0.0.1:9101\"\ntoken_file = \"{}\"\n",
        token.display()
    ));
    let (status, out) = run_once(Some(&lab.b), &["run", "--iface", VB, "--config", cfg.to_str().unwrap()]).unwrap();
    assert_eq!(status.code(), Some(1), "{out}");
    assert!(out.contains("can be read by group or others (mode 644)") && out.contains("chmod 600"), "{out}");
    assert!(!lab.xdp_attached().unwrap());

    // The API's port is taken: one clear error, nothing attached.
    std::fs::set_permissions(&token, std::fs::Permissions::from_mode(0o600)).unwrap();
    let squatter = lab.b.run(|| Ok(std::net::TcpListener::bind("127.0.0.1:9100")?)).unwrap();
    let (status, out) = run_once(Some(&lab.b), &["run", "--iface", VB, "--config", cfg.to_str().unwrap()]).unwrap();
    assert_eq!(status.code(), Some(1), "{out}");
    assert!(out.contains("cannot listen on 127.0.0.1:9100 for the admin API"), "{out}");
    assert!(!lab.xdp_attached().unwrap());
    drop(squatter);

    let d = Daemon::serving(&lab, &cfg, &[]).unwrap();
    let tcp = |method: &str, path: &str, body: Option<&Value>, token: Option<&str>| {
        request_tcp(&lab.b, "127.0.0.1:9100", method, path, body.and_then(json), token).unwrap()
    };
    assert_eq!(tcp("GET", "/healthz", None, None).status, 200, "probes need no token");
    assert_eq!(tcp("GET", "/metrics", None, None).status, 200, "scrapers need no token");
    let a = tcp("GET", "/v1/status", None, None);
    assert_eq!(a.status, 401);
    assert!(a.json()["error"].as_str().unwrap().contains("bearer token"));
    for (method, path, body) in changing_routes() {
        assert_eq!(tcp(method, path, body.as_ref(), None).status, 401, "{method} {path} without a token");
        assert_eq!(tcp(method, path, body.as_ref(), Some("wrong")).status, 401, "{method} {path} with a wrong token");
    }
    assert_eq!(tcp("GET", "/v1/status", None, Some(TOKEN)).status, 200);
    assert_eq!(get(&lab.b, "/v1/rules").json()["rules"].as_array().unwrap().len(), 0, "a refused change got through");

    // The CLI over TCP: 401 without the token, fine with it.
    let (status, out) = run_once(Some(&lab.b), &["status", "--api", "127.0.0.1:9100"]).unwrap();
    assert_eq!(status.code(), Some(1), "{out}");
    assert!(out.contains("401") && out.contains("--token-file"), "{out}");
    let (status, out) = run_once(Some(&lab.b), &["status", "--api", "127.0.0.1:9100", "--token-file", token.to_str().unwrap()]).unwrap();
    assert!(status.success() && out.contains("interface:       vb"), "{out}");

    // The metrics listener serves /metrics and /healthz, nothing else.
    let m = |method: &str, path: &str| request_tcp(&lab.b, "127.0.0.1:9101", method, path, None, None).unwrap().status;
    assert_eq!(m("GET", "/metrics"), 200);
    assert_eq!(m("GET", "/healthz"), 200);
    for (method, path, _) in changing_routes() {
        assert_eq!(m(method, path), 404, "{method} {path} on the metrics listener");
    }
    assert_eq!(m("GET", "/v1/status"), 404);
    let log = d.log();
    assert!(!log.contains(TOKEN), "the token appears in the log:\n{log}");
    let (status, log) = d.stop(libc::SIGTERM).unwrap();
    assert!(status.success(), "{log}");
}
