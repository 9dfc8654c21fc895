//! epoll over upgraded sockets.
//!
//! The kernel's epoll set keeps every descriptor the shim does not own.
//! Upgraded sockets are kept here instead, with their events and data,
//! and the set holds one eventfd (tagged with [`TAG`]) that a connection's
//! change rings while a thread waits in the set ([`Watchers`]).
//! `epoll_wait` reports upgraded sockets from their engines' readiness:
//! level-triggered ones whenever ready; edge-triggered ones when their
//! readiness gained a bit, or data arrived (room was made) since the last
//! report; one-shot ones once until re-armed with EPOLL_CTL_MOD.
//!
//! As in the kernel, a wait looks only at sockets that may be ready, not at
//! every socket in the set: a connection whose readiness may have changed
//! marks its interests dirty in the sets that watch it ([`Watchers`]), and
//! level-triggered sockets reported ready are looked at again next time.
//! (Scanning all of them made a thousand-connection server spend its time
//! in `epoll_wait`.)
//!
//! `unsafe` here: the program's `epoll_event` arrays.

use azsdp::sync::Lock;
use std::collections::BTreeMap;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Weak};
use std::time::{Duration, Instant};

use libc::{
    EPOLLERR, EPOLLET, EPOLLHUP, EPOLLIN, EPOLLONESHOT, EPOLLOUT, EPOLLRDHUP, c_int, epoll_event,
};

use azsdp::busy_poll::Budget;
use azsdp::fabric::shm::loop_bell::{Asleep, LoopBell};
use std::os::fd::AsRawFd;

use crate::ready::Wakeup;
use crate::real;
use crate::sock::Sock;

/// Most events one wait reports (and the most it allocates room for).
const BATCH: usize = 1024;

/// The default busy-poll budget of a wait (the config's `poll` sets it).
const SPIN_MOST: Duration = Duration::from_micros(20);
/// A wait spins only over sets of at most this many upgraded connections
/// (a look at each costs a load; a big server's set has work queued anyway).
const SPIN_CONNS: usize = 256;
/// Spinning time between looks at the kernel's part of the set (a system
/// call each: counted in rounds, a faster round made more of them).
const SPIN_KERNEL_EVERY: Duration = Duration::from_micros(5);

/// The eventfd's data in the kernel set (a value no program uses as a
/// pointer or small integer by accident is good enough: the entry is ours).
const TAG: u64 = 0xa25d_b0e1_7e57_0000;

/// The high half of the data of a TCP socket we watch in the kernel set
/// for a connection still joining the fabric (the low half is its
/// descriptor): its bytes arriving, or room made, wake a wait.
const TCP_TAG: u64 = 0xa25d_b0e2;

/// The data of the reactor's own set in the kernel set, while a thread
/// waiting here borrows it (see `azsdp::driver::lease`): a peer's ring
/// wakes the waiting thread, which turns the reactor itself.
const REACTOR_TAG: u64 = 0xa25d_b0e3_0000_0000;

/// The data of the set's loop bell in the kernel set (see
/// `azsdp::fabric::shm::loop_bell`): a peer rang one of the connections
/// this loop watched when it went to sleep.
const LOOP_BELL_TAG: u64 = 0xa25d_b0e4_0000_0000;

struct Interest {
    sock: Arc<Sock>,
    events: u32,
    data: u64,
    /// Bits reported last time, and the engine's progress then (data
    /// arrived for readers, room made for writers).
    last_bits: u32,
    last_progress: (u64, u64),
    /// What the kernel's edge-triggered watch of a joining connection's
    /// TCP socket said since the last look: bytes arrived there, or room
    /// made. The engine's progress does not count them, and the bits may
    /// read as before (the program has not drained the socket to EAGAIN
    /// in our sight), so each is an edge of its own, as it is on TCP.
    tcp_woke: u32,
    /// A one-shot interest that fired, until EPOLL_CTL_MOD.
    spent: bool,
    /// The connection's ticket when a wait last looked, and the
    /// connection then (see [`sweep`]: a look at the socket's role per
    /// connection and wait cost more than the look at its ticket).
    ticket: u32,
    swept: Option<Arc<crate::conn::Conn>>,
    /// The set's loop bell the connection was armed to ring (0: none).
    routed: u32,
}

/// A connection that rings the set's loop bell stops when it leaves the
/// set (or the set goes): nobody would hear it there.
impl Drop for Interest {
    fn drop(&mut self) {
        if self.routed != 0
            && let Some(c) = self.swept.as_ref()
        {
            c.loop_left(self.routed);
        }
    }
}

struct Set {
    wake: Arc<Wakeup>,
    interests: BTreeMap<c_int, Interest>,
    dirty: Arc<Dirty>,
    /// Interests to look at again on the next wait: level-triggered ones
    /// reported ready, and those a full `events` array left unvisited.
    again: Vec<c_int>,
    /// Sockets of joining connections watched in the kernel set (see
    /// [`TCP_TAG`]).
    tcp_watch: std::collections::BTreeSet<c_int>,
    /// The reactor's set, watched in the kernel set (edge-triggered, left
    /// there between loans).
    nested: Option<c_int>,
    /// The reactor's set fired (its edge came in this set) since a
    /// borrower of this set last asked the kernel what fired in it; and
    /// when that was (`None`: never, so the first turn asks). An edge is
    /// reported once, so whoever takes it from the kernel records it here
    /// (see [`take_kernel`]).
    reactor_fired: bool,
    reactor_asked: Option<Instant>,
    /// How long a wait busy-polls its connections before it sleeps.
    spin: Budget,
    /// Threads inside [`wait`] on this set.
    waiters: usize,
    /// Taken out of [`SETS`] with its entries out of the kernel set (see
    /// [`enter`]): a `ctl` that finds it so makes a new one.
    retired: bool,
    /// The loop's bell, in the kernel set, made at its first sleep (see
    /// [`unsweep`]); `Err` once making it failed.
    bell: Option<Result<LoopBell, ()>>,
    /// Some connection may ring it (see [`unsweep`]).
    routed_any: bool,
}

/// The descriptors of one set whose readiness may have changed since it
/// last looked. A leaf lock: marked from under a driver's lock.
pub struct Dirty {
    fds: Lock<Vec<c_int>>,
    any: AtomicBool,
    /// The set's wakeup: a mark rings it while a thread sleeps in the set.
    wake: Weak<Wakeup>,
}

impl Dirty {
    fn new(wake: &Arc<Wakeup>) -> Dirty {
        Dirty {
            fds: Lock::new(Vec::new()),
            any: AtomicBool::new(false),
            wake: Arc::downgrade(wake),
        }
    }

    fn mark(&self, fd: c_int) {
        self.fds.lock().push(fd);
        self.any.store(true, Ordering::Release);
        if let Some(w) = self.wake.upgrade() {
            w.ring();
        }
    }

    fn take(&self) -> Vec<c_int> {
        if !self.any.swap(false, Ordering::AcqRel) {
            return Vec::new();
        }
        std::mem::take(&mut *self.fds.lock())
    }
}

/// Who waits for one connection's readiness: the epoll sets that watch it
/// (and under which descriptor), and the threads asleep in `poll` or
/// `select` over it, or in a blocking call on its TCP part. A change wakes
/// these and nobody else: ringing every sleeper of the process woke each
/// of ten thousand threads of a thread-per-connection server for every
/// message that any of them got.
#[derive(Default)]
pub struct Watchers {
    sets: Lock<Vec<(Weak<Dirty>, c_int)>>,
    sleepers: Lock<Vec<Arc<Wakeup>>>,
}

impl Watchers {
    /// The connection's readiness may have changed: every set watching it
    /// looks at it on its next wait, and a thread asleep in one, or on
    /// this connection alone, wakes. (Leaf locks only: the caller may hold
    /// the connection's driver.)
    pub fn touched(&self) {
        let sets = self.sets.lock();
        for (d, fd) in sets.iter() {
            if let Some(d) = d.upgrade() {
                d.mark(*fd);
            }
        }
        drop(sets);
        for w in self.sleepers.lock().iter() {
            w.ring();
        }
    }

    /// `w` is rung on every change from now on, until [`Watchers::unlisten`]
    /// (as often as it listened).
    pub fn listen(&self, w: &Arc<Wakeup>) {
        self.sleepers.lock().push(Arc::clone(w));
    }

    pub fn unlisten(&self, w: &Arc<Wakeup>) {
        let mut v = self.sleepers.lock();
        if let Some(i) = v.iter().position(|x| Arc::ptr_eq(x, w)) {
            v.swap_remove(i);
        }
    }

    fn add(&self, d: &Arc<Dirty>, fd: c_int) {
        let mut sets = self.sets.lock();
        sets.retain(|(w, f)| w.strong_count() > 0 && !(*f == fd && w.as_ptr() == Arc::as_ptr(d)));
        sets.push((Arc::downgrade(d), fd));
    }

    fn remove(&self, d: &Arc<Dirty>, fd: c_int) {
        self.sets
            .lock()
            .retain(|(w, f)| w.strong_count() > 0 && !(*f == fd && w.as_ptr() == Arc::as_ptr(d)));
    }
}

static SETS: Lock<BTreeMap<c_int, Arc<Lock<Set>>>> = Lock::new(BTreeMap::new());
/// Sets in [`SETS`] (read without the lock on every `close` and `epoll_wait`).
static COUNT: std::sync::atomic::AtomicUsize = std::sync::atomic::AtomicUsize::new(0);
/// Was any set ever made here? Then a wait in the kernel may report our
/// entries (see [`drop_ours`]), even after its set was retired.
static EVER: AtomicBool = AtomicBool::new(false);

/// Does the shim hold part of any epoll set?
pub fn has_sets() -> bool {
    COUNT.load(Ordering::SeqCst) > 0
}

/// May a wait in the kernel report entries of ours?
pub fn ever_had_sets() -> bool {
    EVER.load(Ordering::SeqCst)
}

/// The set of `epfd` for a wait in it, counted as waited in; `None` if
/// the shim holds no part of it, or held one that has no upgraded socket
/// left and no other waiter: that one is retired here, its entries taken
/// out of the kernel set, so that the program's waits there go straight to
/// the kernel again. (A client that paired one connection and then made
/// thousands of plain ones paid for every wait in our set.)
fn enter(epfd: c_int) -> Option<Arc<Lock<Set>>> {
    let mut sets = SETS.lock();
    let set = Arc::clone(sets.get(&epfd)?);
    let mut s = set.lock();
    if !(s.interests.is_empty() && s.tcp_watch.is_empty() && s.waiters == 0) {
        s.waiters += 1;
        drop(s);
        return Some(set);
    }
    // Under both locks: a `ctl` that took this set before sees it retired
    // and makes a new one, whose entries these deletions cannot touch.
    s.retired = true;
    let _keep = real::KeepErrno::new();
    let nested = s.nested.take();
    let bell = s.bell.take().and_then(Result::ok);
    let bell_fd = bell.as_ref().map(|b| b.fd().as_raw_fd());
    for fd in std::iter::once(s.wake.fd()).chain(nested).chain(bell_fd) {
        // SAFETY: deleting our own entry from the program's set.
        unsafe { real::epoll_ctl(epfd, libc::EPOLL_CTL_DEL, fd, std::ptr::null_mut()) };
    }
    drop(s);
    sets.remove(&epfd);
    COUNT.store(sets.len(), Ordering::Relaxed);
    drop(sets);
    // Dropped unlocked: its eventfd's close comes back through `close`.
    drop(set);
    drop(bell);
    None
}

/// Threads inside `epoll_wait` (in our sets or the kernel's).
static KERNEL_WAITS: std::sync::atomic::AtomicUsize = std::sync::atomic::AtomicUsize::new(0);

/// A thread's stay in the program's `epoll_wait`. A thread that found no
/// set of ours for its descriptor sleeps in the kernel; a set made for that
/// descriptor meanwhile (an upgraded socket added, from another thread)
/// kicks its eventfd if any thread is counted here, so that the sleeper
/// comes to wait in it. (Counted before the look for a set: either the
/// look sees the new set or the maker sees the count.)
pub struct KernelWait {
    _counted: azsdp::sync::Counting,
}

impl KernelWait {
    pub fn begin() -> KernelWait {
        KernelWait {
            _counted: azsdp::sync::Counting::new(&KERNEL_WAITS),
        }
    }
}

/// A thread's stay in [`wait`] (see [`enter`]).
struct Waiting<'a>(&'a Lock<Set>);

impl Drop for Waiting<'_> {
    fn drop(&mut self) {
        self.0.lock().waiters -= 1;
    }
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
    let dirty = Arc::new(Dirty::new(&wake));
    let s = Arc::new(Lock::new(Set {
        wake,
        interests: BTreeMap::new(),
        dirty,
        again: Vec::new(),
        tcp_watch: Default::default(),
        nested: None,
        reactor_fired: false,
        reactor_asked: None,
        spin: Budget::new(crate::runtime::config().map_or(SPIN_MOST, |c| c.global.poll)),
        waiters: 0,
        retired: false,
        bell: None,
        routed_any: false,
    }));
    sets.insert(epfd, Arc::clone(&s));
    COUNT.store(sets.len(), Ordering::SeqCst);
    EVER.store(true, Ordering::SeqCst);
    if KERNEL_WAITS.load(Ordering::SeqCst) > 0 {
        // Perhaps asleep in the kernel on `epfd` (see [`KernelWait`]).
        s.lock().wake.kick();
    }
    Some(s)
}

/// The program closed every descriptor in `range` at once.
pub fn forget_sets_in(range: std::ops::RangeInclusive<c_int>) {
    if !has_sets() {
        return;
    }
    let gone: Vec<c_int> = SETS
        .lock()
        .keys()
        .copied()
        .filter(|fd| range.contains(fd))
        .collect();
    for epfd in gone {
        forget_set(epfd);
    }
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

/// `fd` (upgraded) was closed: drop it from every set (the kernel drops
/// its own watch of the socket with the descriptor).
pub fn forget_fd(fd: c_int) {
    let sets: Vec<_> = SETS.lock().values().cloned().collect();
    for s in sets {
        let mut s = s.lock();
        s.interests.remove(&fd);
        s.tcp_watch.remove(&fd);
    }
}

/// Watch (or stop watching) the TCP socket `fd` of a joining connection
/// in the kernel set `epfd`.
fn watch_tcp(set: &mut Set, epfd: c_int, fd: c_int, on: bool) {
    if on == set.tcp_watch.contains(&fd) {
        return;
    }
    let mut ev = epoll_event {
        events: (EPOLLIN | EPOLLOUT | EPOLLRDHUP | EPOLLET) as u32,
        u64: (TCP_TAG << 32) | fd as u32 as u64,
    };
    let op = if on {
        libc::EPOLL_CTL_ADD
    } else {
        libc::EPOLL_CTL_DEL
    };
    let _keep = real::KeepErrno::new();
    // SAFETY: our own watch of the program's socket in the program's set.
    let r = unsafe { real::epoll_ctl(epfd, op, fd, &mut ev) };
    if on && r == 0 {
        set.tcp_watch.insert(fd);
    } else if !on {
        set.tcp_watch.remove(&fd);
    }
}

/// `epoll_ctl` on an upgraded socket. Returns what epoll_ctl returns.
pub fn ctl(epfd: c_int, op: c_int, fd: c_int, sock: Arc<Sock>, ev: Option<epoll_event>) -> c_int {
    loop {
        let Some(set) = set_for(epfd) else {
            real::set_errno(libc::ENOMEM);
            return -1;
        };
        let mut set = set.lock();
        // Retired since `set_for` found it (see [`enter`]): a new one.
        if !set.retired {
            return ctl_in(&mut set, epfd, op, fd, sock, ev);
        }
    }
}

fn ctl_in(
    set: &mut Set,
    epfd: c_int,
    op: c_int,
    fd: c_int,
    sock: Arc<Sock>,
    ev: Option<epoll_event>,
) -> c_int {
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
            if let Some(c) = sock.conn() {
                c.watchers.add(&set.dirty, fd);
            }
            let fresh = Interest {
                sock,
                events: ev.events,
                data: ev.u64,
                last_bits: 0,
                last_progress: (u64::MAX, u64::MAX),
                tcp_woke: 0,
                spent: false,
                ticket: 0,
                swept: None,
                routed: 0,
            };
            match set.interests.get_mut(&fd) {
                // Modified in place: the connection stays routed to this
                // loop's bell.
                Some(it) if Arc::ptr_eq(&it.sock, &fresh.sock) => {
                    let mut fresh = fresh;
                    std::mem::swap(&mut it.swept, &mut fresh.swept);
                    std::mem::swap(&mut it.routed, &mut fresh.routed);
                    std::mem::swap(it, &mut fresh);
                }
                _ => {
                    set.interests.insert(fd, fresh);
                }
            }
            set.dirty.mark(fd);
        }
        libc::EPOLL_CTL_DEL => {
            let Some(it) = set.interests.remove(&fd) else {
                real::set_errno(libc::ENOENT);
                return -1;
            };
            watch_tcp(set, epfd, fd, false);
            if let Some(c) = it.sock.conn() {
                c.watchers.remove(&set.dirty, fd);
            }
        }
        _ => {
            real::set_errno(libc::EINVAL);
            return -1;
        }
    }
    // (A thread asleep in the set woke at the mark above.)
    0
}

/// An upgraded socket is plain TCP again: move it from our sets back into
/// the kernel's, with its events and data.
pub fn release(sock: &Arc<Sock>) {
    let sets: Vec<(c_int, Arc<Lock<Set>>)> = SETS
        .lock()
        .iter()
        .map(|(e, s)| (*e, Arc::clone(s)))
        .collect();
    for (epfd, set) in sets {
        let moved: Vec<(c_int, Interest)> = {
            let mut set = set.lock();
            let fds: Vec<c_int> = set
                .interests
                .iter()
                .filter(|(_, it)| Arc::ptr_eq(&it.sock, sock))
                .map(|(fd, _)| *fd)
                .collect();
            for fd in &fds {
                watch_tcp(&mut set, epfd, *fd, false);
            }
            fds.into_iter()
                .filter_map(|fd| set.interests.remove(&fd).map(|it| (fd, it)))
                .collect()
        };
        for (fd, it) in moved {
            let mut ev = epoll_event {
                events: it.events,
                u64: it.data,
            };
            // SAFETY: adding the program's descriptor to the program's set,
            // with an event of ours.
            unsafe { real::epoll_ctl(epfd, libc::EPOLL_CTL_ADD, fd, &mut ev) };
        }
    }
    crate::ready::notify();
}

/// A socket in kernel epoll sets was upgraded: move it to ours. A thread
/// asleep in such a set in the kernel is woken, to wait in ours.
pub fn adopt(sock: &Arc<Sock>) {
    let regs = std::mem::take(&mut *sock.kernel_epolls.lock());
    for r in regs {
        if let Some(set) = set_for(r.epfd) {
            set.lock().wake.kick();
        }
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

fn epoll_bits(r: &azsdp::conn::Readiness, wanted: u32) -> u32 {
    let mut b = 0u32;
    if r.readable {
        b |= EPOLLIN as u32;
    }
    if r.writable {
        b |= EPOLLOUT as u32;
    }
    if r.read_hangup {
        b |= EPOLLRDHUP as u32;
    }
    if r.hangup {
        b |= EPOLLHUP as u32;
    }
    if r.error {
        b |= EPOLLERR as u32;
    }
    b & (wanted | (EPOLLHUP | EPOLLERR) as u32)
}

/// The events one wait reports, at most one per descriptor, as the
/// kernel's: an upgraded socket looked at twice in one wait (its joining
/// TCP socket woke after the first look) merges into its first event.
#[derive(Default)]
struct Batch {
    events: Vec<epoll_event>,
    /// The upgraded descriptors reported, to their events' indices (a map:
    /// a wait reports up to [`BATCH`] of them).
    upgraded: std::collections::HashMap<c_int, usize>,
}

impl Batch {
    fn len(&self) -> usize {
        self.events.len()
    }

    fn is_empty(&self) -> bool {
        self.events.is_empty()
    }

    fn reported(&self, fd: c_int) -> bool {
        self.upgraded.contains_key(&fd)
    }

    fn push_upgraded(&mut self, fd: c_int, ev: epoll_event) {
        match self.upgraded.entry(fd) {
            std::collections::hash_map::Entry::Occupied(i) => {
                self.events[*i.get()].events |= ev.events;
            }
            std::collections::hash_map::Entry::Vacant(v) => {
                v.insert(self.events.len());
                self.events.push(ev);
            }
        }
    }
}

/// Collect ready upgraded sockets into `out`: those marked dirty, and
/// those to look at again.
fn collect(set: &mut Set, epfd: c_int, out: &mut Batch, max: usize) {
    let mut look = set.dirty.take();
    look.append(&mut set.again);
    look.sort_unstable();
    look.dedup();
    for (i, fd) in look.iter().enumerate() {
        if out.len() >= max && !out.reported(*fd) {
            // No room this time: next time.
            set.again.extend_from_slice(&look[i..]);
            break;
        }
        let Some(it) = set.interests.get_mut(fd) else {
            continue;
        };
        if it.spent {
            continue;
        }
        let Some(c) = it.sock.conn() else {
            it.swept = None;
            continue;
        };
        if !it.swept.as_ref().is_some_and(|s| Arc::ptr_eq(s, &c)) {
            it.swept = Some(Arc::clone(&c));
        }
        let joining = c.joining_now().is_some();
        let r = c.readiness_on(*fd);
        watch_tcp(set, epfd, *fd, joining);
        let Some(it) = set.interests.get_mut(fd) else {
            continue;
        };
        let bits = epoll_bits(&r, it.events);
        // As the kernel's wake-ups: readers hear of arriving data, writers
        // of room made; nobody of other traffic (credits, acknowledgements).
        let progress = (
            if it.events & EPOLLIN as u32 != 0 {
                r.arrived
            } else {
                0
            },
            if it.events & EPOLLOUT as u32 != 0 {
                r.drained
            } else {
                0
            },
        );
        let edge = it.events & EPOLLET as u32 != 0;
        let tcp_woke = std::mem::take(&mut it.tcp_woke);
        let report = if edge {
            bits != 0
                && (bits & !it.last_bits != 0
                    || progress != it.last_progress
                    || bits & tcp_woke != 0)
        } else {
            bits != 0
        };
        it.last_bits = bits;
        if report {
            it.last_progress = progress;
            if it.events & EPOLLONESHOT as u32 != 0 {
                it.spent = true;
            } else if !edge {
                // Still ready next time? Level-triggered: look again.
                set.again.push(*fd);
            }
            out.push_upgraded(
                *fd,
                epoll_event {
                    events: bits,
                    u64: it.data,
                },
            );
        }
    }
}

/// A wait's look at every connection of a small set (a load of each
/// one's ticket): those a message reached since the last look are marked
/// to be looked at, and kept watched by this loop rather than by the
/// reactor's doorbell until the loop sleeps ([`unsweep`]). Idle ones stay
/// armed: parked, each would be serviced again at every sleep of the loop.
/// An event loop that never sleeps (it finds work at every wait) so hears
/// of each message at its next wait, without a ring of the peer's (a
/// system call there, and a turn of the reactor here that wakes this
/// thread) per message. Bigger sets are left to the doorbells (see
/// [`SPIN_CONNS`]).
fn sweep(set: &mut Set) {
    if set.interests.len() > SPIN_CONNS {
        return;
    }
    let now = azsdp::driver::standby::now_ns();
    for (fd, it) in set.interests.iter_mut() {
        if it.spent {
            continue;
        }
        // The connection as the last look found it ([`collect`] renews
        // it, and the first look takes it).
        if it.swept.is_none() {
            it.swept = it.sock.conn();
        }
        let Some(c) = it.swept.as_ref() else { continue };
        let t = c.ticket();
        if t != it.ticket {
            it.ticket = t;
            set.dirty.mark(*fd);
            c.watched_by_loop(now);
        }
    }
}

/// The wait is about to sleep: its connections are armed to ring the
/// loop's own bell, so that a message for one wakes this loop and no other
/// thread (see `azsdp::fabric::shm::loop_bell`); those it could not arm go
/// back to the reactor's watch (the sleep's `standby::end` arms their
/// doorbells). Connections where a message may have come already are
/// marked to be looked at (the wait then does not sleep). The thread
/// counts as asleep on the loop's bell from before those looks until the
/// returned guard drops (once it woke): peers ring a loop only while it
/// sleeps (see `azsdp::fabric::shm::loop_bell`).
fn unsweep(set: &mut Set, epfd: c_int) -> (Rung, Option<Asleep>) {
    // Counted before the looks that follow, whoever made the bell (a
    // forked child sleeps on its parent's in the set they share).
    let asleep = |set: &Set| {
        set.bell
            .as_ref()
            .and_then(|b| b.as_ref().ok())
            .and_then(LoopBell::asleep)
    };
    if set.interests.len() > SPIN_CONNS {
        let asleep = asleep(set);
        // Grown past the sweep's bound: what rings the loop's bell would
        // go unseen.
        if std::mem::take(&mut set.routed_any) {
            for it in set.interests.values_mut() {
                if let Some(c) = it.swept.as_ref()
                    && it.routed != 0
                {
                    c.loop_left(std::mem::take(&mut it.routed));
                }
            }
        }
        return (Rung::ByReactor, asleep);
    }
    let bell = loop_bell(set, epfd);
    let asleep = asleep(set);
    let mut rung = if bell == 0 {
        Rung::ByReactor
    } else {
        Rung::ByLoopBell
    };
    for (fd, it) in set.interests.iter_mut() {
        let Some(c) = it.swept.as_ref() else { continue };
        // (A spent one-shot interest is not this loop's to hear.)
        let bell = if it.spent { 0 } else { bell };
        if it.routed != 0 && it.routed != bell {
            c.loop_left(it.routed);
        }
        it.routed = bell;
        set.routed_any |= bell != 0;
        match c.loop_sleeps(bell) {
            azsdp::driver::threaded::LoopArmed::Ready => set.dirty.mark(*fd),
            azsdp::driver::threaded::LoopArmed::Routed => {}
            azsdp::driver::threaded::LoopArmed::ByReactor if !it.spent => rung = Rung::ByReactor,
            azsdp::driver::threaded::LoopArmed::ByReactor => {}
        }
    }
    (rung, asleep)
}

/// Who rings a sleeping set's connections (see [`unsweep`]).
#[derive(Clone, Copy, PartialEq, Eq)]
enum Rung {
    /// Its loop bell, each of them: the process's bell, and so the
    /// reactor's set, need no watching for this sleep.
    ByLoopBell,
    /// Some only through the process's bell.
    ByReactor,
}

/// The set's loop bell's id, made and watched in the kernel set at the
/// first sleep (0: none, the process's bell serves; so in a forked child,
/// whose set, shared with its parent, rings the parent's loop).
fn loop_bell(set: &mut Set, epfd: c_int) -> u32 {
    if set
        .bell
        .as_ref()
        .is_some_and(|b| b.as_ref().is_ok_and(|b| !b.made_here()))
    {
        return 0;
    }
    let made = set.bell.get_or_insert_with(|| {
        let bell = LoopBell::new().map_err(|_| ())?;
        let mut ev = epoll_event {
            events: (EPOLLIN | EPOLLET) as u32,
            u64: LOOP_BELL_TAG,
        };
        let _keep = real::KeepErrno::new();
        // SAFETY: adding our own socket to the program's epoll set.
        let r =
            unsafe { real::epoll_ctl(epfd, libc::EPOLL_CTL_ADD, bell.fd().as_raw_fd(), &mut ev) };
        if r != 0 {
            return Err(());
        }
        Ok(bell)
    });
    made.as_ref().map_or(0, |b| {
        b.sleeps();
        b.id()
    })
}

/// Drop our own entries (see [`TAG`], [`TCP_TAG`]) from the `n` events a
/// wait in the kernel wrote into the program's array: a set that became
/// partly ours while a thread slept in it. The count left.
///
/// # Safety
/// `events` must be the program's array, with `n` entries filled.
pub unsafe fn drop_ours(events: *mut epoll_event, n: c_int) -> c_int {
    let Ok(got) = crate::user_mem::read(events.cast_const(), n as usize) else {
        return n;
    };
    let kept: Vec<epoll_event> = got
        .into_iter()
        .filter(|e| {
            e.u64 != TAG && e.u64 != REACTOR_TAG && e.u64 != LOOP_BELL_TAG && e.u64 >> 32 != TCP_TAG
        })
        .collect();
    if kept.len() as c_int != n && crate::user_mem::write(events, &kept).is_err() {
        return n;
    }
    kept.len() as c_int
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
    let set = enter(epfd)?;
    let _waiting = Waiting(&set);
    // The kernel's bounds (EP_MAX_EVENTS).
    let most = (i32::MAX as usize) / std::mem::size_of::<epoll_event>();
    if max <= 0 || max as usize > most {
        real::set_errno(libc::EINVAL);
        return Some(-1);
    }
    // Never allocate on the program's word: report at most a batch per
    // call (fewer events than `max` is always a valid answer).
    let max = (max as usize).min(BATCH);
    let deadline = timeout.map(|t| Instant::now() + t);
    let wake = Arc::clone(&set.lock().wake);
    let mut kernel: Vec<epoll_event> = vec![epoll_event { events: 0, u64: 0 }; max];
    let done = |out: &Batch| -> c_int {
        // Through the kernel: a bad array is EFAULT, not a crash.
        if let Err(e) = crate::user_mem::write(events, &out.events) {
            real::set_errno(e);
            return -1;
        }
        out.len() as c_int
    };
    // What is ready now, or comes within a short spin, needs no wake-up of
    // this thread or of the reactor (and no `standby::end`, which sends
    // the reactor back to watching the connections the program drives).
    let mut out = Batch::default();
    sweep(&mut set.lock());
    collect(&mut set.lock(), epfd, &mut out, max);
    let left = deadline.map(|d| d.saturating_duration_since(Instant::now()));
    if !out.is_empty() || left.is_some_and(|l| l.is_zero()) {
        // The kernel's part too, and no more: arming and looking again
        // would only wake the reactor. (With nothing of ours ready, a wait
        // that may wait asks the kernel only in its spin or its sleep: an
        // event loop made a system call per wait for nothing here.)
        // (No signal window on this path: a wait that returns at once
        // has no later kernel wait a handler run meanwhile could miss, as
        // a call to the kernel's that finds events ready has none. Two
        // `sigprocmask` per wait were most of a busy loop's system calls.)
        let n = look_kernel(&set, epfd, &mut kernel, &mut out, max, mask);
        if n < 0 && out.is_empty() {
            return Some(-1);
        }
        return Some(done(&out));
    }
    // From here the wait may spin and sleep, in several kernel waits:
    // signals wait for the last (see `SignalWindow`).
    let window = crate::ready::SignalWindow::open();
    let mask = window.wait_mask(mask);
    let budget = set.lock().spin.spin();
    let budget = left.map_or(budget, |l| l.min(budget));
    if !budget.is_zero() {
        let n = spin(&set, epfd, &mut kernel, &mut out, max, mask, budget);
        let mut s = set.lock();
        if out.is_empty() {
            s.spin.missed();
        } else {
            s.spin.found();
        }
        drop(s);
        if n < 0 && out.is_empty() {
            return Some(-1);
        }
        if !out.is_empty() {
            return Some(done(&out));
        }
    }
    let slept_at = Instant::now();
    // The reactor's set, borrowed while this thread sleeps: the peer's ring
    // wakes this thread, not the reactor's (which would wake it in turn).
    let mut loan = Borrowed(None);
    loop {
        // (Again after each wake-up that found nothing to report: a ring
        // of the loop's bell took the connection's arming with it.)
        // Every connection of the set rings its own bell: this sleep does
        // not rely on anyone's watch of the process's bell (so a loan
        // given back need not wake the reactor's thread for it).
        let (rung, asleep) = unsweep(&mut set.lock(), epfd);
        let self_rung = rung == Rung::ByLoopBell;
        if loan.0.is_none() {
            loan.0 = borrow_reactor(&set, epfd);
        }
        if let Some(l) = loan.0.as_mut() {
            // Before the look: connections the calls drove go back to
            // being watched, and what rang meanwhile is taken (before the
            // arming: what the turn marks, the look below sees unrung).
            azsdp::driver::standby::end_by_borrower();
            turn_borrowed(&set, l, false);
            if self_rung {
                wake.arm_self_rung();
            } else {
                wake.arm_alone();
            }
        } else if self_rung {
            wake.arm_self_rung();
        } else {
            wake.arm();
            // Asked again once armed: a borrower that gives the set back
            // now either sees this thread asleep (and its thread watches
            // again at once) or leaves the set to this one.
            loan.0 = borrow_reactor(&set, epfd);
            if let Some(l) = loan.0.as_mut() {
                turn_borrowed(&set, l, true);
            }
        }
        let mut out = Batch::default();
        collect(&mut set.lock(), epfd, &mut out, max);
        let mut left = deadline.map(|d| d.saturating_duration_since(Instant::now()));
        if let Some(t) = loan.0.as_ref().and_then(|l| l.timeout()) {
            left = Some(left.map_or(t, |l| l.min(t)));
        }
        let wait_ms: c_int = if !out.is_empty() {
            0
        } else {
            // (Rounded up: a timer's wait that ends early would spin.)
            left.map_or(100, |l| crate::ready::ms_rounded_up(l).min(100))
        };
        let room = max - out.len();
        let n = if room == 0 {
            0
        } else {
            // SAFETY: our own array of `max` entries (room <= max).
            unsafe { real::epoll_pwait(epfd, kernel.as_mut_ptr(), room as c_int, wait_ms, mask) }
        };
        drop(asleep);
        wake.disarm();
        let left = deadline.map(|d| d.saturating_duration_since(Instant::now()));
        if n < 0 {
            if out.is_empty() {
                return Some(-1);
            }
        } else {
            let upgraded = out.len();
            let (looked, rang) = take_kernel(&set, &kernel[..n as usize], &mut out);
            let mut again = looked;
            if rang && let Some(l) = loan.0.as_mut() {
                turn_borrowed(&set, l, true);
                again = true;
            }
            if again {
                // A joining connection's socket woke, or the reactor
                // turned: look now.
                collect(&mut set.lock(), epfd, &mut out, max);
            }
            if out.is_empty() && (looked || rang) && !left.is_some_and(|l| l.is_zero()) {
                continue;
            }
            if upgraded > 0 || again {
                set.lock().spin.woke(slept_at.elapsed());
            }
        }
        if !out.is_empty() || left.is_some_and(|l| l.is_zero()) {
            return Some(done(&out));
        }
    }
}

/// Turn the borrowed reactor. It asks the kernel what fired in its set
/// when `fired` (this wait just took the reactor's edge), when its edge
/// came in this set since the last ask, and at least every
/// [`REACTOR_ASK_EVERY`] whatever this set saw (an edge some path of ours
/// dropped costs that much, not a hang); otherwise it services only what
/// is queued and due. The ask is recorded before the turn, so that an edge
/// during the turn is news.
fn turn_borrowed(set: &Lock<Set>, l: &mut azsdp::driver::reactor::Loan, fired: bool) {
    let ask = {
        let mut s = set.lock();
        let now = Instant::now();
        let ask = std::mem::take(&mut s.reactor_fired)
            || fired
            || s.reactor_asked
                .is_none_or(|t| now.saturating_duration_since(t) >= REACTOR_ASK_EVERY);
        if ask {
            s.reactor_asked = Some(now);
        }
        ask
    };
    if ask {
        l.turn();
    } else {
        l.turn_queued();
    }
}

/// See [`turn_borrowed`].
const REACTOR_ASK_EVERY: Duration = Duration::from_millis(1);

/// A wait's loan of the reactor's set, given back when the wait returns:
/// if other threads sleep then, the reactor's thread watches again at
/// once (their peers' rings must not wait for its nap).
struct Borrowed(Option<azsdp::driver::reactor::Loan>);

impl Drop for Borrowed {
    fn drop(&mut self) {
        if let Some(l) = self.0.take() {
            l.give_back(crate::ready::any_reliant());
        }
    }
}

/// Borrow this process's reactor's set for a sleep in `epfd`, and watch it
/// there (once: it stays, edge-triggered, between loans).
fn borrow_reactor(set: &Lock<Set>, epfd: c_int) -> Option<azsdp::driver::reactor::Loan> {
    let loan = azsdp::driver::reactor::Loan::borrow()?;
    let fd = loan.fd();
    let mut s = set.lock();
    if s.nested != Some(fd) {
        let mut ev = epoll_event {
            events: (EPOLLIN | EPOLLET) as u32,
            u64: REACTOR_TAG,
        };
        let _keep = real::KeepErrno::new();
        // SAFETY: our own watch of the reactor's set in the program's set.
        let r = unsafe { real::epoll_ctl(epfd, libc::EPOLL_CTL_ADD, fd, &mut ev) };
        if r < 0 && real::errno() != libc::EEXIST {
            // (Dropped: the set goes back to the reactor's thread.)
            return None;
        }
        s.nested = Some(fd);
    }
    Some(loan)
}

/// What is ready in the kernel's part of the set, into the room left in
/// `out` (after [`collect`] took our sockets: together, one look without
/// sleeping). Returns the kernel's answer (-1 with errno set on its error).
fn look_kernel(
    set: &Lock<Set>,
    epfd: c_int,
    kernel: &mut [epoll_event],
    out: &mut Batch,
    max: usize,
    mask: *const libc::sigset_t,
) -> c_int {
    let room = max - out.len();
    if room == 0 {
        return 0;
    }
    // SAFETY: our own array of at least `max` entries (room <= max).
    let n = unsafe { real::epoll_pwait(epfd, kernel.as_mut_ptr(), room as c_int, 0, mask) };
    if n > 0 && take_kernel(set, &kernel[..n as usize], out).0 {
        // A joining connection's socket woke: look at it now.
        collect(&mut set.lock(), epfd, out, max);
    }
    n
}

/// Sort the kernel's events into `out`: the program's own descriptors go
/// through, our eventfd is dropped, and a joining connection's socket
/// marks it to be looked at (`.0`: any did). A socket this wait reports
/// already is not marked: that report is the edge. `.1`: the reactor's
/// set fired.
fn take_kernel(set: &Lock<Set>, got: &[epoll_event], out: &mut Batch) -> (bool, bool) {
    let (mut looked, mut rang) = (false, false);
    for ev in got {
        if ev.u64 == REACTOR_TAG {
            set.lock().reactor_fired = true;
            rang = true;
        } else if ev.u64 == LOOP_BELL_TAG {
            // What rang is seen by a look at each connection's ticket.
            let mut s = set.lock();
            if let Some(Ok(b)) = s.bell.as_ref() {
                b.rang();
            }
            sweep(&mut s);
            looked = true;
        } else if ev.u64 >> 32 == TCP_TAG {
            let fd = ev.u64 as u32 as c_int;
            if out.reported(fd) {
                continue;
            }
            let mut s = set.lock();
            if let Some(it) = s.interests.get_mut(&fd) {
                it.tcp_woke |= ev.events;
            }
            s.dirty.mark(fd);
            looked = true;
        } else if ev.u64 != TAG {
            out.events.push(*ev);
        }
    }
    (looked, rang)
}

/// Busy-poll the set's connections for up to `budget` before the wait
/// sleeps: a message that arrives meanwhile is seen by a load of its
/// ring's counter ([`crate::conn::Conn::ticket`]), so the peer posts it
/// without ringing anyone, and the reactor stays parked. The kernel's part
/// of the set is looked at now and then. Returns as [`look_kernel`].
fn spin(
    set: &Lock<Set>,
    epfd: c_int,
    kernel: &mut [epoll_event],
    out: &mut Batch,
    max: usize,
    mask: *const libc::sigset_t,
    budget: Duration,
) -> c_int {
    let conns: Vec<(c_int, Arc<crate::conn::Conn>)> = {
        let s = set.lock();
        if s.interests.len() > SPIN_CONNS {
            return 0;
        }
        s.interests
            .iter()
            .filter(|(_, it)| !it.spent)
            .filter_map(|(fd, it)| Some((*fd, it.sock.conn()?)))
            .collect()
    };
    if conns.is_empty() {
        return 0;
    }
    let mut tickets: Vec<u32> = conns.iter().map(|(_, c)| c.ticket()).collect();
    let start = Instant::now();
    let mut kernel_at = start + SPIN_KERNEL_EVERY;
    let mut round = 0u32;
    loop {
        let mut moved = false;
        for ((fd, c), t) in conns.iter().zip(tickets.iter_mut()) {
            let now = c.ticket();
            if now != *t {
                *t = now;
                let mut s = set.lock();
                if let Some(it) = s.interests.get_mut(fd) {
                    it.ticket = now;
                }
                s.dirty.mark(*fd);
                c.watched_by_loop(azsdp::driver::standby::now_ns());
                moved = true;
            }
        }
        round += 1;
        // (The clock costs more than a round over a few rings.)
        let now = round.is_multiple_of(SPIN_CLOCK_EVERY).then(Instant::now);
        let kernel_due = now.is_some_and(|t| t >= kernel_at);
        if moved || kernel_due {
            collect(&mut set.lock(), epfd, out, max);
            let n = look_kernel(set, epfd, kernel, out, max, mask);
            if n < 0 || !out.is_empty() {
                return n;
            }
            if let Some(t) = now {
                kernel_at = t + SPIN_KERNEL_EVERY;
            }
        }
        if now.is_some_and(|t| t.saturating_duration_since(start) >= budget) {
            return 0;
        }
        std::hint::spin_loop();
    }
}

/// Rounds of [`spin`] per look at the clock.
const SPIN_CLOCK_EVERY: u32 = 8;
