//! Waking and waiting: the peer's futex and doorbell, busy-polling that
//! pays, and the waiter a thread or the reactor sleeps on.

use std::os::fd::AsFd;
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
    /// reactor's doorbell if it is armed (`force`: whatever they do).
    pub(super) fn wake_peer(&self, force: bool) {
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
