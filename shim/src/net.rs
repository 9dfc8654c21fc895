//! Socket addresses between C and Rust, and small socket helpers.
//!
//! `unsafe` here: reading and writing `sockaddr` buffers the program
//! passed in, within the lengths it gave.

use std::net::{IpAddr, Ipv4Addr, Ipv6Addr, SocketAddr, SocketAddrV4, SocketAddrV6};

use libc::{c_int, sockaddr, sockaddr_in, sockaddr_in6, sockaddr_storage, socklen_t};

/// Decode a socket address the program passed (`None` if not IPv4/IPv6).
///
/// # Safety
/// `addr` must be null or point to `len` readable bytes.
pub unsafe fn from_raw(addr: *const sockaddr, len: socklen_t) -> Option<SocketAddr> {
    if addr.is_null() || (len as usize) < std::mem::size_of::<libc::sa_family_t>() {
        return None;
    }
    // SAFETY: at least the family is readable (checked); each arm checks
    // the length of its structure before reading it (unaligned reads, the
    // program's buffer may be any alignment).
    unsafe {
        match c_int::from((*addr).sa_family) {
            libc::AF_INET if len as usize >= std::mem::size_of::<sockaddr_in>() => {
                let a = std::ptr::read_unaligned(addr.cast::<sockaddr_in>());
                Some(SocketAddr::V4(SocketAddrV4::new(
                    Ipv4Addr::from(u32::from_be(a.sin_addr.s_addr)),
                    u16::from_be(a.sin_port),
                )))
            }
            libc::AF_INET6 if len as usize >= std::mem::size_of::<sockaddr_in6>() => {
                let a = std::ptr::read_unaligned(addr.cast::<sockaddr_in6>());
                Some(SocketAddr::V6(SocketAddrV6::new(
                    Ipv6Addr::from(a.sin6_addr.s6_addr),
                    u16::from_be(a.sin6_port),
                    a.sin6_flowinfo,
                    a.sin6_scope_id,
                )))
            }
            _ => None,
        }
    }
}

/// Encode `a` as the kernel would.
pub fn to_storage(a: SocketAddr) -> (sockaddr_storage, socklen_t) {
    // SAFETY: sockaddr_storage is plain data; all-zero is valid.
    let mut st: sockaddr_storage = unsafe { std::mem::zeroed() };
    let len = match a {
        SocketAddr::V4(v4) => {
            let sin = sockaddr_in {
                sin_family: libc::AF_INET as libc::sa_family_t,
                sin_port: v4.port().to_be(),
                sin_addr: libc::in_addr {
                    s_addr: u32::from(*v4.ip()).to_be(),
                },
                sin_zero: [0; 8],
            };
            // SAFETY: sockaddr_storage is larger than and aligned for sockaddr_in.
            unsafe { std::ptr::write((&raw mut st).cast::<sockaddr_in>(), sin) };
            std::mem::size_of::<sockaddr_in>()
        }
        SocketAddr::V6(v6) => {
            let sin6 = sockaddr_in6 {
                sin6_family: libc::AF_INET6 as libc::sa_family_t,
                sin6_port: v6.port().to_be(),
                sin6_flowinfo: v6.flowinfo(),
                sin6_addr: libc::in6_addr {
                    s6_addr: v6.ip().octets(),
                },
                sin6_scope_id: v6.scope_id(),
            };
            // SAFETY: as above, for sockaddr_in6.
            unsafe { std::ptr::write((&raw mut st).cast::<sockaddr_in6>(), sin6) };
            std::mem::size_of::<sockaddr_in6>()
        }
    };
    (st, len as socklen_t)
}

/// Hand `a` back to the program as `accept`/`getpeername` do: copy at most
/// `*len` bytes, and store the full length in `*len`; through the kernel,
/// with its errors (EFAULT for memory it cannot access, EINVAL for a
/// negative length). Null pointers: nothing to do.
pub fn copy_out(
    a: &sockaddr_storage,
    alen: socklen_t,
    out: *mut sockaddr,
    len: *mut socklen_t,
) -> Result<(), c_int> {
    if out.is_null() || len.is_null() {
        return Ok(());
    }
    let room = crate::user_mem::read(len.cast_const(), 1)?[0];
    if (room as i32) < 0 {
        return Err(libc::EINVAL);
    }
    let n = room.min(alen) as usize;
    // SAFETY: `a` is a whole sockaddr_storage, at least `alen` >= n bytes.
    let bytes =
        unsafe { std::slice::from_raw_parts((a as *const sockaddr_storage).cast::<u8>(), n) };
    crate::user_mem::write(out.cast::<u8>(), bytes)?;
    crate::user_mem::write(len, &[alen])
}

/// An address of socket `fd`, as `getsockname`/`getpeername` (`ask`) give it.
fn name_of(
    fd: c_int,
    ask: unsafe fn(c_int, *mut sockaddr, *mut socklen_t) -> c_int,
) -> Option<SocketAddr> {
    // SAFETY: plain data, written by the kernel within `len`.
    let mut st: sockaddr_storage = unsafe { std::mem::zeroed() };
    let mut len = std::mem::size_of::<sockaddr_storage>() as socklen_t;
    let p = (&raw mut st).cast::<sockaddr>();
    // SAFETY: `ask` is libc's getsockname or getpeername, into our buffer.
    let r = unsafe { ask(fd, p, &mut len) };
    // SAFETY: the kernel wrote `len` bytes.
    (r == 0).then(|| unsafe { from_raw(p, len) }).flatten()
}

/// The kernel socket's own address (`getsockname`).
pub fn local_of(fd: c_int) -> Option<SocketAddr> {
    name_of(fd, crate::real::getsockname)
}

/// The kernel socket's peer address (`getpeername`).
pub fn peer_of(fd: c_int) -> Option<SocketAddr> {
    name_of(fd, crate::real::getpeername)
}

/// Unwrap IPv4-mapped IPv6 addresses.
pub fn canonical(ip: IpAddr) -> IpAddr {
    match ip {
        IpAddr::V6(a) => a.to_ipv4_mapped().map_or(IpAddr::V6(a), IpAddr::V4),
        v4 => v4,
    }
}

/// The same address, an IPv4 one and its IPv6-mapped form alike.
pub fn same_addr(a: SocketAddr, b: SocketAddr) -> bool {
    a.port() == b.port() && canonical(a.ip()) == canonical(b.ip())
}

/// Is `ip` an address of this host (this network namespace)?
pub fn is_local(ip: IpAddr) -> bool {
    let ip = canonical(ip);
    if ip.is_loopback() {
        return true;
    }
    if ip.is_unspecified() || ip.is_multicast() {
        return false;
    }
    // Only a local address can be bound (without IP_FREEBIND).
    std::net::UdpSocket::bind(SocketAddr::new(ip, 0)).is_ok()
}

/// A log line's "LOCAL " before "-> PEER", when the local address is known.
pub fn log_from(local: Option<SocketAddr>) -> String {
    local.map_or_else(String::new, |l| format!("{l} "))
}
