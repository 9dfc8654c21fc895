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

use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use super::{Driver, Protector};
use crate::conn::{Access, CallError, CallId, Counters, RecvFlags, SendFlags, State};
use crate::fabric::{Fabric, FabricWaiter};
use crate::protect::uffd::FaultReader;

/// Longest sleep of any thread between looks (bounds shutdown latency).
const MAX_NAP: Duration = Duration::from_millis(20);

struct Shared<F: Fabric, P: Protector> {
    driver: Mutex<Driver<F, P>>,
    waiter: Box<dyn FabricWaiter>,
    stop: AtomicBool,
    /// Application threads blocked in a call (sleeping on the fabric).
    in_calls: AtomicUsize,
}

impl<F: Fabric, P: Protector> Shared<F, P> {
    fn lock(&self) -> MutexGuard<'_, Driver<F, P>> {
        // A panic elsewhere must not wedge the connection: keep going.
        self.driver.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Turn until nothing more arrives; kick sleeping callers if anything
    /// did and `others` of them may be waiting for it.
    fn turn_all(&self, d: &mut Driver<F, P>, others: usize) -> usize {
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
        total
    }
}

/// The threads and the shared driver. Dropping it stops the threads.
pub struct ThreadedDriver<F: Fabric + Send + 'static, P: Protector + Send + 'static> {
    shared: Arc<Shared<F, P>>,
    threads: Vec<JoinHandle<()>>,
}

impl<F: Fabric + Send + 'static, P: Protector + Send + 'static> std::fmt::Debug
    for ThreadedDriver<F, P>
{
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ThreadedDriver")
            .field("threads", &self.threads.len())
            .finish()
    }
}

impl<F: Fabric + Send + 'static, P: Protector + Send + 'static> ThreadedDriver<F, P> {
    /// Start the progress thread (which sleeps on `waiter` between turns)
    /// and, given a fault reader, the fault thread.
    pub fn start(
        driver: Driver<F, P>,
        waiter: impl FabricWaiter + 'static,
        faults: Option<FaultReader>,
    ) -> Self {
        let shared = Arc::new(Shared {
            driver: Mutex::new(driver),
            waiter: Box::new(waiter),
            stop: AtomicBool::new(false),
            in_calls: AtomicUsize::new(0),
        });
        let mut threads = Vec::new();
        let s = Arc::clone(&shared);
        threads.push(
            std::thread::Builder::new()
                .name("azsdp-progress".into())
                .spawn(move || progress(&s))
                .expect("spawn progress thread"),
        );
        if let Some(reader) = faults {
            let s = Arc::clone(&shared);
            threads.push(
                std::thread::Builder::new()
                    .name("azsdp-faults".into())
                    .spawn(move || {
                        while !s.stop.load(Ordering::Relaxed) {
                            let Some(f) = reader.next_timeout(MAX_NAP) else {
                                continue;
                            };
                            let access = if f.write { Access::Write } else { Access::Read };
                            s.lock().submit_fault(f.addr, access);
                            if s.in_calls.load(Ordering::SeqCst) > 0 {
                                s.waiter.kick();
                            }
                        }
                    })
                    .expect("spawn fault thread"),
            );
        }
        ThreadedDriver { shared, threads }
    }

    /// Wait until `ready` finds what it looks for, or `deadline` passes;
    /// this thread turns the engine while it waits.
    fn wait_until<T>(
        &self,
        deadline: Option<Instant>,
        mut ready: impl FnMut(&mut Driver<F, P>) -> Option<T>,
    ) -> Option<T> {
        let s = &*self.shared;
        s.in_calls.fetch_add(1, Ordering::SeqCst);
        let r = loop {
            let ticket = s.waiter.prepare();
            let nap = {
                let mut d = s.lock();
                if let Some(r) = ready(&mut d) {
                    break Some(r);
                }
                if s.turn_all(&mut d, 1) > 0 {
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
            s.waiter.wait(ticket, nap, true);
        };
        s.in_calls.fetch_sub(1, Ordering::SeqCst);
        r
    }

    fn wait_for(&self, call: CallId) -> Result<u64, CallError> {
        self.wait_until(None, |d| d.take_result(call))
            .expect("no deadline")
    }

    /// Blocking `send()`; returns when the engine says the buffer is
    /// reusable (at once under AZ-SDP).
    pub fn send(&self, buf: &[u8], flags: SendFlags) -> Result<u64, CallError> {
        let call = self
            .shared
            .lock()
            .submit_send(buf.as_ptr() as u64, buf.len() as u64, flags);
        self.wait_for(call)
    }

    /// Blocking `recv()`.
    pub fn recv(&self, buf: &mut [u8], flags: RecvFlags) -> Result<u64, CallError> {
        let call = self
            .shared
            .lock()
            .submit_recv(buf.as_mut_ptr() as u64, buf.len() as u64, flags);
        self.wait_for(call)
    }

    /// Before memory is freed, unmapped or discarded: wait until no
    /// transfer uses `range` any more (copied aside, or finished).
    pub fn evacuate(&self, range: std::ops::Range<u64>) {
        let ticket = self.shared.lock().submit_evacuate(range);
        self.wait_until(None, |d| d.resumed(ticket).then_some(()));
    }

    /// `range` was unmapped: drop the protector's state for it.
    pub fn unmapped(&self, range: std::ops::Range<u64>) {
        self.shared.lock().forget_memory(range);
    }

    /// The connection's state (why it ended, if it did).
    pub fn state(&self) -> State {
        self.shared.lock().connection().state().clone()
    }

    pub fn counters(&self) -> Counters {
        self.shared.lock().connection().counters().clone()
    }

    /// `close()`, then wait until the connection is finished or `timeout`
    /// passes; stops the threads. Returns whether it finished cleanly.
    pub fn close(mut self, timeout: Duration) -> (bool, Counters) {
        self.shared.lock().submit_close();
        let clean = self
            .wait_until(Some(Instant::now() + timeout), |d| {
                let c = d.connection();
                c.is_finished()
                    .then(|| !matches!(c.state(), State::Aborted(_)))
            })
            .unwrap_or(false);
        let counters = self.counters();
        self.stop();
        (clean, counters)
    }

    fn stop(&mut self) {
        self.shared.stop.store(true, Ordering::Relaxed);
        self.shared.waiter.kick();
        for t in self.threads.drain(..) {
            let _ = t.join();
        }
    }
}

/// The progress thread: turn, then sleep on the fabric until something
/// comes or a timer is due. While a caller is blocked it only turns when
/// the lock is free (that caller turns for itself).
fn progress<F: Fabric, P: Protector>(s: &Shared<F, P>) {
    while !s.stop.load(Ordering::Relaxed) {
        let ticket = s.waiter.prepare();
        let guard = if s.in_calls.load(Ordering::SeqCst) > 0 {
            match s.driver.try_lock() {
                Ok(g) => Some(g),
                Err(std::sync::TryLockError::Poisoned(e)) => Some(e.into_inner()),
                Err(std::sync::TryLockError::WouldBlock) => None,
            }
        } else {
            Some(s.lock())
        };
        let nap = match guard {
            Some(mut d) => {
                if s.turn_all(&mut d, 0) > 0 {
                    continue;
                }
                d.next_timeout().unwrap_or(MAX_NAP).min(MAX_NAP)
            }
            None => MAX_NAP,
        };
        s.waiter.wait(ticket, nap, false);
    }
}

impl<F: Fabric + Send + 'static, P: Protector + Send + 'static> Drop for ThreadedDriver<F, P> {
    fn drop(&mut self) {
        self.stop();
    }
}
