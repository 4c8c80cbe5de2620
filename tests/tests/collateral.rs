//! Collateral (e), measured: what legitimate newcomers get while a spoofed
//! flood is charged to prefix cells (TestRun: the flood's sources are
//! forged). A newcomer inside a flooded /24 shares its drained cell. A
//! newcomer elsewhere gets a cell of its own that starts where the rule's
//! last resort is: full while every flooded prefix found a cell, drained
//! once some did not (their packets went to the last resort). The README's
//! "(e) Collateral" quotes these figures.

use rl_tests::{datapath, frames::*, lab::require_root, offer};

/// Flood mode always on; "web" allows each source 10 at once, 10 a minute
/// (slow enough that no drained cell refills while the test runs); wide
/// cells as `wide` says.
fn config(flood_prefixes: u32, wide: bool) -> String {
    format!(
        "[datapath]\nmax_sources = 1024\nflood_new_keys_per_sec = 0\nflood_prefixes = {flood_prefixes}\nflood_wide_cells = {wide}\n\
         [default]\nrate = 1000\nburst = 1000\n\
         [[rule]]\nname = \"web\"\nproto = \"udp\"\ndst_ports = [8080]\nrate = 10\nper = \"1m\"\nburst = 10\n"
    )
}

fn to(src: [u8; 4]) -> Vec<u8> {
    eth(&[], ETH_P_IP, &ipv4(src, UDP, &[], &udp(8080)))
}

const NEWCOMERS: u32 = 64;
const EACH: u32 = 5;

/// A flood of one packet from each of 12 sources in each of `flooded`
/// /24s (12 a /24: more than the burst), then `NEWCOMERS` newcomers inside flooded /24s
/// and as many in /24s the flood did not touch, `EACH` packets each (within
/// their own burst). Returns the share of the newcomers' packets passed:
/// (inside, elsewhere).
fn measure(flood_prefixes: u32, flooded: u32, wide: bool) -> (f64, f64) {
    let dp = datapath(&config(flood_prefixes, wide)).unwrap();
    let prefix = |p: u32| [10, (p >> 8) as u8, p as u8];
    for p in 0..flooded {
        let [a, b, c] = prefix(p);
        for host in 1..=12 {
            offer(&dp, &to([a, b, c, host]), 1);
        }
    }
    let share = |srcs: Vec<[u8; 4]>| {
        let passed: u32 = srcs.iter().map(|s| offer(&dp, &to(*s), EACH).0).sum();
        f64::from(passed) / f64::from(NEWCOMERS * EACH)
    };
    let inside = share(
        (0..NEWCOMERS)
            .map(|i| {
                let [a, b, c] = prefix(i * flooded / NEWCOMERS);
                [a, b, c, 200]
            })
            .collect(),
    );
    let elsewhere = share((0..NEWCOMERS).map(|i| [172, 16, i as u8, 200]).collect());
    eprintln!(
        "flood over {flooded} /24s, {} cell slots, wide cells {wide}: newcomers inside them passed {:.1}%, elsewhere {:.1}%",
        rl_common::cell_slots(flood_prefixes),
        100.0 * inside,
        100.0 * elsewhere
    );
    (inside, elsewhere)
}

#[test]
fn newcomers_inside_a_flooded_prefix_share_its_cell_and_elsewhere_keep_their_burst_while_cells_hold(
) {
    require_root();
    // Room for every flooded prefix: the last resort is never charged.
    let (inside, elsewhere) = measure(65_536, 64, true);
    assert!(
        inside <= 0.1,
        "inside a flooded /24 the cell is spent: {inside}"
    );
    assert_eq!(elsewhere, 1.0, "elsewhere a new cell starts full");
}

#[test]
fn once_cells_overflow_newcomers_everywhere_start_from_the_drained_last_resort() {
    require_root();
    // As many flooded /24s as `flood_prefixes` (about 10% find no cell),
    // and 8 times as many. Without wide cells (the rule's flood stays in
    // /24 cells, and the last resort takes what finds none); with them
    // (the default), the flood goes wide at a quarter of the slots and a
    // newcomer elsewhere gets a wide cell of its /16, made drained.
    for wide in [false, true] {
        for (slots_for, flooded) in [(4096, 4096), (256, 2048)] {
            let (inside, elsewhere) = measure(slots_for, flooded, wide);
            assert!(
                inside <= 0.1,
                "inside a flooded /24 (wide cells {wide}): {inside}"
            );
            assert!(elsewhere <= 0.1, "elsewhere, a new cell copies the drained last resort (wide cells {wide}): {elsewhere}");
        }
    }
}
