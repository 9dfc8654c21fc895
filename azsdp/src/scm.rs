//! Receiving messages with their control data, owning every descriptor the
//! kernel installed, whatever else is wrong with a message.
//!
//! A peer chooses what it sends: more descriptors than our control buffer
//! holds (the kernel then installs those that fit and sets `MSG_CTRUNC`),
//! several `SCM_RIGHTS` blocks, no credentials, odd lengths. Descriptors the
//! kernel installed are ours to close: a parser that stops at the first
//! problem (nix's `cmsgs()` refuses a truncated message before wrapping
//! anything) leaks them into the process for good, and a local user could
//! fill a root server's descriptor table that way. So this module walks the
//! control buffer itself and wraps every descriptor in an [`OwnedFd`]
//! before anyone looks at the message; what the caller refuses is closed
//! when dropped.
//!
//! `unsafe` here: `recvmsg`, `recvmmsg` and the `CMSG_*` walk over our own
//! buffers. The calls are raw system calls: inside the preloaded shim,
//! libc's names resolve to the shim's own hooks, which would look each
//! descriptor up for nothing (ours are never the program's sockets).

use std::os::fd::{FromRawFd, OwnedFd, RawFd};

/// Most descriptors a message may bring in ([`recv`] takes in only these;
/// the kernel closes the rest of a longer list itself).
const FD_ROOM: usize = 8;

/// One received message's control data, owned.
#[derive(Debug, Default)]
pub struct Received {
    /// Bytes of payload.
    pub bytes: usize,
    /// The kernel's `SCM_CREDENTIALS`, when the socket passes them.
    pub creds: Option<libc::ucred>,
    /// Every descriptor the kernel installed, in order.
    pub fds: Vec<OwnedFd>,
    /// The payload or the control data was cut (`MSG_TRUNC`, `MSG_CTRUNC`).
    pub truncated: bool,
}

/// Control buffer aligned for `cmsghdr` and large enough for the
/// credentials and [`FD_ROOM`] descriptors.
#[repr(C, align(8))]
struct ControlSpace([u8; 256]);

/// The room the credentials and [`FD_ROOM`] descriptors take.
fn control_len() -> usize {
    // SAFETY: CMSG_SPACE is arithmetic on its argument.
    let n = unsafe {
        libc::CMSG_SPACE(std::mem::size_of::<libc::ucred>() as u32)
            + libc::CMSG_SPACE((FD_ROOM * std::mem::size_of::<RawFd>()) as u32)
    } as usize;
    debug_assert!(n <= std::mem::size_of::<ControlSpace>());
    n.min(std::mem::size_of::<ControlSpace>())
}

/// Receive one message into `buf` on `sock` with `flags` (`MSG_CMSG_CLOEXEC`
/// is always added), retrying `EINTR`.
pub fn recv(sock: RawFd, buf: &mut [u8], flags: libc::c_int) -> std::io::Result<Received> {
    let mut space = ControlSpace([0; 256]);
    let mut iov = libc::iovec {
        iov_base: buf.as_mut_ptr().cast(),
        iov_len: buf.len(),
    };
    let mut m = header(&mut iov, &mut space);
    let n = loop {
        // SAFETY: `m` points at our iovec over `buf` and at our control
        // buffer, both live and of the lengths given.
        let n = unsafe {
            libc::syscall(
                libc::SYS_recvmsg,
                sock,
                &mut m as *mut libc::msghdr,
                flags | libc::MSG_CMSG_CLOEXEC,
            )
        };
        if n >= 0 {
            break n as usize;
        }
        let e = std::io::Error::last_os_error();
        if e.kind() != std::io::ErrorKind::Interrupted {
            return Err(e);
        }
    };
    Ok(owned(&m, &space, n))
}

/// Receive up to `bufs.len()` messages at once (one system call), one into
/// each buffer, with `flags` as [`recv`]. What came, in order: fewer than
/// asked means the queue was empty then (with `MSG_DONTWAIT`); none is
/// `WouldBlock`, as [`recv`].
pub fn recv_batch<const N: usize>(
    sock: RawFd,
    bufs: &mut [[u8; N]],
    flags: libc::c_int,
) -> std::io::Result<Vec<Received>> {
    let count = bufs.len();
    let mut spaces: Vec<ControlSpace> = (0..count).map(|_| ControlSpace([0; 256])).collect();
    let mut iovs: Vec<libc::iovec> = bufs
        .iter_mut()
        .map(|b| libc::iovec {
            iov_base: b.as_mut_ptr().cast(),
            iov_len: N,
        })
        .collect();
    let mut msgs: Vec<libc::mmsghdr> = iovs
        .iter_mut()
        .zip(spaces.iter_mut())
        .map(|(iov, space)| libc::mmsghdr {
            msg_hdr: header(iov, space),
            msg_len: 0,
        })
        .collect();
    let n = loop {
        // SAFETY: `msgs` holds `count` headers, each pointing at its own
        // iovec over one of `bufs` and at its own control buffer, all live
        // until we return; a null timeout.
        let n = unsafe {
            libc::syscall(
                libc::SYS_recvmmsg,
                sock,
                msgs.as_mut_ptr(),
                count as libc::c_uint,
                flags | libc::MSG_CMSG_CLOEXEC,
                std::ptr::null_mut::<libc::timespec>(),
            )
        };
        if n >= 0 {
            break n as usize;
        }
        let e = std::io::Error::last_os_error();
        if e.kind() != std::io::ErrorKind::Interrupted {
            return Err(e);
        }
    };
    // (Every message the kernel filled is walked, whatever the caller then
    // makes of it: its descriptors are owned from here.)
    Ok(msgs[..n.min(count)]
        .iter()
        .zip(spaces.iter())
        .map(|(m, space)| owned(&m.msg_hdr, space, m.msg_len as usize))
        .collect())
}

/// A header for one message into `iov`, with `space` for control data.
fn header(iov: &mut libc::iovec, space: &mut ControlSpace) -> libc::msghdr {
    // SAFETY: plain data; all-zero is a valid msghdr.
    let mut m: libc::msghdr = unsafe { std::mem::zeroed() };
    m.msg_iov = iov;
    m.msg_iovlen = 1;
    m.msg_control = space.0.as_mut_ptr().cast();
    m.msg_controllen = control_len() as _;
    m
}

/// The message `m` describes (`n` bytes of payload, control data in
/// `space`, as the kernel filled them), every descriptor wrapped.
fn owned(m: &libc::msghdr, space: &ControlSpace, n: usize) -> Received {
    let mut r = Received {
        bytes: n,
        truncated: m.msg_flags & (libc::MSG_TRUNC | libc::MSG_CTRUNC) != 0,
        ..Received::default()
    };
    // (A usize on glibc, a u32 elsewhere.)
    let filled: usize = m.msg_controllen as _;
    let end = space.0.as_ptr() as usize + filled.min(control_len());
    // SAFETY: `m` describes `space`, which the kernel filled up to
    // msg_controllen; CMSG_FIRSTHDR/NXTHDR stay within it or return null.
    let mut c = unsafe { libc::CMSG_FIRSTHDR(m) };
    while !c.is_null() {
        // SAFETY: a non-null header lies within the buffer (see above).
        let h = unsafe { &*c };
        // SAFETY: CMSG_DATA and CMSG_LEN are pointer arithmetic.
        let (data, head) = unsafe { (libc::CMSG_DATA(c), libc::CMSG_LEN(0) as usize) };
        let len = (h.cmsg_len as usize).saturating_sub(head);
        // What of the data lies inside the buffer (a truncated block's
        // length is the kernel's; we never read past what it filled).
        let len = len.min(end.saturating_sub(data as usize));
        match (h.cmsg_level, h.cmsg_type) {
            (libc::SOL_SOCKET, libc::SCM_RIGHTS) => {
                for i in 0..len / std::mem::size_of::<RawFd>() {
                    // SAFETY: within the block's filled data; unaligned
                    // read as cmsg data need not be aligned for i32.
                    let raw = unsafe { data.cast::<RawFd>().add(i).read_unaligned() };
                    if raw >= 0 {
                        // SAFETY: the kernel just installed this descriptor
                        // for us; nothing else owns it.
                        r.fds.push(unsafe { OwnedFd::from_raw_fd(raw) });
                    }
                }
            }
            (libc::SOL_SOCKET, libc::SCM_CREDENTIALS)
                if len >= std::mem::size_of::<libc::ucred>() =>
            {
                // SAFETY: the block holds a whole ucred (checked above).
                r.creds = Some(unsafe { data.cast::<libc::ucred>().read_unaligned() });
            }
            _ => {}
        }
        // SAFETY: as CMSG_FIRSTHDR; null past the end.
        c = unsafe { libc::CMSG_NXTHDR(m, c) };
    }
    r
}

/// A connected pair of Unix `SOCK_SEQPACKET` sockets (tests).
#[cfg(test)]
pub(crate) fn seqpacket_pair() -> (OwnedFd, OwnedFd) {
    nix::sys::socket::socketpair(
        nix::sys::socket::AddressFamily::Unix,
        nix::sys::socket::SockType::SeqPacket,
        None,
        nix::sys::socket::SockFlag::SOCK_CLOEXEC,
    )
    .unwrap()
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::os::fd::{AsRawFd, OwnedFd};
    use std::os::unix::net::UnixDatagram;

    /// Send `payload` with `n` copies of `x` in `blocks` SCM_RIGHTS blocks.
    fn send_fds(sock: &OwnedFd, x: &UnixDatagram, payload: &[u8], n: usize, blocks: usize) {
        let raw = vec![x.as_raw_fd(); n];
        let per = n.div_ceil(blocks.max(1)).max(1);
        let chunks: Vec<&[RawFd]> = raw.chunks(per).collect();
        let cmsgs: Vec<nix::sys::socket::ControlMessage<'_>> = chunks
            .iter()
            .map(|c| nix::sys::socket::ControlMessage::ScmRights(c))
            .collect();
        nix::sys::socket::sendmsg::<()>(
            sock.as_raw_fd(),
            &[std::io::IoSlice::new(payload)],
            &cmsgs,
            nix::sys::socket::MsgFlags::empty(),
            None,
        )
        .unwrap();
    }

    /// How many descriptors of this process name `x`'s socket (other
    /// tests' descriptors, opened meanwhile, do not count).
    fn copies_of(x: &UnixDatagram) -> usize {
        let me = std::fs::read_link(format!("/proc/self/fd/{}", x.as_raw_fd())).unwrap();
        std::fs::read_dir("/proc/self/fd")
            .unwrap()
            .flatten()
            .filter(|e| std::fs::read_link(e.path()).is_ok_and(|l| l == me))
            .count()
    }

    #[test]
    fn every_installed_descriptor_is_owned_even_when_truncated() {
        let (a, b) = seqpacket_pair();
        let (x, _y) = UnixDatagram::pair().unwrap();
        for (n, blocks) in [
            (1, 1),
            (5, 1),
            (FD_ROOM, 1),
            (FD_ROOM + 1, 1),
            (200, 1),
            (12, 3),
        ] {
            for _ in 0..50 {
                send_fds(&a, &x, b"hello", n, blocks);
                let r = recv(b.as_raw_fd(), &mut [0u8; 2], 0).unwrap();
                assert_eq!(r.bytes, 2);
                assert!(r.truncated, "payload cut to 2 bytes");
                assert!(!r.fds.is_empty() && r.fds.len() <= n);
                assert_eq!(copies_of(&x), 1 + r.fds.len());
            }
            assert_eq!(copies_of(&x), 1, "{n} descriptors in {blocks} blocks");
        }
    }

    /// A batch owns every descriptor of every message, as one receive does,
    /// and stops where the queue ended.
    #[test]
    fn a_batch_owns_every_message_and_stops_at_the_end() {
        let (a, b) = seqpacket_pair();
        nix::sys::socket::setsockopt(&b, nix::sys::socket::sockopt::PassCred, &true).unwrap();
        let (x, _y) = UnixDatagram::pair().unwrap();
        for round in 0..20 {
            // 0, 1, FD_ROOM + 3 and 200 descriptors, with payloads cut or not.
            send_fds(&a, &x, b"12345678", 0, 1);
            send_fds(&a, &x, b"1234", 1, 1);
            send_fds(&a, &x, b"123456789abc", FD_ROOM + 3, 2);
            send_fds(&a, &x, b"12345678", 200, 1);
            let mut bufs = [[0u8; 8]; 3];
            let got = recv_batch(b.as_raw_fd(), &mut bufs, libc::MSG_DONTWAIT).unwrap();
            assert_eq!(got.len(), 3, "round {round}: a full batch");
            assert_eq!(
                (got[0].bytes, got[0].fds.len(), got[0].truncated),
                (8, 0, false)
            );
            assert_eq!(
                (got[1].bytes, got[1].fds.len(), got[1].truncated),
                (4, 1, false)
            );
            assert_eq!(&bufs[1][..4], b"1234");
            assert!(
                got[2].truncated,
                "12 bytes into 8, and too many descriptors"
            );
            assert!(got.iter().all(|r| r.creds.is_some()));
            assert_eq!(copies_of(&x), 1 + 1 + got[2].fds.len());
            drop(got);
            let got = recv_batch(b.as_raw_fd(), &mut bufs, libc::MSG_DONTWAIT).unwrap();
            assert_eq!(got.len(), 1, "the queue ended after one");
            assert!(got[0].truncated && !got[0].fds.is_empty());
            drop(got);
            assert_eq!(copies_of(&x), 1);
            let e = recv_batch(b.as_raw_fd(), &mut bufs, libc::MSG_DONTWAIT).unwrap_err();
            assert_eq!(e.kind(), std::io::ErrorKind::WouldBlock);
        }
    }

    #[test]
    fn credentials_and_descriptors_arrive_together() {
        let (a, b) = seqpacket_pair();
        nix::sys::socket::setsockopt(&b, nix::sys::socket::sockopt::PassCred, &true).unwrap();
        let (x, _y) = UnixDatagram::pair().unwrap();
        send_fds(&a, &x, b"abc", 2, 1);
        let mut buf = [0u8; 3];
        let r = recv(b.as_raw_fd(), &mut buf, 0).unwrap();
        assert_eq!((r.bytes, &buf, r.truncated), (3, b"abc", false));
        assert_eq!(r.fds.len(), 2);
        let c = r.creds.expect("credentials");
        assert_eq!(c.pid as u32, std::process::id());
        // Nothing queued: a non-blocking receive says so.
        let e = recv(b.as_raw_fd(), &mut buf, libc::MSG_DONTWAIT).unwrap_err();
        assert_eq!(e.kind(), std::io::ErrorKind::WouldBlock);
    }
}
