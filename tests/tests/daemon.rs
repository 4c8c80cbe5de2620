//! The real `rl-control` binary: start, limit, signals, reload, and every bad
//! input the operator can give it. Bad input must produce one clear line, a
//! non-zero exit, and leave nothing attached.

use std::time::Duration;

use rl_tests::{
    daemon::{final_counter, run_once, write, Daemon},
    expected_passed,
    lab::{Lab, VB},
    tolerance,
    traffic::{flood, join, Receiver},
};

const ATTACHED: &str = "attached:";
const START: Duration = Duration::from_secs(20);

/// The error line of a failed run: exactly one line starting with `error: `.
fn error_line(out: &str) -> String {
    let errors: Vec<&str> = out.lines().filter(|l| l.starts_with("error: ")).collect();
    assert_eq!(
        errors.len(),
        1,
        "expected exactly one error line in:\n{out}"
    );
    errors[0].to_string()
}

/// The rule file rl ships (`dist/rules.toml`, what the unit starts with)
/// passes `check-config` and starts the daemon as it is, serving its
/// read-only metrics listener. (It served the admin API over TCP without
/// a token, which the daemon refuses: the unit never started.)
#[test]
fn the_shipped_rule_file_starts_the_daemon_as_it_is() {
    let lab = Lab::new().unwrap();
    let dir = tempfile::tempdir().unwrap();
    let cfg = write(&dir, "rules.toml", include_str!("../../dist/rules.toml"));
    let (status, out) = run_once(None, &["check-config", cfg.to_str().unwrap()]).unwrap();
    assert!(status.success(), "{out}");
    let d = Daemon::serving(&lab, &cfg, &[]).unwrap();
    let health =
        rl_tests::http::request_tcp(&lab.b, "127.0.0.1:9101", "GET", "/healthz", None, None)
            .unwrap();
    assert_eq!(health.status, 200, "{}", health.body);
    let (status, log) = d.stop(libc::SIGTERM).unwrap();
    assert!(status.success(), "{log}");
}

#[test]
fn daemon_limits_a_flood_and_detaches_on_sigterm() {
    let lab = Lab::new().unwrap();
    let dir = tempfile::tempdir().unwrap();
    let cfg = write(
        &dir,
        "rules.toml",
        "[datapath]\nmax_sources = 1024\n[default]\nrate = 100\nburst = 50\n",
    );
    let mut d = Daemon::spawn(
        &lab.b,
        &[
            "run",
            "--iface",
            VB,
            "--config",
            cfg.to_str().unwrap(),
            "--stats-interval",
            "1",
            "--detach-on-exit",
        ],
    )
    .unwrap();
    d.wait_for(ATTACHED, START).unwrap();
    assert!(lab.xdp_attached().unwrap());
    let rx = Receiver::start(&lab.b).unwrap();
    let sent = join(flood(
        &lab.a,
        lab.v4(1),
        lab.v4(2),
        Duration::from_millis(3200),
        None,
    ))
    .unwrap();
    let got = rx.finish().unwrap();
    // Let a periodic report happen, then stop.
    d.wait_for("pkt/s", Duration::from_secs(5)).unwrap();
    let (status, log) = d.stop(libc::SIGTERM).unwrap();
    assert!(status.success(), "exit {status}:\n{log}");
    assert!(
        log.contains("SIGTERM received: stopping") && log.contains("detached and unpinned"),
        "{log}"
    );
    assert!(
        !lab.xdp_attached().unwrap(),
        "XDP still attached after SIGTERM"
    );

    let passed = got.get(&lab.v4(1)).copied().unwrap_or(0);
    let expected = expected_passed(100, 50, sent.seconds());
    assert!(
        (passed as f64 - expected).abs() <= tolerance(expected),
        "passed {passed}, expected {expected:.1}"
    );
    let dropped = final_counter(&log, "dropped_packets").expect("final counters in the log");
    assert!(
        dropped as f64 > sent.packets as f64 * 0.5,
        "dropped {dropped} of {} sent:\n{log}",
        sent.packets
    );
}

#[test]
fn daemon_without_config_runs_the_embedded_default_and_detaches_on_sigint() {
    let lab = Lab::new().unwrap();
    let mut d = Daemon::spawn(
        &lab.b,
        &["run", "--iface", VB, "--mode", "skb", "--detach-on-exit"],
    )
    .unwrap();
    d.wait_for(ATTACHED, START).unwrap();
    let log = d.log();
    assert!(
        log.contains(
            "no --config given: using the embedded default (1000 packets/s, burst 2000 per source)"
        ),
        "{log}"
    );
    assert!(log.contains("mode=skb"), "{log}");
    assert!(lab.xdp_attached().unwrap());
    let (status, log) = d.stop(libc::SIGINT).unwrap();
    assert!(status.success(), "exit {status}:\n{log}");
    assert!(
        log.contains("SIGINT received: stopping") && log.contains("detached and unpinned"),
        "{log}"
    );
    assert!(
        !lab.xdp_attached().unwrap(),
        "XDP still attached after SIGINT"
    );
}

#[test]
fn sighup_reloads_a_valid_file_and_keeps_running_on_an_invalid_one() {
    let lab = Lab::new().unwrap();
    let dir = tempfile::tempdir().unwrap();
    let cfg = write(&dir, "rules.toml", "[default]\nrate = 100\n");
    let mut d = Daemon::spawn(
        &lab.b,
        &["run", "--iface", VB, "--config", cfg.to_str().unwrap()],
    )
    .unwrap();
    d.wait_for(ATTACHED, START).unwrap();
    std::fs::write(&cfg, "[default]\nrate = 100\nburst = -1\n").unwrap();
    d.signal(libc::SIGHUP);
    d.wait_for(
        "reload rejected, keeping the running config:",
        Duration::from_secs(5),
    )
    .unwrap();
    assert!(
        d.log()
            .contains("rules.toml:3:9: default.burst = -1 is out of range"),
        "{}",
        d.log()
    );
    assert!(lab.xdp_attached().unwrap());
    std::fs::write(&cfg, "[default]\nrate = 7\nburst = 9\n").unwrap();
    d.signal(libc::SIGHUP);
    d.wait_for(
        "every source held to 7 packets/s, burst 9",
        Duration::from_secs(5),
    )
    .unwrap();
    let (status, log) = d.stop(libc::SIGTERM).unwrap();
    assert!(status.success(), "{log}");
}

#[test]
fn check_config_accepts_valid_and_locates_errors() {
    let dir = tempfile::tempdir().unwrap();
    let ok = write(
        &dir,
        "ok.toml",
        "[datapath]\nmax_sources = 100\n[default]\nrate = 5\nburst = 10\n",
    );
    let (status, out) = run_once(None, &["check-config", ok.to_str().unwrap()]).unwrap();
    assert!(status.success(), "{out}");
    assert!(out.contains("ok (0 rules, 0 allow and 0 deny CIDRs; by default every source held to 5 packets/s, burst 10; up to 100 sources)"), "{out}");

    let cases = [
        ("rate0.toml", "[default]\nrate = 0\n", "rate0.toml:2:8: default.rate = 0 is out of range: allowed 1..=100000000"),
        ("prefix.toml", "[datapath]\nipv6_prefix = 129\n[default]\nrate = 1\n", "prefix.toml:2:15: datapath.ipv6_prefix = 129 is out of range: allowed 1..=128"),
        ("v4prefix.toml", "[datapath]\nipv4_prefix = 33\n[default]\nrate = 1\n", "v4prefix.toml:2:15: datapath.ipv4_prefix = 33 is out of range: allowed 1..=32"),
        ("unknown.toml", "[default]\nrate = 1\nburts = 2\n", "unknown.toml:3:1: unknown field `burts`, expected `rate` or `burst`"),
        ("syntax.toml", "[default]\nrate = = 1\n", "syntax.toml:2:8: "),
        ("nodefault.toml", "[datapath]\n", "nodefault.toml: missing [default] table"),
        ("dupe.toml", "[default]\nrate = 1\n[[rule]]\nname = \"a\"\nrate = 1\n[[rule]]\nname = \"a\"\nrate = 1\n", "dupe.toml:7:8: rule name \"a\" is already used on line 4"),
        ("proto.toml", "[default]\nrate = 1\n[[rule]]\nname = \"a\"\nproto = \"sctp\"\nrate = 1\n", "proto.toml:5:9: rule \"a\": proto = \"sctp\" is not allowed: use one of any, tcp, udp, icmp, icmpv6"),
        ("cidr.toml", "[default]\nrate = 1\n[[deny]]\ncidr = \"10.0.0.0/33\"\n", "cidr.toml:4:8: deny[0].cidr: \"10.0.0.0/33\": the prefix length must be 0..=32"),
    ];
    for (name, text, want) in cases {
        let p = write(&dir, name, text);
        let (status, out) = run_once(None, &["check-config", p.to_str().unwrap()]).unwrap();
        assert_eq!(status.code(), Some(1), "{name}: {out}");
        let line = error_line(&out);
        assert!(line.contains(want), "{name}: got {line:?}, want {want:?}");
    }
    // Valid line by line, but more rule decisions than the datapath holds
    // (port classes × source classes): refused here, not only at start.
    let mut text = String::from("[default]\nrate = 5\n");
    for x in 0..100 {
        text += &format!("[[rule]]\nname = \"p{x}\"\nproto = \"udp\"\ndst_ports = [{}]\nsrc = [\"10.{x}.0.0/16\"]\nrate = 1\n", 1000 + x);
    }
    for y in 0..105 {
        let src: Vec<String> = (0..100).map(|x| format!("\"10.{x}.{y}.0/24\"")).collect();
        text += &format!(
            "[[rule]]\nname = \"q{y}\"\nsrc = [{}]\nrate = 1\n",
            src.join(", ")
        );
    }
    let big = write(&dir, "decisions.toml", &text);
    let (status, out) = run_once(None, &["check-config", big.to_str().unwrap()]).unwrap();
    assert_eq!(status.code(), Some(1), "{out}");
    assert!(
        error_line(&out)
            .contains("decisions.toml: the rule set needs 1048577 or more rule decision entries"),
        "{out}"
    );

    let (status, out) = run_once(None, &["check-config", "/nonexistent/rules.toml"]).unwrap();
    assert_eq!(status.code(), Some(1));
    assert!(
        error_line(&out).contains("/nonexistent/rules.toml: cannot read the config file"),
        "{out}"
    );
}

/// Every bad input to `run`: one error line, exit 1, nothing attached.
#[test]
fn bad_input_to_run_fails_cleanly_and_leaves_nothing_attached() {
    let lab = Lab::new().unwrap();
    let dir = tempfile::tempdir().unwrap();
    let bad = write(&dir, "bad.toml", "[default]\nrate = 0\n");
    let unknown = write(&dir, "unknown.toml", "[default]\nrate = 10\n[extra]\n");
    let good = write(&dir, "good.toml", "[default]\nrate = 10\n");
    let (bad, unknown, good) = (
        bad.to_str().unwrap(),
        unknown.to_str().unwrap(),
        good.to_str().unwrap(),
    );

    let cases: Vec<(Vec<&str>, String)> = vec![
        (
            vec!["run", "--iface", VB, "--config", "/nonexistent.toml"],
            "cannot read the config file".into(),
        ),
        (
            vec!["run", "--iface", VB, "--config", bad],
            "bad.toml:2:8: default.rate = 0 is out of range".into(),
        ),
        (
            vec!["run", "--iface", VB, "--config", unknown],
            "unknown.toml:3:2: unknown field `extra`".into(),
        ),
        (
            vec!["run", "--iface", "nosuch0", "--config", good],
            "interface `nosuch0` does not exist".into(),
        ),
    ];
    for (args, want) in &cases {
        let (status, out) = run_once(Some(&lab.b), args).unwrap();
        assert_eq!(status.code(), Some(1), "{args:?}: {out}");
        let line = error_line(&out);
        assert!(
            line.contains(want.as_str()),
            "{args:?}: got {line:?}, want {want:?}"
        );
        assert!(!lab.xdp_attached().unwrap(), "{args:?} left XDP attached");
        assert!(
            !lab.b.runtime_dir().join("api.sock").exists(),
            "{args:?} left its admin socket behind"
        );
    }

    // Missing privileges: root without capabilities (empty bounding set).
    let out = std::process::Command::new("ip")
        .args([
            "netns",
            "exec",
            &lab.b.name,
            "setpriv",
            "--bounding-set=-all",
            "--inh-caps=-all",
        ])
        .arg(rl_tests::daemon::binary())
        .args(["run", "--iface", VB, "--config", good])
        .output()
        .expect("setpriv (util-linux)");
    let text = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(1), "{text}");
    assert!(
        error_line(&text).contains(
            "permission denied while mounting bpffs for the pins (that takes CAP_SYS_ADMIN"
        ) && error_line(&text).contains("run rl-control as root"),
        "{text}"
    );
    assert!(!lab.xdp_attached().unwrap());

    // An interface that already carries another XDP program, in every mode.
    let mut first = Daemon::spawn(
        &lab.b,
        &["run", "--iface", VB, "--config", good, "--detach-on-exit"],
    )
    .unwrap();
    first.wait_for(ATTACHED, START).unwrap();
    for mode in ["auto", "native", "skb"] {
        // Its own runtime directory: the first daemon holds the lab's socket.
        let second = dir.path().join("second");
        let args = [
            "run",
            "--iface",
            VB,
            "--config",
            good,
            "--mode",
            mode,
            "--runtime-dir",
            second.to_str().unwrap(),
        ];
        let (status, out) = run_once(Some(&lab.b), &args).unwrap();
        assert_eq!(status.code(), Some(1), "{mode}: {out}");
        assert!(
            error_line(&out).contains(&format!(
                "interface `{VB}` already has an XDP program attached"
            )),
            "{mode}: {out}"
        );
    }
    // The first daemon is untouched and still owns the interface.
    assert!(lab.xdp_attached().unwrap());
    let (status, log) = first.stop(libc::SIGTERM).unwrap();
    assert!(status.success(), "{log}");
    assert!(!lab.xdp_attached().unwrap());
}

/// Rules for the reload test: source 1 under "changing", source 3 under
/// "steady", source 4 allowed.
fn reload_rules(lab: &Lab, changing_rate: u64, extra_rule: bool) -> String {
    let extra = if extra_rule {
        "[[rule]]\nname = \"added\"\nproto = \"tcp\"\nrate = 1\n"
    } else {
        ""
    };
    format!(
        "[datapath]\nmax_sources = 1024\n[default]\nrate = 1000000\n\
         [[allow]]\ncidr = \"{}/32\"\n{extra}\
         [[rule]]\nname = \"changing\"\nsrc = [\"{}/32\"]\nrate = {changing_rate}\nburst = 50\n\
         [[rule]]\nname = \"steady\"\nsrc = [\"{}/32\"]\nrate = 200\nburst = 100\n",
        lab.v4(4),
        lab.v4(1),
        lab.v4(3)
    )
}

/// Writes `text` to `path` the way careful tools do: a new file renamed over
/// the old one, so the daemon never reads half a file.
fn replace(path: &std::path::Path, text: &str) {
    let tmp = path.with_extension("tmp");
    std::fs::write(&tmp, text).unwrap();
    std::fs::rename(&tmp, path).unwrap();
}

#[test]
fn reload_under_a_flood_applies_new_limits_keeps_unchanged_state_and_loses_no_allowed_packet() {
    let lab = Lab::new().unwrap();
    lab.add_source(&format!("{}/24", lab.v4(3))).unwrap();
    lab.add_source(&format!("{}/24", lab.v4(4))).unwrap();
    let dir = tempfile::tempdir().unwrap();
    let cfg = write(&dir, "rules.toml", &reload_rules(&lab, 100, false));
    let pid = dir.path().join("pid");
    let mut d = Daemon::spawn(
        &lab.b,
        &[
            "run",
            "--iface",
            VB,
            "--config",
            cfg.to_str().unwrap(),
            "--pid-file",
            pid.to_str().unwrap(),
            "--no-watch",
        ],
    )
    .unwrap();
    d.wait_for(ATTACHED, START).unwrap();

    let rx = Receiver::start(&lab.b).unwrap();
    let span = Duration::from_millis(6400);
    let changing = flood(&lab.a, lab.v4(1), lab.v4(2), span, None);
    let steady = flood(&lab.a, lab.v4(3), lab.v4(2), span, None);
    let allowed = rl_tests::traffic::paced(&lab.a, lab.v4(4), lab.v4(2), 200, 1200);
    std::thread::sleep(Duration::from_millis(3200));
    // The new file raises one limit and inserts a rule before both (indices move).
    replace(&cfg, &reload_rules(&lab, 400, true));
    let signalled = std::time::Instant::now();
    d.signal(libc::SIGHUP);
    d.wait_for("reloaded", Duration::from_secs(5)).unwrap();
    let seen = std::time::Instant::now();
    let (c, s, al) = (
        join(changing).unwrap(),
        join(steady).unwrap(),
        join(allowed).unwrap(),
    );
    let got = rx.finish().unwrap();
    let n = |ip| got.get(&ip).copied().unwrap_or(0);

    // The changed rule: old limit until the flip, then a fresh bucket at the new rate.
    // The flip happened between the signal and the log line.
    let expect = |flip: std::time::Instant| {
        let before = (flip - c.started).as_secs_f64();
        let after = (c.ended - flip).as_secs_f64();
        expected_passed(100, 50, before) + expected_passed(400, 50, after)
    };
    let (hi, lo) = (expect(signalled), expect(seen));
    let passed = n(lab.v4(1)) as f64;
    assert!(
        passed >= lo - tolerance(lo) && passed <= hi + tolerance(hi),
        "changed rule passed {passed}, expected {lo:.0}..{hi:.0} (flip {:?} after the signal)",
        seen - signalled
    );
    // The unchanged rule kept its bucket: no second burst.
    let expected = expected_passed(200, 100, s.seconds());
    let passed = n(lab.v4(3)) as f64;
    assert!(
        (passed - expected).abs() <= tolerance(expected),
        "unchanged rule passed {passed}, expected {expected:.1} (a reset would add 100)"
    );
    assert_eq!(
        n(lab.v4(4)),
        al.packets,
        "allowed traffic lost packets across the reload"
    );

    // An invalid file changes nothing: the new rules keep enforcing.
    replace(&cfg, "[default]\nrate = 0\n");
    d.signal(libc::SIGHUP);
    d.wait_for(
        "reload rejected, keeping the running config:",
        Duration::from_secs(5),
    )
    .unwrap();
    assert!(
        d.log()
            .contains("rules.toml:2:8: default.rate = 0 is out of range"),
        "{}",
        d.log()
    );
    let idle_from = c.ended;
    let rx = Receiver::start(&lab.b).unwrap();
    let again = join(flood(
        &lab.a,
        lab.v4(1),
        lab.v4(2),
        Duration::from_millis(1600),
        None,
    ))
    .unwrap();
    let got = rx.finish().unwrap();
    let refill = (400.0 * (again.started - idle_from).as_secs_f64()).min(50.0);
    let expected = refill + 400.0 * again.seconds();
    let passed = got.get(&lab.v4(1)).copied().unwrap_or(0) as f64;
    assert!(
        (passed - expected).abs() <= tolerance(expected) + 1.0,
        "after a rejected reload passed {passed}, expected {expected:.1}"
    );
    let (status, log) = d.stop(libc::SIGTERM).unwrap();
    assert!(status.success(), "{log}");
    assert!(!pid.exists(), "the pid file is removed on exit");
}

#[test]
fn a_changed_file_and_the_reload_command_both_reload() {
    let lab = Lab::new().unwrap();
    let dir = tempfile::tempdir().unwrap();
    let cfg = write(&dir, "rules.toml", "[default]\nrate = 100\n");
    let pid = dir.path().join("pid");
    let pid_arg = pid.to_str().unwrap();
    let mut d = Daemon::spawn(
        &lab.b,
        &[
            "run",
            "--iface",
            VB,
            "--config",
            cfg.to_str().unwrap(),
            "--pid-file",
            pid_arg,
        ],
    )
    .unwrap();
    d.wait_for(ATTACHED, START).unwrap();
    replace(&cfg, "[default]\nrate = 7\nburst = 9\n");
    d.wait_for(
        "the config file changed on disk: reloading",
        Duration::from_secs(5),
    )
    .unwrap();
    d.wait_for(
        "every source held to 7 packets/s, burst 9",
        Duration::from_secs(5),
    )
    .unwrap();

    std::fs::write(&cfg, "[default]\nrate = 8\n").unwrap();
    let (status, out) = run_once(None, &["reload", "--pid-file", pid_arg]).unwrap();
    assert!(status.success(), "{out}");
    assert!(out.contains("asked rl-control"), "{out}");
    d.wait_for("SIGHUP received: reloading", Duration::from_secs(5))
        .unwrap();
    d.wait_for("every source held to 8 packets/s", Duration::from_secs(5))
        .unwrap();

    // The file deleted: said once (the rules in force stay); back, with
    // other rules: reloaded.
    std::fs::remove_file(&cfg).unwrap();
    d.wait_for(
        "the config file is gone: the rules in force stay",
        Duration::from_secs(5),
    )
    .unwrap();
    std::thread::sleep(Duration::from_millis(2500));
    std::fs::write(&cfg, "[default]\nrate = 9\n").unwrap();
    d.wait_for("every source held to 9 packets/s", Duration::from_secs(5))
        .unwrap();
    let (status, log) = d.stop(libc::SIGTERM).unwrap();
    assert_eq!(log.matches("the config file is gone").count(), 1, "{log}");
    assert!(status.success(), "{log}");

    // No daemon: one clear error, exit 1.
    let (status, out) = run_once(None, &["reload", "--pid-file", pid_arg]).unwrap();
    assert_eq!(status.code(), Some(1), "{out}");
    assert!(error_line(&out).contains("is rl-control running?"), "{out}");

    // A stale pid file (a killed daemon leaves it) naming another process:
    // not signalled (SIGHUP would have ended this sleep).
    let mut other = std::process::Command::new("sleep")
        .arg("600")
        .spawn()
        .unwrap();
    std::fs::write(&pid, format!("{}\n", other.id())).unwrap();
    let (status, out) = run_once(None, &["reload", "--pid-file", pid_arg]).unwrap();
    assert_eq!(status.code(), Some(1), "{out}");
    assert!(
        error_line(&out).contains("is sleep, not rl-control: the pid file is stale"),
        "{out}"
    );
    std::thread::sleep(Duration::from_millis(100));
    assert!(
        other.try_wait().unwrap().is_none(),
        "the other process was signalled"
    );
    let _ = other.kill();
    let _ = other.wait();
    // Nor a process group, nor every process.
    for bad in ["0", "-1"] {
        std::fs::write(&pid, bad).unwrap();
        let (status, out) = run_once(None, &["reload", "--pid-file", pid_arg]).unwrap();
        assert_eq!(status.code(), Some(1), "{bad}: {out}");
        assert!(
            error_line(&out).contains("not a process id"),
            "{bad}: {out}"
        );
    }
}

/// The runtime directory holds one daemon's admin socket: a stale socket
/// (a killed daemon's) is replaced, a second daemon on the directory stops
/// before touching it (the first keeps answering), and a directory others
/// may write is refused (they could put a socket of their own there).
#[test]
fn one_daemon_serves_a_runtime_directory() {
    use std::os::unix::fs::PermissionsExt;
    let lab = Lab::new().unwrap();
    let dir = tempfile::tempdir().unwrap();
    let good = write(&dir, "good.toml", "[default]\nrate = 10\n");
    let good = good.to_str().unwrap();
    let run_dir = lab.b.runtime_dir();
    std::fs::create_dir_all(&run_dir).unwrap();
    drop(std::os::unix::net::UnixListener::bind(run_dir.join("api.sock")).unwrap());
    let first = Daemon::spawn(
        &lab.b,
        &["run", "--iface", VB, "--config", good, "--detach-on-exit"],
    )
    .unwrap();
    let mut first = first;
    first.wait_for(ATTACHED, START).unwrap();
    assert_eq!(
        rl_tests::http::get(&lab.b, "/v1/status").status,
        200,
        "the stale socket was not replaced"
    );
    let (status, out) =
        run_once(Some(&lab.b), &["run", "--iface", "lo", "--config", good]).unwrap();
    assert_eq!(status.code(), Some(1), "{out}");
    assert!(
        error_line(&out).contains("another rl-control is serving"),
        "{out}"
    );
    assert_eq!(
        rl_tests::http::get(&lab.b, "/v1/status").status,
        200,
        "the second start took the first's socket"
    );
    let (status, log) = first.stop(libc::SIGTERM).unwrap();
    assert!(status.success(), "{log}");
    // A live socket with no lock (an older build's daemon takes none):
    // refused too, and left serving.
    let older = std::os::unix::net::UnixListener::bind(run_dir.join("api.sock")).unwrap();
    let (status, out) = run_once(Some(&lab.b), &["run", "--iface", VB, "--config", good]).unwrap();
    assert_eq!(status.code(), Some(1), "{out}");
    assert!(
        error_line(&out).contains("another rl-control is serving"),
        "{out}"
    );
    assert!(
        run_dir.join("api.sock").exists(),
        "the older daemon's socket was removed"
    );
    drop(older);
    std::fs::remove_file(run_dir.join("api.sock")).unwrap();

    std::fs::set_permissions(&run_dir, std::fs::Permissions::from_mode(0o777)).unwrap();
    let (status, out) = run_once(Some(&lab.b), &["run", "--iface", VB, "--config", good]).unwrap();
    assert_eq!(status.code(), Some(1), "{out}");
    assert!(
        error_line(&out).contains("only root may write where the admin socket lives"),
        "{out}"
    );
    assert!(!lab.xdp_attached().unwrap());
    std::fs::set_permissions(&run_dir, std::fs::Permissions::from_mode(0o755)).unwrap();
}
