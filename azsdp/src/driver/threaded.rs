//! A [`Driver`] shared by the application's threads, a progress thread and
//! a fault thread.
//!
//! A thread that faults on a protected page is stopped in the kernel until
//! someone resolves the fault, so it cannot run the engine itself. Here the
//! fault thread reads faults from the userfaultfd and hands them to the
//! engine; the progress thread polls the fabric and runs timers; application
//! threads submit calls and wait on a condition variable. All engine work
//! happens under one mutex, which no thread holds while it may fault (the
//! engine never touches pages it has protected).

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Condvar, Mutex, MutexGuard};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use super::{Driver, Protector};
use crate::conn::{Access, CallError, CallId, Counters, RecvFlags, SendFlags};
use crate::fabric::Fabric;
use crate::protect::uffd::FaultReader;

struct Shared<F: Fabric, P: Protector> {
    driver: Mutex<Driver<F, P>>,
    changed: Condvar,
    stop: AtomicBool,
}

impl<F: Fabric, P: Protector> Shared<F, P> {
    fn lock(&self) -> MutexGuard<'_, Driver<F, P>> {
        // A panic elsewhere must not wedge the connection: keep going.
        self.driver.lock().unwrap_or_else(|e| e.into_inner())
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
    /// Start the progress thread (which sleeps with `wait` between polls)
    /// and, given a fault reader, the fault thread.
    pub fn start(
        driver: Driver<F, P>,
        wait: impl Fn(Duration) + Send + 'static,
        faults: Option<FaultReader>,
    ) -> Self {
        let shared = Arc::new(Shared {
            driver: Mutex::new(driver),
            changed: Condvar::new(),
            stop: AtomicBool::new(false),
        });
        let mut threads = Vec::new();
        let s = Arc::clone(&shared);
        threads.push(
            std::thread::Builder::new()
                .name("azsdp-progress".into())
                .spawn(move || {
                    while !s.stop.load(Ordering::Relaxed) {
                        let nap = {
                            let mut d = s.lock();
                            d.turn();
                            d.next_timeout().unwrap_or(Duration::from_millis(1))
                        };
                        s.changed.notify_all();
                        wait(nap.min(Duration::from_millis(1)));
                    }
                })
                .expect("spawn progress thread"),
        );
        if let Some(reader) = faults {
            let s = Arc::clone(&shared);
            threads.push(
                std::thread::Builder::new()
                    .name("azsdp-faults".into())
                    .spawn(move || {
                        while !s.stop.load(Ordering::Relaxed) {
                            let Some(f) = reader.next_timeout(Duration::from_millis(20)) else {
                                continue;
                            };
                            let access = if f.write { Access::Write } else { Access::Read };
                            s.lock().submit_fault(f.addr, access);
                            s.changed.notify_all();
                        }
                    })
                    .expect("spawn fault thread"),
            );
        }
        ThreadedDriver { shared, threads }
    }

    /// Wait until `ready` finds what it looks for, turning the engine while
    /// waiting (synchronous fabric completions, e.g. a GET this very thread
    /// just did, are delivered by the next turn).
    fn wait_until<T>(&self, mut ready: impl FnMut(&mut Driver<F, P>) -> Option<T>) -> T {
        let mut d = self.shared.lock();
        loop {
            if let Some(r) = ready(&mut d) {
                return r;
            }
            d.turn();
            if let Some(r) = ready(&mut d) {
                return r;
            }
            d = self
                .shared
                .changed
                .wait_timeout(d, Duration::from_millis(1))
                .unwrap_or_else(|e| e.into_inner())
                .0;
        }
    }

    fn wait_for(&self, call: CallId) -> Result<u64, CallError> {
        self.wait_until(|d| d.take_result(call))
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
        self.wait_until(|d| d.resumed(ticket).then_some(()));
    }

    /// `range` was unmapped: drop the protector's state for it.
    pub fn unmapped(&self, range: std::ops::Range<u64>) {
        self.shared.lock().forget_memory(range);
    }

    pub fn counters(&self) -> Counters {
        self.shared.lock().connection().counters().clone()
    }

    /// `close()`, then wait until the connection is finished or `timeout`
    /// passes; stops the threads. Returns whether it finished cleanly.
    pub fn close(mut self, timeout: Duration) -> (bool, Counters) {
        self.shared.lock().submit_close();
        let deadline = Instant::now() + timeout;
        let clean = loop {
            let d = self.shared.lock();
            let c = d.connection();
            if c.is_finished() {
                break !matches!(c.state(), crate::conn::State::Aborted(_));
            }
            if Instant::now() >= deadline {
                break false;
            }
            drop(
                self.shared
                    .changed
                    .wait_timeout(d, Duration::from_millis(5))
                    .unwrap_or_else(|e| e.into_inner()),
            );
        };
        let counters = self.counters();
        self.stop();
        (clean, counters)
    }

    fn stop(&mut self) {
        self.shared.stop.store(true, Ordering::Relaxed);
        for t in self.threads.drain(..) {
            let _ = t.join();
        }
    }
}

impl<F: Fabric + Send + 'static, P: Protector + Send + 'static> Drop for ThreadedDriver<F, P> {
    fn drop(&mut self) {
        self.stop();
    }
}
