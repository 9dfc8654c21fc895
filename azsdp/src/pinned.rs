//! The memory this process keeps pinned for a NIC: every live RDMA
//! registration of every connection (and of the process's own loopback
//! lock words), whichever endpoint made it.
//!
//! Arming a receive moves its pages with `UFFDIO_MOVE`, which a pinned page
//! in the same transparent huge page forbids: 6.18 says EBUSY, 6.12
//! retries inside the kernel for ever (a livelock no user-space bound
//! reaches, docs/protocol.md §1.1). An endpoint knows its own pins only, so
//! before arming any connection's receive (over any fabric) the driver's
//! fabric asks here whether some registration of this process pins a page
//! within the 2 MiB windows of the range ([`near`]).
//!
//! A forked child inherits this list but not the pins (the kernel copies
//! pinned pages for the child at fork): entries name the process that made
//! them, and only the current process's count. What the program pins by
//! itself (io_uring fixed buffers, its own RDMA) is not known here.

use std::ops::Range;
use std::sync::atomic::{AtomicU64, Ordering};

use crate::sync::Lock;

/// The span of a transparent huge page.
pub const HUGE_PAGE: u64 = 2 << 20;

#[derive(Debug)]
struct Entry {
    token: u64,
    pid: u32,
    range: Range<u64>,
}

static PINNED: Lock<Vec<Entry>> = Lock::new(Vec::new());
static NEXT: AtomicU64 = AtomicU64::new(1);

/// A range recorded as pinned while this lives.
#[derive(Debug)]
pub struct Pin {
    token: u64,
}

/// Record `[addr, addr+len)` as pinned by this process.
pub fn pin(addr: u64, len: u64) -> Pin {
    let token = NEXT.fetch_add(1, Ordering::Relaxed);
    PINNED.lock().push(Entry {
        token,
        pid: crate::process::pid(),
        range: addr..addr.saturating_add(len),
    });
    Pin { token }
}

impl Drop for Pin {
    fn drop(&mut self) {
        let mut all = PINNED.lock();
        if let Some(i) = all.iter().position(|e| e.token == self.token) {
            all.swap_remove(i);
        }
    }
}

/// The 2 MiB-aligned windows `range` lies in.
pub fn huge_windows(range: &Range<u64>) -> Range<u64> {
    range.start - range.start % HUGE_PAGE..range.end.next_multiple_of(HUGE_PAGE)
}

/// Does some registration of this process pin a page within the huge
/// pages `range` lies in?
pub fn near(range: &Range<u64>) -> bool {
    let w = huge_windows(range);
    let me = crate::process::pid();
    PINNED
        .lock()
        .iter()
        .any(|e| e.pid == me && e.range.start < w.end && w.start < e.range.end)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_pin_counts_within_its_huge_pages_while_it_lives() {
        // (Addresses no other test of this process pins.)
        let base = 0x7e00_0000_0000u64;
        let p = pin(base + HUGE_PAGE + 4096, 8192);
        assert!(near(&(base + HUGE_PAGE..base + HUGE_PAGE + 4096)));
        assert!(near(&(base + 2 * HUGE_PAGE - 4096..base + 2 * HUGE_PAGE)));
        assert!(!near(&(base..base + 4096)), "the huge page before");
        assert!(!near(&(base + 2 * HUGE_PAGE..base + 2 * HUGE_PAGE + 4096)));
        drop(p);
        assert!(!near(&(base + HUGE_PAGE..base + HUGE_PAGE + 4096)));
    }

    #[test]
    fn windows_are_whole_huge_pages() {
        assert_eq!(
            huge_windows(&(HUGE_PAGE + 1..HUGE_PAGE + 2)),
            HUGE_PAGE..2 * HUGE_PAGE
        );
        assert_eq!(huge_windows(&(0..HUGE_PAGE + 1)), 0..2 * HUGE_PAGE);
    }
}
