//! azsdp-echo: an ordinary socket program (blocking clients, echo servers
//! in the three shapes real servers take) for the connection-scale
//! benchmark (`azsdp bench`, section "connections") and as the victim of
//! the trust tests. It knows nothing of azsdp: run it plain for kernel
//! TCP, or under `azsdp run`.
//!
//! ```text
//! azsdp-echo serve PORT            epoll echo server on 127.0.0.1:PORT
//! azsdp-echo serve-threads PORT    a thread per connection, blocking
//! azsdp-echo serve-prefork PORT N  N forked workers, each an epoll server
//!                                  accepting on the one listener
//! azsdp-echo hold                  a process holding the secret, not serving
//! azsdp-echo send PORT BYTES       connect, send a pattern, check the echo
//! azsdp-echo many PORT N BYTES     hold N connections at once, each checked
//!                                  (connect all, echo on each, close all;
//!                                  ECHO_PAUSE_MS=T pauses T ms between the
//!                                  connects and the echoes, to profile one;
//!                                  ECHO_CLOSE_PAUSE_MS=T between the echoes
//!                                  and the closes)
//! azsdp-echo cycle PORT N BYTES    N connections one after another, each checked
//! ```
//!
//! `serve` and `hold` keep [`SECRET`] in their heap and print
//! `ready PID ADDRESS` (the secret's address) once set up: a perfectly
//! informed attacker knows where to aim. Client modes print one JSON line.

use std::io::{Read, Write};
use std::net::{SocketAddr, TcpStream};
use std::os::fd::AsRawFd;
use std::time::{Duration, Instant};

/// What an attacker must never get.
const SECRET: &[u8] = b"THE-PASSWORD-IS-hunter2 ";

fn secret_page() -> Box<[u8]> {
    SECRET.iter().copied().cycle().take(64 << 10).collect()
}

fn pattern(i: u64) -> u8 {
    (i.wrapping_mul(2654435761) >> 13) as u8
}

fn die(msg: String) -> ! {
    eprintln!("azsdp-echo: {msg}");
    std::process::exit(2);
}

fn arg<T: std::str::FromStr>(args: &[String], i: usize, what: &str) -> T {
    args.get(i)
        .and_then(|a| a.parse().ok())
        .unwrap_or_else(|| die(format!("missing or bad {what}")))
}

fn main() {
    let args: Vec<String> = std::env::args().collect();
    match args.get(1).map(String::as_str) {
        Some("serve") => serve(arg(&args, 2, "port")),
        Some("serve-threads") => serve_threads(arg(&args, 2, "port")),
        Some("serve-prefork") => serve_prefork(arg(&args, 2, "port"), arg(&args, 3, "workers")),
        Some("hold") => hold(),
        Some("send") => {
            let (port, bytes) = (arg(&args, 2, "port"), arg(&args, 3, "bytes"));
            let t0 = Instant::now();
            match TcpStream::connect(("127.0.0.1", port)).map_err(|e| e.to_string()) {
                Ok(s) => match exchange(&s, bytes) {
                    Ok(()) => println!(
                        "{{\"ok\":true,\"bytes\":{bytes},\"ms\":{}}}",
                        t0.elapsed().as_millis()
                    ),
                    Err(e) => die(e),
                },
                Err(e) => die(e),
            }
        }
        Some("many") => many(
            arg(&args, 2, "port"),
            arg(&args, 3, "count"),
            arg(&args, 4, "bytes"),
        ),
        Some("cycle") => cycle(
            arg(&args, 2, "port"),
            arg(&args, 3, "count"),
            arg(&args, 4, "bytes"),
        ),
        _ => die(
            "usage: azsdp-echo serve|serve-threads|serve-prefork|hold|send|many|cycle ...".into(),
        ),
    }
}

fn ready(secret: &[u8]) {
    println!(
        "ready {} {:#x}",
        std::process::id(),
        secret.as_ptr() as usize
    );
    let _ = std::io::stdout().flush();
}

fn hold() {
    let secret = secret_page();
    ready(&secret);
    // Until the test closes our stdin.
    let mut b = [0u8; 1];
    let _ = std::io::stdin().read(&mut b);
    std::hint::black_box(&secret);
}

/// Send `bytes` of the pattern and read them back, checking every byte.
fn exchange(s: &TcpStream, bytes: u64) -> Result<(), String> {
    s.set_read_timeout(Some(Duration::from_secs(20)))
        .map_err(|e| e.to_string())?;
    let mut sent = 0u64;
    let mut got = 0u64;
    let mut out = vec![0u8; 64 << 10];
    let mut inb = vec![0u8; 64 << 10];
    while got < bytes {
        if sent < bytes {
            let n = (bytes - sent).min(out.len() as u64) as usize;
            for (k, b) in out[..n].iter_mut().enumerate() {
                *b = pattern(sent + k as u64);
            }
            (&*s)
                .write_all(&out[..n])
                .map_err(|e| format!("write at {sent}: {e}"))?;
            sent += n as u64;
        }
        while got < sent {
            let n = (&*s)
                .read(&mut inb)
                .map_err(|e| format!("read at {got}: {e}"))?;
            if n == 0 {
                return Err(format!("EOF after {got} of {bytes} bytes"));
            }
            if inb[..n].windows(SECRET.len()).any(|w| w == SECRET) {
                return Err("the echo carried the secret".into());
            }
            for (k, b) in inb[..n].iter().enumerate() {
                if *b != pattern(got + k as u64) {
                    return Err(format!("byte {} differs", got + k as u64));
                }
            }
            got += n as u64;
        }
    }
    Ok(())
}

fn own_counts() -> (u64, u64, u64) {
    let status = std::fs::read_to_string("/proc/self/status").unwrap_or_default();
    let field = |k: &str| {
        status
            .lines()
            .find_map(|l| l.strip_prefix(k))
            .and_then(|v| v.split_whitespace().next()?.parse().ok())
            .unwrap_or(0)
    };
    let fds = std::fs::read_dir("/proc/self/fd").map_or(0, |d| d.count() as u64);
    (field("VmRSS:"), field("Threads:"), fds)
}

/// Room for ten thousand connections and their threads, as servers ask
/// (nginx's `worker_rlimit_nofile`, systemd's `LimitNOFILE`): the hard
/// limit raised to 65,536 where we may (root), else the soft limit to the
/// hard one.
fn raise_fd_limit() {
    let mut r = libc::rlimit {
        rlim_cur: 0,
        rlim_max: 0,
    };
    // SAFETY: getrlimit/setrlimit with our own struct.
    unsafe {
        libc::getrlimit(libc::RLIMIT_NOFILE, &mut r);
        let want = r.rlim_max.max(65_536);
        let raised = libc::rlimit {
            rlim_cur: want,
            rlim_max: want,
        };
        if libc::setrlimit(libc::RLIMIT_NOFILE, &raised) != 0 {
            r.rlim_cur = r.rlim_max;
            libc::setrlimit(libc::RLIMIT_NOFILE, &r);
        }
    }
}

fn quantiles(mut v: Vec<f64>) -> (f64, f64, f64) {
    v.sort_by(f64::total_cmp);
    let q = |p: f64| {
        v.get(((v.len() as f64 - 1.0) * p) as usize)
            .copied()
            .unwrap_or(0.0)
    };
    (q(0.5), q(0.99), q(1.0))
}

/// Sleep as many milliseconds as the environment variable `var` says.
fn pause(var: &str) {
    if let Some(ms) = std::env::var(var).ok().and_then(|v| v.parse().ok()) {
        std::thread::sleep(std::time::Duration::from_millis(ms));
    }
}

/// Hold `n` connections at once, each checked, then close them all.
fn many(port: u16, n: usize, bytes: u64) {
    raise_fd_limit();
    let before = own_counts();
    let mut conns = Vec::with_capacity(n);
    let mut connect_us = Vec::with_capacity(n);
    let t0 = Instant::now();
    for i in 0..n {
        let t = Instant::now();
        let s = TcpStream::connect(("127.0.0.1", port))
            .unwrap_or_else(|e| die(format!("connect {i}: {e}")));
        connect_us.push(t.elapsed().as_secs_f64() * 1e6);
        conns.push(s);
    }
    let connect_all = t0.elapsed();
    // A pause between the phases (for profiling one phase alone).
    pause("ECHO_PAUSE_MS");
    let t_exchange = Instant::now();
    let mut exchange_us = Vec::with_capacity(n);
    for (i, s) in conns.iter().enumerate() {
        let t = Instant::now();
        exchange(s, bytes).unwrap_or_else(|e| die(format!("connection {i}: {e}")));
        exchange_us.push(t.elapsed().as_secs_f64() * 1e6);
    }
    let exchange_all = t_exchange.elapsed();
    pause("ECHO_CLOSE_PAUSE_MS");
    let during = own_counts();
    let t1 = Instant::now();
    let mut close_us = Vec::with_capacity(n);
    for s in conns {
        let t = Instant::now();
        drop(s);
        close_us.push(t.elapsed().as_secs_f64() * 1e6);
    }
    let close_all = t1.elapsed();
    let total = t0.elapsed();
    let (c50, c99, cmax) = quantiles(connect_us);
    let (d50, d99, dmax) = quantiles(close_us);
    let (e50, e99, emax) = quantiles(exchange_us);
    let per = |a: u64, b: u64| (b as f64 - a as f64) / n as f64;
    println!(
        "{{\"ok\":true,\"connections\":{n},\"total_ms\":{:.1},\"connect_all_ms\":{:.1},\"connect_us\":[{c50:.0},{c99:.0},{cmax:.0}],\
         \"exchange_all_ms\":{:.1},\"exchange_us\":[{e50:.0},{e99:.0},{emax:.0}],\
         \"close_all_ms\":{:.1},\"close_us\":[{d50:.0},{d99:.0},{dmax:.0}],\
         \"rss_kb_per_conn\":{:.1},\"threads_per_conn\":{:.2},\"fds_per_conn\":{:.2},\
         \"rss_kb\":{},\"threads\":{},\"fds\":{}}}",
        total.as_secs_f64() * 1e3,
        connect_all.as_secs_f64() * 1e3,
        exchange_all.as_secs_f64() * 1e3,
        close_all.as_secs_f64() * 1e3,
        per(before.0, during.0),
        per(before.1, during.1),
        per(before.2, during.2),
        during.0,
        during.1,
        during.2,
    );
}

/// `n` connections one after another, each checked.
fn cycle(port: u16, n: usize, bytes: u64) {
    let t0 = Instant::now();
    let mut connect_us = Vec::with_capacity(n);
    for i in 0..n {
        let t = Instant::now();
        let s = TcpStream::connect(("127.0.0.1", port))
            .unwrap_or_else(|e| die(format!("connect {i}: {e}")));
        connect_us.push(t.elapsed().as_secs_f64() * 1e6);
        exchange(&s, bytes).unwrap_or_else(|e| die(format!("connection {i}: {e}")));
    }
    let (c50, c99, cmax) = quantiles(connect_us);
    let after = own_counts();
    println!(
        "{{\"ok\":true,\"connections\":{n},\"total_ms\":{:.1},\"connect_us\":[{c50:.0},{c99:.0},{cmax:.0}],\
         \"rss_kb\":{},\"threads\":{},\"fds\":{}}}",
        t0.elapsed().as_secs_f64() * 1e3,
        after.0,
        after.1,
        after.2
    );
}

/// One connection's unsent echo.
struct Client {
    s: TcpStream,
    pending: Vec<u8>,
}

fn listen(port: u16) -> std::net::TcpListener {
    raise_fd_limit();
    let addr: SocketAddr = ([127, 0, 0, 1], port).into();
    let l = std::net::TcpListener::bind(addr).unwrap_or_else(|e| die(format!("bind: {e}")));
    // A deep backlog, as real servers ask (nginx and redis 511): with
    // std's 128, a client connecting in a tight loop overflows it whenever
    // the server's vCPU stalls, and each dropped SYN costs a second.
    // SAFETY: listen on our own bound socket.
    unsafe { libc::listen(l.as_raw_fd(), 4096) };
    l
}

/// An epoll echo server (non-blocking sockets, level-triggered), single
/// threaded, as event-driven servers are (redis, nginx's worker).
fn serve(port: u16) {
    let l = listen(port);
    let secret = secret_page();
    ready(&secret);
    serve_epoll(&l, &secret);
}

/// A thread per connection, each blocking in read and write, as a classic
/// threaded server is (MySQL's default, Java's old I/O).
fn serve_threads(port: u16) {
    let l = listen(port);
    let secret = secret_page();
    ready(&secret);
    loop {
        let s = match l.accept() {
            Ok((s, _)) => s,
            Err(e) if e.raw_os_error() == Some(libc::EMFILE) => {
                std::thread::sleep(Duration::from_millis(10));
                continue;
            }
            Err(_) => continue,
        };
        // (Small stacks: ten thousand threads.)
        let spawned = std::thread::Builder::new()
            .stack_size(256 << 10)
            .spawn(move || {
                let mut buf = vec![0u8; 16 << 10];
                loop {
                    match (&s).read(&mut buf) {
                        Ok(0) | Err(_) => return,
                        Ok(k) => {
                            if (&s).write_all(&buf[..k]).is_err() {
                                return;
                            }
                        }
                    }
                }
            });
        if let Err(e) = spawned {
            die(format!("thread: {e}"));
        }
        std::hint::black_box(&secret);
    }
}

/// `workers` processes forked after the listener is bound, each an epoll
/// server accepting on it, as nginx's workers or a pre-fork gunicorn's
/// are. The parent only waits; its workers die with it.
fn serve_prefork(port: u16, workers: usize) {
    let l = listen(port);
    let secret = secret_page();
    for _ in 0..workers.max(1) {
        // SAFETY: fork from a single-threaded process; the child runs its
        // own loop and never returns here.
        match unsafe { libc::fork() } {
            0 => {
                // SAFETY: prctl on ourselves, a signal number.
                unsafe { libc::prctl(libc::PR_SET_PDEATHSIG, libc::SIGKILL) };
                serve_epoll(&l, &secret);
            }
            pid if pid < 0 => die("fork".into()),
            _ => {}
        }
    }
    ready(&secret);
    loop {
        let mut status = 0;
        // SAFETY: wait for any child, into our own status word.
        let pid = unsafe { libc::wait(&mut status) };
        if pid > 0 {
            die(format!("worker {pid} ended (status {status:#x})"));
        }
        if std::io::Error::last_os_error().raw_os_error() != Some(libc::EINTR) {
            die("no workers left".into());
        }
    }
}

/// The event loop of [`serve`] and of each pre-forked worker: `l` becomes
/// non-blocking; a worker that loses the race for a connection (another
/// took it) sees `WouldBlock` and goes on.
fn serve_epoll(l: &std::net::TcpListener, secret: &[u8]) -> ! {
    l.set_nonblocking(true).expect("nonblocking");
    // SAFETY: epoll_create1 with no flags of note.
    let ep = unsafe { libc::epoll_create1(libc::EPOLL_CLOEXEC) };
    if ep < 0 {
        die("epoll_create1".into());
    }
    let add = |fd: i32, events: u32| {
        let mut ev = libc::epoll_event {
            events,
            u64: fd as u64,
        };
        // SAFETY: epoll_ctl on our own epoll and socket.
        unsafe { libc::epoll_ctl(ep, libc::EPOLL_CTL_ADD, fd, &mut ev) };
    };
    let modify = |fd: i32, events: u32| {
        let mut ev = libc::epoll_event {
            events,
            u64: fd as u64,
        };
        // SAFETY: as above.
        unsafe { libc::epoll_ctl(ep, libc::EPOLL_CTL_MOD, fd, &mut ev) };
    };
    add(l.as_raw_fd(), libc::EPOLLIN as u32);
    let mut clients: std::collections::HashMap<i32, Client> = Default::default();
    let mut events = vec![libc::epoll_event { events: 0, u64: 0 }; 256];
    let mut buf = vec![0u8; 256 << 10];
    loop {
        // SAFETY: epoll_wait into our own buffer of events.
        let n = unsafe { libc::epoll_wait(ep, events.as_mut_ptr(), events.len() as i32, 1000) };
        if n < 0 {
            if std::io::Error::last_os_error().kind() == std::io::ErrorKind::Interrupted {
                continue;
            }
            die("epoll_wait".into());
        }
        for ev in &events[..n as usize] {
            let fd = ev.u64 as i32;
            if fd == l.as_raw_fd() {
                while let Ok((s, _)) = l.accept() {
                    s.set_nonblocking(true).expect("nonblocking");
                    let fd = s.as_raw_fd();
                    add(fd, libc::EPOLLIN as u32);
                    clients.insert(
                        fd,
                        Client {
                            s,
                            pending: Vec::new(),
                        },
                    );
                }
                continue;
            }
            let Some(c) = clients.get_mut(&fd) else {
                continue;
            };
            let mut gone = false;
            if c.pending.is_empty() {
                match (&c.s).read(&mut buf) {
                    Ok(0) => gone = true,
                    Ok(k) => c.pending.extend_from_slice(&buf[..k]),
                    Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => {}
                    Err(_) => gone = true,
                }
            }
            while !gone && !c.pending.is_empty() {
                match (&c.s).write(&c.pending) {
                    Ok(k) => {
                        c.pending.drain(..k);
                    }
                    Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => break,
                    Err(_) => gone = true,
                }
            }
            if gone {
                clients.remove(&fd);
            } else if c.pending.is_empty() {
                modify(fd, libc::EPOLLIN as u32);
            } else {
                modify(fd, libc::EPOLLOUT as u32);
            }
        }
        std::hint::black_box(secret);
    }
}
