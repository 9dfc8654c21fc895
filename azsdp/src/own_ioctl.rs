//! `ioctl` on a descriptor of our own, by system call.
//!
//! Inside the preloaded shim, `libc::ioctl` named from this crate resolves
//! to the shim's own `ioctl` (the process's first definition), which saves
//! errno, looks the descriptor up among the program's sockets and only then
//! calls the kernel. Our own descriptors (the memory-map handle, the
//! userfaultfd) never need that: a request of an event loop made three
//! `PROCMAP_QUERY`s through it when its buffers were not cached.
//!
//! `unsafe` here: the raw `ioctl(2)` call.

use std::os::fd::RawFd;

/// `ioctl(fd, request, arg)`: the kernel's return value (-1 with errno
/// set on failure).
///
/// # Safety
/// `arg` must be what `request` expects: the address of the structure it
/// reads and writes, valid for the call, or a value it takes by value.
pub unsafe fn ioctl(fd: RawFd, request: libc::c_ulong, arg: usize) -> libc::c_int {
    // SAFETY: the caller passes the argument `request` expects.
    unsafe { libc::syscall(libc::SYS_ioctl, fd, request, arg) as libc::c_int }
}
