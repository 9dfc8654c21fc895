//! Memory that goes away, or is copied by fork(), while a send from it is
//! in flight, between two real processes. Every case goes through the
//! process-wide hooks in `azsdp::process`, called exactly as the preload
//! shim's interposed `free`, `realloc`, `munmap`, `mremap`, `madvise` and
//! `pthread_atfork` handlers call them. The receiver is slow, so the send
//! is still in flight when the memory changes hands; it must still get the
//! bytes that were sent, and the program its own.
//!
//! Needs a full userfaultfd (root, as in CI); skipped elsewhere.

use std::os::unix::net::UnixStream;
use std::time::Duration;

use azsdp::conn::{Counters, FaultPolicy, SendFlags};
use azsdp::driver::threaded::ThreadedDriver;
use azsdp::fabric::shm::ShmEndpoint;
use azsdp::process;
use azsdp::protect::uffd::UffdProtect;
use nix::sys::wait::WaitStatus;

mod common;
use common::*;

const LEN: usize = 1 << 20;

type Sender = ThreadedDriver<ShmEndpoint, UffdProtect>;

/// Fill `len` bytes at `addr` with the stream pattern.
fn fill(addr: u64, len: usize) {
    // SAFETY: the caller's live buffer of `len` bytes.
    let b = unsafe { std::slice::from_raw_parts_mut(addr as *mut u8, len) };
    for (k, x) in b.iter_mut().enumerate() {
        *x = pattern(k as u64);
    }
}

/// Send `LEN` bytes from the buffer `alloc` returns (filled with the
/// pattern) to a slow receiver, run `change` on the buffer while the send
/// is in flight, and check that the receiver got exactly the bytes sent.
fn in_flight(alloc: impl FnOnce() -> u64, change: impl FnOnce(u64, &Sender)) -> Option<Counters> {
    in_flight_then(alloc, |addr, d| {
        change(addr, d);
        0
    })
}

/// [`in_flight`], where `change` also has the stream's next bytes sent
/// (how many it returns), so the receiver must get those too.
fn in_flight_then(
    alloc: impl FnOnce() -> u64,
    change: impl FnOnce(u64, &Sender) -> u64,
) -> Option<Counters> {
    if UffdProtect::new().is_err() {
        assert!(
            !nix::unistd::geteuid().is_root(),
            "root must get a full userfaultfd"
        );
        return None;
    }
    let (a, b) = UnixStream::pair().unwrap();
    let child = spawn(|| verifying_receiver(&b, Duration::from_millis(200), LEN + 4096));
    let _reaper = Reaper(child);
    drop(b);
    let d = protected_sender(&a, FaultPolicy::Copy, 8).expect("full userfaultfd");
    let addr = alloc();
    fill(addr, LEN);
    let flags = SendFlags {
        nonblocking: false,
        protectable: true,
        unprotectable: None,
    };
    // SAFETY: the buffer is LEN bytes and lives until `change` disposes of it.
    let buf = unsafe { std::slice::from_raw_parts(addr as *const u8, LEN) };
    assert_eq!(d.send(buf, flags).unwrap(), LEN as u64);
    let c = d.counters();
    assert!(c.bytes_sent_async > 0, "sent by AZ-SDP: {c:?}");
    let extra = change(addr, &d);
    let (clean, c, state) = d.close_report(Duration::from_secs(20));
    if !clean {
        let status = reap(child, Duration::from_secs(5));
        panic!("unclean close: {state:?}; receiver {status:?}; {c:?}");
    }
    assert_eq!(
        child_report(&a, child),
        (LEN as u64 + extra, 0),
        "the receiver got the bytes that were sent"
    );
    Some(c)
}

fn scribble(addr: u64, len: usize, byte: u8) {
    // SAFETY: the caller's live memory of `len` bytes.
    unsafe { std::ptr::write_bytes(addr as *mut u8, byte, len) };
}

#[test]
fn free_of_an_in_flight_malloc_buffer() {
    let c = in_flight(
        // SAFETY: plain malloc; checked non-null.
        || unsafe { libc::malloc(LEN) } as u64,
        |addr, _| {
            // SAFETY: `addr` is a live malloc'd chunk.
            let usable = unsafe { libc::malloc_usable_size(addr as *mut _) } as u64;
            process::before_free(addr, usable);
            // SAFETY: freeing it, once.
            unsafe { libc::free(addr as *mut _) };
            // The allocator hands the memory out again; it gets scribbled on.
            // SAFETY: plain malloc.
            let again = unsafe { libc::malloc(LEN) } as u64;
            scribble(again, LEN, 0x55);
            // SAFETY: freeing our own chunk.
            unsafe { libc::free(again as *mut _) };
        },
    );
    if let Some(c) = c {
        assert!(c.cow_copies >= 1, "copied aside before free: {c:?}");
    }
}

#[test]
fn realloc_of_an_in_flight_buffer() {
    in_flight(
        // SAFETY: plain malloc.
        || unsafe { libc::malloc(LEN) } as u64,
        |addr, _| {
            // SAFETY: `addr` is a live malloc'd chunk.
            let usable = unsafe { libc::malloc_usable_size(addr as *mut _) } as u64;
            process::before_realloc(addr, usable);
            // SAFETY: growing our chunk; it may move and free the old one.
            let grown = unsafe { libc::realloc(addr as *mut _, 8 * LEN) } as u64;
            assert_ne!(grown, 0);
            scribble(grown, 8 * LEN, 0x66);
            // SAFETY: freeing our own chunk.
            unsafe { libc::free(grown as *mut _) };
        },
    );
}

#[test]
fn munmap_of_an_in_flight_mapping() {
    in_flight(
        || mmap_anon(LEN),
        |addr, _| {
            process::before_unmap(addr, LEN as u64);
            // SAFETY: unmapping our own mapping.
            assert_eq!(unsafe { libc::munmap(addr as *mut _, LEN) }, 0);
            process::after_unmap(addr, LEN as u64);
            // Map something new at the same place and scribble on it.
            let again = mmap_anon(LEN);
            scribble(again, LEN, 0x77);
            // SAFETY: unmapping our own mapping.
            unsafe { libc::munmap(again as *mut _, LEN) };
        },
    );
}

#[test]
fn madvise_dontneed_of_an_in_flight_buffer() {
    in_flight(
        || mmap_anon(LEN),
        |addr, _| {
            process::before_madvise(addr, LEN as u64, libc::MADV_DONTNEED);
            // SAFETY: discarding our own pages (they read as zeros after).
            let r = unsafe { libc::madvise(addr as *mut _, LEN, libc::MADV_DONTNEED) };
            assert_eq!(r, 0);
            // SAFETY: our mapping.
            assert_eq!(unsafe { *(addr as *const u8).add(4096) }, 0);
            scribble(addr, LEN, 0x88);
            // SAFETY: unmapping our own mapping.
            unsafe { libc::munmap(addr as *mut _, LEN) };
        },
    );
}

#[test]
fn mremap_of_an_in_flight_mapping() {
    in_flight(
        || mmap_anon(LEN),
        |addr, _| {
            process::before_remap(addr, LEN as u64);
            // SAFETY: growing our own mapping; it may move.
            let moved = unsafe { libc::mremap(addr as *mut _, LEN, 4 * LEN, libc::MREMAP_MAYMOVE) };
            assert_ne!(moved, libc::MAP_FAILED);
            process::after_remap(addr, LEN as u64);
            scribble(moved as u64, 4 * LEN, 0x99);
            // SAFETY: unmapping our own mapping.
            unsafe { libc::munmap(moved, 4 * LEN) };
        },
    );
}

/// fork() with a send in flight: the atfork handler settles it first (here:
/// copies it aside), the child starts clean — it writes its copy of the
/// buffer without faulting — and the receiver still gets the bytes sent.
/// The child cannot run the connection (this driver has no way to protect
/// a child's pages), so the parent serves its send: the child's bytes come
/// after the parent's in the stream.
#[test]
fn fork_with_a_send_in_flight() {
    const MORE: usize = 4096;
    in_flight_then(
        || mmap_anon(LEN),
        |addr, d| {
            let before = d.counters().cow_copies;
            let child = spawn(|| {
                // Nothing is protected here: these writes must not wait.
                scribble(addr, LEN, 0xee);
                let next: Vec<u8> = (LEN..LEN + MORE).map(|k| pattern(k as u64)).collect();
                let r = d.send(&next, SendFlags::default());
                i32::from(r != Ok(MORE as u64))
            });
            assert_eq!(
                reap(child, Duration::from_secs(10)),
                WaitStatus::Exited(child, 0),
                "the child wrote freely and its send was served"
            );
            let c = d.counters();
            assert!(c.cow_copies > before, "settled before the fork: {c:?}");
            // The parent's buffer is its own again too: no fault now.
            scribble(addr, LEN, 0xdd);
            assert_eq!(d.counters().send_faults, c.send_faults);
            MORE as u64
        },
    );
}

/// Every hook the shim calls as memory goes records the range for caches
/// that keep registrations of it (`released_memory`, read by the verbs
/// fabric's registration cache); advice that keeps the pages does not.
#[test]
fn memory_hooks_record_what_a_registration_cache_must_forget() {
    use azsdp::released_memory::{self, Reader, Released};
    // Addresses no test maps: the hooks only record them.
    let base = 0x6100_0000_0000u64;
    let mib = 1u64 << 20;
    released_memory::watch(base..base + 64 * mib);
    let mut r = Reader::new();
    process::before_free(base, 4096);
    process::before_realloc(base + mib, 8192);
    process::after_unmap(base + 2 * mib, mib);
    process::before_madvise(base + 4 * mib, mib, libc::MADV_DONTNEED);
    process::before_madvise(base + 5 * mib, mib, libc::MADV_WILLNEED);
    process::after_remap(base + 6 * mib, mib);
    process::after_mmap_over(base + 8 * mib, mib);
    // Outside anything watched: not recorded.
    process::before_free(0x1000, 4096);
    let Released::Ranges(seen) = r.read() else {
        panic!("the record overflowed with nothing else writing to it");
    };
    for want in [
        base..base + 4096,
        base + mib..base + mib + 8192,
        base + 2 * mib..base + 3 * mib,
        base + 4 * mib..base + 5 * mib,
        base + 6 * mib..base + 7 * mib,
        base + 8 * mib..base + 9 * mib,
    ] {
        assert!(seen.contains(&want), "{want:x?} not recorded: {seen:x?}");
    }
    assert!(
        !seen.contains(&(base + 5 * mib..base + 6 * mib)),
        "MADV_WILLNEED keeps the pages"
    );
    assert!(!seen.contains(&(0x1000..0x2000)));
}
