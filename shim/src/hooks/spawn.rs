//! Programs started without `exec` passing through us: `posix_spawn`,
//! `posix_spawnp`, `system` and `popen` exec inside libc, through its
//! internal `execve`. The new program inherits the descriptors that do not
//! close on exec, and those the spawn's file actions `dup2` (the file
//! actions are opaque, so the `adddup2` calls are remembered per object).
//! Connections on those move onto their TCP socket first, as before an
//! `exec`; the spawning process keeps the rest.

use libc::{c_char, c_int, pid_t, posix_spawn_file_actions_t, posix_spawnattr_t};

use super::{hook, quietly};
use crate::real;
use azsdp::sync::Lock;

/// Descriptors each live file-actions object `dup2`s, by its address.
static DUP_SOURCES: Lock<Vec<(usize, Vec<c_int>)>> = Lock::new(Vec::new());

fn forget(fa: *const posix_spawn_file_actions_t) {
    DUP_SOURCES.lock().retain(|(a, _)| *a != fa as usize);
}

fn sources(fa: *const posix_spawn_file_actions_t) -> Vec<c_int> {
    if fa.is_null() {
        return Vec::new();
    }
    DUP_SOURCES
        .lock()
        .iter()
        .find(|(a, _)| *a == fa as usize)
        .map(|(_, v)| v.clone())
        .unwrap_or_default()
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn posix_spawn_file_actions_init(
    fa: *mut posix_spawn_file_actions_t,
) -> c_int {
    quietly(|| forget(fa));
    // SAFETY: libc's function with the program's argument.
    unsafe { real::posix_spawn_file_actions_init(fa) }
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn posix_spawn_file_actions_destroy(
    fa: *mut posix_spawn_file_actions_t,
) -> c_int {
    quietly(|| forget(fa));
    // SAFETY: libc's function with the program's argument.
    unsafe { real::posix_spawn_file_actions_destroy(fa) }
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn posix_spawn_file_actions_adddup2(
    fa: *mut posix_spawn_file_actions_t,
    fd: c_int,
    newfd: c_int,
) -> c_int {
    // SAFETY: libc's function with the program's arguments.
    let r = unsafe { real::posix_spawn_file_actions_adddup2(fa, fd, newfd) };
    if r == 0 {
        quietly(|| {
            let mut all = DUP_SOURCES.lock();
            match all.iter_mut().find(|(a, _)| *a == fa as usize) {
                Some((_, v)) => v.push(fd),
                None => all.push((fa as usize, vec![fd])),
            }
        });
    }
    r
}

fn before_spawn(fa: *const posix_spawn_file_actions_t) {
    quietly(|| crate::switch::before_spawn(&sources(fa)));
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn posix_spawn(
    pid: *mut pid_t,
    path: *const c_char,
    fa: *const posix_spawn_file_actions_t,
    attr: *const posix_spawnattr_t,
    argv: *const *mut c_char,
    envp: *const *mut c_char,
) -> c_int {
    before_spawn(fa);
    // SAFETY: libc's posix_spawn with the program's arguments.
    unsafe { real::posix_spawn(pid, path, fa, attr, argv, envp) }
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn posix_spawnp(
    pid: *mut pid_t,
    file: *const c_char,
    fa: *const posix_spawn_file_actions_t,
    attr: *const posix_spawnattr_t,
    argv: *const *mut c_char,
    envp: *const *mut c_char,
) -> c_int {
    before_spawn(fa);
    // SAFETY: libc's posix_spawnp with the program's arguments.
    unsafe { real::posix_spawnp(pid, file, fa, attr, argv, envp) }
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn system(cmd: *const c_char) -> c_int {
    hook(|| {
        if !cmd.is_null() {
            before_spawn(std::ptr::null());
        }
        // SAFETY: libc's system with the program's argument.
        unsafe { real::system(cmd) }
    })
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn popen(cmd: *const c_char, mode: *const c_char) -> *mut libc::FILE {
    before_spawn(std::ptr::null());
    // SAFETY: libc's popen with the program's arguments.
    unsafe { real::popen(cmd, mode) }
}
