//! The engine over the `verbs` fabric between two processes, run inside the
//! SoftRoCE guest (tests/softroce/verbs-check.sh starts both ends).
//!
//! `azsdp-verbs-check server|client ADDR PORT MODE SEED MIB [FROM]`: the
//! client connects from FROM (another RDMA device's address) to the server
//! at ADDR:PORT and sends MIB MiB in random sizes at random alignments, in
//! MODE (`bsdp`, `zsdp`, `block`: AZ-SDP with block-on-write, `copy`:
//! AZ-SDP with copy-on-write, `copy-msg`: the same with the copy-on-write
//! lock taken by message, as on devices without atomics, `memlock-tx` and
//! `memlock-rx`: the same as `copy` with the sender's (or the receiver's)
//! locked-memory limit lowered, once connected, to what it pinned plus 192
//! KiB (run them without CAP_IPC_LOCK: sends that cannot be pinned go by
//! copy, receives into such destinations through a bounce buffer),
//! `armed`: AZ-SDP
//! with the receiver's receives returning before the data lands,
//! `copy-pinned`: `copy` with every registration pinned (`rdma_odp =
//! "off"`; the other modes register receive destinations on demand where
//! the device offers it and passes the endpoint's check of it, and the
//! server checks that they did), `odp-aligned`: `copy` with every send and
//! receive whole pages at page offset 0 and receive destinations on demand
//! without the check (rxe, which fails the check, places such READs right
//! at a path MTU of 4096: it runs the rest of the path), under the
//! receiver's lowered locked-memory limit and with its buffer remapped as
//! in `memlock-rx` and `remap` (on demand, nothing bounces, and kept
//! registrations follow the new pages), `odp-armed`: the same sizes with
//! armed receives (staging registered on demand, its pages moved into
//! place), `ahead`:
//! AZ-SDP copy-on-write with the receiver reading up to 1 MiB ahead of its
//! receives); with a
//! touching mode one send in four
//! is rewritten right after it returns. The server checks every byte and
//! prints `received N bad B gets G armed A`; the client prints its
//! counters. Exit status 0 only if the stream arrived exactly.

use std::net::SocketAddr;
use std::time::Duration;

use azsdp::config::{RdmaLock, RdmaOdp};
use azsdp::conn::{
    Capabilities, EngineConfig, FaultPolicy, LockRegion, RecvFlags, RecvProtect, Role, SendFlags,
};
use azsdp::driver::threaded::ThreadedDriver;
use azsdp::driver::{Driver, capabilities};
use azsdp::fabric::verbs::hello::{Request, Ring};
use azsdp::fabric::verbs::{self, VerbsListener, VerbsParams};
use azsdp::protect::{self, ProtectionMode};

// The stream pattern the shm two-process tests use.
#[path = "../common/mod.rs"]
mod common;
use common::{mismatches, mmap_anon, pattern, word};

/// The page size `odp-aligned` and `odp-armed` keep every send and
/// receive to.
const PAGE: usize = 4096;

/// Whole-page sends and receives at page offset 0, registered on demand
/// without the check (which rxe fails: it places only such READs right).
fn whole_pages(mode: Mode) -> bool {
    matches!(mode, Mode::OdpAligned | Mode::OdpArmed)
}

#[derive(Clone, Copy, PartialEq, Eq, Debug)]
enum Mode {
    Bsdp,
    Zsdp,
    Block,
    Copy,
    CopyPinned,
    OdpAligned,
    OdpArmed,
    CopyMsg,
    MemlockTx,
    MemlockRx,
    Armed,
    Remap,
    Ahead,
}

fn engine(role: Role, caps: Capabilities, mode: Mode) -> EngineConfig {
    let mut e = EngineConfig::new(role, caps, LockRegion::UNSET);
    e.async_zcopy = !matches!(mode, Mode::Zsdp);
    e.zcopy_threshold = if mode == Mode::Bsdp {
        u64::MAX
    } else {
        16 << 10
    };
    e.write_fault = if matches!(
        mode,
        Mode::Copy
            | Mode::CopyPinned
            | Mode::OdpAligned
            | Mode::CopyMsg
            | Mode::MemlockTx
            | Mode::MemlockRx
            | Mode::Ahead
    ) {
        FaultPolicy::Copy
    } else {
        FaultPolicy::Block
    };
    // Rewrites must not send the stream to ZSDP: it is AZ-SDP we test.
    e.fallback_faults = 0;
    if mode == Mode::Ahead {
        e.read_ahead = 1 << 20;
    }
    e.recv_protect = if matches!(mode, Mode::Armed | Mode::OdpArmed) {
        RecvProtect::On
    } else {
        RecvProtect::Off
    };
    // Emulated RDMA is slow: generous liveness bounds.
    e.peer_timeout = Duration::from_secs(30);
    e.keepalive = Duration::from_secs(2);
    e
}

fn fail(msg: String) -> ! {
    eprintln!("azsdp-verbs-check: {msg}");
    std::process::exit(1)
}

fn main() {
    let a: Vec<String> = std::env::args().collect();
    if a.len() < 7 {
        fail("usage: server|client ADDR PORT MODE SEED MIB [FROM]".into());
    }
    let addr: SocketAddr = format!("{}:{}", a[2], a[3])
        .parse()
        .unwrap_or_else(|e| fail(format!("address: {e}")));
    let mode = match a[4].as_str() {
        "bsdp" => Mode::Bsdp,
        "zsdp" => Mode::Zsdp,
        "block" => Mode::Block,
        "copy" => Mode::Copy,
        "copy-pinned" => Mode::CopyPinned,
        "odp-aligned" => Mode::OdpAligned,
        "odp-armed" => Mode::OdpArmed,
        "copy-msg" => Mode::CopyMsg,
        "memlock-tx" => Mode::MemlockTx,
        "memlock-rx" => Mode::MemlockRx,
        "armed" => Mode::Armed,
        "remap" => Mode::Remap,
        "ahead" => Mode::Ahead,
        m => fail(format!("unknown mode {m}")),
    };
    let seed: u64 = a[5].parse().unwrap_or(1);
    let total: u64 = a[6].parse::<u64>().unwrap_or(16) << 20;
    let from: Option<SocketAddr> = a.get(7).map(|f| {
        format!("{f}:0")
            .parse()
            .unwrap_or_else(|e| fail(format!("from: {e}")))
    });
    if verbs::device_count() == 0 {
        fail("no RDMA device".into());
    }
    match a[1].as_str() {
        "server" => server(addr, mode, seed),
        "client" => client(addr, from, mode, seed, total),
        r => fail(format!("unknown role {r}")),
    }
}

/// The fabric's parameters: `copy-msg` leaves the device's atomics unused,
/// `copy-pinned` its registration on demand.
fn params(mode: Mode) -> VerbsParams {
    VerbsParams {
        lock: if mode == Mode::CopyMsg {
            RdmaLock::Message
        } else {
            RdmaLock::Device
        },
        odp: if mode == Mode::CopyPinned {
            RdmaOdp::Off
        } else {
            RdmaOdp::Auto
        },
        check_odp: !whole_pages(mode),
        ..VerbsParams::default()
    }
}

/// Say how the copy-on-write lock is taken; `copy-msg` must take it by
/// message.
fn lock_path(ep: &verbs::VerbsEndpoint, mode: Mode) {
    match ep.lock_by_message() {
        Some(why) => eprintln!("copy-on-write lock by message ({why})"),
        None if mode == Mode::CopyMsg => fail("copy-msg: the lock is not by message".into()),
        None => eprintln!("copy-on-write lock by the devices' atomics"),
    }
}

/// `memlock-tx` (`memlock-rx`): lower the sender's (receiver's)
/// locked-memory limit to what it has pinned now (its connection) plus 192
/// KiB.
fn tighten_memlock(mode: Mode, role: Role) {
    let limited = match role {
        Role::Client => mode == Mode::MemlockTx,
        Role::Server => matches!(mode, Mode::MemlockRx | Mode::OdpAligned),
    };
    if !limited {
        return;
    }
    let status = std::fs::read_to_string("/proc/self/status").unwrap_or_default();
    let pinned_kib: u64 = status
        .lines()
        .find_map(|l| l.strip_prefix("VmPin:"))
        .and_then(|v| v.trim().trim_end_matches("kB").trim().parse().ok())
        .unwrap_or(0);
    let limit = (pinned_kib + 192) << 10;
    if let Err(e) =
        nix::sys::resource::setrlimit(nix::sys::resource::Resource::RLIMIT_MEMLOCK, limit, limit)
    {
        fail(format!("setrlimit: {e}"));
    }
    eprintln!(
        "locked-memory limit {} KiB ({pinned_kib} KiB pinned)",
        limit >> 10
    );
}

fn protection(mode: Mode) -> ProtectionMode {
    match mode {
        Mode::Bsdp | Mode::Zsdp => ProtectionMode::Off,
        _ => ProtectionMode::Auto,
    }
}

fn server(addr: SocketAddr, mode: Mode, seed: u64) {
    let l = VerbsListener::bind(addr, 4).unwrap_or_else(|e| fail(format!("listen: {e}")));
    println!("listening");
    let inc = match l.next(Duration::from_secs(120)) {
        Some(Ok(i)) => i,
        Some(Err(e)) => fail(format!("a request that is not ours: {e}")),
        None => fail("no request".into()),
    };
    eprintln!("request from {:?}: {:?}", inc.from, inc.request);
    let ep = inc
        .accept(params(mode), Duration::from_secs(30))
        .unwrap_or_else(|e| fail(format!("accept: {e}")));
    let p = protect::open(protection(mode));
    let caps = capabilities(true, p.protector.as_ref());
    lock_path(&ep, mode);
    // Receive destinations go on demand wherever the device offers it
    // for READs and passed the endpoint's check of it, unless the mode
    // says pinned; where the device offers it but failed the check, the
    // endpoint says why.
    let on_demand = ep.receives_on_demand();
    eprintln!(
        "receive destinations {} (the device {} registration on demand for READs{})",
        if on_demand { "on demand" } else { "pinned" },
        if ep.offers_on_demand() {
            "offers"
        } else {
            "does not offer"
        },
        ep.on_demand_refused()
            .map(|why| format!(", not used: {why}"))
            .unwrap_or_default()
    );
    let odp_decided = on_demand
        == (ep.offers_on_demand() && mode != Mode::CopyPinned && ep.on_demand_refused().is_none())
        && (!whole_pages(mode) || on_demand == ep.offers_on_demand());
    if !odp_decided {
        fail("registration on demand: used where it should not be, or not where it should".into());
    }
    let waiter = ep.waiter();
    let mut d = Driver::new(engine(Role::Server, caps, mode), ep, p.protector);
    d.establish(Duration::from_secs(60))
        .unwrap_or_else(|e| fail(format!("establish: {e:?}")));
    tighten_memlock(mode, Role::Server);
    let d = ThreadedDriver::start(d, waiter, p.faults);
    let mut store = Region::new(4 << 20);
    let flags = RecvFlags {
        armable: matches!(mode, Mode::Armed | Mode::OdpArmed),
        ..RecvFlags::default()
    };
    let (mut off, mut bad, mut i) = (0u64, 0u64, seed ^ 0x77);
    let (mut recvs, mut remapped) = (0u64, 0u64);
    let progress = std::sync::atomic::AtomicU64::new(0);
    let done = std::sync::atomic::AtomicBool::new(false);
    std::thread::scope(|s| {
        // A receive that makes no progress for 20 s says what the engine and
        // the queue pair wait for (a survivor of a killed peer must end by
        // then: peer_timeout is 30 s).
        s.spawn(|| {
            let mut last = (u64::MAX, std::time::Instant::now());
            while !done.load(std::sync::atomic::Ordering::Relaxed) {
                std::thread::sleep(Duration::from_millis(500));
                let now = progress.load(std::sync::atomic::Ordering::Relaxed);
                if now != last.0 {
                    last = (now, std::time::Instant::now());
                } else if last.1.elapsed() > Duration::from_secs(20) {
                    eprintln!(
                        "stuck at {now}: engine {}; queue pair {}",
                        d.describe(),
                        d.with_fabric(|ep| ep.describe())
                    );
                    last.1 = std::time::Instant::now();
                }
            }
        });
        loop {
            i = word(i);
            let (start, len) = if whole_pages(mode) {
                (0, (1 + word(i) % 512) as usize * PAGE)
            } else {
                ((i % 8192) as usize, 1 + (word(i) % (2 << 20)) as usize)
            };
            recvs += 1;
            if matches!(mode, Mode::Remap | Mode::OdpAligned) && recvs % 4 == 0 {
                // New pages under the same addresses: a registration kept
                // for the old ones must not take this receive's bytes.
                store.replace(recvs % 8 == 0);
                remapped += 1;
            }
            let buf = store.bytes();
            let n = match d.recv(&mut buf[start..start + len], flags) {
                Ok(n) => n as usize,
                Err(e) => fail(format!(
                    "recv at {off}: {e:?} (fabric: {:?}; engine: {})",
                    d.with_fabric(|ep| ep.broken_reason().map(str::to_owned)),
                    d.describe()
                )),
            };
            if n == 0 {
                break;
            }
            bad += mismatches(&buf[start..start + n], off);
            off += n as u64;
            progress.store(off, std::sync::atomic::Ordering::Relaxed);
        }
        done.store(true, std::sync::atomic::Ordering::Relaxed);
    });
    let bounced = d.with_fabric(|ep| ep.bounced());
    let regs = d.with_fabric(|ep| ep.registrations());
    let (_, c) = d.close(Duration::from_secs(30));
    println!(
        "received {off} bad {bad} gets {} armed {} zero-copy {} (read ahead {}) bounced {bounced} \
         registrations made {} (on demand {}) reused {} invalidated {} (buffer remapped {remapped} times)",
        c.gets,
        c.armed_recvs,
        c.bytes_recv_zcopy,
        c.bytes_recv_ahead,
        regs.made,
        regs.on_demand,
        regs.reused,
        regs.invalidated
    );
    drop(store);
    // Every mode but BSDP moves its bulk by RDMA READ.
    let zero_copy_expected = mode != Mode::Bsdp;
    // Under the locked-memory limit, destinations it refuses take the
    // bounce buffer; on demand, nothing is pinned, and nothing bounces.
    let bounce_ok =
        !matches!(mode, Mode::MemlockRx | Mode::OdpAligned) || (bounced > 0) != on_demand;
    // One buffer received into again and again: its registration is kept
    // (except where armed receives unpin it, or the limit bounces it), and
    // a remapped one is let go, unless it is on demand (which follows the
    // new pages: the stream arriving exact says it did).
    let cache_ok = match mode {
        // (Under the sender's limit, few sends go by GET at all.)
        Mode::Bsdp | Mode::MemlockTx | Mode::MemlockRx | Mode::Armed | Mode::OdpArmed => true,
        // Pinned under the receiver's limit, most receives bounce: whether
        // a kept registration meets a remap is up to timing (seen on 6.1:
        // made 13, reused 1, invalidated 0). `remap` checks invalidation.
        Mode::OdpAligned if !on_demand => true,
        Mode::OdpAligned => regs.reused > 0,
        Mode::Remap => regs.reused > 0 && (on_demand || regs.invalidated > 0),
        _ => regs.reused > 0,
    };
    if !cache_ok {
        eprintln!("azsdp-verbs-check: the registration cache did not work as it should: {regs:?}");
    }
    // Every destination registered on demand where it should be, and none
    // where it should not.
    let odp_ok = if on_demand {
        regs.on_demand == regs.made && (mode == Mode::Bsdp || regs.made > 0)
    } else {
        regs.on_demand == 0
    };
    if !odp_ok {
        eprintln!(
            "azsdp-verbs-check: registrations on demand {} of {}, expected {}",
            regs.on_demand,
            regs.made,
            if on_demand { "all" } else { "none" }
        );
    }
    // `ahead`: most of the stream was read ahead of the receives.
    let ahead_ok = mode != Mode::Ahead || c.bytes_recv_ahead * 2 > c.bytes_recv_zcopy;
    if !ahead_ok {
        eprintln!("azsdp-verbs-check: little was read ahead");
    }
    // `odp-armed` on a device with registration on demand (6.17 on, which
    // has the page moves arming needs): receives did return armed.
    let armed_ok = mode != Mode::OdpArmed || !on_demand || c.armed_recvs > 0;
    if !armed_ok {
        eprintln!("azsdp-verbs-check: no receive was armed");
    }
    std::process::exit(i32::from(
        !armed_ok
            || bad != 0
            || off == 0
            || !bounce_ok
            || !cache_ok
            || !odp_ok
            || !ahead_ok
            || (zero_copy_expected && c.bytes_recv_zcopy == 0),
    ));
}

/// A receive buffer of its own anonymous mapping, whose pages can be
/// replaced under the same addresses.
struct Region {
    at: *mut u8,
    len: usize,
}

impl Region {
    fn new(len: usize) -> Region {
        Region {
            at: mmap_anon(len) as *mut u8,
            len,
        }
    }

    fn bytes(&mut self) -> &mut [u8] {
        // SAFETY: our mapping, mapped while `self` lives.
        unsafe { std::slice::from_raw_parts_mut(self.at, self.len) }
    }

    /// New (zero) pages at the same addresses, by `munmap` then `mmap`
    /// there, or (`over`) by a `mmap` over it, with azsdp's memory hooks
    /// called as the shim calls them around the program's own.
    fn replace(&mut self, over: bool) {
        let (a, n) = (self.at as u64, self.len as u64);
        let mut flags = libc::MAP_PRIVATE | libc::MAP_ANONYMOUS | libc::MAP_FIXED;
        if !over {
            azsdp::process::before_unmap(a, n);
            // SAFETY: our mapping; nothing refers to it across the call.
            if unsafe { libc::munmap(self.at.cast(), self.len) } != 0 {
                fail("munmap of the receive buffer".into());
            }
            azsdp::process::after_unmap(a, n);
            flags = libc::MAP_PRIVATE | libc::MAP_ANONYMOUS | libc::MAP_FIXED_NOREPLACE;
        }
        // SAFETY: the same addresses, ours (unmapped just now, or mapped
        // over).
        let at = unsafe {
            libc::mmap(
                self.at.cast(),
                self.len,
                libc::PROT_READ | libc::PROT_WRITE,
                flags,
                -1,
                0,
            )
        };
        if at != self.at.cast() {
            fail("mmap at the receive buffer's address".into());
        }
        azsdp::process::after_mmap(a, flags);
        if over {
            azsdp::process::after_mmap_over(a, n);
        }
    }
}

impl Drop for Region {
    fn drop(&mut self) {
        // SAFETY: our mapping, used no more.
        unsafe { libc::munmap(self.at.cast(), self.len) };
    }
}

fn client(addr: SocketAddr, from: Option<SocketAddr>, mode: Mode, seed: u64, total: u64) {
    let request = Request {
        ring: Ring { count: 0, slot: 0 },
        nonce: seed,
        tcp_client_port: 0,
        tcp_server_port: addr.port(),
        // (Set by `connect`, which knows the device.)
        locks_by_message: false,
    };
    let ep = verbs::connect(addr, from, request, params(mode), Duration::from_secs(60))
        .unwrap_or_else(|e| fail(format!("connect ({}): {e}", e.reason())));
    let p = protect::open(protection(mode));
    let backend = p.backend;
    let caps = capabilities(true, p.protector.as_ref());
    lock_path(&ep, mode);
    let waiter = ep.waiter();
    let mut d = Driver::new(engine(Role::Client, caps, mode), ep, p.protector);
    d.establish(Duration::from_secs(60))
        .unwrap_or_else(|e| fail(format!("establish: {e:?}")));
    tighten_memlock(mode, Role::Client);
    let d = ThreadedDriver::start(d, waiter, p.faults);
    let touching = !matches!(mode, Mode::Bsdp | Mode::Zsdp);
    let mut store = vec![0u64; (3 << 20) / 8];
    let base = store.as_mut_ptr() as usize;
    let pad = base.next_multiple_of(4096) - base;
    // SAFETY: a byte view of our own Vec, which outlives every use below.
    let bytes = unsafe { std::slice::from_raw_parts_mut((base + pad) as *mut u8, (3 << 20) - pad) };
    let flags = SendFlags {
        nonblocking: false,
        protectable: touching,
        unprotectable: None,
    };
    let (mut off, mut i) = (0u64, seed);
    while off < total {
        i = word(i);
        let (start, len) = if whole_pages(mode) {
            (0, (4 + word(i) % 256) as usize * PAGE)
        } else {
            ((i % 8192) as usize, (1 + word(i) % (1 << 20)) as usize)
        };
        let len = len.min((total - off) as usize);
        for (k, x) in bytes[start..start + len].iter_mut().enumerate() {
            *x = pattern(off + k as u64);
        }
        let n = match d.send(&bytes[start..start + len], flags) {
            Ok(n) => n,
            Err(e) => fail(format!(
                "send at {off}: {e:?} (fabric: {:?}; engine: {})",
                d.with_fabric(|ep| ep.broken_reason().map(str::to_owned)),
                d.describe()
            )),
        };
        if n != len as u64 {
            fail(format!("short send at {off}: {n} of {len}"));
        }
        off += n;
        if touching && word(i ^ 5).is_multiple_of(4) {
            // Rewrite part of what was just sent: it must not reach the
            // receiver.
            let (r0, r1) = (start + len / 3, start + len / 2);
            for x in &mut bytes[r0..r1] {
                *x = !*x;
            }
        }
    }
    let (clean, c) = d.close(Duration::from_secs(120));
    println!(
        "sent {off} clean {clean} protection {backend:?} azsdp {} zsdp {} bsdp {} faults {} copy-on-writes {} cas {} fallback {:?}",
        c.bytes_sent_async,
        c.bytes_sent_sync,
        c.bytes_sent_bsdp,
        c.send_faults,
        c.cow_copies,
        caps.cas,
        c.fallback_reason
    );
    drop(store);
    // AZ-SDP modes must have sent asynchronously, and copy-on-write must
    // have copied (the rewrites fault), where the lock can be taken.
    // Under the locked-memory limit, sends that cannot be pinned go by
    // copy and say why.
    let azsdp_ok = if mode == Mode::MemlockTx {
        c.fallback_reason == Some(azsdp::conn::FallbackReason::MemlockLimit)
    } else {
        !touching || c.bytes_sent_async > total / 2
    };
    let cow_ok = !matches!(
        mode,
        Mode::Copy | Mode::CopyPinned | Mode::OdpAligned | Mode::CopyMsg | Mode::Ahead
    ) || !caps.cas
        || c.cow_copies > 0;
    if !azsdp_ok || !cow_ok {
        eprintln!("azsdp-verbs-check: {mode:?} did not run as it should: {c:?}");
    }
    // (A receiver that read everything and left first ends the close
    // without the handshake: verbs has no departure progress words yet, so
    // the close is not "clean" then, but nothing was lost. The receiver
    // checks every byte and the end of the stream.)
    let closed_ok = clean || c.bytes_unread_by_peer == 0;
    std::process::exit(i32::from(!closed_ok || !azsdp_ok || !cow_ok));
}
