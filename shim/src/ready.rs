//! Readiness of upgraded sockets in `poll`, `ppoll`, `select`, `pselect`.
//!
//! An upgraded socket's kernel TCP socket is idle: its readiness is the
//! engine's. A thread that waits on a mix of upgraded and other
//! descriptors sleeps in the kernel on the others plus an eventfd of its
//! own ([`Wakeup`]); engines call [`notify`] whenever they took something
//! in, which writes the eventfds of the threads that sleep. A thread
//! registers before it looks at the engines, so a notification between the
//! look and the sleep is not lost.
//!
//! `unsafe` here: the program's `pollfd` arrays and fd_sets.

use azsdp::sync::Lock;
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd};
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::time::{Duration, Instant};

use azsdp::conn::Readiness;
use libc::{POLLERR, POLLHUP, POLLIN, POLLOUT, POLLRDHUP, c_int, c_short, pollfd};

use crate::real;

/// A sleeping thread's (or epoll set's) eventfd.
pub struct Wakeup {
    efd: OwnedFd,
    asleep: AtomicBool,
}

impl Wakeup {
    pub fn new() -> Option<Arc<Wakeup>> {
        // SAFETY: eventfd(2); we own the result.
        let fd = unsafe { libc::eventfd(0, libc::EFD_NONBLOCK | libc::EFD_CLOEXEC) };
        if fd < 0 {
            return None;
        }
        // SAFETY: a fresh descriptor, owned from here.
        let efd = unsafe { OwnedFd::from_raw_fd(fd) };
        let w = Arc::new(Wakeup {
            efd,
            asleep: AtomicBool::new(false),
        });
        SLEEPERS.lock().push(Arc::downgrade(&w));
        Some(w)
    }

    pub fn fd(&self) -> c_int {
        self.efd.as_raw_fd()
    }

    /// About to look, then sleep: notifications from now on wake us.
    pub fn arm(&self) {
        if !self.asleep.swap(true, Ordering::SeqCst) {
            ARMED.fetch_add(1, Ordering::SeqCst);
        }
        // Only progress threads see data arrive while we sleep: any on
        // standby (the application was just calling) go back to watching.
        azsdp::driver::standby::end();
    }

    /// Awake again: drop what notifications came.
    pub fn disarm(&self) {
        if self.asleep.swap(false, Ordering::SeqCst) {
            ARMED.fetch_sub(1, Ordering::SeqCst);
        }
        let mut v = 0u64;
        // SAFETY: read of 8 bytes into our own u64 (non-blocking eventfd).
        unsafe { real::read(self.fd(), (&raw mut v).cast(), 8) };
    }

    fn ring(&self) {
        if self.asleep.load(Ordering::SeqCst) {
            let one = 1u64;
            // SAFETY: write of 8 bytes from our own u64.
            unsafe { real::write(self.fd(), (&raw const one).cast(), 8) };
        }
    }
}

static SLEEPERS: Lock<Vec<std::sync::Weak<Wakeup>>> = Lock::new(Vec::new());
/// Wakeups armed now. Engines notify after every turn that took something
/// in; with no one asleep that is one load, not a lock. (A sleeper counts
/// itself before it looks at the engines, so it sees any change whose
/// notification found the count at zero.)
static ARMED: AtomicUsize = AtomicUsize::new(0);

/// Readiness of some upgraded socket may have changed.
pub fn notify() {
    if ARMED.load(Ordering::SeqCst) == 0 {
        return;
    }
    let mut v = SLEEPERS.lock();
    v.retain(|w| match w.upgrade() {
        Some(w) => {
            w.ring();
            true
        }
        None => false,
    });
}

thread_local! {
    static MINE: std::cell::OnceCell<Option<Arc<Wakeup>>> = const { std::cell::OnceCell::new() };
}

fn my_wakeup() -> Option<Arc<Wakeup>> {
    MINE.try_with(|m| m.get_or_init(Wakeup::new).clone())
        .ok()
        .flatten()
}

/// `poll` bits for an engine's readiness.
pub fn poll_bits(r: &Readiness, wanted: c_short) -> c_short {
    let mut b = 0;
    if r.readable {
        b |= POLLIN | (wanted & libc::POLLRDNORM);
    }
    if r.writable {
        b |= POLLOUT | (wanted & libc::POLLWRNORM);
    }
    if r.hangup {
        b |= POLLHUP | (wanted & POLLRDHUP);
    }
    if r.error {
        b |= POLLERR;
    }
    // POLLHUP and POLLERR are reported whether asked for or not.
    b & (wanted | POLLHUP | POLLERR)
}

/// Longest sleep between looks, a safety net under the notifications.
const SLICE: Duration = Duration::from_millis(100);

/// `poll`/`ppoll` over `fds`; `None` if none of them is upgraded (the
/// caller asks the kernel). `timeout` `None` waits for ever. Returns what
/// `poll` returns (errno set on -1).
///
/// # Safety
/// `fds` must be null or the program's array of `n` entries.
pub unsafe fn poll(
    fds: *mut pollfd,
    n: usize,
    timeout: Option<Duration>,
    mask: *const libc::sigset_t,
) -> Option<c_int> {
    if fds.is_null() {
        return None;
    }
    // SAFETY: the caller's array.
    let fds = unsafe { std::slice::from_raw_parts_mut(fds, n) };
    let conns: Vec<Option<Arc<crate::conn::Conn>>> = fds
        .iter()
        .map(|p| crate::fdtable::get(p.fd).and_then(|s| s.conn()))
        .collect();
    if conns.iter().all(Option::is_none) {
        return None;
    }
    Some(poll_upgraded(fds, &conns, timeout, mask))
}

fn poll_upgraded(
    fds: &mut [pollfd],
    conns: &[Option<Arc<crate::conn::Conn>>],
    timeout: Option<Duration>,
    mask: *const libc::sigset_t,
) -> c_int {
    let deadline = timeout.map(|t| Instant::now() + t);
    let wake = my_wakeup();
    // The kernel's part: every entry, with upgraded ones disabled (fd -1),
    // plus our eventfd at the end.
    let mut kernel: Vec<pollfd> = fds
        .iter()
        .zip(conns)
        .map(|(p, c)| pollfd {
            fd: if c.is_some() { -1 } else { p.fd },
            events: p.events,
            revents: 0,
        })
        .collect();
    if let Some(w) = &wake {
        kernel.push(pollfd {
            fd: w.fd(),
            events: POLLIN,
            revents: 0,
        });
    }
    loop {
        if let Some(w) = &wake {
            w.arm();
        }
        let mut ready = 0;
        for ((p, c), k) in fds.iter_mut().zip(conns).zip(kernel.iter_mut()) {
            if let Some(c) = c {
                p.revents = poll_bits(&c.engine.readiness(), p.events);
                k.revents = 0;
                if p.revents != 0 {
                    ready += 1;
                }
            }
        }
        let left = deadline.map(|d| d.saturating_duration_since(Instant::now()));
        let wait = if ready > 0 {
            Duration::ZERO
        } else {
            left.map_or(SLICE, |l| l.min(SLICE))
        };
        let ts = libc::timespec {
            tv_sec: wait.as_secs() as libc::time_t,
            tv_nsec: wait.subsec_nanos() as libc::c_long,
        };
        let with_wake = if wait.is_zero() {
            kernel.len() - usize::from(wake.is_some())
        } else {
            kernel.len()
        };
        // SAFETY: our own array; the caller's signal mask, if any.
        let r = unsafe { real::ppoll(kernel.as_mut_ptr(), with_wake as libc::nfds_t, &ts, mask) };
        if let Some(w) = &wake {
            w.disarm();
        }
        if r < 0 {
            return -1;
        }
        for ((p, c), k) in fds.iter_mut().zip(conns).zip(&kernel) {
            if c.is_none() {
                p.revents = k.revents;
                if k.revents != 0 {
                    ready += 1;
                }
            }
        }
        if ready > 0 || left.is_some_and(|l| l.is_zero()) {
            return ready;
        }
    }
}

/// A `poll`-style timeout in milliseconds (negative: none).
pub fn ms_timeout(ms: c_int) -> Option<Duration> {
    (ms >= 0).then(|| Duration::from_millis(ms as u64))
}

pub fn ts_timeout(ts: *const libc::timespec) -> Option<Duration> {
    if ts.is_null() {
        return None;
    }
    // SAFETY: the program's timespec.
    let t = unsafe { *ts };
    Some(Duration::new(
        t.tv_sec.max(0) as u64,
        t.tv_nsec.clamp(0, 999_999_999) as u32,
    ))
}

/// `select`/`pselect` through [`poll`].
///
/// # Safety
/// The fd_sets must be null or the program's sets of at least `nfds` bits.
pub unsafe fn select(
    nfds: c_int,
    r: *mut libc::fd_set,
    w: *mut libc::fd_set,
    e: *mut libc::fd_set,
    timeout: Option<Duration>,
    mask: *const libc::sigset_t,
) -> c_int {
    let mut fds = Vec::new();
    for fd in 0..nfds.max(0) {
        // SAFETY: FD_ISSET on the program's sets, below nfds.
        let (rr, ww, ee) = unsafe {
            (
                !r.is_null() && libc::FD_ISSET(fd, r),
                !w.is_null() && libc::FD_ISSET(fd, w),
                !e.is_null() && libc::FD_ISSET(fd, e),
            )
        };
        if rr || ww || ee {
            let mut events = 0;
            if rr {
                events |= POLLIN;
            }
            if ww {
                events |= POLLOUT;
            }
            if ee {
                events |= libc::POLLPRI;
            }
            fds.push(pollfd {
                fd,
                events,
                revents: 0,
            });
        }
    }
    // SAFETY: our own array, in both calls.
    let n = unsafe { poll(fds.as_mut_ptr(), fds.len(), timeout, mask) }.unwrap_or_else(|| {
        // The upgraded socket is gone meanwhile: the kernel answers all.
        let ts = timeout.map(|t| libc::timespec {
            tv_sec: t.as_secs() as libc::time_t,
            tv_nsec: t.subsec_nanos() as libc::c_long,
        });
        let tsp = ts
            .as_ref()
            .map_or(std::ptr::null(), |t| t as *const libc::timespec);
        // SAFETY: as above.
        unsafe { real::ppoll(fds.as_mut_ptr(), fds.len() as libc::nfds_t, tsp, mask) }
    });
    if n < 0 {
        return -1;
    }
    let mut count = 0;
    // SAFETY: clearing and setting bits below nfds in the program's sets.
    unsafe {
        for set in [r, w, e] {
            if !set.is_null() {
                libc::FD_ZERO(set);
            }
        }
        for p in &fds {
            let bad = p.revents & libc::POLLNVAL != 0;
            if bad {
                real::set_errno(libc::EBADF);
                return -1;
            }
            let rd = p.revents & (POLLIN | POLLHUP | POLLERR) != 0 && p.events & POLLIN != 0;
            let wr = p.revents & (POLLOUT | POLLERR) != 0 && p.events & POLLOUT != 0;
            let ex = p.revents & libc::POLLPRI != 0 && p.events & libc::POLLPRI != 0;
            if rd {
                libc::FD_SET(p.fd, r);
                count += 1;
            }
            if wr {
                libc::FD_SET(p.fd, w);
                count += 1;
            }
            if ex {
                libc::FD_SET(p.fd, e);
                count += 1;
            }
        }
    }
    count
}
