//! What azsdp writes, and where: the shim only through its log
//! (`AZSDP_LOG`), harmlessly even when the program's stderr is a file
//! under `RLIMIT_FSIZE=0` (sshd's children) or a pipe nobody reads; the
//! `azsdp` command quietly when its output is closed (`azsdp stat | head`).
//!
//! The shim's one message from the core, "no full userfaultfd", comes to
//! any process that may not have one: these tests run the programs as
//! uid 65534, as an unprivileged server's would.

use std::os::unix::process::{CommandExt, ExitStatusExt};
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::Duration;

use crate::harness::*;
use crate::port;

const NOBODY: u32 = 65534;

/// Copies of `azsdp`, `libazsdp.so` and `azsdp-echo` that uid 65534 may
/// run, and a directory it may write its logs in; removed at the end.
struct NobodyRun {
    dir: PathBuf,
}

impl NobodyRun {
    fn new(name: &str) -> NobodyRun {
        use std::os::unix::fs::PermissionsExt;
        let dir = std::env::temp_dir().join(format!("azsdp-out-{name}-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir_all(&dir).expect("dir");
        let target = azsdp().parent().expect("target dir").to_path_buf();
        for (name, from) in [
            ("azsdp", azsdp().to_path_buf()),
            ("libazsdp.so", target.join("libazsdp.so")),
            ("azsdp-echo", echo()),
        ] {
            copy_for_anyone(&from, &dir, name);
        }
        std::fs::set_permissions(&dir, std::fs::Permissions::from_mode(0o777)).expect("chmod");
        let stat = dir.join("stat");
        std::fs::create_dir(&stat).expect("stat dir");
        std::fs::set_permissions(&stat, std::fs::Permissions::from_mode(0o700)).expect("chmod");
        std::os::unix::fs::chown(&stat, Some(NOBODY), Some(NOBODY)).expect("chown");
        NobodyRun { dir }
    }

    fn path(&self, name: &str) -> PathBuf {
        self.dir.join(name)
    }

    /// `azsdp run -- azsdp-echo ARGS` as uid 65534, its stderr `stderr`,
    /// with `env` (and nothing of the caller's AZSDP_* settings).
    fn echo(&self, args: &[&str], env: &[(&str, &Path)], stderr: Stdio) -> Command {
        let mut c = Command::new(need("setpriv"));
        let id = NOBODY.to_string();
        c.args(["--reuid", &id, "--regid", &id, "--clear-groups", "--"])
            .arg(self.path("azsdp"))
            .arg("run")
            .arg("--")
            .arg(self.path("azsdp-echo"))
            .args(args)
            .env("AZSDP_STAT_DIR", self.path("stat"))
            .env_remove("AZSDP_CONFIG")
            .env_remove("AZSDP_LOG")
            .env_remove("AZSDP_LOG_LEVEL")
            .stdin(Stdio::null())
            .stdout(Stdio::piped())
            .stderr(stderr);
        for (k, v) in env {
            c.env(k, v);
        }
        c
    }

    fn file(&self, name: &str) -> std::fs::File {
        std::fs::File::create(self.path(name)).expect("file")
    }

    fn read(&self, name: &str) -> String {
        std::fs::read_to_string(self.path(name)).unwrap_or_default()
    }

    /// An echo server as uid 65534 on `p`, ready.
    fn server(&self, p: u16, env: &[(&str, &Path)], stderr: Stdio) -> Proc {
        let mut s = Proc::start(self.echo(&["serve", &p.to_string()], env, stderr), "server");
        let mut out = std::io::BufReader::new(s.child.stdout.take().expect("stdout"));
        let mut line = String::new();
        std::io::BufRead::read_line(&mut out, &mut line).expect("server output");
        assert!(line.starts_with("ready"), "the server said {line:?}");
        s
    }

    /// One client exchange as uid 65534; asserts it was checked.
    fn client(&self, p: u16, env: &[(&str, &Path)], stderr: Stdio) {
        self.client_with(self.echo(&["send", &p.to_string(), "1000000"], env, stderr));
    }

    fn client_with(&self, cmd: Command) {
        let mut c = Proc::start(cmd, "client");
        let st = c
            .wait(Duration::from_secs(30))
            .expect("the client finished");
        let out = c.stdout();
        assert!(st.success(), "client: {st}; {out}");
        assert!(out.contains("\"ok\":true"), "client: {out}");
    }
}

impl Drop for NobodyRun {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.dir);
    }
}

fn root() -> bool {
    // SAFETY: plain system call.
    let root = unsafe { libc::geteuid() } == 0;
    if !root {
        eprintln!("skipped: running as another user needs root");
    }
    root
}

#[test]
fn without_userfaultfd_the_note_goes_to_the_log_and_nowhere_else() {
    if !root() {
        return;
    }
    let r = NobodyRun::new("note");
    // To a log file: the note is there, with the upgrade; stderr is empty.
    let p = port(88);
    let (slog, clog) = (r.path("server.log"), r.path("client.log"));
    let info = Path::new("info");
    let mut s = r.server(
        p,
        &[("AZSDP_LOG", &slog), ("AZSDP_LOG_LEVEL", info)],
        r.file("server.err").into(),
    );
    r.client(
        p,
        &[("AZSDP_LOG", &clog), ("AZSDP_LOG_LEVEL", info)],
        r.file("client.err").into(),
    );
    s.kill();
    let log = r.read("server.log");
    assert!(
        log.contains(": azsdp (fabric shm, peer pid"),
        "not upgraded:\n{log}"
    );
    assert!(
        log.contains("warn: no full userfaultfd"),
        "no note in the log:\n{log}"
    );
    for err in ["server.err", "client.err"] {
        assert_eq!(r.read(err), "", "{err}");
    }
    // The default log is stderr, in the log's format; AZSDP_LOG=off is
    // silence.
    for off in [false, true] {
        let p = port(89) + 32 * u16::from(off);
        let env: &[(&str, &Path)] = if off {
            &[("AZSDP_LOG", Path::new("off"))]
        } else {
            &[]
        };
        let mut s = r.server(p, env, r.file("server.err").into());
        r.client(p, env, r.file("client.err").into());
        s.kill();
        let err = r.read("server.err");
        if off {
            assert_eq!(err, "", "AZSDP_LOG=off");
            assert_eq!(r.read("client.err"), "", "AZSDP_LOG=off");
        } else {
            assert!(
                err.starts_with("azsdp[") && err.contains("warn: no full userfaultfd"),
                "{err}"
            );
        }
    }
}

#[test]
fn a_size_limited_or_closed_stderr_does_not_hurt_the_program() {
    if !root() {
        return;
    }
    let r = NobodyRun::new("stderr");
    let p = port(90);
    let debug = [("AZSDP_LOG_LEVEL", Path::new("debug"))];
    // The server's stderr is a file it may not grow (RLIMIT_FSIZE = 0: a
    // write raises SIGXFSZ, which kills by default).
    let mut cmd = r.echo(
        &["serve", &p.to_string()],
        &debug,
        r.file("server.err").into(),
    );
    no_file_growth(&mut cmd);
    let mut s = Proc::start(cmd, "server");
    let mut out = std::io::BufReader::new(s.child.stdout.take().expect("stdout"));
    let mut line = String::new();
    std::io::BufRead::read_line(&mut out, &mut line).expect("server output");
    assert!(line.starts_with("ready"), "the server said {line:?}");
    // The clients' stderr is a pipe whose reader is gone (SIGPIPE); the
    // second may not grow files either (its shm segment: it stays on TCP).
    for limited in [false, true] {
        let (reader, writer) = std::io::pipe().expect("pipe");
        drop(reader);
        let mut cmd = r.echo(&["send", &p.to_string(), "1000000"], &debug, writer.into());
        if limited {
            no_file_growth(&mut cmd);
        }
        r.client_with(cmd);
    }
    assert!(
        s.child.try_wait().expect("try_wait").is_none(),
        "the server died"
    );
    s.kill();
    assert_eq!(
        std::fs::metadata(r.path("server.err"))
            .map(|m| m.len())
            .ok(),
        Some(0)
    );
}

/// Run `cmd` under `RLIMIT_FSIZE = 0`: growing a file raises SIGXFSZ,
/// which kills by default.
fn no_file_growth(cmd: &mut Command) {
    // SAFETY: setrlimit(2) between fork and exec, nothing else.
    unsafe {
        cmd.pre_exec(|| {
            let zero = libc::rlimit {
                rlim_cur: 0,
                rlim_max: 0,
            };
            if libc::setrlimit(libc::RLIMIT_FSIZE, &zero) != 0 {
                return Err(std::io::Error::last_os_error());
            }
            Ok(())
        });
    }
}

#[test]
fn azsdp_stat_into_a_closed_pipe_ends_quietly() {
    let (reader, writer) = std::io::pipe().expect("pipe");
    drop(reader);
    let out = Command::new(azsdp())
        .arg("stat")
        .stdout(writer)
        .stderr(Stdio::piped())
        .output()
        .expect("azsdp stat");
    let err = String::from_utf8_lossy(&out.stderr);
    assert_eq!(err, "", "stderr");
    assert!(
        out.status.success() || out.status.signal() == Some(libc::SIGPIPE),
        "{}",
        out.status
    );
}
