//! `cargo xtask bench`, request decisions (issue 10): Envoy's rate-limit
//! service over gRPC (a Rust tonic client, the same protocol Envoy speaks)
//! and the HTTP check, against the release daemon in a lab namespace.
//! - latency at a fixed offered rate (open loop: each request is due at its
//!   tick, so queueing behind a slow answer counts), with one key and with
//!   1,000,000 distinct keys;
//! - decisions per second at saturation (64 requests in flight);
//! - the daemon's memory per token-bucket key with 1,000,000 keys (1 per
//!   hour each: every key spends its one, so none is fresh again and
//!   collected during the run; most answers are 429s, decided in full).
//!
//! Knobs for diagnosis: `RL_BENCH_QUICK=1` (the 1-key latencies only),
//! `RL_BENCH_SATURATION=1` (saturation only, after printing the daemon's
//! pid and waiting 3 s, e.g. for `perf record -p`),
//! `RL_BENCH_WORKERS` (the generator's tokio workers, default 2),
//! `RL_BENCH_MAX_SOURCES` (the daemon's `[datapath] max_sources`, default
//! 1,048,576: the collector's walk of the packet tables costs CPU in
//! proportion to it).

use std::time::{Duration, Instant};

use anyhow::{bail, Result};
use envoy_types::pb::envoy::{
    extensions::common::ratelimit::v3::{rate_limit_descriptor::Entry, RateLimitDescriptor},
    service::ratelimit::v3::{rate_limit_service_client::RateLimitServiceClient, RateLimitRequest},
};
use rl_tests::{
    daemon::{write, Daemon},
    lab::Lab,
};

const GRPC: &str = "127.0.0.1:8081";
const RATE: u64 = 20_000;
const SECONDS: u64 = 5;
const KEYS: u64 = 1_000_000;
/// HTTP/2 connections the gRPC load spreads over.
const CONNECTIONS: usize = 4;

fn rules() -> String {
    format!(
        "[default]\nrate = 1000\n[datapath]\nmax_sources = {}\n[l7]\ngrpc_listen = \"{GRPC}\"\nhttp_listen = \"127.0.0.1:8082\"\nmax_keys = 2000000\n\
         [[l7.rule]]\nname = \"per-user\"\ndomain = \"bench\"\ndescriptor = [{{ key = \"user\" }}]\nrate = 1\nper = \"1h\"\n",
        std::env::var("RL_BENCH_MAX_SOURCES").unwrap_or("1048576".into())
    )
}

fn request(user: u64) -> RateLimitRequest {
    RateLimitRequest {
        domain: "bench".into(),
        descriptors: vec![RateLimitDescriptor { entries: vec![Entry { key: "user".into(), value: user.to_string() }], ..Default::default() }],
        hits_addend: 1,
    }
}

fn percentile(v: &mut [f64], q: f64) -> f64 {
    v.sort_by(|a, b| a.partial_cmp(b).unwrap());
    v[((v.len() as f64 * q) as usize).min(v.len() - 1)]
}

/// Open loop at `RATE`/s for `SECONDS` over gRPC; `keys` distinct users;
/// each request's time from its send to its answer. `paced`: a thread
/// sleeping to each request's due time (the kernel's high-resolution
/// timers) releases requests one by one, as many independent clients
/// would; otherwise tokio's timer, which wakes in whole milliseconds,
/// releases each millisecond's 20 requests together.
async fn grpc_latency(keys: u64, paced: bool) -> Result<(f64, f64, u64)> {
    let mut clients = Vec::new();
    for _ in 0..CONNECTIONS {
        clients.push(RateLimitServiceClient::connect(format!("http://{GRPC}")).await?);
    }
    let n = RATE * SECONDS;
    let (tx, mut rx) = tokio::sync::mpsc::unbounded_channel::<u64>();
    let start = Instant::now();
    let due = move |i: u64| start + Duration::from_nanos(i * 1_000_000_000 / RATE);
    let pacer = if paced {
        Some(std::thread::spawn(move || {
            for i in 0..n {
                if let Some(w) = due(i).checked_duration_since(Instant::now()) {
                    std::thread::sleep(w);
                }
                let _ = tx.send(i);
            }
        }))
    } else {
        tokio::spawn(async move {
            for i in 0..n {
                tokio::time::sleep_until(tokio::time::Instant::from_std(due(i))).await;
                let _ = tx.send(i);
            }
        });
        None
    };
    let mut tasks = Vec::with_capacity(n as usize);
    while let Some(i) = rx.recv().await {
        let mut c = clients[i as usize % CONNECTIONS].clone();
        let user = if keys == 1 { 0 } else { (i * 2_654_435_761) % keys };
        tasks.push(tokio::spawn(async move {
            // From the send: sends never wait for answers (open loop), so
            // lateness of the generator is the generator's, not the service's.
            let sent = Instant::now();
            let r = c.should_rate_limit(request(user)).await;
            (r.is_ok(), sent.elapsed().as_secs_f64() * 1e3)
        }));
    }
    if let Some(p) = pacer {
        p.join().map_err(|_| anyhow::anyhow!("the pacer panicked"))?;
    }
    let mut ms = Vec::with_capacity(tasks.len());
    let mut failed = 0;
    for t in tasks {
        let (ok, m) = t.await?;
        failed += u64::from(!ok);
        ms.push(m);
    }
    Ok((percentile(&mut ms, 0.5), percentile(&mut ms, 0.99), failed))
}

/// Closed loop with 64 in flight for `SECONDS`: decisions per second.
async fn grpc_saturation() -> Result<f64> {
    // Several HTTP/2 connections, as Envoy's workers open.
    let mut clients = Vec::new();
    for _ in 0..CONNECTIONS {
        clients.push(RateLimitServiceClient::connect(format!("http://{GRPC}")).await?);
    }
    let stop = Instant::now() + Duration::from_secs(SECONDS);
    let mut tasks = Vec::new();
    for w in 0..64u64 {
        let mut c = clients[w as usize % CONNECTIONS].clone();
        tasks.push(tokio::spawn(async move {
            let mut done = 0u64;
            while Instant::now() < stop {
                if c.should_rate_limit(request(w * 1000 + done % 1000)).await.is_ok() {
                    done += 1;
                }
            }
            done
        }));
    }
    let mut total = 0;
    for t in tasks {
        total += t.await?;
    }
    Ok(total as f64 / SECONDS as f64)
}

/// Creates `keys` distinct buckets (closed loop, 64 in flight).
async fn grpc_fill(keys: u64) -> Result<()> {
    let client = RateLimitServiceClient::connect(format!("http://{GRPC}")).await?;
    let mut tasks = Vec::new();
    for w in 0..64u64 {
        let mut c = client.clone();
        tasks.push(tokio::spawn(async move {
            let mut user = w;
            while user < keys {
                c.should_rate_limit(request(user)).await?;
                user += 64;
            }
            Ok::<_, tonic::Status>(())
        }));
    }
    for t in tasks {
        t.await??;
    }
    Ok(())
}

/// Open loop over the HTTP check from 8 threads at `RATE`/s in all.
fn http_latency(lab: &Lab, keys: u64) -> Result<(f64, f64)> {
    let threads = 8u64;
    let handles: Vec<_> = (0..threads)
        .map(|t| {
            lab.b.spawn(move || {
                let agent = ureq::AgentBuilder::new().timeout(Duration::from_secs(5)).build();
                let per = RATE / threads;
                let n = per * SECONDS;
                let start = Instant::now();
                let mut ms = Vec::with_capacity(n as usize);
                for i in 0..n {
                    let due = start + Duration::from_nanos(i * 1_000_000_000 / per);
                    if let Some(w) = due.checked_duration_since(Instant::now()) {
                        std::thread::sleep(w);
                    }
                    let user = if keys == 1 { 0 } else { ((i * threads + t) * 2_654_435_761) % keys };
                    let body = format!("{{\"domain\":\"bench\",\"descriptors\":[[{{\"key\":\"user\",\"value\":\"{user}\"}}]]}}");
                    let r = agent.post("http://127.0.0.1:8082/v1/check").set("Content-Type", "application/json").send_string(&body);
                    match r {
                        Ok(r) => {
                            r.into_string()?;
                        }
                        Err(ureq::Error::Status(_, r)) => {
                            r.into_string()?;
                        }
                        Err(e) => bail!("the check failed: {e}"),
                    }
                    ms.push((Instant::now() - due).as_secs_f64() * 1e3);
                }
                Ok(ms)
            })
        })
        .collect();
    let mut all = Vec::new();
    for h in handles {
        all.extend(h.join().map_err(|_| anyhow::anyhow!("a load thread panicked"))??);
    }
    Ok((percentile(&mut all, 0.5), percentile(&mut all, 0.99)))
}

fn rss_kib(pid: u32) -> Result<u64> {
    rl_tests::proc_status_kib(pid, "VmRSS")
}

/// Runs the future `make` gives on a runtime of its own, in the lab's
/// protected namespace (where the daemon's loopback listeners are).
fn in_lab<T, F>(lab: &Lab, make: impl FnOnce() -> F + Send + 'static) -> Result<T>
where
    T: Send + 'static,
    F: std::future::Future<Output = Result<T>>,
{
    lab.b.run(move || {
        let workers = std::env::var("RL_BENCH_WORKERS").ok().and_then(|v| v.parse().ok()).unwrap_or(2);
        let rt = tokio::runtime::Builder::new_multi_thread().worker_threads(workers).enable_all().build()?;
        rt.block_on(make())
    })
}

/// ns per decision of the engine alone, in this process (no transport).
fn engine_ns() -> Result<f64> {
    use rl_control::{config::Config, l7::engine::{DescriptorEntry, Engine}};
    let c = Config::from_str(&rules(), "<bench>")?;
    let e = Engine::new(&c.l7, 0, None);
    let n = 1_000_000u64;
    let values: Vec<String> = (0..1000).map(|i| i.to_string()).collect();
    let t = Instant::now();
    for i in 0..n {
        let d = [DescriptorEntry { key: "user".into(), value: values[(i % 1000) as usize].clone() }];
        std::hint::black_box(e.decide("bench", &d, 1));
    }
    Ok(t.elapsed().as_nanos() as f64 / n as f64)
}

fn main() -> Result<()> {
    let steal = rl_tests::StealMeter::start();
    let lab = Lab::new()?;
    let dir = tempfile::tempdir()?;
    let cfg = write(&dir, "rl.toml", &rules());
    let d = Daemon::serving(&lab, &cfg, &[])?;
    println!("rl request-decision benchmark (release daemon, 2 CPUs shared with the load generator), {RATE} requests/s offered for {SECONDS} s");
    let report = |keys: u64, paced: bool, (p50, p99, failed): (f64, f64, u64)| {
        let how = if paced { "paced one by one" } else { "released per ms" };
        println!(
            "gRPC ShouldRateLimit, {keys} key(s) in the store, {how}: p50 {p50:.3} ms, p99 {p99:.3} ms ({failed} failed); target p99 < 1 ms at {RATE}/s: {}",
            if p99 < 1.0 && failed == 0 { "met" } else { "MISSED" }
        );
    };
    if std::env::var_os("RL_BENCH_SATURATION").is_some() {
        // For profiling the daemon: saturation only, its pid first.
        println!("daemon pid {}", d.pid());
        std::thread::sleep(Duration::from_secs(3));
        let rate = in_lab(&lab, grpc_saturation)?;
        println!("gRPC at saturation (64 in flight): {rate:.0} decisions/s");
        d.stop(libc::SIGTERM)?;
        return Ok(());
    }
    for paced in [true, false] {
        report(1, paced, in_lab(&lab, move || grpc_latency(1, paced))?);
    }
    if std::env::var_os("RL_BENCH_QUICK").is_some() {
        return Ok(());
    }
    let before = rss_kib(d.pid())?;
    let t = Instant::now();
    in_lab(&lab, || grpc_fill(KEYS))?;
    let fill = t.elapsed().as_secs_f64();
    let after = rss_kib(d.pid())?;
    let held = rl_tests::http::parse_prometheus(&rl_tests::http::get(&lab.b, "/metrics").body)["rl_l7_keys"];
    if held < KEYS as f64 {
        bail!("the store holds {held} keys after {KEYS} were made");
    }
    let per_key = (after.saturating_sub(before)) as f64 * 1024.0 / KEYS as f64;
    println!(
        "memory: RSS {:.1} MiB before, {:.1} MiB with {KEYS} more token-bucket keys (made in {fill:.1} s): {per_key:.0} bytes per key; target ≤ 100: {}",
        before as f64 / 1024.0,
        after as f64 / 1024.0,
        if per_key <= 100.0 { "met" } else { "MISSED" }
    );
    for paced in [true, false] {
        report(KEYS, paced, in_lab(&lab, move || grpc_latency(KEYS, paced))?);
    }
    let cpu_before = rl_tests::process_cpu_secs(d.pid())?;
    let rate = in_lab(&lab, grpc_saturation)?;
    let daemon_cpu = rl_tests::process_cpu_secs(d.pid())? - cpu_before;
    println!(
        "gRPC at saturation (64 in flight): {rate:.0} decisions/s; target ≥ 100,000: {}",
        if rate >= 100_000.0 { "met" } else { "MISSED" }
    );
    // What the daemon itself spent: the generator takes the rest of the CPUs.
    let per = daemon_cpu / (rate * SECONDS as f64);
    println!(
        "  the daemon used {daemon_cpu:.2} CPU-s for them: {:.1} µs of CPU per decision (two CPUs of the daemon's alone would be {:.0}/s; not measured, derived)",
        per * 1e6,
        2.0 / per
    );
    println!("the engine alone (match, hash, charge, quota; no transport): {:.0} ns per decision", engine_ns()?);
    for keys in [1, KEYS] {
        let (p50, p99) = http_latency(&lab, keys)?;
        println!("HTTP check, {keys} key(s): p50 {p50:.3} ms, p99 {p99:.3} ms");
    }
    d.stop(libc::SIGTERM)?;
    println!("{}", steal.report().1);
    Ok(())
}
