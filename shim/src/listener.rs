//! The server side of pairing: a listener's registration, the offers that
//! clients send to it, and matching them with the connections `accept()`
//! returns.
//!
//! Nothing here waits on a client: `accept()` takes in what has arrived
//! (bounded work per call, non-blocking), matches, answers with one
//! non-blocking message and commits, or leaves the connection on TCP. The
//! offers a listener holds are bounded in all and per user, and expire on
//! their own: every pump drops those older than their deadline, whether or
//! not a connection was accepted.

use azsdp::sync::Lock;
use std::collections::HashMap;
use std::net::SocketAddr;
use std::os::fd::{AsFd, AsRawFd, FromRawFd, OwnedFd, RawFd};
use std::sync::Arc;
use std::sync::atomic::Ordering;
use std::time::{Duration, Instant};

use azsdp::config::Settings;
use azsdp::conn::Role;
use azsdp::fabric::shm::{recv_intro, send_intro};
use azsdp::identity::PeerId;
use azsdp::pairing::{Agreement, Intro, IntroKind, registry_name};
use azsdp::sock_diag;
use azsdp::stats::TcpReason;
use azsdp::transport::{Join, Transport};
use libc::c_int;

use crate::conn::Conn;
use crate::endpoint::AnyEndpoint;
use crate::log::{debug, info, warning};
use crate::net;

/// Registry connections taken in per pump (the rest wait in the kernel's
/// queue for the next one).
const ACCEPT_PER_PUMP: usize = 256;

/// A registry connection whose offer has not arrived yet.
struct Waiting {
    stream: OwnedFd,
    uid: u32,
    since: Instant,
}

/// A client's offer, checked as far as it can be before its connection is
/// accepted.
struct Offer {
    stream: OwnedFd,
    /// Who sent it (kernel credentials, pinned by pidfd).
    peer: PeerId,
    /// The uid the registry connection came from (SO_PEERCRED), counted
    /// against that user's quota.
    uid: u32,
    /// What the transport's offer carries.
    fds: Vec<OwnedFd>,
    page_size: u32,
    dst: SocketAddr,
    since: Instant,
}

#[derive(Default)]
struct Pending {
    waiting: Vec<Waiting>,
    /// By the cookie of the client's TCP socket (as the client claims it;
    /// checked at accept). Several offers may claim one cookie: a lie
    /// cannot push the true one out.
    offers: HashMap<u64, Vec<Offer>>,
}

impl Pending {
    fn len(&self) -> usize {
        self.waiting.len() + self.offers.values().map(Vec::len).sum::<usize>()
    }

    fn of_user(&self, uid: u32) -> usize {
        self.waiting.iter().filter(|w| w.uid == uid).count()
            + self
                .offers
                .values()
                .flatten()
                .filter(|o| o.uid == uid)
                .count()
    }
}

/// How many offers a listener holds at most, in all and from one user
/// other than its own and root (who could stop the server anyway): each
/// holds up to three descriptors, so the bound follows the descriptor limit.
#[derive(Clone, Copy, Debug)]
struct Limits {
    total: usize,
    per_other_user: usize,
    own_uid: u32,
}

impl Limits {
    fn for_this_process() -> Limits {
        let mut r = libc::rlimit {
            rlim_cur: 1024,
            rlim_max: 1024,
        };
        // SAFETY: getrlimit into our own struct.
        unsafe { libc::getrlimit(libc::RLIMIT_NOFILE, &mut r) };
        let total = (r.rlim_cur / 8).clamp(16, 4096) as usize;
        Limits {
            total,
            per_other_user: (total / 8).clamp(4, 256),
            // SAFETY: plain system call.
            own_uid: unsafe { libc::geteuid() },
        }
    }

    fn admits(&self, p: &Pending, uid: u32) -> bool {
        p.len() < self.total
            && (uid == self.own_uid || uid == 0 || p.of_user(uid) < self.per_other_user)
    }
}

/// A listening socket registered for pairing.
pub struct Listener {
    registry: OwnedFd,
    pub addr: SocketAddr,
    pub settings: Settings,
    limits: Limits,
    /// How long an offer or a silent registry connection is kept.
    expiry: Duration,
    pending: Lock<Pending>,
    /// Its RDMA listener, for clients on other hosts (or by rule).
    #[cfg(feature = "verbs")]
    verbs: Option<Arc<crate::verbs_pairing::VerbsAccepts>>,
}

#[cfg(feature = "verbs")]
impl Drop for Listener {
    fn drop(&mut self) {
        if let Some(v) = &self.verbs {
            v.stop();
        }
    }
}

fn os_err() -> std::io::Error {
    std::io::Error::last_os_error()
}

/// An abstract `SOCK_SEQPACKET` address (Linux's `sockaddr_un` with a
/// leading NUL) and its length.
pub fn abstract_addr(name: &str) -> Option<(libc::sockaddr_un, libc::socklen_t)> {
    // SAFETY: plain data; all-zero is valid.
    let mut a: libc::sockaddr_un = unsafe { std::mem::zeroed() };
    a.sun_family = libc::AF_UNIX as libc::sa_family_t;
    let b = name.as_bytes();
    if b.len() + 1 > a.sun_path.len() {
        return None;
    }
    for (i, &c) in b.iter().enumerate() {
        a.sun_path[i + 1] = c as libc::c_char;
    }
    let len = std::mem::size_of::<libc::sa_family_t>() + 1 + b.len();
    Some((a, len as libc::socklen_t))
}

/// A new non-blocking, close-on-exec Unix SEQPACKET socket.
pub fn seqpacket() -> std::io::Result<OwnedFd> {
    seqpacket_with(libc::SOCK_NONBLOCK)
}

/// A new close-on-exec Unix SEQPACKET socket with `flags`.
pub fn seqpacket_with(flags: c_int) -> std::io::Result<OwnedFd> {
    // SAFETY: plain system call.
    let fd = unsafe {
        crate::real::socket(
            libc::AF_UNIX,
            libc::SOCK_SEQPACKET | libc::SOCK_CLOEXEC | flags,
            0,
        )
    };
    if fd < 0 {
        return Err(os_err());
    }
    // SAFETY: a new descriptor we own.
    Ok(unsafe { OwnedFd::from_raw_fd(fd) })
}

/// The credentials (pid, effective uid) of the other end of a Unix socket.
pub fn peer_cred(fd: &impl AsRawFd) -> Option<(u32, u32)> {
    // SAFETY: plain data written by the kernel within `len`.
    let mut cred: libc::ucred = unsafe { std::mem::zeroed() };
    let mut len = std::mem::size_of::<libc::ucred>() as libc::socklen_t;
    // SAFETY: SO_PEERCRED into our own buffer.
    let r = unsafe {
        crate::real::getsockopt(
            fd.as_raw_fd(),
            libc::SOL_SOCKET,
            libc::SO_PEERCRED,
            (&raw mut cred).cast(),
            &mut len,
        )
    };
    (r == 0).then_some((cred.pid as u32, cred.uid))
}

/// Who holds the registry name `name` (a squatter, or another listener).
fn holder_of(name: &str) -> Option<(u32, u32)> {
    let (a, len) = abstract_addr(name)?;
    let s = seqpacket().ok()?;
    // SAFETY: connect with our own encoded address.
    let r = unsafe { crate::real::connect(s.as_raw_fd(), (&raw const a).cast(), len) };
    if r != 0 && std::io::Error::last_os_error().raw_os_error() != Some(libc::EINPROGRESS) {
        return None;
    }
    peer_cred(&s)
}

impl Listener {
    /// Register `addr` (the listening socket's own address). `None` if the
    /// name is taken (then this listener's connections stay on TCP, and the
    /// log says who holds it).
    pub fn register(addr: SocketAddr, settings: Settings) -> Option<Arc<Listener>> {
        let name = registry_name(addr);
        let (a, len) = abstract_addr(&name)?;
        let sock = match seqpacket() {
            Ok(s) => s,
            Err(e) => {
                info!("listener {addr}: no registry socket ({e}); its connections stay on TCP");
                return None;
            }
        };
        // SAFETY: bind and listen on our own socket with our own address.
        let r = unsafe {
            if crate::real::bind(sock.as_raw_fd(), (&raw const a).cast(), len) != 0 {
                -1
            } else {
                crate::real::listen(sock.as_raw_fd(), libc::SOMAXCONN)
            }
        };
        if r != 0 {
            let e = os_err();
            match holder_of(&name) {
                Some((pid, uid)) => warning!(
                    "listener {addr}: its pairing name @{name} is held by pid {pid} (uid {uid}); \
                     its connections stay on TCP, and clients that find the name are refused \
                     unless that user owns this listener ({e})"
                ),
                None => {
                    warning!(
                        "listener {addr}: cannot register @{name} ({e}); its connections stay on TCP"
                    )
                }
            }
            return None;
        }
        let expiry = (settings.pair_timeout * 2).max(Duration::from_secs(1));
        debug!("listener {addr} registered as @{name}");
        Some(Arc::new(Listener {
            registry: sock,
            addr,
            limits: Limits::for_this_process(),
            expiry,
            pending: Lock::new(Pending::default()),
            #[cfg(feature = "verbs")]
            verbs: (settings.fabric != azsdp::config::FabricChoice::Shm
                && !azsdp::sandbox::restricted())
            .then(|| crate::verbs_pairing::VerbsAccepts::start(addr, &settings))
            .flatten(),
            settings,
        }))
    }

    /// Take in, without waiting, what clients sent: new registry
    /// connections (up to [`ACCEPT_PER_PUMP`], within the quotas) and the
    /// offers that have arrived on those already taken. Drops what expired.
    /// Whether the registry's queue may hold more.
    fn pump(&self, p: &mut Pending) -> bool {
        let now = Instant::now();
        let expiry = self.expiry;
        p.waiting.retain(|w| now.duration_since(w.since) < expiry);
        p.offers.retain(|_, v| {
            v.retain(|o| now.duration_since(o.since) < expiry);
            !v.is_empty()
        });
        let mut saturated = true;
        for _ in 0..ACCEPT_PER_PUMP {
            // SAFETY: accept4 on our registry socket, without an address.
            let fd = unsafe {
                crate::real::accept4(
                    self.registry.as_raw_fd(),
                    std::ptr::null_mut(),
                    std::ptr::null_mut(),
                    libc::SOCK_NONBLOCK | libc::SOCK_CLOEXEC,
                )
            };
            if fd < 0 {
                // Nothing queued, or no descriptor to spare: next time.
                saturated = false;
                break;
            }
            // SAFETY: a new descriptor we own.
            let stream = unsafe { OwnedFd::from_raw_fd(fd as RawFd) };
            let Some((pid, uid)) = peer_cred(&stream) else {
                continue;
            };
            if !self.limits.admits(p, uid) {
                debug!(
                    "listener {}: refused a pairing connection from pid {pid} uid {uid}: \
                     {} pending, {} of that user (limits {} in all, {} per other user)",
                    self.addr,
                    p.len(),
                    p.of_user(uid),
                    self.limits.total,
                    self.limits.per_other_user
                );
                continue;
            }
            p.waiting.push(Waiting {
                stream,
                uid,
                since: now,
            });
        }
        for w in std::mem::take(&mut p.waiting) {
            match recv_intro(w.stream.as_fd(), IntroKind::Offer, true) {
                Ok((intro, r)) => {
                    let (Some(target), false) = (intro.pair, r.fds.is_empty()) else {
                        debug!(
                            "listener {}: an offer without its connection or segment",
                            self.addr
                        );
                        continue;
                    };
                    if target.dst.port() != self.addr.port() {
                        debug!(
                            "listener {}: an offer for {} is not ours",
                            self.addr, target.dst
                        );
                        continue;
                    }
                    p.offers.entry(target.cookie).or_default().push(Offer {
                        stream: w.stream,
                        peer: r.peer,
                        uid: w.uid,
                        fds: r.fds,
                        page_size: intro.page_size,
                        dst: target.dst,
                        since: w.since,
                    });
                }
                Err(e) if e.would_block() => p.waiting.push(w),
                Err(e) => debug!("listener {}: dropped a pairing message: {e}", self.addr),
            }
        }
        saturated
    }

    /// Take in what arrived and drop what expired, without waiting for the
    /// lock (the stats thread calls this ten times a second, so that a
    /// listener whose program is slow to accept keeps its registry queue
    /// moving and its offers bounded in time).
    pub fn maintain(&self) {
        if let Some(mut p) = self.pending.try_lock() {
            let _ = self.pump(&mut p);
        }
    }

    /// The offer for the connection whose client end is `far` (as the
    /// kernel describes it), if one is true: it claims that socket's
    /// cookie, and its sender is the user the kernel says owns the socket.
    fn take_offer(&self, p: &mut Pending, far: &sock_diag::TcpSocket) -> Option<Offer> {
        let v = p.offers.get_mut(&far.cookie)?;
        let i = v.iter().position(|o| o.peer.uid() == far.uid);
        let offer = i.map(|i| v.remove(i));
        for liar in v.drain(..) {
            warning!(
                "listener {}: pid {} (uid {}) offered to pair the connection of {} (uid {}); refused",
                self.addr,
                liar.peer.pid(),
                liar.peer.uid(),
                far.local,
                far.uid
            );
        }
        p.offers.remove(&far.cookie);
        offer
    }

    /// `accept()` returned the TCP connection `fd` from `peer` to `local`:
    /// upgrade it if its client offered to; otherwise why not.
    pub fn upgrade(
        &self,
        fd: c_int,
        local: SocketAddr,
        peer: SocketAddr,
        s: &Settings,
    ) -> Result<Arc<Conn>, TcpReason> {
        if azsdp::sandbox::restricted() {
            return Err(TcpReason::Sandboxed);
        }
        #[cfg(feature = "verbs")]
        if let Some(r) = self
            .verbs
            .as_ref()
            .and_then(|v| v.upgrade(fd, local, peer, s))
        {
            return r;
        }
        if !net::is_local(peer.ip()) {
            return Err(TcpReason::PeerRemote);
        }
        let offer = {
            let mut p = self.pending.lock();
            let mut more = self.pump(&mut p);
            if p.offers.is_empty() && !more {
                return Err(TcpReason::PeerNotAzsdp);
            }
            // The client end of this connection, as the kernel knows it.
            let far = match sock_diag::far_end(local, peer) {
                Ok(Some(far)) => far,
                Ok(None) => return Err(TcpReason::PeerNotAzsdp),
                Err(e) => {
                    debug!("{local} <- {peer}: sock_diag: {e}");
                    return Err(TcpReason::PeerUnverified);
                }
            };
            let mut offer = self.take_offer(&mut p, &far);
            // A client's offer is queued before its TCP connection exists:
            // if the queue was too long to take in at once (a flood), take
            // in what was queued before this connection (at most a full
            // backlog) and look again.
            let mut rounds = libc::SOMAXCONN as usize / ACCEPT_PER_PUMP + 1;
            while offer.is_none() && more && rounds > 0 {
                more = self.pump(&mut p);
                rounds -= 1;
                offer = self.take_offer(&mut p, &far);
            }
            offer
        };
        let Some(offer) = offer else {
            return Err(TcpReason::PeerNotAzsdp);
        };
        if s.use_ == azsdp::config::Use::Tcp {
            // Dropping the side channel tells the client at once.
            return Err(TcpReason::Rule);
        }
        if offer.dst.port() != local.port() {
            return Err(TcpReason::Mismatch);
        }
        let join = crate::conn::transport(s, fd).join(offer.fds).map_err(|e| {
            warning!(
                "{local} <- {peer}: pid {} offered a bad segment: {e}",
                offer.peer.pid()
            );
            TcpReason::SetupFailed
        })?;
        // Our answer proves to the client that we hold the accepted socket.
        // SAFETY: `fd` is the descriptor accept() just returned, open for
        // the duration of this call.
        let accepted = unsafe { std::os::fd::BorrowedFd::borrow_raw(fd) };
        let answer = Intro::new(IntroKind::Answer, azsdp::pages::system_page_size() as u32);
        let mut fds = vec![accepted];
        fds.extend(join.fds());
        if let Err(e) = send_intro(offer.stream.as_fd(), &answer, &fds, true) {
            debug!("{local} <- {peer}: the client left before our answer ({e})");
            return Err(TcpReason::PairTimeout);
        }
        // The pairing stream has done its work (dropped here): the
        // connection holds no descriptor of its own.
        let ep = join
            .into_endpoint(offer.peer, offer.page_size)
            .map_err(|e| {
                debug!("{local} <- {peer}: {e}");
                TcpReason::SetupFailed
            })?;
        // The last step that can fail: from here both sides are on azsdp.
        let word = azsdp::transport::Endpoint::agreement(&ep);
        if word
            .compare_exchange(
                Agreement::UNDECIDED,
                Agreement::COMMITTED,
                Ordering::AcqRel,
                Ordering::Acquire,
            )
            .is_err()
        {
            return Err(TcpReason::PairTimeout);
        }
        azsdp::futex::wake_all(word);
        Ok(Conn::start(
            AnyEndpoint::Shm(ep),
            fd,
            Role::Server,
            s,
            local,
            peer,
        ))
    }
}
