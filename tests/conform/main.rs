//! `azsdp-conform PORT`: the conformance suite. Every interposed call, on
//! connected sockets, with valid arguments, with the errors their man pages
//! list, and under signals, in an ordinary libc program that knows nothing
//! of azsdp. It prints a transcript, one line per call: what was called,
//! what it returned, errno (by name) when it failed, whether it kept errno
//! when it succeeded, and what it did (bytes and their checksum, readiness
//! bits, flags, lengths).
//!
//! The test (`tests/programs/conform.rs`) runs it on kernel TCP and under
//! `azsdp run` and compares the transcripts line by line: every line must
//! match, except the few differences `docs/conformance.md` lists.
//!
//! The peer of each connection is a second process (forked first, before
//! any socket exists), so that under azsdp the connections are upgraded. It
//! takes commands over a pipe ([`peer`]).

use std::io::Write as _;

use libc::c_int;

mod cases;
mod peer;

/// Where the transcript goes, and which case and step it is at.
#[allow(missing_debug_implementations)]
pub struct T {
    case: &'static str,
    step: u32,
    out: std::io::BufWriter<std::io::Stdout>,
}

/// A value of errno no call sets: a call that succeeds must leave it.
const SENTINEL: c_int = 7777;

pub fn errno() -> c_int {
    std::io::Error::last_os_error().raw_os_error().unwrap_or(0)
}

pub fn set_errno(e: c_int) {
    // SAFETY: the thread's errno.
    unsafe { *libc::__errno_location() = e };
}

/// errno by name, as the man pages say it.
pub fn ename(e: c_int) -> String {
    let n = match e {
        libc::EPERM => "EPERM",
        libc::ENOENT => "ENOENT",
        libc::EINTR => "EINTR",
        libc::EBADF => "EBADF",
        libc::EAGAIN => "EAGAIN",
        libc::EFAULT => "EFAULT",
        libc::EEXIST => "EEXIST",
        libc::EINVAL => "EINVAL",
        libc::ENOTTY => "ENOTTY",
        libc::EPIPE => "EPIPE",
        libc::ENOTSOCK => "ENOTSOCK",
        libc::EDESTADDRREQ => "EDESTADDRREQ",
        libc::EMSGSIZE => "EMSGSIZE",
        libc::ENOPROTOOPT => "ENOPROTOOPT",
        libc::EOPNOTSUPP => "EOPNOTSUPP",
        libc::EAFNOSUPPORT => "EAFNOSUPPORT",
        libc::EADDRINUSE => "EADDRINUSE",
        libc::ECONNABORTED => "ECONNABORTED",
        libc::ECONNRESET => "ECONNRESET",
        libc::EISCONN => "EISCONN",
        libc::ENOTCONN => "ENOTCONN",
        libc::ETIMEDOUT => "ETIMEDOUT",
        libc::ECONNREFUSED => "ECONNREFUSED",
        libc::EALREADY => "EALREADY",
        libc::EINPROGRESS => "EINPROGRESS",
        libc::ESPIPE => "ESPIPE",
        libc::ENOSYS => "ENOSYS",
        _ => return format!("errno {e}"),
    };
    n.to_string()
}

/// poll bits by name.
pub fn pbits(r: i16) -> String {
    let names = [
        (libc::POLLIN, "IN"),
        (libc::POLLPRI, "PRI"),
        (libc::POLLOUT, "OUT"),
        (libc::POLLERR, "ERR"),
        (libc::POLLHUP, "HUP"),
        (libc::POLLNVAL, "NVAL"),
        (libc::POLLRDHUP, "RDHUP"),
        (libc::POLLRDNORM, "RDNORM"),
        (libc::POLLWRNORM, "WRNORM"),
    ];
    let v: Vec<&str> = names
        .iter()
        .filter(|(b, _)| r & b != 0)
        .map(|(_, n)| *n)
        .collect();
    if v.is_empty() {
        "-".into()
    } else {
        v.join("|")
    }
}

/// A checksum of bytes (FNV-1a), for "the same data arrived".
pub fn crc(b: &[u8]) -> u32 {
    b.iter().fold(0x811c_9dc5u32, |h, &x| {
        (h ^ u32::from(x)).wrapping_mul(0x0100_0193)
    })
}

/// `len` bytes of pattern `seed` (the peer makes the same).
pub fn data(len: usize, seed: u32) -> Vec<u8> {
    (0..len as u32)
        .map(|i| {
            (i.wrapping_mul(2_654_435_761) ^ seed.wrapping_mul(0x9e37_79b9)).rotate_left(5) as u8
        })
        .collect()
}

impl T {
    /// Start case `name`.
    pub fn case(&mut self, name: &'static str) {
        self.case = name;
        self.step = 0;
    }

    /// Record a line.
    pub fn line(&mut self, what: &str, result: &str) {
        self.step += 1;
        let _ = writeln!(self.out, "{}.{:02} {what} = {result}", self.case, self.step);
    }

    /// Make `f`, a call returning a count (or -1 and errno), and record it
    /// with `what`; returns the call's result.
    pub fn call(&mut self, what: &str, f: impl FnOnce() -> isize) -> isize {
        set_errno(SENTINEL);
        let r = f();
        let e = errno();
        let result = if r < 0 {
            format!("-1 {}", ename(e))
        } else if e == SENTINEL {
            r.to_string()
        } else {
            format!("{r} (errno changed to {})", ename(e))
        };
        self.line(what, &result);
        set_errno(e);
        r
    }

    /// As [`T::call`], for a call returning a descriptor (recorded as
    /// `fd`: numbers may differ where azsdp holds descriptors of its own).
    pub fn call_fd(&mut self, what: &str, f: impl FnOnce() -> c_int) -> c_int {
        set_errno(SENTINEL);
        let r = f();
        let e = errno();
        let result = if r < 0 {
            format!("-1 {}", ename(e))
        } else if e == SENTINEL {
            "fd".to_string()
        } else {
            format!("fd (errno changed to {})", ename(e))
        };
        self.line(what, &result);
        set_errno(e);
        r
    }

    /// As [`T::call`], for a call returning an int.
    pub fn call_i(&mut self, what: &str, f: impl FnOnce() -> c_int) -> c_int {
        self.call(what, || f() as isize) as c_int
    }
}

pub fn close(fd: c_int) {
    // SAFETY: close(2) of our own descriptor.
    unsafe { libc::close(fd) };
}

/// `127.0.0.1:port`.
pub fn loopback(port: u16) -> libc::sockaddr_in {
    libc::sockaddr_in {
        sin_family: libc::AF_INET as libc::sa_family_t,
        sin_port: port.to_be(),
        sin_addr: libc::in_addr {
            s_addr: u32::from(std::net::Ipv4Addr::LOCALHOST).to_be(),
        },
        sin_zero: [0; 8],
    }
}

pub fn sleep_ms(ms: u64) {
    std::thread::sleep(std::time::Duration::from_millis(ms));
}

/// Wait (up to 5 s) until `fd` polls `events`; plain libc, not recorded.
pub fn wait_ready(fd: c_int, events: i16) -> i16 {
    let mut p = libc::pollfd {
        fd,
        events,
        revents: 0,
    };
    // SAFETY: one pollfd of ours.
    unsafe { libc::poll(&mut p, 1, 5000) };
    p.revents
}

fn main() {
    let args: Vec<String> = std::env::args().collect();
    let Some(port) = args.get(1).and_then(|p| p.parse::<u16>().ok()) else {
        eprintln!("usage: azsdp-conform PORT");
        std::process::exit(2);
    };
    // The peer first: a process with no socket of ours.
    let mut peer = peer::Peer::start(port);
    let mut t = T {
        case: "",
        step: 0,
        out: std::io::BufWriter::new(std::io::stdout()),
    };
    let r = cases::run(&mut t, &mut peer, port);
    let _ = t.out.flush();
    peer.finish();
    if let Err(e) = r {
        eprintln!("azsdp-conform: {e}");
        std::process::exit(1);
    }
}
