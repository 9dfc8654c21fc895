//! Helpers for tests that run two real processes over the `shm` fabric.
//!
//! The child is forked; it reports over its end of the socket pair and leaves
//! with `_exit`. Every wait is bounded: a child that does not finish is killed
//! and the test fails instead of hanging.

#![allow(dead_code)]

use std::io::{Read, Write};
use std::os::unix::net::UnixStream;
use std::time::{Duration, Instant};

use azsdp::conn::FaultPolicy;
use azsdp::conn::{Capabilities, EngineConfig, LockRegion, RecvFlags, Role};
use azsdp::driver::threaded::ThreadedDriver;
use azsdp::driver::{Driver, NoProtection, Protector, capabilities};
use azsdp::fabric::shm::{ShmEndpoint, ShmParams};
use azsdp::protect::uffd::UffdProtect;
use azsdp::protect::{self, Backend, ProtectionMode};
use nix::sys::wait::{WaitPidFlag, WaitStatus, waitpid};
use nix::unistd::{ForkResult, Pid, fork};

pub fn word(w: u64) -> u64 {
    let mut z = w.wrapping_add(0x9e37_79b9_7f4a_7c15);
    z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
    z ^ (z >> 31)
}

pub fn pattern(off: u64) -> u8 {
    word(off / 8).to_le_bytes()[(off % 8) as usize]
}

/// Bytes of `got` that are not the stream's from offset `off`.
pub fn mismatches(got: &[u8], off: u64) -> u64 {
    got.iter()
        .enumerate()
        .filter(|(k, x)| **x != pattern(off + *k as u64))
        .count() as u64
}

pub fn cfg(role: Role, caps: Capabilities, zsdp: bool, threshold: u64) -> EngineConfig {
    let mut e = EngineConfig::new(role, caps, LockRegion::UNSET);
    e.async_zcopy = !zsdp;
    e.zcopy_threshold = threshold;
    e.peer_timeout = Duration::from_secs(5);
    e.keepalive = Duration::from_millis(500);
    e
}

/// Run `child` in a forked process; returns its pid.
pub fn spawn(child: impl FnOnce() -> i32) -> Pid {
    let _gate = FORK_GATE.read().unwrap_or_else(|e| e.into_inner());
    // SAFETY: glibc makes malloc usable in the child of a multi-threaded
    // parent; the child touches only its own objects and leaves with _exit,
    // never returning into the test harness.
    match unsafe { fork() }.expect("fork") {
        ForkResult::Child => {
            let code = std::panic::catch_unwind(std::panic::AssertUnwindSafe(child)).unwrap_or(101);
            // SAFETY: end the child without unwinding into the harness.
            unsafe { libc::_exit(code) };
        }
        ForkResult::Parent { child } => child,
    }
}

/// Held shared by every fork of these tests, and exclusively by a test
/// whose outcome depends on no fork happening meanwhile: a fork makes the
/// process's shared memory shared with a child, and azsdp then rightly
/// stops treating it as the process's own (the tests share one process).
pub static FORK_GATE: std::sync::RwLock<()> = std::sync::RwLock::new(());

/// Kills and reaps a child that is still running when the test gives up
/// (a failing assertion must not leave the child behind; a child that
/// panics may even hang in the panic hook on a lock a parent thread held
/// at fork time).
pub struct Reaper(pub Pid);

impl Drop for Reaper {
    fn drop(&mut self) {
        if let Ok(WaitStatus::StillAlive) = waitpid(self.0, Some(WaitPidFlag::WNOHANG)) {
            let _ = nix::sys::signal::kill(self.0, nix::sys::signal::Signal::SIGKILL);
            let _ = waitpid(self.0, None);
        }
    }
}

/// Wait for `pid` at most `limit`; kill it if it overstays.
pub fn reap(pid: Pid, limit: Duration) -> WaitStatus {
    let deadline = Instant::now() + limit;
    loop {
        match waitpid(pid, Some(WaitPidFlag::WNOHANG)).expect("waitpid") {
            WaitStatus::StillAlive if Instant::now() < deadline => {
                std::thread::sleep(Duration::from_millis(10))
            }
            WaitStatus::StillAlive => {
                let state = describe_process(pid);
                let _ = nix::sys::signal::kill(pid, nix::sys::signal::Signal::SIGKILL);
                let _ = waitpid(pid, None);
                panic!("child {pid} did not finish within {limit:?}\n{state}");
            }
            s => return s,
        }
    }
}

/// What `pid` is doing, for a failure message: whether it exited, and
/// otherwise each thread's state and kernel wait, plus user stacks when gdb
/// is installed (CI installs it so that a rare hang explains itself).
pub fn describe_process(pid: Pid) -> String {
    if let Ok(s) = waitpid(pid, Some(WaitPidFlag::WNOHANG))
        && s != WaitStatus::StillAlive
    {
        return format!("process {pid}: {s:?}");
    }
    let mut out = format!("process {pid} still runs:\n");
    let tasks = format!("/proc/{pid}/task");
    for t in std::fs::read_dir(&tasks).into_iter().flatten().flatten() {
        let dir = t.path();
        let read = |f: &str| std::fs::read_to_string(dir.join(f)).unwrap_or_default();
        out += &format!(
            "  task {}: {} state {} wchan {} syscall {}\n",
            t.file_name().to_string_lossy(),
            read("comm").trim(),
            read("stat").split(' ').nth(2).unwrap_or("?"),
            read("wchan").trim(),
            read("syscall").trim(),
        );
    }
    let gdb = std::process::Command::new("timeout")
        .args(["20", "gdb", "-p", &pid.to_string(), "-batch", "-nx"])
        .args(["-ex", "thread apply all bt 30"])
        .output();
    if let Ok(o) = gdb {
        out += &String::from_utf8_lossy(&o.stdout);
    }
    out
}

/// The receiving child: accept, wait `delay`, receive everything into
/// `buf_len`-byte reads checking every byte against the pattern, close, and
/// report "bytes bad-bytes" over the socket.
pub fn verifying_receiver(sock: &UnixStream, delay: Duration, buf_len: usize) -> i32 {
    let ep = ShmEndpoint::accept(sock, ShmParams::default()).unwrap();
    let caps = capabilities(ep.can_get().is_none(), &NoProtection);
    let mut d = Driver::new(cfg(Role::Server, caps, false, 16 << 10), ep, NoProtection);
    d.establish(Duration::from_secs(5)).unwrap();
    std::thread::sleep(delay);
    let mut buf = vec![0u8; buf_len];
    let (mut off, mut bad) = (0u64, 0u64);
    loop {
        let n = d.recv(&mut buf, RecvFlags::default()).unwrap() as usize;
        if n == 0 {
            break;
        }
        bad += buf[..n]
            .iter()
            .enumerate()
            .filter(|(k, x)| **x != pattern(off + *k as u64))
            .count() as u64;
        off += n as u64;
    }
    d.close(Duration::from_secs(5));
    (&*sock)
        .write_all(format!("{off} {bad}").as_bytes())
        .unwrap();
    0
}

/// Read the child's "bytes bad-bytes" report and reap it.
pub fn child_report(sock: &UnixStream, child: Pid) -> (u64, u64) {
    let f = child_report_all(sock, child);
    (f[0], f[1])
}

/// Every number the child reported.
pub fn child_report_all(sock: &UnixStream, child: Pid) -> Vec<u64> {
    let mut report = String::new();
    (&*sock).read_to_string(&mut report).unwrap();
    assert_eq!(
        reap(child, Duration::from_secs(30)),
        WaitStatus::Exited(child, 0)
    );
    report.split(' ').map(|x| x.parse().unwrap()).collect()
}

/// The sending side with real page protection, or None without a full
/// userfaultfd (then the caller skips; root always has one).
pub fn protected_sender(
    sock: &UnixStream,
    policy: FaultPolicy,
    fallback_faults: u32,
) -> Option<ThreadedDriver<ShmEndpoint, UffdProtect>> {
    let Ok(uffd) = UffdProtect::new() else {
        assert!(
            !nix::unistd::geteuid().is_root(),
            "root must get a full userfaultfd"
        );
        eprintln!("skipped: no full userfaultfd");
        return None;
    };
    let ep = ShmEndpoint::offer(sock, ShmParams::default()).unwrap();
    let faults = uffd.faults();
    let caps = capabilities(true, &uffd);
    let mut c = cfg(Role::Client, caps, false, 16 << 10);
    c.write_fault = policy;
    c.fallback_faults = fallback_faults;
    let waiter = ep.waiter();
    let mut d = Driver::new(c, ep, uffd);
    d.establish(Duration::from_secs(5)).unwrap();
    Some(ThreadedDriver::start(d, waiter, Some(Box::new(faults))))
}

/// A receiving child reading random sizes at random offsets of its buffer
/// and checking every byte against the pattern; with `armed`, receives
/// return before their data lands (armed pages, userfaultfd) and the check
/// itself waits for it. Reports "bytes bad-bytes armed-receives GETs".
pub fn random_receiver(sock: &UnixStream, seed: u64, armed: bool) -> i32 {
    let p = protect::open(if armed {
        ProtectionMode::Auto
    } else {
        ProtectionMode::Off
    });
    let ep = ShmEndpoint::accept(sock, ShmParams::default()).unwrap();
    let caps = capabilities(ep.can_get().is_none(), p.protector.as_ref());
    let mut c = cfg(Role::Server, caps, false, 16 << 10);
    c.recv_protect = azsdp::conn::RecvProtect::On;
    let waiter = ep.waiter();
    let mut d = Driver::new(c, ep, p.protector);
    d.establish(Duration::from_secs(5)).unwrap();
    let d = ThreadedDriver::start(d, waiter, p.faults);
    let mut store = vec![0u64; (4 << 20) / 8];
    // SAFETY: a byte view of our own Vec, which outlives every use.
    let buf = unsafe { std::slice::from_raw_parts_mut(store.as_mut_ptr().cast::<u8>(), 4 << 20) };
    let flags = RecvFlags {
        armable: armed,
        ..RecvFlags::default()
    };
    let (mut off, mut bad, mut i) = (0u64, 0u64, seed);
    loop {
        i = word(i);
        let start = (i % 8192) as usize;
        let len = 1 + (word(i) % (2 << 20)) as usize;
        let n = d.recv(&mut buf[start..start + len], flags).unwrap() as usize;
        if n == 0 {
            break;
        }
        bad += mismatches(&buf[start..start + n], off);
        off += n as u64;
    }
    let (_, c) = d.close(Duration::from_secs(10));
    drop(store);
    (&*sock)
        .write_all(format!("{off} {bad} {} {}", c.armed_recvs, c.gets).as_bytes())
        .unwrap();
    0
}

/// The sending side with the protection `mode` gives (whatever this host
/// has: the caller checks the backend it got).
pub fn sender_with(
    sock: &UnixStream,
    mode: ProtectionMode,
    policy: FaultPolicy,
    fallback_faults: u32,
) -> (
    ThreadedDriver<ShmEndpoint, Box<dyn Protector + Send>>,
    Backend,
) {
    let p = protect::open(mode);
    let ep = ShmEndpoint::offer(sock, ShmParams::default()).unwrap();
    let caps = capabilities(true, p.protector.as_ref());
    let mut c = cfg(Role::Client, caps, false, 16 << 10);
    c.write_fault = policy;
    c.fallback_faults = fallback_faults;
    let waiter = ep.waiter();
    let mut d = Driver::new(c, ep, p.protector);
    d.establish(Duration::from_secs(5)).unwrap();
    (ThreadedDriver::start(d, waiter, p.faults), p.backend)
}

/// Fill `dst` from a pipe: the kernel writes the (maybe protected) pages.
pub fn kernel_write(dst: &mut [u8], data: &[u8]) {
    let mut fds = [0; 2];
    // SAFETY: creating a pipe into a 2-int array.
    assert_eq!(unsafe { libc::pipe(fds.as_mut_ptr()) }, 0);
    let (rd, wr) = (fds[0], fds[1]);
    let feeder = {
        let data = data.to_vec();
        std::thread::spawn(move || {
            let mut sent = 0;
            while sent < data.len() {
                // SAFETY: writing from our own buffer to our pipe.
                let n = unsafe { libc::write(wr, data[sent..].as_ptr().cast(), data.len() - sent) };
                assert!(n > 0);
                sent += n as usize;
            }
            // SAFETY: closing our end.
            unsafe { libc::close(wr) };
        })
    };
    let mut got = 0;
    while got < dst.len() {
        // SAFETY: reading into the caller's buffer, in bounds.
        let n = unsafe { libc::read(rd, dst[got..].as_mut_ptr().cast(), dst.len() - got) };
        assert!(
            n > 0,
            "read() into a just-sent buffer failed: {}",
            std::io::Error::last_os_error()
        );
        got += n as usize;
    }
    feeder.join().unwrap();
    // SAFETY: closing our end.
    unsafe { libc::close(rd) };
}

/// A fresh private anonymous mapping of `len` bytes: its address.
pub fn mmap_anon(len: usize) -> u64 {
    // SAFETY: a fresh private anonymous mapping.
    let p = unsafe {
        libc::mmap(
            std::ptr::null_mut(),
            len,
            libc::PROT_READ | libc::PROT_WRITE,
            libc::MAP_PRIVATE | libc::MAP_ANONYMOUS,
            -1,
            0,
        )
    };
    assert_ne!(p, libc::MAP_FAILED, "mmap of {len} bytes");
    p as u64
}
