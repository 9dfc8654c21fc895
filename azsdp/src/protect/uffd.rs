//! Write protection with a full userfaultfd.
//!
//! A *full* userfaultfd (`user_mode_only(false)`, which needs root,
//! CAP_SYS_PTRACE or access to `/dev/userfaultfd`) also catches faults taken
//! inside the kernel: a `read(fd, protected_buf)` waits for the handler instead
//! of failing with EFAULT. That is what makes protecting buffers the program
//! may hand to syscalls safe.
//!
//! Ranges are registered (UFFDIO_REGISTER, write-protect mode) the first time
//! they are protected and stay registered, so later sends only toggle
//! protection (UFFDIO_WRITEPROTECT). Pages never touched are protected too:
//! with `UFFD_FEATURE_WP_UNPOPULATED` by the kernel, otherwise by reading each
//! page first (which maps the zero page, which write-protection then covers).
//!
//! Faults are read by [`FaultReader::next`], meant for a dedicated thread: it
//! reads one fixed-size message from the descriptor and allocates nothing.
//!
//! `unsafe` here: pre-touching pages by address.

use std::ops::Range;
use std::sync::Arc;

use userfaultfd::{Event, FaultKind, FeatureFlags, ReadWrite, RegisterMode, Uffd, UffdBuilder};

use crate::pages::RangeCounter;

/// `UFFD_FEATURE_WP_UNPOPULATED` (Linux 6.4); older headers lack the name.
const FEATURE_WP_UNPOPULATED: u64 = 1 << 13;

/// Why protection is not available, or failed.
#[derive(Debug, thiserror::Error)]
pub enum ProtectError {
    /// No full userfaultfd: without it a syscall writing a protected page
    /// would get EFAULT, so nothing may be protected (run as ZSDP).
    #[error("no full userfaultfd (needs root, CAP_SYS_PTRACE or /dev/userfaultfd access): {0}")]
    Unavailable(String),
    #[error("cannot register {range:x?} with userfaultfd: {why}")]
    Register { range: Range<u64>, why: String },
    #[error("write-protect ioctl failed on {range:x?}: {why}")]
    Ioctl { range: Range<u64>, why: String },
}

/// A fault the handler thread read.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Fault {
    pub addr: u64,
    pub write: bool,
    /// A write-protect fault (as opposed to a missing page).
    pub wp: bool,
}

/// The protection side of a userfaultfd.
#[derive(Debug)]
pub struct UffdProtect {
    uffd: Arc<Uffd>,
    registered: RangeCounter,
    wp_unpopulated: bool,
    page: u64,
}

/// Reads faults from the same userfaultfd (for a handler thread).
#[derive(Debug, Clone)]
pub struct FaultReader {
    uffd: Arc<Uffd>,
}

fn build(features: FeatureFlags) -> Result<Uffd, userfaultfd::Error> {
    UffdBuilder::new()
        .close_on_exec(true)
        // Non-blocking reads: a fault seen by poll() may be resolved (woken
        // by an unprotect) before the read, which must then not block.
        .non_blocking(true)
        .user_mode_only(false)
        .require_features(features)
        .create()
}

impl UffdProtect {
    /// Open a full userfaultfd with write-protect support.
    pub fn new() -> Result<UffdProtect, ProtectError> {
        let wp = FeatureFlags::PAGEFAULT_FLAG_WP;
        let unpop = FeatureFlags::from_bits_retain(FEATURE_WP_UNPOPULATED);
        let (uffd, wp_unpopulated) = match build(wp | unpop) {
            Ok(u) => (u, true),
            Err(_) => match build(wp) {
                Ok(u) => (u, false),
                Err(e) => return Err(ProtectError::Unavailable(e.to_string())),
            },
        };
        let page = nix::unistd::sysconf(nix::unistd::SysconfVar::PAGE_SIZE)
            .ok()
            .flatten()
            .map_or(4096, |v| v as u64);
        Ok(UffdProtect {
            uffd: Arc::new(uffd),
            registered: RangeCounter::new(),
            wp_unpopulated,
            page,
        })
    }

    /// Does the kernel protect never-touched pages itself?
    pub fn wp_unpopulated(&self) -> bool {
        self.wp_unpopulated
    }

    pub fn page_size(&self) -> u64 {
        self.page
    }

    /// A reader for the fault-handler thread.
    pub fn faults(&self) -> FaultReader {
        FaultReader {
            uffd: Arc::clone(&self.uffd),
        }
    }

    /// Write-protect whole pages `r`, registering them first if needed.
    pub fn protect(&mut self, r: Range<u64>) -> Result<(), ProtectError> {
        debug_assert!(r.start % self.page == 0 && r.end % self.page == 0);
        // Register only the parts not registered yet.
        let mut gaps = Vec::new();
        let mut cur = r.start;
        for done in self.registered.intersect(&r) {
            if done.start > cur {
                gaps.push(cur..done.start);
            }
            cur = done.end;
        }
        if cur < r.end {
            gaps.push(cur..r.end);
        }
        for fresh in gaps {
            let len = (fresh.end - fresh.start) as usize;
            self.uffd
                .register_with_mode(fresh.start as *mut _, len, RegisterMode::WRITE_PROTECT)
                .map_err(|e| ProtectError::Register {
                    range: fresh.clone(),
                    why: e.to_string(),
                })?;
            self.registered.add(fresh);
        }
        if !self.wp_unpopulated {
            let mut a = r.start;
            while a < r.end {
                // SAFETY: the range was just registered, so it is mapped; a
                // read maps the zero page into a never-touched page (which
                // write-protection then covers) and changes nothing else.
                unsafe { std::ptr::read_volatile(a as *const u8) };
                a += self.page;
            }
        }
        self.uffd
            .write_protect(r.start as *mut _, (r.end - r.start) as usize)
            .map_err(|e| ProtectError::Ioctl {
                range: r,
                why: e.to_string(),
            })
    }

    /// Lift write protection and wake whoever waits on those pages.
    pub fn unprotect(&mut self, r: Range<u64>) -> Result<(), ProtectError> {
        self.uffd
            .remove_write_protection(r.start as *mut _, (r.end - r.start) as usize, true)
            .map_err(|e| ProtectError::Ioctl {
                range: r,
                why: e.to_string(),
            })
    }

    /// Wake threads waiting on `r` (a fault that turned out to need nothing).
    pub fn wake(&self, r: Range<u64>) {
        let _ = self
            .uffd
            .wake(r.start as *mut _, (r.end - r.start) as usize);
    }

    /// Forget registrations in `r` (its memory is being unmapped).
    pub fn forget(&mut self, r: Range<u64>) {
        for part in self.registered.intersect(&r) {
            let _ = self
                .uffd
                .unregister(part.start as *mut _, (part.end - part.start) as usize);
            let _ = self.registered.remove(part);
        }
    }
}

impl FaultReader {
    /// The next fault, waiting at most `timeout`; `None` if none came (or an
    /// event other than a page fault did).
    pub fn next_timeout(&self, timeout: std::time::Duration) -> Option<Fault> {
        use std::os::fd::AsRawFd;
        let mut p = libc::pollfd {
            fd: self.uffd.as_raw_fd(),
            events: libc::POLLIN,
            revents: 0,
        };
        let ms = timeout.as_millis().min(i32::MAX as u128) as i32;
        // SAFETY: one valid pollfd for the duration of the call.
        let n = unsafe { libc::poll(&mut p, 1, ms) };
        if n <= 0 {
            return None;
        }
        self.read_one()
    }

    /// Wait for the next page fault, however long it takes (events other
    /// than page faults are skipped).
    pub fn next(&self) -> Option<Fault> {
        loop {
            if let Some(f) = self.next_timeout(std::time::Duration::from_secs(3600)) {
                return Some(f);
            }
        }
    }

    /// Read one pending fault without waiting.
    fn read_one(&self) -> Option<Fault> {
        match self.uffd.read_event() {
            Ok(Some(Event::Pagefault { kind, rw, addr, .. })) => Some(Fault {
                addr: addr as u64,
                write: rw == ReadWrite::Write,
                wp: matches!(kind, FaultKind::WriteProtected),
            }),
            _ => None,
        }
    }
}

impl crate::driver::Protector for UffdProtect {
    fn can_protect(&self) -> bool {
        true
    }

    fn protect(&mut self, ranges: &[Range<u64>]) -> Result<(), crate::conn::OpError> {
        for (i, r) in ranges.iter().enumerate() {
            if UffdProtect::protect(self, r.clone()).is_err() {
                // All or nothing: the engine assumes a failed prepare left
                // nothing protected.
                for done in &ranges[..i] {
                    let _ = self.unprotect(done.clone());
                }
                return Err(crate::conn::OpError::Local);
            }
        }
        Ok(())
    }

    fn unprotect(&mut self, range: Range<u64>) {
        let _ = UffdProtect::unprotect(self, range);
    }

    fn arm(&mut self, _: Range<u64>) -> Result<(), crate::conn::OpError> {
        // Armed receives (MISSING + UFFDIO_MOVE staging) are not built yet.
        Err(crate::conn::OpError::Local)
    }

    fn disarm(&mut self, _: Range<u64>, _: crate::conn::DisarmOutcome) {}

    fn wake(&mut self, range: Range<u64>) {
        UffdProtect::wake(self, range);
    }

    fn forget(&mut self, range: Range<u64>) {
        UffdProtect::forget(self, range);
    }
}

#[cfg(test)]
mod tests;
