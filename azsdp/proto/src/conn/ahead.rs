//! Reading ahead: a receiver GETs the peer's advertised bytes before its
//! program asks for them, into staging memory from the fabric's pool, and a
//! later `recv()` copies them out.
//!
//! A zero-copy receive makes one GET, into the call's own buffer, and
//! returns when it has landed: the next GET starts with the next call. Where
//! a GET takes long to come back (RDMA READs on SoftRoCE under Linux 6.12:
//! 26 MB/s one at a time, 42-48 MB/s with several in flight), the link idles
//! between calls. With `read_ahead` bytes, the advertisements behind the one
//! a call is taking (all of them when no call waits) are fetched ahead,
//! several GETs in flight, at the price of a copy at the receiver (the
//! sender still sends zero-copy) and a lock round trip more per
//! advertisement (it is given back once the bytes landed, so that the
//! source may copy-on-write). Whether that pays depends on the fabric:
//! with `read_ahead_auto` (the shim's default) the connection's gauge
//! (`conn::ahead_gauge`) decides by trying; the shim allows it over verbs
//! only (a GET on shm is a CPU copy already).
//!
//! Nothing else changes: read-ahead bytes count as taken (GET_COMPLETE, the
//! switch's `consumed`) only when the program reads them, so the source
//! keeps its pages until then, as for any receive; a GET ahead holds the
//! advertisement's lock as any GET does, and gives it back once landed; a
//! withdrawn advertisement drops what was read ahead of its truncation.
//! Staging memory is given back only when no GET writes into it.

use super::rx::{Lock, RxItem};
use super::{AbortReason, Action, Connection, OpError, OpKind, State};
use crate::wire::AbortCode;

/// Where a read-ahead of one advertisement stands.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) enum AheadState {
    /// Waiting for the advertisement's lock.
    Locking,
    /// Waiting for staging memory.
    Allocating,
    /// The GET is in flight into `at`.
    Fetching,
    /// The bytes are at `at`.
    Landed,
}

/// A read-ahead of the rest of one advertisement.
#[derive(Clone, Copy, Debug)]
pub(super) struct Ahead {
    /// Staging memory (the pool's), once allocated.
    pub at: u64,
    /// Byte of the advertisement it starts at (its `taken` then).
    pub from: u32,
    pub len: u32,
    pub state: AheadState,
}

impl Ahead {
    /// Where byte `pos` of the advertisement is in staging.
    pub(super) fn staged(&self, pos: u32) -> u64 {
        self.at + u64::from(pos - self.from)
    }
}

impl Connection {
    /// Bytes read ahead, or on their way, that the program has not read.
    fn ahead_bytes(&self) -> u64 {
        self.in_avails
            .values()
            .filter_map(|a| a.ahead.map(|h| u64::from(h.from + h.len - a.taken)))
            .sum()
    }

    /// Move read-aheads on, and start new ones within `read_ahead`, in
    /// stream order.
    pub(super) fn read_ahead(&mut self) {
        if self.cfg.read_ahead == 0
            || self.state != State::Established
            || self.leaving_fabric()
            || self.orphaned
        {
            return;
        }
        // (With the gauge saying no, none starts; those under way go on.)
        let wanted = self.ahead_gauge.as_ref().is_none_or(|g| g.reading_ahead());
        let mut budget = if wanted {
            self.cfg.read_ahead.saturating_sub(self.ahead_bytes())
        } else {
            0
        };
        let ids: Vec<u32> = self
            .rxq
            .iter()
            .filter_map(|i| match i {
                RxItem::Avail(id) => Some(*id),
                RxItem::Data(_) => None,
            })
            .collect();
        for id in ids {
            let a = &self.in_avails[&id];
            match a.ahead.map(|h| h.state) {
                Some(AheadState::Locking) => {
                    if a.cancel_req {
                        self.drop_ahead(id);
                    } else if !self.by_lock(id, a.lock) {
                        return;
                    }
                    continue;
                }
                Some(_) => continue,
                None => {}
            }
            // A call is taking it, or the source withdraws it.
            if a.gets > 0 || a.cancel_req {
                continue;
            }
            let rest = a.len - a.taken;
            if rest == 0 {
                continue;
            }
            if u64::from(rest) > budget {
                return;
            }
            budget -= u64::from(rest);
            let lock = a.lock;
            let a = self.in_avails.get_mut(&id).expect("live");
            a.ahead = Some(Ahead {
                at: 0,
                from: a.taken,
                len: rest,
                state: AheadState::Locking,
            });
            // The reservation keeps the lock from being given back idle.
            a.gets += 1;
            if !self.by_lock(id, lock) {
                return;
            }
        }
    }

    /// The program took `n` bytes of the peer's advertisements (zero-copy
    /// or out of staging): what the gauge times.
    pub(super) fn took_advertised(&mut self, n: u64) {
        let now = self.now;
        if let Some(g) = self.ahead_gauge.as_mut()
            && g.took(now, n)
        {
            self.counters.ahead_switches += 1;
        }
    }

    /// Move reservation `id` on as its advertisement's lock allows: fetch
    /// when the lock is ours (or none is needed), ask for it when free (it
    /// may have been given back as we wanted it). Whether later
    /// advertisements may go on too: not while a lock is being taken,
    /// given back or copied under (one lock at a time, in stream order).
    fn by_lock(&mut self, id: u32, lock: Lock) -> bool {
        match lock {
            Lock::Held | Lock::Updated | Lock::Unused => {
                self.fetch_ahead(id);
                true
            }
            Lock::Free => {
                self.take_lock(id);
                false
            }
            Lock::Taking | Lock::Releasing | Lock::Copied => false,
        }
    }

    /// The lock is ours (or none is needed): ask for staging memory.
    fn fetch_ahead(&mut self, id: u32) {
        let a = self.in_avails.get_mut(&id).expect("live");
        let Some(h) = a.ahead.as_mut() else {
            return;
        };
        h.state = AheadState::Allocating;
        let len = u64::from(h.len);
        let op = self.op(OpKind::PoolAlloc { avail: id, len });
        self.push(Action::PoolAlloc { op, len });
    }

    /// Give up a read-ahead that has no memory yet (its reservation goes).
    fn drop_ahead(&mut self, id: u32) {
        let a = self.in_avails.get_mut(&id).expect("live");
        a.ahead = None;
        a.gets -= 1;
        if a.gets == 0 {
            self.after_gets(id);
        }
    }

    pub(super) fn on_pooled(&mut self, id: u32, len: u64, r: Result<u64, OpError>) {
        let live = self.state == State::Established && !self.leaving_fabric();
        let wanted = live
            && self
                .in_avails
                .get(&id)
                .is_some_and(|a| !a.cancel_req && a.ahead.is_some());
        match r {
            Ok(at) if wanted => {
                let a = self.in_avails.get_mut(&id).expect("live");
                let from = a.ahead.map_or(0, |h| h.from);
                let src = a.src_at(from);
                let h = a.ahead.as_mut().expect("reading ahead");
                h.at = at;
                h.state = AheadState::Fetching;
                self.counters.gets += 1;
                self.counters.get_bytes += len;
                let op = self.op(OpKind::GetAhead { avail: id, at, len });
                self.push(Action::Get {
                    op,
                    src,
                    dst: at,
                    len,
                    armed: false,
                });
            }
            r => {
                if let Ok(addr) = r {
                    self.push(Action::PoolFree { addr, len });
                }
                if self.in_avails.get(&id).is_some_and(|a| a.ahead.is_some()) {
                    // (No memory: a call takes it zero-copy instead.)
                    self.drop_ahead(id);
                }
            }
        }
    }

    pub(super) fn on_got_ahead(&mut self, id: u32, at: u64, len: u64, r: Result<(), OpError>) {
        let ours = self
            .in_avails
            .get(&id)
            .and_then(|a| a.ahead)
            .is_some_and(|h| h.at == at && h.state == AheadState::Fetching);
        if !ours {
            // The stream it was for is gone (an abort, a switch): nothing
            // writes into the memory any more.
            self.push(Action::PoolFree { addr: at, len });
            return;
        }
        if let Err(e) = r {
            self.push(Action::PoolFree { addr: at, len });
            let a = self.in_avails.get_mut(&id).expect("live");
            a.ahead = None;
            a.gets -= 1;
            self.abort(AbortReason::Fabric(e), Some(AbortCode::FabricError));
            return;
        }
        let a = self.in_avails.get_mut(&id).expect("live");
        a.ahead.as_mut().expect("reading ahead").state = AheadState::Landed;
        a.gets -= 1;
        if a.gets == 0 {
            // The lock goes back: the bytes are here.
            self.after_gets(id);
        }
    }

    /// Advertisement `id` is done with (read to its end, or truncated):
    /// its staging memory goes back.
    pub(super) fn free_ahead(&mut self, id: u32) {
        let Some(a) = self.in_avails.get_mut(&id) else {
            return;
        };
        if let Some(h) = a.ahead
            && h.state == AheadState::Landed
        {
            a.ahead = None;
            self.push(Action::PoolFree {
                addr: h.at,
                len: u64::from(h.len),
            });
        }
    }

    /// The receive stream is being dropped: staging memory no GET writes
    /// into goes back now; the rest when its operation completes.
    pub(super) fn free_all_ahead(&mut self) {
        let ids: Vec<u32> = self.in_avails.keys().copied().collect();
        for id in ids {
            self.free_ahead(id);
        }
    }
}
