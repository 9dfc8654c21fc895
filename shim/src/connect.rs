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
use std::sync::atomic::{AtomicU32, Ordering};
use std::time::{Duration, Instant};

use azsdp::config::{FabricChoice, Settings, Use};
use azsdp::conn::Role;
use azsdp::fabric::shm::{recv_intro, send_intro};
use azsdp::identity::Received;
use azsdp::pairing::{Agreement, Intro, IntroKind, PairTarget, registry_candidates};
use azsdp::sock_diag;
use azsdp::stats::TcpReason;
use azsdp::transport::{Offer, Transport};
use libc::c_int;

use crate::conn::Conn;
use crate::conn::{Active, transport};
use crate::endpoint::AnyEndpoint;
use crate::listener::{abstract_addr, peer_cred, seqpacket_with};
use crate::log::{debug, info, warning};
use crate::net;
use crate::real;

/// What came of `connect()`.
pub enum Outcome {
    /// The kernel's answer (return value, errno); the socket is plain TCP
    /// for `reason` (`None`: not connected, e.g. an error).
    Tcp(c_int, c_int, Option<TcpReason>),
    /// Connected and upgraded.
    Azsdp(Arc<Conn>),
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
fn find_listener(dst: SocketAddr, patience: Duration) -> Result<Registry, Option<String>> {
    let mut refused = None;
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
            continue;
        }
        let Some((pid, uid)) = peer_cred(&sock) else {
            continue;
        };
        match owner_of_listener(dst, uid) {
            Ok(()) => return Ok(Registry { sock, pid }),
            Err(why) => {
                info!(
                    "connect {dst}: @{name} (pid {pid}) is not proven to be the listener's: {why}"
                );
                refused = Some(why);
            }
        }
    }
    Err(refused)
}

/// Does the kernel say the registry's owner (`uid`) owns the socket that
/// listens for `dst`? `Err` says why not.
fn owner_of_listener(dst: SocketAddr, uid: u32) -> Result<(), String> {
    let ls = sock_diag::listeners(dst.port()).map_err(|e| format!("sock_diag: {e}"))?;
    let l = sock_diag::listener_for(&ls, dst).ok_or("no socket listens there")?;
    if l.uid != uid {
        return Err(format!(
            "it is uid {uid}'s, the listening socket is uid {}'s",
            l.uid
        ));
    }
    Ok(())
}

/// Bind `fd` to an ephemeral port if the program did not bind it; the
/// port names the connection in the offer.
pub(crate) fn ensure_port(fd: c_int, family: c_int) -> Option<u16> {
    if let Some(a) = net::local_of(fd)
        && a.port() != 0
    {
        return Some(a.port());
    }
    let any = if family == libc::AF_INET6 {
        SocketAddr::new(IpAddr::V6(Ipv6Addr::UNSPECIFIED), 0)
    } else {
        SocketAddr::new(IpAddr::V4(Ipv4Addr::UNSPECIFIED), 0)
    };
    let (st, len) = net::to_storage(any);
    // SAFETY: bind to our own encoded address.
    let r = unsafe { real::bind(fd, (&raw const st).cast(), len) };
    if r != 0 {
        return None;
    }
    net::local_of(fd).map(|a| a.port()).filter(|p| *p != 0)
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
    let mut err: c_int = 0;
    let mut len = std::mem::size_of::<c_int>() as libc::socklen_t;
    // SAFETY: SO_ERROR into our own int.
    unsafe {
        real::getsockopt(
            fd,
            libc::SOL_SOCKET,
            libc::SO_ERROR,
            (&raw mut err).cast(),
            &mut len,
        )
    };
    if err != 0 { Err(err) } else { Ok(true) }
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

/// The listener's answer, by `deadline`.
fn await_answer(reg: BorrowedFd<'_>, deadline: Instant) -> Result<(Intro, Received), String> {
    loop {
        match recv_intro(reg, IntroKind::Answer, true) {
            Err(e) if e.would_block() => {
                if !wait_for(reg.as_raw_fd(), libc::POLLIN, deadline) {
                    return Err("no answer in time".into());
                }
            }
            r => return r.map_err(|e| e.to_string()),
        }
    }
}

/// Is the answer's socket the far end of our connection `fd`, as the
/// kernel knows it?
fn answer_holds_our_peer(fd: c_int, answer: &Received) -> Result<(), String> {
    let Some(accepted) = answer.fds.first() else {
        return Err("the answer carries no socket".into());
    };
    if !sock_diag::is_tcp(accepted.as_fd()) {
        return Err("the answer's socket is not TCP".into());
    }
    let theirs = sock_diag::cookie_of(accepted.as_fd()).map_err(|e| e.to_string())?;
    let (local, peer) = net::local_of(fd)
        .zip(net::peer_of(fd))
        .ok_or("our socket has no addresses")?;
    let far = sock_diag::far_end(local, peer)
        .map_err(|e| format!("sock_diag: {e}"))?
        .ok_or("the kernel knows no far end of our connection")?;
    if far.cookie != theirs {
        return Err("the answer's socket is not the far end of our connection".into());
    }
    Ok(())
}

/// Withdraw from the pair (the listener then stays on TCP too). False if
/// the listener had already committed.
fn withdraw(word: &AtomicU32) -> bool {
    match word.compare_exchange(
        Agreement::UNDECIDED,
        Agreement::WITHDRAWN,
        Ordering::AcqRel,
        Ordering::Acquire,
    ) {
        Ok(_) => true,
        Err(v) => v == Agreement::WITHDRAWN,
    }
}

/// Wait until the listener commits (true) or `deadline` passes and we
/// withdraw (false).
fn await_commit(word: &AtomicU32, deadline: Instant) -> bool {
    loop {
        let v = word.load(Ordering::Acquire);
        if v == Agreement::COMMITTED {
            return true;
        }
        let left = deadline.saturating_duration_since(Instant::now());
        if v != Agreement::UNDECIDED || left.is_zero() {
            if withdraw(word) {
                return false;
            }
            continue;
        }
        azsdp::futex::wait(
            word,
            Agreement::UNDECIDED,
            left.min(Duration::from_millis(20)),
        );
    }
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
    if settings.use_ == Use::Tcp {
        return plain(TcpReason::Rule);
    }
    if azsdp::sandbox::restricted() {
        // No thread may start here to run a connection.
        return plain(TcpReason::Sandboxed);
    }
    let to = effective_dst(dst);
    let remote = !net::is_local(to.ip());
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
    let reg = match find_listener(
        to,
        (settings.pair_timeout / 4).min(Duration::from_millis(150)),
    ) {
        Ok(reg) => reg,
        Err(_) if settings.use_ == Use::Azsdp => {
            debug!("connect {dst}: no azsdp listener and the rule says azsdp only");
            return Outcome::Tcp(-1, libc::ECONNREFUSED, None);
        }
        Err(None) => return plain(TcpReason::PeerNotAzsdp),
        Err(Some(_)) => return plain(TcpReason::PeerUnverified),
    };
    if reg.pid == azsdp::process::pid() {
        // Our own listener: its accept() may be ours to call, after this
        // connect() returns, so waiting for it could only time out.
        return plain(TcpReason::SameProcess);
    }
    let deadline = Instant::now() + settings.pair_timeout;
    let Some(port) = ensure_port(fd, family) else {
        return plain(TcpReason::SetupFailed);
    };
    // SAFETY: `fd` is the program's socket, open for this call.
    let tcp = unsafe { BorrowedFd::borrow_raw(fd) };
    let Ok(cookie) = sock_diag::cookie_of(tcp) else {
        return plain(TcpReason::SetupFailed);
    };
    let offer = match transport(settings, fd).offer() {
        Ok(o) => o,
        Err(e) => {
            debug!("connect {dst}: no offer: {e}");
            return plain(TcpReason::SetupFailed);
        }
    };
    let intro = Intro {
        kind: IntroKind::Offer,
        page_size: azsdp::pages::system_page_size() as u32,
        pair: Some(PairTarget {
            dst: to,
            client_port: port,
            cookie,
        }),
    };
    if let Err(e) = send_intro(reg.sock.as_fd(), &intro, &offer.fds(), true) {
        debug!("connect {dst}: offer not sent: {e}");
        return plain(TcpReason::SetupFailed);
    }
    // From here the listener may match us: a failure below withdraws by
    // the word (or closes the side channel), and the listener keeps TCP too.
    match kernel_connect(fd, dst, nonblocking, settings.pair_timeout) {
        Ok(true) => {}
        Ok(false) => return Outcome::Tcp(-1, libc::EINPROGRESS, Some(TcpReason::PairTimeout)),
        Err(e) => return Outcome::Tcp(-1, e, None),
    }
    let local = net::local_of(fd).unwrap_or(SocketAddr::new(to.ip(), port));
    let tcp_now = |reason: TcpReason| Outcome::Tcp(0, 0, Some(reason));
    let word = offer.agreement();
    let (answer_intro, answer) = match await_answer(reg.sock.as_fd(), deadline) {
        Ok(a) => a,
        Err(e) if withdraw(word) => {
            debug!("connect {dst}: no upgrade ({e})");
            return tcp_now(TcpReason::PairTimeout);
        }
        // The listener committed as we gave up: its answer came first.
        Err(_) => match await_answer(reg.sock.as_fd(), Instant::now()) {
            Ok(a) => a,
            Err(_) => return broken(dst, offer),
        },
    };
    if let Err(why) = answer_holds_our_peer(fd, &answer) {
        warning!(
            "connect {dst}: pid {} (uid {}) answered for the listener but {why}; staying on TCP",
            answer.peer.pid(),
            answer.peer.uid()
        );
        return if withdraw(word) {
            tcp_now(TcpReason::PeerUnverified)
        } else {
            broken(dst, offer)
        };
    }
    if !await_commit(word, deadline) {
        return tcp_now(TcpReason::PairTimeout);
    }
    let peer_page = answer_intro.page_size;
    // After the accepted socket (checked above): the transport's.
    let fds = answer.fds.into_iter().skip(1).collect();
    // The pairing stream has done its work: the connection holds no
    // descriptor of its own from here.
    drop(reg.sock);
    match offer.into_endpoint(fds, answer.peer, peer_page) {
        Ok(ep) => Outcome::Azsdp(Conn::start(
            AnyEndpoint::Shm(ep),
            fd,
            Role::Client,
            settings,
            local,
            dst,
        )),
        Err(e) => {
            debug!("connect {dst}: {e}");
            Outcome::Tcp(-1, libc::ECONNRESET, None)
        }
    }
}

/// The listener committed to a pair we cannot accept: end it on both sides
/// (the listener's engine sees us leave) and fail the call.
fn broken(dst: SocketAddr, offer: <Active as Transport>::Offer) -> Outcome {
    warning!("connect {dst}: the listener committed to a pair we refused; the connection is reset");
    offer.abandon();
    Outcome::Tcp(-1, libc::ECONNREFUSED, None)
}
