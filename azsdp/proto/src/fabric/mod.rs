//! The fabric: the contract a transport implements for the driver.
//!
//! Shaped after verbs, so that an RDMA NIC implements it as directly as
//! shared memory does:
//!
//! - **registration is posted and completed** ([`Fabric::post_register`],
//!   [`OpResult::Registered`]), and every GET names a key on both sides: the
//!   peer's for the source ([`RemoteBuf`]), ours for the destination
//!   ([`LocalBuf`]);
//! - **messages** are ordered, reliable and whole, with transport credits
//!   ([`Fabric::send_credits`]): the driver posts only what they allow, so
//!   a slow peer pushes back into the engine and from there to `send()`;
//! - **one-sided** GET (RDMA READ) and 64-bit compare-and-swap on lock words;
//! - a **pool** of fabric-owned memory that the peer can GET from, for the
//!   copies copy-on-write makes ([`Fabric::pool_alloc`]);
//! - **one waiter** for messages and completions alike ([`FabricWaiter`]),
//!   which a reactor can sleep on with other connections' (`fd`);
//! - **revocation** ([`Fabric::revoke_access`]): every key this side handed
//!   out stops working at once, while messages still flow (a NIC
//!   invalidates its rkeys or memory windows; it does not move the queue
//!   pair to error, which would kill the messages too).
//!
//! Providers: [`sim`] (deterministic, seeded, for tests), `shm` in the
//! `azsdp` crate (intra-host: rings in a memfd, GET = `process_vm_readv`);
//! `verbs` (rdma-core) comes with the verbs issue.

pub mod sharing;
pub mod sim;

pub use sharing::{Ownership, Sharing, Unshared};

pub use crate::conn::Departure;
use crate::conn::{CasTarget, LockRegion, OpError, OpId, RemoteBuf};
use thiserror::Error;

/// Local memory as a GET destination: an address and the key of the
/// registration that covers it (for a NIC, the lkey).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct LocalBuf {
    pub addr: u64,
    pub key: u32,
}

/// What a registration lets happen to the memory.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum RegAccess {
    /// The peer may GET from it (its key goes to the peer: an rkey).
    PeerRead,
    /// Our own GETs may land in it (its key stays here: an lkey).
    LocalWrite,
}

/// Why the fabric refused to start an operation.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Error)]
pub enum FabricError {
    /// No transport credit: the peer's ring is full. Retry after [`Fabric::poll`].
    #[error("no transport credit")]
    NoCredits,
    /// The message is larger than the peer's receive slot.
    #[error("message too large")]
    TooLarge,
    /// The connection is broken.
    #[error("fabric connection broken")]
    Broken,
    /// This provider cannot do that.
    #[error("operation not supported by this fabric")]
    Unsupported,
}

/// Result of a one-sided operation.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum OpResult {
    /// A posted registration: its key, or why it failed.
    Registered(Result<u32, OpError>),
    Get(Result<(), OpError>),
    Cas(Result<u64, OpError>),
}

/// Something the fabric reports.
#[derive(Debug)]
pub enum FabricEvent<'a> {
    /// A message from the peer, valid for the duration of the callback.
    Message(&'a [u8]),
    /// A one-sided operation finished.
    Done { op: OpId, result: OpResult },
    /// The peer died or the link failed; nothing more will arrive. With
    /// how far the peer's stream and ours had got when it left, if the
    /// fabric knows: the engine can then tell a loss-free end (EOF, as
    /// TCP's FIN) from one that lost data either way (a reset, as the RST
    /// a TCP peer that dies with data unread sends).
    ///
    /// `heir`: the process that ran the peer's side is gone, but another
    /// process of that side holds the connection and carries on (it was
    /// forked with it: its calls went through the one that died). The
    /// engine then moves the stream onto TCP for it, alone, if nothing was
    /// lost (see `Connection::handle_peer_left`).
    PeerGone { left: Option<Departure>, heir: bool },
}

/// Waits for a fabric endpoint's events, messages and completions alike,
/// without borrowing it, so that a thread can sleep while others use the
/// endpoint (behind the driver's lock).
///
/// No wake-up is lost: take a ticket with [`FabricWaiter::prepare`] *before*
/// checking whether there is anything to do, then [`FabricWaiter::wait`]
/// with it returns at once if a message or a kick came in between.
pub trait FabricWaiter: Send + Sync {
    fn prepare(&self) -> u32;
    /// Sleep until a message may have arrived or a kick was made since
    /// `ticket`, or `timeout` passes (it may return early). With `spin`,
    /// busy-poll for the provider's polling time first (for callers that
    /// want latency; background threads should not burn a core).
    fn wait(&self, ticket: u32, timeout: std::time::Duration, spin: bool);
    /// Sleep until a message is published or a kick made after `ticket`,
    /// or `timeout` passes, even if unread messages are waiting (another
    /// thread is reading them).
    fn sleep(&self, ticket: u32, timeout: std::time::Duration);
    /// Wake this process's threads sleeping in [`FabricWaiter::wait`]: a
    /// thread turned the engine for them (e.g. finished their call).
    fn kick(&self);
    /// A descriptor a reactor can poll instead of sleeping here (one
    /// thread watching many endpoints): it polls readable or hung up once
    /// the endpoint is [`Fabric::arm`]ed and an event comes, or the peer
    /// is gone. `None`: this waiter can only be slept on.
    fn fd(&self) -> Option<i32> {
        None
    }
    /// Does the ticket of [`FabricWaiter::prepare`] move when a message
    /// arrives, with no one waiting (a counter the sender bumps in memory
    /// both see)? Then a loop that compares tickets at each of its waits
    /// hears of messages by itself; otherwise only a wait or a kick moves
    /// it, and the reactor must watch.
    fn ticket_moves_on_arrival(&self) -> bool {
        false
    }
}

/// A verbs-like fabric endpoint (one per connection).
pub trait Fabric {
    /// Where this side's lock words live, for the peer's compare-and-swap.
    fn lock_region(&self) -> LockRegion;
    /// Register `[addr, addr+len)` for `access`. Completes with
    /// [`OpResult::Registered`] and the key (an rkey for
    /// [`RegAccess::PeerRead`], an lkey for [`RegAccess::LocalWrite`]);
    /// a provider may complete it before this returns (it then says so in
    /// [`Fabric::completions_pending`]).
    fn post_register(
        &mut self,
        op: OpId,
        addr: u64,
        len: u64,
        access: RegAccess,
    ) -> Result<(), FabricError>;
    /// Withdraw a registration: from now on its key works no more.
    fn deregister(&mut self, key: u32);
    /// Before pages of `range` move (armed, or staging pages landed:
    /// `UFFDIO_MOVE`, which the kernel refuses, or on some kernels retries
    /// for ever, while a page of the same huge page is pinned): let go of
    /// the pins this fabric keeps near it for its own sake (a registration
    /// cache). `false` if some it cannot let go of (one in use) remain,
    /// and arming must not be tried.
    fn unpin_near(&mut self, _range: std::ops::Range<u64>) -> bool {
        true
    }
    /// Transport credit: can a message of up to `len` bytes be posted now
    /// without [`FabricError::NoCredits`]? (A broken fabric says yes: the
    /// post then fails at once.)
    fn has_room(&self, len: usize) -> bool;
    /// Post a message; delivered whole, in order, exactly once, unless broken.
    fn post_message(&mut self, msg: &[u8]) -> Result<(), FabricError>;
    /// Read `len` bytes at `src` in the peer's memory into `dst`, which a
    /// [`RegAccess::LocalWrite`] registration covers.
    fn post_get(
        &mut self,
        op: OpId,
        src: RemoteBuf,
        dst: LocalBuf,
        len: u64,
    ) -> Result<(), FabricError>;
    /// Atomic compare-and-swap on a lock word; the result is the old value.
    fn post_cas(
        &mut self,
        op: OpId,
        target: CasTarget,
        expect: u64,
        new: u64,
    ) -> Result<(), FabricError>;
    /// Memory the fabric owns and the peer can GET from once registered:
    /// `len` bytes for a copy that copy-on-write makes. Returns its address.
    fn pool_alloc(&mut self, len: u64) -> Result<u64, OpError>;
    /// Fill `len` bytes of pool memory at `addr` (from [`Fabric::pool_alloc`]).
    fn pool_fill(&mut self, addr: u64, len: u64, fill: &mut dyn FnMut(&mut [u8]));
    /// Give pool memory back (its registration is withdrawn first).
    fn pool_free(&mut self, addr: u64, len: u64);
    /// Revocation: every key this side handed out stops working at once,
    /// so no peer GET or compare-and-swap on this side's memory succeeds
    /// from now on, including those in flight. Messages still flow.
    fn revoke_access(&mut self);
    /// Deliver what is ready; returns how many events were delivered.
    ///
    /// Every GET and compare-and-swap posted completes here, with an error
    /// if need be, in bounded time once the peer is gone (or a while after
    /// [`Fabric::revoke_access`]): a receive whose GET writes into its
    /// buffer waits for it.
    fn poll(&mut self, on_event: &mut dyn FnMut(FabricEvent<'_>)) -> usize;
    /// Block until something may be ready to poll, or `timeout` passes.
    fn wait(&self, timeout: std::time::Duration);
    /// A reactor is about to stop looking at this endpoint until its
    /// waiter's [`FabricWaiter::fd`] fires: make the next event fire it.
    /// `fired`: the fd fired since the last call (take what it holds).
    /// [`Armed::Ready`] if something may be ready already (poll again
    /// before sleeping, or the wake-up is lost).
    fn arm(&mut self, _fired: bool) -> Armed {
        Armed::Ready
    }
    /// Are completions of operations already posted waiting for
    /// [`Fabric::poll`]? (A provider that completes some at once, as shm
    /// does, says so: no message or interrupt will announce them.)
    fn completions_pending(&self) -> bool {
        false
    }
    /// Do GETs move data while the posting thread goes on (as a NIC's DMA
    /// does)? If not, an armed receive has landed before `recv()` could
    /// return, and arming is pure cost: `recv_protect = "auto"` stays off.
    fn gets_async(&self) -> bool {
        false
    }
    /// How the processes that hold this side after `fork()` share it
    /// (see [`Sharing`]). A provider whose endpoints never outlive their
    /// process's fork keeps the default: one process, always.
    fn sharing(&self) -> &dyn Sharing {
        &Unshared
    }
    /// This side is done (its connection finished, or is dropped): nothing
    /// more will come from it or be read by it, and the peer may learn so
    /// at once.
    fn finish(&self) {}
    /// Record how far our `send()` and `recv()` calls have got (the peer
    /// learns it with [`FabricEvent::PeerGone`] if we die).
    fn publish_progress(&mut self, _progress: Departure) {}
    /// Can the fabric vouch, now, that the peer's side is alive, whatever
    /// its program and engine do (its process exists; its NIC or kernel
    /// answered lately)? Asked when the peer has been silent for
    /// `peer_timeout`: a vouched-for peer is waited for, as TCP waits for
    /// a peer whose kernel answers. `false`: nothing known (the engine's
    /// pings decide).
    fn peer_vouched(&mut self) -> bool {
        false
    }
}

/// What [`Fabric::arm`] found.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Armed {
    /// Nothing waiting: sleep until the waiter's fd fires.
    Sleep,
    /// Something may be waiting: poll before sleeping.
    Ready,
    /// The fd would fire for good (the channel behind it hung up): watch
    /// timers only.
    Deaf,
}
