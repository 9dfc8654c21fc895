//! What the preload shim asks of a transport when it pairs two ends of a
//! TCP connection: the contract that shm implements now, and verbs and the
//! daemon-brokered transport will.
//!
//! The shim owns the pairing *protocol* (the registry, who may pair with
//! whom, the kernel's word on who holds which socket, the commit-or-withdraw
//! agreement); the transport owns what the two sides exchange to build
//! their fabric and the endpoint they then run:
//!
//! 1. the connecting side makes an [`Offer`] ([`Transport::offer`]) and
//!    sends its descriptors with its offer message;
//! 2. the accepting side joins it ([`Transport::join`] with those
//!    descriptors) and answers with the [`Join`]'s descriptors;
//! 3. both agree on a word the offer made ([`Offer::agreement`]), and each
//!    turns its half into an [`Endpoint`].
//!
//! Every identity a decision rests on comes with the messages from the
//! kernel ([`PeerId`]); a transport never takes one from the peer's bytes.

use std::os::fd::{BorrowedFd, OwnedFd};
use std::sync::atomic::AtomicU32;

use crate::fabric::{FabricWaiter, Watched};
use crate::identity::PeerId;
use crate::pairing::BellNote;

/// A way to join two processes' ends of a connection.
pub trait Transport {
    /// The fabric endpoint each side runs.
    type Endpoint: Endpoint;
    /// The connecting side's half before the peer joined.
    type Offer: Offer<Endpoint = Self::Endpoint>;
    /// The accepting side's half, joined to an offer.
    type Join: Join<Endpoint = Self::Endpoint>;

    /// Make an offer for the process `to` (its pid, as the kernel says; 0:
    /// not known). Its note and descriptors go with the offer message.
    fn offer(&self, to: u32) -> std::io::Result<Self::Offer>;
    /// Join the offer of the verified `peer` that said `offered` and came
    /// with `fds` (after the sender's pidfd). Anything malformed is an
    /// error, never a panic: the peer wrote it.
    fn join(
        &self,
        offered: Option<BellNote>,
        peer: &PeerId,
        fds: Vec<OwnedFd>,
    ) -> std::io::Result<Self::Join>;
}

/// The connecting side's half of a pair.
pub trait Offer {
    type Endpoint: Endpoint;
    /// What the offer message says of the sender's process (shm: its bell).
    fn note(&self) -> Option<BellNote> {
        None
    }
    /// What the offer message carries.
    fn fds(&self) -> Vec<BorrowedFd<'_>>;
    /// A word both sides share, 0 at first, that the pairing code agrees on
    /// (by compare-and-swap) whether the pair goes ahead.
    fn agreement(&self) -> &AtomicU32;
    /// Give up on a pair the peer may already have committed to: the
    /// peer's engine sees this side leave.
    fn abandon(self);
    /// The verified `peer` answered `answer` with `fds` (after its pidfd
    /// and the accepted socket): run this side.
    fn into_endpoint(
        self,
        answer: Option<BellNote>,
        fds: Vec<OwnedFd>,
        peer: PeerId,
        peer_page_size: u32,
    ) -> std::io::Result<Self::Endpoint>;
}

/// The accepting side's half of a pair.
pub trait Join {
    type Endpoint: Endpoint;
    /// What the answer says of the sender's process (shm: its bell).
    fn note(&self) -> Option<BellNote> {
        None
    }
    /// What the answer carries after the accepted socket.
    fn fds(&self) -> Vec<BorrowedFd<'_>>;
    /// See [`Offer::agreement`].
    fn agreement(&self) -> &AtomicU32;
    /// Run this side, with the verified offering `peer`.
    fn into_endpoint(self, peer: PeerId, peer_page_size: u32) -> std::io::Result<Self::Endpoint>;
}

/// A paired endpoint, as the shim runs it.
pub trait Endpoint: Watched + Send + 'static {
    type Waiter: FabricWaiter + 'static;
    /// A waiter for its events that does not borrow it.
    fn waiter(&self) -> Self::Waiter;
    /// The (verified) process running the peer side.
    fn peer_pid(&self) -> u32;
    /// May this side GET from the peer (`None`), or why not.
    fn get_refused(&self) -> Option<String>;
    /// Is the peer of our own user? (Only then are our pages advertised.)
    fn same_user(&self) -> bool;
    /// May a receive's destination pages be armed (receive-side
    /// protection) on this fabric?
    fn arms_receives(&self) -> bool {
        true
    }
    /// Is reading ahead of the program (`read_ahead`, a copy at the
    /// receiver) worth it on this fabric? Not where a GET is a CPU copy
    /// already (shm); where it is a NIC's READ whose round trip idles the
    /// link between zero-copy receives (verbs).
    fn reads_ahead(&self) -> bool {
        false
    }
    /// See [`Offer::agreement`].
    fn agreement(&self) -> &AtomicU32;
}
