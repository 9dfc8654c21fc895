//! epoll over upgraded sockets.
//!
//! The kernel's epoll set keeps every descriptor the shim does not own.
//! Upgraded sockets are kept here instead, with their events and data,
//! and the set holds one eventfd (tagged with [`TAG`]) that
//! [`crate::ready::notify`] rings while a thread waits in the set.
//! `epoll_wait` reports upgraded sockets from their engines' readiness:
//! level-triggered ones whenever ready; edge-triggered ones when their
//! readiness gained a bit or their engine took something in since the last
//! report; one-shot ones once until re-armed with EPOLL_CTL_MOD.
//!
//! `unsafe` here: the program's `epoll_event` arrays.

use azsdp::sync::Lock;
use std::collections::BTreeMap;
use std::sync::Arc;
use std::sync::atomic::Ordering;
use std::time::{Duration, Instant};

use libc::{
    EPOLLERR, EPOLLET, EPOLLHUP, EPOLLIN, EPOLLONESHOT, EPOLLOUT, EPOLLRDHUP, c_int, epoll_event,
};

use crate::conn::Conn;
use crate::ready::Wakeup;
use crate::real;
use crate::sock::Sock;

/// The eventfd's data in the kernel set (a value no program uses as a
/// pointer or small integer by accident is good enough: the entry is ours).
const TAG: u64 = 0xa25d_b0e1_7e57_0000;

struct Interest {
    sock: Arc<Sock>,
    events: u32,
    data: u64,
    /// Bits reported last time, and the engine's activity then.
    last_bits: u32,
    last_activity: u64,
    /// A one-shot interest that fired, until EPOLL_CTL_MOD.
    spent: bool,
}

struct Set {
    wake: Arc<Wakeup>,
    interests: BTreeMap<c_int, Interest>,
}

static SETS: Lock<BTreeMap<c_int, Arc<Lock<Set>>>> = Lock::new(BTreeMap::new());
/// Sets in [`SETS`] (read without the lock on every `close` and `epoll_wait`).
static COUNT: std::sync::atomic::AtomicUsize = std::sync::atomic::AtomicUsize::new(0);

/// Does the shim hold part of any epoll set?
pub fn has_sets() -> bool {
    COUNT.load(Ordering::Relaxed) > 0
}

fn set_of(epfd: c_int) -> Option<Arc<Lock<Set>>> {
    SETS.lock().get(&epfd).cloned()
}

/// The shim's part of `epfd`, made (with its eventfd in the kernel set) if
/// it has none yet.
fn set_for(epfd: c_int) -> Option<Arc<Lock<Set>>> {
    let mut sets = SETS.lock();
    if let Some(s) = sets.get(&epfd) {
        return Some(Arc::clone(s));
    }
    let wake = Wakeup::new()?;
    let mut ev = epoll_event {
        events: EPOLLIN as u32,
        u64: TAG,
    };
    // SAFETY: adding our own eventfd to the program's epoll set.
    if unsafe { real::epoll_ctl(epfd, libc::EPOLL_CTL_ADD, wake.fd(), &mut ev) } != 0 {
        return None;
    }
    let s = Arc::new(Lock::new(Set {
        wake,
        interests: BTreeMap::new(),
    }));
    sets.insert(epfd, Arc::clone(&s));
    COUNT.store(sets.len(), Ordering::Relaxed);
    Some(s)
}

/// `epfd` was closed.
pub fn forget_set(epfd: c_int) {
    let gone = {
        let mut sets = SETS.lock();
        let gone = sets.remove(&epfd);
        COUNT.store(sets.len(), Ordering::Relaxed);
        gone
    };
    // Dropped unlocked: its eventfd's close comes back through `close`.
    drop(gone);
}

/// `fd` (upgraded) was closed: drop it from every set.
pub fn forget_fd(fd: c_int) {
    let sets: Vec<_> = SETS.lock().values().cloned().collect();
    for s in sets {
        s.lock().interests.remove(&fd);
    }
}

/// `epoll_ctl` on an upgraded socket. Returns what epoll_ctl returns.
pub fn ctl(epfd: c_int, op: c_int, fd: c_int, sock: Arc<Sock>, ev: Option<epoll_event>) -> c_int {
    let Some(set) = set_for(epfd) else {
        real::set_errno(libc::ENOMEM);
        return -1;
    };
    let mut set = set.lock();
    let exists = set.interests.contains_key(&fd);
    match op {
        libc::EPOLL_CTL_ADD | libc::EPOLL_CTL_MOD => {
            let Some(ev) = ev else {
                real::set_errno(libc::EFAULT);
                return -1;
            };
            if op == libc::EPOLL_CTL_ADD && exists {
                real::set_errno(libc::EEXIST);
                return -1;
            }
            if op == libc::EPOLL_CTL_MOD && !exists {
                real::set_errno(libc::ENOENT);
                return -1;
            }
            set.interests.insert(
                fd,
                Interest {
                    sock,
                    events: ev.events,
                    data: ev.u64,
                    last_bits: 0,
                    last_activity: u64::MAX,
                    spent: false,
                },
            );
        }
        libc::EPOLL_CTL_DEL => {
            if set.interests.remove(&fd).is_none() {
                real::set_errno(libc::ENOENT);
                return -1;
            }
        }
        _ => {
            real::set_errno(libc::EINVAL);
            return -1;
        }
    }
    drop(set);
    crate::ready::notify();
    0
}

/// A socket in kernel epoll sets was upgraded: move it to ours.
pub fn adopt(sock: &Arc<Sock>) {
    let regs = std::mem::take(&mut *sock.kernel_epolls.lock());
    for r in regs {
        // SAFETY: removing the descriptor from the program's set.
        unsafe { real::epoll_ctl(r.epfd, libc::EPOLL_CTL_DEL, r.fd, std::ptr::null_mut()) };
        let ev = epoll_event {
            events: r.events,
            u64: r.data,
        };
        ctl(
            r.epfd,
            libc::EPOLL_CTL_ADD,
            r.fd,
            Arc::clone(sock),
            Some(ev),
        );
    }
}

fn epoll_bits(c: &Conn, wanted: u32) -> u32 {
    let r = c.engine.readiness();
    let mut b = 0u32;
    if r.readable {
        b |= EPOLLIN as u32;
    }
    if r.writable {
        b |= EPOLLOUT as u32;
    }
    if r.hangup {
        b |= (EPOLLHUP | EPOLLRDHUP) as u32;
    }
    if r.error {
        b |= EPOLLERR as u32;
    }
    b & (wanted | (EPOLLHUP | EPOLLERR) as u32)
}

/// Collect ready upgraded sockets into `out`.
fn collect(set: &mut Set, out: &mut Vec<epoll_event>, max: usize) {
    for it in set.interests.values_mut() {
        if out.len() >= max {
            break;
        }
        if it.spent {
            continue;
        }
        let Some(c) = it.sock.conn() else { continue };
        let activity = c.activity.load(Ordering::Relaxed);
        let bits = epoll_bits(&c, it.events);
        let edge = it.events & EPOLLET as u32 != 0;
        let report = if edge {
            bits != 0 && (bits & !it.last_bits != 0 || activity != it.last_activity)
        } else {
            bits != 0
        };
        it.last_bits = bits;
        if report {
            it.last_activity = activity;
            if it.events & EPOLLONESHOT as u32 != 0 {
                it.spent = true;
            }
            out.push(epoll_event {
                events: bits,
                u64: it.data,
            });
        }
    }
}

/// `epoll_wait`/`epoll_pwait` on a set that holds upgraded sockets; `None`
/// if it holds none (the caller goes straight to the kernel).
///
/// # Safety
/// `events` must be the program's array of `max` entries.
pub unsafe fn wait(
    epfd: c_int,
    events: *mut epoll_event,
    max: c_int,
    timeout: Option<Duration>,
    mask: *const libc::sigset_t,
) -> Option<c_int> {
    let set = set_of(epfd)?;
    if max <= 0 || events.is_null() {
        real::set_errno(libc::EINVAL);
        return Some(-1);
    }
    let max = max as usize;
    let deadline = timeout.map(|t| Instant::now() + t);
    let wake = Arc::clone(&set.lock().wake);
    let mut kernel: Vec<epoll_event> = vec![epoll_event { events: 0, u64: 0 }; max];
    loop {
        wake.arm();
        let mut out = Vec::new();
        collect(&mut set.lock(), &mut out, max);
        let left = deadline.map(|d| d.saturating_duration_since(Instant::now()));
        let wait_ms: c_int = if !out.is_empty() {
            0
        } else {
            left.map_or(100, |l| l.as_millis().min(100) as c_int)
        };
        let room = max - out.len();
        let n = if room == 0 {
            0
        } else {
            // SAFETY: our own array of `max` entries (room <= max).
            unsafe { real::epoll_pwait(epfd, kernel.as_mut_ptr(), room as c_int, wait_ms, mask) }
        };
        wake.disarm();
        if n < 0 {
            if out.is_empty() {
                return Some(-1);
            }
        } else {
            for ev in &kernel[..n as usize] {
                if ev.u64 != TAG {
                    out.push(*ev);
                }
            }
        }
        if !out.is_empty() || left.is_some_and(|l| l.is_zero()) {
            // SAFETY: out.len() <= max, the program's array has max entries.
            unsafe { std::ptr::copy_nonoverlapping(out.as_ptr(), events, out.len()) };
            return Some(out.len() as c_int);
        }
    }
}
