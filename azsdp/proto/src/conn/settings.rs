//! Per-connection settings: what the config file resolved to, plus what the
//! host can do. The engine reads them; it never changes them.

use std::time::Duration;

use super::api::Role;

/// What to do when the application writes a page of an in-flight send.
#[derive(Clone, Copy, Debug, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub enum FaultPolicy {
    /// Block the writer until the peer has taken the data (then, after
    /// `block_escalate`, fall back to copying so no wait is unbounded).
    Block,
    /// Take the peer's lock word with compare-and-swap, copy the pages aside,
    /// re-advertise them, and let the writer go at once.
    Copy,
}

/// Receive-side protection: may `recv()` return before the data has landed?
#[derive(Clone, Copy, Debug, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub enum RecvProtect {
    Off,
    On,
    /// Only when the whole pages to arm are at least `recv_protect_min` bytes.
    Auto,
}

/// What the host and its fabric can do for this connection.
#[derive(Clone, Copy, Debug, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct Capabilities {
    /// Memory can be exposed for the peer's GET.
    pub zcopy_source: bool,
    /// The peer's memory can be read with GET.
    pub zcopy_sink: bool,
    /// Pages can be write-protected with every write (including by syscalls)
    /// caught. Without it sends are synchronous (ZSDP).
    pub protect_send: bool,
    /// Pages can be armed for receive-side protection.
    pub arm_recv: bool,
    /// One-sided compare-and-swap on lock words works.
    pub cas: bool,
}

impl Capabilities {
    pub const ALL: Capabilities = Capabilities {
        zcopy_source: true,
        zcopy_sink: true,
        protect_send: true,
        arm_recv: true,
        cas: true,
    };
    pub const NONE: Capabilities = Capabilities {
        zcopy_source: false,
        zcopy_sink: false,
        protect_send: false,
        arm_recv: false,
        cas: false,
    };
}

/// Where this side's lock words live (one per SRC_AVAIL it may receive).
#[derive(Clone, Copy, Debug, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct LockRegion {
    pub addr: u64,
    pub key: u32,
    pub slots: u16,
}

impl LockRegion {
    /// None yet: `Driver::new` fills it in from the fabric.
    pub const UNSET: LockRegion = LockRegion {
        addr: 0,
        key: 0,
        slots: 0,
    };
}

/// Everything the engine needs to know to run one connection.
#[derive(Clone, Debug, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct EngineConfig {
    pub role: Role,
    /// Local page size (power of two).
    pub page_size: u32,
    /// Sends shorter than this go through BSDP.
    pub zcopy_threshold: u64,
    /// AZ-SDP (true): zero-copy sends return at once with their pages
    /// protected. ZSDP (false): they return when the peer has taken the data.
    pub async_zcopy: bool,
    pub write_fault: FaultPolicy,
    /// Under [`FaultPolicy::Block`], how long a writer waits before its pages
    /// are copied aside anyway (bounds the wait; avoids deadlock between two
    /// blocked writers). Zero means copy at once.
    pub block_escalate: Duration,
    pub recv_protect: RecvProtect,
    /// Under [`RecvProtect::Auto`], the least whole-page bytes worth arming.
    pub recv_protect_min: u64,
    /// Bytes of the peer's advertisements a receiver may GET ahead of its
    /// program's `recv()` calls, into staging memory of the fabric's pool,
    /// and copy out when a call comes (0: never; see `conn::ahead`).
    #[serde(default)]
    pub read_ahead: u64,
    /// Read ahead only while it proves faster than zero-copy receives on
    /// this connection (`conn::ahead_gauge`); else whenever it can.
    #[serde(default)]
    pub read_ahead_auto: bool,
    /// Most SRC_AVAILs in flight (also bounded by the peer's lock slots).
    pub max_outstanding: u16,
    /// Largest single SRC_AVAIL; bigger sends are advertised in pieces.
    pub max_avail_len: u32,
    /// Fall back from AZ-SDP to ZSDP when the last `fallback_window`
    /// zero-copy sends saw at least `fallback_faults` write faults (0: never).
    pub fallback_faults: u32,
    pub fallback_window: u32,
    /// ZSDP sends before AZ-SDP is tried again (doubles after each relapse; 0: never).
    pub fallback_recover: u32,
    /// BSDP send buffer: bytes copied from the application not yet posted.
    pub sndbuf: u64,
    /// DATA credits granted to the peer, and the size of each receive slot.
    pub rx_credits: u16,
    pub slot_size: u32,
    /// Abort when the peer is silent this long while something is owed (0: never).
    pub peer_timeout: Duration,
    /// Probe a silent peer after this long.
    pub keepalive: Duration,
    /// How long a closed connection may wait for the peer to take more of its
    /// data before giving up (reset by every bit of progress).
    pub linger: Duration,
    pub caps: Capabilities,
    pub lock_region: LockRegion,
    /// The connection began on the TCP connection beneath and joins the
    /// fabric direction by direction (`conn::join`); both sides agree.
    #[serde(default)]
    pub joins_from_tcp: bool,
}

impl EngineConfig {
    /// Would receive-side protection arm `len` bytes of whole pages of a
    /// receive that may be armed? (The engine decides per GET, the driver
    /// whether to ask the host at all: one rule for both.)
    pub fn arms_pages(&self, len: u64) -> bool {
        self.caps.arm_recv
            && len > 0
            && match self.recv_protect {
                RecvProtect::Off => false,
                RecvProtect::On => true,
                RecvProtect::Auto => len >= self.recv_protect_min,
            }
    }

    /// Defaults from `docs/config.md`, with the given role and capabilities.
    pub fn new(role: Role, caps: Capabilities, lock_region: LockRegion) -> Self {
        EngineConfig {
            role,
            page_size: 4096,
            zcopy_threshold: 64 << 10,
            async_zcopy: true,
            write_fault: FaultPolicy::Copy,
            block_escalate: Duration::from_millis(10),
            recv_protect: RecvProtect::Auto,
            recv_protect_min: 256 << 10,
            read_ahead: 0,
            read_ahead_auto: false,
            max_outstanding: 16,
            max_avail_len: 8 << 20,
            fallback_faults: 8,
            fallback_window: 32,
            fallback_recover: 256,
            sndbuf: 256 << 10,
            rx_credits: 32,
            slot_size: 16 << 10,
            peer_timeout: Duration::from_secs(30),
            keepalive: Duration::from_secs(5),
            linger: Duration::from_secs(30),
            caps,
            lock_region,
            joins_from_tcp: false,
        }
    }
}
