//! The client side of pairing, run inside the program's `connect()`.

use std::io::Write;
use std::net::{IpAddr, Ipv4Addr, Ipv6Addr, SocketAddr};
use std::os::linux::net::SocketAddrExt;
use std::os::unix::net::{SocketAddr as UnixAddr, UnixStream};
use std::sync::Arc;
use std::sync::atomic::Ordering;
use std::time::{Duration, Instant};

use azsdp::config::{Settings, Use};
use azsdp::conn::Role;
use azsdp::fabric::shm::ShmEndpoint;
use azsdp::pairing::{Agreement, PairRequest, REQUEST_LEN, registry_candidates};
use azsdp::stats::TcpReason;
use libc::c_int;

use crate::conn::Conn;
use crate::listener::shm_params;
use crate::log::debug;
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

/// The registration of an azsdp listener for `dst`, if one answers.
fn find_listener(dst: SocketAddr) -> Option<UnixStream> {
    registry_candidates(dst).into_iter().find_map(|name| {
        let ua = UnixAddr::from_abstract_name(name.as_bytes()).ok()?;
        UnixStream::connect_addr(&ua).ok()
    })
}

/// Bind `fd` to an ephemeral port if the program did not bind it; the
/// port names the connection in the pair request.
fn ensure_port(fd: c_int, family: c_int) -> Option<u16> {
    if let Some(a) = net::local_of(fd) {
        if a.port() != 0 {
            return Some(a.port());
        }
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
fn kernel_connect(
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
    let mut p = libc::pollfd {
        fd,
        events: libc::POLLOUT,
        revents: 0,
    };
    // SAFETY: poll of one pollfd we own.
    let n = unsafe {
        real::poll(
            &mut p,
            1,
            patience.as_millis().min(i32::MAX as u128) as c_int,
        )
    };
    if n <= 0 {
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
            Err(e) => Outcome::Tcp(-1, e, None),
        }
    };
    if settings.use_ == Use::Tcp {
        return plain(TcpReason::Rule);
    }
    if !net::is_local(dst.ip()) {
        return plain(TcpReason::PeerRemote);
    }
    let Some(stream) = find_listener(dst) else {
        if settings.use_ == Use::Azsdp {
            debug!("connect {dst}: no azsdp listener and the rule says azsdp only");
            return Outcome::Tcp(-1, libc::ECONNREFUSED, None);
        }
        return plain(TcpReason::PeerNotAzsdp);
    };
    let deadline = Instant::now() + settings.pair_timeout;
    let Some(port) = ensure_port(fd, family) else {
        return plain(TcpReason::SetupFailed);
    };
    let request = PairRequest {
        dst,
        client_port: port,
        client_pid: std::process::id(),
    };
    let mut b = [0u8; REQUEST_LEN];
    request.emit(&mut b);
    net::set_timeouts(&stream, settings.pair_timeout);
    if (&stream).write_all(&b).is_err() {
        return plain(TcpReason::SetupFailed);
    }
    // From here, the listener may match us: a failure below closes the side
    // channel (the listener then keeps TCP too) or withdraws by the word.
    match kernel_connect(fd, dst, nonblocking, settings.pair_timeout) {
        Ok(true) => {}
        Ok(false) => return Outcome::Tcp(-1, libc::EINPROGRESS, Some(TcpReason::PairTimeout)),
        Err(e) => return Outcome::Tcp(-1, e, None),
    }
    let local = net::local_of(fd).unwrap_or(SocketAddr::new(dst.ip(), port));
    let tcp_now = |reason: TcpReason| Outcome::Tcp(0, 0, Some(reason));
    net::set_timeouts(&stream, deadline.saturating_duration_since(Instant::now()));
    let ep = match ShmEndpoint::accept(&stream, shm_params(settings)) {
        Ok(ep) => ep,
        Err(e) => {
            debug!("connect {dst}: no upgrade ({e})");
            return tcp_now(TcpReason::PairTimeout);
        }
    };
    let word = ep.agreement();
    loop {
        let v = word.load(Ordering::Acquire);
        if v == Agreement::COMMITTED {
            break;
        }
        let left = deadline.saturating_duration_since(Instant::now());
        if v != Agreement::UNDECIDED || left.is_zero() {
            if word
                .compare_exchange(
                    Agreement::UNDECIDED,
                    Agreement::WITHDRAWN,
                    Ordering::AcqRel,
                    Ordering::Acquire,
                )
                .is_ok()
                || v == Agreement::WITHDRAWN
            {
                return tcp_now(TcpReason::PairTimeout);
            }
            continue;
        }
        azsdp::futex::wait(
            word,
            Agreement::UNDECIDED,
            left.min(Duration::from_millis(20)),
        );
    }
    drop(stream);
    match Conn::start(ep, Role::Client, settings, local, dst) {
        Ok(c) => Outcome::Azsdp(c),
        Err(e) => {
            debug!("connect {dst}: azsdp handshake failed: {e}");
            Outcome::Tcp(-1, libc::ECONNRESET, None)
        }
    }
}
