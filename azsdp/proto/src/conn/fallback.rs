//! Fault-rate fallback from AZ-SDP to ZSDP, and the way back.
//!
//! Each finished asynchronous advertisement reports how many write faults hit
//! it. When the last `window` of them saw `faults` or more, sends become
//! synchronous (ZSDP): a program that keeps rewriting its buffers gains nothing
//! from protection and pays a fault per send. After `recover` synchronous
//! sends, AZ-SDP is tried again; each relapse doubles that probation (capped).

use std::collections::VecDeque;

#[derive(Clone, Debug, serde::Serialize, serde::Deserialize)]
pub struct FaultMonitor {
    faults: u32,
    window: u32,
    recover: u32,
    recent: VecDeque<u32>,
    sum: u32,
    /// ZSDP sends left before retrying AZ-SDP; `None` while asynchronous.
    probation: Option<u64>,
    relapses: u32,
}

/// A change the monitor decided.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Verdict {
    Stay,
    FallBack,
    Recover,
}

impl FaultMonitor {
    pub fn new(faults: u32, window: u32, recover: u32) -> Self {
        FaultMonitor {
            faults,
            window: window.max(1),
            recover,
            recent: VecDeque::new(),
            sum: 0,
            probation: None,
            relapses: 0,
        }
    }

    pub fn is_fallen_back(&self) -> bool {
        self.probation.is_some()
    }

    /// An asynchronous advertisement finished after `faults` write faults.
    pub fn record_async(&mut self, faults: u32) -> Verdict {
        if self.faults == 0 || self.probation.is_some() {
            return Verdict::Stay;
        }
        self.recent.push_back(faults);
        self.sum += faults;
        while self.recent.len() > self.window as usize {
            self.sum -= self.recent.pop_front().unwrap_or(0);
        }
        if self.sum >= self.faults {
            let shift = self.relapses.min(10);
            self.relapses += 1;
            self.probation = Some(u64::from(self.recover) << shift);
            self.recent.clear();
            self.sum = 0;
            return Verdict::FallBack;
        }
        Verdict::Stay
    }

    /// A synchronous zero-copy send was made while fallen back.
    pub fn record_sync(&mut self) -> Verdict {
        match self.probation {
            Some(left) if self.recover > 0 => {
                if left <= 1 {
                    self.probation = None;
                    Verdict::Recover
                } else {
                    self.probation = Some(left - 1);
                    Verdict::Stay
                }
            }
            _ => Verdict::Stay,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn falls_back_and_recovers_with_growing_probation() {
        let mut m = FaultMonitor::new(3, 4, 2);
        assert_eq!(m.record_async(1), Verdict::Stay);
        assert_eq!(m.record_async(0), Verdict::Stay);
        assert_eq!(m.record_async(2), Verdict::FallBack);
        assert!(m.is_fallen_back());
        assert_eq!(m.record_sync(), Verdict::Stay);
        assert_eq!(m.record_sync(), Verdict::Recover);
        assert!(!m.is_fallen_back());
        for _ in 0..3 {
            m.record_async(1);
        }
        assert!(m.is_fallen_back());
        // second relapse: probation doubled to 4
        for _ in 0..3 {
            assert_eq!(m.record_sync(), Verdict::Stay);
        }
        assert_eq!(m.record_sync(), Verdict::Recover);
    }

    #[test]
    fn window_forgets_old_faults() {
        let mut m = FaultMonitor::new(2, 2, 1);
        assert_eq!(m.record_async(1), Verdict::Stay);
        assert_eq!(m.record_async(0), Verdict::Stay);
        assert_eq!(m.record_async(0), Verdict::Stay);
        assert_eq!(m.record_async(1), Verdict::Stay);
        assert_eq!(m.record_async(1), Verdict::FallBack);
    }

    #[test]
    fn zero_threshold_never_falls_back() {
        let mut m = FaultMonitor::new(0, 1, 1);
        for _ in 0..100 {
            assert_eq!(m.record_async(5), Verdict::Stay);
        }
    }
}
