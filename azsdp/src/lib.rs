//! azsdp: transparent, asynchronous, zero-copy sockets (AZ-SDP).
//!
//! This crate holds everything that is independent of the operating system:
//!
//! - [`wire`]: the message formats, with strict `parse`/`emit`;
//! - [`conn`]: the sans-IO connection engine (BSDP, ZSDP, AZ-SDP, copy-on-write);
//! - [`fabric`]: the verbs-like transport trait and the deterministic `sim` provider;
//! - [`sim`]: the simulation harness that drives two engines over the sim fabric
//!   and checks the protocol's invariants;
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
