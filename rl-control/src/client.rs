//! The CLI side of the admin API: `rl-control status | rules | stats |
//! source IP | ban CIDR | unban CIDR | reload`, talking to a running daemon.
//!
//! Tables for people, `--json` for scripts (the API's own JSON, unchanged).
//! Exit codes: 0 done, 1 the daemon refused or could not be reached (the
//! message says which and what to do), 2 bad usage (clap).

use std::{path::PathBuf, time::Duration};

use anyhow::{bail, Context, Result};
use serde_json::Value;

/// Where and how to reach the daemon.
pub struct Client {
    base: String,
    token: Option<String>,
    agent: ureq::Agent,
}

impl Client {
    /// `api` is `HOST:PORT` or a URL; `token_file` holds the bearer token.
    pub fn new(api: &str, token_file: Option<&PathBuf>) -> Result<Client> {
        let base = if api.contains("://") { api.trim_end_matches('/').to_string() } else { format!("http://{api}") };
        let token = match token_file {
            Some(f) => Some(
                std::fs::read_to_string(f)
                    .with_context(|| format!("cannot read the token file {}", f.display()))?
                    .trim()
                    .to_string(),
            ),
            None => None,
        };
        let agent = ureq::AgentBuilder::new().timeout(Duration::from_secs(30)).build();
        Ok(Client { base, token, agent })
    }

    /// One request; the JSON answer, or an error saying what went wrong.
    pub fn call(&self, method: &str, path: &str, body: Option<&Value>) -> Result<Value> {
        let mut req = self.agent.request(method, &format!("{}{path}", self.base));
        if let Some(t) = &self.token {
            req = req.set("Authorization", &format!("Bearer {t}"));
        }
        let res = match body {
            Some(b) => req.send_json(b.clone()),
            None => req.call(),
        };
        match res {
            Ok(r) => r.into_json().with_context(|| format!("{method} {path}: the answer is not JSON")),
            Err(ureq::Error::Status(code, r)) => {
                let msg = r
                    .into_json::<Value>()
                    .ok()
                    .and_then(|v| v.get("error").and_then(|e| e.as_str()).map(str::to_string))
                    .unwrap_or_else(|| "no error message".into());
                let hint = if code == 401 { " (pass --token-file)" } else { "" };
                bail!("{method} {path}: {code}: {msg}{hint}")
            }
            Err(ureq::Error::Transport(t)) => bail!(
                "cannot reach rl-control at {}: {t}; is it running? (start it with `rl-control run`, or point --api at it)",
                self.base
            ),
        }
    }
}

/// Prints `v` as JSON or, for people, with `human`.
pub fn print(v: &Value, json: bool, human: impl FnOnce(&Value) -> String) {
    if json {
        println!("{}", serde_json::to_string_pretty(v).unwrap_or_default());
    } else {
        print!("{}", human(v));
    }
}

fn s(v: &Value) -> String {
    match v {
        Value::String(s) => s.clone(),
        Value::Null => "-".into(),
        other => other.to_string(),
    }
}

/// Left-aligned columns.
fn table(header: &[&str], rows: &[Vec<String>]) -> String {
    let mut widths: Vec<usize> = header.iter().map(|h| h.len()).collect();
    for r in rows {
        for (w, c) in widths.iter_mut().zip(r) {
            *w = (*w).max(c.chars().count());
        }
    }
    let line = |cells: Vec<String>| {
        let mut l = cells.iter().zip(&widths).map(|(c, w)| format!("{c:<w$}")).collect::<Vec<_>>().join("  ");
        l.truncate(l.trim_end().len());
        l + "\n"
    };
    let mut out = line(header.iter().map(|h| h.to_string()).collect());
    for r in rows {
        out += &line(r.clone());
    }
    out
}

pub fn status(v: &Value) -> String {
    let last = &v["last_reload"];
    let reload = if last.is_null() {
        "none since start".to_string()
    } else {
        format!("{} ({}): {}", if last["ok"] == true { "ok" } else { "FAILED" }, s(&last["trigger"]), s(&last["message"]))
    };
    let p = &v["pressure"];
    let flood = if p["flood_mode"] == true {
        format!("ON since {} (unseen sources charged to their prefix cells)", s(&p["flood_since_unix_ms"]))
    } else {
        "off".to_string()
    };
    format!(
        "interface:       {} (XDP {}, program {})\nuptime:          {}s\nrules:           {} (+ default), {} allow and {} deny CIDRs, {} bans\n\
         sources tracked: IPv4 {}, IPv6 {} of {} per family\nprefix cells:    IPv4 {}, IPv6 {} of {} per family\n\
         unseen keys:     {:.0}/s; buckets created {:.0}/s, collected {} since start\n\
         flood mode:      {flood}\nfallbacks:       {} packets charged to a cell or last resort; {} inserts refused (table full)\n\
         config file:     {}\nlast change:     {reload}\n",
        s(&v["iface"]), s(&v["xdp_mode"]), s(&v["program_id"]), s(&v["uptime_secs"]), s(&v["rules"]),
        s(&v["allow_cidrs"]), s(&v["deny_cidrs"]), s(&v["active_bans"]),
        s(&p["buckets_ipv4"]), s(&p["buckets_ipv6"]), s(&p["bucket_capacity"]),
        s(&p["cells_ipv4"]), s(&p["cells_ipv6"]), s(&p["cell_capacity"]),
        p["unseen_keys_per_sec"].as_f64().unwrap_or(0.0), p["new_buckets_per_sec"].as_f64().unwrap_or(0.0), s(&p["collected_buckets"]),
        s(&p["fallback_packets"]), s(&p["table_full_refusals"]),
        s(&v["config_file"]),
    )
}

pub fn rules(v: &Value) -> String {
    let mut out = format!("default: {} packets/s per source, burst {}\n", s(&v["default"]["rate"]), s(&v["default"]["burst"]));
    for (list, what) in [("allow", "never limited"), ("deny", "always dropped")] {
        let cidrs: Vec<String> = v[list].as_array().into_iter().flatten().map(|c| s(&c["cidr"])).collect();
        if !cidrs.is_empty() {
            out += &format!("{list} ({what}): {}\n", cidrs.join(", "));
        }
    }
    let rows: Vec<Vec<String>> = v["rules"]
        .as_array()
        .into_iter()
        .flatten()
        .map(|r| {
            let limit = if r.get("limits").is_some() {
                "limits: ".to_string() + &r["limits"].as_array().into_iter().flatten().map(|l| format!("{}/{}", s(&l["rate"]), s(&l["per"]))).collect::<Vec<_>>().join(", ")
            } else {
                format!("{}/{}", s(&r["rate"]), r.get("per").map_or("1s".into(), s))
            };
            vec![
                s(&r["name"]),
                r.get("proto").map_or("any".into(), s),
                r.get("dst_ports").map_or("*".into(), |p| p.to_string()),
                limit,
                r.get("key").map_or("source".into(), s),
                r.get("action").map_or("drop".into(), s),
            ]
        })
        .collect();
    out + &table(&["RULE", "PROTO", "PORTS", "LIMIT", "KEY", "ACTION"], &rows)
}

pub fn stats(v: &Value) -> String {
    let rows: Vec<Vec<String>> = v["rules"]
        .as_object()
        .into_iter()
        .flatten()
        .map(|(name, c)| {
            vec![
                name.clone(),
                s(&c["passed_packets"]),
                s(&c["dropped_packets"]),
                s(&c["shadow_dropped_packets"]),
                s(&c["passed_bytes"]),
                s(&c["dropped_bytes"]),
            ]
        })
        .collect();
    table(&["RULE", "PASSED", "DROPPED", "SHADOW", "PASSED BYTES", "DROPPED BYTES"], &rows)
}

pub fn source(v: &Value) -> String {
    let limits = v["limits"].as_array().cloned().unwrap_or_default();
    if limits.is_empty() {
        return format!("{}: no state under any rule (it has its full limit)\n", s(&v["source"]));
    }
    let rows: Vec<Vec<String>> = limits
        .iter()
        .map(|l| {
            vec![s(&l["rule"]), s(&l["limit_index"]), s(&l["limit"]), s(&l["remaining"]), s(&l["retry_after_ms"]), s(&l["reset_ms"])]
        })
        .collect();
    format!("{}\n", s(&v["source"])) + &table(&["RULE", "LIMIT#", "LIMIT", "REMAINING", "RETRY AFTER ms", "RESET ms"], &rows)
}

pub fn top(v: &Value) -> String {
    let rows: Vec<Vec<String>> = v["sources"]
        .as_array()
        .into_iter()
        .flatten()
        .map(|t| {
            vec![
                s(&t["source"]),
                s(&t["rule"]),
                s(&t["drops"]),
                format!("{:.0}", t["drops_per_sec"].as_f64().unwrap_or(0.0)),
                format!("{:.0}", t["rate_seen_pps"].as_f64().unwrap_or(0.0)),
            ]
        })
        .collect();
    let secs = v["interval_secs"].as_f64().unwrap_or(0.0);
    if secs == 0.0 {
        return "no interval measured yet (sources are scanned every 5 s)\n".into();
    }
    format!("drops over the last {secs:.1} s\n") + &table(&["SOURCE", "RULE", "DROPS", "DROPS/s", "SEEN pkt/s"], &rows)
}

pub fn events(v: &Value) -> String {
    let rows: Vec<Vec<String>> = v["events"]
        .as_array()
        .into_iter()
        .flatten()
        .map(|e| vec![s(&e["at_unix_ms"]), s(&e["event"]), s(&e["rule"]), s(&e["limit_index"]), s(&e["source"])])
        .collect();
    table(&["AT (unix ms)", "EVENT", "RULE", "LIMIT#", "SOURCE"], &rows)
}

pub fn applied(v: &Value) -> String {
    format!("done; now enforcing {}\n", s(&v["summary"]))
}

pub fn ban(v: &Value) -> String {
    format!("banned {} for {}s (until Unix time {}){}\n", s(&v["cidr"]), s(&v["ttl_secs"]), s(&v["until"]),
        v["reason"].as_str().filter(|r| !r.is_empty()).map_or(String::new(), |r| format!(": {r}")))
}

/// `/` in a CIDR becomes `%2F` in a path segment.
pub fn encode_segment(text: &str) -> String {
    text.replace('%', "%25").replace('/', "%2F")
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn tables_align_and_segments_encode() {
        let t = table(&["A", "LONG"], &[vec!["xyz".into(), "1".into()]]);
        assert_eq!(t, "A    LONG\nxyz  1\n");
        assert_eq!(encode_segment("10.0.0.0/8"), "10.0.0.0%2F8");
    }
}
