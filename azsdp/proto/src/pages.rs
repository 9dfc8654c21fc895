//! Page arithmetic and interval reference counts.
//!
//! Protection works on whole pages; a user buffer has an unaligned head and
//! tail that must never be protected (other objects live there). [`split`]
//! cuts a buffer into those three parts. [`RangeCounter`] counts, per byte
//! range, how many in-flight operations hold it, and reports exactly the
//! sub-ranges whose count leaves or reaches zero: those are what must be
//! protected or unprotected.

use std::collections::BTreeMap;
use std::ops::Range;

/// Round `addr` down to a multiple of `page` (a power of two).
pub fn page_down(addr: u64, page: u64) -> u64 {
    debug_assert!(page.is_power_of_two());
    addr & !(page - 1)
}

/// Round `addr` up to a multiple of `page`, saturating at the last page boundary.
pub fn page_up(addr: u64, page: u64) -> u64 {
    debug_assert!(page.is_power_of_two());
    match addr.checked_add(page - 1) {
        Some(a) => a & !(page - 1),
        None => page_down(u64::MAX, page),
    }
}

/// A buffer cut at page boundaries: lengths of the unaligned head, the
/// whole-page middle and the unaligned tail. `head + middle + tail == len`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Split {
    pub head: u64,
    pub middle: u64,
    pub tail: u64,
}

/// Cut `[addr, addr+len)` into head, whole pages and tail.
///
/// A buffer without a whole page inside it is all head.
pub fn split(addr: u64, len: u64, page: u64) -> Split {
    let end = addr.saturating_add(len);
    let first = page_up(addr, page);
    let last = page_down(end, page);
    if first >= last {
        return Split {
            head: len,
            middle: 0,
            tail: 0,
        };
    }
    Split {
        head: first - addr,
        middle: last - first,
        tail: end - last,
    }
}

/// Whole pages strictly inside `[addr, addr+len)`, as a byte range (maybe empty).
pub fn whole_pages(addr: u64, len: u64, page: u64) -> Range<u64> {
    let s = split(addr, len, page);
    let start = addr + s.head;
    start..start + s.middle
}

/// Pages touched by `[addr, addr+len)`, as a page-aligned byte range.
pub fn covering_pages(addr: u64, len: u64, page: u64) -> Range<u64> {
    page_down(addr, page)..page_up(addr.saturating_add(len), page)
}

/// Do two half-open ranges share a byte?
pub fn overlaps(a: &Range<u64>, b: &Range<u64>) -> bool {
    a.start < b.end && b.start < a.end && a.start < a.end && b.start < b.end
}

/// Reference counts over byte ranges, stored as disjoint intervals.
#[derive(Clone, Debug, Default)]
pub struct RangeCounter {
    /// start -> (end, count), count >= 1, intervals disjoint.
    map: BTreeMap<u64, (u64, u32)>,
}

impl RangeCounter {
    pub fn new() -> Self {
        Self::default()
    }

    pub fn is_empty(&self) -> bool {
        self.map.is_empty()
    }

    /// Number of references held on the byte at `addr`.
    /// The smallest range covering every counted interval.
    pub fn bounds(&self) -> Option<Range<u64>> {
        let lo = *self.map.keys().next()?;
        let hi = self.map.values().next_back()?.0;
        Some(lo..hi)
    }

    pub fn count_at(&self, addr: u64) -> u32 {
        match self.map.range(..=addr).next_back() {
            Some((_, &(end, c))) if addr < end => c,
            _ => 0,
        }
    }

    /// Does any referenced byte fall inside `r`?
    pub fn overlaps(&self, r: &Range<u64>) -> bool {
        if r.start >= r.end {
            return false;
        }
        if self.count_at(r.start) > 0 {
            return true;
        }
        self.map.range(r.start..r.end).next().is_some()
    }

    /// The referenced parts of `r`.
    pub fn intersect(&self, r: &Range<u64>) -> Vec<Range<u64>> {
        let mut out: Vec<Range<u64>> = Vec::new();
        if r.start >= r.end {
            return out;
        }
        let first = match self.map.range(..=r.start).next_back() {
            Some((&s, _)) => s,
            None => r.start,
        };
        for (&s, &(e, _)) in self.map.range(first..r.end) {
            let (a, b) = (s.max(r.start), e.min(r.end));
            if a < b {
                push_merged(&mut out, a..b);
            }
        }
        out
    }

    /// All referenced ranges, merged.
    pub fn ranges(&self) -> Vec<Range<u64>> {
        let mut out = Vec::new();
        for (&s, &(e, _)) in &self.map {
            push_merged(&mut out, s..e);
        }
        out
    }

    /// Split the interval containing `at` (if any) so that `at` starts one.
    fn split_at(&mut self, at: u64) {
        if let Some((&s, &(e, c))) = self.map.range(..at).next_back()
            && at < e
        {
            self.map.insert(s, (at, c));
            self.map.insert(at, (e, c));
        }
    }

    /// Merge neighbours with equal counts around `[lo, hi]` to keep the map small.
    fn coalesce(&mut self, lo: u64, hi: u64) {
        let start = self.map.range(..lo).next_back().map_or(lo, |(&s, _)| s);
        let keys: Vec<u64> = self.map.range(start..=hi).map(|(&s, _)| s).collect();
        let mut prev: Option<u64> = None;
        for s in keys {
            let (e, c) = self.map[&s];
            if let Some(p) = prev {
                let (pe, pc) = self.map[&p];
                if pe == s && pc == c {
                    self.map.remove(&s);
                    self.map.insert(p, (e, c));
                    continue;
                }
            }
            prev = Some(s);
        }
    }

    /// Take one reference on every byte of `r`. Returns the sub-ranges whose
    /// count went from zero to one (what must now be protected).
    pub fn add(&mut self, r: Range<u64>) -> Vec<Range<u64>> {
        let mut fresh = Vec::new();
        if r.start >= r.end {
            return fresh;
        }
        self.split_at(r.start);
        self.split_at(r.end);
        let inside: Vec<(u64, u64, u32)> = self
            .map
            .range(r.start..r.end)
            .map(|(&s, &(e, c))| (s, e, c))
            .collect();
        let mut cur = r.start;
        for (s, e, c) in inside {
            if s > cur {
                self.map.insert(cur, (s, 1));
                fresh.push(cur..s);
            }
            self.map.insert(s, (e, c + 1));
            cur = e;
        }
        if cur < r.end {
            self.map.insert(cur, (r.end, 1));
            fresh.push(cur..r.end);
        }
        self.coalesce(r.start, r.end);
        fresh
    }

    /// Drop one reference on every byte of `r`. Returns the sub-ranges whose
    /// count reached zero (what must now be unprotected). Bytes of `r` that
    /// held no reference are reported in `Err` (a caller bug) after the rest
    /// has been released.
    pub fn remove(&mut self, r: Range<u64>) -> Result<Vec<Range<u64>>, Vec<Range<u64>>> {
        let mut freed = Vec::new();
        let mut missing = Vec::new();
        if r.start >= r.end {
            return Ok(freed);
        }
        self.split_at(r.start);
        self.split_at(r.end);
        let inside: Vec<(u64, u64, u32)> = self
            .map
            .range(r.start..r.end)
            .map(|(&s, &(e, c))| (s, e, c))
            .collect();
        let mut cur = r.start;
        for (s, e, c) in inside {
            if s > cur {
                missing.push(cur..s);
            }
            if c == 1 {
                self.map.remove(&s);
                push_merged(&mut freed, s..e);
            } else {
                self.map.insert(s, (e, c - 1));
            }
            cur = e;
        }
        if cur < r.end {
            missing.push(cur..r.end);
        }
        self.coalesce(r.start, r.end);
        if missing.is_empty() {
            Ok(freed)
        } else {
            Err(missing)
        }
    }
}

/// Append `r` to a sorted list of ranges, merging with the last if they touch.
fn push_merged(out: &mut Vec<Range<u64>>, r: Range<u64>) {
    if let Some(last) = out.last_mut()
        && last.end == r.start
    {
        last.end = r.end;
        return;
    }
    out.push(r);
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;
    use std::collections::HashMap;

    #[test]
    fn split_cases() {
        let p = 4096;
        assert_eq!(
            split(4096, 8192, p),
            Split {
                head: 0,
                middle: 8192,
                tail: 0
            }
        );
        assert_eq!(
            split(100, 10000, p),
            Split {
                head: 3996,
                middle: 4096,
                tail: 1908
            }
        );
        assert_eq!(
            split(100, 4096, p),
            Split {
                head: 4096,
                middle: 0,
                tail: 0
            }
        );
        assert!(whole_pages(100, 100, p).is_empty());
        assert_eq!(whole_pages(100, 10000, p), 4096..8192);
        assert_eq!(covering_pages(100, 4096, p), 0..8192);
        assert_eq!(page_up(u64::MAX - 3, p), page_down(u64::MAX, p));
    }

    proptest! {
        #[test]
        fn split_is_exact(addr in 0u64..1 << 40, len in 0u64..1 << 24, shift in 9u32..17) {
            let p = 1u64 << shift;
            let s = split(addr, len, p);
            prop_assert_eq!(s.head + s.middle + s.tail, len);
            prop_assert_eq!(s.middle % p, 0);
            if s.middle > 0 {
                prop_assert_eq!((addr + s.head) % p, 0);
                prop_assert!(s.head < p && s.tail < p);
            }
        }

        /// The interval map agrees with a per-unit model under random add/remove.
        #[test]
        fn counter_matches_model(ops in prop::collection::vec((0u64..40, 1u64..12, any::<bool>()), 1..60)) {
            let mut rc = RangeCounter::new();
            let mut model: HashMap<u64, u32> = HashMap::new();
            let mut held: Vec<Range<u64>> = Vec::new();
            for (start, len, add) in ops {
                if add || held.is_empty() {
                    let r = start..start + len;
                    let fresh = rc.add(r.clone());
                    let mut expect = Vec::new();
                    for u in r.clone() {
                        let c = model.entry(u).or_insert(0);
                        if *c == 0 { push_merged(&mut expect, u..u + 1); }
                        *c += 1;
                    }
                    prop_assert_eq!(fresh, expect);
                    held.push(r);
                } else {
                    let r = held.remove((start as usize) % held.len());
                    let freed = rc.remove(r.clone()).expect("held range");
                    let mut expect = Vec::new();
                    for u in r.clone() {
                        let c = model.get_mut(&u).unwrap();
                        *c -= 1;
                        if *c == 0 { push_merged(&mut expect, u..u + 1); }
                    }
                    prop_assert_eq!(freed, expect);
                }
                for u in 0..60 {
                    prop_assert_eq!(rc.count_at(u), model.get(&u).copied().unwrap_or(0));
                    prop_assert_eq!(rc.overlaps(&(u..u + 1)), model.get(&u).copied().unwrap_or(0) > 0);
                }
            }
            for r in held { rc.remove(r).unwrap(); }
            prop_assert!(rc.is_empty());
        }
    }

    #[test]
    fn remove_reports_missing() {
        let mut rc = RangeCounter::new();
        rc.add(10..20);
        let err = rc.remove(5..25).unwrap_err();
        assert_eq!(err, vec![5..10, 20..25]);
        assert!(rc.is_empty());
    }

    #[test]
    fn intersect_and_ranges() {
        let mut rc = RangeCounter::new();
        rc.add(10..20);
        rc.add(15..30);
        rc.add(40..50);
        assert_eq!(rc.ranges(), vec![10..30, 40..50]);
        assert_eq!(rc.intersect(&(12..45)), vec![12..30, 40..45]);
        assert!(!rc.overlaps(&(30..40)));
    }
}
