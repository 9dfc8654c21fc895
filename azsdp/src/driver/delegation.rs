//! Calls of the processes that share a connection after `fork()`, served
//! by the one process that runs it.
//!
//! The kernel lets every process that holds a socket use it, at the same
//! time, each direction on its own (rsync's receiver reads while its
//! generator writes). A connection's engine, though, lives in one
//! process's private memory ([`super::ownership`] says which: the first to
//! use it after the fork). So the others, its **guests**, do not run it:
//! they hand their calls to the **runner**, which executes them on its one
//! engine among its own calls, in the order they come. That keeps
//! `send()` call order across processes (a send returns once the engine
//! took it) and loses or duplicates nothing (one engine, one stream).
//!
//! - **Mailbox** (one per connection): a page of `MAP_SHARED` anonymous
//!   memory made by the forking thread before the fork copies the
//!   connection, so exactly the processes forked from the one that held
//!   it have it (it is never in the segment the peer maps). A guest claims
//!   one of its slots by compare-and-swap, writes the request (operation,
//!   flags, its pid, the address and length of its buffer), posts it and
//!   sleeps on the slot's state word (a futex); the runner takes it,
//!   executes it, writes the result and wakes it. A guest cancels a
//!   request (a deadline, a signal) with a flag in the slot.
//! - **Data**: the runner reads a guest's send buffer with
//!   `process_vm_readv` into a buffer of its own, which the engine then
//!   sends as it sends the runner's own (zero-copy from there: the peer
//!   GETs it), and writes what a receive took into the guest's buffer with
//!   `process_vm_writev`. One copy each way, counted ([`Served`]).
//! - **Waking the runner**: the **family bell**, one eventfd made before
//!   the first such fork and inherited by every process forked after it.
//!   A guest writes it after posting; every runner's reactor watches it
//!   edge-triggered (each write is an event for each of them, and nobody
//!   needs to drain it) and looks at the mailboxes of the connections it
//!   runs. The guest also kicks the connection's waiter (a futex in the
//!   segment), which wakes the runner's own threads blocked in a call.
//! - **Readiness**: after each turn the runner publishes the connection's
//!   readiness in the mailbox; when it changes it bumps the family's epoch
//!   word, on which one thread per guest process sleeps (a futex), which
//!   tells that process's `poll`/`epoll` waiters to look again.
//! - **Departures**: a guest that dies is forgotten (its pending calls
//!   cancelled, what they took dropped, as the kernel drops what a dead
//!   reader took). A runner that closes the connection, or exits, while
//!   another process may hold its descriptor moves the connection onto its
//!   TCP socket first (both sides agree where the stream stands,
//!   docs/protocol.md §8a), and the others carry on there. "May hold" is
//!   the mailbox's **holders**: the process that forked first, every child
//!   forked with it (noted by the parent as `fork()` returns, and by the
//!   child), whoever made a call; a process leaves by closing its copy or
//!   dying. Not only the guests that made a call: a process that had not
//!   used the connection yet when the runner closed would otherwise find
//!   it ended (the kernel keeps a socket open while anyone holds it). A
//!   runner killed outright takes the engine with it, but each guest wrote its pid in the segment (`Sharing::note_heir`):
//!   the peer then moves the stream onto TCP for the guests alone, when
//!   nothing was lost (docs/protocol.md §8a), and their calls go there
//!   (those the runner had not taken; one it was serving fails with
//!   ECONNRESET). If bytes died with it, their calls fail with ECONNRESET.
//!
//! `unsafe` here: the shared pages (`mmap`), the eventfd.

use std::os::fd::{AsRawFd, FromRawFd, OwnedFd};
use std::sync::atomic::{AtomicI64, AtomicU32, AtomicU64, Ordering};
use std::sync::{Arc, Weak};
use std::time::{Duration, Instant};

use super::ownership::ORPHAN_WAIT;
use crate::conn::{CallError, CallId, Readiness, RecvFlags, SendFlags, Shutdown};
use crate::sync::Lock;

/// Requests in flight per connection at once (further guests wait).
const SLOTS: usize = 32;
/// Processes remembered per connection as holding its descriptor (enough
/// for any real server; past that, a runner's close assumes others hold
/// it and moves the connection onto TCP, which is right either way).
const HOLDERS: usize = 16;
/// The most one request moves; a longer call is several requests.
pub const CHUNK: u64 = 1 << 20;
/// Looks at a posted request's state before sleeping on it.
const SPIN: u32 = 500;
/// How often a waiting guest looks whether the runner still lives, and
/// the runner whether its guests do.
const LIVENESS_LOOK: Duration = Duration::from_millis(20);

// A slot's states.
const FREE: u32 = 0;
const FILLING: u32 = 1;
const POSTED: u32 = 2;
const TAKEN: u32 = 3;
const DONE: u32 = 4;

/// What a guest asks.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Request {
    Send {
        addr: u64,
        len: u64,
        nonblocking: bool,
    },
    Recv {
        addr: u64,
        len: u64,
        flags: RecvFlags,
    },
    Shutdown(Shutdown),
    TakeError,
    /// Nothing but a look: the runner publishes readiness.
    Look,
}

impl Request {
    fn encode(&self) -> (u32, u32, u64, u64) {
        match *self {
            Request::Send {
                addr,
                len,
                nonblocking,
            } => (1, u32::from(nonblocking), addr, len),
            Request::Recv { addr, len, flags } => {
                let f = u32::from(flags.nonblocking)
                    | u32::from(flags.peek) << 1
                    | u32::from(flags.waitall) << 2;
                (2, f, addr, len)
            }
            Request::Shutdown(how) => {
                let h = match how {
                    Shutdown::Read => 0,
                    Shutdown::Write => 1,
                    Shutdown::Both => 2,
                };
                (3, h, 0, 0)
            }
            Request::TakeError => (4, 0, 0, 0),
            Request::Look => (5, 0, 0, 0),
        }
    }

    fn decode(op: u32, f: u32, addr: u64, len: u64) -> Option<Request> {
        Some(match op {
            1 => Request::Send {
                addr,
                len: len.min(CHUNK),
                nonblocking: f & 1 != 0,
            },
            2 => Request::Recv {
                addr,
                len: len.min(CHUNK),
                flags: RecvFlags {
                    nonblocking: f & 1 != 0,
                    peek: f & 2 != 0,
                    waitall: f & 4 != 0,
                    armable: false,
                },
            },
            3 => Request::Shutdown(match f {
                0 => Shutdown::Read,
                1 => Shutdown::Write,
                _ => Shutdown::Both,
            }),
            4 => Request::TakeError,
            5 => Request::Look,
            _ => return None,
        })
    }
}

/// What a request came to, as the guest reads it.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Answer {
    Done(Result<u64, CallError>),
    /// The runner cannot reach this process's memory (it changed user, or
    /// made itself undumpable): the connection must move onto TCP.
    Unservable,
    /// The runner is gone without a word (killed): the engine went with it.
    RunnerGone,
}

const UNSERVABLE: i64 = -100;

fn encode_result(r: Result<u64, CallError>) -> i64 {
    match r {
        Ok(n) => n as i64,
        Err(e) => {
            -(match e {
                CallError::WouldBlock => 1,
                CallError::Interrupted => 2,
                CallError::BrokenPipe => 3,
                CallError::ConnReset => 4,
                CallError::TimedOut => 5,
                CallError::Switched => 6,
                CallError::OnTcp => 7,
            })
        }
    }
}

fn decode_result(v: i64) -> Answer {
    if v >= 0 {
        return Answer::Done(Ok(v as u64));
    }
    Answer::Done(Err(match -v {
        1 => CallError::WouldBlock,
        2 => CallError::Interrupted,
        3 => CallError::BrokenPipe,
        5 => CallError::TimedOut,
        6 => CallError::Switched,
        7 => CallError::OnTcp,
        100 => return Answer::Unservable,
        _ => CallError::ConnReset,
    }))
}

#[repr(C)]
struct Slot {
    state: AtomicU32,
    cancel: AtomicU32,
    pid: AtomicU32,
    op: AtomicU32,
    flags: AtomicU32,
    _pad: u32,
    addr: AtomicU64,
    len: AtomicU64,
    result: AtomicI64,
}

/// Readiness bits as published.
const READABLE: u32 = 1;
const WRITABLE: u32 = 2;
const READ_HANGUP: u32 = 4;
const HANGUP: u32 = 8;
const ERROR: u32 = 16;
/// Set once the runner published anything.
const PUBLISHED: u32 = 32;

#[repr(C)]
struct MailboxPage {
    /// The process serving the requests (the last to run the engine).
    runner: AtomicU32,
    /// How the connection ended for the guests, when the runner left
    /// without moving it onto TCP ([`Ending`]; 0: it did not).
    ended: AtomicU32,
    bits: AtomicU32,
    arrived: AtomicU64,
    drained: AtomicU64,
    readable: AtomicU64,
    /// The processes that may hold the descriptor: the one that forked
    /// first, each child forked with it, and whoever made a call; a
    /// process leaves by closing its copy (or by dying).
    holders: [AtomicU32; HOLDERS],
    /// Set when a holder found no free entry: from then on, others may hold
    /// it whatever the entries say.
    holders_overflowed: AtomicU32,
    slots: [Slot; SLOTS],
}

/// Every [`SharedPages`] mapping of this process (inherited over fork with
/// the mappings themselves), as (address, length): see [`leave_family`].
static MAPPED: Lock<Vec<(usize, usize)>> = Lock::new(Vec::new());

/// A page (or a few) of anonymous memory shared with forked children,
/// zero-filled, holding a `T` made of atomics (all zero is valid).
pub(crate) struct SharedPages<T> {
    ptr: *mut T,
    len: usize,
}

// SAFETY: the memory holds atomics only, shared on purpose.
unsafe impl<T> Send for SharedPages<T> {}
// SAFETY: as above.
unsafe impl<T> Sync for SharedPages<T> {}

impl<T> SharedPages<T> {
    pub(crate) fn new() -> std::io::Result<Self> {
        let len = std::mem::size_of::<T>().next_multiple_of(4096);
        // SAFETY: a fresh anonymous shared mapping, owned by the result.
        let p = unsafe {
            libc::mmap(
                std::ptr::null_mut(),
                len,
                libc::PROT_READ | libc::PROT_WRITE,
                libc::MAP_SHARED | libc::MAP_ANONYMOUS,
                -1,
                0,
            )
        };
        if p == libc::MAP_FAILED {
            return Err(std::io::Error::last_os_error());
        }
        MAPPED.lock().push((p as usize, len));
        Ok(SharedPages { ptr: p.cast(), len })
    }

    #[cfg(test)]
    fn detach(&self) {
        detach(self.ptr as usize, self.len);
    }

    pub(crate) fn get(&self) -> &T {
        // SAFETY: mapped, zero-filled (a valid T of atomics) and aligned to
        // a page, for as long as `self` lives.
        unsafe { &*self.ptr }
    }
}

impl<T> Drop for SharedPages<T> {
    fn drop(&mut self) {
        let at = self.ptr as usize;
        MAPPED.lock().retain(|m| m.0 != at);
        // SAFETY: unmapping our own mapping (the other processes keep
        // theirs).
        unsafe { libc::munmap(self.ptr.cast(), self.len) };
    }
}

/// Replace the shared mapping at `ptr` by private zero pages, in place:
/// what this process writes there from now on reaches nobody.
fn detach(ptr: usize, len: usize) {
    // SAFETY: MAP_FIXED over a mapping of ours that stays valid memory (of
    // the same size, readable and writable) for everyone holding it.
    unsafe {
        libc::mmap(
            ptr as *mut libc::c_void,
            len,
            libc::PROT_READ | libc::PROT_WRITE,
            libc::MAP_PRIVATE | libc::MAP_ANONYMOUS | libc::MAP_FIXED,
            -1,
            0,
        )
    };
}

/// This process is about to become one the others may not trust (another
/// user, a seccomp sandbox: privilege-separated servers do this so that a
/// compromise of the child stays there). A request names a pid and an
/// address that a runner reads or writes with its own rights, so such a
/// process must not be able to post any: every shared page of delegation
/// becomes private memory here (valid, inert: its connections moved onto
/// TCP just before), and the family bell's number now names an eventfd of
/// its own. The other processes keep theirs; a fork from here on makes a
/// new family.
pub fn leave_family() {
    for &(ptr, len) in MAPPED.lock().iter() {
        detach(ptr, len);
    }
    // Connections forked from here on start a family of their own.
    if let Some(f) = FAMILY.lock().take() {
        // SAFETY: a fresh eventfd put in the bell's place (dup3 closes the
        // shared one in this process only), then its first number closed.
        unsafe {
            let own = libc::eventfd(0, libc::EFD_NONBLOCK | libc::EFD_CLOEXEC);
            if own >= 0 {
                libc::dup3(own, f.bell.as_raw_fd(), libc::O_CLOEXEC);
                libc::close(own);
            }
        }
    }
}

#[repr(C)]
struct FamilyPage {
    /// Bumped whenever a shared connection's readiness changed.
    epoch: AtomicU32,
    /// Guest threads asleep on `epoch`.
    watchers: AtomicU32,
}

/// What the processes forked from one another share for delegation.
pub struct Family {
    page: SharedPages<FamilyPage>,
    /// Written by guests after posting; watched by every runner's reactor.
    bell: Arc<OwnedFd>,
}

impl std::fmt::Debug for Family {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Family")
            .field("bell", &self.bell.as_raw_fd())
            .finish()
    }
}

static FAMILY: Lock<Option<Arc<Family>>> = Lock::new(None);

/// The family this process belongs to, if a fork made one.
pub fn family() -> Option<Arc<Family>> {
    FAMILY.lock().clone()
}

/// Before a fork that copies a connection: the family, made now if need
/// be (so the child inherits it).
fn family_for_fork() -> Option<Arc<Family>> {
    let mut f = FAMILY.lock();
    if f.is_none() {
        let page = SharedPages::new().ok()?;
        // SAFETY: eventfd(2); owned below.
        let fd = unsafe { libc::eventfd(0, libc::EFD_NONBLOCK | libc::EFD_CLOEXEC) };
        if fd < 0 {
            return None;
        }
        // SAFETY: a fresh descriptor, ours.
        let bell = Arc::new(unsafe { OwnedFd::from_raw_fd(fd) });
        *f = Some(Arc::new(Family { page, bell }));
    }
    f.clone()
}

impl Family {
    /// The descriptor runners watch (edge-triggered).
    pub fn bell(&self) -> &Arc<OwnedFd> {
        &self.bell
    }

    fn ring(&self) {
        let one = 1u64;
        // SAFETY: an 8-byte write from a local to our eventfd.
        unsafe { libc::write(self.bell.as_raw_fd(), (&raw const one).cast(), 8) };
    }

    fn readiness_changed(&self) {
        let p = self.page.get();
        p.epoch.fetch_add(1, Ordering::SeqCst);
        if p.watchers.load(Ordering::SeqCst) != 0 {
            crate::futex::wake_all(&p.epoch);
        }
    }
}

/// One connection's mailbox (see the module).
pub struct Mailbox {
    page: SharedPages<MailboxPage>,
    family: Arc<Family>,
}

impl std::fmt::Debug for Mailbox {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Mailbox")
            .field("runner", &self.runner())
            .finish()
    }
}

impl Mailbox {
    /// Made by the forking thread, before the fork copies the connection.
    pub fn for_fork() -> Option<Arc<Mailbox>> {
        let family = family_for_fork()?;
        let page = SharedPages::new().ok()?;
        let mb = Mailbox { page, family };
        mb.note_holder(crate::process::pid());
        Some(Arc::new(mb))
    }

    fn p(&self) -> &MailboxPage {
        self.page.get()
    }

    pub fn family(&self) -> &Arc<Family> {
        &self.family
    }

    /// This process claimed the connection: guests now wait on it (its
    /// death ends their calls even if it never served one).
    pub fn runs_here(&self) {
        let me = crate::process::pid();
        if self.p().runner.load(Ordering::Relaxed) != me {
            self.p().runner.store(me, Ordering::SeqCst);
        }
    }

    /// The process serving requests (0: none yet).
    pub fn runner(&self) -> u32 {
        self.p().runner.load(Ordering::SeqCst)
    }

    /// May a process other than `me` still hold the descriptor (and use
    /// the connection later)? A runner's close then moves the connection
    /// onto TCP instead of ending it, as the kernel keeps a socket open
    /// while any process holds it: whether or not that process used it
    /// yet (a forked child scheduled late, a parent that had not sent).
    /// Errs towards yes (a reused pid, an overflow): moving is right
    /// either way, only slower.
    pub fn has_other_holders(&self, me: u32) -> bool {
        let p = self.p();
        p.holders_overflowed.load(Ordering::SeqCst) != 0
            || p.holders.iter().any(|g| {
                let pid = g.load(Ordering::SeqCst);
                pid != 0 && pid != me && crate::stats::alive(pid)
            })
    }

    /// `pid` holds the descriptor (it forked with it, was forked with it,
    /// or made a call).
    pub fn note_holder(&self, pid: u32) {
        let holders = &self.p().holders;
        if holders.iter().any(|g| g.load(Ordering::SeqCst) == pid) {
            return;
        }
        for g in holders {
            let old = g.load(Ordering::SeqCst);
            if (old == 0 || !crate::stats::alive(old))
                && g.compare_exchange(old, pid, Ordering::SeqCst, Ordering::SeqCst)
                    .is_ok()
            {
                return;
            }
        }
        self.p().holders_overflowed.store(1, Ordering::SeqCst);
    }

    /// `pid` closed its copy of the descriptor (or execs with it closing).
    pub fn drop_holder(&self, pid: u32) {
        for g in &self.p().holders {
            let _ = g.compare_exchange(pid, 0, Ordering::SeqCst, Ordering::SeqCst);
        }
    }

    /// Readiness as the runner last published it (`None`: never yet).
    pub fn published(&self) -> Option<Readiness> {
        let p = self.p();
        let bits = p.bits.load(Ordering::Acquire);
        (bits & PUBLISHED != 0).then(|| Readiness {
            readable: bits & READABLE != 0,
            writable: bits & WRITABLE != 0,
            read_hangup: bits & READ_HANGUP != 0,
            hangup: bits & HANGUP != 0,
            error: bits & ERROR != 0,
            arrived: p.arrived.load(Ordering::Acquire),
            drained: p.drained.load(Ordering::Acquire),
        })
    }

    /// Bytes a receive could take now, as last published.
    pub fn readable_bytes(&self) -> u64 {
        self.p().readable.load(Ordering::Acquire)
    }
}

/// How a runner that leaves while guests live ends the connection for
/// them, when it cannot move it onto TCP because the peer is gone.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Ending {
    /// Everything the peer sent was delivered: receives see the end of the
    /// stream, sends EPIPE.
    Eof = 1,
    /// Bytes were lost with it: ECONNRESET.
    Reset = 2,
}

impl Mailbox {
    /// The runner leaves: this is how the connection ended for guests.
    pub fn end(&self, how: Ending) {
        self.p().ended.store(how as u32, Ordering::SeqCst);
        // Guests asleep in a request look again.
        for s in &self.p().slots {
            crate::futex::wake_all(&s.state);
        }
        self.family.readiness_changed();
    }

    /// How the connection ended, if the runner left it so.
    pub fn ending(&self) -> Option<Ending> {
        match self.p().ended.load(Ordering::SeqCst) {
            1 => Some(Ending::Eof),
            2 => Some(Ending::Reset),
            _ => None,
        }
    }
}

impl Ending {
    /// What `req` gets on a connection that ended so.
    fn answer(self, req: Request) -> Answer {
        Answer::Done(match (self, req) {
            (Ending::Eof, Request::Recv { .. }) => Ok(0),
            (_, Request::Send { .. }) => Err(CallError::BrokenPipe),
            (Ending::Reset, Request::Recv { .. }) => Err(CallError::ConnReset),
            _ => Ok(0),
        })
    }

    /// Readiness of a connection that ended so.
    pub fn readiness(self) -> Readiness {
        Readiness {
            readable: true,
            writable: true,
            read_hangup: true,
            hangup: true,
            error: self == Ending::Reset,
            arrived: 0,
            drained: 0,
        }
    }
}

// ---------------------------------------------------------------- guests

/// How a guest's request waits (see [`call`]).
pub struct GuestWait<'a> {
    pub deadline: Option<Instant>,
    /// Should the request be cancelled now (a signal to report as EINTR)?
    pub on_signal: &'a dyn Fn() -> bool,
    /// Wake the runner's threads blocked in calls (the waiter's kick).
    pub kick: &'a dyn Fn(),
    /// Has the connection left the fabric (its calls go to TCP)?
    pub left: &'a dyn Fn() -> bool,
}

impl std::fmt::Debug for GuestWait<'_> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("GuestWait")
            .field("deadline", &self.deadline)
            .finish()
    }
}

/// Hand `req` to the runner and wait for its answer. A deadline or a
/// signal cancels it (it then ends with what it moved, or WouldBlock /
/// Interrupted, as the runner's own calls do).
pub fn call(mb: &Mailbox, req: Request, w: &GuestWait<'_>) -> Answer {
    let me = crate::process::pid();
    mb.note_holder(me);
    if let Some(e) = mb.ending() {
        return e.answer(req);
    }
    let p = mb.p();
    let mut nap = Duration::from_micros(50);
    let slot = loop {
        if (w.left)() {
            return Answer::Done(Err(CallError::Switched));
        }
        if let Some(s) = p.slots.iter().find(|s| {
            s.state
                .compare_exchange(FREE, FILLING, Ordering::AcqRel, Ordering::Relaxed)
                .is_ok()
        }) {
            break s;
        }
        if !runner_alive(mb) {
            return after_runner_death(mb, req, w);
        }
        // Every slot busy: others' requests go first.
        std::thread::sleep(nap);
        nap = (nap * 2).min(Duration::from_millis(5));
    };
    let (op, flags, addr, len) = req.encode();
    slot.cancel.store(0, Ordering::Relaxed);
    slot.pid.store(me, Ordering::Relaxed);
    slot.op.store(op, Ordering::Relaxed);
    slot.flags.store(flags, Ordering::Relaxed);
    slot.addr.store(addr, Ordering::Relaxed);
    slot.len.store(len, Ordering::Relaxed);
    slot.result.store(0, Ordering::Relaxed);
    slot.state.store(POSTED, Ordering::Release);
    mb.family.ring();
    (w.kick)();
    let mut cancelled = false;
    let mut looked = Instant::now();
    let mut spun = 0u32;
    loop {
        let s = slot.state.load(Ordering::Acquire);
        if s == DONE {
            let r = decode_result(slot.result.load(Ordering::Acquire));
            slot.state.store(FREE, Ordering::Release);
            return r;
        }
        if !cancelled && (w.deadline.is_some_and(|t| Instant::now() >= t) || (w.on_signal)()) {
            cancelled = true;
            if slot
                .state
                .compare_exchange(POSTED, FREE, Ordering::AcqRel, Ordering::Relaxed)
                .is_ok()
            {
                // Withdrawn before the runner saw it: nothing moved.
                let why = if w.deadline.is_some_and(|t| Instant::now() >= t) {
                    CallError::WouldBlock
                } else {
                    CallError::Interrupted
                };
                return Answer::Done(Err(why));
            }
            slot.cancel.store(1, Ordering::Release);
            mb.family.ring();
            (w.kick)();
        }
        if looked.elapsed() >= LIVENESS_LOOK {
            looked = Instant::now();
            let left = (w.left)();
            let gone = !runner_alive(mb);
            let ended = mb.ending();
            if (gone || left || ended.is_some())
                && slot
                    .state
                    .compare_exchange(POSTED, FREE, Ordering::AcqRel, Ordering::Relaxed)
                    .is_ok()
            {
                // Never taken, so nothing of it moved: made again on TCP if
                // the connection went there (its runner may have exited
                // since, having moved it), else answered by the ending
                // (a runner that lives on but let the connection go).
                return match ended {
                    _ if left => Answer::Done(Err(CallError::Switched)),
                    Some(e) => e.answer(req),
                    None => after_runner_death(mb, req, w),
                };
            }
            if gone && slot.state.load(Ordering::Acquire) == TAKEN {
                // Taken by a runner that died: nobody will answer.
                slot.state.store(FREE, Ordering::Release);
                return mb.ending().map_or(Answer::RunnerGone, |e| e.answer(req));
            }
            if gone && let Some(e) = mb.ending() {
                return e.answer(req);
            }
        }
        if spun < SPIN {
            // The answer often comes within microseconds: a short spin
            // saves a sleep and a wake-up on both sides.
            spun += 1;
            std::hint::spin_loop();
            continue;
        }
        let mut timeout = LIVENESS_LOOK;
        if let Some(t) = w.deadline.filter(|_| !cancelled) {
            timeout = timeout.min(t.saturating_duration_since(Instant::now()));
        }
        crate::futex::wait(&slot.state, s, timeout.max(Duration::from_micros(100)));
    }
}

/// The runner died (killed: it left no ending) before it took the
/// request: the peer moves the stream onto TCP for the processes that
/// carry on, if nothing was lost (`Sharing::note_heir`); wait a little for
/// that, then the call goes there. Else the connection is reset.
fn after_runner_death(mb: &Mailbox, req: Request, w: &GuestWait<'_>) -> Answer {
    if let Some(e) = mb.ending() {
        return e.answer(req);
    }
    let until = Instant::now() + ORPHAN_WAIT;
    loop {
        if (w.left)() {
            return Answer::Done(Err(CallError::Switched));
        }
        if Instant::now() >= until {
            return Answer::RunnerGone;
        }
        std::thread::sleep(Duration::from_millis(5));
    }
}

/// Does the process serving the mailbox live (or has none served yet)?
pub fn runner_alive(mb: &Mailbox) -> bool {
    match mb.runner() {
        // Nobody has served yet: the process that claimed it is starting.
        0 => true,
        pid => crate::stats::alive(pid),
    }
}

/// Called by a guest that waits for readiness: `notify` is told whenever a
/// runner publishes a change (by this process's watcher thread).
pub fn watch_readiness(family: &Arc<Family>, notify: &Arc<dyn Fn() + Send + Sync>) {
    let me = crate::process::pid();
    let mut w = WATCHED.lock();
    if w.pid != me {
        // A forked child: the parent's thread is not here.
        w.pid = me;
        w.notifies.clear();
        w.started = false;
    }
    w.notifies.retain(|n| n.strong_count() > 0);
    if !w.notifies.iter().any(|n| n.ptr_eq(&Arc::downgrade(notify))) {
        w.notifies.push(Arc::downgrade(notify));
    }
    if !w.started {
        let fam = Arc::clone(family);
        w.started = crate::threads::spawn("azsdp-guest", move || watch_loop(&fam, me)).is_ok();
    }
}

#[derive(Default)]
struct Watched {
    pid: u32,
    started: bool,
    notifies: Vec<Weak<dyn Fn() + Send + Sync>>,
}

static WATCHED: Lock<Watched> = Lock::new(Watched {
    pid: 0,
    started: false,
    notifies: Vec::new(),
});

/// A thread of this process is about to sleep waiting for readiness (1);
/// the watcher listens to the runners only then, so that a guest nobody
/// waits in costs the runners no wake-ups.
static WANTED: AtomicU32 = AtomicU32::new(0);

/// The application is about to sleep in `poll`/`epoll_wait`/`select`
/// (after which it looks at readiness): have the watcher tell it of the
/// next change. One load when it already will.
pub fn readiness_wanted() {
    if WANTED.load(Ordering::SeqCst) == 0 && WANTED.swap(1, Ordering::SeqCst) == 0 {
        crate::futex::wake_all(&WANTED);
    }
}

fn watch_loop(family: &Family, me: u32) {
    let p = family.page.get();
    // Kept across naps, so a change published between a waiter's look
    // and our listening is seen (at worst one spurious notification).
    let mut last = p.epoch.load(Ordering::SeqCst);
    while crate::process::pid() == me {
        if WANTED.load(Ordering::SeqCst) == 0 {
            crate::futex::wait(&WANTED, 0, Duration::from_secs(1));
            continue;
        }
        p.watchers.fetch_add(1, Ordering::SeqCst);
        crate::futex::wait(&p.epoch, last, Duration::from_secs(1));
        p.watchers.fetch_sub(1, Ordering::SeqCst);
        let now = p.epoch.load(Ordering::SeqCst);
        if now == last {
            continue;
        }
        last = now;
        // Waiters re-arm before they sleep again.
        WANTED.store(0, Ordering::SeqCst);
        let notifies: Vec<_> = WATCHED
            .lock()
            .notifies
            .iter()
            .filter_map(Weak::upgrade)
            .collect();
        for n in notifies {
            n();
        }
    }
}

// ---------------------------------------------------------------- runner

/// What the runner did for its guests (one copy of each byte, between
/// their memory and its own).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Served {
    pub bytes_sent: u64,
    pub bytes_received: u64,
    pub requests: u64,
}

/// A buffer of the runner's own for one request (page-aligned anonymous
/// memory: the engine may protect it and send it zero-copy).
struct Bounce {
    map: memmap2::MmapMut,
}

/// Smallest buffer made (requests are mostly a few KiB to a chunk).
const BOUNCE_MIN: u64 = 64 << 10;
/// Buffers kept for reuse.
const POOL: usize = 8;

impl Bounce {
    fn new(len: u64) -> Option<Bounce> {
        memmap2::MmapMut::map_anon(len.max(BOUNCE_MIN).next_multiple_of(4096) as usize)
            .ok()
            .map(|map| Bounce { map })
    }

    fn addr(&self) -> u64 {
        self.map.as_ptr() as u64
    }

    fn range(&self) -> std::ops::Range<u64> {
        self.addr()..self.addr() + self.map.len() as u64
    }
}

struct InFlight {
    slot: usize,
    call: CallId,
    pid: u32,
    req: Request,
    bounce: Bounce,
    cancelled: bool,
}

/// The runner's private side of a mailbox.
#[derive(Default)]
pub struct Serving {
    calls: Vec<InFlight>,
    /// Send buffers the engine may still hold: reused once it does not.
    retired: Vec<Bounce>,
    /// Buffers free for the next requests.
    pool: Vec<Bounce>,
    published: Option<(u32, u64, u64, u64)>,
    looked: Option<Instant>,
    pub served: Served,
}

impl std::fmt::Debug for Serving {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Serving")
            .field("calls", &self.calls.len())
            .field("served", &self.served)
            .finish()
    }
}

/// The engine operations the runner needs (the driver's, so this module
/// stays apart from its type parameters).
pub trait Engine {
    fn submit_send(&mut self, addr: u64, len: u64, flags: SendFlags) -> CallId;
    fn submit_recv(&mut self, addr: u64, len: u64, flags: RecvFlags) -> CallId;
    fn cancel(&mut self, call: CallId);
    fn take_result(&mut self, call: CallId) -> Option<Result<u64, CallError>>;
    fn shutdown(&mut self, how: Shutdown);
    fn take_error(&mut self) -> Option<CallError>;
    fn readiness(&self) -> Readiness;
    fn readable_bytes(&self) -> u64;
    fn holds_memory(&self, range: &std::ops::Range<u64>) -> bool;
    fn switched(&self) -> bool;
}

impl Serving {
    /// Calls of guests the engine has in flight (a forked child that
    /// adopts the connection goes on serving them).
    pub fn calls(&self) -> Vec<CallId> {
        self.calls.iter().map(|c| c.call).collect()
    }

    /// This copy does not run the connection any more: forget its work
    /// (the runner that took over has its own copy of it).
    pub fn forget(&mut self) {
        self.calls.clear();
        self.retired.clear();
        self.pool.clear();
        self.published = None;
    }

    /// This copy lets the connection go without moving it onto TCP (its
    /// close ran out of time, or the peer is gone): guests are told how it
    /// ended, and the calls taken for them are answered so, since no turn
    /// of this engine will answer them now. Their buffers stay until this
    /// copy is dropped: an aborted engine may still have a GET in flight
    /// into one (a NIC's READ).
    pub fn end(&mut self, mb: &Mailbox, how: Ending) {
        if mb.ending().is_none() {
            mb.end(how);
        }
        for c in self.calls.drain(..) {
            if let Answer::Done(r) = how.answer(c.req) {
                answer(&mb.p().slots[c.slot], encode_result(r));
            }
            self.retired.push(c.bounce);
        }
        self.published = None;
    }

    /// Take what guests posted, finish what the engine completed, publish
    /// readiness. Called after every turn of the runner's engine. Whether
    /// anything was taken or answered.
    pub fn serve(&mut self, mb: &Mailbox, e: &mut dyn Engine) -> bool {
        let me = crate::process::pid();
        let p = mb.p();
        if p.runner.load(Ordering::Relaxed) != me {
            p.runner.store(me, Ordering::SeqCst);
        }
        let mut moved = false;
        for (i, slot) in p.slots.iter().enumerate() {
            if slot.state.load(Ordering::Acquire) != POSTED
                || slot
                    .state
                    .compare_exchange(POSTED, TAKEN, Ordering::AcqRel, Ordering::Relaxed)
                    .is_err()
            {
                continue;
            }
            moved = true;
            self.take(i, slot, e);
        }
        // Guests gone: cancel what they asked (what it took is dropped).
        let look = self.looked.is_none_or(|t| t.elapsed() >= LIVENESS_LOOK * 5);
        if look && !self.calls.is_empty() {
            self.looked = Some(Instant::now());
            for c in &mut self.calls {
                if !c.cancelled && !crate::stats::alive(c.pid) {
                    c.cancelled = true;
                    e.cancel(c.call);
                }
            }
        }
        let mut i = 0;
        while i < self.calls.len() {
            let c = &mut self.calls[i];
            let slot = &p.slots[c.slot];
            if !c.cancelled && slot.cancel.load(Ordering::Acquire) != 0 {
                c.cancelled = true;
                e.cancel(c.call);
            }
            let Some(r) = e.take_result(c.call) else {
                i += 1;
                continue;
            };
            let c = self.calls.swap_remove(i);
            moved = true;
            let r = self.finish(&c, r);
            answer(slot, r);
            if matches!(c.req, Request::Send { .. }) {
                self.retired.push(c.bounce);
            } else {
                self.recycle(c.bounce);
            }
        }
        let mut i = 0;
        while i < self.retired.len() {
            if e.holds_memory(&self.retired[i].range()) {
                i += 1;
            } else {
                let b = self.retired.swap_remove(i);
                self.recycle(b);
            }
        }
        self.publish(mb, e);
        moved
    }

    /// A buffer of at least `len` bytes: a free one, or a new one.
    fn bounce(&mut self, len: u64) -> Option<Bounce> {
        match self.pool.iter().position(|b| b.map.len() as u64 >= len) {
            Some(i) => Some(self.pool.swap_remove(i)),
            None => Bounce::new(len),
        }
    }

    fn recycle(&mut self, b: Bounce) {
        if self.pool.len() < POOL {
            self.pool.push(b);
        }
    }

    fn take(&mut self, i: usize, slot: &Slot, e: &mut dyn Engine) {
        let pid = slot.pid.load(Ordering::Relaxed);
        let req = Request::decode(
            slot.op.load(Ordering::Relaxed),
            slot.flags.load(Ordering::Relaxed),
            slot.addr.load(Ordering::Relaxed),
            slot.len.load(Ordering::Relaxed),
        );
        self.served.requests += 1;
        if e.switched() {
            answer(slot, encode_result(Err(CallError::Switched)));
            return;
        }
        let call = match req {
            None => return answer(slot, encode_result(Err(CallError::ConnReset))),
            Some(Request::Shutdown(how)) => {
                e.shutdown(how);
                return answer(slot, 0);
            }
            Some(Request::Look) => return answer(slot, 0),
            Some(Request::TakeError) => {
                return answer(slot, e.take_error().map_or(0, |x| encode_result(Err(x))));
            }
            Some(
                req @ Request::Send {
                    addr,
                    len,
                    nonblocking,
                },
            ) => {
                let Some(mut bounce) = self.bounce(len) else {
                    return answer(slot, encode_result(Err(CallError::WouldBlock)));
                };
                if let Err(r) = read_guest(pid, addr, &mut bounce.map[..len as usize]) {
                    self.recycle(bounce);
                    return answer(slot, r);
                }
                let flags = SendFlags {
                    nonblocking,
                    protectable: true,
                    unprotectable: None,
                };
                let call = e.submit_send(bounce.addr(), len, flags);
                (req, call, bounce)
            }
            Some(req @ Request::Recv { len, flags, .. }) => {
                let Some(bounce) = self.bounce(len) else {
                    return answer(slot, encode_result(Err(CallError::WouldBlock)));
                };
                let call = e.submit_recv(bounce.addr(), len, flags);
                (req, call, bounce)
            }
        };
        let (req, call, bounce) = call;
        self.calls.push(InFlight {
            slot: i,
            call,
            pid,
            req,
            bounce,
            cancelled: false,
        });
    }

    /// The answer for a completed call: a receive's bytes written into the
    /// guest's buffer first.
    fn finish(&mut self, c: &InFlight, r: Result<u64, CallError>) -> i64 {
        match (c.req, r) {
            (Request::Recv { addr, flags, .. }, Ok(n)) if n > 0 => {
                if let Err(r) = write_guest(c.pid, addr, &c.bounce.map[..n as usize]) {
                    return r;
                }
                if !flags.peek {
                    self.served.bytes_received += n;
                }
                n as i64
            }
            (Request::Send { .. }, Ok(n)) => {
                self.served.bytes_sent += n;
                n as i64
            }
            (_, r) => encode_result(r),
        }
    }

    fn publish(&mut self, mb: &Mailbox, e: &dyn Engine) {
        let r = e.readiness();
        let bits = PUBLISHED
            | if r.readable { READABLE } else { 0 }
            | if r.writable { WRITABLE } else { 0 }
            | if r.read_hangup { READ_HANGUP } else { 0 }
            | if r.hangup { HANGUP } else { 0 }
            | if r.error { ERROR } else { 0 };
        let now = (bits, r.arrived, r.drained, e.readable_bytes());
        if self.published == Some(now) {
            return;
        }
        self.published = Some(now);
        let p = mb.p();
        p.arrived.store(r.arrived, Ordering::Release);
        p.drained.store(r.drained, Ordering::Release);
        p.readable.store(now.3, Ordering::Release);
        p.bits.store(bits, Ordering::Release);
        mb.family.readiness_changed();
    }
}

fn answer(slot: &Slot, result: i64) {
    slot.result.store(result, Ordering::Release);
    slot.state.store(DONE, Ordering::Release);
    crate::futex::wake_all(&slot.state);
}

/// What a failed access to a guest's memory answers: the guest died
/// (ECONNRESET, nobody reads it), or the runner may not reach it (the
/// guest must move the connection onto TCP).
fn guest_error(e: nix::Error) -> i64 {
    match e {
        nix::Error::EPERM | nix::Error::EACCES => UNSERVABLE,
        _ => encode_result(Err(CallError::ConnReset)),
    }
}

fn read_guest(pid: u32, addr: u64, into: &mut [u8]) -> Result<(), i64> {
    use nix::sys::uio::{RemoteIoVec, process_vm_readv};
    let want = into.len();
    let remote = [RemoteIoVec {
        base: addr as usize,
        len: want,
    }];
    let mut local = [std::io::IoSliceMut::new(into)];
    match process_vm_readv(nix::unistd::Pid::from_raw(pid as i32), &mut local, &remote) {
        Ok(n) if n == want => Ok(()),
        Ok(_) => Err(encode_result(Err(CallError::ConnReset))),
        Err(e) => Err(guest_error(e)),
    }
}

fn write_guest(pid: u32, addr: u64, from: &[u8]) -> Result<(), i64> {
    use nix::sys::uio::{RemoteIoVec, process_vm_writev};
    let remote = [RemoteIoVec {
        base: addr as usize,
        len: from.len(),
    }];
    let local = [std::io::IoSlice::new(from)];
    match process_vm_writev(nix::unistd::Pid::from_raw(pid as i32), &local, &remote) {
        Ok(n) if n == from.len() => Ok(()),
        Ok(_) => Err(encode_result(Err(CallError::ConnReset))),
        Err(e) => Err(guest_error(e)),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn requests_and_results_survive_the_page() {
        let reqs = [
            Request::Send {
                addr: 0x1000,
                len: 77,
                nonblocking: true,
            },
            Request::Recv {
                addr: 0x2000,
                len: 5,
                flags: RecvFlags {
                    nonblocking: false,
                    peek: true,
                    waitall: true,
                    armable: false,
                },
            },
            Request::Shutdown(Shutdown::Write),
            Request::TakeError,
            Request::Look,
        ];
        for r in reqs {
            let (op, f, a, l) = r.encode();
            assert_eq!(Request::decode(op, f, a, l), Some(r));
        }
        assert_eq!(Request::decode(9, 0, 0, 0), None);
        for r in [
            Ok(0),
            Ok(12345),
            Err(CallError::WouldBlock),
            Err(CallError::Interrupted),
            Err(CallError::BrokenPipe),
            Err(CallError::ConnReset),
            Err(CallError::TimedOut),
            Err(CallError::Switched),
        ] {
            assert_eq!(decode_result(encode_result(r)), Answer::Done(r));
        }
        assert_eq!(decode_result(UNSERVABLE), Answer::Unservable);
    }

    /// An engine that takes every send whole and hands out `rx` to
    /// receives, which wait (no result) while it is empty.
    #[derive(Default)]
    struct Fake {
        sent: Vec<u8>,
        rx: Vec<u8>,
        calls: Vec<(CallId, Request2)>,
        next: u64,
        cancelled: Vec<CallId>,
    }

    enum Request2 {
        Send(Result<u64, CallError>),
        Recv(u64, u64),
    }

    impl Engine for Fake {
        fn submit_send(&mut self, addr: u64, len: u64, _: SendFlags) -> CallId {
            // SAFETY: the runner's own buffer of `len` bytes (the test's).
            let b = unsafe { std::slice::from_raw_parts(addr as *const u8, len as usize) };
            self.sent.extend_from_slice(b);
            self.next += 1;
            self.calls
                .push((CallId(self.next), Request2::Send(Ok(len))));
            CallId(self.next)
        }
        fn submit_recv(&mut self, addr: u64, len: u64, _: RecvFlags) -> CallId {
            self.next += 1;
            self.calls
                .push((CallId(self.next), Request2::Recv(addr, len)));
            CallId(self.next)
        }
        fn cancel(&mut self, call: CallId) {
            self.cancelled.push(call);
        }
        fn take_result(&mut self, call: CallId) -> Option<Result<u64, CallError>> {
            let i = self.calls.iter().position(|(c, _)| *c == call)?;
            let r = match self.calls[i].1 {
                Request2::Send(r) => r,
                Request2::Recv(addr, len) => {
                    if self.cancelled.contains(&call) {
                        Err(CallError::Interrupted)
                    } else if self.rx.is_empty() {
                        return None;
                    } else {
                        let n = (len as usize).min(self.rx.len());
                        // SAFETY: the runner's own buffer of `len` bytes.
                        unsafe {
                            std::ptr::copy_nonoverlapping(self.rx.as_ptr(), addr as *mut u8, n)
                        };
                        self.rx.drain(..n);
                        Ok(n as u64)
                    }
                }
            };
            self.calls.remove(i);
            Some(r)
        }
        fn shutdown(&mut self, _: Shutdown) {}
        fn take_error(&mut self) -> Option<CallError> {
            None
        }
        fn readiness(&self) -> Readiness {
            Readiness {
                readable: !self.rx.is_empty(),
                writable: true,
                ..Readiness::default()
            }
        }
        fn readable_bytes(&self) -> u64 {
            self.rx.len() as u64
        }
        fn holds_memory(&self, _: &std::ops::Range<u64>) -> bool {
            false
        }
        fn switched(&self) -> bool {
            false
        }
    }

    fn never() -> bool {
        false
    }

    /// A guest (a thread of this process: `process_vm_*` on our own pid
    /// works) asks; the runner serves until `done`.
    fn served_call(
        mb: &Arc<Mailbox>,
        fake: &mut Fake,
        req: impl FnOnce(&Mailbox) -> Answer + Send + 'static,
        feed: impl Fn(&mut Fake, usize),
    ) -> Answer {
        let guest = {
            let mb = Arc::clone(mb);
            std::thread::spawn(move || req(&mb))
        };
        let mut serving = Serving::default();
        let mut round = 0;
        while !guest.is_finished() {
            feed(fake, round);
            serving.serve(mb, fake);
            round += 1;
            std::thread::sleep(Duration::from_millis(1));
        }
        assert_eq!(mb.runner(), crate::process::pid());
        guest.join().unwrap()
    }

    fn wait(deadline: Option<Instant>) -> GuestWait<'static> {
        GuestWait {
            deadline,
            on_signal: &never,
            kick: &|| {},
            left: &never,
        }
    }

    #[test]
    fn a_guests_send_and_receive_are_served_with_its_own_memory() {
        let mb = Mailbox::for_fork().expect("shared pages");
        let mut fake = Fake::default();
        let out: Vec<u8> = (0..100_000u32).map(|i| (i * 7) as u8).collect();
        let expect = out.clone();
        let r = served_call(
            &mb,
            &mut fake,
            move |mb| {
                let req = Request::Send {
                    addr: out.as_ptr() as u64,
                    len: out.len() as u64,
                    nonblocking: false,
                };
                call(mb, req, &wait(None))
            },
            |_, _| {},
        );
        assert_eq!(r, Answer::Done(Ok(100_000)));
        assert_eq!(fake.sent, expect, "the guest's bytes, read from its memory");

        // A receive waits until the engine has bytes, then they land in the
        // guest's buffer; readiness was published meanwhile.
        let (tx, rx) = std::sync::mpsc::channel();
        let r = served_call(
            &mb,
            &mut fake,
            move |mb| {
                let mut b = vec![0u8; 64];
                let req = Request::Recv {
                    addr: b.as_mut_ptr() as u64,
                    len: 64,
                    flags: RecvFlags::default(),
                };
                let r = call(mb, req, &wait(None));
                tx.send(b).unwrap();
                r
            },
            |f, round| {
                if round == 5 {
                    f.rx.extend_from_slice(b"hello, guest");
                }
            },
        );
        assert_eq!(r, Answer::Done(Ok(12)));
        assert_eq!(&rx.recv().unwrap()[..12], b"hello, guest");
        assert!(mb.published().is_some_and(|r| r.writable && !r.readable));
    }

    #[test]
    fn a_guests_deadline_cancels_its_request_and_an_ending_answers_the_rest() {
        let mb = Mailbox::for_fork().expect("shared pages");
        let mut fake = Fake::default();
        let r = served_call(
            &mb,
            &mut fake,
            |mb| {
                let mut b = vec![0u8; 8];
                let req = Request::Recv {
                    addr: b.as_mut_ptr() as u64,
                    len: 8,
                    flags: RecvFlags::default(),
                };
                let r = call(
                    mb,
                    req,
                    &wait(Some(Instant::now() + Duration::from_millis(50))),
                );
                drop(b);
                r
            },
            |_, _| {},
        );
        assert_eq!(r, Answer::Done(Err(CallError::Interrupted)));
        assert_eq!(fake.cancelled.len(), 1, "the runner cancelled it");
        mb.end(Ending::Eof);
        let b = [0u8; 4];
        let send = Request::Send {
            addr: b.as_ptr() as u64,
            len: 4,
            nonblocking: false,
        };
        assert_eq!(
            call(&mb, send, &wait(None)),
            Answer::Done(Err(CallError::BrokenPipe))
        );
        let recv = Request::Recv {
            addr: b.as_ptr() as u64,
            len: 4,
            flags: RecvFlags::default(),
        };
        assert_eq!(call(&mb, recv, &wait(None)), Answer::Done(Ok(0)));
    }

    /// A runner that lets the connection go without moving it answers the
    /// call it took, by the ending; a call posted and not taken is
    /// answered by the ending too, while the runner's process lives. (A
    /// guest waited for good for either before: it looked only for the
    /// runner's death.)
    #[test]
    fn a_runner_that_lets_go_answers_what_it_took_and_what_waits() {
        let recv = |mb: Arc<Mailbox>| {
            std::thread::spawn(move || {
                let mut b = vec![0u8; 8];
                let req = Request::Recv {
                    addr: b.as_mut_ptr() as u64,
                    len: 8,
                    flags: RecvFlags::default(),
                };
                let r = call(&mb, req, &wait(None));
                drop(b);
                r
            })
        };
        let finished = |g: &std::thread::JoinHandle<Answer>| {
            let t0 = Instant::now();
            while !g.is_finished() && t0.elapsed() < Duration::from_secs(10) {
                std::thread::sleep(Duration::from_millis(1));
            }
            g.is_finished()
        };
        // Taken: the fake engine leaves the receive pending.
        let mb = Mailbox::for_fork().expect("shared pages");
        let mut fake = Fake::default();
        let mut serving = Serving::default();
        let guest = recv(Arc::clone(&mb));
        let t0 = Instant::now();
        while serving.calls().is_empty() && t0.elapsed() < Duration::from_secs(10) {
            serving.serve(&mb, &mut fake);
            std::thread::sleep(Duration::from_millis(1));
        }
        assert_eq!(serving.calls().len(), 1, "the runner took the receive");
        serving.end(&mb, Ending::Reset);
        assert!(finished(&guest), "the guest still waits");
        assert_eq!(
            guest.join().unwrap(),
            Answer::Done(Err(CallError::ConnReset))
        );
        // Posted, never taken, the runner (this process) alive.
        let mb = Mailbox::for_fork().expect("shared pages");
        Serving::default().serve(&mb, &mut fake);
        let guest = recv(Arc::clone(&mb));
        std::thread::sleep(Duration::from_millis(30));
        mb.end(Ending::Eof);
        assert!(finished(&guest), "the guest still waits");
        assert_eq!(guest.join().unwrap(), Answer::Done(Ok(0)));
    }

    /// The permissions of the mapping at `at` in /proc/self/maps.
    fn maps_line(at: usize) -> String {
        let maps = std::fs::read_to_string("/proc/self/maps").unwrap();
        maps.lines()
            .find(|l| {
                let (a, _) = l.split_once('-').unwrap();
                usize::from_str_radix(a, 16).unwrap() == at
            })
            .map(|l| l.split_whitespace().nth(1).unwrap().to_string())
            .unwrap_or_default()
    }

    #[test]
    fn a_detached_page_is_private_and_still_usable() {
        let p: SharedPages<FamilyPage> = SharedPages::new().expect("shared pages");
        p.get().epoch.store(7, Ordering::SeqCst);
        assert_eq!(maps_line(p.ptr as usize), "rw-s");
        p.detach();
        assert_eq!(maps_line(p.ptr as usize), "rw-p", "no longer shared");
        assert_eq!(p.get().epoch.load(Ordering::SeqCst), 0, "fresh pages");
        p.get().epoch.store(9, Ordering::SeqCst);
        assert_eq!(p.get().epoch.load(Ordering::SeqCst), 9);
        let at = p.ptr as usize;
        assert!(MAPPED.lock().iter().any(|m| m.0 == at));
        drop(p);
        assert!(
            !MAPPED.lock().iter().any(|m| m.0 == at),
            "forgotten when unmapped"
        );
    }

    #[test]
    fn a_request_longer_than_a_chunk_is_cut_to_one() {
        let (op, f, a, _) = Request::TakeError.encode();
        assert_eq!(Request::decode(op, f, a, 0), Some(Request::TakeError));
        let r = Request::decode(1, 0, 0, CHUNK * 3);
        assert!(matches!(r, Some(Request::Send { len, .. }) if len == CHUNK));
    }
}
