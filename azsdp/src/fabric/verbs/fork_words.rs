//! Words a connection's side shares with the processes forked from the one
//! that made it: whether one of them asked the runner to move the
//! connection onto its TCP socket, and whether it has. (A queue pair stays
//! with its process; the others use the connection through it, or, once it
//! moved, through the kernel's socket: `driver::delegation`.)
//!
//! `unsafe` here: the shared mapping.

use std::sync::atomic::{AtomicU32, Ordering};

#[repr(C)]
struct Words {
    leave: AtomicU32,
    left: AtomicU32,
}

/// One page of `MAP_SHARED` anonymous memory (inherited by every fork).
#[derive(Debug)]
pub struct ForkWords {
    ptr: *mut Words,
}

// SAFETY: the page holds atomics only, shared on purpose.
unsafe impl Send for ForkWords {}
// SAFETY: as above.
unsafe impl Sync for ForkWords {}

const LEN: usize = 4096;

impl ForkWords {
    pub fn new() -> std::io::Result<ForkWords> {
        // SAFETY: a fresh anonymous shared mapping, owned by the result;
        // zero-filled, which is a valid `Words`.
        let p = unsafe {
            libc::mmap(
                std::ptr::null_mut(),
                LEN,
                libc::PROT_READ | libc::PROT_WRITE,
                libc::MAP_SHARED | libc::MAP_ANONYMOUS,
                -1,
                0,
            )
        };
        if p == libc::MAP_FAILED {
            return Err(std::io::Error::last_os_error());
        }
        Ok(ForkWords { ptr: p.cast() })
    }

    fn words(&self) -> &Words {
        // SAFETY: mapped, page-aligned and zero-initialised for as long as
        // `self` lives.
        unsafe { &*self.ptr }
    }

    pub fn request_leave(&self) {
        self.words().leave.store(1, Ordering::Release);
    }

    pub fn leave_requested(&self) -> bool {
        self.words().leave.load(Ordering::Acquire) != 0
    }

    pub fn mark_left(&self) {
        let w = &self.words().left;
        w.store(1, Ordering::Release);
        crate::futex::wake_all(w);
    }

    pub fn has_left(&self) -> bool {
        self.words().left.load(Ordering::Acquire) != 0
    }
}

impl Drop for ForkWords {
    fn drop(&mut self) {
        // SAFETY: our own mapping (the other processes keep theirs).
        unsafe { libc::munmap(self.ptr.cast(), LEN) };
    }
}
