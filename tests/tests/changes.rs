//! Changes and reads against the running daemon: reads never wait for a
//! change (bans churning over 100,000 installed CIDRs), a ban touches only
//! its own entries, and an API edit never overwrites an operator's
//! unapplied edit of the file; write-back follows symlinks and keeps modes.

use std::{
    os::unix::fs::PermissionsExt,
    sync::{
        atomic::{AtomicBool, AtomicU64, Ordering},
        Arc,
    },
    time::{Duration, Instant},
};

use rl_tests::{
    daemon::{run_once, write, Daemon},
    http::{get, json, parse_prometheus, request},
    lab::Lab,
};
use serde_json::json;

fn deny_list(n: u32) -> String {
    let mut t = String::from("[default]\nrate = 1000\n");
    for i in 0..n {
        t += &format!(
            "[[deny]]\ncidr = \"100.{}.{}.{}/32\"\n",
            64 + (i >> 16) % 64,
            (i >> 8) & 255,
            i & 255
        );
    }
    t
}

#[test]
fn reads_never_wait_for_ban_churn_over_100k_cidrs() {
    let lab = Lab::new().unwrap();
    let dir = tempfile::tempdir().unwrap();
    let cfg = write(&dir, "rl.toml", &deny_list(100_000));
    let d = Daemon::serving(&lab, &cfg, &[]).unwrap();

    // Bans added and lifted back to back for as long as the reads run.
    let stop = Arc::new(AtomicBool::new(false));
    let churned = Arc::new(AtomicU64::new(0));
    let churn = {
        let (ns_dir, stop, churned) = (lab.b.runtime_dir(), stop.clone(), churned.clone());
        std::thread::spawn(move || {
            let sock = ns_dir.join("api.sock");
            let mut i = 0u32;
            while !stop.load(Ordering::Relaxed) {
                let cidr = format!("198.18.{}.0/24", i % 256);
                let body = serde_json::to_vec(&json!({"cidr": cidr, "ttl_secs": 600})).unwrap();
                let (code, text) = rl_control::cli::unix_request(
                    &sock,
                    "POST",
                    "/v1/bans",
                    Some(("application/json", &body)),
                    None,
                )
                .unwrap();
                assert_eq!(code, 201, "{text}");
                let path = format!("/v1/bans/{}", cidr.replace('/', "%2F"));
                let (code, text) =
                    rl_control::cli::unix_request(&sock, "DELETE", &path, None, None).unwrap();
                assert_eq!(code, 200, "{text}");
                churned.fetch_add(2, Ordering::Relaxed);
                i += 1;
            }
        })
    };
    std::thread::sleep(Duration::from_millis(300));
    // Reads until several changes went by (a debug build takes about a
    // second per change of a 100,000-CIDR file), at most 60 s.
    let mut ms = Vec::new();
    let started = Instant::now();
    while churned.load(Ordering::Relaxed) < 8 && started.elapsed() < Duration::from_secs(60) {
        for path in ["/metrics", "/v1/stats", "/healthz", "/v1/sources?top=5"] {
            let t = Instant::now();
            assert_eq!(get(&lab.b, path).status, 200, "{path}");
            ms.push(t.elapsed().as_secs_f64() * 1e3);
        }
        std::thread::sleep(Duration::from_millis(5));
    }
    stop.store(true, Ordering::Relaxed);
    churn.join().expect("the churn thread");
    ms.sort_by(|a, b| a.partial_cmp(b).unwrap());
    let p99 = ms[ms.len() * 99 / 100];
    let changes = churned.load(Ordering::Relaxed);
    eprintln!(
        "{} reads during {changes} ban changes: p50 {:.2} ms, p99 {p99:.2} ms, max {:.2} ms",
        ms.len(),
        ms[ms.len() / 2],
        ms[ms.len() - 1]
    );
    assert!(
        changes >= 8,
        "only {changes} ban changes in 60 s: the churn did not run"
    );
    assert!(
        p99 < 5.0,
        "reads waited for changes: p99 {p99:.2} ms over {} reads",
        ms.len()
    );
    let (status, log) = d.stop(libc::SIGTERM).unwrap();
    assert!(status.success(), "{log}");
}

#[test]
fn an_api_edit_never_overwrites_an_unapplied_edit_of_the_file() {
    let lab = Lab::new().unwrap();
    let dir = tempfile::tempdir().unwrap();
    let cfg = write(&dir, "rl.toml", "[default]\nrate = 100\n");
    let d = Daemon::serving(&lab, &cfg, &[]).unwrap(); // --no-watch
                                                       // The operator edits the file; the daemon has not applied it.
    std::thread::sleep(Duration::from_millis(20));
    let edited = "[default]\nrate = 100\n# operator's note\n[[rule]]\nname = \"ops\"\nproto = \"udp\"\nrate = 7\n";
    std::fs::write(&cfg, edited).unwrap();
    let ban = json!({"cidr": "198.51.100.0/24", "ttl_secs": 60});
    let a = request(&lab.b, "POST", "/v1/bans", json(&ban), None).unwrap();
    assert_eq!(a.status, 409, "{}", a.body);
    assert!(
        a.json()["error"]
            .as_str()
            .unwrap()
            .contains("changed on disk since the daemon last read it"),
        "{}",
        a.body
    );
    assert_eq!(
        std::fs::read_to_string(&cfg).unwrap(),
        edited,
        "the operator's edit was overwritten"
    );
    assert_eq!(
        get(&lab.b, "/v1/bans").json().as_array().unwrap().len(),
        0,
        "the refused ban is in force"
    );
    // Applied, the next change goes through and keeps both.
    let (status, out) = run_once(Some(&lab.b), &["reload"]).unwrap();
    assert!(status.success(), "{out}");
    assert_eq!(
        request(&lab.b, "POST", "/v1/bans", json(&ban), None)
            .unwrap()
            .status,
        201
    );
    let text = std::fs::read_to_string(&cfg).unwrap();
    assert!(
        text.contains("# operator's note")
            && text.contains("name = \"ops\"")
            && text.contains("198.51.100.0/24"),
        "{text}"
    );
    let (status, log) = d.stop(libc::SIGTERM).unwrap();
    assert!(status.success(), "{log}");
}

/// A reload that refuses the file does not make it the running one: the
/// next API change still refuses to write over it, a ban that expires
/// meanwhile is lifted in the datapath without writing the file, and a
/// file that cannot be read is a failed reload on record (SIGHUP answers
/// no one: the log and the counters must say it).
#[test]
fn a_refused_reload_leaves_the_edit_unapplied_and_expiring_bans_never_write_over_it() {
    let lab = Lab::new().unwrap();
    let dir = tempfile::tempdir().unwrap();
    let cfg = write(&dir, "rl.toml", "[default]\nrate = 100\n");
    let d = Daemon::serving(&lab, &cfg, &[]).unwrap(); // --no-watch
    let ban = |cidr: &str, ttl: u64| {
        request(
            &lab.b,
            "POST",
            "/v1/bans",
            json(&json!({"cidr": cidr, "ttl_secs": ttl})),
            None,
        )
        .unwrap()
    };
    // 5 s (whole seconds: 4 at least) for the edit, the reload and the
    // refused ban to come first.
    assert_eq!(ban("198.51.100.0/24", 5).status, 201);
    std::thread::sleep(Duration::from_millis(20));
    let edited = format!(
        "{}# operator's half-done edit\n[[rule]]\nname = \"ops\"\nrate = \"fast\"\n",
        std::fs::read_to_string(&cfg).unwrap()
    );
    std::fs::write(&cfg, &edited).unwrap();
    let (status, out) = run_once(Some(&lab.b), &["reload"]).unwrap();
    assert!(!status.success(), "the broken edit was applied: {out}");
    let a = ban("203.0.113.0/24", 60);
    assert_eq!(
        a.status, 409,
        "a refused reload made the file the running one: {}",
        a.body
    );
    // Read and refused already: the answer says to fix the file (a reload
    // would only be refused again).
    assert!(a.body.contains("does not load"), "{}", a.body);
    // And the status still says why the file was refused, and that it was
    // (rl-control status exits 3: not all is well).
    let st = get(&lab.b, "/v1/status").json();
    assert!(
        st["last_reload"]["message"]
            .as_str()
            .is_some_and(|m| m.contains("rl.toml:")),
        "{st}"
    );
    assert_eq!(st["config_file_refused"], true, "{st}");
    let (status, out) = run_once(Some(&lab.b), &["status"]).unwrap();
    assert_eq!(status.code(), Some(3), "{out}");
    assert!(
        out.contains("the config file as last read does not load"),
        "{out}"
    );
    assert_eq!(
        std::fs::read_to_string(&cfg).unwrap(),
        edited,
        "the operator's edit was overwritten"
    );
    // The first ban's time is up: lifted (the running rules hold no ban),
    // the file left as the operator wrote it, no failed change recorded.
    assert_eq!(
        get(&lab.b, "/v1/rules").json()["bans"]
            .as_array()
            .unwrap()
            .len(),
        1,
        "the ban expired before the test's steps"
    );
    let deadline = Instant::now() + Duration::from_secs(10);
    let st = loop {
        let st = get(&lab.b, "/v1/status").json();
        if st["last_reload"]["trigger"]
            .as_str()
            .unwrap()
            .starts_with("ban(s) expired")
            || Instant::now() > deadline
        {
            break st;
        }
        std::thread::sleep(Duration::from_millis(100));
    };
    assert!(
        st["last_reload"]["trigger"]
            .as_str()
            .unwrap()
            .starts_with("ban(s) expired (lifted, the config file not written"),
        "{st}"
    );
    assert_eq!(st["last_reload"]["ok"], true, "{st}");
    assert!(
        get(&lab.b, "/v1/rules").json()["bans"]
            .as_array()
            .unwrap()
            .is_empty(),
        "the expired ban is still in the running rules"
    );
    assert_eq!(
        std::fs::read_to_string(&cfg).unwrap(),
        edited,
        "lifting a ban wrote over the operator's edit"
    );
    let failed = |lab: &Lab| {
        parse_prometheus(&get(&lab.b, "/metrics").body)["rl_reloads_total{result=\"failed\"}"]
    };
    assert_eq!(
        failed(&lab),
        2.0,
        "the reload and the 409 ban, nothing else"
    );
    // The file gone: a reload by SIGHUP fails on record.
    std::fs::rename(&cfg, dir.path().join("moved.toml")).unwrap();
    d.signal(libc::SIGHUP);
    std::thread::sleep(Duration::from_millis(500));
    assert_eq!(failed(&lab), 3.0, "an unreadable file is a failed reload");
    let st = get(&lab.b, "/v1/status").json();
    assert!(
        st["last_reload"]["message"]
            .as_str()
            .unwrap()
            .contains("cannot read"),
        "{st}"
    );
    assert!(d.log().contains("SIGHUP: reload rejected"), "{}", d.log());
    let (status, log) = d.stop(libc::SIGTERM).unwrap();
    assert!(status.success(), "{log}");
}

#[test]
fn write_back_follows_a_symlink_and_keeps_the_file_mode() {
    let lab = Lab::new().unwrap();
    let dir = tempfile::tempdir().unwrap();
    let real = write(&dir, "real.toml", "[default]\nrate = 100\n");
    std::fs::set_permissions(&real, std::fs::Permissions::from_mode(0o640)).unwrap();
    let link = dir.path().join("rl.toml");
    std::os::unix::fs::symlink(&real, &link).unwrap();
    // What a change killed mid-way leaves (pid 4194305 is above any
    // pid_max): removed at start; one of a live process is not.
    let stale = dir.path().join(".real.toml.rl-tmp.4194305.0");
    let live = dir
        .path()
        .join(format!(".real.toml.rl-tmp.{}.0", std::process::id()));
    std::fs::write(&stale, "half").unwrap();
    std::fs::write(&live, "in use").unwrap();
    let d = Daemon::serving(&lab, &link, &[]).unwrap();
    assert!(!stale.exists(), "a killed change's temporary file was left");
    assert!(live.exists(), "a live process's temporary file was removed");
    std::fs::remove_file(&live).unwrap();
    let a = request(
        &lab.b,
        "POST",
        "/v1/bans",
        json(&json!({"cidr": "203.0.113.0/24", "ttl_secs": 60})),
        None,
    )
    .unwrap();
    assert_eq!(a.status, 201, "{}", a.body);
    assert!(
        std::fs::symlink_metadata(&link)
            .unwrap()
            .file_type()
            .is_symlink(),
        "the symlink was replaced by a file"
    );
    assert!(
        std::fs::read_to_string(&real)
            .unwrap()
            .contains("203.0.113.0/24"),
        "the real file did not get the ban"
    );
    assert_eq!(
        std::fs::metadata(&real).unwrap().permissions().mode() & 0o777,
        0o640,
        "the mode changed"
    );
    let leftovers: Vec<_> = std::fs::read_dir(dir.path())
        .unwrap()
        .flatten()
        .filter(|e| e.file_name().to_string_lossy().contains("rl-tmp"))
        .collect();
    assert!(leftovers.is_empty(), "temporary files left: {leftovers:?}");
    let (status, log) = d.stop(libc::SIGTERM).unwrap();
    assert!(status.success(), "{log}");
}

/// What the datapath was made with changes only with a fresh datapath: a
/// reload that changes the prefix cells' lengths (a source limited in its
/// /24 cell would find a fresh /16 one) or the tables' sizes (the status
/// would read a capacity the tables do not have) is refused with what to
/// do, and the running settings stay in force; so is one that changes
/// what is read at start only (pin_dir, interfaces). A change of the
/// aggregation prefixes applies, and warns that keys start afresh.
#[test]
fn a_reload_that_changes_the_prefix_cells_the_tables_or_the_pins_is_refused() {
    let lab = Lab::new().unwrap();
    let dir = tempfile::tempdir().unwrap();
    let cfg = write(&dir, "rl.toml", "[default]\nrate = 100\n");
    let d = Daemon::serving(&lab, &cfg, &[]).unwrap(); // --no-watch
    std::fs::write(
        &cfg,
        "[datapath]\nflood_prefix_v4 = 16\n[default]\nrate = 100\n",
    )
    .unwrap();
    let (status, out) = run_once(Some(&lab.b), &["reload"]).unwrap();
    assert!(!status.success(), "{out}");
    assert!(
        out.contains("datapath.flood_prefix_v4/v6 = 16/48 differ from the running 24/48"),
        "{out}"
    );
    let r = request(&lab.b, "POST", "/v1/reload", None, None).unwrap();
    assert_eq!(r.status, 422, "{}", r.body);
    for (toml, want) in [
        ("max_sources = 2048", "datapath.max_sources/flood_prefixes = 2048/65536 differ from the running 1048576/65536"),
        ("flood_prefixes = 1024", "datapath.max_sources/flood_prefixes = 1048576/1024 differ from the running 1048576/65536"),
    ] {
        std::fs::write(&cfg, format!("[datapath]\n{toml}\n[default]\nrate = 100\n")).unwrap();
        let (status, out) = run_once(Some(&lab.b), &["reload"]).unwrap();
        assert!(!status.success(), "{toml}: {out}");
        assert!(out.contains(want) && out.contains("rl-control detach"), "{toml}: {out}");
        let s: serde_json::Value = serde_json::from_str(&request(&lab.b, "GET", "/v1/status", None, None).unwrap().body).unwrap();
        assert_eq!(s["pressure"]["bucket_capacity"], 1048576, "{toml}: the refused size reached the status: {s}");
    }
    // Read at start only: a reload would have said "reloaded" and applied
    // nothing.
    for toml in ["pin_dir = \"/tmp/elsewhere\"", "interfaces = [\"lo\"]"] {
        std::fs::write(&cfg, format!("[datapath]\n{toml}\n[default]\nrate = 100\n")).unwrap();
        let (status, out) = run_once(Some(&lab.b), &["reload"]).unwrap();
        assert!(!status.success(), "{toml}: {out}");
        assert!(
            out.contains(
                "datapath.pin_dir and datapath.interfaces are read when the daemon starts"
            ) && out.contains("restart the daemon"),
            "{toml}: {out}"
        );
    }
    // [api] too: its listeners and token are set up at start (a token
    // rotated by a reload would have left the old one working).
    std::fs::write(
        &cfg,
        "[default]\nrate = 100\n[api]\nmetrics_listen = \"127.0.0.1:9101\"\n",
    )
    .unwrap();
    let (status, out) = run_once(Some(&lab.b), &["reload"]).unwrap();
    assert!(
        !status.success() && out.contains("[api] differs from the running daemon's"),
        "{out}"
    );
    // And [l7]'s listeners, threads and gRPC headers (a reload said
    // "reloaded", showed them in /v1/config, and applied nothing).
    for toml in [
        "draft_headers = true",
        "grpc_threads = 1",
        "http_listen = \"127.0.0.1:8099\"",
    ] {
        std::fs::write(&cfg, format!("[default]\nrate = 100\n[l7]\n{toml}\n")).unwrap();
        let (status, out) = run_once(Some(&lab.b), &["reload"]).unwrap();
        assert!(
            !status.success()
                && out.contains(
                    "[l7] grpc_listen, http_listen, grpc_threads, draft_headers or max_connections differ"
                ),
            "{toml}: {out}"
        );
    }
    std::fs::write(&cfg, "[default]\nrate = 100\n[l7]\nmax_keys = 1000\n").unwrap();
    let (status, out) = run_once(Some(&lab.b), &["reload"]).unwrap();
    assert!(status.success(), "max_keys reloads: {out}");
    // The aggregation prefixes apply, with a warning that keys start afresh.
    std::fs::write(
        &cfg,
        "[datapath]\nipv4_prefix = 24\n[default]\nrate = 100\n",
    )
    .unwrap();
    let (status, out) = run_once(Some(&lab.b), &["reload"]).unwrap();
    assert!(status.success(), "{out}");
    // Restored, the file reloads.
    std::fs::write(&cfg, "[default]\nrate = 100\n").unwrap();
    let (status, out) = run_once(Some(&lab.b), &["reload"]).unwrap();
    assert!(status.success(), "{out}");
    let (status, log) = d.stop(libc::SIGTERM).unwrap();
    assert!(status.success(), "{log}");
    assert!(
        log.contains("datapath.ipv4_prefix/ipv6_prefix change from /32//64 to /24//64")
            && log.contains("full burst"),
        "{log}"
    );
}

/// A read-only tmpfs holding the rule file, unmounted on drop.
struct ReadOnlyDir(tempfile::TempDir);

impl ReadOnlyDir {
    fn with(name: &str, text: &str) -> (ReadOnlyDir, std::path::PathBuf) {
        let dir = tempfile::tempdir().unwrap();
        let at = dir.path().to_str().unwrap().to_string();
        let mount = |args: &[&str]| {
            assert!(
                std::process::Command::new("mount")
                    .args(args)
                    .status()
                    .unwrap()
                    .success(),
                "mount {args:?}"
            )
        };
        mount(&["-t", "tmpfs", "-o", "size=1m", "tmpfs", &at]);
        let file = dir.path().join(name);
        std::fs::write(&file, text).unwrap();
        mount(&["-o", "remount,ro", &at]);
        (ReadOnlyDir(dir), file)
    }
}

impl Drop for ReadOnlyDir {
    fn drop(&mut self) {
        let _ = std::process::Command::new("umount")
            .arg(self.0.path())
            .status();
    }
}

/// A ban expiring while the rule file cannot be written (read-only mount,
/// full disk) is lifted in the datapath once, with the failure on record
/// once: not tried again, failed and put back every second.
#[test]
fn an_expired_ban_in_a_file_that_cannot_be_written_is_lifted_once() {
    let lab = Lab::new().unwrap();
    let until = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .unwrap()
        .as_secs()
        + 3;
    let (_ro, cfg) = ReadOnlyDir::with(
        "rl.toml",
        &format!("[default]\nrate = 100\n[[ban]]\ncidr = \"198.51.100.0/24\"\nuntil = {until}\n"),
    );
    let d = Daemon::serving(&lab, &cfg, &[]).unwrap();
    assert_eq!(
        get(&lab.b, "/v1/rules").json()["bans"]
            .as_array()
            .unwrap()
            .len(),
        1
    );
    let failed = |lab: &Lab| {
        parse_prometheus(&get(&lab.b, "/metrics").body)["rl_reloads_total{result=\"failed\"}"]
    };
    let deadline = Instant::now() + Duration::from_secs(10);
    while !get(&lab.b, "/v1/rules").json()["bans"]
        .as_array()
        .unwrap()
        .is_empty()
    {
        assert!(
            Instant::now() < deadline,
            "the expired ban was never lifted:\n{}",
            d.log()
        );
        std::thread::sleep(Duration::from_millis(100));
    }
    let st = get(&lab.b, "/v1/status").json();
    assert!(
        st["last_reload"]["trigger"]
            .as_str()
            .unwrap()
            .contains("writing it failed"),
        "{st}"
    );
    assert_eq!(st["last_reload"]["ok"], true, "{st}");
    // Some passes of the expiry job later: the one failed write, no more.
    std::thread::sleep(Duration::from_secs(3));
    assert_eq!(failed(&lab), 1.0, "{}", d.log());
    assert_eq!(
        d.log()
            .matches(&format!("cannot write {}", cfg.display()))
            .count(),
        1,
        "{}",
        d.log()
    );
    // An API change on that file: refused before anything is installed.
    let a = request(
        &lab.b,
        "POST",
        "/v1/bans",
        json(&json!({"cidr": "203.0.113.0/24", "ttl_secs": 60})),
        None,
    )
    .unwrap();
    assert_eq!(a.status, 500, "{}", a.body);
    assert!(a.body.contains("nothing changed"), "{}", a.body);
    assert!(get(&lab.b, "/v1/rules").json()["bans"]
        .as_array()
        .unwrap()
        .is_empty());
    let (status, log) = d.stop(libc::SIGTERM).unwrap();
    assert!(status.success(), "{log}");
}

/// A file whose bans are an inline list (`ban = [{ ... }]`, which the
/// loader takes) is edited like one of `[[ban]]` tables: a ban added
/// through the API is written, and an expired inline ban is lifted (it
/// stayed in force, silently, while every read said it was gone).
#[test]
fn inline_bans_take_api_edits_and_expire() {
    let lab = Lab::new().unwrap();
    let dir = tempfile::tempdir().unwrap();
    let now = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .unwrap()
        .as_secs();
    let text = format!(
        "ban = [{{ cidr = \"198.51.100.0/24\", until = {} }}]\n[default]\nrate = 100\n",
        now + 3
    );
    let cfg = write(&dir, "rl.toml", &text);
    let d = Daemon::serving(&lab, &cfg, &[]).unwrap();
    let a = request(
        &lab.b,
        "POST",
        "/v1/bans",
        json(&json!({"cidr": "203.0.113.0/24", "ttl_secs": 600})),
        None,
    )
    .unwrap();
    assert_eq!(a.status, 201, "{}", a.body);
    let deadline = Instant::now() + Duration::from_secs(8);
    loop {
        let file = std::fs::read_to_string(&cfg).unwrap();
        let bans = get(&lab.b, "/v1/bans").json();
        if !file.contains("198.51.100.0/24") {
            assert!(file.contains("203.0.113.0/24"), "{file}");
            assert_eq!(bans.as_array().map(Vec::len), Some(1), "{bans}");
            break;
        }
        assert!(
            Instant::now() < deadline,
            "the expired inline ban was not lifted:\n{file}\n{}",
            d.log()
        );
        std::thread::sleep(Duration::from_millis(200));
    }
    let (status, log) = d.stop(libc::SIGTERM).unwrap();
    assert!(status.success(), "{log}");
    assert!(!log.contains("expired bans cannot be lifted"), "{log}");
}
