//! The `sim` fabric: two endpoints joined by a deterministic, seeded model
//! of an RC connection.
//!
//! - Messages arrive in order after a random latency; each direction has a
//!   ring of fixed capacity (transport credits).
//! - A GET moves its bytes in chunks, each at a random instant between post
//!   and completion, as a NIC may; a staged GET lands in staging and is moved
//!   into place at completion. Source keys and bounds are checked (a lying
//!   peer gets [`OpError::RemoteAccess`]).
//! - A compare-and-swap executes atomically at a random instant before its
//!   completion.
//! - Completions of one endpoint arrive in post order (RC send queues do).
//! - A side can die (its memory becomes unreachable, its messages in flight
//!   are lost, the survivor learns after a delay) or revoke the peer's access.
//!
//! Everything is driven by [`SimFabric::advance`] with the two memories.

use std::cmp::Reverse;
use std::collections::{BinaryHeap, HashMap, VecDeque};
use std::time::Duration;

use super::{Fabric, FabricError, FabricEvent, OpResult};
use crate::conn::{CasTarget, LockRegion, OpError, OpId, RemoteBuf};
use crate::sim::memory::SimMemory;
use crate::sim::rng::Rng;
use crate::time::Timestamp;

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
        }
    }
}

#[derive(Debug)]
enum Ready {
    Msg(Vec<u8>),
    Done(OpId, OpResult),
    PeerGone,
}

#[derive(Debug)]
struct Side {
    alive: bool,
    /// This side revoked the peer's access to its memory.
    revoked: bool,
    lock: LockRegion,
    lock_words: Vec<u64>,
    regions: HashMap<u32, (u64, u64)>,
    next_key: u32,
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
    dst: u64,
    len: u64,
    staged: Option<Vec<u8>>,
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
    /// Counters for invariant checks.
    pub gets_posted: [u64; 2],
}

/// Where the simulated lock words of each side live.
const LOCK_BASE: [u64; 2] = [0x7f00_0000_0000, 0x7e00_0000_0000];

impl SimFabric {
    pub fn new(seed: u64, params: SimFabricParams) -> Self {
        let mut rng = Rng::new(seed ^ 0xfab1c);
        let mk = |i: usize, rng: &mut Rng| Side {
            alive: true,
            revoked: false,
            lock: LockRegion {
                addr: LOCK_BASE[i],
                key: rng.next_u32() | 1,
                slots: params.lock_slots,
            },
            lock_words: vec![0; usize::from(params.lock_slots)],
            regions: HashMap::new(),
            next_key: 0x100 + i as u32 * 0x1000_0000,
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
            gets_posted: [0; 2],
        }
    }

    pub fn now(&self) -> Timestamp {
        self.now
    }

    /// The endpoint of side 0 or 1, at the current time.
    pub fn endpoint(&mut self, side: usize) -> SimEndpoint<'_> {
        SimEndpoint { fab: self, side }
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

    /// Run internal events up to and including `until`.
    pub fn advance(&mut self, until: Timestamp, mems: &mut [SimMemory; 2]) {
        while let Some(&Reverse((t, id))) = self.heap.peek() {
            if t > until {
                break;
            }
            self.heap.pop();
            self.now = self.now.max(t);
            if let Some(ev) = self.events.remove(&id) {
                self.run(ev, mems);
            }
        }
        self.now = self.now.max(until);
    }

    fn run(&mut self, ev: Event, mems: &mut [SimMemory; 2]) {
        match ev {
            Event::Arrive { to, msg } => {
                if self.sides[to].alive {
                    self.sides[to].ready.push_back(Ready::Msg(msg));
                } else {
                    self.sides[to].inbound -= 1;
                }
            }
            Event::GetChunk { get, off, len } => {
                let Some(g) = self.gets.get_mut(&get) else {
                    return;
                };
                let peer = 1 - g.side;
                let src = &self.sides[peer];
                if g.failed.is_some() {
                    return;
                }
                if !src.alive || src.revoked {
                    g.failed = Some(OpError::Unreachable);
                    return;
                }
                let ok = src
                    .regions
                    .get(&g.src.key)
                    .is_some_and(|&(a, l)| g.src.addr >= a && g.src.addr + g.len <= a + l);
                if !ok {
                    g.failed = Some(OpError::RemoteAccess);
                    return;
                }
                let mut tmp = vec![0u8; len as usize];
                mems[peer].read_raw(g.src.addr + off, &mut tmp);
                match g.staged.as_mut() {
                    Some(st) => st[off as usize..(off + len) as usize].copy_from_slice(&tmp),
                    None => mems[g.side].write_raw(g.dst + off, &tmp),
                }
            }
            Event::GetDone { get } => {
                let Some(g) = self.gets.remove(&get) else {
                    return;
                };
                let result = match g.failed {
                    Some(e) => Err(e),
                    None => {
                        if let Some(st) = &g.staged {
                            mems[g.side].write_raw(g.dst, st);
                        }
                        Ok(())
                    }
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
            Event::NotifyGone { to } => {
                if self.sides[to].alive && !self.sides[to].gone_reported {
                    self.sides[to].gone_reported = true;
                    self.sides[to].ready.push_back(Ready::PeerGone);
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

/// One side's view of the [`SimFabric`].
#[derive(Debug)]
pub struct SimEndpoint<'a> {
    fab: &'a mut SimFabric,
    side: usize,
}

impl Fabric for SimEndpoint<'_> {
    fn lock_region(&self) -> LockRegion {
        self.fab.sides[self.side].lock
    }

    fn register(&mut self, addr: u64, len: u64) -> Result<u32, OpError> {
        let s = &mut self.fab.sides[self.side];
        s.next_key = s.next_key.wrapping_add(1);
        let key = s.next_key;
        s.regions.insert(key, (addr, len));
        Ok(key)
    }

    fn deregister(&mut self, key: u32) {
        self.fab.sides[self.side].regions.remove(&key);
    }

    fn send_credits(&self) -> usize {
        let peer = &self.fab.sides[1 - self.side];
        self.fab.params.ring_capacity.saturating_sub(peer.inbound)
    }

    fn post_message(&mut self, msg: &[u8]) -> Result<(), FabricError> {
        let me = self.side;
        let peer = 1 - me;
        if !self.fab.sides[me].alive {
            return Err(FabricError::Broken);
        }
        if self.send_credits() == 0 {
            return Err(FabricError::NoCredits);
        }
        let lat = self.fab.rand_in(self.fab.params.msg_latency);
        let at = (self.fab.now + Duration::from_nanos(lat)).max(self.fab.sides[peer].last_arrival);
        self.fab.sides[peer].last_arrival = at;
        self.fab.sides[peer].inbound += 1;
        self.fab.schedule(
            at,
            Event::Arrive {
                to: peer,
                msg: msg.to_vec(),
            },
        );
        Ok(())
    }

    fn post_get(
        &mut self,
        op: OpId,
        src: RemoteBuf,
        dst: u64,
        len: u64,
        staged: bool,
    ) -> Result<(), FabricError> {
        let side = self.side;
        let fab = &mut *self.fab;
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
                staged: staged.then(|| vec![0u8; len as usize]),
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
        let fab = &mut *self.fab;
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

    fn revoke_access(&mut self) {
        self.fab.sides[self.side].revoked = true;
    }

    /// Simulated time only moves in `SimFabric::advance`: nothing to wait for.
    fn wait(&self, _timeout: Duration) {}

    /// Simulated GETs move their bytes at random instants after posting.
    fn gets_async(&self) -> bool {
        true
    }

    fn poll(&mut self, on_event: &mut dyn FnMut(FabricEvent<'_>)) -> usize {
        let mut n = 0;
        while let Some(r) = self.fab.sides[self.side].ready.pop_front() {
            n += 1;
            match r {
                Ready::Msg(m) => {
                    self.fab.sides[self.side].inbound -= 1;
                    on_event(FabricEvent::Message(&m));
                }
                Ready::Done(op, result) => on_event(FabricEvent::Done { op, result }),
                Ready::PeerGone => on_event(FabricEvent::PeerGone { left: None }),
            }
        }
        n
    }
}
