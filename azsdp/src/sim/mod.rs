//! Deterministic simulation of two AZ-SDP endpoints.
//!
//! [`run_seed`] builds a random [`Scenario`] from a seed (settings, fabric
//! timing, application behaviour, injected failures), runs it in simulated
//! time over the [`crate::fabric::sim`] fabric, and checks the invariants:
//!
//! - the receiver gets exactly the sender's byte stream (a prefix of it when a
//!   failure was injected), and no write the sender made after `send()`
//!   returned reaches it;
//! - the engine never touches a page it protected, never protects a page
//!   twice or unprotects one it did not protect;
//! - no page stays protected or armed, and no registration leaks, once the
//!   connection is over;
//! - every blocked call and every faulting access ends;
//! - the counters agree with what the application and the fabric saw.
//!
//! The same seed replays the same run exactly.

pub mod memory;
pub mod rng;
pub mod scenario;
mod world;

use std::time::Duration;

pub use scenario::{Injection, Scenario};

use crate::conn::{Counters, State};

/// The outcome of one seed.
#[derive(Debug)]
pub struct SimReport {
    pub seed: u64,
    pub violations: Vec<String>,
    pub counters: [Counters; 2],
    pub states: [State; 2],
    pub sim_time: Duration,
    pub events: u64,
    /// Message-level trace (only with `verbose`).
    pub trace: Vec<String>,
    pub scenario: Scenario,
}

impl SimReport {
    pub fn passed(&self) -> bool {
        self.violations.is_empty()
    }
}

/// Run one seed.
pub fn run_seed(seed: u64, verbose: bool) -> SimReport {
    world::World::new(Scenario::from_seed(seed), verbose).run()
}

/// Run seeds `first..first+count` on `threads` threads; failing reports only.
pub fn run_seeds(first: u64, count: u64, threads: usize) -> (u64, Vec<SimReport>) {
    use std::sync::Mutex;
    use std::sync::atomic::{AtomicU64, Ordering};
    let next = AtomicU64::new(first);
    let failures = Mutex::new(Vec::new());
    std::thread::scope(|s| {
        for _ in 0..threads.max(1) {
            s.spawn(|| {
                loop {
                    let seed = next.fetch_add(1, Ordering::Relaxed);
                    if seed >= first + count {
                        break;
                    }
                    let r = run_seed(seed, false);
                    if !r.passed() {
                        failures.lock().unwrap_or_else(|e| e.into_inner()).push(r);
                    }
                }
            });
        }
    });
    let mut f = failures.into_inner().unwrap_or_else(|e| e.into_inner());
    f.sort_by_key(|r| r.seed);
    (count, f)
}
