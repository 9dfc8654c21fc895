use super::*;
use crate::protect::test_support::{Pages, PipeRead};
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Duration;

/// A full userfaultfd, or None when this process may not have one (then
/// the caller skips: only root or CAP_SYS_PTRACE get one, and CI is root).
fn uffd() -> Option<UffdProtect> {
    match UffdProtect::new() {
        Ok(u) => Some(u),
        Err(e) if !nix::unistd::geteuid().is_root() => {
            eprintln!("skipped: {e}");
            None
        }
        Err(e) => panic!("root must get a full userfaultfd: {e}"),
    }
}

/// Run `f` on a thread; true if it finished within `wait`.
fn finishes_within(
    wait: Duration,
    f: impl FnOnce() + Send + 'static,
) -> (std::thread::JoinHandle<()>, Arc<AtomicBool>) {
    let done = Arc::new(AtomicBool::new(false));
    let d = Arc::clone(&done);
    let h = std::thread::spawn(move || {
        f();
        d.store(true, Ordering::SeqCst);
    });
    std::thread::sleep(wait);
    (h, done)
}

fn write_blocks_until_unprotected(touch: bool) {
    let Some(mut u) = uffd() else { return };
    let p = Pages::new(4, touch);
    u.protect(p.range()).unwrap();
    let target = p.addr(2 * 4096 + 10);
    let (h, done) = finishes_within(Duration::from_millis(100), move || {
        // SAFETY: inside the mapping, which outlives the thread (joined below).
        unsafe { std::ptr::write_volatile(target as *mut u8, 42) };
    });
    assert!(
        !done.load(Ordering::SeqCst),
        "a write to a protected page must wait"
    );
    let f = u.faults().next().expect("a fault event");
    assert_eq!(f.addr & !4095, target as u64 & !4095);
    assert!(f.write && f.wp);
    u.unprotect(p.range()).unwrap();
    h.join().unwrap();
    assert!(done.load(Ordering::SeqCst));
    // SAFETY: inside the mapping.
    assert_eq!(unsafe { *(target as *const u8) }, 42);
}

#[test]
fn writes_to_protected_pages_wait() {
    write_blocks_until_unprotected(true);
}

#[test]
fn never_touched_pages_are_protected_too() {
    write_blocks_until_unprotected(false);
}

#[test]
fn a_syscall_writing_a_protected_page_waits_instead_of_failing() {
    let Some(mut u) = uffd() else { return };
    let p = Pages::new(2, true);
    u.protect(p.range()).unwrap();
    let read = PipeRead::start(p.addr(4096) as u64, b"hello", Duration::from_millis(100));
    assert!(!read.is_done(), "read() into a protected page waits");
    u.unprotect(p.range()).unwrap();
    assert_eq!(read.finish(), 5, "and then succeeds (no EFAULT)");
    // SAFETY: inside the mapping.
    let landed = unsafe { std::slice::from_raw_parts(p.addr(4096) as *const u8, 5) };
    assert_eq!(landed, b"hello");
}

#[test]
fn reprotecting_reuses_the_registration_and_reads_never_fault() {
    let Some(mut u) = uffd() else { return };
    let p = Pages::new(8, true);
    for _ in 0..3 {
        u.protect(p.range()).unwrap();
        // Reads are fine while protected.
        // SAFETY: inside the mapping.
        let byte = unsafe { std::ptr::read_volatile(p.addr(5 * 4096) as *const u8) };
        assert_eq!(byte, 7);
        u.unprotect(p.range()).unwrap();
    }
    // A sub-range inside a registered range: no new registration needed.
    let r = p.range();
    u.protect(r.start + 4096..r.start + 3 * 4096).unwrap();
    u.unprotect(r.start + 4096..r.start + 3 * 4096).unwrap();
    u.forget(p.range());
}

#[test]
fn file_backed_memory_cannot_be_registered() {
    let Some(mut u) = uffd() else { return };
    let f = crate::test_files::unlinked_tempfile("uffd", &[]);
    f.set_len(8192).unwrap();
    // SAFETY: mapping our own temporary file.
    let ptr = unsafe {
        libc::mmap(
            std::ptr::null_mut(),
            8192,
            libc::PROT_READ | libc::PROT_WRITE,
            libc::MAP_SHARED,
            std::os::fd::AsRawFd::as_raw_fd(&f),
            0,
        )
    };
    assert_ne!(ptr, libc::MAP_FAILED);
    let r = ptr as u64..ptr as u64 + 8192;
    // Refused at registration (or, if an earlier test left the address
    // registered, when the stale registration is redone).
    assert!(matches!(
        u.protect(r),
        Err(ProtectError::Register { .. } | ProtectError::Ioctl { .. })
    ));
    // SAFETY: unmapping what we mapped.
    unsafe { libc::munmap(ptr, 8192) };
}

/// Arm `p`, check that a reader of page 1 waits, write `fill` into staging
/// (as a GET would), land, and check the reader sees it.
fn arm_land(touch: bool) {
    let Some(mut u) = uffd() else { return };
    if !u.can_arm() {
        eprintln!("skipped: no UFFDIO_MOVE");
        return;
    }
    let p = Pages::new(4, touch);
    u.arm(p.range()).unwrap();
    let target = p.addr(4096 + 100);
    let seen = Arc::new(std::sync::atomic::AtomicU8::new(0));
    let s2 = Arc::clone(&seen);
    let (h, done) = finishes_within(Duration::from_millis(100), move || {
        // SAFETY: inside the mapping, which outlives the thread (joined below).
        let b = unsafe { std::ptr::read_volatile(target as *const u8) };
        s2.store(b, Ordering::SeqCst);
    });
    assert!(
        !done.load(Ordering::SeqCst),
        "a read of an armed page waits"
    );
    let f = u.faults().next().expect("a fault event");
    assert_eq!(f.addr & !4095, target as u64 & !4095);
    assert!(!f.wp, "a missing-page fault");
    let stage = u.staging(&p.range()).expect("staging for the armed range");
    // SAFETY: staging is a private mapping of the range's length.
    unsafe { std::ptr::write_bytes(stage as *mut u8, 0x5c, p.len) };
    u.land(&p.range()).unwrap();
    h.join().unwrap();
    assert_eq!(seen.load(Ordering::SeqCst), 0x5c);
    u.disarm(p.range(), crate::conn::DisarmOutcome::Landed);
    // Ordinary memory again: writes and reads do not fault.
    // SAFETY: inside the mapping.
    unsafe { std::ptr::write_bytes(p.ptr, 1, p.len) };
    // SAFETY: inside the mapping.
    assert_eq!(unsafe { *p.ptr.add(p.len - 1) }, 1);
}

#[test]
fn armed_pages_wait_for_their_data() {
    arm_land(true);
}

#[test]
fn never_touched_pages_can_be_armed() {
    arm_land(false);
}

#[test]
fn a_syscall_writing_an_armed_page_waits_for_the_data() {
    let Some(mut u) = uffd() else { return };
    if !u.can_arm() {
        return;
    }
    let p = Pages::new(2, true);
    u.arm(p.range()).unwrap();
    let read = PipeRead::start(p.addr(4096) as u64, b"hello", Duration::from_millis(100));
    assert!(!read.is_done(), "read() into an armed page waits");
    let stage = u.staging(&p.range()).unwrap();
    // SAFETY: staging is a private mapping of the range's length.
    unsafe { std::ptr::write_bytes(stage as *mut u8, b'x', p.len) };
    u.land(&p.range()).unwrap();
    assert_eq!(read.finish(), 5, "and then succeeds (no EFAULT)");
    u.disarm(p.range(), crate::conn::DisarmOutcome::Landed);
    // SAFETY: inside the mapping.
    let page = unsafe { std::slice::from_raw_parts(p.addr(4096) as *const u8, 8) };
    assert_eq!(
        page, b"helloxxx",
        "the syscall's bytes over the landed data"
    );
}

#[test]
fn an_abandoned_arm_gives_the_old_bytes_back() {
    let Some(mut u) = uffd() else { return };
    if !u.can_arm() {
        return;
    }
    let p = Pages::new(3, true);
    u.arm(p.range()).unwrap();
    u.disarm(p.range(), crate::conn::DisarmOutcome::Abandoned);
    // SAFETY: inside the mapping.
    let all = unsafe { std::slice::from_raw_parts(p.ptr, p.len) };
    assert!(all.iter().all(|&b| b == 7));
    // The staging mapping is reused by the next arm of the same size.
    u.arm(p.range()).unwrap();
    u.disarm(p.range(), crate::conn::DisarmOutcome::Abandoned);
    // SAFETY: inside the mapping.
    let all = unsafe { std::slice::from_raw_parts(p.ptr, p.len) };
    assert!(all.iter().all(|&b| b == 7));
}

#[test]
fn lost_data_is_poisoned_not_silently_wrong() {
    let Some(mut u) = uffd() else { return };
    if !u.can_arm() || !u.can_poison() {
        return;
    }
    let p = Pages::new(2, true);
    u.arm(p.range()).unwrap();
    u.disarm(p.range(), crate::conn::DisarmOutcome::Lost);
    let target = p.addr(4096);
    // SAFETY: the child only touches the poisoned page and exits.
    match unsafe { nix::unistd::fork() }.unwrap() {
        nix::unistd::ForkResult::Child => {
            // SAFETY: inside the mapping (poisoned: this raises SIGBUS).
            let b = unsafe { std::ptr::read_volatile(target as *const u8) };
            // SAFETY: leave without running the harness's code.
            unsafe { libc::_exit(i32::from(b)) };
        }
        nix::unistd::ForkResult::Parent { child } => {
            let status = nix::sys::wait::waitpid(child, None).unwrap();
            assert_eq!(
                status,
                nix::sys::wait::WaitStatus::Signaled(
                    child,
                    nix::sys::signal::Signal::SIGBUS,
                    false
                )
            );
        }
    }
}

#[test]
fn registration_takes_the_whole_mapping_once() {
    let Some(mut u) = uffd() else { return };
    // 16 pages between two inaccessible guard pages, so that the mapping
    // cannot merge with a neighbour that other tests change meanwhile.
    let p = Pages::new(18, true);
    let all = p.range();
    for guard in [all.start, all.end - 4096] {
        // SAFETY: a page of our own mapping.
        unsafe { libc::mprotect(guard as *mut _, 4096, libc::PROT_NONE) };
    }
    let r = all.start + 4096..all.end - 4096;
    let vmas = || {
        crate::memory_map::MemoryMap::read()
            .unwrap()
            .covering(&r)
            .map_or(0, <[_]>::len)
    };
    assert_eq!(vmas(), 1);
    // Two sends from different parts of the mapping: registering only
    // their pages would split it into five.
    u.protect(r.start + 3 * 4096..r.start + 4 * 4096).unwrap();
    u.protect(r.start + 9 * 4096..r.start + 11 * 4096).unwrap();
    assert_eq!(vmas(), 1, "one registration for the whole mapping");
    u.unprotect(r.start + 3 * 4096..r.start + 4 * 4096).unwrap();
    u.unprotect(r.start + 9 * 4096..r.start + 11 * 4096)
        .unwrap();
    u.forget(r);
}

#[test]
fn a_registration_gone_with_its_memory_is_redone() {
    let Some(mut u) = uffd() else { return };
    let p = Pages::new(8, true);
    let r = p.range();
    u.protect(r.start..r.start + 4096).unwrap();
    u.unprotect(r.start..r.start + 4096).unwrap();
    // Unmapped behind our back (as glibc's free does), and mapped again at
    // the same place: the cached registration is stale.
    let (addr, len) = (r.start, p.len);
    drop(p);
    // SAFETY: a fresh private anonymous mapping at the address just freed
    // (MAP_FIXED_NOREPLACE: fails rather than clobber anything).
    let q = unsafe {
        libc::mmap(
            addr as *mut _,
            len,
            libc::PROT_READ | libc::PROT_WRITE,
            libc::MAP_PRIVATE | libc::MAP_ANONYMOUS | libc::MAP_FIXED_NOREPLACE,
            -1,
            0,
        )
    };
    if q as u64 != addr {
        eprintln!("skipped: the address was taken meanwhile");
        return;
    }
    // SAFETY: our new mapping.
    unsafe { std::ptr::write_bytes(q.cast::<u8>(), 7, len) };
    u.protect(addr..addr + 4096).unwrap();
    let target = addr + 100;
    let (h, done) = finishes_within(Duration::from_millis(100), move || {
        // SAFETY: inside the new mapping, which outlives the thread.
        unsafe { std::ptr::write_volatile(target as *mut u8, 1) };
    });
    assert!(!done.load(Ordering::SeqCst), "protected again");
    u.unprotect(addr..addr + 4096).unwrap();
    h.join().unwrap();
    // SAFETY: unmapping our mapping.
    unsafe { libc::munmap(q, len) };
}

/// Pin `len` bytes at `addr` the way a NIC's registration does (a
/// long-term pin), with io_uring's fixed buffers: the pin lasts as long as
/// the returned ring.
fn pin_like_a_nic(addr: usize, len: usize) -> Option<std::os::fd::OwnedFd> {
    use std::os::fd::{FromRawFd, OwnedFd};
    let mut params = [0u8; 120];
    // SAFETY: io_uring_setup(2) with a zeroed io_uring_params of its size.
    let fd = unsafe { libc::syscall(libc::SYS_io_uring_setup, 1u32, params.as_mut_ptr()) };
    if fd < 0 {
        return None;
    }
    // SAFETY: a descriptor io_uring_setup just returned, ours alone.
    let ring = unsafe { OwnedFd::from_raw_fd(fd as i32) };
    let iov = libc::iovec {
        iov_base: addr as *mut libc::c_void,
        iov_len: len,
    };
    const IORING_REGISTER_BUFFERS: u32 = 0;
    // SAFETY: io_uring_register(2) of one iovec of ours.
    let r = unsafe {
        libc::syscall(
            libc::SYS_io_uring_register,
            fd,
            IORING_REGISTER_BUFFERS,
            &raw const iov,
            1u32,
        )
    };
    (r == 0).then_some(ring)
}

/// Arming pages of a transparent huge page while another of its pages is
/// pinned (a NIC's registration of the bytes beside a receive's middle
/// pages): the kernel cannot split the huge page. 6.18 says EBUSY, and the
/// arm must then fail (the receive runs synchronously) with the pages
/// untouched. (6.12's `UFFDIO_MOVE` never returns here: it retries inside
/// the kernel, which is why the engine arms before it registers the bytes
/// beside, and why the shim does not arm receives over verbs yet.)
#[test]
fn arming_beside_a_pinned_page_of_a_huge_page_fails_instead_of_spinning() {
    let Some(mut u) = uffd() else { return };
    if !u.can_arm() {
        eprintln!("skipped: no UFFDIO_MOVE");
        return;
    }
    const HUGE: usize = 2 << 20;
    let map = Pages::new(2 * HUGE / 4096, false);
    let huge = map.ptr as usize + (HUGE - map.ptr as usize % HUGE) % HUGE;
    // SAFETY: madvise of our own mapping; then touch the huge page.
    unsafe {
        libc::madvise(huge as *mut libc::c_void, HUGE, libc::MADV_HUGEPAGE);
        std::ptr::write_bytes(huge as *mut u8, 3, HUGE);
    }
    let smaps = std::fs::read_to_string("/proc/self/smaps_rollup").unwrap_or_default();
    let anon_huge_kb: u64 = smaps
        .lines()
        .find_map(|l| l.strip_prefix("AnonHugePages:"))
        .and_then(|v| v.trim().trim_end_matches("kB").trim().parse().ok())
        .unwrap_or(0);
    if anon_huge_kb == 0 {
        eprintln!("skipped: no transparent huge page here");
        return;
    }
    let Some(_pin) = pin_like_a_nic(huge, 4096) else {
        eprintln!("skipped: io_uring cannot pin here");
        return;
    };
    let middle = (huge + 16 * 4096) as u64..(huge + 48 * 4096) as u64;
    let (tx, rx) = std::sync::mpsc::channel();
    let arm = std::thread::spawn(move || {
        let r = u.arm(middle.clone());
        let _ = tx.send(r.is_ok());
        (u, middle)
    });
    match rx.recv_timeout(Duration::from_secs(30)) {
        Ok(armed) => {
            let (mut u, middle) = arm.join().unwrap();
            if armed {
                // (A kernel that could move them after all: fine too.)
                u.disarm(middle, crate::conn::DisarmOutcome::Abandoned);
            }
        }
        Err(_) => panic!("arming beside a pinned huge page did not return in 30 s"),
    }
    // The pages are the program's again, with their bytes.
    // SAFETY: inside our mapping.
    assert_eq!(unsafe { *((huge + 20 * 4096) as *const u8) }, 3);
}
