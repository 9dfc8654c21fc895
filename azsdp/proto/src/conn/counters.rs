//! Per-connection counters: what moved over which path, and why.

use super::api::Unprotectable;

/// Why zero-copy sends are (or were) not asynchronous.
#[derive(Clone, Copy, Debug, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub enum FallbackReason {
    /// Too many write faults on in-flight buffers: AZ-SDP fell back to ZSDP.
    FaultRate,
    /// The host cannot protect pages safely (no full userfaultfd).
    NoProtection,
    /// The peer keeps no lock words (or this side cannot compare-and-swap):
    /// copy-on-write is impossible, so sends are synchronous (ZSDP).
    NoCopyOnWrite,
    /// The peer cannot GET (or this side cannot expose memory): BSDP only.
    NoZeroCopy,
    /// Protecting or registering a buffer failed; that send used BSDP.
    PrepareFailed,
    /// Registering a buffer hit the locked-memory limit (`RLIMIT_MEMLOCK`);
    /// that send used BSDP.
    MemlockLimit,
}

/// Why bytes of a send went by copy (BSDP) rather than by zero-copy.
#[derive(Clone, Copy, Debug, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub enum CopyReason {
    /// Below the zero-copy threshold.
    Small,
    /// The unaligned head and tail of a zero-copy send (or a buffer that
    /// holds no whole page).
    Edges,
    /// A non-blocking send from memory that cannot be protected (which
    /// kind: [`Counters::copied_memory`]); a blocking one goes by ZSDP.
    Memory,
    /// A non-blocking send while write faults had sends synchronous.
    FaultRate,
    /// A non-blocking send while sends are synchronous for another reason
    /// (see [`Counters::fallback_reason`]).
    Nonblocking,
    /// The connection has no zero-copy path (see [`Counters::fallback_reason`]).
    NoZeroCopy,
    /// Protecting or registering the buffer failed.
    PrepareFailed,
    /// Sent after the peer left (nobody reads it).
    PeerGone,
}

/// How many [`CopyReason`]s there are.
pub const COPY_REASONS: usize = 8;

impl CopyReason {
    pub const ALL: [CopyReason; COPY_REASONS] = [
        CopyReason::Small,
        CopyReason::Edges,
        CopyReason::Memory,
        CopyReason::FaultRate,
        CopyReason::Nonblocking,
        CopyReason::NoZeroCopy,
        CopyReason::PrepareFailed,
        CopyReason::PeerGone,
    ];

    /// Its place in [`Counters::copied`].
    pub fn index(self) -> usize {
        self as usize
    }

    /// The name `azsdp stat` and the log give it.
    pub fn name(self) -> &'static str {
        match self {
            CopyReason::Small => "small",
            CopyReason::Edges => "edges",
            CopyReason::Memory => "memory",
            CopyReason::FaultRate => "fault-rate",
            CopyReason::Nonblocking => "non-blocking",
            CopyReason::NoZeroCopy => "no-zero-copy",
            CopyReason::PrepareFailed => "prepare-failed",
            CopyReason::PeerGone => "peer-gone",
        }
    }
}

/// Monotonic counters. Byte counts are application bytes.
#[derive(Clone, Debug, Default, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct Counters {
    // send side
    pub bytes_sent_bsdp: u64,
    pub bytes_sent_async: u64,
    pub bytes_sent_sync: u64,
    pub sends: u64,
    pub data_msgs_sent: u64,
    pub avails_sent: u64,
    pub updates_sent: u64,
    pub cancels_sent: u64,
    /// Sent bytes a peer that left had not read (known when the fabric
    /// says how far it got).
    pub bytes_unread_by_peer: u64,
    // receive side
    pub bytes_recv_bsdp: u64,
    pub bytes_recv_zcopy: u64,
    /// Of `bytes_recv_zcopy`, those read ahead of the program's calls and
    /// copied out of staging (`conn::ahead`).
    #[serde(default)]
    pub bytes_recv_ahead: u64,
    /// Times the read-ahead gauge turned reading ahead on or off
    /// (`conn::ahead_gauge`).
    #[serde(default)]
    pub ahead_switches: u64,
    pub recvs: u64,
    pub gets: u64,
    pub get_bytes: u64,
    pub armed_recvs: u64,
    pub armed_bytes: u64,
    pub armed_lost_bytes: u64,
    // faults and copy-on-write
    pub send_faults: u64,
    pub recv_faults: u64,
    pub spurious_faults: u64,
    pub cow_attempts: u64,
    pub cow_copies: u64,
    pub cow_bytes: u64,
    pub cow_lost: u64,
    pub block_escalations: u64,
    // path changes
    pub fallbacks: u64,
    pub recoveries: u64,
    pub prepare_failures: u64,
    pub arm_failures: u64,
    pub fallback_reason: Option<FallbackReason>,
    /// Bytes of our stream, and of the peer's, that went over TCP before
    /// the connection joined the fabric (`conn::join`).
    #[serde(default)]
    pub tcp_sent_before_join: u64,
    #[serde(default)]
    pub tcp_received_before_join: u64,
    /// Bytes sent by copy, by [`CopyReason`] (they add up to
    /// `bytes_sent_bsdp`).
    pub copied: [u64; COPY_REASONS],
    /// The kind of the last buffer whose bytes were copied because its
    /// pages could not be protected ([`CopyReason::Memory`]).
    pub copied_memory: Option<Unprotectable>,
    // messages
    pub msgs_sent: u64,
    pub msgs_received: u64,
    pub credits_returned: u64,
}

impl Counters {
    /// Bytes sent by copy for `why`.
    pub fn copied(&self, why: CopyReason) -> u64 {
        self.copied[why.index()]
    }

    /// `n` bytes went by copy for `why`.
    pub(super) fn add_copied(&mut self, why: CopyReason, n: u64) {
        self.bytes_sent_bsdp += n;
        self.copied[why.index()] += n;
    }

    /// Why bytes went by copy, largest share first, as
    /// `small 1200, memory (file-mapping) 4096` (empty if none did).
    pub fn copy_summary(&self) -> String {
        let mut v: Vec<(CopyReason, u64)> = CopyReason::ALL
            .iter()
            .map(|r| (*r, self.copied(*r)))
            .filter(|(_, n)| *n > 0)
            .collect();
        v.sort_by_key(|x| std::cmp::Reverse(x.1));
        v.iter()
            .map(|(r, n)| match (r, self.copied_memory) {
                (CopyReason::Memory, Some(k)) => format!("{} ({}) {n}", r.name(), k.name()),
                _ => format!("{} {n}", r.name()),
            })
            .collect::<Vec<_>>()
            .join(", ")
    }

    /// All application bytes the send side accepted.
    pub fn bytes_sent(&self) -> u64 {
        self.bytes_sent_bsdp + self.bytes_sent_async + self.bytes_sent_sync
    }

    /// All application bytes the receive side delivered (not counting peeks).
    pub fn bytes_received(&self) -> u64 {
        self.bytes_recv_bsdp + self.bytes_recv_zcopy
    }
}
