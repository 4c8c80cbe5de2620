//! `cargo xtask bench`, cluster-wide limits (issue 11), in one run against
//! a real Redis (Debian's `redis-server`) in a namespace of the bench's own:
//! - request decisions: a `scope = "cluster"` rule (one script call per
//!   decision) against the same rule local, and against raw `EVALSHA` of the
//!   same script with a bare client: decisions per second and p50/p99 with
//!   32 in flight over 10,000 keys;
//! - the packet-rule sync: Redis calls and commands per round (and per
//!   second at `sync_interval = 100ms`) with 10,000 and 1,000,000 tracked
//!   sources, all hot (worst case) or 1% hot, and quiet sources costing
//!   nothing; and the walk of 1,000,000 real kernel buckets that precedes
//!   every round;
//! - the worst overshoot of three hosts (each a veth lab with XDP and the
//!   release daemon) flooded by one source at once, against the documented
//!   bound, over several rounds.

use std::{
    sync::Arc,
    time::{Duration, Instant},
};

use anyhow::{Context, Result};
use rl_common::{Bucket, Key4};
use rl_control::{
    cluster::{
        packets::{Ledger, Share, Shares},
        requests::DECIDE_LUA,
        Cluster,
    },
    config::Config,
    datapath::share::{scan_shared, BucketId, SharedBucket},
    l7::engine::{DescriptorEntry, Engine},
};
use rl_tests::redis::{Hub, Redis};

const IN_FLIGHT: usize = 32;
const DECISIONS: usize = 20_000;
const KEYS: usize = 10_000;

fn config(url: &str) -> Config {
    let text = format!(
        "[default]\nrate = 1000\n[cluster]\nredis = [\"{url}\"]\nnode = \"bench\"\ntimeout = \"500ms\"\n[l7]\nmax_keys = 100000\n\
         [[l7.rule]]\nname = \"shared\"\ndomain = \"b\"\ndescriptor = [{{ key = \"c\" }}]\nrate = 1000000\nper = \"1s\"\nburst = 1000000\nscope = \"cluster\"\n\
         [[l7.rule]]\nname = \"here\"\ndomain = \"b\"\ndescriptor = [{{ key = \"l\" }}]\nrate = 1000000\nper = \"1s\"\nburst = 1000000\n\
         [[rule]]\nname = \"udp\"\nproto = \"udp\"\nrate = 1000\nscope = \"cluster\"\n"
    );
    Config::from_str(&text, "bench").expect("the bench's rules are valid")
}

fn percentile(v: &mut [f64], q: f64) -> f64 {
    v.sort_by(|a, b| a.partial_cmp(b).unwrap());
    v[((v.len() as f64 * q) as usize).min(v.len() - 1)]
}

/// Runs `DECISIONS` calls of `one(i)`, `IN_FLIGHT` at a time; decisions/s,
/// p50 and p99 in ms.
async fn measure<F, Fut>(one: F) -> (f64, f64, f64)
where
    F: Fn(usize) -> Fut + Send + Sync + 'static,
    Fut: std::future::Future<Output = ()> + Send,
{
    let one = Arc::new(one);
    let start = Instant::now();
    let mut tasks = Vec::new();
    for w in 0..IN_FLIGHT {
        let one = one.clone();
        tasks.push(tokio::spawn(async move {
            let mut lat = Vec::with_capacity(DECISIONS / IN_FLIGHT);
            for i in (w..DECISIONS).step_by(IN_FLIGHT) {
                let t = Instant::now();
                one(i).await;
                lat.push(t.elapsed().as_secs_f64() * 1e3);
            }
            lat
        }));
    }
    let mut all = Vec::new();
    for t in tasks {
        all.extend(t.await.unwrap());
    }
    let secs = start.elapsed().as_secs_f64();
    (
        DECISIONS as f64 / secs,
        percentile(&mut all, 0.5),
        percentile(&mut all, 0.99),
    )
}

fn entry(key: &str, i: usize) -> Vec<DescriptorEntry> {
    vec![DescriptorEntry {
        key: key.into(),
        value: format!("k{}", i % KEYS),
    }]
}

async fn requests(url: String) -> Result<()> {
    let config = config(&url);
    let cluster = Cluster::new(config.cluster.clone().unwrap());
    cluster
        .probe(&[])
        .await
        .map_err(|e| anyhow::anyhow!("{e}"))?;
    let engine = Arc::new(Engine::new(&config.l7, 0, None).with_cluster(Some(cluster.clone())));
    // The same rule in the cluster (descriptor key "c") and local ("l").
    let mut rules = Vec::new();
    for key in ["c", "l"] {
        let e = engine.clone();
        rules.push(
            measure(move |i| {
                let e = e.clone();
                async move {
                    assert_eq!(e.decide_scoped("b", &entry(key, i), 1).await.code, "ok");
                }
            })
            .await,
        );
    }
    let (cluster_rule, local_rule) = (rules[0], rules[1]);
    let client = redis::Client::open(url.as_str())?;
    let conn = redis::aio::ConnectionManager::new(client).await?;
    let script = Arc::new(redis::Script::new(DECIDE_LUA));
    let raw = measure(move |i| {
        let (mut conn, script) = (conn.clone(), script.clone());
        async move {
            let r: Vec<i64> = script
                .key(format!("rl:raw:{{{}}}", i % KEYS))
                .arg("gcra")
                .arg(1)
                .arg(1)
                .arg(0)
                .arg(1_000_000)
                .arg(1_000_000)
                .arg(1_000_000)
                .invoke_async(&mut conn)
                .await
                .unwrap();
            assert_eq!(r[0], 1);
        }
    })
    .await;
    println!("request decisions, {IN_FLIGHT} in flight over {KEYS} keys, {DECISIONS} each (one run, same Redis):");
    for (what, (rate, p50, p99)) in [
        ("cluster rule (decide_scoped ➜ Redis)", cluster_rule),
        ("same rule, local", local_rule),
        ("raw EVALSHA, bare client", raw),
    ] {
        println!("  {what:<40} {rate:>9.0} decisions/s   p50 {p50:.3} ms   p99 {p99:.3} ms");
    }
    println!(
        "  cluster rule / raw EVALSHA: {:.2}× the rate",
        cluster_rule.0 / raw.0
    );
    Ok(())
}

/// Redis' counters: (EVALSHA calls, HSET calls) so far.
fn redis_counts(redis: &Redis) -> (u64, u64) {
    let stats = redis.cli(&["INFO", "commandstats"]).unwrap_or_default();
    let calls = |cmd: &str| {
        stats
            .lines()
            .find(|l| l.starts_with(&format!("cmdstat_{cmd}:")))
            .and_then(|l| l.split("calls=").nth(1))
            .and_then(|v| v.split(',').next())
            .and_then(|v| v.parse().ok())
            .unwrap_or(0)
    };
    (calls("evalsha") + calls("eval"), calls("hset"))
}

async fn sync(url: String, redis: &Redis) -> Result<()> {
    let config = config(&url);
    let cluster = Cluster::new(config.cluster.clone().unwrap());
    cluster
        .probe(&[])
        .await
        .map_err(|e| anyhow::anyhow!("{e}"))?;
    let interval_ns = 100_000_000;
    let rule_id = 8;
    let shares: Shares = [(
        rule_id,
        Share {
            rule: "udp".into(),
            definition: 1,
            which: 0,
            ns_per_packet: 1_000_000,
            burst_ns: 1_000_000_000,
        },
    )]
    .into();
    println!(
        "packet-rule sync, sync_interval 100 ms, 1,000 packets/s per source (θ = 25 packets):"
    );
    for (tracked, hot_every) in [(10_000u32, 1u32), (1_000_000, 100), (1_000_000, 0)] {
        let mut ledger = Ledger::new(&format!("bench-{tracked}-{hot_every}"), 60_000);
        let mut buckets: Vec<SharedBucket> = (0..tracked)
            .map(|i| SharedBucket {
                id: BucketId::V4(Key4 {
                    rule: rule_id,
                    addr: i,
                }),
                bucket: Bucket::default(),
            })
            .collect();
        let rounds = 5;
        let (calls0, hset0) = redis_counts(redis);
        let mut spent = Duration::ZERO;
        let mut sent = 0;
        for round in 1..=rounds {
            for (i, b) in buckets.iter_mut().enumerate() {
                if hot_every != 0 && (i as u32).is_multiple_of(hot_every) {
                    b.bucket.passed = 100 * round;
                }
            }
            let t = Instant::now();
            let now = rl_control::datapath::monotonic_ns();
            let reports = ledger.reports(&buckets, &shares, interval_ns, now);
            let (answers, failure) = ledger.exchange(&cluster, &reports, 60_000).await;
            if let Some(e) = failure {
                anyhow::bail!("the sync failed: {e}");
            }
            for (i, _) in &answers {
                ledger.acknowledge(&reports[*i], now);
            }
            ledger.stats.rounds += 1;
            spent += t.elapsed();
            sent += reports.len();
        }
        let (calls1, hset1) = redis_counts(redis);
        let per_round = |n: u64| n as f64 / rounds as f64;
        let hot = if hot_every == 0 {
            "none hot".to_string()
        } else {
            format!("1 in {hot_every} hot")
        };
        println!(
            "  {tracked:>9} tracked, {hot:<12} {:>7.0} buckets reported/round, {:>5.1} script calls/round ({:>6.0}/s), {:>8.0} bucket writes/round ({:>8.0}/s), {:.1} ms/round",
            sent as f64 / rounds as f64,
            per_round(calls1 - calls0),
            per_round(calls1 - calls0) * 10.0,
            per_round(hset1 - hset0),
            per_round(hset1 - hset0) * 10.0,
            spent.as_secs_f64() * 1e3 / rounds as f64
        );
    }
    Ok(())
}

/// The walk of the kernel tables every round: 1,000,000 real buckets.
fn walk() -> Result<()> {
    use aya::maps::{HashMap, Map, MapData};
    let dp = rl_tests::datapath("[default]\nrate = 1000\n[datapath]\nmax_sources = 1048576\n[[rule]]\nname = \"udp\"\nproto = \"udp\"\nrate = 1000\n")?;
    let ids = dp.table_maps()?;
    let mut map: HashMap<MapData, Key4, Bucket> =
        HashMap::try_from(Map::HashMap(ids.tables.0.open()?))?;
    let t = Instant::now();
    for i in 0..1_000_000u32 {
        map.insert(
            Key4 { rule: 8, addr: i },
            Bucket {
                passed: 1,
                ..Default::default()
            },
            0,
        )
        .context("filling the bucket table")?;
    }
    let filled = t.elapsed();
    let t = Instant::now();
    let n = scan_shared(&ids, |r| r == 8)?.len();
    let walked = t.elapsed();
    println!("  walk of the kernel tables: {n} buckets of the cluster rule in {:.0} ms (filled in {:.1} s)", walked.as_secs_f64() * 1e3, filled.as_secs_f64());
    Ok(())
}

fn main() -> Result<()> {
    let hub = Hub::new(90)?;
    let redis = Redis::start(&hub, 6379)?;
    let url = redis.url();
    let path = format!("/run/netns/{}", hub.ns.name);
    // The bench's client threads live in the hub namespace with Redis.
    std::thread::scope(|s| {
        s.spawn(|| -> Result<()> {
            rl_tests::lab::enter(&path)?;
            let rt = tokio::runtime::Builder::new_multi_thread()
                .worker_threads(2)
                .enable_all()
                .build()?;
            rt.block_on(requests(url.clone()))?;
            rt.block_on(sync(url.clone(), &redis))
        })
        .join()
        .map_err(|_| anyhow::anyhow!("the bench thread panicked"))?
    })?;
    walk()?;
    overshoot()
}

/// Three hosts, one source flooding all of them at 1,000 pps each for 3 s,
/// five times: passes against `R·τ + N·B + (N−1)·R·(T+δ) + N·θ`.
fn overshoot() -> Result<()> {
    use rl_tests::cluster_lab::{ClusterLab, BURST, RATE};
    let c = ClusterLab::new(91, &["local", "local", "local"])?;
    let mut worst: f64 = 0.0;
    let mut line = Vec::new();
    for _ in 0..5 {
        let (p, took) = c.flood_all(3000, 1000)?;
        let excess = p as f64 - RATE as f64 * took;
        let bound_excess = c.bound(took) - RATE as f64 * took;
        worst = worst.max(excess / bound_excess);
        line.push(format!(
            "{p} (R·τ {:.0}, bound {:.0})",
            RATE as f64 * took,
            c.bound(took)
        ));
        // Let every bucket refill before the next round.
        std::thread::sleep(Duration::from_secs(2));
    }
    println!("overshoot, 3 hosts, R = {RATE}/s, B = {BURST}, T = 100 ms, one source at 1,000 pps per host for 3 s, 5 rounds:");
    println!("  passed: {}", line.join(", "));
    println!("  worst excess over R·τ: {:.0}% of the excess the bound allows (three unsynchronised hosts: {:.0} passed per round)", worst * 100.0, 3.0 * (RATE as f64 * 3.0 + BURST as f64));
    Ok(())
}
