use super::*;
use crate::protect::test_support::{Pages, PipeRead};
use std::sync::Arc;
use std::sync::atomic::AtomicBool;

/// `pages` private anonymous pages, filled with 7 (unmapped on drop).
fn anon(pages: usize) -> (Pages, Range<u64>) {
    let p = Pages::new(pages, true);
    let r = p.range();
    (p, r)
}

#[test]
fn a_write_to_a_protected_page_waits_and_is_reported() {
    let mut m = MprotectProtect::new().unwrap();
    let (_p, r) = anon(4);
    m.protect(r.start + 4096..r.start + 3 * 4096).unwrap();
    let target = r.start + 2 * 4096 + 8;
    let done = Arc::new(AtomicBool::new(false));
    let d2 = Arc::clone(&done);
    let h = std::thread::spawn(move || {
        // SAFETY: inside our mapping, which outlives the thread.
        unsafe { std::ptr::write_volatile(target as *mut u8, 42) };
        d2.store(true, Ordering::SeqCst);
    });
    let f = m
        .faults()
        .next_timeout(Duration::from_secs(5))
        .expect("the fault is reported");
    assert_eq!(f.addr, target);
    assert!(f.write);
    std::thread::sleep(Duration::from_millis(50));
    assert!(!done.load(Ordering::SeqCst), "the writer waits");
    // Reads are fine meanwhile.
    // SAFETY: inside our mapping.
    assert_eq!(unsafe { std::ptr::read_volatile(target as *const u8) }, 7);
    m.unprotect(r.start + 2 * 4096..r.start + 3 * 4096);
    h.join().unwrap();
    // SAFETY: inside our mapping.
    assert_eq!(unsafe { *(target as *const u8) }, 42);
    // The rest of the range stays protected until lifted.
    assert!(lookup(r.start + 4096).is_some());
    m.unprotect(r.start + 4096..r.start + 2 * 4096);
    assert!(lookup(r.start + 4096).is_none());
}

#[test]
fn a_syscall_writing_a_protected_page_fails_with_efault() {
    // The documented trade-off of this backend.
    let mut m = MprotectProtect::new().unwrap();
    let (_p, r) = anon(1);
    m.protect(r.clone()).unwrap();
    let read = PipeRead::start(r.start, b"hello", Duration::ZERO);
    assert_eq!(read.finish(), -(libc::EFAULT as isize));
    m.unprotect(r);
}

/// Run `f` in a forked child; its exit status.
fn in_child(f: impl FnOnce() -> i32) -> nix::sys::wait::WaitStatus {
    // SAFETY: the child runs `f` and leaves with _exit.
    match unsafe { nix::unistd::fork() }.unwrap() {
        nix::unistd::ForkResult::Child => {
            let code = f();
            // SAFETY: leave without returning into the harness.
            unsafe { libc::_exit(code) }
        }
        nix::unistd::ForkResult::Parent { child } => nix::sys::wait::waitpid(child, None).unwrap(),
    }
}

extern "C" fn app_handler(_: libc::c_int, _: *mut libc::siginfo_t, _: *mut libc::c_void) {
    // SAFETY: async-signal-safe exit.
    unsafe { libc::_exit(42) };
}

/// A read-only page that is not ours (left mapped: the child exits).
fn foreign_page() -> u64 {
    let (p, r) = anon(1);
    std::mem::forget(p);
    // SAFETY: our own mapping.
    unsafe { libc::mprotect(r.start as *mut _, 4096, libc::PROT_READ) };
    r.start
}

#[test]
fn faults_that_are_not_ours_reach_the_applications_handler() {
    // In a child, so that installing handlers affects no other test.
    let status = in_child(|| {
        // SAFETY: installing a plain SA_SIGINFO handler in a fresh child.
        unsafe {
            let mut act: libc::sigaction = std::mem::zeroed();
            act.sa_sigaction = app_handler as *const () as usize;
            act.sa_flags = libc::SA_SIGINFO;
            libc::sigaction(libc::SIGSEGV, &act, std::ptr::null_mut());
        }
        let _m = MprotectProtect::new().unwrap();
        // Ours goes over the application's, as when the program installed
        // its handler first (the parent may have installed ours already).
        // SAFETY: single-threaded child, nothing protected.
        unsafe { install_handler() };
        let p = foreign_page();
        // SAFETY: a write to a read-only page: the app's handler exits 42.
        unsafe { std::ptr::write_volatile(p as *mut u8, 1) };
        0
    });
    assert_eq!(
        status,
        nix::sys::wait::WaitStatus::Exited(status.pid().unwrap(), 42)
    );
}

#[test]
fn faults_that_are_not_ours_kill_as_without_us() {
    let status = in_child(|| {
        // Keep the default action, as a program without a handler has.
        let _m = MprotectProtect::new().unwrap();
        let p = foreign_page();
        // SAFETY: a write to a read-only page: SIGSEGV, default action.
        unsafe { std::ptr::write_volatile(p as *mut u8, 1) };
        0
    });
    assert!(
        matches!(
            status,
            nix::sys::wait::WaitStatus::Signaled(_, nix::sys::signal::Signal::SIGSEGV, _)
        ),
        "{status:?}"
    );
}
