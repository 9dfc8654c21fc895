//! Page protection for in-flight buffers.
//!
//! - [`uffd`]: write-protect with a full userfaultfd (faults in the kernel
//!   are caught too, so syscalls wait instead of failing).
//!
//! Still to come (intra-host issue): armed receives (MISSING mode + staging +
//! UFFDIO_MOVE), the mprotect + SIGSEGV fallback, and the fault-handler
//! thread that feeds a running engine.

pub mod uffd;
