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
//!
//! The same pair checks, once per process and device, that the device's
//! registration on demand takes READs right before a connection relies on
//! it ([`Loopback::check_reads_on_demand`]): rxe on 6.17 offers it but
//! places a READ's bytes at the start of each page, not at their offset.

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
    /// On the connection's device (its own READs check registration on
    /// demand there).
    responder: CmId,
    _listener: CmId,
    _events: [EventChannel; 2],
    result_mr: Mr,
    cq: Cq,
    responder_cq: Cq,
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
        // A nonce in the private data: any local process may connect to
        // the listener's port, and only our initiator is answered.
        let mut nonce = [0u8; 8];
        // SAFETY: 8 writable bytes.
        let got = unsafe { libc::getrandom(nonce.as_mut_ptr().cast(), 8, libc::GRND_NONBLOCK) };
        if got != 8 {
            return Err(fail("no random nonce"));
        }
        initiator.connect(&nonce, depth)?;
        let responder = loop {
            let req = step(&lev, RDMA_CM_EVENT_CONNECT_REQUEST)?;
            // SAFETY: the new id of a connect request, ours from now on.
            let id = unsafe { CmId::adopt(req.id()) }.ok_or_else(|| fail("no id"))?;
            let ours = req.private_data().starts_with(&nonce);
            if !ours {
                id.reject(&[]);
            }
            // (The event is acknowledged before a refused id goes.)
            drop(req);
            if ours {
                break id;
            }
        };
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
            responder,
            _listener: listener,
            _events: [lev, cev],
            result_mr,
            cq,
            responder_cq: rcq,
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
        self.completion_of(&self.cq, id)?
            .ok()
            .then(|| self.result.load(Ordering::Acquire))
    }

    /// Wait for the completion of the operation `id` (posted under `busy`)
    /// on `cq`.
    fn completion_of(&self, cq: &Cq, id: u64) -> Option<ffi::Completion> {
        let until = Instant::now() + OP_WAIT;
        let mut wc = [ffi::Completion::default(); 4];
        loop {
            let got = cq.poll(&mut wc);
            if let Some(c) = wc[..got].iter().find(|c| c.wr_id == id) {
                return Some(*c);
            }
            if Instant::now() >= until {
                return None;
            }
            std::hint::spin_loop();
        }
    }

    /// Does a READ land right in memory registered on demand on the
    /// connection's device? The responder (on that device) READs a pinned
    /// pattern of the initiator's into a registration on demand of its
    /// own, three times (across pages, at odd offsets, the last into pages
    /// the first mapped), every byte compared, and the bytes around them
    /// must stay untouched.
    pub fn check_reads_on_demand(&self) -> Result<(), String> {
        let page = crate::pages::system_page_size() as usize;
        let len = 3 * page;
        let anon = |fill: fn(usize) -> u8| {
            memmap2::MmapMut::map_anon(len).map(|mut m| {
                m.iter_mut().enumerate().for_each(|(i, b)| *b = fill(i));
                m
            })
        };
        let src = anon(|i| (i * 7 + i / 251) as u8).map_err(|e| e.to_string())?;
        let mut dst = anon(|_| 0).map_err(|e| e.to_string())?;
        // SAFETY: both mappings outlive their registrations (dropped at
        // the end of this function, before them).
        let src_mr = unsafe {
            self._pd
                .register(src.as_ptr() as u64, len as u64, Access::PEER_READ)
        }
        .map_err(|e| e.to_string())?;
        // SAFETY: as above.
        let dst_mr = unsafe {
            self.responder_pd
                .register(dst.as_ptr() as u64, len as u64, Access::LOCAL.on_demand())
        }
        .map_err(|e| format!("registration on demand: {e}"))?;
        // (from, to, bytes)
        let reads = [
            (100, 300, 2 * page + 1000),
            (5, page - 17, 33),
            (0, 64, page),
        ];
        for (from, to, n) in reads {
            let mut last = self.busy.lock();
            *last += 1;
            let id = *last;
            let op = SendOp::Read {
                addr: dst.as_ptr() as u64 + to as u64,
                len: n as u32,
                lkey: dst_mr.lkey(),
                remote: src.as_ptr() as u64 + from as u64,
                rkey: src_mr.rkey(),
            };
            ffi::post_send(self.responder.qp(), id, op).map_err(|e| e.to_string())?;
            match self.completion_of(&self.responder_cq, id) {
                Some(c) if c.ok() => {}
                Some(c) => return Err(format!("a READ failed: {}", c.describe())),
                None => return Err("a READ did not complete".into()),
            }
            drop(last);
            if dst[to..to + n] != src[from..from + n] {
                let wrong = (0..n).filter(|&i| dst[to + i] != src[from + i]).count();
                return Err(format!(
                    "a READ of {n} bytes to page offset {} landed {wrong} bytes wrong",
                    to % page
                ));
            }
            if dst[..to].iter().chain(&dst[to + n..]).any(|&b| b != 0) {
                return Err(format!(
                    "a READ of {n} bytes to page offset {} wrote outside its range",
                    to % page
                ));
            }
            dst.fill(0);
        }
        Ok(())
    }
}

/// Does registration on demand take READs right on the device that serves
/// `local`? Checked once per process and address
/// ([`Loopback::check_reads_on_demand`]), through its pair.
pub fn reads_on_demand_work(
    local: IpAddr,
    device: *mut rdma_mummy_sys::ibv_context,
) -> Result<(), String> {
    type Checked = (u32, Vec<(IpAddr, Result<(), String>)>);
    static CHECKED: Lock<Checked> = Lock::new((0, Vec::new()));
    let me = crate::process::pid();
    {
        let checked = CHECKED.lock();
        if checked.0 == me
            && let Some((_, r)) = checked.1.iter().find(|(a, _)| *a == local)
        {
            return r.clone();
        }
    }
    let t = Instant::now();
    let r = for_address(local, device)
        .and_then(|l| l.check_reads_on_demand())
        .map_err(|why| format!("{why} (checked in {} ms)", t.elapsed().as_millis()));
    let mut checked = CHECKED.lock();
    if checked.0 != me {
        *checked = (me, Vec::new());
    }
    checked.1.push((local, r.clone()));
    r
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
