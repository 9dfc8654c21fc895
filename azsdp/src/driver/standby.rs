//! Progress threads on standby while the application drives a connection.
//!
//! A thread of the application that is inside a call (or was a moment ago)
//! turns the engine itself and busy-polls the incoming ring. If the
//! connection's progress thread slept on that ring's futex too, every
//! message of the peer would have to wake it (a `futex_wake` on the peer's
//! side, a context switch here, and on two cores a preempted poller) only
//! for it to find the caller had taken the message already. So while calls
//! come, the progress thread parks here instead, off the ring, and the peer
//! posts without a system call. It comes back when calls stop (it looks
//! again after a nap that doubles up to [`LONGEST_NAP`]), or at once when
//! the application is about to sleep in `poll`/`epoll_wait`/`select` and
//! needs it to watch for readiness, or waits in a write fault for a
//! completion ([`end`]).
//!
//! `unsafe` here: `clock_gettime`.

use std::sync::atomic::{AtomicU32, AtomicU64, Ordering};
use std::time::Duration;

/// Bumped (and its sleepers woken) by [`end`].
static GENERATION: AtomicU32 = AtomicU32::new(0);
/// Progress threads parked now.
static PARKED: AtomicU32 = AtomicU32::new(0);
/// When [`end`] was last called ([`now_ns`]).
static ENDED_AT: AtomicU64 = AtomicU64::new(0);

/// Calls ended less than this long ago keep the progress thread parked.
pub const RECENT: Duration = Duration::from_micros(200);
/// The longest park between looks: when calls stop, the connection goes
/// unwatched at most this long (unless [`end`] comes first).
pub const LONGEST_NAP: Duration = Duration::from_millis(2);

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

/// Should a progress thread stand by? Yes while a caller is in a call
/// (`in_calls`), or one ended within [`RECENT`] (`last_exit` from
/// [`now_ns`], 0 when none ever did) and no [`end`] came since.
pub fn wanted(in_calls: usize, last_exit: &AtomicU64) -> bool {
    if in_calls > 0 {
        return true;
    }
    let at = last_exit.load(Ordering::SeqCst);
    at != 0
        && at > ENDED_AT.load(Ordering::SeqCst)
        && now_ns().saturating_sub(at) < RECENT.as_nanos() as u64
}

/// Park the calling progress thread for at most `nap`, or until [`end`],
/// if `still_wanted` (looked at once this thread counts as parked, so an
/// [`end`] racing with the decision is never missed).
pub fn park(nap: Duration, still_wanted: impl Fn() -> bool) {
    PARKED.fetch_add(1, Ordering::SeqCst);
    let generation = GENERATION.load(Ordering::SeqCst);
    if still_wanted() {
        crate::futex::wait(&GENERATION, generation, nap);
    }
    PARKED.fetch_sub(1, Ordering::SeqCst);
}

/// Send every parked progress thread back to its ring (one load when none
/// is parked): the application is about to sleep waiting for readiness,
/// which only progress threads can see arrive.
pub fn end() {
    ENDED_AT.store(now_ns(), Ordering::SeqCst);
    if PARKED.load(Ordering::SeqCst) != 0 {
        GENERATION.fetch_add(1, Ordering::SeqCst);
        crate::futex::wake_all(&GENERATION);
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::time::Instant;

    // One test: end() is process-wide, parallel tests would see each other's.
    #[test]
    fn standby_is_wanted_around_calls_and_ended_by_end() {
        wanted_while_calls_run_or_just_ended_and_not_after_end();
        a_parked_thread_returns_on_end_long_before_its_nap();
    }

    fn a_parked_thread_returns_on_end_long_before_its_nap() {
        let t0 = Instant::now();
        let h = std::thread::spawn(|| park(Duration::from_secs(30), || true));
        while PARKED.load(Ordering::SeqCst) == 0 {
            std::thread::yield_now();
        }
        // Until the thread sleeps, an end() is seen by its wait instead.
        std::thread::sleep(Duration::from_millis(10));
        end();
        h.join().unwrap();
        assert!(t0.elapsed() < Duration::from_secs(10));
    }

    fn wanted_while_calls_run_or_just_ended_and_not_after_end() {
        let w = AtomicU64::new(0);
        assert!(!wanted(0, &w), "no call yet");
        assert!(wanted(1, &w), "a call runs");
        std::thread::sleep(Duration::from_millis(1));
        w.store(now_ns(), Ordering::SeqCst);
        assert!(wanted(0, &w), "a call just ended");
        end();
        assert!(!wanted(0, &w), "end() came after it");
        std::thread::sleep(Duration::from_millis(1));
        w.store(now_ns(), Ordering::SeqCst);
        std::thread::sleep(RECENT);
        assert!(!wanted(0, &w), "long ago");
    }
}
