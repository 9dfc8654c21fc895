//! Write protection with a full userfaultfd.
//!
//! A *full* userfaultfd (`user_mode_only(false)`, which needs root,
//! CAP_SYS_PTRACE or access to `/dev/userfaultfd`) also catches faults taken
//! inside the kernel: a `read(fd, protected_buf)` waits for the handler instead
//! of failing with EFAULT. That is what makes protecting buffers the program
//! may hand to syscalls safe.
//!
//! One userfaultfd serves the whole process (a mapping can be registered
//! with only one), shared by every connection's [`UffdProtect`]: it keeps
//! the registrations, a process-wide count of protections per page (two
//! connections may send the same buffer; the pages stay protected until
//! both are done), and who holds which pages. A dispatcher thread reads the
//! faults and hands each to the inbox of every connection holding that
//! page; a fault on a page nobody holds any more is woken at once. A forked
//! child gets a userfaultfd of its own when it first protects something.
//!
//! Protecting registers the whole mapping holding the pages once
//! (UFFDIO_REGISTER, write-protect mode), so the mapping is never split
//! into a piece per send and later sends only toggle protection
//! (UFFDIO_WRITEPROTECT). The cache of registered mappings can go stale
//! when memory is unmapped behind our back (glibc's `free` does that): a
//! write-protect that then fails registers the whole mapping again. Pages
//! never touched are protected too: with `UFFD_FEATURE_WP_UNPOPULATED` by the
//! kernel, otherwise by reading each page first (which maps the zero page,
//! which write-protection then covers).
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
//! The dispatcher reads one fixed-size message at a time, allocates nothing
//! (inboxes are bounded, preallocated channels) and touches no application
//! memory.
//!
//! `unsafe` here: pre-touching pages by address, and the calls of `sys`
//! that change what our address space maps.

use crate::sync::{Lock, LockGuard};
use std::collections::HashMap;
use std::ops::Range;
use std::sync::Arc;
use std::time::Duration;

use crossbeam_channel::{Receiver, Sender};

use crate::pages::RangeCounter;

mod sys;

use sys::{
    FEATURE_MOVE, FEATURE_POISON, FEATURE_WP, FEATURE_WP_SHMEM, FEATURE_WP_UNPOPULATED,
    MOVE_ALLOW_SRC_HOLES, MOVE_DONTWAKE, REGISTER_MISSING, REGISTER_WP, Userfaultfd,
};

pub use super::{Fault, ProtectError};

/// The process's userfaultfd and what it knows, shared by every connection.
struct Process {
    uffd: Userfaultfd,
    pid: u32,
    wp_unpopulated: bool,
    can_move: bool,
    can_poison: bool,
    wp_shmem: bool,
    state: Lock<State>,
}

#[derive(Default)]
struct State {
    /// Mappings (their extents when registered) believed registered. A hit
    /// skips the registration; an entry made stale by memory unmapped and
    /// mapped again behind our back shows as a failed write-protect, after
    /// which the mapping is registered again.
    registered: Vec<Range<u64>>,
    /// Armed pages (registered in MISSING mode too while armed).
    armed: RangeCounter,
    /// Protections per page, over all connections.
    wp: RangeCounter,
    /// Who holds which pages, protected or armed: (pages, owner, where the
    /// owner knows them). An alias's faults are reported at the address the
    /// owner protected, which shows the same pages.
    held: Vec<Held>,
    /// Each owner's fault inbox.
    inboxes: HashMap<u32, Sender<Fault>>,
    /// Each owner's waker, called once its inbox has a fault.
    wakers: HashMap<u32, super::FaultWaker>,
    next_owner: u32,
}

struct Held {
    pages: Range<u64>,
    owner: u32,
    /// Address the owner knows `pages.start` by (itself, or the primary of
    /// an alias).
    known_as: u64,
}

/// Faults an inbox holds before the dispatcher drops more (a dropped fault
/// only means the writer waits until the pages are released). Each is a
/// thread stopped on this connection's pages, so a few dozen is plenty;
/// preallocated per connection, 256 were 6 KiB of every connection's memory.
const INBOX: usize = 32;

static PROCESS: Lock<Option<Arc<Process>>> = Lock::new(None);

/// The locks of this module, held by the fork handler across `fork()` (a
/// child protecting memory takes them to make its own userfaultfd).
pub(crate) fn fork_guards() -> Vec<Box<dyn std::any::Any>> {
    vec![Box::new(PROCESS.lock())]
}

impl Process {
    /// This process's userfaultfd (a forked child makes its own).
    fn get() -> Result<Arc<Process>, ProtectError> {
        crate::process::ensure_atfork();
        let mut p = PROCESS.lock();
        let pid = crate::process::pid();
        if let Some(have) = p.as_ref()
            && have.pid == pid
        {
            return Ok(Arc::clone(have));
        }
        let fresh = Arc::new(Process::open(pid)?);
        let d = Arc::clone(&fresh);
        crate::threads::spawn("azsdp-uffd", move || d.dispatch())
            .map_err(|e| ProtectError::Unavailable(format!("fault thread: {e}")))?;
        *p = Some(Arc::clone(&fresh));
        Ok(fresh)
    }

    fn open(pid: u32) -> Result<Process, ProtectError> {
        // The richest feature set this kernel grants (UFFDIO_API fails on
        // any feature it lacks).
        let wp = FEATURE_WP;
        let attempts = [
            wp | FEATURE_WP_UNPOPULATED | FEATURE_MOVE | FEATURE_POISON | FEATURE_WP_SHMEM,
            wp | FEATURE_WP_UNPOPULATED | FEATURE_MOVE | FEATURE_POISON,
            wp | FEATURE_WP_UNPOPULATED | FEATURE_MOVE,
            wp | FEATURE_WP_UNPOPULATED,
            wp,
        ];
        let mut last = None;
        for f in attempts {
            match Userfaultfd::open(f) {
                Ok(uffd) => {
                    return Ok(Process {
                        uffd,
                        pid,
                        wp_unpopulated: f & FEATURE_WP_UNPOPULATED != 0,
                        can_move: f & FEATURE_MOVE != 0,
                        can_poison: f & FEATURE_POISON != 0,
                        wp_shmem: f & FEATURE_WP_SHMEM != 0,
                        state: Lock::new(State::default()),
                    });
                }
                Err(e) => last = Some(e),
            }
        }
        Err(ProtectError::Unavailable(
            last.map_or_else(String::new, |e| e.to_string()),
        ))
    }

    fn lock(&self) -> LockGuard<'_, State> {
        self.state.lock()
    }

    /// The dispatcher: read faults, hand each to whoever holds its page.
    fn dispatch(&self) {
        loop {
            // SAFETY: the userfaultfd lives as long as `self`.
            let fd = unsafe { std::os::fd::BorrowedFd::borrow_raw(self.uffd.as_raw_fd()) };
            let got =
                crate::poll_fd::poll_fd(fd, libc::POLLIN, Some(std::time::Duration::from_secs(1)));
            if got == 0 {
                if crate::process::pid() != self.pid {
                    return;
                }
                continue;
            }
            let Some(pf) = self.uffd.read_fault() else {
                continue;
            };
            let f = Fault {
                addr: pf.addr,
                write: pf.write,
                wp: pf.wp,
            };
            let page_len = crate::pages::system_page_size();
            let page = f.addr & !(page_len - 1);
            let st = self.lock();
            let mut told = false;
            for h in &st.held {
                if h.pages.start <= f.addr
                    && f.addr < h.pages.end
                    && let Some(tx) = st.inboxes.get(&h.owner)
                {
                    // Reported where the owner knows the page (an alias's
                    // fault at the address the owner protected).
                    let addr = h.known_as + (f.addr - h.pages.start);
                    let sent = tx.try_send(Fault { addr, ..f }).is_ok();
                    if sent && let Some(w) = st.wakers.get(&h.owner) {
                        w();
                    }
                    told |= sent;
                }
            }
            drop(st);
            if !told {
                // Nobody holds it (any more): let the thread retry. A
                // missing page nobody armed reads as zeros, as it would
                // have without us.
                if !f.wp {
                    // SAFETY: fills a hole in a registered range with the
                    // zero page and wakes its waiters.
                    let _ = unsafe { self.uffd.zeropage(&(page..page + page_len)) };
                }
                let _ = self.uffd.wake(&(page..page + page_len));
            }
        }
    }

    fn register_mode(&self, r: &Range<u64>, mode: u32) -> Result<(), String> {
        self.uffd
            .register(r, mode)
            .map_err(|e| format!("UFFDIO_REGISTER: {e}"))
    }

    /// Register `r` in write-protect mode (unless the cache says it is),
    /// except its armed parts, which keep MISSING mode.
    fn ensure_registered(&self, st: &mut State, r: &Range<u64>) -> Result<(), ProtectError> {
        if st
            .registered
            .iter()
            .any(|g| g.start <= r.start && r.end <= g.end)
        {
            return Ok(());
        }
        self.register(st, r)?;
        st.registered.retain(|g| !crate::pages::overlaps(g, r));
        st.registered.push(r.clone());
        Ok(())
    }

    /// Register `r` in write-protect mode, except its armed parts.
    /// Registering what is already registered the same way changes nothing.
    fn register(&self, st: &State, r: &Range<u64>) -> Result<(), ProtectError> {
        let mut cur = r.start;
        let mut parts = Vec::new();
        for a in st.armed.intersect(r) {
            if a.start > cur {
                parts.push(cur..a.start);
            }
            cur = a.end;
        }
        if cur < r.end {
            parts.push(cur..r.end);
        }
        for part in parts {
            self.register_mode(&part, REGISTER_WP)
                .map_err(|why| ProtectError::Register {
                    range: part.clone(),
                    why,
                })?;
        }
        Ok(())
    }

    /// Unregister the parts of `r` that nobody protects or arms.
    fn forget_registration(&self, st: &mut State, r: &Range<u64>) {
        st.registered.retain(|g| !crate::pages::overlaps(g, r));
        if st.wp.overlaps(r)
            || st.armed.overlaps(r)
            || st.held.iter().any(|h| crate::pages::overlaps(&h.pages, r))
        {
            return;
        }
        let _ = self.uffd.unregister(r);
    }

    fn write_protect(&self, r: &Range<u64>) -> Result<(), String> {
        if !self.wp_unpopulated {
            let mut a = r.start;
            while a < r.end {
                // SAFETY: the range is registered, so it is mapped; a read
                // maps the zero page into a never-touched page (which
                // write-protection then covers) and changes nothing else.
                unsafe { std::ptr::read_volatile(a as *const u8) };
                a += crate::pages::system_page_size();
            }
        }
        self.uffd
            .write_protect(r)
            .map_err(|e| format!("UFFDIO_WRITEPROTECT: {e}"))
    }
}

/// One connection's page protection, on the process's userfaultfd.
pub struct UffdProtect {
    proc: Arc<Process>,
    owner: u32,
    inbox: Receiver<Fault>,
    page: u64,
    /// Armed ranges (by start) and the staging pages holding their data.
    armed: HashMap<u64, Staging>,
    /// Staging mappings not in use, kept for the next arm.
    spare: Vec<Staging>,
    /// Aliases protected along with this connection's pages: (alias pages,
    /// the address they show).
    aliases: Vec<(Range<u64>, u64)>,
}

impl std::fmt::Debug for UffdProtect {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("UffdProtect")
            .field("owner", &self.owner)
            .field("armed", &self.armed.len())
            .finish()
    }
}

/// A private anonymous mapping, registered with the userfaultfd (which
/// `UFFDIO_MOVE` requires of its destination), that the pages of an armed
/// range live in while their data is on its way.
#[derive(Debug)]
struct Staging {
    addr: u64,
    len: u64,
}

/// Most bytes of spare staging kept mapped, per connection.
const SPARE_STAGING: u64 = 64 << 20;

/// One connection's faults.
#[derive(Clone)]
pub struct FaultReader {
    inbox: Receiver<Fault>,
    proc: Arc<Process>,
    owner: u32,
}

impl std::fmt::Debug for FaultReader {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("FaultReader")
            .field("owner", &self.owner)
            .finish()
    }
}

/// EAGAINs in a row (no page moved) before `UFFDIO_MOVE` is given up.
const MOVE_RETRIES: u32 = 200;

impl UffdProtect {
    /// Page protection on the process's full userfaultfd.
    pub fn new() -> Result<UffdProtect, ProtectError> {
        let proc = Process::get()?;
        let (tx, inbox) = crossbeam_channel::bounded(INBOX);
        let owner = {
            let mut st = proc.lock();
            st.next_owner += 1;
            let owner = st.next_owner;
            st.inboxes.insert(owner, tx);
            owner
        };
        let page = crate::pages::system_page_size();
        Ok(UffdProtect {
            proc,
            owner,
            inbox,
            page,
            armed: HashMap::new(),
            spare: Vec::new(),
            aliases: Vec::new(),
        })
    }

    /// Can shared memory be protected with all its aliases?
    pub fn can_protect_aliases(&self) -> bool {
        self.proc.wp_shmem
    }

    /// Does the kernel protect never-touched pages itself?
    pub fn wp_unpopulated(&self) -> bool {
        self.proc.wp_unpopulated
    }

    /// Can receives be armed (needs `UFFDIO_MOVE`)?
    pub fn can_arm(&self) -> bool {
        self.proc.can_move
    }

    /// Can lost data be poisoned (`UFFDIO_POISON`)?
    pub fn can_poison(&self) -> bool {
        self.proc.can_poison
    }

    pub fn page_size(&self) -> u64 {
        self.page
    }

    /// This connection's faults (the reactor takes them).
    pub fn faults(&self) -> FaultReader {
        FaultReader {
            inbox: self.inbox.clone(),
            proc: Arc::clone(&self.proc),
            owner: self.owner,
        }
    }

    fn hold(&self, st: &mut State, r: Range<u64>, known_as: u64) {
        st.held.push(Held {
            pages: r,
            owner: self.owner,
            known_as,
        });
    }

    /// Drop this owner's hold on `r` (splitting holds that extend past it).
    fn release(&self, st: &mut State, r: &Range<u64>) {
        let mut keep = Vec::new();
        st.held.retain(|h| {
            if h.owner != self.owner || !crate::pages::overlaps(&h.pages, r) {
                return true;
            }
            if h.pages.start < r.start {
                keep.push(Held {
                    pages: h.pages.start..r.start,
                    owner: h.owner,
                    known_as: h.known_as,
                });
            }
            if r.end < h.pages.end {
                keep.push(Held {
                    pages: r.end..h.pages.end,
                    owner: h.owner,
                    known_as: h.known_as + (r.end - h.pages.start),
                });
            }
            false
        });
        st.held.extend(keep);
    }

    /// Write-protect `r` (registered, counted, held as `known_as`).
    fn protect_one(
        &self,
        st: &mut State,
        r: &Range<u64>,
        known_as: u64,
        extent: &Range<u64>,
    ) -> Result<(), ProtectError> {
        let proc = &self.proc;
        if proc.ensure_registered(st, extent).is_err() {
            proc.ensure_registered(st, r)?;
        }
        let fresh = st.wp.add(r.clone());
        for (i, f) in fresh.iter().enumerate() {
            let mut done = proc.write_protect(f);
            if done.is_err() {
                // The cached registration went with memory unmapped behind
                // our back: register the mapping again and retry once.
                done = proc
                    .register(st, extent)
                    .or_else(|_| proc.register(st, r))
                    .map_err(|e| e.to_string())
                    .and_then(|()| proc.write_protect(f));
            }
            if let Err(why) = done {
                for undo in &fresh[..i] {
                    let _ = proc.uffd.remove_write_protection(undo, true);
                }
                let _ = st.wp.remove(r.clone());
                return Err(ProtectError::Ioctl {
                    range: r.clone(),
                    why,
                });
            }
        }
        self.hold(st, r.clone(), known_as);
        Ok(())
    }

    /// Lift this connection's protection of `r` (its count).
    fn unprotect_one(&self, st: &mut State, r: &Range<u64>) -> Result<(), ProtectError> {
        self.release(st, r);
        let free = st.wp.remove(r.clone()).unwrap_or_else(|partial| partial);
        for f in free {
            self.proc
                .uffd
                .remove_write_protection(&f, true)
                .map_err(|e| ProtectError::Ioctl {
                    range: f.clone(),
                    why: e.to_string(),
                })?;
        }
        Ok(())
    }

    /// Write-protect whole pages `r`, registering them first if needed.
    /// Shared memory is protected at every address it is mapped at in this
    /// process (its aliases), or not at all.
    pub fn protect(&mut self, r: Range<u64>) -> Result<(), ProtectError> {
        debug_assert!(r.start.is_multiple_of(self.page) && r.end.is_multiple_of(self.page));
        let mapping = crate::memory_map::mapping_of(r.start);
        let shared = mapping
            .as_ref()
            .is_some_and(|v| v.kind == crate::memory_map::Kind::Shared);
        let extent = match &mapping {
            Some(v) if v.range.start <= r.start && r.end <= v.range.end => v.range.clone(),
            _ => r.clone(),
        };
        let aliases = if shared {
            crate::memory_map::MemoryMap::read()
                .map(|m| m.aliases(&r))
                .unwrap_or_default()
        } else {
            Vec::new()
        };
        let proc = Arc::clone(&self.proc);
        let mut st = proc.lock();
        self.protect_one(&mut st, &r, r.start, &extent)?;
        for (i, (alias, shows)) in aliases.iter().enumerate() {
            if let Err(e) = self.protect_one(&mut st, alias, *shows, alias) {
                // All or nothing: an unprotected alias would let writes by.
                for (done, _) in &aliases[..i] {
                    let _ = self.unprotect_one(&mut st, done);
                }
                let _ = self.unprotect_one(&mut st, &r);
                return Err(e);
            }
        }
        self.aliases.extend(aliases);
        Ok(())
    }

    /// Lift this connection's protection of `r` (and of the aliases that
    /// show it); the pages become writable (and their writers are woken)
    /// when no connection protects them.
    pub fn unprotect(&mut self, r: Range<u64>) -> Result<(), ProtectError> {
        let proc = Arc::clone(&self.proc);
        let mut st = proc.lock();
        let mut result = self.unprotect_one(&mut st, &r);
        let mut keep = Vec::new();
        for (alias, shows) in std::mem::take(&mut self.aliases) {
            let shown = shows..shows + (alias.end - alias.start);
            if !crate::pages::overlaps(&shown, &r) {
                keep.push((alias, shows));
                continue;
            }
            let lo = shown.start.max(r.start);
            let hi = shown.end.min(r.end);
            let part = alias.start + (lo - shows)..alias.start + (hi - shows);
            if let Err(e) = self.unprotect_one(&mut st, &part) {
                result = Err(e);
            }
            if shown.start < lo {
                keep.push((alias.start..part.start, shows));
            }
            if hi < shown.end {
                keep.push((part.end..alias.end, hi));
            }
        }
        self.aliases = keep;
        result
    }

    /// Wake threads waiting on `r` (a fault that turned out to need
    /// nothing), and at the aliases that show it.
    pub fn wake(&self, r: Range<u64>) {
        let wake = |a: &Range<u64>| {
            let _ = self.proc.uffd.wake(a);
        };
        wake(&r);
        for (alias, shows) in &self.aliases {
            let shown = *shows..*shows + (alias.end - alias.start);
            if crate::pages::overlaps(&shown, &r) {
                wake(alias);
            }
        }
    }

    /// `UFFDIO_MOVE` of `len` bytes from `src` to `dst` (both private
    /// anonymous, `dst` registered and unpopulated), retrying partial moves.
    fn move_pages(&self, dst: u64, src: u64, len: u64, mode: u64) -> Result<(), String> {
        let mut done = 0u64;
        let mut busy = 0u32;
        while done < len {
            // SAFETY: both ranges are private anonymous memory of ours, the
            // destination registered (the callers' contract).
            let (moved, r) = unsafe {
                self.proc
                    .uffd
                    .move_pages(dst + done, src + done, len - done, mode)
            };
            done += moved;
            match r {
                Ok(()) if moved == 0 => break,
                Ok(()) => {}
                // EAGAIN is transient (a folio lock, a split under way)...
                Err(e) if e.raw_os_error() == Some(libc::EAGAIN) && busy < MOVE_RETRIES => {
                    busy = if moved > 0 { 0 } else { busy + 1 };
                    std::thread::yield_now();
                }
                // ...or so it should be: give up after a bound rather than
                // spin on a condition that lasts (a huge page that cannot be
                // split while another of its pages is pinned says EBUSY on
                // 6.18; 6.12 retries inside the kernel and never returns,
                // which no bound here can help: see `rx.rs` on the order of
                // arming and registering). The receive runs synchronously.
                Err(e) if e.raw_os_error() == Some(libc::EAGAIN) => {
                    return Err(format!("UFFDIO_MOVE: still busy after {busy} tries ({e})"));
                }
                Err(e) => return Err(format!("UFFDIO_MOVE: {e}")),
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
        // No huge pages in staging: landing moves pages out of it, which a
        // huge page allows only while none of its pages is pinned, and a
        // NIC pins the staging pages of every GET in flight (6.12 retries
        // such a move inside the kernel for ever).
        // SAFETY: advice on our own fresh mapping.
        unsafe { libc::madvise(p, len as usize, libc::MADV_NOHUGEPAGE) };
        let s = Staging {
            addr: p as u64,
            len,
        };
        // Registered (write-protect mode: nothing there ever faults to us)
        // because UFFDIO_MOVE only moves into registered ranges.
        if let Err(e) = self
            .proc
            .register_mode(&(s.addr..s.addr + len), REGISTER_WP)
        {
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
        debug_assert!(r.start.is_multiple_of(self.page) && r.end.is_multiple_of(self.page));
        let fail = |why: String| ProtectError::Arm {
            range: r.clone(),
            why,
        };
        if !self.proc.can_move {
            return Err(fail("the kernel has no UFFDIO_MOVE".into()));
        }
        let len = r.end - r.start;
        let stage = self.take_staging(len).map_err(fail)?;
        let proc = Arc::clone(&self.proc);
        let mut st = proc.lock();
        if st.wp.overlaps(&r) {
            drop(st);
            self.give_back_staging(stage);
            return Err(fail("pages are write-protected for a send".into()));
        }
        // MISSING mode on top of write-protect: an access to a page that
        // has moved out now faults to us, by the program or by the kernel.
        if let Err(e) = proc.register_mode(&r, REGISTER_MISSING | REGISTER_WP) {
            drop(st);
            self.give_back_staging(stage);
            return Err(fail(e));
        }
        st.armed.add(r.clone());
        self.hold(&mut st, r.clone(), r.start);
        drop(st);
        // Holes (never-touched pages) stay holes in staging.
        let moved = self.move_pages(
            stage.addr,
            r.start,
            len,
            MOVE_DONTWAKE | MOVE_ALLOW_SRC_HOLES,
        );
        if let Err(e) = moved {
            // Whatever moved goes back; the receive runs synchronously.
            let _ = self.move_pages(r.start, stage.addr, len, MOVE_ALLOW_SRC_HOLES);
            let _ = self.proc.register_mode(&r, REGISTER_WP);
            let mut st = proc.lock();
            let _ = st.armed.remove(r.clone());
            self.release(&mut st, &r);
            drop(st);
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
        self.move_pages(r.start, s, r.end - r.start, MOVE_ALLOW_SRC_HOLES)
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
                let _ = self.move_pages(r.start, stage.addr, len, MOVE_ALLOW_SRC_HOLES);
            }
            DisarmOutcome::Lost => {
                // SAFETY: holes of our own registered range, which must
                // not be read (the data never came).
                let poisoned = self.proc.can_poison && unsafe { self.proc.uffd.poison(&r) }.is_ok();
                if !poisoned {
                    // SAFETY: maps the zero page into holes of our own
                    // registered range (and wakes their waiters).
                    let _ = unsafe { self.proc.uffd.zeropage(&r) };
                }
            }
        }
        // Back to write-protect mode only: no later fault on these pages
        // is ours. Staging pages that still hold data are discarded.
        let proc = Arc::clone(&self.proc);
        let mut st = proc.lock();
        let _ = proc.register_mode(&r, REGISTER_WP);
        let _ = st.armed.remove(r.clone());
        self.release(&mut st, &r);
        drop(st);
        self.wake(r);
        // SAFETY: staging is our own private mapping; dropping its pages
        // (moved-back holes or leftovers) is what we want before reuse.
        unsafe { libc::madvise(stage.addr as *mut _, len as usize, libc::MADV_DONTNEED) };
        self.give_back_staging(stage);
    }

    /// Forget registrations in `r` (its memory is being unmapped).
    pub fn forget(&mut self, r: Range<u64>) {
        let proc = Arc::clone(&self.proc);
        let mut st = proc.lock();
        proc.forget_registration(&mut st, &r);
    }
}

fn unmap_staging(s: &Staging) {
    // SAFETY: unmapping a staging mapping we made, which nothing else uses.
    unsafe { libc::munmap(s.addr as *mut _, s.len as usize) };
}

impl Drop for UffdProtect {
    fn drop(&mut self) {
        let proc = Arc::clone(&self.proc);
        if proc.pid != crate::process::pid() {
            // A forked child's copy: the userfaultfd is the parent's.
            return;
        }
        let mut st = proc.lock();
        st.inboxes.remove(&self.owner);
        st.wakers.remove(&self.owner);
        // Whatever this connection still holds is released.
        let mine: Vec<Range<u64>> = st
            .held
            .iter()
            .filter(|h| h.owner == self.owner && h.known_as == h.pages.start)
            .map(|h| h.pages.clone())
            .collect();
        drop(st);
        for r in mine {
            if self.armed.contains_key(&r.start) {
                self.disarm(r, crate::conn::DisarmOutcome::Abandoned);
            } else {
                let _ = self.unprotect(r);
            }
        }
        for (_, s) in self.armed.drain() {
            unmap_staging(&s);
        }
        for s in self.spare.drain(..) {
            unmap_staging(&s);
        }
    }
}

impl FaultReader {
    /// The next fault on this connection's pages, waiting at most `timeout`.
    pub fn next_timeout(&self, timeout: Duration) -> Option<Fault> {
        self.inbox.recv_timeout(timeout).ok()
    }

    /// Wait for the next fault, however long it takes.
    pub fn next(&self) -> Option<Fault> {
        self.inbox.recv().ok()
    }
}

impl super::FaultSource for FaultReader {
    fn try_next(&self) -> Option<Fault> {
        self.inbox.try_recv().ok()
    }

    fn next_timeout(&self, timeout: Duration) -> Option<Fault> {
        FaultReader::next_timeout(self, timeout)
    }

    /// The dispatcher calls `waker` after each fault it puts in the inbox.
    fn watch(&self, waker: super::FaultWaker) -> Option<i32> {
        self.proc.lock().wakers.insert(self.owner, waker);
        // One that came before the waker did is not lost.
        if !self.inbox.is_empty()
            && let Some(w) = self.proc.lock().wakers.get(&self.owner)
        {
            w();
        }
        None
    }
}

impl super::Protector for UffdProtect {
    fn can_protect(&self) -> bool {
        true
    }

    fn protect(&mut self, ranges: &[Range<u64>]) -> Result<(), crate::conn::OpError> {
        for (i, r) in ranges.iter().enumerate() {
            if UffdProtect::protect(self, r.clone()).is_err() {
                // All or nothing: the engine assumes a failed prepare left
                // nothing protected.
                for done in &ranges[..i] {
                    let _ = UffdProtect::unprotect(self, done.clone());
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
        self.proc.can_move
    }

    fn can_protect_aliases(&self) -> bool {
        self.proc.wp_shmem
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
