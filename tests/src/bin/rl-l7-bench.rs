//! `cargo xtask bench`, request decisions (issue 10): Envoy's rate-limit
//! service over gRPC and the HTTP check, against the release daemon in a
//! lab namespace. The gRPC load comes from `rl_tests::rls_load`: calls
//! written straight onto HTTP/2 frames, from 2 threads with 2 connections
//! each, every answer decoded and its code checked, and the total checked
//! against the daemon's decision counter; lean enough that on a 2-CPU host
//! the figures are mostly the daemon's (each line prints both sides' CPU
//! per request). The HTTP check's load comes from `rl_tests::http_load`:
//! keep-alive HTTP/1.1 connections, one request in flight on each, as 8
//! serial clients and as a gateway's pool of 32.
//! - latency at a fixed offered rate (open loop: each request is due at its
//!   tick, so queueing behind a slow answer counts), with one key and with
//!   1,000,000 distinct keys;
//! - decisions per second at saturation (64 requests in flight);
//! - the daemon's memory per token-bucket key with 1,000,000 keys (1 per
//!   hour each: every key spends its one, so none is fresh again and
//!   collected during the run; most answers are 429s, decided in full).
//!
//! Knobs for diagnosis: `RL_BENCH_QUICK=1` (the 1-key latencies only),
//! `RL_BENCH_HTTP=1` (the HTTP check's 1-key latency only),
//! `RL_BENCH_SATURATION=1` (saturation only, after printing the daemon's
//! pid and waiting 3 s, e.g. for `perf record -p`),
//! `RL_BENCH_WORKERS` (the generator's threads, default 2),
//! `RL_BENCH_DUMP=PREFIX` (each latency run writes "sent-at-ms latency-ms"
//! per request to PREFIX-KEYS-PACED-CONNECTION, and the HTTP check's to
//! PREFIX-http-KEYS-SHAPE-THREAD: a tail that comes every second is a
//! periodic job's),
//! `RL_BENCH_MAX_SOURCES` (the daemon's `[datapath] max_sources`, default
//! 1,048,576: the collector's walk of the packet tables costs CPU in
//! proportion to it).

use std::time::{Duration, Instant};

use anyhow::{bail, Result};
use envoy_types::pb::envoy::{
    extensions::common::ratelimit::v3::{rate_limit_descriptor::Entry, RateLimitDescriptor},
    service::ratelimit::v3::RateLimitRequest,
};
use rl_tests::{
    daemon::{write, Daemon},
    http_load::{Dispatch, Pool},
    lab::Lab,
    rls::{encode, on_threads, Ticker},
    rls_load::{Done, Load},
};
use tokio::net::TcpStream;

const GRPC: &str = "127.0.0.1:8081";
const RATE: u64 = 20_000;
const SECONDS: u64 = 5;
const KEYS: u64 = 1_000_000;
/// HTTP/2 connections the gRPC load spreads over.
const CONNECTIONS: usize = 4;
const HTTP: &str = "127.0.0.1:8082";
/// The HTTP load's two shapes: 8 serial clients, each check waiting for
/// its own connection; and a gateway's keep-alive pool of 32 connections,
/// each check on an idle one (Caddy keeps 32 per upstream by default).
const HTTP_LOADS: [(usize, Dispatch); 2] = [(8, Dispatch::InTurn), (32, Dispatch::AnyIdle)];

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
        descriptors: vec![RateLimitDescriptor {
            entries: vec![Entry {
                key: "user".into(),
                value: user.to_string(),
            }],
            ..Default::default()
        }],
        hits_addend: 1,
    }
}

fn percentile(v: &mut [f64], q: f64) -> f64 {
    v.sort_by(|a, b| a.partial_cmp(b).unwrap());
    v[((v.len() as f64 * q) as usize).min(v.len() - 1)]
}

/// The generator's threads (`RL_BENCH_WORKERS`, default 2), each with
/// `CONNECTIONS / threads` connections of its own.
fn threads() -> usize {
    std::env::var("RL_BENCH_WORKERS")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(2)
        .max(1)
}

/// Runs `job(connection, of)` for each of `connections`, spread over the
/// generator's threads (a task per connection); the results in order.
fn on_connections<T, F>(
    lab: &Lab,
    connections: usize,
    job: impl Fn(usize, usize) -> F + Send + Sync + Copy + 'static,
) -> Result<Vec<T>>
where
    T: Send + 'static,
    F: std::future::Future<Output = Result<T>> + Send + 'static,
{
    let per_thread = on_threads(&lab.b, threads(), move |t, threads| async move {
        let per = (connections / threads).max(1);
        let of = per * threads;
        let tasks: Vec<_> = (0..per)
            .map(|k| tokio::spawn(job(t * per + k, of)))
            .collect();
        let mut out = Vec::new();
        for task in tasks {
            out.push(task.await??);
        }
        Ok(out)
    })?;
    Ok(per_thread.into_iter().flatten().collect())
}

/// Waits for answers on one connection, writes what reading queued
/// (window updates, calls that waited for room); the finished calls.
async fn answers(tcp: &TcpStream, load: &mut Load, done: &mut Vec<Done>) -> Result<()> {
    tcp.readable().await?;
    if !load.read(tcp, done)? {
        bail!("the daemon closed a connection");
    }
    load.flush(tcp).await
}

/// Closed loop on one connection: `user(i)` for the i-th call while it
/// gives one, `in_flight` at a time; calls answered (any failure is an
/// error).
async fn closed_loop(
    tcp: &TcpStream,
    load: &mut Load,
    in_flight: usize,
    user: impl Fn(u64) -> Option<u64>,
) -> Result<u64> {
    let (mut next, mut answered, mut done) = (0u64, 0u64, Vec::new());
    loop {
        while load.pending() < in_flight {
            let Some(u) = user(next) else { break };
            load.call(next, encode(&request(u)));
            next += 1;
        }
        if load.pending() == 0 {
            return Ok(answered);
        }
        load.flush(tcp).await?;
        answers(tcp, load, &mut done).await?;
        for d in done.drain(..) {
            d.result
                .map_err(|e| anyhow::anyhow!("call {}: {e}", d.token))?;
            answered += 1;
        }
    }
}

/// Open loop at `RATE`/s for `SECONDS` over gRPC, spread over the
/// connections, each with its own kernel timer; `keys` distinct users;
/// each request's time from its send to its answer. `paced`: requests are
/// released one by one, as many independent clients would send them;
/// otherwise each millisecond's 20 go together. A connection that wakes
/// late sends what is due at once. p50, p99 (ms) and the requests that
/// failed.
fn grpc_latency(lab: &Lab, keys: u64, paced: bool) -> Result<(f64, f64, u64)> {
    let before = decided(lab)?;
    let per_conn = on_connections(lab, CONNECTIONS, move |conn, of| async move {
        let (tcp, mut load) = Load::connect(GRPC.parse()?).await?;
        // Warm up, not counted: the connection's first calls.
        closed_loop(&tcp, &mut load, 1, |i| (i < 100).then_some(0)).await?;
        let rate = RATE / of as u64;
        let n = rate * SECONDS;
        let (every, batch) = if paced {
            (Duration::from_nanos(1_000_000_000 / rate), 1)
        } else {
            (Duration::from_millis(1), (rate / 1000).max(1))
        };
        let ticker = Ticker::new(every)?;
        let t0 = Instant::now();
        let (mut sent, mut done) = (0u64, Vec::new());
        let mut ms = Vec::with_capacity(n as usize);
        let (mut failed, mut dump) = (Vec::new(), String::new());
        let dump_to = std::env::var("RL_BENCH_DUMP").ok();
        let deadline = tokio::time::sleep(Duration::from_secs(4 * SECONDS + 10));
        tokio::pin!(deadline);
        while (ms.len() as u64) < n {
            tokio::select! {
                ticks = ticker.tick(), if sent < n => {
                    for _ in 0..ticks? * batch {
                        if sent == n {
                            break;
                        }
                        let g = sent * of as u64 + conn as u64;
                        load.call(sent, encode(&request(if keys == 1 { 0 } else { (g * 2_654_435_761) % keys })));
                        sent += 1;
                    }
                    load.flush(&tcp).await?;
                }
                r = answers(&tcp, &mut load, &mut done) => {
                    r?;
                    for d in done.drain(..) {
                        // From the send: sends never wait for answers (open
                        // loop), so lateness of the generator is the
                        // generator's, not the service's.
                        let m = d.sent.elapsed().as_secs_f64() * 1e3;
                        ms.push(m);
                        if let Err(e) = d.result {
                            failed.push(e);
                        }
                        if dump_to.is_some() {
                            dump += &format!("{:.3} {m:.3}\n", (d.sent - t0).as_secs_f64() * 1e3);
                        }
                    }
                }
                _ = &mut deadline => bail!("{} of {n} calls unanswered after {} s", n - ms.len() as u64, 4 * SECONDS + 10),
            }
        }
        if let Some(p) = dump_to {
            std::fs::write(format!("{p}-{keys}-{paced}-{conn}"), dump)?;
        }
        Ok((ms, failed))
    })?;
    let (mut ms, mut failed) = (Vec::new(), Vec::new());
    let connections = per_conn.len();
    for (m, f) in per_conn {
        ms.extend(m);
        failed.extend(f);
    }
    if let Some(e) = failed.first() {
        println!("  {} requests failed, the first with: {e}", failed.len());
    }
    // Each connection's warm-up: 100 calls.
    same_count(
        lab,
        before,
        (ms.len() - failed.len() + 100 * connections) as u64,
    )?;
    Ok((
        percentile(&mut ms, 0.5),
        percentile(&mut ms, 0.99),
        failed.len() as u64,
    ))
}

/// The daemon's own count of request decisions, from its metrics: the
/// generator's counts are checked against it.
fn decided(lab: &Lab) -> Result<u64> {
    let m = rl_tests::http::parse_prometheus(&rl_tests::http::get(&lab.b, "/metrics").body);
    Ok(m.iter()
        .filter(|(k, _)| k.starts_with("rl_l7_decisions_total"))
        .map(|(_, v)| *v as u64)
        .sum())
}

/// Fails unless the daemon counted exactly the `answered` decisions since
/// it counted `before`.
fn same_count(lab: &Lab, before: u64, answered: u64) -> Result<()> {
    let counted = decided(lab)? - before;
    if counted != answered {
        bail!("the generator counted {answered} answers, the daemon {counted} decisions");
    }
    Ok(())
}

/// Closed loop with 64 in flight in all for `SECONDS`: decisions per second.
fn grpc_saturation(lab: &Lab) -> Result<f64> {
    let before = decided(lab)?;
    let stop = Instant::now() + Duration::from_secs(SECONDS);
    let done = on_connections(lab, CONNECTIONS, move |conn, of| async move {
        let first = (conn * 1000) as u64;
        let (tcp, mut load) = Load::connect(GRPC.parse()?).await?;
        closed_loop(&tcp, &mut load, 64 / of, |i| {
            (Instant::now() < stop).then_some(first + i % 1000)
        })
        .await
    })?;
    let answered = done.iter().sum::<u64>();
    same_count(lab, before, answered)?;
    Ok(answered as f64 / SECONDS as f64)
}

/// Creates `keys` distinct buckets (closed loop, 64 in flight in all).
fn grpc_fill(lab: &Lab, keys: u64) -> Result<()> {
    on_connections(lab, CONNECTIONS, move |conn, of| async move {
        let (tcp, mut load) = Load::connect(GRPC.parse()?).await?;
        closed_loop(&tcp, &mut load, 64 / of, |i| {
            Some(i * of as u64 + conn as u64).filter(|u| *u < keys)
        })
        .await
    })?;
    Ok(())
}

/// Open loop over the HTTP check at `RATE`/s for `SECONDS` from the
/// generator's threads, each with a kernel timer and `connections / threads`
/// keep-alive connections, one request in flight on each (as forward-auth
/// gateways send them), picked by `dispatch`; `keys` distinct users. A
/// request is timed from when it fell due (the timer's wake-up that found
/// it due) to its whole answer, so one that waits for a connection counts
/// the wait. p50, p99 (ms).
fn http_latency(
    lab: &Lab,
    keys: u64,
    connections: usize,
    dispatch: Dispatch,
) -> Result<(f64, f64)> {
    const WARM: usize = 100;
    let before = decided(lab)?;
    let per_thread = on_threads(&lab.b, threads(), move |t, threads| async move {
        let per = (connections / threads).max(1);
        let mut pool = Pool::connect(HTTP.parse()?, per, dispatch).await?;
        let body = |u: u64| {
            format!("{{\"domain\":\"bench\",\"descriptors\":[[{{\"key\":\"user\",\"value\":\"{u}\"}}]]}}")
        };
        let mut done = Vec::new();
        // Warm up every connection, not counted.
        for _ in 0..WARM {
            for _ in 0..per {
                pool.check(Instant::now(), body(0)).await?;
            }
            while pool.pending() > 0 {
                pool.answers(&mut done).await?;
            }
        }
        for d in done.drain(..) {
            d.result
                .map_err(|e| anyhow::anyhow!("a warm-up check {e}"))?;
        }
        let rate = RATE / threads as u64;
        let n = rate * SECONDS;
        let ticker = Ticker::new(Duration::from_nanos(1_000_000_000 / rate))?;
        let (mut queued, mut ms) = (0u64, Vec::with_capacity(n as usize));
        let (t0, mut dump, dump_to) = (
            Instant::now(),
            String::new(),
            std::env::var("RL_BENCH_DUMP").ok(),
        );
        let deadline = tokio::time::sleep(Duration::from_secs(4 * SECONDS + 10));
        tokio::pin!(deadline);
        while (ms.len() as u64) < n {
            tokio::select! {
                ticks = ticker.tick(), if queued < n => {
                    let now = Instant::now();
                    for _ in 0..ticks?.min(n - queued) {
                        let g = queued * threads as u64 + t as u64;
                        pool.check(now, body(if keys == 1 { 0 } else { (g * 2_654_435_761) % keys })).await?;
                        queued += 1;
                    }
                }
                r = pool.answers(&mut done), if pool.pending() > 0 => {
                    r?;
                    for d in done.drain(..) {
                        let m = d.due.elapsed().as_secs_f64() * 1e3;
                        ms.push(m);
                        if dump_to.is_some() {
                            dump += &format!("{:.3} {m:.3}\n", (d.due - t0).as_secs_f64() * 1e3);
                        }
                        d.result.map_err(|e| anyhow::anyhow!("a check {e}"))?;
                    }
                }
                _ = &mut deadline => bail!("{} of {n} checks unanswered after {} s", n - ms.len() as u64, 4 * SECONDS + 10),
            }
        }
        if let Some(p) = dump_to {
            std::fs::write(format!("{p}-http-{keys}-{dispatch:?}-{t}"), dump)?;
        }
        Ok((ms, WARM * per))
    })?;
    let warm: usize = per_thread.iter().map(|(_, w)| w).sum();
    let mut all: Vec<f64> = per_thread.into_iter().flat_map(|(ms, _)| ms).collect();
    same_count(lab, before, (all.len() + warm) as u64)?;
    Ok((percentile(&mut all, 0.5), percentile(&mut all, 0.99)))
}

fn rss_kib(pid: u32) -> Result<u64> {
    rl_tests::proc_status_kib(pid, "VmRSS")
}

/// ns per decision of the engine alone, in this process (no transport).
fn engine_ns() -> Result<f64> {
    use rl_control::{
        config::Config,
        l7::engine::{DescriptorEntry, Engine},
    };
    let c = Config::from_str(&rules(), "<bench>")?;
    let e = Engine::new(&c.l7, 0, None);
    let n = 1_000_000u64;
    let values: Vec<String> = (0..1000).map(|i| i.to_string()).collect();
    let t = Instant::now();
    for i in 0..n {
        let d = [DescriptorEntry {
            key: "user".into(),
            value: values[(i % 1000) as usize].clone(),
        }];
        std::hint::black_box(e.decide("bench", &d, 1));
    }
    Ok(t.elapsed().as_nanos() as f64 / n as f64)
}

/// ms of one collector sweep over an engine holding `KEYS` keys, none of
/// them fresh (so every one is looked at and kept), in this process.
fn sweep_ms() -> Result<f64> {
    use rl_control::{
        config::Config,
        l7::engine::{DescriptorEntry, Engine},
    };
    let c = Config::from_str(&rules(), "<bench>")?;
    let e = Engine::new(&c.l7, 0, None);
    for i in 0..KEYS {
        e.decide(
            "bench",
            &[DescriptorEntry {
                key: "user".into(),
                value: i.to_string(),
            }],
            1,
        );
    }
    let t = Instant::now();
    let gone = e.collect();
    let ms = t.elapsed().as_secs_f64() * 1e3;
    if gone != 0 || e.keys() != KEYS {
        bail!("the sweep dropped {gone} keys that were not fresh");
    }
    Ok(ms)
}

fn main() -> Result<()> {
    let steal = rl_tests::StealMeter::start();
    let lab = Lab::new()?;
    let dir = tempfile::tempdir()?;
    let cfg = write(&dir, "rl.toml", &rules());
    let d = Daemon::serving(&lab, &cfg, &[])?;
    println!("rl request-decision benchmark (release daemon, 2 CPUs shared with the load generator), {RATE} requests/s offered for {SECONDS} s");
    // Runs one latency measurement; its result and a line with both sides'
    // CPU per request and the steal meanwhile (a vCPU the hypervisor holds
    // back stalls every request on it).
    let measured =
        |run: &dyn Fn() -> Result<(f64, f64, u64)>| -> Result<((f64, f64, u64), String)> {
            let (cpu, own) = (
                rl_tests::process_cpu_secs(d.pid())?,
                rl_tests::process_cpu_secs(std::process::id())?,
            );
            let steal = rl_tests::StealMeter::start();
            let out = run()?;
            let steal = steal.report().0;
            let per = |secs: f64| secs / (RATE * SECONDS) as f64 * 1e6;
            let (cpu, own) = (
                per(rl_tests::process_cpu_secs(d.pid())? - cpu),
                per(rl_tests::process_cpu_secs(std::process::id())? - own),
            );
            Ok((out, format!("  CPU per request: daemon {cpu:.1} µs, load generator {own:.1} µs; steal meanwhile {:.2}%", steal * 100.0)))
        };
    let latency = |keys: u64, paced: bool| -> Result<()> {
        let ((p50, p99, failed), cpu) = measured(&|| grpc_latency(&lab, keys, paced))?;
        let how = if paced {
            "paced one by one"
        } else {
            "released per ms"
        };
        println!(
            "gRPC ShouldRateLimit, {keys} key(s) in the store, {how}: p50 {p50:.3} ms, p99 {p99:.3} ms ({failed} failed); target p99 < 1 ms at {RATE}/s: {}",
            if p99 < 1.0 && failed == 0 { "met" } else { "MISSED" }
        );
        println!("{cpu}");
        Ok(())
    };
    let http = |keys: u64| -> Result<()> {
        for (connections, dispatch) in HTTP_LOADS {
            let ((p50, p99, _), cpu) = measured(&|| {
                http_latency(&lab, keys, connections, dispatch).map(|(p50, p99)| (p50, p99, 0))
            })?;
            let n = (connections / threads()).max(1) * threads();
            let how = match dispatch {
                Dispatch::InTurn => {
                    format!("{n} serial clients (each check waits for its own connection)")
                }
                Dispatch::AnyIdle => {
                    format!("a gateway's pool of {n} connections (each check on an idle one)")
                }
            };
            println!(
                "HTTP check, {keys} key(s), {how}: p50 {p50:.3} ms, p99 {p99:.3} ms; target p99 < 1 ms at {RATE}/s: {}",
                if p99 < 1.0 { "met" } else { "MISSED" }
            );
            println!("{cpu}");
        }
        Ok(())
    };
    if std::env::var_os("RL_BENCH_HTTP").is_some() {
        return http(1);
    }
    if std::env::var_os("RL_BENCH_SATURATION").is_some() {
        // For profiling the daemon: saturation only, its pid first.
        println!("daemon pid {}", d.pid());
        std::thread::sleep(Duration::from_secs(3));
        let rate = grpc_saturation(&lab)?;
        println!("gRPC at saturation (64 in flight): {rate:.0} decisions/s");
        d.stop(libc::SIGTERM)?;
        return Ok(());
    }
    for paced in [true, false] {
        latency(1, paced)?;
    }
    if std::env::var_os("RL_BENCH_QUICK").is_some() {
        return Ok(());
    }

    let before = rss_kib(d.pid())?;
    let t = Instant::now();
    grpc_fill(&lab, KEYS)?;
    let fill = t.elapsed().as_secs_f64();
    let after = rss_kib(d.pid())?;
    let held = rl_tests::http::parse_prometheus(&rl_tests::http::get(&lab.b, "/metrics").body)
        ["rl_l7_keys"];
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
        latency(KEYS, paced)?;
    }
    let cpu_before = rl_tests::process_cpu_secs(d.pid())?;
    let rate = grpc_saturation(&lab)?;
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
    println!(
        "the engine alone (match, hash, charge, quota; no transport): {:.0} ns per decision",
        engine_ns()?
    );
    println!(
        "one sweep of the store with {KEYS} keys in one go: {:.1} ms of a CPU (the daemon sweeps its 64 shards in turn over each second)",
        sweep_ms()?
    );
    for keys in [1, KEYS] {
        http(keys)?;
    }
    d.stop(libc::SIGTERM)?;
    println!("{}", steal.report().1);
    Ok(())
}
