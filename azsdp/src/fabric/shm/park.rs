//! Carrying an endpoint across `exec`: the segment's descriptor, the
//! peer's pidfd and its process's bell are inherited by the next image of
//! this process (same pid), which maps the segment again and takes up the
//! parked engine on it (docs/shim.md, "exec").
//!
//! A side drops the segment's memfd once it is mapped, and a mapping alone
//! cannot be mapped again in a new image. So a side whose socket may
//! survive an exec (not close-on-exec when it is upgraded:
//! [`ShmParams::keep_for_exec`]) keeps a descriptor of it ([`retain`]),
//! placed high (out of the way of the numbers a program's own descriptors
//! get), within a budget of a quarter of the process's descriptor limit;
//! other connections hold no descriptor of their own, and cannot follow an
//! exec (they move onto TCP then, as before).
//!
//! `unsafe` here: taking ownership of the descriptors an exec passed us.

use std::os::fd::{AsFd, AsRawFd, BorrowedFd, FromRawFd, OwnedFd, RawFd};
use std::sync::atomic::{AtomicU32, AtomicUsize, Ordering};
use std::time::Duration;

use serde::{Deserialize, Serialize};

use super::endpoint::ShmEndpoint;
use super::segment::{Segment, ShmParams};
use crate::identity::PeerId;

/// Segment descriptors this process keeps.
static KEPT: AtomicUsize = AtomicUsize::new(0);

/// A descriptor of a segment, kept for a later exec.
#[derive(Debug)]
pub(super) struct KeptFd(OwnedFd);

impl Drop for KeptFd {
    fn drop(&mut self) {
        KEPT.fetch_sub(1, Ordering::Relaxed);
    }
}

impl KeptFd {
    pub(super) fn as_fd(&self) -> BorrowedFd<'_> {
        self.0.as_fd()
    }
}

/// The process's soft descriptor limit.
fn descriptor_limit() -> usize {
    let mut r = libc::rlimit {
        rlim_cur: 0,
        rlim_max: 0,
    };
    // SAFETY: getrlimit into our own struct.
    if unsafe { libc::getrlimit(libc::RLIMIT_NOFILE, &mut r) } != 0 {
        return 0;
    }
    usize::try_from(r.rlim_cur).unwrap_or(usize::MAX)
}

/// Duplicate `fd` (close-on-exec) at `min` or above; `None` on failure.
fn dup_at_or_above(fd: BorrowedFd<'_>, min: usize, cloexec: bool) -> Option<OwnedFd> {
    let cmd = if cloexec {
        libc::F_DUPFD_CLOEXEC
    } else {
        libc::F_DUPFD
    };
    let min = libc::c_int::try_from(min).ok()?;
    // SAFETY: fcntl duplicating a descriptor we hold.
    let d = unsafe { libc::fcntl(fd.as_raw_fd(), cmd, min) };
    // SAFETY: a fresh descriptor nothing else owns.
    (d >= 0).then(|| unsafe { OwnedFd::from_raw_fd(d) })
}

/// Where kept descriptors go: half the limit, at most 1024 (a higher
/// number would grow the process's descriptor table for nothing).
fn high_base(limit: usize) -> usize {
    (limit / 2).min(1024)
}

/// Keep a descriptor of the segment `fd`, if the budget allows.
pub(super) fn retain(fd: BorrowedFd<'_>) -> Option<KeptFd> {
    let limit = descriptor_limit();
    if KEPT.fetch_add(1, Ordering::Relaxed) >= limit / 4 {
        KEPT.fetch_sub(1, Ordering::Relaxed);
        return None;
    }
    match dup_at_or_above(fd, high_base(limit), true) {
        Some(d) => Some(KeptFd(d)),
        None => {
            KEPT.fetch_sub(1, Ordering::Relaxed);
            None
        }
    }
}

/// An endpoint parked for the next image: what it needs besides the
/// segment's contents, and the numbers of the descriptors it inherits.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct ParkedEndpoint {
    side: u8,
    peer_pid: u32,
    peer_uid: u32,
    peer_gid: u32,
    peer_page_size: u32,
    ring_capacity: u64,
    lock_slots: u16,
    poll: Duration,
    fork_gen: u32,
    segment_fd: RawFd,
    pidfd: RawFd,
    bell_fd: RawFd,
}

/// Why a parked endpoint cannot be taken up.
fn bad(what: &str) -> std::io::Error {
    std::io::Error::other(format!("parked endpoint: {what}"))
}

/// Take a descriptor the previous image left us at `fd`, if it is one
/// (and mark it close-on-exec again).
fn inherited(fd: RawFd) -> std::io::Result<OwnedFd> {
    // SAFETY: F_GETFD only asks whether `fd` is open.
    if fd < 0 || unsafe { libc::fcntl(fd, libc::F_GETFD) } < 0 {
        return Err(bad("a descriptor is missing"));
    }
    // SAFETY: the previous image of this process left `fd` open for us
    // (the parked record names it) and nothing in this image owns it.
    let owned = unsafe { OwnedFd::from_raw_fd(fd) };
    // SAFETY: F_SETFD on the descriptor just taken.
    unsafe { libc::fcntl(fd, libc::F_SETFD, libc::FD_CLOEXEC) };
    Ok(owned)
}

fn is_socket(fd: BorrowedFd<'_>) -> bool {
    nix::sys::stat::fstat(fd).is_ok_and(|st| st.st_mode & libc::S_IFMT == libc::S_IFSOCK)
}

impl ShmEndpoint {
    /// This endpoint as a parked record, with the descriptors the next
    /// image inherits (duplicates that do not close on exec; dropping them
    /// undoes that, if the exec fails). `None` if this process did not
    /// keep the segment's descriptor (its budget was spent).
    pub fn park(&self) -> Option<(ParkedEndpoint, Vec<OwnedFd>)> {
        let kept = self.seg.kept.as_ref()?;
        let limit = descriptor_limit();
        let base = high_base(limit);
        let seg = dup_at_or_above(kept.as_fd(), base, false)?;
        let pidfd = dup_at_or_above(self.peer.pidfd(), base, false)?;
        let bell = dup_at_or_above(self.peer_bell.as_fd(), base, false)?;
        let p = ParkedEndpoint {
            side: self.side as u8,
            peer_pid: self.peer.pid(),
            peer_uid: self.peer.uid(),
            peer_gid: self.peer.gid(),
            peer_page_size: self.peer_page_size,
            ring_capacity: self.params.ring_capacity as u64,
            lock_slots: self.params.lock_slots,
            poll: self.params.poll,
            fork_gen: self.fork_gen.load(Ordering::Relaxed),
            segment_fd: seg.as_raw_fd(),
            pidfd: pidfd.as_raw_fd(),
            bell_fd: bell.as_raw_fd(),
        };
        Some((p, vec![seg, pidfd, bell]))
    }

    /// Take up a parked endpoint in this (new) image: the segment mapped
    /// again from its inherited descriptor, the peer as the pidfd pins it.
    /// The caller then tells the peer where our bell is now
    /// ([`ShmEndpoint::announce`]).
    pub fn unpark(p: &ParkedEndpoint) -> std::io::Result<ShmEndpoint> {
        let seg_fd = inherited(p.segment_fd)?;
        let pidfd = inherited(p.pidfd)?;
        let bell = inherited(p.bell_fd)?;
        if !is_socket(bell.as_fd()) {
            return Err(bad("the bell is not a socket"));
        }
        let side = usize::from(p.side);
        if side > 1 {
            return Err(bad("side"));
        }
        // Kept again: the new image may exec in turn.
        let seg = Segment::open(seg_fd, true)?;
        if seg.hdr().owner[side].load(Ordering::Acquire) != crate::process::pid() {
            return Err(bad("the segment's side is not this process's"));
        }
        let peer = PeerId::resumed(p.peer_pid, p.peer_uid, p.peer_gid, pidfd)?;
        let params = ShmParams {
            ring_capacity: usize::try_from(p.ring_capacity).map_err(|_| bad("ring"))?,
            lock_slots: p.lock_slots,
            poll: p.poll,
            keep_for_exec: true,
        };
        let bell = super::bells::take(&peer, None, Some(bell), false)?.bell;
        let mut ep = ShmEndpoint::new(seg, side, bell, peer, p.peer_page_size, params)?;
        ep.fork_gen = AtomicU32::new(p.fork_gen);
        Ok(ep)
    }

    /// Tell the peer, with our kernel identity, that this process's bell is
    /// a new one (the previous image's closed with it).
    pub fn announce(&self) {
        self.send_claim();
    }
}
