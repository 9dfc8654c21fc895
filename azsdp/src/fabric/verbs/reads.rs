//! GETs as RDMA READs (no system calls: tested on its own).
//!
//! A long GET goes as several READs posted together rather than as one:
//! rxe (and NICs whose responder serves one READ at a time) streams one
//! long READ slower than shorter ones in flight at once (perftest in the
//! SoftRoCE guest: one 1 MiB READ at a time 27 MB/s, 128 KiB pieces eight
//! at a time 33 MB/s). The GET completes when its last piece does, with
//! the first failure of any.
//!
//! The send queue has room for [`ReadBook::budget`] READs: pieces past it
//! wait here, in order, and go as earlier ones complete (a post into a full
//! send queue fails, which would break the connection).

use std::collections::{HashMap, VecDeque};

use crate::conn::{OpError, OpId};

/// How a GET is cut.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct ReadSplit {
    /// Bytes of each piece (0: never split).
    pub piece: u32,
    /// At most this many pieces per GET (longer pieces past it).
    pub max_pieces: u32,
}

impl Default for ReadSplit {
    fn default() -> Self {
        ReadSplit {
            piece: 128 << 10,
            max_pieces: 16,
        }
    }
}

impl ReadSplit {
    /// The pieces of a GET of `len` bytes: `(offset, length)`, in order,
    /// covering `[0, len)` exactly, none empty (a GET of 0 bytes is one
    /// READ of 0 bytes), none longer than `u32::MAX`.
    pub fn pieces(&self, len: u64) -> impl Iterator<Item = (u64, u32)> {
        let cap = u64::from(u32::MAX) & !0xfff;
        let piece = if self.piece == 0 {
            cap
        } else {
            let floor = len.div_ceil(u64::from(self.max_pieces.max(1)));
            // Whole pages per piece, so that pieces start on page
            // boundaries of page-aligned buffers.
            u64::from(self.piece)
                .max(floor.next_multiple_of(4096))
                .min(cap)
        };
        let count = len.div_ceil(piece).max(1);
        (0..count).map(move |i| {
            let at = i * piece;
            (at, (len - at).min(piece) as u32)
        })
    }
}

/// One READ of a GET.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Piece {
    pub op: OpId,
    /// Where it lands (our address, lkey).
    pub dst: u64,
    pub lkey: u32,
    /// Where it is read (the peer's address, rkey).
    pub src: u64,
    pub rkey: u32,
    pub len: u32,
}

#[derive(Debug)]
struct Group {
    /// Pieces not completed yet (posted or waiting).
    left: u32,
    failed: Option<OpError>,
}

/// The GETs in flight, by piece.
#[derive(Debug)]
pub struct ReadBook {
    split: ReadSplit,
    budget: u32,
    /// Pieces on the send queue.
    out: u32,
    groups: HashMap<OpId, Group>,
    waiting: VecDeque<Piece>,
}

impl ReadBook {
    /// `budget`: READs the send queue has room for (at least one).
    pub fn new(split: ReadSplit, budget: u32) -> ReadBook {
        ReadBook {
            split,
            budget: budget.max(1),
            out: 0,
            groups: HashMap::new(),
            waiting: VecDeque::new(),
        }
    }

    /// READs the send queue may hold.
    pub fn budget(&self) -> u32 {
        self.budget
    }

    /// Start a GET: its pieces wait in order; take them with
    /// [`ReadBook::next_to_post`].
    #[allow(clippy::too_many_arguments)]
    pub fn start(&mut self, op: OpId, dst: u64, lkey: u32, src: u64, rkey: u32, len: u64) {
        let mut n = 0;
        for (at, plen) in self.split.pieces(len) {
            self.waiting.push_back(Piece {
                op,
                dst: dst + at,
                lkey,
                src: src + at,
                rkey,
                len: plen,
            });
            n += 1;
        }
        self.groups.insert(
            op,
            Group {
                left: n,
                failed: None,
            },
        );
    }

    /// The next piece the send queue has room for; the caller posts it
    /// (and says [`ReadBook::posted`], or fails it with
    /// [`ReadBook::piece_done`]).
    pub fn next_to_post(&mut self) -> Option<Piece> {
        if self.out >= self.budget {
            return None;
        }
        self.waiting.pop_front()
    }

    /// A piece [`ReadBook::next_to_post`] gave is on the send queue.
    pub fn posted(&mut self) {
        self.out += 1;
    }

    /// A posted piece completed (`on_queue`: it had been posted) or failed.
    /// The GET's result once it was its last.
    pub fn piece_done(
        &mut self,
        op: OpId,
        on_queue: bool,
        result: Result<(), OpError>,
    ) -> Option<Result<(), OpError>> {
        if on_queue {
            self.out = self.out.saturating_sub(1);
        }
        let g = self.groups.get_mut(&op)?;
        if let Err(e) = result {
            g.failed.get_or_insert(e);
        }
        g.left -= 1;
        if g.left > 0 {
            return None;
        }
        let g = self.groups.remove(&op)?;
        Some(g.failed.map_or(Ok(()), Err))
    }

    /// The connection is over: every piece not yet posted fails. The GETs
    /// this ends, with their result.
    pub fn fail_waiting(&mut self, e: OpError) -> Vec<(OpId, Result<(), OpError>)> {
        let mut ended = Vec::new();
        while let Some(p) = self.waiting.pop_front() {
            if let Some(r) = self.piece_done(p.op, false, Err(e)) {
                ended.push((p.op, r));
            }
        }
        ended
    }

    /// GETs not completed.
    pub fn in_flight(&self) -> usize {
        self.groups.len()
    }

    /// Pieces waiting for room on the send queue.
    pub fn waiting(&self) -> usize {
        self.waiting.len()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    #[test]
    fn a_megabyte_goes_as_eight_pieces_of_128_kib() {
        let p: Vec<_> = ReadSplit::default().pieces(1 << 20).collect();
        assert_eq!(p.len(), 8);
        assert!(p.iter().all(|&(_, l)| l == 128 << 10));
    }

    #[test]
    fn short_gets_and_empty_ones_are_one_read() {
        let s = ReadSplit::default();
        assert_eq!(s.pieces(4096).collect::<Vec<_>>(), vec![(0, 4096)]);
        assert_eq!(s.pieces(0).collect::<Vec<_>>(), vec![(0, 0)]);
        let never = ReadSplit {
            piece: 0,
            max_pieces: 16,
        };
        assert_eq!(never.pieces(8 << 20).count(), 1);
    }

    #[test]
    fn the_budget_holds_pieces_back_until_earlier_ones_complete() {
        let mut b = ReadBook::new(ReadSplit::default(), 3);
        b.start(OpId(1), 0x10000, 1, 0x20000, 2, 1 << 20);
        let mut first = Vec::new();
        while let Some(p) = b.next_to_post() {
            b.posted();
            first.push(p);
        }
        assert_eq!(first.len(), 3);
        assert_eq!(b.waiting(), 5);
        assert_eq!(b.piece_done(OpId(1), true, Ok(())), None);
        let p = b.next_to_post().expect("room for one more");
        b.posted();
        assert_eq!(p.dst, 0x10000 + 3 * (128 << 10));
        assert_eq!(p.src, 0x20000 + 3 * (128 << 10));
        assert_eq!(b.next_to_post(), None);
    }

    #[test]
    fn a_failed_piece_fails_its_get_once_all_are_back() {
        let mut b = ReadBook::new(ReadSplit::default(), 64);
        b.start(OpId(7), 0, 1, 0, 2, 512 << 10);
        while b.next_to_post().is_some() {
            b.posted();
        }
        assert_eq!(b.piece_done(OpId(7), true, Ok(())), None);
        assert_eq!(
            b.piece_done(OpId(7), true, Err(OpError::RemoteAccess)),
            None
        );
        assert_eq!(b.piece_done(OpId(7), true, Err(OpError::Unreachable)), None);
        assert_eq!(
            b.piece_done(OpId(7), true, Ok(())),
            Some(Err(OpError::RemoteAccess))
        );
        assert_eq!(b.in_flight(), 0);
    }

    #[test]
    fn waiting_pieces_fail_when_the_connection_ends() {
        let mut b = ReadBook::new(ReadSplit::default(), 2);
        b.start(OpId(1), 0, 1, 0, 2, 1 << 20);
        b.start(OpId(2), 0, 1, 0, 2, 4096);
        for _ in 0..2 {
            b.next_to_post().unwrap();
            b.posted();
        }
        // Op 1's two posted pieces are still out: only op 2 ends now.
        let ended = b.fail_waiting(OpError::Unreachable);
        assert_eq!(ended, vec![(OpId(2), Err(OpError::Unreachable))]);
        assert_eq!(b.piece_done(OpId(1), true, Err(OpError::Unreachable)), None);
        assert_eq!(
            b.piece_done(OpId(1), true, Err(OpError::Unreachable)),
            Some(Err(OpError::Unreachable))
        );
    }

    proptest! {
        #[test]
        fn pieces_cover_the_get_exactly(len in 0u64..(64 << 20), piece in 0u32..(1 << 22), max in 1u32..64) {
            let s = ReadSplit { piece, max_pieces: max };
            let p: Vec<_> = s.pieces(len).collect();
            let mut at = 0;
            for &(off, l) in &p {
                prop_assert_eq!(off, at);
                prop_assert!(l > 0 || len == 0);
                at += u64::from(l);
            }
            prop_assert_eq!(at, len);
            if piece != 0 {
                prop_assert!(p.len() as u32 <= max);
            }
        }

        #[test]
        fn every_get_completes_once_whatever_the_order(
            lens in proptest::collection::vec(0u64..(3 << 20), 1..12),
            budget in 1u32..20,
            fail_at in proptest::option::of(0usize..40),
            picks in proptest::collection::vec(any::<usize>(), 0..400),
        ) {
            let mut b = ReadBook::new(ReadSplit::default(), budget);
            for (i, &len) in lens.iter().enumerate() {
                b.start(OpId(i as u64), 0, 1, 0, 2, len);
            }
            let mut out: Vec<Piece> = Vec::new();
            let mut done: HashMap<u64, Result<(), OpError>> = HashMap::new();
            let mut completed = 0usize;
            let mut picks = picks.into_iter();
            loop {
                while let Some(p) = b.next_to_post() {
                    b.posted();
                    out.push(p);
                }
                prop_assert!(out.len() as u32 <= budget);
                if out.is_empty() {
                    break;
                }
                let i = picks.next().unwrap_or(0) % out.len();
                let p = out.remove(i);
                let r = if fail_at == Some(completed) { Err(OpError::Unreachable) } else { Ok(()) };
                completed += 1;
                if let Some(res) = b.piece_done(p.op, true, r) {
                    prop_assert!(done.insert(p.op.0, res).is_none());
                }
            }
            prop_assert_eq!(done.len(), lens.len());
            prop_assert_eq!(b.in_flight(), 0);
            let failures = done.values().filter(|r| r.is_err()).count();
            prop_assert_eq!(failures, usize::from(fail_at.is_some_and(|f| f < completed)));
        }
    }
}
