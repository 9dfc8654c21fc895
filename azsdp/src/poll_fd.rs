//! Waiting on one descriptor of our own, by system call.
//!
//! Inside the preloaded shim, `libc::poll` named from this crate resolves
//! to the shim's own `poll` (the process's first definition), which reads
//! the array through the kernel and looks the descriptor up: four system
//! calls where one will do, and a pidfd check under a connection's lock
//! cost every request that. Our own descriptors (pidfds, userfaultfds,
//! pipes, completion channels) never need the hook.
//!
//! The same goes for our own epoll sets, which also need a timeout finer
//! than `epoll_wait`'s milliseconds: a look due in 200 us, rounded up to
//! a millisecond, left a reply waiting that long.
//!
//! `unsafe` here: the raw `ppoll(2)`, `epoll_pwait2(2)` and
//! `epoll_pwait(2)` calls.

use std::os::fd::{AsRawFd, BorrowedFd};
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Duration;

/// Poll `fd` for `events`, waiting at most `timeout` (`None`: for ever).
/// Returns the events that came (0 on timeout, EINTR or error).
pub fn poll_fd(fd: BorrowedFd<'_>, events: i16, timeout: Option<Duration>) -> i16 {
    let mut p = libc::pollfd {
        fd: fd.as_raw_fd(),
        events,
        revents: 0,
    };
    let ts = timeout.map(timespec);
    // SAFETY: ppoll on one pollfd on our stack, a timespec that outlives
    // the call (or null), and no signal mask.
    let n = unsafe {
        libc::syscall(
            libc::SYS_ppoll,
            &mut p as *mut libc::pollfd,
            1 as libc::nfds_t,
            or_null(&ts),
            std::ptr::null::<libc::sigset_t>(),
            0usize,
        )
    };
    if n > 0 { p.revents } else { 0 }
}

fn timespec(t: Duration) -> libc::timespec {
    libc::timespec {
        tv_sec: t.as_secs().min(i64::MAX as u64) as libc::time_t,
        tv_nsec: libc::c_long::from(t.subsec_nanos() as i32),
    }
}

/// A kernel timeout argument: `ts`, or null for none (for ever).
fn or_null(ts: &Option<libc::timespec>) -> *const libc::timespec {
    ts.as_ref()
        .map_or(std::ptr::null(), |t| t as *const libc::timespec)
}

/// The kernel refused `epoll_pwait2` (before Linux 5.11, or a seccomp
/// filter): waits round up to milliseconds, as they do in a process that
/// a filter might kill for it ([`crate::sandbox::filtered`]).
static NO_PWAIT2: AtomicBool = AtomicBool::new(false);

/// Wait for our own epoll set `epfd` at most `timeout` (`None`: for
/// ever), to the microsecond where the kernel can. Returns the number of
/// events written to `events` (0 on timeout, EINTR or error).
pub fn epoll_wait_own(
    epfd: BorrowedFd<'_>,
    events: &mut [libc::epoll_event],
    timeout: Option<Duration>,
) -> usize {
    let max = events.len().min(i32::MAX as usize) as libc::c_int;
    // (A filter that predates the call might kill for it: not tried.)
    if !NO_PWAIT2.load(Ordering::Relaxed) && !crate::sandbox::filtered() {
        let ts = timeout.map(timespec);
        // SAFETY: `events` is ours for the kernel to fill, at most `max`
        // entries; a timespec that outlives the call (or null), and no
        // signal mask.
        let n = unsafe {
            libc::syscall(
                libc::SYS_epoll_pwait2,
                epfd.as_raw_fd(),
                events.as_mut_ptr(),
                max,
                or_null(&ts),
                std::ptr::null::<libc::sigset_t>(),
                0usize,
            )
        };
        if n >= 0 {
            return n as usize;
        }
        let e = std::io::Error::last_os_error().raw_os_error();
        if !matches!(e, Some(libc::ENOSYS | libc::EPERM)) {
            return 0;
        }
        NO_PWAIT2.store(true, Ordering::Relaxed);
    }
    // Round up: waking early would spin.
    let ms = timeout.map_or(-1, |t| {
        t.as_micros().div_ceil(1000).min(i32::MAX as u128) as libc::c_int
    });
    // SAFETY: as above, with a timeout in milliseconds.
    let n = unsafe {
        libc::syscall(
            libc::SYS_epoll_pwait,
            epfd.as_raw_fd(),
            events.as_mut_ptr(),
            max,
            ms,
            std::ptr::null::<libc::sigset_t>(),
            0usize,
        )
    };
    usize::try_from(n).unwrap_or(0)
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::os::fd::AsFd;

    #[test]
    fn a_pipe_polls_readable_once_written_and_not_before() {
        let (r, w) = nix::unistd::pipe().unwrap();
        assert_eq!(poll_fd(r.as_fd(), libc::POLLIN, Some(Duration::ZERO)), 0);
        nix::unistd::write(&w, b"x").unwrap();
        assert_eq!(
            poll_fd(r.as_fd(), libc::POLLIN, Some(Duration::from_secs(1))) & libc::POLLIN,
            libc::POLLIN
        );
        drop(w);
        let got = poll_fd(r.as_fd(), libc::POLLIN, None);
        assert_ne!(got & (libc::POLLIN | libc::POLLHUP), 0);
    }

    #[test]
    fn an_epoll_wait_times_out_below_a_millisecond_and_sees_what_comes() {
        use std::os::fd::{FromRawFd, OwnedFd};
        // SAFETY: a new epoll set, owned at once.
        let ep = unsafe { OwnedFd::from_raw_fd(libc::epoll_create1(libc::EPOLL_CLOEXEC)) };
        let (r, w) = nix::unistd::pipe().unwrap();
        let mut ev = libc::epoll_event {
            events: libc::EPOLLIN as u32,
            u64: 7,
        };
        // SAFETY: our set, our pipe, an event on our stack.
        let added =
            unsafe { libc::epoll_ctl(ep.as_raw_fd(), libc::EPOLL_CTL_ADD, r.as_raw_fd(), &mut ev) };
        assert_eq!(added, 0);
        let mut got = [libc::epoll_event { events: 0, u64: 0 }; 4];
        // The shortest of many waits: a wait rounded up to a millisecond
        // is never this short (however busy the host).
        let shortest = (0..50)
            .map(|_| {
                let t = std::time::Instant::now();
                let n = epoll_wait_own(ep.as_fd(), &mut got, Some(Duration::from_micros(100)));
                assert_eq!(n, 0);
                t.elapsed()
            })
            .min()
            .unwrap();
        assert!(shortest >= Duration::from_micros(100), "{shortest:?}");
        // (A filter that predates the call might kill for it: not tried.)
        if !NO_PWAIT2.load(Ordering::Relaxed) && !crate::sandbox::filtered() {
            assert!(shortest < Duration::from_micros(900), "{shortest:?}");
        }
        nix::unistd::write(&w, b"x").unwrap();
        assert_eq!(epoll_wait_own(ep.as_fd(), &mut got, None), 1);
        let tag = got[0].u64;
        assert_eq!(tag, 7);
    }
}
