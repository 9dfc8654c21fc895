//! The engine alone, where no action needs executing. Its paths, run by
//! the real driver over the simulated fabric, are tested in
//! `driver/tests`; the simulator covers random interleavings.

use super::*;
use crate::sim::memory::FlatMemory;

#[test]
fn garbage_aborts_without_panic() {
    let mut mem = FlatMemory::new(4096);
    let mut s = Connection::new(
        EngineConfig::new(
            Role::Server,
            Capabilities::ALL,
            LockRegion {
                addr: 0,
                key: 1,
                slots: 4,
            },
        ),
        Timestamp::ZERO,
    );
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
