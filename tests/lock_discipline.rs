//! Every lock in the core and the shim is an `azsdp::sync` lock, whose
//! holder counts as inside azsdp so that the memory hooks (which run inside
//! any allocation, ours included) let it pass instead of re-entering. A bare
//! `std::sync` mutex held across an allocation froze processes at about 130
//! connections; this test keeps the whole class out. (And three more
//! classes of the same kind below: threads started without blocking
//! signals, descriptors received without owning them, thread-locals read
//! where they may be gone.)

use std::path::{Path, PathBuf};

fn sources(dir: &Path, out: &mut Vec<PathBuf>) {
    for e in std::fs::read_dir(dir).expect("source directory").flatten() {
        let p = e.path();
        if p.is_dir() {
            sources(&p, out);
        } else if p.extension().is_some_and(|x| x == "rs") {
            out.push(p);
        }
    }
}

#[test]
fn no_bare_std_locks_in_the_core_or_the_shim() {
    let root = Path::new(env!("CARGO_MANIFEST_DIR")).join("..");
    let mut files = Vec::new();
    for dir in ["azsdp/src", "azsdp/proto/src", "shim/src"] {
        sources(&root.join(dir), &mut files);
    }
    assert!(files.len() > 20, "found only {} files", files.len());
    // Our own types are `Lock` and `azsdp::sync::RwLock`: any mutex, or a
    // reader-writer lock from std, is a bare one.
    let bare = |code: &str| {
        code.contains("Mutex")
            || code.contains("parking_lot")
            || (code.contains("RwLock") && code.contains("std::sync"))
            // A Once caught mid-initialisation by a fork blocks the child
            // for ever: azsdp::fork_once instead.
            || code.contains("OnceLock")
            || code.contains("LazyLock")
            || code.contains("sync::Once")
            || (code.contains("Once::new") && !code.contains("ForkOnce::new"))
    };
    let mut found = Vec::new();
    for f in &files {
        if f.ends_with("azsdp/src/sync.rs") || f.ends_with("azsdp/src/fork_once.rs") {
            continue;
        }
        let text = std::fs::read_to_string(f).expect("read source");
        // Tests may use what they like.
        let text = text.split("#[cfg(test)]").next().unwrap_or("");
        for (n, line) in text.lines().enumerate() {
            let code = line.split("//").next().unwrap_or("");
            if bare(code) {
                found.push(format!("{}:{}: {}", f.display(), n + 1, line.trim()));
            }
        }
    }
    assert!(
        found.is_empty(),
        "use azsdp::sync::{{Lock, RwLock}} and azsdp::fork_once instead of bare std locks and onces:\n{}",
        found.join("\n")
    );
}

/// Every thread azsdp starts goes through `azsdp::threads::spawn`, which
/// blocks asynchronous signals in it: a program's SIGALRM or SIGTERM that
/// lands on one of ours would interrupt none of the program's calls.
#[test]
fn every_thread_is_started_with_signals_blocked() {
    let root = Path::new(env!("CARGO_MANIFEST_DIR")).join("..");
    let mut files = Vec::new();
    for dir in ["azsdp/src", "azsdp/proto/src", "shim/src"] {
        sources(&root.join(dir), &mut files);
    }
    let mut found = Vec::new();
    for f in &files {
        let name = f.file_name().and_then(|n| n.to_str()).unwrap_or("");
        if f.ends_with("azsdp/src/threads.rs") || name == "tests.rs" || name == "test_support.rs" {
            continue;
        }
        let text = std::fs::read_to_string(f).expect("read source");
        // Tests may start threads of their own.
        let code = text.split("#[cfg(test)]").next().unwrap_or("");
        for (n, line) in code.lines().enumerate() {
            let c = line.split("//").next().unwrap_or("");
            if c.contains("thread::spawn") || c.contains("thread::Builder") {
                found.push(format!("{}:{}: {}", f.display(), n + 1, line.trim()));
            }
        }
    }
    assert!(
        found.is_empty(),
        "start threads with azsdp::threads::spawn:\n{}",
        found.join("\n")
    );
}

/// The sans-IO core may reach no operating system: its manifest names no
/// OS crate, and its sources call none (a dependency added later, or a
/// path reaching into one, fails here before it spreads).
#[test]
fn the_sans_io_crate_depends_on_nothing_of_the_os() {
    let root = Path::new(env!("CARGO_MANIFEST_DIR")).join("..");
    let manifest =
        std::fs::read_to_string(root.join("azsdp/proto/Cargo.toml")).expect("proto manifest");
    let deps: Vec<&str> = manifest
        .split("[dependencies]")
        .nth(1)
        .expect("a [dependencies] table")
        .split("\n[")
        .next()
        .unwrap_or("")
        .lines()
        .map(str::trim)
        .filter(|l| !l.is_empty() && !l.starts_with('#'))
        .filter_map(|l| l.split(['.', '=', ' ']).next())
        .collect();
    // Pure data crates only: error derives, and the serialization of a
    // parked engine (serde's derives, postcard's encoding into a Vec).
    assert_eq!(
        deps,
        ["thiserror", "serde", "postcard"],
        "azsdp-proto's dependencies"
    );
    let mut files = Vec::new();
    sources(&root.join("azsdp/proto/src"), &mut files);
    assert!(files.len() > 10, "found only {} files", files.len());
    let os = [
        "libc::",
        "nix::",
        "memmap2",
        "linux_raw_sys",
        "std::fs",
        "std::net",
        "std::process",
        "std::os::",
        "Instant::now",
        "SystemTime",
    ];
    let mut found = Vec::new();
    for f in &files {
        let text = std::fs::read_to_string(f).expect("read source");
        for (n, line) in text.lines().enumerate() {
            let code = line.split("//").next().unwrap_or("");
            if os.iter().any(|w| code.contains(w)) {
                found.push(format!("{}:{}: {}", f.display(), n + 1, line.trim()));
            }
        }
    }
    assert!(
        found.is_empty(),
        "the sans-IO crate reaches the OS:\n{}",
        found.join("\n")
    );
}

/// Code that runs under a connection's lock must not call a libc function
/// the shim interposes on that connection's socket: in a preloaded process
/// the call re-enters the shim, which takes the same lock (socat's `exec`
/// hung on `ioctl(FIONREAD)` so). The socket beneath a connection
/// (`azsdp/src/beneath.rs`) is reached by raw system calls only.
#[test]
fn the_socket_beneath_is_reached_by_raw_system_calls_only() {
    let root = Path::new(env!("CARGO_MANIFEST_DIR")).join("..");
    let code = std::fs::read_to_string(root.join("azsdp/src/beneath.rs")).expect("beneath.rs");
    // What the shim interposes (shim/src/real.rs) and could meet here.
    let hooked = [
        "ioctl",
        "fcntl",
        "send",
        "sendto",
        "sendmsg",
        "recv",
        "recvfrom",
        "recvmsg",
        "read",
        "write",
        "readv",
        "writev",
        "shutdown",
        "close",
        "poll",
        "ppoll",
        "select",
        "dup",
        "dup2",
        "dup3",
        "getsockopt",
        "setsockopt",
    ];
    let calls: Vec<&str> = hooked
        .iter()
        .copied()
        .filter(|f| code.contains(&format!("libc::{f}(")))
        .collect();
    assert!(
        calls.is_empty(),
        "beneath.rs calls libc's hooked {calls:?}: use libc::syscall"
    );
    assert!(code.contains("libc::syscall("), "the raw calls are there");
}

/// Every message azsdp receives with control data goes through
/// `azsdp::scm`, which owns every descriptor the kernel installed before
/// anything looks at the message: a parser that gives up first (nix's
/// `cmsgs()` on a truncated message) leaked a local attacker's descriptors
/// into root servers for good.
#[test]
fn every_descriptor_received_is_owned() {
    // (The shim's `real::recvmsg` is the program's own call.)
    let found = flagged_lines(
        &["azsdp/src", "azsdp/proto/src", "shim/src", "daemon/src"],
        "azsdp/src/scm.rs",
        |code| {
            code.contains(".cmsgs(")
                || code.contains("ControlMessageOwned")
                || code.contains("libc::recvmsg")
                || code.contains("socket::recvmsg")
                || code.contains("recvmsg::<")
        },
    );
    assert!(
        found.is_empty(),
        "receive control data with azsdp::scm::recv:\n{}",
        found.join("\n")
    );
}

/// The shim's own calls of functions it interposes go to libc's
/// definitions (`real::*`), never through `libc::` (which, in a
/// preloaded process, resolves to the shim's own hook: its bookkeeping
/// runs again, on our behalf, and a look at readiness that called
/// `libc::poll` recursed until the stack overflowed). Tests may use the
/// interposed calls on purpose: only code outside `#[cfg(test)]` counts.
#[test]
fn shim_code_calls_libc_not_its_own_hooks() {
    let root = Path::new(env!("CARGO_MANIFEST_DIR")).join("..");
    let real = std::fs::read_to_string(root.join("shim/src/real.rs")).expect("real.rs");
    // The interposed functions: those `real!` declares.
    let names: Vec<String> = real
        .lines()
        .filter_map(|l| l.trim().strip_prefix("fn "))
        .filter_map(|l| l.split('(').next())
        .map(|n| n.trim().to_string())
        .filter(|n| !n.is_empty() && !n.contains(' '))
        .collect();
    assert!(
        names.iter().any(|n| n == "poll") && names.iter().any(|n| n == "fcntl"),
        "no interposed names read from real.rs: {names:?}"
    );
    let found = flagged_lines(&["shim/src"], "shim/src/real.rs", |code| {
        names
            .iter()
            .any(|name| code.contains(&format!("libc::{name}(")))
    });
    assert!(
        found.is_empty(),
        "call real::*, not the shim's own hooks:\n{}",
        found.join("\n")
    );
}

/// In the preloaded shim, the core's `libc::poll` is the shim's own hook,
/// which reads the array through the kernel and looks every descriptor up:
/// a pidfd check under a connection's lock cost four system calls, on
/// every request of an event loop. The core waits on its own descriptors
/// with `azsdp::poll_fd` (one raw `ppoll`).
#[test]
fn core_code_polls_its_own_descriptors_by_system_call() {
    let found = flagged_lines(&["azsdp/src"], "azsdp/src/poll_fd.rs", |code| {
        ["poll", "ppoll", "select", "pselect"]
            .iter()
            .any(|name| code.contains(&format!("libc::{name}(")))
    });
    assert!(
        found.is_empty(),
        "use azsdp::poll_fd, not the shim's readiness hooks:\n{}",
        found.join("\n")
    );
}

/// The same bug class for `ioctl`: the shim's hook looks the descriptor up
/// among the program's sockets first, which our own descriptors (the
/// memory-map handle, the userfaultfd) never need.
#[test]
fn core_code_makes_its_own_ioctls_by_system_call() {
    let found = flagged_lines(&["azsdp/src"], "azsdp/src/own_ioctl.rs", |code| {
        code.contains("libc::ioctl(")
    });
    assert!(
        found.is_empty(),
        "use azsdp::own_ioctl, not the shim's ioctl hook:\n{}",
        found.join("\n")
    );
}

/// The lines of code (outside `#[cfg(test)]`, comments cut) under `dirs`
/// that `bad` flags, but in the file ending with `except`; each as
/// "file:line: text".
fn flagged_lines(dirs: &[&str], except: &str, bad: impl Fn(&str) -> bool) -> Vec<String> {
    let root = Path::new(env!("CARGO_MANIFEST_DIR")).join("..");
    let mut files = Vec::new();
    for dir in dirs {
        sources(&root.join(dir), &mut files);
    }
    let mut found = Vec::new();
    for f in &files {
        if f.ends_with(except) {
            continue;
        }
        let text = std::fs::read_to_string(f).expect("read source");
        let text = text.split("#[cfg(test)]").next().unwrap_or("");
        for (n, line) in text.lines().enumerate() {
            let code = line.split("//").next().unwrap_or("");
            if bad(code) {
                found.push(format!("{}:{}: {}", f.display(), n + 1, line.trim()));
            }
        }
    }
    found
}

/// Thread-locals are read with `try_with`: the shim's code runs at
/// `exit()` (closes, destructors), after the exiting thread's locals with a
/// destructor are gone, where `with` panics. (A forked child that left with
/// `exit()` while its peer's ring was armed panicked in the doorbell's
/// `HELD.with`, and lost its connection's close.)
#[test]
fn thread_locals_are_read_with_try_with() {
    let root = Path::new(env!("CARGO_MANIFEST_DIR")).join("..");
    let mut files = Vec::new();
    for dir in ["azsdp/src", "shim/src"] {
        sources(&root.join(dir), &mut files);
    }
    let mut names = Vec::new();
    let mut texts = Vec::new();
    for f in &files {
        let text = std::fs::read_to_string(f).expect("read source");
        let text = text.split("#[cfg(test)]").next().unwrap_or("").to_string();
        let mut inside = false;
        for line in text.lines() {
            let code = line.split("//").next().unwrap_or("").trim();
            if code.starts_with("thread_local!") {
                inside = true;
            } else if inside && code.starts_with('}') {
                inside = false;
            } else if inside && let Some(rest) = code.strip_prefix("static ") {
                let name: String = rest
                    .chars()
                    .take_while(|c| c.is_alphanumeric() || *c == '_')
                    .collect();
                names.push(name);
            }
        }
        texts.push((f.clone(), text));
    }
    assert!(names.len() >= 5, "found only {names:?}");
    let mut found = Vec::new();
    for (f, text) in &texts {
        for (n, line) in text.lines().enumerate() {
            let code = line.split("//").next().unwrap_or("");
            for name in &names {
                if code.contains(&format!("{name}.with(")) {
                    found.push(format!("{}:{}: {}", f.display(), n + 1, line.trim()));
                }
            }
        }
    }
    assert!(
        found.is_empty(),
        "read thread-locals with try_with (they may be gone at exit):\n{}",
        found.join("\n")
    );
}
