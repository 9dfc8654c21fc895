//! Readiness: poll, ppoll, select, pselect and epoll, over upgraded and
//! plain descriptors alike.

use std::time::Instant;

use libc::{c_int, epoll_event, fd_set, nfds_t, pollfd, sigset_t, timespec, timeval};

use super::data::efail;
use super::{guard, hook};
use crate::sock::{EpollReg, Role};
use crate::{epoll, fdtable, ready, real};

#[unsafe(no_mangle)]
pub unsafe extern "C" fn poll(fds: *mut pollfd, n: nfds_t, timeout: c_int) -> c_int {
    hook(|| {
        // SAFETY: the program's array of n entries.
        let r = guard(Some(-1), || unsafe {
            ready::poll(
                fds,
                n as usize,
                ready::ms_timeout(timeout),
                std::ptr::null(),
            )
        });
        if let Some(r) = r {
            return r;
        }
        // SAFETY: libc's poll.
        unsafe { real::poll(fds, n, timeout) }
    })
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn ppoll(
    fds: *mut pollfd,
    n: nfds_t,
    ts: *const timespec,
    mask: *const sigset_t,
) -> c_int {
    hook(|| {
        let timeout = if crate::pending::any() || azsdp::process::active() {
            match ready::ts_timeout(ts) {
                Ok(t) => t,
                Err(e) => return fail_with(e),
            }
        } else {
            None
        };
        // SAFETY: the program's array is reached only through the kernel.
        let r = guard(Some(-1), || unsafe {
            ready::poll(fds, n as usize, timeout, mask)
        });
        if let Some(r) = r {
            return r;
        }
        // SAFETY: libc's ppoll.
        unsafe { real::ppoll(fds, n, ts, mask) }
    })
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn select(
    n: c_int,
    r: *mut fd_set,
    w: *mut fd_set,
    e: *mut fd_set,
    tv: *mut timeval,
) -> c_int {
    hook(|| {
        let ptrs = [r, w, e];
        let sets = match upgraded_sets(n, ptrs) {
            Ok(Some(sets)) => sets,
            // SAFETY: libc's select.
            Ok(None) => return unsafe { real::select(n, r, w, e, tv) },
            Err(e) => return fail_with(e),
        };
        let timeout = match ready::tv_timeout(tv) {
            Ok(t) => t,
            Err(e) => return fail_with(e),
        };
        let t0 = Instant::now();
        let r = guard(-1, || ready::select(&sets, ptrs, timeout, std::ptr::null()));
        // Linux's select leaves the time not slept in the timeval.
        if let Some(t) = timeout {
            let _keep = real::KeepErrno::new();
            let left = t.saturating_sub(t0.elapsed());
            let v = timeval {
                tv_sec: left.as_secs() as libc::time_t,
                tv_usec: left.subsec_micros() as libc::suseconds_t,
            };
            let _ = crate::user_mem::write(tv, &[v]);
        }
        r
    })
}

/// The program's fd_sets if they involve an upgraded socket (`None`: let
/// the kernel do it all), or `select`'s error for them.
fn upgraded_sets(n: c_int, ptrs: [*mut fd_set; 3]) -> Result<Option<ready::Sets>, c_int> {
    if !(crate::pending::any() || azsdp::process::active()) {
        return Ok(None);
    }
    let sets = ready::Sets::read(n, ptrs)?;
    Ok(sets.involve_upgraded().then_some(sets))
}

/// Fail an interposed call with `e`.
fn fail_with(e: c_int) -> c_int {
    real::set_errno(e);
    -1
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn pselect(
    n: c_int,
    r: *mut fd_set,
    w: *mut fd_set,
    e: *mut fd_set,
    ts: *const timespec,
    mask: *const sigset_t,
) -> c_int {
    hook(|| {
        let ptrs = [r, w, e];
        let sets = match upgraded_sets(n, ptrs) {
            Ok(Some(sets)) => sets,
            // SAFETY: libc's pselect.
            Ok(None) => return unsafe { real::pselect(n, r, w, e, ts, mask) },
            Err(e) => return fail_with(e),
        };
        let timeout = match ready::ts_timeout(ts) {
            Ok(t) => t,
            Err(e) => return fail_with(e),
        };
        guard(-1, || ready::select(&sets, ptrs, timeout, mask))
    })
}

/// Passed through: the shim's part of a set is made when an upgraded
/// socket first joins it (`epoll_ctl`), and dropped when it is closed.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn epoll_create(size: c_int) -> c_int {
    hook(|| {
        // SAFETY: libc's epoll_create.
        unsafe { real::epoll_create(size) }
    })
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn epoll_create1(flags: c_int) -> c_int {
    hook(|| {
        // SAFETY: libc's epoll_create1.
        unsafe { real::epoll_create1(flags) }
    })
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn epoll_ctl(
    epfd: c_int,
    op: c_int,
    fd: c_int,
    ev: *mut epoll_event,
) -> c_int {
    hook(|| {
        let Some(sock) = fdtable::get(fd) else {
            // SAFETY: libc's epoll_ctl.
            return unsafe { real::epoll_ctl(epfd, op, fd, ev) };
        };
        guard(-1, || {
            if sock.conn().is_some() {
                // The event through the kernel (none needed to delete).
                let event = if op == libc::EPOLL_CTL_DEL {
                    None
                } else {
                    match crate::user_mem::read(ev.cast_const(), 1) {
                        Ok(v) => Some(v[0]),
                        Err(e) => return efail(e) as c_int,
                    }
                };
                return epoll::ctl(epfd, op, fd, sock, event);
            }
            // SAFETY: libc's epoll_ctl.
            let r = unsafe { real::epoll_ctl(epfd, op, fd, ev) };
            if r == 0 && matches!(sock.role(), Role::Fresh | Role::Pairing(_)) {
                // Remember it: if the socket is upgraded, it moves to our
                // part. (The kernel took the event: it is readable.)
                let event = if op == libc::EPOLL_CTL_DEL {
                    None
                } else {
                    crate::user_mem::read(ev.cast_const(), 1).ok().map(|v| v[0])
                };
                let mut regs = sock.kernel_epolls.lock();
                regs.retain(|x| !(x.epfd == epfd && x.fd == fd));
                if let (true, Some(e)) = (op != libc::EPOLL_CTL_DEL, event) {
                    regs.push(EpollReg {
                        epfd,
                        fd,
                        events: e.events,
                        data: e.u64,
                    });
                }
            }
            r
        })
    })
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn epoll_wait(
    epfd: c_int,
    ev: *mut epoll_event,
    max: c_int,
    timeout: c_int,
) -> c_int {
    hook(|| {
        // SAFETY: forwarded.
        unsafe { epoll_pwait(epfd, ev, max, timeout, std::ptr::null()) }
    })
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn epoll_pwait(
    epfd: c_int,
    ev: *mut epoll_event,
    max: c_int,
    timeout: c_int,
    mask: *const sigset_t,
) -> c_int {
    hook(|| {
        // SAFETY: the program's array of max entries, forwarded, and
        // libc's epoll_pwait with the program's arguments.
        unsafe {
            epoll_waiting(epfd, ev, max, ready::ms_timeout(timeout), mask, |left| {
                let ms = left.map_or(-1, ready::ms_rounded_up);
                // (libc's epoll_pwait with the program's arguments.)
                real::epoll_pwait(epfd, ev, max, ms, mask)
            })
        }
    })
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn epoll_pwait2(
    epfd: c_int,
    ev: *mut epoll_event,
    max: c_int,
    ts: *const timespec,
    mask: *const sigset_t,
) -> c_int {
    hook(|| {
        let timeout = match ready::ts_timeout(ts) {
            Ok(t) => t,
            Err(e) => return fail_with(e),
        };
        // SAFETY: the program's array of max entries, forwarded, and
        // libc's epoll_pwait2 with the program's arguments.
        unsafe {
            epoll_waiting(epfd, ev, max, timeout, mask, |left| {
                let t = left.map(ready::timespec_of);
                let tp = t
                    .as_ref()
                    .map_or(std::ptr::null(), |t| t as *const timespec);
                // (libc's epoll_pwait2 with the program's arguments and our
                // own timeout.)
                real::epoll_pwait2(epfd, ev, max, tp, mask)
            })
        }
    })
}

/// An `epoll_pwait`-style wait for `timeout` (`None`: no end): in the
/// shim's part of the set if it holds one, else in the kernel's
/// (`kernel`, given the time left), dropping any entry of ours the kernel
/// reports.
///
/// # Safety
/// `ev` must be the program's array of `max` entries.
unsafe fn epoll_waiting(
    epfd: c_int,
    ev: *mut epoll_event,
    max: c_int,
    timeout: Option<std::time::Duration>,
    mask: *const sigset_t,
    mut kernel: impl FnMut(Option<std::time::Duration>) -> c_int,
) -> c_int {
    // Counted, so that a set made meanwhile wakes this thread if it goes to
    // the kernel (see `epoll::KernelWait`).
    let _counted = epoll::KernelWait::begin();
    let deadline = timeout.map(|t| Instant::now() + t);
    let left = || deadline.map(|d| d.saturating_duration_since(Instant::now()));
    loop {
        if epoll::has_sets() {
            // SAFETY: the program's array of max entries.
            let r = guard(Some(-1), || unsafe {
                epoll::wait(epfd, ev, max, left(), mask)
            });
            if let Some(r) = r {
                return r;
            }
        }
        let r = kernel(left());
        if r <= 0 || !epoll::ever_had_sets() {
            return r;
        }
        // A socket of this set was upgraded while we slept in the kernel (a
        // pair that completed), or a set was retired: a wake-up of ours,
        // not the program's.
        // SAFETY: the program's array, as the kernel filled it.
        match unsafe { epoll::drop_ours(ev, r) } {
            0 => continue,
            n => return n,
        }
    }
}
