//! Bad input from the environment and the configuration: a clear error,
//! the program running on plain TCP (or upgraded, where the input is
//! valid), never a panic or a hang.

use std::ffi::OsString;
use std::os::unix::ffi::OsStringExt;
use std::process::Stdio;
use std::time::{Duration, Instant};

use crate::harness::*;
use crate::port;

#[test]
fn bad_environment_and_configuration_fail_clearly() {
    let s = Scratch::new("inputs");
    let p = port(81).to_string();
    let echo = echo();
    let echo = echo.to_str().expect("path");
    let mut srv = s.under_azsdp("server", echo, &["serve", &p]);
    srv.stdout(Stdio::piped());
    let mut srv = Proc::start(srv, "server");
    wait_listening(p.parse().expect("port"), Duration::from_secs(15));
    let fifo = s.path("fifo");
    nix::unistd::mkfifo(&fifo, nix::sys::stat::Mode::S_IRWXU).expect("fifo");
    let junk = OsString::from_vec(vec![0xff, 0xfe, b'!']);
    // (name, variable, value, upgraded?, what the log must say)
    let cases: [(&str, &str, OsString, bool, &str); 6] = [
        (
            "dev-zero",
            "AZSDP_CONFIG",
            "/dev/zero".into(),
            false,
            "not a regular file",
        ),
        (
            "fifo",
            "AZSDP_CONFIG",
            fifo.clone().into_os_string(),
            false,
            "not a regular file",
        ),
        (
            "poll",
            "AZSDP_POLL",
            "10m".into(),
            false,
            "key `poll`: must be",
        ),
        (
            "not-utf8-ours",
            "AZSDP_POLL",
            junk.clone(),
            false,
            "not valid UTF-8",
        ),
        (
            "never",
            "AZSDP_PEER_TIMEOUT",
            "0".into(),
            true,
            ": azsdp (fabric shm, peer pid",
        ),
        (
            "not-utf8-theirs",
            "SOME_VARIABLE",
            junk,
            true,
            ": azsdp (fabric shm, peer pid",
        ),
    ];
    for (name, var, value, upgraded, says) in cases {
        let mut c = s.under_azsdp_anyway(name, echo, &["send", &p, "100000"]);
        c.env(var, &value);
        let t0 = Instant::now();
        let mut c = Proc::start(c, name);
        c.expect_success(Duration::from_secs(20), || s.log(name));
        assert!(
            t0.elapsed() < Duration::from_secs(5),
            "{name} took {:?}",
            t0.elapsed()
        );
        let log = s.log(name);
        assert!(log.contains(says), "{name}: {log}");
        assert!(!log.contains("panicked"), "{name}: {log}");
        assert_eq!(
            log.contains(": azsdp (fabric shm, peer pid"),
            upgraded,
            "{name}: {log}"
        );
        if !upgraded {
            assert!(
                log.contains("tcp (bad-config)"),
                "{name}: no reason given: {log}"
            );
        }
    }
    // A mistyped log level is said once by the shim (and once by `azsdp
    // run`), and the log goes on at warn.
    let mut c = s.under_azsdp_anyway("level", echo, &["send", &p, "100000"]);
    c.env("AZSDP_LOG_LEVEL", "verbose");
    let mut c = Proc::start(c, "level");
    c.expect_success(Duration::from_secs(20), || s.log("level"));
    let log = s.log("level");
    assert_eq!(
        log.matches("warn: AZSDP_LOG_LEVEL=verbose: not a level")
            .count(),
        1,
        "{log}"
    );
    srv.kill();
}
