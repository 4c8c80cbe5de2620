//! The rule language in the real XDP program, with crafted packets through
//! BPF_PROG_TEST_RUN. Limits are "per day" so nothing refills during a test,
//! and the per-rule counters say which rule charged each packet.

use rl_control::{compile::compile, config::Config, datapath::Datapath};
use rl_tests::{datapath, frames::*, lab::require_root, offer};

/// `[default]` never drops in these tests: 1,000,000 per second.
fn with_default(rules: &str) -> String {
    format!("[default]\nrate = 1000000\n{rules}")
}

fn load(rules: &str) -> Datapath {
    require_root();
    datapath(&with_default(rules)).unwrap()
}

use rl_tests::rule_stats as stats;

/// Packets charged to `name` so far (passed, dropped and shadow-dropped).
fn charged(dp: &Datapath, name: &str) -> u64 {
    let s = stats(dp, name);
    s.passed_pkts + s.dropped_pkts + s.shadow_pkts
}

fn tcp4(src: [u8; 4], port: u16, flags: u8) -> Vec<u8> {
    eth(&[], ETH_P_IP, &ipv4(src, TCP, &[], &tcp(port, flags)))
}

fn udp4_to(src: [u8; 4], port: u16) -> Vec<u8> {
    eth(&[], ETH_P_IP, &ipv4(src, UDP, &[], &udp(port)))
}

const SYN: u8 = 0x02;
const ACK: u8 = 0x10;
const V6_IN: [u8; 16] = [0x20, 0x01, 0x0d, 0xb8, 0, 1, 0, 0, 0, 0, 0, 0, 0, 0, 0, 9];
const V6_OUT: [u8; 16] = [0x20, 0x01, 0x0d, 0xb8, 0, 2, 0, 0, 0, 0, 0, 0, 0, 0, 0, 9];

#[test]
fn each_match_dimension_charges_its_rule() {
    let dp = load(
        r#"
[[rule]]
name = "ssh-syn"
proto = "tcp"
dst_ports = [22]
tcp_flags = "syn"
rate = 2
per = "1d"

[[rule]]
name = "udp-range"
proto = "udp"
dst_ports = ["8000-8080"]
rate = 3
per = "1d"

[[rule]]
name = "icmp"
proto = "icmp"
rate = 1
per = "1d"

[[rule]]
name = "v4-src"
src = ["192.0.2.0/24"]
rate = 4
per = "1d"

[[rule]]
name = "v6-src"
src = ["2001:db8:1::/48"]
rate = 5
per = "1d"
"#,
    );
    let a = [198, 51, 100, 1];
    // SYN to 22: limited to 2. SYN+ACK and ACK to 22, and SYN to 23: default.
    assert_eq!(offer(&dp, &tcp4(a, 22, SYN), 5), (2, 3));
    assert_eq!(offer(&dp, &tcp4(a, 22, SYN | ACK), 5), (5, 0));
    assert_eq!(offer(&dp, &tcp4(a, 22, ACK), 5), (5, 0));
    assert_eq!(offer(&dp, &tcp4(a, 23, SYN), 5), (5, 0));
    assert_eq!(charged(&dp, "ssh-syn"), 5);
    // Both ends of the range are in, the ports next to it are not; TCP to 8000 is not UDP.
    assert_eq!(offer(&dp, &udp4_to(a, 8000), 2), (2, 0));
    assert_eq!(offer(&dp, &udp4_to(a, 8080), 2), (1, 1));
    assert_eq!(offer(&dp, &udp4_to(a, 7999), 2), (2, 0));
    assert_eq!(offer(&dp, &udp4_to(a, 8081), 2), (2, 0));
    assert_eq!(offer(&dp, &tcp4(a, 8000, ACK), 2), (2, 0));
    assert_eq!(charged(&dp, "udp-range"), 4);
    // ICMP.
    let ping = eth(&[], ETH_P_IP, &ipv4(a, ICMP, &[], &icmp_echo()));
    assert_eq!(offer(&dp, &ping, 3), (1, 2));
    // Source CIDRs, v4 and v6.
    assert_eq!(offer(&dp, &udp4_to([192, 0, 2, 200], 53), 6), (4, 2));
    assert_eq!(offer(&dp, &udp4_to([192, 0, 3, 1], 53), 6), (6, 0));
    assert_eq!(offer(&dp, &udp6(V6_IN), 7), (5, 2));
    assert_eq!(offer(&dp, &udp6(V6_OUT), 7), (7, 0));
    // Everything else went to [default], and nothing else charged the rules.
    let counts: Vec<u64> = ["ssh-syn", "udp-range", "icmp", "v4-src", "v6-src"]
        .iter()
        .map(|n| charged(&dp, n))
        .collect();
    assert_eq!(counts, vec![5, 4, 3, 6, 7]);
    assert_eq!(stats(&dp, "default").passed_pkts, 15 + 6 + 6 + 7);
}

#[test]
fn first_match_in_file_order_and_one_rule_per_packet() {
    let dp = load(
        r#"
[[rule]]
name = "narrow"
proto = "udp"
dst_ports = [53]
src = ["192.0.2.0/24"]
rate = 1
per = "1d"

[[rule]]
name = "wide"
proto = "udp"
rate = 3
per = "1d"
"#,
    );
    assert_eq!(
        offer(&dp, &udp4_to([192, 0, 2, 1], 53), 4),
        (1, 3),
        "the narrow rule comes first"
    );
    assert_eq!(
        offer(&dp, &udp4_to([192, 0, 2, 1], 54), 4),
        (3, 1),
        "other ports fall to the wide rule"
    );
    assert_eq!(
        offer(&dp, &udp4_to([203, 0, 113, 1], 53), 4),
        (3, 1),
        "other sources too"
    );
    assert_eq!((charged(&dp, "narrow"), charged(&dp, "wide")), (4, 8));
}

#[test]
fn allow_beats_deny_and_deny_beats_rules() {
    let dp = load(
        r#"
[[allow]]
cidr = "10.0.0.0/8"
[[allow]]
cidr = "2001:db8:1::/48"
[[deny]]
cidr = "10.1.0.0/16"
[[deny]]
cidr = "198.51.100.0/24"
[[deny]]
cidr = "2001:db8::/32"

[[rule]]
name = "all"
rate = 1
per = "1d"
"#,
    );
    assert_eq!(
        offer(&dp, &udp4([10, 1, 2, 3]), 5),
        (5, 0),
        "allowed although a longer deny covers it"
    );
    assert_eq!(offer(&dp, &udp4([10, 9, 9, 9]), 5), (5, 0));
    assert_eq!(offer(&dp, &udp4([198, 51, 100, 7]), 5), (0, 5), "denied");
    assert_eq!(offer(&dp, &udp6(V6_IN), 3), (3, 0));
    assert_eq!(offer(&dp, &udp6(V6_OUT), 3), (0, 3));
    assert_eq!(
        offer(&dp, &udp4([203, 0, 113, 5]), 3),
        (1, 2),
        "the rule limits the rest"
    );
    assert_eq!(stats(&dp, "allow").passed_pkts, 13);
    assert_eq!(stats(&dp, "deny").dropped_pkts, 8);
    assert_eq!(
        charged(&dp, "all"),
        3,
        "allowed and denied packets are not charged to rules"
    );
}

/// A ban ends in the kernel at its time, with no install (no daemon, say,
/// to lift it): its sources pass again, under the rules their class gives.
/// A ban inside a longer-lasting one ends with it; `[[deny]]`, bans that
/// have not ended and `[[allow]]` over a ban stay as they were.
#[test]
fn bans_end_in_the_kernel_at_their_time() {
    let now = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .unwrap()
        .as_secs();
    // Ends far enough out that loading (the verifier: seconds in CI) and
    // each check fit before the next end.
    let (early, end) = (now + 5, now + 9);
    let dp = load(&format!(
        r#"
[[allow]]
cidr = "198.51.100.64/26"
[[deny]]
cidr = "192.0.2.0/24"
[[ban]]
cidr = "198.51.100.0/24"
until = {end}
[[ban]]
cidr = "198.51.100.128/25"
until = {early}
[[ban]]
cidr = "203.0.113.0/24"
until = {late}
[[ban]]
cidr = "2001:db8:2::/48"
until = {end}
[[ban]]
cidr = "10.16.0.0/12"
until = {end}

[[rule]]
name = "listed"
src = ["198.51.100.0/28"]
rate = 1
per = "1d"
"#,
        late = now + 3600,
    ));
    let (listed, nested, allowed) = ([198, 51, 100, 1], [198, 51, 100, 200], [198, 51, 100, 70]);
    let banned = |dp: &Datapath| {
        [
            offer(dp, &udp4(listed), 2),
            offer(dp, &udp4(nested), 2),
            offer(dp, &udp6(V6_OUT), 2),
            offer(dp, &udp4([203, 0, 113, 5]), 2),
            offer(dp, &udp4([192, 0, 2, 5]), 2),
            offer(dp, &udp4(allowed), 2),
            // A /12: decided by the first level alone (no trie walk).
            offer(dp, &udp4([10, 17, 1, 1]), 2),
        ]
    };
    let unix = || {
        std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .unwrap()
    };
    let during = [(0, 2), (0, 2), (0, 2), (0, 2), (0, 2), (2, 0), (0, 2)];
    assert!(
        unix() < std::time::Duration::from_secs(early),
        "loading took past the first ban's end: the test cannot see the bans hold"
    );
    assert_eq!(banned(&dp), during, "while the bans hold");
    // The nested ban's own end passes: the longer ban around it holds.
    let wait_until = |t: u64| {
        let left = std::time::Duration::from_secs(t).saturating_sub(unix());
        std::thread::sleep(left + std::time::Duration::from_millis(300));
    };
    wait_until(early);
    assert!(
        unix() < std::time::Duration::from_secs(end - 1),
        "a wait overran"
    );
    assert_eq!(banned(&dp), during, "after the nested ban's end");
    wait_until(end);
    assert_eq!(
        banned(&dp),
        [(1, 1), (2, 0), (2, 0), (0, 2), (0, 2), (2, 0), (2, 0)],
        "after the ban's end: its sources pass, the listed one under its rule"
    );
    assert_eq!(charged(&dp, "listed"), 2);
}

#[test]
fn key_scopes_source_prefix_global() {
    let dp = load(
        r#"
[[rule]]
name = "per-source"
proto = "udp"
dst_ports = [1]
rate = 2
per = "1d"

[[rule]]
name = "per-24"
proto = "udp"
dst_ports = [2]
key = "prefix"
prefix_v4 = 24
rate = 2
per = "1d"

[[rule]]
name = "global"
proto = "udp"
dst_ports = [3]
key = "global"
rate = 2
per = "1d"
"#,
    );
    let (a, b, c) = ([192, 0, 2, 1], [192, 0, 2, 2], [198, 51, 100, 1]);
    assert_eq!(offer(&dp, &udp4_to(a, 1), 3), (2, 1));
    assert_eq!(
        offer(&dp, &udp4_to(b, 1), 3),
        (2, 1),
        "each source has its own bucket"
    );
    assert_eq!(offer(&dp, &udp4_to(a, 2), 3), (2, 1));
    assert_eq!(
        offer(&dp, &udp4_to(b, 2), 3),
        (0, 3),
        "the same /24 shares one bucket"
    );
    assert_eq!(
        offer(&dp, &udp4_to(c, 2), 3),
        (2, 1),
        "another /24 does not"
    );
    assert_eq!(offer(&dp, &udp4_to(a, 3), 1), (1, 0));
    assert_eq!(
        offer(&dp, &udp4_to(c, 3), 3),
        (1, 2),
        "one bucket for everyone"
    );
    assert_eq!(
        offer(&dp, &udp6(V6_IN), 1),
        (1, 0),
        "default: not on these ports"
    );
    let v6_to = |src: [u8; 16], port: u16| eth(&[], ETH_P_IPV6, &ipv6(src, UDP, &udp(port)));
    // The global key is one for both families: IPv6 finds it spent by
    // IPv4 (before, each family had a bucket, and dual-stack traffic
    // passed twice the limit).
    assert_eq!(
        offer(&dp, &v6_to(V6_IN, 3), 3),
        (0, 3),
        "the global bucket holds IPv6 too"
    );
    // IPv6 prefix keys (/48 by default): V6_IN and V6_OUT differ in bits 33..48.
    let mut same48 = V6_IN;
    same48[15] = 200;
    same48[8] = 7;
    assert_eq!(offer(&dp, &v6_to(V6_IN, 2), 1), (1, 0));
    assert_eq!(
        offer(&dp, &v6_to(same48, 2), 3),
        (1, 2),
        "the same IPv6 /48 shares one bucket"
    );
    assert_eq!(
        offer(&dp, &v6_to(V6_OUT, 2), 3),
        (2, 1),
        "another /48 does not"
    );
}

#[test]
fn shadow_counts_would_drop_and_passes_everything() {
    let dp = load("[[rule]]\nname = \"s\"\nrate = 3\nper = \"1d\"\naction = \"shadow\"\n");
    assert_eq!(offer(&dp, &udp4([192, 0, 2, 1]), 10), (10, 0));
    let s = stats(&dp, "s");
    assert_eq!((s.passed_pkts, s.shadow_pkts, s.dropped_pkts), (3, 7, 0));
}

#[test]
fn windows_cap_each_window() {
    // A day-long window: the test cannot straddle a boundary unless it runs at midnight UTC.
    let dp = load(
        "[[rule]]\nname = \"fixed\"\nproto = \"udp\"\ndst_ports = [1]\nrate = 4\nper = \"1d\"\nalgorithm = \"fixed_window\"\n\
         [[rule]]\nname = \"sliding\"\nproto = \"udp\"\ndst_ports = [2]\nrate = 4\nper = \"1d\"\nalgorithm = \"sliding_window\"\n",
    );
    let a = [192, 0, 2, 1];
    assert_eq!(offer(&dp, &udp4_to(a, 1), 6), (4, 2));
    assert_eq!(offer(&dp, &udp4_to(a, 2), 6), (4, 2));
    assert_eq!(
        offer(&dp, &udp4_to([192, 0, 2, 2], 1), 6),
        (4, 2),
        "per source"
    );
}

#[test]
fn all_limits_of_a_rule_must_pass() {
    let dp = load(
        "[[rule]]\nname = \"multi\"\nproto = \"udp\"\ndst_ports = [1]\nlimits = [{ rate = 5, per = \"1d\" }, { rate = 3, per = \"1h\" }]\n\
         [[rule]]\nname = \"bytes\"\nproto = \"udp\"\ndst_ports = [2]\nbytes = 1000\nper = \"1d\"\n\
         [[rule]]\nname = \"both\"\nproto = \"udp\"\ndst_ports = [3]\nrate = 100\nbytes = 500\nper = \"1d\"\n",
    );
    let a = [192, 0, 2, 1];
    assert_eq!(
        offer(&dp, &udp4_to(a, 1), 6),
        (3, 3),
        "the tighter of two packet limits"
    );
    let frame = udp4_to(a, 2);
    let len = frame.len() as u32;
    assert_eq!(
        offer(&dp, &frame, 1000 / len + 3),
        (1000 / len, 3),
        "{len} bytes per frame, 1000-byte budget"
    );
    assert_eq!(
        stats(&dp, "bytes").passed_bytes,
        (1000 / len * len) as u64,
        "bytes are counted per rule"
    );
    assert_eq!(
        offer(&dp, &udp4_to(a, 3), 500 / len + 2),
        (500 / len, 2),
        "a byte limit beside a packet limit"
    );
}

#[test]
fn soft_and_elastic_modes() {
    let dp = load(
        "[[rule]]\nname = \"soft\"\nproto = \"udp\"\ndst_ports = [1]\nrate = 10\nper = \"1d\"\nmode = \"soft\"\nsoft_percent = 50\n\
         [[rule]]\nname = \"elastic\"\nproto = \"udp\"\ndst_ports = [2]\nrate = 2\nper = \"1d\"\nmode = \"elastic\"\npool_rate = 3\npool_per = \"1d\"\n",
    );
    assert_eq!(
        offer(&dp, &udp4_to([192, 0, 2, 1], 1), 20),
        (15, 5),
        "10 + 50%"
    );
    // Source A: its own 2, then the pool's 3. Source B: its own 2; the pool is spent.
    assert_eq!(offer(&dp, &udp4_to([192, 0, 2, 1], 2), 8), (5, 3));
    assert_eq!(offer(&dp, &udp4_to([192, 0, 2, 2], 2), 8), (2, 6));
    // One pool for the rule, IPv6 sources too: spent by IPv4 already
    // (before, each family had a pool of its own).
    let udp6_to = |last: u8, port: u16| {
        let mut src = [0x20, 0x01, 0x0d, 0xb8, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0];
        src[7] = last;
        eth(&[], ETH_P_IPV6, &ipv6(src, UDP, &udp(port)))
    };
    assert_eq!(
        offer(&dp, &udp6_to(1, 2), 8),
        (2, 6),
        "IPv6: its own 2; the rule's pool is spent"
    );
    let dp = load("[[rule]]\nname = \"elastic\"\nproto = \"udp\"\ndst_ports = [2]\nrate = 2\nper = \"1d\"\nmode = \"elastic\"\npool_rate = 3\npool_per = \"1d\"\n");
    assert_eq!(
        offer(&dp, &udp6_to(1, 2), 4),
        (4, 0),
        "IPv6 first: its own 2, then 2 of the pool's 3"
    );
    assert_eq!(
        offer(&dp, &udp4_to([192, 0, 2, 1], 2), 4),
        (3, 1),
        "IPv4: its own 2, then the pool's last one"
    );
}

#[test]
fn reload_keeps_unchanged_rules_state_and_refreshes_changed_ones() {
    require_root();
    let v1 = with_default(
        "[[rule]]\nname = \"keep\"\nproto = \"udp\"\ndst_ports = [1]\nrate = 2\nper = \"1d\"\n\
         [[rule]]\nname = \"change\"\nproto = \"udp\"\ndst_ports = [2]\nrate = 2\nper = \"1d\"\n",
    );
    let v2 = with_default(
        "[[rule]]\nname = \"new\"\nproto = \"udp\"\ndst_ports = [3]\nrate = 1\nper = \"1d\"\n\
         [[rule]]\nname = \"keep\"\nproto = \"udp\"\ndst_ports = [1]\nrate = 2\nper = \"1d\"\n\
         [[rule]]\nname = \"change\"\nproto = \"udp\"\ndst_ports = [2]\nrate = 4\nper = \"1d\"\n",
    );
    let mut dp = Datapath::load(&compile(&Config::from_str(&v1, "v1").unwrap())).unwrap();
    let a = [192, 0, 2, 1];
    assert_eq!(offer(&dp, &udp4_to(a, 1), 3), (2, 1));
    assert_eq!(offer(&dp, &udp4_to(a, 2), 3), (2, 1));
    dp.install(&compile(&Config::from_str(&v2, "v2").unwrap()).rules)
        .unwrap();
    assert_eq!(
        offer(&dp, &udp4_to(a, 1), 2),
        (0, 2),
        "an unchanged rule keeps its spent bucket (moved in the file)"
    );
    assert_eq!(
        offer(&dp, &udp4_to(a, 2), 5),
        (4, 1),
        "a changed rule starts fresh with its new limit"
    );
    assert_eq!(
        offer(&dp, &udp4_to(a, 3), 2),
        (1, 1),
        "a new rule applies at once"
    );
    // Counters follow names across the reload.
    assert_eq!(charged(&dp, "keep"), 5);
    assert_eq!(charged(&dp, "change"), 8);
    // And back: a second reload reuses the first slot.
    dp.install(&compile(&Config::from_str(&v1, "v1").unwrap()).rules)
        .unwrap();
    assert_eq!(offer(&dp, &udp4_to(a, 1), 1), (0, 1), "still spent");
    assert_eq!(
        offer(&dp, &udp4_to(a, 3), 2),
        (2, 0),
        "the removed rule no longer applies"
    );
    assert_eq!(charged(&dp, "keep"), 6);
}

/// The datapath holds 1,000 rules and 100,000 deny CIDRs, and classifies
/// correctly among them.
#[test]
fn holds_a_thousand_rules_and_a_hundred_thousand_cidrs() {
    require_root();
    let mut t = String::from("[datapath]\nmax_sources = 4096\n[default]\nrate = 1000000\n");
    for i in 0..100_000u32 {
        t += &format!(
            "[[deny]]\ncidr = \"100.{}.{}.{}/32\"\n",
            64 + (i >> 16),
            (i >> 8) & 255,
            i & 255
        );
    }
    for i in 0..999u32 {
        t += &format!("[[rule]]\nname = \"r{i}\"\nproto = \"tcp\"\ndst_ports = [{}]\nrate = 2\nper = \"1d\"\n", 1000 + i);
        if i % 10 == 0 {
            t += &format!("src = [\"10.{}.{}.0/24\"]\n", (i >> 8) & 255, i & 255);
        }
    }
    t += "[[rule]]\nname = \"last\"\nproto = \"udp\"\ndst_ports = [53]\nrate = 3\nper = \"1d\"\n";
    let c = Config::from_str(&t, "big").unwrap();
    assert_eq!((c.rules.len(), c.deny.len()), (1000, 100_000));
    let dp = Datapath::load(&compile(&c)).unwrap();
    assert_eq!(
        offer(&dp, &udp4_to([100, 65, 134, 159], 53), 2),
        (0, 2),
        "deny entry 99,999"
    );
    assert_eq!(
        offer(&dp, &udp4_to([100, 65, 134, 160], 53), 4),
        (3, 1),
        "not denied: the last rule"
    );
    assert_eq!(
        offer(&dp, &tcp4([203, 0, 113, 9], 1998, SYN), 3),
        (2, 1),
        "port 1998: rule r998"
    );
    assert_eq!(
        offer(&dp, &tcp4([203, 0, 113, 9], 1999, SYN), 3),
        (3, 0),
        "port 1999: no rule, the default"
    );
    assert_eq!(
        offer(&dp, &tcp4([10, 0, 0, 9], 1000, SYN), 3),
        (2, 1),
        "r0, whose src contains the source"
    );
    assert_eq!(
        offer(&dp, &tcp4([192, 0, 2, 9], 1000, SYN), 3),
        (3, 0),
        "r0 does not apply outside its src"
    );
    assert_eq!(charged(&dp, "last"), 4);
}

/// "Limited" events: one per source per episode, and a kernel-side budget
/// (100 at once, 100/s) however many sources start being limited.
#[test]
fn limited_events_are_one_per_episode_and_budgeted_in_the_kernel() {
    let mut dp =
        load("[[rule]]\nname = \"udp\"\nproto = \"udp\"\nrate = 1\nper = \"1d\"\nburst = 1\n");
    let mut ring = dp.take_events().unwrap();
    let started = std::time::Instant::now();
    // 500 sources, each: one packet passes, three drop (one episode).
    for i in 0..500u32 {
        let frame = udp4([10, 1, (i >> 8) as u8, i as u8]);
        assert_eq!(offer(&dp, &frame, 4), (1, 3));
    }
    let elapsed = started.elapsed().as_secs_f64();
    let mut events = Vec::new();
    while let Some(item) = ring.next() {
        events.extend(rl_common::Event::read(&item));
    }
    let c = dp.counters().unwrap();
    let (sent, suppressed) = (
        c.get(rl_common::STAT_EVENTS),
        c.get(rl_common::STAT_EVENTS_SUPPRESSED),
    );
    assert_eq!(
        sent + suppressed,
        500,
        "one episode per source: {sent} sent, {suppressed} suppressed"
    );
    assert_eq!(events.len() as u64, sent);
    let budget = rl_common::EVENTS_BURST as f64 + rl_common::EVENTS_PER_SEC as f64 * elapsed;
    assert!(
        events.len() as f64 <= budget + 1.0,
        "{} events in {elapsed:.3} s, budget {budget:.1}",
        events.len()
    );
    assert!(
        events.len() as u64 >= rl_common::EVENTS_BURST,
        "the first {} go through",
        rl_common::EVENTS_BURST
    );
    // Each names its source and the rule's bucket.
    let e = events[0];
    assert_eq!((e.family, &e.addr[..4]), (4, &[10u8, 1, 0, 0][..]));
    assert_eq!(dp.rule_name_of_key(e.rule), Some("udp"));
    let mut seen: Vec<[u8; 16]> = events.iter().map(|e| e.addr).collect();
    seen.sort();
    seen.dedup();
    assert_eq!(
        seen.len(),
        events.len(),
        "at most one event per source per episode"
    );
}
