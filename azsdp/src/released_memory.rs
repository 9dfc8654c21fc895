//! Memory the program gave back or replaced, for caches that outlive a
//! transfer (the `verbs` fabric's registration cache).
//!
//! A pinned registration kept after its transfer goes stale when its pages
//! are unmapped, moved, discarded or freed: the NIC would go on reading
//! and writing the old pages. The memory hooks (`free`, `realloc`,
//! `munmap`, `mremap`, `madvise`, `mmap` over a range) record each such
//! range here, and a cache reads the record before it trusts an entry.
//!
//! The hooks run inside allocators and may be called from any thread, so
//! recording allocates nothing and takes no lock a cache holds: a ring of
//! the last [`SLOTS`] ranges, each slot behind its own spin flag (held for
//! three stores), and a sequence number. A reader that fell more than the ring behind learns
//! that it missed some ranges, and must then drop everything it keeps.
//! Only ranges that overlap what some cache watches are recorded, so the
//! common `free` costs two loads.

use std::ops::Range;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};

/// Ranges remembered; a cache that reads less often than this many
/// releases happen drops all its entries. (32 KiB: a busy program frees
/// many small chunks between two receives, most of them beside a watched
/// buffer, inside the covering range.)
pub const SLOTS: usize = 1024;

struct Slot {
    busy: AtomicBool,
    /// The sequence number of the range held (0: none yet).
    seq: AtomicU64,
    start: AtomicU64,
    end: AtomicU64,
}

impl Slot {
    fn with<R>(&self, f: impl FnOnce() -> R) -> R {
        while self
            .busy
            .compare_exchange_weak(false, true, Ordering::Acquire, Ordering::Relaxed)
            .is_err()
        {
            std::thread::yield_now();
        }
        let r = f();
        self.busy.store(false, Ordering::Release);
        r
    }
}

static RING: [Slot; SLOTS] = [const {
    Slot {
        busy: AtomicBool::new(false),
        seq: AtomicU64::new(0),
        start: AtomicU64::new(0),
        end: AtomicU64::new(0),
    }
}; SLOTS];
/// Ranges recorded so far (the next one gets `RECORDED + 1`).
static RECORDED: AtomicU64 = AtomicU64::new(0);
/// What some cache watches, as one covering range (it only widens).
static WATCH_LO: AtomicU64 = AtomicU64::new(u64::MAX);
static WATCH_HI: AtomicU64 = AtomicU64::new(0);

/// From now on, releases overlapping `range` are recorded. Call before
/// the memory is pinned, so that no release after the pin goes unseen.
pub fn watch(range: Range<u64>) {
    WATCH_LO.fetch_min(range.start, Ordering::SeqCst);
    WATCH_HI.fetch_max(range.end, Ordering::SeqCst);
}

/// Does any cache watch released memory? (Nothing is recorded until one
/// does.)
pub fn watching() -> bool {
    WATCH_LO.load(Ordering::SeqCst) < WATCH_HI.load(Ordering::SeqCst)
}

/// `range` was (or is about to be) freed, unmapped, moved away, discarded
/// or mapped over.
pub fn record(range: Range<u64>) {
    if range.is_empty()
        || range.end <= WATCH_LO.load(Ordering::SeqCst)
        || WATCH_HI.load(Ordering::SeqCst) <= range.start
    {
        return;
    }
    let seq = RECORDED.fetch_add(1, Ordering::SeqCst) + 1;
    let slot = &RING[(seq % SLOTS as u64) as usize];
    slot.with(|| {
        // A slower writer of an older turn of the ring leaves the newer
        // range in place (its own is then reported as missed).
        if slot.seq.load(Ordering::Relaxed) < seq {
            slot.start.store(range.start, Ordering::Relaxed);
            slot.end.store(range.end, Ordering::Relaxed);
            slot.seq.store(seq, Ordering::Relaxed);
        }
    });
}

/// Where a cache has read up to.
#[derive(Debug)]
pub struct Reader {
    seen: u64,
}

/// What a cache learns when it reads.
#[derive(Debug, PartialEq, Eq)]
pub enum Released {
    /// These ranges (possibly none) since the last read.
    Ranges(Vec<Range<u64>>),
    /// More than the ring holds, or a range still being written: anything
    /// may have gone.
    Unknown,
}

impl Reader {
    /// A reader that sees releases from now on.
    pub fn new() -> Reader {
        Reader {
            seen: RECORDED.load(Ordering::SeqCst),
        }
    }

    /// Nothing released since the last read (a cheap check for a hit).
    pub fn is_current(&self) -> bool {
        RECORDED.load(Ordering::SeqCst) == self.seen
    }

    /// What was released since the last read.
    pub fn read(&mut self) -> Released {
        let upto = RECORDED.load(Ordering::SeqCst);
        let from = self.seen;
        self.seen = upto;
        if upto - from > SLOTS as u64 {
            return Released::Unknown;
        }
        let mut out = Vec::with_capacity((upto - from) as usize);
        for seq in from + 1..=upto {
            let slot = &RING[(seq % SLOTS as u64) as usize];
            let r = slot.with(|| {
                (slot.seq.load(Ordering::Relaxed) == seq)
                    .then(|| slot.start.load(Ordering::Relaxed)..slot.end.load(Ordering::Relaxed))
            });
            match r {
                Some(r) => out.push(r),
                None => return Released::Unknown,
            }
        }
        Released::Ranges(out)
    }
}

impl Default for Reader {
    fn default() -> Self {
        Reader::new()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    // The ring is process-wide and the tests run in parallel: each uses
    // its own addresses and looks only for its own ranges.

    fn ranges(r: Released) -> Option<Vec<Range<u64>>> {
        match r {
            Released::Ranges(v) => Some(v),
            Released::Unknown => None,
        }
    }

    #[test]
    fn a_watched_release_is_read_once() {
        let base = 0x7000_0000_0000;
        watch(base..base + 0x10_0000);
        let mut r = Reader::new();
        record(base + 0x1000..base + 0x2000);
        let seen = ranges(r.read()).expect("within the ring");
        assert!(seen.contains(&(base + 0x1000..base + 0x2000)));
        let again = ranges(r.read()).unwrap_or_default();
        assert!(!again.contains(&(base + 0x1000..base + 0x2000)));
    }

    #[test]
    fn a_release_nothing_watches_costs_no_record() {
        // Far below anything any test watches.
        let before = RECORDED.load(Ordering::SeqCst);
        let mut r = Reader { seen: before };
        record(0x10..0x20);
        let seen = ranges(r.read()).unwrap_or_default();
        assert!(!seen.contains(&(0x10..0x20)));
    }

    #[test]
    fn a_reader_that_fell_behind_the_ring_is_told_so() {
        let base = 0x7100_0000_0000;
        watch(base..base + 0x100_0000);
        let mut r = Reader::new();
        for i in 0..(SLOTS as u64 + 1) {
            record(base + i * 0x1000..base + (i + 1) * 0x1000);
        }
        assert_eq!(r.read(), Released::Unknown);
        let mut fresh = Reader::new();
        record(base..base + 0x1000);
        assert!(ranges(fresh.read()).is_some_and(|v| v.contains(&(base..base + 0x1000))));
    }

    #[test]
    fn releases_from_many_threads_are_each_seen_or_reported_missed() {
        let base = 0x7200_0000_0000;
        watch(base..base + 0x1000_0000);
        let mut r = Reader::new();
        let threads: Vec<_> = (0..4u64)
            .map(|t| {
                std::thread::spawn(move || {
                    for i in 0..8u64 {
                        let a = base + (t * 8 + i) * 0x1000;
                        record(a..a + 0x1000);
                    }
                })
            })
            .collect();
        for t in threads {
            t.join().expect("recorder");
        }
        match r.read() {
            Released::Ranges(v) => {
                for n in 0..32u64 {
                    let a = base + n * 0x1000;
                    assert!(v.contains(&(a..a + 0x1000)), "range {n} lost");
                }
            }
            // Other tests' records may have pushed ours out of the ring.
            Released::Unknown => {}
        }
    }
}
