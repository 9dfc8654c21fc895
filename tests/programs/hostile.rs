//! A hostile local user against root servers and clients under azsdp.
//!
//! `azsdp-hostile` (built on the azsdp crate) plays the attacker, as uid
//! 65534 through `setpriv`, and, where GETs only happen between processes
//! of one user, as root too. The victims are `azsdp-echo` servers and
//! clients under `azsdp run`, holding a known secret in their heaps, and a
//! third root process not under azsdp that holds it too. Every test asserts
//! the attack failed: no byte of a secret reached the attacker, no
//! connection was hijacked, plain and azsdp clients were still served
//! within a second, and the victims' descriptors stayed bounded.

use std::io::{BufRead, BufReader, Read, Write};
use std::path::PathBuf;
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use crate::harness::*;
use crate::port;

const NOBODY: &str = "65534";

/// Can this run play another user? (Root can; otherwise the cross-user
/// tests say they were skipped.)
fn can_switch_user() -> bool {
    // SAFETY: plain system call.
    let root = unsafe { libc::geteuid() } == 0;
    if !root {
        eprintln!("skipped: playing another user needs root");
    }
    root
}

/// The attacker's and the victim's programs, copied where uid 65534 may
/// run them (the build directory may sit under a private home).
fn tools() -> (PathBuf, PathBuf) {
    static DIR: std::sync::OnceLock<PathBuf> = std::sync::OnceLock::new();
    let dir = DIR.get_or_init(|| {
        use std::os::unix::fs::PermissionsExt;
        // A static is never dropped: the copies of earlier runs (tens of
        // MiB each) go when their test process is gone.
        for e in std::fs::read_dir(std::env::temp_dir())
            .into_iter()
            .flatten()
            .flatten()
        {
            let name = e.file_name().to_string_lossy().into_owned();
            if let Some(pid) = name.strip_prefix("azsdp-hostile-")
                && pid.parse::<u32>().is_ok()
                && !std::path::Path::new(&format!("/proc/{pid}")).exists()
            {
                let _ = std::fs::remove_dir_all(e.path());
            }
        }
        let d = std::env::temp_dir().join(format!("azsdp-hostile-{}", std::process::id()));
        std::fs::create_dir_all(&d).expect("tool dir");
        std::fs::set_permissions(&d, std::fs::Permissions::from_mode(0o755)).expect("chmod");
        for (name, src) in [
            (
                "azsdp-hostile",
                PathBuf::from(env!("CARGO_BIN_EXE_azsdp-hostile")),
            ),
            ("azsdp-echo", echo()),
        ] {
            let to = d.join(name);
            std::fs::copy(src, &to).expect("copy tool");
            std::fs::set_permissions(&to, std::fs::Permissions::from_mode(0o755)).expect("chmod");
        }
        d
    });
    (dir.join("azsdp-hostile"), dir.join("azsdp-echo"))
}

/// `azsdp-hostile args...`, as uid 65534 (`as_nobody`) or as ourselves.
fn attacker(as_nobody: bool, args: &[&str]) -> Command {
    let (hostile, _) = tools();
    let mut c = if as_nobody {
        let mut c = Command::new(need("setpriv"));
        c.args(["--reuid", NOBODY, "--regid", NOBODY, "--clear-groups", "--"])
            .arg(&hostile);
        c
    } else {
        Command::new(&hostile)
    };
    c.args(args)
        .env_remove("LD_PRELOAD")
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::inherit());
    c
}

/// What the attacker reported.
struct Report(serde_json::Value);

impl Report {
    fn flag(&self, k: &str) -> bool {
        self.0[k]
            .as_bool()
            .unwrap_or_else(|| panic!("no {k} in {}", self.0))
    }
    fn count(&self, k: &str) -> u64 {
        self.0[k]
            .as_u64()
            .unwrap_or_else(|| panic!("no {k} in {}", self.0))
    }
    /// Nothing secret reached the attacker.
    fn no_leak(&self) -> &Self {
        assert!(!self.flag("leak"), "the attacker got a secret: {}", self.0);
        self
    }
}

/// Run an attack to its end (bounded) and read its report.
fn attack(as_nobody: bool, args: &[&str]) -> Report {
    let mut p = Proc::start(attacker(as_nobody, args), "azsdp-hostile");
    let out = p.stdout();
    let st = p
        .wait(Duration::from_secs(60))
        .expect("the attacker finished");
    assert!(st.success(), "azsdp-hostile {args:?} failed: {st}; {out}");
    let line = out.lines().last().unwrap_or_default();
    Report(serde_json::from_str(line).unwrap_or_else(|e| panic!("{e}: {out}")))
}

/// An attack that runs in the background (squatter, liar, flood, hostile
/// server): started, and ready once it printed "ready".
struct Background {
    p: Proc,
    out: BufReader<std::process::ChildStdout>,
}

impl Background {
    fn start(as_nobody: bool, args: &[&str]) -> Background {
        let mut p = Proc::start(attacker(as_nobody, args), "azsdp-hostile");
        let mut out = BufReader::new(p.child.stdout.take().expect("stdout"));
        let mut line = String::new();
        out.read_line(&mut line).expect("attacker output");
        assert!(line.starts_with("ready"), "attacker said {line:?}");
        Background { p, out }
    }

    fn report(mut self) -> Report {
        let st = self
            .p
            .wait(Duration::from_secs(60))
            .expect("the attacker finished");
        assert!(st.success(), "the attacker failed: {st}");
        let mut line = String::new();
        self.out.read_line(&mut line).expect("report");
        Report(serde_json::from_str(&line).unwrap_or_else(|e| panic!("{e}: {line}")))
    }
}

/// A victim: `azsdp-echo serve` under azsdp (root), holding the secret.
struct Victim {
    p: Proc,
    pid: i32,
    secret: String,
}

fn victim_server(s: &Scratch, name: &str, port: u16) -> Victim {
    let (_, echo) = tools();
    let mut c = s.under_azsdp(
        name,
        echo.to_str().expect("path"),
        &["serve", &port.to_string()],
    );
    c.stdout(Stdio::piped());
    let mut p = Proc::start(c, name);
    let mut line = String::new();
    BufReader::new(p.child.stdout.as_mut().expect("stdout"))
        .read_line(&mut line)
        .expect("server output");
    let mut w = line.split_whitespace().skip(1);
    let pid = w.next().and_then(|x| x.parse().ok()).expect("pid");
    let secret = w.next().expect("address").to_string();
    Victim { p, pid, secret }
}

/// A third root process, not under azsdp, holding the secret.
fn bystander() -> (Proc, i32, String) {
    let (_, echo) = tools();
    let mut c = Command::new(echo);
    c.arg("hold").stdin(Stdio::piped()).stdout(Stdio::piped());
    let mut p = Proc::start(c, "bystander");
    let mut line = String::new();
    BufReader::new(p.child.stdout.as_mut().expect("stdout"))
        .read_line(&mut line)
        .expect("bystander output");
    let mut w = line.split_whitespace().skip(1);
    let pid = w.next().and_then(|x| x.parse().ok()).expect("pid");
    (p, pid, w.next().expect("address").to_string())
}

/// A client of `port`, under azsdp or plain, exchanging `bytes`: it must
/// succeed within three seconds (plus the exchange itself) and check every
/// byte. Returns the wall time and whether it was upgraded. (A stall
/// guard: the delay a flood causes is judged on the medians, see
/// [`assert_not_slowed`]; one plain client of 185 took 1.1 s in the full
/// suite beside two CPU hogs, where this bound was a second.)
fn served(s: &Scratch, name: &str, azsdp: bool, port: u16, bytes: u64) -> (Duration, bool) {
    let (_, echo) = tools();
    let c = s.command(
        azsdp,
        name,
        echo.to_str().expect("path"),
        &["send", &port.to_string(), &bytes.to_string()],
    );
    let t0 = Instant::now();
    let mut p = Proc::start(c, name);
    p.expect_success(Duration::from_secs(30), || s.log(name));
    let took = t0.elapsed();
    assert!(
        took < Duration::from_secs(3) + Duration::from_millis(bytes / 1000),
        "{name} took {took:?}; its log:\n{}",
        s.log(name)
    );
    (took, s.log(name).contains(": azsdp (fabric shm, peer pid"))
}

fn fds_of(pid: i32) -> usize {
    std::fs::read_dir(format!("/proc/{pid}/fd")).map_or(0, |d| d.count())
}

/// The descriptors `pid` holds once they fall to `at_most`, or after 10 s
/// (what an attack left pending expires on its own).
fn fds_settle(pid: i32, at_most: usize) -> usize {
    let deadline = Instant::now() + Duration::from_secs(10);
    while fds_of(pid) > at_most && Instant::now() < deadline {
        std::thread::sleep(Duration::from_millis(100));
    }
    fds_of(pid)
}

#[test]
fn a_squatter_on_the_pairing_name_gets_nothing() {
    if !can_switch_user() {
        return;
    }
    let s = Scratch::new("squat");
    let p = port(72);
    // The squatter takes the names before the real server starts.
    let squatter = Background::start(true, &["squat", &p.to_string(), "4"]);
    let mut srv = victim_server(&s, "server", p);
    let (_, upgraded) = served(&s, "client", true, p, 1 << 20);
    assert!(!upgraded, "a client paired through a squatted name");
    let log = s.log("client");
    assert!(log.contains("tcp (peer-unverified)"), "{log}");
    let (_, _) = served(&s, "plain", false, p, 1 << 20);
    let r = squatter.report();
    r.no_leak();
    assert_eq!(r.count("offers"), 0, "the client offered to the squatter");
    assert_eq!(r.count("bytes"), 0);
    assert!(!r.flag("paired"));
    let log = s.log("server");
    assert!(
        log.contains("is held by pid") && log.contains("uid 65534"),
        "the listener does not say who took its name:\n{log}"
    );
    srv.p.kill();
}

#[test]
fn forged_identities_and_lies_about_connections_hijack_nothing() {
    if !can_switch_user() {
        return;
    }
    let s = Scratch::new("lies2");
    let p = port(73);
    let ps = p.to_string();
    let mut srv = victim_server(&s, "server", p);
    // An offer with our credentials but the server's own pidfd.
    let r = attack(
        true,
        &["client", &ps, &format!("forged-identity:{}", srv.pid)],
    );
    r.no_leak();
    assert!(!r.flag("paired") && !r.flag("answered"), "{}", r.0);
    assert!(
        s.log("server").contains("the pidfd names pid"),
        "{}",
        s.log("server")
    );
    // Offers for someone else's connection: a plain root client's socket,
    // named by its cookie before it connects.
    let (fd, _) = crate::bound_socket();
    let cookie = azsdp::sock_diag::cookie_of(std::os::fd::AsFd::as_fd(&fd)).expect("cookie");
    let liar = Background::start(true, &["lie", &ps, &cookie.to_string(), "3"]);
    let s2 = crate::connect_from(fd, p);
    (&s2).write_all(b"mine").expect("write");
    let mut b = [0u8; 4];
    (&s2)
        .read_exact(&mut b)
        .expect("the server still echoes to its real client");
    assert_eq!(&b, b"mine");
    let r = liar.report();
    assert!(
        !r.flag("answered") && !r.flag("paired"),
        "hijacked: {}",
        r.0
    );
    let log = s.log("server");
    assert!(log.contains("offered to pair the connection of"), "{log}");
    // Real azsdp clients still pair, and plain ones are served.
    let (_, upgraded) = served(&s, "client", true, p, 1 << 20);
    assert!(upgraded, "{}", s.log("client"));
    served(&s, "plain", false, p, 1 << 20);
    srv.p.kill();
}

#[test]
fn malicious_segments_and_rings_end_only_their_own_connection() {
    if !can_switch_user() {
        return;
    }
    let s = Scratch::new("segments");
    let p = port(74);
    let ps = p.to_string();
    let mut srv = victim_server(&s, "server", p);
    for a in [
        "bad-segment:unsealed",
        "bad-segment:junk",
        "corrupt-ring",
        "corrupt-header",
    ] {
        attack(true, &["client", &ps, a]).no_leak();
        let (_, upgraded) = served(&s, &format!("after-{a}"), true, p, 256 << 10);
        assert!(upgraded, "after {a}: {}", s.log(&format!("after-{a}")));
        assert!(
            srv.p.wait(Duration::ZERO).is_none(),
            "the server died of {a}"
        );
    }
    let log = s.log("server");
    assert!(
        log.contains("made an offer we cannot take up: shm segment"),
        "{log}"
    );
    assert!(!log.contains("panicked"), "{log}");
    srv.p.kill();

    // A hostile listener that corrupts the segment under a root client:
    // the client gets an error, never a panic, and nothing of its memory.
    let (_, echo) = tools();
    for (i, a) in ["corrupt-ring", "corrupt-header", "owner-word:1"]
        .iter()
        .enumerate()
    {
        let hp = port(75 + i as u16);
        let bad = Background::start(true, &["server", &hp.to_string(), a, "3"]);
        let name = format!("victim-client-{i}");
        let c = s.under_azsdp(
            &name,
            echo.to_str().expect("path"),
            &["send", &hp.to_string(), "1000000"],
        );
        let mut c = Proc::start(c, &name);
        let st = c.wait(Duration::from_secs(30)).expect("the client ended");
        assert_eq!(st.code(), Some(2), "{a}: {st}; {}", s.log(&name));
        let log = s.log(&name);
        // The pair completes at a call of the client's: one that began
        // before the answer came sleeps in the kernel on the silent TCP
        // connection until its read timeout or the hostile peer's exit,
        // as on TCP (no harm either).
        let upgraded = log.contains(": azsdp (fabric shm, peer pid");
        assert!(upgraded || log.contains("read at 0: "), "{a}: {log}");
        assert!(!log.contains("panicked"), "{a}: {log}");
        // Nothing was advertised to a peer of another user, whatever it
        // claimed to be able to read.
        assert!(
            !upgraded || log.contains("sent azsdp 0 zsdp 0 "),
            "{a}: {log}"
        );
        bad.report().no_leak();
    }
}

#[test]
fn gets_outside_advertisements_stale_keys_and_owner_rewrites_read_nothing() {
    if !can_switch_user() {
        return;
    }
    let s = Scratch::new("gets");
    let p = port(78);
    let ps = p.to_string();
    let mut srv = victim_server(&s, "server", p);
    let (_bystander, bpid, baddr) = bystander();
    let attacks = [
        "get-outside".to_string(),
        "stale-key".to_string(),
        format!("owner-word:{}:{}", srv.pid, srv.secret),
        format!("owner-word:{bpid}:{baddr}"),
    ];
    // Another user: the server never reads its memory at all.
    for a in &attacks {
        let r = attack(true, &["client", &ps, a]);
        r.no_leak();
        assert_eq!(r.count("bytes"), 0, "{a}: {}", r.0);
    }
    let log = s.log("server");
    assert!(
        log.contains("SRC_AVAIL not allowed without ZCOPY_SINK"),
        "{log}"
    );
    // The same user: the server does GET, and each GET is refused by the
    // key and range check; one for an owner word that names another
    // process waits for that process's claim, which never comes (it never
    // reads the process the word names, nor the attacker), and the
    // connection ends when the attacker leaves or the wait runs out.
    let refusals = |log: &str| {
        log.lines()
            .filter(|l| l.contains(": reset (") && l.contains("gets 1,"))
            .count()
    };
    let before = refusals(&log);
    for a in &attacks {
        let r = attack(false, &["client", &ps, a]);
        r.no_leak();
        assert_eq!(r.count("bytes"), 0, "{a}: {}", r.0);
    }
    // (The server logs a connection when it is done with it.)
    let refused = |log: &str| refusals(log) - before;
    let t0 = Instant::now();
    while refused(&s.log("server")) < attacks.len() && t0.elapsed() < Duration::from_secs(20) {
        std::thread::sleep(Duration::from_millis(50));
    }
    let log = s.log("server");
    assert_eq!(refused(&log), attacks.len(), "{log}");
    // (A refused GET is counted as posted; none delivered a byte.)
    for l in log.lines().filter(|l| l.contains(": reset (")) {
        assert!(
            l.contains("received zero-copy 0 bsdp 0 bytes"),
            "a forged advertisement was read: {l}"
        );
    }
    let (_, upgraded) = served(&s, "client", true, p, 1 << 20);
    assert!(upgraded);
    srv.p.kill();
}

#[test]
fn idle_and_flooding_registry_connections_keep_clients_served() {
    if !can_switch_user() {
        return;
    }
    let s = Scratch::new("flood");
    let p = port(79);
    let mut srv = victim_server(&s, "server", p);
    let base = fds_of(srv.pid);
    let flood = Background::start(true, &["flood", &p.to_string(), "6", "300"]);
    let mut most = 0;
    let mut upgraded = 0;
    for i in 0..6 {
        served(&s, &format!("plain-{i}"), false, p, 64 << 10);
        upgraded += usize::from(served(&s, &format!("azsdp-{i}"), true, p, 64 << 10).1);
        most = most.max(fds_of(srv.pid));
    }
    let r = flood.report();
    assert!(r.count("offers") > 100, "the flood did not flood: {}", r.0);
    // 256 offers from one other user, three descriptors each, at most.
    assert!(
        most < base + 800,
        "the server held {most} descriptors (from {base})"
    );
    // What a process opens once, on its first upgraded connection: the
    // userfaultfd, its stat directory and file, the readiness eventfd, and
    // the reactor's epoll set, eventfd and bell (two ends).
    const ONCE: usize = 8;
    let left = fds_settle(srv.pid, base + ONCE);
    assert!(
        left <= base + ONCE,
        "the flood's offers did not expire: {left} descriptors (from {base})"
    );
    eprintln!(
        "flood: {upgraded}/6 azsdp clients upgraded, at most {most} descriptors (from {base})"
    );
    srv.p.kill();
}

/// The median of `n` runs of a plain client's connect-and-echo of 4 KiB,
/// each beside a burst of `burst` other plain connections (if any).
fn plain_echo_median(s: &Scratch, tag: &str, port: u16, n: usize, burst: usize) -> Duration {
    let mut t: Vec<Duration> = (0..n)
        .map(|i| {
            let name = format!("{tag}-burst-{i}");
            let mut b = (burst > 0).then(|| plain_burst(s, &name, port, burst));
            let took = served(s, &format!("{tag}-{i}"), false, port, 4 << 10).0;
            if let Some(b) = &mut b {
                b.expect_success(Duration::from_secs(60), || s.log(&name));
            }
            took
        })
        .collect();
    t.sort();
    t[n / 2]
}

/// Plain clients under an attack took at most twice their quiet time, and
/// a little for a spawned client's scheduling on a host the attacker
/// shares.
fn assert_not_slowed(quiet: Duration, during: Duration, attack: &str) {
    assert!(
        during <= quiet * 2 + Duration::from_millis(25),
        "a plain connect-and-echo took {during:?} (median) under {attack}, {quiet:?} without"
    );
}

#[test]
fn malformed_messages_with_descriptors_leak_none_and_delay_no_client() {
    if !can_switch_user() {
        return;
    }
    let s = Scratch::new("junk");
    let p = port(146);
    let mut srv = victim_server(&s, "server", p);
    // Its first upgraded connection opens what a process opens once.
    served(&s, "first", true, p, 4 << 10);
    let base = fds_of(srv.pid);
    let quiet = plain_echo_median(&s, "quiet", p, 5, 0);
    let mut junk = Background::start(true, &["junk", &p.to_string(), "10000"]);
    let mut most = base;
    let mut during = Vec::new();
    while junk.p.child.try_wait().expect("try_wait").is_none() {
        during.push(served(&s, &format!("during-{}", during.len()), false, p, 4 << 10).0);
        most = most.max(fds_of(srv.pid));
    }
    let r = junk.report();
    assert!(
        r.flag("answered"),
        "the junk never reached the bell: {}",
        r.0
    );
    assert!(
        r.count("offers") >= 9_000,
        "the attacker sent too little: {}",
        r.0
    );
    // The registry holds a bounded number of pending connections and
    // offers per other user (each with up to three descriptors).
    assert!(
        most < base + 1100,
        "the server held {most} descriptors (from {base})"
    );
    let left = fds_settle(srv.pid, base);
    assert!(
        left <= base,
        "10,000 malformed messages left {left} descriptors (from {base})"
    );
    assert!(!during.is_empty(), "no client ran during the attack");
    during.sort();
    let med = during[during.len() / 2];
    assert_not_slowed(quiet, med, "10,000 malformed messages");
    eprintln!(
        "junk: plain connect-and-echo {quiet:?} quiet, {med:?} under 10,000 malformed messages \
         ({} clients); descriptors at most {most} (from {base})",
        during.len()
    );
    srv.p.kill();
}

/// A plain `azsdp-echo many` opening `n` connections to `port` at once (a
/// burst the server accepts one after another), started.
fn plain_burst(s: &Scratch, name: &str, port: u16, n: usize) -> Proc {
    let (_, echo) = tools();
    let c = s.plain(
        name,
        echo.to_str().expect("path"),
        &["many", &port.to_string(), &n.to_string(), "64"],
    );
    Proc::start(c, name)
}

/// Connections in a burst: within the server's listen backlog (128), which
/// a larger burst overflows now and then on a busy host, plain or not (a
/// dropped SYN costs its client a second).
const BURST: usize = 100;

#[test]
fn a_registry_flood_costs_accept_little() {
    if !can_switch_user() {
        return;
    }
    let s = Scratch::new("flood-accept");
    let p = port(147);
    let mut srv = victim_server(&s, "server", p);
    let quiet = plain_echo_median(&s, "quiet", p, 5, BURST);
    // 3,000 idle pairing connections held open, and new bogus offers for
    // as long as the clients run.
    let flood = Background::start(true, &["flood", &p.to_string(), "8", "3000"]);
    let during = plain_echo_median(&s, "during", p, 5, BURST);
    let r = flood.report();
    assert!(r.count("offers") > 100, "the flood did not flood: {}", r.0);
    eprintln!(
        "flood: a plain connect-and-echo beside a burst of {BURST} took {quiet:?} quiet, \
         {during:?} under the flood ({} offers)",
        r.count("offers")
    );
    assert_not_slowed(quiet, during, "a registry flood");
    srv.p.kill();
}

#[test]
fn stat_files_live_in_a_checked_private_directory_and_go_at_exit() {
    let s = Scratch::new("statdir");
    let p = port(80);
    let mut srv = victim_server(&s, "server", p);
    let (_, echo) = tools();
    // The default directory, made by the shim itself: 0700, ours.
    let mut c = s.under_azsdp(
        "client",
        echo.to_str().expect("path"),
        &["send", &p.to_string(), "100000"],
    );
    c.env_remove("AZSDP_STAT_DIR");
    let mut c = Proc::start(c, "client");
    let pid = c.pid();
    c.expect_success(Duration::from_secs(20), || s.log("client"));
    // SAFETY: plain system call.
    let uid = unsafe { libc::geteuid() };
    let dir = PathBuf::from(format!("/dev/shm/azsdp-{uid}"));
    {
        use std::os::unix::fs::{MetadataExt, PermissionsExt};
        let m = std::fs::symlink_metadata(&dir).expect("the per-user directory");
        assert!(m.is_dir());
        assert_eq!((m.uid(), m.permissions().mode() & 0o777), (uid, 0o700));
    }
    assert!(
        !dir.join(format!("azsdp-stat.{pid}")).exists(),
        "the client's stat file outlived it"
    );
    // A directory anyone can write is refused, with a warning, and the
    // program runs all the same.
    if can_switch_user() {
        use std::os::unix::fs::PermissionsExt;
        let open = s.path("world-writable");
        std::fs::create_dir_all(&open).expect("dir");
        std::fs::set_permissions(&open, std::fs::Permissions::from_mode(0o777)).expect("chmod");
        let planted = s.path("precious");
        std::fs::write(&planted, b"precious").expect("write");
        // The shim's own check is what is tested (`azsdp run` refuses
        // such a directory before the program starts).
        let mut c = s.under_azsdp_anyway(
            "client2",
            echo.to_str().expect("path"),
            &["send", &p.to_string(), "100000"],
        );
        c.env("AZSDP_STAT_DIR", &open);
        let mut c = Proc::start(c, "client2");
        c.expect_success(Duration::from_secs(20), || s.log("client2"));
        let log = s.log("client2");
        assert!(log.contains("can be written by other users"), "{log}");
        assert!(log.contains(": azsdp (fabric shm, peer pid"), "{log}");
        assert_eq!(std::fs::read(&planted).expect("read"), b"precious");
        assert_eq!(std::fs::read_dir(&open).expect("dir").count(), 0);
    }
    srv.p.kill();
}
