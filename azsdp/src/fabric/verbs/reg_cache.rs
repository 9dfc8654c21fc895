//! A `verbs` endpoint's registrations, by key and by the memory they
//! cover (sans-IO: the registration handle is a type parameter, whose drop
//! deregisters).
//!
//! Two kinds, kept differently:
//!
//! - **Local** registrations (a receive's destination, written by our own
//!   READs) give the peer nothing, so they are kept after their last use,
//!   up to a budget of pinned bytes, least recently used first out. A
//!   program that receives into one buffer again (every ttcp-style loop,
//!   every server with a per-connection buffer) registers it once. A
//!   registration serves any buffer inside the pages it pins (not more:
//!   pages beyond the buffer may be write-protected or armed for another
//!   transfer, which pinning them for writing would fault on).
//! - **Peer** registrations (an advertised send) are the peer's rkey: one
//!   exact range per advertisement, shared only by live advertisements of
//!   that same range (a program that sends one buffer again while the peer
//!   still reads the last send would otherwise register pages it has just
//!   write-protected, which fails on 6.1: docs/protocol.md §1.1), and gone
//!   with the last, so a key never lets the peer read what no live
//!   advertisement gives.
//!
//! A kept registration pins the pages it was made on: once the program
//! frees, unmaps, moves or discards that memory, the NIC would write into
//! pages the program no longer sees. The owner passes what
//! [`crate::released_memory`] recorded before every lookup
//! ([`RegCache::forget`]): an entry that overlaps a released range (or
//! every entry, when the record overflowed) is never found again, and
//! goes at once if idle, else with its last use.
//!
//! A local registration made on demand (ODP) pins nothing: the device
//! follows the program's page tables. It is kept across such releases
//! (used again only for a live receive's destination, it writes into
//! whatever that memory is by then), and never stands in the way of a
//! move of pages ([`RegCache::unpin`]).

use std::collections::HashMap;
use std::ops::Range;

#[derive(Debug)]
struct Entry<T> {
    _handle: T,
    peer: bool,
    /// What a lookup must fall inside: the advertised range (peer), the
    /// pages pinned (local).
    range: Range<u64>,
    /// Bytes it pins (whole pages), or covers if on demand (counted
    /// against the same budget: each costs the device state).
    pinned: u64,
    /// Made on demand: pins nothing, follows the page tables.
    on_demand: bool,
    users: u32,
    /// Its memory changed: not to be found again, nor kept.
    stale: bool,
    /// When last used (a counter, for least-recently-used eviction).
    used: u64,
}

/// What the cache did, for the connection's report.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct RegCounts {
    /// Registrations made.
    pub made: u64,
    /// Lookups served by a kept or shared registration.
    pub reused: u64,
    /// Kept registrations dropped because their memory changed.
    pub invalidated: u64,
    /// Registrations made on demand (of `made`).
    pub on_demand: u64,
}

#[derive(Debug)]
pub struct RegCache<T> {
    by_key: HashMap<u32, Entry<T>>,
    /// Pinned bytes of idle (kept, unused) registrations allowed.
    budget: u64,
    idle_bytes: u64,
    clock: u64,
    page: u64,
    counts: RegCounts,
}

impl<T> RegCache<T> {
    /// A cache that keeps up to `budget` pinned bytes of idle local
    /// registrations of memory in pages of `page` bytes.
    pub fn new(budget: u64, page: u64) -> Self {
        RegCache {
            by_key: HashMap::new(),
            budget,
            idle_bytes: 0,
            clock: 0,
            page: page.max(1),
            counts: RegCounts::default(),
        }
    }

    fn pages(&self, addr: u64, len: u64) -> Range<u64> {
        addr - addr % self.page..addr.saturating_add(len).next_multiple_of(self.page)
    }

    /// A live or kept registration covering `[addr, addr+len)` for the
    /// peer (`peer`: exactly that range) or for local writes (any range
    /// inside): its key, counted once more.
    pub fn reuse(&mut self, addr: u64, len: u64, peer: bool) -> Option<u32> {
        let want = addr..addr.saturating_add(len);
        let (&key, _) = self.by_key.iter().find(|(_, e)| {
            !e.stale
                && e.peer == peer
                && if peer {
                    e.range == want
                } else {
                    e.range.start <= want.start && want.end <= e.range.end
                }
        })?;
        self.clock += 1;
        let e = self.by_key.get_mut(&key)?;
        if e.users == 0 {
            self.idle_bytes -= e.pinned;
        }
        e.users += 1;
        e.used = self.clock;
        self.counts.reused += 1;
        Some(key)
    }

    /// A new pinned registration, in use once.
    pub fn insert(&mut self, key: u32, handle: T, addr: u64, len: u64, peer: bool) {
        self.add(key, handle, addr, len, peer, false);
    }

    /// A new local registration made on demand, in use once.
    pub fn insert_on_demand(&mut self, key: u32, handle: T, addr: u64, len: u64) {
        self.add(key, handle, addr, len, false, true);
    }

    fn add(&mut self, key: u32, handle: T, addr: u64, len: u64, peer: bool, on_demand: bool) {
        self.clock += 1;
        self.counts.made += 1;
        self.counts.on_demand += u64::from(on_demand);
        let pages = self.pages(addr, len);
        let pinned = pages.end - pages.start;
        if !peer {
            // Kept ones it covers are of no more use.
            let inside: Vec<u32> = self
                .by_key
                .iter()
                .filter(|(_, e)| {
                    !e.peer
                        && e.users == 0
                        && pages.start <= e.range.start
                        && e.range.end <= pages.end
                })
                .map(|(&k, _)| k)
                .collect();
            for k in inside {
                self.drop_idle(k);
            }
        }
        let old = self.by_key.insert(
            key,
            Entry {
                _handle: handle,
                peer,
                range: if peer {
                    addr..addr.saturating_add(len)
                } else {
                    pages
                },
                pinned,
                on_demand,
                users: 1,
                stale: false,
                used: self.clock,
            },
        );
        if let Some(old) = old
            && old.users == 0
        {
            // (The device reused a key whose registration is gone: only
            // possible if the handle was dropped elsewhere.)
            self.idle_bytes -= old.pinned;
        }
    }

    /// One use of `key` ends; the last deregisters a peer registration or
    /// a stale one, and keeps a local one within the budget.
    pub fn release(&mut self, key: u32) {
        let Some(e) = self.by_key.get_mut(&key) else {
            return;
        };
        e.users = e.users.saturating_sub(1);
        if e.users > 0 {
            return;
        }
        if e.peer || e.stale || e.pinned > self.budget {
            self.by_key.remove(&key);
            return;
        }
        self.idle_bytes += e.pinned;
        self.shrink_to(self.budget);
    }

    /// Drop idle registrations, least recently used first, until they pin
    /// at most `bytes`.
    fn shrink_to(&mut self, bytes: u64) {
        while self.idle_bytes > bytes {
            let Some((&key, _)) = self
                .by_key
                .iter()
                .filter(|(_, e)| e.users == 0)
                .min_by_key(|(_, e)| e.used)
            else {
                self.idle_bytes = 0;
                return;
            };
            self.drop_idle(key);
        }
    }

    fn drop_idle(&mut self, key: u32) {
        if let Some(e) = self.by_key.remove(&key) {
            self.idle_bytes -= e.pinned;
        }
    }

    /// Memory in `released` changed under the program's hands (`None`:
    /// anything may have): registrations of it are never found again.
    pub fn forget(&mut self, released: Option<&[Range<u64>]>) {
        let hit = |e: &Entry<T>| match released {
            None => true,
            Some(rs) => rs
                .iter()
                .any(|r| r.start < e.range.end && e.range.start < r.end),
        };
        let mut idle = Vec::new();
        for (&key, e) in self.by_key.iter_mut() {
            if e.stale || e.on_demand || !hit(e) {
                continue;
            }
            e.stale = true;
            self.counts.invalidated += 1;
            if e.users == 0 {
                idle.push(key);
            }
        }
        for key in idle {
            self.drop_idle(key);
        }
    }

    /// Drop the idle registrations whose pages meet `range` (arming moves
    /// pages, which a pinned page beside them forbids); is any page of
    /// `range` still pinned by one in use?
    pub fn unpin(&mut self, range: Range<u64>) -> bool {
        let page = self.page;
        let meets = |e: &Entry<T>| {
            if e.on_demand {
                return false;
            }
            let start = e.range.start - e.range.start % page;
            let end = e.range.end.next_multiple_of(page);
            start < range.end && range.start < end
        };
        let idle: Vec<u32> = self
            .by_key
            .iter()
            .filter(|(_, e)| e.users == 0 && meets(e))
            .map(|(&k, _)| k)
            .collect();
        for key in idle {
            self.drop_idle(key);
        }
        self.by_key.values().any(meets)
    }

    /// Drop every idle registration (the pin limit was hit: pinned pages
    /// in use come first).
    pub fn drop_all_idle(&mut self) -> bool {
        let had = self.idle_bytes > 0;
        self.shrink_to(0);
        had
    }

    /// Every key the peer could use ends now (revocation).
    pub fn revoke_peer_keys(&mut self) {
        self.by_key.retain(|_, e| !e.peer);
    }

    /// Is `key` a registration made on demand?
    pub fn is_on_demand(&self, key: u32) -> bool {
        self.by_key.get(&key).is_some_and(|e| e.on_demand)
    }

    /// Registrations held, in use or kept.
    pub fn len(&self) -> usize {
        self.by_key.len()
    }

    pub fn is_empty(&self) -> bool {
        self.by_key.is_empty()
    }

    /// Pinned bytes of kept, unused registrations.
    pub fn idle_bytes(&self) -> u64 {
        self.idle_bytes
    }

    pub fn counts(&self) -> RegCounts {
        self.counts
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;
    use std::rc::Rc;

    /// A handle that counts how many of its kind are alive.
    /// (Held for its drop.)
    struct H(#[allow(dead_code)] Rc<()>);

    fn alive(token: &Rc<()>) -> usize {
        Rc::strong_count(token) - 1
    }

    const PAGE: u64 = 4096;

    #[test]
    fn a_peer_range_is_shared_while_live_and_ends_with_its_last_use() {
        let t = Rc::new(());
        let mut c = RegCache::new(1 << 30, PAGE);
        assert_eq!(c.reuse(0x1000, 4096, true), None);
        c.insert(7, H(t.clone()), 0x1000, 4096, true);
        assert_eq!(c.reuse(0x1000, 4096, true), Some(7));
        // Not a wider or narrower range, not the other access.
        assert_eq!(c.reuse(0x1000, 8192, true), None);
        assert_eq!(c.reuse(0x1000, 2048, true), None);
        assert_eq!(c.reuse(0x1000, 4096, false), None);
        c.release(7);
        assert_eq!(alive(&t), 1);
        c.release(7);
        assert_eq!(alive(&t), 0, "a peer key outlived its advertisements");
        assert_eq!(c.reuse(0x1000, 4096, true), None);
    }

    #[test]
    fn a_local_registration_is_kept_and_serves_any_buffer_inside() {
        let t = Rc::new(());
        let mut c = RegCache::new(1 << 30, PAGE);
        c.insert(3, H(t.clone()), 0x10_0100, 0x10_0000, false);
        c.release(3);
        assert_eq!(alive(&t), 1, "kept after its last use");
        assert_eq!(c.idle_bytes(), 0x10_1000);
        assert_eq!(c.reuse(0x10_0100, 0x10_0000, false), Some(3));
        assert_eq!(c.idle_bytes(), 0);
        assert_eq!(c.reuse(0x10_8000, 0x1000, false), Some(3));
        // Inside the pages it pins, beyond the buffer: yes; beyond: no.
        assert_eq!(c.reuse(0x10_0000, 0x200, false), Some(3));
        assert_eq!(c.reuse(0x20_0000, 0x1000, false), Some(3));
        assert_eq!(c.reuse(0x20_0000, 0x1001, false), None);
        assert_eq!(c.counts().reused, 4);
    }

    #[test]
    fn released_memory_ends_a_kept_registration_and_marks_one_in_use() {
        let t = Rc::new(());
        let mut c = RegCache::new(1 << 30, PAGE);
        c.insert(1, H(t.clone()), 0x1000, 0x4000, false);
        c.release(1);
        c.insert(2, H(t.clone()), 0x10_0000, 0x4000, false);
        // Releases beside them leave them be.
        c.forget(Some(&[0x5000..0x6000, 0x10_4000..0x10_5000]));
        assert_eq!(alive(&t), 2);
        c.forget(Some(&[0x4fff..0x5000, 0x10_2000..0x10_3000]));
        assert_eq!(alive(&t), 1, "the idle one went at once");
        assert_eq!(c.reuse(0x10_0000, 0x1000, false), None, "stale");
        c.release(2);
        assert_eq!(alive(&t), 0, "the one in use went with its last use");
        assert_eq!(c.counts().invalidated, 2);
    }

    #[test]
    fn a_wider_registration_replaces_kept_ones_inside_it() {
        let t = Rc::new(());
        let mut c = RegCache::new(1 << 30, PAGE);
        c.insert(1, H(t.clone()), 0x2000, PAGE, false);
        c.release(1);
        c.insert(2, H(t.clone()), 0x8000, PAGE, false);
        c.insert(3, H(t.clone()), 0x1000, 4 * PAGE, false);
        assert_eq!(
            alive(&t),
            2,
            "the kept one inside went; the one in use stays"
        );
        assert_eq!(c.reuse(0x2000, PAGE, false), Some(3));
    }

    #[test]
    fn an_unknown_release_forgets_everything() {
        let t = Rc::new(());
        let mut c = RegCache::new(1 << 30, PAGE);
        for k in 1..4u32 {
            c.insert(k, H(t.clone()), u64::from(k) << 20, 4096, false);
            c.release(k);
        }
        c.forget(None);
        assert!(c.is_empty());
        assert_eq!(alive(&t), 0);
    }

    #[test]
    fn idle_registrations_stay_within_the_budget_least_recent_first_out() {
        let t = Rc::new(());
        let mut c = RegCache::new(3 * PAGE, PAGE);
        for k in 1..=3u32 {
            c.insert(k, H(t.clone()), u64::from(k) << 20, PAGE, false);
            c.release(k);
        }
        // Use 1 again, so 2 is the least recent.
        assert_eq!(c.reuse(1 << 20, PAGE, false), Some(1));
        c.release(1);
        c.insert(4, H(t.clone()), 4 << 20, PAGE, false);
        c.release(4);
        assert_eq!(c.idle_bytes(), 3 * PAGE);
        assert_eq!(c.reuse(2 << 20, PAGE, false), None, "evicted");
        assert!(c.reuse(1 << 20, PAGE, false).is_some());
        // Larger than the whole budget: never kept.
        c.insert(9, H(t.clone()), 9 << 20, 4 * PAGE, false);
        c.release(9);
        assert_eq!(c.reuse(9 << 20, PAGE, false), None);
    }

    #[test]
    fn unpinning_drops_idle_registrations_in_the_window_and_reports_live_ones() {
        let t = Rc::new(());
        let mut c = RegCache::new(1 << 30, PAGE);
        c.insert(1, H(t.clone()), 0x20_0000, PAGE, false);
        c.release(1);
        c.insert(2, H(t.clone()), 0x60_0000, PAGE, false);
        assert!(!c.unpin(0x20_0000..0x40_0000), "only an idle one was there");
        assert_eq!(alive(&t), 1);
        assert!(
            c.unpin(0x40_0000..0x80_0000),
            "one in use pins a page there"
        );
        assert_eq!(alive(&t), 1);
    }

    #[test]
    fn a_registration_on_demand_outlives_releases_and_never_blocks_a_move() {
        let t = Rc::new(());
        let mut c = RegCache::new(1 << 30, PAGE);
        c.insert_on_demand(1, H(t.clone()), 0x20_0100, 2 * PAGE);
        c.insert(2, H(t.clone()), 0x60_0000, PAGE, false);
        c.release(1);
        c.release(2);
        assert!(c.is_on_demand(1) && !c.is_on_demand(2));
        // The program remaps both: the pinned one goes, the one on demand
        // follows the new pages and serves the next receive there.
        let remapped = vec![0x20_0000..0x40_0000, 0x60_0000..0x80_0000];
        c.forget(Some(&remapped));
        assert_eq!(alive(&t), 1);
        assert_eq!(c.reuse(0x20_0000, PAGE, false), Some(1));
        // In use, it pins nothing a move of pages must wait for.
        assert!(!c.unpin(0x20_0000..0x40_0000));
        assert_eq!(alive(&t), 1);
        c.forget(None);
        c.release(1);
        assert_eq!(alive(&t), 1, "kept, even after an unknown release");
        let counts = c.counts();
        assert_eq!(
            (counts.made, counts.on_demand, counts.invalidated),
            (2, 1, 1)
        );
    }

    #[test]
    fn revocation_ends_peer_keys_only() {
        let t = Rc::new(());
        let mut c = RegCache::new(1 << 30, PAGE);
        c.insert(1, H(t.clone()), 0x1000, 4096, true);
        c.insert(2, H(t.clone()), 0x2000, 4096, false);
        c.revoke_peer_keys();
        assert_eq!(alive(&t), 1);
        assert_eq!(c.reuse(0x1000, 4096, true), None);
        assert_eq!(c.reuse(0x2000, 4096, false), Some(2));
    }

    proptest! {
        /// Whatever the uses and releases of memory: a peer registration
        /// lives exactly as long as some use of it; nothing stale is ever
        /// found; idle pins stay within the budget; and once every use
        /// ended and everything was forgotten, nothing is left.
        #[test]
        fn registrations_live_as_the_rules_say(
            ops in proptest::collection::vec((0u8..4, 0u64..4, any::<bool>(), any::<u8>()), 0..200)
        ) {
            let t = Rc::new(());
            let budget = 2 * PAGE;
            let mut c = RegCache::new(budget, PAGE);
            let mut next = 0u32;
            let mut held: Vec<(u32, bool, u64)> = Vec::new();
            // Keys made, by the address they cover, and those whose memory
            // was released since they were made.
            let mut made: Vec<(u32, u64)> = Vec::new();
            let mut stale: std::collections::HashSet<u32> = Default::default();
            for (op, slot, peer, pick) in ops {
                let addr = 0x1000 * (slot + 1);
                match op {
                    0 | 1 => {
                        let key = match c.reuse(addr, 4096, peer) {
                            Some(k) => {
                                prop_assert!(!stale.contains(&k), "found a registration of released memory");
                                k
                            }
                            None => {
                                next += 1;
                                c.insert(next, H(t.clone()), addr, 4096, peer);
                                made.push((next, addr));
                                next
                            }
                        };
                        held.push((key, peer, addr));
                    }
                    2 if !held.is_empty() => {
                        let (key, _, _) = held.remove(usize::from(pick) % held.len());
                        c.release(key);
                    }
                    _ => {
                        c.forget(Some(std::slice::from_ref(&(addr..addr + 1))));
                        stale.extend(made.iter().filter(|m| m.1 == addr).map(|m| m.0));
                    }
                }
                let peer_keys: std::collections::HashSet<u32> =
                    held.iter().filter(|h| h.1).map(|h| h.0).collect();
                let local_keys: std::collections::HashSet<u32> =
                    held.iter().filter(|h| !h.1).map(|h| h.0).collect();
                prop_assert!(c.idle_bytes() <= budget);
                prop_assert_eq!(alive(&t), c.len());
                prop_assert!(c.len() >= peer_keys.len() + local_keys.len());
                prop_assert!(c.len() as u64 <= (peer_keys.len() + local_keys.len()) as u64 + budget / PAGE);
            }
            for (key, _, _) in held.drain(..) {
                c.release(key);
            }
            c.forget(None);
            prop_assert!(c.is_empty());
            prop_assert_eq!(alive(&t), 0);
        }
    }
}
