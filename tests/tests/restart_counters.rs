//! The rules' counters across a reload and a restart: a reload that moves
//! a rule takes its counts out of the pinned tables into the daemon's
//! totals by name; those totals are kept in the runtime directory, so the
//! next daemon on the same pins goes on from them instead of lowering the
//! counters (which Prometheus reads as a reset).

use std::time::Duration;

use rl_tests::{
    daemon::{run_once, write, Daemon},
    http::get,
    lab::{BpfFs, Lab, VB},
    traffic::{flood, join, PORT},
};

fn config(with_v: bool) -> String {
    let v = if with_v {
        "[[rule]]\nname = \"v\"\nproto = \"udp\"\ndst_ports = [1]\nrate = 5\n"
    } else {
        ""
    };
    format!("[datapath]\nmax_sources = 1024\n[default]\nrate = 1000000\n{v}[[rule]]\nname = \"w\"\nproto = \"udp\"\ndst_ports = [{PORT}]\nrate = 1000000\n")
}

fn passed(lab: &Lab, rule: &str) -> u64 {
    get(&lab.b, "/v1/stats").json()["rules"][rule]["passed_packets"]
        .as_u64()
        .unwrap_or(0)
}

#[test]
fn a_rule_retired_by_a_reload_keeps_its_counts_across_a_restart() {
    let lab = Lab::new().unwrap();
    let pins = BpfFs::new().unwrap();
    let dir = tempfile::tempdir().unwrap();
    let cfg = write(&dir, "rl.toml", &config(false));
    let d = Daemon::pinned(&lab, &cfg, &pins, &[]).unwrap();
    join(flood(
        &lab.a,
        lab.v4(1),
        lab.v4(2),
        Duration::from_millis(300),
        None,
    ))
    .unwrap();
    std::thread::sleep(Duration::from_millis(200));
    let before = passed(&lab, "w");
    assert!(before > 100, "w counted {before}");
    // A rule put above w: w moves, and its counts go to the daemon's
    // totals by name.
    write(&dir, "rl.toml", &config(true));
    let (status, out) = run_once(Some(&lab.b), &["reload"]).unwrap();
    assert!(status.success(), "{out}");
    assert_eq!(passed(&lab, "w"), before, "counted once after the reload");
    let kept = lab.b.runtime_dir().join("rule-counters.json");
    let deadline = std::time::Instant::now() + Duration::from_secs(3);
    while !std::fs::read_to_string(&kept).is_ok_and(|t| t.contains("\"w\"")) {
        assert!(
            std::time::Instant::now() < deadline,
            "{} not written",
            kept.display()
        );
        std::thread::sleep(Duration::from_millis(100));
    }
    // kill -9 (no stop to write anything more), and a new daemon on the
    // same pins: w's counts go on from where they were.
    let (_, log) = d.stop(libc::SIGKILL).unwrap();
    let d = Daemon::pinned(&lab, &cfg, &pins, &[]).unwrap();
    assert!(
        d.log().contains("adopted the pinned datapath"),
        "{log}\n{}",
        d.log()
    );
    assert!(
        d.log()
            .contains("the counters of 1 rules the daemon before retired go on"),
        "{}",
        d.log()
    );
    assert_eq!(passed(&lab, "w"), before, "w's counts after the restart");
    // And a clean stop and start again: still there, not counted twice.
    let (status, log) = d.stop(libc::SIGTERM).unwrap();
    assert!(status.success(), "{log}");
    let d = Daemon::pinned(&lab, &cfg, &pins, &[]).unwrap();
    assert_eq!(passed(&lab, "w"), before, "after a second restart");
    // Detached: the counters go with the datapath, and the file with them.
    let (status, log) = d.stop(libc::SIGTERM).unwrap();
    assert!(status.success(), "{log}");
    let (status, out) = run_once(
        Some(&lab.b),
        &["detach", "--iface", VB, "--pin-dir", pins.arg()],
    )
    .unwrap();
    assert!(status.success(), "{out}");
    let d = Daemon::pinned(&lab, &cfg, &pins, &[]).unwrap();
    assert_eq!(passed(&lab, "w"), 0, "a fresh datapath counts from 0");
    let (status, log) = d.stop(libc::SIGTERM).unwrap();
    assert!(status.success(), "{log}");
}
