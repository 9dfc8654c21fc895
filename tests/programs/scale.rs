//! One process pair holds a thousand upgraded connections at once, each
//! checked end to end, then makes ten thousand more one after another.
//! (The figures, against kernel TCP, are `azsdp bench`'s "connections"
//! section; this test checks that it works, not how fast.)

use std::io::{BufRead, BufReader};
use std::process::Stdio;
use std::time::{Duration, Instant};

use crate::harness::*;
use crate::port;

fn fd_hard_limit() -> u64 {
    let mut r = libc::rlimit {
        rlim_cur: 0,
        rlim_max: 0,
    };
    // SAFETY: getrlimit into our own struct.
    unsafe { libc::getrlimit(libc::RLIMIT_NOFILE, &mut r) };
    r.rlim_max
}

fn fds_of(pid: i32) -> usize {
    std::fs::read_dir(format!("/proc/{pid}/fd")).map_or(0, |d| d.count())
}

/// Run `azsdp-echo args` under azsdp to its end; its JSON report.
fn client(s: &Scratch, name: &str, args: &[&str]) -> serde_json::Value {
    let echo = echo();
    let mut c = s.under_azsdp(name, echo.to_str().expect("path"), args);
    c.env("AZSDP_LOG_LEVEL", "info").stdout(Stdio::piped());
    let mut p = Proc::start(c, name);
    let out = p.stdout();
    p.expect_success(Duration::from_secs(300), || s.log(name));
    serde_json::from_str(out.trim()).unwrap_or_else(|e| panic!("{e}: {out}"))
}

/// `azsdp-echo serve` under azsdp on `port`, ready, and warmed up by one
/// connection: what it opens once, on its first connection (its stat file
/// and directory, userfaultfd, the epoll set's eventfd, the reactor), is
/// not counted per connection.
fn echo_server(s: &Scratch, port: &str, level: &str) -> Proc {
    let echo = echo();
    let mut srv = s.under_azsdp("server", echo.to_str().expect("path"), &["serve", port]);
    srv.env("AZSDP_LOG_LEVEL", level).stdout(Stdio::piped());
    let mut srv = Proc::start(srv, "server");
    let mut line = String::new();
    BufReader::new(srv.child.stdout.as_mut().expect("stdout"))
        .read_line(&mut line)
        .expect("server ready");
    client(s, "warm-up", &["send", port, "1000"]);
    std::thread::sleep(Duration::from_millis(500));
    srv
}

#[test]
fn a_thousand_connections_at_once_then_ten_thousand_one_after_another() {
    if fd_hard_limit() < 4096 {
        eprintln!("skipped: a thousand connections need 4096 descriptors");
        return;
    }
    let s = Scratch::new("scale");
    let p = port(82).to_string();
    let mut srv = echo_server(&s, &p, "info");
    let base = fds_of(srv.pid());

    let many = client(&s, "many", &["many", &p, "1000", "4096"]);
    eprintln!("1000 at once: {many}");
    assert_eq!(many["connections"], 1000);
    let log = s.log("many");
    assert_eq!(
        log.matches(": azsdp (fabric shm, peer pid").count(),
        1000,
        "{}",
        &log[..log.len().min(4000)]
    );
    assert!(!log.contains(": tcp ("), "a connection stayed on TCP");

    let t0 = Instant::now();
    let cycle = client(&s, "cycle", &["cycle", &p, "10000", "1024"]);
    eprintln!("10000 in turn ({:?}): {cycle}", t0.elapsed());
    let log = s.log("cycle");
    // A connection that makes one exchange and closes is over before its
    // pair could complete (at a call after the listener's answer): it stays
    // on TCP, as it should, and says why; one the pair caught in time
    // joins.
    let upgraded = log.matches(": azsdp (fabric shm, peer pid").count();
    let short = log.matches(": tcp (short-lived)").count();
    assert_eq!(
        upgraded + short,
        10000,
        "{upgraded} upgraded, {short} short-lived"
    );
    assert_eq!(log.matches(": tcp (").count(), short, "another reason");

    // Everything the server held for them is given back.
    let deadline = Instant::now() + Duration::from_secs(20);
    while fds_of(srv.pid()) > base && Instant::now() < deadline {
        std::thread::sleep(Duration::from_millis(100));
    }
    assert!(
        fds_of(srv.pid()) <= base,
        "the server holds {} descriptors, {base} before",
        fds_of(srv.pid())
    );
    // (The listener commits to each pair it answers; a client that ended
    // first abandons it, and that side stays on TCP too.)
    let server_log = s.log("server");
    let committed = server_log.matches(": azsdp (fabric shm, peer pid").count();
    assert!(
        (1001 + upgraded..=11001).contains(&committed),
        "the server committed to {committed} pairs, {upgraded} of the 10000 upgraded"
    );
    srv.kill();
}

/// Threads of process `pid` now.
fn threads_of(pid: i32) -> usize {
    std::fs::read_to_string(format!("/proc/{pid}/status"))
        .ok()
        .and_then(|s| {
            s.lines()
                .find_map(|l| l.strip_prefix("Threads:"))
                .and_then(|v| v.trim().parse().ok())
        })
        .unwrap_or(0)
}

/// Ten thousand upgraded connections held at once by one client process
/// and one server process, each checked end to end: neither process gains
/// a thread per connection (one reactor drives them all, the userfaultfd
/// dispatcher takes every fault), nor a descriptor beyond the socket.
#[test]
fn ten_thousand_connections_at_once_on_a_fixed_number_of_threads() {
    const N: usize = 10_000;
    // A connection holds no descriptor of its own beyond the program's
    // socket (the bell, the peer's pidfd and its bell are per process).
    if fd_hard_limit() < N as u64 + 2000 {
        eprintln!("skipped: {N} connections need {} descriptors", N + 2000);
        return;
    }
    let s = Scratch::new("scale10k");
    let p = port(83).to_string();
    let echo = echo();
    let mut srv = echo_server(&s, &p, "warn");
    let server_base = threads_of(srv.pid());

    // The server's threads, sampled while the client holds its connections.
    let stop = std::sync::Arc::new(std::sync::atomic::AtomicBool::new(false));
    let pid = srv.pid();
    let watch = {
        let stop = std::sync::Arc::clone(&stop);
        std::thread::spawn(move || {
            let mut most = 0;
            while !stop.load(std::sync::atomic::Ordering::SeqCst) {
                most = most.max(threads_of(pid));
                std::thread::sleep(Duration::from_millis(50));
            }
            most
        })
    };
    let echo_s = echo.to_str().expect("path").to_string();
    let n = N.to_string();
    let mut c = s.under_azsdp("many", &echo_s, &["many", &p, &n, "1024"]);
    c.env("AZSDP_LOG_LEVEL", "info").stdout(Stdio::piped());
    let mut cp = Proc::start(c, "many");
    let out = cp.stdout();
    cp.expect_success(Duration::from_secs(600), || s.log("many"));
    stop.store(true, std::sync::atomic::Ordering::SeqCst);
    let server_most = watch.join().expect("watcher");
    let many: serde_json::Value =
        serde_json::from_str(out.trim()).unwrap_or_else(|e| panic!("{e}: {out}"));
    eprintln!("{N} at once: {many}; server threads {server_base} -> at most {server_most}");
    assert_eq!(many["connections"], N);
    let log = s.log("many");
    // On a loaded host a few may stay on TCP: a connect waits at most
    // `pair_timeout` (5 s in these tests) for the server's accept(), which a
    // single-threaded server behind ten thousand others and other load
    // can take longer to make (kernel TCP would not wait for it at all).
    let upgraded = log.matches(": azsdp (fabric shm, peer pid").count();
    let slowest_connect_us = many["connect_us"][2].as_f64().expect("connect_us");
    assert!(
        upgraded == N || (upgraded >= N - N / 100 && slowest_connect_us >= 4_500_000.0),
        "{upgraded} of {N} upgraded, the slowest connect took {slowest_connect_us} us"
    );
    assert!(!log.contains(": tcp ("), "a connection stayed on TCP");
    // The client started with one thread; azsdp's are the reactor and the
    // fault dispatcher (and the shim's stats publisher).
    let client_threads = many["threads"].as_u64().expect("threads");
    assert!(
        client_threads <= 5,
        "the client ran {client_threads} threads for {N} connections"
    );
    let fds_per_conn = many["fds_per_conn"].as_f64().expect("fds_per_conn");
    assert!(
        fds_per_conn < 1.01,
        "the client held {fds_per_conn} descriptors per connection"
    );
    assert!(
        server_most <= server_base + 1,
        "the server went from {server_base} to {server_most} threads for {N} connections"
    );
    srv.kill();
}
