//! rl's XDP program: parse ➜ limit ➜ count, one verdict per packet.
//!
//! The per-packet path does no string work and no loops over rules: a config
//! lookup, the precomputed classification (see `limit`), one hash lookup
//! per limit of the matched rule (skipped when the known-keys filter says
//! the key owns no bucket; see `known` and `buckets`), one compare-and-swap
//! each, and per-CPU counters.
#![no_std]
#![no_main]
// compare-and-swap on map memory: see `limit::Tat`.
#![allow(internal_features)]
#![feature(core_intrinsics)]

mod bans;
mod buckets;
mod frag;
mod known;
mod limit;
mod parse;
mod stats;

use aya_ebpf::{bindings::xdp_action, macros::xdp, programs::XdpContext};

use crate::{limit::Verdict, parse::Parsed};

/// The limiter. Every path ends in exactly one counted verdict: non-IP and
/// malformed frames in the global counters, IP packets in their rule's.
#[xdp]
// Inlined into the entry point: as a BPF-to-BPF call its packet pointers
// would arrive as plain integers, which the verifier refuses to dereference.
#[inline(always)]
pub fn rl(ctx: XdpContext) -> u32 {
    let len = (ctx.data_end() - ctx.data()) as u64;
    let verdict = match parse::parse(&ctx) {
        Parsed::Ip(pkt) => limit::limit(&ctx, &pkt, len),
        Parsed::NotIp => {
            stats::passed(len, Some(rl_common::STAT_NON_IP));
            Verdict::Pass
        }
        Parsed::Malformed => {
            stats::dropped(len, rl_common::STAT_MALFORMED);
            Verdict::Drop
        }
    };
    match verdict {
        Verdict::Pass => xdp_action::XDP_PASS,
        Verdict::Drop => xdp_action::XDP_DROP,
    }
}

/// The benchmark floor: the cheapest XDP program there is.
#[xdp]
pub fn rl_floor(_ctx: XdpContext) -> u32 {
    xdp_action::XDP_DROP
}

/// The veth benchmark's baseline: attached in rl's place, it passes all.
#[xdp]
pub fn rl_pass(_ctx: XdpContext) -> u32 {
    xdp_action::XDP_PASS
}

/// Clock calibration for the daemon: writes `[jiffies64, ktime_ns]` into the
/// first 16 bytes of a test packet (see `rl_common::PROG_CLOCK`).
#[xdp]
pub fn rl_clock(ctx: XdpContext) -> u32 {
    let p = ctx.data();
    if p + 16 > ctx.data_end() {
        return xdp_action::XDP_ABORTED;
    }
    unsafe {
        let jiffies = aya_ebpf::helpers::bpf_jiffies64();
        let ktime = aya_ebpf::helpers::bpf_ktime_get_ns();
        core::ptr::write_unaligned(p as *mut u64, jiffies);
        core::ptr::write_unaligned((p + 8) as *mut u64, ktime);
    }
    xdp_action::XDP_PASS
}

#[cfg(not(test))]
#[panic_handler]
fn panic(_info: &core::panic::PanicInfo) -> ! {
    loop {}
}

#[unsafe(link_section = "license")]
#[unsafe(no_mangle)]
static LICENSE: [u8; 13] = *b"Dual MIT/GPL\0";
