//! The reactor on standby while the application drives a connection.
//!
//! A thread of the application that is inside a call (or was a moment ago)
//! turns the engine itself and busy-polls the incoming ring. If the reactor
//! armed that connection's doorbell too, every message of the peer would
//! ring it (a system call on the peer's side, a wake-up here, and on two
//! cores a preempted poller) only for it to find the caller had taken the
//! message already. So while calls come, the reactor *parks* the
//! connection instead: it leaves the doorbell unarmed and looks again after
//! a nap that doubles up to [`LONGEST_NAP`]. It comes back at once when the
//! application is about to sleep in `poll`/`epoll_wait`/`select` and needs
//! it to watch for readiness ([`end`]), or when a fault or a kick wakes the
//! connection while no call is in it.
//!
//! `unsafe` here: `clock_gettime`.

use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

/// When [`end`] was last called ([`now_ns`]).
static ENDED_AT: AtomicU64 = AtomicU64::new(0);

/// Calls ended less than this long ago keep the connection parked.
pub const RECENT: Duration = Duration::from_micros(200);
/// A loop that looked at the connection this recently still looks (see
/// [`looped`]): between two waits it serves the program's work, or, on a
/// loaded host, waits for a CPU, and its next wait hears what came. (At
/// [`RECENT`], a loop preempted for a scheduler's slice left its
/// connections to the doorbells, and their rings woke the reactor on the
/// CPUs the loop waited for: every message rang.)
pub const LOOP_RECENT: Duration = Duration::from_millis(10);
/// The longest park between looks: when calls stop, the connection goes
/// unwatched at most this long (unless [`end`] comes first).
pub const LONGEST_NAP: Duration = Duration::from_millis(2);

pub use crate::monotonic::now_ns;

/// Should the reactor stand by? Yes while a caller is in a call
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

/// When the reactor should first look at a connection that a call
/// started (see [`wanted`]): a whole [`LONGEST_NAP`] or more from `now`,
/// on a grid of that step, so that the connections a program starts in a
/// row share one wake-up of the reactor instead of one each.
pub fn first_look(now: std::time::Instant) -> std::time::Instant {
    let step = LONGEST_NAP.as_nanos() as u64;
    now + Duration::from_nanos(2 * step - now_ns() % step)
}

/// Should the reactor stand by for an event loop? Yes while a loop that
/// looks at the connection at each of its waits (`loop_at`, from
/// [`now_ns`], 0 when none does or it sleeps) looked within
/// [`LOOP_RECENT`].
/// Unlike [`wanted`], [`end`] does not cut this short: another thread's
/// sleep is not this loop's, and the loop ends it itself when it sleeps.
pub fn looped(loop_at: &AtomicU64) -> bool {
    let at = loop_at.load(Ordering::SeqCst);
    at != 0 && now_ns().saturating_sub(at) < LOOP_RECENT.as_nanos() as u64
}

/// Send every parked connection back to the reactor's watch (nothing when
/// none is parked): the application is about to sleep waiting for
/// readiness, which only the reactor can see arrive.
pub fn end() {
    end_for(true);
}

/// [`end`] by a thread that borrowed the reactor's set and turns it next
/// (see [`super::reactor::Loan`]): nobody else needs waking.
pub fn end_by_borrower() {
    end_for(false);
}

fn end_for(signal: bool) {
    ENDED_AT.store(now_ns(), Ordering::SeqCst);
    super::reactor::unpark_all(signal);
    // Connections this process shares but does not run: their runners'
    // changes are heard from now on.
    super::delegation::readiness_wanted();
}

#[cfg(test)]
mod tests {
    use super::*;

    // One test: end() is process-wide, parallel tests would see each other's.
    #[test]
    fn standby_is_wanted_around_calls_and_ended_by_end() {
        wanted_while_calls_run_or_just_ended_and_not_after_end();
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
        looped_until_the_loop_sleeps_whatever_end_says();
    }

    fn looped_until_the_loop_sleeps_whatever_end_says() {
        let l = AtomicU64::new(0);
        assert!(!looped(&l), "no loop looked");
        l.store(now_ns(), Ordering::SeqCst);
        assert!(looped(&l), "a loop just looked");
        end();
        assert!(
            looped(&l),
            "another thread's end() is not this loop's sleep"
        );
        l.store(0, Ordering::SeqCst);
        assert!(!looped(&l), "the loop sleeps");
        l.store(now_ns(), Ordering::SeqCst);
        std::thread::sleep(LOOP_RECENT);
        assert!(!looped(&l), "the loop looked long ago");
    }
}
