//! The program's arrays (pollfds, fd_sets, epoll events), read and written
//! through the kernel.
//!
//! An interposed call must fail as the real one would when the program
//! passes a bad pointer or a short array (EFAULT), never crash the program
//! with SIGSEGV in our code. `process_vm_readv`/`process_vm_writev` on our
//! own process check every page and say EFAULT, as the kernel's own copies
//! do.
//!
//! `unsafe` here: the system calls, over the program's addresses (which
//! they check) and our own buffers.

use libc::{c_int, c_void, iovec};

/// Copy `n` values of `T` from the program's `src`; `Err(EFAULT)` if the
/// kernel cannot read them all.
pub fn read<T: Copy + Default>(src: *const T, n: usize) -> Result<Vec<T>, c_int> {
    let mut v = vec![T::default(); n];
    if n == 0 {
        return Ok(v);
    }
    let len = n * std::mem::size_of::<T>();
    let local = iovec {
        iov_base: v.as_mut_ptr().cast::<c_void>(),
        iov_len: len,
    };
    let remote = iovec {
        iov_base: src.cast_mut().cast::<c_void>(),
        iov_len: len,
    };
    // SAFETY: our own buffer of `len` bytes; the remote range is the
    // program's, which the kernel checks.
    let got = unsafe { libc::process_vm_readv(libc::getpid(), &local, 1, &remote, 1, 0) };
    if got != len as isize {
        return Err(libc::EFAULT);
    }
    Ok(v)
}

/// Copy `v` to the program's `dst`; `Err(EFAULT)` if the kernel cannot
/// write it all.
pub fn write<T: Copy>(dst: *mut T, v: &[T]) -> Result<(), c_int> {
    if v.is_empty() {
        return Ok(());
    }
    let len = std::mem::size_of_val(v);
    let local = iovec {
        iov_base: v.as_ptr().cast_mut().cast::<c_void>(),
        iov_len: len,
    };
    let remote = iovec {
        iov_base: dst.cast::<c_void>(),
        iov_len: len,
    };
    // SAFETY: our own buffer of `len` bytes, only read; the remote range is
    // the program's, which the kernel checks.
    let put = unsafe { libc::process_vm_writev(libc::getpid(), &local, 1, &remote, 1, 0) };
    if put != len as isize {
        return Err(libc::EFAULT);
    }
    Ok(())
}

/// The process's descriptor limit (`RLIMIT_NOFILE`, soft): the kernel's
/// bound on `poll`'s `nfds`.
pub fn fd_limit() -> u64 {
    let mut r = libc::rlimit {
        rlim_cur: 0,
        rlim_max: 0,
    };
    // SAFETY: getrlimit into our own struct.
    unsafe { libc::getrlimit(libc::RLIMIT_NOFILE, &mut r) };
    r.rlim_cur
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn bad_addresses_are_efault_not_a_crash() {
        let src = [1u32, 2, 3];
        assert_eq!(read(src.as_ptr(), 3), Ok(vec![1, 2, 3]));
        assert_eq!(read(8 as *const u32, 3), Err(libc::EFAULT));
        assert_eq!(read(std::ptr::null::<u32>(), 0), Ok(vec![]));
        let mut dst = [0u32; 3];
        assert_eq!(write(dst.as_mut_ptr(), &[7, 8, 9]), Ok(()));
        assert_eq!(dst, [7, 8, 9]);
        assert_eq!(write(8 as *mut u32, &[1]), Err(libc::EFAULT));
        // A read-only page is not writable.
        let ro: &'static [u32] = &[0; 4];
        assert_eq!(write(ro.as_ptr().cast_mut(), &[1]), Err(libc::EFAULT));
    }
}
