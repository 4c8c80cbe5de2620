//! Classify ➜ charge. Which rule a packet belongs to comes from tables the
//! daemon precomputed (see rl-control's `compile`): for IPv4 one array lookup
//! by the source's /16 and, only inside a /16 that lists longer CIDRs, an
//! LPM lookup (IPv6: the LPM lookup), one array lookup by protocol/port/SYN,
//! and rarely one hash lookup. The rule's limits are then charged with the shared arithmetic
//! from rl-common, each state word through compare-and-swap.

use core::intrinsics::{atomic_cxchg, AtomicOrdering};

use aya_ebpf::{
    bindings::BPF_F_NO_PREALLOC,
    helpers::{bpf_jiffies64, bpf_ktime_get_ns},
    macros::map,
    maps::{lpm_trie::Key, Array, HashMap, LpmTrie, PerCpuArray, RingBuf},
    programs::XdpContext,
    Global,
};
use aya_log_ebpf::debug;
use rl_common::{
    admit_with, decide_key, gcra, Event, EVENT_BUDGET, LIMITED_GAP_NS,
    STAT_EVENTS, STAT_EVENTS_SUPPRESSED,
    Admit, Bucket, CidrEntry, DIR16_LEN, DIR16_LOOKUP, DatapathConfig, L4Entry, LimitEntry, RuleEntry, RuleStats,
    SharedWord, CFG_LPM_V4, CFG_LPM_V6, CFG_RULES, L4_ICMP, L4_ICMPV6, L4_OTHER, L4_SLOT_LEN, L4_TCP,
    L4_TCP_SYN, L4_UDP, LIMIT_BYTES, LIMIT_COARSE, LIMIT_GCRA, LIST_ALLOW,
    MAX_LIMITS, POOL_INDEX, RSTAT_ALLOW, RSTAT_DENY, RSTAT_LEN, RULE_ELASTIC, RULE_SHADOW, RULE_SLOTS,
    STAT_CONTENDED, STAT_NO_STATE,
};

use crate::{
    bans, buckets, frag,
    parse::{Frag, Packet, IPPROTO_ICMP, IPPROTO_ICMPV6, IPPROTO_TCP, IPPROTO_UDP},
    stats,
};

/// Runtime configuration, written by the daemon; the last write of a reload.
#[map(name = "RL_CONFIG")]
static RL_CONFIG: Array<DatapathConfig> = Array::with_max_entries(1, 0);

#[map(name = "RL_RULES")]
pub static RL_RULES: Array<RuleEntry> = Array::with_max_entries(2 * RULE_SLOTS, 0);

#[map(name = "RL_L4")]
static RL_L4: Array<u32> = Array::with_max_entries(2 * L4_SLOT_LEN, 0);

/// IPv4 first level in front of RL_LPM4 (rl_common::MAP_DIR16).
#[map(name = "RL_DIR16")]
static RL_DIR16: Array<u32> = Array::with_max_entries(2 * DIR16_LEN, 0);

#[map(name = "RL_LPM4")]
static RL_LPM4: LpmTrie<[u8; 5], u32> = LpmTrie::with_max_entries(2 * rl_common::LPM_SLOT_LEN, BPF_F_NO_PREALLOC);
#[map(name = "RL_LPM6")]
static RL_LPM6: LpmTrie<[u8; 17], u32> = LpmTrie::with_max_entries(2 * rl_common::LPM_SLOT_LEN, BPF_F_NO_PREALLOC);

#[map(name = "RL_DECIDE")]
static RL_DECIDE: HashMap<u64, u32> = HashMap::with_max_entries(2 * rl_common::DECIDE_SLOT_LEN, BPF_F_NO_PREALLOC);

/// "Limited" events for the daemon (rl_common::MAP_EVENTS).
#[map(name = "RL_EVENTS")]
static RL_EVENTS: RingBuf = RingBuf::with_byte_size(256 * 1024, 0);

/// The events budget's GCRA word (rl_common::MAP_EVENT_BUDGET).
#[map(name = "RL_EVBUDGET")]
static RL_EVBUDGET: Array<u64> = Array::with_max_entries(1, 0);

#[map(name = "RL_RSTATS")]
static RL_RSTATS: PerCpuArray<RuleStats> = PerCpuArray::with_max_entries(RSTAT_LEN, 0);

/// Per-CPU counts of rare events, used only to rate-limit their log lines.
#[map(name = "RL_LOG_SEEN")]
static RL_LOG_SEEN: PerCpuArray<u64> = PerCpuArray::with_max_entries(rl_common::STAT_COUNT, 0);

/// Benchmark only: when the loader sets this mask, every packet's source
/// is salted with a per-CPU counter under it (`src ^= counter & mask`), so
/// BPF_PROG_TEST_RUN can time paths over many sources with one repeated
/// frame: all ones for a new source every packet, `0xffff` for 65,536
/// sources in turn. It is a load-time constant: at 0 (always, outside
/// `cargo xtask bench`) the verifier removes the branch.
#[unsafe(no_mangle)]
static RL_BENCH_SALT_MASK: Global<u32> = Global::new(0);

#[map(name = "RL_BENCH")]
static RL_BENCH: PerCpuArray<u32> = PerCpuArray::with_max_entries(1, 0);

pub enum Verdict {
    Pass,
    Drop,
}

/// The active configuration, if the daemon has written one.
#[inline(always)]
pub fn config() -> Option<&'static DatapathConfig> {
    RL_CONFIG.get(0).filter(|c| c.enabled != 0)
}

/// Limits an IP packet and counts its verdict exactly once: in the per-rule
/// counters (rules, `[default]`, allow, deny), or in the global ones when no
/// rule set is installed yet. The daemon sums both for totals.
#[inline(always)]
pub fn limit(ctx: &XdpContext, pkt: &Packet, len: u64) -> Verdict {
    let Some(cfg) = config() else {
        // Not configured yet (the daemon attaches only after writing config).
        stats::passed(len, None);
        return Verdict::Pass;
    };
    let (slot, flags) = cfg.slot_flags();
    let mut src = pkt.src;
    let mask = RL_BENCH_SALT_MASK.load();
    if mask != 0 {
        if let Some(salt) = RL_BENCH.get_ptr_mut(0) {
            unsafe {
                *salt = (*salt).wrapping_add(1);
                src[3] ^= *salt & mask;
            }
        }
    }

    let entry = classify(slot, flags, pkt, &src);
    match entry {
        RSTAT_ALLOW => {
            count(RSTAT_ALLOW, len, Counted::Passed);
            Verdict::Pass
        }
        RSTAT_DENY => {
            count(RSTAT_DENY, len, Counted::Dropped);
            Verdict::Drop
        }
        _ => {
            let (mut entry, mut cost) = (entry, Cost { bytes: len, packets: 1 });
            if pkt.frag == Frag::Later {
                match frag::later(cfg, pkt, entry, len) {
                    frag::Later::Pass => return Verdict::Pass,
                    frag::Later::Drop => return Verdict::Drop,
                    frag::Later::Charge { entry: e, packets } => (entry, cost.packets) = (e, packets),
                }
            }
            let Some(rule) = RL_RULES.get(entry) else {
                stats::passed(len, None);
                return Verdict::Pass;
            };
            // Set aside only now: every fragment that gets this far is
            // charged, and `settled` then takes the key. A first fragment
            // sets its datagram's verdict; a later one charged under it
            // (not an orphan, charged as a packet) may break it.
            match pkt.frag {
                Frag::First => frag::stash(pkt, frag::FIRST),
                Frag::Later if cost.packets == 0 => frag::stash(pkt, frag::LATER),
                _ => {}
            }
            let counted = settle(ctx, cfg, rule, entry, pkt.is_v6, &src, cost);
            frag::settled(cfg, rule, entry, counted);
            match counted {
                Counted::Dropped => Verdict::Drop,
                _ => Verdict::Pass,
            }
        }
    }
}

/// The entry a packet counts under: [`RSTAT_ALLOW`], [`RSTAT_DENY`] or a
/// rule-table entry (the first matching rule in file order, precomputed).
#[inline(always)]
fn classify(slot: u32, flags: u32, pkt: &Packet, src: &[u32; 4]) -> u32 {
    // allow / deny / source class: one longest-prefix lookup.
    let mut src_class = 0;
    if let Some(v) = lpm(slot, flags, pkt.is_v6, src) {
        if CidrEntry::list(v) == LIST_ALLOW {
            return RSTAT_ALLOW;
        }
        if bans::denies(v, slot, pkt.is_v6, src) {
            return RSTAT_DENY;
        }
        src_class = CidrEntry::src_class(v);
    }
    let mut index = 0;
    if flags & CFG_RULES != 0 {
        if let Some(e) = RL_L4.get(slot * L4_SLOT_LEN + l4_index(pkt)) {
            index = L4Entry::first(*e) as u32;
            let class = L4Entry::class(*e);
            if class != 0 {
                if let Some(r) = unsafe { RL_DECIDE.get(&decide_key(slot, class, src_class)) } {
                    index = *r;
                }
            }
        }
    }
    slot * RULE_SLOTS + index
}

/// Charges `rule` and counts the verdict under its entry (a shadow rule's
/// drop is counted as such, and passed).
#[inline(always)]
#[allow(clippy::too_many_arguments)]
fn settle(
    ctx: &XdpContext,
    cfg: &DatapathConfig,
    rule: &RuleEntry,
    entry: u32,
    is_v6: bool,
    src: &[u32; 4],
    cost: Cost,
) -> Counted {
    let counted = match charge(ctx, cfg, rule, is_v6, src, cost) {
        Verdict::Pass => Counted::Passed,
        Verdict::Drop if rule.flags & RULE_SHADOW != 0 => Counted::Shadow,
        Verdict::Drop => Counted::Dropped,
    };
    count(entry, cost.bytes, counted);
    counted
}

#[inline(always)]
fn lpm(slot: u32, flags: u32, is_v6: bool, src: &[u32; 4]) -> Option<u32> {
    if is_v6 {
        if flags & CFG_LPM_V6 == 0 {
            return None;
        }
        RL_LPM6.get(&key6(slot, src)).copied()
    } else {
        if flags & CFG_LPM_V4 == 0 {
            return None;
        }
        // The source's /16 usually answers alone.
        let top = u32::from_be(src[3]) >> 16;
        let v = *RL_DIR16.get(slot * DIR16_LEN + top)?;
        if v & DIR16_LOOKUP == 0 {
            return Some(v);
        }
        RL_LPM4.get(&key4(slot, src)).copied()
    }
}

/// The trie key of an IPv4 source (in `src[3]`) in `slot`: all its bits.
#[inline(always)]
pub fn key4(slot: u32, src: &[u32; 4]) -> Key<[u8; 5]> {
    let b = src[3].to_ne_bytes();
    Key::new(8 + 32, [slot as u8, b[0], b[1], b[2], b[3]])
}

/// The trie key of an IPv6 source in `slot`: all its bits.
#[inline(always)]
pub fn key6(slot: u32, src: &[u32; 4]) -> Key<[u8; 17]> {
    let mut data = [0u8; 17];
    data[0] = slot as u8;
    for i in 0..4 {
        let b = src[i].to_ne_bytes();
        data[1 + 4 * i] = b[0];
        data[2 + 4 * i] = b[1];
        data[3 + 4 * i] = b[2];
        data[4 + 4 * i] = b[3];
    }
    Key::new(8 + 128, data)
}

#[inline(always)]
fn l4_index(pkt: &Packet) -> u32 {
    const SYN: u8 = 0x02;
    const ACK: u8 = 0x10;
    let port = pkt.dst_port as u32;
    match pkt.proto {
        IPPROTO_TCP if pkt.tcp_flags & (SYN | ACK) == SYN => L4_TCP_SYN + port,
        IPPROTO_TCP => L4_TCP + port,
        IPPROTO_UDP => L4_UDP + port,
        IPPROTO_ICMP => L4_ICMP,
        IPPROTO_ICMPV6 => L4_ICMPV6,
        _ => L4_OTHER,
    }
}

/// How a packet is counted; the values are `rl_common::FRAG_*`.
#[derive(Clone, Copy)]
#[repr(u32)]
pub enum Counted {
    Passed = rl_common::FRAG_PASSED,
    Dropped = rl_common::FRAG_DROPPED,
    Shadow = rl_common::FRAG_SHADOW,
}

/// What a packet costs: its bytes against byte limits, `packets` (1, or 0
/// for a later fragment, whose datagram its first fragment already
/// counted) against packet limits.
#[derive(Clone, Copy)]
pub struct Cost {
    pub bytes: u64,
    pub packets: u64,
}

#[inline(always)]
pub fn count(index: u32, len: u64, what: Counted) {
    if let Some(s) = RL_RSTATS.get_ptr_mut(index) {
        // Per-CPU entry: only this CPU writes it.
        let s = unsafe { &mut *s };
        match what {
            Counted::Passed => {
                s.passed_pkts += 1;
                s.passed_bytes += len;
            }
            Counted::Dropped => {
                s.dropped_pkts += 1;
                s.dropped_bytes += len;
            }
            Counted::Shadow => {
                s.shadow_pkts += 1;
                s.shadow_bytes += len;
            }
        }
    }
}

/// Charges the packet to every limit of `rule`; all must pass. They are checked first and charged only if
/// all would pass, so a packet dropped by one limit does not spend the
/// others (a race between the check and the charge can still spend an
/// earlier one: never more than the limits allow).
#[inline(always)]
#[allow(clippy::too_many_arguments)]
fn charge(
    ctx: &XdpContext,
    cfg: &DatapathConfig,
    rule: &RuleEntry,
    is_v6: bool,
    src: &[u32; 4],
    cost: Cost,
) -> Verdict {
    // A global rule's buckets hold both families in the IPv4 table.
    let is_v6 = rule.keys_v6(is_v6);
    let n = rule.n_limits as usize;
    if n == 1 {
        // The common case: one limit, no separate check.
        let Some(h) = buckets::bucket(cfg, rule, 0, is_v6, src) else {
            rare_event(ctx, STAT_NO_STATE);
            return Verdict::Drop;
        };
        let b = h.counts;
        let (verdict, t) = admit(ctx, cfg, &rule.limits[0], h.tat, cost);
        let verdict = match verdict {
            Verdict::Drop => over(ctx, cfg, rule, 0, is_v6, src, cost, t, b),
            Verdict::Pass => {
                decided(ctx, t, b, &verdict, rule, 0, is_v6, src);
                verdict
            }
        };
        buckets::count_in_cell(rule, is_v6, h.cell, matches!(verdict, Verdict::Pass));
        return verdict;
    }
    // Check every limit first (buckets are looked up again to charge them:
    // the verifier cannot track map pointers kept in a stack array).
    for i in 0..MAX_LIMITS {
        if i >= n {
            break;
        }
        // A key without a bucket of its own yet is not checked ahead: its
        // bucket is made (or its fallback found) when charged below.
        let Some(b) = buckets::existing(rule, i as u32, is_v6, src) else {
            continue;
        };
        let (limit, word) = (&rule.limits[i], Tat(unsafe { &raw mut (*b).tat_ns }).load());
        let over_at = sure_drop(cfg, limit, word, units(limit, cost))
            .or_else(|| step(cfg, limit, cost, word).is_none().then(|| now(cfg, limit)));
        if let Some(t) = over_at {
            return over(ctx, cfg, rule, i as u32, is_v6, src, cost, t, b);
        }
    }
    for i in 0..MAX_LIMITS {
        if i >= n {
            break;
        }
        let Some(h) = buckets::bucket(cfg, rule, i as u32, is_v6, src) else {
            return Verdict::Drop;
        };
        let b = h.counts;
        let (verdict, t) = admit(ctx, cfg, &rule.limits[i], h.tat, cost);
        if i + 1 == n || matches!(verdict, Verdict::Drop) {
            decided(ctx, t, b, &verdict, rule, i as u32, is_v6, src);
            buckets::count_in_cell(rule, is_v6, h.cell, matches!(verdict, Verdict::Pass));
        }
        if let Verdict::Drop = verdict {
            return Verdict::Drop;
        }
    }
    Verdict::Pass
}

/// A packet over limit `which` (bucket `b`, clock `t`): dropped, unless an
/// elastic rule's pool has room; counted in `b` either way.
#[inline(always)]
#[allow(clippy::too_many_arguments)]
fn over(
    ctx: &XdpContext,
    cfg: &DatapathConfig,
    rule: &RuleEntry,
    which: u32,
    is_v6: bool,
    src: &[u32; 4],
    cost: Cost,
    t: u64,
    b: *mut Bucket,
) -> Verdict {
    if rule.flags & RULE_ELASTIC == 0 {
        decided(ctx, t, b, &Verdict::Drop, rule, which, is_v6, src);
        return Verdict::Drop;
    }
    // `b` is not used past this point: the verifier then need not pair each
    // kind of bucket (own, prefix cell, last resort) with each kind of pool
    // bucket. It is looked up again to be counted.
    let verdict = elastic(ctx, cfg, rule, cost);
    if let Some(b) = buckets::existing(rule, which, is_v6, src) {
        decided(ctx, t, b, &verdict, rule, which, is_v6, src);
    }
    verdict
}

/// Counts the packet in the bucket that decided it (`t`: the time the
/// limit's clock read for it); a drop more than
/// LIMITED_GAP_NS after this bucket's previous one starts a "limited"
/// episode and may raise an event.
#[inline(always)]
#[allow(clippy::too_many_arguments)]
fn decided(
    ctx: &XdpContext,
    t: u64,
    b: *mut Bucket,
    verdict: &Verdict,
    rule: &RuleEntry,
    which: u32,
    is_v6: bool,
    src: &[u32; 4],
) {
    unsafe {
        match verdict {
            Verdict::Pass => (*b).passed += crate::frag::passes(),
            Verdict::Drop => {
                (*b).dropped += 1;
                let last = (*b).last_drop_ns;
                // On the tick clock most drops of a flood see the same time:
                // no store then. A drop a token bucket on ktime decided by
                // the tick clock reads up to a tick earlier than one it
                // decided by ktime: the later time stays.
                if t > last {
                    (*b).last_drop_ns = t;
                    if t - last > LIMITED_GAP_NS {
                        limited(ctx, t, rule, which, is_v6, src);
                    }
                }
            }
        }
    }
}

/// Sends a "limited" event if the kernel-side budget (a token bucket on one
/// shared word) allows it. Out of line: at most once per source per episode.
#[inline(never)]
fn limited(ctx: &XdpContext, t: u64, rule: &RuleEntry, which: u32, is_v6: bool, src: &[u32; 4]) {
    let Some(word) = RL_EVBUDGET.get_ptr_mut(0) else {
        return;
    };
    if !matches!(admit_with(&Tat(word), |w| gcra(w, t, &EVENT_BUDGET)), Admit::Pass) {
        stats::bump(STAT_EVENTS_SUPPRESSED);
        return;
    }
    // The source as the bucket keys it.
    let mut event = Event { at_ns: t, rule: 0, family: 4, addr: [0; 16] };
    if is_v6 {
        let key = rule.key6(which, src);
        (event.rule, event.family, event.addr) = (key.rule, 6, key.addr_bytes());
    } else {
        let key = rule.key4(which, src[3]);
        event.rule = key.rule;
        event.addr[..4].copy_from_slice(&key.addr_bytes());
    }
    if RL_EVENTS.output::<Event>(&event, 0).is_ok() {
        stats::bump(STAT_EVENTS);
    } else {
        rare_event(ctx, STAT_EVENTS_SUPPRESSED);
    }
}

/// An elastic rule lets a key that is over its own limit through while the
/// rule's shared pool has room; otherwise the drop stands.
#[inline(always)]
fn elastic(ctx: &XdpContext, cfg: &DatapathConfig, rule: &RuleEntry, cost: Cost) -> Verdict {
    if rule.flags & RULE_ELASTIC == 0 {
        return Verdict::Drop;
    }
    // One pool for the rule, both families (address 0 in the IPv4 table).
    let Some(h) = buckets::bucket(cfg, rule, POOL_INDEX, false, &[buckets::opaque_zero(); 4]) else {
        return Verdict::Drop;
    };
    // The pool lends a packet to every frame it lets through: a later
    // fragment (counted as no packet, its datagram at its first) over a
    // byte limit costs it one too (asked for 0, a spent pool passed it).
    admit(ctx, cfg, &rule.pool, h.tat, Cost { packets: 1, ..cost }).0
}

/// The limit's clock: the inlined tick clock when it suits the limit.
#[inline(always)]
pub fn now(cfg: &DatapathConfig, limit: &LimitEntry) -> u64 {
    if limit.kind & LIMIT_COARSE != 0 {
        cfg.clock.at(unsafe { bpf_jiffies64() })
    } else {
        unsafe { bpf_ktime_get_ns() }
    }
}

/// The time on the tick clock, for what needs no better than a tick (the
/// flood detector's windows, fragments' expiry): one inlined load, no
/// helper call (each call and return is dear with this CPU's return-stack
/// mitigation). Without a measured tick (the daemon warned at load) the
/// tick clock stands still: ktime then.
#[inline(always)]
pub fn tick_now(cfg: &DatapathConfig) -> u64 {
    if cfg.clock.tick_ns != 0 {
        cfg.clock.at(unsafe { bpf_jiffies64() })
    } else {
        unsafe { bpf_ktime_get_ns() }
    }
}

/// What a packet counts against a limit: one packet, or its bytes.
#[inline(always)]
fn units(limit: &LimitEntry, cost: Cost) -> u64 {
    if limit.kind & LIMIT_BYTES != 0 {
        cost.bytes
    } else {
        cost.packets
    }
}

/// A token bucket on ktime first asks the tick clock whether its packet
/// drops even at the latest time the tick may stand for: a flood over the
/// limit is then dropped without the helper call, and exactly as ktime
/// would have it (`LimitEntry::drops_until`). The time of such a drop:
/// the tick's start.
#[inline(always)]
fn sure_drop(cfg: &DatapathConfig, limit: &LimitEntry, word: u64, units: u64) -> Option<u64> {
    if limit.kind & (0xff | LIMIT_COARSE) != LIMIT_GCRA || cfg.clock.tick_ns == 0 {
        return None;
    }
    let jiffies = unsafe { bpf_jiffies64() };
    limit.drops_until(word, cfg.clock.latest(jiffies), units).then(|| cfg.clock.at(jiffies))
}

/// One limit's step on its state word, for the read-only check of
/// multi-limit rules.
#[inline(always)]
fn step(cfg: &DatapathConfig, limit: &LimitEntry, cost: Cost, word: u64) -> Option<u64> {
    limit.step(word, now(cfg, limit), cfg.epoch_offset_ns, units(limit, cost))
}

/// Charges one limit: the clock is read once, then the algorithm's
/// compare-and-swap loop runs.
#[inline(always)]
fn admit(ctx: &XdpContext, cfg: &DatapathConfig, limit: &LimitEntry, tat: *mut u64, cost: Cost) -> (Verdict, u64) {
    let cell = Tat(tat);
    let u = units(limit, cost);
    if let Some(t) = sure_drop(cfg, limit, cell.load(), u) {
        return (Verdict::Drop, t);
    }
    let t = now(cfg, limit);
    let outcome = match limit.kind & 0xff {
        LIMIT_GCRA => admit_with(&cell, |w| limit.gcra_step(w, t, u)),
        _ => admit_window(cfg, limit, &cell, t, u),
    };
    let verdict = match outcome {
        Admit::Pass => Verdict::Pass,
        Admit::Drop => Verdict::Drop,
        Admit::Contended => {
            rare_event(ctx, STAT_CONTENDED);
            Verdict::Drop
        }
    };
    (verdict, t)
}

/// Window limits, out of line: a BPF-to-BPF call costs a few ns, and keeping
/// their code out of the token-bucket path keeps that path's registers free.
#[inline(never)]
fn admit_window(cfg: &DatapathConfig, limit: &LimitEntry, cell: &Tat, t: u64, units: u64) -> Admit {
    admit_with(cell, |w| limit.window_step(w, t, cfg.epoch_offset_ns, units))
}

/// A bucket's state word. It lives in map memory shared by all CPUs, so it
/// is only read whole and only changed by compare-and-swap.
struct Tat(*mut u64);

impl SharedWord for Tat {
    #[inline(always)]
    fn load(&self) -> u64 {
        unsafe { core::ptr::read_volatile(self.0) }
    }

    #[inline(always)]
    fn compare_exchange(&self, current: u64, new: u64) -> Result<u64, u64> {
        // BPF_ATOMIC | BPF_CMPXCHG (needs BPF CPU v3, set by `cargo xtask build`).
        let (seen, ok) = unsafe {
            atomic_cxchg::<u64, { AtomicOrdering::SeqCst }, { AtomicOrdering::SeqCst }>(
                self.0, current, new,
            )
        };
        if ok {
            Ok(seen)
        } else {
            Err(seen)
        }
    }
}

/// Counts a rare event and logs it at the 1st, 2nd, 4th, 8th… occurrence on
/// this CPU, so a storm of them costs a handful of log records, not one each.
/// Out of line: the logging code is large and never on the hot path.
#[inline(never)]
fn rare_event(ctx: &XdpContext, stat: u32) {
    stats::bump(stat);
    if let Some(seen) = RL_LOG_SEEN.get_ptr_mut(stat) {
        let n = unsafe {
            *seen += 1;
            *seen
        };
        if n & (n - 1) == 0 {
            debug!(ctx, "rl: event {} seen {} times on this cpu", stat, n);
        }
    }
}
