//! The fabric contract and its `sim` provider (from `azsdp-proto`), and the
//! providers that need the operating system: [`shm`] (intra-host: rings in
//! a memfd, GET = `process_vm_readv`) and [`verbs`] (between hosts: an RC
//! queue pair on rdma-core, GET = RDMA READ; the queue pair needs the
//! `verbs` cargo feature).

pub use azsdp_proto::fabric::*;

use std::os::fd::{BorrowedFd, OwnedFd};
use std::sync::Arc;

use crate::driver::reactor::Mail;

/// What the process's reactor ([`crate::driver::reactor`]) needs of an
/// endpoint beyond the sans-IO contract: how the peer rings this side, and
/// what tells that the peer's process is gone.
pub trait Watched: Fabric {
    /// The reactor's token for this side and the bell it listens on: the
    /// peer rings the token there when it posts to an armed side.
    fn set_bell(&mut self, _token: u64, _bell: BorrowedFd<'_>) {}
    /// A descriptor that fires when the peer's process exits, shared by
    /// every connection to that process (a pidfd).
    fn peer_exit_fd(&self) -> Option<Arc<OwnedFd>> {
        None
    }
    /// Mail for this side came on the bell (a claim after the peer forked).
    fn take_mail(&mut self, _mail: Mail) {}
    /// The peer's process may have exited: ask now, not at the next look.
    fn peer_suspect(&mut self) {}
    /// Where the peer rings this side once armed: one of this process's
    /// loop bells (`shm::loop_bell`), or its bell (0).
    fn ring_at(&mut self, _loop_bell: u32) {}
}

pub mod pool;
pub mod ring;
pub mod shm;
pub mod verbs;
