//! `cargo xtask bench`: ns/packet of rl's XDP paths through BPF_PROG_TEST_RUN,
//! each as a ratio to a bare `XDP_DROP` program measured in the same run.
//!
//! Machines here are shared and noisy: load drifts over seconds and comes in
//! bursts of milliseconds. So the process pins itself to one CPU, the cases
//! are measured interleaved (every round runs each case), each case's time in
//! a round is the fastest of a few runs, and two ratios are printed:
//! - *best*: the fastest run of the case over the fastest run of the floor.
//!   Interference only ever adds time, so the fastest run is the best
//!   estimate of what the code itself costs; the targets are judged on it.
//! - *median*: the median over rounds of the case's time over the floor's
//!   time in the same round, which shows how much the machine's load moved
//!   the figures.

use anyhow::{bail, Context, Result};
use rl_control::{
    compile::compile,
    config::Config,
    datapath::{Datapath, LoadOptions, BENCH_NEW_SOURCES},
};
use rl_tests::{
    frames::{eth, ipv4_fragment, udp4, udp6, ETH_P_IP, UDP},
    XDP_DROP, XDP_PASS,
};

/// Interleaved rounds; in each, every case runs `SHOTS` times with `repeat`
/// packets per BPF_PROG_TEST_RUN call, and the fastest shot counts.
const ROUNDS: usize = 7;
const SHOTS: u32 = 3;

/// Salt masks (see `LoadOptions::bench_salt_mask`): one source, a new
/// source every packet, 65,536 sources in turn.
const ONE_SOURCE: u32 = 0;
const KNOWN_SOURCES: u32 = 0xffff;

fn load(rate: u64, burst: u64, max_sources: u32, salt_mask: u32) -> Result<Datapath> {
    load_toml(
        &format!(
            "[datapath]\nmax_sources = {max_sources}\n[default]\nrate = {rate}\nburst = {burst}\n"
        ),
        salt_mask,
    )
}

fn load_toml(toml: &str, bench_salt_mask: u32) -> Result<Datapath> {
    let config = Config::from_str(toml, "<bench>")?;
    Datapath::load_with(
        &compile(&config),
        LoadOptions {
            bench_salt_mask,
            ..Default::default()
        },
    )
    .context("loading the datapath")
}

/// `n` rules, the last one matching the bench frame (UDP to port 53) with a
/// limit it never reaches; the others match other ports, and every tenth has
/// a `src` list, so the source-class lookup is exercised. Plus `cidrs` deny
/// entries (IPv4 /32s in 100.64.0.0/10, which the frame's source is not in).
fn rules_config(n: usize, cidrs: usize) -> String {
    let mut t = String::from("[datapath]\nmax_sources = 1024\n[default]\nrate = 1\n");
    for i in 0..cidrs {
        t += &format!(
            "[[deny]]\ncidr = \"100.{}.{}.{}/32\"\n",
            64 + (i >> 16) % 64,
            (i >> 8) & 255,
            i & 255
        );
    }
    for i in 0..n - 1 {
        t += &format!(
            "[[rule]]\nname = \"r{i}\"\nproto = \"tcp\"\ndst_ports = [{}]\nrate = 5\n",
            1000 + i
        );
        if i % 10 == 0 {
            t += &format!("src = [\"10.{}.{}.0/24\"]\n", (i >> 8) & 255, i & 255);
        }
    }
    t += "[[rule]]\nname = \"dns\"\nproto = \"udp\"\ndst_ports = [53]\nrate = 100000000\nburst = 1000000000\n";
    t
}

type Run<'a> = Box<dyn FnMut() -> Result<(u32, std::time::Duration)> + 'a>;

/// One benchmarked path: how to run it once and the verdict it must give.
struct Case<'a> {
    name: &'static str,
    want: u32,
    run: Run<'a>,
    ns: Vec<f64>,
}

fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(|a, b| a.partial_cmp(b).unwrap());
    v[v.len() / 2]
}

fn main() -> Result<()> {
    // One CPU for the whole run: no migrations between runs, warm caches.
    let cpu = std::thread::available_parallelism().map_or(0, |n| n.get() - 1);
    rl_tests::lab::pin_to_cpu(cpu)?;
    let repeat: u32 = std::env::args()
        .nth(1)
        .map(|s| s.parse())
        .transpose()?
        .unwrap_or(1_000_000);
    let frame = udp4([198, 51, 100, 7]);
    // In a /16 that holds deny CIDRs (but not denied): the IPv4 first level
    // sends it on to the trie walk.
    let frame_in_listed_16 = udp4([100, 65, 200, 7]);
    // A bare later fragment whose datagram's first was never seen: a
    // fragment flood's packet, dropped by the default `fragment_orphans`.
    let orphan = eth(
        &[],
        ETH_P_IP,
        &ipv4_fragment([198, 51, 100, 7], UDP, 0x1234, 185, false, &[0; 32]),
    );
    let frame6 = udp6([0x20, 0x01, 0x0d, 0xb8, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 7]);
    println!(
        "rl XDP benchmark: BPF_PROG_TEST_RUN with repeat = {repeat}, {ROUNDS} interleaved rounds, fastest of {SHOTS} runs per case and round, 64-byte UDP/IPv4 frame, pinned to CPU {cpu}"
    );

    let steal = rl_tests::StealMeter::start();
    let mut floor_dp = load(1, 1, 1024, ONE_SOURCE)?;
    floor_dp.test_run_floor(&frame, 1)?;
    // Pass path: a known source far under its limit.
    let pass_dp = load(100_000_000, 1_000_000_000, 1024, ONE_SOURCE)?;
    pass_dp.test_run(&frame, 1)?;
    pass_dp.test_run(&frame6, 1)?;
    // The same path over 65,536 known sources in turn: the pass row's
    // instructions with the cache misses of many keys, as the unseen-source
    // rows below have them (their one-key, hot-cache twin is the row after
    // them). No flood mode while the sources get their buckets, and room
    // for all of them.
    let known_dp = load_toml(
        "[datapath]\nmax_sources = 262144\nflood_new_keys_per_sec = 1000000000\n[default]\nrate = 100000000\nburst = 1000000000\n",
        KNOWN_SOURCES,
    )?;
    known_dp.test_run(&frame, 2 * 65_536)?;
    let made = known_dp.counters()?.get(rl_common::STAT_NEW_SOURCES);
    if made != 65_536 {
        bail!("the known-sources case made {made} buckets, not 65,536");
    }
    // Drop path: a known source whose bucket is empty.
    let drop_dp = load(1, 1, 1024, ONE_SOURCE)?;
    drop_dp.test_run(&frame, 1)?;
    // Unseen-source path: every packet a new source. Past the CPU's share
    // of the flood threshold in one 67 ms window (3,356 with the defaults
    // on 2 CPUs) flood mode is on and unseen
    // sources are charged to their prefix cells, then, with the cells'
    // room spent, to the rule's last resort: the steady state of a
    // random-source flood. The limit is generous, so they pass.
    let new_dp = load(100_000_000, 1_000_000_000, 65_536, BENCH_NEW_SOURCES)?;
    // The same with the known-keys filter off: every unseen key pays its
    // table lookups (own bucket, prefix cell), as before the filter.
    let unfiltered_dp = load(100_000_000, 1_000_000_000, 65_536, BENCH_NEW_SOURCES)?;
    unfiltered_dp.known_filter()?.disable();
    // Past the flood's onset before the timed runs, whatever `repeat`: the
    // wide cells it makes start drained, so in the onset's ticks a run's
    // last packet may drop (the steady state is what is timed).
    for dp in [&new_dp, &unfiltered_dp] {
        dp.test_run(&frame, 300_000)?;
    }
    // The same path with one unseen source over and over (flood mode always
    // on: no new key ever gets a bucket): the instructions without the
    // cache misses of random keys.
    let hot_dp = load_toml(
        "[datapath]\nmax_sources = 65536\nflood_new_keys_per_sec = 0\n[default]\nrate = 100000000\nburst = 1000000000\n",
        ONE_SOURCE,
    )?;
    hot_dp.test_run(&frame, 1)?;
    // Rule sets of growing size: the per-packet cost must not grow with them.
    let r1 = load_toml(&rules_config(1, 0), ONE_SOURCE)?;
    let r100 = load_toml(&rules_config(100, 0), ONE_SOURCE)?;
    let r1000 = load_toml(&rules_config(1000, 100_000), ONE_SOURCE)?;
    let r1_cidrs = load_toml(&rules_config(1, 100_000), ONE_SOURCE)?;
    for dp in [&r1, &r100, &r1000, &r1_cidrs] {
        dp.test_run(&frame, 1)?;
    }
    r1000.test_run(&frame_in_listed_16, 1)?;

    let mut cases = vec![
        Case {
            name: "floor (bare XDP_DROP)",
            want: XDP_DROP,
            run: Box::new(|| Ok(floor_dp.test_run_floor(&frame, repeat)?)),
            ns: vec![],
        },
        Case {
            name: "pass (known source, under limit)",
            want: XDP_PASS,
            run: Box::new(|| Ok(pass_dp.test_run(&frame, repeat)?)),
            ns: vec![],
        },
        Case {
            name: "  same, 65,536 known sources in turn",
            want: XDP_PASS,
            run: Box::new(|| Ok(known_dp.test_run(&frame, repeat)?)),
            ns: vec![],
        },
        Case {
            name: "pass, IPv6 (known /64, under limit)",
            want: XDP_PASS,
            run: Box::new(|| Ok(pass_dp.test_run(&frame6, repeat)?)),
            ns: vec![],
        },
        Case {
            name: "drop (known source, over limit)",
            want: XDP_DROP,
            run: Box::new(|| Ok(drop_dp.test_run(&frame, repeat)?)),
            ns: vec![],
        },
        Case {
            name: "unseen source, flood mode",
            want: XDP_PASS,
            run: Box::new(|| Ok(new_dp.test_run(&frame, repeat)?)),
            ns: vec![],
        },
        Case {
            name: "  same, one unseen source (hot caches)",
            want: XDP_PASS,
            run: Box::new(|| Ok(hot_dp.test_run(&frame, repeat)?)),
            ns: vec![],
        },
        Case {
            name: "  same, lookup filter off",
            want: XDP_PASS,
            run: Box::new(|| Ok(unfiltered_dp.test_run(&frame, repeat)?)),
            ns: vec![],
        },
        Case {
            name: "later fragment, no first seen (orphan)",
            want: XDP_DROP,
            run: Box::new(|| Ok(pass_dp.test_run(&orphan, repeat)?)),
            ns: vec![],
        },
        Case {
            name: "1 rule",
            want: XDP_PASS,
            run: Box::new(|| Ok(r1.test_run(&frame, repeat)?)),
            ns: vec![],
        },
        Case {
            name: "100 rules",
            want: XDP_PASS,
            run: Box::new(|| Ok(r100.test_run(&frame, repeat)?)),
            ns: vec![],
        },
        Case {
            name: "1 rule + 100,000 deny CIDRs",
            want: XDP_PASS,
            run: Box::new(|| Ok(r1_cidrs.test_run(&frame, repeat)?)),
            ns: vec![],
        },
        Case {
            name: "1,000 rules + 100,000 deny CIDRs",
            want: XDP_PASS,
            run: Box::new(|| Ok(r1000.test_run(&frame, repeat)?)),
            ns: vec![],
        },
        Case {
            name: "  same, source in a listed /16 (trie)",
            want: XDP_PASS,
            run: Box::new(|| Ok(r1000.test_run(&frame_in_listed_16, repeat)?)),
            ns: vec![],
        },
    ];
    for _ in 0..ROUNDS {
        for case in cases.iter_mut() {
            let mut best = f64::INFINITY;
            for _ in 0..SHOTS {
                let (verdict, per_packet) = (case.run)()?;
                if verdict != case.want {
                    bail!("{}: verdict {verdict}, expected {}", case.name, case.want);
                }
                best = best.min(per_packet.as_nanos() as f64);
            }
            case.ns.push(best);
        }
    }
    let floor = cases[0].ns.clone();
    let best = |v: &[f64]| v.iter().cloned().fold(f64::INFINITY, f64::min);
    println!(
        "{:<38} {:>8} {:>10} {:>13} {:>15}",
        "path", "best ns", "median ns", "× floor best", "× floor median"
    );
    let mut ratios = Vec::new();
    for case in &cases {
        let paired = median(case.ns.iter().zip(&floor).map(|(n, f)| n / f).collect());
        let ratio = best(&case.ns) / best(&floor);
        println!(
            "{:<38} {:>8.1} {:>10.1} {:>13.2} {:>15.2}",
            case.name,
            best(&case.ns),
            median(case.ns.clone()),
            ratio,
            paired
        );
        ratios.push(ratio);
    }
    let c = new_dp.counters()?;
    let unseen = repeat as f64 * SHOTS as f64 * ROUNDS as f64;
    println!(
        "unseen-source runs created {} buckets and {} prefix cells; {:.3} of their packets were charged to a fallback",
        c.get(rl_common::STAT_NEW_SOURCES),
        c.get(rl_common::STAT_NEW_CELLS),
        c.get(rl_common::STAT_FALLBACK) as f64 / unseen
    );
    // Rows by name: inserting a row must not shift what is compared.
    let ns = |name: &str| {
        best(
            &cases
                .iter()
                .find(|c| c.name == name)
                .expect("a case of that name")
                .ns,
        )
    };
    let vs = |a: &str, b: &str| ns(a) / ns(b);
    let (pass, unseen, hot, unfiltered) = (
        "pass (known source, under limit)",
        "unseen source, flood mode",
        "  same, one unseen source (hot caches)",
        "  same, lookup filter off",
    );
    let (unseen_vs_pass, hot_vs_pass) = (vs(unseen, pass), vs(hot, pass));
    println!(
        "the lookup filter: unseen source {:.1} ns with it, {:.1} ns without ({:.2}× the known-source pass without it)",
        ns(unseen),
        ns(unfiltered),
        vs(unfiltered, pass)
    );
    println!(
        "target unseen source in flood mode ≤ 2× the known-source pass: {} ({unseen_vs_pass:.2}×; {hot_vs_pass:.2}× with hot caches)",
        if unseen_vs_pass <= 2.0 { "met" } else { "MISSED" }
    );
    // The same paths with the same caches: many keys against many keys
    // (the cache misses of random keys are the machine's, not the path's).
    println!(
        "unseen source against 65,536 known sources in turn (many keys both): {:.2}×; one key both: {hot_vs_pass:.2}×",
        vs(unseen, "  same, 65,536 known sources in turn")
    );
    let h = hot_dp.counters()?;
    if h.get(rl_common::STAT_NEW_SOURCES) != 0 {
        bail!(
            "the hot unseen-source case created {} buckets: its source was not unseen",
            h.get(rl_common::STAT_NEW_SOURCES)
        );
    }
    println!(
        "clock: tick {} ns (0 = ktime only)",
        pass_dp.clock().tick_ns
    );
    println!(
        "verifier: {} of 1,000,000 instructions walked to accept the limiter",
        pass_dp
            .verified_instructions()
            .map_or("?".into(), |n| n.to_string())
    );
    // Rule-count scaling, on the best runs like the floor ratios.
    let (one, cidrs, big) = (
        "1 rule",
        "1 rule + 100,000 deny CIDRs",
        "1,000 rules + 100,000 deny CIDRs",
    );
    let trie = "  same, source in a listed /16 (trie)";
    let (big_vs_one, cidrs_vs_one, trie_vs_one, big_vs_cidrs) =
        (vs(big, one), vs(cidrs, one), vs(trie, one), vs(big, cidrs));
    println!(
        "1,000 rules + 100k CIDRs vs 1 rule: {big_vs_one:.2}× ({trie_vs_one:.2}× for a source whose /16 holds CIDRs, so the trie is walked); \
         vs 1 rule + the same CIDRs: {big_vs_cidrs:.2}×; 1 rule + the CIDRs vs 1 rule: {cidrs_vs_one:.2}×"
    );
    println!(
        "target 1,000 rules + 100k CIDRs ≤ 1.2× one rule: {} ({big_vs_one:.2}×)",
        if big_vs_one <= 1.2 { "met" } else { "MISSED" }
    );
    let target = 3.0;
    for (name, ratio) in [("pass", ratios[1]), ("drop", ratios[3])] {
        println!(
            "target {name} ≤ {target}× floor: {} ({ratio:.2}×)",
            if ratio <= target { "met" } else { "MISSED" }
        );
    }
    println!("{}", steal.report().1);
    drop(cases);
    Ok(())
}
