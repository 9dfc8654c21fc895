//! The simulated world: two processes, each with memory, the real
//! [`Driver`] (engine, executor, flow control, staging) on a simulated host
//! and protector, and application threads, joined by the sim fabric. One
//! event loop in simulated time; every random choice comes from the seed.

use std::cell::RefCell;
use std::cmp::Reverse;
use std::collections::{BTreeMap, BinaryHeap, HashMap};
use std::rc::Rc;
use std::time::Duration;

use super::SimReport;
use super::host::{ProtectLog, SharedTcp, SimClock, SimHost, SimProtector, Trace};
use super::memory::{SharedMems, SimMemory};
use super::rng::Rng;
use super::scenario::{Injection, Scenario};
use crate::conn::{
    Access, CallError, CallId, Counters, RecvFlags, RxRoute, SendFlags, Shutdown, State, Ticket,
    Unprotectable,
};
use crate::driver::Driver;
use crate::fabric::sim::{SimEndpoint, SimFabric};
use crate::time::Timestamp;

mod fork;

/// The driver each side runs: the real one, on simulated parts.
type SimDriver = Driver<SimEndpoint, SimProtector, SimHost>;

/// Produces the bytes an application write puts at a given offset.
type Filler = dyn Fn(u64, &mut [u8]);

/// Events after which a run counts as hung (a livelock at one instant
/// included).
const EVENT_LIMIT: u64 = 20_000_000;
/// Past the scenario's time limit, a run in which no application byte
/// moved for this long is a hang (every wait of the engine ends within a
/// second: peer timeout, linger, stalls).
const STALL_LIMIT: Duration = Duration::from_secs(5);
/// No run goes on past this, moving or not.
const HARD_LIMIT: Duration = Duration::from_secs(300);

/// Where each side's buffers live in simulated memory.
const BUF_BASE: u64 = 0x1000_0000;
const BUF_STRIDE: u64 = 0x100_0000;

#[derive(Debug)]
enum WEvent {
    Wake(usize),
    Timer(usize),
    Poll(usize),
    Kill(usize),
    /// The side leaves the fabric for TCP.
    Switch(usize),
    /// The side's sending direction joins the fabric (the connection
    /// began on TCP).
    Join(usize),
    /// The listener's side allows the join (or forbids it).
    Allow(usize),
    /// The side's process `exec`s a program that runs the shim.
    Exec(usize),
    /// The side's exec gives up waiting for its engine to park.
    ExecDeadline(usize),
    /// The side's process forks (once what is in flight settles) and hands
    /// the connection to its child.
    Fork(usize),
    /// The forked child makes its first call.
    ForkChild(usize),
    /// The forking parent closes its copy.
    ForkParentCloses(usize),
    /// The forking parent's reactor looks at the side.
    ForkLook(usize),
    /// The forking parent is killed.
    ForkParentDies(usize),
    /// A signal interrupts the call, if it is still blocked.
    Cancel {
        side: usize,
        call: CallId,
    },
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Role {
    Sender,
    Receiver,
}

/// What a thread does next.
#[derive(Clone, Debug)]
enum Phase {
    Pick,
    /// Sender: write the stream pattern into the buffer.
    Fill {
        pos: u64,
    },
    Send,
    /// Sender: overwrite `[off, off+len)` of the sent bytes (must not reach the peer).
    Touch {
        off: u64,
        len: u64,
        pos: u64,
    },
    /// Sender: read the touched bytes back (the writer sees its own writes).
    ReadBack {
        off: u64,
        len: u64,
    },
    Recv,
    /// Receiver: write `[off, off+len)` of the received bytes before reading.
    RecvTouch {
        n: u64,
        off: u64,
        len: u64,
        pos: u64,
    },
    /// Receiver: read and check the received bytes.
    Verify {
        n: u64,
        peek: bool,
        touch: Option<(u64, u64)>,
        pos: u64,
    },
    /// Sender: free (or unmap) the buffer; in-flight pages must be settled.
    Free,
    /// Sender: the allocator reuses the freed memory.
    Reuse,
    Release,
    Finish,
    Done,
}

#[derive(Debug)]
struct Thread {
    side: usize,
    role: Role,
    dir: usize,
    rng: Rng,
    phase: Phase,
    msgs_left: u32,
    /// Stream offset: sender, bytes accepted; receiver, bytes delivered.
    pos: u64,
    buf: Option<usize>,
    /// Current message: offset in the buffer and length.
    cur: (u64, u64),
    /// Bytes of the current message already accepted by send().
    sent: u64,
    /// Receiver: the call in flight was a MSG_PEEK.
    last_peek: bool,
    waiting: Option<Wait>,
    result: Option<Result<u64, CallError>>,
    error: Option<CallError>,
    sigbus: bool,
    eof: bool,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Wait {
    Call(CallId),
    /// Stopped in a fault on this page.
    Fault(Ticket, u64),
    /// In `free()`, until the engine settles the memory.
    Evacuate(Ticket),
    /// In a receive on the TCP connection, for bytes or its end.
    Tcp,
    /// Stopped by the process's exec (resumes in the new image).
    Exec,
    /// Stopped by the process's fork (resumes in the child).
    Fork,
    Sleep,
}

/// One side's process, as the world sees it.
#[derive(Debug, Default)]
struct Proc {
    dead: bool,
    closed: bool,
    poll_at: Option<Timestamp>,
    timer_at: Option<Timestamp>,
    faults_raised: u64,
    busy: Vec<bool>,
    /// The process is stopped (SIGSTOP) during this interval.
    stalled: Option<(Timestamp, Timestamp)>,
    /// An exec is under way: its calls stop until the engine parks.
    exec: bool,
    /// Execs whose engine parked, and those that moved onto TCP.
    parked: u64,
    park_fallbacks: u64,
    /// A fork that hands the connection to a child.
    fork: Option<fork::ForkState>,
}

pub struct World {
    sc: Scenario,
    now: Timestamp,
    clock: SimClock,
    rng: Rng,
    fabric: Rc<RefCell<SimFabric>>,
    mems: SharedMems,
    drivers: [SimDriver; 2],
    protect: [Rc<RefCell<ProtectLog>>; 2],
    procs: [Proc; 2],
    threads: Vec<Thread>,
    heap: BinaryHeap<Reverse<(Timestamp, u64)>>,
    events: HashMap<u64, WEvent>,
    seq: u64,
    /// Blocked calls, by side (ordered: wake-ups are scheduled in a
    /// deterministic order).
    calls: BTreeMap<(usize, CallId), usize>,
    violations: Vec<String>,
    trace: Trace,
    events_run: u64,
    /// The TCP connection beneath (the hosts write resends into it).
    tcp: SharedTcp,
    /// Bytes each side's application sent on TCP before its direction
    /// joined the fabric (a connection that began on TCP; what it took
    /// there the engine counts, told by `took_from_tcp`).
    tcp_sent_before_join: [u64; 2],
    /// Each side's receive route when its TCP readers last looked.
    routes: [RxRoute; 2],
    fork_outcome: super::ForkOutcome,
}

fn pattern_word(dir: usize, seed: u64, w: u64) -> u64 {
    let mut z = w ^ seed.rotate_left(17) ^ ((dir as u64 + 1) << 61);
    z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
    z ^ (z >> 31)
}

/// The stream's byte at offset `off` of direction `dir`.
fn fill_pattern(dir: usize, seed: u64, off: u64, out: &mut [u8]) {
    let mut i = 0usize;
    while i < out.len() {
        let o = off + i as u64;
        let w = pattern_word(dir, seed, o / 8).to_le_bytes();
        let start = (o % 8) as usize;
        let k = (8 - start).min(out.len() - i);
        out[i..i + k].copy_from_slice(&w[start..start + k]);
        i += k;
    }
}

/// Bytes a thread writes over data: the pattern with every bit of 0x5A flipped,
/// so each byte differs from what the stream carries.
fn fill_poison(dir: usize, seed: u64, off: u64, out: &mut [u8]) {
    fill_pattern(dir, seed, off, out);
    for b in out.iter_mut() {
        *b ^= 0x5a;
    }
}

impl World {
    pub fn new(sc: Scenario, verbose: bool) -> World {
        let mut rng = Rng::new(sc.seed ^ 0x51_u64);
        let clock = SimClock::default();
        let trace = Trace::new(verbose, clock.clone());
        let mems: SharedMems = Rc::new(RefCell::new([
            SimMemory::new(sc.page[0]),
            SimMemory::new(sc.page[1]),
        ]));
        let mut params = sc.fabric.clone();
        params.p_register_fail = sc.p_prepare_fail;
        params.p_pool_fail = sc.p_copy_fail;
        let fabric = SimFabric::new(
            sc.seed,
            params,
            Rc::clone(&mems),
            trace.clone(),
            sc.injection,
        )
        .shared();
        let tcp = SharedTcp::default();
        let side = |s: usize, rng: &mut Rng| {
            let p = SimProtector::new(s, Rc::clone(&mems), rng.fork(), sc.p_arm_fail);
            let log = Rc::clone(&p.log);
            let mut host = SimHost::new(s, Rc::clone(&mems), clock.clone(), Rc::clone(&tcp));
            host.fabric = Some(Rc::clone(&fabric));
            let ep = SimEndpoint::new(Rc::clone(&fabric), s);
            (Driver::with_host(sc.engine[s].clone(), ep, p, host), log)
        };
        let (d0, log0) = side(0, &mut rng);
        let (d1, log1) = side(1, &mut rng);
        let mut threads = Vec::new();
        for (dir, app) in sc.apps.iter().enumerate() {
            for (side, role) in [(dir, Role::Sender), (1 - dir, Role::Receiver)] {
                threads.push(Thread {
                    side,
                    role,
                    dir,
                    rng: rng.fork(),
                    phase: Phase::Pick,
                    msgs_left: app.messages,
                    pos: 0,
                    buf: None,
                    cur: (0, 0),
                    sent: 0,
                    last_peek: false,
                    waiting: None,
                    result: None,
                    error: None,
                    sigbus: false,
                    eof: false,
                });
            }
        }
        let procs = [
            Proc {
                busy: vec![false; sc.buffers[0].len()],
                ..Proc::default()
            },
            Proc {
                busy: vec![false; sc.buffers[1].len()],
                ..Proc::default()
            },
        ];
        let mut w = World {
            now: Timestamp::ZERO,
            clock,
            rng,
            fabric,
            mems,
            drivers: [d0, d1],
            protect: [log0, log1],
            procs,
            threads,
            heap: BinaryHeap::new(),
            events: HashMap::new(),
            seq: 0,
            calls: BTreeMap::new(),
            violations: Vec::new(),
            tcp,
            tcp_sent_before_join: [0; 2],
            routes: [RxRoute::Fabric; 2],
            fork_outcome: super::ForkOutcome::default(),
            trace,
            events_run: 0,
            sc,
        };
        for t in 0..w.threads.len() {
            w.schedule(Timestamp::ZERO, WEvent::Wake(t));
        }
        match w.sc.injection {
            Injection::Kill { side, at } => w.schedule(Timestamp::ZERO + at, WEvent::Kill(side)),
            Injection::Stall { side, at, dur } => {
                w.procs[side].stalled = Some((Timestamp::ZERO + at, Timestamp::ZERO + at + dur));
            }
            _ => {}
        }
        if let Some((side, at)) = w.sc.switch {
            w.schedule(Timestamp::ZERO + at, WEvent::Switch(side));
        }
        if let Some((side, at)) = w.sc.exec {
            w.schedule(Timestamp::ZERO + at, WEvent::Exec(side));
        }
        if let Some(f) = w.sc.fork {
            w.schedule(Timestamp::ZERO + f.at, WEvent::Fork(f.side));
        }
        for (side, at) in w.sc.join.unwrap_or_default().into_iter().enumerate() {
            if let Some(at) = at {
                w.schedule(Timestamp::ZERO + at, WEvent::Join(side));
            }
        }
        if w.sc.join.is_some() {
            let at = w.sc.allow.unwrap_or_default();
            w.schedule(Timestamp::ZERO + at, WEvent::Allow(1));
        }
        w.settle(0);
        w.settle(1);
        w
    }

    fn schedule(&mut self, at: Timestamp, ev: WEvent) {
        self.seq += 1;
        self.heap.push(Reverse((at, self.seq)));
        self.events.insert(self.seq, ev);
    }

    fn note(&self, s: impl FnOnce() -> String) {
        self.trace.note(s);
    }

    fn buf_addr(side: usize, idx: usize) -> u64 {
        BUF_BASE + (side as u64) * 0x10_0000_0000 + idx as u64 * BUF_STRIDE
    }

    fn side_of(ev: &WEvent, threads: &[Thread]) -> usize {
        match *ev {
            WEvent::Wake(t) => threads[t].side,
            WEvent::Timer(side)
            | WEvent::Poll(side)
            | WEvent::Kill(side)
            | WEvent::Switch(side)
            | WEvent::Join(side)
            | WEvent::Allow(side)
            | WEvent::Exec(side)
            | WEvent::ExecDeadline(side)
            | WEvent::Fork(side)
            | WEvent::ForkChild(side)
            | WEvent::ForkParentCloses(side)
            | WEvent::ForkLook(side)
            | WEvent::ForkParentDies(side)
            | WEvent::Cancel { side, .. } => side,
        }
    }

    /// Run to completion; return the report.
    pub fn run(mut self) -> SimReport {
        let limit = Timestamp::ZERO + self.sc.time_limit;
        // (Bytes the applications moved, and when that last changed.)
        let mut moved = (0u64, Timestamp::ZERO);
        loop {
            if self.finished() {
                break;
            }
            let tw = self.heap.peek().map(|Reverse((t, _))| *t);
            let tf = self.fabric.borrow().next_event_time();
            let next = match (tw, tf) {
                (Some(a), Some(b)) => a.min(b),
                (Some(a), None) | (None, Some(a)) => a,
                (None, None) => {
                    self.violations
                        .push("hang: nothing scheduled but the run is not finished".into());
                    break;
                }
            };
            // A slow run (a receiver that takes a few bytes at a time with
            // compute between) is no hang as long as bytes keep moving.
            let now_moved: u64 = self.threads.iter().map(|t| t.pos).sum();
            if now_moved != moved.0 {
                moved = (now_moved, self.now);
            }
            let stuck = next > limit && next.saturating_since(moved.1) > STALL_LIMIT;
            if stuck || next > Timestamp::ZERO + HARD_LIMIT || self.events_run > EVENT_LIMIT {
                self.violations.push(format!(
                    "hang: still running at {:?}; side 0: {}; side 1: {}",
                    self.now,
                    self.drivers[0].connection().describe_waits(),
                    self.drivers[1].connection().describe_waits()
                ));
                break;
            }
            self.now = self.now.max(next);
            self.clock.set(self.now);
            self.fabric.borrow_mut().advance(self.now);
            for side in 0..2 {
                if self.fabric.borrow().has_ready(side)
                    && self.procs[side].poll_at.is_none()
                    && !self.procs[side].dead
                {
                    let (lo, hi) = self.sc.skew[side];
                    let d = lo + self.rng.below(hi - lo + 1);
                    let at = self.now + Duration::from_nanos(d);
                    self.procs[side].poll_at = Some(at);
                    self.schedule(at, WEvent::Poll(side));
                }
            }
            while let Some(&Reverse((t, id))) = self.heap.peek() {
                if t > self.now {
                    break;
                }
                self.heap.pop();
                let Some(ev) = self.events.remove(&id) else {
                    continue;
                };
                let side = Self::side_of(&ev, &self.threads);
                if let Some((from, until)) = self.procs[side].stalled
                    && self.now >= from
                    && self.now < until
                    && !matches!(ev, WEvent::Kill(_))
                {
                    // The process is stopped: everything it would do waits.
                    self.heap.push(Reverse((until, id)));
                    self.events.insert(id, ev);
                    continue;
                }
                self.events_run += 1;
                if self.events_run > EVENT_LIMIT {
                    break;
                }
                self.run_event(ev);
            }
        }
        self.check_end()
    }

    fn finished(&self) -> bool {
        let threads_done = self
            .threads
            .iter()
            .all(|t| matches!(t.phase, Phase::Done) || self.procs[t.side].dead);
        threads_done
            && (0..2).all(|s| {
                self.procs[s].dead
                    || (self.procs[s].closed
                        && (self.drivers[s].is_finished() || self.runner_dead(s)))
            })
    }

    fn run_event(&mut self, ev: WEvent) {
        match ev {
            WEvent::Wake(t) => {
                if self.procs[self.threads[t].side].dead {
                    return;
                }
                if self.threads[t].waiting == Some(Wait::Sleep) {
                    self.threads[t].waiting = None;
                }
                if self.threads[t].waiting.is_none() {
                    self.step(t);
                }
            }
            WEvent::Timer(side) => {
                self.procs[side].timer_at = None;
                if self.procs[side].dead || !self.fork_lets_run(side) {
                    return;
                }
                self.drivers[side].run_timers();
                self.settle(side);
            }
            WEvent::Poll(side) => {
                self.procs[side].poll_at = None;
                if self.procs[side].dead || !self.fork_lets_run(side) {
                    return;
                }
                self.drivers[side].turn();
                self.settle(side);
                // The peer may have been waiting for room in this side's ring.
                if !self.procs[1 - side].dead && !self.not_driven(1 - side) {
                    self.drivers[1 - side].drive();
                    self.settle(1 - side);
                }
            }
            WEvent::Cancel { side, call } => {
                if !self.procs[side].dead && self.calls.contains_key(&(side, call)) {
                    self.note(|| format!("side {side}: signal interrupts {call:?}"));
                    self.drivers[side].cancel(call);
                    self.settle(side);
                }
            }
            WEvent::Switch(side) => {
                if !self.procs[side].dead {
                    self.note(|| format!("side {side}: leaves the fabric for TCP"));
                    self.drivers[side].leave_fabric();
                    self.settle(side);
                }
            }
            WEvent::Join(side) => self.join(side),
            WEvent::Allow(side) => {
                if !self.procs[side].dead {
                    if self.sc.allow.is_some() {
                        self.note(|| format!("side {side}: allows the join"));
                        self.drivers[side].allow_join();
                    } else {
                        let never = self.drivers[side].forbid_join();
                        self.note(|| format!("side {side}: forbids the join ({never})"));
                    }
                    self.settle(side);
                }
            }
            WEvent::Exec(side) => self.start_exec(side),
            WEvent::Fork(side) => self.start_fork(side),
            WEvent::ForkChild(side) => self.fork_child_calls(side),
            WEvent::ForkParentCloses(side) => self.fork_parent_closes(side),
            WEvent::ForkLook(side) => self.fork_look(side),
            WEvent::ForkParentDies(side) => self.fork_parent_dies(side),
            WEvent::ExecDeadline(side) => {
                if self.procs[side].exec && !self.procs[side].dead {
                    // As the shim does: the connection moves onto TCP.
                    let why = self.drivers[side].park_blocker();
                    let calls = self.calls.keys().filter(|&&(s, _)| s == side).count();
                    let parent = if self.fork_parent_holds(side) {
                        ", the fork's parent holds its copy"
                    } else {
                        ""
                    };
                    self.note(|| {
                        format!(
                            "side {side}: engine did not park ({why:?}, {calls} calls{parent}); leaves the fabric"
                        )
                    });
                    self.procs[side].exec = false;
                    self.procs[side].park_fallbacks += 1;
                    self.drivers[side].pause_arms(false);
                    self.drivers[side].leave_fabric();
                    self.resume_after_exec(side);
                    self.settle(side);
                }
            }
            WEvent::Kill(side) => {
                self.note(|| format!("KILL side {side}"));
                self.procs[side].dead = true;
                self.fabric.borrow_mut().kill(side);
                // Its kernel closes its TCP socket: what it wrote, then the end.
                self.tcp.borrow_mut().shut[side] = true;
                self.wake_tcp_readers(1 - side);
            }
        }
    }

    /// After the driver of `side` ran: wake the threads whose calls ended,
    /// whose faults were resolved or whose memory was settled, and set the
    /// timer for the engine's next deadline.
    fn settle(&mut self, side: usize) {
        if self.procs[side].dead {
            return;
        }
        // A resend may have gone onto TCP (the host writes it).
        self.wake_tcp_readers(1 - side);
        // The peer's JOIN (or its departure) may have moved our receives.
        let route = self.drivers[side].rx_route();
        if route != self.routes[side] || self.drivers[side].peer_left() {
            self.routes[side] = route;
            self.wake_tcp_readers(side);
        }
        let c = self.drivers[side].connection();
        if matches!(c.state(), State::Aborted(_))
            && (c.switch_sent() || c.config().joins_from_tcp)
            && !self.tcp.borrow().shut[side]
        {
            // Aborted halfway through the switch, or while joining: the
            // shim resets the TCP connection, which the peer may be
            // reading already.
            self.tcp.borrow_mut().shut[side] = true;
            self.wake_tcp_readers(1 - side);
        }
        let ended: Vec<((usize, CallId), Result<u64, CallError>)> = self
            .calls
            .range((side, CallId(0))..=(side, CallId(u64::MAX)))
            .filter_map(|(&k, _)| self.drivers[side].take_result(k.1).map(|r| (k, r)))
            .collect();
        for (k, result) in ended {
            let t = self.calls.remove(&k).expect("a blocked call");
            self.note(|| format!("side {side}: {:?} done: {result:?}", k.1));
            self.threads[t].waiting = None;
            self.threads[t].result = Some(result);
            self.schedule(self.now, WEvent::Wake(t));
        }
        let woken = std::mem::take(&mut self.protect[side].borrow_mut().woken);
        for t in 0..self.threads.len() {
            if self.threads[t].side != side {
                continue;
            }
            let go = match self.threads[t].waiting {
                Some(Wait::Fault(_, page)) => woken.iter().any(|r| r.contains(&page)),
                Some(Wait::Evacuate(ticket)) => self.drivers[side].resumed(ticket),
                _ => false,
            };
            if go {
                self.threads[t].waiting = None;
                self.schedule(self.now, WEvent::Wake(t));
            }
        }
        if let Some(t) = self.drivers[side].next_deadline()
            && self.procs[side].timer_at.is_none_or(|x| x > t)
        {
            self.procs[side].timer_at = Some(t);
            let at = t.max(self.now);
            self.schedule(at, WEvent::Timer(side));
        }
        if self.procs[side].exec {
            self.try_park(side);
        }
        self.try_fork(side);
    }

    // ----- exec: the engine parks, the new image takes it up ----------------

    /// Would this thread's next step be a call (or a close) on the
    /// connection? Those wait for the new image.
    fn stops_for_exec(&self, t: usize, phase: &Phase) -> bool {
        let th = &self.threads[t];
        match phase {
            Phase::Send | Phase::Recv => th.result.is_none() && !self.on_tcp(th.side),
            Phase::Finish | Phase::Free => true,
            _ => false,
        }
    }

    /// The process execs: the calls blocked in it are interrupted (their
    /// threads are gone, as a signal ends them), no new ones start, and the
    /// engine settles what it has out on the application's memory.
    fn start_exec(&mut self, side: usize) {
        if self.procs[side].dead || self.procs[side].closed || self.on_tcp(side) {
            return;
        }
        self.note(|| format!("side {side}: exec"));
        self.procs[side].exec = true;
        self.drivers[side].pause_arms(true);
        self.interrupt_calls(side);
        self.schedule(
            self.now + Duration::from_millis(200),
            WEvent::ExecDeadline(side),
        );
        self.settle(side);
    }

    /// Interrupt `side`'s blocked calls (their threads make them again
    /// where they go on: in the new image, or the forked child).
    fn interrupt_calls(&mut self, side: usize) {
        let blocked: Vec<CallId> = self
            .calls
            .range((side, CallId(0))..=(side, CallId(u64::MAX)))
            .map(|(&(_, c), _)| c)
            .collect();
        for call in blocked {
            self.drivers[side].cancel(call);
        }
    }

    /// Park the engine once it is quiet (and, in a forked child, once the
    /// parent closed its copy, as the shim's park waits for the other
    /// holders to), and take it up in a fresh driver (new protector and
    /// host: the new image's), on the same endpoint, after the pause the
    /// exec takes.
    fn try_park(&mut self, side: usize) {
        let quiet = !self.calls.keys().any(|&(s, _)| s == side)
            && self.drivers[side].park_blocker().is_none()
            && !self.fork_parent_holds(side);
        if !quiet {
            return;
        }
        let bytes = match self.drivers[side].park() {
            Ok(b) => b,
            Err(e) => {
                self.violations
                    .push(format!("side {side}: park failed when quiet: {e}"));
                return;
            }
        };
        self.procs[side].exec = false;
        let p = SimProtector::new(
            side,
            Rc::clone(&self.mems),
            self.rng.fork(),
            self.sc.p_arm_fail,
        );
        let log = Rc::clone(&p.log);
        let mut host = SimHost::new(
            side,
            Rc::clone(&self.mems),
            self.clock.clone(),
            Rc::clone(&self.tcp),
        );
        host.unprotectable = Rc::clone(&self.drivers[side].host().unprotectable);
        let ep = self.endpoint_after_exec(side);
        match Driver::unpark(&bytes, ep, p, host) {
            Ok(d) => {
                self.note(|| format!("side {side}: parked {} bytes, taken up", bytes.len()));
                self.drivers[side] = d;
                self.protect[side] = log;
                self.procs[side].parked += 1;
                if self.procs[side].fork.is_some() {
                    self.fork_outcome.child_execs += 1;
                }
            }
            Err(e) => {
                self.violations.push(format!("side {side}: unpark: {e}"));
                return;
            }
        }
        // The new image starts after the exec's pause; meanwhile nothing
        // of this side runs.
        let pause = Duration::from_micros(self.rng.range(50, 3_000));
        if self.procs[side]
            .stalled
            .is_none_or(|(_, until)| until <= self.now)
        {
            self.procs[side].stalled = Some((self.now, self.now + pause));
        }
        self.resume_after_exec(side);
    }

    fn resume_after_exec(&mut self, side: usize) {
        self.resume(side, Wait::Exec);
    }

    /// Wake `side`'s threads stopped in `wait`.
    fn resume(&mut self, side: usize, wait: Wait) {
        for t in 0..self.threads.len() {
            if self.threads[t].side == side && self.threads[t].waiting == Some(wait) {
                self.threads[t].waiting = None;
                self.schedule(self.now, WEvent::Wake(t));
            }
        }
    }

    // ----- the TCP connection, once a side left the fabric ------------------

    /// Has `side`'s connection left the fabric (its calls go to TCP)?
    fn on_tcp(&self, side: usize) -> bool {
        *self.drivers[side].connection().state() == State::Switched || self.heir_on_tcp(side)
    }

    /// Do `side`'s sends go to TCP: it left the fabric, or its sending
    /// direction has not joined yet?
    fn sends_on_tcp(&self, side: usize) -> bool {
        let c = self.drivers[side].connection();
        self.on_tcp(side) || !(c.tx_joined() || matches!(c.state(), State::Aborted(_)))
    }

    /// Do `side`'s receives go to TCP before its peer's stream joined?
    /// (Not once its connection aborted: calls get its error.)
    fn recv_route_tcp(&self, side: usize) -> Option<Option<u64>> {
        if self.runner_dead(side) {
            return None;
        }
        let c = self.drivers[side].connection();
        match c.rx_route() {
            RxRoute::Tcp { left } if !matches!(c.state(), State::Aborted(_) | State::Switched) => {
                Some(left)
            }
            _ => None,
        }
    }

    /// Has `side`'s peer joined (its JOIN is in)?
    fn peer_joined(&self, side: usize) -> bool {
        !matches!(self.drivers[side].rx_route(), RxRoute::Tcp { left: None })
    }

    /// `side`'s sending direction joins the fabric (once; not while its
    /// process execs, nor after it left the fabric or died).
    fn join(&mut self, side: usize) {
        let p = &self.procs[side];
        if p.dead || self.on_tcp(side) || self.drivers[side].connection().tx_joined() {
            return;
        }
        let ended = self
            .threads
            .iter()
            .all(|t| t.side != side || matches!(t.phase, Phase::Done));
        if ended {
            return;
        }
        // A side joins once its handshake is done (the listener answers
        // only when it allows the join); the listener's, as the shim's,
        // only once the client's JOIN is in (the client's program may
        // sleep on the TCP socket alone until it joins).
        let c = self.drivers[side].connection();
        let waits_for_peer =
            c.config().role == crate::conn::Role::Server && !self.peer_joined(side);
        if p.exec || !c.established() || waits_for_peer {
            self.schedule(self.now + Duration::from_micros(200), WEvent::Join(side));
            return;
        }
        let sent = self.tcp_sent_before_join[side];
        self.note(|| format!("side {side}: joins the fabric after {sent} bytes on TCP"));
        self.drivers[side].join_tx(sent);
        self.settle(side);
    }

    /// Threads of `side` waiting for TCP bytes may look again.
    fn wake_tcp_readers(&mut self, side: usize) {
        for t in 0..self.threads.len() {
            if self.threads[t].side == side && self.threads[t].waiting == Some(Wait::Tcp) {
                self.threads[t].waiting = None;
                self.schedule(self.now, WEvent::Wake(t));
            }
        }
    }

    /// `send()` on TCP: all of it goes.
    fn tcp_send(&mut self, side: usize, addr: u64, len: u64) -> u64 {
        let mut b = vec![0u8; len as usize];
        self.mems.borrow_mut()[side].read_raw(addr, &mut b);
        self.tcp.borrow_mut().wrote[side].extend(b);
        self.wake_tcp_readers(1 - side);
        len
    }

    /// A receive while the peer's stream still comes over TCP: at most
    /// `left` bytes there (`None`: until its JOIN says). `None` if it must
    /// wait, for TCP or for the connection.
    fn recv_before_join(
        &mut self,
        side: usize,
        addr: u64,
        len: u64,
        left: Option<u64>,
        flags: RecvFlags,
    ) -> Option<Result<u64, CallError>> {
        let len = left.map_or(len, |k| len.min(k));
        // The end of TCP with no JOIN: the peer ended its stream there (or
        // died; a JOIN on its way then is lost with what follows, as after
        // any death the checks allow a prefix).
        let r = match self.tcp_recv(side, addr, len, flags) {
            Some(Ok(0)) if left.is_some() => Some(Err(CallError::ConnReset)),
            r => r,
        };
        if let Some(Ok(n)) = r
            && n > 0
            && !flags.peek
        {
            if let Err(e) = self.drivers[side].took_from_tcp(n) {
                self.settle(side);
                return Some(Err(e));
            }
            self.settle(side);
        }
        r
    }

    /// A stream's end (or a close) before `side` joined: as the shim, it
    /// joins now if the peer has (the end goes on the fabric after the TCP
    /// part), else it ends on TCP and never joins.
    fn join_now(&mut self, side: usize) {
        if self.procs[side].dead || !self.sends_on_tcp(side) || self.on_tcp(side) {
            return;
        }
        let sent = self.tcp_sent_before_join[side];
        if self.peer_joined(side) {
            self.note(|| format!("side {side}: joins as it ends, after {sent} bytes on TCP"));
            self.drivers[side].join_tx(sent);
        } else {
            self.note(|| format!("side {side}: ends its stream on TCP, after {sent} bytes"));
            self.tcp.borrow_mut().shut[side] = true;
            self.wake_tcp_readers(1 - side);
        }
        self.settle(side);
    }

    /// `recv()` on TCP: `None` if it must wait.
    fn tcp_recv(
        &mut self,
        side: usize,
        addr: u64,
        len: u64,
        flags: RecvFlags,
    ) -> Option<Result<u64, CallError>> {
        let have = self.tcp.borrow().wrote[1 - side].len() as u64;
        let shut = self.tcp.borrow().shut[1 - side];
        let enough =
            have > 0 && (!flags.waitall || flags.peek || flags.nonblocking || have >= len || shut);
        if !enough {
            return if have == 0 && shut {
                Some(Ok(0))
            } else if flags.nonblocking {
                Some(Err(CallError::WouldBlock))
            } else {
                None
            };
        }
        let n = have.min(len);
        let mut tcp = self.tcp.borrow_mut();
        let from = &mut tcp.wrote[1 - side];
        let b: Vec<u8> = if flags.peek {
            from.iter().take(n as usize).copied().collect()
        } else {
            from.drain(..n as usize).collect()
        };
        drop(tcp);
        self.mems.borrow_mut()[side].write_raw(addr, &b);
        Some(Ok(n))
    }

    // ----- application threads --------------------------------------------

    /// An application write of `len` bytes at `addr` from byte `pos` on.
    /// Returns the new position, stopping at a fault (the thread then waits).
    fn app_access(
        &mut self,
        t: usize,
        addr: u64,
        len: u64,
        pos: u64,
        write: Option<&Filler>,
    ) -> u64 {
        let side = self.threads[t].side;
        let page = self.sc.page[side];
        let mut p = pos;
        while p < len {
            let a = addr + p;
            let k = (page - a % page).min(len - p);
            let fault = self.mems.borrow()[side].first_fault(a, k, write.is_some());
            if let Some(fp) = fault {
                self.procs[side].faults_raised += 1;
                let access = if write.is_some() {
                    Access::Write
                } else {
                    Access::Read
                };
                self.note(|| format!("side {side}: fault {access:?} at {fp:#x}"));
                let ticket = self.drivers[side].submit_fault(fp, access);
                self.threads[t].waiting = Some(Wait::Fault(ticket, fp & !(page - 1)));
                self.settle(side);
                return p;
            }
            if let Some(f) = write {
                let mut tmp = vec![0u8; k as usize];
                f(p, &mut tmp);
                self.mems.borrow_mut()[side].write_raw(a, &tmp);
            }
            p += k;
        }
        p
    }

    /// Maybe arrange for a signal to interrupt `call` soon.
    fn maybe_interrupt(&mut self, t: usize, call: CallId, nonblocking: bool) {
        let side = self.threads[t].side;
        let p = self.sc.apps[self.threads[t].dir].p_cancel;
        if !nonblocking && self.threads[t].rng.chance(p) {
            let d = self.threads[t].rng.below(200_000);
            self.schedule(
                self.now + Duration::from_nanos(d),
                WEvent::Cancel { side, call },
            );
        }
    }

    fn sleep(&mut self, t: usize, d: Duration) {
        self.threads[t].waiting = Some(Wait::Sleep);
        self.schedule(self.now + d, WEvent::Wake(t));
    }

    fn compute(&mut self, t: usize) -> bool {
        let max = self.sc.apps[self.threads[t].dir].max_compute.as_nanos() as u64;
        if max > 0 && self.threads[t].rng.chance(0.5) {
            let d = self.threads[t].rng.below(max);
            self.sleep(t, Duration::from_nanos(d));
            return true;
        }
        false
    }

    fn step(&mut self, t: usize) {
        loop {
            if self.threads[t].waiting.is_some() {
                return;
            }
            let phase = self.threads[t].phase.clone();
            let side = self.threads[t].side;
            if self.procs[side].exec && self.stops_for_exec(t, &phase) {
                self.threads[t].waiting = Some(Wait::Exec);
                return;
            }
            if self.fork_holds(side) && self.stops_for_exec(t, &phase) {
                self.threads[t].waiting = Some(Wait::Fork);
                return;
            }
            let next = match self.threads[t].role {
                Role::Sender => self.step_sender(t, phase),
                Role::Receiver => self.step_receiver(t, phase),
            };
            match next {
                Some(p) => self.threads[t].phase = p,
                None => return,
            }
        }
    }

    fn pick_buffer(&mut self, t: usize) -> Option<usize> {
        let side = self.threads[t].side;
        let app = &self.sc.apps[self.threads[t].dir];
        let n = self.sc.buffers[side].len();
        let reuse = self.threads[t].rng.chance(app.p_reuse);
        let first = if reuse {
            0
        } else {
            self.threads[t].rng.below(n as u64) as usize
        };
        let idx = (0..n)
            .map(|i| (first + i) % n)
            .find(|&i| !self.procs[side].busy[i])?;
        self.procs[side].busy[idx] = true;
        Some(idx)
    }

    fn choose_extent(&mut self, t: usize, idx: usize) -> (u64, u64) {
        let side = self.threads[t].side;
        let (cap, _) = self.sc.buffers[side][idx];
        let max_len = self.sc.apps[self.threads[t].dir].max_len.min(cap);
        let r = &mut self.threads[t].rng;
        let len = r.log_size(max_len);
        let slack = cap - len;
        let off = if r.chance(0.3) {
            let page = self.sc.page[side];
            (r.below(slack + 1) / page) * page
        } else {
            r.below(slack + 1)
        };
        (off, len)
    }

    fn take_result(&mut self, t: usize) -> Result<u64, CallError> {
        self.threads[t].result.take().expect("call result")
    }

    fn step_sender(&mut self, t: usize, phase: Phase) -> Option<Phase> {
        let side = self.threads[t].side;
        let dir = self.threads[t].dir;
        let seed = self.sc.seed;
        match phase {
            Phase::Pick => {
                if self.threads[t].msgs_left == 0 {
                    return Some(Phase::Finish);
                }
                let Some(idx) = self.pick_buffer(t) else {
                    self.sleep(t, Duration::from_micros(20));
                    return None;
                };
                let ext = self.choose_extent(t, idx);
                let th = &mut self.threads[t];
                th.buf = Some(idx);
                th.cur = ext;
                th.sent = 0;
                th.msgs_left -= 1;
                Some(Phase::Fill { pos: 0 })
            }
            Phase::Fill { pos } => {
                let (off, len) = self.threads[t].cur;
                let addr = Self::buf_addr(side, self.threads[t].buf.expect("buffer")) + off;
                let base = self.threads[t].pos;
                let f = move |p: u64, out: &mut [u8]| fill_pattern(dir, seed, base + p, out);
                let p = self.app_access(t, addr, len, pos, Some(&f));
                if p < len {
                    self.threads[t].phase = Phase::Fill { pos: p };
                    return None;
                }
                Some(Phase::Send)
            }
            Phase::Send => {
                if let Some(r) = self.threads[t]
                    .result
                    .is_some()
                    .then(|| self.take_result(t))
                {
                    match r {
                        Ok(n) => {
                            self.threads[t].sent += n;
                            self.threads[t].pos += n;
                        }
                        Err(CallError::WouldBlock) => {
                            self.sleep(t, Duration::from_micros(10));
                            self.threads[t].phase = Phase::Send;
                            return None;
                        }
                        // EINTR: the application retries; after a switch,
                        // the shim makes the call again on TCP.
                        Err(CallError::Interrupted | CallError::Switched | CallError::OnTcp) => {}
                        Err(e) => {
                            self.threads[t].error = Some(e);
                            return Some(Phase::Finish);
                        }
                    }
                }
                let (off, len) = self.threads[t].cur;
                let sent = self.threads[t].sent;
                if sent < len && self.sends_on_tcp(side) {
                    let idx = self.threads[t].buf.expect("buffer");
                    let addr = Self::buf_addr(side, idx) + off + sent;
                    let n = self.tcp_send(side, addr, len - sent);
                    if !self.on_tcp(side) {
                        self.tcp_sent_before_join[side] += n;
                    }
                    self.threads[t].result = Some(Ok(n));
                    return Some(Phase::Send);
                }
                if sent == len {
                    let th = &mut self.threads[t];
                    let app = &self.sc.apps[dir];
                    if th.rng.chance(app.p_touch_send) {
                        let toff = th.rng.below(len);
                        let tlen = 1 + th.rng.below((len - toff).min(3 * self.sc.page[side]));
                        return Some(Phase::Touch {
                            off: toff,
                            len: tlen,
                            pos: 0,
                        });
                    }
                    return Some(Phase::Free);
                }
                let idx = self.threads[t].buf.expect("buffer");
                let addr = Self::buf_addr(side, idx) + off + sent;
                let protectable = self.sc.buffers[side][idx].1;
                let nonblocking = self.threads[t].rng.chance(self.sc.apps[dir].p_nonblocking);
                let flags = SendFlags {
                    nonblocking,
                    protectable,
                    // What the host would say of such a buffer.
                    unprotectable: (!protectable).then_some(Unprotectable::Shared),
                };
                if let Some(next) = self.fork_defers_call(t, Phase::Send) {
                    return next;
                }
                let call = self.drivers[side].submit_send(addr, len - sent, flags);
                self.note(|| format!("side {side}: {call:?} send {addr:#x}+{} nonblocking {nonblocking} protectable {protectable}", len - sent));
                self.calls.insert((side, call), t);
                self.threads[t].waiting = Some(Wait::Call(call));
                self.settle(side);
                self.maybe_interrupt(t, call, nonblocking);
                self.threads[t].phase = Phase::Send;
                None
            }
            Phase::Touch { off, len, pos } => {
                let (moff, mlen) = self.threads[t].cur;
                let addr = Self::buf_addr(side, self.threads[t].buf.expect("buffer")) + moff + off;
                // Poison derived from the stream offset these bytes were sent at.
                let base = self.threads[t].pos - mlen + off;
                let f = move |p: u64, out: &mut [u8]| fill_poison(dir, seed, base + p, out);
                let p = self.app_access(t, addr, len, pos, Some(&f));
                if p < len {
                    self.threads[t].phase = Phase::Touch { off, len, pos: p };
                    return None;
                }
                Some(Phase::ReadBack { off, len })
            }
            Phase::ReadBack { off, len } => {
                let (moff, mlen) = self.threads[t].cur;
                let addr = Self::buf_addr(side, self.threads[t].buf.expect("buffer")) + moff + off;
                let mut got = vec![0u8; len as usize];
                self.mems.borrow_mut()[side].read_raw(addr, &mut got);
                let mut want = vec![0u8; len as usize];
                // The touched bytes were sent at stream offset pos - mlen + off.
                fill_poison(dir, seed, self.threads[t].pos - mlen + off, &mut want);
                if got != want {
                    self.violations.push(format!(
                        "side {side}: the sender's own write at {addr:#x} (+{len}) did not stick"
                    ));
                }
                Some(Phase::Free)
            }
            Phase::Free => {
                if !self.threads[t].rng.chance(self.sc.apps[dir].p_free) {
                    return Some(Phase::Release);
                }
                let idx = self.threads[t].buf.expect("buffer");
                let addr = Self::buf_addr(side, idx);
                let cap = self.sc.buffers[side][idx].0;
                let page = self.sc.page[side];
                let range = addr..(addr + cap).next_multiple_of(page);
                self.note(|| format!("side {side}: free {range:x?}"));
                let ticket = self.drivers[side].submit_evacuate(range);
                self.threads[t].waiting = Some(Wait::Evacuate(ticket));
                self.settle(side);
                self.threads[t].phase = Phase::Reuse;
                None
            }
            Phase::Reuse => {
                // free() returned: the memory is ordinary again and gets reused.
                let idx = self.threads[t].buf.expect("buffer");
                let addr = Self::buf_addr(side, idx);
                let cap = self.sc.buffers[side][idx].0;
                if let Some(p) = self.mems.borrow()[side].first_fault(addr, cap, true) {
                    self.violations.push(format!(
                        "side {side}: page {p:#x} still protected after free() was allowed to proceed"
                    ));
                }
                let junk = vec![0xeeu8; cap as usize];
                self.mems.borrow_mut()[side].write_raw(addr, &junk);
                Some(Phase::Release)
            }
            Phase::Release => {
                let idx = self.threads[t].buf.take().expect("buffer");
                self.procs[side].busy[idx] = false;
                if self.compute(t) {
                    self.threads[t].phase = Phase::Pick;
                    return None;
                }
                Some(Phase::Pick)
            }
            Phase::Finish => {
                if self.on_tcp(side) {
                    self.tcp.borrow_mut().shut[side] = true;
                    self.wake_tcp_readers(1 - side);
                }
                // The end of a joining stream goes on the fabric.
                self.join_now(side);
                self.drivers[side].shutdown(Shutdown::Write);
                self.settle(side);
                self.maybe_close(side, t);
                Some(Phase::Done)
            }
            _ => None,
        }
    }

    fn maybe_close(&mut self, side: usize, finishing: usize) {
        let others_done = self
            .threads
            .iter()
            .enumerate()
            .filter(|(i, th)| th.side == side && *i != finishing)
            .all(|(_, th)| matches!(th.phase, Phase::Done));
        if others_done && !self.procs[side].closed && self.runner_dead(side) {
            // An heir closes its TCP socket; the engine died with the
            // parent.
            self.procs[side].closed = true;
            self.tcp.borrow_mut().shut[side] = true;
            self.wake_tcp_readers(1 - side);
            return;
        }
        if others_done && !self.procs[side].closed {
            self.procs[side].closed = true;
            self.join_now(side);
            self.drivers[side].submit_close();
            self.settle(side);
        }
    }

    fn step_receiver(&mut self, t: usize, phase: Phase) -> Option<Phase> {
        let side = self.threads[t].side;
        let dir = self.threads[t].dir;
        let seed = self.sc.seed;
        match phase {
            Phase::Pick => {
                let Some(idx) = self.pick_buffer(t) else {
                    self.sleep(t, Duration::from_micros(20));
                    return None;
                };
                let ext = self.choose_extent(t, idx);
                self.threads[t].buf = Some(idx);
                self.threads[t].cur = ext;
                Some(Phase::Recv)
            }
            Phase::Recv => {
                if let Some(r) = self.threads[t]
                    .result
                    .is_some()
                    .then(|| self.take_result(t))
                {
                    let peek = self.threads[t].last_peek;
                    match r {
                        Ok(0) => {
                            self.threads[t].eof = true;
                            return Some(Phase::Release);
                        }
                        Ok(n) => {
                            let th = &mut self.threads[t];
                            let app = &self.sc.apps[dir];
                            let touch = (!peek && th.rng.chance(app.p_touch_recv)).then(|| {
                                let off = th.rng.below(n);
                                (off, 1 + th.rng.below((n - off).min(2 * self.sc.page[side])))
                            });
                            if let Some((off, len)) = touch {
                                return Some(Phase::RecvTouch {
                                    n,
                                    off,
                                    len,
                                    pos: 0,
                                });
                            }
                            return Some(Phase::Verify {
                                n,
                                peek,
                                touch: None,
                                pos: 0,
                            });
                        }
                        Err(CallError::WouldBlock) => {
                            self.sleep(t, Duration::from_micros(10));
                            self.threads[t].phase = Phase::Recv;
                            return None;
                        }
                        Err(CallError::Interrupted | CallError::Switched | CallError::OnTcp) => {
                            return Some(Phase::Recv);
                        }
                        Err(e) => {
                            self.threads[t].error = Some(e);
                            return Some(Phase::Release);
                        }
                    }
                }
                let (off, len) = self.threads[t].cur;
                let idx = self.threads[t].buf.expect("buffer");
                let addr = Self::buf_addr(side, idx) + off;
                let app = &self.sc.apps[dir];
                let th = &mut self.threads[t];
                let flags = RecvFlags {
                    nonblocking: th.rng.chance(app.p_nonblocking),
                    peek: th.rng.chance(app.p_peek),
                    waitall: th.rng.chance(app.p_waitall),
                    armable: self.sc.buffers[side][idx].1,
                };
                th.last_peek = flags.peek;
                if let Some(left) = self.recv_route_tcp(side) {
                    match self.recv_before_join(side, addr, len, left, flags) {
                        Some(r) => {
                            self.threads[t].result = Some(r);
                            return Some(Phase::Recv);
                        }
                        None => self.threads[t].waiting = Some(Wait::Tcp),
                    }
                    self.threads[t].phase = Phase::Recv;
                    return None;
                }
                if self.on_tcp(side) {
                    match self.tcp_recv(side, addr, len, flags) {
                        Some(r) => self.threads[t].result = Some(r),
                        None => self.threads[t].waiting = Some(Wait::Tcp),
                    }
                    if self.threads[t].result.is_some() {
                        return Some(Phase::Recv);
                    }
                    self.threads[t].phase = Phase::Recv;
                    return None;
                }
                if let Some(next) = self.fork_defers_call(t, Phase::Recv) {
                    return next;
                }
                let call = self.drivers[side].submit_recv(addr, len, flags);
                self.calls.insert((side, call), t);
                self.threads[t].waiting = Some(Wait::Call(call));
                self.settle(side);
                self.threads[t].phase = Phase::Recv;
                None
            }
            Phase::RecvTouch { n, off, len, pos } => {
                let (boff, _) = self.threads[t].cur;
                let addr = Self::buf_addr(side, self.threads[t].buf.expect("buffer")) + boff + off;
                let base = self.threads[t].pos + off;
                // The receiver writes the sender-side poison of the other direction.
                let f = move |p: u64, out: &mut [u8]| fill_poison(dir + 7, seed, base + p, out);
                let p = self.app_access(t, addr, len, pos, Some(&f));
                if p < len {
                    self.threads[t].phase = Phase::RecvTouch {
                        n,
                        off,
                        len,
                        pos: p,
                    };
                    return None;
                }
                Some(Phase::Verify {
                    n,
                    peek: false,
                    touch: Some((off, len)),
                    pos: 0,
                })
            }
            Phase::Verify {
                n,
                peek,
                touch,
                pos,
            } => {
                let (boff, _) = self.threads[t].cur;
                let addr = Self::buf_addr(side, self.threads[t].buf.expect("buffer")) + boff;
                if self.protect[side]
                    .borrow()
                    .lost
                    .iter()
                    .any(|r| r.start < addr + n && addr < r.end)
                {
                    // Reading promised-but-lost armed data: SIGBUS in the real
                    // system. recv() did return these bytes, so they count.
                    self.threads[t].sigbus = true;
                    if !peek {
                        self.threads[t].pos += n;
                    }
                    return Some(Phase::Release);
                }
                let p = self.app_access(t, addr, n, pos, None);
                if p < n {
                    self.threads[t].phase = Phase::Verify {
                        n,
                        peek,
                        touch,
                        pos: p,
                    };
                    return None;
                }
                self.verify(t, addr, n, touch);
                if !peek {
                    self.threads[t].pos += n;
                }
                Some(Phase::Release)
            }
            Phase::Release => {
                let idx = self.threads[t].buf.take().expect("buffer");
                self.procs[side].busy[idx] = false;
                let th = &self.threads[t];
                if th.eof || th.error.is_some() || th.sigbus {
                    return Some(Phase::Finish);
                }
                if self.compute(t) {
                    self.threads[t].phase = Phase::Pick;
                    return None;
                }
                Some(Phase::Pick)
            }
            Phase::Finish => {
                self.maybe_close(side, t);
                Some(Phase::Done)
            }
            _ => None,
        }
    }

    fn verify(&mut self, t: usize, addr: u64, n: u64, touch: Option<(u64, u64)>) {
        let side = self.threads[t].side;
        let dir = self.threads[t].dir;
        let start = self.threads[t].pos;
        let mut got = vec![0u8; n as usize];
        self.mems.borrow_mut()[side].read_raw(addr, &mut got);
        let mut want = vec![0u8; n as usize];
        fill_pattern(dir, self.sc.seed, start, &mut want);
        if let Some((off, len)) = touch {
            fill_poison(
                dir + 7,
                self.sc.seed,
                start + off,
                &mut want[off as usize..(off + len) as usize],
            );
        }
        if got != want {
            let i = got.iter().zip(&want).position(|(a, b)| a != b).unwrap_or(0);
            let mut poison = [0u8; 1];
            fill_poison(dir, self.sc.seed, start + i as u64, &mut poison);
            let why = if got[i] == poison[0] {
                "a write the sender made after send() returned reached the receiver"
            } else {
                "wrong byte"
            };
            self.violations.push(format!(
                "direction {dir}: stream offset {} (buffer {addr:#x}+{i}): got {:#04x}, expected {:#04x}: {why}",
                start + i as u64,
                got[i],
                want[i]
            ));
        }
    }

    // ----- end-of-run checks ------------------------------------------------

    fn check_end(mut self) -> SimReport {
        // (An heir whose runner died with bytes is reset, as the shim's.)
        let fatal = self.sc.injection.is_fatal() || (0..2).any(|s| self.heir_lost(s));
        for s in 0..2 {
            if self.heir_on_tcp(s) {
                self.fork_outcome.heirs_carried_on += 1;
            }
        }
        let aborted: Vec<bool> = (0..2)
            .map(|s| matches!(self.drivers[s].connection().state(), State::Aborted(_)))
            .collect();
        self.violations
            .append(&mut self.fabric.borrow_mut().violations);
        self.violations
            .append(&mut self.tcp.borrow_mut().violations);
        for log in &self.protect {
            self.violations.append(&mut log.borrow_mut().violations);
        }
        for (s, &aborted_s) in aborted.iter().enumerate() {
            if self.procs[s].dead || self.runner_dead(s) {
                continue;
            }
            for v in &self.mems.borrow()[s].violations {
                self.violations.push(format!("side {s}: {}", v.what));
            }
            let left = self.mems.borrow()[s].protected_pages();
            if !left.is_empty() {
                self.violations.push(format!(
                    "side {s}: {} page(s) still protected at the end, first {:x?}",
                    left.len(),
                    left[0]
                ));
            }
            if !self.drivers[s].connection().protected_ranges().is_empty()
                || !self.drivers[s].connection().armed_ranges().is_empty()
            {
                self.violations
                    .push(format!("side {s}: engine still holds protections"));
            }
            let (regs, pool) = {
                let f = self.fabric.borrow();
                (f.registrations(s), f.pool_in_use(s))
            };
            if regs != 0 {
                self.violations
                    .push(format!("side {s}: {regs} registration(s) leaked"));
            }
            if pool != 0 {
                self.violations
                    .push(format!("side {s}: {pool} pool buffer(s) leaked"));
            }
            if !self.protect[s].borrow().lost.is_empty() && !aborted_s {
                self.violations
                    .push(format!("side {s}: armed data lost on a healthy connection"));
            }
            let c = self.drivers[s].connection().counters();
            let posted = self.fabric.borrow().gets_posted[s];
            if c.gets != posted {
                self.violations.push(format!(
                    "side {s}: counters say {} GETs, the fabric saw {posted}",
                    c.gets
                ));
            }
            let copied: u64 = c.copied.iter().sum();
            if copied != c.bytes_sent_bsdp {
                self.violations.push(format!(
                    "side {s}: copied bytes by reason add up to {copied}, not the {} sent by copy",
                    c.bytes_sent_bsdp
                ));
            }
            let faults = c.send_faults + c.recv_faults + c.spurious_faults;
            if faults != self.procs[s].faults_raised {
                // A fault on a page both write-protected and armed counts twice.
                if faults < self.procs[s].faults_raised {
                    self.violations.push(format!(
                        "side {s}: counters say {faults} faults, the application took {}",
                        self.procs[s].faults_raised
                    ));
                }
            }
        }
        for (i, th) in self.threads.iter().enumerate() {
            if !matches!(th.phase, Phase::Done) && !self.procs[th.side].dead {
                self.violations.push(format!(
                    "hang: thread {i} ({:?} on side {}) stuck in {:?} waiting {:?}",
                    th.role, th.side, th.phase, th.waiting
                ));
            }
            if th.sigbus && !aborted[th.side] {
                self.violations
                    .push(format!("thread {i}: SIGBUS on a healthy connection"));
            }
        }
        // After a switch to TCP, the engines' counters say what crossed the
        // fabric only; the stream checks below cover all of it.
        let switched = (0..2).any(|s| *self.drivers[s].connection().state() == State::Switched);
        // Stream accounting per direction.
        for dir in 0..self.sc.apps.len() {
            let (snd, rcv) = (dir, 1 - dir);
            // A killed sender's thread may not have seen its last send() return;
            // its engine's counters (frozen at death) say what it accepted.
            let sent: u64 = if self.procs[snd].dead {
                self.drivers[snd].connection().counters().bytes_sent()
                    + self.tcp_sent_before_join[snd]
            } else {
                self.threads
                    .iter()
                    .filter(|t| t.dir == dir && t.role == Role::Sender)
                    .map(|t| t.pos)
                    .sum()
            };
            let recvd: u64 = self
                .threads
                .iter()
                .filter(|t| t.dir == dir && t.role == Role::Receiver)
                .map(|t| t.pos)
                .sum();
            let cs = self.drivers[snd].connection().counters().clone();
            let cr = self.drivers[rcv].connection().counters().clone();
            // Bytes that went over TCP before the join are the
            // application's, not the engine's.
            let (tcp_sent, tcp_taken) =
                (self.tcp_sent_before_join[snd], cr.tcp_received_before_join);
            if !self.procs[snd].dead && !switched && cs.bytes_sent() + tcp_sent != sent {
                self.violations.push(format!(
                    "direction {dir}: sender counters say {} bytes (+{tcp_sent} on TCP), send() returned {sent}",
                    cs.bytes_sent()
                ));
            }
            if !self.procs[rcv].dead && !switched && cr.bytes_received() + tcp_taken != recvd {
                self.violations.push(format!(
                    "direction {dir}: receiver counters say {} bytes (+{tcp_taken} from TCP), recv() returned {recvd}",
                    cr.bytes_received()
                ));
            }
            let joined = self.drivers[snd].connection().tx_joined();
            if !switched && !fatal && joined && cs.tcp_sent_before_join != tcp_sent {
                self.violations.push(format!(
                    "direction {dir}: the JOIN said {} bytes went over TCP, the application sent {tcp_sent} there",
                    cs.tcp_sent_before_join
                ));
            }
            // After a failure the count is ambiguous (a ZSDP send the peer
            // took may still report an error, as a TCP send may have been
            // lost after returning); the content checks still apply.
            if !fatal && recvd > sent {
                self.violations
                    .push(format!("direction {dir}: received {recvd} > sent {sent}"));
            }
            if !fatal {
                let rth = self
                    .threads
                    .iter()
                    .find(|t| t.dir == dir && t.role == Role::Receiver);
                let got_eof = rth.is_some_and(|t| t.eof);
                if recvd != sent || !got_eof {
                    self.violations.push(format!(
                        "direction {dir}: healthy run delivered {recvd} of {sent} bytes (eof: {got_eof})"
                    ));
                }
                if !switched
                    && (cs.bytes_sent_bsdp != cr.bytes_recv_bsdp
                        || cs.bytes_sent_async + cs.bytes_sent_sync != cr.bytes_recv_zcopy)
                {
                    self.violations.push(format!(
                        "direction {dir}: per-path bytes disagree: sent bsdp {} zcopy {}, received bsdp {} zcopy {}",
                        cs.bytes_sent_bsdp,
                        cs.bytes_sent_async + cs.bytes_sent_sync,
                        cr.bytes_recv_bsdp,
                        cr.bytes_recv_zcopy
                    ));
                }
            }
        }
        if !fatal && (aborted[0] || aborted[1]) {
            self.violations.push(format!(
                "healthy run aborted: {:?} / {:?}",
                self.drivers[0].connection().state(),
                self.drivers[1].connection().state()
            ));
        }
        let counters: [Counters; 2] = [
            self.drivers[0].connection().counters().clone(),
            self.drivers[1].connection().counters().clone(),
        ];
        SimReport {
            seed: self.sc.seed,
            violations: self.violations,
            counters,
            states: [
                self.drivers[0].connection().state().clone(),
                self.drivers[1].connection().state().clone(),
            ],
            sim_time: self.now - Timestamp::ZERO,
            events: self.events_run,
            trace: self.trace.take(),
            parked: self.procs.iter().map(|p| p.parked).sum(),
            park_fallbacks: self.procs.iter().map(|p| p.park_fallbacks).sum(),
            joined: self.sc.join.is_some()
                && self.drivers.iter().all(|d| d.connection().tx_joined()),
            fork: self.fork_outcome,
            scenario: self.sc,
        }
    }
}
