//! The header every SEND of the `verbs` fabric carries, before the
//! engine's message: the receive credits it returns, SDP style (a SEND
//! consumes one receive the peer posted; the peer learns which it may
//! post again from these headers, so it never sends into a missing
//! receive and the queue pair never needs RNR retries).
//!
//! ```text
//! byte 0      kind: 1 a message follows, 2 credits only
//! byte 1      0 (reserved)
//! bytes 2-3   receives reposted since the last header (little endian)
//! ```

use thiserror::Error;

/// Bytes of [`Header`] on the wire.
pub const HEADER_LEN: usize = 4;

const KIND_MESSAGE: u8 = 1;
const KIND_CREDITS: u8 = 2;

/// What a SEND carries besides its credits.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Kind {
    /// An engine message follows (never empty).
    Message,
    /// Nothing follows: this SEND only returns credits.
    Credits,
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
}

impl Header {
    pub fn emit(&self, out: &mut [u8; HEADER_LEN]) {
        out[0] = match self.kind {
            Kind::Message => KIND_MESSAGE,
            Kind::Credits => KIND_CREDITS,
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
            k => return Err(WireError::Kind(k)),
        };
        if bytes[1] != 0 {
            return Err(WireError::Reserved);
        }
        let credits = u16::from_le_bytes([bytes[2], bytes[3]]);
        Ok((Header { kind, credits }, payload))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    proptest! {
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
        assert_eq!(Header::parse(&[3, 0, 0, 0]), Err(WireError::Kind(3)));
        assert_eq!(Header::parse(&[2, 1, 0, 0]), Err(WireError::Reserved));
    }
}
