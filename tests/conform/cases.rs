//! The cases: each makes a fresh connection with the peer and records
//! every call on it (see the crate docs).

use libc::{c_int, c_void, socklen_t};

use crate::peer::Peer;
use azsdp_test_support::{alarm_in, count_signal, delivered, set_timeout};

use crate::{T, close, crc, data, pbits, sleep_ms, wait_ready};

type R = Result<(), String>;

pub fn run(t: &mut T, p: &mut Peer, port: u16) -> R {
    count_signal(libc::SIGPIPE, true);
    let l = listener(port)?;
    stream(t, p, l)?;
    flags(t, p, l)?;
    options(t, p, l)?;
    descriptors(t, p, l)?;
    client_side(t, p)?;
    poll_family(t, p, l)?;
    epoll(t, p, l)?;
    half_close(t, p, l)?;
    departures(t, p, l)?;
    signals(t, p, l)?;
    fortified(t, p, l)?;
    processes(t, p, l)?;
    not_sockets(t)?;
    close(l);
    Ok(())
}

fn listener(port: u16) -> Result<c_int, String> {
    // SAFETY: a listener of ours on 127.0.0.1:port.
    unsafe {
        let l = libc::socket(libc::AF_INET, libc::SOCK_STREAM, 0);
        let one: c_int = 1;
        libc::setsockopt(
            l,
            libc::SOL_SOCKET,
            libc::SO_REUSEADDR,
            (&raw const one).cast(),
            4,
        );
        let a = crate::loopback(port);
        if libc::bind(l, (&raw const a).cast(), std::mem::size_of_val(&a) as u32) != 0 {
            return Err(format!("bind: {}", crate::ename(crate::errno())));
        }
        if libc::listen(l, 16) != 0 {
            return Err("listen".into());
        }
        Ok(l)
    }
}

/// A connection from the peer, accepted here (the call recorded).
fn conn(t: &mut T, p: &mut Peer, l: c_int) -> Result<c_int, String> {
    p.tell("connect");
    // SAFETY: accept(2) without an address.
    let c = t.call_fd("accept", || unsafe {
        libc::accept(l, std::ptr::null_mut(), std::ptr::null_mut())
    });
    let a = p.answer();
    if c < 0 || a != "ok" {
        return Err(format!("{}: no connection ({a})", t.case));
    }
    Ok(c)
}

/// Ask the peer, recording its answer (what it received, or did).
fn peer(t: &mut T, p: &mut Peer, cmd: &str) {
    let a = p.ask(cmd);
    t.line(&format!("peer {cmd}"), &a);
}

fn send(t: &mut T, c: c_int, b: &[u8], flags: c_int, what: &str) -> isize {
    // SAFETY: send(2) from our own buffer.
    t.call(what, || unsafe {
        libc::send(c, b.as_ptr().cast::<c_void>(), b.len(), flags)
    })
}

/// recv(2) of up to `len` bytes, recorded with what arrived.
fn recv(t: &mut T, c: c_int, len: usize, flags: c_int, what: &str) -> Vec<u8> {
    let mut b = vec![0u8; len];
    // SAFETY: recv(2) into our own buffer.
    let n = t.call(what, || unsafe {
        libc::recv(c, b.as_mut_ptr().cast::<c_void>(), len, flags)
    });
    b.truncate(n.max(0) as usize);
    if n > 0 {
        t.line(&format!("{what}: data"), &format!("{:08x}", crc(&b)));
    }
    b
}

fn poll_rec(t: &mut T, fd: c_int, events: i16, ms: c_int, what: &str) -> i16 {
    let mut pf = libc::pollfd {
        fd,
        events,
        revents: 0,
    };
    // SAFETY: one pollfd of ours.
    let n = t.call(what, || unsafe { libc::poll(&mut pf, 1, ms) } as isize);
    t.line(&format!("{what}: revents"), &pbits(pf.revents));
    let _ = n;
    pf.revents
}

fn int_opt(t: &mut T, c: c_int, level: c_int, name: c_int, what: &str) -> c_int {
    let mut v: c_int = -1;
    let mut len = std::mem::size_of::<c_int>() as socklen_t;
    // SAFETY: getsockopt(2) into our own int.
    t.call_i(what, || unsafe {
        libc::getsockopt(c, level, name, (&raw mut v).cast(), &mut len)
    });
    t.line(&format!("{what}: value"), &format!("{v} (len {len})"));
    v
}

fn set_int_opt(t: &mut T, c: c_int, level: c_int, name: c_int, v: c_int, what: &str) {
    // SAFETY: setsockopt(2) from our own int.
    t.call_i(what, || unsafe {
        libc::setsockopt(c, level, name, (&raw const v).cast(), 4)
    });
}

/// Data both ways through every send and receive call.
fn stream(t: &mut T, p: &mut Peer, l: c_int) -> R {
    t.case("stream");
    let c = conn(t, p, l)?;
    let m = data(100, 1);
    send(t, c, &m, 0, "send 100");
    peer(t, p, "recv 100");
    t.line("expected", &format!("{:08x}", crc(&m)));
    peer(t, p, "send 100 2");
    wait_ready(c, libc::POLLIN);
    recv(t, c, 1000, 0, "recv up to 1000");
    // write / read
    let m = data(50, 3);
    // SAFETY: write(2) from our own buffer.
    t.call("write 50", || unsafe {
        libc::write(c, m.as_ptr().cast(), 50)
    });
    peer(t, p, "recv 50");
    peer(t, p, "send 70 4");
    wait_ready(c, libc::POLLIN);
    let mut b = vec![0u8; 1000];
    // SAFETY: read(2) into our own buffer.
    let n = t.call("read up to 1000", || unsafe {
        libc::read(c, b.as_mut_ptr().cast(), 1000)
    });
    t.line(
        "read: data",
        &format!("{:08x}", crc(&b[..n.max(0) as usize])),
    );
    // writev / readv
    let parts = [data(10, 5), data(20, 6), data(30, 7)];
    let iov: Vec<libc::iovec> = parts
        .iter()
        .map(|b| libc::iovec {
            iov_base: b.as_ptr() as *mut c_void,
            iov_len: b.len(),
        })
        .collect();
    // SAFETY: writev(2) of our own iovecs.
    t.call("writev 10+20+30", || unsafe {
        libc::writev(c, iov.as_ptr(), 3)
    });
    peer(t, p, "recv 60");
    t.line("expected", &format!("{:08x}", crc(&parts.concat())));
    peer(t, p, "send 60 8");
    wait_ready(c, libc::POLLIN);
    let (mut a, mut z) = (vec![0u8; 40], vec![0u8; 100]);
    let iov = [
        libc::iovec {
            iov_base: a.as_mut_ptr().cast(),
            iov_len: 40,
        },
        libc::iovec {
            iov_base: z.as_mut_ptr().cast(),
            iov_len: 100,
        },
    ];
    // SAFETY: readv(2) into our own iovecs.
    let n = t.call("readv 40+100", || unsafe {
        libc::readv(c, iov.as_ptr(), 2)
    });
    let got = [&a[..], &z[..(n.max(40) - 40) as usize]].concat();
    t.line("readv: data", &format!("{:08x}", crc(&got)));
    // sendmsg / recvmsg
    let parts = [data(25, 9), data(35, 10)];
    let iov: Vec<libc::iovec> = parts
        .iter()
        .map(|b| libc::iovec {
            iov_base: b.as_ptr() as *mut c_void,
            iov_len: b.len(),
        })
        .collect();
    // SAFETY: plain data.
    let mut m: libc::msghdr = unsafe { std::mem::zeroed() };
    m.msg_iov = iov.as_ptr().cast_mut();
    m.msg_iovlen = 2;
    // SAFETY: sendmsg(2) of our own msghdr.
    t.call("sendmsg 25+35", || unsafe { libc::sendmsg(c, &m, 0) });
    peer(t, p, "recv 60");
    peer(t, p, "send 45 11");
    wait_ready(c, libc::POLLIN);
    let mut rb = vec![0u8; 200];
    let mut name: libc::sockaddr_storage =
        // SAFETY: plain data.
        unsafe { std::mem::zeroed() };
    let mut ctl = [0u8; 64];
    let riov = libc::iovec {
        iov_base: rb.as_mut_ptr().cast(),
        iov_len: 200,
    };
    // SAFETY: plain data.
    let mut m: libc::msghdr = unsafe { std::mem::zeroed() };
    m.msg_iov = (&raw const riov).cast_mut();
    m.msg_iovlen = 1;
    m.msg_name = (&raw mut name).cast();
    m.msg_namelen = std::mem::size_of_val(&name) as u32;
    m.msg_control = ctl.as_mut_ptr().cast();
    m.msg_controllen = ctl.len();
    // SAFETY: recvmsg(2) into our own msghdr.
    let n = t.call("recvmsg 200", || unsafe { libc::recvmsg(c, &mut m, 0) });
    t.line(
        "recvmsg: data, namelen, controllen, flags",
        &format!(
            "{:08x} {} {} {:#x}",
            crc(&rb[..n.max(0) as usize]),
            m.msg_namelen,
            m.msg_controllen,
            m.msg_flags
        ),
    );
    // sendto / recvfrom
    let m = data(33, 12);
    // SAFETY: sendto(2) without an address.
    t.call("sendto 33 without address", || unsafe {
        libc::sendto(c, m.as_ptr().cast(), 33, 0, std::ptr::null(), 0)
    });
    peer(t, p, "recv 33");
    let other = crate::loopback(9);
    // SAFETY: sendto(2) with an address, on a connected stream.
    t.call("sendto 33 with an address", || unsafe {
        libc::sendto(
            c,
            m.as_ptr().cast(),
            33,
            0,
            (&raw const other).cast(),
            std::mem::size_of_val(&other) as u32,
        )
    });
    peer(t, p, "recv 33");
    peer(t, p, "send 21 13");
    wait_ready(c, libc::POLLIN);
    let mut from: libc::sockaddr_storage =
        // SAFETY: plain data.
        unsafe { std::mem::zeroed() };
    let mut flen = std::mem::size_of_val(&from) as socklen_t;
    let mut rb = vec![0u8; 100];
    // SAFETY: recvfrom(2) into our own buffers.
    let n = t.call("recvfrom 100 with an address", || unsafe {
        libc::recvfrom(
            c,
            rb.as_mut_ptr().cast(),
            100,
            0,
            (&raw mut from).cast(),
            &mut flen,
        )
    });
    t.line(
        "recvfrom: data, address length",
        &format!("{:08x} {flen}", crc(&rb[..n.max(0) as usize])),
    );
    // Zero lengths.
    send(t, c, &[], 0, "send 0 bytes");
    // SAFETY: recv(2) of nothing, nonblocking.
    t.call("recv 0 bytes", || unsafe {
        libc::recv(c, rb.as_mut_ptr().cast(), 0, libc::MSG_DONTWAIT)
    });
    close(c);
    peer(t, p, "drain");
    Ok(())
}

/// MSG_PEEK, MSG_WAITALL, MSG_DONTWAIT, MSG_TRUNC, MSG_OOB, MSG_NOSIGNAL.
fn flags(t: &mut T, p: &mut Peer, l: c_int) -> R {
    t.case("flags");
    let c = conn(t, p, l)?;
    recv(
        t,
        c,
        10,
        libc::MSG_DONTWAIT,
        "recv DONTWAIT with nothing there",
    );
    peer(t, p, "send 30 20");
    wait_ready(c, libc::POLLIN);
    recv(t, c, 100, libc::MSG_PEEK, "recv PEEK 100");
    recv(t, c, 10, libc::MSG_PEEK, "recv PEEK 10");
    recv(t, c, 100, 0, "recv 100 after peeking");
    p.tell("send 20 21");
    p.answer();
    p.tell("sendafter 200 30 22");
    p.answer();
    recv(t, c, 50, libc::MSG_WAITALL, "recv WAITALL 50");
    peer(t, p, "send 10 23");
    wait_ready(c, libc::POLLIN);
    // SAFETY: recv(2) with MSG_TRUNC and no buffer: TCP discards.
    t.call("recv TRUNC 4 into no buffer", || unsafe {
        libc::recv(c, std::ptr::null_mut(), 4, libc::MSG_TRUNC)
    });
    recv(t, c, 100, 0, "recv the rest");
    recv(t, c, 10, libc::MSG_OOB, "recv OOB with none");
    send(t, c, b"!", libc::MSG_OOB, "send OOB");
    send(
        t,
        c,
        b"abc",
        libc::MSG_NOSIGNAL | libc::MSG_MORE,
        "send NOSIGNAL|MORE",
    );
    send(t, c, b"def", libc::MSG_DONTWAIT, "send DONTWAIT");
    close(c);
    peer(t, p, "drain");
    Ok(())
}

/// Socket options, fcntl and ioctl on a connection.
fn options(t: &mut T, p: &mut Peer, l: c_int) -> R {
    t.case("options");
    let c = conn(t, p, l)?;
    int_opt(t, c, libc::SOL_SOCKET, libc::SO_ERROR, "SO_ERROR");
    int_opt(t, c, libc::SOL_SOCKET, libc::SO_TYPE, "SO_TYPE");
    int_opt(t, c, libc::SOL_SOCKET, libc::SO_DOMAIN, "SO_DOMAIN");
    int_opt(t, c, libc::SOL_SOCKET, libc::SO_ACCEPTCONN, "SO_ACCEPTCONN");
    set_int_opt(
        t,
        c,
        libc::IPPROTO_TCP,
        libc::TCP_NODELAY,
        1,
        "set TCP_NODELAY",
    );
    int_opt(t, c, libc::IPPROTO_TCP, libc::TCP_NODELAY, "TCP_NODELAY");
    set_int_opt(
        t,
        c,
        libc::SOL_SOCKET,
        libc::SO_KEEPALIVE,
        1,
        "set SO_KEEPALIVE",
    );
    int_opt(t, c, libc::SOL_SOCKET, libc::SO_KEEPALIVE, "SO_KEEPALIVE");
    set_int_opt(t, c, libc::SOL_SOCKET, 9999, 1, "set an unknown option");
    // SAFETY: setsockopt(2) with a short value.
    t.call_i("set SO_KEEPALIVE with 2 bytes", || unsafe {
        let v: c_int = 1;
        libc::setsockopt(
            c,
            libc::SOL_SOCKET,
            libc::SO_KEEPALIVE,
            (&raw const v).cast(),
            2,
        )
    });
    let mut small: u16 = 0;
    let mut slen: socklen_t = 2;
    // SAFETY: getsockopt(2) into a 2-byte buffer.
    t.call_i("SO_ERROR into 2 bytes", || unsafe {
        libc::getsockopt(
            c,
            libc::SOL_SOCKET,
            libc::SO_ERROR,
            (&raw mut small).cast(),
            &mut slen,
        )
    });
    t.line("SO_ERROR into 2 bytes: length", &slen.to_string());
    t.call_i("set SO_RCVTIMEO 200 ms", || {
        set_timeout(c, libc::SO_RCVTIMEO, 200)
    });
    recv(t, c, 10, 0, "recv with SO_RCVTIMEO and nothing there");
    set_timeout(c, libc::SO_RCVTIMEO, 0);
    // fcntl
    // SAFETY: fcntl(2) of our descriptor.
    let fl = t.call_i("F_GETFL", || unsafe { libc::fcntl(c, libc::F_GETFL) });
    // SAFETY: as above.
    t.call_i("F_SETFL O_NONBLOCK", || unsafe {
        libc::fcntl(c, libc::F_SETFL, fl | libc::O_NONBLOCK)
    });
    // SAFETY: as above.
    t.call_i("F_GETFL", || unsafe { libc::fcntl(c, libc::F_GETFL) });
    recv(t, c, 10, 0, "recv non-blocking with nothing there");
    // SAFETY: as above.
    t.call_i("F_SETFL 0", || unsafe { libc::fcntl(c, libc::F_SETFL, fl) });
    // SAFETY: as above.
    t.call_i("F_GETFD", || unsafe { libc::fcntl(c, libc::F_GETFD) });
    // SAFETY: as above.
    t.call_i("F_SETFD FD_CLOEXEC", || unsafe {
        libc::fcntl(c, libc::F_SETFD, libc::FD_CLOEXEC)
    });
    // SAFETY: as above.
    t.call_i("F_GETFD", || unsafe { libc::fcntl(c, libc::F_GETFD) });
    // SAFETY: fcntl(2) with a bad command.
    t.call_i("fcntl bad command", || unsafe { libc::fcntl(c, 9999) });
    // ioctl
    let mut on: c_int = 1;
    // SAFETY: FIONBIO from our own int.
    t.call_i("FIONBIO 1", || unsafe {
        libc::ioctl(c, libc::FIONBIO, &mut on)
    });
    recv(t, c, 10, 0, "recv after FIONBIO with nothing there");
    on = 0;
    // SAFETY: as above.
    t.call_i("FIONBIO 0", || unsafe {
        libc::ioctl(c, libc::FIONBIO, &mut on)
    });
    peer(t, p, "send 42 30");
    wait_ready(c, libc::POLLIN);
    sleep_ms(50);
    let mut n: c_int = -1;
    // SAFETY: FIONREAD into our own int.
    t.call_i("FIONREAD", || unsafe {
        libc::ioctl(c, libc::FIONREAD, &mut n)
    });
    t.line("FIONREAD: value", &n.to_string());
    // SAFETY: an ioctl sockets do not know.
    t.call_i("ioctl TCGETS", || unsafe {
        let mut tio: libc::termios = std::mem::zeroed();
        libc::ioctl(c, libc::TCGETS, &mut tio)
    });
    recv(t, c, 100, 0, "recv the 42");
    // Names
    let mut a: libc::sockaddr_in =
        // SAFETY: plain data.
        unsafe { std::mem::zeroed() };
    let mut alen = std::mem::size_of_val(&a) as socklen_t;
    // SAFETY: getsockname(2) into our own buffer.
    t.call_i("getsockname", || unsafe {
        libc::getsockname(c, (&raw mut a).cast(), &mut alen)
    });
    t.line(
        "getsockname: family, address, port, length",
        &format!(
            "{} {:#x} {} {alen}",
            a.sin_family,
            u32::from_be(a.sin_addr.s_addr),
            u16::from_be(a.sin_port) != 0
        ),
    );
    let mut short = [0u8; 4];
    let mut slen: socklen_t = 4;
    // SAFETY: getpeername(2) into a 4-byte buffer.
    t.call_i("getpeername into 4 bytes", || unsafe {
        libc::getpeername(c, short.as_mut_ptr().cast(), &mut slen)
    });
    t.line("getpeername into 4 bytes: length", &slen.to_string());
    close(c);
    peer(t, p, "drain");
    Ok(())
}

/// dup, dup2, dup3, F_DUPFD, close.
fn descriptors(t: &mut T, p: &mut Peer, l: c_int) -> R {
    t.case("descriptors");
    let c = conn(t, p, l)?;
    // SAFETY: dup(2) of our descriptor.
    let d = t.call_fd("dup", || unsafe { libc::dup(c) });
    send(t, d, b"via dup", 0, "send through the dup");
    peer(t, p, "recv 7");
    // SAFETY: dup3(2) with flags it refuses.
    t.call_fd("dup3 with bad flags", || unsafe {
        libc::dup3(d, 900, 0x1234)
    });
    // SAFETY: dup3(2) onto itself.
    t.call_fd("dup3 onto itself", || unsafe { libc::dup3(d, d, 0) });
    // SAFETY: dup2(2) onto itself.
    let same = t.call_fd("dup2 onto itself", || unsafe { libc::dup2(d, d) });
    t.line("dup2 onto itself: same", &(same == d).to_string());
    // SAFETY: dup3(2) to a free number.
    let e = t.call_fd("dup3 O_CLOEXEC", || unsafe {
        libc::dup3(d, 901, libc::O_CLOEXEC)
    });
    // SAFETY: fcntl(2).
    t.call_i("F_GETFD of the dup3", || unsafe {
        libc::fcntl(e, libc::F_GETFD)
    });
    // SAFETY: fcntl(2) F_DUPFD.
    let f = t.call_fd("F_DUPFD_CLOEXEC", || unsafe {
        libc::fcntl(d, libc::F_DUPFD_CLOEXEC, 0)
    });
    close(c);
    close(d);
    close(e);
    send(t, f, b"last one", 0, "send through the last descriptor");
    peer(t, p, "recv 8");
    peer(t, p, "send 9 40");
    wait_ready(f, libc::POLLIN);
    recv(t, f, 100, 0, "recv through the last descriptor");
    // dup2 over an open connection closes it.
    let (r0, w0) = pipe_pair();
    // SAFETY: dup2(2) of a pipe over our connection.
    t.call_fd("dup2 a pipe over the connection", || unsafe {
        libc::dup2(r0, f)
    });
    peer(t, p, "drain");
    close(f);
    close(r0);
    close(w0);
    // SAFETY: close(2) of what is closed.
    t.call_i("close twice", || unsafe { libc::close(f) });
    Ok(())
}

fn pipe_pair() -> (c_int, c_int) {
    let mut p = [0 as c_int; 2];
    // SAFETY: pipe(2) into our own array.
    unsafe { libc::pipe(p.as_mut_ptr()) };
    (p[0], p[1])
}

/// socket, connect (blocking and not), accept4 flags, listen and bind
/// where they do not belong.
fn client_side(t: &mut T, p: &mut Peer) -> R {
    t.case("client");
    let ans = p.ask("listen");
    let port: u16 = ans
        .strip_prefix("port ")
        .and_then(|x| x.parse().ok())
        .ok_or(format!("peer listen: {ans}"))?;
    // SAFETY: socket(2).
    let s = t.call_fd("socket SOCK_NONBLOCK|SOCK_CLOEXEC", || unsafe {
        libc::socket(
            libc::AF_INET,
            libc::SOCK_STREAM | libc::SOCK_NONBLOCK | libc::SOCK_CLOEXEC,
            0,
        )
    });
    p.tell("accept");
    let a = crate::loopback(port);
    // SAFETY: connect(2) to our own address.
    t.call_i("connect non-blocking", || unsafe {
        libc::connect(s, (&raw const a).cast(), std::mem::size_of_val(&a) as u32)
    });
    poll_rec(t, s, libc::POLLOUT, 5000, "poll OUT after connect");
    let ans = p.answer();
    t.line("peer accept", &ans);
    int_opt(
        t,
        s,
        libc::SOL_SOCKET,
        libc::SO_ERROR,
        "SO_ERROR after connect",
    );
    // SAFETY: connect(2) again.
    t.call_i("connect again", || unsafe {
        libc::connect(s, (&raw const a).cast(), std::mem::size_of_val(&a) as u32)
    });
    // SAFETY: listen(2) on a connected socket.
    t.call_i("listen on a connection", || unsafe { libc::listen(s, 1) });
    let b = crate::loopback(0);
    // SAFETY: bind(2) of a connected socket.
    t.call_i("bind a connection", || unsafe {
        libc::bind(s, (&raw const b).cast(), std::mem::size_of_val(&b) as u32)
    });
    // SAFETY: accept(2) on a connection.
    t.call_fd("accept on a connection", || unsafe {
        libc::accept(s, std::ptr::null_mut(), std::ptr::null_mut())
    });
    send(t, s, b"from the client", 0, "send 15");
    peer(t, p, "recv 15");
    close(s);
    peer(t, p, "drain");
    Ok(())
}

/// poll, ppoll, select, pselect over a connection's states.
fn poll_family(t: &mut T, p: &mut Peer, l: c_int) -> R {
    t.case("poll");
    let c = conn(t, p, l)?;
    let all = libc::POLLIN | libc::POLLOUT | libc::POLLRDHUP | libc::POLLPRI;
    poll_rec(t, c, all, 0, "poll idle");
    poll_rec(t, c, libc::POLLIN, 0, "poll IN idle");
    peer(t, p, "send 10 50");
    wait_ready(c, libc::POLLIN);
    poll_rec(t, c, all, 0, "poll with data");
    let ts = libc::timespec {
        tv_sec: 0,
        tv_nsec: 0,
    };
    let mut pf = libc::pollfd {
        fd: c,
        events: libc::POLLIN,
        revents: 0,
    };
    // SAFETY: ppoll(2) of one pollfd of ours.
    t.call(
        "ppoll IN with data",
        || unsafe { libc::ppoll(&mut pf, 1, &ts, std::ptr::null()) } as isize,
    );
    t.line("ppoll: revents", &pbits(pf.revents));
    // With a pipe beside it, and a closed descriptor (POLLNVAL).
    let (r0, w0) = pipe_pair();
    let (dead, _) = pipe_pair();
    close(dead);
    let mut fds = [
        libc::pollfd {
            fd: r0,
            events: libc::POLLIN,
            revents: 0,
        },
        libc::pollfd {
            fd: c,
            events: libc::POLLIN | libc::POLLOUT,
            revents: 0,
        },
        libc::pollfd {
            fd: dead,
            events: libc::POLLIN,
            revents: 0,
        },
        libc::pollfd {
            fd: -1,
            events: libc::POLLIN,
            revents: 0,
        },
    ];
    // SAFETY: poll(2) of our array.
    t.call(
        "poll pipe, connection, closed fd, -1",
        || unsafe { libc::poll(fds.as_mut_ptr(), 4, 0) } as isize,
    );
    let rs: Vec<String> = fds.iter().map(|f| pbits(f.revents)).collect();
    t.line("poll: revents", &rs.join(" "));
    // SAFETY: write(2) to our pipe.
    unsafe { libc::write(w0, b"x".as_ptr().cast(), 1) };
    // SAFETY: as above.
    t.call(
        "poll with the pipe readable",
        || unsafe { libc::poll(fds.as_mut_ptr(), 2, 0) } as isize,
    );
    let rs: Vec<String> = fds[..2].iter().map(|f| pbits(f.revents)).collect();
    t.line("poll: revents", &rs.join(" "));
    // select and pselect
    let sel = |t: &mut T, what: &str, fdr: &[c_int], fdw: &[c_int], pselect: bool| {
        // SAFETY: fd_sets and times on our stack, all fds < FD_SETSIZE.
        unsafe {
            let mut rs: libc::fd_set = std::mem::zeroed();
            let mut ws: libc::fd_set = std::mem::zeroed();
            let mut es: libc::fd_set = std::mem::zeroed();
            let mut max = 0;
            for &f in fdr {
                libc::FD_SET(f, &mut rs);
                max = max.max(f);
            }
            for &f in fdw {
                libc::FD_SET(f, &mut ws);
                libc::FD_SET(f, &mut es);
                max = max.max(f);
            }
            let mut tv = libc::timeval {
                tv_sec: 0,
                tv_usec: 0,
            };
            let ts = libc::timespec {
                tv_sec: 0,
                tv_nsec: 0,
            };
            t.call(what, || {
                if pselect {
                    libc::pselect(max + 1, &mut rs, &mut ws, &mut es, &ts, std::ptr::null())
                        as isize
                } else {
                    libc::select(max + 1, &mut rs, &mut ws, &mut es, &mut tv) as isize
                }
            });
            let mut got = Vec::new();
            for &f in fdr {
                got.push(format!("r{}", libc::FD_ISSET(f, &rs) as u8));
            }
            for &f in fdw {
                got.push(format!(
                    "w{}e{}",
                    libc::FD_ISSET(f, &ws) as u8,
                    libc::FD_ISSET(f, &es) as u8
                ));
            }
            t.line(&format!("{what}: sets"), &got.join(" "));
        }
    };
    sel(t, "select read+write", &[c, r0], &[c], false);
    sel(t, "pselect read+write", &[c, r0], &[c], true);
    recv(t, c, 100, 0, "recv the 10");
    sel(t, "select read idle", &[c], &[], false);
    // A timeout passes: nothing ready.
    select_read(t, c, 50, "select 50 ms idle");
    poll_rec(t, c, libc::POLLIN, 50, "poll 50 ms idle");
    close(r0);
    close(w0);
    close(c);
    peer(t, p, "drain");
    Ok(())
}

/// select(2) for reading `c` alone, with a timeout; recorded.
fn select_read(t: &mut T, c: c_int, ms: u64, what: &str) -> isize {
    let mut tv = libc::timeval {
        tv_sec: (ms / 1000) as libc::time_t,
        tv_usec: ((ms % 1000) * 1000) as libc::suseconds_t,
    };
    // SAFETY: select(2) of our own set and timeout.
    t.call(what, || unsafe {
        let mut rs: libc::fd_set = std::mem::zeroed();
        libc::FD_SET(c, &mut rs);
        libc::select(
            c + 1,
            &mut rs,
            std::ptr::null_mut(),
            std::ptr::null_mut(),
            &mut tv,
        ) as isize
    })
}

fn epoll_ctl(t: &mut T, ep: c_int, op: c_int, fd: c_int, events: u32, what: &str) -> c_int {
    let mut ev = libc::epoll_event {
        events,
        u64: fd as u64,
    };
    // SAFETY: epoll_ctl(2) with our own event.
    t.call_i(what, || unsafe { libc::epoll_ctl(ep, op, fd, &mut ev) })
}

fn epoll_wait(t: &mut T, ep: c_int, ms: c_int, what: &str) -> usize {
    let mut evs = [libc::epoll_event { events: 0, u64: 0 }; 4];
    // SAFETY: epoll_wait(2) into our own array.
    let n = t.call(
        what,
        || unsafe { libc::epoll_wait(ep, evs.as_mut_ptr(), 4, ms) } as isize,
    );
    let got: Vec<String> = evs[..n.max(0) as usize]
        .iter()
        .map(|e| pbits(e.events as i16))
        .collect();
    t.line(&format!("{what}: events"), &got.join(" "));
    n.max(0) as usize
}

/// epoll: level, edge, one-shot, the control errors, epoll_pwait.
fn epoll(t: &mut T, p: &mut Peer, l: c_int) -> R {
    t.case("epoll");
    let c = conn(t, p, l)?;
    // SAFETY: epoll_create(2) with a size it refuses, then valid ones.
    t.call_fd("epoll_create 0", || unsafe { libc::epoll_create(0) });
    // SAFETY: as above.
    let e1 = t.call_fd("epoll_create 1", || unsafe { libc::epoll_create(1) });
    close(e1);
    // SAFETY: epoll_create1(2).
    t.call_fd("epoll_create1 bad flags", || unsafe {
        libc::epoll_create1(0x1234)
    });
    // SAFETY: as above.
    let ep = t.call_fd("epoll_create1 EPOLL_CLOEXEC", || unsafe {
        libc::epoll_create1(libc::EPOLL_CLOEXEC)
    });
    let et = (libc::EPOLLIN | libc::EPOLLET | libc::EPOLLRDHUP) as u32;
    epoll_ctl(t, ep, libc::EPOLL_CTL_ADD, c, et, "ADD IN|ET|RDHUP");
    epoll_ctl(t, ep, libc::EPOLL_CTL_ADD, c, et, "ADD again");
    epoll_ctl(t, ep, libc::EPOLL_CTL_ADD, ep, et, "ADD itself");
    epoll_ctl(t, ep, 99, c, et, "bad op");
    epoll_wait(t, ep, 0, "wait idle");
    peer(t, p, "send 10 60");
    epoll_wait(t, ep, 5000, "wait for data");
    epoll_wait(t, ep, 0, "wait again, edge");
    peer(t, p, "send 5 61");
    epoll_wait(t, ep, 5000, "wait for more data");
    recv(t, c, 100, 0, "recv 15");
    epoll_ctl(
        t,
        ep,
        libc::EPOLL_CTL_MOD,
        c,
        libc::EPOLLIN as u32,
        "MOD to IN, level",
    );
    peer(t, p, "send 3 62");
    epoll_wait(t, ep, 5000, "wait level");
    epoll_wait(t, ep, 0, "wait level again");
    recv(t, c, 100, 0, "recv 3");
    epoll_wait(t, ep, 0, "wait level after reading");
    epoll_ctl(
        t,
        ep,
        libc::EPOLL_CTL_MOD,
        c,
        (libc::EPOLLIN | libc::EPOLLOUT) as u32,
        "MOD to IN|OUT",
    );
    epoll_wait(t, ep, 0, "wait IN|OUT idle");
    epoll_ctl(t, ep, libc::EPOLL_CTL_DEL, c, 0, "DEL");
    epoll_ctl(t, ep, libc::EPOLL_CTL_DEL, c, 0, "DEL again");
    epoll_ctl(
        t,
        ep,
        libc::EPOLL_CTL_MOD,
        c,
        libc::EPOLLIN as u32,
        "MOD after DEL",
    );
    epoll_ctl(
        t,
        ep,
        libc::EPOLL_CTL_ADD,
        c,
        (libc::EPOLLIN | libc::EPOLLONESHOT) as u32,
        "ADD IN|ONESHOT",
    );
    peer(t, p, "send 4 63");
    epoll_wait(t, ep, 5000, "wait one-shot");
    epoll_wait(t, ep, 0, "wait one-shot again");
    epoll_ctl(
        t,
        ep,
        libc::EPOLL_CTL_MOD,
        c,
        (libc::EPOLLIN | libc::EPOLLONESHOT) as u32,
        "MOD re-arms",
    );
    epoll_wait(t, ep, 0, "wait re-armed");
    let mut evs = [libc::epoll_event { events: 0, u64: 0 }; 2];
    // SAFETY: an empty signal set of ours.
    let mut none: libc::sigset_t = unsafe { std::mem::zeroed() };
    // SAFETY: as above.
    unsafe { libc::sigemptyset(&mut none) };
    // SAFETY: epoll_pwait(2) into our own array.
    t.call(
        "epoll_pwait",
        || unsafe { libc::epoll_pwait(ep, evs.as_mut_ptr(), 2, 0, &none) } as isize,
    );
    // SAFETY: epoll_wait(2) with a bad count.
    t.call(
        "epoll_wait maxevents 0",
        || unsafe { libc::epoll_wait(ep, evs.as_mut_ptr(), 0, 0) } as isize,
    );
    recv(t, c, 100, 0, "recv 4");
    epoll_ctl(
        t,
        ep,
        libc::EPOLL_CTL_MOD,
        c,
        libc::EPOLLIN as u32,
        "MOD to IN, for epoll_pwait2",
    );
    peer(t, p, "send 2 66");
    wait_ready(c, libc::POLLIN);
    let ts = libc::timespec {
        tv_sec: 5,
        tv_nsec: 0,
    };
    // SAFETY: epoll_pwait2(2) into our own array, with our own timeout.
    t.call("epoll_pwait2 with the connection readable", || unsafe {
        libc::epoll_pwait2(ep, evs.as_mut_ptr(), 2, &ts, &none)
    }
        as isize);
    t.line(
        "epoll_pwait2: event",
        &format!("{:#x} {}", { evs[0].events }, { evs[0].u64 } == c as u64),
    );
    recv(t, c, 100, 0, "recv 2");
    let bad = libc::timespec {
        tv_sec: 0,
        tv_nsec: 2_000_000_000,
    };
    // SAFETY: epoll_pwait2(2) with a timeout it refuses.
    t.call("epoll_pwait2 bad timeout", || unsafe {
        libc::epoll_pwait2(ep, evs.as_mut_ptr(), 2, &bad, std::ptr::null())
    } as isize);
    // A pipe and the connection in one set.
    let (r0, w0) = pipe_pair();
    epoll_ctl(
        t,
        ep,
        libc::EPOLL_CTL_ADD,
        r0,
        libc::EPOLLIN as u32,
        "ADD a pipe",
    );
    // SAFETY: write(2) to our pipe.
    unsafe { libc::write(w0, b"x".as_ptr().cast(), 1) };
    peer(t, p, "send 6 64");
    wait_ready(c, libc::POLLIN);
    epoll_wait(t, ep, 0, "wait pipe and connection");
    // SAFETY: read(2) of the pipe's byte into our own.
    unsafe { libc::read(r0, [0u8; 1].as_mut_ptr().cast(), 1) };
    recv(t, c, 100, 0, "recv 6");
    // Emptied of the connection: waits there are the kernel's again. A
    // thread asleep in it wakes for the connection added meanwhile from
    // another thread, when its bytes come.
    epoll_ctl(t, ep, libc::EPOLL_CTL_DEL, c, 0, "DEL the connection");
    epoll_wait(t, ep, 0, "wait with the pipe alone");
    let sleeper = std::thread::spawn(move || {
        let mut evs = [libc::epoll_event { events: 0, u64: 0 }; 4];
        // SAFETY: epoll_wait(2) into this thread's own array.
        let n = unsafe { libc::epoll_wait(ep, evs.as_mut_ptr(), 4, 10_000) };
        let got: Vec<String> = evs[..n.max(0) as usize]
            .iter()
            .map(|e| {
                // (Descriptor numbers differ under the shim: say whose.)
                let (bits, data) = (e.events, e.u64);
                let whose = if data == c as u64 {
                    "the connection"
                } else {
                    "?"
                };
                format!("{bits:#x} {whose}")
            })
            .collect();
        format!("{n} [{}]", got.join(", "))
    });
    // Asleep in the kernel by now (if not, it finds the connection).
    sleep_ms(200);
    epoll_ctl(
        t,
        ep,
        libc::EPOLL_CTL_ADD,
        c,
        libc::EPOLLIN as u32,
        "ADD from another thread",
    );
    peer(t, p, "send 7 65");
    let woke = sleeper.join().unwrap_or_else(|_| "panicked".into());
    t.line("the sleeping thread's wait", &woke);
    recv(t, c, 100, 0, "recv 7");
    close(r0);
    close(w0);
    close(ep);
    close(c);
    peer(t, p, "drain");
    Ok(())
}

/// shutdown in each direction, and its errors.
fn half_close(t: &mut T, p: &mut Peer, l: c_int) -> R {
    t.case("shutdown");
    let c = conn(t, p, l)?;
    let all = libc::POLLIN | libc::POLLOUT | libc::POLLRDHUP;
    // SAFETY: shutdown(2) with a bad direction.
    t.call_i("shutdown 99", || unsafe { libc::shutdown(c, 99) });
    send(t, c, &data(20, 70), 0, "send 20");
    // SAFETY: shutdown(2).
    t.call_i("shutdown SHUT_WR", || unsafe {
        libc::shutdown(c, libc::SHUT_WR)
    });
    peer(t, p, "drain");
    let before = delivered(libc::SIGPIPE);
    send(t, c, b"late", 0, "send after SHUT_WR");
    t.line("SIGPIPE", &(delivered(libc::SIGPIPE) - before).to_string());
    send(
        t,
        c,
        b"late",
        libc::MSG_NOSIGNAL,
        "send NOSIGNAL after SHUT_WR",
    );
    t.line("SIGPIPE", &(delivered(libc::SIGPIPE) - before).to_string());
    poll_rec(t, c, all, 0, "poll after SHUT_WR");
    peer(t, p, "send 12 71");
    wait_ready(c, libc::POLLIN);
    recv(t, c, 100, 0, "recv while half-closed");
    // SAFETY: shutdown(2).
    t.call_i("shutdown SHUT_WR again", || unsafe {
        libc::shutdown(c, libc::SHUT_WR)
    });
    peer(t, p, "shutdown 1");
    wait_ready(c, libc::POLLRDHUP);
    poll_rec(t, c, all, 0, "poll after both sides shut");
    recv(t, c, 100, 0, "recv at the end");
    close(c);
    // SHUT_RD, and SHUT_RDWR on another connection.
    let c = conn(t, p, l)?;
    // SAFETY: shutdown(2).
    t.call_i("shutdown SHUT_RD", || unsafe {
        libc::shutdown(c, libc::SHUT_RD)
    });
    recv(t, c, 100, 0, "recv after SHUT_RD");
    poll_rec(t, c, all, 0, "poll after SHUT_RD");
    send(t, c, b"still", 0, "send after SHUT_RD");
    peer(t, p, "recv 5");
    // SAFETY: shutdown(2).
    t.call_i("shutdown SHUT_RDWR", || unsafe {
        libc::shutdown(c, libc::SHUT_RDWR)
    });
    peer(t, p, "drain");
    poll_rec(t, c, all, 0, "poll after SHUT_RDWR");
    close(c);
    peer(t, p, "close");
    Ok(())
}

/// The peer closes, with or without our data unread, or resets.
fn departures(t: &mut T, p: &mut Peer, l: c_int) -> R {
    let all = libc::POLLIN | libc::POLLOUT | libc::POLLRDHUP;
    t.case("peer-closed");
    let c = conn(t, p, l)?;
    peer(t, p, "send 10 80");
    peer(t, p, "close");
    wait_ready(c, libc::POLLRDHUP);
    sleep_ms(100);
    poll_rec(t, c, all, 0, "poll after the peer closed");
    recv(t, c, 100, 0, "recv its data");
    recv(t, c, 100, 0, "recv at the end");
    recv(t, c, 100, 0, "recv at the end again");
    let before = delivered(libc::SIGPIPE);
    send(
        t,
        c,
        b"to nobody",
        libc::MSG_NOSIGNAL,
        "send to the closed peer",
    );
    sleep_ms(100);
    send(
        t,
        c,
        b"to nobody",
        libc::MSG_NOSIGNAL,
        "send to the closed peer again",
    );
    t.line("SIGPIPE", &(delivered(libc::SIGPIPE) - before).to_string());
    close(c);

    t.case("peer-closed-unread");
    let c = conn(t, p, l)?;
    send(t, c, &data(100, 81), 0, "send 100 it never reads");
    sleep_ms(100);
    peer(t, p, "close");
    wait_ready(c, libc::POLLERR);
    sleep_ms(100);
    poll_rec(t, c, all, 0, "poll after the peer closed unread");
    int_opt(t, c, libc::SOL_SOCKET, libc::SO_ERROR, "SO_ERROR");
    recv(t, c, 100, 0, "recv");
    recv(t, c, 100, 0, "recv again");
    send(t, c, b"x", libc::MSG_NOSIGNAL, "send");
    int_opt(
        t,
        c,
        libc::SOL_SOCKET,
        libc::SO_ERROR,
        "SO_ERROR at the end",
    );
    close(c);

    t.case("peer-reset");
    let c = conn(t, p, l)?;
    peer(t, p, "reset");
    wait_ready(c, libc::POLLERR);
    sleep_ms(100);
    poll_rec(t, c, all, 0, "poll after a reset");
    send(t, c, b"x", libc::MSG_NOSIGNAL, "send");
    send(t, c, b"x", libc::MSG_NOSIGNAL, "send again");
    recv(t, c, 100, 0, "recv");
    close(c);
    Ok(())
}

/// Calls interrupted by a signal handler, with and without SA_RESTART.
fn signals(t: &mut T, p: &mut Peer, l: c_int) -> R {
    t.case("signals");
    let c = conn(t, p, l)?;
    count_signal(libc::SIGALRM, false);
    let before = delivered(libc::SIGALRM);
    alarm_in(100);
    recv(t, c, 10, 0, "recv interrupted");
    alarm_in(100);
    poll_rec(t, c, libc::POLLIN, 5000, "poll interrupted");
    alarm_in(100);
    // SAFETY: epoll set of our own.
    let ep = unsafe { libc::epoll_create1(0) };
    epoll_ctl(t, ep, libc::EPOLL_CTL_ADD, c, libc::EPOLLIN as u32, "ADD");
    epoll_wait(t, ep, 5000, "epoll_wait interrupted");
    alarm_in(100);
    select_read(t, c, 5000, "select interrupted");
    t.line("alarms", &(delivered(libc::SIGALRM) - before).to_string());
    // With SA_RESTART: a receive goes on; the waits still end.
    count_signal(libc::SIGALRM, true);
    p.tell("sendafter 400 5 90");
    p.answer();
    alarm_in(100);
    recv(t, c, 10, 0, "recv restarted");
    alarm_in(100);
    poll_rec(t, c, libc::POLLIN, 5000, "poll with SA_RESTART");
    alarm_in(100);
    epoll_wait(t, ep, 5000, "epoll_wait with SA_RESTART");
    recv(t, c, 10, libc::MSG_DONTWAIT, "recv nothing");
    t.line("alarms", &(delivered(libc::SIGALRM) - before).to_string());
    // SAFETY: default disposition again.
    unsafe { libc::signal(libc::SIGALRM, libc::SIG_IGN) };
    close(ep);
    close(c);
    peer(t, p, "drain");
    Ok(())
}

unsafe extern "C" {
    fn __recv_chk(fd: c_int, buf: *mut c_void, len: usize, buflen: usize, flags: c_int) -> isize;
    fn __read_chk(fd: c_int, buf: *mut c_void, len: usize, buflen: usize) -> isize;
    fn __recvfrom_chk(
        fd: c_int,
        buf: *mut c_void,
        len: usize,
        buflen: usize,
        flags: c_int,
        addr: *mut libc::sockaddr,
        alen: *mut socklen_t,
    ) -> isize;
    fn __poll_chk(fds: *mut libc::pollfd, n: libc::nfds_t, ms: c_int, fdslen: usize) -> c_int;
    fn __ppoll_chk(
        fds: *mut libc::pollfd,
        n: libc::nfds_t,
        ts: *const libc::timespec,
        mask: *const libc::sigset_t,
        fdslen: usize,
    ) -> c_int;
}

/// glibc's `_FORTIFY_SOURCE` entry points, and sendfile.
fn fortified(t: &mut T, p: &mut Peer, l: c_int) -> R {
    t.case("fortified");
    let c = conn(t, p, l)?;
    let mut b = vec![0u8; 100];
    for (i, what) in ["__recv_chk", "__read_chk", "__recvfrom_chk"]
        .iter()
        .enumerate()
    {
        peer(t, p, &format!("send 7 {}", 100 + i));
        wait_ready(c, libc::POLLIN);
        // SAFETY: the fortified calls with our own buffer and its size.
        let n = t.call(what, || unsafe {
            match i {
                0 => __recv_chk(c, b.as_mut_ptr().cast(), 50, 100, 0),
                1 => __read_chk(c, b.as_mut_ptr().cast(), 50, 100),
                _ => __recvfrom_chk(
                    c,
                    b.as_mut_ptr().cast(),
                    50,
                    100,
                    0,
                    std::ptr::null_mut(),
                    std::ptr::null_mut(),
                ),
            }
        });
        t.line(
            &format!("{what}: data"),
            &format!("{:08x}", crc(&b[..n.max(0) as usize])),
        );
    }
    let mut pf = [libc::pollfd {
        fd: c,
        events: libc::POLLOUT,
        revents: 0,
    }];
    // SAFETY: as above.
    t.call(
        "__poll_chk",
        || unsafe { __poll_chk(pf.as_mut_ptr(), 1, 0, 8) } as isize,
    );
    let ts = libc::timespec {
        tv_sec: 0,
        tv_nsec: 0,
    };
    // SAFETY: as above.
    t.call(
        "__ppoll_chk",
        || unsafe { __ppoll_chk(pf.as_mut_ptr(), 1, &ts, std::ptr::null(), 8) } as isize,
    );
    t.line("__ppoll_chk: revents", &pbits(pf[0].revents));
    // sendfile from a file.
    let path = std::env::temp_dir().join(format!("azsdp-conform-{}", std::process::id()));
    let body = data(3000, 110);
    std::fs::write(&path, &body).map_err(|e| e.to_string())?;
    let f = std::fs::File::open(&path).map_err(|e| e.to_string())?;
    let _ = std::fs::remove_file(&path);
    let ffd = std::os::fd::AsRawFd::as_raw_fd(&f);
    let mut off: libc::off_t = 1000;
    // SAFETY: sendfile(2) from our file with our offset.
    t.call("sendfile 1500 from offset 1000", || unsafe {
        libc::sendfile(c, ffd, &mut off, 1500)
    });
    t.line("sendfile: offset", &off.to_string());
    peer(t, p, "recv 1500");
    t.line("expected", &format!("{:08x}", crc(&body[1000..2500])));
    // SAFETY: sendfile64(2) from the file's own position.
    t.call("sendfile64 500 from the file position", || unsafe {
        libc::sendfile64(c, ffd, std::ptr::null_mut(), 500)
    });
    peer(t, p, "recv 500");
    t.line("expected", &format!("{:08x}", crc(&body[..500])));
    // SAFETY: sendfile(2) from a bad descriptor.
    t.call("sendfile from a bad descriptor", || unsafe {
        libc::sendfile(c, 999, std::ptr::null_mut(), 10)
    });
    drop(f);
    close(c);
    peer(t, p, "drain");
    Ok(())
}

/// fork and vfork with a connection open; socket()'s errno; accept4.
fn processes(t: &mut T, p: &mut Peer, l: c_int) -> R {
    t.case("processes");
    let c = conn(t, p, l)?;
    for vfork in [false, true] {
        let what = if vfork { "vfork" } else { "fork" };
        // SAFETY: the child only calls _exit, which is all a vfork child
        // may do (it borrows our memory and stack until then).
        #[allow(deprecated)]
        let pid = t.call_i(what, || unsafe {
            let pid = if vfork { libc::vfork() } else { libc::fork() };
            if pid == 0 {
                libc::_exit(0);
            }
            if pid > 0 { 0 } else { pid }
        });
        let _ = pid;
        let mut status = 0;
        // SAFETY: reap our children.
        unsafe { libc::waitpid(-1, &mut status, 0) };
        send(t, c, b"after", 0, &format!("send after {what}"));
        peer(t, p, "recv 5");
        peer(t, p, "send 3 120");
        wait_ready(c, libc::POLLIN);
        recv(t, c, 10, 0, &format!("recv after {what}"));
    }
    close(c);
    peer(t, p, "drain");
    // accept4 with flags, and with bad ones.
    p.tell("connect");
    // SAFETY: accept4(2) with flags it refuses (the connection waits).
    t.call_fd("accept4 bad flags", || unsafe {
        libc::accept4(l, std::ptr::null_mut(), std::ptr::null_mut(), 0x1234)
    });
    let mut a: libc::sockaddr_in =
        // SAFETY: plain data.
        unsafe { std::mem::zeroed() };
    let mut alen = std::mem::size_of_val(&a) as socklen_t;
    // SAFETY: accept4(2) into our own address.
    let c = t.call_fd("accept4 NONBLOCK|CLOEXEC", || unsafe {
        libc::accept4(
            l,
            (&raw mut a).cast(),
            &mut alen,
            libc::SOCK_NONBLOCK | libc::SOCK_CLOEXEC,
        )
    });
    let ans = p.answer();
    t.line("peer connect", &ans);
    t.line(
        "accept4: family, address, length",
        &format!(
            "{} {:#x} {alen}",
            a.sin_family,
            u32::from_be(a.sin_addr.s_addr)
        ),
    );
    // SAFETY: fcntl(2).
    t.call_i("F_GETFL", || unsafe { libc::fcntl(c, libc::F_GETFL) });
    // SAFETY: fcntl(2).
    t.call_i("F_GETFD", || unsafe { libc::fcntl(c, libc::F_GETFD) });
    recv(t, c, 10, 0, "recv non-blocking");
    close(c);
    peer(t, p, "drain");
    Ok(())
}

/// The interposed calls on descriptors that are not sockets of ours.
fn not_sockets(t: &mut T) -> R {
    t.case("not-sockets");
    let (r0, w0) = pipe_pair();
    let mut b = [0u8; 8];
    // SAFETY: each call on a pipe or a bad descriptor; our own buffers.
    unsafe {
        t.call("send on a pipe", || libc::send(w0, b.as_ptr().cast(), 1, 0));
        t.call("recv on a pipe", || {
            libc::recv(r0, b.as_mut_ptr().cast(), 1, 0)
        });
        t.call("write on a pipe", || {
            libc::write(w0, b"ab".as_ptr().cast(), 2)
        });
        t.call("read on a pipe", || {
            libc::read(r0, b.as_mut_ptr().cast(), 8)
        });
        t.call("send on -1", || libc::send(-1, b.as_ptr().cast(), 1, 0));
        t.call("recv on 999", || {
            libc::recv(999, b.as_mut_ptr().cast(), 1, 0)
        });
        t.call_i("shutdown a pipe", || libc::shutdown(r0, libc::SHUT_RD));
        let mut v: c_int = 0;
        let mut len = 4 as socklen_t;
        t.call_i("getsockopt on a pipe", || {
            libc::getsockopt(
                r0,
                libc::SOL_SOCKET,
                libc::SO_TYPE,
                (&raw mut v).cast(),
                &mut len,
            )
        });
        t.call_i("connect a pipe", || {
            let a = crate::loopback(1);
            libc::connect(r0, (&raw const a).cast(), 16)
        });
        t.call_fd("accept on a pipe", || {
            libc::accept(r0, std::ptr::null_mut(), std::ptr::null_mut())
        });
        t.call_i("listen on a pipe", || libc::listen(r0, 1));
        t.call_fd("socket with a bad family", || {
            libc::socket(12345, libc::SOCK_STREAM, 0)
        });
        t.call_fd("socket with a bad type", || {
            libc::socket(libc::AF_INET, 12345, 0)
        });
        let s = t.call_fd("socket", || {
            libc::socket(libc::AF_INET, libc::SOCK_STREAM, 0)
        });
        t.call("send on an unconnected socket", || {
            libc::send(s, b.as_ptr().cast(), 1, 0)
        });
        t.call("recv on an unconnected socket", || {
            libc::recv(s, b.as_mut_ptr().cast(), 1, 0)
        });
        t.call_fd("accept on an unlistening socket", || {
            libc::accept(s, std::ptr::null_mut(), std::ptr::null_mut())
        });
        let refused = crate::loopback(1);
        t.call_i("connect to a closed port", || {
            libc::connect(s, (&raw const refused).cast(), 16)
        });
        t.call_i("close", || libc::close(s));
        t.call_i("close a bad descriptor", || libc::close(-1));
    }
    close(r0);
    close(w0);
    Ok(())
}
