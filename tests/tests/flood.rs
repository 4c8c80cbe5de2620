//! Real floods through a veth pair into the attached XDP limiter: the number
//! of packets that reach a receiver behind it must be `burst + rate × time`.

use std::{net::IpAddr, time::Duration};

use rl_common::STAT_PASSED_PKTS;
use rl_control::datapath::AttachMode;
use rl_tests::{
    attach, expected_passed,
    frames::{eth, ipv4, udp, ETH_P_8021AD, ETH_P_8021Q, ETH_P_IP, UDP},
    lab::{Lab, VA, VB},
    tolerance,
    traffic::{flood, join, paced, raw_flood, Receiver, Sent, STALL},
};

const FLOOD: Duration = Duration::from_millis(3200);

fn config(rate: u64, burst: u64, extra: &str) -> String {
    format!("[datapath]\nmax_sources = 4096\n{extra}\n[default]\nrate = {rate}\nburst = {burst}\n")
}

/// The first and the last send of the flood `sent`.
fn bounds(sent: &[Sent]) -> (std::time::Instant, std::time::Instant) {
    let start = sent
        .iter()
        .map(|s| s.started)
        .min()
        .expect("a flood has senders");
    let end = sent
        .iter()
        .map(|s| s.ended)
        .max()
        .expect("a flood has senders");
    (start, end)
}

/// Seconds from the first packet of `sent` to the last.
fn span(sent: &[Sent]) -> f64 {
    let (start, end) = bounds(sent);
    (end - start).as_secs_f64()
}

/// Seconds of the flood in which no sender sent (every sender was stalled
/// or not yet started or done) beyond the first `burst_secs` of each such
/// gap: a bucket that the flood keeps empty refills while nobody sends,
/// and what it would gain past a full burst is lost to any limiter.
fn idle_beyond_burst(sent: &[Sent], burst_secs: f64) -> f64 {
    assert!(
        burst_secs >= STALL.as_secs_f64(),
        "a burst of {burst_secs} s is shorter than the shortest stall the senders record"
    );
    let (start, end) = bounds(sent);
    // Each sender's quiet intervals within [start, end], in order, those
    // that touch merged (a burst refills once per gap).
    let quiet = |s: &Sent| {
        let mut q = vec![(start, s.started)];
        q.extend(s.stalls.iter().copied());
        q.push((s.ended, end));
        q.retain(|(a, b)| b > a);
        q.sort();
        let mut merged: Vec<(std::time::Instant, std::time::Instant)> = Vec::new();
        for (a, b) in q {
            match merged.last_mut() {
                Some(last) if a <= last.1 => last.1 = last.1.max(b),
                _ => merged.push((a, b)),
            }
        }
        merged
    };
    // Their intersection over all senders.
    let mut idle = quiet(&sent[0]);
    for s in &sent[1..] {
        let other = quiet(s);
        idle = idle
            .iter()
            .flat_map(|&(a, b)| other.iter().map(move |&(c, d)| (a.max(c), b.min(d))))
            .filter(|(a, b)| b > a)
            .collect();
    }
    idle.iter().fold(0.0, |sum, (a, b)| {
        sum + ((*b - *a).as_secs_f64() - burst_secs).max(0.0)
    })
}

fn assert_accurate(what: &str, passed: u64, rate: u64, burst: u64, sent: &[Sent]) {
    let secs = span(sent);
    let idle = idle_beyond_burst(sent, burst as f64 / rate as f64);
    assert!(
        idle < 0.25 * secs,
        "{what}: the senders (or the datapath, in their softirq) stalled for {:.0} ms of {secs:.3} s: \
         this machine is too busy to keep a flood up",
        idle * 1e3
    );
    let expected = expected_passed(rate, burst, secs - idle);
    let tol = tolerance(expected);
    let offered: u64 = sent.iter().map(|s| s.packets).sum();
    eprintln!(
        "{what}: offered {offered} in {secs:.3} s (senders idle {:.1} ms past a burst), passed {passed}, \
         expected {expected:.1} ± {tol:.1}",
        idle * 1e3
    );
    assert!(
        offered as f64 > 3.0 * expected,
        "{what}: the flood was not far above the limit: offered {offered}"
    );
    assert!(
        (passed as f64 - expected).abs() <= tol,
        "{what}: passed {passed}, expected {expected:.1} ± {tol:.1} (offered {offered} in {secs:.3} s, \
         senders idle {:.1} ms past a burst)",
        idle * 1e3
    );
}

/// One source floods for 3.2 s from the given CPUs; returns what reached the receiver.
/// `coarse`: whether the limit must read the tick clock (else ktime).
fn single_source_flood(
    rate: u64,
    burst: u64,
    mode: AttachMode,
    cpus: &[Option<usize>],
    coarse: bool,
) {
    let lab = Lab::new().unwrap();
    let dp = attach(&lab, &config(rate, burst, ""), mode).unwrap();
    let clock = dp.clock();
    assert!(
        [100, 250, 300, 1000]
            .iter()
            .any(|hz| clock.tick_ns == 1_000_000_000 / hz),
        "the measured kernel tick {} ns is not 1e9/HZ for any usual HZ",
        clock.tick_ns
    );
    let kind = dp.active_rule(0).unwrap().limits[0].kind;
    assert_eq!(
        kind & rl_common::LIMIT_COARSE != 0,
        coarse,
        "clock choice for {rate} pps burst {burst}"
    );
    let rx = Receiver::start(&lab.b).unwrap();
    let senders: Vec<_> = cpus
        .iter()
        .map(|cpu| flood(&lab.a, lab.v4(1), lab.v4(2), FLOOD, *cpu))
        .collect();
    let sent: Vec<Sent> = senders.into_iter().map(|h| join(h).unwrap()).collect();
    let got = rx.finish().unwrap();
    let passed = got.get(&lab.v4(1)).copied().unwrap_or(0);
    // The datapath's own count, named in a failure too: it tells a limiter
    // that passed too few from a receiver that lost some.
    let c = dp.counters().unwrap();
    let ip_passed = c.get(STAT_PASSED_PKTS) - c.get(rl_common::STAT_NON_IP);
    let what = format!(
        "{rate} pps, burst {burst}, {mode} mode, {} sender(s), XDP passed {ip_passed} ({c})",
        cpus.len()
    );
    assert_accurate(&what, passed, rate, burst, &sent);
    // The datapath's own count agrees with the receiver's.
    assert!(
        ip_passed >= passed && ip_passed <= passed + 10,
        "XDP passed {ip_passed} IP packets, receiver got {passed}: {c}"
    );
    if cpus.len() > 1 {
        let per_cpu = dp.counters_per_cpu().unwrap();
        for cpu in cpus.iter().flatten() {
            assert!(
                per_cpu[*cpu].get(STAT_PASSED_PKTS) > 0,
                "the program never passed a packet on CPU {cpu}: the senders did not exercise both CPUs"
            );
        }
    }
}

#[test]
fn flood_at_100_pps_passes_burst_plus_rate_times_duration() {
    single_source_flood(100, 50, AttachMode::Native, &[None], true);
}

#[test]
fn flood_at_10000_pps_passes_burst_plus_rate_times_duration() {
    single_source_flood(10_000, 1_000, AttachMode::Native, &[None], true);
}

/// A burst shorter than a few kernel ticks reads ktime instead of jiffies;
/// that path must be exactly as accurate.
#[test]
fn flood_with_a_burst_of_a_few_ms_is_as_accurate_on_ktime() {
    single_source_flood(10_000, 20, AttachMode::Native, &[None], false);
}

/// In skb mode the program runs on the CPU that sent the packet, so two
/// senders pinned to CPUs 0 and 1 make both CPUs update one bucket at once.
#[test]
fn one_source_flooding_from_two_cpus_is_held_exactly() {
    let cpus = std::thread::available_parallelism()
        .map(|n| n.get())
        .unwrap_or(1);
    assert!(cpus >= 2, "this test needs 2 CPUs; found {cpus}");
    single_source_flood(10_000, 1_000, AttachMode::Skb, &[Some(0), Some(1)], true);
}

#[test]
fn sources_are_independent_and_a_source_under_its_limit_loses_nothing() {
    let (rate, burst) = (200, 100);
    let lab = Lab::new().unwrap();
    lab.add_source(&format!("{}/24", lab.v4(3))).unwrap();
    lab.add_source(&format!("{}/24", lab.v4(4))).unwrap();
    let _dp = attach(&lab, &config(rate, burst, ""), AttachMode::Native).unwrap();
    let rx = Receiver::start(&lab.b).unwrap();
    let f1 = flood(&lab.a, lab.v4(1), lab.v4(2), FLOOD, None);
    let f3 = flood(&lab.a, lab.v4(3), lab.v4(2), FLOOD, None);
    // 150 packets/s, under the 200/s limit, for 3 s.
    let calm = paced(&lab.a, lab.v4(4), lab.v4(2), 150, 450);
    let (s1, s3, sc) = (join(f1).unwrap(), join(f3).unwrap(), join(calm).unwrap());
    let got = rx.finish().unwrap();
    let n = |ip: IpAddr| got.get(&ip).copied().unwrap_or(0);
    assert_accurate("flooding source 1", n(lab.v4(1)), rate, burst, &[s1]);
    assert_accurate("flooding source 2", n(lab.v4(3)), rate, burst, &[s3]);
    assert_eq!(
        n(lab.v4(4)),
        sc.packets,
        "the source under its limit lost packets"
    );
}

#[test]
fn ipv6_is_limited_per_64_by_default() {
    let (rate, burst) = (100, 100);
    let lab = Lab::new().unwrap();
    // Sources: one alone in net 1; two hosts sharing net 2; nets 3 and 4 apart.
    let alone = lab.v6_net(1, 1);
    let (shared_a, shared_b) = (lab.v6_net(2, 1), lab.v6_net(2, 2));
    let (apart_a, apart_b) = (lab.v6_net(3, 1), lab.v6_net(4, 1));
    for ip in [alone, shared_a, shared_b, apart_a, apart_b] {
        lab.add_source(&format!("{ip}/64")).unwrap();
    }
    let dp = attach(&lab, &config(rate, burst, ""), AttachMode::Native).unwrap();
    let rx = Receiver::start(&lab.b).unwrap();
    let dst = lab.v6(2);
    let hs: Vec<_> = [alone, shared_a, shared_b, apart_a, apart_b]
        .iter()
        .map(|ip| flood(&lab.a, *ip, dst, FLOOD, None))
        .collect();
    let sent: Vec<Sent> = hs.into_iter().map(|h| join(h).unwrap()).collect();
    let got = rx.finish().unwrap();
    let n = |ip: IpAddr| got.get(&ip).copied().unwrap_or(0);
    assert_accurate(
        "IPv6 source alone in its /64",
        n(alone),
        rate,
        burst,
        &sent[0..1],
    );
    assert_accurate(
        "two IPv6 hosts in one /64 (one shared bucket)",
        n(shared_a) + n(shared_b),
        rate,
        burst,
        &sent[1..3],
    );
    assert!(
        n(shared_a) > 0 && n(shared_b) > 0,
        "both hosts of the shared /64 got some packets through"
    );
    assert_accurate("IPv6 /64 number 3", n(apart_a), rate, burst, &sent[3..4]);
    assert_accurate("IPv6 /64 number 4", n(apart_b), rate, burst, &sent[4..5]);
    // Buckets: nets 1, 2, 3, 4 (plus link-local sources of neighbour discovery).
    let in_lab = |a: &IpAddr| matches!(a, IpAddr::V6(v6) if v6.octets()[0] == 0xfd);
    let keys = dp
        .sources()
        .unwrap()
        .iter()
        .filter(|s| in_lab(&s.addr))
        .count();
    assert_eq!(keys, 4, "expected one bucket per /64");
}

/// Tagged frames are built by hand and sent through an AF_PACKET socket (the
/// test kernel may lack VLAN devices); a tap on the protected side counts
/// what XDP passed.
#[test]
fn vlan_and_qinq_traffic_is_limited_like_untagged() {
    let (rate, burst) = (100, 50);
    let lab = Lab::new().unwrap();
    let _dp = attach(&lab, &config(rate, burst, ""), AttachMode::Native).unwrap();
    let rx = Receiver::tap(&lab.b, VB).unwrap();
    let (q, qinq, plain) = ([192, 0, 2, 10], [192, 0, 2, 11], [192, 0, 2, 12]);
    let tagged = |tags: &[(u16, u16)], src| eth(tags, ETH_P_IP, &ipv4(src, UDP, &[], &udp(53)));
    let hs = [
        raw_flood(&lab.a, VA, tagged(&[(ETH_P_8021Q, 100)], q), FLOOD),
        raw_flood(
            &lab.a,
            VA,
            tagged(&[(ETH_P_8021AD, 200), (ETH_P_8021Q, 300)], qinq),
            FLOOD,
        ),
        raw_flood(&lab.a, VA, tagged(&[], plain), FLOOD),
    ];
    let sent: Vec<Sent> = hs.into_iter().map(|h| join(h).unwrap()).collect();
    let got = rx.finish().unwrap();
    let n = |ip: [u8; 4]| got.get(&IpAddr::from(ip)).copied().unwrap_or(0);
    assert_accurate("802.1Q tagged source", n(q), rate, burst, &sent[0..1]);
    assert_accurate(
        "802.1ad+802.1Q (QinQ) tagged source",
        n(qinq),
        rate,
        burst,
        &sent[1..2],
    );
    assert_accurate("untagged source", n(plain), rate, burst, &sent[2..3]);
}

/// Wall-clock (Unix epoch) seconds at `t`.
fn epoch_secs(t: std::time::Instant) -> f64 {
    let now = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .unwrap()
        .as_secs_f64();
    now - t.elapsed().as_secs_f64()
}

/// Windows over a real flood, 1 s windows at 200 packets: a fixed window
/// passes its cap in every epoch-aligned second the flood touches (the
/// count restarts at each boundary); a sliding window passes `rate` per
/// second in steady state, between `rate × (time − 1)` and `rate × (time + 1)`
/// in all, and never the fixed window's extra cap at a boundary.
#[test]
fn windows_hold_a_real_flood_to_their_documented_bounds() {
    let rate = 200u64;
    for algorithm in ["fixed_window", "sliding_window"] {
        let lab = Lab::new().unwrap();
        let toml = format!(
            "[datapath]\nmax_sources = 4096\n[default]\nrate = 1000000\n[[rule]]\nname = \"w\"\nsrc = [\"{}/32\"]\nrate = {rate}\nper = \"1s\"\nalgorithm = \"{algorithm}\"\n",
            lab.v4(1)
        );
        let dp = attach(&lab, &toml, AttachMode::Native).unwrap();
        let rx = Receiver::start(&lab.b).unwrap();
        let sent = join(flood(&lab.a, lab.v4(1), lab.v4(2), FLOOD, None)).unwrap();
        let passed = rx.finish().unwrap().get(&lab.v4(1)).copied().unwrap_or(0);
        let (start, end) = (epoch_secs(sent.started), epoch_secs(sent.ended));
        let secs = end - start;
        eprintln!(
            "{algorithm}: offered {} from epoch {start:.3} to {end:.3}, passed {passed}",
            sent.packets
        );
        assert_eq!(
            dp.rule_stats().unwrap()["w"].passed_pkts,
            passed,
            "{algorithm}: the rule's counter agrees with the receiver"
        );
        if algorithm == "fixed_window" {
            // Boundaries within 10 ms of the ends may fall either way (clock
            // tick, send timing): accept each count they allow.
            let touched = |s: f64, e: f64| (e.floor() - s.floor()) as u64 + 1;
            let lo = touched(start + 0.01, end - 0.01);
            let hi = touched(start - 0.01, end + 0.01);
            assert!(
                passed >= rate * lo - 2 && passed <= rate * hi,
                "fixed window passed {passed}: expected {rate} in each of the {lo}..={hi} seconds the flood touched"
            );
        } else {
            let (lo, hi) = (rate as f64 * (secs - 1.0), rate as f64 * (secs + 1.0));
            assert!(
                passed as f64 >= lo && passed as f64 <= hi,
                "sliding window passed {passed} in {secs:.3} s: expected {lo:.0}..={hi:.0}"
            );
        }
    }
}
