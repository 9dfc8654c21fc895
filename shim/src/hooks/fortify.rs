//! The `_FORTIFY_SOURCE` variants (`__read_chk`, `__poll_chk`, ...): the
//! buffer-size check glibc would make, then the plain hook.

use libc::{
    c_int, c_void, nfds_t, pollfd, sigset_t, size_t, sockaddr, socklen_t, ssize_t, timespec,
};

use super::data::{read, recv, recvfrom};
use super::hook;
use super::readiness::{poll, ppoll};
use crate::{fdtable, real};

// Programs built with _FORTIFY_SOURCE call these when the buffer's size is
// known; libc checks `len <= buflen` and aborts otherwise. Upgraded sockets
// get the same check, then the shim's call.

/// The fortify check: a buffer overflow ends the program, as libc's does.
fn chk(len: usize, buflen: usize) {
    if len > buflen {
        crate::log::error!("buffer overflow detected (len {len} > {buflen})");
        // SAFETY: abort(3), as __chk_fail does.
        unsafe { libc::abort() };
    }
}

pub(super) fn upgraded(fd: c_int) -> bool {
    fdtable::get(fd)
        .is_some_and(|s| s.conn().is_some() || matches!(s.role(), crate::sock::Role::Pairing(_)))
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn __read_chk(
    fd: c_int,
    buf: *mut c_void,
    len: size_t,
    buflen: size_t,
) -> ssize_t {
    hook(|| {
        if !upgraded(fd) {
            // SAFETY: libc's __read_chk with the program's arguments.
            return unsafe { real::__read_chk(fd, buf, len, buflen) };
        }
        chk(len, buflen);
        // SAFETY: the shim's read with the program's arguments.
        unsafe { read(fd, buf, len) }
    })
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn __recv_chk(
    fd: c_int,
    buf: *mut c_void,
    len: size_t,
    buflen: size_t,
    flags: c_int,
) -> ssize_t {
    hook(|| {
        if !upgraded(fd) {
            // SAFETY: libc's __recv_chk with the program's arguments.
            return unsafe { real::__recv_chk(fd, buf, len, buflen, flags) };
        }
        chk(len, buflen);
        // SAFETY: the shim's recv with the program's arguments.
        unsafe { recv(fd, buf, len, flags) }
    })
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn __recvfrom_chk(
    fd: c_int,
    buf: *mut c_void,
    len: size_t,
    buflen: size_t,
    flags: c_int,
    addr: *mut sockaddr,
    alen: *mut socklen_t,
) -> ssize_t {
    hook(|| {
        if !upgraded(fd) {
            // SAFETY: libc's __recvfrom_chk with the program's arguments.
            return unsafe { real::__recvfrom_chk(fd, buf, len, buflen, flags, addr, alen) };
        }
        chk(len, buflen);
        // SAFETY: the shim's recvfrom with the program's arguments.
        unsafe { recvfrom(fd, buf, len, flags, addr, alen) }
    })
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn __poll_chk(
    fds: *mut pollfd,
    n: nfds_t,
    timeout: c_int,
    fdslen: size_t,
) -> c_int {
    hook(|| {
        chk(n as usize * std::mem::size_of::<pollfd>(), fdslen);
        // SAFETY: the shim's poll with the program's arguments.
        unsafe { poll(fds, n, timeout) }
    })
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn __ppoll_chk(
    fds: *mut pollfd,
    n: nfds_t,
    ts: *const timespec,
    mask: *const sigset_t,
    fdslen: size_t,
) -> c_int {
    hook(|| {
        chk(n as usize * std::mem::size_of::<pollfd>(), fdslen);
        // SAFETY: the shim's ppoll with the program's arguments.
        unsafe { ppoll(fds, n, ts, mask) }
    })
}
