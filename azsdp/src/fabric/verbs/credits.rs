//! SDP-style receive credits for the `verbs` fabric (no system calls:
//! tested on its own).
//!
//! Each side posts `ring` receives of one slot each. A SEND consumes one of
//! the peer's; a side may send only while it knows of a posted receive
//! (its *credits*), and each header returns the receives reposted since
//! the last one. The last credit is kept for a SEND that returns credits,
//! so two sides that both wait for credits always have one left to tell
//! each other (SDP's rule); a side returns credits on their own when half
//! its ring is waiting to be returned and nothing else carries them.

use thiserror::Error;

#[derive(Clone, Copy, Debug, PartialEq, Eq, Error)]
#[error("the peer returned {returned} credits with {held} held of a ring of {ring}")]
pub struct TooManyCredits {
    pub returned: u16,
    pub held: u16,
    pub ring: u16,
}

/// The fewest receives a side may post (see [`Credits::want_credits_only`]).
pub const MIN_RING: u16 = 3;

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Credits {
    /// Receives the peer posted (its ring size).
    peer_ring: u16,
    /// Receives of ours.
    ring: u16,
    /// The peer's receives we may still send into.
    held: u16,
    /// Our receives reposted and not yet returned.
    unreturned: u16,
}

impl Credits {
    /// At the start every receive of both sides is posted.
    pub fn new(ring: u16, peer_ring: u16) -> Credits {
        Credits {
            peer_ring,
            ring,
            held: peer_ring,
            unreturned: 0,
        }
    }

    /// May a message go now? (It keeps the last credit for one that
    /// returns some.)
    pub fn may_send_message(&self) -> bool {
        self.held >= 2 || (self.held == 1 && self.unreturned > 0)
    }

    /// Should a credits-only SEND go now? When half our ring waits to be
    /// returned, and at least two receives: a credits-only SEND consumes
    /// one of the peer's, which must not by itself make the peer answer
    /// with one (the two would trade credits-only SENDs for ever). Rings
    /// have at least [`MIN_RING`] receives, so a peer that holds its last
    /// credit has left us two to return.
    pub fn want_credits_only(&self) -> bool {
        self.held >= 1 && self.unreturned >= (self.ring / 2).max(2)
    }

    /// A SEND is posted: it takes a credit and carries what is unreturned
    /// (the value for its header).
    pub fn on_send(&mut self) -> u16 {
        debug_assert!(self.held > 0);
        self.held -= 1;
        std::mem::take(&mut self.unreturned)
    }

    /// A SEND came with `returned` credits.
    pub fn on_returned(&mut self, returned: u16) -> Result<(), TooManyCredits> {
        match self.held.checked_add(returned) {
            Some(h) if h <= self.peer_ring => {
                self.held = h;
                Ok(())
            }
            _ => Err(TooManyCredits {
                returned,
                held: self.held,
                ring: self.peer_ring,
            }),
        }
    }

    /// One of our receives was consumed and is posted again.
    pub fn on_reposted(&mut self) {
        self.unreturned = (self.unreturned + 1).min(self.ring);
    }

    pub fn held(&self) -> u16 {
        self.held
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;
    use std::collections::VecDeque;

    /// Two sides with random rings and random wishes to send: nothing is
    /// ever sent into a missing receive, and whoever wants to send gets to
    /// once the other side keeps taking in what arrives.
    fn exchange(ring: [u16; 2], steps: &[(bool, bool)]) {
        let mut c = [
            Credits::new(ring[0], ring[1]),
            Credits::new(ring[1], ring[0]),
        ];
        let mut posted = [ring[0], ring[1]];
        let mut wire: [VecDeque<(bool, u16)>; 2] = [VecDeque::new(), VecDeque::new()];
        let mut want = [0u32; 2];
        let step = |c: &mut [Credits; 2],
                    posted: &mut [u16; 2],
                    wire: &mut [VecDeque<(bool, u16)>; 2],
                    want: &mut [u32; 2],
                    s: usize,
                    deliver: bool| {
            let p = 1 - s;
            if want[s] > 0 && c[s].may_send_message() {
                want[s] -= 1;
                let r = c[s].on_send();
                assert!(posted[p] > 0, "sent into a missing receive");
                posted[p] -= 1;
                wire[s].push_back((true, r));
            } else if c[s].want_credits_only() {
                let r = c[s].on_send();
                assert!(posted[p] > 0, "credits sent into a missing receive");
                posted[p] -= 1;
                wire[s].push_back((false, r));
            }
            if deliver && let Some((_, r)) = wire[p].pop_front() {
                c[s].on_returned(r).unwrap();
                posted[s] += 1;
                c[s].on_reposted();
            }
        };
        for &(a, b) in steps {
            want[0] += u32::from(a);
            want[1] += u32::from(b);
            step(&mut c, &mut posted, &mut wire, &mut want, 0, true);
            step(&mut c, &mut posted, &mut wire, &mut want, 1, true);
        }
        // Both keep taking in: every wish is met (no deadlock).
        for _ in 0..100_000 {
            if want == [0, 0] && wire[0].is_empty() && wire[1].is_empty() {
                return;
            }
            step(&mut c, &mut posted, &mut wire, &mut want, 0, true);
            step(&mut c, &mut posted, &mut wire, &mut want, 1, true);
        }
        panic!("stuck: {c:?} want {want:?}");
    }

    proptest! {
        #[test]
        fn never_into_a_missing_receive_and_never_stuck(
            a in MIN_RING..40, b in MIN_RING..40,
            steps in proptest::collection::vec((any::<bool>(), any::<bool>()), 0..400),
        ) {
            exchange([a, b], &steps);
        }
    }

    #[test]
    fn a_peer_that_returns_more_than_it_could_is_caught() {
        let mut c = Credits::new(8, 8);
        assert!(c.on_returned(1).is_err());
        c.on_send();
        assert!(c.on_returned(1).is_ok());
        assert!(c.on_returned(u16::MAX).is_err());
    }

    #[test]
    fn the_last_credit_waits_for_credits_to_return() {
        let mut c = Credits::new(4, 3);
        assert!(c.may_send_message());
        c.on_send();
        c.on_send();
        assert!(!c.may_send_message());
        c.on_reposted();
        assert!(c.may_send_message(), "it carries a credit back");
    }
}
