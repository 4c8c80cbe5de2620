//! One limiter on several interfaces: one program, one rule set, one set of
//! buckets, so a source's limit is per host; and all or nothing when one
//! interface cannot be attached.

use std::time::Instant;

use rl_tests::{
    daemon::{run_once, write, Daemon},
    frames::{eth, ipv4, udp, ETH_P_IP, UDP},
    http::get,
    lab::{BpfFs, Lab, VA, VA2, VB, VB2},
    traffic::{forged, join, Receiver},
};

const RATE: u64 = 10;
const BURST: u64 = 100;

#[test]
fn one_source_through_two_interfaces_shares_one_limit() {
    let lab = Lab::new().unwrap();
    lab.second_pair().unwrap();
    let dir = tempfile::tempdir().unwrap();
    let cfg = write(
        &dir,
        "rl.toml",
        &format!("[default]\nrate = {RATE}\nburst = {BURST}\n"),
    );
    let d = Daemon::serving(&lab, &cfg, &["--iface", VB2]).unwrap();
    let status = get(&lab.b, "/v1/status").json();
    let ifaces: Vec<&str> = status["interfaces"]
        .as_array()
        .unwrap()
        .iter()
        .map(|i| i["iface"].as_str().unwrap())
        .collect();
    assert_eq!(ifaces, [VB, VB2]);
    let (status, out) = run_once(Some(&lab.b), &["status"]).unwrap();
    assert!(
        out.contains("interfaces:      vb (XDP native), vb2 (XDP native); one program"),
        "{out}"
    );
    assert!(status.success(), "all well: exit 0: {out}");

    // One source, 150 frames through each interface at once.
    let src = [192, 0, 2, 77];
    let frame = eth(&[], ETH_P_IP, &ipv4(src, UDP, &[], &udp(7777)));
    let (tap1, tap2) = (
        Receiver::tap(&lab.b, VB).unwrap(),
        Receiver::tap(&lab.b, VB2).unwrap(),
    );
    let started = Instant::now();
    let s1 = forged(&lab.a, VA, frame.clone(), 150, 1000, None, move |_| src);
    let s2 = forged(&lab.a, VA2, frame, 150, 1000, None, move |_| src);
    join(s1).unwrap();
    join(s2).unwrap();
    let secs = started.elapsed().as_secs_f64();
    let key = std::net::IpAddr::from(src);
    let (p1, p2) = (
        tap1.finish().unwrap().get(&key).copied().unwrap_or(0),
        tap2.finish().unwrap().get(&key).copied().unwrap_or(0),
    );
    let bound = BURST + (RATE as f64 * secs).ceil() as u64 + 1;
    eprintln!(
        "passed {p1} on vb + {p2} on vb2 in {secs:.2} s; one shared bucket allows at most {bound}"
    );
    assert!(
        p1 + p2 <= bound,
        "{p1} + {p2} passed: the interfaces did not share the source's bucket (at most {bound})"
    );
    assert!(p1 + p2 >= BURST, "{p1} + {p2} passed: less than the burst");
    assert!(
        p1 > 0 && p2 > 0,
        "both interfaces passed traffic: {p1}, {p2}"
    );
    let (status, log) = d.stop(libc::SIGTERM).unwrap();
    assert!(status.success(), "{log}");
    assert!(!lab.xdp_attached().unwrap());
}

#[test]
fn when_one_interface_fails_nothing_is_left_attached_anywhere() {
    let lab = Lab::new().unwrap();
    lab.second_pair().unwrap();
    let pins = BpfFs::new().unwrap();
    let dir = tempfile::tempdir().unwrap();
    let cfg = write(&dir, "rl.toml", "[default]\nrate = 10\n");
    // vb2 is taken by another program (another rl, with its own runtime dir).
    let other = dir.path().join("other");
    let mut first = Daemon::spawn(
        &lab.b,
        &[
            "run",
            "--iface",
            VB2,
            "--config",
            cfg.to_str().unwrap(),
            "--runtime-dir",
            other.to_str().unwrap(),
            "--detach-on-exit",
        ],
    )
    .unwrap();
    first
        .wait_for("admin API on", std::time::Duration::from_secs(20))
        .unwrap();

    let (status, out) = run_once(
        Some(&lab.b),
        &[
            "run",
            "--iface",
            VB,
            "--iface",
            VB2,
            "--config",
            cfg.to_str().unwrap(),
            "--pin-dir",
            pins.arg(),
        ],
    )
    .unwrap();
    assert_eq!(status.code(), Some(1), "{out}");
    let line = out
        .lines()
        .find(|l| l.starts_with("error:"))
        .unwrap_or_default()
        .to_string();
    assert!(
        line.contains("interface `vb2` already has an XDP program attached"),
        "{line}"
    );
    assert!(
        !lab.xdp_attached().unwrap(),
        "vb was left attached after vb2 failed"
    );
    assert!(
        !pins.path().join("vb+vb2").exists(),
        "pins were left behind"
    );
    let (status, log) = first.stop(libc::SIGTERM).unwrap();
    assert!(status.success(), "{log}");
}
