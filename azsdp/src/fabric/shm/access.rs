//! What the peer may make us read, and our own registrations: every GET
//! names a key that is checked, before and after the read, against the
//! owner's table (live, range inside), as an RNIC checks an rkey, and reads
//! only the verified, pinned peer process.

use std::io::IoSliceMut;
use std::sync::atomic::Ordering;

use nix::sys::uio::{RemoteIoVec, process_vm_readv};
use nix::unistd::Pid;

use super::endpoint::ShmEndpoint;
use super::segment::{KEY_SLOT_BITS, KEY_SLOT_MASK};
use crate::conn::{CasTarget, OpError, RemoteBuf};
use crate::identity::PeerId;

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
pub(super) fn get_permission(peer: &PeerId) -> Option<NoGet> {
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
pub(super) struct Registrations {
    pub(super) generation: Vec<u32>,
    pub(super) free: Vec<u32>,
}

impl Registrations {
    pub(super) fn new(slots: u32) -> Registrations {
        Registrations {
            generation: vec![0; slots as usize],
            free: (0..slots).rev().collect(),
        }
    }
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

/// Why an operation found the peer unreachable (see [`ShmEndpoint::failure`]):
/// an index into [`FAILURES`], 1-based (0: none yet).
pub(super) const REVOKED: u8 = 1;
pub(super) const REVOKED_DURING: u8 = 2;
pub(super) const PROCESS_GONE: u8 = 3;
pub(super) const CLAIM_LATE: u8 = 4;
pub(super) const CLAIMER_DIED: u8 = 5;
const FAILURES: [&str; 5] = [
    "the peer had revoked its memory (it closed, aborted or left)",
    "the peer revoked its memory while we read it",
    "the peer's process is gone",
    "the process that took the peer side over never claimed it",
    "the process that took the peer side over died before its claim",
];

impl ShmEndpoint {
    /// `OpError::Unreachable`, remembering `why` if it is the first.
    pub(super) fn failure(&self, why: u8) -> OpError {
        let _ = self
            .first_failure
            .compare_exchange(0, why, Ordering::AcqRel, Ordering::Acquire);
        OpError::Unreachable
    }

    /// Why the first operation that failed for the peer's sake failed.
    pub fn first_failure(&self) -> Option<&'static str> {
        let i = self.first_failure.load(Ordering::Acquire);
        FAILURES.get(usize::from(i).checked_sub(1)?).copied()
    }

    pub(super) fn cas(&self, target: CasTarget, expect: u64, new: u64) -> Result<u64, OpError> {
        let word = match target {
            CasTarget::Local { slot } => self.seg.lock_word(self.side, usize::from(slot)),
            CasTarget::Remote { addr, key } => {
                let peer = 1 - self.side;
                if self.seg.hdr().revoked[peer].load(Ordering::Acquire) != 0 {
                    return Err(self.failure(REVOKED));
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
    pub(super) fn registered(&self, key: u32, addr: u64, len: u64) -> bool {
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
    pub(super) fn get(&self, src: RemoteBuf, dst: u64, len: u64) -> Result<(), OpError> {
        if self.no_get.is_some() {
            return Err(OpError::RemoteAccess);
        }
        let revoked = || self.seg.hdr().revoked[1 - self.side].load(Ordering::Acquire) != 0;
        if revoked() {
            return Err(self.failure(REVOKED));
        }
        if !self.registered(src.key, src.addr, len) {
            return Err(OpError::RemoteAccess);
        }
        let r = read_remote(self.peer.pid(), src.addr, dst as *mut u8, len as usize);
        // The pid named the pinned process throughout only if it is still
        // alive now (until it exits, no other process can have its pid).
        if !self.peer.alive() {
            return Err(self.failure(PROCESS_GONE));
        }
        match r {
            Err(nix::Error::ESRCH) => return Err(self.failure(PROCESS_GONE)),
            Err(_) => return Err(OpError::RemoteAccess),
            Ok(()) => {}
        }
        // A registration withdrawn, or an abort, while we read: what we
        // read may no longer be what was advertised.
        if !self.still_registered(src.key) {
            return Err(OpError::RemoteAccess);
        }
        if revoked() {
            return Err(self.failure(REVOKED_DURING));
        }
        Ok(())
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
    pub(super) fn withdraw(&mut self, key: u32) {
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
