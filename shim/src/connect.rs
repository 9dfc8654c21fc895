//! The client side of pairing, run inside the program's `connect()`.
//!
//! Before anything goes to the listener's registry, the kernel must say
//! that the registry's owner is the user who owns the listening socket this
//! connection will reach (a name anyone can bind proves nothing by itself).
//! The listener's answer must then carry the very socket `accept()` gave it
//! for this connection. Anything short of that leaves the connection on TCP
//! with a reason.

use std::net::{IpAddr, Ipv4Addr, Ipv6Addr, SocketAddr};
use std::os::fd::{AsFd, AsRawFd, BorrowedFd, OwnedFd};
use std::sync::Arc;
use std::time::{Duration, Instant};

use azsdp::config::{FabricChoice, Settings, Use};
use azsdp::fabric::shm::{send_intro, send_note};
use azsdp::identity::Received;
use azsdp::listener_proofs::ProvenListeners;
use azsdp::pair_history::PairHistory;
use azsdp::pairing::{Intro, IntroKind, PairTarget, registry_candidates};
use azsdp::sock_diag::{self, Netns};
use azsdp::stats::TcpReason;
use azsdp::transport::{Offer, Transport};
use libc::c_int;

use crate::conn::Conn;
use crate::conn::{Active, transport};
use crate::listener::{abstract_addr, peer_cred, seqpacket_with};
use crate::log::{debug, info};
use crate::net;
use crate::real;

/// What this process's connections to each destination made of their
/// pairs (`azsdp::pair_history`).
static HISTORY: azsdp::sync::Lock<PairHistory> = azsdp::sync::Lock::new(PairHistory::new());

/// Listeners the kernel said a registry's owner owns, a moment ago.
static PROVEN: azsdp::sync::Lock<ProvenListeners> = azsdp::sync::Lock::new(ProvenListeners::new());

/// A connection to `dst` that offered ended: did its pair repay it?
pub fn judged(dst: SocketAddr, repaid: bool) {
    HISTORY.lock().record(dst, repaid);
}

/// What came of `connect()`.
pub enum Outcome {
    /// The kernel's answer (return value, errno); the socket is plain TCP
    /// for `reason` (`None`: not connected, e.g. an error).
    Tcp(c_int, c_int, Option<TcpReason>),
    /// Connected and upgraded (over verbs).
    #[cfg_attr(not(feature = "verbs"), allow(dead_code))]
    Azsdp(Arc<Conn>),
    /// The kernel's answer (return value, errno); the offer went to the
    /// listener, whose answer comes later (`crate::pending`).
    Pairing(Box<Offered>),
}

/// A connection whose offer went to the listener (see [`Outcome::Pairing`]).
pub struct Offered {
    /// The kernel's answer (return value, errno).
    pub r: c_int,
    pub e: c_int,
    pub reg: OwnedFd,
    pub offer: <Active as Transport>::Offer,
    pub to: SocketAddr,
    /// The connection's own address (the kernel's port).
    pub local: Option<SocketAddr>,
}

/// A listener's registration that answered and is the listener's: the
/// connected side-channel socket and its owner's pid.
struct Registry {
    sock: OwnedFd,
    pid: u32,
}

/// The registration of the azsdp listener for `dst`: the first name that
/// answers and whose owner the kernel says owns the socket listening for
/// `dst`. `Err(None)`: no name answers; `Err(Some(why))`: names answer,
/// but none is proven to be the listener's (squatted).
fn find_listener(
    dst: SocketAddr,
    patience: Duration,
    tcp: BorrowedFd<'_>,
) -> Result<Registry, NotFound> {
    let mut refused = None;
    let mut busy = false;
    for name in registry_candidates(dst) {
        let Some((a, len)) = abstract_addr(&name) else {
            continue;
        };
        let Ok(sock) = seqpacket_with(0) else {
            continue;
        };
        // A full registry queue (a flood) gets a moment to drain: the
        // listener takes its queue in every 100 ms.
        let t = libc::timeval {
            tv_sec: 0,
            tv_usec: patience.as_micros().min(999_999) as libc::suseconds_t,
        };
        // SAFETY: connect our own socket to our own encoded address, with
        // a send timeout of our own (which bounds a connect's wait).
        let r = unsafe {
            real::setsockopt(
                sock.as_raw_fd(),
                libc::SOL_SOCKET,
                libc::SO_SNDTIMEO,
                (&raw const t).cast(),
                std::mem::size_of::<libc::timeval>() as libc::socklen_t,
            );
            real::connect(sock.as_raw_fd(), (&raw const a).cast(), len)
        };
        if r != 0 {
            // No such name, or none listening on it: no listener. Anything
            // else (its queue full past our patience, on a loaded host)
            // says nothing of whether one is there.
            busy |= !matches!(real::errno(), libc::ECONNREFUSED | libc::ENOENT);
            continue;
        }
        let Some((pid, uid)) = peer_cred(&sock) else {
            continue;
        };
        match owner_of_listener(dst, uid, tcp) {
            Ok(()) => return Ok(Registry { sock, pid }),
            Err(why) => {
                info!(
                    "connect {dst}: @{name} (pid {pid}) is not proven to be the listener's: {why}"
                );
                refused = Some(why);
            }
        }
    }
    Err(match (refused, busy) {
        (Some(_), _) => NotFound::Unverified,
        (None, true) => NotFound::Busy,
        (None, false) => NotFound::None,
    })
}

/// Why [`find_listener`] found no listener to pair with.
enum NotFound {
    /// No registry there: no listener under azsdp.
    None,
    /// A registry whose owner is not proven to be the listener's.
    Unverified,
    /// A registry that did not take our connection in time.
    Busy,
}

/// Does the kernel say (or did it, a moment ago: `azsdp::listener_proofs`)
/// that the registry's owner (`uid`) owns the socket that listens for
/// `dst`? `Err` says why not.
fn owner_of_listener(dst: SocketAddr, uid: u32, tcp: BorrowedFd<'_>) -> Result<(), String> {
    let netns = sock_diag::netns_cookie(tcp);
    let now = Instant::now();
    if let Some(ns) = netns
        && PROVEN.lock().holds(ns, dst, uid, now)
    {
        return Ok(());
    }
    let l = sock_diag::listener_reached(dst, Netns::Of(tcp))
        .map_err(|e| format!("sock_diag: {e}"))?
        .ok_or("no socket listens there")?;
    if l.uid != uid {
        return Err(format!(
            "it is uid {uid}'s, the listening socket is uid {}'s",
            l.uid
        ));
    }
    if let Some(ns) = netns {
        PROVEN.lock().proven(ns, dst, uid, now);
    }
    Ok(())
}

/// An answer for the listener at `dst` did not hold up: prove its owner
/// afresh next time.
pub(crate) fn doubt_listener(dst: SocketAddr) {
    PROVEN.lock().forget(dst);
}

/// The kernel's `connect()`; for a non-blocking socket, wait up to
/// `patience` for it to complete. `Ok(true)`: connected; `Ok(false)`: still
/// in progress; `Err(errno)`.
pub(crate) fn kernel_connect(
    fd: c_int,
    dst: SocketAddr,
    nonblocking: bool,
    patience: Duration,
) -> Result<bool, c_int> {
    let (st, len) = net::to_storage(dst);
    // SAFETY: connect to our own encoded address.
    let r = unsafe { real::connect(fd, (&raw const st).cast(), len) };
    if r == 0 {
        return Ok(true);
    }
    let e = real::errno();
    if !(nonblocking && e == libc::EINPROGRESS) {
        return Err(e);
    }
    if !wait_for(fd, libc::POLLOUT, Instant::now() + patience) {
        return Ok(false);
    }
    match real::so_error(fd) {
        0 => Ok(true),
        err => Err(err),
    }
}

/// Wait until `fd` is ready for `events` or `deadline` passes.
fn wait_for(fd: c_int, events: i16, deadline: Instant) -> bool {
    loop {
        let left = deadline.saturating_duration_since(Instant::now());
        let mut p = libc::pollfd {
            fd,
            events,
            revents: 0,
        };
        // SAFETY: poll of one pollfd we own.
        let n = unsafe { real::poll(&mut p, 1, left.as_millis().min(i32::MAX as u128) as c_int) };
        if n > 0 {
            return true;
        }
        if n == 0 || real::errno() != libc::EINTR {
            return false;
        }
    }
}

/// Is the answer's socket the far end of our connection `fd`, as the
/// kernel knows it?
pub(crate) fn answer_holds_our_peer(fd: c_int, answer: &Received) -> Result<(), String> {
    let Some(accepted) = answer.fds.first() else {
        return Err("the answer carries no socket".into());
    };
    is_far_end(fd, accepted.as_fd())
}

/// Is `accepted` the far end of our connection `fd`?
fn is_far_end(fd: c_int, accepted: BorrowedFd<'_>) -> Result<(), String> {
    if !sock_diag::is_tcp(accepted) {
        return Err("the answer's socket is not TCP".into());
    }
    // SAFETY: `fd` is the program's socket, open for this call.
    let ours = unsafe { BorrowedFd::borrow_raw(fd) };
    // The kernel keeps one connected TCP socket per address four-tuple in
    // a network namespace: a connected socket of ours whose addresses are
    // ours swapped is the far end of our connection (no netlink lookup,
    // a tenth of a pair's client-side CPU). Not our own socket, as a
    // connection to itself would be.
    let (local, peer) = net::local_of(fd)
        .zip(net::peer_of(fd))
        .ok_or("our socket has no addresses")?;
    let namespaces = sock_diag::netns_cookie(ours).zip(sock_diag::netns_cookie(accepted));
    let Some((here, there)) = namespaces else {
        // A kernel older than 5.14 (no SO_NETNS_COOKIE): ask sock_diag.
        return far_end_is(accepted, local, peer, ours);
    };
    if here != there {
        return Err("the answer's socket is in another network namespace".into());
    }
    let (their_local, their_peer) = net::local_of(accepted.as_raw_fd())
        .zip(net::peer_of(accepted.as_raw_fd()))
        .ok_or("the answer's socket is not connected")?;
    if !net::same_addr(their_local, peer) || !net::same_addr(their_peer, local) {
        return Err("the answer's socket is not the far end of our connection".into());
    }
    let theirs = sock_diag::cookie_of(accepted).map_err(|e| e.to_string())?;
    if sock_diag::cookie_of(ours).is_ok_and(|c| c == theirs) {
        return Err("the answer's socket is our own".into());
    }
    Ok(())
}

/// Is `accepted` the far end of our connection `local` -> `peer` (the
/// netlink lookup)?
fn far_end_is(
    accepted: BorrowedFd<'_>,
    local: SocketAddr,
    peer: SocketAddr,
    ours: BorrowedFd<'_>,
) -> Result<(), String> {
    let theirs = sock_diag::cookie_of(accepted).map_err(|e| e.to_string())?;
    let far = sock_diag::far_end(local, peer, Netns::Of(ours))
        .map_err(|e| format!("sock_diag: {e}"))?
        .ok_or("the kernel knows no far end of our connection")?;
    if far.cookie != theirs {
        return Err("the answer's socket is not the far end of our connection".into());
    }
    Ok(())
}

/// Where a connection to `dst` goes: Linux delivers one to the unspecified
/// address on this host's loopback.
fn effective_dst(dst: SocketAddr) -> SocketAddr {
    match net::canonical(dst.ip()) {
        IpAddr::V4(a) if a.is_unspecified() => {
            SocketAddr::new(Ipv4Addr::LOCALHOST.into(), dst.port())
        }
        IpAddr::V6(a) if a.is_unspecified() => {
            SocketAddr::new(Ipv6Addr::LOCALHOST.into(), dst.port())
        }
        _ => dst,
    }
}

/// `connect(fd, dst)` for a socket under azsdp with `settings`.
pub fn connect(
    fd: c_int,
    family: c_int,
    dst: SocketAddr,
    nonblocking: bool,
    settings: &Settings,
) -> Outcome {
    let plain = |reason: TcpReason| {
        let r = kernel_connect(fd, dst, false, Duration::ZERO);
        match r {
            Ok(_) => Outcome::Tcp(0, 0, Some(reason)),
            // Under way (a non-blocking socket): a TCP connection all the same.
            Err(libc::EINPROGRESS) => Outcome::Tcp(-1, libc::EINPROGRESS, Some(reason)),
            Err(e) => Outcome::Tcp(-1, e, None),
        }
    };
    #[cfg(not(feature = "verbs"))]
    let _ = (nonblocking, family);
    if settings.use_ == Use::Tcp {
        return plain(TcpReason::Rule);
    }
    let to = effective_dst(dst);
    let remote = !net::is_local(to.ip());
    // Asked first: a connection that will not offer needs no other look.
    // (A rule that says azsdp only always offers.)
    let on_shm = !remote && settings.fabric != FabricChoice::Verbs;
    let judged = on_shm && !settings.pair_every_connection && settings.use_ != Use::Azsdp;
    if judged && !HISTORY.lock().offer(to) {
        return plain(TcpReason::NotWorthPairing);
    }
    if azsdp::sandbox::restricted() {
        // No thread may start here to run a connection.
        return plain(TcpReason::Sandboxed);
    }
    if settings.fabric == FabricChoice::Verbs || (remote && settings.fabric == FabricChoice::Auto) {
        #[cfg(feature = "verbs")]
        return crate::verbs_pairing::connect(fd, family, to, nonblocking, settings, &plain);
        #[cfg(not(feature = "verbs"))]
        return plain(if remote {
            TcpReason::PeerRemote
        } else {
            TcpReason::NoRdmaDevice
        });
    }
    if remote {
        return plain(TcpReason::PeerRemote);
    }
    // SAFETY: `fd` is the program's socket, open for this call.
    let tcp = unsafe { BorrowedFd::borrow_raw(fd) };
    let found = find_listener(
        to,
        (settings.pair_timeout / 4).min(Duration::from_millis(150)),
        tcp,
    );
    // (A busy registry is the listener's burst, not its absence: counted,
    // it made every connection of a client that met one on a loaded host
    // skip the listener, as pair_history skips a destination without one.)
    if matches!(found, Err(NotFound::None | NotFound::Unverified)) {
        HISTORY.lock().record_no_listener(to);
    }
    let reg = match found {
        Ok(reg) => reg,
        Err(_) if settings.use_ == Use::Azsdp => {
            debug!("connect {dst}: no azsdp listener and the rule says azsdp only");
            return Outcome::Tcp(-1, libc::ECONNREFUSED, None);
        }
        Err(NotFound::None) => return plain(TcpReason::PeerNotAzsdp),
        Err(NotFound::Unverified) => return plain(TcpReason::PeerUnverified),
        Err(NotFound::Busy) => return plain(TcpReason::ListenerBusy),
    };
    // No bind: the kernel picks the port at `connect()`, as it would on
    // TCP (a bind's search of the port range grows with every socket bound
    // and takes a port from every destination). The cookie names the
    // connection; the listener finds it at the far end of what it accepts.
    let Ok(cookie) = sock_diag::cookie_of(tcp) else {
        return plain(TcpReason::SetupFailed);
    };
    let offer = match transport(settings, fd).offer(reg.pid) {
        Ok(o) => o,
        Err(e) => {
            debug!("connect {dst}: no offer: {e}");
            return plain(TcpReason::SetupFailed);
        }
    };
    let intro = Intro {
        kind: IntroKind::Offer,
        page_size: azsdp::pages::system_page_size() as u32,
        pair: Some(PairTarget { dst: to, cookie }),
        bell: offer.note(),
    };
    if let Err(e) = send_intro(reg.sock.as_fd(), &intro, &offer.fds(), true) {
        debug!("connect {dst}: offer not sent: {e}");
        // The listener closed our registry connection unread: it held all
        // the pending offers its limits allow.
        let refused = matches!(e.raw_os_error(), Some(libc::EPIPE | libc::ECONNRESET));
        return plain(if refused {
            TcpReason::ListenerBusy
        } else {
            TcpReason::SetupFailed
        });
    }
    // From here the listener may match us. Nothing here waits for it:
    // the connection is TCP until the pair completes at one of the
    // program's calls (`crate::pending`), or stays TCP.
    let (st, len) = net::to_storage(dst);
    // SAFETY: connect to our own encoded address.
    let r = unsafe { real::connect(fd, (&raw const st).cast(), len) };
    let e = if r == 0 { 0 } else { real::errno() };
    if r != 0 && e != libc::EINPROGRESS {
        // (The listener matches nothing: no connection reaches it.)
        crate::pending::withdraw(offer.agreement());
        return Outcome::Tcp(-1, e, None);
    }
    // The port is the kernel's now: the note tells the listener which
    // connection of those it accepts is this one, sparing it a question
    // to the kernel for every other (protocol §10). Lost, it costs only
    // that question.
    let local = net::local_of(fd);
    if let Some(from) = local {
        let note = Intro {
            kind: IntroKind::Connected,
            page_size: intro.page_size,
            pair: Some(PairTarget { dst: from, cookie }),
            bell: None,
        };
        if let Err(e) = send_note(reg.sock.as_fd(), &note) {
            debug!("connect {dst}: note not sent: {e}");
        }
    }
    debug!(
        "connect {dst}: offer sent to pid {}, pairing in the background",
        reg.pid
    );
    Outcome::Pairing(Box::new(Offered {
        r,
        e,
        reg: reg.sock,
        offer,
        to,
        local,
    }))
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::net::{TcpListener, TcpStream, UdpSocket};

    /// Only the far end of our connection passes: not our own socket, not
    /// the far end of another connection to the same listener, not a
    /// socket that is not connected, not a socket of another kind.
    #[test]
    fn only_the_far_end_of_our_connection_is_taken_for_it() {
        let l = TcpListener::bind("127.0.0.1:0").unwrap();
        let ours = TcpStream::connect(l.local_addr().unwrap()).unwrap();
        let (far, _) = l.accept().unwrap();
        let other = TcpStream::connect(l.local_addr().unwrap()).unwrap();
        let (other_far, _) = l.accept().unwrap();
        let fd = ours.as_raw_fd();
        assert_eq!(is_far_end(fd, far.as_fd()), Ok(()));
        assert!(is_far_end(fd, ours.as_fd()).is_err(), "our own");
        assert!(is_far_end(fd, other_far.as_fd()).is_err(), "another's");
        assert!(is_far_end(fd, other.as_fd()).is_err(), "another client");
        assert!(is_far_end(fd, l.as_fd()).is_err(), "not connected");
        let udp = UdpSocket::bind("127.0.0.1:0").unwrap();
        assert!(is_far_end(fd, udp.as_fd()).is_err(), "not TCP");
        // The far end of the other connection is its far end.
        assert_eq!(is_far_end(other.as_raw_fd(), other_far.as_fd()), Ok(()));
    }
}
