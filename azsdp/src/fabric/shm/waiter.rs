//! Waking and waiting: the peer's futex and doorbell, busy-polling that
//! pays, and the waiter a thread or the reactor sleeps on.

use std::cell::RefCell;
use std::os::fd::{AsFd, OwnedFd};
use std::sync::Arc;
use std::sync::atomic::Ordering;
use std::time::{Duration, Instant};

use super::endpoint::ShmEndpoint;
use super::segment::Segment;
use crate::driver::reactor;
use crate::fabric::ring::RingWatch;

impl ShmEndpoint {
    /// A waiter for this endpoint's incoming messages (it only looks).
    pub fn waiter(&self) -> ShmWaiter {
        ShmWaiter {
            rx: self.rx.watch(),
            seg: Arc::clone(&self.seg),
            peer: 1 - self.side,
            poll: self.params.poll,
        }
    }

    /// Wake the peer's threads sleeping on the ring, and ring its
    /// reactor's doorbell if it is armed and none slept (`force`: whatever
    /// they do).
    pub(super) fn wake_peer(&self, force: bool) {
        let (published, sleeping) = self.tx.wait_words();
        // Pairs with the count in `wait_ring` (either the sleeper sees what
        // we published, or we see it counted) and with the fence in `arm`
        // (either the peer's reactor sees it, or we see it armed).
        std::sync::atomic::fence(Ordering::SeqCst);
        let asleep = sleeping.load(Ordering::Relaxed) != 0;
        if force || asleep {
            crate::futex::wake_all(published);
        }
        // A thread asleep in a call turns the whole engine once it wakes,
        // and tells readiness waiters what moved, after it stopped counting
        // as asleep: the reactor has nothing to do for this message, and
        // its doorbell stays armed for the next. (Rung as well, each first
        // exchange woke two threads of the peer where TCP wakes one.)
        if asleep && !force && self.peer_runs_alone() {
            return;
        }
        let armed = self.tx.armed();
        if (force || armed.load(Ordering::Relaxed) != 0) && armed.swap(0, Ordering::AcqRel) != 0 {
            self.ring_doorbell();
        }
    }

    /// Has the peer's side stayed with the process we paired with (no fork
    /// froze it, no other process took it)? Only then is a thread asleep on
    /// our ring one that runs it: a sleeper of a process that let the side
    /// go wakes and leaves it be, and the process that runs it now may need
    /// its reactor rung. Once not, never again (a side handed back may
    /// still have the other process's sleeper).
    fn peer_runs_alone(&self) -> bool {
        if self.peer_changed_hands.load(Ordering::Relaxed) {
            return false;
        }
        match self.seg.hdr().owner[1 - self.side].load(Ordering::Acquire) {
            // (Not set yet: the peer's endpoint is on its way.)
            0 => false,
            w if w == self.peer.pid() => true,
            _ => {
                self.peer_changed_hands.store(true, Ordering::Relaxed);
                false
            }
        }
    }

    /// The peer's token on its process's bell. A bell that is full (or a
    /// peer with no token yet) leaves the ring armed: the next message
    /// rings again, and the peer's reactor looks at least once a second.
    /// While this thread holds its rings ([`hold_rings`]), the ring waits
    /// for the hold to end.
    fn ring_doorbell(&self) {
        let token = self.seg.hdr().bell[1 - self.side].load(Ordering::Acquire);
        if token == 0 {
            self.tx.armed().store(1, Ordering::Release);
            return;
        }
        // The bell of the peer's loop that sleeps, if its process gave it
        // to ours (see `loop_bell`).
        let route = self.seg.hdr().route[1 - self.side].load(Ordering::Acquire);
        if route != 0 {
            use super::loop_bell::Rang;
            match super::loop_bell::ring(&self.peer.pidfd_shared(), route, token) {
                Rang::Yes => return,
                // Its loop looks at the connection before it sleeps: the
                // arming stays for the ring that sleep will want.
                Rang::Awake => {
                    self.tx.armed().store(1, Ordering::Release);
                    return;
                }
                Rang::No => {}
            }
        }
        // (Not held at all once the thread's locals are gone: a close at
        // `exit()`, after they were destroyed, rings at once.)
        let held = HELD
            .try_with(|h| {
                let mut h = h.borrow_mut();
                let Some(rings) = h.as_mut() else {
                    return false;
                };
                let bell = &self.peer_bell;
                if !rings
                    .iter()
                    .any(|r| Arc::ptr_eq(&r.bell, bell) && r.token == token)
                {
                    rings.push(HeldRing {
                        bell: Arc::clone(bell),
                        token,
                        armed: self.tx.watch(),
                        _seg: Arc::clone(&self.seg),
                    });
                }
                true
            })
            .unwrap_or(false);
        if !held && !reactor::ring(self.peer_bell.as_fd(), token) {
            self.tx.armed().store(1, Ordering::Release);
        }
    }
}

/// A ring held back (see [`hold_rings`]).
struct HeldRing {
    bell: Arc<OwnedFd>,
    token: u64,
    /// The ring whose doorbell flag goes back up if the bell is full.
    armed: RingWatch,
    /// Keeps the ring's memory mapped (the watch's contract).
    _seg: Arc<Segment>,
}

thread_local! {
    /// This thread's held rings, while it holds them.
    static HELD: RefCell<Option<Vec<HeldRing>>> = const { RefCell::new(None) };
}

/// Held rings, rung when this drops (see [`hold_rings`]).
#[must_use]
#[derive(Debug)]
pub struct RingsHeld {
    outermost: bool,
}

/// Hold back this thread's doorbell rings until the guard drops, then ring
/// each peer's bell once per connection. A call that starts a connection
/// and joins it posts a message for each, and each ring wakes the peer's
/// reactor, which rearms between them. The holder must not wait for the
/// peer while it holds them.
pub fn hold_rings() -> RingsHeld {
    HELD.try_with(|h| {
        let mut h = h.borrow_mut();
        let outermost = h.is_none();
        if outermost {
            *h = Some(Vec::new());
        }
        RingsHeld { outermost }
    })
    .unwrap_or(RingsHeld { outermost: false })
}

impl Drop for RingsHeld {
    fn drop(&mut self) {
        if !self.outermost {
            return;
        }
        let rings = HELD
            .try_with(|h| h.borrow_mut().take())
            .ok()
            .flatten()
            .unwrap_or_default();
        for r in rings {
            if !reactor::ring(r.bell.as_fd(), r.token) {
                r.armed.armed().store(1, Ordering::Release);
            }
        }
    }
}

pub(super) fn wait_ring(
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
    let spin = if crate::busy_poll::spinning_pays() {
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

/// Waits for messages to one endpoint without borrowing it, for a progress
/// thread while other threads use the endpoint.
#[derive(Debug)]
pub struct ShmWaiter {
    // Declared before `seg`, whose mapping it points into.
    pub(super) rx: RingWatch,
    pub(super) seg: Arc<Segment>,
    pub(super) peer: usize,
    pub(super) poll: Duration,
}

impl crate::fabric::FabricWaiter for ShmWaiter {
    fn prepare(&self) -> u32 {
        self.rx.wait_words().0.load(Ordering::Acquire)
    }

    /// The peer bumps the ring's futex word with each message.
    fn ticket_moves_on_arrival(&self) -> bool {
        true
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
