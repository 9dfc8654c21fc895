//! `Once` that survives `fork()`.
//!
//! A `std::sync::Once` caught mid-initialisation by a fork in another thread
//! stays "running" forever in the child, whose first caller then waits for
//! a thread that does not exist there. That hung a forked test child
//! (waiting in the atfork handlers' registration) once in a few hundred
//! runs. Here the state names the process that runs the initialisation: a
//! child that inherits someone else's run takes it over.

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
                init();
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
}
