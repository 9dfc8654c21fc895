//! A [`Driver`] shared by the application's threads, a progress thread and
//! a fault thread.
//!
//! A thread that faults on a protected page is stopped in the kernel until
//! someone resolves the fault, so it cannot run the engine itself. Here the
//! fault thread reads faults from the userfaultfd and hands them to the
//! engine. All engine work happens under one mutex, which no thread holds
//! while it may fault (the engine never touches pages it has protected) or
//! while it sleeps.
//!
//! Waiting: whoever waits for the fabric turns the engine itself when it
//! wakes. An application thread blocked in a call sleeps on the fabric (one
//! wake-up from the peer's message to the thread that needs it, which is
//! what latency wants), and the progress thread steps aside while one does
//! (it only `try_lock`s). When a thread turns the engine and delivers events
//! that may concern other blocked threads, it kicks the waiter so they look.
//! The progress thread keeps things moving when no call is blocked: the
//! GET_COMPLETEs that unprotect an AZ-SDP sender's pages, credits, timers.

use crate::sync::{Lock, LockGuard};
use std::ops::Range;
use std::sync::atomic::{AtomicBool, AtomicU32, AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Weak};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use super::{Driver, Protector, standby};
use crate::conn::{
    Access, CallError, CallId, Counters, Readiness, RecvFlags, SendFlags, Shutdown, State, TxMode,
};
use crate::fabric::{Fabric, FabricWaiter, Ownership};
use crate::process::{self, HeldBounds, Inside, Participant};
use crate::protect::FaultSource;

/// Longest sleep of a caller's thread between looks (bounds how long a
/// blocked call takes to see its peer die without a word).
const MAX_NAP: Duration = Duration::from_millis(20);
/// Longest sleep of an idle progress thread: it wakes for messages, kicks
/// and timers anyway; this bounds how late a connection nobody is calling
/// on sees its peer die silently (and tells poll/epoll waiters). Short
/// naps for a thousand idle connections were fifty thousand wake-ups a
/// second.
const IDLE_NAP: Duration = Duration::from_millis(200);
/// Longest sleep of a fault thread whose source can be woken to stop.
const FAULT_NAP: Duration = Duration::from_secs(5);

struct Shared<F: Fabric, P: Protector> {
    driver: Lock<Driver<F, P>>,
    waiter: Box<dyn FabricWaiter>,
    stop: AtomicBool,
    /// Application threads blocked in a call (sleeping on the fabric).
    in_calls: AtomicUsize,
    /// When the last call ended ([`standby::now_ns`]; 0: none yet).
    last_exit: AtomicU64,
    /// The process that runs the threads; in a forked child this driver is
    /// the parent's copy, inert until the child adopts it.
    owner: AtomicU32,
    threads: Lock<Vec<JoinHandle<()>>>,
    /// Makes a protector for a forked child that adopts the connection
    /// (the parent's is bound to the parent's memory).
    refresh: Lock<Option<Refresh<P>>>,
    /// When a fork froze the connection (see [`Fabric::ownership`]).
    frozen_since: Lock<Option<Instant>>,
    /// `close()` came while the connection was frozen: done once claimed.
    close_pending: Lock<Option<bool>>,
    this: Weak<Shared<F, P>>,
    /// Told whenever a turn delivered something (readiness may have changed).
    notify: Option<Notify>,
    /// Where the connection holds pages (for the memory hooks).
    held: Arc<HeldBounds>,
    /// `close()` was called: the progress thread ends once the connection
    /// is finished or this deadline passes.
    closing: Lock<Option<Instant>>,
    /// Wakes the fault thread's wait, to stop it.
    fault_stopper: Lock<Option<Box<dyn Fn() + Send + Sync>>>,
}

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

/// How long after a fork a connection waits for one of the processes to
/// claim it before the one that made it takes it back.
const FORK_GRACE: Duration = Duration::from_secs(1);

/// Makes the protection of a forked child that adopts a connection.
pub type Refresh<P> = Box<dyn Fn() -> (P, Option<Box<dyn FaultSource>>) + Send + Sync>;

/// Called after the engine took in something from the fabric, a fault or a
/// timer: whoever waits for readiness (poll, epoll) should look again.
pub type Notify = Arc<dyn Fn() + Send + Sync>;

/// The driver, locked, with the thread marked as inside azsdp (so memory
/// hooks let its own frees pass instead of asking this very driver).
struct Locked<'a, F: Fabric, P: Protector> {
    guard: LockGuard<'a, Driver<F, P>>,
    held: &'a HeldBounds,
    waiter: &'a dyn FabricWaiter,
    _inside: Inside,
}

impl<F: Fabric, P: Protector> Drop for Locked<'_, F, P> {
    fn drop(&mut self) {
        // Publish where pages are held for the memory hooks' lock-free look.
        self.held.set(self.guard.connection().held_bounds());
        // Completions this thread's actions produced but did not deliver
        // would wake nobody (they are not messages): whoever waits, look.
        if self.guard.fabric().completions_pending() {
            self.waiter.kick();
        }
    }
}

impl<F: Fabric, P: Protector> std::ops::Deref for Locked<'_, F, P> {
    type Target = Driver<F, P>;
    fn deref(&self) -> &Driver<F, P> {
        &self.guard
    }
}

impl<F: Fabric, P: Protector> std::ops::DerefMut for Locked<'_, F, P> {
    fn deref_mut(&mut self) -> &mut Driver<F, P> {
        &mut self.guard
    }
}

impl<F: Fabric + Send + 'static, P: Protector + Send + 'static> Shared<F, P> {
    fn lock(&self) -> Locked<'_, F, P> {
        let _inside = Inside::enter();
        // A panic elsewhere must not wedge the connection: keep going.
        let guard = self.driver.lock();
        Locked {
            guard,
            held: &self.held,
            waiter: self.waiter.as_ref(),
            _inside,
        }
    }

    fn try_lock(&self) -> Option<Locked<'_, F, P>> {
        let _inside = Inside::enter();
        let guard = self.driver.try_lock()?;
        Some(Locked {
            guard,
            held: &self.held,
            waiter: self.waiter.as_ref(),
            _inside,
        })
    }

    /// In a forked child, before adopting: the threads are the parent's.
    fn orphaned(&self) -> bool {
        crate::process::pid() != self.owner.load(Ordering::SeqCst)
    }

    /// May this process use the connection? A connection a fork froze is
    /// claimed here (and adopted, with threads of its own, by a child);
    /// false if the other process has it.
    fn make_mine(&self) -> bool {
        // Only a fork freezes a connection (and marks it so, here and in
        // the child's copy): otherwise it is ours without asking the fabric.
        if !self.orphaned() && !self.frozen() {
            return true;
        }
        let own = self.lock().fabric().ownership();
        match own {
            Ownership::Mine => !self.orphaned(),
            Ownership::Other => false,
            Ownership::Unclaimed => {
                if self.orphaned() && self.refresh.lock().is_none() {
                    return false;
                }
                if !self.lock().fabric().claim() {
                    return false;
                }
                *self.frozen_since.lock() = None;
                if self.orphaned() {
                    self.adopt();
                }
                true
            }
        }
    }

    /// A forked child took the connection: fresh protection, the calls of
    /// the parent's threads dropped, threads of its own.
    fn adopt(&self) {
        let Some(me) = self.this.upgrade() else {
            return;
        };
        let fresh = self.refresh.lock().as_ref().map(|f| f());
        let faults = {
            let mut d = self.lock();
            d.forget_calls();
            match fresh {
                Some((p, faults)) => {
                    d.replace_protector(p);
                    faults
                }
                None => None,
            }
        };
        self.owner.store(crate::process::pid(), Ordering::SeqCst);
        self.in_calls.store(0, Ordering::SeqCst);
        self.stop.store(false, Ordering::SeqCst);
        let mut threads = self.threads.lock();
        // The parent's threads do not exist here: nothing to join or detach.
        for t in threads.drain(..) {
            std::mem::forget(t);
        }
        *threads = spawn_threads(&me, faults);
    }

    /// Wait until `ready` finds what it looks for, or `deadline` passes;
    /// this thread turns the engine while it waits. `None` also when this
    /// is a forked child's inert copy.
    fn wait_until<T>(
        &self,
        deadline: Option<Instant>,
        mut ready: impl FnMut(&mut Driver<F, P>) -> Option<T>,
    ) -> Option<T> {
        if !self.make_mine() {
            return None;
        }
        self.in_calls.fetch_add(1, Ordering::SeqCst);
        let r = loop {
            if self.frozen() && !self.make_mine() {
                break None;
            }
            let ticket = self.waiter.prepare();
            let nap = {
                let mut d = self.lock();
                if let Some(r) = ready(&mut d) {
                    break Some(r);
                }
                if self.turn_all(&mut d, 1) > 0 {
                    if let Some(r) = ready(&mut d) {
                        break Some(r);
                    }
                    continue;
                }
                let now = Instant::now();
                if deadline.is_some_and(|t| t <= now) {
                    break None;
                }
                let mut nap = d.next_timeout().unwrap_or(MAX_NAP).min(MAX_NAP);
                if let Some(t) = deadline {
                    nap = nap.min(t - now);
                }
                nap
            };
            self.waiter.wait(ticket, nap, true);
        };
        self.last_exit
            .store(standby::now_ns().max(1), Ordering::SeqCst);
        self.in_calls.fetch_sub(1, Ordering::SeqCst);
        r
    }

    /// The progress thread is needed now, though calls ran a moment ago:
    /// off standby (see [`standby`]) until the next call.
    fn end_standby(&self) {
        self.last_exit.store(0, Ordering::SeqCst);
        standby::end();
    }

    /// Wake the fault thread so that it sees `stop`.
    fn stop_faults(&self) {
        if let Some(f) = self.fault_stopper.lock().as_ref() {
            f();
        }
    }

    /// Has a fork frozen the connection (and no one claimed it yet)?
    fn frozen(&self) -> bool {
        self.frozen_since.lock().is_some()
    }

    /// Turn until nothing more arrives; kick sleeping callers if anything
    /// did and `others` of them may be waiting for it.
    fn turn_all(&self, d: &mut Driver<F, P>, others: usize) -> usize {
        let before = d.connection().readiness();
        let mut total = 0;
        loop {
            let n = d.turn();
            total += n;
            if n == 0 {
                break;
            }
        }
        if total > 0 && self.in_calls.load(Ordering::SeqCst) > others {
            self.waiter.kick();
        }
        // Timers change readiness too (a peer that timed out).
        if total > 0 || d.connection().readiness() != before {
            if let Some(n) = &self.notify {
                n();
            }
        }
        total
    }
}

/// The threads and the shared driver. Dropping it stops the threads.
pub struct ThreadedDriver<F: Fabric + Send + 'static, P: Protector + Send + 'static> {
    shared: Arc<Shared<F, P>>,
}

impl<F: Fabric + Send + 'static, P: Protector + Send + 'static> std::fmt::Debug
    for ThreadedDriver<F, P>
{
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ThreadedDriver")
            .field("owner", &self.shared.owner.load(Ordering::Relaxed))
            .finish()
    }
}

impl<F: Fabric + Send + 'static, P: Protector + Send + 'static> ThreadedDriver<F, P> {
    /// Start the progress thread (which sleeps on `waiter` between turns)
    /// and, given a fault reader, the fault thread.
    pub fn start(
        driver: Driver<F, P>,
        waiter: impl FabricWaiter + 'static,
        faults: Option<Box<dyn FaultSource>>,
    ) -> Self {
        Self::start_with_notify(driver, waiter, faults, None)
    }

    /// [`ThreadedDriver::start`], calling `notify` whenever readiness may
    /// have changed.
    pub fn start_with_notify(
        driver: Driver<F, P>,
        waiter: impl FabricWaiter + 'static,
        faults: Option<Box<dyn FaultSource>>,
        notify: Option<Notify>,
    ) -> Self {
        let shared = Arc::new_cyclic(|this| Shared {
            driver: Lock::new(driver),
            waiter: Box::new(waiter),
            stop: AtomicBool::new(false),
            in_calls: AtomicUsize::new(0),
            last_exit: AtomicU64::new(0),
            owner: AtomicU32::new(crate::process::pid()),
            threads: Lock::new(Vec::new()),
            refresh: Lock::new(None),
            frozen_since: Lock::new(None),
            close_pending: Lock::new(None),
            this: this.clone(),
            notify,
            held: Arc::new(HeldBounds::default()),
            closing: Lock::new(None),
            fault_stopper: Lock::new(None),
        });
        let weak: Weak<dyn Participant> = Arc::downgrade(&shared) as Weak<dyn Participant>;
        process::register(weak, Arc::clone(&shared.held));
        *shared.threads.lock() = spawn_threads(&shared, faults);
        ThreadedDriver { shared }
    }

    /// How a forked child that adopts this connection protects its pages
    /// (without it, a child cannot adopt the connection).
    pub fn set_fork_protection(&self, refresh: Refresh<P>) {
        *self.shared.refresh.lock() = Some(refresh);
    }

    /// Does this process run the connection now (without claiming it)?
    pub fn is_mine(&self) -> bool {
        !self.shared.orphaned() && self.shared.lock().fabric().ownership() == Ownership::Mine
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
    fn wait_bounded(&self, call: CallId, limits: &CallLimits<'_>) -> Result<u64, CallError> {
        let mut cut: Option<CallError> = None;
        let r = self.shared.wait_until(None, |d| {
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
            (Some(Err(CallError::Interrupted)), Some(why)) => Err(why),
            (Some(r), _) => r,
            (None, _) => Err(CallError::ConnReset),
        }
    }

    /// `send()` that a deadline or a signal may cut short.
    pub fn send_bounded(
        &self,
        buf: &[u8],
        flags: SendFlags,
        limits: &CallLimits<'_>,
    ) -> Result<u64, CallError> {
        if !self.shared.make_mine() {
            return Err(CallError::ConnReset);
        }
        let call = self
            .shared
            .lock()
            .submit_send(buf.as_ptr() as u64, buf.len() as u64, flags);
        self.wait_bounded(call, limits)
    }

    /// `recv()` that a deadline or a signal may cut short.
    pub fn recv_bounded(
        &self,
        buf: &mut [u8],
        flags: RecvFlags,
        limits: &CallLimits<'_>,
    ) -> Result<u64, CallError> {
        if !self.shared.make_mine() {
            return Err(CallError::ConnReset);
        }
        let call = self
            .shared
            .lock()
            .submit_recv(buf.as_mut_ptr() as u64, buf.len() as u64, flags);
        self.wait_bounded(call, limits)
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
        if !self.shared.make_mine() {
            return Readiness {
                readable: true,
                writable: true,
                read_hangup: true,
                hangup: true,
                error: true,
                arrived: 0,
                drained: 0,
            };
        }
        let mut d = self.shared.lock();
        self.shared.turn_all(&mut d, 0);
        d.connection().readiness()
    }

    /// `SO_ERROR`: the pending error, once (see `Connection::take_error`);
    /// a forked child's inert copy has ECONNRESET.
    pub fn take_error(&self) -> Option<CallError> {
        if !self.shared.make_mine() {
            return Some(CallError::ConnReset);
        }
        let mut d = self.shared.lock();
        self.shared.turn_all(&mut d, 0);
        d.take_error()
    }

    /// Bytes a `recv()` could take without waiting (FIONREAD).
    pub fn readable_bytes(&self) -> u64 {
        if !self.shared.make_mine() {
            return 0;
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
        }
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
        let d = self.shared.lock();
        let c = d.connection();
        (c.counters().clone(), c.outstanding_avails(), c.tx_mode())
    }

    pub fn counters(&self) -> Counters {
        if self.shared.orphaned() {
            return Counters::default();
        }
        self.shared.lock().connection().counters().clone()
    }

    /// `close()` as a program sees it: returns at once (SO_LINGER off, or
    /// `abort` for {on, 0}); the progress thread finishes the connection in
    /// the background and ends once it is finished or `linger` passed.
    /// [`ThreadedDriver::join_closed`] waits for that.
    pub fn close_in_background(&self, abort: bool, linger: Duration) {
        if self.shared.orphaned() {
            // A forked child's copy it never used: the connection is not
            // this process's to end.
            return;
        }
        {
            let mut d = self.shared.lock();
            match d.fabric().ownership() {
                Ownership::Mine => {
                    if abort {
                        d.abort();
                    } else {
                        d.submit_close();
                    }
                }
                // Frozen by a fork: the child may take it over; if it does
                // not, the progress thread reclaims and closes it.
                Ownership::Unclaimed => {
                    *self.shared.close_pending.lock() = Some(abort);
                }
                Ownership::Other => return,
            }
        }
        *self.shared.closing.lock() = Some(Instant::now() + FORK_GRACE + linger);
        self.shared.waiter.kick();
        // The progress thread finishes the close.
        self.shared.end_standby();
    }

    /// After [`ThreadedDriver::close_in_background`]: wait until the
    /// progress thread is done (or `timeout`); whether it finished.
    pub fn join_closed(&self, timeout: Duration) -> bool {
        if self.shared.orphaned() {
            return true;
        }
        let deadline = Instant::now() + timeout;
        while Instant::now() < deadline {
            let done = self.shared.threads.lock().iter().all(|t| t.is_finished());
            if done || self.shared.stop.load(Ordering::SeqCst) {
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
        let pending = self.shared.close_pending.lock().is_some();
        match d.fabric().ownership() {
            Ownership::Other => true,
            _ => !pending && d.is_finished(),
        }
    }

    /// `close()`, then wait until the connection is finished or `timeout`
    /// passes; stops the threads. Returns whether it finished cleanly.
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
        let threads = std::mem::take(&mut *self.shared.threads.lock());
        if self.shared.orphaned() {
            // The threads are the parent's; nothing here to stop or join.
            threads.into_iter().for_each(std::mem::forget);
            return;
        }
        self.shared.stop.store(true, Ordering::Relaxed);
        self.shared.waiter.kick();
        self.shared.stop_faults();
        standby::end();
        if crate::sync::held_here() > 0 {
            // Joining here could wait on a thread that a fork barrier
            // holds back until this one lets go: they end on their own.
            return;
        }
        for t in threads {
            let _ = t.join();
        }
    }
}

/// A driver's lock held across `fork()` (fields drop in order: the guard,
/// then the Arc that keeps its mutex alive).
struct ForkHold<F: Fabric + Send + 'static, P: Protector + Send + 'static> {
    _guard: LockGuard<'static, Driver<F, P>>,
    _shared: Arc<Shared<F, P>>,
}

/// The progress thread and, given a fault reader, the fault thread.
fn spawn_threads<F: Fabric + Send + 'static, P: Protector + Send + 'static>(
    shared: &Arc<Shared<F, P>>,
    faults: Option<Box<dyn FaultSource>>,
) -> Vec<JoinHandle<()>> {
    let mut threads = Vec::new();
    let s = Arc::clone(shared);
    match crate::threads::spawn("azsdp-progress", move || progress(&s)) {
        Ok(t) => threads.push(t),
        Err(e) => crate::protect::log_once(&format!("no progress thread: {e}")),
    }
    if let Some(reader) = faults {
        let s = Arc::clone(shared);
        let stopper = reader.stopper();
        let nap = if stopper.is_some() {
            FAULT_NAP
        } else {
            MAX_NAP
        };
        *shared.fault_stopper.lock() = stopper;
        let r = crate::threads::spawn("azsdp-faults", move || {
            while !s.stop.load(Ordering::Relaxed) {
                let Some(f) = reader.next_timeout(nap) else {
                    continue;
                };
                let access = if f.write { Access::Write } else { Access::Read };
                let mut d = s.lock();
                // Completions already in the ring may have
                // settled the page: deliver them first.
                s.turn_all(&mut d, 0);
                d.submit_fault(f.addr, access);
                // What the fault started may have completed at once
                // (a compare-and-swap on shared memory): deliver it
                // here, no other thread would be woken for it.
                s.turn_all(&mut d, 0);
                drop(d);
                if let Some(n) = &s.notify {
                    n();
                }
                if s.in_calls.load(Ordering::SeqCst) > 0 {
                    s.waiter.kick();
                } else {
                    // The writer waits in its fault, not in a call: the
                    // progress thread must watch for the completion
                    // that releases it.
                    s.end_standby();
                }
            }
        });
        match r {
            Ok(t) => threads.push(t),
            Err(e) => crate::protect::log_once(&format!("no fault thread: {e}")),
        }
    }
    threads
}

/// The progress thread: turn, then sleep on the fabric until something
/// comes or a timer is due. While a caller is blocked it only turns when
/// the lock is free (that caller turns for itself).
fn progress<F: Fabric + Send + 'static, P: Protector + Send + 'static>(s: &Shared<F, P>) {
    let wanted = || standby::wanted(s.in_calls.load(Ordering::SeqCst), &s.last_exit);
    let mut nap = standby::RECENT;
    while !s.stop.load(Ordering::Relaxed) {
        // The application drives the connection now: keep off the ring
        // (see `standby`), looking again after a nap that doubles.
        if wanted() {
            standby::park(nap, wanted);
            nap = (nap * 2).min(standby::LONGEST_NAP);
            continue;
        }
        nap = standby::RECENT;
        let ticket = s.waiter.prepare();
        let guard = if s.in_calls.load(Ordering::SeqCst) > 0 {
            s.try_lock()
        } else {
            Some(s.lock())
        };
        let Some(mut d) = guard else {
            // A caller holds the lock and reads the ring itself: sleep until
            // something new arrives, not while what it is reading is there.
            s.waiter.sleep(ticket, MAX_NAP);
            continue;
        };
        match d.fabric().ownership() {
            Ownership::Mine => {}
            // A forked child took the connection: this copy is done.
            Ownership::Other => {
                s.stop.store(true, Ordering::SeqCst);
                break;
            }
            // Frozen by a fork: wait for a claim; after the grace, take it
            // back (the child did not want it).
            Ownership::Unclaimed => {
                let since = *s.frozen_since.lock().get_or_insert_with(Instant::now);
                if since.elapsed() < FORK_GRACE || !d.fabric().claim() {
                    drop(d);
                    std::thread::sleep(MAX_NAP);
                    continue;
                }
                *s.frozen_since.lock() = None;
            }
        }
        if let Some(abort) = s.close_pending.lock().take() {
            if abort {
                d.abort();
            } else {
                d.submit_close();
            }
        }
        let closing = *s.closing.lock();
        if let Some(deadline) = closing {
            if d.is_finished() || Instant::now() >= deadline {
                if !d.is_finished() {
                    d.abort();
                }
                // The peer learns at once that this side is done.
                d.fabric().finish();
                drop(d);
                // The fault thread ends with it.
                s.stop.store(true, Ordering::SeqCst);
                s.stop_faults();
                break;
            }
        }
        if s.turn_all(&mut d, 0) > 0 {
            continue;
        }
        let mut nap = d.next_timeout().unwrap_or(IDLE_NAP).min(IDLE_NAP);
        if let Some(deadline) = closing {
            nap = nap.min(deadline.saturating_duration_since(Instant::now()));
        }
        drop(d);
        s.waiter.wait(ticket, nap, false);
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
        guard.fabric().freeze();
        *self.frozen_since.lock() = Some(Instant::now());
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
}

impl<F: Fabric + Send + 'static, P: Protector + Send + 'static> Drop for ThreadedDriver<F, P> {
    fn drop(&mut self) {
        self.stop();
    }
}
