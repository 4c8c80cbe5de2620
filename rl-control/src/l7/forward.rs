//! Descriptors written as a query string (`key=value&key…`, in order), and
//! the entries a forward-auth gateway's request supplies: the check's
//! `/v1/forward-auth/{domain}` and the admin API's `/v1/l7/state` read
//! descriptors this way.
//!
//! Forward-auth gateways (Traefik's `forwardAuth`, Caddy's `forward_auth`,
//! nginx's `auth_request`) call an auth service with the client's request
//! headers and no body, and let the request through on a 2xx. A bare `key`
//! in the query takes its value from that request:
//! - `remote_address`: the last address in `X-Forwarded-For` (the one the
//!   gateway itself saw: earlier ones come from the client and can be
//!   forged), else `X-Real-IP`; neither is an error, never the gateway's
//!   own address (that would put every client in one bucket);
//! - `method`: `X-Forwarded-Method`, else `X-Original-Method`;
//! - `path`: `X-Forwarded-Uri`, else `X-Original-URI`, without its query;
//! - `host`: `X-Forwarded-Host`;
//! - any other key: the request header of that name (`x-api-key`).
//!
//! An entry whose header is absent means the descriptor does not apply, as
//! for Envoy's `request_headers` action: nothing is charged.

use std::net::{IpAddr, SocketAddr};

use axum::http::HeaderMap;

use super::engine::DescriptorEntry;

/// The query's parameters in order, percent-decoded: `key=value` as
/// `(key, Some(value))`, a bare `key` as `(key, None)`.
pub fn query_pairs(q: &str) -> Vec<(String, Option<String>)> {
    q.split('&')
        .filter(|p| !p.is_empty())
        .map(|p| match p.split_once('=') {
            Some((k, v)) => (decode(k), Some(decode(v))),
            None => (decode(p), None),
        })
        .collect()
}

/// Percent-decoding (and `+` as a space) of one query component.
fn decode(s: &str) -> String {
    let b = s.as_bytes();
    let mut out = Vec::with_capacity(b.len());
    let mut i = 0;
    while i < b.len() {
        let hex = |c: u8| (c as char).to_digit(16);
        match b[i] {
            b'%' if i + 2 < b.len() => {
                if let (Some(h), Some(l)) = (hex(b[i + 1]), hex(b[i + 2])) {
                    out.push((h * 16 + l) as u8);
                    i += 3;
                    continue;
                }
                out.push(b'%');
            }
            b'+' => out.push(b' '),
            c => out.push(c),
        }
        i += 1;
    }
    String::from_utf8_lossy(&out).into_owned()
}

/// The descriptor a forward-auth call asks for: the query's entries, bare
/// keys filled from the forwarded request. `Ok(None)` when a header it
/// names is absent (the descriptor does not apply); `Err` says what the
/// gateway must send.
pub fn descriptor(q: &str, headers: &HeaderMap) -> Result<Option<Vec<DescriptorEntry>>, String> {
    let pairs = query_pairs(q);
    if pairs.is_empty() {
        return Err("give the descriptor's entries in the query, in order: ?auth_type=login&remote_address (a bare key takes its value from the forwarded request)".into());
    }
    let mut entries = Vec::with_capacity(pairs.len());
    for (key, value) in pairs {
        let value = match value {
            Some(v) => v,
            None => match forwarded(&key, headers)? {
                Some(v) => v,
                None => return Ok(None),
            },
        };
        entries.push(DescriptorEntry { key, value });
    }
    Ok(Some(entries))
}

/// The value of a bare `key` from the forwarded request's headers (see the
/// module's documentation).
fn forwarded(key: &str, headers: &HeaderMap) -> Result<Option<String>, String> {
    // A header's first value (as most applications read it), even when it
    // is not UTF-8: a value the check cannot read is still charged, never
    // skips its limit.
    let raw = |name: &str| headers.get(name).map(|v| v.as_bytes());
    let header = |name: &str| raw(name).map(text);
    let first_of = |names: [&str; 2]| names.iter().find_map(|n| raw(n));
    let value = match key {
        "remote_address" => Some(remote_address(headers)?),
        "method" => first_of(["x-forwarded-method", "x-original-method"]).map(text),
        // The query goes first, from the bytes: past a long path's cut (or
        // in the hash of bytes that are not UTF-8) it would make each query
        // string a bucket of its own.
        "path" => first_of(["x-forwarded-uri", "x-original-uri"])
            .map(|u| text(u.split(|&b| b == b'?').next().unwrap_or_default())),
        "host" => header("x-forwarded-host"),
        name => {
            if axum::http::HeaderName::from_bytes(name.as_bytes()).is_err() {
                return Err(format!("{name:?} is neither remote_address, method, path, host nor a header name: give it a value (key=value) or name a header"));
            }
            header(name)
        }
    };
    Ok(value.map(super::engine::fitted))
}

/// A header value's bytes as text: UTF-8 as it is; other bytes as U+FFFD
/// followed by a hash of the raw bytes, so that values differing only in
/// bytes that are not UTF-8 stay distinct (one cannot spend another's
/// limit).
fn text(raw: &[u8]) -> String {
    match std::str::from_utf8(raw) {
        Ok(s) => s.to_string(),
        // A hash every build computes alike: cluster rules' keys are
        // shared between daemons.
        Err(_) => format!(
            "{}#{:016x}",
            String::from_utf8_lossy(raw),
            crate::compile::stable_hash(&raw, 0)
        ),
    }
}

/// The client's address as the gateway saw it: the last entry of the last
/// `X-Forwarded-For` line, else `X-Real-IP`. An `X-Forwarded-For` whose
/// last entry is not an address is an error, never a reason to look
/// elsewhere (the client could then choose its own key).
fn remote_address(headers: &HeaderMap) -> Result<String, String> {
    let (raw, from) = match headers.get_all("x-forwarded-for").iter().next_back() {
        Some(v) => (v.as_bytes().rsplit(|b| *b == b',').map(<[u8]>::trim_ascii).find(|a| !a.is_empty()).unwrap_or(b""), "X-Forwarded-For"),
        None => match headers.get("x-real-ip") {
            Some(v) => (v.as_bytes().trim_ascii(), "X-Real-IP"),
            None => return Err("remote_address needs the client's address in X-Forwarded-For or X-Real-IP: have the gateway send it (Traefik and Caddy do)".into()),
        },
    };
    let raw = String::from_utf8_lossy(raw);
    let ip = raw
        .parse::<IpAddr>()
        .or_else(|_| raw.parse::<SocketAddr>().map(|s| s.ip()));
    ip.map(|ip| ip.to_string()).map_err(|_| format!("the client address {raw:?} in {from} is not an IP address: the gateway must add the address it saw"))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::l7::rules::MAX_VALUE_LEN;

    fn headers(pairs: &[(&'static str, &'static str)]) -> HeaderMap {
        let mut h = HeaderMap::new();
        for (k, v) in pairs {
            h.append(*k, v.parse().unwrap());
        }
        h
    }

    fn entries(q: &str, h: &HeaderMap) -> Vec<(String, String)> {
        descriptor(q, h)
            .unwrap()
            .unwrap()
            .into_iter()
            .map(|e| (e.key, e.value))
            .collect()
    }

    #[test]
    fn query_pairs_keep_order_and_decode() {
        let p = query_pairs("domain=auth&a%20b=c+d&bare&e=&&f=%zz%4");
        let want = [
            ("domain", Some("auth")),
            ("a b", Some("c d")),
            ("bare", None),
            ("e", Some("")),
            ("f", Some("%zz%4")),
        ];
        assert_eq!(p, want.map(|(k, v)| (k.to_string(), v.map(String::from))));
    }

    #[test]
    fn the_client_address_is_the_last_one_the_gateway_added() {
        let h = headers(&[
            ("x-forwarded-for", "203.0.113.9, 10.0.0.1"),
            ("x-forwarded-for", " 192.0.2.7 "),
        ]);
        assert_eq!(
            entries("auth_type=login&remote_address", &h),
            [
                ("auth_type".into(), "login".into()),
                ("remote_address".into(), "192.0.2.7".into())
            ]
        );
        let h = headers(&[("x-real-ip", "[2001:db8::1]:443")]);
        assert_eq!(
            entries("remote_address", &h),
            [("remote_address".into(), "2001:db8::1".into())]
        );
        let e = descriptor("remote_address", &HeaderMap::new()).unwrap_err();
        assert!(e.contains("X-Forwarded-For"), "{e}");
        assert!(descriptor(
            "remote_address",
            &headers(&[("x-forwarded-for", "not-an-ip")])
        )
        .is_err());
        // An unreadable last entry is an error, not a reason to take the
        // client's own X-Real-IP.
        let mut h = headers(&[("x-real-ip", "198.51.100.1")]);
        h.append(
            "x-forwarded-for",
            axum::http::HeaderValue::from_bytes(b"10.0.0.1, \xff").unwrap(),
        );
        assert!(descriptor("remote_address", &h).is_err());
    }

    #[test]
    fn bare_keys_come_from_the_forwarded_request_or_skip_the_descriptor() {
        let h = headers(&[
            ("x-forwarded-method", "POST"),
            ("x-original-uri", "/login?next=/"),
            ("x-forwarded-host", "shop.example"),
            ("x-api-key", "k1"),
        ]);
        assert_eq!(
            entries("method&path&host&x-api-key", &h),
            [
                ("method", "POST"),
                ("path", "/login"),
                ("host", "shop.example"),
                ("x-api-key", "k1")
            ]
            .map(|(k, v)| (k.to_string(), v.to_string()))
        );
        assert_eq!(
            descriptor("user=alice&x-user", &h).unwrap(),
            None,
            "an absent header: the descriptor does not apply"
        );
        let mut odd = HeaderMap::new();
        odd.insert(
            "x-api-key",
            axum::http::HeaderValue::from_bytes(b"k\xff").unwrap(),
        );
        let k_ff = entries("x-api-key", &odd)[0].1.clone();
        assert!(
            k_ff.starts_with("k\u{fffd}#"),
            "a value that is not UTF-8 is still a key: {k_ff}"
        );
        let mut other = HeaderMap::new();
        other.insert(
            "x-api-key",
            axum::http::HeaderValue::from_bytes(b"k\xfe").unwrap(),
        );
        assert_ne!(
            entries("x-api-key", &other)[0].1,
            k_ff,
            "values differing in bytes that are not UTF-8 stay distinct"
        );
        odd.append("x-api-key", "second".parse().unwrap());
        assert_eq!(
            entries("x-api-key", &odd)[0].1,
            k_ff,
            "the first value, as applications read it"
        );
        let long = format!("/{}", "p".repeat(400));
        let (a, b) = (
            headers(&[("x-forwarded-uri", Box::leak(long.clone().into_boxed_str()))]),
            headers(&[(
                "x-forwarded-uri",
                Box::leak(format!("{long}q").into_boxed_str()),
            )]),
        );
        let (a, b) = (
            entries("path", &a)[0].1.clone(),
            entries("path", &b)[0].1.clone(),
        );
        assert!(
            a.len() <= MAX_VALUE_LEN && a != b,
            "a long value fits, and stays distinct: {a} {b}"
        );
        // A long path's query is dropped before the cut: it cannot make a
        // bucket per query string.
        let (a, b) = (
            headers(&[(
                "x-forwarded-uri",
                Box::leak(format!("{long}?x=1").into_boxed_str()),
            )]),
            headers(&[(
                "x-forwarded-uri",
                Box::leak(format!("{long}?x=2").into_boxed_str()),
            )]),
        );
        assert_eq!(entries("path", &a), entries("path", &b));
        // And a path that is not UTF-8: the query goes before the hash.
        let with = |q: &[u8]| {
            let mut h = HeaderMap::new();
            h.insert(
                "x-forwarded-uri",
                axum::http::HeaderValue::from_bytes(&[b"/a\xff", q].concat()).unwrap(),
            );
            entries("path", &h)[0].1.clone()
        };
        assert_eq!(
            with(b"?x=1"),
            with(b""),
            "the query does not make another bucket"
        );
        assert_ne!(
            with(b""),
            {
                let mut h = HeaderMap::new();
                h.insert(
                    "x-forwarded-uri",
                    axum::http::HeaderValue::from_bytes(b"/a\xfe?x=1").unwrap(),
                );
                entries("path", &h)[0].1.clone()
            },
            "paths differing in bytes that are not UTF-8 stay apart"
        );
        assert!(descriptor("", &h).is_err());
        assert!(descriptor("bad%20name", &h).is_err());
    }
}
