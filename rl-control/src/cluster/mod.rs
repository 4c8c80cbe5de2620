//! Cluster-wide limits through Redis: the only room that talks to Redis.
//!
//! - [`settings`]: `[cluster]` and a rule's `scope`.
//! - [`requests`]: `scope = "cluster"` request rules, decided by one Lua
//!   script call per decision (server time, atomic, exact).
//! - [`members`]: which definition of a cluster rule each daemon holds; a
//!   daemon whose definition differs refuses to join.
//!
//! Redis is never on the packet path, and never holds a decision longer
//! than `timeout`: a call that fails or is slower marks the cluster
//! degraded, cluster rules then enforce `on_failure` without calling Redis,
//! and probes every `sync_interval` bring them back ([`health`]: after
//! more answers in a row each time it failed again soon after).
//!
//! A decision that reached Redis after its caller gave up is not applied:
//! each probe reads Redis' clock ([`RedisClock`]), and a charge carries the
//! deadline, in Redis' time, past which `decide.lua` refuses it.

pub mod batched;
pub mod health;
pub mod members;
pub mod packets;
pub mod requests;
pub mod settings;

use std::{
    sync::{
        atomic::{AtomicBool, AtomicU64, Ordering::Relaxed},
        Arc, Mutex,
    },
    time::Duration,
};

use redis::{aio::ConnectionManager, cluster_async::ClusterConnection, FromRedisValue};
use tracing::{info, warn};

pub use settings::{ClusterConfig, OnFailure, Scope};

/// A connection to the shared Redis: one server, or a Redis Cluster.
#[derive(Clone)]
enum Conn {
    One(ConnectionManager),
    Many(ClusterConnection),
}

/// Why a Redis call gave no answer.
#[derive(Debug, thiserror::Error)]
pub enum Failure {
    #[error("Redis did not answer within {0} ms")]
    Timeout(u64),
    #[error("Redis failed: {0}")]
    Redis(String),
    #[error("the cluster is degraded: Redis calls wait for the next probe")]
    Degraded,
}

/// Counters and state for `/v1/status` and `/metrics`.
#[derive(Default)]
pub struct Health {
    degraded: AtomicBool,
    /// Unix ms when the current degraded spell began (0: healthy).
    since_ms: AtomicU64,
    pub calls_ok: AtomicU64,
    pub calls_failed: AtomicU64,
    /// Decisions answered by `on_failure` instead of Redis.
    pub fallbacks: AtomicU64,
    /// Degraded spells announced (events and warnings) since the start.
    pub spells: AtomicU64,
    /// Whether the degraded spell under way was announced (the one before
    /// the first probe is not, unless that probe fails).
    announced: AtomicBool,
    last_error: Mutex<String>,
}

/// The cluster as `/v1/status` reports it.
#[derive(Clone, Debug, serde::Serialize, utoipa::ToSchema)]
pub struct ClusterStatus {
    /// `ok` or `degraded` (Redis unreachable or too slow: cluster rules
    /// enforce `on_failure`).
    pub state: &'static str,
    pub node: String,
    pub redis: Vec<String>,
    pub on_failure: &'static str,
    /// Unix ms when the degraded spell began.
    pub degraded_since_unix_ms: Option<u64>,
    pub last_error: String,
    pub calls_ok: u64,
    pub calls_failed: u64,
    pub fallbacks: u64,
    /// Degraded spells since the start.
    pub degraded_spells: u64,
    /// Degraded: probes answered in a row still needed before the cluster
    /// is shared again (more than 1 after it failed again within a minute
    /// of a recovery; 0 when healthy).
    pub probes_to_recover: u32,
    /// Cluster rules another daemon defines differently: they stay in
    /// `on_failure` until the definitions agree.
    pub mismatched: Vec<String>,
    /// Why the packet-rule sync failed here in its last round (reading or
    /// raising the bucket tables), if it did: cluster packet rules are not
    /// shared while it lasts, each host enforces them alone.
    pub sync_error: Option<String>,
}

/// A change of the cluster's health, for the event log.
pub type Transition = (&'static str, String);

/// The daemon's handle on the shared Redis.
pub struct Cluster {
    pub config: ClusterConfig,
    conn: tokio::sync::RwLock<Option<Conn>>,
    pub health: Health,
    /// Rule names whose definition differs from another daemon's.
    mismatched: Mutex<Vec<String>>,
    /// Health changes not yet written to the event log.
    transitions: Mutex<Vec<Transition>>,
    /// The packet-rule sync's counts, as of its last round.
    pub sync: Mutex<packets::SyncStats>,
    /// Why the packet-rule sync's last round failed here (reading or
    /// raising the bucket tables), if it did: cluster packet rules then
    /// enforce on each host alone.
    pub sync_error: Mutex<Option<String>>,
    /// When a degraded cluster is healthy again.
    breaker: Mutex<health::Breaker>,
    /// Redis' clock as of the last probe that read it.
    clock: Mutex<Option<RedisClock>>,
}

/// Redis' clock, read by a probe, on this host's monotonic clock (a step
/// of the wall clock here changes nothing). Its error is at most half the
/// round trip that read it.
#[derive(Clone, Copy, Debug)]
struct RedisClock {
    at: std::time::Instant,
    redis_us: u64,
    /// The round trip it was read in: how early deadlines may fall.
    rtt: Duration,
}

/// How long a clock reading is kept against slower ones: clocks drift
/// apart by microseconds a minute, and a clock stepped meanwhile is read
/// again within this.
const CLOCK_KEPT: Duration = Duration::from_secs(10);

static TIME: std::sync::LazyLock<redis::Script> = std::sync::LazyLock::new(|| {
    redis::Script::new(
        "local t = redis.call('TIME') return tonumber(t[1]) * 1000000 + tonumber(t[2])",
    )
});

impl Cluster {
    /// A handle that connects lazily: a Redis down at start leaves the
    /// daemon running with cluster rules in `on_failure`.
    pub fn new(config: ClusterConfig) -> Arc<Cluster> {
        let c = Arc::new(Cluster {
            conn: tokio::sync::RwLock::new(None),
            health: Health::default(),
            mismatched: Mutex::new(Vec::new()),
            transitions: Mutex::new(Vec::new()),
            sync: Mutex::new(packets::SyncStats::default()),
            sync_error: Mutex::new(None),
            breaker: Mutex::new(health::Breaker::new(Duration::from_millis(
                config.sync_interval_ms,
            ))),
            clock: Mutex::new(None),
            config,
        });
        // Degraded until the first probe answers; announced only if it
        // does not.
        c.health.degraded.store(true, Relaxed);
        *c.health
            .last_error
            .lock()
            .unwrap_or_else(|e| e.into_inner()) = "not connected yet".into();
        c
    }

    pub fn timeout(&self) -> Duration {
        Duration::from_millis(self.config.timeout_ms)
    }

    pub fn is_degraded(&self) -> bool {
        self.health.degraded.load(Relaxed)
    }

    fn breaker(&self) -> std::sync::MutexGuard<'_, health::Breaker> {
        self.breaker.lock().unwrap_or_else(|e| e.into_inner())
    }

    fn set_degraded(&self, why: String) {
        *self
            .health
            .last_error
            .lock()
            .unwrap_or_else(|e| e.into_inner()) = why.clone();
        let mut breaker = self.breaker();
        if self.health.degraded.swap(true, Relaxed) {
            breaker.failed();
        } else {
            breaker.degraded(std::time::Instant::now());
        }
        if !self.health.announced.swap(true, Relaxed) {
            self.health
                .since_ms
                .store(crate::config::unix_now_ms(), Relaxed);
            self.health.spells.fetch_add(1, Relaxed);
            warn!(on_failure = self.config.on_failure.name(), "cluster degraded: {why}; cluster rules enforce on_failure = \"{}\" until Redis answers again", self.config.on_failure.name());
            self.transitions
                .lock()
                .unwrap_or_else(|e| e.into_inner())
                .push(("cluster_degraded", why));
        }
    }

    /// A probe answered: healthy again if the breaker says so.
    fn answered(&self) {
        if !self.is_degraded() {
            return;
        }
        let mut breaker = self.breaker();
        if !breaker.answered(
            std::time::Instant::now(),
            self.health.announced.load(Relaxed),
        ) {
            return;
        }
        self.health.degraded.store(false, Relaxed);
        self.health.since_ms.store(0, Relaxed);
        if self.health.announced.swap(false, Relaxed) {
            info!("cluster healthy: Redis answers again; cluster rules are shared again");
            self.transitions
                .lock()
                .unwrap_or_else(|e| e.into_inner())
                .push(("cluster_recovered", String::new()));
        }
    }

    /// Health changes since the last call, oldest first.
    pub fn take_transitions(&self) -> Vec<Transition> {
        std::mem::take(&mut *self.transitions.lock().unwrap_or_else(|e| e.into_inner()))
    }

    /// Tests: the rules another host defines differently, as a probe
    /// that answered would find them (so healthy).
    #[cfg(test)]
    pub fn set_mismatched(&self, rules: Vec<String>) {
        *self.mismatched.lock().unwrap_or_else(|e| e.into_inner()) = rules;
        self.answered();
    }

    pub fn is_mismatched(&self, rule: &str) -> bool {
        self.mismatched
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .iter()
            .any(|r| r == rule)
    }

    pub fn status(&self) -> ClusterStatus {
        let h = &self.health;
        let since = h.since_ms.load(Relaxed);
        ClusterStatus {
            state: if self.is_degraded() { "degraded" } else { "ok" },
            node: self.config.node.clone(),
            redis: self.config.redis_shown(),
            on_failure: self.config.on_failure.name(),
            degraded_since_unix_ms: (since != 0).then_some(since),
            last_error: h
                .last_error
                .lock()
                .unwrap_or_else(|e| e.into_inner())
                .clone(),
            calls_ok: h.calls_ok.load(Relaxed),
            calls_failed: h.calls_failed.load(Relaxed),
            fallbacks: h.fallbacks.load(Relaxed),
            degraded_spells: h.spells.load(Relaxed),
            probes_to_recover: if self.is_degraded() {
                self.breaker().to_go()
            } else {
                0
            },
            mismatched: self
                .mismatched
                .lock()
                .unwrap_or_else(|e| e.into_inner())
                .clone(),
            sync_error: self
                .sync_error
                .lock()
                .unwrap_or_else(|e| e.into_inner())
                .clone(),
        }
    }

    /// Records how the packet-rule sync's round went here (`None`: it
    /// read and raised the tables), logging a change once.
    pub fn sync_went(&self, error: Option<String>) {
        let mut e = self.sync_error.lock().unwrap_or_else(|e| e.into_inner());
        match (&*e, &error) {
            (None, Some(now)) => tracing::warn!("cluster sync: {now}; cluster packet rules enforce on each host alone until it works again"),
            (Some(_), None) => tracing::info!("cluster sync: works again; cluster packet rules are shared again"),
            _ => {}
        }
        *e = error;
    }

    /// Connects if not connected (within `timeout`).
    async fn connection(&self) -> Result<Conn, Failure> {
        if let Some(c) = self.conn.read().await.as_ref() {
            return Ok(c.clone());
        }
        let mut slot = self.conn.write().await;
        if let Some(c) = slot.as_ref() {
            return Ok(c.clone());
        }
        let t = self.timeout();
        let err = |e: redis::RedisError| Failure::Redis(e.to_string());
        let conn = if self.config.is_redis_cluster() {
            let client = redis::cluster::ClusterClientBuilder::new(self.config.redis.clone())
                .connection_timeout(t)
                .response_timeout(t)
                .retries(2)
                .min_retry_wait(10)
                .max_retry_wait(t.as_millis() as u64)
                .build()
                .map_err(err)?;
            // The caller's `timeout` bounds the connection too.
            Conn::Many(client.get_async_connection().await.map_err(err)?)
        } else {
            let client = redis::Client::open(self.config.redis[0].as_str()).map_err(err)?;
            let cfg = redis::aio::ConnectionManagerConfig::new()
                .set_connection_timeout(Some(t))
                .set_response_timeout(Some(t))
                .set_number_of_retries(1)
                .set_max_delay(t);
            Conn::One(ConnectionManager::new_lazy_with_config(client, cfg).map_err(err)?)
        };
        *slot = Some(conn.clone());
        Ok(conn)
    }

    /// Runs `invocation` within `timeout`; a failure degrades the cluster.
    /// While degraded, fails at once (the probe brings Redis back).
    pub async fn call<T: FromRedisValue>(
        &self,
        invocation: &redis::ScriptInvocation<'_>,
    ) -> Result<T, Failure> {
        if self.is_degraded() {
            return Err(Failure::Degraded);
        }
        self.call_anyway(invocation).await
    }

    pub(crate) async fn call_anyway<T: FromRedisValue>(
        &self,
        invocation: &redis::ScriptInvocation<'_>,
    ) -> Result<T, Failure> {
        let t = self.timeout();
        let run = async {
            let conn = self.connection().await?;
            let r = match conn {
                Conn::One(mut c) => invocation.invoke_async(&mut c).await,
                Conn::Many(mut c) => invocation.invoke_async(&mut c).await,
            };
            r.map_err(|e| Failure::Redis(e.to_string()))
        };
        let r = match tokio::time::timeout(t, run).await {
            Ok(r) => r,
            Err(_) => Err(Failure::Timeout(self.config.timeout_ms)),
        };
        match &r {
            Ok(_) => {
                self.health.calls_ok.fetch_add(1, Relaxed);
            }
            Err(e) => {
                self.health.calls_failed.fetch_add(1, Relaxed);
                if matches!(e, Failure::Redis(m) if m.contains("LATE")) {
                    // Redis' clock is ahead of the reading kept (it stepped):
                    // the next probe reads it afresh, or every charge until
                    // the kept reading ages out would be late again.
                    *self.clock.lock().unwrap_or_else(|e| e.into_inner()) = None;
                }
                self.set_degraded(e.to_string());
                if self.config.is_redis_cluster() {
                    // A Redis Cluster that failed over may have moved slots
                    // the client still maps to a dead master: the next call
                    // connects afresh from the seeds and reads the topology.
                    if let Ok(mut slot) = self.conn.try_write() {
                        *slot = None;
                    }
                }
            }
        }
        r
    }

    /// The time, on Redis' clock, past which a charge sent now arrives
    /// too late to apply: now plus `timeout` (0 before any probe read the
    /// clock: no deadline).
    pub fn deadline_us(&self) -> u64 {
        // A Redis Cluster's nodes each have a clock, and the probe reads a
        // random one: a node ahead of it by more than `timeout` would refuse
        // every charge as late. Single Redis only.
        if self.config.is_redis_cluster() {
            return 0;
        }
        match *self.clock.lock().unwrap_or_else(|e| e.into_inner()) {
            Some(c) => c.redis_us + (c.at.elapsed() + self.timeout()).as_micros() as u64,
            None => 0,
        }
    }

    /// Reads Redis' clock (one round trip, within `timeout`).
    async fn read_clock(&self) -> Result<(), Failure> {
        let before = std::time::Instant::now();
        let redis_us: u64 = self.call_anyway(&TIME.prepare_invoke()).await?;
        let rtt = before.elapsed();
        // Redis read its clock somewhere in the round trip: taken as read at
        // its end, so that its time now is never overestimated, nor a
        // deadline late (a round trip slowed on this side, by a busy
        // runtime, made a charge Redis ran after its caller gave up fall
        // within its deadline: CI saw a semaphore permit held so). A
        // deadline may fall up to that round trip early instead: a slower
        // reading (a reconnect, a busy runtime) does not replace a quicker
        // one under ten seconds old, or charges that reach Redis in time
        // would be refused as late.
        let mut clock = self.clock.lock().unwrap_or_else(|e| e.into_inner());
        let keep = clock
            .as_ref()
            .is_some_and(|c| c.rtt < rtt && c.at.elapsed() < CLOCK_KEPT);
        if !keep {
            *clock = Some(RedisClock {
                at: before + rtt,
                redis_us,
                rtt,
            });
        }
        Ok(())
    }

    /// Reads Redis' clock, registers this daemon's cluster rules (see
    /// [`members`]) and, if that answers, counts toward the cluster's
    /// recovery ([`health`]). Called at start and every `sync_interval`.
    pub async fn probe(&self, definitions: &[(String, u64)]) -> Result<(), Failure> {
        self.read_clock().await?;
        let clashes = members::register(self, definitions).await?;
        let mut m = self.mismatched.lock().unwrap_or_else(|e| e.into_inner());
        for (rule, other) in &clashes {
            if !m.contains(rule) {
                warn!(rule, "cluster rule \"{rule}\" is defined differently on {other}: here a request rule answers from on_failure and a packet rule is not shared, until every host defines it the same way");
            }
        }
        *m = clashes.into_iter().map(|(r, _)| r).collect();
        drop(m);
        self.answered();
        Ok(())
    }

    /// How long a daemon's registration of its definitions lasts unless
    /// renewed: a host that went away stops counting after this.
    pub fn membership_ttl(&self) -> Duration {
        Duration::from_millis((30 * self.config.sync_interval_ms).clamp(2_000, 60_000))
    }

    /// One round trip (within `timeout`) that reads Redis' clock: a
    /// failure degrades the cluster, an answer while degraded does not heal
    /// it (a probe re-registers first).
    pub async fn ping(&self) -> Result<(), Failure> {
        self.read_clock().await
    }
}
