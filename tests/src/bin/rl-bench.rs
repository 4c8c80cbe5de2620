//! `cargo xtask bench`: ns/packet of rl's XDP paths through BPF_PROG_TEST_RUN,
//! each as a ratio to a bare `XDP_DROP` program measured in the same run.

use anyhow::{bail, Context, Result};
use rl_control::{
    compile::compile,
    config::Config,
    datapath::{Datapath, LoadOptions},
};
use rl_tests::frames::udp4;

const XDP_DROP: u32 = 1;
const XDP_PASS: u32 = 2;
/// Each figure is the median of this many runs of `repeat` packets.
const ROUNDS: usize = 5;

fn load(rate: u64, burst: u64, max_sources: u32, bench_new_sources: bool) -> Result<Datapath> {
    let toml = format!("[datapath]\nmax_sources = {max_sources}\n[default]\nrate = {rate}\nburst = {burst}\n");
    let config = Config::from_str(&toml, "<bench>")?;
    Datapath::load_with(&compile(&config), LoadOptions { bench_new_sources }).context("loading the datapath")
}

/// Median ns/packet over [`ROUNDS`] runs, checking every run's verdict.
fn measure(mut run: impl FnMut() -> Result<(u32, std::time::Duration)>, want: u32, what: &str) -> Result<f64> {
    let mut ns = Vec::new();
    for _ in 0..ROUNDS {
        let (verdict, per_packet) = run()?;
        if verdict != want {
            bail!("{what}: verdict {verdict}, expected {want}");
        }
        ns.push(per_packet.as_nanos() as f64);
    }
    ns.sort_by(|a, b| a.partial_cmp(b).unwrap());
    Ok(ns[ROUNDS / 2])
}

fn main() -> Result<()> {
    let repeat: u32 = std::env::args().nth(1).map(|s| s.parse()).transpose()?.unwrap_or(1_000_000);
    let frame = udp4([198, 51, 100, 7]);
    // The kernel reports a whole-nanosecond mean per run; many repeats give stable means.
    println!("rl XDP benchmark: BPF_PROG_TEST_RUN, repeat {repeat}, median of {ROUNDS} runs, 64-byte UDP/IPv4 frame");

    let mut floor_dp = load(1, 1, 1024, false)?;
    let floor = measure(|| Ok(floor_dp.test_run_floor(&frame, repeat)?), XDP_DROP, "floor")?;

    // Pass path: a known source far under its limit.
    let pass_dp = load(100_000_000, 1_000_000_000, 1024, false)?;
    pass_dp.test_run(&frame, 1)?;
    let pass = measure(|| Ok(pass_dp.test_run(&frame, repeat)?), XDP_PASS, "pass path")?;

    // Drop path: a known source whose bucket is empty.
    let drop_dp = load(1, 1, 1024, false)?;
    drop_dp.test_run(&frame, 1)?;
    let drop = measure(|| Ok(drop_dp.test_run(&frame, repeat)?), XDP_DROP, "drop path")?;

    // New-source path: every packet a new source, LRU insert (and, once the
    // map is full, eviction: 65,536 entries, the steady state of a
    // random-source flood).
    let new_dp = load(1000, 2000, 65_536, true)?;
    let new = measure(|| Ok(new_dp.test_run(&frame, repeat)?), XDP_PASS, "new-source path")?;
    let c = new_dp.counters()?;

    println!("{:<34} {:>9} {:>14}", "path", "ns/packet", "× floor");
    let row = |name: &str, ns: f64| println!("{name:<34} {ns:>9.1} {:>14.2}", ns / floor);
    row("floor (bare XDP_DROP)", floor);
    row("pass (known source, under limit)", pass);
    row("drop (known source, over limit)", drop);
    row("new source (LRU insert/evict)", new);
    println!(
        "new-source runs created {} buckets ({} per packet)",
        c.get(rl_common::STAT_NEW_SOURCES),
        c.get(rl_common::STAT_NEW_SOURCES) as f64 / (repeat as f64 * ROUNDS as f64)
    );
    let target = 3.0;
    for (name, ns) in [("pass", pass), ("drop", drop)] {
        let ratio = ns / floor;
        println!("target {name} ≤ {target}× floor: {} ({ratio:.2}×)", if ratio <= target { "met" } else { "MISSED" });
    }
    Ok(())
}
