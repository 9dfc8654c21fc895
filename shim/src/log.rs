//! The shim's log: `AZSDP_LOG=stderr|off|FILE` (default stderr) and
//! `AZSDP_LOG_LEVEL=error|warn|info|debug` (default warn).
//!
//! Lines are formatted into a stack buffer and written with one `write(2)`
//! through libc's own `write`, so logging neither allocates nor passes
//! through the shim's hooks, and lines of concurrent threads do not mix.
//!
//! The log is the program's stderr by default, which may be a pipe nobody
//! reads any more or a file under `RLIMIT_FSIZE=0` (sshd's children): a
//! line must not raise SIGPIPE or SIGXFSZ there, which would kill the
//! program, nor change its errno ([`write_quietly`]).

use std::fmt::Write as _;
use std::sync::atomic::{AtomicI32, AtomicU8, Ordering};

pub use azsdp::config::logging::LogLevel as Level;

/// 0: not read yet.
static LEVEL: AtomicU8 = AtomicU8::new(0);
/// -2: not opened yet; -1: off.
static FD: AtomicI32 = AtomicI32::new(-2);

fn setup() {
    use azsdp::config::logging::{self, LogTarget};
    let var = |name: &str| std::env::var_os(name).map(|v| v.to_string_lossy().into_owned());
    let (level, bad_level) = match logging::log_level(var("AZSDP_LOG_LEVEL").as_deref()) {
        Ok(l) => (l, None),
        Err(e) => (Level::Warn, Some(e)),
    };
    let mut bad_file = None;
    let fd = match logging::log_target(var("AZSDP_LOG").as_deref()) {
        LogTarget::Stderr => 2,
        LogTarget::Off => -1,
        LogTarget::File(path) => {
            let c = std::ffi::CString::new(path.as_os_str().as_encoded_bytes()).ok();
            // SAFETY: open(2) of a NUL-terminated path.
            let fd = c.map_or(-1, |c| unsafe {
                libc::open(
                    c.as_ptr(),
                    libc::O_WRONLY | libc::O_CREAT | libc::O_APPEND | libc::O_CLOEXEC,
                    0o644,
                )
            });
            if fd < 0 {
                let e = std::io::Error::last_os_error();
                bad_file = Some(format!(
                    "AZSDP_LOG={}: cannot open it ({e}); logging to stderr",
                    path.display()
                ));
                2
            } else {
                fd
            }
        }
    };
    FD.store(fd, Ordering::Relaxed);
    LEVEL.store(level as u8, Ordering::Relaxed);
    // Said once, when the log is first used (each process reads these
    // variables once).
    for problem in [bad_level.map(|e| format!("{e}; logging at warn")), bad_file]
        .into_iter()
        .flatten()
    {
        write(Level::Warn, format_args!("{problem}"));
    }
}

/// Would a line at `level` be written?
pub fn enabled(level: Level) -> bool {
    if LEVEL.load(Ordering::Relaxed) == 0 {
        setup();
    }
    level as u8 <= LEVEL.load(Ordering::Relaxed) && FD.load(Ordering::Relaxed) >= 0
}

/// A fixed buffer that drops what does not fit.
struct Line {
    buf: [u8; 512],
    len: usize,
}

impl std::fmt::Write for Line {
    fn write_str(&mut self, s: &str) -> std::fmt::Result {
        let n = s.len().min(self.buf.len() - 1 - self.len);
        self.buf[self.len..self.len + n].copy_from_slice(&s.as_bytes()[..n]);
        self.len += n;
        Ok(())
    }
}

pub fn write(level: Level, args: std::fmt::Arguments<'_>) {
    if !enabled(level) || azsdp::sandbox::marked() {
        return;
    }
    let mut line = Line {
        buf: [0; 512],
        len: 0,
    };
    let tag = match level {
        Level::Error => "error",
        Level::Warn => "warn",
        Level::Info => "info",
        Level::Debug => "debug",
    };
    let _ = write!(line, "azsdp[{}] {tag}: ", std::process::id());
    let _ = line.write_fmt(args);
    line.buf[line.len] = b'\n';
    write_quietly(FD.load(Ordering::Relaxed), &line.buf[..line.len + 1]);
}

/// `write(2)` that costs the program nothing if it fails: SIGPIPE and
/// SIGXFSZ are blocked for the call, and one the call raised (not one
/// already pending) is taken back before they are unblocked; errno is
/// kept.
pub fn write_quietly(fd: i32, buf: &[u8]) {
    let _errno = crate::real::KeepErrno::new();
    // SAFETY: signal sets on our stack, initialised by sigemptyset before
    // use; write(2) of our own buffer; the thread's mask is restored.
    unsafe {
        let mut quiet: libc::sigset_t = std::mem::zeroed();
        libc::sigemptyset(&mut quiet);
        libc::sigaddset(&mut quiet, libc::SIGPIPE);
        libc::sigaddset(&mut quiet, libc::SIGXFSZ);
        let mut old: libc::sigset_t = std::mem::zeroed();
        libc::pthread_sigmask(libc::SIG_BLOCK, &quiet, &mut old);
        let mut before: libc::sigset_t = std::mem::zeroed();
        libc::sigpending(&mut before);
        let r = crate::real::write(fd, buf.as_ptr().cast(), buf.len());
        if r < 0 {
            for sig in [libc::SIGPIPE, libc::SIGXFSZ] {
                if libc::sigismember(&before, sig) == 0 {
                    let mut one: libc::sigset_t = std::mem::zeroed();
                    libc::sigemptyset(&mut one);
                    libc::sigaddset(&mut one, sig);
                    let now = libc::timespec {
                        tv_sec: 0,
                        tv_nsec: 0,
                    };
                    libc::sigtimedwait(&one, std::ptr::null_mut(), &now);
                }
            }
        }
        libc::pthread_sigmask(libc::SIG_SETMASK, &old, std::ptr::null_mut());
    }
}

macro_rules! error { ($($t:tt)*) => { $crate::log::write($crate::log::Level::Error, format_args!($($t)*)) } }
macro_rules! warning { ($($t:tt)*) => { $crate::log::write($crate::log::Level::Warn, format_args!($($t)*)) } }
macro_rules! info { ($($t:tt)*) => { $crate::log::write($crate::log::Level::Info, format_args!($($t)*)) } }
macro_rules! debug { ($($t:tt)*) => { $crate::log::write($crate::log::Level::Debug, format_args!($($t)*)) } }
pub(crate) use {debug, error, info, warning};
