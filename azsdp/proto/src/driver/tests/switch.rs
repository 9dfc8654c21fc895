//! Leaving the fabric for TCP: every byte sent arrives once, in order,
//! whatever was in flight (DATA, advertisements read halfway, copies made
//! by copy-on-write, unposted sends), in both directions.

use std::time::Duration;

use super::*;
use crate::conn::{Resend, ResendPiece};

/// The TCP connection beneath a pair: what each side wrote to it.
#[derive(Default)]
struct Tcp {
    wrote: [Vec<u8>; 2],
    shut: [bool; 2],
}

impl Pair {
    /// Write side `s`'s resend to `tcp` (as the shim writes it to the
    /// kernel socket), then tell the driver.
    fn resend(&mut self, s: usize, tcp: &mut Tcp) -> Resend {
        let r = self.d[s].take_resend().expect("a resend");
        for p in &r.pieces {
            match p {
                ResendPiece::Bytes(b) => tcp.wrote[s].extend_from_slice(b),
                ResendPiece::Memory { addr, len } => {
                    let bytes = self.read(s, *addr, *len as usize);
                    tcp.wrote[s].extend(bytes);
                }
            }
        }
        tcp.shut[s] = r.shutdown;
        self.d[s].resend_written();
        r
    }

    /// Both sides leave (side `first` starts): their resends go to `tcp`.
    fn switch(&mut self, first: usize, tcp: &mut Tcp) -> [Resend; 2] {
        self.d[first].leave_fabric();
        self.run_until(Duration::from_secs(1), |p| {
            p.d[0].connection().switch_sent() && p.d[1].connection().switch_sent()
        });
        self.run_for(Duration::from_millis(1));
        let r0 = self.resend(0, tcp);
        let r1 = self.resend(1, tcp);
        self.run_for(Duration::from_millis(1));
        for d in &self.d {
            assert_eq!(*d.connection().state(), State::Switched);
            assert!(d.is_finished());
        }
        [r0, r1]
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
    let mut tcp = Tcp::default();
    let [r0, r1] = p.switch(0, &mut tcp);
    assert_eq!(r0.from, n);
    assert_eq!(r1.from, 1000);
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
    let mut tcp = Tcp::default();
    p.switch(1, &mut tcp);
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
    p.d[1].leave_fabric();
    let mut tcp = Tcp::default();
    p.switch(1, &mut tcp);
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
    let mut tcp = Tcp::default();
    p.switch(0, &mut tcp);
    assert_eq!(p.d[0].take_result(r), Some(Err(CallError::Switched)));
    assert_eq!(
        p.d[0].take_result(s),
        Some(Ok(3 * PAGE)),
        "its bytes are in the resend"
    );
    assert_eq!(tcp.wrote[0], data);
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
    let mut tcp = Tcp::default();
    let [r0, _] = p.switch(0, &mut tcp);
    assert!(r0.pieces.is_empty(), "{r0:?}");
    assert_eq!(r0.from, 20_000);
}
