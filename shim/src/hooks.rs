//! The interposed C functions.
//!
//! Each one first asks whether the descriptor is a socket the shim looks
//! after (one relaxed load for the others) and otherwise calls libc's own
//! function. No panic leaves these functions: [`guard`] turns one into
//! `EIO`.
//!
//! `unsafe` here: the C calling convention and the program's pointers,
//! which are passed on or read within the lengths given, as libc would.

#![allow(clippy::missing_safety_doc)]

use std::panic::AssertUnwindSafe;
use std::sync::Arc;
use std::sync::atomic::Ordering;
use std::time::Instant;

use azsdp::config::{RuleInput, Settings};
use azsdp::conn::{CallError, RecvFlags, Role as EngineRole, SendFlags, Shutdown};
use azsdp::driver::threaded::CallLimits;
use azsdp::stats::TcpReason;
use libc::{
    c_int, c_ulong, c_void, epoll_event, fd_set, msghdr, nfds_t, off_t, pollfd, sigset_t, size_t,
    sockaddr, socklen_t, ssize_t, timespec, timeval,
};

use crate::conn::Conn;
use crate::connect::{self, Outcome};
use crate::listener::Listener;
use crate::log::{debug, info};
use crate::sock::{EpollReg, Role, Sock};
use crate::{epoll, fdtable, net, ready, real, runtime, signals};

/// What an interposed call's result says about success.
trait CallResult {
    fn failed(&self) -> bool;
}

impl CallResult for c_int {
    fn failed(&self) -> bool {
        *self < 0
    }
}

impl CallResult for ssize_t {
    fn failed(&self) -> bool {
        *self < 0
    }
}

/// The body of an interposed call. errno is the program's: libc's functions
/// leave it alone when they succeed, so after a successful call it is what
/// it was before, whatever our own work on the way (lazy set-up, futex
/// waits, probes) did to it; after a failure it is what the body left, the
/// real call's error (cleanup after a failed real call keeps errno, see
/// [`real::KeepErrno`]).
fn hook<R: CallResult>(body: impl FnOnce() -> R) -> R {
    let before = real::errno();
    let r = body();
    if !r.failed() {
        real::set_errno(before);
    }
    r
}

/// Our own work around a memory call: no panic escapes and errno is left
/// as it was (the program's `free` or `mmap` must not see it change).
fn quietly(f: impl FnOnce()) {
    let _keep = real::KeepErrno::new();
    let _ = std::panic::catch_unwind(AssertUnwindSafe(f));
}

/// Run `f`; a panic becomes `fail` with errno EIO.
fn guard<T>(fail: T, f: impl FnOnce() -> T) -> T {
    match std::panic::catch_unwind(AssertUnwindSafe(f)) {
        Ok(v) => v,
        Err(_) => {
            real::set_errno(libc::EIO);
            fail
        }
    }
}

fn settings_for(role: EngineRole, addr: std::net::IpAddr, port: u16) -> Option<Settings> {
    let cfg = runtime::config()?;
    Some(
        cfg.decide(&RuleInput {
            program: runtime::program(),
            role,
            addr,
            port,
        })
        .settings,
    )
}

// ----- connection set-up ---------------------------------------------------

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
        // An upgraded connection's kernel socket is closed underneath (see
        // `seal`), so the kernel would let it bind: refuse as it refuses a
        // connected socket.
        if fdtable::get(fd).is_some_and(|s| s.conn().is_some()) {
            real::set_errno(libc::EINVAL);
            return -1;
        }
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
        let local = net::local_of(nfd);
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
                        info!("{local} <- {peer}: azsdp (peer pid {})", c.peer_pid);
                        sock.set_role(Role::Azsdp(c));
                        seal(nfd);
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
                    info!("-> {dst}: tcp ({})", TcpReason::BadConfig.name());
                    sock.stay_tcp(net::local_of(fd), Some(dst), TcpReason::BadConfig, false);
                });
            }
            real::set_errno(e);
            return r;
        };
        guard(-1, || {
            let nonblocking = sock.is_nonblocking();
            let (r, e) = match connect::connect(fd, sock.family, dst, nonblocking, &s) {
                Outcome::Azsdp(c) => {
                    info!("{} -> {dst}: azsdp (peer pid {})", c.local, c.peer_pid);
                    sock.connect_pending.store(nonblocking, Ordering::SeqCst);
                    sock.set_role(Role::Azsdp(c));
                    seal(fd);
                    epoll::adopt(&sock);
                    (0, 0)
                }
                Outcome::Tcp(r, e, reason) => {
                    if let Some(reason) = reason {
                        info!("-> {dst}: tcp ({})", reason.name());
                        sock.stay_tcp(net::local_of(fd), Some(dst), reason, false);
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

/// An upgraded connection's kernel socket carries nothing from now on:
/// shut its sending side, so that a program that inherits the descriptor
/// across `exec` (and so without the shim's state) reads EOF and gets EPIPE,
/// instead of waiting for ever or writing into a stream nobody reads.
fn seal(fd: c_int) {
    // SAFETY: shutdown(2) of the kernel socket behind `fd`.
    unsafe { real::shutdown(fd, libc::SHUT_WR) };
}

/// The last descriptor of `sock` in this process is gone.
fn release(fd: c_int, sock: Arc<Sock>) {
    if sock.fds.fetch_sub(1, Ordering::SeqCst) != 1 {
        return;
    }
    if let Role::Azsdp(c) = sock.role() {
        epoll::forget_fd(fd);
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
                c.driver.shutdown(how);
                c.touched();
                0
            });
        }
        // SAFETY: libc's shutdown.
        unsafe { real::shutdown(fd, how) }
    })
}

// ----- data ----------------------------------------------------------------

/// A connection's call failed: set errno (and raise SIGPIPE as TCP does).
fn fail(e: CallError, nosignal: bool) -> ssize_t {
    let errno = match e {
        CallError::WouldBlock => libc::EAGAIN,
        CallError::Interrupted => libc::EINTR,
        CallError::BrokenPipe => {
            if !nosignal {
                // SAFETY: raise(3) delivers SIGPIPE to this thread, as TCP does.
                unsafe { libc::raise(libc::SIGPIPE) };
            }
            libc::EPIPE
        }
        CallError::ConnReset => libc::ECONNRESET,
        CallError::TimedOut => libc::ETIMEDOUT,
    };
    real::set_errno(errno);
    -1
}

/// Send the buffers in order on `c`.
fn send_bufs(sock: &Sock, c: &Conn, bufs: &[(*const u8, usize)], flags: c_int) -> ssize_t {
    if flags & libc::MSG_OOB != 0 {
        real::set_errno(libc::EOPNOTSUPP);
        return -1;
    }
    let nonblocking = sock.is_nonblocking() || flags & libc::MSG_DONTWAIT != 0;
    let nosignal = flags & libc::MSG_NOSIGNAL != 0;
    let mut total: usize = 0;
    for &(p, len) in bufs {
        if len == 0 {
            continue;
        }
        if let Err(e) = crate::user_mem::check_buffer(p, len, false) {
            // As the kernel: what went before the bad buffer, else EFAULT.
            if total > 0 {
                break;
            }
            real::set_errno(e);
            return -1;
        }
        // SAFETY: the program's buffer of `len` bytes, which the kernel
        // says it may read.
        let buf = unsafe { std::slice::from_raw_parts(p, len) };
        let flags = SendFlags {
            nonblocking,
            protectable: true,
        };
        let r = if nonblocking {
            c.driver.send(buf, flags)
        } else {
            let deadline = sock.opts().sndtimeo.map(|t| Instant::now() + t);
            let signals = signals::CallSignals::default();
            let limits = CallLimits {
                deadline,
                on_signal: &|| signals.interrupted(),
            };
            c.driver.send_bounded(buf, flags, &limits)
        };
        match r {
            Ok(n) => {
                total += n as usize;
                if (n as usize) < len {
                    break;
                }
            }
            Err(e) if total == 0 => return fail(e, nosignal),
            Err(_) => break,
        }
    }
    total as ssize_t
}

/// Receive into the buffers in order from `c`: the first call waits as
/// the socket and flags say; later buffers take only what is there.
fn recv_bufs(sock: &Sock, c: &Conn, bufs: &[(*mut u8, usize)], flags: c_int) -> ssize_t {
    if flags & libc::MSG_OOB != 0 {
        real::set_errno(libc::EINVAL);
        return -1;
    }
    let want = bufs.iter().fold(0usize, |a, b| a.saturating_add(b.1));
    if flags & libc::MSG_TRUNC != 0 {
        // TCP's MSG_TRUNC: take (or, with MSG_PEEK, look at) up to `want`
        // bytes without copying them to the program.
        let mut scratch = vec![0u8; want.min(1 << 20)];
        let n = scratch.len();
        return recv_bufs(
            sock,
            c,
            &[(scratch.as_mut_ptr(), n)],
            flags & !libc::MSG_TRUNC,
        );
    }
    if want == 0 {
        // TCP waits as for data (or EOF, or an error), then takes nothing.
        let mut one = [0u8; 1];
        let r = recv_bufs(sock, c, &[(one.as_mut_ptr(), 1)], flags | libc::MSG_PEEK);
        return r.min(0);
    }
    let nonblocking = sock.is_nonblocking() || flags & libc::MSG_DONTWAIT != 0;
    let mut total: usize = 0;
    for &(p, len) in bufs {
        if len == 0 {
            continue;
        }
        if let Err(e) = crate::user_mem::check_buffer(p, len, true) {
            if total > 0 {
                break;
            }
            real::set_errno(e);
            return -1;
        }
        // SAFETY: the program's buffer of `len` bytes, which the kernel
        // says it may write.
        let buf = unsafe { std::slice::from_raw_parts_mut(p, len) };
        let first = total == 0;
        let f = RecvFlags {
            nonblocking: nonblocking || !first,
            peek: flags & libc::MSG_PEEK != 0,
            waitall: flags & libc::MSG_WAITALL != 0,
            armable: true,
        };
        let r = if f.nonblocking {
            c.driver.recv(buf, f)
        } else {
            let deadline = sock.opts().rcvtimeo.map(|t| Instant::now() + t);
            let signals = signals::CallSignals::default();
            let limits = CallLimits {
                deadline,
                on_signal: &|| signals.interrupted(),
            };
            c.driver.recv_bounded(buf, f, &limits)
        };
        match r {
            Ok(0) => break,
            Ok(n) => {
                total += n as usize;
                if (n as usize) < len || f.peek {
                    break;
                }
            }
            Err(e) if first => return fail(e, true),
            Err(_) => break,
        }
    }
    total as ssize_t
}

/// Where a data call goes.
enum Target {
    Azsdp(Arc<Sock>, Arc<Conn>),
    /// libc's call; counted when it is a connection left on TCP.
    Plain(Option<Arc<crate::conn::TcpConn>>),
}

fn target(fd: c_int) -> Target {
    match fdtable::get(fd) {
        None => Target::Plain(None),
        Some(s) => match s.role() {
            Role::Azsdp(c) => Target::Azsdp(s, c),
            Role::Tcp(t) => Target::Plain(Some(t)),
            _ => Target::Plain(None),
        },
    }
}

/// Make libc's `call`, counting what it moved on a TCP connection.
fn plain(
    t: Option<Arc<crate::conn::TcpConn>>,
    sent: bool,
    call: impl FnOnce() -> ssize_t,
) -> ssize_t {
    let r = call();
    if let (Some(t), true) = (t, r > 0) {
        if sent {
            t.count(r as u64, 0);
        } else {
            t.count(0, r as u64);
        }
    }
    r
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn send(fd: c_int, buf: *const c_void, len: size_t, flags: c_int) -> ssize_t {
    hook(|| {
        match target(fd) {
            Target::Azsdp(s, c) => guard(-1, || send_bufs(&s, &c, &[(buf.cast(), len)], flags)),
            // SAFETY: libc's send with the program's arguments.
            Target::Plain(t) => plain(t, true, || unsafe { real::send(fd, buf, len, flags) }),
        }
    })
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn sendto(
    fd: c_int,
    buf: *const c_void,
    len: size_t,
    flags: c_int,
    addr: *const sockaddr,
    alen: socklen_t,
) -> ssize_t {
    hook(|| {
        match target(fd) {
            Target::Azsdp(s, c) => guard(-1, || send_bufs(&s, &c, &[(buf.cast(), len)], flags)),
            // SAFETY: libc's sendto with the program's arguments.
            Target::Plain(t) => plain(t, true, || unsafe {
                real::sendto(fd, buf, len, flags, addr, alen)
            }),
        }
    })
}

/// The program's iovec array as (pointer, length) pairs, read through the
/// kernel, with the kernel's checks: EINVAL for more than `IOV_MAX`
/// entries or a total beyond `ssize_t`, EFAULT for an array it cannot
/// read.
fn iovs(iov: *const libc::iovec, n: i64) -> Result<Vec<(*mut u8, usize)>, c_int> {
    const IOV_MAX: i64 = 1024;
    if !(0..=IOV_MAX).contains(&n) {
        return Err(libc::EINVAL);
    }
    let v = crate::user_mem::read(iov, n as usize)?;
    let mut total: usize = 0;
    for e in &v {
        total = total
            .checked_add(e.iov_len)
            .filter(|t| *t <= isize::MAX as usize)
            .ok_or(libc::EINVAL)?;
    }
    Ok(v.iter()
        .map(|e| (e.iov_base.cast::<u8>(), e.iov_len))
        .collect())
}

/// [`iovs`] of bytes to send.
fn send_iovs(iov: *const libc::iovec, n: i64) -> Result<Vec<(*const u8, usize)>, c_int> {
    Ok(iovs(iov, n)?
        .into_iter()
        .map(|(p, l)| (p.cast_const(), l))
        .collect())
}

/// The program's msghdr, read through the kernel.
fn msghdr_of(msg: *const msghdr) -> Result<msghdr, c_int> {
    Ok(crate::user_mem::read(msg, 1)?[0])
}

/// Fail the call with `e` (-1, errno).
fn efail(e: c_int) -> ssize_t {
    real::set_errno(e);
    -1
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn sendmsg(fd: c_int, msg: *const msghdr, flags: c_int) -> ssize_t {
    hook(|| {
        match target(fd) {
            Target::Azsdp(s, c) => guard(-1, || {
                let bufs =
                    match msghdr_of(msg).and_then(|m| send_iovs(m.msg_iov, m.msg_iovlen as i64)) {
                        Ok(b) => b,
                        Err(e) => return efail(e),
                    };
                send_bufs(&s, &c, &bufs, flags)
            }),
            // SAFETY: libc's sendmsg with the program's arguments.
            Target::Plain(t) => plain(t, true, || unsafe { real::sendmsg(fd, msg, flags) }),
        }
    })
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn write(fd: c_int, buf: *const c_void, len: size_t) -> ssize_t {
    hook(|| {
        match target(fd) {
            Target::Azsdp(s, c) => guard(-1, || send_bufs(&s, &c, &[(buf.cast(), len)], 0)),
            // SAFETY: libc's write with the program's arguments.
            Target::Plain(t) => plain(t, true, || unsafe { real::write(fd, buf, len) }),
        }
    })
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn writev(fd: c_int, iov: *const libc::iovec, n: c_int) -> ssize_t {
    hook(|| {
        match target(fd) {
            Target::Azsdp(s, c) => guard(-1, || match send_iovs(iov, i64::from(n)) {
                Ok(bufs) => send_bufs(&s, &c, &bufs, 0),
                Err(e) => efail(e),
            }),
            // SAFETY: libc's writev with the program's arguments.
            Target::Plain(t) => plain(t, true, || unsafe { real::writev(fd, iov, n) }),
        }
    })
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn recv(fd: c_int, buf: *mut c_void, len: size_t, flags: c_int) -> ssize_t {
    hook(|| {
        match target(fd) {
            Target::Azsdp(s, c) => guard(-1, || recv_bufs(&s, &c, &[(buf.cast(), len)], flags)),
            // SAFETY: libc's recv with the program's arguments.
            Target::Plain(t) => plain(t, false, || unsafe { real::recv(fd, buf, len, flags) }),
        }
    })
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn recvfrom(
    fd: c_int,
    buf: *mut c_void,
    len: size_t,
    flags: c_int,
    addr: *mut sockaddr,
    alen: *mut socklen_t,
) -> ssize_t {
    hook(|| {
        match target(fd) {
            Target::Azsdp(s, c) => guard(-1, || {
                // A connected stream socket reports no source address.
                if !alen.is_null()
                    && let Err(e) = crate::user_mem::write(alen, &[0])
                {
                    return efail(e);
                }
                recv_bufs(&s, &c, &[(buf.cast(), len)], flags)
            }),
            // SAFETY: libc's recvfrom with the program's arguments.
            Target::Plain(t) => plain(t, false, || unsafe {
                real::recvfrom(fd, buf, len, flags, addr, alen)
            }),
        }
    })
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn recvmsg(fd: c_int, msg: *mut msghdr, flags: c_int) -> ssize_t {
    hook(|| {
        match target(fd) {
            Target::Azsdp(s, c) => guard(-1, || {
                let mut m = match msghdr_of(msg) {
                    Ok(m) => m,
                    Err(e) => return efail(e),
                };
                let bufs = match iovs(m.msg_iov, m.msg_iovlen as i64) {
                    Ok(b) => b,
                    Err(e) => return efail(e),
                };
                // The kernel writes these back: no address, no control
                // data, no flags.
                m.msg_namelen = 0;
                m.msg_controllen = 0;
                m.msg_flags = 0;
                if let Err(e) = crate::user_mem::write(msg, &[m]) {
                    return efail(e);
                }
                recv_bufs(&s, &c, &bufs, flags)
            }),
            // SAFETY: libc's recvmsg with the program's arguments.
            Target::Plain(t) => plain(t, false, || unsafe { real::recvmsg(fd, msg, flags) }),
        }
    })
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn read(fd: c_int, buf: *mut c_void, len: size_t) -> ssize_t {
    hook(|| {
        match target(fd) {
            Target::Azsdp(s, c) => guard(-1, || recv_bufs(&s, &c, &[(buf.cast(), len)], 0)),
            // SAFETY: libc's read with the program's arguments.
            Target::Plain(t) => plain(t, false, || unsafe { real::read(fd, buf, len) }),
        }
    })
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn readv(fd: c_int, iov: *const libc::iovec, n: c_int) -> ssize_t {
    hook(|| {
        match target(fd) {
            Target::Azsdp(s, c) => guard(-1, || match iovs(iov, i64::from(n)) {
                Ok(bufs) => recv_bufs(&s, &c, &bufs, 0),
                Err(e) => efail(e),
            }),
            // SAFETY: libc's readv with the program's arguments.
            Target::Plain(t) => plain(t, false, || unsafe { real::readv(fd, iov, n) }),
        }
    })
}

/// The same call under its large-file name (python's `os.sendfile`).
#[unsafe(no_mangle)]
pub unsafe extern "C" fn sendfile64(
    out: c_int,
    inp: c_int,
    off: *mut off_t,
    count: size_t,
) -> ssize_t {
    hook(|| {
        if !matches!(target(out), Target::Azsdp(..)) {
            // SAFETY: libc's sendfile64 with the program's arguments.
            return unsafe { real::sendfile64(out, inp, off, count) };
        }
        // SAFETY: the same call (off_t is 64-bit here).
        unsafe { sendfile(out, inp, off, count) }
    })
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn sendfile(
    out: c_int,
    inp: c_int,
    off: *mut off_t,
    count: size_t,
) -> ssize_t {
    hook(|| {
        let (s, c) = match target(out) {
            Target::Azsdp(s, c) => (s, c),
            Target::Plain(t) => {
                // SAFETY: libc's sendfile with the program's arguments.
                return plain(t, true, || unsafe { real::sendfile(out, inp, off, count) });
            }
        };
        guard(-1, || {
            // Read a chunk from the file, then send it: one copy more than the
            // kernel's sendfile, the price of keeping the byte stream ours.
            let chunk = count.min(1 << 20);
            let mut buf = vec![0u8; chunk];
            // SAFETY: reading into our own buffer; `off` is the program's.
            let got = unsafe {
                if off.is_null() {
                    real::read(inp, buf.as_mut_ptr().cast(), chunk)
                } else {
                    libc::pread(inp, buf.as_mut_ptr().cast(), chunk, *off)
                }
            };
            if got <= 0 {
                return got;
            }
            let sent = send_bufs(&s, &c, &[(buf.as_ptr(), got as usize)], 0);
            if sent > 0 {
                // SAFETY: the program's offset, or put back what we did not send.
                unsafe {
                    if off.is_null() {
                        if sent < got {
                            libc::lseek(inp, (sent - got) as off_t, libc::SEEK_CUR);
                        }
                    } else {
                        *off += sent as off_t;
                    }
                }
            }
            sent
        })
    })
}

// ----- _FORTIFY_SOURCE variants ------------------------------------------------
// Programs built with _FORTIFY_SOURCE call these when the buffer's size is
// known; libc checks `len <= buflen` and aborts otherwise. Upgraded sockets
// get the same check, then the shim's call.

/// The fortify check: a buffer overflow ends the program, as libc's does.
fn chk(len: usize, buflen: usize) {
    if len > buflen {
        crate::log::error!("buffer overflow detected (len {len} > {buflen})");
        // SAFETY: abort(3), as __chk_fail does.
        unsafe { libc::abort() };
    }
}

fn upgraded(fd: c_int) -> bool {
    fdtable::get(fd).is_some_and(|s| s.conn().is_some())
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn __read_chk(
    fd: c_int,
    buf: *mut c_void,
    len: size_t,
    buflen: size_t,
) -> ssize_t {
    hook(|| {
        if !upgraded(fd) {
            // SAFETY: libc's __read_chk with the program's arguments.
            return unsafe { real::__read_chk(fd, buf, len, buflen) };
        }
        chk(len, buflen);
        // SAFETY: the shim's read with the program's arguments.
        unsafe { read(fd, buf, len) }
    })
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn __recv_chk(
    fd: c_int,
    buf: *mut c_void,
    len: size_t,
    buflen: size_t,
    flags: c_int,
) -> ssize_t {
    hook(|| {
        if !upgraded(fd) {
            // SAFETY: libc's __recv_chk with the program's arguments.
            return unsafe { real::__recv_chk(fd, buf, len, buflen, flags) };
        }
        chk(len, buflen);
        // SAFETY: the shim's recv with the program's arguments.
        unsafe { recv(fd, buf, len, flags) }
    })
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn __recvfrom_chk(
    fd: c_int,
    buf: *mut c_void,
    len: size_t,
    buflen: size_t,
    flags: c_int,
    addr: *mut sockaddr,
    alen: *mut socklen_t,
) -> ssize_t {
    hook(|| {
        if !upgraded(fd) {
            // SAFETY: libc's __recvfrom_chk with the program's arguments.
            return unsafe { real::__recvfrom_chk(fd, buf, len, buflen, flags, addr, alen) };
        }
        chk(len, buflen);
        // SAFETY: the shim's recvfrom with the program's arguments.
        unsafe { recvfrom(fd, buf, len, flags, addr, alen) }
    })
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn __poll_chk(
    fds: *mut pollfd,
    n: nfds_t,
    timeout: c_int,
    fdslen: size_t,
) -> c_int {
    hook(|| {
        chk(n as usize * std::mem::size_of::<pollfd>(), fdslen);
        // SAFETY: the shim's poll with the program's arguments.
        unsafe { poll(fds, n, timeout) }
    })
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn __ppoll_chk(
    fds: *mut pollfd,
    n: nfds_t,
    ts: *const timespec,
    mask: *const sigset_t,
    fdslen: size_t,
) -> c_int {
    hook(|| {
        chk(n as usize * std::mem::size_of::<pollfd>(), fdslen);
        // SAFETY: the shim's ppoll with the program's arguments.
        unsafe { ppoll(fds, n, ts, mask) }
    })
}

// ----- readiness -----------------------------------------------------------

#[unsafe(no_mangle)]
pub unsafe extern "C" fn poll(fds: *mut pollfd, n: nfds_t, timeout: c_int) -> c_int {
    hook(|| {
        // SAFETY: the program's array of n entries.
        let r = guard(Some(-1), || unsafe {
            ready::poll(
                fds,
                n as usize,
                ready::ms_timeout(timeout),
                std::ptr::null(),
            )
        });
        if let Some(r) = r {
            return r;
        }
        // SAFETY: libc's poll.
        unsafe { real::poll(fds, n, timeout) }
    })
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn ppoll(
    fds: *mut pollfd,
    n: nfds_t,
    ts: *const timespec,
    mask: *const sigset_t,
) -> c_int {
    hook(|| {
        let timeout = if azsdp::process::active() {
            match ready::ts_timeout(ts) {
                Ok(t) => t,
                Err(e) => return fail_with(e),
            }
        } else {
            None
        };
        // SAFETY: the program's array is reached only through the kernel.
        let r = guard(Some(-1), || unsafe {
            ready::poll(fds, n as usize, timeout, mask)
        });
        if let Some(r) = r {
            return r;
        }
        // SAFETY: libc's ppoll.
        unsafe { real::ppoll(fds, n, ts, mask) }
    })
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn select(
    n: c_int,
    r: *mut fd_set,
    w: *mut fd_set,
    e: *mut fd_set,
    tv: *mut timeval,
) -> c_int {
    hook(|| {
        let ptrs = [r, w, e];
        let sets = match upgraded_sets(n, ptrs) {
            Ok(Some(sets)) => sets,
            // SAFETY: libc's select.
            Ok(None) => return unsafe { real::select(n, r, w, e, tv) },
            Err(e) => return fail_with(e),
        };
        let timeout = match ready::tv_timeout(tv) {
            Ok(t) => t,
            Err(e) => return fail_with(e),
        };
        let t0 = Instant::now();
        let r = guard(-1, || ready::select(&sets, ptrs, timeout, std::ptr::null()));
        // Linux's select leaves the time not slept in the timeval.
        if let Some(t) = timeout {
            let _keep = real::KeepErrno::new();
            let left = t.saturating_sub(t0.elapsed());
            let v = timeval {
                tv_sec: left.as_secs() as libc::time_t,
                tv_usec: left.subsec_micros() as libc::suseconds_t,
            };
            let _ = crate::user_mem::write(tv, &[v]);
        }
        r
    })
}

/// The program's fd_sets if they involve an upgraded socket (`None`: let
/// the kernel do it all), or `select`'s error for them.
fn upgraded_sets(n: c_int, ptrs: [*mut fd_set; 3]) -> Result<Option<ready::Sets>, c_int> {
    if !azsdp::process::active() {
        return Ok(None);
    }
    let sets = ready::Sets::read(n, ptrs)?;
    Ok(sets.involve_upgraded().then_some(sets))
}

/// Fail an interposed call with `e`.
fn fail_with(e: c_int) -> c_int {
    real::set_errno(e);
    -1
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn pselect(
    n: c_int,
    r: *mut fd_set,
    w: *mut fd_set,
    e: *mut fd_set,
    ts: *const timespec,
    mask: *const sigset_t,
) -> c_int {
    hook(|| {
        let ptrs = [r, w, e];
        let sets = match upgraded_sets(n, ptrs) {
            Ok(Some(sets)) => sets,
            // SAFETY: libc's pselect.
            Ok(None) => return unsafe { real::pselect(n, r, w, e, ts, mask) },
            Err(e) => return fail_with(e),
        };
        let timeout = match ready::ts_timeout(ts) {
            Ok(t) => t,
            Err(e) => return fail_with(e),
        };
        guard(-1, || ready::select(&sets, ptrs, timeout, mask))
    })
}

/// Passed through: the shim's part of a set is made when an upgraded
/// socket first joins it (`epoll_ctl`), and dropped when it is closed.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn epoll_create(size: c_int) -> c_int {
    hook(|| {
        // SAFETY: libc's epoll_create.
        unsafe { real::epoll_create(size) }
    })
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn epoll_create1(flags: c_int) -> c_int {
    hook(|| {
        // SAFETY: libc's epoll_create1.
        unsafe { real::epoll_create1(flags) }
    })
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn epoll_ctl(
    epfd: c_int,
    op: c_int,
    fd: c_int,
    ev: *mut epoll_event,
) -> c_int {
    hook(|| {
        let Some(sock) = fdtable::get(fd) else {
            // SAFETY: libc's epoll_ctl.
            return unsafe { real::epoll_ctl(epfd, op, fd, ev) };
        };
        guard(-1, || {
            if sock.conn().is_some() {
                // The event through the kernel (none needed to delete).
                let event = if op == libc::EPOLL_CTL_DEL {
                    None
                } else {
                    match crate::user_mem::read(ev.cast_const(), 1) {
                        Ok(v) => Some(v[0]),
                        Err(e) => return efail(e) as c_int,
                    }
                };
                return epoll::ctl(epfd, op, fd, sock, event);
            }
            // SAFETY: libc's epoll_ctl.
            let r = unsafe { real::epoll_ctl(epfd, op, fd, ev) };
            if r == 0 && matches!(sock.role(), Role::Fresh) {
                // Remember it: if the socket is upgraded, it moves to our
                // part. (The kernel took the event: it is readable.)
                let event = if op == libc::EPOLL_CTL_DEL {
                    None
                } else {
                    crate::user_mem::read(ev.cast_const(), 1).ok().map(|v| v[0])
                };
                let mut regs = sock.kernel_epolls.lock();
                regs.retain(|x| !(x.epfd == epfd && x.fd == fd));
                if let (true, Some(e)) = (op != libc::EPOLL_CTL_DEL, event) {
                    regs.push(EpollReg {
                        epfd,
                        fd,
                        events: e.events,
                        data: e.u64,
                    });
                }
            }
            r
        })
    })
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn epoll_wait(
    epfd: c_int,
    ev: *mut epoll_event,
    max: c_int,
    timeout: c_int,
) -> c_int {
    hook(|| {
        // SAFETY: forwarded.
        unsafe { epoll_pwait(epfd, ev, max, timeout, std::ptr::null()) }
    })
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn epoll_pwait(
    epfd: c_int,
    ev: *mut epoll_event,
    max: c_int,
    timeout: c_int,
    mask: *const sigset_t,
) -> c_int {
    hook(|| {
        if epoll::has_sets() {
            // SAFETY: the program's array of max entries.
            let r = guard(Some(-1), || unsafe {
                epoll::wait(epfd, ev, max, ready::ms_timeout(timeout), mask)
            });
            if let Some(r) = r {
                return r;
            }
        }
        // SAFETY: libc's epoll_pwait.
        unsafe { real::epoll_pwait(epfd, ev, max, timeout, mask) }
    })
}

// ----- descriptors and options ------------------------------------------------

/// `newfd` now names `sock` too.
fn dup_into(newfd: c_int, sock: Arc<Sock>) {
    sock.fds.fetch_add(1, Ordering::SeqCst);
    if let Some(old) = fdtable::insert(newfd, sock) {
        release(newfd, old);
    }
}

/// `fd` was closed implicitly (dup2 over it).
fn replaced(fd: c_int) {
    if let Some(old) = fdtable::remove(fd) {
        release(fd, old);
    }
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn fcntl(fd: c_int, cmd: c_int, arg: usize) -> c_int {
    hook(|| {
        // SAFETY: libc's fcntl with the program's argument word.
        let r = unsafe { real::fcntl(fd, cmd, arg) };
        fcntl_done(fd, cmd, arg, r)
    })
}

/// What programs built with `_FILE_OFFSET_BITS=64` call (python, redis).
#[unsafe(no_mangle)]
pub unsafe extern "C" fn fcntl64(fd: c_int, cmd: c_int, arg: usize) -> c_int {
    hook(|| {
        // SAFETY: libc's fcntl64 with the program's argument word.
        let r = unsafe { real::fcntl64(fd, cmd, arg) };
        fcntl_done(fd, cmd, arg, r)
    })
}

/// Follow what a successful `fcntl` did to a tracked socket.
fn fcntl_done(fd: c_int, cmd: c_int, arg: usize, r: c_int) -> c_int {
    if r >= 0 {
        if let Some(sock) = fdtable::get(fd) {
            guard((), || match cmd {
                libc::F_SETFL => sock
                    .nonblocking
                    .store(arg as c_int & libc::O_NONBLOCK != 0, Ordering::Relaxed),
                libc::F_DUPFD | libc::F_DUPFD_CLOEXEC => dup_into(r, sock),
                _ => {}
            });
        }
    }
    r
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn ioctl(fd: c_int, req: c_ulong, arg: usize) -> c_int {
    hook(|| {
        if let Some(sock) = fdtable::get(fd) {
            if req == libc::FIONREAD as c_ulong {
                if let Some(c) = sock.conn() {
                    let n = guard(0, || c.driver.readable_bytes());
                    let n = n.min(c_int::MAX as u64) as c_int;
                    return match crate::user_mem::write(arg as *mut c_int, &[n]) {
                        Ok(()) => 0,
                        Err(e) => {
                            real::set_errno(e);
                            -1
                        }
                    };
                }
            }
            // SAFETY: libc's ioctl.
            let r = unsafe { real::ioctl(fd, req, arg) };
            if r == 0 && req == libc::FIONBIO as c_ulong && arg != 0 {
                // SAFETY: FIONBIO's argument is the program's int.
                let on = unsafe { *(arg as *const c_int) } != 0;
                sock.nonblocking.store(on, Ordering::Relaxed);
            }
            return r;
        }
        // SAFETY: libc's ioctl.
        unsafe { real::ioctl(fd, req, arg) }
    })
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn dup(fd: c_int) -> c_int {
    hook(|| {
        // SAFETY: libc's dup.
        let r = unsafe { real::dup(fd) };
        if r >= 0 {
            if let Some(sock) = fdtable::get(fd) {
                guard((), || dup_into(r, sock));
            }
        }
        r
    })
}

unsafe fn dup2_impl(fd: c_int, fd2: c_int, flags: Option<c_int>) -> c_int {
    // SAFETY: libc's dup2/dup3.
    let r = unsafe {
        match flags {
            None => real::dup2(fd, fd2),
            Some(f) => real::dup3(fd, fd2, f),
        }
    };
    if r >= 0 && fd != fd2 {
        guard((), || {
            replaced(fd2);
            if let Some(sock) = fdtable::get(fd) {
                dup_into(fd2, sock);
            }
        });
    }
    r
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn dup2(fd: c_int, fd2: c_int) -> c_int {
    hook(|| {
        // SAFETY: forwarded.
        unsafe { dup2_impl(fd, fd2, None) }
    })
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn dup3(fd: c_int, fd2: c_int, flags: c_int) -> c_int {
    hook(|| {
        // SAFETY: forwarded.
        unsafe { dup2_impl(fd, fd2, Some(flags)) }
    })
}

fn timeval_duration(val: *const c_void, len: socklen_t) -> Option<std::time::Duration> {
    if val.is_null() || (len as usize) < std::mem::size_of::<timeval>() {
        return None;
    }
    // SAFETY: a timeval of the program's, length checked.
    let t = unsafe { std::ptr::read_unaligned(val.cast::<timeval>()) };
    let d = std::time::Duration::new(
        t.tv_sec.max(0) as u64,
        (t.tv_usec.clamp(0, 999_999) * 1000) as u32,
    );
    (!d.is_zero()).then_some(d)
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn setsockopt(
    fd: c_int,
    level: c_int,
    name: c_int,
    val: *const c_void,
    len: socklen_t,
) -> c_int {
    hook(|| {
        // The kernel socket takes every option (buffer sizes, TCP_NODELAY,
        // keepalive...): harmless for an upgraded one, and right if it stays TCP.
        // SAFETY: libc's setsockopt.
        let r = unsafe { real::setsockopt(fd, level, name, val, len) };
        if r == 0 && level == libc::SOL_SOCKET {
            if let Some(sock) = fdtable::get(fd) {
                guard((), || {
                    let mut o = sock.opts.lock();
                    match name {
                        libc::SO_RCVTIMEO => o.rcvtimeo = timeval_duration(val, len),
                        libc::SO_SNDTIMEO => o.sndtimeo = timeval_duration(val, len),
                        libc::SO_LINGER
                            if (len as usize) >= std::mem::size_of::<libc::linger>() =>
                        {
                            // SAFETY: a linger of the program's, length checked.
                            let l = unsafe { std::ptr::read_unaligned(val.cast::<libc::linger>()) };
                            o.linger_abort = l.l_onoff != 0 && l.l_linger == 0;
                        }
                        _ => {}
                    }
                });
            }
        }
        r
    })
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn getsockopt(
    fd: c_int,
    level: c_int,
    name: c_int,
    val: *mut c_void,
    len: *mut socklen_t,
) -> c_int {
    hook(|| {
        if level == libc::SOL_SOCKET && name == libc::SO_ERROR {
            if let Some(c) = fdtable::get(fd).and_then(|s| s.conn()) {
                // The pending error, once, as the kernel's.
                let err = match c.driver.take_error() {
                    Some(CallError::TimedOut) => libc::ETIMEDOUT,
                    Some(_) => libc::ECONNRESET,
                    None => 0,
                };
                // As the kernel: at most `*len` bytes of the int, and the
                // length it wrote.
                let put = || -> Result<(), c_int> {
                    let room = crate::user_mem::read(len.cast_const(), 1)?[0];
                    if (room as i32) < 0 {
                        return Err(libc::EINVAL);
                    }
                    let n = (room as usize).min(std::mem::size_of::<c_int>());
                    crate::user_mem::write(val.cast::<u8>(), &err.to_ne_bytes()[..n])?;
                    crate::user_mem::write(len, &[n as socklen_t])
                };
                return match put() {
                    Ok(()) => 0,
                    Err(e) => {
                        real::set_errno(e);
                        -1
                    }
                };
            }
        }
        // SAFETY: libc's getsockopt.
        unsafe { real::getsockopt(fd, level, name, val, len) }
    })
}

/// An upgraded socket's name, as the kernel would give it: the kernel
/// socket itself was shut down at the upgrade (see [`seal`]).
fn upgraded_name(fd: c_int, peer: bool, addr: *mut sockaddr, len: *mut socklen_t) -> Option<c_int> {
    let c = fdtable::get(fd)?.conn()?;
    if addr.is_null() || len.is_null() {
        real::set_errno(libc::EFAULT);
        return Some(-1);
    }
    let (st, sl) = net::to_storage(if peer { c.peer } else { c.local });
    if let Err(e) = net::copy_out(&st, sl, addr, len) {
        real::set_errno(e);
        return Some(-1);
    }
    Some(0)
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn getsockname(fd: c_int, addr: *mut sockaddr, len: *mut socklen_t) -> c_int {
    hook(|| {
        if let Some(r) = guard(Some(-1), || upgraded_name(fd, false, addr, len)) {
            return r;
        }
        // SAFETY: libc's getsockname.
        unsafe { real::getsockname(fd, addr, len) }
    })
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn getpeername(fd: c_int, addr: *mut sockaddr, len: *mut socklen_t) -> c_int {
    hook(|| {
        if let Some(r) = guard(Some(-1), || upgraded_name(fd, true, addr, len)) {
            return r;
        }
        // SAFETY: libc's getpeername.
        unsafe { real::getpeername(fd, addr, len) }
    })
}

// ----- process and memory ------------------------------------------------------

#[unsafe(no_mangle)]
pub unsafe extern "C" fn fork() -> libc::pid_t {
    hook(|| {
        // The core's pthread_atfork handlers settle in-flight pages and freeze
        // every connection; whichever process uses one first takes it (see
        // docs/shim.md).
        // SAFETY: libc's fork.
        let pid = unsafe { real::fork() };
        if pid == 0 {
            guard((), runtime::after_fork_in_child);
        }
        pid
    })
}

/// vfork's child would share our address space (and its protected pages)
/// with a parent whose threads keep running: a real fork is the safe
/// reading of vfork's contract.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn vfork() -> libc::pid_t {
    hook(|| {
        // SAFETY: our fork, above.
        unsafe { fork() }
    })
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn free(p: *mut c_void) {
    if !p.is_null() && azsdp::process::active() {
        // SAFETY: p is a live malloc chunk (free's contract).
        let n = unsafe { real::usable_size(p) };
        quietly(|| azsdp::process::before_free(p as u64, n as u64));
    }
    // SAFETY: libc's free.
    unsafe { real::free(p) }
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn realloc(p: *mut c_void, n: size_t) -> *mut c_void {
    if !p.is_null() && azsdp::process::active() {
        // SAFETY: p is a live malloc chunk (realloc's contract).
        let u = unsafe { real::usable_size(p) };
        quietly(|| azsdp::process::before_realloc(p as u64, u as u64));
    }
    // SAFETY: libc's realloc.
    unsafe { real::realloc(p, n) }
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn munmap(addr: *mut c_void, len: size_t) -> c_int {
    quietly(|| azsdp::process::before_unmap(addr as u64, len as u64));
    // SAFETY: libc's munmap.
    let r = unsafe { real::munmap(addr, len) };
    if r == 0 {
        quietly(|| azsdp::process::after_unmap(addr as u64, len as u64));
    }
    r
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn mmap(
    addr: *mut c_void,
    len: size_t,
    prot: c_int,
    flags: c_int,
    fd: c_int,
    off: off_t,
) -> *mut c_void {
    // SAFETY: libc's mmap.
    let r = unsafe { real::mmap(addr, len, prot, flags, fd, off) };
    if r != libc::MAP_FAILED {
        quietly(|| azsdp::process::after_mmap(r as u64, flags));
    }
    r
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn mremap(
    old: *mut c_void,
    old_len: size_t,
    new_len: size_t,
    flags: c_int,
    new_addr: *mut c_void,
) -> *mut c_void {
    quietly(|| azsdp::process::before_remap(old as u64, old_len as u64));
    // SAFETY: libc's mremap (new_addr is read only with MREMAP_FIXED).
    let r = unsafe { real::mremap(old, old_len, new_len, flags, new_addr) };
    if r != libc::MAP_FAILED {
        quietly(|| azsdp::process::after_remap(old as u64, old_len as u64));
    }
    r
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn madvise(addr: *mut c_void, len: size_t, advice: c_int) -> c_int {
    quietly(|| azsdp::process::before_madvise(addr as u64, len as u64, advice));
    // SAFETY: libc's madvise.
    unsafe { real::madvise(addr, len, advice) }
}
