//! Sharing one side of a connection between the processes that hold it
//! after `fork()`: the part of the fabric contract that only fork needs.
//!
//! `fork()` copies a connection's side, engine and endpoint alike, into the
//! child. At most one process may drive it at a time, so the fabric keeps
//! an **arbiter** the copies share (shm: the owner word in the segment;
//! verbs: a page of `MAP_SHARED` memory): a fork freezes it, and the first
//! process to use the connection claims it. The others reach the
//! connection through the one that runs it, or ask it to move the stream
//! onto the TCP socket beneath, which the kernel shares between them
//! ([`Sharing::request_leave`], [`Sharing::mark_left`]). A process that
//! holds the connection without running it notes itself an **heir**: if
//! the runner dies, the peer moves the stream onto TCP for it
//! ([`Sharing::mark_peer_left`]).
//!
//! Each copy's own view (whose threads drive it, since when it is frozen, a
//! `close()` that came meanwhile) is [`crate::driver::ownership`]'s, built
//! on these words. docs/shim.md ("fork") tells the whole story.

/// Who runs one side of a connection (see [`Sharing::ownership`]).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Ownership {
    /// This process.
    Mine,
    /// Frozen since a fork; the first of the processes to claim it gets it.
    Unclaimed,
    /// Another process claimed it: this copy must not touch the fabric.
    Other,
}

/// The words the processes sharing one side after `fork()` leave each
/// other (see the module). Every method takes `&self`: the words live in
/// memory the processes share, and any thread may read them.
pub trait Sharing {
    /// Which process runs this side of the connection. After `fork()` both
    /// processes hold it: it is frozen ([`Ownership::Unclaimed`]) until one
    /// of them [`Sharing::claim`]s it.
    fn ownership(&self) -> Ownership {
        Ownership::Mine
    }
    /// A fork is about to copy this side into a child: freeze it.
    fn freeze(&self) {}
    /// Take an unclaimed side for this process; whether it is ours now.
    fn claim(&self) -> bool {
        true
    }
    /// A process that shares this side after a fork, but does not run it,
    /// wants to use the connection: ask the one that runs it to move it
    /// onto the TCP socket beneath (which the kernel shares between them).
    fn request_leave(&self) {}
    /// Has a process sharing this side asked for that?
    fn leave_requested(&self) -> bool {
        false
    }
    /// This side moved onto TCP: the processes sharing it may use the
    /// socket.
    fn mark_left(&self) {}
    /// Has the process running this side moved it onto TCP?
    fn has_left(&self) -> bool {
        false
    }
    /// The peer's process died and this side moved the stream onto TCP for
    /// the processes of the peer's side that carry on (its heirs): tell
    /// them, as that process would have.
    fn mark_peer_left(&self) {}
    /// This process, which shares its side after a fork but does not run
    /// it, holds the connection: if the process running it dies, the peer
    /// moves the stream onto TCP for it (see
    /// [`super::FabricEvent::PeerGone`]).
    fn note_heir(&self) {}
}

/// A side no fork can share: this process runs it, always.
#[derive(Clone, Copy, Debug, Default)]
pub struct Unshared;

impl Sharing for Unshared {}
