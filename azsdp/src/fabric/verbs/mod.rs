//! The `verbs` fabric: two hosts (or two RDMA devices) over an RC queue
//! pair, on rdma-core (`rdma-mummy-sys` `dlopen`s libibverbs and librdmacm
//! at run time, so a binary built with it runs, and finds no device, on a
//! host without them).
//!
//! - [`wire`]: the header of every SEND (credits), and [`credits`], the
//!   SDP-style flow control it carries: receives are pre-posted and
//!   credited, so the queue pair never needs RNR retries.
//! - [`hello`]: rdma_cm's private data when a connection is made.
//! - [`reg_cache`]: an endpoint's registrations, exact ranges shared while
//!   live.
//! - [`reads`]: GETs as RDMA READs, a long one cut into pieces in flight
//!   together, within the send queue's room.
//! - [`pairing`]: binding a verbs connection to the TCP connection it
//!   upgrades (the commit messages and the listener's waiting table).
//! - `cm` (feature `verbs`): making connections with rdma_cm.
//! - `endpoint` (feature `verbs`): the fabric contract on the queue pair
//!   (its table maps each operation to its verb).
//! - `loopback` (feature `verbs`): our own lock words through the device,
//!   when its atomics are not the CPU's.
//! - `ffi` (feature `verbs`): every unsafe rdma-core call, as owned handles.
//!
//! The protocol-level mapping is in docs/protocol.md ("Over verbs").

pub mod credits;
pub mod hello;
pub mod pairing;
pub mod reads;
pub mod reg_cache;
pub mod wire;

#[cfg(feature = "verbs")]
mod cm;
#[cfg(feature = "verbs")]
mod endpoint;
#[cfg(feature = "verbs")]
mod ffi;
#[cfg(feature = "verbs")]
mod fork_words;
#[cfg(feature = "verbs")]
mod loopback;
#[cfg(feature = "verbs")]
mod waiter;

#[cfg(feature = "verbs")]
pub use cm::{ConnectError, Incoming, VerbsListener, connect};
#[cfg(feature = "verbs")]
pub use endpoint::{VerbsEndpoint, VerbsParams};
#[cfg(feature = "verbs")]
pub use ffi::{device_count, stack_is_ours};
#[cfg(feature = "verbs")]
pub use fork_words::SharedFlag;
#[cfg(feature = "verbs")]
pub use waiter::VerbsWaiter;
