//! Which user the kernel said owns the listener a destination reaches,
//! remembered for a moment.
//!
//! Before a client offers, the kernel must say that the registry's owner
//! owns the listening socket (`sock_diag::listener_reached`): a question
//! per connection, which a burst of connections to one server asks
//! thousands of times a second with the same answer. A proof is kept for
//! [`PROOF_LIFE`], keyed by the network namespace, the destination *and*
//! the owner's uid, so it vouches only for the user it was made for: a
//! registry held by anyone else is asked about afresh. What a stale proof can cost is bounded: the
//! listener's answer must still hold the far end of our very connection
//! (the kernel's cookie), or the connection stays on TCP and the proof is
//! dropped ([`ProvenListeners::forget`]).
//!
//! No system calls: the caller gives the time.

use std::net::SocketAddr;
use std::time::{Duration, Instant};

/// How long a proof holds.
pub const PROOF_LIFE: Duration = Duration::from_secs(1);
/// Proofs kept at most (the oldest goes first).
pub const KEPT: usize = 64;

#[derive(Debug)]
struct Proof {
    netns: u64,
    dst: SocketAddr,
    uid: u32,
    at: Instant,
}

/// The proofs of one process.
#[derive(Debug, Default)]
pub struct ProvenListeners {
    proofs: Vec<Proof>,
}

impl ProvenListeners {
    pub const fn new() -> Self {
        ProvenListeners { proofs: Vec::new() }
    }

    /// Did the kernel of network namespace `netns` (its cookie) say, less
    /// than [`PROOF_LIFE`] before `now`, that `uid` owns the listener `dst`
    /// reaches?
    pub fn holds(&self, netns: u64, dst: SocketAddr, uid: u32, now: Instant) -> bool {
        self.proofs.iter().any(|p| {
            p.netns == netns
                && p.dst == dst
                && p.uid == uid
                && now.saturating_duration_since(p.at) < PROOF_LIFE
        })
    }

    /// The kernel said so at `now`.
    pub fn proven(&mut self, netns: u64, dst: SocketAddr, uid: u32, now: Instant) {
        self.proofs.retain(|p| {
            !(p.netns == netns && p.dst == dst) && now.saturating_duration_since(p.at) < PROOF_LIFE
        });
        if self.proofs.len() >= KEPT {
            self.proofs.remove(0);
        }
        self.proofs.push(Proof {
            netns,
            dst,
            uid,
            at: now,
        });
    }

    /// Something about `dst` did not hold up: ask the kernel next time (in
    /// every namespace).
    pub fn forget(&mut self, dst: SocketAddr) {
        self.proofs.retain(|p| p.dst != dst);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const NS: u64 = 4096;

    fn addr(port: u16) -> SocketAddr {
        ([127, 0, 0, 1], port).into()
    }

    #[test]
    fn a_proof_holds_for_its_user_and_destination_for_a_moment() {
        let t0 = Instant::now();
        let mut p = ProvenListeners::new();
        assert!(!p.holds(NS, addr(80), 1000, t0));
        p.proven(NS, addr(80), 1000, t0);
        // Another namespace's kernel said nothing of it.
        assert!(!p.holds(NS + 1, addr(80), 1000, t0));
        assert!(p.holds(NS, addr(80), 1000, t0 + PROOF_LIFE / 2));
        // Another user's registry, another destination: not vouched for.
        assert!(!p.holds(NS, addr(80), 1001, t0));
        assert!(!p.holds(NS, addr(81), 1000, t0));
        // Stale.
        assert!(!p.holds(NS, addr(80), 1000, t0 + PROOF_LIFE));
        // A new proof for the destination replaces the old one, whoever
        // it names.
        p.proven(NS, addr(80), 1001, t0 + PROOF_LIFE / 2);
        assert!(!p.holds(NS, addr(80), 1000, t0 + PROOF_LIFE / 2));
        assert!(p.holds(NS, addr(80), 1001, t0 + PROOF_LIFE / 2));
        p.forget(addr(80));
        assert!(!p.holds(NS, addr(80), 1001, t0 + PROOF_LIFE / 2));
    }

    #[test]
    fn proofs_are_bounded_and_the_oldest_goes() {
        let t0 = Instant::now();
        let mut p = ProvenListeners::new();
        for i in 0..(KEPT as u16 + 10) {
            p.proven(
                NS,
                addr(1000 + i),
                7,
                t0 + Duration::from_micros(u64::from(i)),
            );
        }
        assert_eq!(p.proofs.len(), KEPT);
        assert!(!p.holds(NS, addr(1000), 7, t0));
        assert!(p.holds(NS, addr(1000 + KEPT as u16 + 9), 7, t0));
    }
}
