//! The receive path: DATA buffering and credits, SRC_AVAIL bookkeeping, the
//! sink's lock protocol, GETs (partial, armed), cancellation and discard.

use std::ops::Range;

use super::lockword;
use super::{
    AbortReason, Action, CallError, CallId, CasTarget, Connection, DisarmOutcome, OpError, OpKind,
    OutMsg, ProtocolError, RecvFlags, RemoteBuf, State, UserBuf, UserMemory,
};
use crate::pages;
use crate::time::Timestamp;
use crate::wire::{self, AbortCode, MsgType};

/// An item of the incoming stream, in order.
#[derive(Clone, Copy, Debug, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub(super) enum RxItem {
    /// Unconsumed DATA bytes at the front of the receive buffer.
    Data(u64),
    /// An advertisement not yet wholly taken.
    Avail(u32),
}

/// The sink's view of the lock word of one advertisement.
#[derive(Clone, Copy, Debug, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub(super) enum Lock {
    Free,
    Taking,
    Held,
    Releasing,
    /// The source copied the data away; waiting for SRC_AVAIL_UPDATE.
    Copied,
    /// Reading from the source's private copy: no lock needed.
    Updated,
    /// This sink offered no lock words (no compare-and-swap): the source
    /// never copies, so nothing needs locking.
    Unused,
}

/// A SRC_AVAIL received from the peer.
#[derive(Debug, serde::Serialize, serde::Deserialize)]
pub(super) struct InAvail {
    pub slot: u16,
    pub gen_: u32,
    pub stream_off: u64,
    pub len: u32,
    pub src: RemoteBuf,
    /// Byte of the advertisement that `src.addr` points at (non-zero after an update).
    pub src_base: u32,
    pub update_seen: bool,
    /// Bytes handed to receives (GETs issued), in order.
    pub taken: u32,
    /// GETs in flight (consuming or peeking), plus arms pending.
    pub gets: u32,
    pub lock: Lock,
    /// Last `consumed` sent in GET_COMPLETE.
    pub reported: u32,
    pub cancel_req: bool,
    /// Its rest read ahead of the program (`ahead`); none in a parked
    /// connection.
    #[serde(skip)]
    pub ahead: Option<super::ahead::Ahead>,
}

impl InAvail {
    /// No GET in flight, and a cancel or the end of the data is waiting to
    /// be settled (truncate, release, report).
    fn needs_settling(&self) -> bool {
        self.gets == 0 && (self.cancel_req || self.taken == self.len)
    }

    /// The lock state once the source is known to have copied the data away.
    fn copied_state(&self) -> Lock {
        if self.update_seen {
            Lock::Updated
        } else {
            Lock::Copied
        }
    }

    pub(super) fn src_at(&self, off: u32) -> RemoteBuf {
        RemoteBuf {
            addr: self.src.addr + u64::from(off - self.src_base),
            key: self.src.key,
        }
    }
}

/// An application `recv()` in progress.
#[derive(Debug)]
pub(super) struct RecvCall {
    pub call: CallId,
    pub buf: UserBuf,
    pub flags: RecvFlags,
    pub filled: u64,
    /// Synchronous GETs writing into this buffer.
    pub gets: u32,
    /// Arms not yet answered.
    pub pending_arm: u32,
    pub cancelled: bool,
    /// A GET into the buffer failed: the call cannot succeed.
    pub failed: bool,
    /// MSG_PEEK: the stream has been walked and the copies issued.
    pub peek_done: bool,
    /// Bytes taken from DATA and from advertisements (counted on success);
    /// of the latter, those read ahead.
    pub via_bsdp: u64,
    pub via_zcopy: u64,
    pub via_ahead: u64,
}

/// Why filling a receive stopped.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Stop {
    Full,
    /// Nothing (more) in the stream.
    Empty,
    /// Waiting for a lock, an evacuation, or a cancel to resolve.
    Wait,
    /// The call was cancelled (whatever the stream still holds: this is
    /// not its end, even after the peer's SHUTDOWN came).
    Cancelled,
}

impl Connection {
    /// `recv()`: the result arrives as [`Action::CallDone`] for `call`
    /// (0 bytes means end of stream).
    pub fn recv(
        &mut self,
        now: Timestamp,
        call: CallId,
        buf: UserBuf,
        flags: RecvFlags,
        mem: &mut dyn UserMemory,
    ) {
        self.now = now;
        self.counters.recvs += 1;
        if let Some(err) = self.abort_error() {
            // After the peer's EOF the stream's end comes first (the error
            // stays pending for a send or SO_ERROR), as TCP in CLOSE_WAIT.
            let eof = self.error_reported || self.aborted_after_eof;
            let result = if eof { Ok(0) } else { Err(err) };
            self.error_reported |= !eof;
            self.push(Action::CallDone { call, result });
            return;
        }
        if self.join.route() != super::RxRoute::Fabric && self.state != State::Switched {
            // The peer's stream still comes over TCP here (join.rs).
            self.push(Action::CallDone {
                call,
                result: Err(CallError::OnTcp),
            });
            return;
        }
        if buf.len == 0 {
            self.push(Action::CallDone {
                call,
                result: Ok(0),
            });
            return;
        }
        self.recv_calls.push_back(RecvCall {
            call,
            buf,
            flags,
            filled: 0,
            gets: 0,
            pending_arm: 0,
            cancelled: false,
            failed: false,
            peek_done: false,
            via_bsdp: 0,
            via_zcopy: 0,
            via_ahead: 0,
        });
        self.progress(mem);
    }

    pub(super) fn progress_recvs(&mut self, mem: &mut dyn UserMemory) {
        if self.leaving_fabric() && self.state == State::Established && !self.orphaned {
            // Calls that took bytes end with them (switch.rs); the rest
            // wait, and go again over TCP.
            return;
        }
        loop {
            if self.recv_calls.is_empty() {
                return;
            }
            let aborted = self.abort_error();
            let stop = match self.state {
                State::Established => self.fill_recv(mem),
                // After an orphan switch, what the dead peer sent is read
                // first (it can be read from nowhere else).
                State::Switched if self.orphaned => self.fill_recv(mem),
                State::Handshake => Stop::Empty,
                State::Aborted(_) | State::Switched => Stop::Wait,
            };
            let call = self.recv_calls.front().expect("head call");
            if call.gets > 0 || call.pending_arm > 0 {
                return;
            }
            let (filled, f) = (call.filled, call.flags);
            let result = if let Some(err) = aborted {
                // (What it was given may not all have landed: it fails.)
                // The error once, then the end of the stream.
                if self.error_reported { Ok(0) } else { Err(err) }
            } else if call.failed {
                Err(CallError::ConnReset)
            } else if self.state == State::Switched
                && self.orphaned
                && filled == 0
                && (self.rx_eof || self.rx_shut)
            {
                // The dead peer had ended its stream: its heirs will not
                // write (the end, as TCP's FIN would say).
                Ok(0)
            } else if self.state == State::Switched {
                // Made after the switch (it raced the caller's look): it
                // goes again over TCP.
                if filled > 0 {
                    Ok(filled)
                } else {
                    Err(CallError::Switched)
                }
            } else if stop == Stop::Full
                || (filled > 0 && (!f.waitall || f.peek))
                || (stop == Stop::Empty && (self.rx_eof || self.rx_shut))
            {
                // Full; or some data and no reason to wait for more; or EOF.
                Ok(filled)
            } else if call.cancelled {
                if filled > 0 {
                    Ok(filled)
                } else {
                    Err(CallError::Interrupted)
                }
            } else if stop == Stop::Empty && f.nonblocking {
                if filled > 0 {
                    Ok(filled)
                } else {
                    Err(CallError::WouldBlock)
                }
            } else {
                return;
            };
            if aborted.is_some() && result.is_err() {
                self.error_reported = true;
            }
            let call = self.recv_calls.pop_front().expect("head call");
            if result.is_ok() && aborted.is_none() && !call.flags.peek {
                self.counters.bytes_recv_bsdp += call.via_bsdp;
                self.counters.bytes_recv_zcopy += call.via_zcopy;
                self.counters.bytes_recv_ahead += call.via_ahead;
            }
            self.push(Action::CallDone {
                call: call.call,
                result,
            });
        }
    }

    /// Move stream bytes into the head receive: copies from DATA, GETs from
    /// advertisements. Issues work; does not wait for it.
    fn fill_recv(&mut self, mem: &mut dyn UserMemory) -> Stop {
        let call = &mut self.recv_calls[0];
        if !call.flags.peek {
            return self.fill_from_stream(mem);
        }
        // MSG_PEEK consumes nothing: each attempt walks the stream from its
        // start, once, and its copies must land before another attempt.
        if call.gets > 0 || call.pending_arm > 0 {
            return Stop::Wait;
        }
        if call.peek_done {
            return Stop::Full;
        }
        call.filled = 0;
        let stop = self.fill_from_stream(mem);
        let call = &mut self.recv_calls[0];
        // MSG_WAITALL is ignored with MSG_PEEK: peeking consumes nothing, so a
        // synchronous sender would never advertise more (docs/protocol.md).
        if stop == Stop::Full || call.filled > 0 {
            call.peek_done = true;
            return Stop::Full;
        }
        stop
    }

    fn fill_from_stream(&mut self, mem: &mut dyn UserMemory) -> Stop {
        let peek = self.recv_calls[0].flags.peek;
        // With MSG_PEEK nothing is consumed: walk the stream with a cursor.
        let (mut idx, mut skip, mut rx_skip) = (0usize, 0u64, 0usize);
        loop {
            let call = &self.recv_calls[0];
            let want = call.buf.len - call.filled;
            if want == 0 {
                return Stop::Full;
            }
            if call.cancelled {
                return Stop::Cancelled;
            }
            let dst = call.buf.addr + call.filled;
            let Some(item) = self.rxq.get(idx).copied() else {
                return Stop::Empty;
            };
            match item {
                RxItem::Data(n) => {
                    let k = want.min(n - skip);
                    if self.must_clear(dst..dst + k) {
                        return Stop::Wait;
                    }
                    copy_out(&self.rxbuf, rx_skip, k as usize, mem, dst);
                    self.recv_calls[0].filled += k;
                    if peek {
                        rx_skip += k as usize;
                        skip += k;
                        if skip == n {
                            idx += 1;
                            skip = 0;
                        }
                    } else {
                        self.rxbuf.drain(..k as usize);
                        self.consume_data(k);
                        self.recv_calls[0].via_bsdp += k;
                        if k == n {
                            self.rxq.pop_front();
                        } else {
                            self.rxq[0] = RxItem::Data(n - k);
                        }
                    }
                }
                RxItem::Avail(id) if self.in_avails[&id].ahead.is_some() => {
                    // Read ahead: copied out of staging once it has landed.
                    let a = &self.in_avails[&id];
                    let h = a.ahead.expect("reading ahead");
                    if a.cancel_req || h.state != super::ahead::AheadState::Landed {
                        return Stop::Wait;
                    }
                    let pos = a.taken + skip as u32;
                    let k = want.min(u64::from(a.len - pos));
                    if self.must_clear(dst..dst + k) {
                        return Stop::Wait;
                    }
                    mem.copy(h.staged(pos), dst, k as usize);
                    let call = &mut self.recv_calls[0];
                    call.filled += k;
                    if peek {
                        idx += 1;
                        skip = 0;
                    } else {
                        call.via_zcopy += k;
                        call.via_ahead += k;
                        self.took_advertised(k);
                        let a = self.in_avails.get_mut(&id).expect("live");
                        a.taken += k as u32;
                        if a.taken == a.len {
                            self.rxq.pop_front();
                            self.free_ahead(id);
                            self.after_gets(id);
                        }
                    }
                }
                RxItem::Avail(id) => {
                    let a = &self.in_avails[&id];
                    if a.cancel_req {
                        return Stop::Wait;
                    }
                    let pos = a.taken + skip as u32;
                    let k = want.min(u64::from(a.len - pos));
                    debug_assert!(k > 0, "empty advertisement {id} left in the stream: {a:?}");
                    let lock = a.lock;
                    // Clear the destination before taking the lock: holding it
                    // while waiting would block the source's copy-on-write.
                    if self.must_clear(dst..dst + k) {
                        return Stop::Wait;
                    }
                    match lock {
                        Lock::Held | Lock::Updated | Lock::Unused => {}
                        Lock::Free => {
                            self.take_lock(id);
                            return Stop::Wait;
                        }
                        Lock::Taking | Lock::Releasing | Lock::Copied => return Stop::Wait,
                    }
                    self.get_into_call(id, pos, dst, k);
                    self.recv_calls[0].filled += k;
                    if peek {
                        idx += 1;
                        skip = 0;
                    } else {
                        self.took_advertised(k);
                        let a = self.in_avails.get_mut(&id).expect("live");
                        a.taken += k as u32;
                        self.recv_calls[0].via_zcopy += k;
                        if a.taken == a.len {
                            self.rxq.pop_front();
                        }
                    }
                }
            }
        }
    }

    /// Is `r` busy with our own protections? If so, start clearing it.
    fn must_clear(&mut self, r: Range<u64>) -> bool {
        let page = self.page();
        let pages_r = pages::covering_pages(r.start, r.end - r.start, page);
        let busy = self.memory_busy(&pages_r, true);
        if busy {
            // Writing here would fault on our own protection: copy the sends
            // aside (never wait on the peer's application), or let the earlier
            // armed receive land.
            self.evacuate_range(&pages_r);
        }
        busy
    }

    /// Issue the GETs that move `k` bytes at `pos` of advertisement `id` into
    /// the head call's buffer at `dst`, arming whole pages when worthwhile.
    fn get_into_call(&mut self, id: u32, pos: u32, dst: u64, k: u64) {
        let call = &self.recv_calls[0];
        let (call_id, flags) = (call.call, call.flags);
        let middle = pages::whole_pages(dst, k, self.page());
        let mlen = middle.end - middle.start;
        let arm = !flags.peek && flags.armable && self.cfg.arms_pages(mlen);
        let a = &self.in_avails[&id];
        if !arm {
            let src = a.src_at(pos);
            self.issue_get(id, Some(call_id), src, dst, k, None);
            return;
        }
        let head = middle.start - dst;
        let tail = dst + k - middle.end;
        let src_head = a.src_at(pos);
        let src_mid = a.src_at(pos + head as u32);
        let src_tail = a.src_at(pos + (head + mlen) as u32);
        self.counters.armed_recvs += 1;
        self.counters.armed_bytes += mlen;
        self.recv_calls[0].pending_arm += 1;
        self.in_avails.get_mut(&id).expect("live").gets += 1;
        let op = self.op(OpKind::Arm {
            avail: id,
            call: call_id,
            range: middle.clone(),
            src: src_mid,
        });
        // The arm first: it moves the middle pages out, which a huge page
        // allows only while no page of it is pinned, and the head and tail
        // GETs register (pin, on a NIC) the pages beside them.
        self.push(Action::Arm { op, range: middle });
        if head > 0 {
            self.issue_get(id, Some(call_id), src_head, dst, head, None);
        }
        if tail > 0 {
            self.issue_get(id, Some(call_id), src_tail, dst + k - tail, tail, None);
        }
    }

    fn issue_get(
        &mut self,
        id: u32,
        call: Option<CallId>,
        src: RemoteBuf,
        dst: u64,
        len: u64,
        armed: Option<Range<u64>>,
    ) {
        if let Some(c) = call
            && let Some(rc) = self.recv_calls.iter_mut().find(|r| r.call == c)
        {
            rc.gets += 1;
        }
        if armed.is_none() || call.is_some() {
            self.in_avails.get_mut(&id).expect("live").gets += 1;
        }
        self.counters.gets += 1;
        self.counters.get_bytes += len;
        let is_armed = armed.is_some();
        let op = self.op(OpKind::Get {
            avail: id,
            call,
            armed,
        });
        self.push(Action::Get {
            op,
            src,
            dst,
            len,
            armed: is_armed,
        });
    }

    pub(super) fn on_armed(
        &mut self,
        id: u32,
        call: CallId,
        range: Range<u64>,
        src: RemoteBuf,
        r: Result<(), OpError>,
    ) {
        if let Some(c) = self.recv_calls.iter_mut().find(|c| c.call == call) {
            c.pending_arm -= 1;
        }
        let live = !self.is_aborted() && self.in_avails.contains_key(&id);
        match r {
            Ok(()) if live => {
                let fresh = self.armed.add(range.clone());
                debug_assert_eq!(fresh, vec![range.clone()], "armed pages overlap");
                let len = range.end - range.start;
                // The arm's reservation on `gets` becomes this GET's.
                self.issue_get(id, None, src, range.start, len, Some(range));
            }
            Ok(()) => {
                self.push(Action::Disarm {
                    range,
                    outcome: DisarmOutcome::Abandoned,
                });
            }
            Err(_) if live => {
                self.counters.arm_failures += 1;
                let a = self.in_avails.get_mut(&id).expect("live");
                a.gets -= 1; // the reservation; issue_get counts the sync GET
                let len = range.end - range.start;
                self.issue_get(id, Some(call), src, range.start, len, None);
            }
            Err(_) => {}
        }
    }

    pub(super) fn on_get_done(
        &mut self,
        id: u32,
        call: Option<CallId>,
        armed: Option<Range<u64>>,
        r: Result<(), OpError>,
    ) {
        if let Some(c) = call
            && let Some(rc) = self.recv_calls.iter_mut().find(|rc| rc.call == c)
        {
            rc.gets -= 1;
            if r.is_err() {
                rc.failed = true;
            }
        }
        if let Some(range) = armed
            && self.armed.count_at(range.start) > 0
        {
            let _ = self.armed.remove(range.clone());
            let outcome = if r.is_ok() {
                DisarmOutcome::Landed
            } else {
                self.counters.armed_lost_bytes += range.end - range.start;
                DisarmOutcome::Lost
            };
            self.push(Action::Disarm { range, outcome });
        }
        if let Err(e) = r {
            self.abort(AbortReason::Fabric(e), Some(AbortCode::FabricError));
            return;
        }
        let Some(a) = self.in_avails.get_mut(&id) else {
            return;
        };
        a.gets -= 1;
        if a.gets == 0 {
            self.after_gets(id);
        }
    }

    /// No GET is in flight on advertisement `id`: report progress to the source.
    pub(super) fn after_gets(&mut self, id: u32) {
        let a = self.in_avails.get_mut(&id).expect("live");
        if a.gets > 0 {
            return;
        }
        if a.cancel_req && a.taken < a.len {
            // (What was read ahead past the truncation is dropped.)
            self.free_ahead(id);
            let a = self.in_avails.get_mut(&id).expect("live");
            a.len = a.taken;
            // Withdrawals may resolve in any order; the stream ends at the
            // earliest truncation.
            self.rx_stream_off = self.rx_stream_off.min(a.stream_off + u64::from(a.taken));
            self.rxq.retain(|x| *x != RxItem::Avail(id));
        }
        let a = &self.in_avails[&id];
        if a.taken == a.len {
            self.release_lock(id, true);
        } else if a.taken > a.reported || a.lock == Lock::Held {
            self.release_lock(id, false);
        }
    }

    /// A lock held with no GET in flight blocks the source's copy-on-write:
    /// give it back (a receive that still needs it takes it again).
    pub(super) fn release_idle_locks(&mut self) {
        let idle: Vec<u32> = self
            .in_avails
            .iter()
            .filter(|(_, a)| a.lock == Lock::Held && a.gets == 0)
            .map(|(id, _)| *id)
            .collect();
        for id in idle {
            self.after_gets(id);
        }
    }

    pub(super) fn take_lock(&mut self, id: u32) {
        let a = self.in_avails.get_mut(&id).expect("live");
        a.lock = Lock::Taking;
        let (slot, g) = (a.slot, a.gen_);
        let op = self.op(OpKind::LockTake { avail: id });
        self.push(Action::Cas {
            op,
            target: CasTarget::Local { slot },
            expect: lockword::open(g),
            new: lockword::taken(g),
        });
    }

    /// Give the lock back (and the slot, when `finished`), then GET_COMPLETE.
    fn release_lock(&mut self, id: u32, finished: bool) {
        let a = self.in_avails.get_mut(&id).expect("live");
        let g = a.gen_;
        if finished && a.lock == Lock::Copied {
            // The source copied the data away and its UPDATE is on its
            // way; this side needs it no more (its bytes were read ahead):
            // it will be taken for what it is.
            self.updates_due.insert(id);
        }
        let expect = match a.lock {
            Lock::Held => lockword::taken(g),
            Lock::Free if finished => lockword::open(g),
            Lock::Copied | Lock::Updated if finished => lockword::copied(g),
            Lock::Unused => {
                // No lock word in use: just report (and free the slot).
                if a.taken > a.reported || finished {
                    self.report_taken(id, finished);
                }
                return;
            }
            Lock::Updated | Lock::Free => {
                // Nothing to release: just report.
                if a.taken > a.reported {
                    self.report_taken(id, false);
                }
                return;
            }
            Lock::Copied | Lock::Taking | Lock::Releasing => return,
        };
        a.lock = Lock::Releasing;
        let slot = a.slot;
        let new = if finished {
            lockword::open(g.wrapping_add(1))
        } else {
            lockword::open(g)
        };
        let op = self.op(OpKind::LockRelease {
            avail: id,
            expect,
            finished,
        });
        self.push(Action::Cas {
            op,
            target: CasTarget::Local { slot },
            expect,
            new,
        });
    }

    pub(super) fn on_lock_taken(
        &mut self,
        id: u32,
        r: Result<u64, OpError>,
    ) -> Result<(), AbortReason> {
        let old = r.map_err(AbortReason::Fabric)?;
        let Some(a) = self.in_avails.get_mut(&id) else {
            return Ok(());
        };
        let g = a.gen_;
        if old == lockword::open(g) {
            a.lock = Lock::Held;
        } else if old == lockword::copied(g) {
            a.lock = a.copied_state();
        } else {
            return Err(AbortReason::Protocol(ProtocolError::LockWord {
                slot: a.slot,
                value: old,
            }));
        }
        // A cancel or discard may have been waiting for the lock to settle.
        if a.needs_settling() {
            self.after_gets(id);
        }
        Ok(())
    }

    pub(super) fn on_lock_released(
        &mut self,
        id: u32,
        expect: u64,
        finished: bool,
        r: Result<u64, OpError>,
    ) -> Result<(), AbortReason> {
        let old = r.map_err(AbortReason::Fabric)?;
        let Some(a) = self.in_avails.get_mut(&id) else {
            return Ok(());
        };
        let g = a.gen_;
        if old != expect {
            if old == lockword::copied(g) && expect == lockword::open(g) {
                // The source copied the data away meanwhile.
                a.lock = a.copied_state();
                if finished {
                    self.release_lock(id, true);
                }
                return Ok(());
            }
            return Err(AbortReason::Protocol(ProtocolError::LockWord {
                slot: a.slot,
                value: old,
            }));
        }
        a.lock = if a.update_seen {
            Lock::Updated
        } else {
            Lock::Free
        };
        let settle = !finished && a.needs_settling();
        if settle {
            // Everything was taken (or a cancel waits) meanwhile, as a read
            // ahead's bytes can be while its lock goes back: the finishing
            // release reports it, once (a report of the whole length that
            // is not the last would end the advertisement twice).
            self.after_gets(id);
        } else {
            self.report_taken(id, finished);
        }
        Ok(())
    }

    /// GET_COMPLETE for what advertisement `id` has had taken; when
    /// `finished`, the advertisement ends and its slot moves to the next
    /// generation.
    fn report_taken(&mut self, id: u32, finished: bool) {
        let a = self.in_avails.get_mut(&id).expect("live");
        a.reported = a.taken;
        let msg = wire::GetComplete {
            id,
            consumed: a.taken,
            final_: finished,
        };
        self.out.push_back(OutMsg::GetComplete(msg));
        if finished {
            let (slot, gen_) = (usize::from(a.slot), a.gen_);
            self.in_avails.remove(&id);
            self.my_slot_user[slot] = None;
            self.my_slot_gen[slot] = gen_.wrapping_add(1);
        }
    }

    pub(super) fn on_data(&mut self, payload: &[u8]) -> Result<(), ProtocolError> {
        let ty = MsgType::Data;
        if self.rx_slots_held >= u32::from(self.cfg.rx_credits.max(1)) {
            return Err(ProtocolError::Invalid {
                ty,
                why: "sent without a credit",
            });
        }
        let max = self.cfg.slot_size as usize - wire::HEADER_LEN;
        if payload.len() > max {
            return Err(ProtocolError::Invalid {
                ty,
                why: "payload larger than the receive slot",
            });
        }
        self.rx_slots_held += 1;
        let n = payload.len() as u64;
        self.rx_stream_off += n;
        if self.app_closed {
            self.abort(AbortReason::LocalReset, Some(AbortCode::Closed));
            return Ok(());
        }
        if self.rx_shut {
            self.unreported += 1;
            return Ok(());
        }
        self.rxbuf.extend(payload);
        self.rx_msgs.push_back(n);
        match self.rxq.back_mut() {
            Some(RxItem::Data(m)) => *m += n,
            _ => self.rxq.push_back(RxItem::Data(n)),
        }
        Ok(())
    }

    /// The application consumed `k` DATA bytes: free the slots they emptied.
    fn consume_data(&mut self, mut k: u64) {
        while k > 0 {
            let Some(front) = self.rx_msgs.front_mut() else {
                debug_assert!(false, "consumed more than received");
                return;
            };
            let m = k.min(*front);
            *front -= m;
            k -= m;
            if *front == 0 {
                self.rx_msgs.pop_front();
                self.unreported += 1;
            }
        }
    }

    pub(super) fn on_src_avail(&mut self, m: wire::SrcAvail) -> Result<(), ProtocolError> {
        let ty = MsgType::SrcAvail;
        let slots = self.my_slot_gen.len();
        if !self.cfg.caps.zcopy_sink || slots == 0 {
            return Err(ProtocolError::Unexpected {
                ty,
                when: "without ZCOPY_SINK",
            });
        }
        if m.id != self.rx_next_avail_id {
            return Err(ProtocolError::Invalid {
                ty,
                why: "advertisement ids out of order",
            });
        }
        let slot = usize::from(m.lock_slot);
        if slot >= slots {
            return Err(ProtocolError::Invalid {
                ty,
                why: "lock slot out of range",
            });
        }
        if self.my_slot_user[slot].is_some() {
            return Err(ProtocolError::Invalid {
                ty,
                why: "lock slot already in use",
            });
        }
        if m.lock_gen != self.my_slot_gen[slot] {
            return Err(ProtocolError::Invalid {
                ty,
                why: "stale lock generation",
            });
        }
        if m.stream_off != self.rx_stream_off {
            return Err(ProtocolError::StreamOffset {
                ty,
                expected: self.rx_stream_off,
                got: m.stream_off,
            });
        }
        self.rx_next_avail_id = self.rx_next_avail_id.wrapping_add(1);
        self.rx_stream_off += u64::from(m.len);
        self.my_slot_user[slot] = Some(m.id);
        self.in_avails.insert(
            m.id,
            InAvail {
                slot: m.lock_slot,
                gen_: m.lock_gen,
                stream_off: m.stream_off,
                len: m.len,
                src: RemoteBuf {
                    addr: m.addr,
                    key: m.key,
                },
                src_base: 0,
                update_seen: false,
                taken: 0,
                gets: 0,
                lock: if self.cfg.caps.cas {
                    Lock::Free
                } else {
                    Lock::Unused
                },
                reported: 0,
                cancel_req: false,
                ahead: None,
            },
        );
        if self.app_closed {
            self.abort(AbortReason::LocalReset, Some(AbortCode::Closed));
        } else if self.rx_shut {
            self.in_avails.get_mut(&m.id).expect("inserted").taken = m.len;
            self.after_gets(m.id);
        } else {
            self.rxq.push_back(RxItem::Avail(m.id));
        }
        Ok(())
    }

    pub(super) fn on_update(&mut self, u: wire::SrcAvailUpdate) -> Result<(), ProtocolError> {
        let ty = MsgType::SrcAvailUpdate;
        let Some(a) = self.in_avails.get_mut(&u.id) else {
            if self.updates_due.remove(&u.id) {
                // Finished here, from what was read ahead, while it came.
                return Ok(());
            }
            return Err(ProtocolError::UnknownAvail { ty, id: u.id });
        };
        if a.update_seen {
            return Err(ProtocolError::Unexpected {
                ty,
                when: "twice for one advertisement",
            });
        }
        if u.base > a.taken || u.base > a.len {
            return Err(ProtocolError::Invalid {
                ty,
                why: "base beyond what the sink has taken",
            });
        }
        if matches!(a.lock, Lock::Held | Lock::Unused) {
            return Err(ProtocolError::Unexpected {
                ty,
                when: "while the sink holds the lock, or without lock words",
            });
        }
        if u.addr.checked_add(u64::from(a.len - u.base)).is_none() {
            return Err(ProtocolError::Invalid {
                ty,
                why: "addr + remaining length overflows",
            });
        }
        a.update_seen = true;
        a.src = RemoteBuf {
            addr: u.addr,
            key: u.key,
        };
        a.src_base = u.base;
        if matches!(a.lock, Lock::Free | Lock::Copied) {
            a.lock = Lock::Updated;
        }
        if a.needs_settling() {
            self.after_gets(u.id);
        }
        Ok(())
    }

    pub(super) fn on_cancel(&mut self, id: u32) -> Result<(), ProtocolError> {
        let ty = MsgType::SrcAvailCancel;
        if id.wrapping_sub(self.rx_next_avail_id) < u32::MAX / 2 {
            return Err(ProtocolError::UnknownAvail { ty, id });
        }
        let Some(a) = self.in_avails.get_mut(&id) else {
            return Ok(()); // finished already; its final GET_COMPLETE is on the way
        };
        if a.taken == a.len || a.cancel_req {
            return Ok(());
        }
        // Only the end of the stream may be withdrawn: whatever follows this
        // advertisement must be withdrawn too (those cancels came first).
        let pos = self.rxq.iter().position(|x| *x == RxItem::Avail(id));
        let tail_withdrawn = pos.is_some_and(|p| {
            self.rxq.iter().skip(p + 1).all(|x| match x {
                RxItem::Avail(later) => self.in_avails.get(later).is_some_and(|l| l.cancel_req),
                RxItem::Data(_) => false,
            })
        });
        if !tail_withdrawn {
            return Err(ProtocolError::Invalid {
                ty,
                why: "cancels an advertisement that is not the end of the stream",
            });
        }
        let a = self.in_avails.get_mut(&id).expect("live");
        a.cancel_req = true;
        if a.gets == 0 && !matches!(a.lock, Lock::Taking | Lock::Releasing) {
            self.after_gets(id);
        }
        Ok(())
    }

    /// SHUT_RD: drop everything queued and everything that arrives later.
    pub(super) fn discard_rx(&mut self) {
        let n: u64 = self.rx_msgs.iter().sum();
        self.rxbuf.clear();
        self.consume_data(n);
        let items: Vec<RxItem> = self.rxq.drain(..).collect();
        for item in items {
            if let RxItem::Avail(id) = item {
                let a = self.in_avails.get_mut(&id).expect("live");
                a.taken = a.len;
                if a.gets == 0 && !matches!(a.lock, Lock::Taking | Lock::Releasing) {
                    self.after_gets(id);
                }
            }
        }
    }
}

/// Copy `len` bytes at `offset` of the receive buffer into application memory.
fn copy_out(
    buf: &std::collections::VecDeque<u8>,
    offset: usize,
    len: usize,
    mem: &mut dyn UserMemory,
    dst: u64,
) {
    let (a, b) = buf.as_slices();
    let mut written = 0usize;
    let mut pos = offset;
    while written < len {
        let (slice, start) = if pos < a.len() {
            (a, pos)
        } else {
            (b, pos - a.len())
        };
        let k = (slice.len() - start).min(len - written);
        mem.write(dst + written as u64, &slice[start..start + k]);
        written += k;
        pos += k;
    }
}
