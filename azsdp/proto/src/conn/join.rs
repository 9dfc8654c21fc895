//! Joining the fabric from the TCP connection beneath (docs/protocol.md §8b).
//!
//! A connection paired after `connect()`/`accept()` returned starts on TCP,
//! and each direction moves onto the fabric on its own. A side joins its
//! sending direction once ([`Connection::join_tx`]): it stops writing to
//! TCP and sends JOIN(tcp_sent), the length of its stream that went over
//! TCP, before any byte of its stream on the fabric. The receiving side reads
//! TCP until it has taken that many bytes (it reports them,
//! [`Connection::took_from_tcp`]), then the fabric. Until the JOIN is in, it
//! reads TCP and waits for either. Stream offsets on the fabric count from
//! the join: SHUTDOWN, SWITCH and the counters never include the TCP part.
//!
//! This is the reverse of leaving (switch.rs): there the fabric's stream
//! goes on over TCP from an offset both sides know; here TCP's goes on over
//! the fabric from an offset the JOIN says.

use super::{CallError, Connection, OutMsg, ProtocolError};
use crate::wire::MsgType;

/// Where the application's next receive reads from.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum RxRoute {
    /// The TCP connection. `left`: bytes of the peer's TCP part still to
    /// read there, or `None` if the peer has not joined (its stream goes on
    /// over TCP until its JOIN says where it ends: wait for TCP or for the
    /// connection, whichever comes first).
    Tcp { left: Option<u64> },
    /// The fabric (the engine's `recv`).
    Fabric,
}

/// One connection's join: both directions' TCP parts. Not joining: every
/// field stays as made, and both routes are the fabric.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub(super) struct Join {
    /// The connection began on TCP (both sides pair this way, or neither).
    joining: bool,
    /// Our JOIN: how much of our stream went over TCP (`None`: our sends
    /// still go there).
    tx: Option<u64>,
    /// The peer's JOIN.
    peer: Option<u64>,
    /// Bytes of the peer's stream our application took from TCP.
    taken: u64,
    /// The listener's side: may the client join? (HELLO_ACK waits for it;
    /// `Some(false)`: never, the connection stays on TCP.)
    allowed: Option<bool>,
    /// The client's HELLO, while HELLO_ACK waits.
    #[serde(skip)]
    hello: Option<crate::wire::Hello>,
}

impl Join {
    pub(super) fn new(joining: bool) -> Join {
        Join {
            joining,
            ..Join::default()
        }
    }

    /// Does a HELLO wait for the driver's word (see [`Connection::allow_join`])?
    pub(super) fn defers_hello(&self) -> bool {
        self.joining && self.allowed != Some(true)
    }

    /// The client never joins: no HELLO is answered from now on.
    fn forbid(&mut self) {
        self.allowed = Some(false);
        self.hello = None;
    }

    /// Keep the HELLO for later; false if one is kept already.
    pub(super) fn defer_hello(&mut self, h: crate::wire::Hello) -> bool {
        self.hello.replace(h).is_none()
    }

    /// Our JOIN's count, once we joined.
    pub(super) fn tx_sent(&self) -> Option<u64> {
        self.tx
    }

    /// May our stream go on the fabric (sends, SHUTDOWN)?
    pub(super) fn tx_on_fabric(&self) -> bool {
        !self.joining || self.tx.is_some()
    }

    pub(super) fn route(&self) -> RxRoute {
        if !self.joining {
            return RxRoute::Fabric;
        }
        match self.peer {
            None => RxRoute::Tcp { left: None },
            Some(n) if self.taken < n => RxRoute::Tcp {
                left: Some(n - self.taken),
            },
            Some(_) => RxRoute::Fabric,
        }
    }

    /// Must the peer's message of type `ty` wait for its JOIN (a message of
    /// its stream, or one about its advertisements)?
    fn needs_peer_join(&self, ty: MsgType) -> bool {
        self.joining
            && self.peer.is_none()
            && matches!(
                ty,
                MsgType::Data
                    | MsgType::SrcAvail
                    | MsgType::SrcAvailUpdate
                    | MsgType::SrcAvailCancel
                    | MsgType::Shutdown
            )
    }
}

impl Connection {
    /// The listener's side: the client may join now (the process that
    /// runs the connection is the only one that holds it). Until then a
    /// client's HELLO goes unanswered, and a client joins only once
    /// answered: a listener that forks the connection first keeps it on
    /// TCP with [`Connection::forbid_join`], no handshake needed.
    pub fn allow_join(&mut self, now: crate::time::Timestamp) {
        self.now = now;
        if !self.join.joining || self.join.allowed.is_some() {
            return;
        }
        self.join.allowed = Some(true);
        if let Some(h) = self.join.hello.take()
            && self.state == super::State::Handshake
        {
            self.accept_hello(h, false);
        }
    }

    /// The listener's side: the client must never join (forked processes
    /// share the connection, and could not agree on what went over TCP).
    /// True if it never will (no HELLO_ACK went); false if the handshake
    /// is done, and the connection must leave the fabric instead.
    pub fn forbid_join(&mut self) -> bool {
        if !self.join.joining || self.state != super::State::Handshake {
            return false;
        }
        self.join.forbid();
        true
    }

    /// Leave for TCP at once if the handshake is not done (or the engine
    /// ended) and nothing joined either way: no SWITCH is needed, and none
    /// goes (`stay_on_tcp_if_unjoined`). Whether it did.
    /// A peer still in its handshake is told (ABORT `StaysOnTcp`), so that
    /// it drops its side at once rather than wait for an answer.
    pub fn stay_on_tcp_now(&mut self, now: crate::time::Timestamp) -> bool {
        self.now = now;
        let handshake = self.state == super::State::Handshake;
        if !(handshake || self.is_aborted()) || !self.stay_on_tcp_if_unjoined() {
            return false;
        }
        if handshake {
            self.out
                .push_back(super::OutMsg::Abort(crate::wire::AbortCode::StaysOnTcp));
        }
        true
    }

    /// A connection begun on TCP with nothing joined either way has its
    /// whole stream on TCP: it is on TCP from now on, with no SWITCH, and
    /// neither side joins (the listener answers no HELLO, and a client
    /// joins only once answered). Whether it was such a connection.
    pub(super) fn stay_on_tcp_if_unjoined(&mut self) -> bool {
        if !self.join.joining || self.join.tx.is_some() || self.join.peer.is_some() {
            return false;
        }
        self.join.forbid();
        self.state = super::State::Switched;
        self.wake_waiters();
        true
    }

    /// The TCP socket beneath was reset (the peer's kernel discarded our
    /// TCP part unread) and the application was told (ECONNRESET): the
    /// connection is over; later sends fail with EPIPE, as TCP's.
    pub fn tcp_reset(&mut self, now: crate::time::Timestamp) {
        self.now = now;
        self.abort(super::AbortReason::PeerGone, None);
        self.error_reported = true;
    }

    /// Is the handshake done (so that a client may join)?
    pub fn established(&self) -> bool {
        self.state == super::State::Established
    }

    /// May our sending direction join now, by §8b's rule: the client once
    /// the handshake is done, the listener once the client's JOIN is in.
    /// (The caller still picks the moment: no send of its under way.)
    pub fn may_join_tx(&self) -> bool {
        match self.cfg.role {
            super::Role::Client => self.established(),
            super::Role::Server => self.join.peer.is_some(),
        }
    }

    /// Our sending direction joins the fabric: `tcp_sent` bytes of our
    /// stream went over TCP, the rest goes here. Once, before any send
    /// through the engine (a second call, or one on a connection that did
    /// not begin on TCP, is ignored).
    pub fn join_tx(&mut self, now: crate::time::Timestamp, tcp_sent: u64) {
        self.now = now;
        if !self.join.joining || self.join.tx.is_some() {
            debug_assert!(self.join.joining, "join_tx on a connection not joining");
            return;
        }
        if self.tx_shutdown != super::TxShutdown::Open {
            // Our stream ended on TCP: it never joins.
            return;
        }
        self.join.tx = Some(tcp_sent);
        self.counters.tcp_sent_before_join = tcp_sent;
        // Before the handshake is done, JOIN follows it (`accept_hello`):
        // nothing but the handshake may come first.
        if self.state == super::State::Established {
            self.out.push_back(OutMsg::Join { tcp_sent });
        }
    }

    /// Has our sending direction joined (or did it begin on the fabric)?
    pub fn tx_joined(&self) -> bool {
        self.join.tx_on_fabric()
    }

    /// Where the application's next receive reads from.
    pub fn rx_route(&self) -> RxRoute {
        self.join.route()
    }

    /// The application took `n` bytes of the peer's stream from TCP (not
    /// peeked). More than the peer's JOIN says went there is a broken
    /// stream: the connection aborts and the caller gets the error.
    pub fn took_from_tcp(&mut self, now: crate::time::Timestamp, n: u64) -> Result<(), CallError> {
        self.now = now;
        self.join.taken += n;
        self.counters.tcp_received_before_join = self.join.taken;
        match self.join.peer {
            Some(end) if self.join.taken > end => {
                self.abort(
                    super::AbortReason::StrayBytes,
                    Some(crate::wire::AbortCode::Reset),
                );
                Err(CallError::ConnReset)
            }
            _ => Ok(()),
        }
    }

    /// Check a message against the join before it is handled.
    pub(super) fn check_join(&self, ty: MsgType) -> Result<(), ProtocolError> {
        if self.join.needs_peer_join(ty) {
            return Err(ProtocolError::Unexpected {
                ty,
                when: "before the peer's JOIN",
            });
        }
        Ok(())
    }

    /// The peer's JOIN: its first `tcp_sent` bytes are on TCP.
    pub(super) fn on_join(&mut self, tcp_sent: u64) -> Result<(), ProtocolError> {
        let ty = MsgType::Join;
        if !self.join.joining {
            return Err(ProtocolError::Unexpected {
                ty,
                when: "on a connection that began on the fabric",
            });
        }
        if self.join.peer.is_some() {
            return Err(ProtocolError::Unexpected { ty, when: "twice" });
        }
        if tcp_sent < self.join.taken {
            // We read more from TCP than it says went there.
            return Err(ProtocolError::Invalid {
                ty,
                why: "says fewer bytes went over TCP than arrived there",
            });
        }
        self.join.peer = Some(tcp_sent);
        Ok(())
    }
}
