//! The driver on Linux: the one [`Driver`] of `azsdp-proto`, on a
//! [`ProcessHost`] (the application's memory by address, the monotonic
//! clock, the kernel's memory map). Programs that own their sockets
//! (examples, benchmarks, tests) call it directly; the preload shim runs it
//! through [`threaded::ThreadedDriver`].
//!
//! Page protection comes from a [`Protector`]. Without one
//! ([`NoProtection`]) the engine is told it cannot protect or arm pages, so
//! zero-copy sends are synchronous (ZSDP) and receives wait for their data.
//!
//! `unsafe` here: [`ProcessHost`] reads and writes application buffers by
//! address, as the engine asks.

use std::ops::Range;
use std::sync::Arc;
use std::time::{Duration, Instant};

use crate::beneath::TcpBeneath;
use crate::conn::{Resend, ResendPiece, Unprotectable, UserMemory};
use crate::time::Timestamp;

pub use azsdp_proto::driver::{Host, Protectable, UnparkError, capabilities, ownership};
pub use azsdp_proto::protect::{NoProtection, Protector};

pub mod delegation;
mod holders;
pub mod lease;
pub mod reactor;
pub mod standby;
pub mod threaded;

/// The one driver, on this process.
pub type Driver<F, P> = azsdp_proto::driver::Driver<F, P, ProcessHost>;

/// This process as the driver's host.
///
/// The engine reads and writes memory only for ranges of calls that are
/// blocked in the driver (their buffers are borrowed for the duration of
/// the call), and never for ranges it has protected or armed.
#[derive(Debug)]
pub struct ProcessHost {
    epoch: Instant,
    /// The time as first read since [`ProcessHost::clock_moves`] (0: not
    /// read yet): one hold of the driver's lock reads the clock once.
    read_at: std::cell::Cell<u64>,
    /// Turn private file mappings a send comes from into anonymous memory
    /// ([`crate::anonymize`]).
    pub convert_private_files: bool,
    /// The TCP socket beneath the connection, if it has one.
    pub beneath: Option<Arc<TcpBeneath>>,
    /// How long writing the resend to it may take.
    pub write_timeout: Duration,
}

impl Default for ProcessHost {
    fn default() -> Self {
        ProcessHost {
            epoch: Instant::now(),
            read_at: std::cell::Cell::new(0),
            convert_private_files: true,
            beneath: None,
            write_timeout: Duration::from_secs(30),
        }
    }
}

impl UserMemory for ProcessHost {
    fn read(&mut self, addr: u64, out: &mut [u8]) {
        // SAFETY: `addr..addr+out.len()` is part of a buffer passed to a
        // blocked send/recv call of this driver (see the type's contract).
        unsafe { std::ptr::copy_nonoverlapping(addr as *const u8, out.as_mut_ptr(), out.len()) };
    }

    fn write(&mut self, addr: u64, data: &[u8]) {
        // SAFETY: as for `read`; the destination is a receive buffer borrowed
        // mutably by the blocked call.
        unsafe { std::ptr::copy_nonoverlapping(data.as_ptr(), addr as *mut u8, data.len()) };
    }

    fn copy(&mut self, from: u64, to: u64, len: usize) {
        // SAFETY: `from` is staging memory of the fabric's pool that a
        // landed GET filled and the engine keeps until this copy is done;
        // `to` as for `write`. The two never overlap (the pool is ours).
        unsafe { std::ptr::copy_nonoverlapping(from as *const u8, to as *mut u8, len) };
    }
}

impl ProcessHost {
    /// The next [`Host::now`] reads the clock again: called as a hold of
    /// the driver's lock ends. Within one hold, the engine's every step
    /// sees one time (a turn is microseconds; its timers are
    /// milliseconds), and a call costs one clock read, not one per step (a
    /// `clock_gettime` per step was 5% of an event loop's client, ab).
    pub fn clock_moves(&self) {
        self.read_at.set(0);
    }
}

impl Host for ProcessHost {
    fn now(&self) -> Timestamp {
        let mut at = self.read_at.get();
        if at == 0 {
            // (At least 1: 0 means not read.)
            at = (self.epoch.elapsed().as_nanos() as u64).max(1);
            self.read_at.set(at);
        }
        Timestamp::from_nanos(at)
    }

    /// Only private anonymous memory, or shared memory whose aliases a
    /// protector can follow (see [`crate::memory_map`]).
    fn protectable(&mut self, pages: &Range<u64>) -> Protectable {
        use crate::memory_map::{self as map, NotProtectable as Not};
        match map::check(pages) {
            Ok(map::Protectable::Private) => Protectable::Private,
            Ok(map::Protectable::Aliased) => Protectable::Aliased,
            Err(Not::File) if self.convert_private_files && crate::anonymize::anonymize(pages) => {
                Protectable::Private
            }
            Err(why) => Protectable::No(match why {
                Not::File => Unprotectable::File,
                Not::Shared => Unprotectable::Shared,
                Not::MainStack => Unprotectable::MainStack,
                Not::ReadOnly => Unprotectable::ReadOnly,
                Not::Unmapped | Not::Special => Unprotectable::Other,
            }),
        }
    }

    fn memory_changed(&mut self) {
        crate::memory_map::invalidate();
    }

    fn stream_clean(&mut self) -> bool {
        self.beneath.as_ref().is_none_or(|b| b.waiting() == 0)
    }

    fn write_stream(&mut self, r: &Resend) -> bool {
        let Some(b) = &self.beneath else {
            return false;
        };
        let pieces: Vec<&[u8]> = r
            .pieces
            .iter()
            .map(|p| match p {
                ResendPiece::Bytes(v) => v.as_slice(),
                // SAFETY: our own memory the engine still holds for the
                // resend: advertised pages (write-protected, or the buffer
                // of a call that has not returned) or a copy in the
                // fabric's pool; released only once this returns.
                ResendPiece::Memory { addr, len } => unsafe {
                    std::slice::from_raw_parts(*addr as *const u8, *len as usize)
                },
            })
            .collect();
        let deadline = Instant::now() + self.write_timeout;
        match b.write_all(&pieces, r.shutdown, deadline) {
            Ok(()) => true,
            Err(e) => {
                crate::protect::log_once(&format!("writing to TCP on leaving the fabric: {e}"));
                b.reset();
                false
            }
        }
    }
}
