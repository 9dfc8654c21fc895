//! Pairing a TCP connection with a `verbs` connection between hosts (the
//! sans-IO part: the two messages that commit a pair, and the listener's
//! table of RDMA connections waiting for their TCP connection).
//!
//! ```text
//! client (connect)                              server (listener, accept)
//! bind TCP port P; rdma_cm REQ to dst:port  ->  take REQ (checked), put it in
//!   (Request: nonce, P, port)                     the table under (source IP
//!                                                 as rdma_cm reports it, P),
//!                               <- REP (accept)   then accept
//! ESTABLISHED; TCP connect()                ->  accept() returns (ip, P):
//!                                                 take (ip, P) from the table
//!                               <- BIND         commit: BIND (the 4-tuple
//! check BIND against its socket                    as the server's kernel says)
//! CONFIRM; connect() returns  ->                CONFIRM: accept() returns
//! ```
//!
//! The table entry exists before the server's REP, so before the client's
//! TCP SYN: `accept()` never waits for a request that is on its way, only
//! (briefly, bounded) for an accept that is. A client that gives up (no
//! BIND within `pair_timeout`) disconnects instead of confirming, and the
//! server, waiting for CONFIRM, sees it leave: both stay on TCP, and no byte
//! of theirs ever went on the TCP stream. The first engine message follows
//! CONFIRM on the same queue pair (in order, RC).

use std::collections::HashMap;
use std::net::IpAddr;
use std::time::{Duration, Instant};

use thiserror::Error;

const MAGIC: [u8; 4] = *b"AZPB";
const VERSION: u8 = 1;
const BIND: u8 = 1;
const CONFIRM: u8 = 2;
/// Bytes of an encoded [`PairMsg`].
pub const PAIR_LEN: usize = 12;

/// The two messages that commit a pair (before the engine's first).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum PairMsg {
    /// The server matched the request with the TCP connection its program
    /// accepted: from `client_port` to `server_port`.
    Bind { client_port: u16, server_port: u16 },
    /// The client checked the bind against its own socket: paired.
    Confirm,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, Error)]
pub enum PairError {
    #[error("{0} bytes, not {PAIR_LEN}")]
    Length(usize),
    #[error("not azsdp's pairing message")]
    NotOurs,
    #[error("version {0}, this is {VERSION}")]
    Version(u8),
    #[error("kind {0}")]
    Kind(u8),
    #[error("reserved bytes set")]
    Reserved,
}

impl PairMsg {
    pub fn emit(&self) -> [u8; PAIR_LEN] {
        let mut b = [0u8; PAIR_LEN];
        b[..4].copy_from_slice(&MAGIC);
        b[4] = VERSION;
        match *self {
            PairMsg::Bind {
                client_port,
                server_port,
            } => {
                b[5] = BIND;
                b[6..8].copy_from_slice(&client_port.to_le_bytes());
                b[8..10].copy_from_slice(&server_port.to_le_bytes());
            }
            PairMsg::Confirm => b[5] = CONFIRM,
        }
        b
    }

    pub fn parse(b: &[u8]) -> Result<PairMsg, PairError> {
        if b.len() != PAIR_LEN {
            return Err(PairError::Length(b.len()));
        }
        if b[..4] != MAGIC {
            return Err(PairError::NotOurs);
        }
        if b[4] != VERSION {
            return Err(PairError::Version(b[4]));
        }
        if b[10..12] != [0, 0] {
            return Err(PairError::Reserved);
        }
        match b[5] {
            BIND => Ok(PairMsg::Bind {
                client_port: u16::from_le_bytes([b[6], b[7]]),
                server_port: u16::from_le_bytes([b[8], b[9]]),
            }),
            CONFIRM if b[6..10] == [0; 4] => Ok(PairMsg::Confirm),
            CONFIRM => Err(PairError::Reserved),
            k => Err(PairError::Kind(k)),
        }
    }
}

/// The TCP connection a request claims: the client's address (as rdma_cm
/// reported the request's source, never as the request says) and its TCP
/// port (as the request says; the server's kernel confirms it when it
/// accepts a TCP connection from exactly there).
pub type Claim = (IpAddr, u16);

/// Why the table refused a request.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Error)]
pub enum Refused {
    #[error("{0} requests wait already")]
    Full(usize),
    #[error("{0} requests from that address wait already")]
    SourceFull(usize),
}

/// RDMA connections a listener accepted that wait for their TCP
/// connection, bounded in all, per source address and in time (a peer
/// that makes requests and never connects by TCP holds nothing for long).
#[derive(Debug)]
pub struct WaitingTable<T> {
    entries: HashMap<Claim, Vec<(T, Instant)>>,
    total: usize,
    per_source: usize,
    expiry: Duration,
}

impl<T> WaitingTable<T> {
    pub fn new(total: usize, per_source: usize, expiry: Duration) -> Self {
        WaitingTable {
            entries: HashMap::new(),
            total,
            per_source,
            expiry,
        }
    }

    pub fn len(&self) -> usize {
        self.entries.values().map(Vec::len).sum()
    }

    pub fn is_empty(&self) -> bool {
        self.entries.is_empty()
    }

    /// Drop what waited longer than the expiry; returns it (to be
    /// disconnected).
    pub fn expire(&mut self, now: Instant) -> Vec<T> {
        let mut gone = Vec::new();
        let expiry = self.expiry;
        self.entries.retain(|_, v| {
            let (keep, old): (Vec<_>, Vec<_>) = std::mem::take(v)
                .into_iter()
                .partition(|(_, since)| now.saturating_duration_since(*since) < expiry);
            gone.extend(old.into_iter().map(|(t, _)| t));
            *v = keep;
            !v.is_empty()
        });
        gone
    }

    /// Hold `t` for `claim`, if the bounds allow.
    pub fn insert(&mut self, claim: Claim, t: T, now: Instant) -> Result<(), (T, Refused)> {
        let n = self.len();
        if n >= self.total {
            return Err((t, Refused::Full(n)));
        }
        let from_source: usize = self
            .entries
            .iter()
            .filter(|(c, _)| c.0 == claim.0)
            .map(|(_, v)| v.len())
            .sum();
        if from_source >= self.per_source {
            return Err((t, Refused::SourceFull(from_source)));
        }
        self.entries.entry(claim).or_default().push((t, now));
        Ok(())
    }

    /// The entry for `claim`, if exactly one claims it: `Err` with all of
    /// them if several do (an impostor races the true client; which is
    /// which cannot be told, so neither is bound).
    pub fn take(&mut self, claim: Claim) -> Result<Option<T>, Vec<T>> {
        let Some(v) = self.entries.remove(&claim) else {
            return Ok(None);
        };
        let mut all: Vec<T> = v.into_iter().map(|(t, _)| t).collect();
        if all.len() == 1 {
            Ok(all.pop())
        } else {
            Err(all)
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;
    use std::net::Ipv4Addr;

    proptest! {
        #[test]
        fn messages_round_trip(c: u16, s: u16, bind: bool) {
            let m = if bind {
                PairMsg::Bind { client_port: c, server_port: s }
            } else {
                PairMsg::Confirm
            };
            prop_assert_eq!(PairMsg::parse(&m.emit()), Ok(m));
        }

        #[test]
        fn garbage_never_panics(b in proptest::collection::vec(any::<u8>(), 0..32)) {
            let _ = PairMsg::parse(&b);
        }

        /// Whatever arrives, the table holds no more than its bounds, and
        /// nothing outlives the expiry.
        #[test]
        fn the_table_stays_bounded(
            ops in proptest::collection::vec((0u8..4, 0u16..6, 0u64..3000), 0..200)
        ) {
            let t0 = Instant::now();
            let mut t = WaitingTable::new(16, 5, Duration::from_secs(1));
            let mut now = t0;
            for (ip, port, ms) in ops {
                now = t0 + Duration::from_millis(ms).max(now - t0);
                let claim = (IpAddr::V4(Ipv4Addr::new(10, 0, 0, ip)), port);
                if port == 5 {
                    let _ = t.take(claim);
                } else {
                    let _ = t.insert(claim, (), now);
                }
                prop_assert!(t.len() <= 16);
                for ip in 0..4u8 {
                    let from: usize = t.entries.iter()
                        .filter(|(c, _)| c.0 == IpAddr::V4(Ipv4Addr::new(10, 0, 0, ip)))
                        .map(|(_, v)| v.len()).sum();
                    prop_assert!(from <= 5);
                }
                t.expire(now);
                prop_assert!(t.entries.values().flatten()
                    .all(|(_, since)| now.duration_since(*since) < Duration::from_secs(1)));
            }
        }
    }

    #[test]
    fn strangers_and_lies_are_refused() {
        let b = PairMsg::Confirm.emit();
        assert_eq!(PairMsg::parse(&b[..11]), Err(PairError::Length(11)));
        let mut x = b;
        x[0] = b'X';
        assert_eq!(PairMsg::parse(&x), Err(PairError::NotOurs));
        let mut x = b;
        x[4] = 2;
        assert_eq!(PairMsg::parse(&x), Err(PairError::Version(2)));
        let mut x = b;
        x[5] = 9;
        assert_eq!(PairMsg::parse(&x), Err(PairError::Kind(9)));
        let mut x = b;
        x[7] = 1;
        assert_eq!(PairMsg::parse(&x), Err(PairError::Reserved));
    }

    #[test]
    fn a_claim_is_taken_once_and_a_contested_one_not_at_all() {
        let mut t = WaitingTable::new(8, 8, Duration::from_secs(5));
        let now = Instant::now();
        let c = (IpAddr::V4(Ipv4Addr::LOCALHOST), 4000);
        t.insert(c, 1, now).unwrap();
        assert_eq!(t.take(c), Ok(Some(1)));
        assert_eq!(t.take(c), Ok(None));
        t.insert(c, 1, now).unwrap();
        t.insert(c, 2, now).unwrap();
        assert_eq!(t.take(c), Err(vec![1, 2]));
        assert_eq!(t.take(c), Ok(None));
        assert!(t.is_empty());
        t.insert(c, 3, now).unwrap();
        assert_eq!(t.expire(now + Duration::from_secs(6)), vec![3]);
        assert!(t.is_empty());
    }
}
