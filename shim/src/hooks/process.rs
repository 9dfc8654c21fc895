//! Process and memory: fork, and the memory calls that end or move pages
//! a connection may still hold (free, realloc, munmap, mremap, madvise);
//! exec and changes of user or group, before which connections move onto
//! their TCP socket.

use libc::{c_char, c_int, c_void, off_t, size_t};

use super::{guard, hook, quietly};
use std::ffi::CStr;

use crate::next_image::Target;
use crate::{exec_park, real, runtime};

#[unsafe(no_mangle)]
pub unsafe extern "C" fn fork() -> libc::pid_t {
    hook(|| {
        // The core's pthread_atfork handlers settle in-flight pages and freeze
        // every connection; whichever process uses one first takes it (see
        // docs/shim.md).
        // Pairs under way stay on TCP (both processes see the count), and
        // so do connections with nothing on the fabric yet.
        crate::pending::forking();
        quietly(crate::switch::before_fork);
        // SAFETY: libc's fork.
        let pid = unsafe { real::fork() };
        if pid == 0 {
            guard((), runtime::after_fork_in_child);
        } else if let Ok(child) = u32::try_from(pid)
            && child > 0
        {
            // Before the program can close its copy: a connection the
            // child holds must not end at another process's close.
            guard((), || azsdp::process::forked_holder(child));
        }
        pid
    })
}

/// `_exit` (and `_Exit`, the same function) runs no exit handler, and
/// forked children leave by it: a connection this process serves for
/// others after a fork would go with it (its engine is in this process's
/// memory). So it moves onto its TCP socket first, where they carry on.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn _exit(status: c_int) -> ! {
    quietly(crate::switch::before_exit_without_handlers);
    // SAFETY: libc's _exit; it does not return.
    unsafe { real::_exit(status) };
    // SAFETY: libc's _exit never returns; this is the raw system call in
    // case a broken resolver gave us something that did.
    unsafe { libc::syscall(libc::SYS_exit_group, status) };
    unreachable!("exit_group returned")
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn _Exit(status: c_int) -> ! {
    // SAFETY: the same contract.
    unsafe { _exit(status) }
}

/// vfork's child would share our address space (and its protected pages)
/// with a parent whose threads keep running: a real fork is the safe
/// reading of vfork's contract.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn vfork() -> libc::pid_t {
    hook(|| {
        // SAFETY: our fork, above.
        unsafe { fork() }
    })
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn free(p: *mut c_void) {
    if !p.is_null() && azsdp::process::releases_matter() {
        // SAFETY: p is a live malloc chunk (free's contract).
        let n = unsafe { real::usable_size(p) };
        quietly(|| azsdp::process::before_free(p as u64, n as u64));
    }
    // SAFETY: libc's free.
    unsafe { real::free(p) }
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn realloc(p: *mut c_void, n: size_t) -> *mut c_void {
    if !p.is_null() && azsdp::process::releases_matter() {
        // SAFETY: p is a live malloc chunk (realloc's contract).
        let u = unsafe { real::usable_size(p) };
        quietly(|| azsdp::process::before_realloc(p as u64, u as u64));
    }
    // SAFETY: libc's realloc.
    unsafe { real::realloc(p, n) }
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn munmap(addr: *mut c_void, len: size_t) -> c_int {
    quietly(|| azsdp::process::before_unmap(addr as u64, len as u64));
    // SAFETY: libc's munmap.
    let r = unsafe { real::munmap(addr, len) };
    if r == 0 {
        quietly(|| azsdp::process::after_unmap(addr as u64, len as u64));
    }
    r
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn mmap(
    addr: *mut c_void,
    len: size_t,
    prot: c_int,
    flags: c_int,
    fd: c_int,
    off: off_t,
) -> *mut c_void {
    // SAFETY: libc's mmap.
    let r = unsafe { real::mmap(addr, len, prot, flags, fd, off) };
    if r != libc::MAP_FAILED {
        quietly(|| azsdp::process::after_mmap(r as u64, flags));
        if flags & libc::MAP_FIXED != 0 {
            quietly(|| azsdp::process::after_mmap_over(r as u64, len as u64));
        }
    }
    r
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn mremap(
    old: *mut c_void,
    old_len: size_t,
    new_len: size_t,
    flags: c_int,
    new_addr: *mut c_void,
) -> *mut c_void {
    quietly(|| azsdp::process::before_remap(old as u64, old_len as u64));
    // SAFETY: libc's mremap (new_addr is read only with MREMAP_FIXED).
    let r = unsafe { real::mremap(old, old_len, new_len, flags, new_addr) };
    if r != libc::MAP_FAILED {
        quietly(|| azsdp::process::after_remap(old as u64, old_len as u64));
        if flags & libc::MREMAP_FIXED != 0 {
            // Whatever was mapped where the range moved to is gone.
            quietly(|| azsdp::process::after_mmap_over(r as u64, new_len as u64));
        }
    }
    r
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn madvise(addr: *mut c_void, len: size_t, advice: c_int) -> c_int {
    quietly(|| azsdp::process::before_madvise(addr as u64, len as u64, advice));
    // SAFETY: libc's madvise.
    unsafe { real::madvise(addr, len, advice) }
}

/// A program's change of protection: the pages a thread checked before
/// (`user_mem::check_buffer`) may be read-only or gone now. Our own
/// protection (the mprotect protector) is not the program's: the
/// connection that made it settles its pages itself.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn mprotect(addr: *mut c_void, len: size_t, prot: c_int) -> c_int {
    // SAFETY: libc's mprotect.
    let r = unsafe { real::mprotect(addr, len, prot) };
    if r == 0 && !azsdp::process::inside() {
        quietly(|| {
            azsdp::memory_map::changed(addr as u64..(addr as u64).saturating_add(len as u64))
        });
    }
    r
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn pkey_mprotect(
    addr: *mut c_void,
    len: size_t,
    prot: c_int,
    pkey: c_int,
) -> c_int {
    // SAFETY: libc's pkey_mprotect.
    let r = unsafe { real::pkey_mprotect(addr, len, prot, pkey) };
    if r == 0 && !azsdp::process::inside() {
        quietly(|| {
            azsdp::memory_map::changed(addr as u64..(addr as u64).saturating_add(len as u64))
        });
    }
    r
}

/// `prctl` is variadic in C; its arguments travel as machine words (see
/// `real`). A seccomp filter may forbid the threads azsdp starts: we learn
/// of it here, before it takes effect (`azsdp::sandbox`).
#[unsafe(no_mangle)]
pub unsafe extern "C" fn prctl(
    option: c_int,
    a2: libc::c_ulong,
    a3: libc::c_ulong,
    a4: libc::c_ulong,
    a5: libc::c_ulong,
) -> c_int {
    if option == libc::PR_SET_SECCOMP {
        quietly(crate::switch::before_sandbox);
        azsdp::sandbox::mark();
    }
    // SAFETY: libc's prctl with the program's argument words.
    unsafe { real::prctl(option, a2, a3, a4, a5) }
}

// ----- exec: connections are parked for the new image, or move onto TCP ------

/// Before an exec that cannot take connections up (the variadic `execl`
/// family, whose environment and failure we cannot see): every
/// connection moves onto its TCP socket (docs/shim.md, "exec").
pub(super) fn before_exec() {
    quietly(crate::switch::before_exec);
}

/// The environment libc passes when the call names none.
fn environ() -> *const *const c_char {
    // SAFETY: reading the process's `environ` pointer.
    unsafe { real::environ() }
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn execve(
    path: *const c_char,
    argv: *const *const c_char,
    envp: *const *const c_char,
) -> c_int {
    // SAFETY: the program's arguments, passed on to libc's execve.
    unsafe {
        let target = Target::Path(CStr::from_ptr(path));
        exec_park::exec(target, envp, |e| real::execve(path, argv, e))
    }
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn execv(path: *const c_char, argv: *const *const c_char) -> c_int {
    // SAFETY: as execve, with the process's environment (what execv passes).
    unsafe {
        let target = Target::Path(CStr::from_ptr(path));
        exec_park::exec(target, environ(), |e| real::execve(path, argv, e))
    }
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn execvp(file: *const c_char, argv: *const *const c_char) -> c_int {
    // SAFETY: as execvpe, with the process's environment (what execvp passes).
    unsafe {
        let target = Target::Search(CStr::from_ptr(file));
        exec_park::exec(target, environ(), |e| real::execvpe(file, argv, e))
    }
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn execvpe(
    file: *const c_char,
    argv: *const *const c_char,
    envp: *const *const c_char,
) -> c_int {
    // SAFETY: the program's arguments, passed on to libc's execvpe.
    unsafe {
        let target = Target::Search(CStr::from_ptr(file));
        exec_park::exec(target, envp, |e| real::execvpe(file, argv, e))
    }
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn fexecve(
    fd: c_int,
    argv: *const *const c_char,
    envp: *const *const c_char,
) -> c_int {
    // SAFETY: the program's arguments, passed on to libc's fexecve.
    unsafe { exec_park::exec(Target::Fd(fd), envp, |e| real::fexecve(fd, argv, e)) }
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn execveat(
    dirfd: c_int,
    path: *const c_char,
    argv: *const *const c_char,
    envp: *const *const c_char,
    flags: c_int,
) -> c_int {
    // SAFETY: the program's arguments, passed on to libc's execveat.
    unsafe {
        let target = Target::At(dirfd, CStr::from_ptr(path), flags);
        exec_park::exec(target, envp, |e| {
            real::execveat(dirfd, path, argv, e, flags)
        })
    }
}

// ----- user and group changes: connections move onto TCP first ---------------

/// Would setting these ids (real, effective, saved; [`SAME`]: unchanged)
/// change any of the current ones?
fn changes(ids: [libc::uid_t; 3], current: [libc::uid_t; 3]) -> bool {
    ids.iter().zip(current).any(|(&n, c)| n != SAME && n != c)
}

/// The process's real, effective and saved user (or group) ids.
fn current(group: bool) -> [libc::uid_t; 3] {
    let mut v = [0; 3];
    // SAFETY: getresuid/getresgid into our own array.
    unsafe {
        if group {
            libc::getresgid(&mut v[0], &mut v[1], &mut v[2]);
        } else {
            libc::getresuid(&mut v[0], &mut v[1], &mut v[2]);
        }
    }
    v
}

/// Before a change to `ids` (real, effective, saved; -1 for "unchanged")
/// of the user or group ids.
fn before_id_change(group: bool, ids: [libc::uid_t; 3]) {
    quietly(|| {
        if changes(ids, current(group)) {
            crate::switch::before_identity_change();
        }
    });
}

const SAME: libc::uid_t = libc::uid_t::MAX;

#[unsafe(no_mangle)]
pub unsafe extern "C" fn setuid(id: libc::uid_t) -> c_int {
    before_id_change(false, [id, id, id]);
    // SAFETY: libc's function with the program's argument.
    unsafe { real::setuid(id) }
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn setgid(id: libc::gid_t) -> c_int {
    before_id_change(true, [id, id, id]);
    // SAFETY: libc's function with the program's argument.
    unsafe { real::setgid(id) }
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn seteuid(id: libc::uid_t) -> c_int {
    before_id_change(false, [SAME, id, SAME]);
    // SAFETY: libc's function with the program's argument.
    unsafe { real::seteuid(id) }
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn setegid(id: libc::gid_t) -> c_int {
    before_id_change(true, [SAME, id, SAME]);
    // SAFETY: libc's function with the program's argument.
    unsafe { real::setegid(id) }
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn setreuid(r: libc::uid_t, e: libc::uid_t) -> c_int {
    before_id_change(false, [r, e, SAME]);
    // SAFETY: libc's function with the program's arguments.
    unsafe { real::setreuid(r, e) }
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn setregid(r: libc::gid_t, e: libc::gid_t) -> c_int {
    before_id_change(true, [r, e, SAME]);
    // SAFETY: libc's function with the program's arguments.
    unsafe { real::setregid(r, e) }
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn setresuid(r: libc::uid_t, e: libc::uid_t, s: libc::uid_t) -> c_int {
    before_id_change(false, [r, e, s]);
    // SAFETY: libc's function with the program's arguments.
    unsafe { real::setresuid(r, e, s) }
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn setresgid(r: libc::gid_t, e: libc::gid_t, s: libc::gid_t) -> c_int {
    before_id_change(true, [r, e, s]);
    // SAFETY: libc's function with the program's arguments.
    unsafe { real::setresgid(r, e, s) }
}
