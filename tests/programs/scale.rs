//! One process pair holds a thousand upgraded connections at once, each
//! checked end to end, then makes ten thousand more one after another.
//! (The figures, against kernel TCP, are `azsdp bench`'s "connections"
//! section; this test checks that it works, not how fast.)

use std::io::{BufRead, BufReader};
use std::process::Stdio;
use std::time::{Duration, Instant};

use crate::harness::*;
use crate::port;

/// The scale tests, one at a time, and apart from tests that a burst of
/// ten thousand connections (and threads) would break on kernel TCP as
/// well. Two scale tests at once, with the ten thousand in turn lingering
/// in TIME_WAIT, once ran out of ports in CI (`connect 9285: Cannot assign
/// requested address`, when the client still bound its sockets); python's
/// ForkingTCPServer, whose listen backlog is 5, loses connections to the
/// kernel's listen-queue overflow beside the thread-per-connection burst
/// and a CPU hog, on kernel TCP too (1 of 20 reset in one run by hand).
pub(crate) fn one_at_a_time() -> std::sync::MutexGuard<'static, ()> {
    static SCALE: std::sync::Mutex<()> = std::sync::Mutex::new(());
    SCALE.lock().unwrap_or_else(|e| e.into_inner())
}

fn fd_hard_limit() -> u64 {
    let mut r = libc::rlimit {
        rlim_cur: 0,
        rlim_max: 0,
    };
    // SAFETY: getrlimit into our own struct.
    unsafe { libc::getrlimit(libc::RLIMIT_NOFILE, &mut r) };
    r.rlim_max
}

/// Run `azsdp-echo args` under azsdp to its end; its JSON report.
fn client(s: &Scratch, name: &str, args: &[&str]) -> serde_json::Value {
    client_within(s, name, args, Duration::from_secs(300))
}

/// [`client`], given `within` to finish.
fn client_within(s: &Scratch, name: &str, args: &[&str], within: Duration) -> serde_json::Value {
    client_with(s, name, args, within, &[])
}

/// [`client_within`], with `env` set on top of the harness's.
fn client_with(
    s: &Scratch,
    name: &str,
    args: &[&str],
    within: Duration,
    env: &[(&str, &str)],
) -> serde_json::Value {
    let p = start_client(s, name, args, env);
    report_of(p, s, name, within)
}

/// `azsdp-echo args` under azsdp, started, with `env` set on top of the
/// harness's (its report comes from [`report_of`]).
fn start_client(s: &Scratch, name: &str, args: &[&str], env: &[(&str, &str)]) -> Proc {
    let echo = echo();
    let mut c = s.under_azsdp(name, echo.to_str().expect("path"), args);
    c.env("AZSDP_LOG_LEVEL", "info")
        .envs(env.iter().copied())
        .stdout(Stdio::piped());
    Proc::start(c, name)
}

/// The JSON report of a client [`start_client`] started, once it ended
/// well within `within`.
fn report_of(mut p: Proc, s: &Scratch, name: &str, within: Duration) -> serde_json::Value {
    let out = p.stdout();
    p.expect_success(within, || s.log(name));
    serde_json::from_str(out.trim()).unwrap_or_else(|e| panic!("{e}: {out}"))
}

/// The most `look` returned, looked at every `every` from now until
/// [`Sampler::most`].
struct Sampler {
    stop: std::sync::Arc<std::sync::atomic::AtomicBool>,
    thread: std::thread::JoinHandle<usize>,
}

impl Sampler {
    fn start(every: Duration, look: impl Fn() -> usize + Send + 'static) -> Sampler {
        let stop = std::sync::Arc::new(std::sync::atomic::AtomicBool::new(false));
        let thread = {
            let stop = std::sync::Arc::clone(&stop);
            std::thread::spawn(move || {
                let mut most = 0;
                while !stop.load(std::sync::atomic::Ordering::SeqCst) {
                    most = most.max(look());
                    std::thread::sleep(every);
                }
                most
            })
        };
        Sampler { stop, thread }
    }

    fn most(self) -> usize {
        self.stop.store(true, std::sync::atomic::Ordering::SeqCst);
        self.thread.join().expect("sampler")
    }
}

/// `azsdp-echo SHAPE PORT ARGS` under azsdp (`serve`: the epoll server),
/// ready, and warmed up by `warm` connections at once: what a process
/// opens once, on its first connection (its stat file and directory,
/// userfaultfd, the epoll set's eventfd, the reactor), is not counted per
/// connection. (A hundred reach every pre-forked worker.)
fn echo_server(s: &Scratch, shape: &[&str], port: &str, level: &str, warm: &str) -> Proc {
    let echo = echo();
    let args: Vec<&str> = [&[shape[0], port], &shape[1..]].concat();
    let mut srv = s.under_azsdp("server", echo.to_str().expect("path"), &args);
    srv.env("AZSDP_LOG_LEVEL", level).stdout(Stdio::piped());
    let mut srv = Proc::start(srv, "server");
    let mut line = String::new();
    BufReader::new(srv.child.stdout.as_mut().expect("stdout"))
        .read_line(&mut line)
        .expect("server ready");
    client(s, "warm-up", &["many", port, warm, "1000"]);
    std::thread::sleep(Duration::from_millis(500));
    srv
}

#[test]
fn a_thousand_connections_at_once_then_ten_thousand_one_after_another() {
    let _one = one_at_a_time();
    if fd_hard_limit() < 4096 {
        eprintln!("skipped: a thousand connections need 4096 descriptors");
        return;
    }
    let s = Scratch::new("scale");
    let p = port(82).to_string();
    let mut srv = echo_server(&s, &["serve"], &p, "info", "1");
    let base = family_fd_kinds(srv.pid());

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
    // (A listener that holds as many pending offers as its limits allow
    // refuses more: `listener-busy`, seen for 79 of 10,000 in one run.)
    assert_paired_or_lost(&log, 10000, 0, &["short-lived", "listener-busy"]);
    let upgraded = outcomes(&log).0;

    // Everything the server held for them is given back.
    assert_fds_given_back(srv.pid(), &base, Duration::from_secs(20));
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

/// A process passes its bell to a peer process once (docs/protocol.md
/// §10, "Bells"): of connections one after another between two
/// processes, the first pair's offer and answer carry the bells, and the
/// later ones only name them, both ways, and still pair. (With a bell in
/// every message, the kernel's Unix garbage collector ran 1.65 times per
/// connection in a burst of pairs.)
#[test]
fn bells_pass_once_per_pair_of_processes() {
    bells_pass_once_to(&["serve"], 187);
}

/// The same against pre-forked workers: the offers go to the registry of
/// the process that listens, and any worker answers, so a worker that
/// lacks the client's bell takes it from the client's process itself, and
/// the client takes the workers' (before, every pair passed both: 1.46
/// runs of the collector per connection).
#[test]
fn bells_pass_once_to_a_family_of_pre_forked_workers() {
    bells_pass_once_to(&["serve-prefork", "4"], 188);
}

fn bells_pass_once_to(shape: &[&str], port_offset: u16) {
    let _one = one_at_a_time();
    let s = Scratch::new("bells-once");
    let p = port(port_offset).to_string();
    let mut srv = echo_server(&s, shape, &p, "debug", "1");
    let n = 40;
    let cycle = client(&s, "cycle", &["cycle", &p, &n.to_string(), "262144"]);
    assert_eq!(cycle["connections"], n);
    let log = s.log("server");
    let named = log.matches("named, ours named").count();
    let passed = log.matches("'s passed, ours passed").count();
    let one_way = log.matches("bells: pid").count() - named - passed;
    eprintln!("bells: {named} pairs named both, {passed} passed both, {one_way} passed one");
    // The warm-up client's pair and the first of these pass both; a later
    // pair whose offer went before the answer to the one ahead of it was
    // taken in passes its bell again (on a loaded host, now and then).
    assert!(
        named * 4 >= n * 3 && passed + one_way + named >= n,
        "of {n} pairs (and the warm-up's), {named} named both bells, \
         {passed} passed both, {one_way} passed one"
    );
    let client_log = s.log("cycle");
    // Every connection pairs, but one that a loaded host let end before
    // its pair completed, which stays TCP as it should (2 runs in 10
    // beside two spinning shells, before and after 2026-11-30).
    let paired = client_log.matches(": azsdp (fabric shm, peer pid").count();
    let short = client_log.matches(": tcp (short-lived)").count();
    let other: Vec<&str> = client_log
        .lines()
        .filter(|l| {
            !l.contains(": azsdp (fabric shm, peer pid") && !l.contains("joined the fabric")
        })
        .collect();
    assert!(
        paired + short == n && paired * 4 >= n * 3,
        "{paired} of {n} connections paired, {short} ended first; \
         the client's other lines: {other:#?}"
    );
    srv.kill();
}

/// A client starts its engine when the listener's answer comes, and the
/// listener's HELLO_ACK waits in the ring for the client's first call: a
/// connection whose first send comes after the listener looked at it
/// (here a pause between the connects and the exchanges) sends it on the
/// fabric, and so does the listener's answer to it. (The engine started
/// at the first call, and every first send went over TCP, while the
/// handshake's rings ran beside it.) Every byte is checked by
/// `azsdp-echo many`.
///
/// The client's receive, asleep while the listener answers, is woken by
/// the listener's post alone: the client's reactor is not rung for it
/// (`rung`, counted while the client holds its connections after the
/// exchanges). It was rung about once per connection as well, two
/// wake-ups per answer where TCP makes one.
#[test]
fn a_first_send_goes_on_the_fabric_to_an_epoll_server() {
    first_sends_on_the_fabric(&["serve"], 189);
}

/// The same against a thread per connection, whose thread looks at the
/// connection as it blocks in its first receive.
#[test]
fn a_first_send_goes_on_the_fabric_to_a_thread_per_connection() {
    first_sends_on_the_fabric(&["serve-threads"], 191);
}

fn first_sends_on_the_fabric(shape: &[&str], port_offset: u16) {
    let _one = one_at_a_time();
    let s = Scratch::new("first-sends");
    let p = port(port_offset).to_string();
    let mut srv = echo_server(&s, shape, &p, "info", "1");
    let n = 40;
    let mut cli = start_client(
        &s,
        "many",
        &["many", &p, &n.to_string(), "1024"],
        &[("ECHO_PAUSE_MS", "1000"), ("ECHO_CLOSE_PAUSE_MS", "3000")],
    );
    // The client's connections once every exchange is over (the stats
    // thread publishes ten times a second), before they close.
    let deadline = Instant::now() + Duration::from_secs(60);
    let exchanged = loop {
        let done: Vec<serde_json::Value> = s
            .stat()
            .into_iter()
            .filter(|c| c["role"] == "client" && c["bytes"]["received"]["bsdp"] == 1024)
            .collect();
        if done.len() == n {
            break done;
        }
        assert!(
            Instant::now() < deadline && cli.wait(Duration::ZERO).is_none(),
            "{} of {n} exchanges seen: {}",
            done.len(),
            s.log("many")
        );
        std::thread::sleep(Duration::from_millis(50));
    };
    let rung: u64 = exchanged.iter().filter_map(|c| c["rung"].as_u64()).sum();
    let many = report_of(cli, &s, "many", Duration::from_secs(120));
    assert_eq!(many["connections"], n, "{many}");
    assert!(
        rung * 4 <= n as u64,
        "the client's reactor was rung {rung} times for {n} first exchanges"
    );
    let client_log = s.log("many");
    let server_log = s.log("server");
    let client_joined = client_log
        .matches("joined the fabric after 0 bytes")
        .count();
    assert_eq!(
        client_log
            .matches("after 0 bytes sent and 0 taken on TCP")
            .count(),
        n,
        "every connection pairs, with nothing on TCP before its pair completed:\n{}",
        &client_log[..client_log.len().min(4000)]
    );
    // (The warm-up client's connection is the server's too.)
    let server_joined = server_log
        .matches("joined the fabric after 0 bytes")
        .count();
    assert!(
        client_joined == n && server_joined >= n,
        "of {n} connections, the client sent {client_joined} first sends on the fabric, \
         the server {server_joined} answers:\n{}\n{}",
        &client_log[..client_log.len().min(3000)],
        &server_log[..server_log.len().min(3000)]
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
    let _one = one_at_a_time();
    const N: usize = 10_000;
    // A connection holds no descriptor of its own beyond the program's
    // socket (the bell, the peer's pidfd and its bell are per process).
    if fd_hard_limit() < N as u64 + 2000 {
        eprintln!("skipped: {N} connections need {} descriptors", N + 2000);
        return;
    }
    let s = Scratch::new("scale10k");
    let p = port(83).to_string();
    let mut srv = echo_server(&s, &["serve"], &p, "warn", "1");
    let server_base = threads_of(srv.pid());

    // The server's threads, sampled while the client holds its connections.
    let pid = srv.pid();
    let watch = Sampler::start(Duration::from_millis(50), move || threads_of(pid));
    let n = N.to_string();
    let many = client_within(
        &s,
        "many",
        &["many", &p, &n, "1024"],
        Duration::from_secs(600),
    );
    let server_most = watch.most();
    eprintln!("{N} at once: {many}; server threads {server_base} -> at most {server_most}");
    assert_eq!(many["connections"], N);
    let log = s.log("many");
    // On a loaded host some may stay on TCP: a pair waits at most
    // `pair_timeout` (5 s in these tests) for the server's accept(), which a
    // single-threaded server behind ten thousand others and other load
    // can take longer to make, or its offer may still be queued behind
    // others when accept() looks. Those say so; no other reason may show.
    assert_paired_or_lost(&log, N, N / 2, LOST_UNDER_LOAD);
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

/// Why a pair may be lost on a loaded host (the connection stays on TCP,
/// whole): it timed out, its offer was not in when accept() looked (or a
/// sibling held it), the listener already held as many offers as its
/// limits allow, or the client closed before it completed.
const LOST_UNDER_LOAD: &[&str] = &[
    "pair-timeout",
    "peer-not-azsdp",
    "listener-busy",
    "short-lived",
];

/// How many connections the client's log says were upgraded, and how many
/// stayed on TCP by each reason.
fn outcomes(log: &str) -> (usize, std::collections::BTreeMap<String, usize>) {
    let upgraded = log.matches(": azsdp (fabric shm, peer pid").count();
    let mut tcp = std::collections::BTreeMap::new();
    for l in log.lines() {
        if let Some(r) = l.split(": tcp (").nth(1).and_then(|r| r.split(')').next()) {
            *tcp.entry(r.to_string()).or_insert(0) += 1;
        }
    }
    (upgraded, tcp)
}

/// Every one of `n` connections was upgraded or lost its pair in a way a
/// loaded host may cause (`lost`), and at least `least` were upgraded.
fn assert_paired_or_lost(log: &str, n: usize, least: usize, lost: &[&str]) {
    let (upgraded, tcp) = outcomes(log);
    let lost_n: usize = tcp
        .iter()
        .filter(|(r, _)| lost.contains(&r.as_str()))
        .map(|(_, k)| k)
        .sum();
    assert_eq!(upgraded + lost_n, n, "{upgraded} upgraded; on TCP: {tcp:?}");
    assert!(
        upgraded >= least,
        "only {upgraded} of {n} upgraded; on TCP: {tcp:?}"
    );
}

/// The processes of the server `pid`: itself and its children (the
/// pre-forked workers).
fn family_of(pid: i32) -> Vec<i32> {
    let kids =
        std::fs::read_to_string(format!("/proc/{pid}/task/{pid}/children")).unwrap_or_default();
    std::iter::once(pid)
        .chain(kids.split_whitespace().filter_map(|k| k.parse().ok()))
        .collect()
}

/// What the descriptors of `pid` and its children are ("socket:[…]",
/// "anon_inode:[eventfd]", paths), with the process that holds each,
/// sorted.
fn family_fd_kinds(pid: i32) -> Vec<(i32, String)> {
    let mut v: Vec<(i32, String)> = family_of(pid)
        .into_iter()
        .flat_map(|p| {
            std::fs::read_dir(format!("/proc/{p}/fd"))
                .into_iter()
                .flatten()
                .flatten()
                .filter_map(|e| std::fs::read_link(e.path()).ok())
                .map(move |t| (p, t.to_string_lossy().into_owned()))
        })
        .collect();
    v.sort();
    v
}

/// The descriptors azsdp's runtime opens in a process at its first
/// connection and keeps for the process's life: its stat file, the
/// reactor's epoll set, eventfd and bell (a socket pair), the userfaultfd.
const RUNTIME_FDS: [&str; 6] = [
    "-stat",
    "anon_inode:[eventpoll]",
    "anon_inode:[eventfd]",
    "anon_inode:[userfaultfd]",
    "socket:",
    "socket:",
];

/// What `now` holds beyond `base`, and how many of those are the runtime
/// of a process whose first connection came after `base` (a pre-forked
/// worker that the warm-up's connections missed, as on a loaded host).
fn fds_beyond(base: &[(i32, String)], now: &[(i32, String)]) -> (Vec<(i32, String)>, usize) {
    let mut extra = now.to_vec();
    for b in base {
        if let Some(i) = extra.iter().position(|x| x == b) {
            extra.remove(i);
        }
    }
    let is_stat = |k: &str| k.ends_with("-stat");
    let started: Vec<i32> = extra
        .iter()
        .filter(|(p, k)| is_stat(k) && !base.iter().any(|(bp, bk)| bp == p && is_stat(bk)))
        .map(|(p, _)| *p)
        .collect();
    let mut runtime = 0;
    for p in started {
        for kind in RUNTIME_FDS {
            let found = extra.iter().position(|(xp, k)| {
                *xp == p
                    && if kind == "-stat" {
                        is_stat(k)
                    } else {
                        k.starts_with(kind)
                    }
            });
            if let Some(i) = found {
                extra.remove(i);
                runtime += 1;
            }
        }
    }
    (extra, runtime)
}

/// A worker whose first connection came during a test holds its runtime
/// after it, which is not a leak; one more descriptor is.
#[test]
fn a_runtime_started_during_a_test_is_not_a_leak() {
    let own = |p: i32, k: &str| (p, k.to_string());
    let base = vec![
        own(1, "/dev/shm/x-stat"),
        own(1, "socket:[1]"),
        own(2, "socket:[1]"),
    ];
    let mut now = base.clone();
    now.extend([
        own(2, "/dev/shm/x-stat"),
        own(2, "anon_inode:[eventpoll]"),
        own(2, "anon_inode:[eventfd]"),
        own(2, "anon_inode:[userfaultfd]"),
        own(2, "socket:[7]"),
        own(2, "socket:[8]"),
    ]);
    assert_eq!(fds_beyond(&base, &now).1, 6);
    assert!(fds_beyond(&base, &now).0.is_empty());
    now.push(own(2, "anon_inode:[eventfd]"));
    assert_eq!(
        fds_beyond(&base, &now),
        (vec![own(2, "anon_inode:[eventfd]")], 6)
    );
    // A process that had its runtime before gets no allowance.
    now.push(own(1, "anon_inode:[eventfd]"));
    assert_eq!(fds_beyond(&base, &now).0.len(), 2);
}

/// Within `within`, the server `pid` and its children hold no more
/// descriptors than they did when `base` was taken
/// ([`family_fd_kinds`], [`fds_beyond`]); on failure, what they hold
/// beyond it.
fn assert_fds_given_back(pid: i32, base: &[(i32, String)], within: Duration) {
    // (A process opens its own /proc/PID/maps once, at its first check of
    // a buffer against the kernel's mappings, and keeps it: not a
    // connection's.)
    let own_maps = |v: Vec<(i32, String)>| -> Vec<(i32, String)> {
        v.into_iter()
            .filter(|(_, k)| !(k.starts_with("/proc/") && k.ends_with("/maps")))
            .collect()
    };
    let base = own_maps(base.to_vec());
    let deadline = Instant::now() + within;
    let look = || {
        let now = own_maps(family_fd_kinds(pid));
        let (extra, runtime) = fds_beyond(&base, &now);
        (now.len() - runtime, extra)
    };
    let (mut held, mut extra) = look();
    while held > base.len() && Instant::now() < deadline {
        std::thread::sleep(Duration::from_millis(100));
        (held, extra) = look();
    }
    assert!(
        held <= base.len(),
        "the server's processes hold {held} descriptors, {} before; beyond those: {extra:?}",
        base.len()
    );
}

/// `n` connections held at once by one client against `shape`
/// (an `azsdp-echo` server mode and its arguments), each echoed back and
/// checked byte for byte; the client holds one descriptor per connection,
/// and the server's processes give back every descriptor once the client
/// closed them all. Returns the client's log and report.
fn many_against(
    shape: &str,
    args: &[&str],
    offset: u16,
    one_fd_each: bool,
    n: usize,
) -> (String, serde_json::Value) {
    let s = Scratch::new(&format!("scale-{shape}"));
    let p = port(offset).to_string();
    let mut srv = echo_server(&s, &[&[shape], args].concat(), &p, "warn", "100");
    let base = family_fd_kinds(srv.pid());
    // The server's descriptors, sampled while the client holds its
    // connections (a thread blocked on its connection once held an
    // eventfd as well, for the rest of its life).
    let pid = srv.pid();
    let watch = Sampler::start(Duration::from_millis(20), move || {
        family_of(pid)
            .iter()
            .map(|p| std::fs::read_dir(format!("/proc/{p}/fd")).map_or(0, |d| d.count()))
            .sum()
    });
    let count = n.to_string();
    let many = client_within(
        &s,
        "many",
        &["many", &p, &count, "1024"],
        Duration::from_secs(600),
    );
    let most = watch.most();
    eprintln!(
        "{n} at once against {shape} {args:?}: {many}; server descriptors at most {most}, {} before",
        base.len()
    );
    // Its sockets, and offers waiting for their accept() (a few hundred
    // at most in a burst).
    assert!(
        most <= base.len() + n + n / 10 || !one_fd_each,
        "the server held {most} descriptors for {n} connections ({} before)",
        base.len()
    );
    assert_eq!(many["connections"], n);
    let fds_per_conn = many["fds_per_conn"].as_f64().expect("fds_per_conn");
    assert!(
        fds_per_conn < 1.01 || !one_fd_each,
        "the client held {fds_per_conn} descriptors per connection"
    );
    assert_fds_given_back(srv.pid(), &base, Duration::from_secs(30));
    srv.kill();
    (s.log("many"), many)
}

/// By default a client stops offering pairs to a destination whose
/// connections end before a pair could repay its cost (here each makes
/// one 1 KiB exchange and closes): after a run of them, most connections
/// stay on TCP without an offer (`not-worth-pairing`), a few still offer
/// (probes), and every echo is checked. With `pair_every_connection`
/// (which the other tests set), every connection offers.
#[test]
fn pair_history_stops_offers_to_short_lived_destinations() {
    let _one = one_at_a_time();
    let s = Scratch::new("pair-history");
    let p = port(84).to_string();
    let mut srv = echo_server(&s, &["serve"], &p, "info", "1");
    for every in [false, true] {
        let name = format!("cycle-{every}");
        let every_env = every.to_string();
        let out = client_with(
            &s,
            &name,
            &["cycle", &p, "400", "1024"],
            Duration::from_secs(300),
            &[("AZSDP_PAIR_EVERY_CONNECTION", &every_env)],
        );
        eprintln!("400 in turn (pair every connection: {every}): {out}");
        let log = s.log(&name);
        let (upgraded, tcp) = outcomes(&log);
        let skipped = tcp.get("not-worth-pairing").copied().unwrap_or(0);
        let offered = 400 - skipped;
        eprintln!("{offered} offered ({upgraded} upgraded), {skipped} not; on TCP: {tcp:?}");
        if every {
            assert_eq!(skipped, 0, "{tcp:?}");
        } else {
            // (On a quiet host 8 + 392/16, about 32, offer; a connection
            // slowed past 20 ms by a loaded host repays and starts over.)
            assert!(
                skipped >= 200 && offered >= azsdp::pair_history::SHORT_STREAK as usize,
                "{offered} offered, {skipped} not: {tcp:?}"
            );
        }
    }
    srv.kill();
}

/// A thread-per-connection server: ten thousand threads, each blocked on
/// its own connection. Each one's wake-ups are its connection's alone
/// (ringing every sleeper of the process for every message made this
/// shape crawl at 2,000 connections, at a load average of 200), and a
/// thread waiting for its client's first bytes holds no descriptor (each
/// once held an eventfd: 20,000 descriptors, and the run stalled at
/// connection 9,994 against a limit of 20,000).
#[test]
fn ten_thousand_connections_at_once_against_a_thread_per_connection_server() {
    let _one = one_at_a_time();
    if fd_hard_limit() < 12_000 {
        eprintln!("skipped: ten thousand connections need 12000 descriptors");
        return;
    }
    let (log, _) = many_against("serve-threads", &[], 148, true, 10_000);
    // (As in the epoll test: on a loaded host some pairs are lost.)
    assert_paired_or_lost(&log, 10_000, 2_500, LOST_UNDER_LOAD);
}

/// Pre-forked workers, each an epoll server accepting on the one listener.
/// Every connection completes and is checked. Not every one is upgraded:
/// a worker may take in the offer of a connection that its sibling
/// accepts, which then stays on TCP (docs/shim.md, "Process models"); a
/// reason is logged for each.
#[test]
fn ten_thousand_connections_at_once_against_pre_forked_workers() {
    let _one = one_at_a_time();
    if fd_hard_limit() < 12_000 {
        eprintln!("skipped: ten thousand connections need 12000 descriptors");
        return;
    }
    // (Nor does every connection hold one descriptor in the client: a pair
    // whose offer a sibling holds keeps its registry socket until that
    // sibling closes the offer.)
    let (log, _) = many_against("serve-prefork", &["4"], 149, false, 10_000);
    assert_paired_or_lost(&log, 10_000, 2_500, LOST_UNDER_LOAD);
}
