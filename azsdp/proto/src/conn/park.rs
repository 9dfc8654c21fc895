//! Parking a connection: its engine as plain data, so that another image
//! of the process (the program it `exec`s) takes it up where this one
//! stopped, on the same fabric connection, without the peer noticing.
//!
//! Only a *quiet* connection parks ([`Connection::park_blocker`]): no call
//! in progress, no operation in flight, none of this side's application
//! memory advertised, protected or armed, no fault waiting. What is left
//! is the engine's own state (sequence numbers, credits, stream offsets,
//! the bytes it buffers each way, the peer's advertisements not yet read,
//! counters), none of which names this image's memory. The peer's
//! advertisements stay valid: they name the peer's memory, which the exec
//! does not touch.

use thiserror::Error;

use super::{Connection, State, Switch};

/// What a parked connection's state is set to on the way back (only an
/// established connection parks).
pub(super) fn established() -> State {
    State::Established
}

/// Why a connection cannot be parked now.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Error)]
pub enum Unparkable {
    #[error("the handshake is not over, or the connection has ended")]
    NotEstablished,
    #[error("the connection is leaving the fabric")]
    Leaving,
    #[error("calls are in progress")]
    Calls,
    #[error("fabric operations are in flight")]
    InFlight,
    #[error("application memory is advertised to the peer")]
    Advertised,
    #[error("application memory is protected or armed")]
    Protected,
    #[error("faults wait for the engine")]
    Faults,
    #[error("the application closed it")]
    Closed,
}

impl Connection {
    /// What keeps the connection from parking now (`None`: it may park).
    /// A driver that wants to park stops new calls and arms, and waits for
    /// this to clear (the peer finishing its reads of our pages).
    pub fn park_blocker(&self) -> Option<Unparkable> {
        if self.state != State::Established {
            return Some(Unparkable::NotEstablished);
        }
        if self.switch != Switch::No || self.peer_switch.is_some() {
            return Some(Unparkable::Leaving);
        }
        if !self.send_calls.is_empty() || !self.recv_calls.is_empty() {
            return Some(Unparkable::Calls);
        }
        if !self.ops.is_empty() || !self.actions.is_empty() {
            return Some(Unparkable::InFlight);
        }
        if !self.out_avails.is_empty() {
            return Some(Unparkable::Advertised);
        }
        // (Staging memory does not survive an exec. Read-ahead runs over
        // verbs only, whose connections do not park.)
        if self.in_avails.values().any(|a| a.ahead.is_some()) {
            return Some(Unparkable::InFlight);
        }
        if !self.armed.is_empty() || !self.send_prot.is_empty() {
            return Some(Unparkable::Protected);
        }
        if !self.waiters.is_empty() {
            return Some(Unparkable::Faults);
        }
        if self.app_closed || self.linger_deadline.is_some() {
            return Some(Unparkable::Closed);
        }
        None
    }

    /// Checks on a connection read back from parked bytes (they come from
    /// this process's previous image, but a mismatch of builds, or memory
    /// gone wrong, must give an error, not a broken engine).
    pub(crate) fn check_unparked(&self) -> Result<(), &'static str> {
        let slots = usize::from(self.cfg.lock_region.slots);
        if !self.cfg.page_size.is_power_of_two() {
            return Err("page size");
        }
        if self.my_slot_gen.len() != slots || self.my_slot_user.len() != slots {
            return Err("lock slots");
        }
        if self.slot_gen.len() != self.slot_busy.len() {
            return Err("peer lock slots");
        }
        if self.peer.is_none() {
            return Err("no peer");
        }
        if self.rx_msgs.iter().sum::<u64>() > self.rxbuf.len() as u64 {
            return Err("receive buffer");
        }
        if self.tx_unposted > self.txbuf.len() as u64 {
            return Err("send buffer");
        }
        if self.switch != Switch::No {
            return Err("switch state");
        }
        Ok(())
    }
}

impl Connection {
    /// Move the engine's clock to `now` (a new image's host counts from
    /// another epoch): what was `self.now` becomes `now`, and the times
    /// kept are shifted with it, so no timer fires early or late.
    pub(crate) fn rebase_clock(&mut self, now: crate::time::Timestamp) {
        // How long before the old `now` the last message came, before the
        // new one (the only time kept besides `now` in a parked engine).
        let ago = self.now.0.saturating_sub(self.last_rx.0);
        self.last_rx = crate::time::Timestamp(now.0.saturating_sub(ago));
        self.now = now;
    }
}
