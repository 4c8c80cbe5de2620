//! Hand-built frames for `BPF_PROG_TEST_RUN`: well-formed and deliberately
//! broken. Checksums are left zero: XDP does not verify them.

pub const ETH_P_IP: u16 = 0x0800;
pub const ETH_P_IPV6: u16 = 0x86DD;
pub const ETH_P_ARP: u16 = 0x0806;
pub const ETH_P_8021Q: u16 = 0x8100;
pub const ETH_P_8021AD: u16 = 0x88A8;
pub const TCP: u8 = 6;
pub const UDP: u8 = 17;
pub const ICMP: u8 = 1;
pub const ICMPV6: u8 = 58;

/// Ethernet header + `payload`, behind VLAN `tags` (outer first: (TPID, VID)).
pub fn eth(tags: &[(u16, u16)], ethertype: u16, payload: &[u8]) -> Vec<u8> {
    let mut f = vec![0x02, 0, 0, 0, 0, 0xbb, 0x02, 0, 0, 0, 0, 0xaa];
    for (tpid, vid) in tags {
        f.extend_from_slice(&tpid.to_be_bytes());
        f.extend_from_slice(&vid.to_be_bytes());
    }
    f.extend_from_slice(&ethertype.to_be_bytes());
    f.extend_from_slice(payload);
    f
}

/// IPv4 header (with `options`, a multiple of 4 bytes) + `l4`.
pub fn ipv4(src: [u8; 4], proto: u8, options: &[u8], l4: &[u8]) -> Vec<u8> {
    let ihl = (20 + options.len()) / 4;
    let total = (ihl * 4 + l4.len()) as u16;
    let mut h = vec![0x40 | ihl as u8, 0];
    h.extend_from_slice(&total.to_be_bytes());
    h.extend_from_slice(&[0, 1, 0x40, 0, 64, proto, 0, 0]);
    h.extend_from_slice(&src);
    h.extend_from_slice(&[10, 0, 0, 2]);
    h.extend_from_slice(options);
    h.extend_from_slice(l4);
    h
}

/// IPv6 header + `payload` whose first header is `next`.
pub fn ipv6(src: [u8; 16], next: u8, payload: &[u8]) -> Vec<u8> {
    let mut h = vec![0x60, 0, 0, 0];
    h.extend_from_slice(&(payload.len() as u16).to_be_bytes());
    h.extend_from_slice(&[next, 64]);
    h.extend_from_slice(&src);
    let mut dst = [0u8; 16];
    dst[0] = 0xfd;
    dst[15] = 2;
    h.extend_from_slice(&dst);
    h.extend_from_slice(payload);
    h
}

/// An 8-byte IPv6 extension header (hop-by-hop, routing, destination options)
/// announcing `next`, followed by `rest`.
pub fn ipv6_ext(next: u8, rest: &[u8]) -> Vec<u8> {
    ipv6_ext_sized(next, 0, rest)
}

/// An IPv6 extension header of `(units + 1) × 8` bytes (its length field
/// `units`) announcing `next`, followed by `rest`.
pub fn ipv6_ext_sized(next: u8, units: u8, rest: &[u8]) -> Vec<u8> {
    let mut h = vec![0u8; (usize::from(units) + 1) * 8];
    (h[0], h[1]) = (next, units);
    h.extend_from_slice(rest);
    h
}

/// An IPv6 authentication header of `(units + 2) × 4` bytes (its length
/// field `units`: RFC 4302 counts 4-byte words less 2) announcing `next`,
/// followed by `rest`.
pub fn ipv6_ah(next: u8, units: u8, rest: &[u8]) -> Vec<u8> {
    let mut h = vec![0u8; (usize::from(units) + 2) * 4];
    (h[0], h[1]) = (next, units);
    h.extend_from_slice(rest);
    h
}

/// An IPv6 fragment header announcing `next`, at fragment `offset` (8-byte
/// units), without the M bit (the last fragment), id 1.
pub fn ipv6_frag(next: u8, offset: u16, rest: &[u8]) -> Vec<u8> {
    ipv6_fragment(next, offset, false, 1, rest)
}

/// An IPv6 fragment header: `more` sets the M bit.
pub fn ipv6_fragment(next: u8, offset: u16, more: bool, id: u32, rest: &[u8]) -> Vec<u8> {
    let mut h = vec![next, 0];
    h.extend_from_slice(&(offset << 3 | more as u16).to_be_bytes());
    h.extend_from_slice(&id.to_be_bytes());
    h.extend_from_slice(rest);
    h
}

/// An IPv4 fragment from `src` to 10.0.0.2: identification `id`, `offset`
/// in 8-byte units, `more` sets MF; `payload` is its share of the datagram.
pub fn ipv4_fragment(
    src: [u8; 4],
    proto: u8,
    id: u16,
    offset: u16,
    more: bool,
    payload: &[u8],
) -> Vec<u8> {
    let mut h = ipv4(src, proto, &[], payload);
    h[4..6].copy_from_slice(&id.to_be_bytes());
    h[6..8].copy_from_slice(&((more as u16) << 13 | offset).to_be_bytes());
    h
}

pub fn udp(dport: u16) -> Vec<u8> {
    let mut h = vec![0x30, 0x39];
    h.extend_from_slice(&dport.to_be_bytes());
    h.extend_from_slice(&[0, 16, 0, 0]);
    h.extend_from_slice(&[0u8; 8]);
    h
}

pub fn tcp(dport: u16, flags: u8) -> Vec<u8> {
    let mut h = vec![0x30, 0x39];
    h.extend_from_slice(&dport.to_be_bytes());
    h.extend_from_slice(&[0; 8]);
    h.extend_from_slice(&[5 << 4, flags, 0xff, 0xff, 0, 0, 0, 0]);
    h
}

pub fn icmp_echo() -> Vec<u8> {
    vec![8, 0, 0, 0, 0, 1, 0, 1]
}

/// A UDP/IPv4 frame from `src`.
pub fn udp4(src: [u8; 4]) -> Vec<u8> {
    eth(&[], ETH_P_IP, &ipv4(src, UDP, &[], &udp(53)))
}

/// A UDP/IPv6 frame from `src`.
pub fn udp6(src: [u8; 16]) -> Vec<u8> {
    eth(&[], ETH_P_IPV6, &ipv6(src, UDP, &udp(53)))
}

/// The IPv4 or IPv6 source of an Ethernet frame, behind any VLAN tags.
pub fn source_of(frame: &[u8]) -> Option<std::net::IpAddr> {
    let mut off = 12;
    loop {
        let ethertype = u16::from_be_bytes([*frame.get(off)?, *frame.get(off + 1)?]);
        off += 2;
        match ethertype {
            ETH_P_8021Q | ETH_P_8021AD => off += 2,
            ETH_P_IP => {
                let b: [u8; 4] = frame.get(off + 12..off + 16)?.try_into().ok()?;
                return Some(b.into());
            }
            ETH_P_IPV6 => {
                let b: [u8; 16] = frame.get(off + 8..off + 24)?.try_into().ok()?;
                return Some(b.into());
            }
            _ => return None,
        }
    }
}
