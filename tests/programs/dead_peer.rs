//! `dead-peer-{blocking,poll,select,epoll}`: a peer that dies or leaves
//! while this side waits in a call, as TCP reports it.
//!
//! Each case runs in a fresh pair of processes: the server forks a child
//! that accepts the connection and does the waiting; the client forks a
//! "victim" that connects, plays its part and then dies (SIGKILL) or
//! closes. The victim writes the moment of its death to its parent, which
//! passes it to the server over a control connection. The server then
//! checks that its child
//! - woke within a second of that moment, with what TCP gives (EOF, or
//!   ECONNRESET / EPIPE after a reset), and
//! - got out of `close()` and `exit()` within a second too, whatever it
//!   still had in flight to the departed peer.
//!
//! The waiting style is the scenario's: blocking calls, or non-blocking
//! ones with `poll`, `select` or `epoll_wait`.

use super::*;

/// How the server's child waits.
#[derive(Clone, Copy, Debug, PartialEq)]
pub enum Style {
    Blocking,
    Poll,
    Select,
    Epoll,
}

/// What the victim does, and what the server's child waits in.
#[derive(Clone, Copy, Debug)]
enum Case {
    /// The victim read everything and is killed while we wait to read:
    /// EOF.
    KilledIdle,
    /// Killed with data of ours unread (some copied, some zero-copy in
    /// flight) while we wait to read: a reset.
    KilledUnread,
    /// Killed while we are blocked sending `chunk`-byte pieces it never
    /// reads: the send fails.
    KilledWhileSending { chunk: usize },
    /// Alive, but closes with data of ours unread while we keep sending:
    /// a later send fails.
    ClosedWhileSending { chunk: usize },
    /// Dies or closes while we have copied data queued for it, and we
    /// close and exit without another call: neither waits for it.
    LeftBeforeOurClose { killed: bool },
}

const CASES: [Case; 8] = [
    Case::KilledIdle,
    Case::KilledUnread,
    Case::KilledWhileSending { chunk: 1 << 20 },
    Case::KilledWhileSending { chunk: 16 << 10 },
    Case::ClosedWhileSending { chunk: 1 << 20 },
    Case::ClosedWhileSending { chunk: 16 << 10 },
    Case::LeftBeforeOurClose { killed: true },
    Case::LeftBeforeOurClose { killed: false },
];

/// The longest any step may take after the peer's departure.
const NOTICE: Duration = Duration::from_secs(1);
/// How long the victim waits before it goes, for the server to be waiting.
const SETTLE_MS: u64 = 200;

fn mono_ns() -> u64 {
    let mut ts = libc::timespec {
        tv_sec: 0,
        tv_nsec: 0,
    };
    // SAFETY: clock_gettime(2) into our own structure.
    unsafe { libc::clock_gettime(libc::CLOCK_MONOTONIC, &mut ts) };
    ts.tv_sec as u64 * 1_000_000_000 + ts.tv_nsec as u64
}

fn fork_or_fail() -> Result<libc::pid_t, String> {
    // SAFETY: fork(2); children leave with _exit.
    let pid = unsafe { libc::fork() };
    check!(pid >= 0, "fork: {}", err_name(errno()));
    Ok(pid)
}

fn pipe_pair() -> Result<(c_int, c_int), String> {
    let mut p = [0 as c_int; 2];
    // SAFETY: pipe(2) into our own array.
    let r = unsafe { libc::pipe(p.as_mut_ptr()) };
    check!(r == 0, "pipe: {}", err_name(errno()));
    Ok((p[0], p[1]))
}

fn write_fd(fd: c_int, b: &[u8]) {
    // SAFETY: write(2) from our own buffer.
    unsafe { libc::write(fd, b.as_ptr().cast(), b.len()) };
}

fn read_to_end(fd: c_int) -> String {
    let mut out = Vec::new();
    let mut b = [0u8; 512];
    loop {
        // SAFETY: read(2) into our own buffer.
        let n = unsafe { libc::read(fd, b.as_mut_ptr().cast(), b.len()) };
        if n <= 0 {
            break;
        }
        out.extend_from_slice(&b[..n as usize]);
    }
    String::from_utf8_lossy(&out).into_owned()
}

/// Reap `pid`, which must leave with status 0 (or be killed by SIGKILL if
/// `killed`).
fn reap(pid: libc::pid_t, killed: bool) -> R {
    let mut status = 0;
    // SAFETY: waitpid on our own child.
    let r = unsafe { libc::waitpid(pid, &mut status, 0) };
    check!(r == pid, "waitpid: {}", err_name(errno()));
    if killed {
        check!(
            libc::WIFSIGNALED(status) && libc::WTERMSIG(status) == libc::SIGKILL,
            "the victim ended with status {status:#x}"
        );
    } else {
        check!(
            libc::WIFEXITED(status) && libc::WEXITSTATUS(status) == 0,
            "the child ended with status {status:#x}"
        );
    }
    Ok(())
}

/// Run `f` in a forked child that reports to the parent through a pipe
/// (`ok`, or what failed) and leaves with `_exit`: returns its pid and the
/// pipe's read end. The child stamps, as its last line, when it started
/// to exit.
fn child(f: impl FnOnce(c_int) -> R) -> Result<(libc::pid_t, c_int), String> {
    let (rd, wr) = pipe_pair()?;
    let pid = fork_or_fail()?;
    if pid == 0 {
        close(rd);
        let r = f(wr);
        let line = match r {
            Ok(()) => format!("ok\nexit {}\n", mono_ns()),
            Err(e) => format!("{e}\n"),
        };
        write_fd(wr, line.as_bytes());
        close(wr);
        // exit(3), not _exit: the exit handlers (the shim's included) run,
        // as they do when a real server's worker leaves.
        std::process::exit(0);
    }
    close(wr);
    Ok((pid, rd))
}

/// Wait until `fd` is ready for `events` in the given style (a no-op for
/// blocking calls). Returns what the wait reported.
fn wait_for(style: Style, fd: c_int, events: i16, ms: c_int) -> Result<i16, String> {
    match style {
        Style::Blocking => Ok(events),
        Style::Poll => {
            let r = poll1(fd, events, ms);
            check!(r != 0, "poll: nothing within {ms} ms");
            Ok(r)
        }
        Style::Select => {
            // SAFETY: fd_sets and timeval on our stack, fd < FD_SETSIZE.
            unsafe {
                let mut rd: libc::fd_set = std::mem::zeroed();
                let mut wr: libc::fd_set = std::mem::zeroed();
                let mut ex: libc::fd_set = std::mem::zeroed();
                if events & libc::POLLIN != 0 {
                    libc::FD_SET(fd, &mut rd);
                }
                if events & libc::POLLOUT != 0 {
                    libc::FD_SET(fd, &mut wr);
                }
                libc::FD_SET(fd, &mut ex);
                let mut tv = libc::timeval {
                    tv_sec: libc::time_t::from(ms / 1000),
                    tv_usec: libc::suseconds_t::from(ms % 1000) * 1000,
                };
                let n = libc::select(fd + 1, &mut rd, &mut wr, &mut ex, &mut tv);
                check!(n > 0, "select: {n} ({})", err_name(errno()));
                let mut r = 0;
                if libc::FD_ISSET(fd, &rd) {
                    r |= libc::POLLIN;
                }
                if libc::FD_ISSET(fd, &wr) {
                    r |= libc::POLLOUT;
                }
                Ok(r)
            }
        }
        Style::Epoll => {
            // SAFETY: epoll_create1(2).
            let ep = unsafe { libc::epoll_create1(0) };
            check!(ep >= 0, "epoll_create1: {}", err_name(errno()));
            let mut want = libc::EPOLLRDHUP as u32;
            if events & libc::POLLIN != 0 {
                want |= libc::EPOLLIN as u32;
            }
            if events & libc::POLLOUT != 0 {
                want |= libc::EPOLLOUT as u32;
            }
            let r = epoll_ctl(ep, libc::EPOLL_CTL_ADD, fd, want)
                .and_then(|()| epoll_wait1(ep, ms).ok_or(format!("epoll: nothing within {ms} ms")));
            close(ep);
            // EPOLLIN/OUT/ERR/HUP have poll's values.
            Ok(r? as i16)
        }
    }
}

/// The server's child: accepts the case's connection and waits in it.
/// Returns when it woke (CLOCK_MONOTONIC ns).
fn serve(case: Case, style: Style, l: c_int) -> Result<u64, String> {
    let c = accept_one(l)?;
    close(l);
    if style != Style::Blocking {
        set_nonblocking(c);
    }
    let send = |b: &[u8]| -> isize {
        // SAFETY: send(2) from our own buffer; no SIGPIPE.
        unsafe { libc::send(c, b.as_ptr().cast(), b.len(), libc::MSG_NOSIGNAL) }
    };
    let woke = match case {
        Case::KilledIdle | Case::KilledUnread => {
            check!(send(b"g") == 1, "send go: {}", err_name(errno()));
            if matches!(case, Case::KilledUnread) {
                // Unread by the victim: copied, then zero-copy.
                for b in [data(1000, 1), data(100_000, 2)] {
                    let mut at = 0;
                    while at < b.len() {
                        let n = send(&b[at..]);
                        if n < 0 && errno() == libc::EAGAIN {
                            wait_for(style, c, libc::POLLOUT, 5000)?;
                            continue;
                        }
                        check!(n > 0, "send unread data: {}", err_name(errno()));
                        at += n as usize;
                    }
                }
            }
            let revents = wait_for(style, c, libc::POLLIN, 5000)?;
            let mut b = [0u8; 64];
            let n = recv_some(c, &mut b, 0);
            let woke = mono_ns();
            let e = errno();
            if matches!(case, Case::KilledIdle) {
                check!(
                    n == 0,
                    "expected EOF, recv gave {n} ({}), revents {revents:#x}",
                    err_name(e)
                );
                check!(revents & libc::POLLIN != 0, "revents {revents:#x}");
            } else {
                check!(
                    n < 0 && e == libc::ECONNRESET,
                    "expected ECONNRESET, recv gave {n} ({}), revents {revents:#x}",
                    err_name(e)
                );
                check!(
                    style != Style::Poll || revents & (libc::POLLERR | libc::POLLHUP) != 0,
                    "revents {revents:#x}"
                );
                // Then sending fails too.
                let n = send(b"x");
                let e = errno();
                check!(
                    n < 0 && (e == libc::EPIPE || e == libc::ECONNRESET),
                    "send after the reset gave {n} ({})",
                    err_name(e)
                );
            }
            woke
        }
        Case::KilledWhileSending { chunk } | Case::ClosedWhileSending { chunk } => {
            check!(send(b"g") == 1, "send go: {}", err_name(errno()));
            let b = data(chunk, 3);
            let t0 = Instant::now();
            loop {
                check!(
                    t0.elapsed() < Duration::from_secs(20),
                    "sends still succeed 20 s on"
                );
                let n = send(&b);
                if n > 0 {
                    continue;
                }
                let e = errno();
                if n < 0 && e == libc::EAGAIN {
                    // Readiness after the departure: writable (the send
                    // then fails) or an error.
                    wait_for(style, c, libc::POLLOUT, 5000)?;
                    continue;
                }
                let woke = mono_ns();
                check!(
                    n < 0 && (e == libc::EPIPE || e == libc::ECONNRESET),
                    "send gave {n} ({})",
                    err_name(e)
                );
                break woke;
            }
        }
        Case::LeftBeforeOurClose { .. } => {
            check!(send(b"g") == 1, "send go: {}", err_name(errno()));
            // Fill what the connection takes without blocking (16 KiB
            // pieces: the copied path), then let the peer go.
            let b = data(16 << 10, 4);
            for _ in 0..64 {
                // SAFETY: send(2) from our own buffer, never blocking.
                let n = unsafe {
                    libc::send(
                        c,
                        b.as_ptr().cast(),
                        b.len(),
                        libc::MSG_NOSIGNAL | libc::MSG_DONTWAIT,
                    )
                };
                if n < 0 {
                    break;
                }
            }
            sleep_ms(2 * SETTLE_MS);
            close(c);
            return Ok(mono_ns());
        }
    };
    close(c);
    Ok(woke)
}

/// The client's victim: connects, plays its part, then dies or closes.
/// Writes the moment it went to `report`.
fn victim(case: Case, port: u16, report: c_int) -> R {
    let c = connect_to(port)?;
    check!(recv_exact(c, 1)? == b"g", "go");
    sleep_ms(SETTLE_MS);
    write_fd(report, &mono_ns().to_le_bytes());
    match case {
        Case::KilledIdle
        | Case::KilledUnread
        | Case::KilledWhileSending { .. }
        | Case::LeftBeforeOurClose { killed: true } => {
            // SAFETY: kill(2) of ourselves.
            unsafe { libc::kill(libc::getpid(), libc::SIGKILL) };
            unreachable!("SIGKILL returned");
        }
        Case::ClosedWhileSending { .. } | Case::LeftBeforeOurClose { killed: false } => {
            close(c);
            // Stay alive while the server notices.
            sleep_ms(2 * NOTICE.as_millis() as u64);
        }
    }
    Ok(())
}

pub fn run(server: bool, port: u16, style: Style) -> R {
    if server {
        let l = listen_on(port)?;
        let control = accept_one(l)?;
        for case in CASES {
            let what = format!("{case:?} ({style:?})");
            let (pid, rd) = child(|wr| {
                close(control);
                let woke = serve(case, style, l)?;
                write_fd(wr, format!("woke {woke}\n").as_bytes());
                Ok(())
            })?;
            let report = read_to_end(rd);
            close(rd);
            reap(pid, false)?;
            let reaped = mono_ns();
            let went = u64::from_le_bytes(
                recv_exact(control, 8)?
                    .try_into()
                    .map_err(|_| "8 bytes".to_string())?,
            );
            let field = |k: &str| -> Option<u64> {
                report
                    .lines()
                    .find_map(|l| l.strip_prefix(k)?.trim().parse().ok())
            };
            let (Some(woke), Some(exit)) = (field("woke "), field("exit ")) else {
                return Err(format!("{what}: {report}"));
            };
            let after = Duration::from_nanos(woke.saturating_sub(went));
            check!(
                after < NOTICE,
                "{what}: the server woke {after:?} after its peer went"
            );
            let exiting = Duration::from_nanos(reaped.saturating_sub(exit));
            eprintln!("{what}: woke {after:?} after the peer went, exited in {exiting:?}");
            check!(
                exiting < NOTICE,
                "{what}: the server's child took {exiting:?} to exit"
            );
            send_all(control, b"n")?;
        }
        close(control);
    } else {
        let control = connect_to(port)?;
        for case in CASES {
            let (rd, wr) = pipe_pair()?;
            let pid = fork_or_fail()?;
            if pid == 0 {
                close(control);
                close(rd);
                if let Err(e) = victim(case, port, wr) {
                    eprintln!("victim {case:?}: {e}");
                    // SAFETY: leave the child at once.
                    unsafe { libc::_exit(1) };
                }
                std::process::exit(0);
            }
            close(wr);
            let killed = !matches!(
                case,
                Case::ClosedWhileSending { .. } | Case::LeftBeforeOurClose { killed: false }
            );
            reap(pid, killed)?;
            let mut went = [0u8; 8];
            // SAFETY: read(2) into our own buffer.
            let n = unsafe { libc::read(rd, went.as_mut_ptr().cast(), 8) };
            close(rd);
            check!(n == 8, "the victim did not say when it went");
            send_all(control, &went)?;
            check!(recv_exact(control, 1)? == b"n", "next");
        }
        close(control);
    }
    Ok(())
}
