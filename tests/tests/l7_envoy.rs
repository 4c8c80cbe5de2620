//! Envoy's rate-limit service against real clients: a real Envoy (its
//! `ratelimit` filter, a real upstream, descriptors from a header and from
//! `remote_address`, x-ratelimit headers) and Envoy's own Python gRPC
//! client (several descriptors per request, hits_addend, refunds).

use std::time::Duration;

use rl_tests::{
    daemon::{write, Daemon},
    envoy::{self, upstream},
    http::{get, parse_prometheus},
    lab::Lab,
};

const GRPC: &str = "127.0.0.1:8081";

fn rules() -> String {
    format!(
        "[default]\nrate = 1000\n[l7]\ngrpc_listen = \"{GRPC}\"\ndraft_headers = true\n\
         [[l7.rule]]\nname = \"per-user\"\ndomain = \"edge\"\ndescriptor = [{{ key = \"user\" }}]\nrate = 3\nper = \"1m\"\n\
         [[l7.rule]]\nname = \"per-ip\"\ndomain = \"edge\"\ndescriptor = [{{ key = \"remote_address\" }}]\nrate = 1\nper = \"1h\"\naction = \"shadow\"\n\
         [[l7.rule]]\nname = \"uploads\"\ndomain = \"api\"\ndescriptor = [{{ key = \"user\" }}, {{ key = \"op\", value = \"upload\" }}]\nalgorithm = \"concurrency\"\nmax = 2\n\
         [[l7.rule]]\nname = \"reads\"\ndomain = \"api\"\ndescriptor = [{{ key = \"user\" }}, {{ key = \"op\", value = \"read\" }}]\nrate = 10\nper = \"1m\"\n\
         [[l7.rule]]\nname = \"tokens\"\ndomain = \"api\"\ndescriptor = [{{ key = \"user\" }}, {{ key = \"op\", value = \"tokens\" }}]\nrate = 100\nper = \"1h\"\ndrain_over_limit = true\n"
    )
}

const ENVOY: &str = r#"
admin: { address: { socket_address: { address: 127.0.0.1, port_value: 9901 } } }
static_resources:
  listeners:
  - name: edge
    address: { socket_address: { address: 127.0.0.1, port_value: 10000 } }
    filter_chains:
    - filters:
      - name: envoy.filters.network.http_connection_manager
        typed_config:
          "@type": type.googleapis.com/envoy.extensions.filters.network.http_connection_manager.v3.HttpConnectionManager
          stat_prefix: edge
          route_config:
            virtual_hosts:
            - name: all
              domains: ["*"]
              routes:
              - match: { prefix: "/metered" }
                route:
                  cluster: upstream
                  rate_limits:
                  - actions: [{ request_headers: { header_name: x-user, descriptor_key: user } }]
                    limit: { dynamic_metadata: { metadata_key: { key: rl, path: [{ key: limit }] } } }
              - match: { prefix: "/" }
                route:
                  cluster: upstream
                  rate_limits:
                  - actions: [{ request_headers: { header_name: x-user, descriptor_key: user } }]
                  - actions: [{ remote_address: {} }]
          http_filters:
          # The limit override of /metered: 5 per minute, as a plan's
          # metadata would give it.
          - name: envoy.filters.http.lua
            typed_config:
              "@type": type.googleapis.com/envoy.extensions.filters.http.lua.v3.Lua
              default_source_code:
                inline_string: |
                  function envoy_on_request(h)
                    h:streamInfo():dynamicMetadata():set("rl", "limit", { requests_per_unit = 5, unit = "MINUTE" })
                  end
          - name: envoy.filters.http.ratelimit
            typed_config:
              "@type": type.googleapis.com/envoy.extensions.filters.http.ratelimit.v3.RateLimit
              domain: edge
              failure_mode_deny: false
              timeout: 1s
              enable_x_ratelimit_headers: DRAFT_VERSION_03
              rate_limit_service:
                transport_api_version: V3
                grpc_service: { envoy_grpc: { cluster_name: rl } }
          - name: envoy.filters.http.router
            typed_config: { "@type": type.googleapis.com/envoy.extensions.filters.http.router.v3.Router }
  clusters:
  - name: upstream
    type: STATIC
    load_assignment:
      cluster_name: upstream
      endpoints: [{ lb_endpoints: [{ endpoint: { address: { socket_address: { address: 127.0.0.1, port_value: 18080 } } } }] }]
  - name: rl
    type: STATIC
    typed_extension_protocol_options:
      envoy.extensions.upstreams.http.v3.HttpProtocolOptions:
        "@type": type.googleapis.com/envoy.extensions.upstreams.http.v3.HttpProtocolOptions
        explicit_http_config: { http2_protocol_options: {} }
    load_assignment:
      cluster_name: rl
      endpoints: [{ lb_endpoints: [{ endpoint: { address: { socket_address: { address: 127.0.0.1, port_value: 8081 } } } }] }]
"#;

/// One request through Envoy as `user`: status and lower-cased headers.
fn through_envoy(lab: &Lab, user: &str) -> (u16, std::collections::HashMap<String, String>) {
    through_envoy_to(lab, "/", user)
}

/// [`through_envoy`] to `path`.
fn through_envoy_to(
    lab: &Lab,
    path: &str,
    user: &str,
) -> (u16, std::collections::HashMap<String, String>) {
    let (user, url) = (user.to_string(), format!("http://127.0.0.1:10000{path}"));
    lab.b
        .run(move || {
            let agent = ureq::AgentBuilder::new()
                .timeout(Duration::from_secs(5))
                .build();
            let r = match agent.get(&url).set("x-user", &user).call() {
                Ok(r) => r,
                Err(ureq::Error::Status(_, r)) => r,
                Err(e) => return Err(e.into()),
            };
            let h = r
                .headers_names()
                .into_iter()
                .filter_map(|n| {
                    r.header(&n)
                        .map(|v| (n.to_ascii_lowercase(), v.to_string()))
                })
                .collect();
            Ok((r.status(), h))
        })
        .unwrap()
}

#[test]
fn a_real_envoy_limits_through_rl_and_fails_open_while_rl_is_down() {
    let lab = Lab::new().unwrap();
    let dir = tempfile::tempdir().unwrap();
    upstream(&lab.b, 18080).unwrap();
    let cfg = write(&dir, "rl.toml", &rules());
    let d = Daemon::serving(&lab, &cfg, &[]).unwrap();
    let envoy = envoy::start(&lab.b, dir.path(), ENVOY, 9901).unwrap();

    for left in [2, 1, 0] {
        let (status, h) = through_envoy(&lab, "alice");
        assert_eq!(status, 200, "{h:?}\n{}", envoy.log());
        assert!(h["x-ratelimit-limit"].starts_with("3"), "{h:?}");
        assert_eq!(h["x-ratelimit-remaining"], left.to_string(), "{h:?}");
        let reset: u64 = h["x-ratelimit-reset"].parse().unwrap();
        assert!(reset <= 60, "{h:?}");
    }
    let (status, h) = through_envoy(&lab, "alice");
    assert_eq!(status, 429, "{h:?}");
    assert_eq!(
        h.get("x-envoy-ratelimited").map(String::as_str),
        Some("true"),
        "{h:?}"
    );
    assert_eq!(h["x-ratelimit-remaining"], "0");
    // A user header longer than descriptors hold (a JWT, say) is limited
    // like any other, never refused: a refused call is one Envoy passes.
    // Two such users that differ only at the end keep buckets of their own.
    let long = "eyJ".to_string() + &"x".repeat(3000);
    for variant in ["a", "b"] {
        let got: Vec<u16> = (0..4)
            .map(|_| through_envoy(&lab, &format!("{long}{variant}")).0)
            .collect();
        assert_eq!(
            got,
            [200, 200, 200, 429],
            "a {}-byte user, {variant}\n{}",
            long.len() + 1,
            envoy.log()
        );
    }
    // A route whose rate limit carries Envoy's limit override (5 per
    // minute, from dynamic metadata): the override decides, not per-user's
    // 3 per minute.
    let got: Vec<u16> = (0..6)
        .map(|_| through_envoy_to(&lab, "/metered", "dave").0)
        .collect();
    assert_eq!(got, [200, 200, 200, 200, 200, 429], "{}", envoy.log());
    // Another user has a bucket of their own; the shadow rule on the
    // address (1 per hour, long exceeded) never answers 429.
    assert_eq!(through_envoy(&lab, "bob").0, 200);
    let m = parse_prometheus(&get(&lab.b, "/metrics").body);
    assert!(
        m["rl_l7_decisions_total{rule=\"per-ip\",result=\"shadow_over\"}"] >= 4.0,
        "{m:?}"
    );
    assert_eq!(
        m["rl_l7_decisions_total{rule=\"per-user\",result=\"over\"}"], 4.0,
        "alice's fourth, each long user's, and dave's sixth (an override counts under its rule)"
    );

    // rl stopped: Envoy's failure mode (allow) applies.
    let (status, log) = d.stop(libc::SIGTERM).unwrap();
    assert!(status.success(), "{log}");
    assert_eq!(
        through_envoy(&lab, "alice").0,
        200,
        "failure_mode_deny = false lets requests through"
    );
    // rl back: decisions resume.
    let d = Daemon::serving(&lab, &cfg, &[]).unwrap();
    let mut got = Vec::new();
    for _ in 0..4 {
        got.push(through_envoy(&lab, "carol").0);
    }
    assert_eq!(got, [200, 200, 200, 429], "{}", envoy.log());
    drop(envoy);
    let (status, log) = d.stop(libc::SIGTERM).unwrap();
    assert!(status.success(), "{log}");
}

const PY_CLIENT: &str = r#"
import json, sys, grpc
from envoy.service.ratelimit.v3 import rls_pb2, rls_pb2_grpc
from envoy.extensions.common.ratelimit.v3 import ratelimit_pb2
from google.protobuf import wrappers_pb2

stub = rls_pb2_grpc.RateLimitServiceStub(grpc.insecure_channel(sys.argv[1]))

def desc(entries, hits=None, negative=False):
    d = ratelimit_pb2.RateLimitDescriptor(entries=[ratelimit_pb2.RateLimitDescriptor.Entry(key=k, value=v) for k, v in entries])
    if hits is not None:
        d.hits_addend.CopyFrom(wrappers_pb2.UInt64Value(value=hits))
    if negative:
        # is_negative_hits (field 4): newer than these Python protos, so
        # set as the raw field, which the message keeps and sends.
        d.MergeFromString(b"\x20\x01")
    return d

def ask(domain, descs, hits=0):
    r = stub.ShouldRateLimit(rls_pb2.RateLimitRequest(domain=domain, descriptors=descs, hits_addend=hits))
    return {"overall": r.overall_code, "codes": [s.code for s in r.statuses],
            "remaining": [s.limit_remaining for s in r.statuses],
            "limits": [[s.current_limit.name, s.current_limit.requests_per_unit, s.current_limit.unit] for s in r.statuses],
            "headers": {h.key: h.value for h in r.response_headers_to_add}}

up = lambda: desc([("user", "u1"), ("op", "upload")])
read = lambda h=None: desc([("user", "u1"), ("op", "read")], h)
out = {}
# Two descriptors in one request: an upload permit and a read.
out["both"] = ask("api", [up(), read()])
out["second_upload"] = ask("api", [up()])
out["third_upload"] = ask("api", [up()])
# A refund releases a permit.
out["refund"] = ask("api", [desc([("user", "u1"), ("op", "upload")], 1, True)])
out["after_refund"] = ask("api", [up()])
# hits_addend: 8 reads at once at the request level leave 1 of 10.
out["eight_reads"] = ask("api", [read()], hits=8)
out["two_more"] = ask("api", [read(2)])
out["unmatched"] = ask("api", [desc([("nothing", "x")])])
try:
    stub.ShouldRateLimit(rls_pb2.RateLimitRequest(domain="", descriptors=[up()]))
    out["empty_domain"] = "accepted"
except grpc.RpcError as e:
    out["empty_domain"] = e.code().name
# Values and hits from clients are decided, never refused (a refused call
# is one Envoy passes): a 300-byte user's read of 11 hits is over 10.
out["huge_value"] = ask("api", [desc([("user", "v" * 300), ("op", "read")], 11)])
out["huge_hits"] = ask("api", [desc([("user", "u9"), ("op", "read")], 2**64 - 1)])
# A token budget (100 per hour, drain_over_limit): each request checked
# with 0 hits, its usage charged after the fact (Envoy's
# apply_on_stream_done). 60 + 70 is over: the budget is drained, and the
# next check says so.
tokens = lambda h: desc([("user", "u1"), ("op", "tokens")], h)
out["budget"] = [ask("api", [tokens(0)]), ask("api", [tokens(60)]), ask("api", [tokens(0)]),
                 ask("api", [tokens(70)]), ask("api", [tokens(0)])]
# Envoy's limit override, as Envoy's own service applies it: 11 reads
# under 1000 per second pass (the rule says 10 per minute); 2 per minute
# lets two through; the rule's own bucket is untouched (10 reads pass).
def overridden(entries, n, unit, hits=None):
    d = desc(entries, hits)
    d.limit.requests_per_unit = n
    d.limit.unit = unit
    return d
u7 = [("user", "u7"), ("op", "read")]
out["override"] = ask("api", [overridden(u7, 1000, 1, 11)])
out["override_small"] = [ask("api", [overridden(u7, 2, 2)]) for _ in range(3)]
out["override_rule_bucket"] = ask("api", [desc(u7, 10)])
# No rule for this descriptor: a fixed window per descriptor.
tenant = [("tenant", "t1")]
out["override_unmatched"] = [ask("api", [overridden(tenant, 1, 3)]) for _ in range(2)]
# Not applied: an unknown unit (the rule's 10 per minute decides 11 hits),
# and a concurrency rule (its 2 permits decide).
out["override_unit"] = ask("api", [overridden([("user", "u8"), ("op", "read")], 1000, 99, 11)])
out["override_concurrency"] = ask("api", [overridden([("user", "u8"), ("op", "upload")], 1000, 1, 3)])
print(json.dumps(out))
"#;

#[test]
fn envoys_python_grpc_client_gets_several_descriptors_hits_and_refunds_right() {
    let lab = Lab::new().unwrap();
    let dir = tempfile::tempdir().unwrap();
    let cfg = write(&dir, "rl.toml", &rules());
    let d = Daemon::serving(&lab, &cfg, &[]).unwrap();
    let out = std::process::Command::new("ip")
        .args([
            "netns",
            "exec",
            &lab.b.name,
            "python3",
            "-c",
            PY_CLIENT,
            GRPC,
        ])
        .output()
        .expect("python3");
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let v: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    const OK: u64 = 1;
    const OVER: u64 = 2;
    let codes = |k: &str| {
        v[k]["codes"]
            .as_array()
            .unwrap()
            .iter()
            .map(|c| c.as_u64().unwrap())
            .collect::<Vec<_>>()
    };
    assert_eq!(codes("both"), [OK, OK]);
    assert_eq!(
        v["both"]["limits"][0],
        serde_json::json!(["uploads", 2, 2]),
        "concurrency: max per lease (60 s: a minute)"
    );
    assert_eq!(
        v["both"]["limits"][1],
        serde_json::json!(["reads", 10, 2]),
        "10 per minute"
    );
    assert_eq!(v["both"]["remaining"], serde_json::json!([1, 9]));
    assert_eq!(codes("second_upload"), [OK]);
    assert_eq!(
        (codes("third_upload"), v["third_upload"]["overall"].as_u64()),
        (vec![OVER], Some(OVER)),
        "max 2 permits out"
    );
    assert_eq!(codes("refund"), [OK]);
    assert_eq!(codes("after_refund"), [OK], "the refund released a permit");
    assert_eq!(
        (codes("eight_reads"), &v["eight_reads"]["remaining"]),
        (vec![OK], &serde_json::json!([1]))
    );
    assert_eq!(
        codes("two_more"),
        [OVER],
        "a descriptor's hits_addend overrides the request's"
    );
    assert_eq!(
        (codes("unmatched"), v["unmatched"]["overall"].as_u64()),
        (vec![OK], Some(OK))
    );
    assert!(
        v["both"]["headers"]["ratelimit-policy"]
            .as_str()
            .unwrap()
            .starts_with("\"uploads\";q=2"),
        "{v}"
    );
    assert_eq!(v["empty_domain"], "INVALID_ARGUMENT");
    let budget: Vec<(u64, u64)> = v["budget"]
        .as_array()
        .unwrap()
        .iter()
        .map(|a| {
            (
                a["codes"][0].as_u64().unwrap(),
                a["remaining"][0].as_u64().unwrap(),
            )
        })
        .collect();
    assert_eq!(
        budget,
        [(OK, 100), (OK, 40), (OK, 40), (OVER, 0), (OVER, 0)],
        "a drained budget is over at the next check: {v}"
    );
    assert_eq!(
        (codes("override"), &v["override"]["limits"][0]),
        (vec![OK], &serde_json::json!(["reads", 1000, 1])),
        "the override decides, not the rule: {v}"
    );
    let small: Vec<u64> = v["override_small"]
        .as_array()
        .unwrap()
        .iter()
        .map(|a| a["codes"][0].as_u64().unwrap())
        .collect();
    assert_eq!(small, [OK, OK, OVER], "2 per minute: {v}");
    assert_eq!(
        v["override_small"][0]["limits"][0],
        serde_json::json!(["reads", 2, 2])
    );
    assert_eq!(
        codes("override_rule_bucket"),
        [OK],
        "the rule's bucket untouched: {v}"
    );
    let unmatched: Vec<(u64, String)> = v["override_unmatched"]
        .as_array()
        .unwrap()
        .iter()
        .map(|a| {
            (
                a["codes"][0].as_u64().unwrap(),
                a["limits"][0][0].as_str().unwrap().to_string(),
            )
        })
        .collect();
    assert_eq!(
        unmatched,
        [
            (OK, "(override)".to_string()),
            (OVER, "(override)".to_string())
        ],
        "1 per hour for a descriptor no rule matches: {v}"
    );
    assert_eq!(codes("override_unit"), [OVER], "the rule decides: {v}");
    assert_eq!(
        codes("override_concurrency"),
        [OVER],
        "3 permits over max 2: {v}"
    );
    let m = parse_prometheus(&get(&lab.b, "/metrics").body);
    assert_eq!(m.get("rl_l7_limit_overrides_ignored_total"), Some(&2.0));
    assert_eq!(
        m.get("rl_l7_decisions_total{rule=\"(override)\",result=\"over\"}"),
        Some(&1.0)
    );
    assert!(
        d.log().contains("its unit is not one of")
            && d.log()
                .contains("a concurrency or scope = \"cluster\" rule"),
        "{}",
        d.log()
    );
    assert_eq!(codes("huge_value"), [OVER], "{v}");
    assert_eq!(codes("huge_hits"), [OVER], "{v}");
    let (status, log) = d.stop(libc::SIGTERM).unwrap();
    assert!(status.success(), "{log}");
}
