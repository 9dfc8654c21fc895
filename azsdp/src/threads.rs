//! azsdp's own threads.
//!
//! A program's process-directed signals (SIGALRM, SIGTERM, SIGINT, ...) go
//! to any thread that does not block them. Without the shim every thread is
//! the program's; with it, a signal the program expects to interrupt its
//! `epoll_wait` (redis on SIGTERM, Python on `alarm()`) could land on one of
//! ours and interrupt nothing. So every thread azsdp starts blocks every
//! signal but the synchronous ones (a fault in our own code must still be
//! reported, not ignored), and the program's threads receive them as
//! before.
//!
//! `unsafe` here: `pthread_sigmask`.

use std::io;
use std::thread::JoinHandle;

/// Signals the kernel raises on the faulting thread itself: left open.
const SYNCHRONOUS: [libc::c_int; 6] = [
    libc::SIGSEGV,
    libc::SIGBUS,
    libc::SIGFPE,
    libc::SIGILL,
    libc::SIGTRAP,
    libc::SIGSYS,
];

/// Fill `set` with every signal but the synchronous ones.
pub fn async_signals(set: &mut libc::sigset_t) {
    // SAFETY: filling and editing a set we own.
    unsafe {
        libc::sigfillset(set);
        for s in SYNCHRONOUS {
            libc::sigdelset(set, s);
        }
    }
}

/// Block, in the calling thread, every signal but the synchronous ones.
pub fn block_async_signals() {
    // SAFETY: sigset_t is plain data; the call applies our own set to the
    // calling thread only.
    unsafe {
        let mut set: libc::sigset_t = std::mem::zeroed();
        async_signals(&mut set);
        libc::pthread_sigmask(libc::SIG_BLOCK, &set, std::ptr::null_mut());
    }
}

/// Start a thread of azsdp's, named `name`, with asynchronous signals
/// blocked from its first instruction (they are blocked in the spawning
/// thread around the spawn, so the new thread inherits the mask).
pub fn spawn<F, T>(name: &str, f: F) -> io::Result<JoinHandle<T>>
where
    F: FnOnce() -> T + Send + 'static,
    T: Send + 'static,
{
    // SAFETY: as above; the old mask is restored right after the spawn.
    let old = unsafe {
        let mut set: libc::sigset_t = std::mem::zeroed();
        let mut old: libc::sigset_t = std::mem::zeroed();
        async_signals(&mut set);
        libc::pthread_sigmask(libc::SIG_BLOCK, &set, &mut old);
        old
    };
    let r = std::thread::Builder::new()
        .name(name.into())
        .spawn(move || {
            block_async_signals();
            f()
        });
    // SAFETY: restoring the spawning thread's own mask.
    unsafe { libc::pthread_sigmask(libc::SIG_SETMASK, &old, std::ptr::null_mut()) };
    r
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn our_threads_block_async_signals_and_the_spawner_keeps_its_mask() {
        let mask = |how: &str| {
            std::fs::read_to_string("/proc/thread-self/status")
                .unwrap()
                .lines()
                .find_map(|l| l.strip_prefix(how).map(|v| v.trim().to_string()))
                .unwrap()
        };
        let before = mask("SigBlk:");
        let h = spawn("azsdp-test", move || mask("SigBlk:")).unwrap();
        let theirs = u64::from_str_radix(&h.join().unwrap(), 16).unwrap();
        let alrm = 1u64 << (libc::SIGALRM - 1);
        let segv = 1u64 << (libc::SIGSEGV - 1);
        assert!(theirs & alrm != 0, "SIGALRM blocked in our thread");
        assert!(theirs & segv == 0, "SIGSEGV left open");
        assert_eq!(mask("SigBlk:"), before, "the spawner's mask is unchanged");
    }
}
