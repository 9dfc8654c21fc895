//! The TCP socket beneath an upgraded connection.
//!
//! The program's descriptor stays a kernel TCP socket for the connection's
//! life. While the connection is on the fabric nothing is sent on it, so
//! anything that arrives was written behind azsdp's back (a raw system
//! call, an `exec`'d image without the shim): the driver looks for that,
//! and resets the connection rather than lose or reorder those bytes. When
//! the connection leaves the fabric (docs/protocol.md §8a) the driver writes
//! this side's resend to it, and the program uses it directly from then on.
//!
//! Which descriptor: the program's own, until the program closes it while
//! the connection still finishes in the background; then a duplicate the
//! connection keeps (made by [`TcpBeneath::detach`] before the program's
//! close goes through) and closes when it is done, so the kernel sends its
//! FIN after the data, as it would for TCP.
//!
//! `unsafe` here: system calls on that descriptor, made directly (libc's
//! `ioctl`, `send`, `fcntl`... are the shim's hooks in a preloaded
//! process, which would take this very connection's lock).

use std::os::fd::{AsRawFd, FromRawFd, OwnedFd, RawFd};
use std::time::{Duration, Instant};

use crate::sync::Lock;

/// Which descriptor names the socket now.
#[derive(Debug)]
enum Fd {
    /// The program's: not ours to close.
    Program(RawFd),
    /// Our duplicate, after the program closed its own.
    Own(OwnedFd),
    None,
}

/// The TCP socket beneath one upgraded connection.
#[derive(Debug)]
pub struct TcpBeneath {
    fd: Lock<Fd>,
}

impl TcpBeneath {
    /// The socket behind the program's descriptor `fd`.
    pub fn new(fd: RawFd) -> TcpBeneath {
        TcpBeneath {
            fd: Lock::new(Fd::Program(fd)),
        }
    }

    /// The program is about to close (or replace) its descriptor `fd`:
    /// if it is the one used here, use `other` (another descriptor of the
    /// program's for the same socket), else keep a duplicate (`keep`: the
    /// connection still needs the socket), or let go.
    pub fn detach(&self, fd: RawFd, other: Option<RawFd>, keep: bool) {
        let mut g = self.fd.lock();
        if !matches!(*g, Fd::Program(f) if f == fd) {
            return;
        }
        *g = match other {
            Some(o) => Fd::Program(o),
            None => Fd::None,
        };
        if other.is_none() && keep {
            // SAFETY: F_DUPFD_CLOEXEC on a descriptor the program still
            // holds (its close has not gone through yet).
            let d = unsafe { libc::syscall(libc::SYS_fcntl, fd, libc::F_DUPFD_CLOEXEC, 0) } as i32;
            if d >= 0 {
                // SAFETY: a descriptor the kernel just made for us.
                *g = Fd::Own(unsafe { OwnedFd::from_raw_fd(d) });
            }
        }
    }

    /// Stop using the socket (the connection is done with it).
    pub fn release(&self) {
        *self.fd.lock() = Fd::None;
    }

    fn raw(g: &Fd) -> Option<RawFd> {
        match g {
            Fd::Program(f) => Some(*f),
            Fd::Own(o) => Some(o.as_raw_fd()),
            Fd::None => None,
        }
    }

    /// Bytes waiting to be read on the socket (0 if it is gone or broken:
    /// nothing can be taken from it then).
    pub fn waiting(&self) -> usize {
        let g = self.fd.lock();
        let Some(fd) = Self::raw(&g) else {
            return 0;
        };
        let mut n: libc::c_int = 0;
        // SAFETY: FIONREAD writes one int, ours.
        let r = unsafe { libc::syscall(libc::SYS_ioctl, fd, libc::FIONREAD, &mut n) };
        if r < 0 { 0 } else { n.max(0) as usize }
    }

    /// Write all of each piece in order, then shut the sending side if
    /// `shutdown`; give up at `deadline` (a peer that never reads).
    pub fn write_all(
        &self,
        pieces: &[&[u8]],
        shutdown: bool,
        deadline: Instant,
    ) -> std::io::Result<()> {
        let g = self.fd.lock();
        let Some(fd) = Self::raw(&g) else {
            return Err(std::io::Error::from_raw_os_error(libc::EBADF));
        };
        for p in pieces {
            let mut done = 0usize;
            while done < p.len() {
                // SAFETY: sending from a slice we borrow; MSG_NOSIGNAL: a
                // peer gone is an error here, not a SIGPIPE for the program.
                let n = unsafe {
                    libc::syscall(
                        libc::SYS_sendto,
                        fd,
                        p[done..].as_ptr(),
                        p.len() - done,
                        libc::MSG_NOSIGNAL | libc::MSG_DONTWAIT,
                        std::ptr::null::<libc::sockaddr>(),
                        0,
                    )
                };
                if n > 0 {
                    done += n as usize;
                    continue;
                }
                let e = std::io::Error::last_os_error();
                match e.raw_os_error() {
                    Some(libc::EINTR) => {}
                    Some(libc::EAGAIN) => wait_writable(fd, deadline)?,
                    _ => return Err(e),
                }
            }
        }
        if shutdown {
            // SAFETY: shutdown(2) of the socket's sending side.
            unsafe { libc::syscall(libc::SYS_shutdown, fd, libc::SHUT_WR) };
        }
        Ok(())
    }

    /// The connection broke while moving onto the socket: what the peer
    /// reads from it would not be the stream. End it both ways.
    pub fn reset(&self) {
        let g = self.fd.lock();
        if let Some(fd) = Self::raw(&g) {
            // SAFETY: shutdown(2) of the socket, both directions.
            unsafe { libc::syscall(libc::SYS_shutdown, fd, libc::SHUT_RDWR) };
        }
    }
}

/// Wait until `fd` may be written, or fail at `deadline`.
fn wait_writable(fd: RawFd, deadline: Instant) -> std::io::Result<()> {
    let left = deadline.saturating_duration_since(Instant::now());
    if left.is_zero() {
        return Err(std::io::Error::from_raw_os_error(libc::ETIMEDOUT));
    }
    let mut p = libc::pollfd {
        fd,
        events: libc::POLLOUT,
        revents: 0,
    };
    let left = left.min(Duration::from_secs(1));
    let ts = libc::timespec {
        tv_sec: left.as_secs() as libc::time_t,
        tv_nsec: libc::c_long::from(left.subsec_nanos()),
    };
    // SAFETY: one pollfd and a timespec of ours, no signal mask.
    let r = unsafe {
        libc::syscall(
            libc::SYS_ppoll,
            &mut p,
            1,
            &ts,
            std::ptr::null::<libc::sigset_t>(),
            0,
        )
    };
    if r < 0 && std::io::Error::last_os_error().raw_os_error() != Some(libc::EINTR) {
        return Err(std::io::Error::last_os_error());
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::io::Read;
    use std::os::unix::net::UnixStream;

    #[test]
    fn waits_writes_and_keeps_a_duplicate_when_the_program_closes() {
        let (a, mut b) = UnixStream::pair().unwrap();
        let t = TcpBeneath::new(a.as_raw_fd());
        assert_eq!(t.waiting(), 0);
        use std::io::Write;
        (&b).write_all(b"stray").unwrap();
        assert_eq!(t.waiting(), 5);
        // The program closes its descriptor: ours goes on.
        t.detach(a.as_raw_fd(), None, true);
        drop(a);
        let far = Instant::now() + Duration::from_secs(5);
        t.write_all(&[b"hello ", b"world"], true, far).unwrap();
        let mut got = String::new();
        b.read_to_string(&mut got).unwrap();
        assert_eq!(got, "hello world");
        t.release();
        assert!(t.write_all(&[b"x"], false, far).is_err());
    }
}
