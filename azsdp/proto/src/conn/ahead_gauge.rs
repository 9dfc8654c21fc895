//! Whether reading ahead pays on this connection, found by trying it.
//!
//! Reading ahead (`conn::ahead`) keeps several GETs in flight at the price
//! of a copy at the receiver. Which wins depends on the fabric, not on
//! anything the engine can see in one GET: on SoftRoCE under Linux 6.12 a
//! READ turns around slowly and reading ahead streams 64 KiB receives 1.32x
//! faster even with the copy; under 6.1 the same device is busy for the
//! whole READ, and the copy makes them 0.86x as fast (docs/benchmarks.md).
//! So with `read_ahead = "auto"` the gauge
//! measures the rate at which the program takes the peer's advertised bytes,
//! in epochs of four times the read-ahead budget (within [`EPOCH_MIN`] and
//! [`EPOCH_MAX`]; 4 MiB for `auto`'s 1 MiB), with reading ahead off and on in turn (off,
//! on, on, off: a drift of the host's speed falls on both alike), keeps the
//! better, and tries again after [`HOLD`] epochs (the program, the host and
//! the peer change).
//!
//! An epoch starts only once the bytes fetched under the previous setting
//! are through (the first `budget` bytes after a change are not timed), and
//! one in which the program paused (a gap between takes many times the
//! usual one) is timed again: only a program that keeps reading says what
//! the setting is worth.

use std::time::Duration;

use crate::time::Timestamp;

/// Bytes taken per timed epoch, at least and at most.
pub const EPOCH_MIN: u64 = 256 << 10;
pub const EPOCH_MAX: u64 = 16 << 20;
/// Epochs a decision holds before the gauge tries again.
pub const HOLD: u32 = 32;
/// A gap between takes this many times the usual one is a pause of the
/// program's (or of the peer's sending), which makes the epoch's time
/// meaningless ...
const PAUSE_FACTOR: f64 = 16.0;
/// ... if it is longer than this, too.
pub const PAUSE_MIN: Duration = Duration::from_millis(2);
/// How much faster reading ahead must be to be kept (it costs a copy
/// and staging memory; a tie, or a difference within the emulator's
/// noise, goes to zero-copy).
const MARGIN: f64 = 1.05;
/// The settings the probe times, in order.
const PROBE: [bool; 4] = [false, true, true, false];

#[derive(Clone, Debug, PartialEq, serde::Serialize, serde::Deserialize)]
enum Phase {
    /// Timing step `step` of [`PROBE`].
    Probing { step: usize },
    /// The decision holds for `left` more epochs.
    Holding { left: u32 },
}

/// The gauge of one connection's receive side.
#[derive(Clone, Debug, serde::Serialize, serde::Deserialize)]
pub struct AheadGauge {
    /// Bytes fetched ahead at most (the first bytes after a change are
    /// not timed: they were fetched under the old setting).
    budget: u64,
    /// Bytes per timed epoch.
    epoch: u64,
    phase: Phase,
    on: bool,
    /// Bytes still to take before the epoch's clock starts.
    settle: u64,
    /// The current epoch: when its clock started, its last take, bytes.
    started: Option<Timestamp>,
    last: Timestamp,
    bytes: u64,
    /// The usual gap between takes (nanoseconds, a moving average; 0: none
    /// seen yet).
    gap_ns: f64,
    /// Rates (bytes per second) the probe measured: off, on.
    rates: [f64; 2],
}

impl AheadGauge {
    pub fn new(budget: u64) -> Self {
        AheadGauge {
            budget,
            epoch: budget.saturating_mul(4).clamp(EPOCH_MIN, EPOCH_MAX),
            phase: Phase::Probing { step: 0 },
            on: PROBE[0],
            settle: 0,
            started: None,
            last: Timestamp::ZERO,
            bytes: 0,
            gap_ns: 0.0,
            rates: [0.0; 2],
        }
    }

    /// Read ahead now?
    pub fn reading_ahead(&self) -> bool {
        self.on
    }

    /// The program took `n` advertised bytes at `now`. Whether the
    /// setting changed.
    pub fn took(&mut self, now: Timestamp, n: u64) -> bool {
        if self.settle > 0 {
            let k = n.min(self.settle);
            self.settle -= k;
            if self.settle > 0 {
                return false;
            }
            self.start(now, 0);
            return false;
        }
        let Some(started) = self.started else {
            self.start(now, n);
            return false;
        };
        let gap = now.saturating_since(self.last);
        let gap_ns = gap.as_nanos() as f64;
        if self.gap_ns > 0.0 && gap >= PAUSE_MIN && gap_ns > self.gap_ns * PAUSE_FACTOR {
            // The program paused: time this epoch again from here.
            self.start(now, n);
            return false;
        }
        self.gap_ns = if self.gap_ns > 0.0 {
            0.875 * self.gap_ns + 0.125 * gap_ns
        } else {
            gap_ns
        };
        self.last = now;
        self.bytes += n;
        if self.bytes < self.epoch {
            return false;
        }
        let secs = now.saturating_since(started).as_secs_f64();
        let rate = if secs > 0.0 {
            self.bytes as f64 / secs
        } else {
            f64::MAX
        };
        self.started = None;
        self.bytes = 0;
        self.next(rate)
    }

    /// Start the epoch's clock at `now`, with `n` bytes taken then.
    fn start(&mut self, now: Timestamp, n: u64) {
        self.started = Some(now);
        self.last = now;
        self.bytes = n;
    }

    /// An epoch ended at `rate`: on to the next, and the setting it wants.
    fn next(&mut self, rate: f64) -> bool {
        let was = self.on;
        match self.phase {
            Phase::Probing { step } => {
                self.rates[usize::from(PROBE[step])] += rate;
                if step + 1 < PROBE.len() {
                    self.phase = Phase::Probing { step: step + 1 };
                    self.on = PROBE[step + 1];
                } else {
                    self.on = self.rates[1] > self.rates[0] * MARGIN;
                    self.rates = [0.0; 2];
                    self.phase = Phase::Holding { left: HOLD };
                }
            }
            Phase::Holding { left } => {
                if left > 1 {
                    self.phase = Phase::Holding { left: left - 1 };
                } else {
                    self.phase = Phase::Probing { step: 0 };
                    self.on = PROBE[0];
                }
            }
        }
        if self.on != was {
            self.settle = self.budget;
        }
        self.on != was
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    /// Feed the gauge a program taking `chunk`-byte pieces, at `rate(on)`
    /// bytes per second, until it decides (at most `limit` bytes); what
    /// it decided.
    fn decide(
        g: &mut AheadGauge,
        limit: u64,
        chunk: u64,
        rate: impl Fn(bool) -> f64,
    ) -> Option<bool> {
        let mut now = Timestamp::from_nanos(1_000_000_000);
        let mut done = 0;
        while done < limit {
            let dt = chunk as f64 / rate(g.reading_ahead());
            now = now + Duration::from_secs_f64(dt);
            g.took(now, chunk);
            if let Some(d) = decided(g) {
                return Some(d);
            }
            done += chunk;
        }
        None
    }

    fn decided(g: &AheadGauge) -> Option<bool> {
        matches!(g.phase, Phase::Holding { .. }).then_some(g.on)
    }

    /// SoftRoCE's figures (MB/s, 64 KiB): 6.12 reads ahead faster; 6.1
    /// does not, nor does a gain within the margin.
    #[test]
    fn reading_ahead_is_kept_only_where_it_is_faster() {
        for (ahead, zero_copy, kept) in [
            (49e6, 39e6, true),
            (33e6, 36e6, false),
            (36e6, 36e6, false),
            (36.5e6, 36e6, false),
        ] {
            let mut g = AheadGauge::new(1 << 20);
            let rate = |on| if on { ahead } else { zero_copy };
            let d = decide(&mut g, 40 << 20, 64 << 10, rate);
            assert_eq!(d, Some(kept), "{ahead} vs {zero_copy}");
        }
    }

    #[test]
    fn it_tries_again_after_holding() {
        let mut g = AheadGauge::new(1 << 20);
        // Faster ahead at first, slower later (the peer moved, say).
        let mut flip = false;
        let mut now = Timestamp::from_nanos(1);
        let mut choices = Vec::new();
        for i in 0..4000u64 {
            if i == 1500 {
                flip = true;
            }
            let faster = g.reading_ahead() != flip;
            let rate = if faster { 50e6 } else { 35e6 };
            now = now + Duration::from_secs_f64((64u64 << 10) as f64 / rate);
            if g.took(now, 64 << 10) {
                choices.push((i, g.reading_ahead()));
            }
        }
        assert_eq!(decided(&g), Some(false), "{choices:?}");
        assert!(choices.iter().any(|&(i, on)| i < 1500 && on), "{choices:?}");
    }

    #[test]
    fn a_pause_restarts_the_epoch_instead_of_counting_as_slowness() {
        let mut g = AheadGauge::new(1 << 20);
        let mut now = Timestamp::from_nanos(1);
        let mut took = |g: &mut AheadGauge, dt: Duration| {
            now = now + dt;
            g.took(now, 64 << 10)
        };
        // Off: takes 1.5 ms apart. On: twice as fast, but the program
        // pauses for 10 s in the middle of the first timed epoch, which
        // must not count against reading ahead.
        let step = Duration::from_micros(1500);
        while !g.reading_ahead() {
            took(&mut g, step);
        }
        while g.settle > 0 || g.bytes < 10 << 16 {
            took(&mut g, step / 2);
        }
        took(&mut g, Duration::from_secs(10));
        while decided(&g).is_none() {
            let dt = if g.reading_ahead() { step / 2 } else { step };
            took(&mut g, dt);
        }
        assert_eq!(decided(&g), Some(true));
    }

    #[test]
    fn the_bytes_after_a_change_are_not_timed() {
        let mut g = AheadGauge::new(1 << 20);
        let mut now = Timestamp::from_nanos(1);
        // The first epoch (off) ends: on is wanted next, after settling.
        while !g.took(now, 64 << 10) {
            now = now + Duration::from_millis(1);
        }
        assert!(g.reading_ahead());
        assert_eq!(g.settle, 1 << 20);
        for _ in 0..16 {
            now = now + Duration::from_millis(1);
            g.took(now, 64 << 10);
        }
        assert_eq!(g.settle, 0);
        assert_eq!(g.bytes, 0, "the clock starts after settling");
    }

    proptest! {
        /// Whatever the rates and pieces, the gauge settles on the faster
        /// setting when the two differ by more than the margin and noise.
        #[test]
        fn the_faster_setting_wins(
            off in 10e6f64..10e9,
            ratio in prop_oneof![0.5f64..0.95, 1.1f64..2.0],
            chunk_kib in 4u64..2048,
            budget_kib in 0u64..4096,
        ) {
            let mut g = AheadGauge::new(budget_kib << 10);
            let on = off * ratio;
            let limit = 8 * (EPOCH_MAX + (budget_kib << 10) + (chunk_kib << 10));
            let d = decide(&mut g, limit, chunk_kib << 10, |a| if a { on } else { off });
            prop_assert_eq!(d, Some(ratio > 1.0));
        }
    }
}
