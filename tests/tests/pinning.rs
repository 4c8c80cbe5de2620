//! Enforcement outlives the daemon: the datapath is pinned on a bpffs (one
//! the test mounts outside `/sys`, see `BpfFs`), survives `kill -9`, is
//! adopted with its buckets by the next daemon, swapped without losing a
//! packet, refused when its layout does not fit, and removed by `detach`.

use std::time::{Duration, Instant};

use rl_tests::{
    daemon::{run_once, write, Daemon},
    http::get,
    lab::{BpfFs, Lab, VA, VB},
    load_pinned,
    traffic::{flood, join, paced, Receiver},
};

const RATE: u64 = 100;
const BURST: u64 = 1000;

fn config(max_sources: u32) -> String {
    format!("[datapath]\nmax_sources = {max_sources}\n[default]\nrate = {RATE}\nburst = {BURST}\n")
}

/// Floods from source 1 for `secs`; returns (packets that got through, when
/// the flood ended).
fn flood_for(lab: &Lab, secs: f64) -> (u64, Instant) {
    let rx = Receiver::start(&lab.b).unwrap();
    join(flood(
        &lab.a,
        lab.v4(1),
        lab.v4(2),
        Duration::from_secs_f64(secs),
        None,
    ))
    .unwrap();
    let ended = Instant::now();
    (
        rx.finish().unwrap().get(&lab.v4(1)).copied().unwrap_or(0),
        ended,
    )
}

/// The most a bucket emptied at `since` can pass until now: `RATE` per
/// second, plus 1% and a few packets for timing.
fn refill_bound(since: Instant) -> u64 {
    (RATE as f64 * since.elapsed().as_secs_f64() * 1.01) as u64 + 5
}

fn program_id(lab: &Lab) -> u32 {
    get(&lab.b, "/v1/status").json()["program_id"]
        .as_u64()
        .expect("program_id in /v1/status") as u32
}

#[test]
fn kill_9_leaves_the_limit_enforcing_and_a_restart_adopts_it_without_a_fresh_burst() {
    let lab = Lab::new().unwrap();
    let pins = BpfFs::new().unwrap();
    let dir = tempfile::tempdir().unwrap();
    let cfg = write(&dir, "rl.toml", &config(1024));
    let d = Daemon::pinned(&lab, &cfg, &pins, &[]).unwrap();
    let first_prog = program_id(&lab);

    // The burst goes, then the flood is held to the rate.
    let (passed, emptied) = flood_for(&lab, 1.5);
    assert!(
        (BURST..=BURST + 200).contains(&passed),
        "first flood: {passed} passed"
    );

    // kill -9: the program stays attached with its buckets.
    let (status, log) = d.stop(libc::SIGKILL).unwrap();
    assert!(!status.success(), "{log}");
    assert_eq!(
        lab.xdp_prog_ids().unwrap(),
        vec![first_prog],
        "the program stays attached after kill -9"
    );
    let (passed, _) = flood_for(&lab, 2.0);
    let bound = refill_bound(emptied);
    assert!(
        passed <= bound,
        "with the daemon dead: {passed} passed, at most {bound} (rate only, no fresh burst)"
    );
    assert!(passed > 0, "the limit still passes its rate");

    // A new daemon adopts the pins: same buckets, its own program, one on
    // the interface.
    let d = Daemon::pinned(&lab, &cfg, &pins, &[]).unwrap();
    assert!(
        d.log().contains("adopted the pinned datapath"),
        "{}",
        d.log()
    );
    let second_prog = program_id(&lab);
    assert_ne!(
        second_prog, first_prog,
        "the new daemon's program replaced the old one"
    );
    assert_eq!(
        lab.xdp_prog_ids().unwrap(),
        vec![second_prog],
        "exactly one program on the interface"
    );
    let (passed, _) = flood_for(&lab, 2.0);
    let bound = refill_bound(emptied);
    assert!(
        passed <= bound,
        "after the restart: {passed} passed, at most {bound} (no fresh burst)"
    );

    // A clean stop leaves it enforcing too; `detach` removes it all.
    let (status, log) = d.stop(libc::SIGTERM).unwrap();
    assert!(
        status.success() && log.contains("left attached and enforcing"),
        "{log}"
    );
    assert_eq!(lab.xdp_prog_ids().unwrap(), vec![second_prog]);
    let (status, out) = run_once(
        Some(&lab.b),
        &["detach", "--iface", VB, "--pin-dir", pins.arg()],
    )
    .unwrap();
    assert!(status.success(), "{out}");
    assert!(out.contains("detached rl from vb"), "{out}");
    assert!(!lab.xdp_attached().unwrap(), "detach left XDP attached");
    assert!(!pins.path().join(VB).exists(), "detach left pins behind");
    let (status, out) = run_once(
        Some(&lab.b),
        &["detach", "--iface", VB, "--pin-dir", pins.arg()],
    )
    .unwrap();
    assert!(
        status.success() && out.contains("nothing to detach"),
        "{out}"
    );
}

#[test]
fn a_restart_under_paced_traffic_swaps_the_program_without_losing_a_packet() {
    let lab = Lab::new().unwrap();
    let pins = BpfFs::new().unwrap();
    let dir = tempfile::tempdir().unwrap();
    let cfg = write(&dir, "rl.toml", &config(1024));
    let d = Daemon::pinned(&lab, &cfg, &pins, &[]).unwrap();
    let before = program_id(&lab);
    // 50 packets/s for 6 s: well under the limit.
    let rx = Receiver::start(&lab.b).unwrap();
    let sender = paced(&lab.a, lab.v4(1), lab.v4(2), 50, 300);
    std::thread::sleep(Duration::from_millis(1500));
    let (status, log) = d.stop(libc::SIGTERM).unwrap();
    assert!(status.success(), "{log}");
    let d = Daemon::pinned(&lab, &cfg, &pins, &["--detach-on-exit"]).unwrap();
    let after = program_id(&lab);
    let sent = join(sender).unwrap();
    let got = rx.finish().unwrap().get(&lab.v4(1)).copied().unwrap_or(0);
    assert_ne!(before, after, "the program was replaced");
    assert_eq!(
        got, sent.packets,
        "packets lost across the restart and program swap"
    );
    let (status, log) = d.stop(libc::SIGTERM).unwrap();
    assert!(
        status.success() && log.contains("detached and unpinned"),
        "{log}"
    );
    assert!(!lab.xdp_attached().unwrap());
}

/// The name of the XDP program on `vb`, as `ip -d link` shows it.
fn program_name(lab: &Lab) -> String {
    let out = lab.b.ip(&["-d", "link", "show", VB]).unwrap();
    let words: Vec<&str> = out.split_whitespace().collect();
    let at = words
        .iter()
        .position(|w| w.starts_with("prog/xdp"))
        .expect("an XDP program on vb");
    words[at..]
        .windows(2)
        .find(|w| w[0] == "name")
        .map(|w| w[1].to_string())
        .unwrap_or_default()
}

#[test]
fn an_upgrade_between_different_programs_under_paced_traffic_loses_nothing() {
    let lab = Lab::new().unwrap();
    let pins = BpfFs::new().unwrap();
    let dir = tempfile::tempdir().unwrap();
    let text = config(1024);
    let cfg = write(&dir, "rl.toml", &text);
    let d = Daemon::pinned(&lab, &cfg, &pins, &[]).unwrap();
    assert_eq!(program_name(&lab), "rl");
    let rx = Receiver::start(&lab.b).unwrap();
    let sender = paced(&lab.a, lab.v4(1), lab.v4(2), 50, 300);
    std::thread::sleep(Duration::from_millis(1500));
    let (status, log) = d.stop(libc::SIGTERM).unwrap();
    assert!(status.success(), "{log}");

    // Another version: a different program (the bare XDP_PASS one) takes
    // the pinned link over, atomically, with the pinned maps.
    use rl_control::{
        compile::compile,
        config::Config,
        datapath::{Datapath, LoadOptions},
    };
    let compiled = compile(&Config::from_str(&text, "<test>").unwrap());
    let mut other = Datapath::load_with(
        &compiled,
        LoadOptions {
            pin: Some(pins.path().join(VB)),
            ..Default::default()
        },
    )
    .unwrap();
    assert!(other.adopted());
    let other = lab
        .b
        .run(move || {
            other.attach_baseline(VB)?;
            Ok(other)
        })
        .unwrap();
    assert_eq!(
        program_name(&lab),
        "rl_pass",
        "the other program did not take the link over"
    );
    std::thread::sleep(Duration::from_millis(1500));
    drop(other);
    assert_eq!(
        program_name(&lab),
        "rl_pass",
        "the link stays pinned with the other program"
    );

    // And the limiter again, replacing a program that is not its own.
    let d = Daemon::pinned(&lab, &cfg, &pins, &["--detach-on-exit"]).unwrap();
    assert_eq!(program_name(&lab), "rl");
    assert_eq!(
        lab.xdp_prog_ids().unwrap().len(),
        1,
        "exactly one program on the interface"
    );
    let sent = join(sender).unwrap();
    let got = rx.finish().unwrap().get(&lab.v4(1)).copied().unwrap_or(0);
    assert_eq!(got, sent.packets, "packets lost across two program swaps");
    let (status, log) = d.stop(libc::SIGTERM).unwrap();
    assert!(status.success(), "{log}");
}

#[test]
fn a_second_daemon_on_the_same_pins_is_refused() {
    let lab = Lab::new().unwrap();
    let pins = BpfFs::new().unwrap();
    let dir = tempfile::tempdir().unwrap();
    let cfg = write(&dir, "rl.toml", &config(1024));
    let d = Daemon::pinned(&lab, &cfg, &pins, &["--detach-on-exit"]).unwrap();
    let prog = program_id(&lab);
    // Another runtime directory, so only the pins are shared.
    let other = dir.path().join("other");
    let args = [
        "run",
        "--iface",
        VB,
        "--config",
        cfg.to_str().unwrap(),
        "--pin-dir",
        pins.arg(),
        "--runtime-dir",
        other.to_str().unwrap(),
    ];
    let (status, out) = run_once(Some(&lab.b), &args).unwrap();
    assert_eq!(status.code(), Some(1), "{out}");
    assert!(
        out.contains("another rl-control is running on the datapath pinned in"),
        "{out}"
    );
    assert_eq!(
        lab.xdp_prog_ids().unwrap(),
        vec![prog],
        "the second daemon took the program over"
    );
    let (status, log) = d.stop(libc::SIGTERM).unwrap();
    assert!(status.success(), "{log}");
}

#[test]
fn an_incompatible_pinned_layout_is_refused_with_what_differs() {
    let lab = Lab::new().unwrap();
    let pins = BpfFs::new().unwrap();
    let dir = tempfile::tempdir().unwrap();
    let small = write(&dir, "small.toml", &config(1024));
    let big = write(&dir, "big.toml", &config(2048));
    let d = Daemon::pinned(&lab, &small, &pins, &[]).unwrap();
    let prog = program_id(&lab);
    let (status, log) = d.stop(libc::SIGTERM).unwrap();
    assert!(status.success(), "{log}");

    // Another capacity: refused, the pinned datapath untouched.
    let (status, out) = run_once(
        Some(&lab.b),
        &[
            "run",
            "--iface",
            VB,
            "--config",
            big.to_str().unwrap(),
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
        line.contains("does not fit this rl-control: RL_SRC4 holds"),
        "{line}"
    );
    assert!(
        line.contains(&format!(
            "rl-control detach --iface {VB} --pin-dir {}",
            pins.arg()
        )),
        "{line}"
    );
    assert_eq!(
        lab.xdp_prog_ids().unwrap(),
        vec![prog],
        "the refused daemon changed the interface"
    );

    // Other prefix cells: refused (a source limited in its /24 cell would
    // find a fresh /16 one).
    let coarse = write(
        &dir,
        "coarse.toml",
        &config(1024).replace("[datapath]\n", "[datapath]\nflood_prefix_v4 = 16\n"),
    );
    let (status, out) = run_once(
        Some(&lab.b),
        &[
            "run",
            "--iface",
            VB,
            "--config",
            coarse.to_str().unwrap(),
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
    assert!(line.contains("its prefix cells are IPv4 /24 and IPv6 /48 (datapath.flood_prefix_v4/v6), this configuration's /16 and /48"), "{line}");
    assert_eq!(lab.xdp_prog_ids().unwrap(), vec![prog]);

    // A map of the right shape made without BPF_F_MMAPABLE (as a
    // development build might pin): refused, the daemon could not map it.
    let known = pins.path().join(VB).join(rl_common::MAP_KNOWN);
    let held = aya::maps::MapData::from_pin(&known).unwrap();
    std::fs::remove_file(&known).unwrap();
    let plain: aya::maps::Array<aya::maps::MapData, u64> =
        aya::maps::Array::create(rl_common::KNOWN_ENTRIES, 0).unwrap();
    plain.pin(&known).unwrap();
    let (status, out) = run_once(
        Some(&lab.b),
        &[
            "run",
            "--iface",
            VB,
            "--config",
            small.to_str().unwrap(),
            "--pin-dir",
            pins.arg(),
        ],
    )
    .unwrap();
    assert_eq!(status.code(), Some(1), "{out}");
    assert!(
        out.contains("RL_KNOWN was created with flags 0x0, this build's are 0x400"),
        "{out}"
    );
    assert_eq!(lab.xdp_prog_ids().unwrap(), vec![prog]);
    std::fs::remove_file(&known).unwrap();
    held.pin(&known).unwrap();

    // Another layout version (as a future build would pin): refused too.
    set_layout_version(&pins.path().join(VB), 999);
    let (status, out) = run_once(
        Some(&lab.b),
        &[
            "run",
            "--iface",
            VB,
            "--config",
            small.to_str().unwrap(),
            "--pin-dir",
            pins.arg(),
        ],
    )
    .unwrap();
    assert_eq!(status.code(), Some(1), "{out}");
    assert!(
        out.contains(&format!(
            "its layout version is 999, this build's is {}",
            rl_common::LAYOUT_VERSION
        )),
        "{out}"
    );
    assert_eq!(lab.xdp_prog_ids().unwrap(), vec![prog]);
}

fn set_layout_version(dir: &std::path::Path, v: u32) {
    use aya::maps::{Array, Map, MapData};
    let data = MapData::from_pin(dir.join(rl_common::MAP_LAYOUT)).unwrap();
    let mut arr: Array<MapData, u32> = Array::try_from(Map::Array(data)).unwrap();
    arr.set(0, v, 0).unwrap();
}

/// A rule set with rule "w" (UDP 53, 3 an hour, `algorithm` appended)
/// compiled, and a pin directory `name` on a fresh bpffs, prepared.
fn pinned_w(
    algorithm: &str,
    name: &str,
) -> (rl_control::compile::Compiled, BpfFs, std::path::PathBuf) {
    use rl_control::{compile::compile, config::Config, datapath::prepare_pins};
    rl_tests::lab::require_root();
    let toml = format!(
        "[datapath]\nmax_sources = 1024\n[default]\nrate = 1000\n\
         [[rule]]\nname = \"w\"\nproto = \"udp\"\ndst_ports = [53]\nrate = 3\nper = \"1h\"\n{algorithm}"
    );
    let compiled = compile(&Config::from_str(&toml, "<test>").unwrap());
    let pins = BpfFs::new().unwrap();
    let dir = pins.path().join(name);
    prepare_pins(pins.path(), &dir).unwrap();
    (compiled, pins, dir)
}

/// Takes `ifaces` over with `dp` and `rules` (as the daemon starts),
/// inside the lab's protected namespace; returns the datapath and what
/// the take-over said.
fn take_over_in(
    lab: &Lab,
    mut dp: rl_control::datapath::Datapath,
    rules: &rl_control::compile::RuleSet,
    ifaces: &[&str],
) -> (
    rl_control::datapath::Datapath,
    Result<(), rl_control::datapath::DatapathError>,
) {
    let (rules, ifaces): (_, Vec<String>) = (
        rules.clone(),
        ifaces.iter().map(|i| i.to_string()).collect(),
    );
    lab.b
        .run(move || {
            let taken = dp
                .take_over(&rules, &ifaces, rl_control::datapath::AttachMode::Native)
                .map(|_| ());
            Ok((dp, taken))
        })
        .unwrap()
}

/// The known-keys filter pinned in `dir` (word 0: its control word).
fn known_word(dir: &std::path::Path) -> aya::maps::Array<aya::maps::MapData, u64> {
    use aya::maps::{Array, Map, MapData};
    Array::try_from(Map::Array(
        MapData::from_pin(dir.join(rl_common::MAP_KNOWN)).unwrap(),
    ))
    .unwrap()
}

/// The config entry pinned in `dir`.
fn config_entry(
    dir: &std::path::Path,
) -> aya::maps::Array<aya::maps::MapData, rl_common::DatapathConfig> {
    use aya::maps::{Array, Map, MapData};
    Array::try_from(Map::Array(
        MapData::from_pin(dir.join(rl_common::MAP_CONFIG)).unwrap(),
    ))
    .unwrap()
}

/// Zeroes the cell arrays' size in the config entry pinned in `dir`, as a
/// build older than that field leaves it; returns this build's.
fn as_an_older_build_left_it(dir: &std::path::Path) -> u16 {
    let mut c = config_entry(dir).get(&0, 0).unwrap();
    let ours = c.cell_slots_log2;
    c.cell_slots_log2 = 0;
    config_entry(dir).set(0, c, 0).unwrap();
    ours
}

/// Loads the datapath pinned in `dir`, or adopts it.
/// A restart keeps the wall-clock offset the pinned window counts were
/// made with: were the clock stepped (here: as if it had read an hour
/// behind when the datapath was made), a re-measured offset would move
/// every window, and a fixed window would read as a new one, its cap
/// fresh again.
#[test]
fn an_adopted_datapath_keeps_the_clock_its_windows_were_counted_by() {
    use aya::maps::{Array, Map, MapData};
    use rl_tests::frames::*;
    let (compiled, _pins, dir) = pinned_w("algorithm = \"fixed_window\"\n", "clock");
    let load = || load_pinned(&compiled, &dir);
    let frame = eth(&[], ETH_P_IP, &ipv4([192, 0, 2, 1], UDP, &[], &udp(53)));
    let dp = load();
    let config = || -> Array<MapData, rl_common::DatapathConfig> {
        Array::try_from(Map::Array(
            MapData::from_pin(dir.join(rl_common::MAP_CONFIG)).unwrap(),
        ))
        .unwrap()
    };
    let mut cfg = config().get(&0, 0).unwrap();
    let behind = cfg.epoch_offset_ns.wrapping_sub(3_600_000_000_000);
    cfg.epoch_offset_ns = behind;
    config().set(0, cfg, 0).unwrap();
    assert_eq!(rl_tests::offer(&dp, &frame, 5), (3, 2), "3 an hour");
    drop(dp);
    let dp = load();
    assert!(dp.adopted());
    assert_eq!(dp.epoch_offset_ns(), behind, "the pinned offset is kept");
    assert_eq!(
        rl_tests::offer(&dp, &frame, 2),
        (0, 2),
        "the window the key spent is still the one it is in"
    );
}

/// A restart keeps the pinned tick clock for good, through its take-over:
/// one measured again reads up to a tick from it (more if the start was
/// preempted at the tick's edge), or switches between ticks and ktime, and
/// a clock that steps back puts window limits into the window before,
/// whose count is another. Here the pinned datapath reads ktime (its tick
/// was not measured), then the tick clock of a start preempted 3 ms at
/// the edge.
#[test]
fn an_adopted_datapath_keeps_the_pinned_tick_clock_through_its_take_over() {
    use rl_control::datapath::{Datapath, LoadOptions};
    let lab = Lab::new().unwrap();
    let (compiled, _pins, dir) = pinned_w("algorithm = \"fixed_window\"\n", VB);
    let ktime = LoadOptions {
        pin: Some(dir.clone()),
        without_tick: true,
        ..Default::default()
    };
    let (dp, taken) = take_over_in(
        &lab,
        Datapath::load_with(&compiled, ktime).unwrap(),
        &compiled.rules,
        &[VB],
    );
    taken.unwrap();
    drop(dp);
    let dp = load_pinned(&compiled, &dir);
    assert!(dp.adopted());
    assert_eq!(
        dp.clock(),
        rl_common::TickClock::default(),
        "the pinned datapath read ktime: so does the restart"
    );
    let (dp, taken) = take_over_in(&lab, dp, &compiled.rules, &[VB]);
    taken.unwrap();
    assert_eq!(
        config_entry(&dir).get(&0, 0).unwrap().clock,
        rl_common::TickClock::default(),
        "after the take-over too"
    );
    drop(dp);

    // A tick clock measured 3 ms late: kept as it is.
    let mut entry = config_entry(&dir).get(&0, 0).unwrap();
    entry.clock = rl_common::TickClock {
        tick_ns: 4_000_000,
        offset_ns: 3_000_000,
    };
    config_entry(&dir).set(0, entry, 0).unwrap();
    let dp = load_pinned(&compiled, &dir);
    assert_eq!(
        dp.clock(),
        entry.clock,
        "the pinned tick clock, not one measured again"
    );
    let (dp, taken) = take_over_in(&lab, dp, &compiled.rules, &[VB]);
    taken.unwrap();
    assert_eq!(
        config_entry(&dir).get(&0, 0).unwrap().clock,
        entry.clock,
        "after the take-over too"
    );
    drop(dp);
}

/// The rules' counters live in the pinned maps: a restarted daemon, which
/// finds both rule tables unknown and writes its rules into both (as
/// `Datapath::take_over` does), goes on from the counts it finds under the rules'
/// ids, instead of clearing them.
#[test]
fn an_adopted_datapath_keeps_its_rules_counts() {
    use rl_control::{compile::compile, config::Config};
    use rl_tests::frames::*;
    let (compiled, _pins, dir) = pinned_w("", "counts");
    // As `Datapath::take_over` does (after its swap): both slots written.
    let start = || {
        let mut dp = load_pinned(&compiled, &dir);
        dp.install(&compiled.rules).unwrap();
        dp.install(&compiled.rules).unwrap();
        dp
    };
    let (w, other) = (
        eth(&[], ETH_P_IP, &ipv4([192, 0, 2, 1], UDP, &[], &udp(53))),
        eth(&[], ETH_P_IP, &ipv4([192, 0, 2, 1], UDP, &[], &udp(99))),
    );
    let dp = start();
    assert_eq!(rl_tests::offer(&dp, &w, 5), (3, 2), "3 an hour");
    assert_eq!(rl_tests::offer(&dp, &other, 4), (4, 0), "[default]");
    let before = dp.rule_stats().unwrap();
    assert_eq!(
        (
            before["w"].passed_pkts,
            before["w"].dropped_pkts,
            before["default"].passed_pkts
        ),
        (3, 2, 4)
    );
    drop(dp);
    // Two restarts: the counts stay in the pinned tables with their rules.
    drop(start());
    let dp = start();
    assert!(dp.adopted());
    let after = dp.rule_stats().unwrap();
    assert_eq!(after["w"], before["w"], "w's counts go on across restarts");
    assert_eq!(after["default"], before["default"], "[default]'s too");
    assert_eq!(
        rl_tests::offer(&dp, &w, 1),
        (0, 1),
        "and its bucket is kept"
    );
    assert_eq!(dp.rule_stats().unwrap()["w"].dropped_pkts, 3);
    let before = dp.rule_stats().unwrap();
    // Restarted again with a rule put before w: w's counts move to this
    // process's totals. The second install fails right after it took
    // them; the next one does not count them twice.
    drop(dp);
    let moved = "[datapath]\nmax_sources = 1024\n[default]\nrate = 1000\n[[rule]]\nname = \"v\"\nproto = \"udp\"\ndst_ports = [54]\nrate = 5\n\
        [[rule]]\nname = \"w\"\nproto = \"udp\"\ndst_ports = [53]\nrate = 3\nper = \"1h\"\n";
    let moved = compile(&Config::from_str(moved, "<test>").unwrap());
    assert_eq!(
        moved.rules.entries[2].id, compiled.rules.entries[1].id,
        "w, unchanged, one place on"
    );
    assert_eq!(moved.rules.names[2], "w");
    let mut dp = load_pinned(&moved, &dir);
    dp.fail_next_install_at("found");
    assert!(dp.install(&moved.rules).is_err());
    dp.install(&moved.rules).unwrap();
    dp.install(&moved.rules).unwrap();
    assert_eq!(
        dp.rule_stats().unwrap()["w"],
        before["w"],
        "w's counts, moved with it, counted once"
    );
}

/// An adopted datapath's rules are written only once this build's program
/// has replaced the pinned one, so the pinned program never reads a table
/// that a daemon of another build is changing (it would not heed this
/// build's marks). The failure injected at the first write of the rules
/// finds this build's program already attached, enforcing the pinned
/// rules, unchanged; had the rules been written before the swap, it would
/// find the pinned program. The next start puts the new rules in force.
#[test]
fn an_adopted_datapath_swaps_its_program_in_before_it_writes_a_rule() {
    use rl_control::{
        compile::{compile, Compiled},
        config::Config,
        datapath::{Datapath, DatapathError},
    };
    use rl_tests::frames::*;
    let lab = Lab::new().unwrap();
    let (compiled, _pins, dir) = pinned_w("", VB);
    // Loads or adopts the pins with `c`, fails its next install at `fail`,
    // and takes VB over.
    let take_over =
        |c: Compiled, fail: Option<&'static str>| -> (Datapath, Result<(), DatapathError>) {
            let mut dp = load_pinned(&c, &dir);
            if let Some(step) = fail {
                dp.fail_next_install_at(step);
            }
            take_over_in(&lab, dp, &c.rules, &[VB])
        };
    let w = eth(&[], ETH_P_IP, &ipv4([192, 0, 2, 1], UDP, &[], &udp(53)));
    let (dp, taken) = take_over(compiled, None);
    taken.unwrap();
    assert!(!dp.adopted());
    let first = lab.xdp_prog_ids().unwrap();
    assert_eq!(rl_tests::offer(&dp, &w, 4), (3, 1), "w: 3 an hour");
    drop(dp);

    let changed = || {
        let toml = "[datapath]\nmax_sources = 1024\n[default]\nrate = 1000\n\
            [[rule]]\nname = \"w\"\nproto = \"udp\"\ndst_ports = [53]\nrate = 5\nper = \"1h\"\n";
        compile(&Config::from_str(toml, "<test>").unwrap())
    };
    // The pinned config entry as an older build could leave it: after the
    // swap it must stay this build's, whatever fails.
    let ours = as_an_older_build_left_it(&dir);
    let (dp, taken) = take_over(changed(), Some("unnamed"));
    assert!(dp.adopted());
    let err = taken.expect_err("the injected failure");
    assert!(
        matches!(err, DatapathError::AfterSwap(_)),
        "the rules were written before the swap: {err}"
    );
    assert!(
        err.to_string()
            .contains("enforces the rule set that was pinned"),
        "{err}"
    );
    let now = lab.xdp_prog_ids().unwrap();
    assert_eq!(
        now.len(),
        1,
        "exactly one program on the interface: {now:?}"
    );
    assert_ne!(
        now, first,
        "this build's program was swapped in before the first write of a rule"
    );
    assert_eq!(
        config_entry(&dir).get(&0, 0).unwrap().cell_slots_log2,
        ours,
        "this build's settings stay once its program is in"
    );
    assert_eq!(
        rl_tests::offer(&dp, &w, 2),
        (0, 2),
        "the pinned rule, and its bucket, still in force"
    );
    drop(dp);

    let (dp, taken) = take_over(changed(), None);
    taken.unwrap();
    assert_eq!(lab.xdp_prog_ids().unwrap().len(), 1);
    assert_eq!(
        rl_tests::offer(&dp, &w, 6),
        (5, 1),
        "the new rule in force (a changed rule starts afresh)"
    );
    drop(dp);

    // Pins whose link is gone (its pin removed: the program detached): the
    // adopting daemon attaches afresh, and a failure writing the rules
    // then detaches it again, leaving the interface as it found it.
    std::fs::remove_file(dir.join(format!("link-native-{VB}"))).unwrap();
    assert!(!lab.xdp_attached().unwrap());
    let (dp, taken) = take_over(changed(), Some("unnamed"));
    assert!(
        matches!(taken, Err(DatapathError::AfterSwap(_))),
        "{:?}",
        taken.err()
    );
    assert!(
        !lab.xdp_attached().unwrap(),
        "a program attached afresh is detached again"
    );
    drop(dp);

    // A pinned link whose interface was deleted and made again under the
    // same name is defunct (the kernel answers ENOLINK): attached afresh.
    // Any other failure to swap (one injected just before: EPERM) keeps
    // the pinned link, its pin and its program, and fails the start.
    take_over(changed(), None).1.unwrap();
    let pinned_program = lab.xdp_prog_ids().unwrap();
    let valid = rl_common::KNOWN_VALID | rl_common::KNOWN_HALF;
    known_word(&dir).set(0, valid, 0).unwrap();
    // Loaded, not yet swapped in: the filter off, in the half the pinned
    // program marks meanwhile (had it been switched, a put-back word
    // would trust a half without their bits).
    drop(load_pinned(&changed(), &dir));
    assert_eq!(
        known_word(&dir).get(&0, 0).unwrap(),
        rl_common::KNOWN_HALF,
        "off, the same half"
    );
    as_an_older_build_left_it(&dir);
    let settings = config_entry(&dir).get(&0, 0).unwrap();
    // The pinned program's known-keys filter valid (as a walk leaves it):
    // a start that fails before its swap leaves it so.
    known_word(&dir).set(0, valid, 0).unwrap();
    let (dp, taken) = take_over(changed(), Some("swap"));
    let err = taken.expect_err("the swap refused");
    assert!(
        err.to_string().contains("keeps its program")
            && err.to_string().contains("rl-control detach"),
        "{err}"
    );
    assert_eq!(
        lab.xdp_prog_ids().unwrap(),
        pinned_program,
        "the pinned link keeps its program"
    );
    assert!(
        dir.join(format!("link-native-{VB}")).exists(),
        "and its pin"
    );
    assert_eq!(
        config_entry(&dir).get(&0, 0).unwrap(),
        settings,
        "the settings put back"
    );
    assert_eq!(
        known_word(&dir).get(&0, 0).unwrap(),
        valid,
        "the pinned filter put back (left off, a flood would pay table lookups until a walk)"
    );
    assert_eq!(
        rl_tests::offer(&dp, &w, 1),
        (0, 1),
        "the pinned rule still in force"
    );
    drop(dp);

    // A failure after the kernel swapped the program in, in this process's
    // bookkeeping of the link (taking it from aya, holding its fd): the
    // start fails, yet this build's program enforces the pinned rules in
    // the pinned link, under this build's settings, and a restart takes
    // the link over again.
    let (dp, taken) = take_over(changed(), Some("swapped"));
    let err = taken.expect_err("the injected failure");
    assert!(err.to_string().contains("after step swapped"), "{err}");
    let now = lab.xdp_prog_ids().unwrap();
    assert_eq!(
        now.len(),
        1,
        "exactly one program on the interface: {now:?}"
    );
    assert_ne!(now, pinned_program, "this build's program is in the link");
    assert!(
        dir.join(format!("link-native-{VB}")).exists(),
        "the link stays pinned"
    );
    assert_eq!(
        config_entry(&dir).get(&0, 0).unwrap().cell_slots_log2,
        ours,
        "this build's settings stay once its program is in"
    );
    assert_eq!(
        rl_tests::offer(&dp, &w, 1),
        (0, 1),
        "the pinned rule still in force"
    );
    drop(dp);
    assert_eq!(
        lab.xdp_prog_ids().unwrap(),
        now,
        "the link outlives the process that failed"
    );
    let (dp, taken) = take_over(changed(), None);
    taken.expect("a restart takes the link over again");
    assert_eq!(lab.xdp_prog_ids().unwrap().len(), 1);
    assert_eq!(
        rl_tests::offer(&dp, &w, 1),
        (0, 1),
        "the pinned rule's bucket kept"
    );
    drop(dp);

    lab.b.ip(&["link", "del", VB]).unwrap();
    lab.a
        .ip(&["link", "add", VA, "type", "veth", "peer", "name", VB])
        .unwrap();
    lab.a
        .ip(&["link", "set", VB, "netns", &lab.b.name])
        .unwrap();
    lab.b.ip(&["link", "set", VB, "up"]).unwrap();
    assert!(!lab.xdp_attached().unwrap());
    let (dp, taken) = take_over(changed(), None);
    taken.expect("a defunct pinned link is replaced");
    assert_eq!(lab.xdp_prog_ids().unwrap().len(), 1, "attached afresh");
    assert_eq!(rl_tests::offer(&dp, &w, 1), (0, 1), "with the buckets kept");
}

/// An entry that an older build emptied (its mark was `NO_RULE_ID` alone,
/// the flag clear) and that this build fills is marked before it is
/// filled, as a rule's entry that changes is: filled in one write, its id
/// and flags would change at once, and a fragment whose verdict names the
/// rule coming back could read it half-written.
#[test]
fn an_entry_an_older_build_emptied_is_marked_before_it_is_filled() {
    use aya::maps::{Array, Map, MapData};
    use rl_common::{RuleEntry, NO_RULE_ID, RULE_SLOTS, RULE_UNNAMED};
    let (compiled, _pins, dir) = pinned_w("", "emptied");
    let mut dp = load_pinned(&compiled, &dir);
    dp.install(&compiled.rules).unwrap();
    drop(dp);
    // w's entry (1) and the one past the rules (2), in both slots, as an
    // older build empties a place.
    let mut rules: Array<MapData, RuleEntry> = Array::try_from(Map::Array(
        MapData::from_pin(dir.join(rl_common::MAP_RULES)).unwrap(),
    ))
    .unwrap();
    let emptied = RuleEntry {
        id: NO_RULE_ID,
        ..Default::default()
    };
    for slot in 0..2 {
        rules.set(slot * RULE_SLOTS + 1, emptied, 0).unwrap();
        rules.set(slot * RULE_SLOTS + 2, emptied, 0).unwrap();
    }
    let mut dp = load_pinned(&compiled, &dir);
    assert!(dp.adopted());
    let entry = (dp.active_slot().expect("the pinned slot") ^ 1) * RULE_SLOTS + 1;
    dp.fail_next_install_at("unnamed");
    assert!(dp.install(&compiled.rules).is_err());
    let marked = RuleEntry {
        id: NO_RULE_ID,
        flags: RULE_UNNAMED,
        ..Default::default()
    };
    assert_eq!(
        dp.rule_table_entry(entry).unwrap(),
        marked,
        "marked, and nothing else written, before the fill"
    );
    dp.install(&compiled.rules).unwrap();
    let filled = dp.rule_table_entry(entry).unwrap();
    assert_eq!(
        (filled.id, filled.flags & RULE_UNNAMED),
        (compiled.rules.entries[1].id, 0),
        "filled, the mark lifted"
    );
    // Past the rules: marked by the installs into the slot read whole, so
    // that a later change that fills it (this process knows only the
    // entries it wrote) need not.
    assert_eq!(
        dp.rule_table_entry(entry + 1).unwrap(),
        marked,
        "the place past the rules, marked too"
    );
}

/// Adopting writes this build's settings into the pinned config entry (an
/// older build's may lack some: the cell arrays' size was carved from its
/// `enabled`), keeping its slot, flags and clock, which the pinned rules'
/// limits were set for. A start that fails before its swap (here, a rule
/// set too large, refused before anything else changes) puts the entry
/// back as it was found and leaves the pinned program in place.
#[test]
fn adopting_writes_this_builds_settings_and_a_failed_start_puts_them_back() {
    let lab = Lab::new().unwrap();
    let (compiled, _pins, dir) = pinned_w("", VB);
    take_over_in(&lab, load_pinned(&compiled, &dir), &compiled.rules, &[VB])
        .1
        .unwrap();
    let pinned_program = lab.xdp_prog_ids().unwrap();
    let entry = || config_entry(&dir);
    // As an older build could have left it.
    let mut old = entry().get(&0, 0).unwrap();
    (old.cell_slots_log2, old.flood_cap, old.clock.tick_ns) = (0, 7, old.clock.tick_ns + 1);
    entry().set(0, old, 0).unwrap();

    let dp = load_pinned(&compiled, &dir);
    assert!(dp.adopted());
    let now = dp.config().unwrap();
    let slots_log2 = rl_common::cell_slots(compiled.flood_prefixes).trailing_zeros() as u16;
    assert_eq!(
        (now.cell_slots_log2, now.enabled),
        (slots_log2, 1),
        "this build's cell arrays"
    );
    assert_ne!(now.flood_cap, 7, "this build's flood cap");
    assert_eq!(
        (now.clock, now.slot_flags, now.epoch_offset_ns),
        (old.clock, old.slot_flags, old.epoch_offset_ns),
        "the pinned slot, flags and clock"
    );

    let mut too_large = compiled.rules.clone();
    too_large.decide = (0..=rl_common::DECIDE_SLOT_LEN)
        .map(|i| ((1 + (i >> 16) as u16, i as u16), 0))
        .collect();
    let (dp, taken) = take_over_in(&lab, dp, &too_large, &[VB]);
    let err = taken.expect_err("a rule set too large");
    assert!(
        err.to_string()
            .contains("rule decision entries, more than the"),
        "{err}"
    );
    assert_eq!(
        entry().get(&0, 0).unwrap(),
        old,
        "the config entry put back as it was found"
    );
    assert_eq!(
        lab.xdp_prog_ids().unwrap(),
        pinned_program,
        "the pinned program stays"
    );
    drop(dp);
}

/// On two interfaces: the first's pinned link is taken over, the second
/// refuses (another program holds it). The start fails, naming it; the
/// first keeps this build's program, which reads this build's settings
/// (the config entry is not put back once a link was taken over), and
/// the pinned rule stays in force.
#[test]
fn a_start_that_fails_on_a_second_interface_after_a_swap_keeps_this_builds_settings() {
    use rl_control::datapath::DatapathError;
    use rl_tests::{frames::*, lab::VB2};
    let lab = Lab::new().unwrap();
    lab.second_pair().unwrap();
    let (compiled, _pins, dir) = pinned_w("", "two");
    take_over_in(&lab, load_pinned(&compiled, &dir), &compiled.rules, &[VB])
        .1
        .unwrap();
    let pinned_program = lab.xdp_prog_ids().unwrap();
    // Another program on the second interface, held while the start runs.
    let mut other = rl_tests::datapath("[default]\nrate = 1\n").unwrap();
    let other = lab
        .b
        .run(move || {
            other
                .attach_baseline(VB2)
                .map(|()| other)
                .map_err(Into::into)
        })
        .unwrap();
    let ours = as_an_older_build_left_it(&dir);

    let (dp, taken) = take_over_in(
        &lab,
        load_pinned(&compiled, &dir),
        &compiled.rules,
        &[VB, VB2],
    );
    assert!(
        matches!(taken, Err(DatapathError::InterfaceBusy(ref i)) if i == VB2),
        "{:?}",
        taken.err()
    );
    let now = lab.xdp_prog_ids().unwrap();
    assert_eq!(now.len(), 1);
    assert_ne!(
        now, pinned_program,
        "the first interface's pinned link was taken over"
    );
    assert_eq!(
        config_entry(&dir).get(&0, 0).unwrap().cell_slots_log2,
        ours,
        "this build's settings, which its program needs, stay"
    );
    let w = eth(&[], ETH_P_IP, &ipv4([192, 0, 2, 1], UDP, &[], &udp(53)));
    assert_eq!(
        rl_tests::offer(&dp, &w, 4),
        (3, 1),
        "the pinned rule in force"
    );
    drop((dp, other));
}

/// Once an adopting daemon's rules are in force, a failure writing them
/// into the second table only warns: the start succeeds, and the next
/// change writes that table whole.
#[test]
fn a_take_over_whose_second_table_fails_still_puts_the_rules_in_force() {
    use rl_control::{compile::compile, config::Config};
    use rl_tests::frames::*;
    let lab = Lab::new().unwrap();
    let (compiled, _pins, dir) = pinned_w("", VB);
    let w_at = |rate: u32| {
        let toml = format!("[datapath]\nmax_sources = 1024\n[default]\nrate = 1000\n[[rule]]\nname = \"w\"\nproto = \"udp\"\ndst_ports = [53]\nrate = {rate}\nper = \"1h\"\n");
        compile(&Config::from_str(&toml, "<test>").unwrap())
    };
    take_over_in(&lab, load_pinned(&compiled, &dir), &compiled.rules, &[VB])
        .1
        .unwrap();
    let five = w_at(5);
    let mut dp = load_pinned(&five, &dir);
    // Each install passes "unnamed" once: the second one fails there.
    dp.fail_install_at("unnamed", 1);
    let (mut dp, taken) = take_over_in(&lab, dp, &five.rules, &[VB]);
    taken.expect("the start succeeds");
    let w = eth(&[], ETH_P_IP, &ipv4([192, 0, 2, 1], UDP, &[], &udp(53)));
    assert_eq!(rl_tests::offer(&dp, &w, 6), (5, 1), "the new rule in force");
    dp.install(&w_at(7).rules).unwrap();
    assert_eq!(
        rl_tests::offer(&dp, &w, 8),
        (7, 1),
        "the next change, into the table whose write failed, in force"
    );
}

/// A pinned link whose interface was moved to another network namespace,
/// another interface taking its name here, is refused, naming the pin:
/// swapping it would leave the interface here without a program while
/// reporting one. The moved interface keeps its program.
#[test]
fn a_pinned_link_on_an_interface_moved_away_is_refused() {
    moved_away(false);
}

/// The kernel keeps a moved interface's index where it is free there, and
/// a new interface may get that index here (`ip link add … index N`, or
/// the cyclic allocator coming round): the index alone cannot tell the two
/// apart, the program attached here can.
#[test]
fn a_pinned_link_on_an_interface_moved_away_is_refused_under_the_same_index() {
    moved_away(true);
}

/// Moves the pinned link's interface to a third namespace and makes a new
/// veth of its name here (`same_index`: under its index too); a start must
/// refuse the pinned link and leave both interfaces as they are.
fn moved_away(same_index: bool) {
    use rl_control::datapath::DatapathError;
    let lab = Lab::new().unwrap();
    let away = rl_tests::lab::Netns::new(format!("rl-lab{}-c", lab.id)).unwrap();
    let (compiled, _pins, dir) = pinned_w("", VB);
    let take_over = |dp| take_over_in(&lab, dp, &compiled.rules, &[VB]);
    take_over(load_pinned(&compiled, &dir)).1.unwrap();
    let index = |ns: &rl_tests::lab::Netns| -> String {
        let out = ns.ip(&["-o", "link", "show", VB]).unwrap();
        out.split(':').next().unwrap().trim().to_string()
    };
    // The pinned program's settings, as an older build left them: a
    // refusal before any link was swapped must put them back.
    as_an_older_build_left_it(&dir);
    let settings = config_entry(&dir).get(&0, 0).unwrap();
    let was = index(&lab.b);
    lab.b.ip(&["link", "set", VB, "netns", &away.name]).unwrap();
    assert_eq!(index(&away), was, "the moved interface keeps its index");
    // With an index asked for, the peer needs one of its own too: veth
    // would give it the same.
    let mut add = vec!["link", "add", VB];
    if same_index {
        add.extend(["index", was.as_str()]);
    }
    add.extend(["type", "veth", "peer", "name", "vbx"]);
    if same_index {
        add.extend(["index", "4000"]);
    }
    lab.b.ip(&add).unwrap();
    lab.b.ip(&["link", "set", VB, "up"]).unwrap();
    assert_eq!(index(&lab.b) == was, same_index);
    let (dp, taken) = take_over(load_pinned(&compiled, &dir));
    let err = taken.expect_err("a link on another interface");
    assert!(matches!(err, DatapathError::Attach { .. }), "{err}");
    assert!(
        err.to_string()
            .contains("moved to another network namespace")
            && err.to_string().contains("rl-control detach"),
        "{err}"
    );
    assert!(
        !lab.xdp_attached().unwrap(),
        "the interface here gets no program it would not have"
    );
    assert!(
        away.ip(&["-d", "link", "show", VB])
            .unwrap()
            .contains("prog/xdp"),
        "the moved interface keeps its program"
    );
    assert_eq!(
        config_entry(&dir).get(&0, 0).unwrap(),
        settings,
        "its settings put back as they were found"
    );
    drop(dp);
}
