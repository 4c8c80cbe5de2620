//! Prefix cells in their arrays (`rl_common::cells`), through TestRun: an
//! unseen key in flood mode is charged to its /24's cell; the collector
//! frees cells that are fresh again and keeps the rest; the cluster sync
//! reads and raises cells; a cell charged while the collector frees it is
//! kept, and its prefix claims nothing while it is being freed; and a cell
//! an older build left in the sources' table is moved into the array before
//! the program swap, without losing its state: by the datapath, and end to
//! end by a daemon started on such pins, with real packets through veth.

use aya::maps::{HashMap, Map, MapData};
use rl_common::{Bucket, Key4, KEY_CELL, STAT_FALLBACK, STAT_NEW_CELLS};
use rl_control::{
    compile::compile,
    config::Config,
    datapath::{
        collect,
        share::{scan_shared, BucketId, Tables},
        CellArray, Datapath, Pass, COLLECT_IDLE_NS,
    },
};
use rl_tests::{datapath, frames::*, lab::require_root, offer};

fn to(src: [u8; 4], port: u16) -> Vec<u8> {
    eth(&[], ETH_P_IP, &ipv4(src, UDP, &[], &udp(port)))
}

/// `flood_rules` with flood mode always on: every unseen key goes to its cell.
fn rules() -> String {
    rl_tests::flood_rules(1024).replace("flood_new_keys_per_sec = 2000", "flood_new_keys_per_sec = 0")
}

/// The cell key of `src` under limit 0 of rule `index` (0 `[default]`, 2 "once").
fn cell_key(index: usize, src: [u8; 4]) -> Key4 {
    let compiled = compile(&Config::from_str(&rules(), "<test>").unwrap());
    let k = compiled.rules.entries[index].key4(0, u32::from_ne_bytes(src));
    Key4 { rule: k.rule | KEY_CELL, addr: k.addr & u32::from_ne_bytes([255, 255, 255, 0]) }
}

/// A datapath where one packet from `prefix.1` to "once" (1 per hour) made
/// the /24's cell: the datapath, its cells, the cell's key and slot.
fn once_cell(prefix: [u8; 3]) -> (Datapath, CellArray<Key4>, Key4, u32) {
    require_root();
    let dp = datapath(&rules()).unwrap();
    let cells = dp.cells_v4().unwrap();
    let [a, b, c] = prefix;
    let key = cell_key(2, [a, b, c, 0]);
    assert_eq!(offer(&dp, &to([a, b, c, 1], 9999), 1), (1, 0), "the hour's one packet passes");
    let i = cells.find(&key).expect("its cell was made");
    (dp, cells, key, i)
}

fn pass(dp: &Datapath) -> Pass {
    let limits = dp.limits_by_key().unwrap();
    collect(dp.table_ids().unwrap(), dp.epoch_offset_ns(), &limits, &dp.known_filter().unwrap()).expect("a collector pass")
}

#[test]
fn unseen_keys_share_their_prefix_cell_and_the_collector_frees_it_once_fresh() {
    require_root();
    let dp = datapath(&rules()).unwrap();
    let cells = dp.cells_v4().unwrap();
    // Two newcomers of one /24 under "once" (1 per hour): one cell, one pass.
    let got = offer(&dp, &to([10, 9, 9, 1], 9999), 1).0 + offer(&dp, &to([10, 9, 9, 2], 9999), 1).0;
    assert_eq!(got, 1, "newcomers of one /24 share its 1-per-hour cell");
    let c = dp.counters().unwrap();
    assert!(c.get(STAT_FALLBACK) >= 2 && c.get(STAT_NEW_CELLS) == 1, "one cell claimed, both charged to it: {c}");
    let once = cells.find(&cell_key(2, [10, 9, 9, 0])).expect("the cell is in the array");
    assert_eq!(cells.get(once).bucket.passed, 1);
    // A newcomer of another /24 gets a cell of its own.
    assert_eq!(offer(&dp, &to([10, 9, 10, 1], 9999), 1), (1, 0));
    // Cells under [default] (1,000/s) are fresh again within milliseconds.
    for i in 0..20u8 {
        assert_eq!(offer(&dp, &to([10, 20, i, 1], 5000), 1), (1, 0));
    }
    let before = pass(&dp);
    assert_eq!(before.cells.0, 22, "every cell is counted and none is fresh yet for a second: {before:?}");
    std::thread::sleep(std::time::Duration::from_nanos(COLLECT_IDLE_NS + 200_000_000));
    let after = pass(&dp);
    assert_eq!((after.cells.0, after.collected), (2, 20), "the [default] cells were freed, the 1-per-hour ones kept: {after:?}");
    assert!(cells.find(&cell_key(0, [10, 20, 0, 1])).is_none());
    // The /24 that used its hour stays limited.
    assert_eq!(offer(&dp, &to([10, 9, 9, 3], 9999), 1), (0, 1));
}

#[test]
fn the_cluster_sync_reads_and_raises_cells() {
    require_root();
    let dp = datapath(&rules()).unwrap();
    assert_eq!(offer(&dp, &to([10, 7, 7, 1], 9999), 1), (1, 0));
    let key = cell_key(2, [10, 7, 7, 0]);
    let once = key.rule & !KEY_CELL;
    let ids = dp.table_ids().unwrap();
    let shared = scan_shared(ids, |r| r == once).unwrap();
    assert!(shared.iter().any(|b| b.id == BucketId::V4(key) && b.bucket.passed == 1), "the cell is shared: {shared:?}");
    // Another /24's cell, fresh: raised by the cluster to an hour ahead.
    assert_eq!(offer(&dp, &to([10, 7, 8, 1], 9999), 1), (1, 0));
    let fresh = cell_key(2, [10, 7, 8, 0]);
    let mut tables = Tables::open(ids).unwrap();
    let hour_ahead = rl_control::datapath::monotonic_ns() + 3_600_000_000_000;
    assert!(tables.raise(&BucketId::V4(fresh), hour_ahead), "the cell moved up");
    assert!(!tables.raise(&BucketId::V4(fresh), hour_ahead - 1), "never down");
    assert_eq!(offer(&dp, &to([10, 7, 8, 2], 9999), 1), (0, 1), "other hosts' usage now limits this /24");
    assert!(!tables.raise(&BucketId::V4(cell_key(2, [10, 7, 99, 0])), hour_ahead), "no such cell");
}

#[test]
fn a_cell_an_older_build_kept_in_the_sources_table_moves_to_the_array_and_keeps_limiting() {
    use rl_control::datapath::LoadOptions;
    require_root();
    let pins = rl_tests::lab::BpfFs::new().unwrap();
    let dir = pins.path().join("cells");
    rl_control::datapath::prepare_pins(pins.path(), &dir).unwrap();
    let compiled = compile(&Config::from_str(&rules(), "<test>").unwrap());
    let load = || Datapath::load_with(&compiled, LoadOptions { pin: Some(dir.clone()), ..Default::default() }).unwrap();
    // As an older build left it: a drained 1-per-hour cell in the sources'
    // table, and no cell arrays pinned.
    let key = cell_key(2, [10, 5, 5, 0]);
    let drained = rl_control::datapath::monotonic_ns() + 3_000_000_000_000;
    {
        let dp = load();
        assert!(!dp.cells_in_tables(), "fresh pins");
        let mut table: HashMap<MapData, Key4, Bucket> =
            HashMap::try_from(Map::HashMap(MapData::from_id(dp.table_ids().unwrap().tables.0).unwrap())).unwrap();
        table.insert(key, Bucket { tat_ns: drained, passed: 1, ..Bucket::default() }, 0).unwrap();
    }
    for name in [rl_common::MAP_CELLS_V4, rl_common::MAP_CELLS_V6, rl_common::MAP_CELL_COUNT] {
        std::fs::remove_file(dir.join(name)).unwrap();
    }
    // A daemon that stops before it has moved them moves them at its next start.
    assert!(load().cells_in_tables());
    let mut dp = load();
    assert!(dp.adopted() && dp.cells_in_tables(), "the daemon must move the cells before its swap");
    // (The pin directory is held by `dp`: a second load would be refused.)
    let load_again_sees_cells_in_tables = |d: &std::path::Path| !d.join(rl_common::MAP_CELL_COUNT).exists();
    let ids = dp.table_ids().unwrap();
    let mut table: HashMap<MapData, Key4, Bucket> =
        HashMap::try_from(Map::HashMap(MapData::from_id(ids.tables.0).unwrap())).unwrap();
    let cells = dp.cells_v4().unwrap();
    assert!(cells.find(&key).is_none());
    // The daemon copies it before it swaps its program in: the new program
    // finds it at once, not a copy of the rule's last resort.
    assert_eq!(dp.move_old_cells().unwrap(), 1);
    assert!(load_again_sees_cells_in_tables(&dir), "not marked done before the swap");
    dp.cells_moved().unwrap();
    let i = cells.find(&key).expect("the array holds it before any collector pass");
    assert_eq!(cells.get(i).bucket.tat_ns, drained, "with its state");
    assert_eq!(offer(&dp, &to([10, 5, 5, 9], 9999), 1), (0, 1), "a newcomer of that /24 is charged to it: the hour is still used");
    // The old program charged the table's copy after the copy was taken:
    // the collector merges that in, then deletes the table's copy.
    let later = drained + 600_000_000_000;
    table.insert(key, Bucket { tat_ns: later, passed: 2, ..Bucket::default() }, 0).unwrap();
    pass(&dp);
    assert!(table.get(&key, 0).is_err(), "the table no longer holds it");
    let i = cells.find(&key).expect("the array still holds it");
    assert_eq!(cells.get(i).bucket.tat_ns, later, "the old program's last charges are merged in");
    assert_eq!(offer(&dp, &to([10, 5, 5, 9], 9999), 1), (0, 1));
    assert_eq!(offer(&dp, &to([10, 5, 6, 9], 9999), 1), (1, 0), "another /24 is not");
    drop((cells, table, dp));
    assert!(!load().cells_in_tables(), "a restart of this build has its arrays pinned: nothing to move");
}

#[test]
fn a_cell_charged_while_the_collector_frees_it_is_kept_with_its_charges() {
    require_root();
    let dp = datapath(&rules()).unwrap();
    let cells = dp.cells_v4().unwrap();
    let limits = dp.limits_by_key().unwrap();
    let key = cell_key(0, [10, 6, 6, 0]);
    let limit = limits[&(key.rule & !KEY_CELL)];
    let fresh = |b: &Bucket| limit.is_fresh(b.tat_ns, rl_control::datapath::monotonic_ns(), dp.epoch_offset_ns());
    // A [default] cell (1,000/s, burst 1,000), fresh again after a few ms.
    assert_eq!(offer(&dp, &to([10, 6, 6, 1], 5000), 1), (1, 0));
    std::thread::sleep(std::time::Duration::from_millis(20));
    let i = cells.find(&key).unwrap();
    let seen = cells.get(i);
    assert!(fresh(&seen.bucket), "the collector reads it fresh");
    // The race: newcomers of the /24 drain it after that read, before the
    // collector acts on it.
    let drained = offer(&dp, &to([10, 6, 6, 2], 5000), 1_010);
    assert!(drained.0 >= 1_000 && drained.1 >= 1, "the burst passed, then drops: {drained:?}");
    assert!(cells.begin_free(i, &key, seen.claim), "its claim did not change");
    assert!(!cells.finish_free(i, &key, fresh), "charged meanwhile: kept");
    let kept = cells.get(cells.find(&key).expect("the cell is found again"));
    assert_eq!(kept.bucket.passed, 1 + u64::from(drained.0), "with every charge");
    assert_eq!(offer(&dp, &to([10, 6, 6, 3], 5000), 1), (0, 1), "the /24 stays limited: no fresh allowance");
}

#[test]
fn while_a_cell_is_being_freed_its_prefix_is_charged_to_the_last_resort_and_claims_nothing() {
    let (dp, cells, key, i) = once_cell([10, 4, 4]);
    let claimed = dp.counters().unwrap().get(STAT_NEW_CELLS);
    assert!(cells.begin_free(i, &key, cells.get(i).claim));
    assert!(cells.find(&key).is_none(), "a dying cell is nobody's");
    // "once" allows 1 per hour: its last resort (fresh) passes one packet;
    // no second cell is made for the /24 in the set's other way.
    assert_eq!(offer(&dp, &to([10, 4, 4, 2], 9999), 2), (1, 1));
    assert_eq!(dp.counters().unwrap().get(STAT_NEW_CELLS), claimed, "nothing claimed while the cell is dying");
    assert!(cells.find(&key).is_none());
    // Turned back (it is not fresh): it limits the /24 again, with its state.
    assert!(!cells.finish_free(i, &key, |_| false));
    assert_eq!(cells.find(&key), Some(i));
    assert_eq!(cells.get(i).bucket.passed, 1);
    // A daemon that stops between the two steps leaves the cell dying: the
    // next collector pass finishes the free (it is not fresh: kept).
    assert!(cells.begin_free(i, &key, cells.get(i).claim));
    let left = pass(&dp);
    assert_eq!(cells.find(&key), Some(i), "a pass finishes an abandoned free: {left:?}");
    // Freed for real: the key is cleared, and the next newcomer claims anew.
    assert!(cells.begin_free(i, &key, cells.get(i).claim));
    assert!(cells.finish_free(i, &key, |_| true));
    assert_eq!(cells.get(i).claim, 0);
    assert_ne!(cells.get(i).key, key, "a freed slot keeps no key a claimer could match before writing its own");
    offer(&dp, &to([10, 4, 4, 3], 9999), 1);
    assert_eq!(dp.counters().unwrap().get(STAT_NEW_CELLS), claimed + 1);
    assert!(cells.find(&key).is_some());
}

#[test]
fn ipv6_newcomers_of_one_prefix_share_its_cell_and_another_prefix_gets_its_own() {
    require_root();
    let dp = datapath(&rules()).unwrap();
    let six = |tail: [u8; 4], port: u16| {
        let mut src = [0x20, 0x01, 0x0d, 0xb8, 0, 7, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0];
        src[4..8].copy_from_slice(&tail);
        eth(&[], ETH_P_IPV6, &ipv6(src, UDP, &udp(port)))
    };
    // 2001:db8:7::/48 under "once" (1 per hour): two /64s of it, one pass.
    let got = offer(&dp, &six([0, 7, 0, 1], 9999), 1).0 + offer(&dp, &six([0, 7, 0, 2], 9999), 1).0;
    assert_eq!(got, 1, "newcomers of one /48 share its cell");
    // 2001:db8:8::/48 is another cell.
    assert_eq!(offer(&dp, &six([0, 8, 0, 1], 9999), 1), (1, 0));
    assert_eq!(dp.counters().unwrap().get(STAT_NEW_CELLS), 2);
    assert_eq!(pass(&dp).cells.1, 2, "both IPv6 cells are counted");
}

#[test]
fn a_window_bucket_charged_in_its_window_survives_a_collector_pass() {
    require_root();
    // Windows start at whole multiples of their length on the Unix clock.
    // The collector tests freshness a second back, where a bucket of the
    // window running now once looked over (a window other than that
    // second's): deleted, its source got a fresh allowance.
    let rules = "[default]\nrate = 1000\nburst = 1000\n\
                 [[rule]]\nname = \"fixed\"\nproto = \"udp\"\ndst_ports = [8001]\nrate = 3\nper = \"2s\"\nalgorithm = \"fixed_window\"\n\
                 [[rule]]\nname = \"sliding\"\nproto = \"udp\"\ndst_ports = [8002]\nrate = 3\nper = \"1s\"\nalgorithm = \"sliding_window\"\n";
    let dp = datapath(rules).unwrap();
    // Start early in a 2 s window, so that all below happens inside it (and
    // past the first ticks: the datapath's coarse clock lags by up to one).
    let into = || std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).unwrap().as_nanos() % 2_000_000_000;
    while !(50_000_000..300_000_000).contains(&into()) {
        std::thread::sleep(std::time::Duration::from_millis(5));
    }
    let start = std::time::Instant::now();
    for port in [8001, 8002] {
        assert_eq!(offer(&dp, &to([192, 0, 2, 44], port), 4), (3, 1), "port {port}: 3 per window");
    }
    let p = pass(&dp);
    assert_eq!(p.collected, 0, "nothing is fresh: {p:?}");
    for port in [8001, 8002] {
        assert_eq!(offer(&dp, &to([192, 0, 2, 44], port), 1), (0, 1), "port {port}: still limited after the pass");
    }
    assert!(start.elapsed() < std::time::Duration::from_millis(400), "the test outlived the sliding window's reach: rerun");
}

#[test]
fn a_pass_clears_the_key_an_older_build_left_in_a_freed_slot() {
    let (dp, cells, key, i) = once_cell([10, 3, 3]);
    // As the older build freed slots: the claim back to 0, the key left.
    assert!(cells.begin_free(i, &key, cells.get(i).claim));
    assert!(cells.release_abandoned(i, cells.get(i).claim));
    assert_eq!((cells.get(i).claim, cells.get(i).key), (0, key));
    pass(&dp);
    assert_eq!((cells.get(i).claim, cells.get(i).key), (0, Key4::default()), "the pass cleared the stale key");
}

#[test]
fn a_daemon_upgrading_pins_with_cells_in_the_tables_moves_them_and_the_limit_holds() {
    use rl_control::datapath::LoadOptions;
    use rl_tests::{
        daemon::{write, Daemon},
        lab::{BpfFs, Lab, VA, VB},
        traffic::{forged, join, Receiver},
    };
    let lab = Lab::new().unwrap();
    let pins = BpfFs::new().unwrap();
    let conf = tempfile::tempdir().unwrap();
    let cfg = write(&conf, "rl.toml", &rules());
    let dir = pins.path().join(rl_control::datapath::pin_group(&[VB.to_string()]));
    let send = |src: [u8; 4]| {
        let tap = Receiver::tap(&lab.b, VB).unwrap();
        join(forged(&lab.a, VA, to(src, 9999), 1, 0, None, move |_| src)).unwrap();
        std::thread::sleep(std::time::Duration::from_millis(200));
        tap.finish().unwrap().get(&std::net::IpAddr::from(src)).copied().unwrap_or(0)
    };
    // This build uses the /24's hour ("once": 1 per hour, flood mode always
    // on, so the source is charged to its cell).
    let d = Daemon::pinned(&lab, &cfg, &pins, &[]).unwrap();
    assert_eq!(send([192, 0, 2, 10]), 1, "the hour's one packet passes");
    let (status, log) = d.stop(libc::SIGTERM).unwrap();
    assert!(status.success(), "{log}");
    // Turn its pins into an older build's: the cell in the sources' table,
    // no cell arrays pinned (the attached program keeps its own).
    let key = cell_key(2, [192, 0, 2, 0]);
    {
        let compiled = compile(&Config::from_str(&rules(), "<test>").unwrap());
        let dp = Datapath::load_with(&compiled, LoadOptions { pin: Some(dir.clone()), ..Default::default() }).unwrap();
        let cells = dp.cells_v4().unwrap();
        let cell = cells.get(cells.find(&key).expect("this build kept the cell in its array"));
        let mut table: HashMap<MapData, Key4, Bucket> =
            HashMap::try_from(Map::HashMap(MapData::from_id(dp.table_ids().unwrap().tables.0).unwrap())).unwrap();
        table.insert(key, cell.bucket, 0).unwrap();
    }
    for name in [rl_common::MAP_CELLS_V4, rl_common::MAP_CELLS_V6, rl_common::MAP_CELL_COUNT] {
        std::fs::remove_file(dir.join(name)).unwrap();
    }
    // The upgrade: the daemon copies the cell before its swap and marks the
    // move done after it.
    let d = Daemon::pinned(&lab, &cfg, &pins, &[]).unwrap();
    let log = d.log();
    let line = |needle: &str| log.lines().position(|l| l.contains(needle));
    let copied = line("copied the prefix cells an older build kept").expect(&log);
    assert!(log.lines().nth(copied).unwrap().trim_end().ends_with(" cells=1"), "one cell copied: {log}");
    assert!(copied < line("attached: ").expect(&log), "copied before the program swap: {log}");
    assert!(dir.join(rl_common::MAP_CELL_COUNT).exists(), "the move is marked done once the program is in");
    assert_eq!(send([192, 0, 2, 20]), 0, "a newcomer of that /24 finds the hour used");
    assert_eq!(send([198, 51, 100, 7]), 1, "another /24 has its own");
    let (status, log) = d.stop(libc::SIGTERM).unwrap();
    assert!(status.success(), "{log}");
    let (status, out) = rl_tests::daemon::run_once(Some(&lab.b), &["detach", "--iface", VB, "--pin-dir", pins.arg()]).unwrap();
    assert!(status.success(), "{out}");
}
