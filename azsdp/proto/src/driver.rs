//! The driver: one [`Connection`] run over one [`Fabric`] with one
//! [`Protector`], on a [`Host`] that gives it the application's memory and
//! a clock. It executes the engine's actions, posts its messages as far as
//! the fabric's credits allow, delivers the fabric's events, and runs the
//! engine's timers.
//!
//! There is one driver. The `azsdp` crate runs it in a real process (its
//! host reads memory by address and reads the monotonic clock; the shim
//! wraps it in threads); [`crate::sim`] runs the very same driver in
//! simulated time, over the simulated fabric and memory, under seeded
//! interleavings and fault injection.
//!
//! What the driver adds to the engine's actions:
//! - **registration is posted**: a source is protected, then registered
//!   for the peer; a GET's destination is registered for local writes
//!   first, and the GET is posted when its key is back (a NIC needs both
//!   keys); the destination's key is withdrawn when the GET is done;
//! - **copies aside** go to the fabric's pool, registered for the peer;
//! - **staging**: a GET into armed pages lands in the protector's staging
//!   pages, registered like any destination, and is moved into place when
//!   it is done;
//! - **flow control**: messages are taken from the engine only while the
//!   fabric has room for the largest one, so nothing queues here: a slow
//!   peer leaves them in the engine, whose credits push back to `send()`.

use std::ops::Range;
use std::time::Duration;

use crate::conn::{
    Access, Action, CallError, CallId, Capabilities, Completion, Connection, EngineConfig, OpError,
    OpId, RecvFlags, RemoteBuf, Resend, SendFlags, State, Ticket, Unprotectable, UserBuf,
    UserMemory,
};
use crate::fabric::{Fabric, FabricError, FabricEvent, LocalBuf, OpResult, RegAccess};
use crate::id_map::IdMap;
pub use crate::protect::{NoProtection, Protector};
use crate::time::Timestamp;

/// May whole pages be write-protected or armed (see [`Host::protectable`])?
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Protectable {
    /// Private memory: yes.
    Private,
    /// Memory that other mappings alias: only with a protector that
    /// protects the aliases too.
    Aliased,
    /// Memory that cannot be protected, and why.
    No(Unprotectable),
}

/// What the driver needs of the machine it runs on: the application's
/// memory (the engine's copies), a clock, and what kind of memory a
/// buffer is.
pub trait Host: UserMemory {
    /// Now, on a monotonic clock.
    fn now(&self) -> Timestamp;
    /// May the whole pages `pages` be protected?
    fn protectable(&mut self, pages: &Range<u64>) -> Protectable;
    /// Protecting or registering memory failed: what the host knows of the
    /// address space may be out of date.
    fn memory_changed(&mut self) {}
    /// Has nothing arrived on the TCP connection beneath (which stays unused
    /// while the connection is on the fabric)? A host without one says yes.
    fn stream_clean(&mut self) -> bool {
        true
    }
    /// Write `r` to the TCP connection beneath (the connection leaves the
    /// fabric: docs/protocol.md §8a), then shut its sending side if
    /// `r.shutdown`. Memory pieces are this host's own memory. False if it
    /// could not (no such connection, or it failed).
    fn write_stream(&mut self, r: &Resend) -> bool {
        let _ = r;
        false
    }
}

/// Capabilities a fabric and protector give an engine.
pub fn capabilities(can_get: bool, protector: &dyn Protector) -> Capabilities {
    Capabilities {
        zcopy_source: true,
        zcopy_sink: can_get,
        protect_send: protector.can_protect(),
        arm_recv: can_get && protector.can_arm(),
        cas: true,
    }
}

/// Operation ids the driver makes for its own steps; the engine's count up
/// from 1 and never get here.
const DRIVER_OPS: u64 = 1 << 63;

/// An operation between the engine's action and its completion.
#[derive(Debug)]
enum Step {
    /// A source's registration for the peer (the engine's own op), and
    /// the pages protected for it (lifted again if it fails: the engine
    /// takes a failed preparation to have protected nothing).
    Source { protect: Vec<Range<u64>> },
    /// A copy in the pool, being registered for the peer.
    Copy { op: OpId, addr: u64, len: u64 },
    /// A GET's destination, being registered; the GET follows.
    Sink {
        op: OpId,
        src: RemoteBuf,
        dst: u64,
        len: u64,
        staged: Option<Range<u64>>,
    },
    /// A GET in flight (the engine's op): its destination's key, and the
    /// armed range to land it in when it went to staging (and where the
    /// staging pages are).
    Get {
        key: u32,
        staged: Option<(Range<u64>, u64)>,
    },
}

/// A connection, its fabric, its protector and its host.
#[derive(Debug)]
pub struct Driver<F: Fabric, P: Protector, H: Host> {
    conn: Connection,
    fabric: F,
    protector: P,
    host: H,
    next_call: u64,
    done: IdMap<CallId, Result<u64, CallError>>,
    resumed: Vec<Ticket>,
    /// Page each pending fault is on, to wake its thread on `Resume`.
    fault_pages: IdMap<Ticket, u64>,
    next_ticket: u64,
    steps: IdMap<OpId, Step>,
    next_op: u64,
    /// A message the fabric refused although it said it had room (one at
    /// most: nothing is taken from the engine while it is here).
    refused: Option<Vec<u8>>,
    /// This side's resend, written to TCP once its SWITCH is out.
    resend: Option<Resend>,
    /// No new arms (a fork is pending: staging pages shared with a child
    /// could not be moved back).
    arms_paused: bool,
    buf: Vec<u8>,
    /// Completions taken from the fabric, kept to reuse its allocation.
    completed: Vec<(OpId, OpResult)>,
    /// The fabric reported the peer gone: nothing more comes from it.
    peer_left: bool,
    /// Longest single sleep while waiting.
    pub max_wait: Duration,
}

impl<F: Fabric, P: Protector, H: Host + Default> Driver<F, P, H> {
    /// Start a connection on a default host (the client side posts HELLO
    /// at once).
    pub fn new(cfg: EngineConfig, fabric: F, protector: P) -> Self {
        Self::with_host(cfg, fabric, protector, H::default())
    }
}

impl<F: Fabric, P: Protector, H: Host> Driver<F, P, H> {
    /// Start a connection on `host`.
    pub fn with_host(mut cfg: EngineConfig, fabric: F, protector: P, host: H) -> Self {
        cfg.lock_region = fabric.lock_region();
        if cfg.recv_protect == crate::conn::RecvProtect::Auto && !fabric.gets_async() {
            // Synchronous GETs land before recv() can return: never arm.
            cfg.recv_protect = crate::conn::RecvProtect::Off;
        }
        let now = host.now();
        let mut d = Driver {
            conn: Connection::new(cfg, now),
            fabric,
            protector,
            host,
            next_call: 1,
            done: IdMap::default(),
            resumed: Vec::new(),
            fault_pages: IdMap::default(),
            next_ticket: 1,
            steps: IdMap::default(),
            next_op: 0,
            refused: None,
            resend: None,
            arms_paused: false,
            buf: Vec::new(),
            completed: Vec::new(),
            peer_left: false,
            max_wait: Duration::from_millis(50),
        };
        d.drive();
        d
    }

    /// `SO_ERROR` (see [`Connection::take_error`]).
    pub fn take_error(&mut self) -> Option<CallError> {
        self.conn.take_error()
    }

    pub fn connection(&self) -> &Connection {
        &self.conn
    }

    /// How long the buffer messages are written into has grown.
    #[cfg(test)]
    pub(crate) fn transmit_buffer_len(&self) -> usize {
        self.buf.len()
    }

    pub fn fabric(&self) -> &F {
        &self.fabric
    }

    pub fn fabric_mut(&mut self) -> &mut F {
        &mut self.fabric
    }

    pub fn protector(&self) -> &P {
        &self.protector
    }

    pub fn host(&self) -> &H {
        &self.host
    }

    fn now(&self) -> Timestamp {
        self.host.now()
    }

    fn step_op(&mut self) -> OpId {
        self.next_op += 1;
        OpId(DRIVER_OPS | self.next_op)
    }

    /// Execute actions and post messages until the engine has nothing to
    /// say or the fabric has no room for more.
    pub fn drive(&mut self) {
        loop {
            let mut any = false;
            while let Some(a) = self.conn.poll_action() {
                any = true;
                self.exec(a);
            }
            // A provider that completed operations as they were posted
            // (shm) announces them to nobody: deliver them now.
            if self.fabric.completions_pending() && self.deliver() > 0 {
                continue;
            }
            if let Some(m) = self.refused.take() {
                match self.fabric.post_message(&m) {
                    Err(FabricError::NoCredits) => self.refused = Some(m),
                    // Posted, or the fabric is broken (it reports PeerGone).
                    _ => any = true,
                }
            }
            let need = self.conn.max_message_len();
            // What our calls have got to is published before the credits
            // that follow from it go out: a peer that sees us die takes
            // it for how far our programs read (see `handle_peer_left`).
            self.fabric.publish_progress(self.conn.progress_made());
            // Credits: take a message from the engine only when the fabric
            // has room for the largest it may be.
            while self.refused.is_none() && self.fabric.has_room(need) {
                let Some(len) = self.conn.next_transmit_len() else {
                    break;
                };
                if self.buf.len() < len {
                    self.buf.resize(len, 0);
                }
                let Some(n) = self.conn.poll_transmit(&mut self.buf) else {
                    break;
                };
                debug_assert!(n <= len, "a message longer than next_transmit_len");
                any = true;
                if let Err(FabricError::NoCredits) = self.fabric.post_message(&self.buf[..n]) {
                    self.refused = Some(self.buf[..n].to_vec());
                }
            }
            // The resend may block until the peer reads TCP, which it does
            // once it has our SWITCH: so that goes first. (An orphan
            // switch posts none, and its dead peer may take nothing.)
            if self.resend.is_some()
                && (self.conn.orphaned() || (self.refused.is_none() && !self.conn.has_transmit()))
                && let Some(r) = self.resend.take()
            {
                self.write_resend(r);
                continue;
            }
            if !any {
                // (Progress was published above, and nothing changed since.)
                return;
            }
        }
    }

    fn complete(&mut self, op: OpId, c: Completion) {
        let now = self.now();
        self.conn.handle_completion(now, op, c, &mut self.host);
    }

    /// Post a registration for step `step`; false if the fabric refused.
    fn register(&mut self, op: OpId, addr: u64, len: u64, access: RegAccess, step: Step) -> bool {
        self.steps.insert(op, step);
        if self.fabric.post_register(op, addr, len, access).is_err() {
            self.steps.remove(&op);
            return false;
        }
        true
    }

    fn exec(&mut self, a: Action) {
        match a {
            Action::PrepareSource {
                op,
                addr,
                len,
                protect,
            } => {
                // Registered first, protected once registered: a NIC
                // registers (pins) pages that are not write-protected yet,
                // and its READs of them never fault afterwards (`ibv_reg_mr`
                // of a protected range fails, or faults, per kernel). The
                // pages are the caller's until its send() returns, which is
                // after both.
                let posted =
                    self.register(op, addr, len, RegAccess::PeerRead, Step::Source { protect });
                if !posted {
                    // Perhaps the memory is not what the host thought.
                    self.host.memory_changed();
                    self.complete(op, Completion::Prepared(Err(OpError::Local)));
                }
            }
            Action::ReleaseSource { key, .. } => self.fabric.deregister(key),
            Action::Unprotect { range } => self.protector.unprotect(range),
            Action::Arm { op, range } => {
                let r = if self.arms_paused || !self.fabric.unpin_near(range.clone()) {
                    Err(OpError::Local)
                } else {
                    self.protector.arm(range)
                };
                self.complete(op, Completion::Armed(r));
            }
            Action::Disarm { range, outcome } => self.protector.disarm(range, outcome),
            Action::Get {
                op,
                src,
                dst,
                len,
                armed,
            } => {
                // An armed destination is written through its staging
                // pages, which `land` moves into place when the GET is done.
                let range = dst..dst + len;
                let (at, staged) = if armed {
                    match self.protector.staging(&range) {
                        Some(at) => (at, Some(range)),
                        None => {
                            self.complete(op, Completion::Get(Err(OpError::Local)));
                            return;
                        }
                    }
                } else {
                    (dst, None)
                };
                let sub = self.step_op();
                let sink = Step::Sink {
                    op,
                    src,
                    dst: at,
                    len,
                    staged,
                };
                if !self.register(sub, at, len, RegAccess::LocalWrite, sink) {
                    self.complete(op, Completion::Get(Err(OpError::Local)));
                }
            }
            Action::Cas {
                op,
                target,
                expect,
                new,
            } => {
                if self.fabric.post_cas(op, target, expect, new).is_err() {
                    self.complete(op, Completion::Cas(Err(OpError::Unreachable)));
                }
            }
            Action::CopyAside { op, addr, len } => {
                let at = match self.fabric.pool_alloc(len) {
                    Ok(at) => at,
                    Err(e) => {
                        self.complete(op, Completion::Copied(Err(e)));
                        return;
                    }
                };
                let host = &mut self.host;
                self.fabric
                    .pool_fill(at, len, &mut |bytes| host.read(addr, bytes));
                let sub = self.step_op();
                let copy = Step::Copy { op, addr: at, len };
                if !self.register(sub, at, len, RegAccess::PeerRead, copy) {
                    self.fabric.pool_free(at, len);
                    self.complete(op, Completion::Copied(Err(OpError::Local)));
                }
            }
            Action::ReleaseCopy { buf, len } => {
                self.fabric.deregister(buf.key);
                self.fabric.pool_free(buf.addr, len);
            }
            Action::PoolAlloc { op, len } => {
                let r = self.fabric.pool_alloc(len);
                self.complete(op, Completion::Pooled(r));
            }
            Action::PoolFree { addr, len } => self.fabric.pool_free(addr, len),
            Action::RevokeAccess => self.fabric.revoke_access(),
            Action::CallDone { call, result } => {
                self.done.insert(call, result);
            }
            Action::Resume { ticket } => match self.fault_pages.remove(&ticket) {
                // A fault: wake the thread stopped on that page.
                Some(page) => {
                    let size = u64::from(self.conn.config().page_size);
                    self.protector.wake(page..page + size);
                }
                // An evacuation: its caller polls `resumed`.
                None => self.resumed.push(ticket),
            },
            Action::CheckStream => {
                let (now, clean) = (self.now(), self.host.stream_clean());
                self.conn.stream_checked(now, clean, &mut self.host);
            }
            // Written once our SWITCH is out (see `drive`).
            Action::Resend(r) => self.resend = Some(r),
        }
    }

    /// Write this side's resend to TCP (both SWITCHes are out).
    fn write_resend(&mut self, r: Resend) {
        let now = self.now();
        if self.host.write_stream(&r) {
            self.conn.resend_written(now, &mut self.host);
            if self.conn.orphaned() {
                // The dead peer's heirs read it from TCP now.
                self.fabric.sharing().mark_peer_left();
            }
        } else {
            self.conn.stream_failed(now, &mut self.host);
        }
    }

    /// A registration the driver posted is done.
    fn registered(&mut self, op: OpId, r: Result<u32, OpError>) {
        match self.steps.remove(&op) {
            Some(Step::Source { protect }) => {
                let r = r.and_then(|key| {
                    if protect.is_empty() || self.protector.protect(&protect).is_ok() {
                        Ok(key)
                    } else {
                        self.fabric.deregister(key);
                        Err(OpError::Local)
                    }
                });
                if r.is_err() {
                    self.host.memory_changed();
                }
                self.complete(op, Completion::Prepared(r));
            }
            Some(Step::Copy { op, addr, len }) => {
                let r = r.map(|key| RemoteBuf { addr, key });
                if r.is_err() {
                    self.fabric.pool_free(addr, len);
                }
                self.complete(op, Completion::Copied(r));
            }
            Some(Step::Sink {
                op,
                src,
                dst,
                len,
                staged,
            }) => {
                let Ok(key) = r else {
                    self.complete(op, Completion::Get(Err(OpError::Local)));
                    return;
                };
                let was_staged = staged.is_some();
                let staged = staged.map(|range| (range, dst));
                self.steps.insert(op, Step::Get { key, staged });
                let dst = LocalBuf { addr: dst, key };
                if self.fabric.post_get(op, src, dst, len).is_err() {
                    self.steps.remove(&op);
                    self.fabric.deregister(key);
                    if was_staged {
                        // (The staging pages move back when disarmed.)
                        self.fabric.unpin_near(dst.addr..dst.addr + len);
                    }
                    self.complete(op, Completion::Get(Err(OpError::Local)));
                }
            }
            // Not ours to know (a fabric that completes what it never
            // got): nothing waits for it.
            Some(Step::Get { .. }) | None => {}
        }
    }

    /// A GET is done: withdraw its destination's key (a NIC's pinned
    /// pages cannot move while registered), then land staged data.
    fn got(&mut self, op: OpId, r: Result<(), OpError>) {
        let r = match self.steps.remove(&op) {
            Some(Step::Get { key, staged }) => {
                self.fabric.deregister(key);
                match staged {
                    Some((range, at)) => {
                        // The staging pages move into place: a registration
                        // the fabric would keep must not pin them.
                        self.fabric.unpin_near(at..at + (range.end - range.start));
                        r.and_then(|()| self.protector.land(&range))
                    }
                    None => r,
                }
            }
            _ => r,
        };
        self.complete(op, Completion::Get(r));
    }

    /// Deliver what the fabric has, and run timers; returns how many fabric
    /// events were delivered (0: nothing happened but timers).
    pub fn turn(&mut self) -> usize {
        let n = self.deliver();
        self.run_timers();
        n
    }

    /// Hand the fabric's events to the engine; messages go straight from
    /// the fabric's buffer (no copy). Their actions are left for `drive`.
    fn deliver(&mut self) -> usize {
        let now = self.now();
        let mut done = std::mem::take(&mut self.completed);
        let (conn, host, left) = (&mut self.conn, &mut self.host, &mut self.peer_left);
        let n = self.fabric.poll(&mut |e| match e {
            FabricEvent::Message(m) => conn.handle_message(now, m, host),
            // Completions need the fabric or the protector, which `poll`
            // holds: taken after it, in the order they came.
            FabricEvent::Done { op, result } => done.push((op, result)),
            FabricEvent::PeerGone { left: l, heir } => {
                *left = true;
                conn.handle_peer_left(now, l, heir, host);
            }
        });
        for (op, result) in done.drain(..) {
            match result {
                OpResult::Registered(r) => self.registered(op, r),
                OpResult::Get(r) => self.got(op, r),
                OpResult::Cas(r) => self.complete(op, Completion::Cas(r)),
            }
        }
        self.completed = done;
        n
    }

    /// Run the engine's timers that are due, and what they produce.
    pub fn run_timers(&mut self) {
        let now = self.now();
        // Asked only when the silence would end the connection.
        let silent_too_long = self
            .conn
            .deadline(crate::conn::Timer::PeerTimeout)
            .is_some_and(|t| t <= now);
        if silent_too_long && self.fabric.peer_vouched() {
            self.conn.peer_vouched(now);
        }
        if self.conn.poll_timeout().is_some_and(|t| t <= now) {
            self.conn.handle_timeout(now, &mut self.host);
        }
        self.drive();
    }

    /// Run until `call` is done; returns its result.
    fn wait_call(&mut self, call: CallId) -> Result<u64, CallError> {
        loop {
            self.drive();
            if let Some(r) = self.done.remove(&call) {
                return r;
            }
            self.turn();
            if let Some(r) = self.done.remove(&call) {
                return r;
            }
            let until = self
                .next_timeout()
                .map_or(self.max_wait, |t| t.min(self.max_wait));
            self.fabric.wait(until);
        }
    }

    fn call_id(&mut self) -> CallId {
        self.next_call += 1;
        CallId(self.next_call)
    }

    /// Start a `send()` of `len` bytes at `addr`; its result comes from
    /// [`Driver::take_result`]. The bytes must stay valid and unchanged by
    /// the caller until the result is in.
    pub fn submit_send(&mut self, addr: u64, len: u64, mut flags: SendFlags) -> CallId {
        if flags.protectable {
            flags.unprotectable = self.unprotectable(addr, len);
            flags.protectable = flags.unprotectable.is_none();
        }
        let call = self.call_id();
        let now = self.now();
        self.conn
            .send(now, call, UserBuf { addr, len }, flags, &mut self.host);
        self.drive();
        call
    }

    /// Start a `recv()` into `len` bytes at `addr` (which must stay valid
    /// and untouched by the caller until the result is in).
    pub fn submit_recv(&mut self, addr: u64, len: u64, mut flags: RecvFlags) -> CallId {
        // The host is asked (a system call) only for a receive the engine
        // could arm: not `&=`, which would ask for every receive.
        flags.armable = flags.armable
            && self.may_arm(addr, len, flags)
            && self.protector.can_arm()
            && self.unprotectable(addr, len).is_none();
        let call = self.call_id();
        let now = self.now();
        self.conn
            .recv(now, call, UserBuf { addr, len }, flags, &mut self.host);
        self.drive();
        call
    }

    /// Could the engine arm any of this receive's pages, by its settings
    /// (for the largest part it could arm: the buffer's whole pages)?
    fn may_arm(&self, addr: u64, len: u64, flags: RecvFlags) -> bool {
        let cfg = self.conn.config();
        let whole = crate::pages::whole_pages(addr, len, u64::from(cfg.page_size));
        !flags.peek && cfg.arms_pages(whole.end - whole.start)
    }

    /// Why the whole pages of `[addr, addr+len)` may not be protected or
    /// armed (`None`: they may). Buffers copied whatever the answer, or
    /// too small to hold a whole page, need no answer.
    fn unprotectable(&mut self, addr: u64, len: u64) -> Option<Unprotectable> {
        if !self.protector.can_protect() {
            return Some(Unprotectable::NoProtector);
        }
        let cfg = self.conn.config();
        if len < cfg.zcopy_threshold {
            return None;
        }
        let pages = crate::pages::whole_pages(addr, len, u64::from(cfg.page_size));
        if pages.is_empty() {
            return None;
        }
        match self.host.protectable(&pages) {
            Protectable::Private => None,
            Protectable::Aliased if self.protector.can_protect_aliases() => None,
            Protectable::Aliased => Some(Unprotectable::Shared),
            Protectable::No(why) => Some(why),
        }
    }

    /// A forked child adopts this copy of the connection: the calls in it
    /// belong to threads of the parent that do not exist here. Cancel them
    /// (what they consumed is lost to the child, as when two processes
    /// read one TCP socket) and forget their results.
    pub fn forget_calls(&mut self) {
        self.forget_calls_except(&[]);
    }

    /// [`Driver::forget_calls`], but for `keep` (calls the adopting
    /// process goes on with: those it serves for other processes).
    pub fn forget_calls_except(&mut self, keep: &[CallId]) {
        for call in self.conn.pending_calls() {
            if !keep.contains(&call) {
                self.cancel(call);
            }
        }
        self.done.retain(|call, _| keep.contains(call));
    }

    /// Use `p` from now on (a forked child's own protection); nothing may be
    /// protected or armed when this is called.
    pub fn replace_protector(&mut self, p: P) {
        drop(std::mem::replace(&mut self.protector, p));
    }

    /// Interrupt a submitted call (a signal, or its socket timeout): it
    /// completes with what it moved, or [`CallError::Interrupted`].
    pub fn cancel(&mut self, call: CallId) {
        let now = self.now();
        self.conn.cancel(now, call, &mut self.host);
        self.drive();
    }

    /// The result of a submitted call, once it is done.
    pub fn take_result(&mut self, call: CallId) -> Option<Result<u64, CallError>> {
        self.done.remove(&call)
    }

    /// Report a fault the protector caught; the faulting thread is woken
    /// when the engine resumes it (or when its pages are unprotected).
    pub fn submit_fault(&mut self, addr: u64, access: Access) -> Ticket {
        let ticket = Ticket(self.next_ticket);
        self.next_ticket += 1;
        let size = u64::from(self.conn.config().page_size);
        self.fault_pages.insert(ticket, addr & !(size - 1));
        let now = self.now();
        self.conn.handle_fault(now, ticket, addr, access);
        self.drive();
        ticket
    }

    /// Ask the engine to settle everything in flight on `range` (memory about
    /// to be freed, unmapped or discarded); [`Driver::resumed`] says when.
    pub fn submit_evacuate(&mut self, range: Range<u64>) -> Ticket {
        let ticket = Ticket(self.next_ticket);
        self.next_ticket += 1;
        let now = self.now();
        self.conn.evacuate(now, ticket, range, &mut self.host);
        self.drive();
        ticket
    }

    /// Stop (or resume) arming receives; those asked meanwhile run
    /// synchronously.
    pub fn pause_arms(&mut self, paused: bool) {
        self.arms_paused = paused;
    }

    /// `range` was unmapped (after [`Driver::submit_evacuate`] settled it).
    pub fn forget_memory(&mut self, range: Range<u64>) {
        self.protector.forget(range);
    }

    /// Has the engine let evacuation `ticket` proceed?
    /// Forgets it once seen.
    pub fn resumed(&mut self, ticket: Ticket) -> bool {
        match self.resumed.iter().position(|t| *t == ticket) {
            Some(i) => {
                self.resumed.swap_remove(i);
                true
            }
            None => false,
        }
    }

    /// Leave the fabric for the TCP connection beneath (see
    /// `Connection::leave_fabric`); the host writes this side's resend
    /// ([`Host::write_stream`]) when both sides have left.
    pub fn leave_fabric(&mut self) {
        let now = self.now();
        self.conn.leave_fabric(now, &mut self.host);
        self.drive();
    }

    /// Our sending direction joins the fabric after `tcp_sent` bytes went
    /// over TCP (see `Connection::join_tx`).
    pub fn join_tx(&mut self, tcp_sent: u64) {
        let now = self.now();
        self.conn.join_tx(now, tcp_sent);
        self.drive();
    }

    /// The listener's side: the client may join (`Connection::allow_join`).
    pub fn allow_join(&mut self) {
        let now = self.now();
        self.conn.allow_join(now);
        self.drive();
    }

    /// The listener's side: the client never joins, if it is not too late
    /// (`Connection::forbid_join`).
    pub fn forbid_join(&mut self) -> bool {
        self.conn.forbid_join()
    }

    /// On TCP at once if nothing joined either way, nor can
    /// (`Connection::stay_on_tcp_now`). Whether it is.
    pub fn stay_on_tcp_now(&mut self) -> bool {
        let now = self.now();
        let r = self.conn.stay_on_tcp_now(now);
        self.drive();
        r
    }

    /// The TCP socket beneath was reset (`Connection::tcp_reset`).
    pub fn tcp_reset(&mut self) {
        let now = self.now();
        self.conn.tcp_reset(now);
        self.drive();
    }

    /// Where the application's next receive reads from (`conn::RxRoute`).
    pub fn rx_route(&self) -> crate::conn::RxRoute {
        self.conn.rx_route()
    }

    /// The application took `n` bytes from TCP while the route said so.
    pub fn took_from_tcp(&mut self, n: u64) -> Result<(), CallError> {
        let now = self.now();
        let r = self.conn.took_from_tcp(now, n);
        self.drive();
        r
    }

    /// Look at the TCP connection beneath: bytes there while on the fabric
    /// were written behind our back, and reset the connection.
    pub fn check_stream(&mut self) {
        if self.conn.switch_sent() || self.host.stream_clean() {
            return;
        }
        let now = self.now();
        self.conn.stray_bytes(now, &mut self.host);
        self.drive();
    }

    /// Has the fabric said the peer is gone? (Nothing more will come from
    /// it: a reactor need not watch its waiter any more.)
    pub fn peer_left(&self) -> bool {
        self.peer_left
    }

    /// When the engine wants attention next (its timers), from now.
    pub fn next_timeout(&self) -> Option<Duration> {
        let now = self.now();
        self.conn.poll_timeout().map(|t| t.saturating_since(now))
    }

    /// When the engine wants attention next, on the host's clock.
    pub fn next_deadline(&self) -> Option<Timestamp> {
        self.conn.poll_timeout()
    }

    /// Blocking `send()` of `buf`.
    pub fn send(&mut self, buf: &[u8], flags: SendFlags) -> Result<u64, CallError> {
        let call = self.submit_send(buf.as_ptr() as u64, buf.len() as u64, flags);
        self.wait_call(call)
    }

    /// Blocking `recv()` into `buf`.
    pub fn recv(&mut self, buf: &mut [u8], flags: RecvFlags) -> Result<u64, CallError> {
        let call = self.submit_recv(buf.as_mut_ptr() as u64, buf.len() as u64, flags);
        self.wait_call(call)
    }

    /// Wait until the handshake is over (or failed), for at most `timeout`
    /// on the host's clock.
    pub fn establish(&mut self, timeout: Duration) -> Result<(), CallError> {
        let deadline = self.now() + timeout;
        loop {
            self.turn();
            let now = self.now();
            match self.conn.state() {
                State::Established | State::Switched => return Ok(()),
                State::Aborted(r) => return Err(r.call_error()),
                State::Handshake if now >= deadline => return Err(CallError::TimedOut),
                State::Handshake => self
                    .fabric
                    .wait(self.max_wait.min(deadline.saturating_since(now))),
            }
        }
    }

    /// `shutdown(how)`.
    pub fn shutdown(&mut self, how: crate::conn::Shutdown) {
        let now = self.now();
        self.conn.shutdown(now, how, &mut self.host);
        self.drive();
    }

    /// `close()` with SO_LINGER {on, 0}: the peer sees a reset.
    pub fn abort(&mut self) {
        let now = self.now();
        self.conn
            .close(now, crate::conn::Linger::Abort, &mut self.host);
        self.drive();
    }

    /// Start `close()` (SO_LINGER off): the connection finishes in the background.
    pub fn submit_close(&mut self) {
        let now = self.now();
        self.conn
            .close(now, crate::conn::Linger::Background, &mut self.host);
        self.drive();
    }

    /// The engine has nothing left to do and every message it produced is
    /// in the fabric.
    pub fn is_finished(&self) -> bool {
        self.conn.is_finished()
            && (self.refused.is_none() || matches!(self.conn.state(), State::Aborted(_)))
    }

    /// `close()`, then drive until the connection is finished or `timeout`
    /// passes on the host's clock. Returns whether it finished cleanly.
    pub fn close(&mut self, timeout: Duration) -> bool {
        self.submit_close();
        let deadline = self.now() + timeout;
        while !self.is_finished() && self.now() < deadline {
            self.drive();
            self.turn();
            if !self.is_finished() {
                let left = deadline.saturating_since(self.now());
                self.fabric.wait(self.max_wait.min(left));
            }
        }
        self.is_finished() && !matches!(self.conn.state(), State::Aborted(_))
    }
}

pub mod ownership;
mod park;
pub use park::{UnparkError, parked_header};

#[cfg(test)]
mod tests;
