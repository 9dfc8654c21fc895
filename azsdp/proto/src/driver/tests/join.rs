//! Joining the fabric from TCP: receives follow the route the peer's JOIN
//! sets, calls on a direction still on TCP go there, and a peer that breaks
//! the rule is a protocol error.

use super::*;
use crate::conn::{Connection, RxRoute};
use crate::sim::memory::FlatMemory;
use crate::wire;

fn joining(role: Role) -> EngineConfig {
    let mut c = cfg(role);
    c.joins_from_tcp = true;
    c
}

fn joining_pair() -> Pair {
    Pair::new(joining(Role::Client), joining(Role::Server))
}

#[test]
fn receives_read_tcp_until_the_peers_join_then_the_fabric() {
    let mut p = joining_pair();
    // No JOIN yet: read TCP, and wait for either.
    assert_eq!(p.d[1].rx_route(), RxRoute::Tcp { left: None });
    p.d[0].join_tx(100);
    let (s, data) = p.send_pattern(0, 50, 3);
    assert_eq!(p.poll(0, s), Some(Ok(50)));
    assert_eq!(p.d[1].rx_route(), RxRoute::Tcp { left: Some(100) });
    // The fabric's bytes wait behind the TCP part.
    let r = p.recv(1, DST, 4096);
    assert_eq!(p.poll(1, r), Some(Err(CallError::OnTcp)));
    p.d[1].took_from_tcp(60).unwrap();
    assert_eq!(p.d[1].rx_route(), RxRoute::Tcp { left: Some(40) });
    p.d[1].took_from_tcp(40).unwrap();
    assert_eq!(p.d[1].rx_route(), RxRoute::Fabric);
    let r = p.recv(1, DST, 4096);
    assert_eq!(p.wait(1, r), Ok(50));
    assert_eq!(p.read(1, DST, 50), data);
    // The engine counts its own bytes; the TCP part is counted apart.
    assert_eq!(p.counters(0).bytes_sent(), 50);
    assert_eq!(p.counters(0).tcp_sent_before_join, 100);
    assert_eq!(p.counters(1).tcp_received_before_join, 100);
}

#[test]
fn a_side_that_has_not_joined_sends_on_tcp() {
    let mut p = joining_pair();
    assert!(!p.d[0].connection().tx_joined());
    let (s, _) = p.send_pattern(0, 10, 1);
    assert_eq!(p.poll(0, s), Some(Err(CallError::OnTcp)));
    p.d[0].join_tx(0);
    assert!(p.d[0].connection().tx_joined());
    let (s, data) = p.send_pattern(0, 10, 1);
    assert_eq!(p.poll(0, s), Some(Ok(10)));
    // Nothing went over TCP: the peer reads the fabric at once.
    assert_eq!(p.d[1].rx_route(), RxRoute::Fabric);
    let r = p.recv(1, DST, 100);
    assert_eq!(p.wait(1, r), Ok(10));
    assert_eq!(p.read(1, DST, 10), data);
}

#[test]
fn the_end_of_a_joined_stream_comes_after_its_tcp_part() {
    let mut p = joining_pair();
    p.d[0].join_tx(7);
    p.d[0].shutdown(Shutdown::Write);
    p.run_for(Duration::from_millis(1));
    assert_eq!(p.d[1].rx_route(), RxRoute::Tcp { left: Some(7) });
    p.d[1].took_from_tcp(7).unwrap();
    let r = p.recv(1, DST, 100);
    assert_eq!(p.wait(1, r), Ok(0), "then the end of the stream");
}

#[test]
fn more_from_tcp_than_the_join_said_resets() {
    let mut p = joining_pair();
    p.d[0].join_tx(10);
    p.run_for(Duration::from_millis(1));
    assert_eq!(p.d[1].took_from_tcp(11), Err(CallError::ConnReset));
    assert!(matches!(p.d[1].connection().state(), State::Aborted(_)));
}

#[test]
fn a_join_saying_less_than_already_arrived_is_a_protocol_error() {
    let mut p = joining_pair();
    p.d[1].took_from_tcp(10).unwrap();
    p.d[0].join_tx(9);
    p.run_for(Duration::from_millis(1));
    assert!(
        matches!(
            p.d[1].connection().state(),
            State::Aborted(AbortReason::Protocol(_))
        ),
        "{:?}",
        p.d[1].connection().state()
    );
}

#[test]
fn data_before_the_peers_join_and_a_join_nobody_expects_are_errors() {
    // Side 1 began on the fabric, side 0 on TCP: side 1's DATA comes
    // without a JOIN, and side 0's JOIN is one side 1 never expects.
    let mut p = Pair::new(joining(Role::Client), cfg(Role::Server));
    let (s, _) = p.send_pattern(1, 10, 2);
    assert_eq!(p.poll(1, s), Some(Ok(10)));
    assert!(
        matches!(
            p.d[0].connection().state(),
            State::Aborted(AbortReason::Protocol(_))
        ),
        "{:?}",
        p.d[0].connection().state()
    );
    let mut p = Pair::new(joining(Role::Client), cfg(Role::Server));
    p.d[0].join_tx(0);
    p.run_for(Duration::from_millis(1));
    assert!(
        matches!(
            p.d[1].connection().state(),
            State::Aborted(AbortReason::Protocol(_))
        ),
        "{:?}",
        p.d[1].connection().state()
    );
}

/// The listener commits (and joins, having sent nothing) before the
/// client's HELLO is in: its JOIN must follow its HELLO_ACK.
#[test]
fn a_server_that_joins_before_the_handshake_sends_join_after_hello_ack() {
    let mut mem = FlatMemory::new(4096);
    let now = Timestamp::ZERO;
    let mut client = Connection::new(joining(Role::Client), now);
    let mut server = Connection::new(joining(Role::Server), now);
    server.join_tx(now, 0);
    server.allow_join(now);
    let mut buf = vec![0u8; 1 << 16];
    assert_eq!(server.poll_transmit(&mut buf), None, "nothing before HELLO");
    let n = client.poll_transmit(&mut buf).expect("HELLO");
    server.handle_message(now, &buf[..n], &mut mem);
    let mut types = Vec::new();
    while let Some(n) = server.poll_transmit(&mut buf) {
        types.push(wire::parse(&buf[..n]).unwrap().msg.msg_type());
        client.handle_message(now, &buf[..n], &mut mem);
    }
    assert_eq!(types, [wire::MsgType::HelloAck, wire::MsgType::Join]);
    assert_eq!(*client.state(), State::Established);
    assert_eq!(client.rx_route(), RxRoute::Fabric);
}

/// Until the listener allows it, the client's HELLO goes unanswered (so the
/// client never joins); then the handshake completes.
#[test]
fn the_listener_answers_once_it_allows_the_join() {
    let mut mem = FlatMemory::new(4096);
    let now = Timestamp::ZERO;
    let mut client = Connection::new(joining(Role::Client), now);
    let mut server = Connection::new(joining(Role::Server), now);
    let mut buf = vec![0u8; 1 << 16];
    let n = client.poll_transmit(&mut buf).expect("HELLO");
    server.handle_message(now, &buf[..n], &mut mem);
    assert_eq!(server.poll_transmit(&mut buf), None, "no HELLO_ACK yet");
    assert!(!server.established());
    server.allow_join(now);
    let n = server.poll_transmit(&mut buf).expect("HELLO_ACK");
    client.handle_message(now, &buf[..n], &mut mem);
    assert!(client.established() && server.established());
}

/// A listener that forks the connection before the handshake forbids the
/// join: no HELLO_ACK ever goes, and leaving needs no SWITCH (nothing went
/// on the fabric); after the handshake it is too late to forbid.
#[test]
fn a_forbidden_join_stays_on_tcp_without_a_handshake() {
    let mut mem = FlatMemory::new(4096);
    let now = Timestamp::ZERO;
    let mut client = Connection::new(joining(Role::Client), now);
    let mut server = Connection::new(joining(Role::Server), now);
    let mut buf = vec![0u8; 1 << 16];
    let n = client.poll_transmit(&mut buf).expect("HELLO");
    server.handle_message(now, &buf[..n], &mut mem);
    assert!(server.forbid_join());
    server.allow_join(now);
    assert_eq!(server.poll_transmit(&mut buf), None, "never answered");
    server.leave_fabric(now, &mut mem);
    assert_eq!(*server.state(), State::Switched);
    assert_eq!(server.poll_transmit(&mut buf), None, "no SWITCH either");
    client.leave_fabric(now, &mut mem);
    assert_eq!(*client.state(), State::Switched);
    // Established: too late.
    let mut p = joining_pair();
    assert!(!p.d[1].forbid_join());
}

/// A stream that ends before its side joined (the peer has not joined
/// either) ends on TCP: no SHUTDOWN on the fabric, and it never joins.
#[test]
fn a_stream_that_ends_before_it_joined_stays_on_tcp() {
    let mut p = joining_pair();
    p.d[0].shutdown(Shutdown::Write);
    p.d[0].join_tx(5);
    p.run_for(Duration::from_millis(1));
    assert!(!p.d[0].connection().tx_joined());
    assert_eq!(p.d[1].rx_route(), RxRoute::Tcp { left: None });
    assert_eq!(p.counters(1).msgs_received, 1, "only the HELLO");
}

/// A peer that leaves (dies, abandons the pair) before anything joined
/// either way takes nothing with it: the stream is all on TCP and goes on
/// there, not a reset. Once something joined, a departure is as before.
#[test]
fn a_peer_gone_before_anything_joined_leaves_the_stream_on_tcp() {
    for joined in [false, true] {
        let mut mem = FlatMemory::new(4096);
        let now = Timestamp::ZERO;
        let mut client = Connection::new(joining(Role::Client), now);
        let mut server = Connection::new(joining(Role::Server), now);
        server.allow_join(now);
        if joined {
            client.join_tx(now, 3);
        }
        let mut buf = vec![0u8; 1 << 16];
        for _ in 0..4 {
            while let Some(n) = client.poll_transmit(&mut buf) {
                server.handle_message(now, &buf[..n], &mut mem);
            }
            while let Some(n) = server.poll_transmit(&mut buf) {
                client.handle_message(now, &buf[..n], &mut mem);
            }
        }
        assert!(client.established() && server.established());
        server.handle_peer_gone(now);
        if joined {
            assert!(matches!(server.state(), State::Aborted(_)), "{joined}");
        } else {
            assert_eq!(*server.state(), State::Switched);
        }
    }
}
