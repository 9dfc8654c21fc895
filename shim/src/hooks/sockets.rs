//! Connection set-up and teardown: socket, bind, listen, accept, connect,
//! close, shutdown.

use std::sync::Arc;
use std::sync::atomic::Ordering;

use azsdp::conn::{Role as EngineRole, Shutdown};
use azsdp::stats::TcpReason;
use libc::{c_int, sockaddr, socklen_t};

use super::{guard, hook, settings_for};
use crate::connect::{self, Outcome};
use crate::listener::Listener;
use crate::log::{debug, info};
use crate::sock::{Role, Sock};
use crate::{epoll, fdtable, net, real, runtime};

#[unsafe(no_mangle)]
pub unsafe extern "C" fn socket(domain: c_int, ty: c_int, protocol: c_int) -> c_int {
    hook(|| {
        // SAFETY: libc's socket with the program's arguments.
        let fd = unsafe { real::socket(domain, ty, protocol) };
        if fd >= 0
            && (domain == libc::AF_INET || domain == libc::AF_INET6)
            && ty & 0xf == libc::SOCK_STREAM
            && (protocol == 0 || protocol == libc::IPPROTO_TCP)
            && !azsdp::process::inside()
            && !runtime::disabled()
        {
            let e = real::errno();
            guard((), || {
                // Loaded once (a bad configuration is logged then); the socket
                // is tracked either way, so that its connection gets a stat row
                // with its reason (`bad-config`).
                let _ = runtime::config();
                fdtable::insert(fd, Sock::new(domain, ty & libc::SOCK_NONBLOCK != 0));
            });
            real::set_errno(e);
        }
        fd
    })
}

/// Passed through: the address a socket binds is the kernel's to check,
/// and pairing reads it back with `getsockname` when it needs it.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn bind(fd: c_int, addr: *const sockaddr, len: socklen_t) -> c_int {
    hook(|| {
        // (An upgraded connection's socket is a connected kernel socket:
        // the kernel refuses it as any.)
        // SAFETY: libc's bind.
        unsafe { real::bind(fd, addr, len) }
    })
}

/// A listener is registered for pairing before the kernel listens on it,
/// so no client of a burst finds it unregistered (a port the kernel picks
/// at `listen()` is registered right after).
#[unsafe(no_mangle)]
pub unsafe extern "C" fn listen(fd: c_int, backlog: c_int) -> c_int {
    hook(|| {
        // (the socket, and its registration if its port was known before)
        let before = guard(None, || {
            let sock = fdtable::get(fd)?;
            if !matches!(sock.role(), Role::Fresh) {
                return None;
            }
            let local = net::local_of(fd)?;
            let l = (local.port() != 0).then(|| register(local));
            Some((sock, l))
        });
        // SAFETY: libc's listen.
        let r = unsafe { real::listen(fd, backlog) };
        let e = real::errno();
        if r == 0
            && let Some((sock, l)) = before
        {
            guard((), || {
                // A port the kernel picked at listen() is known only now.
                let l = match l {
                    Some(l) => l,
                    None => match net::local_of(fd) {
                        Some(local) => register(local),
                        None => Err(TcpReason::Unsupported),
                    },
                };
                sock.set_role(match l {
                    Ok(l) => Role::Listener(l),
                    Err(reason) => Role::Unpaired(reason),
                });
            });
        }
        // A failed listen() drops the registration it did not need.
        real::set_errno(e);
        r
    })
}

/// Register a listener on `local` if the rules let it pair; otherwise why
/// its connections stay on TCP.
fn register(local: std::net::SocketAddr) -> Result<Arc<Listener>, TcpReason> {
    let s =
        settings_for(EngineRole::Server, local.ip(), local.port()).ok_or(TcpReason::BadConfig)?;
    if s.use_ == azsdp::config::Use::Tcp {
        debug!("listener {local}: a rule keeps it on TCP");
        return Err(TcpReason::Rule);
    }
    let l = Listener::register(local, s).ok_or(TcpReason::PeerUnverified)?;
    runtime::start_publisher();
    Ok(l)
}

unsafe fn accept_impl(fd: c_int, addr: *mut sockaddr, len: *mut socklen_t, flags: c_int) -> c_int {
    let listener = fdtable::get(fd).and_then(|s| match s.role() {
        Role::Listener(l) => Some((s, Ok(l))),
        Role::Unpaired(reason) => Some((s, Err(reason))),
        _ => None,
    });
    let Some((lsock, listener)) = listener else {
        // SAFETY: libc's accept4 with the program's arguments.
        return unsafe { real::accept4(fd, addr, len, flags) };
    };
    // SAFETY: plain data.
    let mut st: libc::sockaddr_storage = unsafe { std::mem::zeroed() };
    let mut sl = std::mem::size_of::<libc::sockaddr_storage>() as socklen_t;
    // SAFETY: accept4 into our own buffer.
    let nfd = unsafe { real::accept4(fd, (&raw mut st).cast(), &mut sl, flags) };
    if nfd < 0 {
        return nfd;
    }
    if let Err(e) = net::copy_out(&st, sl, addr, len) {
        // As the kernel: the connection is dropped.
        // SAFETY: closing the descriptor we just accepted.
        unsafe { real::close(nfd) };
        real::set_errno(e);
        return -1;
    }
    let e = real::errno();
    guard((), || {
        let sock = Sock::new(lsock.family, flags & libc::SOCK_NONBLOCK != 0);
        // SAFETY: the kernel wrote `sl` bytes.
        let peer = unsafe { net::from_raw((&raw const st).cast(), sl) };
        // A listener on one address accepts on that address: only a
        // wildcard's connections need the kernel's word.
        let local = match &listener {
            Ok(l) if !l.addr.ip().is_unspecified() => Some(l.addr),
            _ => net::local_of(nfd),
        };
        match (local, peer, listener) {
            (Some(local), Some(peer), Err(reason)) => {
                info!("{local} <- {peer}: tcp ({})", reason.name());
                sock.stay_tcp(Some(local), Some(peer), reason, true);
            }
            (Some(local), Some(peer), Ok(listener)) => {
                let s = settings_for(EngineRole::Server, peer.ip(), local.port())
                    .unwrap_or_else(|| listener.settings.clone());
                match listener.upgrade(nfd, local, peer, &s) {
                    Ok(c) => {
                        info!(
                            "{local} <- {peer}: azsdp (fabric {}, peer pid {})",
                            c.fabric, c.peer_pid
                        );
                        sock.set_role(Role::Azsdp(c));
                    }
                    Err(reason) => {
                        info!("{local} <- {peer}: tcp ({})", reason.name());
                        sock.stay_tcp(Some(local), Some(peer), reason, true);
                    }
                }
            }
            (local, peer, _) => {
                info!("{local:?} <- {peer:?}: tcp (unsupported addresses)");
                sock.stay_tcp(local, peer, TcpReason::Unsupported, true);
            }
        }
        if let Some(old) = fdtable::insert(nfd, sock) {
            release(nfd, old);
        }
    });
    real::set_errno(e);
    nfd
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn accept(fd: c_int, addr: *mut sockaddr, len: *mut socklen_t) -> c_int {
    hook(|| {
        // SAFETY: forwarded.
        unsafe { accept_impl(fd, addr, len, 0) }
    })
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn accept4(
    fd: c_int,
    addr: *mut sockaddr,
    len: *mut socklen_t,
    flags: c_int,
) -> c_int {
    hook(|| {
        // SAFETY: forwarded.
        unsafe { accept_impl(fd, addr, len, flags) }
    })
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn connect(fd: c_int, addr: *const sockaddr, len: socklen_t) -> c_int {
    hook(|| {
        let sock = fdtable::get(fd);
        if let Some(s) = &sock
            && s.conn().is_some()
            && s.connect_pending.swap(false, Ordering::SeqCst)
        {
            return 0;
        }
        let sock = sock.filter(|s| matches!(s.role(), Role::Fresh));
        // SAFETY: the program's address, within its length.
        let dst = unsafe { net::from_raw(addr, len) };
        let (Some(sock), Some(dst)) = (sock, dst) else {
            // SAFETY: libc's connect.
            return unsafe { real::connect(fd, addr, len) };
        };
        let Some(s) = settings_for(EngineRole::Client, net::canonical(dst.ip()), dst.port()) else {
            // A bad configuration: plain TCP, counted with its reason.
            // SAFETY: libc's connect.
            let r = unsafe { real::connect(fd, addr, len) };
            let e = real::errno();
            if r == 0 || e == libc::EINPROGRESS {
                guard((), || {
                    let local = net::local_of(fd);
                    info!(
                        "{}-> {dst}: tcp ({})",
                        net::log_from(local),
                        TcpReason::BadConfig.name()
                    );
                    sock.stay_tcp(local, Some(dst), TcpReason::BadConfig, false);
                });
            }
            real::set_errno(e);
            return r;
        };
        guard(-1, || {
            let nonblocking = sock.is_nonblocking();
            let (r, e) = match connect::connect(fd, sock.family, dst, nonblocking, &s) {
                Outcome::Azsdp(c) => {
                    info!(
                        "{} -> {dst}: azsdp (fabric {}, peer pid {})",
                        c.local, c.fabric, c.peer_pid
                    );
                    sock.connect_pending.store(nonblocking, Ordering::SeqCst);
                    sock.set_role(Role::Azsdp(c));
                    epoll::adopt(&sock);
                    (0, 0)
                }
                Outcome::Pairing(o) => {
                    let connect::Offered {
                        r,
                        e,
                        reg,
                        offer,
                        to,
                        local,
                    } = *o;
                    let p = crate::pending::Pending::start(&sock, fd, reg, offer, to, local, &s);
                    sock.set_role(Role::Pairing(p));
                    (r, e)
                }
                Outcome::Tcp(r, e, reason) => {
                    if let Some(reason) = reason {
                        let local = net::local_of(fd);
                        info!("{}-> {dst}: tcp ({})", net::log_from(local), reason.name());
                        sock.stay_tcp(local, Some(dst), reason, false);
                        sock.kernel_epolls.lock().clear();
                    }
                    (r, e)
                }
            };
            // A non-blocking TCP connect() always says EINPROGRESS, even
            // when it completes at once (we waited for it here): so do we,
            // and the program's poll for POLLOUT and SO_ERROR follow.
            let (r, e) = if nonblocking && r == 0 {
                (-1, libc::EINPROGRESS)
            } else {
                (r, e)
            };
            real::set_errno(e);
            r
        })
    })
}

/// The last descriptor of `sock` in this process is gone.
pub(super) fn release(fd: c_int, sock: Arc<Sock>) {
    if let Role::Pairing(p) = sock.role()
        && sock.fds.load(Ordering::SeqCst) == 1
    {
        p.give_up(&sock, TcpReason::ShortLived);
    }
    if let Some(c) = sock.conn() {
        // The socket beneath may still be needed after the program's
        // descriptor is gone (`fd` is out of the table already).
        let other = (sock.fds.load(Ordering::SeqCst) > 1)
            .then(|| {
                fdtable::entries()
                    .into_iter()
                    .find(|(f, s)| *f != fd && Arc::ptr_eq(s, &sock))
                    .map(|(f, _)| f)
            })
            .flatten();
        c.program_closes(fd, other);
    }
    if sock.fds.fetch_sub(1, Ordering::SeqCst) != 1 {
        return;
    }
    if let Role::Azsdp(c) = sock.role() {
        epoll::forget_fd(fd);
        if let Some(j) = c.joining_now()
            && !j.forked()
            && !c.driver.shared_by_fork()
            && !sock.opts().linger_abort
        {
            // The end of our stream goes after its TCP part.
            j.end_stream(&c, fd);
        }
        c.close_with(sock.opts().linger_abort);
    }
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn close(fd: c_int) -> c_int {
    hook(|| {
        if let Some(sock) = fdtable::remove(fd) {
            guard((), || release(fd, sock));
        } else if epoll::has_sets() {
            guard((), || epoll::forget_set(fd));
        }
        // SAFETY: libc's close.
        unsafe { real::close(fd) }
    })
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn shutdown(fd: c_int, how: c_int) -> c_int {
    hook(|| {
        if let Some(s) = fdtable::get(fd)
            && let Role::Pairing(p) = s.role()
        {
            // The stream ends on TCP: the pair will not be.
            guard((), || p.give_up(&s, TcpReason::ShortLived));
        }
        if let Some(c) = fdtable::get(fd).and_then(|s| s.conn()) {
            let how = match how {
                libc::SHUT_RD => Shutdown::Read,
                libc::SHUT_WR => Shutdown::Write,
                libc::SHUT_RDWR => Shutdown::Both,
                _ => {
                    real::set_errno(libc::EINVAL);
                    return -1;
                }
            };
            return guard(-1, || {
                if let Some(j) = c.joining_now()
                    && !j.forked()
                    && !c.driver.shared_by_fork()
                {
                    if how != Shutdown::Write && j.rx_on_socket(&c) {
                        // Receives still read the socket: it says EOF now,
                        // as the kernel's would.
                        // SAFETY: shutdown of the program's socket, as asked.
                        unsafe { real::shutdown(fd, libc::SHUT_RD) };
                    }
                    if how != Shutdown::Read {
                        j.end_stream(&c, fd);
                    }
                }
                c.driver.shutdown(how);
                c.touched();
                0
            });
        }
        // SAFETY: libc's shutdown.
        unsafe { real::shutdown(fd, how) }
    })
}
