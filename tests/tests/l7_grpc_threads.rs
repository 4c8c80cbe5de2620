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
            // gRPC's health service, as Envoy's gRPC health checks ask it.
            const HEALTH: &str = "/grpc.health.v1.Health/Check";
            let health = [
                conns[1].raw(HEALTH, frame(&[0, 0, 0, 0, 0])).await?,
                conns[2]
                    .raw(
                        HEALTH,
                        frame(b"\0\0\0\0\x2d\x0a\x2benvoy.service.ratelimit.v3.RateLimitService"),
                    )
                    .await?,
                conns[3]
                    .raw(HEALTH, frame(&[0, 0, 0, 0, 3, 0x0a, 1, b'x']))
                    .await?,
            ];
            let health: Vec<(String, Vec<u8>)> =
                health.into_iter().map(|(c, d)| (c, d.to_vec())).collect();
            opened.send((codes, bad, health))?;
            let _ = closing.recv();
            drop(conns);
            Ok::<_, anyhow::Error>(())
        })
    });
    let (codes, bad, health) = wait_open
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
    // Envoy lets a refused call's request through: each is counted by code.
    let m = parse_prometheus(&get(&lab.b, "/metrics").body);
    let serving = vec![0u8, 0, 0, 0, 2, 0x08, 0x01];
    assert_eq!(
        health,
        [
            ("0".to_string(), serving.clone()),
            ("0".to_string(), serving),
            ("5".to_string(), vec![])
        ],
        "health: SERVING for the server and the rate-limit service, NOT_FOUND else"
    );
    // Calls of the rate-limit method only (not the unknown methods, nor the
    // health checks): a refused one is a request Envoy let through.
    for (code, n) in [("13", 4.0), ("3", 1.0), ("12", 1.0), ("8", 1.0), ("4", 0.0)] {
        let name = format!("rl_l7_refused_total{{api=\"grpc\",code=\"{code}\"}}");
        assert_eq!(m.get(&name).copied(), Some(n), "{name}");
    }
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

/// What one connection and its clients may hold: requests trickling in
/// hold at most two messages' worth of the connection's flow control
/// (capacity comes back once a message is whole), a call whose message
/// does not arrive within 10 s gets DEADLINE_EXCEEDED, a connection that
/// never completes its HTTP/2 handshake is closed after 10 s, and past
/// `[l7] max_connections` a new connection is closed at once and counted.
#[test]
fn a_listener_bounds_its_connections_and_what_they_hold() {
    let Served { lab, d, dir: _dir, .. } = served(&format!(
        "[default]\nrate = 1000\n[l7]\ngrpc_listen = \"{GRPC}\"\ngrpc_threads = 1\nmax_connections = 3\n\
         [[l7.rule]]\nname = \"per-user\"\ndomain = \"edge\"\ndescriptor = [{{ key = \"user\" }}]\nrate = 3\nper = \"1h\"\n"
    ))
    .unwrap();
    let gauge = |lab: &Lab, name: &str| {
        parse_prometheus(&get(&lab.b, "/metrics").body)
            .get(&format!("{name}{{api=\"grpc\"}}"))
            .copied()
    };
    let (report, reported) = mpsc::channel();
    let client = lab.b.spawn(move || {
        let rt = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()?;
        rt.block_on(async move {
            use tokio::io::AsyncReadExt;
            let addr: std::net::SocketAddr = GRPC.parse()?;
            // One HTTP/2 connection: three calls each sending 1 MiB of a
            // message, never finished.
            let tcp = tokio::net::TcpStream::connect(addr).await?;
            let (send, conn) = h2::client::handshake(tcp).await?;
            tokio::spawn(async move {
                let _ = conn.await;
            });
            let mut calls = Vec::new();
            for _ in 0..3 {
                let req = http::Request::post(format!(
                    "http://{GRPC}/envoy.service.ratelimit.v3.RateLimitService/ShouldRateLimit"
                ))
                .header("content-type", "application/grpc")
                .body(())?;
                let (resp, stream) = send.clone().ready().await?.send_request(req, false)?;
                calls.push((resp, stream));
            }
            let mut granted = 0usize;
            let until = tokio::time::Instant::now() + Duration::from_secs(2);
            for (_, stream) in calls.iter_mut() {
                let mut mine = 0usize;
                stream.reserve_capacity(1 << 20);
                while mine < 1 << 20 {
                    let cap = match tokio::time::timeout_at(
                        until,
                        std::future::poll_fn(|cx| stream.poll_capacity(cx)),
                    )
                    .await
                    {
                        Ok(Some(Ok(n))) => n,
                        _ => break,
                    };
                    let n = cap.min((1 << 20) - mine);
                    if n > 0 {
                        stream.send_data(bytes::Bytes::from(vec![0u8; n]), false)?;
                        mine += n;
                    }
                }
                granted += mine;
            }
            // Two connections that never say a word, and one past the limit.
            let mut silent = [
                tokio::net::TcpStream::connect(addr).await?,
                tokio::net::TcpStream::connect(addr).await?,
            ];
            tokio::time::sleep(Duration::from_millis(300)).await;
            let mut past = tokio::net::TcpStream::connect(addr).await?;
            let mut buf = [0u8; 64];
            let past_closed = matches!(
                tokio::time::timeout(Duration::from_secs(2), past.read(&mut buf)).await,
                Ok(Ok(0)) | Ok(Err(_))
            );
            report.send(("held", granted, past_closed))?;
            // The calls' messages never arrive: each is answered with its
            // deadline; the silent connections are closed.
            let mut statuses = Vec::new();
            for (resp, _stream) in calls {
                let r = tokio::time::timeout(Duration::from_secs(15), resp).await??;
                statuses.push(
                    r.headers()
                        .get("grpc-status")
                        .map(|s| String::from_utf8_lossy(s.as_bytes()).into_owned()),
                );
            }
            // (The daemon's HTTP/2 settings arrive first: read to the end.)
            let mut closed = 0;
            for s in silent.iter_mut() {
                let eof = async {
                    loop {
                        match s.read(&mut buf).await {
                            Ok(0) | Err(_) => return,
                            Ok(_) => {}
                        }
                    }
                };
                if tokio::time::timeout(Duration::from_secs(15), eof)
                    .await
                    .is_ok()
                {
                    closed += 1;
                }
            }
            Ok::<_, anyhow::Error>((statuses, closed))
        })
    });
    let (_, granted, past_closed) = reported
        .recv_timeout(Duration::from_secs(20))
        .expect("the client stalled");
    eprintln!("three unfinished 1 MiB messages on one connection: {granted} bytes sent");
    assert!(
        granted <= 2 * ((1 << 20) + (64 << 10)),
        "{granted} bytes of unfinished messages held by one connection"
    );
    assert!(
        granted >= 2 << 20,
        "two whole messages' worth must fit: {granted}"
    );
    assert!(
        past_closed,
        "a connection past max_connections = 3 was served"
    );
    assert_eq!(gauge(&lab, "rl_l7_connections"), Some(3.0));
    assert_eq!(gauge(&lab, "rl_l7_max_connections"), Some(3.0));
    assert!(gauge(&lab, "rl_l7_connections_refused_total") >= Some(1.0));
    assert!(d.log().contains("max_connections"), "{}", d.log());
    let (statuses, closed) = client.join().unwrap().unwrap();
    assert_eq!(
        statuses,
        vec![Some("4".to_string()); 3],
        "DEADLINE_EXCEEDED for messages that never arrive"
    );
    assert_eq!(closed, 2, "connections without a handshake are closed");
    // Room again: a call is answered.
    let code = lab
        .b
        .run(|| {
            let rt = tokio::runtime::Builder::new_current_thread()
                .enable_all()
                .build()?;
            rt.block_on(async {
                Conn::connect(GRPC.parse()?)
                    .await?
                    .call(encode(&request("w")))
                    .await
            })
        })
        .unwrap();
    assert_eq!(code, Code::Ok);
    d.stop(libc::SIGTERM).unwrap();
}
