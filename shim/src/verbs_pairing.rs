//! Pairing over verbs, between hosts (or two RDMA devices of one host, by
//! rule): the client in `connect()`, the listener's side in a thread of
//! its own and in `accept()`. The protocol is `azsdp::fabric::verbs::pairing`
//! (docs/shim.md, "Between hosts"); the program's descriptor stays a kernel
//! TCP socket, and nothing of ours is ever written on it.

use std::net::{IpAddr, Ipv4Addr, Ipv6Addr, SocketAddr};
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};

use azsdp::config::Settings;
use azsdp::conn::Role;
use azsdp::fabric::verbs::hello::{Request, Ring};
use azsdp::fabric::verbs::pairing::{PairMsg, WaitingTable};
use azsdp::fabric::verbs::reads::ReadSplit;
use azsdp::fabric::verbs::{
    self, ConnectError, SharedFlag, VerbsEndpoint, VerbsListener, VerbsParams,
};
use azsdp::stats::TcpReason;
use azsdp::sync::Lock;
use libc::c_int;

use crate::conn::Conn;
use crate::connect::{Outcome, kernel_connect};
use crate::endpoint::AnyEndpoint;
use crate::log::{debug, info, warning};
use crate::net;

/// Requests a listener holds for connections not accepted yet, in all
/// and from one address.
const WAITING_TOTAL: usize = 1024;
const WAITING_PER_SOURCE: usize = 256;

/// How long the listener's thread gives one RDMA connection to be
/// established.
const ESTABLISH_WAIT: Duration = Duration::from_secs(5);

fn params(s: &Settings) -> VerbsParams {
    VerbsParams {
        poll: s.poll,
        lock: s.rdma_lock,
        odp: s.rdma_odp,
        read_split: ReadSplit {
            piece: s.rdma_read_piece.min(u64::from(u32::MAX)) as u32,
            ..ReadSplit::default()
        },
        ..VerbsParams::default()
    }
}

fn reason_of(e: &ConnectError) -> TcpReason {
    match e {
        ConnectError::NoDevice => TcpReason::NoRdmaDevice,
        ConnectError::Route(_) => TcpReason::RdmaRoute,
        ConnectError::Rejected => TcpReason::CmRejected,
        ConnectError::NotAzsdp | ConnectError::Malformed(_) => TcpReason::PeerNotAzsdp,
        ConnectError::Timeout(_) => TcpReason::CmTimeout,
        ConnectError::Io(_) => TcpReason::SetupFailed,
    }
}

/// The address this host would send from to reach `dst` (the kernel's
/// route, asked with an unsent UDP socket).
fn source_toward(dst: SocketAddr) -> Option<IpAddr> {
    let any: SocketAddr = if dst.is_ipv4() {
        "0.0.0.0:0".parse().ok()?
    } else {
        "[::]:0".parse().ok()?
    };
    let u = std::net::UdpSocket::bind(any).ok()?;
    u.connect(dst).ok()?;
    Some(u.local_addr().ok()?.ip())
}

fn nonce() -> u64 {
    let mut n = 0u64;
    // SAFETY: 8 bytes into a local.
    unsafe { libc::getrandom((&raw mut n).cast(), 8, libc::GRND_NONBLOCK) };
    n
}

/// `connect(fd, dst)` over verbs: the RDMA connection first (so that the
/// listener holds it before our TCP connection reaches its `accept()`),
/// then the kernel's, then the listener's BIND for it.
pub fn connect(
    fd: c_int,
    family: c_int,
    dst: SocketAddr,
    nonblocking: bool,
    settings: &Settings,
    plain: &dyn Fn(TcpReason) -> Outcome,
) -> Outcome {
    let Some(port) = ensure_port(fd, family) else {
        return plain(TcpReason::SetupFailed);
    };
    let bound = net::local_of(fd)
        .map(|a| a.ip())
        .filter(|ip| !ip.is_unspecified());
    let src = bound.or_else(|| source_toward(dst));
    let request = Request {
        ring: Ring { count: 0, slot: 0 },
        nonce: nonce(),
        tcp_client_port: port,
        tcp_server_port: dst.port(),
        // (Set by `connect`, which knows the device.)
        locks_by_message: false,
    };
    let deadline = Instant::now() + settings.pair_timeout;
    let mut ep = match verbs::connect(
        dst,
        src.map(|ip| SocketAddr::new(ip, 0)),
        request,
        params(settings),
        settings.pair_timeout,
    ) {
        Ok(ep) => ep,
        Err(e) if settings.use_ == azsdp::config::Use::Azsdp => {
            debug!("connect {dst}: no verbs connection ({e}) and the rule says azsdp only");
            return Outcome::Tcp(-1, libc::ECONNREFUSED, None);
        }
        Err(e) => {
            debug!("connect {dst}: stays on TCP: {e}");
            return plain(reason_of(&e));
        }
    };
    // Dropping `ep` from here disconnects: the listener stays on TCP too.
    match kernel_connect(fd, dst, nonblocking, settings.pair_timeout) {
        Ok(true) => {}
        Ok(false) => return Outcome::Tcp(-1, libc::EINPROGRESS, Some(TcpReason::PairTimeout)),
        Err(e) => return Outcome::Tcp(-1, e, None),
    }
    let local = net::local_of(fd).unwrap_or(SocketAddr::new(
        src.unwrap_or(IpAddr::V4(std::net::Ipv4Addr::UNSPECIFIED)),
        port,
    ));
    let tcp_now = |reason: TcpReason| Outcome::Tcp(0, 0, Some(reason));
    let bind = match ep.take_first(deadline).map(|m| PairMsg::parse(&m)) {
        Ok(Ok(b)) => b,
        Ok(Err(e)) => {
            warning!("connect {dst}: the listener's pairing message is malformed ({e}); TCP");
            return tcp_now(TcpReason::PeerUnverified);
        }
        Err(e) => {
            debug!("connect {dst}: not bound ({e}); TCP");
            return tcp_now(TcpReason::PairTimeout);
        }
    };
    let expected = PairMsg::Bind {
        client_port: local.port(),
        server_port: dst.port(),
    };
    if bind != expected {
        warning!("connect {dst}: the listener bound {bind:?}, not our connection; TCP");
        return tcp_now(TcpReason::Mismatch);
    }
    if let Err(e) = ep.send_first(&PairMsg::Confirm.emit()) {
        debug!("connect {dst}: cannot confirm ({e}); TCP");
        return tcp_now(TcpReason::PairTimeout);
    }
    Outcome::Azsdp(Conn::start(
        AnyEndpoint::Verbs(ep),
        fd,
        Role::Client,
        settings,
        local,
        dst,
        None,
    ))
}

/// An RDMA connection the listener's thread took, for the TCP connection
/// it claims.
struct Waiting {
    ep: Lock<Option<Result<VerbsEndpoint, String>>>,
}

/// A listener's verbs side: an rdma_cm listener on its address and port,
/// and a thread that takes its requests.
pub struct VerbsAccepts {
    addr: SocketAddr,
    table: Lock<WaitingTable<Arc<Waiting>>>,
    stop: AtomicBool,
    /// A process forked from this one accepts on the listening socket (a
    /// pre-forked server): the RDMA connections this process's thread
    /// accepts could be bound only to the TCP connections this process
    /// accepts, so the thread refuses requests from then on and clients
    /// fall back to TCP at once (`cm-rejected`), not after `pair_timeout`.
    copies_accept: SharedFlag,
}

impl VerbsAccepts {
    /// Listen on `addr` (the TCP listener's) over RDMA, if this host can.
    pub fn start(addr: SocketAddr, s: &Settings) -> Option<Arc<VerbsAccepts>> {
        if verbs::device_count() == 0 {
            debug!("listener {addr}: no RDMA device; TCP and shm only");
            return None;
        }
        let l = match VerbsListener::bind(addr, libc::SOMAXCONN) {
            Ok(l) => l,
            Err(e) => {
                info!("listener {addr}: no RDMA listener ({e}); TCP and shm only");
                return None;
            }
        };
        let me = Arc::new(VerbsAccepts {
            addr,
            table: Lock::new(WaitingTable::new(
                WAITING_TOTAL,
                WAITING_PER_SOURCE,
                (s.pair_timeout * 2).max(Duration::from_secs(2)),
            )),
            stop: AtomicBool::new(false),
            copies_accept: match SharedFlag::new() {
                Ok(f) => f,
                Err(e) => {
                    info!("listener {addr}: no RDMA listener ({e})");
                    return None;
                }
            },
        });
        let run = Arc::clone(&me);
        let p = params(s);
        match azsdp::threads::spawn("azsdp-rdma-cm", move || run.serve(l, p)) {
            Ok(_) => {
                debug!("listener {addr}: RDMA listener up");
                Some(me)
            }
            Err(e) => {
                info!("listener {addr}: no RDMA listener thread ({e})");
                None
            }
        }
    }

    pub fn stop(&self) {
        self.stop.store(true, Ordering::SeqCst);
    }

    /// The thread: take each request, hold it under the TCP connection it
    /// claims, accept it.
    fn serve(&self, l: VerbsListener, p: VerbsParams) {
        let _inside = azsdp::process::Inside::enter();
        while !self.stop.load(Ordering::SeqCst) && verbs::stack_is_ours() {
            let expired = self.table.lock().expire(Instant::now());
            drop(expired);
            let incoming = match l.next(Duration::from_millis(200)) {
                None => continue,
                Some(Err(e)) => {
                    debug!("listener {}: refused an RDMA request: {e}", self.addr);
                    continue;
                }
                Some(Ok(i)) => i,
            };
            let Some(from) = incoming.from else {
                incoming.reject();
                continue;
            };
            if self.copies_accept.is_set() {
                debug!(
                    "listener {}: RDMA request from {from} rejected: forked processes accept \
                     on this listener (a pre-forked server), and an RDMA connection stays with \
                     the process that accepts it",
                    self.addr
                );
                incoming.reject();
                continue;
            }
            if incoming.request.tcp_server_port != self.addr.port() {
                debug!(
                    "listener {}: an RDMA request from {from} for port {}; rejected",
                    self.addr, incoming.request.tcp_server_port
                );
                incoming.reject();
                continue;
            }
            let w = Arc::new(Waiting {
                ep: Lock::new(None),
            });
            // Held before we accept, so before the client's TCP connection
            // exists: accept() finds it.
            let claim = (net::canonical(from.ip()), incoming.request.tcp_client_port);
            let inserted = self
                .table
                .lock()
                .insert(claim, Arc::clone(&w), Instant::now());
            if let Err((_, why)) = inserted {
                debug!(
                    "listener {}: RDMA request from {from} rejected: {why}",
                    self.addr
                );
                incoming.reject();
                continue;
            }
            let r = incoming
                .accept(p, ESTABLISH_WAIT)
                .map_err(|e| e.to_string());
            *w.ep.lock() = Some(r);
        }
    }

    /// `accept()` returned the TCP connection `fd` from `peer`: if an RDMA
    /// connection claims it, pair them (`Some`, upgraded or why not);
    /// `None` if none claims it.
    pub fn upgrade(
        &self,
        fd: c_int,
        local: SocketAddr,
        peer: SocketAddr,
        s: &Settings,
    ) -> Option<Result<Arc<Conn>, TcpReason>> {
        if !verbs::stack_is_ours() {
            if !self.copies_accept.is_set() {
                info!(
                    "listener {}: a forked process accepts here: from now on its clients stay \
                     on TCP (cm-rejected)",
                    self.addr
                );
                self.copies_accept.set();
            }
            return None;
        }
        let taken = self
            .table
            .lock()
            .take((net::canonical(peer.ip()), peer.port()));
        let w = match taken {
            Ok(w) => w?,
            Err(all) => {
                warning!(
                    "{local} <- {peer}: {} RDMA requests claim this connection (an impostor \
                     on the client's host?); none is bound, it stays on TCP",
                    all.len()
                );
                return Some(Err(TcpReason::PeerUnverified));
            }
        };
        let deadline = Instant::now() + s.pair_timeout * 2;
        // The thread may be between its accept and the establishment.
        let ep = loop {
            if let Some(r) = w.ep.lock().take() {
                break r;
            }
            if Instant::now() >= deadline {
                break Err("not established in time".into());
            }
            std::thread::sleep(Duration::from_millis(1));
        };
        let mut ep = match ep {
            Ok(ep) => ep,
            Err(e) => {
                debug!("{local} <- {peer}: the RDMA connection failed ({e}); TCP");
                return Some(Err(TcpReason::CmTimeout));
            }
        };
        if s.use_ == azsdp::config::Use::Tcp {
            return Some(Err(TcpReason::Rule));
        }
        let bind = PairMsg::Bind {
            client_port: peer.port(),
            server_port: local.port(),
        };
        let confirmed = ep
            .send_first(&bind.emit())
            .and_then(|()| ep.take_first(deadline))
            .and_then(|m| PairMsg::parse(&m).map_err(|e| e.to_string()));
        match confirmed {
            Ok(PairMsg::Confirm) => Some(Ok(Conn::start(
                AnyEndpoint::Verbs(ep),
                fd,
                Role::Server,
                s,
                local,
                peer,
                None,
            ))),
            Ok(other) => {
                warning!("{local} <- {peer}: the client answered {other:?}, not CONFIRM; TCP");
                Some(Err(TcpReason::PeerUnverified))
            }
            Err(e) => {
                debug!("{local} <- {peer}: the client did not confirm ({e}); TCP");
                Some(Err(TcpReason::PairTimeout))
            }
        }
    }
}

/// Bind `fd` to an ephemeral port if the program did not bind it; the
/// port names the connection in an RDMA request.
fn ensure_port(fd: c_int, family: c_int) -> Option<u16> {
    if let Some(a) = net::local_of(fd)
        && a.port() != 0
    {
        return Some(a.port());
    }
    let any = if family == libc::AF_INET6 {
        SocketAddr::new(IpAddr::V6(Ipv6Addr::UNSPECIFIED), 0)
    } else {
        SocketAddr::new(IpAddr::V4(Ipv4Addr::UNSPECIFIED), 0)
    };
    let (st, len) = net::to_storage(any);
    // SAFETY: bind to our own encoded address.
    let r = unsafe { crate::real::bind(fd, (&raw const st).cast(), len) };
    if r != 0 {
        return None;
    }
    net::local_of(fd).map(|a| a.port()).filter(|p| *p != 0)
}
