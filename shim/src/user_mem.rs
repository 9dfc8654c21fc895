//! The program's memory as the kernel would treat it.
//!
//! An interposed call must fail as the real one would when the program
//! passes a bad pointer or a short array (EFAULT), never crash the program
//! with SIGSEGV in our code. Every range of the program's memory we touch
//! (data buffers, and small arrays: pollfds, fd_sets, epoll events,
//! iovecs, msghdrs) is first checked against the kernel's view of the
//! mappings ([`check_buffer`]), which a thread caches until the program
//! maps, unmaps or reprotects memory. An event loop's `epoll_ctl` and
//! `epoll_wait` then cost no system call of ours; going through the
//! kernel (`process_vm_readv`, and `getpid` for it) cost two per call.
//!
//! `unsafe` here: the copies from and to the program's addresses, which
//! [`check_buffer`] vouched for.

use libc::c_int;

/// C data for which every bit pattern is a valid value, so it may be
/// filled with whatever bytes the program's memory holds.
///
/// # Safety
/// Implement only for such types (integers and structs of them).
pub unsafe trait Plain: Copy {}

// SAFETY: integers and C structs of integers and pointers.
unsafe impl Plain for u8 {}
// SAFETY: as above.
unsafe impl Plain for u32 {}
// SAFETY: as above.
unsafe impl Plain for u64 {}
// SAFETY: as above.
unsafe impl Plain for i32 {}
// SAFETY: as above.
unsafe impl Plain for i64 {}
// SAFETY: as above.
unsafe impl Plain for libc::pollfd {}
// SAFETY: as above.
unsafe impl Plain for libc::iovec {}
// SAFETY: as above.
unsafe impl Plain for libc::msghdr {}
// SAFETY: as above.
unsafe impl Plain for libc::mmsghdr {}
// SAFETY: as above.
unsafe impl Plain for libc::epoll_event {}
// SAFETY: as above.
unsafe impl Plain for libc::timespec {}
// SAFETY: as above.
unsafe impl Plain for libc::timeval {}

/// Copy `n` values of `T` from the program's `src`; `Err(EFAULT)` where
/// the kernel's copy would fault.
pub fn read<T: Plain>(src: *const T, n: usize) -> Result<Vec<T>, c_int> {
    let len = n
        .checked_mul(std::mem::size_of::<T>())
        .ok_or(libc::EFAULT)?;
    check_buffer(src.cast::<u8>(), len, false)?;
    let mut v: Vec<T> = Vec::with_capacity(n);
    // SAFETY: the program's `len` bytes are mapped readable (checked just
    // now), our buffer has room for them, and byte copies need no
    // alignment; any bytes are a valid `T` (`Plain`).
    unsafe {
        std::ptr::copy_nonoverlapping(src.cast::<u8>(), v.as_mut_ptr().cast::<u8>(), len);
        v.set_len(n);
    }
    Ok(v)
}

/// Copy `v` to the program's `dst`; `Err(EFAULT)` where the kernel's copy
/// would fault.
pub fn write<T: Plain>(dst: *mut T, v: &[T]) -> Result<(), c_int> {
    let len = std::mem::size_of_val(v);
    check_buffer(dst.cast_const().cast::<u8>(), len, true)?;
    // SAFETY: the program's `len` bytes are mapped writable (checked just
    // now), and byte copies need no alignment.
    unsafe { std::ptr::copy_nonoverlapping(v.as_ptr().cast::<u8>(), dst.cast::<u8>(), len) };
    Ok(())
}

/// Mappings a thread's checked buffers were in lately: (start, end,
/// checked for writing, memory-map generation). Sixty-four: one request of
/// an event loop touches a stack, a heap, static data and more, and a
/// program may give each connection buffers of their own mapping (malloc
/// maps every block of 128 KiB or more by itself): memaslap's 16
/// connections a thread touched more than eight, and every call missed.
/// A scan of all of them costs less than one `PROCMAP_QUERY`.
type Known = [(u64, u64, bool, u64); KNOWN_MAPPINGS];
const KNOWN_MAPPINGS: usize = 64;

thread_local! {
    /// The mappings, and where the next one goes (round robin). A
    /// `RefCell`, not a copy out of a `Cell`: the array is 2 KiB.
    static KNOWN: std::cell::RefCell<(Known, usize)> =
        const { std::cell::RefCell::new(([(0, 0, false, u64::MAX); KNOWN_MAPPINGS], 0)) };
}

/// May a call read (or, with `write`, write) the program's `len` bytes at
/// `p`? `Err(EFAULT)` where the kernel's copy would fault. A buffer inside
/// a mapping that held one of the last few checked by this thread, with
/// no interposed `mmap`/`munmap`/`mremap`/`madvise`/`mprotect` since, passes without
/// a system call; otherwise the kernel is asked (`PROCMAP_QUERY`).
/// (Memory that libc unmaps internally, as `free()` does with large
/// blocks, is not seen: a program that sends from freed memory may still
/// fault, as it would when it touched it.)
pub fn check_buffer(p: *const u8, len: usize, write: bool) -> Result<(), c_int> {
    if len == 0 {
        return Ok(());
    }
    let start = p as u64;
    let end = start.checked_add(len as u64).ok_or(libc::EFAULT)?;
    if p.is_null() {
        return Err(libc::EFAULT);
    }
    let generation = azsdp::memory_map::generation();
    // (A signal handler's call in the middle of ours finds the cache
    // borrowed: it asks the kernel, and caches nothing.) A mapping seen
    // before the last changes still holds if none of them touched it: it
    // counts as seen now.
    let hit = KNOWN
        .try_with(|k| {
            k.try_borrow_mut().is_ok_and(|mut k| {
                let covers = |&(lo, hi, w, _): &(u64, u64, bool, u64)| {
                    lo <= start && end <= hi && (w || !write)
                };
                if k.0.iter().any(|e| covers(e) && e.3 == generation) {
                    return true;
                }
                let Some(e) = k.0.iter_mut().filter(|e| covers(e)).max_by_key(|e| e.3) else {
                    return false;
                };
                let held = azsdp::memory_map::untouched_since(&(e.0..e.1), e.3);
                if held {
                    e.3 = generation;
                }
                held
            })
        })
        .unwrap_or(false);
    if hit {
        return Ok(());
    }
    let r = azsdp::memory_map::accessible(&(start..end), write).ok_or(libc::EFAULT)?;
    let _ = KNOWN.try_with(|k| {
        if let Ok(mut k) = k.try_borrow_mut() {
            let next = k.1;
            k.0[next] = (r.start, r.end, write, generation);
            k.1 = (next + 1) % KNOWN_MAPPINGS;
        }
    });
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

    #[test]
    fn buffers_are_checked_against_the_kernels_mappings() {
        let heap = vec![0u8; 100_000];
        assert_eq!(check_buffer(heap.as_ptr(), heap.len(), true), Ok(()));
        // Again, from the thread's cache.
        assert_eq!(check_buffer(heap.as_ptr(), 10, false), Ok(()));
        assert_eq!(check_buffer(std::ptr::null(), 1, false), Err(libc::EFAULT));
        assert_eq!(check_buffer(std::ptr::null(), 0, true), Ok(()));
        assert_eq!(
            check_buffer(usize::MAX as *const u8, 2, false),
            Err(libc::EFAULT)
        );
        let ro: &'static [u8] = b"read-only data";
        assert_eq!(check_buffer(ro.as_ptr(), ro.len(), false), Ok(()));
        assert_eq!(check_buffer(ro.as_ptr(), ro.len(), true), Err(libc::EFAULT));
        // Two pages, the second unmapped (through the interposable munmap,
        // as a program's would be).
        // SAFETY: mmap/munmap of our own pages.
        let p = unsafe {
            let p = libc::mmap(
                std::ptr::null_mut(),
                8192,
                libc::PROT_READ | libc::PROT_WRITE,
                libc::MAP_PRIVATE | libc::MAP_ANONYMOUS,
                -1,
                0,
            );
            assert_ne!(p, libc::MAP_FAILED);
            p.cast::<u8>()
        };
        assert_eq!(check_buffer(p, 8192, true), Ok(()));
        // SAFETY: our own second page.
        unsafe { libc::munmap(p.add(4096).cast(), 4096) };
        azsdp::memory_map::invalidate();
        assert_eq!(check_buffer(p, 4096, true), Ok(()));
        assert_eq!(check_buffer(p, 4097, true), Err(libc::EFAULT));
        // SAFETY: our own first page.
        unsafe { libc::munmap(p.cast(), 4096) };
    }

    /// The thread's cache of checked mappings must not outlive a change of
    /// protection: the program's `mprotect` (the interposed one, as a
    /// program's own call would be) makes a cached writable page EFAULT,
    /// not a crash in our copy.
    #[test]
    fn a_reprotected_page_is_efault_even_after_it_was_cached() {
        // SAFETY: mmap/mprotect/munmap of our own page.
        let p = unsafe {
            let p = libc::mmap(
                std::ptr::null_mut(),
                4096,
                libc::PROT_READ | libc::PROT_WRITE,
                libc::MAP_PRIVATE | libc::MAP_ANONYMOUS,
                -1,
                0,
            );
            assert_ne!(p, libc::MAP_FAILED);
            p.cast::<u32>()
        };
        assert_eq!(write(p, &[5, 6]), Ok(()));
        assert_eq!(read(p.cast_const(), 2), Ok(vec![5, 6]));
        // SAFETY: our own page.
        let r = unsafe { libc::mprotect(p.cast(), 4096, libc::PROT_READ) };
        assert_eq!(r, 0);
        assert_eq!(write(p, &[7]), Err(libc::EFAULT));
        assert_eq!(read(p.cast_const(), 2), Ok(vec![5, 6]));
        // SAFETY: our own page.
        let r = unsafe { libc::mprotect(p.cast(), 4096, libc::PROT_NONE) };
        assert_eq!(r, 0);
        assert_eq!(read(p.cast_const(), 1), Err(libc::EFAULT));
        // SAFETY: our own page.
        unsafe { libc::munmap(p.cast(), 4096) };
    }
}
