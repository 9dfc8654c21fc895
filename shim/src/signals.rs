//! Should a blocking call that a signal handler interrupted fail with
//! EINTR? The kernel restarts socket calls after handlers installed with
//! SA_RESTART and fails them with EINTR otherwise. The wait does not say
//! which signal came, so: EINTR if any caught signal's handler lacks
//! SA_RESTART (asked of the kernel only when a wait was interrupted).

/// Does some signal have a handler installed without SA_RESTART?
pub fn some_handler_without_restart() -> bool {
    (1..libc::SIGRTMAX()).any(|sig| {
        // Faults are synchronous to the faulting code: they never cut a
        // wait short (and runtimes, ours included, catch SIGSEGV without
        // SA_RESTART).
        let synchronous = [
            libc::SIGSEGV,
            libc::SIGBUS,
            libc::SIGILL,
            libc::SIGFPE,
            libc::SIGTRAP,
            libc::SIGSYS,
        ];
        if sig == libc::SIGKILL || sig == libc::SIGSTOP || synchronous.contains(&sig) {
            return false;
        }
        // SAFETY: plain data, filled by the kernel.
        let mut old: libc::sigaction = unsafe { std::mem::zeroed() };
        // SAFETY: querying (act null) the disposition of a valid signal.
        let r = unsafe { libc::sigaction(sig, std::ptr::null(), &mut old) };
        r == 0
            && old.sa_sigaction != libc::SIG_DFL
            && old.sa_sigaction != libc::SIG_IGN
            && old.sa_flags & libc::SA_RESTART == 0
    })
}
