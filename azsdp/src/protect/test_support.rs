//! Test helpers shared by the protection backends' tests.

use std::ops::Range;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicIsize, Ordering};
use std::thread::JoinHandle;
use std::time::Duration;

/// Anonymous private pages, unmapped on drop.
pub struct Pages {
    pub ptr: *mut u8,
    pub len: usize,
}

impl Pages {
    pub fn new(pages: usize, touch: bool) -> Pages {
        let len = pages * 4096;
        // SAFETY: anonymous private mapping, checked below.
        let ptr = unsafe {
            libc::mmap(
                std::ptr::null_mut(),
                len,
                libc::PROT_READ | libc::PROT_WRITE,
                libc::MAP_PRIVATE | libc::MAP_ANONYMOUS,
                -1,
                0,
            )
        };
        assert_ne!(ptr, libc::MAP_FAILED);
        let ptr = ptr.cast::<u8>();
        if touch {
            // SAFETY: the mapping is `len` bytes.
            unsafe { ptr.write_bytes(7, len) };
        }
        Pages { ptr, len }
    }
    pub fn range(&self) -> Range<u64> {
        self.ptr as u64..self.ptr as u64 + self.len as u64
    }
    pub fn addr(&self, off: usize) -> usize {
        self.ptr as usize + off
    }
}

impl Drop for Pages {
    fn drop(&mut self) {
        // SAFETY: unmapping our own mapping.
        unsafe { libc::munmap(self.ptr.cast(), self.len) };
    }
}

/// A `read()` of `data` from a pipe into `dst`, started on a thread: the
/// kernel writes `dst` (maybe a protected or armed page).
pub struct PipeRead {
    thread: Option<JoinHandle<()>>,
    done: Arc<AtomicBool>,
    n: Arc<AtomicIsize>,
    fds: [i32; 2],
}

impl PipeRead {
    /// Start it and give it `wait` to finish (it should not, if `dst` is
    /// guarded).
    pub fn start(dst: u64, data: &'static [u8], wait: Duration) -> PipeRead {
        let mut fds = [0; 2];
        // SAFETY: plain pipe creation into a 2-int array.
        assert_eq!(unsafe { libc::pipe(fds.as_mut_ptr()) }, 0);
        // SAFETY: writing from a static buffer to our pipe.
        let wrote = unsafe { libc::write(fds[1], data.as_ptr().cast(), data.len()) };
        assert_eq!(wrote, data.len() as isize);
        let (done, n) = (
            Arc::new(AtomicBool::new(false)),
            Arc::new(AtomicIsize::new(-2)),
        );
        let (d2, n2, rd, len) = (Arc::clone(&done), Arc::clone(&n), fds[0], data.len());
        let thread = std::thread::spawn(move || {
            // SAFETY: reading into the caller's mapping, which outlives the
            // thread (joined in `finish`).
            let r = unsafe { libc::read(rd, dst as *mut libc::c_void, len) };
            let r = if r < 0 {
                -(std::io::Error::last_os_error().raw_os_error().unwrap_or(0) as isize)
            } else {
                r
            };
            n2.store(r, Ordering::SeqCst);
            d2.store(true, Ordering::SeqCst);
        });
        std::thread::sleep(wait);
        PipeRead {
            thread: Some(thread),
            done,
            n,
            fds,
        }
    }

    pub fn is_done(&self) -> bool {
        self.done.load(Ordering::SeqCst)
    }

    /// Wait for the read; what it returned (bytes, or minus the errno).
    pub fn finish(mut self) -> isize {
        if let Some(t) = self.thread.take() {
            t.join().unwrap();
        }
        self.n.load(Ordering::SeqCst)
    }
}

impl Drop for PipeRead {
    fn drop(&mut self) {
        // SAFETY: closing our pipe.
        unsafe {
            libc::close(self.fds[0]);
            libc::close(self.fds[1]);
        }
    }
}
