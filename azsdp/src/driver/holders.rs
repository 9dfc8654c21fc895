//! The processes that hold one connection's descriptor after `fork()`, as
//! this process sees them: who runs the connection ([`ForkOwnership`]),
//! how a child that takes it over protects its pages, the mailbox through
//! which the others' calls come and what this process serves of them
//! ([`delegation`]), and what it learnt of a runner that died.
//!
//! [`super::threaded`] asks this type every sharing question and tells it
//! every sharing event (a fork, a close here, an adoption, a serve); no
//! other part of the driver touches these fields. The rules themselves
//! are the sans-IO core's (`azsdp_proto::driver::ownership`), which the
//! simulator runs too; docs/architecture.md, "Ownership across fork".

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};

use super::delegation::{self, Engine, Mailbox, Serving};
use super::ownership::{Close, ForReactor, ForkOwnership, Use};
use crate::conn::CallId;
use crate::fabric::Sharing;
use crate::process;
use crate::protect::FaultSource;
use crate::sync::Lock;
use crate::time::Timestamp;

/// Makes a fresh protector (and its fault source) for a forked child that
/// adopts the connection: the parent's is bound to the parent's memory.
pub type Refresh<P> = Box<dyn Fn() -> Fresh<P> + Send + Sync>;

/// An adopting child's protector, and where its faults come from.
pub type Fresh<P> = (P, Option<Box<dyn FaultSource>>);

/// One connection's sharing state in this process (see the module).
pub(super) struct Holders<P> {
    /// Who runs the connection after a fork.
    own: ForkOwnership,
    /// How a child that adopts the connection protects its pages (none: it
    /// cannot adopt; the process that runs it serves its calls).
    refresh: Lock<Option<Refresh<P>>>,
    /// Made by the first fork that copied the connection, before the copy:
    /// the other processes' calls come through it. Never replaced.
    mailbox: Lock<Option<Arc<Mailbox>>>,
    /// `mailbox` is set (looked at without the lock on every turn).
    has_mailbox: AtomicBool,
    /// What this process serves for the others while it runs the
    /// connection.
    serving: Lock<Serving>,
    /// This process's reactor watches the family bell for the connection.
    family_watched: AtomicBool,
    /// A guest found the runner gone (killed): said once.
    runner_gone: AtomicBool,
    /// The program closed its descriptor in this process: a child forked
    /// from here on does not hold it.
    closed_here: AtomicBool,
}

impl<P> std::fmt::Debug for Holders<P> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Holders")
            .field("runner", &self.own.runner())
            .field("mailbox", &self.mailbox())
            .field("closed_here", &self.closed_here.load(Ordering::Relaxed))
            .finish()
    }
}

impl<P> Holders<P> {
    /// A connection this process made or accepted: it runs it, alone.
    pub(super) fn new() -> Self {
        Holders {
            own: ForkOwnership::new(process::pid()),
            refresh: Lock::new(None),
            mailbox: Lock::new(None),
            has_mailbox: AtomicBool::new(false),
            serving: Lock::new(Serving::default()),
            family_watched: AtomicBool::new(false),
            runner_gone: AtomicBool::new(false),
            closed_here: AtomicBool::new(false),
        }
    }

    /// The process whose threads drive this copy (for debugging output).
    pub(super) fn runner(&self) -> u32 {
        self.own.runner()
    }

    /// A forked child's copy that it never ran (the threads, the
    /// protector and the calls in it are the parent's).
    pub(super) fn orphaned(&self) -> bool {
        self.own.orphaned(process::pid())
    }

    /// Frozen by a fork: nobody runs it until a process claims it.
    pub(super) fn frozen(&self) -> bool {
        self.own.frozen()
    }

    /// This process runs the connection and no fork since changed that
    /// (answered without the fabric's words).
    pub(super) fn settled(&self) -> bool {
        self.own.settled(process::pid())
    }

    /// Does this process run the connection now?
    pub(super) fn runs_here(&self, sharing: &dyn Sharing) -> bool {
        self.own.runs_here(sharing, process::pid())
    }

    /// Has another process taken the connection over?
    pub(super) fn taken(&self, sharing: &dyn Sharing) -> bool {
        self.own.taken(sharing)
    }

    /// A call of this process: may it use the connection, or must it adopt
    /// it first? A sandboxed process, or one without a way to protect its
    /// pages, may not adopt (it could not start the threads or protect).
    pub(super) fn for_call(&self, sharing: &dyn Sharing) -> Use {
        let can_adopt = || self.refresh.lock().is_some() && !crate::sandbox::restricted();
        self.own.for_call(sharing, process::pid(), can_adopt)
    }

    /// This process claimed the connection: the guests follow it from now,
    /// whether it serves them or dies first (then they must not wait for
    /// ever).
    pub(super) fn claimed(&self) {
        if let Some(mb) = self.mailbox() {
            mb.runs_here();
        }
    }

    /// How an adopting child protects its pages.
    pub(super) fn set_refresh(&self, refresh: Refresh<P>) {
        *self.refresh.lock() = Some(refresh);
    }

    /// A forked child adopts the connection: a fresh protector if it has a
    /// way to make one, and the guests' calls the parent was serving, which
    /// go on here (this copy has their buffers).
    pub(super) fn adopt(&self) -> (Option<Fresh<P>>, Vec<CallId>) {
        let fresh = self.refresh.lock().as_ref().map(|f| f());
        (fresh, self.serving.lock().calls())
    }

    /// ... and has taken it: it runs it from now, with its own reactor.
    pub(super) fn adopted(&self) {
        self.own.adopted(process::pid());
        self.family_watched.store(false, Ordering::SeqCst);
    }

    /// What the reactor does with the connection; a copy that another
    /// process took over forgets what it served.
    pub(super) fn for_reactor(
        &self,
        sharing: &dyn Sharing,
        now: impl FnOnce() -> Timestamp,
    ) -> ForReactor {
        let r = self.own.for_reactor(sharing, now);
        if matches!(r, ForReactor::Gone) {
            self.serving.lock().forget();
        }
        r
    }

    /// The fork is about to copy the connection: freeze it, and make the
    /// mailbox the first time, so that both processes have it.
    pub(super) fn freeze_for_fork(&self, sharing: &dyn Sharing, now: Timestamp) {
        self.own.freeze(sharing, now);
        if !self.has_mailbox.load(Ordering::Acquire)
            && let Some(mb) = Mailbox::for_fork()
        {
            *self.mailbox.lock() = Some(mb);
            self.has_mailbox.store(true, Ordering::Release);
        }
    }

    /// `pid` was forked with the descriptor (unless this process had
    /// closed it first).
    pub(super) fn forked_holder(&self, pid: u32) {
        if !self.closed_here.load(Ordering::SeqCst)
            && let Some(mb) = self.mailbox()
        {
            mb.note_holder(pid);
        }
    }

    /// The program closed its descriptor here: off the holders, and a
    /// child forked from now on does not hold it.
    pub(super) fn closed_here(&self) {
        self.closed_here.store(true, Ordering::SeqCst);
        self.not_held_here();
    }

    /// What this process's close (`abort`: SO_LINGER {on, 0}) does to a
    /// connection it did not inherit unused.
    pub(super) fn close(&self, sharing: &dyn Sharing, abort: bool) -> Close {
        self.own.close(sharing, abort)
    }

    /// A close deferred by a fork's freeze, due now that the reactor took
    /// the connection back (`Some(abort)`).
    pub(super) fn take_deferred_close(&self) -> Option<bool> {
        self.own.take_deferred_close()
    }

    /// Is a close deferred by a fork's freeze still to come?
    pub(super) fn close_deferred(&self) -> bool {
        self.own.close_deferred()
    }

    /// This process no longer holds the descriptor (it closed it, or
    /// execs with it closing): off the mailbox's holders.
    pub(super) fn not_held_here(&self) {
        if let Some(mb) = self.mailbox() {
            mb.drop_holder(process::pid());
        }
    }

    /// The mailbox, once a fork copied the connection (one load before).
    pub(super) fn mailbox(&self) -> Option<Arc<Mailbox>> {
        if !self.has_mailbox.load(Ordering::Acquire) {
            return None;
        }
        self.mailbox.lock().clone()
    }

    /// Has a fork copied the connection (other processes may hold its
    /// descriptor, whether they used it yet or not)?
    pub(super) fn shared_by_fork(&self) -> bool {
        self.has_mailbox.load(Ordering::Acquire)
    }

    /// The mailbox, if a process other than this one may hold the
    /// descriptor: the guests this process's close must think of.
    pub(super) fn guests(&self) -> Option<Arc<Mailbox>> {
        self.mailbox()
            .filter(|mb| mb.has_other_holders(process::pid()))
    }

    /// The mailbox, the first time the reactor is to watch the family
    /// bell for it (once per process that runs the connection).
    pub(super) fn family_to_watch(&self) -> Option<Arc<Mailbox>> {
        if !self.shared_by_fork() || self.family_watched.swap(true, Ordering::SeqCst) {
            return None;
        }
        self.mailbox()
    }

    /// Serve the guests after a turn of the engine: whether anything was
    /// taken or answered.
    pub(super) fn serve(&self, e: &mut dyn Engine) -> bool {
        match self.mailbox() {
            Some(mb) => self.serving.lock().serve(&mb, e),
            None => false,
        }
    }

    /// This process lets the connection go without moving it onto TCP:
    /// the guests are told how it ended, and the calls taken for them are
    /// answered so.
    pub(super) fn end_for_guests(&self, how: delegation::Ending) {
        if let Some(mb) = self.mailbox() {
            self.serving.lock().end(&mb, how);
        }
    }

    /// What this process served for the others.
    pub(super) fn served(&self) -> delegation::Served {
        self.serving.lock().served
    }

    /// A guest found the runner gone: true the first time (to say it once).
    pub(super) fn runner_died(&self) -> bool {
        !self.runner_gone.swap(true, Ordering::SeqCst)
    }

    /// Is the runner known gone, or found gone now?
    pub(super) fn runner_is_gone(&self, mb: &Mailbox) -> bool {
        if self.runner_gone.load(Ordering::SeqCst) || !delegation::runner_alive(mb) {
            self.runner_gone.store(true, Ordering::SeqCst);
            return true;
        }
        false
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::fabric::Ownership;
    use std::process::{Child, Command};
    use std::sync::atomic::AtomicU8;

    /// The arbiter's words, in this process alone.
    #[derive(Default)]
    struct Words(AtomicU8);

    impl Sharing for Words {
        fn ownership(&self) -> Ownership {
            match self.0.load(Ordering::SeqCst) {
                0 => Ownership::Mine,
                1 => Ownership::Unclaimed,
                _ => Ownership::Other,
            }
        }
        fn freeze(&self) {
            self.0.store(1, Ordering::SeqCst);
        }
        fn claim(&self) -> bool {
            self.0
                .compare_exchange(1, 0, Ordering::SeqCst, Ordering::SeqCst)
                .is_ok()
        }
    }

    fn now() -> Timestamp {
        Timestamp::from_nanos(crate::monotonic::now_ns())
    }

    /// A live process that is not this one (a forked child's stand-in).
    fn other_process() -> Child {
        Command::new("sleep").arg("30").spawn().expect("sleep")
    }

    #[test]
    fn the_first_fork_makes_the_mailbox_and_later_forks_keep_it() {
        let h = Holders::<()>::new();
        let words = Words::default();
        assert!(!h.shared_by_fork() && h.mailbox().is_none());
        assert!(h.family_to_watch().is_none(), "no family before a fork");
        h.freeze_for_fork(&words, now());
        let first = h.mailbox().expect("made by the fork");
        assert!(h.frozen() && !h.settled(), "frozen until claimed");
        assert!(matches!(h.for_call(&words), Use::Mine), "claimed back");
        h.claimed();
        assert_eq!(first.runner(), process::pid(), "guests follow the claim");
        h.freeze_for_fork(&words, now());
        assert!(Arc::ptr_eq(&first, &h.mailbox().unwrap()), "never replaced");
    }

    #[test]
    fn a_child_forked_after_the_close_here_does_not_hold_the_connection() {
        let mut child = other_process();
        let words = Words::default();
        let open = Holders::<()>::new();
        open.freeze_for_fork(&words, now());
        open.forked_holder(child.id());
        assert!(open.guests().is_some(), "the child holds the descriptor");

        let closed = Holders::<()>::new();
        closed.freeze_for_fork(&words, now());
        closed.closed_here();
        closed.forked_holder(child.id());
        assert!(closed.guests().is_none(), "forked after the close");
        assert!(
            !closed.mailbox().unwrap().has_other_holders(child.id()),
            "and this process left the holders at its close"
        );
        let _ = child.kill();
        let _ = child.wait();
    }

    #[test]
    fn the_family_bell_is_watched_once_per_process_that_runs_the_connection() {
        let h = Holders::<()>::new();
        h.freeze_for_fork(&Words::default(), now());
        assert!(h.family_to_watch().is_some());
        assert!(h.family_to_watch().is_none(), "watched already");
        h.adopted();
        assert!(h.family_to_watch().is_some(), "an adopting child's reactor");
    }

    #[test]
    fn a_dead_runner_is_told_once_and_stays_dead() {
        let h = Holders::<()>::new();
        h.freeze_for_fork(&Words::default(), now());
        let mb = h.mailbox().unwrap();
        assert!(!h.runner_is_gone(&mb), "no runner yet is not a dead one");
        assert!(h.runner_died());
        assert!(!h.runner_died(), "said once");
        assert!(h.runner_is_gone(&mb));
    }

    #[test]
    fn a_copy_another_process_took_over_is_gone_for_the_reactor() {
        let h = Holders::<()>::new();
        let words = Words::default();
        assert!(matches!(h.for_reactor(&words, now), ForReactor::Run));
        h.freeze_for_fork(&words, now());
        assert!(matches!(h.for_reactor(&words, now), ForReactor::Wait));
        words.0.store(2, Ordering::SeqCst);
        assert!(matches!(h.for_reactor(&words, now), ForReactor::Gone));
        assert!(h.taken(&words) && !h.runs_here(&words));
        assert!(matches!(h.close(&words, false), Close::NotOurs));
    }
}
