//! Data: send, recv and their variants, read/write on sockets (batches
//! in [`super::batched`], files and pipes in [`super::file_data`]).

use std::sync::Arc;
use std::time::Instant;

use azsdp::conn::{CallError, RecvFlags, SendFlags};
use azsdp::driver::threaded::CallLimits;
use libc::{c_int, c_void, msghdr, size_t, sockaddr, socklen_t, ssize_t};

use super::{guard, hook};
use crate::conn::Conn;
use crate::sock::{Role, Sock};
use crate::{fdtable, real, signals};

/// A connection's call failed: set errno (and raise SIGPIPE as TCP does).
pub(super) fn fail(e: CallError, nosignal: bool) -> ssize_t {
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
        // (Made again on TCP before it gets here; never the program's.)
        CallError::Switched | CallError::OnTcp => libc::EAGAIN,
    };
    real::set_errno(errno);
    -1
}

/// Send the buffers in order on `c` (descriptor `fd`).
pub(super) fn send_bufs(
    fd: c_int,
    sock: &Arc<Sock>,
    c: &Arc<Conn>,
    bufs: &[(*const u8, usize)],
    flags: c_int,
) -> ssize_t {
    if flags & libc::MSG_OOB != 0 {
        real::set_errno(libc::EOPNOTSUPP);
        return -1;
    }
    let nonblocking = sock.is_nonblocking() || flags & libc::MSG_DONTWAIT != 0;
    let nosignal = flags & libc::MSG_NOSIGNAL != 0;
    if let Some(j) = c.joining_now() {
        if c.driver.on_tcp() {
            // The peer said it stays on TCP (it forked before the join).
            return on_tcp(fd, sock, c, true, bufs, flags);
        }
        if j.forked() || c.driver.shared_by_fork() {
            return after_fork_on_tcp(fd, sock, c, true, bufs, flags);
        }
        if let Some(r) = j.send(c, fd, bufs, flags) {
            return r;
        }
    }
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
        let sf = SendFlags {
            nonblocking,
            protectable: true,
            unprotectable: None,
        };
        let r = if nonblocking {
            c.driver.send(buf, sf)
        } else {
            let deadline = sock.opts().sndtimeo.map(|t| Instant::now() + t);
            let signals = signals::CallSignals::default();
            let limits = CallLimits {
                deadline,
                on_signal: &|| signals.interrupted(),
            };
            c.driver.send_bounded(buf, sf, &limits)
        };
        match r {
            Ok(n) => {
                total += n as usize;
                if (n as usize) < len {
                    break;
                }
            }
            Err(CallError::Switched) if total == 0 => {
                // The connection moved onto its TCP socket: the call goes there.
                return on_tcp(fd, sock, c, true, bufs, flags);
            }
            Err(e) if total == 0 => return fail(e, nosignal),
            Err(_) => break,
        }
    }
    total as ssize_t
}

/// A call on a connection still joining the fabric that a fork shares:
/// the processes that hold it cannot agree on what went over TCP, so the
/// connection moves onto its TCP socket (asking the process that runs it,
/// if another does), and the call is made there.
fn after_fork_on_tcp<T>(
    fd: c_int,
    sock: &Arc<Sock>,
    c: &Arc<Conn>,
    sent: bool,
    bufs: &[(*const T, usize)],
    flags: c_int,
) -> ssize_t {
    // (This process runs it, or takes it over from one that let go.)
    let claimed = c.driver.claim();
    let moved = if claimed {
        c.driver.leave_fabric(crate::switch::LEAVE_WAIT)
    } else {
        c.driver.ask_runner_to_leave()
    };
    if !moved && !c.driver.on_tcp() {
        crate::log::warning!(
            "{} -> {}: a call after fork could not move onto TCP ({}, {:?}); reset",
            c.local,
            c.peer,
            if claimed {
                "ran it here"
            } else {
                "asked its runner"
            },
            c.driver.state()
        );
        return fail(CallError::ConnReset, true);
    }
    on_tcp(fd, sock, c, sent, bufs, flags)
}

/// A call the connection ended because it moved onto its TCP socket, made
/// there (the descriptor is plain from now on).
fn on_tcp<T>(
    fd: c_int,
    sock: &Arc<Sock>,
    c: &Arc<Conn>,
    sent: bool,
    bufs: &[(*const T, usize)],
    flags: c_int,
) -> ssize_t {
    // After an orphan switch, what the dead peer sent is read from the
    // connection first: only sends go to the socket until then.
    let t = if c.driver.has_rx_tail() {
        None
    } else {
        crate::switch::moved(sock, c).map(TcpCall::from)
    };
    // SAFETY: the program's buffers, as it passed them.
    plain_flags(t, sent, flags, || unsafe {
        real::io(fd, sent, bufs, flags)
    })
}

/// Receive into the buffers in order from `c` (descriptor `fd`): the
/// first call waits as the socket and flags say; later buffers take only
/// what is there.
pub(super) fn recv_bufs(
    fd: c_int,
    sock: &Arc<Sock>,
    c: &Arc<Conn>,
    bufs: &[(*mut u8, usize)],
    flags: c_int,
) -> ssize_t {
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
            fd,
            sock,
            c,
            &[(scratch.as_mut_ptr(), n)],
            flags & !libc::MSG_TRUNC,
        );
    }
    if want == 0 {
        // TCP waits as for data (or EOF, or an error), then takes nothing.
        let mut one = [0u8; 1];
        let r = recv_bufs(
            fd,
            sock,
            c,
            &[(one.as_mut_ptr(), 1)],
            flags | libc::MSG_PEEK,
        );
        return r.min(0);
    }
    let nonblocking = sock.is_nonblocking() || flags & libc::MSG_DONTWAIT != 0;
    let Some(j) = c.joining_now() else {
        let r = recv_engine(fd, sock, c, bufs, flags, nonblocking);
        if r == 0 && c.joining.is_some() && crate::join::reset_beneath(fd) {
            // The peer's end came over the fabric, but our TCP part died
            // unread with it (its kernel reset the socket): as TCP.
            c.driver.tcp_reset();
            real::set_errno(libc::ECONNRESET);
            return -1;
        }
        return r;
    };
    let on_tcp_now = c.driver.on_tcp();
    if on_tcp_now || j.forked() || c.driver.shared_by_fork() {
        let bufs: Vec<(*const u8, usize)> =
            bufs.iter().map(|&(p, l)| (p.cast_const(), l)).collect();
        if on_tcp_now {
            // (As in send_bufs.)
            return on_tcp(fd, sock, c, false, &bufs, flags);
        }
        return after_fork_on_tcp(fd, sock, c, false, &bufs, flags);
    }
    // The TCP part first; MSG_WAITALL goes on into the fabric's.
    let waitall = flags & libc::MSG_WAITALL != 0 && flags & libc::MSG_PEEK == 0;
    let deadline = sock.opts().rcvtimeo.map(|t| Instant::now() + t);
    let mut got: usize = 0;
    loop {
        let rest = advance(bufs, got);
        let nb = nonblocking || (got > 0 && !waitall);
        match j.recv(c, fd, &rest, flags, nb, deadline) {
            crate::join::Received::Done(r) if r > 0 => {
                got += r as usize;
                // (A peek looks again from the start: one part only.)
                if got == want || flags & libc::MSG_PEEK != 0 {
                    return got as ssize_t;
                }
                // Else on, without waiting: the kernel's receive takes all
                // that is there, across the end of the TCP part too.
            }
            crate::join::Received::Done(r) => return if got > 0 { got as ssize_t } else { r },
            crate::join::Received::Fabric => {
                if got > 0 && !waitall {
                    let _errno = real::KeepErrno::new();
                    let r = recv_engine(fd, sock, c, &rest, flags, true);
                    return (got + r.max(0) as usize) as ssize_t;
                }
                let r = recv_engine(fd, sock, c, &rest, flags, nonblocking);
                if r == 0 && got == 0 && crate::join::reset_beneath(fd) {
                    // (As above.)
                    c.driver.tcp_reset();
                    real::set_errno(libc::ECONNRESET);
                    return -1;
                }
                return if got == 0 {
                    r
                } else {
                    (got + r.max(0) as usize) as ssize_t
                };
            }
        }
    }
}

/// The buffers past their first `n` bytes.
fn advance(bufs: &[(*mut u8, usize)], mut n: usize) -> Vec<(*mut u8, usize)> {
    let mut out = Vec::with_capacity(bufs.len());
    for &(p, l) in bufs {
        if n >= l {
            n -= l;
            continue;
        }
        // SAFETY: within the program's buffer of `l` bytes.
        out.push((unsafe { p.add(n) }, l - n));
        n = 0;
    }
    out
}

/// The engine's part of a receive (see [`recv_bufs`]).
fn recv_engine(
    fd: c_int,
    sock: &Arc<Sock>,
    c: &Arc<Conn>,
    bufs: &[(*mut u8, usize)],
    flags: c_int,
    nonblocking: bool,
) -> ssize_t {
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
            Err(CallError::Switched) if first => {
                let bufs: Vec<(*const u8, usize)> =
                    bufs.iter().map(|&(p, l)| (p.cast_const(), l)).collect();
                return on_tcp(fd, sock, c, false, &bufs, flags);
            }
            Err(e) if first => return fail(e, true),
            Err(_) => break,
        }
    }
    total as ssize_t
}

/// Where a data call goes.
pub(super) enum Target {
    Azsdp(Arc<Sock>, Arc<Conn>),
    /// libc's call; counted when it is a connection left on TCP.
    Plain(Option<TcpCall>),
}

/// A call on a connection's TCP socket, counted; while its pair is under
/// way, with the ticket that keeps the pair from completing until the
/// call is over (`crate::pending::Counts`).
pub(super) struct TcpCall {
    conn: Arc<crate::conn::TcpConn>,
    _ticket: Option<crate::pending::Ticket>,
}

impl From<Arc<crate::conn::TcpConn>> for TcpCall {
    fn from(conn: Arc<crate::conn::TcpConn>) -> TcpCall {
        TcpCall {
            conn,
            _ticket: None,
        }
    }
}

impl std::ops::Deref for TcpCall {
    type Target = crate::conn::TcpConn;
    fn deref(&self) -> &crate::conn::TcpConn {
        &self.conn
    }
}

/// Looks at a socket whose pair another thread was completing, at most
/// (then the call goes on TCP as it would have before the gate).
const RELOOKS: u32 = 10_000;

pub(super) fn target(fd: c_int) -> Target {
    for _ in 0..RELOOKS {
        let Some(s) = fdtable::get(fd) else {
            return Target::Plain(None);
        };
        let p = match s.role() {
            // Moved onto its TCP socket: plain from now on.
            Role::Azsdp(c) if c.driver.is_switched() => {
                return Target::Plain(crate::switch::moved(&s, &c).map(TcpCall::from));
            }
            Role::Azsdp(c) => return Target::Azsdp(s, c),
            Role::Tcp(t) => return Target::Plain(Some(t.into())),
            Role::Pairing(p) => p,
            _ => return Target::Plain(None),
        };
        // A pair under way completes here if it can (no other call of
        // ours is on the socket), else the call is TCP's, counted, and
        // holds the pair off until it is over.
        if let Some(c) = p.try_complete(&s, fd) {
            return Target::Azsdp(s, c);
        }
        match s.role() {
            Role::Pairing(q) if Arc::ptr_eq(&p, &q) => {}
            _ => continue,
        }
        match p.enter() {
            Some(ticket) => {
                return Target::Plain(Some(TcpCall {
                    conn: Arc::clone(&p.tcp),
                    _ticket: Some(ticket),
                }));
            }
            None => p.wait_completed(),
        }
    }
    match fdtable::get(fd).map(|s| s.role()) {
        Some(Role::Pairing(p)) => Target::Plain(Some(Arc::clone(&p.tcp).into())),
        Some(Role::Tcp(t)) => Target::Plain(Some(t.into())),
        _ => Target::Plain(None),
    }
}

/// Make libc's `call`, counting what it moved on a TCP connection.
pub(super) fn plain(t: Option<TcpCall>, sent: bool, call: impl FnOnce() -> ssize_t) -> ssize_t {
    plain_flags(t, sent, 0, call)
}

/// [`plain`] for a call with `flags` (a peek takes nothing).
pub(super) fn plain_flags(
    t: Option<TcpCall>,
    sent: bool,
    flags: c_int,
    call: impl FnOnce() -> ssize_t,
) -> ssize_t {
    match t {
        Some(t) => t.call(sent, flags & libc::MSG_PEEK != 0, call),
        None => call(),
    }
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn send(fd: c_int, buf: *const c_void, len: size_t, flags: c_int) -> ssize_t {
    hook(|| {
        match target(fd) {
            Target::Azsdp(s, c) => guard(-1, || send_bufs(fd, &s, &c, &[(buf.cast(), len)], flags)),
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
            Target::Azsdp(s, c) => guard(-1, || send_bufs(fd, &s, &c, &[(buf.cast(), len)], flags)),
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
pub(super) fn iovs(iov: *const libc::iovec, n: i64) -> Result<Vec<(*mut u8, usize)>, c_int> {
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
pub(super) fn send_iovs(iov: *const libc::iovec, n: i64) -> Result<Vec<(*const u8, usize)>, c_int> {
    Ok(iovs(iov, n)?
        .into_iter()
        .map(|(p, l)| (p.cast_const(), l))
        .collect())
}

/// The program's msghdr, read through the kernel.
pub(super) fn msghdr_of(msg: *const msghdr) -> Result<msghdr, c_int> {
    Ok(crate::user_mem::read(msg, 1)?[0])
}

/// Fail the call with `e` (-1, errno).
pub(super) fn efail(e: c_int) -> ssize_t {
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
                send_bufs(fd, &s, &c, &bufs, flags)
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
            Target::Azsdp(s, c) => guard(-1, || send_bufs(fd, &s, &c, &[(buf.cast(), len)], 0)),
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
                Ok(bufs) => send_bufs(fd, &s, &c, &bufs, 0),
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
            Target::Azsdp(s, c) => guard(-1, || recv_bufs(fd, &s, &c, &[(buf.cast(), len)], flags)),
            // SAFETY: libc's recv with the program's arguments.
            Target::Plain(t) => plain_flags(t, false, flags, || unsafe {
                real::recv(fd, buf, len, flags)
            }),
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
                recv_bufs(fd, &s, &c, &[(buf.cast(), len)], flags)
            }),
            // SAFETY: libc's recvfrom with the program's arguments.
            Target::Plain(t) => plain_flags(t, false, flags, || unsafe {
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
                recv_bufs(fd, &s, &c, &bufs, flags)
            }),
            Target::Plain(t) => plain_flags(t, false, flags, || {
                // SAFETY: libc's recvmsg with the program's arguments.
                unsafe { real::recvmsg(fd, msg, flags) }
            }),
        }
    })
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn read(fd: c_int, buf: *mut c_void, len: size_t) -> ssize_t {
    hook(|| {
        match target(fd) {
            Target::Azsdp(s, c) => guard(-1, || recv_bufs(fd, &s, &c, &[(buf.cast(), len)], 0)),
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
                Ok(bufs) => recv_bufs(fd, &s, &c, &bufs, 0),
                Err(e) => efail(e),
            }),
            // SAFETY: libc's readv with the program's arguments.
            Target::Plain(t) => plain(t, false, || unsafe { real::readv(fd, iov, n) }),
        }
    })
}
