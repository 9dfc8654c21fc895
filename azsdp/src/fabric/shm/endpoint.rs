//! One side of a connection: the fabric contract over the segment.

use std::collections::VecDeque;
use std::os::fd::OwnedFd;
use std::sync::Arc;
use std::sync::atomic::{AtomicU32, Ordering};
use std::time::{Duration, Instant};

use super::access::{NoGet, Registrations, get_permission};
use super::liveness::HeldGet;
use super::segment::{FORK_GEN, FORK_GEN_ONE, FROZEN, LOCAL_KEY, PID_MASK, Segment, ShmParams};
use super::waiter::wait_ring;
use crate::conn::{CasTarget, LockRegion, OpError, OpId, RemoteBuf};
use crate::fabric::pool::Pool;
use crate::fabric::ring::{self, Ring};
use crate::fabric::{
    Armed, Departure, Fabric, FabricError, FabricEvent, LocalBuf, OpResult, Ownership, RegAccess,
    Sharing,
};
use crate::identity::PeerId;

/// One side of a `shm` connection.
#[derive(Debug)]
pub struct ShmEndpoint {
    // Rings borrow the mapping in `seg`: declared first, dropped first.
    pub(super) tx: Ring,
    pub(super) rx: Ring,
    pub(super) seg: Arc<Segment>,
    pub(super) side: usize,
    /// The process running the peer side, verified and pinned.
    pub(super) peer: PeerId,
    /// The bell of the process running the peer side (shared by every
    /// connection to that process): rung when we post to an armed ring,
    /// and where a claim after our fork goes.
    pub(super) peer_bell: Arc<OwnedFd>,
    pub(super) peer_page_size: u32,
    pub(super) no_get: Option<NoGet>,
    pub(super) params: ShmParams,
    pub(super) completions: VecDeque<(OpId, OpResult)>,
    pub(super) regs: Registrations,
    /// Copies copy-on-write makes, for the peer to GET.
    pub(super) pool: Pool,
    pub(super) gone_reported: bool,
    /// The peer wrote nonsense into the segment: the connection is over.
    pub(super) corrupt: bool,
    /// The peer's process may have exited (the reactor heard its pidfd, or
    /// another process claimed the peer side): the next liveness check
    /// asks the kernel. Otherwise the endpoints of one peer process ask it
    /// at most once per [`ALIVE_EVERY`] between them.
    pub(super) alive_suspect: bool,
    pub(super) held_gets: VecDeque<HeldGet>,
    /// The generation of the freeze this copy made or was made by (see
    /// [`FORK_GEN`]); a fork copies it into the child.
    pub(super) fork_gen: AtomicU32,
    /// Why the first operation that failed for the peer's sake failed (the
    /// engine's abort says only "peer unreachable"; the close line says
    /// this too).
    pub(super) first_failure: std::sync::atomic::AtomicU8,
    /// Our claim (after taking this side over in a forked child) has not
    /// reached the peer yet: [`Fabric::poll`] sends it again.
    pub(super) claim_unsent: std::sync::atomic::AtomicBool,
    /// The last of our loop bells the peer's process was found to hold
    /// (see `Watched::ring_at`; 0: none).
    pub(super) given_bell: u32,
    /// A fork froze the peer's side, or another process took it, since we
    /// paired (see [`ShmEndpoint::peer_runs_alone`]); it stays set.
    pub(super) peer_changed_hands: std::sync::atomic::AtomicBool,
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

pub(super) fn page_size() -> u32 {
    crate::pages::system_page_size() as u32
}

impl ShmEndpoint {
    pub(super) fn new(
        seg: Segment,
        side: usize,
        peer_bell: Arc<OwnedFd>,
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
            peer_bell,
            peer,
            peer_page_size,
            no_get,
            params,
            completions: VecDeque::new(),
            pool: Pool::default(),
            regs,
            gone_reported: false,
            corrupt: false,
            alive_suspect: false,
            held_gets: VecDeque::new(),
            fork_gen: AtomicU32::new(0),
            first_failure: std::sync::atomic::AtomicU8::new(0),
            claim_unsent: std::sync::atomic::AtomicBool::new(false),
            given_bell: 0,
            peer_changed_hands: Default::default(),
        })
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

    /// This side closed, or the peer corrupted the segment: no message
    /// goes out any more.
    fn cannot_post(&self) -> bool {
        self.corrupt || self.seg.hdr().closed[self.side].load(Ordering::Relaxed) != 0
    }
}

impl ShmEndpoint {
    /// Is owner word `w` frozen by the fork this copy came from (or made)?
    fn frozen_by_our_fork(&self, w: u32) -> bool {
        w & FROZEN != 0 && w & FORK_GEN == self.fork_gen.load(Ordering::Relaxed)
    }
}

/// The processes holding this side after a fork share the segment's
/// owner, leave, left and heir words.
impl Sharing for ShmEndpoint {
    fn ownership(&self) -> Ownership {
        let w = self.seg.hdr().owner[self.side].load(Ordering::Acquire);
        if w == crate::process::pid() {
            Ownership::Mine
        } else if self.frozen_by_our_fork(w) {
            Ownership::Unclaimed
        } else {
            Ownership::Other
        }
    }

    /// Frozen with the next generation, which this copy (and the child's,
    /// made from it by the fork) remembers.
    fn freeze(&self) {
        let me = crate::process::pid();
        let generation = self
            .fork_gen
            .load(Ordering::Relaxed)
            .wrapping_add(FORK_GEN_ONE)
            & FORK_GEN;
        let frozen = me | FROZEN | generation;
        if self.seg.hdr().owner[self.side]
            .compare_exchange(me, frozen, Ordering::AcqRel, Ordering::Acquire)
            .is_ok()
        {
            self.fork_gen.store(generation, Ordering::Relaxed);
        }
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
            if !self.frozen_by_our_fork(w) {
                return false;
            }
            match word.compare_exchange(w, me, Ordering::AcqRel, Ordering::Acquire) {
                Ok(was) => {
                    if was & PID_MASK != me {
                        self.send_claim();
                    }
                    return true;
                }
                Err(now) => w = now,
            }
        }
    }

    fn request_leave(&self) {
        self.seg.hdr().leave[self.side].store(1, Ordering::Release);
    }

    fn leave_requested(&self) -> bool {
        self.seg.hdr().leave[self.side].load(Ordering::Relaxed) != 0
    }

    fn mark_left(&self) {
        let w = &self.seg.hdr().left[self.side];
        w.store(1, Ordering::Release);
        crate::futex::wake_all(w);
    }

    fn mark_peer_left(&self) {
        let w = &self.seg.hdr().left[1 - self.side];
        w.store(1, Ordering::Release);
        crate::futex::wake_all(w);
    }

    fn note_heir(&self) {
        let w = &self.seg.hdr().heir[self.side];
        let me = crate::process::pid();
        if w.load(Ordering::Relaxed) != me {
            w.store(me, Ordering::Release);
        }
    }

    fn has_left(&self) -> bool {
        self.seg.hdr().left[self.side].load(Ordering::Acquire) != 0
    }
}

impl Fabric for ShmEndpoint {
    fn sharing(&self) -> &dyn Sharing {
        self
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

    /// The peer's process (the claimer's, after a fork) lives, did not
    /// close its side, and is held up (stopped, or starved of CPU: see
    /// [`crate::stats::held_up`]): it is waited for. A live peer whose
    /// threads all sleep and yet do not answer is not vouched for.
    fn peer_vouched(&mut self) -> bool {
        self.peer_alive() && peer_held_up(self.peer.pid())
    }

    /// Nothing of ours pins here, but a NIC's registrations of this
    /// process (another connection's, over verbs) may.
    fn unpin_near(&mut self, range: std::ops::Range<u64>) -> bool {
        !crate::pinned::near(&range)
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
        self.resend_claim();
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
            on_event(FabricEvent::PeerGone {
                left: None,
                heir: false,
            });
            return n + 1;
        }
        // GETs held for a claim fail first: with the peer gone no poll
        // may come to see their wait run out.
        if n == 0 && !self.peer_alive() && self.rx.is_empty() {
            for g in std::mem::take(&mut self.held_gets) {
                on_event(FabricEvent::Done {
                    op: g.op,
                    result: OpResult::Get(Err(self.failure(super::access::PROCESS_GONE))),
                });
                n += 1;
            }
            self.gone_reported = true;
            let hdr = self.seg.hdr();
            let left = Departure {
                sent: hdr.sent[1 - self.side].load(Ordering::Acquire),
                read: hdr.read[1 - self.side].load(Ordering::Acquire),
            };
            // An heir that lives carries the peer's side on (not one that
            // closed it cleanly: then nothing is carried).
            let heir = hdr.heir[1 - self.side].load(Ordering::Acquire);
            let heir = !self.peer_closed()
                && heir != 0
                && heir != self.peer.pid()
                && crate::stats::alive(heir);
            on_event(FabricEvent::PeerGone {
                left: Some(left),
                heir,
            });
            n += 1;
        }
        n
    }
}

/// Is peer process `pid` held up ([`crate::stats::held_up`])? Asked once
/// per `peer_timeout` of a connection's silence: a few looks, a few
/// milliseconds apart, so that a busy process caught with every thread
/// asleep for an instant still counts; and the answer serves every
/// connection to that process for a moment (a starved peer with many
/// connections is asked once, not once per connection).
fn peer_held_up(pid: u32) -> bool {
    use std::time::{Duration, Instant};
    static LAST: crate::sync::Lock<Option<(u32, Instant, bool)>> = crate::sync::Lock::new(None);
    if let Some((p, at, held)) = *LAST.lock()
        && p == pid
        && at.elapsed() < Duration::from_millis(100)
    {
        return held;
    }
    let held = (0..3).any(|i| {
        if i > 0 {
            std::thread::sleep(Duration::from_millis(2));
        }
        crate::stats::held_up(pid)
    });
    *LAST.lock() = Some((pid, Instant::now(), held));
    held
}
