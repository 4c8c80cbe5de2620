//! Reading the datapath: counters, per-rule stats, buckets and quotas.

use std::net::IpAddr;

use aya::maps::{Array, HashMap, MapData, PerCpuArray};
use rl_common::*;

use super::*;

impl Datapath {
    /// Packets and bytes per rule name (plus `allow` and `deny`), summed
    /// over CPUs and over every rule set the name has been in since load,
    /// and with what the pinned tables held for the rules that stayed in
    /// place when they were adopted.
    pub fn rule_stats(
        &self,
    ) -> Result<std::collections::BTreeMap<String, RuleStats>, DatapathError> {
        let stats: PerCpuArray<&MapData, RuleStats> = map_ref(&self.ebpf, MAP_RULE_STATS)?;
        let mut out: std::collections::BTreeMap<String, RuleStats> =
            self.retired.iter().map(|(k, v)| (k.clone(), *v)).collect();
        // Both slots: the inactive one keeps its counts until it is rewritten.
        for slot in 0..2u32 {
            for (i, name) in self.slots[slot as usize].names.iter().enumerate() {
                let per_cpu = stats
                    .get(&(slot * RULE_SLOTS + i as u32), 0)
                    .map_err(|e| map_error(MAP_RULE_STATS, e))?;
                add_stats(out.entry(name.clone()).or_default(), per_cpu.iter());
            }
        }
        for (name, idx) in [("allow", RSTAT_ALLOW), ("deny", RSTAT_DENY)] {
            let per_cpu = stats
                .get(&idx, 0)
                .map_err(|e| map_error(MAP_RULE_STATS, e))?;
            add_stats(out.entry(name.to_string()).or_default(), per_cpu.iter());
        }
        Ok(out)
    }

    /// Rule `index` (0 = `[default]`) of the active rule set, as the
    /// datapath reads it.
    pub fn active_rule(&self, index: u32) -> Result<RuleEntry, DatapathError> {
        self.rule_table_entry(self.active.unwrap_or(0) * RULE_SLOTS + index)
    }

    /// Entry `entry` of the rule table (both slots), as the datapath reads it.
    pub fn rule_table_entry(&self, entry: u32) -> Result<RuleEntry, DatapathError> {
        let arr: Array<&MapData, RuleEntry> = map_ref(&self.ebpf, MAP_RULES)?;
        arr.get(&entry, 0).map_err(|e| map_error(MAP_RULES, e))
    }

    /// The slot the datapath reads (`None` before the first install).
    pub fn active_slot(&self) -> Option<u32> {
        self.active
    }

    /// The configuration the datapath is reading now.
    pub fn config(&self) -> Result<DatapathConfig, DatapathError> {
        let arr: Array<&MapData, DatapathConfig> = map_ref(&self.ebpf, MAP_CONFIG)?;
        arr.get(&0, 0).map_err(|e| map_error(MAP_CONFIG, e))
    }

    /// Counters summed over all CPUs.
    pub fn counters(&self) -> Result<Counters, DatapathError> {
        let mut out = Counters::default();
        for cpu in self.counters_per_cpu()? {
            for (o, v) in out.0.iter_mut().zip(cpu.0) {
                *o += v;
            }
        }
        // Counts of rule sets since replaced (their map entries were reset).
        for r in self.retired.values() {
            add_rule_totals(&mut out, r);
        }
        Ok(out)
    }

    /// Counters of each possible CPU, indexed by CPU number.
    pub fn counters_per_cpu(&self) -> Result<Vec<Counters>, DatapathError> {
        let arr: PerCpuArray<&MapData, Stats> = map_ref(&self.ebpf, MAP_STATS)?;
        let values = arr.get(&0, 0).map_err(|e| map_error(MAP_STATS, e))?;
        let mut out: Vec<Counters> = values.iter().map(|s| Counters(s.0)).collect();
        // IP packets are counted once, in their rule's entry: add them all.
        let rules: PerCpuArray<&MapData, RuleStats> = map_ref(&self.ebpf, MAP_RULE_STATS)?;
        // Entries in use (the others are zero: `install` retires a slot's
        // counters before rewriting it, but for the rules that stay in
        // place, which it also retires when it fails).
        let used = (0..2u32)
            .flat_map(|slot| {
                (0..self.slots[slot as usize].names.len() as u32)
                    .map(move |i| slot * RULE_SLOTS + i)
            })
            .chain([RSTAT_ALLOW, RSTAT_DENY]);
        for idx in used {
            let per_cpu = rules
                .get(&idx, 0)
                .map_err(|e| map_error(MAP_RULE_STATS, e))?;
            for (o, r) in out.iter_mut().zip(per_cpu.iter()) {
                add_rule_totals(o, r);
            }
        }
        Ok(out)
    }

    /// Every bucket the datapath holds, IPv4 then IPv6.
    pub fn sources(&self) -> Result<Vec<Source>, DatapathError> {
        scan_buckets(self.source_maps()?)
    }

    /// The quota of `addr` under every limit of the active rule set, as
    /// HTTP rate-limit headers would state it, from the bucket that charges
    /// it there now ([`charged_by`]): its own, or the fallback a flood or a
    /// full table charges it to (reported only while that fallback holds a
    /// charge: a fresh one leaves the source its full limit). For limits on
    /// the tick clock the datapath's time trails ktime by up to one tick,
    /// so waits are lengthened by a tick: a client that waits
    /// `retry_after` is never early.
    pub fn source_quotas(&self, addr: IpAddr) -> Result<Vec<SourceQuota>, DatapathError> {
        let Some(slot) = self.active else {
            return Ok(Vec::new());
        };
        let names = &self.slots[slot as usize].names;
        let rules: Array<&MapData, RuleEntry> = map_ref(&self.ebpf, MAP_RULES)?;
        let v4: HashMap<&MapData, Key4, Bucket> = map_ref(&self.ebpf, MAP_SOURCES_V4)?;
        let v6: HashMap<&MapData, Key6, Bucket> = map_ref(&self.ebpf, MAP_SOURCES_V6)?;
        let (cfg, cells) = (self.config()?, self.table_maps()?.cell_arrays()?);
        let now = monotonic_ns();
        let mut out = Vec::new();
        for i in 0..names.len() as u32 {
            let rule = rules
                .get(&(slot * RULE_SLOTS + i), 0)
                .map_err(|e| map_error(MAP_RULES, e))?;
            let wide = rule.flags & RULE_CLUSTER == 0;
            for which in 0..rule.n_limits.min(rl_common::MAX_LIMITS as u32) {
                // A global rule's buckets hold both families in the IPv4 table.
                let addr = match addr {
                    IpAddr::V6(_) if !rule.keys_v6(true) => {
                        IpAddr::V4(std::net::Ipv4Addr::UNSPECIFIED)
                    }
                    a => a,
                };
                let found = match addr {
                    IpAddr::V4(a) => {
                        let key = rule.key4(which, u32::from_ne_bytes(a.octets()));
                        charged_by(&v4, &cells.0, &key, &cfg, wide)
                            .map(|(by, k, b)| (by, prefix4(by, &k, &rule, &cfg), b))
                    }
                    IpAddr::V6(a) => {
                        let key = rule.key6(which, &words6(a));
                        charged_by(&v6, &cells.1, &key, &cfg, wide)
                            .map(|(by, k, b)| (by, prefix6(by, &k, &rule, &cfg), b))
                    }
                };
                let Some((by, prefix, bucket)) = found else {
                    continue;
                };
                let q = self.quota_now(&rule.limits[which as usize], bucket.tat_ns, now);
                if by != ChargedBy::Own && q.remaining >= q.limit {
                    continue;
                }
                out.push(SourceQuota {
                    rule: i,
                    which,
                    by,
                    prefix,
                    quota: q,
                });
            }
        }
        Ok(out)
    }

    /// The rules' names by `RuleEntry::id` (what bucket keys name), from
    /// both rule sets: a rule the last reload removed keeps its buckets
    /// (and cells) while the other set holds it.
    pub fn rule_names_by_id(
        &self,
    ) -> Result<std::collections::BTreeMap<u32, String>, DatapathError> {
        let mut out = std::collections::BTreeMap::new();
        for slot in [0, 1u32] {
            for (i, name) in self.slots[slot as usize].names.iter().enumerate() {
                out.insert(
                    self.rule_table_entry(slot * RULE_SLOTS + i as u32)?.id,
                    name.clone(),
                );
            }
        }
        Ok(out)
    }

    /// The name of rule `index` in the active rule set.
    pub fn rule_name(&self, index: u32) -> Option<&str> {
        self.slots[self.active? as usize]
            .names
            .get(index as usize)
            .map(String::as_str)
    }

    /// The source maps (IPv4, IPv6), for [`scan_buckets`].
    pub fn source_maps(&self) -> Result<(MapRef, MapRef), DatapathError> {
        Ok((self.map_ref(MAP_SOURCES_V4)?, self.map_ref(MAP_SOURCES_V6)?))
    }

    /// Map `name`, for a reader to open a handle of its own.
    pub(super) fn map_ref(&self, name: &'static str) -> Result<MapRef, DatapathError> {
        let map = self
            .ebpf
            .map(name)
            .ok_or_else(|| DatapathError::Load(format!("map {name} is missing")))?;
        let data = match map {
            aya::maps::Map::HashMap(d)
            | aya::maps::Map::PerCpuArray(d)
            | aya::maps::Map::Array(d) => d,
            _ => {
                return Err(DatapathError::Load(format!(
                    "map {name} is not of the type rl-common describes"
                )))
            }
        };
        MapRef::of(data, name)
    }
}

/// One of the datapath's maps, for readers on other threads: each
/// [`MapRef::open`] makes a handle of its own from a duplicate of the
/// daemon's descriptor. (Opening a map by kernel id would take
/// `CAP_SYS_ADMIN`, which the shipped service does not grant.)
#[derive(Clone, Debug)]
pub struct MapRef {
    fd: std::sync::Arc<std::os::fd::OwnedFd>,
    name: &'static str,
}

impl MapRef {
    pub(super) fn of(data: &MapData, name: &'static str) -> Result<MapRef, DatapathError> {
        use std::os::fd::AsFd;
        let fd = data
            .fd()
            .as_fd()
            .try_clone_to_owned()
            .map_err(|e| map_error(name, e))?;
        Ok(MapRef {
            fd: std::sync::Arc::new(fd),
            name,
        })
    }

    /// A handle of one's own on the map.
    pub fn open(&self) -> Result<MapData, DatapathError> {
        // `F_DUPFD_CLOEXEC` says EINVAL, not EMFILE, when the open-files
        // limit leaves no descriptor: say what it means.
        let fd = self.fd.try_clone().map_err(|e| match e.raw_os_error() {
            Some(libc::EINVAL) => std::io::Error::from_raw_os_error(libc::EMFILE),
            _ => e,
        });
        let fd = fd.map_err(|e| map_error(self.name, e))?;
        MapData::from_fd(fd).map_err(|e| map_error(self.name, e))
    }
}

/// A source's quota under one limit ([`Datapath::source_quotas`]).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct SourceQuota {
    /// The rule's index in the active rule set.
    pub rule: u32,
    /// Which of its limits.
    pub which: u32,
    pub by: ChargedBy,
    /// The bucket's prefix (`None` for a last resort): the source
    /// aggregated to its rule's key prefix, or the cell's.
    pub prefix: Option<(IpAddr, u8)>,
    pub quota: rl_common::Quota,
}

/// The kind of bucket that charges a source under a limit.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum ChargedBy {
    /// Its own bucket.
    Own,
    /// Its prefix cell, shared by the unseen sources of the prefix.
    PrefixCell,
    /// Its wide cell, shared by the unseen sources of the wider prefix.
    WideCell,
    /// Its rule's last resort, shared by the unseen sources without a cell.
    LastResort,
}

/// What charges `key` now, as the program finds it (`rl_common::pressure`):
/// its own bucket, else its wide cell (`wide`: not for a cluster rule),
/// else its prefix cell, else its rule's last resort; with the key and a
/// copy of the bucket. `None`: none exists, so the key has its full limit.
fn charged_by<K: BucketKey + FallbackKeys + KnownKey + Copy + PartialEq>(
    table: &HashMap<&MapData, K, Bucket>,
    cells: &super::cells::CellArray<K>,
    key: &K,
    cfg: &DatapathConfig,
    wide: bool,
) -> Option<(ChargedBy, K, Bucket)> {
    if let Ok(b) = table.get(key, 0) {
        return Some((ChargedBy::Own, *key, b));
    }
    let fallbacks = [
        (ChargedBy::WideCell, key.wide(cfg)),
        (ChargedBy::PrefixCell, key.cell(cfg)),
    ];
    for (by, k) in fallbacks
        .into_iter()
        .filter(|(by, _)| wide || *by != ChargedBy::WideCell)
    {
        if let Some(i) = cells.find(&k) {
            return Some((by, k, cells.get(i).bucket));
        }
    }
    let last = key.last_resort();
    table
        .get(&last, 0)
        .ok()
        .map(|b| (ChargedBy::LastResort, last, b))
}

/// The prefix of the IPv4 bucket `key` that charges a source `by`.
fn prefix4(
    by: ChargedBy,
    key: &Key4,
    rule: &RuleEntry,
    cfg: &DatapathConfig,
) -> Option<(IpAddr, u8)> {
    // (A cell's key is the rule's key masked further.)
    let mask = rule.v4_mask
        & match by {
            ChargedBy::Own => u32::MAX,
            ChargedBy::PrefixCell => cfg.cell_mask4,
            ChargedBy::WideCell => wide_mask4(cfg.cell_mask4),
            ChargedBy::LastResort => return None,
        };
    Some((key.addr(), mask.count_ones() as u8))
}

/// The prefix of the IPv6 bucket `key` that charges a source `by`.
fn prefix6(
    by: ChargedBy,
    key: &Key6,
    rule: &RuleEntry,
    cfg: &DatapathConfig,
) -> Option<(IpAddr, u8)> {
    let mask = match by {
        ChargedBy::Own => [u32::MAX; 4],
        ChargedBy::PrefixCell => cfg.cell_mask6,
        ChargedBy::WideCell => wide_mask6(&cfg.cell_mask6),
        ChargedBy::LastResort => return None,
    };
    Some((
        key.addr(),
        mask.iter()
            .zip(&rule.v6_mask)
            .map(|(m, r)| (m & r).count_ones())
            .sum::<u32>() as u8,
    ))
}

/// A prefix cell or wide cell holding a charge, as a collector pass found
/// it: where a flood charged to shared cells shows, since those keep no
/// per-source counts.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct ChargedCell {
    /// The limit it charges: `RuleEntry::id | limit index`.
    pub limit: u32,
    /// Its key's address (the prefix's first address).
    pub addr: IpAddr,
    pub wide: bool,
    /// No room left: one more unit is over the limit.
    pub drained: bool,
    /// The room it has left, in eighths of its limit (0 ..= 7: it holds a
    /// charge), comparable across limits of any kind and rate.
    pub room_eighths: u8,
    /// Its state word when the pass read it.
    pub word: u64,
}

/// Cells kept by [`ChargedCells`].
pub const CHARGED_CELLS_KEPT: usize = 100;

/// The cells a pass found holding a charge, the most limiting first (see
/// [`ChargedCells::settle`]; at most [`CHARGED_CELLS_KEPT`]), and how many
/// had no room left, per family. A pass checks each cell with one step of
/// the limit's arithmetic, as the program does; the quotas of the few kept
/// are worked out after it ([`Datapath::cell_quotas`]).
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct ChargedCells {
    pub cells: Vec<ChargedCell>,
    pub drained: (u64, u64),
    /// Each limit's capacity (by `ChargedCell::limit`), worked out once a
    /// pass: a window's is a search.
    capacities: Vec<(u32, u64)>,
}

impl ChargedCells {
    /// Counts and keeps the cell of `family` (0 IPv4) under `limit`
    /// holding `word` at `now`, if it holds a charge (is not fresh).
    pub(super) fn offer(
        &mut self,
        family: u32,
        limit: &LimitEntry,
        mut cell: ChargedCell,
        now: u64,
        epoch_offset_ns: u64,
    ) {
        if limit.is_fresh(cell.word, now, epoch_offset_ns) {
            return;
        }
        cell.drained = limit.step(cell.word, now, epoch_offset_ns, 1).is_none();
        if cell.drained {
            *if family == 0 {
                &mut self.drained.0
            } else {
                &mut self.drained.1
            } += 1;
        } else {
            let capacity = match self.capacities.iter().find(|(l, _)| *l == cell.limit) {
                Some(&(_, c)) => c,
                None => {
                    let c = rl_common::quota::capacity(limit, now, epoch_offset_ns);
                    self.capacities.push((cell.limit, c));
                    c
                }
            };
            cell.room_eighths =
                rl_common::quota::room_eighths(limit, cell.word, now, epoch_offset_ns, capacity);
        }
        self.cells.push(cell);
        if self.cells.len() >= 4 * CHARGED_CELLS_KEPT {
            self.settle();
        }
    }

    /// Orders the cells (those with no room left first, wide ones before
    /// prefix cells, then the least room left in eighths of their limits,
    /// then the state furthest ahead, then by address) and keeps
    /// [`CHARGED_CELLS_KEPT`].
    pub(super) fn settle(&mut self) {
        self.cells.sort_by_key(|c| {
            (
                std::cmp::Reverse((c.drained, c.wide)),
                c.room_eighths,
                std::cmp::Reverse(c.word),
                c.addr,
            )
        });
        self.cells.truncate(CHARGED_CELLS_KEPT);
    }
}

/// A cell's quota now and its prefix (address, length), by [`Datapath::cell_quotas`].
pub type CellQuota = (Quota, (IpAddr, u8));

impl Datapath {
    /// The quota of each of `cells` now (as `/v1/sources/{ip}` reads a
    /// source's: by the rule in force, else the one it replaced; a coarse
    /// limit's waits a tick longer) and its prefix (the cells' length, 8
    /// bits shorter for a wide one (IPv6 16), within its rule's key
    /// prefix); `None` for a cell whose rule is in neither rule table.
    pub fn cell_quotas(
        &self,
        cells: &[ChargedCell],
    ) -> Result<Vec<Option<CellQuota>>, DatapathError> {
        let (cfg, now) = (self.config()?, monotonic_ns());
        Ok(cells
            .iter()
            .map(|cell| {
                let (rule, _) = self.rule_of_id(cell.limit & rl_common::RULE_ID_MASK)?;
                let limit = match cell.limit & 7 {
                    rl_common::POOL_INDEX => &rule.pool,
                    which => rule.limits.get(which as usize)?,
                };
                let by = if cell.wide {
                    ChargedBy::WideCell
                } else {
                    ChargedBy::PrefixCell
                };
                let prefix = match cell.addr {
                    IpAddr::V4(a) => prefix4(
                        by,
                        &Key4 {
                            rule: cell.limit,
                            addr: u32::from_ne_bytes(a.octets()),
                        },
                        rule,
                        &cfg,
                    ),
                    IpAddr::V6(a) => prefix6(
                        by,
                        &Key6 {
                            rule: cell.limit,
                            addr: words6(a),
                        },
                        rule,
                        &cfg,
                    ),
                }?;
                Some((self.quota_now(limit, cell.word, now), prefix))
            })
            .collect())
    }

    /// The quota of `limit` holding `word` at `now`, for a client: a
    /// coarse limit's waits a tick longer (the datapath's time trails
    /// ktime by up to a tick), so a client that waits them is never early.
    fn quota_now(&self, limit: &LimitEntry, word: u64, now: u64) -> Quota {
        let mut q = rl_common::quota(limit, word, now, self.epoch_offset_ns);
        if limit.kind & rl_common::LIMIT_COARSE != 0 {
            let tick = self.clock.tick_ns;
            q.retry_after_ns += if q.retry_after_ns > 0 { tick } else { 0 };
            q.reset_ns += if q.reset_ns > 0 { tick } else { 0 };
        }
        q
    }
}

/// An IPv6 address as the four network-order words a packet holds.
fn words6(a: std::net::Ipv6Addr) -> [u32; 4] {
    let o = a.octets();
    [0, 4, 8, 12].map(|j| u32::from_ne_bytes([o[j], o[j + 1], o[j + 2], o[j + 3]]))
}

/// One bucket: a source (masked to its aggregation prefix) under one limit.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Source {
    pub addr: IpAddr,
    pub rule: u32,
    pub bucket: Bucket,
}

/// Adds one rule's counts to the totals (shadow drops were passed).
fn add_rule_totals(c: &mut Counters, r: &RuleStats) {
    use rl_common::{STAT_DROPPED_BYTES, STAT_DROPPED_PKTS, STAT_PASSED_BYTES, STAT_PASSED_PKTS};
    c.0[STAT_PASSED_PKTS as usize] += r.passed_pkts + r.shadow_pkts;
    c.0[STAT_PASSED_BYTES as usize] += r.passed_bytes + r.shadow_bytes;
    c.0[STAT_DROPPED_PKTS as usize] += r.dropped_pkts;
    c.0[STAT_DROPPED_BYTES as usize] += r.dropped_bytes;
}

pub(super) fn add_stats<'a>(into: &mut RuleStats, from: impl Iterator<Item = &'a RuleStats>) {
    for s in from {
        into.passed_pkts += s.passed_pkts;
        into.passed_bytes += s.passed_bytes;
        into.dropped_pkts += s.dropped_pkts;
        into.dropped_bytes += s.dropped_bytes;
        into.shadow_pkts += s.shadow_pkts;
        into.shadow_bytes += s.shadow_bytes;
    }
}

/// Every bucket in the source maps with these ids, IPv4 then IPv6, through
/// handles of the caller's own (a walk of a million buckets never needs a
/// [`Datapath`] or its lock), with one `BPF_MAP_LOOKUP_BATCH` per 16,384
/// buckets.
pub fn scan_buckets(maps: (MapRef, MapRef)) -> Result<Vec<Source>, DatapathError> {
    let v4 = scan_table::<Key4>(&maps.0, MAP_SOURCES_V4)?;
    let v6 = scan_table::<Key6>(&maps.1, MAP_SOURCES_V6)?;
    Ok(sources_of(&v4).chain(sources_of(&v6)).collect())
}

/// The sources' own buckets among a table's entries: prefix cells and last
/// resorts are not sources.
pub(super) fn sources_of<K: BucketKey>(
    entries: &[(K, Bucket)],
) -> impl Iterator<Item = Source> + '_ {
    entries
        .iter()
        .filter(|(k, _)| key_kind(k.rule()) == KeyKind::Own)
        .map(|(k, b)| Source::of(k, *b))
}

/// Every entry of the bucket table (sources or prefix cells) with kernel id
/// `id`, through a handle of our own.
pub(super) fn scan_table<K: BucketKey>(
    id: &MapRef,
    name: &'static str,
) -> Result<Vec<(K, Bucket)>, DatapathError> {
    let mut out = Vec::new();
    scan_table_each::<K>(id, name, |k, b| {
        out.extend(k.iter().copied().zip(b.iter().copied()));
        Ok(())
    })?;
    Ok(out)
}

/// [`scan_table`] a chunk at a time (up to 16,384 entries): memory stays
/// bounded whatever the table holds.
pub(super) fn scan_table_each<K: BucketKey>(
    id: &MapRef,
    name: &'static str,
    mut f: impl FnMut(&[K], &[Bucket]) -> Result<(), DatapathError>,
) -> Result<(), DatapathError> {
    use std::os::fd::{AsFd, AsRawFd};
    let data = id.open()?;
    // The kernel writes key_size and value_size bytes per entry into
    // our buffers: they must be exactly K and Bucket.
    let info = data.info().map_err(|e| map_error(name, e))?;
    let sizes = (info.key_size() as usize, info.value_size() as usize);
    if sizes != (std::mem::size_of::<K>(), std::mem::size_of::<Bucket>()) {
        return Err(DatapathError::Load(format!(
            "map {name} has {}-byte keys and {}-byte values, rl-common expects {} and {}: rebuild both with `cargo xtask build`",
            sizes.0,
            sizes.1,
            std::mem::size_of::<K>(),
            std::mem::size_of::<Bucket>()
        )));
    }
    let fd = data.fd().as_fd().as_raw_fd();
    let mut failed = None;
    let r = super::batch::lookup_batch_each::<K, Bucket, std::io::Error>(fd, |k, b| {
        f(k, b).map_err(|e| {
            failed = Some(e);
            std::io::Error::other("stopped")
        })
    });
    match (r, failed) {
        (_, Some(e)) => Err(e),
        (Err(e), None) => Err(map_error(name, e)),
        (Ok(()), None) => Ok(()),
    }
}

/// A bucket table's key: which limit, and an address.
pub(super) trait BucketKey: aya::Pod + Default {
    fn rule(&self) -> u32;
    fn addr(&self) -> IpAddr;
    /// The key of the last resort of this key's limit.
    fn last_resort(&self) -> Self;
    /// The key as either table's.
    fn id(&self) -> super::share::BucketId;
}

impl BucketKey for Key4 {
    fn rule(&self) -> u32 {
        self.rule
    }
    fn last_resort(&self) -> Self {
        Key4 {
            rule: last_resort_rule(self.rule),
            addr: 0,
        }
    }
    fn id(&self) -> super::share::BucketId {
        super::share::BucketId::V4(*self)
    }
    fn addr(&self) -> IpAddr {
        IpAddr::from(self.addr_bytes())
    }
}

impl BucketKey for Key6 {
    fn rule(&self) -> u32 {
        self.rule
    }
    fn last_resort(&self) -> Self {
        Key6 {
            rule: last_resort_rule(self.rule),
            addr: [0; 4],
        }
    }
    fn id(&self) -> super::share::BucketId {
        super::share::BucketId::V6(*self)
    }
    fn addr(&self) -> IpAddr {
        IpAddr::from(self.addr_bytes())
    }
}

impl Source {
    pub(super) fn of<K: BucketKey>(k: &K, bucket: Bucket) -> Source {
        Source {
            addr: k.addr(),
            rule: k.rule(),
            bucket,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A packet limit of 5 per second (burst 5), on exact time.
    fn five() -> LimitEntry {
        let c = crate::compile::compile(
            &crate::config::Config::from_str("[default]\nrate = 5\n", "x").unwrap(),
        );
        c.rules.entries[0].limits[0]
    }

    fn cell(n: u8, word: u64) -> ChargedCell {
        ChargedCell {
            limit: 8,
            addr: IpAddr::from([10, n, 0, 0]),
            wide: false,
            drained: false,
            room_eighths: 0,
            word,
        }
    }

    /// Only cells holding a charge are kept, those with no room left
    /// first (then wide ones, then the least room, then the state furthest ahead, then by
    /// address), at most CHARGED_CELLS_KEPT of them, and the drained ones
    /// are counted per family, kept or not.
    #[test]
    fn charged_cells_keep_the_most_limiting_and_count_the_drained() {
        let (l, now, second) = (five(), 100_000_000_000u64, 1_000_000_000u64);
        let mut c = ChargedCells::default();
        // Drained: a state word a whole burst (1 s) ahead of now, or more.
        for n in 0..=250u8 {
            c.offer(
                u32::from(n % 2),
                &l,
                cell(n, now + second + u64::from(n) * 1_000),
                now,
                0,
            );
        }
        c.offer(0, &l, cell(251, now - 10 * second), now, 0); // fresh: no charge
        c.offer(0, &l, cell(252, now + second / 2), now, 0); // half used: room left
        c.settle();
        assert_eq!(c.drained, (126, 125));
        assert_eq!(c.cells.len(), CHARGED_CELLS_KEPT);
        assert_eq!(c.cells[0].addr, IpAddr::from([10, 250, 0, 0]));
        assert!(c.cells.iter().all(|x| x.drained));
        assert!(c.cells.windows(2).all(|w| w[0].word > w[1].word));
        let mut few = ChargedCells::default();
        few.offer(0, &l, cell(1, now - 10 * second), now, 0);
        few.offer(0, &l, cell(2, now + second / 2), now, 0);
        few.offer(
            0,
            &l,
            ChargedCell {
                wide: true,
                ..cell(3, now + second / 2)
            },
            now,
            0,
        );
        few.offer(0, &l, cell(4, now + 2 * second), now, 0);
        few.settle();
        let order: Vec<(u8, bool, bool)> = few
            .cells
            .iter()
            .map(|c| {
                (
                    if let IpAddr::V4(a) = c.addr {
                        a.octets()[1]
                    } else {
                        0
                    },
                    c.wide,
                    c.drained,
                )
            })
            .collect();
        assert_eq!(
            order,
            [(4, false, true), (3, true, false), (2, false, false)],
            "a fresh cell holds no charge"
        );
        assert_eq!(few.drained, (1, 0));
    }

    /// Cells under unlike limits rank by the room they leave, in eighths of
    /// each limit, not by their state words (a token bucket's is a time, a
    /// window's a packed count).
    #[test]
    fn charged_cells_of_unlike_limits_rank_by_the_room_they_leave() {
        use rl_common::limit_entry::LIMIT_FIXED;
        let (five, now, second) = (five(), 100_000_000_000u64, 1_000_000_000u64);
        let window = LimitEntry {
            kind: LIMIT_FIXED,
            shift: 0,
            a: 10 * second,
            b: 3,
        };
        let word = window.step(0, now, 0, 1).unwrap();
        // Four fifths of the bucket's burst used (1 of 8 eighths left); one
        // of the window's three (5 of 8 left).
        let bucket = cell(1, now + 4 * second / 5);
        let windowed = ChargedCell {
            limit: 16,
            ..cell(2, word)
        };
        assert!(
            bucket.word < windowed.word,
            "the state words would rank them the other way"
        );
        let mut c = ChargedCells::default();
        c.offer(0, &five, bucket, now, 0);
        c.offer(0, &window, windowed, now, 0);
        c.settle();
        let ranked: Vec<(u32, u8)> = c.cells.iter().map(|x| (x.limit, x.room_eighths)).collect();
        assert_eq!(ranked, [(8, 1), (16, 5)]);
    }
}
