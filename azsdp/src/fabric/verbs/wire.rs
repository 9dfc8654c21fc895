//! The header every SEND of the `verbs` fabric carries, before the
//! engine's message: the receive credits it returns, SDP style (a SEND
//! consumes one receive the peer posted; the peer learns which it may
//! post again from these headers, so it never sends into a missing
//! receive and the queue pair never needs RNR retries).
//!
//! ```text
//! byte 0      kind: 1 a message follows, 2 credits only,
//!             3 a lock request follows, 4 a lock answer follows
//! byte 1      0 (reserved)
//! bytes 2-3   receives reposted since the last header (little endian)
//! ```
//!
//! A lock request and its answer are a compare-and-swap on one of the
//! receiver's lock words, made by the receiver's CPU for the sender: the
//! copy-on-write lock (docs/protocol.md §5.1) where a device has no atomics
//! or its atomics and the CPU's do not meet (see [`CasRequest`]).

use thiserror::Error;

/// Bytes of [`Header`] on the wire.
pub const HEADER_LEN: usize = 4;

const KIND_MESSAGE: u8 = 1;
const KIND_CREDITS: u8 = 2;
const KIND_CAS_REQUEST: u8 = 3;
const KIND_CAS_ANSWER: u8 = 4;

/// What a SEND carries besides its credits.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Kind {
    /// An engine message follows (never empty).
    Message,
    /// Nothing follows: this SEND only returns credits.
    Credits,
    /// A [`CasRequest`] follows.
    CasRequest,
    /// A [`CasAnswer`] follows.
    CasAnswer,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Header {
    pub kind: Kind,
    pub credits: u16,
}

/// Why a received SEND is not one of ours. The peer wrote it: the
/// connection is over.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Error)]
pub enum WireError {
    #[error("a SEND of {0} bytes is shorter than its header")]
    Short(usize),
    #[error("unknown kind {0}")]
    Kind(u8),
    #[error("reserved byte set")]
    Reserved,
    #[error("a credits-only SEND carries {0} bytes")]
    CreditsWithPayload(usize),
    #[error("a message SEND carries no message")]
    EmptyMessage,
    #[error("a lock {0} of {1} bytes")]
    CasLength(&'static str, usize),
}

impl Header {
    pub fn emit(&self, out: &mut [u8; HEADER_LEN]) {
        out[0] = match self.kind {
            Kind::Message => KIND_MESSAGE,
            Kind::Credits => KIND_CREDITS,
            Kind::CasRequest => KIND_CAS_REQUEST,
            Kind::CasAnswer => KIND_CAS_ANSWER,
        };
        out[1] = 0;
        out[2..4].copy_from_slice(&self.credits.to_le_bytes());
    }

    /// The header of a received SEND of `bytes`, and what follows it.
    pub fn parse(bytes: &[u8]) -> Result<(Header, &[u8]), WireError> {
        if bytes.len() < HEADER_LEN {
            return Err(WireError::Short(bytes.len()));
        }
        let payload = &bytes[HEADER_LEN..];
        let kind = match bytes[0] {
            KIND_MESSAGE if payload.is_empty() => return Err(WireError::EmptyMessage),
            KIND_MESSAGE => Kind::Message,
            KIND_CREDITS if !payload.is_empty() => {
                return Err(WireError::CreditsWithPayload(payload.len()));
            }
            KIND_CREDITS => Kind::Credits,
            KIND_CAS_REQUEST if payload.len() != CAS_REQUEST_LEN => {
                return Err(WireError::CasLength("request", payload.len()));
            }
            KIND_CAS_REQUEST => Kind::CasRequest,
            KIND_CAS_ANSWER if payload.len() != CAS_ANSWER_LEN => {
                return Err(WireError::CasLength("answer", payload.len()));
            }
            KIND_CAS_ANSWER => Kind::CasAnswer,
            k => return Err(WireError::Kind(k)),
        };
        if bytes[1] != 0 {
            return Err(WireError::Reserved);
        }
        let credits = u16::from_le_bytes([bytes[2], bytes[3]]);
        Ok((Header { kind, credits }, payload))
    }
}

/// Bytes of a [`CasRequest`] after its header.
pub const CAS_REQUEST_LEN: usize = 32;
/// Bytes of a [`CasAnswer`] after its header.
pub const CAS_ANSWER_LEN: usize = 16;

/// Compare-and-swap the receiver's lock word at `addr` (in the region it
/// registered as `key`, as its lock region says): `expect` → `new`.
///
/// ```text
/// 0-1   tag (the sender's, echoed in the answer)    16-23 expect
/// 2-3   0                                           24-31 new
/// 4-7   key
/// 8-15  addr
/// ```
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct CasRequest {
    pub tag: u16,
    pub key: u32,
    pub addr: u64,
    pub expect: u64,
    pub new: u64,
}

/// The answer to the [`CasRequest`] of `tag`: the word's value before
/// (`Ok`), or refused (an address or key that is not the lock region's).
///
/// ```text
/// 0-1  tag    2  0 done, 1 refused    3-7  0    8-15  the old value
/// ```
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct CasAnswer {
    pub tag: u16,
    pub old: Option<u64>,
}

fn u64_at(b: &[u8], at: usize) -> u64 {
    let mut w = [0u8; 8];
    w.copy_from_slice(&b[at..at + 8]);
    u64::from_le_bytes(w)
}

impl CasRequest {
    pub fn emit(&self) -> [u8; CAS_REQUEST_LEN] {
        let mut b = [0u8; CAS_REQUEST_LEN];
        b[0..2].copy_from_slice(&self.tag.to_le_bytes());
        b[4..8].copy_from_slice(&self.key.to_le_bytes());
        b[8..16].copy_from_slice(&self.addr.to_le_bytes());
        b[16..24].copy_from_slice(&self.expect.to_le_bytes());
        b[24..32].copy_from_slice(&self.new.to_le_bytes());
        b
    }

    pub fn parse(b: &[u8]) -> Result<CasRequest, WireError> {
        if b.len() != CAS_REQUEST_LEN {
            return Err(WireError::CasLength("request", b.len()));
        }
        if b[2..4] != [0, 0] {
            return Err(WireError::Reserved);
        }
        Ok(CasRequest {
            tag: u16::from_le_bytes([b[0], b[1]]),
            key: u32::from_le_bytes([b[4], b[5], b[6], b[7]]),
            addr: u64_at(b, 8),
            expect: u64_at(b, 16),
            new: u64_at(b, 24),
        })
    }
}

impl CasAnswer {
    pub fn emit(&self) -> [u8; CAS_ANSWER_LEN] {
        let mut b = [0u8; CAS_ANSWER_LEN];
        b[0..2].copy_from_slice(&self.tag.to_le_bytes());
        b[2] = u8::from(self.old.is_none());
        b[8..16].copy_from_slice(&self.old.unwrap_or(0).to_le_bytes());
        b
    }

    pub fn parse(b: &[u8]) -> Result<CasAnswer, WireError> {
        if b.len() != CAS_ANSWER_LEN {
            return Err(WireError::CasLength("answer", b.len()));
        }
        if b[3..8].iter().any(|&x| x != 0) || b[2] > 1 {
            return Err(WireError::Reserved);
        }
        let old = u64_at(b, 8);
        if b[2] == 1 && old != 0 {
            return Err(WireError::Reserved);
        }
        Ok(CasAnswer {
            tag: u16::from_le_bytes([b[0], b[1]]),
            old: (b[2] == 0).then_some(old),
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    proptest! {
        #[test]
        fn lock_requests_and_answers_round_trip(tag: u16, key: u32, addr: u64, expect: u64, new: u64, old: Option<u64>) {
            let r = CasRequest { tag, key, addr, expect, new };
            prop_assert_eq!(CasRequest::parse(&r.emit()), Ok(r));
            let a = CasAnswer { tag, old };
            prop_assert_eq!(CasAnswer::parse(&a.emit()), Ok(a));
            // Inside a SEND, with its header.
            let mut wire = vec![KIND_CAS_REQUEST, 0, 1, 0];
            wire.extend_from_slice(&r.emit());
            let (h, rest) = Header::parse(&wire).unwrap();
            prop_assert_eq!(h, Header { kind: Kind::CasRequest, credits: 1 });
            prop_assert_eq!(CasRequest::parse(rest), Ok(r));
        }

        #[test]
        fn lock_garbage_never_panics(b in proptest::collection::vec(any::<u8>(), 0..40)) {
            if let Ok(r) = CasRequest::parse(&b) {
                prop_assert_eq!(&r.emit()[..], &b[..]);
            }
            if let Ok(a) = CasAnswer::parse(&b) {
                prop_assert_eq!(&a.emit()[..], &b[..]);
            }
        }

        #[test]
        fn emit_then_parse_is_identity(credits: u16, message: bool, payload in proptest::collection::vec(any::<u8>(), 1..64)) {
            let h = Header { kind: if message { Kind::Message } else { Kind::Credits }, credits };
            let mut b = [0u8; HEADER_LEN];
            h.emit(&mut b);
            let mut wire = b.to_vec();
            if message {
                wire.extend_from_slice(&payload);
            }
            let (back, rest) = Header::parse(&wire).unwrap();
            prop_assert_eq!(back, h);
            prop_assert_eq!(rest, if message { &payload[..] } else { &[][..] });
        }

        #[test]
        fn garbage_never_panics(bytes in proptest::collection::vec(any::<u8>(), 0..16)) {
            if let Ok((h, rest)) = Header::parse(&bytes) {
                let mut b = [0u8; HEADER_LEN];
                h.emit(&mut b);
                prop_assert_eq!(&b[..], &bytes[..HEADER_LEN]);
                prop_assert_eq!(rest.is_empty(), h.kind == Kind::Credits);
                match h.kind {
                    Kind::CasRequest => prop_assert_eq!(rest.len(), CAS_REQUEST_LEN),
                    Kind::CasAnswer => prop_assert_eq!(rest.len(), CAS_ANSWER_LEN),
                    _ => {}
                }
            }
        }
    }

    #[test]
    fn malformed_headers_are_refused() {
        assert_eq!(Header::parse(&[1, 0, 0]), Err(WireError::Short(3)));
        assert_eq!(Header::parse(&[1, 0, 0, 0]), Err(WireError::EmptyMessage));
        assert_eq!(
            Header::parse(&[2, 0, 0, 0, 9]),
            Err(WireError::CreditsWithPayload(1))
        );
        assert_eq!(Header::parse(&[5, 0, 0, 0]), Err(WireError::Kind(5)));
        assert_eq!(
            Header::parse(&[3, 0, 0, 0, 1]),
            Err(WireError::CasLength("request", 1))
        );
        assert_eq!(
            Header::parse(&[4, 0, 0, 0]),
            Err(WireError::CasLength("answer", 0))
        );
        let refused = CasAnswer { tag: 3, old: None }.emit();
        let mut lie = refused;
        lie[8] = 1;
        assert_eq!(CasAnswer::parse(&lie), Err(WireError::Reserved));
        let mut b = refused;
        b[2] = 2;
        assert_eq!(CasAnswer::parse(&b), Err(WireError::Reserved));
        assert_eq!(Header::parse(&[2, 1, 0, 0]), Err(WireError::Reserved));
    }
}
