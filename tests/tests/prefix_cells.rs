//! Prefix cells in their arrays (`rl_common::cells`), through TestRun: an
//! unseen key in flood mode is charged to its /24's cell; the collector
//! frees cells that are fresh again and keeps the rest; the cluster sync
//! reads and raises cells (a cluster rule's cells keep counts for it); a
//! cell's drops raise "limited" events per CPU episode; a cell charged while
//! the collector frees it is
//! kept, and its prefix claims nothing while it is being freed; and a cell
//! an older build left in the sources' table or in its 64-byte cell array
//! is moved into this build's arrays before the program swap, without
//! losing its state: by the datapath, and end to end by a daemon started on
//! such pins, with real packets through veth.

use aya::maps::{HashMap, Map, MapData};
use rl_common::{Bucket, Key4, OldCell, KEY_CELL, STAT_FALLBACK, STAT_NEW_CELLS};
use rl_control::{
    compile::compile,
    config::Config,
    datapath::{
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
    rl_tests::flood_rules(1024).replace(
        "flood_new_keys_per_sec = 2000",
        "flood_new_keys_per_sec = 0",
    )
}

/// [`rules`] and "shared", a cluster rule: its cells keep counts for the
/// sync (no Redis is reached by a datapath alone).
fn cluster_rules() -> String {
    rules()
        + "[cluster]\nredis = [\"redis://127.0.0.1:1\"]\nnode = \"test\"\n\
           [[rule]]\nname = \"shared\"\nproto = \"udp\"\ndst_ports = [6666]\nrate = 1\nper = \"1h\"\nburst = 1\nscope = \"cluster\"\n"
}

/// Whether a bucket state word is ahead of now: charged, for a limit of one
/// per hour.
fn ahead(tat_ns: u64) -> bool {
    tat_ns > rl_control::datapath::monotonic_ns()
}

/// The cell key of `src` under limit 0 of rule `index` (0 `[default]`, 2
/// "once", 3 "shared" of [`cluster_rules`]).
fn cell_key(index: usize, src: [u8; 4]) -> Key4 {
    let compiled = compile(&Config::from_str(&cluster_rules(), "<test>").unwrap());
    let k = compiled.rules.entries[index].key4(0, u32::from_ne_bytes(src));
    Key4 {
        rule: k.rule | KEY_CELL,
        addr: k.addr & u32::from_ne_bytes([255, 255, 255, 0]),
    }
}

/// A datapath where one packet from `prefix.1` to "once" (1 per hour) made
/// the /24's cell: the datapath, its cells, the cell's key and slot.
fn once_cell(prefix: [u8; 3]) -> (Datapath, CellArray<Key4>, Key4, u32) {
    require_root();
    let dp = datapath(&rules()).unwrap();
    let cells = dp.cells_v4().unwrap();
    let [a, b, c] = prefix;
    let key = cell_key(2, [a, b, c, 0]);
    assert_eq!(
        offer(&dp, &to([a, b, c, 1], 9999), 1),
        (1, 0),
        "the hour's one packet passes"
    );
    let i = cells.find(&key).expect("its cell was made");
    (dp, cells, key, i)
}

fn pass(dp: &Datapath) -> Pass {
    rl_tests::collector_pass(dp)
}

#[test]
fn unseen_keys_share_their_prefix_cell_and_the_collector_frees_it_once_fresh() {
    require_root();
    // Room for all 22 prefixes: with 256 sets of two ways, three of them
    // land in one set about once in 40 runs (the seed is random), and the
    // third has no cell.
    let dp = datapath(&rules().replace("flood_prefixes = 256", "flood_prefixes = 65536")).unwrap();
    let cells = dp.cells_v4().unwrap();
    // Two newcomers of one /24 under "once" (1 per hour): one cell, one pass.
    let got = offer(&dp, &to([10, 9, 9, 1], 9999), 1).0 + offer(&dp, &to([10, 9, 9, 2], 9999), 1).0;
    assert_eq!(got, 1, "newcomers of one /24 share its 1-per-hour cell");
    let c = dp.counters().unwrap();
    assert!(
        c.get(STAT_FALLBACK) >= 2 && c.get(STAT_NEW_CELLS) == 1,
        "one cell claimed, both charged to it: {c}"
    );
    let once = cells
        .find(&cell_key(2, [10, 9, 9, 0]))
        .expect("the cell is in the array");
    let c = cells.get(once);
    assert!(ahead(c.bucket.tat_ns), "its hour is used: {c:?}");
    assert_eq!(
        (c.bucket.passed, c.bucket.dropped),
        (0, 0),
        "a rule that is not a cluster rule keeps no counts in its cells"
    );
    // A newcomer of another /24 gets a cell of its own.
    assert_eq!(offer(&dp, &to([10, 9, 10, 1], 9999), 1), (1, 0));
    // Cells under [default] (1,000/s) are fresh again within milliseconds.
    for i in 0..20u8 {
        assert_eq!(offer(&dp, &to([10, 20, i, 1], 5000), 1), (1, 0));
    }
    let before = pass(&dp);
    assert_eq!(
        before.cells.0, 22,
        "every cell is counted and none is fresh yet for a second: {before:?}"
    );
    std::thread::sleep(std::time::Duration::from_nanos(
        COLLECT_IDLE_NS + 200_000_000,
    ));
    let after = pass(&dp);
    assert_eq!(
        (after.cells.0, after.collected),
        (2, 20),
        "the [default] cells were freed, the 1-per-hour ones kept: {after:?}"
    );
    assert!(cells.find(&cell_key(0, [10, 20, 0, 1])).is_none());
    // The /24 that used its hour stays limited.
    assert_eq!(offer(&dp, &to([10, 9, 9, 3], 9999), 1), (0, 1));
}

#[test]
fn a_cells_drop_raises_a_limited_event_when_its_cpu_saw_no_cell_drop_for_a_second() {
    require_root();
    // Cells keep no drop time: the episode is the CPU's (its scratch).
    rl_tests::lab::pin_to_cpu(0).unwrap();
    let mut dp = datapath(&rules()).unwrap();
    let mut ring = dp.take_events().unwrap();
    let mut read = || {
        let mut got = Vec::new();
        while let Some(item) = ring.next() {
            got.extend(rl_common::Event::read(&item));
        }
        got
    };
    // Two /24s use their hour ("once") and drop one each.
    assert_eq!(offer(&dp, &to([10, 8, 1, 1], 9999), 2), (1, 1));
    assert_eq!(offer(&dp, &to([10, 8, 2, 1], 9999), 2), (1, 1));
    let first = read();
    assert_eq!(
        first.len(),
        1,
        "one event: the second /24's drop is in this CPU's episode: {first:?}"
    );
    assert_eq!(&first[0].addr[..4], &[10, 8, 1, 1], "it names the source");
    std::thread::sleep(std::time::Duration::from_nanos(
        rl_common::LIMITED_GAP_NS + 100_000_000,
    ));
    assert_eq!(offer(&dp, &to([10, 8, 2, 2], 9999), 1), (0, 1));
    let second = read();
    assert_eq!(
        second.len(),
        1,
        "a drop after a quiet second starts a new episode: {second:?}"
    );
    assert_eq!(&second[0].addr[..4], &[10, 8, 2, 2]);
    let c = dp.counters().unwrap();
    assert_eq!(
        c.get(rl_common::STAT_EVENTS_SUPPRESSED),
        0,
        "none were over the budget: {c}"
    );
}

#[test]
fn the_cluster_sync_reads_and_raises_cells() {
    require_root();
    let dp = datapath(&cluster_rules()).unwrap();
    // "shared" (a cluster rule, 1 per hour): its cell counts what it passed
    // and dropped, which the sync reports.
    assert_eq!(offer(&dp, &to([10, 7, 7, 1], 6666), 3), (1, 2));
    let key = cell_key(3, [10, 7, 7, 0]);
    let rule = key.rule & !KEY_CELL;
    let ids = dp.table_maps().unwrap();
    let shared = scan_shared(&ids, |r| r == rule).unwrap();
    let cell = shared
        .iter()
        .find(|b| b.id == BucketId::V4(key))
        .unwrap_or_else(|| panic!("the cell is shared: {shared:?}"));
    assert_eq!(
        (cell.bucket.passed, cell.bucket.dropped),
        (1, 2),
        "with its counts"
    );
    assert!(ahead(cell.bucket.tat_ns), "and its state");
    // Another /24's cell, fresh: raised by the cluster to an hour ahead.
    assert_eq!(offer(&dp, &to([10, 7, 8, 1], 9999), 1), (1, 0));
    let fresh = cell_key(2, [10, 7, 8, 0]);
    let mut tables = Tables::open(&ids).unwrap();
    let hour_ahead = rl_control::datapath::monotonic_ns() + 3_600_000_000_000;
    assert!(
        tables.raise(&BucketId::V4(fresh), hour_ahead),
        "the cell moved up"
    );
    assert!(
        !tables.raise(&BucketId::V4(fresh), hour_ahead - 1),
        "never down"
    );
    assert_eq!(
        offer(&dp, &to([10, 7, 8, 2], 9999), 1),
        (0, 1),
        "other hosts' usage now limits this /24"
    );
    assert!(
        !tables.raise(&BucketId::V4(cell_key(2, [10, 7, 99, 0])), hour_ahead),
        "no such cell"
    );
}

/// A bpffs and a pin directory `name` on it, and [`rules`] compiled.
fn pin_lab(
    name: &str,
) -> (
    rl_tests::lab::BpfFs,
    std::path::PathBuf,
    rl_control::compile::Compiled,
) {
    require_root();
    let pins = rl_tests::lab::BpfFs::new().unwrap();
    let dir = pins.path().join(name);
    rl_control::datapath::prepare_pins(pins.path(), &dir).unwrap();
    (
        pins,
        dir,
        compile(&Config::from_str(&rules(), "<test>").unwrap()),
    )
}

/// `compiled`'s datapath pinned in (or adopted from) `dir`.
fn load_pinned(compiled: &rl_control::compile::Compiled, dir: &std::path::Path) -> Datapath {
    let opts = rl_control::datapath::LoadOptions {
        pin: Some(dir.to_path_buf()),
        ..Default::default()
    };
    Datapath::load_with(compiled, opts).unwrap()
}

#[test]
fn a_cell_an_older_build_kept_in_the_sources_table_moves_to_the_array_and_keeps_limiting() {
    let (_pins, dir, compiled) = pin_lab("cells");
    let load = || load_pinned(&compiled, &dir);
    // As an older build left it: a drained 1-per-hour cell in the sources'
    // table, and no cell arrays pinned.
    let key = cell_key(2, [10, 5, 5, 0]);
    let drained = rl_control::datapath::monotonic_ns() + 3_000_000_000_000;
    {
        let dp = load();
        assert!(!dp.cells_in_tables(), "fresh pins");
        let mut table: HashMap<MapData, Key4, Bucket> = HashMap::try_from(Map::HashMap(
            dp.table_maps().unwrap().tables.0.open().unwrap(),
        ))
        .unwrap();
        table
            .insert(
                key,
                Bucket {
                    tat_ns: drained,
                    passed: 1,
                    ..Bucket::default()
                },
                0,
            )
            .unwrap();
    }
    for name in rl_common::CELL_MAPS {
        std::fs::remove_file(dir.join(name)).unwrap();
    }
    // A daemon that stops before it has moved them moves them at its next start.
    assert!(load().cells_in_tables());
    let mut dp = load();
    assert!(
        dp.adopted() && dp.cells_in_tables(),
        "the daemon must move the cells before its swap"
    );
    // (The pin directory is held by `dp`: a second load would be refused.)
    let load_again_sees_cells_in_tables =
        |d: &std::path::Path| !d.join(rl_common::MAP_CELL_COUNT).exists();
    let ids = dp.table_maps().unwrap();
    let mut table: HashMap<MapData, Key4, Bucket> =
        HashMap::try_from(Map::HashMap(ids.tables.0.open().unwrap())).unwrap();
    let cells = dp.cells_v4().unwrap();
    assert!(cells.find(&key).is_none());
    // The daemon copies it before it swaps its program in: the new program
    // finds it at once, not a copy of the rule's last resort.
    assert_eq!(dp.move_old_cells().unwrap(), 1);
    assert!(
        load_again_sees_cells_in_tables(&dir),
        "not marked done before the swap"
    );
    dp.cells_moved().unwrap();
    let i = cells
        .find(&key)
        .expect("the array holds it before any collector pass");
    assert_eq!(cells.get(i).bucket.tat_ns, drained, "with its state");
    assert_eq!(
        offer(&dp, &to([10, 5, 5, 9], 9999), 1),
        (0, 1),
        "a newcomer of that /24 is charged to it: the hour is still used"
    );
    // The old program charged the table's copy after the copy was taken:
    // the collector merges that in, then deletes the table's copy.
    let later = drained + 600_000_000_000;
    table
        .insert(
            key,
            Bucket {
                tat_ns: later,
                passed: 2,
                ..Bucket::default()
            },
            0,
        )
        .unwrap();
    pass(&dp);
    assert!(table.get(&key, 0).is_err(), "the table no longer holds it");
    let i = cells.find(&key).expect("the array still holds it");
    assert_eq!(
        cells.get(i).bucket.tat_ns,
        later,
        "the old program's last charges are merged in"
    );
    assert_eq!(offer(&dp, &to([10, 5, 5, 9], 9999), 1), (0, 1));
    assert_eq!(
        offer(&dp, &to([10, 5, 6, 9], 9999), 1),
        (1, 0),
        "another /24 is not"
    );
    drop((cells, table, dp));
    assert!(
        !load().cells_in_tables(),
        "a restart of this build has its arrays pinned: nothing to move"
    );
}

#[test]
fn pins_holding_cells_without_their_key_array_or_their_seed_are_refused() {
    let (pins, dir, compiled) = pin_lab("partial");
    drop(load_pinned(&compiled, &dir));
    for (name, is) in [
        (
            rl_common::MAP_CELL_KEYS_V4,
            "a cell array without its key array",
        ),
        (rl_common::MAP_CELL_SEED, "cells without their seed"),
    ] {
        let kept = pins.path().join("kept");
        std::fs::rename(dir.join(name), &kept).unwrap();
        let opts = rl_control::datapath::LoadOptions {
            pin: Some(dir.clone()),
            ..Default::default()
        };
        let e = Datapath::load_with(&compiled, opts)
            .err()
            .unwrap_or_else(|| panic!("{is} adopted"))
            .to_string();
        assert!(
            e.contains("of the prefix cells' maps only") && e.contains("rl-control detach"),
            "{is}: {e}"
        );
        std::fs::rename(&kept, dir.join(name)).unwrap();
    }
    drop(load_pinned(&compiled, &dir));
}

/// `bpf(cmd, attr)` for the few commands the old-array test makes itself.
fn bpf(cmd: i64, attr: &mut [u64; 16]) -> i64 {
    let r = unsafe {
        libc::syscall(
            libc::SYS_bpf,
            cmd,
            attr.as_mut_ptr(),
            std::mem::size_of_val(attr),
        )
    };
    assert!(r >= 0, "bpf({cmd}): {}", std::io::Error::last_os_error());
    r
}

/// An fd for the object pinned at `path` (`BPF_OBJ_GET`).
fn pinned_fd(path: &std::path::Path) -> std::os::fd::OwnedFd {
    use std::os::fd::FromRawFd;
    let c = std::ffi::CString::new(path.as_os_str().as_encoded_bytes()).unwrap();
    let mut attr = [0u64; 16];
    attr[0] = c.as_ptr() as u64;
    unsafe { std::os::fd::OwnedFd::from_raw_fd(bpf(7, &mut attr) as i32) }
}

/// Writes `cell` to slot `i` of the 64-byte cell array behind `fd`.
fn write_old_cell(fd: &std::os::fd::OwnedFd, i: u32, cell: &OldCell<Key4>) {
    use std::os::fd::AsRawFd;
    let mut attr = [0u64; 16];
    attr[0] = fd.as_raw_fd() as u64;
    attr[1] = &i as *const u32 as u64;
    attr[2] = cell as *const OldCell<Key4> as u64;
    bpf(2, &mut attr);
}

/// Pins at `path` an IPv4 cell array as builds before 16-byte cells made
/// it (`Array<OldCell<Key4>>`, mappable), with `cells` (slot, cell).
fn pin_old_cell_array(path: &std::path::Path, slots: u32, cells: &[(u32, OldCell<Key4>)]) {
    use std::os::fd::{AsRawFd, FromRawFd};
    let mut attr = [0u64; 16];
    // map_type ARRAY (2), key 4 bytes; value 64 bytes, `slots` entries;
    // map_flags BPF_F_MMAPABLE; the name from byte 28.
    attr[0] = 2 | 4 << 32;
    attr[1] = 64 | (slots as u64) << 32;
    attr[2] = 1 << 10;
    let name = rl_common::MAP_OLD_CELLS_V4.as_bytes();
    let bytes = unsafe { std::slice::from_raw_parts_mut(attr.as_mut_ptr() as *mut u8, 128) };
    bytes[28..28 + name.len()].copy_from_slice(name);
    let fd = unsafe { std::os::fd::OwnedFd::from_raw_fd(bpf(0, &mut attr) as i32) };
    for (i, cell) in cells {
        write_old_cell(&fd, *i, cell);
    }
    let c = std::ffi::CString::new(path.as_os_str().as_encoded_bytes()).unwrap();
    let mut attr = [0u64; 16];
    attr[0] = c.as_ptr() as u64;
    attr[1] = fd.as_raw_fd() as u64;
    bpf(6, &mut attr);
}

#[test]
fn a_cell_an_older_build_kept_in_a_64_byte_array_moves_to_the_new_arrays_with_its_late_charges() {
    use rl_common::KnownKey;
    let (_pins, dir, compiled) = pin_lab("cells64");
    let load = || load_pinned(&compiled, &dir);
    drop(load());
    // As a build with 64-byte cells left its pins: none of this build's
    // cell maps, its own array holding a drained 1-per-hour cell.
    for name in rl_common::CELL_MAPS
        .into_iter()
        .filter(|n| *n != rl_common::MAP_CELL_COUNT)
    {
        std::fs::remove_file(dir.join(name)).unwrap();
    }
    let key = cell_key(2, [10, 5, 7, 0]);
    let drained = rl_control::datapath::monotonic_ns() + 3_000_000_000_000;
    let old = OldCell {
        claim: key.known_hash() | 1,
        bucket: Bucket {
            tat_ns: drained,
            passed: 1,
            ..Bucket::default()
        },
        key,
    };
    let slots = rl_common::cell_slots(compiled.flood_prefixes);
    let old_path = dir.join(rl_common::MAP_OLD_CELLS_V4);
    // (Any slot: a move reads them all.)
    let at = 1;
    // And another /24's, which this build's program will charge further
    // than the old one did.
    let key2 = cell_key(2, [10, 5, 9, 0]);
    let old2 = OldCell {
        claim: key2.known_hash() | 1,
        key: key2,
        ..old
    };
    pin_old_cell_array(&old_path, slots, &[(at, old), (2, old2)]);
    let mut dp = load();
    assert!(
        dp.adopted() && dp.cells_in_old_arrays(),
        "the daemon must move the cells before its swap"
    );
    let cells = dp.cells_v4().unwrap();
    assert!(cells.find(&key).is_none());
    assert_eq!(dp.move_old_cells().unwrap(), 2, "copied before the swap");
    let further = drained + 1_200_000_000_000;
    assert!(Tables::open(&dp.table_maps().unwrap())
        .unwrap()
        .raise(&BucketId::V4(key2), further));
    let i = cells.find(&key).expect("the new array holds it");
    assert_eq!(cells.get(i).bucket.tat_ns, drained, "with its state");
    assert_eq!(cells.get(i).key, key);
    assert_eq!(
        offer(&dp, &to([10, 5, 7, 9], 9999), 1),
        (0, 1),
        "a newcomer of that /24 is charged to it: the hour is still used"
    );
    // The old program charged its copy after the copy was taken: merged in
    // once the swap is done, and the old array is unpinned.
    let later = drained + 600_000_000_000;
    write_old_cell(
        &pinned_fd(&old_path),
        at,
        &OldCell {
            bucket: Bucket {
                tat_ns: later,
                passed: 2,
                ..old.bucket
            },
            ..old
        },
    );
    assert!(old_path.exists(), "kept until the swap");
    assert_eq!(dp.cells_moved().unwrap(), 2);
    assert!(!old_path.exists(), "unpinned once merged");
    assert_eq!(
        cells.get(cells.find(&key).unwrap()).bucket.tat_ns,
        later,
        "the old program's last charges are merged in"
    );
    assert_eq!(
        cells.get(cells.find(&key2).unwrap()).bucket.tat_ns,
        further,
        "a merge never takes a cell's state back"
    );
    assert_eq!(
        offer(&dp, &to([10, 5, 8, 9], 9999), 1),
        (1, 0),
        "another /24 is not limited"
    );
    drop((cells, dp));
    assert!(
        !load().cells_in_old_arrays(),
        "a restart has nothing more to move"
    );
}

#[test]
fn a_cell_charged_while_the_collector_frees_it_is_kept_with_its_charges() {
    require_root();
    let dp = datapath(&rules()).unwrap();
    let cells = dp.cells_v4().unwrap();
    let limits = dp.limits_by_key().unwrap();
    let key = cell_key(0, [10, 6, 6, 0]);
    let limit = limits[&(key.rule & !KEY_CELL)];
    let fresh = |b: &Bucket| {
        limit.is_fresh(
            b.tat_ns,
            rl_control::datapath::monotonic_ns(),
            dp.epoch_offset_ns(),
        )
    };
    // A [default] cell (1,000/s, burst 1,000), fresh again after a few ms.
    assert_eq!(offer(&dp, &to([10, 6, 6, 1], 5000), 1), (1, 0));
    std::thread::sleep(std::time::Duration::from_millis(20));
    let i = cells.find(&key).unwrap();
    let seen = cells.get(i);
    assert!(fresh(&seen.bucket), "the collector reads it fresh");
    // The race: newcomers of the /24 drain it after that read, before the
    // collector acts on it.
    let t0 = rl_control::datapath::monotonic_ns();
    let drained = offer(&dp, &to([10, 6, 6, 2], 5000), 1_010);
    let since = std::time::Instant::now();
    assert!(
        drained.0 >= 1_000 && drained.1 >= 1,
        "the burst passed, then drops: {drained:?}"
    );
    assert_eq!(cells.get(i).claim, seen.claim, "its claim did not change");
    assert!(cells.begin_free(i, &key));
    assert!(
        !cells.finish_free(i, &key, fresh),
        "charged meanwhile: kept"
    );
    let kept = cells.get(cells.find(&key).expect("the cell is found again"));
    // 1,000/s: each pass moved the state 1 ms on from (at most a 4 ms tick
    // before) the drain's start.
    let charged = t0 - 10_000_000 + u64::from(drained.0) * 1_000_000;
    assert!(
        kept.bucket.tat_ns >= charged,
        "with every charge: {} < {charged}",
        kept.bucket.tat_ns
    );
    // No fresh allowance: a newcomer gets what refilled since the drain (a
    // packet a ms; freeing waits out runs in flight, so some ms pass), far
    // from the 200 a fresh cell (burst 1,000) would pass. The limit reads
    // the tick clock, so a tick's worth comes at once: a tick that starts
    // just after the drain hands out its packets at once.
    let (passed, dropped) = offer(&dp, &to([10, 6, 6, 3], 5000), 200);
    let tick_ms = dp.clock().tick_ns.div_ceil(1_000_000) as u32;
    let refilled = since.elapsed().as_millis() as u32 + 1 + tick_ms;
    assert!(
        dropped >= 1 && passed <= refilled,
        "the /24 stays limited: {passed} passed, {refilled} refilled since the drain"
    );
}

#[test]
fn while_a_cell_is_being_freed_its_prefix_is_charged_to_the_last_resort_and_claims_nothing() {
    let (dp, cells, key, i) = once_cell([10, 4, 4]);
    let claimed = dp.counters().unwrap().get(STAT_NEW_CELLS);
    assert!(cells.begin_free(i, &key));
    assert!(cells.find(&key).is_none(), "a dying cell is nobody's");
    // "once" allows 1 per hour: its last resort (fresh) passes one packet;
    // no second cell is made for the /24 in the set's other way.
    assert_eq!(offer(&dp, &to([10, 4, 4, 2], 9999), 2), (1, 1));
    assert_eq!(
        dp.counters().unwrap().get(STAT_NEW_CELLS),
        claimed,
        "nothing claimed while the cell is dying"
    );
    assert!(cells.find(&key).is_none());
    // Turned back (it is not fresh): it limits the /24 again, with its state.
    assert!(!cells.finish_free(i, &key, |_| false));
    assert_eq!(cells.find(&key), Some(i));
    assert!(ahead(cells.get(i).bucket.tat_ns));
    // A daemon that stops between the two steps leaves the cell dying: the
    // next collector pass finishes the free (it is not fresh: kept).
    assert!(cells.begin_free(i, &key));
    let left = pass(&dp);
    assert_eq!(
        cells.find(&key),
        Some(i),
        "a pass finishes an abandoned free: {left:?}"
    );
    // Freed for real, and the next newcomer claims anew.
    assert!(cells.begin_free(i, &key));
    assert!(cells.finish_free(i, &key, |_| true));
    assert_eq!(cells.get(i).claim, 0);
    offer(&dp, &to([10, 4, 4, 3], 9999), 1);
    assert_eq!(dp.counters().unwrap().get(STAT_NEW_CELLS), claimed + 1);
    assert!(cells.find(&key).is_some());
}

#[test]
fn a_slot_being_written_is_busy_for_its_key_and_a_pass_frees_one_a_stopped_daemon_left() {
    use std::sync::atomic::Ordering;
    let (dp, cells, key, i) = once_cell([10, 4, 5]);
    assert!(
        cells.begin_free(i, &key) && cells.finish_free(i, &key, |_| true),
        "freed"
    );
    // As a run between its claim and its state, or a daemon stopped in the
    // middle of a move, leaves it: the key's claim word, writing.
    let writing = rl_common::cell_writing(cells.claim_of(&key));
    cells.claim_word(i).store(writing, Ordering::Release);
    let claimed = dp.counters().unwrap().get(STAT_NEW_CELLS);
    // "once" allows 1 per hour: the fresh last resort passes one packet,
    // and no cell is made for the /24 in the set's other way.
    assert_eq!(offer(&dp, &to([10, 4, 5, 2], 9999), 2), (1, 1));
    assert_eq!(
        dp.counters().unwrap().get(STAT_NEW_CELLS),
        claimed,
        "nothing claimed while the slot is being written"
    );
    assert!(cells.find(&key).is_none());
    // Still writing a grace later: the collector frees it.
    let p = pass(&dp);
    assert_eq!((cells.get(i).claim, p.collected), (0, 1), "{p:?}");
    offer(&dp, &to([10, 4, 5, 3], 9999), 1);
    assert_eq!(
        dp.counters().unwrap().get(STAT_NEW_CELLS),
        claimed + 1,
        "the next newcomer claims anew"
    );
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
    // An attempt the runner stalls past 400 ms (the sliding window's reach)
    // proves nothing either way: another source tries again.
    let into = || {
        std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .unwrap()
            .as_nanos()
            % 2_000_000_000
    };
    for host in 44..47 {
        while !(50_000_000..300_000_000).contains(&into()) {
            std::thread::sleep(std::time::Duration::from_millis(5));
        }
        let start = std::time::Instant::now();
        let first = [8001, 8002].map(|port| offer(&dp, &to([192, 0, 2, host], port), 4));
        let p = pass(&dp);
        let after = [8001, 8002].map(|port| offer(&dp, &to([192, 0, 2, host], port), 1));
        if start.elapsed() >= std::time::Duration::from_millis(400) {
            continue;
        }
        assert_eq!(first, [(3, 1); 2], "3 per window");
        assert_eq!(p.collected, 0, "nothing is fresh: {p:?}");
        assert_eq!(after, [(0, 1); 2], "still limited after the pass");
        return;
    }
    panic!("three attempts each outlived the sliding window's reach (400 ms): this runner is too slow for the test");
}

/// Where an older build kept its prefix cells.
#[derive(Clone, Copy, PartialEq)]
enum OldCells {
    /// In the sources' tables, without cell arrays.
    Tables,
    /// In 64-byte cell arrays (`rl_common::OldCell`).
    Arrays64,
}

#[test]
fn a_daemon_upgrading_pins_with_cells_in_the_tables_moves_them_and_the_limit_holds() {
    daemon_upgrade(OldCells::Tables);
}

#[test]
fn a_daemon_upgrading_pins_with_64_byte_cell_arrays_moves_them_unpins_those_and_the_limit_holds() {
    daemon_upgrade(OldCells::Arrays64);
}

/// A daemon started on pins an older build left, with the cell of a /24
/// whose hour is used where that build kept it: it copies the cell before
/// its swap, finishes the move after it, and the /24 stays limited.
fn daemon_upgrade(old: OldCells) {
    use rl_common::KnownKey;
    use rl_tests::{
        daemon::{write, Daemon},
        lab::{BpfFs, Lab, VA, VB},
        traffic::{forged, join, Receiver},
    };
    let lab = Lab::new().unwrap();
    let pins = BpfFs::new().unwrap();
    let conf = tempfile::tempdir().unwrap();
    let cfg = write(&conf, "rl.toml", &rules());
    let dir = pins
        .path()
        .join(rl_control::datapath::pin_group(&[VB.to_string()]));
    let send = |src: [u8; 4]| {
        let tap = Receiver::tap(&lab.b, VB).unwrap();
        join(forged(&lab.a, VA, to(src, 9999), 1, 0, None, move |_| src)).unwrap();
        std::thread::sleep(std::time::Duration::from_millis(200));
        tap.finish()
            .unwrap()
            .get(&std::net::IpAddr::from(src))
            .copied()
            .unwrap_or(0)
    };
    // This build uses the /24's hour ("once": 1 per hour, flood mode always
    // on, so the source is charged to its cell).
    let d = Daemon::pinned(&lab, &cfg, &pins, &[]).unwrap();
    assert_eq!(send([192, 0, 2, 10]), 1, "the hour's one packet passes");
    let (status, log) = d.stop(libc::SIGTERM).unwrap();
    assert!(status.success(), "{log}");
    // Turn its pins into an older build's (the attached program keeps its
    // own maps): no cell maps of this build, the cell where that build kept
    // it.
    let key = cell_key(2, [192, 0, 2, 0]);
    let compiled = compile(&Config::from_str(&rules(), "<test>").unwrap());
    let cell = {
        let dp = load_pinned(&compiled, &dir);
        let cells = dp.cells_v4().unwrap();
        let cell = cells.get(
            cells
                .find(&key)
                .expect("this build kept the cell in its array"),
        );
        if old == OldCells::Tables {
            let mut table: HashMap<MapData, Key4, Bucket> = HashMap::try_from(Map::HashMap(
                dp.table_maps().unwrap().tables.0.open().unwrap(),
            ))
            .unwrap();
            table.insert(key, cell.bucket, 0).unwrap();
        }
        cell
    };
    for name in rl_common::CELL_MAPS {
        // Builds with 64-byte arrays had RL_CELLN.
        if !(old == OldCells::Arrays64 && name == rl_common::MAP_CELL_COUNT) {
            std::fs::remove_file(dir.join(name)).unwrap();
        }
    }
    let old_path = dir.join(rl_common::MAP_OLD_CELLS_V4);
    if old == OldCells::Arrays64 {
        let slots = rl_common::cell_slots(compiled.flood_prefixes);
        let at = 0;
        pin_old_cell_array(
            &old_path,
            slots,
            &[(
                at,
                OldCell {
                    claim: key.known_hash() | 1,
                    bucket: cell.bucket,
                    key,
                },
            )],
        );
    }
    // The upgrade: the daemon copies the cell before its swap and finishes
    // the move after it.
    let d = Daemon::pinned(&lab, &cfg, &pins, &[]).unwrap();
    let log = d.log();
    let line = |needle: &str| log.lines().position(|l| l.contains(needle));
    let copied = line("copied the prefix cells an older build kept").expect(&log);
    assert!(
        log.lines()
            .nth(copied)
            .unwrap()
            .trim_end()
            .ends_with(" cells=1"),
        "one cell copied: {log}"
    );
    let swapped = line("swapped this build's program into the pinned XDP link").expect(&log);
    assert!(copied < swapped, "copied before the program swap: {log}");
    if old == OldCells::Tables {
        assert!(
            dir.join(rl_common::MAP_CELL_COUNT).exists(),
            "the move is marked done once the program is in"
        );
    } else {
        let merged = line("merged what the older build charged since the copy").expect(&log);
        assert!(
            swapped < merged
                && log
                    .lines()
                    .nth(merged)
                    .unwrap()
                    .trim_end()
                    .ends_with(" cells=1"),
            "merged after the swap: {log}"
        );
        assert!(!old_path.exists(), "the old array is unpinned");
    }
    assert_eq!(
        send([192, 0, 2, 20]),
        0,
        "a newcomer of that /24 finds the hour used"
    );
    assert_eq!(send([198, 51, 100, 7]), 1, "another /24 has its own");
    let (status, log) = d.stop(libc::SIGTERM).unwrap();
    assert!(status.success(), "{log}");
    let (status, out) = rl_tests::daemon::run_once(
        Some(&lab.b),
        &["detach", "--iface", VB, "--pin-dir", pins.arg()],
    )
    .unwrap();
    assert!(status.success(), "{out}");
}

/// The collector hands the cluster sync every bucket and cell of a shared
/// limit it deletes, with its last counts (a bucket made again counts from
/// zero in the kernel: the sync must know), and nothing of other limits.
#[test]
fn the_collector_records_the_deletes_of_shared_limits_for_the_cluster_sync() {
    require_root();
    let fast = "[cluster]\nredis = [\"redis://127.0.0.1:1\"]\nnode = \"test\"\n\
        [[rule]]\nname = \"fast\"\nproto = \"udp\"\ndst_ports = [7788]\nrate = 1000\nscope = \"cluster\"\n";
    // Flood mode always on (a cell), then never (an own bucket).
    for (toml, kind) in [
        (rules() + fast, "cell"),
        (rl_tests::flood_rules(1024) + fast, "own bucket"),
    ] {
        let dp = datapath(&toml).unwrap();
        let compiled = compile(&Config::from_str(&toml, "<test>").unwrap());
        let fast_index = compiled
            .rules
            .names
            .iter()
            .position(|n| n == "fast")
            .unwrap();
        let own = compiled.rules.entries[fast_index].key4(0, u32::from_ne_bytes([10, 5, 5, 1]));
        let id = if kind == "cell" {
            BucketId::V4(Key4 {
                rule: own.rule | KEY_CELL,
                addr: own.addr & u32::from_ne_bytes([255, 255, 255, 0]),
            })
        } else {
            BucketId::V4(own)
        };
        assert_eq!(offer(&dp, &to([10, 5, 5, 1], 7788), 3), (3, 0), "{kind}");
        assert_eq!(
            offer(&dp, &to([10, 6, 6, 1], 5000), 2),
            (2, 0),
            "{kind}: [default], not shared"
        );
        let handoff = rl_control::datapath::share::Collected::default();
        handoff.lock().limits.insert(own.rule);
        let collect = |dp: &Datapath| {
            let limits = dp.limits_by_key().unwrap();
            let known = dp.known_filter().unwrap();
            rl_control::datapath::collect_handing(
                &dp.table_maps().unwrap(),
                dp.epoch_offset_ns(),
                &limits,
                &known,
                Some(&handoff),
            )
            .unwrap()
        };
        collect(&dp);
        assert!(
            handoff.lock().deleted.is_empty(),
            "{kind}: nothing fresh for a second yet"
        );
        std::thread::sleep(std::time::Duration::from_nanos(
            COLLECT_IDLE_NS + 200_000_000,
        ));
        let pass = collect(&dp);
        assert!(pass.collected >= 2, "{kind}: both collected: {pass:?}");
        let records = std::mem::take(&mut handoff.lock().deleted);
        assert_eq!(
            records.len(),
            1,
            "{kind}: only the shared limit's delete is recorded: {records:?}"
        );
        assert_eq!(records[0].id, id, "{kind}");
        assert_eq!(
            (records[0].bucket.passed, records[0].bucket.dropped),
            (3, 0),
            "{kind}: with its last counts"
        );
    }
}

/// A delete the collector decided from its read of a chunk is decided
/// again once it holds the records' lock: a bucket charged (or raised by
/// the sync) while it waited for the lock stays, unrecorded.
#[test]
fn a_bucket_charged_while_the_collector_waits_for_the_records_lock_stays() {
    require_root();
    let fast = "[cluster]\nredis = [\"redis://127.0.0.1:1\"]\nnode = \"test\"\n\
        [[rule]]\nname = \"fast\"\nproto = \"udp\"\ndst_ports = [7788]\nrate = 1000\nscope = \"cluster\"\n";
    let toml = rl_tests::flood_rules(1024) + fast;
    let dp = std::sync::Arc::new(datapath(&toml).unwrap());
    let compiled = compile(&Config::from_str(&toml, "<test>").unwrap());
    let index = compiled
        .rules
        .names
        .iter()
        .position(|n| n == "fast")
        .unwrap();
    let own = compiled.rules.entries[index].key4(0, u32::from_ne_bytes([10, 5, 5, 1]));
    assert_eq!(offer(&dp, &to([10, 5, 5, 1], 7788), 3), (3, 0));
    std::thread::sleep(std::time::Duration::from_nanos(
        COLLECT_IDLE_NS + 200_000_000,
    ));
    let handoff = std::sync::Arc::new(rl_control::datapath::share::Collected::default());
    let held = handoff.lock();
    let walker = {
        let (dp, handoff) = (dp.clone(), handoff.clone());
        std::thread::spawn(move || {
            let limits = dp.limits_by_key().unwrap();
            let known = dp.known_filter().unwrap();
            rl_control::datapath::collect_handing(
                &dp.table_maps().unwrap(),
                dp.epoch_offset_ns(),
                &limits,
                &known,
                Some(&handoff),
            )
            .unwrap()
        })
    };
    // The walk found the idle bucket and now waits for the lock: the
    // bucket is charged meanwhile (`kept_on_second_look` below says the
    // walk had read it idle before).
    std::thread::sleep(std::time::Duration::from_millis(500));
    assert!(
        !walker.is_finished(),
        "the walk waits for the records' lock"
    );
    assert_eq!(offer(&dp, &to([10, 5, 5, 1], 7788), 1), (1, 0));
    let mut held = held;
    held.limits.insert(own.rule);
    drop(held);
    let pass = walker.join().unwrap();
    assert_eq!(
        (pass.collected, pass.kept_on_second_look),
        (0, 1),
        "read idle, then kept: {pass:?}"
    );
    assert!(handoff.lock().deleted.is_empty(), "nothing recorded");
    let shared = scan_shared(&dp.table_maps().unwrap(), |r| r == own.rule).unwrap();
    let b = shared
        .iter()
        .find(|b| b.id == BucketId::V4(own))
        .expect("the charged bucket stays");
    assert_eq!(b.bucket.passed, 4);
}
