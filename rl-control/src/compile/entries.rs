//! Rule and limit entries: a rule's limits as the datapath's arithmetic
//! reads them (rates to nanoseconds per packet or byte, bursts to spans).

use super::*;

/// The prefix lengths (IPv4, IPv6) that key rule `r`'s buckets, with
/// `[datapath]`'s default prefixes: 0 for a global key.
pub fn key_prefixes(r: &Rule, v4_default: u8, v6_default: u8) -> (u8, u8) {
    match r.key {
        KeyScope::Source => (v4_default, v6_default),
        KeyScope::Prefix { v4, v6 } => (v4, v6),
        KeyScope::Global => (0, 0),
    }
}

/// What rule `r`'s buckets mean, hashed into its id: the rule (matching
/// fields too: a rule that now matches other traffic starts fresh) and the
/// prefixes that key it. Its `src` and `dst_ports` hash as listed: taking
/// them as sets would change the ids of rules listed out of order, and an
/// upgrade would hand their keys a fresh burst.
pub(super) fn rule_definition(r: &Rule, v4_default: u8, v6_default: u8) -> (&Rule, u8, u8) {
    let (v4, v6) = key_prefixes(r, v4_default, v6_default);
    (r, v4, v6)
}

/// The datapath's entry for rule `r` (its bucket id, masks and limits as
/// written), with `[datapath]`'s default prefixes.
pub fn rule_entry(r: &Rule, v4_default: u8, v6_default: u8) -> RuleEntry {
    let definition = rule_definition(r, v4_default, v6_default);
    let (_, v4, v6) = definition;
    let id = stable_id(&definition);
    let mut limits = [LimitEntry::default(); MAX_LIMITS];
    for (slot, l) in limits.iter_mut().zip(&r.limits) {
        *slot = limit_entry(r.algorithm, l.unit, &l.enforced(r.mode));
    }
    let mut flags = 0;
    if r.action == Action::Shadow {
        flags |= RULE_SHADOW;
    }
    let mut pool = LimitEntry::default();
    if let Mode::Elastic { pool: p } = r.mode {
        flags |= RULE_ELASTIC;
        pool = gcra(Unit::Packets, &p);
    }
    if r.scope == crate::config::rules::Scope::Cluster {
        flags |= rl_common::RULE_CLUSTER;
    }
    if (v4, v6) == (0, 0) {
        // One key for all its traffic, both families.
        flags |= rl_common::RULE_GLOBAL;
    }
    RuleEntry {
        id,
        flags,
        n_limits: r.limits.len() as u32,
        v4_mask: if v4 == 0 {
            0
        } else {
            prefix_mask_words::<1>(v4)[0]
        },
        v6_mask: if v6 == 0 {
            [0; 4]
        } else {
            prefix_mask_words::<4>(v6)
        },
        limits,
        pool,
    }
}

/// The datapath's (and the request buckets') form of one limit.
pub fn limit_entry(algorithm: Algorithm, unit: Unit, rate: &Rate) -> LimitEntry {
    match algorithm {
        Algorithm::TokenBucket => gcra(unit, rate),
        Algorithm::FixedWindow => window(LIMIT_FIXED, rl_common::window::FIXED_MAX, unit, rate),
        Algorithm::SlidingWindow => {
            window(LIMIT_SLIDING, rl_common::window::SLIDING_MAX, unit, rate)
        }
    }
}

/// A token bucket: GCRA with ns per unit in fixed point, as fine as fits
/// (a 64 KiB packet times the cost must stay below 2⁶³). The cost rounds up
/// (never looser than written) and the bucket holds exactly `burst` units of it, the arithmetic
/// of [`rl_common::Limit`] (for packets, `shift = 0`, the very same values).
pub(super) fn gcra(unit: Unit, rate: &Rate) -> LimitEntry {
    let per_ns = rate.per_secs as u128 * NS;
    let amount = rate.amount as u128;
    let mut shift = 0;
    let cost = |s: u32| (per_ns << s).div_ceil(amount);
    if unit == Unit::Bytes {
        while shift < 32 && cost(shift + 1) * 65_536 < (1u128 << 63) {
            shift += 1;
        }
    }
    let a = cost(shift).max(1);
    let b = ((a * rate.burst as u128) >> shift).min(u64::MAX as u128 / 2);
    LimitEntry {
        kind: LIMIT_GCRA | if unit == Unit::Bytes { LIMIT_BYTES } else { 0 },
        shift,
        a: a.min(u64::MAX as u128 / 2) as u64,
        b: b as u64,
    }
}

/// A window counter; byte caps above what the word holds count in units of
/// `2^shift` bytes.
pub(super) fn window(kind: u32, cap: u64, unit: Unit, rate: &Rate) -> LimitEntry {
    let mut shift = 0;
    while rate.amount >> shift > cap {
        shift += 1;
    }
    // Packets and requests never count in units of several (validation
    // keeps them within the cap): only bytes do.
    debug_assert!(
        shift == 0 || unit == Unit::Bytes,
        "a packet window over its cap"
    );
    LimitEntry {
        kind: kind | if unit == Unit::Bytes { LIMIT_BYTES } else { 0 },
        shift,
        a: rate.per_secs * NS as u64,
        b: rate.amount >> shift,
    }
}
