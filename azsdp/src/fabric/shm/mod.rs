//! The `shm` fabric: two processes on one host.
//!
//! A `memfd` segment, mapped by both, holds a [`Ring`] per direction for
//! messages, each side's lock words (so the peer's compare-and-swap is a real
//! atomic on shared memory, one-sided as on a NIC), each side's table of
//! registrations, and per-side flags. GET is one `process_vm_readv` from the
//! peer's pages straight into the destination (the intra-host RDMA READ: one
//! copy, no peer involvement). A side that waits polls for a while, then
//! sleeps on a futex in the segment.
//!
//! **Trust.** The peer can write every byte of the segment at any time, so
//! nothing read from it is trusted beyond the connection it belongs to:
//! ring positions and lengths are checked on every access (a corrupted ring
//! ends the connection), the header's sizes are read once and checked at
//! [`ShmJoin::open`], and the segment is sealed against shrinking (a peer
//! could otherwise truncate it under us). Who the peer *is* comes only from
//! the kernel ([`crate::identity`]): the process whose memory GETs read is
//! the one whose credentials and pidfd came with its pairing message,
//! pinned by that pidfd; a process that takes the peer's side over after a
//! fork is followed only when it says so on our bell with its own kernel
//! identity ([`IntroKind::Claim`]), never because a word in the segment
//! names it.
//!
//! **Keys.** Every GET names a key, and the reader checks it against the
//! owner's registration table in the segment, as an RNIC checks an rkey: the
//! key must be live, and the range inside the registered one, before the
//! read and still after it (a registration withdrawn meanwhile voids the
//! read, as does the pinned process having exited, which could have freed
//! its pid for another). A peer can only make us read its own memory; one
//! of another user is never read at all ([`NoGet::OtherUser`]). While the
//! owner word says another process took the peer's side and its claim has
//! not come, GETs wait for it (then fail): neither process is read.
//!
//! **Waking.** A side that waits busy-polls, then sleeps on a futex in the
//! segment; a side no call waits on is its process's reactor's
//! ([`crate::driver::reactor`]), which *arms* the ring (a flag in it) and
//! sleeps. The peer that posts to an armed ring takes the flag and rings the
//! reactor's bell with the token that side published in the header: one
//! datagram on a socket every peer of that process holds. So a connection
//! holds no descriptor of its own: one bell per process, one pidfd and one
//! bell per peer process, shared by all connections to it.
//!
//! Bootstrap runs over a connected Unix socket: the side that makes the
//! segment ([`ShmOffer`]) sends it with an [`IntroKind::Offer`] and its
//! process's bell; the other ([`ShmJoin`]) maps it and answers with its own
//! bell. A process that promised to keep a peer process's bell is only
//! told its name after that ([`bells`]). Both messages carry the sender's kernel identity, and the socket
//! is done with after them. A process that takes a side over after a fork
//! says so on the peer's bell, as mail with its own kernel identity and
//! bell ([`IntroKind::Claim`]). [`ShmEndpoint::offer`] and
//! [`ShmEndpoint::accept`] do the whole exchange for programs that own both
//! ends' setup; the preload shim runs the same steps inside `connect()` and
//! `accept()` with its own checks between them.
//!
//! `unsafe` here: mapping the segment, atomics and futexes on shared memory,
//! and the raw destination of GETs (application memory named by address).

mod access;
#[doc(hidden)]
pub mod adversary;
pub mod bells;
mod bootstrap;
mod endpoint;
mod liveness;
pub mod loop_bell;
mod park;
mod sealed;
mod segment;
mod waiter;

pub use access::NoGet;
pub use bells::bell_id;
pub use bootstrap::{
    IntroError, ShmJoin, ShmJoined, ShmOffer, ShmOffered, ShmTransport, recv_intro, recv_note,
    send_intro, send_note,
};
pub use endpoint::ShmEndpoint;
pub use park::ParkedEndpoint;
pub use segment::{MAX_RING, ShmParams};
pub use waiter::{RingsHeld, ShmWaiter, hold_rings};

#[cfg(test)]
mod tests;
