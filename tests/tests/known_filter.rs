//! The known-keys filter (`rl_common::known`) lets a key without a bucket
//! skip its table lookup. A clear bit for a key that owns a bucket would
//! hand it a fresh allowance in flood mode, so these check that the XDP
//! program sets bits before it inserts (in both halves while a rebuild is
//! in progress, so that the rebuild keeps them) and that the collector's
//! rebuild keeps the bits of every bucket it keeps and drops the bits of
//! those it deletes.

use rl_common::{Key4, KNOWN_HALF, KNOWN_REBUILDING, KNOWN_VALID, STAT_FALLBACK, STAT_NEW_SOURCES};
use rl_control::datapath::{collect, Datapath, KnownFilter, COLLECT_IDLE_NS};
use rl_control::{compile::compile, config::Config};
use rl_tests::{datapath, frames::*, lab::require_root, offer, traffic::spoofed_source as spoofed};

fn to(src: [u8; 4], port: u16) -> Vec<u8> {
    eth(&[], ETH_P_IP, &ipv4(src, UDP, &[], &udp(port)))
}

/// A `[default]` source's bucket key under `toml`, as the program derives it.
fn default_key(toml: &str, src: [u8; 4]) -> Key4 {
    let compiled = compile(&Config::from_str(toml, "<test>").unwrap());
    compiled.rules.entries[0].key4(0, u32::from_ne_bytes(src))
}

fn filter(dp: &Datapath) -> KnownFilter {
    dp.known_filter().expect("mapping the known-keys filter")
}

fn rebuild(dp: &Datapath, known: &KnownFilter) -> rl_control::datapath::Pass {
    let limits = dp.limits_by_key().unwrap();
    collect(
        &dp.table_maps().unwrap(),
        dp.epoch_offset_ns(),
        &limits,
        known,
    )
    .expect("a collector pass")
}

fn active(known: &KnownFilter) -> u32 {
    (known.control() & KNOWN_HALF) as u32
}

#[test]
fn the_program_marks_a_new_bucket_in_both_halves_before_a_rebuild_can_miss_it() {
    require_root();
    let toml = rl_tests::flood_rules(1024);
    let dp = datapath(&toml).unwrap();
    let key = default_key(&toml, [192, 0, 2, 44]);
    let known = filter(&dp);
    assert_eq!(
        known.control() & KNOWN_VALID,
        KNOWN_VALID,
        "a fresh table's filter is valid from the start"
    );
    // Outside a rebuild only the half the program reads is marked (the
    // other is zeroed before it is built).
    let calm = default_key(&toml, [192, 0, 2, 43]);
    assert_eq!(offer(&dp, &to([192, 0, 2, 43], 5000), 1), (1, 0));
    let read = active(&known);
    assert!(
        known.has(read, &calm),
        "the half being read has a new bucket's bit"
    );
    assert!(
        !known.has(read ^ 1, &calm),
        "outside a rebuild the other half is left alone"
    );
    let src = [192, 0, 2, 44];
    let half = known.begin();
    assert_eq!(half, read ^ 1);
    assert_eq!(
        known.control() & KNOWN_REBUILDING,
        KNOWN_REBUILDING,
        "a rebuild tells the program so"
    );
    assert!(!known.has(half, &key) && !known.has(half ^ 1, &key));
    // Inserted while the half is being rebuilt: the program's own mark is
    // what keeps it, whatever the walk saw.
    assert_eq!(offer(&dp, &to(src, 5000), 1), (1, 0));
    assert!(
        known.has(half, &key),
        "the half being rebuilt has the new bucket's bit"
    );
    assert!(known.has(half ^ 1, &key), "the half being read has it too");
    known.finish(half);
    assert_eq!(
        known.control(),
        KNOWN_VALID | u64::from(half),
        "finishing flips the halves and ends the rebuild"
    );
}

#[test]
fn a_limited_key_stays_limited_in_flood_mode_across_rebuilds() {
    require_root();
    // Flood mode is per CPU: keep every test run on one.
    rl_tests::lab::pin_to_cpu(0).unwrap();
    let dp = datapath(&rl_tests::flood_rules(1024)).unwrap();
    let known = filter(&dp);
    let (limited, good) = ([192, 0, 2, 20], [192, 0, 2, 10]);
    assert_eq!(offer(&dp, &to(limited, 9999), 3), (1, 2), "1 per hour");
    assert_eq!(offer(&dp, &to(good, 5000), 5), (5, 0));
    // Two rebuilds: both halves have been rebuilt by a walk.
    for _ in 0..2 {
        let before = active(&known);
        let pass = rebuild(&dp, &known);
        assert_ne!(active(&known), before, "a complete walk flips the halves");
        assert!(pass.own.0 >= 2 && pass.known_fill.0 > 0.0, "{pass:?}");
    }
    // Flood mode, entered through another rule, so the once-rule's last
    // resort stays fresh: a hidden bucket would show as a pass.
    let mut seed = 0x5eed_0001u32;
    for _ in 0..4096 {
        offer(&dp, &to(spoofed(&mut seed), 5000), 1);
    }
    assert!(
        dp.counters().unwrap().get(STAT_FALLBACK) > 0,
        "flood mode charged unseen keys to fallbacks"
    );
    assert_eq!(
        offer(&dp, &to(limited, 9999), 3),
        (0, 3),
        "the limited key's bucket was found, not skipped"
    );
    assert_eq!(offer(&dp, &to(good, 5000), 5), (5, 0));
    // A newcomer to the once-rule in flood mode: its fresh last resort
    // passes it once, which is what the check above would have shown.
    assert_eq!(offer(&dp, &to([198, 51, 100, 9], 9999), 2), (1, 1));
    // Still flood mode after the checks, so it was during them (its
    // windows are 67 ms): of two more unseen keys at least one goes to a
    // fallback (one a window, just past the CPU's share, is offered a
    // bucket of its own; outside flood mode both would get one).
    let c = dp.counters().unwrap();
    offer(&dp, &to(spoofed(&mut seed), 5000), 1);
    offer(&dp, &to(spoofed(&mut seed), 5000), 1);
    let after = dp.counters().unwrap();
    let (made, fell) = (
        after.get(STAT_NEW_SOURCES) - c.get(STAT_NEW_SOURCES),
        after.get(STAT_FALLBACK) - c.get(STAT_FALLBACK),
    );
    assert!(
        made <= 1 && fell >= 1 && made + fell == 2,
        "flood mode ended before the checks were done: {made} made, {fell} to fallbacks"
    );
}

#[test]
fn a_rebuild_drops_the_bits_of_collected_buckets() {
    require_root();
    // No flood mode: every source gets a bucket of its own.
    let toml = rl_tests::flood_rules(8192).replace(
        "flood_new_keys_per_sec = 2000",
        "flood_new_keys_per_sec = 1000000000",
    );
    let dp = datapath(&toml).unwrap();
    let known = filter(&dp);
    let sources: Vec<[u8; 4]> = (0..4000u32)
        .map(|i| [10, 77, (i >> 8) as u8, i as u8])
        .collect();
    for s in &sources {
        assert_eq!(offer(&dp, &to(*s, 5000), 1), (1, 0));
    }
    let kept = [192, 0, 2, 20];
    assert_eq!(offer(&dp, &to(kept, 9999), 2), (1, 1));
    let filled = rebuild(&dp, &known);
    // Two bits per bucket (rarely one, when both land on the same bit).
    let bits = filled.known_fill.0 * f64::from(rl_common::KNOWN_WORDS) * 64.0;
    assert!(
        bits >= 2.0 * 4001.0 * 0.97,
        "{bits} bits set for 4,001 buckets: {filled:?}"
    );
    // Once fresh and idle, the [default] buckets are collected, and the
    // rebuild that collects them leaves their bits clear.
    std::thread::sleep(std::time::Duration::from_nanos(
        COLLECT_IDLE_NS + 200_000_000,
    ));
    let pass = rebuild(&dp, &known);
    assert!(pass.collected >= 4000, "{pass:?}");
    let half = active(&known);
    let still = sources
        .iter()
        .filter(|s| known.has(half, &default_key(&toml, **s)))
        .count();
    assert!(
        still <= 4,
        "{still} of 4000 collected buckets still have their bit"
    );
    assert!(
        pass.known_fill.0 < filled.known_fill.0 / 100.0,
        "{pass:?} after {filled:?}"
    );
    // The limited bucket was kept, so is its bit: still limited.
    assert_eq!(offer(&dp, &to(kept, 9999), 1), (0, 1));
}

#[test]
fn pins_from_a_build_without_the_filter_are_adopted_with_it_off_until_a_walk() {
    use rl_control::datapath::LoadOptions;
    require_root();
    rl_tests::lab::pin_to_cpu(0).unwrap();
    let pins = rl_tests::lab::BpfFs::new().unwrap();
    let dir = pins.path().join("known");
    rl_control::datapath::prepare_pins(pins.path(), &dir).unwrap();
    let toml = rl_tests::flood_rules(1024);
    let compiled = compile(&Config::from_str(&toml, "<test>").unwrap());
    let load = || {
        Datapath::load_with(
            &compiled,
            LoadOptions {
                pin: Some(dir.clone()),
                ..Default::default()
            },
        )
        .unwrap()
    };
    let limited = [192, 0, 2, 20];
    {
        let dp = load();
        assert_eq!(offer(&dp, &to(limited, 9999), 3), (1, 2), "1 per hour");
    }
    // What an older build leaves: every map pinned but this one.
    std::fs::remove_file(dir.join(rl_common::MAP_KNOWN)).unwrap();
    let dp = load();
    let known = filter(&dp);
    assert_eq!(
        known.control() & KNOWN_VALID,
        0,
        "an adopted table's bucket keys are not in a fresh filter: it must start off"
    );
    let mut seed = 0x5eed_0002u32;
    for _ in 0..4096 {
        offer(&dp, &to(spoofed(&mut seed), 5000), 1);
    }
    assert!(dp.counters().unwrap().get(STAT_FALLBACK) > 0, "flood mode");
    assert_eq!(
        offer(&dp, &to(limited, 9999), 2),
        (0, 2),
        "the adopted bucket is looked up while the filter is off"
    );
    rebuild(&dp, &known);
    assert_eq!(
        known.control() & KNOWN_VALID,
        KNOWN_VALID,
        "the first walk makes it valid"
    );
    assert_eq!(
        offer(&dp, &to(limited, 9999), 2),
        (0, 2),
        "and the walk marked the adopted bucket"
    );

    // A downgrade to such a build and back: its program inserted buckets
    // without their bits under the valid control word it left alone
    // (here: a rebuild that marks nothing). Adopted, whatever the control
    // word says, the filter is off until a walk.
    let half = known.begin();
    known.finish(half);
    drop((known, dp));
    let dp = load();
    let known = filter(&dp);
    assert_eq!(
        known.control() & KNOWN_VALID,
        0,
        "adopted: the filter is off whatever its control word said"
    );
    for _ in 0..4096 {
        offer(&dp, &to(spoofed(&mut seed), 5000), 1);
    }
    assert_eq!(
        offer(&dp, &to(limited, 9999), 2),
        (0, 2),
        "a bucket whose bits another build left clear is looked up: still limited"
    );
    rebuild(&dp, &known);
    assert_eq!(
        offer(&dp, &to(limited, 9999), 2),
        (0, 2),
        "and marked by the walk"
    );
}
