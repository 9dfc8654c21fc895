//! What the kernel says about TCP sockets: `NETLINK_SOCK_DIAG` (the
//! interface `ss` uses) and `SO_COOKIE`.
//!
//! Pairing rests on these facts, none of which a peer can forge:
//! - who owns the socket listening on a port ([`listeners`]);
//! - which socket is the far end of a connection ([`far_end`]), named by
//!   its cookie: a 64-bit number the kernel gives each socket once per
//!   boot and never reuses;
//! - the cookie of a socket someone handed us ([`cookie_of`]): holding the
//!   descriptor is the proof of holding the socket.
//!
//! Queries run in the caller's network namespace, the one whose abstract
//! Unix names the pairing registry uses. No privilege is needed.
//!
//! `unsafe` here: the netlink structures, read from and written to byte
//! buffers, and `getsockopt`.

use std::net::{IpAddr, Ipv4Addr, Ipv6Addr, SocketAddr};
use std::os::fd::{AsFd, AsRawFd, BorrowedFd, FromRawFd, OwnedFd};
use std::sync::atomic::{AtomicU32, Ordering};

const NETLINK_SOCK_DIAG: i32 = 4;
const SOCK_DIAG_BY_FAMILY: u16 = 20;
const NLMSG_ERROR: u16 = 2;
const NLMSG_DONE: u16 = 3;
const TCP_LISTEN: u32 = 10;
const TCP_TIME_WAIT: u32 = 6;
const NOCOOKIE: u32 = !0;

#[repr(C)]
#[derive(Clone, Copy, Default)]
struct NlMsgHdr {
    len: u32,
    ty: u16,
    flags: u16,
    seq: u32,
    pid: u32,
}

#[repr(C)]
#[derive(Clone, Copy, Default)]
struct SockId {
    sport: u16, // network order
    dport: u16, // network order
    src: [u8; 16],
    dst: [u8; 16],
    iface: u32,
    cookie: [u32; 2],
}

#[repr(C)]
#[derive(Clone, Copy, Default)]
struct ReqV2 {
    family: u8,
    protocol: u8,
    ext: u8,
    pad: u8,
    states: u32,
    id: SockId,
}

#[repr(C)]
#[derive(Clone, Copy, Default)]
struct DiagMsg {
    family: u8,
    state: u8,
    timer: u8,
    retrans: u8,
    id: SockId,
    expires: u32,
    rqueue: u32,
    wqueue: u32,
    uid: u32,
    inode: u32,
}

const _: () = assert!(std::mem::size_of::<SockId>() == 48);
const _: () = assert!(std::mem::size_of::<ReqV2>() == 56);
const _: () = assert!(std::mem::size_of::<DiagMsg>() == 72);

/// A TCP socket as the kernel describes it.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct TcpSocket {
    pub local: SocketAddr,
    pub remote: SocketAddr,
    /// The uid of the process that created it.
    pub uid: u32,
    pub inode: u32,
    /// Unique per socket and boot (as `SO_COOKIE` reports it).
    pub cookie: u64,
    pub state: u8,
}

fn addr_bytes(ip: IpAddr) -> (u8, [u8; 16]) {
    let mut b = [0u8; 16];
    match canonical(ip) {
        IpAddr::V4(a) => {
            b[..4].copy_from_slice(&a.octets());
            (libc::AF_INET as u8, b)
        }
        IpAddr::V6(a) => (libc::AF_INET6 as u8, a.octets()),
    }
}

fn canonical(ip: IpAddr) -> IpAddr {
    match ip {
        IpAddr::V6(a) => a.to_ipv4_mapped().map_or(IpAddr::V6(a), IpAddr::V4),
        v4 => v4,
    }
}

fn addr_of(family: u8, b: &[u8; 16], port_be: u16) -> SocketAddr {
    let port = u16::from_be(port_be);
    if i32::from(family) == libc::AF_INET {
        SocketAddr::new(IpAddr::V4(Ipv4Addr::new(b[0], b[1], b[2], b[3])), port)
    } else {
        SocketAddr::new(IpAddr::V6(Ipv6Addr::from(*b)), port)
    }
}

fn as_bytes<T: Copy>(v: &T) -> &[u8] {
    // SAFETY: T is a plain repr(C) struct of integers without padding
    // (sizes asserted above); any byte view of it is initialised.
    unsafe { std::slice::from_raw_parts((v as *const T).cast::<u8>(), std::mem::size_of::<T>()) }
}

fn read_at<T: Copy + Default>(b: &[u8], at: usize) -> Option<T> {
    let end = at.checked_add(std::mem::size_of::<T>())?;
    if end > b.len() {
        return None;
    }
    // SAFETY: in bounds (checked); T is plain integers, valid for any bits;
    // read_unaligned copes with the buffer's alignment.
    Some(unsafe { std::ptr::read_unaligned(b[at..].as_ptr().cast::<T>()) })
}

/// A netlink socket kept for the next query: making and closing one costs
/// more than the question, and a pair asks two. It is kept with the
/// process and the network namespace it was made in, and serves only a
/// question about a socket of that namespace (a forked child, or a thread
/// asking about a socket of another namespace, makes its own).
struct Spare {
    fd: OwnedFd,
    pid: u32,
    netns: u64,
}

static SPARE: crate::sync::Lock<Option<Spare>> = crate::sync::Lock::new(None);

/// Numbers each request, so that an answer left unread by a query that
/// failed half-way is never taken for another's.
static SEQ: AtomicU32 = AtomicU32::new(1);

/// Where a query runs: in the network namespace of a socket the caller
/// holds (the kept netlink socket may serve), or where the calling thread
/// is (a socket of its own).
#[derive(Clone, Copy, Debug)]
pub enum Netns<'a> {
    Of(BorrowedFd<'a>),
    Here,
}

/// The kernel's cookie of the network namespace of socket `fd`
/// (`SO_NETNS_COOKIE`, Linux 5.14).
pub fn netns_cookie(fd: BorrowedFd<'_>) -> Option<u64> {
    sockopt_u64(fd, libc::SO_NETNS_COOKIE).ok()
}

/// A 64-bit `SOL_SOCKET` option of socket `fd`.
fn sockopt_u64(fd: BorrowedFd<'_>, opt: libc::c_int) -> std::io::Result<u64> {
    let mut v: u64 = 0;
    let mut len = std::mem::size_of::<u64>() as libc::socklen_t;
    // SAFETY: getsockopt into our own u64, within `len`.
    let r = unsafe {
        libc::getsockopt(
            fd.as_raw_fd(),
            libc::SOL_SOCKET,
            opt,
            (&raw mut v).cast(),
            &mut len,
        )
    };
    if r != 0 {
        return Err(std::io::Error::last_os_error());
    }
    Ok(v)
}

/// A new sock_diag socket.
fn new_socket() -> std::io::Result<OwnedFd> {
    // SAFETY: plain system call.
    let fd = unsafe {
        libc::socket(
            libc::AF_NETLINK,
            libc::SOCK_DGRAM | libc::SOCK_CLOEXEC,
            NETLINK_SOCK_DIAG,
        )
    };
    if fd < 0 {
        return Err(std::io::Error::last_os_error());
    }
    // SAFETY: a new descriptor we own.
    Ok(unsafe { OwnedFd::from_raw_fd(fd) })
}

/// One request, answered by zero or more socket descriptions.
fn query(req: ReqV2, dump: bool, ns: Netns<'_>) -> std::io::Result<Vec<TcpSocket>> {
    let netns = match ns {
        Netns::Of(fd) => netns_cookie(fd),
        Netns::Here => None,
    };
    let pid = crate::process::pid();
    let kept = netns.and_then(|netns| {
        let mut spare = SPARE.lock();
        match spare.take() {
            Some(s) if s.pid == pid && s.netns == netns => Some(s.fd),
            // Another namespace's: it goes; a forked child's copy of its
            // parent's is closed here without touching the parent's.
            _ => None,
        }
    });
    let (sock, own) = match kept {
        Some(fd) => (fd, netns),
        // Tagged with its own namespace, the calling thread's, which need
        // not be the one of the socket asked about.
        None => {
            let fd = new_socket()?;
            let own = netns.and_then(|_| netns_cookie(fd.as_fd()));
            (fd, own)
        }
    };
    let out = ask(&sock, req, dump)?;
    // Kept only after a whole answer: nothing is left unread in it.
    if let Some(netns) = own {
        let mut spare = SPARE.lock();
        if spare.is_none() {
            *spare = Some(Spare {
                fd: sock,
                pid,
                netns,
            });
        }
    }
    Ok(out)
}

/// Send `req` on `sock` and read its whole answer.
fn ask(sock: &OwnedFd, req: ReqV2, dump: bool) -> std::io::Result<Vec<TcpSocket>> {
    let seq = SEQ.fetch_add(1, Ordering::Relaxed);
    let mut flags = libc::NLM_F_REQUEST as u16;
    if dump {
        flags |= libc::NLM_F_DUMP as u16;
    }
    let hdr = NlMsgHdr {
        len: (std::mem::size_of::<NlMsgHdr>() + std::mem::size_of::<ReqV2>()) as u32,
        ty: SOCK_DIAG_BY_FAMILY,
        flags,
        seq,
        pid: 0,
    };
    let mut msg = Vec::with_capacity(hdr.len as usize);
    msg.extend_from_slice(as_bytes(&hdr));
    msg.extend_from_slice(as_bytes(&req));
    // SAFETY: send of our own buffer to the kernel (address: none, the
    // netlink socket's default destination is the kernel).
    let n = unsafe { libc::send(sock.as_raw_fd(), msg.as_ptr().cast(), msg.len(), 0) };
    if n < 0 {
        return Err(std::io::Error::last_os_error());
    }
    let mut out = Vec::new();
    // Not zeroed: the kernel writes what we read. One socket's answer is a
    // few hundred bytes; a dump's come in pages. (Zeroing 32 KiB per
    // request was a tenth of a listener's pairing under a burst.)
    let mut buf: Vec<u8> = Vec::with_capacity(if dump { 32 << 10 } else { 4 << 10 });
    loop {
        // SAFETY: recv into our own buffer's spare capacity, within it.
        let n = unsafe { libc::recv(sock.as_raw_fd(), buf.as_mut_ptr().cast(), buf.capacity(), 0) };
        if n < 0 {
            let e = std::io::Error::last_os_error();
            if e.kind() == std::io::ErrorKind::Interrupted {
                continue;
            }
            return Err(e);
        }
        // SAFETY: the kernel wrote the first `n` bytes (n <= capacity).
        unsafe { buf.set_len(n as usize) };
        let b = &buf[..];
        let mut at = 0;
        while let Some(h) = read_at::<NlMsgHdr>(b, at) {
            let len = h.len as usize;
            if len < std::mem::size_of::<NlMsgHdr>() || at + len > b.len() {
                return Err(std::io::Error::other("malformed sock_diag answer"));
            }
            let body = at + std::mem::size_of::<NlMsgHdr>();
            if h.seq != seq {
                // A late answer to an earlier request: not ours.
                at += len.next_multiple_of(4);
                continue;
            }
            match h.ty {
                NLMSG_DONE => return Ok(out),
                NLMSG_ERROR => {
                    let code = read_at::<i32>(b, body).unwrap_or(-libc::EIO);
                    if code == 0 {
                        return Ok(out);
                    }
                    return Err(std::io::Error::from_raw_os_error(-code));
                }
                SOCK_DIAG_BY_FAMILY => {
                    if let Some(m) = read_at::<DiagMsg>(b, body) {
                        out.push(TcpSocket {
                            local: addr_of(m.family, &m.id.src, m.id.sport),
                            remote: addr_of(m.family, &m.id.dst, m.id.dport),
                            uid: m.uid,
                            inode: m.inode,
                            cookie: u64::from(m.id.cookie[0]) | (u64::from(m.id.cookie[1]) << 32),
                            state: m.state,
                        });
                    }
                    if !dump {
                        return Ok(out);
                    }
                }
                _ => {}
            }
            at += len.next_multiple_of(4);
        }
    }
}

/// The socket whose local address is `local` and remote address is
/// `remote` (an established connection, or one the kernel is setting up,
/// or the last of the four-tuple, lingering in TIME_WAIT). Never the
/// listener on `local`, which the kernel answers with when it finds no
/// connection: a caller asking whether a connection was accepted would
/// read the listener's inode as a yes.
pub fn socket(
    local: SocketAddr,
    remote: SocketAddr,
    ns: Netns<'_>,
) -> std::io::Result<Option<TcpSocket>> {
    let (family, src) = addr_bytes(local.ip());
    let (f2, dst) = addr_bytes(remote.ip());
    if family != f2 {
        return Ok(None);
    }
    let req = ReqV2 {
        family,
        protocol: libc::IPPROTO_TCP as u8,
        states: !0,
        id: SockId {
            sport: local.port().to_be(),
            dport: remote.port().to_be(),
            src,
            dst,
            cookie: [NOCOOKIE, NOCOOKIE],
            ..SockId::default()
        },
        ..ReqV2::default()
    };
    match query(req, false, ns) {
        Ok(v) => Ok(v
            .into_iter()
            .find(|t| t.state != TCP_LISTEN as u8 && t.remote.port() == remote.port())),
        Err(e) if e.raw_os_error() == Some(libc::ENOENT) => Ok(None),
        Err(e) => Err(e),
    }
}

/// The far end of the connection of socket `fd`: the socket whose local
/// address is `fd`'s peer and whose remote address is `fd`'s own.
pub fn far_end(
    local: SocketAddr,
    peer: SocketAddr,
    ns: Netns<'_>,
) -> std::io::Result<Option<TcpSocket>> {
    socket(peer, local, ns)
}

/// The listening socket a connection to `dst` from this host reaches, as
/// the kernel's own lookup picks it (an exact address before a wildcard,
/// a dual-stack `[::]` for IPv4): one request, no dump. Asked as a
/// connection from port 0, which no connection has, so the kernel's lookup
/// falls back to the listener.
pub fn listener_reached(dst: SocketAddr, ns: Netns<'_>) -> std::io::Result<Option<TcpSocket>> {
    let (family, local) = addr_bytes(dst.ip());
    let req = ReqV2 {
        family,
        protocol: libc::IPPROTO_TCP as u8,
        states: 1 << TCP_LISTEN,
        id: SockId {
            sport: dst.port().to_be(),
            dport: 0,
            src: local,
            dst: local,
            cookie: [NOCOOKIE, NOCOOKIE],
            ..SockId::default()
        },
        ..ReqV2::default()
    };
    match query(req, false, ns) {
        Ok(v) => Ok(v.into_iter().find(|t| t.state == TCP_LISTEN as u8)),
        Err(e) if e.raw_os_error() == Some(libc::ENOENT) => Ok(None),
        Err(e) => Err(e),
    }
}

/// The sockets connected (or connecting) to TCP `port` anywhere on this
/// host, of both families: the client ends of connections to a listener
/// on `port`. Not those in TIME_WAIT, which no program holds.
pub fn connected_to(port: u16) -> std::io::Result<Vec<TcpSocket>> {
    let mut out = Vec::new();
    for family in [libc::AF_INET as u8, libc::AF_INET6 as u8] {
        let req = ReqV2 {
            family,
            protocol: libc::IPPROTO_TCP as u8,
            states: !((1 << TCP_LISTEN) | (1 << TCP_TIME_WAIT)),
            ..ReqV2::default()
        };
        match query(req, true, Netns::Here) {
            Ok(v) => out.extend(v.into_iter().filter(|s| s.remote.port() == port)),
            // A kernel without IPv6 has no such family to dump.
            Err(_) if family == libc::AF_INET6 as u8 => {}
            Err(e) => return Err(e),
        }
    }
    Ok(out)
}

/// The kernel's cookie of socket `fd` (`SO_COOKIE`).
pub fn cookie_of(fd: BorrowedFd<'_>) -> std::io::Result<u64> {
    sockopt_u64(fd, libc::SO_COOKIE)
}

/// Is `fd` a TCP socket? (`SO_PROTOCOL`)
pub fn is_tcp(fd: BorrowedFd<'_>) -> bool {
    let mut v: i32 = 0;
    let mut len = std::mem::size_of::<i32>() as libc::socklen_t;
    // SAFETY: getsockopt into our own int, within `len`.
    let r = unsafe {
        libc::getsockopt(
            fd.as_raw_fd(),
            libc::SOL_SOCKET,
            libc::SO_PROTOCOL,
            (&raw mut v).cast(),
            &mut len,
        )
    };
    r == 0 && v == libc::IPPROTO_TCP
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::net::{TcpListener, TcpStream};
    use std::os::fd::AsFd;

    #[test]
    fn the_kernel_names_both_ends_and_the_listener() {
        let l = TcpListener::bind("127.0.0.1:0").unwrap();
        let addr = l.local_addr().unwrap();
        let c = TcpStream::connect(addr).unwrap();
        let (s, _) = l.accept().unwrap();
        let (cl, sl) = (c.local_addr().unwrap(), s.local_addr().unwrap());
        let far = far_end(cl, c.peer_addr().unwrap(), Netns::Of(c.as_fd()))
            .unwrap()
            .unwrap();
        assert_eq!(far.cookie, cookie_of(s.as_fd()).unwrap());
        assert_eq!(far.uid, nix::unistd::getuid().as_raw());
        let far = far_end(sl, s.peer_addr().unwrap(), Netns::Here)
            .unwrap()
            .unwrap();
        assert_eq!(far.cookie, cookie_of(c.as_fd()).unwrap());
        assert_ne!(cookie_of(c.as_fd()).unwrap(), cookie_of(s.as_fd()).unwrap());
        let found = listener_reached(addr, Netns::Of(l.as_fd()))
            .unwrap()
            .unwrap();
        assert_eq!(found.cookie, cookie_of(l.as_fd()).unwrap());
        assert!(is_tcp(c.as_fd()));
        // No such connection.
        let nobody: SocketAddr = "127.0.0.1:1".parse().unwrap();
        assert_eq!(far_end(cl, nobody, Netns::Of(c.as_fd())).unwrap(), None);
        // Nor a connection to the listener from a port with none: the
        // kernel's lookup falls back to the listener, which is no answer.
        assert_eq!(socket(addr, nobody, Netns::Here).unwrap(), None);
        let own = socket(sl, cl, Netns::Of(s.as_fd())).unwrap().unwrap();
        assert_eq!(own.cookie, cookie_of(s.as_fd()).unwrap());
    }

    #[test]
    fn the_listener_reached_is_the_kernels_pick() {
        let cookie = |l: &TcpListener| cookie_of(l.as_fd()).unwrap();
        let reached = |a: SocketAddr| listener_reached(a, Netns::Here).unwrap().map(|l| l.cookie);
        // Where none of ours may answer: nothing, or a listener of another
        // test that took the same port meanwhile (the standard library
        // binds with SO_REUSEADDR), which must be listening, and not one
        // of `ours`.
        let none_of_ours = |a: SocketAddr, ours: &[u64]| {
            if let Some(l) = listener_reached(a, Netns::Here).unwrap() {
                assert_eq!(l.state, TCP_LISTEN as u8, "{a}: {l:?}");
                assert!(!ours.contains(&l.cookie), "{a}: {l:?}");
            }
        };
        // A wildcard reaches every local address; an exact one only its
        // own.
        let any = TcpListener::bind("0.0.0.0:0").unwrap();
        let port = any.local_addr().unwrap().port();
        assert_eq!(reached(([127, 0, 0, 1], port).into()), Some(cookie(&any)));
        assert_eq!(reached(([127, 0, 0, 2], port).into()), Some(cookie(&any)));
        let exact = TcpListener::bind("127.0.0.2:0").unwrap();
        let p2 = exact.local_addr().unwrap().port();
        assert_eq!(reached(([127, 0, 0, 2], p2).into()), Some(cookie(&exact)));
        none_of_ours(([127, 0, 0, 1], p2).into(), &[cookie(&exact)]);
        // A dual-stack [::] takes IPv4 connections too.
        if let Ok(six) = TcpListener::bind("[::]:0") {
            let p6 = six.local_addr().unwrap().port();
            assert_eq!(reached(([127, 0, 0, 1], p6).into()), Some(cookie(&six)));
            assert_eq!(
                reached(format!("[::1]:{p6}").parse().unwrap()),
                Some(cookie(&six))
            );
        }
        // Nobody listens: no answer, and never a connection. A test
        // that forks meanwhile holds copies of our descriptors until its
        // child execs, so a drop alone may leave them listening: shutting
        // a listener down stops it whoever holds it.
        let stop = |l: TcpListener| {
            nix::sys::socket::shutdown(l.as_raw_fd(), nix::sys::socket::Shutdown::Read).unwrap()
        };
        let gone = [cookie(&any), cookie(&exact)];
        stop(any);
        stop(exact);
        none_of_ours(([127, 0, 0, 1], port).into(), &gone);
        let l = TcpListener::bind("127.0.0.1:0").unwrap();
        let a = l.local_addr().unwrap();
        let c = TcpStream::connect(a).unwrap();
        let (s, _) = l.accept().unwrap();
        let ours = [
            cookie(&l),
            cookie_of(c.as_fd()).unwrap(),
            cookie_of(s.as_fd()).unwrap(),
        ];
        stop(l);
        none_of_ours(a, &ours);
    }

    #[test]
    fn the_kept_socket_answers_each_question_with_its_own_answer() {
        let l = TcpListener::bind("127.0.0.1:0").unwrap();
        let addr = l.local_addr().unwrap();
        let c = TcpStream::connect(addr).unwrap();
        let (s, _) = l.accept().unwrap();
        let here = Netns::Of(c.as_fd());
        // An answer nobody read, left in the kept socket (a query that
        // failed half-way): later questions must not take it for theirs.
        let _ = far_end(c.local_addr().unwrap(), addr, here).unwrap();
        if let Some(spare) = SPARE.lock().as_ref() {
            let req = ReqV2 {
                family: libc::AF_INET as u8,
                protocol: libc::IPPROTO_TCP as u8,
                states: !0,
                ..ReqV2::default()
            };
            let hdr = NlMsgHdr {
                len: (std::mem::size_of::<NlMsgHdr>() + std::mem::size_of::<ReqV2>()) as u32,
                ty: SOCK_DIAG_BY_FAMILY,
                flags: (libc::NLM_F_REQUEST | libc::NLM_F_DUMP) as u16,
                seq: 0,
                pid: 0,
            };
            let mut msg = as_bytes(&hdr).to_vec();
            msg.extend_from_slice(as_bytes(&req));
            // SAFETY: a send of our own buffer on the kept socket.
            let n = unsafe { libc::send(spare.fd.as_raw_fd(), msg.as_ptr().cast(), msg.len(), 0) };
            assert_eq!(n, msg.len() as isize);
        }
        for _ in 0..3 {
            let far = far_end(c.local_addr().unwrap(), addr, here)
                .unwrap()
                .unwrap();
            assert_eq!(far.cookie, cookie_of(s.as_fd()).unwrap());
            let back = far_end(s.local_addr().unwrap(), c.local_addr().unwrap(), here)
                .unwrap()
                .unwrap();
            assert_eq!(back.cookie, cookie_of(c.as_fd()).unwrap());
            let found = listener_reached(addr, here).unwrap().unwrap();
            assert_eq!(found.cookie, cookie_of(l.as_fd()).unwrap());
        }
    }

    #[test]
    fn a_thread_in_another_network_namespace_asks_there() {
        let l = TcpListener::bind("127.0.0.1:0").unwrap();
        let addr = l.local_addr().unwrap();
        // Fill the spare with this namespace's socket.
        assert!(
            listener_reached(addr, Netns::Of(l.as_fd()))
                .unwrap()
                .is_some()
        );
        let first_ns = l.as_raw_fd();
        let theirs = std::thread::spawn(move || {
            // SAFETY: moves only this thread to a new network namespace.
            if unsafe { libc::unshare(libc::CLONE_NEWNET) } != 0 {
                return None; // unprivileged: nothing to test
            }
            // Loopback is down in a new namespace; a listener still binds.
            let lo = TcpListener::bind("0.0.0.0:0").ok()?;
            let port = lo.local_addr().unwrap().port();
            let there: SocketAddr = ([127, 0, 0, 1], port).into();
            let mine = cookie_of(lo.as_fd()).unwrap();
            // The listener of the first namespace is not here...
            let first = listener_reached(addr, Netns::Of(lo.as_fd())).unwrap();
            // ...and this one is.
            let found = listener_reached(there, Netns::Of(lo.as_fd())).unwrap();
            // Last, a question asked from here, that this namespace
            // answers, but said to be about the first namespace's socket,
            // with no spare to take: the socket made here must not be kept
            // as the first namespace's (the look below would then ask here).
            drop(SPARE.lock().take());
            // SAFETY: the main thread's listener, open until we are joined.
            let l = unsafe { BorrowedFd::borrow_raw(first_ns) };
            assert!(listener_reached(there, Netns::Of(l)).unwrap().is_some());
            Some((first.map(|f| f.cookie), found.map(|f| f.cookie), mine))
        })
        .join()
        .unwrap();
        if let Some((first, found, mine)) = theirs {
            assert_ne!(first, Some(cookie_of(l.as_fd()).unwrap()));
            assert_eq!(found, Some(mine));
        }
        // And back here, the first namespace's listener again.
        let again = listener_reached(addr, Netns::Of(l.as_fd()))
            .unwrap()
            .unwrap();
        assert_eq!(again.cookie, cookie_of(l.as_fd()).unwrap());
    }
}
