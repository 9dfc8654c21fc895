//! The `sim` fabric: two endpoints joined by a deterministic, seeded model
//! of an RC connection.
//!
//! - Messages arrive in order after a random latency; each direction has a
//!   ring of fixed capacity (transport credits).
//! - Registrations complete after a random delay (and may fail, as a
//!   NIC's may); every GET needs a key on both sides, checked with bounds
//!   and access (a lying peer gets [`OpError::RemoteAccess`]; a driver
//!   that gets into unregistered memory is a violation).
//! - A GET moves its bytes in chunks, each at a random instant between post
//!   and completion, as a NIC may.
//! - A compare-and-swap executes atomically at a random instant before its
//!   completion.
//! - Completions of one endpoint arrive in post order (RC send queues do).
//! - A side can die (its memory becomes unreachable, its messages in flight
//!   are lost, the survivor learns after a delay, with how far the dead
//!   side's calls had got, as shm tells) or revoke the peer's access.
//! - Copies go to a pool in the side's memory, which the fabric hands out
//!   and takes back.
//! - The scenario's hostile injections (garbage, lying advertisements) are
//!   applied to messages as they are posted: the fabric is where a hostile
//!   peer's bytes come from.
//!
//! Everything is driven by [`SimFabric::advance`]; each side's driver holds
//! a [`SimEndpoint`], a handle on the shared fabric.

use std::cell::RefCell;
use std::cmp::Reverse;
use std::collections::{BinaryHeap, HashMap, VecDeque};
use std::ops::Range;
use std::rc::Rc;
use std::time::Duration;

use super::{Fabric, FabricError, FabricEvent, LocalBuf, OpResult, Ownership, RegAccess, Sharing};
use crate::conn::{CasTarget, Departure, LockRegion, OpError, OpId, RemoteBuf};
use crate::sim::Trace;
use crate::sim::memory::SharedMems;
use crate::sim::rng::Rng;
use crate::sim::scenario::Injection;
use crate::time::Timestamp;
use crate::wire;

/// Timing and capacity of the simulated fabric.
#[derive(Clone, Debug)]
pub struct SimFabricParams {
    /// One-way message latency range, in nanoseconds.
    pub msg_latency: (u64, u64),
    /// Fixed part of a one-sided operation, in nanoseconds.
    pub op_latency: (u64, u64),
    /// GET bandwidth, bytes per microsecond.
    pub bytes_per_us: u64,
    /// Messages each direction's ring holds.
    pub ring_capacity: usize,
    /// How long the survivor takes to notice a dead peer.
    pub death_detect: Duration,
    /// Lock words per side.
    pub lock_slots: u16,
    /// Chance that a registration for the peer fails.
    pub p_register_fail: f64,
    /// How it fails (a resource, or the locked-memory limit).
    pub register_error: OpError,
    /// Chance that the pool has no room for a copy.
    pub p_pool_fail: f64,
    /// Chance that the survivor of a death is not told how far the dead
    /// side's calls had got (shm tells, unless its segment was corrupt).
    pub p_departure_unknown: f64,
}

impl Default for SimFabricParams {
    fn default() -> Self {
        SimFabricParams {
            msg_latency: (500, 5_000),
            op_latency: (1_000, 10_000),
            bytes_per_us: 4_000,
            ring_capacity: 256,
            death_detect: Duration::from_millis(1),
            lock_slots: 16,
            p_register_fail: 0.0,
            register_error: OpError::Local,
            p_pool_fail: 0.0,
            p_departure_unknown: 0.25,
        }
    }
}

#[derive(Debug)]
enum Ready {
    Msg(Vec<u8>),
    Done(OpId, OpResult),
    PeerGone(Option<Departure>),
}

/// A registration: where, and for what.
#[derive(Clone, Copy, Debug)]
struct Region {
    addr: u64,
    len: u64,
    access: RegAccess,
}

/// The words the processes holding one side after a fork share (see
/// [`Sharing`]), as shm keeps them in the segment.
#[derive(Debug, Default)]
struct Shared {
    /// The process that runs the side; with [`FROZEN`], the one whose fork
    /// froze it, until a process claims it.
    owner: u32,
    /// Forks that froze the side so far: only copies made by the last one
    /// may claim it (a copy left from an earlier fork lost it for good).
    generation: u32,
    /// A process that does not run the side asked the runner to move it
    /// onto TCP.
    leave: bool,
    /// The side moved onto TCP (its runner did, or the peer did for its
    /// heirs).
    left: bool,
    /// Another process of this side carries on after its runner dies (an
    /// heir).
    heir: bool,
}

/// [`Shared::owner`]'s frozen bit.
const FROZEN: u32 = 1 << 31;

/// The process id of a side's first process (its forks take others).
pub const FIRST_PID: [u32; 2] = [100, 200];

#[derive(Debug)]
struct Side {
    alive: bool,
    shared: Shared,
    /// This side revoked the peer's access to its memory.
    revoked: bool,
    lock: LockRegion,
    lock_words: Vec<u64>,
    regions: HashMap<u32, Region>,
    /// Local registrations deregistered but kept pinned, as a cache keeps
    /// them (until `unpin_near`).
    kept: Vec<Range<u64>>,
    next_key: u32,
    /// Pool memory handed out: start -> length.
    pool: HashMap<u64, u64>,
    pool_next: u64,
    /// How far this side's calls have got (told to the peer if it dies).
    progress: Departure,
    msgs_posted: u64,
    avails_posted: u64,
    /// Completions and messages ready for this side, in order.
    ready: VecDeque<Ready>,
    /// Messages in flight to this side plus those ready but not polled.
    inbound: usize,
    /// Arrival time of the last message sent to this side (FIFO).
    last_arrival: Timestamp,
    /// Completion time of the last operation this side posted (in order).
    last_completion: Timestamp,
    gone_reported: bool,
}

#[derive(Debug)]
struct GetOp {
    side: usize,
    op: OpId,
    src: RemoteBuf,
    dst: LocalBuf,
    len: u64,
    failed: Option<OpError>,
}

#[derive(Debug)]
enum Event {
    Arrive {
        to: usize,
        msg: Vec<u8>,
    },
    GetChunk {
        get: u64,
        off: u64,
        len: u64,
    },
    GetDone {
        get: u64,
    },
    CasExec {
        side: usize,
        target: CasTarget,
        expect: u64,
        new: u64,
        done: u64,
    },
    CasDone {
        side: usize,
        op: OpId,
        result: Result<u64, OpError>,
    },
    Registered {
        side: usize,
        op: OpId,
        result: Result<u32, OpError>,
    },
    NotifyGone {
        to: usize,
    },
}

/// Two simulated endpoints and the link between them.
#[derive(Debug)]
pub struct SimFabric {
    now: Timestamp,
    rng: Rng,
    params: SimFabricParams,
    sides: [Side; 2],
    heap: BinaryHeap<Reverse<(Timestamp, u64)>>,
    events: HashMap<u64, Event>,
    gets: HashMap<u64, GetOp>,
    seq: u64,
    mems: SharedMems,
    trace: Trace,
    injection: Injection,
    /// Counters for invariant checks.
    pub gets_posted: [u64; 2],
    /// What the drivers did that the contract forbids.
    pub violations: Vec<String>,
    /// Each side has posted its SWITCH (the peer will learn it is leaving,
    /// and read TCP from then on).
    pub switch_posted: [bool; 2],
    /// Does the fabric vouch for a live peer (`Fabric::peer_vouched`)? As
    /// shm does for a stopped or busy process; off, as for one whose
    /// threads all sleep.
    pub vouches: bool,
}

/// Where the simulated lock words of each side live.
const LOCK_BASE: [u64; 2] = [0x7f00_0000_0000, 0x7e00_0000_0000];
/// Where each side's pool lives in its memory.
const POOL_BASE: [u64; 2] = [0x4000_0000_0000, 0x5000_0000_0000];

impl SimFabric {
    /// The fabric between the two memories of `mems`; `trace` gets a line
    /// per message when it is on; `injection` is the scenario's.
    pub fn new(
        seed: u64,
        params: SimFabricParams,
        mems: SharedMems,
        trace: Trace,
        injection: Injection,
    ) -> Self {
        let mut rng = Rng::new(seed ^ 0xfab1c);
        let mk = |i: usize, rng: &mut Rng| Side {
            alive: true,
            shared: Shared {
                owner: FIRST_PID[i],
                ..Shared::default()
            },
            revoked: false,
            lock: LockRegion {
                addr: LOCK_BASE[i],
                key: rng.next_u32() | 1,
                slots: params.lock_slots,
            },
            lock_words: vec![0; usize::from(params.lock_slots)],
            regions: HashMap::new(),
            kept: Vec::new(),
            next_key: 0x100 + i as u32 * 0x1000_0000,
            pool: HashMap::new(),
            pool_next: POOL_BASE[i],
            progress: Departure { sent: 0, read: 0 },
            msgs_posted: 0,
            avails_posted: 0,
            ready: VecDeque::new(),
            inbound: 0,
            last_arrival: Timestamp::ZERO,
            last_completion: Timestamp::ZERO,
            gone_reported: false,
        };
        let sides = [mk(0, &mut rng), mk(1, &mut rng)];
        SimFabric {
            now: Timestamp::ZERO,
            rng,
            params,
            sides,
            heap: BinaryHeap::new(),
            events: HashMap::new(),
            gets: HashMap::new(),
            seq: 0,
            mems,
            trace,
            injection,
            gets_posted: [0; 2],
            violations: Vec::new(),
            switch_posted: [false; 2],
            vouches: true,
        }
    }

    /// The fabric, shared by the two endpoints and the world.
    pub fn shared(self) -> Rc<RefCell<SimFabric>> {
        Rc::new(RefCell::new(self))
    }

    pub fn now(&self) -> Timestamp {
        self.now
    }

    /// When the next internal event happens, if any.
    pub fn next_event_time(&self) -> Option<Timestamp> {
        self.heap.peek().map(|Reverse((t, _))| *t)
    }

    /// Does `side` have events ready to poll?
    pub fn has_ready(&self, side: usize) -> bool {
        !self.sides[side].ready.is_empty()
    }

    pub fn is_alive(&self, side: usize) -> bool {
        self.sides[side].alive
    }

    /// Current value of one of `side`'s lock words (for checks).
    pub fn lock_word(&self, side: usize, slot: usize) -> u64 {
        self.sides[side].lock_words[slot]
    }

    /// Does `side` hold registration `key`?
    pub fn is_registered(&self, side: usize, key: u32) -> bool {
        self.sides[side].regions.contains_key(&key)
    }

    /// Registrations `side` still holds (for leak checks).
    pub fn registrations(&self, side: usize) -> usize {
        self.sides[side].regions.len()
    }

    /// Pool buffers `side` still holds (for leak checks).
    pub fn pool_in_use(&self, side: usize) -> usize {
        self.sides[side].pool.len()
    }

    /// Lock region of `side`.
    pub fn lock_region(&self, side: usize) -> LockRegion {
        self.sides[side].lock
    }

    fn schedule(&mut self, at: Timestamp, ev: Event) -> u64 {
        self.seq += 1;
        let id = self.seq;
        self.heap.push(Reverse((at, id)));
        self.events.insert(id, ev);
        id
    }

    fn rand_in(&mut self, (lo, hi): (u64, u64)) -> u64 {
        if hi <= lo {
            lo
        } else {
            lo + self.rng.below(hi - lo + 1)
        }
    }

    /// Kill `side`: its memory becomes unreachable and its undelivered
    /// messages are lost; the peer learns after `death_detect`.
    /// Like [`SimFabric::kill`], with a process of `side` that carries on
    /// (an heir: the peer moves the stream onto TCP for it).
    pub fn kill_with_heir(&mut self, side: usize) {
        self.sides[side].shared.heir = true;
        self.kill(side);
    }

    /// Did the peer of `side` (its process dead) mark `side` left for its
    /// heirs?
    pub fn left_for_heirs(&self, side: usize) -> bool {
        self.sides[side].shared.left
    }

    pub fn kill(&mut self, side: usize) {
        if !self.sides[side].alive {
            return;
        }
        self.sides[side].alive = false;
        let peer = 1 - side;
        // Messages from the dead side still in flight are lost.
        let lost: Vec<u64> = self
            .events
            .iter()
            .filter(|(_, e)| matches!(e, Event::Arrive { to, .. } if *to == peer))
            .map(|(id, _)| *id)
            .collect();
        for id in lost {
            self.events.remove(&id);
            self.sides[peer].inbound -= 1;
        }
        let at = self.now + self.params.death_detect;
        self.schedule(at, Event::NotifyGone { to: peer });
    }

    /// Can `side` fill `len` bytes of memory at `addr` (registered)?
    fn covered(&self, side: usize, key: u32, addr: u64, len: u64, access: RegAccess) -> bool {
        self.sides[side].regions.get(&key).is_some_and(|r| {
            r.access == access
                && addr >= r.addr
                && addr.checked_add(len).is_some_and(|e| e <= r.addr + r.len)
        })
    }

    /// Run internal events up to and including `until`.
    pub fn advance(&mut self, until: Timestamp) {
        while let Some(&Reverse((t, id))) = self.heap.peek() {
            if t > until {
                break;
            }
            self.heap.pop();
            self.now = self.now.max(t);
            if let Some(ev) = self.events.remove(&id) {
                self.run(ev);
            }
        }
        self.now = self.now.max(until);
    }

    fn run(&mut self, ev: Event) {
        match ev {
            Event::Arrive { to, msg } => {
                if self.sides[to].alive {
                    self.sides[to].ready.push_back(Ready::Msg(msg));
                } else {
                    self.sides[to].inbound -= 1;
                }
            }
            Event::GetChunk { get, off, len } => {
                let Some(g) = self.gets.get(&get) else {
                    return;
                };
                let (side, src, dst, total) = (g.side, g.src, g.dst, g.len);
                let peer = 1 - side;
                let failed = if g.failed.is_some() {
                    return;
                } else if !self.sides[peer].alive || self.sides[peer].revoked {
                    Some(OpError::Unreachable)
                } else if !self.covered(peer, src.key, src.addr, total, RegAccess::PeerRead) {
                    Some(OpError::RemoteAccess)
                } else if !self.covered(side, dst.key, dst.addr, total, RegAccess::LocalWrite) {
                    self.violations.push(format!(
                        "side {side}: GET into {:#x}+{total} without a local registration (key {})",
                        dst.addr, dst.key
                    ));
                    Some(OpError::Local)
                } else {
                    None
                };
                if let Some(e) = failed {
                    if let Some(g) = self.gets.get_mut(&get) {
                        g.failed = Some(e);
                    }
                    return;
                }
                let at = dst.addr + off;
                let s = &self.sides[side];
                let in_pool = (POOL_BASE[side]..s.pool_next).contains(&at);
                if in_pool && !s.pool.iter().any(|(&a, &l)| a <= at && at + len <= a + l) {
                    // (A NIC would write into memory reused for something
                    // else.)
                    self.violations.push(format!(
                        "side {side}: GET lands in {at:#x}+{len}, pool memory given back"
                    ));
                }
                let mut tmp = vec![0u8; len as usize];
                let mut mems = self.mems.borrow_mut();
                mems[peer].read_raw(src.addr + off, &mut tmp);
                mems[side].write_raw(at, &tmp);
            }
            Event::GetDone { get } => {
                let Some(g) = self.gets.remove(&get) else {
                    return;
                };
                let result = match g.failed {
                    Some(e) => Err(e),
                    None => Ok(()),
                };
                if self.sides[g.side].alive {
                    self.sides[g.side]
                        .ready
                        .push_back(Ready::Done(g.op, OpResult::Get(result)));
                }
            }
            Event::CasExec {
                side,
                target,
                expect,
                new,
                done,
            } => {
                let result = self.exec_cas(side, target, expect, new);
                if let Some(Event::CasDone { result: r, .. }) = self.events.get_mut(&done) {
                    *r = result;
                }
            }
            Event::CasDone { side, op, result } => {
                if self.sides[side].alive {
                    self.sides[side]
                        .ready
                        .push_back(Ready::Done(op, OpResult::Cas(result)));
                }
            }
            Event::Registered { side, op, result } => {
                if self.sides[side].alive {
                    self.sides[side]
                        .ready
                        .push_back(Ready::Done(op, OpResult::Registered(result)));
                }
            }
            Event::NotifyGone { to } => {
                if self.sides[to].alive && !self.sides[to].gone_reported {
                    self.sides[to].gone_reported = true;
                    // Shm tells how far the dead side's calls had got; a
                    // fabric may also know nothing (a corrupt ring).
                    let unknown = self.rng.chance(self.params.p_departure_unknown);
                    let left = (!unknown).then_some(self.sides[1 - to].progress);
                    self.sides[to].ready.push_back(Ready::PeerGone(left));
                }
            }
        }
    }

    fn exec_cas(
        &mut self,
        side: usize,
        target: CasTarget,
        expect: u64,
        new: u64,
    ) -> Result<u64, OpError> {
        let (owner, slot) = match target {
            CasTarget::Local { slot } => (side, usize::from(slot)),
            CasTarget::Remote { addr, key } => {
                let peer = 1 - side;
                let p = &self.sides[peer];
                if !p.alive || p.revoked {
                    return Err(OpError::Unreachable);
                }
                let off = addr.wrapping_sub(p.lock.addr);
                if key != p.lock.key || off % 8 != 0 || off / 8 >= u64::from(p.lock.slots) {
                    return Err(OpError::RemoteAccess);
                }
                (peer, (off / 8) as usize)
            }
        };
        let Some(w) = self.sides[owner].lock_words.get_mut(slot) else {
            return Err(OpError::RemoteAccess);
        };
        let old = *w;
        if old == expect {
            *w = new;
        }
        Ok(old)
    }

    /// Completion time for an op of `side` posted now that moves `bytes`.
    fn completion_time(&mut self, side: usize, bytes: u64) -> Timestamp {
        let fixed = self.rand_in(self.params.op_latency);
        let xfer = bytes * 1_000 / self.params.bytes_per_us.max(1);
        let t = self.now + Duration::from_nanos(fixed + xfer);
        let t = t.max(self.sides[side].last_completion);
        self.sides[side].last_completion = t;
        t
    }
}

impl SimFabric {
    /// Apply the scenario's injection to a message `side` posts.
    fn tamper(&mut self, side: usize, mut msg: Vec<u8>) -> Vec<u8> {
        let nth = self.sides[side].msgs_posted;
        self.sides[side].msgs_posted += 1;
        match self.injection {
            Injection::Garbage { side: s, nth: k } if s == side && k == nth => {
                match self.rng.below(3) {
                    0 => {
                        let n = self.rng.below(64) as usize;
                        msg = (0..n).map(|_| self.rng.next_u32() as u8).collect();
                    }
                    1 => msg[0] ^= 0x80,  // version
                    _ => msg[14] ^= 0x01, // reserved
                }
                self.trace.note(|| format!("side {side}: garbage injected"));
            }
            Injection::Lie { side: s, nth: k } if s == side => {
                if let Ok(f) = wire::parse(&msg)
                    && let wire::Message::SrcAvail(mut a) = f.msg
                {
                    let this = self.sides[side].avails_posted;
                    self.sides[side].avails_posted += 1;
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
                        if wire::emit(&frame, &mut out).is_ok() {
                            msg = out;
                            self.trace.note(|| format!("side {side}: SRC_AVAIL lies"));
                        }
                    }
                }
            }
            _ => {}
        }
        msg
    }
}

/// One side's view of the shared [`SimFabric`].
#[derive(Debug, Clone)]
pub struct SimEndpoint {
    fab: Rc<RefCell<SimFabric>>,
    side: usize,
    /// The process holding this copy of the side.
    pid: u32,
    /// The fork this copy came from, or made last.
    fork_gen: std::cell::Cell<u32>,
}

impl SimEndpoint {
    pub fn new(fab: Rc<RefCell<SimFabric>>, side: usize) -> Self {
        SimEndpoint {
            fab,
            side,
            pid: FIRST_PID[side],
            fork_gen: std::cell::Cell::new(0),
        }
    }

    /// The copy of this side that `fork()` gives the child `pid` (it
    /// shares the side's words with this one: [`Sharing`]).
    pub fn forked(&self, pid: u32) -> Self {
        SimEndpoint {
            fab: Rc::clone(&self.fab),
            side: self.side,
            pid,
            fork_gen: self.fork_gen.clone(),
        }
    }

    /// The process holding this copy.
    pub fn pid(&self) -> u32 {
        self.pid
    }
}

/// The processes holding a side share its words, as shm's segment does.
impl Sharing for SimEndpoint {
    fn ownership(&self) -> Ownership {
        let f = self.fab.borrow();
        let w = &f.sides[self.side].shared;
        if w.owner == self.pid {
            Ownership::Mine
        } else if w.owner & FROZEN != 0 && w.generation == self.fork_gen.get() {
            Ownership::Unclaimed
        } else {
            Ownership::Other
        }
    }

    fn freeze(&self) {
        let mut f = self.fab.borrow_mut();
        let w = &mut f.sides[self.side].shared;
        if w.owner == self.pid {
            w.owner = self.pid | FROZEN;
            w.generation += 1;
            self.fork_gen.set(w.generation);
        }
    }

    fn claim(&self) -> bool {
        if self.ownership() == Ownership::Unclaimed {
            self.fab.borrow_mut().sides[self.side].shared.owner = self.pid;
        }
        self.ownership() == Ownership::Mine
    }

    fn request_leave(&self) {
        self.fab.borrow_mut().sides[self.side].shared.leave = true;
    }

    fn leave_requested(&self) -> bool {
        self.fab.borrow().sides[self.side].shared.leave
    }

    fn mark_left(&self) {
        self.fab.borrow_mut().sides[self.side].shared.left = true;
    }

    fn has_left(&self) -> bool {
        self.fab.borrow().sides[self.side].shared.left
    }

    fn mark_peer_left(&self) {
        self.fab.borrow_mut().sides[1 - self.side].shared.left = true;
    }

    fn note_heir(&self) {
        self.fab.borrow_mut().sides[self.side].shared.heir = true;
    }
}

impl Fabric for SimEndpoint {
    /// The peer's process lives (whether its driver runs or not: a test
    /// may hold a side still, as SIGSTOP does).
    fn peer_vouched(&mut self) -> bool {
        let f = self.fab.borrow();
        f.vouches && f.sides[1 - self.side].alive
    }

    fn sharing(&self) -> &dyn Sharing {
        self
    }

    fn lock_region(&self) -> LockRegion {
        self.fab.borrow().sides[self.side].lock
    }

    fn post_register(
        &mut self,
        op: OpId,
        addr: u64,
        len: u64,
        access: RegAccess,
    ) -> Result<(), FabricError> {
        let side = self.side;
        let mut fab = self.fab.borrow_mut();
        if !fab.sides[side].alive {
            return Err(FabricError::Broken);
        }
        let p = fab.params.p_register_fail;
        let fail = access == RegAccess::PeerRead && fab.rng.chance(p);
        let result = if fail {
            Err(fab.params.register_error)
        } else {
            let s = &mut fab.sides[side];
            s.next_key = s.next_key.wrapping_add(1);
            let key = s.next_key;
            s.regions.insert(key, Region { addr, len, access });
            if access == RegAccess::LocalWrite {
                fab.mems.borrow_mut()[side].pin(&(addr..addr + len));
            }
            Ok(key)
        };
        let at = fab.completion_time(side, 0);
        fab.schedule(at, Event::Registered { side, op, result });
        Ok(())
    }

    fn deregister(&mut self, key: u32) {
        let side = self.side;
        let mut fab = self.fab.borrow_mut();
        match fab.sides[side].regions.remove(&key) {
            None => fab
                .violations
                .push(format!("side {side}: deregistration of unknown key {key}")),
            // Local registrations stay pinned half the time, as a cache
            // keeps them.
            Some(r) if r.access == RegAccess::LocalWrite => {
                let range = r.addr..r.addr + r.len;
                if fab.rng.chance(0.5) {
                    fab.sides[side].kept.push(range);
                } else {
                    fab.mems.borrow_mut()[side].unpin(&range);
                }
            }
            Some(_) => {}
        }
    }

    fn unpin_near(&mut self, range: Range<u64>) -> bool {
        const HUGE: u64 = 2 << 20;
        let window = range.start - range.start % HUGE..range.end.next_multiple_of(HUGE);
        let meets = |r: &Range<u64>| r.start < window.end && window.start < r.end;
        let side = self.side;
        let mut fab = self.fab.borrow_mut();
        let kept = std::mem::take(&mut fab.sides[side].kept);
        let (gone, stay): (Vec<_>, Vec<_>) = kept.into_iter().partition(|r| meets(r));
        fab.sides[side].kept = stay;
        for r in &gone {
            fab.mems.borrow_mut()[side].unpin(r);
        }
        !fab.sides[side]
            .regions
            .values()
            .any(|r| r.access == RegAccess::LocalWrite && meets(&(r.addr..r.addr + r.len)))
    }

    fn has_room(&self, _len: usize) -> bool {
        let fab = self.fab.borrow();
        let peer = &fab.sides[1 - self.side];
        !fab.sides[self.side].alive || peer.inbound < fab.params.ring_capacity
    }

    fn post_message(&mut self, msg: &[u8]) -> Result<(), FabricError> {
        let me = self.side;
        let peer = 1 - me;
        let mut fab = self.fab.borrow_mut();
        if !fab.sides[me].alive {
            return Err(FabricError::Broken);
        }
        if fab.sides[peer].inbound >= fab.params.ring_capacity {
            return Err(FabricError::NoCredits);
        }
        fab.trace.note(|| format!("side {me} -> {}", describe(msg)));
        if matches!(wire::parse(msg), Ok(f) if matches!(f.msg, wire::Message::Switch { .. })) {
            fab.switch_posted[me] = true;
        }
        let msg = fab.tamper(me, msg.to_vec());
        let range = fab.params.msg_latency;
        let lat = fab.rand_in(range);
        let at = (fab.now + Duration::from_nanos(lat)).max(fab.sides[peer].last_arrival);
        fab.sides[peer].last_arrival = at;
        fab.sides[peer].inbound += 1;
        fab.schedule(at, Event::Arrive { to: peer, msg });
        Ok(())
    }

    fn post_get(
        &mut self,
        op: OpId,
        src: RemoteBuf,
        dst: LocalBuf,
        len: u64,
    ) -> Result<(), FabricError> {
        let side = self.side;
        let mut fab = self.fab.borrow_mut();
        let fab = &mut *fab;
        fab.gets_posted[side] += 1;
        let done = fab.completion_time(side, len);
        fab.seq += 1;
        let get = fab.seq;
        fab.gets.insert(
            get,
            GetOp {
                side,
                op,
                src,
                dst,
                len,
                failed: None,
            },
        );
        // Move the bytes in up to four chunks at random instants in the window.
        let chunks = 1 + fab.rng.below(4.min(len));
        let span = done.as_nanos().saturating_sub(fab.now.as_nanos()).max(1);
        let mut off = 0;
        for i in 0..chunks {
            let clen = if i + 1 == chunks {
                len - off
            } else {
                len / chunks
            };
            let at = Timestamp::from_nanos(fab.now.as_nanos() + fab.rng.below(span));
            fab.schedule(
                at,
                Event::GetChunk {
                    get,
                    off,
                    len: clen,
                },
            );
            off += clen;
        }
        fab.schedule(done, Event::GetDone { get });
        Ok(())
    }

    fn post_cas(
        &mut self,
        op: OpId,
        target: CasTarget,
        expect: u64,
        new: u64,
    ) -> Result<(), FabricError> {
        let side = self.side;
        let mut fab = self.fab.borrow_mut();
        let done_at = fab.completion_time(side, 8);
        let done = fab.schedule(
            done_at,
            Event::CasDone {
                side,
                op,
                result: Err(OpError::Unreachable),
            },
        );
        let span = done_at.as_nanos().saturating_sub(fab.now.as_nanos()).max(1);
        let at = Timestamp::from_nanos(fab.now.as_nanos() + fab.rng.below(span));
        fab.schedule(
            at,
            Event::CasExec {
                side,
                target,
                expect,
                new,
                done,
            },
        );
        Ok(())
    }

    fn pool_alloc(&mut self, len: u64) -> Result<u64, OpError> {
        let side = self.side;
        let mut fab = self.fab.borrow_mut();
        let p = fab.params.p_pool_fail;
        if fab.rng.chance(p) {
            return Err(OpError::Local);
        }
        let page = fab.mems.borrow()[side].page_size();
        let s = &mut fab.sides[side];
        let at = s.pool_next;
        // A guard page between copies: a driver that writes past one is seen.
        s.pool_next += len.next_multiple_of(page) + page;
        s.pool.insert(at, len);
        fab.trace
            .note(|| format!("side {side}: pool {at:#x}+{len}"));
        Ok(at)
    }

    fn pool_fill(&mut self, addr: u64, len: u64, fill: &mut dyn FnMut(&mut [u8])) {
        let mut tmp = vec![0u8; len as usize];
        // The fill reads the application's memory: no borrow held meanwhile.
        fill(&mut tmp);
        let side = self.side;
        let fab = self.fab.borrow();
        if fab.sides[side].pool.get(&addr) != Some(&len) {
            drop(fab);
            self.fab.borrow_mut().violations.push(format!(
                "side {side}: fill of {addr:#x}+{len}, not a pool buffer"
            ));
            return;
        }
        fab.mems.borrow_mut()[side].write_raw(addr, &tmp);
    }

    fn pool_free(&mut self, addr: u64, len: u64) {
        let side = self.side;
        let mut fab = self.fab.borrow_mut();
        fab.trace
            .note(|| format!("side {side}: pool free {addr:#x}+{len}"));
        if fab.sides[side].pool.remove(&addr) != Some(len) {
            fab.violations.push(format!(
                "side {side}: free of {addr:#x}+{len}, not a pool buffer"
            ));
            return;
        }
        fab.mems.borrow_mut()[side].discard(addr..addr + len);
    }

    fn revoke_access(&mut self) {
        self.fab.borrow_mut().sides[self.side].revoked = true;
    }

    /// Simulated time only moves in `SimFabric::advance`: nothing to wait for.
    fn wait(&self, _timeout: Duration) {}

    /// Simulated GETs move their bytes at random instants after posting.
    fn gets_async(&self) -> bool {
        true
    }

    fn publish_progress(&mut self, progress: Departure) {
        self.fab.borrow_mut().sides[self.side].progress = progress;
    }

    fn poll(&mut self, on_event: &mut dyn FnMut(FabricEvent<'_>)) -> usize {
        let mut n = 0;
        loop {
            // No borrow is held while the engine takes the event.
            let next = {
                let mut fab = self.fab.borrow_mut();
                let r = fab.sides[self.side].ready.pop_front();
                if let Some(Ready::Msg(m)) = &r {
                    fab.sides[self.side].inbound -= 1;
                    fab.trace
                        .note(|| format!("side {} <- {}", self.side, describe(m)));
                }
                r
            };
            let Some(r) = next else {
                return n;
            };
            n += 1;
            match r {
                Ready::Msg(m) => on_event(FabricEvent::Message(&m)),
                Ready::Done(op, result) => on_event(FabricEvent::Done { op, result }),
                Ready::PeerGone(left) => {
                    self.fab
                        .borrow()
                        .trace
                        .note(|| format!("side {}: peer gone, left {left:?}", self.side));
                    let heir = self.fab.borrow().sides[1 - self.side].shared.heir;
                    on_event(FabricEvent::PeerGone { left, heir });
                }
            }
        }
    }
}

/// One line about a message, for traces.
pub fn describe(m: &[u8]) -> String {
    match wire::parse(m) {
        Ok(f) => match f.msg {
            wire::Message::Data(p) => format!("#{} DATA {}B cr{}", f.seq, p.len(), f.credits),
            msg => format!("#{} {:?} cr{}", f.seq, msg, f.credits),
        },
        Err(e) => format!("garbage ({e})"),
    }
}
