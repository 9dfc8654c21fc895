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
use std::os::fd::{AsFd, AsRawFd, BorrowedFd, FromRawFd, OwnedFd, RawFd};
use std::sync::Arc;
use std::sync::atomic::Ordering;
use std::time::{Duration, Instant};

use azsdp::config::Settings;
use azsdp::conn::Role;
use azsdp::fabric::shm::{recv_intro, recv_note, send_intro};
use azsdp::identity::PeerId;
use azsdp::pairing::{Agreement, BellNote, Intro, IntroKind, registry_name};
use azsdp::sock_diag::{self, Netns};
use azsdp::stats::TcpReason;
use azsdp::transport::{Join, Transport};
use libc::c_int;

use crate::conn::Conn;
use crate::endpoint::AnyEndpoint;
use crate::log::{debug, info, warning};
use crate::net;

/// The registry's queue in the kernel. A client that finds it full waits
/// a moment for room (`connect::find_listener`), then stays on TCP; a
/// short queue bounds that wait behind a flood (at [`IN_BACKGROUND`]'s
/// pace, under half a second).
/// Honest clients queue one connection each while they connect, so only
/// hundreds of clients connecting at the same instant find it full.
const REGISTRY_BACKLOG: c_int = 256;

/// How much registry work one pump may do: new pairing connections taken
/// in, and messages read from those already taken.
#[derive(Clone, Copy, Debug)]
struct Budget {
    accepts: usize,
    reads: usize,
}

/// One round within the program's `accept()`: more than the one pairing
/// connection each client makes, so that honest clients' offers keep
/// ahead of their TCP connections; the round stops at the offer of the
/// connection being accepted. In a pre-fork server each worker's
/// `accept()` takes from the one registry queue, which is in the order
/// the clients connected: offers taken in past one's own landed in the
/// worker that did not accept their connections, which stayed on TCP. A
/// flood of pairing connections costs `accept()` tens of microseconds (the
/// rest waits in the kernel's queue for the stats thread).
const IN_ACCEPT: Budget = Budget {
    accepts: 8,
    reads: 4,
};

/// Refused or useless connections and messages in one round of the stats
/// thread before it calls the queue flooded (more than a round of
/// [`IN_ACCEPT`] can see: only the stats thread decides).
const FLOOD_WASTE: usize = 16;

/// Refused descriptors kept for the stats thread to close, at most.
const DOOMED_MOST: usize = 128;
/// How long an offer must have waited, and then how long after its
/// connection was seen accepted, before it counts as another process's
/// (see `Pending::drop_accepted_elsewhere`).
const FOREIGN_AFTER: Duration = Duration::from_millis(100);
/// Offers looked up in the kernel per round of the stats thread.
const FOREIGN_LOOKS: usize = 8;

/// How long a flood found by one round counts.
const FLOODED_FOR: Duration = Duration::from_secs(1);

/// Rounds of [`IN_ACCEPT`] one `accept()` may take while the queue is not
/// flooded and this connection's offer is not in yet.
const IN_ACCEPT_ROUNDS: usize = 8;

/// From the stats thread, ten times a second, whether or not the program
/// accepts: it keeps the queue moving and the offers bounded in time. Each
/// refused connection costs a close, and a flood's closes free the memory
/// its messages carry: bounded, they take a few percent of a core.
const IN_BACKGROUND: Budget = Budget {
    accepts: 64,
    reads: 128,
};

/// Where a round of [`Listener::take_in`] stops reading offers.
#[derive(Clone, Copy, Debug)]
enum Until {
    /// The stats thread: takes in, reads what poll says is readable.
    Background,
    /// `accept()`, before it knows whether any offer is for its
    /// connection: reads at once, stops at the first offer that may be
    /// for the connection from this address (its note names it, or no
    /// note came yet).
    From(SocketAddr),
    /// `accept()`: reads at once, stops at the offer claiming this cookie
    /// (the far end of the connection accepted).
    Cookie(u64),
}

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
    /// What the transport's offer carries, and says of the client's bell.
    fds: Vec<OwnedFd>,
    bell: Option<BellNote>,
    page_size: u32,
    dst: SocketAddr,
    /// The cookie of the client's TCP socket, as the client claims it.
    cookie: u64,
    since: Instant,
    /// When a look found its connection accepted (by a process that is not
    /// this one, unless its `accept()` was about to take it).
    accepted_at: Option<Instant>,
    /// Where the connection comes from, as the client's note says
    /// (protocol §10): `None` until the note is read.
    from: Option<SocketAddr>,
}

impl Batch {
    /// Was the queue flooded: more left than a round takes in, and at
    /// least half of what it took, and at least [`FLOOD_WASTE`], refused or
    /// of no use? (An honest burst fills the queue with offers that are
    /// taken up; a few stray messages are no flood.)
    fn flooded(&self) -> bool {
        self.saturated && self.wasted >= FLOOD_WASTE && self.wasted * 2 >= self.taken
    }

    fn discard(&mut self, fds: impl IntoIterator<Item = OwnedFd>) {
        self.wasted += 1;
        if self.close_now {
            fds.into_iter().for_each(drop);
        } else {
            self.doomed.extend(fds);
        }
    }
}

impl Offer {
    /// Its descriptors, to close.
    fn into_fds(self) -> impl Iterator<Item = OwnedFd> {
        std::iter::once(self.stream).chain(self.fds)
    }

    /// Read the client's note if it came (one receive). `Err`: the client
    /// closed its stream, or sent what is no note of this offer's: the
    /// offer is no good.
    fn read_note(&mut self) -> Result<(), String> {
        if self.from.is_some() {
            return Ok(());
        }
        match recv_note(self.stream.as_fd(), IntroKind::Connected) {
            Ok(None) => Ok(()),
            Ok(Some(n)) => match n.pair {
                Some(t) if t.cookie == self.cookie => {
                    self.from = Some(t.dst);
                    Ok(())
                }
                _ => Err("a note for another connection".into()),
            },
            Err(e) => Err(e.to_string()),
        }
    }

    /// May this be the offer of the connection accepted from `peer`? Yes
    /// if its note names `peer` or has not come.
    fn may_be_from(&self, peer: SocketAddr) -> bool {
        self.from.is_none_or(|f| net::same_addr(f, peer))
    }
}

/// Notes read per `accept()` at most: a client that never sends its note
/// costs a look in the kernel, not a receive per held offer.
const NOTE_READS: usize = 8;

/// What one round of [`Listener::take_in`] took in.
#[derive(Default)]
struct Batch {
    /// Connections whose offer has not come yet.
    waiting: Vec<Waiting>,
    /// Offers that passed their format checks.
    offers: Vec<Offer>,
    /// Refused: to close outside the lock.
    doomed: Vec<OwnedFd>,
    /// Close what is refused at once instead (off the program's path:
    /// the stats thread, which holds no lock meanwhile).
    close_now: bool,
    /// The budget ran out with more queued.
    saturated: bool,
    /// Pairing connections taken from the queue, and how many of them
    /// were refused or said nothing of use.
    taken: usize,
    wasted: usize,
}

#[derive(Default)]
struct Pending {
    waiting: Vec<Waiting>,
    /// By the cookie of the client's TCP socket (as the client claims it;
    /// checked at accept). Several offers may claim one cookie: a lie
    /// cannot push the true one out.
    offers: HashMap<u64, Vec<Offer>>,
    /// Cookies of the client ends of accepted connections that stayed on
    /// TCP while their offer, if any, was still queued (behind a flood): an
    /// offer for one of them that comes in later is closed at once, so that
    /// its client goes on with TCP instead of waiting out `pair_timeout`.
    on_tcp: HashMap<u64, Instant>,
    /// What was refused or expired, closed by the stats thread outside the
    /// lock: closing a flood's connections frees the memory their messages
    /// carry, work that `accept()` should not do.
    doomed: Vec<OwnedFd>,
    /// Until when the queue counts as flooded (see [`Batch::flooded`]).
    flooded_until: Option<Instant>,
    /// The stats thread is taking in without the lock: the users of the
    /// waiting connections it took out, still counted against quotas.
    taking_in: Option<Vec<u32>>,
    /// The process that last called `accept()` on this listener, and when.
    /// Only that process takes in new pairing connections in the
    /// background: a parent that forked its workers, or a worker that
    /// stopped accepting, would take the offers of connections another
    /// process accepts, and those would stay on TCP.
    last_accept: Option<(u32, Instant)>,
}

impl Pending {
    /// May an offer held be the one of the connection accepted from
    /// `peer`? Reads the notes not yet read (up to [`NOTE_READS`]); an
    /// offer whose note is bad is closed. Without notes every accepted
    /// connection needs a look in the kernel while any offer is held, and a
    /// pre-fork server's workers each hold offers of connections their
    /// siblings accepted.
    fn may_hold(&mut self, peer: SocketAddr, addr: SocketAddr) -> bool {
        self.read_notes(NOTE_READS, |_| true, addr);
        self.offers.values().flatten().any(|o| o.may_be_from(peer))
    }

    /// Read the notes not yet read of up to `most` offers that `which`
    /// picks, and close the offers whose note is bad.
    fn read_notes(&mut self, most: usize, which: impl Fn(&Offer) -> bool, addr: SocketAddr) {
        let mut bad = Vec::new();
        let unread = self
            .offers
            .iter_mut()
            .flat_map(|(cookie, v)| v.iter_mut().enumerate().map(move |(i, o)| (*cookie, i, o)))
            .filter(|(_, _, o)| o.from.is_none() && which(o))
            .take(most);
        for (cookie, i, o) in unread {
            if let Err(e) = o.read_note() {
                debug!("listener {addr}: an offer closed: {e}");
                bad.push((cookie, i));
            }
        }
        self.remove_offers(bad);
    }

    /// Close the offers at (cookie, index).
    fn remove_offers(&mut self, mut at: Vec<(u64, usize)>) {
        // Highest index first, so that the others stay where they are.
        at.sort_unstable_by_key(|g| std::cmp::Reverse(g.1));
        for (cookie, i) in at {
            let Some(v) = self.offers.get_mut(&cookie) else {
                continue;
            };
            let o = v.remove(i);
            if v.is_empty() {
                self.offers.remove(&cookie);
            }
            self.doomed.extend(o.into_fds());
        }
    }

    fn len(&self) -> usize {
        self.waiting.len()
            + self.offers.values().map(Vec::len).sum::<usize>()
            + self.taking_in.as_ref().map_or(0, Vec::len)
    }

    /// Is the queue flooded (a round of the stats thread found it so
    /// within the last [`FLOODED_FOR`])?
    fn flooded(&self) -> bool {
        self.flooded_until.is_some_and(|t| Instant::now() < t)
    }

    /// What a round of the stats thread says of the queue: flooded for
    /// [`FLOODED_FOR`] from a round that finds it so (a flood's pace varies:
    /// a round that happens to drain it does not end it).
    fn note_round(&mut self, b: &Batch) {
        if b.flooded() {
            self.flooded_until = Some(Instant::now() + FLOODED_FOR);
        }
    }

    /// Drop (to [`Pending::doomed`]) what is older than `expiry`.
    fn expire(&mut self, expiry: Duration) {
        let now = Instant::now();
        let expired = self
            .waiting
            .extract_if(.., |w| now.duration_since(w.since) >= expiry);
        let expired: Vec<OwnedFd> = expired.map(|w| w.stream).collect();
        self.doomed.extend(expired);
        let mut old = Vec::new();
        for v in self.offers.values_mut() {
            old.extend(v.extract_if(.., |o| now.duration_since(o.since) >= expiry));
        }
        if !old.is_empty() {
            self.offers.retain(|_, v| !v.is_empty());
            self.doomed
                .extend(old.into_iter().flat_map(Offer::into_fds));
        }
        self.on_tcp
            .retain(|_, since| now.duration_since(*since) < expiry);
    }

    /// Close the offers whose connections another process accepted: a
    /// listener shared after a fork (a server whose children accept) may
    /// have taken in the offer of a connection its child accepts, and
    /// that child, not finding it, keeps the connection on TCP; without
    /// this, the client would wait out `pair_timeout` for an answer that
    /// cannot come. An offer held [`FOREIGN_AFTER`] after a look found its
    /// connection accepted (the kernel gave it an inode) was not this
    /// process's to take: its own `accept()` matches within microseconds.
    /// At most [`FOREIGN_LOOKS`] offers are looked up per round.
    fn drop_accepted_elsewhere(&mut self, addr: SocketAddr) {
        let now = Instant::now();
        let due =
            |o: &Offer| o.accepted_at.is_none() && now.duration_since(o.since) >= FOREIGN_AFTER;
        let (mut any_due, mut any_seen) = (false, false);
        for o in self.offers.values().flatten() {
            any_due |= due(o);
            any_seen |= o.accepted_at.is_some();
        }
        if !any_due && !any_seen {
            return;
        }
        self.read_notes(usize::MAX, due, addr);
        let any_unnoted = self
            .offers
            .values()
            .flatten()
            .any(|o| due(o) && o.from.is_none());
        // An offer's note says where its connection comes from. Without
        // one, the kernel's list of the sockets connected to this
        // listener's port says which client port each cookie has (a dump,
        // at most once a round, and only while such an offer has waited
        // this long).
        let port_of: HashMap<u64, SocketAddr> = if any_unnoted {
            sock_diag::connected_to(addr.port())
                .unwrap_or_default()
                .iter()
                .map(|c| (c.cookie, c.local))
                .collect()
        } else {
            HashMap::new()
        };
        let mut looks = 0;
        let mut gone = Vec::new();
        for (cookie, v) in self.offers.iter_mut() {
            for (i, o) in v.iter_mut().enumerate() {
                if let Some(at) = o.accepted_at {
                    if now.duration_since(at) >= FOREIGN_AFTER {
                        gone.push((*cookie, i));
                    }
                    continue;
                }
                if !due(o) || looks >= FOREIGN_LOOKS {
                    continue;
                }
                // Not connected (yet, or any more): nothing to look up.
                let Some(client) = o.from.as_ref().or_else(|| port_of.get(&o.cookie)) else {
                    continue;
                };
                looks += 1;
                // Accepted: it has an inode (a file), or this end is
                // closing it (FIN_WAIT1/2, LAST_ACK, CLOSING), which only a
                // process that accepted it can do. Not TIME_WAIT: an
                // earlier connection of the same four-tuple lingers there
                // (ten thousand connections in a row reuse client ports).
                let accepted = sock_diag::socket(o.dst, *client, Netns::Here).is_ok_and(|t| {
                    t.is_some_and(|t| t.inode != 0 || matches!(t.state, 4 | 5 | 9 | 11))
                });
                if accepted {
                    o.accepted_at = Some(now);
                }
            }
        }
        for (cookie, _) in &gone {
            debug!(
                "listener {addr}: the connection of cookie {cookie} was accepted by another \
                 process; its offer closed"
            );
        }
        self.remove_offers(gone);
    }

    /// Take the waiting connections out for [`Listener::take_in`], with
    /// what is held in all and per user counted before (they still count
    /// against the quotas while out).
    fn take_waiting(&mut self) -> (Vec<Waiting>, HashMap<u32, usize>, usize) {
        let (counts, held) = (self.counts(), self.len());
        (std::mem::take(&mut self.waiting), counts, held)
    }

    /// Put back what [`Listener::take_in`] took in (its admissions were
    /// counted against what was held when its `waiting` was taken out).
    fn merge(&mut self, b: Batch, addr: SocketAddr) {
        self.waiting.extend(b.waiting);
        self.doomed.extend(b.doomed);
        for o in b.offers {
            if self.on_tcp.contains_key(&o.cookie) {
                debug!(
                    "listener {addr}: an offer came after its connection was accepted on TCP; closed"
                );
                self.doomed.extend(o.into_fds());
            } else {
                self.offers.entry(o.cookie).or_default().push(o);
            }
        }
        if self.doomed.len() > DOOMED_MOST {
            // The stats thread is late (a loaded host): close the excess
            // here rather than let a flood hold descriptors.
            self.doomed.truncate(DOOMED_MOST);
        }
    }

    /// The offers that claim `cookie`, no longer held.
    fn take_cookie(&mut self, cookie: u64) -> Vec<Offer> {
        self.offers.remove(&cookie).unwrap_or_default()
    }

    /// How many of each user's connections and offers are held.
    fn counts(&self) -> HashMap<u32, usize> {
        let mut c = HashMap::new();
        let uids = self.waiting.iter().map(|w| w.uid);
        let taken = self.taking_in.iter().flatten().copied();
        for uid in uids
            .chain(self.offers.values().flatten().map(|o| o.uid))
            .chain(taken)
        {
            *c.entry(uid).or_default() += 1;
        }
        c
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

    /// May one more be held, with `held` in all and `of_user` of `uid`'s?
    fn admits(&self, held: usize, of_user: usize, uid: u32) -> bool {
        held < self.total && (uid == self.own_uid || uid == 0 || of_user < self.per_other_user)
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

/// Split `waiting` into up to `most` connections that have something to
/// read (a message, or the close) and the rest, with one `poll`.
fn readable_first(waiting: Vec<Waiting>, most: usize) -> (Vec<Waiting>, Vec<Waiting>) {
    if waiting.is_empty() || most == 0 {
        return (Vec::new(), waiting);
    }
    let mut fds: Vec<libc::pollfd> = waiting
        .iter()
        .map(|w| libc::pollfd {
            fd: w.stream.as_raw_fd(),
            events: libc::POLLIN,
            revents: 0,
        })
        .collect();
    // SAFETY: poll over our own array of pollfds, with no wait.
    let n = unsafe { crate::real::poll(fds.as_mut_ptr(), fds.len() as libc::nfds_t, 0) };
    if n <= 0 {
        return (Vec::new(), waiting);
    }
    let mut ready = Vec::new();
    let mut idle = Vec::with_capacity(waiting.len());
    for (w, f) in waiting.into_iter().zip(&fds) {
        if f.revents != 0 && ready.len() < most {
            ready.push(w);
        } else {
            idle.push(w);
        }
    }
    (ready, idle)
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
                crate::real::listen(sock.as_raw_fd(), REGISTRY_BACKLOG)
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

    /// Take in, without waiting and within `budget`, what clients sent: new
    /// registry connections (within the quotas) and the offers that have
    /// arrived on those already `waiting` (only the readable ones are
    /// read). Needs no lock: `held` and `counts` are what `Pending` held
    /// when `waiting` was taken out of it.
    fn take_in(
        &self,
        waiting: Vec<Waiting>,
        mut counts: HashMap<u32, usize>,
        held: usize,
        budget: Budget,
        close_now: bool,
        until: Until,
    ) -> Batch {
        let now = Instant::now();
        let mut b = Batch {
            // Until the queue is found empty (unknown with no accepts).
            saturated: budget.accepts > 0,
            close_now,
            ..Batch::default()
        };
        let mut fresh = Vec::new();
        for _ in 0..budget.accepts {
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
                b.saturated = false;
                break;
            }
            // SAFETY: a new descriptor we own.
            let stream = unsafe { OwnedFd::from_raw_fd(fd as RawFd) };
            b.taken += 1;
            let Some((pid, uid)) = peer_cred(&stream) else {
                b.discard([stream]);
                continue;
            };
            let mine = counts.entry(uid).or_default();
            if !self.limits.admits(held + fresh.len(), *mine, uid) {
                debug!(
                    "listener {}: refused a pairing connection from pid {pid} uid {uid}: \
                     {} pending, {} of that user (limits {} in all, {} per other user)",
                    self.addr,
                    held + fresh.len(),
                    *mine,
                    self.limits.total,
                    self.limits.per_other_user
                );
                b.discard([stream]);
                continue;
            }
            *mine += 1;
            let w = Waiting {
                stream,
                uid,
                since: now,
            };
            // Read at once, and stop at the offer of the connection being
            // accepted: the ones behind it are for other `accept()`s,
            // perhaps in other processes (see [`IN_ACCEPT`]).
            if let Until::Background = until {
                fresh.push(w);
                continue;
            }
            let taken = b.offers.len();
            self.read_offer(w, &mut b);
            let stop = b.offers[taken..].iter().any(|o| match until {
                Until::Cookie(c) => o.cookie == c,
                Until::From(peer) => o.may_be_from(peer),
                Until::Background => false,
            });
            if stop {
                break;
            }
        }
        // A new connection's offer is usually queued already (a client
        // sends it right after connecting): read those at once; of the
        // older ones, only what poll says is readable.
        let (readable, idle) = readable_first(waiting, budget.reads);
        b.waiting.extend(idle);
        for w in fresh.into_iter().chain(readable) {
            self.read_offer(w, &mut b);
        }
        b
    }

    /// Read the offer of registry connection `w` into `b` (or keep `w`
    /// waiting for it, or refuse it).
    fn read_offer(&self, w: Waiting, b: &mut Batch) {
        match recv_intro(w.stream.as_fd(), IntroKind::Offer, true) {
            Ok((intro, r)) => {
                let why = match intro.pair {
                    _ if r.fds.is_empty() => "carries no segment",
                    None => "names no connection",
                    Some(t) if t.dst.port() != self.addr.port() => "is for another port",
                    Some(target) => {
                        let mut o = Offer {
                            stream: w.stream,
                            peer: r.peer,
                            uid: w.uid,
                            fds: r.fds,
                            bell: intro.bell,
                            page_size: intro.page_size,
                            dst: target.dst,
                            cookie: target.cookie,
                            since: w.since,
                            accepted_at: None,
                            from: None,
                        };
                        // Its note is usually in too (the client sends it
                        // right after its `connect()`).
                        match o.read_note() {
                            Ok(()) => b.offers.push(o),
                            Err(e) => {
                                debug!("listener {}: an offer closed: {e}", self.addr);
                                b.discard(o.into_fds());
                            }
                        }
                        return;
                    }
                };
                debug!("listener {}: an offer that {why}; closed", self.addr);
                b.discard(std::iter::once(w.stream).chain(r.fds));
            }
            Err(e) if e.would_block() => b.waiting.push(w),
            Err(e) => {
                debug!("listener {}: dropped a pairing message: {e}", self.addr);
                b.discard([w.stream]);
            }
        }
    }

    /// [`Listener::take_in`] with the lock held throughout (the program's
    /// `accept()`, which must see what it takes in), stopping at `until`.
    /// Whether the registry's queue may hold more.
    fn pump(&self, p: &mut Pending, budget: Budget, until: Until) -> bool {
        let (waiting, counts, held) = p.take_waiting();
        let b = self.take_in(waiting, counts, held, budget, false, until);
        let saturated = b.saturated;
        p.merge(b, self.addr);
        saturated
    }

    /// Take in what arrived and drop what expired (the stats thread calls
    /// this ten times a second, so that a listener whose program is slow to
    /// accept keeps its registry queue moving and its offers bounded in
    /// time). In a flood, the lock is held only to take out and put back,
    /// never across a system call, so the program's `accept()` never waits
    /// for this; otherwise a round is short and holds it throughout, so
    /// that `accept()` always sees every offer taken in.
    pub fn maintain(&self) {
        let Some(mut p) = self.pending.try_lock() else {
            return;
        };
        p.expire(self.expiry);
        let accepting = p.last_accept.is_some_and(|(pid, at)| {
            pid == azsdp::process::pid() && at.elapsed() < Duration::from_secs(1)
        });
        let budget = Budget {
            accepts: if accepting { IN_BACKGROUND.accepts } else { 0 },
            ..IN_BACKGROUND
        };
        if !p.flooded() {
            let (waiting, counts, held) = p.take_waiting();
            let b = self.take_in(waiting, counts, held, budget, false, Until::Background);
            p.note_round(&b);
            p.merge(b, self.addr);
            p.drop_accepted_elsewhere(self.addr);
            let doomed = std::mem::take(&mut p.doomed);
            drop(p);
            drop(doomed);
            return;
        }
        let (waiting, counts, held) = p.take_waiting();
        p.taking_in = Some(waiting.iter().map(|w| w.uid).collect());
        let doomed = std::mem::take(&mut p.doomed);
        drop(p);
        drop(doomed);
        let b = self.take_in(waiting, counts, held, budget, true, Until::Background);
        let mut p = self.pending.lock();
        p.note_round(&b);
        p.taking_in = None;
        p.merge(b, self.addr);
    }

    /// The offer for the connection whose client end is `far` (as the
    /// kernel describes it), if one is true: it claims that socket's
    /// cookie, and its sender is the user the kernel says owns the socket.
    /// Every other offer that claims the cookie is a lie.
    fn take_offer(&self, p: &mut Pending, far: &sock_diag::TcpSocket) -> Option<Offer> {
        let mut v = p.take_cookie(far.cookie);
        let i = v.iter().position(|o| o.peer.uid() == far.uid);
        let offer = i.map(|i| v.remove(i));
        for liar in v {
            warning!(
                "listener {}: pid {} (uid {}) offered to pair the connection of {} (uid {}); refused",
                self.addr,
                liar.peer.pid(),
                liar.peer.uid(),
                far.local,
                far.uid
            );
            p.doomed.extend(liar.into_fds());
        }
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
            p.last_accept = Some((azsdp::process::pid(), Instant::now()));
            // A client's offer is queued before its TCP connection exists,
            // so it is usually in by now (taken in by an earlier accept(),
            // or by this one's few reads). While the queue is flooded,
            // accept() reads none: the stats thread drains the flood, this
            // connection stays on TCP, and its offer is closed when it
            // comes in, so that its client stops waiting.
            let flooded = p.flooded();
            if !flooded {
                p.expire(self.expiry);
            }
            // The client end of this connection, as the kernel knows it:
            // asked for only once an offer is held (a plain client's
            // connection costs no lookup).
            let mut far: Option<sock_diag::TcpSocket> = None;
            // SAFETY: `fd` is the socket accept() just returned, open for
            // this call.
            let here = Netns::Of(unsafe { BorrowedFd::borrow_raw(fd) });
            let mut more = false;
            for round in 0..=IN_ACCEPT_ROUNDS {
                if far.is_none() && !p.offers.is_empty() && p.may_hold(peer, self.addr) {
                    far = match sock_diag::far_end(local, peer, here) {
                        Ok(Some(far)) => Some(far),
                        Ok(None) => return Err(TcpReason::PeerNotAzsdp),
                        Err(e) => {
                            debug!("{local} <- {peer}: sock_diag: {e}");
                            return Err(TcpReason::PeerUnverified);
                        }
                    };
                }
                let cookie = far.map(|f| f.cookie);
                if cookie.is_some_and(|c| p.offers.contains_key(&c))
                    || flooded
                    || round == IN_ACCEPT_ROUNDS
                    || (round > 0 && !more)
                {
                    break;
                }
                // In an honest burst the queue may hold many offers ahead
                // of this one, each wanted by a later accept(): take them
                // in until this one is among them.
                let until = cookie.map_or(Until::From(peer), Until::Cookie);
                more = self.pump(&mut p, IN_ACCEPT, until);
            }
            let ours = far.filter(|f| p.offers.contains_key(&f.cookie));
            let Some(far) = ours else {
                // Its offer may be queued still, or in the stats thread's
                // hands: if it comes, it is closed.
                let unseen = more || flooded || p.taking_in.is_some();
                if unseen && p.on_tcp.len() < self.limits.total {
                    let cookie = far.map(|f| f.cookie).or_else(|| {
                        sock_diag::far_end(local, peer, here)
                            .ok()
                            .flatten()
                            .map(|f| f.cookie)
                    });
                    if let Some(c) = cookie {
                        debug!(
                            "{local} <- {peer}: its offer, if any, is still queued behind \
                             others; the connection stays on TCP"
                        );
                        p.on_tcp.insert(c, Instant::now());
                    }
                }
                return Err(TcpReason::PeerNotAzsdp);
            };
            self.take_offer(&mut p, &far)
        };
        let Some(mut offer) = offer else {
            return Err(TcpReason::PeerNotAzsdp);
        };
        // Its note, if it came, is read now: a stream closed with it unread
        // (after our answer) tells the client of a reset before the answer
        // (which it then reads all the same, `pending::recv_answer`).
        let _ = offer.read_note();
        if s.use_ == azsdp::config::Use::Tcp {
            // Dropping the side channel tells the client at once.
            return Err(TcpReason::Rule);
        }
        if offer.dst.port() != local.port() {
            return Err(TcpReason::Mismatch);
        }
        let join = crate::conn::transport(s, fd);
        let join = join.join(offer.bell, &offer.peer, offer.fds).map_err(|e| {
            warning!(
                "{local} <- {peer}: pid {} made an offer we cannot take up: {e}",
                offer.peer.pid()
            );
            TcpReason::SetupFailed
        })?;
        // Our answer proves to the client that we hold the accepted socket.
        // SAFETY: `fd` is the descriptor accept() just returned, open for
        // the duration of this call.
        let accepted = unsafe { std::os::fd::BorrowedFd::borrow_raw(fd) };
        let answer = Intro {
            bell: join.note(),
            ..Intro::new(IntroKind::Answer, azsdp::pages::system_page_size() as u32)
        };
        let mut fds = vec![accepted];
        fds.extend(join.fds());
        if let Err(e) = send_intro(offer.stream.as_fd(), &answer, &fds, true) {
            debug!("{local} <- {peer}: the client left before our answer ({e})");
            return Err(TcpReason::PairTimeout);
        }
        let said = |b: Option<BellNote>| match b {
            Some(b) if b.held => "named",
            _ => "passed",
        };
        debug!(
            "{local} <- {peer}: bells: pid {}'s {}, ours {}",
            offer.peer.pid(),
            said(offer.bell),
            said(answer.bell)
        );
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
            // Begun on TCP: the client may have sent on it already; we
            // join once it has (`crate::join`).
            Some(crate::join::Joining::new(true, 0)),
        ))
    }
}
