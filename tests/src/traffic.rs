//! Real packets: UDP floods and paced senders in the sender namespace, and a
//! receiver in the protected namespace that counts what got through, per
//! source address.

use std::{
    collections::HashMap,
    net::{IpAddr, SocketAddr, UdpSocket},
    os::fd::AsRawFd,
    sync::{
        atomic::{AtomicBool, Ordering},
        mpsc, Arc,
    },
    thread::JoinHandle,
    time::{Duration, Instant},
};

use anyhow::{Context, Result};

use crate::lab::{pin_to_cpu, Netns};

/// The UDP port floods are sent to.
pub const PORT: u16 = 7777;
const PAYLOAD: [u8; 32] = [0x5a; 32];

/// What a sender did.
#[derive(Debug, Clone)]
pub struct Sent {
    pub packets: u64,
    pub started: Instant,
    pub ended: Instant,
    /// Gaps of more than [`STALL`] between two sends of a flood (start, end;
    /// a flood's `started` and `ended` are its first and last send):
    /// a busy machine that stops the sender for longer than a limit's burst
    /// lasts costs the flood allowance, which a test must not blame on the
    /// limiter. Empty for paced senders.
    pub stalls: Vec<(Instant, Instant)>,
}

/// The shortest gap between two sends of a flood that [`Sent::stalls`] records.
pub const STALL: Duration = Duration::from_millis(1);

impl Sent {
    pub fn seconds(&self) -> f64 {
        (self.ended - self.started).as_secs_f64()
    }
}

fn socket(src: IpAddr) -> Result<UdpSocket> {
    UdpSocket::bind(SocketAddr::new(src, 0)).with_context(|| format!("binding a sender to {src}"))
}

/// Calls `send` (true when a packet left) as fast as one thread can for
/// `duration`; failed sends (ENOBUFS and friends) are not counted.
fn send_for(duration: Duration, mut send: impl FnMut() -> bool) -> Sent {
    let began = Instant::now();
    let (mut packets, mut first, mut last, mut stalls) = (0u64, None, began, Vec::new());
    loop {
        for _ in 0..64 {
            if send() {
                packets += 1;
                let now = Instant::now();
                if first.is_none() {
                    first = Some(now);
                } else if now - last > STALL {
                    stalls.push((last, now));
                }
                last = now;
            }
        }
        if began.elapsed() >= duration {
            break;
        }
    }
    Sent {
        packets,
        started: first.unwrap_or(began),
        ended: last,
        stalls,
    }
}

/// Sends as fast as one thread can from `src` to `dst` for `duration`,
/// optionally pinned to `cpu`.
pub fn flood(
    ns: &Netns,
    src: IpAddr,
    dst: IpAddr,
    duration: Duration,
    cpu: Option<usize>,
) -> JoinHandle<Result<Sent>> {
    ns.spawn(move || {
        if let Some(cpu) = cpu {
            pin_to_cpu(cpu)?;
        }
        let sock = socket(src)?;
        let to = SocketAddr::new(dst, PORT);
        Ok(send_for(duration, || sock.send_to(&PAYLOAD, to).is_ok()))
    })
}

/// Sends `count` packets from `src` to `dst`, evenly paced at `pps`.
pub fn paced(
    ns: &Netns,
    src: IpAddr,
    dst: IpAddr,
    pps: u64,
    count: u64,
) -> JoinHandle<Result<Sent>> {
    paced_datagrams(ns, src, dst, pps, count, PAYLOAD.len())
}

/// [`paced`] with `size`-byte datagrams: above the MTU, the sending kernel
/// fragments each one.
pub fn paced_datagrams(
    ns: &Netns,
    src: IpAddr,
    dst: IpAddr,
    pps: u64,
    count: u64,
    size: usize,
) -> JoinHandle<Result<Sent>> {
    ns.spawn(move || {
        let payload = vec![0x5a; size];
        let sock = socket(src)?;
        let to = SocketAddr::new(dst, PORT);
        let started = Instant::now();
        let gap = Duration::from_nanos(1_000_000_000 / pps);
        let mut packets = 0;
        for i in 0..count {
            let due = started + gap * i as u32;
            if let Some(wait) = due.checked_duration_since(Instant::now()) {
                std::thread::sleep(wait);
            }
            sock.send_to(&payload, to).context("paced send")?;
            packets += 1;
        }
        Ok(Sent {
            packets,
            started,
            ended: Instant::now(),
            stalls: Vec::new(),
        })
    })
}

/// Joins a sender thread, surfacing any error.
pub fn join(h: JoinHandle<Result<Sent>>) -> Result<Sent> {
    h.join()
        .map_err(|_| anyhow::anyhow!("sender thread panicked"))?
}

/// An AF_PACKET socket bound to `dev` in the current namespace.
fn packet_socket(dev: &str) -> Result<std::os::fd::OwnedFd> {
    use std::os::fd::FromRawFd;
    let proto = (libc::ETH_P_ALL as u16).to_be();
    let fd = unsafe { libc::socket(libc::AF_PACKET, libc::SOCK_RAW, proto as i32) };
    if fd < 0 {
        anyhow::bail!("AF_PACKET socket: {}", std::io::Error::last_os_error());
    }
    let fd = unsafe { std::os::fd::OwnedFd::from_raw_fd(fd) };
    let name = std::ffi::CString::new(dev)?;
    let ifindex = unsafe { libc::if_nametoindex(name.as_ptr()) };
    if ifindex == 0 {
        anyhow::bail!("no interface {dev}");
    }
    let mut sll: libc::sockaddr_ll = unsafe { std::mem::zeroed() };
    sll.sll_family = libc::AF_PACKET as u16;
    sll.sll_protocol = proto;
    sll.sll_ifindex = ifindex as i32;
    let rc = unsafe {
        libc::bind(
            fd.as_raw_fd(),
            &sll as *const _ as *const libc::sockaddr,
            std::mem::size_of::<libc::sockaddr_ll>() as u32,
        )
    };
    if rc != 0 {
        anyhow::bail!(
            "binding AF_PACKET to {dev}: {}",
            std::io::Error::last_os_error()
        );
    }
    Ok(fd)
}

/// Sends the hand-built Ethernet `frame` on `dev` as fast as one thread can
/// for `duration` (for frames the kernel cannot build itself, such as VLAN
/// tags on a kernel without VLAN support).
pub fn raw_flood(
    ns: &Netns,
    dev: &'static str,
    frame: Vec<u8>,
    duration: Duration,
) -> JoinHandle<Result<Sent>> {
    ns.spawn(move || {
        let fd = packet_socket(dev)?;
        Ok(send_for(duration, || {
            let n = unsafe { libc::send(fd.as_raw_fd(), frame.as_ptr().cast(), frame.len(), 0) };
            n == frame.len() as isize
        }))
    })
}

/// Sends `count` copies of the Ethernet+IPv4 `frame` on `dev` in `ns`, the
/// i-th from the forged source `source(i)` (addresses no socket could send
/// from), paced at `pps` or, with `pps = 0`, as fast as one thread can;
/// optionally pinned to `cpu`. Every frame is sent: a full queue is waited on.
pub fn forged(
    ns: &Netns,
    dev: &'static str,
    mut frame: Vec<u8>,
    count: u64,
    pps: u64,
    cpu: Option<usize>,
    mut source: impl FnMut(u64) -> [u8; 4] + Send + 'static,
) -> JoinHandle<Result<Sent>> {
    const SRC: std::ops::Range<usize> = 26..30;
    ns.spawn(move || {
        if let Some(cpu) = cpu {
            pin_to_cpu(cpu)?;
        }
        anyhow::ensure!(
            frame.len() >= SRC.end && frame[12..14] == [0x08, 0x00],
            "forged() needs an untagged IPv4 frame"
        );
        let fd = packet_socket(dev)?;
        let started = Instant::now();
        for i in 0..count {
            // pps 0: no pacing.
            if let Some(offset) = (i * 1_000_000_000).checked_div(pps) {
                let due = started + Duration::from_nanos(offset);
                if let Some(wait) = due.checked_duration_since(Instant::now()) {
                    std::thread::sleep(wait);
                }
            }
            frame[SRC].copy_from_slice(&source(i));
            let mut tries = 0;
            while unsafe { libc::send(fd.as_raw_fd(), frame.as_ptr().cast(), frame.len(), 0) }
                != frame.len() as isize
            {
                tries += 1;
                anyhow::ensure!(
                    tries < 1000,
                    "AF_PACKET send on {dev}: {}",
                    std::io::Error::last_os_error()
                );
                std::thread::sleep(Duration::from_micros(100));
            }
        }
        Ok(Sent {
            packets: count,
            started,
            ended: Instant::now(),
            stalls: Vec::new(),
        })
    })
}

/// A pseudo-random 10/8 address (xorshift over `state`), odd last byte.
pub fn spoofed_source(state: &mut u32) -> [u8; 4] {
    *state ^= *state << 13;
    *state ^= *state >> 17;
    *state ^= *state << 5;
    let b = state.to_be_bytes();
    [10, b[1], b[2], b[3] | 1]
}

/// One received packet: its source if it counts, `None` if it does not.
type Received = Option<IpAddr>;

/// Counts received packets per source address on its own thread until
/// [`Receiver::finish`]: either UDP datagrams on [`PORT`] ([`Receiver::start`])
/// or every frame XDP passed on an interface ([`Receiver::tap`]).
pub struct Receiver {
    stop: Arc<AtomicBool>,
    handle: JoinHandle<Result<HashMap<IpAddr, u64>>>,
}

/// A deep receive buffer, so a busy machine cannot make the receiver, rather
/// than rl, lose packets (SO_RCVBUFFORCE works for root), and a short read
/// timeout so the receiver notices when to stop.
fn prepare_receive(fd: std::os::fd::RawFd) {
    let size: libc::c_int = 64 << 20;
    let tv = libc::timeval {
        tv_sec: 0,
        tv_usec: 50_000,
    };
    unsafe {
        libc::setsockopt(
            fd,
            libc::SOL_SOCKET,
            libc::SO_RCVBUFFORCE,
            &size as *const _ as *const libc::c_void,
            std::mem::size_of::<libc::c_int>() as u32,
        );
        libc::setsockopt(
            fd,
            libc::SOL_SOCKET,
            libc::SO_RCVTIMEO,
            &tv as *const _ as *const libc::c_void,
            std::mem::size_of::<libc::timeval>() as u32,
        );
    }
}

impl Receiver {
    /// A UDP receiver on [`PORT`] (IPv4 and IPv6) in `ns`; returns once bound.
    pub fn start(ns: &Netns) -> Result<Receiver> {
        Receiver::spawn(ns, "UDP receiver", || {
            let sock = UdpSocket::bind(SocketAddr::new("::".parse().unwrap(), PORT))
                .context("binding the receiver")?;
            prepare_receive(sock.as_raw_fd());
            Ok(move |buf: &mut [u8]| -> Option<Received> {
                sock.recv_from(buf)
                    .ok()
                    .map(|(_, from)| Some(from.ip().to_canonical()))
            })
        })
    }

    /// Counts the frames arriving on `dev` in `ns` that XDP passed (packet
    /// taps run after XDP), whatever their VLAN tags.
    pub fn tap(ns: &Netns, dev: &'static str) -> Result<Receiver> {
        Receiver::spawn(ns, "tap receiver", move || {
            let fd = packet_socket(dev)?;
            prepare_receive(fd.as_raw_fd());
            Ok(move |buf: &mut [u8]| -> Option<Received> {
                let mut sll: libc::sockaddr_ll = unsafe { std::mem::zeroed() };
                let mut len = std::mem::size_of::<libc::sockaddr_ll>() as u32;
                let n = unsafe {
                    libc::recvfrom(
                        fd.as_raw_fd(),
                        buf.as_mut_ptr().cast(),
                        buf.len(),
                        0,
                        &mut sll as *mut _ as *mut libc::sockaddr,
                        &mut len,
                    )
                };
                if n <= 0 {
                    return None;
                }
                let incoming = sll.sll_pkttype != libc::PACKET_OUTGOING;
                Some(
                    incoming
                        .then(|| crate::frames::source_of(&buf[..n as usize]))
                        .flatten(),
                )
            })
        })
    }

    /// Runs `open` in `ns`, then calls the receive function it returns
    /// (`None` on timeout) until stopped and drained.
    fn spawn<R>(
        ns: &Netns,
        what: &'static str,
        open: impl FnOnce() -> Result<R> + Send + 'static,
    ) -> Result<Receiver>
    where
        R: FnMut(&mut [u8]) -> Option<Received>,
    {
        let stop = Arc::new(AtomicBool::new(false));
        let (ready_tx, ready_rx) = mpsc::channel();
        let stop2 = stop.clone();
        let handle = ns.spawn(move || -> Result<HashMap<IpAddr, u64>> {
            let mut recv = open()?;
            let _ = ready_tx.send(());
            let mut counts = HashMap::new();
            let mut buf = [0u8; 2048];
            let mut quiet_since_stop = 0;
            loop {
                match recv(&mut buf) {
                    Some(Some(src)) => *counts.entry(src).or_insert(0) += 1,
                    Some(None) => {}
                    None if stop2.load(Ordering::Relaxed) => {
                        quiet_since_stop += 1;
                        if quiet_since_stop >= 4 {
                            break;
                        }
                    }
                    None => {}
                }
            }
            Ok(counts)
        });
        ready_rx
            .recv_timeout(Duration::from_secs(5))
            .with_context(|| format!("the {what} did not start"))?;
        Ok(Receiver { stop, handle })
    }

    /// Stops after the socket has drained; returns packets per source.
    pub fn finish(self) -> Result<HashMap<IpAddr, u64>> {
        self.stop.store(true, Ordering::Relaxed);
        self.handle
            .join()
            .map_err(|_| anyhow::anyhow!("receiver thread panicked"))?
    }
}
