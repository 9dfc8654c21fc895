//! What the driver asks of page protection: write-protect source pages,
//! arm receive destinations, stage and land GETs into armed pages, wake
//! threads faulting on pages that need nothing more. The backends
//! ([`super::uffd`], [`super::mprotect`]) implement it; [`NoProtection`]
//! stands in where none is available.
//!
//! It lives here, not with the driver, so that protection depends on
//! nothing of the driver's (the driver uses it, not the other way round).

use std::ops::Range;

use crate::conn::{DisarmOutcome, OpError};

/// Page protection for the driver: write-protect, arm, copy aside.
pub trait Protector {
    /// What this protector can do (merged into the engine's capabilities).
    fn can_protect(&self) -> bool;
    fn protect(&mut self, ranges: &[Range<u64>]) -> Result<(), OpError>;
    fn unprotect(&mut self, range: Range<u64>);
    /// Can receives be armed (receive-side protection)?
    fn can_arm(&self) -> bool {
        false
    }
    /// Can it protect shared memory together with all its aliases?
    fn can_protect_aliases(&self) -> bool {
        false
    }
    fn arm(&mut self, range: Range<u64>) -> Result<(), OpError>;
    /// Where a GET into armed `range` must write (staging), if elsewhere.
    fn staging(&self, _range: &Range<u64>) -> Option<u64> {
        None
    }
    /// The GET into armed `range` finished: put its data in place.
    fn land(&mut self, _range: &Range<u64>) -> Result<(), OpError> {
        Ok(())
    }
    fn disarm(&mut self, range: Range<u64>, outcome: DisarmOutcome);
    /// Let threads faulting on `range` retry (their pages need nothing more).
    fn wake(&mut self, range: Range<u64>);
    /// `range` is being unmapped: forget any state kept for it.
    fn forget(&mut self, _range: Range<u64>) {}
}

/// No page protection: sends are ZSDP, receives are synchronous.
#[derive(Debug, Default)]
pub struct NoProtection;

impl Protector for NoProtection {
    fn can_protect(&self) -> bool {
        false
    }
    fn protect(&mut self, _: &[Range<u64>]) -> Result<(), OpError> {
        Err(OpError::Local)
    }
    fn unprotect(&mut self, _: Range<u64>) {}
    fn arm(&mut self, _: Range<u64>) -> Result<(), OpError> {
        Err(OpError::Local)
    }
    fn disarm(&mut self, _: Range<u64>, _: DisarmOutcome) {}
    fn wake(&mut self, _: Range<u64>) {}
}

impl Protector for Box<dyn Protector + Send> {
    fn can_protect(&self) -> bool {
        (**self).can_protect()
    }
    fn protect(&mut self, ranges: &[Range<u64>]) -> Result<(), OpError> {
        (**self).protect(ranges)
    }
    fn unprotect(&mut self, range: Range<u64>) {
        (**self).unprotect(range)
    }
    fn can_arm(&self) -> bool {
        (**self).can_arm()
    }
    fn can_protect_aliases(&self) -> bool {
        (**self).can_protect_aliases()
    }
    fn arm(&mut self, range: Range<u64>) -> Result<(), OpError> {
        (**self).arm(range)
    }
    fn staging(&self, range: &Range<u64>) -> Option<u64> {
        (**self).staging(range)
    }
    fn land(&mut self, range: &Range<u64>) -> Result<(), OpError> {
        (**self).land(range)
    }
    fn disarm(&mut self, range: Range<u64>, outcome: DisarmOutcome) {
        (**self).disarm(range, outcome)
    }
    fn wake(&mut self, range: Range<u64>) {
        (**self).wake(range)
    }
    fn forget(&mut self, range: Range<u64>) {
        (**self).forget(range)
    }
}
