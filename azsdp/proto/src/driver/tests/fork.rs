//! Who runs a side after `fork()`, over the sim fabric's shared words:
//! random interleavings of the processes' calls, reactor looks, closes and
//! further forks, at random times, checked against the rules of
//! [`crate::driver::ownership`].

use super::*;
use crate::driver::ownership::{Close, FORK_GRACE, ForReactor, ForkOwnership, Use};
use crate::fabric::sim::FIRST_PID;
use crate::fabric::{Ownership, Sharing};

/// One process holding a copy of side 1.
struct Copy {
    pid: u32,
    ep: SimEndpoint,
    own: ForkOwnership,
    /// May it adopt (a sandboxed child may not start threads)?
    can_adopt: bool,
    /// It was told the connection is another's (NotMine, Gone, NotOurs).
    lost: bool,
    closed: bool,
}

/// What happened to the side, over every copy.
#[derive(Default)]
struct Seen {
    /// The process that last got a verdict to run the side, and since
    /// when no other has claimed it.
    runner: Option<u32>,
    deferred_taken: u32,
    /// When the last fork froze the side.
    frozen_at: Timestamp,
}

fn run_verdict(seen: &mut Seen, c: &Copy, why: &str, seed: u64) {
    assert!(
        !c.lost,
        "seed {seed}: pid {} lost the side, then {why}",
        c.pid
    );
    if let Some(r) = seen.runner {
        assert_eq!(
            r, c.pid,
            "seed {seed}: pid {} runs the side ({why}) while {r} does",
            c.pid
        );
    }
    seen.runner = Some(c.pid);
}

fn interleave(seed: u64) {
    let p = Pair::new(cfg(Role::Client), cfg(Role::Server));
    let mut rng = Rng::new(seed);
    let first = p.d[1].fabric().forked(FIRST_PID[1]);
    let mut copies = vec![Copy {
        pid: FIRST_PID[1],
        own: ForkOwnership::new(FIRST_PID[1]),
        ep: first,
        can_adopt: true,
        lost: false,
        closed: false,
    }];
    let mut seen = Seen {
        runner: Some(FIRST_PID[1]),
        ..Seen::default()
    };
    let mut now = Timestamp::ZERO;
    let mut next_pid = FIRST_PID[1] + 1;
    for _ in 0..rng.range(1, 40) {
        now = now + Duration::from_micros(rng.range(0, 600_000));
        let i = rng.below(copies.len() as u64) as usize;
        match rng.below(8) {
            // fork(): the process that runs the side freezes it, and the
            // child gets a copy of everything, its view included.
            0 if copies.len() < 4 => {
                let c = &copies[i];
                if c.closed || c.lost || !c.own.runs_here(&c.ep, c.pid) {
                    continue;
                }
                c.own.freeze(&c.ep, now);
                let child = Copy {
                    pid: next_pid,
                    ep: c.ep.forked(next_pid),
                    own: c.own.clone(),
                    can_adopt: rng.chance(0.8),
                    lost: false,
                    closed: false,
                };
                next_pid += 1;
                seen.runner = None;
                seen.frozen_at = now;
                copies.push(child);
            }
            1..=3 => {
                let c = &mut copies[i];
                if c.closed {
                    continue;
                }
                let adopt = c.can_adopt;
                match c.own.for_call(&c.ep, c.pid, || adopt) {
                    Use::Mine => run_verdict(&mut seen, c, "a call runs it", seed),
                    Use::Adopt => {
                        assert!(adopt, "seed {seed}: pid {} adopted unable to", c.pid);
                        run_verdict(&mut seen, c, "a call adopts it", seed);
                        c.own.adopted(c.pid);
                    }
                    Use::NotMine => c.lost = c.ep.ownership() == Ownership::Other,
                }
            }
            4..=5 => {
                // The reactor of a process whose threads drive its copy.
                let c = &mut copies[i];
                if c.own.orphaned(c.pid) || c.lost {
                    continue;
                }
                let was = c.ep.ownership();
                match c.own.for_reactor(&c.ep, || now) {
                    ForReactor::Run => {
                        assert!(
                            was == Ownership::Mine || now - seen.frozen_at >= FORK_GRACE,
                            "seed {seed}: taken back within the grace"
                        );
                        run_verdict(&mut seen, c, "its reactor runs it", seed);
                        if c.own.take_deferred_close().is_some() {
                            seen.deferred_taken += 1;
                        }
                    }
                    ForReactor::Gone => c.lost = true,
                    ForReactor::Wait => {
                        assert_eq!(c.ep.ownership(), Ownership::Unclaimed, "seed {seed}");
                    }
                }
            }
            _ => {
                let c = &mut copies[i];
                if c.closed || c.own.orphaned(c.pid) {
                    // (A child's copy it never used is not its to end.)
                    c.closed = true;
                    continue;
                }
                c.closed = true;
                match c.own.close(&c.ep, rng.chance(0.2)) {
                    Close::Now => run_verdict(&mut seen, c, "its close ends it", seed),
                    Close::Deferred => assert!(c.own.close_deferred(), "seed {seed}"),
                    Close::NotOurs => c.lost = true,
                }
            }
        }
    }
    // Left alone past the grace, a frozen side goes back to a process that
    // made it and is still there to run it (a parent whose child never
    // called), and a close deferred meanwhile is done then, once.
    now = now + FORK_GRACE + Duration::from_millis(1);
    let frozen = copies[0].ep.ownership() == Ownership::Unclaimed;
    let mut taken_back = false;
    for c in copies.iter_mut() {
        if c.own.orphaned(c.pid) || c.lost {
            continue;
        }
        if c.own.for_reactor(&c.ep, || now) == ForReactor::Run {
            run_verdict(&mut seen, c, "its reactor runs it after the grace", seed);
            taken_back = true;
            if c.own.take_deferred_close().is_some() {
                seen.deferred_taken += 1;
            }
        }
    }
    assert!(
        !frozen || taken_back,
        "seed {seed}: the side stayed frozen past the grace"
    );
    assert!(seen.deferred_taken <= 1, "seed {seed}: a close done twice");
    for c in &copies {
        assert!(
            !c.own.close_deferred() || seen.runner != Some(c.pid),
            "seed {seed}: pid {} runs the side with its close still deferred",
            c.pid
        );
    }
}

#[test]
fn one_process_runs_a_side_whatever_the_forks_calls_and_closes() {
    for seed in 0..3_000 {
        interleave(seed);
    }
}

#[test]
fn a_child_that_calls_first_takes_the_side_and_the_parent_lets_go() {
    let p = Pair::new(cfg(Role::Client), cfg(Role::Server));
    let parent = p.d[1].fabric().forked(FIRST_PID[1]);
    let own = ForkOwnership::new(FIRST_PID[1]);
    own.freeze(&parent, Timestamp::ZERO);
    let child_own = own.clone();
    let child = parent.forked(FIRST_PID[1] + 1);
    assert_eq!(own.close(&parent, false), Close::Deferred);
    assert_eq!(child_own.for_call(&child, child.pid(), || true), Use::Adopt);
    let late = Timestamp::ZERO + FORK_GRACE * 2;
    assert_eq!(own.for_reactor(&parent, || late), ForReactor::Gone);
    assert_eq!(own.for_call(&parent, parent.pid(), || true), Use::NotMine);
    // The parent's deferred close is not the child's connection's end.
    assert_eq!(child.ownership(), Ownership::Mine);
}
