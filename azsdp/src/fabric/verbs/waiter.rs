//! Waiting on a `verbs` connection: its completion channel (armed CQ), its
//! rdma_cm event channel (the peer leaving) and a kick, behind one epoll
//! descriptor a reactor can watch with the other connections'.

use std::os::fd::{AsRawFd, FromRawFd, OwnedFd};
use std::sync::Arc;
use std::sync::atomic::{AtomicU32, Ordering};
use std::time::{Duration, Instant};

use super::ffi::{CompChannel, Cq, EventChannel};
use crate::fabric::FabricWaiter;

/// A connection's waiter (clones share it).
#[derive(Clone, Debug)]
pub struct VerbsWaiter(Arc<Inner>);

#[derive(Debug)]
pub struct Inner {
    cq: Arc<Cq>,
    comp: Arc<CompChannel>,
    _events: Arc<EventChannel>,
    epoll: OwnedFd,
    kick: OwnedFd,
    seq: AtomicU32,
    poll: Duration,
}

fn owned(fd: i32) -> std::io::Result<OwnedFd> {
    if fd < 0 {
        return Err(std::io::Error::last_os_error());
    }
    // SAFETY: a descriptor just made, owned by no one else.
    Ok(unsafe { OwnedFd::from_raw_fd(fd) })
}

impl std::ops::Deref for VerbsWaiter {
    type Target = Inner;
    fn deref(&self) -> &Inner {
        &self.0
    }
}

impl VerbsWaiter {
    pub(super) fn new(
        cq: Arc<Cq>,
        comp: Arc<CompChannel>,
        events: Arc<EventChannel>,
        poll: Duration,
    ) -> std::io::Result<VerbsWaiter> {
        // SAFETY: plain system calls making descriptors we own.
        let epoll = owned(unsafe { libc::epoll_create1(libc::EPOLL_CLOEXEC) })?;
        // SAFETY: as above.
        let kick = owned(unsafe { libc::eventfd(0, libc::EFD_CLOEXEC | libc::EFD_NONBLOCK) })?;
        for fd in [comp.fd(), events.fd(), kick.as_raw_fd()] {
            let mut ev = libc::epoll_event {
                events: libc::EPOLLIN as u32,
                u64: fd as u64,
            };
            // SAFETY: live descriptors; the epoll set is ours.
            if unsafe { libc::epoll_ctl(epoll.as_raw_fd(), libc::EPOLL_CTL_ADD, fd, &mut ev) } != 0
            {
                return Err(std::io::Error::last_os_error());
            }
        }
        Ok(VerbsWaiter(Arc::new(Inner {
            cq,
            comp,
            _events: events,
            epoll,
            kick,
            seq: AtomicU32::new(0),
            poll,
        })))
    }
}

impl Inner {
    /// Take what fired the descriptor and ask for an event at the next
    /// completion.
    pub fn rearm(&self) {
        self.comp.drain();
        let mut v = 0u64;
        // SAFETY: 8 bytes into a local from our non-blocking eventfd.
        unsafe { libc::read(self.kick.as_raw_fd(), (&mut v as *mut u64).cast(), 8) };
        self.cq.arm();
    }

    /// Has anything fired, waiting up to `ms`?
    fn fired(&self, ms: i32) -> bool {
        let mut ev = [libc::epoll_event { events: 0, u64: 0 }; 3];
        // SAFETY: our epoll set and room for 3 events.
        unsafe { libc::epoll_wait(self.epoll.as_raw_fd(), ev.as_mut_ptr(), 3, ms) > 0 }
    }

    fn sleep_until(&self, ticket: u32, timeout: Duration, spin: bool) {
        if self.seq.load(Ordering::Acquire) != ticket {
            return;
        }
        let start = Instant::now();
        let mut fired = false;
        if spin {
            while start.elapsed() < self.poll.min(timeout) {
                if self.fired(0) || self.seq.load(Ordering::Acquire) != ticket {
                    fired = true;
                    break;
                }
                std::hint::spin_loop();
            }
        }
        if !fired {
            let left = timeout.saturating_sub(start.elapsed());
            let ms = left.as_millis().clamp(0, i32::MAX as u128) as i32;
            fired = self.fired(ms.max(i32::from(!left.is_zero())));
        }
        if fired {
            self.comp.drain();
            self.seq.fetch_add(1, Ordering::AcqRel);
        }
    }
}

impl FabricWaiter for VerbsWaiter {
    fn prepare(&self) -> u32 {
        self.cq.arm();
        self.seq.load(Ordering::Acquire)
    }

    fn wait(&self, ticket: u32, timeout: Duration, spin: bool) {
        self.sleep_until(ticket, timeout, spin);
    }

    fn sleep(&self, ticket: u32, timeout: Duration) {
        self.sleep_until(ticket, timeout, false);
    }

    fn kick(&self) {
        self.seq.fetch_add(1, Ordering::AcqRel);
        let one = 1u64;
        // SAFETY: 8 bytes from a local into our eventfd.
        unsafe { libc::write(self.kick.as_raw_fd(), (&one as *const u64).cast(), 8) };
    }

    fn fd(&self) -> Option<i32> {
        Some(self.epoll.as_raw_fd())
    }
}
