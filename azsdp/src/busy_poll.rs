//! When busy-polling pays, and for how long.
//!
//! A thread that expects an answer within microseconds spins on shared
//! memory instead of sleeping: the peer then posts without a system call
//! and nobody is woken. That pays only while the peer has a CPU of its own
//! (a spinner on a contended host takes the CPU the peer needs), and only
//! while answers do come that fast ([`Budget`]).

use std::sync::atomic::Ordering;
use std::time::Duration;

/// Does busy-polling before a sleep pay now? Not when more threads are
/// runnable than there are CPUs: a spinner then takes the CPU the thread it
/// waits for needs (four clients and a server ping-ponging on two cores
/// waited 3x longer than on TCP). Looked up in `/proc/loadavg` at most
/// every few milliseconds, process-wide.
pub fn spinning_pays() -> bool {
    use std::sync::atomic::{AtomicBool, AtomicU64};
    static CHECKED_AT: AtomicU64 = AtomicU64::new(0);
    static PAYS: AtomicBool = AtomicBool::new(true);
    const EVERY_NS: u64 = 5_000_000;
    let now = crate::monotonic::now_ns().max(1);
    let at = CHECKED_AT.load(Ordering::Relaxed);
    if at != 0 && now.saturating_sub(at) < EVERY_NS {
        return PAYS.load(Ordering::Relaxed);
    }
    if CHECKED_AT
        .compare_exchange(at, now, Ordering::Relaxed, Ordering::Relaxed)
        .is_err()
    {
        return PAYS.load(Ordering::Relaxed);
    }
    // The CPU count, asked once (it reads cgroup files); 0: not yet.
    static CPUS: std::sync::atomic::AtomicUsize = std::sync::atomic::AtomicUsize::new(0);
    let cpus = match CPUS.load(Ordering::Relaxed) {
        0 => {
            let n = std::thread::available_parallelism().map_or(1, |n| n.get());
            CPUS.store(n, Ordering::Relaxed);
            n
        }
        n => n,
    };
    // "0.50 0.40 0.30 RUNNABLE/TOTAL LASTPID"
    let runnable = std::fs::read_to_string("/proc/loadavg").ok().and_then(|l| {
        l.split_whitespace()
            .nth(3)?
            .split('/')
            .next()?
            .parse::<usize>()
            .ok()
    });
    let pays = runnable.is_none_or(|r| r <= cpus);
    PAYS.store(pays, Ordering::Relaxed);
    pays
}

/// How long one waiter spins before it sleeps, adapted to what its spins
/// found: one that found work keeps the whole budget, one that found
/// nothing halves it (down to none, so an idle waiter stops spinning), and
/// a sleep that ended soon after it began (an answer the spin would have
/// caught, or nearly) gives the whole budget back.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Budget {
    now: Duration,
    most: Duration,
}

impl Budget {
    pub const fn new(most: Duration) -> Budget {
        Budget { now: most, most }
    }

    /// The spin to make now (none while spinning does not pay).
    pub fn spin(&self) -> Duration {
        if self.now.is_zero() || !spinning_pays() {
            return Duration::ZERO;
        }
        self.now
    }

    /// The budget as adapted so far, whatever the host's load.
    pub fn current(&self) -> Duration {
        self.now
    }

    /// A spin found work.
    pub fn found(&mut self) {
        self.now = self.most;
    }

    /// A spin found nothing.
    pub fn missed(&mut self) {
        self.now /= 2;
        if self.now < self.most / 16 {
            self.now = Duration::ZERO;
        }
    }

    /// A sleep ended after `slept` with work to do.
    pub fn woke(&mut self, slept: Duration) {
        if slept <= self.most * 50 {
            self.now = self.most;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_budget_halves_to_nothing_when_idle_and_comes_back_with_quick_work() {
        let most = Duration::from_micros(32);
        let mut b = Budget::new(most);
        assert_eq!(b.current(), most);
        b.missed();
        assert_eq!(b.current(), most / 2);
        for _ in 0..4 {
            b.missed();
        }
        assert_eq!(b.current(), Duration::ZERO, "idle: no spin at all");
        b.woke(Duration::from_millis(50));
        assert_eq!(
            b.current(),
            Duration::ZERO,
            "a long sleep: spinning would not have paid"
        );
        b.woke(Duration::from_micros(40));
        assert_eq!(b.current(), most, "an answer soon after the spin gave up");
        b.missed();
        b.found();
        assert_eq!(b.current(), most);
    }
}
