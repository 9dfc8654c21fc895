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

/// Side `s` ended the connection for a protocol error of its peer's.
fn assert_protocol_error(p: &Pair, s: usize) {
    let state = p.d[s].connection().state();
    assert!(
        matches!(state, State::Aborted(AbortReason::Protocol(_))),
        "side {s}: {state:?}"
    );
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
    assert_protocol_error(&p, 1);
}

#[test]
fn data_before_the_peers_join_and_a_join_nobody_expects_are_errors() {
    // Side 1 began on the fabric, side 0 on TCP: side 1's DATA comes
    // without a JOIN, and side 0's JOIN is one side 1 never expects.
    let mut p = Pair::new(joining(Role::Client), cfg(Role::Server));
    let (s, _) = p.send_pattern(1, 10, 2);
    assert_eq!(p.poll(1, s), Some(Ok(10)));
    assert_protocol_error(&p, 0);
    let mut p = Pair::new(joining(Role::Client), cfg(Role::Server));
    p.d[0].join_tx(0);
    p.run_for(Duration::from_millis(1));
    assert_protocol_error(&p, 1);
}

/// Two engines begun on TCP, driven by hand: messages cross only when a
/// test says.
struct Engines {
    mem: FlatMemory,
    now: Timestamp,
    client: Connection,
    server: Connection,
    buf: Vec<u8>,
}

impl Engines {
    fn new() -> Engines {
        let now = Timestamp::ZERO;
        Engines {
            mem: FlatMemory::new(4096),
            now,
            client: Connection::new(joining(Role::Client), now),
            server: Connection::new(joining(Role::Server), now),
            buf: vec![0u8; 1 << 16],
        }
    }

    /// The client's HELLO reaches the listener.
    fn hello(&mut self) {
        let n = self.client.poll_transmit(&mut self.buf).expect("HELLO");
        self.server
            .handle_message(self.now, &self.buf[..n], &mut self.mem);
    }

    /// What the listener sends reaches the client; the types, in order.
    fn server_to_client(&mut self) -> Vec<wire::MsgType> {
        let mut types = Vec::new();
        while let Some(n) = self.server.poll_transmit(&mut self.buf) {
            types.push(wire::parse(&self.buf[..n]).unwrap().msg.msg_type());
            self.client
                .handle_message(self.now, &self.buf[..n], &mut self.mem);
        }
        types
    }

    /// Everything either side has to send crosses, until both are quiet.
    fn exchange(&mut self) {
        for _ in 0..4 {
            while let Some(n) = self.client.poll_transmit(&mut self.buf) {
                self.server
                    .handle_message(self.now, &self.buf[..n], &mut self.mem);
            }
            self.server_to_client();
        }
    }
}

/// The listener commits (and joins, having sent nothing) before the
/// client's HELLO is in: its JOIN must follow its HELLO_ACK.
#[test]
fn a_server_that_joins_before_the_handshake_sends_join_after_hello_ack() {
    let mut e = Engines::new();
    let now = e.now;
    e.server.join_tx(now, 0);
    e.server.allow_join(now);
    assert_eq!(
        e.server.poll_transmit(&mut e.buf),
        None,
        "nothing before HELLO"
    );
    e.hello();
    assert_eq!(
        e.server_to_client(),
        [wire::MsgType::HelloAck, wire::MsgType::Join]
    );
    assert_eq!(*e.client.state(), State::Established);
    assert_eq!(e.client.rx_route(), RxRoute::Fabric);
}

/// Until the listener allows it, the client's HELLO goes unanswered (so the
/// client never joins); then the handshake completes.
#[test]
fn the_listener_answers_once_it_allows_the_join() {
    let mut e = Engines::new();
    e.hello();
    assert!(e.server_to_client().is_empty(), "no HELLO_ACK yet");
    assert!(!e.server.established());
    e.server.allow_join(e.now);
    assert_eq!(e.server_to_client(), [wire::MsgType::HelloAck]);
    assert!(e.client.established() && e.server.established());
}

/// §8b's rule of who may join when: the client once the handshake is
/// done, the listener once the client's JOIN is in (the handshake alone
/// is not enough: its program may still sleep on the TCP socket alone).
#[test]
fn the_client_may_join_once_answered_the_listener_once_the_client_joined() {
    let mut e = Engines::new();
    let now = e.now;
    assert!(!e.client.may_join_tx() && !e.server.may_join_tx());
    e.server.allow_join(now);
    e.exchange();
    assert!(e.client.established() && e.server.established());
    assert!(e.client.may_join_tx());
    assert!(!e.server.may_join_tx(), "the handshake alone");
    e.client.join_tx(now, 3);
    e.exchange();
    assert!(e.server.may_join_tx());
}

/// A listener that forks the connection before the handshake forbids the
/// join: no HELLO_ACK ever goes, and leaving needs no SWITCH (nothing went
/// on the fabric); its ABORT (`StaysOnTcp`) tells the client, which
/// stays on TCP at once rather than wait for an answer. After the
/// handshake it is too late to forbid.
#[test]
fn a_forbidden_join_stays_on_tcp_without_a_handshake() {
    let mut e = Engines::new();
    let now = e.now;
    e.hello();
    assert!(e.server.forbid_join());
    e.server.allow_join(now);
    assert!(e.server_to_client().is_empty(), "never answered");
    e.server.leave_fabric(now, &mut e.mem);
    assert_eq!(*e.server.state(), State::Switched);
    assert_eq!(e.server_to_client(), [wire::MsgType::Abort], "no SWITCH");
    assert_eq!(*e.client.state(), State::Switched);
    assert!(!e.client.stay_on_tcp_now(now), "once");
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
        let mut e = Engines::new();
        let now = e.now;
        e.server.allow_join(now);
        if joined {
            e.client.join_tx(now, 3);
        }
        e.exchange();
        assert!(e.client.established() && e.server.established());
        e.server.handle_peer_gone(now);
        if joined {
            assert!(matches!(e.server.state(), State::Aborted(_)), "{joined}");
        } else {
            assert_eq!(*e.server.state(), State::Switched);
        }
    }
}
