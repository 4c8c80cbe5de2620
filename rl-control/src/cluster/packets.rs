//! Packet rules with `scope = "cluster"`: Redis stays off the packet path.
//!
//! Every host enforces in XDP from its own token buckets, each allowed the
//! rule's whole rate. Every `sync_interval` the daemon reports the packets
//! its hot buckets passed since the last report (one script call per batch
//! of up to 1,000, per hash slot on a Redis Cluster); Redis charges them to the bucket's cluster-wide token
//! bucket on its own clock and answers how far ahead of now that bucket
//! is; the daemon moves its own bucket up to it (never down: its own
//! packets are in both). So every bucket sees every host's packets, its own
//! at once and the others' within `T + δ`, and no share of the rate is ever
//! stranded on an idle host.
//!
//! Overshoot bound, for `N` hosts, rate `R`, burst `B`, `T` the sync
//! interval, `δ` Redis' round trip and `θ` the hot threshold: over any span
//! `τ`, the hosts together pass at most
//! `R·τ + N·B + (N−1)·R·(T+δ) + N·θ` packets of one key: each host may
//! spend its own burst, and each other host's rate for as long as its
//! report is on the way; a bucket travels once its unreported packets reach
//! `θ = max(1, R·T/4)` or it drops.

use std::{collections::HashMap, sync::LazyLock};

use redis::Script;

use super::{Cluster, Failure};
use crate::datapath::share::{BucketId, SharedBucket};

static SYNC: LazyLock<Script> = LazyLock::new(|| Script::new(include_str!("sync.lua")));

/// Hash slots a rule's buckets spread over in a Redis Cluster (one script
/// call per slot per round there; one server takes a rule's buckets in one
/// call per [`LINES_PER_CALL`]).
pub const SHARDS: u64 = 16;

/// A cluster limit as the datapath numbers it (`RuleEntry::id | index`).
#[derive(Clone, Debug)]
pub struct Share {
    pub rule: String,
    /// The rule's definition hash: hosts with another definition never
    /// share its buckets.
    pub definition: u64,
    pub which: u32,
    pub ns_per_packet: u64,
    pub burst_ns: u64,
}

pub type Shares = HashMap<u32, Share>;

/// What this daemon last acknowledged of one bucket.
#[derive(Clone, Copy, Debug)]
struct Tracked {
    passed: u64,
    dropped: u64,
    /// Packets this daemon run reported for it in total.
    cum: u64,
    at_ns: u64,
    /// When the bucket was last in the tables.
    seen_ns: u64,
    /// Packets its collected incarnations passed past what was reported:
    /// they travel with its next report.
    carry: u64,
    /// When the collector last recorded its delete: it lived, so it is
    /// kept as long as a bucket seen then.
    recorded_ns: u64,
}

/// One bucket's line in a report to Redis (packet and batched request
/// buckets alike).
#[derive(Clone, Debug)]
pub struct Line {
    /// The bucket's Redis key; `slot` is its hash tag (one call per slot).
    pub key: String,
    pub slot: String,
    /// Units this daemon run reported in total, this one included.
    pub cum: u64,
    /// Units since the last acknowledged report.
    pub delta: u64,
    pub ns_per_unit: u64,
    /// The units passed during this span (the cluster bucket charges them
    /// from its start).
    pub interval_ns: u64,
}

/// One bucket's report in a round.
#[derive(Clone, Debug)]
pub struct Report {
    pub id: BucketId,
    pub line: Line,
    passed: u64,
    dropped: u64,
}

/// Counts for `/metrics`.
#[derive(Clone, Copy, Debug, Default)]
pub struct SyncStats {
    pub rounds: u64,
    pub reported_keys: u64,
    pub calls: u64,
    /// Buckets moved up to their cluster bucket.
    pub raised: u64,
    /// Buckets of cluster rules seen in the last round / reported in it.
    pub buckets: u64,
    pub hot: u64,
}

/// This daemon run's side of the exchange.
pub struct Ledger {
    reporter: String,
    /// Every bucket reported, with its cumulative count: kept while Redis
    /// may still hold that count (a bucket the collector deleted and the
    /// datapath made again counts from zero in the kernel, never here).
    tracked: HashMap<BucketId, Tracked>,
    forget_after_ns: u64,
    /// Whether the collector's records since the last round's reports are
    /// complete (see [`Ledger::collected`]); `None` until the first. Without
    /// them a bucket missing from a round is taken as collected.
    complete: Option<bool>,
    /// Whether the next round takes the tables' counts as reported (see
    /// [`Ledger::from_the_tables`]).
    baseline: bool,
    /// Every packet this run reported, summed: a bucket tracked anew (never
    /// reported, or forgotten while Redis kept its ledger) counts on from
    /// here, so its count is above any this run sent for it before and
    /// Redis charges its packets in full (a count below Redis' ledger is a
    /// stale report, charged nothing).
    base: u64,
    pub stats: SyncStats,
}

impl Ledger {
    /// A ledger reporting as `node` (a restarted daemon reports under a new
    /// name, so its counts start again without being taken for old ones).
    /// `keep_ms`: how long Redis keeps a bucket's ledger after its last
    /// report (this side keeps its counts twice as long).
    pub fn new(node: &str, keep_ms: u64) -> Ledger {
        let boot = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map_or(0, |d| d.as_millis());
        Ledger {
            reporter: format!("{node}:{boot}"),
            tracked: HashMap::new(),
            forget_after_ns: 2 * keep_ms * 1_000_000,
            complete: None,
            baseline: false,
            base: 0,
            stats: SyncStats::default(),
        }
    }

    /// For a daemon that adopted pinned tables: their buckets' counts are
    /// lifetime counts, which the runs before reported up to their last
    /// round. Its first round takes them as reported (under this run's
    /// new name, from 0), so that a restart does not charge Redis again
    /// for every recently active source (up to `2·R·T + B` each: a
    /// blackout on every host); what passed between that last round and
    /// the restart goes unreported (one interval's worth at most).
    pub fn from_the_tables(mut self) -> Ledger {
        self.baseline = true;
        self
    }

    /// Takes the collector's records of deleted buckets (see
    /// [`Collected`](crate::datapath::share::Collected)), made under the
    /// lock this round's scan of the tables was made under: a tracked one
    /// counts from zero from now on, and what it passed past its last
    /// report is carried to its next one. A bucket never reported is
    /// tracked from its record (up to [`TRACKED_FROM_RECORDS`] buckets),
    /// so that what its lives pass under `θ` each still adds up to a
    /// report. `complete`: no record was dropped before these.
    pub fn collected(&mut self, records: &[SharedBucket], complete: bool, now: u64) {
        for r in records {
            let passed = r.bucket.passed;
            let room = self.tracked.len() < TRACKED_FROM_RECORDS;
            match self.tracked.get_mut(&r.id) {
                Some(t) => {
                    t.carry += passed.saturating_sub(t.passed);
                    (t.passed, t.dropped, t.recorded_ns) = (0, 0, now);
                }
                None if passed > 0 && room => {
                    self.tracked.insert(
                        r.id,
                        Tracked {
                            passed: 0,
                            dropped: 0,
                            cum: self.base,
                            at_ns: 0,
                            seen_ns: 0,
                            carry: passed,
                            recorded_ns: now,
                        },
                    );
                }
                None => {}
            }
        }
        self.complete = Some(self.complete.unwrap_or(true) && complete);
    }

    /// The buckets that travel this round: those whose unreported packets
    /// (carried ones included, for a bucket not made again too) reach `θ`,
    /// or that dropped since the last report. A report is capped at what the
    /// bucket could pass in two intervals (`2·R·T + B`): usage during an
    /// outage (`on_failure = "open"`, say) is not charged in full when
    /// Redis is back.
    pub fn reports(
        &mut self,
        buckets: &[SharedBucket],
        shares: &Shares,
        interval_ns: u64,
        now: u64,
    ) -> Vec<Report> {
        if std::mem::take(&mut self.baseline) {
            // (Bounded as the records' tracking is: past it, a bucket
            // reports its count, capped as any.)
            for sb in buckets
                .iter()
                .filter(|sb| shares.contains_key(&sb.id.limit()))
                .take(TRACKED_FROM_RECORDS)
            {
                let (passed, dropped) = (sb.bucket.passed, sb.bucket.dropped);
                self.tracked.insert(
                    sb.id,
                    Tracked {
                        passed,
                        dropped,
                        cum: self.base,
                        at_ns: now,
                        seen_ns: now,
                        carry: 0,
                        recorded_ns: 0,
                    },
                );
            }
            return Vec::new();
        }
        let mut out = Vec::new();
        let mut seen = 0;
        for sb in buckets {
            let Some(share) = shares.get(&sb.id.limit()) else {
                continue;
            };
            seen += 1;
            let t = self.tracked.get_mut(&sb.id).map(|t| {
                t.seen_ns = now;
                *t
            });
            if let Some(r) = report(sb.id, &sb.bucket, t, share, interval_ns, now, self.base) {
                self.base += r.line.delta;
                out.push(r);
            }
        }
        // Collected with packets unreported, and not made again (yet): they
        // travel once they reach θ, as a live bucket's.
        let absent: Vec<(BucketId, Tracked)> = self
            .tracked
            .iter()
            .filter(|(_, t)| t.carry > 0 && t.seen_ns != now)
            .map(|(id, t)| (*id, *t))
            .collect();
        for (id, t) in absent {
            if let Some(share) = shares.get(&id.limit()) {
                if let Some(r) = report(
                    id,
                    &rl_common::Bucket::default(),
                    Some(t),
                    share,
                    interval_ns,
                    now,
                    self.base,
                ) {
                    self.base += r.line.delta;
                    out.push(r);
                }
            }
        }
        // Without complete records, a tracked bucket of a shared rule that
        // is not in the tables is taken as collected: made again, it counts
        // from zero in the kernel. (Told only by its count going down, one
        // that passed its old count again before the next round would leave
        // that many packets unreported.) With them this is not needed, and
        // would be wrong for a prefix cell the collector is freeing: out of
        // the scans for a moment, it may live on with its count.
        let (forget, complete) = (self.forget_after_ns, self.complete == Some(true));
        self.complete = self.complete.map(|_| true);
        self.tracked.retain(|id, t| {
            if !complete && t.seen_ns != now && shares.contains_key(&id.limit()) {
                (t.passed, t.dropped) = (0, 0);
            }
            now.saturating_sub(t.seen_ns.max(t.at_ns).max(t.recorded_ns)) < forget
        });
        self.stats.buckets = seen;
        self.stats.hot = out.len() as u64;
        out
    }

    /// Sends `reports` (see [`exchange`]).
    pub async fn exchange(
        &mut self,
        cluster: &Cluster,
        reports: &[Report],
        keep_ms: u64,
    ) -> (Vec<(usize, u64)>, Option<Failure>) {
        let lines: Vec<&Line> = reports.iter().map(|r| &r.line).collect();
        let (answers, failure, calls) = exchange(cluster, &self.reporter, &lines, keep_ms).await;
        self.stats.calls += calls;
        (answers, failure)
    }

    /// Records that Redis holds `r`.
    pub fn acknowledge(&mut self, r: &Report, now: u64) {
        self.tracked.insert(
            r.id,
            Tracked {
                passed: r.passed,
                dropped: r.dropped,
                cum: r.line.cum,
                at_ns: now,
                seen_ns: now,
                carry: 0,
                recorded_ns: 0,
            },
        );
        self.stats.reported_keys += 1;
    }
}

/// Most buckets tracked when a record of a bucket never reported would
/// add one (a spoofed flood on a cluster rule makes and collects a bucket
/// per source): past it such records are let go, as before records.
pub const TRACKED_FROM_RECORDS: usize = 1 << 18;

/// The report of bucket `id` holding `b` (tracked as `t`; if not, its
/// count starts at the run's `base`), if it travels this round.
fn report(
    id: BucketId,
    b: &rl_common::Bucket,
    t: Option<Tracked>,
    share: &Share,
    interval_ns: u64,
    now: u64,
    base: u64,
) -> Option<Report> {
    // Only reported buckets are tracked: the rest have reported nothing,
    // so all they passed is unreported.
    let (passed0, dropped0, cum0, carry) = match t {
        Some(t) if b.passed >= t.passed => (t.passed, t.dropped, t.cum, t.carry),
        // A bucket collected and made again counts from zero in the
        // kernel; its reports go on from the count Redis holds.
        Some(t) => (0, 0, t.cum, t.carry),
        None => (0, 0, base, 0),
    };
    let mut delta = b.passed - passed0 + carry;
    let theta = (interval_ns / share.ns_per_packet.max(1) / 4).max(1);
    if delta < theta && b.dropped <= dropped0 {
        return None;
    }
    // What the bucket could pass in (at most) two intervals: a report
    // after an outage charges no more.
    let span = t.map_or(2 * interval_ns, |t| {
        now.saturating_sub(t.at_ns).min(2 * interval_ns)
    });
    delta = delta.min((span + share.burst_ns) / share.ns_per_packet.max(1) + 1);
    let addr = id.addr_bytes();
    let shard = crate::compile::stable_hash(&addr, 0) % SHARDS;
    let mut hex: String = addr.iter().map(|b| format!("{b:02x}")).collect();
    if rl_common::key_kind(id.rule()) == rl_common::KeyKind::Cell {
        // A prefix cell and a source's own bucket may share an address.
        hex.push_str("/cell");
    }
    let slot = format!(
        "{}:{:016x}:{}:{shard}",
        share.rule, share.definition, share.which
    );
    Some(Report {
        id,
        line: Line {
            key: format!("rl:p:{{{slot}}}:{hex}"),
            slot,
            cum: cum0 + delta,
            delta,
            ns_per_unit: share.ns_per_packet,
            interval_ns,
        },
        passed: b.passed,
        dropped: b.dropped,
    })
}

/// Most buckets in one script call: Redis runs a script alone, so a call
/// is kept to a few milliseconds.
pub const LINES_PER_CALL: usize = 1_000;

/// Sends `lines` as `reporter` (a daemon run's name): one script call per
/// [`LINES_PER_CALL`] buckets of one rule (and, on a Redis Cluster, one hash
/// slot); returns, per line index, until when its cluster bucket is ahead
/// (monotonic ns: the time its call was answered plus how far ahead Redis
/// said it was; 0 when not ahead), the failure that stopped the round if
/// one did (the cluster is then degraded: the lines not answered travel
/// again, and are charged once), and the calls made. A call's answer is
/// dated when it arrives, not when the round's raises are written: those
/// wait for the round's other calls.
pub async fn exchange(
    cluster: &Cluster,
    reporter: &str,
    lines: &[&Line],
    keep_ms: u64,
) -> (Vec<(usize, u64)>, Option<Failure>, u64) {
    // A call charges every line at one cost and interval: group by rule
    // (the slot names it), and by slot only where slots matter.
    let one_server = !cluster.config.is_redis_cluster();
    let mut groups: HashMap<(&str, u64, u64), Vec<usize>> = HashMap::new();
    for (i, l) in lines.iter().enumerate() {
        let slot = if one_server { "" } else { l.slot.as_str() };
        groups
            .entry((slot, l.ns_per_unit, l.interval_ns))
            .or_default()
            .push(i);
    }
    let mut answers = Vec::with_capacity(lines.len());
    let mut calls = 0;
    for idx in groups.into_values().flat_map(|g| {
        g.chunks(LINES_PER_CALL)
            .map(<[usize]>::to_vec)
            .collect::<Vec<_>>()
    }) {
        let first = lines[idx[0]];
        let mut inv = SYNC.prepare_invoke();
        for &i in &idx {
            inv.key(&lines[i].key);
        }
        inv.arg(reporter)
            .arg(first.ns_per_unit as f64 / 1000.0)
            .arg(first.interval_ns / 1000)
            .arg(keep_ms);
        for &i in &idx {
            inv.arg(lines[i].cum).arg(lines[i].delta);
        }
        match cluster.call::<Vec<u64>>(&inv).await {
            Ok(ahead) => {
                let at = crate::datapath::monotonic_ns();
                answers.extend(
                    idx.into_iter()
                        .zip(ahead)
                        .map(|(i, us)| (i, if us == 0 { 0 } else { at + us * 1000 })),
                );
            }
            Err(e) => return (answers, Some(e), calls),
        }
        calls += 1;
    }
    (answers, None, calls)
}

#[cfg(test)]
mod tests {
    use super::*;
    use rl_common::{Bucket, Key4};

    const INTERVAL: u64 = 100_000_000;

    /// Limit 0x100 shared at 1,000 packets/s with a burst of `burst_ns`.
    fn shared(burst_ns: u64) -> Shares {
        [(
            0x100,
            Share {
                rule: "r".into(),
                definition: 1,
                which: 0,
                ns_per_packet: 1_000_000,
                burst_ns,
            },
        )]
        .into()
    }

    /// A ledger, one limit shared at 1,000 packets/s (θ = 25 a round), and
    /// the bucket `rule`/1 of that limit holding a count.
    fn one_bucket(rule: u32) -> (BucketId, Shares, impl Fn(u64) -> SharedBucket, Ledger) {
        let id = BucketId::V4(Key4 { rule, addr: 1 });
        let shares = shared(1_000_000_000_000);
        let bucket = move |passed| SharedBucket {
            id,
            bucket: Bucket {
                passed,
                ..Default::default()
            },
        };
        (id, shares, bucket, Ledger::new("n", 10_000))
    }

    /// A bucket reported, collected (absent from a round's scan) and made
    /// again reports all it passed since, even when that is more than it
    /// had passed before: its count going down is not the only sign.
    /// A daemon that adopted the pinned tables takes their lifetime counts
    /// as reported at its first round, and reports what passes after.
    #[test]
    fn a_restart_on_pinned_tables_reports_only_what_passes_after_it() {
        let (_, shares, bucket, ledger) = one_bucket(0x100);
        let mut ledger = ledger.from_the_tables();
        assert!(
            ledger
                .reports(&[bucket(5_000)], &shares, INTERVAL, INTERVAL)
                .is_empty(),
            "the run before reported those"
        );
        let r = ledger.reports(&[bucket(5_030)], &shares, INTERVAL, 2 * INTERVAL);
        assert_eq!(r.len(), 1);
        assert_eq!(
            (r[0].line.delta, r[0].line.cum),
            (30, 30),
            "only the 30 passed since, under this run's name"
        );
    }

    /// A report is capped at what its bucket could pass in two of the
    /// round's spans (an outage's backlog charges no more), where the span
    /// is what the rounds take: 500 packets passed at 1,000/s over a 500 ms
    /// round are all charged, where a cap of the 100 ms interval left 289
    /// uncharged.
    #[test]
    fn a_report_of_a_slow_round_charges_all_the_round_passed() {
        let (id, _, bucket, mut ledger) = one_bucket(0x100);
        let shares = shared(10_000_000);
        let r = ledger.reports(&[bucket(40)], &shares, INTERVAL, INTERVAL);
        assert_eq!((r.len(), r[0].id), (1, id));
        ledger.acknowledge(&r[0], INTERVAL);
        let later = INTERVAL + 5 * INTERVAL;
        let capped = ledger.reports(&[bucket(540)], &shares, INTERVAL, later);
        assert_eq!(capped[0].line.delta, 211, "two intervals and the burst");
        let all = ledger.reports(&[bucket(540)], &shares, 5 * INTERVAL, later);
        assert_eq!(all[0].line.delta, 500, "the round's span");
    }

    #[test]
    fn a_bucket_collected_and_made_again_reports_from_zero() {
        let (_, shares, bucket, mut ledger) = one_bucket(0x100);
        let interval = INTERVAL;
        let r = ledger.reports(&[bucket(40)], &shares, interval, interval);
        assert_eq!(r.len(), 1);
        assert_eq!(r[0].line.delta, 40);
        ledger.acknowledge(&r[0], interval);
        // Collected: not in this round's tables.
        assert!(ledger
            .reports(&[], &shares, interval, 2 * interval)
            .is_empty());
        // Made again, it passed 45 before the next round.
        let r = ledger.reports(&[bucket(45)], &shares, interval, 3 * interval);
        assert_eq!(r.len(), 1, "a hot bucket (45 unreported, threshold 25)");
        assert_eq!(
            (r[0].line.delta, r[0].line.cum),
            (45, 85),
            "all 45 reported, on top of the 40 Redis holds"
        );
    }

    /// The collector's record of a delete re-bases a tracked bucket: made
    /// again within the round and past its old count before it, it still
    /// reports all of both incarnations' unreported packets (told by its
    /// count alone, it reported 45 − 40 = 5 of them).
    #[test]
    fn a_bucket_collected_and_made_again_within_a_round_reports_both_lives() {
        let (id, shares, bucket, mut ledger) = one_bucket(0x100);
        let interval = INTERVAL;
        ledger.collected(&[], true, 0);
        let r = ledger.reports(&[bucket(40)], &shares, interval, interval);
        ledger.acknowledge(&r[0], interval);
        // Deleted at 42 (2 unreported), made again, 45 by the next round.
        ledger.collected(&[bucket(42)], true, 2 * interval);
        let r = ledger.reports(&[bucket(45)], &shares, interval, 2 * interval);
        assert_eq!(r.len(), 1);
        assert_eq!(
            (r[0].line.delta, r[0].line.cum),
            (47, 87),
            "2 from its first life, 45 from its second"
        );
        ledger.acknowledge(&r[0], 2 * interval);
        // Deleted at 60 (15 unreported, under θ = 25) and not made again:
        // carried; made again and deleted at 20, the 35 travel alone.
        ledger.collected(&[bucket(60)], true, 3 * interval);
        assert!(
            ledger
                .reports(&[], &shares, interval, 3 * interval)
                .is_empty(),
            "15 wait, as a live bucket's would"
        );
        ledger.collected(&[bucket(20)], true, 4 * interval);
        let r = ledger.reports(&[], &shares, interval, 4 * interval);
        assert_eq!(r.len(), 1, "a collected bucket's last packets travel");
        assert_eq!((r[0].line.delta, r[0].line.cum, r[0].id), (35, 122, id));
        ledger.acknowledge(&r[0], 4 * interval);
        ledger.collected(&[], true, 5 * interval);
        assert!(ledger
            .reports(&[], &shares, interval, 5 * interval)
            .is_empty());
        // Made again: counts from zero.
        let r = ledger.reports(&[bucket(30)], &shares, interval, 6 * interval);
        assert_eq!((r[0].line.delta, r[0].line.cum), (30, 152));
    }

    /// A bucket never reported, collected with fewer than θ packets in each
    /// of its lives, 25 s apart (longer than the ledger keeps an idle
    /// bucket, 20 s here, unless a record says it lived): the records add
    /// them up, and they travel once they reach θ (before records, each
    /// life's were lost).
    #[test]
    fn lives_under_the_threshold_add_up_to_a_report() {
        let (id, shares, bucket, mut ledger) = one_bucket(0x100);
        for life in 1..=3 {
            let at = life * 25_000_000_000;
            ledger.collected(&[bucket(10)], true, at);
            let r = ledger.reports(&[], &shares, INTERVAL, at);
            if life < 3 {
                assert!(
                    r.is_empty(),
                    "life {life}: {} packets, under θ = 25",
                    10 * life
                );
            } else {
                assert_eq!(
                    (r.len(), r[0].id, r[0].line.delta, r[0].line.cum),
                    (1, id, 30, 30)
                );
            }
        }
    }

    /// A bucket forgotten (idle past `forget_after`) while Redis may still
    /// hold its count (other hosts kept the hash alive) counts on from all
    /// the run reported: above its old count, so Redis charges its new
    /// packets in full (from 0 they were charged nothing until they passed
    /// the old count).
    #[test]
    fn a_forgotten_bucket_counts_on_above_its_old_count() {
        let (_, shares, bucket, mut ledger) = one_bucket(0x100);
        let r = ledger.reports(&[bucket(2_000)], &shares, INTERVAL, INTERVAL);
        let old = r[0].line.cum;
        ledger.acknowledge(&r[0], INTERVAL);
        ledger.collected(&[bucket(2_000)], true, 2 * INTERVAL);
        // Past forget_after (20 s here): gone from the ledger.
        assert!(ledger
            .reports(&[], &shares, INTERVAL, 30_000_000_000)
            .is_empty());
        assert!(ledger.tracked.is_empty());
        let r = ledger.reports(&[bucket(300)], &shares, INTERVAL, 31_000_000_000);
        assert_eq!(r[0].line.delta, 300);
        assert!(
            r[0].line.cum >= old + 300,
            "{} after {old}: Redis would charge it {} of 300",
            r[0].line.cum,
            r[0].line.cum.saturating_sub(old).min(300)
        );
    }

    /// Records dropped in a round without reports (degraded) still make
    /// the next reports take a missing bucket as collected.
    #[test]
    fn dropped_records_are_remembered_until_the_next_reports() {
        let (_, shares, bucket, mut ledger) = one_bucket(0x100);
        let r = ledger.reports(&[bucket(40)], &shares, INTERVAL, INTERVAL);
        ledger.acknowledge(&r[0], INTERVAL);
        ledger.collected(&[], false, 2 * INTERVAL);
        ledger.collected(&[], true, 3 * INTERVAL);
        assert!(ledger
            .reports(&[], &shares, INTERVAL, 3 * INTERVAL)
            .is_empty());
        ledger.collected(&[], true, 4 * INTERVAL);
        let r = ledger.reports(&[bucket(45)], &shares, INTERVAL, 4 * INTERVAL);
        assert_eq!(
            (r[0].line.delta, r[0].line.cum),
            (45, 85),
            "taken as collected and made again"
        );
    }

    /// With complete records, a bucket missing from one round was not
    /// collected (a prefix cell the collector was freeing, then kept): back
    /// with its count, it reports only what is new.
    #[test]
    fn with_complete_records_a_bucket_missing_for_a_round_keeps_its_count() {
        let (_, shares, bucket, mut ledger) = one_bucket(0x100 | rl_common::KEY_CELL);
        let interval = INTERVAL;
        ledger.collected(&[], true, 0);
        let r = ledger.reports(&[bucket(40)], &shares, interval, interval);
        ledger.acknowledge(&r[0], interval);
        ledger.collected(&[], true, 0);
        assert!(ledger
            .reports(&[], &shares, interval, 2 * interval)
            .is_empty());
        ledger.collected(&[], true, 0);
        assert!(
            ledger
                .reports(&[bucket(41)], &shares, interval, 3 * interval)
                .is_empty(),
            "1 new packet, under θ"
        );
        let r = ledger.reports(&[bucket(70)], &shares, interval, 4 * interval);
        assert_eq!((r[0].line.delta, r[0].line.cum), (30, 70));
    }
}
