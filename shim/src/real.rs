//! The functions the shim interposes, as libc implements them: found with
//! `dlsym(RTLD_NEXT, name)` on first use and cached.
//!
//! `unsafe` here: calling through resolved symbol addresses. Every wrapper
//! has the C prototype of the function it stands for.
//!
//! `fcntl` and `ioctl` are variadic in C; stable Rust cannot define or call
//! variadic functions, so they take their one optional argument as a
//! machine word. On the Linux ABIs we build for (x86-64 System V, AArch64
//! AAPCS64) a variadic integer or pointer argument travels exactly like a
//! named one, so this is the same call.

#![allow(clippy::missing_safety_doc)]

use libc::{
    c_int, c_ulong, c_void, epoll_event, fd_set, msghdr, nfds_t, off_t, pollfd, sigset_t, size_t,
    sockaddr, socklen_t, ssize_t, timespec, timeval,
};
use std::sync::atomic::{AtomicUsize, Ordering};

/// Address of the next definition of `name` (NUL-terminated), or abort:
/// without libc's own functions the program cannot run at all.
fn resolve(name: &'static [u8]) -> usize {
    // SAFETY: name is NUL-terminated (the macro appends the NUL).
    let p = unsafe { libc::dlsym(libc::RTLD_NEXT, name.as_ptr().cast()) };
    if p.is_null() {
        let msg = b"azsdp: cannot find libc's own definition of an interposed function\n";
        // SAFETY: plain write(2) of a static buffer, then abort.
        unsafe {
            libc::syscall(libc::SYS_write, 2, msg.as_ptr(), msg.len());
            libc::abort();
        }
    }
    p as usize
}

unsafe extern "C" {
    #[link_name = "environ"]
    static ENVIRON: *const *const libc::c_char;
}

/// The process's environment array (what `execv` and `execvp` pass).
///
/// # Safety
/// Not while another thread changes the environment.
pub unsafe fn environ() -> *const *const libc::c_char {
    // SAFETY: reading libc's `environ` variable.
    unsafe { ENVIRON }
}

/// Address of the next definition of `name` (NUL-terminated), for a
/// call that cannot go through a typed wrapper (variadic functions).
pub fn next_definition(name: &'static [u8]) -> usize {
    resolve(name)
}

macro_rules! real {
    ($( fn $name:ident($($arg:ident: $t:ty),*) -> $ret:ty; )*) => {
        $(
            #[inline]
            pub unsafe fn $name($($arg: $t),*) -> $ret {
                static ADDR: AtomicUsize = AtomicUsize::new(0);
                let mut a = ADDR.load(Ordering::Relaxed);
                if a == 0 {
                    a = resolve(concat!(stringify!($name), "\0").as_bytes());
                    ADDR.store(a, Ordering::Relaxed);
                }
                // SAFETY: `a` is libc's definition of this very function,
                // whose C prototype the signature below spells out.
                unsafe {
                    let f: unsafe extern "C" fn($($t),*) -> $ret = std::mem::transmute(a);
                    f($($arg),*)
                }
            }
        )*
    };
}

real! {
    fn socket(domain: c_int, ty: c_int, protocol: c_int) -> c_int;
    fn bind(fd: c_int, addr: *const sockaddr, len: socklen_t) -> c_int;
    fn listen(fd: c_int, backlog: c_int) -> c_int;
    fn accept4(fd: c_int, addr: *mut sockaddr, len: *mut socklen_t, flags: c_int) -> c_int;
    fn connect(fd: c_int, addr: *const sockaddr, len: socklen_t) -> c_int;
    fn close(fd: c_int) -> c_int;
    fn closefrom(low: c_int) -> ();
    fn shutdown(fd: c_int, how: c_int) -> c_int;
    fn send(fd: c_int, buf: *const c_void, len: size_t, flags: c_int) -> ssize_t;
    fn sendto(fd: c_int, buf: *const c_void, len: size_t, flags: c_int, addr: *const sockaddr, alen: socklen_t) -> ssize_t;
    fn sendmsg(fd: c_int, msg: *const msghdr, flags: c_int) -> ssize_t;
    fn recv(fd: c_int, buf: *mut c_void, len: size_t, flags: c_int) -> ssize_t;
    fn recvfrom(fd: c_int, buf: *mut c_void, len: size_t, flags: c_int, addr: *mut sockaddr, alen: *mut socklen_t) -> ssize_t;
    fn recvmsg(fd: c_int, msg: *mut msghdr, flags: c_int) -> ssize_t;
    fn sendmmsg(fd: c_int, v: *mut libc::mmsghdr, n: libc::c_uint, flags: c_int) -> c_int;
    fn recvmmsg(fd: c_int, v: *mut libc::mmsghdr, n: libc::c_uint, flags: c_int, timeout: *mut timespec) -> c_int;
    fn splice(fd_in: c_int, off_in: *mut libc::loff_t, fd_out: c_int, off_out: *mut libc::loff_t, len: size_t, flags: libc::c_uint) -> ssize_t;
    fn read(fd: c_int, buf: *mut c_void, len: size_t) -> ssize_t;
    fn write(fd: c_int, buf: *const c_void, len: size_t) -> ssize_t;
    fn readv(fd: c_int, iov: *const libc::iovec, n: c_int) -> ssize_t;
    fn writev(fd: c_int, iov: *const libc::iovec, n: c_int) -> ssize_t;
    fn sendfile(out: c_int, inp: c_int, off: *mut off_t, count: size_t) -> ssize_t;
    fn poll(fds: *mut pollfd, n: nfds_t, timeout: c_int) -> c_int;
    fn ppoll(fds: *mut pollfd, n: nfds_t, ts: *const timespec, mask: *const sigset_t) -> c_int;
    fn select(n: c_int, r: *mut fd_set, w: *mut fd_set, e: *mut fd_set, tv: *mut timeval) -> c_int;
    fn pselect(n: c_int, r: *mut fd_set, w: *mut fd_set, e: *mut fd_set, ts: *const timespec, mask: *const sigset_t) -> c_int;
    fn epoll_create(size: c_int) -> c_int;
    fn epoll_create1(flags: c_int) -> c_int;
    fn epoll_ctl(epfd: c_int, op: c_int, fd: c_int, ev: *mut epoll_event) -> c_int;
    fn epoll_pwait(epfd: c_int, ev: *mut epoll_event, max: c_int, timeout: c_int, mask: *const sigset_t) -> c_int;
    fn epoll_pwait2(epfd: c_int, ev: *mut epoll_event, max: c_int, timeout: *const timespec, mask: *const sigset_t) -> c_int;
    fn fcntl(fd: c_int, cmd: c_int, arg: usize) -> c_int;
    fn fcntl64(fd: c_int, cmd: c_int, arg: usize) -> c_int;
    fn sendfile64(out: c_int, inp: c_int, off: *mut off_t, count: size_t) -> ssize_t;
    fn __read_chk(fd: c_int, buf: *mut c_void, len: size_t, buflen: size_t) -> ssize_t;
    fn __recv_chk(fd: c_int, buf: *mut c_void, len: size_t, buflen: size_t, flags: c_int) -> ssize_t;
    fn __recvfrom_chk(fd: c_int, buf: *mut c_void, len: size_t, buflen: size_t, flags: c_int, addr: *mut sockaddr, alen: *mut socklen_t) -> ssize_t;
    fn __poll_chk(fds: *mut pollfd, n: nfds_t, timeout: c_int, fdslen: size_t) -> c_int;
    fn __ppoll_chk(fds: *mut pollfd, n: nfds_t, ts: *const timespec, mask: *const sigset_t, fdslen: size_t) -> c_int;
    fn ioctl(fd: c_int, req: c_ulong, arg: usize) -> c_int;
    fn dup(fd: c_int) -> c_int;
    fn dup2(fd: c_int, fd2: c_int) -> c_int;
    fn dup3(fd: c_int, fd2: c_int, flags: c_int) -> c_int;
    fn setsockopt(fd: c_int, level: c_int, name: c_int, val: *const c_void, len: socklen_t) -> c_int;
    fn getsockopt(fd: c_int, level: c_int, name: c_int, val: *mut c_void, len: *mut socklen_t) -> c_int;
    fn getsockname(fd: c_int, addr: *mut sockaddr, len: *mut socklen_t) -> c_int;
    fn getpeername(fd: c_int, addr: *mut sockaddr, len: *mut socklen_t) -> c_int;
    fn fork() -> libc::pid_t;
    fn _exit(status: c_int) -> ();
    fn prctl(option: c_int, a2: c_ulong, a3: c_ulong, a4: c_ulong, a5: c_ulong) -> c_int;
    fn execve(path: *const libc::c_char, argv: *const *const libc::c_char, envp: *const *const libc::c_char) -> c_int;
    fn execvpe(file: *const libc::c_char, argv: *const *const libc::c_char, envp: *const *const libc::c_char) -> c_int;
    fn fexecve(fd: c_int, argv: *const *const libc::c_char, envp: *const *const libc::c_char) -> c_int;
    fn execveat(dirfd: c_int, path: *const libc::c_char, argv: *const *const libc::c_char, envp: *const *const libc::c_char, flags: c_int) -> c_int;
    fn posix_spawn_file_actions_init(fa: *mut libc::posix_spawn_file_actions_t) -> c_int;
    fn posix_spawn_file_actions_destroy(fa: *mut libc::posix_spawn_file_actions_t) -> c_int;
    fn posix_spawn_file_actions_adddup2(fa: *mut libc::posix_spawn_file_actions_t, fd: c_int, newfd: c_int) -> c_int;
    fn posix_spawn(pid: *mut libc::pid_t, path: *const libc::c_char, fa: *const libc::posix_spawn_file_actions_t, attr: *const libc::posix_spawnattr_t, argv: *const *mut libc::c_char, envp: *const *mut libc::c_char) -> c_int;
    fn posix_spawnp(pid: *mut libc::pid_t, file: *const libc::c_char, fa: *const libc::posix_spawn_file_actions_t, attr: *const libc::posix_spawnattr_t, argv: *const *mut libc::c_char, envp: *const *mut libc::c_char) -> c_int;
    fn system(cmd: *const libc::c_char) -> c_int;
    fn popen(cmd: *const libc::c_char, mode: *const libc::c_char) -> *mut libc::FILE;
    fn setuid(id: libc::uid_t) -> c_int;
    fn setgid(id: libc::gid_t) -> c_int;
    fn seteuid(id: libc::uid_t) -> c_int;
    fn setegid(id: libc::gid_t) -> c_int;
    fn setreuid(r: libc::uid_t, e: libc::uid_t) -> c_int;
    fn setregid(r: libc::gid_t, e: libc::gid_t) -> c_int;
    fn setresuid(r: libc::uid_t, e: libc::uid_t, s: libc::uid_t) -> c_int;
    fn setresgid(r: libc::gid_t, e: libc::gid_t, s: libc::gid_t) -> c_int;
    fn free(p: *mut c_void) -> ();
    fn realloc(p: *mut c_void, n: size_t) -> *mut c_void;
    fn munmap(addr: *mut c_void, len: size_t) -> c_int;
    fn mmap(addr: *mut c_void, len: size_t, prot: c_int, flags: c_int, fd: c_int, off: off_t) -> *mut c_void;
    fn mremap(old: *mut c_void, old_len: size_t, new_len: size_t, flags: c_int, new_addr: *mut c_void) -> *mut c_void;
    fn madvise(addr: *mut c_void, len: size_t, advice: c_int) -> c_int;
    fn mprotect(addr: *mut c_void, len: size_t, prot: c_int) -> c_int;
    fn pkey_mprotect(addr: *mut c_void, len: size_t, prot: c_int, pkey: c_int) -> c_int;
}

/// `malloc_usable_size` is not interposed: call libc's directly.
pub unsafe fn usable_size(p: *mut c_void) -> size_t {
    // SAFETY: p came from malloc (the caller's contract for free/realloc).
    unsafe { libc::malloc_usable_size(p) }
}

/// The calling thread's errno.
pub fn set_errno(e: c_int) {
    // SAFETY: __errno_location always returns this thread's errno slot.
    unsafe { *libc::__errno_location() = e };
}

pub fn errno() -> c_int {
    std::io::Error::last_os_error().raw_os_error().unwrap_or(0)
}

/// Keeps the thread's errno as it was when made, for cleanup that runs
/// after a real call (whose errno is the program's answer) and may make
/// system calls of its own.
pub struct KeepErrno(c_int);

impl KeepErrno {
    pub fn new() -> KeepErrno {
        KeepErrno(errno())
    }
}

impl Drop for KeepErrno {
    fn drop(&mut self) {
        set_errno(self.0);
    }
}

/// A send (`sent`) or receive on socket `fd` of the buffers, with `flags`,
/// by libc's calls. Without flags, the plain calls the program itself
/// makes: a seccomp sandbox (sshd's pre-auth child) may allow only those.
///
/// # Safety
/// The buffers must be the program's, valid for the call as it passed them.
pub unsafe fn io<T>(fd: c_int, sent: bool, bufs: &[(*const T, usize)], flags: c_int) -> ssize_t {
    let iov: Vec<libc::iovec> = bufs
        .iter()
        .map(|&(p, l)| libc::iovec {
            iov_base: p.cast_mut().cast(),
            iov_len: l,
        })
        .collect();
    // SAFETY: a msghdr of ours naming the program's buffers.
    let mut m: msghdr = unsafe { std::mem::zeroed() };
    m.msg_iov = iov.as_ptr().cast_mut();
    m.msg_iovlen = iov.len() as _;
    // SAFETY: libc's calls on the program's descriptor and buffers.
    unsafe {
        match (sent, flags, iov.len()) {
            (true, 0, 1) => write(fd, iov[0].iov_base, iov[0].iov_len),
            (false, 0, 1) => read(fd, iov[0].iov_base, iov[0].iov_len),
            (true, 0, n) => writev(fd, iov.as_ptr(), n as c_int),
            (false, 0, n) => readv(fd, iov.as_ptr(), n as c_int),
            (true, ..) => sendmsg(fd, &m, flags),
            (false, ..) => recvmsg(fd, &mut m, flags),
        }
    }
}

/// The socket's pending error, taken (SO_ERROR), with libc's call.
pub fn so_error(fd: c_int) -> c_int {
    let mut err: c_int = 0;
    let mut len = std::mem::size_of::<c_int>() as libc::socklen_t;
    // SAFETY: SO_ERROR into our own int.
    unsafe {
        getsockopt(
            fd,
            libc::SOL_SOCKET,
            libc::SO_ERROR,
            (&raw mut err).cast(),
            &mut len,
        )
    };
    err
}
