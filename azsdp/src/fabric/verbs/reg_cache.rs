//! A `verbs` endpoint's registrations, by key (sans-IO: the registration
//! handle is a type parameter, whose drop deregisters).
//!
//! Registrations of one exact range and access are shared while live (a
//! count): a program that sends one buffer again while the peer still
//! reads the last send would otherwise register pages it has just
//! write-protected, which fails on 6.1 (docs/protocol.md §1.1). Exact ranges
//! only, so a key never lets the peer read beyond what some live
//! advertisement gives, and the last release ends it.
//!
//! Nothing is kept after its last use: a pinned registration kept for a
//! range whose pages went (a `free` whose allocator unmaps or trims inside
//! libc, where no hook sees it) would land a READ in the old pages. Keeping
//! registrations needs an invalidation the allocator cannot bypass (ODP,
//! or a memory window per advertisement over a registration of a whole
//! mapping): docs/protocol.md §1.1.

use std::collections::HashMap;

#[derive(Debug)]
struct Entry<T> {
    _handle: T,
    peer: bool,
    range: (u64, u64),
    users: u32,
}

#[derive(Debug)]
pub struct RegCache<T> {
    by_key: HashMap<u32, Entry<T>>,
    live: HashMap<(u64, u64, bool), u32>,
}

impl<T> Default for RegCache<T> {
    fn default() -> Self {
        RegCache {
            by_key: HashMap::new(),
            live: HashMap::new(),
        }
    }
}

impl<T> RegCache<T> {
    /// A live registration of exactly `[addr, addr+len)` for the peer
    /// (`peer`) or for local writes: its key, counted once more.
    pub fn reuse(&mut self, addr: u64, len: u64, peer: bool) -> Option<u32> {
        let key = *self.live.get(&(addr, len, peer))?;
        let e = self.by_key.get_mut(&key)?;
        e.users += 1;
        Some(key)
    }

    /// A new registration, in use once.
    pub fn insert(&mut self, key: u32, handle: T, addr: u64, len: u64, peer: bool) {
        self.live.insert((addr, len, peer), key);
        self.by_key.insert(
            key,
            Entry {
                _handle: handle,
                peer,
                range: (addr, len),
                users: 1,
            },
        );
    }

    /// One use of `key` ends; the last deregisters it.
    pub fn release(&mut self, key: u32) {
        let Some(e) = self.by_key.get_mut(&key) else {
            return;
        };
        e.users = e.users.saturating_sub(1);
        if e.users == 0 {
            let (peer, (addr, len)) = (e.peer, e.range);
            self.live.remove(&(addr, len, peer));
            self.by_key.remove(&key);
        }
    }

    /// Every key the peer could use ends now (revocation).
    pub fn revoke_peer_keys(&mut self) {
        self.by_key.retain(|_, e| !e.peer);
        self.live.retain(|&(_, _, peer), _| !peer);
    }

    /// Registrations held.
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
    /// (Held for its drop.)
    struct H(#[allow(dead_code)] Rc<()>);

    fn alive(token: &Rc<()>) -> usize {
        Rc::strong_count(token) - 1
    }

    #[test]
    fn one_range_is_shared_while_live_and_ends_with_its_last_use() {
        let t = Rc::new(());
        let mut c = RegCache::default();
        assert_eq!(c.reuse(0x1000, 4096, true), None);
        c.insert(7, H(t.clone()), 0x1000, 4096, true);
        assert_eq!(c.reuse(0x1000, 4096, true), Some(7));
        // Not a wider or narrower range, not the other access.
        assert_eq!(c.reuse(0x1000, 8192, true), None);
        assert_eq!(c.reuse(0x1000, 4096, false), None);
        c.release(7);
        assert_eq!(alive(&t), 1);
        c.release(7);
        assert_eq!(alive(&t), 0, "a peer key outlived its advertisements");
        assert_eq!(c.reuse(0x1000, 4096, true), None);
    }

    #[test]
    fn revocation_ends_peer_keys_only() {
        let t = Rc::new(());
        let mut c = RegCache::default();
        c.insert(1, H(t.clone()), 0x1000, 4096, true);
        c.insert(2, H(t.clone()), 0x2000, 4096, false);
        c.revoke_peer_keys();
        assert_eq!(alive(&t), 1);
        assert_eq!(c.reuse(0x1000, 4096, true), None);
        assert_eq!(c.reuse(0x2000, 4096, false), Some(2));
    }

    proptest! {
        /// Whatever the uses, a registration lives exactly as long as some
        /// use of it, and distinct live ranges never share a key.
        #[test]
        fn a_registration_lives_as_long_as_its_uses(
            ops in proptest::collection::vec((any::<bool>(), 0u64..4, any::<bool>(), any::<u8>()), 0..200)
        ) {
            let t = Rc::new(());
            let mut c = RegCache::default();
            let mut next = 0u32;
            let mut held: Vec<u32> = Vec::new();
            for (take, slot, peer, pick) in ops {
                let addr = 0x1000 * (slot + 1);
                if take {
                    let key = c.reuse(addr, 4096, peer).unwrap_or_else(|| {
                        next += 1;
                        c.insert(next, H(t.clone()), addr, 4096, peer);
                        next
                    });
                    held.push(key);
                } else if !held.is_empty() {
                    let key = held.remove(usize::from(pick) % held.len());
                    c.release(key);
                }
                let distinct: std::collections::HashSet<u32> = held.iter().copied().collect();
                prop_assert_eq!(c.len(), distinct.len());
                prop_assert_eq!(alive(&t), distinct.len());
            }
            for key in held.drain(..) {
                c.release(key);
            }
            prop_assert!(c.is_empty());
            prop_assert_eq!(alive(&t), 0);
        }
    }
}
