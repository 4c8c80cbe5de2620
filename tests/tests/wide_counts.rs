//! Rule ids and their wide-cell counts across installs and adoption
//! (`compile::part_wide_counts`): a rule new to the rule tables gets a count
//! of its own, a rule keeps the id the tables hold for it through restarts,
//! and rules an older build left sharing one keep their ids and are named
//! to the operator. (A flood under one of two such rules: `wide_cells.rs`.)

use std::path::Path;

use aya::maps::{Array, Map, MapData};
use rl_common::{wide_entry, RuleEntry, RULE_SLOTS, RULE_STEPS_MASK};
use rl_control::{
    compile::{compile, Compiled},
    config::Config,
    datapath::{prepare_pins, Datapath},
};
use rl_tests::{
    daemon::{run_once, write, Daemon},
    lab::{require_root, BpfFs, Lab, VB},
    load_pinned,
};

const BASE: &str = "[datapath]\nmax_sources = 1024\n[default]\nrate = 1000\n";

/// A "3 per hour" UDP rule.
fn rule(name: &str, port: u16) -> String {
    format!("[[rule]]\nname = \"{name}\"\nproto = \"udp\"\ndst_ports = [{port}]\nrate = 3\nper = \"1h\"\n")
}

/// `BASE` and two rules, x (UDP 53) and y (UDP 54), whose ids as compiled
/// share a wide-cell count: x's name and the rule file.
fn sharing_pair() -> (String, String) {
    let x = rl_tests::sharing_a_wide_count(BASE, "x", |n| rule(n, 53), &rule("y", 54));
    let toml = format!("{BASE}{}{}", rule(&x, 53), rule("y", 54));
    (x, toml)
}

fn compiled(toml: &str) -> Compiled {
    compile(&Config::from_str(toml, "<test>").unwrap())
}

/// Rule `i` of the active table.
fn installed(dp: &Datapath, i: u32) -> RuleEntry {
    dp.rule_table_entry(dp.active_slot().unwrap() * RULE_SLOTS + i)
        .unwrap()
}

/// Rewrites rule `i` of both pinned rule tables in `pins` as a build
/// before the parting left it: under `id`, no steps kept.
fn as_an_older_build_left(pins: &Path, i: u32, id: u32) {
    let mut rules: Array<MapData, RuleEntry> = Array::try_from(Map::Array(
        MapData::from_pin(pins.join(rl_common::MAP_RULES)).unwrap(),
    ))
    .unwrap();
    for slot in 0..2 {
        let mut e = rules.get(&(slot * RULE_SLOTS + i), 0).unwrap();
        (e.id, e.flags) = (id, e.flags & !RULE_STEPS_MASK);
        rules.set(slot * RULE_SLOTS + i, e, 0).unwrap();
    }
}

/// Rule tables an older build wrote, where two rules' ids share a
/// wide-cell count: adopted, both rules keep their ids (and so their
/// buckets) through every install, and the datapath names the pair for
/// the daemon's warning. A rule new to the tables gets a count of its own.
#[test]
fn an_older_builds_rules_that_share_a_wide_count_keep_their_ids_and_are_named() {
    require_root();
    let (x, toml) = sharing_pair();
    let compiled = compiled(&toml);
    let natural: Vec<u32> = compiled.rules.entries.iter().map(|e| e.id).collect();
    assert_eq!(wide_entry(natural[1], 0), wide_entry(natural[2], 0));
    let pins = BpfFs::new().unwrap();
    let dir = pins.path().join("shared");
    prepare_pins(pins.path(), &dir).unwrap();
    let dp = load_pinned(&compiled, &dir);
    assert_eq!(installed(&dp, 1).id, natural[1]);
    let moved = installed(&dp, 2).id;
    assert_ne!(moved, natural[2], "this build parts them");
    drop(dp);
    // Adopted (a restart): y keeps the id it was moved to, and its buckets.
    let mut dp = load_pinned(&compiled, &dir);
    assert!(dp.adopted());
    for _ in 0..2 {
        dp.install(&compiled.rules).unwrap();
        assert_eq!(
            (installed(&dp, 1).id, installed(&dp, 2).id),
            (natural[1], moved),
            "a restart keeps the moved id"
        );
    }
    assert!(dp.wide_count_notes().is_empty());
    drop(dp);
    // Restarted without x (removed while the daemon was down): y keeps the
    // id the tables hold for it, though its own would now be free.
    let only_y = self::compiled(&format!("{BASE}{}", rule("y", 54)));
    let mut dp = load_pinned(&only_y, &dir);
    dp.install(&only_y.rules).unwrap();
    assert_eq!(
        installed(&dp, 1).id,
        moved,
        "the id read back from the adopted tables"
    );
    drop(dp);
    as_an_older_build_left(&dir, 2, natural[2]);
    let mut dp = load_pinned(&compiled, &dir);
    assert!(dp.adopted());
    for _ in 0..2 {
        dp.install(&compiled.rules).unwrap();
        assert_eq!(
            (installed(&dp, 1).id, installed(&dp, 2).id),
            (natural[1], natural[2]),
            "ids the tables hold are kept"
        );
    }
    let notes = dp.wide_count_notes();
    assert_eq!(notes.len(), 1, "{notes:?}");
    assert!(
        notes[0].starts_with(&format!("rules {x} and y share a wide-cell count")),
        "{notes:?}"
    );
    // A rule new to the tables whose id would share theirs gets its own.
    let z = rl_tests::sharing_a_wide_count(
        &format!("{BASE}{}", rule(&x, 53)),
        "z",
        |n| rule(n, 55),
        &rule("y", 54),
    );
    let more = self::compiled(&format!("{toml}{}", rule(&z, 55)));
    assert_eq!(
        wide_entry(more.rules.entries[3].id, 0),
        wide_entry(natural[2], 0)
    );
    dp.install(&more.rules).unwrap();
    let (ex, ey, ez) = (installed(&dp, 1), installed(&dp, 2), installed(&dp, 3));
    assert_eq!((ex.id, ey.id), (natural[1], natural[2]));
    assert!(
        wide_entry(ez.id, 0) != wide_entry(ey.id, 0),
        "the new rule parted from them"
    );
    assert_eq!(dp.wide_count_notes().len(), 1, "still only the older pair");
}

/// The operator is told of rules that share a wide-cell count, and how to
/// part them: none when this build made the tables (a fresh datapath parts
/// them, and `check-config` says nothing), a warning naming the pair at
/// start and at each reload when an older build's tables hold them so.
#[test]
fn the_daemon_warns_of_rules_that_share_a_wide_count_in_tables_it_adopts() {
    let lab = Lab::new().unwrap();
    let pins = BpfFs::new().unwrap();
    let dir = tempfile::tempdir().unwrap();
    let (x, toml) = sharing_pair();
    let natural = compiled(&toml).rules.entries[2].id;
    let cfg = write(&dir, "rl.toml", &toml);
    let note = |out: &str| {
        out.lines()
            .filter(|l| l.contains("share a wide-cell count"))
            .map(str::to_string)
            .collect::<Vec<_>>()
    };
    let (status, out) = run_once(None, &["check-config", cfg.to_str().unwrap()]).unwrap();
    assert!(
        status.success() && note(&out).is_empty(),
        "a fresh datapath parts them:\n{out}"
    );
    let d = Daemon::pinned(&lab, &cfg, &pins, &[]).unwrap();
    let (status, log) = d.stop(libc::SIGTERM).unwrap();
    assert!(status.success() && note(&log).is_empty(), "{log}");
    as_an_older_build_left(&pins.path().join(VB), 2, natural);
    let d = Daemon::pinned(&lab, &cfg, &pins, &[]).unwrap();
    let (status, out) = run_once(Some(&lab.b), &["reload"]).unwrap();
    assert!(status.success(), "{out}");
    let (status, log) = d.stop(libc::SIGTERM).unwrap();
    assert!(status.success(), "{log}");
    let warned = note(&log);
    assert_eq!(warned.len(), 2, "at the start and at the reload:\n{log}");
    assert!(
        warned.iter().all(|l| l.contains("WARN")
            && l.contains(&format!("rules {x} and y share"))
            && l.contains("rename one")),
        "{log}"
    );
    let (status, out) = run_once(
        Some(&lab.b),
        &["detach", "--iface", VB, "--pin-dir", pins.arg()],
    )
    .unwrap();
    assert!(status.success(), "{out}");
}
