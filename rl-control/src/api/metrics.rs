//! `GET /metrics`: the Prometheus text exposition of the datapath's
//! counters, the tables' pressure, request decisions, the cluster's health
//! and the daemon's own.

use std::fmt::Write as _;

use axum::{
    extract::State as AxState,
    http::header,
    response::{IntoResponse, Response},
};

use super::{reads::rule_counters, *};

/// Prometheus text exposition: one part per room, each writing its
/// families in turn.
#[utoipa::path(get, path = "/metrics", responses((status = 200, description = "Prometheus text format", content_type = "text/plain")))]
pub(super) async fn metrics(AxState(api): AxState<Api>) -> ApiResult<Response> {
    let s = lock(&api.state);
    let mut out = String::new();
    datapath(&mut out, &s)?;
    pressure(&mut out, &s);
    requests(&mut out, &s);
    daemon(&mut out, &s);
    if let Some(c) = &s.cluster {
        cluster(&mut out, c);
    }
    Ok((
        [(
            header::CONTENT_TYPE,
            "text/plain; version=0.0.4; charset=utf-8",
        )],
        out,
    )
        .into_response())
}

/// A label value as the text format escapes it.
fn esc(v: &str) -> String {
    v.replace('\\', "\\\\")
        .replace('"', "\\\"")
        .replace('\n', "\\n")
}

/// A family's `# HELP` and `# TYPE` lines.
fn family(out: &mut String, name: &str, kind: &str, help: &str) {
    let _ = writeln!(out, "# HELP {name} {help}\n# TYPE {name} {kind}");
}

/// The datapath's counters: per rule, and the frames and events outside
/// the rules.
fn datapath(out: &mut String, s: &State) -> ApiResult<()> {
    let rules = rule_counters(s)?;
    let global = s.dp.counters()?;
    family(
        out,
        "rl_packets_total",
        "counter",
        "Packets by rule (allow, deny and default included) and verdict.",
    );
    for (name, c) in &rules {
        for (verdict, v) in [
            ("passed", c.passed_packets),
            ("dropped", c.dropped_packets),
            ("shadow_dropped", c.shadow_dropped_packets),
        ] {
            let _ = writeln!(
                out,
                "rl_packets_total{{rule=\"{}\",verdict=\"{verdict}\"}} {v}",
                esc(name)
            );
        }
    }
    family(
        out,
        "rl_bytes_total",
        "counter",
        "Bytes by rule and verdict.",
    );
    for (name, c) in &rules {
        for (verdict, v) in [
            ("passed", c.passed_bytes),
            ("dropped", c.dropped_bytes),
            ("shadow_dropped", c.shadow_dropped_bytes),
        ] {
            let _ = writeln!(
                out,
                "rl_bytes_total{{rule=\"{}\",verdict=\"{verdict}\"}} {v}",
                esc(name)
            );
        }
    }
    family(out, "rl_datapath_events_total", "counter", "The datapath's own counts, since it was loaded, by event: non_ip_packets (passed), malformed_packets (dropped), new_sources (buckets created), no_state_drops (a rule failed closed), contended_drops, events and events_suppressed (limited events sent, and held back by their budget), fallback_packets (charged to a prefix cell or last resort), table_full_refusals, new_cells, fragment_orphans.");
    for (i, name) in rl_common::STAT_NAMES.iter().enumerate() {
        if name.contains("passed") || name.contains("dropped") {
            continue;
        }
        let _ = writeln!(
            out,
            "rl_datapath_events_total{{event=\"{name}\"}} {}",
            global.get(i as u32)
        );
    }
    Ok(())
}

/// The tables' pressure, as the collector last saw it.
fn pressure(out: &mut String, s: &State) {
    let p = &s.pressure;
    family(
        out,
        "rl_tracked_sources",
        "gauge",
        "Per-source buckets held (refreshed every second).",
    );
    let _ = writeln!(
        out,
        "rl_tracked_sources{{family=\"ipv4\"}} {}\nrl_tracked_sources{{family=\"ipv6\"}} {}",
        p.buckets_ipv4, p.buckets_ipv6
    );
    family(
        out,
        "rl_source_capacity",
        "gauge",
        "Capacity of each family's source map (datapath.max_sources).",
    );
    let _ = writeln!(out, "rl_source_capacity {}", s.config.datapath.max_sources);
    family(
        out,
        "rl_table_occupancy_ratio",
        "gauge",
        "Entries held over capacity, per table and family (cells: over the cells an array takes before it is full, half its slots; at 1, a prefix without a cell shares its rule's last resort).",
    );
    for (table, family_, held, cap) in [
        (
            "sources",
            "ipv4",
            p.buckets_ipv4,
            s.config.datapath.max_sources,
        ),
        (
            "sources",
            "ipv6",
            p.buckets_ipv6,
            s.config.datapath.max_sources,
        ),
        (
            "cells",
            "ipv4",
            p.cells_ipv4,
            rl_common::cell_room(s.config.datapath.flood_prefixes),
        ),
        (
            "cells",
            "ipv6",
            p.cells_ipv6,
            rl_common::cell_room(s.config.datapath.flood_prefixes),
        ),
    ] {
        let _ = writeln!(
            out,
            "rl_table_occupancy_ratio{{table=\"{table}\",family=\"{family_}\"}} {}",
            held as f64 / cap.max(1) as f64
        );
    }
    family(out, "rl_prefix_cells", "gauge", "Prefix cells held (each family's array takes datapath.flood_prefixes rounded up to a power of two, in twice as many slots, two per set).");
    let _ = writeln!(
        out,
        "rl_prefix_cells{{family=\"ipv4\"}} {}\nrl_prefix_cells{{family=\"ipv6\"}} {}",
        p.cells_ipv4, p.cells_ipv6
    );
    family(out, "rl_wide_cells", "gauge", "Of the prefix cells, wide ones (8 bits shorter, IPv6 16): made while a rule's flood holds a quarter of the cells' slots (half of datapath.flood_prefixes rounded up to a power of two) or more.");
    let _ = writeln!(
        out,
        "rl_wide_cells{{family=\"ipv4\"}} {}\nrl_wide_cells{{family=\"ipv6\"}} {}",
        p.wide_cells_ipv4, p.wide_cells_ipv6
    );
    family(out, "rl_rule_wide_cells", "gauge", "Wide cells per rule that has any (absent: none): the rules whose floods went wide, so whose newcomers in a flooded prefix start drained.");
    for w in &p.wide_cell_rules {
        let _ = writeln!(out, "rl_rule_wide_cells{{rule=\"{0}\",family=\"ipv4\"}} {1}\nrl_rule_wide_cells{{rule=\"{0}\",family=\"ipv6\"}} {2}", esc(&w.rule), w.ipv4, w.ipv6);
    }
    family(out, "rl_known_filter_fill_ratio", "gauge", "Share of the known-keys filter's bits set: how often a key without a bucket still pays a table lookup.");
    let _ = writeln!(out, "rl_known_filter_fill_ratio{{family=\"ipv4\"}} {}\nrl_known_filter_fill_ratio{{family=\"ipv6\"}} {}", p.known_filter_fill_ipv4, p.known_filter_fill_ipv6);
    family(out, "rl_unseen_keys_per_second", "gauge", "Keys the datapath found no bucket for, per second (from the flood detectors' last whole 67 ms window).");
    let _ = writeln!(out, "rl_unseen_keys_per_second {}", p.unseen_keys_per_sec);
    family(
        out,
        "rl_new_buckets_per_second",
        "gauge",
        "Per-source buckets created per second.",
    );
    let _ = writeln!(out, "rl_new_buckets_per_second {}", p.new_buckets_per_sec);
    family(out, "rl_flood_mode", "gauge", "1 while unseen sources are charged to their prefix cells (flood mode), and for two seconds after the last.");
    let _ = writeln!(out, "rl_flood_mode {}", u8::from(p.flood_mode));
    family(out, "rl_flood_mode_cpus", "gauge", "CPUs in flood mode now or within the last two seconds (each measures its own share of datapath.flood_new_keys_per_sec: one alone under a low rl_unseen_keys_per_second points at uneven receive queues).");
    let _ = writeln!(out, "rl_flood_mode_cpus {}", p.flood_mode_cpus);
    family(out, "rl_table_full", "gauge", "1 while the sources' table is full (datapath.max_sources own buckets): new sources share their prefix cells.");
    let _ = writeln!(out, "rl_table_full {}", u8::from(p.table_full));
    family(out, "rl_cells_full", "gauge", "1 while a family's prefix cells are full (datapath.flood_prefixes rounded up to a power of two): a prefix without a cell shares its rule's last resort.");
    let _ = writeln!(out, "rl_cells_full {}", u8::from(p.cells_full));
    family(out, "rl_collected_buckets_total", "counter", "Buckets deleted by the collector because their state was fresh again (since the daemon started).");
    let _ = writeln!(out, "rl_collected_buckets_total {}", p.collected_buckets);
    let readers = [
        ("walk", &p.collector.walk),
        ("flood_reading", &p.collector.flood_reading),
    ];
    family(out, "rl_collector_up", "gauge", "1 while a background reader's passes work (walk: occupancy, cells, top lists and the collection of fresh buckets; flood_reading: flood mode; events: the \"limited\" events feed); 0 while they fail, and its figures are as it last read them.");
    for (reader, h) in readers.into_iter().chain([("events", &p.collector.events)]) {
        let _ = writeln!(
            out,
            "rl_collector_up{{reader=\"{reader}\"}} {}",
            u8::from(!h.failing() && h.last_ok_unix_ms.is_some())
        );
    }
    family(out, "rl_collector_last_pass_timestamp_seconds", "gauge", "When a background reader's last pass completed (Unix time; before its first, when the daemon started). Each passes every second.");
    let started_ms =
        crate::config::unix_now_ms().saturating_sub(s.started.elapsed().as_millis() as u64);
    for (reader, h) in readers {
        let ms = h.last_ok_unix_ms.unwrap_or(started_ms);
        let _ = writeln!(
            out,
            "rl_collector_last_pass_timestamp_seconds{{reader=\"{reader}\"}} {}",
            ms as f64 / 1e3
        );
    }
}

/// Request decisions (`[[l7.rule]]`).
fn requests(out: &mut String, s: &State) {
    let engine = s.l7.read().unwrap_or_else(|e| e.into_inner()).clone();
    family(out, "rl_l7_decisions_total", "counter", "Request decisions per [[l7.rule]]: ok, over (answered 429) and shadow_over (counted, answered ok).");
    for (name, c) in engine.counters() {
        use std::sync::atomic::Ordering::Relaxed;
        for (result, v) in [
            ("ok", c.ok.load(Relaxed)),
            ("over", c.over.load(Relaxed)),
            ("shadow_over", c.shadow_over.load(Relaxed)),
        ] {
            let _ = writeln!(
                out,
                "rl_l7_decisions_total{{rule=\"{name}\",result=\"{result}\"}} {v}"
            );
        }
    }
    family(out, "rl_l7_overflow_total", "counter", "Request charges per [[l7.rule]] made to its overflow bucket: keys with no bucket of their own while the store held [l7] max_keys share one (limited together: raise max_keys).");
    for (name, c) in engine.counters() {
        let _ = writeln!(
            out,
            "rl_l7_overflow_total{{rule=\"{name}\"}} {}",
            c.overflow.load(std::sync::atomic::Ordering::Relaxed)
        );
    }
    family(
        out,
        "rl_l7_unmatched_total",
        "counter",
        "Request descriptors no [[l7.rule]] matched (not limited).",
    );
    let _ = writeln!(
        out,
        "rl_l7_unmatched_total {}",
        engine.unmatched.load(std::sync::atomic::Ordering::Relaxed)
    );
    family(
        out,
        "rl_l7_limit_overrides_ignored_total",
        "counter",
        "Envoy descriptors whose limit override rl did not apply ([l7] apply_limit_overrides = false, an unknown unit, a concurrency or cluster rule, or 1024 distinct overrides held): the matching rule's limits decided.",
    );
    let _ = writeln!(
        out,
        "rl_l7_limit_overrides_ignored_total {}",
        crate::l7::OVERRIDES_IGNORED.load(std::sync::atomic::Ordering::Relaxed)
    );
    family(
        out,
        "rl_l7_refused_total",
        "counter",
        "Request-limit calls refused without a decision (gRPC by status code, the HTTP check's 400s): a gateway that lets requests through when its call fails (Envoy's default) did not limit them.",
    );
    for (code, c) in crate::l7::GRPC_REFUSED.iter().enumerate() {
        let v = c.load(std::sync::atomic::Ordering::Relaxed);
        // The codes the service answers are always exported (a series
        // that appears at its first count hides that count from increase()).
        if v > 0 || [3, 4, 8, 12, 13].contains(&code) {
            let _ = writeln!(
                out,
                "rl_l7_refused_total{{api=\"grpc\",code=\"{code}\"}} {v}"
            );
        }
    }
    let _ = writeln!(
        out,
        "rl_l7_refused_total{{api=\"http\",code=\"400\"}} {}",
        crate::l7::HTTP_REFUSED.load(std::sync::atomic::Ordering::Relaxed)
    );
    family(
        out,
        "rl_l7_request_seconds",
        "histogram",
        "Time to answer a request decision (decode, decide, encode), by front end.",
    );
    for (api, l) in [
        ("grpc", &crate::l7::GRPC_LATENCY),
        ("http", &crate::l7::HTTP_LATENCY),
    ] {
        let (counts, sum) = l.snapshot();
        for (i, c) in counts.iter().enumerate() {
            let le = crate::l7::LATENCY_BOUNDS
                .get(i)
                .map_or("+Inf".to_string(), |b| b.to_string());
            let _ = writeln!(
                out,
                "rl_l7_request_seconds_bucket{{api=\"{api}\",le=\"{le}\"}} {c}"
            );
        }
        let _ = writeln!(out, "rl_l7_request_seconds_sum{{api=\"{api}\"}} {sum}\nrl_l7_request_seconds_count{{api=\"{api}\"}} {}", counts.last().copied().unwrap_or(0));
    }
    let listeners = crate::l7::threads::LISTENERS
        .lock()
        .unwrap_or_else(|e| e.into_inner())
        .clone();
    if !listeners.is_empty() {
        family(
            out,
            "rl_l7_connections",
            "gauge",
            "Open connections per request listener (api: grpc, http).",
        );
        for (api, l) in &listeners {
            let _ = writeln!(
                out,
                "rl_l7_connections{{api=\"{api}\"}} {}",
                l.open.load(std::sync::atomic::Ordering::Relaxed)
            );
        }
        family(
            out,
            "rl_l7_max_connections",
            "gauge",
            "[l7] max_connections: open connections per request listener at most.",
        );
        for (api, l) in &listeners {
            let _ = writeln!(out, "rl_l7_max_connections{{api=\"{api}\"}} {}", l.max);
        }
        family(
            out,
            "rl_l7_connections_refused_total",
            "counter",
            "Connections closed unserved: the listener held [l7] max_connections.",
        );
        for (api, l) in &listeners {
            let _ = writeln!(
                out,
                "rl_l7_connections_refused_total{{api=\"{api}\"}} {}",
                l.refused.load(std::sync::atomic::Ordering::Relaxed)
            );
        }
    }
    let threads = crate::l7::grpc_threads::THREADS.load(std::sync::atomic::Ordering::Relaxed);
    if threads > 0 {
        family(
            out,
            "rl_l7_grpc_connections",
            "gauge",
            "Open gRPC connections per serving thread ([l7] grpc_threads).",
        );
        for (i, c) in crate::l7::grpc_threads::CONNECTIONS[..threads]
            .iter()
            .enumerate()
        {
            let _ = writeln!(
                out,
                "rl_l7_grpc_connections{{thread=\"{i}\"}} {}",
                c.load(std::sync::atomic::Ordering::Relaxed)
            );
        }
    }
    family(
        out,
        "rl_l7_keys",
        "gauge",
        "Request buckets held, against [l7] max_keys.",
    );
    let _ = writeln!(out, "rl_l7_keys {}", engine.keys());
    family(out, "rl_l7_max_keys", "gauge", "[l7] max_keys.");
    let _ = writeln!(out, "rl_l7_max_keys {}", s.config.l7.max_keys);
}

/// The daemon's own: bans, rules, changes, API requests, uptime.
fn daemon(out: &mut String, s: &State) {
    family(out, "rl_active_bans", "gauge", "Bans in force.");
    let _ = writeln!(
        out,
        "rl_active_bans {}",
        s.config.active_bans(unix_now()).count()
    );
    family(
        out,
        "rl_rules",
        "gauge",
        "Rules in force ([default] not counted).",
    );
    let _ = writeln!(out, "rl_rules {}", s.config.rules.len());
    family(
        out,
        "rl_reloads_total",
        "counter",
        "Rule set changes (file reloads and API changes) by result.",
    );
    let _ = writeln!(
        out,
        "rl_reloads_total{{result=\"ok\"}} {}\nrl_reloads_total{{result=\"failed\"}} {}",
        s.reloads_ok, s.reloads_failed
    );
    family(
        out,
        "rl_api_requests_total",
        "counter",
        "Admin API requests by route and status.",
    );
    for ((route, code), n) in &s.api_requests {
        let _ = writeln!(
            out,
            "rl_api_requests_total{{route=\"{}\",status=\"{code}\"}} {n}",
            esc(route)
        );
    }
    family(
        out,
        "rl_uptime_seconds",
        "gauge",
        "Seconds since the daemon attached.",
    );
    let _ = writeln!(out, "rl_uptime_seconds {}", s.started.elapsed().as_secs());
}

/// The cluster's health and the packet-rule sync (`[cluster]` only).
fn cluster(out: &mut String, c: &crate::cluster::Cluster) {
    let st = c.status();
    family(
        out,
        "rl_cluster_degraded",
        "gauge",
        "1 while Redis does not answer within [cluster] timeout: cluster rules enforce on_failure.",
    );
    let _ = writeln!(
        out,
        "rl_cluster_degraded{{on_failure=\"{}\"}} {}",
        st.on_failure,
        u8::from(st.state == "degraded")
    );
    family(out, "rl_cluster_degraded_spells_total", "counter", "Degraded spells since the start: more than a few an hour is a flapping Redis (each recovery after one waits for more answered probes).");
    let _ = writeln!(
        out,
        "rl_cluster_degraded_spells_total {}",
        st.degraded_spells
    );
    family(
        out,
        "rl_cluster_redis_calls_total",
        "counter",
        "Redis script calls by result.",
    );
    let _ = writeln!(out, "rl_cluster_redis_calls_total{{result=\"ok\"}} {}\nrl_cluster_redis_calls_total{{result=\"failed\"}} {}", st.calls_ok, st.calls_failed);
    family(
        out,
        "rl_cluster_fallbacks_total",
        "counter",
        "Cluster decisions answered by on_failure instead of Redis.",
    );
    let _ = writeln!(out, "rl_cluster_fallbacks_total {}", st.fallbacks);
    family(
        out,
        "rl_cluster_sync_failing",
        "gauge",
        "1 while the packet-rule sync fails here (reading or raising the bucket tables): cluster packet rules are enforced by each host alone.",
    );
    let _ = writeln!(
        out,
        "rl_cluster_sync_failing {}",
        u8::from(st.sync_error.is_some())
    );
    let sync = *c.sync.lock().unwrap_or_else(|e| e.into_inner());
    family(
        out,
        "rl_cluster_sync_rounds_total",
        "counter",
        "Packet-rule sync rounds.",
    );
    let _ = writeln!(out, "rl_cluster_sync_rounds_total {}", sync.rounds);
    family(
        out,
        "rl_cluster_sync_calls_total",
        "counter",
        "Redis script calls of the packet-rule sync (one per hash slot per round).",
    );
    let _ = writeln!(out, "rl_cluster_sync_calls_total {}", sync.calls);
    family(
        out,
        "rl_cluster_reported_buckets_total",
        "counter",
        "Bucket reports the packet-rule sync sent and Redis acknowledged.",
    );
    let _ = writeln!(
        out,
        "rl_cluster_reported_buckets_total {}",
        sync.reported_keys
    );
    family(
        out,
        "rl_cluster_raised_buckets_total",
        "counter",
        "Buckets moved up to their cluster bucket (other hosts' packets charged here).",
    );
    let _ = writeln!(out, "rl_cluster_raised_buckets_total {}", sync.raised);
    family(
        out,
        "rl_cluster_buckets",
        "gauge",
        "Buckets of cluster packet rules in the last round, and the hot ones that travelled.",
    );
    let _ = writeln!(
        out,
        "rl_cluster_buckets{{kind=\"all\"}} {}\nrl_cluster_buckets{{kind=\"hot\"}} {}",
        sync.buckets, sync.hot
    );
    family(out, "rl_cluster_mismatched_rules", "gauge", "Cluster rules another daemon defines differently (request rules answer from on_failure, packet rules are not shared).");
    let _ = writeln!(out, "rl_cluster_mismatched_rules {}", st.mismatched.len());
}
