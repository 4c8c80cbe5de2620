//! Packet-level tests of the real XDP program through BPF_PROG_TEST_RUN:
//! parsing verdicts, counters, aggregation and cross-CPU exactness.

use std::time::Instant;

use rl_common::{
    STAT_CONTENDED, STAT_DROPPED_PKTS, STAT_MALFORMED, STAT_NEW_SOURCES, STAT_NON_IP,
    STAT_PASSED_PKTS,
};
use rl_control::datapath::Datapath;
use rl_tests::{
    datapath,
    frames::*,
    lab::{pin_to_cpu, require_root},
    offer, XDP_DROP, XDP_PASS,
};

fn verdict(dp: &Datapath, frame: &[u8]) -> u32 {
    dp.test_run(frame, 1).expect("test run").0
}

/// A limit that does not refill during a test (1 packet/s).
fn config(burst: u32, extra: &str) -> String {
    format!("[datapath]\nmax_sources = 4096\n{extra}\n[default]\nrate = 1\nburst = {burst}\n")
}

fn v6(last: u8, net: u8) -> [u8; 16] {
    let mut a = [0u8; 16];
    a[0] = 0xfd;
    a[7] = net;
    a[15] = last;
    a
}

#[test]
fn malformed_and_truncated_frames_get_defined_verdicts() {
    require_root();
    let dp = datapath(&config(1000, "")).unwrap();
    let src = [192, 0, 2, 1];
    let v4 = |proto, l4: &[u8]| eth(&[], ETH_P_IP, &ipv4(src, proto, &[], l4));
    let mut bad_version = ipv4(src, UDP, &[], &udp(53));
    bad_version[0] = 0x65;
    let mut short_ihl = ipv4(src, UDP, &[], &udp(53));
    short_ihl[0] = 0x44;
    let mut tcp_doff = tcp(80, 0x02);
    tcp_doff[12] = 4 << 4;
    let mut tcp_options_past_end = tcp(80, 0x02);
    tcp_options_past_end[12] = 10 << 4;
    tcp_options_past_end.extend_from_slice(&[1, 1, 1, 1]);
    // Seven destination-options headers before UDP: one more than the bound.
    let seven_ext = (0..7).fold(udp(53), |inner, i| {
        ipv6_ext(if i == 0 { UDP } else { 60 }, &inner)
    });
    let six_ext = (0..6).fold(udp(53), |inner, i| {
        ipv6_ext(if i == 0 { UDP } else { 60 }, &inner)
    });
    let two_ext = ipv6_ext(60, &ipv6_ext(UDP, &udp(53)));
    let mut non_first_v4 = ipv4(src, UDP, &[], &[1, 2, 3]);
    non_first_v4[6] = 0x00;
    non_first_v4[7] = 0x10; // offset 16 × 8 bytes

    // (what, frame, verdict, counted as non-IP, counted as malformed)
    let cases: Vec<(&str, Vec<u8>, u32, bool, bool)> = vec![
        (
            "ARP",
            eth(&[], ETH_P_ARP, &[0u8; 28]),
            XDP_PASS,
            true,
            false,
        ),
        (
            "Ethernet header only",
            eth(&[], 0x88b5, &[]),
            XDP_PASS,
            true,
            false,
        ),
        (
            "truncated VLAN tag",
            eth(&[], ETH_P_8021Q, &[0, 100]),
            XDP_PASS,
            true,
            false,
        ),
        (
            "three VLAN tags (priority tags the kernel would strip)",
            eth(
                &[(ETH_P_8021Q, 0), (ETH_P_8021Q, 0), (ETH_P_8021Q, 0)],
                ETH_P_IP,
                &ipv4(src, UDP, &[], &udp(53)),
            ),
            XDP_DROP,
            false,
            true,
        ),
        (
            "IPv4 header cut at 10 bytes",
            eth(&[], ETH_P_IP, &ipv4(src, UDP, &[], &[])[..10]),
            XDP_DROP,
            false,
            true,
        ),
        (
            "IPv4 version 6 in an IPv4 frame",
            eth(&[], ETH_P_IP, &bad_version),
            XDP_DROP,
            false,
            true,
        ),
        (
            "IPv4 IHL 4",
            eth(&[], ETH_P_IP, &short_ihl),
            XDP_DROP,
            false,
            true,
        ),
        (
            "IPv4 options cut short",
            eth(
                &[],
                ETH_P_IP,
                &ipv4(src, UDP, &[1, 1, 1, 1, 1, 1, 1, 1], &[])[..24],
            ),
            XDP_DROP,
            false,
            true,
        ),
        (
            "TCP header cut at 10 bytes",
            v4(TCP, &tcp(80, 2)[..10]),
            XDP_DROP,
            false,
            true,
        ),
        (
            "TCP data offset 4",
            v4(TCP, &tcp_doff),
            XDP_DROP,
            false,
            true,
        ),
        (
            "UDP header cut at 4 bytes",
            v4(UDP, &udp(53)[..4]),
            XDP_DROP,
            false,
            true,
        ),
        (
            "ICMP header cut at 2 bytes",
            v4(ICMP, &[8, 0]),
            XDP_DROP,
            false,
            true,
        ),
        // First fragments (offset 0, more to come) too short for the L4
        // header they claim: malformed, not orphans and not whole packets.
        (
            "IPv4 first fragment, UDP header cut at 4 bytes",
            eth(
                &[],
                ETH_P_IP,
                &ipv4_fragment(src, UDP, 7, 0, true, &udp(53)[..4]),
            ),
            XDP_DROP,
            false,
            true,
        ),
        (
            "IPv4 first fragment, TCP header cut at 12 bytes",
            eth(
                &[],
                ETH_P_IP,
                &ipv4_fragment(src, TCP, 8, 0, true, &tcp(80, 2)[..12]),
            ),
            XDP_DROP,
            false,
            true,
        ),
        // A TCP header whose data offset claims options past the first
        // fragment (RFC 1858's tiny fragment): 40 bytes claimed, 24 held.
        (
            "IPv4 first fragment, TCP options past its end",
            eth(
                &[],
                ETH_P_IP,
                &ipv4_fragment(src, TCP, 10, 0, true, &tcp_options_past_end),
            ),
            XDP_DROP,
            false,
            true,
        ),
        (
            "IPv6 first fragment, TCP options past its end",
            eth(
                &[],
                ETH_P_IPV6,
                &ipv6(
                    v6(1, 0),
                    44,
                    &ipv6_fragment(TCP, 0, true, 11, &tcp_options_past_end),
                ),
            ),
            XDP_DROP,
            false,
            true,
        ),
        // The same header whole (not a fragment): the kernel judges it.
        (
            "TCP options past the packet's end, not a fragment",
            v4(TCP, &tcp_options_past_end),
            XDP_PASS,
            false,
            false,
        ),
        (
            "IPv6 first fragment, UDP header cut at 6 bytes",
            eth(
                &[],
                ETH_P_IPV6,
                &ipv6(v6(1, 0), 44, &ipv6_fragment(UDP, 0, true, 9, &udp(53)[..6])),
            ),
            XDP_DROP,
            false,
            true,
        ),
        (
            "IPv6 header cut at 30 bytes",
            eth(&[], ETH_P_IPV6, &ipv6(v6(1, 0), UDP, &udp(53))[..30]),
            XDP_DROP,
            false,
            true,
        ),
        (
            "IPv6 seven extension headers",
            eth(&[], ETH_P_IPV6, &ipv6(v6(1, 0), 60, &seven_ext)),
            XDP_DROP,
            false,
            true,
        ),
        (
            "IPv6 extension header cut",
            eth(&[], ETH_P_IPV6, &ipv6(v6(1, 0), 0, &[17])),
            XDP_DROP,
            false,
            true,
        ),
        (
            "IPv6 UDP cut after extension header",
            eth(
                &[],
                ETH_P_IPV6,
                &ipv6(v6(1, 0), 0, &ipv6_ext(UDP, &[0, 53])),
            ),
            XDP_DROP,
            false,
            true,
        ),
        // Well-formed but unusual: limited by source (the bucket has room), so passed.
        (
            "IPv4 with options + UDP",
            eth(&[], ETH_P_IP, &ipv4(src, UDP, &[1, 1, 1, 1], &udp(53))),
            XDP_PASS,
            false,
            false,
        ),
        // Its first fragment was never seen: an orphan, dropped by default.
        (
            "IPv4 non-first fragment",
            eth(&[], ETH_P_IP, &non_first_v4),
            XDP_DROP,
            false,
            false,
        ),
        (
            "IPv4 GRE (unknown L4)",
            v4(47, &[0, 0, 8, 0]),
            XDP_PASS,
            false,
            false,
        ),
        (
            "IPv4 ICMP echo",
            v4(ICMP, &icmp_echo()),
            XDP_PASS,
            false,
            false,
        ),
        (
            "IPv6 six extension headers + UDP",
            eth(&[], ETH_P_IPV6, &ipv6(v6(1, 0), 60, &six_ext)),
            XDP_PASS,
            false,
            false,
        ),
        (
            "IPv6 two extension headers + UDP",
            eth(&[], ETH_P_IPV6, &ipv6(v6(1, 0), 0, &two_ext)),
            XDP_PASS,
            false,
            false,
        ),
        (
            "IPv6 non-first fragment",
            eth(
                &[],
                ETH_P_IPV6,
                &ipv6(v6(1, 0), 44, &ipv6_frag(UDP, 100, &[1, 2])),
            ),
            XDP_DROP,
            false,
            false,
        ),
        // Offset 0 and no more fragments: a whole packet (RFC 6946).
        (
            "IPv6 atomic fragment + UDP",
            eth(
                &[],
                ETH_P_IPV6,
                &ipv6(v6(1, 0), 44, &ipv6_frag(UDP, 0, &udp(53))),
            ),
            XDP_PASS,
            false,
            false,
        ),
        (
            "IPv6 first fragment + UDP",
            eth(
                &[],
                ETH_P_IPV6,
                &ipv6(v6(1, 0), 44, &ipv6_fragment(UDP, 0, true, 2, &udp(53))),
            ),
            XDP_PASS,
            false,
            false,
        ),
        (
            "ICMPv6 echo",
            eth(
                &[],
                ETH_P_IPV6,
                &ipv6(v6(1, 0), ICMPV6, &[128, 0, 0, 0, 0, 1, 0, 1]),
            ),
            XDP_PASS,
            false,
            false,
        ),
        ("TCP SYN", v4(TCP, &tcp(22, 0x02)), XDP_PASS, false, false),
    ];

    let (mut non_ip, mut malformed, mut passed, mut dropped) = (0, 0, 0, 0);
    for (what, frame, want, is_non_ip, is_malformed) in &cases {
        assert_eq!(verdict(&dp, frame), *want, "{what}");
        non_ip += *is_non_ip as u64;
        malformed += *is_malformed as u64;
        if *want == XDP_PASS {
            passed += 1
        } else {
            dropped += 1
        }
    }
    let c = dp.counters().unwrap();
    assert_eq!(c.get(STAT_NON_IP), non_ip, "{c}");
    assert_eq!(c.get(STAT_MALFORMED), malformed, "{c}");
    assert_eq!(c.get(STAT_PASSED_PKTS), passed, "{c}");
    assert_eq!(c.get(STAT_DROPPED_PKTS), dropped, "{c}");
    assert_eq!(
        c.get(STAT_PASSED_PKTS) + c.get(STAT_DROPPED_PKTS),
        cases.len() as u64
    );
    // Only well-formed IP packets create buckets: 192.0.2.1 and fd00::1.
    assert_eq!(c.get(STAT_NEW_SOURCES), 2, "{c}");
}

#[test]
fn frames_shorter_than_ethernet_are_rejected_by_the_kernel_or_passed() {
    require_root();
    let dp = datapath(&config(10, "")).unwrap();
    // The kernel's test runner refuses frames under 14 bytes; if it ever
    // accepts them, the program must pass them as non-IP.
    match dp.test_run(&[0u8; 6], 1) {
        Ok((v, _)) => {
            assert_eq!(v, XDP_PASS);
            assert_eq!(dp.counters().unwrap().get(STAT_NON_IP), 1);
        }
        Err(e) => assert!(e.to_string().contains("Invalid argument"), "{e}"),
    }
}

#[test]
fn burst_then_drop_and_sources_are_independent() {
    require_root();
    let dp = datapath(&config(5, "")).unwrap();
    assert_eq!(offer(&dp, &udp4([198, 51, 100, 1]), 20), (5, 15));
    // Another source has its own full bucket.
    assert_eq!(offer(&dp, &udp4([198, 51, 100, 2]), 20), (5, 15));
    // An IPv6 source whose low bits equal an IPv4 source's is another source
    // (the families live in separate maps).
    let mut low = [0u8; 16];
    low[15] = 1;
    assert_eq!(offer(&dp, &udp6(low), 7), (5, 2));
    let c = dp.counters().unwrap();
    assert_eq!(
        (c.get(STAT_PASSED_PKTS), c.get(STAT_DROPPED_PKTS)),
        (15, 32)
    );
    assert_eq!(c.get(STAT_NEW_SOURCES), 3);
    assert_eq!(dp.sources().unwrap().len(), 3);
}

#[test]
fn vlan_tagged_frames_are_limited_like_untagged() {
    require_root();
    let dp = datapath(&config(4, "")).unwrap();
    let src = [203, 0, 113, 9];
    let packet = ipv4(src, UDP, &[], &udp(53));
    // Single 802.1Q tag and 802.1ad + 802.1Q (QinQ) share the source's bucket
    // with untagged frames: 4 pass in total, whatever the tagging.
    assert_eq!(
        offer(&dp, &eth(&[(ETH_P_8021Q, 100)], ETH_P_IP, &packet), 2),
        (2, 0)
    );
    assert_eq!(
        offer(
            &dp,
            &eth(
                &[(ETH_P_8021AD, 200), (ETH_P_8021Q, 300)],
                ETH_P_IP,
                &packet
            ),
            1
        ),
        (1, 0)
    );
    assert_eq!(offer(&dp, &eth(&[], ETH_P_IP, &packet), 3), (1, 2));
    assert_eq!(
        offer(&dp, &eth(&[(ETH_P_8021Q, 100)], ETH_P_IP, &packet), 2),
        (0, 2)
    );
    // A new IPv6 source behind two tags gets its own burst.
    let v6pkt = ipv6(v6(7, 1), UDP, &udp(53));
    assert_eq!(
        offer(
            &dp,
            &eth(&[(ETH_P_8021AD, 1), (ETH_P_8021Q, 2)], ETH_P_IPV6, &v6pkt),
            6
        ),
        (4, 2)
    );
}

#[test]
fn sources_are_aggregated_to_the_configured_prefixes() {
    require_root();
    let dp = datapath(&config(3, "ipv4_prefix = 24\nipv6_prefix = 64")).unwrap();
    // Two IPv4 hosts in one /24 share a bucket, another /24 does not.
    assert_eq!(offer(&dp, &udp4([10, 1, 1, 1]), 2), (2, 0));
    assert_eq!(offer(&dp, &udp4([10, 1, 1, 200]), 3), (1, 2));
    assert_eq!(offer(&dp, &udp4([10, 1, 2, 1]), 3), (3, 0));
    // Two IPv6 hosts in one /64 share a bucket, another /64 does not.
    assert_eq!(offer(&dp, &udp6(v6(1, 1)), 2), (2, 0));
    assert_eq!(offer(&dp, &udp6(v6(99, 1)), 3), (1, 2));
    assert_eq!(offer(&dp, &udp6(v6(1, 2)), 3), (3, 0));
    assert_eq!(dp.sources().unwrap().len(), 4);

    // With /128 every IPv6 address is its own source.
    let dp = datapath(&config(3, "ipv6_prefix = 128")).unwrap();
    assert_eq!(offer(&dp, &udp6(v6(1, 1)), 3), (3, 0));
    assert_eq!(offer(&dp, &udp6(v6(2, 1)), 3), (3, 0));
}

/// Two threads pinned to different CPUs run the same source's packet through
/// the program at the same time. The bucket (1 packet/s, burst B) barely
/// refills during the run, so exactly B packets may pass (+1 per elapsed
/// second). A lost update or a token spent twice shows up as more than that.
#[test]
fn one_source_on_two_cpus_at_once_spends_each_token_once() {
    two_cpus_on_one_bucket("token bucket", &config(300_000, ""), true, [ONE_SOURCE; 2]);
}

/// Both CPUs charge one `key = "global"` bucket as fast as the program runs,
/// every packet within the limit: any drop is a compare-and-swap lost 16
/// times in a row. At most 0.1% of the passed packets may be lost so.
#[test]
fn a_global_key_on_two_cpus_loses_at_most_a_thousandth_to_contention() {
    require_root();
    let cpus = std::thread::available_parallelism()
        .map(|n| n.get())
        .unwrap_or(1);
    assert!(
        cpus >= 2,
        "this test needs at least 2 CPUs to run the program concurrently; found {cpus}"
    );
    let toml = "[datapath]\nmax_sources = 4096\n[default]\nrate = 1\n\
        [[rule]]\nname = \"all\"\nkey = \"global\"\nrate = 100000000\nburst = 1000000000\n";
    let dp = datapath(toml).unwrap();
    const REPEAT: u32 = 1_000_000;
    const ROUNDS: u32 = 3;
    // Each CPU its own source: the key is global all the same.
    let spans = race(&dp, [[198, 18, 0, 1], [198, 18, 0, 2]], REPEAT, ROUNDS);
    // The figure means something only if the CPUs raced for most of it.
    let overlap = spans[0]
        .1
        .min(spans[1].1)
        .saturating_duration_since(spans[0].0.max(spans[1].0));
    let shorter = (spans[0].1 - spans[0].0).min(spans[1].1 - spans[1].0);
    assert!(overlap * 2 >= shorter, "the two CPUs ran together for {overlap:?} of {shorter:?}: too little to measure contention");
    let per_cpu = dp.counters_per_cpu().unwrap();
    let c = dp.counters().unwrap();
    let (passed, contended) = (c.get(STAT_PASSED_PKTS), c.get(STAT_CONTENDED));
    let offered = 2 * u64::from(REPEAT) * u64::from(ROUNDS);
    eprintln!(
        "global key, 2 CPUs: {offered} packets, passed {passed} (cpu0 {}, cpu1 {}), contended drops {contended} ({:.4}% of passed)",
        per_cpu[0].get(STAT_PASSED_PKTS),
        per_cpu[1].get(STAT_PASSED_PKTS),
        100.0 * contended as f64 / passed as f64
    );
    assert_eq!(passed + c.get(STAT_DROPPED_PKTS), offered, "{c}");
    assert_eq!(
        c.get(STAT_DROPPED_PKTS),
        contended,
        "only contention drops within the limit: {c}"
    );
    assert!(
        per_cpu[0].get(STAT_PASSED_PKTS) > 0 && per_cpu[1].get(STAT_PASSED_PKTS) > 0,
        "both CPUs ran: {c}"
    );
    assert!(
        contended * 1000 <= passed,
        "contended drops {contended} exceed 0.1% of {passed} passed"
    );
}

/// The source both CPUs send from in the one-source races.
const ONE_SOURCE: [u8; 4] = [198, 18, 0, 1];

/// The same race on a global key whose limit takes effect: each CPU sends
/// from its own source, and the rule's total stays exactly within its
/// bound (a contended drop spends no token, so later packets take it).
#[test]
fn a_global_key_on_two_cpus_holds_its_limit_exactly() {
    let toml = "[datapath]\nmax_sources = 4096\n[default]\nrate = 1\n\
        [[rule]]\nname = \"all\"\nkey = \"global\"\nrate = 1\nburst = 300000\n";
    two_cpus_on_one_bucket("global key", toml, true, [[198, 18, 0, 1], [198, 18, 0, 2]]);
}

/// The same race for the window algorithms: a day-long window holds exactly
/// its cap (a run at midnight UTC could straddle a boundary).
#[test]
fn window_counters_on_two_cpus_at_once_are_exact() {
    for algorithm in ["fixed_window", "sliding_window"] {
        let toml = format!(
            "[datapath]\nmax_sources = 4096\n[default]\nrate = 1\n[[rule]]\nname = \"w\"\nrate = 300000\nper = \"1d\"\nalgorithm = \"{algorithm}\"\n"
        );
        two_cpus_on_one_bucket(algorithm, &toml, false, [ONE_SOURCE; 2]);
    }
}

/// Two threads pinned to CPUs 0 and 1 run one source's packet through the
/// program at once; exactly 300,000 may pass (plus the refill of a token
/// bucket at 1 packet/s).
/// `sources`: the source each CPU sends from (one bucket all the same:
/// the same source, or a rule whose key is global).
fn two_cpus_on_one_bucket(what: &str, toml: &str, refills: bool, sources: [[u8; 4]; 2]) {
    require_root();
    let cpus = std::thread::available_parallelism()
        .map(|n| n.get())
        .unwrap_or(1);
    assert!(
        cpus >= 2,
        "this test needs at least 2 CPUs to run the program concurrently; found {cpus}"
    );
    const BURST: u64 = 300_000;
    const REPEAT: u32 = 1_000_000;
    const ROUNDS: u32 = 3;
    let dp = datapath(toml).unwrap();
    let start = Instant::now();
    let spans = race(&dp, sources, REPEAT, ROUNDS);
    let elapsed = start.elapsed().as_secs_f64();
    let per_cpu = dp.counters_per_cpu().unwrap();
    let passed_on = |cpu: usize| per_cpu[cpu].get(STAT_PASSED_PKTS);
    let c = dp.counters().unwrap();
    let passed = c.get(STAT_PASSED_PKTS);
    let offered = 2 * u64::from(REPEAT) * u64::from(ROUNDS);
    assert_eq!(passed + c.get(STAT_DROPPED_PKTS), offered, "{what}: {c}");
    // The two runs overlapped in time and both CPUs spent tokens.
    assert!(
        spans[0].0 < spans[1].1 && spans[1].0 < spans[0].1,
        "{what}: runs did not overlap: {spans:?}"
    );
    assert!(
        passed_on(0) > BURST / 10 && passed_on(1) > BURST / 10,
        "{what}: both CPUs must draw on the bucket concurrently: cpu0 {} cpu1 {}",
        passed_on(0),
        passed_on(1)
    );
    let refill = if refills {
        elapsed.ceil() as u64 + 1
    } else {
        0
    };
    assert!(
        passed >= BURST && passed <= BURST + refill,
        "{what}: passed {passed}, allowed {BURST}..={} (contended drops {})",
        BURST + refill,
        c.get(STAT_CONTENDED)
    );
}

/// Threads pinned to CPUs 0 and 1 each run a UDP frame from their source
/// through the program `rounds` × `repeat` times, started together; when
/// each ran, as (start, end).
fn race(
    dp: &rl_control::datapath::Datapath,
    sources: [[u8; 4]; 2],
    repeat: u32,
    rounds: u32,
) -> Vec<(Instant, Instant)> {
    let barrier = std::sync::Barrier::new(2);
    std::thread::scope(|s| {
        let hs: Vec<_> = (0..2)
            .map(|cpu| {
                let (frame, barrier) = (udp4(sources[cpu]), &barrier);
                s.spawn(move || {
                    pin_to_cpu(cpu).unwrap();
                    barrier.wait();
                    let t0 = Instant::now();
                    for _ in 0..rounds {
                        dp.test_run(&frame, repeat).unwrap();
                    }
                    (t0, Instant::now())
                })
            })
            .collect();
        hs.into_iter().map(|h| h.join().unwrap()).collect()
    })
}

/// A token bucket on ktime (4/s with a burst of 1: no tolerance, so it
/// does not read the tick clock) drops its flood by the tick clock where
/// the drop is sure, and passes each packet as soon as ktime says it is
/// due: the first packet offered after each 250 ms passes, not one a tick
/// later (as it would if the sure-drop test trusted the start of the tick
/// instead of its latest time).
///
/// Alone and as the first of two limits (checked before either is charged).
#[test]
fn a_ktime_bucket_flooded_passes_each_packet_when_due_not_a_tick_late() {
    require_root();
    pin_to_cpu(0).unwrap();
    for rules in [
        "[default]\nrate = 4\nburst = 1\n",
        "[default]\nrate = 1\n[[rule]]\nname = \"two\"\nlimits = [{ rate = 4, burst = 1 }, { bytes = \"100MB\", per = \"1s\" }]\n",
    ] {
        flooded_ktime_bucket(&format!("[datapath]\nmax_sources = 4096\n{rules}"));
    }
}

fn flooded_ktime_bucket(toml: &str) {
    let dp = datapath(toml).unwrap();
    assert_ne!(
        dp.clock().tick_ns,
        0,
        "the tick clock was not measured at load: this test needs it"
    );
    let frame = udp4([198, 51, 100, 9]);
    const INTERVAL_NS: u64 = 250_000_000;
    const PASSES: usize = 9;
    // (host ktime before, after) the run of each passed packet.
    let mut passes: Vec<(u64, u64)> = Vec::new();
    let (mut offered, deadline) = (
        0u64,
        rl_control::datapath::monotonic_ns() + (PASSES as u64 + 1) * INTERVAL_NS,
    );
    while passes.len() < PASSES && rl_control::datapath::monotonic_ns() < deadline {
        let before = rl_control::datapath::monotonic_ns();
        let v = verdict(&dp, &frame);
        offered += 1;
        if v == XDP_PASS {
            passes.push((before, rl_control::datapath::monotonic_ns()));
        }
    }
    assert_eq!(
        passes.len(),
        PASSES,
        "{offered} packets offered over {} ms",
        (PASSES as u64 + 1) * INTERVAL_NS / 1_000_000
    );
    // Each pass comes at least an interval after the one before (the
    // limit), and, with packets offered every few µs, at most a quarter
    // tick after it was due: a pass held to the next tick's edge would
    // come up to a tick late.
    let tick = dp.clock().tick_ns;
    let mut late = Vec::new();
    for w in passes.windows(2) {
        let (prev, this) = (w[0], w[1]);
        assert!(
            this.1 - prev.0 >= INTERVAL_NS,
            "passed {} ns after the pass before, under the 250 ms interval",
            this.1 - prev.0
        );
        late.push(this.0.saturating_sub(prev.1 + INTERVAL_NS));
    }
    let on_time = late.iter().filter(|&&l| l <= tick / 4).count();
    // One pass may be held back by the machine (a preemption in the loop).
    assert!(
        on_time + 1 >= late.len(),
        "{toml}: passes were late by {late:?} ns after their due time ({offered} packets offered)"
    );
    let c = dp.counters().unwrap();
    assert_eq!(c.get(STAT_PASSED_PKTS) + c.get(STAT_DROPPED_PKTS), offered);
}
