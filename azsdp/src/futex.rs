//! Futex wait and wake on a 32-bit word (shared memory or our own), used by
//! the `shm` rings and the mprotect fault handler. Both are plain syscalls,
//! safe in a signal handler.
//!
//! `unsafe` here: the raw `futex(2)` calls.

use std::sync::atomic::AtomicU32;
use std::time::Duration;

/// Sleep while `word` holds `expected`, at most `timeout` (may return early).
pub fn wait(word: &AtomicU32, expected: u32, timeout: Duration) {
    let ts = libc::timespec {
        tv_sec: timeout.as_secs().min(i64::MAX as u64) as libc::time_t,
        tv_nsec: libc::c_long::from(timeout.subsec_nanos() as i32),
    };
    // SAFETY: FUTEX_WAIT on a live, 4-byte aligned word (an atomic) with a
    // valid timespec; not private, so it also works on shared memory.
    unsafe {
        libc::syscall(
            libc::SYS_futex,
            word.as_ptr(),
            libc::FUTEX_WAIT,
            expected,
            &ts as *const libc::timespec,
        )
    };
}

/// Wake every thread sleeping on `word`.
pub fn wake_all(word: &AtomicU32) {
    // SAFETY: FUTEX_WAKE on a live, 4-byte aligned word.
    unsafe {
        libc::syscall(libc::SYS_futex, word.as_ptr(), libc::FUTEX_WAKE, i32::MAX);
    }
}

/// [`wait`] on a signed word (same futex, another view of the integer).
pub fn wait_i32(word: &std::sync::atomic::AtomicI32, expected: i32, timeout: Duration) {
    // SAFETY: AtomicI32 and AtomicU32 have the same size and alignment; the
    // futex only compares and sleeps.
    let as_u32 = unsafe { &*(word as *const std::sync::atomic::AtomicI32).cast::<AtomicU32>() };
    wait(as_u32, expected as u32, timeout);
}

/// [`wake_all`] on a signed word.
pub fn wake_all_i32(word: &std::sync::atomic::AtomicI32) {
    // SAFETY: as in `wait_i32`.
    let as_u32 = unsafe { &*(word as *const std::sync::atomic::AtomicI32).cast::<AtomicU32>() };
    wake_all(as_u32);
}
