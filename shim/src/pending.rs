//! A client's pair under way: `connect()` returned the kernel's connection
//! at once, and the program uses it as TCP while the listener answers
//! (docs/shim.md, "Pairing").
//!
//! The reactor starts the connection's engine as soon as the listener
//! committed, so that the handshake is over by the program's first call.
//! The pair completes at the start of one of the program's calls on the
//! socket, when no other call of this process is on it: then no thread
//! sleeps in the kernel on the socket alone (polls over it are the shim's
//! while the pair is under way), and the count of what went over TCP is
//! final. The connection then joins the fabric (`crate::join`): the
//! listener's side, which waits for our JOIN before it sends on the
//! fabric, sends on TCP until then. A pair the listener has not committed
//! to within `pair_timeout` is withdrawn (by the stats thread too, so no
//! call waits for it); one it committed to completes at the program's next
//! call, however late. A fork while the pair is under way keeps the
//! connection on TCP: the processes could not agree on what went there.

use std::net::SocketAddr;
use std::os::fd::{AsFd, AsRawFd, OwnedFd};
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Weak};
use std::time::Instant;

use azsdp::config::Settings;
use azsdp::conn::Role as EngineRole;
use azsdp::driver::reactor::{Next, Reactor, Registration, Serviced, Wake};
use azsdp::fabric::shm::recv_intro;
use azsdp::identity::Received;
use azsdp::pairing::{Agreement, Intro, IntroKind};
use azsdp::stats::TcpReason;
use azsdp::sync::Lock;
use azsdp::transport::{Offer, Transport};
use libc::c_int;

use crate::conn::{Active, Conn, Prepared, TcpConn};
use crate::endpoint::AnyEndpoint;
use crate::log::{debug, info, warning};
use crate::sock::{Role, Sock};

type ActiveOffer = <Active as Transport>::Offer;

/// Forks of this process (the hook counts them before the fork, so both
/// processes see the new count).
static FORKS: AtomicU64 = AtomicU64::new(0);

/// Pairs of this process still under way (undecided).
static UNDECIDED: AtomicUsize = AtomicUsize::new(0);

/// Is a pair under way in this process? (Polls over its sockets are the
/// shim's then, even before any connection is upgraded.) Asked before
/// `process::active()`: a pair stops counting here only once its
/// connection counts there (Release/Acquire), so one of the two holds.
pub fn any() -> bool {
    UNDECIDED.load(Ordering::Acquire) > 0
}

/// Forks of this process so far (and of the one it was forked from).
pub fn forks() -> u64 {
    FORKS.load(Ordering::SeqCst)
}

/// A fork is about to happen.
pub fn forking() {
    FORKS.fetch_add(1, Ordering::SeqCst);
}

/// Pairs under way, for the stats thread's expiry.
static UNDER_WAY: Lock<Vec<(Weak<Pending>, Weak<Sock>)>> = Lock::new(Vec::new());

/// What went over the TCP socket while the pair was under way.
#[derive(Default)]
pub struct Counts {
    pub sent: AtomicU64,
    pub taken: AtomicU64,
    /// The program's calls on the socket now (each holds a [`Ticket`]
    /// from before it chose TCP until it is over).
    pub busy: AtomicUsize,
    /// The thread completing the pair (0: none). With `busy`, a gate: the
    /// completion raises it, then looks for calls; a call counts itself,
    /// then looks for a completion. Whichever comes second backs off, so
    /// no call moves bytes on TCP after the completion took the counts.
    completing: std::sync::atomic::AtomicI32,
}

/// A call's place on the TCP socket of a pair under way: the pair does
/// not complete while it is held (see [`Counts`]).
pub struct Ticket(Arc<TcpConn>);

impl Drop for Ticket {
    fn drop(&mut self) {
        if let Some(c) = self.0.counts() {
            c.busy.fetch_sub(1, Ordering::SeqCst);
        }
    }
}

/// A decided pair still counted as under way (see
/// [`Pending::decide_later`]).
struct StillCounted;

impl Drop for StillCounted {
    fn drop(&mut self) {
        UNDECIDED.fetch_sub(1, Ordering::Release);
    }
}

/// The completion's side of the gate: lowered when dropped.
struct Completing<'a>(&'a Counts);

impl Completing<'_> {
    /// Raise the gate; `None` if a call holds the socket.
    fn raise(c: &Counts) -> Option<Completing<'_>> {
        c.completing
            .store(azsdp::sync::tid().max(1), Ordering::SeqCst);
        if c.busy.load(Ordering::SeqCst) > 0 {
            c.completing.store(0, Ordering::SeqCst);
            return None;
        }
        Some(Completing(c))
    }
}

impl Drop for Completing<'_> {
    fn drop(&mut self) {
        self.0.completing.store(0, Ordering::SeqCst);
    }
}

/// Bytes the program moved, and what it was doing, while the pair of its
/// socket was under way.
struct Parts {
    /// The listener's registration, until its answer is in.
    reg: Option<OwnedFd>,
    /// The offer, until the reactor makes the endpoint of it.
    offer: Option<ActiveOffer>,
    /// The answer, once in (it may come before the listener's commit).
    answer: Option<(Intro, Received)>,
    /// What the reactor made of a committed pair (`intake`), for the
    /// program's next call: the connection, started (its HELLO went), or
    /// why there is none.
    made: Option<Result<Prepared, TcpReason>>,
}

impl Parts {
    /// Has the listener committed (or is that past deciding)?
    fn agreement(&self) -> u32 {
        self.offer.as_ref().map_or(Agreement::COMMITTED, |o| {
            o.agreement().load(Ordering::Acquire)
        })
    }

    /// Withdraw from the pair; false if the listener committed.
    fn withdraw(&self) -> bool {
        self.offer.as_ref().is_some_and(|o| withdraw(o.agreement()))
    }

    /// Give up a pair the listener may have committed to: its engine sees
    /// us leave.
    fn abandon(self) {
        if let Some(o) = self.offer {
            o.abandon();
        }
        // (A connection prepared already closes its side as it drops: the
        // listener's engine, which nothing joined, stays on TCP.)
    }
}

thread_local! {
    /// Registrations whose answer the reactor took in: closed at its next
    /// service, once it stopped watching them (a descriptor closed while
    /// still in its set could be reused, and removed by mistake).
    static SPENT: std::cell::RefCell<Vec<OwnedFd>> = const { std::cell::RefCell::new(Vec::new()) };
}

pub struct Pending {
    parts: Lock<Option<Parts>>,
    /// The connection as TCP meanwhile (stats, and the counts).
    pub tcp: Arc<TcpConn>,
    dst: SocketAddr,
    settings: Settings,
    deadline: Instant,
    forks: u64,
    /// The process that made the offer: only it speaks for the pair (a
    /// forked child's copy is inert, and stays TCP).
    pid: u32,
    decided: AtomicBool,
    /// The program's descriptor when it connected, and its socket: the
    /// reactor checks the answer against them (`intake`).
    fd: c_int,
    /// Our end's address, for the log.
    local: Option<SocketAddr>,
    sock: Weak<Sock>,
    /// The reactor's watch of the registration, while the answer is due.
    watch: Lock<Option<Registration>>,
}

/// The listener's answer, if it came. A listener that closes the stream
/// before reading the client's note (protocol §10) leaves a reset that the
/// kernel reports before the answer queued ahead of it: the reset is read
/// once, and the answer after it.
fn recv_answer(
    reg: std::os::fd::BorrowedFd<'_>,
) -> Result<(Intro, Received), azsdp::fabric::shm::IntroError> {
    match recv_intro(reg, IntroKind::Answer, true) {
        Err(e) if e.raw_os_error() == Some(libc::ECONNRESET) => {
            recv_intro(reg, IntroKind::Answer, true)
        }
        r => r,
    }
}

impl Pending {
    /// The offer went to the listener `reg` and the kernel's connect was
    /// made (or is under way).
    pub fn start(
        sock: &Arc<Sock>,
        fd: c_int,
        reg: OwnedFd,
        offer: ActiveOffer,
        dst: SocketAddr,
        local: Option<SocketAddr>,
        settings: &Settings,
    ) -> Arc<Pending> {
        let tcp = TcpConn::pairing(local, Some(dst));
        let reg_fd = reg.as_raw_fd();
        let p = Arc::new(Pending {
            parts: Lock::new(Some(Parts {
                reg: Some(reg),
                offer: Some(offer),
                answer: None,
                made: None,
            })),
            tcp,
            dst,
            settings: settings.clone(),
            deadline: Instant::now() + settings.pair_timeout,
            forks: FORKS.load(Ordering::SeqCst),
            pid: azsdp::process::pid(),
            decided: AtomicBool::new(false),
            fd,
            local,
            sock: Arc::downgrade(sock),
            watch: Lock::new(None),
        });
        // The reactor takes the answer in as it comes, so that a pair
        // holds no descriptor but the socket while the program has not
        // called yet (ten thousand connects in a row). Without a reactor
        // (a sandbox), the program's next call does.
        if let Ok(r) = Reactor::get() {
            let weak: Weak<dyn Serviced> = Arc::downgrade(&p) as Weak<Pending>;
            if let Ok(w) = r.register_watching(weak, &[reg_fd]) {
                *p.watch.lock() = Some(w);
            }
        }
        UNDER_WAY
            .lock()
            .push((Arc::downgrade(&p), Arc::downgrade(sock)));
        UNDECIDED.fetch_add(1, Ordering::Relaxed);
        crate::runtime::start_publisher();
        p
    }

    /// At a call's start: complete the pair if it can be now. The
    /// connection it became, if it did.
    pub fn try_complete(&self, sock: &Arc<Sock>, fd: c_int) -> Option<Arc<Conn>> {
        if self.decided.load(Ordering::Acquire) {
            return None;
        }
        if FORKS.load(Ordering::SeqCst) != self.forks {
            self.give_up(sock, TcpReason::Forked);
            return None;
        }
        let counts = self.tcp.counts()?;
        if counts.busy.load(Ordering::SeqCst) > 0 {
            return None;
        }
        let mut guard = self.parts.lock();
        let parts = guard.as_mut()?;
        if parts.made.is_none()
            && parts.answer.is_none()
            && let Some(reg) = parts.reg.as_ref()
        {
            match recv_answer(reg.as_fd()) {
                Ok(a) => parts.answer = Some(a),
                Err(e) if e.would_block() => {
                    let late = Instant::now() >= self.deadline;
                    drop(guard);
                    if late {
                        self.give_up(sock, TcpReason::PairTimeout);
                    }
                    return None;
                }
                Err(e) => {
                    debug!("connect {}: no upgrade ({e})", self.dst);
                    drop(guard);
                    self.give_up(sock, TcpReason::PeerNotAzsdp);
                    return None;
                }
            }
        }
        match parts.agreement() {
            Agreement::COMMITTED => {}
            Agreement::UNDECIDED if Instant::now() < self.deadline => return None,
            Agreement::UNDECIDED if parts.withdraw() => {
                drop(guard);
                self.give_up(sock, TcpReason::PairTimeout);
                return None;
            }
            Agreement::UNDECIDED => {}
            _ => {
                drop(guard);
                self.give_up(sock, TcpReason::PairTimeout);
                return None;
            }
        }
        // Committed: ours to take up now, unless a call of another thread
        // chose TCP meanwhile (it would move bytes the counts miss).
        let _gate = Completing::raise(counts)?;
        let parts = guard.take()?;
        drop(guard);
        // Counted as under way until the role says what it became.
        let _counted = self.decide_later();
        let made = match (parts.made, parts.offer) {
            (Some(made), _) => made,
            (None, Some(offer)) => self.prepare(fd, offer, parts.answer),
            (None, None) => Err(TcpReason::SetupFailed),
        };
        let prepared = match made {
            Ok(p) => p,
            Err(reason) => {
                self.stay_tcp(sock, reason);
                return None;
            }
        };
        let local = crate::net::local_of(fd).unwrap_or(self.dst);
        let (sent, taken) = (
            counts.sent.load(Ordering::SeqCst),
            counts.taken.load(Ordering::SeqCst),
        );
        let rings = azsdp::fabric::shm::hold_rings();
        let c = prepared.run(
            &self.settings,
            local,
            self.dst,
            Some(crate::join::Joining::new(false, sent)),
            azsdp::driver::threaded::Start::InCall,
        );
        // What the program took of the listener's TCP part so far; then
        // our JOIN goes at once (no send of ours is on the socket).
        if taken > 0 && c.driver.took_from_tcp(taken).is_err() {
            warning!(
                "connect {}: {taken} bytes came over TCP, more than the listener sent there",
                self.dst
            );
        }
        if let Some(j) = c.joining.as_ref() {
            j.join_now(&c);
        }
        drop(rings);
        c.judge_at_close(self.dst, self.deadline - self.settings.pair_timeout);
        info!(
            "{local} -> {}: azsdp (fabric {}, peer pid {}; after {sent} bytes sent and {taken} taken on TCP)",
            self.dst, c.fabric, c.peer_pid
        );
        sock.set_role(Role::Azsdp(Arc::clone(&c)));
        crate::epoll::adopt(sock);
        c.touched();
        Some(c)
    }

    /// A call is about to move bytes on the socket: its ticket, or `None`
    /// while another thread completes the pair, or once it is decided (wait
    /// with [`Pending::wait_completed`], then look at the socket's role
    /// again).
    pub fn enter(&self) -> Option<Ticket> {
        let c = self.tcp.counts()?;
        c.busy.fetch_add(1, Ordering::SeqCst);
        if azsdp::process::pid() != self.pid {
            // A forked child's copy (a completion it copied mid-way has no
            // thread here to finish it): the parent speaks for the pair,
            // and the child's calls are TCP's.
            return Some(Ticket(Arc::clone(&self.tcp)));
        }
        let by = c.completing.load(Ordering::SeqCst);
        // (A signal handler on the completing thread itself cannot wait
        // for it: it goes on as before the gate.)
        let waits = by != 0 && by != azsdp::sync::tid();
        // Completed (or given up) since the caller looked at the role:
        // the role says where the call goes now.
        if waits || self.decided.load(Ordering::SeqCst) {
            c.busy.fetch_sub(1, Ordering::SeqCst);
            return None;
        }
        Some(Ticket(Arc::clone(&self.tcp)))
    }

    /// Wait until no thread is completing the pair (a completion makes no
    /// call of its own and waits for nobody's, so this is short).
    pub fn wait_completed(&self) {
        let Some(c) = self.tcp.counts() else {
            return;
        };
        while c.completing.load(Ordering::SeqCst) != 0 {
            std::thread::yield_now();
        }
    }

    /// The connection of a committed pair, from the listener's answer,
    /// which must name the far end of our connection `fd` (else why not),
    /// started: its HELLO goes now, so that the handshake is over by the
    /// program's first call, and its first send goes on the fabric (the
    /// listener's HELLO_ACK waits in the ring, unrung: nothing here
    /// listens for it before that call).
    fn prepare(
        &self,
        fd: c_int,
        offer: ActiveOffer,
        answer: Option<(Intro, Received)>,
    ) -> Result<Prepared, TcpReason> {
        let Some((intro, answer)) = answer else {
            offer.abandon();
            return Err(TcpReason::SetupFailed);
        };
        if let Err(why) = crate::connect::answer_holds_our_peer(fd, &answer) {
            crate::connect::doubt_listener(self.dst);
            warning!(
                "connect {}: pid {} (uid {}) answered for the listener but {why}; staying on TCP",
                self.dst,
                answer.peer.pid(),
                answer.peer.uid()
            );
            offer.abandon();
            return Err(TcpReason::PeerUnverified);
        }
        let peer = answer.peer;
        let fds = answer.fds.into_iter().skip(1).collect();
        let ep = offer
            .into_endpoint(intro.bell, fds, peer, intro.page_size)
            .map_err(|e| {
                // (The listener's engine sees us gone and stays on TCP.)
                debug!("connect {}: {e}", self.dst);
                TcpReason::SetupFailed
            })?;
        Ok(Prepared::new(
            AnyEndpoint::Shm(ep),
            fd,
            EngineRole::Client,
            &self.settings,
            true,
        ))
    }

    /// The reactor: take the answer in, and once the listener committed,
    /// make the connection and start its engine (`prepare`); the
    /// registration goes (to `SPENT`).
    fn intake(&self) -> Next {
        let _ = SPENT.try_with(|s| s.borrow_mut().clear());
        let done = Next {
            done: true,
            ..Next::default()
        };
        if self.decided.load(Ordering::Acquire) || azsdp::process::pid() != self.pid {
            return done;
        }
        let mut guard = self.parts.lock();
        let Some(parts) = guard.as_mut() else {
            return done;
        };
        if parts.answer.is_none() {
            let Some(reg) = parts.reg.as_ref() else {
                return done;
            };
            match recv_answer(reg.as_fd()) {
                Ok(a) => parts.answer = Some(a),
                Err(e) if e.would_block() => {
                    return Next {
                        watch: true,
                        ..Next::default()
                    };
                }
                // (The program's next call finds out, and stays on TCP.)
                Err(_) => return done,
            }
        }
        match parts.agreement() {
            Agreement::COMMITTED => {}
            // The commit follows the answer closely: look again soon.
            Agreement::UNDECIDED if Instant::now() < self.deadline => {
                return Next {
                    at: Some(Instant::now() + std::time::Duration::from_millis(1)),
                    ..Next::default()
                };
            }
            _ => return done,
        }
        // Our descriptor must still be this socket's (not closed, and its
        // number taken by another) for the check against the answer.
        let ours = self
            .sock
            .upgrade()
            .is_some_and(|s| crate::fdtable::get(self.fd).is_some_and(|t| Arc::ptr_eq(&s, &t)));
        if !ours {
            return done;
        }
        let spent = parts.reg.take();
        if let Some(offer) = parts.offer.take() {
            parts.made = Some(self.prepare(self.fd, offer, parts.answer.take()));
        }
        drop(guard);
        // (Closed now, with the closure, if the thread's locals are gone.)
        let _ = SPENT.try_with(|s| s.borrow_mut().extend(spent));
        done
    }

    /// Decided, one way or the other (once).
    fn decide(&self) {
        drop(self.decide_later());
    }

    /// [`Pending::decide`], but counted among the pairs under way until
    /// the guard drops: a poll of another thread that finds neither a
    /// pair under way nor a live connection asks the kernel alone, and
    /// would sleep through what comes on the fabric.
    fn decide_later(&self) -> Option<StillCounted> {
        (!self.decided.swap(true, Ordering::AcqRel)).then_some(StillCounted)
    }

    /// The pair will not be: withdraw (or, if the listener committed just
    /// now, abandon it: its engine sees us leave) and stay on TCP.
    pub fn give_up(&self, sock: &Arc<Sock>, reason: TcpReason) {
        if azsdp::process::pid() != self.pid {
            // A forked child's copy: the parent speaks for the pair.
            self.decide();
            self.stay_tcp(sock, TcpReason::Forked);
            return;
        }
        let Some(parts) = self.parts.lock().take() else {
            return;
        };
        self.decide();
        if !parts.withdraw() {
            parts.abandon();
        }
        // A connection that ended, or went to a forked child, before its
        // pair completed is one a pair never pays for. One whose pair
        // failed for the listener's reasons (a burst it was slow to
        // accept, a sibling worker holding the offer) says nothing of how
        // long such connections live: it is not counted.
        if matches!(reason, TcpReason::ShortLived | TcpReason::Forked) {
            crate::connect::judged(self.dst, false);
        }
        self.stay_tcp(sock, reason);
    }

    fn stay_tcp(&self, sock: &Arc<Sock>, reason: TcpReason) {
        info!(
            "{}-> {}: tcp ({})",
            crate::net::log_from(self.local),
            self.dst,
            reason.name()
        );
        self.tcp.set_reason(reason);
        if matches!(sock.role(), Role::Pairing(p) if std::ptr::eq(Arc::as_ptr(&p), self)) {
            sock.set_role(Role::Tcp(Arc::clone(&self.tcp)));
            sock.kernel_epolls.lock().clear();
        }
    }
}

impl Serviced for Pending {
    fn service(&self, _wake: Wake) -> Next {
        self.intake()
    }
}

/// Withdraw from the pair (the listener then stays on TCP too). False if
/// the listener had committed.
pub fn withdraw(word: &std::sync::atomic::AtomicU32) -> bool {
    match word.compare_exchange(
        Agreement::UNDECIDED,
        Agreement::WITHDRAWN,
        Ordering::AcqRel,
        Ordering::Acquire,
    ) {
        Ok(_) => true,
        Err(v) => v == Agreement::WITHDRAWN,
    }
}

/// The stats thread: pairs past `pair_timeout` that the listener has not
/// committed to are withdrawn (their connections stay TCP); the rest wait
/// for their program's next call.
pub fn expire() {
    let now = Instant::now();
    let due: Vec<(Arc<Pending>, Arc<Sock>)> = {
        let mut v = UNDER_WAY.lock();
        v.retain(|(p, s)| {
            p.upgrade()
                .is_some_and(|p| !p.decided.load(Ordering::Acquire))
                && s.strong_count() > 0
        });
        v.iter()
            .filter_map(|(p, s)| Some((p.upgrade()?, s.upgrade()?)))
            .filter(|(p, _)| now >= p.deadline)
            .collect()
    };
    for (p, sock) in due {
        let withdrawn = p
            .parts
            .lock()
            .as_ref()
            .is_some_and(|parts| parts.withdraw());
        if withdrawn {
            p.give_up(&sock, TcpReason::PairTimeout);
        }
    }
}

/// Give up every pair under way (an exec: the new image knows none).
pub fn give_up_all(reason: TcpReason) {
    let all: Vec<(Arc<Pending>, Arc<Sock>)> = UNDER_WAY
        .lock()
        .drain(..)
        .filter_map(|(p, s)| Some((p.upgrade()?, s.upgrade()?)))
        .collect();
    for (p, sock) in all {
        p.give_up(&sock, reason);
    }
}
