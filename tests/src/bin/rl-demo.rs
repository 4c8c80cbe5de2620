//! `cargo xtask demo`: a throwaway veth lab, the real `rl-control` daemon on
//! its embedded default (1000 packets/s, burst 2000 per source), floods from
//! several IPv4 and IPv6 sources plus one calm source, and a table of what
//! each source got through against what the limiter should allow.

use std::{net::IpAddr, time::Duration};

use anyhow::{bail, Result};
use rl_tests::{
    daemon::{final_counter, Daemon},
    expected_passed,
    lab::{Lab, VB},
    tolerance,
    traffic::{flood, join, paced, Receiver, Sent},
};

const RATE: u64 = 1000;
const BURST: u64 = 2000;
const SECONDS: u64 = 5;

fn main() -> Result<()> {
    println!("rl demo: building a veth lab in two network namespaces");
    let lab = Lab::new()?;
    let floods: Vec<IpAddr> = vec![lab.v4(1), lab.v4(3), lab.v4(4), lab.v6(1)];
    let calm = lab.v4(5);
    for ip in [lab.v4(3), lab.v4(4), calm] {
        lab.add_source(&format!("{ip}/24"))?;
    }
    println!(
        "starting `rl-control run --iface {VB}` (no --config: the embedded default) in {}",
        lab.b.name
    );
    let mut daemon = Daemon::spawn(
        &lab.b,
        &[
            "run",
            "--iface",
            VB,
            "--stats-interval",
            "2",
            "--detach-on-exit",
        ],
    )?;
    daemon.wait_for("attached:", Duration::from_secs(20))?;
    for line in daemon.log().lines() {
        println!("  daemon | {line}");
    }

    let rx = Receiver::start(&lab.b)?;
    println!(
        "flooding for {SECONDS} s from {} sources as fast as they can, and from {calm} at 500 packets/s (under the limit)",
        floods.len()
    );
    let handles: Vec<_> = floods
        .iter()
        .map(|src| {
            let dst = if src.is_ipv6() { lab.v6(2) } else { lab.v4(2) };
            flood(&lab.a, *src, dst, Duration::from_secs(SECONDS), None)
        })
        .collect();
    let calm_handle = paced(&lab.a, calm, lab.v4(2), 500, 500 * SECONDS);
    let sent: Vec<Sent> = handles.into_iter().map(join).collect::<Result<_>>()?;
    let calm_sent = join(calm_handle)?;
    let got = rx.finish()?;
    let (status, log) = daemon.stop(libc::SIGTERM)?;

    println!();
    println!(
        "{:<22} {:>10} {:>10} {:>10} {:>20}  ",
        "source", "sent", "passed", "dropped", "expected passed"
    );
    let mut all_ok = true;
    let mut row = |src: IpAddr, s: &Sent, expected: f64, tol: f64| {
        let passed = got.get(&src).copied().unwrap_or(0);
        let ok = (passed as f64 - expected).abs() <= tol;
        all_ok &= ok;
        println!(
            "{:<22} {:>10} {:>10} {:>10} {:>12.0} ± {:<5.0}  {}",
            src.to_string(),
            s.packets,
            passed,
            s.packets.saturating_sub(passed),
            expected,
            tol,
            if ok { "ok" } else { "OFF" }
        );
    };
    for (src, s) in floods.iter().zip(&sent) {
        let expected = expected_passed(RATE, BURST, s.seconds());
        row(*src, s, expected, tolerance(expected));
    }
    row(calm, &calm_sent, calm_sent.packets as f64, 0.0);
    println!(
        "\nexpected passed = burst {BURST} + {RATE}/s × flood seconds (±1%); the calm source must lose nothing."
    );
    println!(
        "daemon: {status}; final counters passed_packets={} dropped_packets={}",
        final_counter(&log, "passed_packets").unwrap_or(0),
        final_counter(&log, "dropped_packets").unwrap_or(0)
    );
    drop(lab);
    println!("lab removed.");
    if !status.success() || !all_ok {
        bail!("the demo did not match the expected numbers");
    }
    Ok(())
}
