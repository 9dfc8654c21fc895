//! Making `verbs` connections with rdma_cm, in the RDMA TCP port space.
//!
//! The client resolves the address and the route, makes its queue pair
//! and posts its receives, then connects with a [`Request`] in the private
//! data; the server takes the request from its [`VerbsListener`], checks
//! it, and accepts with its own receives (or rejects). Every step is
//! bounded by the caller's time limit.

use std::net::SocketAddr;
use std::time::{Duration, Instant};

use rdma_mummy_sys::rdma_cm_event_type::*;
use thiserror::Error;

use super::endpoint::{Parts, PeerParams, VerbsEndpoint, VerbsParams};
use super::ffi::{self, CmEvent, CmId, CompChannel, Cq, EventChannel, Pd};
use super::hello::{HelloError, Reply, Request, Ring};

/// Why a connection could not be made: each a reason `azsdp stat` shows.
#[derive(Debug, Error)]
pub enum ConnectError {
    #[error("no RDMA device")]
    NoDevice,
    #[error("no RDMA route to the peer: {0}")]
    Route(String),
    #[error("the peer rejected the connection")]
    Rejected,
    #[error("the peer is not azsdp (no listener, or another program's)")]
    NotAzsdp,
    #[error("the peer's answer is malformed: {0}")]
    Malformed(HelloError),
    #[error("timed out ({0})")]
    Timeout(&'static str),
    #[error("{0}")]
    Io(#[from] std::io::Error),
}

impl ConnectError {
    /// The reason's short name, as `azsdp stat` shows it.
    pub fn reason(&self) -> &'static str {
        match self {
            ConnectError::NoDevice => "no-rdma-device",
            ConnectError::Route(_) => "rdma-route",
            ConnectError::Rejected => "cm-rejected",
            ConnectError::NotAzsdp => "peer-not-azsdp",
            ConnectError::Malformed(_) => "cm-malformed",
            ConnectError::Timeout(_) => "cm-timeout",
            ConnectError::Io(_) => "rdma-error",
        }
    }
}

fn left(until: Instant) -> Duration {
    until.saturating_duration_since(Instant::now())
}

fn ms(d: Duration) -> i32 {
    d.as_millis().clamp(1, i32::MAX as u128) as i32
}

/// Wait for the event that ends a step on `id`'s channel.
fn step(
    events: &EventChannel,
    until: Instant,
    what: &'static str,
) -> Result<CmEvent, ConnectError> {
    events.next(left(until)).ok_or(ConnectError::Timeout(what))
}

fn parts(id: CmId, events: EventChannel) -> Result<Parts, ConnectError> {
    let ctx = id.context();
    if ctx.is_null() {
        return Err(ConnectError::NoDevice);
    }
    let caps = ffi::device_caps(ctx)?;
    let pd = Pd::new(ctx)?;
    let comp = CompChannel::new(ctx)?;
    let cq = Cq::new(ctx, 1024, &comp)?;
    Ok(Parts {
        id,
        events,
        pd,
        comp,
        cq,
        caps,
    })
}

fn ring(p: &VerbsParams) -> Ring {
    Ring {
        count: p.ring,
        slot: p.slot,
    }
}

/// Connect to `dst` (from `src`, if given), asking to pair `request`'s TCP
/// connection; returns the established endpoint.
pub fn connect(
    dst: SocketAddr,
    src: Option<SocketAddr>,
    mut request: Request,
    params: VerbsParams,
    timeout: Duration,
) -> Result<VerbsEndpoint, ConnectError> {
    if ffi::device_count() == 0 {
        return Err(ConnectError::NoDevice);
    }
    let until = Instant::now() + timeout;
    let events = EventChannel::new()?;
    let id = CmId::new(&events)?;
    id.resolve_addr(src, dst, ms(left(until)))?;
    let e = step(&events, until, "address")?;
    if e.kind() != RDMA_CM_EVENT_ADDR_RESOLVED {
        return Err(ConnectError::Route(format!(
            "{} ({})",
            e.name(),
            e.status()
        )));
    }
    drop(e);
    id.resolve_route(ms(left(until)))?;
    let e = step(&events, until, "route")?;
    if e.kind() != RDMA_CM_EVENT_ROUTE_RESOLVED {
        return Err(ConnectError::Route(format!(
            "{} ({})",
            e.name(),
            e.status()
        )));
    }
    drop(e);
    let mut ep = VerbsEndpoint::new(parts(id, events)?, params)?;
    let caps_depth = ep.read_depth();
    request.ring = ring(&params);
    request.locks_by_message = ep.own_words_by_message();
    ep.id().connect(&request.emit(), caps_depth)?;
    let e = step(ep.events(), until, "connect")?;
    match e.kind() {
        RDMA_CM_EVENT_ESTABLISHED => match Reply::parse(&e.private_data()) {
            Ok(Reply::Accept {
                ring: r,
                locks_by_message,
            }) => {
                drop(e);
                ep.set_peer(PeerParams {
                    ring: r.count,
                    slot: r.slot,
                    locks_by_message,
                });
                Ok(ep)
            }
            Ok(Reply::Reject) => Err(ConnectError::Rejected),
            Err(m) => Err(ConnectError::Malformed(m)),
        },
        // No listener on the port (the peer's RDMA stack answers for it),
        // or one that rejects with data that is not ours.
        RDMA_CM_EVENT_REJECTED => match Reply::parse(&e.private_data()) {
            Ok(_) => Err(ConnectError::Rejected),
            Err(_) => Err(ConnectError::NotAzsdp),
        },
        RDMA_CM_EVENT_UNREACHABLE | RDMA_CM_EVENT_CONNECT_ERROR => Err(ConnectError::Route(
            format!("{} ({})", e.name(), e.status()),
        )),
        _ => Err(ConnectError::Route(e.name().to_string())),
    }
}

/// An rdma_cm listener on an address and port.
#[derive(Debug)]
pub struct VerbsListener {
    // The id before its channel.
    id: CmId,
    events: EventChannel,
}

/// A connection request taken from a [`VerbsListener`].
#[derive(Debug)]
pub struct Incoming {
    id: CmId,
    pub request: Request,
    /// Where the request came from, as the kernel's RDMA stack says.
    pub from: Option<SocketAddr>,
}

impl VerbsListener {
    pub fn bind(addr: SocketAddr, backlog: i32) -> std::io::Result<VerbsListener> {
        let events = EventChannel::new()?;
        let id = CmId::new(&events)?;
        id.bind(addr)?;
        id.listen(backlog)?;
        Ok(VerbsListener { id, events })
    }

    /// Polls readable when a request may be waiting.
    pub fn fd(&self) -> i32 {
        self.events.fd()
    }

    /// The next request, waiting up to `timeout`. A request that is not
    /// ours is rejected here.
    pub fn next(&self, timeout: Duration) -> Option<Result<Incoming, HelloError>> {
        let until = Instant::now() + timeout;
        loop {
            let e = self.events.next(left(until))?;
            if e.kind() != RDMA_CM_EVENT_CONNECT_REQUEST {
                continue;
            }
            // SAFETY: the new id of a connect request, ours from now on.
            let Some(id) = (unsafe { CmId::adopt(e.id()) }) else {
                continue;
            };
            let data = e.private_data();
            drop(e);
            let from = id.addresses().1;
            return Some(match Request::parse(&data) {
                Ok(request) => Ok(Incoming { id, request, from }),
                Err(m) => {
                    id.reject(&Reply::Reject.emit());
                    Err(m)
                }
            });
        }
    }

    pub fn local(&self) -> Option<SocketAddr> {
        self.id.addresses().0
    }
}

impl Incoming {
    /// Accept: our queue pair, receives posted, established within
    /// `timeout`.
    pub fn accept(
        self,
        params: VerbsParams,
        timeout: Duration,
    ) -> Result<VerbsEndpoint, ConnectError> {
        let until = Instant::now() + timeout;
        let events = EventChannel::new()?;
        self.id.migrate(&events)?;
        let peer = PeerParams {
            ring: self.request.ring.count,
            slot: self.request.ring.slot,
            locks_by_message: self.request.locks_by_message,
        };
        let mut ep = VerbsEndpoint::new(parts(self.id, events)?, params)?;
        ep.set_peer(peer);
        let depth = ep.read_depth();
        let reply = Reply::Accept {
            ring: ring(&params),
            locks_by_message: ep.own_words_by_message(),
        };
        ep.id().accept(&reply.emit(), depth)?;
        let e = step(ep.events(), until, "establish")?;
        if e.kind() != RDMA_CM_EVENT_ESTABLISHED {
            return Err(ConnectError::Route(e.name().to_string()));
        }
        Ok(ep)
    }

    pub fn reject(self) {
        self.id.reject(&Reply::Reject.emit());
    }
}
