//! Pairing two TCP connections of one host for an upgrade (sans-IO part).
//!
//! A listener under azsdp registers its address in the network namespace's
//! abstract Unix socket namespace, under [`registry_name`]. A client under
//! azsdp that finds the name connects to it and sends a [`PairRequest`]
//! naming its TCP connection (by the local port it has bound) *before*
//! its TCP `connect()`; the listener's `accept()` matches the accepted
//! connection's peer port against the requests it has, sets up the shm
//! segment over the Unix connection, and both sides agree with one
//! compare-and-swap on the segment's agreement word ([`Agreement`]): the
//! listener commits, or the client, tired of waiting, withdraws. Whoever
//! loses goes on with plain TCP, as does everything when anything fails,
//! so a peer that is not under azsdp never sees a foreign byte.

use std::net::{IpAddr, Ipv4Addr, Ipv6Addr, SocketAddr};

use thiserror::Error;

const MAGIC: [u8; 4] = *b"AZPR";
/// Version of the request format.
pub const VERSION: u16 = 1;
/// Bytes of an encoded [`PairRequest`].
pub const REQUEST_LEN: usize = 4 + 2 + 2 + 16 + 2 + 2 + 4 + 4;

/// What a client asks of a listener.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct PairRequest {
    /// The address the client connects to (the listener's).
    pub dst: SocketAddr,
    /// The port the client's TCP socket is bound to.
    pub client_port: u16,
    /// The client's pid (the listener checks it against the Unix peer
    /// credentials).
    pub client_pid: u32,
}

#[derive(Clone, Debug, PartialEq, Eq, Error)]
pub enum PairError {
    #[error("pair request has {0} bytes, expected {REQUEST_LEN}")]
    Length(usize),
    #[error("not a pair request (bad magic)")]
    Magic,
    #[error("pair request version {0}, this side speaks {VERSION}")]
    Version(u16),
    #[error("pair request names address family {0}")]
    Family(u16),
    #[error("pair request names port 0")]
    PortZero,
    #[error("pair request has non-zero reserved bytes")]
    Reserved,
}

impl PairRequest {
    pub fn emit(&self, out: &mut [u8; REQUEST_LEN]) {
        out[0..4].copy_from_slice(&MAGIC);
        out[4..6].copy_from_slice(&VERSION.to_le_bytes());
        let (family, ip) = match self.dst.ip() {
            IpAddr::V4(a) => (4u16, a.to_ipv6_mapped()),
            IpAddr::V6(a) => (6u16, a),
        };
        out[6..8].copy_from_slice(&family.to_le_bytes());
        out[8..24].copy_from_slice(&ip.octets());
        out[24..26].copy_from_slice(&self.dst.port().to_le_bytes());
        out[26..28].copy_from_slice(&self.client_port.to_le_bytes());
        out[28..32].copy_from_slice(&self.client_pid.to_le_bytes());
        out[32..36].fill(0);
    }

    pub fn parse(b: &[u8]) -> Result<PairRequest, PairError> {
        if b.len() != REQUEST_LEN {
            return Err(PairError::Length(b.len()));
        }
        if b[0..4] != MAGIC {
            return Err(PairError::Magic);
        }
        let u16_at = |i: usize| u16::from_le_bytes([b[i], b[i + 1]]);
        let version = u16_at(4);
        if version != VERSION {
            return Err(PairError::Version(version));
        }
        let mut octets = [0u8; 16];
        octets.copy_from_slice(&b[8..24]);
        let v6 = Ipv6Addr::from(octets);
        let ip = match u16_at(6) {
            4 => IpAddr::V4(v6.to_ipv4_mapped().ok_or(PairError::Family(4))?),
            6 => IpAddr::V6(v6),
            f => return Err(PairError::Family(f)),
        };
        let port = u16_at(24);
        let client_port = u16_at(26);
        if port == 0 || client_port == 0 {
            return Err(PairError::PortZero);
        }
        if b[32..36] != [0; 4] {
            return Err(PairError::Reserved);
        }
        Ok(PairRequest {
            dst: SocketAddr::new(ip, port),
            client_port,
            client_pid: u32::from_le_bytes([b[28], b[29], b[30], b[31]]),
        })
    }
}

/// The abstract Unix socket name (without the leading NUL) under which a
/// listener on `addr` registers. Wildcard listeners register under the
/// unspecified address of their family; a client tries the exact address
/// first, then the wildcards ([`registry_candidates`]).
pub fn registry_name(addr: SocketAddr) -> String {
    let ip = match addr.ip() {
        IpAddr::V6(a) => match a.to_ipv4_mapped() {
            Some(v4) if !a.is_unspecified() => IpAddr::V4(v4),
            _ => IpAddr::V6(a),
        },
        ip => ip,
    };
    format!("azsdp/v{VERSION}/tcp/{ip}/{}", addr.port())
}

/// Names to try, in order, for a connection to `dst`.
pub fn registry_candidates(dst: SocketAddr) -> Vec<String> {
    let port = dst.port();
    let mut v = vec![registry_name(dst)];
    let any4 = registry_name(SocketAddr::new(IpAddr::V4(Ipv4Addr::UNSPECIFIED), port));
    let any6 = registry_name(SocketAddr::new(IpAddr::V6(Ipv6Addr::UNSPECIFIED), port));
    let is_v4 = matches!(dst.ip(), IpAddr::V4(_))
        || matches!(dst.ip(), IpAddr::V6(a) if a.to_ipv4_mapped().is_some());
    if is_v4 {
        // A dual-stack [::] listener takes IPv4 connections too.
        v.push(any4);
        v.push(any6);
    } else {
        v.push(any6);
    }
    v.dedup();
    v
}

/// Values of the segment's agreement word.
#[derive(Debug)]
pub struct Agreement;

impl Agreement {
    pub const UNDECIDED: u32 = 0;
    /// The listener accepted the TCP connection and goes ahead.
    pub const COMMITTED: u32 = 1;
    /// The client gave up waiting and stays on TCP.
    pub const WITHDRAWN: u32 = 2;
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    fn addr() -> impl Strategy<Value = SocketAddr> {
        prop_oneof![
            (any::<u32>(), 1u16..).prop_map(|(a, p)| SocketAddr::new(Ipv4Addr::from(a).into(), p)),
            (any::<u128>(), 1u16..).prop_map(|(a, p)| {
                let v6 = Ipv6Addr::from(a);
                // A mapped address in a v6 request would come back as v4.
                let v6 = if v6.to_ipv4_mapped().is_some() {
                    Ipv6Addr::LOCALHOST
                } else {
                    v6
                };
                SocketAddr::new(v6.into(), p)
            }),
        ]
    }

    proptest! {
        #[test]
        fn requests_round_trip(dst in addr(), client_port in 1u16.., client_pid: u32) {
            let r = PairRequest { dst, client_port, client_pid };
            let mut b = [0u8; REQUEST_LEN];
            r.emit(&mut b);
            prop_assert_eq!(PairRequest::parse(&b), Ok(r));
        }

        #[test]
        fn garbage_is_an_error_not_a_panic(b in proptest::collection::vec(any::<u8>(), 0..64)) {
            let _ = PairRequest::parse(&b);
        }

        #[test]
        fn a_corrupted_magic_or_version_is_refused(i in 0usize..6, x in 1u8..) {
            let r = PairRequest { dst: "127.0.0.1:80".parse().unwrap(), client_port: 5, client_pid: 1 };
            let mut b = [0u8; REQUEST_LEN];
            r.emit(&mut b);
            b[i] ^= x;
            prop_assert!(PairRequest::parse(&b).is_err());
        }

        #[test]
        fn a_corrupted_byte_never_reads_as_the_same_request(i in 0usize..REQUEST_LEN, x in 1u8..) {
            let r = PairRequest { dst: "127.0.0.1:80".parse().unwrap(), client_port: 5, client_pid: 1 };
            let mut b = [0u8; REQUEST_LEN];
            r.emit(&mut b);
            b[i] ^= x;
            prop_assert_ne!(PairRequest::parse(&b), Ok(r));
        }
    }

    #[test]
    fn bad_fields_are_named() {
        let r = PairRequest {
            dst: "127.0.0.1:80".parse().unwrap(),
            client_port: 5,
            client_pid: 1,
        };
        let mut b = [0u8; REQUEST_LEN];
        r.emit(&mut b);
        assert_eq!(PairRequest::parse(&b[..10]), Err(PairError::Length(10)));
        let mut z = b;
        z[26] = 0;
        z[27] = 0;
        assert_eq!(PairRequest::parse(&z), Err(PairError::PortZero));
        let mut z = b;
        z[35] = 1;
        assert_eq!(PairRequest::parse(&z), Err(PairError::Reserved));
        let mut z = b;
        z[8] = 1; // an IPv4 request whose address is not v4-mapped
        assert_eq!(PairRequest::parse(&z), Err(PairError::Family(4)));
    }

    #[test]
    fn names_and_candidates() {
        let v4: SocketAddr = "127.0.0.1:6379".parse().unwrap();
        assert_eq!(registry_name(v4), "azsdp/v1/tcp/127.0.0.1/6379");
        let mapped: SocketAddr = "[::ffff:127.0.0.1]:6379".parse().unwrap();
        assert_eq!(registry_name(mapped), registry_name(v4));
        assert_eq!(
            registry_candidates(v4),
            vec![
                "azsdp/v1/tcp/127.0.0.1/6379",
                "azsdp/v1/tcp/0.0.0.0/6379",
                "azsdp/v1/tcp/::/6379"
            ]
        );
        let v6: SocketAddr = "[::1]:80".parse().unwrap();
        assert_eq!(
            registry_candidates(v6),
            vec!["azsdp/v1/tcp/::1/80", "azsdp/v1/tcp/::/80"]
        );
    }
}
