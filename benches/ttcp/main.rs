//! `azsdp-ttcp`: a ttcp-style test program with ordinary blocking sockets.
//!
//! It makes no azsdp calls: run it plain for kernel TCP, or under
//! `azsdp run --config FILE` for the modes FILE selects. As in ttcp (and in
//! the AZ-SDP paper's evaluation) one buffer is reused for every call.
//!
//! ```text
//! azsdp-ttcp -r [-p PORT] [--clients N] [--json]         # receiver / echo server
//! azsdp-ttcp -t HOST [-p PORT] [-l LEN] [-n COUNT] [-A ALIGN] [-O OFFSET] [--streams N]
//!            [--test throughput|latency|source] [--compute-us US] [--touch-window W] [--json]
//! ```
//!
//! The transmitter starts with a fixed 64-byte header naming the test, so
//! the receiver needs no options beyond its port. Tests:
//! - `throughput`: COUNT sends of LEN bytes; the receiver reads them all
//!   (with `--compute-us`, busy computation between sends: the overlap test;
//!   with `--touch-window W`, the sender rewrites its buffer and the receiver
//!   reads its buffer once every W calls: the page-fault test);
//! - `latency`: COUNT ping-pongs of LEN bytes each way; half the round trip;
//! - `source`: the receiver sends COUNT × LEN bytes to the transmitter
//!   (fan-out, when N transmitters talk to one receiver).
//!
//! `--streams N` runs N connections from N threads of one transmitter
//! (multi-stream); `--clients N` makes the receiver serve N connections at
//! once, one thread each (hot-spot, fan-in, fan-out with N transmitters).
//! Results are per connection, plus the aggregate with `--streams`.

use std::io::{Read, Write};
use std::net::{TcpListener, TcpStream};
use std::process::ExitCode;
use std::time::{Duration, Instant};

const MAGIC: u32 = 0x7474_6370; // "ttcp"

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Test {
    Throughput,
    Latency,
    Source,
}

impl Test {
    fn name(self) -> &'static str {
        match self {
            Test::Throughput => "throughput",
            Test::Latency => "latency",
            Test::Source => "source",
        }
    }
}

#[derive(Clone, Debug)]
struct Opts {
    transmit: Option<String>,
    port: u16,
    len: usize,
    count: u64,
    align: usize,
    offset: usize,
    test: Test,
    compute_us: u64,
    touch_window: u64,
    json: bool,
    streams: usize,
    clients: usize,
}

fn usage() -> String {
    "usage: azsdp-ttcp -r [-p PORT] [--clients N] [--json]\n       azsdp-ttcp -t HOST [-p PORT] [-l LEN] [-n COUNT] [-A ALIGN] [-O OFFSET] \
     [--streams N] [--test throughput|latency|source] [--compute-us US] [--touch-window W] [--json]"
        .into()
}

/// `64k`, `1m`, `4096`: a size.
fn size(s: &str) -> Result<u64, String> {
    let (num, mul) = match s.chars().last() {
        Some('k' | 'K') => (&s[..s.len() - 1], 1 << 10),
        Some('m' | 'M') => (&s[..s.len() - 1], 1 << 20),
        Some('g' | 'G') => (&s[..s.len() - 1], 1 << 30),
        _ => (s, 1),
    };
    num.parse::<u64>()
        .map(|n| n * mul)
        .map_err(|_| format!("`{s}` is not a size"))
}

fn parse(args: &[String]) -> Result<Opts, String> {
    let mut o = Opts {
        transmit: None,
        port: 5001,
        len: 64 << 10,
        count: 2048,
        align: 4096,
        offset: 0,
        test: Test::Throughput,
        compute_us: 0,
        touch_window: 0,
        json: false,
        streams: 1,
        clients: 1,
    };
    let mut receive = false;
    let mut it = args.iter();
    while let Some(a) = it.next() {
        let mut val = || {
            it.next()
                .cloned()
                .ok_or_else(|| format!("{a} needs a value"))
        };
        match a.as_str() {
            "-r" => receive = true,
            "-t" => o.transmit = Some(val()?),
            "-p" => o.port = val()?.parse().map_err(|_| "bad port")?,
            "-l" => o.len = size(&val()?)? as usize,
            "-n" => o.count = size(&val()?)?,
            "-A" => o.align = size(&val()?)? as usize,
            "-O" => o.offset = size(&val()?)? as usize,
            "--test" => {
                o.test = match val()?.as_str() {
                    "throughput" => Test::Throughput,
                    "latency" => Test::Latency,
                    "source" => Test::Source,
                    t => return Err(format!("unknown test `{t}`")),
                }
            }
            "--compute-us" => o.compute_us = size(&val()?)?,
            "--touch-window" => o.touch_window = size(&val()?)?,
            "--json" => o.json = true,
            "--streams" => o.streams = (size(&val()?)? as usize).max(1),
            "--clients" => o.clients = (size(&val()?)? as usize).max(1),
            "-h" | "--help" => return Err(usage()),
            other => return Err(format!("unknown option `{other}`\n{}", usage())),
        }
    }
    if receive == o.transmit.is_some() {
        return Err(usage());
    }
    if o.len == 0 || o.align == 0 || !o.align.is_power_of_two() {
        return Err("-l must be positive and -A a power of two".into());
    }
    Ok(o)
}

/// A buffer of `len` bytes whose start is `offset` past an `align` boundary.
struct Buf {
    store: Vec<u8>,
    start: usize,
    len: usize,
}

impl Buf {
    fn new(len: usize, align: usize, offset: usize) -> Buf {
        let store = vec![0u8; len + align + offset];
        let base = store.as_ptr() as usize;
        let start = base.next_multiple_of(align) - base + offset;
        let mut b = Buf { store, start, len };
        b.fill(0);
        b
    }
    fn get(&mut self) -> &mut [u8] {
        &mut self.store[self.start..self.start + self.len]
    }
    /// Write a pattern (a new "message") into the whole buffer.
    fn fill(&mut self, round: u64) {
        for (i, x) in self.get().iter_mut().enumerate() {
            *x = (i as u64).wrapping_mul(31).wrapping_add(round) as u8;
        }
    }
    /// Read the whole buffer (a program using what it received).
    fn touch(&mut self) -> u64 {
        self.get().iter().map(|x| u64::from(*x)).sum()
    }
}

/// Busy computation for `us` microseconds (not a sleep: the CPU is used).
fn compute(us: u64) {
    if us == 0 {
        return;
    }
    let end = Instant::now() + Duration::from_micros(us);
    let mut x = 1u64;
    while Instant::now() < end {
        for _ in 0..64 {
            x = x.wrapping_mul(6364136223846793005).wrapping_add(1);
        }
    }
    std::hint::black_box(x);
}

fn header(o: &Opts) -> [u8; 64] {
    let mut h = [0u8; 64];
    h[0..4].copy_from_slice(&MAGIC.to_le_bytes());
    h[4] = match o.test {
        Test::Throughput => 0,
        Test::Latency => 1,
        Test::Source => 2,
    };
    h[8..16].copy_from_slice(&(o.len as u64).to_le_bytes());
    h[16..24].copy_from_slice(&o.count.to_le_bytes());
    h[24..32].copy_from_slice(&o.touch_window.to_le_bytes());
    h[32..40].copy_from_slice(&(o.align as u64).to_le_bytes());
    h[40..48].copy_from_slice(&(o.offset as u64).to_le_bytes());
    h
}

fn read_header(h: &[u8; 64]) -> Result<(Test, usize, u64, u64, usize, usize), String> {
    let u = |i: usize| u64::from_le_bytes(h[i..i + 8].try_into().unwrap_or_default());
    if h[0..4] != MAGIC.to_le_bytes() {
        return Err("the transmitter is not azsdp-ttcp".into());
    }
    let test = match h[4] {
        0 => Test::Throughput,
        1 => Test::Latency,
        2 => Test::Source,
        t => return Err(format!("unknown test {t}")),
    };
    let len = u(8);
    if len == 0 || len > (1 << 30) {
        return Err(format!("bad length {len}"));
    }
    let align = u(32).max(1);
    if !align.is_power_of_two() || align > (1 << 30) || u(40) > (1 << 30) {
        return Err("bad alignment".into());
    }
    Ok((
        test,
        len as usize,
        u(16),
        u(24),
        align as usize,
        u(40) as usize,
    ))
}

struct Result_ {
    bytes: u64,
    secs: f64,
    calls: u64,
}

fn report(o: &Opts, role: &str, r: &Result_, test: Test, len: usize, count: u64) {
    let gbps = r.bytes as f64 / r.secs / 1e9;
    let lat_us = r.secs * 1e6 / count.max(1) as f64 / 2.0;
    if o.json {
        println!(
            "{{\"role\":\"{role}\",\"test\":\"{}\",\"size\":{len},\"count\":{count},\"bytes\":{},\
             \"secs\":{:.6},\"calls\":{},\"gbytes_per_sec\":{gbps:.4},\"latency_us\":{lat_us:.3},\
             \"compute_us\":{},\"touch_window\":{}}}",
            test.name(),
            r.bytes,
            r.secs,
            r.calls,
            o.compute_us,
            o.touch_window
        );
    } else {
        match test {
            Test::Throughput | Test::Source => println!(
                "ttcp-{role}: {} bytes in {:.4} real seconds = {gbps:.3} GB/s ({} calls)",
                r.bytes, r.secs, r.calls
            ),
            Test::Latency => println!(
                "ttcp-{role}: {count} round trips of {len} bytes in {:.4} s = {lat_us:.2} us one way",
                r.secs
            ),
        }
    }
}

/// One connection of the transmitter.
fn transmit_one(o: &Opts, host: &str) -> Result<Result_, String> {
    let mut s = TcpStream::connect((host, o.port)).map_err(|e| format!("connect: {e}"))?;
    let _ = s.set_nodelay(true);
    s.write_all(&header(o))
        .map_err(|e| format!("header: {e}"))?;
    let mut buf = Buf::new(o.len, o.align, o.offset);
    let t0 = Instant::now();
    if o.test == Test::Source {
        let total = o.len as u64 * o.count;
        let (bytes, calls) = drain(&mut s, &mut buf, total, o.touch_window)?;
        s.write_all(&[1]).map_err(|e| format!("ack: {e}"))?;
        return Ok(Result_ {
            bytes,
            secs: t0.elapsed().as_secs_f64(),
            calls,
        });
    }
    for i in 0..o.count {
        if o.touch_window > 0 && i % o.touch_window == 0 && i > 0 {
            buf.fill(i);
        }
        s.write_all(buf.get()).map_err(|e| format!("write: {e}"))?;
        match o.test {
            Test::Latency => s.read_exact(buf.get()).map_err(|e| format!("read: {e}"))?,
            _ => compute(o.compute_us),
        }
    }
    if o.test == Test::Throughput {
        // The receiver's one-byte answer: everything arrived.
        let mut ack = [0u8; 1];
        s.read_exact(&mut ack)
            .map_err(|e| format!("final ack: {e}"))?;
    }
    Ok(Result_ {
        bytes: o.len as u64 * o.count,
        secs: t0.elapsed().as_secs_f64(),
        calls: o.count,
    })
}

fn transmit(o: &Opts, host: &str) -> Result<(), String> {
    if !o.json {
        println!(
            "ttcp-t: buflen={}, nbuf={}, align={}/{}, port={}, streams={}  tcp  -> {host}",
            o.len, o.count, o.align, o.offset, o.port, o.streams
        );
    }
    let t0 = Instant::now();
    let results: Vec<Result<Result_, String>> = std::thread::scope(|sc| {
        let hs: Vec<_> = (0..o.streams)
            .map(|_| sc.spawn(|| transmit_one(o, host)))
            .collect();
        hs.into_iter()
            .map(|h| h.join().unwrap_or_else(|_| Err("a stream panicked".into())))
            .collect()
    });
    let secs = t0.elapsed().as_secs_f64();
    let mut total = Result_ {
        bytes: 0,
        secs,
        calls: 0,
    };
    for r in results {
        let r = r?;
        if o.streams == 1 {
            report(o, "t", &r, o.test, o.len, o.count);
        }
        total.bytes += r.bytes;
        total.calls += r.calls;
    }
    if o.streams > 1 {
        report(o, "t", &total, o.test, o.len, o.count);
    }
    Ok(())
}

/// Read `total` bytes into `buf` (reading the buffer every `window` calls).
fn drain(s: &mut TcpStream, buf: &mut Buf, total: u64, window: u64) -> Result<(u64, u64), String> {
    let (mut bytes, mut calls, mut sink) = (0u64, 0u64, 0u64);
    let len = buf.len as u64;
    while bytes < total {
        let want = (total - bytes).min(len) as usize;
        let n = s
            .read(&mut buf.get()[..want])
            .map_err(|e| format!("read: {e}"))?;
        if n == 0 {
            return Err(format!("EOF after {bytes} of {total} bytes"));
        }
        bytes += n as u64;
        calls += 1;
        if window > 0 && calls % window == 0 {
            sink = sink.wrapping_add(buf.touch());
        }
    }
    std::hint::black_box(sink);
    Ok((bytes, calls))
}

fn receive_one(o: &Opts, mut s: TcpStream) -> Result<(), String> {
    let _ = s.set_nodelay(true);
    let mut h = [0u8; 64];
    s.read_exact(&mut h).map_err(|e| format!("header: {e}"))?;
    let (test, len, count, window, align, offset) = read_header(&h)?;
    let mut buf = Buf::new(len, align, offset);
    let t0 = Instant::now();
    let (bytes, calls) = match test {
        Test::Throughput => {
            let r = drain(&mut s, &mut buf, len as u64 * count, window)?;
            s.write_all(&[1]).map_err(|e| format!("ack: {e}"))?;
            r
        }
        Test::Latency => {
            for _ in 0..count {
                s.read_exact(buf.get()).map_err(|e| format!("read: {e}"))?;
                s.write_all(buf.get()).map_err(|e| format!("write: {e}"))?;
            }
            (2 * len as u64 * count, 2 * count)
        }
        Test::Source => {
            for i in 0..count {
                if window > 0 && i % window == 0 && i > 0 {
                    buf.fill(i);
                }
                s.write_all(buf.get()).map_err(|e| format!("write: {e}"))?;
            }
            let mut ack = [0u8; 1];
            s.read_exact(&mut ack)
                .map_err(|e| format!("final ack: {e}"))?;
            (len as u64 * count, count)
        }
    };
    let r = Result_ {
        bytes,
        secs: t0.elapsed().as_secs_f64(),
        calls,
    };
    report(o, "r", &r, test, len, count);
    Ok(())
}

fn receive(o: &Opts) -> Result<(), String> {
    let l = TcpListener::bind(("0.0.0.0", o.port)).map_err(|e| format!("bind: {e}"))?;
    if !o.json {
        println!("ttcp-r: port={}  tcp", o.port);
    }
    // One thread per connection, all accepted first (hot-spot, fan-in,
    // fan-out run their clients at once).
    let mut conns = Vec::new();
    for _ in 0..o.clients {
        conns.push(l.accept().map_err(|e| format!("accept: {e}"))?.0);
    }
    std::thread::scope(|sc| {
        let hs: Vec<_> = conns
            .into_iter()
            .map(|s| sc.spawn(move || receive_one(o, s)))
            .collect();
        hs.into_iter().try_for_each(|h| {
            h.join()
                .unwrap_or_else(|_| Err("a connection panicked".into()))
        })
    })
}

fn main() -> ExitCode {
    let args: Vec<String> = std::env::args().skip(1).collect();
    let o = match parse(&args) {
        Ok(o) => o,
        Err(e) => {
            eprintln!("{e}");
            return ExitCode::from(2);
        }
    };
    let r = match &o.transmit {
        Some(h) => transmit(&o, h),
        None => receive(&o),
    };
    match r {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("azsdp-ttcp: {e}");
            ExitCode::FAILURE
        }
    }
}
