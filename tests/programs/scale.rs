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

#[test]
fn a_thousand_connections_at_once_then_ten_thousand_one_after_another() {
    if fd_hard_limit() < 4096 {
        eprintln!("skipped: a thousand connections need 4096 descriptors");
        return;
    }
    let s = Scratch::new("scale");
    let p = port(82).to_string();
    let echo = echo();
    let mut srv = s.under_azsdp("server", echo.to_str().expect("path"), &["serve", &p]);
    srv.env("AZSDP_LOG_LEVEL", "info").stdout(Stdio::piped());
    let mut srv = Proc::start(srv, "server");
    let mut line = String::new();
    BufReader::new(srv.child.stdout.as_mut().expect("stdout"))
        .read_line(&mut line)
        .expect("server ready");
    // What the server opens once, on its first connection (its stat file
    // and directory, userfaultfd, the epoll set's eventfd), is not per
    // connection.
    client(&s, "warm-up", &["send", &p, "1000"]);
    std::thread::sleep(Duration::from_millis(500));
    let base = fds_of(srv.pid());

    let many = client(&s, "many", &["many", &p, "1000", "4096"]);
    eprintln!("1000 at once: {many}");
    assert_eq!(many["connections"], 1000);
    let log = s.log("many");
    assert_eq!(
        log.matches(": azsdp (peer pid").count(),
        1000,
        "{}",
        &log[..log.len().min(4000)]
    );
    assert!(!log.contains(": tcp ("), "a connection stayed on TCP");

    let t0 = Instant::now();
    let cycle = client(&s, "cycle", &["cycle", &p, "10000", "1024"]);
    eprintln!("10000 in turn ({:?}): {cycle}", t0.elapsed());
    let log = s.log("cycle");
    assert_eq!(log.matches(": azsdp (peer pid").count(), 10000);
    assert!(!log.contains(": tcp ("), "a connection stayed on TCP");

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
    let server_log = s.log("server");
    assert_eq!(server_log.matches(": azsdp (peer pid").count(), 11001);
    srv.kill();
}
