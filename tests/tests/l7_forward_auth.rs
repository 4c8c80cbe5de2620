//! The HTTP check as forward-auth gateways use it: a real Caddy
//! (`forward_auth`) and a real nginx (`auth_request`) in front of a real
//! upstream, rl's `/v1/forward-auth/{domain}` deciding from the forwarded
//! request's client address and headers, and the gateway turning rl's
//! "over the limit" into a 429 for the client.

use rl_tests::{
    daemon::{served, Served},
    envoy::upstream,
    gateway::{get_from, Gateway, Reply},
    http::{get, request_tcp},
    lab::Lab,
};

const CHECK: &str = "127.0.0.1:8082";
const UPSTREAM: u16 = 10001;

fn rules() -> String {
    format!(
        "[default]\nrate = 1000\n[l7]\nhttp_listen = \"{CHECK}\"\n\
         [[l7.rule]]\nname = \"login-per-ip\"\ndomain = \"auth\"\n\
         descriptor = [{{ key = \"auth_type\", value = \"login\" }}, {{ key = \"remote_address\" }}]\nrate = 3\nper = \"1m\"\nalgorithm = \"sliding_log\"\n\
         [[l7.rule]]\nname = \"per-key\"\ndomain = \"api\"\ndescriptor = [{{ key = \"x-api-key\" }}]\nrate = 2\nper = \"1h\"\n\
         [[l7.rule]]\nname = \"uploads\"\ndomain = \"up\"\ndescriptor = [{{ key = \"x-api-key\" }}]\nalgorithm = \"concurrency\"\nmax = 2\n"
    )
}

/// Three logins a minute per client address, through `gateway`: a client
/// that forges `X-Forwarded-For` is counted by the address the gateway saw;
/// the 4th login gets 429 with `Retry-After`. Returns that 429.
fn logins_are_limited_per_client(lab: &Lab, gateway: &str, log: impl Fn() -> String) -> Reply {
    let login = |from: &str, headers: &[(&str, &str)]| {
        get_from(&lab.b, from, gateway, "/login", headers).unwrap()
    };
    let forged = [("X-Forwarded-For", "198.51.100.1")];
    let t0 = std::time::Instant::now();
    for i in 0..3 {
        let r = login("127.0.0.1", &forged);
        assert_eq!(
            (r.status, r.body.as_str()),
            (200, "ok"),
            "login {i} reaches the upstream: {r:?}\n{}",
            log()
        );
    }
    let r = login("127.0.0.1", &forged);
    assert_eq!(r.status, 429, "the 4th login in a minute: {r:?}\n{}", log());
    let retry: u64 = r
        .header("retry-after")
        .parse()
        .unwrap_or_else(|_| panic!("{r:?}"));
    // 60 s after the first login, made after `t0`.
    assert!(
        (59u64.saturating_sub(t0.elapsed().as_secs())..=60).contains(&retry),
        "{r:?}"
    );
    let state = |ip: &str| {
        get(
            &lab.b,
            &format!("/v1/l7/state?domain=auth&auth_type=login&remote_address={ip}"),
        )
        .json()
    };
    assert_eq!(state("127.0.0.1")["code"], "over_limit");
    assert_eq!(
        state("198.51.100.1")["remaining"],
        3,
        "the forged address was never charged"
    );
    assert_eq!(
        login("127.0.0.2", &[]).status,
        200,
        "another client has its own bucket"
    );
    r
}

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
fn caddy_forward_auth_limits_by_client_address_and_header() {
    let Served { lab, d, dir, .. } = served(&rules()).unwrap();
    upstream(&lab.b, UPSTREAM).unwrap();
    let caddy = Gateway::caddy(&lab.b, dir.path(), CADDYFILE, 10080).unwrap();
    let r = logins_are_limited_per_client(&lab, "127.0.0.1:10080", || caddy.log());
    // Caddy hands rl's own answer to the client.
    assert_eq!(
        (
            r.header("x-ratelimit-limit"),
            r.header("x-ratelimit-remaining")
        ),
        ("3", "0"),
        "{r:?}"
    );
    assert_eq!(
        r.header("ratelimit-policy"),
        "\"login-per-ip\";q=3;w=60",
        "{r:?}"
    );
    assert!(r.body.contains("over_limit"), "{r:?}");

    // A key from a header; a request without the header is not limited by
    // that rule (as Envoy's request_headers action).
    let api = |headers: &[(&str, &str)]| {
        get_from(
            &lab.b,
            "127.0.0.1",
            "127.0.0.1:10080",
            "/api/items",
            headers,
        )
        .unwrap()
        .status
    };
    assert_eq!(
        [
            api(&[("X-Api-Key", "k1")]),
            api(&[("X-Api-Key", "k1")]),
            api(&[("X-Api-Key", "k1")])
        ],
        [200, 200, 429]
    );
    assert_eq!(api(&[("X-Api-Key", "k2")]), 200);
    assert_eq!([api(&[]), api(&[]), api(&[])], [200, 200, 200]);

    // Called without the client's address: a 400 that says what to send.
    let a = request_tcp(
        &lab.b,
        CHECK,
        "GET",
        "/v1/forward-auth/auth?auth_type=login&remote_address",
        None,
        None,
    )
    .unwrap();
    assert_eq!(a.status, 400, "{}", a.body);
    assert!(a.body.contains("X-Forwarded-For"), "{}", a.body);
    let a = request_tcp(&lab.b, CHECK, "GET", "/v1/forward-auth/auth", None, None).unwrap();
    assert_eq!(a.status, 400, "{}", a.body);
    // A concurrency rule: nothing would release the permits, so a 400 that
    // says so, at the first call (it would read "max per lease" otherwise).
    let up = get_from(
        &lab.b,
        "127.0.0.1",
        CHECK,
        "/v1/forward-auth/up?x-api-key",
        &[("X-Api-Key", "k1")],
    )
    .unwrap();
    assert_eq!(up.status, 400, "{}", up.body);
    assert!(up.body.contains("no release"), "{}", up.body);
    // Over the limit, the status a gateway asks for (nginx needs 401/403).
    let direct = |over: &str| {
        let headers = [("X-Forwarded-For", "127.0.0.1"), ("RL-Over-Status", over)];
        get_from(
            &lab.b,
            "127.0.0.1",
            CHECK,
            "/v1/forward-auth/auth?auth_type=login&remote_address",
            &headers,
        )
        .unwrap()
        .status
    };
    assert_eq!(
        [direct("401"), direct("403"), direct("429"), direct("418")],
        [401, 403, 429, 400]
    );
    let (status, log) = d.stop(libc::SIGTERM).unwrap();
    assert!(status.success(), "{log}");
    assert_eq!(
        api(&[("X-Api-Key", "k3")]),
        502,
        "with rl-control down Caddy fails closed"
    );
}

/// nginx's `auth_request` lets 2xx through, denies on 401 and 403, and
/// takes any other status as an error (500): it asks rl for 403 over the
/// limit (`RL-Over-Status`) and answers the client 429 itself, with rl's
/// `Retry-After`. `$proxy_add_x_forwarded_for` appends the client nginx saw
/// to whatever the client sent: rl takes the last address.
const NGINX: &str = r#"
error_log nginx-error.log warn;
pid nginx.pid;
events { worker_connections 64; }
http {
    access_log off;
    client_body_temp_path tmp-body;
    proxy_temp_path tmp-proxy;
    fastcgi_temp_path tmp-fastcgi;
    uwsgi_temp_path tmp-uwsgi;
    scgi_temp_path tmp-scgi;
    server {
        listen 127.0.0.1:10081;
        location /login {
            auth_request /_rl;
            auth_request_set $rl_retry_after $upstream_http_retry_after;
            error_page 403 = @limited;
            proxy_pass http://127.0.0.1:10001;
        }
        location = /_rl {
            internal;
            proxy_pass http://127.0.0.1:8082/v1/forward-auth/auth?auth_type=login&remote_address;
            proxy_pass_request_body off;
            proxy_set_header Content-Length "";
            proxy_set_header X-Forwarded-For $proxy_add_x_forwarded_for;
            proxy_set_header RL-Over-Status 403;
        }
        location @limited {
            add_header Retry-After $rl_retry_after always;
            return 429;
        }
    }
}
"#;

#[test]
fn nginx_auth_request_limits_by_client_address() {
    let Served { lab, d, dir, .. } = served(&rules()).unwrap();
    upstream(&lab.b, UPSTREAM).unwrap();
    let nginx = Gateway::nginx(&lab.b, dir.path(), NGINX, 10081).unwrap();
    logins_are_limited_per_client(&lab, "127.0.0.1:10081", || {
        nginx.log()
            + &std::fs::read_to_string(dir.path().join("nginx-error.log")).unwrap_or_default()
    });
    let a = request_tcp(
        &lab.b,
        CHECK,
        "GET",
        "/v1/forward-auth/auth?auth_type=login&remote_address",
        None,
        None,
    );
    assert_eq!(a.unwrap().status, 400);
    let (status, log) = d.stop(libc::SIGTERM).unwrap();
    assert!(status.success(), "{log}");
    let r = get_from(&lab.b, "127.0.0.1", "127.0.0.1:10081", "/login", &[]).unwrap();
    assert_eq!(
        r.status, 500,
        "with rl-control down nginx fails closed: {r:?}"
    );
}
