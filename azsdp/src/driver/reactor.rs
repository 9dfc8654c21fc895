//! The reactor: one thread drives every connection of the process that no
//! call is driving.
//!
//! The reactor sleeps in `epoll_wait` over:
//! - the process's **bell**, a datagram socket whose writing end every
//!   peer process holds: a peer rings a connection by sending its token
//!   (8 bytes), and sends its mail there too (a claim after a fork, with
//!   the sender's kernel identity);
//! - descriptors shared by connections, such as a peer process's pidfd
//!   (one per peer process, whatever the number of connections to it),
//!   which fires when that process exits;
//! - descriptors of one connection (a NIC's completion channel, the
//!   `mprotect` backend's fault pipe);
//! - an eventfd for wake-ups from other threads, and the earliest timer any
//!   connection asked for;
//! - one-time readiness watches of program sockets ([`Reactor::when_ready`]):
//!   a thread that waits on a connection's TCP socket sleeps on a futex,
//!   and whoever turns the set wakes it, so that it holds no descriptor.
//!
//! It then *services* each connection that is due: rung, fired, its timer
//! passed, or woken by another thread (a fault arrived, a call left work
//! behind). What a service does is the connection's business
//! ([`Serviced`]); it says when it wants looking at next and whether its
//! descriptors should fire again.
//!
//! So a process has a fixed number of azsdp threads however many
//! connections it holds (this one, and the userfaultfd dispatcher), and a
//! connection holds no descriptor of its own beyond the program's socket.
//!
//! Rules that keep one thread for all safe:
//! - the reactor never blocks on a connection: a service only `try_lock`s
//!   it (a holder that was asked for wakes it again when it lets go);
//! - a service never touches application memory: the engine reads and
//!   writes it only for calls that are in progress, and a connection with
//!   a call in progress is driven by that call's thread;
//! - descriptors are registered one-shot, so a descriptor that stays
//!   readable (a hung-up channel) fires once per service that re-arms it,
//!   never in a loop; one the connection is done with is removed before it
//!   is closed (shared ones are held by the reactor while watched);
//! - the bell is anyone's to ring: a token names at most a connection to
//!   look at (a spurious look costs a turn), and a full bell loses nothing
//!   (the ringer leaves the ring armed, and the backstop look comes).
//!
//! After `fork()` the child has no reactor thread and must not touch the
//! parent's epoll instance (it shares it): a child that adopts a connection
//! starts a reactor of its own, and the parent's registrations it inherited
//! are dropped without a system call.
//!
//! `unsafe` here: `epoll_*` and `eventfd` calls.

use std::cmp::Reverse;
use std::collections::BinaryHeap;
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd};
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::{Arc, Weak};
use std::time::{Duration, Instant};

use std::collections::{HashMap, HashSet};
use std::os::fd::{AsFd, BorrowedFd};

use super::lease::{Borrow, Lease, Signal};
use crate::identity::{self, IdentityError, Received};
use crate::sync::Lock;

/// A connection the reactor drives.
pub trait Serviced: Send + Sync {
    /// Look at the connection (see [`Wake`] for why).
    fn service(&self, wake: Wake) -> Next;
}

/// Why a connection is serviced.
#[derive(Debug, Default)]
pub struct Wake {
    /// Rung on the bell, or one of its descriptors fired.
    pub fired: bool,
    /// Another thread asked (see [`Registration::wake`]).
    pub woken: bool,
    /// A shared descriptor it watches fired (a peer process exited).
    pub shared_fired: bool,
    /// Mail that came for it on the bell.
    pub mail: Vec<Mail>,
}

/// A message for one connection that came on the bell with its sender's
/// kernel identity (see [`send_mail`]).
#[derive(Debug)]
pub struct Mail {
    pub body: [u8; MAIL_LEN],
    pub from: Received,
}

/// Bytes of a mail's body.
pub const MAIL_LEN: usize = crate::pairing::INTRO_LEN;
/// A bell message: the token, then (mail only) the body.
const TOKEN_LEN: usize = 8;

/// Ring `token` on a peer's bell (`bell`: its writing end). `false` if the
/// bell is full or gone (the ringer then keeps the ring armed).
pub fn ring(bell: BorrowedFd<'_>, token: u64) -> bool {
    send_ring(bell, token).is_ok()
}

/// Send `token` on `bell` without waiting, by system call (the preload
/// shim's `send` is its hook, a detour per ring).
pub fn send_ring(bell: BorrowedFd<'_>, token: u64) -> std::io::Result<()> {
    let b = token.to_le_bytes();
    // SAFETY: an 8-byte send from a local on a socket we hold, no address.
    let n = unsafe {
        libc::syscall(
            libc::SYS_sendto,
            bell.as_raw_fd(),
            b.as_ptr(),
            b.len(),
            libc::MSG_DONTWAIT | libc::MSG_NOSIGNAL,
            std::ptr::null::<libc::sockaddr>(),
            0,
        )
    };
    if n == b.len() as libc::c_long {
        Ok(())
    } else {
        Err(std::io::Error::last_os_error())
    }
}

/// Send `body` to the connection `token` on a peer's bell, with this
/// process's kernel identity and `fds`.
pub fn send_mail(
    bell: BorrowedFd<'_>,
    token: u64,
    body: &[u8; MAIL_LEN],
    fds: &[BorrowedFd<'_>],
) -> std::io::Result<()> {
    let mut b = [0u8; TOKEN_LEN + MAIL_LEN];
    b[..TOKEN_LEN].copy_from_slice(&token.to_le_bytes());
    b[TOKEN_LEN..].copy_from_slice(body);
    identity::send_nonblocking(bell, &b, fds)
}

/// What a service asks of the reactor.
#[derive(Clone, Copy, Debug, Default)]
pub struct Next {
    /// Service again at this time at the latest (`None`: only when a
    /// descriptor fires or someone wakes it).
    pub at: Option<Instant>,
    /// Re-arm the connection's descriptors (`false`: they do not matter
    /// now, or would fire for good).
    pub watch: bool,
    /// The connection is done with the reactor: forget it.
    pub done: bool,
    /// Calls drive the connection (see [`super::standby`]): service it
    /// again at once on [`unpark_all`].
    pub parked: bool,
}

/// The epoll token of the wake-up eventfd.
const WAKE_TOKEN: u64 = u64::MAX;
/// The epoll token of the bell.
const BELL_TOKEN: u64 = u64::MAX - 1;
/// The epoll token of the family bell (see [`super::delegation`]).
const FAMILY_TOKEN: u64 = u64::MAX - 2;
/// Set in the epoll token of a shared descriptor (the rest: its number).
const SHARED_FLAG: u64 = 1 << 62;
/// Set in the epoll token of a one-time readiness watch ([`ReadyOnce`];
/// the rest: its generation and slot).
const ONCE_FLAG: u64 = 1 << 61;
/// Generations stay below this, so that no connection's token has a
/// flag bit set.
const GENERATIONS: u32 = 1 << 29;
/// Send buffer of the bell's writing end, in bytes (a ring costs about a
/// kilobyte of it until read).
const BELL_ROOM: libc::c_int = 4 << 20;
/// Bell messages taken per wake-up.
const BELL_BATCH: usize = 512;
/// Bell messages taken per system call.
const BELL_RECV: usize = 16;
/// Events taken per `epoll_wait`.
const BATCH: usize = 256;

struct Entry {
    conn: Weak<dyn Serviced>,
    generation: u32,
    fds: Vec<i32>,
    /// The descriptors are armed in epoll (one-shot: disarmed once fired).
    watching: bool,
    /// The earliest timer queued for it (stale heap entries are skipped).
    timer: Option<Instant>,
    /// In the ready list already.
    queued: bool,
    /// In the parked list already (a set, so that ten thousand parked
    /// connections cost no search each).
    parked: bool,
    fired: bool,
    woken: bool,
    shared_fired: bool,
    mail: Vec<Mail>,
    /// Shared descriptors it watches (by number).
    shared: Vec<i32>,
}

/// A descriptor several connections watch, held while watched.
struct SharedWatch {
    fd: Arc<std::os::fd::OwnedFd>,
    /// A set: ten thousand connections to one peer process share its
    /// pidfd, and each leaves on its own.
    conns: HashSet<(usize, u32)>,
}

#[derive(Default)]
struct Inner {
    entries: Vec<Option<Entry>>,
    free: Vec<usize>,
    next_generation: u32,
    timers: BinaryHeap<Reverse<(Instant, usize, u32)>>,
    ready: Vec<usize>,
    /// Connections whose last service parked them.
    parked: Vec<(usize, u32)>,
    shared: HashMap<i32, SharedWatch>,
    /// The family bell (watched edge-triggered, never drained) and the
    /// connections whose guests ring it.
    family: Option<SharedWatch>,
    /// One-time readiness watches, by slot: generation and who to wake.
    once: Vec<Option<(u32, Waker)>>,
    once_free: Vec<usize>,
}

/// What a [`ReadyOnce`] calls when its descriptor is ready.
pub type Waker = Arc<dyn Fn() + Send + Sync>;

impl Inner {
    /// Forget that `id` watches shared `fd`; the descriptor if nobody does
    /// any more (to remove from the set).
    fn unshare(
        &mut self,
        fd: i32,
        id: usize,
        generation: u32,
    ) -> Option<Arc<std::os::fd::OwnedFd>> {
        let w = self.shared.get_mut(&fd)?;
        w.conns.remove(&(id, generation));
        if w.conns.is_empty() {
            return self.shared.remove(&fd).map(|w| w.fd);
        }
        None
    }

    fn entry(&mut self, id: usize, generation: u32) -> Option<&mut Entry> {
        self.entries
            .get_mut(id)?
            .as_mut()
            .filter(|e| e.generation == generation)
    }

    fn queue(&mut self, id: usize, generation: u32, fired: bool, woken: bool) {
        let Some(e) = self.entry(id, generation) else {
            return;
        };
        e.fired |= fired;
        e.woken |= woken;
        if fired {
            e.watching = false;
        }
        if !e.queued {
            e.queued = true;
            self.ready.push(id);
        }
    }
}

/// The process's reactor.
pub struct Reactor {
    /// The process that made it (a forked child makes its own).
    pid: u32,
    epoll: OwnedFd,
    wake_fd: OwnedFd,
    /// The bell: read here, written by peers (see [`Reactor::bell`]).
    bell_r: OwnedFd,
    bell_w: OwnedFd,
    /// What pairing messages call the bell (its socket's inode number):
    /// a peer process that keeps it is not passed it again.
    bell_id: u32,
    /// The thread is in (or about to enter) `epoll_wait`.
    sleeping: AtomicBool,
    /// Who watches the set (see [`super::lease`]).
    lease: Lease,
    /// Held by whoever turns (the thread, or a borrower).
    turning: Lock<()>,
    inner: Lock<Inner>,
    /// Connections registered (for tests and stats).
    live: AtomicUsize,
    /// Length of `Inner::parked` (looked at without the lock).
    parked: AtomicUsize,
}

/// Service every parked connection at once (see [`super::standby::end`]);
/// one load when none is. `signal`: get the set's watcher to turn (a
/// borrower about to turn itself does not need it).
pub fn unpark_all(signal: bool) {
    let Some(r) = REACTOR
        .try_lock()
        .and_then(|g| g.as_ref().map(Arc::clone))
        .filter(|r| r.pid == crate::process::pid())
    else {
        return;
    };
    if r.parked.load(Ordering::SeqCst) == 0 {
        return;
    }
    {
        let mut st = r.inner.lock();
        let parked = std::mem::take(&mut st.parked);
        r.parked.store(0, Ordering::SeqCst);
        for (id, generation) in parked {
            if let Some(e) = st.entry(id, generation) {
                e.parked = false;
            }
            st.queue(id, generation, false, false);
        }
    }
    if signal {
        r.signal();
    }
}

impl std::fmt::Debug for Reactor {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Reactor")
            .field("pid", &self.pid)
            .field("live", &self.live.load(Ordering::Relaxed))
            .finish()
    }
}

/// The reactor's set, borrowed by a program thread about to sleep in
/// `epoll_wait` (see [`super::lease`]): the thread puts [`Loan::fd`] in
/// its own set, and when it fires, or before it sleeps, calls
/// [`Loan::turn`]. Dropping it gives the set back.
pub struct Loan {
    reactor: Arc<Reactor>,
    events: Vec<libc::epoll_event>,
    /// Given back while other threads sleep without it (dropped without
    /// [`Loan::give_back`]: assumed so).
    others_asleep: bool,
    _not_send: std::marker::PhantomData<*const ()>,
}

/// Events a borrower takes per `epoll_wait` of the reactor's set.
const LOAN_BATCH: usize = 64;
/// `epoll_wait`s of the reactor's set per [`Loan::turn`] at most.
const LOAN_ROUNDS: usize = 16;

impl std::fmt::Debug for Loan {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Loan").field("fd", &self.fd()).finish()
    }
}

impl Loan {
    /// Borrow this process's reactor's set, if it has one and its thread
    /// can spare it now (the first ask wakes the thread to hand over, so
    /// a later wait gets it).
    pub fn borrow() -> Option<Loan> {
        let r = REACTOR
            .try_lock()
            .and_then(|g| g.as_ref().map(Arc::clone))
            .filter(|r| r.pid == crate::process::pid())?;
        // (One borrower at a time: a signal handler's wait in the thread
        // that holds the loan gets none.)
        match r.lease.borrow() {
            Borrow::Lent => {}
            Borrow::Asked => {
                r.ring();
                return None;
            }
            Borrow::No => return None,
        }
        Some(Loan {
            reactor: r,
            events: vec![libc::epoll_event { events: 0, u64: 0 }; LOAN_BATCH],
            others_asleep: true,
            _not_send: std::marker::PhantomData,
        })
    }

    /// The reactor's epoll set, to watch (readable: a turn is due).
    pub fn fd(&self) -> i32 {
        self.reactor.epoll.as_raw_fd()
    }

    /// Turn the reactor without sleeping until its set is drained. Also a
    /// sign of life: call it once per round of the wait.
    pub fn turn(&mut self) {
        self.turn_asking(true);
    }

    /// [`Self::turn`] without asking the kernel about the set: service what
    /// is queued (connections unparked, work handed over) and the timers
    /// that are due. For a borrower whose own set says the reactor's has
    /// not fired since it last turned: one system call fewer per sleep.
    pub fn turn_queued(&mut self) {
        self.turn_asking(false);
    }

    fn turn_asking(&mut self, kernel: bool) {
        let r = &self.reactor;
        r.lease.beat();
        let Some(_turning) = r.turning.try_lock() else {
            // The thread took the set back and turns it.
            return;
        };
        r.lease.turning();
        if !kernel {
            r.turn(&[]);
            return;
        }
        for _ in 0..LOAN_ROUNDS {
            let n = r.wait(&mut self.events, Some(Duration::ZERO));
            r.turn(&self.events[..n]);
            if n < LOAN_BATCH {
                return;
            }
        }
        // More than a turn's worth: the ring is a fresh event, so a set
        // watching ours edge-triggered fires again.
        r.ring();
    }

    /// How long the borrower may sleep before a timer of the reactor's is
    /// due (zero: work is queued; `None`: no timer).
    pub fn timeout(&self) -> Option<Duration> {
        let st = self.reactor.inner.lock();
        if !st.ready.is_empty() {
            return Some(Duration::ZERO);
        }
        st.timers
            .peek()
            .map(|Reverse((at, _, _))| at.saturating_duration_since(Instant::now()))
    }
}

impl Loan {
    /// Give the set back. `others_asleep`: other threads sleep waiting for
    /// readiness without it, so its thread must watch again now (not
    /// after a nap), or their peers' rings would wait for it.
    pub fn give_back(mut self, others_asleep: bool) {
        self.others_asleep = others_asleep;
    }
}

impl Drop for Loan {
    fn drop(&mut self) {
        let lease = &self.reactor.lease;
        if lease.give_back(self.others_asleep) {
            crate::futex::wake_all(lease.word());
        }
    }
}

static REACTOR: Lock<Option<Arc<Reactor>>> = Lock::new(None);

/// The locks of this module, held by the fork handler across `fork()`.
pub(crate) fn fork_guards() -> Vec<Box<dyn std::any::Any>> {
    vec![Box::new(REACTOR.lock())]
}

fn os_err(what: &str) -> std::io::Error {
    let e = std::io::Error::last_os_error();
    std::io::Error::new(e.kind(), format!("{what}: {e}"))
}

impl Reactor {
    /// This process's reactor, started on first use.
    pub fn get() -> std::io::Result<Arc<Reactor>> {
        let pid = crate::process::pid();
        let mut slot = REACTOR.lock();
        if let Some(r) = slot.as_ref().filter(|r| r.pid == pid) {
            return Ok(Arc::clone(r));
        }
        // A parent's reactor, inherited over fork: its epoll instance is
        // the parent's (shared), so it is left alone, never closed here.
        if let Some(old) = slot.take() {
            std::mem::forget(old);
        }
        // SAFETY: plain system calls; the descriptors become owned below.
        let (ep, ev) = unsafe {
            (
                libc::epoll_create1(libc::EPOLL_CLOEXEC),
                libc::eventfd(0, libc::EFD_CLOEXEC | libc::EFD_NONBLOCK),
            )
        };
        if ep < 0 || ev < 0 {
            let e = os_err("reactor");
            // SAFETY: closing what we just opened, if we did.
            unsafe {
                if ep >= 0 {
                    libc::close(ep);
                }
                if ev >= 0 {
                    libc::close(ev);
                }
            }
            return Err(e);
        }
        // SAFETY: both were just opened and are ours alone.
        let (epoll, wake_fd) = unsafe { (OwnedFd::from_raw_fd(ep), OwnedFd::from_raw_fd(ev)) };
        let (bell_r, bell_w) = {
            use nix::sys::socket::{AddressFamily, SockFlag, SockType, socketpair};
            socketpair(
                AddressFamily::Unix,
                SockType::Datagram,
                None,
                SockFlag::SOCK_CLOEXEC | SockFlag::SOCK_NONBLOCK,
            )
            .map_err(std::io::Error::from)?
        };
        identity::pass_credentials(bell_r.as_fd())?;
        let bell_id = crate::fabric::shm::bell_id(bell_w.as_fd())?;
        // Every peer's rings are charged to this one socket's send buffer
        // until read: room for many (what does not fit waits for the next
        // message, or the backstop look).
        let room: libc::c_int = BELL_ROOM;
        for opt in [libc::SO_SNDBUFFORCE, libc::SO_SNDBUF] {
            // SAFETY: setsockopt with a c_int we own, on our socket.
            let r = unsafe {
                libc::setsockopt(
                    bell_w.as_raw_fd(),
                    libc::SOL_SOCKET,
                    opt,
                    (&raw const room).cast(),
                    std::mem::size_of::<libc::c_int>() as libc::socklen_t,
                )
            };
            if r == 0 {
                break;
            }
        }
        let r = Arc::new(Reactor {
            pid,
            epoll,
            wake_fd,
            bell_r,
            bell_w,
            bell_id,
            sleeping: AtomicBool::new(false),
            lease: Lease::default(),
            turning: Lock::new(()),
            inner: Lock::new(Inner::default()),
            live: AtomicUsize::new(0),
            parked: AtomicUsize::new(0),
        });
        r.ctl(
            libc::EPOLL_CTL_ADD,
            r.wake_fd.as_raw_fd(),
            WAKE_TOKEN,
            false,
        )?;
        r.ctl(libc::EPOLL_CTL_ADD, r.bell_r.as_raw_fd(), BELL_TOKEN, false)?;
        let run = Arc::clone(&r);
        crate::threads::spawn("azsdp-reactor", move || run.run())?;
        *slot = Some(Arc::clone(&r));
        Ok(r)
    }

    /// The bell's writing end, for peers: pass it at pairing (and with a
    /// claim after a fork); they ring [`Registration::token`] on it.
    pub fn bell(&self) -> BorrowedFd<'_> {
        self.bell_w.as_fd()
    }

    /// The bell's id in pairing messages (`pairing::BellNote`).
    pub fn bell_id(&self) -> u32 {
        self.bell_id
    }

    /// Call `wake` once, from whichever thread turns the set, when `fd`
    /// is ready for `events` (`EPOLLIN`, `EPOLLOUT`; hang-ups and errors
    /// count), or at once if it is now; forgotten when the returned watch
    /// drops. `fd` is the caller's to keep open until then: a program's
    /// socket that a waiting call of its own stands on.
    pub fn when_ready(
        self: &Arc<Self>,
        fd: i32,
        events: u32,
        wake: Waker,
    ) -> std::io::Result<ReadyOnce> {
        let (slot, generation) = {
            let mut st = self.inner.lock();
            st.next_generation = (st.next_generation + 1) % GENERATIONS;
            let generation = st.next_generation;
            let slot = match st.once_free.pop() {
                Some(i) => i,
                None => {
                    st.once.push(None);
                    st.once.len() - 1
                }
            };
            st.once[slot] = Some((generation, wake));
            (slot, generation)
        };
        let watch = ReadyOnce {
            reactor: Arc::clone(self),
            slot,
            generation,
        };
        // The program's socket: its registration stays in the set after a
        // watch ends (one-shot, so it fires at most once more, for a token
        // nobody holds), and goes when the socket closes; the next watch
        // re-arms it. (A socket ready already wakes whoever waits on the
        // set.)
        let events = events | libc::EPOLLRDHUP as u32 | libc::EPOLLONESHOT as u32;
        let token = ONCE_FLAG | (u64::from(generation) << 32) | slot as u64;
        match self.epoll_ctl(libc::EPOLL_CTL_MOD, fd, events, token) {
            Err(e) if e.raw_os_error() == Some(libc::ENOENT) => {
                self.epoll_ctl(libc::EPOLL_CTL_ADD, fd, events, token)
            }
            r => r,
        }
        .map(|()| watch)
        .map_err(|_| os_err("epoll_ctl"))
    }

    fn ctl(&self, op: i32, fd: i32, token: u64, oneshot: bool) -> std::io::Result<()> {
        let oneshot = if oneshot {
            libc::EPOLLONESHOT as u32
        } else {
            0
        };
        self.epoll_ctl(
            op,
            fd,
            (libc::EPOLLIN | libc::EPOLLRDHUP) as u32 | oneshot,
            token,
        )
        .map_err(|_| os_err("epoll_ctl"))
    }

    /// `epoll_ctl` on our set, by system call: the shim hooks libc's for
    /// the program's upgraded sockets, which `when_ready` watches and
    /// which our own descriptors never are. `events` is unused by DEL.
    fn epoll_ctl(&self, op: i32, fd: i32, events: u32, token: u64) -> std::io::Result<()> {
        let mut ev = libc::epoll_event { events, u64: token };
        // SAFETY: an event we own, for the duration of the call (the
        // kernel ignores it for EPOLL_CTL_DEL).
        let r = unsafe {
            libc::syscall(
                libc::SYS_epoll_ctl,
                self.epoll.as_raw_fd(),
                op,
                fd,
                &raw mut ev,
            )
        };
        if r == 0 {
            Ok(())
        } else {
            Err(std::io::Error::last_os_error())
        }
    }

    /// Drive `conn`, watching `fds` (one-shot; re-armed when its service
    /// asks). It is serviced once at once.
    pub fn register(
        self: &Arc<Self>,
        conn: Weak<dyn Serviced>,
        fds: &[i32],
    ) -> std::io::Result<Registration> {
        let reg = self.register_watching(conn, fds)?;
        reg.wake();
        Ok(reg)
    }

    /// As [`Reactor::register`], but serviced first when one of `fds`
    /// fires (the kernel reports one that is ready already as it is
    /// added): no wake-up of the reactor for a look that would find
    /// nothing, such as a pair's answer that has yet to come.
    pub fn register_watching(
        self: &Arc<Self>,
        conn: Weak<dyn Serviced>,
        fds: &[i32],
    ) -> std::io::Result<Registration> {
        let (id, generation) = {
            let mut st = self.inner.lock();
            st.next_generation = (st.next_generation + 1) % GENERATIONS;
            let generation = st.next_generation;
            let entry = Entry {
                conn,
                generation,
                fds: Vec::new(),
                watching: true,
                timer: None,
                queued: false,
                parked: false,
                fired: false,
                woken: false,
                shared_fired: false,
                mail: Vec::new(),
                shared: Vec::new(),
            };
            let id = match st.free.pop() {
                Some(id) => {
                    st.entries[id] = Some(entry);
                    id
                }
                None => {
                    st.entries.push(Some(entry));
                    st.entries.len() - 1
                }
            };
            (id, generation)
        };
        let reg = Registration {
            reactor: Arc::clone(self),
            id,
            generation,
        };
        self.live.fetch_add(1, Ordering::SeqCst);
        for &fd in fds {
            self.ctl(libc::EPOLL_CTL_ADD, fd, token(id, generation), true)?;
            if let Some(e) = self.inner.lock().entry(id, generation) {
                e.fds.push(fd);
            }
        }
        Ok(reg)
    }

    /// Ask for a service of `id` soon (from any thread; never blocks for
    /// long: the reactor holds its lock only between services).
    fn wake(&self, id: usize, generation: u32) {
        self.inner.lock().queue(id, generation, false, true);
        self.signal();
    }

    /// Ask for a plain service of `id` soon: not [`Wake::woken`], so the
    /// connection's standby holds (see [`Registration::look_again`]).
    fn look_again(&self, id: usize, generation: u32) {
        self.inner.lock().queue(id, generation, false, false);
        self.signal();
    }

    /// Work is queued: get whoever watches the set to turn.
    fn signal(&self) {
        match self.lease.work_queued() {
            Signal::WakeThread => crate::futex::wake_all(self.lease.word()),
            // A borrower hears the ring through its own set; the thread,
            // if it sleeps (else it sees the work before it does).
            Signal::Ring => {
                if !self.lease.by_thread() || self.sleeping.load(Ordering::SeqCst) {
                    self.ring();
                }
            }
        }
    }

    fn ring(&self) {
        let one = 1u64;
        // SAFETY: an 8-byte write from a local to our eventfd.
        unsafe { libc::write(self.wake_fd.as_raw_fd(), (&raw const one).cast(), 8) };
    }

    fn remove(&self, id: usize, generation: u32) {
        let (fds, unwatched) = {
            let mut st = self.inner.lock();
            match st.entry(id, generation) {
                Some(e) => {
                    let fds = std::mem::take(&mut e.fds);
                    let shared = std::mem::take(&mut e.shared);
                    st.entries[id] = None;
                    st.free.push(id);
                    if let Some(f) = st.family.as_mut() {
                        f.conns.remove(&(id, generation));
                    }
                    let unwatched: Vec<_> = shared
                        .into_iter()
                        .filter_map(|fd| st.unshare(fd, id, generation))
                        .collect();
                    (fds, unwatched)
                }
                None => return,
            }
        };
        // Held until removed from the set, then closed if last.
        for fd in unwatched {
            // (A descriptor we hold, the Arc, until it is out of the set.)
            let _ = self.epoll_ctl(libc::EPOLL_CTL_DEL, fd.as_raw_fd(), 0, 0);
        }
        self.live.fetch_sub(1, Ordering::SeqCst);
        for fd in fds {
            // (One the entry registered, which its owner closes only after
            // this.)
            let _ = self.epoll_ctl(libc::EPOLL_CTL_DEL, fd, 0, 0);
        }
    }

    /// The thread: wait, collect what is due, service it, repeat; stand
    /// aside while a program thread borrows the set (see [`Loan`]).
    fn run(&self) {
        let mut events = vec![libc::epoll_event { events: 0, u64: 0 }; BATCH];
        while crate::process::pid() == self.pid {
            if !self.lease.by_thread() {
                self.lease.aside(crate::futex::wait);
                continue;
            }
            let timeout = {
                self.sleeping.store(true, Ordering::SeqCst);
                let st = self.inner.lock();
                if !st.ready.is_empty() {
                    Some(Duration::ZERO)
                } else {
                    st.timers
                        .peek()
                        .map(|Reverse((at, _, _))| at.saturating_duration_since(Instant::now()))
                }
            };
            // What was queued so far, this turn takes.
            self.lease.turning();
            let n = self.wait(&mut events, timeout);
            // (Not held across the sleep: a fork waits for our locks.)
            let turning = self.turning.lock();
            self.turn(&events[..n]);
            drop(turning);
            self.lease.hand_over();
        }
    }

    /// Wait up to `timeout` (`None`: for ever) for the set; the events
    /// taken.
    fn wait(&self, events: &mut [libc::epoll_event], timeout: Option<Duration>) -> usize {
        let n = crate::poll_fd::epoll_wait_own(self.epoll.as_fd(), events, timeout);
        self.sleeping.store(false, Ordering::SeqCst);
        n
    }

    /// One turn, the caller holding `turning`: collect what `events` and
    /// the timers make due, and service it.
    fn turn(&self, events: &[libc::epoll_event]) {
        let mut due: Vec<(usize, u32, Weak<dyn Serviced>, Wake)> = Vec::new();
        // Called once the lock is let go.
        let mut ready_once: Vec<Waker> = Vec::new();
        {
            let mut st = self.inner.lock();
            for ev in events {
                let t = ev.u64;
                if t == WAKE_TOKEN {
                    let mut v = 0u64;
                    // SAFETY: an 8-byte read into a local.
                    unsafe { libc::read(self.wake_fd.as_raw_fd(), (&raw mut v).cast(), 8) };
                    continue;
                }
                if t == BELL_TOKEN {
                    self.take_bell(&mut st);
                    continue;
                }
                if t == FAMILY_TOKEN {
                    // A guest posted a request to one of them.
                    let conns = st
                        .family
                        .as_ref()
                        .map(|f| f.conns.iter().copied().collect::<Vec<_>>())
                        .unwrap_or_default();
                    for (id, generation) in conns {
                        st.queue(id, generation, false, true);
                    }
                    continue;
                }
                if t & ONCE_FLAG != 0 {
                    let (slot, generation) =
                        ((t & 0xffff_ffff) as usize, ((t & !ONCE_FLAG) >> 32) as u32);
                    if let Some((g, wake)) = st.once.get_mut(slot).and_then(Option::take) {
                        if g == generation {
                            st.once_free.push(slot);
                            ready_once.push(wake);
                        } else {
                            st.once[slot] = Some((g, wake));
                        }
                    }
                    continue;
                }
                if t & SHARED_FLAG != 0 {
                    // One-shot and not re-armed: a pidfd stays readable.
                    let conns = st
                        .shared
                        .get(&((t & !SHARED_FLAG) as i32))
                        .map(|w| w.conns.iter().copied().collect::<Vec<_>>())
                        .unwrap_or_default();
                    for (id, generation) in conns {
                        if let Some(e) = st.entry(id, generation) {
                            e.shared_fired = true;
                        }
                        st.queue(id, generation, false, true);
                    }
                    continue;
                }
                st.queue((t & 0xffff_ffff) as usize, (t >> 32) as u32, true, false);
            }
            let now = Instant::now();
            while let Some(&Reverse((at, id, generation))) = st.timers.peek() {
                if at > now {
                    break;
                }
                st.timers.pop();
                let current = st.entry(id, generation).and_then(|e| e.timer);
                if current == Some(at) {
                    if let Some(e) = st.entry(id, generation) {
                        e.timer = None;
                    }
                    st.queue(id, generation, false, false);
                }
            }
            let ready = std::mem::take(&mut st.ready);
            for id in &ready {
                if let Some(e) = st.entries[*id].as_mut() {
                    e.queued = false;
                    let wake = Wake {
                        fired: std::mem::take(&mut e.fired),
                        woken: std::mem::take(&mut e.woken),
                        shared_fired: std::mem::take(&mut e.shared_fired),
                        mail: std::mem::take(&mut e.mail),
                    };
                    due.push((*id, e.generation, e.conn.clone(), wake));
                }
            }
            st.ready = ready;
            st.ready.clear();
        }
        for wake in ready_once {
            wake();
        }
        for (id, generation, conn, wake) in due {
            // The connection may go while it is serviced: its last
            // reference may drop here, with no lock of ours held.
            let next = match conn.upgrade() {
                Some(c) => c.service(wake),
                None => Next {
                    done: true,
                    ..Next::default()
                },
            };
            let _ = self.apply(id, generation, next);
        }
    }

    /// Take what rang: tokens to service, mail to hand over. A bell that
    /// was full may have lost rings (their ringers left their rings armed,
    /// and the backstop look comes), so a full batch services everyone.
    fn take_bell(&self, st: &mut Inner) {
        let mut bufs = [[0u8; TOKEN_LEN + MAIL_LEN]; BELL_RECV];
        let mut taken = 0;
        while taken < BELL_BATCH {
            // One system call for what rang meanwhile: a busy event loop
            // hears several rings per wake-up.
            let got = match identity::recv_batch_with_credentials(self.bell_r.as_fd(), &mut bufs) {
                Ok(got) => got,
                Err(e) if e.kind() == std::io::ErrorKind::Interrupted => continue,
                // WouldBlock (or a bell that failed): nothing more now.
                Err(_) => return,
            };
            let whole = got.len() == BELL_RECV;
            for (r, b) in got.into_iter().zip(bufs.iter()) {
                let token = u64::from_le_bytes(b[..TOKEN_LEN].try_into().expect("8 bytes"));
                let (id, generation) = ((token & 0xffff_ffff) as usize, (token >> 32) as u32);
                match r {
                    Ok(from) => {
                        let mut body = [0u8; MAIL_LEN];
                        body.copy_from_slice(&b[TOKEN_LEN..]);
                        if let Some(e) = st.entry(id, generation) {
                            e.mail.push(Mail { body, from });
                            st.queue(id, generation, true, false);
                        }
                    }
                    Err(IdentityError::Length { got: TOKEN_LEN, .. }) => {
                        st.queue(id, generation, true, false);
                    }
                    // Anything else is nobody's: dropped (descriptors closed).
                    Err(_) => {}
                }
                taken += 1;
            }
            if !whole {
                // The bell was empty when the batch was taken.
                return;
            }
        }
        let all: Vec<(usize, u32)> = st
            .entries
            .iter()
            .enumerate()
            .filter_map(|(id, e)| e.as_ref().map(|e| (id, e.generation)))
            .collect();
        for (id, generation) in all {
            st.queue(id, generation, true, false);
        }
        self.ring();
    }

    /// Do what a service of `id` asked for. Whether it set a timer sooner
    /// than every one before (the sleeper, which took its timeout from
    /// the earliest, would not wake for it).
    fn apply(&self, id: usize, generation: u32, next: Next) -> bool {
        if next.done {
            self.remove(id, generation);
            return false;
        }
        let (rearm, sooner) = {
            let mut st = self.inner.lock();
            let Some(e) = st.entry(id, generation) else {
                return false;
            };
            let mut push = None;
            if let Some(at) = next.at
                && e.timer.is_none_or(|t| at < t)
            {
                e.timer = Some(at);
                push = Some(at);
            }
            let rearm = (next.watch && !e.watching).then(|| {
                e.watching = true;
                e.fds.clone()
            });
            let park = next.parked && !std::mem::replace(&mut e.parked, true);
            let mut sooner = false;
            if let Some(at) = push {
                sooner = st
                    .timers
                    .peek()
                    .is_none_or(|Reverse((top, _, _))| at < *top);
                st.timers.push(Reverse((at, id, generation)));
            }
            if park {
                st.parked.push((id, generation));
                self.parked.store(st.parked.len(), Ordering::SeqCst);
            }
            (rearm, sooner)
        };
        for fd in rearm.into_iter().flatten() {
            let _ = self.ctl(libc::EPOLL_CTL_MOD, fd, token(id, generation), true);
        }
        sooner
    }
}

fn token(id: usize, generation: u32) -> u64 {
    (u64::from(generation) << 32) | id as u64
}

/// A connection's place in the reactor; dropping it forgets the
/// connection (and stops watching its descriptors, which must stay open
/// until then).
pub struct Registration {
    reactor: Arc<Reactor>,
    id: usize,
    generation: u32,
}

impl std::fmt::Debug for Registration {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Registration")
            .field("id", &self.id)
            .finish()
    }
}

impl Registration {
    /// Service the connection soon, whatever its descriptors and timers say.
    pub fn wake(&self) {
        if self.reactor.pid == crate::process::pid() {
            self.reactor.wake(self.id, self.generation);
        }
    }

    /// Service the connection by `at` (sooner if its timers say), waking
    /// the reactor only if it would look later than that anyway.
    pub fn look_by(&self, at: Instant) {
        self.serviced_here(Next {
            at: Some(at),
            ..Next::default()
        });
    }

    /// The connection's owner serviced it itself (its first look, as it
    /// registers): do what that service asked, and wake the reactor only
    /// if it must look sooner than it would anyway (a new connection
    /// costs it no wake-up while other timers are earlier).
    pub fn serviced_here(&self, next: Next) {
        let r = &self.reactor;
        if r.pid != crate::process::pid() {
            return;
        }
        if next.done {
            // (Rare at a first look: left to the reactor as before.)
            r.wake(self.id, self.generation);
            return;
        }
        if r.apply(self.id, self.generation, next) {
            r.signal();
        }
    }

    /// Service the connection soon, as it would be had its last service
    /// not found it busy: a caller or an event loop that drives it now
    /// keeps the reactor off it, where [`Registration::wake`] would not.
    pub fn look_again(&self) {
        if self.reactor.pid == crate::process::pid() {
            self.reactor.look_again(self.id, self.generation);
        }
    }

    /// What a peer rings on this process's bell for this connection.
    pub fn token(&self) -> u64 {
        token(self.id, self.generation)
    }

    /// Watch a descriptor other connections may watch too (a peer
    /// process's pidfd): when it fires, each of them is serviced, with
    /// [`Wake::shared_fired`]. One-shot: it fires once. The reactor holds
    /// it while anyone watches it.
    pub fn watch_shared(&self, fd: Arc<std::os::fd::OwnedFd>) -> std::io::Result<()> {
        let r = &self.reactor;
        let raw = fd.as_raw_fd();
        let me = (self.id, self.generation);
        let mut st = r.inner.lock();
        if st.entry(self.id, self.generation).is_none() {
            return Ok(());
        }
        let fresh = !st.shared.contains_key(&raw);
        if fresh {
            r.ctl(libc::EPOLL_CTL_ADD, raw, SHARED_FLAG | raw as u64, true)?;
        }
        let w = st.shared.entry(raw).or_insert_with(|| SharedWatch {
            fd,
            conns: HashSet::new(),
        });
        if w.conns.insert(me)
            && let Some(e) = st.entry(self.id, self.generation)
        {
            e.shared.push(raw);
        }
        Ok(())
    }

    /// Service the connection whenever a guest rings the family bell `fd`
    /// (see [`super::delegation`]): watched edge-triggered, so each ring
    /// is an event for every process's reactor that watches it, and
    /// nobody drains it.
    pub fn watch_family(&self, fd: &Arc<std::os::fd::OwnedFd>) -> std::io::Result<()> {
        let r = &self.reactor;
        let me = (self.id, self.generation);
        let mut st = r.inner.lock();
        if st.entry(self.id, self.generation).is_none() {
            return Ok(());
        }
        if st.family.is_none() {
            let events = (libc::EPOLLIN | libc::EPOLLET) as u32;
            r.epoll_ctl(libc::EPOLL_CTL_ADD, fd.as_raw_fd(), events, FAMILY_TOKEN)
                .map_err(|_| os_err("epoll_ctl"))?;
            st.family = Some(SharedWatch {
                fd: Arc::clone(fd),
                conns: HashSet::new(),
            });
        }
        if let Some(f) = st.family.as_mut() {
            f.conns.insert(me);
        }
        Ok(())
    }

    /// Stop watching shared `fd` (see [`Registration::watch_shared`]).
    pub fn unwatch_shared(&self, fd: &std::os::fd::OwnedFd) {
        let r = &self.reactor;
        let raw = fd.as_raw_fd();
        let gone = {
            let mut st = r.inner.lock();
            if let Some(e) = st.entry(self.id, self.generation) {
                e.shared.retain(|f| *f != raw);
            }
            st.unshare(raw, self.id, self.generation)
        };
        if let Some(fd) = gone {
            // (A descriptor we still hold.)
            let _ = r.epoll_ctl(libc::EPOLL_CTL_DEL, fd.as_raw_fd(), 0, 0);
        }
    }

    /// Watch `fd` too (one-shot, as those given at registration).
    pub fn watch(&self, fd: i32) -> std::io::Result<()> {
        let r = &self.reactor;
        r.ctl(
            libc::EPOLL_CTL_ADD,
            fd,
            token(self.id, self.generation),
            true,
        )?;
        if let Some(e) = r.inner.lock().entry(self.id, self.generation) {
            e.fds.push(fd);
        }
        Ok(())
    }

    /// A closure that does [`Registration::wake`] (for fault wakers).
    pub fn waker(&self) -> impl Fn() + Send + Sync + 'static {
        let (r, id, generation) = (Arc::clone(&self.reactor), self.id, self.generation);
        move || {
            if r.pid == crate::process::pid() {
                r.wake(id, generation);
            }
        }
    }
}

impl Drop for Registration {
    fn drop(&mut self) {
        // A forked child's copy of the parent's: not ours to touch.
        if self.reactor.pid == crate::process::pid() {
            self.reactor.remove(self.id, self.generation);
        }
    }
}

/// A one-time readiness watch ([`Reactor::when_ready`]); dropping it
/// forgets it.
pub struct ReadyOnce {
    reactor: Arc<Reactor>,
    slot: usize,
    generation: u32,
}

impl std::fmt::Debug for ReadyOnce {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ReadyOnce")
            .field("slot", &self.slot)
            .finish()
    }
}

impl Drop for ReadyOnce {
    fn drop(&mut self) {
        let mut st = self.reactor.inner.lock();
        let ours = st
            .once
            .get(self.slot)
            .and_then(Option::as_ref)
            .is_some_and(|(g, _)| *g == self.generation);
        let taken = if ours {
            st.once_free.push(self.slot);
            st.once[self.slot].take()
        } else {
            None
        };
        // (Its waker dropped with no lock of ours held.)
        drop(st);
        drop(taken);
    }
}

/// How long the reactor may leave an idle connection unlooked at: a
/// backstop for what no descriptor announces (a peer that dies while a
/// forked child of it keeps its side channel open).
pub const IDLE_LOOK: Duration = Duration::from_secs(1);

#[cfg(test)]
mod tests {
    use super::*;
    use crossbeam_channel::{Receiver, Sender, unbounded};

    /// What one service saw: (fired, woken, shared_fired, mails).
    type Seen = (bool, bool, bool, usize);

    struct Probe {
        seen: Sender<Seen>,
        next: Lock<Next>,
    }

    impl Serviced for Probe {
        fn service(&self, w: Wake) -> Next {
            let _ = self
                .seen
                .send((w.fired, w.woken, w.shared_fired, w.mail.len()));
            *self.next.lock()
        }
    }

    fn probe(r: &Arc<Reactor>) -> (Arc<Probe>, Registration, Receiver<Seen>) {
        probe_registered(r, true)
    }

    /// A probe registered with a first look (`looked`) or without.
    fn probe_registered(
        r: &Arc<Reactor>,
        looked: bool,
    ) -> (Arc<Probe>, Registration, Receiver<Seen>) {
        let (tx, rx) = unbounded();
        let p = Arc::new(Probe {
            seen: tx,
            next: Lock::new(Next::default()),
        });
        let weak: Weak<dyn Serviced> = Arc::downgrade(&p) as Weak<dyn Serviced>;
        let reg = if looked {
            r.register(weak, &[])
        } else {
            r.register_watching(weak, &[])
        };
        (p, reg.expect("register"), rx)
    }

    const LONG: Duration = Duration::from_secs(10);

    /// A one-time watch calls its waker once when its socket turns
    /// readable (and at once if it is already), never after it is
    /// dropped, and a socket watched again is re-armed.
    #[test]
    fn a_ready_once_watch_wakes_once_and_never_after_it_is_dropped() {
        use std::io::Write;
        use std::os::unix::net::UnixStream;
        let r = Reactor::get().expect("reactor");
        let (mut a, b) = UnixStream::pair().expect("pair");
        let (tx, rx) = unbounded::<u32>();
        let waker = |n: u32| -> Waker {
            let tx = tx.clone();
            Arc::new(move || {
                let _ = tx.send(n);
            })
        };
        let fd = b.as_raw_fd();
        let w1 = r
            .when_ready(fd, libc::EPOLLIN as u32, waker(1))
            .expect("watch");
        assert!(
            rx.recv_timeout(Duration::from_millis(200)).is_err(),
            "nothing to read yet"
        );
        a.write_all(b"x").unwrap();
        assert_eq!(rx.recv_timeout(LONG), Ok(1));
        assert!(
            rx.recv_timeout(Duration::from_millis(200)).is_err(),
            "once only"
        );
        drop(w1);
        // Still readable: the next watch fires at once.
        let w2 = r
            .when_ready(fd, libc::EPOLLIN as u32, waker(2))
            .expect("watch");
        assert_eq!(rx.recv_timeout(LONG), Ok(2));
        drop(w2);
        // A watch dropped before its socket turns ready calls nobody.
        let (mut c, d) = UnixStream::pair().expect("pair");
        let w3 = r
            .when_ready(d.as_raw_fd(), libc::EPOLLIN as u32, waker(3))
            .expect("watch");
        drop(w3);
        c.write_all(b"y").unwrap();
        assert!(
            rx.recv_timeout(Duration::from_millis(300)).is_err(),
            "dropped"
        );
        // A bad descriptor is an error, not a watch.
        assert!(r.when_ready(-1, libc::EPOLLIN as u32, waker(4)).is_err());
    }

    /// A first look its owner took in place (no wake-up): the timer it
    /// asks for is kept, whether it is the earliest (then the reactor is
    /// woken to sleep less) or not (it wakes for the earlier one first).
    #[test]
    fn a_look_taken_in_place_keeps_its_timer_sooner_or_later() {
        let r = Reactor::get().expect("reactor");
        let (p, reg, seen) = probe_registered(&r, false);
        assert!(
            seen.recv_timeout(Duration::from_millis(100)).is_err(),
            "registered without a look"
        );
        for (earlier, at) in [(None, 50), (Some(30), 120)] {
            let (_q, other, _other_seen) = probe(&r);
            let t0 = Instant::now();
            if let Some(ms) = earlier {
                other.serviced_here(Next {
                    at: Some(t0 + Duration::from_millis(ms)),
                    ..Next::default()
                });
            }
            reg.serviced_here(Next {
                at: Some(t0 + Duration::from_millis(at)),
                ..Next::default()
            });
            assert_eq!(seen.recv_timeout(LONG).unwrap(), (false, false, false, 0));
            let took = t0.elapsed();
            assert!(took >= Duration::from_millis(at), "{took:?}");
            // (Not the backstop look, a second later.)
            assert!(took < Duration::from_millis(at + 800), "{took:?}");
        }
        drop(reg);
        drop(p);
    }

    #[test]
    fn rings_wakes_timers_exits_and_mail_reach_their_connection_only() {
        let r = Reactor::get().expect("reactor");
        let (p, reg, seen) = probe(&r);
        let (_q, other, other_seen) = probe(&r);
        // The first look comes at registration.
        assert_eq!(seen.recv_timeout(LONG).unwrap(), (false, true, false, 0));
        assert!(other_seen.recv_timeout(LONG).unwrap().1);

        // A ring on the bell names one connection.
        assert!(ring(r.bell(), reg.token()));
        assert!(seen.recv_timeout(LONG).unwrap().0);
        // A false token (a stale generation) services nobody.
        assert!(ring(r.bell(), reg.token() ^ (1 << 40)));
        assert!(seen.recv_timeout(Duration::from_millis(200)).is_err());
        assert!(other_seen.try_recv().is_err());

        // Another thread's wake.
        other.wake();
        assert!(other_seen.recv_timeout(LONG).unwrap().1);

        // The timer a service asks for.
        let t0 = Instant::now();
        *p.next.lock() = Next {
            at: Some(t0 + Duration::from_millis(50)),
            ..Next::default()
        };
        reg.wake();
        seen.recv_timeout(LONG).unwrap();
        *p.next.lock() = Next::default();
        assert_eq!(seen.recv_timeout(LONG).unwrap(), (false, false, false, 0));
        assert!(t0.elapsed() >= Duration::from_millis(50));

        // A shared descriptor: a child's pidfd fires when it exits, for
        // every connection watching it.
        let mut child = std::process::Command::new("sleep")
            .arg("0.05")
            .spawn()
            .expect("sleep");
        let pidfd = Arc::new(identity::pidfd_open(child.id()).expect("pidfd"));
        reg.watch_shared(Arc::clone(&pidfd)).unwrap();
        other.watch_shared(Arc::clone(&pidfd)).unwrap();
        assert!(seen.recv_timeout(LONG).unwrap().2);
        assert!(other_seen.recv_timeout(LONG).unwrap().2);
        child.wait().unwrap();
        reg.unwatch_shared(&pidfd);

        // Mail comes with the sender's identity.
        let body = [7u8; MAIL_LEN];
        send_mail(r.bell(), reg.token(), &body, &[]).unwrap();
        assert_eq!(seen.recv_timeout(LONG).unwrap().3, 1);

        // A borrower: the first ask wakes the thread to hand over, a later
        // one gets the set; a ring makes the loan's descriptor readable,
        // and the borrower's turn services the connection in its thread.
        assert!(Loan::borrow().is_none(), "the first ask only asks");
        let mut loan = None;
        let t0 = Instant::now();
        while loan.is_none() && t0.elapsed() < LONG {
            std::thread::sleep(Duration::from_millis(1));
            loan = Loan::borrow();
        }
        let mut loan = loan.expect("the thread handed its set over");
        while seen.try_recv().is_ok() {}
        assert!(ring(r.bell(), reg.token()));
        let mut pfd = libc::pollfd {
            fd: loan.fd(),
            events: libc::POLLIN,
            revents: 0,
        };
        // SAFETY: poll(2) on one pollfd we own.
        assert_eq!(unsafe { libc::poll(&mut pfd, 1, 10_000) }, 1, "the ring");
        loan.turn();
        assert!(seen.try_recv().expect("serviced in this thread").0);
        drop(loan);
        // Given back: the thread watches again within naps.
        assert!(ring(r.bell(), reg.token()));
        assert!(seen.recv_timeout(LONG).unwrap().0);

        // Once the registration is dropped, its token services nothing.
        let token = reg.token();
        drop(reg);
        assert!(ring(r.bell(), token));
        assert!(seen.recv_timeout(Duration::from_millis(200)).is_err());
        drop(p);
    }
}
