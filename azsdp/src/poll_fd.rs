//! Waiting on one descriptor of our own, by system call.
//!
//! Inside the preloaded shim, `libc::poll` named from this crate resolves
//! to the shim's own `poll` (the process's first definition), which reads
//! the array through the kernel and looks the descriptor up: four system
//! calls where one will do, and a pidfd check under a connection's lock
//! cost every request that. Our own descriptors (pidfds, userfaultfds,
//! pipes, completion channels) never need the hook.
//!
//! `unsafe` here: the raw `ppoll(2)` call.

use std::os::fd::{AsRawFd, BorrowedFd};
use std::time::Duration;

/// Poll `fd` for `events`, waiting at most `timeout` (`None`: for ever).
/// Returns the events that came (0 on timeout, EINTR or error).
pub fn poll_fd(fd: BorrowedFd<'_>, events: i16, timeout: Option<Duration>) -> i16 {
    let mut p = libc::pollfd {
        fd: fd.as_raw_fd(),
        events,
        revents: 0,
    };
    let ts = timeout.map(|t| libc::timespec {
        tv_sec: t.as_secs().min(i64::MAX as u64) as libc::time_t,
        tv_nsec: libc::c_long::from(t.subsec_nanos() as i32),
    });
    let tsp = ts
        .as_ref()
        .map_or(std::ptr::null(), |t| t as *const libc::timespec);
    // SAFETY: ppoll on one pollfd on our stack, a timespec that outlives
    // the call (or null), and no signal mask.
    let n = unsafe {
        libc::syscall(
            libc::SYS_ppoll,
            &mut p as *mut libc::pollfd,
            1 as libc::nfds_t,
            tsp,
            std::ptr::null::<libc::sigset_t>(),
            0usize,
        )
    };
    if n > 0 { p.revents } else { 0 }
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
}
