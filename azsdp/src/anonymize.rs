//! Pages of a private file mapping turned into anonymous memory, so that a
//! send from them can be zero-copy.
//!
//! A `MAP_PRIVATE` mapping of a file never writes back to the file, and by
//! POSIX it is unspecified whether it sees changes made to the file after
//! it was mapped. So its pages may be replaced by anonymous pages holding
//! the same bytes: copied once into a fresh anonymous mapping, which
//! `mremap` then moves over them in one step. From then on they are private
//! anonymous memory, which the driver may write-protect, and the next send
//! from the same buffer finds them so at once (iperf3 sends every byte from
//! one buffer, a `MAP_PRIVATE` mapping of a temporary file).
//!
//! Only the whole pages of the buffer being sent are converted (the pages
//! the driver would protect); the rest of the mapping stays as it was. The
//! copy is made by the kernel (`process_vm_readv` of our own memory), so a
//! page past the end of the file fails the conversion instead of raising
//! SIGBUS. A write by another thread to those pages while they are copied
//! would be lost; a thread that writes a buffer a `send()` is reading races
//! with the send already, and on TCP too what is sent is then undefined.
//!
//! `unsafe` here: mmap, mremap and munmap by system call (libc's are the
//! shim's hooks, which must not see our own mappings come and go).

use std::io::IoSliceMut;
use std::ops::Range;

use nix::sys::uio::{RemoteIoVec, process_vm_readv};

use crate::memory_map::{self, Kind};

/// Turn the whole pages `pages` into private anonymous memory with the same
/// bytes, if they all belong to writable private file mappings. Whether
/// they are anonymous now.
pub fn anonymize(pages: &Range<u64>) -> bool {
    if pages.is_empty() || !convertible(pages) {
        return false;
    }
    let len = (pages.end - pages.start) as usize;
    // SAFETY: a fresh anonymous mapping the kernel places; no memory of
    // ours is touched.
    let tmp = unsafe {
        libc::syscall(
            libc::SYS_mmap,
            0usize,
            len,
            libc::PROT_READ | libc::PROT_WRITE,
            libc::MAP_PRIVATE | libc::MAP_ANONYMOUS,
            -1i32,
            0usize,
        )
    };
    if tmp < 0 {
        return false;
    }
    let tmp = tmp as usize;
    // SAFETY: `tmp` is the start of the `len`-byte mapping just made,
    // which nothing else knows of.
    let dst = unsafe { std::slice::from_raw_parts_mut(tmp as *mut u8, len) };
    let src = [RemoteIoVec {
        base: pages.start as usize,
        len,
    }];
    let me = nix::unistd::Pid::from_raw(crate::process::pid() as i32);
    let copied = process_vm_readv(me, &mut [IoSliceMut::new(dst)], &src);
    let moved = copied == Ok(len) && {
        // SAFETY: moves our own anonymous mapping over `pages`, which the
        // checks above found to be private file mappings of this process;
        // the pages hold the same bytes before and after.
        let r = unsafe {
            libc::syscall(
                libc::SYS_mremap,
                tmp,
                len,
                len,
                libc::MREMAP_MAYMOVE | libc::MREMAP_FIXED,
                pages.start as usize,
            )
        };
        r == pages.start as i64
    };
    if !moved {
        // SAFETY: the mapping made above, still where it was.
        unsafe { libc::syscall(libc::SYS_munmap, tmp, len) };
    }
    memory_map::invalidate();
    moved
}

/// Do writable private file mappings, and nothing else, cover `pages`?
fn convertible(pages: &Range<u64>) -> bool {
    let mut at = pages.start;
    while at < pages.end {
        let Some(v) = memory_map::mapping_of(at) else {
            return false;
        };
        let private_file = v.kind == Kind::File && !v.shared;
        if !private_file || !v.readable || !v.writable || v.executable || v.range.start > at {
            return false;
        }
        at = v.range.end;
    }
    true
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::os::fd::AsRawFd;

    fn page() -> u64 {
        crate::pages::system_page_size()
    }

    #[test]
    fn a_private_file_mapping_becomes_anonymous_with_the_same_bytes() {
        let p = page() as usize;
        let bytes: Vec<u8> = (0..4 * p).map(|i| (i % 251) as u8).collect();
        let f = crate::test_files::unlinked_tempfile("anonymize", &bytes);
        // SAFETY: a fresh private mapping of the file, unmapped below.
        let base = unsafe {
            libc::mmap(
                std::ptr::null_mut(),
                4 * p,
                libc::PROT_READ | libc::PROT_WRITE,
                libc::MAP_PRIVATE,
                f.as_raw_fd(),
                0,
            )
        };
        assert_ne!(base, libc::MAP_FAILED);
        let base = base as u64;
        // A write before: kept (a private copy already).
        // SAFETY: inside the mapping.
        unsafe { *((base + 10) as *mut u8) = 0xee };
        let pages = base + page()..base + 3 * page();
        memory_map::invalidate();
        assert_eq!(
            memory_map::check(&pages),
            Err(memory_map::NotProtectable::File)
        );
        assert!(anonymize(&pages));
        assert_eq!(
            memory_map::check(&pages),
            Ok(memory_map::Protectable::Private),
            "the middle pages are anonymous now"
        );
        // SAFETY: reading the whole mapping, which is still mapped.
        let now = unsafe { std::slice::from_raw_parts(base as *const u8, 4 * p) };
        for (i, b) in now.iter().enumerate() {
            let want = if i == 10 { 0xee } else { (i % 251) as u8 };
            assert_eq!(*b, want, "byte {i}");
        }
        // Converted pages no longer see the file change; the pages left
        // alone (untouched, so still the file's) do.
        use std::os::unix::fs::FileExt;
        f.write_all_at(&[0x55], page() + 2).unwrap();
        f.write_all_at(&[0x66], 3 * page() + 2).unwrap();
        // SAFETY: reading inside the mapping.
        let (converted, left) = unsafe {
            (
                *((base + page() + 2) as *const u8),
                *((base + 3 * page() + 2) as *const u8),
            )
        };
        assert_eq!(converted, ((p + 2) % 251) as u8);
        assert_eq!(left, 0x66);
        // SAFETY: the mapping made above.
        unsafe { libc::munmap(base as *mut libc::c_void, 4 * p) };
    }

    #[test]
    fn anonymous_shared_and_read_only_memory_are_left_alone() {
        let p = page() as usize;
        let f = crate::test_files::unlinked_tempfile("anonymize", &vec![7; 2 * p]);
        for (prot, flags, fd) in [
            (libc::PROT_READ, libc::MAP_PRIVATE, f.as_raw_fd()),
            (
                libc::PROT_READ | libc::PROT_WRITE,
                libc::MAP_SHARED,
                f.as_raw_fd(),
            ),
            (
                libc::PROT_READ | libc::PROT_WRITE,
                libc::MAP_PRIVATE | libc::MAP_ANONYMOUS,
                -1,
            ),
        ] {
            // SAFETY: a fresh mapping, unmapped below.
            let base = unsafe { libc::mmap(std::ptr::null_mut(), 2 * p, prot, flags, fd, 0) };
            assert_ne!(base, libc::MAP_FAILED);
            let base = base as u64;
            memory_map::invalidate();
            assert!(!anonymize(&(base..base + 2 * page())), "{prot} {flags}");
            // SAFETY: the mapping made above.
            unsafe { libc::munmap(base as *mut libc::c_void, 2 * p) };
        }
    }
}
