//! Whether a client's next connection to a destination is worth offering
//! to pair.
//!
//! A pair costs both processes hundreds of microseconds (an offer with a
//! segment, checks of each other, a handshake, a teardown), which a
//! connection of a request or two never repays: HTTP without keep-alive,
//! `pgbench -C`, or any connection a forking server hands to its child
//! (which stays on TCP). A process remembers, per destination, how its
//! last paired connections there went; after [`SHORT_STREAK`] in a row
//! that did not repay their pair, it offers only one connection in
//! [`PROBE_EVERY`], whose outcome says whether that changed; each probe
//! that does not repay either doubles the gap, up to
//! [`PROBE_EVERY_MOST`]. Each process keeps its own:
//! no message moves it, only how its own connections went (a listener
//! that never completes a pair costs its clients only the probes).
//!
//! No system calls: the caller gives the outcomes (docs/shim.md,
//! "Pairing").

use std::net::SocketAddr;
use std::time::Duration;

/// Outcomes in a row that did not repay their pair before a destination
/// is offered only now and then.
pub const SHORT_STREAK: u32 = 8;
/// While skipping, one connection in this many still offers...
pub const PROBE_EVERY: u32 = 16;
/// ...and in this many at most, after probes that did not repay either
/// (a probe costs about as much as a dozen connections' TCP set-up).
pub const PROBE_EVERY_MOST: u32 = 256;
/// Destinations remembered (the least recently used goes first).
pub const REMEMBERED: usize = 64;
/// A paired connection that lived this long after its `connect()`...
pub const LIVED: Duration = Duration::from_millis(20);
/// ...or moved this many bytes on the fabric repaid its pair.
pub const MOVED: u64 = 4 << 20;

/// Did a connection repay its pair? It must have moved bytes on the
/// fabric (one that a fork moved to TCP first, or that never joined, did
/// not), and lived [`LIVED`] or moved [`MOVED`]. (A pair that failed for
/// the listener's reasons is not judged at all: the caller's rule.)
pub fn repaid(lived: Duration, fabric_bytes: u64) -> bool {
    fabric_bytes > 0 && (lived >= LIVED || fabric_bytes >= MOVED)
}

#[derive(Debug)]
struct Destination {
    addr: SocketAddr,
    /// Outcomes in a row that did not repay.
    short: u32,
    /// Connections not offered since the last offer.
    skipped: u32,
    /// One connection in this many offers while skipping.
    gap: u32,
    /// When it was last asked about or told of (for eviction).
    used: u64,
}

impl Destination {
    /// A connection that offered did not repay (or found no listener):
    /// one more in the streak, and once skipping, a longer gap.
    fn missed(&mut self) {
        if self.short >= SHORT_STREAK {
            self.gap = (self.gap * 2).min(PROBE_EVERY_MOST);
        }
        self.short = self.short.saturating_add(1);
    }
}

/// One process's memory of its destinations.
#[derive(Debug, Default)]
pub struct PairHistory {
    dests: Vec<Destination>,
    clock: u64,
}

impl PairHistory {
    pub const fn new() -> PairHistory {
        PairHistory {
            dests: Vec::new(),
            clock: 0,
        }
    }

    /// Should a connection to `dst` offer now? Counts it as skipped if
    /// not.
    pub fn offer(&mut self, dst: SocketAddr) -> bool {
        let Some(d) = self.find(dst) else {
            return true;
        };
        if d.short < SHORT_STREAK || d.skipped + 1 >= d.gap {
            d.skipped = 0;
            return true;
        }
        d.skipped += 1;
        false
    }

    /// A connection to `dst` that offered ended; `repaid`: see [`repaid`].
    pub fn record(&mut self, dst: SocketAddr, repaid: bool) {
        if repaid {
            if let Some(d) = self.find(dst) {
                d.short = 0;
                d.skipped = 0;
                d.gap = PROBE_EVERY;
            }
            return;
        }
        let d = self.entry(dst);
        d.missed();
    }

    /// A connection to `dst` found no listener there to offer to (none
    /// registered, or none proven the listener's): a streak at once, so
    /// that the next connections skip the look (a dozen system calls
    /// each) until a probe finds one.
    pub fn record_no_listener(&mut self, dst: SocketAddr) {
        let d = self.entry(dst);
        d.missed();
        d.short = d.short.max(SHORT_STREAK);
    }

    /// `dst`'s entry, if remembered, marked used.
    fn find(&mut self, dst: SocketAddr) -> Option<&mut Destination> {
        self.clock += 1;
        let now = self.clock;
        let d = self.dests.iter_mut().find(|d| d.addr == dst)?;
        d.used = now;
        Some(d)
    }

    /// `dst`'s entry, made if new (forgetting the least recently used
    /// one when full).
    fn entry(&mut self, dst: SocketAddr) -> &mut Destination {
        self.clock += 1;
        let now = self.clock;
        let i = match self.dests.iter().position(|d| d.addr == dst) {
            Some(i) => i,
            None => {
                if self.dests.len() >= REMEMBERED {
                    let oldest = (0..self.dests.len())
                        .min_by_key(|&i| self.dests[i].used)
                        .unwrap_or(0);
                    self.dests.swap_remove(oldest);
                }
                self.dests.push(Destination {
                    addr: dst,
                    short: 0,
                    skipped: 0,
                    gap: PROBE_EVERY,
                    used: now,
                });
                self.dests.len() - 1
            }
        };
        let d = &mut self.dests[i];
        d.used = now;
        d
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn addr(port: u16) -> SocketAddr {
        SocketAddr::from(([127, 0, 0, 1], port))
    }

    #[test]
    fn short_connections_stop_offers_but_for_probes_and_one_that_repays_restores_them() {
        let mut h = PairHistory::new();
        let (a, b) = (addr(80), addr(6379));
        for _ in 0..SHORT_STREAK - 1 {
            assert!(h.offer(a));
            h.record(a, false);
        }
        assert!(h.offer(a), "not yet a streak");
        h.record(a, false);
        // Now one in PROBE_EVERY offers.
        let offered: Vec<bool> = (0..3 * PROBE_EVERY).map(|_| h.offer(a)).collect();
        assert_eq!(offered.iter().filter(|o| **o).count(), 3, "{offered:?}");
        assert!(offered[PROBE_EVERY as usize - 1]);
        // Another destination is its own.
        assert!(h.offer(b));
        // A probe that repays restores every offer.
        h.record(a, true);
        assert!((0..2 * PROBE_EVERY).all(|_| h.offer(a)));
    }

    #[test]
    fn each_probe_that_does_not_repay_doubles_the_gap_up_to_the_most() {
        let mut h = PairHistory::new();
        let a = addr(80);
        for _ in 0..SHORT_STREAK {
            h.record(a, false);
        }
        let mut gaps = Vec::new();
        for _ in 0..7 {
            let gap = (1..=2 * PROBE_EVERY_MOST).find(|_| h.offer(a)).unwrap();
            gaps.push(gap);
            h.record(a, false);
        }
        assert_eq!(gaps, [16, 32, 64, 128, 256, 256, 256]);
        h.record(a, true);
        assert!((0..PROBE_EVERY).all(|_| h.offer(a)), "restored");
    }

    #[test]
    fn the_least_recently_used_destination_is_forgotten_first() {
        let mut h = PairHistory::new();
        for p in 0..REMEMBERED as u16 {
            for _ in 0..SHORT_STREAK {
                h.record(addr(p), false);
            }
        }
        // Port 0 is asked about (used); port 1 is the oldest now.
        assert!(!h.offer(addr(0)));
        for _ in 0..SHORT_STREAK {
            h.record(addr(1000), false);
        }
        assert_eq!(h.dests.len(), REMEMBERED);
        assert!(h.offer(addr(1)), "forgotten: offers again");
        assert!(!h.offer(addr(0)), "remembered");
        assert!(!h.offer(addr(1000)));
    }

    #[test]
    fn a_destination_without_a_listener_is_skipped_at_once_until_a_probe_repays() {
        let mut h = PairHistory::new();
        let a = addr(8080);
        assert!(h.offer(a));
        h.record_no_listener(a);
        let offered: Vec<bool> = (0..2 * PROBE_EVERY).map(|_| h.offer(a)).collect();
        assert_eq!(offered.iter().filter(|o| **o).count(), 2, "{offered:?}");
        // The listener came: a probe that repays restores every offer.
        h.record(a, true);
        assert!((0..PROBE_EVERY).all(|_| h.offer(a)));
        // A probe that finds none again keeps skipping.
        h.record_no_listener(a);
        assert!(!h.offer(a));
    }

    #[test]
    fn a_pair_repays_when_it_moved_bytes_on_the_fabric_and_lived_or_moved_enough() {
        assert!(!repaid(Duration::from_secs(10), 0), "never on the fabric");
        assert!(!repaid(Duration::from_millis(2), 1024));
        assert!(repaid(LIVED, 1));
        assert!(repaid(Duration::from_millis(1), MOVED));
        // A destination never short is not remembered at all.
        let mut h = PairHistory::new();
        h.record(addr(1), true);
        assert!(h.dests.is_empty());
    }
}
