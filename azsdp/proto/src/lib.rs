//! azsdp-proto: the AZ-SDP protocol without the operating system.
//!
//! Everything here is deterministic and performs no system call; the
//! compiler enforces it (this crate depends on no OS crate):
//!
//! - [`wire`]: message formats, strict `parse`/`emit`;
//! - [`conn`]: the connection engine (BSDP, ZSDP, AZ-SDP, copy-on-write):
//!   events in, actions out;
//! - [`fabric`]: the contract a transport implements (posted
//!   registrations with keys, messages with credits, GET, compare-and-swap,
//!   a pool, one waiter, revocation), and its deterministic `sim` provider;
//! - [`protect`]: the contract page protection implements;
//! - [`driver`]: the one driver that executes the engine's actions over a
//!   fabric and a protector, generic over its [`driver::Host`] (memory and
//!   clock): the `azsdp` crate runs it on Linux, [`sim`] runs the very same
//!   driver in simulated time;
//! - [`pages`], [`time`], [`id_map`]: small pieces the others share.
//!
//! See `docs/architecture.md` in the repository.

pub mod conn;
pub mod driver;
pub mod fabric;
pub mod id_map;
pub mod pages;
pub mod protect;
pub mod sim;
pub mod time;
pub mod wire;
