//! What a hostile peer can do to a segment it maps: write any word of it.
//! The adversarial tests (`tests/hostile`) play such a peer with this
//! crate; none of this lets a process do more than it could by writing
//! memory it already maps.

use std::sync::atomic::{AtomicU64, Ordering};

use super::endpoint::ShmEndpoint;
use super::segment::{KEY_SLOT_BITS, KEY_SLOT_MASK};

/// Which side of the segment `ep` runs.
pub fn side(ep: &ShmEndpoint) -> usize {
    ep.side
}

/// Write `side`'s owner word.
pub fn set_owner(ep: &ShmEndpoint, side: usize, word: u32) {
    ep.seg.hdr().owner[side & 1].store(word, Ordering::Release);
}

/// Write registration `slot` of `side` as its owner would.
pub fn write_registration(ep: &ShmEndpoint, side: usize, slot: u32, key: u32, addr: u64, len: u64) {
    if let Some(e) = ep.seg.reg(side & 1, slot) {
        e.addr.store(addr, Ordering::Relaxed);
        e.len.store(len, Ordering::Relaxed);
        e.key.store(u64::from(key), Ordering::Release);
    }
}

/// Put nonsense in the producer position of the ring for `dir`.
pub fn corrupt_ring(ep: &ShmEndpoint, dir: usize) {
    let at = ep.seg.layout.ring[dir & 1] + 64;
    // SAFETY: the ring header's producer word: inside the mapping,
    // 8-aligned, and only ever accessed atomically.
    let w = unsafe { &*ep.seg.base().add(at).cast::<AtomicU64>() };
    w.store(1 << 40, Ordering::Release);
}

/// Overwrite the segment header's magic and sizes.
pub fn corrupt_header(ep: &ShmEndpoint) {
    let h = ep.seg.hdr();
    h.magic.store(0, Ordering::Relaxed);
    h.ring_cap.store(u32::MAX, Ordering::Relaxed);
    h.lock_slots.store(u32::MAX, Ordering::Relaxed);
}

/// The key a registration in `slot` has at `generation`.
pub fn key(slot: u32, generation: u32) -> u32 {
    (generation << KEY_SLOT_BITS) | (slot & KEY_SLOT_MASK)
}
