//! `Once` that survives `fork()`.
//!
//! A `std::sync::Once` caught mid-initialisation by a fork in another thread
//! stays "running" forever in the child, whose first caller then waits for
//! a thread that does not exist there. That hung a forked test child
//! (waiting in the atfork handlers' registration) once in a few hundred
//! runs. Here the state names the process that runs the initialisation: a
//! child that inherits someone else's run takes it over.

use std::cell::UnsafeCell;
use std::sync::atomic::{AtomicU64, Ordering};

const RUNNING: u64 = 1;
const DONE: u64 = 2;

/// Runs its initialisation once per process lineage (a child inherits a
/// finished one, and redoes one the fork interrupted).
#[derive(Debug)]
pub struct ForkOnce {
    /// `pid << 2 | phase` (0: never started).
    state: AtomicU64,
}

impl ForkOnce {
    pub const fn new() -> ForkOnce {
        ForkOnce {
            state: AtomicU64::new(0),
        }
    }

    /// Run `init` unless it ran (or another thread of this process runs it
    /// now: then wait for it).
    pub fn call(&self, init: impl FnOnce()) {
        // Done is the common case, asked on every hooked call: it needs no
        // `getpid` (a child inherits "done" as it is).
        if self.state.load(Ordering::Acquire) & 3 == DONE {
            return;
        }
        let me = u64::from(crate::process::raw_pid());
        loop {
            let s = self.state.load(Ordering::Acquire);
            if s & 3 == DONE {
                return;
            }
            if s & 3 == RUNNING && s >> 2 == me {
                std::thread::yield_now();
                continue;
            }
            // Never started, or started by a process that forked us.
            if self
                .state
                .compare_exchange(s, me << 2 | RUNNING, Ordering::AcqRel, Ordering::Acquire)
                .is_ok()
            {
                // A panicking `init` (caught at the FFI boundary) leaves it
                // to be tried again, not "running" for ever.
                struct Retry<'a>(&'a AtomicU64);
                impl Drop for Retry<'_> {
                    fn drop(&mut self) {
                        self.0.store(0, Ordering::Release);
                    }
                }
                let retry = Retry(&self.state);
                init();
                std::mem::forget(retry);
                self.state.store(me << 2 | DONE, Ordering::Release);
                return;
            }
        }
    }

    /// Mark it done for the calling process (a fork handler whose running
    /// proves the initialisation took effect).
    pub fn mark_done(&self) {
        let me = u64::from(crate::process::raw_pid());
        self.state.store(me << 2 | DONE, Ordering::Release);
    }
}

impl Default for ForkOnce {
    fn default() -> Self {
        Self::new()
    }
}

/// A value made once per process lineage, as [`ForkOnce`] runs: unlike a
/// `OnceLock`, a child whose fork caught another thread making it makes it
/// itself instead of waiting for a thread that does not exist there.
pub struct ForkOnceCell<T> {
    once: ForkOnce,
    value: UnsafeCell<Option<T>>,
}

// SAFETY: the value is written only inside `once.call` (one runner per
// process at a time, and never again once done) and read only after it.
unsafe impl<T: Send + Sync> Sync for ForkOnceCell<T> {}

impl<T> ForkOnceCell<T> {
    pub const fn new() -> ForkOnceCell<T> {
        ForkOnceCell {
            once: ForkOnce::new(),
            value: UnsafeCell::new(None),
        }
    }

    /// The value, made by `make` if this process lineage has none yet.
    pub fn get_or_init(&self, make: impl FnOnce() -> T) -> &T {
        // SAFETY: only the one runner of `call` writes, before any reader
        // can pass `call` (which returns once the run is done).
        self.once
            .call(|| unsafe { *self.value.get() = Some(make()) });
        // SAFETY: `call` returned, so the value was written and is never
        // written again in this process.
        unsafe { (*self.value.get()).as_ref().expect("made by call") }
    }
}

impl<T> Default for ForkOnceCell<T> {
    fn default() -> Self {
        Self::new()
    }
}

impl<T> std::fmt::Debug for ForkOnceCell<T> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ForkOnceCell").finish_non_exhaustive()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::atomic::AtomicUsize;

    #[test]
    fn runs_once_across_threads() {
        static ONCE: ForkOnce = ForkOnce::new();
        static RUNS: AtomicUsize = AtomicUsize::new(0);
        let hs: Vec<_> = (0..8)
            .map(|_| std::thread::spawn(|| ONCE.call(|| _ = RUNS.fetch_add(1, Ordering::SeqCst))))
            .collect();
        hs.into_iter().for_each(|h| h.join().unwrap());
        assert_eq!(RUNS.load(Ordering::SeqCst), 1);
    }

    #[test]
    fn a_run_inherited_from_another_process_is_taken_over() {
        let once = ForkOnce::new();
        // As a child sees it: running, in the parent (another pid).
        once.state.store(
            (u64::from(crate::process::raw_pid()) + 1) << 2 | RUNNING,
            Ordering::SeqCst,
        );
        let mut ran = false;
        once.call(|| ran = true);
        assert!(ran);
        let mut again = false;
        once.call(|| again = true);
        assert!(!again);
    }

    #[test]
    fn a_panicking_initialisation_is_tried_again() {
        let cell: ForkOnceCell<u32> = ForkOnceCell::new();
        let r = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
            cell.get_or_init(|| panic!("first try fails"));
        }));
        assert!(r.is_err());
        assert_eq!(*cell.get_or_init(|| 7), 7);
        assert_eq!(*cell.get_or_init(|| 8), 7);
    }
}
