//! The monotonic clock as a number, for times kept in atomics.
//!
//! `unsafe` here: the `clock_gettime` call.

/// A monotonic clock in nanoseconds, cheap enough to read on every call.
pub fn now_ns() -> u64 {
    // CLOCK_MONOTONIC itself, not an epoch in a OnceLock (a fork in the
    // middle of its initialisation would leave the child blocked on it).
    let mut ts = libc::timespec {
        tv_sec: 0,
        tv_nsec: 0,
    };
    // SAFETY: clock_gettime writes the timespec we own.
    unsafe { libc::clock_gettime(libc::CLOCK_MONOTONIC, &mut ts) };
    (ts.tv_sec as u64) * 1_000_000_000 + ts.tv_nsec as u64
}
