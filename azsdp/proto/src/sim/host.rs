//! The simulated machine each side's driver runs on: a clock that the
//! world moves, the side's memory, and page protection that keeps the
//! pages' states in that memory and reports what the engine gets wrong.
//!
//! The world and the drivers share these through `Rc` handles: the
//! simulation runs on one thread, and no borrow is held across a call into
//! the driver.

use std::cell::{Cell, RefCell};
use std::collections::{HashMap, VecDeque};
use std::ops::Range;
use std::rc::Rc;

use super::memory::{Prot, SharedMems};
use super::rng::Rng;
use crate::conn::{DisarmOutcome, OpError, Resend, ResendPiece, Unprotectable, UserMemory};
use crate::driver::{Host, Protectable};
use crate::protect::Protector;
use crate::time::Timestamp;

/// Simulated time, shared by the world and both hosts.
#[derive(Clone, Debug, Default)]
pub struct SimClock(Rc<Cell<Timestamp>>);

impl SimClock {
    pub fn now(&self) -> Timestamp {
        self.0.get()
    }
    pub fn set(&self, t: Timestamp) {
        self.0.set(t);
    }
}

/// The run's trace (when verbose): lines stamped with simulated time.
#[derive(Clone, Debug, Default)]
pub struct Trace {
    lines: Option<Rc<RefCell<Vec<String>>>>,
    clock: SimClock,
}

impl Trace {
    pub fn new(on: bool, clock: SimClock) -> Trace {
        Trace {
            lines: on.then(Rc::default),
            clock,
        }
    }

    pub fn note(&self, line: impl FnOnce() -> String) {
        if let Some(l) = &self.lines {
            l.borrow_mut()
                .push(format!("{:?} {}", self.clock.now(), line()));
        }
    }

    pub fn take(&self) -> Vec<String> {
        self.lines
            .as_ref()
            .map(|l| std::mem::take(&mut *l.borrow_mut()))
            .unwrap_or_default()
    }
}

/// Ranges a host says cannot be protected, and why.
pub type Unprotectables = Rc<RefCell<Vec<(Range<u64>, Unprotectable)>>>;

/// The TCP connection beneath a simulated pair: what each side wrote to it
/// and the other has not read yet, and whether it shut its sending side.
#[derive(Debug, Default)]
pub struct SimTcp {
    pub wrote: [VecDeque<u8>; 2],
    pub shut: [bool; 2],
    /// What the drivers did with it that a real socket would punish.
    pub violations: Vec<String>,
}

/// The TCP connection, shared by both hosts and the world.
pub type SharedTcp = Rc<RefCell<SimTcp>>;

/// One side's host: its memory and the clock.
#[derive(Debug)]
pub struct SimHost {
    side: usize,
    mems: SharedMems,
    clock: SimClock,
    /// Memory this host calls unprotectable (all else is private).
    pub unprotectable: Unprotectables,
    /// How many times the driver asked [`Host::protectable`] (each is a
    /// system call on a real host).
    pub asked: Rc<Cell<u64>>,
    /// The TCP connection beneath.
    pub tcp: SharedTcp,
    /// The fabric, to see whether this side's SWITCH is out when it writes
    /// its resend.
    pub fabric: Option<Rc<RefCell<crate::fabric::sim::SimFabric>>>,
}

impl SimHost {
    pub fn new(side: usize, mems: SharedMems, clock: SimClock, tcp: SharedTcp) -> SimHost {
        SimHost {
            side,
            mems,
            clock,
            unprotectable: Rc::default(),
            asked: Rc::default(),
            tcp,
            fabric: None,
        }
    }
}

impl UserMemory for SimHost {
    fn read(&mut self, addr: u64, out: &mut [u8]) {
        self.mems.borrow_mut()[self.side].read(addr, out);
    }
    fn write(&mut self, addr: u64, data: &[u8]) {
        self.mems.borrow_mut()[self.side].write(addr, data);
    }
}

impl Host for SimHost {
    fn now(&self) -> Timestamp {
        self.clock.now()
    }
    /// Until this side's SWITCH the peer writes nothing: whatever is there
    /// came behind azsdp's back.
    fn stream_clean(&mut self) -> bool {
        self.tcp.borrow().wrote[1 - self.side].is_empty()
    }

    fn write_stream(&mut self, r: &Resend) -> bool {
        let mut tcp = self.tcp.borrow_mut();
        // A real socket's buffers are bounded: a resend larger than they
        // are blocks until the peer reads TCP, which it does only once it
        // has our SWITCH. So the SWITCH must be out first, whatever the
        // size (a live peer; a dead one's heirs read TCP at once).
        let bytes = r.len();
        if let Some(f) = &self.fabric {
            let f = f.borrow();
            if bytes > 0 && !f.switch_posted[self.side] && f.is_alive(1 - self.side) {
                tcp.violations.push(format!(
                    "side {}: resend of {bytes} bytes written before its SWITCH was posted \
                     (a real socket would block for ever once its buffers are full)",
                    self.side
                ));
            }
        }
        for p in &r.pieces {
            match p {
                ResendPiece::Bytes(b) => tcp.wrote[self.side].extend(b),
                ResendPiece::Memory { addr, len } => {
                    let mut b = vec![0u8; *len as usize];
                    self.mems.borrow_mut()[self.side].read_raw(*addr, &mut b);
                    tcp.wrote[self.side].extend(b);
                }
            }
        }
        tcp.shut[self.side] |= r.shutdown;
        true
    }

    fn protectable(&mut self, pages: &Range<u64>) -> Protectable {
        self.asked.set(self.asked.get() + 1);
        let overlaps = |r: &Range<u64>| r.start < pages.end && pages.start < r.end;
        match self
            .unprotectable
            .borrow()
            .iter()
            .find(|(r, _)| overlaps(r))
        {
            Some((_, why)) => Protectable::No(*why),
            None => Protectable::Private,
        }
    }
}

/// What a side's protection did that the world wants to know.
#[derive(Debug, Default)]
pub struct ProtectLog {
    /// Page ranges whose faulting threads were woken.
    pub woken: Vec<Range<u64>>,
    /// Armed ranges whose promised data never came.
    pub lost: Vec<Range<u64>>,
    /// What the engine asked that the pages' states forbid.
    pub violations: Vec<String>,
}

/// Where each side's staging pages live in its memory.
const STAGE_BASE: [u64; 2] = [0x6000_0000_0000, 0x6800_0000_0000];

/// Page protection over simulated memory, with the checks the kernel's
/// protection would make (protecting what is protected is an engine bug),
/// and staging pages for armed receives, as userfaultfd's.
#[derive(Debug)]
pub struct SimProtector {
    side: usize,
    mems: SharedMems,
    rng: Rng,
    p_arm_fail: f64,
    /// Armed range start -> its staging pages.
    staging: HashMap<u64, (u64, u64)>,
    next_stage: u64,
    pub log: Rc<RefCell<ProtectLog>>,
}

impl SimProtector {
    pub fn new(side: usize, mems: SharedMems, rng: Rng, p_arm_fail: f64) -> SimProtector {
        SimProtector {
            side,
            mems,
            rng,
            p_arm_fail,
            staging: HashMap::new(),
            next_stage: STAGE_BASE[side],
            log: Rc::default(),
        }
    }

    /// Pages that move (armed, landed) must not be pinned: the kernel
    /// refuses to move them, or on some kernels retries for ever.
    fn check_movable(&mut self, r: &Range<u64>, what: &str) {
        if self.mems.borrow()[self.side].pinned(r) {
            self.log.borrow_mut().violations.push(format!(
                "side {}: {what} moves pages of {r:x?} a registration pins",
                self.side
            ));
        }
    }

    fn set(&mut self, r: Range<u64>, from: Prot, to: Prot, what: &str) {
        let wrong = self.mems.borrow_mut()[self.side].set_prot(r.clone(), from, to);
        if !wrong.is_empty() {
            self.log.borrow_mut().violations.push(format!(
                "side {}: {what} of {r:x?} found pages not {from:?}: {wrong:x?}",
                self.side
            ));
        }
    }
}

impl Protector for SimProtector {
    fn can_protect(&self) -> bool {
        true
    }
    fn can_arm(&self) -> bool {
        true
    }
    fn protect(&mut self, ranges: &[Range<u64>]) -> Result<(), OpError> {
        for r in ranges {
            self.set(r.clone(), Prot::None, Prot::WriteProtected, "protect");
        }
        Ok(())
    }
    fn unprotect(&mut self, range: Range<u64>) {
        self.set(range, Prot::WriteProtected, Prot::None, "unprotect");
    }
    fn arm(&mut self, range: Range<u64>) -> Result<(), OpError> {
        if self.rng.chance(self.p_arm_fail) {
            return Err(OpError::Local);
        }
        self.check_movable(&range, "arm");
        self.set(range.clone(), Prot::None, Prot::Armed, "arm");
        let len = range.end - range.start;
        let page = self.mems.borrow()[self.side].page_size();
        let at = self.next_stage;
        self.next_stage += len.next_multiple_of(page) + page;
        self.staging.insert(range.start, (at, len));
        Ok(())
    }
    fn staging(&self, range: &Range<u64>) -> Option<u64> {
        self.staging
            .get(&range.start)
            .filter(|(_, len)| *len == range.end - range.start)
            .map(|(at, _)| *at)
    }
    fn land(&mut self, range: &Range<u64>) -> Result<(), OpError> {
        let Some(at) = self.staging(range) else {
            return Err(OpError::Local);
        };
        self.check_movable(&(at..at + (range.end - range.start)), "land");
        let mut m = self.mems.borrow_mut();
        let mut tmp = vec![0u8; (range.end - range.start) as usize];
        m[self.side].read_raw(at, &mut tmp);
        m[self.side].write_raw(range.start, &tmp);
        Ok(())
    }
    fn disarm(&mut self, range: Range<u64>, outcome: DisarmOutcome) {
        self.set(range.clone(), Prot::Armed, Prot::None, "disarm");
        if let Some((at, len)) = self.staging.remove(&range.start) {
            self.mems.borrow_mut()[self.side].discard(at..at + len);
        }
        if outcome == DisarmOutcome::Lost {
            self.log.borrow_mut().lost.push(range);
        }
    }
    fn wake(&mut self, range: Range<u64>) {
        self.log.borrow_mut().woken.push(range);
    }
}
