//! Who watches the reactor's epoll set: the reactor's own thread, or a
//! program thread asleep in `epoll_wait` that borrowed it (a *loan*).
//!
//! A message for a program asleep in `epoll_wait` used to wake two threads
//! in series: the reactor heard the peer's ring, turned the engine and
//! rang the program's set, and only then did the program's thread wake.
//! With a loan, the program's set holds the reactor's, so the ring wakes
//! the program's thread, which turns the reactor itself: one wake-up per
//! message, as on TCP. Meanwhile the reactor's thread naps on the state
//! word, and takes its set back when loans stop (see [`Lease::aside`]).
//!
//! The state word moves so:
//! - `BY_THREAD` → `HANDING`: a program thread asked; the reactor's
//!   thread finishes its turn and sets `FREE`;
//! - `FREE` → `LENT`: a program thread borrowed; `LENT` → `FREE`: it gave
//!   the loan back, without a system call unless the thread sleeps deep or
//!   work is waiting;
//! - `FREE` → `BY_THREAD`: nobody borrowed for a whole nap, or work came
//!   while nobody watched (a fault, another thread's wake);
//! - `LENT` → `BY_THREAD`: the borrower has not been heard of for
//!   [`DEEP_NAP`] (a thread lost in a signal handler, or gone).
//!
//! Turns are serialised by the reactor's own lock, never by this word, so
//! a taken-back loan whose borrower wakes late costs a spurious turn, not
//! a race.

use std::sync::atomic::{AtomicBool, AtomicU32, Ordering};
use std::time::Duration;

const BY_THREAD: u32 = 0;
const HANDING: u32 = 1;
const FREE: u32 = 2;
const LENT: u32 = 3;

/// How long the reactor's thread naps between looks at a lent set.
pub const NAP: Duration = Duration::from_millis(2);
/// Its nap while a borrower sleeps (a give-back wakes it): a borrower not
/// heard of for this long loses the loan.
pub const DEEP_NAP: Duration = Duration::from_secs(1);
/// Quiet naps (no loan taken or given back, no beat) before a deep one.
const QUIET_BEFORE_DEEP: u32 = 2;

/// The result of [`Lease::borrow`].
#[derive(Debug, PartialEq, Eq)]
pub enum Borrow {
    /// The caller holds the loan until [`Lease::give_back`].
    Lent,
    /// The reactor's thread watches; it was asked to hand over and must be
    /// woken to hear it (the caller rings it).
    Asked,
    /// Not now (handing over, or another thread holds it).
    No,
}

/// What [`Lease::work_queued`] asks of the caller.
#[derive(Debug, PartialEq, Eq)]
pub enum Signal {
    /// Ring the reactor's set (whoever watches it hears).
    Ring,
    /// Nobody watches: wake the reactor's thread on the state word.
    WakeThread,
}

/// The state word and its counters.
#[derive(Debug, Default)]
pub struct Lease {
    state: AtomicU32,
    /// Loans taken so far (the thread's naps compare it).
    loans: AtomicU32,
    /// A borrower's sign of life, once per wait round.
    beats: AtomicU32,
    /// Work was queued that no turn has taken yet.
    urgent: AtomicBool,
    /// The thread sleeps a deep nap: a give-back must wake it.
    deep: AtomicBool,
}

impl Lease {
    /// Try to take the loan (see [`Borrow`]).
    pub fn borrow(&self) -> Borrow {
        match self
            .state
            .compare_exchange(FREE, LENT, Ordering::SeqCst, Ordering::SeqCst)
        {
            Ok(_) => {
                self.loans.fetch_add(1, Ordering::SeqCst);
                Borrow::Lent
            }
            Err(BY_THREAD) => {
                if self
                    .state
                    .compare_exchange(BY_THREAD, HANDING, Ordering::SeqCst, Ordering::SeqCst)
                    .is_ok()
                {
                    Borrow::Asked
                } else {
                    Borrow::No
                }
            }
            Err(_) => Borrow::No,
        }
    }

    /// The borrower is alive (once per round of its wait).
    pub fn beat(&self) {
        self.beats.fetch_add(1, Ordering::Relaxed);
    }

    /// The borrower is about to turn: what was queued so far, it takes.
    pub fn turning(&self) {
        self.urgent.store(false, Ordering::SeqCst);
    }

    /// Give the loan back; `others_asleep`: threads wait for readiness
    /// without it, so the reactor's thread must watch again at once. True
    /// if the thread must be woken (it sleeps deep, or work is waiting that
    /// nobody will turn).
    pub fn give_back(&self, others_asleep: bool) -> bool {
        if others_asleep {
            self.urgent.store(true, Ordering::SeqCst);
        }
        if self
            .state
            .compare_exchange(LENT, FREE, Ordering::SeqCst, Ordering::SeqCst)
            .is_err()
        {
            // Taken back meanwhile.
            return false;
        }
        self.deep.load(Ordering::SeqCst) || self.urgent.load(Ordering::SeqCst)
    }

    /// Work was queued for a turn: how to get one.
    pub fn work_queued(&self) -> Signal {
        self.urgent.store(true, Ordering::SeqCst);
        if self.state.load(Ordering::SeqCst) == FREE {
            Signal::WakeThread
        } else {
            Signal::Ring
        }
    }

    /// Does the reactor's thread watch its set (so it turns now)?
    pub fn by_thread(&self) -> bool {
        matches!(self.state.load(Ordering::SeqCst), BY_THREAD | HANDING)
    }

    /// The thread finished a turn: if a program thread asked, the set is
    /// free for it to borrow. True if it was handed over.
    pub fn hand_over(&self) -> bool {
        self.state
            .compare_exchange(HANDING, FREE, Ordering::SeqCst, Ordering::SeqCst)
            .is_ok()
    }

    /// The state word (for [`crate::futex`]).
    pub fn word(&self) -> &AtomicU32 {
        &self.state
    }

    /// The reactor's thread stands aside while its set is free or lent,
    /// sleeping on the state word with `wait` (the futex's, in tests a
    /// stand-in); returns once it watches the set again.
    pub fn aside(&self, wait: impl Fn(&AtomicU32, u32, Duration)) {
        let mut seen = self.marks();
        let mut quiet = 0u32;
        let mut woke_from_deep = false;
        loop {
            let st = self.state.load(Ordering::SeqCst);
            if st == BY_THREAD || st == HANDING {
                return;
            }
            let mut nap = NAP;
            if st == LENT && quiet >= QUIET_BEFORE_DEEP {
                self.deep.store(true, Ordering::SeqCst);
                // (Seen after the flag: a give-back before it wakes nobody,
                // so look again.)
                if self.state.load(Ordering::SeqCst) != LENT {
                    self.deep.store(false, Ordering::SeqCst);
                    continue;
                }
                nap = DEEP_NAP;
            }
            wait(&self.state, st, nap);
            let deep = self.deep.swap(false, Ordering::SeqCst);
            let now = self.marks();
            let st = self.state.load(Ordering::SeqCst);
            let urgent = self.urgent.load(Ordering::SeqCst);
            let take = match st {
                // Work nobody watches for, or nobody borrowed for a nap
                // (right after a deep nap, give the borrower one more).
                FREE => (urgent || (now.0 == seen.0 && !woke_from_deep)).then_some(FREE),
                // The borrower went silent for a whole deep nap.
                LENT if deep && now == seen => Some(LENT),
                _ => None,
            };
            if let Some(from) = take
                && self
                    .state
                    .compare_exchange(from, BY_THREAD, Ordering::SeqCst, Ordering::SeqCst)
                    .is_ok()
            {
                return;
            }
            woke_from_deep = deep && st == FREE;
            quiet = if now == seen { quiet + 1 } else { 0 };
            seen = now;
        }
    }

    fn marks(&self) -> (u32, u32) {
        (
            self.loans.load(Ordering::SeqCst),
            self.beats.load(Ordering::SeqCst),
        )
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::Arc;
    use std::time::Instant;

    fn no_sleep(_: &AtomicU32, _: u32, _: Duration) {}

    /// A lease the thread handed over and a borrower holds.
    fn lent() -> Lease {
        let l = Lease::default();
        assert_eq!(l.borrow(), Borrow::Asked);
        assert!(l.hand_over());
        assert_eq!(l.borrow(), Borrow::Lent);
        l
    }

    #[test]
    fn a_loan_is_asked_for_then_taken_and_given_back() {
        let l = Lease::default();
        assert!(l.by_thread());
        assert_eq!(l.borrow(), Borrow::Asked);
        assert_eq!(l.borrow(), Borrow::No, "asked already");
        assert!(l.by_thread(), "the thread turns until it hands over");
        assert!(l.hand_over());
        assert!(!l.by_thread());
        assert_eq!(l.borrow(), Borrow::Lent);
        assert_eq!(l.borrow(), Borrow::No, "one borrower at a time");
        l.turning();
        assert!(!l.give_back(false), "nothing waits, nobody sleeps deep");
        assert_eq!(l.borrow(), Borrow::Lent, "borrowed again without asking");
        assert!(!l.give_back(false));
    }

    #[test]
    fn work_while_nobody_watches_wakes_the_thread_and_it_takes_the_set() {
        let l = lent();
        assert_eq!(l.work_queued(), Signal::Ring, "the borrower hears a ring");
        // Given back before it turned: the thread must come.
        assert!(l.give_back(false));
        assert_eq!(l.work_queued(), Signal::WakeThread);
        l.aside(no_sleep);
        assert!(l.by_thread());
    }

    #[test]
    fn a_give_back_beside_other_sleepers_wakes_the_thread_to_take_the_set() {
        let l = lent();
        l.turning();
        assert!(l.give_back(true), "other threads wait without the set");
        // Taken at the first look, even though a loan came during the nap.
        l.aside(|_, _, _| {
            let _ = l.borrow();
            l.give_back(false);
        });
        assert!(l.by_thread());
    }

    #[test]
    fn the_thread_takes_the_set_back_after_a_nap_without_loans() {
        let l = Lease::default();
        assert_eq!(l.borrow(), Borrow::Asked);
        assert!(l.hand_over());
        // Free and nobody borrows: after one nap it watches again.
        l.aside(no_sleep);
        assert!(l.by_thread());
    }

    #[test]
    fn a_silent_borrower_loses_the_loan_after_a_deep_nap() {
        let l = lent();
        l.turning();
        l.aside(no_sleep);
        assert!(l.by_thread(), "taken back");
        assert!(!l.give_back(false), "the late give-back changes nothing");
        assert!(l.by_thread());
    }

    #[test]
    fn a_beating_borrower_keeps_the_loan_and_its_give_back_wakes_a_deep_sleeper() {
        let l = Arc::new(lent());
        l.turning();
        let naps = Arc::new(AtomicU32::new(0));
        let (l2, n2) = (Arc::clone(&l), Arc::clone(&naps));
        // (The real naps: a deep one lasts a second unless a give-back
        // ends it, so a stall of this thread under load loses nothing.)
        let t = std::thread::spawn(move || {
            l2.aside(|w, v, d| {
                n2.fetch_add(1, Ordering::SeqCst);
                crate::futex::wait(w, v, d);
            });
        });
        // Beat for a while: the thread keeps napping, the loan stays.
        let t0 = Instant::now();
        while t0.elapsed() < Duration::from_millis(300) {
            l.beat();
            std::thread::sleep(Duration::from_millis(5));
        }
        assert!(!l.by_thread(), "a beating borrower keeps it");
        // Stop beating until the thread sleeps deep, then give back.
        while !l.deep.load(Ordering::SeqCst) {
            std::thread::sleep(Duration::from_millis(1));
        }
        if l.give_back(false) {
            crate::futex::wake_all(l.word());
        }
        t.join().unwrap();
        assert!(l.by_thread(), "nobody borrowed again: the thread watches");
        assert!(naps.load(Ordering::SeqCst) >= 2);
    }
}
