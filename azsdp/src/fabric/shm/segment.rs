//! The segment both sides map: its header, layout and checks (sizes are
//! read once, checked, and kept: the peer can write every word).

use std::os::fd::{AsFd, OwnedFd};
use std::sync::atomic::{AtomicBool, AtomicU32, AtomicU64, Ordering};
use std::time::Duration;

use memmap2::{MmapMut, MmapOptions};

use crate::fabric::ring::{self, Ring};

const MAGIC: u64 = 0x617a_7364_7073_686d; // "azsdpshm"
const VERSION: u32 = 7;
const HEADER_LEN: usize = 4096;
/// Largest ring a segment may have (a peer's segment asking for more is
/// refused rather than mapped).
pub const MAX_RING: usize = 64 << 20;
const MAX_LOCK_SLOTS: u32 = 4096;
const MAX_REG_SLOTS: u32 = 1 << KEY_SLOT_BITS;

/// A registration key: the table slot in the low bits, a generation above
/// (never 0, so no key is 0 and a reused slot never revives an old key).
pub(super) const KEY_SLOT_BITS: u32 = 14;
pub(super) const KEY_SLOT_MASK: u32 = (1 << KEY_SLOT_BITS) - 1;
/// The key of every local GET destination: `process_vm_readv` writes our
/// own memory, so they need none (no table key is 0: generations start at 1).
pub(super) const LOCAL_KEY: u32 = 0;

/// Segment header, at offset 0.
#[repr(C, align(64))]
pub(super) struct SegHeader {
    pub(super) magic: AtomicU64,
    pub(super) version: AtomicU32,
    pub(super) ring_cap: AtomicU32,
    pub(super) lock_slots: AtomicU32,
    pub(super) reg_slots: AtomicU32,
    /// Random identity, used as the lock words' key.
    pub(super) key: AtomicU32,
    /// Per side: set before that side unprotects anything on abort; a GET
    /// from that side's memory that sees it afterwards is void.
    pub(super) revoked: [AtomicU32; 2],
    /// Per side: the side closed its end cleanly.
    pub(super) closed: [AtomicU32; 2],
    /// Per side: how much of its stream that side's `send()` calls have
    /// returned (the survivor of a death compares it with what it got).
    pub(super) sent: [AtomicU64; 2],
    /// Per side: how much of the other side's stream that side's `recv()`
    /// calls have returned (the survivor compares it with what it sent).
    pub(super) read: [AtomicU64; 2],
    /// Per side: the pid of the process running that side, with
    /// [`FROZEN`] set from a fork until a process claims it. Each side
    /// reads its own to know whether it runs the connection; the peer's
    /// is only a hint that a claim is on its way to our bell.
    pub(super) owner: [AtomicU32; 2],
    /// Free for whoever set the pair up to agree on it (the preload shim's
    /// commit-or-withdraw word, see [`ShmEndpoint::agreement`]).
    pub(super) agreement: AtomicU32,
    /// Per side: the token that side's reactor answers to on its process's
    /// bell (0: none yet). The peer rings it; a false one only makes some
    /// connection of ours look for nothing.
    pub(super) bell: [AtomicU64; 2],
    /// Per side: the loop bell of that side's process to ring instead of
    /// the process's bell (0: the process's), while the loop its
    /// connection belongs to sleeps (see `loop_bell`). The peer rings it
    /// only if that process gave it that bell.
    pub(super) route: [AtomicU32; 2],
    /// Per side: a process sharing that side after a fork asks the one
    /// running it to move the connection onto TCP. (The peer could write
    /// it too: that only moves the connection onto TCP.)
    pub(super) leave: [AtomicU32; 2],
    /// Per side: the side moved onto TCP.
    pub(super) left: [AtomicU32; 2],
    /// Per side: the pid of a process that shares that side after a fork
    /// and does not run it (its calls go through the runner): if the
    /// runner dies, the peer moves the stream onto TCP for it. (The peer
    /// could write it too: that only makes a death move the stream onto
    /// TCP instead of ending it.)
    pub(super) heir: [AtomicU32; 2],
}

const _: () = assert!(std::mem::size_of::<SegHeader>() <= HEADER_LEN);

/// One registration, written by its owner, checked by the peer's GETs.
#[repr(C, align(32))]
pub(super) struct RegEntry {
    /// The live key, or 0 when the slot is free. Stored last (release)
    /// when registering, first when withdrawing.
    pub(super) key: AtomicU64,
    pub(super) addr: AtomicU64,
    pub(super) len: AtomicU64,
}

const REG_ENTRY_LEN: usize = std::mem::size_of::<RegEntry>();
const _: () = assert!(REG_ENTRY_LEN == 32);

/// In an owner word: frozen since a fork. The word is the pid of the
/// process that runs the side (pids stay below 2^22: [`PID_MASK`]) and,
/// while frozen, which freeze this is ([`FORK_GEN`]): only the copies that
/// fork made (the process that froze it, its child) may claim it; a copy
/// from an earlier fork whose connection was claimed and frozen again by a
/// later one is not the runner's any more.
pub(super) const FROZEN: u32 = 1 << 31;
/// The pid part of an owner word.
pub(super) const PID_MASK: u32 = (1 << 22) - 1;
/// The freeze's generation in an owner word (9 bits, wrapping).
pub(super) const FORK_GEN: u32 = !(FROZEN | PID_MASK);
/// One step of [`FORK_GEN`].
pub(super) const FORK_GEN_ONE: u32 = 1 << 22;

/// Sizes of a segment.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct ShmParams {
    /// Bytes of each direction's ring (a power of two).
    pub ring_capacity: usize,
    /// Lock words per side.
    pub lock_slots: u16,
    /// Busy-poll before sleeping.
    pub poll: Duration,
    /// Keep a descriptor of the segment so that this side can follow an
    /// exec (see `park`): only for a connection whose socket may survive
    /// one, so that others hold no descriptor of their own.
    pub keep_for_exec: bool,
}

impl Default for ShmParams {
    fn default() -> Self {
        ShmParams {
            ring_capacity: 1 << 20,
            lock_slots: 64,
            poll: Duration::from_micros(20),
            keep_for_exec: false,
        }
    }
}

impl ShmParams {
    /// Registrations per side: every outstanding advertisement (at most one
    /// per lock word) and its copy-on-write copy, with room to spare.
    pub(super) fn reg_slots(&self) -> u32 {
        (u32::from(self.lock_slots) * 4).clamp(64, MAX_REG_SLOTS)
    }
}

/// Layout of the segment: where each part starts.
#[derive(Clone, Copy, Debug)]
pub(super) struct Layout {
    pub(super) ring: [usize; 2],
    pub(super) ring_len: usize,
    pub(super) locks: [usize; 2],
    pub(super) regs: [usize; 2],
    pub(super) len: usize,
}

impl Layout {
    pub(super) fn new(ring_cap: usize, slots: u32, reg_slots: u32) -> Layout {
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
pub(super) struct Segment {
    pub(super) map: MmapMut,
    pub(super) layout: Layout,
    pub(super) slots: u16,
    pub(super) reg_slots: u32,
    pub(super) key: u32,
    /// Per side: a waiter of this process saw that side's closed flag and
    /// returned at once, so that its thread looks (then reports the peer
    /// gone). Later waits sleep as usual: with nothing more to come, not
    /// sleeping would spin.
    pub(super) closed_seen: [AtomicBool; 2],
    /// A descriptor of the segment, kept so that this side can follow an
    /// exec (see `park`); `None` beyond the budget.
    pub(super) kept: Option<super::park::KeptFd>,
}

pub(super) fn bad(what: &str) -> std::io::Error {
    std::io::Error::new(
        std::io::ErrorKind::InvalidData,
        format!("shm segment: {what}"),
    )
}

impl Segment {
    /// Has `side` closed, and is that news to this process's waiters (see
    /// `closed_seen`)?
    pub(super) fn peer_closed_news(&self, side: usize) -> bool {
        self.hdr().closed[side].load(Ordering::Acquire) != 0
            && !self.closed_seen[side].swap(true, Ordering::AcqRel)
    }

    pub(super) fn hdr(&self) -> &SegHeader {
        // SAFETY: the mapping is at least HEADER_LEN bytes, page-aligned, and
        // lives as long as self; SegHeader is all atomics (any bit pattern
        // is valid).
        unsafe { &*self.map.as_ptr().cast::<SegHeader>() }
    }

    pub(super) fn base(&self) -> *mut u8 {
        self.map.as_ptr().cast_mut()
    }

    /// Lock word `slot` of `side`.
    pub(super) fn lock_word(&self, side: usize, slot: usize) -> Option<&AtomicU64> {
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
    pub(super) fn reg(&self, side: usize, slot: u32) -> Option<&RegEntry> {
        if slot >= self.reg_slots {
            return None;
        }
        let off = self.layout.regs[side] + slot as usize * REG_ENTRY_LEN;
        // SAFETY: in bounds (slot < reg_slots, the table holds reg_slots
        // entries), 32-aligned (tables start 64-aligned), shared and only
        // ever accessed atomically.
        Some(unsafe { &*self.base().add(off).cast::<RegEntry>() })
    }

    pub(super) fn ring(&self, dir: usize) -> std::io::Result<Ring> {
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
    pub(super) fn create(p: &ShmParams) -> std::io::Result<(Segment, OwnedFd)> {
        use nix::fcntl::SealFlag;
        if !p.ring_capacity.is_power_of_two() || !(64..=MAX_RING).contains(&p.ring_capacity) {
            return Err(bad("ring capacity must be a power of two up to 64 MiB"));
        }
        let reg_slots = p.reg_slots();
        let layout = Layout::new(p.ring_capacity, u32::from(p.lock_slots), reg_slots);
        let (fd, mut map) = super::sealed::create(
            c"azsdp-shm",
            layout.len,
            SealFlag::F_SEAL_SHRINK | SealFlag::F_SEAL_GROW | SealFlag::F_SEAL_SEAL,
        )?;
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
            kept: p
                .keep_for_exec
                .then(|| super::park::retain(fd.as_fd()))
                .flatten(),
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
    pub(super) fn open(fd: OwnedFd, keep_for_exec: bool) -> std::io::Result<Segment> {
        use nix::fcntl::{FcntlArg, SealFlag, fcntl};
        let seals = fcntl(&fd, FcntlArg::F_GET_SEALS).map_err(|_| bad("not a sealable memfd"))?;
        let seals = SealFlag::from_bits_truncate(seals);
        if !seals.contains(SealFlag::F_SEAL_SHRINK) {
            return Err(bad("not sealed against shrinking"));
        }
        let kept = keep_for_exec
            .then(|| super::park::retain(fd.as_fd()))
            .flatten();
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
            kept,
        };
        seg.ring(0)?;
        seg.ring(1)?;
        Ok(seg)
    }
}
