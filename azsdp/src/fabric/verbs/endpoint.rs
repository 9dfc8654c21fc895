//! One side of a `verbs` connection: the fabric contract on an RC queue
//! pair.
//!
//! | contract | verbs |
//! |---|---|
//! | message | SEND into one of the peer's pre-posted receives, behind a [`Header`] with credits |
//! | GET | RDMA READ from the peer's rkey into our lkey |
//! | compare-and-swap | ATOMIC_CMP_AND_SWP on the peer's lock words (its own: the CPU's, when the device's atomics are coherent with it); by message (`wire::CasRequest`, made by the peer's CPU) where either side's device has no atomics, or a side's atomics and CPU do not meet |
//! | register | `ibv_reg_mr` (pinned; completes at once) |
//! | revocation | every registration the peer can use is deregistered |
//! | peer gone | a failed completion, or rdma_cm's DISCONNECTED / DEVICE_REMOVAL |

use std::collections::{HashMap, VecDeque};
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

use memmap2::MmapMut;

use super::credits::Credits;
use super::ffi::{self, Access, CmId, CompChannel, Cq, DeviceCaps, EventChannel, Mr, Pd, SendOp};
use super::reads::{ReadBook, ReadSplit};
use super::waiter::VerbsWaiter;
use super::wire::{CasAnswer, CasRequest, HEADER_LEN, Header, Kind};
use crate::config::{RdmaLock, RdmaOdp};
use crate::conn::{CasTarget, LockRegion, OpError, OpId, RemoteBuf};
use crate::fabric::pool::Pool;
use crate::fabric::{Armed, Fabric, FabricError, FabricEvent, LocalBuf, OpResult, RegAccess};

/// Sizes a side chooses for its receives (the peer learns them at
/// connection time).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct VerbsParams {
    /// Receives posted (and SENDs that may be outstanding).
    pub ring: u16,
    /// Bytes of each receive (header included).
    pub slot: u32,
    /// Lock words of this side.
    pub lock_slots: u16,
    /// Busy-poll before sleeping.
    pub poll: Duration,
    /// How the copy-on-write lock words are changed (`rdma_lock`).
    pub lock: RdmaLock,
    /// Pinned bytes of receive destinations kept registered after use
    /// (`reg_cache`).
    pub reg_cache: u64,
    /// How a long GET is cut into READs in flight together (`reads`).
    pub read_split: ReadSplit,
    /// Receive destinations on demand where the device offers it
    /// (`rdma_odp`).
    pub odp: RdmaOdp,
    /// Check, once per process and device, that READs land right in
    /// memory registered on demand before using it (`loopback`). Off only
    /// in tests whose READs land whole pages at page offset 0, which rxe
    /// (6.17 to 7.3 at least) places right, for the rest of the path.
    pub check_odp: bool,
}

impl Default for VerbsParams {
    fn default() -> Self {
        VerbsParams {
            ring: 32,
            // The engine's largest message (a BSDP slot of 16 KiB and its
            // header) and our header.
            slot: (16 << 10) + 512,
            lock_slots: 64,
            poll: Duration::from_micros(20),
            lock: RdmaLock::Auto,
            reg_cache: 32 << 20,
            read_split: ReadSplit::default(),
            odp: RdmaOdp::Auto,
            check_odp: true,
        }
    }
}

/// What the peer told at connection time.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct PeerParams {
    pub ring: u16,
    pub slot: u32,
    /// Its lock words take compare-and-swap by message only.
    pub locks_by_message: bool,
}

// Work request ids: the kind in the top byte, an index below.
const WR_RECV: u64 = 1 << 56;
const WR_SEND: u64 = 2 << 56;
const WR_OP: u64 = 3 << 56;
const WR_PROBE: u64 = 4 << 56;
const WR_BOUNCE: u64 = 5 << 56;
const WR_KIND: u64 = 0xff << 56;

/// A READ (a GET's piece) or compare-and-swap on the send queue.
#[derive(Debug)]
struct Pending {
    op: OpId,
    /// The result word of a compare-and-swap (none: a READ).
    cas_slot: Option<usize>,
}

/// Compare-and-swaps that may be outstanding at once.
const CAS_SLOTS: usize = 64;

/// READs that may be on the send queue at once (`reads::ReadBook`).
const READ_SLOTS: u32 = 256;

/// Bytes of the bounce buffer (see [`Bounce`]).
const BOUNCE_LEN: usize = 64 << 10;

/// Receive destinations the locked-memory limit (`RLIMIT_MEMLOCK`) will not
/// let us pin: their READs land, a piece at a time, in one buffer pinned
/// once per connection, and are copied from there. The receive is then a
/// copy, not zero-copy, but it works, as TCP would (a GET that failed would
/// reset the connection). Bounced destinations are "registered" with the
/// buffer's own lkey, which no real registration can have while it lives.
#[derive(Debug)]
struct Bounce {
    // The registration goes before its memory.
    mr: Mr,
    buf: MmapMut,
    /// GETs into bounced destinations, in order; the front one's piece is
    /// on the send queue while `in_flight`.
    jobs: VecDeque<BounceJob>,
    in_flight: Option<u32>,
    /// Bytes copied from it so far.
    copied: u64,
}

#[derive(Debug)]
struct BounceJob {
    op: OpId,
    src: RemoteBuf,
    dst: u64,
    len: u64,
    done: u64,
}

#[derive(Debug)]
pub struct VerbsEndpoint {
    // Drop order matters: the queue pair (in the id) before the
    // registrations and the CQ, those before the PD and the channels.
    id: CmId,
    /// Registrations by key, shared and kept as `super::reg_cache` says.
    regs: super::reg_cache::RegCache<Mr>,
    /// Memory released since `regs` last looked.
    released: crate::released_memory::Reader,
    lock_mr: Option<Mr>,
    /// Our lock words registered for the loopback pair, when the device's
    /// atomics are not the CPU's (see `loopback`).
    local_locks: Option<(Mr, Arc<super::loopback::Loopback>)>,
    /// Why there is none.
    no_local_locks: Option<String>,
    /// Our lock words take the peer's compare-and-swap by message only
    /// (a NIC's would not meet our own), and why.
    words_by_message: Option<String>,
    /// We take the peer's lock words by message (our device has no
    /// atomics, or the peer asked).
    cas_by_message: bool,
    /// Compare-and-swaps by message in flight, by tag (their result slot).
    cas_by_tag: HashMap<u16, OpId>,
    /// Answers to the peer's, waiting for a credit.
    cas_answers: VecDeque<CasAnswer>,
    /// Made when a destination could not be pinned.
    bounce: Option<Bounce>,
    /// Receive destinations are registered on demand (the device offers
    /// it for READs, `rdma_odp` allows it, the device passed the check,
    /// and no such registration has failed yet).
    odp_local: bool,
    /// Why not, where the device offers it.
    odp_refused: Option<String>,
    slot_mr: Mr,
    cas_mr: Mr,
    cq: Arc<Cq>,
    waiter: VerbsWaiter,
    _comp: Arc<CompChannel>,
    events: Arc<EventChannel>,
    _pd: Pd,
    /// Our receive slots, then our send slots.
    slots: MmapMut,
    locks: MmapMut,
    cas_words: Box<[AtomicU64]>,
    free_cas: Vec<usize>,
    params: VerbsParams,
    peer: PeerParams,
    caps: DeviceCaps,
    credits: Credits,
    free_send: Vec<u16>,
    pending: HashMap<u64, Pending>,
    /// GETs by piece, and the pieces waiting for room on the send queue.
    reads: ReadBook,
    next_op: u64,
    completions: VecDeque<(OpId, OpResult)>,
    /// Completions [`Fabric::arm`] took off the CQ, for the next poll.
    stash: Vec<ffi::Completion>,
    pool: Pool,
    /// Why the connection is over, once it is.
    broken: Option<String>,
    gone_reported: bool,
    departed: std::sync::atomic::AtomicBool,
    /// When a poll last found a completion: the peer's queue pair was
    /// alive then (or its message came).
    last_heard: Instant,
    /// A completion came since the last poll looked (the clock is read
    /// once per poll, not per completion).
    heard: bool,
    /// Since when a liveness probe is out (its completion not in yet).
    probing: Option<Instant>,
    /// When the engine let go of the peer's access (the connection ended
    /// or left the fabric; see [`VerbsEndpoint::flush_if_over`]).
    revoked_at: Option<Instant>,
    /// The queue pair was moved to the error state ([`VerbsEndpoint::flush_if_over`]).
    flushed: bool,
    /// A receive came back flushed: every message that arrived before
    /// the end has been taken (see [`VerbsEndpoint::take_until_flushed`]).
    rq_flushed: bool,
    /// Shared with the processes forked from this one.
    fork: super::fork_words::ForkWords,
}

/// The parts of a connection made before it is established (see `cm`).
#[derive(Debug)]
pub(super) struct Parts {
    pub id: CmId,
    pub events: EventChannel,
    pub pd: Pd,
    pub comp: CompChannel,
    pub cq: Cq,
    pub caps: DeviceCaps,
}

fn anon(len: usize) -> std::io::Result<MmapMut> {
    MmapMut::map_anon(len.max(1))
}

impl VerbsEndpoint {
    /// Queue pair and buffers on `parts`, every receive posted: ready for
    /// rdma_cm to connect.
    pub(super) fn new(parts: Parts, params: VerbsParams) -> std::io::Result<VerbsEndpoint> {
        let Parts {
            id,
            events,
            pd,
            comp,
            cq,
            caps,
        } = parts;
        let ring = usize::from(params.ring);
        let slot = params.slot as usize;
        // SENDs, compare-and-swaps (and their answers by message), READs,
        // the probe and a bounced piece.
        let send_depth = params.ring as u32 + 2 * CAS_SLOTS as u32 + READ_SLOTS + 2;
        id.create_qp(&pd, &cq, send_depth, params.ring as u32)?;
        let slots = anon(2 * ring * slot)?;
        let locks = anon(usize::from(params.lock_slots) * 8)?;
        let cas_words: Box<[AtomicU64]> = (0..CAS_SLOTS).map(|_| AtomicU64::new(0)).collect();
        // SAFETY: each region is ours and outlives its registration (the
        // endpoint drops registrations before the memory).
        let (slot_mr, lock_mr, cas_mr) = unsafe {
            (
                pd.register(slots.as_ptr() as u64, slots.len() as u64, Access::LOCAL)?,
                pd.register(
                    locks.as_ptr() as u64,
                    locks.len() as u64,
                    if caps.atomics {
                        Access::PEER_ATOMIC
                    } else {
                        Access::LOCAL
                    },
                )?,
                pd.register(
                    cas_words.as_ptr() as u64,
                    (CAS_SLOTS * 8) as u64,
                    Access::LOCAL,
                )?,
            )
        };
        let comp = Arc::new(comp);
        let cq = Arc::new(cq);
        let events = Arc::new(events);
        let waiter = VerbsWaiter::new(
            Arc::clone(&cq),
            Arc::clone(&comp),
            Arc::clone(&events),
            params.poll,
        )?;
        // (What the loopback pair, when one is wanted, is made for.)
        let local_ip = id
            .addresses()
            .0
            .map(|a| a.ip())
            .ok_or_else(|| "no local address".to_string());
        let local_locks = if !caps.atomics {
            Err("the device has no atomics".to_string())
        } else if params.lock == RdmaLock::Message {
            Err("rdma_lock = \"message\"".to_string())
        } else if caps.atomics_with_cpu {
            Err("not needed".to_string())
        } else if params.lock == RdmaLock::Auto {
            Err(
                "the device's atomics are not the CPU's, and each of our own lock operations \
                 through it would be a round trip (rdma_lock = \"auto\")"
                    .to_string(),
            )
        } else {
            local_ip
                .clone()
                .and_then(|ip| super::loopback::for_address(ip, id.context()))
                .and_then(|l| {
                    // SAFETY: the lock words outlive the registration (it
                    // is dropped with the endpoint, before them).
                    unsafe { l.register(locks.as_ptr() as u64, locks.len() as u64) }
                        .map(|mr| (mr, l))
                        .map_err(|e| e.to_string())
                })
        };
        let (local_locks, no_local_locks) = match local_locks {
            Ok(l) => (Some(l), None),
            Err(e) => (None, Some(e)),
        };
        let nic_meets_cpu =
            params.lock != RdmaLock::Message && caps.atomics && caps.atomics_with_cpu;
        let words_by_message = if nic_meets_cpu || local_locks.is_some() {
            None
        } else {
            no_local_locks.clone()
        };
        let odp_wanted = params.odp == RdmaOdp::Auto && caps.odp_reads;
        let odp_refused = if odp_wanted && params.check_odp {
            local_ip
                .and_then(|ip| super::loopback::reads_on_demand_work(ip, id.context()))
                .err()
        } else {
            None
        };
        if let Some(why) = &odp_refused {
            crate::protect::log_once(&format!(
                "verbs: the device offers registration on demand, but it is not \
                 used (receive destinations are pinned): {why}"
            ));
        }
        let odp_local = odp_wanted && odp_refused.is_none();
        let ep = VerbsEndpoint {
            id,
            regs: super::reg_cache::RegCache::new(
                params.reg_cache,
                crate::pages::system_page_size(),
            ),
            released: crate::released_memory::Reader::new(),
            lock_mr: Some(lock_mr),
            local_locks,
            no_local_locks,
            cas_by_message: !caps.atomics || params.lock == RdmaLock::Message,
            words_by_message,
            cas_by_tag: HashMap::new(),
            cas_answers: VecDeque::new(),
            bounce: None,
            odp_local,
            odp_refused,
            slot_mr,
            cas_mr,
            cq,
            waiter,
            _comp: comp,
            events,
            _pd: pd,
            slots,
            locks,
            cas_words,
            free_cas: (0..CAS_SLOTS).rev().collect(),
            params,
            peer: PeerParams {
                ring: 0,
                slot: 0,
                locks_by_message: false,
            },
            caps,
            credits: Credits::new(params.ring, 0),
            free_send: (0..params.ring).rev().collect(),
            pending: HashMap::new(),
            reads: ReadBook::new(params.read_split, READ_SLOTS),
            next_op: 0,
            completions: VecDeque::new(),
            stash: Vec::new(),
            pool: Pool::default(),
            broken: None,
            gone_reported: false,
            departed: std::sync::atomic::AtomicBool::new(false),
            last_heard: Instant::now(),
            heard: false,
            probing: None,
            revoked_at: None,
            flushed: false,
            rq_flushed: false,
            fork: super::fork_words::ForkWords::new()?,
        };
        for i in 0..params.ring {
            ep.post_recv(i)?;
        }
        let mut ep = ep;
        if memlock_finite() && !ep.odp_local {
            // (Without it, a refused destination resets the connection.
            // Destinations on demand are not pinned, and so never refused
            // for the limit.)
            let _ = ep.ensure_bounce();
        }
        Ok(ep)
    }

    /// The peer's receives, learnt at connection time.
    pub(super) fn set_peer(&mut self, peer: PeerParams) {
        self.peer = peer;
        self.cas_by_message |= peer.locks_by_message;
        self.credits = Credits::new(self.params.ring, peer.ring);
    }

    pub(super) fn id(&self) -> &CmId {
        &self.id
    }

    pub(super) fn events(&self) -> &EventChannel {
        &self.events
    }

    /// The waiter for the driver's threads and reactor.
    pub fn waiter(&self) -> VerbsWaiter {
        self.waiter.clone()
    }

    /// RDMA READs and atomics the queue pair may have outstanding.
    pub(super) fn read_depth(&self) -> u8 {
        self.caps.max_rd_atom
    }

    /// Does the copy-on-write lock go by message either way (and why)?
    /// `None`: both sides' NICs take it with their atomics. Either way the
    /// lock holds: a lock word is only ever changed in one coherence
    /// domain (its owner's CPU, or its owner's device).
    pub fn lock_by_message(&self) -> Option<String> {
        match (&self.words_by_message, self.cas_by_message) {
            (None, false) => None,
            (Some(why), _) => Some(format!("our lock words: {why}")),
            (None, true) if self.peer.locks_by_message => {
                Some("the peer's lock words: asked by the peer".into())
            }
            (None, true) => Some(
                self.no_local_locks
                    .clone()
                    .unwrap_or_else(|| "the device's atomics are not used".into()),
            ),
        }
    }

    /// Why the endpoint stopped (an error completion, a disconnect, a
    /// probe unanswered), once it has: the close line says it beside the
    /// engine's reason, which for every such break is "peer is gone".
    pub fn broken_reason(&self) -> Option<&str> {
        self.broken.as_deref()
    }

    /// What the queue pair waits for, in a line (for a caller that finds
    /// the connection stuck).
    pub fn describe(&self) -> String {
        format!(
            "{} operation(s) posted ({} GET(s), {} READ(s) waiting for room), {} lock request(s) by message, {} bounced GET(s), {} SEND(s) out, \
             {} completion(s) unread, probe out for {:?}, last heard {:?} ago, broken {:?}",
            self.pending.len(),
            self.reads.in_flight(),
            self.reads.waiting(),
            self.cas_by_tag.len(),
            self.bounce.as_ref().map_or(0, |b| b.jobs.len()),
            usize::from(self.params.ring) - self.free_send.len(),
            self.completions.len() + self.stash.len(),
            self.probing.map(|t| t.elapsed()),
            self.last_heard.elapsed(),
            self.broken
        )
    }

    /// What the registration cache did.
    pub fn registrations(&self) -> super::reg_cache::RegCounts {
        self.regs.counts()
    }

    /// Does the device offer registration on demand for READs?
    pub fn offers_on_demand(&self) -> bool {
        self.caps.odp_reads
    }

    /// Are receive destinations registered on demand (now)?
    pub fn receives_on_demand(&self) -> bool {
        self.odp_local
    }

    /// Why not, where the device offers it and the settings allow it.
    pub fn on_demand_refused(&self) -> Option<&str> {
        self.odp_refused.as_deref()
    }

    /// Bytes received through the bounce buffer (destinations the
    /// locked-memory limit would not let us pin).
    pub fn bounced(&self) -> u64 {
        self.bounce.as_ref().map_or(0, |b| b.copied)
    }

    /// Must the peer compare-and-swap our lock words by message? (Said in
    /// the connection's private data, `hello`.)
    pub(super) fn own_words_by_message(&self) -> bool {
        self.words_by_message.is_some()
    }

    /// The local and the peer's address, as the kernel's RDMA stack says.
    pub fn addresses(&self) -> (Option<std::net::SocketAddr>, Option<std::net::SocketAddr>) {
        self.id.addresses()
    }

    fn slot_addr(&self, i: usize) -> u64 {
        self.slots.as_ptr() as u64 + (i * self.params.slot as usize) as u64
    }

    fn post_recv(&self, i: u16) -> std::io::Result<()> {
        ffi::post_recv(
            self.id.qp(),
            WR_RECV | u64::from(i),
            self.slot_addr(usize::from(i)),
            self.params.slot,
            self.slot_mr.lkey(),
        )
    }

    fn break_with(&mut self, why: String) {
        if self.broken.is_none() {
            self.broken = Some(why);
        }
    }

    /// Post a SEND of `kind` with `payload` (empty for credits only).
    fn send(&mut self, kind: Kind, payload: &[u8]) -> Result<(), FabricError> {
        let Some(i) = self.free_send.pop() else {
            return Err(FabricError::NoCredits);
        };
        let returned = self.credits.on_send();
        let header = Header {
            kind,
            credits: returned,
        };
        let ring = usize::from(self.params.ring);
        let at = (ring + usize::from(i)) * self.params.slot as usize;
        let len = HEADER_LEN + payload.len();
        let buf = &mut self.slots[at..at + len];
        let mut h = [0u8; HEADER_LEN];
        header.emit(&mut h);
        buf[..HEADER_LEN].copy_from_slice(&h);
        buf[HEADER_LEN..].copy_from_slice(payload);
        let op = SendOp::Send {
            addr: self.slot_addr(ring + usize::from(i)),
            len: len as u32,
            lkey: self.slot_mr.lkey(),
        };
        if let Err(e) = ffi::post_send(self.id.qp(), WR_SEND | u64::from(i), op) {
            self.free_send.push(i);
            self.break_with(format!("post SEND: {e}"));
            return Err(FabricError::Broken);
        }
        Ok(())
    }

    /// Post a compare-and-swap whose old value lands in `cas_slot`.
    fn post_cas_op(&mut self, op: OpId, send: SendOp, cas_slot: usize) -> Result<(), FabricError> {
        self.next_op += 1;
        let wr = WR_OP | (self.next_op & !WR_KIND);
        if let Err(e) = ffi::post_send(self.id.qp(), wr, send) {
            self.free_cas.push(cas_slot);
            self.break_with(format!("post: {e}"));
            return Err(FabricError::Broken);
        }
        self.pending.insert(
            wr,
            Pending {
                op,
                cas_slot: Some(cas_slot),
            },
        );
        Ok(())
    }

    /// Post the GETs' pieces the send queue has room for. A failed post
    /// breaks the connection: that piece and those not posted fail (their
    /// GETs end at the next poll, once their posted pieces are flushed).
    fn post_reads(&mut self) {
        while self.broken.is_none()
            && let Some(p) = self.reads.next_to_post()
        {
            self.next_op += 1;
            let wr = WR_OP | (self.next_op & !WR_KIND);
            let read = SendOp::Read {
                addr: p.dst,
                len: p.len,
                lkey: p.lkey,
                remote: p.src,
                rkey: p.rkey,
            };
            match ffi::post_send(self.id.qp(), wr, read) {
                Ok(()) => {
                    self.reads.posted();
                    self.pending.insert(
                        wr,
                        Pending {
                            op: p.op,
                            cas_slot: None,
                        },
                    );
                }
                Err(e) => {
                    self.break_with(format!("post READ: {e}"));
                    if let Some(r) = self
                        .reads
                        .piece_done(p.op, false, Err(OpError::Unreachable))
                    {
                        self.completions.push_back((p.op, OpResult::Get(r)));
                    }
                }
            }
        }
    }

    /// rdma_cm's events for this connection: the peer left, or the device
    /// did.
    fn take_cm_events(&mut self) {
        while let Some(e) = self.events.take() {
            use rdma_mummy_sys::rdma_cm_event_type::*;
            match e.kind() {
                RDMA_CM_EVENT_DISCONNECTED
                | RDMA_CM_EVENT_DEVICE_REMOVAL
                | RDMA_CM_EVENT_TIMEWAIT_EXIT
                | RDMA_CM_EVENT_UNREACHABLE
                | RDMA_CM_EVENT_CONNECT_ERROR => self.break_with(format!("rdma_cm: {}", e.name())),
                _ => {}
            }
        }
    }

    /// Take the completions waiting; messages go to `on_event`.
    fn take_completions(&mut self, on_event: &mut dyn FnMut(FabricEvent<'_>)) -> usize {
        let mut wcs = [ffi::Completion::default(); 32];
        let mut n = 0;
        for wc in std::mem::take(&mut self.stash) {
            n += self.completion(&wc, on_event);
        }
        loop {
            let got = self.cq.poll(&mut wcs);
            for wc in &wcs[..got] {
                n += self.completion(wc, on_event);
            }
            if got < wcs.len() {
                return n;
            }
        }
    }

    fn completion(
        &mut self,
        wc: &ffi::Completion,
        on_event: &mut dyn FnMut(FabricEvent<'_>),
    ) -> usize {
        let ok = wc.ok();
        self.heard |= ok;
        let index = wc.wr_id & !WR_KIND;
        match wc.wr_id & WR_KIND {
            WR_PROBE => {
                self.probing = None;
                if !ok {
                    self.break_with(format!("liveness probe: {}", wc.describe()));
                }
                0
            }
            WR_BOUNCE => self.bounce_piece_done(wc, on_event),
            WR_RECV if ok => self.received(index as u16, wc.byte_len as usize, on_event),
            WR_SEND => {
                self.free_send.push(index as u16);
                if !ok {
                    self.break_with(format!("SEND: {}", wc.describe()));
                }
                0
            }
            WR_OP => {
                let Some(p) = self.pending.remove(&wc.wr_id) else {
                    return 0;
                };
                let result = match p.cas_slot {
                    Some(s) => {
                        self.free_cas.push(s);
                        let old = self.cas_words[s].load(Ordering::Acquire);
                        OpResult::Cas(if ok { Ok(old) } else { Err(op_error(wc)) })
                    }
                    None => {
                        let piece = if ok { Ok(()) } else { Err(op_error(wc)) };
                        let get = self.reads.piece_done(p.op, true, piece);
                        // Room on the send queue for a waiting piece.
                        self.post_reads();
                        match get {
                            Some(r) => OpResult::Get(r),
                            None => {
                                if !ok && !wc.remote_refusal() {
                                    self.break_with(format!("operation: {}", wc.describe()));
                                }
                                return 0;
                            }
                        }
                    }
                };
                if !ok && !wc.remote_refusal() {
                    self.break_with(format!("operation: {}", wc.describe()));
                }
                on_event(FabricEvent::Done { op: p.op, result });
                1
            }
            // A receive flushed: the queue pair is in error.
            kind => {
                self.rq_flushed |= kind == WR_RECV;
                self.break_with(format!("receive: {}", wc.describe()));
                0
            }
        }
    }

    fn received(&mut self, i: u16, len: usize, on_event: &mut dyn FnMut(FabricEvent<'_>)) -> usize {
        let at = usize::from(i) * self.params.slot as usize;
        let len = len.min(self.params.slot as usize);
        let mut n = 0;
        let parsed = Header::parse(&self.slots[at..at + len]).map(|(h, p)| (h, p.len()));
        match parsed {
            Ok((h, plen)) => {
                if let Err(e) = self.credits.on_returned(h.credits) {
                    self.break_with(format!("the peer lied about credits: {e}"));
                    return 0;
                }
                let body = at + HEADER_LEN..at + HEADER_LEN + plen;
                match h.kind {
                    Kind::Message => {
                        on_event(FabricEvent::Message(&self.slots[body]));
                        n = 1;
                    }
                    Kind::Credits => {}
                    Kind::CasRequest => match CasRequest::parse(&self.slots[body]) {
                        Ok(r) => self.answer_cas(r),
                        Err(e) => self.break_with(format!("the peer sent garbage: {e}")),
                    },
                    Kind::CasAnswer => match CasAnswer::parse(&self.slots[body]) {
                        Ok(a) => n = self.cas_answered(a, on_event),
                        Err(e) => self.break_with(format!("the peer sent garbage: {e}")),
                    },
                }
            }
            Err(e) => {
                self.break_with(format!("the peer sent garbage: {e}"));
                return 0;
            }
        }
        match self.post_recv(i) {
            Ok(()) => self.credits.on_reposted(),
            Err(e) => self.break_with(format!("post receive: {e}")),
        }
        n
    }
}

impl VerbsEndpoint {
    /// Let the cache forget registrations of memory the program released
    /// since it last looked.
    fn forget_released(&mut self) {
        if self.released.is_current() {
            return;
        }
        match self.released.read() {
            crate::released_memory::Released::Ranges(r) => self.regs.forget(Some(&r)),
            crate::released_memory::Released::Unknown => self.regs.forget(None),
        }
    }

    /// A pinned registration of `[addr, addr+len)`.
    fn register(&self, addr: u64, len: u64, flags: Access) -> Result<Mr, OpError> {
        // SAFETY: the engine registers memory it holds (a send buffer
        // under advertisement, a receive destination, pool memory) and
        // releases it before letting go of it; a registration kept after
        // that is dropped once the program releases the memory
        // (`forget_released`), before it could be used again.
        unsafe { self._pd.register(addr, len, flags) }.map_err(|e| registration_error(&e))
    }

    /// A pinned registration, watched for the program releasing its
    /// memory (it may be kept), and made again once kept ones are let go
    /// if they were what the locked-memory limit refused.
    fn register_pinned(&mut self, at: u64, n: u64, flags: Access) -> Result<Mr, OpError> {
        crate::released_memory::watch(at..at + n);
        let r = self.register(at, n, flags);
        if matches!(r, Err(OpError::PinLimit)) && self.regs.drop_all_idle() {
            // Kept pins made room for the limit to refuse: pins in use
            // come first.
            return self.register(at, n, flags);
        }
        r
    }

    /// A receive destination's registration on demand: nothing pinned, so
    /// nothing the locked-memory limit counts or a move of pages forbids,
    /// and the device writes into whatever pages the range maps when its
    /// READ lands there, so a kept one stays right when the program
    /// remaps that memory. If the device refuses it after all, this and
    /// later ones are pinned.
    fn register_on_demand(&mut self, at: u64, n: u64) -> Result<Mr, OpError> {
        // SAFETY: as for `register`; a kept one is used again only for a
        // live receive's destination, whatever the pages are by then.
        match unsafe { self._pd.register(at, n, Access::LOCAL.on_demand()) } {
            Ok(mr) => Ok(mr),
            Err(e) => {
                crate::protect::log_once(&format!(
                    "verbs: the device refused a registration on demand ({e}): \
                     receive destinations are pinned from now on"
                ));
                self.odp_local = false;
                self.odp_refused = Some(format!("a registration on demand failed: {e}"));
                if memlock_finite() {
                    let _ = self.ensure_bounce();
                }
                self.register_pinned(at, n, Access::LOCAL)
            }
        }
    }

    /// The key for a destination that cannot be pinned: the bounce
    /// buffer's.
    fn bounce_key(&mut self) -> Result<u32, OpError> {
        self.ensure_bounce()?;
        crate::protect::log_once(
            "verbs: receive destinations cannot be pinned (RLIMIT_MEMLOCK): \
             their READs land in a bounce buffer and are copied",
        );
        Ok(self.bounce.as_ref().map_or(0, |b| b.mr.lkey()))
    }

    /// Make (and pin) the bounce buffer, once. Done with the connection
    /// where the locked-memory limit is finite, so that the fallback never
    /// needs the memory the limit has just refused.
    fn ensure_bounce(&mut self) -> Result<(), OpError> {
        if self.bounce.is_some() {
            return Ok(());
        }
        let buf = anon(BOUNCE_LEN).map_err(|_| OpError::Local)?;
        // SAFETY: the buffer lives in the endpoint with its registration,
        // which is dropped first (field order in Bounce).
        let mr = unsafe {
            self._pd
                .register(buf.as_ptr() as u64, buf.len() as u64, Access::LOCAL)
        }
        .map_err(|e| registration_error(&e))?;
        self.bounce = Some(Bounce {
            mr,
            buf,
            jobs: VecDeque::new(),
            in_flight: None,
            copied: 0,
        });
        Ok(())
    }

    /// Post the next piece of the front bounced GET, unless one is out.
    fn next_bounce_piece(&mut self) {
        let Some(b) = self.bounce.as_mut() else {
            return;
        };
        let Some(j) = b.jobs.front() else {
            return;
        };
        if b.in_flight.is_some() || self.broken.is_some() {
            return;
        }
        let n = (j.len - j.done).min(BOUNCE_LEN as u64) as u32;
        let read = SendOp::Read {
            addr: b.buf.as_ptr() as u64,
            len: n,
            lkey: b.mr.lkey(),
            remote: j.src.addr + j.done,
            rkey: j.src.key,
        };
        match ffi::post_send(self.id.qp(), WR_BOUNCE, read) {
            Ok(()) => b.in_flight = Some(n),
            Err(e) => self.break_with(format!("post: {e}")),
        }
    }

    /// A bounced piece landed (or failed): copy it to its destination, and
    /// finish the GET or post its next piece.
    fn bounce_piece_done(
        &mut self,
        wc: &ffi::Completion,
        on_event: &mut dyn FnMut(FabricEvent<'_>),
    ) -> usize {
        let Some(b) = self.bounce.as_mut() else {
            return 0;
        };
        let (Some(n), Some(j)) = (b.in_flight.take(), b.jobs.front_mut()) else {
            return 0;
        };
        if !wc.ok() {
            let op = j.op;
            b.jobs.pop_front();
            if !wc.remote_refusal() {
                self.break_with(format!("operation: {}", wc.describe()));
            }
            on_event(FabricEvent::Done {
                op,
                result: OpResult::Get(Err(op_error(wc))),
            });
            self.next_bounce_piece();
            return 1;
        }
        // SAFETY: the destination is the memory of a receive in progress,
        // which the engine "registered" for this GET and keeps until it
        // completes (as it would for the NIC's own write); the bounce
        // buffer holds `n` bytes the READ just landed, and the two do not
        // overlap (the buffer is ours alone).
        unsafe {
            std::ptr::copy_nonoverlapping(b.buf.as_ptr(), (j.dst + j.done) as *mut u8, n as usize);
        }
        j.done += u64::from(n);
        b.copied += u64::from(n);
        let mut events = 0;
        if j.done == j.len {
            let op = j.op;
            b.jobs.pop_front();
            on_event(FabricEvent::Done {
                op,
                result: OpResult::Get(Ok(())),
            });
            events = 1;
        }
        self.next_bounce_piece();
        events
    }
}

/// Fault `[addr, addr+len)` in for writing from the CPU, before a READ
/// lands there through a registration on demand. The device's own fault
/// cannot wait for a userfaultfd handler or a SIGSEGV handler (the kernel
/// fails it, and the READ ends in a protection error): a page still
/// write-protected by another connection's send, or never touched in a
/// range registered with userfaultfd, must be resolved the CPU's way first,
/// as pinning it did. Each page's first byte in the range is read and
/// written back unchanged.
///
/// # Safety
/// `[addr, addr+len)` is mapped, writable memory the caller may write.
unsafe fn fault_in_for_writing(addr: u64, len: u64) {
    let page = crate::pages::system_page_size();
    let end = addr.saturating_add(len);
    let mut at = addr;
    while at < end {
        let p = at as *mut u8;
        // SAFETY: the caller's promise; volatile, so that neither access
        // is elided.
        unsafe { p.write_volatile(p.read_volatile()) };
        at = at - at % page + page;
    }
}

/// Did a registration fail for the locked-memory limit? (The kernel says
/// ENOMEM; only a finite `RLIMIT_MEMLOCK`, in a process without
/// CAP_IPC_LOCK, which lifts it, makes that the limit: any other ENOMEM is
/// a local failure, not a reason to bounce.)
fn pin_limit(e: &std::io::Error) -> bool {
    e.kind() == std::io::ErrorKind::OutOfMemory && memlock_finite() && !may_lock_memory()
}

/// CAP_IPC_LOCK in the effective set (`CapEff` of /proc/self/status).
fn may_lock_memory() -> bool {
    const CAP_IPC_LOCK: u32 = 14;
    std::fs::read_to_string("/proc/self/status").is_ok_and(|st| {
        st.lines()
            .find_map(|l| l.strip_prefix("CapEff:"))
            .and_then(|v| u64::from_str_radix(v.trim(), 16).ok())
            .is_some_and(|caps| caps & (1 << CAP_IPC_LOCK) != 0)
    })
}

/// What a failed registration means for the engine.
fn registration_error(e: &std::io::Error) -> OpError {
    if pin_limit(e) {
        OpError::PinLimit
    } else {
        OpError::Local
    }
}

fn memlock_finite() -> bool {
    nix::sys::resource::getrlimit(nix::sys::resource::Resource::RLIMIT_MEMLOCK)
        .is_ok_and(|(soft, _)| soft != libc::RLIM_INFINITY)
}

/// The lock word a peer's [`CasRequest`] names, if it names one of ours:
/// the key of our lock region (none once revoked), an aligned word inside
/// its `slots` words from `base`.
fn requested_slot(base: u64, slots: u16, region: Option<u32>, r: &CasRequest) -> Option<u16> {
    if region != Some(r.key) || r.addr < base {
        return None;
    }
    let off = r.addr - base;
    if !off.is_multiple_of(8) {
        return None;
    }
    u16::try_from(off / 8).ok().filter(|&slot| slot < slots)
}

fn op_error(wc: &ffi::Completion) -> OpError {
    if wc.remote_refusal() {
        OpError::RemoteAccess
    } else if wc.local_fault() {
        OpError::Local
    } else {
        OpError::Unreachable
    }
}

impl Fabric for VerbsEndpoint {
    fn lock_region(&self) -> LockRegion {
        LockRegion {
            addr: self.locks.as_ptr() as u64,
            key: self.lock_mr.as_ref().map_or(0, Mr::rkey),
            slots: self.params.lock_slots,
        }
    }

    /// Registration through the cache (`super::reg_cache`), completed at
    /// once: a receive destination on demand where the device offers it,
    /// pinned elsewhere; a source always pinned (what the peer may read is
    /// then the pages advertised, whatever the program maps there later by
    /// a call the memory hooks do not see).
    fn post_register(
        &mut self,
        op: OpId,
        addr: u64,
        len: u64,
        access: RegAccess,
    ) -> Result<(), FabricError> {
        let peer = access == RegAccess::PeerRead;
        self.forget_released();
        if let Some(key) = self.regs.reuse(addr, len, peer) {
            self.completions
                .push_back((op, OpResult::Registered(Ok(key))));
            return Ok(());
        }
        // A local registration covers its whole pages (the device checks
        // bytes, and a kept one serves any buffer in them); the peer's
        // covers the advertised bytes alone.
        let (at, n) = if peer {
            (addr, len)
        } else {
            let page = crate::pages::system_page_size();
            let at = addr - addr % page;
            (at, addr.saturating_add(len).next_multiple_of(page) - at)
        };
        let r = if peer {
            self.register_pinned(at, n, Access::PEER_READ)
        } else if self.odp_local {
            self.register_on_demand(at, n)
        } else {
            self.register_pinned(at, n, Access::LOCAL)
        };
        let r = match r {
            Ok(mr) => {
                let key = if peer { mr.rkey() } else { mr.lkey() };
                if !peer && self.odp_local {
                    self.regs.insert_on_demand(key, mr, addr, len);
                } else {
                    self.regs.insert(key, mr, addr, len, peer);
                }
                Ok(key)
            }
            Err(OpError::PinLimit) if !peer => self.bounce_key(),
            Err(why) => Err(why),
        };
        self.completions.push_back((op, OpResult::Registered(r)));
        Ok(())
    }

    fn deregister(&mut self, key: u32) {
        if self.bounce.as_ref().is_some_and(|b| b.mr.lkey() == key) {
            return;
        }
        self.regs.release(key);
    }

    /// Drop kept registrations in the huge pages (2 MiB) around `range`:
    /// arming moves its pages, which a pinned page of the same huge page
    /// forbids (6.18: EBUSY; 6.12 retries inside the kernel for ever).
    /// Our kept registrations near go; then no registration of this
    /// process (any connection's, in use or kept) may pin a page there.
    fn unpin_near(&mut self, range: std::ops::Range<u64>) -> bool {
        let window = crate::pinned::huge_windows(&range);
        !self.regs.unpin(window) && !crate::pinned::near(&range)
    }

    fn has_room(&self, len: usize) -> bool {
        self.broken.is_some()
            || (self.credits.may_send_message()
                && !self.free_send.is_empty()
                && HEADER_LEN + len <= self.peer.slot as usize)
    }

    fn post_message(&mut self, msg: &[u8]) -> Result<(), FabricError> {
        if self.foreign() || self.broken.is_some() {
            return Err(FabricError::Broken);
        }
        if HEADER_LEN + msg.len() > self.peer.slot as usize {
            return Err(FabricError::TooLarge);
        }
        if !self.credits.may_send_message() {
            return Err(FabricError::NoCredits);
        }
        self.send(Kind::Message, msg)
    }

    fn post_get(
        &mut self,
        op: OpId,
        src: RemoteBuf,
        dst: LocalBuf,
        len: u64,
    ) -> Result<(), FabricError> {
        if self.foreign() || self.broken.is_some() {
            return Err(FabricError::Broken);
        }
        let Ok(len) = u32::try_from(len) else {
            self.completions
                .push_back((op, OpResult::Get(Err(OpError::Local))));
            return Ok(());
        };
        if let Some(b) = self.bounce.as_mut()
            && b.mr.lkey() == dst.key
        {
            b.jobs.push_back(BounceJob {
                op,
                src,
                dst: dst.addr,
                len: u64::from(len),
                done: 0,
            });
            self.next_bounce_piece();
            return Ok(());
        }
        if self.regs.is_on_demand(dst.key) {
            // SAFETY: the destination is the memory of a receive in
            // progress, held for this GET, whose bytes the READ overwrites.
            unsafe { fault_in_for_writing(dst.addr, u64::from(len)) };
        }
        self.reads
            .start(op, dst.addr, dst.key, src.addr, src.key, u64::from(len));
        self.post_reads();
        Ok(())
    }

    fn post_cas(
        &mut self,
        op: OpId,
        target: CasTarget,
        expect: u64,
        new: u64,
    ) -> Result<(), FabricError> {
        if self.foreign() {
            return Err(FabricError::Broken);
        }
        match target {
            CasTarget::Local { slot } => {
                let r = self.cas_own(slot, expect, new);
                self.completions.push_back((op, OpResult::Cas(r)));
                Ok(())
            }
            CasTarget::Remote { addr, key } => {
                if self.broken.is_some() {
                    return Err(FabricError::Broken);
                }
                if self.cas_by_message {
                    return self.post_cas_message(op, addr, key, expect, new);
                }
                let Some(s) = self.free_cas.pop() else {
                    return Err(FabricError::NoCredits);
                };
                self.cas_words[s].store(0, Ordering::Relaxed);
                let cas = SendOp::Cas {
                    addr: self.cas_words.as_ptr() as u64 + (s * 8) as u64,
                    lkey: self.cas_mr.lkey(),
                    remote: addr,
                    rkey: key,
                    expect,
                    new,
                };
                self.post_cas_op(op, cas, s)
            }
        }
    }

    fn pool_alloc(&mut self, len: u64) -> Result<u64, OpError> {
        self.pool.alloc(len)
    }

    fn pool_fill(&mut self, addr: u64, len: u64, fill: &mut dyn FnMut(&mut [u8])) {
        if let Some(b) = self.pool.bytes(addr, len) {
            fill(b);
        }
    }

    fn pool_free(&mut self, addr: u64, _len: u64) {
        self.pool.free(addr);
    }

    /// Every key the peer could use goes: the NIC refuses them from now,
    /// READs in flight included.
    fn revoke_access(&mut self) {
        if self.foreign() {
            return;
        }
        self.regs.revoke_peer_keys();
        self.lock_mr = None;
        self.revoked_at.get_or_insert_with(Instant::now);
    }

    fn poll(&mut self, on_event: &mut dyn FnMut(FabricEvent<'_>)) -> usize {
        if self.foreign() {
            return 0;
        }
        let mut n = 0;
        while let Some((op, result)) = self.completions.pop_front() {
            on_event(FabricEvent::Done { op, result });
            n += 1;
        }
        n += self.take_completions(on_event);
        self.send_cas_answers();
        if self.broken.is_none() && self.credits.want_credits_only() && !self.free_send.is_empty() {
            let _ = self.send(Kind::Credits, &[]);
        }
        self.take_cm_events();
        self.probe_if_quiet();
        self.flush_if_over();
        if self.broken.is_some() && !self.gone_reported {
            // What arrived before the end is delivered first.
            n += self.take_until_flushed(on_event);
            // Lock requests no answer will come for fail, as the NIC's
            // own operations do (flushed).
            for (tag, op) in std::mem::take(&mut self.cas_by_tag) {
                self.free_cas.push(usize::from(tag));
                let result = OpResult::Cas(Err(OpError::Unreachable));
                on_event(FabricEvent::Done { op, result });
                n += 1;
            }
            // READs not posted yet fail (those posted come back flushed).
            for (op, r) in self.reads.fail_waiting(OpError::Unreachable) {
                on_event(FabricEvent::Done {
                    op,
                    result: OpResult::Get(r),
                });
                n += 1;
            }
            // (The piece on the send queue, if any, comes back flushed.)
            if let Some(b) = self.bounce.as_mut() {
                let waiting = b.jobs.len() - usize::from(b.in_flight.is_some());
                for j in b.jobs.drain(b.jobs.len() - waiting..) {
                    let result = OpResult::Get(Err(OpError::Unreachable));
                    on_event(FabricEvent::Done { op: j.op, result });
                    n += 1;
                }
            }
            self.gone_reported = true;
            on_event(FabricEvent::PeerGone {
                left: None,
                heir: false,
            });
            n += 1;
        }
        n
    }

    fn wait(&self, timeout: Duration) {
        if self.foreign() {
            std::thread::sleep(timeout.min(Duration::from_millis(10)));
            return;
        }
        if !self.completions.is_empty() {
            return;
        }
        let t = crate::fabric::FabricWaiter::prepare(&self.waiter);
        crate::fabric::FabricWaiter::wait(&self.waiter, t, timeout, true);
    }

    /// Arm the CQ, then look once: a completion that came before the arm
    /// raises no event, so it is taken off now (for the next poll) and the
    /// reactor polls before sleeping.
    fn arm(&mut self, _fired: bool) -> Armed {
        if self.foreign() {
            return Armed::Sleep;
        }
        self.waiter.rearm();
        let mut wcs = [ffi::Completion::default(); 8];
        let got = self.cq.poll(&mut wcs);
        self.stash.extend_from_slice(&wcs[..got]);
        let cm_waiting = self.cm_event_waiting();
        if !self.stash.is_empty()
            || !self.completions.is_empty()
            || cm_waiting
            || (self.broken.is_some() && !self.gone_reported)
        {
            Armed::Ready
        } else {
            Armed::Sleep
        }
    }

    fn completions_pending(&self) -> bool {
        !self.completions.is_empty()
    }

    fn gets_async(&self) -> bool {
        true
    }

    /// The peer's queue pair answered lately: a quiet connection's probe
    /// (every [`PROBE_QUIET`]) is acknowledged by the peer's NIC or kernel
    /// even while its process is stopped, and fails once it is gone.
    fn peer_vouched(&mut self) -> bool {
        self.broken.is_none() && self.last_heard.elapsed() < PROBE_QUIET + VOUCH_SLACK
    }

    fn finish(&self) {
        self.depart();
    }

    fn sharing(&self) -> &dyn crate::fabric::Sharing {
        self
    }
}

/// The queue pair is the process's that made it: a forked child's copy
/// never touches it (its calls go to the runner, `driver::delegation`).
/// The leave and left words are a page the forks share.
impl crate::fabric::Sharing for VerbsEndpoint {
    fn ownership(&self) -> crate::fabric::Ownership {
        if ffi::stack_is_ours() {
            crate::fabric::Ownership::Mine
        } else {
            crate::fabric::Ownership::Other
        }
    }

    fn claim(&self) -> bool {
        ffi::stack_is_ours()
    }

    fn request_leave(&self) {
        self.fork.request_leave();
    }

    fn leave_requested(&self) -> bool {
        self.fork.leave_requested()
    }

    fn mark_left(&self) {
        self.fork.mark_left();
    }

    fn has_left(&self) -> bool {
        self.fork.has_left()
    }
}

impl VerbsEndpoint {
    /// Is this a forked child's copy of the connection? Its queue pair,
    /// completion queue and channels are the parent's (the same device
    /// queues, mapped into both): a poll here would take the parent's
    /// completions, an arm its events, a post would write into its send
    /// queue. The driver sends such a process's calls to the runner; this
    /// keeps any path that slips past that off the device.
    fn foreign(&self) -> bool {
        !ffi::stack_is_ours()
    }

    /// A compare-and-swap on our own lock word `slot`, in the coherence
    /// domain the peer's take it in: the CPU's, or the device's (through
    /// the loopback pair) when the peer's NIC takes them.
    fn cas_own(&self, slot: u16, expect: u64, new: u64) -> Result<u64, OpError> {
        if slot >= self.params.lock_slots {
            return Err(OpError::Local);
        }
        if let Some((mr, l)) = &self.local_locks {
            let addr = self.locks.as_ptr() as u64 + u64::from(slot) * 8;
            return l.cas(mr, addr, expect, new).ok_or(OpError::Local);
        }
        let words = self.locks.as_ptr() as *const AtomicU64;
        // SAFETY: slot is in range of the mapping, whose words are 8-byte
        // aligned (a page).
        let w = unsafe { &*words.add(usize::from(slot)) };
        Ok(
            match w.compare_exchange(expect, new, Ordering::AcqRel, Ordering::Acquire) {
                Ok(v) | Err(v) => v,
            },
        )
    }

    /// The peer's lock by message: a request, answered by the peer's CPU.
    fn post_cas_message(
        &mut self,
        op: OpId,
        addr: u64,
        key: u32,
        expect: u64,
        new: u64,
    ) -> Result<(), FabricError> {
        if !self.credits.may_send_message() || self.free_send.is_empty() {
            return Err(FabricError::NoCredits);
        }
        let Some(s) = self.free_cas.pop() else {
            return Err(FabricError::NoCredits);
        };
        let tag = s as u16;
        let req = CasRequest {
            tag,
            key,
            addr,
            expect,
            new,
        };
        if let Err(e) = self.send(Kind::CasRequest, &req.emit()) {
            self.free_cas.push(s);
            return Err(e);
        }
        self.cas_by_tag.insert(tag, op);
        Ok(())
    }

    /// The peer asks for a compare-and-swap on one of our lock words: made
    /// here if it names one (our lock region's key, an aligned word in
    /// it, not revoked), refused otherwise, as a NIC would refuse it.
    fn answer_cas(&mut self, r: CasRequest) {
        let region = self.lock_mr.as_ref().map(Mr::rkey);
        let base = self.locks.as_ptr() as u64;
        let old = requested_slot(base, self.params.lock_slots, region, &r)
            .and_then(|slot| self.cas_own(slot, r.expect, r.new).ok());
        self.cas_answers.push_back(CasAnswer { tag: r.tag, old });
        self.send_cas_answers();
    }

    /// Answers that waited for a credit go now (in order).
    fn send_cas_answers(&mut self) {
        while let Some(a) = self.cas_answers.front().copied() {
            if self.broken.is_some()
                || !self.credits.may_send_message()
                || self.free_send.is_empty()
                || self.send(Kind::CasAnswer, &a.emit()).is_err()
            {
                return;
            }
            self.cas_answers.pop_front();
        }
    }

    /// The peer's answer to one of our requests.
    fn cas_answered(&mut self, a: CasAnswer, on_event: &mut dyn FnMut(FabricEvent<'_>)) -> usize {
        let Some(op) = self.cas_by_tag.remove(&a.tag) else {
            self.break_with(format!(
                "the peer answered lock request {} never made",
                a.tag
            ));
            return 0;
        };
        self.free_cas.push(usize::from(a.tag));
        let result = OpResult::Cas(a.old.ok_or(OpError::RemoteAccess));
        on_event(FabricEvent::Done { op, result });
        1
    }
}

impl VerbsEndpoint {
    /// Leave: the SENDs still on the send queue (the engine's last
    /// messages, its SHUTDOWN among them) go out first, as a TCP socket's
    /// queued bytes and FIN outlive its close; then the peer is told at
    /// once. Bounded: a peer that takes no more leaves us after
    /// [`DEPART_WAIT`].
    fn depart(&self) {
        if self.foreign() || self.departed.swap(true, Ordering::AcqRel) {
            return;
        }
        // (Completions `arm` took off the CQ and no poll has seen yet are
        // in the stash.)
        let stashed = self
            .stash
            .iter()
            .filter(|w| w.wr_id & WR_KIND == WR_SEND)
            .count();
        let mut outstanding =
            (usize::from(self.params.ring) - self.free_send.len()).saturating_sub(stashed);
        let until = std::time::Instant::now() + DEPART_WAIT;
        let mut wcs = [ffi::Completion::default(); 32];
        while outstanding > 0 && self.broken.is_none() && std::time::Instant::now() < until {
            let got = self.cq.poll(&mut wcs);
            let sends = wcs[..got]
                .iter()
                .filter(|w| w.wr_id & WR_KIND == WR_SEND)
                .count();
            // A failed completion, or the peer gone (an rdma_cm event):
            // nothing more will be taken.
            if wcs[..got].iter().any(|w| !w.ok()) || self.cm_event_waiting() {
                break;
            }
            outstanding = outstanding.saturating_sub(sends);
            if got == 0 {
                std::thread::sleep(Duration::from_micros(200));
            }
        }
        self.id.disconnect();
    }
}

impl VerbsEndpoint {
    /// Pairing, before the engine runs: send one message (see
    /// `super::pairing`).
    pub fn send_first(&mut self, msg: &[u8]) -> Result<(), String> {
        self.post_message(msg)
            .map_err(|e| self.broken.clone().unwrap_or_else(|| format!("{e:?}")))
    }

    /// Pairing, before the engine runs: the next message the peer sent,
    /// taken off the queue (what comes after it stays for the engine), by
    /// `until`. `Err` says why none came: the peer left, broke the
    /// connection, or took too long.
    pub fn take_first(&mut self, until: Instant) -> Result<Vec<u8>, String> {
        let mut wcs = [ffi::Completion::default(); 1];
        loop {
            let mut got: Option<Vec<u8>> = None;
            while got.is_none() {
                let wc = if self.stash.is_empty() {
                    if self.cq.poll(&mut wcs) == 0 {
                        break;
                    }
                    wcs[0]
                } else {
                    self.stash.remove(0)
                };
                self.completion(&wc, &mut |ev| {
                    if let FabricEvent::Message(m) = ev {
                        got = Some(m.to_vec());
                    }
                });
            }
            if let Some(m) = got {
                return Ok(m);
            }
            self.take_cm_events();
            if let Some(why) = &self.broken {
                return Err(why.clone());
            }
            let left = until.saturating_duration_since(Instant::now());
            if left.is_zero() {
                return Err("no message in time".into());
            }
            let t = crate::fabric::FabricWaiter::prepare(&self.waiter);
            if self.cq.poll(&mut wcs) == 1 {
                self.stash.push(wcs[0]);
                continue;
            }
            crate::fabric::FabricWaiter::wait(
                &self.waiter,
                t,
                left.min(Duration::from_millis(20)),
                true,
            );
        }
    }

    /// A connection quiet for [`PROBE_QUIET`] asks the peer's queue pair
    /// whether it is still there. A peer whose process died leaves no
    /// completion and, if its rdma_cm DREQ is lost, no event either: the
    /// probe's retries run out (a few seconds) and the peer is gone; a
    /// probe with no completion at all in [`PROBE_GIVE_UP`] ends it too.
    /// The engine's own keepalive needs credits, which a dead peer may
    /// hold.
    fn probe_if_quiet(&mut self) {
        let now = Instant::now();
        if std::mem::take(&mut self.heard) {
            self.last_heard = now;
        }
        if let Some(since) = self.probing
            && self.broken.is_none()
            && now - since >= PROBE_GIVE_UP
        {
            // Neither acknowledged nor failed: something ahead of it on the
            // send queue never ends (a READ from a peer that is gone).
            let waits = format!("{}; {}", self.describe(), ffi::describe_qp(self.id.qp()));
            self.flushed = true;
            self.id.disconnect();
            self.break_with(format!(
                "liveness probe neither acknowledged nor failed in {PROBE_GIVE_UP:?}: flushed ({waits})"
            ));
        }
        if self.broken.is_some() || self.probing.is_some() || now - self.last_heard < PROBE_QUIET {
            return;
        }
        match ffi::post_send(self.id.qp(), WR_PROBE, SendOp::Probe) {
            Ok(()) => self.probing = Some(now),
            Err(e) => self.break_with(format!("post probe: {e}")),
        }
    }

    /// Operations still in flight once the connection is over (the peer
    /// gone, or [`REVOKED_FLUSH`] after the engine let go of it) would wait
    /// for a peer that will not answer: rxe was seen to keep a READ from a
    /// killed peer outstanding for good after its DREQ came, with no retry
    /// and no error. The queue pair goes to the error state, which flushes
    /// them, so the calls waiting on them end (a receive whose READ writes
    /// into its buffer cannot return before).
    fn flush_if_over(&mut self) {
        let bounced = self.bounce.as_ref().map_or(0, |b| b.jobs.len());
        if self.flushed || (self.pending.is_empty() && self.cas_by_tag.is_empty() && bounced == 0) {
            return;
        }
        let revoked_long_ago = self
            .revoked_at
            .is_some_and(|t| t.elapsed() >= REVOKED_FLUSH);
        if self.broken.is_some() || revoked_long_ago {
            self.flushed = true;
            self.id.disconnect();
            self.break_with(format!(
                "{} operation(s) in flight after the end: flushed",
                self.pending.len() + self.cas_by_tag.len() + bounced
            ));
        }
    }

    /// The connection is over: move the queue pair to the error state
    /// (`rdma_disconnect`) and take completions until a receive comes back
    /// flushed, at most [`RQ_FLUSH_WAIT`]. Receives complete in order, so
    /// every message that arrived before the end is delivered then. The
    /// peer's DISCONNECTED can come before the completions of its last
    /// messages, whose SENDs it saw complete: a bsdp transfer over rxe on
    /// 6.17 lost its last 15 KiB and its SHUTDOWN, and the receiver got
    /// ECONNRESET (CI, 2026-11-27).
    fn take_until_flushed(&mut self, on_event: &mut dyn FnMut(FabricEvent<'_>)) -> usize {
        if !self.rq_flushed {
            self.id.disconnect();
        }
        let until = Instant::now() + RQ_FLUSH_WAIT;
        let mut n = self.take_completions(on_event);
        while !self.rq_flushed && Instant::now() < until {
            std::thread::sleep(Duration::from_micros(100));
            n += self.take_completions(on_event);
        }
        n
    }

    /// Has rdma_cm an event for this connection (after it was
    /// established: the peer or the device left)?
    fn cm_event_waiting(&self) -> bool {
        // SAFETY: the channel's descriptor lives as long as `self`.
        let fd = unsafe { std::os::fd::BorrowedFd::borrow_raw(self.events.fd()) };
        crate::poll_fd::poll_fd(fd, libc::POLLIN, Some(Duration::ZERO)) != 0
    }
}

/// How long a connection may be quiet before its peer is probed.
const PROBE_QUIET: Duration = Duration::from_secs(2);

/// How long past [`PROBE_QUIET`] the last word of the peer's queue pair
/// still vouches for it (the probe's round trip, a busy host).
const VOUCH_SLACK: Duration = Duration::from_secs(3);

/// How long a probe may go without a completion. A dead peer's queue pair
/// fails it once the retries run out (seconds); a live one acknowledges it
/// from its kernel or NIC, whatever its program does.
const PROBE_GIVE_UP: Duration = Duration::from_secs(15);

/// How long operations may stay in flight after the connection ended.
const REVOKED_FLUSH: Duration = Duration::from_secs(2);

/// How long the end of a connection waits for its receive queue to come
/// back flushed (in microseconds on rxe and hardware; a queue with no
/// receive posted never does).
const RQ_FLUSH_WAIT: Duration = Duration::from_secs(1);

/// How long leaving waits for the last SENDs to be taken.
const DEPART_WAIT: Duration = Duration::from_secs(5);

impl Drop for VerbsEndpoint {
    fn drop(&mut self) {
        self.depart();
    }
}

/// As the shim runs it. The peer is on another host (or device): no pid of
/// ours to name, and no user of ours to compare; it reads only what an
/// advertisement's rkey lets it, and only until revocation.
impl crate::transport::Endpoint for VerbsEndpoint {
    type Waiter = VerbsWaiter;

    fn waiter(&self) -> VerbsWaiter {
        self.waiter.clone()
    }

    fn peer_pid(&self) -> u32 {
        0
    }

    fn get_refused(&self) -> Option<String> {
        None
    }

    fn same_user(&self) -> bool {
        true
    }

    /// Not in the shim: a program that sends from a buffer it has just
    /// received into would register pages still armed (`ibv_reg_mr` on
    /// 6.12 waits in their fault for a landing the same connection must
    /// make), and measured, arming gains nothing for a receiver that reads
    /// into one buffer (docs/protocol.md §1.1). The engine arms over verbs
    /// (`azsdp-verbs-check armed`).
    fn arms_receives(&self) -> bool {
        false
    }

    /// A READ's round trip idles the link between zero-copy receives
    /// (`conn::ahead`).
    fn reads_ahead(&self) -> bool {
        true
    }

    /// Pairing over verbs agrees by its own messages (`super::pairing`):
    /// an endpoint exists only once agreed.
    fn agreement(&self) -> &std::sync::atomic::AtomicU32 {
        static AGREED: std::sync::atomic::AtomicU32 =
            std::sync::atomic::AtomicU32::new(crate::pairing::Agreement::COMMITTED);
        &AGREED
    }
}

/// The reactor watches the waiter's descriptor (completions and rdma_cm
/// events of this connection): no bell, and the peer's leaving comes as
/// an rdma_cm event, not a pidfd.
impl crate::fabric::Watched for VerbsEndpoint {}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    fn req(key: u32, addr: u64) -> CasRequest {
        CasRequest {
            tag: 1,
            key,
            addr,
            expect: 0,
            new: 1,
        }
    }

    #[test]
    fn a_lock_request_names_only_our_words() {
        let base = 0x10000;
        assert_eq!(requested_slot(base, 4, Some(7), &req(7, base)), Some(0));
        assert_eq!(
            requested_slot(base, 4, Some(7), &req(7, base + 24)),
            Some(3)
        );
        // Past the region, misaligned, before it, another key, revoked.
        assert_eq!(requested_slot(base, 4, Some(7), &req(7, base + 32)), None);
        assert_eq!(requested_slot(base, 4, Some(7), &req(7, base + 4)), None);
        assert_eq!(requested_slot(base, 4, Some(7), &req(7, base - 8)), None);
        assert_eq!(requested_slot(base, 4, Some(7), &req(8, base)), None);
        assert_eq!(requested_slot(base, 4, None, &req(7, base)), None);
    }

    proptest! {
        #[test]
        fn a_named_word_is_inside_the_region(base in 0u64..1 << 40, slots: u16, key: u32, addr: u64) {
            let base = base * 8;
            if let Some(slot) = requested_slot(base, slots, Some(key), &req(key, addr)) {
                prop_assert!(slot < slots);
                prop_assert_eq!(base + u64::from(slot) * 8, addr);
            }
        }
    }
}
