//! A connection as the shim holds it: upgraded ([`Conn`], an engine on the
//! shm fabric) or plain TCP ([`TcpConn`], only counted).

use azsdp::sync::Lock;
use std::net::SocketAddr;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};

use azsdp::beneath::TcpBeneath;
use azsdp::config::Settings;
use azsdp::conn::{Capabilities, LockRegion, Role, TxMode};
use azsdp::driver::threaded::{Start, ThreadedDriver};
use azsdp::driver::{Driver, ProcessHost, Protector, capabilities};
use azsdp::fabric::shm::{ShmParams, ShmTransport};
use azsdp::protect;
use azsdp::stats::{ConnPath, StatFile, TcpReason};
use azsdp::transport::Endpoint;

use crate::endpoint::AnyEndpoint;
use crate::log::{debug, info, warning};

/// The transport connections of this host are paired over (the one place
/// that names it: pairing and connections go through [`Transport`] and
/// [`Endpoint`]).
pub type Active = ShmTransport;
/// The endpoint an upgraded connection runs (on any fabric).
pub type ActiveEndpoint = AnyEndpoint;

/// The transport, sized by `s`, for the connection on socket `fd`.
pub fn transport(s: &Settings, fd: i32) -> Active {
    // SAFETY: F_GETFD on the program's socket.
    let survives_exec = unsafe { crate::real::fcntl(fd, libc::F_GETFD, 0) } & libc::FD_CLOEXEC == 0;
    ShmTransport {
        params: ShmParams {
            ring_capacity: (s.bsdp_buffer.max(64 << 10) * 2)
                .next_power_of_two()
                .min(azsdp::fabric::shm::MAX_RING as u64) as usize,
            poll: s.poll,
            keep_for_exec: survives_exec,
            ..ShmParams::default()
        },
    }
}

/// What runs one upgraded connection: the engine, its fabric endpoint and
/// its page protection, driven between calls by the process's reactor.
type ConnDriver = ThreadedDriver<ActiveEndpoint, Box<dyn Protector + Send>>;

/// An upgraded connection.
pub struct Conn {
    pub driver: ConnDriver,
    /// The TCP socket beneath (the program's descriptor, or ours once the
    /// program closed it while the connection finishes).
    pub beneath: Arc<TcpBeneath>,
    /// The epoll sets watching this connection.
    pub watchers: Arc<crate::epoll::Watchers>,
    pub local: SocketAddr,
    pub peer: SocketAddr,
    pub peer_pid: u32,
    /// The fabric it runs on (`shm`, `verbs`).
    pub fabric: &'static str,
    role: Role,
    linger: Duration,
    closed: AtomicBool,
    reported: AtomicBool,
    stat: Lock<Option<(Arc<StatFile>, usize)>>,
    /// Last path published (to log changes once).
    path: Lock<ConnPath>,
    /// The connection began on its TCP socket and is joining the fabric
    /// (`crate::join`); `None` once paired on the fabric from the start.
    pub joining: Option<crate::join::Joining>,
    /// A client's destination and the time of its `connect()`: at the
    /// end, whether the pair repaid it goes into the history
    /// (`crate::connect::judged`).
    judge: Lock<Option<(SocketAddr, Instant)>>,
}

/// A connection's engine made and started, not yet driven by this
/// process: its HELLO is posted, and the peer's answer waits in the ring
/// until [`Prepared::run`] (a client prepares its connection when the
/// listener's answer comes, so that the handshake is over by the
/// program's first call; docs/shim.md, "Pairing").
pub struct Prepared {
    driver: Driver<ActiveEndpoint, Box<dyn Protector + Send>>,
    faults: Option<Box<dyn azsdp::protect::FaultSource>>,
    beneath: Arc<TcpBeneath>,
    role: Role,
}

impl Prepared {
    /// Make the engine for a pair whose segment is set up and agreed on;
    /// `joins`: the connection began on TCP and joins the fabric.
    pub fn new(
        ep: ActiveEndpoint,
        fd: i32,
        role: Role,
        settings: &Settings,
        joins: bool,
    ) -> Prepared {
        let p = protect::open(settings.protection);
        let mut caps: Capabilities = capabilities(ep.get_refused().is_none(), p.protector.as_ref());
        // Never advertise our pages to a peer of another user: it cannot
        // read them (a hostile one may claim it can, to have us protect
        // pages and wait for GETs that never come).
        caps.zcopy_source &= Endpoint::same_user(&ep);
        caps.arm_recv &= ep.arms_receives();
        let mut cfg = settings.engine_config(role, caps, LockRegion::UNSET);
        cfg.joins_from_tcp = joins;
        if !ep.reads_ahead() {
            cfg.read_ahead = 0;
        }
        let beneath = Arc::new(TcpBeneath::new(fd));
        let host = Conn::host(settings, &beneath);
        Prepared {
            driver: Driver::with_host(cfg, ep, p.protector, host),
            faults: p.faults,
            beneath,
            role,
        }
    }

    /// Drive the connection from this process's reactor and the program's
    /// calls. `joining`: what the program moved on TCP so far, if the
    /// connection began there. `start`: whether a call of the program
    /// starts it (and drives it now).
    pub fn run(
        self,
        settings: &Settings,
        local: SocketAddr,
        peer: SocketAddr,
        joining: Option<crate::join::Joining>,
        start: Start,
    ) -> Arc<Conn> {
        Conn::run(self, settings, local, peer, joining, start)
    }
}

impl Conn {
    /// Start the engine for a pair whose segment is set up and agreed on.
    /// Nothing waits for the peer here: the handshake completes in the
    /// background, and calls that need it wait for it (bounded by
    /// `peer_timeout`, and by the peer process's life).
    ///
    /// `joining`: the connection began on TCP and joins the fabric
    /// (`crate::join`), with what the program moved on TCP so far.
    pub fn start(
        ep: ActiveEndpoint,
        fd: i32,
        role: Role,
        settings: &Settings,
        local: SocketAddr,
        peer: SocketAddr,
        joining: Option<crate::join::Joining>,
    ) -> Arc<Conn> {
        Prepared::new(ep, fd, role, settings, joining.is_some()).run(
            settings,
            local,
            peer,
            joining,
            Start::Idle,
        )
    }

    /// Take up a connection the previous image of this process parked
    /// before its `exec` (see `crate::exec_park`): the same engine, on the
    /// same segment, driven from here on by this image.
    pub fn resume(
        engine: &[u8],
        ep: ActiveEndpoint,
        fd: i32,
        role: Role,
        settings: &Settings,
        local: SocketAddr,
        peer: SocketAddr,
    ) -> Result<Arc<Conn>, azsdp::driver::UnparkError> {
        let p = protect::open(settings.protection);
        let beneath = Arc::new(TcpBeneath::new(fd));
        let host = Self::host(settings, &beneath);
        let driver = Driver::unpark(engine, ep, p.protector, host)?;
        let prepared = Prepared {
            driver,
            faults: p.faults,
            beneath,
            role,
        };
        // (Only a connection whose join was over is parked.)
        let c = prepared.run(settings, local, peer, None, Start::Idle);
        // The peer rings the previous image's bell, gone with it.
        c.driver.with_fabric(|ep| {
            if let Some(shm) = ep.shm() {
                shm.announce()
            }
        });
        Ok(c)
    }

    fn host(settings: &Settings, beneath: &Arc<TcpBeneath>) -> ProcessHost {
        let mut host = ProcessHost::default();
        host.convert_private_files = settings.convert_private_files;
        host.beneath = Some(Arc::clone(beneath));
        host.write_timeout = settings.peer_timeout.max(Duration::from_secs(1));
        host
    }

    /// Drive `p` from this process's reactor and the program's calls.
    fn run(
        p: Prepared,
        settings: &Settings,
        local: SocketAddr,
        peer: SocketAddr,
        joining: Option<crate::join::Joining>,
        start: Start,
    ) -> Arc<Conn> {
        let Prepared {
            driver: d,
            faults,
            beneath,
            role,
        } = p;
        let peer_pid = Endpoint::peer_pid(d.fabric());
        let fabric = d.fabric().fabric_name();
        let waiter = Endpoint::waiter(d.fabric());
        let watchers = Arc::new(crate::epoll::Watchers::default());
        let w = Arc::clone(&watchers);
        let notify: azsdp::driver::threaded::Notify = Arc::new(move || w.touched());
        let driver = ThreadedDriver::start_with_notify(d, waiter, faults, Some(notify), start);
        // A forked child that takes the connection over protects its own
        // memory with its own userfaultfd.
        let mode = settings.protection;
        driver.set_fork_protection(Box::new(move || {
            let p = protect::open(mode);
            (p.protector, p.faults)
        }));
        let stat = crate::runtime::stat_file().and_then(|f| {
            let slot = f.open_slot(role, local, peer)?;
            f.set_path(slot, ConnPath::Azsdp, None, peer_pid);
            f.set_fabric(slot, fabric);
            Some((f, slot))
        });
        crate::runtime::ensure_exit_handler();
        crate::runtime::note_linger(settings.linger);
        let c = Arc::new(Conn {
            driver,
            beneath,
            watchers,
            local,
            peer,
            peer_pid,
            fabric,
            role,
            linger: settings.linger,
            closed: AtomicBool::new(false),
            reported: AtomicBool::new(false),
            stat: Lock::new(stat),
            path: Lock::new(ConnPath::Azsdp),
            joining,
            judge: Lock::new(None),
        });
        c.publish();
        c
    }

    /// Copy the engine's counters into the stat file.
    pub fn publish(&self) {
        // (Unchanged since the last publish: ten thousand idle connections
        // cost the stats thread no locks.)
        let Some((counters, outstanding, mode)) = self.driver.snapshot_if_touched() else {
            return;
        };
        let path = match mode {
            TxMode::Async => ConnPath::Azsdp,
            TxMode::Sync => ConnPath::Zsdp,
            TxMode::Buffered => ConnPath::Bsdp,
        };
        {
            let mut last = self.path.lock();
            if *last != path {
                debug!(
                    "{} -> {}: sends now {} ({:?})",
                    self.local,
                    self.peer,
                    path.name(),
                    counters.fallback_reason
                );
                *last = path;
            }
        }
        let mut stat = self.stat.lock();
        let me = azsdp::process::pid();
        if stat.as_ref().is_some_and(|(f, _)| f.pid() != me) && self.driver.is_mine() {
            // A forked child took the connection over: its own slot.
            let role = self.role;
            *stat = crate::runtime::stat_file().and_then(|f| {
                let slot = f.open_slot(role, self.local, self.peer)?;
                f.set_path(slot, path, None, self.peer_pid);
                Some((f, slot))
            });
        }
        if let Some((f, slot)) = stat.as_ref() {
            f.publish(*slot, &counters, outstanding as u64, path);
            f.set_rung(*slot, self.driver.rung());
        }
    }

    /// The program closed its last descriptor: finish in the background.
    pub fn close_with(self: &Arc<Self>, abort: bool) {
        if self.closed.swap(true, Ordering::SeqCst) {
            return;
        }
        self.driver.close_in_background(abort, self.linger);
        crate::runtime::closing(Arc::clone(self));
        self.touched();
    }

    /// Readiness for poll/select/epoll of the program's descriptor `fd`:
    /// the engine's, with the TCP socket's part while joining.
    pub fn readiness_on(&self, fd: i32) -> azsdp::conn::Readiness {
        let mut r = self.driver.readiness();
        if let Some(j) = self.joining.as_ref().filter(|j| !j.settled()) {
            j.merge(self, fd, &mut r);
        } else if self.joining.is_some() && r.read_hangup && !r.error {
            // The peer ended; our TCP part may have died unread with it
            // (its kernel reset the socket), as TCP would show.
            let mut p = libc::pollfd {
                fd,
                events: 0,
                revents: 0,
            };
            // SAFETY: a poll of one pollfd of ours, without waiting (libc's:
            // `libc::poll` would be our own hook).
            unsafe { crate::real::poll(&mut p, 1, 0) };
            if p.revents & libc::POLLERR != 0 {
                r.error = true;
                r.hangup = true;
            }
        }
        r
    }

    /// Is the connection still joining the fabric (a direction of it on
    /// the TCP socket)?
    pub fn joining_now(&self) -> Option<&crate::join::Joining> {
        self.joining.as_ref().filter(|j| !j.settled())
    }

    /// Changes when a message may have arrived (see
    /// `ThreadedDriver::ticket`): what a busy-poller watches.
    pub fn ticket(&self) -> u32 {
        self.driver.ticket()
    }

    /// An event loop looked at the connection's ticket and looks again
    /// at its next wait (see `ThreadedDriver::watched_by_loop`).
    pub fn watched_by_loop(&self, at_ns: u64) {
        self.driver.watched_by_loop(at_ns);
    }

    /// That loop is about to sleep, with its bell `loop_bell` (0: none).
    pub fn loop_sleeps(&self, loop_bell: u32) -> azsdp::driver::threaded::LoopArmed {
        self.driver.loop_sleeps(loop_bell)
    }

    /// The loop with bell `loop_bell` no longer watches the connection.
    pub fn loop_left(&self, loop_bell: u32) {
        self.driver.loop_left(loop_bell);
    }

    /// The program changed the connection's state itself (a shutdown, a
    /// close): whoever waits for its readiness looks again.
    pub fn touched(&self) {
        self.watchers.touched();
    }

    pub fn close(self: &Arc<Self>) {
        self.close_with(false);
    }

    /// Which end of the connection this is.
    pub fn role(&self) -> Role {
        self.role
    }

    /// The program is closing (or replacing) its descriptor `fd` of this
    /// connection, whose other descriptor (if any) is `other`: the socket
    /// beneath stays reachable while the connection may still need it.
    pub fn program_closes(&self, fd: i32, other: Option<i32>) {
        let needed = !self.driver.is_switched() && !self.driver.is_finished();
        self.beneath.detach(fd, other, needed);
    }

    /// The connection moved onto its TCP socket: its azsdp life ends here
    /// (the close line, the stat slot), the program's descriptor is plain.
    pub fn switched(&self) {
        self.closed.store(true, Ordering::SeqCst);
        self.report();
        self.close_slot();
        self.beneath.release();
    }

    /// Wait (up to the linger time) for a background close to finish.
    pub fn join_closed(&self) {
        self.driver
            .join_closed(self.linger + Duration::from_millis(100));
    }

    pub fn finished(&self) -> bool {
        let done = self.closed.load(Ordering::SeqCst) && self.driver.is_finished();
        if done {
            self.report();
            self.close_slot();
        }
        done
    }

    fn close_slot(&self) {
        if let Some((f, slot)) = self.stat.lock().as_ref() {
            f.close_slot(*slot);
        }
    }

    /// At the end, tell this process's pair history whether the pair
    /// repaid its cost (a client's connection to `dst`, connected at `at`).
    pub fn judge_at_close(&self, dst: SocketAddr, at: Instant) {
        *self.judge.lock() = Some((dst, at));
    }

    /// One line at the end: what moved over which path.
    pub fn report(&self) {
        if self.reported.swap(true, Ordering::SeqCst) || self.driver.inherited_only() {
            // (A forked child's copy it never ran: its process reports it.)
            return;
        }
        let (c, _, _) = self.driver.snapshot();
        if let Some((dst, at)) = self.judge.lock().take() {
            // (The engine counts the fabric's bytes only, never the TCP
            // part before the join.)
            let fabric = c.bytes_sent() + c.bytes_received();
            let repaid = azsdp::pair_history::repaid(at.elapsed(), fabric);
            crate::connect::judged(dst, repaid);
        }
        let end = match self.driver.state() {
            // (The peer's process died and others of its side carry on, or
            // the peer had closed and gone when this side left the fabric.)
            _ if self.driver.orphaned() => {
                "moved to its TCP socket alone (the peer's end was gone)".to_string()
            }
            _ if self.driver.is_switched() => "moved to its TCP socket".to_string(),
            azsdp::conn::State::Aborted(r) => {
                let mut why = r.to_string();
                if c.bytes_unread_by_peer > 0 {
                    why += &format!(", {} sent bytes never read", c.bytes_unread_by_peer);
                }
                if let Some(f) = self.driver.with_fabric(|ep| ep.broken_reason()) {
                    why += &format!("; fabric: {f}");
                }
                format!("reset ({why})")
            }
            azsdp::conn::State::Switched => "moved to its TCP socket".to_string(),
            _ => "closed".to_string(),
        };
        if let Some(w) = self.driver.stalled() {
            // A timeout is a stall somewhere: say where, whatever the level
            // (and what the fabric waits for, where it can say).
            let fabric = self.driver.with_fabric(|ep| ep.describe());
            let fabric = fabric.map(|f| format!("; fabric: {f}")).unwrap_or_default();
            warning!(
                "{} -> {}: timed out waiting: {w}{fabric}",
                self.local,
                self.peer
            );
        }
        let copied = match c.copy_summary() {
            s if s.is_empty() => String::new(),
            s => format!(" (copied: {s})"),
        };
        let served = self.driver.served();
        let served = if served.requests == 0 {
            String::new()
        } else {
            format!(
                "; for the processes it shares the connection with: {} calls, sent {} received {} bytes (one copy each)",
                served.requests, served.bytes_sent, served.bytes_received
            )
        };
        let ahead = match c.bytes_recv_ahead {
            0 => String::new(),
            n => format!(" (read ahead, then copied: {n})"),
        };
        let before_join = |n: u64| match n {
            0 => String::new(),
            n => format!(" (on TCP before joining: {n})"),
        };
        let (sent_tcp, received_tcp) = (
            before_join(c.tcp_sent_before_join),
            before_join(c.tcp_received_before_join),
        );
        info!(
            "{} -> {}: {end}; sent azsdp {} zsdp {} bsdp {} bytes{copied}{sent_tcp}, received zero-copy {} bsdp {} bytes{ahead}{received_tcp}; \
             gets {}, faults {}, copy-on-writes {}, fallbacks {}",
            self.local,
            self.peer,
            c.bytes_sent_async,
            c.bytes_sent_sync,
            c.bytes_sent_bsdp,
            c.bytes_recv_zcopy,
            c.bytes_recv_bsdp,
            c.gets,
            c.send_faults + c.recv_faults,
            c.cow_copies,
            c.fallbacks
        );
        if !served.is_empty() {
            info!("{} -> {}: {}", self.local, self.peer, &served[2..]);
        }
    }
}

impl Drop for Conn {
    fn drop(&mut self) {
        self.close_slot();
    }
}

/// A connection left on plain TCP: only counted, for `azsdp stat`.
pub struct TcpConn {
    stat: Option<(Arc<StatFile>, usize)>,
    /// While a pair is under way (`crate::pending`): what the program
    /// moved on the socket, exactly.
    counts: Option<crate::pending::Counts>,
}

impl TcpConn {
    pub fn new(
        local: Option<SocketAddr>,
        peer: Option<SocketAddr>,
        reason: TcpReason,
        server: bool,
    ) -> Arc<TcpConn> {
        Arc::new(TcpConn {
            stat: Self::slot(local, peer, reason, server),
            counts: None,
        })
    }

    /// A client's connection whose pair is under way.
    pub fn pairing(local: Option<SocketAddr>, peer: Option<SocketAddr>) -> Arc<TcpConn> {
        Arc::new(TcpConn {
            stat: Self::slot(local, peer, TcpReason::Pairing, false),
            counts: Some(crate::pending::Counts::default()),
        })
    }

    fn slot(
        local: Option<SocketAddr>,
        peer: Option<SocketAddr>,
        reason: TcpReason,
        server: bool,
    ) -> Option<(Arc<StatFile>, usize)> {
        let unspecified = SocketAddr::from(([0, 0, 0, 0], 0));
        let role = if server { Role::Server } else { Role::Client };
        crate::runtime::stat_file().and_then(|f| {
            let slot = f.open_slot(
                role,
                local.unwrap_or(unspecified),
                peer.unwrap_or(unspecified),
            )?;
            f.set_path(slot, ConnPath::Tcp, Some(reason), 0);
            Some((f, slot))
        })
    }

    pub fn counts(&self) -> Option<&crate::pending::Counts> {
        self.counts.as_ref()
    }

    /// Why it is (or stays) on TCP.
    pub fn set_reason(&self, reason: TcpReason) {
        if let Some((f, slot)) = &self.stat {
            f.set_path(*slot, ConnPath::Tcp, Some(reason), 0);
        }
    }

    pub fn count(&self, sent: u64, received: u64) {
        if let Some((f, slot)) = &self.stat {
            f.add_tcp(*slot, sent, received);
        }
    }

    /// Make the program's data call `f` on the socket, counted: what it
    /// sent (`sent`) or took (a peek takes nothing).
    pub fn call(&self, sent: bool, peek: bool, f: impl FnOnce() -> isize) -> isize {
        if let Some(c) = &self.counts {
            c.busy.fetch_add(1, Ordering::SeqCst);
        }
        let r = f();
        if r > 0 {
            let n = r as u64;
            if let Some(c) = &self.counts {
                if sent {
                    c.sent.fetch_add(n, Ordering::SeqCst);
                } else if !peek {
                    c.taken.fetch_add(n, Ordering::SeqCst);
                }
            }
            if sent {
                self.count(n, 0);
            } else if !peek {
                self.count(0, n);
            }
        }
        if let Some(c) = &self.counts {
            c.busy.fetch_sub(1, Ordering::SeqCst);
        }
        r
    }
}

impl Drop for TcpConn {
    fn drop(&mut self) {
        if let Some((f, slot)) = &self.stat {
            f.close_slot(*slot);
        }
    }
}
