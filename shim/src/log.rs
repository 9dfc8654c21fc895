//! The shim's log: `AZSDP_LOG=stderr|off|FILE` (default stderr) and
//! `AZSDP_LOG_LEVEL=error|warn|info|debug` (default warn).
//!
//! Lines are formatted into a stack buffer and written with one `write(2)`
//! through libc's own `write`, so logging neither allocates nor passes
//! through the shim's hooks, and lines of concurrent threads do not mix.

use std::fmt::Write as _;
use std::sync::atomic::{AtomicI32, AtomicU8, Ordering};

#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord)]
#[repr(u8)]
pub enum Level {
    Error = 1,
    Warn = 2,
    Info = 3,
    Debug = 4,
}

/// 0: not read yet.
static LEVEL: AtomicU8 = AtomicU8::new(0);
/// -2: not opened yet; -1: off.
static FD: AtomicI32 = AtomicI32::new(-2);

fn setup() {
    let level = match std::env::var("AZSDP_LOG_LEVEL").as_deref() {
        Ok("error") => Level::Error,
        Ok("info") => Level::Info,
        Ok("debug") => Level::Debug,
        _ => Level::Warn,
    };
    let fd = match std::env::var("AZSDP_LOG").as_deref() {
        Err(_) | Ok("") | Ok("stderr") => 2,
        Ok("off") | Ok("none") => -1,
        Ok(path) => match std::ffi::CString::new(path) {
            // SAFETY: open(2) of a NUL-terminated path.
            Ok(c) => unsafe {
                libc::open(
                    c.as_ptr(),
                    libc::O_WRONLY | libc::O_CREAT | libc::O_APPEND | libc::O_CLOEXEC,
                    0o644,
                )
            }
            .max(2),
            Err(_) => 2,
        },
    };
    FD.store(fd, Ordering::Relaxed);
    LEVEL.store(level as u8, Ordering::Relaxed);
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
    if !enabled(level) {
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
    // SAFETY: write(2) of our own initialised buffer.
    unsafe {
        crate::real::write(
            FD.load(Ordering::Relaxed),
            line.buf.as_ptr().cast(),
            line.len + 1,
        )
    };
}

macro_rules! error { ($($t:tt)*) => { $crate::log::write($crate::log::Level::Error, format_args!($($t)*)) } }
macro_rules! warning { ($($t:tt)*) => { $crate::log::write($crate::log::Level::Warn, format_args!($($t)*)) } }
macro_rules! info { ($($t:tt)*) => { $crate::log::write($crate::log::Level::Info, format_args!($($t)*)) } }
macro_rules! debug { ($($t:tt)*) => { $crate::log::write($crate::log::Level::Debug, format_args!($($t)*)) } }
pub(crate) use {debug, error, info, warning};
