//! What rdma_cm's private data carries when a `verbs` connection is made:
//! the client's request, the server's accept and its reject. (No system
//! calls: tested on its own.)
//!
//! ```text
//! request (24 bytes)            accept (16 bytes)           reject (4 bytes)
//! 0-1  "AZ"                     0-1  "AZ"                   0-1  "AZ"
//! 2    version (1)              2    version                2    version
//! 3    0 (request)              3    1 (accept)             3    2 (reject)
//! 4-5  receives posted          4-5  receives posted
//! 6-9  bytes per receive        6-9  bytes per receive
//! 10-17 nonce                   10   flags
//! 18-19 client's TCP port       11-15 0
//! 20-21 server's TCP port
//! 22   flags
//! 23   0
//! ```
//!
//! Flags: bit 0, "compare-and-swap my lock words by message" (the sender's
//! device has no atomics, or its atomics and its CPU's do not meet and it
//! cannot loop its own through the device: `wire::CasRequest`).
//!
//! rdma_cm leaves 56 bytes of private data for a request in the TCP port
//! space: the addresses are not in it, rdma_cm reports them (the kernel's
//! view of where the request came from, which the server checks against
//! the TCP connection's peer address).

use thiserror::Error;

const MAGIC: [u8; 2] = *b"AZ";
pub const VERSION: u8 = 1;
const REQUEST: u8 = 0;
const ACCEPT: u8 = 1;
const REJECT: u8 = 2;
const FLAG_LOCKS_BY_MESSAGE: u8 = 1;

pub const REQUEST_LEN: usize = 24;
pub const ACCEPT_LEN: usize = 16;
pub const REJECT_LEN: usize = 4;

/// Receives of one side: how many and how large.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Ring {
    pub count: u16,
    pub slot: u32,
}

/// The smallest receive a side may offer: a header and a message the
/// engine cannot do without.
pub const MIN_SLOT: u32 = 1024;
/// The largest (a peer's claim beyond it is a lie or a mistake).
pub const MAX_SLOT: u32 = 1 << 20;

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Request {
    pub ring: Ring,
    pub nonce: u64,
    /// The TCP connection this request pairs: its client's port and its
    /// server's port.
    pub tcp_client_port: u16,
    pub tcp_server_port: u16,
    /// The client's lock words take compare-and-swap by message only.
    pub locks_by_message: bool,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Reply {
    /// Accepted: the server's receives, and whether its lock words take
    /// compare-and-swap by message only.
    Accept {
        ring: Ring,
        locks_by_message: bool,
    },
    Reject,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, Error)]
pub enum HelloError {
    #[error("{0} bytes: too short")]
    Short(usize),
    #[error("not azsdp's")]
    NotOurs,
    #[error("version {0}, this is {VERSION}")]
    Version(u8),
    #[error("kind {0}")]
    Kind(u8),
    #[error("receives of {0} x {1} bytes")]
    Ring(u16, u32),
    #[error("reserved bytes set")]
    Reserved,
}

fn ring_ok(r: Ring) -> Result<Ring, HelloError> {
    if r.count >= super::credits::MIN_RING && (MIN_SLOT..=MAX_SLOT).contains(&r.slot) {
        Ok(r)
    } else {
        Err(HelloError::Ring(r.count, r.slot))
    }
}

fn head(b: &[u8], len: usize) -> Result<u8, HelloError> {
    // rdma_cm pads private data: longer is fine, shorter is not.
    if b.len() < 4 || b[..2] != MAGIC {
        return Err(if b.len() >= 2 && b[..2] != MAGIC {
            HelloError::NotOurs
        } else {
            HelloError::Short(b.len())
        });
    }
    if b[2] != VERSION {
        return Err(HelloError::Version(b[2]));
    }
    if b.len() < len {
        return Err(HelloError::Short(b.len()));
    }
    Ok(b[3])
}

fn ring_at(b: &[u8]) -> Ring {
    Ring {
        count: u16::from_le_bytes([b[4], b[5]]),
        slot: u32::from_le_bytes([b[6], b[7], b[8], b[9]]),
    }
}

fn emit_ring(out: &mut [u8], kind: u8, r: Ring) {
    out[..2].copy_from_slice(&MAGIC);
    out[2] = VERSION;
    out[3] = kind;
    out[4..6].copy_from_slice(&r.count.to_le_bytes());
    out[6..10].copy_from_slice(&r.slot.to_le_bytes());
}

impl Request {
    pub fn emit(&self) -> [u8; REQUEST_LEN] {
        let mut b = [0u8; REQUEST_LEN];
        emit_ring(&mut b, REQUEST, self.ring);
        b[10..18].copy_from_slice(&self.nonce.to_le_bytes());
        b[18..20].copy_from_slice(&self.tcp_client_port.to_le_bytes());
        b[20..22].copy_from_slice(&self.tcp_server_port.to_le_bytes());
        b[22] = if self.locks_by_message {
            FLAG_LOCKS_BY_MESSAGE
        } else {
            0
        };
        b
    }

    pub fn parse(b: &[u8]) -> Result<Request, HelloError> {
        match head(b, REQUEST_LEN)? {
            REQUEST => {}
            k => return Err(HelloError::Kind(k)),
        }
        if b[22] & !FLAG_LOCKS_BY_MESSAGE != 0 || b[23] != 0 {
            return Err(HelloError::Reserved);
        }
        Ok(Request {
            ring: ring_ok(ring_at(b))?,
            nonce: u64::from_le_bytes(b[10..18].try_into().unwrap_or_default()),
            tcp_client_port: u16::from_le_bytes([b[18], b[19]]),
            tcp_server_port: u16::from_le_bytes([b[20], b[21]]),
            locks_by_message: b[22] & FLAG_LOCKS_BY_MESSAGE != 0,
        })
    }
}

impl Reply {
    pub fn emit(&self) -> Vec<u8> {
        match self {
            Reply::Accept {
                ring,
                locks_by_message,
            } => {
                let mut b = vec![0u8; ACCEPT_LEN];
                emit_ring(&mut b, ACCEPT, *ring);
                if *locks_by_message {
                    b[10] = FLAG_LOCKS_BY_MESSAGE;
                }
                b
            }
            Reply::Reject => {
                let mut b = vec![0u8; REJECT_LEN];
                b[..2].copy_from_slice(&MAGIC);
                b[2] = VERSION;
                b[3] = REJECT;
                b
            }
        }
    }

    pub fn parse(b: &[u8]) -> Result<Reply, HelloError> {
        match head(b, REJECT_LEN)? {
            ACCEPT => {
                if b.len() < ACCEPT_LEN {
                    return Err(HelloError::Short(b.len()));
                }
                if b[10] & !FLAG_LOCKS_BY_MESSAGE != 0 || b[11..16].iter().any(|&x| x != 0) {
                    return Err(HelloError::Reserved);
                }
                Ok(Reply::Accept {
                    ring: ring_ok(ring_at(b))?,
                    locks_by_message: b[10] & FLAG_LOCKS_BY_MESSAGE != 0,
                })
            }
            REJECT => Ok(Reply::Reject),
            k => Err(HelloError::Kind(k)),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    fn ring() -> impl Strategy<Value = Ring> {
        (super::super::credits::MIN_RING.., MIN_SLOT..=MAX_SLOT)
            .prop_map(|(count, slot)| Ring { count, slot })
    }

    proptest! {
        #[test]
        fn requests_round_trip(ring in ring(), nonce: u64, a: u16, b: u16, locks_by_message: bool) {
            let r = Request { ring, nonce, tcp_client_port: a, tcp_server_port: b, locks_by_message };
            prop_assert_eq!(Request::parse(&r.emit()), Ok(r));
            // rdma_cm may hand it over padded.
            let mut padded = r.emit().to_vec();
            padded.extend_from_slice(&[0; 32]);
            prop_assert_eq!(Request::parse(&padded), Ok(r));
        }

        #[test]
        fn replies_round_trip(ring in ring(), accept: bool, locks_by_message: bool) {
            let r = if accept { Reply::Accept { ring, locks_by_message } } else { Reply::Reject };
            prop_assert_eq!(Reply::parse(&r.emit()), Ok(r));
        }

        #[test]
        fn garbage_never_panics(b in proptest::collection::vec(any::<u8>(), 0..64)) {
            let _ = Request::parse(&b);
            let _ = Reply::parse(&b);
        }
    }

    #[test]
    fn lies_and_strangers_are_refused() {
        let r = Request {
            ring: Ring {
                count: 8,
                slot: 4096,
            },
            nonce: 7,
            tcp_client_port: 1,
            tcp_server_port: 2,
            locks_by_message: false,
        };
        let mut b = r.emit();
        b[22] = 2;
        assert_eq!(Request::parse(&b), Err(HelloError::Reserved));
        let mut b = r.emit();
        b[0] = b'X';
        assert_eq!(Request::parse(&b), Err(HelloError::NotOurs));
        let mut b = r.emit();
        b[2] = 9;
        assert_eq!(Request::parse(&b), Err(HelloError::Version(9)));
        let mut b = r.emit();
        b[4..6].copy_from_slice(&1u16.to_le_bytes());
        assert_eq!(Request::parse(&b), Err(HelloError::Ring(1, 4096)));
        let mut b = r.emit();
        b[6..10].copy_from_slice(&u32::MAX.to_le_bytes());
        assert_eq!(Request::parse(&b), Err(HelloError::Ring(8, u32::MAX)));
        assert_eq!(Request::parse(&r.emit()[..20]), Err(HelloError::Short(20)));
        assert_eq!(Reply::parse(&r.emit()), Err(HelloError::Kind(0)));
    }
}
