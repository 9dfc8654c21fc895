//! A blocking driver: one [`Connection`] run over one [`Fabric`] inside a
//! real process. It executes the engine's actions, pumps messages, and waits
//! on the fabric between events. Programs that own their sockets (examples,
//! benchmarks, tests) call it directly; the preload shim runs it through
//! [`threaded::ThreadedDriver`], with a progress and a fault thread per
//! connection.
//!
//! Page protection comes from a [`Protector`]. Without one
//! ([`NoProtection`]) the engine is told it cannot protect or arm pages, so
//! zero-copy sends are synchronous (ZSDP) and receives wait for their data.
//!
//! `unsafe` here: [`ProcessMemory`] reads and writes application buffers by
//! address, as the engine asks.

use std::collections::VecDeque;
use std::ops::Range;
use std::time::{Duration, Instant};

use crate::conn::{
    Access, Action, CallError, CallId, Capabilities, Completion, Connection, EngineConfig, OpError,
    OpId, RecvFlags, RemoteBuf, SendFlags, State, Ticket, UserBuf, UserMemory,
};
use crate::fabric::{Fabric, FabricError, FabricEvent, OpResult};
use crate::id_map::IdMap;
use crate::time::Timestamp;

pub use crate::protect::{NoProtection, Protector};

pub mod standby;
pub mod threaded;

/// The application's own memory, by address.
///
/// The engine calls it only for ranges of calls that are blocked in this
/// driver (their buffers are borrowed for the duration of the call), and
/// never for ranges it has protected or armed.
#[derive(Debug, Default)]
pub struct ProcessMemory;

impl UserMemory for ProcessMemory {
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

/// A connection, its fabric and its protector, driven synchronously.
#[derive(Debug)]
pub struct Driver<F: Fabric, P: Protector> {
    conn: Connection,
    fabric: F,
    protector: P,
    mem: ProcessMemory,
    epoch: Instant,
    next_call: u64,
    done: IdMap<CallId, Result<u64, CallError>>,
    resumed: Vec<Ticket>,
    /// Page each pending fault is on, to wake its thread on `Resume`.
    fault_pages: IdMap<Ticket, u64>,
    next_ticket: u64,
    /// Messages the engine produced that the fabric had no room for yet.
    backlog: VecDeque<Vec<u8>>,
    /// Private copies made for copy-on-write, by address.
    copies: IdMap<u64, Vec<u8>>,
    /// GETs into armed ranges that land in staging first.
    staged: IdMap<OpId, Range<u64>>,
    /// No new arms (a fork is pending: staging pages shared with a child
    /// could not be moved back).
    arms_paused: bool,
    buf: Vec<u8>,
    /// Longest single sleep while waiting.
    pub max_wait: Duration,
}

impl<F: Fabric, P: Protector> Driver<F, P> {
    /// Start a connection (the client side posts HELLO at once).
    pub fn new(mut cfg: EngineConfig, fabric: F, protector: P) -> Self {
        cfg.lock_region = fabric.lock_region();
        if cfg.recv_protect == crate::conn::RecvProtect::Auto && !fabric.gets_async() {
            // Synchronous GETs land before recv() can return: never arm.
            cfg.recv_protect = crate::conn::RecvProtect::Off;
        }
        let epoch = Instant::now();
        Driver {
            conn: Connection::new(cfg, Timestamp::ZERO),
            fabric,
            protector,
            mem: ProcessMemory,
            epoch,
            next_call: 1,
            done: IdMap::default(),
            resumed: Vec::new(),
            fault_pages: IdMap::default(),
            next_ticket: 1,
            backlog: VecDeque::new(),
            copies: IdMap::default(),
            staged: IdMap::default(),
            arms_paused: false,
            buf: Vec::new(),
            max_wait: Duration::from_millis(50),
        }
    }

    /// `SO_ERROR` (see [`Connection::take_error`]).
    pub fn take_error(&mut self) -> Option<CallError> {
        self.conn.take_error()
    }

    pub fn connection(&self) -> &Connection {
        &self.conn
    }

    pub fn fabric(&self) -> &F {
        &self.fabric
    }

    fn now(&self) -> Timestamp {
        Timestamp::from_nanos(self.epoch.elapsed().as_nanos() as u64)
    }

    /// Execute actions and post messages until the engine has nothing to say.
    pub(crate) fn drive(&mut self) {
        loop {
            let mut any = false;
            while let Some(a) = self.conn.poll_action() {
                any = true;
                self.exec(a);
            }
            let need = self.conn.max_message_len();
            if self.buf.len() < need {
                self.buf.resize(need, 0);
            }
            while let Some(m) = self.backlog.front() {
                match self.fabric.post_message(m) {
                    Ok(()) => {
                        self.backlog.pop_front();
                    }
                    Err(FabricError::NoCredits) => break,
                    Err(_) => {
                        self.backlog.clear();
                        break;
                    }
                }
            }
            // Post straight from the engine's buffer; copy only what the
            // fabric has no room for yet (kept in order behind the backlog).
            while let Some(n) = self.conn.poll_transmit(&mut self.buf) {
                any = true;
                let posted = if self.backlog.is_empty() {
                    self.fabric.post_message(&self.buf[..n])
                } else {
                    Err(FabricError::NoCredits)
                };
                match posted {
                    Ok(()) => {}
                    Err(FabricError::NoCredits) => self.backlog.push_back(self.buf[..n].to_vec()),
                    Err(_) => self.backlog.clear(),
                }
            }
            if !any {
                self.fabric.publish_progress(self.conn.progress_made());
                return;
            }
        }
    }

    fn complete(&mut self, op: OpId, c: Completion) {
        let now = self.now();
        self.conn.handle_completion(now, op, c, &mut self.mem);
    }

    fn exec(&mut self, a: Action) {
        match a {
            Action::PrepareSource {
                op,
                addr,
                len,
                protect,
            } => {
                let r = if protect.is_empty() {
                    Ok(())
                } else {
                    self.protector.protect(&protect)
                };
                let r = r.and_then(|()| self.fabric.register(addr, len));
                if r.is_err() {
                    // Perhaps the memory is not what the map said any more.
                    crate::memory_map::invalidate();
                }
                self.complete(op, Completion::Prepared(r));
            }
            Action::ReleaseSource { key, .. } => self.fabric.deregister(key),
            Action::Unprotect { range } => self.protector.unprotect(range),
            Action::Arm { op, range } => {
                let r = if self.arms_paused {
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
                // An armed destination is written through its staging pages,
                // which `land` moves into place when the GET is done.
                let range = dst..dst + len;
                let stage = if armed {
                    self.protector.staging(&range)
                } else {
                    None
                };
                let posted = match stage {
                    Some(at) => {
                        self.staged.insert(op, range);
                        self.fabric.post_get(op, src, at, len, false)
                    }
                    None => self.fabric.post_get(op, src, dst, len, armed),
                };
                if posted.is_err() {
                    self.staged.remove(&op);
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
                let mut copy = vec![0u8; len as usize];
                self.mem.read(addr, &mut copy);
                let at = copy.as_ptr() as u64;
                let r = self
                    .fabric
                    .register(at, len)
                    .map(|key| RemoteBuf { addr: at, key });
                if r.is_ok() {
                    self.copies.insert(at, copy);
                }
                self.complete(op, Completion::Copied(r));
            }
            Action::ReleaseCopy { buf, .. } => {
                self.fabric.deregister(buf.key);
                self.copies.remove(&buf.addr);
            }
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
        }
    }

    /// Deliver what the fabric has, and run timers; returns how many fabric
    /// events were delivered (0: nothing happened but timers). Messages go
    /// to the engine straight from the fabric's buffer (no copy).
    pub(crate) fn turn(&mut self) -> usize {
        let now = self.now();
        let (conn, mem, staged, protector) = (
            &mut self.conn,
            &mut self.mem,
            &mut self.staged,
            &mut self.protector,
        );
        let n = self.fabric.poll(&mut |e| match e {
            FabricEvent::Message(m) => conn.handle_message(now, m, mem),
            FabricEvent::Done {
                op,
                result: OpResult::Get(r),
            } => {
                let r = match staged.remove(&op) {
                    Some(range) => r.and_then(|()| protector.land(&range)),
                    None => r,
                };
                conn.handle_completion(now, op, Completion::Get(r), mem);
            }
            FabricEvent::Done {
                op,
                result: OpResult::Cas(r),
            } => conn.handle_completion(now, op, Completion::Cas(r), mem),
            FabricEvent::PeerGone { left } => conn.handle_peer_left(now, left, mem),
        });
        if self.conn.poll_timeout().is_some_and(|t| t <= now) {
            self.conn.handle_timeout(now, &mut self.mem);
        }
        self.drive();
        n
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
            let now = self.now();
            let until = self.conn.poll_timeout().map_or(self.max_wait, |t| {
                t.saturating_since(now).min(self.max_wait)
            });
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
        flags.protectable &= self.protector.can_protect() && self.may_protect(addr, len);
        let call = self.call_id();
        let now = self.now();
        self.conn
            .send(now, call, UserBuf { addr, len }, flags, &mut self.mem);
        self.drive();
        call
    }

    /// Start a `recv()` into `len` bytes at `addr` (which must stay valid
    /// and untouched by the caller until the result is in).
    pub fn submit_recv(&mut self, addr: u64, len: u64, mut flags: RecvFlags) -> CallId {
        flags.armable &= self.protector.can_arm() && self.may_protect(addr, len);
        let call = self.call_id();
        let now = self.now();
        self.conn
            .recv(now, call, UserBuf { addr, len }, flags, &mut self.mem);
        self.drive();
        call
    }

    /// May the whole pages of `[addr, addr+len)` be protected or armed?
    /// Only private anonymous memory (see [`crate::memory_map`]); buffers
    /// too small to hold a whole page need no answer.
    fn may_protect(&self, addr: u64, len: u64) -> bool {
        let cfg = self.conn.config();
        if len < cfg.zcopy_threshold {
            // Copied (BSDP) whatever the answer: don't ask.
            return true;
        }
        let pages = crate::pages::whole_pages(addr, len, u64::from(cfg.page_size));
        pages.is_empty()
            || match crate::memory_map::check(&pages) {
                Ok(crate::memory_map::Protectable::Private) => true,
                Ok(crate::memory_map::Protectable::Aliased) => self.protector.can_protect_aliases(),
                Err(_) => false,
            }
    }

    /// A forked child adopts this copy of the connection: the calls in it
    /// belong to threads of the parent that do not exist here. Cancel them
    /// (what they consumed is lost to the child, as when two processes
    /// read one TCP socket) and forget their results.
    pub fn forget_calls(&mut self) {
        for call in self.conn.pending_calls() {
            self.cancel(call);
        }
        self.done.clear();
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
        self.conn.cancel(now, call, &mut self.mem);
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
        self.conn.evacuate(now, ticket, range, &mut self.mem);
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

    /// When the engine wants attention next (timers), from now.
    pub fn next_timeout(&self) -> Option<Duration> {
        let now = self.now();
        self.conn.poll_timeout().map(|t| t.saturating_since(now))
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

    /// Wait until the handshake is over (or failed).
    pub fn establish(&mut self, timeout: Duration) -> Result<(), CallError> {
        let deadline = Instant::now() + timeout;
        loop {
            self.turn();
            match self.conn.state() {
                State::Established => return Ok(()),
                State::Aborted(r) => return Err(r.call_error()),
                State::Handshake if Instant::now() >= deadline => return Err(CallError::TimedOut),
                State::Handshake => self
                    .fabric
                    .wait(self.max_wait.min(deadline - Instant::now())),
            }
        }
    }

    /// `shutdown(how)`.
    pub fn shutdown(&mut self, how: crate::conn::Shutdown) {
        let now = self.now();
        self.conn.shutdown(now, how, &mut self.mem);
        self.drive();
    }

    /// `close()` with SO_LINGER {on, 0}: the peer sees a reset.
    pub fn abort(&mut self) {
        let now = self.now();
        self.conn
            .close(now, crate::conn::Linger::Abort, &mut self.mem);
        self.drive();
    }

    /// Start `close()` (SO_LINGER off): the connection finishes in the background.
    pub fn submit_close(&mut self) {
        let now = self.now();
        self.conn
            .close(now, crate::conn::Linger::Background, &mut self.mem);
        self.drive();
    }

    /// The engine has nothing left to do and every message it produced is
    /// in the fabric (none waits in the backlog for ring space).
    pub fn is_finished(&self) -> bool {
        self.conn.is_finished()
            && (self.backlog.is_empty() || matches!(self.conn.state(), State::Aborted(_)))
    }

    /// `close()`, then drive until the connection is finished or `timeout`
    /// passes. Returns whether it finished cleanly.
    pub fn close(&mut self, timeout: Duration) -> bool {
        self.submit_close();
        let deadline = Instant::now() + timeout;
        while !self.is_finished() && Instant::now() < deadline {
            self.drive();
            self.turn();
            if !self.is_finished() {
                self.fabric.wait(
                    self.max_wait
                        .min(deadline.saturating_duration_since(Instant::now())),
                );
            }
        }
        self.is_finished() && !matches!(self.conn.state(), State::Aborted(_))
    }
}
