//! Sizing the files azsdp makes (shm segments, stat files) without
//! SIGXFSZ.
//!
//! A process may run under a file-size limit (`RLIMIT_FSIZE`; sshd's
//! children have 0). Growing a file past it, memfds included, raises
//! SIGXFSZ, which kills the program by default: azsdp would kill a program
//! TCP serves. So the size is checked against the limit first, and a file
//! that may not grow is an error (EFBIG) for the caller to handle.

use std::fs::File;
use std::io;

use nix::sys::resource::{Resource, getrlimit};

/// Set `file`'s length to `len`, unless the process's file-size limit
/// forbids it (then EFBIG, and no signal).
pub fn set_len(file: &File, len: u64) -> io::Result<()> {
    if !allowed(len) {
        return Err(io::Error::new(
            io::ErrorKind::FileTooLarge,
            format!("the process's file-size limit (RLIMIT_FSIZE) is below {len} bytes"),
        ));
    }
    file.set_len(len)
}

/// May this process grow a file to `len` bytes?
pub fn allowed(len: u64) -> bool {
    match getrlimit(Resource::RLIMIT_FSIZE) {
        Ok((soft, _)) => soft == libc::RLIM_INFINITY || len <= soft,
        Err(_) => true,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn within_the_limit_a_file_grows() {
        let f = memfd();
        set_len(&f, 8192).expect("no limit in tests");
        assert_eq!(f.metadata().unwrap().len(), 8192);
    }

    /// Under `RLIMIT_FSIZE = 0` (in a child: the limit is process-wide),
    /// growing fails with EFBIG and the process lives.
    #[test]
    fn past_the_limit_growing_fails_without_a_signal() {
        let f = memfd();
        // SAFETY: the child makes system calls and leaves with _exit.
        let pid = unsafe { libc::fork() };
        assert!(pid >= 0);
        if pid == 0 {
            let zero = libc::rlimit {
                rlim_cur: 0,
                rlim_max: libc::RLIM_INFINITY,
            };
            // SAFETY: setrlimit of our own process, then _exit.
            unsafe {
                libc::setrlimit(libc::RLIMIT_FSIZE, &zero);
                let ok = !allowed(1) && set_len(&f, 4096).is_err() && allowed(0);
                libc::_exit(if ok { 0 } else { 1 });
            }
        }
        let mut status = 0;
        // SAFETY: waitpid on our own child.
        unsafe { libc::waitpid(pid, &mut status, 0) };
        assert!(
            libc::WIFEXITED(status) && libc::WEXITSTATUS(status) == 0,
            "status {status:#x}"
        );
    }

    fn memfd() -> File {
        use nix::sys::memfd::{MFdFlags, memfd_create};
        File::from(memfd_create(c"azsdp-file-size-test", MFdFlags::MFD_CLOEXEC).expect("memfd"))
    }
}
