//! Direct tests of specific engine behaviours. The simulator (`crate::sim`)
//! covers random interleavings; these pin down semantics one at a time with a
//! tiny two-engine harness whose driver answers operations when told to.

use std::collections::VecDeque;

use super::*;
use crate::sim::memory::FlatMemory;

const MEM: usize = 8 << 20;
const PAGE: u64 = 4096;

fn cfg(role: Role, slots: u16) -> EngineConfig {
    let mut c = EngineConfig::new(
        role,
        Capabilities::ALL,
        LockRegion {
            addr: 0,
            key: 1,
            slots,
        },
    );
    c.zcopy_threshold = 8192;
    c
}

/// Two engines, two memories, and a driver whose operations complete only
/// when `run` is called (so tests can look at the state in between).
struct Pair {
    c: [Connection; 2],
    mem: [FlatMemory; 2],
    locks: [Vec<u64>; 2],
    /// Write-protected and armed pages, per side, as the driver applied them.
    wp: [RangeCounter; 2],
    armed: [RangeCounter; 2],
    pending: [VecDeque<Action>; 2],
    done: Vec<(usize, CallId, Result<u64, CallError>)>,
    resumed: Vec<Ticket>,
    next: u64,
}

impl Pair {
    fn new(c0: EngineConfig, c1: EngineConfig) -> Pair {
        let (s0, s1) = (c0.lock_region.slots, c1.lock_region.slots);
        let mut p = Pair {
            c: [
                Connection::new(c0, Timestamp::ZERO),
                Connection::new(c1, Timestamp::ZERO),
            ],
            mem: [FlatMemory::new(MEM), FlatMemory::new(MEM)],
            locks: [vec![0; s0.into()], vec![0; s1.into()]],
            wp: [RangeCounter::new(), RangeCounter::new()],
            armed: [RangeCounter::new(), RangeCounter::new()],
            pending: [VecDeque::new(), VecDeque::new()],
            done: Vec::new(),
            resumed: Vec::new(),
            next: 1,
        };
        p.run();
        assert_eq!(*p.c[0].state(), State::Established);
        p
    }

    fn id(&mut self) -> u64 {
        self.next += 1;
        self.next
    }

    /// Deliver messages and collect actions until nothing moves; host and
    /// fabric operations are queued, not executed.
    fn pump(&mut self) {
        let t = Timestamp::ZERO;
        for _ in 0..1000 {
            let mut moved = false;
            for s in 0..2 {
                let mut buf = vec![0u8; self.c[s].max_message_len()];
                while let Some(n) = self.c[s].poll_transmit(&mut buf) {
                    self.c[1 - s].handle_message(t, &buf[..n], &mut self.mem[1 - s]);
                    moved = true;
                }
                while let Some(a) = self.c[s].poll_action() {
                    moved = true;
                    match a {
                        Action::CallDone { call, result } => self.done.push((s, call, result)),
                        Action::Resume { ticket } => self.resumed.push(ticket),
                        Action::Unprotect { range } => {
                            self.wp[s]
                                .remove(range)
                                .expect("unprotect of protected pages");
                        }
                        Action::Disarm { range, .. } => {
                            self.armed[s].remove(range).expect("disarm of armed pages");
                        }
                        Action::ReleaseSource { .. }
                        | Action::ReleaseCopy { .. }
                        | Action::RevokeAccess => {}
                        other => self.pending[s].push_back(other),
                    }
                }
            }
            if !moved {
                return;
            }
        }
        panic!("no quiescence");
    }

    /// Execute one queued operation of side `s`.
    fn complete_one(&mut self, s: usize) -> bool {
        let t = Timestamp::ZERO;
        let Some(a) = self.pending[s].pop_front() else {
            return false;
        };
        let (op, c) = match a {
            Action::PrepareSource { op, protect, .. } => {
                for r in protect {
                    self.wp[s].add(r);
                }
                (op, Completion::Prepared(Ok(7)))
            }
            Action::Arm { op, range } => {
                self.armed[s].add(range);
                (op, Completion::Armed(Ok(())))
            }
            Action::Get {
                op, src, dst, len, ..
            } => {
                let bytes = self.mem[1 - s].get(src.addr, len as usize).to_vec();
                self.mem[s].fill(dst, &bytes);
                (op, Completion::Get(Ok(())))
            }
            Action::Cas {
                op,
                target,
                expect,
                new,
            } => {
                let (owner, slot) = match target {
                    CasTarget::Local { slot } => (s, usize::from(slot)),
                    CasTarget::Remote { addr, .. } => (1 - s, (addr / 8) as usize),
                };
                let w = &mut self.locks[owner][slot];
                let old = *w;
                if old == expect {
                    *w = new;
                }
                (op, Completion::Cas(Ok(old)))
            }
            Action::CopyAside { op, addr, len } => {
                let bytes = self.mem[s].get(addr, len as usize).to_vec();
                let dst = 7 << 20;
                self.mem[s].fill(dst, &bytes);
                (op, Completion::Copied(Ok(RemoteBuf { addr: dst, key: 8 })))
            }
            other => panic!("not an operation: {other:?}"),
        };
        self.c[s].handle_completion(t, op, c, &mut self.mem[s]);
        true
    }

    /// Run everything to quiescence.
    fn run(&mut self) {
        loop {
            self.pump();
            let a = self.complete_one(0);
            let b = self.complete_one(1);
            if !a && !b {
                self.pump();
                if self.pending.iter().all(VecDeque::is_empty) {
                    return;
                }
            }
        }
    }

    fn send(&mut self, s: usize, addr: u64, len: u64) -> CallId {
        let call = CallId(self.id());
        let flags = SendFlags {
            nonblocking: false,
            protectable: true,
        };
        self.c[s].send(
            Timestamp::ZERO,
            call,
            UserBuf { addr, len },
            flags,
            &mut self.mem[s],
        );
        call
    }

    fn recv(&mut self, s: usize, addr: u64, len: u64, flags: RecvFlags) -> CallId {
        let call = CallId(self.id());
        self.c[s].recv(
            Timestamp::ZERO,
            call,
            UserBuf { addr, len },
            flags,
            &mut self.mem[s],
        );
        call
    }

    fn result(&self, call: CallId) -> Option<Result<u64, CallError>> {
        self.done.iter().find(|d| d.1 == call).map(|d| d.2)
    }
}

fn pattern(len: usize, salt: u8) -> Vec<u8> {
    (0..len)
        .map(|i| (i as u8).wrapping_mul(31) ^ salt)
        .collect()
}

#[test]
fn azsdp_send_returns_at_once_and_splits_head_and_tail() {
    let mut p = Pair::new(cfg(Role::Client, 4), cfg(Role::Server, 4));
    let (addr, len) = (0x1100u64, 3 * PAGE + 100);
    let data = pattern(len as usize, 1);
    p.mem[0].fill(addr, &data);
    let call = p.send(0, addr, len);
    p.pump();
    // Only the PrepareSource is outstanding; once answered, send() is done
    // while the peer has not read a byte.
    assert_eq!(p.result(call), None);
    p.complete_one(0);
    p.pump();
    assert_eq!(p.result(call), Some(Ok(len)));
    let middle = pages::whole_pages(addr, len, PAGE);
    assert_eq!(p.wp[0].ranges(), vec![middle.clone()]);
    let c = p.c[0].counters();
    assert_eq!(
        c.bytes_sent_bsdp,
        (middle.start - addr) + (addr + len - middle.end)
    );
    assert_eq!(c.bytes_sent_async, middle.end - middle.start);
    // The receiver gets exactly the bytes; the protection lifts.
    let r = p.recv(
        1,
        0x20000,
        len,
        RecvFlags {
            waitall: true,
            ..RecvFlags::default()
        },
    );
    p.run();
    assert_eq!(p.result(r), Some(Ok(len)));
    assert_eq!(p.mem[1].get(0x20000, len as usize), &data[..]);
    assert!(p.wp[0].is_empty());
    assert_eq!(p.c[1].counters().gets, 1);
}

#[test]
fn zsdp_send_waits_for_get_complete() {
    let mut c0 = cfg(Role::Client, 4);
    c0.async_zcopy = false;
    let mut p = Pair::new(c0, cfg(Role::Server, 4));
    assert_eq!(p.c[0].tx_mode(), TxMode::Sync);
    let data = pattern(40_000, 2);
    p.mem[0].fill(0x3333, &data);
    let call = p.send(0, 0x3333, 40_000);
    p.run();
    assert_eq!(
        p.result(call),
        None,
        "ZSDP returns only once the peer has read"
    );
    assert!(p.wp[0].is_empty(), "ZSDP protects nothing");
    let r = p.recv(1, 0x50000, 40_000, RecvFlags::default());
    p.run();
    assert_eq!(p.result(r), Some(Ok(40_000)));
    assert_eq!(p.result(call), Some(Ok(40_000)));
    assert_eq!(p.mem[1].get(0x50000, 40_000), &data[..]);
}

#[test]
fn partial_gets_leave_the_rest_advertised() {
    let mut p = Pair::new(cfg(Role::Client, 4), cfg(Role::Server, 4));
    let data = pattern(8 * PAGE as usize, 3);
    p.mem[0].fill(0x10000, &data);
    let call = p.send(0, 0x10000, 8 * PAGE);
    p.run();
    assert_eq!(p.result(call), Some(Ok(8 * PAGE)));
    let mut got = Vec::new();
    for i in 0..8u64 {
        let r = p.recv(1, 0x100000 + i * 0x10000, PAGE, RecvFlags::default());
        p.run();
        assert_eq!(p.result(r), Some(Ok(PAGE)));
        got.extend_from_slice(p.mem[1].get(0x100000 + i * 0x10000, PAGE as usize));
        // Pages already read are unprotected at once; the rest stay protected.
        let protected: u64 = p.wp[0].ranges().iter().map(|r| r.end - r.start).sum();
        assert_eq!(protected, (7 - i) * PAGE);
    }
    assert_eq!(got, data);
    assert_eq!(p.c[1].counters().gets, 8);
}

#[test]
fn copy_on_write_lets_the_writer_go_and_the_peer_gets_the_old_bytes() {
    let mut p = Pair::new(cfg(Role::Client, 4), cfg(Role::Server, 4));
    let data = pattern(4 * PAGE as usize, 4);
    p.mem[0].fill(0x20000, &data);
    let call = p.send(0, 0x20000, 4 * PAGE);
    p.run();
    assert_eq!(p.result(call), Some(Ok(4 * PAGE)));
    // The application writes page 2 of the in-flight buffer.
    p.c[0].handle_fault(
        Timestamp::ZERO,
        Ticket(99),
        0x20000 + 2 * PAGE + 5,
        Access::Write,
    );
    p.run();
    assert_eq!(
        p.resumed,
        vec![Ticket(99)],
        "the writer went on before the peer read"
    );
    assert!(p.wp[0].is_empty());
    p.mem[0].fill(0x20000 + 2 * PAGE, &[0xff; 64]);
    let c = p.c[0].counters();
    assert_eq!((c.send_faults, c.cow_copies, c.updates_sent), (1, 1, 1));
    let r = p.recv(
        1,
        0x200000,
        4 * PAGE,
        RecvFlags {
            waitall: true,
            ..RecvFlags::default()
        },
    );
    p.run();
    assert_eq!(p.result(r), Some(Ok(4 * PAGE)));
    assert_eq!(p.mem[1].get(0x200000, 4 * PAGE as usize), &data[..]);
}

#[test]
fn block_on_write_waits_for_the_transfer() {
    let mut c0 = cfg(Role::Client, 4);
    c0.write_fault = FaultPolicy::Block;
    c0.block_escalate = std::time::Duration::from_secs(10);
    let mut p = Pair::new(c0, cfg(Role::Server, 4));
    p.mem[0].fill(0x40000, &pattern(2 * PAGE as usize, 5));
    p.send(0, 0x40000, 2 * PAGE);
    p.run();
    p.c[0].handle_fault(Timestamp::ZERO, Ticket(7), 0x40000, Access::Write);
    p.run();
    assert!(p.resumed.is_empty(), "block-on-write waits");
    let r = p.recv(1, 0x300000, 2 * PAGE, RecvFlags::default());
    p.run();
    assert_eq!(p.result(r), Some(Ok(2 * PAGE)));
    assert_eq!(p.resumed, vec![Ticket(7)]);
    assert_eq!(p.c[0].counters().cow_copies, 0);
}

#[test]
fn receive_side_protection_returns_before_the_data_lands() {
    let mut c1 = cfg(Role::Server, 4);
    c1.recv_protect = RecvProtect::On;
    let mut p = Pair::new(cfg(Role::Client, 4), c1);
    let data = pattern(6 * PAGE as usize, 6);
    p.mem[0].fill(0x60000, &data);
    p.send(0, 0x60000, 6 * PAGE);
    p.run();
    // Destination misaligned by 100 bytes: edges are fetched before return,
    // the 5 whole pages in between are armed and land later.
    let dst = 0x400000 + 100;
    let flags = RecvFlags {
        armable: true,
        ..RecvFlags::default()
    };
    let r = p.recv(1, dst, 6 * PAGE, flags);
    p.pump();
    while p.pending[1]
        .iter()
        .any(|a| matches!(a, Action::Cas { .. } | Action::Arm { .. }))
        || p.pending[1]
            .iter()
            .any(|a| matches!(a, Action::Get { armed: false, .. }))
    {
        // Complete everything except the armed GET.
        let i = p.pending[1]
            .iter()
            .position(|a| !matches!(a, Action::Get { armed: true, .. }))
            .expect("an operation to run");
        let a = p.pending[1].remove(i).expect("present");
        p.pending[1].push_front(a);
        p.complete_one(1);
        p.pump();
    }
    assert_eq!(
        p.result(r),
        Some(Ok(6 * PAGE)),
        "recv returned with data still in flight"
    );
    let middle = pages::whole_pages(dst, 6 * PAGE, PAGE);
    assert_eq!(p.armed[1].ranges(), vec![middle.clone()]);
    // Touching an armed page waits for the data.
    p.c[1].handle_fault(Timestamp::ZERO, Ticket(5), middle.start + 10, Access::Read);
    p.pump();
    assert!(p.resumed.is_empty());
    p.run();
    assert_eq!(p.resumed, vec![Ticket(5)]);
    assert!(p.armed[1].is_empty());
    assert_eq!(p.mem[1].get(dst, 6 * PAGE as usize), &data[..]);
    assert_eq!(p.c[1].counters().armed_recvs, 1);
}

#[test]
fn fault_rate_fallback_is_visible_and_recovers() {
    let mut c0 = cfg(Role::Client, 4);
    c0.fallback_faults = 2;
    c0.fallback_window = 4;
    c0.fallback_recover = 2;
    let mut p = Pair::new(c0, cfg(Role::Server, 4));
    for i in 0..2u64 {
        p.mem[0].fill(0x80000, &pattern(2 * PAGE as usize, i as u8));
        p.send(0, 0x80000, 2 * PAGE);
        p.run();
        p.c[0].handle_fault(Timestamp::ZERO, Ticket(i), 0x80000, Access::Write);
        p.run();
        let r = p.recv(1, 0x500000, 2 * PAGE, RecvFlags::default());
        p.run();
        assert_eq!(p.result(r), Some(Ok(2 * PAGE)));
    }
    let c = p.c[0].counters();
    assert_eq!(c.fallbacks, 1);
    assert_eq!(c.fallback_reason, Some(FallbackReason::FaultRate));
    assert_eq!(p.c[0].tx_mode(), TxMode::Sync);
    // Two synchronous sends later, AZ-SDP is back.
    for _ in 0..2 {
        let s = p.send(0, 0x80000, 2 * PAGE);
        let r = p.recv(1, 0x500000, 2 * PAGE, RecvFlags::default());
        p.run();
        assert_eq!(p.result(s), Some(Ok(2 * PAGE)));
        assert_eq!(p.result(r), Some(Ok(2 * PAGE)));
    }
    assert_eq!(p.c[0].counters().recoveries, 1);
    assert_eq!(p.c[0].tx_mode(), TxMode::Async);
}

#[test]
fn credits_coalesce_small_sends_while_short() {
    let mut c1 = cfg(Role::Server, 4);
    c1.rx_credits = 1;
    let mut p = Pair::new(cfg(Role::Client, 4), c1);
    for i in 0..10u64 {
        p.mem[0].fill(0x1000 + i * 10, &[i as u8; 10]);
        let s = p.send(0, 0x1000 + i * 10, 10);
        p.run();
        assert_eq!(p.result(s), Some(Ok(10)), "buffered sends return at once");
    }
    // One credit: the first DATA went alone, the other nine sends wait and
    // leave together when the credit returns.
    assert_eq!(p.c[0].counters().data_msgs_sent, 1);
    let r = p.recv(1, 0x9000, 100, RecvFlags::default());
    p.run();
    assert_eq!(p.result(r), Some(Ok(10)));
    let r = p.recv(1, 0x9000 + 10, 100, RecvFlags::default());
    p.run();
    assert_eq!(p.result(r), Some(Ok(90)));
    assert_eq!(p.c[0].counters().data_msgs_sent, 2);
}

#[test]
fn shutdown_delivers_eof_after_all_data_and_close_with_unread_data_resets() {
    let mut p = Pair::new(cfg(Role::Client, 4), cfg(Role::Server, 4));
    p.mem[0].fill(0x1000, b"last words");
    p.send(0, 0x1000, 10);
    p.c[0].shutdown(Timestamp::ZERO, Shutdown::Write, &mut p.mem[0]);
    p.run();
    let s = p.send(0, 0x1000, 10);
    p.run();
    assert_eq!(p.result(s), Some(Err(CallError::BrokenPipe)));
    let r = p.recv(1, 0x9000, 100, RecvFlags::default());
    p.run();
    assert_eq!(p.result(r), Some(Ok(10)));
    let r = p.recv(1, 0x9000, 100, RecvFlags::default());
    p.run();
    assert_eq!(p.result(r), Some(Ok(0)), "EOF");

    let mut q = Pair::new(cfg(Role::Client, 4), cfg(Role::Server, 4));
    q.mem[0].fill(0x1000, b"unread");
    q.send(0, 0x1000, 6);
    q.run();
    q.c[1].close(Timestamp::ZERO, Linger::Background, &mut q.mem[1]);
    q.run();
    assert!(matches!(
        q.c[0].state(),
        State::Aborted(AbortReason::PeerAbort(AbortCode::Reset))
    ));
    // As TCP after a reset: the error once, then EPIPE.
    let s = q.send(0, 0x1000, 6);
    q.run();
    assert_eq!(q.result(s), Some(Err(CallError::ConnReset)));
    let s = q.send(0, 0x1000, 6);
    q.run();
    assert_eq!(q.result(s), Some(Err(CallError::BrokenPipe)));
    assert!(!q.c[0].readiness().error, "reported");
}

#[test]
fn abort_releases_every_page_and_fails_blocked_calls() {
    let mut p = Pair::new(cfg(Role::Client, 4), cfg(Role::Server, 4));
    p.mem[0].fill(0x10000, &pattern(4 * PAGE as usize, 7));
    p.send(0, 0x10000, 4 * PAGE);
    let r = p.recv(0, 0x200000, 100, RecvFlags::default());
    p.run();
    assert!(!p.wp[0].is_empty());
    p.c[0].handle_peer_gone(Timestamp::ZERO);
    p.pump();
    assert!(p.wp[0].is_empty(), "pages released");
    assert_eq!(p.result(r), Some(Err(CallError::ConnReset)));
    assert!(p.c[0].is_finished());
}

#[test]
fn garbage_aborts_without_panic() {
    let mut mem = FlatMemory::new(4096);
    let mut s = Connection::new(cfg(Role::Server, 4), Timestamp::ZERO);
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

#[test]
fn a_peer_that_leaves_after_a_clean_close_ends_nothing() {
    let mut p = Pair::new(cfg(Role::Client, 4), cfg(Role::Server, 4));
    p.mem[0].fill(0x10000, &pattern(4 * PAGE as usize, 9));
    p.send(0, 0x10000, 4 * PAGE);
    p.run();
    p.c[0].close(Timestamp::ZERO, Linger::Background, &mut p.mem[0]);
    let r = p.recv(1, 0x200000, 8 * PAGE, RecvFlags::default());
    p.run();
    assert_eq!(p.result(r), Some(Ok(4 * PAGE)));
    assert!(p.c[0].is_finished(), "the sender's close is done");
    // The reader exits at once (its process, and the fabric, are gone).
    p.c[0].handle_peer_gone(Timestamp::ZERO);
    p.pump();
    assert_eq!(
        *p.c[0].state(),
        State::Established,
        "a clean close stays clean"
    );

    // But a peer that leaves while data is owed is a failure.
    let mut q = Pair::new(cfg(Role::Client, 4), cfg(Role::Server, 4));
    q.mem[0].fill(0x10000, &pattern(4 * PAGE as usize, 9));
    q.send(0, 0x10000, 4 * PAGE);
    q.run();
    q.c[0].close(Timestamp::ZERO, Linger::Background, &mut q.mem[0]);
    q.pump();
    q.c[0].handle_peer_gone(Timestamp::ZERO);
    q.pump();
    assert_eq!(*q.c[0].state(), State::Aborted(AbortReason::PeerGone));
}

fn left(sent: u64, read: u64) -> Departure {
    Departure { sent, read }
}

/// A peer that dies having read everything we sent ends our stream with
/// EOF and makes the socket writable, with sends failing (EPIPE); one that
/// dies with some of it unread, even data that reached its buffers, resets
/// the connection, as a TCP peer's RST does.
#[test]
fn a_peer_that_dies_with_our_data_unread_resets_the_connection() {
    let small = 1000;
    for read_it in [true, false] {
        let mut p = Pair::new(cfg(Role::Client, 4), cfg(Role::Server, 4));
        p.mem[0].fill(0x10000, &pattern(small as usize, 3));
        let s = p.send(0, 0x10000, small);
        p.run();
        assert_eq!(p.result(s), Some(Ok(small)));
        if read_it {
            let r = p.recv(1, 0x200000, 4 * PAGE, RecvFlags::default());
            p.run();
            assert_eq!(p.result(r), Some(Ok(small)));
        }
        // The receiver dies; the sender learns how far it read.
        let gone = p.c[1].progress_made();
        assert_eq!(gone.read, if read_it { small } else { 0 });
        p.c[0].handle_peer_left(Timestamp::ZERO, Some(gone), &mut p.mem[0]);
        p.pump();
        let ready = p.c[0].readiness();
        assert!(ready.readable && ready.writable, "{ready:?}");
        let s = p.send(0, 0x10000, small);
        p.run();
        if read_it {
            // As TCP to a peer that closed: this send goes (nobody reads
            // it: a reset), the next fails with EPIPE, receives see EOF.
            assert_eq!(p.result(s), Some(Ok(small)));
            assert_eq!(*p.c[0].state(), State::Aborted(AbortReason::PeerGone));
            assert!(p.c[0].readiness().error);
            let r = p.recv(0, 0x200000, 100, RecvFlags::default());
            p.run();
            assert_eq!(p.result(r), Some(Ok(0)));
            let s = p.send(0, 0x10000, small);
            p.run();
            assert_eq!(p.result(s), Some(Err(CallError::BrokenPipe)));
            assert!(!p.c[0].readiness().error);
        } else {
            assert_eq!(*p.c[0].state(), State::Aborted(AbortReason::PeerGone));
            assert!(ready.error);
            assert_eq!(p.c[0].counters().bytes_unread_by_peer, small);
            assert!(p.result(s).is_some_and(|r| r.is_err()));
        }
    }
}

/// A peer that dies leaving nothing unsent (all its returned sends arrived,
/// nothing advertised from its memory) ends the stream with EOF after the
/// data, as TCP does; one that leaves data behind is a reset.
#[test]
fn a_peer_that_dies_owing_nothing_ends_with_eof() {
    let small = 1000;
    let mut p = Pair::new(cfg(Role::Client, 4), cfg(Role::Server, 4));
    p.mem[0].fill(0x10000, &pattern(small as usize, 3));
    let s = p.send(0, 0x10000, small);
    p.run();
    assert_eq!(p.result(s), Some(Ok(small)));
    let sent = p.c[0].tx_returned();
    assert_eq!(sent, small);
    // The sender dies; the receiver has not read yet.
    p.c[1].handle_peer_left(Timestamp::ZERO, Some(left(sent, 0)), &mut p.mem[1]);
    let r = p.recv(1, 0x200000, 4 * PAGE, RecvFlags::default());
    p.run();
    assert_eq!(p.result(r), Some(Ok(small)), "the data first");
    let r = p.recv(1, 0x200000, 4 * PAGE, RecvFlags::default());
    p.run();
    assert_eq!(p.result(r), Some(Ok(0)), "then EOF");

    // It claimed more than arrived: data died with it.
    let mut q = Pair::new(cfg(Role::Client, 4), cfg(Role::Server, 4));
    q.mem[0].fill(0x10000, &pattern(small as usize, 3));
    q.send(0, 0x10000, small);
    q.run();
    q.c[1].handle_peer_left(Timestamp::ZERO, Some(left(small + 1, 0)), &mut q.mem[1]);
    q.pump();
    assert_eq!(*q.c[1].state(), State::Aborted(AbortReason::PeerGone));

    // Zero-copy data still in its memory: lost too.
    let mut z = Pair::new(cfg(Role::Client, 4), cfg(Role::Server, 4));
    z.mem[0].fill(0x10000, &pattern(4 * PAGE as usize, 3));
    z.send(0, 0x10000, 4 * PAGE);
    z.run();
    let sent = z.c[0].tx_returned();
    z.c[1].handle_peer_left(Timestamp::ZERO, Some(left(sent, 0)), &mut z.mem[1]);
    z.pump();
    assert_eq!(*z.c[1].state(), State::Aborted(AbortReason::PeerGone));
}

#[test]
fn a_timeout_says_what_the_connection_was_waiting_for() {
    let mut p = Pair::new(cfg(Role::Client, 4), cfg(Role::Server, 4));
    // Side 0 waits for data the silent peer never sends.
    let r = p.recv(0, 0x200000, 100, RecvFlags::default());
    p.run();
    let timeout = p.c[0].cfg.peer_timeout;
    let later = Timestamp::ZERO + timeout + std::time::Duration::from_millis(1);
    p.c[0].handle_timeout(later, &mut p.mem[0]);
    p.pump();
    assert_eq!(p.result(r), Some(Err(CallError::TimedOut)));
    let w = p.c[0].stalled().expect("a timeout says what it waited for");
    assert!(w.contains("1 recv call(s)"), "{w}");
    assert!(w.contains("peer silent"), "{w}");
    assert_eq!(p.c[1].stalled(), None);
}
