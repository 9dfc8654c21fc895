//! Running real, unmodified programs under `azsdp run` in tests.
//!
//! The first test to need them builds `libazsdp.so` and the `azsdp` command
//! (release profile, as users run them). Each test gets its own stat
//! directory, so `azsdp stat` shows only its own processes, and its own
//! ports. Every wait is bounded and every child is killed on drop: a test
//! fails, it never hangs.

#![allow(dead_code)]

use std::io::Read;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, ExitStatus, Stdio};
use std::sync::OnceLock;
use std::time::{Duration, Instant};

pub fn workspace() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .parent()
        .expect("workspace root")
        .to_path_buf()
}

fn target_dir() -> PathBuf {
    std::env::var_os("CARGO_TARGET_DIR")
        .map(PathBuf::from)
        .unwrap_or_else(|| workspace().join("target"))
}

/// The `azsdp` command, built (with libazsdp.so and the benchmark
/// programs next to it) on first use.
pub fn azsdp() -> &'static Path {
    static BUILT: OnceLock<PathBuf> = OnceLock::new();
    BUILT.get_or_init(|| {
        let cargo = std::env::var("CARGO").unwrap_or_else(|_| "cargo".into());
        // The daemon package holds azsdp, azsdp-ttcp and azsdp-echo.
        let args = [
            "build",
            "--release",
            "-p",
            "azsdp-shim",
            "-p",
            "azsdp-daemon",
        ];
        let st = Command::new(&cargo)
            .current_dir(workspace())
            .args(args)
            .status()
            .expect("run cargo build");
        assert!(st.success(), "cargo {args:?} failed");
        let bin = target_dir().join("release/azsdp");
        assert!(target_dir().join("release/libazsdp.so").exists());
        assert!(target_dir().join("release/azsdp-ttcp").exists());
        bin
    })
}

/// `azsdp-ttcp`, built with the rest.
pub fn ttcp() -> PathBuf {
    azsdp();
    target_dir().join("release/azsdp-ttcp")
}

/// `azsdp-echo`, built with the rest.
pub fn echo() -> PathBuf {
    azsdp();
    target_dir().join("release/azsdp-echo")
}

/// Path of a program the test needs; the CI installs them (see `.ci/run`).
pub fn need(program: &str) -> PathBuf {
    if program.contains('/') {
        return PathBuf::from(program);
    }
    on_path(program)
        .unwrap_or_else(|| panic!("`{program}` is not installed (the CI installs it with apt-get)"))
}

/// `program` in a directory of PATH.
fn on_path(program: &str) -> Option<PathBuf> {
    let path = std::env::var_os("PATH").unwrap_or_default();
    // (Daemons live in sbin, which a user's PATH may leave out.)
    std::env::split_paths(&path)
        .chain(["/usr/sbin".into(), "/sbin".into()])
        .map(|d| d.join(program))
        .find(|p| p.exists())
}

/// Whether `programs` are all installed. A test that needs a missing one
/// is skipped, with a line saying what to install, so the test command
/// passes on a machine with nothing but the Rust toolchain; in CI (`CI`
/// set, as CI services set it) a missing program fails the test instead,
/// so nothing is skipped there unnoticed.
pub fn have(programs: &[&str]) -> bool {
    let missing: Vec<&str> = programs
        .iter()
        .copied()
        .filter(|p| on_path(p).is_none())
        .collect();
    if missing.is_empty() {
        return true;
    }
    let packages: Vec<&str> = missing
        .iter()
        .map(|p| match *p {
            "redis-server" => "redis-server",
            p if p.starts_with("redis-") => "redis-tools",
            "setpriv" => "util-linux",
            "postgres" => "postgresql",
            "psql" => "postgresql-client",
            "sshd" => "openssh-server",
            "ab" => "apache2-utils",
            "ssh" | "scp" | "ssh-keygen" => "openssh-client",
            p => p,
        })
        .collect();
    let what = format!(
        "needs {} (Debian: apt-get install {})",
        missing.join(", "),
        packages.join(" ")
    );
    let ci = std::env::var_os("CI").is_some_and(|v| !v.is_empty() && v != "false" && v != "0");
    assert!(!ci, "{what}; CI must install it (.ci/run)");
    eprintln!("skipped: {what}");
    false
}

/// Copy `from` into `dir` as `name`, executable by every user: a test that
/// runs a program as another uid (65534) cannot reach the build's own
/// where only its owner may enter (a CI checkout under /root).
pub fn copy_for_anyone(from: &Path, dir: &Path, name: &str) -> PathBuf {
    use std::os::unix::fs::PermissionsExt;
    let to = dir.join(name);
    std::fs::copy(from, &to).expect("copy");
    std::fs::set_permissions(&to, std::fs::Permissions::from_mode(0o755)).expect("chmod");
    to
}

/// A scratch directory for one test, removed at the end.
pub struct Scratch(pub PathBuf);

impl Scratch {
    pub fn new(name: &str) -> Scratch {
        let p = std::env::temp_dir().join(format!("azsdp-prog-{name}-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&p);
        std::fs::create_dir_all(&p).expect("scratch dir");
        let s = Scratch(p);
        let _ = std::fs::remove_dir_all(s.stat_dir());
        std::fs::create_dir_all(s.stat_dir()).expect("stat dir");
        s
    }

    pub fn path(&self, name: &str) -> PathBuf {
        self.0.join(name)
    }

    /// The stat directory, in memory as users' is (`/dev/shm`): stat
    /// files on a disk's file system are written back while ten thousand
    /// connections update them, which made a scale test eight times
    /// slower than the same run under the default directory.
    pub fn stat_dir(&self) -> PathBuf {
        let shm = Path::new("/dev/shm");
        if !shm.is_dir() {
            return self.0.join("stat");
        }
        let name = self.0.file_name().unwrap_or_default().to_string_lossy();
        shm.join(format!("{name}-stat"))
    }

    /// `azsdp run -- program args...`, with this test's stat directory and
    /// the shim's log in `<name>.log`.
    pub fn under_azsdp(&self, name: &str, program: &str, args: &[&str]) -> Command {
        self.run_with(&[], name, program, args)
    }

    /// `under_azsdp` with `azsdp run --run-anyway`: the program starts
    /// whatever `azsdp run` thinks of the configuration and environment,
    /// so that the shim's own handling of them is what is tested.
    pub fn under_azsdp_anyway(&self, name: &str, program: &str, args: &[&str]) -> Command {
        self.run_with(&["--run-anyway"], name, program, args)
    }

    fn run_with(&self, options: &[&str], name: &str, program: &str, args: &[&str]) -> Command {
        let mut c = Command::new(azsdp());
        c.arg("run")
            .args(options)
            .arg("--")
            .arg(need(program))
            .args(args);
        self.setup(&mut c, name);
        c
    }

    /// The same program without azsdp.
    pub fn plain(&self, name: &str, program: &str, args: &[&str]) -> Command {
        let mut c = Command::new(need(program));
        c.args(args);
        self.setup(&mut c, name);
        c
    }

    /// `under_azsdp` or `plain`, as `azsdp` says.
    pub fn command(&self, azsdp: bool, name: &str, program: &str, args: &[&str]) -> Command {
        if azsdp {
            self.under_azsdp(name, program, args)
        } else {
            self.plain(name, program, args)
        }
    }

    fn setup(&self, c: &mut Command, name: &str) {
        let log = std::fs::File::create(self.path(&format!("{name}.log"))).expect("log file");
        // (A connect waits `pair_timeout`, 500 ms by default, for the
        // server's accept() and then stays on TCP, which is right; but
        // these tests check what pairs, and on a loaded host, the suite
        // beside a guest or a build, an accept() can take longer. A test
        // that wants the default sets its own. Likewise every connection
        // offers, even after a run of short ones to its destination:
        // `pair_history_stops_offers_to_short_lived_destinations` tests
        // the default.)
        c.env("AZSDP_STAT_DIR", self.stat_dir())
            .env("AZSDP_LOG_LEVEL", "debug")
            .env("AZSDP_PAIR_TIMEOUT", "5s")
            .env("AZSDP_PAIR_EVERY_CONNECTION", "true")
            .env_remove("AZSDP_CONFIG")
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(log);
    }

    pub fn log(&self, name: &str) -> String {
        std::fs::read_to_string(self.path(&format!("{name}.log"))).unwrap_or_default()
    }

    /// The client's log, then the server's (for a client's failure).
    pub fn client_and_server_logs(&self) -> String {
        format!(
            "{}\nthe server's log:\n{}",
            self.log("client"),
            self.log("server")
        )
    }

    /// `azsdp stat --json` for this test's processes.
    pub fn stat(&self) -> Vec<serde_json::Value> {
        let out = Command::new(azsdp())
            .args(["stat", "--json"])
            .env("AZSDP_STAT_DIR", self.stat_dir())
            .output()
            .expect("azsdp stat");
        assert!(out.status.success(), "azsdp stat failed");
        match serde_json::from_slice(&out.stdout).expect("stat output is JSON") {
            serde_json::Value::Array(v) => v,
            other => panic!("stat output is not an array: {other}"),
        }
    }

    /// Poll `azsdp stat` until `want` holds for some connection, or `t`.
    pub fn stat_until(
        &self,
        t: Duration,
        want: impl Fn(&serde_json::Value) -> bool,
    ) -> Option<serde_json::Value> {
        let deadline = Instant::now() + t;
        while Instant::now() < deadline {
            if let Some(c) = self.stat().into_iter().find(|c| want(c)) {
                return Some(c);
            }
            std::thread::sleep(Duration::from_millis(50));
        }
        None
    }
}

impl Drop for Scratch {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(self.stat_dir());
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

/// A child process, killed when dropped.
pub struct Proc {
    pub child: Child,
    pub name: String,
}

impl Proc {
    pub fn start(mut cmd: Command, name: &str) -> Proc {
        // Its own process group, so that `kill` takes what it started too
        // (`git daemon` runs `git-daemon` as a child, which outlived the
        // test and held its port for a later run's).
        std::os::unix::process::CommandExt::process_group(&mut cmd, 0);
        Proc {
            child: cmd.spawn().unwrap_or_else(|e| panic!("start {name}: {e}")),
            name: name.into(),
        }
    }

    pub fn pid(&self) -> i32 {
        self.child.id() as i32
    }

    /// Wait up to `t` for it to exit.
    pub fn wait(&mut self, t: Duration) -> Option<ExitStatus> {
        let deadline = Instant::now() + t;
        loop {
            if let Some(s) = self.child.try_wait().expect("try_wait") {
                return Some(s);
            }
            if Instant::now() >= deadline {
                return None;
            }
            std::thread::sleep(Duration::from_millis(5));
        }
    }

    /// Wait, failing the test (with `log()`, read then) if it takes longer
    /// than `t` or fails.
    pub fn expect_success(&mut self, t: Duration, log: impl FnOnce() -> String) {
        match self.wait(t) {
            Some(s) if s.success() => {}
            Some(s) => panic!("{} failed ({s}); its log:\n{}", self.name, log()),
            None => panic!(
                "{} did not finish within {t:?}; its log:\n{}",
                self.name,
                log()
            ),
        }
    }

    pub fn kill(&mut self) {
        if self.child.try_wait().ok().flatten().is_none() {
            // SAFETY: signalling the process group this Proc leads.
            unsafe { libc::kill(-(self.child.id() as i32), libc::SIGKILL) };
        }
        let _ = self.child.kill();
        let _ = self.child.wait();
    }

    pub fn stdout(&mut self) -> String {
        let mut s = String::new();
        if let Some(o) = self.child.stdout.as_mut() {
            let _ = o.read_to_string(&mut s);
        }
        s
    }
}

impl Drop for Proc {
    fn drop(&mut self) {
        self.kill();
    }
}

/// Wait until something listens on TCP `port` (from /proc/net/tcp{,6},
/// without connecting, which would take the server's one connection).
pub fn wait_listening(port: u16, t: Duration) {
    let deadline = Instant::now() + t;
    let hex = format!(":{port:04X} ");
    while Instant::now() < deadline {
        for f in ["/proc/net/tcp", "/proc/net/tcp6"] {
            let text = std::fs::read_to_string(f).unwrap_or_default();
            // local_address is the second column; state 0A is LISTEN.
            if text.lines().any(|l| {
                let cols: Vec<&str> = l.split_whitespace().collect();
                cols.len() > 3 && format!("{} ", cols[1]).ends_with(&hex) && cols[3] == "0A"
            }) {
                return;
            }
        }
        std::thread::sleep(Duration::from_millis(10));
    }
    panic!("nothing listens on port {port} after {t:?}");
}

/// sha256 of a file (coreutils' sha256sum).
pub fn sha256(path: &Path) -> String {
    let out = Command::new("sha256sum")
        .arg(path)
        .output()
        .expect("sha256sum");
    assert!(out.status.success());
    String::from_utf8_lossy(&out.stdout)
        .split_whitespace()
        .next()
        .unwrap_or_default()
        .to_string()
}

/// Write `len` pseudo-random bytes to `path` (fast, not cryptographic).
pub fn random_file(path: &Path, len: u64, seed: u64) {
    use std::io::Write;
    let f = std::fs::File::create(path).expect("create");
    let mut w = std::io::BufWriter::with_capacity(1 << 20, f);
    let mut x = seed | 1;
    let mut buf = vec![0u8; 1 << 20];
    let mut left = len;
    while left > 0 {
        for chunk in buf.chunks_mut(8) {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            let b = x.to_le_bytes();
            chunk.copy_from_slice(&b[..chunk.len()]);
        }
        let n = left.min(buf.len() as u64) as usize;
        w.write_all(&buf[..n]).expect("write");
        left -= n as u64;
    }
    w.flush().expect("flush");
}

/// A JSON field as u64 (0 if absent).
pub fn num(v: &serde_json::Value, path: &[&str]) -> u64 {
    let mut cur = v;
    for p in path {
        cur = &cur[*p];
    }
    cur.as_u64().unwrap_or(0)
}

pub fn text<'a>(v: &'a serde_json::Value, key: &str) -> &'a str {
    v[key].as_str().unwrap_or("")
}

/// `python3 tests/programs/SCRIPT server PORT`, then `SCRIPT client PORT
/// ARGS...`, both under azsdp, in scratch directory `name`: the client must
/// succeed within `t`; the server then has `grace` to finish before it is
/// killed. Returns the scratch, for the logs (`client`, `server`).
pub fn python_pair(
    name: &str,
    script: &str,
    port: u16,
    client_args: &[&str],
    t: Duration,
    grace: Duration,
) -> Scratch {
    let script = workspace().join("tests/programs").join(script);
    let script = script.display().to_string();
    let s = Scratch::new(name);
    let p = port.to_string();
    let mut srv = Proc::start(
        s.under_azsdp("server", "python3", &[&script, "server", &p]),
        "python3 server",
    );
    wait_listening(port, crate::LISTEN);
    let mut args = vec![script.as_str(), "client", &p];
    args.extend_from_slice(client_args);
    let mut cli = Proc::start(s.under_azsdp("client", "python3", &args), "python3 client");
    cli.expect_success(t, || s.client_and_server_logs());
    srv.wait(grace);
    srv.kill();
    s
}
