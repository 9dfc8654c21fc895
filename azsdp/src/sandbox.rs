//! Is this process sandboxed, so that it may not create threads?
//!
//! A seccomp filter may kill a thread that calls `clone3` (sshd's pre-auth
//! child does: "only that thread dies", and its parent then waits for
//! ever). azsdp runs a connection on threads of its own (the reactor, the
//! userfaultfd dispatcher), so in such a process it never starts one: the
//! process makes no new upgraded connection, and one it inherited from a
//! fork is left to the process that runs it, which moves it onto its TCP
//! socket when this one uses it.
//!
//! Known from the program's own `prctl(PR_SET_SECCOMP)`, which the shim
//! sees before it takes effect, or from the kernel: `PR_GET_SECCOMP` in a
//! process that started without a filter, else strict mode or more
//! seccomp filters (`Seccomp_filters:` in `/proc/self/status`) than the
//! process started with. Filters a process starts with come from its
//! container or launcher, which let it start threads (a container's
//! default profile does), so they alone do not count.

use std::sync::atomic::{AtomicBool, AtomicI64, Ordering};

/// The program asked for a seccomp filter (or strict mode).
static MARKED: AtomicBool = AtomicBool::new(false);
/// Seccomp filters the process started with (-1: not read yet).
static BASELINE: AtomicI64 = AtomicI64::new(-1);

/// Read the filters the process starts with: at load, before the program
/// runs (a forked child inherits the parent's count and its baseline).
pub fn note_start() {
    if BASELINE.load(Ordering::SeqCst) < 0 {
        let n = status().map_or(0, |s| field(&s, "Seccomp_filters:").unwrap_or(0));
        BASELINE.store(i64::from(n), Ordering::SeqCst);
    }
}

/// The program is installing a seccomp filter: no thread of ours starts
/// from now on.
pub fn mark() {
    MARKED.store(true, Ordering::SeqCst);
}

/// Did the program install a seccomp filter itself (cheap: no read of
/// `/proc`)? Such a filter allows what the program calls, not what azsdp
/// would (a log line's signal-mask calls kill sshd's pre-auth child), so
/// azsdp stays quiet there.
pub fn marked() -> bool {
    MARKED.load(Ordering::SeqCst)
}

/// Might a seccomp filter stand between azsdp and a system call newer
/// than the program's own: one the process started with (its launcher's,
/// which may date from before that call), or one the program installed?
/// Cheap: two loads. (Such a filter may kill where it would refuse.)
pub fn filtered() -> bool {
    if BASELINE.load(Ordering::Relaxed) < 0 {
        // (Outside the shim: not read at load. Filters present now count.)
        note_start();
    }
    MARKED.load(Ordering::Relaxed) || BASELINE.load(Ordering::Relaxed) != 0
}

/// May azsdp start threads in this process?
pub fn restricted() -> bool {
    if MARKED.load(Ordering::SeqCst) {
        return true;
    }
    // Asked at every connection's start: the kernel says whether a filter
    // came in some way the shim did not see. A process that started with
    // none asks `prctl(PR_GET_SECCOMP)` (a quarter of a microsecond; 0:
    // none now either); one that started with some (a container's) counts
    // them in /proc (14 us). A filter that refuses the read itself says
    // enough, and so does a chroot without /proc (sshd's pre-auth child
    // chroots and drops its user before its filter: such a process must
    // not take the connection over either).
    if BASELINE.load(Ordering::SeqCst) == 0 {
        // SAFETY: prctl with integer arguments only.
        return unsafe { libc::prctl(libc::PR_GET_SECCOMP, 0, 0, 0, 0) } != 0;
    }
    let Some(s) = status() else {
        return true;
    };
    let base = BASELINE.load(Ordering::SeqCst).max(0);
    field(&s, "Seccomp:") == Some(1)
        || field(&s, "Seccomp_filters:").is_some_and(|n| i64::from(n) > base)
}

fn status() -> Option<String> {
    std::fs::read_to_string("/proc/self/status").ok()
}

/// A numeric field (`Seccomp:`, `Seccomp_filters:`) of a status text.
fn field(status: &str, name: &str) -> Option<u32> {
    status
        .lines()
        .find_map(|l| l.strip_prefix(name))
        .and_then(|v| v.trim().parse().ok())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_status_fields_say_the_mode_and_the_filters() {
        let st = "Name:\tx\nSeccomp:\t2\nSeccomp_filters:\t3\n";
        assert_eq!(field(st, "Seccomp:"), Some(2));
        assert_eq!(field(st, "Seccomp_filters:"), Some(3));
        assert_eq!(field("Name:\tx\n", "Seccomp:"), None);
        // Whatever filters this test process started with, it added none.
        note_start();
        assert!(!restricted());
    }

    #[test]
    fn a_filter_installed_behind_our_back_is_seen() {
        note_start();
        // SAFETY: fork; the child installs an allow-all filter with the
        // raw system call (no prctl the shim would see), asks, and exits.
        unsafe {
            let pid = libc::fork();
            if pid == 0 {
                let allow = [libc::sock_filter {
                    code: (libc::BPF_RET | libc::BPF_K) as u16,
                    jt: 0,
                    jf: 0,
                    k: libc::SECCOMP_RET_ALLOW,
                }];
                let prog = libc::sock_fprog {
                    len: 1,
                    filter: allow.as_ptr().cast_mut(),
                };
                libc::prctl(libc::PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0);
                let r = libc::syscall(
                    libc::SYS_seccomp,
                    libc::SECCOMP_SET_MODE_FILTER,
                    0,
                    &raw const prog,
                );
                let code = match (r, restricted(), restricted()) {
                    (0, true, true) => 0,
                    (0, ..) => 1,
                    _ => 2,
                };
                libc::_exit(code);
            }
            let mut st = 0;
            libc::waitpid(pid, &mut st, 0);
            assert_eq!(libc::WEXITSTATUS(st), 0, "status {st:#x}");
        }
        assert!(!restricted(), "the parent has no filter of its own");
    }
}
