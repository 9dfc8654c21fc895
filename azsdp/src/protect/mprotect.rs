//! Write protection with `mprotect` and a SIGSEGV handler: the fallback
//! when no full userfaultfd is available.
//!
//! The trade-off (see `docs/protection.md`): a *syscall* that writes a page
//! protected this way fails with EFAULT instead of waiting, because the
//! kernel does not raise a signal for its own accesses. So this backend is
//! used only when the configuration asks for it (`protection = "mprotect"`);
//! under `auto`, a host without a full userfaultfd runs zero-copy sends
//! synchronously (ZSDP) instead. The preload shim narrows the gap by
//! settling in-flight pages before the calls it interposes (read, recv, ...)
//! write them, but cannot for syscalls it does not see.
//!
//! How it works: protected ranges live in a fixed, process-wide table of
//! atomic slots, each tagged with its owner (one per [`MprotectProtect`]).
//! The handler, on a write to a read-only page, looks the address up: if it
//! is ours, it writes a fixed-size record to the owner's pipe (its fault
//! thread reads it) and waits on a futex until the page is no longer
//! protected, then returns and the write is retried. Anything else is
//! passed to the handler that was installed before ours, or to the default
//! action. The handler allocates nothing, takes no lock and touches no
//! application memory: atomics, `write(2)`, `futex(2)`.
//!
//! `unsafe` here: the signal handler and its installation, `mprotect`, and
//! the raw pipe calls.

use std::cell::UnsafeCell;
use std::ops::Range;
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd};
use std::sync::atomic::{AtomicI32, AtomicU32, AtomicU64, Ordering};
use std::time::Duration;

use super::{Fault, FaultSource, ProtectError};
use crate::conn::{DisarmOutcome, OpError};

/// Protected ranges the whole process can have at once.
const SLOTS: usize = 4096;
/// Protectors the process can have at once.
const OWNERS: usize = 256;

struct Slot {
    start: AtomicU64,
    end: AtomicU64,
    owner: AtomicU32,
}

#[allow(clippy::declare_interior_mutable_const)]
const EMPTY: Slot = Slot {
    start: AtomicU64::new(0),
    end: AtomicU64::new(0),
    owner: AtomicU32::new(0),
};

static TABLE: [Slot; SLOTS] = [EMPTY; SLOTS];

#[allow(clippy::declare_interior_mutable_const)]
const NO_PIPE: AtomicI32 = AtomicI32::new(-1);
/// Write end of each owner's fault pipe (-1: none).
static PIPES: [AtomicI32; OWNERS] = [NO_PIPE; OWNERS];

/// Bumped whenever protection is lifted or a waiter should look again; the
/// handler's futex word.
static GEN: AtomicU32 = AtomicU32::new(0);

/// The SIGSEGV action that was in place before ours (written once, before
/// ours is installed; read-only afterwards).
struct OldAction(UnsafeCell<Option<libc::sigaction>>);
// SAFETY: written once under `INSTALL` before the handler that reads it
// exists; never written again.
unsafe impl Sync for OldAction {}
static OLD: OldAction = OldAction(UnsafeCell::new(None));
static INSTALL: crate::fork_once::ForkOnce = crate::fork_once::ForkOnce::new();
static INSTALLED: AtomicU32 = AtomicU32::new(0);

/// The owner of the protected range holding `addr`, if any.
fn lookup(addr: u64) -> Option<u32> {
    TABLE.iter().find_map(|s| {
        let start = s.start.load(Ordering::Acquire);
        (start != 0 && start <= addr && addr < s.end.load(Ordering::Acquire))
            .then(|| s.owner.load(Ordering::Acquire))
    })
}

fn bump_and_wake() {
    GEN.fetch_add(1, Ordering::SeqCst);
    crate::futex::wake_all(&GEN);
}

/// `si_code` of a fault on a page whose protection forbids the access.
const SEGV_ACCERR: libc::c_int = 2;

/// The fault record a handler writes to its owner's pipe.
const RECORD: usize = 16;

extern "C" fn on_segv(sig: libc::c_int, info: *mut libc::siginfo_t, ctx: *mut libc::c_void) {
    // SAFETY: the kernel passes a valid siginfo for SA_SIGINFO handlers.
    let (code, addr) = unsafe { ((*info).si_code, (*info).si_addr() as u64) };
    if code == SEGV_ACCERR
        && let Some(owner) = lookup(addr)
    {
        // SAFETY: errno is thread-local; save it so the interrupted code
        // does not see ours.
        let errno = unsafe { *libc::__errno_location() };
        let fd = PIPES
            .get(owner as usize)
            .map_or(-1, |p| p.load(Ordering::Acquire));
        if fd >= 0 {
            let mut rec = [0u8; RECORD];
            rec[..8].copy_from_slice(&addr.to_le_bytes());
            rec[8] = 1; // a write
            // SAFETY: write(2) of a stack buffer: async-signal-safe. A full
            // pipe (non-blocking) drops the record: the writer then waits
            // for the transfer, as under block-on-write.
            unsafe { libc::write(fd, rec.as_ptr().cast(), RECORD) };
        }
        loop {
            let seen = GEN.load(Ordering::SeqCst);
            if lookup(addr).is_none() {
                break;
            }
            crate::futex::wait(&GEN, seen, Duration::from_millis(50));
        }
        // SAFETY: as above.
        unsafe { *libc::__errno_location() = errno };
        return;
    }
    if code == SEGV_ACCERR && resolved_meanwhile(addr) {
        // Ours after all: unprotected between the fault and our look.
        return;
    }
    chain(sig, info, ctx);
}

/// A write fault on a page not in the table: was it protected by us and
/// unprotected between the fault and the lookup (so a retry succeeds)?
/// Asks the kernel whether the mapping is writable now (`PROCMAP_QUERY`);
/// without that ioctl, lets the same address retry a few times.
fn resolved_meanwhile(addr: u64) -> bool {
    match writable_now(addr) {
        Some(w) => w,
        None => {
            static LAST: AtomicU64 = AtomicU64::new(0);
            static TRIES: AtomicU32 = AtomicU32::new(0);
            if LAST.swap(addr, Ordering::AcqRel) == addr {
                TRIES.fetch_add(1, Ordering::AcqRel) < 3
            } else {
                TRIES.store(0, Ordering::Release);
                true
            }
        }
    }
}

/// Is the mapping holding `addr` writable? `None` if the kernel cannot
/// say. Only async-signal-safe calls: open, ioctl, close.
fn writable_now(addr: u64) -> Option<bool> {
    use crate::memory_map::{PROCMAP_QUERY, ProcmapQuery, VMA_WRITABLE};
    // SAFETY: a NUL-terminated path; the descriptor is closed below.
    let fd = unsafe {
        libc::open(
            c"/proc/self/maps".as_ptr(),
            libc::O_RDONLY | libc::O_CLOEXEC,
        )
    };
    if fd < 0 {
        return None;
    }
    let mut q = ProcmapQuery {
        size: std::mem::size_of::<ProcmapQuery>() as u64,
        query_addr: addr,
        ..ProcmapQuery::default()
    };
    // SAFETY: PROCMAP_QUERY reads and writes only `q` (no name buffer).
    let rc = unsafe { crate::own_ioctl::ioctl(fd, PROCMAP_QUERY, (&raw mut q) as usize) };
    // SAFETY: closing the descriptor opened above.
    unsafe { libc::close(fd) };
    (rc == 0).then_some(q.vma_flags & VMA_WRITABLE != 0)
}

/// Not ours: hand the signal to whoever had it before, as if we were not here.
fn chain(sig: libc::c_int, info: *mut libc::siginfo_t, ctx: *mut libc::c_void) {
    // SAFETY: OLD was written before our handler was installed and is
    // never written again.
    let old = unsafe { *OLD.0.get() };
    let Some(old) = old else {
        default_action(sig);
        return;
    };
    let h = old.sa_sigaction;
    if h == libc::SIG_DFL || h == libc::SIG_IGN {
        // Ignoring a fault would retry it forever: take the default action.
        default_action(sig);
    } else if old.sa_flags & libc::SA_SIGINFO != 0 {
        // SAFETY: the previous handler was installed with SA_SIGINFO, so
        // this is its three-argument entry point.
        let f: extern "C" fn(libc::c_int, *mut libc::siginfo_t, *mut libc::c_void) =
            unsafe { std::mem::transmute(h) };
        f(sig, info, ctx);
    } else {
        // SAFETY: a one-argument handler (installed without SA_SIGINFO).
        let f: extern "C" fn(libc::c_int) = unsafe { std::mem::transmute(h) };
        f(sig);
    }
}

/// Restore the default action; returning re-executes the faulting
/// instruction, which then takes it (core dump), as without us.
fn default_action(sig: libc::c_int) {
    // SAFETY: a zeroed sigaction is SIG_DFL with an empty mask.
    let mut dfl: libc::sigaction = unsafe { std::mem::zeroed() };
    dfl.sa_sigaction = libc::SIG_DFL;
    // SAFETY: sigaction is async-signal-safe; both pointers are valid.
    unsafe { libc::sigaction(sig, &dfl, std::ptr::null_mut()) };
}

/// Install our handler over whatever is there, remembering it for `chain`.
///
/// # Safety
/// No thread may be running `on_segv` (it reads OLD): call it once, before
/// any page is protected, or in a single-threaded process.
unsafe fn install_handler() {
    // SAFETY: zeroed sigaction structs are valid; we fill in ours and read
    // the previous one into OLD before ours can run.
    unsafe {
        let mut old: libc::sigaction = std::mem::zeroed();
        let mut act: libc::sigaction = std::mem::zeroed();
        act.sa_sigaction = on_segv as *const () as usize;
        act.sa_flags = libc::SA_SIGINFO | libc::SA_RESTART | libc::SA_ONSTACK;
        libc::sigemptyset(&mut act.sa_mask);
        if libc::sigaction(libc::SIGSEGV, std::ptr::null(), &mut old) != 0 {
            return;
        }
        *OLD.0.get() = Some(old);
        if libc::sigaction(libc::SIGSEGV, &act, std::ptr::null_mut()) == 0 {
            INSTALLED.store(1, Ordering::Release);
        }
    }
}

fn install() -> Result<(), ProtectError> {
    // SAFETY: the first installation, before any page is protected.
    INSTALL.call(|| unsafe { install_handler() });
    if INSTALLED.load(Ordering::Acquire) == 1 {
        Ok(())
    } else {
        Err(ProtectError::Unavailable(
            "cannot install the SIGSEGV handler".into(),
        ))
    }
}

/// Page protection with `mprotect` + SIGSEGV, for one connection.
#[derive(Debug)]
pub struct MprotectProtect {
    owner: u32,
    /// Our slots in the table, and their ranges.
    mine: Vec<(usize, Range<u64>)>,
    read_end: std::sync::Arc<OwnedFd>,
    page: u64,
}

/// Reads the faults the handler reports for one protector.
#[derive(Debug, Clone)]
pub struct SignalFaults {
    read_end: std::sync::Arc<OwnedFd>,
}

impl MprotectProtect {
    pub fn new() -> Result<MprotectProtect, ProtectError> {
        install()?;
        let mut fds = [0; 2];
        // SAFETY: pipe2 into a 2-int array.
        if unsafe { libc::pipe2(fds.as_mut_ptr(), libc::O_CLOEXEC | libc::O_NONBLOCK) } != 0 {
            return Err(ProtectError::Unavailable(format!(
                "fault pipe: {}",
                std::io::Error::last_os_error()
            )));
        }
        // SAFETY: pipe2 just created these descriptors for us.
        let (rd, wr) = unsafe { (OwnedFd::from_raw_fd(fds[0]), OwnedFd::from_raw_fd(fds[1])) };
        let Some(owner) = (1..OWNERS).find(|&i| {
            PIPES[i]
                .compare_exchange(-1, wr.as_raw_fd(), Ordering::AcqRel, Ordering::Acquire)
                .is_ok()
        }) else {
            return Err(ProtectError::Unavailable(
                "too many mprotect protectors in this process".into(),
            ));
        };
        // The write end now belongs to the table (closed in Drop).
        std::mem::forget(wr);
        let page = crate::pages::system_page_size();
        Ok(MprotectProtect {
            owner: owner as u32,
            mine: Vec::new(),
            read_end: std::sync::Arc::new(rd),
            page,
        })
    }

    /// This connection's faults (the reactor polls the pipe).
    pub fn faults(&self) -> SignalFaults {
        SignalFaults {
            read_end: std::sync::Arc::clone(&self.read_end),
        }
    }

    fn take_slot(&mut self, r: Range<u64>) -> Result<(), ProtectError> {
        let i = TABLE
            .iter()
            .position(|s| {
                s.start
                    .compare_exchange(0, u64::MAX, Ordering::AcqRel, Ordering::Acquire)
                    .is_ok()
            })
            .ok_or_else(|| ProtectError::Ioctl {
                range: r.clone(),
                why: "protection table full".into(),
            })?;
        let s = &TABLE[i];
        s.owner.store(self.owner, Ordering::Release);
        s.end.store(r.end, Ordering::Release);
        s.start.store(r.start, Ordering::Release);
        self.mine.push((i, r));
        Ok(())
    }

    fn free_slot(i: usize) {
        TABLE[i].start.store(0, Ordering::Release);
    }

    /// Write-protect whole pages `r`.
    pub fn protect(&mut self, r: Range<u64>) -> Result<(), ProtectError> {
        debug_assert!(r.start.is_multiple_of(self.page) && r.end.is_multiple_of(self.page));
        // In the table before the pages turn read-only: any fault on them
        // finds its owner.
        self.take_slot(r.clone())?;
        // SAFETY: whole pages of the application's buffer; the engine only
        // protects anonymous read-write memory it was told is protectable.
        let rc = unsafe {
            libc::mprotect(
                r.start as *mut _,
                (r.end - r.start) as usize,
                libc::PROT_READ,
            )
        };
        if rc != 0 {
            let why = std::io::Error::last_os_error().to_string();
            let (i, _) = self.mine.pop().expect("just taken");
            Self::free_slot(i);
            return Err(ProtectError::Ioctl { range: r, why });
        }
        Ok(())
    }

    /// Lift protection from `r` (whole pages, possibly part of a protected
    /// range) and let waiting writers go.
    pub fn unprotect(&mut self, r: Range<u64>) {
        // SAFETY: as in protect; read-write is what these pages had.
        unsafe {
            libc::mprotect(
                r.start as *mut _,
                (r.end - r.start) as usize,
                libc::PROT_READ | libc::PROT_WRITE,
            )
        };
        // Out of the table after the pages are writable again. The parts of
        // a range outside `r` stay read-only: their new slots go in before
        // the old one goes out, so a write to them always finds its owner.
        let mut keep = Vec::new();
        let mut gone = Vec::new();
        for (i, have) in &self.mine {
            if have.end <= r.start || r.end <= have.start {
                continue;
            }
            if have.start < r.start {
                keep.push(have.start..r.start);
            }
            if r.end < have.end {
                keep.push(r.end..have.end);
            }
            gone.push(*i);
        }
        for k in keep {
            // With the table full, the piece stays read-only without an
            // owner: a write there takes the default (loud) path.
            let _ = self.take_slot(k);
        }
        self.mine.retain(|(i, _)| !gone.contains(i));
        for i in gone {
            Self::free_slot(i);
        }
        bump_and_wake();
    }
}

impl Drop for MprotectProtect {
    fn drop(&mut self) {
        for (i, r) in std::mem::take(&mut self.mine) {
            // SAFETY: as in unprotect.
            unsafe {
                libc::mprotect(
                    r.start as *mut _,
                    (r.end - r.start) as usize,
                    libc::PROT_READ | libc::PROT_WRITE,
                )
            };
            Self::free_slot(i);
        }
        bump_and_wake();
        let fd = PIPES[self.owner as usize].swap(-1, Ordering::AcqRel);
        if fd >= 0 {
            // SAFETY: the write end we registered; no handler can use it
            // any more (it was swapped out of the table first).
            unsafe { libc::close(fd) };
        }
    }
}

impl SignalFaults {
    /// Wait up to `timeout` (0: only look) for a record, and read it.
    fn read(&self, timeout: Duration) -> Option<Fault> {
        if crate::poll_fd::poll_fd(
            std::os::fd::AsFd::as_fd(&*self.read_end),
            libc::POLLIN,
            Some(timeout),
        ) == 0
        {
            return None;
        }
        let mut rec = [0u8; RECORD];
        // SAFETY: reading into a stack buffer of RECORD bytes; records are
        // written whole (smaller than PIPE_BUF, so atomic).
        let n = unsafe { libc::read(self.read_end.as_raw_fd(), rec.as_mut_ptr().cast(), RECORD) };
        (n == RECORD as isize).then(|| Fault {
            addr: u64::from_le_bytes(rec[..8].try_into().expect("8 bytes")),
            write: rec[8] != 0,
            wp: true,
        })
    }
}

impl FaultSource for SignalFaults {
    fn try_next(&self) -> Option<Fault> {
        self.read(Duration::ZERO)
    }

    fn next_timeout(&self, timeout: Duration) -> Option<Fault> {
        self.read(timeout)
    }

    /// The pipe the signal handler writes records to (a handler can call
    /// nothing but `write`).
    fn watch(&self, _waker: super::FaultWaker) -> Option<i32> {
        Some(self.read_end.as_raw_fd())
    }
}

impl super::Protector for MprotectProtect {
    fn can_protect(&self) -> bool {
        true
    }

    fn protect(&mut self, ranges: &[Range<u64>]) -> Result<(), OpError> {
        for (i, r) in ranges.iter().enumerate() {
            if MprotectProtect::protect(self, r.clone()).is_err() {
                for done in &ranges[..i] {
                    MprotectProtect::unprotect(self, done.clone());
                }
                return Err(OpError::Local);
            }
        }
        Ok(())
    }

    fn unprotect(&mut self, range: Range<u64>) {
        MprotectProtect::unprotect(self, range);
    }

    fn arm(&mut self, _: Range<u64>) -> Result<(), OpError> {
        // Arming needs pages that vanish and come back; mprotect cannot
        // move the staged data into place atomically. Receives are
        // synchronous with this backend.
        Err(OpError::Local)
    }

    fn disarm(&mut self, _: Range<u64>, _: DisarmOutcome) {}

    fn wake(&mut self, _: Range<u64>) {
        bump_and_wake();
    }
}

#[cfg(test)]
mod tests;
