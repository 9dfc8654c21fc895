//! Per-connection counters: what moved over which path, and why.

/// Why zero-copy sends are (or were) not asynchronous.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
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
}

/// Monotonic counters. Byte counts are application bytes.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
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
    // messages
    pub msgs_sent: u64,
    pub msgs_received: u64,
    pub credits_returned: u64,
}

impl Counters {
    /// All application bytes the send side accepted.
    pub fn bytes_sent(&self) -> u64 {
        self.bytes_sent_bsdp + self.bytes_sent_async + self.bytes_sent_sync
    }

    /// All application bytes the receive side delivered (not counting peeks).
    pub fn bytes_received(&self) -> u64 {
        self.bytes_recv_bsdp + self.bytes_recv_zcopy
    }
}
