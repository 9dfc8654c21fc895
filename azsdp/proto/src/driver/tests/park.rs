//! Parking an engine (an `exec`) and taking it up in a new driver: the
//! stream goes on where it was, each way, with what was in flight on the
//! peer's side (its advertisements, DATA in the ring) read by the new one.

use std::time::Duration;

use proptest::prelude::*;

use super::*;

impl Pair {
    /// Side `s` waits until its engine may park (its advertisements read
    /// by the peer), parks it, and a fresh driver (new protector and host)
    /// takes it up on the same endpoint.
    fn park_and_take_up(&mut self, s: usize) -> usize {
        self.d[s].pause_arms(true);
        self.run_until(Duration::from_millis(100), |p| {
            p.d[s].park_blocker().is_none()
        });
        let bytes = self.d[s].park().expect("quiet");
        let p = SimProtector::new(s, Rc::clone(&self.mems), crate::sim::rng::Rng::new(99), 0.0);
        let log = Rc::clone(&p.log);
        let mut host = SimHost::new(
            s,
            Rc::clone(&self.mems),
            self.clock.clone(),
            Rc::clone(&self.tcp),
        );
        host.unprotectable = Rc::clone(&self.unprotectable[s]);
        let ep = SimEndpoint::new(Rc::clone(&self.fabric), s);
        self.d[s] = Driver::unpark(&bytes, ep, p, host).expect("unpark");
        self.logs[s] = log;
        bytes.len()
    }
}

impl Pair {
    /// Side `from` sends `data` (from memory it may protect); the other
    /// receives all of it: what arrived.
    fn send_whole(&mut self, from: usize, data: &[u8]) -> Vec<u8> {
        let len = data.len() as u64;
        self.write(from, BUF + 0x40000, data);
        let s = self.send(from, BUF + 0x40000, len);
        let r = self.recv_all(1 - from, DST + 0x40000, len);
        assert_eq!(self.wait(1 - from, r), Ok(len));
        assert_eq!(self.wait(from, s), Ok(len));
        self.read(1 - from, DST + 0x40000, data.len())
    }
}

#[test]
fn a_parked_engine_goes_on_in_a_new_driver_each_way() {
    let mut p = Pair::new(cfg(Role::Client), cfg(Role::Server));
    // Side 0 sends DATA and a zero-copy send the peer reads half of; side
    // 1 sends DATA and an advertisement side 0 has not read at all.
    let a = pattern(3000, 1);
    let b = pattern(6 * PAGE as usize + 50, 2);
    p.write(0, BUF, &a);
    p.write(0, BUF + 0x10000, &b);
    let s = p.send(0, BUF, a.len() as u64);
    assert_eq!(p.poll(0, s), Some(Ok(3000)));
    let s = p.send(0, BUF + 0x10000, b.len() as u64);
    assert_eq!(p.poll(0, s), Some(Ok(b.len() as u64)));
    let c = pattern(5000, 3);
    let d = pattern(5 * PAGE as usize, 4);
    p.write(1, BUF, &c);
    p.write(1, BUF + 0x10000, &d);
    let s = p.send(1, BUF, c.len() as u64);
    assert_eq!(p.poll(1, s), Some(Ok(5000)));
    let s1 = p.send(1, BUF + 0x10000, d.len() as u64);
    let r = p.recv_all(1, DST, 3000 + 2 * PAGE);
    let n = p.wait(1, r).unwrap();
    let mut got0 = p.read(1, DST, n as usize);
    // Side 1 reads the rest of side 0's advertisement, so side 0 may park.
    let rest = (a.len() + b.len()) as u64 - n;
    let r = p.recv_all(1, DST, rest);
    let parked = {
        let len = p.park_and_take_up(0);
        assert_eq!(p.wait(1, r), Ok(rest));
        len
    };
    got0.extend(p.read(1, DST, rest as usize));
    assert!(parked > 0);
    // The new image reads what side 1 sent before and during the park.
    let r = p.recv_all(0, DST, (c.len() + d.len()) as u64);
    assert_eq!(p.wait(0, r), Ok((c.len() + d.len()) as u64));
    assert_eq!(p.poll(1, s1), Some(Ok(d.len() as u64)));
    let mut got1 = p.read(0, DST, c.len() + d.len());
    // And both go on: a zero-copy send each way after the park.
    let e = pattern(4 * PAGE as usize, 5);
    got0.extend(p.send_whole(0, &e));
    let f = pattern(3 * PAGE as usize + 7, 6);
    got1.extend(p.send_whole(1, &f));
    assert_eq!(got0, [a, b, e].concat());
    assert_eq!(got1, [c, d, f].concat());
    // The counters carried over: everything either side sent is counted.
    let sent0: u64 = p.counters(0).bytes_sent();
    assert_eq!(sent0, got0.len() as u64);
    assert_eq!(p.counters(0).bytes_received(), got1.len() as u64);
    assert!(p.counters(0).bytes_sent_async > 0 && p.counters(1).gets > 0);
}

#[test]
fn an_engine_with_pages_out_or_a_call_in_progress_does_not_park() {
    let mut p = Pair::new(cfg(Role::Client), cfg(Role::Server));
    let b = pattern(6 * PAGE as usize, 2);
    p.write(0, BUF, &b);
    let s = p.send(0, BUF, b.len() as u64);
    assert_eq!(p.poll(0, s), Some(Ok(b.len() as u64)));
    assert_eq!(p.d[0].park(), Err(crate::conn::Unparkable::Advertised));
    let r = p.recv(0, DST, 100);
    p.run_for(Duration::from_millis(1));
    assert_eq!(p.d[0].park_blocker(), Some(crate::conn::Unparkable::Calls));
    p.d[0].cancel(r);
    assert_eq!(p.d[0].take_result(r), Some(Err(CallError::Interrupted)));
}

/// The parked bytes the test below mangles.
fn parked_bytes() -> (Pair, Vec<u8>) {
    let mut p = Pair::new(cfg(Role::Client), cfg(Role::Server));
    p.write(1, BUF, &pattern(700, 1));
    let s = p.send(1, BUF, 700);
    assert_eq!(p.poll(1, s), Some(Ok(700)));
    let bytes = p.d[0].park().expect("quiet");
    (p, bytes)
}

fn unpark_in(p: &Pair, bytes: &[u8]) -> Result<SimDriver, UnparkError> {
    let prot = SimProtector::new(0, Rc::clone(&p.mems), crate::sim::rng::Rng::new(1), 0.0);
    let host = SimHost::new(0, Rc::clone(&p.mems), p.clock.clone(), Rc::clone(&p.tcp));
    Driver::unpark(bytes, SimEndpoint::new(Rc::clone(&p.fabric), 0), prot, host)
}

#[test]
fn parked_bytes_of_another_build_or_cut_short_are_refused() {
    let (p, bytes) = parked_bytes();
    assert!(unpark_in(&p, &bytes).is_ok());
    assert_eq!(
        unpark_in(&p, b"not parked").err(),
        Some(UnparkError::NotParked)
    );
    for cut in 0..bytes.len() {
        assert!(unpark_in(&p, &bytes[..cut]).is_err(), "cut at {cut}");
    }
    // Another build: its version string differs.
    let mut other = bytes.clone();
    let at = 8 + 1; // after the magic and the string's length
    other[at] ^= 0x01;
    assert!(matches!(
        unpark_in(&p, &other),
        Err(UnparkError::OtherBuild(..))
    ));
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(300))]
    /// Whatever the bytes, taking them up answers (an engine or an error),
    /// never panics.
    #[test]
    fn mangled_parked_bytes_never_panic(
        flips in proptest::collection::vec((any::<prop::sample::Index>(), any::<u8>()), 1..8),
        tail in proptest::collection::vec(any::<u8>(), 0..64),
    ) {
        let (p, mut bytes) = parked_bytes();
        for (i, x) in flips {
            let i = i.index(bytes.len());
            bytes[i] ^= x;
        }
        bytes.extend(tail);
        let _ = unpark_in(&p, &bytes);
    }
}
