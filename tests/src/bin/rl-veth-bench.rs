//! `cargo xtask bench`, end to end: CPU ns per packet of a random-source
//! flood on the veth lab with, attached in turn to the protected interface,
//! - a bare `XDP_PASS` program (the baseline),
//! - rl (a generous limit: every packet passes, so both pay the same stack
//!   cost after XDP, and unseen sources go the flood-mode path),
//! - nftables' netdev-ingress dynset limit (`update @set { ip saddr limit
//!   rate over … }`), the in-kernel peer, with a 1M-element set like rl's
//!   table (the peer the target names), and again with a 4M-element one
//!   that holds every source of both phases: the 1M set is full in the
//!   sustained phase, where nftables stops applying the rule to new
//!   sources (it fails open), and so costs less than a peer that enforces.
//!
//! Two more rl cases split rl's cost in the same run:
//! - **rl, one known source**: every frame from one source, which owns a
//!   bucket after its first frame: rl's fixed cost per frame (parse,
//!   classify, one cached bucket, counters), below which no flood path
//!   can go;
//! - **rl, one hot cell**: the random flood with `flood_prefix_v4 = 8`, so
//!   every unseen source is charged to one prefix cell that stays cached:
//!   the flood path's instructions and its own-key filter check without
//!   the per-prefix state's cache misses: what this flood path would cost
//!   if its per-prefix state were free.
//!
//! And one rl case with another setting, beside the default it trades
//! against: **rl, wide cells off** (`flood_wide_cells = false`): the flood
//! is charged to a cell per /24 throughout, where by default, once the
//! cells hold a quarter of their room (32,768 /24s), it is charged to the
//! 256 /16s' wide cells, which stay cached where 65,536 /24s' cells do
//! not (the README's "Floods": wide cells, and the collateral they move).
//! By default a wide cell starts drained, so on the tick clock each drops
//! the frames of its first tick: the bench reports how many (they skip
//! the stack's work, about 0.001× of the figure per 0.1% of frames).
//!
//! The generator (rl's own, AF_PACKET, forged 10/8 sources, the same
//! sequence for every case) sends a fixed count of frames from one pinned
//! thread. The frames are addressed to another host's MAC, so after the
//! filter the stack drops them at once: what differs between cases is the
//! filter. CPU time is all CPUs' busy time over the send (wall time × CPUs
//! less cpuidle residency: see `BusyClock`), generator included; cases are
//! interleaved over rounds, and each case starts from an empty table (fresh
//! datapath, fresh nft set).
//!
//! Each run measures two phases of one flood, `frames` each:
//! - **first**: the flood's first frames, from empty tables. rl creates
//!   per-source buckets until its flood detector trips
//!   (`flood_new_keys_per_sec`: 3,356 per CPU in its first 67 ms window by
//!   default on 2 CPUs)
//!   and claims a prefix cell for each new /24 (65,536 in all); nftables
//!   inserts every new source.
//! - **sustained**: the next frames of the same flood (another sequence
//!   over the same 2²³ odd 10/8 addresses: about 11% of its sources were
//!   seen in the first phase, 0.04% own a bucket; the same /24s): what a
//!   flood that lasts costs per frame. nftables' set (1M elements) is full
//!   by then, and its updates stop inserting.
//!
//! Knobs for looking further: `RL_BENCH_ONE_SOURCE=1` sends every case's
//! frames from one source, and `RL_BENCH_DATAPATH` is TOML prepended to
//! rl's rules (not the hot-cell or wide-cells-off cases'), e.g.
//! `$'[datapath]\nflood_prefixes = 8192\n'`.
//! `RL_BENCH_PREFIXES=16384` narrows the flood to that many /24 prefixes
//! (fewer prefix cells: what the cells' working set costs).
//! `RL_BENCH_ONLY=rl` (or `rlunfiltered`, `rlknown`, `rlhotcell`, `rlnowide`, `nft`, `nftroomy`)
//! measures that case beside the baseline alone, e.g. under `perf record
//! -a`. `RL_BENCH_ROUNDS=N` runs N interleaved rounds instead of 5 (single
//! rounds' ratios range over about 0.1× on a shared VM; more rounds steady
//! the medians).

use std::time::Instant;

use anyhow::{bail, Context, Result};
use rl_common::STAT_PASSED_PKTS;
use rl_tests::{
    datapath,
    frames::{eth, ipv4, udp, ETH_P_IP, UDP},
    lab::{Lab, VA, VB},
    traffic::{forged, join, spoofed_source},
    BusyClock,
};

/// Interleaved rounds (`RL_BENCH_ROUNDS` overrides): each case's ratio is
/// the median of its rounds' ratios to that round's baseline.
const ROUNDS: usize = 5;

fn rounds() -> Result<usize> {
    match std::env::var("RL_BENCH_ROUNDS") {
        Err(_) => Ok(ROUNDS),
        Ok(v) => match v.parse::<usize>() {
            Ok(n) if (1..=100).contains(&n) => Ok(n),
            _ => bail!("RL_BENCH_ROUNDS={v}: expected a count of rounds from 1 to 100"),
        },
    }
}

const RL_CONFIG: &str = "[default]\nrate = 100000000\nburst = 1000000000\n";

/// nftables' rule with a set of `size` sources: 1M like rl's own table
/// ([`Filter::Nft`]), or room for every source of both phases
/// ([`Filter::NftRoomy`]).
fn nft_ruleset(size: u32) -> String {
    format!(
        "table netdev rlbench {{\n\
         \tcounter seen {{ }}\n\
         \tset sources {{ type ipv4_addr; size {size}; flags dynamic,timeout; timeout 1m; }}\n\
         \tchain ingress {{\n\
         \t\ttype filter hook ingress device \"{VB}\" priority -500; policy accept;\n\
         \t\tip saddr 10.0.0.0/8 counter name \"seen\" update @sources {{ ip saddr limit rate over 1000/second }} drop\n\
         \t}}\n}}\n"
    )
}

#[derive(Clone, Copy, Debug, PartialEq)]
enum Filter {
    Pass,
    Rl,
    /// rl with its known-keys filter off: every unseen key pays its table
    /// lookups, as before the filter.
    RlUnfiltered,
    /// rl with every frame from one source (see the module doc).
    RlKnown,
    /// rl with the flood charged to one cached prefix cell (see the module
    /// doc).
    RlHotCell,
    /// rl with a cell per /24 throughout (`flood_wide_cells = false`; see
    /// the module doc).
    RlNoWide,
    Nft,
    /// nftables with a set that holds every source of both phases, so
    /// that it never stops applying the rule (the 1M set is full in the
    /// sustained phase, where its updates fail and new sources pass
    /// unlimited).
    NftRoomy,
}

impl Filter {
    const ALL: [Filter; 8] = [
        Filter::Pass,
        Filter::Rl,
        Filter::RlUnfiltered,
        Filter::RlKnown,
        Filter::RlHotCell,
        Filter::RlNoWide,
        Filter::Nft,
        Filter::NftRoomy,
    ];

    fn name(self) -> &'static str {
        match self {
            Filter::Pass => "bare XDP_PASS",
            Filter::Rl => "rl (flood mode)",
            Filter::RlUnfiltered => "rl, lookup filter off",
            Filter::RlKnown => "rl, one known source",
            Filter::RlHotCell => "rl, one hot cell",
            Filter::RlNoWide => "rl, wide cells off",
            Filter::Nft => "nftables dynset limit",
            Filter::NftRoomy => "nftables, 4M-element set",
        }
    }

    /// `[datapath]` settings prepended to rl's rules: the case's own, else
    /// `RL_BENCH_DATAPATH`.
    fn datapath(self) -> String {
        match self {
            Filter::RlHotCell => "[datapath]\nflood_prefix_v4 = 8\n".to_string(),
            Filter::RlNoWide => "[datapath]\nflood_wide_cells = false\n".to_string(),
            _ => std::env::var("RL_BENCH_DATAPATH").unwrap_or_default(),
        }
    }
}

/// The two nftables rule files: [`Filter::Nft`]'s and [`Filter::NftRoomy`]'s.
struct NftRules {
    full: std::path::PathBuf,
    roomy: std::path::PathBuf,
}

/// The two phases of a flood (see the module doc).
const PHASES: [&str; 2] = ["first", "sustained"];

/// Floods `lab` through `filter` with `frames` forged frames for each of
/// [`PHASES`]; returns busy CPU ns per frame of each.
/// `check`: also confirm the filter saw every frame (for nftables a
/// listing costs seconds, so the caller asks once).
fn one_run(
    lab: &Lab,
    filter: Filter,
    frames: u64,
    rules: &NftRules,
    check: bool,
) -> Result<[f64; 2]> {
    let mut dp = None;
    match filter {
        Filter::Pass
        | Filter::Rl
        | Filter::RlUnfiltered
        | Filter::RlKnown
        | Filter::RlHotCell
        | Filter::RlNoWide => {
            let mut d = datapath(&format!("{}{RL_CONFIG}", filter.datapath()))?;
            if filter == Filter::RlUnfiltered {
                d.known_filter()?.disable();
            }
            lab.b
                .run(move || {
                    if filter == Filter::Pass {
                        d.attach_baseline(VB)?;
                    } else {
                        d.attach(VB, rl_control::datapath::AttachMode::Native)?;
                    }
                    Ok(d)
                })
                .map(|d| dp = Some(d))?;
        }
        Filter::Nft => lab
            .b
            .exec("nft", &["-f", rules.full.to_str().context("rules path")?])?,
        Filter::NftRoomy => lab
            .b
            .exec("nft", &["-f", rules.roomy.to_str().context("rules path")?])?,
    }
    let one = filter == Filter::RlKnown || std::env::var("RL_BENCH_ONE_SOURCE").is_ok();
    let first = flood(lab, frames, 0x2545_f491, one)?;
    let sustained = flood(lab, frames, 0x9e37_79b9, one)?;
    let total = 2 * frames;
    if let Some(d) = &dp {
        if filter != Filter::Pass {
            // A wide cell starts drained (see README, "Floods"): on the
            // tick clock, a new one drops the frames of its first tick.
            // Those frames skip the stack's work, so they are reported.
            let passed = d.counters()?.get(STAT_PASSED_PKTS);
            let onset = if matches!(filter, Filter::Rl | Filter::RlUnfiltered) {
                total / 200
            } else {
                0
            };
            if passed + onset < total {
                bail!(
                    "rl passed {passed} of {total} frames: the limit was meant to pass all ({})",
                    d.counters()?
                );
            }
            if passed < total {
                eprintln!(
                    "  ({}: {} of {total} frames dropped as wide cells were made, drained)",
                    filter.name(),
                    total - passed
                );
            }
        }
    }
    drop(dp);
    if matches!(filter, Filter::Nft | Filter::NftRoomy) {
        let seen = if check { nft_counted(lab)? } else { total };
        lab.b
            .exec("nft", &["delete", "table", "netdev", "rlbench"])?;
        if seen < total {
            bail!("nftables saw {seen} of {total} frames: its hook was not on the path");
        }
    }
    Ok([first, sustained])
}

/// Sends `frames` forged frames from random 10/8 sources (the sequence
/// `seed` starts), or all from one source (`one`); returns busy CPU ns per
/// frame.
fn flood(lab: &Lab, frames: u64, mut seed: u32, one: bool) -> Result<f64> {
    let frame = eth(&[], ETH_P_IP, &ipv4([0; 4], UDP, &[], &udp(9)));
    let narrow = flood_prefixes()?;
    let clock = BusyClock::start();
    let sent = join(forged(&lab.a, VA, frame, frames, 0, Some(0), move |_| {
        if one {
            return [10, 1, 2, 3];
        }
        let mut s = spoofed_source(&mut seed);
        s[1] &= narrow;
        s
    }))?;
    let busy = clock.busy_ns();
    if sent.packets < frames {
        bail!("the generator sent {} of {frames} frames", sent.packets);
    }
    Ok(busy / frames as f64)
}

/// `RL_BENCH_PREFIXES`: the /24 prefixes the flood's sources span (a power
/// of two from 256 to 65,536, the default: all of 10/8), as the mask of the
/// source's second byte.
fn flood_prefixes() -> Result<u8> {
    let Ok(v) = std::env::var("RL_BENCH_PREFIXES") else {
        return Ok(255);
    };
    match v.parse::<u32>() {
        Ok(n) if n.is_power_of_two() && (256..=65_536).contains(&n) => Ok((n / 256 - 1) as u8),
        _ => bail!("RL_BENCH_PREFIXES={v}: expected a power of two from 256 to 65536"),
    }
}

/// The packets the nft rule's named counter saw (listing just the counter:
/// a chain listing would fetch the whole set, seconds for 1M elements).
fn nft_counted(lab: &Lab) -> Result<u64> {
    let out = std::process::Command::new("ip")
        .args([
            "netns",
            "exec",
            &lab.b.name,
            "nft",
            "list",
            "counter",
            "netdev",
            "rlbench",
            "seen",
        ])
        .output()
        .context("running nft")?;
    let text = String::from_utf8_lossy(&out.stdout);
    let mut words = text.split_whitespace().skip_while(|w| *w != "packets");
    words
        .nth(1)
        .and_then(|n| n.parse().ok())
        .with_context(|| format!("no counter in: {text}"))
}

fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(|a, b| a.partial_cmp(b).unwrap());
    v[v.len() / 2]
}

fn main() -> Result<()> {
    let frames: u64 = std::env::args()
        .nth(1)
        .map(|s| s.parse())
        .transpose()?
        .unwrap_or(1_000_000);
    let rounds = rounds()?;
    let lab = Lab::new()?;
    let dir = tempfile::tempdir()?;
    let rules = NftRules {
        full: dir.path().join("rlbench.nft"),
        roomy: dir.path().join("rlbench-roomy.nft"),
    };
    std::fs::write(&rules.full, nft_ruleset(1 << 20))?;
    std::fs::write(&rules.roomy, nft_ruleset(1 << 22))?;
    println!(
        "veth random-source flood: {frames} forged UDP/IPv4 frames per phase (first, sustained) from one sender \
         pinned to CPU 0, {rounds} interleaved rounds; busy CPU ns per frame over all CPUs (sender included), \
         by {}",
        BusyClock::source()
    );
    let steal = rl_tests::StealMeter::start();
    let mut filters = Filter::ALL.to_vec();
    if let Ok(only) = std::env::var("RL_BENCH_ONLY") {
        // For profiling one case: the baseline is still measured first.
        filters.retain(|f| *f == Filter::Pass || format!("{f:?}").eq_ignore_ascii_case(&only));
    }
    // ns[phase][filter][round]
    let mut ns: Vec<Vec<Vec<f64>>> = vec![vec![Vec::new(); filters.len()]; PHASES.len()];
    let started = Instant::now();
    // A warm-up run, not counted: first-touch costs land on no case.
    one_run(&lab, Filter::Pass, frames / 10, &rules, false)?;
    for round in 0..rounds {
        for (i, f) in filters.iter().enumerate() {
            let per_phase = one_run(&lab, *f, frames, &rules, round == 0)?;
            for (phase, v) in per_phase.into_iter().enumerate() {
                ns[phase][i].push(v);
            }
        }
    }
    let mut verdicts = Vec::new();
    for (phase, name) in PHASES.iter().enumerate() {
        let ns = &ns[phase];
        println!("{name} {frames} frames:");
        println!(
            "  {:<24} {:>10} {:>10} {:>16} {:>13}",
            "filter", "best ns", "median ns", "× XDP_PASS (med)", "rounds' range"
        );
        for (i, f) in filters.iter().enumerate() {
            // Each round's case against that round's baseline.
            let rounds: Vec<f64> = ns[i].iter().zip(&ns[0]).map(|(n, p)| n / p).collect();
            let (lo, hi) = rounds.iter().fold((f64::INFINITY, 0f64), |(lo, hi), r| {
                (lo.min(*r), hi.max(*r))
            });
            let best = ns[i].iter().cloned().fold(f64::INFINITY, f64::min);
            println!(
                "  {:<24} {:>10.0} {:>10.0} {:>16.3} {:>7.3}–{:.3}",
                f.name(),
                best,
                median(ns[i].clone()),
                median(rounds),
                lo,
                hi
            );
        }
        if filters.len() < Filter::ALL.len() {
            continue;
        }
        let at = |f: Filter| {
            filters
                .iter()
                .position(|g| *g == f)
                .expect("every case is measured")
        };
        let ratio = |i: Filter, j: Filter| {
            median(
                ns[at(i)]
                    .iter()
                    .zip(&ns[at(j)])
                    .map(|(a, b)| a / b)
                    .collect(),
            )
        };
        let (rl_vs_pass, rl_vs_nft) = (
            ratio(Filter::Rl, Filter::Pass),
            ratio(Filter::Rl, Filter::Nft),
        );
        println!(
            "  the lookup filter: rl {:.3}× rl with it off",
            ratio(Filter::Rl, Filter::RlUnfiltered)
        );
        println!(
            "  against an nftables set that never fills (every source of both phases has room): rl {:.3}× it",
            ratio(Filter::Rl, Filter::NftRoomy)
        );
        let (fixed, hot) = (
            ratio(Filter::RlKnown, Filter::Pass),
            ratio(Filter::RlHotCell, Filter::Pass),
        );
        println!(
            "  where rl's cost goes: its fixed cost (one known source) {:.3}×, the flood path with its state cached (one hot cell) {:+.3}×, the flood's per-prefix state {:+.3}×",
            fixed,
            hot - fixed,
            rl_vs_pass - hot
        );
        println!(
            "  wide cells: rl with them off (a cell per /24 throughout) {:.3}× bare XDP_PASS, with them (the default) {rl_vs_pass:.3}×",
            ratio(Filter::RlNoWide, Filter::Pass)
        );
        let met = |ok: bool| if ok { "met" } else { "MISSED" };
        verdicts.push(format!(
            "{name}: rl ≤ 1.10× bare XDP_PASS {} ({rl_vs_pass:.3}×), rl ≤ nftables {} ({rl_vs_nft:.3}× nftables)",
            met(rl_vs_pass <= 1.10),
            met(rl_vs_nft <= 1.0)
        ));
    }
    for v in verdicts {
        println!("target, {v}");
    }
    println!(
        "{} ({:.0} s)",
        steal.report().1,
        started.elapsed().as_secs_f64()
    );
    Ok(())
}
