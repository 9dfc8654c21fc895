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

pub mod host;
pub mod memory;
pub mod rng;
pub mod scenario;
mod world;

use std::time::Duration;

pub use host::Trace;
pub use scenario::{Fork, Injection, Scenario};

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
    /// Engines parked by an exec and taken up by the new image, and execs
    /// whose engine did not park in time (it moved onto TCP instead).
    pub parked: u64,
    pub park_fallbacks: u64,
    /// The connection began on TCP and both sides' sending directions
    /// joined the fabric.
    pub joined: bool,
    /// What a fork that handed a side to a child came to.
    pub fork: ForkOutcome,
}

/// What forks that hand a side to a child came to (counts, so that a
/// batch can add them up).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct ForkOutcome {
    /// The process forked (everything in flight settled first).
    pub forked: u64,
    /// The child's first call claimed the side and adopted it.
    pub adopted: u64,
    /// Nobody claimed it within the grace: the parent took it back.
    pub taken_back: u64,
    /// The stream moved onto TCP for the child (the parent closed its
    /// copy while it ran the side, or the child asked to share it).
    pub moved_for_child: u64,
    /// The parent died while it ran the side for the child (its heir).
    pub heirs: u64,
    /// ... and the peer moved the stream onto TCP for the heir (nothing
    /// was lost with the parent).
    pub heirs_carried_on: u64,
    /// A child that adopted the side exec'd, and its new image took the
    /// parked engine up.
    pub child_execs: u64,
}

impl ForkOutcome {
    fn add(&mut self, o: &ForkOutcome) {
        self.forked += o.forked;
        self.adopted += o.adopted;
        self.taken_back += o.taken_back;
        self.moved_for_child += o.moved_for_child;
        self.heirs += o.heirs;
        self.heirs_carried_on += o.heirs_carried_on;
        self.child_execs += o.child_execs;
    }
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

/// What a batch of seeds did, for coverage checks and the demo's summary.
#[derive(Debug, Default)]
pub struct BatchSummary {
    pub seeds: u64,
    pub failures: Vec<SimReport>,
    /// Counters of both sides of every seed, added up.
    pub totals: Counters,
    /// Seeds whose scenario injected a failure.
    pub injected: u64,
    /// Seeds that ended with at least one side aborted.
    pub aborted: u64,
    /// Seeds whose connection left the fabric for TCP (both sides).
    pub switched: u64,
    /// Seeds whose connection began on TCP and joined the fabric (both
    /// sides' sending directions).
    pub joined: u64,
    /// Engines parked across an exec, and execs that moved onto TCP.
    pub parked: u64,
    pub park_fallbacks: u64,
    pub forks: ForkOutcome,
}

fn add(total: &mut Counters, c: &Counters) {
    let Counters {
        bytes_sent_bsdp,
        bytes_sent_async,
        bytes_sent_sync,
        sends,
        data_msgs_sent,
        avails_sent,
        updates_sent,
        cancels_sent,
        bytes_unread_by_peer,
        bytes_recv_bsdp,
        bytes_recv_zcopy,
        bytes_recv_ahead,
        ahead_switches,
        recvs,
        gets,
        get_bytes,
        armed_recvs,
        armed_bytes,
        armed_lost_bytes,
        send_faults,
        recv_faults,
        spurious_faults,
        cow_attempts,
        cow_copies,
        cow_bytes,
        cow_lost,
        block_escalations,
        fallbacks,
        recoveries,
        prepare_failures,
        arm_failures,
        fallback_reason: _,
        copied,
        copied_memory: _,
        msgs_sent,
        msgs_received,
        credits_returned,
        tcp_sent_before_join,
        tcp_received_before_join,
    } = c;
    total.bytes_sent_bsdp += bytes_sent_bsdp;
    for (t, n) in total.copied.iter_mut().zip(copied) {
        *t += n;
    }
    total.bytes_sent_async += bytes_sent_async;
    total.bytes_sent_sync += bytes_sent_sync;
    total.sends += sends;
    total.data_msgs_sent += data_msgs_sent;
    total.avails_sent += avails_sent;
    total.updates_sent += updates_sent;
    total.cancels_sent += cancels_sent;
    total.bytes_unread_by_peer += bytes_unread_by_peer;
    total.bytes_recv_bsdp += bytes_recv_bsdp;
    total.bytes_recv_zcopy += bytes_recv_zcopy;
    total.bytes_recv_ahead += bytes_recv_ahead;
    total.ahead_switches += ahead_switches;
    total.recvs += recvs;
    total.gets += gets;
    total.get_bytes += get_bytes;
    total.armed_recvs += armed_recvs;
    total.armed_bytes += armed_bytes;
    total.armed_lost_bytes += armed_lost_bytes;
    total.send_faults += send_faults;
    total.recv_faults += recv_faults;
    total.spurious_faults += spurious_faults;
    total.cow_attempts += cow_attempts;
    total.cow_copies += cow_copies;
    total.cow_bytes += cow_bytes;
    total.cow_lost += cow_lost;
    total.block_escalations += block_escalations;
    total.fallbacks += fallbacks;
    total.recoveries += recoveries;
    total.prepare_failures += prepare_failures;
    total.arm_failures += arm_failures;
    total.msgs_sent += msgs_sent;
    total.msgs_received += msgs_received;
    total.credits_returned += credits_returned;
    total.tcp_sent_before_join += tcp_sent_before_join;
    total.tcp_received_before_join += tcp_received_before_join;
}

/// Run seeds `first..first+count` on `threads` threads.
pub fn run_seeds(first: u64, count: u64, threads: usize) -> BatchSummary {
    use std::sync::atomic::{AtomicU64, Ordering};
    let next = AtomicU64::new(first);
    let mut summary = BatchSummary {
        seeds: count,
        ..BatchSummary::default()
    };
    // Each thread sums its own seeds; the parts are added at the end.
    let parts: Vec<BatchSummary> = std::thread::scope(|s| {
        let workers: Vec<_> = (0..threads.max(1))
            .map(|_| {
                s.spawn(|| {
                    let mut sum = BatchSummary::default();
                    loop {
                        let seed = next.fetch_add(1, Ordering::Relaxed);
                        if seed >= first + count {
                            return sum;
                        }
                        let r = run_seed(seed, false);
                        add(&mut sum.totals, &r.counters[0]);
                        add(&mut sum.totals, &r.counters[1]);
                        sum.injected += u64::from(r.scenario.injection.is_fatal());
                        sum.aborted +=
                            u64::from(r.states.iter().any(|s| matches!(s, State::Aborted(_))));
                        sum.switched += u64::from(r.states.iter().all(|s| *s == State::Switched));
                        sum.parked += r.parked;
                        sum.joined += u64::from(r.joined);
                        sum.park_fallbacks += r.park_fallbacks;
                        sum.forks.add(&r.fork);
                        if !r.passed() {
                            sum.failures.push(r);
                        }
                    }
                })
            })
            .collect();
        workers
            .into_iter()
            .map(|w| w.join().unwrap_or_else(|p| std::panic::resume_unwind(p)))
            .collect()
    });
    for p in parts {
        add(&mut summary.totals, &p.totals);
        summary.injected += p.injected;
        summary.aborted += p.aborted;
        summary.switched += p.switched;
        summary.parked += p.parked;
        summary.joined += p.joined;
        summary.park_fallbacks += p.park_fallbacks;
        summary.forks.add(&p.forks);
        summary.failures.extend(p.failures);
    }
    let mut sum = summary;
    sum.failures.sort_by_key(|r| r.seed);
    sum
}
