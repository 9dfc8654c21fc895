//! Stream bytes between two real processes over the `shm` fabric.
//!
//! ```text
//! cargo run --release -p azsdp --example shm_stream -- --mode zsdp --bytes 1G --size 1M
//! ```
//!
//! Forks a receiver, streams `--bytes` in `--size` sends from a buffer at
//! `--align` bytes past a page boundary, optionally rewrites the buffer right
//! after a send with probability `--touch`, verifies every byte at the
//! receiver, and prints one line: mode, GB/s, verified, GETs, faults, COWs.
//! Modes: bsdp, zsdp, azsdp-bow, azsdp-cow, and tcp (kernel TCP loopback).
//! Until the userfaultfd protector lands, the azsdp modes run as ZSDP and say
//! so (`fallback NoProtection`).

use std::io::{Read, Write};
use std::net::{TcpListener, TcpStream};
use std::os::unix::net::UnixStream;
use std::time::{Duration, Instant};

use clap::{Parser, ValueEnum};

use azsdp::config::parse_size;
use azsdp::conn::{
    Capabilities, EngineConfig, FaultPolicy, LockRegion, RecvFlags, RecvProtect, Role, SendFlags,
};
use azsdp::driver::threaded::ThreadedDriver;
use azsdp::driver::{Driver, NoProtection, Protector, capabilities};
use azsdp::fabric::shm::{ShmEndpoint, ShmParams};
use azsdp::protect::uffd::UffdProtect;

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
    #[arg(long, value_enum)]
    mode: Mode,
    /// Total bytes (e.g. 1G, 256MiB).
    #[arg(long, value_parser = parse_size, default_value = "256MiB")]
    bytes: u64,
    /// Bytes per send.
    #[arg(long, value_parser = parse_size, default_value = "1MiB")]
    size: u64,
    /// Offset of the send buffer from a page boundary.
    #[arg(long, default_value_t = 0)]
    align: u64,
    /// Probability of rewriting the buffer right after each send.
    #[arg(long, default_value_t = 0.0)]
    touch: f64,
    #[arg(long, value_enum, default_value = "off")]
    recv_protect: OnOff,
    /// Send buffers used in turn (1: one buffer reused, as ttcp does).
    #[arg(long, default_value_t = 1)]
    buffers: usize,
}

/// The stream's 8-byte word number `w` (byte `o` is byte `o % 8` of word
/// `o / 8`). Cheap enough to fill and check at memory speed, and different
/// for every word, so shifted, stale or rewritten bytes are caught.
fn word(w: u64) -> u64 {
    (w ^ 0x5bd1_e995).wrapping_mul(0x9e37_79b9_7f4a_7c15)
}

/// Split `buf` (stream offset `off`) into an unaligned head, whole words, a tail.
fn word_range(len: usize, off: u64) -> (usize, usize) {
    let head = ((8 - off % 8) % 8) as usize;
    let head = head.min(len);
    let words = (len - head) / 8;
    (head, head + words * 8)
}

fn fill(buf: &mut [u8], off: u64) {
    let (h, w_end) = word_range(buf.len(), off);
    for (i, b) in buf[..h].iter_mut().enumerate() {
        let o = off + i as u64;
        *b = word(o / 8).to_le_bytes()[(o % 8) as usize];
    }
    let first = (off + h as u64) / 8;
    for (k, chunk) in buf[h..w_end].chunks_exact_mut(8).enumerate() {
        chunk.copy_from_slice(&word(first + k as u64).to_le_bytes());
    }
    for (i, b) in buf[w_end..].iter_mut().enumerate() {
        let o = off + (w_end + i) as u64;
        *b = word(o / 8).to_le_bytes()[(o % 8) as usize];
    }
}

fn check(buf: &[u8], off: u64) -> bool {
    let (h, w_end) = word_range(buf.len(), off);
    let byte = |i: usize| {
        let o = off + i as u64;
        word(o / 8).to_le_bytes()[(o % 8) as usize]
    };
    let first = (off + h as u64) / 8;
    (0..h).all(|i| buf[i] == byte(i))
        && buf[h..w_end]
            .chunks_exact(8)
            .enumerate()
            .fold(true, |ok, (k, c)| {
                ok & (c == word(first + k as u64).to_le_bytes())
            })
        && (w_end..buf.len()).all(|i| buf[i] == byte(i))
}

fn engine_config(args: &Args, role: Role, caps: Capabilities) -> EngineConfig {
    let mut e = EngineConfig::new(
        role,
        caps,
        LockRegion {
            addr: 0,
            key: 0,
            slots: 0,
        },
    );
    e.max_outstanding = 16;
    e.peer_timeout = Duration::from_secs(10);
    e.keepalive = Duration::from_secs(2);
    e.recv_protect = if args.recv_protect == OnOff::On {
        RecvProtect::On
    } else {
        RecvProtect::Off
    };
    match args.mode {
        Mode::Bsdp => e.zcopy_threshold = u64::MAX,
        Mode::Zsdp => e.async_zcopy = false,
        Mode::AzsdpBow => e.write_fault = FaultPolicy::Block,
        Mode::AzsdpCow => e.write_fault = FaultPolicy::Copy,
        Mode::Tcp => {}
    }
    e
}

/// Result line fields the receiver reports back.
struct Report {
    verified: bool,
    bytes: u64,
    secs: f64,
    gets: u64,
}

fn receiver_shm(args: &Args, sock: &UnixStream) -> Report {
    let ep = ShmEndpoint::accept(sock, ShmParams::default()).expect("shm bootstrap");
    let caps = capabilities(ep.can_get().is_none(), &NoProtection);
    let mut d = Driver::new(engine_config(args, Role::Server, caps), ep, NoProtection);
    d.establish(Duration::from_secs(10)).expect("handshake");
    let mut buf = vec![0u8; args.size as usize];
    let (mut off, mut ok) = (0u64, true);
    let mut start = None;
    loop {
        let n = d.recv(&mut buf, RecvFlags::default()).expect("recv") as usize;
        start.get_or_insert_with(Instant::now);
        if n == 0 {
            break;
        }
        ok &= check(&buf[..n], off);
        off += n as u64;
    }
    let secs = start.map_or(0.0, |s| s.elapsed().as_secs_f64());
    d.close(Duration::from_secs(5));
    Report {
        verified: ok && off == args.bytes,
        bytes: off,
        secs,
        gets: d.connection().counters().gets,
    }
}

fn receiver_tcp(args: &Args, listener: TcpListener) -> Report {
    let (mut s, _) = listener.accept().expect("accept");
    let mut buf = vec![0u8; args.size as usize];
    let (mut off, mut ok) = (0u64, true);
    let mut start = None;
    loop {
        let n = s.read(&mut buf).expect("read");
        start.get_or_insert_with(Instant::now);
        if n == 0 {
            break;
        }
        ok &= check(&buf[..n], off);
        off += n as u64;
    }
    Report {
        verified: ok && off == args.bytes,
        bytes: off,
        secs: start.map_or(0.0, |s| s.elapsed().as_secs_f64()),
        gets: 0,
    }
}

/// The send buffer: `size` bytes at `align` past a page boundary.
struct SendBuf {
    storage: Vec<u8>,
    start: usize,
    len: usize,
}

impl SendBuf {
    fn new(size: u64, align: u64) -> SendBuf {
        let storage = vec![0u8; (size + align + 8192) as usize];
        let base = storage.as_ptr() as usize;
        let start = base.next_multiple_of(4096) - base + (align as usize % 4096);
        SendBuf {
            storage,
            start,
            len: size as usize,
        }
    }
    fn get(&mut self) -> &mut [u8] {
        &mut self.storage[self.start..self.start + self.len]
    }
}

/// The sending application: `--bytes` in `--size` pieces from the send
/// buffers in turn, each filled with the stream pattern and handed to `send`;
/// with probability `--touch` the buffer is rewritten right after (the send
/// has returned, so it is the program's again).
fn produce(args: &Args, bufs: &mut [SendBuf], mut send: impl FnMut(&[u8])) {
    let mut rng = 0x1234_5678u64;
    let (mut off, mut k) = (0u64, 0usize);
    while off < args.bytes {
        let nb = bufs.len();
        let b = &mut bufs[k % nb];
        k += 1;
        let n = args.size.min(args.bytes - off) as usize;
        fill(&mut b.get()[..n], off);
        send(&b.get()[..n]);
        rng ^= rng << 13;
        rng ^= rng >> 7;
        rng ^= rng << 17;
        if (rng % 1_000_000) as f64 / 1_000_000.0 < args.touch {
            b.get()[0] ^= 0xff;
        }
        off += n as u64;
    }
}

fn main() {
    let args = Args::parse();
    let tcp = (args.mode == Mode::Tcp).then(|| TcpListener::bind("127.0.0.1:0").expect("bind"));
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
            let line = format!("{} {} {} {}\n", r.verified, r.bytes, r.secs, r.gets);
            (&theirs).write_all(line.as_bytes()).expect("report");
            // SAFETY: leave without running the parent's exit handlers twice.
            unsafe { libc::_exit(0) };
        }
        nix::unistd::ForkResult::Parent { child } => child,
    };
    drop(theirs);
    let mut bufs: Vec<SendBuf> = (0..args.buffers.max(1))
        .map(|_| SendBuf::new(args.size, args.align))
        .collect();
    let (mut faults_seen, mut cows, mut fallback) = (0, 0, None);
    match &tcp {
        Some(l) => {
            let mut s = TcpStream::connect(l.local_addr().expect("addr")).expect("connect");
            produce(&args, &mut bufs, |chunk| s.write_all(chunk).expect("write"));
            drop(s);
        }
        None => {
            let ep = ShmEndpoint::offer(&mine, ShmParams::default()).expect("shm bootstrap");
            // Page protection (AZ-SDP) needs a full userfaultfd.
            let uffd = match args.mode {
                Mode::AzsdpBow | Mode::AzsdpCow => UffdProtect::new().ok(),
                _ => None,
            };
            let faults = uffd.as_ref().map(UffdProtect::faults);
            let protector: Box<dyn Protector + Send> = match uffd {
                Some(u) => Box::new(u),
                None => Box::new(NoProtection),
            };
            let caps = capabilities(ep.can_get().is_none(), protector.as_ref());
            let waiter = ep.waiter();
            let mut d = Driver::new(engine_config(&args, Role::Client, caps), ep, protector);
            d.establish(Duration::from_secs(10)).expect("handshake");
            let d = ThreadedDriver::start(d, move |t| waiter.wait(t), faults);
            let flags = SendFlags {
                nonblocking: false,
                protectable: true,
            };
            produce(&args, &mut bufs, |chunk| {
                let sent = d.send(chunk, flags).expect("send");
                assert_eq!(sent, chunk.len() as u64);
            });
            let (clean, c) = d.close(Duration::from_secs(30));
            assert!(clean, "clean close");
            faults_seen = c.send_faults;
            cows = c.cow_copies;
            fallback = c.fallback_reason;
        }
    }
    let mut line = String::new();
    (&mine).read_to_string(&mut line).expect("report");
    let _ = nix::sys::wait::waitpid(child, None);
    let f: Vec<&str> = line.split_whitespace().collect();
    let (verified, bytes, secs, gets) = (
        f[0] == "true",
        f[1].parse::<u64>().unwrap_or(0),
        f[2].parse::<f64>().unwrap_or(0.0),
        f[3],
    );
    let gbps = if secs > 0.0 {
        bytes as f64 / secs / 1e9
    } else {
        0.0
    };
    println!(
        "{:?} {:.2} GB/s {} {} B GETs {} faults {} COWs {}{}",
        args.mode,
        gbps,
        if verified { "verified" } else { "CORRUPTED" },
        bytes,
        gets,
        faults_seen,
        cows,
        fallback.map_or(String::new(), |r| format!(" (fallback {r:?})"))
    );
    std::process::exit(i32::from(!verified));
}
