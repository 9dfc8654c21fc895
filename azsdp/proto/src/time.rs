//! Time as the engine sees it: a monotonic nanosecond count chosen by the driver.
//!
//! The engine never reads a clock. Drivers pass the current [`Timestamp`] with each
//! event; the simulator passes simulated time, the shim passes `CLOCK_MONOTONIC`.

use std::fmt;
use std::ops::{Add, Sub};
use std::time::Duration;

/// Nanoseconds since an arbitrary, driver-chosen epoch.
#[derive(
    Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash, Default, serde::Serialize, serde::Deserialize,
)]
pub struct Timestamp(pub u64);

impl Timestamp {
    pub const ZERO: Timestamp = Timestamp(0);

    pub fn from_nanos(ns: u64) -> Self {
        Timestamp(ns)
    }

    pub fn as_nanos(self) -> u64 {
        self.0
    }

    /// Time elapsed since `earlier`, zero if `earlier` is in the future.
    pub fn saturating_since(self, earlier: Timestamp) -> Duration {
        Duration::from_nanos(self.0.saturating_sub(earlier.0))
    }
}

impl Add<Duration> for Timestamp {
    type Output = Timestamp;
    fn add(self, d: Duration) -> Timestamp {
        let ns = u64::try_from(d.as_nanos()).unwrap_or(u64::MAX);
        Timestamp(self.0.saturating_add(ns))
    }
}

impl Sub<Timestamp> for Timestamp {
    type Output = Duration;
    fn sub(self, rhs: Timestamp) -> Duration {
        self.saturating_since(rhs)
    }
}

impl fmt::Debug for Timestamp {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "t={}.{:06}ms", self.0 / 1_000_000, self.0 % 1_000_000)
    }
}
