//! Packet fuzzing: random and mutated frames through the real XDP program
//! (BPF_PROG_TEST_RUN), each verdict compared with the userspace reference
//! (`rl_tests::reference`), and every counter compared at the end of each
//! batch. Frames: VLAN stacks, IPv4 with options and fragments, IPv6 with
//! extension chains (hop-by-hop, routing, destination options, AH,
//! fragment), TCP/UDP/ICMP/other, then truncations, bad IHL and lengths,
//! and random byte flips.
//!
//! `RL_FUZZ_FRAMES` sets the number of frames (default 1,000,000, under a
//! minute); `RL_FUZZ_SEED` the seed (default: fixed, so a failure repeats;
//! `cargo xtask fuzz` runs longer with a random one).

use std::collections::HashMap;

use rl_common::{STAT_DROPPED_PKTS, STAT_FRAG_ORPHANS, STAT_MALFORMED, STAT_NON_IP, STAT_PASSED_PKTS};
use rl_control::datapath::Datapath;
use rl_tests::{
    datapath,
    frames::*,
    lab::require_root,
    reference::{Counted, Reference, FUZZ_RULES, FUZZ_RULE_NAMES},
    XDP_DROP, XDP_PASS,
};

/// xorshift64*: small, seedable, good enough to pick mutations.
struct Rng(u64);

impl Rng {
    fn next(&mut self) -> u64 {
        self.0 ^= self.0 >> 12;
        self.0 ^= self.0 << 25;
        self.0 ^= self.0 >> 27;
        self.0.wrapping_mul(0x2545_f491_4f6c_dd1d)
    }
    fn below(&mut self, n: u64) -> u64 {
        self.next() % n
    }
    fn chance(&mut self, percent: u64) -> bool {
        self.below(100) < percent
    }
    fn pick<T: Copy>(&mut self, from: &[T]) -> T {
        from[self.below(from.len() as u64) as usize]
    }
}

/// A source: mostly from a few /16s (allowed, denied, the `lab` rule, and
/// others), so buckets fill up and limits bite; sometimes anywhere.
fn source(r: &mut Rng, v6: bool) -> [u8; 16] {
    let net = r.pick(&[1u8, 2, 3, 4, 5, 5, 5]);
    let mut a = [0u8; 16];
    if v6 {
        (a[0], a[1], a[7], a[15]) = (0xfd, net, r.below(4) as u8, r.below(256) as u8);
        if r.chance(10) {
            a[2..8].copy_from_slice(&r.next().to_be_bytes()[..6]);
        }
    } else {
        (a[12], a[13], a[14], a[15]) = (10, net, 0, r.below(4) as u8);
        if r.chance(10) {
            a[14] = r.below(256) as u8;
        }
    }
    a
}

fn l4_header(r: &mut Rng, proto: u8) -> Vec<u8> {
    match proto {
        TCP => tcp(r.pick(&[80, 443, 22, 53]), r.pick(&[0x02, 0x12, 0x10, 0x03, 0x00])),
        UDP => udp(r.pick(&[53, 80, 123])),
        ICMP | ICMPV6 => icmp_echo(),
        _ => vec![0u8; 8],
    }
}

fn ipv4_frame(r: &mut Rng) -> Vec<u8> {
    let src = source(r, false);
    let proto = r.pick(&[TCP, TCP, UDP, UDP, ICMP, 47]);
    let options: Vec<u8> = vec![1u8; 4 * r.below(3) as usize];
    let mut l4 = l4_header(r, proto);
    l4.extend(std::iter::repeat_n(0x5a, r.below(24) as usize));
    let mut ip = ipv4(src[12..].try_into().unwrap(), proto, &options, &l4);
    if r.chance(25) {
        // A fragment of one of a few datagrams: first (MF), middle or last.
        let id = r.below(6) as u16;
        let (offset, more) = r.pick(&[(0u16, true), (0, true), (0, false), (8, true), (16, false)]);
        ip[4..6].copy_from_slice(&id.to_be_bytes());
        ip[6..8].copy_from_slice(&((more as u16) << 13 | offset).to_be_bytes());
    }
    ip
}

fn ipv6_frame(r: &mut Rng) -> Vec<u8> {
    let src = source(r, true);
    let proto = r.pick(&[TCP, UDP, UDP, ICMPV6, ICMP, 47]);
    let mut inner = l4_header(r, proto);
    let mut next = proto;
    // An extension chain, innermost first.
    for _ in 0..r.below(8) {
        let kind = r.pick(&[0u8, 43, 60, 51, 44, 44]);
        inner = match kind {
            44 => {
                let offset = r.pick(&[0u16, 0, 8]);
                ipv6_fragment(next, offset, r.chance(60), r.below(6) as u32, &inner)
            }
            51 => {
                // AH: length in 4-byte units minus 2; 12 bytes here.
                let mut h = vec![next, 1, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0];
                h.extend_from_slice(&inner);
                h
            }
            _ => ipv6_ext(next, &inner),
        };
        next = kind;
    }
    ipv6(src, next, &inner)
}

/// One frame: well-formed, then perhaps broken.
fn frame(r: &mut Rng) -> Vec<u8> {
    let v6 = r.chance(45);
    let ip = if v6 { ipv6_frame(r) } else { ipv4_frame(r) };
    let tags: Vec<(u16, u16)> = (0..r.pick(&[0usize, 0, 0, 1, 2, 3]))
        .map(|_| (r.pick(&[ETH_P_8021Q, ETH_P_8021AD]), r.below(4096) as u16))
        .collect();
    let ethertype = if r.chance(3) { ETH_P_ARP } else if v6 { ETH_P_IPV6 } else { ETH_P_IP };
    let mut f = eth(&tags, ethertype, &ip);
    let l3 = 14 + 4 * tags.len();
    if r.chance(30) {
        // Flip a few bytes, mostly in the headers.
        for _ in 0..1 + r.below(3) {
            let span = (l3 + 80).min(f.len());
            let at = if r.chance(80) { r.below(span as u64) } else { r.below(f.len() as u64) } as usize;
            f[at] = r.next() as u8;
        }
    }
    if r.chance(10) && !v6 {
        // A bad IHL or total length.
        if r.chance(50) {
            f[l3] = 0x40 | r.below(16) as u8;
        } else {
            f[l3 + 2..l3 + 4].copy_from_slice(&(r.below(80) as u16).to_be_bytes());
        }
    }
    if r.chance(10) && v6 && f.len() > l3 + 6 {
        f[l3 + 4..l3 + 6].copy_from_slice(&(r.below(80) as u16).to_be_bytes());
    }
    if r.chance(15) {
        f.truncate(14.max(r.below(f.len() as u64 + 1) as usize));
    }
    f
}

#[derive(Default, Debug, PartialEq, Eq)]
struct Tally {
    non_ip: u64,
    malformed: u64,
    orphans: u64,
    passed: u64,
    dropped: u64,
    /// (passed packets, dropped packets, passed bytes, dropped bytes) by name.
    rules: HashMap<&'static str, (u64, u64, u64, u64)>,
}

fn observed(dp: &Datapath) -> Tally {
    let c = dp.counters().unwrap();
    let stats = dp.rule_stats().unwrap();
    let mut t = Tally {
        non_ip: c.get(STAT_NON_IP),
        malformed: c.get(STAT_MALFORMED),
        orphans: c.get(STAT_FRAG_ORPHANS),
        passed: c.get(STAT_PASSED_PKTS),
        dropped: c.get(STAT_DROPPED_PKTS),
        rules: HashMap::new(),
    };
    for (name, _) in FUZZ_RULE_NAMES {
        let s = stats.get(name).copied().unwrap_or_default();
        if s.passed_pkts + s.dropped_pkts > 0 {
            t.rules.insert(name, (s.passed_pkts, s.dropped_pkts, s.passed_bytes, s.dropped_bytes));
        }
    }
    t
}

#[test]
fn random_and_mutated_frames_match_the_reference() {
    require_root();
    let total: u64 = std::env::var("RL_FUZZ_FRAMES").ok().and_then(|v| v.parse().ok()).unwrap_or(1_000_000);
    let seed: u64 = std::env::var("RL_FUZZ_SEED").ok().and_then(|v| v.parse().ok()).unwrap_or(0x5eed_f00d);
    // A fresh datapath and reference per batch: the fragment table (an
    // LRU of 65,536 datagrams) never fills, so its evictions, which the
    // reference does not model, never happen.
    const BATCH: u64 = 100_000;
    let mut r = Rng(seed | 1);
    let mut done = 0;
    while done < total {
        // The reference never expires a datagram: a batch must end well
        // within FUZZ_RULES' fragment_ttl_ms (60 s), as it does by far.
        let batch_start = std::time::Instant::now();
        let dp = datapath(FUZZ_RULES).unwrap();
        let mut reference = Reference::default();
        let mut want = Tally::default();
        for i in 0..BATCH.min(total - done) {
            let f = frame(&mut r);
            let (pass, counted) = reference.run(&f);
            let got = dp.test_run(&f, 1).unwrap().0;
            let expect = if pass { XDP_PASS } else { XDP_DROP };
            assert_eq!(
                got,
                expect,
                "frame {} (seed {seed}, {:?} into its batch): verdict {got}, reference {expect} ({counted:?}): {:02x?}",
                done + i,
                batch_start.elapsed(),
                f
            );
            let len = f.len() as u64;
            if pass { want.passed += 1 } else { want.dropped += 1 }
            match counted {
                Counted::NonIp => want.non_ip += 1,
                Counted::Malformed => want.malformed += 1,
                Counted::Orphan => want.orphans += 1,
                Counted::Allow | Counted::Deny => {}
                Counted::Rule(i) => {
                    let e = want.rules.entry(FUZZ_RULE_NAMES[i].0).or_default();
                    if pass { (e.0 += 1, e.2 += len) } else { (e.1 += 1, e.3 += len) };
                }
            }
        }
        assert_eq!(observed(&dp), want, "counters after frames {done}.. (seed {seed})");
        let took = batch_start.elapsed();
        assert!(took < std::time::Duration::from_secs(50), "a batch took {took:?}: too close to the 60 s fragment TTL the reference ignores");
        if done == 0 {
            eprintln!("packet fuzz, first batch: {want:?}");
        }
        done += BATCH.min(total - done);
    }
    eprintln!("packet fuzz: {done} frames, seed {seed}, 0 mismatches");
}
