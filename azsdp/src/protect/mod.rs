//! Page protection for in-flight buffers.
//!
//! - [`uffd`]: a full userfaultfd: write protection for sends, armed
//!   receives (MISSING + `UFFDIO_MOVE`), and kernel accesses (a syscall
//!   writing a protected page) wait instead of failing.
//! - [`mprotect`]: `mprotect` + SIGSEGV, the fallback. Syscalls writing a
//!   protected page fail with EFAULT, so it is used only when asked for.
//!
//! [`open`] applies the `protection` policy (`docs/protection.md`): under
//! `auto`, a host without a full userfaultfd protects nothing and zero-copy
//! sends run synchronously (ZSDP), which the connection's counters show
//! (`fallback_reason: NoProtection`) and the log says once.

pub mod mprotect;
#[cfg(test)]
mod test_support;
pub mod uffd;

use crate::sync::Lock;
use std::ops::Range;
use std::time::Duration;

/// The contract (sans-IO, in `azsdp-proto`): what the driver asks of page
/// protection.
pub use azsdp_proto::protect::{NoProtection, Protector};

/// Why protection is not available, or failed.
#[derive(Debug, thiserror::Error)]
pub enum ProtectError {
    /// No full userfaultfd: without it a syscall writing a protected page
    /// would get EFAULT, so nothing may be protected (run as ZSDP).
    #[error("no full userfaultfd (needs root, CAP_SYS_PTRACE or /dev/userfaultfd access): {0}")]
    Unavailable(String),
    #[error("cannot register {range:x?} with userfaultfd: {why}")]
    Register { range: Range<u64>, why: String },
    #[error("protection change failed on {range:x?}: {why}")]
    Ioctl { range: Range<u64>, why: String },
    #[error("cannot arm {range:x?}: {why}")]
    Arm { range: Range<u64>, why: String },
}

/// A fault a handler thread read.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Fault {
    pub addr: u64,
    pub write: bool,
    /// A write-protect fault (as opposed to a missing page).
    pub wp: bool,
}

/// Called, by whichever thread learns of it, when a fault waits; it must
/// not block.
pub type FaultWaker = std::sync::Arc<dyn Fn() + Send + Sync>;

/// Where a connection's faults come from.
pub trait FaultSource: Send + Sync {
    /// The next fault waiting, if any (never blocks).
    fn try_next(&self) -> Option<Fault>;
    /// The next fault, waiting at most `timeout` (for a thread of its own:
    /// tests and examples).
    fn next_timeout(&self, timeout: Duration) -> Option<Fault>;
    /// How a reactor learns that faults wait: a descriptor that polls
    /// readable while they do (`Some`), or else `waker`, called when one
    /// arrives.
    fn watch(&self, waker: FaultWaker) -> Option<i32>;
}

/// The `protection` setting: which mechanism guards in-flight pages.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum ProtectionMode {
    /// A full userfaultfd if the process can have one; otherwise none
    /// (zero-copy sends are synchronous).
    #[default]
    Auto,
    /// Only a full userfaultfd (same as `auto`, but the log calls a
    /// missing one an error of configuration).
    Userfaultfd,
    /// `mprotect` + SIGSEGV: works anywhere, but a syscall writing an
    /// in-flight buffer fails with EFAULT.
    Mprotect,
    /// Never protect: ZSDP for zero-copy sends.
    Off,
}

/// Which mechanism a [`Protection`] uses.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Backend {
    Userfaultfd,
    Mprotect,
    None,
}

/// A protector and its fault source, as chosen by [`open`].
pub struct Protection {
    pub protector: Box<dyn Protector + Send>,
    pub faults: Option<Box<dyn FaultSource>>,
    pub backend: Backend,
    /// Why the backend is not the best one, if it is not.
    pub note: Option<String>,
}

impl std::fmt::Debug for Protection {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Protection")
            .field("backend", &self.backend)
            .field("note", &self.note)
            .finish()
    }
}

impl Protection {
    fn none(note: Option<String>) -> Protection {
        Protection {
            protector: Box::new(NoProtection),
            faults: None,
            backend: Backend::None,
            note,
        }
    }
}

/// Pick the protection `mode` asks for on this host. Never fails: without
/// a usable mechanism, nothing is protected and the note says why (logged
/// once per process).
pub fn open(mode: ProtectionMode) -> Protection {
    let p = match mode {
        ProtectionMode::Off => Protection::none(None),
        ProtectionMode::Auto | ProtectionMode::Userfaultfd => match uffd::UffdProtect::new() {
            Ok(u) => {
                let faults: Box<dyn FaultSource> = Box::new(u.faults());
                Protection {
                    protector: Box::new(u),
                    faults: Some(faults),
                    backend: Backend::Userfaultfd,
                    note: None,
                }
            }
            Err(e) => Protection::none(Some(format!(
                "{e}; zero-copy sends are synchronous (ZSDP). `protection = \"mprotect\"` \
                 protects anyway, at the cost of EFAULT from syscalls that write in-flight buffers"
            ))),
        },
        ProtectionMode::Mprotect => match mprotect::MprotectProtect::new() {
            Ok(m) => {
                let faults: Box<dyn FaultSource> = Box::new(m.faults());
                Protection {
                    protector: Box::new(m),
                    faults: Some(faults),
                    backend: Backend::Mprotect,
                    note: Some(
                        "mprotect protection: syscalls that write in-flight buffers fail with EFAULT"
                            .into(),
                    ),
                }
            }
            Err(e) => {
                Protection::none(Some(format!("{e}; zero-copy sends are synchronous (ZSDP)")))
            }
        },
    };
    if let Some(note) = &p.note {
        log_once(note);
    }
    p
}

static SAID: Lock<Vec<String>> = Lock::new(Vec::new());

/// The locks of this module, held by the fork handler across `fork()`.
pub(crate) fn fork_guards() -> Vec<Box<dyn std::any::Any>> {
    let mut g: Vec<Box<dyn std::any::Any>> = vec![Box::new(SAID.lock())];
    g.extend(uffd::fork_guards());
    g
}

/// Say `note` once per process, through [`crate::notes`] (never straight
/// to the program's stderr).
pub(crate) fn log_once(note: &str) {
    let mut said = SAID.lock();
    if !said.iter().any(|s| s == note) {
        said.push(note.to_string());
        drop(said);
        crate::notes::note(note);
    }
}
