//! Leaving the fabric for the TCP connection beneath (docs/protocol.md §9).
//!
//! Either side may leave: its process is about to `exec` a program that
//! will not run the shim, say. It stops starting work, waits for its own
//! operations in flight, and sends SWITCH(consumed, sent); a side that
//! receives SWITCH leaves too. Once a side has sent its SWITCH and received
//! the peer's, it writes its own stream to TCP from the first byte the
//! peer's application has not consumed ([`Action::Resend`]): DATA it kept
//! until the peer's credits said it was consumed, advertised bytes from
//! their pages (still protected) or copies, and what it had not posted yet.
//! It reads the peer's stream from TCP from the first byte its own
//! application had not consumed, which is exactly where the peer's resend
//! starts. So no byte is lost, repeated or reordered, in either direction.
//! Bytes that reach TCP before a side has sent its SWITCH were written
//! behind azsdp's back (the shim resets the connection then).

use std::collections::VecDeque;

use super::tx::AvailState;
use super::{
    Action, CallError, Connection, OutMsg, ProtocolError, Resend, ResendPiece, State, UserMemory,
};
use crate::wire::{AbortCode, MsgType};

/// Where a connection is in leaving the fabric.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub(super) enum Switch {
    /// On the fabric.
    #[default]
    No,
    /// Leaving: our SWITCH goes once nothing of ours is in flight.
    Leaving,
    /// The driver checks the TCP connection before our SWITCH goes.
    Checking,
    /// Our SWITCH is out; the peer's may not be in yet.
    Sent,
    /// Both are: our resend is with the driver.
    Resending,
}

/// A piece of our stream handed to the fabric, in stream order, kept until
/// the peer has consumed it (its bytes may have to go again over TCP).
#[derive(Clone, Copy, Debug, serde::Serialize, serde::Deserialize)]
pub(super) enum Posted {
    /// The `nth` DATA message this side sent (its bytes stay in the send
    /// buffer until its credit comes back).
    Data { nth: u64, len: u64 },
    /// An advertisement (its pages or copy stay until it is finished).
    Avail { id: u32, len: u64 },
}

impl Posted {
    fn len(&self) -> u64 {
        match *self {
            Posted::Data { len, .. } | Posted::Avail { len, .. } => len,
        }
    }
}

impl Connection {
    /// Leave the fabric for the TCP connection beneath, both directions
    /// (see the module). The driver then sees [`Action::Resend`]; calls in
    /// progress end with [`CallError::Switched`] (or what they moved), to be
    /// made again on TCP.
    pub fn leave_fabric(&mut self, now: crate::time::Timestamp, mem: &mut dyn UserMemory) {
        // Begun on TCP, and nothing went on the fabric either way, nor will
        // (join.rs; or an engine that ended before anything did, its peer
        // gone): on TCP at once, no SWITCH needed.
        if self.stay_on_tcp_now(now) {
            return;
        }
        if self.switch == Switch::No && !self.is_aborted() && self.state != State::Switched {
            self.switch = Switch::Leaving;
        }
        self.progress(mem);
    }

    /// Has this side started leaving the fabric (or left)?
    pub fn leaving_fabric(&self) -> bool {
        self.switch != Switch::No || self.state == State::Switched
    }

    /// Has this side sent its SWITCH? From then on, bytes on TCP from the
    /// peer are its resend, not stray.
    pub fn switch_sent(&self) -> bool {
        matches!(self.switch, Switch::Sent | Switch::Resending) || self.state == State::Switched
    }

    /// The driver's answer to [`Action::CheckStream`]: `clean` if nothing
    /// arrived on the TCP connection; then our SWITCH goes, else the
    /// connection is reset (those bytes were written behind our back, and
    /// would otherwise be taken for the peer's resend).
    pub fn stream_checked(
        &mut self,
        now: crate::time::Timestamp,
        clean: bool,
        mem: &mut dyn UserMemory,
    ) {
        self.now = now;
        if self.switch != Switch::Checking || self.is_aborted() {
            return;
        }
        // (Bytes of the peer's TCP part, before it joined, are no stray.)
        if !clean && self.rx_route() == super::RxRoute::Fabric {
            self.abort(super::AbortReason::StrayBytes, Some(AbortCode::Reset));
            return;
        }
        if !self.orphaned {
            // (An orphan switch has nobody to tell.)
            let (consumed, sent) = (self.rx_consumed(), self.posted_end());
            self.out.push_back(OutMsg::Switch { consumed, sent });
        }
        self.switch = Switch::Sent;
        self.progress(mem);
    }

    /// The resend could not be written: the stream is broken.
    pub fn stream_failed(&mut self, now: crate::time::Timestamp, mem: &mut dyn UserMemory) {
        self.now = now;
        self.abort(super::AbortReason::StreamFailed, Some(AbortCode::Reset));
        self.progress(mem);
    }

    /// Something arrived on the TCP connection while on the fabric: it was
    /// written behind azsdp's back; the connection is reset.
    pub fn stray_bytes(&mut self, now: crate::time::Timestamp, mem: &mut dyn UserMemory) {
        self.now = now;
        if self.switch_sent() || self.rx_route() != super::RxRoute::Fabric {
            // The peer's resend, or its part before it joined: not stray.
            return;
        }
        self.abort(super::AbortReason::StrayBytes, Some(AbortCode::Reset));
        self.progress(mem);
    }

    /// The driver wrote the [`Action::Resend`] to TCP: let go of everything.
    pub fn resend_written(&mut self, now: crate::time::Timestamp, mem: &mut dyn UserMemory) {
        self.now = now;
        if self.switch != Switch::Resending || self.is_aborted() {
            return;
        }
        // Sends end only now: their buffers were in the resend. What they
        // put in the stream went with it; the rest goes again over TCP.
        for call in std::mem::take(&mut self.send_calls) {
            let in_avails: u64 = self
                .out_avails
                .values()
                .filter(|a| a.sync_call == Some(call.call))
                .map(|a| u64::from(a.len))
                .sum();
            let sent = call.accepted + in_avails;
            self.push(Action::CallDone {
                call: call.call,
                result: if sent > 0 {
                    Ok(sent)
                } else {
                    Err(CallError::Switched)
                },
            });
        }
        self.tx_returned = self.tx_stream_off;
        self.push(Action::RevokeAccess);
        let ids: Vec<u32> = self.out_avails.keys().copied().collect();
        for id in ids {
            if let Some(a) = self.out_avails.remove(&id) {
                self.release_avail(&a);
            }
        }
        if self.orphaned {
            // What arrived from the dead peer stays, read first.
            self.drop_tx_stream();
            self.out.clear();
        } else {
            self.clear_stream_state();
            for call in std::mem::take(&mut self.recv_calls) {
                self.push(Action::CallDone {
                    call: call.call,
                    result: Err(CallError::Switched),
                });
            }
        }
        self.state = State::Switched;
        self.switch = Switch::No;
        self.wake_waiters();
        self.progress(mem);
    }

    /// The peer's process died with heirs (see `handle_peer_left`): leave
    /// the fabric alone, resending our stream from `consumed` (what the
    /// peer's programs had read). False if that cannot be done (the
    /// connection was leaving already, or we no longer hold those bytes).
    pub(super) fn orphan_switch(&mut self, consumed: u64, mem: &mut dyn UserMemory) -> bool {
        if self.state != State::Established
            || self.switch != Switch::No
            || self.peer_switch.is_some()
            || consumed < self.posted_base
            || consumed > self.tx_stream_off
        {
            return false;
        }
        self.orphaned = true;
        self.peer_switch = Some(consumed);
        self.switch = Switch::Leaving;
        self.progress(mem);
        true
    }

    /// Leaving, with a peer that is gone after closing cleanly (all it
    /// sent is here, and it can take nothing more): no SWITCH will come, and
    /// none need go. As a TCP peer that closed, it reads no more of our
    /// stream, so nothing goes again; what it sent stays to be read first,
    /// and the connection is on TCP at once (not after `peer_timeout`).
    fn switch_without_peer(&mut self) {
        self.orphaned = true;
        self.peer_switch = Some(self.tx_stream_off);
    }

    /// The peer left the fabric (its SWITCH): so do we.
    pub(super) fn on_switch(&mut self, consumed: u64, sent: u64) -> Result<(), ProtocolError> {
        let ty = MsgType::Switch;
        if self.peer_switch.is_some() {
            return Err(ProtocolError::Unexpected { ty, when: "twice" });
        }
        if consumed < self.posted_base || consumed > self.tx_stream_off {
            return Err(ProtocolError::Invalid {
                ty,
                why: "consumed is outside what was sent and not yet acknowledged",
            });
        }
        if sent < self.rx_stream_off {
            return Err(ProtocolError::Invalid {
                ty,
                why: "sent is less than what arrived",
            });
        }
        self.peer_switch = Some(consumed);
        if self.switch == Switch::No {
            self.switch = Switch::Leaving;
        }
        Ok(())
    }

    /// Bytes of the peer's stream our application has taken (or dropped
    /// after SHUT_RD): all of what arrived but what still waits in the
    /// receive queue.
    fn rx_consumed(&self) -> u64 {
        self.rx_stream_off - self.readable_bytes()
    }

    /// Where our stream put on the fabric ends.
    fn posted_end(&self) -> u64 {
        self.posted_base + self.posted.iter().map(Posted::len).sum::<u64>()
    }

    /// Nothing of ours in flight: no operation, no cancel waiting for its
    /// answer, no receive with GETs or arms outstanding.
    fn switch_quiet(&self) -> bool {
        self.ops.is_empty()
            && self.actions.is_empty()
            && !self.out_avails.values().any(|a| a.cancel_sent)
            && self
                .recv_calls
                .iter()
                .all(|c| c.gets == 0 && c.pending_arm == 0)
    }

    /// Move the switch along (called by `progress`).
    pub(super) fn progress_switch(&mut self) {
        if self.is_aborted() || self.state != State::Established {
            return;
        }
        if self.peer_left && self.switch != Switch::No && self.peer_switch.is_none() {
            self.switch_without_peer();
        }
        match self.switch {
            Switch::No | Switch::Checking | Switch::Resending => {}
            Switch::Leaving => {
                if let Some(consumed) = self.peer_switch {
                    self.settle_cancels(consumed);
                }
                self.finish_filled_recvs();
                if self.switch_quiet() {
                    self.switch = Switch::Checking;
                    self.push(Action::CheckStream);
                }
            }
            Switch::Sent => {
                if let Some(from) = self.peer_switch {
                    self.start_resend(from);
                }
            }
        }
    }

    /// The peer left: it answers no cancel of ours (it reads nothing more
    /// of the fabric), and its SWITCH's `consumed` says how much of each
    /// cancelled advertisement it took, as the GET_COMPLETE would have.
    /// (Waiting for that answer hung both sides: seed 16506.)
    fn settle_cancels(&mut self, consumed: u64) {
        let cancelled: Vec<(u32, u64, u32)> = self
            .out_avails
            .values()
            .filter(|a| a.cancel_sent)
            .map(|a| (a.id, a.stream_off, a.len))
            .collect();
        for (id, off, len) in cancelled {
            let took = consumed.saturating_sub(off).min(u64::from(len)) as u32;
            if let Some(a) = self.out_avails.get_mut(&id) {
                a.acked = a.acked.max(took);
            }
            self.finish_out_avail(id);
        }
    }

    /// Receives that took bytes end now with them: those bytes count as
    /// consumed in our SWITCH.
    fn finish_filled_recvs(&mut self) {
        while let Some(c) = self.recv_calls.front() {
            if c.gets > 0 || c.pending_arm > 0 || c.filled == 0 {
                return;
            }
            let c = self.recv_calls.pop_front().expect("head call");
            if !c.flags.peek {
                self.counters.bytes_recv_bsdp += c.via_bsdp;
                self.counters.bytes_recv_zcopy += c.via_zcopy;
                self.counters.bytes_recv_ahead += c.via_ahead;
            }
            self.push(Action::CallDone {
                call: c.call,
                result: Ok(c.filled),
            });
        }
    }

    /// Both SWITCHes are out: hand the driver our stream from `from`, and
    /// end the calls in progress (to be made again on TCP).
    fn start_resend(&mut self, from: u64) {
        let resend = match self.resend_from(from) {
            Ok(r) => r,
            Err(why) => {
                let e = ProtocolError::Invalid {
                    ty: MsgType::Switch,
                    why,
                };
                self.abort(
                    super::AbortReason::Protocol(e),
                    Some(AbortCode::ProtocolError),
                );
                return;
            }
        };
        self.switch = Switch::Resending;
        self.push(Action::Resend(resend));
    }

    /// Our stream from offset `from` to its end, in order.
    fn resend_from(&self, from: u64) -> Result<Resend, &'static str> {
        if from < self.posted_base {
            return Err("the peer wants bytes it had acknowledged");
        }
        let mut r = Resend {
            from,
            pieces: Vec::new(),
            shutdown: self.tx_shutdown != super::TxShutdown::Open,
        };
        // Offset in the stream, and in the send buffer (whose front holds
        // the oldest DATA not yet acknowledged).
        let mut off = self.posted_base;
        let mut buf_at = 0u64;
        let bytes = |r: &mut Resend, off: u64, buf_at: u64, len: u64| {
            let skip = from.saturating_sub(off).min(len);
            if skip < len {
                push_bytes(r, &self.txbuf, buf_at + skip, len - skip);
            }
        };
        for p in &self.posted {
            match *p {
                Posted::Data { nth, len } => {
                    if nth < self.data_acked {
                        // Consumed, so before `from`.
                        if off + len > from {
                            return Err("the peer wants DATA it had acknowledged");
                        }
                    } else {
                        bytes(&mut r, off, buf_at, len);
                        buf_at += len;
                    }
                    off += len;
                }
                Posted::Avail { id, len } => {
                    if let Some(a) = self.out_avails.get(&id) {
                        self.avail_piece(&mut r, a, from.saturating_sub(off).min(len));
                    } else if len > 0 && off + len > from {
                        // (A cancelled one that nothing was taken of is
                        // empty, wherever it is.)
                        return Err("the peer wants an advertisement it had finished");
                    }
                    off += len;
                }
            }
        }
        for item in &self.txq {
            match *item {
                super::TxItem::Data(n) => {
                    bytes(&mut r, off, buf_at, n);
                    buf_at += n;
                    off += n;
                }
                super::TxItem::Avail(id) => {
                    if let Some(a) = self.out_avails.get(&id) {
                        let len = u64::from(a.len);
                        self.avail_piece(&mut r, a, from.saturating_sub(off).min(len));
                        off += len;
                    }
                }
                super::TxItem::Shutdown => {}
            }
        }
        if off != self.tx_stream_off {
            return Err("the stream's pieces do not add up");
        }
        Ok(r)
    }

    /// An advertisement's bytes from `skip` on: from its copy if
    /// copy-on-write made one, else from its pages.
    fn avail_piece(&self, r: &mut Resend, a: &super::tx::OutAvail, skip: u64) {
        let len = u64::from(a.len);
        if skip >= len || a.state == AvailState::Preparing {
            return;
        }
        let src = a.source_at(skip as u32);
        r.pieces.push(ResendPiece::Memory {
            addr: src.addr,
            len: len - skip,
        });
    }

    /// Everything the stream held, gone (the connection left the fabric).
    fn clear_stream_state(&mut self) {
        self.drop_tx_stream();
        self.drop_rx_stream();
        // `out` keeps our SWITCH until it is posted; DATA not yet written
        // into messages is in the resend (and the peer reads the fabric no
        // more).
        self.out.retain(|m| !matches!(m, OutMsg::Data { .. }));
    }

    /// `credits` DATA messages came back: the peer consumed them, their
    /// bytes need not be kept.
    pub(super) fn ack_data(&mut self, credits: u32) {
        for _ in 0..credits {
            let Some(len) = self.retained.pop_front() else {
                break;
            };
            self.txbuf.drain(..len as usize);
            self.emitted_unacked = self.emitted_unacked.saturating_sub(len);
            self.data_acked += 1;
        }
        self.trim_posted();
    }

    /// Forget the front of the posted stream while it is consumed.
    pub(super) fn trim_posted(&mut self) {
        while let Some(p) = self.posted.front() {
            let done = match *p {
                Posted::Data { nth, .. } => nth < self.data_acked,
                Posted::Avail { id, .. } => !self.out_avails.contains_key(&id),
            };
            if !done {
                return;
            }
            self.posted_base += p.len();
            self.posted.pop_front();
        }
    }
}

/// Append `len` bytes of `buf` from `at` to the resend (merged with bytes
/// just before them).
fn push_bytes(r: &mut Resend, buf: &VecDeque<u8>, at: u64, len: u64) {
    let (at, len) = (at as usize, len as usize);
    let mut v = match r.pieces.pop() {
        Some(ResendPiece::Bytes(v)) => v,
        Some(other) => {
            r.pieces.push(other);
            Vec::new()
        }
        None => Vec::new(),
    };
    v.extend(buf.range(at..at + len));
    r.pieces.push(ResendPiece::Bytes(v));
}
