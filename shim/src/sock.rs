//! A TCP socket the shim looks after, and what it has become.

use azsdp::sync::{Lock, RwLock};
use std::net::SocketAddr;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::time::Duration;

use azsdp::stats::TcpReason;

use crate::conn::{Conn, TcpConn};
use crate::listener::Listener;

/// What a tracked socket is now.
#[derive(Clone)]
pub enum Role {
    /// Created, not yet listening or connected.
    Fresh,
    /// Listening, registered for pairing.
    Listener(Arc<Listener>),
    /// Listening, but its connections stay on TCP, for this reason (a
    /// rule, its registry name taken, a bad configuration).
    Unpaired(TcpReason),
    /// Upgraded: data goes over the azsdp fabric.
    Azsdp(Arc<Conn>),
    /// Connected over plain TCP (counted for `azsdp stat`).
    Tcp(Arc<TcpConn>),
    /// Connected over TCP while the pair is under way (`crate::pending`).
    Pairing(Arc<crate::pending::Pending>),
}

/// A kernel epoll set this socket was added to while it was plain TCP.
#[derive(Clone, Copy, Debug)]
pub struct EpollReg {
    pub epfd: i32,
    pub fd: i32,
    pub events: u32,
    pub data: u64,
}

/// Options the shim itself honours.
#[derive(Clone, Copy, Debug, Default)]
pub struct Opts {
    pub rcvtimeo: Option<Duration>,
    pub sndtimeo: Option<Duration>,
    /// SO_LINGER {on, 0}: close resets.
    pub linger_abort: bool,
}

pub struct Sock {
    pub family: i32,
    /// O_NONBLOCK of the open file (shared by dup'd descriptors).
    pub nonblocking: AtomicBool,
    /// Descriptors of this process naming it.
    pub fds: AtomicUsize,
    role: RwLock<Role>,
    pub opts: Lock<Opts>,
    pub kernel_epolls: Lock<Vec<EpollReg>>,
    /// A non-blocking `connect()` said EINPROGRESS for a connection that
    /// was already made: the next `connect()` says 0, as the kernel's does
    /// once the handshake is over (later ones EISCONN).
    pub connect_pending: AtomicBool,
}

impl Sock {
    pub fn new(family: i32, nonblocking: bool) -> Arc<Sock> {
        Arc::new(Sock {
            family,
            nonblocking: AtomicBool::new(nonblocking),
            fds: AtomicUsize::new(1),
            role: RwLock::new(Role::Fresh),
            opts: Lock::new(Opts::default()),
            kernel_epolls: Lock::new(Vec::new()),
            connect_pending: AtomicBool::new(false),
        })
    }

    pub fn role(&self) -> Role {
        self.role.read().clone()
    }

    pub fn set_role(&self, r: Role) {
        *self.role.write() = r;
    }

    /// Replace the role if it is still connection `c` (two threads may
    /// find a connection moved at once: one takes the move).
    pub fn replace_conn(&self, c: &Arc<Conn>, with: Role) -> bool {
        let mut r = self.role.write();
        if matches!(&*r, Role::Azsdp(x) if Arc::ptr_eq(x, c)) {
            *r = with;
            true
        } else {
            false
        }
    }

    pub fn conn(&self) -> Option<Arc<Conn>> {
        match &*self.role.read() {
            Role::Azsdp(c) => Some(Arc::clone(c)),
            _ => None,
        }
    }

    pub fn is_nonblocking(&self) -> bool {
        self.nonblocking.load(Ordering::Relaxed)
    }

    pub fn opts(&self) -> Opts {
        *self.opts.lock()
    }

    /// The connection stays on plain TCP, for `reason`.
    pub fn stay_tcp(
        &self,
        local: Option<SocketAddr>,
        peer: Option<SocketAddr>,
        reason: TcpReason,
        server: bool,
    ) {
        self.set_role(Role::Tcp(TcpConn::new(local, peer, reason, server)));
    }
}
