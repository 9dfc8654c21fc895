//! Who runs a connection after `fork()`: the one home of that state.
//!
//! A connection's side is run by one process. `fork()` copies it, so parent
//! and child hold the same engine state and the same fabric endpoint, and
//! at most one of them may go on with it. Two things decide which:
//!
//! - the **arbiter** the processes share, which the fabric keeps
//!   ([`Sharing::freeze`], [`Sharing::claim`], [`Sharing::ownership`]): shm's
//!   owner word in the segment, frozen by the forking thread and taken by
//!   compare-and-swap by the first process that uses the connection (the
//!   peer follows the winner only on its kernel-checked claim, see
//!   `azsdp::fabric::shm`);
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
//!
//! A close by the runner, at once or deferred, ends the side as
//! [`ending`] says: onto TCP while other processes hold the descriptor.
//!
//! Sans-IO, as the engine: the caller passes its process id (`me`) and the
//! time, and the state is atomics, so that a call checks it with one load
//! and no lock.

use std::sync::atomic::{AtomicU8, AtomicU32, AtomicU64, Ordering};
use std::time::Duration;

use crate::fabric::{Ownership, Sharing};
use crate::time::Timestamp;

/// How long after a fork a connection waits for one of the processes to
/// claim it before the one that made it takes it back.
pub const FORK_GRACE: Duration = Duration::from_secs(1);

/// How long a process that held the connection without running it (an
/// heir) waits, after the runner died, for the peer to move the stream
/// onto TCP for it (the peer notices the death within milliseconds);
/// then its calls are reset.
pub const ORPHAN_WAIT: Duration = Duration::from_secs(3);

/// [`ForkOwnership::frozen_since`] when no fork froze the connection.
const NOT_FROZEN: u64 = 0;
/// [`ForkOwnership::deferred_close`]'s values.
const NO_CLOSE: u8 = 0;
const CLOSE: u8 = 1;
const ABORT: u8 = 2;

/// One copy's view of who runs its connection (see the module).
#[derive(Debug)]
pub struct ForkOwnership {
    /// The process whose threads drive this copy; in a forked child, the
    /// parent's until the child adopts it.
    runner: AtomicU32,
    /// When a fork froze the connection, until someone claims it: the
    /// driver's clock in nanoseconds, plus one ([`NOT_FROZEN`]: not frozen).
    frozen_since: AtomicU64,
    /// `close()` came while frozen: [`CLOSE`] or [`ABORT`], done once
    /// claimed.
    deferred_close: AtomicU8,
}

/// `fork()` copies this view into the child, as it copies all memory.
impl Clone for ForkOwnership {
    fn clone(&self) -> Self {
        ForkOwnership {
            runner: AtomicU32::new(self.runner.load(Ordering::SeqCst)),
            frozen_since: AtomicU64::new(self.frozen_since.load(Ordering::SeqCst)),
            deferred_close: AtomicU8::new(self.deferred_close.load(Ordering::SeqCst)),
        }
    }
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

/// How the process that runs the side ends it when it closes its
/// descriptor (at once, or when it takes a deferred close up after the
/// grace): see [`ending`].
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Ending {
    /// Other processes still hold the descriptor (the kernel keeps the
    /// socket open for them, used yet or not): the stream moves onto the
    /// TCP socket, where they carry on.
    OntoTcp,
    /// Others hold it, but the peer is gone: tell them how the stream
    /// ended, then close.
    TellThenClose,
    Close,
    /// SO_LINGER {on, 0}.
    Abort,
}

/// How a close by the process that runs the side ends it: `others_hold`,
/// other processes may hold its descriptor; `peer_gone`, the peer left or
/// the connection aborted (there is no stream to move).
pub fn ending(others_hold: bool, peer_gone: bool, abort: bool) -> Ending {
    match (others_hold, peer_gone) {
        (true, false) => Ending::OntoTcp,
        (true, true) => Ending::TellThenClose,
        (false, _) if abort => Ending::Abort,
        (false, _) => Ending::Close,
    }
}

fn stamp(now: Timestamp) -> u64 {
    now.as_nanos().saturating_add(1)
}

impl ForkOwnership {
    /// A connection process `me` made (or took up after an exec).
    pub fn new(me: u32) -> Self {
        ForkOwnership {
            runner: AtomicU32::new(me),
            frozen_since: AtomicU64::new(NOT_FROZEN),
            deferred_close: AtomicU8::new(NO_CLOSE),
        }
    }

    /// In a forked child (`me`), before adopting: this copy's threads are
    /// the parent's, and nothing here may touch it.
    pub fn orphaned(&self, me: u32) -> bool {
        me != self.runner.load(Ordering::SeqCst)
    }

    /// Has a fork frozen the connection (and no one claimed it yet)?
    pub fn frozen(&self) -> bool {
        self.frozen_since.load(Ordering::Acquire) != NOT_FROZEN
    }

    /// Ours without asking the arbiter: no fork touched it.
    pub fn settled(&self, me: u32) -> bool {
        !self.orphaned(me) && !self.frozen()
    }

    /// `fork()` is about to copy the connection (the forking thread holds
    /// the driver's lock across it, so both copies see the same state).
    pub fn freeze(&self, sharing: &dyn Sharing, now: Timestamp) {
        sharing.freeze();
        self.frozen_since.store(stamp(now), Ordering::Release);
    }

    /// A call of process `me` wants the connection: claim it if a fork
    /// froze it. `can_adopt`: could a forked child run it (it has a way to
    /// protect its own pages, and may start threads)? Asked only when the
    /// answer matters (it may read `/proc`).
    pub fn for_call(
        &self,
        sharing: &dyn Sharing,
        me: u32,
        can_adopt: impl FnOnce() -> bool,
    ) -> Use {
        match sharing.ownership() {
            Ownership::Mine if self.orphaned(me) => Use::NotMine,
            Ownership::Mine => Use::Mine,
            Ownership::Other => Use::NotMine,
            Ownership::Unclaimed => {
                let orphaned = self.orphaned(me);
                if (orphaned && !can_adopt()) || !sharing.claim() {
                    return Use::NotMine;
                }
                self.frozen_since.store(NOT_FROZEN, Ordering::Release);
                if orphaned { Use::Adopt } else { Use::Mine }
            }
        }
    }

    /// Process `me` adopted the connection: its threads drive it now.
    pub fn adopted(&self, me: u32) {
        self.runner.store(me, Ordering::SeqCst);
    }

    /// The reactor's look: a connection nobody claimed within
    /// [`FORK_GRACE`] of the fork is taken back. `now` is read only then
    /// (not on every look of a connection no fork froze).
    pub fn for_reactor(
        &self,
        sharing: &dyn Sharing,
        now: impl FnOnce() -> Timestamp,
    ) -> ForReactor {
        match sharing.ownership() {
            Ownership::Mine => ForReactor::Run,
            Ownership::Other => ForReactor::Gone,
            Ownership::Unclaimed => {
                let now = now();
                // (A copy that did not see the fork's freeze starts the
                // grace at its first look.)
                let since = match self.frozen_since.compare_exchange(
                    NOT_FROZEN,
                    stamp(now),
                    Ordering::AcqRel,
                    Ordering::Acquire,
                ) {
                    Ok(_) => stamp(now),
                    Err(was) => was,
                };
                let waited = Duration::from_nanos(stamp(now).saturating_sub(since));
                if waited < FORK_GRACE || !sharing.claim() {
                    return ForReactor::Wait;
                }
                self.frozen_since.store(NOT_FROZEN, Ordering::Release);
                ForReactor::Run
            }
        }
    }

    /// `close()` (`abort`: SO_LINGER {on, 0}) by this process.
    pub fn close(&self, sharing: &dyn Sharing, abort: bool) -> Close {
        match sharing.ownership() {
            Ownership::Mine => Close::Now,
            Ownership::Unclaimed => {
                let how = if abort { ABORT } else { CLOSE };
                self.deferred_close.store(how, Ordering::Release);
                Close::Deferred
            }
            Ownership::Other => Close::NotOurs,
        }
    }

    /// A `close()` deferred while frozen, to do now that it is ours
    /// (`Some(abort)`).
    pub fn take_deferred_close(&self) -> Option<bool> {
        match self.deferred_close.swap(NO_CLOSE, Ordering::AcqRel) {
            NO_CLOSE => None,
            how => Some(how == ABORT),
        }
    }

    /// Is a `close()` waiting for a claim?
    pub fn close_deferred(&self) -> bool {
        self.deferred_close.load(Ordering::Acquire) != NO_CLOSE
    }

    /// Does process `me` run the connection now (without claiming it)?
    pub fn runs_here(&self, sharing: &dyn Sharing, me: u32) -> bool {
        !self.orphaned(me) && sharing.ownership() == Ownership::Mine
    }

    /// Did another process take the connection (this copy is done)?
    pub fn taken(&self, sharing: &dyn Sharing) -> bool {
        sharing.ownership() == Ownership::Other
    }

    /// The process whose threads drive this copy (for debugging output).
    pub fn runner(&self) -> u32 {
        self.runner.load(Ordering::Relaxed)
    }
}
