//! The server side of pairing: a listener's registration, and matching the
//! connections `accept()` returns with the clients' requests.

use std::collections::HashMap;
use std::io::Read;
use std::net::SocketAddr;
use std::os::linux::net::SocketAddrExt;
use std::os::unix::net::{SocketAddr as UnixAddr, UnixListener, UnixStream};
use std::sync::Arc;
use std::sync::Mutex;
use std::sync::atomic::Ordering;
use std::time::{Duration, Instant};

use azsdp::config::Settings;
use azsdp::conn::Role;
use azsdp::fabric::shm::{ShmEndpoint, ShmParams};
use azsdp::pairing::{Agreement, PairRequest, REQUEST_LEN, registry_name};
use azsdp::stats::TcpReason;

use crate::conn::Conn;
use crate::log::{debug, info};
use crate::net;

/// Requests older than this were abandoned by their clients.
const STALE: Duration = Duration::from_secs(30);

struct Pending {
    stream: UnixStream,
    request: PairRequest,
    since: Instant,
}

/// A listening socket registered for pairing.
pub struct Listener {
    unix: UnixListener,
    pub addr: SocketAddr,
    pub settings: Settings,
    pending: Mutex<HashMap<u16, Pending>>,
}

/// Shm segment sizes for a connection with `s`.
pub fn shm_params(s: &Settings) -> ShmParams {
    ShmParams {
        ring_capacity: (s.bsdp_buffer.max(64 << 10) * 2)
            .next_power_of_two()
            .min(64 << 20) as usize,
        poll: s.poll,
        ..ShmParams::default()
    }
}

impl Listener {
    /// Register `addr` (the listening socket's own address). `None` if
    /// another listener holds the name (then connections here stay TCP).
    pub fn register(addr: SocketAddr, settings: Settings) -> Option<Arc<Listener>> {
        let name = registry_name(addr);
        let ua = UnixAddr::from_abstract_name(name.as_bytes()).ok()?;
        match UnixListener::bind_addr(&ua) {
            Ok(unix) => {
                unix.set_nonblocking(true).ok()?;
                debug!("listener {addr} registered as @{name}");
                Some(Arc::new(Listener {
                    unix,
                    addr,
                    settings,
                    pending: Mutex::new(HashMap::new()),
                }))
            }
            Err(e) => {
                info!(
                    "listener {addr} not registered for azsdp (@{name}: {e}); its connections stay on TCP"
                );
                None
            }
        }
    }

    /// Take in the requests that arrived (each was sent before its TCP
    /// connect, so an accepted connection's request is already here).
    fn drain(&self, pending: &mut HashMap<u16, Pending>) {
        pending.retain(|_, p| p.since.elapsed() < STALE);
        while let Ok((stream, _)) = self.unix.accept() {
            if stream.set_nonblocking(false).is_err() {
                continue;
            }
            net::set_timeouts(&stream, Duration::from_millis(200));
            let mut b = [0u8; REQUEST_LEN];
            let got = (&stream).read_exact(&mut b);
            let request = match got
                .map_err(|e| e.to_string())
                .and_then(|()| PairRequest::parse(&b).map_err(|e| e.to_string()))
            {
                Ok(r) => r,
                Err(e) => {
                    debug!("listener {}: dropped a pair request: {e}", self.addr);
                    continue;
                }
            };
            // The pid is the kernel's word, not the client's.
            if net::peer_pid(&stream) != Some(request.client_pid) {
                debug!(
                    "listener {}: pair request claims pid {}, which is not the sender's",
                    self.addr, request.client_pid
                );
                continue;
            }
            pending.insert(
                request.client_port,
                Pending {
                    stream,
                    request,
                    since: Instant::now(),
                },
            );
        }
    }

    /// `accept()` returned a TCP connection from `peer` to `local`:
    /// upgrade it if its client asked to; otherwise why not.
    pub fn upgrade(
        &self,
        local: SocketAddr,
        peer: SocketAddr,
        s: &Settings,
    ) -> Result<Arc<Conn>, TcpReason> {
        if !net::is_local(peer.ip()) {
            return Err(TcpReason::PeerRemote);
        }
        let p = {
            let mut pending = self.pending.lock().unwrap_or_else(|e| e.into_inner());
            self.drain(&mut pending);
            pending.remove(&peer.port())
        };
        let Some(p) = p else {
            return Err(TcpReason::PeerNotAzsdp);
        };
        if s.use_ == azsdp::config::Use::Tcp {
            // Dropping the side channel tells the client at once.
            return Err(TcpReason::Rule);
        }
        if p.request.dst.port() != local.port() {
            return Err(TcpReason::Mismatch);
        }
        net::set_timeouts(&p.stream, s.pair_timeout);
        let ep = ShmEndpoint::offer(&p.stream, shm_params(s)).map_err(|e| {
            debug!("{local} <- {peer}: shm setup failed: {e}");
            TcpReason::SetupFailed
        })?;
        let word = ep.agreement();
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
        Conn::start(ep, Role::Server, s, local, peer).map_err(|e| {
            debug!("{local} <- {peer}: azsdp handshake failed: {e}");
            TcpReason::SetupFailed
        })
    }
}
