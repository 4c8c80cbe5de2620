//! A userspace reference of the XDP program's parser, classifier and
//! fragment tracking, written from README.md ("How it works", "Fragments")
//! rather than from rl-ebpf's code, for the packet fuzz test. It covers the
//! rule set [`FUZZ_RULES`] (packet limits that never refill during a test),
//! so every verdict and counter can be predicted exactly.

use std::collections::HashMap;

/// What the parser makes of a frame.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Parsed {
    NotIp,
    Malformed,
    Ip(Packet),
}

#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Packet {
    pub v6: bool,
    pub src: [u8; 16],
    pub proto: u8,
    pub port: u16,
    pub flags: u8,
    pub frag: Frag,
    /// A later fragment's data bytes, by its IP header's lengths.
    pub data: u32,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Frag {
    No,
    /// A first or later fragment of datagram (dst fold, id).
    First(u32, u32),
    Later(u32, u32),
}

fn be16(f: &[u8], at: usize) -> Option<u16> {
    Some(u16::from_be_bytes([*f.get(at)?, *f.get(at + 1)?]))
}

/// Ethernet, up to two VLAN tags (a third is malformed), IPv4 or IPv6 (six extension headers at
/// most), then TCP/UDP/ICMP/ICMPv6 headers.
pub fn parse(f: &[u8]) -> Parsed {
    let Some(mut ethertype) = be16(f, 12) else {
        return Parsed::NotIp;
    };
    let mut off = 14;
    for _ in 0..2 {
        if ethertype != 0x8100 && ethertype != 0x88a8 {
            break;
        }
        let Some(inner) = be16(f, off + 2) else {
            return Parsed::NotIp;
        };
        ethertype = inner;
        off += 4;
    }
    match ethertype {
        0x0800 => ipv4(f, off),
        0x86dd => ipv6(f, off),
        // A third tag: malformed (the kernel would strip priority tags
        // and deliver what is inside).
        0x8100 | 0x88a8 => Parsed::Malformed,
        _ => Parsed::NotIp,
    }
}

fn l4_min(proto: u8) -> usize {
    match proto {
        6 => 20,
        17 => 8,
        1 | 58 => 4,
        _ => 0,
    }
}

fn ipv4(f: &[u8], off: usize) -> Parsed {
    let Some(h) = f.get(off..off + 20) else {
        return Parsed::Malformed;
    };
    let ihl = (h[0] & 15) as usize * 4;
    if h[0] >> 4 != 4 || ihl < 20 || f.len() < off + ihl {
        return Parsed::Malformed;
    }
    let mut src = [0u8; 16];
    src[12..].copy_from_slice(&h[12..16]);
    let mut p = Packet {
        v6: false,
        src,
        proto: h[9],
        port: 0,
        flags: 0,
        frag: Frag::No,
        data: 0,
    };
    let field = u16::from_be_bytes([h[6], h[7]]);
    let dst = u32::from_ne_bytes([h[16], h[17], h[18], h[19]]);
    let id = u16::from_be_bytes([h[4], h[5]]) as u32;
    if field & 0x1fff != 0 {
        p.frag = Frag::Later(dst, id);
        p.data = (u16::from_be_bytes([h[2], h[3]]) as usize).saturating_sub(ihl) as u32;
        return Parsed::Ip(p);
    }
    let mut first_end = 0;
    if field & 0x2000 != 0 {
        p.frag = Frag::First(dst, id);
        first_end = off + u16::from_be_bytes([h[2], h[3]]) as usize;
    }
    l4(f, off + ihl, first_end, p)
}

fn ipv6(f: &[u8], off: usize) -> Parsed {
    let Some(h) = f.get(off..off + 40) else {
        return Parsed::Malformed;
    };
    if h[0] >> 4 != 6 {
        return Parsed::Malformed;
    }
    let mut src = [0u8; 16];
    src.copy_from_slice(&h[8..24]);
    let mut p = Packet {
        v6: true,
        src,
        proto: h[6],
        port: 0,
        flags: 0,
        frag: Frag::No,
        data: 0,
    };
    let ip_end = off + 40 + u16::from_be_bytes([h[4], h[5]]) as usize;
    let w = |i: usize| u32::from_ne_bytes([h[i], h[i + 1], h[i + 2], h[i + 3]]);
    let dst = w(24) ^ w(28) ^ w(32) ^ w(36);
    let mut at = off + 40;
    // At most six extension headers.
    for _ in 0..6 {
        match p.proto {
            0 | 43 | 60 => {
                let Some(e) = f.get(at..at + 2) else {
                    return Parsed::Malformed;
                };
                p.proto = e[0];
                at += (e[1] as usize + 1) * 8;
            }
            51 => {
                let Some(e) = f.get(at..at + 2) else {
                    return Parsed::Malformed;
                };
                p.proto = e[0];
                at += (e[1] as usize + 2) * 4;
            }
            44 => {
                let Some(e) = f.get(at..at + 8) else {
                    return Parsed::Malformed;
                };
                p.proto = e[0];
                let field = u16::from_be_bytes([e[2], e[3]]);
                let id = u32::from_be_bytes([e[4], e[5], e[6], e[7]]);
                at += 8;
                if field & 0xfff8 != 0 {
                    p.frag = Frag::Later(dst, id);
                    p.data = ip_end.saturating_sub(at) as u32;
                    return Parsed::Ip(p);
                }
                if field & 1 != 0 {
                    p.frag = Frag::First(dst, id);
                }
            }
            _ => break,
        }
    }
    if matches!(p.proto, 0 | 43 | 60 | 51 | 44) {
        return Parsed::Malformed;
    }
    let first = matches!(p.frag, Frag::First(..));
    l4(f, at, if first { ip_end } else { 0 }, p)
}

/// `first_end`: a first fragment's IP end, which must hold its whole L4
/// header (for TCP, by its data offset); 0 otherwise.
fn l4(f: &[u8], at: usize, first_end: usize, mut p: Packet) -> Parsed {
    if first_end != 0 && at + l4_min(p.proto) > first_end {
        return Parsed::Malformed;
    }
    match p.proto {
        6 => {
            let Some(t) = f.get(at..at + 20) else {
                return Parsed::Malformed;
            };
            let doff = (t[12] >> 4) as usize;
            if doff < 5 || (first_end != 0 && at + doff * 4 > first_end) {
                return Parsed::Malformed;
            }
            p.port = u16::from_be_bytes([t[2], t[3]]);
            p.flags = t[13];
        }
        17 => {
            let Some(u) = f.get(at..at + 8) else {
                return Parsed::Malformed;
            };
            p.port = u16::from_be_bytes([u[2], u[3]]);
        }
        1 | 58 if f.len() < at + 4 => return Parsed::Malformed,
        _ => {}
    }
    Parsed::Ip(p)
}

/// The rule set the fuzz test loads: allow and deny CIDRs, then rules in
/// order, each a per-source packet limit of `burst` per day, and a final
/// catch-all so `[default]` (which refills every second) is never used.
pub const FUZZ_RULES: &str = r#"
[datapath]
max_sources = 1048576
flood_new_keys_per_sec = 1000000000
fragment_ttl_ms = 60000
[default]
rate = 1
[[allow]]
cidr = "10.1.0.0/16"
[[allow]]
cidr = "fd01::/16"
[[deny]]
cidr = "10.2.0.0/16"
[[deny]]
cidr = "fd02::/16"
[[rule]]
name = "dns"
proto = "udp"
dst_ports = [53]
rate = 1
per = "1d"
burst = 3
[[rule]]
name = "syn"
proto = "tcp"
dst_ports = [80]
tcp_flags = "syn"
rate = 1
per = "1d"
burst = 2
[[rule]]
name = "web"
proto = "tcp"
dst_ports = [80, 443]
rate = 1
per = "1d"
burst = 4
[[rule]]
name = "icmp"
proto = "icmp"
rate = 1
per = "1d"
burst = 2
[[rule]]
name = "lab"
src = ["10.3.0.0/16", "fd03::/16"]
rate = 1
per = "1d"
burst = 1
[[rule]]
name = "bulk"
proto = "udp"
dst_ports = [9000]
rate = 1000000
per = "1d"
bytes = "1B"
byte_burst = "4000B"
[[rule]]
name = "rest"
proto = "any"
rate = 1
per = "1d"
burst = 5
"#;

/// Rule names in [`FUZZ_RULES`] order, and their bursts (in packets, or
/// for [`BYTE_RULE`] in bytes: frames' lengths).
pub const FUZZ_RULE_NAMES: [(&str, u32); 7] = [
    ("dns", 3),
    ("syn", 2),
    ("web", 4),
    ("icmp", 2),
    ("lab", 1),
    ("bulk", 4000),
    ("rest", 5),
];

/// The rule of [`FUZZ_RULES`] limited by bytes (a byte a day, 4,000 at
/// once; its packet limit, a million a day, never bites): every fragment's
/// bytes count, so a datagram's later fragments can break it.
pub const BYTE_RULE: usize = 5;

/// Where the reference counts a frame.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Counted {
    NonIp,
    Malformed,
    Orphan,
    Allow,
    Deny,
    Rule(usize),
}

/// The reference datapath for [`FUZZ_RULES`]: verdict (true = pass) and
/// where each frame is counted.
#[derive(Default)]
pub struct Reference {
    buckets: HashMap<(usize, [u8; 16]), u32>,
    /// (family, src, dst fold, proto, id) ➜ (rule, passed, later data)
    frags: HashMap<FragKey, (usize, bool, u32)>,
    /// How often its rarer fragment paths were taken.
    pub reached: Reached,
}

/// How often [`Reference`] took the fragment paths a fuzz run must reach.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Reached {
    /// Later fragments charged (and passed) under their passed datagram.
    pub later_passed: u64,
    /// Later fragments dropped past their datagram's 65,535 bytes.
    pub past_bound: u64,
    /// Passed datagrams broken by a later fragment's drop (a byte limit).
    pub broken: u64,
}

impl Reached {
    pub fn add(&mut self, o: &Reached) {
        self.later_passed += o.later_passed;
        self.past_bound += o.past_bound;
        self.broken += o.broken;
    }
}

/// A datagram's fragments: (IPv6, source, destination fold, protocol, id).
type FragKey = (bool, [u8; 16], u32, u8, u32);

impl Reference {
    pub fn run(&mut self, frame: &[u8]) -> (bool, Counted) {
        let p = match parse(frame) {
            Parsed::NotIp => return (true, Counted::NonIp),
            Parsed::Malformed => return (false, Counted::Malformed),
            Parsed::Ip(p) => p,
        };
        // In 10.<n>.0.0/16 or fd0<n>::/16.
        let in_net = |n: u8| {
            if p.v6 {
                p.src[..2] == [0xfd, n]
            } else {
                p.src[12..14] == [10, n]
            }
        };
        if in_net(1) {
            return (true, Counted::Allow);
        }
        if in_net(2) {
            return (false, Counted::Deny);
        }
        let key = |p: &Packet| {
            let mut k = p.src;
            if p.v6 {
                k[8..].fill(0);
            }
            k
        };
        let (mut rule, mut packets) = (self.classify(&p, in_net(3)), 1);
        let datagram = match p.frag {
            Frag::First(dst, id) | Frag::Later(dst, id) => {
                Some((p.v6, p.src, dst, if p.v6 { 0 } else { p.proto }, id))
            }
            Frag::No => None,
        };
        if let (Frag::Later(..), Some(dg)) = (p.frag, datagram) {
            match self.frags.get_mut(&dg) {
                Some(&mut (r, false, _)) => return (false, Counted::Rule(r)),
                // A datagram holds at most 65,535 bytes: later fragments
                // past that are dropped (and no more is counted once over).
                Some((r, true, data)) => {
                    if *data > 65_535 {
                        self.reached.past_bound += 1;
                        return (false, Counted::Rule(*r));
                    }
                    // Each counts as at least 512 bytes.
                    *data += p.data.max(512);
                    if *data > 65_535 {
                        self.reached.past_bound += 1;
                        return (false, Counted::Rule(*r));
                    }
                    (rule, packets) = (*r, 0);
                }
                None => return (false, Counted::Orphan),
            }
        }
        // The byte rule charges every fragment's bytes (the frame's length).
        let units = if rule == BYTE_RULE {
            frame.len() as u32
        } else {
            packets
        };
        let used = self.buckets.entry((rule, key(&p))).or_insert(0);
        let pass = *used + units <= FUZZ_RULE_NAMES[rule].1;
        if pass {
            *used += units;
        }
        match (p.frag, datagram) {
            // Only a first fragment sets its datagram's verdict.
            (Frag::First(..), Some(dg)) => {
                self.frags.insert(dg, (rule, pass, 0));
            }
            (Frag::Later(..), Some(dg)) if !pass => {
                if let Some(v) = self.frags.get_mut(&dg) {
                    v.1 = false;
                    self.reached.broken += 1;
                }
            }
            (Frag::Later(..), Some(_)) => self.reached.later_passed += 1,
            _ => {}
        }
        (pass, Counted::Rule(rule))
    }

    /// The first rule, in file order, that matches.
    fn classify(&self, p: &Packet, lab: bool) -> usize {
        let syn = p.proto == 6 && p.flags & 0x12 == 0x02;
        let ported = matches!(p.frag, Frag::No | Frag::First(..));
        if p.proto == 17 && p.port == 53 && ported {
            0
        } else if syn && p.port == 80 && ported {
            1
        } else if p.proto == 6 && (p.port == 80 || p.port == 443) && ported {
            2
        } else if p.proto == 1 {
            3
        } else if lab {
            4
        } else if p.proto == 17 && p.port == 9000 && ported {
            BYTE_RULE
        } else {
            6
        }
    }
}
