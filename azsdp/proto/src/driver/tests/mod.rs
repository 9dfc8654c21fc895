//! The real driver, two of them, over the simulated fabric, in the
//! quinn-proto style: a [`Pair`] that runs whatever is due and then steps
//! simulated time to the next thing that happens (a message, a completion,
//! or one of the engines' timers). Timers that take seconds on a real
//! clock (keepalive, peer timeout, linger, block-on-write escalation) are
//! tested here in microseconds of wall time (`timers`), and so is each of
//! the engine's paths, one behaviour at a time (`paths`); the simulator
//! covers their random interleavings.

mod fork;
mod join;
mod park;
mod paths;
mod switch;
mod timers;

use std::cell::RefCell;
use std::ops::Range;
use std::rc::Rc;
use std::time::Duration;

use super::*;
use crate::conn::{AbortReason, Counters, FaultPolicy, LockRegion, Role, Shutdown};
use crate::fabric::sim::{SimEndpoint, SimFabric, SimFabricParams};
use crate::sim::host::{
    ProtectLog, SharedTcp, SimClock, SimHost, SimProtector, Trace, Unprotectables,
};
use crate::sim::memory::{Prot, SharedMems, SimMemory};
use crate::sim::rng::Rng;
use crate::sim::scenario::Injection;

const PAGE: u64 = 4096;
/// Where the tests' buffers are.
const BUF: u64 = 0x10_0000;
/// Where the receiving side's buffers are.
const DST: u64 = 0x80_0000;

type SimDriver = Driver<SimEndpoint, SimProtector, SimHost>;

/// A blocking send from memory the driver may write-protect (AZ-SDP).
const PROTECTABLE: SendFlags = SendFlags {
    nonblocking: false,
    protectable: true,
    unprotectable: None,
};

fn cfg(role: Role) -> EngineConfig {
    let region = LockRegion {
        addr: 0,
        key: 0,
        slots: 0,
    };
    let mut c = EngineConfig::new(role, Capabilities::ALL, region);
    c.page_size = PAGE as u32;
    c.zcopy_threshold = 8192;
    c
}

struct Pair {
    clock: SimClock,
    fabric: Rc<RefCell<SimFabric>>,
    mems: SharedMems,
    d: [SimDriver; 2],
    logs: [Rc<RefCell<ProtectLog>>; 2],
    /// What each side's host calls unprotectable.
    unprotectable: [Unprotectables; 2],
    /// How often each side's driver asked its host whether memory may be
    /// protected.
    asked: [Rc<std::cell::Cell<u64>>; 2],
    /// The TCP connection beneath.
    tcp: SharedTcp,
    /// Sides whose driver does not run (a process stopped by SIGSTOP or a
    /// debugger: alive, silent).
    stopped: [bool; 2],
}

/// Messages take 1 µs, operations 2 µs (plus 4 µs per 16 KiB a GET
/// moves), and a death is noticed by the fabric only after an hour (so
/// timers go first) and with how far the dead side's calls had got.
fn fabric_params() -> SimFabricParams {
    SimFabricParams {
        msg_latency: (1_000, 1_000),
        op_latency: (2_000, 2_000),
        death_detect: Duration::from_secs(3600),
        p_departure_unknown: 0.0,
        ..SimFabricParams::default()
    }
}

impl Pair {
    /// Two connected drivers over [`fabric_params`].
    fn new(c0: EngineConfig, c1: EngineConfig) -> Pair {
        Pair::with_fabric(fabric_params(), c0, c1)
    }

    /// Two connected drivers over a fabric of `params`.
    fn with_fabric(params: SimFabricParams, c0: EngineConfig, c1: EngineConfig) -> Pair {
        let clock = SimClock::default();
        let mems: SharedMems = Rc::new(RefCell::new([SimMemory::new(PAGE), SimMemory::new(PAGE)]));
        let trace = Trace::new(false, clock.clone());
        let fabric = SimFabric::new(1, params, Rc::clone(&mems), trace, Injection::None).shared();
        let mut rng = Rng::new(7);
        let tcp = SharedTcp::default();
        let mut logs = Vec::new();
        let mut hosts = Vec::new();
        let mut mk = |s: usize, c: EngineConfig| {
            let p = SimProtector::new(s, Rc::clone(&mems), rng.fork(), 0.0);
            logs.push(Rc::clone(&p.log));
            let host = SimHost::new(s, Rc::clone(&mems), clock.clone(), Rc::clone(&tcp));
            hosts.push((Rc::clone(&host.unprotectable), Rc::clone(&host.asked)));
            Driver::with_host(c, SimEndpoint::new(Rc::clone(&fabric), s), p, host)
        };
        let d = [mk(0, c0), mk(1, c1)];
        let logs = [Rc::clone(&logs[0]), Rc::clone(&logs[1])];
        let unprotectable = [Rc::clone(&hosts[0].0), Rc::clone(&hosts[1].0)];
        let asked = [Rc::clone(&hosts[0].1), Rc::clone(&hosts[1].1)];
        let mut p = Pair {
            clock,
            fabric,
            mems,
            d,
            logs,
            unprotectable,
            asked,
            tcp,
            stopped: [false; 2],
        };
        // (A listener begun on TCP answers once it allows the join.)
        p.d[1].allow_join();
        p.run_for(Duration::from_millis(1));
        assert_eq!(*p.d[0].connection().state(), State::Established);
        assert_eq!(*p.d[1].connection().state(), State::Established);
        p
    }

    fn now(&self) -> Timestamp {
        self.clock.now()
    }

    /// Run everything due now, until nothing more is.
    fn settle(&mut self) {
        self.fabric.borrow_mut().advance(self.now());
        loop {
            let mut n = 0;
            for (d, stopped) in self.d.iter_mut().zip(self.stopped) {
                if !stopped {
                    n += d.turn();
                }
            }
            self.fabric.borrow_mut().advance(self.now());
            if n == 0 {
                return;
            }
        }
    }

    /// Step to the next message, completion or timer; false if nothing is
    /// scheduled before `limit`.
    fn step(&mut self, limit: Timestamp) -> bool {
        self.settle();
        let deadline = |s: usize| {
            if self.stopped[s] {
                None
            } else {
                self.d[s].next_deadline()
            }
        };
        let next = [
            self.fabric.borrow().next_event_time(),
            deadline(0),
            deadline(1),
        ]
        .into_iter()
        .flatten()
        .min();
        match next {
            Some(t) if t <= limit => {
                self.clock.set(t.max(self.now()));
                self.settle();
                true
            }
            _ => false,
        }
    }

    /// Step for `d` of simulated time.
    fn run_for(&mut self, d: Duration) {
        let limit = self.now() + d;
        while self.step(limit) {}
        self.clock.set(limit);
        self.settle();
    }

    /// Step until `done` holds; panics after `d` of simulated time.
    fn run_until(&mut self, d: Duration, mut done: impl FnMut(&mut Pair) -> bool) {
        let limit = self.now() + d;
        while !done(self) {
            assert!(self.step(limit), "nothing happened by {limit:?}");
        }
    }

    /// Step until `call` of side `s` is done; its result.
    fn wait(&mut self, s: usize, call: CallId) -> Result<u64, CallError> {
        self.wait_within(s, call, Duration::from_secs(1))
    }

    /// Step until `call` of side `s` is done; its result. Panics after `d`
    /// of simulated time.
    fn wait_within(&mut self, s: usize, call: CallId, d: Duration) -> Result<u64, CallError> {
        let mut got = None;
        self.run_until(d, |p| {
            got = got.or_else(|| p.d[s].take_result(call));
            got.is_some()
        });
        got.expect("run_until returned")
    }

    /// Run for a millisecond, then the result of `call` of side `s`, if
    /// it is done.
    fn poll(&mut self, s: usize, call: CallId) -> Option<Result<u64, CallError>> {
        self.run_for(Duration::from_millis(1));
        self.d[s].take_result(call)
    }

    /// A blocking send the driver may protect.
    fn send(&mut self, s: usize, addr: u64, len: u64) -> CallId {
        self.d[s].submit_send(addr, len, PROTECTABLE)
    }

    /// `len` bytes of pattern `seed` written at [`BUF`] of side `s` and
    /// sent (blocking, protectable); the call and the bytes.
    fn send_pattern(&mut self, s: usize, len: usize, seed: u8) -> (CallId, Vec<u8>) {
        let data = pattern(len, seed);
        self.write(s, BUF, &data);
        (self.send(s, BUF, len as u64), data)
    }

    /// A blocking receive.
    fn recv(&mut self, s: usize, addr: u64, len: u64) -> CallId {
        self.d[s].submit_recv(addr, len, RecvFlags::default())
    }

    /// A blocking receive of exactly `len` bytes.
    fn recv_all(&mut self, s: usize, addr: u64, len: u64) -> CallId {
        let flags = RecvFlags {
            waitall: true,
            ..RecvFlags::default()
        };
        self.d[s].submit_recv(addr, len, flags)
    }

    /// Side `s`'s pages in protection state `prot`, as whole ranges.
    fn pages(&self, s: usize, prot: Prot) -> Vec<Range<u64>> {
        let mut out: Vec<Range<u64>> = Vec::new();
        for (a, p) in self.mems.borrow()[s].protected_pages() {
            if p != prot {
                continue;
            }
            match out.last_mut() {
                Some(r) if r.end == a => r.end = a + PAGE,
                _ => out.push(a..a + PAGE),
            }
        }
        out
    }

    /// Has side `s`'s protector woken a thread faulting on `addr`'s page?
    fn woken(&self, s: usize, addr: u64) -> bool {
        self.logs[s]
            .borrow()
            .woken
            .iter()
            .any(|r| r.contains(&addr))
    }

    fn counters(&self, s: usize) -> &Counters {
        self.d[s].connection().counters()
    }

    fn write(&mut self, side: usize, addr: u64, bytes: &[u8]) {
        self.mems.borrow_mut()[side].write_raw(addr, bytes);
    }

    fn read(&mut self, side: usize, addr: u64, len: usize) -> Vec<u8> {
        let mut v = vec![0; len];
        self.mems.borrow_mut()[side].read_raw(addr, &mut v);
        v
    }
}

fn pattern(len: usize, salt: u8) -> Vec<u8> {
    (0..len)
        .map(|i| (i as u8).wrapping_mul(31) ^ salt)
        .collect()
}
