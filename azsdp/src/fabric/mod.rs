//! The fabric contract and its `sim` provider (from `azsdp-proto`), and the
//! providers that need the operating system: [`shm`] (intra-host: rings in
//! a memfd, GET = `process_vm_readv`). `verbs` (rdma-core) comes with the
//! verbs issue.

pub use azsdp_proto::fabric::*;

pub mod pool;
pub mod ring;
pub mod shm;
