//! Envoy's rate-limit service on several threads (`[l7] grpc_threads`):
//! connections are dealt out in turn, every thread answers from the one
//! shared set of request buckets, bad calls get their gRPC status, and
//! `rl_l7_grpc_connections{thread}` follows connections as they open and
//! close.

use std::{sync::mpsc, time::Duration};

use envoy_types::pb::envoy::{
    extensions::common::ratelimit::v3::{rate_limit_descriptor::Entry, RateLimitDescriptor},
    service::ratelimit::v3::{rate_limit_response::Code, RateLimitRequest},
};
use rl_tests::{
    daemon::{served, Served},
    http::{get, parse_prometheus},
    lab::Lab,
    rls::{encode, Conn},
};

const GRPC: &str = "127.0.0.1:8081";

fn request(user: &str) -> RateLimitRequest {
    RateLimitRequest {
        domain: "edge".into(),
        descriptors: vec![RateLimitDescriptor {
            entries: vec![Entry {
                key: "user".into(),
                value: user.into(),
            }],
            ..Default::default()
        }],
        hits_addend: 1,
    }
}

fn connections(lab: &Lab) -> (f64, f64) {
    let m = parse_prometheus(&get(&lab.b, "/metrics").body);
    let at = |t: &str| {
        m.get(&format!("rl_l7_grpc_connections{{thread=\"{t}\"}}"))
            .copied()
            .unwrap_or(-1.0)
    };
    (at("0"), at("1"))
}

#[test]
fn connections_are_dealt_over_the_threads_which_share_one_set_of_buckets() {
    let Served { lab, d, dir: _dir, .. } = served(&format!(
        "[default]\nrate = 1000\n[l7]\ngrpc_listen = \"{GRPC}\"\ngrpc_threads = 2\n\
         [[l7.rule]]\nname = \"per-user\"\ndomain = \"edge\"\ndescriptor = [{{ key = \"user\" }}]\nrate = 3\nper = \"1h\"\n"
    ))
    .unwrap();
    let names: Vec<String> = std::fs::read_dir(format!("/proc/{}/task", d.pid()))
        .unwrap()
        .filter_map(|t| std::fs::read_to_string(t.ok()?.path().join("comm")).ok())
        .map(|c| c.trim().to_string())
        .collect();
    for want in ["rl-l7-0", "rl-l7-1"] {
        assert!(
            names.iter().any(|n| n == want),
            "no thread {want} in the daemon: {names:?}"
        );
    }
    assert!(
        !names.iter().any(|n| n == "rl-l7-2"),
        "more threads than grpc_threads = 2: {names:?}"
    );
    assert_eq!(
        connections(&lab),
        (0.0, 0.0),
        "connections before any client"
    );

    // Four connections, held open until told; one call on each, in turn.
    let (opened, wait_open) = mpsc::channel();
    let (close, closing) = mpsc::channel::<()>();
    let client = lab.b.spawn(move || {
        let rt = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()?;
        rt.block_on(async move {
            let mut conns = Vec::new();
            for _ in 0..4 {
                conns.push(Conn::connect(GRPC.parse()?).await?);
            }
            // User "u" may pass 3 times an hour: the 4th call is over the
            // limit whichever thread answers it.
            let mut codes = Vec::new();
            for c in &conns {
                codes.push(c.call(encode(&request("u"))).await?);
            }
            // Bad input on the same connections: a body that is not the
            // protobuf, a request without a domain, a method that does
            // not exist. Each is answered with its gRPC status and the
            // connection keeps serving.
            let garbage = bytes::Bytes::from_static(&[0, 0, 0, 0, 3, 0xff, 0xff, 0xff]);
            let mut no_domain = request("u");
            no_domain.domain.clear();
            // And gRPC's own framing, which the daemon reads itself: a
            // compressed message (no compression is offered), a message
            // shorter than its prefix says, no message, two messages, and
            // one over the 1 MiB cap.
            let mut two = encode(&request("u")).to_vec();
            two.extend_from_slice(&two.clone());
            let mut huge = vec![0u8, 0, 0x10, 0, 1];
            huge.resize(5 + (1 << 20) + 1, b'x');
            const RLS: &str = "/envoy.service.ratelimit.v3.RateLimitService/ShouldRateLimit";
            let frame = |b: &[u8]| bytes::Bytes::copy_from_slice(b);
            let bad = [
                conns[0].raw(RLS, garbage).await?.0,
                conns[1].raw(RLS, encode(&no_domain)).await?.0,
                conns[2]
                    .raw(
                        "/envoy.service.ratelimit.v3.RateLimitService/Nope",
                        encode(&request("u")),
                    )
                    .await?
                    .0,
                conns[3]
                    .raw("/other.Service/Call", encode(&request("u")))
                    .await?
                    .0,
                conns[0].raw(RLS, frame(&[1, 0, 0, 0, 2, 0x0a, 0])).await?.0,
                conns[1]
                    .raw(RLS, frame(&[0, 0, 0, 0, 10, 0x0a, 0]))
                    .await?
                    .0,
                conns[2].raw(RLS, bytes::Bytes::new()).await?.0,
                conns[3].raw(RLS, two.into()).await?.0,
                conns[0].raw(RLS, huge.into()).await?.0,
            ];
            codes.push(conns[0].call(encode(&request("v"))).await?);
            opened.send((codes, bad))?;
            let _ = closing.recv();
            drop(conns);
            Ok::<_, anyhow::Error>(())
        })
    });
    let (codes, bad) = wait_open
        .recv_timeout(Duration::from_secs(10))
        .expect("the client did not finish its calls");
    assert_eq!(
        codes[..4],
        [Code::Ok, Code::Ok, Code::Ok, Code::OverLimit],
        "one bucket across the threads"
    );
    // INTERNAL for an undecodable message (as tonic answers it),
    // INVALID_ARGUMENT, UNIMPLEMENTED twice; UNIMPLEMENTED for compression,
    // INTERNAL for a short, a missing and a second message,
    // RESOURCE_EXHAUSTED over the cap.
    assert_eq!(
        bad,
        ["13", "3", "12", "12", "12", "13", "13", "13", "8"],
        "gRPC statuses of bad calls"
    );
    assert_eq!(codes[4], Code::Ok, "a connection serves on after bad calls");
    assert_eq!(
        connections(&lab),
        (2.0, 2.0),
        "four connections dealt out in turn over two threads"
    );
    close.send(()).unwrap();
    client.join().unwrap().unwrap();
    let mut now = connections(&lab);
    for _ in 0..50 {
        if now == (0.0, 0.0) {
            break;
        }
        std::thread::sleep(Duration::from_millis(100));
        now = connections(&lab);
    }
    assert_eq!(now, (0.0, 0.0), "closed connections are no longer counted");
    d.stop(libc::SIGTERM).unwrap();
}
