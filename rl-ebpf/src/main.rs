//! rl's XDP program: parse ➜ limit ➜ count, one verdict per packet.
//!
//! The per-packet path does no string work and no loops over rules: one
//! config lookup, one LRU hash lookup (plus an insert for a new source), one
//! compare-and-swap, and two per-CPU counter increments.
#![no_std]
#![no_main]
// compare-and-swap on map memory: see `limit::Tat`.
#![allow(internal_features)]
#![feature(core_intrinsics)]

mod limit;
mod parse;
mod stats;

use aya_ebpf::{bindings::xdp_action, macros::xdp, programs::XdpContext};

use crate::{
    limit::Verdict,
    parse::Parsed,
};

/// The limiter. Every path ends in exactly one counted verdict.
#[xdp]
pub fn rl(ctx: XdpContext) -> u32 {
    let len = (ctx.data_end() - ctx.data()) as u64;
    match try_rl(&ctx) {
        Verdict::Pass => {
            stats::passed(len);
            xdp_action::XDP_PASS
        }
        Verdict::Drop => {
            stats::dropped(len);
            xdp_action::XDP_DROP
        }
    }
}

#[inline(always)]
fn try_rl(ctx: &XdpContext) -> Verdict {
    let pkt = match parse::parse(ctx) {
        Parsed::Ip(pkt) => pkt,
        Parsed::NotIp => {
            stats::bump(rl_common::STAT_NON_IP);
            return Verdict::Pass;
        }
        Parsed::Malformed => {
            stats::bump(rl_common::STAT_MALFORMED);
            return Verdict::Drop;
        }
    };
    limit::limit_source(ctx, &pkt)
}

/// The benchmark floor: the cheapest XDP program there is.
#[xdp]
pub fn rl_floor(_ctx: XdpContext) -> u32 {
    xdp_action::XDP_DROP
}

#[cfg(not(test))]
#[panic_handler]
fn panic(_info: &core::panic::PanicInfo) -> ! {
    loop {}
}

#[unsafe(link_section = "license")]
#[unsafe(no_mangle)]
static LICENSE: [u8; 13] = *b"Dual MIT/GPL\0";
