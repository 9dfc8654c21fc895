//! `azsdp demo`: a real program pair under `azsdp run`, and the same pair
//! on plain kernel TCP, with what moved over which path.
//!
//! The pair is this very executable in its `demo-peer` role: an ordinary
//! blocking-socket program (std::net, no azsdp calls) that either receives
//! and verifies a stream or sends one, reusing one buffer as ttcp does.

use std::io::{Read, Write};
use std::net::{TcpListener, TcpStream};
use std::path::{Path, PathBuf};
use std::process::{Command, ExitCode, Stdio};
use std::time::Instant;

/// Byte `i` of a buffer: the stream is the buffer, sent again and again.
fn pattern(i: u64) -> u8 {
    (i.wrapping_mul(0x9e37_79b9) >> 11) as u8
}

fn filled(len: usize) -> Vec<u8> {
    (0..len as u64).map(pattern).collect()
}

/// `azsdp demo-peer`: receive (`--listen PORT`) or send (`--connect PORT`).
pub fn peer(
    listen: Option<u16>,
    connect: Option<u16>,
    bytes: u64,
    buflen: usize,
    touch: bool,
) -> ExitCode {
    let r = match (listen, connect) {
        (Some(p), None) => receive(p, bytes, buflen),
        (None, Some(p)) => send(p, bytes, buflen, touch),
        _ => Err("give --listen or --connect".to_string()),
    };
    match r {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("azsdp demo-peer: {e}");
            ExitCode::FAILURE
        }
    }
}

fn receive(port: u16, bytes: u64, buflen: usize) -> Result<(), String> {
    let l = TcpListener::bind(("127.0.0.1", port)).map_err(|e| format!("bind: {e}"))?;
    println!("listening");
    let (mut s, _) = l.accept().map_err(|e| format!("accept: {e}"))?;
    let mut buf = vec![0u8; buflen];
    // Twice the sender's buffer: any read lies within it at its offset.
    let expect = filled(buflen).repeat(2);
    let mut at = 0u64;
    loop {
        let n = s.read(&mut buf).map_err(|e| format!("read: {e}"))?;
        if n == 0 {
            break;
        }
        let from = (at % buflen as u64) as usize;
        if buf[..n] != expect[from..from + n] {
            return Err(format!("wrong bytes within {at}..{}", at + n as u64));
        }
        at += n as u64;
    }
    if at != bytes {
        return Err(format!("received {at} bytes, expected {bytes}"));
    }
    Ok(())
}

fn send(port: u16, bytes: u64, buflen: usize, touch: bool) -> Result<(), String> {
    let mut s = TcpStream::connect(("127.0.0.1", port)).map_err(|e| format!("connect: {e}"))?;
    let mut buf = filled(buflen);
    let mut at = 0u64;
    while at < bytes {
        let n = (bytes - at).min(buflen as u64) as usize;
        if touch {
            // Rewrite the buffer (same contents) as a program preparing its
            // next message would: under AZ-SDP the write may meet pages
            // still in flight, which the protection catches.
            for (i, b) in buf.iter_mut().enumerate() {
                *b = pattern(i as u64);
            }
        }
        s.write_all(&buf[..n]).map_err(|e| format!("write: {e}"))?;
        at += n as u64;
    }
    s.shutdown(std::net::Shutdown::Write)
        .map_err(|e| format!("shutdown: {e}"))?;
    Ok(())
}

struct Run {
    secs: f64,
    sender_log: String,
    receiver_log: String,
}

struct Params {
    bytes: u64,
    buflen: usize,
    touch: bool,
}

fn run_pair(exe: &Path, azsdp: bool, port: u16, p: &Params, dir: &Path) -> Result<Run, String> {
    let (bytes, buflen) = (p.bytes, p.buflen);
    let logs = [dir.join("receiver.log"), dir.join("sender.log")];
    let cmd = |role: &str, log: &Path| {
        let mut c = if azsdp {
            let mut c = Command::new(exe);
            c.args(["run", "--"]).arg(exe);
            c
        } else {
            Command::new(exe)
        };
        c.arg("demo-peer")
            .arg(role)
            .arg(port.to_string())
            .args([
                "--bytes",
                &bytes.to_string(),
                "--buflen",
                &buflen.to_string(),
            ])
            .args(p.touch.then_some("--touch"))
            .env("AZSDP_LOG", log)
            .env("AZSDP_LOG_LEVEL", "info")
            .stdout(Stdio::piped());
        c
    };
    for l in &logs {
        let _ = std::fs::remove_file(l);
    }
    let mut rx = cmd("--listen", &logs[0])
        .spawn()
        .map_err(|e| format!("start the receiver: {e}"))?;
    let mut line = [0u8; 10];
    let ready = rx
        .stdout
        .as_mut()
        .map(|o| o.read_exact(&mut line).is_ok())
        .unwrap_or(false);
    if !ready {
        let _ = rx.kill();
        return Err("the receiver did not start".into());
    }
    let t0 = Instant::now();
    let tx = cmd("--connect", &logs[1])
        .status()
        .map_err(|e| format!("run the sender: {e}"))?;
    let rxs = rx.wait().map_err(|e| format!("wait: {e}"))?;
    let secs = t0.elapsed().as_secs_f64();
    if !tx.success() || !rxs.success() {
        return Err(format!("the pair failed (sender {tx}, receiver {rxs})"));
    }
    let read = |p: &PathBuf| std::fs::read_to_string(p).unwrap_or_default();
    Ok(Run {
        secs,
        sender_log: read(&logs[1]),
        receiver_log: read(&logs[0]),
    })
}

/// The shim's closing line of the (only) connection in `log`.
fn closing(log: &str) -> Option<String> {
    log.lines()
        .find(|l| l.contains(": closed; "))
        .and_then(|l| l.split(": closed; ").nth(1))
        .map(str::to_string)
}

/// "1GiB", "64KiB", "10 bytes".
fn human(n: u64) -> String {
    let s = azsdp::config::format_size(n);
    if s.bytes().all(|b| b.is_ascii_digit()) {
        format!("{s} bytes")
    } else {
        s
    }
}

fn gbps(bytes: u64, secs: f64) -> f64 {
    bytes as f64 / secs / 1e9
}

pub fn demo(bytes: u64, buflen: usize, touch: bool) -> ExitCode {
    let params = Params {
        bytes,
        buflen,
        touch,
    };
    let exe = match std::env::current_exe() {
        Ok(e) => e,
        Err(e) => {
            eprintln!("azsdp demo: {e}");
            return ExitCode::FAILURE;
        }
    };
    if let Err(e) = crate::locate::shim() {
        eprintln!("azsdp demo: {e}");
        return ExitCode::from(2);
    }
    let dir = std::env::temp_dir().join(format!("azsdp-demo-{}", std::process::id()));
    let _ = std::fs::create_dir_all(&dir);
    let port = 18000 + (std::process::id() % 2000) as u16;
    println!(
        "azsdp demo: {} in {} writes from one reused buffer{}, receiver verifying every byte",
        human(bytes),
        human(buflen as u64),
        if touch {
            " rewritten before each write"
        } else {
            ""
        }
    );
    let mut code = ExitCode::SUCCESS;
    let mut tcp_secs = None;
    for (name, azsdp) in [("kernel TCP ", false), ("azsdp run  ", true)] {
        match run_pair(&exe, azsdp, port + u16::from(azsdp), &params, &dir) {
            Ok(r) => {
                let mut line =
                    format!("  {name}: {:.2} s, {:.2} GB/s", r.secs, gbps(bytes, r.secs));
                if let (true, Some(t)) = (azsdp, tcp_secs) {
                    line += &format!(" ({:.2}x kernel TCP)", t / r.secs);
                }
                println!("{line}");
                if azsdp {
                    match (closing(&r.sender_log), closing(&r.receiver_log)) {
                        (Some(s), Some(rcv)) => {
                            println!("    sender:   {s}");
                            println!("    receiver: {rcv}");
                        }
                        _ => {
                            println!("    the pair stayed on TCP; the shim said:");
                            for l in r.sender_log.lines().chain(r.receiver_log.lines()) {
                                println!("      {l}");
                            }
                        }
                    }
                } else {
                    tcp_secs = Some(r.secs);
                }
            }
            Err(e) => {
                println!("  {name}: {e}");
                code = ExitCode::FAILURE;
            }
        }
    }
    let _ = std::fs::remove_dir_all(&dir);
    println!("`azsdp stat` shows live connections; `azsdp run -- PROGRAM` runs yours.");
    code
}
