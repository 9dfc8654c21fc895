//! Per-process connection statistics in shared memory, for `azsdp stat`.
//!
//! Every process under azsdp that has a connection keeps one file,
//! `<dir>/azsdp-stat.<pid>`, of fixed-size slots, one per connection, each
//! a row of 64-bit atomic words the process updates as it goes. `azsdp
//! stat` maps the files read-only and copies the rows; no daemon and no
//! locking (a row may be a few updates stale, never torn within a word).
//!
//! The directory is the user's own: `/dev/shm/azsdp-<euid>`, made 0700
//! (or `AZSDP_STAT_DIR`), and checked before use: it must be a real
//! directory, owned by the user, that nobody else can write. A name in a
//! world-writable place can be squatted, so files are created relative to
//! the checked directory's descriptor, with `O_EXCL | O_NOFOLLOW`. A process
//! removes its file at exit; files of processes that died are removed by
//! the next process that makes one there and by `azsdp stat`.
//!
//! `unsafe` here: the shared mapping viewed as atomics.

use std::fs::File;
use std::net::{IpAddr, Ipv6Addr, SocketAddr};
use std::os::fd::{AsFd, OwnedFd};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};

use memmap2::{Mmap, MmapMut};

use crate::conn::{COPY_REASONS, CopyReason, Counters, FallbackReason, Role, Unprotectable};

const MAGIC: u64 = 0x617a_7364_7073_7432; // "azsdpst2"
/// Connections one process file can show (more are counted, not shown).
/// The file is sparse: only pages of slots in use take memory.
pub const SLOTS: usize = 4096;
const WORDS: usize = 48;
const HEADER_WORDS: usize = 32;

/// Word indices within a slot.
mod w {
    pub const STATE: usize = 0;
    pub const ROLE: usize = 1;
    pub const PATH: usize = 2;
    pub const REASON: usize = 3;
    pub const LOCAL_PORT: usize = 4;
    pub const PEER_PORT: usize = 5;
    pub const PEER_PID: usize = 6;
    pub const LOCAL_IP: usize = 7; // and 8
    pub const PEER_IP: usize = 9; // and 10
    pub const ZC_REASON: usize = 11;
    pub const SENT_BSDP: usize = 12;
    pub const SENT_ASYNC: usize = 13;
    pub const SENT_SYNC: usize = 14;
    pub const RECV_BSDP: usize = 15;
    pub const RECV_ZCOPY: usize = 16;
    pub const SENT_TCP: usize = 17;
    pub const RECV_TCP: usize = 18;
    pub const AVAILS_OUT: usize = 19;
    pub const AVAILS_SENT: usize = 20;
    pub const GETS: usize = 21;
    pub const GET_BYTES: usize = 22;
    pub const SEND_FAULTS: usize = 23;
    pub const RECV_FAULTS: usize = 24;
    pub const COW_COPIES: usize = 25;
    pub const COW_LOST: usize = 26;
    pub const FALLBACKS: usize = 27;
    pub const ARMED_RECVS: usize = 28;
    pub const OPENED_MS: usize = 29;
    /// Bytes sent by copy, one word per [`super::CopyReason`].
    pub const COPIED: usize = 30; // to 37
    /// The kind of memory last copied for want of protection.
    pub const COPIED_MEMORY: usize = 38;
    /// The fabric an upgraded connection runs on ([`super::FABRICS`]).
    pub const FABRIC: usize = 39;
    /// The peer's rings of this side's doorbell.
    pub const RUNG: usize = 40;
}

/// Fabric names, by the code the stat word holds (0: none, TCP).
/// (`-msglock`: the copy-on-write lock by message; `-odp`: receive
/// destinations registered on demand.)
pub const FABRICS: [&str; 5] = [
    "shm",
    "verbs",
    "verbs-msglock",
    "verbs-odp",
    "verbs-msglock-odp",
];

/// Header word indices.
mod h {
    pub const MAGIC: usize = 0;
    pub const PID: usize = 1;
    pub const SLOTS: usize = 2;
    pub const DROPPED: usize = 3;
    pub const PROGRAM: usize = 4; // 8 words, NUL-padded
}

/// Which path a connection's bytes take.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum ConnPath {
    /// Plain kernel TCP.
    Tcp,
    /// On the azsdp fabric, copied through the rings only.
    Bsdp,
    /// Zero-copy, synchronous.
    Zsdp,
    /// Zero-copy, asynchronous (AZ-SDP).
    Azsdp,
}

impl ConnPath {
    fn code(self) -> u64 {
        match self {
            ConnPath::Tcp => 1,
            ConnPath::Bsdp => 2,
            ConnPath::Zsdp => 3,
            ConnPath::Azsdp => 4,
        }
    }
    fn from_code(c: u64) -> ConnPath {
        match c {
            2 => ConnPath::Bsdp,
            3 => ConnPath::Zsdp,
            4 => ConnPath::Azsdp,
            _ => ConnPath::Tcp,
        }
    }
    pub fn name(self) -> &'static str {
        match self {
            ConnPath::Tcp => "tcp",
            ConnPath::Bsdp => "bsdp",
            ConnPath::Zsdp => "zsdp",
            ConnPath::Azsdp => "azsdp",
        }
    }
}

/// Why a connection stayed on (or went back to) TCP.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum TcpReason {
    /// A config rule says `tcp` for it.
    Rule,
    /// No listener under azsdp answers for that address and port.
    PeerNotAzsdp,
    /// The peer is on another host (no remote fabric yet).
    PeerRemote,
    /// The listener did not accept the connection within `pair_timeout`.
    PairTimeout,
    /// The side channel or the shared segment could not be set up.
    SetupFailed,
    /// The configuration could not be loaded.
    BadConfig,
    /// The peer's address does not match what it claimed when pairing.
    Mismatch,
    /// Socket options the fabric does not emulate (e.g. OOB data).
    Unsupported,
    /// The kernel did not confirm who the other side is (a registry name
    /// held by someone who does not own the listener, an answer without
    /// the accepted socket, an offer from another user than the socket's).
    PeerUnverified,
    /// Client and listener are one process: its `accept()` may come only
    /// after this `connect()` returns, so pairing could only time out.
    SameProcess,
    /// The connection was on azsdp and moved onto its TCP socket (an
    /// `exec`, or processes sharing it after a fork).
    Switched,
    /// The process may not start threads (a seccomp filter it installed).
    Sandboxed,
    /// Verbs was to be tried, but this host has no RDMA device (or no
    /// rdma-core, or a build without the `verbs` feature).
    NoRdmaDevice,
    /// rdma_cm found no route to the peer's address.
    RdmaRoute,
    /// The peer's azsdp listener rejected the RDMA connection (full, or
    /// its request did not check out).
    CmRejected,
    /// The peer's RDMA connection was not made within `pair_timeout`.
    CmTimeout,
    /// The pair is under way: the connection is TCP meanwhile.
    Pairing,
    /// A fork shared the connection before its pair completed.
    Forked,
    /// The program shut the connection down or closed it before its pair
    /// completed.
    ShortLived,
    /// The listener refused the offer: it held as many pending offers as
    /// its limits allow (a burst the server had not accepted yet).
    ListenerBusy,
    /// This process's recent connections to the destination ended before a
    /// pair paid off, so this one made no offer (`pair_every_connection`).
    NotWorthPairing,
}

impl TcpReason {
    pub const ALL: [TcpReason; 21] = [
        TcpReason::Rule,
        TcpReason::PeerNotAzsdp,
        TcpReason::PeerRemote,
        TcpReason::PairTimeout,
        TcpReason::SetupFailed,
        TcpReason::BadConfig,
        TcpReason::Mismatch,
        TcpReason::Unsupported,
        TcpReason::PeerUnverified,
        TcpReason::SameProcess,
        TcpReason::Switched,
        TcpReason::Sandboxed,
        TcpReason::NoRdmaDevice,
        TcpReason::RdmaRoute,
        TcpReason::CmRejected,
        TcpReason::CmTimeout,
        TcpReason::Pairing,
        TcpReason::Forked,
        TcpReason::ShortLived,
        TcpReason::ListenerBusy,
        TcpReason::NotWorthPairing,
    ];
    fn code(self) -> u64 {
        TcpReason::ALL.iter().position(|r| *r == self).unwrap_or(0) as u64 + 1
    }
    fn from_code(c: u64) -> Option<TcpReason> {
        c.checked_sub(1)
            .and_then(|i| TcpReason::ALL.get(i as usize))
            .copied()
    }
    pub fn name(self) -> &'static str {
        match self {
            TcpReason::Rule => "rule",
            TcpReason::PeerNotAzsdp => "peer-not-azsdp",
            TcpReason::PeerRemote => "peer-remote",
            TcpReason::PairTimeout => "pair-timeout",
            TcpReason::SetupFailed => "setup-failed",
            TcpReason::BadConfig => "bad-config",
            TcpReason::Mismatch => "mismatch",
            TcpReason::Unsupported => "unsupported",
            TcpReason::PeerUnverified => "peer-unverified",
            TcpReason::SameProcess => "same-process",
            TcpReason::Switched => "switched",
            TcpReason::Sandboxed => "sandboxed",
            TcpReason::NoRdmaDevice => "no-rdma-device",
            TcpReason::RdmaRoute => "rdma-route",
            TcpReason::CmRejected => "cm-rejected",
            TcpReason::CmTimeout => "cm-timeout",
            TcpReason::Pairing => "pairing",
            TcpReason::Forked => "forked",
            TcpReason::ShortLived => "short-lived",
            TcpReason::ListenerBusy => "listener-busy",
            TcpReason::NotWorthPairing => "not-worth-pairing",
        }
    }
}

fn zc_code(r: Option<FallbackReason>) -> u64 {
    match r {
        None => 0,
        Some(FallbackReason::FaultRate) => 1,
        Some(FallbackReason::NoProtection) => 2,
        Some(FallbackReason::NoCopyOnWrite) => 3,
        Some(FallbackReason::NoZeroCopy) => 4,
        Some(FallbackReason::PrepareFailed) => 5,
        Some(FallbackReason::MemlockLimit) => 6,
    }
}

fn zc_name(c: u64) -> Option<&'static str> {
    Some(match c {
        1 => "fault-rate",
        2 => "no-protection",
        3 => "no-copy-on-write",
        4 => "no-zero-copy",
        5 => "prepare-failed",
        6 => "memlock-limit",
        _ => return None,
    })
}

/// Where the stat files of all users live, unless `AZSDP_STAT_DIR` says.
pub const SHARED_ROOT: &str = "/dev/shm";

/// Directory of this user's stat files: `AZSDP_STAT_DIR`, else
/// `/dev/shm/azsdp-<euid>`.
pub fn dir() -> PathBuf {
    std::env::var_os("AZSDP_STAT_DIR")
        .map(PathBuf::from)
        .unwrap_or_else(|| own_dir(nix::unistd::geteuid().as_raw()))
}

fn own_dir(uid: u32) -> PathBuf {
    Path::new(SHARED_ROOT).join(format!("azsdp-{uid}"))
}

/// Directories `azsdp stat` reads: `AZSDP_STAT_DIR`, else every user's
/// directory under `/dev/shm` (those it may read).
pub fn dirs_to_read() -> Vec<PathBuf> {
    if let Some(d) = std::env::var_os("AZSDP_STAT_DIR") {
        return vec![PathBuf::from(d)];
    }
    let mut v: Vec<PathBuf> = std::fs::read_dir(SHARED_ROOT)
        .into_iter()
        .flatten()
        .flatten()
        .filter(|e| {
            e.file_name()
                .to_str()
                .and_then(|n| n.strip_prefix("azsdp-"))
                .is_some_and(|u| u.parse::<u32>().is_ok())
        })
        .map(|e| e.path())
        .collect();
    v.sort();
    v
}

/// Why a stat directory was not used.
#[derive(Debug, thiserror::Error)]
pub enum StatDirError {
    #[error("{0}: {1}")]
    Io(PathBuf, std::io::Error),
    #[error("{0} is owned by uid {1}, not by us (uid {2}): not used")]
    Owner(PathBuf, u32, u32),
    #[error("{0} can be written by other users (mode {1:o}): not used")]
    Mode(PathBuf, u32),
}

/// Open `dir` for our files after checking that it is a directory (not a
/// symlink to one) that we own and nobody else can write. Our own default
/// directory is made, 0700, if missing.
pub fn open_dir(dir: &Path) -> Result<OwnedFd, StatDirError> {
    use nix::fcntl::{OFlag, open};
    use nix::sys::stat::{Mode, fstat};
    let euid = nix::unistd::geteuid().as_raw();
    let io = |e: nix::Error| StatDirError::Io(dir.to_path_buf(), e.into());
    if std::env::var_os("AZSDP_STAT_DIR").is_none() && dir == own_dir(euid) {
        match nix::unistd::mkdir(dir, Mode::S_IRWXU) {
            Ok(()) | Err(nix::Error::EEXIST) => {}
            Err(e) => return Err(io(e)),
        }
    }
    let fd = open(
        dir,
        OFlag::O_RDONLY | OFlag::O_DIRECTORY | OFlag::O_NOFOLLOW | OFlag::O_CLOEXEC,
        Mode::empty(),
    )
    .map_err(io)?;
    let st = fstat(&fd).map_err(io)?;
    if st.st_uid != euid {
        return Err(StatDirError::Owner(dir.to_path_buf(), st.st_uid, euid));
    }
    let mode = st.st_mode & 0o7777;
    if mode & 0o022 != 0 {
        return Err(StatDirError::Mode(dir.to_path_buf(), mode));
    }
    Ok(fd)
}

fn file_name(pid: u32) -> String {
    format!("azsdp-stat.{pid}")
}

/// The pid a stat file's name names.
fn pid_of(name: &std::ffi::OsStr) -> Option<u32> {
    name.to_str()?.strip_prefix("azsdp-stat.")?.parse().ok()
}

fn file_of(dir: &Path, pid: u32) -> PathBuf {
    dir.join(file_name(pid))
}

/// Remove the files of processes that are gone, in the checked `dir`.
fn sweep(dirfd: &OwnedFd, dir: &Path) {
    for e in std::fs::read_dir(dir).into_iter().flatten().flatten() {
        let name = e.file_name();
        let Some(pid) = pid_of(&name) else {
            continue;
        };
        if !alive(pid) {
            let _ = nix::unistd::unlinkat(
                dirfd,
                name.as_os_str(),
                nix::unistd::UnlinkatFlags::NoRemoveDir,
            );
        }
    }
}

fn file_len() -> usize {
    (HEADER_WORDS + SLOTS * WORDS) * 8
}

fn ip_words(ip: IpAddr) -> (u64, u64) {
    let v6 = match ip {
        IpAddr::V4(a) => a.to_ipv6_mapped(),
        IpAddr::V6(a) => a,
    };
    let b = u128::from(v6);
    ((b >> 64) as u64, b as u64)
}

fn ip_of(hi: u64, lo: u64) -> IpAddr {
    let a = Ipv6Addr::from((u128::from(hi) << 64) | u128::from(lo));
    match a.to_ipv4_mapped() {
        Some(v4) => IpAddr::V4(v4),
        None => IpAddr::V6(a),
    }
}

/// This process's stat file, for writing.
#[derive(Debug)]
pub struct StatFile {
    map: MmapMut,
    dirfd: OwnedFd,
    path: PathBuf,
    pid: u32,
    /// Where the next search for a free slot starts, and how many slots
    /// are taken: an open costs a slot or two, not a scan from slot 0
    /// (with thousands of connections, a scan per connection was a
    /// quadratic cost), and a full file costs nothing.
    next: AtomicUsize,
    used: AtomicUsize,
}

impl StatFile {
    /// Create this process's file in `dir` (checked with [`open_dir`]); a
    /// file of the same pid (ours before an exec, or a dead process's)
    /// is replaced.
    pub fn create(dir: &Path, program: &str) -> std::io::Result<StatFile> {
        use nix::fcntl::{OFlag, openat};
        use nix::sys::stat::Mode;
        let dirfd = open_dir(dir).map_err(|e| std::io::Error::other(e.to_string()))?;
        sweep(&dirfd, dir);
        let pid = std::process::id();
        let name = file_name(pid);
        let flags =
            OFlag::O_RDWR | OFlag::O_CREAT | OFlag::O_EXCL | OFlag::O_NOFOLLOW | OFlag::O_CLOEXEC;
        let mode = Mode::S_IRUSR | Mode::S_IWUSR;
        let fd = match openat(&dirfd, name.as_str(), flags, mode) {
            Err(nix::Error::EEXIST) => {
                nix::unistd::unlinkat(
                    &dirfd,
                    name.as_str(),
                    nix::unistd::UnlinkatFlags::NoRemoveDir,
                )?;
                openat(&dirfd, name.as_str(), flags, mode)?
            }
            r => r?,
        };
        let f = File::from(fd);
        if let Err(e) = crate::file_size::set_len(&f, file_len() as u64) {
            let _ = nix::unistd::unlinkat(
                &dirfd,
                name.as_str(),
                nix::unistd::UnlinkatFlags::NoRemoveDir,
            );
            return Err(e);
        }
        // SAFETY: a regular file we just made, in our own directory; only
        // this process writes it, and only through atomics.
        let map = unsafe { MmapMut::map_mut(&f)? };
        let s = StatFile {
            map,
            dirfd,
            path: file_of(dir, pid),
            pid,
            next: AtomicUsize::new(0),
            used: AtomicUsize::new(0),
        };
        let hdr = s.words(0, HEADER_WORDS);
        hdr[h::PID].store(u64::from(pid), Ordering::Relaxed);
        hdr[h::SLOTS].store(SLOTS as u64, Ordering::Relaxed);
        let name = program.as_bytes();
        for (i, word) in hdr[h::PROGRAM..h::PROGRAM + 8].iter().enumerate() {
            let mut b = [0u8; 8];
            for (j, x) in b.iter_mut().enumerate() {
                *x = name.get(i * 8 + j).copied().unwrap_or(0);
            }
            word.store(u64::from_le_bytes(b), Ordering::Relaxed);
        }
        hdr[h::MAGIC].store(MAGIC, Ordering::Release);
        Ok(s)
    }

    /// Where the file is.
    pub fn path(&self) -> &Path {
        &self.path
    }

    /// Remove the file (at exit). Only the process that made it does.
    pub fn remove(&self) {
        // (Not from a seccomp sandbox, which may kill for it: a later
        // process sweeps the file.)
        if crate::process::pid() == self.pid && !crate::sandbox::marked() {
            let _ = nix::unistd::unlinkat(
                self.dirfd.as_fd(),
                file_name(self.pid).as_str(),
                nix::unistd::UnlinkatFlags::NoRemoveDir,
            );
        }
    }

    fn words(&self, at: usize, n: usize) -> &[AtomicU64] {
        assert!((at + n) * 8 <= self.map.len());
        // SAFETY: in bounds (checked), 8-aligned (page-aligned map), and the
        // memory is only ever accessed as atomics by every process.
        unsafe { std::slice::from_raw_parts(self.map.as_ptr().cast::<AtomicU64>().add(at), n) }
    }

    fn slot_words(&self, slot: usize) -> &[AtomicU64] {
        self.words(HEADER_WORDS + slot * WORDS, WORDS)
    }

    /// The process that made the file.
    pub fn pid(&self) -> u32 {
        self.pid
    }

    /// Writes from a forked child, whose inherited mapping is the parent's
    /// file, are dropped (it makes its own).
    fn mine(&self) -> bool {
        crate::process::pid() == self.pid
    }

    /// Take a free slot for a connection; `None` (counted) if all are used.
    pub fn open_slot(&self, role: Role, local: SocketAddr, peer: SocketAddr) -> Option<usize> {
        if !self.mine() {
            return None;
        }
        let start = self.next.load(Ordering::Relaxed);
        let free = self.used.load(Ordering::Relaxed) < SLOTS;
        for slot in (start..SLOTS)
            .chain(0..start)
            .take(if free { SLOTS } else { 0 })
        {
            let s = self.slot_words(slot);
            if s[w::STATE]
                .compare_exchange(0, 1, Ordering::AcqRel, Ordering::Relaxed)
                .is_ok()
            {
                for x in &s[1..] {
                    x.store(0, Ordering::Relaxed);
                }
                s[w::ROLE].store(u64::from(role == Role::Server), Ordering::Relaxed);
                s[w::PATH].store(ConnPath::Tcp.code(), Ordering::Relaxed);
                s[w::LOCAL_PORT].store(u64::from(local.port()), Ordering::Relaxed);
                s[w::PEER_PORT].store(u64::from(peer.port()), Ordering::Relaxed);
                let (a, b) = ip_words(local.ip());
                s[w::LOCAL_IP].store(a, Ordering::Relaxed);
                s[w::LOCAL_IP + 1].store(b, Ordering::Relaxed);
                let (a, b) = ip_words(peer.ip());
                s[w::PEER_IP].store(a, Ordering::Relaxed);
                s[w::PEER_IP + 1].store(b, Ordering::Relaxed);
                let ms = std::time::SystemTime::now()
                    .duration_since(std::time::UNIX_EPOCH)
                    .map_or(0, |d| d.as_millis() as u64);
                s[w::OPENED_MS].store(ms, Ordering::Relaxed);
                s[w::STATE].store(2, Ordering::Release);
                self.used.fetch_add(1, Ordering::Relaxed);
                self.next.store((slot + 1) % SLOTS, Ordering::Relaxed);
                return Some(slot);
            }
        }
        self.words(0, HEADER_WORDS)[h::DROPPED].fetch_add(1, Ordering::Relaxed);
        None
    }

    /// Set the connection's path, peer pid and why it is on TCP (if it is).
    pub fn set_path(&self, slot: usize, path: ConnPath, reason: Option<TcpReason>, peer_pid: u32) {
        if !self.mine() {
            return;
        }
        let s = self.slot_words(slot);
        s[w::PATH].store(path.code(), Ordering::Relaxed);
        s[w::REASON].store(reason.map_or(0, TcpReason::code), Ordering::Relaxed);
        s[w::PEER_PID].store(u64::from(peer_pid), Ordering::Relaxed);
    }

    /// The fabric the connection runs on (a name of [`FABRICS`]).
    pub fn set_fabric(&self, slot: usize, fabric: &str) {
        if !self.mine() {
            return;
        }
        let code = FABRICS
            .iter()
            .position(|f| *f == fabric)
            .map_or(0, |i| i + 1);
        self.slot_words(slot)[w::FABRIC].store(code as u64, Ordering::Relaxed);
    }

    /// Bytes moved over plain TCP.
    pub fn add_tcp(&self, slot: usize, sent: u64, received: u64) {
        if !self.mine() {
            return;
        }
        let s = self.slot_words(slot);
        if sent > 0 {
            s[w::SENT_TCP].fetch_add(sent, Ordering::Relaxed);
        }
        if received > 0 {
            s[w::RECV_TCP].fetch_add(received, Ordering::Relaxed);
        }
    }

    /// Copy an engine's counters into the slot.
    pub fn publish(&self, slot: usize, c: &Counters, outstanding_avails: u64, path: ConnPath) {
        if !self.mine() {
            return;
        }
        let s = self.slot_words(slot);
        let set = |i: usize, v: u64| s[i].store(v, Ordering::Relaxed);
        set(w::PATH, path.code());
        set(w::ZC_REASON, zc_code(c.fallback_reason));
        set(w::SENT_BSDP, c.bytes_sent_bsdp);
        set(w::SENT_ASYNC, c.bytes_sent_async);
        set(w::SENT_SYNC, c.bytes_sent_sync);
        set(w::RECV_BSDP, c.bytes_recv_bsdp);
        set(w::RECV_ZCOPY, c.bytes_recv_zcopy);
        // A connection that began on TCP: what went there before it joined.
        set(w::SENT_TCP, c.tcp_sent_before_join);
        set(w::RECV_TCP, c.tcp_received_before_join);
        set(w::AVAILS_OUT, outstanding_avails);
        set(w::AVAILS_SENT, c.avails_sent);
        set(w::GETS, c.gets);
        set(w::GET_BYTES, c.get_bytes);
        set(w::SEND_FAULTS, c.send_faults);
        set(w::RECV_FAULTS, c.recv_faults);
        set(w::COW_COPIES, c.cow_copies);
        set(w::COW_LOST, c.cow_lost);
        set(w::FALLBACKS, c.fallbacks);
        set(w::ARMED_RECVS, c.armed_recvs);
        for (i, n) in c.copied.iter().enumerate() {
            set(w::COPIED + i, *n);
        }
        let kind = c
            .copied_memory
            .and_then(|k| Unprotectable::ALL.iter().position(|x| *x == k));
        set(w::COPIED_MEMORY, kind.map_or(0, |i| i as u64 + 1));
    }

    /// How often the peer rang this side's doorbell (see
    /// `ThreadedDriver::rung`).
    pub fn set_rung(&self, slot: usize, rung: u64) {
        if !self.mine() {
            return;
        }
        self.slot_words(slot)[w::RUNG].store(rung, Ordering::Relaxed);
    }

    /// The connection is gone: free its slot.
    pub fn close_slot(&self, slot: usize) {
        if !self.mine() {
            return;
        }
        if self.slot_words(slot)[w::STATE].swap(0, Ordering::AcqRel) != 0 {
            self.used.fetch_sub(1, Ordering::Relaxed);
        }
    }
}

impl Drop for StatFile {
    fn drop(&mut self) {
        self.remove();
    }
}

/// One connection as `azsdp stat` shows it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ConnStat {
    pub pid: u32,
    pub program: String,
    pub role: Role,
    pub local: SocketAddr,
    pub peer: SocketAddr,
    pub peer_pid: u32,
    pub path: ConnPath,
    /// The fabric of an upgraded connection (`shm`, `verbs`).
    pub fabric: Option<&'static str>,
    pub tcp_reason: Option<TcpReason>,
    pub zcopy_fallback: Option<&'static str>,
    pub sent_tcp: u64,
    pub recv_tcp: u64,
    pub sent_bsdp: u64,
    pub sent_async: u64,
    pub sent_sync: u64,
    pub recv_bsdp: u64,
    pub recv_zcopy: u64,
    pub avails_outstanding: u64,
    pub avails_sent: u64,
    pub gets: u64,
    pub get_bytes: u64,
    pub send_faults: u64,
    pub recv_faults: u64,
    pub cow_copies: u64,
    pub cow_lost: u64,
    pub fallbacks: u64,
    pub armed_recvs: u64,
    /// Wake-ups of this process's reactor that the peer's messages asked
    /// (rings of its doorbell): few while a call or an event loop is
    /// looking at the connection.
    pub rung: u64,
    /// Bytes sent by copy, by [`CopyReason`] (index).
    pub copied: [u64; COPY_REASONS],
    /// What memory was copied for want of protection ([`CopyReason::Memory`]).
    pub copied_memory: Option<Unprotectable>,
    pub opened_ms: u64,
}

impl ConnStat {
    /// Bytes sent by copy for `why`.
    pub fn copied(&self, why: CopyReason) -> u64 {
        self.copied[why.index()]
    }

    /// Why most of the copied bytes were copied (`memory` with its kind),
    /// or `None` if none were.
    pub fn main_copy_reason(&self) -> Option<String> {
        let top = CopyReason::ALL
            .iter()
            .copied()
            .filter(|r| self.copied(*r) > 0)
            .max_by_key(|r| self.copied(*r))?;
        Some(match (top, self.copied_memory) {
            (CopyReason::Memory, Some(k)) => format!("memory:{}", k.name()),
            _ => top.name().to_string(),
        })
    }
}

/// Is `pid` a live process? A zombie (exited, not yet waited for by its
/// parent) is not: its connections are gone.
pub(crate) fn alive(pid: u32) -> bool {
    let Ok(p) = i32::try_from(pid) else {
        return false;
    };
    // SAFETY: kill with signal 0 only checks for existence.
    let r = unsafe { libc::kill(p, 0) };
    let exists = r == 0 || std::io::Error::last_os_error().raw_os_error() == Some(libc::EPERM);
    exists
        && std::fs::read_to_string(format!("/proc/{p}/stat"))
            .map_or(true, |st| !matches!(process_state(&st), Some('Z' | 'X')))
}

/// Is live process `pid` held up rather than idle: is some thread of it
/// stopped (SIGSTOP, a debugger: `T`, `t`), runnable but waiting for a
/// CPU (`R`), or in uninterruptible sleep (`D`)? A peer so held up cannot
/// answer, but will: it is waited for, as TCP waits for it. One whose
/// threads all sleep (`S`) yet stays silent is not held up: its engine is
/// stuck, and the connection times out. False if `/proc` cannot tell.
pub(crate) fn held_up(pid: u32) -> bool {
    let Ok(tasks) = std::fs::read_dir(format!("/proc/{pid}/task")) else {
        return false;
    };
    tasks.flatten().any(|t| {
        std::fs::read_to_string(t.path().join("stat"))
            .is_ok_and(|st| matches!(process_state(&st), Some('R' | 'D' | 'T' | 't')))
    })
}

/// The state letter of a `/proc/PID/stat` line (after the command name,
/// which may itself hold spaces and parentheses).
fn process_state(stat: &str) -> Option<char> {
    stat.rsplit_once(')')?.1.trim_start().chars().next()
}

/// Read every live process's connections in `dirs`.
pub fn read_dirs(dirs: &[PathBuf]) -> Vec<ConnStat> {
    let mut out: Vec<ConnStat> = dirs.iter().flat_map(|d| read_all(d)).collect();
    out.sort_by_key(|c| (c.pid, c.opened_ms));
    out
}

/// Read every live process's connections under `dir`; files of processes
/// that are gone are removed. Unreadable or foreign files (not owned by
/// the directory's owner, or not regular files) are skipped.
pub fn read_all(dir: &Path) -> Vec<ConnStat> {
    let mut out = Vec::new();
    let Ok(owner) = std::fs::symlink_metadata(dir).map(|m| {
        use std::os::unix::fs::MetadataExt;
        (m.is_dir(), m.uid())
    }) else {
        return out;
    };
    if !owner.0 {
        return out;
    }
    let Ok(entries) = std::fs::read_dir(dir) else {
        return out;
    };
    for e in entries.flatten() {
        let Some(pid) = pid_of(&e.file_name()) else {
            continue;
        };
        if !alive(pid) {
            let _ = std::fs::remove_file(e.path());
            continue;
        }
        if let Some(rows) = read_file(&e.path(), pid, owner.1) {
            out.extend(rows);
        }
    }
    out.sort_by_key(|c| (c.pid, c.opened_ms));
    out
}

fn read_file(path: &Path, pid: u32, owner: u32) -> Option<Vec<ConnStat>> {
    use std::os::unix::fs::{MetadataExt, OpenOptionsExt};
    let f = std::fs::OpenOptions::new()
        .read(true)
        .custom_flags(libc::O_NOFOLLOW | libc::O_NONBLOCK)
        .open(path)
        .ok()?;
    let m = f.metadata().ok()?;
    if !m.is_file() || m.uid() != owner || m.len() < file_len() as u64 {
        return None;
    }
    // SAFETY: read-only shared mapping, read only through atomics below.
    let map = unsafe { Mmap::map(&f).ok()? };
    // SAFETY: the file is at least file_len() bytes (checked) and the
    // mapping page-aligned; its writer only stores whole words atomically.
    let words =
        unsafe { std::slice::from_raw_parts(map.as_ptr().cast::<AtomicU64>(), file_len() / 8) };
    let get = |i: usize| words[i].load(Ordering::Relaxed);
    if words[h::MAGIC].load(Ordering::Acquire) != MAGIC || get(h::PID) != u64::from(pid) {
        return None;
    }
    let mut program = Vec::new();
    for i in 0..8 {
        program.extend_from_slice(&get(h::PROGRAM + i).to_le_bytes());
    }
    let program = String::from_utf8_lossy(&program)
        .trim_end_matches('\0')
        .to_string();
    let mut rows = Vec::new();
    for slot in 0..SLOTS {
        let b = HEADER_WORDS + slot * WORDS;
        let s = |i: usize| get(b + i);
        if words[b + w::STATE].load(Ordering::Acquire) != 2 {
            continue;
        }
        rows.push(ConnStat {
            pid,
            program: program.clone(),
            role: if s(w::ROLE) == 1 {
                Role::Server
            } else {
                Role::Client
            },
            local: SocketAddr::new(
                ip_of(s(w::LOCAL_IP), s(w::LOCAL_IP + 1)),
                s(w::LOCAL_PORT) as u16,
            ),
            peer: SocketAddr::new(
                ip_of(s(w::PEER_IP), s(w::PEER_IP + 1)),
                s(w::PEER_PORT) as u16,
            ),
            peer_pid: s(w::PEER_PID) as u32,
            path: ConnPath::from_code(s(w::PATH)),
            fabric: (s(w::FABRIC) as usize)
                .checked_sub(1)
                .and_then(|i| FABRICS.get(i))
                .copied(),
            tcp_reason: TcpReason::from_code(s(w::REASON)),
            zcopy_fallback: zc_name(s(w::ZC_REASON)),
            sent_tcp: s(w::SENT_TCP),
            recv_tcp: s(w::RECV_TCP),
            sent_bsdp: s(w::SENT_BSDP),
            sent_async: s(w::SENT_ASYNC),
            sent_sync: s(w::SENT_SYNC),
            recv_bsdp: s(w::RECV_BSDP),
            recv_zcopy: s(w::RECV_ZCOPY),
            avails_outstanding: s(w::AVAILS_OUT),
            avails_sent: s(w::AVAILS_SENT),
            gets: s(w::GETS),
            get_bytes: s(w::GET_BYTES),
            send_faults: s(w::SEND_FAULTS),
            recv_faults: s(w::RECV_FAULTS),
            cow_copies: s(w::COW_COPIES),
            cow_lost: s(w::COW_LOST),
            fallbacks: s(w::FALLBACKS),
            armed_recvs: s(w::ARMED_RECVS),
            rung: s(w::RUNG),
            copied: std::array::from_fn(|i| s(w::COPIED + i)),
            copied_memory: (s(w::COPIED_MEMORY) as usize)
                .checked_sub(1)
                .and_then(|i| Unprotectable::ALL.get(i))
                .copied(),
            opened_ms: s(w::OPENED_MS),
        });
    }
    Some(rows)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_zombie_is_not_alive() {
        assert_eq!(process_state("12 (a) b) c) Z 1 2"), Some('Z'));
        assert_eq!(process_state("12 (sleep) S 1"), Some('S'));
        assert_eq!(process_state("garbage"), None);
        assert!(alive(std::process::id()));
        let mut child = std::process::Command::new("true").spawn().unwrap();
        let pid = child.id();
        // Not waited for: a zombie once it has exited.
        let deadline = std::time::Instant::now() + std::time::Duration::from_secs(20);
        while alive(pid) {
            assert!(
                std::time::Instant::now() < deadline,
                "child {pid} never exited"
            );
            std::thread::sleep(std::time::Duration::from_millis(5));
        }
        child.wait().unwrap();
    }

    #[test]
    fn rows_round_trip_and_dead_files_are_removed() {
        let dir = std::env::temp_dir().join(format!("azsdp-stat-test-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let f = StatFile::create(&dir, "prog-name").unwrap();
        let local: SocketAddr = "127.0.0.1:5000".parse().unwrap();
        let peer: SocketAddr = "[::1]:6000".parse().unwrap();
        let slot = f.open_slot(Role::Server, local, peer).unwrap();
        let other = f.open_slot(Role::Client, peer, local).unwrap();
        f.set_path(slot, ConnPath::Azsdp, None, 4242);
        f.set_path(other, ConnPath::Tcp, Some(TcpReason::PeerNotAzsdp), 0);
        f.add_tcp(other, 10, 20);
        let mut copied = [0; COPY_REASONS];
        copied[CopyReason::Small.index()] = 100;
        copied[CopyReason::Memory.index()] = 5000;
        let c = Counters {
            bytes_sent_async: 1 << 30,
            gets: 7,
            fallback_reason: Some(FallbackReason::FaultRate),
            copied,
            copied_memory: Some(Unprotectable::File),
            tcp_sent_before_join: 11,
            tcp_received_before_join: 12,
            ..Counters::default()
        };
        f.publish(slot, &c, 3, ConnPath::Zsdp);
        f.close_slot(other);
        // A file of a process that cannot exist.
        std::fs::write(dir.join("azsdp-stat.4000000000"), b"x").unwrap();
        let rows = read_all(&dir);
        assert_eq!(rows.len(), 1);
        let r = &rows[0];
        assert_eq!(r.program, "prog-name");
        assert_eq!((r.local, r.peer, r.peer_pid), (local, peer, 4242));
        assert_eq!(r.role, Role::Server);
        assert_eq!(r.path, ConnPath::Zsdp);
        assert_eq!(
            (r.sent_async, r.gets, r.avails_outstanding),
            (1 << 30, 7, 3)
        );
        assert_eq!((r.sent_tcp, r.recv_tcp), (11, 12));
        assert_eq!(r.zcopy_fallback, Some("fault-rate"));
        assert_eq!(r.copied, copied);
        assert_eq!(r.copied_memory, Some(Unprotectable::File));
        assert_eq!(r.main_copy_reason().as_deref(), Some("memory:file-mapping"));
        assert!(!dir.join("azsdp-stat.4000000000").exists());
        drop(f);
        assert!(read_all(&dir).is_empty());
        assert!(!file_of(&dir, std::process::id()).exists(), "removed");
        let _ = std::fs::remove_dir_all(&dir);
    }

    /// A directory others can write, one owned by someone else, or a
    /// symlink to a directory is not used; a symlink planted where our
    /// file goes is replaced, never followed.
    #[test]
    fn squatted_directories_and_planted_symlinks_are_refused() {
        use std::os::unix::fs::PermissionsExt;
        let base = std::env::temp_dir().join(format!("azsdp-stat-trap-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&base);
        let open = base.join("open");
        std::fs::create_dir_all(&open).unwrap();
        std::fs::set_permissions(&open, std::fs::Permissions::from_mode(0o777)).unwrap();
        assert!(matches!(open_dir(&open), Err(StatDirError::Mode(..))));
        assert!(StatFile::create(&open, "p").is_err());
        let link = base.join("link");
        std::os::unix::fs::symlink(&open, &link).unwrap();
        assert!(matches!(open_dir(&link), Err(StatDirError::Io(..))));
        if nix::unistd::geteuid().is_root() {
            let theirs = base.join("theirs");
            std::fs::create_dir_all(&theirs).unwrap();
            std::os::unix::fs::chown(&theirs, Some(65534), None).unwrap();
            assert!(matches!(open_dir(&theirs), Err(StatDirError::Owner(..))));
        }
        let ours = base.join("ours");
        std::fs::create_dir_all(&ours).unwrap();
        let victim = base.join("victim");
        std::fs::write(&victim, b"precious").unwrap();
        std::os::unix::fs::symlink(&victim, file_of(&ours, std::process::id())).unwrap();
        let f = StatFile::create(&ours, "p").unwrap();
        assert_eq!(std::fs::read(&victim).unwrap(), b"precious");
        assert!(
            !std::fs::symlink_metadata(f.path())
                .unwrap()
                .file_type()
                .is_symlink()
        );
        drop(f);
        let _ = std::fs::remove_dir_all(&base);
    }

    #[test]
    fn stopped_and_busy_processes_are_held_up_sleeping_ones_are_not() {
        use std::time::{Duration, Instant};
        let until = |what: &str, pid: u32, want: bool| {
            let deadline = Instant::now() + Duration::from_secs(20);
            while held_up(pid) != want {
                assert!(
                    Instant::now() < deadline,
                    "{what}: held_up({pid}) never {want}"
                );
                std::thread::sleep(Duration::from_millis(10));
            }
        };
        let mut sleeper = std::process::Command::new("sleep")
            .arg("60")
            .spawn()
            .unwrap();
        let pid = sleeper.id();
        until("sleeping", pid, false);
        // SAFETY: signals to our own child.
        unsafe { libc::kill(pid as i32, libc::SIGSTOP) };
        until("stopped", pid, true);
        // SAFETY: as above.
        unsafe { libc::kill(pid as i32, libc::SIGCONT) };
        until("continued", pid, false);
        sleeper.kill().unwrap();
        sleeper.wait().unwrap();
        let mut spinner = std::process::Command::new("sh")
            .args(["-c", "while :; do :; done"])
            .spawn()
            .unwrap();
        until("spinning", spinner.id(), true);
        spinner.kill().unwrap();
        spinner.wait().unwrap();
        assert!(!held_up(u32::MAX), "no such process");
    }
}
