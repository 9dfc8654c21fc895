//! A connection that began on its TCP socket, until both directions have
//! joined the fabric (docs/protocol.md §8b, docs/shim.md "Pairing").
//!
//! Sends go to the socket, counted, until this side joins; it joins at a
//! send (or a shutdown) with no other send on the socket, so the count is
//! the TCP part's length. The client joins at its first chance: it took
//! the pair up, so its program's waits on this socket watch the fabric
//! too from now on. The listener's side joins only once the client's JOIN
//! is in: before that, the client's program may sleep in the kernel on
//! the socket alone, and would never see bytes sent on the fabric.
//!
//! Receives read the socket until the peer's TCP part is taken (or, before
//! its JOIN, whatever comes), waiting for the socket or for the connection,
//! whichever comes first.

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};

use azsdp::conn::{Readiness, RxRoute};
use azsdp::driver::threaded::{FIRST_CALL_NAP, LONGEST_CALL_NAP};
use azsdp::sync::Lock;
use libc::{c_int, ssize_t};

use crate::conn::Conn;
use crate::log::info;
use crate::real;

#[derive(Default)]
struct Tx {
    /// Bytes the program sent on the socket.
    sent: u64,
    /// Sends on the socket now.
    inflight: usize,
}

/// The TCP part of a joining connection, as this process sees it.
pub struct Joining {
    tx: Lock<Tx>,
    /// Join only after the peer did (the listener's side).
    after_peer: bool,
    /// Our sending direction joined; the peer's TCP part is all taken.
    tx_done: AtomicBool,
    rx_done: AtomicBool,
    /// Our stream ended on the socket before it joined: it never will.
    tx_over: AtomicBool,
    /// The listener's side allowed the client to join.
    allowed: AtomicBool,
    /// Forks of this process when the connection began (`crate::pending`).
    forks: u64,
}

/// What a receive on the TCP part came to.
pub enum Received {
    /// The call's result, as the kernel's (errno set).
    Done(ssize_t),
    /// The rest comes from the fabric: make the call there.
    Fabric,
}

impl Joining {
    /// `sent`: bytes the program sent on the socket before the
    /// connection was paired (the client's, while its pair was pending).
    pub fn new(after_peer: bool, sent: u64) -> Joining {
        Joining {
            tx: Lock::new(Tx { sent, inflight: 0 }),
            after_peer,
            tx_done: AtomicBool::new(false),
            rx_done: AtomicBool::new(false),
            tx_over: AtomicBool::new(false),
            allowed: AtomicBool::new(false),
            forks: crate::pending::forks(),
        }
    }

    /// Has a fork copied the connection since it began (in this process,
    /// or in the one it was forked from)? Then several processes may hold
    /// the socket, and none may join, allow a join, or shut the socket for
    /// the others.
    pub fn forked(&self) -> bool {
        crate::pending::forks() != self.forks
    }

    /// Both directions are on the fabric: nothing here matters any more.
    pub fn settled(&self) -> bool {
        self.tx_done.load(Ordering::Acquire) && self.rx_done.load(Ordering::Acquire)
    }

    pub fn tx_done(&self) -> bool {
        self.tx_done.load(Ordering::Acquire)
    }

    /// The listener's side, at the program's first call (or look) in the
    /// process that runs the connection, not shared by a fork: the client
    /// may join. (A listener that forks first never allows it: the
    /// connection stays on TCP with no handshake, see `leave_fabric`.)
    fn allow(&self, c: &Conn) {
        if !self.after_peer || self.allowed.load(Ordering::Acquire) {
            return;
        }
        if !self.forked() && !c.driver.shared_by_fork() && c.driver.is_mine() {
            self.allowed.store(true, Ordering::Release);
            c.driver.allow_join();
        }
    }

    fn rx_on_tcp(&self, c: &Conn) -> Option<Option<u64>> {
        if self.rx_done.load(Ordering::Acquire) {
            return None;
        }
        match c.driver.rx_route() {
            RxRoute::Fabric => {
                self.rx_done.store(true, Ordering::Release);
                None
            }
            RxRoute::Tcp { left } => Some(left),
        }
    }

    /// Join our sending direction if no send is on the socket and the
    /// rule allows (`force`: the stream ends, join whatever the peer did).
    /// Whether it has joined.
    fn try_join(&self, c: &Conn, force: bool) -> bool {
        if self.tx_done() {
            return true;
        }
        let tx = self.tx.lock();
        self.try_join_locked(c, &tx, force)
    }

    /// [`Joining::try_join`] with the sending side's lock held (so that a
    /// send that finds it cannot join yet is counted in flight before
    /// another thread can join).
    fn try_join_locked(&self, c: &Conn, tx: &Tx, force: bool) -> bool {
        if self.tx_done() {
            return true;
        }
        if c.driver.tx_joined() {
            self.tx_done.store(true, Ordering::Release);
            return true;
        }
        if self.tx_over.load(Ordering::Acquire)
            || self.forked()
            || matches!(c.driver.state(), azsdp::conn::State::Aborted(_))
        {
            // Ended on the socket, or the engine is gone before anything
            // of ours went on it: the socket carries it all.
            return false;
        }
        // The client joins once answered (the listener allowed it); the
        // listener once the client's JOIN is in.
        if tx.inflight > 0 || !(force || c.driver.may_join_tx()) {
            return false;
        }
        c.driver.join_tx(tx.sent);
        self.tx_done.store(true, Ordering::Release);
        info!(
            "{} -> {}: joined the fabric after {} bytes on TCP",
            c.local, c.peer, tx.sent
        );
        true
    }

    /// Do receives read the TCP socket now?
    pub fn rx_on_socket(&self, c: &Conn) -> bool {
        self.rx_on_tcp(c).is_some()
    }

    /// Join now if the rule allows (the client, once its pair completed).
    pub fn join_now(&self, c: &Conn) -> bool {
        self.try_join(c, false)
    }

    /// A send: `None` if it goes to the engine (this side has joined, now
    /// or before), else the socket's result.
    pub fn send(
        &self,
        c: &Conn,
        fd: c_int,
        bufs: &[(*const u8, usize)],
        flags: c_int,
    ) -> Option<ssize_t> {
        self.allow(c);
        {
            // Decided and counted under one hold of the lock: a join by
            // another thread in between would leave this send uncounted
            // on TCP after the JOIN.
            let mut tx = self.tx.lock();
            if self.try_join_locked(c, &tx, false) {
                return None;
            }
            tx.inflight += 1;
        }
        // SAFETY: the program's buffers, as it passed them.
        let r = unsafe { real::io(fd, true, bufs, flags) };
        let _errno = real::KeepErrno::new();
        let mut tx = self.tx.lock();
        tx.inflight -= 1;
        if r > 0 {
            tx.sent += r as u64;
        }
        Some(r)
    }

    /// The stream ends here (shutdown for writing, close). A peer that has
    /// not joined may be reading the socket alone: the stream ends there,
    /// and never joins. Otherwise we join now, and the end goes on the
    /// fabric after the TCP part.
    pub fn end_stream(&self, c: &Conn, fd: c_int) {
        if self.tx_done() || self.tx_over.load(Ordering::Acquire) {
            return;
        }
        let peer_joined = !matches!(c.driver.rx_route(), RxRoute::Tcp { left: None });
        if !peer_joined {
            let _tx = self.tx.lock();
            if !c.driver.tx_joined() {
                self.tx_over.store(true, Ordering::Release);
                // SAFETY: shutdown of the program's socket, as it asked.
                unsafe { real::shutdown(fd, libc::SHUT_WR) };
                return;
            }
        }
        // Sends on the socket end now (the shutdown fails them, or they
        // finish): wait for their counts.
        let deadline = Instant::now() + Duration::from_secs(1);
        while !self.try_join(c, true) && Instant::now() < deadline {
            std::thread::sleep(Duration::from_micros(200));
        }
    }

    /// A receive: the socket's part of the peer's stream, or `Fabric`.
    pub fn recv(
        &self,
        c: &Conn,
        fd: c_int,
        bufs: &[(*mut u8, usize)],
        flags: c_int,
        nonblocking: bool,
        deadline: Option<Instant>,
    ) -> Received {
        self.allow(c);
        let signals = crate::signals::CallSignals::default();
        // Looks again now and then (a safety net under the notifications),
        // as a blocked call on the fabric does: from its first nap,
        // doubling while nothing comes, so that ten thousand threads
        // blocked on idle connections leave the CPUs alone.
        let mut slice = FIRST_CALL_NAP;
        loop {
            // (Joining needs no send of ours: a program that only reads
            // gets the peer's stream on the fabric too.)
            self.try_join(c, false);
            let Some(left) = self.rx_on_tcp(c) else {
                return Received::Fabric;
            };
            let capped = cap(bufs, left);
            let peek = flags & libc::MSG_PEEK != 0;
            let f = (flags & !libc::MSG_WAITALL) | libc::MSG_DONTWAIT;
            let consts: Vec<(*const u8, usize)> =
                capped.iter().map(|&(p, l)| (p.cast_const(), l)).collect();
            // SAFETY: the program's buffers, cut to the TCP part.
            let r = unsafe { real::io(fd, false, &consts, f) };
            if r > 0 {
                if !peek && c.driver.took_from_tcp(r as u64).is_err() {
                    // More than the peer's JOIN said: the connection is reset.
                    real::set_errno(libc::ECONNRESET);
                    return Received::Done(-1);
                }
                c.touched();
                return Received::Done(r);
            }
            let e = real::errno();
            let at_end = r == 0;
            if r < 0 && e != libc::EAGAIN {
                return Received::Done(r);
            }
            if at_end {
                if left.is_some() {
                    // The socket ended inside the TCP part its JOIN named.
                    real::set_errno(libc::ECONNRESET);
                    return Received::Done(-1);
                }
                // No JOIN (the engine has taken in all that came): the
                // peer ended its stream on the socket, or died.
                if matches!(c.driver.rx_route(), RxRoute::Tcp { left: None }) {
                    return Received::Done(0);
                }
                continue;
            }
            if nonblocking {
                real::set_errno(libc::EAGAIN);
                return Received::Done(-1);
            }
            if signals.interrupted() {
                real::set_errno(libc::EINTR);
                return Received::Done(-1);
            }
            let left_time = deadline.map(|d| d.saturating_duration_since(Instant::now()));
            if left_time.is_some_and(|l| l.is_zero()) {
                real::set_errno(libc::EAGAIN);
                return Received::Done(-1);
            }
            wait(
                c,
                fd,
                libc::POLLIN,
                left_time.map_or(slice, |l| l.min(slice)),
                left.is_none(),
            );
            slice = (slice * 2).min(LONGEST_CALL_NAP);
        }
    }

    /// The poll events of the TCP socket that concern the connection now:
    /// POLLIN while receives read it, POLLOUT while sends go there.
    pub fn tcp_events(&self, c: &Conn) -> i16 {
        let mut e = 0;
        if self.rx_on_tcp(c).is_some() {
            e |= libc::POLLIN | libc::POLLRDHUP;
        }
        if !self.tx_done() {
            e |= libc::POLLOUT;
        }
        e
    }

    /// The socket's part of the readiness: what a receive or a send on it
    /// would do now, in place of the engine's.
    pub fn merge(&self, c: &Conn, fd: c_int, r: &mut Readiness) {
        self.allow(c);
        self.try_join(c, false);
        let rx_tcp = self.rx_on_tcp(c);
        let tx_tcp = !self.tx_done() && !c.driver.tx_joined();
        if rx_tcp.is_none() && !tx_tcp {
            return;
        }
        if tx_tcp
            && rx_tcp == Some(None)
            && matches!(c.driver.state(), azsdp::conn::State::Aborted(_))
        {
            // The engine is gone before anything went on the fabric either
            // way: the socket is all there is.
            *r = Readiness::default();
        }
        let mut p = libc::pollfd {
            fd,
            events: libc::POLLIN | libc::POLLOUT | libc::POLLRDHUP,
            revents: 0,
        };
        // SAFETY: a poll of one pollfd we own, without waiting.
        unsafe { real::poll(&mut p, 1, 0) };
        if let Some(left) = rx_tcp {
            let data = p.revents & libc::POLLIN != 0;
            let ended = p.revents & (libc::POLLRDHUP | libc::POLLHUP) != 0;
            // At the socket's end with no JOIN: a receive says EOF (it
            // would not wait); inside a named TCP part, ECONNRESET.
            r.readable = data || (ended && left.is_some()) || r.error;
            r.read_hangup = ended && left.is_none();
            // (Both ways shut on the socket, or reset: as the kernel says.)
            r.hangup |= p.revents & libc::POLLHUP != 0;
        }
        if tx_tcp {
            r.writable = p.revents & libc::POLLOUT != 0;
        }
        if p.revents & libc::POLLERR != 0 {
            r.error = true;
        }
    }
}

/// The buffers, cut to `left` bytes in all.
fn cap(bufs: &[(*mut u8, usize)], left: Option<u64>) -> Vec<(*mut u8, usize)> {
    let Some(mut left) = left else {
        return bufs.to_vec();
    };
    let mut out = Vec::new();
    for &(p, l) in bufs {
        if left == 0 {
            break;
        }
        let take = (l as u64).min(left);
        out.push((p, take as usize));
        left -= take;
    }
    out
}

/// Sleep until the socket is ready for `events`, the connection's state
/// may have changed (a JOIN came), or `most` passes. `no_join`: the
/// caller's last look found the peer's JOIN not in yet.
///
/// The thread sleeps on a futex of its own, not in `poll` with an eventfd:
/// a thread-per-connection server has thousands of threads here at once
/// (each waiting for its client's first bytes), and each would hold a
/// descriptor. The reactor watches the socket for it instead, once.
fn wait(c: &Conn, fd: c_int, events: i16, most: Duration, no_join: bool) {
    // Before the peer's JOIN, what comes next is most likely that JOIN on
    // the fabric (the peer joins at its first send after ours): sleep
    // where the peer's post wakes this thread itself, with the socket
    // watched for the rest. (Through the reactor, each first exchange
    // woke two threads in turn where TCP wakes one.) The caller looked
    // at the route just now; the wait looks again under the lock.
    if no_join
        && let Ok(_watch) = azsdp::driver::reactor::Reactor::get()
            .and_then(|r| r.when_ready(fd, events as u32, c.driver.kicker()))
        && c.driver.wait_for_peer_join(most)
    {
        return;
    }
    let Some(w) = crate::ready::my_quiet_wakeup() else {
        std::thread::sleep(most.min(Duration::from_millis(1)));
        return;
    };
    w.arm_alone();
    let mut listening = crate::ready::Listening::new(Some(&w));
    listening.add(&c.watchers);
    // Read after arming, before the last look: a change from now on moves
    // the word, and the sleep below does not begin.
    let seen = w.word().load(Ordering::SeqCst);
    if !matches!(c.driver.rx_route(), RxRoute::Fabric) {
        let waker = Arc::clone(&w);
        let kick: azsdp::driver::reactor::Waker = Arc::new(move || waker.kick());
        let watch = azsdp::driver::reactor::Reactor::get()
            .and_then(|r| r.when_ready(fd, events as u32, kick));
        match watch {
            Ok(_watch) => azsdp::futex::wait(w.word(), seen, most),
            // (No reactor, or the socket cannot be watched: look again
            // soon.)
            Err(_) => {
                let mut p = libc::pollfd {
                    fd,
                    events,
                    revents: 0,
                };
                let ms = most.min(Duration::from_millis(2)).as_millis().max(1) as c_int;
                // SAFETY: our own pollfd.
                unsafe { real::poll(&raw mut p, 1, ms) };
            }
        }
    }
    w.disarm();
}

/// Was the TCP socket `fd` reset (the peer's kernel discarded what we sent
/// there)? A look that takes nothing.
pub fn reset_beneath(fd: c_int) -> bool {
    let mut b = 0u8;
    let _keep = real::KeepErrno::new();
    let bufs = [((&raw mut b).cast_const(), 1usize)];
    // SAFETY: a one-byte peek into our own byte.
    let r = unsafe { real::io(fd, false, &bufs, libc::MSG_PEEK | libc::MSG_DONTWAIT) };
    r < 0 && real::errno() == libc::ECONNRESET
}
