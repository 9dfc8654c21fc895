//! What the test programs (`azsdp-sockcheck`, `azsdp-conform`) and the
//! tests that drive them share: plain libc helpers for loopback sockets,
//! errno, signal counting and timers. Nothing here knows of azsdp: the
//! programs must stay ordinary libc programs.

use std::sync::atomic::{AtomicUsize, Ordering};

use libc::c_int;

/// `127.0.0.1:port`, as the C socket calls take it.
///
/// `SOCKCHECK_ADDR` (an IPv4 address of this host) replaces it: the
/// SoftRoCE guest runs the same programs between its two RDMA devices.
pub fn loopback(port: u16) -> libc::sockaddr_in {
    let ip = std::env::var("SOCKCHECK_ADDR")
        .ok()
        .and_then(|a| a.parse::<std::net::Ipv4Addr>().ok())
        .unwrap_or(std::net::Ipv4Addr::LOCALHOST);
    libc::sockaddr_in {
        sin_family: libc::AF_INET as libc::sa_family_t,
        sin_port: port.to_be(),
        sin_addr: libc::in_addr {
            s_addr: u32::from(ip).to_be(),
        },
        sin_zero: [0; 8],
    }
}

/// The calling thread's errno.
pub fn errno() -> c_int {
    std::io::Error::last_os_error().raw_os_error().unwrap_or(0)
}

/// close(2), its result ignored.
pub fn close(fd: c_int) {
    // SAFETY: close(2) of the caller's descriptor.
    unsafe { libc::close(fd) };
}

pub fn sleep_ms(ms: u64) {
    std::thread::sleep(std::time::Duration::from_millis(ms));
}

/// `len` bytes of pattern `seed`: both ends of a check make the same.
pub fn pattern(len: usize, seed: u32) -> Vec<u8> {
    (0..len as u32)
        .map(|i| {
            (i.wrapping_mul(2_654_435_761) ^ seed.wrapping_mul(0x9e37_79b9)).rotate_left(5) as u8
        })
        .collect()
}

/// Signals delivered so far, by number, to handlers that [`count_signal`]
/// installed.
static DELIVERED: [AtomicUsize; 65] = [const { AtomicUsize::new(0) }; 65];

extern "C" fn counter(sig: c_int) {
    if let Some(n) = DELIVERED.get(sig as usize) {
        n.fetch_add(1, Ordering::SeqCst);
    }
}

/// Handle `sig` by counting it (see [`delivered`]), with or without
/// SA_RESTART.
pub fn count_signal(sig: c_int, restart: bool) {
    // SAFETY: installing a handler that only touches an atomic.
    unsafe {
        let mut sa: libc::sigaction = std::mem::zeroed();
        sa.sa_sigaction = counter as extern "C" fn(c_int) as usize;
        sa.sa_flags = if restart { libc::SA_RESTART } else { 0 };
        libc::sigaction(sig, &sa, std::ptr::null_mut());
    }
}

/// How many times `sig` reached its counting handler.
pub fn delivered(sig: c_int) -> usize {
    DELIVERED
        .get(sig as usize)
        .map_or(0, |n| n.load(Ordering::SeqCst))
}

/// SIGALRM in `ms` milliseconds (ITIMER_REAL, once).
pub fn alarm_in(ms: u64) {
    let it = libc::itimerval {
        it_interval: libc::timeval {
            tv_sec: 0,
            tv_usec: 0,
        },
        it_value: libc::timeval {
            tv_sec: (ms / 1000) as libc::time_t,
            tv_usec: ((ms % 1000) * 1000) as libc::suseconds_t,
        },
    };
    // SAFETY: setitimer(2) from our own struct.
    unsafe { libc::setitimer(libc::ITIMER_REAL, &it, std::ptr::null_mut()) };
}

/// Set a timeval socket option (SO_RCVTIMEO, SO_SNDTIMEO) to `ms`
/// milliseconds (0: no timeout); returns setsockopt's result.
pub fn set_timeout(fd: c_int, name: c_int, ms: u64) -> c_int {
    let tv = libc::timeval {
        tv_sec: (ms / 1000) as libc::time_t,
        tv_usec: ((ms % 1000) * 1000) as libc::suseconds_t,
    };
    // SAFETY: setsockopt(2) from our own timeval.
    unsafe {
        libc::setsockopt(
            fd,
            libc::SOL_SOCKET,
            name,
            (&raw const tv).cast(),
            std::mem::size_of_val(&tv) as libc::socklen_t,
        )
    }
}
