//! The rdma-core calls the `verbs` fabric makes, as owned handles.
//!
//! Everything unsafe about verbs lives here: each handle owns one object
//! of libibverbs or librdmacm (which `rdma-mummy-sys` `dlopen`s at run
//! time: on a host without rdma-core every call fails and no device is
//! found) and frees it when dropped. libibverbs' calls are thread-safe,
//! so a handle may be used from any thread; what must not happen at once
//! (destroying a queue pair while a completion for it is polled) the
//! owner of the handles orders, the endpoint behind the driver's lock.

use std::ffi::c_void;
use std::io;
use std::net::SocketAddr;
use std::ptr::{NonNull, null_mut};
use std::time::{Duration, Instant};

use rdma_mummy_sys as sys;

/// What a work completion says that the fabric uses.
#[derive(Clone, Copy, Debug, Default)]
pub struct Completion {
    pub wr_id: u64,
    pub status: u32,
    pub byte_len: u32,
}

impl Completion {
    pub fn ok(&self) -> bool {
        self.status == sys::ibv_wc_status::IBV_WC_SUCCESS
    }

    /// The peer's NIC refused the access (a bad or revoked key).
    pub fn remote_refusal(&self) -> bool {
        use sys::ibv_wc_status::*;
        self.status == IBV_WC_REM_ACCESS_ERR || self.status == IBV_WC_REM_INV_REQ_ERR
    }

    /// Our own buffer or key was at fault.
    pub fn local_fault(&self) -> bool {
        use sys::ibv_wc_status::*;
        matches!(
            self.status,
            IBV_WC_LOC_PROT_ERR | IBV_WC_LOC_LEN_ERR | IBV_WC_LOC_ACCESS_ERR
        )
    }

    pub fn describe(&self) -> String {
        // SAFETY: ibv_wc_status_str returns a static string for any status.
        unsafe {
            let p = sys::ibv_wc_status_str(self.status);
            if p.is_null() {
                format!("status {}", self.status)
            } else {
                std::ffi::CStr::from_ptr(p).to_string_lossy().into_owned()
            }
        }
    }
}

fn last_error(what: &str) -> io::Error {
    let e = io::Error::last_os_error();
    io::Error::new(e.kind(), format!("{what}: {e}"))
}

/// A `sockaddr_storage` for rdma_cm.
pub fn sockaddr(a: SocketAddr) -> libc::sockaddr_storage {
    // SAFETY: plain data.
    let mut s: libc::sockaddr_storage = unsafe { std::mem::zeroed() };
    match a {
        SocketAddr::V4(v4) => {
            // SAFETY: sockaddr_storage is large and aligned enough for any
            // sockaddr.
            let sin = unsafe { &mut *(&mut s as *mut _ as *mut libc::sockaddr_in) };
            sin.sin_family = libc::AF_INET as u16;
            sin.sin_port = v4.port().to_be();
            sin.sin_addr.s_addr = u32::from_ne_bytes(v4.ip().octets());
        }
        SocketAddr::V6(v6) => {
            // SAFETY: as above.
            let sin6 = unsafe { &mut *(&mut s as *mut _ as *mut libc::sockaddr_in6) };
            sin6.sin6_family = libc::AF_INET6 as u16;
            sin6.sin6_port = v6.port().to_be();
            sin6.sin6_addr.s6_addr = v6.ip().octets();
            sin6.sin6_scope_id = v6.scope_id();
        }
    }
    s
}

/// A sockaddr rdma_cm reports, as a Rust address.
///
/// # Safety
/// `p` is null or points to a sockaddr of its family's size.
unsafe fn socket_addr(p: *const libc::sockaddr) -> Option<SocketAddr> {
    if p.is_null() {
        return None;
    }
    // SAFETY: the caller's promise; the family says which struct it is.
    unsafe {
        match i32::from((*p).sa_family) {
            libc::AF_INET => {
                let sin = &*(p as *const libc::sockaddr_in);
                let ip = std::net::Ipv4Addr::from(sin.sin_addr.s_addr.to_ne_bytes());
                Some(SocketAddr::new(ip.into(), u16::from_be(sin.sin_port)))
            }
            libc::AF_INET6 => {
                let sin6 = &*(p as *const libc::sockaddr_in6);
                let ip = std::net::Ipv6Addr::from(sin6.sin6_addr.s6_addr);
                Some(SocketAddr::new(ip.into(), u16::from_be(sin6.sin6_port)))
            }
            _ => None,
        }
    }
}

/// A channel's descriptor: never blocks (we wait in poll or epoll), and
/// does not outlive an exec.
fn nonblocking_cloexec(fd: i32) {
    // SAFETY: fcntl on a descriptor the channel owns.
    unsafe {
        let fl = libc::fcntl(fd, libc::F_GETFL);
        libc::fcntl(fd, libc::F_SETFL, fl | libc::O_NONBLOCK);
        libc::fcntl(fd, libc::F_SETFD, libc::FD_CLOEXEC);
    }
}

/// The process that opened the RDMA stack (0: none yet).
static STACK_OWNER: std::sync::atomic::AtomicU32 = std::sync::atomic::AtomicU32::new(0);

/// Is the RDMA stack this process's to use? A forked child holds copies of
/// its parent's handles (queue pairs, registrations, channels), which are
/// the parent's still: the child never destroys them (that would end the
/// parent's connections), nor opens the stack again on the parent's
/// inherited device contexts.
pub fn stack_is_ours() -> bool {
    use std::sync::atomic::Ordering;
    let me = crate::process::pid();
    // A plain load first: this is asked on every call's ownership check,
    // and a compare-and-swap would take the line exclusive each time.
    match STACK_OWNER.load(Ordering::Acquire) {
        0 => match STACK_OWNER.compare_exchange(0, me, Ordering::AcqRel, Ordering::Acquire) {
            Ok(_) => true,
            Err(owner) => owner == me,
        },
        owner => owner == me,
    }
}

/// How many RDMA devices this host has (0 without rdma-core, or in a
/// process whose stack is not its own: see [`stack_is_ours`]).
pub fn device_count() -> usize {
    if !stack_is_ours() {
        return 0;
    }
    let mut n = 0;
    // SAFETY: the list is freed right away; n is ours.
    unsafe {
        let list = sys::ibv_get_device_list(&mut n);
        if !list.is_null() {
            sys::ibv_free_device_list(list);
        }
    }
    n.max(0) as usize
}

/// An rdma_cm event channel: a descriptor that polls readable when an
/// event for one of its ids comes.
#[derive(Debug)]
pub struct EventChannel(NonNull<sys::rdma_event_channel>);

// SAFETY: librdmacm's calls on a channel are thread-safe.
unsafe impl Send for EventChannel {}
// SAFETY: as above.
unsafe impl Sync for EventChannel {}

impl EventChannel {
    pub fn new() -> io::Result<EventChannel> {
        if !stack_is_ours() {
            return Err(io::Error::other(
                "the RDMA stack is the parent process's (a forked child)",
            ));
        }
        // SAFETY: no arguments; a null result is an error.
        let p = unsafe { sys::rdma_create_event_channel() };
        let c =
            EventChannel(NonNull::new(p).ok_or_else(|| last_error("rdma_create_event_channel"))?);
        // Events are taken when the descriptor says so, never waited for
        // inside librdmacm.
        nonblocking_cloexec(c.fd());
        Ok(c)
    }

    pub fn fd(&self) -> i32 {
        // SAFETY: a live channel.
        unsafe { self.0.as_ref().fd }
    }

    /// The next event, if one is waiting.
    pub fn take(&self) -> Option<CmEvent> {
        let mut ev = null_mut();
        // SAFETY: a live channel; the event is acked by CmEvent's drop.
        let r = unsafe { sys::rdma_get_cm_event(self.0.as_ptr(), &mut ev) };
        (r == 0).then(|| CmEvent(ev))
    }

    /// The next event, waiting up to `timeout` for it.
    pub fn next(&self, timeout: Duration) -> Option<CmEvent> {
        let until = Instant::now() + timeout;
        loop {
            if let Some(e) = self.take() {
                return Some(e);
            }
            let left = until.saturating_duration_since(Instant::now());
            if left.is_zero() {
                return None;
            }
            // SAFETY: the channel's descriptor lives as long as `self`.
            let fd = unsafe { std::os::fd::BorrowedFd::borrow_raw(self.fd()) };
            crate::poll_fd::poll_fd(fd, libc::POLLIN, Some(left.max(Duration::from_millis(1))));
        }
    }
}

impl Drop for EventChannel {
    fn drop(&mut self) {
        if !stack_is_ours() {
            return;
        }
        // SAFETY: every id on it was destroyed or migrated first (the
        // owners hold the channel longer than their ids).
        unsafe { sys::rdma_destroy_event_channel(self.0.as_ptr()) }
    }
}

/// One rdma_cm event, acknowledged when dropped.
#[derive(Debug)]
pub struct CmEvent(*mut sys::rdma_cm_event);

impl CmEvent {
    pub fn kind(&self) -> u32 {
        // SAFETY: a live event.
        unsafe { (*self.0).event }
    }

    pub fn status(&self) -> i32 {
        // SAFETY: a live event.
        unsafe { (*self.0).status }
    }

    /// The id the event is about (for a connect request: the new one).
    pub fn id(&self) -> *mut sys::rdma_cm_id {
        // SAFETY: a live event.
        unsafe { (*self.0).id }
    }

    /// The private data of a connect request, an accept or a reject.
    pub fn private_data(&self) -> Vec<u8> {
        // SAFETY: a live event; the union's conn arm is the one rdma_cm
        // fills for connected port spaces, and its data lives as long as
        // the event.
        unsafe {
            let c = &(*self.0).param.conn;
            if c.private_data.is_null() {
                return Vec::new();
            }
            std::slice::from_raw_parts(c.private_data as *const u8, usize::from(c.private_data_len))
                .to_vec()
        }
    }

    pub fn name(&self) -> &'static str {
        use sys::rdma_cm_event_type::*;
        match self.kind() {
            RDMA_CM_EVENT_ADDR_RESOLVED => "address resolved",
            RDMA_CM_EVENT_ADDR_ERROR => "address error",
            RDMA_CM_EVENT_ROUTE_RESOLVED => "route resolved",
            RDMA_CM_EVENT_ROUTE_ERROR => "route error",
            RDMA_CM_EVENT_CONNECT_REQUEST => "connect request",
            RDMA_CM_EVENT_CONNECT_ERROR => "connect error",
            RDMA_CM_EVENT_UNREACHABLE => "unreachable",
            RDMA_CM_EVENT_REJECTED => "rejected",
            RDMA_CM_EVENT_ESTABLISHED => "established",
            RDMA_CM_EVENT_DISCONNECTED => "disconnected",
            RDMA_CM_EVENT_DEVICE_REMOVAL => "device removal",
            RDMA_CM_EVENT_TIMEWAIT_EXIT => "timewait exit",
            _ => "other event",
        }
    }
}

impl Drop for CmEvent {
    fn drop(&mut self) {
        if !stack_is_ours() {
            return;
        }
        // SAFETY: acked once.
        unsafe { sys::rdma_ack_cm_event(self.0) };
    }
}

/// An rdma_cm id in the TCP port space, with the queue pair it may own.
#[derive(Debug)]
pub struct CmId(NonNull<sys::rdma_cm_id>);

// SAFETY: librdmacm's and libibverbs' calls are thread-safe.
unsafe impl Send for CmId {}
// SAFETY: as above.
unsafe impl Sync for CmId {}

impl CmId {
    pub fn new(channel: &EventChannel) -> io::Result<CmId> {
        let mut id = null_mut();
        // SAFETY: a live channel; the id is ours until dropped.
        let r = unsafe {
            sys::rdma_create_id(
                channel.0.as_ptr(),
                &mut id,
                null_mut(),
                sys::rdma_port_space::RDMA_PS_TCP,
            )
        };
        if r != 0 {
            return Err(last_error("rdma_create_id"));
        }
        NonNull::new(id)
            .map(CmId)
            .ok_or_else(|| last_error("rdma_create_id"))
    }

    /// Take an id a connect request event brought.
    ///
    /// # Safety
    /// `id` is the new id of a CONNECT_REQUEST event, owned by no one else.
    pub unsafe fn adopt(id: *mut sys::rdma_cm_id) -> Option<CmId> {
        NonNull::new(id).map(CmId)
    }

    pub fn as_ptr(&self) -> *mut sys::rdma_cm_id {
        self.0.as_ptr()
    }

    fn check(r: i32, what: &str) -> io::Result<()> {
        if r == 0 {
            Ok(())
        } else {
            Err(last_error(what))
        }
    }

    pub fn bind(&self, a: SocketAddr) -> io::Result<()> {
        let mut s = sockaddr(a);
        // SAFETY: a live id and an address of ours.
        Self::check(
            unsafe { sys::rdma_bind_addr(self.as_ptr(), &mut s as *mut _ as *mut _) },
            "rdma_bind_addr",
        )
    }

    pub fn listen(&self, backlog: i32) -> io::Result<()> {
        // SAFETY: a live, bound id.
        Self::check(
            unsafe { sys::rdma_listen(self.as_ptr(), backlog) },
            "rdma_listen",
        )
    }

    pub fn resolve_addr(
        &self,
        src: Option<SocketAddr>,
        dst: SocketAddr,
        ms: i32,
    ) -> io::Result<()> {
        let mut d = sockaddr(dst);
        let mut s = src.map(sockaddr);
        let sp = s
            .as_mut()
            .map_or(null_mut(), |s| s as *mut _ as *mut libc::sockaddr);
        // SAFETY: a live id and addresses of ours.
        Self::check(
            unsafe {
                sys::rdma_resolve_addr(self.as_ptr(), sp.cast(), &mut d as *mut _ as *mut _, ms)
            },
            "rdma_resolve_addr",
        )
    }

    pub fn resolve_route(&self, ms: i32) -> io::Result<()> {
        // SAFETY: a live id with a resolved address.
        Self::check(
            unsafe { sys::rdma_resolve_route(self.as_ptr(), ms) },
            "rdma_resolve_route",
        )
    }

    /// Move the id's events to `channel`.
    pub fn migrate(&self, channel: &EventChannel) -> io::Result<()> {
        // SAFETY: a live id and channel.
        Self::check(
            unsafe { sys::rdma_migrate_id(self.as_ptr(), channel.0.as_ptr()) },
            "rdma_migrate_id",
        )
    }

    /// The device context the id is bound to (after address resolution or
    /// on a connect request).
    pub fn context(&self) -> *mut sys::ibv_context {
        // SAFETY: a live id.
        unsafe { (*self.as_ptr()).verbs }
    }

    pub fn qp(&self) -> *mut sys::ibv_qp {
        // SAFETY: a live id.
        unsafe { (*self.as_ptr()).qp }
    }

    /// The local and the peer's address, as the RDMA stack (the kernel)
    /// reports them.
    pub fn addresses(&self) -> (Option<SocketAddr>, Option<SocketAddr>) {
        // SAFETY: a live id; rdma_get_local_addr/peer_addr point into it.
        unsafe {
            (
                socket_addr(sys::rdma_get_local_addr(&*self.as_ptr()) as *const _ as *const _),
                socket_addr(sys::rdma_get_peer_addr(&*self.as_ptr()) as *const _ as *const _),
            )
        }
    }

    /// Make the id's RC queue pair on `pd`, both directions completing on
    /// `cq`.
    pub fn create_qp(&self, pd: &Pd, cq: &Cq, send: u32, recv: u32) -> io::Result<()> {
        // SAFETY: plain data.
        let mut a: sys::ibv_qp_init_attr = unsafe { std::mem::zeroed() };
        a.send_cq = cq.0.as_ptr();
        a.recv_cq = cq.0.as_ptr();
        a.cap.max_send_wr = send;
        a.cap.max_recv_wr = recv;
        a.cap.max_send_sge = 1;
        a.cap.max_recv_sge = 1;
        a.qp_type = sys::ibv_qp_type::IBV_QPT_RC;
        a.sq_sig_all = 1;
        // SAFETY: a live id, PD and CQ of its device.
        Self::check(
            unsafe { sys::rdma_create_qp(self.as_ptr(), pd.0.as_ptr(), &mut a) },
            "rdma_create_qp",
        )
    }

    fn conn_param(private: &[u8], depth: u8) -> sys::rdma_conn_param {
        // SAFETY: plain data.
        let mut c: sys::rdma_conn_param = unsafe { std::mem::zeroed() };
        c.private_data = private.as_ptr().cast();
        c.private_data_len = private.len().min(u8::MAX as usize) as u8;
        c.responder_resources = depth;
        c.initiator_depth = depth;
        c.retry_count = 7;
        // Receives are credited: a missing one is a bug, not a wait.
        c.rnr_retry_count = 0;
        c
    }

    pub fn connect(&self, private: &[u8], depth: u8) -> io::Result<()> {
        let mut c = Self::conn_param(private, depth);
        // SAFETY: a live id with a queue pair; the data outlives the call.
        Self::check(
            unsafe { sys::rdma_connect(self.as_ptr(), &mut c) },
            "rdma_connect",
        )
    }

    pub fn accept(&self, private: &[u8], depth: u8) -> io::Result<()> {
        let mut c = Self::conn_param(private, depth);
        // SAFETY: as connect.
        Self::check(
            unsafe { sys::rdma_accept(self.as_ptr(), &mut c) },
            "rdma_accept",
        )
    }

    pub fn reject(&self, private: &[u8]) {
        // SAFETY: a live id of a connect request.
        unsafe {
            sys::rdma_reject(
                self.as_ptr(),
                private.as_ptr().cast(),
                private.len().min(u8::MAX as usize) as u8,
            )
        };
    }

    pub fn disconnect(&self) {
        // SAFETY: a live id (failing harmlessly if not connected).
        unsafe { sys::rdma_disconnect(self.as_ptr()) };
    }
}

impl Drop for CmId {
    fn drop(&mut self) {
        if !stack_is_ours() {
            return;
        }
        // SAFETY: the id and its queue pair are ours; its events were acked.
        unsafe {
            if !(*self.as_ptr()).qp.is_null() {
                sys::rdma_destroy_qp(self.as_ptr());
            }
            sys::rdma_destroy_id(self.as_ptr());
        }
    }
}

/// What a device can do that the fabric needs to know.
#[derive(Clone, Copy, Debug)]
pub struct DeviceCaps {
    /// NIC atomics at all.
    pub atomics: bool,
    /// NIC atomics that are atomic with the CPU's too (IBV_ATOMIC_GLOB).
    pub atomics_with_cpu: bool,
    /// Outstanding RDMA READs / atomics a queue pair may have.
    pub max_rd_atom: u8,
    /// Registrations on demand (`IBV_ACCESS_ON_DEMAND`) that RDMA READs
    /// of a reliable-connected queue pair may use.
    pub odp_reads: bool,
}

pub fn device_caps(ctx: *mut sys::ibv_context) -> io::Result<DeviceCaps> {
    // SAFETY: plain data filled by the call on a live context (which falls
    // back to ibv_query_device, leaving the extended fields zero, where
    // the provider has no extended query).
    let mut x: sys::ibv_device_attr_ex = unsafe { std::mem::zeroed() };
    // SAFETY: as above; no input.
    if unsafe { sys::ibv_query_device_ex(ctx, std::ptr::null(), &mut x) } != 0 {
        return Err(last_error("ibv_query_device_ex"));
    }
    let a = &x.orig_attr;
    let odp =
        x.odp_caps.general_caps & u64::from(sys::ibv_odp_general_caps::IBV_ODP_SUPPORT.0) != 0;
    let rc_reads = x.odp_caps.per_transport_caps.rc_odp_caps
        & sys::ibv_odp_transport_cap_bits::IBV_ODP_SUPPORT_READ.0
        != 0;
    Ok(DeviceCaps {
        atomics: a.atomic_cap != sys::ibv_atomic_cap::IBV_ATOMIC_NONE,
        atomics_with_cpu: a.atomic_cap == sys::ibv_atomic_cap::IBV_ATOMIC_GLOB,
        max_rd_atom: a.max_qp_rd_atom.clamp(1, 16) as u8,
        odp_reads: odp && rc_reads,
    })
}

/// A protection domain.
#[derive(Debug)]
pub struct Pd(NonNull<sys::ibv_pd>);

// SAFETY: libibverbs' calls are thread-safe.
unsafe impl Send for Pd {}
// SAFETY: as above.
unsafe impl Sync for Pd {}

impl Pd {
    pub fn new(ctx: *mut sys::ibv_context) -> io::Result<Pd> {
        // SAFETY: a live context.
        let p = unsafe { sys::ibv_alloc_pd(ctx) };
        NonNull::new(p)
            .map(Pd)
            .ok_or_else(|| last_error("ibv_alloc_pd"))
    }

    /// Register `[addr, addr+len)`.
    ///
    /// # Safety
    /// The range stays mapped while the registration lives. Pinned, the
    /// peer's reads of it after that fail or read the pages registered
    /// (the NIC holds them); on demand ([`Access::on_demand`]), the NIC
    /// reads and writes whatever the range maps when it gets there.
    pub unsafe fn register(&self, addr: u64, len: u64, access: Access) -> io::Result<Mr> {
        // SAFETY: the caller's promise.
        let mr = unsafe {
            sys::ibv_reg_mr(
                self.0.as_ptr(),
                addr as *mut c_void,
                len as usize,
                access.0 as i32,
            )
        };
        // (On demand pins nothing: the process-wide list of pins is for
        // moves of pages that a pin forbids, `crate::pinned`.)
        NonNull::new(mr)
            .map(|mr| {
                let pin = !access.is_on_demand();
                Mr(mr, pin.then(|| crate::pinned::pin(addr, len)))
            })
            .ok_or_else(|| last_error("ibv_reg_mr"))
    }
}

impl Drop for Pd {
    fn drop(&mut self) {
        if !stack_is_ours() {
            return;
        }
        // SAFETY: its registrations and queue pairs went first.
        unsafe { sys::ibv_dealloc_pd(self.0.as_ptr()) };
    }
}

/// Registration access flags.
#[derive(Clone, Copy, Debug)]
pub struct Access(u32);

impl Access {
    pub const LOCAL: Access = Access(sys::ibv_access_flags::IBV_ACCESS_LOCAL_WRITE.0);
    pub const PEER_READ: Access = Access(sys::ibv_access_flags::IBV_ACCESS_REMOTE_READ.0);
    pub const PEER_ATOMIC: Access = Access(
        sys::ibv_access_flags::IBV_ACCESS_LOCAL_WRITE.0
            | sys::ibv_access_flags::IBV_ACCESS_REMOTE_ATOMIC.0
            | sys::ibv_access_flags::IBV_ACCESS_REMOTE_READ.0,
    );

    /// The same access, on demand: no page is pinned, and the device
    /// faults pages in through the kernel as it reaches them.
    pub fn on_demand(self) -> Access {
        Access(self.0 | sys::ibv_access_flags::IBV_ACCESS_ON_DEMAND.0)
    }

    pub fn is_on_demand(self) -> bool {
        self.0 & sys::ibv_access_flags::IBV_ACCESS_ON_DEMAND.0 != 0
    }
}

/// A memory registration: its keys work until it is dropped, and its pages
/// count as pinned by this process while it lives ([`crate::pinned`]),
/// unless it is on demand.
#[derive(Debug)]
pub struct Mr(
    NonNull<sys::ibv_mr>,
    #[allow(dead_code)] Option<crate::pinned::Pin>,
);

// SAFETY: libibverbs' calls are thread-safe.
unsafe impl Send for Mr {}
// SAFETY: as above.
unsafe impl Sync for Mr {}

impl Mr {
    pub fn lkey(&self) -> u32 {
        // SAFETY: a live registration.
        unsafe { self.0.as_ref().lkey }
    }
    pub fn rkey(&self) -> u32 {
        // SAFETY: a live registration.
        unsafe { self.0.as_ref().rkey }
    }
}

impl Drop for Mr {
    fn drop(&mut self) {
        if !stack_is_ours() {
            return;
        }
        // SAFETY: a live registration; the NIC refuses its keys from now.
        unsafe { sys::ibv_dereg_mr(self.0.as_ptr()) };
    }
}

/// A completion channel: a descriptor that polls readable after an armed
/// CQ got a completion.
#[derive(Debug)]
pub struct CompChannel(NonNull<sys::ibv_comp_channel>);

// SAFETY: libibverbs' calls are thread-safe.
unsafe impl Send for CompChannel {}
// SAFETY: as above.
unsafe impl Sync for CompChannel {}

impl CompChannel {
    pub fn new(ctx: *mut sys::ibv_context) -> io::Result<CompChannel> {
        // SAFETY: a live context.
        let p = unsafe { sys::ibv_create_comp_channel(ctx) };
        let c = CompChannel(NonNull::new(p).ok_or_else(|| last_error("ibv_create_comp_channel"))?);
        nonblocking_cloexec(c.fd());
        Ok(c)
    }

    pub fn fd(&self) -> i32 {
        // SAFETY: a live channel.
        unsafe { self.0.as_ref().fd }
    }

    /// Take (and acknowledge) the completion events waiting: how many.
    pub fn drain(&self) -> u32 {
        let mut n = 0;
        loop {
            let (mut cq, mut ctx) = (null_mut(), null_mut());
            // SAFETY: a live, non-blocking channel.
            if unsafe { sys::ibv_get_cq_event(self.0.as_ptr(), &mut cq, &mut ctx) } != 0 {
                return n;
            }
            // SAFETY: the event's CQ is live (its owner holds it).
            unsafe { sys::ibv_ack_cq_events(cq, 1) };
            n += 1;
        }
    }
}

impl Drop for CompChannel {
    fn drop(&mut self) {
        if !stack_is_ours() {
            return;
        }
        // SAFETY: its CQs went first.
        unsafe { sys::ibv_destroy_comp_channel(self.0.as_ptr()) };
    }
}

/// A completion queue.
#[derive(Debug)]
pub struct Cq(NonNull<sys::ibv_cq>);

// SAFETY: libibverbs' calls are thread-safe.
unsafe impl Send for Cq {}
// SAFETY: as above.
unsafe impl Sync for Cq {}

impl Cq {
    pub fn new(ctx: *mut sys::ibv_context, entries: i32, channel: &CompChannel) -> io::Result<Cq> {
        // SAFETY: a live context and channel.
        let p = unsafe { sys::ibv_create_cq(ctx, entries, null_mut(), channel.0.as_ptr(), 0) };
        NonNull::new(p)
            .map(Cq)
            .ok_or_else(|| last_error("ibv_create_cq"))
    }

    /// Ask for an event on the channel at the next completion.
    pub fn arm(&self) {
        // SAFETY: a live CQ.
        unsafe { sys::ibv_req_notify_cq(self.0.as_ptr(), 0) };
    }

    /// Take up to `out.len()` (at most 32) completions; how many.
    pub fn poll(&self, out: &mut [Completion]) -> usize {
        // SAFETY: plain data.
        let mut wc: [sys::ibv_wc; 32] = unsafe { std::mem::zeroed() };
        let want = out.len().min(wc.len());
        // SAFETY: a live CQ and room for `want` entries.
        let n = unsafe { sys::ibv_poll_cq(self.0.as_ptr(), want as i32, wc.as_mut_ptr()) };
        let n = n.max(0) as usize;
        for (o, w) in out.iter_mut().zip(&wc[..n]) {
            *o = Completion {
                wr_id: w.wr_id,
                status: w.status,
                byte_len: w.byte_len,
            };
        }
        n
    }
}

impl Drop for Cq {
    fn drop(&mut self) {
        if !stack_is_ours() {
            return;
        }
        // SAFETY: its queue pair went first; every event was acked.
        unsafe { sys::ibv_destroy_cq(self.0.as_ptr()) };
    }
}

/// Post one receive of `[addr, addr+len)` (lkey `lkey`).
pub fn post_recv(
    qp: *mut sys::ibv_qp,
    wr_id: u64,
    addr: u64,
    len: u32,
    lkey: u32,
) -> io::Result<()> {
    let mut sge = sys::ibv_sge {
        addr,
        length: len,
        lkey,
    };
    // SAFETY: plain data.
    let mut wr: sys::ibv_recv_wr = unsafe { std::mem::zeroed() };
    wr.wr_id = wr_id;
    wr.sg_list = &mut sge;
    wr.num_sge = 1;
    let mut bad = null_mut();
    // SAFETY: a live queue pair; the buffer is registered (lkey) and lives
    // as long as the queue pair.
    let r = unsafe { sys::ibv_post_recv(qp, &mut wr, &mut bad) };
    if r == 0 {
        Ok(())
    } else {
        Err(io::Error::from_raw_os_error(r))
    }
}

/// One send-queue operation.
#[derive(Clone, Copy, Debug)]
pub enum SendOp {
    /// SEND `[addr, addr+len)`.
    Send { addr: u64, len: u32, lkey: u32 },
    /// RDMA READ `len` bytes at the peer's `remote` (key `rkey`) into ours.
    Read {
        addr: u64,
        len: u32,
        lkey: u32,
        remote: u64,
        rkey: u32,
    },
    /// Compare-and-swap the peer's word at `remote`; the old value lands
    /// in our 8 bytes at `addr`.
    Cas {
        addr: u64,
        lkey: u32,
        remote: u64,
        rkey: u32,
        expect: u64,
        new: u64,
    },
    /// A zero-byte RDMA WRITE: touches no memory (no key is checked, IB
    /// C9-88) and consumes no receive, but is acknowledged only by a live
    /// queue pair: a liveness probe.
    Probe,
}

pub fn post_send(qp: *mut sys::ibv_qp, wr_id: u64, op: SendOp) -> io::Result<()> {
    use sys::ibv_wr_opcode::*;
    // SAFETY: plain data.
    let mut wr: sys::ibv_send_wr = unsafe { std::mem::zeroed() };
    let mut sge = match op {
        SendOp::Send { addr, len, lkey } => {
            wr.opcode = IBV_WR_SEND;
            sys::ibv_sge {
                addr,
                length: len,
                lkey,
            }
        }
        SendOp::Read {
            addr,
            len,
            lkey,
            remote,
            rkey,
        } => {
            wr.opcode = IBV_WR_RDMA_READ;
            wr.wr.rdma = sys::rdma_t {
                remote_addr: remote,
                rkey,
            };
            sys::ibv_sge {
                addr,
                length: len,
                lkey,
            }
        }
        SendOp::Cas {
            addr,
            lkey,
            remote,
            rkey,
            expect,
            new,
        } => {
            wr.opcode = IBV_WR_ATOMIC_CMP_AND_SWP;
            wr.wr.atomic = sys::atomic_t {
                remote_addr: remote,
                compare_add: expect,
                swap: new,
                rkey,
            };
            sys::ibv_sge {
                addr,
                length: 8,
                lkey,
            }
        }
        SendOp::Probe => {
            wr.opcode = IBV_WR_RDMA_WRITE;
            sys::ibv_sge {
                addr: 0,
                length: 0,
                lkey: 0,
            }
        }
    };
    wr.wr_id = wr_id;
    wr.send_flags = sys::ibv_send_flags::IBV_SEND_SIGNALED.0;
    wr.sg_list = &mut sge;
    wr.num_sge = i32::from(!matches!(op, SendOp::Probe));
    let mut bad = null_mut();
    // SAFETY: a live queue pair; local buffers are registered (their lkey)
    // and live until the completion.
    let r = unsafe { sys::ibv_post_send(qp, &mut wr, &mut bad) };
    if r == 0 {
        Ok(())
    } else {
        Err(io::Error::from_raw_os_error(r))
    }
}

/// The queue pair's state and retry parameters as the device reports them,
/// in a line (for a connection found stuck).
pub fn describe_qp(qp: *mut sys::ibv_qp) -> String {
    use sys::ibv_qp_attr_mask as m;
    // SAFETY: plain data.
    let mut a: sys::ibv_qp_attr = unsafe { std::mem::zeroed() };
    // SAFETY: plain data.
    let mut init: sys::ibv_qp_init_attr = unsafe { std::mem::zeroed() };
    let mask = m::IBV_QP_STATE.0
        | m::IBV_QP_TIMEOUT.0
        | m::IBV_QP_RETRY_CNT.0
        | m::IBV_QP_MAX_QP_RD_ATOMIC.0
        | m::IBV_QP_MAX_DEST_RD_ATOMIC.0
        | m::IBV_QP_SQ_PSN.0;
    // SAFETY: a live queue pair; both outputs are ours.
    let r = unsafe { sys::ibv_query_qp(qp, &mut a, mask as i32, &mut init) };
    if r != 0 {
        return format!(
            "queue pair: query failed ({})",
            io::Error::from_raw_os_error(r)
        );
    }
    format!(
        "queue pair: state {}, sq_draining {}, timeout {}, retry_cnt {}, rd_atomic {}/{}, sq_psn {}",
        a.qp_state,
        a.sq_draining,
        a.timeout,
        a.retry_cnt,
        a.max_rd_atomic,
        a.max_dest_rd_atomic,
        a.sq_psn
    )
}
