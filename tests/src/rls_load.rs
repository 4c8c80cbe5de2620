//! The benchmark's load: `ShouldRateLimit` calls written straight onto
//! HTTP/2 frames, many in flight per connection, answers read in bulk.
//!
//! On a 2-CPU machine the generator's CPU is taken from the daemon it
//! measures. With the `h2` client ([`crate::rls::Conn`]) the generator
//! spent more CPU per request than the daemon (47–51 µs paced, against
//! 32–34), mostly in h2's stream bookkeeping and a task per call. Here a
//! connection is a byte buffer out and a frame parser in:
//! - requests are HEADERS (a header block encoded once, literals without
//!   indexing, so the server's table is never needed) and DATA frames;
//! - answers are read to their END_STREAM; the DATA frame's message is
//!   decoded and its overall code checked. Header blocks are skipped: a call
//!   that failed (a trailers-only answer) carries no message and counts as
//!   failed.
//! - flow control: the connection and every stream get a 1 GiB receive
//!   window up front (topped up as answers arrive); the server's window for
//!   requests and its stream limit are kept to (calls wait locally).
//!
//! Requests are encoded by [`crate::rls::encode`]. The functional tests
//! keep using real clients (`h2`, tonic, Envoy, grpcio); this is only the
//! load.

use std::{collections::VecDeque, net::SocketAddr, time::Instant};

use anyhow::{bail, Context, Result};
use bytes::Bytes;
use envoy_types::pb::envoy::service::ratelimit::v3::{
    rate_limit_response::Code, RateLimitResponse,
};
use prost::Message;
use tokio::net::TcpStream;

const PATH: &[u8] = b"/envoy.service.ratelimit.v3.RateLimitService/ShouldRateLimit";
const PREFACE: &[u8] = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n";
const DATA: u8 = 0;
const HEADERS: u8 = 1;
const RST_STREAM: u8 = 3;
const SETTINGS: u8 = 4;
const PING: u8 = 6;
const GOAWAY: u8 = 7;
const WINDOW_UPDATE: u8 = 8;
const END_STREAM: u8 = 1;
const ACK: u8 = 1;
const END_HEADERS: u8 = 4;
const PADDED: u8 = 8;
/// Our receive windows (connection and each stream).
const WINDOW: u32 = 1 << 30;

/// A finished call: when its frames were handed to the socket, and its
/// overall code or why it failed.
pub struct Done {
    pub token: u64,
    pub sent: Instant,
    pub result: Result<Code, String>,
}

struct Call {
    token: u64,
    sent: Instant,
    message: Vec<u8>,
}

/// One HTTP/2 connection to the service (the socket is the caller's, so
/// that it can wait on it while this is borrowed elsewhere).
pub struct Load {
    headers: Vec<u8>,
    next_stream: u32,
    /// Streams in flight, by (id - 1) / 2 - `first`.
    calls: VecDeque<Option<Call>>,
    first: u32,
    in_flight: usize,
    /// The server's limit on streams in flight, and its window for our DATA.
    max_streams: usize,
    send_window: i64,
    /// Calls waiting for room: (token, gRPC message).
    waiting: VecDeque<(u64, Bytes)>,
    out: Vec<u8>,
    /// Answers read, `filled` bytes of it (zeroed once, reused).
    input: Vec<u8>,
    filled: usize,
    /// Answer bytes received since the connection window was last topped up.
    unacked: u64,
}

fn frame(out: &mut Vec<u8>, kind: u8, flags: u8, stream: u32, payload: &[u8]) {
    let n = payload.len() as u32;
    out.extend_from_slice(&[(n >> 16) as u8, (n >> 8) as u8, n as u8, kind, flags]);
    out.extend_from_slice(&stream.to_be_bytes());
    out.extend_from_slice(payload);
}

/// An HPACK string literal, not Huffman-coded (lengths < 127 here).
fn literal(block: &mut Vec<u8>, s: &[u8]) {
    assert!(s.len() < 127);
    block.push(s.len() as u8);
    block.extend_from_slice(s);
}

impl Load {
    /// Connects (the socket, no Nagle delay) and starts HTTP/2 on it.
    pub async fn connect(addr: SocketAddr) -> Result<(TcpStream, Load)> {
        let tcp = TcpStream::connect(addr)
            .await
            .with_context(|| format!("connecting to {addr}"))?;
        tcp.set_nodelay(true)?;
        // :method POST, :scheme http (static table), then literals without
        // indexing: :path, :authority, content-type, te.
        let mut headers = vec![0x83, 0x86, 0x04];
        literal(&mut headers, PATH);
        headers.push(0x01);
        literal(&mut headers, addr.to_string().as_bytes());
        headers.extend_from_slice(&[0x0f, 0x10]);
        literal(&mut headers, b"application/grpc");
        headers.push(0x00);
        literal(&mut headers, b"te");
        literal(&mut headers, b"trailers");
        let mut load = Load {
            headers,
            next_stream: 1,
            calls: VecDeque::new(),
            first: 0,
            in_flight: 0,
            max_streams: 100,
            send_window: 65_535,
            waiting: VecDeque::new(),
            out: PREFACE.to_vec(),
            input: vec![0; 256 << 10],
            filled: 0,
            unacked: 0,
        };
        // SETTINGS: no push (2), our stream window (4).
        let mut settings = Vec::new();
        settings.extend_from_slice(&[0, 2, 0, 0, 0, 0]);
        settings.extend_from_slice(&[0, 4]);
        settings.extend_from_slice(&WINDOW.to_be_bytes());
        frame(&mut load.out, SETTINGS, 0, 0, &settings);
        frame(
            &mut load.out,
            WINDOW_UPDATE,
            0,
            0,
            &(WINDOW - 65_535).to_be_bytes(),
        );
        load.flush(&tcp).await?;
        Ok((tcp, load))
    }

    /// Calls in flight or waiting.
    pub fn pending(&self) -> usize {
        self.in_flight + self.waiting.len()
    }

    /// Queues a call ([`crate::rls::encode`]d); `token` comes back with
    /// its answer. Written out by the next [`Load::flush`].
    pub fn call(&mut self, token: u64, message: Bytes) {
        self.waiting.push_back((token, message));
        self.start_waiting();
    }

    fn start_waiting(&mut self) {
        while self.in_flight < self.max_streams {
            let Some((_, m)) = self.waiting.front() else {
                break;
            };
            if (m.len() as i64) > self.send_window {
                break;
            }
            let (token, m) = self.waiting.pop_front().expect("just seen");
            let id = self.next_stream;
            self.next_stream += 2;
            frame(&mut self.out, HEADERS, END_HEADERS, id, &self.headers);
            frame(&mut self.out, DATA, END_STREAM, id, &m);
            self.send_window -= m.len() as i64;
            self.calls.push_back(Some(Call {
                token,
                sent: Instant::now(),
                message: Vec::new(),
            }));
            self.in_flight += 1;
        }
    }

    /// Writes everything queued.
    pub async fn flush(&mut self, tcp: &TcpStream) -> Result<()> {
        let mut at = 0;
        while at < self.out.len() {
            match tcp.try_write(&self.out[at..]) {
                Ok(n) => at += n,
                Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => tcp.writable().await?,
                Err(e) => return Err(e).context("writing calls"),
            }
        }
        self.out.clear();
        Ok(())
    }

    /// Reads what has arrived (after `tcp.readable()`), appending finished
    /// calls to `done`; false when the server closed the connection.
    pub fn read(&mut self, tcp: &TcpStream, done: &mut Vec<Done>) -> Result<bool> {
        let mut open = true;
        loop {
            if self.filled == self.input.len() {
                // A frame larger than what is held: room for it.
                self.input.resize(2 * self.input.len(), 0);
            }
            match crate::read_available(tcp, &mut self.input[self.filled..])
                .context("reading answers")?
            {
                Some(0) => {
                    open = false;
                    break;
                }
                Some(n) => self.filled += n,
                None => break,
            }
        }
        // Taken out while its frames are handled (no copy of each).
        let mut input = std::mem::take(&mut self.input);
        let mut at = 0;
        while self.filled - at >= 9 {
            let h = &input[at..at + 9];
            let n = (h[0] as usize) << 16 | (h[1] as usize) << 8 | h[2] as usize;
            if self.filled - at - 9 < n {
                break;
            }
            let (kind, flags) = (h[3], h[4]);
            let stream = u32::from_be_bytes([h[5], h[6], h[7], h[8]]) & 0x7fff_ffff;
            let handled = self.frame_in(kind, flags, stream, &input[at + 9..at + 9 + n], done);
            at += 9 + n;
            if let Err(e) = handled {
                self.input = input;
                return Err(e);
            }
        }
        // The start of a frame not yet whole moves to the front.
        input.copy_within(at..self.filled, 0);
        self.filled -= at;
        self.input = input;
        if self.unacked > (WINDOW / 2) as u64 {
            frame(
                &mut self.out,
                WINDOW_UPDATE,
                0,
                0,
                &(self.unacked as u32).to_be_bytes(),
            );
            self.unacked = 0;
        }
        self.start_waiting();
        Ok(open)
    }

    fn frame_in(
        &mut self,
        kind: u8,
        flags: u8,
        stream: u32,
        payload: &[u8],
        done: &mut Vec<Done>,
    ) -> Result<()> {
        match kind {
            DATA => {
                self.unacked += payload.len() as u64;
                let body = match payload.split_first() {
                    Some((&pad, rest)) if flags & PADDED != 0 => {
                        &rest[..rest.len().saturating_sub(pad as usize)]
                    }
                    _ => payload,
                };
                if let Some(c) = self.slot(stream) {
                    c.message.extend_from_slice(body);
                }
                if flags & END_STREAM != 0 {
                    self.finish(stream, done, None);
                }
            }
            HEADERS if flags & END_STREAM != 0 => self.finish(stream, done, None),
            RST_STREAM => self.finish(stream, done, Some(format!("stream reset ({payload:?})"))),
            SETTINGS if flags & ACK == 0 => {
                for s in payload.chunks_exact(6) {
                    let v = u32::from_be_bytes([s[2], s[3], s[4], s[5]]);
                    if u16::from_be_bytes([s[0], s[1]]) == 3 {
                        self.max_streams = v as usize;
                    }
                }
                frame(&mut self.out, SETTINGS, ACK, 0, &[]);
            }
            PING if flags & ACK == 0 => frame(&mut self.out, PING, ACK, 0, payload),
            GOAWAY => bail!(
                "the server sent GOAWAY: {:?}",
                String::from_utf8_lossy(payload.get(8..).unwrap_or_default())
            ),
            WINDOW_UPDATE if stream == 0 && payload.len() == 4 => {
                self.send_window +=
                    (u32::from_be_bytes([payload[0], payload[1], payload[2], payload[3]])
                        & 0x7fff_ffff) as i64;
            }
            // Response headers, CONTINUATION, PRIORITY, stream windows:
            // nothing to do (requests are far smaller than a stream window).
            _ => {}
        }
        Ok(())
    }

    fn slot(&mut self, stream: u32) -> Option<&mut Call> {
        let i = ((stream.checked_sub(1)? / 2).checked_sub(self.first)?) as usize;
        self.calls.get_mut(i)?.as_mut()
    }

    fn finish(&mut self, stream: u32, done: &mut Vec<Done>, failed: Option<String>) {
        let Some(i) = (stream.wrapping_sub(1) / 2).checked_sub(self.first) else {
            return;
        };
        let Some(call) = self.calls.get_mut(i as usize).and_then(Option::take) else {
            return;
        };
        self.in_flight -= 1;
        let result = match failed {
            Some(e) => Err(e),
            None => answer(&call.message),
        };
        done.push(Done {
            token: call.token,
            sent: call.sent,
            result,
        });
        while let Some(None) = self.calls.front() {
            self.calls.pop_front();
            self.first += 1;
        }
    }
}

/// The overall code in an answer's message.
fn answer(m: &[u8]) -> Result<Code, String> {
    if m.len() < 5 {
        return Err("an answer without a message (a failed call)".into());
    }
    let r =
        RateLimitResponse::decode(&m[5..]).map_err(|e| format!("an undecodable answer: {e}"))?;
    Code::try_from(r.overall_code)
        .ok()
        .filter(|c| *c != Code::Unknown)
        .ok_or_else(|| "an answer without a code".into())
}
