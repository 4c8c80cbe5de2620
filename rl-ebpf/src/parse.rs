//! Headers ➜ a small packet summary.
//!
//! Verdicts for what cannot be parsed (documented in README.md, "Datapath"):
//! - Not IPv4/IPv6 (ARP, LLDP, a frame shorter than Ethernet, a truncated VLAN
//!   tag): [`Parsed::NotIp`] ➜ passed, never limited.
//! - A third VLAN tag (the kernel would strip priority tags and deliver the
//!   IP packet inside), or IPv4/IPv6 whose L3 header is truncated or invalid (version mismatch,
//!   IHL < 5, more than [`MAX_IPV6_EXT`] extension headers), or whose TCP, UDP,
//!   ICMP or ICMPv6 header is cut short: [`Parsed::Malformed`] ➜ dropped. No
//!   host would accept them, and passing them would let a flood dodge the
//!   limit by cutting its headers.
//! - Fragments ([`Frag`]): a first fragment is classified like a whole
//!   packet, and is malformed if its IP length cannot hold the TCP, UDP or
//!   ICMP header it claims (a TCP header's options included). Non-first
//!   fragments carry no L4 header: they follow their first fragment (see
//!   `frag`). Other L4 protocols are limited by source.

use core::mem::size_of;

use aya_ebpf::programs::XdpContext;

const ETH_HLEN: usize = 14;
const VLAN_HLEN: usize = 4;
const IPV4_MIN_HLEN: usize = 20;
const IPV6_HLEN: usize = 40;
const TCP_MIN_HLEN: usize = 20;
const UDP_HLEN: usize = 8;
/// ICMP and ICMPv6: type, code and checksum.
const ICMP_MIN_HLEN: usize = 4;
/// IPv6 extension header and fragment header length unit.
const IPV6_EXT_UNIT: usize = 8;

/// At most this many VLAN tags (802.1Q inside 802.1ad) are skipped.
pub const MAX_VLAN_TAGS: usize = 2;
/// At most this many IPv6 extension headers are skipped; a longer chain is
/// treated as malformed (bounded for the verifier, and real traffic uses few).
pub const MAX_IPV6_EXT: usize = 6;

const ETH_P_IP: u16 = 0x0800;
const ETH_P_IPV6: u16 = 0x86DD;
const ETH_P_8021Q: u16 = 0x8100;
const ETH_P_8021AD: u16 = 0x88A8;

pub const IPPROTO_ICMP: u8 = 1;
pub const IPPROTO_TCP: u8 = 6;
pub const IPPROTO_UDP: u8 = 17;
pub const IPPROTO_ICMPV6: u8 = 58;
const IPPROTO_HOPOPTS: u8 = 0;
const IPPROTO_ROUTING: u8 = 43;
const IPPROTO_FRAGMENT: u8 = 44;
const IPPROTO_AH: u8 = 51;
const IPPROTO_DSTOPTS: u8 = 60;

/// Where a packet stands in fragmentation.
#[derive(Clone, Copy, PartialEq, Eq)]
pub enum Frag {
    /// A whole datagram (including IPv6 "atomic" fragments).
    No,
    /// Offset 0, more fragments follow: carries the L4 header.
    First,
    /// Offset > 0: no L4 header.
    Later,
}

/// What the limiter needs from a packet.
pub struct Packet {
    /// Source address as four network-order words; IPv4 uses only `src[3]`.
    pub src: [u32; 4],
    pub is_v6: bool,
    /// L4 protocol number (after IPv6 extension headers).
    pub proto: u8,
    /// Destination port for TCP/UDP first fragments, otherwise 0.
    pub dst_port: u16,
    /// TCP flags byte (CWR..FIN), otherwise 0.
    pub tcp_flags: u8,
    pub frag: Frag,
    /// Fragments only (0 otherwise): the destination (IPv6: folded, see
    /// `rl_common::FragKey`) and the fragment id, which name the datagram.
    pub dst: u32,
    pub frag_id: u32,
    /// Later fragments only (0 otherwise): the bytes of data it brings to
    /// its datagram, by its IP header's length (see `frag`).
    pub frag_data: u32,
}

pub enum Parsed {
    Ip(Packet),
    NotIp,
    Malformed,
}

/// The one bounds-checked access to packet memory: a pointer to a `T` at
/// `offset`, if the whole `T` lies inside the packet.
#[inline(always)]
fn ptr_at<T>(ctx: &XdpContext, offset: usize) -> Option<*const T> {
    let start = ctx.data();
    let end = ctx.data_end();
    if start + offset + size_of::<T>() > end {
        return None;
    }
    Some((start + offset) as *const T)
}

#[inline(always)]
fn read<T: Copy>(ctx: &XdpContext, offset: usize) -> Option<T> {
    // Unaligned: packet headers after VLAN tags or IP options are not aligned.
    ptr_at::<T>(ctx, offset).map(|p| unsafe { p.read_unaligned() })
}

#[inline(always)]
fn read_be16(ctx: &XdpContext, offset: usize) -> Option<u16> {
    read::<[u8; 2]>(ctx, offset).map(u16::from_be_bytes)
}

#[inline(always)]
pub fn parse(ctx: &XdpContext) -> Parsed {
    let Some(mut ethertype) = read_be16(ctx, 12) else {
        return Parsed::NotIp;
    };
    let mut off = ETH_HLEN;
    for _ in 0..MAX_VLAN_TAGS {
        if ethertype != ETH_P_8021Q && ethertype != ETH_P_8021AD {
            break;
        }
        // A VLAN tag: 2 bytes TCI, then the inner EtherType.
        let Some(inner) = read_be16(ctx, off + 2) else {
            return Parsed::NotIp;
        };
        ethertype = inner;
        off += VLAN_HLEN;
    }
    match ethertype {
        ETH_P_IP => parse_ipv4(ctx, off),
        ETH_P_IPV6 => parse_ipv6(ctx, off),
        // A third tag: the kernel strips priority tags (VLAN id 0) one
        // after another and hands the IP packet inside to the stack, so
        // passed unread it would escape every rule, deny and ban too.
        ETH_P_8021Q | ETH_P_8021AD => Parsed::Malformed,
        _ => Parsed::NotIp,
    }
}

#[inline(always)]
fn parse_ipv4(ctx: &XdpContext, off: usize) -> Parsed {
    // The header's fields are loaded where they are used: a fragment's
    // identity (destination, id, length) only for fragments. Loaded from
    // one copy of the whole header, they were all loaded up front and
    // spilled to the stack on every packet.
    let Some(hdr) = ptr_at::<[u8; IPV4_MIN_HLEN]>(ctx, off) else {
        return Parsed::Malformed;
    };
    let hdr = hdr as *const u8;
    let first = unsafe { byte(hdr) };
    let ihl = (first & 0x0f) as usize * 4;
    if first >> 4 != 4 || ihl < IPV4_MIN_HLEN {
        return Parsed::Malformed;
    }
    // Options included: the whole header must be present.
    if ptr_at::<u8>(ctx, off + ihl - 1).is_none() {
        return Parsed::Malformed;
    }
    let frag_field = unsafe { be16(hdr.add(6)) };
    let src = unsafe { word(hdr.add(12)) };
    let mut pkt = Packet {
        src: [0, 0, 0, src],
        is_v6: false,
        proto: unsafe { byte(hdr.add(9)) },
        dst_port: 0,
        tcp_flags: 0,
        frag: Frag::No,
        dst: 0,
        frag_id: 0,
        frag_data: 0,
    };
    if frag_field & (IPV4_MF | IPV4_OFFSET) == 0 {
        return parse_l4(ctx, off + ihl, 0, pkt);
    }
    pkt.dst = unsafe { word(hdr.add(16)) };
    pkt.frag_id = unsafe { be16(hdr.add(4)) } as u32;
    let total = unsafe { be16(hdr.add(2)) } as usize;
    if frag_field & IPV4_OFFSET != 0 {
        pkt.frag = Frag::Later;
        pkt.frag_data = total.saturating_sub(ihl) as u32;
        return Parsed::Ip(pkt);
    }
    pkt.frag = Frag::First;
    parse_l4(ctx, off + ihl, off + total, pkt)
}

// Loads of header fields the caller has bounds-checked, each one load
// (volatile, so that LLVM neither merges them into a copy of the header
// nor hoists a fragment's fields onto every packet's path).

/// The byte at `p`.
#[inline(always)]
unsafe fn byte(p: *const u8) -> u8 {
    unsafe { core::ptr::read_volatile(p) }
}

/// A big-endian 16-bit field at `p` (headers are 2-byte aligned after
/// Ethernet and VLAN tags).
#[inline(always)]
unsafe fn be16(p: *const u8) -> u16 {
    u16::from_be(unsafe { core::ptr::read_volatile(p as *const u16) })
}

/// A 32-bit word at `p` as it lies in the packet (network order): one
/// 4-byte load, though after Ethernet it is only 2-byte aligned, which x86
/// (and the verifier there) accept; a byte-wise read costs seven more
/// instructions.
#[inline(always)]
unsafe fn word(p: *const u8) -> u32 {
    unsafe { core::ptr::read_volatile(p as *const u32) }
}

/// IPv4 flags and fragment offset (bytes 6-7): "more fragments" and the offset.
const IPV4_MF: u16 = 0x2000;
const IPV4_OFFSET: u16 = 0x1fff;

/// The L4 header a first fragment must hold whole.
#[inline(always)]
fn l4_min_len(proto: u8) -> usize {
    match proto {
        IPPROTO_TCP => TCP_MIN_HLEN,
        IPPROTO_UDP => UDP_HLEN,
        IPPROTO_ICMP | IPPROTO_ICMPV6 => ICMP_MIN_HLEN,
        _ => 0,
    }
}

#[inline(always)]
fn parse_ipv6(ctx: &XdpContext, off: usize) -> Parsed {
    // Loaded where used, a word at a time (see `parse_ipv4`): a copy of
    // the whole header was loaded byte by byte and spilled.
    let Some(hdr) = ptr_at::<[u8; IPV6_HLEN]>(ctx, off) else {
        return Parsed::Malformed;
    };
    let hdr = hdr as *const u8;
    if unsafe { byte(hdr) } >> 4 != 6 {
        return Parsed::Malformed;
    }
    let w = |i: usize| unsafe { word(hdr.add(i)) };
    let mut pkt = Packet {
        src: [w(8), w(12), w(16), w(20)],
        is_v6: true,
        proto: unsafe { byte(hdr.add(6)) },
        dst_port: 0,
        tcp_flags: 0,
        frag: Frag::No,
        dst: 0,
        frag_id: 0,
        frag_data: 0,
    };
    // Where the IPv6 payload ends by its header: a first fragment must hold
    // its L4 header before it.
    let ip_end = off + IPV6_HLEN + unsafe { be16(hdr.add(4)) } as usize;
    let mut off = off + IPV6_HLEN;
    for _ in 0..MAX_IPV6_EXT {
        match pkt.proto {
            IPPROTO_HOPOPTS | IPPROTO_ROUTING | IPPROTO_DSTOPTS => {
                let Some(ext) = read::<[u8; 2]>(ctx, off) else {
                    return Parsed::Malformed;
                };
                pkt.proto = ext[0];
                off += (ext[1] as usize + 1) * IPV6_EXT_UNIT;
            }
            IPPROTO_AH => {
                // AH counts its length in 4-byte units, minus 2.
                let Some(ext) = read::<[u8; 2]>(ctx, off) else {
                    return Parsed::Malformed;
                };
                pkt.proto = ext[0];
                off += (ext[1] as usize + 2) * 4;
            }
            IPPROTO_FRAGMENT => {
                let Some(frag) = read::<[u8; IPV6_EXT_UNIT]>(ctx, off) else {
                    return Parsed::Malformed;
                };
                pkt.proto = frag[0];
                let field = u16::from_be_bytes([frag[2], frag[3]]);
                off += IPV6_EXT_UNIT;
                if field & (IPV6_OFFSET | IPV6_M) != 0 {
                    pkt.dst = w(24) ^ w(28) ^ w(32) ^ w(36);
                    pkt.frag_id = u32::from_be_bytes([frag[4], frag[5], frag[6], frag[7]]);
                    if field & IPV6_OFFSET != 0 {
                        // A non-first fragment: no L4 header follows.
                        pkt.frag = Frag::Later;
                        pkt.frag_data = ip_end.saturating_sub(off) as u32;
                        return Parsed::Ip(pkt);
                    }
                    pkt.frag = Frag::First;
                }
                // Offset 0 and no M bit: an "atomic" fragment, a whole datagram.
            }
            _ => return parse_l4_checked(ctx, off, ip_end, pkt),
        }
    }
    match pkt.proto {
        IPPROTO_HOPOPTS | IPPROTO_ROUTING | IPPROTO_DSTOPTS | IPPROTO_AH | IPPROTO_FRAGMENT => {
            Parsed::Malformed
        }
        _ => parse_l4_checked(ctx, off, ip_end, pkt),
    }
}

/// IPv6 fragment header field (bytes 2-3): offset in 8-byte units, M bit.
const IPV6_OFFSET: u16 = 0xfff8;
const IPV6_M: u16 = 0x0001;

/// [`parse_l4`] for an IPv6 payload ending at `ip_end`: a first
/// fragment's must hold its L4 header.
#[inline(always)]
fn parse_l4_checked(ctx: &XdpContext, off: usize, ip_end: usize, pkt: Packet) -> Parsed {
    parse_l4(ctx, off, if pkt.frag == Frag::First { ip_end } else { 0 }, pkt)
}

/// The L4 header at `off`. `first_end`: for a first fragment, where its IP
/// payload ends, which must hold the whole L4 header it claims (for TCP,
/// the options its data offset claims too: RFC 1858's tiny fragments,
/// whose header runs on into the next fragment); 0 for a whole packet.
#[inline(always)]
fn parse_l4(ctx: &XdpContext, off: usize, first_end: usize, mut pkt: Packet) -> Parsed {
    if first_end != 0 && off + l4_min_len(pkt.proto) > first_end {
        return Parsed::Malformed;
    }
    match pkt.proto {
        IPPROTO_TCP => {
            let Some(tcp) = ptr_at::<[u8; TCP_MIN_HLEN]>(ctx, off) else {
                return Parsed::Malformed;
            };
            let tcp = tcp as *const u8;
            // Data offset (high nibble) and flags, one load.
            let doff_flags = unsafe { be16(tcp.add(12)) };
            let doff = (doff_flags >> 12) as usize;
            if doff < 5 || (first_end != 0 && off + doff * 4 > first_end) {
                return Parsed::Malformed;
            }
            pkt.dst_port = unsafe { be16(tcp.add(2)) };
            pkt.tcp_flags = doff_flags as u8;
        }
        IPPROTO_UDP => {
            let Some(udp) = ptr_at::<[u8; UDP_HLEN]>(ctx, off) else {
                return Parsed::Malformed;
            };
            pkt.dst_port = unsafe { be16((udp as *const u8).add(2)) };
        }
        IPPROTO_ICMP | IPPROTO_ICMPV6 => {
            if ptr_at::<[u8; ICMP_MIN_HLEN]>(ctx, off).is_none() {
                return Parsed::Malformed;
            }
        }
        _ => {}
    }
    Parsed::Ip(pkt)
}
