//! A peer that sends arbitrary messages: an established engine (and one in
//! its handshake) must never panic, whatever arrives, and must end up either
//! still established or aborted with every page released.
#![no_main]

use azsdp::conn::{
    Action, Capabilities, CallId, Completion, Connection, EngineConfig, LockRegion, RecvFlags,
    RemoteBuf, Role, SendFlags, State, UserBuf,
};
use azsdp::sim::memory::FlatMemory;
use azsdp::time::Timestamp;
use azsdp::wire::{self, Frame, Hello, Message};
use libfuzzer_sys::fuzz_target;

fn cfg(role: Role) -> EngineConfig {
    EngineConfig::new(role, Capabilities::ALL, LockRegion { addr: 0x1000, key: 7, slots: 4 })
}

/// Answer every operation at once, successfully, as a driver would.
fn drive(c: &mut Connection, mem: &mut FlatMemory) {
    let t = Timestamp::ZERO;
    let mut out = vec![0u8; c.max_message_len()];
    for _ in 0..1000 {
        while c.poll_transmit(&mut out).is_some() {}
        let Some(a) = c.poll_action() else { return };
        let done = match a {
            Action::PrepareSource { op, .. } => Some((op, Completion::Prepared(Ok(5)))),
            Action::Arm { op, .. } => Some((op, Completion::Armed(Ok(())))),
            Action::Get { op, .. } => Some((op, Completion::Get(Ok(())))),
            Action::Cas { op, expect, .. } => Some((op, Completion::Cas(Ok(expect)))),
            Action::CopyAside { op, .. } => {
                Some((op, Completion::Copied(Ok(RemoteBuf { addr: 0xc0000, key: 6 }))))
            }
            _ => None,
        };
        if let Some((op, r)) = done {
            c.handle_completion(t, op, r, mem);
        }
    }
}

fuzz_target!(|data: &[u8]| {
    let mut mem = FlatMemory::new(1 << 20);
    let t = Timestamp::ZERO;
    // Half the inputs start from an established connection with work in
    // flight; half begin on TCP (JOIN's rules), and join half the time.
    let established = data.first().is_some_and(|b| b & 1 == 1);
    let joining = data.first().is_some_and(|b| b & 2 == 2);
    let mut config = cfg(Role::Server);
    config.joins_from_tcp = joining;
    let mut c = Connection::new(config, t);
    if joining && data.first().is_some_and(|b| b & 4 == 4) {
        c.join_tx(t, 1000);
    }
    // A listener begun on TCP answers HELLO only once allowed; half the
    // joining inputs allow it (the rest stay in the handshake).
    if joining && data.first().is_some_and(|b| b & 8 == 8) {
        c.allow_join(t);
    }
    let mut seq = 0u32;
    if established {
        let hello = Hello {
            min_version: 1,
            max_version: 1,
            page_size: 4096,
            features: wire::features::ALL,
            credits: 8,
            lock_slots: 4,
            slot_size: 4096,
            lock_addr: 0x2000,
            lock_key: 9,
            max_avail: 1 << 20,
        };
        let f = Frame { seq, credits: 0, msg: Message::Hello(hello) };
        let mut buf = vec![0u8; f.wire_len()];
        wire::emit(&f, &mut buf).unwrap();
        c.handle_message(t, &buf, &mut mem);
        seq += 1;
        let flags = SendFlags { nonblocking: false, protectable: true, unprotectable: None };
        c.send(t, CallId(1), UserBuf { addr: 0x10000, len: 300_000 }, flags, &mut mem);
        c.recv(t, CallId(2), UserBuf { addr: 0x80000, len: 100_000 }, RecvFlags::default(), &mut mem);
        drive(&mut c, &mut mem);
    }
    // Messages: 2-byte length prefixes; each gets the right sequence number
    // half the time so that the fuzzer reaches the message handlers.
    let mut rest = &data[1.min(data.len())..];
    while rest.len() >= 2 {
        let len = usize::from(u16::from_le_bytes([rest[0], rest[1]])) % 512;
        rest = &rest[2..];
        let mut msg = rest[..len.min(rest.len())].to_vec();
        rest = &rest[len.min(rest.len())..];
        if msg.len() >= 8 && msg[0] & 1 == 0 {
            msg[4..8].copy_from_slice(&seq.to_be_bytes());
        }
        if msg.len() >= 16 {
            msg[0] = wire::VERSION;
            let n = msg.len() as u32;
            msg[4..8].copy_from_slice(&n.to_be_bytes());
            msg[8..12].copy_from_slice(&seq.to_be_bytes());
        }
        c.handle_message(t, &msg, &mut mem);
        seq = seq.wrapping_add(1);
        drive(&mut c, &mut mem);
    }
    if matches!(c.state(), State::Aborted(_)) {
        assert!(c.protected_ranges().is_empty());
        assert!(c.armed_ranges().is_empty());
    }
});
