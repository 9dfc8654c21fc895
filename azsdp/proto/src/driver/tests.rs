//! The real driver, two of them, over the simulated fabric, in the
//! quinn-proto style: a [`Pair`] that runs whatever is due and then steps
//! simulated time to the next thing that happens (a message, a completion,
//! or one of the engines' timers). Timers that take seconds on a real
//! clock (keepalive, peer timeout, linger, block-on-write escalation) are
//! tested here in microseconds of wall time.

use std::cell::RefCell;
use std::rc::Rc;
use std::time::Duration;

use super::*;
use crate::conn::{AbortReason, FaultPolicy, LockRegion, Role, Shutdown};
use crate::fabric::sim::{SimEndpoint, SimFabric, SimFabricParams};
use crate::sim::host::{ProtectLog, SimClock, SimHost, SimProtector, Trace};
use crate::sim::memory::{SharedMems, SimMemory};
use crate::sim::rng::Rng;
use crate::sim::scenario::Injection;

const PAGE: u64 = 4096;
/// Where the tests' buffers are.
const BUF: u64 = 0x10_0000;

type SimDriver = Driver<SimEndpoint, SimProtector, SimHost>;

/// A blocking send from memory the driver may write-protect (AZ-SDP).
const PROTECTABLE: SendFlags = SendFlags {
    nonblocking: false,
    protectable: true,
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
}

impl Pair {
    /// Two connected drivers: messages take 1 µs, operations 2 µs.
    fn new(c0: EngineConfig, c1: EngineConfig) -> Pair {
        let params = SimFabricParams {
            msg_latency: (1_000, 1_000),
            op_latency: (2_000, 2_000),
            death_detect: Duration::from_secs(3600),
            ..SimFabricParams::default()
        };
        let clock = SimClock::default();
        let mems: SharedMems = Rc::new(RefCell::new([SimMemory::new(PAGE), SimMemory::new(PAGE)]));
        let trace = Trace::new(false, clock.clone());
        let fabric = SimFabric::new(1, params, Rc::clone(&mems), trace, Injection::None).shared();
        let mut rng = Rng::new(7);
        let mut logs = Vec::new();
        let mut mk = |s: usize, c: EngineConfig| {
            let p = SimProtector::new(s, Rc::clone(&mems), rng.fork(), 0.0);
            logs.push(Rc::clone(&p.log));
            let host = SimHost::new(s, Rc::clone(&mems), clock.clone());
            Driver::with_host(c, SimEndpoint::new(Rc::clone(&fabric), s), p, host)
        };
        let d = [mk(0, c0), mk(1, c1)];
        let logs = [Rc::clone(&logs[0]), Rc::clone(&logs[1])];
        let mut p = Pair {
            clock,
            fabric,
            mems,
            d,
            logs,
        };
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
            for d in &mut self.d {
                n += d.turn();
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
        let next = [
            self.fabric.borrow().next_event_time(),
            self.d[0].next_deadline(),
            self.d[1].next_deadline(),
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

#[test]
fn bytes_cross_through_the_real_driver_with_posted_registrations() {
    let mut p = Pair::new(cfg(Role::Client), cfg(Role::Server));
    let data = pattern(100_000, 3);
    p.write(0, BUF, &data);
    let send = p.d[0].submit_send(BUF, data.len() as u64, PROTECTABLE);
    let flags = RecvFlags {
        waitall: true,
        ..RecvFlags::default()
    };
    let recv = p.d[1].submit_recv(BUF, data.len() as u64, flags);
    let mut got = None;
    p.run_until(Duration::from_secs(1), |p| {
        got = got.or(p.d[1].take_result(recv));
        got.is_some()
    });
    assert_eq!(got, Some(Ok(data.len() as u64)));
    assert_eq!(p.read(1, BUF, data.len()), data);
    p.run_for(Duration::from_millis(1));
    assert_eq!(p.d[0].take_result(send), Some(Ok(data.len() as u64)));
    let c = p.d[1].connection().counters();
    assert!(c.gets > 0, "the zero-copy path ran: {c:?}");
    // Every key went back: sources after GET_COMPLETE, destinations after
    // their GET.
    let f = p.fabric.borrow();
    assert_eq!((f.registrations(0), f.registrations(1)), (0, 0));
    assert!(f.violations.is_empty(), "{:?}", f.violations);
}

#[test]
fn keepalive_pings_a_quiet_peer_and_the_connection_lives() {
    let mut c1 = cfg(Role::Server);
    c1.keepalive = Duration::from_secs(5);
    c1.peer_timeout = Duration::from_secs(30);
    let mut p = Pair::new(cfg(Role::Client), c1);
    // A recv waits on side 1: the peer owes it data, so silence counts.
    let recv = p.d[1].submit_recv(BUF, 100, RecvFlags::default());
    p.settle();
    let before = p.d[1].connection().counters().msgs_sent;
    let due = p.d[1].connection().deadline(crate::conn::Timer::Keepalive);
    assert!(due.is_some_and(|t| t > p.now()), "armed: {due:?}");
    // Two minutes of silence: a ping every keepalive, each answered.
    p.run_for(Duration::from_secs(120));
    let pings = p.d[1].connection().counters().msgs_sent - before;
    assert!(
        (20..=26).contains(&pings),
        "one ping per 5 s of 120 s, got {pings}"
    );
    assert_eq!(*p.d[1].connection().state(), State::Established);
    assert_eq!(p.d[1].take_result(recv), None, "still waiting for data");
}

#[test]
fn a_silent_dead_peer_times_out_at_peer_timeout() {
    let mut c1 = cfg(Role::Server);
    c1.keepalive = Duration::from_secs(5);
    c1.peer_timeout = Duration::from_secs(30);
    let mut p = Pair::new(cfg(Role::Client), c1);
    let recv = p.d[1].submit_recv(BUF, 100, RecvFlags::default());
    p.settle();
    let since = p.now();
    // Side 0 dies; the fabric would tell in an hour: the timer goes first.
    p.fabric.borrow_mut().kill(0);
    let mut got = None;
    p.run_until(Duration::from_secs(60), |p| {
        got = got.or(p.d[1].take_result(recv));
        got.is_some()
    });
    assert_eq!(got, Some(Err(CallError::TimedOut)));
    let waited = p.now().saturating_since(since);
    assert!(
        // Counted from the peer's last word, a moment before it died.
        waited >= Duration::from_millis(29_990) && waited <= Duration::from_secs(31),
        "timed out after {waited:?}"
    );
    assert_eq!(
        *p.d[1].connection().state(),
        State::Aborted(AbortReason::PeerTimeout)
    );
}

#[test]
fn close_with_data_the_peer_never_reads_aborts_at_linger() {
    let mut c0 = cfg(Role::Client);
    c0.linger = Duration::from_secs(10);
    c0.keepalive = Duration::from_secs(1);
    c0.peer_timeout = Duration::from_secs(3600);
    let mut p = Pair::new(c0, cfg(Role::Server));
    // Zero-copy data the peer never reads: its pages stay advertised.
    let data = pattern(64 << 10, 9);
    p.write(0, BUF, &data);
    let send = p.d[0].submit_send(BUF, data.len() as u64, PROTECTABLE);
    p.run_for(Duration::from_millis(1));
    assert_eq!(p.d[0].take_result(send), Some(Ok(data.len() as u64)));
    p.d[0].submit_close();
    let closed = p.now();
    assert!(
        p.d[0]
            .connection()
            .deadline(crate::conn::Timer::Linger)
            .is_some()
    );
    p.run_until(Duration::from_secs(20), |p| {
        matches!(p.d[0].connection().state(), State::Aborted(_))
    });
    assert_eq!(
        *p.d[0].connection().state(),
        State::Aborted(AbortReason::LingerTimeout)
    );
    let after = p.now().saturating_since(closed);
    assert!(
        after >= Duration::from_secs(10) && after < Duration::from_millis(10_010),
        "aborted after {after:?}"
    );
    // Nothing stays protected or registered on the side that gave up.
    assert!(p.d[0].connection().protected_ranges().is_empty());
    p.run_for(Duration::from_millis(1));
    assert_eq!(p.fabric.borrow().registrations(0), 0);
    assert!(p.mems.borrow()[0].protected_pages().is_empty());
}

#[test]
fn block_on_write_escalates_a_stuck_writer_after_block_escalate() {
    let mut c0 = cfg(Role::Client);
    c0.write_fault = FaultPolicy::Block;
    c0.block_escalate = Duration::from_millis(10);
    let mut p = Pair::new(c0, cfg(Role::Server));
    let data = pattern(64 << 10, 5);
    p.write(0, BUF, &data);
    let send = p.d[0].submit_send(BUF, data.len() as u64, PROTECTABLE);
    p.run_for(Duration::from_millis(1));
    assert_eq!(p.d[0].take_result(send), Some(Ok(data.len() as u64)));
    assert!(
        !p.d[0].connection().protected_ranges().is_empty(),
        "AZ-SDP: the pages are protected until the peer's GET"
    );
    // The program writes the buffer; nobody reads on the other side.
    let page = BUF + PAGE;
    let _ticket = p.d[0].submit_fault(page + 8, Access::Write);
    let faulted = p.now();
    p.run_until(Duration::from_secs(1), |p| {
        p.logs[0].borrow().woken.iter().any(|r| r.contains(&page))
    });
    let waited = p.now().saturating_since(faulted);
    assert!(
        waited >= Duration::from_millis(10) && waited < Duration::from_millis(11),
        "writer released after {waited:?}"
    );
    assert_eq!(p.d[0].connection().counters().block_escalations, 1);
    // The peer still gets the bytes as sent, from the copy.
    let recv = p.d[1].submit_recv(
        BUF,
        data.len() as u64,
        RecvFlags {
            waitall: true,
            ..RecvFlags::default()
        },
    );
    p.write(0, page + 8, b"scribble");
    let mut got = None;
    p.run_until(Duration::from_secs(1), |p| {
        got = got.or(p.d[1].take_result(recv));
        got.is_some()
    });
    assert_eq!(got, Some(Ok(data.len() as u64)));
    assert_eq!(p.read(1, BUF, data.len()), data);
    p.d[0].shutdown(Shutdown::Both);
}
