//! Real gateways in a lab namespace, stopped on drop: Envoy (see
//! [`crate::envoy`]), and in front of rl's HTTP check the forward-auth
//! gateways Caddy (`forward_auth`) and nginx (`auth_request`), Debian's
//! `caddy` and `nginx-light`, installed by the bootstrap.
//! And a plain HTTP/1.1 GET from a chosen loopback address, so a test can
//! be several clients.

use std::{
    collections::HashMap,
    io::{Read, Write},
    process::{Child, Command, Stdio},
    time::{Duration, Instant},
};

use anyhow::{bail, Context, Result};

use crate::lab::Netns;

/// A running gateway.
pub struct Gateway {
    child: Child,
    log: std::path::PathBuf,
}

impl Gateway {
    /// Starts Caddy in `ns` with the Caddyfile `config`, its state kept in
    /// `dir`; returns once 127.0.0.1:`port` accepts connections.
    pub fn caddy(ns: &Netns, dir: &std::path::Path, config: &str, port: u16) -> Result<Gateway> {
        let file = dir.join("Caddyfile");
        std::fs::write(&file, config)?;
        let mut cmd = command(ns, "caddy", "caddy")?;
        cmd.args(["run", "--adapter", "caddyfile", "--config"])
            .arg(&file)
            // Caddy keeps its state under $HOME and $XDG_*: all in `dir`.
            .env("HOME", dir)
            .env("XDG_DATA_HOME", dir)
            .env("XDG_CONFIG_HOME", dir);
        Gateway::listening(cmd, dir.join("caddy.log"), ns, port)
    }

    /// Starts nginx in `ns` with `config` (an `http { … }` block and what
    /// goes before it; `dir` is its prefix, for relative paths) in the
    /// foreground; returns once 127.0.0.1:`port` accepts connections.
    pub fn nginx(ns: &Netns, dir: &std::path::Path, config: &str, port: u16) -> Result<Gateway> {
        let file = dir.join("nginx.conf");
        std::fs::write(&file, config)?;
        let mut cmd = command(ns, "nginx", "nginx-light")?;
        cmd.arg("-p")
            .arg(dir)
            .arg("-c")
            .arg(&file)
            .args(["-g", "daemon off; master_process off;"]);
        Gateway::listening(cmd, dir.join("nginx.log"), ns, port)
    }

    /// `cmd` (its stderr into `log`), once 127.0.0.1:`port` accepts
    /// connections in `ns`.
    fn listening(
        mut cmd: Command,
        log: std::path::PathBuf,
        ns: &Netns,
        port: u16,
    ) -> Result<Gateway> {
        cmd.stderr(std::fs::File::create(&log)?);
        let ready = || {
            ns.run(move || Ok(std::net::TcpStream::connect(("127.0.0.1", port)).is_ok()))
                .unwrap_or(false)
        };
        Gateway::run(cmd, log, "the gateway", &ready)
    }

    /// Starts `cmd`, its log in `log`; returns once it is `ready` (20 s at
    /// most), or fails with its log.
    pub fn run(
        mut cmd: Command,
        log: std::path::PathBuf,
        what: &str,
        ready: &dyn Fn() -> bool,
    ) -> Result<Gateway> {
        let child = cmd
            .stdout(Stdio::null())
            .spawn()
            .with_context(|| format!("starting {what}"))?;
        let mut gw = Gateway { child, log };
        let deadline = Instant::now() + Duration::from_secs(20);
        loop {
            if ready() {
                return Ok(gw);
            }
            if let Some(status) = gw.child.try_wait()? {
                bail!("{what} exited ({status}): {}", gw.log());
            }
            if Instant::now() > deadline {
                bail!("{what} was not ready within 20 s: {}", gw.log());
            }
            std::thread::sleep(Duration::from_millis(100));
        }
    }

    pub fn log(&self) -> String {
        std::fs::read_to_string(&self.log).unwrap_or_default()
    }
}

/// `program` run in `ns`, or why it cannot be.
fn command(ns: &Netns, program: &str, package: &str) -> Result<Command> {
    if Command::new("sh")
        .args(["-c", &format!("command -v {program}")])
        .output()
        .map(|o| !o.status.success())
        .unwrap_or(true)
    {
        bail!("{program} is not installed (Debian package {package}): run `cargo xtask bootstrap`");
    }
    let mut cmd = Command::new("ip");
    cmd.args(["netns", "exec", &ns.name, program]);
    Ok(cmd)
}

impl Drop for Gateway {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// An HTTP answer: status, headers (names lowercased), body.
#[derive(Debug)]
pub struct Reply {
    pub status: u16,
    pub headers: HashMap<String, String>,
    pub body: String,
}

impl Reply {
    /// A header's value ("" when absent).
    pub fn header(&self, name: &str) -> &str {
        self.headers.get(name).map(String::as_str).unwrap_or("")
    }
}

/// `GET path` on `to` from the local address `from` (any 127/8 address is
/// the host's own), with extra `headers`, in `ns`.
pub fn get_from(
    ns: &Netns,
    from: &str,
    to: &str,
    path: &str,
    headers: &[(&str, &str)],
) -> Result<Reply> {
    let (from, to): (std::net::SocketAddr, std::net::SocketAddr) =
        (format!("{from}:0").parse()?, to.parse()?);
    let mut req = format!("GET {path} HTTP/1.1\r\nHost: {to}\r\nConnection: close\r\n");
    for (k, v) in headers {
        req += &format!("{k}: {v}\r\n");
    }
    req += "\r\n";
    let path = path.to_string();
    ns.run(move || {
        let rt = tokio::runtime::Builder::new_current_thread()
            .enable_io()
            .build()?;
        let s = rt.block_on(async {
            let s = tokio::net::TcpSocket::new_v4()?;
            s.bind(from)?;
            s.connect(to).await
        });
        let s = s
            .with_context(|| format!("connecting from {from} to {to}"))?
            .into_std()?;
        drop(rt);
        s.set_nonblocking(false)?;
        s.set_read_timeout(Some(Duration::from_secs(10)))?;
        let mut s = s;
        s.write_all(req.as_bytes())?;
        let mut raw = Vec::new();
        s.read_to_end(&mut raw)
            .with_context(|| format!("reading the answer to GET {path}"))?;
        parse(&String::from_utf8_lossy(&raw))
    })
}

/// A whole `Connection: close` answer (a `Content-Length` or unframed body).
fn parse(raw: &str) -> Result<Reply> {
    let (head, body) = raw
        .split_once("\r\n\r\n")
        .with_context(|| format!("not an HTTP answer: {raw:?}"))?;
    let mut lines = head.split("\r\n");
    let status = lines
        .next()
        .and_then(|l| l.split_whitespace().nth(1))
        .and_then(|c| c.parse().ok())
        .with_context(|| format!("no status in {head:?}"))?;
    let headers = lines
        .filter_map(|l| l.split_once(':'))
        .map(|(k, v)| (k.trim().to_ascii_lowercase(), v.trim().to_string()))
        .collect();
    Ok(Reply {
        status,
        headers,
        body: body.to_string(),
    })
}
