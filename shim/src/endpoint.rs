//! The endpoint an upgraded connection runs: shared memory to a peer on
//! this host, or (with the `verbs` feature) an RDMA queue pair. One type,
//! so that a connection's driver, its stat row and the shim's calls are the
//! same whichever fabric carries it; each method passes to the fabric.

use std::os::fd::{BorrowedFd, OwnedFd};
use std::sync::Arc;
use std::sync::atomic::AtomicU32;
use std::time::Duration;

use azsdp::conn::{CasTarget, LockRegion, OpError, OpId, RemoteBuf};
use azsdp::driver::reactor::Mail;
use azsdp::fabric::shm::{ShmEndpoint, ShmWaiter};
#[cfg(feature = "verbs")]
use azsdp::fabric::verbs::{VerbsEndpoint, VerbsWaiter};
use azsdp::fabric::{
    Armed, Departure, Fabric, FabricError, FabricEvent, FabricWaiter, LocalBuf, RegAccess, Sharing,
    Watched,
};
use azsdp::transport::Endpoint;

// One per connection, inside its driver's heap allocation: the variants'
// sizes do not matter, and a box would cost every call a pointer chase.
#[allow(clippy::large_enum_variant)]
pub enum AnyEndpoint {
    Shm(ShmEndpoint),
    #[cfg(feature = "verbs")]
    Verbs(VerbsEndpoint),
}

pub enum AnyWaiter {
    Shm(ShmWaiter),
    #[cfg(feature = "verbs")]
    Verbs(VerbsWaiter),
}

/// `$body` with `$e` bound to the fabric's endpoint (or waiter).
macro_rules! each {
    ($ty:ident, $self:expr, $e:ident => $body:expr) => {
        match $self {
            $ty::Shm($e) => $body,
            #[cfg(feature = "verbs")]
            $ty::Verbs($e) => $body,
        }
    };
}

impl AnyEndpoint {
    /// The fabric's name, as `azsdp stat` shows it.
    pub fn fabric_name(&self) -> &'static str {
        match self {
            AnyEndpoint::Shm(_) => "shm",
            // The copy-on-write lock by message, not by the NICs' atomics
            // (`VerbsEndpoint::lock_by_message`); receive destinations
            // registered on demand, not pinned.
            #[cfg(feature = "verbs")]
            AnyEndpoint::Verbs(e) => {
                match (e.lock_by_message().is_some(), e.receives_on_demand()) {
                    (false, false) => "verbs",
                    (true, false) => "verbs-msglock",
                    (false, true) => "verbs-odp",
                    (true, true) => "verbs-msglock-odp",
                }
            }
        }
    }

    /// What the fabric waits for, if it can say (for a stall's report).
    pub fn describe(&self) -> Option<String> {
        match self {
            AnyEndpoint::Shm(_) => None,
            #[cfg(feature = "verbs")]
            AnyEndpoint::Verbs(e) => Some(e.describe()),
        }
    }

    /// Why the fabric broke, if it did and can say (shm: why the first
    /// operation found the peer unreachable; verbs: the completion or
    /// event that ended the queue pair).
    pub fn broken_reason(&self) -> Option<String> {
        match self {
            AnyEndpoint::Shm(e) => e.first_failure().map(str::to_string),
            #[cfg(feature = "verbs")]
            AnyEndpoint::Verbs(e) => e.broken_reason().map(str::to_string),
        }
    }

    /// The shared-memory endpoint, if that is the fabric (exec parking and
    /// fork claims are shm's).
    pub fn shm(&self) -> Option<&ShmEndpoint> {
        match self {
            AnyEndpoint::Shm(e) => Some(e),
            #[cfg(feature = "verbs")]
            AnyEndpoint::Verbs(_) => None,
        }
    }
}

impl std::fmt::Debug for AnyEndpoint {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        each!(AnyEndpoint, self, e => e.fmt(f))
    }
}

impl FabricWaiter for AnyWaiter {
    fn prepare(&self) -> u32 {
        each!(AnyWaiter, self, w => w.prepare())
    }
    fn wait(&self, ticket: u32, timeout: Duration, spin: bool) {
        each!(AnyWaiter, self, w => w.wait(ticket, timeout, spin))
    }
    fn sleep(&self, ticket: u32, timeout: Duration) {
        each!(AnyWaiter, self, w => w.sleep(ticket, timeout))
    }
    fn kick(&self) {
        each!(AnyWaiter, self, w => w.kick())
    }
    fn fd(&self) -> Option<i32> {
        each!(AnyWaiter, self, w => w.fd())
    }
    fn ticket_moves_on_arrival(&self) -> bool {
        each!(AnyWaiter, self, w => w.ticket_moves_on_arrival())
    }
}

impl Fabric for AnyEndpoint {
    fn lock_region(&self) -> LockRegion {
        each!(AnyEndpoint, self, e => e.lock_region())
    }
    fn post_register(
        &mut self,
        op: OpId,
        addr: u64,
        len: u64,
        access: RegAccess,
    ) -> Result<(), FabricError> {
        each!(AnyEndpoint, self, e => e.post_register(op, addr, len, access))
    }
    fn deregister(&mut self, key: u32) {
        each!(AnyEndpoint, self, e => e.deregister(key))
    }
    fn peer_vouched(&mut self) -> bool {
        each!(AnyEndpoint, self, e => e.peer_vouched())
    }

    fn unpin_near(&mut self, range: std::ops::Range<u64>) -> bool {
        each!(AnyEndpoint, self, e => e.unpin_near(range))
    }
    fn has_room(&self, len: usize) -> bool {
        each!(AnyEndpoint, self, e => e.has_room(len))
    }
    fn post_message(&mut self, msg: &[u8]) -> Result<(), FabricError> {
        each!(AnyEndpoint, self, e => e.post_message(msg))
    }
    fn post_get(
        &mut self,
        op: OpId,
        src: RemoteBuf,
        dst: LocalBuf,
        len: u64,
    ) -> Result<(), FabricError> {
        each!(AnyEndpoint, self, e => e.post_get(op, src, dst, len))
    }
    fn post_cas(
        &mut self,
        op: OpId,
        target: CasTarget,
        expect: u64,
        new: u64,
    ) -> Result<(), FabricError> {
        each!(AnyEndpoint, self, e => e.post_cas(op, target, expect, new))
    }
    fn pool_alloc(&mut self, len: u64) -> Result<u64, OpError> {
        each!(AnyEndpoint, self, e => e.pool_alloc(len))
    }
    fn pool_fill(&mut self, addr: u64, len: u64, fill: &mut dyn FnMut(&mut [u8])) {
        each!(AnyEndpoint, self, e => e.pool_fill(addr, len, fill))
    }
    fn pool_free(&mut self, addr: u64, len: u64) {
        each!(AnyEndpoint, self, e => e.pool_free(addr, len))
    }
    fn revoke_access(&mut self) {
        each!(AnyEndpoint, self, e => e.revoke_access())
    }
    fn poll(&mut self, on_event: &mut dyn FnMut(FabricEvent<'_>)) -> usize {
        each!(AnyEndpoint, self, e => e.poll(on_event))
    }
    fn wait(&self, timeout: Duration) {
        each!(AnyEndpoint, self, e => Fabric::wait(e, timeout))
    }
    fn arm(&mut self, fired: bool) -> Armed {
        each!(AnyEndpoint, self, e => e.arm(fired))
    }
    fn completions_pending(&self) -> bool {
        each!(AnyEndpoint, self, e => e.completions_pending())
    }
    fn gets_async(&self) -> bool {
        each!(AnyEndpoint, self, e => e.gets_async())
    }
    fn sharing(&self) -> &dyn Sharing {
        each!(AnyEndpoint, self, e => e.sharing())
    }
    fn finish(&self) {
        each!(AnyEndpoint, self, e => e.finish())
    }
    fn publish_progress(&mut self, progress: Departure) {
        each!(AnyEndpoint, self, e => e.publish_progress(progress))
    }
}

impl Watched for AnyEndpoint {
    fn set_bell(&mut self, token: u64, bell: BorrowedFd<'_>) {
        each!(AnyEndpoint, self, e => e.set_bell(token, bell))
    }
    fn peer_exit_fd(&self) -> Option<Arc<OwnedFd>> {
        each!(AnyEndpoint, self, e => e.peer_exit_fd())
    }
    fn take_mail(&mut self, mail: Mail) {
        each!(AnyEndpoint, self, e => e.take_mail(mail))
    }
    fn peer_suspect(&mut self) {
        each!(AnyEndpoint, self, e => e.peer_suspect())
    }
    fn ring_at(&mut self, loop_bell: u32) {
        each!(AnyEndpoint, self, e => e.ring_at(loop_bell))
    }
}

impl Endpoint for AnyEndpoint {
    type Waiter = AnyWaiter;
    fn waiter(&self) -> AnyWaiter {
        match self {
            AnyEndpoint::Shm(e) => AnyWaiter::Shm(Endpoint::waiter(e)),
            #[cfg(feature = "verbs")]
            AnyEndpoint::Verbs(e) => AnyWaiter::Verbs(Endpoint::waiter(e)),
        }
    }
    fn peer_pid(&self) -> u32 {
        each!(AnyEndpoint, self, e => Endpoint::peer_pid(e))
    }
    fn get_refused(&self) -> Option<String> {
        each!(AnyEndpoint, self, e => e.get_refused())
    }
    fn same_user(&self) -> bool {
        each!(AnyEndpoint, self, e => Endpoint::same_user(e))
    }
    fn arms_receives(&self) -> bool {
        each!(AnyEndpoint, self, e => Endpoint::arms_receives(e))
    }
    fn reads_ahead(&self) -> bool {
        each!(AnyEndpoint, self, e => Endpoint::reads_ahead(e))
    }
    fn agreement(&self) -> &AtomicU32 {
        each!(AnyEndpoint, self, e => Endpoint::agreement(e))
    }
}
