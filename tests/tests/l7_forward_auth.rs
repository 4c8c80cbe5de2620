//! The HTTP check as a forward-auth gateway uses it: a real Caddy
//! (`forward_auth`) in front of a real upstream, rl's
//! `/v1/forward-auth/{domain}` deciding from the forwarded request's
//! client address and headers, and Caddy handing rl's 429 (with its
//! headers) to the client.

use rl_tests::{
    caddy::{get_from, Caddy},
    daemon::{served, Served},
    envoy::upstream,
    http::{get, request_tcp},
};

const CHECK: &str = "127.0.0.1:8082";
const GATEWAY: &str = "127.0.0.1:10080";

const CADDYFILE: &str = r#"
{
	admin off
	auto_https off
}
:10080 {
	handle /login* {
		forward_auth 127.0.0.1:8082 {
			uri /v1/forward-auth/auth?auth_type=login&remote_address
		}
		reverse_proxy 127.0.0.1:10001
	}
	handle /api* {
		forward_auth 127.0.0.1:8082 {
			uri /v1/forward-auth/api?x-api-key
		}
		reverse_proxy 127.0.0.1:10001
	}
}
"#;

#[test]
fn a_real_forward_auth_gateway_limits_by_client_address_and_header() {
    let Served { lab, d, dir, .. } = served(&format!(
        "[default]\nrate = 1000\n[l7]\nhttp_listen = \"{CHECK}\"\n\
         [[l7.rule]]\nname = \"login-per-ip\"\ndomain = \"auth\"\n\
         descriptor = [{{ key = \"auth_type\", value = \"login\" }}, {{ key = \"remote_address\" }}]\nrate = 3\nper = \"1m\"\nalgorithm = \"sliding_log\"\n\
         [[l7.rule]]\nname = \"per-key\"\ndomain = \"api\"\ndescriptor = [{{ key = \"x-api-key\" }}]\nrate = 2\nper = \"1h\"\n"
    ))
    .unwrap();
    upstream(&lab.b, 10001).unwrap();
    let caddy = Caddy::start(&lab.b, dir.path(), CADDYFILE, 10080).unwrap();
    let login = |from: &str, headers: &[(&str, &str)]| get_from(&lab.b, from, GATEWAY, "/login", headers).unwrap();

    // A client that forges X-Forwarded-For is still counted by the address
    // Caddy saw.
    let forged = [("X-Forwarded-For", "198.51.100.1")];
    for i in 0..3 {
        let r = login("127.0.0.1", &forged);
        assert_eq!((r.status, r.body.as_str()), (200, "ok"), "login {i} reaches the upstream: {r:?}\n{}", caddy.log());
    }
    let r = login("127.0.0.1", &forged);
    assert_eq!(r.status, 429, "the 4th login in a minute: {r:?}");
    assert_eq!((r.header("x-ratelimit-limit"), r.header("x-ratelimit-remaining")), ("3", "0"), "{r:?}");
    let retry: u64 = r.header("retry-after").parse().unwrap_or_else(|_| panic!("{r:?}"));
    assert!((59..=60).contains(&retry), "{r:?}");
    assert_eq!(r.header("ratelimit-policy"), "\"login-per-ip\";q=3;w=60", "{r:?}");
    assert!(r.body.contains("over_limit"), "rl's own answer reaches the client: {r:?}");
    let state = |ip: &str| get(&lab.b, &format!("/v1/l7/state?domain=auth&auth_type=login&remote_address={ip}")).json();
    assert_eq!(state("127.0.0.1")["code"], "over_limit");
    assert_eq!(state("198.51.100.1")["remaining"], 3, "the forged address was never charged");
    assert_eq!(login("127.0.0.2", &[]).status, 200, "another client has its own bucket");

    // A key from a header; a request without the header is not limited by
    // that rule (as Envoy's request_headers action).
    let api = |headers: &[(&str, &str)]| get_from(&lab.b, "127.0.0.1", GATEWAY, "/api/items", headers).unwrap().status;
    assert_eq!([api(&[("X-Api-Key", "k1")]), api(&[("X-Api-Key", "k1")]), api(&[("X-Api-Key", "k1")])], [200, 200, 429]);
    assert_eq!(api(&[("X-Api-Key", "k2")]), 200);
    assert_eq!([api(&[]), api(&[]), api(&[])], [200, 200, 200]);

    // Called without the client's address: a 400 that says what to send.
    let a = request_tcp(&lab.b, CHECK, "GET", "/v1/forward-auth/auth?auth_type=login&remote_address", None, None).unwrap();
    assert_eq!(a.status, 400, "{}", a.body);
    assert!(a.body.contains("X-Forwarded-For"), "{}", a.body);
    let a = request_tcp(&lab.b, CHECK, "GET", "/v1/forward-auth/auth", None, None).unwrap();
    assert_eq!(a.status, 400, "{}", a.body);
    drop(caddy);
    let (status, log) = d.stop(libc::SIGTERM).unwrap();
    assert!(status.success(), "{log}");
}
