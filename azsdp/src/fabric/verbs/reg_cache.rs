//! A `verbs` endpoint's registrations, by key (sans-IO: the registration
//! handle is a type parameter, whose drop deregisters).
//!
//! - Registrations of one exact range and access are shared while live (a
//!   count): a program that sends one buffer again while the peer still
//!   reads the last send would otherwise register pages it has just
//!   write-protected, which fails on 6.1 (docs/protocol.md §1.1). Exact
//!   ranges only, so a key never lets the peer read beyond what some live
//!   advertisement gives, and the last release ends a peer key.
//! - Local registrations (receive destinations) are kept after their last
//!   release, a few per connection, to be used again for the same range (a
//!   program receiving into one buffer), but only while the memory epoch
//!   (`process::memory_epoch`: any interposed call that may give memory back
//!   or replace pages) has not moved since they were made: a pinned
//!   registration of pages that went would land a READ in the old pages.

use std::collections::{HashMap, VecDeque};

#[derive(Debug)]
struct Entry<T> {
    _handle: T,
    peer: bool,
    range: (u64, u64),
    users: u32,
    epoch: usize,
}

#[derive(Debug)]
pub struct RegCache<T> {
    by_key: HashMap<u32, Entry<T>>,
    live: HashMap<(u64, u64, bool), u32>,
    kept: VecDeque<(u64, u64, u32)>,
    kept_epoch: usize,
    keep: usize,
}

impl<T> RegCache<T> {
    /// Keeping at most `keep` local registrations after their last use.
    pub fn new(keep: usize) -> Self {
        RegCache {
            by_key: HashMap::new(),
            live: HashMap::new(),
            kept: VecDeque::new(),
            kept_epoch: 0,
            keep,
        }
    }

    fn drop_kept_if(&mut self, epoch: usize) {
        if epoch != self.kept_epoch {
            for (_, _, key) in std::mem::take(&mut self.kept) {
                self.by_key.remove(&key);
            }
            self.kept_epoch = epoch;
        }
    }

    /// A registration of exactly `[addr, addr+len)` for the peer (`peer`)
    /// or for local writes that can be used now: its key, counted.
    pub fn reuse(&mut self, addr: u64, len: u64, peer: bool, epoch: usize) -> Option<u32> {
        self.drop_kept_if(epoch);
        if !peer
            && let Some(i) = self
                .kept
                .iter()
                .position(|&(a, l, _)| (a, l) == (addr, len))
            && let Some((_, _, key)) = self.kept.remove(i)
        {
            self.live.insert((addr, len, false), key);
        }
        let key = *self.live.get(&(addr, len, peer))?;
        let e = self.by_key.get_mut(&key)?;
        e.users += 1;
        Some(key)
    }

    /// A new registration, made at `epoch`, in use once.
    pub fn insert(&mut self, key: u32, handle: T, addr: u64, len: u64, peer: bool, epoch: usize) {
        self.live.insert((addr, len, peer), key);
        self.by_key.insert(
            key,
            Entry {
                _handle: handle,
                peer,
                range: (addr, len),
                users: 1,
                epoch,
            },
        );
    }

    /// One use of `key` ends (at `epoch`): the last ends a peer key, and
    /// keeps a local one if memory has not changed since it was made.
    pub fn release(&mut self, key: u32, epoch: usize) {
        let Some(e) = self.by_key.get_mut(&key) else {
            return;
        };
        e.users = e.users.saturating_sub(1);
        if e.users > 0 {
            return;
        }
        let (peer, (addr, len), unchanged) = (e.peer, e.range, e.epoch == epoch);
        self.live.remove(&(addr, len, peer));
        self.drop_kept_if(epoch);
        if peer || !unchanged || self.keep == 0 {
            self.by_key.remove(&key);
            return;
        }
        self.kept.push_back((addr, len, key));
        if self.kept.len() > self.keep
            && let Some((_, _, old)) = self.kept.pop_front()
        {
            self.by_key.remove(&old);
        }
    }

    /// Every key the peer could use ends now (revocation).
    pub fn revoke_peer_keys(&mut self) {
        self.by_key.retain(|_, e| !e.peer);
        self.live.retain(|&(_, _, peer), _| !peer);
    }

    /// Registrations held (live or kept).
    pub fn len(&self) -> usize {
        self.by_key.len()
    }

    pub fn is_empty(&self) -> bool {
        self.by_key.is_empty()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;
    use std::rc::Rc;

    /// A handle that counts how many of its kind are alive.
    /// (Held for its drop: it counts the handles alive.)
    struct H(#[allow(dead_code)] Rc<()>);

    fn alive(token: &Rc<()>) -> usize {
        Rc::strong_count(token) - 1
    }

    #[test]
    fn one_range_is_shared_while_live_and_a_peer_key_ends_with_its_last_use() {
        let t = Rc::new(());
        let mut c = RegCache::new(8);
        assert_eq!(c.reuse(0x1000, 4096, true, 0), None);
        c.insert(7, H(t.clone()), 0x1000, 4096, true, 0);
        assert_eq!(c.reuse(0x1000, 4096, true, 0), Some(7));
        // Not a wider or narrower range, not the other access.
        assert_eq!(c.reuse(0x1000, 8192, true, 0), None);
        assert_eq!(c.reuse(0x1000, 4096, false, 0), None);
        c.release(7, 0);
        assert_eq!(alive(&t), 1);
        c.release(7, 0);
        assert_eq!(alive(&t), 0, "a peer key outlived its advertisements");
        assert_eq!(c.reuse(0x1000, 4096, true, 0), None);
    }

    #[test]
    fn a_local_registration_is_kept_until_memory_changes() {
        let t = Rc::new(());
        let mut c = RegCache::new(8);
        c.insert(3, H(t.clone()), 0x2000, 4096, false, 5);
        c.release(3, 5);
        assert_eq!(alive(&t), 1);
        assert_eq!(c.reuse(0x2000, 4096, false, 5), Some(3));
        c.release(3, 5);
        // A free, munmap, ... since: gone, and not used again.
        assert_eq!(c.reuse(0x2000, 4096, false, 6), None);
        assert_eq!(alive(&t), 0);
        // One made before a change and released after it is not kept.
        c.insert(4, H(t.clone()), 0x3000, 4096, false, 6);
        c.release(4, 7);
        assert_eq!(alive(&t), 0);
    }

    #[test]
    fn revocation_ends_peer_keys_only() {
        let t = Rc::new(());
        let mut c = RegCache::new(8);
        c.insert(1, H(t.clone()), 0x1000, 4096, true, 0);
        c.insert(2, H(t.clone()), 0x2000, 4096, false, 0);
        c.revoke_peer_keys();
        assert_eq!(alive(&t), 1);
        assert_eq!(c.reuse(0x1000, 4096, true, 0), None);
        assert_eq!(c.reuse(0x2000, 4096, false, 0), Some(2));
    }

    proptest! {
        /// Whatever the uses, peer keys never outlive their last use, kept
        /// registrations stay within bound, and nothing kept survives a
        /// change of the memory epoch.
        #[test]
        fn registrations_stay_bounded_and_peer_keys_end(
            ops in proptest::collection::vec((0u8..3, 0u64..4, any::<bool>(), 0usize..3), 0..200)
        ) {
            let t = Rc::new(());
            let mut c = RegCache::new(3);
            let mut next = 0u32;
            let mut held: Vec<u32> = Vec::new();
            let mut epoch = 0;
            for (op, slot, peer, bump) in ops {
                epoch += bump / 2;
                let addr = 0x1000 * (slot + 1);
                match op {
                    0 | 1 => {
                        let key = match c.reuse(addr, 4096, peer, epoch) {
                            Some(k) => k,
                            None => {
                                next += 1;
                                c.insert(next, H(t.clone()), addr, 4096, peer, epoch);
                                next
                            }
                        };
                        held.push(key);
                    }
                    _ => {
                        if !held.is_empty() {
                            let key = held.remove(usize::from(slot as u8) % held.len());
                            c.release(key, epoch);
                        }
                    }
                }
                let live: std::collections::HashSet<u32> = held.iter().copied().collect();
                prop_assert!(c.len() <= live.len() + 3);
                prop_assert_eq!(c.by_key.values().filter(|e| e.peer && e.users == 0).count(), 0);
            }
            // Memory changes, every use ends: nothing is left registered.
            for key in held.drain(..) {
                c.release(key, epoch + 1);
            }
            prop_assert_eq!(c.reuse(0, 4096, false, epoch + 1), None);
            prop_assert_eq!(alive(&t), 0);
        }
    }
}
