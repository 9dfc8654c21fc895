//! A single-producer, single-consumer message ring in shared memory.
//!
//! The `shm` fabric puts two of these (one per direction) in a `memfd`
//! segment mapped by both processes. A message is a record: a `u32` length,
//! the bytes, padding to 8. A record that does not fit before the end of the
//! data area is preceded by a wrap marker and starts again at offset 0, so
//! every message is contiguous and can be handed out as one slice.
//!
//! Positions are free-running `u64` byte counters (`tail` written only by the
//! producer, `head` only by the consumer); `tail - head` is what is in use.
//! Release stores publish, acquire loads observe, so a record's bytes are
//! visible before the position that covers them.
//!
//! This is one of the crate's `unsafe` modules: it reads and writes a memory
//! region it does not own. [`Ring::attach`] states the contract.

use std::sync::atomic::{AtomicU32, AtomicU64, Ordering};

/// Bytes of the shared header before the data area.
pub const HEADER: usize = 256;
const MAGIC: u64 = 0x617a_7364_7072_6e67; // "azsdprng"
const WRAP: u32 = u32::MAX;
const ALIGN: usize = 8;

/// The shared header. Producer and consumer fields sit on separate cache
/// lines so the two sides do not bounce one line between cores.
#[repr(C, align(64))]
struct Header {
    magic: AtomicU64,
    capacity: AtomicU64,
    _pad0: [u8; 48],
    /// Producer position (bytes ever written).
    tail: AtomicU64,
    /// Wake-ups ever posted (one per message, plus the consumer's own
    /// kicks): the consumer's futex word. Never used as a position.
    published: AtomicU32,
    _pad1: [u8; 52],
    /// Consumer position (bytes ever consumed).
    head: AtomicU64,
    /// Consumer threads about to sleep; the producer wakes them.
    sleeping: AtomicU32,
    /// The consumer's reactor watches its doorbell: the producer that
    /// takes this from 1 to 0 rings it (see `ShmEndpoint::arm`).
    armed: AtomicU32,
    _pad2: [u8; 48],
}

const _: () = assert!(std::mem::size_of::<Header>() <= HEADER);

/// Why a ring cannot be attached.
#[derive(Clone, Copy, Debug, PartialEq, Eq, thiserror::Error)]
pub enum RingError {
    #[error("ring region too small or capacity not a power of two")]
    BadSize,
    #[error("ring header is not initialised (bad magic)")]
    BadMagic,
    #[error("message of {0} bytes does not fit in the ring")]
    TooLarge(usize),
    /// The shared positions or a record length make no sense: only a
    /// corrupted (or hostile) peer writes these. The ring is unusable.
    #[error("ring corrupted by the peer")]
    Corrupt,
}

/// One end of a ring (either end: producer and consumer use the same type,
/// and must each be used by one thread at a time).
#[derive(Debug)]
pub struct Ring {
    hdr: *const Header,
    data: *mut u8,
    cap: usize,
}

// SAFETY: the ring only touches shared memory through atomics (positions)
// and through disjoint byte ranges owned, by protocol, by one side at a time.
unsafe impl Send for Ring {}

/// What waiting threads see of a ring: is it empty, and its futex words.
#[derive(Debug)]
pub struct RingWatch {
    hdr: *const Header,
}

// SAFETY: a watch only reads and updates the header's atomics, from any
// number of threads; the header outlives it (the owner keeps the mapping).
unsafe impl Send for RingWatch {}
// SAFETY: as above; every access is atomic.
unsafe impl Sync for RingWatch {}

impl RingWatch {
    fn h(&self) -> &Header {
        // SAFETY: attached rings point at a live, initialised header, and
        // the watch's owner keeps the mapping alive.
        unsafe { &*self.hdr }
    }

    pub fn is_empty(&self) -> bool {
        let h = self.h();
        h.head.load(Ordering::Acquire) == h.tail.load(Ordering::Acquire)
    }

    /// The futex word (wake-ups posted) and the count of sleepers.
    pub fn wait_words(&self) -> (&AtomicU32, &AtomicU32) {
        let h = self.h();
        (&h.published, &h.sleeping)
    }

    /// The consumer's doorbell flag (1: ring it on the next message).
    pub fn armed(&self) -> &AtomicU32 {
        &self.h().armed
    }
}

/// Total bytes a ring with `capacity` data bytes needs.
pub fn region_len(capacity: usize) -> usize {
    HEADER + capacity
}

impl Ring {
    /// Initialise a ring in `region` (done once, by the segment's creator).
    ///
    /// # Safety
    /// `region` must be valid for reads and writes of `len` bytes, aligned to
    /// 64, and no one else may use it during initialisation.
    pub unsafe fn init(region: *mut u8, len: usize) -> Result<(), RingError> {
        let cap = len.checked_sub(HEADER).ok_or(RingError::BadSize)?;
        if !cap.is_power_of_two() || cap < 64 {
            return Err(RingError::BadSize);
        }
        // SAFETY: the caller guarantees the region is valid, aligned and ours.
        unsafe { region.write_bytes(0, HEADER) };
        let hdr = region.cast::<Header>();
        // SAFETY: the header is in bounds, aligned, and was just zeroed
        // (all-zero is a valid value for every field).
        let h = unsafe { &*hdr };
        h.capacity.store(cap as u64, Ordering::Relaxed);
        h.magic.store(MAGIC, Ordering::Release);
        Ok(())
    }

    /// Attach to an initialised ring.
    ///
    /// # Safety
    /// `region` must stay valid for reads and writes of `len` bytes, aligned
    /// to 64, for the life of the returned `Ring`; at most one producer and
    /// one consumer may use the ring at a time.
    pub unsafe fn attach(region: *mut u8, len: usize) -> Result<Ring, RingError> {
        if len < HEADER + 64 || !(region as usize).is_multiple_of(64) {
            return Err(RingError::BadSize);
        }
        let hdr = region.cast::<Header>();
        // SAFETY: in bounds and aligned per the caller's contract.
        let h = unsafe { &*hdr };
        if h.magic.load(Ordering::Acquire) != MAGIC {
            return Err(RingError::BadMagic);
        }
        let cap = h.capacity.load(Ordering::Relaxed) as usize;
        if !cap.is_power_of_two() || HEADER + cap > len {
            return Err(RingError::BadSize);
        }
        Ok(Ring {
            hdr,
            // SAFETY: HEADER < len, so the data area starts inside the region.
            data: unsafe { region.add(HEADER) },
            cap,
        })
    }

    fn h(&self) -> &Header {
        // SAFETY: valid for the life of self (attach's contract).
        unsafe { &*self.hdr }
    }

    /// Bytes of the data area.
    pub fn capacity(&self) -> usize {
        self.cap
    }

    /// Largest message this ring can ever carry.
    pub fn max_message(&self) -> usize {
        self.cap / 2 - 2 * ALIGN
    }

    fn record_len(n: usize) -> usize {
        (4 + n).next_multiple_of(ALIGN)
    }

    /// Both positions, checked: the peer can write them (the header is
    /// shared), so nothing is trusted that would put an access outside the
    /// data area. Records start 8-aligned; at most `cap` bytes are in use.
    fn positions(&self) -> Result<(u64, u64), RingError> {
        let h = self.h();
        let head = h.head.load(Ordering::Acquire);
        let tail = h.tail.load(Ordering::Acquire);
        let used = tail.wrapping_sub(head);
        if used > self.cap as u64
            || !head.is_multiple_of(ALIGN as u64)
            || !tail.is_multiple_of(ALIGN as u64)
        {
            return Err(RingError::Corrupt);
        }
        Ok((head, tail))
    }

    /// Producer: would a message of `len` bytes (at most the largest this
    /// ring carries) be pushed now? True too when the positions are corrupt:
    /// the push then fails at once.
    pub fn has_room(&self, len: usize) -> bool {
        let Ok((head, tail)) = self.positions() else {
            return true;
        };
        let used = tail.wrapping_sub(head) as usize;
        let off = (tail as usize) & (self.cap - 1);
        let rec = Self::record_len(len.min(self.max_message()));
        let to_end = self.cap - off;
        let need = if rec > to_end { to_end + rec } else { rec };
        used + need <= self.cap
    }

    /// Producer: copy `msg` in as one record. `Ok(false)` when there is no
    /// room now (retry after the consumer has made progress).
    pub fn push(&self, msg: &[u8]) -> Result<bool, RingError> {
        if msg.len() > self.max_message() {
            return Err(RingError::TooLarge(msg.len()));
        }
        let h = self.h();
        let (head, tail) = self.positions()?;
        let used = tail.wrapping_sub(head) as usize;
        let off = (tail as usize) & (self.cap - 1);
        let rec = Self::record_len(msg.len());
        let to_end = self.cap - off;
        let (skip, need) = if rec > to_end {
            (to_end, to_end + rec)
        } else {
            (0, rec)
        };
        if used + need > self.cap {
            return Ok(false);
        }
        if skip > 0 {
            // SAFETY: off + 4 <= cap (records are 8-aligned and off < cap),
            // and these bytes are free (used + need <= cap).
            unsafe { self.data.add(off).cast::<u32>().write_unaligned(WRAP) };
        }
        let start = (off + skip) & (self.cap - 1);
        // SAFETY: start + rec <= cap by construction, and the range is free.
        unsafe {
            self.data
                .add(start)
                .cast::<u32>()
                .write_unaligned(msg.len() as u32);
            std::ptr::copy_nonoverlapping(msg.as_ptr(), self.data.add(start + 4), msg.len());
        }
        h.tail
            .store(tail.wrapping_add(need as u64), Ordering::Release);
        h.published.fetch_add(1, Ordering::Release);
        Ok(true)
    }

    /// Consumer: hand the next message to `f` (valid only during the call),
    /// then release its space. `Ok(None)` when the ring is empty;
    /// [`RingError::Corrupt`] when the peer wrote nonsense (the bytes of a
    /// message may still change under `f`: the peer can write them, so `f`
    /// must treat them as untrusted input, as it does).
    pub fn pop<R>(&self, f: impl FnOnce(&[u8]) -> R) -> Result<Option<R>, RingError> {
        let h = self.h();
        let (mut head, tail) = self.positions()?;
        if head == tail {
            return Ok(None);
        }
        let mut off = (head as usize) & (self.cap - 1);
        // SAFETY: off is 8-aligned and below cap, so off + 4 <= cap; the
        // producer published these bytes.
        let mut len = unsafe { self.data.add(off).cast::<u32>().read_unaligned() };
        if len == WRAP {
            head = head.wrapping_add((self.cap - off) as u64);
            off = 0;
            // SAFETY: as above, at offset 0.
            len = unsafe { self.data.cast::<u32>().read_unaligned() };
        }
        let len = len as usize;
        let rec = Self::record_len(len) as u64;
        if len > self.max_message()
            || off + 4 + len > self.cap
            || head.wrapping_add(rec).wrapping_sub(tail) as i64 > 0
        {
            return Err(RingError::Corrupt);
        }
        // SAFETY: [off+4, off+4+len) is inside the data area and published.
        let msg = unsafe { std::slice::from_raw_parts(self.data.add(off + 4), len) };
        let r = f(msg);
        h.head.store(head.wrapping_add(rec), Ordering::Release);
        Ok(Some(r))
    }

    /// Is there a message to pop?
    pub fn is_empty(&self) -> bool {
        let h = self.h();
        h.head.load(Ordering::Relaxed) == h.tail.load(Ordering::Acquire)
    }

    /// A view of this ring's wake-up words and emptiness, for threads that
    /// only wait for it (it never pushes or pops).
    pub fn watch(&self) -> RingWatch {
        RingWatch { hdr: self.hdr }
    }

    /// Bytes in use (for tests and stats); the whole ring if corrupted.
    pub fn used(&self) -> usize {
        self.positions()
            .map_or(self.cap, |(head, tail)| tail.wrapping_sub(head) as usize)
    }

    /// The consumer's futex word and sleeping flag, for the waiting logic of
    /// the fabric (poll, then announce `sleeping`, re-check, then futex-wait
    /// on `published`).
    pub fn wait_words(&self) -> (&AtomicU32, &AtomicU32) {
        let h = self.h();
        (&h.published, &h.sleeping)
    }

    /// The consumer's doorbell flag (see [`RingWatch::armed`]).
    pub fn armed(&self) -> &AtomicU32 {
        &self.h().armed
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::alloc::{Layout, alloc_zeroed, dealloc};

    struct Region {
        ptr: *mut u8,
        layout: Layout,
    }

    impl Region {
        fn new(cap: usize) -> Region {
            let layout = Layout::from_size_align(region_len(cap), 64).unwrap();
            // SAFETY: non-zero size.
            let ptr = unsafe { alloc_zeroed(layout) };
            assert!(!ptr.is_null());
            // SAFETY: fresh allocation of the right size and alignment.
            unsafe { Ring::init(ptr, layout.size()).unwrap() };
            Region { ptr, layout }
        }
        fn ring(&self) -> Ring {
            // SAFETY: the region outlives every ring made from it in these tests.
            unsafe { Ring::attach(self.ptr, self.layout.size()).unwrap() }
        }
    }

    impl Drop for Region {
        fn drop(&mut self) {
            // SAFETY: allocated with this layout.
            unsafe { dealloc(self.ptr, self.layout) };
        }
    }

    #[test]
    fn messages_come_out_whole_and_in_order_across_wraps() {
        let r = Region::new(256);
        let (p, c) = (r.ring(), r.ring());
        let mut expect = std::collections::VecDeque::new();
        let mut n = 0u8;
        for round in 0..2000usize {
            let len = 1 + (round * 37) % 100;
            let msg = vec![n; len];
            if p.push(&msg).unwrap() {
                expect.push_back(msg);
                n = n.wrapping_add(1);
            }
            if round % 3 == 0 {
                while let Some(got) = c.pop(<[u8]>::to_vec).unwrap() {
                    assert_eq!(got, expect.pop_front().unwrap());
                }
            }
        }
        while let Some(got) = c.pop(<[u8]>::to_vec).unwrap() {
            assert_eq!(got, expect.pop_front().unwrap());
        }
        assert!(expect.is_empty());
        assert_eq!(c.used(), 0);
    }

    #[test]
    fn full_ring_refuses_and_oversize_is_an_error() {
        let r = Region::new(128);
        let p = r.ring();
        assert_eq!(p.push(&[0u8; 200]), Err(RingError::TooLarge(200)));
        let mut pushed = 0;
        while p.push(&[1u8; 20]).unwrap() {
            pushed += 1;
        }
        assert!(pushed >= 4);
        assert!(p.pop(|m| m.len()).unwrap().is_some());
        assert!(p.push(&[1u8; 20]).unwrap());
    }

    #[test]
    fn attach_checks_the_header() {
        let layout = Layout::from_size_align(region_len(256), 64).unwrap();
        // SAFETY: non-zero size.
        let ptr = unsafe { alloc_zeroed(layout) };
        // SAFETY: valid region; zeroed, so not initialised.
        let attached = unsafe { Ring::attach(ptr, layout.size()) };
        assert_eq!(attached.unwrap_err(), RingError::BadMagic);
        // SAFETY: valid region, but 300 is not a power-of-two capacity.
        let init = unsafe { Ring::init(ptr, HEADER + 300) };
        assert_eq!(init, Err(RingError::BadSize));
        // SAFETY: allocated with this layout.
        unsafe { dealloc(ptr, layout) };
    }

    /// A peer that rewrites the shared positions or a record's length:
    /// an error on either end, never an access outside the data area.
    #[test]
    fn a_corrupted_ring_is_an_error_not_an_overrun() {
        let r = Region::new(256);
        let (p, c) = (r.ring(), r.ring());
        assert!(p.push(b"hello").unwrap());
        let h = p.h();
        let (head, tail) = (
            h.head.load(Ordering::Relaxed),
            h.tail.load(Ordering::Relaxed),
        );
        for (bad_head, bad_tail) in [
            (tail + 8, tail),    // consumer ahead of the producer
            (head, head + 4096), // more in use than the ring holds
            (head, tail + 3),    // a misaligned position
            (head + 1, tail),
        ] {
            h.head.store(bad_head, Ordering::Relaxed);
            h.tail.store(bad_tail, Ordering::Relaxed);
            assert_eq!(c.pop(|m| m.len()), Err(RingError::Corrupt));
            assert_eq!(p.push(b"x"), Err(RingError::Corrupt));
            assert_eq!(c.used(), c.capacity());
        }
        h.head.store(head, Ordering::Relaxed);
        h.tail.store(tail, Ordering::Relaxed);
        // A record length beyond the published bytes, or beyond the ring.
        for len in [200u32, 5000, u32::MAX - 1] {
            // SAFETY: offset 0 of the data area, which holds our record.
            unsafe { p.data.cast::<u32>().write_unaligned(len) };
            assert_eq!(c.pop(|m| m.len()), Err(RingError::Corrupt));
        }
        // SAFETY: as above: restore the true length.
        unsafe { p.data.cast::<u32>().write_unaligned(5) };
        assert_eq!(c.pop(|m| m.to_vec()), Ok(Some(b"hello".to_vec())));
    }

    /// The driver's credit check: `has_room` says yes exactly when a push
    /// of that size would succeed, wraps included, so a ring whose largest
    /// message is half of it is never stuck.
    #[test]
    fn has_room_agrees_with_push_at_every_position() {
        let r = Region::new(256);
        let (p, c) = (r.ring(), r.ring());
        let max = p.max_message();
        for step in 0..200usize {
            let len = (step * 37) % (max + 1);
            let room = p.has_room(len);
            assert_eq!(
                room,
                p.push(&vec![7u8; len]).unwrap(),
                "step {step}, {len} B"
            );
            if !room || step % 3 == 0 {
                assert!(c.pop(|m| m.len()).unwrap().is_some());
            }
        }
        // An empty ring takes the largest message wherever its tail is.
        while c.pop(|_| ()).unwrap().is_some() {}
        assert!(p.has_room(max) && p.has_room(usize::MAX));
        // Corrupt positions: yes, and the push then fails.
        p.h().tail.store(3, Ordering::Relaxed);
        assert!(p.has_room(8));
        assert_eq!(p.push(b"x"), Err(RingError::Corrupt));
    }

    #[test]
    fn two_threads_move_a_million_messages() {
        let r = Region::new(4096);
        let (p, c) = (r.ring(), r.ring());
        let total = 1_000_000u32;
        std::thread::scope(|s| {
            s.spawn(move || {
                for i in 0..total {
                    let len = 2 + (i as usize % 61);
                    let mut msg = vec![0u8; len];
                    msg[0] = i as u8;
                    msg[len - 1] = (i >> 8) as u8;
                    while !p.push(&msg).unwrap() {
                        std::hint::spin_loop();
                    }
                }
            });
            s.spawn(move || {
                let mut i = 0u32;
                while i < total {
                    if let Some(ok) = c
                        .pop(|m| {
                            m.len() == 2 + (i as usize % 61)
                                && m[0] == i as u8
                                && m[m.len() - 1] == (i >> 8) as u8
                        })
                        .unwrap()
                    {
                        assert!(ok, "message {i} corrupted");
                        i += 1;
                    } else {
                        std::hint::spin_loop();
                    }
                }
            });
        });
    }
}
