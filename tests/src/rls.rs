//! A client of Envoy's rate-limit service over `h2` (one HTTP/2 stream per
//! call, any method, any body, the gRPC status read from the trailers),
//! for tests that need calls tonic's client would not make; and the
//! generator's threads and timer. The benchmark's load itself is
//! [`crate::rls_load`], leaner still.

use std::{net::SocketAddr, time::Duration};

use anyhow::{bail, Context, Result};
use bytes::{BufMut, Bytes, BytesMut};
use envoy_types::pb::envoy::service::ratelimit::v3::{
    rate_limit_response::Code, RateLimitRequest, RateLimitResponse,
};
use prost::Message;

const PATH: &str = "/envoy.service.ratelimit.v3.RateLimitService/ShouldRateLimit";

/// A request as a gRPC message on the wire (length-prefixed protobuf).
pub fn encode(req: &RateLimitRequest) -> Bytes {
    let mut b = BytesMut::with_capacity(5 + req.encoded_len());
    b.put_u8(0);
    b.put_u32(req.encoded_len() as u32);
    req.encode(&mut b).expect("a BytesMut grows");
    b.freeze()
}

/// One HTTP/2 connection to the service.
#[derive(Clone)]
pub struct Conn {
    send: h2::client::SendRequest<Bytes>,
    uri: http::Uri,
}

impl Conn {
    /// Connects and drives the connection on the current runtime.
    pub async fn connect(addr: SocketAddr) -> Result<Self> {
        let tcp = tokio::net::TcpStream::connect(addr)
            .await
            .with_context(|| format!("connecting to {addr}"))?;
        tcp.set_nodelay(true)?;
        // h2 closes a connection that holds more than ~130 small DATA
        // frames unread (its guard against a hostile server); a generator
        // thread that runs late holds many answers at once, so a larger
        // budget.
        let (send, conn) = h2::client::Builder::new()
            .data_frame_budget(16 << 20)
            .handshake(tcp)
            .await
            .context("the HTTP/2 handshake")?;
        tokio::spawn(async move {
            let _ = conn.await;
        });
        Ok(Conn {
            send,
            uri: format!("http://{addr}{PATH}").parse()?,
        })
    }

    /// `ShouldRateLimit` with an [`encode`]d request: the overall code.
    pub async fn call(&self, body: Bytes) -> Result<Code> {
        let (status, data) = self.raw(PATH, body).await?;
        if status != "0" {
            bail!("grpc-status {status}");
        }
        if data.len() < 5 {
            bail!("an answer of {} bytes", data.len());
        }
        let r = RateLimitResponse::decode(&data[5..])?;
        Code::try_from(r.overall_code)
            .ok()
            .filter(|c| *c != Code::Unknown)
            .context("an answer without a code")
    }

    /// A gRPC call of any method with any body: its grpc-status (from the
    /// trailers, or from the headers of a trailers-only answer) and the
    /// response body.
    pub async fn raw(&self, path: &str, body: Bytes) -> Result<(String, BytesMut)> {
        let mut send = self.send.clone().ready().await?;
        let uri = if path == PATH {
            self.uri.clone()
        } else {
            format!(
                "http://{}{path}",
                self.uri.authority().context("an authority")?
            )
            .parse()?
        };
        let req = http::Request::post(uri)
            .header("content-type", "application/grpc")
            .header("te", "trailers")
            .body(())?;
        let (resp, mut stream) = send.send_request(req, false)?;
        stream.send_data(body, true)?;
        let resp = resp.await?;
        if resp.status() != http::StatusCode::OK {
            bail!("HTTP status {}", resp.status());
        }
        let status = |h: &http::HeaderMap| {
            h.get("grpc-status")
                .map(|s| String::from_utf8_lossy(s.as_bytes()).into_owned())
        };
        if let Some(s) = status(resp.headers()) {
            return Ok((s, BytesMut::new()));
        }
        let mut body = resp.into_body();
        let mut data = BytesMut::new();
        while let Some(chunk) = body.data().await {
            let chunk = chunk?;
            let _ = body.flow_control().release_capacity(chunk.len());
            data.extend_from_slice(&chunk);
        }
        let trailers = body
            .trailers()
            .await?
            .context("an answer without trailers")?;
        Ok((
            status(&trailers).context("trailers without grpc-status")?,
            data,
        ))
    }
}

/// Runs `job(thread, of)` on `threads` threads in the lab namespace `ns`,
/// each on a current-thread runtime of its own; the results in order.
pub fn on_threads<T, F>(
    ns: &crate::lab::Netns,
    threads: usize,
    job: impl Fn(usize, usize) -> F + Send + Sync + 'static,
) -> Result<Vec<T>>
where
    T: Send + 'static,
    F: std::future::Future<Output = Result<T>>,
{
    let job = std::sync::Arc::new(job);
    let handles: Vec<_> = (0..threads)
        .map(|t| {
            let job = job.clone();
            ns.spawn(move || {
                tokio::runtime::Builder::new_current_thread()
                    .enable_all()
                    .build()?
                    .block_on(job(t, threads))
            })
        })
        .collect();
    handles
        .into_iter()
        .map(|h| {
            h.join()
                .map_err(|_| anyhow::anyhow!("a load thread panicked"))?
        })
        .collect()
}

/// A periodic kernel timer (timerfd) on the current runtime: wakes every
/// `every` with nanosecond precision, where tokio's own timer rounds to
/// whole milliseconds.
pub struct Ticker {
    fd: tokio::io::unix::AsyncFd<std::os::fd::OwnedFd>,
}

impl Ticker {
    pub fn new(every: Duration) -> Result<Self> {
        use std::os::fd::FromRawFd;
        let fd = unsafe {
            libc::timerfd_create(
                libc::CLOCK_MONOTONIC,
                libc::TFD_NONBLOCK | libc::TFD_CLOEXEC,
            )
        };
        if fd < 0 {
            return Err(std::io::Error::last_os_error()).context("timerfd_create");
        }
        let fd = unsafe { std::os::fd::OwnedFd::from_raw_fd(fd) };
        let ts = libc::timespec {
            tv_sec: every.as_secs() as i64,
            tv_nsec: every.subsec_nanos() as i64,
        };
        let spec = libc::itimerspec {
            it_interval: ts,
            it_value: ts,
        };
        use std::os::fd::AsRawFd;
        if unsafe { libc::timerfd_settime(fd.as_raw_fd(), 0, &spec, std::ptr::null_mut()) } != 0 {
            return Err(std::io::Error::last_os_error()).context("timerfd_settime");
        }
        // SAFETY: the OwnedFd moves into the AsyncFd and stays open with it.
        let fd = unsafe {
            tokio::io::unix::AsyncFd::register_with_interest(fd, tokio::io::Interest::READABLE)
        }
        .map_err(|e| anyhow::anyhow!("registering the timer: {e}"))?;
        Ok(Ticker { fd })
    }

    /// Waits for the next tick; how many periods have passed since the last
    /// call (more than 1 when this thread was late).
    pub async fn tick(&self) -> Result<u64> {
        use std::os::fd::AsRawFd;
        loop {
            let mut guard = self.fd.readable().await?;
            let mut n = 0u64;
            let r = unsafe { libc::read(self.fd.get_ref().as_raw_fd(), (&raw mut n).cast(), 8) };
            // A read takes every expiry so far: the next comes as a new
            // event, so the readiness is cleared either way (no read that
            // would only say EAGAIN before waiting).
            guard.clear_ready();
            if r == 8 {
                return Ok(n);
            }
        }
    }
}
