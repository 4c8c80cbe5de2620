//! A real Redis (Debian's `redis-server`) for cluster tests, in a namespace
//! of the test's own (the hub) that every host lab reaches through a bridge;
//! stopped, killed and restarted by the tests; killed on drop.

use std::{
    net::IpAddr,
    process::{Child, Command, Stdio},
    time::{Duration, Instant},
};

use anyhow::{bail, Context, Result};

use crate::lab::{Lab, Netns};

/// The hub: a namespace with a bridge, `10.88.<id>.1/24`, that host labs
/// join with a veth each (`vr` in the lab's protected namespace).
pub struct Hub {
    pub ns: Netns,
    pub id: u32,
    joined: u32,
}

pub const BRIDGE: &str = "br0";
/// The hub's end of a lab in that lab's namespace.
pub const VR: &str = "vr";

impl Hub {
    pub fn new(id: u32) -> Result<Hub> {
        crate::lab::require_root();
        let ns = Netns::new(format!("rl-hub{id}"))?;
        ns.ip(&["link", "add", BRIDGE, "type", "bridge"])?;
        ns.ip(&["addr", "add", &format!("10.88.{id}.1/24"), "dev", BRIDGE])?;
        ns.ip(&["link", "set", BRIDGE, "up"])?;
        Ok(Hub { ns, id, joined: 0 })
    }

    /// The hub's own address (where Redis listens).
    pub fn addr(&self) -> IpAddr {
        format!("10.88.{}.1", self.id).parse().unwrap()
    }

    /// Connects `ns` (a lab's protected namespace) to the bridge; returns its
    /// address on the hub's network.
    pub fn join(&mut self, ns: &Netns) -> Result<IpAddr> {
        self.joined += 1;
        let port = format!("hp{}", self.joined);
        self.ns
            .ip(&["link", "add", &port, "type", "veth", "peer", "name", VR])?;
        self.ns.ip(&["link", "set", VR, "netns", &ns.name])?;
        self.ns
            .ip(&["link", "set", &port, "master", BRIDGE, "up"])?;
        let addr: IpAddr = format!("10.88.{}.{}", self.id, 10 + self.joined)
            .parse()
            .unwrap();
        ns.ip(&["addr", "add", &format!("{addr}/24"), "dev", VR])?;
        ns.ip(&["link", "set", VR, "up"])?;
        Ok(addr)
    }

    /// Joins the protected side of `lab`.
    pub fn join_lab(&mut self, lab: &Lab) -> Result<IpAddr> {
        self.join(&lab.b)
    }
}

/// A `redis-server` in the hub, listening on the hub's address.
pub struct Redis {
    child: Option<Child>,
    ns: String,
    pub host: IpAddr,
    pub port: u16,
    dir: tempfile::TempDir,
    extra: Vec<String>,
}

impl Redis {
    /// Starts Redis in `hub` on `port` (no persistence: a restart is empty).
    pub fn start(hub: &Hub, port: u16) -> Result<Redis> {
        Redis::start_with(&hub.ns, hub.addr(), port, &[])
    }

    /// Starts Redis in `ns` on `host:port` with `extra` server arguments.
    pub fn start_with(ns: &Netns, host: IpAddr, port: u16, extra: &[&str]) -> Result<Redis> {
        if Command::new("redis-server")
            .arg("--version")
            .output()
            .is_err()
        {
            bail!("redis-server is missing: install Debian's redis-server (`cargo xtask bootstrap` does)");
        }
        let dir = tempfile::Builder::new().prefix("rl-redis-").tempdir()?;
        let mut r = Redis {
            child: None,
            ns: ns.name.clone(),
            host,
            port,
            dir,
            extra: extra.iter().map(|s| s.to_string()).collect(),
        };
        r.launch()?;
        Ok(r)
    }

    fn launch(&mut self) -> Result<()> {
        let port = self.port.to_string();
        let child = Command::new("ip")
            .args([
                "netns",
                "exec",
                &self.ns,
                "redis-server",
                "--port",
                &port,
                "--bind",
                &self.host.to_string(),
            ])
            .args([
                "--save",
                "",
                "--appendonly",
                "no",
                "--protected-mode",
                "no",
                "--daemonize",
                "no",
                "--loglevel",
                "warning",
            ])
            .arg("--dir")
            .arg(self.dir.path())
            .args(&self.extra)
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .context("starting redis-server")?;
        self.child = Some(child);
        let deadline = Instant::now() + Duration::from_secs(10);
        while Instant::now() < deadline {
            if self.cli(&["PING"]).is_ok_and(|o| o.trim() == "PONG") {
                return Ok(());
            }
            std::thread::sleep(Duration::from_millis(20));
        }
        bail!(
            "redis-server on {}:{} did not answer PING within 10 s",
            self.host,
            self.port
        )
    }

    /// `redis://HOST:PORT`
    pub fn url(&self) -> String {
        format!("redis://{}:{}", self.host, self.port)
    }

    pub fn pid(&self) -> u32 {
        self.child.as_ref().map_or(0, |c| c.id())
    }

    /// Sends `signal` (SIGSTOP: Redis hangs; SIGCONT: it resumes), if it
    /// runs (pid 0 would signal the whole process group).
    pub fn signal(&self, signal: libc::c_int) {
        if let Some(c) = &self.child {
            unsafe { libc::kill(c.id() as i32, signal) };
        }
    }

    /// Kills Redis (SIGKILL) and waits for it.
    pub fn kill(&mut self) {
        if let Some(mut c) = self.child.take() {
            let _ = c.kill();
            let _ = c.wait();
        }
    }

    /// Starts it again, empty (nothing is persisted).
    pub fn restart(&mut self) -> Result<()> {
        self.kill();
        self.launch()
    }

    /// `redis-cli -h HOST -p PORT args…` in the hub; its output.
    pub fn cli(&self, args: &[&str]) -> Result<String> {
        let port = self.port.to_string();
        let out = Command::new("ip")
            .args([
                "netns",
                "exec",
                &self.ns,
                "redis-cli",
                "-h",
                &self.host.to_string(),
                "-p",
                &port,
            ])
            .args(args)
            .output()
            .context("running redis-cli (install Debian's redis-tools)")?;
        if !out.status.success() {
            bail!(
                "redis-cli {}: {}",
                args.join(" "),
                String::from_utf8_lossy(&out.stderr)
            );
        }
        Ok(String::from_utf8_lossy(&out.stdout).into_owned())
    }
}

impl Drop for Redis {
    fn drop(&mut self) {
        // A stopped process must resume to die promptly.
        self.signal(libc::SIGCONT);
        self.kill();
    }
}

/// A Redis Cluster in the hub: `masters` masters with `replicas` replicas
/// each, on consecutive ports from `first_port`, made with
/// `redis-cli --cluster create`; a failed master's replica takes over
/// after `cluster-node-timeout` (1 s).
pub struct RedisCluster {
    pub nodes: Vec<Redis>,
    ns: String,
}

impl RedisCluster {
    pub fn start(
        hub: &Hub,
        first_port: u16,
        masters: usize,
        replicas: usize,
    ) -> Result<RedisCluster> {
        let mut nodes = Vec::new();
        for i in 0..masters * (1 + replicas) {
            let port = first_port + i as u16;
            let conf = format!("nodes-{port}.conf");
            nodes.push(Redis::start_with(
                &hub.ns,
                hub.addr(),
                port,
                &[
                    "--cluster-enabled",
                    "yes",
                    "--cluster-config-file",
                    &conf,
                    "--cluster-node-timeout",
                    "1000",
                    "--repl-diskless-sync-delay",
                    "0",
                ],
            )?);
        }
        let addrs: Vec<String> = nodes
            .iter()
            .map(|n| format!("{}:{}", n.host, n.port))
            .collect();
        let out = Command::new("ip")
            .args([
                "netns",
                "exec",
                &hub.ns.name,
                "redis-cli",
                "--cluster",
                "create",
            ])
            .args(&addrs)
            .args(["--cluster-replicas", &replicas.to_string(), "--cluster-yes"])
            .output()
            .context("running redis-cli --cluster create")?;
        if !out.status.success() {
            bail!(
                "redis-cli --cluster create: {}{}",
                String::from_utf8_lossy(&out.stdout),
                String::from_utf8_lossy(&out.stderr)
            );
        }
        let c = RedisCluster {
            nodes,
            ns: hub.ns.name.clone(),
        };
        c.wait_ok(Duration::from_secs(20))?;
        // A replica that never synchronised cannot take over: wait for every
        // replica's link to its master.
        let deadline = Instant::now() + Duration::from_secs(20);
        while !c.nodes.iter().all(|n| {
            n.cli(&["INFO", "replication"])
                .is_ok_and(|i| i.contains("role:master") || i.contains("master_link_status:up"))
        }) {
            if Instant::now() > deadline {
                bail!("the Redis Cluster's replicas did not synchronise with their masters within 20 s");
            }
            std::thread::sleep(Duration::from_millis(100));
        }
        Ok(c)
    }

    /// Waits until every live node reports `cluster_state:ok`.
    pub fn wait_ok(&self, within: Duration) -> Result<()> {
        let deadline = Instant::now() + within;
        loop {
            let ok = self.nodes.iter().filter(|n| n.child.is_some()).all(|n| {
                n.cli(&["CLUSTER", "INFO"])
                    .is_ok_and(|i| i.contains("cluster_state:ok"))
            });
            if ok {
                return Ok(());
            }
            if Instant::now() >= deadline {
                bail!(
                    "the Redis Cluster in {} did not reach cluster_state:ok within {within:?}",
                    self.ns
                );
            }
            std::thread::sleep(Duration::from_millis(100));
        }
    }

    /// Waits until a replica has taken over from the dead node `victim`:
    /// the live nodes mark it failed, another master serves every slot, and
    /// the cluster is ok.
    pub fn wait_failover(&self, victim: usize, within: Duration) -> Result<Duration> {
        let t = Instant::now();
        let port = format!(":{}@", self.nodes[victim].port);
        let live = (0..self.nodes.len())
            .find(|&n| n != victim)
            .context("no live node")?;
        loop {
            let nodes = self.nodes[live]
                .cli(&["CLUSTER", "NODES"])
                .unwrap_or_default();
            let failed = nodes.lines().any(|l| {
                l.contains(&port)
                    && l.split_whitespace()
                        .nth(2)
                        .is_some_and(|f| f.split(',').any(|x| x == "fail"))
            });
            if failed && self.wait_ok(Duration::ZERO).is_ok() {
                return Ok(t.elapsed());
            }
            if t.elapsed() > within {
                bail!(
                    "no replica took over from node {} within {within:?}:\n{nodes}",
                    self.nodes[victim].port
                );
            }
            std::thread::sleep(Duration::from_millis(100));
        }
    }

    /// The seed URLs (the masters as made).
    pub fn seeds(&self, masters: usize) -> Vec<String> {
        self.nodes[..masters].iter().map(Redis::url).collect()
    }

    /// The live node that holds a key matching `pattern` as a master.
    pub fn master_holding(&self, pattern: &str) -> Option<usize> {
        self.nodes.iter().position(|n| {
            n.child.is_some()
                && n.cli(&["ROLE"]).is_ok_and(|r| r.starts_with("master"))
                && n.cli(&["KEYS", pattern])
                    .is_ok_and(|k| !k.trim().is_empty())
        })
    }
}
