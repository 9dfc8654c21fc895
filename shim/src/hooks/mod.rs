//! The interposed C functions, by family: connection set-up
//! ([`sockets`]), data ([`data`], batches in [`batched`], files and pipes
//! in [`file_data`], and the `_FORTIFY_SOURCE` variants in [`fortify`]),
//! readiness ([`readiness`]), descriptors and options ([`descriptors`]),
//! process and memory ([`process`]), programs spawned inside libc
//! ([`spawn`]).
//!
//! Each one first asks whether the descriptor is a socket the shim looks
//! after (one relaxed load for the others) and otherwise calls libc's own
//! function. No panic leaves these functions: [`guard`] turns one into
//! `EIO`.
//!
//! `unsafe` here: the C calling convention and the program's pointers,
//! which are passed on or read within the lengths given, as libc would.

#![allow(clippy::missing_safety_doc)]

mod batched;
mod data;
mod descriptors;
#[cfg(target_arch = "x86_64")]
mod exec_variadic;
mod file_data;
mod fortify;
mod process;
mod readiness;
mod sockets;
mod spawn;

use std::panic::AssertUnwindSafe;

use azsdp::config::{RuleInput, Settings};
use azsdp::conn::Role as EngineRole;
use libc::{c_int, ssize_t};

use crate::{real, runtime};

/// What an interposed call's result says about success.
pub(super) trait CallResult {
    fn failed(&self) -> bool;
}

impl CallResult for c_int {
    fn failed(&self) -> bool {
        *self < 0
    }
}

impl CallResult for ssize_t {
    fn failed(&self) -> bool {
        *self < 0
    }
}

/// The body of an interposed call. errno is the program's: libc's functions
/// leave it alone when they succeed, so after a successful call it is what
/// it was before, whatever our own work on the way (lazy set-up, futex
/// waits, probes) did to it; after a failure it is what the body left, the
/// real call's error (cleanup after a failed real call keeps errno, see
/// [`real::KeepErrno`]).
pub(super) fn hook<R: CallResult>(body: impl FnOnce() -> R) -> R {
    let before = real::errno();
    let r = body();
    if !r.failed() {
        real::set_errno(before);
    }
    r
}

/// Our own work around a memory call: no panic escapes and errno is left
/// as it was (the program's `free` or `mmap` must not see it change).
pub(super) fn quietly(f: impl FnOnce()) {
    let _keep = real::KeepErrno::new();
    let _ = std::panic::catch_unwind(AssertUnwindSafe(f));
}

/// Run `f`; a panic becomes `fail` with errno EIO.
pub(super) fn guard<T>(fail: T, f: impl FnOnce() -> T) -> T {
    match std::panic::catch_unwind(AssertUnwindSafe(f)) {
        Ok(v) => v,
        Err(_) => {
            real::set_errno(libc::EIO);
            fail
        }
    }
}

pub(crate) fn settings_for(
    role: EngineRole,
    addr: std::net::IpAddr,
    port: u16,
) -> Option<Settings> {
    let cfg = runtime::config()?;
    Some(
        cfg.decide(&RuleInput {
            program: runtime::program(),
            role,
            addr,
            port,
        })
        .settings,
    )
}
