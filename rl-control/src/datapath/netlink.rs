//! The one question rl asks rtnetlink: which XDP programs an interface of
//! this network namespace runs (aya 0.14 attaches through netlink but
//! cannot ask). Adoption uses it to tell a pinned link's interface from
//! another one that took its name and index here.

use std::{
    io::{Error, ErrorKind, Result},
    os::fd::{AsRawFd, FromRawFd, OwnedFd},
};

const RTM_NEWLINK: u16 = 16;
const RTM_GETLINK: u16 = 18;
const NLMSG_ERROR: u16 = 2;
const NLM_F_REQUEST: u16 = 1;
/// `struct nlmsghdr` and `struct ifinfomsg`.
const NLMSG_HDR: usize = 16;
const IFINFO: usize = 16;
/// `IFLA_XDP` (nested) and the program ids inside it: one per attach mode
/// (skb, driver, hardware), and the one of the only mode attached.
const IFLA_XDP: u16 = 43;
const IFLA_XDP_PROG_IDS: [u16; 4] = [4, 5, 6, 7];
/// An attribute type's flag bits (nested, byte order).
const NLA_TYPE_MASK: u16 = 0x3fff;

/// The ids of the XDP programs attached to interface `ifindex` here, in
/// any mode; empty if none.
pub(super) fn xdp_programs(ifindex: u32) -> Result<Vec<u32>> {
    let fd = socket()?;
    let mut req = [0u8; NLMSG_HDR + IFINFO];
    req[0..4].copy_from_slice(&((NLMSG_HDR + IFINFO) as u32).to_ne_bytes());
    req[4..6].copy_from_slice(&RTM_GETLINK.to_ne_bytes());
    req[6..8].copy_from_slice(&NLM_F_REQUEST.to_ne_bytes());
    req[8..12].copy_from_slice(&1u32.to_ne_bytes());
    req[NLMSG_HDR + 4..NLMSG_HDR + 8].copy_from_slice(&ifindex.to_ne_bytes());
    if unsafe { libc::send(fd.as_raw_fd(), req.as_ptr().cast(), req.len(), 0) } < 0 {
        return Err(Error::last_os_error());
    }
    let mut buf = vec![0u8; 64 * 1024];
    loop {
        let n = unsafe { libc::recv(fd.as_raw_fd(), buf.as_mut_ptr().cast(), buf.len(), 0) };
        if n >= 0 {
            return answer(&buf[..n as usize]);
        }
        let e = Error::last_os_error();
        if e.kind() != ErrorKind::Interrupted {
            return Err(e);
        }
    }
}

fn socket() -> Result<OwnedFd> {
    let fd = unsafe {
        libc::socket(
            libc::AF_NETLINK,
            libc::SOCK_RAW | libc::SOCK_CLOEXEC,
            libc::NETLINK_ROUTE,
        )
    };
    if fd < 0 {
        return Err(Error::last_os_error());
    }
    let fd = unsafe { OwnedFd::from_raw_fd(fd) };
    // The kernel answers at once; never wait long for it.
    let timeout = libc::timeval {
        tv_sec: 2,
        tv_usec: 0,
    };
    let set = unsafe {
        libc::setsockopt(
            fd.as_raw_fd(),
            libc::SOL_SOCKET,
            libc::SO_RCVTIMEO,
            (&raw const timeout).cast(),
            std::mem::size_of_val(&timeout) as libc::socklen_t,
        )
    };
    if set < 0 {
        return Err(Error::last_os_error());
    }
    Ok(fd)
}

/// The program ids in the kernel's answer to one `RTM_GETLINK`.
fn answer(msg: &[u8]) -> Result<Vec<u32>> {
    let bad = || Error::new(ErrorKind::InvalidData, "a malformed rtnetlink answer");
    let u16_at = |b: &[u8], i: usize| {
        b.get(i..i + 2)
            .map(|s| u16::from_ne_bytes([s[0], s[1]]))
            .ok_or_else(bad)
    };
    let len = msg
        .get(0..4)
        .map(|s| u32::from_ne_bytes([s[0], s[1], s[2], s[3]]) as usize)
        .ok_or_else(bad)?;
    let msg = msg.get(..len).ok_or_else(bad)?;
    match u16_at(msg, 4)? {
        NLMSG_ERROR => {
            let code = msg.get(NLMSG_HDR..NLMSG_HDR + 4).ok_or_else(bad)?;
            return match i32::from_ne_bytes([code[0], code[1], code[2], code[3]]).wrapping_neg() {
                // An acknowledgement (never asked for): no answer.
                0 => Err(bad()),
                errno => Err(Error::from_raw_os_error(errno)),
            };
        }
        RTM_NEWLINK => {}
        _ => return Err(bad()),
    }
    let mut ids = Vec::new();
    for (kind, xdp) in attributes(msg.get(NLMSG_HDR + IFINFO..).ok_or_else(bad)?) {
        if kind != IFLA_XDP {
            continue;
        }
        for (kind, v) in attributes(xdp) {
            if let (true, Ok(id)) = (IFLA_XDP_PROG_IDS.contains(&kind), <[u8; 4]>::try_from(v)) {
                let id = u32::from_ne_bytes(id);
                if id != 0 && !ids.contains(&id) {
                    ids.push(id);
                }
            }
        }
    }
    Ok(ids)
}

/// The `(type, payload)` of each `struct rtattr` in `b` (4-byte aligned);
/// stops at the first one that does not fit.
fn attributes(mut b: &[u8]) -> impl Iterator<Item = (u16, &[u8])> {
    std::iter::from_fn(move || {
        let len = u16::from_ne_bytes([*b.first()?, *b.get(1)?]) as usize;
        let kind = u16::from_ne_bytes([*b.get(2)?, *b.get(3)?]) & NLA_TYPE_MASK;
        if len < 4 || len > b.len() {
            return None;
        }
        let payload = &b[4..len];
        b = b.get((len + 3) & !3..).unwrap_or(&[]);
        Some((kind, payload))
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn attr(kind: u16, payload: &[u8]) -> Vec<u8> {
        let mut a = Vec::new();
        a.extend_from_slice(&((4 + payload.len()) as u16).to_ne_bytes());
        a.extend_from_slice(&kind.to_ne_bytes());
        a.extend_from_slice(payload);
        a.resize((a.len() + 3) & !3, 0);
        a
    }

    fn newlink(attrs: &[u8]) -> Vec<u8> {
        let mut m = vec![0u8; NLMSG_HDR + IFINFO];
        m.extend_from_slice(attrs);
        let len = m.len() as u32;
        m[0..4].copy_from_slice(&len.to_ne_bytes());
        m[4..6].copy_from_slice(&RTM_NEWLINK.to_ne_bytes());
        m
    }

    #[test]
    fn the_program_ids_of_every_mode_are_read_from_the_nested_xdp_attribute() {
        let mut xdp = attr(2, &[1]); // IFLA_XDP_ATTACHED: a u8, padded
        xdp.extend(attr(6, &7u32.to_ne_bytes())); // skb
        xdp.extend(attr(5, &9u32.to_ne_bytes())); // driver
        let mut all = attr(3, b"vb\0"); // IFLA_IFNAME before it
        all.extend(attr(IFLA_XDP | 0x8000, &xdp)); // NLA_F_NESTED set
        all.extend(attr(4, &5u32.to_ne_bytes())); // an IFLA_* 4 outside IFLA_XDP: not a program
        assert_eq!(answer(&newlink(&all)).unwrap(), vec![7, 9]);
        assert_eq!(
            answer(&newlink(&attr(3, b"vb\0"))).unwrap(),
            Vec::<u32>::new()
        );
    }

    #[test]
    fn an_error_answer_is_the_kernels_errno_and_a_cut_answer_is_refused() {
        let mut m = vec![0u8; NLMSG_HDR + 4];
        m[0..4].copy_from_slice(&((NLMSG_HDR + 4) as u32).to_ne_bytes());
        m[4..6].copy_from_slice(&NLMSG_ERROR.to_ne_bytes());
        m[NLMSG_HDR..].copy_from_slice(&(-libc::ENODEV).to_ne_bytes());
        assert_eq!(answer(&m).unwrap_err().raw_os_error(), Some(libc::ENODEV));
        let whole = newlink(&attr(IFLA_XDP, &attr(4, &3u32.to_ne_bytes())));
        assert_eq!(answer(&whole).unwrap(), vec![3]);
        assert!(
            answer(&whole[..whole.len() - 4]).is_err(),
            "shorter than its length says"
        );
    }
}
