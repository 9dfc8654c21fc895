//! Who runs a connection after `fork()`: the one home of that state.
//!
//! A connection's side is run by one process. `fork()` copies it, so parent
//! and child hold the same engine state and the same fabric endpoint, and
//! at most one of them may go on with it. Two things decide which:
//!
//! - the **arbiter** the processes share, which the fabric keeps
//!   ([`Fabric::freeze`], [`Fabric::claim`], [`Fabric::ownership`]): shm's
//!   owner word in the segment, frozen by the forking thread and taken by
//!   compare-and-swap by the first process that uses the connection (the
//!   peer follows the winner only on its kernel-checked claim, see
//!   `fabric::shm`);
//! - each copy's **own view**, kept here ([`ForkOwnership`]): which process's
//!   threads drive this copy (a child's copy of the parent's connection is
//!   *orphaned* until the child adopts it), since when a fork has it
//!   frozen, and a `close()` that came meanwhile.
//!
//! Transitions, all made here:
//!
//! | event | in the parent | in the child |
//! |---|---|---|
//! | `fork()` | [`ForkOwnership::freeze`]: frozen, arbiter frozen | inherits the frozen copy, orphaned |
//! | a call | [`ForkOwnership::for_call`]: claim, then [`Use::Mine`] | claim, then [`Use::Adopt`] (fresh protection, own threads) |
//! | the other claimed | [`Use::NotMine`]; the reactor lets go ([`ForReactor::Gone`]) | the same |
//! | nobody claims for [`FORK_GRACE`] | the reactor takes it back ([`ForReactor::Run`]) | – |
//! | `close()` while frozen | deferred ([`Close::Deferred`]), done once claimed | – |

use std::sync::atomic::{AtomicU32, Ordering};
use std::time::{Duration, Instant};

use crate::fabric::{Ownership, Watched as Fabric};
use crate::sync::Lock;

/// How long after a fork a connection waits for one of the processes to
/// claim it before the one that made it takes it back.
pub const FORK_GRACE: Duration = Duration::from_secs(1);

/// One copy's view of who runs its connection (see the module).
#[derive(Debug)]
pub struct ForkOwnership {
    /// The process whose threads drive this copy; in a forked child, the
    /// parent's until the child adopts it.
    runner: AtomicU32,
    /// When a fork froze the connection, until someone claims it.
    frozen_since: Lock<Option<Instant>>,
    /// `close()` came while frozen (`Some(abort)`): done once claimed.
    deferred_close: Lock<Option<bool>>,
}

/// May a call of this process use the connection?
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Use {
    Mine,
    /// Another process has it (or this copy cannot be adopted).
    NotMine,
    /// A forked child just claimed it: adopt it before use.
    Adopt,
}

/// What the reactor may do with the connection.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum ForReactor {
    Run,
    /// Frozen by a fork: look again later.
    Wait,
    /// Another process took it: this copy is done.
    Gone,
}

/// What `close()` does now.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Close {
    Now,
    /// Frozen by a fork: done by whichever process claims it.
    Deferred,
    /// Another process runs the connection: not ours to end.
    NotOurs,
}

impl Default for ForkOwnership {
    fn default() -> Self {
        ForkOwnership {
            runner: AtomicU32::new(crate::process::pid()),
            frozen_since: Lock::new(None),
            deferred_close: Lock::new(None),
        }
    }
}

impl ForkOwnership {
    /// In a forked child, before adopting: this copy's threads are the
    /// parent's, and nothing here may touch it.
    pub fn orphaned(&self) -> bool {
        crate::process::pid() != self.runner.load(Ordering::SeqCst)
    }

    /// Has a fork frozen the connection (and no one claimed it yet)?
    pub fn frozen(&self) -> bool {
        self.frozen_since.lock().is_some()
    }

    /// Ours without asking the arbiter: no fork touched it.
    pub fn settled(&self) -> bool {
        !self.orphaned() && !self.frozen()
    }

    /// `fork()` is about to copy the connection (the forking thread holds
    /// the driver's lock across it, so both copies see the same state).
    pub fn freeze(&self, fabric: &impl Fabric) {
        fabric.freeze();
        *self.frozen_since.lock() = Some(Instant::now());
    }

    /// A call of this process wants the connection: claim it if a fork
    /// froze it. `can_adopt`: could a forked child run it (it has a way to
    /// protect its own pages, and may start threads)? Asked only when the
    /// answer matters (it may read `/proc`).
    pub fn for_call(&self, fabric: &impl Fabric, can_adopt: impl FnOnce() -> bool) -> Use {
        match fabric.ownership() {
            Ownership::Mine if self.orphaned() => Use::NotMine,
            Ownership::Mine => Use::Mine,
            Ownership::Other => Use::NotMine,
            Ownership::Unclaimed => {
                let orphaned = self.orphaned();
                if (orphaned && !can_adopt()) || !fabric.claim() {
                    return Use::NotMine;
                }
                *self.frozen_since.lock() = None;
                if orphaned { Use::Adopt } else { Use::Mine }
            }
        }
    }

    /// This process adopted the connection: its threads drive it now.
    pub fn adopted(&self) {
        self.runner.store(crate::process::pid(), Ordering::SeqCst);
    }

    /// The reactor's look at `now`: a connection nobody claimed within
    /// [`FORK_GRACE`] of the fork is taken back.
    pub fn for_reactor(&self, fabric: &impl Fabric, now: Instant) -> ForReactor {
        match fabric.ownership() {
            Ownership::Mine => ForReactor::Run,
            Ownership::Other => ForReactor::Gone,
            Ownership::Unclaimed => {
                let since = *self.frozen_since.lock().get_or_insert(now);
                if now.duration_since(since) < FORK_GRACE || !fabric.claim() {
                    return ForReactor::Wait;
                }
                *self.frozen_since.lock() = None;
                ForReactor::Run
            }
        }
    }

    /// `close()` (`abort`: SO_LINGER {on, 0}) by this process.
    pub fn close(&self, fabric: &impl Fabric, abort: bool) -> Close {
        match fabric.ownership() {
            Ownership::Mine => Close::Now,
            Ownership::Unclaimed => {
                *self.deferred_close.lock() = Some(abort);
                Close::Deferred
            }
            Ownership::Other => Close::NotOurs,
        }
    }

    /// A `close()` deferred while frozen, to do now that it is ours
    /// (`Some(abort)`).
    pub fn take_deferred_close(&self) -> Option<bool> {
        self.deferred_close.lock().take()
    }

    /// Is a `close()` waiting for a claim?
    pub fn close_deferred(&self) -> bool {
        self.deferred_close.lock().is_some()
    }

    /// Does this process run the connection now (without claiming it)?
    pub fn runs_here(&self, fabric: &impl Fabric) -> bool {
        !self.orphaned() && fabric.ownership() == Ownership::Mine
    }

    /// Did another process take the connection (this copy is done)?
    pub fn taken(&self, fabric: &impl Fabric) -> bool {
        fabric.ownership() == Ownership::Other
    }

    /// The process whose threads drive this copy (for debugging output).
    pub fn runner(&self) -> u32 {
        self.runner.load(Ordering::Relaxed)
    }
}
