//! Stream bytes between two real processes over the `shm` fabric.
//!
//! ```text
//! cargo run --release -p azsdp --example shm_stream -- --mode azsdp-cow --bytes 1G --size 1M
//! ```
//!
//! Forks a receiver, streams `--bytes` in `--size` sends from a buffer at
//! `--align` bytes past a page boundary, and verifies every byte at the
//! receiver. As in ttcp, the send buffer is reused (`--buffers` of them in
//! turn). With probability `--touch`, the program rewrites a buffer right
//! after handing it to `send()` (a write into an in-flight buffer): the new
//! contents are a new *generation*, and both sides replay the same random
//! sequence, so the receiver knows exactly which generation each byte must
//! come from — the bytes sent, never the bytes written after.
//!
//! Prints one line: mode, GB/s, `verified`, GETs, faults (send+receive),
//! COWs. Modes: bsdp, zsdp, azsdp-bow, azsdp-cow, and tcp (kernel TCP
//! loopback, for comparison). AZ-SDP needs a full userfaultfd; without one
//! the line says `fallback NoProtection` and the figures are ZSDP's.

use std::io::{Read, Write};
use std::net::{TcpListener, TcpStream};
use std::os::unix::net::UnixStream;
use std::time::{Duration, Instant};

use clap::{Parser, ValueEnum};

use azsdp::config::parse_size;
use azsdp::conn::{
    Capabilities, Counters, EngineConfig, FaultPolicy, LockRegion, RecvFlags, RecvProtect, Role,
    SendFlags,
};
use azsdp::driver::threaded::ThreadedDriver;
use azsdp::driver::{Driver, Protector, capabilities};
use azsdp::fabric::shm::{ShmEndpoint, ShmParams};
use azsdp::protect::{self, FaultSource, ProtectionMode};

#[derive(Clone, Copy, Debug, PartialEq, Eq, ValueEnum)]
enum Mode {
    Bsdp,
    Zsdp,
    AzsdpBow,
    AzsdpCow,
    Tcp,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, ValueEnum)]
enum OnOff {
    On,
    Off,
}

#[derive(Parser, Debug)]
#[command(about = "Stream bytes between two processes over AZ-SDP's shm fabric")]
struct Args {
    #[arg(long, value_enum, required_unless_present = "table")]
    mode: Option<Mode>,
    /// Run every mode at 4 KiB, 64 KiB, 1 MiB and 16 MiB sends (each in
    /// fresh processes), measure single-copy memcpy in the same run, and
    /// print a markdown table.
    #[arg(long)]
    table: bool,
    /// Repetitions per table cell (the median is shown).
    #[arg(long, default_value_t = 3)]
    reps: usize,
    /// Sends shorter than this are copied (BSDP); the engine's default.
    #[arg(long, value_parser = parse_size, default_value = "64KiB")]
    threshold: u64,
    /// Total bytes (e.g. 1G, 256MiB).
    #[arg(long, value_parser = parse_size, default_value = "256MiB")]
    bytes: u64,
    /// Bytes per send (and per receive).
    #[arg(long, value_parser = parse_size, default_value = "1MiB")]
    size: u64,
    /// Offset of the send buffer from a page boundary.
    #[arg(long, default_value_t = 0)]
    align: u64,
    /// Probability of rewriting the buffer right after each send.
    #[arg(long, default_value_t = 0.0)]
    touch: f64,
    /// Receive-side protection (recv returns before the data lands).
    #[arg(long, value_enum, default_value = "off")]
    recv_protect: OnOff,
    /// Send buffers used in turn (1: one buffer reused, as ttcp does).
    #[arg(long, default_value_t = 1)]
    buffers: usize,
    /// Seed of the touch sequence.
    #[arg(long, default_value_t = 1)]
    seed: u64,
}

/// Byte `i` of a buffer of generation `generation`: different for every word and
/// generation, so shifted, stale or rewritten bytes are caught.
fn fill(buf: &mut [u8], generation: u64) {
    let mut chunks = buf.chunks_exact_mut(8);
    let mut w = 0u64;
    for c in &mut chunks {
        c.copy_from_slice(&word(generation, w).to_le_bytes());
        w += 1;
    }
    let rest = chunks.into_remainder();
    let last = word(generation, w).to_le_bytes();
    rest.copy_from_slice(&last[..rest.len()]);
}

fn word(generation: u64, w: u64) -> u64 {
    ((generation << 40) ^ w ^ 0x5bd1_e995).wrapping_mul(0x9e37_79b9_7f4a_7c15)
}

/// The sequence of sends both sides replay: which buffer and generation each
/// send carries, and when the sender rewrites a buffer.
struct Plan {
    rng: u64,
    touch: f64,
    gens: Vec<u64>,
    next_gen: u64,
    k: usize,
}

impl Plan {
    fn new(args: &Args) -> Plan {
        let n = args.buffers.max(1);
        Plan {
            rng: args.seed | 1,
            touch: args.touch,
            gens: (0..n as u64).collect(),
            next_gen: n as u64,
            k: 0,
        }
    }

    /// The next send: (buffer index, its generation, rewritten right after?).
    /// A rewrite gives the buffer the returned new generation.
    fn next(&mut self) -> (usize, u64, Option<u64>) {
        let b = self.k % self.gens.len();
        self.k += 1;
        let generation = self.gens[b];
        self.rng ^= self.rng << 13;
        self.rng ^= self.rng >> 7;
        self.rng ^= self.rng << 17;
        let touch = (self.rng % 1_000_000) as f64 / 1_000_000.0 < self.touch;
        let new = touch.then(|| {
            self.gens[b] = self.next_gen;
            self.next_gen += 1;
            self.next_gen - 1
        });
        (b, generation, new)
    }
}

/// The receiver's view: expected bytes of each send, regenerated only when
/// the generation changes (so verifying is a memory compare).
struct Verifier {
    plan: Plan,
    size: usize,
    total: u64,
    /// Stream offset where the current send starts, its length, generation.
    at: u64,
    cur_len: usize,
    cur_gen: u64,
    expect: Vec<u8>,
    expect_gen: Option<u64>,
    ok: bool,
}

impl Verifier {
    fn new(args: &Args) -> Verifier {
        let mut v = Verifier {
            plan: Plan::new(args),
            size: args.size as usize,
            total: args.bytes,
            at: 0,
            cur_len: 0,
            cur_gen: 0,
            expect: vec![0; args.size as usize],
            expect_gen: None,
            ok: true,
        };
        v.advance();
        v
    }

    fn advance(&mut self) {
        let (_, generation, _) = self.plan.next();
        self.cur_gen = generation;
        self.cur_len = (self.size as u64).min(self.total.saturating_sub(self.at)) as usize;
        if self.expect_gen != Some(generation) {
            fill(&mut self.expect, generation);
            self.expect_gen = Some(generation);
        }
    }

    /// Check `data`, the next bytes of the stream.
    fn check(&mut self, mut data: &[u8], off: &mut u64) {
        while !data.is_empty() {
            let i = (*off - self.at) as usize;
            let k = (self.cur_len - i).min(data.len());
            self.ok &= data[..k] == self.expect[i..i + k];
            data = &data[k..];
            *off += k as u64;
            if *off - self.at == self.cur_len as u64 {
                self.at = *off;
                if self.at < self.total {
                    self.advance();
                }
            }
        }
    }
}

fn engine_config(args: &Args, role: Role, caps: Capabilities) -> EngineConfig {
    let mut e = EngineConfig::new(role, caps, LockRegion::UNSET);
    e.max_outstanding = 16;
    e.zcopy_threshold = args.threshold;
    e.peer_timeout = Duration::from_secs(10);
    e.keepalive = Duration::from_secs(2);
    e.recv_protect = if args.recv_protect == OnOff::On {
        RecvProtect::On
    } else {
        RecvProtect::Off
    };
    match args.mode() {
        Mode::Bsdp => e.zcopy_threshold = u64::MAX,
        Mode::Zsdp => e.async_zcopy = false,
        Mode::AzsdpBow => e.write_fault = FaultPolicy::Block,
        Mode::AzsdpCow => e.write_fault = FaultPolicy::Copy,
        Mode::Tcp => {}
    }
    e
}

/// What the receiver reports back.
struct Report {
    verified: bool,
    bytes: u64,
    secs: f64,
    gets: u64,
    faults: u64,
}

/// Page protection for one side: a full userfaultfd when the mode (and, at
/// the receiver, `--recv-protect`) asks for it and the host has one.
fn protection(wanted: bool) -> (Box<dyn Protector + Send>, Option<Box<dyn FaultSource>>) {
    let p = protect::open(if wanted {
        ProtectionMode::Auto
    } else {
        ProtectionMode::Off
    });
    (p.protector, p.faults)
}

fn azsdp_mode(m: Mode) -> bool {
    matches!(m, Mode::AzsdpBow | Mode::AzsdpCow)
}

type ShmDriver = ThreadedDriver<ShmEndpoint, Box<dyn Protector + Send>>;

/// One side's engine over `sock`'s shm segment, running on its threads.
fn start(args: &Args, sock: &UnixStream, role: Role, protect: bool) -> ShmDriver {
    let ep = match role {
        Role::Client => ShmEndpoint::offer(sock, ShmParams::default()),
        Role::Server => ShmEndpoint::accept(sock, ShmParams::default()),
    }
    .expect("shm bootstrap");
    let (protector, faults) = protection(protect);
    let caps = capabilities(ep.can_get().is_none(), protector.as_ref());
    let waiter = ep.waiter();
    let mut d = Driver::new(engine_config(args, role, caps), ep, protector);
    d.establish(Duration::from_secs(10)).expect("handshake");
    ThreadedDriver::start(d, waiter, faults)
}

/// A page-aligned buffer with `align` bytes of offset, `len` bytes long.
struct AlignedBuf {
    storage: Vec<u8>,
    start: usize,
    len: usize,
}

impl AlignedBuf {
    fn new(len: u64, align: u64) -> AlignedBuf {
        let storage = vec![0u8; (len + align + 8192) as usize];
        let base = storage.as_ptr() as usize;
        let start = base.next_multiple_of(4096) - base + (align as usize % 4096);
        AlignedBuf {
            storage,
            start,
            len: len as usize,
        }
    }
    fn get(&mut self) -> &mut [u8] {
        &mut self.storage[self.start..self.start + self.len]
    }
}

fn receive(args: &Args, mut recv: impl FnMut(&mut [u8]) -> usize) -> (bool, u64, f64) {
    let mut buf = AlignedBuf::new(args.size, 0);
    let mut v = Verifier::new(args);
    let mut off = 0u64;
    let mut start = None;
    loop {
        let n = recv(buf.get());
        start.get_or_insert_with(Instant::now);
        if n == 0 {
            break;
        }
        v.check(&buf.get()[..n], &mut off);
    }
    let secs = start.map_or(0.0, |s| s.elapsed().as_secs_f64());
    (v.ok && off == args.bytes, off, secs)
}

fn receiver_shm(args: &Args, sock: &UnixStream) -> Report {
    let protect = azsdp_mode(args.mode()) && args.recv_protect == OnOff::On;
    let d = start(args, sock, Role::Server, protect);
    let flags = RecvFlags {
        armable: true,
        ..RecvFlags::default()
    };
    let (verified, bytes, secs) = receive(args, |b| match d.recv(b, flags) {
        Ok(n) => n as usize,
        Err(e) => panic!("recv: {e} ({:?})", d.state()),
    });
    let (_, c) = d.close(Duration::from_secs(5));
    Report {
        verified,
        bytes,
        secs,
        gets: c.gets,
        faults: c.recv_faults,
    }
}

fn receiver_tcp(args: &Args, listener: TcpListener) -> Report {
    let (mut s, _) = listener.accept().expect("accept");
    let (verified, bytes, secs) = receive(args, |b| s.read(b).expect("read"));
    Report {
        verified,
        bytes,
        secs,
        gets: 0,
        faults: 0,
    }
}

/// The sender's buffers, each filled with its first generation. They must
/// outlive the connection: under AZ-SDP a send returns while the peer may
/// still read the buffer (the shim's `free()` hook settles that for
/// unmodified programs).
fn send_buffers(args: &Args) -> Vec<AlignedBuf> {
    (0..args.buffers.max(1))
        .map(|i| {
            let mut b = AlignedBuf::new(args.size, args.align);
            fill(b.get(), i as u64);
            b
        })
        .collect()
}

/// The sending program: `--bytes` in `--size` pieces from the buffers in
/// turn, rewriting a buffer right after its send when the plan says so.
fn produce(args: &Args, bufs: &mut [AlignedBuf], mut send: impl FnMut(&[u8])) {
    let mut plan = Plan::new(args);
    let mut off = 0u64;
    while off < args.bytes {
        let (b, _, rewrite) = plan.next();
        let n = args.size.min(args.bytes - off) as usize;
        send(&bufs[b].get()[..n]);
        if let Some(generation) = rewrite {
            fill(bufs[b].get(), generation);
        }
        off += n as u64;
    }
}

impl Args {
    fn mode(&self) -> Mode {
        self.mode.unwrap_or(Mode::Tcp)
    }
}

/// Single-copy bandwidth (GB/s) between two `size`-byte buffers, the
/// physical limit of any one-copy transport at that size.
fn memcpy_gbps(size: usize) -> f64 {
    let src = vec![1u8; size];
    let mut dst = vec![0u8; size];
    let total = (1u64 << 30).max(size as u64 * 8);
    let rounds = (total / size as u64).max(1);
    let start = Instant::now();
    for _ in 0..rounds {
        dst.copy_from_slice(std::hint::black_box(&src));
        std::hint::black_box(&mut dst);
    }
    (rounds * size as u64) as f64 / start.elapsed().as_secs_f64() / 1e9
}

fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(f64::total_cmp);
    v.get(v.len() / 2).copied().unwrap_or(0.0)
}

/// `--table`: every mode at each size, each run in fresh processes.
fn table(args: &Args) {
    let exe = std::env::current_exe().expect("own path");
    let sizes: [(u64, &str); 4] = [
        (4 << 10, "4 KiB"),
        (64 << 10, "64 KiB"),
        (1 << 20, "1 MiB"),
        (16 << 20, "16 MiB"),
    ];
    let modes = [
        (Mode::Tcp, "tcp"),
        (Mode::Bsdp, "bsdp"),
        (Mode::Zsdp, "zsdp"),
        (Mode::AzsdpBow, "azsdp-bow"),
        (Mode::AzsdpCow, "azsdp-cow"),
    ];
    println!("| mode | 4 KiB | 64 KiB | 1 MiB | 16 MiB |");
    println!("|---|---|---|---|---|");
    let mut tcp = [0.0f64; 4];
    let mut rows = Vec::new();
    for (mode, name) in modes {
        let mut cells = Vec::new();
        for (i, (size, _)) in sizes.iter().enumerate() {
            let bytes = (*size * 512).clamp(256 << 20, 1 << 30);
            let runs: Vec<f64> = (0..args.reps.max(1))
                .map(|_| {
                    let out = std::process::Command::new(&exe)
                        .args(["--mode", name, "--size", &size.to_string()])
                        .args(["--bytes", &bytes.to_string()])
                        .args(["--threshold", &args.threshold.to_string()])
                        .args(["--touch", &args.touch.to_string()])
                        .output()
                        .expect("run shm_stream");
                    let line = String::from_utf8_lossy(&out.stdout).to_string();
                    assert!(
                        out.status.success() && line.contains("verified"),
                        "{name} at {size} B failed: {line}{}",
                        String::from_utf8_lossy(&out.stderr)
                    );
                    line.split_whitespace()
                        .nth(1)
                        .and_then(|g| g.parse().ok())
                        .unwrap_or(0.0)
                })
                .collect();
            let gbps = median(runs);
            if mode == Mode::Tcp {
                tcp[i] = gbps;
            }
            cells.push(gbps);
        }
        rows.push((name, cells));
    }
    for (name, cells) in &rows {
        let cells: Vec<String> = cells
            .iter()
            .zip(tcp)
            .map(|(g, t)| format!("{g:.2} ({:.2}x)", if t > 0.0 { g / t } else { 0.0 }))
            .collect();
        println!("| {name} | {} |", cells.join(" | "));
    }
    let mc: Vec<String> = sizes
        .iter()
        .zip(tcp)
        .map(|((s, _), t)| {
            let g = memcpy_gbps(*s as usize);
            format!("{g:.2} ({:.2}x)", if t > 0.0 { g / t } else { 0.0 })
        })
        .collect();
    println!("| memcpy | {} |", mc.join(" | "));
    println!(
        "\nGB/s, median of {} runs (ratio to kernel TCP loopback at the same size); touch probability {}; zero-copy threshold {} B.",
        args.reps.max(1),
        args.touch,
        args.threshold
    );
}

fn main() {
    let args = Args::parse();
    if args.table {
        table(&args);
        return;
    }
    let tcp = (args.mode() == Mode::Tcp).then(|| TcpListener::bind("127.0.0.1:0").expect("bind"));
    let (mine, theirs) = UnixStream::pair().expect("socketpair");
    // SAFETY: fork before any thread is started; the child reports over the
    // socket and leaves with _exit.
    let child = match unsafe { nix::unistd::fork() }.expect("fork") {
        nix::unistd::ForkResult::Child => {
            drop(mine);
            let r = match tcp {
                Some(l) => receiver_tcp(&args, l),
                None => receiver_shm(&args, &theirs),
            };
            let line = format!(
                "{} {} {} {} {}\n",
                r.verified, r.bytes, r.secs, r.gets, r.faults
            );
            (&theirs).write_all(line.as_bytes()).expect("report");
            // SAFETY: leave without running the parent's exit handlers twice.
            unsafe { libc::_exit(0) };
        }
        nix::unistd::ForkResult::Parent { child } => child,
    };
    drop(theirs);
    let mut counters = Counters::default();
    let mut bufs = send_buffers(&args);
    match &tcp {
        Some(l) => {
            let mut s = TcpStream::connect(l.local_addr().expect("addr")).expect("connect");
            produce(&args, &mut bufs, |chunk| s.write_all(chunk).expect("write"));
        }
        None => {
            let d = start(&args, &mine, Role::Client, azsdp_mode(args.mode()));
            let flags = SendFlags {
                nonblocking: false,
                protectable: true,
                unprotectable: None,
            };
            produce(&args, &mut bufs, |chunk| {
                let sent = match d.send(chunk, flags) {
                    Ok(n) => n,
                    Err(e) => panic!("send: {e} ({:?})", d.state()),
                };
                assert_eq!(sent, chunk.len() as u64);
            });
            let (clean, c) = d.close(Duration::from_secs(30));
            assert!(clean, "clean close");
            counters = c;
        }
    }
    let mut line = String::new();
    (&mine).read_to_string(&mut line).expect("report");
    let _ = nix::sys::wait::waitpid(child, None);
    let f: Vec<&str> = line.split_whitespace().collect();
    let field = |i: usize| f.get(i).copied().unwrap_or("0");
    let verified = field(0) == "true";
    let bytes = field(1).parse::<u64>().unwrap_or(0);
    let secs = field(2).parse::<f64>().unwrap_or(0.0);
    let gbps = if secs > 0.0 {
        bytes as f64 / secs / 1e9
    } else {
        0.0
    };
    println!(
        "{:?} {:.2} GB/s {} {} B GETs {} faults {}+{} COWs {}{}",
        args.mode(),
        gbps,
        if verified { "verified" } else { "CORRUPTED" },
        bytes,
        field(3),
        counters.send_faults,
        field(4),
        counters.cow_copies,
        counters
            .fallback_reason
            .map_or(String::new(), |r| format!(" (fallback {r:?})"))
    );
    std::process::exit(i32::from(!verified));
}
