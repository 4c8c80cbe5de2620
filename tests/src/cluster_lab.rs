//! Hosts sharing a packet rule through Redis: each host a lab with its own
//! veth, XDP and `rl-control`, all reaching one Redis through the hub's
//! bridge; one forged source floods any of them. For the cluster tests and
//! `cargo xtask bench`.

use std::time::Duration;

use anyhow::Result;

use crate::{
    daemon::{write, Daemon},
    frames::{eth, ipv4, udp, ETH_P_IP, UDP},
    http::get,
    lab::{Lab, VA},
    redis::{Hub, Redis},
    traffic::{forged, join, Sent},
};

/// The shared rule: `RATE` packets/s, burst `BURST`, synced every `SYNC_S`.
pub const RATE: u64 = 200;
pub const BURST: u64 = 20;
pub const SYNC_S: f64 = 0.1;
pub const SOURCE: [u8; 4] = [198, 51, 100, 7];
pub const PORT: u16 = 9000;
pub const RULE: &str = "udp-9000";

fn config(redis: &str, node: &str, on_failure: &str) -> String {
    format!(
        "[default]\nrate = 1000000\n\
         [cluster]\nredis = [\"{redis}\"]\nnode = \"{node}\"\nsync_interval = \"100ms\"\ntimeout = \"300ms\"\non_failure = \"{on_failure}\"\n\
         [[rule]]\nname = \"{RULE}\"\nproto = \"udp\"\ndst_ports = [{PORT}]\nrate = {RATE}\nburst = {BURST}\nscope = \"cluster\"\n"
    )
}

/// The hub, its Redis, the hosts and their daemons (fields drop in
/// declaration order: daemons first, the hub last).
pub struct ClusterLab {
    pub daemons: Vec<Daemon>,
    pub redis: Redis,
    pub labs: Vec<Lab>,
    pub hub: Hub,
    _dir: tempfile::TempDir,
}

impl ClusterLab {
    /// One host per `on_failure` entry, each running the shared rule.
    pub fn new(hub_id: u32, on_failure: &[&str]) -> Result<ClusterLab> {
        let mut hub = Hub::new(hub_id)?;
        let labs: Vec<Lab> = on_failure
            .iter()
            .map(|_| Lab::new())
            .collect::<Result<_>>()?;
        for lab in &labs {
            hub.join_lab(lab)?;
        }
        let redis = Redis::start(&hub, 6379)?;
        let dir = tempfile::tempdir()?;
        let mut daemons = Vec::new();
        for (i, (lab, mode)) in labs.iter().zip(on_failure).enumerate() {
            let cfg = write(
                &dir,
                &format!("h{i}.toml"),
                &config(&redis.url(), &format!("host-{i}"), mode),
            );
            daemons.push(Daemon::serving(lab, &cfg, &[])?);
        }
        Ok(ClusterLab {
            daemons,
            redis,
            labs,
            hub,
            _dir: dir,
        })
    }

    /// The documented bound for `secs` of traffic from every host (δ taken
    /// as 10 ms, far above the lab's round trip).
    pub fn bound(&self, secs: f64) -> f64 {
        let (r, n, b) = (RATE as f64, self.labs.len() as f64, BURST as f64);
        let theta = (r * SYNC_S / 4.0).max(1.0);
        r * secs + n * b + (n - 1.0) * r * (SYNC_S + 0.01) + n * theta
    }

    /// Packets the rule let through on host `i` (shadow drops pass too:
    /// `on_failure = "open"`).
    pub fn passed(&self, i: usize) -> u64 {
        let r = &get(&self.labs[i].b, "/v1/stats").json()["rules"][RULE];
        r["passed_packets"].as_u64().unwrap_or(0)
            + r["shadow_dropped_packets"].as_u64().unwrap_or(0)
    }

    pub fn dropped(&self, i: usize) -> u64 {
        get(&self.labs[i].b, "/v1/stats").json()["rules"][RULE]["dropped_packets"]
            .as_u64()
            .unwrap_or(0)
    }

    pub fn total(&self) -> u64 {
        (0..self.labs.len()).map(|i| self.passed(i)).sum()
    }

    /// `count` frames from [`SOURCE`] to the rule's port at `pps` on host `i`.
    pub fn flood(&self, i: usize, count: u64, pps: u64) -> std::thread::JoinHandle<Result<Sent>> {
        forged(
            &self.labs[i].a,
            VA,
            eth(&[], ETH_P_IP, &ipv4(SOURCE, UDP, &[], &udp(PORT))),
            count,
            pps,
            None,
            |_| SOURCE,
        )
    }

    /// Every host floods `count` frames at `pps` at once; returns what they
    /// passed together and how long the longest sender took.
    pub fn flood_all(&self, count: u64, pps: u64) -> Result<(u64, f64)> {
        let before = self.total();
        let senders: Vec<_> = (0..self.labs.len())
            .map(|i| self.flood(i, count, pps))
            .collect();
        let mut took: f64 = 0.0;
        for h in senders {
            took = took.max(join(h)?.seconds());
        }
        std::thread::sleep(Duration::from_millis(300));
        Ok((self.total() - before, took))
    }
}
