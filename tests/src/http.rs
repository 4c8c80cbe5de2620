//! Real HTTP to a daemon's admin API: over its Unix socket (the lab
//! namespace's runtime directory), or over TCP inside the namespace.

use anyhow::{Context, Result};

use crate::lab::Netns;

/// One answer: status and body.
#[derive(Debug, Clone)]
pub struct Answer {
    pub status: u16,
    pub body: String,
}

impl Answer {
    pub fn json(&self) -> serde_json::Value {
        serde_json::from_str(&self.body).unwrap_or_else(|e| panic!("not JSON ({e}): {}", self.body))
    }
}

/// `method path` to the admin socket of the daemon running in `ns` (see
/// `Netns::runtime_dir`), with an optional body (content type, bytes) and
/// bearer token.
pub fn request(
    ns: &Netns,
    method: &str,
    path: &str,
    body: Option<(&str, Vec<u8>)>,
    token: Option<&str>,
) -> Result<Answer> {
    exchange(ns, method, path, body, token, &[]).map(|(a, _)| a)
}

/// [`request`] with `extra` request headers: the answer and its header
/// block.
fn exchange(
    ns: &Netns,
    method: &str,
    path: &str,
    body: Option<(&str, Vec<u8>)>,
    token: Option<&str>,
    extra: &[(&str, &str)],
) -> Result<(Answer, String)> {
    let sock = ns.runtime_dir().join(rl_control::cli::API_SOCKET);
    let content = body.as_ref().map(|(t, b)| (*t, b.as_slice()));
    let (status, head, body) =
        rl_control::cli::unix_exchange(&sock, method, path, content, token, extra)
            .with_context(|| format!("{method} {path} on {}", sock.display()))?;
    Ok((Answer { status, body }, head))
}

/// [`request`] with `extra` request headers: the answer and the value of
/// its header `want` (case-insensitive), if any.
pub fn request_headers(
    ns: &Netns,
    method: &str,
    path: &str,
    body: Option<(&str, Vec<u8>)>,
    extra: &[(&str, &str)],
    want: &str,
) -> Result<(Answer, Option<String>)> {
    let (answer, head) = exchange(ns, method, path, body, None, extra)?;
    let value = head.lines().find_map(|l| {
        let (name, value) = l.split_once(':')?;
        name.trim()
            .eq_ignore_ascii_case(want)
            .then(|| value.trim().to_string())
    });
    Ok((answer, value))
}

/// `method path` over TCP to `addr` from inside `ns`.
pub fn request_tcp(
    ns: &Netns,
    addr: &str,
    method: &str,
    path: &str,
    body: Option<(&str, Vec<u8>)>,
    token: Option<&str>,
) -> Result<Answer> {
    let (method, url) = (method.to_string(), format!("http://{addr}{path}"));
    let body = body.map(|(t, b)| (t.to_string(), b));
    let token = token.map(str::to_string);
    ns.run(move || {
        let agent = ureq::AgentBuilder::new()
            .timeout(std::time::Duration::from_secs(30))
            .build();
        let mut req = agent.request(&method, &url);
        if let Some(t) = &token {
            req = req.set("Authorization", &format!("Bearer {t}"));
        }
        let res = match &body {
            Some((ctype, bytes)) => req.set("Content-Type", ctype).send_bytes(bytes),
            None => req.call(),
        };
        let r = match res {
            Ok(r) => r,
            Err(ureq::Error::Status(_, r)) => r,
            Err(e) => return Err(e).with_context(|| format!("{method} {url}")),
        };
        let status = r.status();
        Ok(Answer {
            status,
            body: r.into_string().context("reading the answer")?,
        })
    })
}

/// GET without a token.
pub fn get(ns: &Netns, path: &str) -> Answer {
    request(ns, "GET", path, None, None).unwrap()
}

/// A JSON body.
pub fn json(v: &serde_json::Value) -> Option<(&'static str, Vec<u8>)> {
    Some(("application/json", serde_json::to_vec(v).unwrap()))
}

/// Parses Prometheus text: `name{labels}` ➜ value, checking every sample
/// line has a declared TYPE.
pub fn parse_prometheus(text: &str) -> std::collections::HashMap<String, f64> {
    let mut typed = std::collections::HashSet::new();
    let mut out = std::collections::HashMap::new();
    for line in text.lines() {
        if let Some(rest) = line.strip_prefix("# TYPE ") {
            let mut it = rest.split_whitespace();
            let (name, kind) = (it.next().unwrap(), it.next().unwrap());
            assert!(["counter", "gauge", "histogram"].contains(&kind), "{line}");
            typed.insert(name.to_string());
            continue;
        }
        if line.starts_with('#') || line.is_empty() {
            continue;
        }
        let (series, value) = line
            .rsplit_once(' ')
            .unwrap_or_else(|| panic!("bad sample line: {line}"));
        let name = series.split('{').next().unwrap();
        let family = ["_bucket", "_sum", "_count"]
            .iter()
            .find_map(|x| name.strip_suffix(x))
            .filter(|f| typed.contains(*f));
        assert!(
            typed.contains(name) || family.is_some(),
            "sample before its TYPE: {line}"
        );
        assert!(!series.contains('{') || series.ends_with('}'), "{line}");
        out.insert(
            series.to_string(),
            value
                .parse::<f64>()
                .unwrap_or_else(|_| panic!("bad value: {line}")),
        );
    }
    out
}
