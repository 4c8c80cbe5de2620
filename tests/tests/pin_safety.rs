//! The pins stay root's and stay adoptable: a first start that fails or is
//! stopped before its datapath is in force leaves nothing a later start
//! refuses; interface pin directories are root's alone (0700); and an
//! interface that carries rl's datapath for another set of interfaces is
//! refused with what to do, not with a hint that does not work; and a
//! program taken off under a running daemon is reported, not hidden.

use std::os::unix::fs::PermissionsExt;

use aya::maps::{Array, Map, MapData};
use rl_control::{
    compile::compile,
    config::{units::Cidr, Config},
    datapath::{prepare_pins, Datapath, LoadOptions},
};
use rl_tests::{
    daemon::{run_once, write, Daemon},
    http::get,
    lab::{require_root, BpfFs, Lab, VB, VB2},
    load_pinned,
};

const RULES: &str = "[datapath]\nmax_sources = 1024\n[default]\nrate = 100\n";

fn pinned(dir: &std::path::Path) -> Vec<String> {
    let mut v: Vec<String> = std::fs::read_dir(dir)
        .unwrap()
        .flatten()
        .map(|e| e.file_name().to_string_lossy().into_owned())
        .collect();
    v.sort();
    v
}

#[test]
fn a_first_start_that_fails_or_is_stopped_before_it_enforces_leaves_nothing_to_refuse() {
    require_root();
    let pins = BpfFs::new().unwrap();
    let dir = pins.path().join("x");
    prepare_pins(pins.path(), &dir).unwrap();

    // Fails after its maps are pinned (its CIDRs do not fit): no pin stays.
    let mut compiled = compile(&Config::from_str(RULES, "<test>").unwrap());
    let host = Cidr::host(std::net::IpAddr::from([192, 0, 2, 1]));
    compiled.rules.lpm = vec![(host, 0); rl_common::LPM_SLOT_LEN as usize + 1];
    let opts = || LoadOptions {
        pin: Some(dir.clone()),
        ..Default::default()
    };
    let e = Datapath::load_with(&compiled, opts())
        .err()
        .expect("more CIDRs than the tables hold");
    assert!(e.to_string().contains("CIDR"), "{e}");
    assert_eq!(
        pinned(&dir),
        Vec::<String>::new(),
        "a failed fresh start left pins"
    );

    // Stopped after pinning, before its layout version was written (as a
    // kill -9 there leaves it): the next start removes them and loads afresh.
    let compiled = compile(&Config::from_str(RULES, "<test>").unwrap());
    drop(load_pinned(&compiled, &dir));
    let layout = MapData::from_pin(dir.join(rl_common::MAP_LAYOUT)).unwrap();
    let mut layout: Array<MapData, u32> = Array::try_from(Map::Array(layout)).unwrap();
    layout.set(0, 0, 0).unwrap();
    drop(layout);
    let dp =
        Datapath::load_with(&compiled, opts()).expect("the next start after an interrupted one");
    assert!(!dp.adopted(), "nothing was in force there to adopt");
    drop(dp);
    // A datapath that was in force (its version written) is adopted as before.
    let dp = Datapath::load_with(&compiled, opts()).unwrap();
    assert!(dp.adopted());
    drop(dp);
    rl_control::datapath::detach_pinned(&dir).unwrap();

    // As the daemon loads (the version written only as its first link is
    // pinned), then killed before attaching: the next start clears the
    // pins, even with tables of another size (it was refused: "detach").
    let lab = Lab::new().unwrap();
    prepare_pins(pins.path(), &dir).unwrap();
    let daemon = || LoadOptions {
        pin: Some(dir.clone()),
        layout_at_attach: true,
        ..Default::default()
    };
    drop(Datapath::load_with(&compiled, daemon()).unwrap());
    let bigger = compile(&Config::from_str(&RULES.replace("1024", "4096"), "<test>").unwrap());
    let dp = Datapath::load_with(&bigger, daemon())
        .expect("a start after one killed between load and attach");
    assert!(!dp.adopted(), "nothing was in force there to adopt");
    // Attached, it is in force: the next start adopts it (and refuses
    // other sizes).
    let rules = bigger.rules.clone();
    let dp = lab
        .b
        .run(move || {
            let mut dp = dp;
            dp.take_over(
                &rules,
                &[VB.to_string()],
                rl_control::datapath::AttachMode::Native,
            )?;
            Ok(dp)
        })
        .unwrap();
    drop(dp); // a pinned link outlives it, as when a daemon is killed
    let e = Datapath::load_with(&compiled, daemon())
        .err()
        .expect("other sizes on a datapath in force");
    assert!(
        e.to_string().contains("max_sources") || e.to_string().contains("size"),
        "{e}"
    );
    // Another max_sources and flood_prefixes sizing the same tables
    // (4096 + 65536 = 9632 + 60000; 2 × 60000 cells round up to 2^17):
    // refused as well, by the pinned cap of own buckets.
    let alike = compile(
        &Config::from_str(
            "[datapath]\nmax_sources = 9632\nflood_prefixes = 60000\n[default]\nrate = 100\n",
            "<test>",
        )
        .unwrap(),
    );
    let e = Datapath::load_with(&alike, daemon())
        .err()
        .expect("other settings sizing the tables alike");
    assert!(
        e.to_string()
            .contains("made with max_sources = 4096, this configuration says 9632"),
        "{e}"
    );
    assert!(Datapath::load_with(&bigger, daemon()).unwrap().adopted());
    rl_control::datapath::detach_pinned(&dir).unwrap();
}

#[test]
fn interface_pin_directories_are_roots_alone() {
    require_root();
    let pins = BpfFs::new().unwrap();
    let fresh = pins.path().join("a");
    prepare_pins(pins.path(), &fresh).unwrap();
    assert_eq!(
        std::fs::metadata(&fresh).unwrap().permissions().mode() & 0o777,
        0o700,
        "made root's alone"
    );

    // An older build's 0755 directory is tightened; one anyone may write is refused.
    let older = pins.path().join("b");
    std::fs::create_dir(&older).unwrap();
    std::fs::set_permissions(&older, std::fs::Permissions::from_mode(0o755)).unwrap();
    prepare_pins(pins.path(), &older).unwrap();
    assert_eq!(
        std::fs::metadata(&older).unwrap().permissions().mode() & 0o777,
        0o700,
        "tightened"
    );
    let open = pins.path().join("c");
    std::fs::create_dir(&open).unwrap();
    std::fs::set_permissions(&open, std::fs::Permissions::from_mode(0o777)).unwrap();
    let e = prepare_pins(pins.path(), &open).expect_err("a directory anyone may write");
    assert!(
        e.to_string().contains("only root may hold rl's pins"),
        "{e}"
    );

    // A pin directory another user made first (on a bpffs anyone may
    // write): they could move root's interface directory away. Refused.
    let squatted = pins.path().join("rl");
    std::fs::create_dir(&squatted).unwrap();
    std::os::unix::fs::chown(&squatted, Some(1000), Some(1000)).unwrap();
    let e =
        prepare_pins(&squatted, &squatted.join("eth0")).expect_err("a pin directory a user owns");
    assert!(
        e.to_string().contains("owned by uid 1000")
            && e.to_string().contains("can move rl's pins away"),
        "{e}"
    );
    // A sticky one anyone may write (as /sys/fs/bpf may be mounted) is fine.
    std::os::unix::fs::chown(&squatted, Some(0), Some(0)).unwrap();
    std::fs::set_permissions(&squatted, std::fs::Permissions::from_mode(0o1777)).unwrap();
    prepare_pins(&squatted, &squatted.join("eth0")).unwrap();
    std::fs::set_permissions(&squatted, std::fs::Permissions::from_mode(0o777)).unwrap();
    let e = prepare_pins(&squatted, &squatted.join("eth1"))
        .expect_err("a pin directory anyone may write, not sticky");
    assert!(e.to_string().contains("mode 777"), "{e}");
}

#[test]
fn an_interface_pinned_for_another_set_is_refused_with_what_to_do() {
    let lab = Lab::new().unwrap();
    lab.second_pair().unwrap();
    let pins = BpfFs::new().unwrap();
    let dir = tempfile::tempdir().unwrap();
    let cfg = write(&dir, "rl.toml", "[default]\nrate = 100\n");
    // vb alone, left attached and enforcing.
    let d = Daemon::pinned(&lab, &cfg, &pins, &[]).unwrap();
    let (status, log) = d.stop(libc::SIGTERM).unwrap();
    assert!(
        status.success() && log.contains("left attached and enforcing"),
        "{log}"
    );
    // Now vb and vb2: vb carries the other set's datapath.
    let args = [
        "run",
        "--iface",
        VB,
        "--iface",
        VB2,
        "--config",
        cfg.to_str().unwrap(),
        "--pin-dir",
        pins.arg(),
        "--no-watch",
    ];
    let mut d = Daemon::spawn(&lab.b, &args).unwrap();
    let want = format!("rl-control detach --iface {VB}");
    d.wait_for(&want, std::time::Duration::from_secs(20))
        .unwrap_or_else(|e| panic!("{e}: {}", d.log()));
    let (status, log) = d.stop(libc::SIGTERM).unwrap();
    assert!(!status.success(), "{log}");
    assert!(
        log.contains("carries rl's datapath pinned for another set of interfaces"),
        "{log}"
    );
    assert!(
        !log.contains("ip link set dev"),
        "not the hint that cannot remove a link: {log}"
    );
    assert!(
        lab.xdp_attached().unwrap(),
        "the pinned datapath on vb keeps enforcing"
    );
}

/// `rl-control detach` (or anything else) takes the program off while the
/// daemon runs: the daemon no longer reports itself attached. `/healthz`
/// answers 503 saying what to do, `/v1/status` and `rl-control status` say
/// which interface lost it (before, all three kept saying "attached").
#[test]
fn a_program_taken_off_under_a_running_daemon_is_reported_not_hidden() {
    let lab = Lab::new().unwrap();
    let pins = BpfFs::new().unwrap();
    let dir = tempfile::tempdir().unwrap();
    let cfg = write(&dir, "rl.toml", "[default]\nrate = 100\n");
    let d = Daemon::pinned(&lab, &cfg, &pins, &[]).unwrap();
    assert_eq!(get(&lab.b, "/healthz").status, 200);
    assert_eq!(
        get(&lab.b, "/v1/status").json()["interfaces"][0]["attached"],
        true
    );
    let (status, out) = run_once(
        Some(&lab.b),
        &["detach", "--iface", VB, "--pin-dir", pins.arg()],
    )
    .unwrap();
    assert!(status.success(), "{out}");
    assert!(!lab.xdp_attached().unwrap());
    let health = get(&lab.b, "/healthz");
    assert_eq!(health.status, 503, "{}", health.body);
    assert!(
        health.body.contains(&format!(
            "no longer attached to {VB} (it runs no XDP program)"
        )) && health.body.contains("restart the daemon"),
        "{}",
        health.body
    );
    assert_eq!(
        get(&lab.b, "/v1/status").json()["interfaces"][0]["attached"],
        false
    );
    let (status, out) = run_once(Some(&lab.b), &["status"]).unwrap();
    assert!(out.contains(&format!("NOT ATTACHED:    {VB}")), "{out}");
    assert_eq!(status.code(), Some(3), "not all well: {out}");
    assert!(out.contains(&format!("{VB} not attached")), "{out}");
    let (status, log) = d.stop(libc::SIGTERM).unwrap();
    assert!(status.success(), "{log}");
    assert!(
        log.contains("no longer attached to") && !log.contains("left attached and enforcing"),
        "the stop does not claim it enforces: {log}"
    );
}
