//! azsdp: transparent, asynchronous, zero-copy sockets (AZ-SDP).
//!
//! The protocol, and what runs it on Linux:
//!
//! - sans-IO, no system calls: [`wire`] (message formats, strict
//!   `parse`/`emit`), [`conn`] (the connection engine: BSDP, ZSDP, AZ-SDP,
//!   copy-on-write), [`pages`], [`time`], [`fabric`]'s types with the
//!   deterministic `sim` provider, and [`sim`] (the simulation harness that
//!   checks the protocol's invariants);
//! - the host: [`driver`] (runs a connection over a fabric in a process, and
//!   its threaded form), [`fabric`]'s `shm` provider, [`protect`] (page
//!   protection: userfaultfd, mprotect), [`memory_map`], [`process`] (live
//!   connections, memory hooks, fork), [`pairing`], [`identity`] and
//!   [`sock_diag`] (who the peer is, from the kernel), [`stats`], [`sync`];
//! - [`config`]: the configuration file, environment overrides and rules.
//!
//! See `docs/architecture.md` and `docs/protocol.md` in the repository.

pub mod config;
pub mod conn;
pub mod driver;
pub mod fabric;
pub mod file_size;
pub mod fork_once;
pub mod futex;
pub mod id_map;
pub mod identity;
pub mod memory_map;
pub mod notes;
pub mod pages;
pub mod pairing;
pub mod process;
pub mod protect;
pub mod sim;
pub mod sock_diag;
pub mod stats;
pub mod sync;
pub mod threads;
pub mod time;
pub mod wire;
