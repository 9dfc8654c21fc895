//! The engines' timers, run by the real driver in simulated time:
//! keepalive, peer timeout, linger, block-on-write escalation.

use std::time::Duration;

use super::*;

#[test]
fn bytes_cross_through_the_real_driver_with_posted_registrations() {
    let mut p = Pair::new(cfg(Role::Client), cfg(Role::Server));
    let data = pattern(100_000, 3);
    p.write(0, BUF, &data);
    let send = p.d[0].submit_send(BUF, data.len() as u64, PROTECTABLE);
    let flags = RecvFlags {
        waitall: true,
        ..RecvFlags::default()
    };
    let recv = p.d[1].submit_recv(BUF, data.len() as u64, flags);
    assert_eq!(p.wait(1, recv), Ok(data.len() as u64));
    assert_eq!(p.read(1, BUF, data.len()), data);
    p.run_for(Duration::from_millis(1));
    assert_eq!(p.d[0].take_result(send), Some(Ok(data.len() as u64)));
    let c = p.d[1].connection().counters();
    assert!(c.gets > 0, "the zero-copy path ran: {c:?}");
    // Every key went back: sources after GET_COMPLETE, destinations after
    // their GET.
    let f = p.fabric.borrow();
    assert_eq!((f.registrations(0), f.registrations(1)), (0, 0));
    assert!(f.violations.is_empty(), "{:?}", f.violations);
}

#[test]
fn keepalive_pings_a_quiet_peer_and_the_connection_lives() {
    let mut c1 = cfg(Role::Server);
    c1.keepalive = Duration::from_secs(5);
    c1.peer_timeout = Duration::from_secs(30);
    let mut p = Pair::new(cfg(Role::Client), c1);
    // A recv waits on side 1: the peer owes it data, so silence counts.
    let recv = p.d[1].submit_recv(BUF, 100, RecvFlags::default());
    p.settle();
    let before = p.d[1].connection().counters().msgs_sent;
    let due = p.d[1].connection().deadline(crate::conn::Timer::Keepalive);
    assert!(due.is_some_and(|t| t > p.now()), "armed: {due:?}");
    // Two minutes of silence: a ping every keepalive, each answered.
    p.run_for(Duration::from_secs(120));
    let pings = p.d[1].connection().counters().msgs_sent - before;
    assert!(
        (20..=26).contains(&pings),
        "one ping per 5 s of 120 s, got {pings}"
    );
    assert_eq!(*p.d[1].connection().state(), State::Established);
    assert_eq!(p.d[1].take_result(recv), None, "still waiting for data");
}

#[test]
fn a_silent_dead_peer_times_out_at_peer_timeout() {
    let mut c1 = cfg(Role::Server);
    c1.keepalive = Duration::from_secs(5);
    c1.peer_timeout = Duration::from_secs(30);
    let mut p = Pair::new(cfg(Role::Client), c1);
    let recv = p.d[1].submit_recv(BUF, 100, RecvFlags::default());
    p.settle();
    let since = p.now();
    // Side 0 dies; the fabric would tell in an hour: the timer goes first.
    p.fabric.borrow_mut().kill(0);
    assert_eq!(
        p.wait_within(1, recv, Duration::from_secs(60)),
        Err(CallError::TimedOut)
    );
    let waited = p.now().saturating_since(since);
    assert!(
        // Counted from the peer's last word, a moment before it died.
        waited >= Duration::from_millis(29_990) && waited <= Duration::from_secs(31),
        "timed out after {waited:?}"
    );
    assert_eq!(
        *p.d[1].connection().state(),
        State::Aborted(AbortReason::PeerTimeout)
    );
}

#[test]
fn silence_counts_from_when_the_peer_began_to_owe_us() {
    // Idle for twice `peer_timeout` (nothing owed, so no ping), then a
    // call: the peer has `peer_timeout` from now to answer, not from its
    // last word a minute ago (that aborted the call at once).
    let mut c1 = cfg(Role::Server);
    c1.keepalive = Duration::from_secs(5);
    c1.peer_timeout = Duration::from_secs(30);
    let mut p = Pair::new(cfg(Role::Client), c1);
    // (A peer that is alive and idle, not held up: nothing vouches for it.)
    p.fabric.borrow_mut().vouches = false;
    p.run_for(Duration::from_secs(60));
    let recv = p.recv(1, BUF, 100);
    p.run_for(Duration::from_millis(1));
    assert_eq!(*p.d[1].connection().state(), State::Established);
    assert_eq!(p.d[1].take_result(recv), None);
    let (send, data) = p.send_pattern(0, 100, 8);
    assert_eq!(p.wait(1, recv), Ok(100));
    assert_eq!(p.read(1, BUF, 100), data);
    assert_eq!(p.wait(0, send), Ok(100));
}

#[test]
fn a_stopped_peer_is_waited_for_not_timed_out() {
    // A peer process stopped (SIGSTOP, a debugger) answers no ping, but
    // lives: TCP waits for it (its kernel still answers), and so do we.
    let mut c1 = cfg(Role::Server);
    c1.keepalive = Duration::from_secs(1);
    c1.peer_timeout = Duration::from_secs(3);
    let mut p = Pair::new(cfg(Role::Client), c1);
    let recv = p.recv(1, BUF, 100);
    p.settle();
    p.stopped[0] = true;
    p.run_for(Duration::from_secs(60));
    assert_eq!(*p.d[1].connection().state(), State::Established);
    assert_eq!(p.d[1].take_result(recv), None, "still waiting for data");
    // It goes on, and the data comes.
    p.stopped[0] = false;
    let (send, data) = p.send_pattern(0, 100, 5);
    assert_eq!(p.wait(1, recv), Ok(100));
    assert_eq!(p.read(1, BUF, 100), data);
    assert_eq!(p.wait(0, send), Ok(100));
    // Stopped, then killed: no longer vouched for, it times out.
    let recv = p.recv(1, BUF, 100);
    p.stopped[0] = true;
    p.run_for(Duration::from_secs(10));
    assert_eq!(*p.d[1].connection().state(), State::Established);
    p.fabric.borrow_mut().kill(0);
    assert_eq!(
        p.wait_within(1, recv, Duration::from_secs(10)),
        Err(CallError::TimedOut)
    );
}

#[test]
fn an_abort_after_the_peers_shutdown_is_a_reset_while_its_data_is_unread() {
    // The peer sent, shut down, then reset before our program read: the
    // bytes went with the abort, and an end of stream would hide their
    // loss (TCP would have delivered them from its buffer).
    let mut p = Pair::new(cfg(Role::Client), cfg(Role::Server));
    let (send, data) = p.send_pattern(0, 64 << 10, 2);
    p.run_for(Duration::from_millis(1));
    assert_eq!(p.d[0].take_result(send), Some(Ok(data.len() as u64)));
    p.d[0].shutdown(crate::conn::Shutdown::Write);
    p.run_for(Duration::from_millis(1));
    p.d[0].abort();
    p.run_for(Duration::from_millis(1));
    assert!(matches!(p.d[1].connection().state(), State::Aborted(_)));
    let recv = p.recv(1, BUF, 100);
    assert_eq!(p.wait(1, recv), Err(CallError::ConnReset));
    let recv = p.recv(1, BUF, 100);
    assert_eq!(p.wait(1, recv), Ok(0), "then the end, once");
}

#[test]
fn an_abort_after_everything_was_read_is_the_end_of_the_stream() {
    let mut p = Pair::new(cfg(Role::Client), cfg(Role::Server));
    let (send, data) = p.send_pattern(0, 1000, 2);
    let recv = p.recv(1, BUF, 1000);
    assert_eq!(p.wait(1, recv), Ok(1000));
    assert_eq!(p.read(1, BUF, 1000), data);
    assert_eq!(p.wait(0, send), Ok(1000));
    p.d[0].shutdown(crate::conn::Shutdown::Write);
    p.run_for(Duration::from_millis(1));
    p.d[0].abort();
    p.run_for(Duration::from_millis(1));
    let recv = p.recv(1, BUF, 100);
    assert_eq!(p.wait(1, recv), Ok(0));
}

#[test]
fn close_with_data_the_peer_never_reads_aborts_at_linger() {
    let mut c0 = cfg(Role::Client);
    c0.linger = Duration::from_secs(10);
    c0.keepalive = Duration::from_secs(1);
    c0.peer_timeout = Duration::from_secs(3600);
    let mut p = Pair::new(c0, cfg(Role::Server));
    // Zero-copy data the peer never reads: its pages stay advertised.
    let data = pattern(64 << 10, 9);
    p.write(0, BUF, &data);
    let send = p.d[0].submit_send(BUF, data.len() as u64, PROTECTABLE);
    p.run_for(Duration::from_millis(1));
    assert_eq!(p.d[0].take_result(send), Some(Ok(data.len() as u64)));
    p.d[0].submit_close();
    let closed = p.now();
    assert!(
        p.d[0]
            .connection()
            .deadline(crate::conn::Timer::Linger)
            .is_some()
    );
    p.run_until(Duration::from_secs(20), |p| {
        matches!(p.d[0].connection().state(), State::Aborted(_))
    });
    assert_eq!(
        *p.d[0].connection().state(),
        State::Aborted(AbortReason::LingerTimeout)
    );
    let after = p.now().saturating_since(closed);
    assert!(
        after >= Duration::from_secs(10) && after < Duration::from_millis(10_010),
        "aborted after {after:?}"
    );
    // Nothing stays protected or registered on the side that gave up.
    assert!(p.d[0].connection().protected_ranges().is_empty());
    p.run_for(Duration::from_millis(1));
    assert_eq!(p.fabric.borrow().registrations(0), 0);
    assert!(p.mems.borrow()[0].protected_pages().is_empty());
}

#[test]
fn block_on_write_escalates_a_stuck_writer_after_block_escalate() {
    let mut c0 = cfg(Role::Client);
    c0.write_fault = FaultPolicy::Block;
    c0.block_escalate = Duration::from_millis(10);
    let mut p = Pair::new(c0, cfg(Role::Server));
    let data = pattern(64 << 10, 5);
    p.write(0, BUF, &data);
    let send = p.d[0].submit_send(BUF, data.len() as u64, PROTECTABLE);
    p.run_for(Duration::from_millis(1));
    assert_eq!(p.d[0].take_result(send), Some(Ok(data.len() as u64)));
    assert!(
        !p.d[0].connection().protected_ranges().is_empty(),
        "AZ-SDP: the pages are protected until the peer's GET"
    );
    // The program writes the buffer; nobody reads on the other side.
    let page = BUF + PAGE;
    let _ticket = p.d[0].submit_fault(page + 8, Access::Write);
    let faulted = p.now();
    p.run_until(Duration::from_secs(1), |p| {
        p.logs[0].borrow().woken.iter().any(|r| r.contains(&page))
    });
    let waited = p.now().saturating_since(faulted);
    assert!(
        waited >= Duration::from_millis(10) && waited < Duration::from_millis(11),
        "writer released after {waited:?}"
    );
    assert_eq!(p.d[0].connection().counters().block_escalations, 1);
    // The peer still gets the bytes as sent, from the copy.
    let recv = p.d[1].submit_recv(
        BUF,
        data.len() as u64,
        RecvFlags {
            waitall: true,
            ..RecvFlags::default()
        },
    );
    p.write(0, page + 8, b"scribble");
    assert_eq!(p.wait(1, recv), Ok(data.len() as u64));
    assert_eq!(p.read(1, BUF, data.len()), data);
    p.d[0].shutdown(Shutdown::Both);
}
