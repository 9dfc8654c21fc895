//! The `shm` fabric: two processes on one host.
//!
//! A `memfd` segment, mapped by both, holds a [`Ring`] per direction for
//! messages, each side's lock words (so the peer's compare-and-swap is a real
//! atomic on shared memory, one-sided as on a NIC), and per-side flags. GET is
//! one `process_vm_readv` from the peer's pages straight into the destination
//! (the intra-host RDMA READ: one copy, no peer involvement). A side that
//! waits polls for a while, then sleeps on a futex in the segment.
//!
//! Bootstrap ([`ShmEndpoint::offer`] / [`ShmEndpoint::accept`]) runs over a
//! connected Unix or TCP socket: over Unix the creator passes the memfd with
//! SCM_RIGHTS; over TCP the acceptor takes it from the creator with
//! `pidfd_getfd` (which needs the permission reading its memory needs) and
//! checks the segment's random key, so a peer lying about its pid gets
//! nowhere. Both exchange pid, uid and page size, and each probes whether it
//! may read the other's memory. If it may not (another user, no ptrace permission), the
//! connection stays on the rings (BSDP) and [`ShmEndpoint::can_get`] says why.
//!
//! Keys are not enforced here: `process_vm_readv` can read any of the peer's
//! memory that the kernel lets it, so this provider is for processes that
//! trust each other; the `azsdpd` broker will check ranges for those that
//! do not.
//!
//! `unsafe` here: mapping the segment, atomics and futexes on shared memory,
//! and the raw destination of GETs (application memory named by address).

use std::collections::VecDeque;
use std::io::{IoSlice, IoSliceMut};
use std::os::fd::{AsFd, AsRawFd, OwnedFd};
use std::os::unix::net::UnixStream;
use std::sync::Arc;
use std::sync::atomic::{AtomicU32, AtomicU64, Ordering};
use std::time::{Duration, Instant};

use memmap2::MmapMut;
use nix::sys::socket::{ControlMessage, ControlMessageOwned, MsgFlags, recvmsg, sendmsg};
use nix::sys::uio::{RemoteIoVec, process_vm_readv};
use nix::unistd::Pid;

use super::ring::{self, Ring, RingWatch};
use super::{Fabric, FabricError, FabricEvent, OpResult, Ownership};
use crate::conn::{CasTarget, LockRegion, OpError, OpId, RemoteBuf};

const MAGIC: u64 = 0x617a_7364_7073_686d; // "azsdpshm"
const VERSION: u32 = 1;
const HEADER_LEN: usize = 4096;

/// Segment header, at offset 0.
#[repr(C, align(64))]
struct SegHeader {
    magic: AtomicU64,
    version: AtomicU32,
    ring_cap: AtomicU32,
    lock_slots: AtomicU32,
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
    /// Per side: the pid of the process running that side, with
    /// [`FROZEN`] set from a fork until a process claims it.
    owner: [AtomicU32; 2],
    /// Free for whoever set the pair up to agree on it (the preload shim's
    /// commit-or-withdraw word, see [`ShmEndpoint::agreement`]).
    agreement: AtomicU32,
}

const _: () = assert!(std::mem::size_of::<SegHeader>() <= HEADER_LEN);

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

/// Layout of the segment: where each part starts.
#[derive(Clone, Copy, Debug)]
struct Layout {
    ring: [usize; 2],
    ring_len: usize,
    locks: [usize; 2],
    len: usize,
}

impl Layout {
    fn new(ring_cap: usize, slots: u16) -> Layout {
        let ring_len = ring::region_len(ring_cap).next_multiple_of(64);
        let r0 = HEADER_LEN;
        let r1 = r0 + ring_len;
        let l0 = r1 + ring_len;
        let locks_len = (usize::from(slots) * 8).next_multiple_of(64);
        let l1 = l0 + locks_len;
        Layout {
            ring: [r0, r1],
            ring_len,
            locks: [l0, l1],
            len: (l1 + locks_len).next_multiple_of(4096),
        }
    }
}

/// A mapped segment.
#[derive(Debug)]
struct Segment {
    map: MmapMut,
    layout: Layout,
    slots: u16,
    key: u32,
    fd: OwnedFd,
}

impl Segment {
    fn hdr(&self) -> &SegHeader {
        // SAFETY: the mapping is at least HEADER_LEN bytes, page-aligned, and
        // lives as long as self; SegHeader is all atomics (any bit pattern
        // that the creator wrote, or zero, is valid).
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

    fn ring(&self, dir: usize) -> Ring {
        // SAFETY: the ring region lies inside the mapping, is 64-aligned, and
        // the mapping outlives the Ring (the endpoint holds both; Ring is
        // dropped first as a field declared earlier). One producer and one
        // consumer per direction by construction of the endpoints.
        unsafe { Ring::attach(self.base().add(self.layout.ring[dir]), self.layout.ring_len) }
            .expect("initialised ring")
    }

    fn create(p: &ShmParams) -> std::io::Result<Segment> {
        let layout = Layout::new(p.ring_capacity, p.lock_slots);
        let fd =
            nix::sys::memfd::memfd_create(c"azsdp-shm", nix::sys::memfd::MFdFlags::MFD_CLOEXEC)?;
        let file = std::fs::File::from(fd.try_clone()?);
        file.set_len(layout.len as u64)?;
        // SAFETY: a fresh memfd of the right length, mapped shared; nobody
        // else has it yet.
        let mut map = unsafe { MmapMut::map_mut(&file)? };
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
            key,
            fd,
        };
        let h = seg.hdr();
        h.version.store(VERSION, Ordering::Relaxed);
        h.ring_cap.store(p.ring_capacity as u32, Ordering::Relaxed);
        h.lock_slots
            .store(u32::from(p.lock_slots), Ordering::Relaxed);
        h.key.store(key, Ordering::Relaxed);
        h.magic.store(MAGIC, Ordering::Release);
        Ok(seg)
    }

    fn open(fd: OwnedFd) -> std::io::Result<Segment> {
        let bad = |what: &str| {
            std::io::Error::new(
                std::io::ErrorKind::InvalidData,
                format!("shm segment: {what}"),
            )
        };
        let file = std::fs::File::from(fd.try_clone()?);
        let len = file.metadata()?.len() as usize;
        if len < HEADER_LEN {
            return Err(bad("too short"));
        }
        // SAFETY: mapping a memfd the peer passed us; we only access it
        // through atomics and rings that validate every length they read.
        let map = unsafe { MmapMut::map_mut(&file)? };
        // SAFETY: HEADER_LEN bytes are mapped (checked above).
        let h = unsafe { &*map.as_ptr().cast::<SegHeader>() };
        if h.magic.load(Ordering::Acquire) != MAGIC || h.version.load(Ordering::Relaxed) != VERSION
        {
            return Err(bad("bad magic or version"));
        }
        let cap = h.ring_cap.load(Ordering::Relaxed) as usize;
        let slots =
            u16::try_from(h.lock_slots.load(Ordering::Relaxed)).map_err(|_| bad("lock slots"))?;
        if !cap.is_power_of_two() || cap < 64 {
            return Err(bad("ring capacity"));
        }
        let layout = Layout::new(cap, slots);
        if layout.len > len {
            return Err(bad("shorter than its layout"));
        }
        let key = h.key.load(Ordering::Relaxed);
        Ok(Segment {
            map,
            layout,
            slots,
            key,
            fd,
        })
    }
}

/// What each side tells the other at bootstrap.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default)]
struct Intro {
    magic: u64,
    pid: u32,
    uid: u32,
    page_size: u32,
    /// The creator's descriptor number of the segment (for a peer that
    /// takes it with `pidfd_getfd`, over TCP); 0 from the acceptor.
    seg_fd: u32,
    /// Address of a word in the sender's memory holding `canary`.
    probe_addr: u64,
    canary: u64,
    /// The segment's key, which the acceptor checks in the segment it got
    /// (a peer lying about its pid would name a process without it).
    seg_key: u32,
}

/// Bytes of an [`Intro`] on the wire.
const INTRO_LEN: usize = 48;

impl Intro {
    fn bytes(&self) -> [u8; INTRO_LEN] {
        let mut b = [0u8; INTRO_LEN];
        b[0..8].copy_from_slice(&self.magic.to_le_bytes());
        b[8..12].copy_from_slice(&self.pid.to_le_bytes());
        b[12..16].copy_from_slice(&self.uid.to_le_bytes());
        b[16..20].copy_from_slice(&self.page_size.to_le_bytes());
        b[20..24].copy_from_slice(&self.seg_fd.to_le_bytes());
        b[24..32].copy_from_slice(&self.probe_addr.to_le_bytes());
        b[32..40].copy_from_slice(&self.canary.to_le_bytes());
        b[40..44].copy_from_slice(&self.seg_key.to_le_bytes());
        b
    }

    fn parse(b: &[u8]) -> Option<Intro> {
        if b.len() != INTRO_LEN || b[44..48] != [0; 4] {
            return None;
        }
        let u64_at = |i: usize| u64::from_le_bytes(b[i..i + 8].try_into().expect("8 bytes"));
        let u32_at = |i: usize| u32::from_le_bytes(b[i..i + 4].try_into().expect("4 bytes"));
        let intro = Intro {
            magic: u64_at(0),
            pid: u32_at(8),
            uid: u32_at(12),
            page_size: u32_at(16),
            seg_fd: u32_at(20),
            probe_addr: u64_at(24),
            canary: u64_at(32),
            seg_key: u32_at(40),
        };
        (intro.magic == MAGIC && intro.pid != 0).then_some(intro)
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

/// One side of a `shm` connection.
#[derive(Debug)]
pub struct ShmEndpoint {
    // Rings borrow the mapping in `seg`: declared first, dropped first.
    tx: Ring,
    rx: Ring,
    seg: Arc<Segment>,
    side: usize,
    peer_pid: Pid,
    peer_page_size: u32,
    no_get: Option<NoGet>,
    params: ShmParams,
    completions: VecDeque<(OpId, OpResult)>,
    next_key: u32,
    gone_reported: bool,
    /// Readable once the peer process has exited (zombie or reaped).
    peer_fd: Option<OwnedFd>,
    /// When the peer process was last seen alive: an idle poll asks the
    /// kernel (a system call) at most once per [`ALIVE_EVERY`].
    alive_at: Option<Instant>,
}

/// How often an idle endpoint asks whether the peer process still exists
/// (a peer that closes says so in the segment at once; this is for one
/// that dies without closing).
const ALIVE_EVERY: Duration = Duration::from_millis(1);

fn io_err(e: impl std::fmt::Display) -> std::io::Error {
    std::io::Error::other(e.to_string())
}

/// A connected stream socket the bootstrap runs over: Unix (the segment
/// travels with SCM_RIGHTS) or TCP (the peer takes it with `pidfd_getfd`).
pub trait BootstrapSocket: AsFd {}
impl BootstrapSocket for UnixStream {}
impl BootstrapSocket for std::net::TcpStream {}

fn is_unix(sock: &impl AsFd) -> bool {
    nix::sys::socket::getsockname::<nix::sys::socket::UnixAddr>(sock.as_fd().as_raw_fd()).is_ok()
}

fn write_all(sock: &impl AsFd, mut b: &[u8]) -> std::io::Result<()> {
    while !b.is_empty() {
        let n = nix::unistd::write(sock.as_fd(), b).map_err(io_err)?;
        if n == 0 {
            return Err(io_err("the bootstrap socket closed"));
        }
        b = &b[n..];
    }
    Ok(())
}

fn read_exact(sock: &impl AsFd, mut b: &mut [u8]) -> std::io::Result<()> {
    while !b.is_empty() {
        let n = nix::unistd::read(sock.as_fd(), b).map_err(io_err)?;
        if n == 0 {
            return Err(io_err("the bootstrap socket closed"));
        }
        b = &mut b[n..];
    }
    Ok(())
}

fn send_intro(sock: &impl AsFd, intro: &Intro, fd: Option<&OwnedFd>) -> std::io::Result<()> {
    let bytes = intro.bytes();
    if !is_unix(sock) {
        return write_all(sock, &bytes);
    }
    let iov = [IoSlice::new(&bytes)];
    let fds = fd.map(|f| [f.as_raw_fd()]);
    let cmsgs: Vec<ControlMessage<'_>> = fds
        .as_ref()
        .map(|f| ControlMessage::ScmRights(f))
        .into_iter()
        .collect();
    let n = sendmsg::<()>(
        sock.as_fd().as_raw_fd(),
        &iov,
        &cmsgs,
        MsgFlags::MSG_NOSIGNAL,
        None,
    )
    .map_err(io_err)?;
    write_all(sock, &bytes[n..])
}

fn recv_intro(sock: &impl AsFd) -> std::io::Result<(Intro, Option<OwnedFd>)> {
    let mut bytes = [0u8; INTRO_LEN];
    let mut fd = None;
    let mut n = 0;
    if is_unix(sock) {
        let mut iov = [IoSliceMut::new(&mut bytes)];
        let mut space = nix::cmsg_space!([std::os::fd::RawFd; 1]);
        let msg = recvmsg::<()>(
            sock.as_fd().as_raw_fd(),
            &mut iov,
            Some(&mut space),
            MsgFlags::MSG_CMSG_CLOEXEC,
        )
        .map_err(io_err)?;
        for c in msg.cmsgs().map_err(io_err)? {
            if let ControlMessageOwned::ScmRights(fds) = c {
                for raw in fds {
                    // SAFETY: the kernel just installed this descriptor for us.
                    let owned = unsafe { <OwnedFd as std::os::fd::FromRawFd>::from_raw_fd(raw) };
                    fd.get_or_insert(owned);
                }
            }
        }
        n = msg.bytes;
        if n == 0 {
            return Err(io_err("the bootstrap socket closed"));
        }
    }
    read_exact(sock, &mut bytes[n..])?;
    let intro = Intro::parse(&bytes).ok_or_else(|| io_err("malformed shm introduction"))?;
    Ok((intro, fd))
}

/// Both sides say they are done probing; then the canaries may go.
fn handshake_done(sock: &impl AsFd) -> std::io::Result<()> {
    write_all(sock, &[1])?;
    let mut b = [0u8; 1];
    read_exact(sock, &mut b)?;
    if b[0] != 1 {
        return Err(io_err("malformed shm handshake"));
    }
    Ok(())
}

/// Take descriptor `fd` of process `pid` (TCP bootstrap: needs the same
/// permission as reading its memory).
fn take_peer_fd(pid: u32, fd: u32) -> std::io::Result<OwnedFd> {
    let pidfd = pidfd_open(Pid::from_raw(pid as i32))
        .ok_or_else(|| io_err("pidfd_open of the peer failed"))?;
    // SAFETY: plain syscall with integer arguments.
    let got = unsafe { libc::syscall(libc::SYS_pidfd_getfd, pidfd.as_raw_fd(), fd as i32, 0) };
    if got < 0 {
        return Err(io_err(format!(
            "cannot take the peer's shm segment (pidfd_getfd: {}); over TCP that needs \
             permission to trace the peer",
            std::io::Error::last_os_error()
        )));
    }
    // SAFETY: the kernel just installed this descriptor for us.
    Ok(unsafe { <OwnedFd as std::os::fd::FromRawFd>::from_raw_fd(got as i32) })
}

fn page_size() -> u32 {
    crate::pages::system_page_size() as u32
}

/// Read `len` bytes at `src` in process `pid` into `dst`, all or nothing.
fn read_remote(pid: Pid, src: u64, dst: *mut u8, len: usize) -> Result<(), nix::Error> {
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
    /// Bootstrap as the creator of the segment (side 0).
    pub fn offer(sock: &impl BootstrapSocket, params: ShmParams) -> std::io::Result<ShmEndpoint> {
        let seg = Segment::create(&params)?;
        let canary = Box::new(seg.key as u64 ^ 0x5a5a_5a5a_0000_0000);
        let mut mine = Self::intro(&canary);
        mine.seg_fd = seg.fd.as_raw_fd() as u32;
        mine.seg_key = seg.key;
        send_intro(sock, &mine, Some(&seg.fd))?;
        let (peer, _) = recv_intro(sock)?;
        Self::finish(sock, seg, 0, &mine, &peer, params)
    }

    /// Bootstrap as the side that maps the peer's segment (side 1).
    pub fn accept(sock: &impl BootstrapSocket, params: ShmParams) -> std::io::Result<ShmEndpoint> {
        let (peer, fd) = recv_intro(sock)?;
        let fd = match fd {
            Some(fd) => fd,
            None if !is_unix(sock) => take_peer_fd(peer.pid, peer.seg_fd)?,
            None => return Err(io_err("the peer sent no shm segment")),
        };
        let seg = Segment::open(fd)?;
        if seg.key != peer.seg_key {
            return Err(io_err(
                "the shm segment is not the one the peer announced (wrong pid or descriptor)",
            ));
        }
        let canary = Box::new(seg.key as u64 ^ 0xa5a5_a5a5_0000_0000);
        let mine = Self::intro(&canary);
        send_intro(sock, &mine, None)?;
        let params = ShmParams {
            ring_capacity: seg.layout.ring_len - ring::HEADER,
            lock_slots: seg.slots,
            ..params
        };
        Self::finish(sock, seg, 1, &mine, &peer, params)
    }

    fn intro(canary: &u64) -> Intro {
        Intro {
            magic: MAGIC,
            pid: std::process::id(),
            uid: nix::unistd::getuid().as_raw(),
            page_size: page_size(),
            seg_fd: 0,
            probe_addr: std::ptr::from_ref(canary) as u64,
            canary: *canary,
            seg_key: 0,
        }
    }

    fn finish(
        sock: &impl AsFd,
        seg: Segment,
        side: usize,
        mine: &Intro,
        peer: &Intro,
        params: ShmParams,
    ) -> std::io::Result<ShmEndpoint> {
        let peer_pid = Pid::from_raw(peer.pid as i32);
        // May we read the peer's memory? Try it on the word it told us about.
        // (Its canary lives until it has read ours and answered, which
        // happens after this probe in both bootstrap orders.)
        let no_get = if mine.uid != peer.uid {
            Some(NoGet::OtherUser {
                mine: mine.uid,
                peer: peer.uid,
            })
        } else {
            let mut got = 0u64;
            match read_remote(
                peer_pid,
                peer.probe_addr,
                std::ptr::from_mut(&mut got).cast(),
                8,
            ) {
                Ok(()) if got == peer.canary => None,
                Ok(()) => Some(NoGet::Refused("probe read the wrong value".into())),
                Err(e) => Some(NoGet::Refused(e.desc().to_string())),
            }
        };
        seg.hdr().owner[side].store(crate::process::pid(), Ordering::Release);
        // Keep our canary alive until the peer has probed it too.
        handshake_done(sock)?;
        let seg = Arc::new(seg);
        Ok(ShmEndpoint {
            tx: seg.ring(side),
            rx: seg.ring(1 - side),
            side,
            peer_pid,
            peer_page_size: peer.page_size,
            no_get,
            params,
            completions: VecDeque::new(),
            next_key: 0x1000 * (side as u32 + 1),
            gone_reported: false,
            alive_at: None,
            peer_fd: pidfd_open(peer_pid),
            seg,
        })
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

    pub fn peer_pid(&self) -> i32 {
        self.peer_pid.as_raw()
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

    fn wake_peer(&self, force: bool) {
        let (published, sleeping) = self.tx.wait_words();
        if force || sleeping.load(Ordering::Acquire) != 0 {
            crate::futex::wake_all(published);
        }
    }

    fn peer_closed(&self) -> bool {
        self.seg.hdr().closed[1 - self.side].load(Ordering::Acquire) != 0
    }

    /// Follow the peer side to the process that runs it now (a forked
    /// child may have claimed it): its memory is where GETs read.
    fn follow_peer(&mut self) {
        let w = self.seg.hdr().owner[1 - self.side].load(Ordering::Acquire) & !FROZEN;
        if w != 0 && w as i32 != self.peer_pid.as_raw() {
            self.peer_pid = Pid::from_raw(w as i32);
            self.peer_fd = pidfd_open(self.peer_pid);
        }
    }

    fn peer_alive(&mut self) -> bool {
        if self.peer_closed() {
            return false;
        }
        let now = Instant::now();
        if self.alive_at.is_some_and(|t| now < t + ALIVE_EVERY) {
            return true;
        }
        self.follow_peer();
        let alive = match &self.peer_fd {
            Some(fd) => !pidfd_exited(fd),
            // Without pidfd: a zombie still answers kill(0); the peer
            // timeout catches that case.
            None => nix::sys::signal::kill(self.peer_pid, None).is_ok(),
        };
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

    fn publish_sent(&mut self, returned: u64) {
        let word = &self.seg.hdr().sent[self.side];
        if word.load(Ordering::Relaxed) != returned {
            word.store(returned, Ordering::Release);
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
                Ok(_) => return true,
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

    /// Keys are handed out but not enforced (see the module docs).
    fn register(&mut self, _addr: u64, _len: u64) -> Result<u32, OpError> {
        self.next_key = self.next_key.wrapping_add(1);
        Ok(self.next_key)
    }

    fn deregister(&mut self, _key: u32) {}

    fn send_credits(&self) -> usize {
        // Messages of the largest size that surely fit now.
        (self.tx.capacity() - self.tx.used()) / (self.tx.max_message() + 16)
    }

    fn post_message(&mut self, msg: &[u8]) -> Result<(), FabricError> {
        if self.seg.hdr().closed[self.side].load(Ordering::Relaxed) != 0 {
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
            Err(_) => Err(FabricError::TooLarge),
        }
    }

    fn post_get(
        &mut self,
        op: OpId,
        src: RemoteBuf,
        dst: u64,
        len: u64,
        staged: bool,
    ) -> Result<(), FabricError> {
        if staged {
            // Armed destinations need the protection layer's staging and
            // UFFDIO_MOVE; without it, receive-side protection is off.
            return Err(FabricError::Unsupported);
        }
        let peer = 1 - self.side;
        self.follow_peer();
        let result = if self.no_get.is_some() {
            Err(OpError::RemoteAccess)
        } else {
            match read_remote(self.peer_pid, src.addr, dst as *mut u8, len as usize) {
                // A GET that overlapped the peer's abort read pages it may
                // have rewritten after unprotecting: void.
                Ok(()) if self.seg.hdr().revoked[peer].load(Ordering::Acquire) != 0 => {
                    Err(OpError::Unreachable)
                }
                Ok(()) => Ok(()),
                Err(nix::Error::ESRCH) => Err(OpError::Unreachable),
                Err(_) => Err(OpError::RemoteAccess),
            }
        };
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
        let mut n = 0;
        while let Some((op, result)) = self.completions.pop_front() {
            on_event(FabricEvent::Done { op, result });
            n += 1;
        }
        while self.rx.pop(|m| on_event(FabricEvent::Message(m))).is_some() {
            n += 1;
        }
        if n == 0 && !self.gone_reported && !self.peer_alive() && self.rx.is_empty() {
            self.gone_reported = true;
            let sent = self.seg.hdr().sent[1 - self.side].load(Ordering::Acquire);
            on_event(FabricEvent::PeerGone { sent: Some(sent) });
            n += 1;
        }
        n
    }
}

/// A pidfd for `pid`, if the kernel has them (Linux 5.3+).
fn pidfd_open(pid: Pid) -> Option<OwnedFd> {
    // SAFETY: plain syscall with integer arguments.
    let fd = unsafe { libc::syscall(libc::SYS_pidfd_open, pid.as_raw(), 0) };
    // SAFETY: on success the kernel returned a new descriptor that we own.
    (fd >= 0).then(|| unsafe { <OwnedFd as std::os::fd::FromRawFd>::from_raw_fd(fd as i32) })
}

/// Has the process behind `fd` exited? (A pidfd polls readable then.)
fn pidfd_exited(fd: &OwnedFd) -> bool {
    let mut p = libc::pollfd {
        fd: fd.as_raw_fd(),
        events: libc::POLLIN,
        revents: 0,
    };
    // SAFETY: one valid pollfd, zero timeout.
    let n = unsafe { libc::poll(&mut p, 1, 0) };
    n > 0 && p.revents & libc::POLLIN != 0
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
    if quiet() && seg.hdr().closed[peer].load(Ordering::Acquire) == 0 {
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
        if published.load(Ordering::Acquire) == ticket
            && self.seg.hdr().closed[self.peer].load(Ordering::Acquire) == 0
        {
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
