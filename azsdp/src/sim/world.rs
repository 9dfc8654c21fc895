//! The simulated world: two processes, each with memory, an engine, a
//! driver and application threads, joined by the sim fabric. One event loop
//! in simulated time; every random choice comes from the seed.

use std::cmp::Reverse;
use std::collections::{BinaryHeap, HashMap};
use std::ops::Range;
use std::time::Duration;

use super::SimReport;
use super::memory::{Prot, SimMemory};
use super::rng::Rng;
use super::scenario::{Injection, Scenario};
use crate::conn::{
    Access, Action, CallError, CallId, Completion, Connection, Counters, DisarmOutcome, Linger,
    OpError, RecvFlags, RemoteBuf, SendFlags, Shutdown, State, Ticket, UserBuf,
};
use crate::fabric::sim::SimFabric;
use crate::fabric::{Fabric, FabricEvent, OpResult};
use crate::time::Timestamp;
use crate::wire;

/// Produces the bytes an application write puts at a given offset.
type Filler = dyn Fn(u64, &mut [u8]);

/// Where each side's buffers and private copies live in simulated memory.
const BUF_BASE: u64 = 0x1000_0000;
const BUF_STRIDE: u64 = 0x100_0000;
const COPY_BASE: u64 = 0x4000_0000_0000;

#[derive(Debug)]
enum WEvent {
    Wake(usize),
    Host {
        side: usize,
        op: crate::conn::OpId,
        c: Completion,
    },
    Timer(usize),
    Poll(usize),
    Kill(usize),
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
    Fault(Ticket),
    Sleep,
}

/// One side's host: the sim driver's state.
#[derive(Debug, Default)]
struct Host {
    dead: bool,
    closed: bool,
    poll_at: Option<Timestamp>,
    timer_at: Option<Timestamp>,
    /// Messages the engine produced that the fabric has no credit for yet.
    outq: std::collections::VecDeque<Vec<u8>>,
    msgs_posted: u64,
    avails_posted: u64,
    next_copy: u64,
    faults_raised: u64,
    lost: Vec<Range<u64>>,
    busy: Vec<bool>,
    /// The process is stopped (SIGSTOP) during this interval.
    stalled: Option<(Timestamp, Timestamp)>,
}

pub struct World {
    sc: Scenario,
    now: Timestamp,
    rng: Rng,
    fabric: SimFabric,
    mems: [SimMemory; 2],
    conns: [Connection; 2],
    hosts: [Host; 2],
    threads: Vec<Thread>,
    heap: BinaryHeap<Reverse<(Timestamp, u64)>>,
    events: HashMap<u64, WEvent>,
    seq: u64,
    next_id: u64,
    calls: HashMap<CallId, usize>,
    tickets: HashMap<Ticket, usize>,
    violations: Vec<String>,
    trace: Option<Vec<String>>,
    events_run: u64,
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
        let mut fabric = SimFabric::new(sc.seed, sc.fabric.clone());
        let mut cfg0 = sc.engine[0].clone();
        let mut cfg1 = sc.engine[1].clone();
        cfg0.lock_region = fabric.endpoint(0).lock_region();
        cfg1.lock_region = fabric.endpoint(1).lock_region();
        let conns = [
            Connection::new(cfg0, Timestamp::ZERO),
            Connection::new(cfg1, Timestamp::ZERO),
        ];
        let mems = [SimMemory::new(sc.page[0]), SimMemory::new(sc.page[1])];
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
        let hosts = [
            Host {
                busy: vec![false; sc.buffers[0].len()],
                ..Host::default()
            },
            Host {
                busy: vec![false; sc.buffers[1].len()],
                ..Host::default()
            },
        ];
        let mut w = World {
            now: Timestamp::ZERO,
            rng,
            fabric,
            mems,
            conns,
            hosts,
            threads,
            heap: BinaryHeap::new(),
            events: HashMap::new(),
            seq: 0,
            next_id: 1,
            calls: HashMap::new(),
            tickets: HashMap::new(),
            violations: Vec::new(),
            trace: verbose.then(Vec::new),
            events_run: 0,
            sc,
        };
        for t in 0..w.threads.len() {
            w.schedule(Timestamp::ZERO, WEvent::Wake(t));
        }
        match w.sc.injection {
            Injection::Kill { side, at } => w.schedule(Timestamp::ZERO + at, WEvent::Kill(side)),
            Injection::Stall { side, at, dur } => {
                w.hosts[side].stalled = Some((Timestamp::ZERO + at, Timestamp::ZERO + at + dur));
            }
            _ => {}
        }
        w.drive(0);
        w.drive(1);
        w
    }

    fn schedule(&mut self, at: Timestamp, ev: WEvent) {
        self.seq += 1;
        self.heap.push(Reverse((at, self.seq)));
        self.events.insert(self.seq, ev);
    }

    fn note(&mut self, s: impl FnOnce() -> String) {
        if let Some(t) = self.trace.as_mut() {
            t.push(format!("{:?} {}", self.now, s()));
        }
    }

    fn fresh_id(&mut self) -> u64 {
        self.next_id += 1;
        self.next_id
    }

    fn buf_addr(side: usize, idx: usize) -> u64 {
        BUF_BASE + (side as u64) * 0x10_0000_0000 + idx as u64 * BUF_STRIDE
    }

    fn side_of(ev: &WEvent, threads: &[Thread]) -> usize {
        match *ev {
            WEvent::Wake(t) => threads[t].side,
            WEvent::Host { side, .. }
            | WEvent::Timer(side)
            | WEvent::Poll(side)
            | WEvent::Kill(side)
            | WEvent::Cancel { side, .. } => side,
        }
    }

    /// Run to completion; return the report.
    pub fn run(mut self) -> SimReport {
        let limit = Timestamp::ZERO + self.sc.time_limit;
        loop {
            if self.finished() {
                break;
            }
            let tw = self.heap.peek().map(|Reverse((t, _))| *t);
            let tf = self.fabric.next_event_time();
            let next = match (tw, tf) {
                (Some(a), Some(b)) => a.min(b),
                (Some(a), None) | (None, Some(a)) => a,
                (None, None) => {
                    self.violations
                        .push("hang: nothing scheduled but the run is not finished".into());
                    break;
                }
            };
            if next > limit || self.events_run > 20_000_000 {
                self.violations
                    .push(format!("hang: still running at {:?}", self.now));
                break;
            }
            self.now = self.now.max(next);
            self.fabric.advance(self.now, &mut self.mems);
            for side in 0..2 {
                if self.fabric.has_ready(side)
                    && self.hosts[side].poll_at.is_none()
                    && !self.hosts[side].dead
                {
                    let (lo, hi) = self.sc.skew[side];
                    let d = lo + self.rng.below(hi - lo + 1);
                    let at = self.now + Duration::from_nanos(d);
                    self.hosts[side].poll_at = Some(at);
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
                if let Some((from, until)) = self.hosts[side].stalled
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
                self.run_event(ev);
            }
        }
        self.check_end()
    }

    fn finished(&self) -> bool {
        let threads_done = self
            .threads
            .iter()
            .all(|t| matches!(t.phase, Phase::Done) || self.hosts[t.side].dead);
        threads_done
            && (0..2).all(|s| {
                self.hosts[s].dead || (self.hosts[s].closed && self.conns[s].is_finished())
            })
    }

    fn run_event(&mut self, ev: WEvent) {
        match ev {
            WEvent::Wake(t) => {
                if self.hosts[self.threads[t].side].dead {
                    return;
                }
                if self.threads[t].waiting == Some(Wait::Sleep) {
                    self.threads[t].waiting = None;
                }
                if self.threads[t].waiting.is_none() {
                    self.step(t);
                }
            }
            WEvent::Host { side, op, c } => {
                if self.hosts[side].dead {
                    return;
                }
                self.note(|| format!("side {side}: {op:?} -> {c:?}"));
                self.conns[side].handle_completion(self.now, op, c, &mut self.mems[side]);
                self.drive(side);
            }
            WEvent::Timer(side) => {
                self.hosts[side].timer_at = None;
                if self.hosts[side].dead {
                    return;
                }
                if self.conns[side]
                    .poll_timeout()
                    .is_some_and(|t| t <= self.now)
                {
                    self.conns[side].handle_timeout(self.now, &mut self.mems[side]);
                }
                self.drive(side);
            }
            WEvent::Poll(side) => {
                self.hosts[side].poll_at = None;
                if self.hosts[side].dead {
                    return;
                }
                self.poll_fabric(side);
            }
            WEvent::Cancel { side, call } => {
                if !self.hosts[side].dead && self.calls.contains_key(&call) {
                    self.note(|| format!("side {side}: signal interrupts {call:?}"));
                    self.conns[side].cancel(self.now, call, &mut self.mems[side]);
                    self.drive(side);
                }
            }
            WEvent::Kill(side) => {
                self.note(|| format!("KILL side {side}"));
                self.hosts[side].dead = true;
                self.fabric.kill(side);
            }
        }
    }

    fn poll_fabric(&mut self, side: usize) {
        enum Ev {
            Msg(Vec<u8>),
            Done(crate::conn::OpId, OpResult),
            Gone,
        }
        let mut evs = Vec::new();
        self.fabric.endpoint(side).poll(&mut |e| {
            evs.push(match e {
                FabricEvent::Message(m) => Ev::Msg(m.to_vec()),
                FabricEvent::Done { op, result } => Ev::Done(op, result),
                FabricEvent::PeerGone { .. } => Ev::Gone,
            })
        });
        for e in evs {
            let now = self.now;
            match e {
                Ev::Msg(m) => {
                    if self.trace.is_some() {
                        let d = describe(&m);
                        self.note(|| format!("side {side} <- {d}"));
                    }
                    self.conns[side].handle_message(now, &m, &mut self.mems[side]);
                }
                Ev::Done(op, r) => {
                    let c = match r {
                        OpResult::Get(r) => Completion::Get(r),
                        OpResult::Cas(r) => Completion::Cas(r),
                    };
                    self.conns[side].handle_completion(now, op, c, &mut self.mems[side]);
                }
                Ev::Gone => {
                    self.note(|| format!("side {side}: peer gone"));
                    self.conns[side].handle_peer_gone(now);
                }
            }
            self.drive(side);
        }
        // The peer may have been waiting for room in this side's ring.
        if !self.hosts[1 - side].dead {
            self.flush(1 - side);
        }
    }

    /// Execute the engine's actions and post its messages.
    fn drive(&mut self, side: usize) {
        if self.hosts[side].dead {
            return;
        }
        loop {
            let mut any = false;
            while let Some(a) = self.conns[side].poll_action() {
                any = true;
                self.exec(side, a);
            }
            let mut buf = vec![0u8; self.conns[side].max_message_len()];
            while let Some(n) = self.conns[side].poll_transmit(&mut buf) {
                any = true;
                let msg = self.inject(side, buf[..n].to_vec());
                self.hosts[side].outq.push_back(msg);
            }
            if !any {
                break;
            }
        }
        self.flush(side);
        if let Some(t) = self.conns[side].poll_timeout()
            && self.hosts[side].timer_at.is_none_or(|x| x > t)
        {
            self.hosts[side].timer_at = Some(t);
            let at = t.max(self.now);
            self.schedule(at, WEvent::Timer(side));
        }
    }

    fn flush(&mut self, side: usize) {
        while let Some(m) = self.hosts[side].outq.front() {
            let r = self.fabric.endpoint(side).post_message(m);
            match r {
                Ok(()) => {
                    self.hosts[side].outq.pop_front();
                }
                // No transport credit: retried when the peer drains its ring.
                Err(_) => break,
            }
        }
    }

    /// Apply the scenario's message injection to an outgoing message.
    fn inject(&mut self, side: usize, mut msg: Vec<u8>) -> Vec<u8> {
        let nth = self.hosts[side].msgs_posted;
        self.hosts[side].msgs_posted += 1;
        if self.trace.is_some() {
            let d = describe(&msg);
            self.note(|| format!("side {side} -> {d}"));
        }
        match self.sc.injection {
            Injection::Garbage { side: s, nth: k } if s == side && k == nth => {
                let kind = self.rng.below(3);
                match kind {
                    0 => {
                        let n = self.rng.below(64) as usize;
                        msg = (0..n).map(|_| self.rng.next_u32() as u8).collect();
                    }
                    1 => msg[0] ^= 0x80,  // version
                    _ => msg[14] ^= 0x01, // reserved
                }
                self.note(|| format!("side {side}: garbage injected"));
            }
            Injection::Lie { side: s, nth: k } if s == side => {
                if let Ok(f) = wire::parse(&msg)
                    && let wire::Message::SrcAvail(mut a) = f.msg
                {
                    let this = self.hosts[side].avails_posted;
                    self.hosts[side].avails_posted += 1;
                    if this == k {
                        if self.rng.chance(0.5) {
                            a.key ^= 0x5555;
                        } else {
                            a.addr = a.addr.wrapping_add(1 << 30);
                        }
                        let frame = wire::Frame {
                            msg: wire::Message::SrcAvail(a),
                            ..f
                        };
                        let mut out = vec![0u8; frame.wire_len()];
                        wire::emit(&frame, &mut out).expect("room");
                        msg = out;
                        self.note(|| format!("side {side}: SRC_AVAIL lies"));
                    }
                }
            }
            _ => {}
        }
        msg
    }

    fn host_done(&mut self, side: usize, op: crate::conn::OpId, c: Completion) {
        // Host operations usually complete at once; sometimes a little later.
        let delay = if self.rng.chance(0.7) {
            0
        } else {
            self.rng.below(3_000)
        };
        let at = self.now + Duration::from_nanos(delay);
        self.schedule(at, WEvent::Host { side, op, c });
    }

    fn exec(&mut self, side: usize, a: Action) {
        match a {
            Action::PrepareSource {
                op,
                addr,
                len,
                protect,
            } => {
                self.note(|| {
                    format!("side {side}: prepare {op:?} {addr:#x}+{len} protect {protect:x?}")
                });
                if self.rng.chance(self.sc.p_prepare_fail) {
                    self.host_done(side, op, Completion::Prepared(Err(OpError::Local)));
                    return;
                }
                for r in protect {
                    let wrong =
                        self.mems[side].set_prot(r.clone(), Prot::None, Prot::WriteProtected);
                    if !wrong.is_empty() {
                        self.violations.push(format!(
                            "side {side}: protect of {r:x?} found pages already protected: {wrong:x?}"
                        ));
                    }
                }
                let key = self
                    .fabric
                    .endpoint(side)
                    .register(addr, len)
                    .expect("sim register");
                self.host_done(side, op, Completion::Prepared(Ok(key)));
            }
            Action::ReleaseSource { key, .. } => {
                if !self.fabric.is_registered(side, key) {
                    self.violations.push(format!(
                        "side {side}: release of unregistered source key {key}"
                    ));
                }
                self.fabric.endpoint(side).deregister(key);
            }
            Action::Unprotect { range } => {
                let wrong =
                    self.mems[side].set_prot(range.clone(), Prot::WriteProtected, Prot::None);
                if !wrong.is_empty() {
                    self.violations.push(format!(
                        "side {side}: unprotect of {range:x?} found unprotected pages {wrong:x?}"
                    ));
                }
            }
            Action::Arm { op, range } => {
                if self.rng.chance(self.sc.p_arm_fail) {
                    self.host_done(side, op, Completion::Armed(Err(OpError::Local)));
                    return;
                }
                let wrong = self.mems[side].set_prot(range.clone(), Prot::None, Prot::Armed);
                if !wrong.is_empty() {
                    self.violations.push(format!(
                        "side {side}: arm of {range:x?} found protected pages {wrong:x?}"
                    ));
                }
                self.host_done(side, op, Completion::Armed(Ok(())));
            }
            Action::Disarm { range, outcome } => {
                let wrong = self.mems[side].set_prot(range.clone(), Prot::Armed, Prot::None);
                if !wrong.is_empty() {
                    self.violations.push(format!(
                        "side {side}: disarm of {range:x?} found unarmed pages {wrong:x?}"
                    ));
                }
                if outcome == DisarmOutcome::Lost {
                    self.hosts[side].lost.push(range);
                }
            }
            Action::Get {
                op,
                src,
                dst,
                len,
                armed,
            } => {
                let _ = self
                    .fabric
                    .endpoint(side)
                    .post_get(op, src, dst, len, armed);
            }
            Action::Cas {
                op,
                target,
                expect,
                new,
            } => {
                let _ = self.fabric.endpoint(side).post_cas(op, target, expect, new);
            }
            Action::CopyAside { op, addr, len } => {
                if self.rng.chance(self.sc.p_copy_fail) {
                    self.host_done(side, op, Completion::Copied(Err(OpError::Local)));
                    return;
                }
                if self.mems[side].first_fault(addr, len, false).is_some() {
                    self.violations.push(format!(
                        "side {side}: copy-aside reads armed pages at {addr:#x}"
                    ));
                }
                let dst = COPY_BASE + (side as u64) * 0x1000_0000_0000 + self.hosts[side].next_copy;
                self.hosts[side].next_copy +=
                    len.next_multiple_of(self.sc.page[side]) + self.sc.page[side];
                let mut tmp = vec![0u8; len as usize];
                self.mems[side].read_raw(addr, &mut tmp);
                self.mems[side].write_raw(dst, &tmp);
                let key = self
                    .fabric
                    .endpoint(side)
                    .register(dst, len)
                    .expect("sim register");
                self.host_done(
                    side,
                    op,
                    Completion::Copied(Ok(RemoteBuf { addr: dst, key })),
                );
            }
            Action::ReleaseCopy { buf, len } => {
                if !self.fabric.is_registered(side, buf.key) {
                    self.violations.push(format!(
                        "side {side}: release of unregistered copy key {}",
                        buf.key
                    ));
                }
                self.fabric.endpoint(side).deregister(buf.key);
                self.mems[side].discard(buf.addr..buf.addr + len);
            }
            Action::RevokeAccess => self.fabric.endpoint(side).revoke_access(),
            Action::CallDone { call, result } => {
                self.note(|| format!("side {side}: {call:?} done: {result:?}"));
                let Some(t) = self.calls.remove(&call) else {
                    self.violations
                        .push(format!("side {side}: CallDone for unknown {call:?}"));
                    return;
                };
                self.threads[t].waiting = None;
                self.threads[t].result = Some(result);
                self.schedule(self.now, WEvent::Wake(t));
            }
            Action::Resume { ticket } => {
                let Some(t) = self.tickets.remove(&ticket) else {
                    self.violations
                        .push(format!("side {side}: Resume for unknown {ticket:?}"));
                    return;
                };
                self.threads[t].waiting = None;
                self.schedule(self.now, WEvent::Wake(t));
            }
        }
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
            if let Some(fp) = self.mems[side].first_fault(a, k, write.is_some()) {
                let ticket = Ticket(self.fresh_id());
                self.tickets.insert(ticket, t);
                self.threads[t].waiting = Some(Wait::Fault(ticket));
                self.hosts[side].faults_raised += 1;
                let access = if write.is_some() {
                    Access::Write
                } else {
                    Access::Read
                };
                self.note(|| format!("side {side}: fault {access:?} at {fp:#x}"));
                self.conns[side].handle_fault(self.now, ticket, fp, access);
                self.drive(side);
                return p;
            }
            if let Some(f) = write {
                let mut tmp = vec![0u8; k as usize];
                f(p, &mut tmp);
                self.mems[side].write_raw(a, &tmp);
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
            .find(|&i| !self.hosts[side].busy[i])?;
        self.hosts[side].busy[idx] = true;
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
                        // EINTR: the application retries.
                        Err(CallError::Interrupted) => {}
                        Err(e) => {
                            self.threads[t].error = Some(e);
                            return Some(Phase::Finish);
                        }
                    }
                }
                let (off, len) = self.threads[t].cur;
                let sent = self.threads[t].sent;
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
                let call = CallId(self.fresh_id());
                self.calls.insert(call, t);
                self.threads[t].waiting = Some(Wait::Call(call));
                self.note(|| format!("side {side}: {call:?} send {addr:#x}+{} nonblocking {nonblocking} protectable {protectable}", len - sent));
                self.conns[side].send(
                    self.now,
                    call,
                    UserBuf {
                        addr,
                        len: len - sent,
                    },
                    SendFlags {
                        nonblocking,
                        protectable,
                    },
                    &mut self.mems[side],
                );
                self.drive(side);
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
                self.mems[side].read_raw(addr, &mut got);
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
                let ticket = Ticket(self.fresh_id());
                self.tickets.insert(ticket, t);
                self.threads[t].waiting = Some(Wait::Fault(ticket));
                self.note(|| format!("side {side}: free {range:x?}"));
                self.conns[side].evacuate(self.now, ticket, range, &mut self.mems[side]);
                self.drive(side);
                self.threads[t].phase = Phase::Reuse;
                None
            }
            Phase::Reuse => {
                // free() returned: the memory is ordinary again and gets reused.
                let idx = self.threads[t].buf.expect("buffer");
                let addr = Self::buf_addr(side, idx);
                let cap = self.sc.buffers[side][idx].0;
                if let Some(p) = self.mems[side].first_fault(addr, cap, true) {
                    self.violations.push(format!(
                        "side {side}: page {p:#x} still protected after free() was allowed to proceed"
                    ));
                }
                let junk = vec![0xeeu8; cap as usize];
                self.mems[side].write_raw(addr, &junk);
                Some(Phase::Release)
            }
            Phase::Release => {
                let idx = self.threads[t].buf.take().expect("buffer");
                self.hosts[side].busy[idx] = false;
                if self.compute(t) {
                    self.threads[t].phase = Phase::Pick;
                    return None;
                }
                Some(Phase::Pick)
            }
            Phase::Finish => {
                self.conns[side].shutdown(self.now, Shutdown::Write, &mut self.mems[side]);
                self.drive(side);
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
        if others_done && !self.hosts[side].closed {
            self.hosts[side].closed = true;
            self.conns[side].close(self.now, Linger::Background, &mut self.mems[side]);
            self.drive(side);
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
                        Err(CallError::Interrupted) => return Some(Phase::Recv),
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
                let call = CallId(self.fresh_id());
                self.calls.insert(call, t);
                self.threads[t].waiting = Some(Wait::Call(call));
                self.conns[side].recv(
                    self.now,
                    call,
                    UserBuf { addr, len },
                    flags,
                    &mut self.mems[side],
                );
                self.drive(side);
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
                if self.hosts[side]
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
                self.hosts[side].busy[idx] = false;
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
        self.mems[side].read_raw(addr, &mut got);
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
        let fatal = self.sc.injection.is_fatal();
        let aborted: Vec<bool> = (0..2)
            .map(|s| matches!(self.conns[s].state(), State::Aborted(_)))
            .collect();
        for (s, &aborted_s) in aborted.iter().enumerate() {
            if self.hosts[s].dead {
                continue;
            }
            for v in &self.mems[s].violations {
                self.violations.push(format!("side {s}: {}", v.what));
            }
            let left = self.mems[s].protected_pages();
            if !left.is_empty() {
                self.violations.push(format!(
                    "side {s}: {} page(s) still protected at the end, first {:x?}",
                    left.len(),
                    left[0]
                ));
            }
            if !self.conns[s].protected_ranges().is_empty()
                || !self.conns[s].armed_ranges().is_empty()
            {
                self.violations
                    .push(format!("side {s}: engine still holds protections"));
            }
            if self.fabric.registrations(s) != 0 {
                self.violations.push(format!(
                    "side {s}: {} registration(s) leaked",
                    self.fabric.registrations(s)
                ));
            }
            if !self.hosts[s].lost.is_empty() && !aborted_s {
                self.violations
                    .push(format!("side {s}: armed data lost on a healthy connection"));
            }
            let c = self.conns[s].counters();
            if c.gets != self.fabric.gets_posted[s] {
                self.violations.push(format!(
                    "side {s}: counters say {} GETs, the fabric saw {}",
                    c.gets, self.fabric.gets_posted[s]
                ));
            }
            let faults = c.send_faults + c.recv_faults + c.spurious_faults;
            if faults != self.hosts[s].faults_raised {
                // A fault on a page both write-protected and armed counts twice.
                if faults < self.hosts[s].faults_raised {
                    self.violations.push(format!(
                        "side {s}: counters say {faults} faults, the application took {}",
                        self.hosts[s].faults_raised
                    ));
                }
            }
        }
        for (i, th) in self.threads.iter().enumerate() {
            if !matches!(th.phase, Phase::Done) && !self.hosts[th.side].dead {
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
        // Stream accounting per direction.
        for dir in 0..self.sc.apps.len() {
            let (snd, rcv) = (dir, 1 - dir);
            // A killed sender's thread may not have seen its last send() return;
            // its engine's counters (frozen at death) say what it accepted.
            let sent: u64 = if self.hosts[snd].dead {
                self.conns[snd].counters().bytes_sent()
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
            let cs = self.conns[snd].counters().clone();
            let cr = self.conns[rcv].counters().clone();
            if !self.hosts[snd].dead && cs.bytes_sent() != sent {
                self.violations.push(format!(
                    "direction {dir}: sender counters say {} bytes, send() returned {sent}",
                    cs.bytes_sent()
                ));
            }
            if !self.hosts[rcv].dead && cr.bytes_received() != recvd {
                self.violations.push(format!(
                    "direction {dir}: receiver counters say {} bytes, recv() returned {recvd}",
                    cr.bytes_received()
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
                if cs.bytes_sent_bsdp != cr.bytes_recv_bsdp
                    || cs.bytes_sent_async + cs.bytes_sent_sync != cr.bytes_recv_zcopy
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
                self.conns[0].state(),
                self.conns[1].state()
            ));
        }
        let counters: [Counters; 2] = [
            self.conns[0].counters().clone(),
            self.conns[1].counters().clone(),
        ];
        SimReport {
            seed: self.sc.seed,
            violations: self.violations,
            counters,
            states: [self.conns[0].state().clone(), self.conns[1].state().clone()],
            sim_time: self.now - Timestamp::ZERO,
            events: self.events_run,
            trace: self.trace.unwrap_or_default(),
            scenario: self.sc,
        }
    }
}

/// One line describing a wire message, for traces.
fn describe(m: &[u8]) -> String {
    match wire::parse(m) {
        Ok(f) => match f.msg {
            wire::Message::Data(p) => format!("#{} DATA {}B cr{}", f.seq, p.len(), f.credits),
            msg => format!("#{} {:?} cr{}", f.seq, msg, f.credits),
        },
        Err(e) => format!("garbage ({e})"),
    }
}
