//! The engine's timers, named in one table: each has a deadline (when it
//! is armed) and an expiry. [`Connection::poll_timeout`] is the earliest
//! deadline; [`Connection::handle_timeout`] fires the due ones in table
//! order. Both read the same [`Connection::deadline`], so they cannot
//! disagree.

use std::ops::Range;
use std::time::Duration;

use super::{AbortReason, Connection, FaultPolicy, OutMsg, State, UserMemory};
use crate::time::Timestamp;
use crate::wire::AbortCode;

/// A timer of the engine.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Timer {
    /// Work an earlier event left for the next turn: at once.
    Repoll,
    /// `close()` left data in flight: abort if it is not finished by the
    /// linger timeout.
    Linger,
    /// The peer owes an answer (a handshake, a GET_COMPLETE, a call's
    /// data) and said nothing for `peer_timeout`: abort.
    PeerTimeout,
    /// Quiet for `keepalive` while the peer owes something: ping it.
    Keepalive,
    /// A writer blocked on a page under block-on-write for
    /// `block_escalate`: settle the page another way (evacuate it).
    BlockEscalate,
}

impl Timer {
    /// Every timer, in the order they fire when due together (the aborts
    /// first: a connection that ends needs no ping).
    pub const ALL: [Timer; 5] = [
        Timer::Repoll,
        Timer::Linger,
        Timer::PeerTimeout,
        Timer::Keepalive,
        Timer::BlockEscalate,
    ];
}

impl Connection {
    /// The fabric vouches that the peer's side is alive now (its process
    /// lives, or its NIC answered) although its engine says nothing: it
    /// may be stopped (a debugger, SIGSTOP) or starved of CPU. Such a peer
    /// is not timed out (`peer_timeout`), as a TCP peer whose kernel still
    /// answers is not; pings go on, and a peer that dies is seen as gone.
    pub fn peer_vouched(&mut self, now: Timestamp) {
        self.last_vouched = Some(now);
    }

    /// When `timer` expires, if it is armed.
    pub fn deadline(&self, timer: Timer) -> Option<Timestamp> {
        let liveness = || self.owes_liveness() && self.cfg.peer_timeout > Duration::ZERO;
        match timer {
            Timer::Repoll => self.repoll.then_some(self.now),
            // An aborted connection waits for nothing more, nor one that
            // left the fabric.
            _ if self.is_aborted() || self.state == State::Switched => None,
            Timer::Linger => self.linger_deadline.filter(|_| !self.is_finished()),
            Timer::PeerTimeout => liveness().then(|| {
                let since = self.silent_since();
                let heard = self.last_vouched.map_or(since, |v| v.max(since));
                heard + self.cfg.peer_timeout
            }),
            Timer::Keepalive => (!self.ping_outstanding
                && self.state == State::Established
                && !self.switch_sent()
                && liveness())
            .then(|| self.silent_since() + self.cfg.keepalive),
            Timer::BlockEscalate => (self.cfg.write_fault == FaultPolicy::Block)
                .then(|| {
                    self.waiters
                        .iter()
                        .filter(|w| !w.escalated)
                        .map(|w| w.since + self.cfg.block_escalate)
                        .min()
                })
                .flatten(),
        }
    }

    /// When the driver should call [`Connection::handle_timeout`] next.
    pub fn poll_timeout(&self) -> Option<Timestamp> {
        Timer::ALL.iter().filter_map(|&t| self.deadline(t)).min()
    }

    /// Time passed: fire every timer that is due.
    pub fn handle_timeout(&mut self, now: Timestamp, mem: &mut dyn UserMemory) {
        self.now = now;
        for timer in Timer::ALL {
            if self.deadline(timer).is_some_and(|d| d <= now) {
                self.fire(timer, now, mem);
                if self.is_aborted() {
                    return;
                }
            }
        }
        self.progress(mem);
    }

    fn fire(&mut self, timer: Timer, now: Timestamp, mem: &mut dyn UserMemory) {
        match timer {
            Timer::Repoll => {
                self.repoll = false;
                self.progress(mem);
            }
            Timer::Linger => self.abort(AbortReason::LingerTimeout, Some(AbortCode::Timeout)),
            Timer::PeerTimeout => self.abort(AbortReason::PeerTimeout, Some(AbortCode::Timeout)),
            Timer::Keepalive => {
                self.ping_outstanding = true;
                self.out.push_back(OutMsg::Credit {
                    ping: true,
                    pong: false,
                });
            }
            Timer::BlockEscalate => {
                let due: Vec<Range<u64>> = self
                    .waiters
                    .iter_mut()
                    .filter(|w| !w.escalated && now >= w.since + self.cfg.block_escalate)
                    .map(|w| {
                        w.escalated = true;
                        w.range.clone()
                    })
                    .collect();
                for r in due {
                    self.counters.block_escalations += 1;
                    self.evacuate_range(&r);
                }
            }
        }
    }
}
