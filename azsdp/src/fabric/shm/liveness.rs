//! Who runs the peer side, and whether it still exists: the pinned peer,
//! its process's bell, claims after its fork (followed only with the
//! claimer's kernel identity), GETs held while a claim is on its way.

use std::os::fd::{AsFd, BorrowedFd, OwnedFd};
use std::sync::Arc;
use std::sync::atomic::Ordering;
use std::time::{Duration, Instant};

use super::access::get_permission;
use super::bells;
use super::endpoint::{ShmEndpoint, page_size};
use super::loop_bell;
use super::segment::PID_MASK;
use crate::conn::{OpId, RemoteBuf};
use crate::driver::reactor::{self, Mail, Reactor};
use crate::fabric::{OpResult, Ownership, Sharing};
use crate::pairing::{Intro, IntroKind};

/// How long a GET waits for the claim of a process that took the peer side
/// over. A true claim is on our bell before anything the new process
/// posts, but reaches the endpoint only when this process's reactor
/// thread runs, which on a loaded host can take a while (200 ms was seen
/// to be too short in CI: a pull of rsync's daemon reset). A claimer that
/// is gone fails the GET at once; a word rewritten without a claim (the
/// peer's own doing) fails it, and holds up a call on its own connection,
/// no longer than this.
const CLAIM_WAIT: Duration = Duration::from_secs(5);

/// A GET held until a claim comes (see `ShmEndpoint::claim_pending`).
#[derive(Debug)]
pub(super) struct HeldGet {
    pub(super) op: OpId,
    pub(super) src: RemoteBuf,
    pub(super) dst: u64,
    pub(super) len: u64,
    pub(super) since: Instant,
}

/// How often the endpoints of one peer process ask whether it still
/// exists (a peer that closes says so in the segment at once; this is for
/// one that dies without closing, whose exit the reactor may not have
/// heard yet).
pub(super) const ALIVE_EVERY: Duration = Duration::from_millis(1);

impl ShmEndpoint {
    pub(super) fn peer_closed(&self) -> bool {
        self.seg.hdr().closed[1 - self.side].load(Ordering::Acquire) != 0
    }

    /// Does the owner word say another process took the peer side, whose
    /// claim (with its kernel identity) has not reached us yet?
    pub(super) fn claim_pending(&self) -> bool {
        self.claimer().is_some()
    }

    /// The process the owner word names when it is not the pinned peer
    /// (its claim on the way, or a rewrite without one).
    fn claimer(&self) -> Option<u32> {
        let w = self.seg.hdr().owner[1 - self.side].load(Ordering::Acquire) & PID_MASK;
        (w != 0 && w != self.peer.pid()).then_some(w)
    }

    /// GETs held for a claim: run once it came, failed if it never does.
    pub(super) fn release_held_gets(&mut self) {
        while let Some(g) = self.held_gets.front() {
            let result = if let Some(claimer) = self.claimer() {
                let alive = crate::stats::alive(claimer);
                if g.since.elapsed() < CLAIM_WAIT && alive {
                    return;
                }
                Err(self.failure(if alive {
                    super::access::CLAIM_LATE
                } else {
                    super::access::CLAIMER_DIED
                }))
            } else {
                self.get(g.src, g.dst, g.len)
            };
            let op = g.op;
            self.held_gets.pop_front();
            self.completions.push_back((op, OpResult::Get(result)));
        }
    }

    /// Tell the peer, with our kernel identity and our process's bell, that
    /// this process runs our side now (after a fork). Until it has
    /// that claim it holds its GETs (and fails them after [`CLAIM_WAIT`]),
    /// so one that could not go yet goes again at the next poll: the
    /// peer's connection may not have put its bell token in the segment
    /// yet (a child that claims at its first call, right after the
    /// connect, under load), or its bell may be full.
    pub(super) fn send_claim(&self) {
        let sent = (|| {
            let reactor = Reactor::get().ok()?;
            let token = self.seg.hdr().bell[1 - self.side].load(Ordering::Acquire);
            if token == 0 {
                return None;
            }
            let mut body = [0u8; reactor::MAIL_LEN];
            Intro::new(IntroKind::Claim, page_size()).emit(&mut body);
            match reactor::send_mail(self.peer_bell.as_fd(), token, &body, &[reactor.bell()]) {
                Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => None,
                // (Sent, or a peer that is gone: it needs no claim.)
                _ => Some(()),
            }
        })();
        self.claim_unsent.store(sent.is_none(), Ordering::Release);
    }

    /// A claim that could not go before: try again (see [`Self::send_claim`]).
    pub(super) fn resend_claim(&self) {
        if self.claim_unsent.load(Ordering::Acquire) && self.ownership() == Ownership::Mine {
            self.send_claim();
        }
    }

    /// The peer did not close and (as of at most [`ALIVE_EVERY`] ago, or
    /// now if its exit may have been heard) its process lives.
    pub(super) fn peer_alive(&mut self) -> bool {
        if self.peer_closed() {
            return false;
        }
        if std::mem::take(&mut self.alive_suspect) {
            return self.peer.alive();
        }
        self.peer.alive_lately(ALIVE_EVERY)
    }
}

impl crate::fabric::Watched for ShmEndpoint {
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
        if let IntroKind::LoopBell(id) = intro.kind {
            // From the peer's own process only.
            let mut fds = mail.from.fds.into_iter();
            if mail.from.peer.uid() == self.peer.uid()
                && mail.from.peer.pid() == self.peer.pid()
                && let Some(bell) = fds.next()
            {
                let page = fds.next();
                loop_bell::take(&self.peer.pidfd_shared(), self.peer.uid(), id, bell, page);
            }
            return;
        }
        let owner = self.seg.hdr().owner[1 - self.side].load(Ordering::Acquire) & PID_MASK;
        if intro.kind != IntroKind::Claim
            || mail.from.peer.uid() != self.peer.uid()
            || mail.from.peer.pid() != owner
        {
            return;
        }
        let Some(bell) = mail.from.fds.into_iter().next() else {
            return;
        };
        let Ok(taken) = bells::take(&mail.from.peer, None, Some(bell), false) else {
            return;
        };
        self.peer = mail.from.peer;
        self.peer_changed_hands.store(true, Ordering::Relaxed);
        self.peer_bell = taken.bell;
        self.no_get = get_permission(&self.peer);
        self.alive_suspect = true;
    }

    fn peer_suspect(&mut self) {
        self.alive_suspect = true;
    }

    /// Rings for this side go to our loop bell `bell` (0: the process's
    /// bell), once the peer's process holds it: the first time, it is
    /// passed to it as mail on its bell.
    fn ring_at(&mut self, bell: u32) {
        let route = if bell == 0 || bell == self.given_bell || self.give_loop_bell(bell) {
            bell
        } else {
            0
        };
        let word = &self.seg.hdr().route[self.side];
        if word.load(Ordering::Relaxed) != route {
            word.store(route, Ordering::Release);
        }
    }
}

impl ShmEndpoint {
    /// Does the peer's process hold our loop bell `bell` (given now if
    /// not yet)?
    fn give_loop_bell(&mut self, bell: u32) -> bool {
        let peer = self.peer.pidfd_shared();
        let held = match loop_bell::to_give(bell, &peer) {
            loop_bell::Giving::Held => true,
            loop_bell::Giving::Unknown => false,
            loop_bell::Giving::Give(w, page) => {
                let token = self.seg.hdr().bell[1 - self.side].load(Ordering::Acquire);
                let mut body = [0u8; reactor::MAIL_LEN];
                Intro::new(IntroKind::LoopBell(bell), page_size()).emit(&mut body);
                let mut fds = vec![w.as_fd()];
                fds.extend(page.as_ref().map(|p| p.as_fd()));
                let sent = token != 0
                    && reactor::send_mail(self.peer_bell.as_fd(), token, &body, &fds).is_ok();
                if !sent {
                    loop_bell::not_given(bell, &peer);
                }
                sent
            }
        };
        if held {
            self.given_bell = bell;
        }
        held
    }
}
