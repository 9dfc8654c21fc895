use std::os::fd::{AsFd, OwnedFd};
use std::os::unix::net::UnixStream;
use std::sync::atomic::Ordering;
use std::time::{Duration, Instant};

use super::segment::{FROZEN, KEY_SLOT_BITS, KEY_SLOT_MASK, PID_MASK, Segment};
use super::*;
use crate::conn::{CasTarget, OpError, OpId, RemoteBuf};
use crate::fabric::{Fabric, FabricError, FabricEvent, LocalBuf, OpResult};
use crate::pairing::{INTRO_LEN, Intro, IntroKind};

fn params() -> ShmParams {
    ShmParams {
        ring_capacity: 1 << 16,
        lock_slots: 8,
        poll: Duration::from_micros(5),
        keep_for_exec: false,
    }
}

/// Both ends in one process (process_vm_readv on one's own pid works).
fn pair() -> (ShmEndpoint, ShmEndpoint) {
    let (a, b) = UnixStream::pair().unwrap();
    let t = std::thread::spawn(move || ShmEndpoint::accept(&b, params()).unwrap());
    let e0 = ShmEndpoint::offer(&a, params()).unwrap();
    (e0, t.join().unwrap())
}

enum Got {
    Msg(Vec<u8>),
    Done(OpId, OpResult),
    Gone,
}

fn drain(e: &mut ShmEndpoint) -> Vec<Got> {
    let mut v = Vec::new();
    e.poll(&mut |ev| {
        v.push(match ev {
            FabricEvent::Message(m) => Got::Msg(m.to_vec()),
            FabricEvent::Done { op, result } => Got::Done(op, result),
            FabricEvent::PeerGone { .. } => Got::Gone,
        })
    });
    v
}

#[test]
fn messages_gets_and_cas_within_one_process() {
    let (mut a, mut b) = pair();
    assert_eq!(a.can_get(), None);
    assert_eq!(b.can_get(), None);
    a.post_message(b"hello").unwrap();
    b.wait(Duration::from_secs(1));
    assert!(matches!(&drain(&mut b)[..], [Got::Msg(m)] if m == b"hello"));

    // GET: b reads a's buffer straight into its own.
    let src: Vec<u8> = (0..100_000u32).map(|i| (i % 251) as u8).collect();
    let mut dst = vec![0u8; src.len()];
    let key = a.register(src.as_ptr() as u64, src.len() as u64).unwrap();
    b.post_get(
        OpId(1),
        RemoteBuf {
            addr: src.as_ptr() as u64,
            key,
        },
        LocalBuf {
            addr: dst.as_mut_ptr() as u64,
            key: 0,
        },
        src.len() as u64,
    )
    .unwrap();
    assert!(matches!(
        drain(&mut b)[..],
        [Got::Done(OpId(1), OpResult::Get(Ok(())))]
    ));
    assert_eq!(dst, src);

    // CAS on the peer's lock word 3, then the owner sees the result locally.
    let region = a.lock_region();
    let target = CasTarget::Remote {
        addr: region.addr + 24,
        key: region.key,
    };
    b.post_cas(OpId(2), target, 0, 7).unwrap();
    b.post_cas(OpId(3), target, 0, 9).unwrap();
    let r = drain(&mut b);
    assert!(matches!(r[0], Got::Done(OpId(2), OpResult::Cas(Ok(0)))));
    assert!(
        matches!(r[1], Got::Done(OpId(3), OpResult::Cas(Ok(7)))),
        "second CAS loses"
    );
    a.post_cas(OpId(4), CasTarget::Local { slot: 3 }, 7, 8)
        .unwrap();
    assert!(matches!(
        drain(&mut a)[..],
        [Got::Done(OpId(4), OpResult::Cas(Ok(7)))]
    ));

    // A wrong key, a misaligned or out-of-range word: refused.
    for t in [
        CasTarget::Remote {
            addr: region.addr,
            key: region.key ^ 1,
        },
        CasTarget::Remote {
            addr: region.addr + 3,
            key: region.key,
        },
        CasTarget::Remote {
            addr: region.addr + 8 * 8,
            key: region.key,
        },
        CasTarget::Local { slot: 8 },
    ] {
        b.post_cas(OpId(5), t, 0, 1).unwrap();
        assert!(matches!(
            drain(&mut b)[..],
            [Got::Done(_, OpResult::Cas(Err(OpError::RemoteAccess)))]
        ));
    }

    // After a revokes access, b's GETs and CASes on a fail.
    a.revoke_access();
    b.post_get(
        OpId(6),
        RemoteBuf {
            addr: src.as_ptr() as u64,
            key,
        },
        LocalBuf {
            addr: dst.as_mut_ptr() as u64,
            key: 0,
        },
        8,
    )
    .unwrap();
    assert!(matches!(
        drain(&mut b)[..],
        [Got::Done(_, OpResult::Get(Err(OpError::Unreachable)))]
    ));
    b.post_cas(OpId(7), target, 8, 1).unwrap();
    assert!(matches!(
        drain(&mut b)[..],
        [Got::Done(_, OpResult::Cas(Err(OpError::Unreachable)))]
    ));

    // A clean close is seen as the peer going away.
    a.close();
    b.wait(Duration::from_secs(1));
    assert!(matches!(drain(&mut b)[..], [Got::Gone]));
}

#[test]
fn full_ring_and_oversize_messages() {
    let (mut a, mut b) = pair();
    let big = vec![0u8; 1 << 16];
    assert_eq!(a.post_message(&big), Err(FabricError::TooLarge));
    let msg = vec![1u8; 4000];
    let mut sent = 0;
    while a.post_message(&msg).is_ok() {
        sent += 1;
    }
    assert!(sent >= 8, "sent {sent}");
    assert_eq!(a.post_message(&msg), Err(FabricError::NoCredits));
    assert_eq!(drain(&mut b).len(), sent);
    assert!(a.post_message(&msg).is_ok());
}

#[test]
fn bootstrap_rejects_garbage() {
    let (a, b) = UnixStream::pair().unwrap();
    use std::io::Write;
    // Bytes without the sender's kernel identity.
    (&a).write_all(&[0u8; INTRO_LEN]).unwrap();
    assert!(ShmEndpoint::accept(&b, params()).is_err());
    // A peer that goes away in the middle of its introduction.
    let (a, b) = UnixStream::pair().unwrap();
    (&a).write_all(&[0u8; 20]).unwrap();
    drop(a);
    assert!(ShmEndpoint::accept(&b, params()).is_err());
    // An identified offer of the wrong kind, or without a segment.
    let (a, b) = UnixStream::pair().unwrap();
    send_intro(a.as_fd(), &Intro::new(IntroKind::Claim, 4096), &[], false).unwrap();
    let e = ShmEndpoint::accept(&b, params()).unwrap_err();
    assert!(e.to_string().contains("expected Offer"), "{e}");
    let (a, b) = UnixStream::pair().unwrap();
    send_intro(a.as_fd(), &Intro::new(IntroKind::Offer, 4096), &[], false).unwrap();
    let e = ShmEndpoint::accept(&b, params()).unwrap_err();
    assert!(e.to_string().contains("a segment and a bell"), "{e}");
}

#[test]
fn a_note_is_taken_whole_or_refused_with_what_came_with_it() {
    use crate::pairing::PairTarget;
    let note = Intro {
        kind: IntroKind::Connected,
        page_size: 4096,
        pair: Some(PairTarget {
            dst: "127.0.0.1:40000".parse().unwrap(),
            cookie: 7,
        }),
        bell: None,
    };
    let (a, b) = crate::scm::seqpacket_pair();
    // Nothing yet.
    assert!(matches!(
        recv_note(b.as_fd(), IntroKind::Connected),
        Ok(None)
    ));
    send_note(a.as_fd(), &note).unwrap();
    let got = recv_note(b.as_fd(), IntroKind::Connected).unwrap();
    assert_eq!(got, Some(note));
    // Of another kind, or with descriptors (closed here), or garbage.
    send_note(a.as_fd(), &Intro::new(IntroKind::Offer, 4096)).unwrap();
    assert!(recv_note(b.as_fd(), IntroKind::Connected).is_err());
    send_intro(a.as_fd(), &note, &[], false).unwrap();
    assert!(matches!(
        recv_note(b.as_fd(), IntroKind::Connected),
        Err(IntroError::NoteCarries)
    ));
    nix::sys::socket::send(
        std::os::fd::AsRawFd::as_raw_fd(&a),
        &[0x5a; 30],
        nix::sys::socket::MsgFlags::empty(),
    )
    .unwrap();
    assert!(recv_note(b.as_fd(), IntroKind::Connected).is_err());
    // The sender gone.
    drop(a);
    assert!(recv_note(b.as_fd(), IntroKind::Connected).is_err());
}

/// A way to spoil a segment before it is offered.
type Spoil = Box<dyn FnOnce(&Segment, &OwnedFd)>;

/// The segment `mutate` spoiled, offered to a joining side.
fn join_spoiled(mutate: impl FnOnce(&Segment, &OwnedFd)) -> std::io::Result<ShmJoin> {
    let (seg, fd) = Segment::create(&params()).unwrap();
    mutate(&seg, &fd);
    ShmJoin::open(fd, params().poll, false)
}

/// Sizes, seals and ring headers of an offered segment are checked before
/// anything in it is used: a malicious segment is an error, not a panic.
#[test]
fn a_malformed_segment_is_refused() {
    assert!(join_spoiled(|_, _| {}).is_ok());
    let cases: Vec<(&str, Spoil)> = vec![
        (
            "bad magic",
            Box::new(|s, _| s.hdr().magic.store(1, Ordering::Relaxed)),
        ),
        (
            "ring capacity",
            Box::new(|s, _| s.hdr().ring_cap.store(1 << 30, Ordering::Relaxed)),
        ),
        (
            "ring capacity",
            Box::new(|s, _| s.hdr().ring_cap.store(1000, Ordering::Relaxed)),
        ),
        (
            "shorter than its layout",
            Box::new(|s, _| s.hdr().ring_cap.store(1 << 20, Ordering::Relaxed)),
        ),
        (
            "slots",
            Box::new(|s, _| s.hdr().lock_slots.store(0, Ordering::Relaxed)),
        ),
        (
            "slots",
            Box::new(|s, _| s.hdr().reg_slots.store(u32::MAX, Ordering::Relaxed)),
        ),
        (
            "ring 0",
            Box::new(|s, _| {
                // SAFETY: the first ring's magic word, inside our own mapping.
                unsafe { s.base().add(s.layout.ring[0]).cast::<u64>().write(0) }
            }),
        ),
        (
            "ring 1",
            Box::new(move |s, _| {
                // SAFETY: the second ring's capacity word, inside our mapping.
                unsafe { s.base().add(s.layout.ring[1] + 8).cast::<u64>().write(64) }
            }),
        ),
    ];
    for (want, spoil) in cases {
        let e = join_spoiled(spoil).unwrap_err();
        assert!(e.to_string().contains(want), "{want}: {e}");
    }
    // Not sealed against shrinking (the peer could truncate it under us).
    let plain =
        nix::sys::memfd::memfd_create(c"not-sealed", nix::sys::memfd::MFdFlags::MFD_CLOEXEC)
            .unwrap();
    std::fs::File::from(plain.try_clone().unwrap())
        .set_len(1 << 20)
        .unwrap();
    let e = ShmJoin::open(plain, params().poll, false).unwrap_err();
    assert!(e.to_string().contains("seal"), "{e}");
    // Not a memfd at all.
    let (x, _y) = UnixStream::pair().unwrap();
    let e = ShmJoin::open(x.into(), params().poll, false).unwrap_err();
    assert!(e.to_string().contains("memfd"), "{e}");
}

/// GETs name a key: one that is not live, or a range outside it, is
/// refused without reading anything.
#[test]
fn gets_are_checked_against_live_registrations() {
    let (mut a, mut b) = pair();
    let src = vec![7u8; 3 * 4096];
    let secret = vec![0x5au8; 4096];
    let key = a.register(src.as_ptr() as u64, 4096).unwrap();
    let at = |addr: *const u8, key| RemoteBuf {
        addr: addr as u64,
        key,
    };
    let get = |b: &mut ShmEndpoint, remote: RemoteBuf, len: u64| {
        let mut dst = vec![0u8; len as usize];
        b.post_get(
            OpId(1),
            remote,
            LocalBuf {
                addr: dst.as_mut_ptr() as u64,
                key: 0,
            },
            len,
        )
        .unwrap();
        let r = match drain(b).pop() {
            Some(Got::Done(_, OpResult::Get(r))) => r,
            _ => panic!("no completion"),
        };
        (r, dst)
    };
    assert_eq!(get(&mut b, at(src.as_ptr(), key), 4096).0, Ok(()));
    // Inside the buffer, but past the registered range.
    let (r, dst) = get(&mut b, at(src.as_ptr(), key), 4097);
    assert_eq!(r, Err(OpError::RemoteAccess));
    assert!(dst.iter().all(|&x| x == 0), "nothing was read");
    // Memory that was never advertised, under a live key.
    let (r, dst) = get(&mut b, at(secret.as_ptr(), key), 16);
    assert_eq!(r, Err(OpError::RemoteAccess));
    assert!(!dst.contains(&0x5a));
    // Keys that were never handed out.
    for bogus in [0, key ^ (1 << KEY_SLOT_BITS), key | KEY_SLOT_MASK, u32::MAX] {
        assert_eq!(
            get(&mut b, at(src.as_ptr(), bogus), 8).0,
            Err(OpError::RemoteAccess)
        );
    }
    // A stale key: withdrawn, and its slot reused for another range.
    a.deregister(key);
    assert_eq!(
        get(&mut b, at(src.as_ptr(), key), 8).0,
        Err(OpError::RemoteAccess)
    );
    let again = a.register(secret.as_ptr() as u64, 4096).unwrap();
    assert_ne!(again, key);
    assert_eq!(
        get(&mut b, at(src.as_ptr(), key), 8).0,
        Err(OpError::RemoteAccess)
    );
    assert_eq!(
        get(&mut b, at(secret.as_ptr(), key), 8).0,
        Err(OpError::RemoteAccess)
    );
    assert_eq!(get(&mut b, at(secret.as_ptr(), again), 8).0, Ok(()));
    // A full table refuses registration instead of reusing a live slot.
    let mut keys = Vec::new();
    while let Ok(k) = a.register(src.as_ptr() as u64, 8) {
        keys.push(k);
    }
    assert_eq!(keys.len() as u32 + 1, params().reg_slots());
    assert_eq!(a.register(src.as_ptr() as u64, 8), Err(OpError::Local));
}

/// The peer's owner word is only a hint: rewriting it to another process
/// (without that process's own claim, with its kernel identity, on our
/// bell) changes nothing about whose memory GETs read or whose death ends
/// the connection. A GET waits for the claim meanwhile (a true one is on
/// its way), and reads the pinned process once the word is back; one
/// whose named process does not exist fails at once, reading nothing.
#[test]
fn a_rewritten_owner_word_is_not_followed() {
    let (mut a, mut b) = pair();
    let me = std::process::id() as i32;
    for forged in [1, 1 | FROZEN, 0x3f_ffff] {
        a.seg.hdr().owner[0].store(forged, Ordering::Release);
        b.alive_suspect = true;
        let src = vec![3u8; 64];
        let key = a.register(src.as_ptr() as u64, 64).unwrap();
        let mut dst = vec![0u8; 64];
        let remote = RemoteBuf {
            addr: src.as_ptr() as u64,
            key,
        };
        b.post_get(
            OpId(1),
            remote,
            LocalBuf {
                addr: dst.as_mut_ptr() as u64,
                key: 0,
            },
            64,
        )
        .unwrap();
        let got = drain(&mut b);
        assert_eq!(dst, vec![0u8; 64], "nothing was read");
        if forged & PID_MASK == 0x3f_ffff {
            // No such process: no claim can come, the GET fails at once.
            assert!(
                matches!(
                    got[..],
                    [Got::Done(_, OpResult::Get(Err(OpError::Unreachable)))]
                ),
                "the GET for a claimer that does not exist"
            );
            a.seg.hdr().owner[0].store(me as u32, Ordering::Release);
            a.deregister(key);
            continue;
        }
        assert!(
            !got.iter()
                .any(|g| matches!(g, Got::Done(_, OpResult::Get(_)))),
            "a GET went ahead for an unclaimed owner word"
        );
        // A claim may take a while on a loaded host (its reactor thread
        // delivers it): the GET still waits after 300 ms.
        std::thread::sleep(Duration::from_millis(300));
        assert!(
            !drain(&mut b)
                .iter()
                .any(|g| matches!(g, Got::Done(_, OpResult::Get(_)))),
            "a GET gave up on a live claimer after 300 ms"
        );
        a.seg.hdr().owner[0].store(me as u32, Ordering::Release);
        assert!(matches!(
            drain(&mut b)[..],
            [Got::Done(_, OpResult::Get(Ok(())))]
        ));
        assert_eq!(dst, src);
        assert_eq!(b.peer_pid(), me, "still the pinned process");
        a.deregister(key);
    }
}

/// A claim made before the peer's connection has put its bell token in
/// the segment (a forked child that claims at its first call, right after
/// the connect, with the peer's thread slow under load) cannot be
/// delivered yet: it goes at a later poll, once the token is there. (It
/// was dropped: the peer then held its GETs for a claim that never came,
/// and reset the connection after five seconds.)
#[test]
fn a_claim_the_peer_cannot_take_yet_goes_again_at_the_next_poll() {
    let (mut a, _b) = pair();
    let token = a.seg.hdr().bell[1].swap(0, Ordering::AcqRel);
    a.send_claim();
    assert!(a.claim_unsent.load(Ordering::Acquire), "no token: not sent");
    drain(&mut a);
    assert!(a.claim_unsent.load(Ordering::Acquire), "still no token");
    a.seg.hdr().bell[1].store(token.max(1), Ordering::Release);
    drain(&mut a);
    assert!(
        !a.claim_unsent.load(Ordering::Acquire),
        "sent at the poll after the token came"
    );
}

/// A peer that corrupts the ring's positions ends the connection with an
/// error (PeerGone without a stream length), on both directions.
#[test]
fn a_corrupted_ring_ends_the_connection() {
    let (mut a, mut b) = pair();
    a.post_message(b"first").unwrap();
    // The peer (a) rewrites the tail of the ring b reads: past the head
    // by more than the ring holds.
    let ring = a.seg.layout.ring[0];
    // SAFETY: the ring header's tail word (offset 64), in the mapping.
    unsafe { a.seg.base().add(ring + 64).cast::<u64>().write(1 << 40) };
    let got = drain(&mut b);
    assert!(matches!(&got[..], [Got::Gone]), "{}", got.len());
    assert_eq!(b.post_message(b"x"), Err(FabricError::Broken));
    // Nothing more is reported.
    assert!(drain(&mut b).is_empty());
}

/// Two real processes: the child GETs from the parent and CASes its lock word.
#[test]
fn two_processes_get_and_cas() {
    let (a, b) = UnixStream::pair().unwrap();
    let src: Vec<u8> = (0..(3 << 20) as u32)
        .map(|i| (i.wrapping_mul(2654435761) >> 24) as u8)
        .collect();
    let sum: u64 = src.iter().map(|&x| u64::from(x)).sum();
    // SAFETY: the child only uses async-signal-safe-enough operations on
    // memory it owns (the test harness's other threads are not touched) and
    // leaves with _exit, never returning into the harness.
    match unsafe { nix::unistd::fork() }.unwrap() {
        nix::unistd::ForkResult::Child => {
            drop(a);
            let code = std::panic::catch_unwind(|| {
                let mut e = ShmEndpoint::accept(&b, params()).unwrap();
                // Wait for the parent's advertisement: addr, len, key.
                let mut adv = Vec::new();
                while adv.is_empty() {
                    e.wait(Duration::from_secs(5));
                    e.poll(&mut |ev| {
                        if let FabricEvent::Message(m) = ev {
                            adv = m.to_vec();
                        }
                    });
                }
                let addr = u64::from_le_bytes(adv[0..8].try_into().unwrap());
                let len = u64::from_le_bytes(adv[8..16].try_into().unwrap());
                let key = u32::from_le_bytes(adv[16..20].try_into().unwrap());
                let mut dst = vec![0u8; len as usize];
                e.post_get(
                    OpId(1),
                    RemoteBuf { addr, key },
                    LocalBuf {
                        addr: dst.as_mut_ptr() as u64,
                        key: 0,
                    },
                    len,
                )
                .unwrap();
                let mut ok = false;
                e.poll(&mut |ev| {
                    ok = matches!(
                        ev,
                        FabricEvent::Done {
                            result: OpResult::Get(Ok(())),
                            ..
                        }
                    )
                });
                assert!(ok);
                let got: u64 = dst.iter().map(|&x| u64::from(x)).sum();
                // Take the parent's lock word 0, as a source does on a write fault.
                let target = CasTarget::Remote {
                    addr: e.seg.layout.locks[0] as u64,
                    key: e.seg.key,
                };
                e.post_cas(OpId(2), target, 0, 42).unwrap();
                let mut won = false;
                e.poll(&mut |ev| {
                    won = matches!(
                        ev,
                        FabricEvent::Done {
                            result: OpResult::Cas(Ok(0)),
                            ..
                        }
                    )
                });
                assert!(won);
                e.post_message(&got.to_le_bytes()).unwrap();
                std::thread::sleep(Duration::from_millis(50));
            });
            // SAFETY: leave the child without running the harness's atexit.
            unsafe { libc::_exit(i32::from(code.is_err())) };
        }
        nix::unistd::ForkResult::Parent { child } => {
            drop(b);
            let mut e = ShmEndpoint::offer(&a, params()).unwrap();
            assert_eq!(e.peer_pid(), child.as_raw());
            assert_eq!(e.can_get(), None);
            let key = e.register(src.as_ptr() as u64, src.len() as u64).unwrap();
            let mut adv = Vec::new();
            adv.extend_from_slice(&(src.as_ptr() as u64).to_le_bytes());
            adv.extend_from_slice(&(src.len() as u64).to_le_bytes());
            adv.extend_from_slice(&key.to_le_bytes());
            e.post_message(&adv).unwrap();
            let mut reply = None;
            let deadline = Instant::now() + Duration::from_secs(10);
            while reply.is_none() && Instant::now() < deadline {
                e.wait(Duration::from_millis(100));
                e.poll(&mut |ev| {
                    if let FabricEvent::Message(m) = ev {
                        reply = Some(u64::from_le_bytes(m.try_into().unwrap()));
                    }
                });
            }
            assert_eq!(reply, Some(sum), "the child read the parent's bytes");
            e.post_cas(OpId(9), CasTarget::Local { slot: 0 }, 42, 43)
                .unwrap();
            let mut seen = None;
            e.poll(&mut |ev| {
                if let FabricEvent::Done {
                    result: OpResult::Cas(r),
                    ..
                } = ev
                {
                    seen = Some(r);
                }
            });
            assert_eq!(
                seen,
                Some(Ok(42)),
                "the child's compare-and-swap landed in shared memory"
            );
            let status = nix::sys::wait::waitpid(child, None).unwrap();
            assert_eq!(status, nix::sys::wait::WaitStatus::Exited(child, 0));
            // The child is gone: the next poll says so.
            let mut gone = false;
            e.poll(&mut |ev| gone |= matches!(ev, FabricEvent::PeerGone { .. }));
            assert!(gone);
        }
    }
}

/// The peer's bell as `a` rings it, made a datagram socket read here (not
/// blocking), with the peer's token `token`.
fn peer_bell_here(a: &mut ShmEndpoint, token: u64) -> std::os::unix::net::UnixDatagram {
    let (bell_r, bell_w) = std::os::unix::net::UnixDatagram::pair().unwrap();
    bell_r.set_nonblocking(true).unwrap();
    a.peer_bell = std::sync::Arc::new(OwnedFd::from(bell_w));
    a.seg.hdr().bell[1 - a.side].store(token, Ordering::Release);
    bell_r
}

/// Rings held by a thread go once per bell and token when the hold ends,
/// and none before; a full bell leaves the doorbell armed.
#[test]
fn held_rings_go_once_when_the_hold_ends() {
    let (mut a, _b) = pair();
    let token = 0x5eed_u64;
    let bell_r = peer_bell_here(&mut a, token);
    let rings = || {
        let mut got = Vec::new();
        let mut buf = [0u8; 16];
        while let Ok(n) = bell_r.recv(&mut buf) {
            got.push(u64::from_le_bytes(buf[..n].try_into().unwrap()));
        }
        got
    };
    // Not held: each message to an armed peer rings.
    for _ in 0..2 {
        a.tx.armed().store(1, Ordering::Release);
        a.post_message(b"x").unwrap();
    }
    assert_eq!(rings(), vec![token, token]);
    // Held: nothing until the hold ends, then one ring.
    let held = hold_rings();
    let inner = hold_rings();
    for _ in 0..3 {
        a.tx.armed().store(1, Ordering::Release);
        a.post_message(b"y").unwrap();
    }
    drop(inner);
    assert_eq!(rings(), Vec::<u64>::new(), "an inner hold rings nothing");
    drop(held);
    assert_eq!(rings(), vec![token]);
    assert_eq!(a.tx.armed().load(Ordering::Acquire), 0);
    // A bell that is gone when the hold ends: the doorbell stays armed.
    drop(bell_r);
    let held = hold_rings();
    a.tx.armed().store(1, Ordering::Release);
    a.post_message(b"z").unwrap();
    drop(held);
    assert_eq!(a.tx.armed().load(Ordering::Acquire), 1);
}

/// A message for a peer with a thread asleep on the ring wakes that thread
/// alone: the doorbell stays armed for the next. Once a fork froze the
/// peer's side (or another process took it), a sleeper may be one that no
/// longer runs it, and the doorbell rings as well, for good.
#[test]
fn a_sleeper_is_woken_without_the_doorbell_until_the_peer_changes_hands() {
    let (mut a, b) = pair();
    let bell_r = peer_bell_here(&mut a, 0x5eed);
    let rung = || {
        let mut buf = [0u8; 16];
        bell_r.recv(&mut buf).is_ok()
    };
    // (b's incoming ring is a's outgoing one; its side is a's peer's.)
    let sleeping = b.rx.wait_words().1;
    let owner = &b.seg.hdr().owner[b.side];
    let runner = owner.load(Ordering::Acquire);
    sleeping.store(1, Ordering::SeqCst);
    a.tx.armed().store(1, Ordering::Release);
    a.post_message(b"x").unwrap();
    assert!(!rung(), "a sleeper's reactor was rung too");
    assert_eq!(a.tx.armed().load(Ordering::Acquire), 1, "the arming stays");
    // Frozen by a fork: rung as well.
    owner.store(runner | FROZEN, Ordering::Release);
    a.post_message(b"y").unwrap();
    assert!(rung(), "a frozen side's reactor was not rung");
    // Back with the same process: still rung (a sleeper of the child may
    // be left).
    owner.store(runner, Ordering::Release);
    a.tx.armed().store(1, Ordering::Release);
    a.post_message(b"z").unwrap();
    assert!(rung(), "a side that changed hands once was not rung");
    sleeping.store(0, Ordering::SeqCst);
}

#[test]
fn a_loop_that_is_awake_is_not_rung_and_keeps_its_arming() {
    let (mut a, _b) = pair();
    // The peer side's loop, its bell given to this (a's) process.
    let bell = loop_bell::LoopBell::new().unwrap();
    let peer = a.peer.pidfd_shared();
    let loop_bell::Giving::Give(w, page) = loop_bell::to_give(bell.id(), &peer) else {
        panic!("a new bell is to give");
    };
    let uid = nix::unistd::geteuid().as_raw();
    let page = page.map(|p| p.try_clone().unwrap());
    loop_bell::take(&peer, uid, bell.id(), w.try_clone().unwrap(), page);
    a.seg.hdr().bell[1 - a.side].store(0x5eed, Ordering::Release);
    a.seg.hdr().route[1 - a.side].store(bell.id(), Ordering::Release);
    let readable = || {
        crate::poll_fd::poll_fd(bell.fd(), libc::POLLIN, Some(Duration::ZERO)) & libc::POLLIN != 0
    };
    // Awake: messages go unrung, and the arming stays for its next sleep.
    for _ in 0..3 {
        a.tx.armed().store(1, Ordering::Release);
        a.post_message(b"x").unwrap();
        assert!(!readable(), "an awake loop was rung");
        assert_eq!(a.tx.armed().load(Ordering::Acquire), 1);
    }
    // Asleep: the first message rings it and takes the arming.
    let asleep = bell.asleep().expect("a sleepers' page");
    a.post_message(b"y").unwrap();
    assert!(readable(), "a sleeping loop was not rung");
    assert_eq!(a.tx.armed().load(Ordering::Acquire), 0);
    drop(asleep);
}

/// A process passes its bell to a peer process once: later pairs between
/// the two only name it, both ways, and still pair. (Both roles are this
/// process here; the table is per process, so it is both sides' too.)
#[test]
fn later_pairs_between_two_processes_name_the_bells_they_passed() {
    use crate::identity::{PeerId, pidfd_open};
    use crate::transport::{Join as _, Offer as _, Transport as _};
    let t = ShmTransport { params: params() };
    let pid = std::process::id();
    // A verified view of us, as a message's would be (one pin per process).
    let us = || {
        PeerId::resumed(
            pid,
            nix::unistd::geteuid().as_raw(),
            nix::unistd::getegid().as_raw(),
            pidfd_open(pid).unwrap(),
        )
        .unwrap()
    };
    let mut ends = Vec::new();
    for round in 0..3 {
        let offer = t.offer(pid).unwrap();
        let offered = offer.note().unwrap();
        // (Other tests of this process pair it with itself too: the first
        // round may find the bells kept already.)
        assert!(
            offered.held || round == 0,
            "round {round}: the offer names our bell"
        );
        assert!(
            offered.keeps != 0 || round == 0,
            "round {round}: it keeps our bell"
        );
        let fds: Vec<OwnedFd> = offer
            .fds()
            .iter()
            .map(|f| f.try_clone_to_owned().unwrap())
            .collect();
        assert_eq!(fds.len(), if offered.held { 1 } else { 2 });
        let join = t.join(Some(offered), &us(), fds).unwrap();
        let answer = join.note().unwrap();
        assert!(
            answer.held || round == 0,
            "round {round}: the answer names our bell"
        );
        assert_eq!(join.fds().len(), usize::from(!answer.held));
        let passed = join
            .fds()
            .iter()
            .map(|f| f.try_clone_to_owned().unwrap())
            .collect();
        let _ = join.agreement().compare_exchange(
            crate::pairing::Agreement::UNDECIDED,
            crate::pairing::Agreement::COMMITTED,
            Ordering::AcqRel,
            Ordering::Acquire,
        );
        let e1 = join.into_endpoint(us(), 4096).unwrap();
        let e0 = offer
            .into_endpoint(Some(answer), passed, us(), 4096)
            .unwrap();
        ends.push((e0, e1));
    }
    // A peer that names a bell we never kept, at a descriptor that is
    // another bell, is refused, and the pair fails alone.
    let offer = t.offer(pid).unwrap();
    let mut lie = offer.note().unwrap();
    lie.id ^= 0x5a5a;
    let memfd = vec![offer.fds()[0].try_clone_to_owned().unwrap()];
    let e = t.join(Some(lie), &us(), memfd).unwrap_err();
    assert!(e.to_string().contains("is not that bell"), "{e}");
}
