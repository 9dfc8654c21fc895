//! Fabric-owned memory for the copies copy-on-write makes: page-aligned
//! anonymous buffers, handed out by address and reused by size, so that a
//! copy costs no allocation once the pool is warm. A provider exposes them
//! to the peer through its own registrations (shm: its table, read by
//! `process_vm_readv`; verbs: one memory region for the pool).

use std::collections::HashMap;

use memmap2::MmapMut;

use crate::conn::OpError;

/// Most bytes of spare buffers kept for reuse.
const SPARE_BYTES: usize = 8 << 20;

/// Buffers in use, by address, and spares by length.
#[derive(Debug, Default)]
pub struct Pool {
    used: HashMap<u64, MmapMut>,
    spare: Vec<MmapMut>,
}

impl Pool {
    /// A buffer of at least `len` bytes; its address.
    pub fn alloc(&mut self, len: u64) -> Result<u64, OpError> {
        let len = usize::try_from(len).map_err(|_| OpError::Local)?.max(1);
        let page = crate::pages::system_page_size() as usize;
        let size = len.next_multiple_of(page);
        let buf = match self.spare.iter().position(|b| b.len() == size) {
            Some(i) => self.spare.swap_remove(i),
            None => MmapMut::map_anon(size).map_err(|_| OpError::Local)?,
        };
        let at = buf.as_ptr() as u64;
        self.used.insert(at, buf);
        Ok(at)
    }

    /// The first `len` bytes of the buffer at `addr`, if it is in use.
    pub fn bytes(&mut self, addr: u64, len: u64) -> Option<&mut [u8]> {
        let buf = self.used.get_mut(&addr)?;
        buf.get_mut(..usize::try_from(len).ok()?)
    }

    /// Take the buffer at `addr` back.
    pub fn free(&mut self, addr: u64) {
        let Some(buf) = self.used.remove(&addr) else {
            return;
        };
        let spare: usize = self.spare.iter().map(|b| b.len()).sum();
        if spare + buf.len() <= SPARE_BYTES {
            self.spare.push(buf);
        } else {
            // Unmapped now: a registration kept of it (a NIC's, for a GET
            // that landed here) must not serve the memory mapped there next.
            crate::released_memory::record(addr..addr + buf.len() as u64);
        }
    }

    /// Buffers in use.
    pub fn in_use(&self) -> usize {
        self.used.len()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn buffers_are_page_aligned_reused_and_bounded() {
        let mut p = Pool::default();
        let a = p.alloc(100).unwrap();
        assert_eq!(a % crate::pages::system_page_size(), 0);
        p.bytes(a, 100).unwrap().fill(7);
        assert!(p.bytes(a, 1 << 20).is_none(), "past the buffer");
        p.free(a);
        assert_eq!(p.in_use(), 0);
        let b = p.alloc(200).unwrap();
        assert_eq!(a, b, "a spare of the same size is reused");
        assert!(p.bytes(a + 1, 1).is_none(), "only by its own address");
        p.free(b);
        let big = p.alloc(16 << 20).unwrap();
        p.free(big);
        assert!(p.spare.iter().map(|b| b.len()).sum::<usize>() <= SPARE_BYTES);
    }
}
