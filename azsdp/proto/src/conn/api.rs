//! The engine's vocabulary: what drivers hand it and what it asks of them.

use std::fmt;
use std::ops::Range;

use thiserror::Error;

use crate::wire::{AbortCode, MsgType, WireError};

/// A blocked application call (one thread inside `send`/`recv`), named by the driver.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct CallId(pub u64);

/// A fabric or host operation the engine started, named by the engine
/// (counting up from 1; the driver names its own steps from 2^63).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct OpId(pub u64);

/// A blocked memory access (a fault) or a memory-lifetime request, named by the driver.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct Ticket(pub u64);

/// An application buffer: an address in the application's memory and a length.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct UserBuf {
    pub addr: u64,
    pub len: u64,
}

impl UserBuf {
    pub fn range(&self) -> Range<u64> {
        self.addr..self.addr.saturating_add(self.len)
    }
}

/// How a `send()` may proceed.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct SendFlags {
    /// O_NONBLOCK or MSG_DONTWAIT: never wait for the peer.
    pub nonblocking: bool,
    /// The driver may write-protect the buffer's whole pages (anonymous, private,
    /// not a main-thread stack). If false, zero-copy sends of it are synchronous.
    pub protectable: bool,
    /// Why not, when the driver found out (for the counters).
    pub unprotectable: Option<Unprotectable>,
}

/// Why a buffer's whole pages cannot be write-protected.
#[derive(Clone, Copy, Debug, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub enum Unprotectable {
    /// This process has no page protection (no full userfaultfd).
    NoProtector,
    /// A mapping of a file (shared, or private and not converted).
    File,
    /// Memory another process may map.
    Shared,
    /// The main thread's stack.
    MainStack,
    /// Read-only memory.
    ReadOnly,
    /// Anything else (vdso, not mapped).
    Other,
}

impl Unprotectable {
    pub const ALL: [Unprotectable; 6] = [
        Unprotectable::NoProtector,
        Unprotectable::File,
        Unprotectable::Shared,
        Unprotectable::MainStack,
        Unprotectable::ReadOnly,
        Unprotectable::Other,
    ];

    /// The name `azsdp stat` and the log give it.
    pub fn name(self) -> &'static str {
        match self {
            Unprotectable::NoProtector => "no-protection",
            Unprotectable::File => "file-mapping",
            Unprotectable::Shared => "shared-memory",
            Unprotectable::MainStack => "main-stack",
            Unprotectable::ReadOnly => "read-only",
            Unprotectable::Other => "other-memory",
        }
    }
}

/// How a `recv()` may proceed.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct RecvFlags {
    pub nonblocking: bool,
    /// MSG_PEEK: copy without consuming.
    pub peek: bool,
    /// MSG_WAITALL: wait for the whole length (or EOF / error).
    pub waitall: bool,
    /// The driver may arm the buffer's whole pages (receive-side protection).
    pub armable: bool,
}

/// A memory access that faulted.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Access {
    Read,
    Write,
}

/// Copies between the application's memory and the engine's buffers.
///
/// The engine calls it only for ranges it knows are not protected by itself,
/// and only on behalf of a call that is blocked (so the range is stable).
pub trait UserMemory {
    fn read(&mut self, addr: u64, out: &mut [u8]);
    fn write(&mut self, addr: u64, data: &[u8]);
    /// Copy `len` bytes from `from` to `to` (staging memory of the
    /// fabric's pool into a receive buffer).
    fn copy(&mut self, from: u64, to: u64, len: usize) {
        let mut b = vec![0u8; len];
        self.read(from, &mut b);
        self.write(to, &b);
    }
}

/// Memory of the peer, as advertised: an address and the key that guards it.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, serde::Serialize, serde::Deserialize)]
pub struct RemoteBuf {
    pub addr: u64,
    pub key: u32,
}

/// Which lock word a compare-and-swap targets.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum CasTarget {
    /// One of this side's own lock words (the sink takes and releases them).
    Local { slot: u16 },
    /// A lock word in the peer's memory (the source, on a write fault).
    Remote { addr: u64, key: u32 },
}

/// What became of the data of an armed receive.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum DisarmOutcome {
    /// The data is in place; the pages are ordinary memory again.
    Landed,
    /// The transfer failed: the data the application was promised will not
    /// arrive. Drivers make a later touch of these pages fail loudly (SIGBUS).
    Lost,
    /// The receive failed before returning; the pages hold no promised data.
    Abandoned,
}

/// What the engine asks the driver to do. Drivers execute actions in order.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Action {
    /// Write-protect the listed ranges (whole pages), then register
    /// `[addr, addr+len)` for the peer's GET. Answer with
    /// [`Completion::Prepared`] and the key; a failure must leave nothing
    /// protected.
    PrepareSource {
        op: OpId,
        addr: u64,
        len: u64,
        protect: Vec<Range<u64>>,
    },
    /// `[addr, addr+len)` is no longer advertised under `key`.
    ReleaseSource { addr: u64, len: u64, key: u32 },
    /// Lift write protection from these whole pages.
    Unprotect { range: Range<u64> },
    /// Arm these whole pages for an early-returning receive: any access blocks
    /// (reported as a fault) until the data lands. Answer with [`Completion::Armed`].
    Arm { op: OpId, range: Range<u64> },
    /// The armed pages are ordinary memory again.
    Disarm {
        range: Range<u64>,
        outcome: DisarmOutcome,
    },
    /// One-sided read of `len` bytes from the peer into local memory (the
    /// driver registers the destination for it). With `armed`, the
    /// destination pages are armed: the data lands in the protector's
    /// staging pages, moved into place when the read completes.
    Get {
        op: OpId,
        src: RemoteBuf,
        dst: u64,
        len: u64,
        armed: bool,
    },
    /// 64-bit compare-and-swap. Answer with [`Completion::Cas`] (the old value).
    Cas {
        op: OpId,
        target: CasTarget,
        expect: u64,
        new: u64,
    },
    /// Copy `[addr, addr+len)` into memory the peer can GET (the fabric's
    /// pool, registered for the peer): copy-on-write. Answer with
    /// [`Completion::Copied`].
    CopyAside { op: OpId, addr: u64, len: u64 },
    /// A private copy made by `CopyAside` is no longer needed.
    ReleaseCopy { buf: RemoteBuf, len: u64 },
    /// Take `len` bytes of the fabric's pool, for data read ahead of the
    /// program (GET into it with [`Action::Get`]). Answer with
    /// [`Completion::Pooled`].
    PoolAlloc { op: OpId, len: u64 },
    /// Memory of [`Action::PoolAlloc`] is no longer needed (no GET writes
    /// into it any more).
    PoolFree { addr: u64, len: u64 },
    /// After this, no peer operation on this side's memory may succeed: the
    /// fabric invalidates every key this side handed out (in-flight
    /// operations included). Executed before an abort unprotects pages.
    /// Messages still flow.
    RevokeAccess,
    /// An application call finished.
    CallDone {
        call: CallId,
        result: Result<u64, CallError>,
    },
    /// A blocked access (fault or lifetime request) may proceed.
    Resume { ticket: Ticket },
    /// This side is about to send its SWITCH: is the TCP connection beneath
    /// still untouched (nothing arrived on it)? Answer with
    /// `Connection::stream_checked`. (The peer writes to it only after our
    /// SWITCH, so anything there now was written behind azsdp's back.)
    CheckStream,
    /// Both sides left the fabric (SWITCH both ways): write this side's
    /// stream from where the peer's application stopped to the TCP
    /// connection beneath, then call `Connection::resend_written` (or
    /// `Connection::stream_failed`). Until then the bytes stay where the
    /// pieces say.
    Resend(Resend),
}

/// What a side that leaves the fabric writes to the TCP connection beneath:
/// its stream from the first byte the peer's application has not consumed,
/// in order.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Resend {
    /// Stream offset of the first byte.
    pub from: u64,
    pub pieces: Vec<ResendPiece>,
    /// Our stream had ended (SHUTDOWN): shut the TCP connection's sending
    /// side once the pieces are written.
    pub shutdown: bool,
}

impl Resend {
    /// Bytes in all the pieces.
    pub fn len(&self) -> u64 {
        self.pieces.iter().map(ResendPiece::len).sum()
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }
}

/// One piece of a [`Resend`].
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum ResendPiece {
    /// Bytes the engine holds (sent by copy).
    Bytes(Vec<u8>),
    /// Bytes in this side's memory: an advertised buffer (still protected,
    /// or held by a blocked call) or a copy-on-write copy in the fabric's
    /// pool.
    Memory { addr: u64, len: u64 },
}

impl ResendPiece {
    pub fn len(&self) -> u64 {
        match self {
            ResendPiece::Bytes(b) => b.len() as u64,
            ResendPiece::Memory { len, .. } => *len,
        }
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }
}

/// Results the driver reports for operations the engine started.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Completion {
    Prepared(Result<u32, OpError>),
    Armed(Result<(), OpError>),
    Get(Result<(), OpError>),
    Cas(Result<u64, OpError>),
    Copied(Result<RemoteBuf, OpError>),
    /// The address of the pool memory taken.
    Pooled(Result<u64, OpError>),
}

/// Why an operation failed.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Error)]
pub enum OpError {
    /// The peer refused the access (bad key or address): it lied or forgot.
    #[error("remote access refused")]
    RemoteAccess,
    /// The peer or the link is gone.
    #[error("peer unreachable")]
    Unreachable,
    /// A local resource failed (registration, protection, memory).
    #[error("local resource failure")]
    Local,
    /// A registration was refused for the locked-memory limit
    /// (`RLIMIT_MEMLOCK`): the pages cannot be pinned.
    #[error("locked-memory limit reached")]
    PinLimit,
}

/// How an application call failed; drivers map these to errno.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Error)]
pub enum CallError {
    /// EAGAIN.
    #[error("operation would block")]
    WouldBlock,
    /// EINTR (cancelled before any byte moved).
    #[error("interrupted")]
    Interrupted,
    /// EPIPE: sending after shutdown or after the connection ended.
    #[error("broken pipe")]
    BrokenPipe,
    /// ECONNRESET.
    #[error("connection reset")]
    ConnReset,
    /// ETIMEDOUT.
    #[error("connection timed out")]
    TimedOut,
    /// The connection left the fabric for the TCP connection beneath: do
    /// the call again there. (Never seen by an application.)
    #[error("moved to the TCP connection")]
    Switched,
    /// This direction of a connection that began on TCP has not joined
    /// the fabric yet: make the call on TCP (`conn::join`). (Never seen by
    /// an application.)
    #[error("still on the TCP connection")]
    OnTcp,
}

/// A violation of the protocol by the peer.
#[derive(Clone, Debug, PartialEq, Eq, Error)]
pub enum ProtocolError {
    #[error("malformed message: {0}")]
    Wire(#[from] WireError),
    #[error("sequence number {got}, expected {expected}")]
    Sequence { expected: u32, got: u32 },
    #[error("{ty} not allowed {when}")]
    Unexpected { ty: MsgType, when: &'static str },
    #[error("{ty}: {why}")]
    Invalid { ty: MsgType, why: &'static str },
    #[error("{ty}: stream offset {got}, expected {expected}")]
    StreamOffset {
        ty: MsgType,
        expected: u64,
        got: u64,
    },
    #[error("{ty}: unknown advertisement id {id}")]
    UnknownAvail { ty: MsgType, id: u32 },
    #[error("lock word {slot} holds {value:#x}, which no valid peer writes")]
    LockWord { slot: u16, value: u64 },
}

/// Why a connection ended abnormally.
#[derive(Clone, Debug, PartialEq, Eq, Error)]
pub enum AbortReason {
    #[error("reset by the local application")]
    LocalReset,
    #[error("aborted by the peer ({0:?})")]
    PeerAbort(AbortCode),
    #[error("protocol error: {0}")]
    Protocol(ProtocolError),
    #[error("peer did not answer within the timeout")]
    PeerTimeout,
    #[error("peer is gone")]
    PeerGone,
    #[error("fabric operation failed: {0}")]
    Fabric(OpError),
    #[error("linger timeout with data still in flight")]
    LingerTimeout,
    #[error("no common protocol version")]
    Incompatible,
    #[error("bytes arrived on the TCP connection behind azsdp's back")]
    StrayBytes,
    #[error("the TCP connection beneath failed while the connection moved onto it")]
    StreamFailed,
}

impl AbortReason {
    /// The error pending and later calls see.
    pub fn call_error(&self) -> CallError {
        match self {
            AbortReason::PeerTimeout | AbortReason::LingerTimeout => CallError::TimedOut,
            _ => CallError::ConnReset,
        }
    }
}

/// How `close()` treats data still in flight.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Linger {
    /// SO_LINGER off: return at once; the connection finishes in the background,
    /// aborting if it has not within the configured linger timeout.
    Background,
    /// SO_LINGER {on, 0}: abort at once (the peer sees a reset).
    Abort,
}

/// Which directions `shutdown()` closes.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Shutdown {
    Read,
    Write,
    Both,
}

/// Readiness for poll/select/epoll.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Readiness {
    pub readable: bool,
    pub writable: bool,
    /// The receive direction is finished: the peer shut down its sending
    /// side, we shut down ours for receiving, or the connection was
    /// aborted (POLLRDHUP).
    pub read_hangup: bool,
    /// Both directions are finished, or the connection was aborted
    /// (POLLHUP).
    pub hangup: bool,
    /// An error is pending: the connection was aborted and no call has
    /// reported it yet (POLLERR).
    pub error: bool,
    /// Grows whenever data (or the end of the stream) arrives: an
    /// edge-triggered reader is told again then, and only then.
    pub arrived: u64,
    /// Grows whenever the send buffer makes room: the same for writers.
    pub drained: u64,
}

/// Which side opened the connection (who sends HELLO).
#[derive(Clone, Copy, Debug, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub enum Role {
    Client,
    Server,
}

impl fmt::Display for Role {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            Role::Client => "client",
            Role::Server => "server",
        })
    }
}

/// What a departed peer had done (see `FabricEvent::PeerGone`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Departure {
    /// How much of its stream its `send()` calls had returned.
    pub sent: u64,
    /// How much of our stream its `recv()` calls had returned.
    pub read: u64,
}
