//! The conformance suite (`tests/conform`): every interposed call, on
//! kernel TCP and under azsdp, compared call by call.

use std::process::Stdio;
use std::time::Duration;

use crate::harness::*;
use crate::port;

/// Steps where azsdp answers differently from kernel TCP, on purpose, and
/// why (`docs/conformance.md` says the same). Each must still differ: a
/// stale entry fails the test too.
const KNOWN: &[(&str, &str)] = &[(
    "flags.17 send OOB",
    "urgent data (MSG_OOB) is not carried: EOPNOTSUPP",
)];

fn transcript(azsdp: bool, offset: u16) -> (String, String) {
    let s = Scratch::new(&format!("conform-{azsdp}"));
    let p = port(offset + 32 * u16::from(azsdp)).to_string();
    let mut c = s.command(azsdp, "conform", env!("CARGO_BIN_EXE_azsdp-conform"), &[&p]);
    c.stdout(Stdio::piped());
    let mut proc = Proc::start(c, "azsdp-conform");
    let out = proc.stdout();
    let st = proc
        .wait(Duration::from_secs(120))
        .expect("azsdp-conform finished");
    let log = s.log("conform");
    assert!(
        st.success(),
        "azsdp-conform (azsdp: {azsdp}) failed: {st}\n{log}"
    );
    (out, log)
}

/// `step what` of a transcript line, without the result.
fn key(line: &str) -> &str {
    line.rsplit_once(" = ").map_or(line, |(k, _)| k)
}

#[test]
fn every_interposed_call_answers_as_kernel_tcp_does() {
    let (tcp, _) = transcript(false, 31);
    let (ours, log) = transcript(true, 31);
    let upgraded = log.matches(": azsdp (fabric shm, peer pid").count();
    // (Connections begin on TCP: one the peer shuts down at once, or a
    // server forks at once, stays there, as it should.)
    let stayed: Vec<&str> = log
        .lines()
        .filter(|l| {
            l.contains(": tcp (") && !l.contains("(short-lived)") && !l.contains("(forked)")
        })
        .collect();
    assert!(
        upgraded >= 15 && stayed.is_empty(),
        "{upgraded} connections upgraded, on TCP: {stayed:?}"
    );
    let (a, b): (Vec<&str>, Vec<&str>) = (tcp.lines().collect(), ours.lines().collect());
    assert!(a.len() > 300, "a short transcript:\n{tcp}");
    assert_eq!(
        a.iter().map(|l| key(l)).collect::<Vec<_>>(),
        b.iter().map(|l| key(l)).collect::<Vec<_>>(),
        "the two runs made different calls"
    );
    let mut wrong = Vec::new();
    let mut known_seen = Vec::new();
    for (x, y) in a.iter().zip(&b) {
        if let Some((k, why)) = KNOWN.iter().find(|(k, _)| key(x) == *k) {
            known_seen.push(*k);
            assert_ne!(
                x, y,
                "{k} no longer differs ({why}): update KNOWN and the docs"
            );
            continue;
        }
        if x != y {
            wrong.push(format!("  kernel TCP: {x}\n  azsdp:      {y}"));
        }
    }
    assert_eq!(
        known_seen.len(),
        KNOWN.len(),
        "a known difference was not run"
    );
    assert!(
        wrong.is_empty(),
        "{} of {} calls answered differently:\n{}",
        wrong.len(),
        a.len(),
        wrong.join("\n")
    );
}
