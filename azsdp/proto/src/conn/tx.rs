//! The send path: BSDP copies, SRC_AVAIL advertisements, write faults and
//! copy-on-write, GET_COMPLETE handling, cancellation.

use std::collections::VecDeque;
use std::ops::Range;

use super::fallback::Verdict;
use super::lockword;
use super::switch::Posted;
use super::{
    Action, CallError, CallId, Connection, CopyReason, FallbackReason, OpError, OpKind, OutMsg,
    ProtocolError, RemoteBuf, SendFlags, State, TxMode, TxShutdown, UserBuf, UserMemory,
};
use crate::pages;
use crate::time::Timestamp;
use crate::wire::{self, MsgType};

/// One step of a send's plan, in stream order.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) enum Seg {
    /// Copy `len` bytes at buffer offset `off` into the send buffer.
    Bsdp { off: u64, len: u64, why: CopyReason },
    /// Advertise `len` bytes at `off`; `sync` sends wait for GET_COMPLETE.
    Zcopy { off: u64, len: u64, sync: bool },
}

/// An application `send()` in progress.
#[derive(Debug)]
pub(super) struct SendCall {
    pub call: CallId,
    pub buf: UserBuf,
    pub flags: SendFlags,
    /// Built when the call reaches the head of the queue.
    pub plan: Option<VecDeque<Seg>>,
    /// Bytes the application may consider sent.
    pub accepted: u64,
    /// Synchronous advertisements of this call not yet finished.
    pub sync_pending: u32,
    /// The advertisement whose PrepareSource is out.
    pub waiting_prepare: Option<u32>,
    pub cancelled: bool,
}

/// An item of the outgoing stream, waiting for credits or its turn.
#[derive(Clone, Copy, Debug, serde::Serialize, serde::Deserialize)]
pub(super) enum TxItem {
    Data(u64),
    Avail(u32),
    Shutdown,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) enum AvailState {
    /// PrepareSource is out.
    Preparing,
    /// In the send queue, not yet posted: the peer does not know it.
    Queued,
    Posted,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) enum Cow {
    Idle,
    /// Compare-and-swap on the peer's lock word in flight.
    Cas,
    /// CopyAside in flight.
    Copying,
    /// The sink held the lock; retry after its next GET_COMPLETE.
    Lost,
    /// The copy could not be made; this advertisement stays on its pages.
    Failed,
}

/// A SRC_AVAIL this side advertised (or is about to).
#[derive(Debug)]
pub(super) struct OutAvail {
    /// Local handle (key of `out_avails`); never on the wire.
    pub id: u32,
    /// Id on the wire, assigned when posted so posted ids stay consecutive.
    pub wire_id: Option<u32>,
    pub slot: u16,
    pub gen_: u32,
    pub stream_off: u64,
    pub len: u32,
    /// Application address of byte 0.
    pub addr: u64,
    /// Registration key of the application range (valid until released).
    pub key: Option<u32>,
    /// Write-protected application range still held (asynchronous only).
    pub prot: Option<Range<u64>>,
    /// Private copy holding bytes `[base, len)`, after copy-on-write.
    pub copy: Option<(RemoteBuf, u32)>,
    /// Bytes the sink reported taken.
    pub acked: u32,
    pub state: AvailState,
    pub cow: Cow,
    /// Owning call, for synchronous advertisements.
    pub sync_call: Option<CallId>,
    pub cancel_sent: bool,
    pub faults: u32,
    /// Byte of the advertisement the copy in flight starts at.
    pub copy_from: u32,
    /// While preparing: the ranges this advertisement asked to protect.
    /// If the driver fails, it leaves them unprotected.
    pub asked: Vec<Range<u64>>,
}

impl OutAvail {
    pub fn protects(&self, r: &Range<u64>) -> bool {
        self.prot.as_ref().is_some_and(|p| pages::overlaps(p, r))
    }

    /// Where byte `off` of this advertisement can be read now.
    pub(super) fn source_at(&self, off: u32) -> RemoteBuf {
        match self.copy {
            Some((buf, base)) => RemoteBuf {
                addr: buf.addr + u64::from(off - base),
                key: buf.key,
            },
            None => RemoteBuf {
                addr: self.addr + u64::from(off),
                key: self.key.unwrap_or(0),
            },
        }
    }
}

impl Connection {
    /// `send()`: the result arrives as [`Action::CallDone`] for `call`, possibly
    /// before this returns.
    pub fn send(
        &mut self,
        now: Timestamp,
        call: CallId,
        buf: UserBuf,
        flags: SendFlags,
        mem: &mut dyn UserMemory,
    ) {
        self.now = now;
        self.counters.sends += 1;
        let refused = if let Some(e) = self.abort_error() {
            // The error once (as TCP's socket error), then EPIPE.
            let first = !self.app_closed && !self.error_reported;
            self.error_reported = true;
            Some(if first { e } else { CallError::BrokenPipe })
        } else if self.tx_shutdown != TxShutdown::Open {
            Some(CallError::BrokenPipe)
        } else if !self.join.tx_on_fabric() {
            // Our stream still goes over TCP (join.rs).
            Some(CallError::OnTcp)
        } else if self.peer_left {
            // As TCP to a peer that closed: this send goes (and draws a
            // reset, since nobody reads it), the next one fails.
            self.counters.bytes_unread_by_peer += buf.len;
            self.counters.add_copied(CopyReason::PeerGone, buf.len);
            self.push(Action::CallDone {
                call,
                result: Ok(buf.len),
            });
            self.abort(super::AbortReason::PeerGone, None);
            return;
        } else {
            None
        };
        if let Some(e) = refused {
            self.push(Action::CallDone {
                call,
                result: Err(e),
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
        self.send_calls.push_back(SendCall {
            call,
            buf,
            flags,
            plan: None,
            accepted: 0,
            sync_pending: 0,
            waiting_prepare: None,
            cancelled: false,
        });
        self.progress(mem);
    }

    /// Interrupt a blocked `send()` or `recv()` (signal, SO_SNDTIMEO/SO_RCVTIMEO).
    /// It completes with the bytes it moved, or [`CallError::Interrupted`].
    pub fn cancel(&mut self, now: Timestamp, call: CallId, mem: &mut dyn UserMemory) {
        self.now = now;
        if let Some(c) = self.send_calls.iter_mut().find(|c| c.call == call) {
            c.cancelled = true;
            if let Some(plan) = c.plan.as_mut() {
                plan.clear();
            } else {
                c.plan = Some(VecDeque::new());
            }
            // Withdraw its synchronous advertisements, newest first, as long
            // as each is the end of the stream (a truncation elsewhere would
            // tear a hole in it); the others finish normally.
            let ids: Vec<u32> = self
                .out_avails
                .values()
                .filter(|a| a.sync_call == Some(call) && !a.cancel_sent)
                .map(|a| a.id)
                .rev()
                .collect();
            let mut end = self.tx_stream_off;
            for id in ids {
                let a = &self.out_avails[&id];
                if a.state == AvailState::Preparing {
                    continue; // withdrawn when its preparation answers
                }
                if a.stream_off + u64::from(a.len) != end {
                    break;
                }
                end = a.stream_off;
                self.cancel_out_avail(id);
            }
        }
        if let Some(c) = self.recv_calls.iter_mut().find(|c| c.call == call) {
            c.cancelled = true;
        }
        self.progress(mem);
    }

    fn cancel_out_avail(&mut self, id: u32) {
        let Some(a) = self.out_avails.get_mut(&id) else {
            return;
        };
        match a.state {
            AvailState::Posted => {
                a.cancel_sent = true;
                let wire_id = a.wire_id.expect("posted");
                self.out.push_back(OutMsg::Cancel(wire_id));
                self.counters.cancels_sent += 1;
            }
            AvailState::Queued => {
                // The peer never saw it: take it back out of the stream.
                self.txq
                    .retain(|t| !matches!(t, super::TxItem::Avail(x) if *x == id));
                let len = u64::from(a.len);
                self.tx_stream_off -= len;
                a.acked = 0;
                self.finish_out_avail(id);
            }
            AvailState::Preparing => {}
        }
    }

    /// The plan for a send: which bytes go by copy (and why), which by
    /// zero-copy.
    fn plan(&mut self, buf: UserBuf, flags: SendFlags) -> VecDeque<Seg> {
        let mut plan = VecDeque::new();
        let all_bsdp = |why| Seg::Bsdp {
            off: 0,
            len: buf.len,
            why,
        };
        if buf.len < self.cfg.zcopy_threshold {
            plan.push_back(all_bsdp(CopyReason::Small));
            return plan;
        }
        if self.mode == TxMode::Buffered {
            plan.push_back(all_bsdp(CopyReason::NoZeroCopy));
            return plan;
        }
        let can_async = self.mode == TxMode::Async && flags.protectable;
        if can_async {
            let s = pages::split(buf.addr, buf.len, self.page());
            if s.middle == 0 {
                plan.push_back(all_bsdp(CopyReason::Edges));
                return plan;
            }
            if s.head > 0 {
                plan.push_back(Seg::Bsdp {
                    off: 0,
                    len: s.head,
                    why: CopyReason::Edges,
                });
            }
            plan.push_back(Seg::Zcopy {
                off: s.head,
                len: s.middle,
                sync: false,
            });
            if s.tail > 0 {
                plan.push_back(Seg::Bsdp {
                    off: s.head + s.middle,
                    len: s.tail,
                    why: CopyReason::Edges,
                });
            }
        } else if flags.nonblocking {
            // A non-blocking send cannot wait for GET_COMPLETE.
            let why = if self.mode == TxMode::Sync {
                if self.monitor.is_fallen_back() {
                    CopyReason::FaultRate
                } else {
                    CopyReason::Nonblocking
                }
            } else if let Some(kind) = flags.unprotectable {
                self.counters.copied_memory = Some(kind);
                CopyReason::Memory
            } else {
                CopyReason::Nonblocking
            };
            plan.push_back(all_bsdp(why));
        } else {
            // Synchronous zero-copy needs no protection, so no head/tail split.
            plan.push_back(Seg::Zcopy {
                off: 0,
                len: buf.len,
                sync: true,
            });
        }
        plan
    }

    /// Advance the send at the head of the queue as far as it can go.
    pub(super) fn progress_sends(&mut self, mem: &mut dyn UserMemory) {
        if self.state == State::Switched {
            // A call made after the switch (it raced the caller's look):
            // it goes again over TCP.
            for call in std::mem::take(&mut self.send_calls) {
                let result = if call.accepted > 0 {
                    Ok(call.accepted)
                } else {
                    Err(CallError::Switched)
                };
                self.push(Action::CallDone {
                    call: call.call,
                    result,
                });
            }
            return;
        }
        if self.state != State::Established {
            return self.fail_sends_if_aborted();
        }
        if self.leaving_fabric() {
            // Calls wait: they end, and go again over TCP, at the resend.
            return;
        }
        while let Some(call) = self.send_calls.front() {
            if call.waiting_prepare.is_some() {
                return;
            }
            let (buf, flags) = (call.buf, call.flags);
            if call.plan.is_none() {
                // A source still being filled by an armed receive must land first.
                let pages_r = pages::covering_pages(buf.addr, buf.len, self.page());
                if self.memory_busy(&pages_r, false) {
                    return;
                }
                let plan = self.plan(buf, flags);
                self.send_calls[0].plan = Some(plan);
            }
            let blocked = self.run_plan(mem);
            let call = &self.send_calls[0];
            if call.waiting_prepare.is_some() {
                return;
            }
            let plan_done = call.plan.as_ref().is_some_and(|p| p.is_empty());
            let gives_up = blocked && (call.flags.nonblocking || call.cancelled);
            if (plan_done || gives_up) && call.sync_pending == 0 {
                let call = self.send_calls.pop_front().expect("head call");
                // Calls finish in stream order: all of the stream so far is
                // now returned to the program.
                self.tx_returned = self.tx_stream_off;
                let result = if call.accepted > 0 {
                    Ok(call.accepted)
                } else if call.cancelled {
                    Err(CallError::Interrupted)
                } else if blocked {
                    Err(CallError::WouldBlock)
                } else {
                    Ok(0)
                };
                self.push(Action::CallDone {
                    call: call.call,
                    result,
                });
                continue;
            }
            return;
        }
    }

    fn fail_sends_if_aborted(&mut self) {
        if let Some(err) = self.abort_error() {
            let mut keep = VecDeque::new();
            for call in std::mem::take(&mut self.send_calls) {
                if call.waiting_prepare.is_some() {
                    keep.push_back(call);
                } else {
                    let result = if call.accepted > 0 {
                        Ok(call.accepted)
                    } else {
                        self.error_reported = true;
                        Err(err)
                    };
                    self.push(Action::CallDone {
                        call: call.call,
                        result,
                    });
                }
            }
            self.send_calls = keep;
        }
    }

    /// Execute the head call's plan. Returns true when it stopped for lack of
    /// buffer space or advertisement slots.
    fn run_plan(&mut self, mem: &mut dyn UserMemory) -> bool {
        let page = self.page();
        loop {
            let call = &self.send_calls[0];
            let Some(seg) = call.plan.as_ref().and_then(|p| p.front()).copied() else {
                return false;
            };
            let base = call.buf.addr;
            match seg {
                Seg::Bsdp { off, len, why } => {
                    let space = self.cfg.sndbuf.saturating_sub(self.tx_unposted);
                    if space == 0 {
                        return true;
                    }
                    let n = len.min(space);
                    copy_in(mem, base + off, n, &mut self.txbuf);
                    self.advance_head_seg(Seg::Bsdp {
                        off: off + n,
                        len: len - n,
                        why,
                    });
                    self.send_calls[0].accepted += n;
                    self.counters.add_copied(why, n);
                    self.tx_unposted += n;
                    self.tx_stream_off += n;
                    match self.txq.back_mut() {
                        Some(TxItem::Data(m)) => *m += n,
                        _ => self.txq.push_back(TxItem::Data(n)),
                    }
                }
                Seg::Zcopy { off, len, sync } => {
                    let Some(slot) = self.free_slot() else {
                        return true;
                    };
                    let max = u64::from(self.cfg.max_avail_len).max(page);
                    let chunk = if sync {
                        len.min(max)
                    } else {
                        len.min(pages::page_down(max, page))
                    };
                    self.advance_head_seg(Seg::Zcopy {
                        off: off + chunk,
                        len: len - chunk,
                        sync,
                    });
                    self.start_avail(slot, base + off, chunk, sync);
                    return false;
                }
            }
        }
    }

    /// Replace the head call's first plan step by what is left of it.
    fn advance_head_seg(&mut self, rest: Seg) {
        let plan = self.send_calls[0].plan.as_mut().expect("planned");
        let empty = matches!(rest, Seg::Bsdp { len: 0, .. } | Seg::Zcopy { len: 0, .. });
        if empty {
            plan.pop_front();
        } else {
            plan[0] = rest;
        }
    }

    fn free_slot(&self) -> Option<u16> {
        let max = self.peer.map_or(0, |p| p.max_outstanding);
        if self.out_avails.len() >= usize::from(max) {
            return None;
        }
        (0..max).find(|s| !self.slot_busy[usize::from(*s)])
    }

    /// Create an advertisement for `[addr, addr+len)` and ask the driver to
    /// register (and, if asynchronous, protect) it.
    fn start_avail(&mut self, slot: u16, addr: u64, len: u64, sync: bool) {
        let id = self.next_avail_id;
        self.next_avail_id = self.next_avail_id.wrapping_add(1);
        self.slot_busy[usize::from(slot)] = true;
        let (prot, protect) = if sync {
            (None, Vec::new())
        } else {
            let r = addr..addr + len;
            let fresh = self.send_prot.add(r.clone());
            (Some(r), fresh)
        };
        let asked = protect.clone();
        let call = &mut self.send_calls[0];
        call.waiting_prepare = Some(id);
        let owner = call.call;
        self.out_avails.insert(
            id,
            OutAvail {
                id,
                wire_id: None,
                slot,
                gen_: self.slot_gen[usize::from(slot)],
                stream_off: 0,
                len: len as u32,
                addr,
                key: None,
                prot,
                copy: None,
                acked: 0,
                state: AvailState::Preparing,
                cow: Cow::Idle,
                sync_call: sync.then_some(owner),
                cancel_sent: false,
                faults: 0,
                copy_from: 0,
                asked,
            },
        );
        let op = self.op(OpKind::Prepare { avail: id });
        self.push(Action::PrepareSource {
            op,
            addr,
            len,
            protect,
        });
    }

    pub(super) fn on_prepared(&mut self, id: u32, r: Result<u32, OpError>) {
        let head = self
            .send_calls
            .iter()
            .position(|c| c.waiting_prepare == Some(id));
        if let Some(i) = head {
            self.send_calls[i].waiting_prepare = None;
        }
        let aborted = self.is_aborted();
        let Some(a) = self.out_avails.get_mut(&id) else {
            return;
        };
        match r {
            Ok(key) if !aborted => {
                a.asked.clear();
                a.key = Some(key);
                a.state = AvailState::Queued;
                a.stream_off = self.tx_stream_off;
                self.tx_stream_off += u64::from(a.len);
                self.txq.push_back(TxItem::Avail(id));
                let len = u64::from(a.len);
                let sync = a.sync_call.is_some();
                let mut withdraw = false;
                if let Some(i) = head {
                    let call = &mut self.send_calls[i];
                    if sync {
                        call.sync_pending += 1;
                        withdraw = call.cancelled;
                    } else {
                        call.accepted += len;
                    }
                }
                if withdraw {
                    // Its call was interrupted meanwhile; it is the end of
                    // the stream and unposted: take it back.
                    self.cancel_out_avail(id);
                    return;
                }
                if !sync {
                    self.counters.bytes_sent_async += len;
                }
                // A writer may have faulted on these pages while we prepared.
                let prot = a.prot.clone();
                if let Some(p) = prot
                    && self.waiters.iter().any(|w| pages::overlaps(&w.range, &p))
                    && self.cfg.write_fault == super::FaultPolicy::Copy
                {
                    self.start_cow(id);
                }
            }
            Ok(key) => {
                // Aborted meanwhile: undo.
                a.key = Some(key);
                self.drop_out_avail(id);
            }
            Err(e) => {
                // Nothing was protected; the refcount must not say otherwise.
                let asked = std::mem::take(&mut a.asked);
                if let Some(p) = a.prot.take() {
                    self.release_prot(p, &asked);
                }
                let a = self.out_avails.get_mut(&id).expect("present");
                self.counters.prepare_failures += 1;
                self.counters.fallback_reason = Some(if e == OpError::PinLimit {
                    FallbackReason::MemlockLimit
                } else {
                    FallbackReason::PrepareFailed
                });
                let (addr, len) = (a.addr, u64::from(a.len));
                self.drop_out_avail(id);
                // Send those bytes by copy instead, in the same place in the
                // stream; unless the call was interrupted meanwhile: then
                // they were never sent (the call returns what was taken,
                // and its advertisements before them may be withdrawn).
                if let Some(i) = head
                    && !aborted
                    && !self.send_calls[i].cancelled
                {
                    let call = &mut self.send_calls[i];
                    let off = addr - call.buf.addr;
                    if let Some(plan) = call.plan.as_mut() {
                        plan.push_front(Seg::Bsdp {
                            off,
                            len,
                            why: CopyReason::PrepareFailed,
                        });
                    }
                }
            }
        }
    }

    /// Move stream items to the out queue as credits allow.
    pub(super) fn pump_tx(&mut self) {
        if self.state != State::Established || self.leaving_fabric() {
            return;
        }
        let max_payload = self.peer.map_or(0, |p| p.max_payload).max(1);
        while let Some(item) = self.txq.front_mut() {
            match item {
                TxItem::Data(n) => {
                    if self.credits == 0 {
                        return;
                    }
                    let m = (*n).min(max_payload);
                    *n -= m;
                    if *n == 0 {
                        self.txq.pop_front();
                    }
                    self.credits -= 1;
                    self.credits_in_use += 1;
                    self.tx_unposted -= m;
                    self.tx_drained += m;
                    self.posted.push_back(Posted::Data {
                        nth: self.data_pumped,
                        len: m,
                    });
                    self.data_pumped += 1;
                    self.retained.push_back(m);
                    self.out.push_back(OutMsg::Data { len: m });
                }
                TxItem::Avail(id) => {
                    let id = *id;
                    let Some(a) = self.out_avails.get_mut(&id) else {
                        self.txq.pop_front();
                        continue;
                    };
                    if a.cow == Cow::Copying {
                        // A lock-free copy (started before posting) is in
                        // flight: post it once it is done, pointing at the copy.
                        return;
                    }
                    self.txq.pop_front();
                    a.state = AvailState::Posted;
                    let wire_id = self.next_wire_id;
                    self.next_wire_id = self.next_wire_id.wrapping_add(1);
                    a.wire_id = Some(wire_id);
                    self.wire_ids.insert(wire_id, id);
                    let src = a.source_at(0);
                    let msg = wire::SrcAvail {
                        id: wire_id,
                        lock_slot: a.slot,
                        lock_gen: a.gen_,
                        len: a.len,
                        stream_off: a.stream_off,
                        addr: src.addr,
                        key: src.key,
                    };
                    self.posted.push_back(Posted::Avail {
                        id,
                        len: u64::from(a.len),
                    });
                    self.out.push_back(OutMsg::Avail(msg));
                    self.counters.avails_sent += 1;
                }
                TxItem::Shutdown => {
                    self.txq.pop_front();
                    self.tx_shutdown = TxShutdown::Sent;
                    self.out.push_back(OutMsg::Shutdown(self.tx_stream_off));
                }
            }
        }
    }

    /// GET_COMPLETE from the sink.
    pub(super) fn on_get_complete(&mut self, g: wire::GetComplete) -> Result<(), ProtocolError> {
        let ty = MsgType::GetComplete;
        let Some(&id) = self.wire_ids.get(&g.id) else {
            return Err(ProtocolError::UnknownAvail { ty, id: g.id });
        };
        let a = self.out_avails.get_mut(&id).expect("mapped");
        if a.state != AvailState::Posted {
            return Err(ProtocolError::Unexpected {
                ty,
                when: "for an advertisement not yet posted",
            });
        }
        if g.consumed < a.acked || g.consumed > a.len {
            return Err(ProtocolError::Invalid {
                ty,
                why: "consumed moved backwards or past the advertised length",
            });
        }
        if g.final_ && !a.cancel_sent && g.consumed != a.len {
            return Err(ProtocolError::Invalid {
                ty,
                why: "finished short of the length without a cancel",
            });
        }
        a.acked = g.consumed;
        // Pages wholly below the consumed point are free again.
        let released = match &mut a.prot {
            Some(p) => {
                let upto = pages::page_down(a.addr + u64::from(a.acked), self.cfg.page_size.into())
                    .max(p.start)
                    .min(p.end);
                let r = p.start..upto;
                p.start = upto;
                r
            }
            None => 0..0,
        };
        if a.cow == super::tx::Cow::Lost {
            a.cow = Cow::Idle;
        }
        let finished = a.acked == a.len || g.final_;
        self.unprotect(released);
        if finished {
            self.finish_out_avail(id);
        } else {
            // Writers that lost the lock race try again now.
            let retry: Vec<Range<u64>> = self
                .waiters
                .iter()
                .filter(|w| w.escalated && w.access == super::Access::Write)
                .map(|w| w.range.clone())
                .collect();
            for r in retry {
                self.evacuate_range(&r);
            }
        }
        Ok(())
    }

    fn unprotect(&mut self, r: Range<u64>) {
        self.release_prot(r, &[]);
    }

    /// Drop this advertisement's references on `r`; unprotect what reaches
    /// zero, except `never_applied` (ranges whose protection failed).
    fn release_prot(&mut self, r: Range<u64>, never_applied: &[Range<u64>]) {
        if r.start >= r.end {
            return;
        }
        match self.send_prot.remove(r) {
            Ok(freed) => {
                for range in freed {
                    for piece in subtract(range, never_applied) {
                        self.push(Action::Unprotect { range: piece });
                    }
                }
            }
            Err(missing) => debug_assert!(false, "unprotect of unheld pages {missing:?}"),
        }
    }

    /// The advertisement is done (fully taken, cancelled, or withdrawn).
    pub(super) fn finish_out_avail(&mut self, id: u32) {
        let Some(a) = self.out_avails.remove(&id) else {
            return;
        };
        if let Some(w) = a.wire_id {
            self.wire_ids.remove(&w);
        }
        self.release_avail(&a);
        if a.state == AvailState::Posted {
            // The sink moves to the next generation when it finishes this one.
            self.slot_gen[usize::from(a.slot)] = a.gen_.wrapping_add(1);
        }
        if let Some(owner) = a.sync_call {
            if a.cancel_sent && a.acked < a.len {
                // The unsent rest leaves the stream; it was its tail.
                self.tx_stream_off -= u64::from(a.len - a.acked);
                for p in self.posted.iter_mut().rev() {
                    if let Posted::Avail { id: pid, len } = p
                        && *pid == id
                    {
                        *len = u64::from(a.acked);
                        break;
                    }
                }
            }
            self.counters.bytes_sent_sync += u64::from(a.acked);
            if let Some(call) = self.send_calls.iter_mut().find(|c| c.call == owner) {
                call.sync_pending -= 1;
                call.accepted += u64::from(a.acked);
            }
            if self.monitor.is_fallen_back() && self.monitor.record_sync() == Verdict::Recover {
                self.counters.recoveries += 1;
                self.mode = TxMode::Async;
            }
        } else if self.monitor.record_async(a.faults) == Verdict::FallBack {
            self.counters.fallbacks += 1;
            self.counters.fallback_reason = Some(FallbackReason::FaultRate);
            self.mode = TxMode::Sync;
        }
        self.trim_posted();
    }

    /// Give back what an advertisement holds: its protected pages, its
    /// registration or private copy, its lock slot.
    pub(super) fn release_avail(&mut self, a: &OutAvail) {
        if let Some(p) = a.prot.clone() {
            self.unprotect(p);
        }
        if let Some(key) = a.key {
            self.push(Action::ReleaseSource {
                addr: a.addr,
                len: u64::from(a.len),
                key,
            });
        }
        if let Some((buf, base)) = a.copy {
            self.push(Action::ReleaseCopy {
                buf,
                len: u64::from(a.len - base),
            });
        }
        self.slot_busy[usize::from(a.slot)] = false;
    }

    /// Abort path: release an advertisement without waiting for the peer.
    pub(super) fn drop_out_avail(&mut self, id: u32) {
        let Some(a) = self.out_avails.get_mut(&id) else {
            return;
        };
        if a.state == AvailState::Preparing
            && self
                .ops
                .values()
                .any(|k| matches!(k, OpKind::Prepare { avail } if *avail == id))
        {
            // Keep it until PrepareSource answers; on_prepared drops it then.
            if a.key.is_none() {
                return;
            }
        }
        // Only a prepared advertisement was counted in its call's sync_pending.
        let sync_call = a
            .sync_call
            .take()
            .filter(|_| a.state != AvailState::Preparing);
        let a = self.out_avails.remove(&id).expect("present");
        if let Some(w) = a.wire_id {
            self.wire_ids.remove(&w);
        }
        self.release_avail(&a);
        if let Some(owner) = sync_call
            && let Some(call) = self.send_calls.iter_mut().find(|c| c.call == owner)
        {
            call.sync_pending = call.sync_pending.saturating_sub(1);
        }
    }

    /// Make `range` writable as soon as possible: copy aside every
    /// advertisement protecting it (if copy-on-write is possible).
    pub(super) fn evacuate_range(&mut self, range: &Range<u64>) {
        let ids: Vec<u32> = self
            .out_avails
            .values()
            .filter(|a| a.protects(range))
            .map(|a| a.id)
            .collect();
        for id in ids {
            self.start_cow(id);
        }
    }

    fn start_cow(&mut self, id: u32) {
        if self.switch_sent() {
            // The resend reads these pages: writers wait for it.
            return;
        }
        let cow_ok = self.peer.is_some_and(|p| p.cow);
        let Some(a) = self.out_avails.get_mut(&id) else {
            return;
        };
        if a.cow != Cow::Idle || a.prot.is_none() || a.copy.is_some() {
            return;
        }
        match a.state {
            AvailState::Preparing => {}
            AvailState::Queued => {
                // Not posted: no one can be reading it; copy without the lock.
                a.cow = Cow::Copying;
                a.copy_from = 0;
                let (addr, len) = (a.addr, u64::from(a.len));
                self.counters.cow_attempts += 1;
                let op = self.op(OpKind::Copy { avail: id, len });
                self.push(Action::CopyAside { op, addr, len });
            }
            AvailState::Posted if cow_ok => {
                a.cow = Cow::Cas;
                let (slot, gen_) = (a.slot, a.gen_);
                let peer = self.peer.expect("established").hello;
                self.counters.cow_attempts += 1;
                let op = self.op(OpKind::CowCas { avail: id });
                self.push(Action::Cas {
                    op,
                    target: super::CasTarget::Remote {
                        addr: peer.lock_addr + 8 * u64::from(slot),
                        key: peer.lock_key,
                    },
                    expect: lockword::open(gen_),
                    new: lockword::copied(gen_),
                });
            }
            AvailState::Posted => {}
        }
    }

    pub(super) fn on_cow_cas(
        &mut self,
        id: u32,
        r: Result<u64, OpError>,
    ) -> Result<(), super::AbortReason> {
        let old = r.map_err(super::AbortReason::Fabric)?;
        let Some(a) = self.out_avails.get_mut(&id) else {
            return Ok(());
        };
        if old == lockword::open(a.gen_) {
            a.cow = Cow::Copying;
            // A GET_COMPLETE may still advance `acked` before the copy is
            // done; the copy (and the UPDATE) start where it is now.
            let off = a.acked;
            a.copy_from = off;
            let (addr, len) = (a.addr + u64::from(off), u64::from(a.len - off));
            a.copy = None;
            let op = self.op(OpKind::Copy { avail: id, len });
            self.push(Action::CopyAside { op, addr, len });
        } else {
            // The sink holds it (or has finished): wait for its GET_COMPLETE.
            a.cow = Cow::Lost;
            self.counters.cow_lost += 1;
        }
        Ok(())
    }

    pub(super) fn on_copied(&mut self, id: u32, len: u64, r: Result<RemoteBuf, OpError>) {
        let aborted = self.is_aborted();
        let Some(a) = self.out_avails.get_mut(&id) else {
            if let Ok(buf) = r {
                // The advertisement ended while copying: drop the copy.
                self.push(Action::ReleaseCopy { buf, len });
            }
            return;
        };
        let posted = a.state == AvailState::Posted;
        let wire_id = a.wire_id.unwrap_or(0);
        let base = a.copy_from;
        match r {
            Ok(buf) if !aborted => {
                a.cow = Cow::Idle;
                a.copy = Some((buf, base));
                let prot = a.prot.take();
                // The pages are no longer advertised: only the copy is.
                let user_key = a.key.take();
                let (addr, len) = (a.addr, u64::from(a.len));
                self.counters.cow_copies += 1;
                self.counters.cow_bytes += u64::from(a.len - base);
                if posted {
                    self.out.push_back(OutMsg::Update(wire::SrcAvailUpdate {
                        id: wire_id,
                        base,
                        addr: buf.addr,
                        key: buf.key,
                    }));
                    self.counters.updates_sent += 1;
                }
                if let Some(p) = prot {
                    self.unprotect(p);
                }
                if let Some(key) = user_key {
                    self.push(Action::ReleaseSource { addr, len, key });
                }
            }
            Ok(buf) => {
                let len = u64::from(a.len - base);
                self.push(Action::ReleaseCopy { buf, len });
            }
            Err(_) => {
                // No copy: the writer waits for the GET. If we hold the peer's
                // lock, tell it to read the original pages without it.
                a.cow = Cow::Failed;
                if posted {
                    let src = a.source_at(base);
                    self.out.push_back(OutMsg::Update(wire::SrcAvailUpdate {
                        id: wire_id,
                        base,
                        addr: src.addr,
                        key: src.key,
                    }));
                    self.counters.updates_sent += 1;
                }
            }
        }
    }
}

/// `r` minus the (sorted, disjoint) ranges in `holes`.
fn subtract(r: Range<u64>, holes: &[Range<u64>]) -> Vec<Range<u64>> {
    let mut out = Vec::new();
    let mut cur = r.start;
    for h in holes {
        if h.end <= cur || h.start >= r.end {
            continue;
        }
        if h.start > cur {
            out.push(cur..h.start);
        }
        cur = cur.max(h.end);
    }
    if cur < r.end {
        out.push(cur..r.end);
    }
    out
}

/// Append `n` bytes of application memory at `addr` to `buf`, reading
/// straight into the ring's new tail (which may wrap around).
fn copy_in(mem: &mut dyn UserMemory, addr: u64, n: u64, buf: &mut VecDeque<u8>) {
    let old = buf.len();
    buf.resize(old + n as usize, 0);
    let (a, b) = buf.as_mut_slices();
    if old >= a.len() {
        mem.read(addr, &mut b[old - a.len()..]);
    } else {
        let first = a.len() - old;
        mem.read(addr, &mut a[old..]);
        mem.read(addr + first as u64, b);
    }
}
