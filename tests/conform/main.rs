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

pub use azsdp_test_support::{close, errno, loopback, pattern as data, sleep_ms};
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
        self.record(what, f, |r| r.to_string())
    }

    /// As [`T::call`], for a call returning a descriptor (recorded as
    /// `fd`: numbers may differ where azsdp holds descriptors of its own).
    pub fn call_fd(&mut self, what: &str, f: impl FnOnce() -> c_int) -> c_int {
        self.record(what, || f() as isize, |_| "fd".to_string()) as c_int
    }

    /// Make `f` with errno at [`SENTINEL`] and record its result (`shown`
    /// if it succeeded), its errno if it failed, and whether it kept errno
    /// if it succeeded; leaves errno as the call did.
    fn record(
        &mut self,
        what: &str,
        f: impl FnOnce() -> isize,
        shown: impl FnOnce(isize) -> String,
    ) -> isize {
        set_errno(SENTINEL);
        let r = f();
        let e = errno();
        let result = if r < 0 {
            format!("-1 {}", ename(e))
        } else if e == SENTINEL {
            shown(r)
        } else {
            format!("{} (errno changed to {})", shown(r), ename(e))
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
