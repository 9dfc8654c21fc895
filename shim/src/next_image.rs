//! Will the program an `exec` starts load this library? Only then may a
//! connection be parked for it to take up (docs/shim.md, "exec"); any
//! doubt sends the connection onto its TCP socket instead, which every
//! program can read.
//!
//! The dynamic loader preloads `LD_PRELOAD`'s libraries into a dynamic
//! executable of our kind, unless the exec is secure (set-user-ID or
//! set-group-ID file, file capabilities, differing real and effective
//! ids), when it ignores them. So the new image runs the shim when its
//! environment preloads this very file (same device and inode), does not
//! disable azsdp, and its program (or a script's interpreter) is a dynamic
//! ELF executable of this machine whose interpreter is glibc's loader.
//!
//! `unsafe` here: `dladdr` on our own code, reads of the program's
//! environment array.

use std::ffi::{CStr, CString};
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd};
use std::os::unix::ffi::OsStrExt;

/// What an exec names.
#[derive(Clone, Copy, Debug)]
pub enum Target<'a> {
    /// A path (`execve`, `execv`).
    Path(&'a CStr),
    /// A file searched in `PATH` unless it has a slash (`execvp`,
    /// `execvpe`).
    Search(&'a CStr),
    /// An open descriptor (`fexecve`).
    Fd(libc::c_int),
    /// `execveat(dirfd, path, .., flags)`.
    At(libc::c_int, &'a CStr, libc::c_int),
}

/// The environment entries of a NULL-terminated `envp` array.
///
/// # Safety
/// `envp` is null or a valid NULL-terminated array of C strings that
/// outlive the returned slice.
pub unsafe fn entries<'a>(envp: *const *const libc::c_char) -> Vec<&'a CStr> {
    let mut out = Vec::new();
    if envp.is_null() {
        return out;
    }
    let mut i = 0;
    loop {
        // SAFETY: within the array, up to its NULL (the caller's promise).
        let p = unsafe { *envp.add(i) };
        if p.is_null() {
            return out;
        }
        // SAFETY: a C string of the array.
        out.push(unsafe { CStr::from_ptr(p) });
        i += 1;
    }
}

fn value<'a>(env: &[&'a CStr], name: &str) -> Option<&'a [u8]> {
    env.iter().rev().find_map(|e| {
        let b = e.to_bytes();
        b.strip_prefix(name.as_bytes())
            .and_then(|rest| rest.strip_prefix(b"="))
    })
}

/// Device and inode of a file, following links.
fn identity_of(path: &[u8]) -> Option<(u64, u64)> {
    let c = CString::new(path).ok()?;
    // SAFETY: an all-zero stat is a valid out-buffer.
    let mut st: libc::stat = unsafe { std::mem::zeroed() };
    // SAFETY: stat of a NUL-terminated path into our own struct.
    (unsafe { libc::stat(c.as_ptr(), &mut st) } == 0).then_some((st.st_dev, st.st_ino))
}

/// `fstat` of an open file.
fn fstat(fd: &OwnedFd) -> std::io::Result<libc::stat> {
    // SAFETY: an all-zero stat is a valid out-buffer.
    let mut st: libc::stat = unsafe { std::mem::zeroed() };
    // SAFETY: fstat of a descriptor we hold into our own struct.
    if unsafe { libc::fstat(fd.as_raw_fd(), &mut st) } != 0 {
        return Err(std::io::Error::last_os_error());
    }
    Ok(st)
}

/// This library's own file.
fn own_identity() -> Option<(u64, u64)> {
    let mut info = libc::Dl_info {
        dli_fname: std::ptr::null(),
        dli_fbase: std::ptr::null_mut(),
        dli_sname: std::ptr::null(),
        dli_saddr: std::ptr::null_mut(),
    };
    // SAFETY: dladdr on the address of a function of this library, into
    // our own struct.
    let ok = unsafe { libc::dladdr(own_identity as *const libc::c_void, &mut info) };
    if ok == 0 || info.dli_fname.is_null() {
        return None;
    }
    // SAFETY: the loader's NUL-terminated name of our library.
    identity_of(unsafe { CStr::from_ptr(info.dli_fname) }.to_bytes())
}

/// Why the new image would not run the shim (`Ok`: it would).
pub fn runs_shim(target: Target<'_>, env: &[&CStr]) -> Result<(), String> {
    if value(env, "AZSDP_DISABLE").is_some() {
        return Err("its environment sets AZSDP_DISABLE".into());
    }
    let ours = own_identity().ok_or("this library's file is not found")?;
    let preload = value(env, "LD_PRELOAD").unwrap_or_default();
    let preloaded = preload
        .split(|&b| b == b':' || b == b' ')
        .filter(|p| p.contains(&b'/'))
        .any(|p| identity_of(p) == Some(ours));
    if !preloaded {
        return Err("its environment's LD_PRELOAD does not load this library".into());
    }
    // SAFETY: plain id queries.
    let ids_differ =
        unsafe { libc::getuid() != libc::geteuid() || libc::getgid() != libc::getegid() };
    if ids_differ {
        return Err("real and effective ids differ (a secure exec ignores LD_PRELOAD)".into());
    }
    let file = open_target(target).map_err(|e| format!("its program cannot be opened: {e}"))?;
    check_program(file, 0)
}

fn open_path(path: &[u8]) -> std::io::Result<OwnedFd> {
    let c = CString::new(path).map_err(|_| std::io::Error::from_raw_os_error(libc::EINVAL))?;
    // SAFETY: open of a NUL-terminated path.
    let fd = unsafe { libc::open(c.as_ptr(), libc::O_RDONLY | libc::O_CLOEXEC) };
    if fd < 0 {
        return Err(std::io::Error::last_os_error());
    }
    // SAFETY: a fresh descriptor nothing else owns.
    Ok(unsafe { OwnedFd::from_raw_fd(fd) })
}

/// The file `execvp` would run: `file` itself if it has a slash, else the
/// first executable regular file of that name in `PATH` (glibc searches
/// the caller's own `PATH`, `/bin:/usr/bin` without one).
fn search(file: &[u8]) -> std::io::Result<OwnedFd> {
    if file.contains(&b'/') {
        return open_path(file);
    }
    let path = std::env::var_os("PATH").unwrap_or_else(|| "/bin:/usr/bin".into());
    for dir in path.as_bytes().split(|&b| b == b':') {
        let dir: &[u8] = if dir.is_empty() { b"." } else { dir };
        let mut full = dir.to_vec();
        full.push(b'/');
        full.extend_from_slice(file);
        let Ok(c) = CString::new(full.clone()) else {
            continue;
        };
        // SAFETY: access(2) of a NUL-terminated path.
        if unsafe { libc::access(c.as_ptr(), libc::X_OK) } != 0 {
            continue;
        }
        if let Ok(fd) = open_path(&full)
            && fstat(&fd).is_ok_and(|st| st.st_mode & libc::S_IFMT == libc::S_IFREG)
        {
            return Ok(fd);
        }
    }
    Err(std::io::Error::from_raw_os_error(libc::ENOENT))
}

fn open_target(t: Target<'_>) -> std::io::Result<OwnedFd> {
    match t {
        Target::Path(p) => open_path(p.to_bytes()),
        Target::Search(f) => search(f.to_bytes()),
        Target::Fd(fd) => open_path(format!("/proc/self/fd/{fd}").as_bytes()),
        Target::At(dirfd, p, flags) => {
            if flags & libc::AT_EMPTY_PATH != 0 && p.to_bytes().is_empty() {
                return open_path(format!("/proc/self/fd/{dirfd}").as_bytes());
            }
            // SAFETY: openat of a NUL-terminated path.
            let fd = unsafe { libc::openat(dirfd, p.as_ptr(), libc::O_RDONLY | libc::O_CLOEXEC) };
            if fd < 0 {
                return Err(std::io::Error::last_os_error());
            }
            // SAFETY: a fresh descriptor nothing else owns.
            Ok(unsafe { OwnedFd::from_raw_fd(fd) })
        }
    }
}

fn read_at(fd: &OwnedFd, buf: &mut [u8], off: u64) -> usize {
    let Ok(off) = libc::off_t::try_from(off) else {
        return 0;
    };
    // SAFETY: pread into our own buffer.
    let n = unsafe { libc::pread(fd.as_raw_fd(), buf.as_mut_ptr().cast(), buf.len(), off) };
    usize::try_from(n).unwrap_or(0)
}

const EM_HERE: u16 = if cfg!(target_arch = "x86_64") {
    62
} else if cfg!(target_arch = "aarch64") {
    183
} else {
    0
};

/// Is the opened program one that would load the shim? (`depth`: scripts
/// whose interpreter is a script, as the kernel allows a few.)
fn check_program(file: OwnedFd, depth: u32) -> Result<(), String> {
    let st = fstat(&file).map_err(|e| e.to_string())?;
    if st.st_mode & libc::S_IFMT != libc::S_IFREG {
        return Err("its program is not a regular file".into());
    }
    if st.st_mode & (libc::S_ISUID | libc::S_ISGID) != 0 {
        return Err("its program is set-user-ID or set-group-ID".into());
    }
    // SAFETY: fgetxattr asking only for the size.
    let caps = unsafe {
        libc::fgetxattr(
            file.as_raw_fd(),
            c"security.capability".as_ptr(),
            std::ptr::null_mut(),
            0,
        )
    };
    if caps >= 0 {
        return Err("its program has file capabilities".into());
    }
    let mut head = [0u8; 64];
    let n = read_at(&file, &mut head, 0);
    let head = &head[..n];
    if let Some(line) = head.strip_prefix(b"#!") {
        if depth >= 4 {
            return Err("scripts nested too deep".into());
        }
        let line = line.split(|&b| b == b'\n').next().unwrap_or_default();
        let interp = line
            .split(|&b| b == b' ' || b == b'\t')
            .find(|w| !w.is_empty())
            .ok_or("a script without an interpreter")?;
        let f = open_path(interp).map_err(|e| format!("its script's interpreter: {e}"))?;
        return check_program(f, depth + 1);
    }
    if n < 64 || &head[..4] != b"\x7fELF" {
        return Err("its program is not an ELF executable".into());
    }
    if head[4] != 2 || head[5] != 1 {
        return Err("its program is not a 64-bit little-endian ELF".into());
    }
    let u16_at = |o: usize| u16::from_le_bytes([head[o], head[o + 1]]);
    let u64_at = |o: usize| u64::from_le_bytes(head[o..o + 8].try_into().unwrap_or_default());
    if u16_at(18) != EM_HERE {
        return Err("its program is for another machine".into());
    }
    let (phoff, phentsize, phnum) = (u64_at(32), u64::from(u16_at(54)), u64::from(u16_at(56)));
    if phentsize < 56 || phnum > 256 {
        return Err("its program's headers are not understood".into());
    }
    for i in 0..phnum {
        let mut ph = [0u8; 56];
        if read_at(&file, &mut ph, phoff + i * phentsize) < 56 {
            break;
        }
        const PT_INTERP: u32 = 3;
        if u32::from_le_bytes([ph[0], ph[1], ph[2], ph[3]]) != PT_INTERP {
            continue;
        }
        let off = u64::from_le_bytes(ph[8..16].try_into().unwrap_or_default());
        let len = u64::from_le_bytes(ph[32..40].try_into().unwrap_or_default()).min(255) as usize;
        let mut interp = vec![0u8; len];
        let got = read_at(&file, &mut interp, off);
        interp.truncate(got);
        let name = interp.split(|&b| b == 0).next().unwrap_or_default();
        let base = name.rsplit(|&b| b == b'/').next().unwrap_or_default();
        return if base.starts_with(b"ld-linux") {
            Ok(())
        } else {
            Err(format!(
                "its program's loader is {}",
                String::from_utf8_lossy(name)
            ))
        };
    }
    Err("its program is statically linked".into())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn env(v: &[&'static CStr]) -> Vec<&'static CStr> {
        v.to_vec()
    }

    #[test]
    fn a_program_without_this_library_preloaded_does_not_run_it() {
        let e = env(&[c"PATH=/usr/bin"]);
        assert!(runs_shim(Target::Path(c"/bin/sh"), &e).is_err());
        let e = env(&[c"AZSDP_DISABLE=1", c"LD_PRELOAD=/nonexistent.so"]);
        let why = runs_shim(Target::Path(c"/bin/sh"), &e).unwrap_err();
        assert!(why.contains("AZSDP_DISABLE"), "{why}");
    }

    #[test]
    fn dynamic_static_and_script_programs_are_told_apart() {
        let sh = open_path(b"/bin/sh").unwrap();
        assert_eq!(check_program(sh, 0), Ok(()));
        let dir = std::env::temp_dir().join(format!("azsdp-next-image-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let script = dir.join("s");
        std::fs::write(&script, b"#!/bin/sh\necho\n").unwrap();
        let f = open_path(script.as_os_str().as_bytes()).unwrap();
        assert_eq!(check_program(f, 0), Ok(()));
        let bad = dir.join("b");
        std::fs::write(&bad, b"#!/nonexistent/interp\n").unwrap();
        let f = open_path(bad.as_os_str().as_bytes()).unwrap();
        assert!(check_program(f, 0).is_err());
        let text = dir.join("t");
        std::fs::write(
            &text,
            b"just text, no ELF header at all, long enough to be read whole...",
        )
        .unwrap();
        let f = open_path(text.as_os_str().as_bytes()).unwrap();
        assert!(check_program(f, 0).unwrap_err().contains("not an ELF"));
        let _ = std::fs::remove_dir_all(&dir);
    }
}
