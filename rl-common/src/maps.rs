//! Map names and the `#[repr(C)]` keys and values the XDP program and the
//! daemon share. Every layout is pinned by a size assertion: a silent change
//! would make lookups miss.

use core::mem::size_of;

use crate::{clock::TickClock, limiter::Limit};

/// IPv4 buckets (`BPF_MAP_TYPE_LRU_HASH`, [`Key4`] ➜ [`Bucket`]).
/// Its capacity is set at load time from `datapath.max_sources`.
pub const MAP_SOURCES_V4: &str = "RL_SRC4";
/// IPv6 buckets ([`Key6`] ➜ [`Bucket`]), sized like [`MAP_SOURCES_V4`].
///
/// Why two maps: an 8-byte IPv4 key hashes and compares in about half the
/// time of a 20-byte one, on the lookup every packet makes; and a flood of
/// one family cannot evict the other family's buckets.
pub const MAP_SOURCES_V6: &str = "RL_SRC6";
/// The single-entry [`DatapathConfig`] array written by the daemon.
pub const MAP_CONFIG: &str = "RL_CONFIG";
/// Per-CPU [`Stats`], one entry: one lookup per packet covers every counter.
pub const MAP_STATS: &str = "RL_STATS";

/// The limiter program's name in the object file.
pub const PROG_LIMITER: &str = "rl";
/// A program that only returns `XDP_DROP`: the floor for benchmarks.
pub const PROG_FLOOR: &str = "rl_floor";
/// A program that writes `[jiffies64, ktime_ns]` (native-endian `u64`s) into
/// the first 16 bytes of the packet: the daemon's [`TickClock`] calibration.
pub const PROG_CLOCK: &str = "rl_clock";

/// Rule id of the `[default]` limit.
pub const RULE_DEFAULT: u32 = 0;

/// The key of an IPv4 bucket: which limit, and the source masked to its
/// aggregation prefix.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash)]
pub struct Key4 {
    /// Which limit this bucket belongs to ([`RULE_DEFAULT`] for `[default]`).
    pub rule: u32,
    /// The masked address in network byte order, as read from the packet.
    pub addr: u32,
}
const _: () = assert!(size_of::<Key4>() == 8);

/// The key of an IPv6 bucket: which limit, and the source masked to its
/// aggregation prefix as four network-order words read from the packet.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash)]
pub struct Key6 {
    pub rule: u32,
    pub addr: [u32; 4],
}
const _: () = assert!(size_of::<Key6>() == 20);

impl Key4 {
    /// The address's four bytes, in order.
    pub fn addr_bytes(&self) -> [u8; 4] {
        self.addr.to_ne_bytes()
    }
}

impl Key6 {
    /// The address's 16 bytes, in order.
    pub fn addr_bytes(&self) -> [u8; 16] {
        let mut out = [0u8; 16];
        for (i, w) in self.addr.iter().enumerate() {
            out[i * 4..i * 4 + 4].copy_from_slice(&w.to_ne_bytes());
        }
        out
    }
}

/// A bucket: the GCRA theoretical arrival time, in ktime nanoseconds (read
/// directly or through [`TickClock`]).
/// Updated only with compare-and-swap (see [`crate::admit_shared`]).
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Bucket {
    pub tat_ns: u64,
}
const _: () = assert!(size_of::<Bucket>() == 8);

/// What the daemon tells the datapath; entry 0 of [`MAP_CONFIG`].
/// Until the daemon writes it, `enabled` is 0 and every packet passes.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct DatapathConfig {
    /// The `[default]` per-source limit.
    pub default_limit: Limit,
    /// Mask applied to IPv4 sources (network order), from `ipv4_prefix`.
    pub v4_mask: u32,
    /// 1 once the daemon has written a configuration.
    pub enabled: u32,
    /// Mask applied to IPv6 sources (network-order words), from `ipv6_prefix`.
    pub v6_mask: [u32; 4],
    /// The tick clock, measured by the daemon at load.
    pub clock: TickClock,
    /// 1 when `default_limit` reads time through `clock` (see
    /// [`TickClock::suits`]), 0 for `bpf_ktime_get_ns`.
    pub default_coarse: u32,
    pub _pad: u32,
}
const _: () = assert!(size_of::<DatapathConfig>() == 64);

impl DatapathConfig {
    /// This configuration with `clock`, each limit reading the tick clock
    /// exactly when the clock [suits](TickClock::suits) it.
    pub fn with_clock(mut self, clock: TickClock) -> Self {
        self.clock = clock;
        self.default_coarse = clock.suits(&self.default_limit) as u32;
        self
    }
}

/// The `N` network-order words (as read from packet memory) of a mask that
/// keeps the first `prefix` bits of a `32 × N`-bit address.
pub fn prefix_mask_words<const N: usize>(prefix: u8) -> [u32; N] {
    let mut out = [0u32; N];
    let mut left = prefix as u32;
    for w in out.iter_mut() {
        let bits = if left >= 32 { 32 } else { left };
        left -= bits;
        let host = if bits == 0 { 0 } else { u32::MAX << (32 - bits) };
        *w = u32::from_ne_bytes(host.to_be_bytes());
    }
    out
}

/// Every counter of one CPU, indexed by the `STAT_*` constants.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Stats(pub [u64; STAT_COUNT as usize]);

// Counters: indices into [`Stats`].
/// Packets passed (all of them, including non-IP).
pub const STAT_PASSED_PKTS: u32 = 0;
pub const STAT_PASSED_BYTES: u32 = 1;
/// Packets dropped (all of them, including malformed).
pub const STAT_DROPPED_PKTS: u32 = 2;
pub const STAT_DROPPED_BYTES: u32 = 3;
/// Of the passed: frames that are not IPv4/IPv6 (never limited).
pub const STAT_NON_IP: u32 = 4;
/// Of the dropped: IP packets with truncated or malformed headers.
pub const STAT_MALFORMED: u32 = 5;
/// Buckets created for sources seen for the first time (or after eviction).
pub const STAT_NEW_SOURCES: u32 = 6;
/// Of the dropped: the source's bucket could not be created or found.
pub const STAT_NO_STATE: u32 = 7;
/// Of the dropped: other CPUs won the bucket's compare-and-swap every retry.
pub const STAT_CONTENDED: u32 = 8;
/// Number of counters.
pub const STAT_COUNT: u32 = 9;

/// Counter names for logs and metrics, indexed like the `STAT_*` constants.
pub const STAT_NAMES: [&str; STAT_COUNT as usize] = [
    "passed_packets",
    "passed_bytes",
    "dropped_packets",
    "dropped_bytes",
    "non_ip_packets",
    "malformed_packets",
    "new_sources",
    "no_state_drops",
    "contended_drops",
];

#[cfg(feature = "user")]
mod pod {
    unsafe impl aya::Pod for super::Key4 {}
    unsafe impl aya::Pod for super::Key6 {}
    unsafe impl aya::Pod for super::Bucket {}
    unsafe impl aya::Pod for super::DatapathConfig {}
    unsafe impl aya::Pod for super::Stats {}
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn masks_keep_prefix_bits_in_network_order() {
        let m: [u32; 1] = prefix_mask_words(24);
        assert_eq!(m[0].to_ne_bytes(), [255, 255, 255, 0]);
        let m: [u32; 4] = prefix_mask_words(64);
        assert_eq!(m[1].to_ne_bytes(), [255; 4]);
        assert_eq!(m[2], 0);
        let m: [u32; 4] = prefix_mask_words(52);
        assert_eq!(m[1].to_ne_bytes(), [255, 255, 240, 0]);
        let m: [u32; 4] = prefix_mask_words(128);
        assert_eq!(m, [u32::MAX; 4]);
        let m: [u32; 1] = prefix_mask_words(0);
        assert_eq!(m, [0]);
    }

    #[test]
    fn key_bytes_are_network_order() {
        let k = Key4 { rule: 0, addr: u32::from_ne_bytes([192, 0, 2, 7]) };
        assert_eq!(k.addr_bytes(), [192, 0, 2, 7]);
        let k = Key6 { rule: 0, addr: [u32::from_ne_bytes([0xfd, 0, 0, 1]), 0, 0, u32::from_ne_bytes([0, 0, 0, 9])] };
        assert_eq!(k.addr_bytes()[0], 0xfd);
        assert_eq!(k.addr_bytes()[15], 9);
    }
}
