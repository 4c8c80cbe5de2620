//! `cargo xtask bench`, admin API part: request latency at a steady 1,000
//! requests/s, and how long a `PUT /v1/rules` of 1,000 rules takes until it
//! is enforced, against a real daemon attached in a veth lab.
//!
//! Latency is measured open-loop: each request is due at a fixed 1 ms tick
//! and its latency runs from when it was due, so a slow answer also counts
//! against the requests queued behind it (no coordinated omission).

use std::time::{Duration, Instant};

use anyhow::{bail, Context, Result};
use rl_tests::{
    daemon::Daemon,
    lab::{Lab, VB},
    traffic::{join, paced, Receiver},
};

const RATE: u64 = 1_000;
const TOKEN: &str = "bench-token-0123456789";
const SECONDS: u64 = 5;

/// p50 and p99 (ms) of `path` requested at `RATE`/s for `SECONDS`, from a
/// thread inside the daemon's namespace over one keep-alive connection.
fn latency(lab: &Lab, path: &str) -> Result<(f64, f64, usize)> {
    let url = format!("http://127.0.0.1:9100{path}");
    let mut ms = lab.b.run(move || {
        let agent = ureq::AgentBuilder::new()
            .timeout(Duration::from_secs(5))
            .build();
        let n = RATE * SECONDS;
        let gap = Duration::from_nanos(1_000_000_000 / RATE);
        let mut out = Vec::with_capacity(n as usize);
        let start = Instant::now();
        for i in 0..n {
            let due = start + gap * i as u32;
            if let Some(w) = due.checked_duration_since(Instant::now()) {
                std::thread::sleep(w);
            }
            let r = agent
                .get(&url)
                .set("Authorization", &format!("Bearer {TOKEN}"))
                .call()
                .with_context(|| format!("GET {url}"))?;
            r.into_string()?;
            out.push((Instant::now() - due).as_secs_f64() * 1e3);
        }
        Ok(out)
    })?;
    ms.sort_by(|a, b| a.partial_cmp(b).unwrap());
    let at = |q: f64| ms[((ms.len() as f64 * q) as usize).min(ms.len() - 1)];
    Ok((at(0.50), at(0.99), ms.len()))
}

/// 1,000 rules; the last matches the bench's UDP packets with `burst`.
fn rule_set(tag: &str, burst: u64) -> serde_json::Value {
    let mut rules: Vec<serde_json::Value> = (0..999)
        .map(|i| serde_json::json!({"name": format!("{tag}{i}"), "proto": "tcp", "dst_ports": [1000 + i], "rate": 5}))
        .collect();
    rules.push(serde_json::json!({"name": format!("{tag}-udp"), "proto": "udp", "rate": 1, "burst": burst, "per": "60s"}));
    serde_json::json!({"default": {"rate": 100000}, "rules": rules})
}

fn main() -> Result<()> {
    let steal = rl_tests::StealMeter::start();
    let lab = Lab::new()?;
    let dir = tempfile::tempdir()?;
    let cfg = dir.path().join("rules.toml");
    // Over TCP, as a remote operator or scraper would: TCP needs a token.
    let token = dir.path().join("token");
    std::fs::write(&token, TOKEN)?;
    std::fs::set_permissions(&token, std::os::unix::fs::PermissionsExt::from_mode(0o600))?;
    std::fs::write(
        &cfg,
        format!(
            "[default]\nrate = 100000\n[api]\nlisten = \"127.0.0.1:9100\"\ntoken_file = \"{}\"\n",
            token.display()
        ),
    )?;
    let pid = dir.path().join("pid");
    let mut d = Daemon::spawn(
        &lab.b,
        &[
            "run",
            "--iface",
            VB,
            "--config",
            cfg.to_str().unwrap(),
            "--pid-file",
            pid.to_str().unwrap(),
            "--no-watch",
            "--detach-on-exit",
        ],
    )?;
    d.wait_for("admin API on", Duration::from_secs(20))?;
    // Some state to report on.
    join(paced(&lab.a, lab.v4(1), lab.v4(2), 10_000, 100))?;

    println!("rl admin API benchmark: {RATE} requests/s for {SECONDS} s per route, open loop, one keep-alive connection");
    let mut worst = 0f64;
    for path in [format!("/v1/sources/{}", lab.v4(1)), "/metrics".to_string()] {
        let (p50, p99, n) = latency(&lab, &path)?;
        worst = worst.max(p99);
        println!("GET {path:<28} p50 {p50:6.3} ms  p99 {p99:6.3} ms  ({n} requests)");
    }

    // Rule swap: two different sets of 1,000 rules, each PUT timed from the
    // request to its answer (the answer comes after the switch), then
    // checked with packets: exactly `burst` of the next 10 pass.
    let mut swaps = Vec::new();
    for (round, burst) in [("a", 3u64), ("b", 5), ("c", 2), ("d", 4)] {
        let body = serde_json::to_vec(&rule_set(round, burst))?;
        let took = lab.b.run(move || {
            let agent = ureq::AgentBuilder::new()
                .timeout(Duration::from_secs(30))
                .build();
            let t = Instant::now();
            let r = agent
                .put("http://127.0.0.1:9100/v1/rules")
                .set("Content-Type", "application/json")
                .set("Authorization", &format!("Bearer {TOKEN}"))
                .send_bytes(&body);
            let took = t.elapsed();
            match r {
                Ok(_) => Ok(took),
                Err(e) => bail!("PUT /v1/rules: {e}"),
            }
        })?;
        let rx = Receiver::start(&lab.b)?;
        join(paced(&lab.a, lab.v4(1), lab.v4(2), 10_000, 10))?;
        let passed = rx.finish()?.get(&lab.v4(1)).copied().unwrap_or(0);
        if passed != burst {
            bail!("after PUT {round}: {passed} of 10 passed, the new rule allows {burst}: not enforced");
        }
        swaps.push(took.as_secs_f64() * 1e3);
        println!("PUT /v1/rules (1,000 rules, set {round}): enforced after {:.1} ms ({passed} of 10 packets passed, as the new rule says)", took.as_secs_f64() * 1e3);
    }
    for line in d.log().lines().filter(|l| l.contains("api: PUT /v1/rules")) {
        println!(
            "  daemon: {}",
            line.split("now enforcing ").nth(1).unwrap_or(line)
        );
    }
    let (status, _) = d.stop(libc::SIGTERM)?;
    if !status.success() {
        bail!("the daemon exited with {status}");
    }
    println!("{}", steal.report().1);
    let slowest = swaps.iter().cloned().fold(0.0, f64::max);
    println!(
        "target p99 < 5 ms: {} ({worst:.3} ms worst p99)",
        if worst < 5.0 { "met" } else { "MISSED" }
    );
    println!(
        "target rule swap < 100 ms: {} ({slowest:.1} ms slowest)",
        if slowest < 100.0 { "met" } else { "MISSED" }
    );
    Ok(())
}
