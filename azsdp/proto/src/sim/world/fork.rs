//! A side's process forks and hands the connection to its child, as a
//! fork-per-connection server does: the world plays both processes' parts
//! over the sim fabric's [`Sharing`] words, with the real
//! [`ForkOwnership`], as the shim does (docs/architecture.md, "Ownership
//! across fork").
//!
//! - Before the fork, the process settles what is in flight on the
//!   application's memory and stops arming: protection does not cross a
//!   fork. The fork freezes the side.
//! - The application goes on in the child. Its first call claims the side
//!   and adopts it (a fresh protector, the parent's calls dropped), or,
//!   when the parent took it back after the grace, asks the parent to move
//!   the stream onto TCP.
//! - While the side is frozen nobody drives its engine; the parent's
//!   reactor takes it back once the grace is over. The parent's `close()`
//!   is deferred while frozen and done when it takes the side back: then,
//!   as the child still holds the descriptor, the stream moves onto TCP
//!   instead of ending.
//!
//! One engine stands for both copies: after the fork only the process
//! that runs the side drives it, and a call of the other is what the
//! runner would serve for it (`azsdp::driver::delegation`).

use std::time::Duration;

use super::{Phase, WEvent, Wait, World};
use crate::conn::{CallError, State, Ticket};
use crate::driver::ownership::{
    self, Close, Ending, FORK_GRACE, ForReactor, ForkOwnership, ORPHAN_WAIT, Use,
};
use crate::fabric::sim::SimEndpoint;
use crate::fabric::{Ownership, Sharing};
use crate::sim::host::SimProtector;
use crate::time::Timestamp;

/// One process's copy of the side.
#[derive(Debug)]
struct Holder {
    ep: SimEndpoint,
    own: ForkOwnership,
}

impl Holder {
    fn pid(&self) -> u32 {
        self.ep.pid()
    }
}

/// A side's fork, from the settling before it to the end.
#[derive(Debug)]
pub(super) struct ForkState {
    parent: Holder,
    child: Option<Holder>,
    /// Settling before the fork (the evacuation's ticket).
    settling: Option<Ticket>,
    forked_at: Option<Timestamp>,
    /// The application runs in the child.
    child_started: bool,
    /// The parent's reactor took the side back after the grace.
    parent_ran: bool,
    /// The parent closed its copy.
    parent_closed: bool,
    /// The parent was killed.
    parent_dead: bool,
    /// ... while it ran the side: its engine is gone, and the child holds
    /// the descriptor (an heir).
    runner_dead: bool,
    died_at: Timestamp,
}

impl World {
    /// The side's process is about to fork: no new calls, the blocked ones
    /// interrupted (the threads go on in the child), everything in flight
    /// settled, no new arms.
    pub(super) fn start_fork(&mut self, side: usize) {
        let p = &self.procs[side];
        if p.dead || p.closed || p.fork.is_some() || self.on_tcp(side) {
            return;
        }
        self.note(|| format!("side {side}: about to fork"));
        let ep = self.drivers[side].fabric().clone();
        let own = ForkOwnership::new(ep.pid());
        self.drivers[side].pause_arms(true);
        self.interrupt_calls(side);
        let ticket = self.drivers[side].submit_evacuate(0..u64::MAX);
        self.procs[side].fork = Some(ForkState {
            parent: Holder { ep, own },
            child: None,
            settling: Some(ticket),
            forked_at: None,
            child_started: false,
            parent_ran: false,
            parent_closed: false,
            parent_dead: false,
            runner_dead: false,
            died_at: Timestamp::ZERO,
        });
        self.settle(side);
    }

    /// Do the application's calls of `side` wait for the child?
    pub(super) fn fork_holds(&self, side: usize) -> bool {
        self.procs[side]
            .fork
            .as_ref()
            .is_some_and(|f| !f.child_started)
    }

    /// Fork once everything is settled: freeze the side and copy it.
    pub(super) fn try_fork(&mut self, side: usize) {
        let Some(ticket) = self.procs[side].fork.as_ref().and_then(|f| f.settling) else {
            return;
        };
        let blocked = self.calls.keys().any(|&(s, _)| s == side);
        if blocked || !self.drivers[side].resumed(ticket) {
            return;
        }
        let now = self.now;
        let sc = self.sc.fork.expect("a fork in the scenario");
        let f = self.procs[side].fork.as_mut().expect("a fork");
        f.settling = None;
        f.forked_at = Some(now);
        f.parent.own.freeze(&f.parent.ep, now);
        let child_pid = f.parent.pid() + 1;
        f.child = Some(Holder {
            ep: f.parent.ep.forked(child_pid),
            own: f.parent.own.clone(),
        });
        // The fork is over in the parent: it may arm again (it runs
        // nothing while the side is frozen).
        self.drivers[side].pause_arms(false);
        self.note(|| format!("side {side}: forked child {child_pid}"));
        self.fork_outcome.forked += 1;
        self.schedule(now + sc.child_after, WEvent::ForkChild(side));
        self.schedule(now + sc.parent_after, WEvent::ForkParentCloses(side));
        self.schedule(
            now + FORK_GRACE + Duration::from_micros(1),
            WEvent::ForkLook(side),
        );
        if let Some(after) = sc.parent_dies {
            self.schedule(now + after, WEvent::ForkParentDies(side));
        }
    }

    /// Does the parent of `side`'s fork still hold its copy of the
    /// descriptor (a child's exec waits for its close before it parks)?
    pub(super) fn fork_parent_holds(&self, side: usize) -> bool {
        self.procs[side]
            .fork
            .as_ref()
            .is_some_and(|f| f.child.is_some() && !f.parent_closed && !f.parent_dead)
    }

    /// The endpoint an exec's new image takes `side` up on: the process
    /// keeps its pid, so a forked child's copy stays the child's.
    pub(super) fn endpoint_after_exec(&self, side: usize) -> SimEndpoint {
        match self.procs[side]
            .fork
            .as_ref()
            .and_then(|f| f.child.as_ref())
        {
            Some(child) if child.ep.ownership() == Ownership::Mine => child.ep.clone(),
            _ => SimEndpoint::new(std::rc::Rc::clone(&self.fabric), side),
        }
    }

    /// Did the process running `side` die, leaving the child its heir?
    pub(super) fn runner_dead(&self, side: usize) -> bool {
        self.procs[side]
            .fork
            .as_ref()
            .is_some_and(|f| f.runner_dead)
    }

    /// An heir's calls go to TCP once the peer moved the stream there for
    /// it.
    pub(super) fn heir_on_tcp(&self, side: usize) -> bool {
        self.runner_dead(side) && self.fabric.borrow().left_for_heirs(side)
    }

    /// The runner died with bytes: the peer reset the stream instead of
    /// moving it onto TCP for the heir, or did not move it within
    /// [`ORPHAN_WAIT`] (it had let the connection go: everything it sent
    /// was in the ring, and the dead runner had not read it all). The
    /// heir's calls are reset then, as the shim's.
    pub(super) fn heir_lost(&self, side: usize) -> bool {
        let Some(f) = self.procs[side].fork.as_ref().filter(|f| f.runner_dead) else {
            return false;
        };
        !self.fabric.borrow().left_for_heirs(side)
            && (matches!(
                self.drivers[1 - side].connection().state(),
                State::Aborted(_)
            ) || self.now >= f.died_at + ORPHAN_WAIT)
    }

    /// Before thread `t` makes a call on its side's engine (`phase`, a
    /// send or a receive): `Some(next step)` if the fork defers it. The
    /// call waits for the child to run (it is made again there), or, an
    /// heir's, for the peer to move the stream onto TCP for it (then it
    /// goes there) or to reset it.
    pub(super) fn fork_defers_call(&mut self, t: usize, phase: Phase) -> Option<Option<Phase>> {
        let side = self.threads[t].side;
        if self.fork_holds(side) {
            self.threads[t].waiting = Some(Wait::Fork);
            self.threads[t].phase = phase;
            return Some(None);
        }
        if !self.runner_dead(side) {
            return None;
        }
        if self.heir_lost(side) {
            self.threads[t].result = Some(Err(CallError::ConnReset));
            return Some(Some(phase));
        }
        self.sleep(t, Duration::from_millis(1));
        self.threads[t].phase = phase;
        Some(None)
    }

    /// The parent is killed. Only while it runs the side for a child that
    /// has not called yet does that touch the connection: the child is its
    /// heir, and the peer moves the stream onto TCP for it if nothing was
    /// lost with the parent (else it resets it), as with the shim's
    /// `Sharing::note_heir`. (A child that called already had its calls
    /// served by the parent, with buffers of the parent's; one engine
    /// stands for both here, so that case is left to the real-program
    /// test of a killed runner; nor is a death in the middle of the move
    /// onto TCP modelled.)
    pub(super) fn fork_parent_dies(&mut self, side: usize) {
        if self.procs[side].dead {
            return;
        }
        let c = self.drivers[side].connection();
        let settled = c.is_finished() || c.leaving_fabric() || *c.state() != State::Established;
        let f = self.procs[side].fork.as_mut().expect("a fork");
        let runs = f.parent.ep.ownership() == Ownership::Mine;
        if !runs {
            f.parent_dead = true;
            self.note(|| format!("side {side}: the parent dies (it does not run the side)"));
            return;
        }
        if f.child_started || settled {
            // (Not modelled: see above; the parent lives on.)
            return;
        }
        f.parent_dead = true;
        f.runner_dead = true;
        f.died_at = self.now;
        self.note(|| {
            format!("side {side}: the parent dies running the side; the child is its heir")
        });
        self.fork_outcome.heirs += 1;
        self.fabric.borrow_mut().kill_with_heir(side);
    }

    /// Is `side` frozen by its fork, or its runner dead (nobody may drive
    /// its engine)?
    pub(super) fn not_driven(&self, side: usize) -> bool {
        self.procs[side].fork.as_ref().is_some_and(|f| {
            f.runner_dead || (f.child.is_some() && f.parent.ep.ownership() == Ownership::Unclaimed)
        })
    }

    /// May the engine of `side` be driven now (by the process that runs
    /// it)? The parent's reactor looks: while the side is frozen within
    /// the grace, nobody drives it, and its events wait for the look after
    /// the grace.
    pub(super) fn fork_lets_run(&mut self, side: usize) -> bool {
        let now = self.now;
        let Some(f) = &self.procs[side].fork else {
            return true;
        };
        let (Some(forked_at), Some(child)) = (f.forked_at, &f.child) else {
            return true;
        };
        if f.runner_dead {
            return false;
        }
        if child.ep.ownership() == Ownership::Mine {
            return true;
        }
        if f.parent_dead {
            // Nobody takes it back: the child's call claims it.
            return false;
        }
        match f.parent.own.for_reactor(&f.parent.ep, || now) {
            ForReactor::Run => {
                if !std::mem::replace(
                    &mut self.procs[side].fork.as_mut().expect("a fork").parent_ran,
                    true,
                ) {
                    self.note(|| format!("side {side}: the parent takes it back"));
                    self.fork_outcome.taken_back += 1;
                }
                self.parent_runs(side);
                true
            }
            ForReactor::Gone => true,
            ForReactor::Wait => {
                let look = (forked_at + FORK_GRACE + Duration::from_micros(1)).max(now);
                let p = &mut self.procs[side];
                if p.poll_at.is_none_or(|t| t < look) {
                    p.poll_at = Some(look);
                    self.schedule(look, WEvent::Poll(side));
                }
                false
            }
        }
    }

    /// What the parent's reactor does while it runs the side: a close
    /// deferred during the grace, a request of the child to move onto TCP.
    fn parent_runs(&mut self, side: usize) {
        let f = self.procs[side].fork.as_ref().expect("a fork");
        if let Some(abort) = f.parent.own.take_deferred_close() {
            self.note(|| format!("side {side}: the parent's deferred close"));
            self.end_in_parent(side, abort);
        }
        let f = self.procs[side].fork.as_ref().expect("a fork");
        let c = self.drivers[side].connection();
        if f.parent.ep.leave_requested() && !c.leaving_fabric() && *c.state() != State::Switched {
            self.note(|| format!("side {side}: the child asks to share by TCP"));
            self.fork_outcome.moved_for_child += 1;
            self.drivers[side].leave_fabric();
        }
    }

    /// The parent ends its copy while it runs the side, as the shim does
    /// ([`ownership::ending`]): the child holds the descriptor until its
    /// application closes, so the stream moves onto TCP for it; once the
    /// child closed, the end is the child's close (one engine stands for
    /// both copies here).
    fn end_in_parent(&mut self, side: usize, abort: bool) {
        let c = self.drivers[side].connection();
        let child_holds = !self.procs[side].closed;
        let gone = self.drivers[side].peer_left() || matches!(c.state(), State::Aborted(_));
        let moving = c.leaving_fabric() || *c.state() == State::Switched;
        match ownership::ending(child_holds, gone, abort) {
            Ending::OntoTcp if !moving => {
                self.note(|| format!("side {side}: moves onto TCP for the child"));
                self.fork_outcome.moved_for_child += 1;
                self.drivers[side].leave_fabric();
            }
            Ending::OntoTcp => {}
            // Once the child closed, the engine both copies share is
            // closing already.
            _ if !child_holds => {}
            Ending::TellThenClose | Ending::Close => {
                self.note(|| format!("side {side}: the parent's close ends the side"));
                self.drivers[side].submit_close();
            }
            Ending::Abort => self.drivers[side].abort(),
        }
    }

    /// The child's first call: it claims and adopts the side, or (the
    /// parent took it back) asks it to move onto TCP. Then the
    /// application goes on.
    pub(super) fn fork_child_calls(&mut self, side: usize) {
        if self.procs[side].dead {
            return;
        }
        let f = self.procs[side].fork.as_mut().expect("a fork");
        f.child_started = true;
        let child = f.child.as_ref().expect("a child");
        let pid = child.pid();
        let decision = child.own.for_call(&child.ep, pid, || true);
        match decision {
            Use::Adopt => {
                child.own.adopted(pid);
                self.note(|| format!("side {side}: child {pid} adopts the side"));
                self.fork_outcome.adopted += 1;
                if let Some(after) = self.sc.fork.and_then(|f| f.child_execs) {
                    // sshd's child re-executes itself.
                    self.schedule(self.now + after, WEvent::Exec(side));
                }
                let p = SimProtector::new(
                    side,
                    std::rc::Rc::clone(&self.mems),
                    self.rng.fork(),
                    self.sc.p_arm_fail,
                );
                self.protect[side] = std::rc::Rc::clone(&p.log);
                self.drivers[side].forget_calls_except(&[]);
                self.drivers[side].replace_protector(p);
                // Its own reactor looks at once.
                self.procs[side].poll_at = Some(self.now);
                self.schedule(self.now, WEvent::Poll(side));
            }
            Use::NotMine => {
                child.ep.request_leave();
                self.note(|| format!("side {side}: child {pid} shares the side by TCP"));
                // The parent's reactor sees it at its next look.
                let at = self.now + Duration::from_micros(self.rng.range(1, 1_000_000));
                self.schedule(at, WEvent::ForkLook(side));
            }
            Use::Mine => {}
        }
        self.resume(side, Wait::Fork);
        self.settle(side);
    }

    /// The parent closes its copy.
    pub(super) fn fork_parent_closes(&mut self, side: usize) {
        let f = self.procs[side].fork.as_mut().expect("a fork");
        if self.procs[side].dead || f.parent_dead {
            return;
        }
        f.parent_closed = true;
        match f.parent.own.close(&f.parent.ep, false) {
            Close::Now => {
                self.note(|| format!("side {side}: the parent closes its copy"));
                self.end_in_parent(side, false);
            }
            Close::Deferred => self.note(|| format!("side {side}: the parent's close deferred")),
            Close::NotOurs => self.note(|| format!("side {side}: the parent closes its copy")),
        }
        // A child's exec may have waited for this close.
        self.settle(side);
    }

    /// The parent's reactor looks at the side (a timer of its own).
    pub(super) fn fork_look(&mut self, side: usize) {
        if self.procs[side].dead || !self.fork_lets_run(side) {
            return;
        }
        self.drivers[side].turn();
        self.settle(side);
    }
}
