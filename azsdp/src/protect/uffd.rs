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
//! Armed receives (receive-side protection) use MISSING mode and
//! `UFFDIO_MOVE`: arming moves the destination's pages out into private
//! staging pages (so any access to the destination, by the program or by a
//! syscall, waits for the handler), the GET lands in the staging pages, and
//! landing moves them back into place. No page is allocated, zeroed or
//! copied on the way: the program's own pages make the round trip. A
//! receive that fails before returning moves the old pages back; data that
//! was promised but never came is poisoned (`UFFDIO_POISON`: a later access
//! gets SIGBUS rather than silently wrong bytes).
//!
//! Faults are read by [`FaultReader::next`], meant for a dedicated thread: it
//! reads one fixed-size message from the descriptor and allocates nothing.
//!
//! `unsafe` here: pre-touching pages by address, and the raw `UFFDIO_MOVE`
//! and `UFFDIO_POISON` ioctls (the crate predates them).

use std::collections::HashMap;
use std::ops::Range;
use std::os::fd::AsRawFd;
use std::sync::Arc;

use userfaultfd::{Event, FaultKind, FeatureFlags, ReadWrite, RegisterMode, Uffd, UffdBuilder};

use crate::pages::RangeCounter;

/// `UFFD_FEATURE_PAGEFAULT_FLAG_WP`.
const FEATURE_WP: u64 = 1 << 0;
/// `UFFD_FEATURE_WP_UNPOPULATED` (Linux 6.4); older headers lack the name.
const FEATURE_WP_UNPOPULATED: u64 = 1 << 13;
/// `UFFD_FEATURE_POISON` (Linux 6.6).
const FEATURE_POISON: u64 = 1 << 14;
/// `UFFD_FEATURE_MOVE` (Linux 6.8).
const FEATURE_MOVE: u64 = 1 << 16;
/// `_IOWR(0xAA, 0x05, struct uffdio_move)` (40 bytes).
const UFFDIO_MOVE: libc::c_ulong = 0xc028_aa05;
/// `_IOWR(0xAA, 0x08, struct uffdio_poison)` (32 bytes).
const UFFDIO_POISON: libc::c_ulong = 0xc020_aa08;
const UFFDIO_MOVE_MODE_DONTWAKE: u64 = 1 << 0;
const UFFDIO_MOVE_MODE_ALLOW_SRC_HOLES: u64 = 1 << 1;

#[repr(C)]
struct UffdioMove {
    dst: u64,
    src: u64,
    len: u64,
    mode: u64,
    moved: i64,
}

#[repr(C)]
struct UffdioPoison {
    start: u64,
    len: u64,
    mode: u64,
    updated: i64,
}

pub use super::{Fault, ProtectError};

/// The protection side of a userfaultfd.
#[derive(Debug)]
pub struct UffdProtect {
    uffd: Arc<Uffd>,
    registered: RangeCounter,
    wp_unpopulated: bool,
    /// `UFFDIO_MOVE` works: armed receives are possible.
    can_move: bool,
    can_poison: bool,
    page: u64,
    /// Armed ranges (by start) and the staging pages holding their data.
    armed: HashMap<u64, Staging>,
    /// Staging mappings not in use, kept for the next arm.
    spare: Vec<Staging>,
}

/// A private anonymous mapping, registered with the userfaultfd (which
/// `UFFDIO_MOVE` requires of its destination), that the pages of an armed
/// range live in while their data is on its way.
#[derive(Debug)]
struct Staging {
    addr: u64,
    len: u64,
}

/// Most bytes of spare staging kept mapped.
const SPARE_STAGING: u64 = 64 << 20;

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
        // The richest feature set this kernel grants (UFFDIO_API fails on
        // any feature it lacks).
        let wp = FEATURE_WP;
        let attempts = [
            wp | FEATURE_WP_UNPOPULATED | FEATURE_MOVE | FEATURE_POISON,
            wp | FEATURE_WP_UNPOPULATED | FEATURE_MOVE,
            wp | FEATURE_WP_UNPOPULATED,
            wp,
        ];
        let mut last = None;
        let mut got = None;
        for f in attempts {
            match build(FeatureFlags::from_bits_retain(f)) {
                Ok(u) => {
                    got = Some((u, f));
                    break;
                }
                Err(e) => last = Some(e),
            }
        }
        let Some((uffd, features)) = got else {
            return Err(ProtectError::Unavailable(
                last.map_or_else(String::new, |e| e.to_string()),
            ));
        };
        let page = nix::unistd::sysconf(nix::unistd::SysconfVar::PAGE_SIZE)
            .ok()
            .flatten()
            .map_or(4096, |v| v as u64);
        Ok(UffdProtect {
            uffd: Arc::new(uffd),
            registered: RangeCounter::new(),
            wp_unpopulated: features & FEATURE_WP_UNPOPULATED != 0,
            can_move: features & FEATURE_MOVE != 0,
            can_poison: features & FEATURE_POISON != 0,
            page,
            armed: HashMap::new(),
            spare: Vec::new(),
        })
    }

    /// Does the kernel protect never-touched pages itself?
    pub fn wp_unpopulated(&self) -> bool {
        self.wp_unpopulated
    }

    /// Can receives be armed (needs `UFFDIO_MOVE`)?
    pub fn can_arm(&self) -> bool {
        self.can_move
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

    /// Register the parts of `r` not registered yet (write-protect mode).
    fn ensure_registered(&mut self, r: &Range<u64>) -> Result<(), ProtectError> {
        let mut gaps = Vec::new();
        let mut cur = r.start;
        for done in self.registered.intersect(r) {
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
        Ok(())
    }

    /// Write-protect whole pages `r`, registering them first if needed.
    pub fn protect(&mut self, r: Range<u64>) -> Result<(), ProtectError> {
        debug_assert!(r.start % self.page == 0 && r.end % self.page == 0);
        self.ensure_registered(&r)?;
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

    fn register_mode(&self, r: &Range<u64>, mode: RegisterMode) -> Result<(), String> {
        self.uffd
            .register_with_mode(r.start as *mut _, (r.end - r.start) as usize, mode)
            .map(|_| ())
            .map_err(|e| e.to_string())
    }

    /// `UFFDIO_MOVE` of `len` bytes from `src` to `dst` (both private
    /// anonymous, `dst` registered and unpopulated), retrying partial moves.
    fn move_pages(&self, dst: u64, src: u64, len: u64, mode: u64) -> Result<(), String> {
        let mut done = 0u64;
        while done < len {
            let mut m = UffdioMove {
                dst: dst + done,
                src: src + done,
                len: len - done,
                mode,
                moved: 0,
            };
            // SAFETY: the ioctl reads and writes only `m`; the kernel checks
            // both ranges (same mm, anonymous, registered destination).
            let rc = unsafe { libc::ioctl(self.uffd.as_raw_fd(), UFFDIO_MOVE, &mut m) };
            if m.moved > 0 {
                done += m.moved as u64;
            }
            if rc == 0 {
                if m.moved <= 0 {
                    break;
                }
                continue;
            }
            let err = nix::errno::Errno::last();
            if err != nix::errno::Errno::EAGAIN {
                return Err(format!("UFFDIO_MOVE: {err}"));
            }
        }
        Ok(())
    }

    fn take_staging(&mut self, len: u64) -> Result<Staging, String> {
        if let Some(i) = self.spare.iter().position(|s| s.len == len) {
            return Ok(self.spare.swap_remove(i));
        }
        // SAFETY: a fresh private anonymous mapping; nothing else refers to it.
        let p = unsafe {
            libc::mmap(
                std::ptr::null_mut(),
                len as usize,
                libc::PROT_READ | libc::PROT_WRITE,
                libc::MAP_PRIVATE | libc::MAP_ANONYMOUS,
                -1,
                0,
            )
        };
        if p == libc::MAP_FAILED {
            return Err(format!("staging mmap: {}", nix::errno::Errno::last()));
        }
        let s = Staging {
            addr: p as u64,
            len,
        };
        // Registered (write-protect mode: nothing there ever faults to us)
        // because UFFDIO_MOVE only moves into registered ranges.
        if let Err(e) = self.register_mode(&(s.addr..s.addr + len), RegisterMode::WRITE_PROTECT) {
            unmap_staging(&s);
            return Err(format!("staging register: {e}"));
        }
        Ok(s)
    }

    fn give_back_staging(&mut self, s: Staging) {
        let spare: u64 = self.spare.iter().map(|s| s.len).sum();
        if spare + s.len <= SPARE_STAGING {
            self.spare.push(s);
        } else {
            unmap_staging(&s);
        }
    }

    /// Arm whole pages `r` for an early-returning receive: from now until
    /// [`UffdProtect::disarm`], any access to them faults to the handler.
    /// Their current pages move into staging, where the GET will land.
    pub fn arm(&mut self, r: Range<u64>) -> Result<(), ProtectError> {
        debug_assert!(r.start % self.page == 0 && r.end % self.page == 0);
        let fail = |why: String| ProtectError::Arm {
            range: r.clone(),
            why,
        };
        if !self.can_move {
            return Err(fail("the kernel has no UFFDIO_MOVE".into()));
        }
        let len = r.end - r.start;
        let stage = self.take_staging(len).map_err(fail)?;
        // MISSING mode on top of write-protect: an access to a page that
        // has moved out now faults to us, by the program or by the kernel.
        if let Err(e) = self.register_mode(&r, RegisterMode::MISSING | RegisterMode::WRITE_PROTECT)
        {
            self.give_back_staging(stage);
            return Err(fail(e));
        }
        self.registered.add(r.clone());
        // Holes (never-touched pages) stay holes in staging.
        let moved = self.move_pages(
            stage.addr,
            r.start,
            len,
            UFFDIO_MOVE_MODE_DONTWAKE | UFFDIO_MOVE_MODE_ALLOW_SRC_HOLES,
        );
        if let Err(e) = moved {
            // Whatever moved goes back; the receive runs synchronously.
            let _ = self.move_pages(r.start, stage.addr, len, UFFDIO_MOVE_MODE_ALLOW_SRC_HOLES);
            let _ = self.register_mode(&r, RegisterMode::WRITE_PROTECT);
            self.give_back_staging(stage);
            return Err(fail(e));
        }
        self.armed.insert(r.start, stage);
        Ok(())
    }

    /// Where the data of armed range `r` must be written (its staging pages).
    pub fn staging(&self, r: &Range<u64>) -> Option<u64> {
        self.armed
            .get(&r.start)
            .filter(|s| s.len == r.end - r.start)
            .map(|s| s.addr)
    }

    /// Move the staged pages of armed range `r` into place (waking whoever
    /// waits on them). The range stays armed until [`UffdProtect::disarm`].
    pub fn land(&mut self, r: &Range<u64>) -> Result<(), ProtectError> {
        let s = self.staging(r).ok_or_else(|| ProtectError::Arm {
            range: r.clone(),
            why: "not armed".into(),
        })?;
        self.move_pages(
            r.start,
            s,
            r.end - r.start,
            UFFDIO_MOVE_MODE_ALLOW_SRC_HOLES,
        )
        .map_err(|why| ProtectError::Arm {
            range: r.clone(),
            why,
        })
    }

    /// Armed range `r` is ordinary memory again. `Landed`: its data was put
    /// in place by [`UffdProtect::land`]. `Abandoned`: the old pages move
    /// back. `Lost`: the pages are poisoned, so a later access gets SIGBUS
    /// (or, without `UFFDIO_POISON`, reads zeros).
    pub fn disarm(&mut self, r: Range<u64>, outcome: crate::conn::DisarmOutcome) {
        use crate::conn::DisarmOutcome;
        let Some(stage) = self.armed.remove(&r.start) else {
            return;
        };
        let len = r.end - r.start;
        match outcome {
            DisarmOutcome::Landed => {}
            DisarmOutcome::Abandoned => {
                let _ = self.move_pages(r.start, stage.addr, len, UFFDIO_MOVE_MODE_ALLOW_SRC_HOLES);
            }
            DisarmOutcome::Lost => {
                let mut p = UffdioPoison {
                    start: r.start,
                    len,
                    mode: 0,
                    updated: 0,
                };
                // SAFETY: the ioctl reads and writes only `p`; it fills
                // holes in our own registered range.
                let poisoned = self.can_poison
                    && unsafe { libc::ioctl(self.uffd.as_raw_fd(), UFFDIO_POISON, &mut p) } == 0;
                if !poisoned {
                    // SAFETY: maps the zero page into holes of our own
                    // registered range (and wakes their waiters).
                    let _ = unsafe { self.uffd.zeropage(r.start as *mut _, len as usize, true) };
                }
            }
        }
        // Back to write-protect mode only: no later fault on these pages
        // is ours. Staging pages that still hold data are discarded.
        let _ = self.register_mode(&r, RegisterMode::WRITE_PROTECT);
        self.wake(r);
        // SAFETY: staging is our own private mapping; dropping its pages
        // (moved-back holes or leftovers) is what we want before reuse.
        unsafe { libc::madvise(stage.addr as *mut _, len as usize, libc::MADV_DONTNEED) };
        self.give_back_staging(stage);
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

fn unmap_staging(s: &Staging) {
    // SAFETY: unmapping a staging mapping we made, which nothing else uses.
    unsafe { libc::munmap(s.addr as *mut _, s.len as usize) };
}

impl Drop for UffdProtect {
    fn drop(&mut self) {
        for (_, s) in self.armed.drain() {
            unmap_staging(&s);
        }
        for s in self.spare.drain(..) {
            unmap_staging(&s);
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

impl super::FaultSource for FaultReader {
    fn next_timeout(&self, timeout: std::time::Duration) -> Option<Fault> {
        FaultReader::next_timeout(self, timeout)
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

    fn can_arm(&self) -> bool {
        self.can_move
    }

    fn arm(&mut self, range: Range<u64>) -> Result<(), crate::conn::OpError> {
        UffdProtect::arm(self, range).map_err(|_| crate::conn::OpError::Local)
    }

    fn staging(&self, range: &Range<u64>) -> Option<u64> {
        UffdProtect::staging(self, range)
    }

    fn land(&mut self, range: &Range<u64>) -> Result<(), crate::conn::OpError> {
        UffdProtect::land(self, range).map_err(|_| crate::conn::OpError::Local)
    }

    fn disarm(&mut self, range: Range<u64>, outcome: crate::conn::DisarmOutcome) {
        UffdProtect::disarm(self, range, outcome);
    }

    fn wake(&mut self, range: Range<u64>) {
        UffdProtect::wake(self, range);
    }

    fn forget(&mut self, range: Range<u64>) {
        UffdProtect::forget(self, range);
    }
}

#[cfg(test)]
mod tests;
