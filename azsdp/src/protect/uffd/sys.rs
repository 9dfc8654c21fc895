//! The kernel's userfaultfd interface, from the pre-generated bindings of
//! `linux-raw-sys` (no bindgen, so nothing but the Rust toolchain is
//! needed to build).
//!
//! The ABI is stable: the structures and most ioctl numbers come from
//! `linux-raw-sys`; the two ioctls it does not list (`UFFDIO_MOVE`,
//! `UFFDIO_POISON`) are encoded from its request numbers and structure
//! sizes as `_IOWR` does, and a test checks that encoding against the
//! numbers it does list. Mode bits that the kernel header defines with a
//! cast (which bindgen skips) are spelled out here.
//!
//! `unsafe` here: the syscall and ioctls, each with the structure the
//! kernel expects, and the ones that change what our own address space
//! maps (zero pages, moves, poison), which are `unsafe fn`s.

use std::io;
use std::mem::size_of;
use std::ops::Range;
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd, RawFd};

use linux_raw_sys::general as uapi;
use linux_raw_sys::ioctl as req;

pub use uapi::{
    UFFD_FEATURE_MOVE as FEATURE_MOVE, UFFD_FEATURE_PAGEFAULT_FLAG_WP as FEATURE_WP,
    UFFD_FEATURE_POISON as FEATURE_POISON, UFFD_FEATURE_WP_HUGETLBFS_SHMEM as FEATURE_WP_SHMEM,
    UFFD_FEATURE_WP_UNPOPULATED as FEATURE_WP_UNPOPULATED,
    UFFDIO_REGISTER_MODE_MISSING as REGISTER_MISSING, UFFDIO_REGISTER_MODE_WP as REGISTER_WP,
};

/// `UFFDIO_WRITEPROTECT_MODE_WP`.
const WRITEPROTECT_MODE_WP: u64 = 1 << 0;
/// `UFFDIO_WRITEPROTECT_MODE_DONTWAKE`.
const WRITEPROTECT_MODE_DONTWAKE: u64 = 1 << 1;
/// `UFFDIO_MOVE_MODE_DONTWAKE`.
pub const MOVE_DONTWAKE: u64 = 1 << 0;
/// `UFFDIO_MOVE_MODE_ALLOW_SRC_HOLES`.
pub const MOVE_ALLOW_SRC_HOLES: u64 = 1 << 1;

/// `_IOWR(type, nr, size)` in the encoding most architectures share
/// (direction bits 30-31, size 16-29, type 8-15, number 0-7).
#[cfg(not(any(
    target_arch = "powerpc",
    target_arch = "powerpc64",
    target_arch = "mips",
    target_arch = "mips64",
    target_arch = "sparc64"
)))]
const fn iowr(ty: u32, nr: u32, size: usize) -> u32 {
    (3 << 30) | ((size as u32) << 16) | (ty << 8) | nr
}

/// `_IO(type, nr)` (no direction, no size).
const fn io(ty: u32, nr: u32) -> u32 {
    (ty << 8) | nr
}

const UFFDIO_MOVE: u32 = iowr(
    uapi::UFFDIO,
    uapi::_UFFDIO_MOVE,
    size_of::<uapi::uffdio_move>(),
);
const UFFDIO_POISON: u32 = iowr(
    uapi::UFFDIO,
    uapi::_UFFDIO_POISON,
    size_of::<uapi::uffdio_poison>(),
);
/// `/dev/userfaultfd`'s ioctl that makes a userfaultfd.
const USERFAULTFD_IOC_NEW: u32 = io(uapi::USERFAULTFD_IOC, 0);

/// A page fault, as the fault thread reads it.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct PageFault {
    pub addr: u64,
    pub write: bool,
    /// On a write-protected page (not a missing one).
    pub wp: bool,
}

/// A userfaultfd that also catches faults taken inside the kernel (not
/// `UFFD_USER_MODE_ONLY`), non-blocking and close-on-exec.
#[derive(Debug)]
pub struct Userfaultfd {
    fd: OwnedFd,
}

fn range(r: &Range<u64>) -> uapi::uffdio_range {
    uapi::uffdio_range {
        start: r.start,
        len: r.end - r.start,
    }
}

/// `ioctl(fd, request, arg)`, its failure as the OS error.
///
/// # Safety
/// `arg` must be the structure `request` reads and writes.
unsafe fn ioctl<T>(fd: RawFd, request: u32, arg: &mut T) -> io::Result<()> {
    // SAFETY: the caller passes the structure the request expects.
    if unsafe {
        crate::own_ioctl::ioctl(fd, libc::c_ulong::from(request), (arg as *mut T) as usize)
    } == 0
    {
        Ok(())
    } else {
        Err(io::Error::last_os_error())
    }
}

impl Userfaultfd {
    /// A new userfaultfd with exactly `features` (the kernel refuses a
    /// feature it lacks: EINVAL). From the syscall, else (where it is
    /// refused to unprivileged users) from `/dev/userfaultfd`.
    pub fn open(features: u32) -> io::Result<Userfaultfd> {
        let flags = libc::O_CLOEXEC | libc::O_NONBLOCK;
        // SAFETY: userfaultfd(2) takes only flags and returns a new fd.
        let fd = unsafe { libc::syscall(libc::SYS_userfaultfd, flags) } as RawFd;
        let fd = if fd >= 0 {
            fd
        } else {
            let refused = io::Error::last_os_error();
            let dev = std::fs::OpenOptions::new()
                .read(true)
                .write(true)
                .open("/dev/userfaultfd")
                .map_err(|_| refused)?;
            // SAFETY: USERFAULTFD_IOC_NEW takes the flags by value and
            // returns a new fd.
            let fd = unsafe {
                crate::own_ioctl::ioctl(
                    dev.as_raw_fd(),
                    USERFAULTFD_IOC_NEW as libc::c_ulong,
                    flags as usize,
                )
            };
            if fd < 0 {
                return Err(io::Error::last_os_error());
            }
            fd
        };
        // SAFETY: a new descriptor that nothing else owns.
        let fd = unsafe { OwnedFd::from_raw_fd(fd) };
        let u = Userfaultfd { fd };
        let mut api = uapi::uffdio_api {
            api: u64::from(uapi::UFFD_API),
            features: u64::from(features),
            ioctls: 0,
        };
        // SAFETY: UFFDIO_API with its structure.
        unsafe { ioctl(u.fd.as_raw_fd(), req::UFFDIO_API, &mut api) }?;
        Ok(u)
    }

    pub fn as_raw_fd(&self) -> RawFd {
        self.fd.as_raw_fd()
    }

    /// Register `r` with `mode` (`REGISTER_WP`, `REGISTER_MISSING`, both).
    pub fn register(&self, r: &Range<u64>, mode: u32) -> io::Result<()> {
        let mut a = uapi::uffdio_register {
            range: range(r),
            mode: u64::from(mode),
            ioctls: 0,
        };
        // SAFETY: UFFDIO_REGISTER with its structure.
        unsafe { ioctl(self.as_raw_fd(), req::UFFDIO_REGISTER, &mut a) }
    }

    pub fn unregister(&self, r: &Range<u64>) -> io::Result<()> {
        let mut a = range(r);
        // SAFETY: UFFDIO_UNREGISTER with its structure.
        unsafe { ioctl(self.as_raw_fd(), req::UFFDIO_UNREGISTER, &mut a) }
    }

    /// Write-protect `r` (registered in write-protect mode).
    pub fn write_protect(&self, r: &Range<u64>) -> io::Result<()> {
        self.writeprotect(r, WRITEPROTECT_MODE_WP)
    }

    /// Lift the write protection of `r`, waking its waiters if `wake`.
    pub fn remove_write_protection(&self, r: &Range<u64>, wake: bool) -> io::Result<()> {
        self.writeprotect(r, if wake { 0 } else { WRITEPROTECT_MODE_DONTWAKE })
    }

    fn writeprotect(&self, r: &Range<u64>, mode: u64) -> io::Result<()> {
        let mut a = uapi::uffdio_writeprotect {
            range: range(r),
            mode,
        };
        // SAFETY: UFFDIO_WRITEPROTECT with its structure; it changes only
        // page permissions, not contents.
        unsafe { ioctl(self.as_raw_fd(), req::UFFDIO_WRITEPROTECT, &mut a) }
    }

    /// Wake the threads waiting on faults in `r`.
    pub fn wake(&self, r: &Range<u64>) -> io::Result<()> {
        let mut a = range(r);
        // SAFETY: UFFDIO_WAKE with its structure.
        unsafe { ioctl(self.as_raw_fd(), req::UFFDIO_WAKE, &mut a) }
    }

    /// Map the zero page into the holes of `r` and wake its waiters.
    ///
    /// # Safety
    /// `r` must be registered memory of ours whose holes may read as zeros.
    pub unsafe fn zeropage(&self, r: &Range<u64>) -> io::Result<()> {
        let mut a = uapi::uffdio_zeropage {
            range: range(r),
            mode: 0,
            zeropage: 0,
        };
        // SAFETY: UFFDIO_ZEROPAGE with its structure; the caller vouches
        // for the range.
        unsafe { ioctl(self.as_raw_fd(), req::UFFDIO_ZEROPAGE, &mut a) }
    }

    /// `UFFDIO_MOVE` of up to `len` bytes from `src` to `dst`: how many
    /// bytes moved (the kernel may move fewer, and says EAGAIN).
    ///
    /// # Safety
    /// Both ranges must be private anonymous memory of ours, `dst`
    /// registered, and nobody may rely on what `src` holds afterwards.
    pub unsafe fn move_pages(
        &self,
        dst: u64,
        src: u64,
        len: u64,
        mode: u64,
    ) -> (u64, io::Result<()>) {
        let mut m = uapi::uffdio_move {
            dst,
            src,
            len,
            mode,
            move_: 0,
        };
        // SAFETY: UFFDIO_MOVE with its structure; the caller vouches for
        // the ranges.
        let r = unsafe { ioctl(self.as_raw_fd(), UFFDIO_MOVE, &mut m) };
        (m.move_.max(0) as u64, r)
    }

    /// Fill the holes of `r` with poison: a later access gets SIGBUS.
    ///
    /// # Safety
    /// `r` must be registered memory of ours whose holes must not be read.
    pub unsafe fn poison(&self, r: &Range<u64>) -> io::Result<()> {
        let mut p = uapi::uffdio_poison {
            range: range(r),
            mode: 0,
            updated: 0,
        };
        // SAFETY: UFFDIO_POISON with its structure; the caller vouches for
        // the range.
        unsafe { ioctl(self.as_raw_fd(), UFFDIO_POISON, &mut p) }
    }

    /// The next page fault, if one is waiting (other events, which we
    /// never ask for, are skipped).
    pub fn read_fault(&self) -> Option<PageFault> {
        let mut msg = std::mem::MaybeUninit::<uapi::uffd_msg>::uninit();
        let want = size_of::<uapi::uffd_msg>();
        // SAFETY: read(2) of at most one message into our own buffer.
        let n = unsafe { libc::read(self.as_raw_fd(), msg.as_mut_ptr().cast(), want) };
        if n != want as isize {
            return None;
        }
        // SAFETY: the kernel wrote a whole message.
        let msg = unsafe { msg.assume_init() };
        if u32::from(msg.event) != uapi::UFFD_EVENT_PAGEFAULT {
            return None;
        }
        // SAFETY: a page-fault message holds the `pagefault` variant; the
        // fields are copied out of the packed structure by value.
        let pf = unsafe { msg.arg.pagefault };
        let (flags, addr) = (pf.flags, pf.address);
        Some(PageFault {
            addr,
            write: flags & u64::from(uapi::UFFD_PAGEFAULT_FLAG_WRITE) != 0,
            wp: flags & u64::from(uapi::UFFD_PAGEFAULT_FLAG_WP) != 0,
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Our `_IOWR` gives the numbers linux-raw-sys lists, so it gives the
    /// right ones for the two it does not.
    #[test]
    fn ioctl_encoding_matches_the_pregenerated_numbers() {
        let api = iowr(
            uapi::UFFDIO,
            uapi::_UFFDIO_API,
            size_of::<uapi::uffdio_api>(),
        );
        assert_eq!(api, req::UFFDIO_API);
        let wp = iowr(
            uapi::UFFDIO,
            uapi::_UFFDIO_WRITEPROTECT,
            size_of::<uapi::uffdio_writeprotect>(),
        );
        assert_eq!(wp, req::UFFDIO_WRITEPROTECT);
        let copy = iowr(
            uapi::UFFDIO,
            uapi::_UFFDIO_COPY,
            size_of::<uapi::uffdio_copy>(),
        );
        assert_eq!(copy, req::UFFDIO_COPY);
        // The kernel header's values (x86_64 and every generic-ioctl arch).
        assert_eq!(UFFDIO_MOVE, 0xc028_aa05);
        assert_eq!(UFFDIO_POISON, 0xc020_aa08);
        assert_eq!(USERFAULTFD_IOC_NEW, 0xaa00);
        assert_eq!(size_of::<uapi::uffd_msg>(), 32);
    }
}
