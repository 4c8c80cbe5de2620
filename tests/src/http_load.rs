//! The benchmark's load for the HTTP check: `POST /v1/check` written
//! straight onto an HTTP/1.1 keep-alive connection, one request in flight
//! at a time (as forward-auth gateways send them: nginx's `auth_request`,
//! Traefik's `forwardAuth`), answers parsed just enough to check them.
//!
//! The 8 blocking `ureq` threads it replaces spent 50–52 µs of CPU per
//! request against the daemon's 36–38 on the same 2 CPUs: the figures were
//! the generator's. Here a connection is a byte buffer out and a response
//! parser in: the status must be 200 or 429 and the body whole
//! (`Content-Length`); anything else fails the request. The functional
//! tests keep using a real client (`ureq`). A [`Pool`] holds a thread's
//! connections and sends each due check by its [`Dispatch`].

use std::time::Instant;

use anyhow::{bail, Context, Result};
use tokio::{io::AsyncWriteExt, net::TcpStream};

/// A finished request: when it became due, and its status or why it failed.
pub struct Done {
    pub due: Instant,
    pub result: Result<u16, String>,
}

/// One keep-alive connection's requests: those waiting for the connection,
/// the one in flight, the answer read so far.
pub struct Checks {
    host: String,
    waiting: std::collections::VecDeque<(Instant, String)>,
    in_flight: Option<Instant>,
    input: Vec<u8>,
    filled: usize,
}

impl Checks {
    pub async fn connect(addr: std::net::SocketAddr) -> Result<(TcpStream, Checks)> {
        let tcp = TcpStream::connect(addr)
            .await
            .with_context(|| format!("connecting to the HTTP check on {addr}"))?;
        tcp.set_nodelay(true)?;
        let c = Checks {
            host: addr.to_string(),
            waiting: Default::default(),
            in_flight: None,
            input: vec![0; 16 << 10],
            filled: 0,
        };
        Ok((tcp, c))
    }

    /// Requests not yet answered (waiting or in flight).
    pub fn pending(&self) -> usize {
        self.waiting.len() + self.in_flight.is_some() as usize
    }

    /// Queues a check with this JSON body, due `due`; it is sent as soon as
    /// the connection is free (see [`Checks::send`]).
    pub fn check(&mut self, due: Instant, body: String) {
        self.waiting.push_back((due, body));
    }

    /// Sends the next waiting request if none is in flight.
    pub async fn send(&mut self, tcp: &mut TcpStream) -> Result<()> {
        if self.in_flight.is_some() {
            return Ok(());
        }
        let Some((due, body)) = self.waiting.pop_front() else {
            return Ok(());
        };
        let head = format!(
            "POST /v1/check HTTP/1.1\r\nHost: {}\r\nContent-Type: application/json\r\nContent-Length: {}\r\n\r\n",
            self.host,
            body.len()
        );
        let mut out = head.into_bytes();
        out.extend_from_slice(body.as_bytes());
        tcp.write_all(&out).await.context("sending a check")?;
        self.in_flight = Some(due);
        Ok(())
    }

    /// Reads what has arrived (after `tcp.readable()`); the request in
    /// flight if its answer is now whole.
    pub fn read(&mut self, tcp: &TcpStream) -> Result<Option<Done>> {
        let Some(due) = self.in_flight else {
            bail!("an answer came with no request in flight")
        };
        if self.filled == self.input.len() {
            self.input.resize(2 * self.input.len(), 0);
        }
        match crate::read_available(tcp, &mut self.input[self.filled..])
            .context("reading an answer")?
        {
            Some(0) => bail!("the daemon closed the connection"),
            Some(n) => self.filled += n,
            None => {}
        }
        let Some(len) = answer_len(&self.input[..self.filled])? else {
            return Ok(None);
        };
        let status = std::str::from_utf8(&self.input[9..12])
            .ok()
            .and_then(|s| s.parse::<u16>().ok())
            .unwrap_or(0);
        self.input.copy_within(len..self.filled, 0);
        self.filled -= len;
        self.in_flight = None;
        let result = match status {
            200 | 429 => Ok(status),
            s => Err(format!("answered {s}")),
        };
        Ok(Some(Done { due, result }))
    }
}

/// How a due check picks its connection.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Dispatch {
    /// In turn: each check waits for its own connection, even while
    /// others are idle (a fixed set of serial clients).
    InTurn,
    /// An idle connection, else the first to come free (a gateway's
    /// keep-alive pool: Caddy keeps 32 per upstream, nginx `keepalive N`).
    AnyIdle,
}

/// A set of keep-alive connections and the checks waiting for one.
pub struct Pool {
    conns: Vec<(TcpStream, Checks)>,
    dispatch: Dispatch,
    /// Connections with nothing in flight (`AnyIdle`).
    idle: Vec<usize>,
    /// Checks waiting for any connection (`AnyIdle`).
    backlog: std::collections::VecDeque<(Instant, String)>,
    next: usize,
    ready: Vec<usize>,
}

impl Pool {
    pub async fn connect(
        addr: std::net::SocketAddr,
        connections: usize,
        dispatch: Dispatch,
    ) -> Result<Pool> {
        let mut conns = Vec::with_capacity(connections);
        for _ in 0..connections {
            conns.push(Checks::connect(addr).await?);
        }
        let idle = (0..connections).rev().collect();
        Ok(Pool {
            conns,
            dispatch,
            idle,
            backlog: Default::default(),
            next: 0,
            ready: Vec::new(),
        })
    }

    /// Checks not yet answered.
    pub fn pending(&self) -> usize {
        self.backlog.len() + self.conns.iter().map(|(_, c)| c.pending()).sum::<usize>()
    }

    /// A check due `due`, sent at once if its connection is free.
    pub async fn check(&mut self, due: Instant, body: String) -> Result<()> {
        let i = match self.dispatch {
            Dispatch::InTurn => {
                self.next = (self.next + 1) % self.conns.len();
                self.next
            }
            Dispatch::AnyIdle => match self.idle.pop() {
                Some(i) => i,
                None => {
                    self.backlog.push_back((due, body));
                    return Ok(());
                }
            },
        };
        let (tcp, c) = &mut self.conns[i];
        c.check(due, body);
        c.send(tcp).await
    }

    /// Waits for answers, then reads every connection that has one and
    /// sends each freed connection its next check; the finished checks.
    pub async fn answers(&mut self, done: &mut Vec<Done>) -> Result<()> {
        let (conns, ready) = (&self.conns, &mut self.ready);
        std::future::poll_fn(|cx| {
            ready.clear();
            for (i, (tcp, c)) in conns.iter().enumerate() {
                if c.in_flight.is_some() && tcp.poll_read_ready(cx).is_ready() {
                    ready.push(i);
                }
            }
            if ready.is_empty() {
                std::task::Poll::Pending
            } else {
                std::task::Poll::Ready(())
            }
        })
        .await;
        for k in 0..self.ready.len() {
            let i = self.ready[k];
            let (tcp, c) = &mut self.conns[i];
            let Some(d) = c.read(tcp)? else { continue };
            done.push(d);
            match self.dispatch {
                Dispatch::InTurn => c.send(tcp).await?,
                Dispatch::AnyIdle => match self.backlog.pop_front() {
                    Some((due, body)) => {
                        c.check(due, body);
                        c.send(tcp).await?;
                    }
                    None => self.idle.push(i),
                },
            }
        }
        Ok(())
    }
}

/// The length of the whole answer at the start of `b` (head and
/// `Content-Length` body), once it is all there.
fn answer_len(b: &[u8]) -> Result<Option<usize>> {
    let Some(end) = b.windows(4).position(|w| w == b"\r\n\r\n") else {
        return Ok(None);
    };
    if !b.starts_with(b"HTTP/1.1 ") || end < 12 {
        bail!(
            "not an HTTP/1.1 answer: {:?}",
            String::from_utf8_lossy(&b[..end.min(80)])
        );
    }
    let head = std::str::from_utf8(&b[..end]).context("an answer's head")?;
    let body = head
        .split("\r\n")
        .find_map(|l| {
            l.split_once(':')
                .filter(|(k, _)| k.eq_ignore_ascii_case("content-length"))
                .map(|(_, v)| v.trim())
        })
        .context("an answer without Content-Length")?
        .parse::<usize>()
        .context("an answer's Content-Length")?;
    let whole = end + 4 + body;
    Ok((b.len() >= whole).then_some(whole))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn answers_are_whole_only_with_their_body() {
        let a = b"HTTP/1.1 429 Too Many Requests\r\ncontent-length: 2\r\nx: y\r\n\r\n{}";
        assert_eq!(answer_len(a).unwrap(), Some(a.len()));
        assert_eq!(answer_len(&a[..a.len() - 1]).unwrap(), None);
        assert_eq!(answer_len(b"HTTP/1.1 200 OK\r\n").unwrap(), None);
        assert!(answer_len(b"HTTP/1.1 200 OK\r\n\r\n").is_err());
    }
}
