//! Pairing two TCP connections of one host for an upgrade (sans-IO part):
//! the side channel's message format and the registry's names.
//!
//! A listener under azsdp registers its address in the network namespace's
//! abstract Unix namespace, under [`registry_name`] (a `SOCK_SEQPACKET`
//! socket, so every message arrives whole). A client under azsdp that finds
//! the name, and has checked with the kernel that its owner runs as the user
//! who owns the listening TCP socket, sends an [`Intro`] of kind
//! [`IntroKind::Offer`] *before* its TCP `connect()`. The offer carries the
//! client's kernel identity (credentials and a pidfd, see
//! [`crate::identity`]), the shm segment it made, and its TCP socket itself:
//! holding the descriptor is the proof of holding the socket, which the
//! listener matches by cookie with the far end of the connection `accept()`
//! returned (`crate::sock_diag`). The listener answers ([`IntroKind::Answer`])
//! with its own identity and the accepted socket, which the client checks the
//! same way, and both agree with one compare-and-swap on the segment's
//! agreement word ([`Agreement`]): the listener commits, or the client,
//! tired of waiting or not satisfied, withdraws. Whoever loses goes on with
//! plain TCP, as does everything when anything fails, so a peer that is not
//! under azsdp never sees a foreign byte.
//!
//! Right after its `connect()`, when the kernel has given its socket a
//! port, the client adds a [`IntroKind::Connected`] note on the same
//! stream: the address its connection comes from. A listener holding
//! offers then knows, from the address `accept()` gives it, which of them
//! can be the accepted connection's without asking the kernel; the kernel
//! is still asked before any offer is taken up (the note is a claim too).
//!
//! After the pair is made, the same socket carries [`IntroKind::Claim`]s:
//! a process that takes over one side of the connection after `fork()` says
//! so with its kernel identity, and the peer follows it only then.

use std::net::{IpAddr, Ipv4Addr, Ipv6Addr, SocketAddr};

use thiserror::Error;

const MAGIC: [u8; 4] = *b"AZBT";
/// Version of the side channel's format and of the registry names (6: a
/// bell is named with its descriptor number, for a receiver that takes it
/// from the sender's process itself; 5: an offer or answer names its
/// sender's bell, and passes it only to a process that does not keep it
/// already; 4 named an offer's connection by cookie alone; 3 began
/// connections on TCP, docs/protocol.md §8b).
pub const VERSION: u16 = 6;
/// Bytes of an encoded [`Intro`].
pub const INTRO_LEN: usize = 56;

/// What an [`Intro`] is for.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum IntroKind {
    /// From the side that made the shm segment (it travels with it).
    Offer,
    /// From the side that mapped the offered segment.
    Answer,
    /// From a process taking over its side after a fork.
    Claim,
    /// From a client after its `connect()`, on its offer's stream: its
    /// connection's own address (in `pair.dst`) and its socket's cookie.
    /// No identity or descriptors travel with it.
    Connected,
    /// Mail on a peer's bell: the writing end of one of the sender's loop
    /// bells (`fabric::shm::loop_bell`), with this id (never 0).
    LoopBell(u32),
}

impl IntroKind {
    fn code(self) -> u8 {
        match self {
            IntroKind::Offer => 1,
            IntroKind::Answer => 2,
            IntroKind::Claim => 3,
            IntroKind::Connected => 4,
            IntroKind::LoopBell(_) => 5,
        }
    }
}

/// One side-channel message. The sender's identity and descriptors travel
/// beside it as control messages, never in it.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Intro {
    pub kind: IntroKind,
    /// The sender's page size.
    pub page_size: u32,
    /// For a client's offer: the address its TCP connection goes to (the
    /// listener's) and the cookie of its socket. For its
    /// [`IntroKind::Connected`] note: the address the connection comes
    /// from, and the same cookie.
    pub pair: Option<PairTarget>,
    /// For an offer or answer of the shm fabric: the sender's bell.
    pub bell: Option<BellNote>,
}

/// The TCP connection an offer is about.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct PairTarget {
    pub dst: SocketAddr,
    /// The kernel's cookie of the client's TCP socket (`SO_COOKIE`). A
    /// claim, not a proof: the listener matches it with the far end of the
    /// accepted connection and checks that the kernel says that socket
    /// belongs to the offer's (kernel-verified) user. The client's port is
    /// not named: the kernel picks it at `connect()`, after the offer.
    pub cookie: u64,
}

/// What an offer or answer says of the two processes' bells (the
/// sockets their reactors are rung on, docs/protocol.md §10): a process
/// passes its bell to a peer process once, and names it after that. Each
/// side states only what it holds itself.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct BellNote {
    /// The sender's bell (its socket's inode number; never 0).
    pub id: u32,
    /// Not passed: the receiver said it keeps it, or that it takes it from
    /// the sender's process itself.
    pub held: bool,
    /// The receiver's bell that the sender keeps (0: none).
    pub keeps: u32,
    /// The sender's descriptor number of its bell, for a receiver that
    /// takes it from the sender's process itself (`pidfd_getfd`; the
    /// receiver checks that it is the bell named).
    pub fd: u32,
    /// The sender takes the receiver's bell from the receiver's process
    /// itself: a reply need not pass it.
    pub fetches: bool,
}

impl BellNote {
    const HELD: u8 = 1;
    const FETCHES: u8 = 2;
}

#[derive(Clone, Debug, PartialEq, Eq, Error)]
pub enum PairError {
    #[error("side-channel message has {0} bytes, expected {INTRO_LEN}")]
    Length(usize),
    #[error("not an azsdp side-channel message (bad magic)")]
    Magic,
    #[error("side-channel version {0}, this side speaks {VERSION}")]
    Version(u16),
    #[error("unknown side-channel message kind {0}")]
    Kind(u8),
    #[error("side-channel message names address family {0}")]
    Family(u8),
    #[error("side-channel message names port 0")]
    PortZero,
    #[error("page size {0} is not a power of two from 4 KiB to 1 GiB")]
    PageSize(u32),
    #[error("side-channel message has non-zero reserved bytes")]
    Reserved,
    #[error("side-channel message says of bells without naming its own")]
    BellFlags,
    #[error("side-channel message names descriptor {0} for its bell")]
    BellFd(u32),
}

impl Intro {
    pub fn new(kind: IntroKind, page_size: u32) -> Intro {
        Intro {
            kind,
            page_size,
            pair: None,
            bell: None,
        }
    }

    /// Does a message of this kind name its sender's bell?
    fn names_a_bell(kind: IntroKind) -> bool {
        matches!(kind, IntroKind::Offer | IntroKind::Answer)
    }

    pub fn emit(&self, out: &mut [u8; INTRO_LEN]) {
        out.fill(0);
        out[0..4].copy_from_slice(&MAGIC);
        out[4..6].copy_from_slice(&VERSION.to_le_bytes());
        out[6] = self.kind.code();
        if let IntroKind::LoopBell(id) = self.kind {
            out[40..44].copy_from_slice(&id.to_le_bytes());
        }
        if let Some(b) = self
            .bell
            .filter(|b| b.id != 0 && Intro::names_a_bell(self.kind))
        {
            out[30] = if b.held { BellNote::HELD } else { 0 }
                | if b.fetches { BellNote::FETCHES } else { 0 };
            out[40..44].copy_from_slice(&b.id.to_le_bytes());
            out[44..48].copy_from_slice(&b.keeps.to_le_bytes());
            out[48..52].copy_from_slice(&b.fd.to_le_bytes());
        }
        out[8..12].copy_from_slice(&self.page_size.to_le_bytes());
        if let Some(p) = self.pair {
            let (family, ip) = match p.dst.ip() {
                IpAddr::V4(a) => (4u8, a.to_ipv6_mapped()),
                IpAddr::V6(a) => (6u8, a),
            };
            out[7] = family;
            out[12..28].copy_from_slice(&ip.octets());
            out[28..30].copy_from_slice(&p.dst.port().to_le_bytes());
            out[32..40].copy_from_slice(&p.cookie.to_le_bytes());
        }
    }

    pub fn parse(b: &[u8]) -> Result<Intro, PairError> {
        if b.len() != INTRO_LEN {
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
        let kind = match b[6] {
            1 => IntroKind::Offer,
            2 => IntroKind::Answer,
            3 => IntroKind::Claim,
            4 => IntroKind::Connected,
            5 => match u32::from_le_bytes([b[40], b[41], b[42], b[43]]) {
                0 => return Err(PairError::Reserved),
                id => IntroKind::LoopBell(id),
            },
            k => return Err(PairError::Kind(k)),
        };
        let page_size = u32::from_le_bytes([b[8], b[9], b[10], b[11]]);
        if !page_size.is_power_of_two() || !(4096..=1 << 30).contains(&page_size) {
            return Err(PairError::PageSize(page_size));
        }
        let names_a_bell = Intro::names_a_bell(kind);
        let reserved_from = match kind {
            IntroKind::LoopBell(_) => 44,
            _ if names_a_bell => 52,
            _ => 40,
        };
        let flags_ok =
            b[30] == 0 || (names_a_bell && b[30] & !(BellNote::HELD | BellNote::FETCHES) == 0);
        if !flags_ok || b[31] != 0 || b[reserved_from..].iter().any(|&x| x != 0) {
            return Err(PairError::Reserved);
        }
        let u32_at = |i: usize| u32::from_le_bytes([b[i], b[i + 1], b[i + 2], b[i + 3]]);
        let bell = if names_a_bell {
            match u32_at(40) {
                0 if b[30] != 0 || u32_at(44) != 0 || u32_at(48) != 0 => {
                    return Err(PairError::BellFlags);
                }
                0 => None,
                _ if u32_at(48) > i32::MAX as u32 => return Err(PairError::BellFd(u32_at(48))),
                id => Some(BellNote {
                    id,
                    held: b[30] & BellNote::HELD != 0,
                    keeps: u32_at(44),
                    fd: u32_at(48),
                    fetches: b[30] & BellNote::FETCHES != 0,
                }),
            }
        } else {
            None
        };
        let mut c = [0u8; 8];
        c.copy_from_slice(&b[32..40]);
        let cookie = u64::from_le_bytes(c);
        let mut octets = [0u8; 16];
        octets.copy_from_slice(&b[12..28]);
        let v6 = Ipv6Addr::from(octets);
        let port = u16_at(28);
        let pair = match b[7] {
            0 if v6.is_unspecified() && port == 0 && cookie == 0 => None,
            0 => return Err(PairError::Reserved),
            f @ (4 | 6) => {
                let ip = if f == 4 {
                    IpAddr::V4(v6.to_ipv4_mapped().ok_or(PairError::Family(4))?)
                } else {
                    IpAddr::V6(v6)
                };
                if port == 0 {
                    return Err(PairError::PortZero);
                }
                Some(PairTarget {
                    dst: SocketAddr::new(ip, port),
                    cookie,
                })
            }
            f => return Err(PairError::Family(f)),
        };
        Ok(Intro {
            kind,
            page_size,
            pair,
            bell,
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
    /// The client gave up waiting (or was not satisfied) and stays on TCP.
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
                // A mapped address in a v6 message would come back as v4.
                let v6 = if v6.to_ipv4_mapped().is_some() {
                    Ipv6Addr::LOCALHOST
                } else {
                    v6
                };
                SocketAddr::new(v6.into(), p)
            }),
        ]
    }

    fn intro() -> impl Strategy<Value = Intro> {
        (
            prop_oneof![
                Just(IntroKind::Offer),
                Just(IntroKind::Answer),
                Just(IntroKind::Claim),
                Just(IntroKind::Connected),
                (1u32..).prop_map(IntroKind::LoopBell)
            ],
            12u32..=30,
            proptest::option::of((addr(), any::<u64>())),
            proptest::option::of((
                1u32..,
                any::<bool>(),
                any::<u32>(),
                0..=i32::MAX as u32,
                any::<bool>(),
            )),
        )
            .prop_map(|(kind, shift, pair, bell)| Intro {
                kind,
                page_size: 1 << shift,
                pair: pair.map(|(dst, cookie)| PairTarget { dst, cookie }),
                bell: bell.filter(|_| Intro::names_a_bell(kind)).map(
                    |(id, held, keeps, fd, fetches)| BellNote {
                        id,
                        held,
                        keeps,
                        fd,
                        fetches,
                    },
                ),
            })
    }

    fn offer() -> Intro {
        Intro {
            kind: IntroKind::Offer,
            page_size: 4096,
            pair: Some(PairTarget {
                dst: "127.0.0.1:80".parse().unwrap(),
                cookie: 77,
            }),
            bell: Some(BellNote {
                id: 9,
                held: false,
                keeps: 4,
                fd: 12,
                fetches: true,
            }),
        }
    }

    proptest! {
        #[test]
        fn intros_round_trip(i in intro()) {
            let mut b = [0u8; INTRO_LEN];
            i.emit(&mut b);
            prop_assert_eq!(Intro::parse(&b), Ok(i));
        }

        #[test]
        fn garbage_is_an_error_not_a_panic(b in proptest::collection::vec(any::<u8>(), 0..64)) {
            let _ = Intro::parse(&b);
        }

        #[test]
        fn a_corrupted_magic_or_version_is_refused(i in 0usize..6, x in 1u8..) {
            let mut b = [0u8; INTRO_LEN];
            offer().emit(&mut b);
            b[i] ^= x;
            prop_assert!(Intro::parse(&b).is_err());
        }

        #[test]
        fn a_corrupted_byte_never_reads_as_the_same_message(i in 0usize..INTRO_LEN, x in 1u8..) {
            let mut b = [0u8; INTRO_LEN];
            offer().emit(&mut b);
            b[i] ^= x;
            prop_assert_ne!(Intro::parse(&b), Ok(offer()));
        }
    }

    #[test]
    fn bad_fields_are_named() {
        let mut b = [0u8; INTRO_LEN];
        offer().emit(&mut b);
        assert_eq!(Intro::parse(&b[..10]), Err(PairError::Length(10)));
        let mut z = b;
        z[28] = 0;
        z[29] = 0;
        assert_eq!(Intro::parse(&z), Err(PairError::PortZero));
        let mut z = b;
        z[30] = 5; // where version 3 named the client's port
        assert_eq!(Intro::parse(&z), Err(PairError::Reserved));
        let mut z = b;
        z[30] = 4; // a bell flag no version defines
        assert_eq!(Intro::parse(&z), Err(PairError::Reserved));
        let mut z = b;
        z[51] = 0x80; // no descriptor number is negative
        assert_eq!(Intro::parse(&z), Err(PairError::BellFd(0x8000_000c)));
        let mut z = b;
        z[52] = 1; // past the bell's bytes
        assert_eq!(Intro::parse(&z), Err(PairError::Reserved));
        let mut z = b;
        z[40] = 0; // says what it keeps, but names no bell of its own
        assert_eq!(Intro::parse(&z), Err(PairError::BellFlags));
        let mut z = b;
        z[6] = 3; // a claim names no bells in its header
        assert_eq!(Intro::parse(&z), Err(PairError::Reserved));
        let mut z = b;
        z[6] = 4; // nor does a note
        z[44] = 0;
        assert_eq!(Intro::parse(&z), Err(PairError::Reserved));
        let mut z = b;
        z[12] = 1; // an IPv4 message whose address is not v4-mapped
        assert_eq!(Intro::parse(&z), Err(PairError::Family(4)));
        let mut z = b;
        z[6] = 9;
        assert_eq!(Intro::parse(&z), Err(PairError::Kind(9)));
        let mut z = b;
        z[9] = 0x30;
        assert!(matches!(Intro::parse(&z), Err(PairError::PageSize(_))));
        let mut z = b;
        z[7] = 0; // no pair, but an address
        assert_eq!(Intro::parse(&z), Err(PairError::Reserved));
    }

    #[test]
    fn names_and_candidates() {
        let v4: SocketAddr = "127.0.0.1:6379".parse().unwrap();
        assert_eq!(registry_name(v4), "azsdp/v6/tcp/127.0.0.1/6379");
        let mapped: SocketAddr = "[::ffff:127.0.0.1]:6379".parse().unwrap();
        assert_eq!(registry_name(mapped), registry_name(v4));
        assert_eq!(
            registry_candidates(v4),
            vec![
                "azsdp/v6/tcp/127.0.0.1/6379",
                "azsdp/v6/tcp/0.0.0.0/6379",
                "azsdp/v6/tcp/::/6379"
            ]
        );
        let v6: SocketAddr = "[::1]:80".parse().unwrap();
        assert_eq!(
            registry_candidates(v6),
            vec!["azsdp/v6/tcp/::1/80", "azsdp/v6/tcp/::/80"]
        );
    }
}
