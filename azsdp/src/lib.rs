//! azsdp: transparent, asynchronous, zero-copy sockets (AZ-SDP).
//!
//! The protocol, and what runs it on Linux:
//!
//! - sans-IO, no system calls, in the `azsdp-proto` crate (which depends on
//!   no OS crate) and re-exported here: [`wire`] (message formats, strict
//!   `parse`/`emit`), [`conn`] (the connection engine: BSDP, ZSDP, AZ-SDP,
//!   copy-on-write), the [`fabric`] contract with its deterministic `sim`
//!   provider, the protection contract ([`protect::Protector`]), the one
//!   driver ([`driver::Driver`]), [`pages`], [`time`], and [`sim`] (the
//!   simulation that runs that driver and checks the protocol's
//!   invariants);
//! - the host: [`driver`]'s Linux host ([`driver::ProcessHost`]), threaded
//!   form and reactor, [`fabric`]'s `shm` provider, the [`transport`]
//!   contract the shim pairs over, [`protect`] (page
//!   protection: userfaultfd, mprotect), [`memory_map`], [`process`] (live
//!   connections, memory hooks, fork), [`pairing`], [`identity`] and
//!   [`sock_diag`] (who the peer is, from the kernel), [`stats`], [`sync`];
//! - [`config`]: the configuration file, environment overrides and rules.
//!
//! See `docs/architecture.md` and `docs/protocol.md` in the repository.

pub use azsdp_proto::{conn, id_map, sim, time, wire};

pub mod anonymize;
pub mod beneath;
pub mod busy_poll;
pub mod config;
pub mod driver;
pub mod fabric;
pub mod file_size;
pub mod fork_once;
pub mod futex;
pub mod identity;
pub mod listener_proofs;
pub mod memory_map;
pub mod monotonic;
pub mod notes;
pub mod own_ioctl;
pub mod pages;
pub mod pair_history;
pub mod pairing;
pub mod pinned;
pub mod poll_fd;
pub mod process;
pub mod protect;
pub mod released_memory;
pub mod sandbox;
pub(crate) mod scm;
pub mod sock_diag;
pub mod stats;
pub mod sync;
pub mod threads;
pub mod transport;

#[cfg(test)]
mod test_files;
