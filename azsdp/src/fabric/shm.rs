//! The `shm` fabric: two processes on one host.
//!
//! A `memfd` segment, mapped by both, holds a [`Ring`] per direction for
//! messages, each side's lock words (so the peer's compare-and-swap is a real
//! atomic on shared memory, one-sided as on a NIC), each side's table of
//! registrations, and per-side flags. GET is one `process_vm_readv` from the
//! peer's pages straight into the destination (the intra-host RDMA READ: one
//! copy, no peer involvement). A side that waits polls for a while, then
//! sleeps on a futex in the segment.
//!
//! **Trust.** The peer can write every byte of the segment at any time, so
//! nothing read from it is trusted beyond the connection it belongs to:
//! ring positions and lengths are checked on every access (a corrupted ring
//! ends the connection), the header's sizes are read once and checked at
//! [`ShmJoin::open`], and the segment is sealed against shrinking (a peer
//! could otherwise truncate it under us). Who the peer *is* comes only from
//! the kernel ([`crate::identity`]): the process whose memory GETs read is
//! the one whose credentials and pidfd came with its pairing message,
//! pinned by that pidfd; a process that takes the peer's side over after a
//! fork is followed only when it says so on our bell with its own kernel
//! identity ([`IntroKind::Claim`]), never because a word in the segment
//! names it.
//!
//! **Keys.** Every GET names a key, and the reader checks it against the
//! owner's registration table in the segment, as an RNIC checks an rkey: the
//! key must be live, and the range inside the registered one, before the
//! read and still after it (a registration withdrawn meanwhile voids the
//! read, as does the pinned process having exited, which could have freed
//! its pid for another). A peer can only make us read its own memory; one
//! of another user is never read at all ([`NoGet::OtherUser`]). While the
//! owner word says another process took the peer's side and its claim has
//! not come, GETs wait for it (then fail): neither process is read.
//!
//! **Waking.** A side that waits busy-polls, then sleeps on a futex in the
//! segment; a side no call waits on is its process's reactor's
//! ([`crate::driver::reactor`]), which *arms* the ring (a flag in it) and
//! sleeps. The peer that posts to an armed ring takes the flag and rings the
//! reactor's bell with the token that side published in the header: one
//! datagram on a socket every peer of that process holds. So a connection
//! holds no descriptor of its own: one bell per process, one pidfd and one
//! bell per peer process, shared by all connections to it.
//!
//! Bootstrap runs over a connected Unix socket: the side that makes the
//! segment ([`ShmOffer`]) sends it with an [`IntroKind::Offer`] and its
//! process's bell; the other ([`ShmJoin`]) maps it and answers with its own
//! bell. Both messages carry the sender's kernel identity, and the socket
//! is done with after them. A process that takes a side over after a fork
//! says so on the peer's bell, as mail with its own kernel identity and
//! bell ([`IntroKind::Claim`]). [`ShmEndpoint::offer`] and
//! [`ShmEndpoint::accept`] do the whole exchange for programs that own both
//! ends' setup; the preload shim runs the same steps inside `connect()` and
//! `accept()` with its own checks between them.
//!
//! `unsafe` here: mapping the segment, atomics and futexes on shared memory,
//! and the raw destination of GETs (application memory named by address).

use std::collections::VecDeque;
use std::io::IoSliceMut;
use std::os::fd::{AsFd, BorrowedFd, OwnedFd};
use std::sync::atomic::{AtomicBool, AtomicU32, AtomicU64, Ordering};
use std::sync::{Arc, Weak};
use std::time::{Duration, Instant};

use memmap2::{MmapMut, MmapOptions};
use nix::sys::uio::{RemoteIoVec, process_vm_readv};
use nix::unistd::Pid;

use super::pool::Pool;
use super::ring::{self, Ring, RingWatch};
use super::{
    Armed, Departure, Fabric, FabricError, FabricEvent, LocalBuf, OpResult, Ownership, RegAccess,
};
use crate::conn::{CasTarget, LockRegion, OpError, OpId, RemoteBuf};
use crate::driver::reactor::{self, Mail, Reactor};
use crate::identity::{self, IdentityError, PeerId};
use crate::pairing::{INTRO_LEN, Intro, IntroKind};
use crate::sync::Lock;
use crate::transport::{self, Transport};

const MAGIC: u64 = 0x617a_7364_7073_686d; // "azsdpshm"
const VERSION: u32 = 4;
const HEADER_LEN: usize = 4096;
/// Largest ring a segment may have (a peer's segment asking for more is
/// refused rather than mapped).
pub const MAX_RING: usize = 64 << 20;
const MAX_LOCK_SLOTS: u32 = 4096;
const MAX_REG_SLOTS: u32 = 1 << KEY_SLOT_BITS;

/// A registration key: the table slot in the low bits, a generation above
/// (never 0, so no key is 0 and a reused slot never revives an old key).
const KEY_SLOT_BITS: u32 = 14;
const KEY_SLOT_MASK: u32 = (1 << KEY_SLOT_BITS) - 1;
/// The key of every local GET destination: `process_vm_readv` writes our
/// own memory, so they need none (no table key is 0: generations start at 1).
const LOCAL_KEY: u32 = 0;

/// Segment header, at offset 0.
#[repr(C, align(64))]
struct SegHeader {
    magic: AtomicU64,
    version: AtomicU32,
    ring_cap: AtomicU32,
    lock_slots: AtomicU32,
    reg_slots: AtomicU32,
    /// Random identity, used as the lock words' key.
    key: AtomicU32,
    /// Per side: set before that side unprotects anything on abort; a GET
    /// from that side's memory that sees it afterwards is void.
    revoked: [AtomicU32; 2],
    /// Per side: the side closed its end cleanly.
    closed: [AtomicU32; 2],
    /// Per side: how much of its stream that side's `send()` calls have
    /// returned (the survivor of a death compares it with what it got).
    sent: [AtomicU64; 2],
    /// Per side: how much of the other side's stream that side's `recv()`
    /// calls have returned (the survivor compares it with what it sent).
    read: [AtomicU64; 2],
    /// Per side: the pid of the process running that side, with
    /// [`FROZEN`] set from a fork until a process claims it. Each side
    /// reads its own to know whether it runs the connection; the peer's
    /// is only a hint that a claim is on its way to our bell.
    owner: [AtomicU32; 2],
    /// Free for whoever set the pair up to agree on it (the preload shim's
    /// commit-or-withdraw word, see [`ShmEndpoint::agreement`]).
    agreement: AtomicU32,
    /// Per side: the token that side's reactor answers to on its process's
    /// bell (0: none yet). The peer rings it; a false one only makes some
    /// connection of ours look for nothing.
    bell: [AtomicU64; 2],
}

const _: () = assert!(std::mem::size_of::<SegHeader>() <= HEADER_LEN);

/// One registration, written by its owner, checked by the peer's GETs.
#[repr(C, align(32))]
struct RegEntry {
    /// The live key, or 0 when the slot is free. Stored last (release)
    /// when registering, first when withdrawing.
    key: AtomicU64,
    addr: AtomicU64,
    len: AtomicU64,
}

const REG_ENTRY_LEN: usize = std::mem::size_of::<RegEntry>();
const _: () = assert!(REG_ENTRY_LEN == 32);

/// In an owner word: frozen since a fork (pids stay below 2^22).
const FROZEN: u32 = 1 << 31;

/// Sizes of a segment.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct ShmParams {
    /// Bytes of each direction's ring (a power of two).
    pub ring_capacity: usize,
    /// Lock words per side.
    pub lock_slots: u16,
    /// Busy-poll before sleeping.
    pub poll: Duration,
}

impl Default for ShmParams {
    fn default() -> Self {
        ShmParams {
            ring_capacity: 1 << 20,
            lock_slots: 64,
            poll: Duration::from_micros(20),
        }
    }
}

impl ShmParams {
    /// Registrations per side: every outstanding advertisement (at most one
    /// per lock word) and its copy-on-write copy, with room to spare.
    fn reg_slots(&self) -> u32 {
        (u32::from(self.lock_slots) * 4).clamp(64, MAX_REG_SLOTS)
    }
}

/// Layout of the segment: where each part starts.
#[derive(Clone, Copy, Debug)]
struct Layout {
    ring: [usize; 2],
    ring_len: usize,
    locks: [usize; 2],
    regs: [usize; 2],
    len: usize,
}

impl Layout {
    fn new(ring_cap: usize, slots: u32, reg_slots: u32) -> Layout {
        let ring_len = ring::region_len(ring_cap).next_multiple_of(64);
        let r0 = HEADER_LEN;
        let r1 = r0 + ring_len;
        let l0 = r1 + ring_len;
        let locks_len = (slots as usize * 8).next_multiple_of(64);
        let l1 = l0 + locks_len;
        let g0 = l1 + locks_len;
        let regs_len = reg_slots as usize * REG_ENTRY_LEN;
        let g1 = g0 + regs_len;
        Layout {
            ring: [r0, r1],
            ring_len,
            locks: [l0, l1],
            regs: [g0, g1],
            len: (g1 + regs_len).next_multiple_of(4096),
        }
    }
}

/// A mapped segment.
#[derive(Debug)]
struct Segment {
    map: MmapMut,
    layout: Layout,
    slots: u16,
    reg_slots: u32,
    key: u32,
    /// Per side: a waiter of this process saw that side's closed flag and
    /// returned at once, so that its thread looks (then reports the peer
    /// gone). Later waits sleep as usual: with nothing more to come, not
    /// sleeping would spin.
    closed_seen: [AtomicBool; 2],
}

fn bad(what: &str) -> std::io::Error {
    std::io::Error::new(
        std::io::ErrorKind::InvalidData,
        format!("shm segment: {what}"),
    )
}

impl Segment {
    /// Has `side` closed, and is that news to this process's waiters (see
    /// `closed_seen`)?
    fn peer_closed_news(&self, side: usize) -> bool {
        self.hdr().closed[side].load(Ordering::Acquire) != 0
            && !self.closed_seen[side].swap(true, Ordering::AcqRel)
    }

    fn hdr(&self) -> &SegHeader {
        // SAFETY: the mapping is at least HEADER_LEN bytes, page-aligned, and
        // lives as long as self; SegHeader is all atomics (any bit pattern
        // is valid).
        unsafe { &*self.map.as_ptr().cast::<SegHeader>() }
    }

    fn base(&self) -> *mut u8 {
        self.map.as_ptr().cast_mut()
    }

    /// Lock word `slot` of `side`.
    fn lock_word(&self, side: usize, slot: usize) -> Option<&AtomicU64> {
        if slot >= usize::from(self.slots) {
            return None;
        }
        let off = self.layout.locks[side] + slot * 8;
        // SAFETY: in bounds (slot < slots, the lock area holds slots words),
        // 8-aligned (lock areas are 64-aligned), shared and only ever
        // accessed atomically.
        Some(unsafe { &*self.base().add(off).cast::<AtomicU64>() })
    }

    /// Registration `slot` of `side`.
    fn reg(&self, side: usize, slot: u32) -> Option<&RegEntry> {
        if slot >= self.reg_slots {
            return None;
        }
        let off = self.layout.regs[side] + slot as usize * REG_ENTRY_LEN;
        // SAFETY: in bounds (slot < reg_slots, the table holds reg_slots
        // entries), 32-aligned (tables start 64-aligned), shared and only
        // ever accessed atomically.
        Some(unsafe { &*self.base().add(off).cast::<RegEntry>() })
    }

    fn ring(&self, dir: usize) -> std::io::Result<Ring> {
        // SAFETY: the ring region lies inside the mapping and is 64-aligned;
        // the mapping outlives the Ring (the endpoint holds both; Ring is
        // dropped first as a field declared earlier). One producer and one
        // consumer per direction by construction of the endpoints. Attach
        // checks the ring's header against the region's length.
        let r =
            unsafe { Ring::attach(self.base().add(self.layout.ring[dir]), self.layout.ring_len) }
                .map_err(|e| bad(&format!("ring {dir}: {e}")))?;
        if r.capacity() != self.layout.ring_len - ring::HEADER {
            return Err(bad(&format!(
                "ring {dir}: capacity differs from the header's"
            )));
        }
        Ok(r)
    }

    /// A new segment and its memfd, sealed so that nobody can shrink or
    /// grow it.
    fn create(p: &ShmParams) -> std::io::Result<(Segment, OwnedFd)> {
        use nix::fcntl::{FcntlArg, SealFlag, fcntl};
        use nix::sys::memfd::{MFdFlags, memfd_create};
        if !p.ring_capacity.is_power_of_two() || !(64..=MAX_RING).contains(&p.ring_capacity) {
            return Err(bad("ring capacity must be a power of two up to 64 MiB"));
        }
        let reg_slots = p.reg_slots();
        let layout = Layout::new(p.ring_capacity, u32::from(p.lock_slots), reg_slots);
        let fd = memfd_create(
            c"azsdp-shm",
            MFdFlags::MFD_CLOEXEC | MFdFlags::MFD_ALLOW_SEALING,
        )?;
        let file = std::fs::File::from(fd.try_clone()?);
        crate::file_size::set_len(&file, layout.len as u64)?;
        fcntl(
            &fd,
            FcntlArg::F_ADD_SEALS(
                SealFlag::F_SEAL_SHRINK | SealFlag::F_SEAL_GROW | SealFlag::F_SEAL_SEAL,
            ),
        )?;
        // SAFETY: a fresh memfd of the right length, mapped shared; nobody
        // else has it yet.
        let mut map = unsafe { MmapOptions::new().len(layout.len).map_mut(&file)? };
        let base = map.as_mut_ptr();
        for dir in 0..2 {
            // SAFETY: in bounds, 64-aligned, not yet shared.
            unsafe { Ring::init(base.add(layout.ring[dir]), layout.ring_len) }
                .map_err(std::io::Error::other)?;
        }
        let key = {
            use std::hash::BuildHasher;
            std::collections::hash_map::RandomState::new().hash_one(std::process::id()) as u32 | 1
        };
        let seg = Segment {
            map,
            layout,
            slots: p.lock_slots,
            reg_slots,
            key,
            closed_seen: Default::default(),
        };
        let h = seg.hdr();
        h.version.store(VERSION, Ordering::Relaxed);
        h.ring_cap.store(p.ring_capacity as u32, Ordering::Relaxed);
        h.lock_slots
            .store(u32::from(p.lock_slots), Ordering::Relaxed);
        h.reg_slots.store(reg_slots, Ordering::Relaxed);
        h.key.store(key, Ordering::Relaxed);
        h.magic.store(MAGIC, Ordering::Release);
        Ok((seg, fd))
    }

    /// Map a segment the peer made. Everything in it is the peer's word:
    /// sizes are read once, checked, and used from our copy.
    fn open(fd: OwnedFd) -> std::io::Result<Segment> {
        use nix::fcntl::{FcntlArg, SealFlag, fcntl};
        let seals = fcntl(&fd, FcntlArg::F_GET_SEALS).map_err(|_| bad("not a sealable memfd"))?;
        let seals = SealFlag::from_bits_truncate(seals);
        if !seals.contains(SealFlag::F_SEAL_SHRINK) {
            return Err(bad("not sealed against shrinking"));
        }
        let file = std::fs::File::from(fd);
        let len = file.metadata()?.len() as usize;
        let largest = Layout::new(MAX_RING, MAX_LOCK_SLOTS, MAX_REG_SLOTS).len;
        if !(HEADER_LEN..=largest).contains(&len) {
            return Err(bad("size out of range"));
        }
        // SAFETY: mapping a sealed memfd the peer passed us, at most its
        // (unshrinkable) length; we only access it through atomics and rings
        // that check every position and length they read.
        let map = unsafe { MmapOptions::new().len(len).map_mut(&file)? };
        // SAFETY: HEADER_LEN bytes are mapped (checked above).
        let h = unsafe { &*map.as_ptr().cast::<SegHeader>() };
        if h.magic.load(Ordering::Acquire) != MAGIC || h.version.load(Ordering::Relaxed) != VERSION
        {
            return Err(bad("bad magic or version"));
        }
        let cap = h.ring_cap.load(Ordering::Relaxed) as usize;
        let slots = h.lock_slots.load(Ordering::Relaxed);
        let reg_slots = h.reg_slots.load(Ordering::Relaxed);
        if !cap.is_power_of_two() || !(64..=MAX_RING).contains(&cap) {
            return Err(bad("ring capacity"));
        }
        if !(1..=MAX_LOCK_SLOTS).contains(&slots) || !(1..=MAX_REG_SLOTS).contains(&reg_slots) {
            return Err(bad("lock or registration slots"));
        }
        let layout = Layout::new(cap, slots, reg_slots);
        if layout.len > len {
            return Err(bad("shorter than its layout"));
        }
        let key = h.key.load(Ordering::Relaxed);
        let seg = Segment {
            map,
            layout,
            slots: slots as u16,
            reg_slots,
            key,
            closed_seen: Default::default(),
        };
        seg.ring(0)?;
        seg.ring(1)?;
        Ok(seg)
    }
}

/// Why GET is not available to this endpoint.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum NoGet {
    /// The peer runs as another user.
    OtherUser { mine: u32, peer: u32 },
    /// The kernel refused to let us read the peer's memory.
    Refused(String),
}

/// Whether we may read `peer`'s memory, asked of the kernel without
/// touching any of it: `process_vm_readv` checks permission before it
/// looks at addresses, so reading address 0 fails with EFAULT when we may
/// and EPERM when we may not.
fn get_permission(peer: &PeerId) -> Option<NoGet> {
    let mine = nix::unistd::geteuid().as_raw();
    if peer.uid() != mine {
        return Some(NoGet::OtherUser {
            mine,
            peer: peer.uid(),
        });
    }
    let mut byte = [0u8; 1];
    let remote = [RemoteIoVec { base: 0, len: 1 }];
    let pid = Pid::from_raw(peer.pid() as i32);
    let r = process_vm_readv(pid, &mut [IoSliceMut::new(&mut byte)], &remote);
    if !peer.alive() {
        return Some(NoGet::Refused("the peer exited".into()));
    }
    match r {
        Ok(_) | Err(nix::Error::EFAULT) => None,
        Err(e) => Some(NoGet::Refused(e.desc().to_string())),
    }
}

/// This side's registrations: which slots are free and each slot's last
/// generation (kept in our own memory; the table in the segment is only
/// what the peer checks).
#[derive(Debug)]
struct Registrations {
    generation: Vec<u32>,
    free: Vec<u32>,
}

impl Registrations {
    fn new(slots: u32) -> Registrations {
        Registrations {
            generation: vec![0; slots as usize],
            free: (0..slots).rev().collect(),
        }
    }
}

/// One side of a `shm` connection.
#[derive(Debug)]
pub struct ShmEndpoint {
    // Rings borrow the mapping in `seg`: declared first, dropped first.
    tx: Ring,
    rx: Ring,
    seg: Arc<Segment>,
    side: usize,
    /// The process running the peer side, verified and pinned.
    peer: PeerId,
    /// The bell of the process running the peer side (shared by every
    /// connection to that process): rung when we post to an armed ring,
    /// and where a claim after our fork goes.
    peer_bell: Arc<OwnedFd>,
    peer_page_size: u32,
    no_get: Option<NoGet>,
    params: ShmParams,
    completions: VecDeque<(OpId, OpResult)>,
    regs: Registrations,
    /// Copies copy-on-write makes, for the peer to GET.
    pool: Pool,
    gone_reported: bool,
    /// The peer wrote nonsense into the segment: the connection is over.
    corrupt: bool,
    /// When the peer process was last seen alive: an idle poll asks the
    /// kernel (a system call) at most once per [`ALIVE_EVERY`].
    alive_at: Option<Instant>,
    held_gets: VecDeque<HeldGet>,
}

/// An endpoint this process runs and lets go of says so in the segment:
/// the peer then learns at once that nothing more will come or be read
/// (as a TCP peer learns from the FIN, or the RST its next segment
/// draws), not when this process exits. (A forked child's copy of the
/// parent's side is not this process's to close.)
impl Drop for ShmEndpoint {
    fn drop(&mut self) {
        self.finish();
    }
}

/// How long a GET waits for the claim of a process that took the peer side
/// over. A true claim is on our bell before anything the new process
/// posts, and reaches the endpoint within microseconds; a word rewritten
/// without one fails the GET (and holds up a call on it) no longer.
const CLAIM_WAIT: Duration = Duration::from_millis(200);

/// A GET held until a claim comes (see `ShmEndpoint::claim_pending`).
#[derive(Debug)]
struct HeldGet {
    op: OpId,
    src: RemoteBuf,
    dst: u64,
    len: u64,
    since: Instant,
}

/// How often an idle endpoint asks whether the peer process still exists
/// (a peer that closes says so in the segment at once; this is for one
/// that dies without closing).
const ALIVE_EVERY: Duration = Duration::from_millis(1);

fn page_size() -> u32 {
    crate::pages::system_page_size() as u32
}

/// Send a side-channel message of `kind` with this process's identity and
/// `fds`, whole or not at all.
pub fn send_intro(
    sock: BorrowedFd<'_>,
    intro: &Intro,
    fds: &[BorrowedFd<'_>],
    nonblocking: bool,
) -> std::io::Result<()> {
    let mut b = [0u8; INTRO_LEN];
    intro.emit(&mut b);
    if nonblocking {
        identity::send_nonblocking(sock, &b, fds)
    } else {
        identity::send(sock, &b, fds)
    }
}

/// Why a side-channel message was refused.
#[derive(Debug, thiserror::Error)]
pub enum IntroError {
    #[error("{0}")]
    Identity(#[from] IdentityError),
    #[error("{0}")]
    Format(#[from] crate::pairing::PairError),
    #[error("expected {want:?}, got {got:?}")]
    Kind { want: IntroKind, got: IntroKind },
}

impl IntroError {
    /// Nothing was queued (non-blocking receive).
    pub fn would_block(&self) -> bool {
        matches!(self, IntroError::Identity(IdentityError::Io(e)) if e.kind() == std::io::ErrorKind::WouldBlock)
    }
}

impl From<IntroError> for std::io::Error {
    fn from(e: IntroError) -> Self {
        match e {
            IntroError::Identity(IdentityError::Io(e)) => e,
            e => std::io::Error::other(e.to_string()),
        }
    }
}

/// Receive one side-channel message of kind `want`, with its sender's
/// verified identity and descriptors.
pub fn recv_intro(
    sock: BorrowedFd<'_>,
    want: IntroKind,
    nonblocking: bool,
) -> Result<(Intro, identity::Received), IntroError> {
    let mut b = [0u8; INTRO_LEN];
    let r = identity::recv(sock, &mut b, nonblocking)?;
    let intro = Intro::parse(&b)?;
    if intro.kind != want {
        return Err(IntroError::Kind {
            want,
            got: intro.kind,
        });
    }
    Ok((intro, r))
}

/// A segment this side made, before the peer has joined.
#[derive(Debug)]
pub struct ShmOffer {
    seg: Segment,
    memfd: OwnedFd,
    params: ShmParams,
}

impl ShmOffer {
    pub fn new(params: ShmParams) -> std::io::Result<ShmOffer> {
        let (seg, memfd) = Segment::create(&params)?;
        Ok(ShmOffer { seg, memfd, params })
    }

    /// The segment's descriptor, to pass to the peer with the offer.
    pub fn memfd(&self) -> BorrowedFd<'_> {
        self.memfd.as_fd()
    }

    /// See [`ShmEndpoint::agreement`].
    pub fn agreement(&self) -> &AtomicU32 {
        &self.seg.hdr().agreement
    }

    /// Give up on a pair the peer may already have committed to: mark our
    /// side closed, so that the peer's engine sees us leave.
    pub fn abandon(self) {
        self.seg.hdr().closed[0].store(1, Ordering::Release);
        for dir in 0..2 {
            if let Ok(r) = self.seg.ring(dir) {
                crate::futex::wake_all(r.wait_words().0);
            }
        }
    }

    /// The peer joined (its answer named it, and passed its process's
    /// `bell`): run side 0.
    pub fn into_endpoint(
        self,
        bell: OwnedFd,
        peer: PeerId,
        peer_page_size: u32,
    ) -> std::io::Result<ShmEndpoint> {
        ShmEndpoint::new(self.seg, 0, bell, peer, peer_page_size, self.params)
    }
}

/// A segment the peer offered, mapped and checked.
#[derive(Debug)]
pub struct ShmJoin {
    seg: Segment,
    params: ShmParams,
}

impl ShmJoin {
    /// Map the offered `memfd`; `poll` is this side's busy-poll time.
    pub fn open(memfd: OwnedFd, poll: Duration) -> std::io::Result<ShmJoin> {
        let seg = Segment::open(memfd)?;
        let params = ShmParams {
            ring_capacity: seg.layout.ring_len - ring::HEADER,
            lock_slots: seg.slots,
            poll,
        };
        Ok(ShmJoin { seg, params })
    }

    /// See [`ShmEndpoint::agreement`].
    pub fn agreement(&self) -> &AtomicU32 {
        &self.seg.hdr().agreement
    }

    /// Run side 1, with the offering `peer` and its process's `bell`.
    pub fn into_endpoint(
        self,
        bell: OwnedFd,
        peer: PeerId,
        peer_page_size: u32,
    ) -> std::io::Result<ShmEndpoint> {
        ShmEndpoint::new(self.seg, 1, bell, peer, peer_page_size, self.params)
    }
}

/// The shm fabric as a [`Transport`]: segments of `params`; each side's
/// half carries its process's bell (an offer: the segment, then the bell;
/// an answer: the bell).
#[derive(Clone, Copy, Debug)]
pub struct ShmTransport {
    pub params: ShmParams,
}

/// [`ShmTransport`]'s offer: the segment made, and the bell it carries.
#[derive(Debug)]
pub struct ShmOffered {
    offer: ShmOffer,
    reactor: Arc<Reactor>,
}

/// [`ShmTransport`]'s join: the offered segment mapped and checked, the
/// offerer's bell, and ours for the answer.
#[derive(Debug)]
pub struct ShmJoined {
    join: ShmJoin,
    bell: OwnedFd,
    reactor: Arc<Reactor>,
}

impl Transport for ShmTransport {
    type Endpoint = ShmEndpoint;
    type Offer = ShmOffered;
    type Join = ShmJoined;

    fn offer(&self) -> std::io::Result<ShmOffered> {
        Ok(ShmOffered {
            offer: ShmOffer::new(self.params)?,
            reactor: Reactor::get()?,
        })
    }

    fn join(&self, fds: Vec<OwnedFd>) -> std::io::Result<ShmJoined> {
        let mut fds = fds.into_iter();
        let (Some(memfd), Some(bell), None) = (fds.next(), fds.next(), fds.next()) else {
            return Err(bad("an offer carries a segment and a bell, nothing else"));
        };
        Ok(ShmJoined {
            join: ShmJoin::open(memfd, self.params.poll)?,
            bell,
            reactor: Reactor::get()?,
        })
    }
}

impl transport::Offer for ShmOffered {
    type Endpoint = ShmEndpoint;

    fn fds(&self) -> Vec<BorrowedFd<'_>> {
        vec![self.offer.memfd(), self.reactor.bell()]
    }

    fn agreement(&self) -> &AtomicU32 {
        self.offer.agreement()
    }

    fn abandon(self) {
        self.offer.abandon();
    }

    fn into_endpoint(
        self,
        fds: Vec<OwnedFd>,
        peer: PeerId,
        peer_page_size: u32,
    ) -> std::io::Result<ShmEndpoint> {
        let mut fds = fds.into_iter();
        let (Some(bell), None) = (fds.next(), fds.next()) else {
            return Err(bad("an answer carries a bell, nothing else"));
        };
        self.offer.into_endpoint(bell, peer, peer_page_size)
    }
}

impl transport::Join for ShmJoined {
    type Endpoint = ShmEndpoint;

    fn fds(&self) -> Vec<BorrowedFd<'_>> {
        vec![self.reactor.bell()]
    }

    fn agreement(&self) -> &AtomicU32 {
        self.join.agreement()
    }

    fn into_endpoint(self, peer: PeerId, peer_page_size: u32) -> std::io::Result<ShmEndpoint> {
        self.join.into_endpoint(self.bell, peer, peer_page_size)
    }
}

impl transport::Endpoint for ShmEndpoint {
    type Waiter = ShmWaiter;

    fn waiter(&self) -> ShmWaiter {
        ShmEndpoint::waiter(self)
    }

    fn peer_pid(&self) -> u32 {
        self.peer.pid()
    }

    fn get_refused(&self) -> Option<String> {
        self.no_get.as_ref().map(|n| format!("{n:?}"))
    }

    fn same_user(&self) -> bool {
        ShmEndpoint::same_user(self)
    }

    fn agreement(&self) -> &AtomicU32 {
        ShmEndpoint::agreement(self)
    }
}

/// Bells this process rings, one per peer process (by its shared pidfd):
/// a peer's later connections pass the same bell again, and keep none.
static BELLS: Lock<Vec<(Weak<OwnedFd>, Weak<OwnedFd>)>> = Lock::new(Vec::new());

/// The bell of `peer`'s process: the one we hold already, or `fresh`.
fn shared_bell(peer: &PeerId, fresh: OwnedFd) -> Arc<OwnedFd> {
    let pidfd = peer.pidfd_shared();
    let mut bells = BELLS.lock();
    bells.retain(|(p, b)| p.strong_count() > 0 && b.strong_count() > 0);
    if let Some(b) = bells
        .iter()
        .filter(|(p, _)| std::ptr::eq(p.as_ptr(), Arc::as_ptr(&pidfd)))
        .find_map(|(_, b)| b.upgrade())
    {
        return b;
    }
    let b = Arc::new(fresh);
    bells.push((Arc::downgrade(&pidfd), Arc::downgrade(&b)));
    b
}

/// Read `len` bytes at `src` in process `pid` into `dst`, all or nothing.
fn read_remote(pid: u32, src: u64, dst: *mut u8, len: usize) -> Result<(), nix::Error> {
    let pid = Pid::from_raw(pid as i32);
    let mut done = 0usize;
    while done < len {
        // SAFETY: the caller guarantees `dst` is valid for `len` bytes of
        // writes (it is the engine's GET destination, which the engine does
        // not touch until the GET completes).
        let local = unsafe { std::slice::from_raw_parts_mut(dst.add(done), len - done) };
        let remote = [RemoteIoVec {
            base: (src as usize).wrapping_add(done),
            len: len - done,
        }];
        let n = process_vm_readv(pid, &mut [IoSliceMut::new(local)], &remote)?;
        if n == 0 {
            return Err(nix::Error::EFAULT);
        }
        done += n;
    }
    Ok(())
}

impl ShmEndpoint {
    fn new(
        seg: Segment,
        side: usize,
        peer_bell: OwnedFd,
        peer: PeerId,
        peer_page_size: u32,
        params: ShmParams,
    ) -> std::io::Result<ShmEndpoint> {
        let no_get = get_permission(&peer);
        seg.hdr().owner[side].store(crate::process::pid(), Ordering::Release);
        let regs = Registrations::new(seg.reg_slots);
        let (tx, rx) = (seg.ring(side)?, seg.ring(1 - side)?);
        Ok(ShmEndpoint {
            tx,
            rx,
            seg: Arc::new(seg),
            side,
            peer_bell: shared_bell(&peer, peer_bell),
            peer,
            peer_page_size,
            no_get,
            params,
            completions: VecDeque::new(),
            pool: Pool::default(),
            regs,
            gone_reported: false,
            corrupt: false,
            alive_at: None,
            held_gets: VecDeque::new(),
        })
    }

    /// Bootstrap over a connected Unix socket as the side that makes the
    /// segment (side 0), as [`ShmTransport`] pairs: the offer carries the
    /// segment and this process's bell, the answer the peer's bell. `sock`
    /// stays the caller's.
    pub fn offer(sock: &impl AsFd, params: ShmParams) -> std::io::Result<ShmEndpoint> {
        use transport::Offer as _;
        let offer = ShmTransport { params }.offer()?;
        let fd = sock.as_fd();
        send_intro(
            fd,
            &Intro::new(IntroKind::Offer, page_size()),
            &offer.fds(),
            false,
        )?;
        let (intro, answer) = recv_intro(fd, IntroKind::Answer, false)?;
        offer.into_endpoint(answer.fds, answer.peer, intro.page_size)
    }

    /// Bootstrap over a connected Unix socket as the side that maps the
    /// peer's segment (side 1).
    pub fn accept(sock: &impl AsFd, params: ShmParams) -> std::io::Result<ShmEndpoint> {
        use transport::Join as _;
        let fd = sock.as_fd();
        let (intro, offer) = recv_intro(fd, IntroKind::Offer, false)?;
        let join = ShmTransport { params }.join(offer.fds)?;
        send_intro(
            fd,
            &Intro::new(IntroKind::Answer, page_size()),
            &join.fds(),
            false,
        )?;
        join.into_endpoint(offer.peer, intro.page_size)
    }

    /// A waiter for this endpoint's incoming messages (it only looks).
    pub fn waiter(&self) -> ShmWaiter {
        ShmWaiter {
            rx: self.rx.watch(),
            seg: Arc::clone(&self.seg),
            peer: 1 - self.side,
            poll: self.params.poll,
        }
    }

    /// A word both sides share, 0 when the segment is made, that the code
    /// pairing two connections uses to agree (by compare-and-swap) whether
    /// the pair goes ahead. Waiters sleep on it with [`crate::futex`].
    pub fn agreement(&self) -> &AtomicU32 {
        &self.seg.hdr().agreement
    }

    /// `None` if this side may GET from the peer; otherwise why not.
    pub fn can_get(&self) -> Option<&NoGet> {
        self.no_get.as_ref()
    }

    /// The pid of the (verified) process running the peer side.
    pub fn peer_pid(&self) -> i32 {
        self.peer.pid() as i32
    }

    /// The (verified) uid of the peer.
    pub fn peer_uid(&self) -> u32 {
        self.peer.uid()
    }

    /// Is the peer of our own user? Only then may either side read the
    /// other's memory: across users the pair runs over the rings, whatever
    /// the peer says it can do.
    pub fn same_user(&self) -> bool {
        self.peer.uid() == nix::unistd::geteuid().as_raw()
    }

    pub fn peer_page_size(&self) -> u32 {
        self.peer_page_size
    }

    /// Mark this end closed cleanly (the peer then sees PeerGone without
    /// waiting for the process to exit).
    pub fn close(&self) {
        self.seg.hdr().closed[self.side].store(1, Ordering::Release);
        self.wake_peer(true);
    }

    /// Wake the peer's threads sleeping on the ring, and ring its
    /// reactor's doorbell if it is armed (`force`: whatever they do).
    fn wake_peer(&self, force: bool) {
        let (published, sleeping) = self.tx.wait_words();
        if force || sleeping.load(Ordering::Acquire) != 0 {
            crate::futex::wake_all(published);
        }
        // Pairs with the fence in `arm`: either the peer's reactor sees
        // what we published, or we see it armed.
        std::sync::atomic::fence(Ordering::SeqCst);
        let armed = self.tx.armed();
        if (force || armed.load(Ordering::Relaxed) != 0) && armed.swap(0, Ordering::AcqRel) != 0 {
            self.ring_doorbell();
        }
    }

    /// The peer's token on its process's bell. A bell that is full (or a
    /// peer with no token yet) leaves the ring armed: the next message
    /// rings again, and the peer's reactor looks at least once a second.
    fn ring_doorbell(&self) {
        let token = self.seg.hdr().bell[1 - self.side].load(Ordering::Acquire);
        if token == 0 || !reactor::ring(self.peer_bell.as_fd(), token) {
            self.tx.armed().store(1, Ordering::Release);
        }
    }

    fn peer_closed(&self) -> bool {
        self.seg.hdr().closed[1 - self.side].load(Ordering::Acquire) != 0
    }

    /// Does the owner word say another process took the peer side, whose
    /// claim (with its kernel identity) has not reached us yet?
    fn claim_pending(&self) -> bool {
        let w = self.seg.hdr().owner[1 - self.side].load(Ordering::Acquire) & !FROZEN;
        w != 0 && w != self.peer.pid()
    }

    /// GETs held for a claim: run once it came, failed if it never does.
    fn release_held_gets(&mut self) {
        while let Some(g) = self.held_gets.front() {
            let result = if !self.claim_pending() {
                self.get(g.src, g.dst, g.len)
            } else if g.since.elapsed() >= CLAIM_WAIT {
                Err(OpError::Unreachable)
            } else {
                return;
            };
            let op = g.op;
            self.held_gets.pop_front();
            self.completions.push_back((op, OpResult::Get(result)));
        }
    }

    /// Tell the peer, with our kernel identity and our process's bell, that
    /// this process runs our side now (after a fork).
    fn send_claim(&self) {
        let Ok(reactor) = Reactor::get() else {
            return;
        };
        let mut body = [0u8; reactor::MAIL_LEN];
        Intro::new(IntroKind::Claim, page_size()).emit(&mut body);
        let token = self.seg.hdr().bell[1 - self.side].load(Ordering::Acquire);
        // A peer that is gone needs no claim.
        let _ = reactor::send_mail(self.peer_bell.as_fd(), token, &body, &[reactor.bell()]);
    }

    fn peer_alive(&mut self) -> bool {
        if self.peer_closed() {
            return false;
        }
        let now = Instant::now();
        if self.alive_at.is_some_and(|t| now < t + ALIVE_EVERY) {
            return true;
        }
        let alive = self.peer.alive();
        self.alive_at = alive.then_some(now);
        alive
    }

    fn cas(&self, target: CasTarget, expect: u64, new: u64) -> Result<u64, OpError> {
        let word = match target {
            CasTarget::Local { slot } => self.seg.lock_word(self.side, usize::from(slot)),
            CasTarget::Remote { addr, key } => {
                let peer = 1 - self.side;
                if self.seg.hdr().revoked[peer].load(Ordering::Acquire) != 0 {
                    return Err(OpError::Unreachable);
                }
                let base = self.seg.layout.locks[peer] as u64;
                match addr.checked_sub(base) {
                    Some(off) if key == self.seg.key && off % 8 == 0 => {
                        self.seg.lock_word(peer, (off / 8) as usize)
                    }
                    _ => None,
                }
            }
        };
        let word = word.ok_or(OpError::RemoteAccess)?;
        Ok(
            match word.compare_exchange(expect, new, Ordering::AcqRel, Ordering::Acquire) {
                Ok(v) | Err(v) => v,
            },
        )
    }

    /// The peer's registration `key`, if it is live and covers `[addr, addr+len)`.
    fn registered(&self, key: u32, addr: u64, len: u64) -> bool {
        let Some(e) = self.seg.reg(1 - self.side, key & KEY_SLOT_MASK) else {
            return false;
        };
        if key == 0 || e.key.load(Ordering::Acquire) != u64::from(key) {
            return false;
        }
        let (a, l) = (
            e.addr.load(Ordering::Acquire),
            e.len.load(Ordering::Acquire),
        );
        let Some(end) = addr.checked_add(len) else {
            return false;
        };
        addr >= a && end <= a.saturating_add(l)
    }

    fn still_registered(&self, key: u32) -> bool {
        self.seg
            .reg(1 - self.side, key & KEY_SLOT_MASK)
            .is_some_and(|e| e.key.load(Ordering::Acquire) == u64::from(key))
    }

    /// A GET, checked as an RNIC checks an rkey, from the pinned peer.
    fn get(&self, src: RemoteBuf, dst: u64, len: u64) -> Result<(), OpError> {
        if self.no_get.is_some() {
            return Err(OpError::RemoteAccess);
        }
        let revoked = || self.seg.hdr().revoked[1 - self.side].load(Ordering::Acquire) != 0;
        if revoked() {
            return Err(OpError::Unreachable);
        }
        if !self.registered(src.key, src.addr, len) {
            return Err(OpError::RemoteAccess);
        }
        let r = read_remote(self.peer.pid(), src.addr, dst as *mut u8, len as usize);
        // The pid named the pinned process throughout only if it is still
        // alive now (until it exits, no other process can have its pid).
        if !self.peer.alive() {
            return Err(OpError::Unreachable);
        }
        match r {
            Err(nix::Error::ESRCH) => return Err(OpError::Unreachable),
            Err(_) => return Err(OpError::RemoteAccess),
            Ok(()) => {}
        }
        // A registration withdrawn, or an abort, while we read: what we
        // read may no longer be what was advertised.
        if !self.still_registered(src.key) {
            return Err(OpError::RemoteAccess);
        }
        if revoked() {
            return Err(OpError::Unreachable);
        }
        Ok(())
    }
}

impl ShmEndpoint {
    /// This side closed, or the peer corrupted the segment: no message
    /// goes out any more.
    fn cannot_post(&self) -> bool {
        self.corrupt || self.seg.hdr().closed[self.side].load(Ordering::Relaxed) != 0
    }
}

/// Registrations in the segment's table.
impl ShmEndpoint {
    /// Publish `[addr, addr+len)` in our table, for the peer's GETs (what
    /// [`Fabric::post_register`] does for [`RegAccess::PeerRead`], at once).
    pub fn register(&mut self, addr: u64, len: u64) -> Result<u32, OpError> {
        let slot = self.regs.free.pop().ok_or(OpError::Local)?;
        let g = &mut self.regs.generation[slot as usize];
        *g = g.wrapping_add(1) & (u32::MAX >> KEY_SLOT_BITS);
        if *g == 0 {
            *g = 1;
        }
        let key = (*g << KEY_SLOT_BITS) | slot;
        let e = self.seg.reg(self.side, slot).ok_or(OpError::Local)?;
        e.addr.store(addr, Ordering::Relaxed);
        e.len.store(len, Ordering::Relaxed);
        e.key.store(u64::from(key), Ordering::Release);
        Ok(key)
    }

    /// Withdraw a registration from our table.
    fn withdraw(&mut self, key: u32) {
        let slot = key & KEY_SLOT_MASK;
        if let Some(e) = self.seg.reg(self.side, slot)
            && e.key.load(Ordering::Relaxed) == u64::from(key)
            && self.regs.generation.get(slot as usize) == Some(&(key >> KEY_SLOT_BITS))
        {
            e.key.store(0, Ordering::Release);
            self.regs.free.push(slot);
        }
    }
}

impl Fabric for ShmEndpoint {
    fn ownership(&self) -> Ownership {
        let w = self.seg.hdr().owner[self.side].load(Ordering::Acquire);
        if w == crate::process::pid() {
            Ownership::Mine
        } else if w & FROZEN != 0 {
            Ownership::Unclaimed
        } else {
            Ownership::Other
        }
    }

    fn finish(&self) {
        if self.ownership() == Ownership::Mine {
            self.close();
        }
    }

    fn publish_progress(&mut self, p: Departure) {
        let hdr = self.seg.hdr();
        for (word, v) in [
            (&hdr.sent[self.side], p.sent),
            (&hdr.read[self.side], p.read),
        ] {
            if word.load(Ordering::Relaxed) != v {
                word.store(v, Ordering::Release);
            }
        }
    }

    fn freeze(&self) {
        let me = crate::process::pid();
        let _ = self.seg.hdr().owner[self.side].compare_exchange(
            me,
            me | FROZEN,
            Ordering::AcqRel,
            Ordering::Acquire,
        );
    }

    /// Take the side for this process, and tell the peer so with our kernel
    /// identity (it follows nothing else).
    fn claim(&self) -> bool {
        let me = crate::process::pid();
        let word = &self.seg.hdr().owner[self.side];
        let mut w = word.load(Ordering::Acquire);
        loop {
            if w == me {
                return true;
            }
            if w & FROZEN == 0 {
                return false;
            }
            match word.compare_exchange(w, me, Ordering::AcqRel, Ordering::Acquire) {
                Ok(was) => {
                    if was & !FROZEN != me {
                        self.send_claim();
                    }
                    return true;
                }
                Err(now) => w = now,
            }
        }
    }

    fn lock_region(&self) -> LockRegion {
        LockRegion {
            addr: self.seg.layout.locks[self.side] as u64,
            key: self.seg.key,
            slots: self.seg.slots,
        }
    }

    /// Registration completes at once: local destinations need no key
    /// (`process_vm_readv` writes our own memory), sources for the peer
    /// go in our table.
    fn post_register(
        &mut self,
        op: OpId,
        addr: u64,
        len: u64,
        access: RegAccess,
    ) -> Result<(), FabricError> {
        let r = match access {
            RegAccess::LocalWrite => Ok(LOCAL_KEY),
            RegAccess::PeerRead => self.register(addr, len),
        };
        self.completions.push_back((op, OpResult::Registered(r)));
        Ok(())
    }

    fn deregister(&mut self, key: u32) {
        if key != LOCAL_KEY {
            self.withdraw(key);
        }
    }

    fn has_room(&self, len: usize) -> bool {
        // Broken, or a full ring whose reader is gone: the post fails at once.
        self.cannot_post() || self.gone_reported || self.tx.has_room(len)
    }

    fn pool_alloc(&mut self, len: u64) -> Result<u64, OpError> {
        self.pool.alloc(len)
    }

    fn pool_fill(&mut self, addr: u64, len: u64, fill: &mut dyn FnMut(&mut [u8])) {
        if let Some(bytes) = self.pool.bytes(addr, len) {
            fill(bytes);
        }
    }

    fn pool_free(&mut self, addr: u64, _len: u64) {
        self.pool.free(addr);
    }

    fn post_message(&mut self, msg: &[u8]) -> Result<(), FabricError> {
        if self.cannot_post() {
            return Err(FabricError::Broken);
        }
        match self.tx.push(msg) {
            Ok(true) => {
                self.wake_peer(false);
                Ok(())
            }
            // A full ring whose reader is gone never drains.
            Ok(false) if self.gone_reported => Err(FabricError::Broken),
            Ok(false) => Err(FabricError::NoCredits),
            Err(ring::RingError::TooLarge(_)) => Err(FabricError::TooLarge),
            Err(_) => {
                self.corrupt = true;
                Err(FabricError::Broken)
            }
        }
    }

    fn post_get(
        &mut self,
        op: OpId,
        src: RemoteBuf,
        dst: LocalBuf,
        len: u64,
    ) -> Result<(), FabricError> {
        if self.claim_pending() {
            // The peer side moved to a process whose claim is still on its
            // way: its memory is not the one to read yet.
            self.held_gets.push_back(HeldGet {
                op,
                src,
                dst: dst.addr,
                len,
                since: Instant::now(),
            });
            return Ok(());
        }
        let result = self.get(src, dst.addr, len);
        self.completions.push_back((op, OpResult::Get(result)));
        Ok(())
    }

    fn post_cas(
        &mut self,
        op: OpId,
        target: CasTarget,
        expect: u64,
        new: u64,
    ) -> Result<(), FabricError> {
        let r = self.cas(target, expect, new);
        self.completions.push_back((op, OpResult::Cas(r)));
        Ok(())
    }

    fn revoke_access(&mut self) {
        self.seg.hdr().revoked[self.side].store(1, Ordering::Release);
    }

    fn completions_pending(&self) -> bool {
        !self.completions.is_empty()
    }

    /// Set the incoming ring's doorbell flag: the peer's next message rings
    /// our token on this process's bell.
    fn arm(&mut self, _fired: bool) -> Armed {
        self.rx.armed().store(1, Ordering::Relaxed);
        // Pairs with the fence in `wake_peer`.
        std::sync::atomic::fence(Ordering::SeqCst);
        let ready = !self.completions.is_empty()
            || !self.rx.is_empty()
            || (self.peer_closed() && !self.gone_reported);
        if ready { Armed::Ready } else { Armed::Sleep }
    }

    /// Wait until a message may be ready or `timeout` passes: busy-poll for
    /// `params.poll`, then sleep on the futex. Completions of this side's own
    /// operations are synchronous, so they never need a wait.
    fn wait(&self, timeout: Duration) {
        if !self.completions.is_empty() {
            return;
        }
        let ticket = self.rx.wait_words().0.load(Ordering::Acquire);
        wait_ring(
            &self.rx.watch(),
            &self.seg,
            1 - self.side,
            self.params.poll,
            timeout,
            ticket,
        );
    }

    fn poll(&mut self, on_event: &mut dyn FnMut(FabricEvent<'_>)) -> usize {
        if !self.held_gets.is_empty() {
            self.release_held_gets();
        }
        let mut n = 0;
        while let Some((op, result)) = self.completions.pop_front() {
            on_event(FabricEvent::Done { op, result });
            n += 1;
        }
        while !self.corrupt {
            match self.rx.pop(|m| on_event(FabricEvent::Message(m))) {
                Ok(Some(())) => n += 1,
                Ok(None) => break,
                Err(_) => self.corrupt = true,
            }
        }
        if self.gone_reported {
            return n;
        }
        if self.corrupt {
            // Whatever the peer claims to have sent, the stream is broken.
            self.gone_reported = true;
            on_event(FabricEvent::PeerGone { left: None });
            return n + 1;
        }
        if n == 0 && !self.peer_alive() && self.rx.is_empty() {
            self.gone_reported = true;
            let hdr = self.seg.hdr();
            let left = Departure {
                sent: hdr.sent[1 - self.side].load(Ordering::Acquire),
                read: hdr.read[1 - self.side].load(Ordering::Acquire),
            };
            on_event(FabricEvent::PeerGone { left: Some(left) });
            n += 1;
        }
        n
    }
}

impl super::Watched for ShmEndpoint {
    fn set_bell(&mut self, token: u64, _bell: BorrowedFd<'_>) {
        self.seg.hdr().bell[self.side].store(token, Ordering::Release);
    }

    fn peer_exit_fd(&self) -> Option<Arc<OwnedFd>> {
        Some(self.peer.pidfd_shared())
    }

    /// A claim: the peer side runs in the sender's process now. Only a
    /// claimer of the peer's user whose pid the segment's owner word names
    /// is followed (so one that maps the segment: the peer or a process it
    /// forked; any peer of ours can ring our bell), with the bell it passed.
    fn take_mail(&mut self, mail: Mail) {
        let Ok(intro) = Intro::parse(&mail.body) else {
            return;
        };
        let owner = self.seg.hdr().owner[1 - self.side].load(Ordering::Acquire) & !FROZEN;
        if intro.kind != IntroKind::Claim
            || mail.from.peer.uid() != self.peer.uid()
            || mail.from.peer.pid() != owner
        {
            return;
        }
        let Some(bell) = mail.from.fds.into_iter().next() else {
            return;
        };
        self.peer = mail.from.peer;
        self.peer_bell = shared_bell(&self.peer, bell);
        self.no_get = get_permission(&self.peer);
        self.alive_at = None;
    }

    fn peer_suspect(&mut self) {
        self.alive_at = None;
    }
}

/// What a hostile peer can do to a segment it maps: write any word of it.
/// The adversarial tests (`tests/hostile`) play such a peer with this
/// crate; none of this lets a process do more than it could by writing
/// memory it already maps.
#[doc(hidden)]
pub mod adversary {
    use super::*;

    /// Which side of the segment `ep` runs.
    pub fn side(ep: &ShmEndpoint) -> usize {
        ep.side
    }

    /// Write `side`'s owner word.
    pub fn set_owner(ep: &ShmEndpoint, side: usize, word: u32) {
        ep.seg.hdr().owner[side & 1].store(word, Ordering::Release);
    }

    /// Write registration `slot` of `side` as its owner would.
    pub fn write_registration(
        ep: &ShmEndpoint,
        side: usize,
        slot: u32,
        key: u32,
        addr: u64,
        len: u64,
    ) {
        if let Some(e) = ep.seg.reg(side & 1, slot) {
            e.addr.store(addr, Ordering::Relaxed);
            e.len.store(len, Ordering::Relaxed);
            e.key.store(u64::from(key), Ordering::Release);
        }
    }

    /// Put nonsense in the producer position of the ring for `dir`.
    pub fn corrupt_ring(ep: &ShmEndpoint, dir: usize) {
        let at = ep.seg.layout.ring[dir & 1] + 64;
        // SAFETY: the ring header's producer word: inside the mapping,
        // 8-aligned, and only ever accessed atomically.
        let w = unsafe { &*ep.seg.base().add(at).cast::<AtomicU64>() };
        w.store(1 << 40, Ordering::Release);
    }

    /// Overwrite the segment header's magic and sizes.
    pub fn corrupt_header(ep: &ShmEndpoint) {
        let h = ep.seg.hdr();
        h.magic.store(0, Ordering::Relaxed);
        h.ring_cap.store(u32::MAX, Ordering::Relaxed);
        h.lock_slots.store(u32::MAX, Ordering::Relaxed);
    }

    /// The key a registration in `slot` has at `generation`.
    pub fn key(slot: u32, generation: u32) -> u32 {
        (generation << KEY_SLOT_BITS) | (slot & KEY_SLOT_MASK)
    }
}

/// Busy-poll `rx` for `poll`, then sleep on its futex until a message is
/// published or a kick made after `ticket`, the peer closes, or `timeout`
/// passes.
fn wait_ring(
    rx: &RingWatch,
    seg: &Segment,
    peer: usize,
    poll: Duration,
    timeout: Duration,
    ticket: u32,
) {
    let (published, sleeping) = rx.wait_words();
    let quiet = || rx.is_empty() && published.load(Ordering::Acquire) == ticket;
    if !quiet() {
        return;
    }
    let start = Instant::now();
    let spin = if spinning_pays() {
        poll.min(timeout)
    } else {
        Duration::ZERO
    };
    'spin: while !spin.is_zero() {
        // Reading the clock costs more than a look at the ring.
        for _ in 0..64 {
            if !quiet() {
                return;
            }
            std::hint::spin_loop();
        }
        if start.elapsed() >= spin {
            break 'spin;
        }
    }
    // A count, not a flag: several threads of this process may sleep here.
    sleeping.fetch_add(1, Ordering::SeqCst);
    if quiet() && !seg.peer_closed_news(peer) {
        crate::futex::wait(published, ticket, timeout.saturating_sub(start.elapsed()));
    }
    sleeping.fetch_sub(1, Ordering::SeqCst);
}

/// Does busy-polling before a sleep pay now? Not when more threads are
/// runnable than there are CPUs: a spinner then takes the CPU the thread it
/// waits for needs (four clients and a server ping-ponging on two cores
/// waited 3x longer than on TCP). Looked up in `/proc/loadavg` at most
/// every few milliseconds, process-wide.
fn spinning_pays() -> bool {
    use std::sync::atomic::{AtomicBool, AtomicU64};
    static CHECKED_AT: AtomicU64 = AtomicU64::new(0);
    static PAYS: AtomicBool = AtomicBool::new(true);
    const EVERY_NS: u64 = 5_000_000;
    let now = crate::driver::standby::now_ns().max(1);
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

/// Waits for messages to one endpoint without borrowing it, for a progress
/// thread while other threads use the endpoint.
#[derive(Debug)]
pub struct ShmWaiter {
    // Declared before `seg`, whose mapping it points into.
    rx: RingWatch,
    seg: Arc<Segment>,
    peer: usize,
    poll: Duration,
}

impl super::FabricWaiter for ShmWaiter {
    fn prepare(&self) -> u32 {
        self.rx.wait_words().0.load(Ordering::Acquire)
    }

    fn wait(&self, ticket: u32, timeout: Duration, spin: bool) {
        let poll = if spin { self.poll } else { Duration::ZERO };
        wait_ring(&self.rx, &self.seg, self.peer, poll, timeout, ticket);
    }

    fn sleep(&self, ticket: u32, timeout: Duration) {
        let (published, sleeping) = self.rx.wait_words();
        sleeping.fetch_add(1, Ordering::SeqCst);
        if published.load(Ordering::Acquire) == ticket && !self.seg.peer_closed_news(self.peer) {
            crate::futex::wait(published, ticket, timeout);
        }
        sleeping.fetch_sub(1, Ordering::SeqCst);
    }

    /// Bump the incoming ring's futex word (it only counts wake-ups: the
    /// peer adds one per message, we add one per kick) and wake its
    /// sleepers, who are all of this process.
    fn kick(&self) {
        let (published, sleeping) = self.rx.wait_words();
        published.fetch_add(1, Ordering::Release);
        if sleeping.load(Ordering::SeqCst) != 0 {
            crate::futex::wake_all(published);
        }
    }
}

#[cfg(test)]
mod tests;
