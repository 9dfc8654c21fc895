//! Data that comes from or goes to a file or a pipe: `sendfile` and
//! `splice`. The kernel would move these bytes between its own buffers; on
//! an upgraded connection they go through one buffer of ours instead, the
//! price of keeping the byte stream in the engine (a `splice` that went to
//! the kernel socket would be bytes behind the shim's back).

use libc::{c_int, c_uint, loff_t, off_t, size_t, ssize_t};

use super::data::{Target, efail, plain, recv_bufs, send_bufs, target};
use super::{guard, hook};
use crate::real;

/// The most one call moves through our buffer.
const CHUNK: usize = 1 << 20;

/// The same call under its large-file name (python's `os.sendfile`).
#[unsafe(no_mangle)]
pub unsafe extern "C" fn sendfile64(
    out: c_int,
    inp: c_int,
    off: *mut off_t,
    count: size_t,
) -> ssize_t {
    hook(|| {
        if !matches!(target(out), Target::Azsdp(..)) {
            // SAFETY: libc's sendfile64 with the program's arguments.
            return unsafe { real::sendfile64(out, inp, off, count) };
        }
        // SAFETY: the same call (off_t is 64-bit here).
        unsafe { sendfile(out, inp, off, count) }
    })
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn sendfile(
    out: c_int,
    inp: c_int,
    off: *mut off_t,
    count: size_t,
) -> ssize_t {
    hook(|| {
        let (s, c) = match target(out) {
            Target::Azsdp(s, c) => (s, c),
            Target::Plain(t) => {
                // SAFETY: libc's sendfile with the program's arguments.
                return plain(t, true, || unsafe { real::sendfile(out, inp, off, count) });
            }
        };
        guard(-1, || {
            // Read a chunk from the file, then send it.
            let chunk = count.min(CHUNK);
            let mut buf = vec![0u8; chunk];
            // SAFETY: reading into our own buffer; `off` is the program's.
            let got = unsafe {
                if off.is_null() {
                    real::read(inp, buf.as_mut_ptr().cast(), chunk)
                } else {
                    libc::pread(inp, buf.as_mut_ptr().cast(), chunk, *off)
                }
            };
            if got <= 0 {
                return got;
            }
            let sent = send_bufs(out, &s, &c, &[(buf.as_ptr(), got as usize)], 0);
            if sent > 0 {
                // SAFETY: the program's offset, or put back what we did not send.
                unsafe {
                    if off.is_null() {
                        if sent < got {
                            libc::lseek(inp, (sent - got) as off_t, libc::SEEK_CUR);
                        }
                    } else {
                        *off += sent as off_t;
                    }
                }
            }
            sent
        })
    })
}

/// Is `fd` a pipe (or FIFO)?
fn is_pipe(fd: c_int) -> bool {
    // SAFETY: fstat into our own zeroed structure.
    unsafe {
        let mut st: libc::stat = std::mem::zeroed();
        libc::fstat(fd, &mut st) == 0 && st.st_mode & libc::S_IFMT == libc::S_IFIFO
    }
}

/// Wait until `fd` (a pipe end) is ready for `events`, as a blocking
/// `splice` would; the program's signals end the wait with EINTR.
fn wait_pipe(fd: c_int, events: i16) -> Result<(), c_int> {
    let mut p = libc::pollfd {
        fd,
        events,
        revents: 0,
    };
    // SAFETY: poll of one entry of our own.
    let n = unsafe { real::poll(&mut p, 1, -1) };
    if n < 0 { Err(real::errno()) } else { Ok(()) }
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn splice(
    fd_in: c_int,
    off_in: *mut loff_t,
    fd_out: c_int,
    off_out: *mut loff_t,
    len: size_t,
    flags: c_uint,
) -> ssize_t {
    hook(|| match (target(fd_in), target(fd_out)) {
        (_, Target::Azsdp(s, c)) => guard(-1, || {
            checked(fd_in, [off_in, off_out], len, flags, |n, nonblocking| {
                pipe_to_conn(fd_in, n, nonblocking, |buf| {
                    let f = if nonblocking { libc::MSG_DONTWAIT } else { 0 };
                    send_bufs(fd_out, &s, &c, &[(buf.as_ptr(), buf.len())], f)
                })
            })
        }),
        (Target::Azsdp(s, c), _) => guard(-1, || {
            checked(fd_out, [off_in, off_out], len, flags, |n, nonblocking| {
                conn_to_pipe(fd_out, n, nonblocking, |buf| {
                    let f = if nonblocking { libc::MSG_DONTWAIT } else { 0 };
                    recv_bufs(fd_in, &s, &c, &[(buf.as_mut_ptr(), buf.len())], f)
                })
            })
        }),
        (Target::Plain(ti), Target::Plain(to)) => {
            // SAFETY: libc's splice with the program's arguments.
            let call = || unsafe { real::splice(fd_in, off_in, fd_out, off_out, len, flags) };
            match (ti, to) {
                (Some(t), _) => plain(Some(t), false, call),
                (None, t) => plain(t, true, call),
            }
        }
    })
}

/// The kernel's checks of a `splice` between an upgraded socket and
/// `pipe` (neither end takes an offset; the other end must be a pipe),
/// then `f` with the length to move and whether not to wait.
fn checked(
    pipe: c_int,
    offsets: [*mut loff_t; 2],
    len: size_t,
    flags: c_uint,
    f: impl FnOnce(usize, bool) -> ssize_t,
) -> ssize_t {
    if offsets.iter().any(|o| !o.is_null()) {
        return efail(libc::ESPIPE);
    }
    if !is_pipe(pipe) {
        return efail(libc::EINVAL);
    }
    if len == 0 {
        return 0;
    }
    f(len.min(CHUNK), flags & libc::SPLICE_F_NONBLOCK != 0)
}

/// Move up to `len` bytes from the pipe `pipe` through `send`, taking from
/// the pipe only what `send` took: the bytes are first copied out with
/// `tee` (the pipe keeps them), then as many as were sent are consumed.
fn pipe_to_conn(
    pipe: c_int,
    len: usize,
    nonblocking: bool,
    send: impl FnOnce(&[u8]) -> ssize_t,
) -> ssize_t {
    let mut ends = [0 as c_int; 2];
    // SAFETY: pipe2 into our own array.
    if unsafe { libc::pipe2(ends.as_mut_ptr(), libc::O_CLOEXEC) } != 0 {
        return -1;
    }
    let _close = Closer(ends);
    // The copy holds what the program's pipe holds, up to its size.
    // SAFETY: fcntl on the program's pipe and on ours.
    unsafe {
        let size = real::fcntl(pipe, libc::F_GETPIPE_SZ, 0);
        if size > 0 {
            real::fcntl(ends[1], libc::F_SETPIPE_SZ, size as usize);
        }
    }
    let tee_flags = if nonblocking {
        libc::SPLICE_F_NONBLOCK
    } else {
        0
    };
    let copied = loop {
        // SAFETY: tee(2) from the program's pipe into ours.
        let n = unsafe { libc::tee(pipe, ends[1], len, tee_flags) };
        if n < 0 && real::errno() == libc::EAGAIN && !nonblocking {
            // The program's pipe is non-blocking but the call is not.
            if let Err(e) = wait_pipe(pipe, libc::POLLIN) {
                return efail(e);
            }
            continue;
        }
        break n;
    };
    if copied <= 0 {
        // 0: every writer closed the pipe; or tee's error.
        return copied;
    }
    let mut buf = vec![0u8; copied as usize];
    // SAFETY: read(2) of what tee put in our pipe, into our buffer.
    let got = unsafe { real::read(ends[0], buf.as_mut_ptr().cast(), buf.len()) };
    if got != copied {
        return efail(libc::EIO);
    }
    let sent = send(&buf);
    if sent > 0 {
        // Consume what went out, and only that.
        let mut left = sent as usize;
        while left > 0 {
            // SAFETY: read(2) from the program's pipe into our buffer.
            let n = unsafe { real::read(pipe, buf.as_mut_ptr().cast(), left) };
            if n <= 0 {
                break;
            }
            left -= n as usize;
        }
    }
    sent
}

/// Move up to `len` bytes received by `recv` into the pipe `pipe`, never
/// more than the pipe has room for (so none of them is left in our hands).
fn conn_to_pipe(
    pipe: c_int,
    len: usize,
    nonblocking: bool,
    recv: impl FnOnce(&mut [u8]) -> ssize_t,
) -> ssize_t {
    let room = loop {
        // SAFETY: fcntl and ioctl(FIONREAD) on the program's pipe.
        let (size, used) = unsafe {
            let mut used: c_int = 0;
            let size = real::fcntl(pipe, libc::F_GETPIPE_SZ, 0);
            real::ioctl(pipe, libc::FIONREAD, (&raw mut used) as usize);
            (size, used)
        };
        if size < 0 {
            return -1;
        }
        let room = (size - used).max(0) as usize;
        if room > 0 {
            break room;
        }
        if nonblocking {
            return efail(libc::EAGAIN);
        }
        if let Err(e) = wait_pipe(pipe, libc::POLLOUT) {
            return efail(e);
        }
    };
    let mut buf = vec![0u8; len.min(room)];
    let got = recv(&mut buf);
    if got <= 0 {
        return got;
    }
    let mut done = 0usize;
    while done < got as usize {
        // SAFETY: write(2) of our buffer into the program's pipe.
        let n = unsafe { real::write(pipe, buf[done..].as_ptr().cast(), got as usize - done) };
        if n < 0 {
            if real::errno() == libc::EINTR {
                continue;
            }
            if real::errno() == libc::EAGAIN && wait_pipe(pipe, libc::POLLOUT).is_ok() {
                continue;
            }
            // The reader closed the pipe: the bytes are lost, as with the
            // kernel's splice when the pipe breaks mid-call.
            return if done > 0 { done as ssize_t } else { -1 };
        }
        done += n as usize;
    }
    got
}

/// Closes both ends of our scratch pipe.
struct Closer([c_int; 2]);

impl Drop for Closer {
    fn drop(&mut self) {
        // SAFETY: our own descriptors.
        unsafe {
            real::close(self.0[0]);
            real::close(self.0[1]);
        }
    }
}
