//! Batches of messages: `sendmmsg` and `recvmmsg`. On a stream socket each
//! message is one `sendmsg`/`recvmsg` in turn, and the call returns how
//! many messages were done once one fails (its error is the call's only
//! if it was the first). `sendmmsg` also stops after a message that went
//! out in part, so the program's next call carries on from there;
//! `recvmmsg`, as the kernel's, goes on after a short message
//! (`MSG_WAITFORONE` makes the later ones take only what is there).

use std::time::{Duration, Instant};

use libc::{c_int, c_uint, mmsghdr, timespec};

use super::data::{Target, efail, iovs, recv_bufs, send_bufs, send_iovs, target};
use super::{guard, hook};
use crate::{real, user_mem};

/// The program's message vector, read through the kernel.
fn messages(v: *mut mmsghdr, n: c_uint) -> Result<Vec<mmsghdr>, c_int> {
    // The kernel takes at most UIO_MAXIOV messages per call.
    let n = (n as usize).min(1024);
    user_mem::read(v.cast_const(), n)
}

/// Bytes moved by the first `n` messages (for a TCP connection's counts).
fn moved(v: *mut mmsghdr, n: c_int) -> u64 {
    if n <= 0 {
        return 0;
    }
    messages(v, n as c_uint)
        .map(|m| m.iter().map(|h| u64::from(h.msg_len)).sum())
        .unwrap_or(0)
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn sendmmsg(fd: c_int, v: *mut mmsghdr, n: c_uint, flags: c_int) -> c_int {
    hook(|| match target(fd) {
        Target::Azsdp(s, c) => guard(-1, || {
            let msgs = match messages(v, n) {
                Ok(m) => m,
                Err(e) => return efail(e) as c_int,
            };
            let mut done: c_int = 0;
            for (i, m) in msgs.iter().enumerate() {
                let bufs = match send_iovs(m.msg_hdr.msg_iov, m.msg_hdr.msg_iovlen as i64) {
                    Ok(b) => b,
                    Err(e) if done == 0 => return efail(e) as c_int,
                    Err(_) => break,
                };
                let want: usize = bufs.iter().map(|b| b.1).sum();
                let r = send_bufs(fd, &s, &c, &bufs, flags);
                if r < 0 {
                    if done == 0 {
                        return -1;
                    }
                    break;
                }
                // SAFETY: within the vector the program passed (read above).
                let len_at = unsafe { &raw mut (*v.add(i)).msg_len };
                if let Err(e) = user_mem::write(len_at, &[r as c_uint]) {
                    return efail(e) as c_int;
                }
                done += 1;
                if (r as usize) < want {
                    break;
                }
            }
            done
        }),
        Target::Plain(t) => {
            // SAFETY: libc's sendmmsg with the program's arguments.
            let call = || unsafe { real::sendmmsg(fd, v, n, flags) };
            let Some(t) = t else { return call() };
            // (Counted by what the messages moved.)
            let mut r = 0;
            t.call(true, false, || {
                r = call();
                moved(v, r) as isize
            });
            r
        }
    })
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn recvmmsg(
    fd: c_int,
    v: *mut mmsghdr,
    n: c_uint,
    flags: c_int,
    timeout: *mut timespec,
) -> c_int {
    hook(|| match target(fd) {
        Target::Azsdp(s, c) => guard(-1, || {
            let msgs = match messages(v, n) {
                Ok(m) => m,
                Err(e) => return efail(e) as c_int,
            };
            let deadline = if timeout.is_null() {
                None
            } else {
                match user_mem::read(timeout.cast_const(), 1) {
                    Ok(t) if t[0].tv_sec >= 0 && (0..1_000_000_000).contains(&t[0].tv_nsec) => {
                        Some(
                            Instant::now() + Duration::new(t[0].tv_sec as u64, t[0].tv_nsec as u32),
                        )
                    }
                    Ok(_) => return efail(libc::EINVAL) as c_int,
                    Err(e) => return efail(e) as c_int,
                }
            };
            let base = flags & !libc::MSG_WAITFORONE;
            let mut done: c_int = 0;
            for (i, m) in msgs.iter().enumerate() {
                let bufs = match iovs(m.msg_hdr.msg_iov, m.msg_hdr.msg_iovlen as i64) {
                    Ok(b) => b,
                    Err(e) if done == 0 => return efail(e) as c_int,
                    Err(_) => break,
                };
                // After the first message, MSG_WAITFORONE takes only what is
                // there.
                let f = if done > 0 && flags & libc::MSG_WAITFORONE != 0 {
                    base | libc::MSG_DONTWAIT
                } else {
                    base
                };
                let r = recv_bufs(fd, &s, &c, &bufs, f);
                if r < 0 {
                    if done == 0 {
                        return -1;
                    }
                    break;
                }
                // The kernel writes these back: the length, and no address,
                // control data or flags.
                let mut back = *m;
                back.msg_len = r as c_uint;
                back.msg_hdr.msg_namelen = 0;
                back.msg_hdr.msg_controllen = 0;
                back.msg_hdr.msg_flags = 0;
                // SAFETY: within the vector the program passed (read above).
                if let Err(e) = user_mem::write(unsafe { v.add(i) }, &[back]) {
                    return efail(e) as c_int;
                }
                done += 1;
                // At EOF every further message would be empty too.
                if r == 0 || deadline.is_some_and(|d| Instant::now() >= d) {
                    break;
                }
            }
            if let Some(d) = deadline {
                // The kernel leaves the time that was left in *timeout.
                let left = d.saturating_duration_since(Instant::now());
                let _ = user_mem::write(timeout, &[crate::ready::timespec_of(left)]);
            }
            done
        }),
        Target::Plain(t) => {
            // SAFETY: libc's recvmmsg with the program's arguments.
            let call = || unsafe { real::recvmmsg(fd, v, n, flags, timeout) };
            let Some(t) = t else { return call() };
            let mut r = 0;
            t.call(false, flags & libc::MSG_PEEK != 0, || {
                r = call();
                moved(v, r) as isize
            });
            r
        }
    })
}
