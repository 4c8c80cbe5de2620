//! The CLI side of the admin API: `rl-control status | rules | stats |
//! source IP | ban CIDR | unban CIDR | reload`, talking to a running daemon.
//!
//! Tables for people, `--json` for scripts (the API's own JSON, unchanged).
//! Exit codes: 0 done, 1 the daemon refused or could not be reached (the
//! message says which and what to do), 2 bad usage (clap), 3 `status` of a
//! daemon that runs but is not all well.

use std::{path::PathBuf, time::Duration};

use anyhow::{bail, Context, Result};
use serde_json::Value;

/// The admin API's Unix socket inside a runtime directory.
pub const API_SOCKET: &str = "api.sock";
/// The runtime directory by default (`--runtime-dir`).
pub const DEFAULT_RUNTIME_DIR: &str = "/run/rl";

/// Where and how to reach the daemon: its Unix socket (root only, no
/// token), or a TCP address with a bearer token.
pub struct Client {
    to: To,
    token: Option<String>,
}

enum To {
    Socket(PathBuf),
    Tcp { base: String, agent: ureq::Agent },
}

impl Client {
    /// The socket in `runtime_dir`, or with `api` (`HOST:PORT` or a URL)
    /// that TCP address; `token_file` holds the bearer token.
    pub fn new(
        runtime_dir: &std::path::Path,
        api: Option<&str>,
        token_file: Option<&PathBuf>,
    ) -> Result<Client> {
        let token = match token_file {
            Some(f) => Some(
                std::fs::read_to_string(f)
                    .with_context(|| format!("cannot read the token file {}", f.display()))?
                    .trim()
                    .to_string(),
            ),
            None => None,
        };
        let to = match api {
            Some(api) if api.starts_with("https://") => bail!(
                "--api {api}: rl-control speaks plain HTTP to the daemon (its [api] listen, which belongs on loopback or a private network); reach a remote daemon through an SSH tunnel, or use curl through your TLS proxy"
            ),
            Some(api) => To::Tcp {
                base: if api.contains("://") {
                    api.trim_end_matches('/').to_string()
                } else {
                    format!("http://{api}")
                },
                agent: ureq::AgentBuilder::new()
                    .timeout(Duration::from_secs(30))
                    .build(),
            },
            None => To::Socket(runtime_dir.join(API_SOCKET)),
        };
        Ok(Client { to, token })
    }

    /// One request; the JSON answer, or an error saying what went wrong.
    pub fn call(&self, method: &str, path: &str, body: Option<&Value>) -> Result<Value> {
        let bytes = body.map(|b| serde_json::to_vec(b).unwrap_or_default());
        let (code, text) = match &self.to {
            To::Socket(sock) => {
                let content = bytes.as_deref().map(|b| ("application/json", b));
                unix_request(sock, method, path, content, self.token.as_deref()).map_err(|e| {
                    let hint = match e.kind() {
                        std::io::ErrorKind::WouldBlock | std::io::ErrorKind::TimedOut => {
                            "no answer within 30 s: the daemon is busy or stuck, and a change may still take effect (check `rl-control status` and the daemon's log)"
                        }
                        std::io::ErrorKind::PermissionDenied => "only root may use the admin socket",
                        std::io::ErrorKind::NotFound | std::io::ErrorKind::ConnectionRefused => {
                            "is rl-control running? (start it with `rl-control run`; point --runtime-dir at its runtime directory)"
                        }
                        _ => "is rl-control running?",
                    };
                    anyhow::anyhow!("cannot reach rl-control at {}: {e}; {hint}", sock.display())
                })?
            }
            To::Tcp { base, agent } => {
                let mut req = agent.request(method, &format!("{base}{path}"));
                if let Some(t) = &self.token {
                    req = req.set("Authorization", &format!("Bearer {t}"));
                }
                let res = match &bytes {
                    Some(b) => req.set("Content-Type", "application/json").send_bytes(b),
                    None => req.call(),
                };
                match res {
                    Ok(r) => (r.status(), r.into_string().unwrap_or_default()),
                    Err(ureq::Error::Status(code, r)) => (code, r.into_string().unwrap_or_default()),
                    Err(ureq::Error::Transport(t)) => bail!(
                        "cannot reach rl-control at {base}: {t}; is it running, with `--api` or `[api] listen` at that address?"
                    ),
                }
            }
        };
        let v: Value = serde_json::from_str(&text)
            .with_context(|| format!("{method} {path}: {code}: the answer is not JSON"))?;
        if !(200..300).contains(&code) {
            let msg = v
                .get("error")
                .and_then(|e| e.as_str())
                .unwrap_or("no error message");
            let hint = if code == 401 {
                " (pass --token-file)"
            } else {
                ""
            };
            bail!("{method} {path}: {code}: {msg}{hint}");
        }
        Ok(v)
    }
}

/// One HTTP/1.1 request over the Unix socket `sock`: the status and body.
/// (`content`: content type and body.) Enough HTTP for the admin API:
/// `Connection: close`, a `Content-Length` or chunked answer.
pub fn unix_request(
    sock: &std::path::Path,
    method: &str,
    path: &str,
    content: Option<(&str, &[u8])>,
    token: Option<&str>,
) -> std::io::Result<(u16, String)> {
    unix_exchange(sock, method, path, content, token, &[]).map(|(code, _, body)| (code, body))
}

/// [`unix_request`] with `extra` request headers: the status, the
/// answer's header block and its body.
pub fn unix_exchange(
    sock: &std::path::Path,
    method: &str,
    path: &str,
    content: Option<(&str, &[u8])>,
    token: Option<&str>,
    extra: &[(&str, &str)],
) -> std::io::Result<(u16, String, String)> {
    use std::io::{Read, Write};
    let mut s = std::os::unix::net::UnixStream::connect(sock)?;
    s.set_read_timeout(Some(Duration::from_secs(30)))?;
    let mut head = format!("{method} {path} HTTP/1.1\r\nHost: rl-control\r\nConnection: close\r\n");
    if let Some(t) = token {
        head += &format!("Authorization: Bearer {t}\r\n");
    }
    for (name, value) in extra {
        head += &format!("{name}: {value}\r\n");
    }
    let body = match content {
        Some((ctype, b)) => {
            head += &format!("Content-Type: {ctype}\r\n");
            b
        }
        None => &[][..],
    };
    head += &format!("Content-Length: {}\r\n\r\n", body.len());
    // The body is written beside the read: a server that refuses early
    // (413 for a body too large) answers and closes while it is still being
    // written, and its answer must be read all the same.
    s.write_all(head.as_bytes())?;
    let mut w = s.try_clone()?;
    let body = body.to_vec();
    let writer = std::thread::spawn(move || w.write_all(&body));
    let mut raw = Vec::new();
    let read = s.read_to_end(&mut raw);
    let written = writer.join().unwrap_or(Ok(()));
    let cut = |e: &std::io::Error| {
        matches!(
            e.kind(),
            std::io::ErrorKind::BrokenPipe | std::io::ErrorKind::ConnectionReset
        )
    };
    match read {
        Err(e) if !cut(&e) || raw.is_empty() => return Err(e),
        _ => {}
    }
    if let Err(e) = written {
        if !cut(&e) {
            return Err(e);
        }
    }
    let bad = |what: &str| {
        std::io::Error::new(
            std::io::ErrorKind::InvalidData,
            format!("bad HTTP answer: {what}"),
        )
    };
    let split = raw
        .windows(4)
        .position(|w| w == b"\r\n\r\n")
        .ok_or_else(|| bad("no end of headers"))?;
    let head = String::from_utf8_lossy(&raw[..split]).into_owned();
    let code: u16 = head
        .split_whitespace()
        .nth(1)
        .and_then(|c| c.parse().ok())
        .ok_or_else(|| bad("no status"))?;
    let mut body = raw[split + 4..].to_vec();
    if head
        .to_ascii_lowercase()
        .contains("transfer-encoding: chunked")
    {
        body = dechunk(&body).ok_or_else(|| bad("broken chunked body"))?;
    }
    Ok((code, head, String::from_utf8_lossy(&body).into_owned()))
}

fn dechunk(mut b: &[u8]) -> Option<Vec<u8>> {
    let mut out = Vec::new();
    loop {
        let eol = b.windows(2).position(|w| w == b"\r\n")?;
        let size = usize::from_str_radix(
            std::str::from_utf8(&b[..eol])
                .ok()?
                .split(';')
                .next()?
                .trim(),
            16,
        )
        .ok()?;
        b = &b[eol + 2..];
        if size == 0 {
            return Some(out);
        }
        out.extend_from_slice(b.get(..size)?);
        b = b.get(size + 2..)?;
    }
}

/// Prints `v` as JSON or, for people, with `human`.
pub fn print(v: &Value, json: bool, human: impl FnOnce(&Value) -> String) {
    use std::io::Write;
    let text = if json {
        serde_json::to_string_pretty(v).unwrap_or_default() + "\n"
    } else {
        human(v)
    };
    // A reader gone (`| head`) ends the output quietly, as for any Unix
    // tool, where print! would panic.
    let _ = std::io::stdout().lock().write_all(text.as_bytes());
}

fn s(v: &Value) -> String {
    match v {
        Value::String(s) => s.clone(),
        Value::Null => "-".into(),
        other => other.to_string(),
    }
}

/// A Unix time in milliseconds (a JSON number) as UTC and how long ago:
/// `2026-11-27 19:11:19 UTC (42 s ago)`; as is if it is not a number.
fn since(v: &Value) -> String {
    let Some(ms) = v.as_u64() else { return s(v) };
    let now = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_millis() as u64);
    format!(
        "{} ({} s ago)",
        utc(ms / 1000),
        now.saturating_sub(ms) / 1000
    )
}

/// Unix seconds as `YYYY-MM-DD HH:MM:SS UTC` (the proleptic Gregorian
/// calendar, from days since the epoch by eras of 400 years).
fn utc(secs: u64) -> String {
    let (days, rest) = (secs / 86_400, secs % 86_400);
    let z = days + 719_468;
    let (era, doe) = (z / 146_097, z % 146_097);
    let yoe = (doe - doe / 1_460 + doe / 36_524 - doe / 146_096) / 365;
    let doy = doe - (365 * yoe + yoe / 4 - yoe / 100);
    let mp = (5 * doy + 2) / 153;
    let (day, month) = (
        doy - (153 * mp + 2) / 5 + 1,
        if mp < 10 { mp + 3 } else { mp - 9 },
    );
    let year = yoe + era * 400 + u64::from(month <= 2);
    format!(
        "{year:04}-{month:02}-{day:02} {:02}:{:02}:{:02} UTC",
        rest / 3600,
        rest / 60 % 60,
        rest % 60
    )
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
        let mut l = cells
            .iter()
            .zip(&widths)
            .map(|(c, w)| format!("{c:<w$}"))
            .collect::<Vec<_>>()
            .join("  ");
        l.truncate(l.trim_end().len());
        l + "\n"
    };
    let mut out = line(header.iter().map(|h| h.to_string()).collect());
    for r in rows {
        out += &line(r.clone());
    }
    out
}

pub fn l7_state(v: &Value) -> String {
    if v["code"] == "unmatched" {
        return "no [[l7.rule]] matches this descriptor: it is not limited\n".into();
    }
    format!(
        "rule:        {}{}\nnext:        {}\nlimit:       {} per {}s\nremaining:   {}\nretry after: {} ms\nfull again:  {} ms\n",
        s(&v["rule"]),
        if v["enforced"] == false { " (shadow: counted, never limits)" } else { "" },
        if v["code"] == "ok" { "passes" } else { "over the limit" },
        s(&v["limit"]),
        s(&v["per_secs"]),
        s(&v["remaining"]),
        s(&v["retry_after_ms"]),
        s(&v["reset_ms"]),
    )
}

/// What is wrong with a running daemon, from its status: an interface no
/// longer attached, the config file as last read refused, a background
/// reader failing, the cluster degraded or its packet sync failing.
pub fn unhealthy(v: &Value) -> Vec<String> {
    let mut wrong = Vec::new();
    for i in v["interfaces"].as_array().into_iter().flatten() {
        if i["attached"] == false {
            wrong.push(format!("{} not attached", s(&i["iface"])));
        }
    }
    // The file as last read was refused (not an API edit refused for its
    // own content, which leaves all as it was).
    if v["config_file_refused"] == true {
        wrong.push("the config file as last read does not load: older rules are in force".into());
    }
    for k in ["walk", "flood_reading", "events"] {
        if v["pressure"]["collector"][k]["error"].is_string() {
            wrong.push(format!("the {k} reader is failing"));
        }
    }
    let c = &v["cluster"];
    if c["state"].as_str().is_some_and(|st| st != "ok") {
        wrong.push("the cluster is degraded".into());
    }
    if c["sync_error"].is_string() {
        wrong.push("the cluster's packet sync is failing".into());
    }
    wrong
}

pub fn status(v: &Value) -> String {
    let last = &v["last_reload"];
    let reload = if last.is_null() {
        "none since start".to_string()
    } else {
        format!(
            "{} ({}): {}",
            if last["ok"] == true { "ok" } else { "FAILED" },
            s(&last["trigger"]),
            s(&last["message"])
        )
    };
    let p = &v["pressure"];
    let flood = if p["flood_mode"] == true {
        format!(
            "ON since {}, on {} of {} CPUs (unseen sources charged to their prefix cells)",
            since(&p["flood_since_unix_ms"]),
            s(&p["flood_mode_cpus"]),
            s(&p["cpus"])
        )
    } else {
        "off".to_string()
    };
    let mut table = if p["table_full"] == true {
        format!(
            "sources table:   FULL at {} own buckets: new sources share their prefix cells\n",
            s(&p["bucket_capacity"])
        )
    } else {
        String::new()
    };
    if p["cells_full"] == true {
        table += &format!(
            "prefix cells:    FULL at {}: a prefix without a cell shares its rule's last resort (datapath.flood_prefixes)\n",
            s(&p["cell_capacity"])
        );
    }
    let failing: Vec<String> = [
        ("walk", "tables' walk"),
        ("flood_reading", "flood reading"),
        ("events", "events feed"),
    ]
    .iter()
    .filter_map(|(k, name)| {
        let r = &p["collector"][k];
        r["error"].as_str().map(|e| {
            format!(
                "{name} FAILING since {}: {e}",
                since(&r["failing_since_unix_ms"])
            )
        })
    })
    .collect();
    if !failing.is_empty() {
        table += &format!("collector:       {} (its figures above are as it last read them; tried again every second)\n", failing.join("; "));
    }
    let on: Vec<String> = v["interfaces"]
        .as_array()
        .map(|a| {
            a.iter()
                .map(|i| format!("{} (XDP {})", s(&i["iface"]), s(&i["xdp_mode"])))
                .collect()
        })
        .unwrap_or_default();
    let mut iface_line = match on.len() {
        0 | 1 => format!(
            "interface:       {} (XDP {}, program {})",
            s(&v["iface"]),
            s(&v["xdp_mode"]),
            s(&v["program_id"])
        ),
        _ => format!(
            "interfaces:      {}; one program ({}) and one set of buckets",
            on.join(", "),
            s(&v["program_id"])
        ),
    };
    let gone: Vec<String> = v["interfaces"]
        .as_array()
        .into_iter()
        .flatten()
        .filter(|i| i["attached"] == false)
        .map(|i| s(&i["iface"]))
        .collect();
    if !gone.is_empty() {
        iface_line += &format!(
            "\nNOT ATTACHED:    {}: rl's program no longer runs there, nothing limits that traffic (restart the daemon to attach it again)",
            gone.join(", ")
        );
    }
    let c = &v["cluster"];
    let redis: Vec<String> = c["redis"].as_array().into_iter().flatten().map(s).collect();
    let mismatched: Vec<String> = c["mismatched"]
        .as_array()
        .into_iter()
        .flatten()
        .map(s)
        .collect();
    let mut cluster = match c["state"].as_str() {
        None => String::new(),
        Some("ok") => format!(
            "cluster:         ok, node {} on {} (on_failure = {})\n",
            s(&c["node"]),
            redis.join(", "),
            s(&c["on_failure"])
        ),
        Some(_) => format!(
            "cluster:         DEGRADED since {} ({}): cluster rules enforce on_failure = {}\n",
            since(&c["degraded_since_unix_ms"]),
            s(&c["last_error"]),
            s(&c["on_failure"])
        ),
    };
    if c["probes_to_recover"].as_u64().is_some_and(|n| n > 1) {
        cluster += &format!(
            "                 Redis failed again soon after recovering: shared again after {} answered probes in a row\n",
            c["probes_to_recover"]
        );
    }
    if !mismatched.is_empty() {
        cluster += &format!(
            "                 defined differently by another host (not shared here): {}\n",
            mismatched.join(", ")
        );
    }
    if let Some(e) = c["sync_error"].as_str() {
        cluster += &format!(
            "                 packet-rule sync FAILING ({e}): cluster packet rules enforced by this host alone\n"
        );
    }
    let wide_rules: Vec<String> = p["wide_cell_rules"]
        .as_array()
        .into_iter()
        .flatten()
        .map(|w| {
            format!(
                "{} (IPv4 {}, IPv6 {})",
                s(&w["rule"]),
                s(&w["ipv4"]),
                s(&w["ipv6"])
            )
        })
        .collect();
    let wide_rules = match wide_rules.is_empty() {
        true => String::new(),
        false => format!(
            "wide cells of:   {} (their newcomers in a flooded prefix start drained)\n",
            wide_rules.join(", ")
        ),
    };
    format!(
        "{iface_line}\nuptime:          {}s\nrules:           {} (+ default), {} allow and {} deny CIDRs, {} bans\n\
         sources tracked: IPv4 {}, IPv6 {} of {} per family\nprefix cells:    IPv4 {}, IPv6 {} of {} per family; wide: IPv4 {}, IPv6 {}\n\
         unseen keys:     {:.0}/s; buckets created {:.0}/s, collected {} since start\n\
         lookup filter:   {:.3}% of IPv4 bits, {:.3}% of IPv6 bits set (an unseen key pays a table lookup that often)\n\
         {wide_rules}flood mode:      {flood}\nfallbacks:       {} packets charged to a cell or last resort; {} inserts refused (table full)\n{table}\
         config file:     {}\nlast change:     {reload}\n{cluster}",
        s(&v["uptime_secs"]), s(&v["rules"]),
        s(&v["allow_cidrs"]), s(&v["deny_cidrs"]), s(&v["active_bans"]),
        s(&p["buckets_ipv4"]), s(&p["buckets_ipv6"]), s(&p["bucket_capacity"]),
        s(&p["cells_ipv4"]), s(&p["cells_ipv6"]), s(&p["cell_capacity"]), s(&p["wide_cells_ipv4"]), s(&p["wide_cells_ipv6"]),
        p["unseen_keys_per_sec"].as_f64().unwrap_or(0.0), p["new_buckets_per_sec"].as_f64().unwrap_or(0.0), s(&p["collected_buckets"]),
        100.0 * p["known_filter_fill_ipv4"].as_f64().unwrap_or(0.0), 100.0 * p["known_filter_fill_ipv6"].as_f64().unwrap_or(0.0),
        s(&p["fallback_packets"]), s(&p["table_full_refusals"]),
        s(&v["config_file"]),
    )
}

pub fn rules(v: &Value) -> String {
    let mut out = format!(
        "default: {} packets/s per source, burst {}\n",
        s(&v["default"]["rate"]),
        s(&v["default"]["burst"])
    );
    for (list, what) in [("allow", "never limited"), ("deny", "always dropped")] {
        let cidrs: Vec<String> = v[list]
            .as_array()
            .into_iter()
            .flatten()
            .map(|c| s(&c["cidr"]))
            .collect();
        if !cidrs.is_empty() {
            out += &format!("{list} ({what}): {}\n", first_of(&cidrs, 10));
        }
    }
    let bans = v["bans"].as_array().map_or(0, Vec::len);
    if bans > 0 {
        out += &format!("bans: {bans} in the file (rl-control bans lists those in force)\n");
    }
    let rows: Vec<Vec<String>> = v["rules"]
        .as_array()
        .into_iter()
        .flatten()
        .map(|r| {
            let limit = if r.get("limits").is_some() {
                "limits: ".to_string()
                    + &r["limits"]
                        .as_array()
                        .into_iter()
                        .flatten()
                        .map(|l| format!("{}/{}", s(&l["rate"]), s(&l["per"])))
                        .collect::<Vec<_>>()
                        .join(", ")
            } else {
                let mut l = format!("{}/{}", s(&r["rate"]), r.get("per").map_or("1s".into(), s));
                if let Some(b) = r.get("burst") {
                    l += &format!(" burst {}", s(b));
                }
                if let Some(b) = r.get("bytes") {
                    l += &format!(", {} bytes", s(b));
                }
                l
            };
            let src: Vec<String> = r["src"].as_array().into_iter().flatten().map(s).collect();
            let mut proto = r.get("proto").map_or("any".into(), s);
            if let Some(f) = r.get("tcp_flags") {
                proto += &format!(" {}", s(f));
            }
            let mut action = r.get("action").map_or("drop".into(), s);
            if let Some(m) = r.get("mode") {
                action += &format!(" ({})", s(m));
            }
            vec![
                s(&r["name"]),
                proto,
                r.get("dst_ports").map_or("*".into(), |p| p.to_string()),
                if src.is_empty() {
                    "*".into()
                } else {
                    first_of(&src, 3)
                },
                limit,
                r.get("key").map_or("source".into(), s),
                action,
            ]
        })
        .collect();
    out + &table(
        &["RULE", "PROTO", "PORTS", "SRC", "LIMIT", "KEY", "ACTION"],
        &rows,
    )
}

/// The first `n` of `items`, and how many more (`--json` shows them all).
fn first_of(items: &[String], n: usize) -> String {
    match items.len() {
        len if len <= n => items.join(", "),
        len => format!(
            "{} and {} more (--json for all)",
            items[..n].join(", "),
            len - n
        ),
    }
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
    table(
        &[
            "RULE",
            "PASSED",
            "DROPPED",
            "SHADOW",
            "PASSED BYTES",
            "DROPPED BYTES",
        ],
        &rows,
    )
}

pub fn source(v: &Value) -> String {
    let limits = v["limits"].as_array().cloned().unwrap_or_default();
    match v["listed"].as_str() {
        Some("allow") => return format!("{}: in an allow CIDR (never limited)\n", s(&v["source"])),
        Some("deny") => {
            return format!(
                "{}: in a deny CIDR or a ban (always dropped)\n",
                s(&v["source"])
            )
        }
        _ => {}
    }
    if limits.is_empty() {
        return format!(
            "{}: no charge under any rule (it has its full limit)\n",
            s(&v["source"])
        );
    }
    let rows: Vec<Vec<String>> = limits
        .iter()
        .map(|l| {
            let by = match (l["charged_to"].as_str(), l["prefix"].as_str()) {
                (Some(kind), Some(p)) => format!("{} {p}", kind.replace('_', " ")),
                (Some(kind), None) => kind.replace('_', " "),
                (None, _) => "?".into(),
            };
            vec![
                s(&l["rule"]),
                s(&l["limit_index"]),
                s(&l["limit"]),
                s(&l["remaining"]),
                s(&l["retry_after_ms"]),
                s(&l["reset_ms"]),
                by,
            ]
        })
        .collect();
    let shared = limits
        .iter()
        .any(|l| l["charged_to"].as_str().is_some_and(|k| k != "own"));
    let note = if shared {
        "(a shared bucket's figures are its whole prefix's: the source has no bucket of its own under that limit)\n"
    } else {
        ""
    };
    format!("{}\n", s(&v["source"]))
        + &table(
            &[
                "RULE",
                "LIMIT#",
                "LIMIT",
                "REMAINING",
                "RETRY AFTER ms",
                "RESET ms",
                "CHARGED TO",
            ],
            &rows,
        )
        + note
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
    format!("drops over the last {secs:.1} s\n")
        + &table(&["SOURCE", "RULE", "DROPS", "DROPS/s", "SEEN pkt/s"], &rows)
}

pub fn cells(v: &Value) -> String {
    if v["read_at_unix_ms"].as_u64().unwrap_or(0) == 0 {
        return "no collector pass yet (the cells are read every second)\n".into();
    }
    let rows: Vec<Vec<String>> = v["cells"]
        .as_array()
        .into_iter()
        .flatten()
        .map(|c| {
            let wait = |ms: &Value| format!("{:.1} s", ms.as_u64().unwrap_or(0) as f64 / 1e3);
            vec![
                s(&c["prefix"]),
                s(&c["rule"]),
                s(&c["kind"]),
                format!("{}/{}", s(&c["remaining"]), s(&c["limit"])),
                wait(&c["retry_after_ms"]),
                wait(&c["reset_ms"]),
            ]
        })
        .collect();
    let head = format!(
        "cells with no room left: IPv4 {}, IPv6 {} (read {})\n",
        s(&v["drained_ipv4"]),
        s(&v["drained_ipv6"]),
        since(&v["read_at_unix_ms"])
    );
    match rows.is_empty() {
        true => head + "no cell holds a charge\n",
        false => {
            head + &table(
                &[
                    "PREFIX",
                    "RULE",
                    "KIND",
                    "LEFT",
                    "RETRY AFTER",
                    "FULL AGAIN IN",
                ],
                &rows,
            )
        }
    }
}

pub fn events(v: &Value) -> String {
    let rows: Vec<Vec<String>> = v["events"]
        .as_array()
        .into_iter()
        .flatten()
        .map(|e| {
            // Only "limited" events name a limit and a source; a host's
            // event names neither, a rule's only its rule.
            let limited = e["event"] == "limited";
            let or_dash = |v: &Value| {
                Some(s(v))
                    .filter(|t| !t.is_empty())
                    .unwrap_or_else(|| "-".into())
            };
            let at = e["at_unix_ms"].as_u64().map_or_else(
                || s(&e["at_unix_ms"]),
                |ms| {
                    format!(
                        "{}.{:03}",
                        utc(ms / 1000).trim_end_matches(" UTC"),
                        ms % 1000
                    )
                },
            );
            let limit = if limited {
                s(&e["limit_index"])
            } else {
                "-".into()
            };
            vec![
                at,
                s(&e["event"]),
                or_dash(&e["rule"]),
                limit,
                or_dash(&e["source"]),
                or_dash(&e["detail"]),
            ]
        })
        .collect();
    table(
        &["AT (UTC)", "EVENT", "RULE", "LIMIT#", "SOURCE", "DETAIL"],
        &rows,
    )
}

pub fn applied(v: &Value) -> String {
    format!("done; now enforcing {}\n", s(&v["summary"]))
}

pub fn ban(v: &Value) -> String {
    format!(
        "banned {} for {}s (until Unix time {}){}\n",
        s(&v["cidr"]),
        s(&v["ttl_secs"]),
        s(&v["until"]),
        v["reason"]
            .as_str()
            .filter(|r| !r.is_empty())
            .map_or(String::new(), |r| format!(": {r}"))
    )
}

/// `GET /v1/bans` as a table: prefix, time left, end, reason.
pub fn bans(v: &Value) -> String {
    let rows: Vec<Vec<String>> = v
        .as_array()
        .into_iter()
        .flatten()
        .map(|b| {
            let left = b["ttl_secs"].as_u64().unwrap_or(0);
            vec![
                s(&b["cidr"]),
                format!("{}h{:02}m{:02}s", left / 3600, left / 60 % 60, left % 60),
                s(&b["until"]),
                b["reason"].as_str().unwrap_or("").to_string(),
            ]
        })
        .collect();
    if rows.is_empty() {
        return "no bans in force\n".into();
    }
    table(&["PREFIX", "LEFT", "UNTIL (Unix)", "REASON"], &rows)
}

/// `text` percent-encoded for a path segment or a query value: every byte
/// but letters, digits, `-._~` and `:` (IPv6 addresses read as written),
/// so `/` in a CIDR, and `+`, `&`, `=`, `#` or a space in a descriptor
/// value, arrive as given.
pub fn encode_segment(text: &str) -> String {
    let mut out = String::with_capacity(text.len());
    for b in text.bytes() {
        if b.is_ascii_alphanumeric() || b"-._~:".contains(&b) {
            out.push(b as char);
        } else {
            out.push_str(&format!("%{b:02X}"));
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The rules table shows what decides a packet (source lists, TCP
    /// flags, burst, mode), long CIDR lists cut short, and the bans.
    #[test]
    fn the_rules_table_shows_sources_flags_and_bans() {
        let deny: Vec<Value> = (0..12)
            .map(|i| serde_json::json!({ "cidr": format!("192.0.2.{i}/32") }))
            .collect();
        let v = serde_json::json!({
            "default": {"rate": 100, "burst": 200},
            "allow": [], "deny": deny,
            "bans": [{"cidr": "198.51.100.0/24", "until": 1}],
            "rules": [{"name": "ssh-syn", "proto": "tcp", "tcp_flags": "syn", "dst_ports": [22],
                       "src": ["203.0.113.0/24"], "rate": 5, "per": "1m", "burst": 10, "mode": "soft"}],
        });
        let out = rules(&v);
        assert!(
            out.contains("192.0.2.9/32 and 2 more (--json for all)"),
            "{out}"
        );
        assert!(out.contains("bans: 1 in the file"), "{out}");
        let row = out.lines().find(|l| l.starts_with("ssh-syn")).unwrap();
        for part in [
            "tcp syn",
            "[22]",
            "203.0.113.0/24",
            "5/1m burst 10",
            "drop (soft)",
        ] {
            assert!(row.contains(part), "{part:?} missing: {row}");
        }
    }

    #[test]
    fn tables_align_and_segments_encode() {
        let t = table(&["A", "LONG"], &[vec!["xyz".into(), "1".into()]]);
        assert_eq!(t, "A    LONG\nxyz  1\n");
        assert_eq!(encode_segment("10.0.0.0/8"), "10.0.0.0%2F8");
        assert_eq!(encode_segment("2001:db8::/32"), "2001:db8::%2F32");
        assert_eq!(encode_segment("a+b&c=d #é"), "a%2Bb%26c%3Dd%20%23%C3%A9");
    }

    /// A host's event prints "-" where it names no rule, limit or source.
    #[test]
    fn events_name_a_limit_and_a_source_only_where_they_have_one() {
        let v = serde_json::json!({"events": [
            {"at_unix_ms": 1_795_800_000_123u64, "event": "flood_started", "rule": "", "limit_index": 0, "source": ""},
            {"at_unix_ms": 1_795_800_000_000u64, "event": "limited", "rule": "dns", "limit_index": 0, "source": "10.0.0.1"},
            {"at_unix_ms": 1_795_800_000_000u64, "event": "cluster_degraded", "rule": "", "limit_index": 0, "source": "", "detail": "timed-out"},
        ]});
        let out = events(&v);
        let lines: Vec<Vec<&str>> = out
            .lines()
            .map(|l| l.split_whitespace().collect())
            .collect();
        assert_eq!(
            lines[1],
            [
                "2026-11-27",
                "17:20:00.123",
                "flood_started",
                "-",
                "-",
                "-",
                "-"
            ],
            "{out}"
        );
        assert_eq!(
            lines[2],
            [
                "2026-11-27",
                "17:20:00.000",
                "limited",
                "dns",
                "0",
                "10.0.0.1",
                "-"
            ],
            "{out}"
        );
        assert_eq!(
            lines[3],
            [
                "2026-11-27",
                "17:20:00.000",
                "cluster_degraded",
                "-",
                "-",
                "-",
                "timed-out"
            ],
            "{out}"
        );
    }

    /// Times read as dates (checked against `date -u -d @SECS`), leap days
    /// and centuries included.
    #[test]
    fn unix_times_read_as_utc_dates() {
        for (secs, want) in [
            (0, "1970-01-01 00:00:00 UTC"),
            (951_782_400, "2000-02-29 00:00:00 UTC"),
            (1_798_407_321, "2026-12-27 21:35:21 UTC"),
            (4_107_542_399, "2100-02-28 23:59:59 UTC"),
        ] {
            assert_eq!(utc(secs), want);
        }
        let ago = since(&Value::from(1_798_407_321_000u64));
        assert!(
            ago.starts_with("2026-12-27 21:35:21 UTC (") && ago.ends_with(" s ago)"),
            "{ago}"
        );
        assert_eq!(since(&Value::Null), "-");
    }
}
