//! Leaving the fabric for TCP: every byte sent arrives once, in order,
//! whatever was in flight (DATA, advertisements read halfway, copies made
//! by copy-on-write, unposted sends), in both directions.

use std::time::Duration;

use super::*;

/// What each side wrote to the TCP connection beneath, and whether it
/// shut its sending side.
struct Tcp {
    wrote: [Vec<u8>; 2],
    shut: [bool; 2],
}

impl Pair {
    /// Both sides leave (side `first` starts); what they wrote to TCP.
    fn switch(&mut self, first: usize) -> Tcp {
        self.d[first].leave_fabric();
        self.run_until(Duration::from_secs(1), |p| {
            p.d.iter()
                .all(|d| *d.connection().state() == State::Switched)
        });
        self.run_for(Duration::from_millis(1));
        for d in &self.d {
            assert!(d.is_finished());
        }
        let mut t = self.tcp.borrow_mut();
        Tcp {
            wrote: [
                t.wrote[0].drain(..).collect(),
                t.wrote[1].drain(..).collect(),
            ],
            shut: t.shut,
        }
    }

    /// Nothing is left protected, armed, registered or pooled anywhere.
    fn all_released(&self) {
        for s in 0..2 {
            assert!(
                self.mems.borrow()[s].protected_pages().is_empty(),
                "side {s}"
            );
            let f = self.fabric.borrow();
            assert_eq!((f.registrations(s), f.pool_in_use(s)), (0, 0), "side {s}");
        }
    }
}

#[test]
fn a_switch_loses_nothing_in_flight_either_way() {
    let mut p = Pair::new(cfg(Role::Client), cfg(Role::Server));
    // Side 0: small DATA, a zero-copy send, more DATA; side 1 reads part
    // of the advertisement (a partial GET).
    let mut sent0 = Vec::new();
    for (at, len, salt) in [
        (BUF, 3000, 1u8),
        (BUF + 0x10000, 6 * PAGE + 50, 2),
        (BUF + 0x30000, 500, 3),
    ] {
        let data = pattern(len as usize, salt);
        p.write(0, at, &data);
        let s = p.send(0, at, len);
        assert_eq!(p.poll(0, s), Some(Ok(len)));
        sent0.extend(data);
    }
    // Side 1 sends too, and side 0 reads a little of it.
    let sent1 = pattern(5000, 9);
    p.write(1, BUF, &sent1);
    let s = p.send(1, BUF, 5000);
    assert_eq!(p.poll(1, s), Some(Ok(5000)));
    let r = p.recv(0, DST, 1000);
    assert_eq!(p.wait(0, r), Ok(1000));
    let mut got1 = p.read(0, DST, 1000);
    let r = p.recv_all(1, DST, 3000 + 2 * PAGE);
    let n = p.wait(1, r).unwrap();
    let mut got0 = p.read(1, DST, n as usize);
    assert!(p.counters(1).gets > 0, "part of the advertisement was read");
    let tcp = p.switch(0);
    got0.extend(&tcp.wrote[0]);
    got1.extend(&tcp.wrote[1]);
    assert_eq!(got0, sent0);
    assert_eq!(got1, sent1);
    assert!(!tcp.shut[0] && !tcp.shut[1]);
    p.all_released();
}

#[test]
fn a_copy_on_write_copy_goes_again_not_the_rewritten_pages() {
    let mut p = Pair::new(cfg(Role::Client), cfg(Role::Server));
    let data = pattern(4 * PAGE as usize, 4);
    p.write(0, BUF, &data);
    let s = p.send(0, BUF, 4 * PAGE);
    assert_eq!(p.poll(0, s), Some(Ok(4 * PAGE)));
    p.d[0].submit_fault(BUF + PAGE, Access::Write);
    p.run_until(Duration::from_millis(10), |p| p.woken(0, BUF + PAGE));
    assert_eq!(p.counters(0).cow_copies, 1);
    p.write(0, BUF, &[0xff; 4 * PAGE as usize]);
    let tcp = p.switch(1);
    assert_eq!(tcp.wrote[0], data);
    assert!(tcp.wrote[1].is_empty());
    p.all_released();
}

#[test]
fn both_sides_leaving_at_once_and_a_shut_stream_carry_over() {
    let mut p = Pair::new(cfg(Role::Client), cfg(Role::Server));
    p.write(0, BUF, b"before the end");
    let s = p.send(0, BUF, 14);
    p.d[0].shutdown(Shutdown::Write);
    assert_eq!(p.poll(0, s), Some(Ok(14)));
    p.d[0].leave_fabric();
    let tcp = p.switch(1);
    assert_eq!(tcp.wrote[0], b"before the end");
    assert!(tcp.shut[0] && !tcp.shut[1], "{:?}", tcp.shut);
}

#[test]
fn calls_in_progress_end_to_go_again_over_tcp() {
    let mut c0 = cfg(Role::Client);
    c0.async_zcopy = false;
    let mut p = Pair::new(c0, cfg(Role::Server));
    // A blocked receive on side 0 (nothing to read) and a ZSDP send that
    // waits for the peer, which never reads.
    let r = p.recv(0, DST, 100);
    let data = pattern(3 * PAGE as usize, 5);
    p.write(0, BUF, &data);
    let s = p.send(0, BUF, 3 * PAGE);
    assert_eq!(p.poll(0, s), None);
    let tcp = p.switch(0);
    assert_eq!(p.d[0].take_result(r), Some(Err(CallError::Switched)));
    assert_eq!(
        p.d[0].take_result(s),
        Some(Ok(3 * PAGE)),
        "its bytes are in the resend"
    );
    assert_eq!(tcp.wrote[0], data);
}

/// A call made once the connection has switched (the caller looked just
/// before) ends at once, to go again over TCP; it does not wait for ever.
#[test]
fn calls_made_after_the_switch_end_at_once() {
    let mut p = Pair::new(cfg(Role::Client), cfg(Role::Server));
    p.switch(1);
    p.write(0, BUF, &pattern(100, 7));
    let s = p.send(0, BUF, 100);
    let r = p.recv(0, DST, 100);
    let nb = p.d[0].submit_recv(
        DST,
        100,
        RecvFlags {
            nonblocking: true,
            ..RecvFlags::default()
        },
    );
    p.run_for(Duration::from_millis(1));
    for call in [s, r, nb] {
        assert_eq!(p.d[0].take_result(call), Some(Err(CallError::Switched)));
    }
}

#[test]
fn a_switch_after_everything_was_read_resends_nothing() {
    let mut p = Pair::new(cfg(Role::Client), cfg(Role::Server));
    let data = pattern(20_000, 6);
    p.write(0, BUF, &data);
    let s = p.send(0, BUF, 20_000);
    let r = p.recv_all(1, DST, 20_000);
    assert_eq!(p.wait(1, r), Ok(20_000));
    assert_eq!(p.wait(0, s), Ok(20_000));
    p.run_for(Duration::from_millis(1));
    let tcp = p.switch(0);
    assert!(tcp.wrote[0].is_empty() && tcp.wrote[1].is_empty());
}

#[test]
fn bytes_on_tcp_before_the_switch_reset_the_connection() {
    let mut p = Pair::new(cfg(Role::Client), cfg(Role::Server));
    // Side 1's program wrote to the TCP socket behind azsdp's back.
    p.tcp.borrow_mut().wrote[1].extend(b"stray");
    // Seen when looking at it on the fabric...
    p.d[0].check_stream();
    p.run_for(Duration::from_millis(1));
    assert_eq!(
        *p.d[0].connection().state(),
        State::Aborted(AbortReason::StrayBytes)
    );
    // ... and before a SWITCH would make them look like the peer's resend.
    let mut q = Pair::new(cfg(Role::Client), cfg(Role::Server));
    q.tcp.borrow_mut().wrote[1].extend(b"stray");
    q.d[0].leave_fabric();
    q.run_for(Duration::from_millis(1));
    assert_eq!(
        *q.d[0].connection().state(),
        State::Aborted(AbortReason::StrayBytes)
    );
    assert!(matches!(q.d[1].connection().state(), State::Aborted(_)));
}

/// A fabric that notices a death within 100 us (before any timer).
fn quick_death() -> SimFabricParams {
    SimFabricParams {
        death_detect: Duration::from_micros(100),
        ..fabric_params()
    }
}

/// The peer's process dies while another process of its side carries on
/// (an heir): everything the peer's sends returned is here, so this side
/// moves the stream onto TCP alone, from what the peer's programs had
/// read of ours, and keeps what it had not read yet of the peer's stream
/// for its program, before the TCP socket.
#[test]
fn a_dead_peer_with_an_heir_hands_the_stream_over_on_tcp() {
    let mut p = Pair::with_fabric(quick_death(), cfg(Role::Client), cfg(Role::Server));
    let a = pattern(3000, 1);
    p.write(0, BUF, &a);
    let s = p.send(0, BUF, 3000);
    assert_eq!(p.poll(0, s), Some(Ok(3000)));
    let b = pattern(5000, 2);
    p.write(1, BUF, &b);
    let s = p.send(1, BUF, 5000);
    assert_eq!(p.poll(1, s), Some(Ok(5000)));
    let r = p.recv_all(0, DST, 2000);
    assert_eq!(p.wait(0, r), Ok(2000));
    let r = p.recv_all(1, DST, 1000);
    assert_eq!(p.wait(1, r), Ok(1000));
    p.run_for(Duration::from_millis(1));
    p.fabric.borrow_mut().kill_with_heir(0);
    p.run_until(Duration::from_secs(2), |p| {
        *p.d[1].connection().state() == State::Switched
    });
    assert!(p.fabric.borrow().left_for_heirs(0), "the heirs were told");
    // Side 1's stream from what side 0's program had read: on TCP.
    assert_eq!(p.tcp.borrow().wrote[1], &b[2000..]);
    // What side 0 sent and side 1 had not read: read from the engine,
    // then the TCP socket.
    assert_eq!(p.d[1].connection().rx_tail(), 2000);
    let r = p.recv(1, DST, 4000);
    assert_eq!(p.wait(1, r), Ok(2000));
    assert_eq!(p.read(1, DST, 2000), a[1000..]);
    let r = p.recv(1, DST, 100);
    assert_eq!(p.wait(1, r), Err(CallError::Switched));
    assert_eq!(p.d[1].connection().rx_tail(), 0);
}

/// The same when this side had closed already (its program sent all and
/// closed; everything is posted, so the engine is finished): what the dead
/// peer's programs had not read of ours is still owed to the heirs, as a
/// TCP sender's kernel still delivers after its program closed. (It was
/// not: a finished side took the death for the end and timed out, and the
/// heir was reset; the simulator's forks found it.)
#[test]
fn a_closed_side_still_hands_its_unread_bytes_to_a_dead_peers_heir() {
    let (mut p, b) = closed_after_sending(5000, 1000, 2);
    heirs_take_over(&mut p);
    assert_eq!(p.tcp.borrow().wrote[1], &b[1000..]);
}

/// Side 1 sent `len` bytes of pattern `salt`, side 0's program read `read`
/// of them, and side 1 closed: its engine is finished (all posted).
fn closed_after_sending(len: usize, read: u64, salt: u8) -> (Pair, Vec<u8>) {
    let mut p = Pair::with_fabric(quick_death(), cfg(Role::Client), cfg(Role::Server));
    let (s, b) = p.send_pattern(1, len, salt);
    assert_eq!(p.poll(1, s), Some(Ok(len as u64)));
    let r = p.recv_all(0, DST, read);
    assert_eq!(p.wait(0, r), Ok(read));
    assert_eq!(p.read(0, DST, read as usize), b[..read as usize]);
    p.d[1].submit_close();
    p.run_until(Duration::from_millis(10), |p| {
        p.d[1].connection().is_finished()
    });
    assert!(p.d[1].connection().is_finished(), "closed and all posted");
    (p, b)
}

/// Side 0's process dies with an heir: side 1 moves the stream onto TCP
/// for it, and says so.
fn heirs_take_over(p: &mut Pair) {
    p.fabric.borrow_mut().kill_with_heir(0);
    p.run_until(Duration::from_secs(2), |p| {
        *p.d[1].connection().state() == State::Switched
    });
    assert_eq!(*p.d[1].connection().state(), State::Switched);
    assert!(p.fabric.borrow().left_for_heirs(0), "the heirs were told");
}

/// A closed side whose stream the dead process had read to the end still
/// hands the heir that end: nothing goes again, and the TCP connection's
/// sending side is shut, so the heir reads the end of the stream where TCP
/// would give it, not a reset after waiting for a stream that never comes.
#[test]
fn a_closed_side_hands_the_end_of_its_stream_to_a_dead_peers_heir() {
    let (mut p, _) = closed_after_sending(3000, 3000, 4);
    // The end of the stream, read too: nothing is owed but the end.
    let r = p.recv(0, DST, 100);
    assert_eq!(p.wait(0, r), Ok(0));
    heirs_take_over(&mut p);
    assert!(p.tcp.borrow().wrote[1].is_empty(), "nothing goes again");
    assert!(p.tcp.borrow().shut[1], "the stream's end goes on TCP");
}

/// Without an heir, or with bytes the dead peer's sends returned that never
/// arrived (an advertisement not read), the death is what it always was.
#[test]
fn a_dead_peer_whose_heir_would_miss_bytes_resets_the_connection() {
    let mut p = Pair::with_fabric(quick_death(), cfg(Role::Client), cfg(Role::Server));
    let a = pattern(6 * PAGE as usize, 1);
    p.write(0, BUF, &a);
    let s = p.send(0, BUF, a.len() as u64);
    assert_eq!(p.poll(0, s), Some(Ok(a.len() as u64)));
    p.fabric.borrow_mut().kill_with_heir(0);
    p.run_until(Duration::from_secs(2), |p| {
        matches!(p.d[1].connection().state(), State::Aborted(_))
    });
    assert!(!p.fabric.borrow().left_for_heirs(0));
    assert!(p.tcp.borrow().wrote[1].is_empty());
}

/// A fabric that says only that the peer is gone, not how far it got (as
/// verbs' rdma_cm DISCONNECTED), within 100 us.
fn departure_unknown() -> SimFabricParams {
    SimFabricParams {
        death_detect: Duration::from_micros(100),
        p_departure_unknown: 1.0,
        ..fabric_params()
    }
}

/// The peer closed cleanly (its data and its end of stream all read here)
/// and its endpoint is gone, then this side leaves the fabric (a close
/// while a forked process holds a copy): no SWITCH will ever answer, and
/// none is awaited. The connection is on TCP at once, not after the peer
/// timeout, and nothing goes again (the peer reads no more).
#[test]
fn leaving_after_the_peer_closed_and_left_waits_for_nobody() {
    for peer_gone_first in [true, false] {
        let mut p = Pair::with_fabric(departure_unknown(), cfg(Role::Client), cfg(Role::Server));
        let a = pattern(20_000, 3);
        p.write(0, BUF, &a);
        let s = p.send(0, BUF, a.len() as u64);
        let r = p.recv_all(1, DST, a.len() as u64);
        assert_eq!(p.wait(1, r), Ok(a.len() as u64));
        assert_eq!(p.wait(0, s), Ok(a.len() as u64));
        let b = pattern(300, 4);
        p.write(1, BUF, &b);
        let s = p.send(1, BUF, 300);
        assert_eq!(p.poll(1, s), Some(Ok(300)));
        let r = p.recv_all(0, DST, 300);
        assert_eq!(p.wait(0, r), Ok(300));
        p.d[0].submit_close();
        let eof = p.recv(1, DST, 100);
        assert_eq!(p.wait(1, eof), Ok(0));
        p.run_until(Duration::from_millis(10), |p| p.d[0].is_finished());
        if peer_gone_first {
            p.fabric.borrow_mut().kill(0);
            p.run_for(Duration::from_millis(1));
            assert!(p.d[1].peer_left());
            p.d[1].leave_fabric();
        } else {
            // Our SWITCH goes to an endpoint that is going: no answer.
            p.d[1].leave_fabric();
            p.fabric.borrow_mut().kill(0);
        }
        p.run_until(Duration::from_millis(10), |p| {
            *p.d[1].connection().state() == State::Switched
        });
        assert!(p.d[1].is_finished());
        assert!(p.tcp.borrow().wrote[1].is_empty());
        // The end of the peer's stream came over the fabric: still EOF.
        let r = p.recv(1, DST, 100);
        assert_eq!(p.wait(1, r), Ok(0));
    }
}
