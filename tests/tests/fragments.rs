//! Fragments follow their datagram: crafted fragments through
//! BPF_PROG_TEST_RUN (every case, IPv4 and IPv6), then real datagrams that
//! the sending kernel fragments, through veth into the attached limiter.

use std::{net::IpAddr, time::Duration};

use rl_common::{
    RuleEntry, NO_RULE_ID, RULE_SHADOW, RULE_SLOTS, RULE_UNNAMED, STAT_DROPPED_PKTS,
    STAT_FRAG_ORPHANS, STAT_PASSED_PKTS,
};
use rl_control::datapath::{AttachMode, Datapath};
use rl_tests::{
    attach, datapath, expected_passed,
    frames::*,
    lab::{require_root, Lab},
    offer,
    traffic::{join, paced_datagrams, Receiver, PORT},
};

use rl_tests::rule_stats as stats;

const SRC: [u8; 4] = [192, 0, 2, 1];

/// A UDP datagram to `port` in IPv4 fragments: the first (UDP header +
/// 592 bytes) and `later` more of 600 bytes each.
fn datagram4(src: [u8; 4], id: u16, port: u16, later: u16) -> Vec<Vec<u8>> {
    let mut first = udp(port);
    first.resize(600, 0);
    let mut out = vec![eth(
        &[],
        ETH_P_IP,
        &ipv4_fragment(src, UDP, id, 0, later > 0, &first),
    )];
    for i in 1..=later {
        out.push(eth(
            &[],
            ETH_P_IP,
            &ipv4_fragment(src, UDP, id, i * 75, i < later, &[7u8; 600]),
        ));
    }
    out
}

fn datagram6(last: u8, id: u32, port: u16, later: u16) -> Vec<Vec<u8>> {
    let mut src = [0u8; 16];
    (src[0], src[15]) = (0xfd, last);
    let mut first = udp(port);
    first.resize(600, 0);
    let mut out = vec![eth(
        &[],
        ETH_P_IPV6,
        &ipv6(src, 44, &ipv6_fragment(UDP, 0, later > 0, id, &first)),
    )];
    for i in 1..=later {
        out.push(eth(
            &[],
            ETH_P_IPV6,
            &ipv6(
                src,
                44,
                &ipv6_fragment(UDP, i * 75, i < later, id, &[7u8; 600]),
            ),
        ));
    }
    out
}

/// A datagram from [`SRC`] (IPv4) or fd00::1 (IPv6) to `port`: its first
/// fragment and `later` more.
fn datagram(v6: bool, id: u16, port: u16, later: u16) -> Vec<Vec<u8>> {
    if v6 {
        datagram6(1, id as u32, port, later)
    } else {
        datagram4(SRC, id, port, later)
    }
}

fn family(v6: bool) -> &'static str {
    if v6 {
        "IPv6"
    } else {
        "IPv4"
    }
}

/// Offers each frame once; the verdicts, as (passed, dropped).
fn offer_all(dp: &Datapath, frames: &[Vec<u8>]) -> (u32, u32) {
    frames
        .iter()
        .map(|f| offer(dp, f, 1))
        .fold((0, 0), |a, b| (a.0 + b.0, a.1 + b.1))
}

const RULES: &str = "[default]\nrate = 1000\n\
    [[rule]]\nname = \"pkts\"\nproto = \"udp\"\ndst_ports = [53]\nrate = 2\nper = \"1h\"\n\
    [[rule]]\nname = \"bytes\"\nproto = \"udp\"\ndst_ports = [54]\nbytes = 1500\nper = \"1h\"\n";

#[test]
fn later_fragments_take_their_first_fragments_rule_and_verdict() {
    require_root();
    for v6 in [false, true] {
        let family = family(v6);
        let dp = datapath(&format!("[datapath]\nmax_sources = 1024\n{RULES}")).unwrap();
        let dgram = |id: u16, port: u16, later: u16| datagram(v6, id, port, later);
        // The packet limit counts datagrams: two of them pass whole, with
        // all their later fragments (no ports: they would fall to
        // [default] on their own); the third is dropped whole.
        assert_eq!(
            offer_all(&dp, &dgram(1, 53, 4)),
            (5, 0),
            "{family}: datagram 1"
        );
        assert_eq!(
            offer_all(&dp, &dgram(2, 53, 1)),
            (2, 0),
            "{family}: datagram 2"
        );
        assert_eq!(
            offer_all(&dp, &dgram(3, 53, 2)),
            (0, 3),
            "{family}: datagram 3, over the limit"
        );
        // A late duplicate of a passed datagram's fragment still follows it.
        assert_eq!(
            offer_all(&dp, &dgram(1, 53, 1)[1..]),
            (1, 0),
            "{family}: duplicate"
        );
        let s = stats(&dp, "pkts");
        assert_eq!(
            (s.passed_pkts, s.dropped_pkts),
            (8, 3),
            "{family}: every fragment counted under the rule"
        );
        assert_eq!(
            stats(&dp, "default").passed_pkts,
            0,
            "{family}: nothing fell to [default]"
        );

        // The byte limit counts every fragment's bytes: 1500 bytes hold
        // the first two fragments of a datagram, not the third.
        let big = dgram(4, 54, 3);
        let sizes: Vec<u64> = big.iter().map(|f| f.len() as u64).collect();
        assert!(
            sizes[0] + sizes[1] <= 1500 && sizes[0] + sizes[1] + sizes[2] > 1500,
            "{sizes:?}"
        );
        assert_eq!(
            offer_all(&dp, &big[..2]),
            (2, 0),
            "{family}: within the byte limit"
        );
        assert_eq!(
            offer_all(&dp, &big[2..]),
            (0, 2),
            "{family}: over the byte limit, then the broken datagram"
        );
        let s = stats(&dp, "bytes");
        assert_eq!(s.passed_bytes, sizes[0] + sizes[1], "{family}");

        // Orphans: no first fragment seen (another id, or another source
        // with the same id) ➜ dropped and counted by default.
        let mut other = if v6 {
            datagram6(2, 1, 53, 1)
        } else {
            datagram4([192, 0, 2, 2], 1, 53, 1)
        };
        assert_eq!(
            offer_all(&dp, &dgram(99, 53, 1)[1..]),
            (0, 1),
            "{family}: orphan"
        );
        assert_eq!(
            offer_all(&dp, &other.split_off(1)),
            (0, 1),
            "{family}: same id, other source"
        );
        let c = dp.counters().unwrap();
        assert_eq!(c.get(STAT_FRAG_ORPHANS), 2, "{family}: {c}");
        assert_eq!(
            c.get(STAT_PASSED_PKTS) + c.get(STAT_DROPPED_PKTS),
            17,
            "{family}: each frame counted once: {c}"
        );
    }
}

#[test]
fn a_first_fragments_verdict_expires_and_orphans_can_be_limited_by_source() {
    require_root();
    let dp = datapath(&format!(
        "[datapath]\nmax_sources = 1024\nfragment_ttl_ms = 200\nfragment_orphans = \"source\"\n{RULES}"
    ))
    .unwrap();
    // A TTL long enough that the second fragment, offered right after the
    // first, is never late on a busy runner; short enough to wait out.
    let d = datagram4(SRC, 7, 53, 2);
    assert_eq!(offer_all(&dp, &d[..2]), (2, 0));
    std::thread::sleep(Duration::from_millis(400));
    // Expired: an orphan, limited by source under [default] (rate 1000).
    assert_eq!(offer_all(&dp, &d[2..]), (1, 0));
    assert_eq!(stats(&dp, "default").passed_pkts, 1);
    assert_eq!(stats(&dp, "pkts").passed_pkts, 2);
    assert_eq!(dp.counters().unwrap().get(STAT_FRAG_ORPHANS), 1);
    // IPv6 orphans likewise.
    assert_eq!(offer_all(&dp, &datagram6(1, 5, 53, 1)[1..]), (1, 0));
    assert_eq!(stats(&dp, "default").passed_pkts, 2);
}

/// Datagrams of 3,000 bytes, which the sending kernel cuts into three
/// fragments at MTU 1500, to a packet limit and a byte limit, from an IPv4
/// and an IPv6 source each: what reaches the receiver is held to the limits.
#[test]
fn real_fragmented_datagrams_through_veth_are_held_to_the_limit() {
    let lab = Lab::new().unwrap();
    let (p4, b4, p6, b6) = (lab.v4(1), lab.v4(3), lab.v6(1), lab.v6(3));
    lab.add_source(&format!("{b4}/24")).unwrap();
    lab.add_source(&format!("{b6}/64")).unwrap();
    let toml = format!(
        "[datapath]\nmax_sources = 1024\n[default]\nrate = 100000\n\
         [[rule]]\nname = \"pkts\"\nproto = \"udp\"\ndst_ports = [{PORT}]\nsrc = [\"{p4}/32\", \"{p6}/128\"]\nrate = 20\n\
         [[rule]]\nname = \"bytes\"\nproto = \"udp\"\ndst_ports = [{PORT}]\nsrc = [\"{b4}/32\", \"{b6}/128\"]\nbytes = 62000\n"
    );
    let dp = attach(&lab, &toml, AttachMode::Native).unwrap();
    let rx = Receiver::start(&lab.b).unwrap();
    let (pps, count, size) = (150, 300, 3000);
    let senders: Vec<_> = [p4, b4, p6, b6]
        .into_iter()
        .map(|src| {
            let dst = if src.is_ipv4() { lab.v4(2) } else { lab.v6(2) };
            paced_datagrams(&lab.a, src, dst, pps, count, size)
        })
        .collect();
    let sent: Vec<_> = senders.into_iter().map(|h| join(h).unwrap()).collect();
    let got = rx.finish().unwrap();
    let secs = sent.iter().map(|s| s.seconds()).fold(0.0, f64::max);
    let datagrams = |ip: IpAddr| got.get(&ip).copied().unwrap_or(0) as f64;

    // Packet limit: 20 datagrams/s (burst 20), each passed whole.
    let want = expected_passed(20, 20, secs);
    for ip in [p4, p6] {
        let n = datagrams(ip);
        eprintln!(
            "packet limit, {ip}: {n} of {count} datagrams in {secs:.2} s, expected {want:.0}"
        );
        assert!(
            (n - want).abs() <= want * 0.15 + 3.0,
            "{ip}: {n} datagrams passed, expected {want:.0}"
        );
    }
    let s = stats(&dp, "pkts");
    assert_eq!(s.passed_pkts % 3, 0, "whole datagrams pass: {s:?}");
    assert_eq!(
        s.passed_pkts + s.dropped_pkts,
        2 * count * 3,
        "every fragment counted under the rule: {s:?}"
    );
    // Byte limit: 62,000 bytes/s (burst as much) of fragments on the wire;
    // a datagram is 3 fragments, 3,112 bytes with their headers (IPv4).
    let s = stats(&dp, "bytes");
    let budget = 2.0 * expected_passed(62_000, 62_000, secs);
    eprintln!(
        "byte limit: {} bytes passed, budget {budget:.0}, datagrams {} + {}",
        s.passed_bytes,
        datagrams(b4),
        datagrams(b6)
    );
    assert!(s.passed_bytes as f64 <= budget * 1.05 + 3000.0, "{s:?}");
    assert!(
        s.passed_bytes as f64 >= budget * 0.8,
        "the byte limit passed too little: {s:?}"
    );
    for ip in [b4, b6] {
        let n = datagrams(ip);
        // Bytes are counted per fragment: once the burst is spent, refills
        // mostly go to first fragments whose rest no longer fits (the rest
        // of such a datagram is then dropped without spending more), so
        // whole datagrams are about the burst's worth.
        assert!(
            n * 3000.0 <= budget / 2.0 * 1.05 + 3000.0,
            "{ip}: {n} datagrams"
        );
        assert!(
            n >= 62_000.0 / 3200.0 * 0.8,
            "{ip}: only {n} whole datagrams"
        );
    }
    assert_eq!(dp.counters().unwrap().get(STAT_FRAG_ORPHANS), 0);
}

/// A later fragment follows only its own datagram: same source and id but
/// another destination (IPv4 and IPv6) or another protocol (IPv4; IPv6
/// ids are unique per source and destination) is another datagram, whose
/// first fragment was not seen: an orphan, dropped by default.
#[test]
fn a_datagram_is_its_source_destination_protocol_and_id() {
    require_root();
    for v6 in [false, true] {
        let family = family(v6);
        let dp = datapath(&format!("[datapath]\nmax_sources = 1024\n{RULES}")).unwrap();
        let frames = datagram(v6, 9, 53, 1);
        let (first, later) = (&frames[0], &frames[1]);
        assert_eq!(
            offer(&dp, first, 1),
            (1, 0),
            "{family}: the first fragment passes"
        );
        // Another destination: the destination address's last byte.
        let dst_last = if v6 { 14 + 39 } else { 14 + 19 };
        let mut elsewhere = later.clone();
        elsewhere[dst_last] ^= 1;
        assert_eq!(
            offer(&dp, &elsewhere, 1),
            (0, 1),
            "{family}: same id to another destination"
        );
        let mut cases = 1;
        if !v6 {
            let mut tcp = later.clone();
            tcp[14 + 9] = TCP;
            assert_eq!(
                offer(&dp, &tcp, 1),
                (0, 1),
                "{family}: same id, another protocol"
            );
            cases += 1;
        }
        assert_eq!(
            dp.counters().unwrap().get(STAT_FRAG_ORPHANS),
            cases,
            "{family}: counted as orphans"
        );
        assert_eq!(
            offer(&dp, later, 1),
            (1, 0),
            "{family}: its own later fragment still follows it"
        );
    }
}

/// A datagram's later fragments bring at most what an IP datagram holds
/// (65,535 bytes of data): past that, a stream of them (here the same
/// 600-byte fragment again and again) is dropped, however few packets the
/// one datagram was charged. Without the bound, one passed first fragment
/// opened its datagram to later fragments without end.
#[test]
fn a_datagrams_later_fragments_stop_where_an_ip_datagram_ends() {
    require_root();
    for v6 in [false, true] {
        let family = family(v6);
        let dp = datapath(&format!(
            "[datapath]\nmax_sources = 1024\nfragment_ttl_ms = 60000\n{RULES}"
        ))
        .unwrap();
        let frames = datagram(v6, 20, 53, 1);
        assert_eq!(
            offer(&dp, &frames[0], 1),
            (1, 0),
            "{family}: the first fragment"
        );
        // 600 bytes of data each: 109 fit in 65,535 bytes.
        assert_eq!(
            offer(&dp, &frames[1], 120),
            (109, 11),
            "{family}: later fragments past 65,535 bytes"
        );
        assert_eq!(
            offer(&dp, &frames[1], 5),
            (0, 5),
            "{family}: and every one after"
        );
        let s = stats(&dp, "pkts");
        assert_eq!(
            (s.passed_pkts, s.dropped_pkts),
            (110, 16),
            "{family}: counted under the datagram's rule"
        );
        // A new first fragment with the same id is a new datagram, charged
        // as one (the rule allows 2 per hour).
        assert_eq!(
            offer(&dp, &frames[0], 1),
            (1, 0),
            "{family}: the id's next datagram"
        );
        assert_eq!(
            offer(&dp, &frames[1], 1),
            (1, 0),
            "{family}: its later fragment"
        );
        // Later fragments that claim no data count 512 bytes each: 127
        // fit, not an endless stream.
        let (first, empty) = if v6 {
            // Another /64: sources are keyed by their /64.
            let mut src = [0u8; 16];
            (src[0], src[7]) = (0xfd, 9);
            let mut head = udp(53);
            head.resize(600, 0);
            let first = eth(
                &[],
                ETH_P_IPV6,
                &ipv6(src, 44, &ipv6_fragment(UDP, 0, true, 23, &head)),
            );
            (
                first,
                eth(
                    &[],
                    ETH_P_IPV6,
                    &ipv6(src, 44, &ipv6_fragment(UDP, 75, false, 23, &[])),
                ),
            )
        } else {
            let src = [192, 0, 2, 9];
            (
                datagram4(src, 23, 53, 1)[0].clone(),
                eth(&[], ETH_P_IP, &ipv4_fragment(src, UDP, 23, 75, false, &[])),
            )
        };
        assert_eq!(
            offer(&dp, &first, 1),
            (1, 0),
            "{family}: another source's datagram"
        );
        assert_eq!(
            offer(&dp, &empty, 200),
            (127, 73),
            "{family}: later fragments without data"
        );
    }
}

/// Under a shadow rule the bound above only counts: the later fragments
/// past 65,535 bytes are shadow-dropped and passed, never dropped (before,
/// a shadow rule's datagram past its end was dropped for real).
#[test]
fn a_shadow_rule_passes_later_fragments_past_an_ip_datagrams_end_and_counts_them() {
    require_root();
    let rules = "[datapath]\nmax_sources = 1024\nfragment_ttl_ms = 60000\n[default]\nrate = 1000\n\
        [[rule]]\nname = \"pkts\"\nproto = \"udp\"\ndst_ports = [53]\nrate = 2\nper = \"1h\"\naction = \"shadow\"\n";
    for v6 in [false, true] {
        let family = family(v6);
        let dp = datapath(rules).unwrap();
        let frames = datagram(v6, 20, 53, 1);
        assert_eq!(
            offer(&dp, &frames[0], 1),
            (1, 0),
            "{family}: the first fragment"
        );
        assert_eq!(
            offer(&dp, &frames[1], 120),
            (120, 0),
            "{family}: a shadow rule drops nothing"
        );
        let s = stats(&dp, "pkts");
        assert_eq!(
            (s.passed_pkts, s.shadow_pkts, s.dropped_pkts),
            (110, 11, 0),
            "{family}: past the datagram's end counted as shadow drops"
        );
    }
}

/// A cluster rule's counts, which its sync reports to Redis as packets,
/// take a datagram once, at its first fragment: in the source's own bucket
/// and, in flood mode, in its prefix cell. Before, each later fragment was
/// counted as a packet of its own, so a datagram in four fragments spent
/// four of the cluster's packets.
#[test]
fn a_cluster_rules_counts_take_a_fragmented_datagram_once() {
    require_root();
    for (flood, charged) in [(2000, "its own bucket"), (0, "its prefix cell")] {
        let dp = datapath(&format!(
            "[datapath]\nmax_sources = 1024\nflood_new_keys_per_sec = {flood}\n\
             [cluster]\nredis = [\"redis://127.0.0.1:1\"]\nnode = \"test\"\n[default]\nrate = 1000\n\
             [[rule]]\nname = \"shared\"\nproto = \"udp\"\ndst_ports = [6666]\nrate = 5\nper = \"1h\"\nscope = \"cluster\"\n"
        ))
        .unwrap();
        assert_eq!(
            offer_all(&dp, &datagram4(SRC, 40, 6666, 3)),
            (4, 0),
            "{charged}: the datagram passes whole"
        );
        let shared =
            rl_control::datapath::share::scan_shared(&dp.table_maps().unwrap(), |_| true).unwrap();
        let passed: u64 = shared.iter().map(|b| b.bucket.passed).sum();
        assert!(
            !shared.is_empty(),
            "{charged}: the cluster rule's bucket is shared"
        );
        assert_eq!(
            passed, 1,
            "{charged}: one datagram, one packet for the cluster: {shared:?}"
        );
        assert_eq!(
            stats(&dp, "shared").passed_pkts,
            4,
            "{charged}: every fragment still counted in the rule's stats"
        );
    }
}

/// Only a first fragment sets how long its datagram's verdict lasts: later
/// fragments arriving every 20 ms do not keep it open past
/// `fragment_ttl_ms` (200 ms here); after it they are orphans, dropped.
/// Each offer is judged only where its whole run falls clearly on one side
/// of the 200 ms (the verdict's clock is the kernel's coarse one, a tick of
/// up to 10 ms), so a stalled test thread cannot fail it.
#[test]
fn later_fragments_do_not_keep_their_datagrams_verdict_alive() {
    require_root();
    for v6 in [false, true] {
        let family = family(v6);
        let dp = datapath(&format!(
            "[datapath]\nmax_sources = 1024\nfragment_ttl_ms = 200\n{RULES}"
        ))
        .unwrap();
        let frames = datagram(v6, 21, 53, 1);
        let start = std::time::Instant::now();
        assert_eq!(
            offer(&dp, &frames[0], 1),
            (1, 0),
            "{family}: the first fragment"
        );
        let first_done = start.elapsed();
        let (mut early, mut late) = (0, 0);
        while start.elapsed() < Duration::from_millis(600) {
            std::thread::sleep(Duration::from_millis(20));
            let from = start.elapsed();
            let got = offer(&dp, &frames[1], 1);
            let to = start.elapsed();
            if to < Duration::from_millis(180) {
                assert_eq!(
                    got,
                    (1, 0),
                    "{family}: a later fragment {from:?}–{to:?} after its first"
                );
                early += 1;
            } else if from > first_done + Duration::from_millis(230) {
                assert_eq!(
                    got,
                    (0, 1),
                    "{family}: a later fragment {from:?} after its first, past the 200 ms"
                );
                late += 1;
            }
        }
        assert!(
            early >= 1 && late >= 1,
            "{family}: the test's timing: {early} fragments early, {late} late"
        );
        assert!(
            dp.counters().unwrap().get(STAT_FRAG_ORPHANS) >= late,
            "{family}: the late ones are orphans"
        );
    }
}

/// Under a shadow rule, a later fragment that its byte limit would drop
/// marks its datagram shadow-dropped: the rest of it is counted so and no
/// longer spends the limit, as a dropped datagram's rest would not.
#[test]
fn a_shadow_rules_broken_datagram_stays_shadow_dropped() {
    require_root();
    let dp = datapath(&format!(
        "[datapath]\nmax_sources = 1024\n{}",
        RULES.replace("bytes = 1500\n", "bytes = 1500\naction = \"shadow\"\n")
    ))
    .unwrap();
    // Three fragments of 634 bytes, then a last one of 74 that alone would
    // still fit the 1,500 bytes.
    let mut big = datagram4(SRC, 30, 54, 2);
    big[2] = eth(
        &[],
        ETH_P_IP,
        &ipv4_fragment(SRC, UDP, 30, 150, true, &[7u8; 600]),
    );
    big.push(eth(
        &[],
        ETH_P_IP,
        &ipv4_fragment(SRC, UDP, 30, 225, false, &[7u8; 40]),
    ));
    let sizes: Vec<u64> = big.iter().map(|f| f.len() as u64).collect();
    assert!(
        sizes[0] + sizes[1] + sizes[3] <= 1500 && sizes[0] + sizes[1] + sizes[2] > 1500,
        "{sizes:?}"
    );
    assert_eq!(
        offer_all(&dp, &big),
        (4, 0),
        "a shadow rule passes everything"
    );
    let s = stats(&dp, "bytes");
    assert_eq!(
        s.passed_bytes,
        sizes[0] + sizes[1],
        "the first two fragments within the byte limit"
    );
    assert_eq!(
        (s.shadow_pkts, s.shadow_bytes),
        (2, sizes[2] + sizes[3]),
        "the third would drop, and the rest of its datagram with it"
    );
}

/// With `fragment_orphans = "source"`, every orphan is charged as a packet
/// of its own, however many share a fragment id: 3 of 6 pass a limit of 3.
#[test]
fn orphans_limited_by_source_are_each_charged() {
    require_root();
    for v6 in [false, true] {
        let family = family(v6);
        let dp = datapath(&format!(
            "[datapath]\nmax_sources = 1024\nfragment_orphans = \"source\"\n{RULES}\
             [[rule]]\nname = \"udp\"\nproto = \"udp\"\nrate = 3\nper = \"1h\"\n"
        ))
        .unwrap();
        let frames = datagram(v6, 22, 53, 1);
        assert_eq!(
            offer(&dp, &frames[1], 6),
            (3, 3),
            "{family}: six orphans of one datagram"
        );
        let s = stats(&dp, "udp");
        assert_eq!(
            (s.passed_pkts, s.dropped_pkts),
            (3, 3),
            "{family}: under the rule for UDP without ports"
        );
        assert_eq!(dp.counters().unwrap().get(STAT_FRAG_ORPHANS), 6, "{family}");
    }
}

/// A verdict names its rule by its place in one of the two rule slots. One
/// rule change leaves that slot as it was; a second rewrites it (and a
/// failed change may have rewritten part of it), so the rest of the
/// datagram would be counted, and charged, under whatever rule now sits
/// there. The verdict also holds its rule's tag: while the place holds
/// that rule (rewritten unchanged, as by a restarted daemon) it stands;
/// else it is forgotten and the later fragments are orphans.
#[test]
fn a_verdict_lasts_while_its_place_holds_its_rule() {
    require_root();
    let head = "[datapath]\nmax_sources = 1024\nfragment_ttl_ms = 60000\n[default]\nrate = 1000\n";
    let rule = |name: &str, port: u16, limit: &str| {
        format!("[[rule]]\nname = \"{name}\"\nproto = \"udp\"\ndst_ports = [{port}]\n{limit}\n")
    };
    let install = |dp: &mut Datapath, rules: &str| {
        let compiled = rl_control::compile::compile(
            &rl_control::config::Config::from_str(&format!("{head}{rules}"), "<test>").unwrap(),
        );
        dp.install(&compiled.rules)
    };
    let tight = "rate = 2\nper = \"1h\"";
    for v6 in [false, true] {
        let family = family(v6);
        let dgram = |id: u16| datagram(v6, id, 53, 3);
        let (a, b) = (dgram(1), dgram(2));
        // Rule sets 1 to 4 alternate between the slots; each has its rule
        // at entry 1. Were a forgotten verdict read through "other" or
        // "other2" (generous), its fragment would pass, counted there.
        let mut dp = datapath(&format!("{head}{}", rule("a", 53, tight))).unwrap();
        assert_eq!(offer_all(&dp, &a[..2]), (2, 0), "{family}");
        install(&mut dp, &rule("b", 53, tight)).unwrap();
        assert_eq!(offer_all(&dp, &b[..2]), (2, 0), "{family}");
        assert_eq!(
            offer_all(&dp, &a[2..3]),
            (1, 0),
            "{family}: one change later, a's rule is still in its slot"
        );
        assert_eq!(
            (stats(&dp, "a").passed_pkts, stats(&dp, "b").passed_pkts),
            (3, 2),
            "{family}"
        );
        install(&mut dp, &rule("other", 99, "rate = 1000")).unwrap();
        let orphans = dp.counters().unwrap().get(STAT_FRAG_ORPHANS);
        assert_eq!(
            offer_all(&dp, &a[3..]),
            (0, 1),
            "{family}: a's slot rewritten, its last fragment is an orphan"
        );
        assert_eq!(
            dp.counters().unwrap().get(STAT_FRAG_ORPHANS),
            orphans + 1,
            "{family}"
        );
        assert_eq!(
            stats(&dp, "other").passed_pkts,
            0,
            "{family}: nothing under the rule now in its place"
        );
        assert_eq!(
            offer_all(&dp, &b[2..3]),
            (1, 0),
            "{family}: b's rule is in the inactive slot"
        );
        assert_eq!(stats(&dp, "b").passed_pkts, 3, "{family}");
        // A change that fails after rewriting b's slot's rules.
        dp.fail_next_install_at("rules");
        assert!(install(&mut dp, &rule("other2", 99, "rate = 1000")).is_err());
        assert_eq!(
            offer_all(&dp, &b[3..]),
            (0, 1),
            "{family}: b's slot was being rewritten, its last fragment is an orphan"
        );
        assert_eq!(
            dp.counters().unwrap().get(STAT_FRAG_ORPHANS),
            orphans + 2,
            "{family}"
        );
        assert_eq!(stats(&dp, "b").passed_pkts, 3, "{family}");
        // The datapath still works after the failed change.
        install(&mut dp, &rule("c", 53, tight)).unwrap();
        let c = dgram(3);
        assert_eq!(offer_all(&dp, &c[..2]), (2, 0), "{family}");
        // The same rules written into both slots again (as a restarted
        // daemon does): the verdict still names its rule.
        install(&mut dp, &rule("c", 53, tight)).unwrap();
        install(&mut dp, &rule("c", 53, tight)).unwrap();
        assert_eq!(
            offer_all(&dp, &c[2..]),
            (2, 0),
            "{family}: the same rule rewritten in place"
        );
        assert_eq!(stats(&dp, "c").passed_pkts, 4, "{family}");
        assert_eq!(
            dp.counters().unwrap().get(STAT_FRAG_ORPHANS),
            orphans + 2,
            "{family}: no orphan"
        );
        // A rule set that ends before the verdict's place: after two
        // changes that place holds no rule, whatever was left there.
        let three = format!(
            "{}{}{}",
            rule("x", 60, tight),
            rule("y", 61, tight),
            rule("z", 53, tight)
        );
        install(&mut dp, &three).unwrap();
        let z = dgram(4);
        assert_eq!(offer_all(&dp, &z[..2]), (2, 0), "{family}: z is entry 3");
        install(&mut dp, &rule("x", 60, tight)).unwrap();
        install(&mut dp, &rule("x", 60, tight)).unwrap();
        assert_eq!(
            offer_all(&dp, &z[2..]),
            (0, 2),
            "{family}: z's place is past the rules: its fragments are orphans"
        );
        assert_eq!(
            dp.counters().unwrap().get(STAT_FRAG_ORPHANS),
            orphans + 4,
            "{family}"
        );
        let past = dp
            .rule_table_entry(dp.active_slot().unwrap() * RULE_SLOTS + 3)
            .unwrap();
        assert_eq!(
            past,
            RuleEntry {
                id: NO_RULE_ID,
                flags: RULE_UNNAMED,
                ..Default::default()
            },
            "{family}: emptied, as older builds read it too"
        );
        // Filled again (into the other slot, then into this one, stopped
        // before the mark is lifted): under the mark first, like a
        // changed entry.
        let emptied = dp.active_slot().unwrap() * RULE_SLOTS + 3;
        install(&mut dp, &three).unwrap();
        let z_rule = dp.active_rule(3).unwrap();
        dp.fail_next_install_at("rewritten");
        assert!(install(&mut dp, &three).is_err());
        assert_eq!(
            dp.rule_table_entry(emptied).unwrap(),
            RuleEntry {
                flags: z_rule.flags | RULE_UNNAMED,
                ..z_rule
            },
            "{family}: filled under the mark"
        );
    }
}

/// A rule changed in place keeps its id (a failure mode of the cluster
/// changes rules so). Its entry is marked before the rewrite, so that no
/// verdict is read through it half-written, and the mark leaves the rule
/// whole, so that a run that took the verdict just before charges the rule
/// it checked. The new contents are written under the mark, which a last
/// write lifts: the entry then holds its rule's new version, and the
/// verdict stands under it.
#[test]
fn a_rule_changed_in_place_is_unnamed_whole_before_its_rewrite() {
    require_root();
    let conf = "[datapath]\nmax_sources = 1024\nfragment_ttl_ms = 60000\n[default]\nrate = 1000\n\
                [[rule]]\nname = \"a\"\nproto = \"udp\"\ndst_ports = [53]\nrate = 2\nper = \"1h\"\n";
    let rules = rl_control::compile::compile(
        &rl_control::config::Config::from_str(conf, "<test>").unwrap(),
    )
    .rules;
    // As `compile::with_failure_mode` changes a cluster rule: same id.
    let mut changed = rules.clone();
    changed.entries[1].flags |= RULE_SHADOW;
    for v6 in [false, true] {
        let family = family(v6);
        let a = datagram(v6, 1, 53, 5);
        let mut dp = datapath(conf).unwrap();
        let entry = dp.active_slot().unwrap() * RULE_SLOTS + 1;
        let (whole, default) = (
            dp.rule_table_entry(entry).unwrap(),
            dp.rule_table_entry(entry - 1).unwrap(),
        );
        assert_eq!(whole.id, rules.entries[1].id, "{family}");
        assert_eq!(offer_all(&dp, &a[..2]), (2, 0), "{family}");
        // Written into the other slot: the verdict's place is untouched.
        dp.install(&changed).unwrap();
        assert_eq!(
            offer_all(&dp, &a[2..3]),
            (1, 0),
            "{family}: its place still holds the rule as it was"
        );
        // Into the verdict's slot, stopped right after the marking.
        dp.fail_next_install_at("unnamed");
        assert!(dp.install(&changed).is_err());
        let marked = dp.rule_table_entry(entry).unwrap();
        assert_eq!(
            marked,
            RuleEntry {
                flags: whole.flags | RULE_UNNAMED,
                ..whole
            },
            "{family}: marked, the rule kept whole"
        );
        assert_eq!(
            dp.rule_table_entry(entry - 1).unwrap(),
            default,
            "{family}: [default], unchanged, is not marked"
        );
        let orphans = dp.counters().unwrap().get(STAT_FRAG_ORPHANS);
        assert_eq!(
            offer_all(&dp, &a[3..4]),
            (0, 1),
            "{family}: while its place is marked, a fragment is an orphan"
        );
        assert_eq!(
            dp.counters().unwrap().get(STAT_FRAG_ORPHANS),
            orphans + 1,
            "{family}"
        );
        let new = RuleEntry {
            flags: whole.flags | RULE_SHADOW,
            ..whole
        };
        // Stopped after the new contents went in under the mark.
        dp.fail_next_install_at("rewritten");
        assert!(dp.install(&changed).is_err());
        assert_eq!(
            dp.rule_table_entry(entry).unwrap(),
            RuleEntry {
                flags: new.flags | RULE_UNNAMED,
                ..new
            },
            "{family}: new, still marked"
        );
        assert_eq!(
            offer_all(&dp, &a[4..5]),
            (0, 1),
            "{family}: still an orphan"
        );
        assert_eq!(
            dp.counters().unwrap().get(STAT_FRAG_ORPHANS),
            orphans + 2,
            "{family}"
        );
        // Found marked, and changed again (back to the first version): under
        // the mark too.
        dp.fail_next_install_at("rewritten");
        assert!(dp.install(&rules).is_err());
        assert_eq!(
            dp.rule_table_entry(entry).unwrap(),
            marked,
            "{family}: the first version, marked"
        );
        dp.install(&changed).unwrap();
        assert_eq!(
            dp.rule_table_entry(entry).unwrap(),
            new,
            "{family}: rewritten, unmarked"
        );
        assert_eq!(
            offer_all(&dp, &a[5..]),
            (1, 0),
            "{family}: the rule's new version: the verdict stands under it"
        );
        assert_eq!(
            dp.counters().unwrap().get(STAT_FRAG_ORPHANS),
            orphans + 2,
            "{family}"
        );
    }
}

/// A later fragment charges nothing to a packet limit (its datagram was
/// counted at its first), so it must change nothing: as the first charge
/// of a sliding window it wrote a current count of 0, which reads as never
/// charged, and the previous window's count was forgotten (100 more could
/// pass at once right after the boundary). Here the rule is 3 per 2 s,
/// sliding: 3 datagrams use it up, a later fragment of the third arrives
/// in the next window, and the next datagram still finds the previous
/// window weighing in (it would have passed).
#[test]
fn a_later_fragment_never_resets_a_sliding_windows_count() {
    require_root();
    let dp = datapath("[datapath]\nmax_sources = 1024\nfragment_ttl_ms = 5000\n[default]\nrate = 1000\n[[rule]]\nname = \"slide\"\nproto = \"udp\"\ndst_ports = [55]\nrate = 3\nper = \"2s\"\nalgorithm = \"sliding_window\"\n").unwrap();
    // Windows are aligned to the Unix epoch: start well inside one, so
    // the three fit in it.
    let now = || {
        std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .unwrap()
            .as_millis() as u64
    };
    while !(50..300).contains(&(now() % 2000)) {
        std::thread::sleep(std::time::Duration::from_millis(5));
    }
    let window = now() / 2000;
    let last = datagram4(SRC, 30, 55, 1);
    assert_eq!(offer_all(&dp, &datagram4(SRC, 31, 55, 0)), (1, 0));
    assert_eq!(offer_all(&dp, &datagram4(SRC, 32, 55, 0)), (1, 0));
    assert_eq!(
        offer_all(&dp, &last[..1]),
        (1, 0),
        "the third datagram's first fragment"
    );
    // The next window, 30 ms in: the later fragment, then a new datagram.
    while now() / 2000 == window || now() % 2000 < 30 {
        std::thread::sleep(std::time::Duration::from_millis(2));
    }
    assert_eq!(now() / 2000, window + 1, "the test ran late");
    assert_eq!(
        offer_all(&dp, &last[1..]),
        (1, 0),
        "the later fragment follows its datagram"
    );
    assert_eq!(
        offer_all(&dp, &datagram4(SRC, 33, 55, 0)),
        (0, 1),
        "the previous window's 3 still weigh (about 90%) early in the next"
    );
}

/// An elastic rule's pool lends a packet to every frame it lets through: a
/// later fragment over the key's byte limit costs it one too (asked for 0
/// packets, a spent pool passed every such fragment), so a byte limit
/// holds fragmented datagrams once the pool is spent.
#[test]
fn an_elastic_pool_does_not_carry_fragments_past_a_byte_limit() {
    require_root();
    let dp = datapath("[datapath]\nmax_sources = 1024\n[default]\nrate = 1000\n[[rule]]\nname = \"el\"\nproto = \"udp\"\ndst_ports = [56]\nbytes = 1500\nper = \"1h\"\nmode = \"elastic\"\npool_rate = 1\npool_per = \"1h\"\n").unwrap();
    // 4 fragments of about 630 bytes: the first two fit the 1,500 bytes;
    // the pool (one packet an hour) lends the third; the fourth is over
    // both (before, it passed on a zero-packet loan, as every later one).
    let (passed, dropped) = offer_all(&dp, &datagram4(SRC, 40, 56, 3));
    assert_eq!(
        (passed, dropped),
        (3, 1),
        "a fragment past the byte limit and the pool"
    );
    // The pool spent: the next datagram is dropped whole.
    assert_eq!(offer_all(&dp, &datagram4(SRC, 41, 56, 2)), (0, 3));
}
