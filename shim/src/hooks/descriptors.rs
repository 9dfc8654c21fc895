//! Descriptors and options: fcntl, ioctl, dup, socket options and names.

use std::sync::Arc;
use std::sync::atomic::Ordering;

use azsdp::conn::CallError;
use libc::{c_int, c_ulong, c_void, sockaddr, socklen_t, timeval};

use super::sockets::release;
use super::{guard, hook, quietly};
use crate::sock::Sock;
use crate::{fdtable, net, real};

/// `newfd` now names `sock` too.
fn dup_into(newfd: c_int, sock: Arc<Sock>) {
    sock.fds.fetch_add(1, Ordering::SeqCst);
    if let Some(old) = fdtable::insert(newfd, sock) {
        release(newfd, old);
    }
}

/// `fd` was closed implicitly (dup2 over it).
fn replaced(fd: c_int) {
    if let Some(old) = fdtable::remove(fd) {
        release(fd, old);
    }
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn fcntl(fd: c_int, cmd: c_int, arg: usize) -> c_int {
    hook(|| {
        // SAFETY: libc's fcntl with the program's argument word.
        let r = unsafe { real::fcntl(fd, cmd, arg) };
        fcntl_done(fd, cmd, arg, r)
    })
}

/// What programs built with `_FILE_OFFSET_BITS=64` call (python, redis).
#[unsafe(no_mangle)]
pub unsafe extern "C" fn fcntl64(fd: c_int, cmd: c_int, arg: usize) -> c_int {
    hook(|| {
        // SAFETY: libc's fcntl64 with the program's argument word.
        let r = unsafe { real::fcntl64(fd, cmd, arg) };
        fcntl_done(fd, cmd, arg, r)
    })
}

/// Follow what a successful `fcntl` did to a tracked socket.
fn fcntl_done(fd: c_int, cmd: c_int, arg: usize, r: c_int) -> c_int {
    if r >= 0
        && let Some(sock) = fdtable::get(fd)
    {
        guard((), || match cmd {
            libc::F_SETFL => sock
                .nonblocking
                .store(arg as c_int & libc::O_NONBLOCK != 0, Ordering::Relaxed),
            libc::F_DUPFD | libc::F_DUPFD_CLOEXEC => dup_into(r, sock),
            _ => {}
        });
    }
    r
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn ioctl(fd: c_int, req: c_ulong, arg: usize) -> c_int {
    hook(|| {
        if let Some(sock) = fdtable::get(fd) {
            if req == libc::FIONREAD as c_ulong
                && let Some(c) = sock.conn()
                // (While the peer's TCP part is read, the socket's count.)
                && c.joining_now().is_none_or(|j| !j.rx_on_socket(&c))
            {
                let n = guard(0, || c.driver.readable_bytes());
                let n = n.min(c_int::MAX as u64) as c_int;
                return match crate::user_mem::write(arg as *mut c_int, &[n]) {
                    Ok(()) => 0,
                    Err(e) => {
                        real::set_errno(e);
                        -1
                    }
                };
            }
            // SAFETY: libc's ioctl.
            let r = unsafe { real::ioctl(fd, req, arg) };
            if r == 0 && req == libc::FIONBIO as c_ulong && arg != 0 {
                // SAFETY: FIONBIO's argument is the program's int.
                let on = unsafe { *(arg as *const c_int) } != 0;
                sock.nonblocking.store(on, Ordering::Relaxed);
            }
            return r;
        }
        // SAFETY: libc's ioctl.
        unsafe { real::ioctl(fd, req, arg) }
    })
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn dup(fd: c_int) -> c_int {
    hook(|| {
        // SAFETY: libc's dup.
        let r = unsafe { real::dup(fd) };
        if r >= 0
            && let Some(sock) = fdtable::get(fd)
        {
            guard((), || dup_into(r, sock));
        }
        r
    })
}

unsafe fn dup2_impl(fd: c_int, fd2: c_int, flags: Option<c_int>) -> c_int {
    // SAFETY: libc's dup2/dup3.
    let r = unsafe {
        match flags {
            None => real::dup2(fd, fd2),
            Some(f) => real::dup3(fd, fd2, f),
        }
    };
    if r >= 0 && fd != fd2 {
        guard((), || {
            replaced(fd2);
            if let Some(sock) = fdtable::get(fd) {
                dup_into(fd2, sock);
            }
        });
    }
    r
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn dup2(fd: c_int, fd2: c_int) -> c_int {
    hook(|| {
        // SAFETY: forwarded.
        unsafe { dup2_impl(fd, fd2, None) }
    })
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn dup3(fd: c_int, fd2: c_int, flags: c_int) -> c_int {
    hook(|| {
        // SAFETY: forwarded.
        unsafe { dup2_impl(fd, fd2, Some(flags)) }
    })
}

/// The program closes every descriptor in `first..=last` at once
/// (`close_range`, `closefrom`): forget what the shim kept for each, as
/// `close` would. Otherwise a closed number would still name its
/// connection here, and whatever the kernel opens next on that number (a
/// file, a pipe) would be read and written as the connection.
fn closing_range(first: libc::c_uint, last: libc::c_uint) {
    let (Ok(first), last) = (
        c_int::try_from(first),
        c_int::try_from(last).unwrap_or(c_int::MAX),
    ) else {
        return;
    };
    for (fd, _) in fdtable::entries() {
        if (first..=last).contains(&fd)
            && let Some(sock) = fdtable::remove(fd)
        {
            release(fd, sock);
        }
    }
    crate::epoll::forget_sets_in(first..=last);
}

/// `close_range(2)` (glibc 2.34): what glibc's `closefrom`, Python's
/// subprocess and daemons that close what they inherited call. With
/// `CLOSE_RANGE_CLOEXEC` it closes nothing (exec checks each descriptor's
/// flag when it comes).
#[unsafe(no_mangle)]
pub unsafe extern "C" fn close_range(
    first: libc::c_uint,
    last: libc::c_uint,
    flags: c_int,
) -> c_int {
    hook(|| {
        if flags as libc::c_uint & libc::CLOSE_RANGE_CLOEXEC == 0 && first <= last {
            guard((), || closing_range(first, last));
        }
        // SAFETY: the system call glibc's wrapper makes, with the program's
        // arguments (glibc before 2.34 has no wrapper to forward to).
        unsafe { libc::syscall(libc::SYS_close_range, first, last, flags) as c_int }
    })
}

/// `closefrom(3)` (glibc 2.34): glibc calls its own `close_range`
/// inside, which no interposition sees.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn closefrom(low: c_int) {
    if let Ok(low) = libc::c_uint::try_from(low) {
        quietly(|| closing_range(low, libc::c_uint::MAX));
    }
    // SAFETY: libc's closefrom.
    unsafe { real::closefrom(low) }
}

fn timeval_duration(val: *const c_void, len: socklen_t) -> Option<std::time::Duration> {
    if val.is_null() || (len as usize) < std::mem::size_of::<timeval>() {
        return None;
    }
    // SAFETY: a timeval of the program's, length checked.
    let t = unsafe { std::ptr::read_unaligned(val.cast::<timeval>()) };
    let d = std::time::Duration::new(
        t.tv_sec.max(0) as u64,
        (t.tv_usec.clamp(0, 999_999) * 1000) as u32,
    );
    (!d.is_zero()).then_some(d)
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn setsockopt(
    fd: c_int,
    level: c_int,
    name: c_int,
    val: *const c_void,
    len: socklen_t,
) -> c_int {
    hook(|| {
        // The kernel socket takes every option (buffer sizes, TCP_NODELAY,
        // keepalive...): harmless for an upgraded one, and right if it stays TCP.
        // SAFETY: libc's setsockopt.
        let r = unsafe { real::setsockopt(fd, level, name, val, len) };
        if r == 0
            && level == libc::SOL_SOCKET
            && let Some(sock) = fdtable::get(fd)
        {
            guard((), || {
                let mut o = sock.opts.lock();
                match name {
                    libc::SO_RCVTIMEO => o.rcvtimeo = timeval_duration(val, len),
                    libc::SO_SNDTIMEO => o.sndtimeo = timeval_duration(val, len),
                    libc::SO_LINGER if (len as usize) >= std::mem::size_of::<libc::linger>() => {
                        // SAFETY: a linger of the program's, length checked.
                        let l = unsafe { std::ptr::read_unaligned(val.cast::<libc::linger>()) };
                        o.linger_abort = l.l_onoff != 0 && l.l_linger == 0;
                    }
                    _ => {}
                }
            });
        }
        r
    })
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn getsockopt(
    fd: c_int,
    level: c_int,
    name: c_int,
    val: *mut c_void,
    len: *mut socklen_t,
) -> c_int {
    hook(|| {
        if level == libc::SOL_SOCKET
            && name == libc::SO_ERROR
            && let Some(c) = fdtable::get(fd).and_then(|s| s.conn())
        {
            // The pending error, once, as the kernel's.
            let err = match c.driver.take_error() {
                Some(CallError::TimedOut) => libc::ETIMEDOUT,
                Some(_) => libc::ECONNRESET,
                // A connection still joining: the socket's own (a reset
                // of its TCP part), taken from it as the kernel does.
                None if c.joining_now().is_some() => real::so_error(fd),
                None => 0,
            };
            // As the kernel: at most `*len` bytes of the int, and the
            // length it wrote.
            let put = || -> Result<(), c_int> {
                let room = crate::user_mem::read(len.cast_const(), 1)?[0];
                if (room as i32) < 0 {
                    return Err(libc::EINVAL);
                }
                let n = (room as usize).min(std::mem::size_of::<c_int>());
                crate::user_mem::write(val.cast::<u8>(), &err.to_ne_bytes()[..n])?;
                crate::user_mem::write(len, &[n as socklen_t])
            };
            return match put() {
                Ok(()) => 0,
                Err(e) => {
                    real::set_errno(e);
                    -1
                }
            };
        }
        // SAFETY: libc's getsockopt.
        unsafe { real::getsockopt(fd, level, name, val, len) }
    })
}

/// An upgraded socket's name, as paired (the kernel's own, which the
/// connected socket beneath still has).
fn upgraded_name(fd: c_int, peer: bool, addr: *mut sockaddr, len: *mut socklen_t) -> Option<c_int> {
    let c = fdtable::get(fd)?.conn()?;
    if addr.is_null() || len.is_null() {
        real::set_errno(libc::EFAULT);
        return Some(-1);
    }
    let (st, sl) = net::to_storage(if peer { c.peer } else { c.local });
    if let Err(e) = net::copy_out(&st, sl, addr, len) {
        real::set_errno(e);
        return Some(-1);
    }
    Some(0)
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn getsockname(fd: c_int, addr: *mut sockaddr, len: *mut socklen_t) -> c_int {
    hook(|| {
        if let Some(r) = guard(Some(-1), || upgraded_name(fd, false, addr, len)) {
            return r;
        }
        // SAFETY: libc's getsockname.
        unsafe { real::getsockname(fd, addr, len) }
    })
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn getpeername(fd: c_int, addr: *mut sockaddr, len: *mut socklen_t) -> c_int {
    hook(|| {
        if let Some(r) = guard(Some(-1), || upgraded_name(fd, true, addr, len)) {
            return r;
        }
        // SAFETY: libc's getpeername.
        unsafe { real::getpeername(fd, addr, len) }
    })
}
