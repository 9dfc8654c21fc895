//! Hash maps keyed by the engine's own counters (call ids, op ids,
//! tickets, addresses). SipHash, std's default, guards against keys chosen
//! by an attacker; these keys are ours, and SipHash showed as 5% of a
//! 64-byte ping-pong's samples. One multiply spreads them well enough.

use std::collections::HashMap;
use std::hash::{BuildHasherDefault, Hasher};

/// A `HashMap` for keys the process made itself.
pub type IdMap<K, V> = HashMap<K, V, BuildHasherDefault<IdHasher>>;

/// Multiply-and-fold hashing of integer keys.
#[derive(Clone, Copy, Debug, Default)]
pub struct IdHasher(u64);

impl Hasher for IdHasher {
    fn finish(&self) -> u64 {
        // The high bits of the product are the well-mixed ones; hashbrown
        // takes its control bits from the top and its index from the bottom.
        self.0 ^ (self.0 >> 29)
    }

    fn write(&mut self, bytes: &[u8]) {
        for chunk in bytes.chunks(8) {
            let mut w = [0u8; 8];
            w[..chunk.len()].copy_from_slice(chunk);
            self.write_u64(u64::from_le_bytes(w));
        }
    }

    fn write_u64(&mut self, n: u64) {
        self.0 = (self.0.rotate_left(5) ^ n).wrapping_mul(0x9e37_79b9_7f4a_7c15);
    }

    fn write_u32(&mut self, n: u32) {
        self.write_u64(u64::from(n));
    }

    fn write_usize(&mut self, n: usize) {
        self.write_u64(n as u64);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn sequential_and_page_aligned_keys_spread() {
        for step in [1u64, 4096] {
            let mut buckets = [0u32; 64];
            for k in 0..64 * 64u64 {
                let mut h = IdHasher::default();
                h.write_u64(k * step);
                buckets[(h.finish() % 64) as usize] += 1;
                let top = (h.finish() >> 57) as usize;
                assert!(top < 128);
            }
            // No bucket gets more than three times its share.
            assert!(
                buckets.iter().all(|&b| b < 3 * 64),
                "step {step}: {buckets:?}"
            );
        }
        let mut m: IdMap<u64, u64> = IdMap::default();
        for k in 0..1000 {
            m.insert(k * 4096, k);
        }
        assert!((0..1000).all(|k| m[&(k * 4096)] == k));
    }
}
