//! Direct unit tests of the engine; the simulator (`crate::sim`) covers the
//! protocol under random interleavings.

use super::*;
use crate::sim::memory::FlatMemory;

fn cfg(role: Role) -> EngineConfig {
    EngineConfig::new(
        role,
        Capabilities::ALL,
        LockRegion {
            addr: 0x1000,
            key: 1,
            slots: 4,
        },
    )
}

fn pump(from: &mut Connection, to: &mut Connection, mem: &mut FlatMemory) -> usize {
    let mut n = 0;
    let mut buf = vec![0u8; from.max_message_len()];
    while let Some(len) = from.poll_transmit(&mut buf) {
        to.handle_message(Timestamp::ZERO, &buf[..len], mem);
        n += 1;
    }
    n
}

#[test]
fn handshake_then_bsdp_roundtrip() {
    let mut mem = FlatMemory::new(1 << 16);
    let mut c = Connection::new(cfg(Role::Client), Timestamp::ZERO);
    let mut s = Connection::new(cfg(Role::Server), Timestamp::ZERO);
    assert_eq!(pump(&mut c, &mut s, &mut mem), 1);
    assert_eq!(pump(&mut s, &mut c, &mut mem), 1);
    assert_eq!(*c.state(), State::Established);
    assert_eq!(*s.state(), State::Established);
    assert_eq!(c.tx_mode(), TxMode::Async);

    mem.fill(100, b"hello, world");
    let flags = SendFlags {
        nonblocking: false,
        protectable: true,
    };
    c.send(
        Timestamp::ZERO,
        CallId(1),
        UserBuf { addr: 100, len: 12 },
        flags,
        &mut mem,
    );
    assert_eq!(
        c.poll_action(),
        Some(Action::CallDone {
            call: CallId(1),
            result: Ok(12)
        })
    );
    pump(&mut c, &mut s, &mut mem);
    s.recv(
        Timestamp::ZERO,
        CallId(2),
        UserBuf {
            addr: 1000,
            len: 64,
        },
        RecvFlags::default(),
        &mut mem,
    );
    assert_eq!(
        s.poll_action(),
        Some(Action::CallDone {
            call: CallId(2),
            result: Ok(12)
        })
    );
    assert_eq!(mem.get(1000, 12), b"hello, world");
    assert_eq!(s.counters().bytes_recv_bsdp, 12);
}

#[test]
fn garbage_aborts_without_panic() {
    let mut mem = FlatMemory::new(4096);
    let mut s = Connection::new(cfg(Role::Server), Timestamp::ZERO);
    s.handle_message(Timestamp::ZERO, &[1, 2, 3, 4, 5], &mut mem);
    assert!(matches!(
        s.state(),
        State::Aborted(AbortReason::Protocol(_))
    ));
    // The peer is told why.
    let mut buf = vec![0u8; s.max_message_len()];
    let n = s.poll_transmit(&mut buf).unwrap();
    let f = wire::parse(&buf[..n]).unwrap();
    assert_eq!(
        f.msg,
        Message::Abort {
            code: AbortCode::ProtocolError
        }
    );
}
