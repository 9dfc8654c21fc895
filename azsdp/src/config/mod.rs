//! Configuration: a TOML file, `AZSDP_CONFIG=FILE`, and `AZSDP_<KEY>=value`
//! overrides of single global keys.
//!
//! ```toml
//! zcopy_threshold = "64KiB"     # global tunables at the top level
//! write_fault = "copy"
//!
//! [[rule]]                      # first matching rule wins
//! program = "redis-*"
//! role = "server"
//! address = "10.0.0.0/8"
//! port = "6379"
//! use = "azsdp"                 # azsdp | tcp | both
//! zcopy_threshold = "16KiB"     # per-rule tunables override the globals
//! ```
//!
//! Every error names the file (or variable), the line and the key. The full
//! reference is `docs/config.md`.

pub mod logging;
mod problems;
mod values;

use std::net::IpAddr;
use std::path::{Path, PathBuf};
use std::time::Duration;

use toml::Spanned;
use toml::de::{DeTable, DeValue};

use crate::conn::{Capabilities, EngineConfig, FaultPolicy, LockRegion, RecvProtect, Role};
use crate::protect::ProtectionMode;
pub use problems::{ConfigError, Problem};
use problems::{did_you_mean, position};
pub use values::{Cidr, Glob, PortRange, parse_duration, parse_size};

/// Default location of the configuration file.
pub const DEFAULT_PATH: &str = "/etc/azsdp/azsdp.toml";

/// Largest configuration file read.
pub const MAX_FILE_BYTES: u64 = 1 << 20;

/// The text of the regular file at `path`, if it is one and not too long.
fn read_bounded(path: &Path) -> Result<String, String> {
    use std::io::Read;
    use std::os::unix::fs::OpenOptionsExt;
    // Non-blocking: opening a FIFO must not wait for a writer.
    let f = std::fs::OpenOptions::new()
        .read(true)
        .custom_flags(libc::O_NONBLOCK | libc::O_CLOEXEC)
        .open(path)
        .map_err(|e| format!("cannot read: {e}"))?;
    let m = f.metadata().map_err(|e| format!("cannot read: {e}"))?;
    if !m.is_file() {
        return Err("cannot read: not a regular file".into());
    }
    if m.len() > MAX_FILE_BYTES {
        return Err(format!(
            "cannot read: {} bytes, more than the {MAX_FILE_BYTES} a configuration may have",
            m.len()
        ));
    }
    let mut b = Vec::new();
    f.take(MAX_FILE_BYTES + 1)
        .read_to_end(&mut b)
        .map_err(|e| format!("cannot read: {e}"))?;
    if b.len() as u64 > MAX_FILE_BYTES {
        return Err("cannot read: it grew past the limit while read".into());
    }
    String::from_utf8(b)
        .map_err(|e| format!("not UTF-8 text (byte {})", e.utf8_error().valid_up_to()))
}

/// Which fabric an upgraded connection runs on.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum FabricChoice {
    /// Shared memory for a peer on this host, verbs (where the build has
    /// it and the host has an RDMA device) for one on another.
    Auto,
    /// Shared memory only: a peer on another host stays on TCP.
    Shm,
    /// Verbs, even to an address of this host (through the NIC, as the
    /// paper ran its stack; and how two RDMA devices of one host test it).
    Verbs,
}

/// Over verbs, how a connection's copy-on-write lock words are changed.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum RdmaLock {
    /// The NIC's atomics where the CPU's are coherent with them; else by
    /// message (a side's own lock operations would each be an atomic
    /// through its own device, a round trip per operation).
    Auto,
    /// The NIC's atomics: the peer's words by RDMA compare-and-swap, and
    /// our own through the device too when its atomics are not the CPU's.
    Device,
    /// By message: each side changes only its own words, with the CPU,
    /// and asks the peer to change the peer's (one SEND each way).
    Message,
}

/// Over verbs, whether receive destinations are registered on demand
/// (`IBV_ACCESS_ON_DEMAND`: nothing pinned, the NIC follows the program's
/// page tables) where the device offers it for RDMA READ.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum RdmaOdp {
    /// On demand where the device offers it, pinned elsewhere.
    Auto,
    /// Always pinned.
    Off,
}

/// What a matching connection uses.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Use {
    /// AZ-SDP only: a connection whose peer is not under azsdp is refused.
    Azsdp,
    /// Plain kernel TCP, never upgraded.
    Tcp,
    /// Try AZ-SDP; stay on TCP when the peer is not under azsdp.
    Both,
}

/// Thresholds and policies. In rules, unset fields inherit the globals.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Tunables {
    pub use_: Option<Use>,
    pub fabric: Option<FabricChoice>,
    pub zcopy_threshold: Option<u64>,
    pub async_: Option<bool>,
    pub write_fault: Option<FaultPolicy>,
    pub block_escalate: Option<Duration>,
    pub recv_protect: Option<RecvProtect>,
    pub recv_protect_min: Option<u64>,
    pub read_ahead: Option<u64>,
    pub read_ahead_auto: Option<bool>,
    pub protection: Option<ProtectionMode>,
    pub convert_private_files: Option<bool>,
    pub max_outstanding: Option<u16>,
    pub max_avail: Option<u32>,
    pub fallback_faults: Option<u32>,
    pub fallback_window: Option<u32>,
    pub fallback_recover: Option<u32>,
    pub bsdp_buffer: Option<u64>,
    pub bsdp_slot: Option<u32>,
    pub bsdp_credits: Option<u16>,
    pub poll: Option<Duration>,
    pub rdma_read_piece: Option<u64>,
    pub rdma_lock: Option<RdmaLock>,
    pub rdma_odp: Option<RdmaOdp>,
    pub peer_timeout: Option<Duration>,
    pub keepalive: Option<Duration>,
    pub linger: Option<Duration>,
    pub pair_timeout: Option<Duration>,
    pub pair_every_connection: Option<bool>,
}

/// Tunables with every field decided.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Settings {
    pub use_: Use,
    pub fabric: FabricChoice,
    pub zcopy_threshold: u64,
    pub async_: bool,
    pub write_fault: FaultPolicy,
    pub block_escalate: Duration,
    pub recv_protect: RecvProtect,
    pub recv_protect_min: u64,
    /// Bytes a receiver may read ahead of its program (over verbs only:
    /// the shim turns it off where a GET is a CPU copy).
    pub read_ahead: u64,
    /// Read ahead only while it proves faster (`read_ahead = "auto"`).
    pub read_ahead_auto: bool,
    /// Which mechanism guards in-flight pages (a driver setting).
    pub protection: ProtectionMode,
    /// Turn the sent pages of private file mappings into anonymous memory,
    /// so they can be protected (a driver setting).
    pub convert_private_files: bool,
    pub max_outstanding: u16,
    pub max_avail: u32,
    pub fallback_faults: u32,
    pub fallback_window: u32,
    pub fallback_recover: u32,
    pub bsdp_buffer: u64,
    pub bsdp_slot: u32,
    pub bsdp_credits: u16,
    /// How long a waiting thread polls before it sleeps (a driver setting).
    pub poll: Duration,
    /// Bytes of each RDMA READ a long GET is cut into over verbs, 0 for
    /// one READ per GET (a fabric setting: `fabric::verbs::reads`).
    pub rdma_read_piece: u64,
    /// How the copy-on-write lock goes over verbs (a fabric setting).
    pub rdma_lock: RdmaLock,
    /// Whether receive destinations are registered on demand over verbs
    /// (a fabric setting).
    pub rdma_odp: RdmaOdp,
    pub peer_timeout: Duration,
    pub keepalive: Duration,
    pub linger: Duration,
    /// How long a client's `connect()` waits for the listener to accept
    /// before the connection stays on TCP (a driver setting).
    pub pair_timeout: Duration,
    /// Offer every connection, even to a destination whose recent
    /// connections ended before a pair could pay off (`false`: a client
    /// stops offering there but for a probe now and then).
    pub pair_every_connection: bool,
}

impl Default for Settings {
    fn default() -> Self {
        let e = EngineConfig::new(Role::Client, Capabilities::ALL, LockRegion::UNSET);
        Settings {
            use_: Use::Both,
            fabric: FabricChoice::Auto,
            zcopy_threshold: e.zcopy_threshold,
            async_: e.async_zcopy,
            write_fault: e.write_fault,
            block_escalate: e.block_escalate,
            recv_protect: e.recv_protect,
            recv_protect_min: e.recv_protect_min,
            read_ahead: AUTO_READ_AHEAD,
            read_ahead_auto: true,
            protection: ProtectionMode::Auto,
            convert_private_files: true,
            max_outstanding: e.max_outstanding,
            max_avail: e.max_avail_len,
            fallback_faults: e.fallback_faults,
            fallback_window: e.fallback_window,
            fallback_recover: e.fallback_recover,
            bsdp_buffer: e.sndbuf,
            bsdp_slot: e.slot_size,
            bsdp_credits: e.rx_credits,
            poll: Duration::from_micros(20),
            rdma_read_piece: 128 << 10,
            rdma_lock: RdmaLock::Auto,
            rdma_odp: RdmaOdp::Auto,
            peer_timeout: e.peer_timeout,
            keepalive: e.keepalive,
            linger: e.linger,
            pair_timeout: Duration::from_millis(500),
            pair_every_connection: false,
        }
    }
}

impl Settings {
    /// Apply the fields `t` sets.
    pub fn overlay(&self, t: &Tunables) -> Settings {
        let mut s = self.clone();
        macro_rules! take {
            ($($f:ident),*) => { $( if let Some(v) = t.$f { s.$f = v; } )* };
        }
        take!(
            use_,
            fabric,
            zcopy_threshold,
            async_,
            write_fault,
            block_escalate,
            recv_protect,
            recv_protect_min,
            read_ahead,
            read_ahead_auto,
            protection,
            convert_private_files,
            max_outstanding,
            max_avail,
            fallback_faults,
            fallback_window,
            fallback_recover,
            bsdp_buffer,
            bsdp_slot,
            bsdp_credits,
            poll,
            rdma_read_piece,
            rdma_lock,
            rdma_odp,
            peer_timeout,
            keepalive,
            linger,
            pair_timeout,
            pair_every_connection
        );
        s
    }

    /// Every key and its value, in configuration syntax (a TOML value:
    /// strings quoted), in the order of `docs/config.md`.
    pub fn entries(&self) -> Vec<(&'static str, String)> {
        let q = |s: &str| format!("\"{s}\"");
        let size = |n: u64| q(&format_size(n));
        let dur = |d: Duration| q(&show(d));
        let v = vec![
            (
                "use",
                q(match self.use_ {
                    Use::Azsdp => "azsdp",
                    Use::Tcp => "tcp",
                    Use::Both => "both",
                }),
            ),
            (
                "fabric",
                q(match self.fabric {
                    FabricChoice::Auto => "auto",
                    FabricChoice::Shm => "shm",
                    FabricChoice::Verbs => "verbs",
                }),
            ),
            ("zcopy_threshold", size(self.zcopy_threshold)),
            ("async", self.async_.to_string()),
            (
                "write_fault",
                q(match self.write_fault {
                    FaultPolicy::Copy => "copy",
                    FaultPolicy::Block => "block",
                }),
            ),
            ("block_escalate", dur(self.block_escalate)),
            (
                "recv_protect",
                q(match self.recv_protect {
                    RecvProtect::Auto => "auto",
                    RecvProtect::On => "on",
                    RecvProtect::Off => "off",
                }),
            ),
            ("recv_protect_min", size(self.recv_protect_min)),
            (
                "read_ahead",
                if self.read_ahead_auto {
                    q("auto")
                } else {
                    size(self.read_ahead)
                },
            ),
            (
                "protection",
                q(match self.protection {
                    ProtectionMode::Auto => "auto",
                    ProtectionMode::Userfaultfd => "userfaultfd",
                    ProtectionMode::Mprotect => "mprotect",
                    ProtectionMode::Off => "off",
                }),
            ),
            (
                "convert_private_files",
                self.convert_private_files.to_string(),
            ),
            ("max_outstanding", self.max_outstanding.to_string()),
            ("max_avail", size(u64::from(self.max_avail))),
            ("fallback_faults", self.fallback_faults.to_string()),
            ("fallback_window", self.fallback_window.to_string()),
            ("fallback_recover", self.fallback_recover.to_string()),
            ("bsdp_buffer", size(self.bsdp_buffer)),
            ("bsdp_slot", size(u64::from(self.bsdp_slot))),
            ("bsdp_credits", self.bsdp_credits.to_string()),
            ("poll", dur(self.poll)),
            ("rdma_read_piece", size(self.rdma_read_piece)),
            (
                "rdma_lock",
                q(match self.rdma_lock {
                    RdmaLock::Auto => "auto",
                    RdmaLock::Device => "device",
                    RdmaLock::Message => "message",
                }),
            ),
            (
                "rdma_odp",
                q(match self.rdma_odp {
                    RdmaOdp::Auto => "auto",
                    RdmaOdp::Off => "off",
                }),
            ),
            ("peer_timeout", dur(self.peer_timeout)),
            ("keepalive", dur(self.keepalive)),
            ("linger", dur(self.linger)),
            ("pair_timeout", dur(self.pair_timeout)),
            (
                "pair_every_connection",
                self.pair_every_connection.to_string(),
            ),
        ];
        debug_assert_eq!(v.len(), TUNABLE_KEYS.len());
        v
    }

    /// [`Settings::entries`] as TOML lines (`key = value`), aligned.
    pub fn to_toml(&self) -> String {
        self.entries()
            .into_iter()
            .map(|(k, v)| format!("{k:<16} = {v}\n"))
            .collect()
    }

    /// The engine configuration for one connection.
    pub fn engine_config(
        &self,
        role: Role,
        caps: Capabilities,
        lock_region: LockRegion,
    ) -> EngineConfig {
        let mut e = EngineConfig::new(role, caps, lock_region);
        e.zcopy_threshold = self.zcopy_threshold;
        e.async_zcopy = self.async_;
        e.write_fault = self.write_fault;
        e.block_escalate = self.block_escalate;
        e.recv_protect = self.recv_protect;
        e.recv_protect_min = self.recv_protect_min;
        e.read_ahead = self.read_ahead;
        e.read_ahead_auto = self.read_ahead_auto;
        e.max_outstanding = self.max_outstanding;
        e.max_avail_len = self.max_avail;
        e.fallback_faults = self.fallback_faults;
        e.fallback_window = self.fallback_window;
        e.fallback_recover = self.fallback_recover;
        e.sndbuf = self.bsdp_buffer;
        e.slot_size = self.bsdp_slot;
        e.rx_credits = self.bsdp_credits;
        e.peer_timeout = self.peer_timeout;
        e.keepalive = self.keepalive;
        e.linger = self.linger;
        e
    }
}

/// One `[[rule]]`: all of its set conditions must hold.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Rule {
    /// 1-based position in the file, for messages.
    pub index: usize,
    pub program: Option<Glob>,
    pub role: Option<Role>,
    pub address: Option<Cidr>,
    pub port: Option<PortRange>,
    pub tunables: Tunables,
}

/// What a connection is, for rule matching.
#[derive(Clone, Debug)]
pub struct RuleInput<'a> {
    /// Path or name of the program (matched by its last component, or whole
    /// if the pattern has a `/`).
    pub program: &'a str,
    pub role: Role,
    /// The peer's address (client: the address connected to).
    pub addr: IpAddr,
    /// The listening port (server: its own; client: the one connected to).
    pub port: u16,
}

/// A loaded configuration.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Config {
    /// Where it came from (for messages and `azsdp stat`).
    pub source: Option<PathBuf>,
    pub global: Settings,
    pub rules: Vec<Rule>,
}

/// What the rules decided for one connection.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Decision {
    /// 1-based index of the matching rule, if any.
    pub rule: Option<usize>,
    pub settings: Settings,
}

/// The `AZSDP_*` variables that are not keys, by their full names.
fn reserved_env_names() -> impl Iterator<Item = String> {
    RESERVED_ENV.iter().map(|r| format!("AZSDP_{r}"))
}

/// Every `AZSDP_*` variable azsdp reads.
fn env_names() -> Vec<String> {
    reserved_env_names()
        .chain(
            TUNABLE_KEYS
                .iter()
                .map(|k| format!("AZSDP_{}", k.to_ascii_uppercase())),
        )
        .collect()
}

/// Environment variables with the AZSDP_ prefix that are not tunables.
const RESERVED_ENV: &[&str] = &[
    "CONFIG",
    "LOG",
    "LOG_LEVEL",
    "SIM_SEEDS",
    "STAT_DIR",
    "SHIM",
    "DISABLE",
];

/// What `read_ahead = "auto"` reads ahead at most, when it does.
pub const AUTO_READ_AHEAD: u64 = 1 << 20;

/// Every key a tunables table accepts, with its parser.
const TUNABLE_KEYS: &[&str] = &[
    "use",
    "fabric",
    "zcopy_threshold",
    "async",
    "write_fault",
    "block_escalate",
    "recv_protect",
    "recv_protect_min",
    "read_ahead",
    "protection",
    "convert_private_files",
    "max_outstanding",
    "max_avail",
    "fallback_faults",
    "fallback_window",
    "fallback_recover",
    "bsdp_buffer",
    "bsdp_slot",
    "bsdp_credits",
    "poll",
    "rdma_read_piece",
    "rdma_lock",
    "rdma_odp",
    "peer_timeout",
    "keepalive",
    "linger",
    "pair_timeout",
    "pair_every_connection",
];

/// A raw value, whether from TOML or from the environment.
enum Raw<'a> {
    Str(&'a str),
    Int(i64),
    Bool(bool),
    Other(&'static str),
}

fn to_u64(
    raw: &Raw<'_>,
    what: &str,
    parse: fn(&str) -> Result<u64, String>,
) -> Result<u64, String> {
    match raw {
        Raw::Int(n) if *n >= 0 => Ok(*n as u64),
        Raw::Int(_) => Err(format!("{what} must not be negative")),
        Raw::Str(s) => parse(s),
        Raw::Bool(_) | Raw::Other(_) => Err(format!("{what} must be a number or a string")),
    }
}

fn int(s: &str) -> Result<u64, String> {
    s.trim()
        .parse()
        .map_err(|_| format!("`{s}` is not a whole number"))
}

fn in_range<T: TryFrom<u64>>(v: u64, lo: u64, hi: u64, what: &str) -> Result<T, String> {
    if v < lo || v > hi {
        return Err(format!("{what} must be from {lo} to {hi}, not {v}"));
    }
    T::try_from(v).map_err(|_| format!("{what} is out of range"))
}

fn size_in(raw: &Raw<'_>, lo: u64, hi: u64) -> Result<u64, String> {
    let v = to_u64(raw, "a size", parse_size)?;
    in_range(v, lo, hi, "the size")
}

fn count_in<T: TryFrom<u64>>(raw: &Raw<'_>, lo: u64, hi: u64) -> Result<T, String> {
    let v = to_u64(raw, "a count", int)?;
    in_range(v, lo, hi, "the value")
}

fn duration(raw: &Raw<'_>) -> Result<Duration, String> {
    match raw {
        Raw::Str(s) => parse_duration(s),
        Raw::Int(0) => Ok(Duration::ZERO),
        _ => Err("a duration must be a string with a unit, such as \"10ms\"".into()),
    }
}

/// A size as the configuration writes it: "64KiB", "8MiB", or bytes.
pub fn format_size(n: u64) -> String {
    for (unit, shift) in [("GiB", 30), ("MiB", 20), ("KiB", 10)] {
        if n >= 1 << shift && n.is_multiple_of(1 << shift) {
            return format!("{}{unit}", n >> shift);
        }
    }
    n.to_string()
}

/// A duration as the configuration writes it: "10ms", "30s", "5m".
fn show(d: Duration) -> String {
    if d.is_zero() {
        "0".into()
    } else if d.as_secs() >= 60 && d.as_secs().is_multiple_of(60) && d.subsec_nanos() == 0 {
        format!("{}m", d.as_secs() / 60)
    } else if d.subsec_nanos() == 0 {
        format!("{}s", d.as_secs())
    } else if d.as_micros().is_multiple_of(1000) {
        format!("{}ms", d.as_millis())
    } else {
        format!("{}us", d.as_micros())
    }
}

/// A duration from `lo` to `hi`; with `zero_ok`, also `0` (which the key
/// documents as "never" or "at once").
fn duration_in(
    raw: &Raw<'_>,
    lo: Duration,
    hi: Duration,
    zero_ok: bool,
) -> Result<Duration, String> {
    let d = duration(raw)?;
    if (d.is_zero() && zero_ok) || (lo..=hi).contains(&d) {
        return Ok(d);
    }
    let zero = if zero_ok { "0, or " } else { "" };
    Err(format!(
        "must be {zero}from {} to {}, not {}",
        show(lo),
        show(hi),
        show(d)
    ))
}

fn boolean(raw: &Raw<'_>) -> Result<bool, String> {
    match raw {
        Raw::Bool(b) => Ok(*b),
        Raw::Str(s) => match s.trim() {
            "true" | "yes" | "on" | "1" => Ok(true),
            "false" | "no" | "off" | "0" => Ok(false),
            other => Err(format!("`{other}` is not true or false")),
        },
        _ => Err("must be true or false".into()),
    }
}

fn choice<T: Copy>(raw: &Raw<'_>, options: &[(&str, T)]) -> Result<T, String> {
    let names: Vec<&str> = options.iter().map(|(n, _)| *n).collect();
    let Raw::Str(s) = raw else {
        return Err(format!("must be one of {}", names.join(", ")));
    };
    options
        .iter()
        .find(|(n, _)| n.eq_ignore_ascii_case(s.trim()))
        .map(|(_, v)| *v)
        .ok_or_else(|| format!("`{s}` is not one of {}", names.join(", ")))
}

/// Set one tunable from a raw value.
fn set_tunable(t: &mut Tunables, key: &str, raw: &Raw<'_>) -> Result<(), String> {
    const GIB: u64 = 1 << 30;
    const MS: Duration = Duration::from_millis(1);
    const SEC: Duration = Duration::from_secs(1);
    const MINUTE: Duration = Duration::from_secs(60);
    const HOUR: Duration = Duration::from_secs(3600);
    const DAY: Duration = Duration::from_secs(86400);
    match key {
        "use" => {
            t.use_ = Some(choice(
                raw,
                &[
                    ("azsdp", Use::Azsdp),
                    ("tcp", Use::Tcp),
                    ("both", Use::Both),
                ],
            )?)
        }
        "fabric" => {
            t.fabric = Some(choice(
                raw,
                &[
                    ("auto", FabricChoice::Auto),
                    ("shm", FabricChoice::Shm),
                    ("verbs", FabricChoice::Verbs),
                ],
            )?)
        }
        "zcopy_threshold" => t.zcopy_threshold = Some(size_in(raw, 0, u64::MAX)?),
        "async" => t.async_ = Some(boolean(raw)?),
        "convert_private_files" => t.convert_private_files = Some(boolean(raw)?),
        "write_fault" => {
            t.write_fault = Some(choice(
                raw,
                &[("copy", FaultPolicy::Copy), ("block", FaultPolicy::Block)],
            )?)
        }
        "block_escalate" => t.block_escalate = Some(duration_in(raw, MS, 10 * SEC, true)?),
        "recv_protect" => {
            t.recv_protect = Some(choice(
                raw,
                &[
                    ("auto", RecvProtect::Auto),
                    ("on", RecvProtect::On),
                    ("off", RecvProtect::Off),
                ],
            )?)
        }
        "recv_protect_min" => t.recv_protect_min = Some(size_in(raw, 0, u64::MAX)?),
        "read_ahead" => {
            if matches!(raw, Raw::Str(s) if s.trim().eq_ignore_ascii_case("auto")) {
                t.read_ahead = Some(AUTO_READ_AHEAD);
                t.read_ahead_auto = Some(true);
            } else {
                t.read_ahead = Some(size_in(raw, 0, GIB).map_err(|e| format!("{e}, or \"auto\""))?);
                t.read_ahead_auto = Some(false);
            }
        }
        "protection" => {
            t.protection = Some(choice(
                raw,
                &[
                    ("auto", ProtectionMode::Auto),
                    ("userfaultfd", ProtectionMode::Userfaultfd),
                    ("mprotect", ProtectionMode::Mprotect),
                    ("off", ProtectionMode::Off),
                ],
            )?)
        }
        "max_outstanding" => t.max_outstanding = Some(count_in(raw, 1, 1024)?),
        "max_avail" => t.max_avail = Some(size_in(raw, 4096, GIB)? as u32),
        "fallback_faults" => t.fallback_faults = Some(count_in(raw, 0, 1 << 20)?),
        "fallback_window" => t.fallback_window = Some(count_in(raw, 1, 1 << 20)?),
        "fallback_recover" => t.fallback_recover = Some(count_in(raw, 0, 1 << 30)?),
        "bsdp_buffer" => t.bsdp_buffer = Some(size_in(raw, 4096, GIB)?),
        "bsdp_slot" => {
            t.bsdp_slot = Some(size_in(
                raw,
                u64::from(crate::wire::MIN_SLOT_SIZE),
                u64::from(crate::wire::MAX_SLOT_SIZE),
            )? as u32)
        }
        "bsdp_credits" => t.bsdp_credits = Some(count_in(raw, 1, 65535)?),
        // Busy-polling longer than a few sleeps and wake-ups cost only
        // burns the CPU.
        "poll" => t.poll = Some(duration_in(raw, Duration::from_micros(1), 10 * MS, true)?),
        "rdma_read_piece" => {
            let n = size_in(raw, 0, GIB)?;
            if n != 0 && n < 4096 {
                return Err("must be 0 (one READ per GET) or at least 4KiB".into());
            }
            t.rdma_read_piece = Some(n)
        }
        "rdma_lock" => {
            t.rdma_lock = Some(choice(
                raw,
                &[
                    ("auto", RdmaLock::Auto),
                    ("device", RdmaLock::Device),
                    ("message", RdmaLock::Message),
                ],
            )?)
        }
        "rdma_odp" => {
            t.rdma_odp = Some(choice(
                raw,
                &[("auto", RdmaOdp::Auto), ("off", RdmaOdp::Off)],
            )?)
        }
        "peer_timeout" => t.peer_timeout = Some(duration_in(raw, 100 * MS, DAY, true)?),
        "keepalive" => t.keepalive = Some(duration_in(raw, 10 * MS, HOUR, false)?),
        "linger" => t.linger = Some(duration_in(raw, MS, DAY, true)?),
        "pair_timeout" => t.pair_timeout = Some(duration_in(raw, MS, MINUTE, false)?),
        "pair_every_connection" => t.pair_every_connection = Some(boolean(raw)?),
        _ => return Err(format!("unknown key (known: {})", TUNABLE_KEYS.join(", "))),
    }
    Ok(())
}

fn raw_of<'a>(v: &'a DeValue<'_>) -> Raw<'a> {
    match v {
        DeValue::String(s) => Raw::Str(s),
        DeValue::Integer(i) => {
            let digits = i.as_str().replace('_', "");
            match i64::from_str_radix(&digits, i.radix()) {
                Ok(n) => Raw::Int(n),
                Err(_) => Raw::Other("an out-of-range integer"),
            }
        }
        DeValue::Boolean(b) => Raw::Bool(*b),
        DeValue::Float(_) => Raw::Other("a float"),
        DeValue::Datetime(_) => Raw::Other("a date"),
        DeValue::Array(_) => Raw::Other("an array"),
        DeValue::Table(_) => Raw::Other("a table"),
    }
}

/// The problems found in one text, and where each key was set (for
/// problems that involve two keys).
struct Report<'t> {
    origin: &'t str,
    text: &'t str,
    problems: Vec<Problem>,
    /// Key path (`keepalive`, `rule[2].keepalive`) -> its span.
    spans: std::collections::HashMap<String, std::ops::Range<usize>>,
}

impl Report<'_> {
    fn add(
        &mut self,
        span: Option<std::ops::Range<usize>>,
        key: Option<String>,
        message: String,
        help: Option<String>,
    ) {
        let (line, column) = match span.map(|s| position(self.text, s.start)) {
            Some((l, c)) => (Some(l), Some(c)),
            None => (None, None),
        };
        self.problems.push(Problem {
            origin: self.origin.to_string(),
            line,
            column,
            key,
            message,
            help,
        });
    }

    /// An unknown key at `span`, and the known one it may have meant.
    fn unknown_key(
        &mut self,
        span: std::ops::Range<usize>,
        path: String,
        key: &str,
        known: &[&str],
    ) {
        let help = match did_you_mean(key, known.iter().copied()) {
            Some(k) => format!("did you mean `{k}`?"),
            None => format!("the keys here are: {}", known.join(", ")),
        };
        self.add(Some(span), Some(path), "unknown key".into(), Some(help));
    }
}

/// The keys a `[[rule]]` matches on.
const MATCH_KEYS: &[&str] = &["program", "role", "address", "port"];

/// Which pairs of keys disagree in `s`: (the key to blame, the other, why).
fn conflicts(s: &Settings) -> Vec<(&'static str, &'static str, String)> {
    let mut v = Vec::new();
    if u64::from(s.bsdp_slot) > s.bsdp_buffer {
        v.push((
            "bsdp_slot",
            "bsdp_buffer",
            format!(
                "the slot ({}) is larger than bsdp_buffer ({})",
                format_size(u64::from(s.bsdp_slot)),
                format_size(s.bsdp_buffer)
            ),
        ));
    }
    if s.peer_timeout > Duration::ZERO && s.keepalive >= s.peer_timeout {
        v.push((
            "keepalive",
            "peer_timeout",
            format!(
                "{} must be shorter than peer_timeout ({})",
                show(s.keepalive),
                show(s.peer_timeout)
            ),
        ));
    }
    v
}

impl Config {
    /// Parse a configuration from TOML text; `origin` names it in errors,
    /// which are all of its problems, in file order.
    pub fn parse(text: &str, origin: &str) -> Result<Config, ConfigError> {
        let mut r = Report {
            origin,
            text,
            problems: Vec::new(),
            spans: Default::default(),
        };
        let doc = match DeTable::parse(text) {
            Ok(d) => d,
            Err(e) => {
                r.add(e.span(), None, e.message().trim().to_string(), None);
                return Err(ConfigError {
                    problems: r.problems,
                });
            }
        };
        let mut global = Tunables::default();
        let mut rules = Vec::new();
        let mut top_keys: Vec<&str> = TUNABLE_KEYS.to_vec();
        top_keys.push("rule");
        for (k, v) in doc.get_ref().iter() {
            let key: &str = k.get_ref();
            if key == "rule" {
                let DeValue::Array(items) = v.get_ref() else {
                    r.add(
                        Some(v.span()),
                        Some("rule".into()),
                        "must be an array of tables".into(),
                        Some("write [[rule]]".into()),
                    );
                    continue;
                };
                for (i, item) in items.iter().enumerate() {
                    if let Some(rule) = parse_rule(i + 1, item, &mut r) {
                        rules.push(rule);
                    }
                }
                continue;
            }
            if !TUNABLE_KEYS.contains(&key) {
                r.unknown_key(k.span(), key.to_string(), key, &top_keys);
                continue;
            }
            match raw_value(v).and_then(|raw| set_tunable(&mut global, key, &raw)) {
                Ok(()) => {
                    r.spans.insert(key.to_string(), k.span());
                }
                Err(m) => r.add(Some(v.span()), Some(key.to_string()), m, None),
            }
        }
        let config = Config {
            source: None,
            global: Settings::default().overlay(&global),
            rules,
        };
        config.check(&mut r);
        if r.problems.is_empty() {
            return Ok(config);
        }
        r.problems
            .sort_by_key(|p| (p.line.unwrap_or(usize::MAX), p.column.unwrap_or(0)));
        Err(ConfigError {
            problems: r.problems,
        })
    }

    /// Keys that disagree, each reported at the line that set the key to
    /// blame (or, if only the other was set there, at that one's).
    fn check(&self, r: &mut Report<'_>) {
        let mut report = |s: &Settings, prefix: &str, only_if_set_here: bool| {
            for (blame, other, why) in conflicts(s) {
                let here = |k: &str| r.spans.get(&format!("{prefix}{k}")).cloned();
                let span = here(blame).or_else(|| here(other));
                if only_if_set_here && span.is_none() {
                    // The rule inherits both: the globals' problem already says so.
                    continue;
                }
                r.add(span, Some(format!("{prefix}{blame}")), why, None);
            }
        };
        report(&self.global, "", false);
        for rule in &self.rules {
            let s = self.global.overlay(&rule.tunables);
            report(&s, &format!("rule[{}].", rule.index), true);
        }
    }

    /// Load from `path`: a regular file of at most [`MAX_FILE_BYTES`]
    /// (a FIFO, a device or `/dev/zero` is refused without reading it).
    pub fn load(path: &Path) -> Result<Config, ConfigError> {
        let origin = path.display().to_string();
        let text = read_bounded(path).map_err(|message| {
            ConfigError::one(Problem {
                origin: origin.clone(),
                line: None,
                column: None,
                key: None,
                message,
                help: None,
            })
        })?;
        let mut c = Config::parse(&text, &origin)?;
        c.source = Some(path.to_path_buf());
        Ok(c)
    }

    /// Load as a preloaded program does: `explicit` (e.g. `azsdp run
    /// --config`), else `AZSDP_CONFIG`, else [`DEFAULT_PATH`] if it exists,
    /// else the built-in defaults; then apply `AZSDP_<KEY>` overrides.
    /// The error holds every problem: the file's, then the environment's.
    pub fn from_environment(
        explicit: Option<&Path>,
        vars: impl IntoIterator<Item = (std::ffi::OsString, std::ffi::OsString)>,
    ) -> Result<Config, ConfigError> {
        let mut problems = Vec::new();
        let env_problem =
            |name: &str, key: Option<String>, message: String, help: Option<String>| Problem {
                origin: format!("env {name}"),
                line: None,
                column: None,
                key,
                message,
                help,
            };
        // Only AZSDP_ variables are ours; any other may be any bytes.
        let mut ours: Vec<(String, String)> = Vec::new();
        for (k, v) in vars {
            if !k.as_encoded_bytes().starts_with(b"AZSDP_") {
                continue;
            }
            let name = k.to_string_lossy().into_owned();
            match v.into_string() {
                Ok(v) => ours.push((name, v)),
                Err(_) => problems.push(env_problem(
                    &name,
                    None,
                    "the value is not valid UTF-8".into(),
                    None,
                )),
            }
        }
        let from_env = ours
            .iter()
            .find(|(k, _)| k == "AZSDP_CONFIG")
            .map(|(_, v)| PathBuf::from(v));
        let loaded = match (explicit, from_env) {
            (Some(p), _) => Config::load(p),
            (None, Some(p)) => Config::load(&p),
            (None, None) if Path::new(DEFAULT_PATH).exists() => {
                Config::load(Path::new(DEFAULT_PATH))
            }
            (None, None) => Ok(Config::default()),
        };
        let mut config = loaded.unwrap_or_else(|e| {
            problems.splice(0..0, e.problems);
            Config::default()
        });
        let mut overrides = Tunables::default();
        let mut set_by_env: Vec<(String, &str)> = Vec::new();
        for (k, v) in &ours {
            let Some(name) = k.strip_prefix("AZSDP_") else {
                continue;
            };
            if RESERVED_ENV.contains(&name) {
                continue;
            }
            let key = name.to_ascii_lowercase();
            if !TUNABLE_KEYS.contains(&key.as_str()) {
                let known = env_names();
                let help = match did_you_mean(k, known.iter().map(String::as_str)) {
                    Some(n) => format!("did you mean {n}?"),
                    None => format!(
                        "azsdp reads AZSDP_<KEY> for each configuration key and {}",
                        reserved_env_names().collect::<Vec<_>>().join(", ")
                    ),
                };
                problems.push(env_problem(k, None, "unknown variable".into(), Some(help)));
                continue;
            }
            match set_tunable(&mut overrides, &key, &Raw::Str(v)) {
                Ok(()) => set_by_env.push((key, k)),
                Err(m) => problems.push(env_problem(k, Some(key), m, None)),
            }
        }
        config.global = config.global.overlay(&overrides);
        // A conflict the variables made (the file's own were reported).
        for (blame, other, why) in conflicts(&config.global) {
            let var = |key: &str| set_by_env.iter().find(|(k, _)| k == key).map(|(_, v)| *v);
            if let Some(name) = var(blame).or_else(|| var(other)) {
                problems.push(env_problem(name, Some(blame.to_string()), why, None));
            }
        }
        if problems.is_empty() {
            Ok(config)
        } else {
            Err(ConfigError { problems })
        }
    }

    /// The settings for a connection: the first matching rule over the globals.
    pub fn decide(&self, c: &RuleInput<'_>) -> Decision {
        let base = c.program.rsplit('/').next().unwrap_or(c.program);
        for r in &self.rules {
            let program_ok = r.program.as_ref().is_none_or(|g| {
                if g.as_str().contains('/') {
                    g.matches(c.program)
                } else {
                    g.matches(base)
                }
            });
            let ok = program_ok
                && r.role.is_none_or(|x| x == c.role)
                && r.address.is_none_or(|a| a.contains(c.addr))
                && r.port.is_none_or(|p| p.contains(c.port));
            if ok {
                return Decision {
                    rule: Some(r.index),
                    settings: self.global.overlay(&r.tunables),
                };
            }
        }
        Decision {
            rule: None,
            settings: self.global.clone(),
        }
    }
}

fn raw_value<'v>(v: &'v Spanned<DeValue<'_>>) -> Result<Raw<'v>, String> {
    match raw_of(v.get_ref()) {
        Raw::Other(what) => Err(format!("{what} is not a valid value here")),
        r => Ok(r),
    }
}

/// One `[[rule]]`; its problems go to `r`.
fn parse_rule(index: usize, item: &Spanned<DeValue<'_>>, r: &mut Report<'_>) -> Option<Rule> {
    let DeValue::Table(t) = item.get_ref() else {
        r.add(
            Some(item.span()),
            Some(format!("rule[{index}]")),
            "must be a table".into(),
            None,
        );
        return None;
    };
    let mut rule = Rule {
        index,
        program: None,
        role: None,
        address: None,
        port: None,
        tunables: Tunables::default(),
    };
    let known: Vec<&str> = MATCH_KEYS.iter().chain(TUNABLE_KEYS).copied().collect();
    for (k, v) in t.iter() {
        let key: &str = k.get_ref();
        let path = format!("rule[{index}].{key}");
        if !known.contains(&key) {
            r.unknown_key(k.span(), path, key, &known);
            continue;
        }
        let set = raw_value(v).and_then(|raw| {
            let text = match &raw {
                Raw::Str(s) => Some(*s),
                _ => None,
            };
            match key {
                "program" => {
                    let s = text.ok_or("must be a string (a glob)")?;
                    rule.program = Some(Glob::new(s)?);
                }
                "role" => {
                    rule.role = Some(choice(
                        &raw,
                        &[("server", Role::Server), ("client", Role::Client)],
                    )?)
                }
                "address" => {
                    let s = text.ok_or("must be a string such as \"10.0.0.0/8\"")?;
                    rule.address = Some(Cidr::parse(s)?);
                }
                "port" => {
                    rule.port = Some(match raw {
                        Raw::Int(n) => u16::try_from(n)
                            .map(|p| PortRange { lo: p, hi: p })
                            .map_err(|_| format!("`{n}` is not a port (0 to 65535)"))?,
                        Raw::Str(s) => PortRange::parse(s)?,
                        _ => return Err("must be a port or a range such as \"1000-2000\"".into()),
                    })
                }
                _ => set_tunable(&mut rule.tunables, key, &raw)?,
            }
            Ok(())
        });
        match set {
            Ok(()) => {
                r.spans.insert(path, k.span());
            }
            Err(m) => r.add(Some(v.span()), Some(path), m, None),
        }
    }
    Some(rule)
}

#[cfg(test)]
mod tests;
