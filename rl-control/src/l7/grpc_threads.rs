//! Envoy's rate-limit service on the l7 serving threads
//! ([`super::threads`]): each connection stays on the thread it was dealt
//! to, so a call never leaves it, and answers to calls that arrive together
//! go out in one write. Envoy holds one connection per worker, so a busy
//! Envoy spreads over the threads. `rl_l7_grpc_connections{thread}` shows
//! the spread.
//!
//! Each connection is served by `h2` directly, its calls polled inside the
//! connection's own task (see [`connection`]).

use std::{
    sync::{
        atomic::{AtomicU64, AtomicUsize, Ordering::Relaxed},
        Arc,
    },
    task::Poll,
    time::Instant,
};

use bytes::{BufMut, Bytes, BytesMut};
use envoy_types::pb::envoy::service::ratelimit::v3::RateLimitRequest;
use futures_util::{stream::FuturesUnordered, StreamExt};
use h2::{server::SendResponse, RecvStream};
use http::{header::CONTENT_TYPE, HeaderMap, HeaderValue, Response};
use prost::Message;
use tokio::net::{TcpListener, TcpStream};
use tracing::debug;

use super::{
    grpc::{self, Failure},
    rules::MAX_GRPC_THREADS,
    threads::Threads,
};

/// The one method served.
pub const PATH: &str = "/envoy.service.ratelimit.v3.RateLimitService/ShouldRateLimit";
/// The largest request message accepted (RESOURCE_EXHAUSTED beyond). The
/// largest valid request (16 descriptors of 16 entries of 256-byte keys
/// and values) is about 130 KiB.
pub const MAX_MESSAGE: usize = 1 << 20;
/// Calls in flight per connection (HTTP/2 streams), as hyper's default.
const MAX_STREAMS: u32 = 200;
/// A stream's flow-control window: the largest message, its framing, and
/// room for frame padding. Capacity is given back only once a message is
/// whole, so a connection's unfinished requests hold at most
/// [`CONNECTION_WINDOW`] bytes, however many streams it opens.
const STREAM_WINDOW: u32 = (MAX_MESSAGE + (64 << 10)) as u32;
/// The bytes of unfinished requests one connection may hold.
const CONNECTION_WINDOW: u32 = 2 * STREAM_WINDOW;
/// How long a new connection has to complete HTTP/2's handshake and open
/// its first call (Envoy connects when it has one to make): past it, it is
/// closed.
const HANDSHAKE: std::time::Duration = std::time::Duration::from_secs(10);
/// How long a call has to send its whole message (DEADLINE_EXCEEDED past
/// it): a stream trickling its message holds a slot and its bytes.
const CALL_READ: std::time::Duration = std::time::Duration::from_secs(10);
/// A connection with no call in flight for this long is closed (GOAWAY);
/// Envoy opens another when it next needs one.
const IDLE: std::time::Duration = std::time::Duration::from_secs(300);

/// Open connections per serving thread.
pub static CONNECTIONS: [AtomicU64; MAX_GRPC_THREADS] =
    [const { AtomicU64::new(0) }; MAX_GRPC_THREADS];
/// Serving threads started (0 without `[l7] grpc_listen`).
pub static THREADS: AtomicUsize = AtomicUsize::new(0);

/// Serves Envoy's rate-limit service on `threads`, with a service from
/// `make` per thread.
pub fn serve(
    listener: TcpListener,
    threads: &Threads,
    max_connections: u32,
    make: impl Fn() -> grpc::Service,
) {
    let services: Vec<Arc<grpc::Service>> =
        (0..threads.count()).map(|_| Arc::new(make())).collect();
    THREADS.store(threads.count(), Relaxed);
    let limits = super::threads::Limits::new("grpc", max_connections);
    threads.serve(listener, "gRPC", limits, move |s, i| {
        connection(s, i, services[i].clone())
    });
}

/// Serves one connection on this thread until it closes, counted in
/// [`CONNECTIONS`] meanwhile.
async fn connection(s: TcpStream, thread: usize, svc: Arc<grpc::Service>) {
    CONNECTIONS[thread].fetch_add(1, Relaxed);
    let served = calls(s, &svc).await;
    CONNECTIONS[thread].fetch_sub(1, Relaxed);
    if let Err(e) = served {
        debug!("a gRPC connection on thread {thread} ended: {e}");
    }
}

/// The connection's HTTP/2 and its calls, all polled by this one task: a
/// call that can be answered at once (every local rule) is answered in the
/// same wake-up that read it, with no task spawned and no hand-over. (hyper
/// spawned a task per call and woke the connection's task to send each
/// answer; with tonic's body codec and hyper's date header that was about
/// a sixth of the daemon's CPU per call at saturation.)
///
/// Every call that has arrived is taken before any is answered, so the
/// next poll of the connection writes all their answers in one go (h2
/// writes what is queued each time it is polled: taking and answering calls
/// one by one cost a write each).
async fn calls(s: TcpStream, svc: &grpc::Service) -> Result<(), String> {
    let handshake = h2::server::Builder::new()
        .initial_window_size(STREAM_WINDOW)
        .initial_connection_window_size(CONNECTION_WINDOW)
        .max_concurrent_streams(MAX_STREAMS)
        .max_header_list_size(16 << 10)
        .handshake::<_, Bytes>(s);
    let mut conn = match tokio::time::timeout(HANDSHAKE, handshake).await {
        Ok(c) => c.map_err(|e| e.to_string())?,
        Err(_) => return Err(format!("no HTTP/2 handshake within {HANDSHAKE:?}")),
    };
    let mut under_way = FuturesUnordered::new();
    // h2's handshake completes before the client's preface is read: until
    // a first call, the connection has HANDSHAKE, then IDLE at a time.
    let mut idle = Box::pin(tokio::time::sleep(HANDSHAKE));
    let (mut called, mut closing) = (false, false);
    std::future::poll_fn(|cx| loop {
        let mut active = false;
        loop {
            match conn.poll_accept(cx) {
                Poll::Ready(Some(Ok((req, respond)))) => {
                    under_way.push(call(svc, req, respond));
                    (active, called) = (true, true);
                }
                Poll::Ready(Some(Err(e))) => return Poll::Ready(Err(e.to_string())),
                // Closed, every stream done.
                Poll::Ready(None) => return Poll::Ready(Ok(())),
                Poll::Pending => break,
            }
        }
        let mut answered = false;
        while let Poll::Ready(Some(())) = under_way.poll_next_unpin(cx) {
            answered = true;
        }
        if active || answered {
            idle.as_mut().reset(tokio::time::Instant::now() + IDLE);
        }
        if !answered {
            if under_way.is_empty() && std::future::Future::poll(idle.as_mut(), cx).is_ready() {
                if !called {
                    return Poll::Ready(Err(format!("no call within {HANDSHAKE:?} of connecting")));
                }
                if closing {
                    // A peer that never closes after GOAWAY keeps no slot.
                    return Poll::Ready(Err(format!("not closed within {HANDSHAKE:?} of GOAWAY")));
                }
                // Idle: GOAWAY, then the connection closes once the peer
                // has seen it (polled on), or HANDSHAKE later.
                closing = true;
                conn.graceful_shutdown();
                idle.as_mut().reset(tokio::time::Instant::now() + HANDSHAKE);
                continue;
            }
            return Poll::Pending;
        }
    })
    .await
}

/// One unary call: reads its message, answers it, sends the answer (or a
/// trailers-only failure).
async fn call(svc: &grpc::Service, req: http::Request<RecvStream>, respond: SendResponse<Bytes>) {
    if req.uri().path() == HEALTH_CHECK {
        return send(respond, health(message_in_time(req.into_body()).await));
    }
    let rls = req.uri().path() == PATH;
    let outcome = if !rls {
        Err(Failure::new(
            Failure::UNIMPLEMENTED,
            format!(
                "unknown method {}: this service has {PATH} only",
                req.uri().path()
            ),
        ))
    } else {
        match message_in_time(req.into_body()).await {
            Ok(m) => {
                let t = Instant::now();
                let answer = match RateLimitRequest::decode(m) {
                    Ok(r) => svc.answer(r).await.map(|a| framed(&a)),
                    Err(e) => Err(Failure::new(
                        Failure::INTERNAL,
                        format!("failed to decode the request: {e}"),
                    )),
                };
                super::GRPC_LATENCY.record(t.elapsed());
                answer
            }
            Err(f) => Err(f),
        }
    };
    if let (true, Err(f)) = (rls, &outcome) {
        super::refused("grpc", f.code, &f.message);
    }
    send(respond, outcome);
}

/// gRPC's health service (`grpc.health.v1.Health/Check`), as Envoy's gRPC
/// health checks and Kubernetes probes ask it: SERVING for the whole
/// server (`""`) and for the rate-limit service, NOT_FOUND for any other.
pub const HEALTH_CHECK: &str = "/grpc.health.v1.Health/Check";

fn health(request: Result<Bytes, Failure>) -> Result<Bytes, Failure> {
    let m = request?;
    // HealthCheckRequest { string service = 1; } (names under 128 bytes).
    let service = match &m[..] {
        [] => "",
        [0x0a, len, rest @ ..] if (*len as usize) == rest.len() => {
            std::str::from_utf8(rest).unwrap_or("?")
        }
        _ => "?",
    };
    if !service.is_empty() && service != "envoy.service.ratelimit.v3.RateLimitService" {
        return Err(Failure::new(5, format!("no service {service:?} here")));
    }
    // HealthCheckResponse { status: SERVING (1) }.
    Ok(Bytes::from_static(&[0, 0, 0, 0, 2, 0x08, 0x01]))
}

/// [`message`], or DEADLINE_EXCEEDED when it does not arrive within
/// [`CALL_READ`].
async fn message_in_time(body: RecvStream) -> Result<Bytes, Failure> {
    tokio::time::timeout(CALL_READ, message(body))
        .await
        .unwrap_or_else(|_| {
            Err(Failure::new(
                Failure::DEADLINE_EXCEEDED,
                format!("the request message did not arrive within {CALL_READ:?}"),
            ))
        })
}

/// The request's one gRPC message (length-prefixed, uncompressed), read to
/// the end of the stream.
async fn message(mut body: RecvStream) -> Result<Bytes, Failure> {
    // Usually the whole message comes in one frame, kept as it is; only a
    // message split over frames is copied together.
    let (mut first, mut joined) = (Bytes::new(), BytesMut::new());
    // Flow-control capacity is given back once the message is whole (or
    // refused), not chunk by chunk: see [`STREAM_WINDOW`].
    let mut held = Held {
        body: &mut body,
        bytes: 0,
    };
    while let Some(chunk) = held.body.data().await {
        let chunk = chunk
            .map_err(|e| Failure::new(Failure::INTERNAL, format!("reading the request: {e}")))?;
        held.bytes += chunk.len();
        if first.len() + joined.len() + chunk.len() > 5 + MAX_MESSAGE {
            return Err(Failure::new(
                Failure::RESOURCE_EXHAUSTED,
                format!("a request message may be at most {MAX_MESSAGE} bytes"),
            ));
        }
        if first.is_empty() && joined.is_empty() {
            first = chunk;
        } else {
            joined.extend_from_slice(&std::mem::take(&mut first));
            joined.extend_from_slice(&chunk);
        }
    }
    drop(held);
    let buf = if joined.is_empty() {
        first
    } else {
        joined.freeze()
    };
    if buf.len() < 5 {
        return Err(Failure::new(Failure::INTERNAL, "missing request message"));
    }
    if buf[0] != 0 {
        return Err(Failure::new(
            Failure::UNIMPLEMENTED,
            "compressed messages are not supported: send them uncompressed",
        ));
    }
    let len = u32::from_be_bytes([buf[1], buf[2], buf[3], buf[4]]) as usize;
    if len != buf.len() - 5 {
        return Err(Failure::new(
            Failure::INTERNAL,
            format!(
                "a unary call carries one message: {len} bytes announced, {} sent",
                buf.len() - 5
            ),
        ));
    }
    Ok(buf.slice(5..))
}

/// A request's bytes read and not yet given back to the connection's
/// flow control: given back when dropped (message whole, refused, or the
/// call timed out).
struct Held<'a> {
    body: &'a mut RecvStream,
    bytes: usize,
}

impl Drop for Held<'_> {
    fn drop(&mut self) {
        let _ = self.body.flow_control().release_capacity(self.bytes);
    }
}

/// An answer as a gRPC message on the wire.
fn framed(m: &impl Message) -> Bytes {
    let len = m.encoded_len();
    let mut b = BytesMut::with_capacity(5 + len);
    b.put_u8(0);
    b.put_u32(len as u32);
    m.encode(&mut b).expect("the buffer has room");
    b.freeze()
}

/// Sends an answer: headers, the message, `grpc-status: 0` trailers; or a
/// failure as trailers-only (status and message in the headers).
fn send(mut respond: SendResponse<Bytes>, outcome: Result<Bytes, Failure>) {
    let mut head = Response::new(());
    head.headers_mut()
        .insert(CONTENT_TYPE, HeaderValue::from_static("application/grpc"));
    match outcome {
        Ok(message) => {
            let Ok(mut stream) = respond.send_response(head, false) else {
                return;
            };
            if stream.send_data(message, false).is_ok() {
                let mut trailers = HeaderMap::with_capacity(1);
                trailers.insert("grpc-status", HeaderValue::from_static("0"));
                let _ = stream.send_trailers(trailers);
            }
        }
        Err(f) => {
            let h = head.headers_mut();
            h.insert("grpc-status", HeaderValue::from(f.code as u16));
            if let Ok(m) = HeaderValue::from_str(&percent_encoded(&f.message)) {
                h.insert("grpc-message", m);
            }
            let _ = respond.send_response(head, true);
        }
    }
}

/// gRPC's `grpc-message` encoding: bytes outside printable ASCII, and `%`,
/// as `%XX`.
fn percent_encoded(m: &str) -> String {
    let mut out = String::with_capacity(m.len());
    for b in m.bytes() {
        if (0x20..0x7f).contains(&b) && b != b'%' {
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

    #[test]
    fn grpc_messages_are_percent_encoded() {
        assert_eq!(percent_encoded("a 100% ok"), "a 100%25 ok");
        assert_eq!(percent_encoded("é\n"), "%C3%A9%0A");
    }
}
