//! The sans-IO AZ-SDP connection engine.
//!
//! A [`Connection`] takes application intents (`send`, `recv`, `shutdown`,
//! `close`), fabric events (`handle_message`, `handle_completion`,
//! `handle_peer_gone`), fault notifications (`handle_fault`, `evacuate`) and
//! timer ticks (`handle_timeout`). It answers with messages to post
//! ([`Connection::poll_transmit`]) and [`Action`]s ([`Connection::poll_action`]):
//! GETs, compare-and-swaps, protection changes, and wake-ups of blocked calls
//! and faults. It performs no syscalls and reads no clock; application memory
//! is reached only through the [`UserMemory`] the driver passes in.
//!
//! The send path lives in `tx.rs`, the receive path in `rx.rs`; this file holds
//! what both share: handshake, message dispatch, credits, faults, timers and
//! teardown. The state machines are specified in `docs/protocol.md`.

mod ahead;
mod ahead_gauge;
mod api;
mod counters;
mod fallback;
mod join;
pub mod lockword;
mod park;
mod rx;
mod settings;
mod switch;
mod timers;
mod tx;

use std::collections::{BTreeMap, VecDeque};
use std::ops::Range;

pub use api::*;
pub use counters::{COPY_REASONS, CopyReason, Counters, FallbackReason};
pub use join::RxRoute;
pub use park::Unparkable;
pub use settings::{Capabilities, EngineConfig, FaultPolicy, LockRegion, RecvProtect};
pub use timers::Timer;

use crate::pages::{self, RangeCounter};
use crate::time::Timestamp;
use crate::wire::{self, AbortCode, Frame, Hello, Message, MsgType};
use fallback::FaultMonitor;
use rx::{InAvail, RecvCall, RxItem};
use switch::{Posted, Switch};
use tx::{OutAvail, SendCall, TxItem};

/// Connection life cycle.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum State {
    /// Waiting for HELLO (server) or HELLO_ACK (client).
    Handshake,
    Established,
    /// Aborted; pending operations are draining, no new work is accepted.
    Aborted(AbortReason),
    /// Both sides left the fabric: the stream goes on over TCP.
    Switched,
}

/// The send mode in force for new zero-copy sends.
#[derive(Clone, Copy, Debug, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub enum TxMode {
    /// AZ-SDP: asynchronous zero-copy.
    Async,
    /// ZSDP: zero-copy, `send()` waits for GET_COMPLETE.
    Sync,
    /// BSDP only: no zero-copy possible.
    Buffered,
}

/// What the peer told us in its HELLO, plus what we derived.
#[derive(Clone, Copy, Debug, serde::Serialize, serde::Deserialize)]
struct Peer {
    hello: Hello,
    /// Most DATA payload bytes per message.
    max_payload: u64,
    /// SRC_AVAILs we may have in flight.
    max_outstanding: u16,
    cow: bool,
}

/// A message waiting to be posted, in wire order.
#[derive(Clone, Copy, Debug, serde::Serialize, serde::Deserialize)]
enum OutMsg {
    Hello,
    HelloAck,
    /// DATA carrying the next `len` bytes of the send buffer.
    Data {
        len: u64,
    },
    Avail(wire::SrcAvail),
    Update(wire::SrcAvailUpdate),
    Cancel(u32),
    GetComplete(wire::GetComplete),
    Credit {
        ping: bool,
        pong: bool,
    },
    Shutdown(u64),
    Abort(AbortCode),
    Switch {
        consumed: u64,
        sent: u64,
    },
    Join {
        tcp_sent: u64,
    },
}

/// What an operation in flight is for.
#[derive(Clone, Debug)]
enum OpKind {
    Prepare {
        avail: u32,
    },
    CowCas {
        avail: u32,
    },
    Copy {
        avail: u32,
        /// How long the copy is (for its release if the advertisement
        /// is gone by the time it is done).
        len: u64,
    },
    LockTake {
        avail: u32,
    },
    LockRelease {
        avail: u32,
        expect: u64,
        finished: bool,
    },
    Arm {
        avail: u32,
        call: CallId,
        range: Range<u64>,
        src: RemoteBuf,
    },
    Get {
        avail: u32,
        call: Option<CallId>,
        armed: Option<Range<u64>>,
    },
    /// Staging memory for a read-ahead of `avail` (`ahead`).
    PoolAlloc {
        avail: u32,
        len: u64,
    },
    /// A GET ahead of the program into staging memory `at`.
    GetAhead {
        avail: u32,
        at: u64,
        len: u64,
    },
}

/// A blocked access waiting for a range to become ordinary memory.
#[derive(Clone, Debug)]
struct Waiter {
    ticket: Ticket,
    range: Range<u64>,
    access: Access,
    since: Timestamp,
    escalated: bool,
}

/// One AZ-SDP connection. See the module documentation.
///
/// Serialized only to park it ([`park`]): the skipped fields are what a
/// parkable connection holds none of (they name application memory or
/// operations in flight).
#[derive(Debug, serde::Serialize, serde::Deserialize)]
pub struct Connection {
    cfg: EngineConfig,
    #[serde(skip, default = "park::established")]
    state: State,
    peer: Option<Peer>,
    now: Timestamp,
    next_op: u64,
    #[serde(skip)]
    ops: crate::id_map::IdMap<OpId, OpKind>,
    #[serde(skip)]
    actions: VecDeque<Action>,
    counters: Counters,

    // message channel
    out: VecDeque<OutMsg>,
    tx_seq: u32,
    rx_seq: u32,
    /// DATA credits we may still use.
    credits: u32,
    /// DATA messages we sent whose credit has not come back.
    credits_in_use: u32,
    /// Slots freed here not yet reported to the peer.
    unreported: u32,
    /// DATA messages received whose slot is not yet reported free.
    rx_slots_held: u32,

    // send side
    txbuf: VecDeque<u8>,
    /// Bytes in `txbuf` not yet moved to the out queue.
    tx_unposted: u64,
    /// Bytes ever moved from `txbuf` to the out queue (room made).
    tx_drained: u64,
    txq: VecDeque<TxItem>,
    #[serde(skip)]
    send_calls: VecDeque<SendCall>,
    #[serde(skip)]
    out_avails: BTreeMap<u32, OutAvail>,
    /// Local handles of advertisements, and the ids they were posted under.
    next_avail_id: u32,
    next_wire_id: u32,
    wire_ids: BTreeMap<u32, u32>,
    /// Generation of each of the peer's lock slots, and whether it is in use.
    slot_gen: Vec<u32>,
    slot_busy: Vec<bool>,
    #[serde(skip)]
    send_prot: RangeCounter,
    tx_stream_off: u64,
    tx_shutdown: TxShutdown,
    mode: TxMode,
    monitor: FaultMonitor,

    // receive side
    /// Whether reading ahead pays here (`read_ahead_auto` only).
    #[serde(default)]
    ahead_gauge: Option<ahead_gauge::AheadGauge>,
    rxbuf: VecDeque<u8>,
    /// Unconsumed bytes of each DATA message, in order (credit accounting).
    rx_msgs: VecDeque<u64>,
    rxq: VecDeque<RxItem>,
    in_avails: BTreeMap<u32, InAvail>,
    rx_next_avail_id: u32,
    rx_stream_off: u64,
    /// Generation of each of our lock slots, and which advertisement holds it.
    my_slot_gen: Vec<u32>,
    my_slot_user: Vec<Option<u32>>,
    #[serde(skip)]
    recv_calls: VecDeque<RecvCall>,
    #[serde(skip)]
    armed: RangeCounter,
    rx_eof: bool,
    rx_shut: bool,
    /// Advertisements finished here while the source's SRC_AVAIL_UPDATE
    /// for them was on its way (their bytes were read ahead): it is
    /// expected, once each.
    #[serde(default)]
    updates_due: std::collections::BTreeSet<u32>,
    /// The peer left after closing cleanly (see `handle_peer_gone`).
    peer_left: bool,
    /// Stream offset up to which our `send()` calls have returned.
    tx_returned: u64,

    // leaving the fabric (switch.rs)
    switch: Switch,
    /// What the peer's SWITCH said its application consumed of our stream.
    peer_switch: Option<u64>,
    /// The peer's process died, and its heirs (processes of its side that
    /// carry on) get the stream on TCP from this side alone: no SWITCH
    /// goes, and what arrived from the peer and was not read yet stays
    /// here, read before the TCP socket (see `handle_peer_left`).
    #[serde(default)]
    orphaned: bool,
    /// The connection's move from TCP onto the fabric (join.rs).
    #[serde(default)]
    join: join::Join,
    /// Our stream handed to the fabric and not yet consumed, in order.
    posted: VecDeque<Posted>,
    /// Stream offset of `posted`'s first piece.
    posted_base: u64,
    /// DATA messages handed to the fabric, and those whose credit came back.
    data_pumped: u64,
    data_acked: u64,
    /// Lengths of DATA handed to the fabric whose credit has not come back;
    /// their bytes are at the front of `txbuf`.
    retained: VecDeque<u64>,
    /// Bytes at the front of `txbuf` already written into messages.
    emitted_unacked: u64,

    // faults and lifetime
    #[serde(skip)]
    waiters: Vec<Waiter>,

    // liveness and teardown
    last_rx: Timestamp,
    /// When the fabric last vouched that the peer's side is alive (see
    /// [`Connection::peer_vouched`]).
    #[serde(skip)]
    last_vouched: Option<Timestamp>,
    /// Since when the peer owes us something (`owes_liveness`): silence
    /// counts from then, not from the peer's last word before (a
    /// connection idle longer than `peer_timeout` whose program then calls
    /// was timed out at once, before the peer could answer).
    #[serde(skip)]
    owing_since: Option<Timestamp>,
    ping_outstanding: bool,
    app_closed: bool,
    linger_deadline: Option<Timestamp>,
    /// The abort's error was reported (by a call or `SO_ERROR`): as TCP's
    /// socket error, it is reported once; then receives see the end of
    /// the stream and sends EPIPE.
    error_reported: bool,
    /// The peer's stream had ended (EOF) when the connection was aborted:
    /// as TCP reset in CLOSE_WAIT, receives see the end of the stream and
    /// the error is EPIPE.
    aborted_after_eof: bool,
    /// Work waits for queued actions to run: `poll_timeout` says "now".
    repoll: bool,
    /// What the connection was waiting for when it timed out (for the
    /// log: a timeout is a stall somewhere, and this says where).
    stalled: Option<String>,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
enum TxShutdown {
    Open,
    Queued,
    Sent,
}

impl Connection {
    /// A new connection. The client posts HELLO at once; the server waits for it.
    pub fn new(cfg: EngineConfig, now: Timestamp) -> Connection {
        let monitor = FaultMonitor::new(
            cfg.fallback_faults,
            cfg.fallback_window,
            cfg.fallback_recover,
        );
        let my_slots = usize::from(cfg.lock_region.slots);
        let mut c = Connection {
            state: State::Handshake,
            peer: None,
            now,
            next_op: 1,
            ops: Default::default(),
            actions: VecDeque::new(),
            counters: Counters::default(),
            out: VecDeque::new(),
            tx_seq: 0,
            rx_seq: 0,
            credits: 0,
            credits_in_use: 0,
            unreported: 0,
            rx_slots_held: 0,
            txbuf: VecDeque::new(),
            tx_unposted: 0,
            tx_drained: 0,
            txq: VecDeque::new(),
            send_calls: VecDeque::new(),
            out_avails: BTreeMap::new(),
            next_avail_id: 0,
            next_wire_id: 0,
            wire_ids: BTreeMap::new(),
            slot_gen: Vec::new(),
            slot_busy: Vec::new(),
            send_prot: RangeCounter::new(),
            tx_stream_off: 0,
            tx_shutdown: TxShutdown::Open,
            mode: TxMode::Buffered,
            monitor,
            ahead_gauge: (cfg.read_ahead > 0 && cfg.read_ahead_auto)
                .then(|| ahead_gauge::AheadGauge::new(cfg.read_ahead)),
            rxbuf: VecDeque::new(),
            rx_msgs: VecDeque::new(),
            rxq: VecDeque::new(),
            in_avails: BTreeMap::new(),
            rx_next_avail_id: 0,
            rx_stream_off: 0,
            my_slot_gen: vec![0; my_slots],
            my_slot_user: vec![None; my_slots],
            recv_calls: VecDeque::new(),
            armed: RangeCounter::new(),
            rx_eof: false,
            rx_shut: false,
            updates_due: Default::default(),
            stalled: None,
            peer_left: false,
            tx_returned: 0,
            switch: Switch::No,
            peer_switch: None,
            orphaned: false,
            join: join::Join::new(cfg.joins_from_tcp),
            posted: VecDeque::new(),
            posted_base: 0,
            data_pumped: 0,
            data_acked: 0,
            retained: VecDeque::new(),
            emitted_unacked: 0,
            waiters: Vec::new(),
            last_rx: now,
            last_vouched: None,
            owing_since: None,
            ping_outstanding: false,
            app_closed: false,
            linger_deadline: None,
            error_reported: false,
            aborted_after_eof: false,
            repoll: false,
            cfg,
        };
        if c.cfg.role == Role::Client {
            c.out.push_back(OutMsg::Hello);
        }
        c
    }

    // ----- queries -------------------------------------------------------

    pub fn state(&self) -> &State {
        &self.state
    }

    pub fn counters(&self) -> &Counters {
        &self.counters
    }

    pub fn config(&self) -> &EngineConfig {
        &self.cfg
    }

    /// The send mode new zero-copy sends would use now.
    pub fn tx_mode(&self) -> TxMode {
        self.mode
    }

    /// SRC_AVAILs this side has advertised that are not finished.
    pub fn outstanding_avails(&self) -> usize {
        self.out_avails.len()
    }

    /// Readiness for poll/select/epoll.
    /// As TCP's `tcp_poll` sees a socket: readable with data, at the end
    /// of the stream or on an error; writable with room, and once sending
    /// is shut down or the connection aborted (a send then fails at
    /// once); hung up when both directions are finished.
    pub fn readiness(&self) -> Readiness {
        if self.state == State::Switched {
            // The TCP connection's readiness is what counts now: whoever
            // waits here must look there.
            return Readiness {
                readable: true,
                writable: true,
                ..Readiness::default()
            };
        }
        let aborted = matches!(self.state, State::Aborted(_));
        let rx_done = aborted || self.rx_eof || self.rx_shut;
        let tx_done = aborted || self.tx_shutdown != TxShutdown::Open || self.peer_left;
        Readiness {
            readable: rx_done || !self.rxq.is_empty(),
            // Sends are taken from the moment the pair is made (queued
            // until the engines' handshake is over), as TCP's after
            // connect() returns.
            writable: tx_done || (!aborted && self.tx_unposted < self.cfg.sndbuf),
            read_hangup: rx_done,
            hangup: aborted || (rx_done && self.tx_shutdown != TxShutdown::Open),
            error: aborted && !self.error_reported,
            arrived: self.rx_stream_off + u64::from(self.rx_eof),
            drained: self.tx_drained,
        }
    }

    /// `SO_ERROR`: the pending error, reported once (as TCP's socket
    /// error, which reading clears).
    pub fn take_error(&mut self) -> Option<CallError> {
        let e = self.abort_error().filter(|_| !self.error_reported);
        self.error_reported = true;
        e
    }

    /// Calls not yet completed (their threads are blocked in them).
    pub fn pending_calls(&self) -> Vec<CallId> {
        self.send_calls
            .iter()
            .map(|c| c.call)
            .chain(self.recv_calls.iter().map(|c| c.call))
            .collect()
    }

    /// How much of our stream our `send()` calls have returned (what a
    /// peer may rely on having been sent; see [`Connection::handle_peer_left`]).
    pub fn tx_returned(&self) -> u64 {
        self.tx_returned
    }

    /// How far our calls have got, for the peer to judge our departure by
    /// (published through the fabric; see [`Connection::handle_peer_left`]).
    pub fn progress_made(&self) -> Departure {
        Departure {
            sent: self.tx_returned,
            read: self.counters.bytes_received(),
        }
    }

    /// Bytes a `recv()` could take now without waiting for the peer
    /// (FIONREAD): buffered DATA plus what is left of each advertisement.
    pub fn readable_bytes(&self) -> u64 {
        self.rxq
            .iter()
            .map(|item| match item {
                RxItem::Data(n) => *n,
                RxItem::Avail(id) => self
                    .in_avails
                    .get(id)
                    .map_or(0, |a| u64::from(a.len.saturating_sub(a.taken))),
            })
            .sum()
    }

    /// Does anything in flight hold `range` of application memory: pages
    /// write-protected for a send, or armed for a receive? (Memory-lifetime
    /// hooks ask before memory is freed, unmapped or discarded.)
    pub fn holds_memory(&self, range: &Range<u64>) -> bool {
        self.send_prot.overlaps(range) || self.armed.overlaps(range)
    }

    /// The smallest range covering every page held (protected or armed).
    pub fn held_bounds(&self) -> Option<Range<u64>> {
        match (self.send_prot.bounds(), self.armed.bounds()) {
            (Some(a), Some(b)) => Some(a.start.min(b.start)..a.end.max(b.end)),
            (a, b) => a.or(b),
        }
    }

    /// Nothing is left to do: the driver may drop the connection.
    pub fn is_finished(&self) -> bool {
        let drained = self.ops.is_empty()
            && self.out.is_empty()
            && self.actions.is_empty()
            && self.send_calls.is_empty()
            && self.recv_calls.is_empty()
            && self.waiters.is_empty();
        match self.state {
            State::Aborted(_) | State::Switched => drained,
            _ => {
                drained
                    && self.app_closed
                    && self.tx_shutdown == TxShutdown::Sent
                    && self.out_avails.is_empty()
                    && self.in_avails.is_empty()
            }
        }
    }

    /// Pages this connection holds write-protected (for checks and stats).
    pub fn protected_ranges(&self) -> Vec<Range<u64>> {
        self.send_prot.ranges()
    }

    /// Pages this connection holds armed.
    pub fn armed_ranges(&self) -> Vec<Range<u64>> {
        self.armed.ranges()
    }

    // ----- outputs -------------------------------------------------------

    /// The next action for the driver, in order.
    pub fn poll_action(&mut self) -> Option<Action> {
        self.actions.pop_front()
    }

    /// Largest message this connection may ask `poll_transmit` to write.
    pub fn max_message_len(&self) -> usize {
        let data = self
            .peer
            .map_or(0, |p| p.max_payload as usize + wire::HEADER_LEN);
        data.max(wire::MAX_CONTROL_LEN)
    }

    /// How long a buffer the next [`Connection::poll_transmit`] needs
    /// (`None`: nothing to send). At most [`Connection::max_message_len`]:
    /// a driver sizes its buffer by what it sends, so a connection of small
    /// messages never holds (and zeroes) one of the largest.
    pub fn next_transmit_len(&self) -> Option<usize> {
        let plain_credit = |m: &OutMsg| {
            matches!(
                m,
                OutMsg::Credit {
                    ping: false,
                    pong: false
                }
            )
        };
        // (What `poll_transmit` skips: a plain credit with nothing to
        // carry. Credits only grow by a message's emission, so the first
        // one it skips is all it skips.)
        let msg = self
            .out
            .iter()
            .find(|m| !(plain_credit(m) && self.unreported == 0))?;
        Some(match msg {
            OutMsg::Data { len } => wire::HEADER_LEN + *len as usize,
            _ => wire::MAX_CONTROL_LEN,
        })
    }

    /// Are messages waiting for [`Connection::poll_transmit`]?
    pub fn has_transmit(&self) -> bool {
        !self.out.is_empty()
    }

    /// Write the next message into `buf` (at least [`max_message_len`] bytes)
    /// and return its length, or `None` if nothing is due.
    ///
    /// [`max_message_len`]: Connection::max_message_len
    pub fn poll_transmit(&mut self, buf: &mut [u8]) -> Option<usize> {
        loop {
            let msg = self.out.pop_front()?;
            let credits = self.unreported.min(u32::from(u16::MAX));
            let is_plain_credit = matches!(
                msg,
                OutMsg::Credit {
                    ping: false,
                    pong: false
                }
            );
            if is_plain_credit && credits == 0 {
                continue; // an earlier message already carried them
            }
            let len = match self.emit(msg, credits as u16, buf) {
                Ok(n) => n,
                Err(e) => {
                    // Only a driver passing a short buffer gets here.
                    debug_assert!(false, "poll_transmit: {e}");
                    self.out.push_front(msg);
                    return None;
                }
            };
            self.unreported -= credits;
            self.rx_slots_held -= credits;
            self.counters.credits_returned += u64::from(credits);
            self.tx_seq = self.tx_seq.wrapping_add(1);
            self.counters.msgs_sent += 1;
            return Some(len);
        }
    }

    fn emit(
        &mut self,
        msg: OutMsg,
        credits: u16,
        buf: &mut [u8],
    ) -> Result<usize, wire::WireError> {
        let seq = self.tx_seq;
        let m = match msg {
            OutMsg::Hello => Message::Hello(self.my_hello()),
            OutMsg::HelloAck => Message::HelloAck(self.my_hello()),
            OutMsg::Data { len } => {
                let len = len as usize;
                let need = wire::HEADER_LEN + len;
                if buf.len() < need {
                    return Err(wire::WireError::BufferTooSmall {
                        need,
                        have: buf.len(),
                    });
                }
                wire::emit_header(MsgType::Data, 0, seq, credits, len, buf)?;
                // The bytes stay at the front of the send buffer until the
                // peer's credit says it consumed them (switch.rs).
                let at = self.emitted_unacked as usize;
                let (a, b) = self.txbuf.as_slices();
                let dst = &mut buf[wire::HEADER_LEN..need];
                if at + len <= a.len() {
                    dst.copy_from_slice(&a[at..at + len]);
                } else if at >= a.len() {
                    dst.copy_from_slice(&b[at - a.len()..at - a.len() + len]);
                } else {
                    let from_a = a.len() - at;
                    dst[..from_a].copy_from_slice(&a[at..]);
                    dst[from_a..].copy_from_slice(&b[..len - from_a]);
                }
                self.emitted_unacked += len as u64;
                self.counters.data_msgs_sent += 1;
                return Ok(need);
            }
            OutMsg::Avail(a) => Message::SrcAvail(a),
            OutMsg::Update(u) => Message::SrcAvailUpdate(u),
            OutMsg::Cancel(id) => Message::SrcAvailCancel { id },
            OutMsg::GetComplete(g) => Message::GetComplete(g),
            OutMsg::Credit { ping, pong } => Message::Credit { ping, pong },
            OutMsg::Shutdown(end) => Message::Shutdown { stream_end: end },
            OutMsg::Abort(code) => Message::Abort { code },
            OutMsg::Switch { consumed, sent } => Message::Switch { consumed, sent },
            OutMsg::Join { tcp_sent } => Message::Join { tcp_sent },
        };
        wire::emit(
            &Frame {
                seq,
                credits,
                msg: m,
            },
            buf,
        )
    }

    fn my_hello(&self) -> Hello {
        let caps = self.cfg.caps;
        let slots = self.cfg.lock_region.slots;
        let mut features = 0;
        if caps.zcopy_source {
            features |= wire::features::ZCOPY_SOURCE;
        }
        if caps.zcopy_sink && slots > 0 {
            features |= wire::features::ZCOPY_SINK;
            if caps.cas {
                features |= wire::features::COW_LOCK;
            }
        }
        Hello {
            min_version: wire::VERSION,
            max_version: wire::VERSION,
            page_size: self.cfg.page_size,
            features,
            credits: self.cfg.rx_credits.max(1),
            lock_slots: slots,
            slot_size: self
                .cfg
                .slot_size
                .clamp(wire::MIN_SLOT_SIZE, wire::MAX_SLOT_SIZE),
            lock_addr: self.cfg.lock_region.addr,
            lock_key: self.cfg.lock_region.key,
            max_avail: self.cfg.max_avail_len,
        }
    }

    /// Is the peer expected to do something for us (so silence is suspicious)?
    fn owes_liveness(&self) -> bool {
        self.state == State::Handshake
            || self.switch == Switch::Sent
            || !self.out_avails.is_empty()
            || !self.send_calls.is_empty()
            || !self.recv_calls.is_empty()
            || !self.waiters.is_empty()
            || self.app_closed
    }

    /// What this side is waiting for, in a line: calls, advertisements
    /// both ways, operations in flight by kind, credits, fault waiters, and
    /// how long since the peer last spoke.
    pub fn describe_waits(&self) -> String {
        let mut kinds: BTreeMap<&'static str, usize> = BTreeMap::new();
        for k in self.ops.values() {
            let name = match k {
                OpKind::Prepare { .. } => "prepare",
                OpKind::CowCas { .. } => "cow-cas",
                OpKind::Copy { .. } => "copy",
                OpKind::LockTake { .. } => "lock-take",
                OpKind::LockRelease { .. } => "lock-release",
                OpKind::Arm { .. } => "arm",
                OpKind::Get { .. } => "get",
                OpKind::PoolAlloc { .. } => "staging",
                OpKind::GetAhead { .. } => "get-ahead",
            };
            *kinds.entry(name).or_default() += 1;
        }
        let ops: Vec<String> = kinds.iter().map(|(k, n)| format!("{n} {k}")).collect();
        let leaving = match self.switch {
            Switch::No => String::new(),
            s => format!(" (leaving the fabric: {s:?})"),
        };
        format!(
            "{:?}{leaving}{}, {} send call(s), {} recv call(s), {} advertisement(s) out, {} in, \
             ops in flight [{}], credits {} ({} in use), {} fault waiter(s), \
             {} B buffered out, {} B buffered in, peer silent {:?}",
            self.state,
            if self.peer_left { " (peer gone)" } else { "" },
            self.send_calls.len(),
            self.recv_calls.len(),
            self.out_avails.len(),
            self.in_avails.len(),
            ops.join(", "),
            self.credits,
            self.credits_in_use,
            self.waiters.len(),
            self.txbuf.len(),
            self.rxbuf.len(),
            self.now.saturating_since(self.last_rx),
        )
    }

    /// What it was waiting for when it timed out, if it did.
    pub fn stalled(&self) -> Option<&str> {
        self.stalled.as_deref()
    }

    // ----- small helpers ---------------------------------------------------

    fn op(&mut self, kind: OpKind) -> OpId {
        let id = OpId(self.next_op);
        self.next_op += 1;
        self.ops.insert(id, kind);
        id
    }

    fn push(&mut self, a: Action) {
        self.actions.push_back(a);
    }

    fn page(&self) -> u64 {
        u64::from(self.cfg.page_size)
    }

    fn is_aborted(&self) -> bool {
        matches!(self.state, State::Aborted(_))
    }

    fn abort_error(&self) -> Option<CallError> {
        match &self.state {
            State::Aborted(r) => Some(match r.call_error() {
                CallError::ConnReset if self.aborted_after_eof => CallError::BrokenPipe,
                e => e,
            }),
            _ => None,
        }
    }

    // ----- application: shutdown and close ---------------------------------

    /// `shutdown(how)`.
    pub fn shutdown(&mut self, now: Timestamp, how: Shutdown, mem: &mut dyn UserMemory) {
        self.now = now;
        if self.state == State::Switched {
            // The TCP connection's own shutdown is what counts now.
            return;
        }
        if matches!(how, Shutdown::Write | Shutdown::Both)
            && self.tx_shutdown == TxShutdown::Open
            && !self.is_aborted()
        {
            if self.join.tx_on_fabric() {
                self.tx_shutdown = TxShutdown::Queued;
                self.txq.push_back(TxItem::Shutdown);
            } else {
                // Our stream ended on TCP before it joined (the peer reads
                // its end there): nothing of it goes on the fabric.
                self.tx_shutdown = TxShutdown::Sent;
            }
        }
        if matches!(how, Shutdown::Read | Shutdown::Both) && !self.rx_shut {
            self.rx_shut = true;
            self.discard_rx();
        }
        self.progress(mem);
    }

    /// `close()`. The connection may live on (lingering) until
    /// [`Connection::is_finished`].
    pub fn close(&mut self, now: Timestamp, linger: Linger, mem: &mut dyn UserMemory) {
        self.now = now;
        if self.app_closed {
            return;
        }
        self.app_closed = true;
        if self.state == State::Switched {
            // Closing the TCP connection is the driver's.
            return;
        }
        let unread = !self.rxq.is_empty();
        if linger == Linger::Abort || unread {
            // TCP sends a reset when closing with unread data; so do we.
            self.abort(AbortReason::LocalReset, Some(AbortCode::Reset));
        } else {
            self.linger_deadline = Some(now + self.cfg.linger);
            self.shutdown(now, Shutdown::Both, mem);
        }
        self.progress(mem);
    }

    /// Abort from the application or the driver (e.g. the fabric failed).
    pub fn abort_local(&mut self, now: Timestamp, reason: AbortReason, code: AbortCode) {
        self.now = now;
        self.abort(reason, Some(code));
    }

    // ----- fabric events ---------------------------------------------------

    /// The fabric lost the peer (process died, link down), with how far it
    /// had got if the fabric knows. As a TCP peer that dies sends FIN when
    /// it read everything sent to it and RST otherwise: a departure that
    /// lost nothing either way (all it sent arrived here, none of it waits
    /// in its memory; all we sent was read there) ends our stream with EOF
    /// after its data, and later sends fail with EPIPE. Any other is a
    /// reset (ECONNRESET): data one program believed sent died unread,
    /// whether ours was still queued, in flight or in its buffers.
    ///
    /// With `heir` (another process of the peer's side holds the
    /// connection and carries on), a peer whose every returned send
    /// arrived here hands the stream over: this side writes to TCP what
    /// the peer's programs had not read of ours (from `left.read`, as if
    /// the peer had sent a SWITCH saying so), keeps what arrived from the
    /// peer for our program to read first, and the heirs go on over TCP.
    pub fn handle_peer_left(
        &mut self,
        now: Timestamp,
        left: Option<Departure>,
        heir: bool,
        mem: &mut dyn UserMemory,
    ) {
        self.now = now;
        let Some(left) = left else {
            self.handle_peer_gone(now);
            // (A switch under way settles now: see `switch_without_peer`.)
            self.progress(mem);
            return;
        };
        // A side that finished (closed, everything posted) still owes the
        // heirs the rest of its stream: what the dead process had not read
        // of it, and its end (with nothing left, the end alone), as a TCP
        // sender's kernel delivers them after its program closed. Without
        // it, heirs that had read everything waited for a stream that never
        // came, and were reset.
        if self.is_aborted() || (self.is_finished() && !heir) {
            return;
        }
        let all_here = self.in_avails.is_empty() && left.sent <= self.rx_stream_off;
        if heir && all_here && self.orphan_switch(left.read, mem) {
            return;
        }
        let all_read = self.send_calls.is_empty()
            && self.out_avails.is_empty()
            && left.read >= self.tx_returned;
        if !(all_here && all_read) {
            self.counters.bytes_unread_by_peer = self.tx_returned.saturating_sub(left.read);
            self.abort(AbortReason::PeerGone, None);
            return;
        }
        self.rx_eof = true;
        self.peer_left = true;
        self.progress(mem);
    }

    pub fn handle_peer_gone(&mut self, now: Timestamp) {
        self.now = now;
        // A peer that leaves after everything is settled (our close is
        // done, nothing is owed either way) ends nothing: that is a clean
        // close seen from the fabric.
        if self.is_finished() {
            return;
        }
        // A peer that closed its side cleanly and then left, owing nothing
        // zero-copy, took nothing with it: what it sent is all here (as TCP
        // data after a FIN outlives the sender). It can no longer receive:
        // our sends fail with EPIPE, unless something of ours is in flight.
        let tx_idle = self.send_calls.is_empty() && self.out_avails.is_empty();
        if self.rx_eof && self.in_avails.is_empty() && tx_idle {
            self.peer_left = true;
            return;
        }
        self.abort(AbortReason::PeerGone, None);
    }

    /// A message arrived from the peer.
    pub fn handle_message(&mut self, now: Timestamp, bytes: &[u8], mem: &mut dyn UserMemory) {
        self.now = now;
        self.last_rx = now;
        self.ping_outstanding = false;
        if self.is_aborted() {
            return;
        }
        self.counters.msgs_received += 1;
        if let Err(e) = self.dispatch(bytes) {
            let code = if matches!(
                e,
                ProtocolError::Unexpected {
                    ty: MsgType::Hello | MsgType::HelloAck,
                    ..
                }
            ) {
                AbortCode::Incompatible
            } else {
                AbortCode::ProtocolError
            };
            self.abort(AbortReason::Protocol(e), Some(code));
        }
        self.progress(mem);
    }

    fn dispatch(&mut self, bytes: &[u8]) -> Result<(), ProtocolError> {
        let frame = wire::parse(bytes)?;
        if frame.seq != self.rx_seq {
            return Err(ProtocolError::Sequence {
                expected: self.rx_seq,
                got: frame.seq,
            });
        }
        self.rx_seq = self.rx_seq.wrapping_add(1);
        let ty = frame.msg.msg_type();
        let established = self.state == State::Established;
        match (ty, established) {
            (MsgType::Hello | MsgType::HelloAck | MsgType::Abort, _) => {}
            (_, false) => {
                return Err(ProtocolError::Unexpected {
                    ty,
                    when: "before the handshake",
                });
            }
            _ => {}
        }
        self.check_join(ty)?;
        if matches!(self.switch, Switch::Sent | Switch::Resending) || self.state == State::Switched
        {
            // We left the fabric: the peer's stream comes again over TCP.
            return match frame.msg {
                Message::Switch { consumed, sent } => self.on_switch(consumed, sent),
                Message::Join { tcp_sent } => self.on_join(tcp_sent),
                Message::Abort { code } => {
                    self.abort(AbortReason::PeerAbort(code), None);
                    Ok(())
                }
                _ => Ok(()),
            };
        }
        // A closed connection lingers as long as the peer keeps taking data.
        let progress = frame.credits > 0 || matches!(frame.msg, Message::GetComplete(_));
        if progress && let Some(d) = self.linger_deadline.as_mut() {
            *d = self.now + self.cfg.linger;
        }
        if frame.credits > 0 {
            let c = u32::from(frame.credits);
            if c > self.credits_in_use {
                return Err(ProtocolError::Invalid {
                    ty,
                    why: "returns more credits than are in use",
                });
            }
            self.credits_in_use -= c;
            self.credits += c;
            self.ack_data(c);
        }
        match frame.msg {
            Message::Hello(h) => self.on_hello(h, false)?,
            Message::HelloAck(h) => self.on_hello(h, true)?,
            Message::Data(payload) => self.on_data(payload)?,
            Message::SrcAvail(a) => self.on_src_avail(a)?,
            Message::SrcAvailUpdate(u) => self.on_update(u)?,
            Message::SrcAvailCancel { id } => self.on_cancel(id)?,
            Message::GetComplete(g) => self.on_get_complete(g)?,
            Message::Credit { ping, pong: _ } => {
                if ping {
                    self.out.push_back(OutMsg::Credit {
                        ping: false,
                        pong: true,
                    });
                }
            }
            Message::Shutdown { stream_end } => {
                if stream_end != self.rx_stream_off {
                    return Err(ProtocolError::StreamOffset {
                        ty,
                        expected: self.rx_stream_off,
                        got: stream_end,
                    });
                }
                if self.rx_eof {
                    return Err(ProtocolError::Unexpected { ty, when: "twice" });
                }
                self.rx_eof = true;
            }
            Message::Abort { code } => self.abort(AbortReason::PeerAbort(code), None),
            Message::Switch { consumed, sent } => self.on_switch(consumed, sent)?,
            Message::Join { tcp_sent } => self.on_join(tcp_sent)?,
        }
        Ok(())
    }

    fn on_hello(&mut self, h: Hello, is_ack: bool) -> Result<(), ProtocolError> {
        let ty = if is_ack {
            MsgType::HelloAck
        } else {
            MsgType::Hello
        };
        let expected = match self.cfg.role {
            Role::Server => !is_ack,
            Role::Client => is_ack,
        };
        if self.state != State::Handshake || !expected {
            return Err(ProtocolError::Unexpected {
                ty,
                when: "in this role or state",
            });
        }
        if h.min_version > wire::VERSION || h.max_version < wire::VERSION {
            return Err(ProtocolError::Unexpected {
                ty,
                when: "with no common version",
            });
        }
        if !is_ack && self.join.defers_hello() {
            // Answered when the driver allows the join (join.rs).
            if !self.join.defer_hello(h) {
                return Err(ProtocolError::Unexpected { ty, when: "twice" });
            }
            return Ok(());
        }
        self.accept_hello(h, is_ack);
        Ok(())
    }

    /// The peer's HELLO (or HELLO_ACK) checked: take its parameters, and
    /// the connection is established.
    fn accept_hello(&mut self, h: Hello, is_ack: bool) {
        let payload = u64::from(h.slot_size) - wire::HEADER_LEN as u64;
        let sink = h.features & wire::features::ZCOPY_SINK != 0;
        let cow = h.features & wire::features::COW_LOCK != 0 && self.cfg.caps.cas;
        let max_outstanding = if sink {
            self.cfg.max_outstanding.min(h.lock_slots)
        } else {
            0
        };
        self.peer = Some(Peer {
            hello: h,
            max_payload: payload,
            max_outstanding,
            cow,
        });
        self.credits = u32::from(h.credits);
        self.slot_gen = vec![0; usize::from(h.lock_slots)];
        self.slot_busy = vec![false; usize::from(h.lock_slots)];
        self.mode = if !(sink && self.cfg.caps.zcopy_source) || max_outstanding == 0 {
            self.counters.fallback_reason = Some(FallbackReason::NoZeroCopy);
            TxMode::Buffered
        } else if !self.cfg.async_zcopy {
            TxMode::Sync
        } else if !self.cfg.caps.protect_send {
            self.counters.fallback_reason = Some(FallbackReason::NoProtection);
            TxMode::Sync
        } else if !cow {
            // Without the peer's lock words a write to an in-flight page could
            // only wait for the peer application to read: no asynchrony.
            self.counters.fallback_reason = Some(FallbackReason::NoCopyOnWrite);
            TxMode::Sync
        } else {
            TxMode::Async
        };
        if !is_ack {
            self.out.push_back(OutMsg::HelloAck);
        }
        if let Some(tcp_sent) = self.join.tx_sent() {
            // Joined before the handshake: JOIN follows it.
            self.out.push_back(OutMsg::Join { tcp_sent });
        }
        self.state = State::Established;
    }

    /// A fabric or host operation finished.
    pub fn handle_completion(
        &mut self,
        now: Timestamp,
        op: OpId,
        result: Completion,
        mem: &mut dyn UserMemory,
    ) {
        self.now = now;
        let Some(kind) = self.ops.remove(&op) else {
            debug_assert!(false, "completion for unknown op {op:?}");
            return;
        };
        let r = match (kind, result) {
            (OpKind::Prepare { avail }, Completion::Prepared(r)) => {
                self.on_prepared(avail, r);
                Ok(())
            }
            (OpKind::CowCas { avail }, Completion::Cas(r)) => self.on_cow_cas(avail, r),
            (OpKind::Copy { avail, len }, Completion::Copied(r)) => {
                self.on_copied(avail, len, r);
                Ok(())
            }
            (OpKind::LockTake { avail }, Completion::Cas(r)) => self.on_lock_taken(avail, r),
            (
                OpKind::LockRelease {
                    avail,
                    expect,
                    finished,
                },
                Completion::Cas(r),
            ) => self.on_lock_released(avail, expect, finished, r),
            (
                OpKind::Arm {
                    avail,
                    call,
                    range,
                    src,
                },
                Completion::Armed(r),
            ) => {
                self.on_armed(avail, call, range, src, r);
                Ok(())
            }
            (OpKind::Get { avail, call, armed }, Completion::Get(r)) => {
                self.on_get_done(avail, call, armed, r);
                Ok(())
            }
            (OpKind::PoolAlloc { avail, len }, Completion::Pooled(r)) => {
                self.on_pooled(avail, len, r);
                Ok(())
            }
            (OpKind::GetAhead { avail, at, len }, Completion::Get(r)) => {
                self.on_got_ahead(avail, at, len, r);
                Ok(())
            }
            (kind, result) => {
                debug_assert!(false, "completion {result:?} does not match {kind:?}");
                Ok(())
            }
        };
        if let Err(e) = r {
            self.abort(e, Some(AbortCode::ProtocolError));
        }
        self.progress(mem);
    }

    // ----- faults and memory lifetime --------------------------------------

    /// The application touched `addr` and faulted. The driver resumes the
    /// access when it sees [`Action::Resume`] for `ticket`.
    pub fn handle_fault(&mut self, now: Timestamp, ticket: Ticket, addr: u64, access: Access) {
        self.now = now;
        let page = self.page();
        let range = pages::page_down(addr, page)..pages::page_down(addr, page) + page;
        let write_prot = access == Access::Write && self.send_prot.overlaps(&range);
        let armed = self.armed.overlaps(&range);
        if !write_prot && !armed {
            self.counters.spurious_faults += 1;
            self.push(Action::Resume { ticket });
            return;
        }
        if write_prot {
            self.counters.send_faults += 1;
            for a in self.out_avails.values_mut() {
                if a.protects(&range) {
                    a.faults += 1;
                }
            }
            if self.cfg.write_fault == FaultPolicy::Copy || self.cfg.block_escalate.is_zero() {
                self.evacuate_range(&range);
            }
        }
        if armed {
            self.counters.recv_faults += 1;
        }
        self.waiters.push(Waiter {
            ticket,
            range,
            access,
            since: now,
            escalated: self.cfg.write_fault == FaultPolicy::Copy,
        });
    }

    /// The application is about to free, unmap, remap or discard `range`:
    /// everything in flight on it must finish or move first. The driver
    /// proceeds when it sees [`Action::Resume`] for `ticket`.
    pub fn evacuate(
        &mut self,
        now: Timestamp,
        ticket: Ticket,
        range: Range<u64>,
        mem: &mut dyn UserMemory,
    ) {
        self.now = now;
        self.evacuate_range(&range);
        self.waiters.push(Waiter {
            ticket,
            range,
            access: Access::Write,
            since: now,
            escalated: true,
        });
        self.progress(mem);
    }

    /// Is `r` (application memory) unsafe to touch from the engine right now:
    /// protected by us, or released by an action the driver has not run yet?
    /// In the second case, ask to be polled again once it has.
    fn memory_busy(&mut self, r: &Range<u64>, write: bool) -> bool {
        if self.armed.overlaps(r) || (write && self.send_prot.overlaps(r)) {
            return true;
        }
        let pending = self.actions.iter().any(|a| match a {
            Action::Unprotect { range } => write && pages::overlaps(range, r),
            Action::Disarm { range, .. } => pages::overlaps(range, r),
            _ => false,
        });
        if pending {
            self.repoll = true;
        }
        pending
    }

    /// Resume every waiter whose range is ordinary memory again.
    fn wake_waiters(&mut self) {
        let mut i = 0;
        while i < self.waiters.len() {
            let w = &self.waiters[i];
            let blocked = self.armed.overlaps(&w.range)
                || (w.access == Access::Write && self.send_prot.overlaps(&w.range));
            if blocked {
                i += 1;
            } else {
                let w = self.waiters.swap_remove(i);
                self.push(Action::Resume { ticket: w.ticket });
            }
        }
    }

    // ----- progress and teardown -----------------------------------------

    /// Run every state machine as far as it can go.
    fn progress(&mut self, mem: &mut dyn UserMemory) {
        // Loop because each side can unblock the other (a recv's evacuation
        // frees a send's pages; a send's buffer space frees credits...).
        for _ in 0..8 {
            let before = (
                self.actions.len(),
                self.out.len(),
                self.send_calls.len(),
                self.recv_calls.len(),
            );
            self.progress_sends(mem);
            self.pump_tx();
            self.progress_recvs(mem);
            self.release_idle_locks();
            self.maybe_return_credits();
            self.wake_waiters();
            self.progress_switch();
            self.read_ahead();
            let after = (
                self.actions.len(),
                self.out.len(),
                self.send_calls.len(),
                self.recv_calls.len(),
            );
            if before == after {
                break;
            }
        }
        self.owing_since = match (self.owes_liveness(), self.owing_since) {
            (true, None) => Some(self.now),
            (true, since) => since,
            (false, _) => None,
        };
    }

    /// Since when the peer's silence counts: its last word, or when it
    /// began to owe us something, whichever came later.
    fn silent_since(&self) -> Timestamp {
        self.owing_since
            .map_or(self.last_rx, |o| o.max(self.last_rx))
    }

    /// Return freed receive slots in batches of half the window. That is
    /// enough for a sender that keeps sending: while fewer than half are
    /// unreported, it holds more than half of them. Returning each slot as
    /// soon as it is free would make a fast reader answer every DATA with a
    /// CREDIT and a blocked writer wake once per message (lock-step). Once
    /// the peer has shut down its side it sends nothing that would bring
    /// the count to half, and its close waits for the last ones: they go
    /// back as soon as everything is read.
    fn maybe_return_credits(&mut self) {
        if self.unreported == 0 || self.state != State::Established || self.switch != Switch::No {
            return;
        }
        let half = (u32::from(self.cfg.rx_credits) / 2).max(1);
        let drained = self.rx_eof && self.rx_msgs.is_empty();
        let already_queued = !self.out.is_empty();
        if !already_queued && (self.unreported >= half || drained) {
            self.out.push_back(OutMsg::Credit {
                ping: false,
                pong: false,
            });
        }
    }

    /// Forget what our stream held, sent or not (an abort, or a switch
    /// whose resend carried it).
    fn drop_tx_stream(&mut self) {
        self.txq.clear();
        self.txbuf.clear();
        self.tx_unposted = 0;
        self.retained.clear();
        self.emitted_unacked = 0;
        self.posted.clear();
    }

    /// Forget what the peer's stream held that was not consumed.
    /// Bytes that arrived from the peer before it died and our program
    /// has not read yet, after an orphan switch (read before the TCP
    /// socket); 0 otherwise.
    pub fn rx_tail(&self) -> u64 {
        if self.orphaned && self.state == State::Switched {
            self.readable_bytes()
        } else {
            0
        }
    }

    /// Did this side move the stream onto TCP alone, for the heirs of a
    /// peer process that died?
    pub fn orphaned(&self) -> bool {
        self.orphaned
    }

    fn drop_rx_stream(&mut self) {
        self.free_all_ahead();
        self.rxq.clear();
        self.rxbuf.clear();
        self.rx_msgs.clear();
        self.in_avails.clear();
    }

    /// Tear the connection down: tell the peer (if `code`), cut its access,
    /// release every page, fail every call.
    fn abort(&mut self, reason: AbortReason, code: Option<AbortCode>) {
        if self.is_aborted() || self.state == State::Switched {
            return;
        }
        // Begun on TCP and nothing went on the fabric either way (the peer
        // left, or never took the pair up): the stream goes on over TCP
        // (join.rs). (A peer breaking the protocol is still an error.)
        if !matches!(reason, AbortReason::Protocol(_)) && self.stay_on_tcp_if_unjoined() {
            return;
        }
        if matches!(
            reason,
            AbortReason::PeerTimeout | AbortReason::LingerTimeout
        ) {
            self.stalled = Some(self.describe_waits());
        }
        // The end of the stream only if the program had read up to it:
        // bytes before it that the abort drops were lost, which an EOF
        // would hide.
        self.aborted_after_eof = self.rx_eof && self.rxq.is_empty();
        self.state = State::Aborted(reason);
        let err = self.abort_error().expect("aborted");
        self.out.clear();
        if let Some(code) = code {
            self.out.push_back(OutMsg::Abort(code));
        }
        self.push(Action::RevokeAccess);
        // Send side: every advertisement ends here.
        let ids: Vec<u32> = self.out_avails.keys().copied().collect();
        for id in ids {
            self.drop_out_avail(id);
        }
        self.drop_tx_stream();
        for call in std::mem::take(&mut self.send_calls) {
            if call.waiting_prepare.is_none() {
                let result = if call.accepted > 0 {
                    Ok(call.accepted)
                } else {
                    Err(err)
                };
                self.push(Action::CallDone {
                    call: call.call,
                    result,
                });
            } else {
                // Its PrepareSource is still out; finish the call when it returns.
                self.send_calls.push_back(call);
            }
        }
        // Receive side: armed pages will never get their data.
        for r in self.armed.ranges() {
            let _ = self.armed.remove(r.clone());
            self.counters.armed_lost_bytes += r.end - r.start;
            self.push(Action::Disarm {
                range: r,
                outcome: DisarmOutcome::Lost,
            });
        }
        self.drop_rx_stream();
        let calls = std::mem::take(&mut self.recv_calls);
        for mut call in calls {
            call.failed = true;
            if call.gets == 0 && call.pending_arm == 0 {
                self.error_reported = true;
                self.push(Action::CallDone {
                    call: call.call,
                    result: Err(err),
                });
            } else {
                // Its GETs write into the buffer until they complete.
                self.recv_calls.push_back(call);
            }
        }
        self.wake_waiters();
    }
}

#[cfg(test)]
mod tests;
