//! AZ-SDP wire format: every protocol message, with strict `parse` and `emit`.
//!
//! All integers are big-endian (network order). A message is a 16-byte header
//! followed by a type-specific body. The fabric delivers messages whole, so the
//! header's length must equal the length of the buffer handed to [`parse`].
//!
//! ```text
//!  0       1       2               4                               8
//! +-------+-------+---------------+-------------------------------+
//! |version| type  |     flags     |        length (incl. header)  |
//! +-------+-------+---------------+-------------------------------+
//! |            sequence           |    credits    |   reserved=0  |
//! +-------------------------------+---------------+---------------+
//! ```
//!
//! [`parse`] validates everything that can be checked without connection state:
//! version, type, length, reserved fields and bits, value ranges and overflow of
//! `offset + length`. The engine checks the rest (sequence numbers, stream
//! offsets, known ids). Every error names the message type and field at fault.
//! Encoding is canonical: a buffer that parses re-emits to the same bytes.
//! The format is specified in `docs/protocol.md`.

use thiserror::Error;

/// The protocol version this implementation speaks.
pub const VERSION: u8 = 1;
/// Length of the common header.
pub const HEADER_LEN: usize = 16;
/// Smallest receive slot a peer may advertise: room for any control message.
pub const MIN_SLOT_SIZE: u32 = 256;
/// Largest receive slot a peer may advertise.
pub const MAX_SLOT_SIZE: u32 = 16 << 20;
/// Smallest and largest page size a peer may report.
pub const MIN_PAGE_SIZE: u32 = 512;
pub const MAX_PAGE_SIZE: u32 = 1 << 30;

/// Message types (header byte 1).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
#[repr(u8)]
pub enum MsgType {
    Hello = 1,
    HelloAck = 2,
    Data = 3,
    SrcAvail = 4,
    SrcAvailUpdate = 5,
    SrcAvailCancel = 6,
    GetComplete = 7,
    Credit = 8,
    Shutdown = 9,
    Abort = 10,
    Switch = 11,
    Join = 12,
}

impl MsgType {
    pub const ALL: [MsgType; 12] = [
        MsgType::Hello,
        MsgType::HelloAck,
        MsgType::Data,
        MsgType::SrcAvail,
        MsgType::SrcAvailUpdate,
        MsgType::SrcAvailCancel,
        MsgType::GetComplete,
        MsgType::Credit,
        MsgType::Shutdown,
        MsgType::Abort,
        MsgType::Switch,
        MsgType::Join,
    ];

    pub fn from_u8(v: u8) -> Option<MsgType> {
        MsgType::ALL.into_iter().find(|t| *t as u8 == v)
    }

    /// Exact body length for fixed-size types; `None` for DATA.
    pub fn body_len(self) -> Option<usize> {
        Some(match self {
            MsgType::Hello | MsgType::HelloAck => HELLO_BODY,
            MsgType::Data => return None,
            MsgType::SrcAvail => 40,
            MsgType::SrcAvailUpdate => 24,
            MsgType::SrcAvailCancel => 8,
            MsgType::GetComplete => 8,
            MsgType::Credit => 0,
            MsgType::Shutdown => 8,
            MsgType::Abort => 4,
            MsgType::Switch => 16,
            MsgType::Join => 8,
        })
    }

    /// Flag bits defined for this type; any other bit is an error.
    pub fn allowed_flags(self) -> u16 {
        match self {
            MsgType::GetComplete => flags::FINAL,
            MsgType::Credit => flags::PING | flags::PONG,
            _ => 0,
        }
    }

    pub fn name(self) -> &'static str {
        match self {
            MsgType::Hello => "HELLO",
            MsgType::HelloAck => "HELLO_ACK",
            MsgType::Data => "DATA",
            MsgType::SrcAvail => "SRC_AVAIL",
            MsgType::SrcAvailUpdate => "SRC_AVAIL_UPDATE",
            MsgType::SrcAvailCancel => "SRC_AVAIL_CANCEL",
            MsgType::GetComplete => "GET_COMPLETE",
            MsgType::Credit => "CREDIT",
            MsgType::Shutdown => "SHUTDOWN",
            MsgType::Abort => "ABORT",
            MsgType::Switch => "SWITCH",
            MsgType::Join => "JOIN",
        }
    }
}

impl std::fmt::Display for MsgType {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.name())
    }
}

/// Header flag bits.
pub mod flags {
    /// GET_COMPLETE: the advertisement is finished (fully taken, or cancelled).
    pub const FINAL: u16 = 0x0001;
    /// CREDIT: the sender asks for a PONG (keepalive probe).
    pub const PING: u16 = 0x0001;
    /// CREDIT: answer to a PING.
    pub const PONG: u16 = 0x0002;
}

/// HELLO feature bits.
pub mod features {
    /// The peer may advertise SRC_AVAILs (it can expose memory for GET).
    pub const ZCOPY_SOURCE: u32 = 0x1;
    /// The peer can GET advertised memory.
    pub const ZCOPY_SINK: u32 = 0x2;
    /// The peer keeps lock words the other side may compare-and-swap (copy-on-write).
    pub const COW_LOCK: u32 = 0x4;
    pub const ALL: u32 = ZCOPY_SOURCE | ZCOPY_SINK | COW_LOCK;
}

const HELLO_BODY: usize = 40;

/// HELLO and HELLO_ACK body: what each side offers.
#[derive(Clone, Copy, Debug, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct Hello {
    pub min_version: u8,
    pub max_version: u8,
    /// Page size of the sender's memory (power of two).
    pub page_size: u32,
    /// [`features`] bits.
    pub features: u32,
    /// DATA credits granted to the peer: receive slots reserved for its DATA.
    pub credits: u16,
    /// Lock words (and so SRC_AVAILs in flight) the sender accepts as a data sink.
    pub lock_slots: u16,
    /// Largest message the sender accepts, header included.
    pub slot_size: u32,
    /// Where the sender's lock words live, for the peer's compare-and-swap.
    pub lock_addr: u64,
    pub lock_key: u32,
    /// Largest SRC_AVAIL the sender will advertise (informational, for the sink's staging).
    pub max_avail: u32,
}

/// SRC_AVAIL: "bytes `[stream_off, stream_off+len)` are at `addr` under `key`".
#[derive(Clone, Copy, Debug, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct SrcAvail {
    pub id: u32,
    pub lock_slot: u16,
    pub lock_gen: u32,
    pub len: u32,
    pub stream_off: u64,
    pub addr: u64,
    pub key: u32,
}

/// SRC_AVAIL_UPDATE: the rest of advertisement `id`, from byte `base` of it on,
/// now lives at `addr` under `key` (a private copy made after a write fault).
#[derive(Clone, Copy, Debug, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct SrcAvailUpdate {
    pub id: u32,
    pub base: u32,
    pub addr: u64,
    pub key: u32,
}

/// GET_COMPLETE: the sink has taken `consumed` bytes of advertisement `id` in all.
#[derive(Clone, Copy, Debug, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct GetComplete {
    pub id: u32,
    pub consumed: u32,
    /// The advertisement is finished; `consumed` is its final length.
    pub final_: bool,
}

/// ABORT reason codes.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, serde::Serialize, serde::Deserialize)]
#[repr(u16)]
pub enum AbortCode {
    /// The application asked for it (close with SO_LINGER 0, or unread data on close).
    Reset = 1,
    /// The sender of ABORT found a protocol violation in what it received.
    ProtocolError = 2,
    /// The peer stopped answering.
    Timeout = 3,
    /// A fabric operation failed (e.g. a GET was refused).
    FabricError = 4,
    /// No common protocol version or mandatory feature.
    Incompatible = 5,
    /// Data arrived after the receiving application closed its end.
    Closed = 6,
    /// The connection began on TCP and stays there: nothing joined the
    /// fabric either way, and nothing will (§8b).
    StaysOnTcp = 7,
}

impl AbortCode {
    pub const ALL: [AbortCode; 7] = [
        AbortCode::Reset,
        AbortCode::ProtocolError,
        AbortCode::Timeout,
        AbortCode::FabricError,
        AbortCode::Incompatible,
        AbortCode::Closed,
        AbortCode::StaysOnTcp,
    ];
    pub fn from_u16(v: u16) -> Option<AbortCode> {
        AbortCode::ALL.into_iter().find(|c| *c as u16 == v)
    }
}

/// A message body.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Message<'a> {
    Hello(Hello),
    HelloAck(Hello),
    Data(&'a [u8]),
    SrcAvail(SrcAvail),
    SrcAvailUpdate(SrcAvailUpdate),
    SrcAvailCancel {
        id: u32,
    },
    GetComplete(GetComplete),
    Credit {
        ping: bool,
        pong: bool,
    },
    Shutdown {
        stream_end: u64,
    },
    Abort {
        code: AbortCode,
    },
    /// The sender leaves the fabric for the TCP connection beneath: its
    /// application consumed `consumed` bytes of the receiver's stream
    /// (everything after comes again over TCP), and it put `sent` bytes of
    /// its own stream on the fabric.
    Switch {
        consumed: u64,
        sent: u64,
    },
    /// The sender's stream moves from the TCP connection beneath onto the
    /// fabric: its first `tcp_sent` bytes went over TCP, the rest come here.
    Join {
        tcp_sent: u64,
    },
}

impl Message<'_> {
    pub fn msg_type(&self) -> MsgType {
        match self {
            Message::Hello(_) => MsgType::Hello,
            Message::HelloAck(_) => MsgType::HelloAck,
            Message::Data(_) => MsgType::Data,
            Message::SrcAvail(_) => MsgType::SrcAvail,
            Message::SrcAvailUpdate(_) => MsgType::SrcAvailUpdate,
            Message::SrcAvailCancel { .. } => MsgType::SrcAvailCancel,
            Message::GetComplete(_) => MsgType::GetComplete,
            Message::Credit { .. } => MsgType::Credit,
            Message::Shutdown { .. } => MsgType::Shutdown,
            Message::Abort { .. } => MsgType::Abort,
            Message::Switch { .. } => MsgType::Switch,
            Message::Join { .. } => MsgType::Join,
        }
    }

    fn flags(&self) -> u16 {
        match *self {
            Message::GetComplete(g) if g.final_ => flags::FINAL,
            Message::Credit { ping, pong } => {
                (if ping { flags::PING } else { 0 }) | (if pong { flags::PONG } else { 0 })
            }
            _ => 0,
        }
    }

    fn body_len(&self) -> usize {
        match self {
            Message::Data(p) => p.len(),
            m => m.msg_type().body_len().unwrap_or(0),
        }
    }
}

/// A whole message: header fields plus body.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Frame<'a> {
    /// Per-direction message sequence number, starting at 0.
    pub seq: u32,
    /// DATA credits returned to the receiver of this frame.
    pub credits: u16,
    pub msg: Message<'a>,
}

impl Frame<'_> {
    /// Bytes this frame occupies on the wire.
    pub fn wire_len(&self) -> usize {
        HEADER_LEN + self.msg.body_len()
    }
}

/// Why a buffer is not a valid message. Each variant names what is wrong.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Error)]
pub enum WireError {
    #[error("message of {len} bytes is shorter than the {HEADER_LEN}-byte header")]
    Truncated { len: usize },
    #[error("unsupported protocol version {0} (this side speaks {VERSION})")]
    Version(u8),
    #[error("unknown message type {0}")]
    UnknownType(u8),
    #[error("{ty}: header length {header} does not match the {actual} bytes received")]
    LengthMismatch {
        ty: MsgType,
        header: u32,
        actual: usize,
    },
    #[error("{ty}: body is {actual} bytes, expected {expected}")]
    BodyLength {
        ty: MsgType,
        expected: usize,
        actual: usize,
    },
    #[error("{ty}: undefined flag bits {bits:#06x}")]
    Flags { ty: MsgType, bits: u16 },
    #[error("{ty}: reserved field `{field}` is not zero")]
    Reserved { ty: MsgType, field: &'static str },
    #[error("{ty}: field `{field}` is invalid: {why}")]
    Field {
        ty: MsgType,
        field: &'static str,
        why: &'static str,
    },
    #[error("output buffer of {have} bytes is too small for a {need}-byte message")]
    BufferTooSmall { need: usize, have: usize },
}

/// A cursor over a body, reading big-endian fields.
struct Reader<'a> {
    buf: &'a [u8],
    pos: usize,
}

impl<'a> Reader<'a> {
    fn u8(&mut self) -> u8 {
        let v = self.buf[self.pos];
        self.pos += 1;
        v
    }
    fn u16(&mut self) -> u16 {
        let v = u16::from_be_bytes([self.buf[self.pos], self.buf[self.pos + 1]]);
        self.pos += 2;
        v
    }
    fn u32(&mut self) -> u32 {
        let mut b = [0u8; 4];
        b.copy_from_slice(&self.buf[self.pos..self.pos + 4]);
        self.pos += 4;
        u32::from_be_bytes(b)
    }
    fn u64(&mut self) -> u64 {
        let mut b = [0u8; 8];
        b.copy_from_slice(&self.buf[self.pos..self.pos + 8]);
        self.pos += 8;
        u64::from_be_bytes(b)
    }
}

/// A cursor writing big-endian fields.
struct Writer<'a> {
    buf: &'a mut [u8],
    pos: usize,
}

impl Writer<'_> {
    fn u8(&mut self, v: u8) {
        self.buf[self.pos] = v;
        self.pos += 1;
    }
    fn u16(&mut self, v: u16) {
        self.bytes(&v.to_be_bytes());
    }
    fn u32(&mut self, v: u32) {
        self.bytes(&v.to_be_bytes());
    }
    fn u64(&mut self, v: u64) {
        self.bytes(&v.to_be_bytes());
    }
    fn bytes(&mut self, b: &[u8]) {
        self.buf[self.pos..self.pos + b.len()].copy_from_slice(b);
        self.pos += b.len();
    }
}

fn reserved(ty: MsgType, field: &'static str, v: u64) -> Result<(), WireError> {
    if v == 0 {
        Ok(())
    } else {
        Err(WireError::Reserved { ty, field })
    }
}

fn field(ty: MsgType, field: &'static str, ok: bool, why: &'static str) -> Result<(), WireError> {
    if ok {
        Ok(())
    } else {
        Err(WireError::Field { ty, field, why })
    }
}

/// Parse and validate one message. The whole of `buf` must be the message.
pub fn parse(buf: &[u8]) -> Result<Frame<'_>, WireError> {
    if buf.len() < HEADER_LEN {
        return Err(WireError::Truncated { len: buf.len() });
    }
    let mut h = Reader { buf, pos: 0 };
    let version = h.u8();
    let ty_raw = h.u8();
    let flag_bits = h.u16();
    let length = h.u32();
    let seq = h.u32();
    let credits = h.u16();
    let rsv = h.u16();
    if version != VERSION {
        return Err(WireError::Version(version));
    }
    let ty = MsgType::from_u8(ty_raw).ok_or(WireError::UnknownType(ty_raw))?;
    if length as usize != buf.len() {
        return Err(WireError::LengthMismatch {
            ty,
            header: length,
            actual: buf.len(),
        });
    }
    let bad_flags = flag_bits & !ty.allowed_flags();
    if bad_flags != 0 {
        return Err(WireError::Flags {
            ty,
            bits: bad_flags,
        });
    }
    reserved(ty, "header.reserved", rsv.into())?;
    let body = &buf[HEADER_LEN..];
    match ty.body_len() {
        Some(expected) if body.len() != expected => {
            return Err(WireError::BodyLength {
                ty,
                expected,
                actual: body.len(),
            });
        }
        None if body.is_empty() => {
            return Err(WireError::Field {
                ty,
                field: "payload",
                why: "DATA must carry at least one byte",
            });
        }
        _ => {}
    }
    let mut r = Reader { buf: body, pos: 0 };
    let msg = match ty {
        MsgType::Hello | MsgType::HelloAck => {
            let hello = parse_hello(ty, &mut r)?;
            if ty == MsgType::Hello {
                Message::Hello(hello)
            } else {
                Message::HelloAck(hello)
            }
        }
        MsgType::Data => Message::Data(body),
        MsgType::SrcAvail => {
            let id = r.u32();
            let lock_slot = r.u16();
            reserved(ty, "reserved1", r.u16().into())?;
            let lock_gen = r.u32();
            let len = r.u32();
            let stream_off = r.u64();
            let addr = r.u64();
            let key = r.u32();
            reserved(ty, "reserved2", r.u32().into())?;
            field(ty, "len", len > 0, "must not be zero")?;
            field(
                ty,
                "addr",
                addr.checked_add(len.into()).is_some(),
                "addr + len overflows",
            )?;
            field(
                ty,
                "stream_off",
                stream_off.checked_add(len.into()).is_some(),
                "stream_off + len overflows",
            )?;
            Message::SrcAvail(SrcAvail {
                id,
                lock_slot,
                lock_gen,
                len,
                stream_off,
                addr,
                key,
            })
        }
        MsgType::SrcAvailUpdate => {
            let id = r.u32();
            let base = r.u32();
            let addr = r.u64();
            let key = r.u32();
            reserved(ty, "reserved", r.u32().into())?;
            Message::SrcAvailUpdate(SrcAvailUpdate {
                id,
                base,
                addr,
                key,
            })
        }
        MsgType::SrcAvailCancel => {
            let id = r.u32();
            reserved(ty, "reserved", r.u32().into())?;
            Message::SrcAvailCancel { id }
        }
        MsgType::GetComplete => Message::GetComplete(GetComplete {
            id: r.u32(),
            consumed: r.u32(),
            final_: flag_bits & flags::FINAL != 0,
        }),
        MsgType::Credit => Message::Credit {
            ping: flag_bits & flags::PING != 0,
            pong: flag_bits & flags::PONG != 0,
        },
        MsgType::Shutdown => Message::Shutdown {
            stream_end: r.u64(),
        },
        MsgType::Switch => {
            let consumed = r.u64();
            let sent = r.u64();
            Message::Switch { consumed, sent }
        }
        MsgType::Join => Message::Join { tcp_sent: r.u64() },
        MsgType::Abort => {
            let raw = r.u16();
            reserved(ty, "reserved", r.u16().into())?;
            let code = AbortCode::from_u16(raw).ok_or(WireError::Field {
                ty,
                field: "code",
                why: "unknown abort code",
            })?;
            Message::Abort { code }
        }
    };
    Ok(Frame { seq, credits, msg })
}

fn parse_hello(ty: MsgType, r: &mut Reader<'_>) -> Result<Hello, WireError> {
    let min_version = r.u8();
    let max_version = r.u8();
    reserved(ty, "reserved1", r.u16().into())?;
    let page_size = r.u32();
    let feature_bits = r.u32();
    let credits = r.u16();
    let lock_slots = r.u16();
    let slot_size = r.u32();
    let lock_addr = r.u64();
    let lock_key = r.u32();
    let max_avail = r.u32();
    reserved(ty, "reserved2", r.u32().into())?;
    field(
        ty,
        "min_version",
        min_version >= 1 && min_version <= max_version,
        "must be at least 1 and at most max_version",
    )?;
    field(
        ty,
        "page_size",
        page_size.is_power_of_two() && (MIN_PAGE_SIZE..=MAX_PAGE_SIZE).contains(&page_size),
        "must be a power of two from 512 B to 1 GiB",
    )?;
    field(
        ty,
        "features",
        feature_bits & !features::ALL == 0,
        "undefined feature bits",
    )?;
    field(ty, "credits", credits > 0, "must grant at least one credit")?;
    field(
        ty,
        "slot_size",
        (MIN_SLOT_SIZE..=MAX_SLOT_SIZE).contains(&slot_size),
        "must be from 256 B to 16 MiB",
    )?;
    field(
        ty,
        "lock_addr",
        lock_addr.checked_add(u64::from(lock_slots) * 8).is_some(),
        "lock_addr + 8 * lock_slots overflows",
    )?;
    field(
        ty,
        "lock_slots",
        feature_bits & features::COW_LOCK == 0 || lock_slots > 0,
        "COW_LOCK needs at least one lock slot",
    )?;
    field(
        ty,
        "lock_slots",
        feature_bits & features::ZCOPY_SINK == 0 || lock_slots > 0,
        "ZCOPY_SINK needs at least one slot",
    )?;
    Ok(Hello {
        min_version,
        max_version,
        page_size,
        features: feature_bits,
        credits,
        lock_slots,
        slot_size,
        lock_addr,
        lock_key,
        max_avail,
    })
}

/// Write the 16-byte header of a message with a `body_len`-byte body.
pub fn emit_header(
    ty: MsgType,
    flag_bits: u16,
    seq: u32,
    credits: u16,
    body_len: usize,
    out: &mut [u8],
) -> Result<(), WireError> {
    let need = HEADER_LEN + body_len;
    if out.len() < HEADER_LEN {
        return Err(WireError::BufferTooSmall {
            need,
            have: out.len(),
        });
    }
    let length = u32::try_from(need).map_err(|_| WireError::Field {
        ty,
        field: "length",
        why: "message longer than 4 GiB",
    })?;
    let mut w = Writer { buf: out, pos: 0 };
    w.u8(VERSION);
    w.u8(ty as u8);
    w.u16(flag_bits);
    w.u32(length);
    w.u32(seq);
    w.u16(credits);
    w.u16(0);
    Ok(())
}

/// Encode `frame` into `out`, returning the number of bytes written.
///
/// Emitting does not validate field values: it is the engine's job to build
/// valid frames, and the property tests check that what it can build parses.
pub fn emit(frame: &Frame<'_>, out: &mut [u8]) -> Result<usize, WireError> {
    let need = frame.wire_len();
    if out.len() < need {
        return Err(WireError::BufferTooSmall {
            need,
            have: out.len(),
        });
    }
    let ty = frame.msg.msg_type();
    emit_header(
        ty,
        frame.msg.flags(),
        frame.seq,
        frame.credits,
        frame.msg.body_len(),
        out,
    )?;
    let mut w = Writer {
        buf: &mut out[HEADER_LEN..need],
        pos: 0,
    };
    match frame.msg {
        Message::Hello(h) | Message::HelloAck(h) => {
            w.u8(h.min_version);
            w.u8(h.max_version);
            w.u16(0);
            w.u32(h.page_size);
            w.u32(h.features);
            w.u16(h.credits);
            w.u16(h.lock_slots);
            w.u32(h.slot_size);
            w.u64(h.lock_addr);
            w.u32(h.lock_key);
            w.u32(h.max_avail);
            w.u32(0);
        }
        Message::Data(p) => w.bytes(p),
        Message::SrcAvail(a) => {
            w.u32(a.id);
            w.u16(a.lock_slot);
            w.u16(0);
            w.u32(a.lock_gen);
            w.u32(a.len);
            w.u64(a.stream_off);
            w.u64(a.addr);
            w.u32(a.key);
            w.u32(0);
        }
        Message::SrcAvailUpdate(u) => {
            w.u32(u.id);
            w.u32(u.base);
            w.u64(u.addr);
            w.u32(u.key);
            w.u32(0);
        }
        Message::SrcAvailCancel { id } => {
            w.u32(id);
            w.u32(0);
        }
        Message::GetComplete(g) => {
            w.u32(g.id);
            w.u32(g.consumed);
        }
        Message::Credit { .. } => {}
        Message::Shutdown { stream_end } => w.u64(stream_end),
        Message::Switch { consumed, sent } => {
            w.u64(consumed);
            w.u64(sent);
        }
        Message::Join { tcp_sent } => w.u64(tcp_sent),
        Message::Abort { code } => {
            w.u16(code as u16);
            w.u16(0);
        }
    }
    debug_assert_eq!(w.pos, need - HEADER_LEN);
    Ok(need)
}

/// Largest message any frame other than DATA needs.
pub const MAX_CONTROL_LEN: usize = HEADER_LEN + HELLO_BODY;

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    fn hello_strategy() -> impl Strategy<Value = Hello> {
        (
            (1u8..=3, 0u8..=3),
            9u32..=30,
            0u32..=features::ALL,
            1u16..=u16::MAX,
            1u16..=1024,
            MIN_SLOT_SIZE..=MAX_SLOT_SIZE,
            0u64..(u64::MAX / 2),
            any::<u32>(),
            any::<u32>(),
        )
            .prop_map(
                |((minv, extra), shift, feats, credits, slots, slot, addr, key, max_avail)| Hello {
                    min_version: minv,
                    max_version: minv.saturating_add(extra),
                    page_size: 1 << shift,
                    features: feats,
                    credits,
                    lock_slots: slots,
                    slot_size: slot,
                    lock_addr: addr,
                    lock_key: key,
                    max_avail,
                },
            )
    }

    /// A message to round-trip: DATA owns its payload, the rest borrow nothing.
    #[derive(Debug, Clone)]
    enum TestMsg {
        Data(Vec<u8>),
        Fixed(Message<'static>),
    }

    impl TestMsg {
        fn message(&self) -> Message<'_> {
            match self {
                TestMsg::Data(p) => Message::Data(p),
                TestMsg::Fixed(m) => *m,
            }
        }
    }

    fn message_strategy() -> impl Strategy<Value = TestMsg> {
        let fixed = prop_oneof![
            hello_strategy().prop_map(Message::Hello),
            hello_strategy().prop_map(Message::HelloAck),
            (
                any::<u32>(),
                any::<u16>(),
                any::<u32>(),
                1u32..,
                0u64..u64::MAX / 2,
                0u64..u64::MAX / 2,
                any::<u32>()
            )
                .prop_map(|(id, lock_slot, lock_gen, len, stream_off, addr, key)| {
                    Message::SrcAvail(SrcAvail {
                        id,
                        lock_slot,
                        lock_gen,
                        len,
                        stream_off,
                        addr,
                        key,
                    })
                }),
            (any::<u32>(), any::<u32>(), any::<u64>(), any::<u32>()).prop_map(
                |(id, base, addr, key)| Message::SrcAvailUpdate(SrcAvailUpdate {
                    id,
                    base,
                    addr,
                    key
                })
            ),
            any::<u32>().prop_map(|id| Message::SrcAvailCancel { id }),
            (any::<u32>(), any::<u32>(), any::<bool>()).prop_map(|(id, consumed, final_)| {
                Message::GetComplete(GetComplete {
                    id,
                    consumed,
                    final_,
                })
            }),
            (any::<bool>(), any::<bool>()).prop_map(|(ping, pong)| Message::Credit { ping, pong }),
            any::<u64>().prop_map(|stream_end| Message::Shutdown { stream_end }),
            (any::<u64>(), any::<u64>())
                .prop_map(|(consumed, sent)| Message::Switch { consumed, sent }),
            any::<u64>().prop_map(|tcp_sent| Message::Join { tcp_sent }),
            prop::sample::select(AbortCode::ALL.to_vec()).prop_map(|code| Message::Abort { code }),
        ];
        prop_oneof![
            prop::collection::vec(any::<u8>(), 1..300).prop_map(TestMsg::Data),
            fixed.prop_map(TestMsg::Fixed),
        ]
    }

    proptest! {
        #[test]
        fn emit_then_parse_roundtrips(
            msg in message_strategy(),
            seq in any::<u32>(),
            credits in any::<u16>(),
        ) {
            let frame = Frame { seq, credits, msg: msg.message() };
            let mut buf = vec![0u8; frame.wire_len()];
            let n = emit(&frame, &mut buf).unwrap();
            prop_assert_eq!(n, buf.len());
            let parsed = parse(&buf).unwrap();
            prop_assert_eq!(parsed, frame);
        }

        #[test]
        fn parse_arbitrary_bytes_never_panics(bytes in prop::collection::vec(any::<u8>(), 0..128)) {
            if let Ok(frame) = parse(&bytes) {
                // Canonical encoding: what parses re-emits to the same bytes.
                let mut out = vec![0u8; frame.wire_len()];
                emit(&frame, &mut out).unwrap();
                prop_assert_eq!(out, bytes);
            }
        }

        #[test]
        fn parse_mutated_valid_messages_never_panics(
            seq in any::<u32>(),
            stream_end in any::<u64>(),
            idx in 0usize..24,
            byte in any::<u8>(),
        ) {
            let frame = Frame { seq, credits: 3, msg: Message::Shutdown { stream_end } };
            let mut buf = vec![0u8; frame.wire_len()];
            emit(&frame, &mut buf).unwrap();
            buf[idx] = byte;
            if let Ok(f) = parse(&buf) {
                let mut out = vec![0u8; f.wire_len()];
                emit(&f, &mut out).unwrap();
                prop_assert_eq!(out, buf);
            }
        }
    }

    fn emitted(msg: Message<'_>) -> Vec<u8> {
        let frame = Frame {
            seq: 7,
            credits: 2,
            msg,
        };
        let mut buf = vec![0u8; frame.wire_len()];
        emit(&frame, &mut buf).unwrap();
        buf
    }

    fn sample_avail() -> SrcAvail {
        SrcAvail {
            id: 1,
            lock_slot: 0,
            lock_gen: 0,
            len: 4096,
            stream_off: 100,
            addr: 0x1000,
            key: 9,
        }
    }

    #[test]
    fn header_errors_name_the_problem() {
        assert_eq!(parse(&[1, 2, 3]), Err(WireError::Truncated { len: 3 }));
        let mut b = emitted(Message::Credit {
            ping: false,
            pong: false,
        });
        b[0] = 2;
        assert_eq!(parse(&b), Err(WireError::Version(2)));
        b[0] = 1;
        b[1] = 99;
        assert_eq!(parse(&b), Err(WireError::UnknownType(99)));
        b[1] = MsgType::Credit as u8;
        b[3] = 0x04;
        assert_eq!(
            parse(&b),
            Err(WireError::Flags {
                ty: MsgType::Credit,
                bits: 4
            })
        );
        b[3] = 0;
        b[15] = 1;
        assert_eq!(
            parse(&b),
            Err(WireError::Reserved {
                ty: MsgType::Credit,
                field: "header.reserved"
            })
        );
        b[15] = 0;
        let mut longer = b.clone();
        longer.push(0);
        assert!(matches!(
            parse(&longer),
            Err(WireError::LengthMismatch { .. })
        ));
        let err = parse(&longer).unwrap_err().to_string();
        assert!(err.contains("CREDIT"), "{err}");
    }

    #[test]
    fn body_errors_name_the_field() {
        let mut a = sample_avail();
        a.len = 0;
        let err = parse(&emitted(Message::SrcAvail(a))).unwrap_err();
        assert_eq!(
            err,
            WireError::Field {
                ty: MsgType::SrcAvail,
                field: "len",
                why: "must not be zero"
            }
        );
        let mut a = sample_avail();
        a.addr = u64::MAX - 10;
        assert!(matches!(
            parse(&emitted(Message::SrcAvail(a))),
            Err(WireError::Field { field: "addr", .. })
        ));
        let mut b = emitted(Message::SrcAvail(sample_avail()));
        b[HEADER_LEN + 6] = 1; // reserved1
        assert!(matches!(
            parse(&b),
            Err(WireError::Reserved {
                field: "reserved1",
                ..
            })
        ));
        let mut b = emitted(Message::Abort {
            code: AbortCode::Reset,
        });
        b[HEADER_LEN + 1] = 77;
        assert!(matches!(
            parse(&b),
            Err(WireError::Field { field: "code", .. })
        ));
        let mut b = emitted(Message::Data(b"x"));
        b.truncate(HEADER_LEN);
        b[4..8].copy_from_slice(&(HEADER_LEN as u32).to_be_bytes());
        assert!(matches!(
            parse(&b),
            Err(WireError::Field {
                field: "payload",
                ..
            })
        ));
    }

    #[test]
    fn hello_validation() {
        let good = Hello {
            min_version: 1,
            max_version: 1,
            page_size: 4096,
            features: features::ALL,
            credits: 8,
            lock_slots: 16,
            slot_size: 65536,
            lock_addr: 0x10000,
            lock_key: 3,
            max_avail: 8 << 20,
        };
        assert!(parse(&emitted(Message::Hello(good))).is_ok());
        for (bad, name) in [
            (
                Hello {
                    page_size: 4097,
                    ..good
                },
                "page_size",
            ),
            (Hello { credits: 0, ..good }, "credits"),
            (
                Hello {
                    slot_size: 10,
                    ..good
                },
                "slot_size",
            ),
            (
                Hello {
                    min_version: 2,
                    max_version: 1,
                    ..good
                },
                "min_version",
            ),
            (
                Hello {
                    features: 0x80,
                    ..good
                },
                "features",
            ),
            (
                Hello {
                    lock_slots: 0,
                    ..good
                },
                "lock_slots",
            ),
            (
                Hello {
                    lock_addr: u64::MAX,
                    ..good
                },
                "lock_addr",
            ),
        ] {
            match parse(&emitted(Message::Hello(bad))) {
                Err(WireError::Field { field, .. }) => assert_eq!(field, name),
                other => panic!("{name}: {other:?}"),
            }
        }
    }

    #[test]
    fn emit_reports_small_buffer() {
        let frame = Frame {
            seq: 0,
            credits: 0,
            msg: Message::SrcAvail(sample_avail()),
        };
        let mut small = [0u8; 20];
        assert_eq!(
            emit(&frame, &mut small),
            Err(WireError::BufferTooSmall { need: 56, have: 20 })
        );
    }
}
