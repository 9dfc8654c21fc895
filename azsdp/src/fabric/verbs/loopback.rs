//! Compare-and-swap on our own lock words through the NIC.
//!
//! The copy-on-write lock is a word in the sink's memory that the source
//! takes with an RDMA atomic and the sink with a compare-and-swap of its
//! own. Most devices' atomics (rxe's, and mlx5's) are `IBV_ATOMIC_HCA`:
//! atomic among the device's own operations, not with the CPU's. So on
//! such a device the sink's own operation must go through the device too:
//! an RDMA compare-and-swap from a queue pair connected to another of this
//! process on the same device (made with rdma_cm, from the device's
//! address to itself). One such pair per process and device; each
//! operation waits for its completion (microseconds on a NIC), under a
//! lock.

use std::net::{IpAddr, SocketAddr};
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

use rdma_mummy_sys::rdma_cm_event_type::*;

use super::ffi::{self, Access, CmId, CompChannel, Cq, EventChannel, Mr, Pd, SendOp};
use crate::sync::Lock;

/// How long one operation may take before it counts as failed.
const OP_WAIT: Duration = Duration::from_secs(5);
/// How long making the pair may take.
const SETUP_WAIT: Duration = Duration::from_secs(10);

#[derive(Debug)]
pub struct Loopback {
    // The ids (with their queue pairs) before the CQs and the PDs.
    initiator: CmId,
    _responder: CmId,
    _listener: CmId,
    _events: [EventChannel; 2],
    result_mr: Mr,
    cq: Cq,
    _responder_cq: Cq,
    _comp: [CompChannel; 2],
    _pd: Pd,
    /// The responder's: the lock words are registered here, on the device
    /// that runs the connection (whose atomics the peer's CAS uses too).
    responder_pd: Pd,
    result: Box<AtomicU64>,
    /// Serializes operations (one result word, one outstanding CAS); the
    /// id of the last one posted (a late completion of one that timed out
    /// is not taken for the next's).
    busy: Lock<u64>,
}

impl Loopback {
    /// A connected pair whose responder is on `device`, which serves `local`
    /// (the address of one of this process's connections).
    pub fn connect(
        local: IpAddr,
        device: *mut rdma_mummy_sys::ibv_context,
    ) -> std::io::Result<Loopback> {
        let until = Instant::now() + SETUP_WAIT;
        let left = || until.saturating_duration_since(Instant::now());
        let fail = |what: &str| std::io::Error::other(format!("loopback pair: {what}"));
        let lev = EventChannel::new()?;
        let listener = CmId::new(&lev)?;
        listener.bind(SocketAddr::new(local, 0))?;
        listener.listen(1)?;
        let port = listener
            .addresses()
            .0
            .map(|a| a.port())
            .ok_or_else(|| fail("no port"))?;
        let cev = EventChannel::new()?;
        let initiator = CmId::new(&cev)?;
        initiator.resolve_addr(None, SocketAddr::new(local, port), 5000)?;
        let step = |ch: &EventChannel, want: u32| -> std::io::Result<ffi::CmEvent> {
            let e = ch.next(left()).ok_or_else(|| fail("timed out"))?;
            if e.kind() == want {
                Ok(e)
            } else {
                Err(fail(e.name()))
            }
        };
        drop(step(&cev, RDMA_CM_EVENT_ADDR_RESOLVED)?);
        initiator.resolve_route(5000)?;
        drop(step(&cev, RDMA_CM_EVENT_ROUTE_RESOLVED)?);
        let ctx = initiator.context();
        if ctx.is_null() {
            return Err(fail("no device"));
        }
        let pd = Pd::new(ctx)?;
        let comp = CompChannel::new(ctx)?;
        let cq = Cq::new(ctx, 16, &comp)?;
        let depth = ffi::device_caps(ctx)?.max_rd_atom;
        initiator
            .create_qp(&pd, &cq, 4, 1)
            .map_err(|e| fail(&format!("initiator: {e}")))?;
        initiator.connect(&[], depth)?;
        let req = step(&lev, RDMA_CM_EVENT_CONNECT_REQUEST)?;
        // SAFETY: the new id of a connect request, ours from now on.
        let responder = unsafe { CmId::adopt(req.id()) }.ok_or_else(|| fail("no id"))?;
        drop(req);
        // The responder is on the device that owns `local` (the one that
        // runs the connection); the initiator wherever routing put it.
        let rctx = responder.context();
        if rctx != device {
            return Err(fail("the address is not on the connection's device"));
        }
        let responder_pd = Pd::new(rctx)?;
        let rcomp = CompChannel::new(rctx)?;
        let rcq = Cq::new(rctx, 4, &rcomp)?;
        responder
            .create_qp(&responder_pd, &rcq, 1, 1)
            .map_err(|e| fail(&format!("responder: {e}")))?;
        responder.accept(&[], depth)?;
        drop(step(&cev, RDMA_CM_EVENT_ESTABLISHED)?);
        drop(step(&lev, RDMA_CM_EVENT_ESTABLISHED)?);
        let result = Box::new(AtomicU64::new(0));
        // SAFETY: the word lives in the Box as long as the registration
        // (fields drop in order: the registration first).
        let result_mr =
            unsafe { pd.register(&*result as *const AtomicU64 as u64, 8, Access::LOCAL)? };
        Ok(Loopback {
            initiator,
            _responder: responder,
            _listener: listener,
            _events: [lev, cev],
            result_mr,
            cq,
            _responder_cq: rcq,
            _comp: [comp, rcomp],
            _pd: pd,
            responder_pd,
            result,
            busy: Lock::new(0),
        })
    }

    /// Register `[addr, addr+len)` (lock words) for our own operations.
    ///
    /// # Safety
    /// The range stays mapped while the registration lives.
    pub unsafe fn register(&self, addr: u64, len: u64) -> std::io::Result<Mr> {
        // SAFETY: the caller's promise.
        unsafe { self.responder_pd.register(addr, len, Access::PEER_ATOMIC) }
    }

    /// Compare-and-swap the word at `addr` (in `mr`): the old value.
    pub fn cas(&self, mr: &Mr, addr: u64, expect: u64, new: u64) -> Option<u64> {
        let mut last = self.busy.lock();
        *last += 1;
        let id = *last;
        self.result.store(!expect, Ordering::Relaxed);
        let op = SendOp::Cas {
            addr: &*self.result as *const AtomicU64 as u64,
            lkey: self.result_mr.lkey(),
            remote: addr,
            rkey: mr.rkey(),
            expect,
            new,
        };
        ffi::post_send(self.initiator.qp(), id, op).ok()?;
        let until = Instant::now() + OP_WAIT;
        let mut wc = [ffi::Completion::default(); 4];
        loop {
            let got = self.cq.poll(&mut wc);
            if let Some(c) = wc[..got].iter().find(|c| c.wr_id == id) {
                return c.ok().then(|| self.result.load(Ordering::Acquire));
            }
            if Instant::now() >= until {
                return None;
            }
            std::hint::spin_loop();
        }
    }
}

/// The pair of this process for the device that serves `local`, made at
/// the first need. (A forked child makes its own: the parent's queue pairs
/// are not its to use, nor to destroy.)
pub fn for_address(
    local: IpAddr,
    device: *mut rdma_mummy_sys::ibv_context,
) -> Result<Arc<Loopback>, String> {
    type Pairs = (u32, Vec<(IpAddr, Arc<Loopback>)>);
    static PAIRS: Lock<Pairs> = Lock::new((0, Vec::new()));
    let mut pairs = PAIRS.lock();
    let me = crate::process::pid();
    if pairs.0 != me {
        std::mem::forget(std::mem::take(&mut pairs.1));
        pairs.0 = me;
    }
    if let Some((_, l)) = pairs.1.iter().find(|(a, _)| *a == local) {
        return Ok(Arc::clone(l));
    }
    let l = Arc::new(Loopback::connect(local, device).map_err(|e| e.to_string())?);
    pairs.1.push((local, Arc::clone(&l)));
    Ok(l)
}
