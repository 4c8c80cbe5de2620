//! One charge of one request bucket, under its shard's lock: the packet
//! algorithms with rl-common's step functions (all of a rule's limits or
//! none) and `quota` for the headers, the sliding log, the semaphore.

use rl_common::{quota, quota::ceil_ms, LimitEntry};

use super::{
    engine::{Bucket, Compiled, Status},
    rules::L7Algorithm,
    runs::Runs,
};
use crate::config::rules::{Action, Algorithm};

const NS: u64 = 1_000_000_000;

/// One charge under the shard lock.
pub(super) fn charge(c: &Compiled, bucket: &mut Bucket, now: u64, hits: i64, epoch: u64) -> Status {
    let rule = &c.rule;
    let base = Status {
        code: "ok",
        rule: rule.name.clone(),
        limit: 0,
        per_secs: 0,
        remaining: 0,
        reset_ms: 0,
        retry_after_ms: 0,
        shadow: false,
        enforced: rule.action != Action::Shadow,
    };
    let st = match (bucket, rule.algorithm) {
        (Bucket::One(word), L7Algorithm::Packet(a)) => {
            packet_charge(c, a, std::slice::from_mut(word), now, hits, epoch, base)
        }
        (Bucket::Words(words), L7Algorithm::Packet(a)) => {
            packet_charge(c, a, words, now, hits, epoch, base)
        }
        (Bucket::Log(logs), _) => log_charge(c, logs, now, hits, base),
        (Bucket::Leases(leases), L7Algorithm::Concurrency { max, lease_secs }) => {
            lease_charge(leases, max, lease_secs, now, hits, base)
        }
        _ => unreachable!("a bucket is made for its rule's algorithm"),
    };
    st.for_hits(hits)
}

/// The sliding log: a hit's times kept per limit for a window; the
/// request fits if every limit's log has room for it.
fn log_charge(c: &Compiled, logs: &mut [Runs], now: u64, hits: i64, base: Status) -> Status {
    let rule = &c.rule;
    let units = hits.max(0) as u64;
    for (log, l) in logs.iter_mut().zip(&rule.limits) {
        let window = l.rate.per_secs * NS;
        log.expire(|t| t + window <= now);
        // A refund takes back the oldest hits: which hits it gives back is
        // not known, and the oldest were to leave first anyway (taking the
        // newest would make room a request still in the window had taken).
        log.take_oldest(hits.min(0).unsigned_abs());
    }
    let fits = logs
        .iter()
        .zip(&rule.limits)
        .all(|(log, l)| log.len() + units <= l.rate.amount);
    if fits {
        for log in logs.iter_mut() {
            log.push(now, units);
        }
    } else if c.rule.drain && units > 0 {
        // `drain_over_limit`: every log filled up to its rate, now.
        for (log, l) in logs.iter_mut().zip(&rule.limits) {
            log.push(now, l.rate.amount.saturating_sub(log.len()));
        }
    }
    let (log, l) = logs
        .iter()
        .zip(&rule.limits)
        .min_by_key(|(log, l)| l.rate.amount.saturating_sub(log.len()))
        .expect("a rule has a limit");
    let window = l.rate.per_secs * NS;
    let remaining = l.rate.amount.saturating_sub(log.len());
    let newest = log.newest().map_or(0, |t| (t + window).saturating_sub(now));
    // When the request (over) or one more fits under every limit.
    let wanted = if fits { 1 } else { units.max(1) };
    let retry = logs
        .iter()
        .zip(&rule.limits)
        .map(|(log, l)| log.until_room(l.rate.per_secs * NS, l.rate.amount, wanted, now))
        .max()
        .unwrap_or(0);
    Status {
        code: if fits { "ok" } else { "over_limit" },
        limit: l.rate.amount,
        per_secs: l.rate.per_secs,
        remaining,
        reset_ms: ceil_ms(newest),
        retry_after_ms: ceil_ms(retry),
        ..base
    }
}

/// The semaphore: up to `max` leases held at once, each for `lease_secs`
/// unless given back (negative hits release the oldest). `leases` holds
/// the times they were taken.
fn lease_charge(
    leases: &mut Runs,
    max: u64,
    lease_secs: u64,
    now: u64,
    hits: i64,
    base: Status,
) -> Status {
    let life = lease_secs * NS;
    leases.expire(|t| t + life <= now);
    let ok = if hits < 0 {
        // A refund releases the oldest permits.
        leases.take_oldest(hits.unsigned_abs());
        true
    } else if leases.len() + hits as u64 <= max {
        leases.push(now, hits as u64);
        true
    } else {
        false
    };
    let remaining = max.saturating_sub(leases.len());
    let wanted = if ok { 1 } else { hits.max(1) as u64 };
    Status {
        code: if ok { "ok" } else { "over_limit" },
        limit: max,
        per_secs: lease_secs,
        remaining,
        reset_ms: ceil_ms(
            leases
                .newest()
                .map_or(0, |t| (t + life).saturating_sub(now)),
        ),
        retry_after_ms: ceil_ms(leases.until_room(life, max, wanted, now)),
        ..base
    }
}

/// A packet-algorithm charge: every limit's step must pass, or nothing
/// changes; the status speaks for the tightest limit.
fn packet_charge(
    c: &Compiled,
    a: Algorithm,
    words: &mut [u64],
    now: u64,
    hits: i64,
    epoch: u64,
    base: Status,
) -> Status {
    let rule = &c.rule;
    let units = hits.max(0) as u64;
    let step = |l: &LimitEntry, w: u64| match a {
        Algorithm::TokenBucket => l.gcra_step_checked(w, now, units),
        _ => l.window_step(w, now, epoch, units),
    };
    let next: Option<Vec<u64>> = c
        .limits
        .iter()
        .zip(words.iter())
        .map(|(l, w)| match hits {
            // A refund: every limit gets them back.
            ..0 => Some(l.refund(*w, now, epoch, hits.unsigned_abs())),
            0 => Some(*w),
            _ => step(l, *w),
        })
        .collect();
    let over = next.is_none();
    if let Some(n) = next {
        words.copy_from_slice(&n);
    } else if rule.drain && units > 0 {
        // `drain_over_limit`: every limit emptied, now (never refilled:
        // a limit further behind stays as it is).
        for (l, w) in c.limits.iter().zip(words.iter_mut()) {
            *w = l.merge(*w, l.drained(now, epoch), now, epoch);
        }
    }
    // The headers speak for the tightest limit; the retry time is when
    // one more (or, over, all of the hits) fits under every limit: limits
    // out of room at once may free up at different times.
    let (mut tightest, mut retry_ns) = (None::<(usize, rl_common::quota::Quota)>, 0);
    for (i, (l, w)) in c.limits.iter().zip(words.iter()).enumerate() {
        let q = quota(l, *w, now, epoch);
        retry_ns = retry_ns.max(q.retry_after_ns);
        if tightest.is_none_or(|(_, t)| q.remaining < t.remaining) {
            tightest = Some((i, q));
        }
    }
    let (i, q) = tightest.expect("a rule has a limit");
    if over && units > 1 {
        retry_ns = c
            .limits
            .iter()
            .zip(words.iter())
            .map(|(l, w)| rl_common::quota::wait_for(l, *w, now, epoch, units))
            .max()
            .unwrap_or(0);
    }
    Status {
        code: if over { "over_limit" } else { "ok" },
        limit: rule.limits[i].rate.amount,
        per_secs: rule.limits[i].rate.per_secs,
        remaining: q.remaining,
        reset_ms: ceil_ms(q.reset_ns),
        retry_after_ms: ceil_ms(retry_ns),
        ..base
    }
}
