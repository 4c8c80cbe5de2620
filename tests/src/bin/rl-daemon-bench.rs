//! `cargo xtask bench`, daemon part (issue 9): what the running daemon costs
//! and loses, against the release binary in a veth lab with pinned maps.
//! - packets a paced source loses while the daemon restarts (the new one
//!   adopts the pins and replaces the program: the upgrade path);
//! - `/metrics` latency while bans are added and lifted back to back over
//!   100,000 installed CIDRs;
//! - the daemon's peak RSS (VmHWM) with 1,000,000 tracked sources, written
//!   into its pinned table, after the collector and the top ranking ran.

use std::{
    sync::{
        atomic::{AtomicBool, AtomicU64, Ordering},
        Arc,
    },
    time::{Duration, Instant},
};

use anyhow::{bail, Result};
use rl_common::{Bucket, Key4};
use rl_control::{compile::compile, config::Config};
use rl_tests::{
    daemon::{write, Daemon},
    http::get,
    lab::{BpfFs, Lab},
    traffic::{join, paced, Receiver},
};

fn vm_hwm_kib(pid: u32) -> Result<u64> {
    rl_tests::proc_status_kib(pid, "VmHWM")
}

/// Packets lost by a 1,000 pps source across a daemon restart.
fn restart_loss(lab: &Lab, pins: &BpfFs, cfg: &std::path::Path) -> Result<(u64, u64, f64)> {
    let d = Daemon::pinned(lab, cfg, pins, &[])?;
    let rx = Receiver::start(&lab.b)?;
    let sender = paced(&lab.a, lab.v4(1), lab.v4(2), 1000, 4000);
    std::thread::sleep(Duration::from_millis(1000));
    let t = Instant::now();
    let (status, log) = d.stop(libc::SIGTERM)?;
    if !status.success() {
        bail!("the daemon did not stop cleanly:\n{log}");
    }
    let d = Daemon::pinned(lab, cfg, pins, &["--detach-on-exit"])?;
    let took = t.elapsed().as_secs_f64();
    let sent = join(sender)?;
    let got = rx.finish()?.get(&lab.v4(1)).copied().unwrap_or(0);
    d.stop(libc::SIGTERM)?;
    Ok((sent.packets, sent.packets - got.min(sent.packets), took))
}

/// `/metrics` p50/p99 (ms) while bans churn over 100,000 CIDRs.
fn metrics_under_churn(lab: &Lab, dir: &std::path::Path) -> Result<(f64, f64, u64, usize)> {
    let mut text = String::from("[default]\nrate = 1000\n");
    for i in 0..100_000u32 {
        text += &format!(
            "[[deny]]\ncidr = \"100.{}.{}.{}/32\"\n",
            64 + (i >> 16) % 64,
            (i >> 8) & 255,
            i & 255
        );
    }
    let cfg = write_in(dir, "churn.toml", &text)?;
    let d = Daemon::serving(lab, &cfg, &[])?;
    let stop = Arc::new(AtomicBool::new(false));
    let churned = Arc::new(AtomicU64::new(0));
    let churn = {
        let (sock, stop, churned) = (
            lab.b.runtime_dir().join("api.sock"),
            stop.clone(),
            churned.clone(),
        );
        std::thread::spawn(move || -> Result<()> {
            let mut i = 0u32;
            while !stop.load(Ordering::Relaxed) {
                let cidr = format!("198.18.{}.0/24", i % 256);
                let body = serde_json::to_vec(&serde_json::json!({"cidr": cidr, "ttl_secs": 600}))?;
                let (c1, _) = rl_control::cli::unix_request(
                    &sock,
                    "POST",
                    "/v1/bans",
                    Some(("application/json", &body)),
                    None,
                )?;
                let (c2, _) = rl_control::cli::unix_request(
                    &sock,
                    "DELETE",
                    &format!("/v1/bans/{}", cidr.replace('/', "%2F")),
                    None,
                    None,
                )?;
                if (c1, c2) != (201, 200) {
                    bail!("ban churn answered {c1} and {c2}");
                }
                churned.fetch_add(2, Ordering::Relaxed);
                i += 1;
            }
            Ok(())
        })
    };
    let mut ms = Vec::new();
    let start = Instant::now();
    while start.elapsed() < Duration::from_secs(10) {
        let t = Instant::now();
        if get(&lab.b, "/metrics").status != 200 {
            bail!("/metrics failed");
        }
        ms.push(t.elapsed().as_secs_f64() * 1e3);
        std::thread::sleep(Duration::from_millis(2));
    }
    stop.store(true, Ordering::Relaxed);
    churn
        .join()
        .map_err(|_| anyhow::anyhow!("the churn thread panicked"))??;
    d.stop(libc::SIGTERM)?;
    ms.sort_by(|a, b| a.partial_cmp(b).unwrap());
    Ok((
        ms[ms.len() / 2],
        ms[ms.len() * 99 / 100],
        churned.load(Ordering::Relaxed),
        ms.len(),
    ))
}

fn write_in(dir: &std::path::Path, name: &str, text: &str) -> Result<std::path::PathBuf> {
    let p = dir.join(name);
    std::fs::write(&p, text)?;
    Ok(p)
}

/// Peak RSS (MiB) of a daemon tracking `n` sources (one in ten dropping).
fn rss_with_sources(lab: &Lab, pins: &BpfFs, dir: &std::path::Path, n: u32) -> Result<(f64, f64)> {
    let text = "[default]\nrate = 1000\nburst = 2000\n";
    let cfg = write_in(dir, "rss.toml", text)?;
    let d = Daemon::pinned(lab, &cfg, pins, &["--detach-on-exit"])?;
    let before = vm_hwm_kib(d.pid())? as f64 / 1024.0;
    let rule = compile(&Config::from_str(text, "<bench>")?).rules.entries[0];
    let map = aya::maps::MapData::from_pin(pins.path().join("vb").join(rl_common::MAP_SOURCES_V4))?;
    let mut table: aya::maps::HashMap<aya::maps::MapData, Key4, Bucket> =
        aya::maps::HashMap::try_from(aya::maps::Map::from_map_data(map)?)?;
    let hour_ahead = rl_control::datapath::monotonic_ns() + 3_600_000_000_000;
    for i in 0..n {
        let addr = u32::from_be_bytes([10, (i >> 16) as u8, (i >> 8) as u8, i as u8]).to_be();
        let b = Bucket {
            tat_ns: hour_ahead,
            passed: 2000,
            dropped: if i % 10 == 0 { 5 } else { 0 },
            last_drop_ns: 0,
        };
        table.insert(rule.key4(0, addr), b, 0)?;
    }
    // Buckets written from here are not counted as created by the
    // datapath, and the collector does not walk tables that were empty at
    // its last walk with nothing created since: a few real packets from a
    // new source make it walk.
    join(paced(&lab.a, lab.v4(1), lab.v4(2), 100, 5))?;
    // Two top rankings (every 5 collector passes of 1 s) and then some.
    std::thread::sleep(Duration::from_secs(12));
    let tracked = get(&lab.b, "/v1/status").json()["tracked_sources"]
        .as_u64()
        .unwrap_or(0);
    if tracked < n as u64 {
        bail!("the daemon tracks {tracked} sources, {n} were written");
    }
    let peak = vm_hwm_kib(d.pid())? as f64 / 1024.0;
    d.stop(libc::SIGTERM)?;
    Ok((before, peak))
}

fn main() -> Result<()> {
    let steal = rl_tests::StealMeter::start();
    let lab = Lab::new()?;
    let pins = BpfFs::new()?;
    let dir = tempfile::tempdir()?;
    let cfg = write(&dir, "rl.toml", "[default]\nrate = 100000\n");
    println!("rl daemon benchmark (release binary, veth lab, pins on a bpffs outside /sys)");
    let (sent, lost, took) = restart_loss(&lab, &pins, &cfg)?;
    println!(
        "restart (the new daemon adopts the pins and replaces the program, as an upgrade does): {lost} of {sent} paced packets lost \
         (stop to serving again: {took:.2} s); target 0: {}",
        if lost == 0 { "met" } else { "MISSED" }
    );
    let (p50, p99, churned, n) = metrics_under_churn(&lab, dir.path())?;
    println!(
        "GET /metrics during ban churn over 100,000 CIDRs: p50 {p50:.3} ms, p99 {p99:.3} ms ({n} requests, {churned} ban changes); target p99 < 5 ms: {}",
        if p99 < 5.0 { "met" } else { "MISSED" }
    );
    let n = 1_000_000;
    let (before, peak) = rss_with_sources(&lab, &pins, dir.path(), n)?;
    println!(
        "daemon peak RSS (VmHWM): {before:.1} MiB at start, {peak:.1} MiB with {n} tracked sources (100,000 of them dropping); target ≤ 256 MiB: {}",
        if peak <= 256.0 { "met" } else { "MISSED" }
    );
    println!("{}", steal.report().1);
    Ok(())
}
