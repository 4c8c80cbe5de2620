//! Envoy's rate-limit service (`envoy.service.ratelimit.v3.RateLimitService
//! /ShouldRateLimit`) on `[l7] grpc_listen`, over the same engine as the
//! HTTP check: any Envoy, Istio or Envoy Gateway can use it unchanged.
//!
//! - Each descriptor is charged on its own; the request is over the limit
//!   if any non-shadow descriptor is. Envoy's request-level `hits_addend` 0
//!   means 1; a descriptor's own `hits_addend` overrides it, and with
//!   `is_negative_hits` it is a refund (a `concurrency` permit released, a token bucket's or window's count given back).
//! - A period Envoy's units cannot express is reported in the longest unit
//!   not longer than it, with `requests_per_unit` scaled down (rounded
//!   down, at least 1): "5 per 90 s" reads "3 per minute". The decision
//!   itself always uses the exact period. A `concurrency` rule reports
//!   `max` per its lease.
//! - A descriptor's `limit` override is applied as Envoy's own service
//!   applies it, in a domain that has rules (`engine::overrides`), unless
//!   `[l7] apply_limit_overrides = false`.
//! - Keys and values longer than 256 bytes are fitted (their start and a
//!   hash of the whole), and hits may be any number: both come from
//!   clients, and a refused call is one Envoy passes unlimited. Malformed
//!   requests (no domain, no or too many descriptors or entries, an empty
//!   key), which only Envoy's configuration makes, get `INVALID_ARGUMENT`.

use envoy_types::pb::{
    envoy::{
        config::core::v3::HeaderValue,
        service::ratelimit::v3::{
            rate_limit_response::{rate_limit::Unit, Code, DescriptorStatus, RateLimit},
            RateLimitRequest, RateLimitResponse,
        },
    },
    google::protobuf::Duration,
};

use super::{
    engine::{overrides, DescriptorEntry, LimitOverride, Status},
    http::{deciding, Shared, MAX_DESCRIPTORS},
    rules::{MAX_ENTRIES, MAX_VALUE_LEN},
};

/// The service.
pub struct Service {
    pub l7: Shared,
    /// Add the IETF `RateLimit-Policy` / `RateLimit` headers.
    pub draft_headers: bool,
}

/// A call's failure: its gRPC status code and message.
#[derive(Debug)]
pub struct Failure {
    pub code: u8,
    pub message: String,
}

impl Failure {
    pub const INVALID_ARGUMENT: u8 = 3;
    pub const DEADLINE_EXCEEDED: u8 = 4;
    pub const RESOURCE_EXHAUSTED: u8 = 8;
    pub const UNIMPLEMENTED: u8 = 12;
    pub const INTERNAL: u8 = 13;

    pub fn new(code: u8, message: impl Into<String>) -> Self {
        Failure {
            code,
            message: message.into(),
        }
    }
}

/// Envoy's unit and `requests_per_unit` for `limit` per `per_secs`.
pub fn envoy_unit(limit: u64, per_secs: u64) -> (Unit, u32) {
    // Envoy's own service: a month is 30 days, a year 365.
    const UNITS: [(u64, Unit); 7] = [
        (31_536_000, Unit::Year),
        (2_592_000, Unit::Month),
        (604_800, Unit::Week),
        (86_400, Unit::Day),
        (3_600, Unit::Hour),
        (60, Unit::Minute),
        (1, Unit::Second),
    ];
    let (secs, unit) = UNITS
        .iter()
        .copied()
        .find(|(s, _)| *s <= per_secs.max(1))
        .unwrap_or((1, Unit::Second));
    let per_unit =
        (limit as u128 * secs as u128 / per_secs.max(1) as u128).clamp(1, u32::MAX as u128);
    (unit, per_unit as u32)
}

fn invalid(m: String) -> Failure {
    Failure::new(Failure::INVALID_ARGUMENT, m)
}

/// A descriptor's status for Envoy. Unmatched descriptors and shadow rules
/// answer OK without a limit: Envoy builds its x-ratelimit headers from the
/// statuses that carry one, and those must be the enforced rules.
fn descriptor_status(s: Status) -> DescriptorStatus {
    if !s.enforced {
        return DescriptorStatus {
            code: Code::Ok as i32,
            ..Default::default()
        };
    }
    let (unit, per_unit) = envoy_unit(s.limit, s.per_secs);
    DescriptorStatus {
        code: if s.code == "over_limit" {
            Code::OverLimit
        } else {
            Code::Ok
        } as i32,
        current_limit: Some(RateLimit {
            name: s.rule,
            requests_per_unit: per_unit,
            unit: unit as i32,
        }),
        limit_remaining: s.remaining.min(u32::MAX as u64) as u32,
        duration_until_reset: Some(Duration {
            seconds: (s.reset_ms / 1000) as i64,
            nanos: ((s.reset_ms % 1000) * 1_000_000) as i32,
        }),
        ..Default::default()
    }
}

fn header(key: &str, value: String) -> HeaderValue {
    HeaderValue {
        key: key.into(),
        value,
        ..Default::default()
    }
}

impl Service {
    /// `ShouldRateLimit`.
    pub async fn answer(&self, r: RateLimitRequest) -> Result<RateLimitResponse, Failure> {
        if r.domain.is_empty() || r.domain.len() > MAX_VALUE_LEN {
            return Err(invalid(format!("domain must be 1..={MAX_VALUE_LEN} bytes")));
        }
        if r.descriptors.is_empty() || r.descriptors.len() > MAX_DESCRIPTORS {
            return Err(invalid(format!(
                "a request needs 1..={MAX_DESCRIPTORS} descriptors, not {} (domain {:?})",
                r.descriptors.len(),
                r.domain
            )));
        }
        let request_hits = if r.hits_addend == 0 {
            1
        } else {
            r.hits_addend as i64
        };
        let mut charges = Vec::with_capacity(r.descriptors.len());
        for d in r.descriptors {
            if d.entries.is_empty() || d.entries.len() > MAX_ENTRIES {
                return Err(invalid(format!(
                    "a descriptor needs 1..={MAX_ENTRIES} entries, not {} (domain {:?})",
                    d.entries.len(),
                    r.domain
                )));
            }
            if d.entries.iter().any(|e| e.key.is_empty()) {
                return Err(invalid("descriptor keys must not be empty".into()));
            }
            let limit = d.limit.and_then(|l| {
                let o = LimitOverride::from_envoy(l.requests_per_unit, l.unit);
                if o.is_none() {
                    overrides::ignored(&r.domain, overrides::Ignored::Unit);
                }
                o
            });
            // Any number of hits: one past a limit's room is over it.
            let hits = d
                .hits_addend
                .map_or(request_hits, |v| v.value.min(i64::MAX as u64) as i64);
            // Moved, not copied: the request is ours. Long values are
            // fitted, never refused (see `DescriptorEntry::fitted`).
            let entries: Vec<DescriptorEntry> = d
                .entries
                .into_iter()
                .map(|e| {
                    DescriptorEntry {
                        key: e.key,
                        value: e.value,
                    }
                    .fitted()
                })
                .collect();
            charges.push((
                entries,
                if d.is_negative_hits { -hits } else { hits },
                limit,
            ));
        }
        let engine = self.l7.read().unwrap_or_else(|e| e.into_inner()).clone();
        let mut statuses: Vec<Status> = Vec::with_capacity(charges.len());
        for (e, h, limit) in &charges {
            let overridden = limit.and_then(|o| engine.decide_overridden(&r.domain, e, *h, o));
            statuses.push(match overridden {
                Some(s) => s,
                None => engine.decide_scoped(&r.domain, e, *h).await,
            });
        }
        let over = statuses.iter().any(|s| s.code == "over_limit");
        let mut out = RateLimitResponse {
            overall_code: if over { Code::OverLimit } else { Code::Ok } as i32,
            ..Default::default()
        };
        if self.draft_headers {
            if let Some(s) = deciding(&statuses) {
                let reset = s.reset_ms.div_ceil(1000);
                out.response_headers_to_add.push(header(
                    "ratelimit-policy",
                    format!("\"{}\";q={};w={}", s.rule, s.limit, s.per_secs),
                ));
                out.response_headers_to_add.push(header(
                    "ratelimit",
                    format!("\"{}\";r={};t={reset}", s.rule, s.remaining),
                ));
            }
        }
        // The statuses moved in: each rule name is copied once per answer.
        out.statuses = statuses.into_iter().map(descriptor_status).collect();
        Ok(out)
    }
}

#[cfg(test)]
mod tests {
    use envoy_types::pb::envoy::extensions::common::ratelimit::v3::{
        rate_limit_descriptor::Entry, RateLimitDescriptor,
    };

    use super::*;

    fn service(rules: &str) -> Service {
        let c =
            crate::config::Config::from_str(&format!("[default]\nrate = 1\n{rules}"), "t").unwrap();
        let engine = std::sync::Arc::new(super::super::engine::Engine::new(&c.l7, 0, None));
        Service {
            l7: std::sync::Arc::new(std::sync::RwLock::new(engine)),
            draft_headers: false,
        }
    }

    fn ask(
        s: &Service,
        domain: &str,
        entries: &[(&str, &str)],
        hits: Option<u64>,
    ) -> Result<RateLimitResponse, Failure> {
        let d = RateLimitDescriptor {
            entries: entries
                .iter()
                .map(|(k, v)| Entry {
                    key: k.to_string(),
                    value: v.to_string(),
                })
                .collect(),
            hits_addend: hits.map(|value| envoy_types::pb::google::protobuf::UInt64Value { value }),
            ..Default::default()
        };
        let r = RateLimitRequest {
            domain: domain.into(),
            descriptors: vec![d],
            hits_addend: 0,
        };
        tokio::runtime::Builder::new_current_thread()
            .build()
            .unwrap()
            .block_on(s.answer(r))
    }

    /// Values and hits come from clients (a JWT, a path, a body's size):
    /// a long value or a large hit count is decided, never refused, since
    /// Envoy passes a request whose rate-limit call fails. Long values
    /// that differ only past the cut keep buckets of their own.
    #[test]
    fn long_values_and_large_hits_are_decided_not_refused() {
        let mut rules = String::new();
        for (name, algo) in [
            ("tb", "token_bucket"),
            ("fw", "fixed_window"),
            ("sw", "sliding_window"),
            ("log", "sliding_log"),
        ] {
            rules += &format!("[[l7.rule]]\nname = \"{name}\"\ndomain = \"d\"\ndescriptor = [{{ key = \"{name}\" }}]\nrate = 2\nper = \"1h\"\nalgorithm = \"{algo}\"\n");
        }
        rules += "[[l7.rule]]\nname = \"sem\"\ndomain = \"d\"\ndescriptor = [{ key = \"sem\" }]\nalgorithm = \"concurrency\"\nmax = 2\n";
        let s = service(&rules);
        let jwt = "eyJ".to_string() + &"a".repeat(4000);
        let code = |r: Result<RateLimitResponse, Failure>| {
            r.map(|r| r.overall_code).map_err(|f| f.message)
        };
        for rule in ["tb", "fw", "sw", "log", "sem"] {
            for big in [1_000_001, u64::from(u32::MAX), u64::MAX] {
                assert_eq!(
                    code(ask(&s, "d", &[(rule, &jwt)], Some(big))),
                    Ok(Code::OverLimit as i32),
                    "{rule}: {big} hits"
                );
            }
            assert_eq!(
                code(ask(&s, "d", &[(rule, &(jwt.clone() + "1"))], Some(2))),
                Ok(Code::Ok as i32),
                "{rule}"
            );
            assert_eq!(
                code(ask(&s, "d", &[(rule, &(jwt.clone() + "1"))], Some(1))),
                Ok(Code::OverLimit as i32),
                "{rule}: spent"
            );
            assert_eq!(
                code(ask(&s, "d", &[(rule, &(jwt.clone() + "2"))], Some(2))),
                Ok(Code::Ok as i32),
                "{rule}: a value differing past the cut has a bucket of its own"
            );
        }
        // A long key too (keys come from Envoy's configuration): unmatched.
        assert_eq!(
            code(ask(&s, "d", &[(&jwt, "v")], None)),
            Ok(Code::Ok as i32)
        );
        assert!(
            code(ask(&s, "d", &[("", "v")], None)).is_err(),
            "an empty key is Envoy's configuration's mistake"
        );
    }

    #[test]
    fn periods_envoy_cannot_express_are_reported_in_the_longest_unit_not_longer() {
        assert_eq!(envoy_unit(5, 60), (Unit::Minute, 5));
        assert_eq!(envoy_unit(5, 90), (Unit::Minute, 3));
        assert_eq!(envoy_unit(300, 60), (Unit::Minute, 300));
        assert_eq!(envoy_unit(10, 86_400), (Unit::Day, 10));
        assert_eq!(
            envoy_unit(1, 7_200),
            (Unit::Hour, 1),
            "rounded down, at least 1"
        );
        assert_eq!(envoy_unit(7, 1), (Unit::Second, 7));
        assert_eq!(envoy_unit(2, 1_209_600), (Unit::Week, 1));
        // Months and years, as Envoy's overrides name them (30 d, 365 d).
        assert_eq!(envoy_unit(1_000, 2_592_000), (Unit::Month, 1_000));
        assert_eq!(envoy_unit(1_000, 5_184_000), (Unit::Month, 500));
        assert_eq!(envoy_unit(12, 31_536_000), (Unit::Year, 12));
    }
}
