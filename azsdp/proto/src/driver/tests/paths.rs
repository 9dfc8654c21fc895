//! The engine's paths one behaviour at a time, run by the real driver over
//! the simulated fabric: AZ-SDP, ZSDP, partial GETs, copy- and
//! block-on-write, armed receives, the fault-rate fallback, credits,
//! shutdown and close, and what a departed peer leaves behind.

use std::time::Duration;

use super::*;
use crate::conn::{FallbackReason, RecvProtect, TxMode};
use crate::pages;
use crate::wire::AbortCode;

/// A fabric on which a death is noticed at once, without the dead side's
/// progress (as when its segment is unreadable).
fn quick_death(progress_known: bool) -> SimFabricParams {
    SimFabricParams {
        death_detect: Duration::from_micros(1),
        p_departure_unknown: if progress_known { 0.0 } else { 1.0 },
        ..fabric_params()
    }
}

#[test]
fn azsdp_send_returns_at_once_and_splits_head_and_tail() {
    let mut p = Pair::new(cfg(Role::Client), cfg(Role::Server));
    let (addr, len) = (BUF + 0x100, 3 * PAGE + 100);
    let data = pattern(len as usize, 1);
    p.write(0, addr, &data);
    let call = p.send(0, addr, len);
    assert_eq!(
        p.d[0].take_result(call),
        None,
        "not before the pages are protected and registered"
    );
    // Done while the peer has not read a byte.
    assert_eq!(p.poll(0, call), Some(Ok(len)));
    let middle = pages::whole_pages(addr, len, PAGE);
    assert_eq!(p.pages(0, Prot::WriteProtected), vec![middle.clone()]);
    let c = p.counters(0);
    assert_eq!(
        c.bytes_sent_bsdp,
        (middle.start - addr) + (addr + len - middle.end)
    );
    assert_eq!(c.bytes_sent_async, middle.end - middle.start);
    // The receiver gets exactly the bytes; the protection lifts.
    let r = p.recv_all(1, DST, len);
    assert_eq!(p.wait(1, r), Ok(len));
    assert_eq!(p.read(1, DST, len as usize), data);
    p.run_for(Duration::from_millis(1));
    assert!(p.pages(0, Prot::WriteProtected).is_empty());
    assert_eq!(p.counters(1).gets, 1);
}

/// Every registration for the peer refused for the locked-memory limit
/// (`RLIMIT_MEMLOCK`): the sends go by copy, every byte arrives, and the
/// reason says why.
#[test]
fn the_locked_memory_limit_sends_by_copy_and_says_so() {
    let params = SimFabricParams {
        p_register_fail: 1.0,
        register_error: OpError::PinLimit,
        ..fabric_params()
    };
    let mut p = Pair::with_fabric(params, cfg(Role::Client), cfg(Role::Server));
    let (addr, len) = (BUF + 0x100, 8 * PAGE + 100);
    let data = pattern(len as usize, 3);
    p.write(0, addr, &data);
    let call = p.send(0, addr, len);
    assert_eq!(p.poll(0, call), Some(Ok(len)));
    let r = p.recv_all(1, DST, len);
    assert_eq!(p.wait(1, r), Ok(len));
    assert_eq!(p.read(1, DST, len as usize), data);
    let c = p.counters(0);
    assert_eq!(c.bytes_sent_bsdp, len);
    assert_eq!(c.fallback_reason, Some(FallbackReason::MemlockLimit));
    assert!(p.pages(0, Prot::WriteProtected).is_empty());
}

#[test]
fn zsdp_send_waits_for_get_complete() {
    let mut c0 = cfg(Role::Client);
    c0.async_zcopy = false;
    let mut p = Pair::new(c0, cfg(Role::Server));
    assert_eq!(p.d[0].connection().tx_mode(), TxMode::Sync);
    let (addr, len) = (BUF + 0x333, 40_000);
    let data = pattern(len as usize, 2);
    p.write(0, addr, &data);
    let call = p.send(0, addr, len);
    assert_eq!(p.poll(0, call), None, "ZSDP returns once the peer has read");
    assert!(
        p.pages(0, Prot::WriteProtected).is_empty(),
        "ZSDP protects nothing"
    );
    let r = p.recv(1, DST, len);
    assert_eq!(p.wait(1, r), Ok(len));
    assert_eq!(p.wait(0, call), Ok(len));
    assert_eq!(p.read(1, DST, len as usize), data);
}

#[test]
fn partial_gets_leave_the_rest_advertised() {
    let mut p = Pair::new(cfg(Role::Client), cfg(Role::Server));
    let data = pattern(8 * PAGE as usize, 3);
    p.write(0, BUF, &data);
    let call = p.send(0, BUF, 8 * PAGE);
    assert_eq!(p.poll(0, call), Some(Ok(8 * PAGE)));
    let mut got = Vec::new();
    for i in 0..8u64 {
        let at = DST + i * 0x10000;
        let r = p.recv(1, at, PAGE);
        assert_eq!(p.wait(1, r), Ok(PAGE));
        got.extend_from_slice(&p.read(1, at, PAGE as usize));
        // Pages already read are unprotected at once; the rest stay.
        p.run_for(Duration::from_millis(1));
        let protected: u64 = p
            .pages(0, Prot::WriteProtected)
            .iter()
            .map(|r| r.end - r.start)
            .sum();
        assert_eq!(protected, (7 - i) * PAGE);
    }
    assert_eq!(got, data);
    assert_eq!(p.counters(1).gets, 8);
}

#[test]
fn copy_on_write_lets_the_writer_go_and_the_peer_gets_the_old_bytes() {
    let mut p = Pair::new(cfg(Role::Client), cfg(Role::Server));
    let data = pattern(4 * PAGE as usize, 4);
    p.write(0, BUF, &data);
    let call = p.send(0, BUF, 4 * PAGE);
    assert_eq!(p.poll(0, call), Some(Ok(4 * PAGE)));
    // The program writes page 2 of the in-flight buffer; nobody reads yet.
    let page = BUF + 2 * PAGE;
    p.d[0].submit_fault(page + 5, Access::Write);
    p.run_until(Duration::from_millis(10), |p| p.woken(0, page));
    assert!(p.pages(0, Prot::WriteProtected).is_empty());
    p.write(0, page, &[0xff; 64]);
    let c = p.counters(0);
    assert_eq!((c.send_faults, c.cow_copies, c.updates_sent), (1, 1, 1));
    let r = p.recv_all(1, DST, 4 * PAGE);
    assert_eq!(p.wait(1, r), Ok(4 * PAGE));
    assert_eq!(p.read(1, DST, 4 * PAGE as usize), data);
    // The copy went back to the pool once read.
    p.run_for(Duration::from_millis(1));
    assert_eq!(p.fabric.borrow().pool_in_use(0), 0);
}

#[test]
fn read_ahead_fetches_advertisements_before_the_calls_and_copies_them_out() {
    let mut c1 = cfg(Role::Server);
    c1.read_ahead = 64 << 10;
    let mut p = Pair::new(cfg(Role::Client), c1);
    // Eight sends of four pages, advertised at once; no receive yet.
    let data = pattern(32 * PAGE as usize, 6);
    p.write(0, BUF, &data);
    for i in 0..8 {
        let call = p.send(0, BUF + i * 4 * PAGE, 4 * PAGE);
        assert_eq!(p.poll(0, call), Some(Ok(4 * PAGE)));
    }
    // The receiver reads ahead up to its 64 KiB: four advertisements,
    // several GETs in flight, before any call; the source's pages stay
    // protected (nothing is consumed until the program reads it).
    p.run_for(Duration::from_millis(1));
    assert_eq!(p.counters(1).gets, 4);
    assert_eq!(p.fabric.borrow().pool_in_use(1), 4);
    assert_eq!(p.pages(0, Prot::WriteProtected).len(), 1);
    // The program reads it all, in pieces: copies from staging first.
    let mut got = Vec::new();
    for i in 0..16u64 {
        let r = p.recv(1, DST + i * 0x10000, 2 * PAGE);
        assert_eq!(p.wait(1, r), Ok(2 * PAGE));
        got.extend_from_slice(&p.read(1, DST + i * 0x10000, 2 * PAGE as usize));
    }
    assert_eq!(got, data);
    p.run_for(Duration::from_millis(1));
    let c = p.counters(1);
    assert_eq!(c.bytes_recv_zcopy, 32 * PAGE);
    assert!(c.bytes_recv_ahead >= 16 * PAGE, "{c:?}");
    // Everything was given back: staging, and the source's pages.
    assert_eq!(p.fabric.borrow().pool_in_use(1), 0);
    assert!(p.pages(0, Prot::WriteProtected).is_empty());
    let f = p.fabric.borrow();
    assert_eq!((f.registrations(0), f.registrations(1)), (0, 0));
}

#[test]
fn a_write_after_a_read_ahead_landed_copies_and_the_receiver_keeps_the_old_bytes() {
    let mut c1 = cfg(Role::Server);
    c1.read_ahead = 1 << 20;
    let mut p = Pair::new(cfg(Role::Client), c1);
    let data = pattern(4 * PAGE as usize, 7);
    p.write(0, BUF, &data);
    let call = p.send(0, BUF, 4 * PAGE);
    assert_eq!(p.poll(0, call), Some(Ok(4 * PAGE)));
    p.run_for(Duration::from_millis(1));
    assert_eq!(p.fabric.borrow().pool_in_use(1), 1, "read ahead");
    // The program rewrites its buffer: the lock is free again (the bytes
    // landed), so the source copies aside and tells the receiver, which
    // needs the copy no more.
    p.d[0].submit_fault(BUF + 5, Access::Write);
    p.run_until(Duration::from_millis(10), |p| p.woken(0, BUF));
    p.write(0, BUF, &[0xee; 64]);
    assert_eq!(p.counters(0).cow_copies, 1);
    let r = p.recv_all(1, DST, 4 * PAGE);
    assert_eq!(p.wait(1, r), Ok(4 * PAGE));
    assert_eq!(p.read(1, DST, 4 * PAGE as usize), data);
    p.run_for(Duration::from_millis(1));
    assert_eq!(*p.d[1].connection().state(), State::Established);
    assert_eq!(p.fabric.borrow().pool_in_use(0), 0);
    assert_eq!(p.fabric.borrow().pool_in_use(1), 0);
}

#[test]
fn block_on_write_waits_for_the_transfer() {
    let mut c0 = cfg(Role::Client);
    c0.write_fault = FaultPolicy::Block;
    c0.block_escalate = Duration::from_secs(10);
    let mut p = Pair::new(c0, cfg(Role::Server));
    p.write(0, BUF, &pattern(2 * PAGE as usize, 5));
    let call = p.send(0, BUF, 2 * PAGE);
    assert_eq!(p.poll(0, call), Some(Ok(2 * PAGE)));
    p.d[0].submit_fault(BUF, Access::Write);
    p.run_for(Duration::from_millis(1));
    assert!(!p.woken(0, BUF), "block-on-write waits");
    let r = p.recv(1, DST, 2 * PAGE);
    assert_eq!(p.wait(1, r), Ok(2 * PAGE));
    p.run_until(Duration::from_millis(10), |p| p.woken(0, BUF));
    assert_eq!(p.counters(0).cow_copies, 0);
}

/// Whether a receive's pages may be armed is asked only of a receive that
/// may arm: on a real host each answer is a system call (`PROCMAP_QUERY`),
/// and an event loop's large reads paid one each for nothing.
#[test]
fn a_receive_that_may_not_arm_asks_nothing_of_its_memory() {
    let mut c1 = cfg(Role::Server);
    c1.recv_protect = RecvProtect::On;
    let mut p = Pair::new(cfg(Role::Client), c1);
    let (call, data) = p.send_pattern(0, 6 * PAGE as usize, 9);
    assert_eq!(p.wait(0, call), Ok(6 * PAGE));
    let before = p.asked[1].get();
    let r = p.recv_all(1, DST, 6 * PAGE);
    assert_eq!(p.wait(1, r), Ok(6 * PAGE));
    assert_eq!(p.read(1, DST, data.len()), data);
    assert_eq!(p.asked[1].get(), before, "a receive that may not arm asked");
    // One that may arm asks.
    let (call, _) = p.send_pattern(0, 6 * PAGE as usize, 10);
    assert_eq!(p.wait(0, call), Ok(6 * PAGE));
    let flags = RecvFlags {
        armable: true,
        ..RecvFlags::default()
    };
    let r = p.d[1].submit_recv(DST, 6 * PAGE, flags);
    assert_eq!(p.wait(1, r), Ok(6 * PAGE));
    assert!(p.asked[1].get() > before);
    // Under `auto`, one smaller than `recv_protect_min` never arms: no
    // question either.
    let mut p = Pair::new(cfg(Role::Client), cfg(Role::Server));
    let (call, _) = p.send_pattern(0, 6 * PAGE as usize, 11);
    assert_eq!(p.wait(0, call), Ok(6 * PAGE));
    let before = p.asked[1].get();
    let r = p.d[1].submit_recv(DST, 6 * PAGE, flags);
    assert_eq!(p.wait(1, r), Ok(6 * PAGE));
    assert_eq!(p.asked[1].get(), before, "a receive too small to arm asked");
}

#[test]
fn receive_side_protection_returns_before_the_data_lands() {
    let mut c1 = cfg(Role::Server);
    c1.recv_protect = RecvProtect::On;
    // GETs move 100 bytes a microsecond: the armed middle lands well
    // after the edges.
    let slow = SimFabricParams {
        bytes_per_us: 100,
        ..fabric_params()
    };
    let mut p = Pair::with_fabric(slow, cfg(Role::Client), c1);
    let data = pattern(6 * PAGE as usize, 6);
    p.write(0, BUF, &data);
    let call = p.send(0, BUF, 6 * PAGE);
    assert_eq!(p.poll(0, call), Some(Ok(6 * PAGE)));
    // Destination misaligned by 100 bytes: the edges are fetched before
    // recv() returns, the 5 whole pages in between are armed and land
    // later.
    let dst = DST + 100;
    let flags = RecvFlags {
        armable: true,
        ..RecvFlags::default()
    };
    let r = p.d[1].submit_recv(dst, 6 * PAGE, flags);
    assert_eq!(
        p.wait(1, r),
        Ok(6 * PAGE),
        "recv returned with data in flight"
    );
    let middle = pages::whole_pages(dst, 6 * PAGE, PAGE);
    assert_eq!(p.pages(1, Prot::Armed), vec![middle.clone()]);
    // Touching an armed page waits for the data.
    p.d[1].submit_fault(middle.start + 10, Access::Read);
    p.settle();
    assert!(!p.woken(1, middle.start));
    p.run_until(Duration::from_millis(10), |p| p.woken(1, middle.start));
    assert!(p.pages(1, Prot::Armed).is_empty());
    assert_eq!(p.read(1, dst, 6 * PAGE as usize), data);
    assert_eq!(p.counters(1).armed_recvs, 1);
}

#[test]
fn fault_rate_fallback_is_visible_and_recovers() {
    let mut c0 = cfg(Role::Client);
    c0.fallback_faults = 2;
    c0.fallback_window = 4;
    c0.fallback_recover = 2;
    let mut p = Pair::new(c0, cfg(Role::Server));
    for i in 0..2u8 {
        p.write(0, BUF, &pattern(2 * PAGE as usize, i));
        let s = p.send(0, BUF, 2 * PAGE);
        assert_eq!(p.poll(0, s), Some(Ok(2 * PAGE)));
        p.d[0].submit_fault(BUF, Access::Write);
        p.run_for(Duration::from_millis(1));
        let r = p.recv_all(1, DST, 2 * PAGE);
        assert_eq!(p.wait(1, r), Ok(2 * PAGE));
        // The advertisement ends, with its fault count, at GET_COMPLETE.
        p.run_for(Duration::from_millis(1));
    }
    let c = p.counters(0);
    assert_eq!(c.fallbacks, 1, "{c:?}");
    assert_eq!(c.fallback_reason, Some(FallbackReason::FaultRate));
    assert_eq!(p.d[0].connection().tx_mode(), TxMode::Sync);
    // Two synchronous sends later, AZ-SDP is back.
    for _ in 0..2 {
        let s = p.send(0, BUF, 2 * PAGE);
        let r = p.recv_all(1, DST, 2 * PAGE);
        assert_eq!(p.wait(1, r), Ok(2 * PAGE));
        assert_eq!(p.wait(0, s), Ok(2 * PAGE));
    }
    assert_eq!(p.counters(0).recoveries, 1);
    assert_eq!(p.d[0].connection().tx_mode(), TxMode::Async);
}

#[test]
fn credits_coalesce_small_sends_while_short() {
    let mut c1 = cfg(Role::Server);
    c1.rx_credits = 1;
    let mut p = Pair::new(cfg(Role::Client), c1);
    for i in 0..10u64 {
        p.write(0, BUF + i * 10, &[i as u8; 10]);
        let s = p.send(0, BUF + i * 10, 10);
        assert_eq!(p.poll(0, s), Some(Ok(10)), "buffered sends return at once");
    }
    // One credit: the first DATA went alone, the other nine sends wait and
    // leave together when the credit returns.
    assert_eq!(p.counters(0).data_msgs_sent, 1);
    let r = p.recv(1, DST, 100);
    assert_eq!(p.wait(1, r), Ok(10));
    let r = p.recv(1, DST + 10, 100);
    assert_eq!(p.wait(1, r), Ok(90));
    assert_eq!(p.counters(0).data_msgs_sent, 2);
    let want: Vec<u8> = (0..10u8).flat_map(|i| [i; 10]).collect();
    assert_eq!(p.read(1, DST, 100), want);
}

#[test]
fn shutdown_delivers_eof_after_all_data_and_close_with_unread_data_resets() {
    let mut p = Pair::new(cfg(Role::Client), cfg(Role::Server));
    p.write(0, BUF, b"last words");
    let s = p.send(0, BUF, 10);
    p.d[0].shutdown(Shutdown::Write);
    assert_eq!(p.poll(0, s), Some(Ok(10)));
    let s = p.send(0, BUF, 10);
    assert_eq!(p.wait(0, s), Err(CallError::BrokenPipe));
    let r = p.recv(1, DST, 100);
    assert_eq!(p.wait(1, r), Ok(10));
    assert_eq!(p.read(1, DST, 10), b"last words");
    let r = p.recv(1, DST, 100);
    assert_eq!(p.wait(1, r), Ok(0), "EOF");

    let mut q = Pair::new(cfg(Role::Client), cfg(Role::Server));
    q.write(0, BUF, b"unread");
    let s = q.send(0, BUF, 6);
    assert_eq!(q.poll(0, s), Some(Ok(6)));
    q.d[1].submit_close();
    q.run_for(Duration::from_millis(1));
    assert_eq!(
        *q.d[0].connection().state(),
        State::Aborted(AbortReason::PeerAbort(AbortCode::Reset))
    );
    // As TCP after a reset: the error once, then EPIPE.
    let s = q.send(0, BUF, 6);
    assert_eq!(q.wait(0, s), Err(CallError::ConnReset));
    let s = q.send(0, BUF, 6);
    assert_eq!(q.wait(0, s), Err(CallError::BrokenPipe));
    assert!(!q.d[0].connection().readiness().error, "reported");
}

#[test]
fn a_dead_peer_releases_every_page_and_fails_blocked_calls() {
    let mut p = Pair::with_fabric(quick_death(false), cfg(Role::Client), cfg(Role::Server));
    p.write(0, BUF, &pattern(4 * PAGE as usize, 7));
    let s = p.send(0, BUF, 4 * PAGE);
    let r = p.recv(0, DST, 100);
    assert_eq!(p.poll(0, s), Some(Ok(4 * PAGE)));
    assert!(!p.pages(0, Prot::WriteProtected).is_empty());
    p.fabric.borrow_mut().kill(1);
    assert_eq!(p.wait(0, r), Err(CallError::ConnReset));
    assert!(
        p.pages(0, Prot::WriteProtected).is_empty(),
        "pages released"
    );
    assert!(p.d[0].is_finished());
    p.run_for(Duration::from_millis(1));
    assert_eq!(p.fabric.borrow().registrations(0), 0);
}

#[test]
fn a_peer_that_leaves_after_a_clean_close_ends_nothing() {
    let mut p = Pair::with_fabric(quick_death(false), cfg(Role::Client), cfg(Role::Server));
    p.write(0, BUF, &pattern(4 * PAGE as usize, 9));
    let s = p.send(0, BUF, 4 * PAGE);
    assert_eq!(p.poll(0, s), Some(Ok(4 * PAGE)));
    p.d[0].submit_close();
    let r = p.recv(1, DST, 8 * PAGE);
    assert_eq!(p.wait(1, r), Ok(4 * PAGE));
    p.run_for(Duration::from_millis(1));
    assert!(p.d[0].is_finished(), "the sender's close is done");
    // The reader exits at once (its process, and the fabric, are gone).
    p.fabric.borrow_mut().kill(1);
    p.run_for(Duration::from_millis(1));
    assert!(p.d[0].peer_left());
    assert_eq!(
        *p.d[0].connection().state(),
        State::Established,
        "a clean close stays clean"
    );

    // But a peer that leaves while data is owed is a failure.
    let mut q = Pair::with_fabric(quick_death(false), cfg(Role::Client), cfg(Role::Server));
    q.write(0, BUF, &pattern(4 * PAGE as usize, 9));
    let s = q.send(0, BUF, 4 * PAGE);
    assert_eq!(q.poll(0, s), Some(Ok(4 * PAGE)));
    q.d[0].submit_close();
    q.fabric.borrow_mut().kill(1);
    q.run_until(Duration::from_millis(10), |q| q.d[0].peer_left());
    assert_eq!(
        *q.d[0].connection().state(),
        State::Aborted(AbortReason::PeerGone)
    );
}

/// A peer that dies having read everything we sent ends our stream with
/// EOF and makes the socket writable, with sends failing (EPIPE); one that
/// dies with some of it unread, even data that reached its buffers, resets
/// the connection, as a TCP peer's RST does.
#[test]
fn a_peer_that_dies_with_our_data_unread_resets_the_connection() {
    let small = 1000;
    for read_it in [true, false] {
        let mut p = Pair::with_fabric(quick_death(true), cfg(Role::Client), cfg(Role::Server));
        p.write(0, BUF, &pattern(small as usize, 3));
        let s = p.send(0, BUF, small);
        assert_eq!(p.poll(0, s), Some(Ok(small)));
        if read_it {
            let r = p.recv(1, DST, 4 * PAGE);
            assert_eq!(p.wait(1, r), Ok(small));
        }
        assert_eq!(
            p.d[1].connection().progress_made().read,
            if read_it { small } else { 0 }
        );
        // The receiver dies; the fabric tells the sender how far it read.
        p.run_for(Duration::from_millis(1));
        p.fabric.borrow_mut().kill(1);
        p.run_until(Duration::from_millis(10), |p| p.d[0].peer_left());
        let ready = p.d[0].connection().readiness();
        assert!(ready.readable && ready.writable, "{ready:?}");
        let s = p.send(0, BUF, small);
        let sent = p.wait(0, s);
        assert_eq!(
            *p.d[0].connection().state(),
            State::Aborted(AbortReason::PeerGone)
        );
        if read_it {
            // As TCP to a peer that closed: this send goes (nobody reads
            // it: a reset), the next fails with EPIPE, receives see EOF.
            assert_eq!(sent, Ok(small));
            assert!(p.d[0].connection().readiness().error);
            let r = p.recv(0, DST, 100);
            assert_eq!(p.wait(0, r), Ok(0));
            let s = p.send(0, BUF, small);
            assert_eq!(p.wait(0, s), Err(CallError::BrokenPipe));
            assert!(!p.d[0].connection().readiness().error);
        } else {
            assert!(ready.error);
            assert_eq!(p.counters(0).bytes_unread_by_peer, small);
            assert!(sent.is_err(), "{sent:?}");
        }
    }
}

/// A peer that dies leaving nothing unsent (all its returned sends arrived,
/// nothing advertised from its memory) ends the stream with EOF after the
/// data, as TCP does; one that leaves data behind is a reset.
#[test]
fn a_peer_that_dies_owing_nothing_ends_with_eof() {
    let small = 1000;
    let mut p = Pair::with_fabric(quick_death(true), cfg(Role::Client), cfg(Role::Server));
    p.write(0, BUF, &pattern(small as usize, 3));
    let s = p.send(0, BUF, small);
    assert_eq!(p.poll(0, s), Some(Ok(small)));
    assert_eq!(p.d[0].connection().tx_returned(), small);
    // The sender dies; the receiver has not read yet.
    p.fabric.borrow_mut().kill(0);
    p.run_until(Duration::from_millis(10), |p| p.d[1].peer_left());
    let r = p.recv(1, DST, 4 * PAGE);
    assert_eq!(p.wait(1, r), Ok(small), "the data first");
    assert_eq!(p.read(1, DST, small as usize), pattern(small as usize, 3));
    let r = p.recv(1, DST, 4 * PAGE);
    assert_eq!(p.wait(1, r), Ok(0), "then EOF");

    // Its send returned, but the DATA died in flight with it.
    let mut q = Pair::with_fabric(quick_death(true), cfg(Role::Client), cfg(Role::Server));
    let s = q.send(0, BUF, small);
    assert_eq!(q.d[0].take_result(s), Some(Ok(small)), "buffered at once");
    q.fabric.borrow_mut().kill(0);
    q.run_until(Duration::from_millis(10), |q| q.d[1].peer_left());
    assert_eq!(
        *q.d[1].connection().state(),
        State::Aborted(AbortReason::PeerGone)
    );

    // Zero-copy data still in its memory: lost too.
    let mut z = Pair::with_fabric(quick_death(true), cfg(Role::Client), cfg(Role::Server));
    z.write(0, BUF, &pattern(4 * PAGE as usize, 3));
    let s = z.send(0, BUF, 4 * PAGE);
    assert_eq!(z.poll(0, s), Some(Ok(4 * PAGE)));
    z.fabric.borrow_mut().kill(0);
    z.run_until(Duration::from_millis(10), |z| z.d[1].peer_left());
    assert_eq!(
        *z.d[1].connection().state(),
        State::Aborted(AbortReason::PeerGone)
    );
}

#[test]
fn a_timeout_says_what_the_connection_was_waiting_for() {
    let mut p = Pair::new(cfg(Role::Client), cfg(Role::Server));
    // Side 0 waits for data; side 1 falls silent (dies, and the fabric
    // would tell in an hour).
    let r = p.recv(0, DST, 100);
    p.settle();
    p.fabric.borrow_mut().kill(1);
    let timeout = p.d[0].connection().config().peer_timeout;
    assert_eq!(p.wait_within(0, r, timeout * 2), Err(CallError::TimedOut));
    let w = p.d[0]
        .connection()
        .stalled()
        .expect("a timeout says what it waited for");
    assert!(w.contains("1 recv call(s)"), "{w}");
    assert!(w.contains("peer silent"), "{w}");
    assert_eq!(p.d[1].connection().stalled(), None);
}

/// Every byte sent by copy is counted under why: small, the edges of a
/// zero-copy send, memory that cannot be protected (non-blocking: a
/// blocking send from it goes by ZSDP instead), the fault rate.
#[test]
fn bytes_sent_by_copy_say_why() {
    use crate::conn::{CopyReason, Unprotectable};
    let mut c0 = cfg(Role::Client);
    c0.fallback_faults = 1;
    c0.fallback_window = 1;
    c0.fallback_recover = 100;
    let mut p = Pair::new(c0, cfg(Role::Server));
    const FILE: u64 = 0x40_0000;
    p.unprotectable[0]
        .borrow_mut()
        .push((FILE..FILE + (1 << 20), Unprotectable::File));
    let nonblocking = SendFlags {
        nonblocking: true,
        ..PROTECTABLE
    };
    let mut sent = Vec::new();
    let send = |p: &mut Pair, sent: &mut Vec<u8>, addr: u64, len: u64, flags: SendFlags| {
        let data = pattern(len as usize, sent.len() as u8);
        p.write(0, addr, &data);
        let s = p.d[0].submit_send(addr, len, flags);
        assert_eq!(p.poll(0, s), Some(Ok(len)));
        sent.extend(data);
    };
    send(&mut p, &mut sent, BUF, 100, PROTECTABLE);
    let edged = 3 * PAGE + 100;
    let middle = pages::whole_pages(BUF + 0x100, edged, PAGE);
    send(&mut p, &mut sent, BUF + 0x100, edged, PROTECTABLE);
    send(&mut p, &mut sent, FILE, 4 * PAGE, nonblocking);
    // Blocking, from the same memory: synchronous zero-copy, not a copy.
    let again = sent[sent.len() - 4 * PAGE as usize..].to_vec();
    let z = p.d[0].submit_send(FILE, 4 * PAGE, PROTECTABLE);
    let mut got = Vec::new();
    let want = 100 + edged + 8 * PAGE;
    while (got.len() as u64) < want {
        let r = p.recv(1, DST, 1 << 20);
        let n = p.wait(1, r).expect("recv");
        got.extend(p.read(1, DST, n as usize));
    }
    assert_eq!(p.wait(0, z), Ok(4 * PAGE));
    sent.extend(again);
    assert_eq!(got, sent);
    // A fault on an in-flight buffer: the next non-blocking send is copied
    // (sends are synchronous now).
    send(&mut p, &mut sent, BUF + 0x10_0000, 4 * PAGE, PROTECTABLE);
    p.d[0].submit_fault(BUF + 0x10_0000, Access::Write);
    let r = p.recv_all(1, DST, 4 * PAGE);
    assert_eq!(p.wait(1, r), Ok(4 * PAGE));
    p.run_for(Duration::from_millis(1));
    assert_eq!(p.d[0].connection().tx_mode(), TxMode::Sync);
    send(&mut p, &mut sent, BUF, 4 * PAGE, nonblocking);
    let c = p.counters(0);
    assert_eq!(c.copied(CopyReason::Small), 100);
    assert_eq!(
        c.copied(CopyReason::Edges),
        edged - (middle.end - middle.start)
    );
    assert_eq!(c.copied(CopyReason::Memory), 4 * PAGE);
    assert_eq!(c.copied_memory, Some(Unprotectable::File));
    assert_eq!(c.copied(CopyReason::FaultRate), 4 * PAGE);
    assert_eq!(c.bytes_sent_sync, 4 * PAGE);
    assert_eq!(c.copied.iter().sum::<u64>(), c.bytes_sent_bsdp);
    let summary = c.copy_summary();
    assert!(summary.contains("memory (file-mapping) 16384"), "{summary}");
}

#[test]
fn the_transmit_buffer_grows_only_to_the_largest_message_sent() {
    // Below the zero-copy threshold: every byte goes by copy, in DATA.
    let mut p = Pair::new(cfg(Role::Client), cfg(Role::Server));
    let (s, data) = p.send_pattern(0, 1000, 5);
    assert_eq!(p.wait(0, s), Ok(1000));
    let r = p.recv_all(1, DST, 1000);
    assert_eq!(p.wait(1, r), Ok(1000));
    assert_eq!(p.read(1, DST, 1000), data);
    // The largest message either side may send is the slot's length; a
    // connection of small messages holds a buffer their size.
    let largest = p.d[0].connection().max_message_len();
    let small = p.d[0].transmit_buffer_len();
    assert!((1000..2 * 1024).contains(&small), "{small} bytes");
    assert!(small < largest, "{small} of {largest}");
    let (s, data) = p.send_pattern(0, 6000, 6);
    assert_eq!(p.wait(0, s), Ok(6000));
    let r = p.recv_all(1, DST, 6000);
    assert_eq!(p.wait(1, r), Ok(6000));
    assert_eq!(p.read(1, DST, 6000), data);
    let grown = p.d[0].transmit_buffer_len();
    assert!(grown > small && grown <= largest, "{grown} of {largest}");
}
