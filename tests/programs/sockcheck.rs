//! `azsdp-sockcheck SCENARIO server|client PORT`: an ordinary program that
//! checks, through plain libc socket calls, the socket semantics programs
//! rely on. It knows nothing of azsdp: the tests run it on kernel TCP (to
//! prove the expectations are TCP's) and under `azsdp run`.
//!
//! Exit status 0 when every check holds; otherwise the failed check is
//! printed and the status is 1.

use std::sync::atomic::Ordering;
use std::time::{Duration, Instant};

use azsdp_test_support::{
    alarm_in, close, count_signal, delivered, errno, loopback as addr, pattern as data,
    set_timeout, sleep_ms,
};
use libc::{c_int, c_void};

type R = Result<(), String>;

macro_rules! check {
    ($cond:expr, $($msg:tt)*) => {
        if !$cond {
            return Err(format!("{}:{}: {}", file!(), line!(), format!($($msg)*)));
        }
    };
}

// After `check!`, which it uses.
mod dead_peer;

fn err_name(e: c_int) -> String {
    std::io::Error::from_raw_os_error(e).to_string()
}

fn tcp_socket() -> Result<c_int, String> {
    // SAFETY: socket(2).
    let fd = unsafe { libc::socket(libc::AF_INET, libc::SOCK_STREAM, 0) };
    if fd < 0 {
        return Err(format!("socket: {}", err_name(errno())));
    }
    Ok(fd)
}

fn listen_on(port: u16) -> Result<c_int, String> {
    let fd = tcp_socket()?;
    let one: c_int = 1;
    let a = addr(port);
    // SAFETY: plain socket calls on our own descriptor and structures.
    unsafe {
        libc::setsockopt(
            fd,
            libc::SOL_SOCKET,
            libc::SO_REUSEADDR,
            (&raw const one).cast(),
            4,
        );
        if libc::bind(fd, (&raw const a).cast(), std::mem::size_of_val(&a) as u32) != 0 {
            return Err(format!("bind: {}", err_name(errno())));
        }
        if libc::listen(fd, 16) != 0 {
            return Err(format!("listen: {}", err_name(errno())));
        }
    }
    println!("listening");
    Ok(fd)
}

fn accept_one(l: c_int) -> Result<c_int, String> {
    let fd = accept_nowait(l)?;
    await_join(fd);
    Ok(fd)
}

fn accept_nowait(l: c_int) -> Result<c_int, String> {
    // SAFETY: accept(2) without an address.
    let fd = unsafe { libc::accept(l, std::ptr::null_mut(), std::ptr::null_mut()) };
    if fd < 0 {
        return Err(format!("accept: {}", err_name(errno())));
    }
    Ok(fd)
}

fn connect_to(port: u16) -> Result<c_int, String> {
    connect_addr(addr(port))
}

fn connect_addr(a: libc::sockaddr_in) -> Result<c_int, String> {
    let fd = connect_nowait(a)?;
    await_join(fd);
    Ok(fd)
}

fn connect_nowait(a: libc::sockaddr_in) -> Result<c_int, String> {
    let fd = tcp_socket()?;
    // SAFETY: connect(2) to our own address structure.
    if unsafe { libc::connect(fd, (&raw const a).cast(), std::mem::size_of_val(&a) as u32) } != 0 {
        return Err(format!("connect: {}", err_name(errno())));
    }
    Ok(fd)
}

/// Under azsdp, `connect()` and `accept()` return before the pair
/// completes, and a connection starts on TCP: a client that sends and
/// ends at once, or a server that forks at once, stays there, as it
/// should. These scenarios test the upgraded paths: give the connection
/// its time (up to 10 s) to join the fabric, by polling the socket (a look
/// at it completes the pair, allows the join, joins) until the shim's
/// log says how it went for this connection: joined, or TCP.
fn await_join(fd: c_int) {
    if !std::env::var("LD_PRELOAD").is_ok_and(|v| v.contains("azsdp")) {
        return;
    }
    // The shim's log: stderr, or the file AZSDP_LOG names.
    let log_file = match std::env::var("AZSDP_LOG") {
        Ok(v) if v == "off" => return,
        Ok(v) if !v.is_empty() && v != "stderr" => v,
        _ => "/proc/self/fd/2".to_string(),
    };
    let (Some(local), Some(peer)) = (sock_name(fd, false), sock_name(fd, true)) else {
        return;
    };
    // (A line of this connection's: "local -> peer: ", or "local <- peer: "
    // for the listener's side of a pair.)
    let me = [
        format!("{local} -> {peer}: "),
        format!("{local} <- {peer}: "),
    ];
    let deadline = Instant::now() + Duration::from_secs(10);
    while Instant::now() < deadline {
        let mut p = libc::pollfd {
            fd,
            events: 0,
            revents: 0,
        };
        // SAFETY: poll(2) of one pollfd of ours.
        unsafe { libc::poll(&mut p, 1, 1) };
        let log = std::fs::read_to_string(&log_file).unwrap_or_default();
        let outcomes = [
            ": joined the fabric",
            ": tcp (",
            ": moved to its TCP socket",
            "(fabric verbs",
        ];
        if log
            .lines()
            .any(|l| me.iter().any(|m| l.contains(m)) && outcomes.iter().any(|o| l.contains(o)))
        {
            return;
        }
    }
}

/// The socket's own address, or its peer's, as `a.b.c.d:port`.
fn sock_name(fd: c_int, peer: bool) -> Option<String> {
    // SAFETY: plain data, filled by the kernel.
    let mut a: libc::sockaddr_in = unsafe { std::mem::zeroed() };
    let mut len = std::mem::size_of_val(&a) as libc::socklen_t;
    let get = if peer {
        libc::getpeername
    } else {
        libc::getsockname
    };
    // SAFETY: get{sock,peer}name into our own structure.
    if unsafe { get(fd, (&raw mut a).cast(), &mut len) } != 0 {
        return None;
    }
    let ip = std::net::Ipv4Addr::from(u32::from_be(a.sin_addr.s_addr));
    Some(format!("{ip}:{}", u16::from_be(a.sin_port)))
}

fn send_all(fd: c_int, mut b: &[u8]) -> R {
    while !b.is_empty() {
        // SAFETY: send(2) from our own buffer.
        let n = unsafe { libc::send(fd, b.as_ptr().cast(), b.len(), 0) };
        check!(n > 0, "send: {}", err_name(errno()));
        b = &b[n as usize..];
    }
    Ok(())
}

fn recv_some(fd: c_int, b: &mut [u8], flags: c_int) -> isize {
    // SAFETY: recv(2) into our own buffer.
    unsafe { libc::recv(fd, b.as_mut_ptr().cast(), b.len(), flags) }
}

fn recv_exact(fd: c_int, len: usize) -> Result<Vec<u8>, String> {
    let mut v = vec![0u8; len];
    let mut at = 0;
    while at < len {
        let n = recv_some(fd, &mut v[at..], 0);
        check!(
            n > 0,
            "recv after {at} of {len}: {}",
            if n == 0 {
                "EOF".into()
            } else {
                err_name(errno())
            }
        );
        at += n as usize;
    }
    Ok(v)
}

fn expect_eof(fd: c_int) -> R {
    let mut b = [0u8; 16];
    let n = recv_some(fd, &mut b, 0);
    check!(
        n == 0,
        "expected EOF, recv gave {n} ({})",
        err_name(errno())
    );
    Ok(())
}

fn set_nonblocking(fd: c_int) {
    // SAFETY: fcntl(2) flags of our own descriptor.
    unsafe {
        let fl = libc::fcntl(fd, libc::F_GETFL);
        libc::fcntl(fd, libc::F_SETFL, fl | libc::O_NONBLOCK);
    }
}

fn fionread(fd: c_int) -> c_int {
    let mut n: c_int = -1;
    // SAFETY: FIONREAD into our own int.
    unsafe { libc::ioctl(fd, libc::FIONREAD, &mut n) };
    n
}

fn poll1(fd: c_int, events: i16, ms: c_int) -> i16 {
    let mut p = libc::pollfd {
        fd,
        events,
        revents: 0,
    };
    // SAFETY: poll(2) of one entry.
    let n = unsafe { libc::poll(&mut p, 1, ms) };
    if n <= 0 { 0 } else { p.revents }
}

// ----- scenarios ---------------------------------------------------------------

/// Sizes and alignments through blocking calls, with MSG_WAITALL.
fn basic(server: bool, port: u16) -> R {
    let sizes = [1usize, 64, 4095, 65536 + 3, (1 << 20) + 17, 4 << 20];
    let total: usize = sizes.iter().sum();
    let all = data(total + 4096, 1);
    if server {
        let l = listen_on(port)?;
        let c = accept_one(l)?;
        let mut got = vec![0u8; total];
        // SAFETY: MSG_WAITALL recv into our own buffer.
        let n = unsafe { libc::recv(c, got.as_mut_ptr().cast(), total, libc::MSG_WAITALL) };
        check!(n as usize == total, "MSG_WAITALL gave {n} of {total}");
        let mut off = 0;
        for s in sizes {
            check!(
                got[off..off + s] == all[off + 1..off + 1 + s],
                "bytes of the {s}-byte send differ"
            );
            off += s;
        }
        send_all(c, b"done")?;
        expect_eof(c)?;
        close(c);
    } else {
        let c = connect_to(port)?;
        let mut off = 0;
        for s in sizes {
            // Unaligned by one byte: heads and tails go through the rings.
            send_all(c, &all[off + 1..off + 1 + s])?;
            off += s;
        }
        check!(recv_exact(c, 4)? == b"done", "reply");
        close(c);
    }
    Ok(())
}

/// O_NONBLOCK, EAGAIN, poll, FIONREAD, MSG_PEEK, and POLLOUT once the
/// peer drains a full connection.
fn nonblock(server: bool, port: u16) -> R {
    if server {
        let l = listen_on(port)?;
        let c = accept_one(l)?;
        set_nonblocking(c);
        let mut b = [0u8; 2048];
        check!(
            recv_some(c, &mut b, 0) == -1 && errno() == libc::EAGAIN,
            "empty recv: {}",
            err_name(errno())
        );
        check!(fionread(c) == 0, "FIONREAD on empty: {}", fionread(c));
        check!(poll1(c, libc::POLLIN, 100) == 0, "POLLIN with nothing sent");
        send_all(c, b"go")?;
        check!(
            poll1(c, libc::POLLIN, 5000) & libc::POLLIN != 0,
            "no POLLIN after the peer sent"
        );
        let t = Instant::now();
        while fionread(c) < 1000 && t.elapsed() < Duration::from_secs(5) {
            sleep_ms(1);
        }
        check!(
            fionread(c) == 1000,
            "FIONREAD {} after 1000 sent",
            fionread(c)
        );
        check!(recv_some(c, &mut b[..10], libc::MSG_PEEK) == 10, "MSG_PEEK");
        check!(b[..10] == data(1000, 2)[..10], "peeked bytes");
        check!(fionread(c) == 1000, "MSG_PEEK consumed");
        check!(recv_some(c, &mut b, 0) == 1000, "recv after peek");
        check!(b[..1000] == data(1000, 2)[..], "received bytes");
        check!(
            recv_some(c, &mut b, libc::MSG_DONTWAIT) == -1 && errno() == libc::EAGAIN,
            "drained recv"
        );
        // Fill the connection: the peer does not read yet. As on TCP, bytes
        // queued on our side may still move to the peer's side after the
        // first EAGAIN (over verbs, as credits come back), so POLLOUT may
        // return; but then a send must take bytes. Full is 50 ms without it.
        let chunk = vec![7u8; 65536];
        let mut sent = 0usize;
        loop {
            check!(
                sent < (1 << 30),
                "a non-blocking send never filled the connection"
            );
            // SAFETY: send(2) from our own buffer.
            let n = unsafe { libc::send(c, chunk.as_ptr().cast(), chunk.len(), 0) };
            if n < 0 {
                check!(errno() == libc::EAGAIN, "full send: {}", err_name(errno()));
                if poll1(c, libc::POLLOUT, 50) & libc::POLLOUT == 0 {
                    break;
                }
                // SAFETY: as above.
                let n = unsafe { libc::send(c, chunk.as_ptr().cast(), chunk.len(), 0) };
                check!(n > 0, "POLLOUT, then send: {}", err_name(errno()));
                sent += n as usize;
                continue;
            }
            sent += n as usize;
        }
        check!(
            poll1(c, libc::POLLOUT, 10_000) & libc::POLLOUT != 0,
            "no POLLOUT after the peer drained"
        );
        // Tell the peer how much to expect, then close.
        let mut left = sent.to_le_bytes().to_vec();
        while !left.is_empty() {
            // SAFETY: as above.
            let n = unsafe { libc::send(c, left.as_ptr().cast(), left.len(), 0) };
            if n > 0 {
                left.drain(..n as usize);
            } else {
                poll1(c, libc::POLLOUT, 1000);
            }
        }
        close(c);
    } else {
        let c = connect_to(port)?;
        check!(recv_exact(c, 2)? == b"go", "go");
        send_all(c, &data(1000, 2))?;
        // Read nothing until the peer has filled the connection: what is
        // waiting here stops growing (a fixed sleep lost the race on a busy
        // host, whose peer was still filling when we began to drain).
        let (mut last, mut since) = (fionread(c), Instant::now());
        let t = Instant::now();
        while (last == 0 || since.elapsed() < Duration::from_millis(300))
            && t.elapsed() < Duration::from_secs(20)
        {
            sleep_ms(10);
            let now = fionread(c);
            if now != last {
                (last, since) = (now, Instant::now());
            }
        }
        let mut total = Vec::new();
        let mut b = vec![0u8; 1 << 16];
        loop {
            let n = recv_some(c, &mut b, 0);
            check!(n >= 0, "recv: {}", err_name(errno()));
            if n == 0 {
                break;
            }
            total.extend_from_slice(&b[..n as usize]);
        }
        check!(total.len() >= 8, "short stream");
        let tail: [u8; 8] = total[total.len() - 8..].try_into().unwrap_or_default();
        let sent = usize::from_le_bytes(tail);
        check!(
            sent == total.len() - 8,
            "got {} bytes, peer sent {sent}",
            total.len() - 8
        );
        check!(total[..sent].iter().all(|x| *x == 7), "flood bytes");
        close(c);
    }
    Ok(())
}

/// shutdown(SHUT_WR): the peer reads everything, then EOF, and can still
/// answer.
fn halfclose(server: bool, port: u16) -> R {
    let msg = data(1 << 20, 3);
    if server {
        let l = listen_on(port)?;
        let c = accept_one(l)?;
        check!(recv_exact(c, msg.len())? == msg, "data before EOF");
        expect_eof(c)?;
        expect_eof(c)?;
        send_all(c, b"reply after your EOF")?;
        close(c);
    } else {
        let c = connect_to(port)?;
        send_all(c, &msg)?;
        // SAFETY: shutdown(2) of our own socket.
        check!(unsafe { libc::shutdown(c, libc::SHUT_WR) } == 0, "shutdown");
        // SAFETY: send(2) after SHUT_WR must fail with EPIPE.
        let n = unsafe { libc::send(c, b"x".as_ptr().cast(), 1, libc::MSG_NOSIGNAL) };
        check!(
            n == -1 && errno() == libc::EPIPE,
            "send after SHUT_WR: {n} {}",
            err_name(errno())
        );
        check!(recv_exact(c, 20)? == b"reply after your EOF", "reply");
        expect_eof(c)?;
        close(c);
    }
    Ok(())
}

/// Writing to a closed peer: EPIPE, SIGPIPE unless MSG_NOSIGNAL.
fn sigpipe(server: bool, port: u16) -> R {
    if server {
        let l = listen_on(port)?;
        let c = accept_one(l)?;
        recv_exact(c, 1)?;
        close(c);
    } else {
        count_signal(libc::SIGPIPE, true);
        let c = connect_to(port)?;
        send_all(c, b"x")?;
        sleep_ms(300);
        let chunk = vec![1u8; 65536];
        let mut failed = None;
        for _ in 0..1000 {
            // SAFETY: send(2) from our own buffer.
            let n =
                unsafe { libc::send(c, chunk.as_ptr().cast(), chunk.len(), libc::MSG_NOSIGNAL) };
            if n < 0 {
                failed = Some(errno());
                break;
            }
            sleep_ms(1);
        }
        let e = failed.ok_or("sends to a closed peer kept succeeding")?;
        check!(
            e == libc::EPIPE || e == libc::ECONNRESET,
            "errno {}",
            err_name(e)
        );
        check!(
            delivered(libc::SIGPIPE) == 0,
            "SIGPIPE despite MSG_NOSIGNAL"
        );
        // SAFETY: as above, now without MSG_NOSIGNAL.
        let n = unsafe { libc::send(c, chunk.as_ptr().cast(), chunk.len(), 0) };
        check!(
            n == -1 && errno() == libc::EPIPE,
            "second send: {n} {}",
            err_name(errno())
        );
        check!(
            delivered(libc::SIGPIPE) == 1,
            "SIGPIPE count {}",
            delivered(libc::SIGPIPE)
        );
        close(c);
    }
    Ok(())
}

fn epoll_wait1(ep: c_int, ms: c_int) -> Option<u32> {
    let mut ev = libc::epoll_event { events: 0, u64: 0 };
    // SAFETY: epoll_wait(2) for one event into our own structure.
    let n = unsafe { libc::epoll_wait(ep, &mut ev, 1, ms) };
    (n == 1).then_some(ev.events)
}

fn epoll_ctl(ep: c_int, op: c_int, fd: c_int, events: u32) -> R {
    let mut ev = libc::epoll_event {
        events,
        u64: fd as u64,
    };
    // SAFETY: epoll_ctl(2) with our own event.
    let r = unsafe { libc::epoll_ctl(ep, op, fd, &mut ev) };
    check!(r == 0, "epoll_ctl: {}", err_name(errno()));
    Ok(())
}

/// epoll level- and edge-triggered, EPOLLOUT, and select.
fn readiness(server: bool, port: u16) -> R {
    let m = |i: u32| data(100, 10 + i);
    if server {
        let l = listen_on(port)?;
        let c = accept_one(l)?;
        set_nonblocking(c);
        // SAFETY: epoll_create1(2).
        let ep = unsafe { libc::epoll_create1(0) };
        let inn = libc::EPOLLIN as u32;
        epoll_ctl(ep, libc::EPOLL_CTL_ADD, c, inn)?;
        check!(
            epoll_wait1(ep, 5000).is_some_and(|e| e & inn != 0),
            "LT: first message"
        );
        check!(
            epoll_wait1(ep, 0).is_some_and(|e| e & inn != 0),
            "LT: still readable"
        );
        epoll_ctl(ep, libc::EPOLL_CTL_MOD, c, inn | libc::EPOLLET as u32)?;
        check!(epoll_wait1(ep, 1000).is_some(), "ET: report after MOD");
        check!(
            epoll_wait1(ep, 100).is_none(),
            "ET: reported again without new data"
        );
        send_all(c, b"a")?;
        check!(
            epoll_wait1(ep, 5000).is_some_and(|e| e & inn != 0),
            "ET: second message"
        );
        let t = Instant::now();
        let mut got = Vec::new();
        let mut b = [0u8; 512];
        while got.len() < 200 && t.elapsed() < Duration::from_secs(5) {
            let n = recv_some(c, &mut b, 0);
            if n > 0 {
                got.extend_from_slice(&b[..n as usize]);
            } else {
                sleep_ms(1);
            }
        }
        check!(got == [m(1), m(2)].concat(), "messages 1 and 2");
        epoll_ctl(ep, libc::EPOLL_CTL_MOD, c, libc::EPOLLOUT as u32)?;
        check!(
            epoll_wait1(ep, 1000).is_some_and(|e| e & libc::EPOLLOUT as u32 != 0),
            "EPOLLOUT"
        );
        epoll_ctl(ep, libc::EPOLL_CTL_DEL, c, 0)?;
        send_all(c, b"b")?;
        // select() for the third message.
        // SAFETY: fd_set manipulation and select(2) on our own sets.
        let ready = unsafe {
            let mut r: libc::fd_set = std::mem::zeroed();
            libc::FD_ZERO(&mut r);
            libc::FD_SET(c, &mut r);
            let mut tv = libc::timeval {
                tv_sec: 5,
                tv_usec: 0,
            };
            let n = libc::select(
                c + 1,
                &mut r,
                std::ptr::null_mut(),
                std::ptr::null_mut(),
                &mut tv,
            );
            n == 1 && libc::FD_ISSET(c, &r)
        };
        check!(ready, "select: third message");
        let mut b = [0u8; 100];
        check!(
            recv_some(c, &mut b, 0) == 100 && b[..] == m(3)[..],
            "message 3"
        );
        send_all(c, b"c")?;
        close(ep);
        close(c);
    } else {
        let c = connect_to(port)?;
        send_all(c, &m(1))?;
        check!(recv_exact(c, 1)? == b"a", "a");
        send_all(c, &m(2))?;
        check!(recv_exact(c, 1)? == b"b", "b");
        send_all(c, &m(3))?;
        check!(recv_exact(c, 1)? == b"c", "c");
        close(c);
    }
    Ok(())
}

/// One thread sends while another receives on the same socket.
fn threads(server: bool, port: u16) -> R {
    const TOTAL: usize = 64 << 20;
    if server {
        let l = listen_on(port)?;
        let c = accept_one(l)?;
        let mut b = vec![0u8; 256 << 10];
        let mut echoed = 0;
        while echoed < TOTAL {
            let n = recv_some(c, &mut b, 0);
            check!(n > 0, "echo recv: {n}");
            send_all(c, &b[..n as usize])?;
            echoed += n as usize;
        }
        expect_eof(c)?;
        close(c);
    } else {
        let c = connect_to(port)?;
        let src = data(TOTAL, 4);
        let sender = {
            let src = src.clone();
            std::thread::spawn(move || -> R {
                for chunk in src.chunks(300_001) {
                    send_all(c, chunk)?;
                }
                Ok(())
            })
        };
        let got = recv_exact(c, TOTAL)?;
        sender.join().map_err(|_| "sender panicked")??;
        check!(got == src, "echoed bytes differ");
        // SAFETY: shutdown(2).
        unsafe { libc::shutdown(c, libc::SHUT_WR) };
        expect_eof(c)?;
        close(c);
    }
    Ok(())
}

/// SO_RCVTIMEO, EINTR without SA_RESTART, restart with it.
fn signals(server: bool, port: u16) -> R {
    if server {
        let l = listen_on(port)?;
        let c = accept_one(l)?;
        let mut b = [0u8; 16];
        set_timeout(c, libc::SO_RCVTIMEO, 100);
        let t = Instant::now();
        check!(
            recv_some(c, &mut b, 0) == -1 && errno() == libc::EAGAIN,
            "SO_RCVTIMEO: {}",
            err_name(errno())
        );
        check!(
            t.elapsed() >= Duration::from_millis(90),
            "SO_RCVTIMEO returned after {:?}",
            t.elapsed()
        );
        set_timeout(c, libc::SO_RCVTIMEO, 0);
        count_signal(libc::SIGALRM, false);
        alarm_in(150);
        check!(
            recv_some(c, &mut b, 0) == -1 && errno() == libc::EINTR,
            "no EINTR: {}",
            err_name(errno())
        );
        check!(delivered(libc::SIGALRM) == 1, "alarm did not fire");
        count_signal(libc::SIGALRM, true);
        alarm_in(150);
        let n = recv_some(c, &mut b, 0);
        check!(
            n == 1 && b[0] == b'x',
            "restarted recv gave {n} ({})",
            err_name(errno())
        );
        check!(delivered(libc::SIGALRM) == 2, "second alarm did not fire");
        close(c);
    } else {
        let c = connect_to(port)?;
        sleep_ms(1000);
        send_all(c, b"x")?;
        expect_eof(c)?;
        close(c);
    }
    Ok(())
}

/// dup, dup2 and close of one of the descriptors.
fn descriptors(server: bool, port: u16) -> R {
    if server {
        let l = listen_on(port)?;
        let c = accept_one(l)?;
        // SAFETY: dup(2)/dup2(2) of our own descriptors.
        let d = unsafe { libc::dup(c) };
        check!(d >= 0, "dup");
        close(c);
        check!(recv_exact(d, 5)? == b"hello", "recv on the dup");
        // SAFETY: as above.
        check!(unsafe { libc::dup2(d, 100) } == 100, "dup2");
        close(d);
        send_all(100, b"world")?;
        expect_eof(100)?;
        close(100);
    } else {
        let c = connect_to(port)?;
        send_all(c, b"hello")?;
        check!(recv_exact(c, 5)? == b"world", "world");
        close(c);
    }
    Ok(())
}

/// A memory file holding `bytes`, read back from its start: it takes the
/// lowest free descriptor number, as the kernel gives out.
fn memfd_with(bytes: &[u8]) -> Result<c_int, String> {
    // SAFETY: memfd_create(2) with a NUL-terminated name.
    let f = unsafe { libc::memfd_create(c"azsdp-check".as_ptr(), 0) };
    check!(f >= 0, "memfd_create: {}", err_name(errno()));
    // SAFETY: write(2) from our slice, lseek(2) on our own descriptor.
    unsafe {
        check!(
            libc::write(f, bytes.as_ptr().cast(), bytes.len()) == bytes.len() as isize,
            "write to the memory file"
        );
        libc::lseek(f, 0, libc::SEEK_SET);
    }
    Ok(f)
}

/// Descriptors closed as a range (`close_range`, and `closefrom` in a
/// forked child before it execs, as Python's subprocess and sshd do): the
/// number of a closed connection names whatever the kernel opens next on
/// it, and reads that, not the connection; a child's `closefrom` takes
/// nothing from its parent, which carries on with the connection.
fn close_range_scenario(server: bool, port: u16) -> R {
    let msg = data(1 << 20, 80);
    let file = data(64 << 10, 81);
    if server {
        let l = listen_on(port)?;
        for _ in 0..2 {
            let c = accept_one(l)?;
            loop {
                let mut buf = vec![0u8; 256 << 10];
                let n = recv_some(c, &mut buf, 0);
                check!(n >= 0, "echo recv: {}", err_name(errno()));
                if n == 0 {
                    break;
                }
                send_all(c, &buf[..n as usize])?;
            }
            close(c);
        }
        close(l);
        return Ok(());
    }
    let exchange = |c: c_int| -> R {
        send_all(c, &msg)?;
        check!(recv_exact(c, msg.len())? == msg, "the echo");
        Ok(())
    };
    let c = connect_to(port)?;
    exchange(c)?;
    // SAFETY: close_range(2) of our own descriptor.
    let r = unsafe { libc::close_range(c as u32, c as u32, 0) };
    check!(r == 0, "close_range");
    let f = memfd_with(&file)?;
    check!(
        f == c,
        "the memory file took {f}, not the socket's number {c}"
    );
    let mut got = vec![0u8; file.len()];
    check!(
        recv_exact_read(f, &mut got)? && got == file,
        "the file read through the socket's old number"
    );
    close(f);

    let c = connect_to(port)?;
    exchange(c)?;
    // SAFETY: fork(2); the child closes from the socket's number up, opens
    // a file there, reads it and _exits.
    let pid = unsafe { libc::fork() };
    if pid == 0 {
        let r = (|| -> R {
            // SAFETY: glibc's closefrom(3) (2.34; not in the libc crate) in
            // our own process.
            unsafe { closefrom(c) };
            let f = memfd_with(&file)?;
            check!(f == c, "the child's memory file took {f}, not {c}");
            let mut got = vec![0u8; file.len()];
            check!(
                recv_exact_read(f, &mut got)? && got == file,
                "the child's file"
            );
            Ok(())
        })();
        if let Err(e) = &r {
            eprintln!("child: {e}");
        }
        // SAFETY: leave the child without unwinding.
        unsafe { libc::_exit(i32::from(r.is_err())) };
    }
    reap_ok(pid, "the child")?;
    exchange(c)?;
    close(c);
    Ok(())
}

unsafe extern "C" {
    fn closefrom(low: c_int);
}

/// Wait for our child `pid`: an error naming `who` unless it exited 0.
fn reap_ok(pid: libc::pid_t, who: &str) -> R {
    let mut st = 0;
    // SAFETY: waitpid(2) on our own child.
    unsafe { libc::waitpid(pid, &mut st, 0) };
    check!(
        libc::WIFEXITED(st) && libc::WEXITSTATUS(st) == 0,
        "{who} failed: {st:#x}"
    );
    Ok(())
}

/// `read(2)` until `buf` is full; whether it filled (false at end of file).
fn recv_exact_read(fd: c_int, buf: &mut [u8]) -> Result<bool, String> {
    let mut at = 0;
    while at < buf.len() {
        // SAFETY: read(2) into the rest of our buffer.
        let n = unsafe { libc::read(fd, buf[at..].as_mut_ptr().cast(), buf.len() - at) };
        check!(n >= 0, "read: {}", err_name(errno()));
        if n == 0 {
            return Ok(false);
        }
        at += n as usize;
    }
    Ok(true)
}

/// A pre-fork server: the children accept on the inherited listener.
fn prefork(server: bool, port: u16) -> R {
    let msg = data(1 << 20, 5);
    if server {
        let l = listen_on(port)?;
        let mut kids = Vec::new();
        for _ in 0..2 {
            // SAFETY: fork(2); the child only runs the loop below and _exits.
            let pid = unsafe { libc::fork() };
            if pid == 0 {
                let r = (|| -> R {
                    let c = accept_one(l)?;
                    let got = recv_exact(c, msg.len())?;
                    check!(got == msg, "child got changed bytes");
                    send_all(c, b"ok")?;
                    expect_eof(c)?;
                    close(c);
                    Ok(())
                })();
                if let Err(e) = &r {
                    eprintln!("child: {e}");
                }
                // SAFETY: leave the child without unwinding.
                unsafe { libc::_exit(i32::from(r.is_err())) };
            }
            kids.push(pid);
        }
        for pid in kids {
            let mut st = 0;
            // SAFETY: waitpid(2) on our own child.
            unsafe { libc::waitpid(pid, &mut st, 0) };
            check!(
                libc::WIFEXITED(st) && libc::WEXITSTATUS(st) == 0,
                "child {pid} failed"
            );
        }
    } else {
        for _ in 0..2 {
            let c = connect_to(port)?;
            send_all(c, &msg)?;
            check!(recv_exact(c, 2)? == b"ok", "ok");
            close(c);
        }
    }
    Ok(())
}

fn name_of(fd: c_int, peer: bool) -> Result<(u32, u16), String> {
    // SAFETY: plain data written by the kernel (or the shim) within len.
    let mut a: libc::sockaddr_in = unsafe { std::mem::zeroed() };
    let mut len = std::mem::size_of_val(&a) as libc::socklen_t;
    // SAFETY: get{sock,peer}name into our own structure.
    let r = unsafe {
        if peer {
            libc::getpeername(fd, (&raw mut a).cast(), &mut len)
        } else {
            libc::getsockname(fd, (&raw mut a).cast(), &mut len)
        }
    };
    check!(
        r == 0,
        "get{}name: {}",
        if peer { "peer" } else { "sock" },
        err_name(errno())
    );
    check!(
        len as usize == std::mem::size_of_val(&a),
        "name length {len}"
    );
    Ok((u32::from_be(a.sin_addr.s_addr), u16::from_be(a.sin_port)))
}

/// Each side's names agree with the other's, after data moved.
fn names(server: bool, port: u16) -> R {
    let c = if server {
        let l = listen_on(port)?;
        accept_one(l)?
    } else {
        connect_to(port)?
    };
    send_all(c, b"n")?;
    recv_exact(c, 1)?;
    let (local, peer) = (name_of(c, false)?, name_of(c, true)?);
    // The server's address is the test's (127.0.0.1 unless
    // SOCKCHECK_ADDR says), on its side and as the client's peer; the
    // client's is the kernel's pick, never unspecified.
    let server_ip = u32::from_be(addr(port).sin_addr.s_addr);
    let (servers, clients) = if server { (local, peer) } else { (peer, local) };
    check!(
        servers.0 == server_ip && clients.0 != 0,
        "addresses {local:?} {peer:?}"
    );
    if server {
        check!(local.1 == port, "server's own port {}", local.1);
    } else {
        check!(peer.1 == port, "client's peer port {}", peer.1);
    }
    // Exchange what each side sees: mine must be the other's peer.
    send_all(c, &local.1.to_le_bytes())?;
    send_all(c, &peer.1.to_le_bytes())?;
    let theirs = recv_exact(c, 4)?;
    check!(
        u16::from_le_bytes([theirs[0], theirs[1]]) == peer.1,
        "their local is not my peer"
    );
    check!(
        u16::from_le_bytes([theirs[2], theirs[3]]) == local.1,
        "their peer is not my local"
    );
    close(c);
    Ok(())
}

/// Fork after accept: in `child_serves`, the child uses the connection
/// and the parent closes its descriptor at once (fork-per-connection
/// servers); otherwise the child closes it and the parent goes on.
fn fork_after_accept(server: bool, port: u16, child_serves: bool) -> R {
    let msg = data(1 << 20, 6);
    if server {
        let l = listen_on(port)?;
        let c = accept_one(l)?;
        let serve = |c: c_int| -> R {
            check!(recv_exact(c, msg.len())? == msg, "bytes changed");
            send_all(c, b"ok")?;
            expect_eof(c)?;
            close(c);
            Ok(())
        };
        // SAFETY: fork(2); the child runs `serve` or closes, then _exits.
        let pid = unsafe { libc::fork() };
        if pid == 0 {
            let r = if child_serves {
                serve(c)
            } else {
                close(c);
                Ok(())
            };
            if let Err(e) = &r {
                eprintln!("child: {e}");
            }
            // SAFETY: leave the child without unwinding.
            unsafe { libc::_exit(i32::from(r.is_err())) };
        }
        if child_serves {
            close(c);
        } else {
            // The child is gone before the parent touches the connection.
            let mut st = 0;
            // SAFETY: waitpid(2) on our own child.
            unsafe { libc::waitpid(pid, &mut st, 0) };
            serve(c)?;
        }
        let mut st = 0;
        // SAFETY: as above (ECHILD if already reaped).
        unsafe { libc::waitpid(pid, &mut st, 0) };
        check!(
            child_serves || st == 0 || libc::WIFEXITED(st),
            "child status {st}"
        );
        if child_serves {
            check!(
                libc::WIFEXITED(st) && libc::WEXITSTATUS(st) == 0,
                "the child failed"
            );
        }
    } else {
        let c = connect_to(port)?;
        send_all(c, &msg)?;
        check!(recv_exact(c, 2)? == b"ok", "ok");
        close(c);
    }
    Ok(())
}

unsafe extern "C" {
    fn __read_chk(fd: c_int, buf: *mut c_void, len: usize, buflen: usize) -> isize;
    fn __recv_chk(fd: c_int, buf: *mut c_void, len: usize, buflen: usize, flags: c_int) -> isize;
    fn __poll_chk(fds: *mut libc::pollfd, n: libc::nfds_t, timeout: c_int, fdslen: usize) -> c_int;
    fn fcntl64(fd: c_int, cmd: c_int, ...) -> c_int;
}

/// The other names glibc gives these calls: sendfile and sendfile64 from a
/// file, the _FORTIFY_SOURCE reads and poll, fcntl64.
fn glibc_names(server: bool, port: u16) -> R {
    let file_data = data(3 << 20, 8);
    if server {
        let l = listen_on(port)?;
        let c = accept_one(l)?;
        let path = std::env::temp_dir().join(format!("sockcheck-sendfile-{}", std::process::id()));
        std::fs::write(&path, &file_data).map_err(|e| e.to_string())?;
        let f = std::fs::File::open(&path).map_err(|e| e.to_string())?;
        let _ = std::fs::remove_file(&path);
        let ffd = std::os::fd::AsRawFd::as_raw_fd(&f);
        let half = file_data.len() / 2;
        let mut off: libc::off_t = 0;
        while (off as usize) < half {
            // SAFETY: sendfile(2) from our file at our offset.
            let n = unsafe { libc::sendfile(c, ffd, &mut off, half - off as usize) };
            check!(n > 0, "sendfile: {}", err_name(errno()));
        }
        while (off as usize) < file_data.len() {
            // SAFETY: sendfile64(2), likewise.
            let n = unsafe { libc::sendfile64(c, ffd, &mut off, file_data.len() - off as usize) };
            check!(n > 0, "sendfile64: {}", err_name(errno()));
        }
        let mut b = [0u8; 64];
        let mut p = libc::pollfd {
            fd: c,
            events: libc::POLLIN,
            revents: 0,
        };
        // SAFETY: the fortified poll of one entry of our own.
        let n = unsafe { __poll_chk(&mut p, 1, 5000, std::mem::size_of::<libc::pollfd>()) };
        check!(n == 1 && p.revents & libc::POLLIN != 0, "__poll_chk: {n}");
        // SAFETY: fortified reads into our own buffer.
        let n = unsafe { __recv_chk(c, b.as_mut_ptr().cast(), 32, b.len(), libc::MSG_WAITALL) };
        check!(n == 32 && b[..32] == data(64, 9)[..32], "__recv_chk: {n}");
        // SAFETY: as above.
        let n = unsafe { __read_chk(c, b.as_mut_ptr().cast(), 32, b.len()) };
        check!(
            n > 0 && b[..n as usize] == data(64, 9)[32..32 + n as usize],
            "__read_chk: {n}"
        );
        // SAFETY: fcntl64 on our own descriptor.
        unsafe { fcntl64(c, libc::F_SETFL, libc::O_NONBLOCK) };
        let mut rest = 64 - 32 - n as usize;
        while rest > 0 {
            let m = recv_some(c, &mut b, 0);
            check!(
                m > 0 || errno() == libc::EAGAIN,
                "recv: {}",
                err_name(errno())
            );
            if m > 0 {
                rest -= m as usize;
            }
        }
        check!(
            recv_some(c, &mut b, 0) == -1 && errno() == libc::EAGAIN,
            "fcntl64 O_NONBLOCK: {}",
            err_name(errno())
        );
        send_all(c, b"k")?;
        close(c);
    } else {
        let c = connect_to(port)?;
        check!(
            recv_exact(c, file_data.len())? == file_data,
            "the file's bytes"
        );
        send_all(c, &data(64, 9))?;
        check!(recv_exact(c, 1)? == b"k", "k");
        close(c);
    }
    Ok(())
}

/// The client sends, then waits to be killed (by the test); the server
/// must read the data, then EOF: a process that dies leaving nothing
/// unsent ends its connection as a close would.
fn killed_idle(server: bool, port: u16) -> R {
    let msg = data(100_000, 7);
    if server {
        let l = listen_on(port)?;
        let c = accept_one(l)?;
        check!(recv_exact(c, msg.len())? == msg, "data before the death");
        println!("got");
        use std::io::Write as _;
        let _ = std::io::stdout().flush();
        expect_eof(c)?;
        close(c);
    } else {
        let c = connect_to(port)?;
        send_all(c, &msg)?;
        sleep_ms(60_000);
    }
    Ok(())
}

/// The client sends 8 MiB (zero-copy: `send()` returns before the peer
/// took the pages) and leaves at once, by `_exit` or by `exit`: the kernel
/// would deliver all of it, then the end of the stream, and so must we.
fn exit_after_send(server: bool, port: u16, raw: bool) -> R {
    let msg = data(8 << 20, 11);
    if server {
        let l = listen_on(port)?;
        let c = accept_one(l)?;
        check!(
            recv_exact(c, msg.len())? == msg,
            "the bytes sent before the exit"
        );
        expect_eof(c)?;
        close(c);
        return Ok(());
    }
    let c = connect_to(port)?;
    send_all(c, &msg)?;
    if raw {
        // SAFETY: the process ends here; nothing is left to unwind.
        unsafe { libc::_exit(0) }
    }
    std::process::exit(0)
}

/// Turns a pre-fork server's two processes take on one socket.
const SHARED_TURNS: usize = 8;
/// Bytes of each turn, each way (large enough to go zero-copy).
const SHARED_TURN: usize = 200_000;

/// A server forks after accepting and both processes use the connection,
/// taking turns (a pipe each way says whose turn it is): each turn reads a
/// chunk of the client's stream and answers with a chunk of its own, so
/// the bytes must keep their order across the processes both ways. The
/// connection moves onto its TCP socket when the second process first uses
/// it.
fn fork_both_use(server: bool, port: u16) -> R {
    let ask = |t: usize| data(SHARED_TURN, 40 + t as u32);
    let answer = |t: usize| data(SHARED_TURN, 80 + t as u32);
    if !server {
        let c = connect_to(port)?;
        for t in 0..SHARED_TURNS {
            send_all(c, &ask(t))?;
            check!(recv_exact(c, SHARED_TURN)? == answer(t), "answer {t}");
        }
        expect_eof(c)?;
        close(c);
        return Ok(());
    }
    let l = listen_on(port)?;
    let c = accept_one(l)?;
    let (mut to_child, mut to_parent) = ([0; 2], [0; 2]);
    // SAFETY: two pipes of ours.
    unsafe {
        libc::pipe(to_child.as_mut_ptr());
        libc::pipe(to_parent.as_mut_ptr());
    }
    let turn = |first: usize, wait: c_int, tell: c_int| -> R {
        for t in (first..SHARED_TURNS).step_by(2) {
            if t > 0 {
                let mut b = [0u8; 1];
                // SAFETY: one byte from our pipe into a local.
                let n = unsafe { libc::read(wait, b.as_mut_ptr().cast(), 1) };
                check!(n == 1, "turn {t}: the pipe");
            }
            check!(recv_exact(c, SHARED_TURN)? == ask(t), "ask {t}");
            send_all(c, &answer(t))?;
            // SAFETY: one byte into our pipe.
            unsafe { libc::write(tell, b"x".as_ptr().cast(), 1) };
        }
        Ok(())
    };
    // SAFETY: fork(2); the child takes the odd turns, then _exits.
    let pid = unsafe { libc::fork() };
    // Each side closes the pipe ends it does not use: a side that fails
    // then ends the other's wait for its turn (EOF) instead of hanging it.
    if pid == 0 {
        close(to_child[1]);
        close(to_parent[0]);
        let r = turn(1, to_child[0], to_parent[1]);
        if let Err(e) = &r {
            eprintln!("child: {e}");
        }
        close(c);
        // SAFETY: leave the child without unwinding.
        unsafe { libc::_exit(i32::from(r.is_err())) };
    }
    close(to_child[0]);
    close(to_parent[1]);
    turn(0, to_parent[0], to_child[1])?;
    reap_ok(pid, "the child")?;
    close(c);
    Ok(())
}

/// Bytes each way while two processes share a connection, and after.
const SPLIT_BYTES: usize = 24 << 20;
const SPLIT_TAIL: usize = 3 << 20;

/// rsync's shape: after the fork, one process reads the client's stream
/// (`poll` and non-blocking receives) while the other writes its own (plain
/// blocking sends), both at once, one direction each. The reader then
/// exits, and the writer carries on alone both ways: a tail after the
/// reader's exit, and the client's last word. `reader_first`: the reader
/// uses the connection first (so it is the process that runs it, and the
/// one that leaves while the other still uses it).
fn fork_split(server: bool, port: u16, reader_first: bool) -> R {
    let up = data(SPLIT_BYTES, 60);
    let down = data(SPLIT_BYTES, 61);
    let tail = data(SPLIT_TAIL, 62);
    if !server {
        let c = connect_to(port)?;
        let sender = std::thread::spawn(move || send_all(c, &data(SPLIT_BYTES, 60)));
        check!(recv_exact(c, SPLIT_BYTES)? == down, "the writer's bytes");
        sender.join().map_err(|_| "sender panicked".to_string())??;
        check!(recv_exact(c, SPLIT_TAIL)? == tail, "the tail");
        send_all(c, b"bye")?;
        expect_eof(c)?;
        close(c);
        return Ok(());
    }
    let l = listen_on(port)?;
    let c = accept_one(l)?;
    // Who uses the connection first (and so runs it): the reader tells
    // `started` once it has bytes, the writer `go` once it has sent some.
    let (mut started, mut go) = ([0; 2], [0; 2]);
    // SAFETY: two pipes of ours.
    unsafe {
        libc::pipe(started.as_mut_ptr());
        libc::pipe(go.as_mut_ptr());
    }
    let wait_pipe = |fd: c_int, what: &str| -> R {
        let mut b = [0u8; 1];
        // SAFETY: one byte from our pipe into a local.
        let n = unsafe { libc::read(fd, b.as_mut_ptr().cast(), 1) };
        check!(n == 1, "{what}");
        Ok(())
    };
    // SAFETY: fork(2); the child reads, then _exits.
    let pid = unsafe { libc::fork() };
    if pid == 0 {
        let r = (|| -> R {
            if !reader_first {
                wait_pipe(go[0], "the writer did not start")?;
            }
            let mut got = vec![0u8; SPLIT_BYTES];
            let mut at = 0;
            let mut told = false;
            while at < SPLIT_BYTES {
                let mut p = libc::pollfd {
                    fd: c,
                    events: libc::POLLIN,
                    revents: 0,
                };
                // SAFETY: poll(2) on our own pollfd.
                let n = unsafe { libc::poll(&mut p, 1, 10_000) };
                check!(n == 1, "poll after {at}: {n} ({})", err_name(errno()));
                let n = recv_some(c, &mut got[at..], libc::MSG_DONTWAIT);
                if n < 0 && errno() == libc::EAGAIN {
                    continue;
                }
                check!(n > 0, "recv after {at}: {n} ({})", err_name(errno()));
                at += n as usize;
                if !told {
                    // (After the first bytes: one receive may take them all.)
                    told = true;
                    // SAFETY: one byte into our pipe.
                    unsafe { libc::write(started[1], b"x".as_ptr().cast(), 1) };
                }
            }
            check!(got == up, "the client's bytes");
            Ok(())
        })();
        if let Err(e) = &r {
            eprintln!("reader: {e}");
        }
        close(c);
        // SAFETY: leave the child without unwinding.
        unsafe { libc::_exit(i32::from(r.is_err())) };
    }
    if reader_first {
        wait_pipe(started[0], "the reader did not start")?;
        send_all(c, &down)?;
    } else {
        send_all(c, &down[..4096])?;
        // SAFETY: one byte into our pipe.
        unsafe { libc::write(go[1], b"x".as_ptr().cast(), 1) };
        send_all(c, &down[4096..])?;
    }
    reap_ok(pid, "the reader")?;
    send_all(c, &tail)?;
    check!(recv_exact(c, 3)? == b"bye", "bye");
    close(c);
    Ok(())
}

/// How the forked child of [`fork_idle_holder`] leaves.
const IDLE_HOLDER_ENDINGS: [&str; 3] = ["close, _exit", "_exit", "exit"];

/// A forked child runs the connection (it is the first to use it) and
/// leaves, while its parent, which holds the descriptor too, has not
/// touched it yet: the parent answers only once the child is reaped. As
/// on TCP, the child's going does not end the connection (the parent's
/// descriptor keeps the socket open), whether it closes first or leaves
/// by `_exit` or `exit()`. (A runner once ended it when no other process
/// had made a call yet: rsync's shape, under load.)
fn fork_idle_holder(server: bool, port: u16) -> R {
    let question = data(4 << 20, 63);
    let answer = data(1 << 20, 64);
    if !server {
        for ending in IDLE_HOLDER_ENDINGS {
            let c = connect_to(port)?;
            send_all(c, &question)?;
            check!(
                recv_exact(c, answer.len())? == answer,
                "the answer ({ending})"
            );
            expect_eof(c)?;
            close(c);
        }
        return Ok(());
    }
    let l = listen_on(port)?;
    for (i, ending) in IDLE_HOLDER_ENDINGS.into_iter().enumerate() {
        let c = accept_one(l)?;
        // SAFETY: fork(2); the child reads, then leaves as told.
        let pid = unsafe { libc::fork() };
        if pid == 0 {
            let r = (|| -> R {
                check!(recv_exact(c, question.len())? == question, "the question");
                Ok(())
            })();
            if let Err(e) = &r {
                eprintln!("child ({ending}): {e}");
            }
            let code = i32::from(r.is_err());
            match i {
                0 => {
                    close(c);
                    // SAFETY: leave the child without unwinding.
                    unsafe { libc::_exit(code) }
                }
                // SAFETY: as above, the descriptor still open.
                1 => unsafe { libc::_exit(code) },
                // SAFETY: libc's exit (its handlers run), without unwinding.
                _ => unsafe { libc::exit(code) },
            }
        }
        reap_ok(pid, "the child ({ending})")?;
        send_all(c, &answer)?;
        close(c);
    }
    close(l);
    Ok(())
}

/// A fork-per-connection server on a busy host: the parent closes its copy
/// at once, and the child makes its first call only after the fork's grace
/// (1 s, after which the parent's reactor takes the connection back). As
/// on TCP, the child serves the connection: the parent, which closed,
/// moves it onto the socket the child holds instead of ending it (it had
/// reset the client, and left the child waiting for ever on a runner that
/// had let go).
fn fork_late_child(server: bool, port: u16) -> R {
    const MIB: usize = 1 << 20;
    let q1 = data(MIB, 80);
    let a1 = data(MIB, 81);
    let q2 = data(MIB, 82);
    let a2 = data(MIB, 83);
    if !server {
        let c = connect_to(port)?;
        send_all(c, &q1)?;
        check!(recv_exact(c, MIB)? == a1, "the first answer");
        send_all(c, &q2)?;
        check!(recv_exact(c, MIB)? == a2, "the child's answer");
        expect_eof(c)?;
        close(c);
        return Ok(());
    }
    let l = listen_on(port)?;
    let c = accept_one(l)?;
    check!(recv_exact(c, MIB)? == q1, "the first question");
    send_all(c, &a1)?;
    // SAFETY: fork(2); the child serves after a pause, then _exits.
    let pid = unsafe { libc::fork() };
    if pid == 0 {
        let r = (|| -> R {
            sleep_ms(1500);
            check!(recv_exact(c, MIB)? == q2, "the second question");
            send_all(c, &a2)?;
            close(c);
            Ok(())
        })();
        if let Err(e) = &r {
            eprintln!("child: {e}");
        }
        // SAFETY: leave the child without unwinding.
        unsafe { libc::_exit(i32::from(r.is_err())) };
    }
    close(c);
    reap_ok(pid, "the child")?;
    close(l);
    Ok(())
}

/// A server whose forked child runs the connection (it used it first)
/// while the parent's calls go through it, until the parent kills it
/// (SIGKILL): as with TCP, the parent carries on, both ways, and the
/// client sees nothing but the bytes (what the child sent and the client
/// had not read yet included).
fn runner_killed(server: bool, port: u16) -> R {
    const MIB: usize = 1 << 20;
    const EXTRA: usize = 32 << 10;
    let hello = data(64 << 10, 70);
    let down1 = data(MIB, 71);
    let extra = data(EXTRA, 72);
    let up1 = data(MIB, 73);
    let up2 = data(MIB, 74);
    let down2 = data(MIB, 75);
    if server {
        // The peer: it sees nothing but the bytes.
        let l = listen_on(port)?;
        let c = accept_one(l)?;
        send_all(c, &hello)?;
        check!(recv_exact(c, MIB)? == down1, "what the child sent");
        send_all(c, &up1)?;
        send_all(c, &up2)?;
        check!(recv_exact(c, EXTRA)? == extra, "the child's last bytes");
        check!(recv_exact(c, MIB)? == down2, "what the parent sent after");
        send_all(c, b"bye")?;
        expect_eof(c)?;
        close(c);
        close(l);
        return Ok(());
    }
    let c = connect_to(port)?;
    check!(recv_exact(c, hello.len())? == hello, "hello");
    let mut sent = [0; 2];
    // SAFETY: a pipe of ours.
    unsafe { libc::pipe(sent.as_mut_ptr()) };
    // SAFETY: fork(2); the child sends, then waits to be killed.
    let pid = unsafe { libc::fork() };
    if pid == 0 {
        let ok = send_all(c, &down1)
            .and_then(|()| send_all(c, &extra))
            .is_ok();
        // SAFETY: one byte into our pipe.
        unsafe { libc::write(sent[1], if ok { b"y" } else { b"n" }.as_ptr().cast(), 1) };
        loop {
            sleep_ms(1000);
        }
    }
    let mut b = [0u8; 1];
    // SAFETY: one byte from our pipe into a local.
    let n = unsafe { libc::read(sent[0], b.as_mut_ptr().cast(), 1) };
    check!(n == 1 && b[0] == b'y', "the child did not send");
    check!(recv_exact(c, MIB)? == up1, "the peer's first MiB");
    // SAFETY: kill(2) and waitpid(2) on our own child.
    unsafe {
        libc::kill(pid, libc::SIGKILL);
        libc::waitpid(pid, std::ptr::null_mut(), 0);
    }
    check!(recv_exact(c, MIB)? == up2, "the peer's second MiB");
    send_all(c, &down2)?;
    check!(recv_exact(c, 3)? == b"bye", "bye");
    close(c);
    Ok(())
}

/// `sendmmsg`/`recvmmsg` and `splice` on a connected socket, both ways:
/// every byte arrives, in order, whichever call carried it.
fn batch_calls(server: bool, port: u16) -> R {
    const SIZES: [usize; 4] = [1000, 70_000, 5, 200_000];
    const SPLICED: usize = 3 << 20;
    const BATCH_BACK: usize = 512 << 10;
    let batch_total: usize = SIZES.iter().sum::<usize>() * 2;
    if !server {
        let c = connect_to(port)?;
        check!(
            recv_exact(c, batch_total)? == data(batch_total, 50),
            "sendmmsg's bytes"
        );
        check!(
            recv_exact(c, SPLICED)? == data(SPLICED, 51),
            "spliced bytes"
        );
        send_all(c, &data(BATCH_BACK, 52))?;
        send_all(c, &data(SPLICED, 53))?;
        check!(recv_exact(c, 2)? == b"ok", "ok");
        expect_eof(c)?;
        close(c);
        return Ok(());
    }
    let l = listen_on(port)?;
    let c = accept_one(l)?;
    // sendmmsg: four messages of two buffers each.
    let out = data(batch_total, 50);
    let mut iov = Vec::new();
    let mut at = 0;
    for &n in &SIZES {
        for _ in 0..2 {
            iov.push(libc::iovec {
                iov_base: out[at..].as_ptr().cast_mut().cast(),
                iov_len: n,
            });
            at += n;
        }
    }
    let mut msgs: Vec<libc::mmsghdr> = (0..SIZES.len())
        .map(|i| {
            // SAFETY: a C structure of integers and pointers: zero is valid.
            let mut m: libc::mmsghdr = unsafe { std::mem::zeroed() };
            m.msg_hdr.msg_iov = iov[2 * i..].as_mut_ptr();
            m.msg_hdr.msg_iovlen = 2;
            m
        })
        .collect();
    // SAFETY: sendmmsg(2) of our own vector.
    let n = unsafe { libc::sendmmsg(c, msgs.as_mut_ptr(), msgs.len() as u32, 0) };
    check!(
        n == SIZES.len() as c_int,
        "sendmmsg: {n} ({})",
        err_name(errno())
    );
    for (m, &size) in msgs.iter().zip(&SIZES) {
        check!(
            m.msg_len as usize == 2 * size,
            "sendmmsg's msg_len {}",
            m.msg_len
        );
    }
    // splice from a pipe that a thread fills.
    let (mut p, mut q) = ([0; 2], [0; 2]);
    // SAFETY: two pipes of ours.
    unsafe {
        libc::pipe(p.as_mut_ptr());
        libc::pipe(q.as_mut_ptr());
    }
    let writer = p[1];
    let filler = std::thread::spawn(move || {
        let d = data(SPLICED, 51);
        let mut at = 0;
        while at < d.len() {
            // SAFETY: write(2) of our buffer into our pipe.
            let n = unsafe {
                libc::write(writer, d[at..].as_ptr().cast(), (d.len() - at).min(100_000))
            };
            assert!(n > 0);
            at += n as usize;
        }
        close(writer);
    });
    let mut moved = 0;
    loop {
        // SAFETY: splice(2) between our pipe and our socket.
        let n = unsafe {
            libc::splice(
                p[0],
                std::ptr::null_mut(),
                c,
                std::ptr::null_mut(),
                1 << 20,
                0,
            )
        };
        check!(n >= 0, "splice to the socket: {}", err_name(errno()));
        if n == 0 {
            break;
        }
        moved += n as usize;
    }
    filler.join().map_err(|_| "the pipe's filler panicked")?;
    check!(moved == SPLICED, "spliced {moved} of {SPLICED}");
    close(p[0]);
    // recvmmsg with MSG_WAITFORONE, three 64 KiB messages at a time; each
    // message's bytes follow the last one's.
    let mut back = Vec::with_capacity(BATCH_BACK);
    while back.len() < BATCH_BACK {
        // Never more than this stream's rest: the client's next stream
        // follows at once, and a larger batch would take from it.
        let left = BATCH_BACK - back.len();
        let mut space = vec![0u8; 3 * 65536];
        let mut bufs: Vec<libc::iovec> = space
            .chunks_mut(65536)
            .enumerate()
            .map(|(i, b)| libc::iovec {
                iov_base: b.as_mut_ptr().cast(),
                iov_len: left.saturating_sub(i * 65536).min(b.len()),
            })
            .filter(|v| v.iov_len > 0)
            .collect();
        let batch = bufs.len();
        let mut msgs: Vec<libc::mmsghdr> = (0..batch)
            .map(|i| {
                // SAFETY: a C structure of integers and pointers: zero is valid.
                let mut m: libc::mmsghdr = unsafe { std::mem::zeroed() };
                m.msg_hdr.msg_iov = &raw mut bufs[i];
                m.msg_hdr.msg_iovlen = 1;
                m
            })
            .collect();
        // SAFETY: recvmmsg(2) into our own vector.
        let n = unsafe {
            libc::recvmmsg(
                c,
                msgs.as_mut_ptr(),
                batch as u32,
                libc::MSG_WAITFORONE,
                std::ptr::null_mut(),
            )
        };
        check!(n > 0, "recvmmsg: {n} ({})", err_name(errno()));
        for (i, m) in msgs[..n as usize].iter().enumerate() {
            check!(m.msg_len > 0, "recvmmsg: an empty message before EOF");
            back.extend_from_slice(&space[i * 65536..i * 65536 + m.msg_len as usize]);
        }
    }
    check!(back == data(BATCH_BACK, 52), "recvmmsg's bytes");
    // splice from the socket into a pipe that a thread drains.
    let reader = q[0];
    let drainer = std::thread::spawn(move || {
        let mut v = Vec::with_capacity(SPLICED);
        let mut b = vec![0u8; 100_000];
        while v.len() < SPLICED {
            // SAFETY: read(2) from our pipe into our buffer.
            let n = unsafe { libc::read(reader, b.as_mut_ptr().cast(), b.len()) };
            if n <= 0 {
                break;
            }
            v.extend_from_slice(&b[..n as usize]);
        }
        close(reader);
        v
    });
    let mut moved = 0;
    while moved < SPLICED {
        let want = (SPLICED - moved).min(1 << 20);
        // SAFETY: splice(2) between our socket and our pipe.
        let n =
            unsafe { libc::splice(c, std::ptr::null_mut(), q[1], std::ptr::null_mut(), want, 0) };
        check!(n > 0, "splice from the socket: {n} ({})", err_name(errno()));
        moved += n as usize;
    }
    close(q[1]);
    let v = drainer.join().map_err(|_| "the pipe's drainer panicked")?;
    check!(
        v == data(SPLICED, 53),
        "spliced bytes from the socket ({} of {SPLICED})",
        v.len()
    );
    send_all(c, b"ok")?;
    close(c);
    close(l);
    Ok(())
}

/// A server forks after accept; the child drops root for nobody, as
/// privilege-separated servers do, and serves the connection; the parent
/// closes its copy. (Root only: as anyone else the scenario is skipped.)
fn fork_setuid(server: bool, port: u16) -> R {
    const ASK: usize = 700_000;
    const ANSWER: usize = 300_000;
    if !server {
        let c = connect_to(port)?;
        send_all(c, &data(ASK, 61))?;
        check!(
            recv_exact(c, ANSWER)? == data(ANSWER, 62),
            "the child's answer"
        );
        expect_eof(c)?;
        close(c);
        return Ok(());
    }
    let l = listen_on(port)?;
    let c = accept_one(l)?;
    // SAFETY: fork; the child serves and _exits.
    let pid = unsafe { libc::fork() };
    if pid == 0 {
        let r = (|| -> R {
            // SAFETY: dropping to nobody, as a root server's child does.
            unsafe {
                if libc::geteuid() == 0 {
                    check!(
                        libc::setgid(65534) == 0 && libc::setuid(65534) == 0,
                        "setuid: {}",
                        err_name(errno())
                    );
                }
            }
            check!(
                recv_exact(c, ASK)? == data(ASK, 61),
                "the ask, in the child"
            );
            send_all(c, &data(ANSWER, 62))
        })();
        if let Err(e) = &r {
            eprintln!("child: {e}");
        }
        close(c);
        // SAFETY: leave the child without unwinding.
        unsafe { libc::_exit(i32::from(r.is_err())) };
    }
    check!(pid > 0, "fork: {}", err_name(errno()));
    close(c);
    reap_ok(pid, "the child")?;
    Ok(())
}

/// Bytes of the client's stream, of which the server's first image reads
/// `BEFORE_EXEC` and the image it execs the rest; then the exec'd image's
/// answer.
const EXEC_STREAM: usize = 600_000;
const BEFORE_EXEC: usize = 50_000;
const EXEC_ANSWER: usize = 300_000;

/// A server forks and execs a program with the upgraded socket as its
/// descriptor (inetd style): the new image, with the shim (`keep_shim`:
/// it takes the parked connection up) or without it (the connection moved
/// onto its TCP socket first), reads exactly the rest of the client's
/// stream (what the first image had not read, whether it came by copy or
/// zero-copy) and what it writes reaches the client after everything sent
/// before.
/// How [`exec`] starts the new image.
#[derive(Clone, Copy, PartialEq)]
enum Exec {
    /// fork, then execve, with LD_PRELOAD kept or cleared.
    Execve { keep_shim: bool },
    /// fork, then execl (variadic in C).
    Execl,
    /// posix_spawn, the socket (close-on-exec here) given to the new
    /// program by the file actions' dup2.
    Spawn,
    /// system(): a shell that runs the program, which inherits the socket.
    System,
    /// fork, execve, and the new image reads some of the stream, then
    /// execs itself again with the socket.
    Twice,
    /// fork, then execve with the shim, and this process closes its copy
    /// only a moment later (as a busy inetd may): the exec'd image still
    /// takes the connection up.
    LateClose,
    /// execve that fails (E2BIG: an argument longer than the kernel
    /// takes, after the shim parked the connection): this process reads
    /// the rest of the stream and answers.
    Failing,
}

fn exec(server: bool, port: u16, how: Exec) -> R {
    let stream = data(EXEC_STREAM, 17);
    if !server {
        let c = connect_to(port)?;
        send_all(c, &stream[..EXEC_STREAM / 2])?;
        send_all(c, &stream[EXEC_STREAM / 2..])?;
        check!(
            recv_exact(c, EXEC_ANSWER)? == data(EXEC_ANSWER, 18),
            "the exec'd image's answer"
        );
        expect_eof(c)?;
        close(c);
        return Ok(());
    }
    let l = listen_on(port)?;
    let c = accept_one(l)?;
    check!(
        recv_exact(c, BEFORE_EXEC)? == stream[..BEFORE_EXEC],
        "what the first image read"
    );
    let exe_path = std::env::current_exe().map_err(|e| e.to_string())?;
    let cstr = |b: Vec<u8>| std::ffi::CString::new(b).expect("no NUL");
    let exe = cstr(exe_path.clone().into_os_string().into_encoded_bytes());
    // The descriptor the new image finds the connection on.
    let fd_there: c_int = if how == Exec::Spawn { 100 } else { c };
    let then_exec = if how == Exec::Twice { EXEC_AGAIN } else { 0 };
    let huge = "x".repeat(256 << 10);
    let mut args: Vec<std::ffi::CString> = [
        "azsdp-sockcheck",
        "exec-probe",
        &fd_there.to_string(),
        "0",
        &then_exec.to_string(),
    ]
    .iter()
    .map(|a| cstr(a.as_bytes().to_vec()))
    .collect();
    if how == Exec::Failing {
        args.push(cstr(huge.into_bytes()));
    }
    let mut argv: Vec<*const libc::c_char> = args.iter().map(|a| a.as_ptr()).collect();
    argv.push(std::ptr::null());
    let keep_shim = how != Exec::Execve { keep_shim: false };
    let env: Vec<std::ffi::CString> = std::env::vars_os()
        .filter(|(k, _)| keep_shim || k != "LD_PRELOAD")
        .map(|(k, v)| {
            let mut kv = k.into_encoded_bytes();
            kv.push(b'=');
            kv.extend(v.into_encoded_bytes());
            cstr(kv)
        })
        .collect();
    let mut envp: Vec<*const libc::c_char> = env.iter().map(|a| a.as_ptr()).collect();
    envp.push(std::ptr::null());
    let status = match how {
        Exec::Failing => {
            // SAFETY: exec with NUL-terminated arrays built above.
            let r = unsafe { libc::execve(exe.as_ptr(), argv.as_ptr(), envp.as_ptr()) };
            check!(
                r == -1 && errno() == libc::E2BIG,
                "the exec did not fail with E2BIG: {r} {}",
                err_name(errno())
            );
            exec_probe(c, 0, 0)?;
            0
        }
        Exec::Execve { .. } | Exec::Execl | Exec::Twice | Exec::LateClose => {
            // SAFETY: fork; the child only execs (or exits).
            let pid = unsafe { libc::fork() };
            if pid == 0 {
                // SAFETY: exec with NUL-terminated arrays built above.
                unsafe {
                    if how == Exec::Execl {
                        libc::execl(
                            exe.as_ptr(),
                            argv[0],
                            argv[1],
                            argv[2],
                            argv[3],
                            argv[4],
                            argv[5],
                        );
                    } else {
                        libc::execve(exe.as_ptr(), argv.as_ptr(), envp.as_ptr());
                    }
                    libc::_exit(127);
                }
            }
            check!(pid > 0, "fork: {}", err_name(errno()));
            if how == Exec::LateClose {
                sleep_ms(150);
            }
            // The child runs the connection now: this copy is only closed.
            close(c);
            let mut status = 0;
            // SAFETY: waitpid for our child.
            unsafe { libc::waitpid(pid, &mut status, 0) };
            status
        }
        Exec::Spawn => {
            // SAFETY: the file actions and spawn of our own arrays; the
            // socket closes on exec, so only the dup2 gives it over.
            unsafe {
                libc::fcntl(c, libc::F_SETFD, libc::FD_CLOEXEC);
                let mut fa: libc::posix_spawn_file_actions_t = std::mem::zeroed();
                libc::posix_spawn_file_actions_init(&mut fa);
                libc::posix_spawn_file_actions_adddup2(&mut fa, c, fd_there);
                let mut pid = 0;
                let r = libc::posix_spawn(
                    &mut pid,
                    exe.as_ptr(),
                    &fa,
                    std::ptr::null(),
                    argv.as_ptr().cast(),
                    envp.as_ptr().cast(),
                );
                libc::posix_spawn_file_actions_destroy(&mut fa);
                check!(r == 0, "posix_spawn: {}", err_name(r));
                close(c);
                let mut status = 0;
                libc::waitpid(pid, &mut status, 0);
                status
            }
        }
        Exec::System => {
            let cmd = format!(
                "'{}' exec-probe {c} 0 0",
                exe_path.display().to_string().replace('\'', "'\\''")
            );
            let cmd = cstr(cmd.into_bytes());
            // SAFETY: system(3) of our own command line.
            let status = unsafe { libc::system(cmd.as_ptr()) };
            close(c);
            status
        }
    };
    check!(
        libc::WIFEXITED(status) && libc::WEXITSTATUS(status) == 0,
        "the exec'd image failed: status {status:#x}"
    );
    Ok(())
}

/// Bytes the first exec'd image of [`Exec::Twice`] reads before it execs
/// again.
const EXEC_AGAIN: usize = 200_000;

/// The exec'd side of [`exec`]: descriptor `fd` was inherited, upgraded;
/// the images before read `BEFORE_EXEC + skip` bytes of the stream. With
/// `then_exec`, read that much and exec again.
fn exec_probe(fd: c_int, skip: usize, then_exec: usize) -> R {
    let stream = data(EXEC_STREAM, 17);
    let at = BEFORE_EXEC + skip;
    if then_exec > 0 {
        check!(
            recv_exact(fd, then_exec)? == stream[at..at + then_exec],
            "part of the stream, in the first exec'd image"
        );
        let exe = std::env::current_exe().map_err(|e| e.to_string())?;
        let err = std::os::unix::process::CommandExt::exec(std::process::Command::new(exe).args([
            "exec-probe",
            &fd.to_string(),
            &(skip + then_exec).to_string(),
            "0",
        ]));
        return Err(format!("the second exec failed: {err}"));
    }
    check!(
        recv_exact(fd, EXEC_STREAM - at)? == stream[at..],
        "the rest of the client's stream, in the exec'd image"
    );
    send_all(fd, &data(EXEC_ANSWER, 18))?;
    close(fd);
    Ok(())
}

/// Bytes written to an upgraded socket around the shim (a raw system
/// call) while the peer is blocked reading it: on kernel TCP they simply
/// arrive; under azsdp the stream cannot take them in order, so the
/// reader gets ECONNRESET, within a few seconds, and never hangs.
fn stray_bytes(server: bool, port: u16) -> R {
    if !server {
        let c = connect_to(port)?;
        sleep_ms(300);
        // SAFETY: a raw write(2) of our own buffer, around libc and the shim.
        let n = unsafe { libc::syscall(libc::SYS_write, c, b"0123456789".as_ptr(), 10usize) };
        check!(n == 10, "raw write: {n}");
        sleep_ms(6000);
        close(c);
        return Ok(());
    }
    let l = listen_on(port)?;
    let c = accept_one(l)?;
    set_timeout(c, libc::SO_RCVTIMEO, 10_000);
    let t = Instant::now();
    let mut b = [0u8; 16];
    let n = recv_some(c, &mut b, 0);
    let e = errno();
    check!(
        t.elapsed() < Duration::from_secs(8),
        "the read took {:?}: it waited for its timeout",
        t.elapsed()
    );
    match n {
        // Kernel TCP: the bytes.
        10 => check!(&b[..10] == b"0123456789", "the raw bytes"),
        -1 => check!(e == libc::ECONNRESET, "recv: {}", err_name(e)),
        n => return Err(format!("recv returned {n}")),
    }
    close(c);
    close(l);
    Ok(())
}

/// A signal interrupts each waiting call on an upgraded socket: poll,
/// ppoll, select, pselect, epoll_wait, epoll_pwait fail with EINTR (Linux
/// never restarts them, SA_RESTART or not), and the next wait still sees
/// the data when it comes.
fn eintr_waits(server: bool, port: u16) -> R {
    if !server {
        let c = connect_to(port)?;
        // Long enough for the server's twelve interrupted waits.
        sleep_ms(2500);
        send_all(c, b"x")?;
        expect_eof(c)?;
        close(c);
        return Ok(());
    }
    let l = listen_on(port)?;
    let c = accept_one(l)?;
    // SAFETY: epoll_create1.
    let ep = unsafe { libc::epoll_create1(0) };
    epoll_ctl(ep, libc::EPOLL_CTL_ADD, c, libc::EPOLLIN as u32)?;
    for restart in [false, true] {
        count_signal(libc::SIGALRM, restart);
        let waits: [(&str, &dyn Fn() -> c_int); 6] = [
            ("poll", &|| {
                let mut p = libc::pollfd {
                    fd: c,
                    events: libc::POLLIN,
                    revents: 0,
                };
                // SAFETY: one pollfd of ours.
                unsafe { libc::poll(&mut p, 1, 5000) }
            }),
            ("ppoll", &|| {
                let mut p = libc::pollfd {
                    fd: c,
                    events: libc::POLLIN,
                    revents: 0,
                };
                let ts = libc::timespec {
                    tv_sec: 5,
                    tv_nsec: 0,
                };
                // SAFETY: one pollfd and a timespec of ours.
                unsafe { libc::ppoll(&mut p, 1, &ts, std::ptr::null()) }
            }),
            ("select", &|| {
                // SAFETY: an fd_set and a timeval of ours.
                unsafe {
                    let mut r: libc::fd_set = std::mem::zeroed();
                    libc::FD_SET(c, &mut r);
                    let mut tv = libc::timeval {
                        tv_sec: 5,
                        tv_usec: 0,
                    };
                    libc::select(
                        c + 1,
                        &mut r,
                        std::ptr::null_mut(),
                        std::ptr::null_mut(),
                        &mut tv,
                    )
                }
            }),
            ("pselect", &|| {
                // SAFETY: an fd_set and a timespec of ours.
                unsafe {
                    let mut r: libc::fd_set = std::mem::zeroed();
                    libc::FD_SET(c, &mut r);
                    let ts = libc::timespec {
                        tv_sec: 5,
                        tv_nsec: 0,
                    };
                    libc::pselect(
                        c + 1,
                        &mut r,
                        std::ptr::null_mut(),
                        std::ptr::null_mut(),
                        &ts,
                        std::ptr::null(),
                    )
                }
            }),
            ("epoll_wait", &|| {
                let mut ev = libc::epoll_event { events: 0, u64: 0 };
                // SAFETY: one event of ours.
                unsafe { libc::epoll_wait(ep, &mut ev, 1, 5000) }
            }),
            ("epoll_pwait", &|| {
                let mut ev = libc::epoll_event { events: 0, u64: 0 };
                // SAFETY: one event of ours, no mask.
                unsafe { libc::epoll_pwait(ep, &mut ev, 1, 5000, std::ptr::null()) }
            }),
        ];
        for (name, wait) in waits {
            let before = delivered(libc::SIGALRM);
            alarm_in(100);
            let t = Instant::now();
            let r = wait();
            let e = errno();
            check!(
                r == -1 && e == libc::EINTR,
                "{name} (SA_RESTART {restart}) gave {r}, {} after {:?}",
                err_name(e),
                t.elapsed()
            );
            check!(delivered(libc::SIGALRM) == before + 1, "{name}: no alarm");
        }
    }
    // The data still arrives, and a successful wait leaves errno alone.
    // SAFETY: setting our own errno.
    unsafe { *libc::__errno_location() = 12345 };
    check!(
        poll1(c, libc::POLLIN, 10_000) & libc::POLLIN != 0,
        "no data after the signals"
    );
    check!(
        errno() == 12345,
        "a successful poll changed errno to {}",
        err_name(errno())
    );
    let got = recv_exact(c, 1)?;
    check!(
        errno() == 12345,
        "a successful recv changed errno to {}",
        err_name(errno())
    );
    check!(got == b"x", "got {got:?}");
    close(ep);
    close(c);
    Ok(())
}

/// Arguments the kernel refuses, with an upgraded socket involved: the
/// kernel's error, never a crash or an allocation on the program's word.
fn bad_args(server: bool, port: u16) -> R {
    if !server {
        let c = connect_to(port)?;
        send_all(c, b"ready")?;
        expect_eof(c)?;
        close(c);
        return Ok(());
    }
    let l = listen_on(port)?;
    let c = accept_one(l)?;
    check!(
        poll1(c, libc::POLLIN, 10_000) & libc::POLLIN != 0,
        "no data"
    );
    let fails = |what: &str, r: c_int, want: c_int| -> R {
        let e = errno();
        check!(
            r == -1 && e == want,
            "{what}: {r}, {} (want {})",
            err_name(e),
            err_name(want)
        );
        Ok(())
    };
    // A page with a pollfd at its very end; the next page is not mapped.
    // SAFETY: mmap/munmap of our own pages.
    let page = unsafe {
        let p = libc::mmap(
            std::ptr::null_mut(),
            8192,
            libc::PROT_READ | libc::PROT_WRITE,
            libc::MAP_PRIVATE | libc::MAP_ANONYMOUS,
            -1,
            0,
        );
        check!(p != libc::MAP_FAILED, "mmap");
        libc::munmap(p.cast::<u8>().add(4096).cast(), 4096);
        p.cast::<u8>()
    };
    // SAFETY: the page after ours, which is not mapped: any access faults.
    let unmapped = unsafe { page.add(4096) };
    // SAFETY: the last pollfd-sized slot of our mapped page.
    let last =
        unsafe { page.add(4096 - std::mem::size_of::<libc::pollfd>()) }.cast::<libc::pollfd>();
    // SAFETY: writing our own mapped pollfd.
    unsafe {
        last.write(libc::pollfd {
            fd: c,
            events: libc::POLLIN,
            revents: 0,
        })
    };
    let mut one = libc::pollfd {
        fd: c,
        events: libc::POLLIN,
        revents: 0,
    };
    // SAFETY: each call below passes what the kernel must refuse; the
    // valid parts are our own structures.
    unsafe {
        fails(
            "poll nfds UINT_MAX",
            libc::poll(&mut one, u32::MAX as libc::nfds_t, 0),
            libc::EINVAL,
        )?;
        let ts = libc::timespec {
            tv_sec: 0,
            tv_nsec: 0,
        };
        fails(
            "ppoll nfds UINT_MAX",
            libc::ppoll(&mut one, u32::MAX as libc::nfds_t, &ts, std::ptr::null()),
            libc::EINVAL,
        )?;
        fails("poll past the array", libc::poll(last, 2, 0), libc::EFAULT)?;
        fails(
            "ppoll past the array",
            libc::ppoll(last, 2, &ts, std::ptr::null()),
            libc::EFAULT,
        )?;
        let bad_ts = libc::timespec {
            tv_sec: 0,
            tv_nsec: 2_000_000_000,
        };
        fails(
            "ppoll bad timespec",
            libc::ppoll(&mut one, 1, &bad_ts, std::ptr::null()),
            libc::EINVAL,
        )?;
        // (A timespec glibc cannot read crashes glibc's own ppoll, which
        // copies it before the system call: not a case for us either.)
        let mut r: libc::fd_set = std::mem::zeroed();
        libc::FD_SET(c, &mut r);
        let mut tv = libc::timeval {
            tv_sec: 0,
            tv_usec: 0,
        };
        fails(
            "select bad set",
            libc::select(
                c + 1,
                &mut r,
                unmapped.cast::<libc::fd_set>(),
                std::ptr::null_mut(),
                &mut tv,
            ),
            libc::EFAULT,
        )?;
        fails(
            "select nfds -1",
            libc::select(
                -1,
                &mut r,
                std::ptr::null_mut(),
                std::ptr::null_mut(),
                &mut tv,
            ),
            libc::EINVAL,
        )?;
        let mut bad_tv = libc::timeval {
            tv_sec: 0,
            tv_usec: -1,
        };
        fails(
            "select bad timeval",
            libc::select(
                c + 1,
                &mut r,
                std::ptr::null_mut(),
                std::ptr::null_mut(),
                &mut bad_tv,
            ),
            libc::EINVAL,
        )?;
        let ep = libc::epoll_create1(0);
        epoll_ctl(ep, libc::EPOLL_CTL_ADD, c, libc::EPOLLIN as u32)?;
        let mut ev = libc::epoll_event { events: 0, u64: 0 };
        fails(
            "epoll_wait maxevents 0",
            libc::epoll_wait(ep, &mut ev, 0, 0),
            libc::EINVAL,
        )?;
        fails(
            "epoll_wait maxevents too large",
            libc::epoll_wait(ep, &mut ev, i32::MAX, 0),
            libc::EINVAL,
        )?;
        fails(
            "epoll_wait bad array",
            libc::epoll_wait(ep, unmapped.cast::<libc::epoll_event>(), 1, 0),
            libc::EFAULT,
        )?;
        // A huge but allowed maxevents with one event ready: one event.
        // (The kernel checks that the whole array would lie in user space:
        // an array on the heap, low in it, not on the stack near its top.)
        let most = i32::MAX / std::mem::size_of::<libc::epoll_event>() as i32;
        let mut on_heap = Box::new(libc::epoll_event { events: 0, u64: 0 });
        let n = libc::epoll_wait(ep, &mut *on_heap, most, 0);
        check!(
            n == 1,
            "epoll_wait with maxevents {most} gave {n} ({})",
            err_name(errno())
        );
        fails(
            "epoll_ctl ADD without an event",
            libc::epoll_ctl(ep, libc::EPOLL_CTL_ADD, c, std::ptr::null_mut()),
            libc::EFAULT,
        )?;
        close(ep);
        // Data calls with buffers, arrays and lengths the kernel refuses;
        // the pending "ready" must stay unread.
        let bad = unmapped.cast::<c_void>();
        fails(
            "recv into an unmapped page",
            libc::recv(c, bad, 10, 0) as c_int,
            libc::EFAULT,
        )?;
        fails(
            "recv into NULL",
            libc::recv(c, std::ptr::null_mut(), 10, 0) as c_int,
            libc::EFAULT,
        )?;
        fails(
            "read into an unmapped page",
            libc::read(c, bad, 10) as c_int,
            libc::EFAULT,
        )?;
        fails(
            "send from an unmapped page",
            libc::send(c, bad, 10, 0) as c_int,
            libc::EFAULT,
        )?;
        fails(
            "send from NULL",
            libc::send(c, std::ptr::null(), 10, 0) as c_int,
            libc::EFAULT,
        )?;
        fails(
            "write from an unmapped page",
            libc::write(c, bad, 10) as c_int,
            libc::EFAULT,
        )?;
        let mut byte = [0u8; 4];
        let iov = libc::iovec {
            iov_base: byte.as_mut_ptr().cast(),
            iov_len: 4,
        };
        let bad_iov = unmapped.cast::<libc::iovec>();
        fails(
            "writev a bad iovec array",
            libc::writev(c, bad_iov, 1) as c_int,
            libc::EFAULT,
        )?;
        fails(
            "writev -1 iovecs",
            libc::writev(c, &iov, -1) as c_int,
            libc::EINVAL,
        )?;
        fails(
            "writev 1025 iovecs",
            libc::writev(c, &iov, 1025) as c_int,
            libc::EINVAL,
        )?;
        fails(
            "readv a bad iovec array",
            libc::readv(c, bad_iov, 1) as c_int,
            libc::EFAULT,
        )?;
        let to_bad = libc::iovec {
            iov_base: bad,
            iov_len: 10,
        };
        fails(
            "readv into an unmapped page",
            libc::readv(c, &to_bad, 1) as c_int,
            libc::EFAULT,
        )?;
        fails(
            "sendmsg a bad msghdr",
            libc::sendmsg(c, unmapped.cast::<libc::msghdr>(), 0) as c_int,
            libc::EFAULT,
        )?;
        let mut m: libc::msghdr = std::mem::zeroed();
        m.msg_iov = (&raw const to_bad).cast_mut();
        m.msg_iovlen = 1;
        fails(
            "recvmsg into an unmapped page",
            libc::recvmsg(c, &mut m, 0) as c_int,
            libc::EFAULT,
        )?;
        fails(
            "FIONREAD into NULL",
            libc::ioctl(c, libc::FIONREAD, std::ptr::null_mut::<c_int>()),
            libc::EFAULT,
        )?;
        let mut v: c_int = 0;
        fails(
            "SO_ERROR with a bad length",
            libc::getsockopt(
                c,
                libc::SOL_SOCKET,
                libc::SO_ERROR,
                (&raw mut v).cast(),
                unmapped.cast::<libc::socklen_t>(),
            ),
            libc::EFAULT,
        )?;
        let mut alen = 128 as libc::socklen_t;
        fails(
            "getpeername into an unmapped page",
            libc::getpeername(c, unmapped.cast::<libc::sockaddr>(), &mut alen),
            libc::EFAULT,
        )?;
        let mut sa: libc::sockaddr_storage = std::mem::zeroed();
        let mut neg = -1i32 as libc::socklen_t;
        fails(
            "getpeername with a negative length",
            libc::getpeername(c, (&raw mut sa).cast(), &mut neg),
            libc::EINVAL,
        )?;
        // Still usable, errno kept by successful calls.
        *libc::__errno_location() = 4321;
        let n = libc::poll(&mut one, 1, 0);
        check!(
            n == 1 && errno() == 4321,
            "poll gave {n}, errno {}",
            err_name(errno())
        );
        libc::munmap(page.cast(), 4096);
    }
    let got = recv_exact(c, 5)?;
    check!(got == b"ready", "got {got:?}");
    close(c);
    Ok(())
}

/// CPU time this process has used (user and system).
/// Connections that Linux delivers on this host pair at once or stay TCP
/// at once. The server connects to its own listener and accepts, in one
/// thread, 20 times: nothing may wait for an answer only its own later
/// accept() could give (20 x pair_timeout). Then the client connects to
/// 0.0.0.0:PORT, which Linux delivers to the loopback listener: under
/// azsdp it pairs like any local connection (the test checks the logs).
fn local_pairs(server: bool, port: u16) -> R {
    const PAIRS: usize = 20;
    let want = data(100_000, 9);
    if server {
        // Our own pairs on a listener of their own (an ephemeral port),
        // before the client is told to connect to the other.
        let own = tcp_socket()?;
        let mut a = addr(0);
        let mut alen = std::mem::size_of_val(&a) as libc::socklen_t;
        // SAFETY: bind/listen/getsockname on our socket and address.
        unsafe {
            check!(
                libc::bind(own, (&raw const a).cast(), alen) == 0 && libc::listen(own, 4) == 0,
                "own listener: {}",
                err_name(errno())
            );
            libc::getsockname(own, (&raw mut a).cast(), &mut alen);
        }
        let own_port = u16::from_be(a.sin_port);
        let t = Instant::now();
        for i in 0..PAIRS {
            // (Our own accept answers the pair; one thread makes both
            // ends' calls, so neither waits for the other's join.)
            let c = connect_nowait(addr(own_port))?;
            let a = accept_nowait(own)?;
            let b = data(1000, i as u32);
            send_all(c, &b)?;
            check!(recv_exact(a, b.len())? == b, "pair {i}: bytes differ");
            send_all(a, &b)?;
            check!(recv_exact(c, b.len())? == b, "pair {i}: reply differs");
            close(c);
            close(a);
        }
        check!(
            t.elapsed() < Duration::from_secs(5),
            "{PAIRS} connect+accept pairs in one thread took {:?}: a connect waited for an accept only it could make",
            t.elapsed()
        );
        close(own);
        let l = listen_on(port)?;
        let c = accept_one(l)?;
        check!(
            recv_exact(c, want.len())? == want,
            "0.0.0.0 client: bytes differ"
        );
        send_all(c, b"done")?;
        expect_eof(c)?;
        close(c);
    } else {
        let mut a = addr(port);
        a.sin_addr.s_addr = u32::from(std::net::Ipv4Addr::UNSPECIFIED).to_be();
        let c = connect_addr(a)?;
        send_all(c, &want)?;
        check!(recv_exact(c, 4)? == b"done", "reply");
        close(c);
    }
    Ok(())
}

fn cpu_time() -> Duration {
    // SAFETY: getrusage(2) into our own struct.
    let ru = unsafe {
        let mut ru: libc::rusage = std::mem::zeroed();
        libc::getrusage(libc::RUSAGE_SELF, &mut ru);
        ru
    };
    let t = |tv: libc::timeval| Duration::new(tv.tv_sec as u64, tv.tv_usec as u32 * 1000);
    t(ru.ru_utime) + t(ru.ru_stime)
}

/// Connections whose peer closed (its process lives on) and that this
/// side leaves open: they must cost nothing while idle (a progress thread
/// that never slept again once the peer had closed used a core each).
fn idle_cpu(server: bool, port: u16) -> R {
    const CONNS: usize = 8;
    if !server {
        // (Each connection joins and carries its byte before the next is
        // made: the server accepts one at a time.)
        let mut cs = Vec::new();
        for _ in 0..CONNS {
            let c = connect_to(port)?;
            send_all(c, b"x")?;
            cs.push(c);
        }
        for c in cs {
            close(c);
        }
        sleep_ms(4000);
        return Ok(());
    }
    let l = listen_on(port)?;
    let mut cs = Vec::new();
    for _ in 0..CONNS {
        let c = accept_one(l)?;
        check!(recv_exact(c, 1)? == b"x", "data");
        cs.push(c);
    }
    for &c in &cs {
        check!(
            poll1(c, libc::POLLRDHUP, 5000) & libc::POLLRDHUP != 0,
            "the peer's close was not seen"
        );
    }
    sleep_ms(300);
    let (t0, c0) = (Instant::now(), cpu_time());
    sleep_ms(2000);
    let (wall, cpu) = (t0.elapsed(), cpu_time() - c0);
    check!(
        cpu < Duration::from_millis(200),
        "{CONNS} idle connections whose peer closed used {cpu:?} of CPU in {wall:?}"
    );
    for c in cs {
        expect_eof(c)?;
        close(c);
    }
    Ok(())
}

/// A thousand forks while connections open, move and close in another
/// thread (and the shim's stats thread publishes): every child, which
/// makes a socket, closes what it inherited and exits through the exit
/// handlers, must end. A lock inherited held would hang it for ever.
fn fork_stress(server: bool, port: u16) -> R {
    const FORKS: usize = 1000;
    if !server {
        let control = connect_to(port)?;
        set_nonblocking(control);
        let mut rounds = 0u64;
        loop {
            let mut b = [0u8; 1];
            let n = recv_some(control, &mut b, 0);
            if n == 0 || (n < 0 && errno() != libc::EAGAIN) {
                break;
            }
            let round = || -> R {
                let c = connect_to(port)?;
                send_all(c, b"p")?;
                let got = recv_exact(c, 1);
                close(c);
                let got = got?;
                check!(got == b"p", "echo {got:?}");
                Ok(())
            };
            if let Err(e) = round() {
                // Cut short by the server stopping: fine; otherwise not.
                let mut b = [0u8; 1];
                if recv_some(control, &mut b, 0) != 0 {
                    sleep_ms(100);
                    if recv_some(control, &mut b, 0) != 0 {
                        return Err(e);
                    }
                }
                break;
            }
            rounds += 1;
        }
        check!(rounds > 0, "no connection moved");
        close(control);
        return Ok(());
    }
    let l = listen_on(port)?;
    let control = accept_one(l)?;
    let stop = std::sync::Arc::new(std::sync::atomic::AtomicBool::new(false));
    let st = std::sync::Arc::clone(&stop);
    let churn = std::thread::spawn(move || {
        let mut served = 0u64;
        while !st.load(Ordering::SeqCst) {
            if poll1(l, libc::POLLIN, 100) & libc::POLLIN == 0 {
                continue;
            }
            let Ok(c) = accept_one(l) else { continue };
            // The client may leave mid-connection when told to stop.
            if let Ok(got) = recv_exact(c, 1)
                && send_all(c, &got).is_ok()
                && expect_eof(c).is_ok()
            {
                served += 1;
            }
            close(c);
        }
        served
    });
    let mut hung = 0;
    for i in 0..FORKS {
        // SAFETY: fork(2); the child only makes system calls through libc
        // (interposed as the program's are) and leaves with exit(3).
        let pid = unsafe { libc::fork() };
        check!(pid >= 0, "fork {i}: {}", err_name(errno()));
        if pid == 0 {
            // SAFETY: the child's own descriptors, then exit (which runs
            // the exit handlers, the shim's included).
            unsafe {
                let s = libc::socket(libc::AF_INET, libc::SOCK_STREAM, 0);
                libc::close(s);
                libc::close(control);
                let mut p = libc::pollfd {
                    fd: l,
                    events: libc::POLLIN,
                    revents: 0,
                };
                libc::poll(&mut p, 1, 0);
                libc::exit(0);
            }
        }
        let t0 = Instant::now();
        loop {
            let mut status = 0;
            // SAFETY: waitpid on our own child.
            let r = unsafe { libc::waitpid(pid, &mut status, libc::WNOHANG) };
            if r == pid {
                check!(
                    libc::WIFEXITED(status) && libc::WEXITSTATUS(status) == 0,
                    "child {i} ended with status {status:#x}"
                );
                break;
            }
            if t0.elapsed() > Duration::from_secs(20) {
                hung += 1;
                // SAFETY: kill and reap our own hung child.
                unsafe {
                    libc::kill(pid, libc::SIGKILL);
                    libc::waitpid(pid, &mut status, 0);
                }
                break;
            }
            sleep_ms(1);
        }
    }
    stop.store(true, Ordering::SeqCst);
    close(control);
    let served = churn
        .join()
        .map_err(|_| "churn thread panicked".to_string())?;
    check!(served > 0, "no connection was served while forking");
    check!(hung == 0, "{hung} of {FORKS} forked children hung");
    Ok(())
}

fn main() {
    let args: Vec<String> = std::env::args().collect();
    let usage = "usage: azsdp-sockcheck SCENARIO server|client PORT";
    if args.get(1).is_some_and(|a| a == "exec-probe") {
        let num = |i: usize| args.get(i).and_then(|a| a.parse::<usize>().ok());
        let (Some(fd), Some(skip), Some(then_exec)) = (num(2), num(3), num(4)) else {
            eprintln!("usage: azsdp-sockcheck exec-probe FD SKIP THEN_EXEC");
            std::process::exit(2);
        };
        if let Err(e) = exec_probe(fd as c_int, skip, then_exec) {
            eprintln!("azsdp-sockcheck exec-probe: {e}");
            std::process::exit(1);
        }
        return;
    }
    let (Some(scenario), Some(role), Some(port)) = (
        args.get(1),
        args.get(2),
        args.get(3).and_then(|p| p.parse::<u16>().ok()),
    ) else {
        eprintln!("{usage}");
        std::process::exit(2);
    };

    let server = role == "server";
    let r = match scenario.as_str() {
        "basic" => basic(server, port),
        "nonblock" => nonblock(server, port),
        "halfclose" => halfclose(server, port),
        "sigpipe" => sigpipe(server, port),
        "readiness" => readiness(server, port),
        "threads" => threads(server, port),
        "signals" => signals(server, port),
        "descriptors" => descriptors(server, port),
        "prefork" => prefork(server, port),
        "exec" => exec(server, port, Exec::Execve { keep_shim: true }),
        "exec-bare" => exec(server, port, Exec::Execve { keep_shim: false }),
        "exec-l" => exec(server, port, Exec::Execl),
        "spawn" => exec(server, port, Exec::Spawn),
        "system" => exec(server, port, Exec::System),
        "exec-twice" => exec(server, port, Exec::Twice),
        "exec-failing" => exec(server, port, Exec::Failing),
        "exec-late-close" => exec(server, port, Exec::LateClose),
        "stray-bytes" => stray_bytes(server, port),
        "runner-killed" => runner_killed(server, port),
        "fork-both-use" => fork_both_use(server, port),
        "fork-setuid" => fork_setuid(server, port),
        "fork-split" => fork_split(server, port, false),
        "fork-split-reader-runs" => fork_split(server, port, true),
        "fork-idle-holder" => fork_idle_holder(server, port),
        "fork-late-child" => fork_late_child(server, port),
        "close-range" => close_range_scenario(server, port),
        "killed-idle" => killed_idle(server, port),
        "exit-after-send" => exit_after_send(server, port, false),
        "_exit-after-send" => exit_after_send(server, port, true),
        "glibc-names" => glibc_names(server, port),
        "batch-calls" => batch_calls(server, port),
        "fork-child-serves" => fork_after_accept(server, port, true),
        "fork-parent-serves" => fork_after_accept(server, port, false),
        "names" => names(server, port),
        "eintr-waits" => eintr_waits(server, port),
        "bad-args" => bad_args(server, port),
        "fork-stress" => fork_stress(server, port),
        "local-pairs" => local_pairs(server, port),
        "idle-cpu" => idle_cpu(server, port),
        "dead-peer-blocking" => dead_peer::run(server, port, dead_peer::Style::Blocking),
        "dead-peer-poll" => dead_peer::run(server, port, dead_peer::Style::Poll),
        "dead-peer-select" => dead_peer::run(server, port, dead_peer::Style::Select),
        "dead-peer-epoll" => dead_peer::run(server, port, dead_peer::Style::Epoll),
        _ => Err(format!("unknown scenario {scenario}; {usage}")),
    };
    if let Err(e) = r {
        eprintln!("azsdp-sockcheck {scenario} {role}: {e}");
        std::process::exit(1);
    }
}
