//! A [`Driver`] shared by the application's threads and the process's
//! reactor.
//!
//! A thread that faults on a protected page is stopped in the kernel until
//! someone resolves the fault, so it cannot run the engine itself: the
//! fault goes to the connection's fault source, whose waker asks the
//! reactor ([`super::reactor`]) and any thread blocked in a call to take
//! it. All engine work happens under one mutex, which no thread holds
//! while it may fault (the engine never touches pages it has protected) or
//! while it sleeps.
//!
//! Waiting: a thread blocked in a call turns the engine itself (one wake-up
//! from the peer's message to the thread that needs it, which is what
//! latency wants), and the reactor stays off the connection meanwhile (see
//! [`standby`]): the engine touches application memory only for calls in
//! progress, so the reactor never does. When a thread turns the engine and
//! delivers events that may concern other blocked threads, it kicks the
//! waiter so they look. The reactor keeps things moving when no call is
//! blocked: the GET_COMPLETEs that unprotect an AZ-SDP sender's pages,
//! credits, faults, timers, the close that `close()` left behind.

use crate::sync::{Lock, LockGuard};
use std::ops::Range;
use std::sync::atomic::{AtomicBool, AtomicU32, AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Weak};
use std::time::{Duration, Instant};

use super::delegation::{self, Answer, GuestWait, Mailbox, Request};
use super::holders::Holders;
use super::ownership::{self, Close, Ending, FORK_GRACE, ForReactor, Use};
use super::reactor::{self, Next, Reactor, Registration, Serviced, Wake};
use super::{Driver, Protector, standby};
use crate::conn::{
    Access, CallError, CallId, Counters, Readiness, RecvFlags, RxRoute, SendFlags, Shutdown, State,
    TxMode,
};
use crate::fabric::{Armed, FabricWaiter, Watched as Fabric};
use crate::process::{self, HeldBounds, Inside, Participant};
use crate::protect::FaultSource;
use crate::time::Timestamp;

/// First sleep of a caller's thread between looks, a safety net under the
/// wake-ups (the peer's ring, the reactor's kick when the peer's process
/// dies); it doubles while nothing comes, up to [`LONGEST_CALL_NAP`], so that
/// ten thousand threads blocked on idle connections leave the CPUs alone
/// (at a fixed 20 ms they made the load average pass 1,000). Not shorter:
/// from 20 ms, a thread blocked 1.2 s for its request woke six times where
/// TCP's wakes once, a context switch each (docs/shim.md). The shim's
/// wait of a receive on a connection still joining sleeps the same.
pub const FIRST_CALL_NAP: Duration = Duration::from_millis(200);
pub const LONGEST_CALL_NAP: Duration = Duration::from_secs(1);
/// How often the reactor looks at a connection frozen by a fork, for the
/// claim of the process that takes it.
const FROZEN_LOOK: Duration = Duration::from_millis(20);

struct Shared<F: Fabric, P: Protector> {
    /// The connection's place in the reactor; dropped (its descriptors no
    /// longer watched) before the driver, which owns them.
    registration: Lock<Option<Registration>>,
    driver: Lock<Driver<F, P>>,
    waiter: Arc<dyn FabricWaiter>,
    /// Where the connection's faults come from (the protector's).
    faults: Lock<Option<Box<dyn FaultSource>>>,
    stop: AtomicBool,
    /// The reactor is done with the connection (closed, or taken by
    /// another process).
    released: AtomicBool,
    /// Application threads in a call (they drive the connection).
    in_calls: AtomicUsize,
    /// When the last call ended ([`standby::now_ns`]; 0: none yet).
    last_exit: AtomicU64,
    /// When an event loop last looked at the connection, until it sleeps
    /// (0: not watched so; see [`standby::looped`]).
    loop_at: AtomicU64,
    /// The loop bell of the last loop that slept watching the connection
    /// (0: none): while no loop looks (`loop_at` is 0), the peer rings it
    /// there (see `fabric::shm::loop_bell`).
    loop_bell: AtomicU32,
    /// The loop bell and ticket when a sleeping loop last armed the
    /// connection itself (see [`ThreadedDriver::loop_sleeps`]; 0: not).
    loop_armed: AtomicU64,
    /// Services the peer's rings (or the connection's descriptors) asked
    /// of the reactor: wake-ups its messages cost this process.
    rung: AtomicU64,
    /// Someone held the driver's lock since the stats last looked (so
    /// ten thousand idle connections cost the stats thread no locks).
    touched: AtomicBool,
    /// The reactor left the connection to callers: its next look backs off.
    standby_nap: Lock<Duration>,
    /// The reactor parked the connection longer than a quick call's
    /// standby, for a caller blocked in it: that call's end wakes it.
    parked_long: AtomicBool,
    /// The reactor found the lock taken: whoever holds it wakes it.
    wanted: AtomicBool,
    /// ... and that service was urgent (see [`Shared::service`]).
    wanted_urgent: AtomicBool,
    /// The processes that hold the connection after a fork: who runs it,
    /// the others' mailbox, what this one serves them (see [`Holders`]).
    holders: Holders<P>,
    this: Weak<Shared<F, P>>,
    /// Told whenever a turn delivered something (readiness may have changed).
    notify: Option<Notify>,
    /// Where the connection holds pages (for the memory hooks).
    held: Arc<HeldBounds>,
    /// `close()` was called: the reactor lets go once the connection is
    /// finished or this deadline passes.
    closing: Lock<Option<Instant>>,
    /// The peer's exit descriptor the reactor watches for us.
    peer_exit: Lock<Option<Arc<std::os::fd::OwnedFd>>>,
    /// Mail and news the reactor brought while the lock was taken: handed
    /// over at the next turn.
    mail: Lock<Vec<reactor::Mail>>,
    suspect: AtomicBool,
    /// `mail` or `suspect` has something.
    news: AtomicBool,
    /// The connection left the fabric (State::Switched): its calls go to
    /// the TCP socket beneath.
    switched: AtomicBool,
    /// When the TCP socket beneath was last looked at for stray bytes
    /// ([`standby::now_ns`]).
    stream_looked: AtomicU64,
    /// Counted in `process::active` until dropped.
    _alive: process::Alive,
}

/// How long a process sharing a connection after a fork waits for the one
/// running it to move it onto TCP.
const SHARE_WAIT: Duration = Duration::from_secs(10);

/// How long a park waits for the other processes holding the connection's
/// descriptor to close it (a parent that forked the process about to exec
/// closes its copy a moment later); one that keeps it costs the exec this
/// much, then the connection moves to TCP.
const OTHERS_LEAVE: Duration = Duration::from_millis(500);

/// How often an idle connection's TCP socket is looked at for bytes
/// written behind azsdp's back.
const STREAM_LOOK_NS: u64 = 1_000_000_000;

/// How a sleeping loop's connection will be rung (see
/// [`ThreadedDriver::loop_sleeps`]).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum LoopArmed {
    /// On the loop's bell.
    Routed,
    /// A message may have come already: look before sleeping.
    Ready,
    /// Through the process's bell and the reactor, if at all.
    ByReactor,
}

/// The connection's lock was held (see `Shared::arm_for`).
#[derive(Debug, PartialEq, Eq)]
struct Busy;

/// How stale [`Shared::loop_at`] may grow before a loop's look renews it
/// (a quarter of [`standby::LOOP_RECENT`]).
const LOOP_MARK_EVERY_NS: u64 = standby::LOOP_RECENT.as_nanos() as u64 / 4;

/// Bounds of a blocking call (see [`ThreadedDriver::send_bounded`]).
pub struct CallLimits<'a> {
    /// Give up (with what moved, or EAGAIN) at this time.
    pub deadline: Option<Instant>,
    /// Asked before each sleep of the call: should it end now with EINTR
    /// (a signal the program handles without SA_RESTART is pending)?
    pub on_signal: &'a dyn Fn() -> bool,
}

impl CallLimits<'static> {
    /// No deadline; signals never cut the call short.
    pub const NONE: CallLimits<'static> = CallLimits {
        deadline: None,
        on_signal: &never,
    };
}

fn never() -> bool {
    false
}

impl std::fmt::Debug for CallLimits<'_> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("CallLimits")
            .field("deadline", &self.deadline)
            .finish()
    }
}

/// What [`ThreadedDriver::hand_to_others`] did.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Handed {
    /// The connection is on its TCP socket.
    Moved,
    /// The peer is gone: the others were told how the stream ended.
    Ended,
    /// It could not move: the others see it reset.
    Failed,
}

pub use super::holders::Refresh;

/// Called after the engine took in something from the fabric, a fault or a
/// timer: whoever waits for readiness (poll, epoll) should look again.
pub type Notify = Arc<dyn Fn() + Send + Sync>;

/// The driver, locked, with the thread marked as inside azsdp (so memory
/// hooks let its own frees pass instead of asking this very driver).
struct Locked<'a, F: Fabric, P: Protector> {
    guard: Option<LockGuard<'a, Driver<F, P>>>,
    shared: &'a Shared<F, P>,
    /// Only looked (the stats' snapshot): leaves `touched` alone.
    looked_only: bool,
    _inside: Inside,
}

impl<F: Fabric, P: Protector> Drop for Locked<'_, F, P> {
    fn drop(&mut self) {
        let Some(guard) = self.guard.take() else {
            return;
        };
        // Publish where pages are held for the memory hooks' lock-free look.
        self.shared.held.set(guard.connection().held_bounds());
        // (Set before the unlock: a snapshot that cleared it either sees
        // this holder's changes or leaves it set for the next one.)
        if !self.looked_only && !self.shared.touched.load(Ordering::Relaxed) {
            self.shared.touched.store(true, Ordering::Release);
        }
        // Completions this thread's actions produced but did not deliver
        // would wake nobody (they are not messages): whoever waits, look.
        let pending = guard.fabric().completions_pending();
        guard.host().clock_moves();
        drop(guard);
        if pending {
            self.shared.waiter.kick();
        }
        // The reactor found the lock taken while we held it: it looks
        // again, as urgently as it looked then. (A plain look made urgent
        // here kept a busy event loop's connections armed: every message
        // rang, its service met the loop's lock, and the loop's unlock
        // re-armed it.)
        let wanted = self.shared.wanted.swap(false, Ordering::SeqCst);
        let urgent = self.shared.wanted_urgent.swap(false, Ordering::SeqCst);
        if pending || urgent {
            self.shared.wake_reactor();
        } else if wanted && let Some(r) = self.shared.registration.lock().as_ref() {
            r.look_again();
        }
    }
}

impl<F: Fabric, P: Protector> std::ops::Deref for Locked<'_, F, P> {
    type Target = Driver<F, P>;
    fn deref(&self) -> &Driver<F, P> {
        self.guard.as_ref().expect("held until dropped")
    }
}

impl<F: Fabric, P: Protector> std::ops::DerefMut for Locked<'_, F, P> {
    fn deref_mut(&mut self) -> &mut Driver<F, P> {
        self.guard.as_mut().expect("held until dropped")
    }
}

impl<F: Fabric, P: Protector> Shared<F, P> {
    /// Ask the reactor to look at the connection soon.
    fn wake_reactor(&self) {
        if let Some(r) = self.registration.lock().as_ref() {
            r.wake();
        }
    }
}

impl<F: Fabric + Send + 'static, P: Protector + Send + 'static> Shared<F, P> {
    /// Arm the connection to ring `loop_bell` (0: the process's bell), as
    /// the reactor would, from an event loop's thread. [`Busy`] if its
    /// lock is held (its holder's unlock brings the reactor, which arms
    /// it); `None` if nothing of the fabric is this process's to arm.
    fn arm_for(&self, loop_bell: u32) -> Result<Option<Armed>, Busy> {
        // (Asked before the second try: a holder that lets go meanwhile
        // leaves the lock to it.)
        let mut d = self
            .try_lock()
            .or_else(|| {
                self.wanted.store(true, Ordering::SeqCst);
                self.try_lock()
            })
            .ok_or(Busy)?;
        d.looked_only = true;
        if d.peer_left()
            || self.stop.load(Ordering::SeqCst)
            || !self.holders.runs_here(d.fabric().sharing())
        {
            return Ok(None);
        }
        d.fabric_mut().ring_at(loop_bell);
        Ok(Some(d.fabric_mut().arm(false)))
    }

    fn lock(&self) -> Locked<'_, F, P> {
        let _inside = Inside::enter();
        // A panic elsewhere must not wedge the connection: keep going.
        let guard = self.driver.lock();
        Locked {
            guard: Some(guard),
            shared: self,
            looked_only: false,
            _inside,
        }
    }

    /// [`Shared::lock`] for a look that changes nothing.
    fn lock_to_look(&self) -> Locked<'_, F, P> {
        let mut l = self.lock();
        l.looked_only = true;
        l
    }

    fn try_lock(&self) -> Option<Locked<'_, F, P>> {
        let _inside = Inside::enter();
        let guard = self.driver.try_lock()?;
        Some(Locked {
            guard: Some(guard),
            shared: self,
            looked_only: false,
            _inside,
        })
    }

    /// Have the reactor watch the peer's exit descriptor (again, if the
    /// peer changed after a fork).
    fn watch_peer_exit(&self, d: &Driver<F, P>, reg: &Registration) {
        let now = d.fabric().peer_exit_fd();
        let mut watched = self.peer_exit.lock();
        let same = match (&*watched, &now) {
            (Some(a), Some(b)) => Arc::ptr_eq(a, b),
            (None, None) => true,
            _ => false,
        };
        if same {
            return;
        }
        if let Some(old) = watched.take() {
            reg.unwatch_shared(&old);
        }
        if let Some(fd) = now {
            match reg.watch_shared(Arc::clone(&fd)) {
                Ok(()) => *watched = Some(fd),
                Err(e) => crate::protect::log_once(&format!("reactor: {e}")),
            }
        }
    }

    /// Drive the connection from the reactor, watching its waiter and
    /// fault descriptors; faults wake it (and callers) as they come.
    fn attach(self: &Arc<Self>) {
        let reactor = match Reactor::get() {
            Ok(r) => r,
            Err(e) => {
                crate::protect::log_once(&format!("no reactor: {e}"));
                return;
            }
        };
        let mut fds: Vec<i32> = self.waiter.fd().into_iter().collect();
        let weak: Weak<dyn Serviced> = Arc::downgrade(self) as Weak<dyn Serviced>;
        // Locked until the peer knows how to ring us: the reactor's first
        // look (which arms the fabric) waits for it, and is asked for once
        // the lock is gone (asked at once, it met the lock, and the unlock
        // woke the reactor a second time: two wake-ups per connection).
        let mut d = self.lock();
        let reg = match reactor.register_watching(weak, &fds) {
            Ok(r) => r,
            Err(e) => {
                crate::protect::log_once(&format!("reactor: {e}"));
                return;
            }
        };
        d.fabric_mut().set_bell(reg.token(), reactor.bell());
        self.watch_peer_exit(&d, &reg);
        if let Some(f) = self.faults.lock().as_ref() {
            let (wake, waiter) = (reg.waker(), Arc::clone(&self.waiter));
            let waker: crate::protect::FaultWaker = Arc::new(move || {
                wake();
                waiter.kick();
            });
            fds.clear();
            if let Some(fd) = f.watch(waker) {
                fds.push(fd);
            }
        }
        for fd in fds {
            if let Err(e) = reg.watch(fd) {
                crate::protect::log_once(&format!("reactor: {e}"));
            }
        }
        // In place before the lock goes: a look the reactor tried meanwhile
        // is asked for again when it does (see `Locked::drop`).
        *self.registration.lock() = Some(reg);
        // The reactor's first look, taken here while we hold the lock: it
        // arms the fabric (the peer rings from now on) and says when to
        // look next; the reactor wakes for it only if that is sooner than
        // it would anyway (one wake-up per connection was a tenth of a
        // pair's context switches).
        let now = Instant::now();
        let next = if standby::wanted(self.in_calls.load(Ordering::SeqCst), &self.last_exit) {
            // Started by the program's call (see `Start::InCall`):
            // the call drives it, and the reactor stands by unarmed, or a
            // reply to this call rings it beside waking the caller.
            drop(d);
            Next {
                at: Some(standby::first_look(now)),
                parked: true,
                ..Next::default()
            }
        } else {
            self.service_locked(d, false, now)
        };
        if let Some(reg) = self.registration.lock().as_ref() {
            reg.serviced_here(next);
        }
    }

    /// In a forked child, before adopting: the threads are the parent's.
    fn orphaned(&self) -> bool {
        self.holders.orphaned()
    }

    /// May this process use the connection? A connection a fork froze is
    /// claimed here (and adopted, with threads of its own, by a child);
    /// false if the other process has it.
    fn make_mine(&self) -> bool {
        if self.holders.settled() {
            return true;
        }
        let decision = self.holders.for_call(self.lock().fabric().sharing());
        let mine = match decision {
            Use::Mine => true,
            Use::NotMine => false,
            Use::Adopt => {
                self.adopt();
                true
            }
        };
        if mine {
            self.holders.claimed();
        }
        mine
    }

    /// A forked child took the connection: fresh protection, the calls of
    /// the parent's threads dropped, threads of its own.
    fn adopt(&self) {
        let Some(me) = self.this.upgrade() else {
            return;
        };
        let (fresh, served) = self.holders.adopt();
        let faults = {
            let mut d = self.lock();
            // The calls the parent served for other processes go on here
            // (this copy has their buffers); its own threads' do not.
            d.forget_calls_except(&served);
            match fresh {
                Some((p, faults)) => {
                    d.replace_protector(p);
                    faults
                }
                None => None,
            }
        };
        self.holders.adopted();
        self.in_calls.store(0, Ordering::SeqCst);
        self.stop.store(false, Ordering::SeqCst);
        self.released.store(false, Ordering::SeqCst);
        // The parent's registration is dropped without touching its reactor.
        drop(self.registration.lock().take());
        *self.faults.lock() = faults;
        me.attach();
    }

    /// Wait until `ready` finds what it looks for, or `deadline` passes;
    /// this thread turns the engine while it waits. `None` also when this
    /// is a forked child's inert copy.
    fn wait_until<T>(
        &self,
        deadline: Option<Instant>,
        ready: impl FnMut(&mut Driver<F, P>) -> Option<T>,
    ) -> Option<T> {
        if !self.make_mine() {
            return None;
        }
        let _call = self.enter_call();
        self.wait_in_call(deadline, ready)
    }

    /// Count the calling thread as in a call (the reactor stays off the
    /// connection: the engine may touch this call's memory) until dropped.
    fn enter_call(&self) -> InCall<'_> {
        self.enter(false)
    }

    /// [`Shared::enter_call`] for one step of a wait that its caller takes
    /// again at once: its end leaves the reactor parked (the end of the
    /// caller's next call brings it back).
    fn enter_call_step(&self) -> InCall<'_> {
        self.enter(true)
    }

    fn enter(&self, step: bool) -> InCall<'_> {
        InCall::enter(
            &self.in_calls,
            &self.last_exit,
            &self.parked_long,
            &self.registration,
            step,
        )
    }

    /// [`Shared::wait_until`] for a thread already counted in a call.
    fn wait_in_call<T>(
        &self,
        deadline: Option<Instant>,
        mut ready: impl FnMut(&mut Driver<F, P>) -> Option<T>,
    ) -> Option<T> {
        let mut longest = FIRST_CALL_NAP;
        loop {
            if self.holders.frozen() && !self.make_mine() {
                break None;
            }
            let ticket = self.waiter.prepare();
            let nap = {
                let mut d = self.lock();
                if let Some(r) = ready(&mut d) {
                    return Some(r);
                }
                if self.turn_all(&mut d, 1) > 0 {
                    if let Some(r) = ready(&mut d) {
                        return Some(r);
                    }
                    continue;
                }
                // The reactor stays off while calls wait: the look for
                // bytes behind our back is theirs then (a reader blocked
                // for ever on a stream that went astray would hang).
                self.look_at_stream(&mut d);
                let now = Instant::now();
                if deadline.is_some_and(|t| t <= now) {
                    return None;
                }
                let mut nap = d.next_timeout().unwrap_or(longest).min(longest);
                if let Some(t) = deadline {
                    nap = nap.min(t - now);
                }
                nap
            };
            self.waiter.wait(ticket, nap, true);
            longest = (longest * 2).min(LONGEST_CALL_NAP);
        }
    }

    /// What a call gets when another process runs the connection: made
    /// again on the TCP socket once the connection moved there, else a
    /// reset.
    fn elsewhere(&self) -> CallError {
        if self.share_by_tcp() {
            CallError::Switched
        } else {
            CallError::ConnReset
        }
    }

    /// This process shares the connection after a fork but does not run it:
    /// ask the one that does to move it onto the TCP socket (the kernel
    /// shares that), and wait until it has. Whether it did (calls then go
    /// to the socket).
    fn share_by_tcp(&self) -> bool {
        if self.switched.load(Ordering::SeqCst) {
            return true;
        }
        {
            let d = self.lock();
            if d.host().beneath.is_none() {
                // No TCP socket to share (a library user's own channel):
                // the copy stays inert, and the runner keeps the fabric.
                return false;
            }
            d.fabric().sharing().request_leave();
        }
        let deadline = Instant::now() + SHARE_WAIT;
        // The lock is not held while waiting: this process's reactor
        // services the connection meanwhile, and a fork by another thread
        // would wait for the lock (sync.rs: no wait with a lock held).
        while !self.lock().fabric().sharing().has_left() {
            if Instant::now() >= deadline {
                return false;
            }
            // (The runner's reactor sees the request at its next look,
            // within a second.)
            std::thread::sleep(Duration::from_millis(2));
        }
        self.switched.store(true, Ordering::SeqCst);
        true
    }

    /// Has the connection left the fabric (this process's calls go to the
    /// TCP socket)? Seen from a process that does not run it.
    fn left(&self) -> bool {
        if self.switched.load(Ordering::SeqCst) {
            return true;
        }
        if self.lock().fabric().sharing().has_left() {
            self.switched.store(true, Ordering::SeqCst);
            return true;
        }
        false
    }

    /// A process that does not run the connection: are its calls served
    /// by the one that does (see [`delegation`])? If not (no mailbox: the
    /// connection was not on the fabric at the fork), it shares it by TCP.
    fn guest(&self) -> Option<Arc<Mailbox>> {
        self.holders.mailbox().filter(|_| !self.left())
    }

    /// One request for the runner; `None` when the call must go elsewhere
    /// (the connection left the fabric: made again on TCP).
    fn ask(&self, mb: &Mailbox, req: Request, limits: &CallLimits<'_>) -> Result<u64, CallError> {
        // If the runner dies, the peer carries the stream on for us.
        self.lock().fabric().sharing().note_heir();
        let kick = || self.waiter.kick();
        let left = || self.left();
        let w = GuestWait {
            deadline: limits.deadline,
            on_signal: limits.on_signal,
            kick: &kick,
            left: &left,
        };
        match delegation::call(mb, req, &w) {
            Answer::Done(Err(CallError::Switched)) => {
                self.switched.store(self.left(), Ordering::SeqCst);
                Err(CallError::Switched)
            }
            // Cut by the deadline (SO_RCVTIMEO/SO_SNDTIMEO): EAGAIN, as
            // for the runner's own calls.
            Answer::Done(Err(CallError::Interrupted))
                if limits.deadline.is_some_and(|t| Instant::now() >= t) =>
            {
                Err(CallError::WouldBlock)
            }
            Answer::Done(r) => r,
            // The runner cannot reach our memory: both go on TCP.
            Answer::Unservable => Err(self.elsewhere()),
            Answer::RunnerGone => {
                if self.holders.runner_died() {
                    crate::protect::log_once(
                        "the process that ran a shared connection died: it is reset",
                    );
                }
                Err(CallError::ConnReset)
            }
        }
    }

    /// A guest's `send()`: in requests of at most [`delegation::CHUNK`]; a
    /// blocking one goes on until all is taken (or a request is cut short).
    fn guest_send(
        &self,
        buf: &[u8],
        flags: SendFlags,
        limits: &CallLimits<'_>,
    ) -> Result<u64, CallError> {
        let addr = buf.as_ptr() as u64;
        let more = !flags.nonblocking;
        self.guest_chunks(buf.len() as u64, limits, more, |at, len| Request::Send {
            addr: addr + at,
            len,
            nonblocking: flags.nonblocking,
        })
    }

    /// A guest's `recv()`: one request (MSG_WAITALL: until all came).
    fn guest_recv(
        &self,
        buf: &mut [u8],
        flags: RecvFlags,
        limits: &CallLimits<'_>,
    ) -> Result<u64, CallError> {
        let addr = buf.as_mut_ptr() as u64;
        let more = flags.waitall && !flags.peek;
        self.guest_chunks(buf.len() as u64, limits, more, |at, len| Request::Recv {
            addr: addr + at,
            len,
            flags,
        })
    }

    /// A guest's call of `len` bytes as requests of at most a chunk each
    /// (`req(offset, length)`); `more`: go on after a whole chunk until all
    /// moved (a short answer or an error after some bytes ends it).
    fn guest_chunks(
        &self,
        len: u64,
        limits: &CallLimits<'_>,
        more: bool,
        req: impl Fn(u64, u64) -> Request,
    ) -> Result<u64, CallError> {
        let Some(mb) = self.guest() else {
            return Err(self.elsewhere_or_switched());
        };
        let mut total = 0u64;
        loop {
            let chunk = (len - total).min(delegation::CHUNK);
            match self.ask(&mb, req(total, chunk), limits) {
                Ok(n) => {
                    total += n;
                    if total >= len || n < chunk || !more {
                        return Ok(total);
                    }
                }
                Err(e) if total == 0 => return Err(e),
                Err(_) => return Ok(total),
            }
        }
    }

    /// This process, which runs the connection, closed its descriptor
    /// (`abort`: SO_LINGER {on, 0}). If other processes may still hold
    /// it (their descriptors keep the kernel's socket open, used yet or
    /// not), it moves onto that socket, where they carry on, instead of
    /// ending (or, if the peer is gone, they are told how it ended).
    fn end_here(&self, d: &mut Driver<F, P>, abort: bool) {
        let guests = self.holders.guests();
        let told = Shared::ending_for_guests(d);
        match ownership::ending(guests.is_some(), told.is_some(), abort) {
            Ending::OntoTcp => d.leave_fabric(),
            Ending::TellThenClose => {
                if let (Some(mb), Some(how)) = (guests, told) {
                    mb.end(how);
                }
                d.submit_close();
            }
            Ending::Abort => d.abort(),
            Ending::Close => d.submit_close(),
        }
    }

    /// The peer is gone, so the connection cannot move onto TCP for the
    /// guests: how it ends for them (`None`: the peer lives, it can move).
    fn ending_for_guests(d: &Driver<F, P>) -> Option<delegation::Ending> {
        let c = d.connection();
        let gone = d.peer_left() || matches!(c.state(), State::Aborted(_));
        if !gone {
            return None;
        }
        let r = c.readiness();
        Some(if r.read_hangup && !r.error && c.readable_bytes() == 0 {
            delegation::Ending::Eof
        } else {
            delegation::Ending::Reset
        })
    }

    fn elsewhere_or_switched(&self) -> CallError {
        if self.switched.load(Ordering::SeqCst) {
            CallError::Switched
        } else {
            self.elsewhere()
        }
    }

    /// Readiness as the runner published it, for a guest (and from now on
    /// this process's waiters hear of changes).
    fn guest_readiness(&self, mb: &Mailbox) -> Readiness {
        if let Some(n) = &self.notify {
            delegation::watch_readiness(mb.family(), n);
        }
        if let Some(e) = mb.ending() {
            return e.readiness();
        }
        if self.holders.runner_is_gone(mb) {
            return delegation::Ending::Reset.readiness();
        }
        match mb.published() {
            Some(r) => r,
            None => {
                // Nothing published yet: ask the runner to.
                let _ = delegation::call(
                    mb,
                    Request::Look,
                    &GuestWait {
                        deadline: Some(Instant::now() + Duration::from_millis(100)),
                        on_signal: &never,
                        kick: &|| self.waiter.kick(),
                        left: &|| self.left(),
                    },
                );
                mb.published().unwrap_or_default()
            }
        }
    }

    /// Do `act` on the engine and turn it on this thread, as a wake-up of
    /// the reactor would have it turned (the wake-up cost more than the
    /// turn: one or two per connection that joins from TCP), telling
    /// readiness waiters and blocked callers what changed.
    fn act_and_turn<T>(&self, act: impl FnOnce(&mut Driver<F, P>) -> T) -> T {
        let r = {
            let mut d = self.lock();
            let before = Seen::of(&d);
            let r = act(&mut d);
            self.turn_all_since(&mut d, 0, before);
            r
        };
        self.waiter.kick();
        r
    }

    /// The reactor is needed now, though calls ran a moment ago: off
    /// standby (see [`standby`]) until the next call.
    fn end_standby(&self) {
        self.last_exit.store(0, Ordering::SeqCst);
        self.wake_reactor();
    }

    /// Hand the fabric what the reactor brought for it: mail, and news
    /// that the peer's process may have exited.
    fn take_news(&self, d: &mut Driver<F, P>) {
        if !self.news.swap(false, Ordering::SeqCst) {
            return;
        }
        let mail = std::mem::take(&mut *self.mail.lock());
        for m in mail {
            d.fabric_mut().take_mail(m);
        }
        if self.suspect.swap(false, Ordering::SeqCst) {
            d.fabric_mut().peer_suspect();
        }
    }

    /// Hand the faults that wait to the engine: completions already
    /// delivered may have settled their pages, and what a fault starts may
    /// complete at once (a compare-and-swap on shared memory), which the
    /// turn that follows delivers.
    fn take_faults(&self, d: &mut Driver<F, P>) -> usize {
        let faults = self.faults.lock();
        let Some(src) = faults.as_ref() else {
            return 0;
        };
        let mut n = 0;
        while let Some(f) = src.try_next() {
            if n == 0 {
                // Completions already in the ring may have settled the page.
                while d.turn() > 0 {}
            }
            let access = if f.write { Access::Write } else { Access::Read };
            d.submit_fault(f.addr, access);
            n += 1;
        }
        n
    }

    /// Turn until nothing more arrives; kick sleeping callers if anything
    /// did and `others` of them may be waiting for it.
    fn turn_all(&self, d: &mut Driver<F, P>, others: usize) -> usize {
        let before = Seen::of(d);
        self.turn_all_since(d, others, before)
    }

    /// [`Shared::turn_all`], telling readiness waiters if what they look
    /// at moved from `before` (taken before the caller's own step on the
    /// engine).
    fn turn_all_since(&self, d: &mut Driver<F, P>, others: usize, before: Seen) -> usize {
        self.take_news(d);
        let mut total = self.take_faults(d);
        loop {
            let n = d.turn();
            total += n;
            if n == 0 {
                break;
            }
        }
        if self.holders.serve(d) {
            total += 1;
        }
        if total > 0 && self.in_calls.load(Ordering::SeqCst) > others {
            self.waiter.kick();
        }
        if *d.connection().state() == State::Switched
            && d.connection().rx_tail() == 0
            && !self.switched.swap(true, Ordering::SeqCst)
        {
            // Every caller looks again (their calls go to TCP now), and so
            // do the processes sharing this side. (After an orphan switch,
            // once what the dead peer sent has been read.)
            d.fabric().sharing().mark_left();
            self.waiter.kick();
        } else if d.fabric().sharing().leave_requested() && !d.connection().leaving_fabric() {
            // A process sharing this side after a fork wants to use it:
            // both go on the TCP socket, which the kernel shares.
            d.leave_fabric();
        }
        // Only when what they look at moved: a handshake's step, a credit
        // or a completion that moves none of it would wake every thread
        // blocked on the connection for nothing. Timers move it too (a
        // peer that timed out).
        if Seen::of(d) != before
            && let Some(n) = &self.notify
        {
            n();
        }
        total
    }
}

/// What readiness waiters outside the engine look at: its readiness
/// (whose counters grow with every arrival and drain, for edge-triggered
/// waiters) and, while the connection joins from TCP, where receives read
/// and whether our side may join (`shim/src/join.rs`). Not the handshake
/// as such: a listener's receiver, blocked until the client joins, has
/// nothing to do when it ends.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
struct Seen {
    readiness: Readiness,
    route: RxRoute,
    may_join: bool,
    tx_joined: bool,
}

impl Seen {
    fn of<F: Fabric, P: Protector>(d: &Driver<F, P>) -> Seen {
        let c = d.connection();
        Seen {
            readiness: c.readiness(),
            route: c.rx_route(),
            may_join: c.may_join_tx(),
            tx_joined: c.tx_joined(),
        }
    }
}

/// The driver shared by callers and the reactor. Dropping it stops driving
/// the connection.
pub struct ThreadedDriver<F: Fabric + Send + 'static, P: Protector + Send + 'static> {
    shared: Arc<Shared<F, P>>,
}

impl<F: Fabric + Send + 'static, P: Protector + Send + 'static> std::fmt::Debug
    for ThreadedDriver<F, P>
{
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ThreadedDriver")
            .field("runner", &self.shared.holders.runner())
            .finish()
    }
}

/// Who starts a connection's driver.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Start {
    /// Nothing drives it yet: the reactor's first look arms the fabric.
    Idle,
    /// A call of the program that drives it from here (a client's first
    /// call after its pair completed): the reactor starts on standby, its
    /// first look on the grid of [`standby::first_look`].
    InCall,
}

impl<F: Fabric + Send + 'static, P: Protector + Send + 'static> ThreadedDriver<F, P> {
    /// Hand the connection to the process's reactor, which watches
    /// `waiter` and `faults` for it when no call drives it.
    pub fn start(
        driver: Driver<F, P>,
        waiter: impl FabricWaiter + 'static,
        faults: Option<Box<dyn FaultSource>>,
    ) -> Self {
        Self::start_with_notify(driver, waiter, faults, None, Start::Idle)
    }

    /// [`ThreadedDriver::start`], calling `notify` whenever readiness may
    /// have changed; `start` says whether a call of the program starts it.
    pub fn start_with_notify(
        driver: Driver<F, P>,
        waiter: impl FabricWaiter + 'static,
        faults: Option<Box<dyn FaultSource>>,
        notify: Option<Notify>,
        start: Start,
    ) -> Self {
        let shared = Arc::new_cyclic(|this| Shared {
            registration: Lock::new(None),
            driver: Lock::new(driver),
            waiter: Arc::new(waiter),
            faults: Lock::new(faults),
            stop: AtomicBool::new(false),
            released: AtomicBool::new(false),
            in_calls: AtomicUsize::new(0),
            last_exit: AtomicU64::new(match start {
                Start::Idle => 0,
                Start::InCall => standby::now_ns(),
            }),
            loop_at: AtomicU64::new(0),
            loop_bell: AtomicU32::new(0),
            loop_armed: AtomicU64::new(0),
            rung: AtomicU64::new(0),
            touched: AtomicBool::new(true),
            standby_nap: Lock::new(standby::RECENT),
            parked_long: AtomicBool::new(false),
            wanted: AtomicBool::new(false),
            wanted_urgent: AtomicBool::new(false),
            holders: Holders::new(),
            this: this.clone(),
            notify,
            held: Arc::new(HeldBounds::default()),
            closing: Lock::new(None),
            peer_exit: Lock::new(None),
            mail: Lock::new(Vec::new()),
            suspect: AtomicBool::new(false),
            news: AtomicBool::new(false),
            switched: AtomicBool::new(false),
            stream_looked: AtomicU64::new(0),
            _alive: process::Alive::count(),
        });
        let weak: Weak<dyn Participant> = Arc::downgrade(&shared) as Weak<dyn Participant>;
        process::register(weak, Arc::clone(&shared.held));
        shared.attach();
        ThreadedDriver { shared }
    }

    /// How a forked child that adopts this connection protects its pages
    /// (without it, a child cannot adopt the connection).
    pub fn set_fork_protection(&self, refresh: Refresh<P>) {
        self.shared.holders.set_refresh(refresh);
    }

    /// Does this process run the connection now (without claiming it)?
    pub fn is_mine(&self) -> bool {
        self.shared
            .holders
            .runs_here(self.shared.lock().fabric().sharing())
    }

    /// May this process use the connection now? Claims one a fork froze
    /// (adopting it in a child); false if another process has it.
    pub fn claim(&self) -> bool {
        self.shared.make_mine()
    }

    /// Wait for `call` within `limits`: past the deadline, or after a
    /// signal handler ran and `limits.on_signal` says the call must not
    /// restart, it is cancelled (it then ends with what it moved, or with
    /// `WouldBlock` for a deadline and `Interrupted` for a signal, as
    /// SO_RCVTIMEO/SO_SNDTIMEO and EINTR).
    ///
    /// `None` when another process runs the connection (or took it during
    /// the call): the call is then that process's to serve.
    fn wait_bounded(
        &self,
        submit: impl FnOnce(&mut Driver<F, P>) -> CallId,
        limits: &CallLimits<'_>,
    ) -> Option<Result<u64, CallError>> {
        if !self.shared.make_mine() {
            return None;
        }
        // Counted before the call is submitted: from then on the engine may
        // touch its memory, which only this thread may do.
        let _call = self.shared.enter_call();
        let call = submit(&mut self.shared.lock());
        let mut cut: Option<CallError> = None;
        let r = self.shared.wait_in_call(None, |d| {
            if let Some(r) = d.take_result(call) {
                return Some(r);
            }
            if cut.is_none() {
                if limits.deadline.is_some_and(|t| Instant::now() >= t) {
                    cut = Some(CallError::WouldBlock);
                    d.cancel(call);
                } else if (limits.on_signal)() {
                    cut = Some(CallError::Interrupted);
                    d.cancel(call);
                }
                return d.take_result(call);
            }
            None
        });
        match (r, cut) {
            (Some(Err(CallError::Interrupted)), Some(why)) => Some(Err(why)),
            (Some(r), _) => Some(r),
            (None, _) => None,
        }
    }

    /// `send()` that a deadline or a signal may cut short.
    pub fn send_bounded(
        &self,
        buf: &[u8],
        flags: SendFlags,
        limits: &CallLimits<'_>,
    ) -> Result<u64, CallError> {
        self.wait_bounded(
            |d| d.submit_send(buf.as_ptr() as u64, buf.len() as u64, flags),
            limits,
        )
        .unwrap_or_else(|| self.shared.guest_send(buf, flags, limits))
    }

    /// `recv()` that a deadline or a signal may cut short.
    pub fn recv_bounded(
        &self,
        buf: &mut [u8],
        flags: RecvFlags,
        limits: &CallLimits<'_>,
    ) -> Result<u64, CallError> {
        let (addr, len) = (buf.as_mut_ptr() as u64, buf.len() as u64);
        self.wait_bounded(|d| d.submit_recv(addr, len, flags), limits)
            .unwrap_or_else(|| self.shared.guest_recv(buf, flags, limits))
    }

    /// Blocking `send()`; returns when the engine says the buffer is
    /// reusable (at once under AZ-SDP).
    pub fn send(&self, buf: &[u8], flags: SendFlags) -> Result<u64, CallError> {
        self.send_bounded(buf, flags, &CallLimits::NONE)
    }

    /// Blocking `recv()`.
    pub fn recv(&self, buf: &mut [u8], flags: RecvFlags) -> Result<u64, CallError> {
        self.recv_bounded(buf, flags, &CallLimits::NONE)
    }

    /// Before memory is freed, unmapped or discarded: wait until no
    /// transfer uses `range` any more (copied aside, or finished). The
    /// process-wide hooks ([`crate::process`]) do this for every driver.
    pub fn evacuate(&self, range: std::ops::Range<u64>) {
        self.shared.evacuate(range);
    }

    /// `range` was unmapped: drop the protector's state for it.
    pub fn unmapped(&self, range: std::ops::Range<u64>) {
        self.shared.forget(range);
    }

    /// Readiness for poll/select/epoll (a forked child's inert copy is in
    /// error: it cannot move data).
    pub fn readiness(&self) -> Readiness {
        if !self.shared.make_mine()
            && let Some(mb) = self.shared.guest()
        {
            return self.shared.guest_readiness(&mb);
        }
        if !self.shared.make_mine() && self.shared.share_by_tcp() {
            // The socket's own readiness is what counts: look there.
            return Readiness {
                readable: true,
                writable: true,
                ..Readiness::default()
            };
        }
        if !self.shared.make_mine() {
            // A copy that cannot be used: as a reset connection.
            return delegation::Ending::Reset.readiness();
        }
        let mut d = self.shared.lock();
        self.shared.turn_all(&mut d, 0);
        d.connection().readiness()
    }

    /// `SO_ERROR`: the pending error, once (see `Connection::take_error`);
    /// a forked child's inert copy has ECONNRESET.
    pub fn take_error(&self) -> Option<CallError> {
        if !self.shared.make_mine() {
            let Some(mb) = self.shared.guest() else {
                return Some(CallError::ConnReset);
            };
            return self
                .shared
                .ask(&mb, Request::TakeError, &CallLimits::NONE)
                .err()
                .filter(|e| *e != CallError::Switched);
        }
        let mut d = self.shared.lock();
        self.shared.turn_all(&mut d, 0);
        d.take_error()
    }

    /// Bytes a `recv()` could take without waiting (FIONREAD).
    pub fn readable_bytes(&self) -> u64 {
        if !self.shared.make_mine() {
            return self.shared.guest().map_or(0, |mb| mb.readable_bytes());
        }
        let mut d = self.shared.lock();
        self.shared.turn_all(&mut d, 0);
        d.connection().readable_bytes()
    }

    /// `shutdown(how)`; returns at once.
    pub fn shutdown(&self, how: Shutdown) {
        if self.shared.make_mine() {
            self.shared.lock().shutdown(how);
            self.shared.waiter.kick();
            self.shared.wake_reactor();
        } else if let Some(mb) = self.shared.guest() {
            let _ = self
                .shared
                .ask(&mb, Request::Shutdown(how), &CallLimits::NONE);
        }
    }

    /// Does another process run the connection, which this one shares
    /// after a fork and has now had moved onto the TCP socket (see
    /// `share_by_tcp`)? Cheap while no fork touched the connection
    /// (`make_mine` answers from the settled view).
    pub fn runs_elsewhere(&self) -> bool {
        if self.shared.make_mine() {
            return false;
        }
        if self.shared.holders.shared_by_fork() {
            // Served by the runner until the connection leaves the fabric.
            return self.shared.left();
        }
        self.shared.share_by_tcp()
    }

    /// This process is about to exec, and its descriptors of the
    /// connection close on exec: it no longer holds it (the process that
    /// runs it may end it at its close). (Should the exec fail, the
    /// process's next call notes it again.)
    pub fn not_held_after_exec(&self) {
        self.shared.holders.not_held_here();
    }

    /// Has a fork copied this connection (other processes may hold its
    /// descriptor, whether they used it yet or not)?
    pub fn shared_by_fork(&self) -> bool {
        self.shared.holders.shared_by_fork()
    }

    /// Does this process run the connection for others too (live
    /// processes that may hold its descriptor: forked with it, or that made
    /// calls)? Cheap when no fork copied it.
    pub fn serves_others(&self) -> bool {
        let h = &self.shared.holders;
        h.shared_by_fork()
            && !self.shared.orphaned()
            && !h.taken(self.shared.lock().fabric().sharing())
            && h.guests().is_some()
    }

    /// This process runs the connection for others and is about to go
    /// without its exit handlers (`_exit`): move the connection onto its
    /// TCP socket for them (waiting at most `timeout`), or, if the peer is
    /// gone, tell them how it ended.
    pub fn hand_to_others(&self, timeout: Duration) -> Handed {
        let Some(mb) = self.shared.holders.mailbox() else {
            return Handed::Failed;
        };
        let ending = Shared::ending_for_guests(&self.shared.lock());
        if let Some(how) = ending {
            mb.end(how);
            return Handed::Ended;
        }
        if self.leave_fabric(timeout) {
            // The guests' calls the move ended are answered before this
            // process goes (they are made again on TCP).
            let mut d = self.shared.lock();
            self.shared.holders.serve(&mut *d);
            Handed::Moved
        } else {
            mb.end(delegation::Ending::Reset);
            Handed::Failed
        }
    }

    /// Park the connection for the next image of this process (an exec
    /// that runs the shim): wait up to `wait` for it to be quiet (no call
    /// in progress, the peer done reading our pages; receives stop
    /// arming), then return its engine as bytes and what `park_fabric`
    /// makes of the endpoint, with a hold that keeps the connection still
    /// (nothing turns it) until dropped: the exec replaces the process, or
    /// fails and the connection goes on as if nothing happened. Why not,
    /// if it cannot park (the caller moves it onto TCP instead).
    pub fn park<T>(
        &self,
        wait: Duration,
        park_fabric: impl FnOnce(&F) -> Option<T>,
    ) -> Result<Parked<'_, F, P, T>, String> {
        if !self.is_mine() || self.is_switched() {
            return Err("not run by this process".into());
        }
        let deadline = Instant::now() + wait;
        // A forked parent closes its copy just after the fork, and its
        // child may well exec first (inetd, sshd's re-exec): give the
        // others a moment to leave before the connection moves to TCP.
        let leave = wait.min(OTHERS_LEAVE);
        let leave_by = Instant::now() + leave;
        while self.serves_others() {
            if Instant::now() >= leave_by {
                return Err(format!(
                    "other processes share it (their calls come through this one), \
                     still after {leave:?}"
                ));
            }
            std::thread::sleep(Duration::from_millis(1));
        }
        self.shared.lock().pause_arms(true);
        self.shared.end_standby();
        let quiet = self
            .shared
            .wait_until(Some(deadline), |d| d.park_blocker().is_none().then_some(()));
        let mut d = self.shared.lock();
        let parked = match (quiet, d.park()) {
            (Some(()), Ok(bytes)) => match park_fabric(d.fabric()) {
                Some(t) => Ok((bytes, t)),
                None => Err("its fabric endpoint cannot follow an exec".into()),
            },
            (_, Err(why)) => Err(format!("not quiet within {wait:?}: {why}")),
            (None, Ok(_)) => Err(format!("not quiet within {wait:?}")),
        };
        match parked {
            Ok((engine, fabric)) => Ok(Parked {
                engine,
                fabric,
                hold: ParkHold { locked: d },
            }),
            Err(e) => {
                d.pause_arms(false);
                Err(e)
            }
        }
    }

    /// Call `f` with the connection's fabric endpoint.
    pub fn with_fabric<T>(&self, f: impl FnOnce(&F) -> T) -> T {
        f(self.shared.lock().fabric())
    }

    /// Is this a forked child's copy of a connection it never ran?
    pub fn inherited_only(&self) -> bool {
        self.shared.orphaned()
    }

    /// What this process served for others (see [`delegation`]).
    pub fn served(&self) -> delegation::Served {
        self.shared.holders.served()
    }

    /// This process shares the connection with the one that runs it: ask
    /// that one to move it onto the TCP socket, and wait until it has
    /// (before an `exec`, a change of user, a sandbox, which the runner
    /// could not serve). Whether the connection is on TCP now.
    pub fn ask_runner_to_leave(&self) -> bool {
        !self.shared.make_mine() && self.shared.share_by_tcp()
    }

    /// A number that changes when a message may have arrived (or a
    /// thread kicked the connection's waiters): a busy-poller over many
    /// connections compares it, one load each, instead of turning them.
    pub fn ticket(&self) -> u32 {
        self.shared.waiter.prepare()
    }

    /// An event loop looked at the connection (at `at_ns`, from
    /// [`standby::now_ns`]) and looks again at its next wait: as after a
    /// call, the reactor stands by, and the peer posts without ringing,
    /// until the loop sleeps ([`ThreadedDriver::loop_sleeps`]). Other
    /// threads' sleeps leave it so (see [`standby::looped`]).
    pub fn watched_by_loop(&self, at_ns: u64) {
        // A loop cannot hear a fabric whose ticket moves only when someone
        // waits (verbs: a completion channel): the reactor watches that.
        if !self.shared.waiter.ticket_moves_on_arrival() {
            return;
        }
        // A busy loop's waits come microseconds apart: a store per wait
        // would only bounce the line with the reactor's reads.
        let was = self.shared.loop_at.load(Ordering::Relaxed);
        if was == 0 || at_ns.saturating_sub(was) >= LOOP_MARK_EVERY_NS {
            self.shared.loop_at.store(at_ns.max(1), Ordering::SeqCst);
        }
    }

    /// How often the peer rang the connection (or its descriptors fired):
    /// the reactor's wake-ups it cost (see `stats`).
    pub fn rung(&self) -> u64 {
        self.shared.rung.load(Ordering::Relaxed)
    }

    /// The loop of [`ThreadedDriver::watched_by_loop`] is about to sleep:
    /// only the reactor sees messages come now, or, with `loop_bell` (one
    /// of this process's, see `fabric::shm::loop_bell`; 0: none), the loop
    /// itself: the connection is armed to ring that bell, here if its
    /// lock is free (else by the reactor, which the holder's unlock
    /// brings).
    pub fn loop_sleeps(&self, loop_bell: u32) -> LoopArmed {
        let sh = &self.shared;
        if sh.loop_at.load(Ordering::Relaxed) != 0 {
            sh.loop_at.store(0, Ordering::SeqCst);
        }
        if loop_bell == 0 || !sh.waiter.ticket_moves_on_arrival() {
            return LoopArmed::ByReactor;
        }
        if sh.loop_bell.load(Ordering::Relaxed) != loop_bell {
            sh.loop_bell.store(loop_bell, Ordering::SeqCst);
        }
        // Armed for this bell, and nothing came since (a message would
        // have moved the ticket): it still is.
        let ticket = sh.waiter.prepare();
        let armed = (u64::from(loop_bell) << 32) | u64::from(ticket);
        if sh.loop_armed.load(Ordering::Relaxed) == armed {
            return LoopArmed::Routed;
        }
        let (got, was) = match sh.arm_for(loop_bell) {
            // (The reactor arms it, for this bell, when the holder lets go.)
            Err(Busy) => return LoopArmed::Routed,
            Ok(None) => (LoopArmed::ByReactor, 0),
            Ok(Some(Armed::Ready)) => (LoopArmed::Ready, 0),
            Ok(Some(_)) => (LoopArmed::Routed, armed),
        };
        sh.loop_armed.store(was, Ordering::Relaxed);
        got
    }

    /// The loop whose bell is `loop_bell` no longer watches the connection
    /// (it left the set, or the set went): the connection is armed again
    /// to ring the process's bell.
    pub fn loop_left(&self, loop_bell: u32) {
        let sh = &self.shared;
        if sh
            .loop_bell
            .compare_exchange(loop_bell, 0, Ordering::SeqCst, Ordering::SeqCst)
            .is_ok()
        {
            sh.loop_at.store(0, Ordering::SeqCst);
            sh.loop_armed.store(0, Ordering::Relaxed);
            // (What came already waits for the program's next look, as
            // bytes in a socket's buffer would: redis-benchmark deletes
            // and adds its socket at every request, and a wake of the
            // reactor each time cost a loaded host most of its rate.)
            let _ = sh.arm_for(0);
        }
    }

    /// Is the connection on its TCP socket now: moved there by this
    /// process, or by the one that runs it at this one's request?
    pub fn on_tcp(&self) -> bool {
        self.is_switched() || self.runs_elsewhere()
    }

    /// Did the connection move onto TCP alone for the heirs of a dead
    /// peer, with bytes that peer sent still to be read here first? (Sends
    /// go to the TCP socket meanwhile; receives come here.)
    pub fn has_rx_tail(&self) -> bool {
        self.shared.lock().connection().rx_tail() > 0
    }

    /// Did the connection move onto TCP alone, for the processes left when
    /// the peer's process died (see `FabricEvent::PeerGone`)?
    pub fn orphaned(&self) -> bool {
        self.shared.lock().connection().orphaned()
    }

    /// Our sending direction joins the fabric after `tcp_sent` bytes
    /// went over TCP (a connection that began there, docs/protocol.md §8b).
    /// Only the process that runs the connection joins.
    pub fn join_tx(&self, tcp_sent: u64) {
        if self.shared.make_mine() {
            self.shared.act_and_turn(|d| d.join_tx(tcp_sent));
        }
    }

    /// The listener's side: the client may join (only the process that
    /// runs the connection allows it).
    pub fn allow_join(&self) {
        if self.shared.make_mine() {
            self.shared.act_and_turn(|d| d.allow_join());
        }
    }

    /// On TCP at once, with no SWITCH, if this process runs the connection
    /// and nothing joined the fabric either way, nor can
    /// (`Driver::stay_on_tcp_now`). Whether it is.
    pub fn stay_on_tcp_now(&self) -> bool {
        if !self.shared.make_mine() || !self.shared.lock().stay_on_tcp_now() {
            return false;
        }
        self.shared.end_standby();
        self.shared.waiter.kick();
        true
    }

    /// The TCP socket beneath was reset, and the program told.
    pub fn tcp_reset(&self) {
        if self.shared.make_mine() {
            self.shared.lock().tcp_reset();
            self.shared.waiter.kick();
        }
    }

    /// May our sending direction join the fabric now, by §8b's rule
    /// (`Connection::may_join_tx`), after taking in what came?
    pub fn may_join_tx(&self) -> bool {
        let mut d = self.shared.lock();
        self.shared.turn_all(&mut d, 0);
        d.connection().may_join_tx()
    }

    /// Has our sending direction joined the fabric (or begun there)?
    pub fn tx_joined(&self) -> bool {
        self.shared.lock().connection().tx_joined()
    }

    /// Where a receive reads from (`conn::RxRoute`).
    pub fn rx_route(&self) -> crate::conn::RxRoute {
        let mut d = self.shared.lock();
        self.shared.turn_all(&mut d, 0);
        d.rx_route()
    }

    /// A receive that reads the TCP socket until the peer's JOIN comes
    /// sleeps here, counted in a call (the reactor stands by), until the
    /// route leaves [`RxRoute::Tcp`]`{ left: None }`, a message comes (the
    /// peer's post wakes this thread itself, as it wakes a call blocked on
    /// the fabric), the waiter is kicked ([`ThreadedDriver::kicker`]: the
    /// socket turned ready), or `nap` passes. Whether it slept here (or
    /// found the route moved): false if this process does not run the
    /// connection, or the engine is over (nothing more comes on the
    /// fabric: wait for the socket alone).
    ///
    /// [`RxRoute::Tcp`]: crate::conn::RxRoute::Tcp
    pub fn wait_for_peer_join(&self, nap: Duration) -> bool {
        let sh = &self.shared;
        // (A forked copy does not claim the connection here.)
        if !sh.holders.settled() && !self.is_mine() {
            return false;
        }
        // (The caller's loop comes back here until the route moves: the
        // reactor stays parked between the steps, instead of a wake-up of
        // it at each nap's end, ten thousand threads waiting at once.)
        let _call = sh.enter_call_step();
        let ticket = sh.waiter.prepare();
        {
            let mut d = sh.lock();
            sh.turn_all(&mut d, 1);
            if !matches!(
                d.connection().state(),
                crate::conn::State::Handshake | crate::conn::State::Established
            ) {
                return false;
            }
            if !matches!(d.rx_route(), crate::conn::RxRoute::Tcp { left: None }) {
                return true;
            }
        }
        // No busy-poll: the peer's JOIN follows its program's next send,
        // which our peer's loop makes after a wake-up of its own (tens of
        // microseconds at least), and a spin here takes that CPU from it.
        sh.waiter.wait(ticket, nap, false);
        true
    }

    /// Wakes the threads asleep in [`ThreadedDriver::wait_for_peer_join`]
    /// (and in blocked calls): for a watch of the socket beneath.
    pub fn kicker(&self) -> reactor::Waker {
        let waiter = Arc::clone(&self.shared.waiter);
        Arc::new(move || waiter.kick())
    }

    /// The program took `n` bytes from TCP while the route said so.
    pub fn took_from_tcp(&self, n: u64) -> Result<(), CallError> {
        let r = self.shared.act_and_turn(|d| d.took_from_tcp(n));
        if r.is_err() {
            // Aborted: the reactor finishes it.
            self.shared.wake_reactor();
        }
        r
    }

    /// Has the connection left the fabric for the TCP socket beneath?
    pub fn is_switched(&self) -> bool {
        self.shared.switched.load(Ordering::SeqCst)
    }

    /// Leave the fabric for the TCP socket beneath (docs/protocol.md §8a),
    /// and wait until both sides have, this side's resend is written (the
    /// socket is the program's from then on), or `timeout` passes. Whether
    /// the connection is on TCP now.
    pub fn leave_fabric(&self, timeout: Duration) -> bool {
        if !self.shared.make_mine() {
            return false;
        }
        self.shared.lock().leave_fabric();
        self.shared.end_standby();
        let deadline = Instant::now() + timeout;
        let end = self.shared.wait_until(Some(deadline), |d| {
            let s = d.connection().state();
            (*s == State::Switched || matches!(s, State::Aborted(_))).then(|| s.clone())
        });
        end == Some(State::Switched)
    }

    /// The connection's state (why it ended, if it did).
    pub fn state(&self) -> State {
        if self.shared.orphaned() {
            return State::Aborted(crate::conn::AbortReason::LocalReset);
        }
        self.shared.lock().connection().state().clone()
    }

    /// What the connection was waiting for when it timed out, if it did.
    pub fn stalled(&self) -> Option<String> {
        if self.shared.orphaned() {
            return None;
        }
        self.shared.lock().connection().stalled().map(String::from)
    }

    /// What the engine waits for now, in a line (for a caller that finds
    /// it stuck).
    pub fn describe(&self) -> String {
        self.shared.lock().connection().describe_waits()
    }

    /// Pages the connection holds write-protected now.
    pub fn protected_ranges(&self) -> Vec<Range<u64>> {
        if self.shared.orphaned() {
            return Vec::new();
        }
        self.shared.lock().connection().protected_ranges()
    }

    /// Counters, outstanding SRC_AVAILs and the send mode, in one look.
    pub fn snapshot(&self) -> (Counters, usize, TxMode) {
        if self.shared.orphaned() {
            return (Counters::default(), 0, TxMode::Buffered);
        }
        let d = self.shared.lock_to_look();
        let c = d.connection();
        (c.counters().clone(), c.outstanding_avails(), c.tx_mode())
    }

    /// [`ThreadedDriver::snapshot`] if anyone held the driver since the
    /// last one that this returned.
    pub fn snapshot_if_touched(&self) -> Option<(Counters, usize, TxMode)> {
        let t = &self.shared.touched;
        if !t.load(Ordering::Relaxed) || !t.swap(false, Ordering::AcqRel) {
            return None;
        }
        Some(self.snapshot())
    }

    pub fn counters(&self) -> Counters {
        if self.shared.orphaned() {
            return Counters::default();
        }
        self.shared.lock().connection().counters().clone()
    }

    /// `close()` as a program sees it: returns at once (SO_LINGER off, or
    /// `abort` for {on, 0}); the reactor finishes the connection in the
    /// background and lets go once it is finished or `linger` passed.
    /// [`ThreadedDriver::join_closed`] waits for that.
    pub fn close_in_background(&self, abort: bool, linger: Duration) {
        self.shared.holders.closed_here();
        if self.shared.orphaned() {
            // A forked child's copy it never used: the connection is not
            // this process's to end.
            return;
        }
        {
            let mut d = self.shared.lock();
            match self.shared.holders.close(d.fabric().sharing(), abort) {
                Close::Now => self.shared.end_here(&mut d, abort),
                // Frozen by a fork: the child may take it over; if it does
                // not, the reactor reclaims it and ends it here then.
                Close::Deferred => {}
                Close::NotOurs => return,
            }
        }
        *self.shared.closing.lock() = Some(Instant::now() + FORK_GRACE + linger);
        self.shared.waiter.kick();
        // The reactor finishes the close.
        self.shared.end_standby();
    }

    /// After [`ThreadedDriver::close_in_background`]: wait until the
    /// reactor is done with the connection (or `timeout`); whether it is.
    pub fn join_closed(&self, timeout: Duration) -> bool {
        if self.shared.orphaned() {
            return true;
        }
        let deadline = Instant::now() + timeout;
        while Instant::now() < deadline {
            if self.shared.released.load(Ordering::SeqCst)
                || self.shared.stop.load(Ordering::SeqCst)
            {
                return true;
            }
            std::thread::sleep(Duration::from_millis(1));
        }
        false
    }

    /// Is the connection finished (nothing left in flight)?
    pub fn is_finished(&self) -> bool {
        if self.shared.orphaned() {
            return true;
        }
        let d = self.shared.lock();
        let h = &self.shared.holders;
        h.taken(d.fabric().sharing()) || (!h.close_deferred() && d.is_finished())
    }

    /// `close()`, then wait until the connection is finished or `timeout`
    /// passes; stops driving it. Returns whether it finished cleanly.
    pub fn close(self, timeout: Duration) -> (bool, Counters) {
        let (clean, counters, _) = self.close_report(timeout);
        (clean, counters)
    }

    /// [`ThreadedDriver::close`], also returning the final state (why it
    /// was not clean, if it was not).
    pub fn close_report(mut self, timeout: Duration) -> (bool, Counters, State) {
        if self.shared.orphaned() {
            return (false, Counters::default(), self.state());
        }
        self.shared.lock().submit_close();
        let clean = self
            .shared
            .wait_until(Some(Instant::now() + timeout), |d| {
                d.is_finished()
                    .then(|| !matches!(d.connection().state(), State::Aborted(_)))
            })
            .unwrap_or(false);
        let counters = self.counters();
        let state = self.state();
        self.stop();
        (clean, counters, state)
    }

    fn stop(&mut self) {
        self.shared.stop.store(true, Ordering::SeqCst);
        // Its descriptors are watched no more from here (a forked child's
        // copy of the parent's registration is dropped without a word).
        drop(self.shared.registration.lock().take());
    }
}

/// A driver's lock held across `fork()` (fields drop in order: the guard,
/// then the Arc that keeps its mutex alive).
/// A connection parked by [`ThreadedDriver::park`]: its engine as bytes,
/// what the caller made of its endpoint, and the hold that keeps it still.
#[derive(Debug)]
pub struct Parked<'a, F: Fabric + Send + 'static, P: Protector + Send + 'static, T> {
    pub engine: Vec<u8>,
    pub fabric: T,
    pub hold: ParkHold<'a, F, P>,
}

/// A parked connection, kept still (its lock held) until dropped; see
/// [`ThreadedDriver::park`].
pub struct ParkHold<'a, F: Fabric + Send + 'static, P: Protector + Send + 'static> {
    locked: Locked<'a, F, P>,
}

impl<F: Fabric + Send + 'static, P: Protector + Send + 'static> std::fmt::Debug
    for ParkHold<'_, F, P>
{
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("ParkHold")
    }
}

/// The exec did not happen: the connection goes on (receives arm again).
impl<F: Fabric + Send + 'static, P: Protector + Send + 'static> Drop for ParkHold<'_, F, P> {
    fn drop(&mut self) {
        self.locked.pause_arms(false);
    }
}

struct ForkHold<F: Fabric + Send + 'static, P: Protector + Send + 'static> {
    _guard: LockGuard<'static, Driver<F, P>>,
    _shared: Arc<Shared<F, P>>,
}

/// Keeps a thread counted in a call (see [`Shared::enter_call`]).
struct InCall<'a> {
    in_calls: &'a AtomicUsize,
    last_exit: &'a AtomicU64,
    parked_long: &'a AtomicBool,
    registration: &'a Lock<Option<reactor::Registration>>,
    /// One step of a longer wait (see [`Shared::enter_call_step`]).
    step: bool,
}

impl<'a> InCall<'a> {
    fn enter(
        in_calls: &'a AtomicUsize,
        last_exit: &'a AtomicU64,
        parked_long: &'a AtomicBool,
        registration: &'a Lock<Option<reactor::Registration>>,
        step: bool,
    ) -> Self {
        in_calls.fetch_add(1, Ordering::SeqCst);
        InCall {
            in_calls,
            last_exit,
            parked_long,
            registration,
            step,
        }
    }
}

impl Drop for InCall<'_> {
    fn drop(&mut self) {
        self.last_exit
            .store(standby::now_ns().max(1), Ordering::SeqCst);
        self.in_calls.fetch_sub(1, Ordering::SeqCst);
        // The reactor parked the connection for long while this call
        // blocked: it looks again soon (once per long wait, never per
        // quick call), on the grid of first looks, where the ends of other
        // threads' waits share its wake-up (at once, it found the program
        // calling still and parked the connection again, or armed it for
        // the peer's answer to this call, which wakes the caller anyway).
        if !self.step
            && self.parked_long.load(Ordering::SeqCst)
            && self.parked_long.swap(false, Ordering::SeqCst)
            && let Some(r) = self.registration.lock().as_ref()
        {
            r.look_by(standby::first_look(Instant::now()));
        }
    }
}

impl<F: Fabric + Send + 'static, P: Protector + Send + 'static> Serviced for Shared<F, P> {
    /// What a progress thread of the connection's own used to do, once:
    /// stand by while calls drive it, follow a fork's ownership, finish a
    /// background close, turn the engine, then arm the fabric's waiter and
    /// say when to look next.
    fn service(&self, wake: Wake) -> Next {
        let Wake {
            fired,
            woken,
            shared_fired,
            mail,
        } = wake;
        if fired {
            self.rung.fetch_add(1, Ordering::Relaxed);
        }
        // Handed to the fabric by whoever turns the engine next.
        self.keep_mail(mail, shared_fired);
        if self.stop.load(Ordering::SeqCst) || self.orphaned() {
            return Next {
                done: true,
                ..Next::default()
            };
        }
        let now = Instant::now();
        // The application drives the connection now: keep off it (see
        // `standby`), looking again after a nap that doubles. A fault or a
        // kick while no call is in it cuts the standby short.
        let urgent = woken && self.in_calls.load(Ordering::SeqCst) == 0;
        if !urgent
            && (standby::wanted(self.in_calls.load(Ordering::SeqCst), &self.last_exit)
                || standby::looped(&self.loop_at))
        {
            let mut nap = self.standby_nap.lock();
            let longest = if *nap >= standby::LONGEST_NAP && self.park_for_blocked_call() {
                LONGEST_CALL_NAP
            } else {
                standby::LONGEST_NAP
            };
            let at = now + (*nap).min(longest);
            *nap = (*nap * 2).min(longest);
            return Next {
                at: Some(at),
                parked: true,
                ..Next::default()
            };
        }
        self.parked_long.store(false, Ordering::SeqCst);
        *self.standby_nap.lock() = standby::RECENT;
        let Some(d) = self.try_lock() else {
            // Whoever holds it wakes us when it lets go (or, if it let go
            // meanwhile, the second try gets it).
            if urgent {
                self.wanted_urgent.store(true, Ordering::SeqCst);
            }
            self.wanted.store(true, Ordering::SeqCst);
            match self.try_lock() {
                Some(d) => {
                    self.wanted.store(false, Ordering::SeqCst);
                    self.wanted_urgent.store(false, Ordering::SeqCst);
                    return self.service_locked(d, fired, now);
                }
                // The holder wakes us when it lets go (the backstop look
                // is only for what nothing announces).
                None => {
                    return Next {
                        at: Some(now + reactor::IDLE_LOOK),
                        ..Next::default()
                    };
                }
            }
        };
        // A call may have started since the look above: it drives now.
        if self.in_calls.load(Ordering::SeqCst) > 0 {
            drop(d);
            return Next {
                at: Some(now + standby::LONGEST_NAP),
                ..Next::default()
            };
        }
        self.service_locked(d, fired, now)
    }
}

impl<F: Fabric + Send + 'static, P: Protector + Send + 'static> Shared<F, P> {
    /// Is a call blocked in the connection, so that the reactor may look
    /// rarely? Such a call has its own wake-ups, and its end brings the
    /// reactor back (`parked_long`); ten thousand threads blocked in calls
    /// kept the reactor busy at a look every 2 ms each. The flag goes up
    /// before the look at the calls, so that a call ending between the two
    /// sees it.
    fn park_for_blocked_call(&self) -> bool {
        self.parked_long.store(true, Ordering::SeqCst);
        let blocked = self.in_calls.load(Ordering::SeqCst) > 0;
        if !blocked {
            self.parked_long.store(false, Ordering::SeqCst);
        }
        blocked
    }

    fn keep_mail(&self, mail: Vec<reactor::Mail>, shared_fired: bool) {
        if mail.is_empty() && !shared_fired {
            return;
        }
        if !mail.is_empty() {
            self.mail.lock().extend(mail);
        }
        if shared_fired {
            self.suspect.store(true, Ordering::SeqCst);
        }
        self.news.store(true, Ordering::SeqCst);
        // A caller asleep in a call takes it at once.
        self.waiter.kick();
    }

    /// Once a second, look at the TCP socket beneath for bytes written
    /// around the shim (see [`Driver::check_stream`]).
    fn look_at_stream(&self, d: &mut Driver<F, P>) {
        let at = standby::now_ns();
        if at.saturating_sub(self.stream_looked.load(Ordering::Relaxed)) >= STREAM_LOOK_NS {
            self.stream_looked.store(at, Ordering::Relaxed);
            d.check_stream();
        }
    }

    fn service_locked(&self, mut d: Locked<'_, F, P>, fired: bool, now: Instant) -> Next {
        self.take_news(&mut d);
        if let Some(reg) = self.registration.lock().as_ref() {
            self.watch_peer_exit(&d, reg);
        }
        match self.holders.for_reactor(d.fabric().sharing(), fork_clock) {
            ForReactor::Run => {}
            // A forked child took the connection: this copy is done.
            ForReactor::Gone => {
                self.stop.store(true, Ordering::SeqCst);
                self.released.store(true, Ordering::SeqCst);
                return Next {
                    done: true,
                    ..Next::default()
                };
            }
            // Frozen by a fork: wait for a claim (after the grace, the
            // reactor takes it back: the child did not want it).
            ForReactor::Wait => {
                return Next {
                    at: Some(now + FROZEN_LOOK),
                    ..Next::default()
                };
            }
        }
        if let Some(mb) = self.holders.family_to_watch()
            && let Some(reg) = self.registration.lock().as_ref()
            && let Err(e) = reg.watch_family(mb.family().bell())
        {
            crate::protect::log_once(&format!("reactor: {e}"));
        }
        self.look_at_stream(&mut d);
        if let Some(abort) = self.holders.take_deferred_close() {
            // Reclaimed after the fork's grace: a child that holds the
            // descriptor but has not called yet (a busy host) carries on.
            self.end_here(&mut d, abort);
        }
        let closing = *self.closing.lock();
        let mut fired = fired;
        // A fabric that keeps saying "ready" gets a few turns, then a timer.
        for _ in 0..4 {
            self.turn_all(&mut d, 0);
            if let Some(deadline) = closing
                && (d.is_finished() || Instant::now() >= deadline)
            {
                if !d.is_finished() {
                    d.abort();
                }
                // The peer learns at once that this side is done.
                d.fabric().finish();
                if !d.fabric().sharing().has_left() && self.holders.shared_by_fork() {
                    // Guests must not wait for a runner that let go.
                    let how = Shared::ending_for_guests(&d).unwrap_or(delegation::Ending::Reset);
                    self.holders.end_for_guests(how);
                }
                self.stop.store(true, Ordering::SeqCst);
                self.released.store(true, Ordering::SeqCst);
                return Next {
                    done: true,
                    ..Next::default()
                };
            }
            let armed = if d.peer_left() {
                // Nothing more comes from the fabric: timers only.
                Armed::Deaf
            } else {
                // A sleeping loop's bell, or (no loop, or one that looks
                // but is busy) the process's.
                let bell = if self.loop_at.load(Ordering::SeqCst) == 0 {
                    self.loop_bell.load(Ordering::Relaxed)
                } else {
                    0
                };
                d.fabric_mut().ring_at(bell);
                d.fabric_mut().arm(std::mem::take(&mut fired))
            };
            if armed == Armed::Ready {
                continue;
            }
            let mut at = now
                + d.next_timeout()
                    .unwrap_or(reactor::IDLE_LOOK)
                    .min(reactor::IDLE_LOOK);
            if let Some(deadline) = closing {
                at = at.min(deadline);
            }
            return Next {
                at: Some(at),
                watch: armed == Armed::Sleep,
                ..Next::default()
            };
        }
        Next {
            at: Some(Instant::now() + Duration::from_millis(1)),
            ..Next::default()
        }
    }
}

impl<F: Fabric + Send + 'static, P: Protector + Send + 'static> Participant for Shared<F, P> {
    fn holds(&self, range: &Range<u64>) -> bool {
        !self.orphaned() && self.lock().connection().holds_memory(range)
    }

    fn evacuate(&self, range: Range<u64>) {
        if self.orphaned() {
            return;
        }
        let ticket = self.lock().submit_evacuate(range);
        self.wait_until(None, |d| d.resumed(ticket).then_some(()));
    }

    fn forget(&self, range: Range<u64>) {
        if !self.orphaned() {
            self.lock().forget_memory(range);
        }
    }

    fn hold_for_fork(self: Arc<Self>) -> Box<dyn std::any::Any> {
        if self.orphaned() {
            return Box::new(());
        }
        let guard = self.driver.lock();
        self.holders
            .freeze_for_fork(guard.fabric().sharing(), fork_clock());
        // SAFETY: the guard borrows `self.driver`; the Arc stored next to it
        // keeps that alive, and `ForkHold` drops the guard first (field
        // order), so the borrow never outlives the mutex.
        let guard: LockGuard<'static, Driver<F, P>> = unsafe { std::mem::transmute(guard) };
        Box::new(ForkHold {
            _guard: guard,
            _shared: self,
        })
    }

    fn set_forking(&self, forking: bool) {
        if !self.orphaned() {
            self.lock().pause_arms(forking);
        }
    }

    fn forked_holder(&self, pid: u32) {
        self.holders.forked_holder(pid);
    }
}

/// The clock of [`ForkOwnership`]'s grace: the monotonic clock.
fn fork_clock() -> Timestamp {
    Timestamp::from_nanos(crate::monotonic::now_ns())
}

impl<F: Fabric + Send + 'static, P: Protector + Send + 'static> Drop for ThreadedDriver<F, P> {
    fn drop(&mut self) {
        self.stop();
    }
}

/// The engine operations a runner serves its guests with.
impl<F: Fabric, P: Protector> delegation::Engine for Driver<F, P> {
    fn submit_send(&mut self, addr: u64, len: u64, flags: SendFlags) -> CallId {
        Driver::submit_send(self, addr, len, flags)
    }
    fn submit_recv(&mut self, addr: u64, len: u64, flags: RecvFlags) -> CallId {
        Driver::submit_recv(self, addr, len, flags)
    }
    fn cancel(&mut self, call: CallId) {
        Driver::cancel(self, call);
    }
    fn take_result(&mut self, call: CallId) -> Option<Result<u64, CallError>> {
        Driver::take_result(self, call)
    }
    fn shutdown(&mut self, how: Shutdown) {
        Driver::shutdown(self, how);
    }
    fn take_error(&mut self) -> Option<CallError> {
        Driver::take_error(self)
    }
    fn readiness(&self) -> Readiness {
        self.connection().readiness()
    }
    fn readable_bytes(&self) -> u64 {
        self.connection().readable_bytes()
    }
    fn holds_memory(&self, range: &Range<u64>) -> bool {
        self.connection().holds_memory(range)
    }
    fn switched(&self) -> bool {
        *self.connection().state() == State::Switched
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A call is counted while its guard lives, and only a whole call's end
    /// (not one step of a wait) takes back a long park of the reactor.
    #[test]
    fn a_call_counts_until_it_ends_and_only_a_whole_call_ends_a_long_park() {
        let (calls, exit, parked) = (
            AtomicUsize::new(0),
            AtomicU64::new(0),
            AtomicBool::new(true),
        );
        let reg = Lock::new(None);
        for step in [true, false] {
            let call = InCall::enter(&calls, &exit, &parked, &reg, step);
            assert_eq!(calls.load(Ordering::SeqCst), 1, "counted while it runs");
            drop(call);
            assert_eq!(calls.load(Ordering::SeqCst), 0, "not counted after");
            assert_ne!(exit.load(Ordering::SeqCst), 0, "its end is the last exit");
            assert_eq!(
                parked.load(Ordering::SeqCst),
                step,
                "a step leaves the park"
            );
        }
    }
}
