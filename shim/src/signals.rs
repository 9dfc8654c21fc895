//! Signals during a blocking socket call on an upgraded socket, as the
//! kernel treats them: a handler installed with SA_RESTART runs and the
//! call goes on; any other handler runs and the call fails with EINTR.
//!
//! The call waits in our code and on futexes, not in one system call the
//! signal would cut short, and a signal handled between two of our waits
//! would interrupt nothing. So once a call is about to sleep, asynchronous
//! signals stay pending ([`CallSignals`], the same window `poll` and
//! `epoll_wait` use), and before each sleep the kernel is asked which
//! signals are pending: restartable ones are delivered there and then, any
//! other ends the call with EINTR (its handler runs as the window closes,
//! before the call returns). A signal is then seen within one sleep (at
//! most 20 ms), never missed.

/// The pending-signal window of one blocking call, opened by its first
/// [`CallSignals::interrupted`] (a call that never sleeps never opens it).
#[derive(Default)]
pub struct CallSignals {
    window: std::cell::RefCell<Option<crate::ready::SignalWindow>>,
}

impl CallSignals {
    /// About to sleep: should the call end with EINTR? Restartable signals
    /// pending now are delivered here.
    pub fn interrupted(&self) -> bool {
        let mut w = self.window.borrow_mut();
        let window = w.get_or_insert_with(crate::ready::SignalWindow::open);
        // SAFETY: plain data filled by the kernel.
        let mut pending: libc::sigset_t = unsafe { std::mem::zeroed() };
        // SAFETY: sigpending into our own set.
        unsafe { libc::sigpending(&mut pending) };
        let mut any = false;
        let mut cut = false;
        for sig in 1..libc::SIGRTMAX() {
            // SAFETY: membership tests on sets we own.
            let (is_pending, blocked) = unsafe {
                (
                    libc::sigismember(&pending, sig) == 1,
                    libc::sigismember(window.program_mask(), sig) == 1,
                )
            };
            if is_pending && !blocked {
                any = true;
                cut |= !restartable(sig);
            }
        }
        if any && !cut {
            window.deliver();
        }
        cut
    }
}

/// Would the kernel restart a socket call after `sig`? Yes for a handler
/// with SA_RESTART, an ignored signal, or a default action (which
/// terminates, stops and continues, or ignores: never EINTR).
fn restartable(sig: libc::c_int) -> bool {
    // SAFETY: plain data, filled by the kernel.
    let mut old: libc::sigaction = unsafe { std::mem::zeroed() };
    // SAFETY: querying (act null) the disposition of a valid signal.
    let r = unsafe { libc::sigaction(sig, std::ptr::null(), &mut old) };
    r != 0
        || old.sa_sigaction == libc::SIG_DFL
        || old.sa_sigaction == libc::SIG_IGN
        || old.sa_flags & libc::SA_RESTART != 0
}
