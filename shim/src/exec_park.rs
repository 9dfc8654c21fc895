//! Connections carried across `exec` (docs/shim.md, "exec").
//!
//! Before an exec whose new image will run the shim ([`next_image`]), each
//! connection this process runs that a surviving descriptor names is
//! **parked**: its engine waits until it is quiet (no call in progress,
//! the peer done reading our pages), is serialized, and is held still
//! while the exec runs. A record of them (engine, the endpoint's
//! inherited descriptors, the program's descriptors naming it, addresses,
//! options) goes into a memfd the new image inherits, whose number is in
//! the environment the exec passes (`AZSDP_PARKED`). The new image's shim
//! takes each one up as it loads, before the program's `main`, and takes
//! the variable out of the environment. If the exec fails, it is all
//! undone and the connections go on in this image.
//!
//! Every other connection is handled as before any exec: moved onto its
//! TCP socket ([`crate::switch::before_exec`]). So is one the new program
//! gets as a standard stream (descriptor 0, 1 or 2, as inetd-style servers
//! pass it): programs use stdio on those, and libc's stdio reads and
//! writes the descriptor without passing through the shim.
//!
//! `unsafe` here: the environment arrays handed to the real exec, the
//! inherited record's descriptor.

use std::ffi::{CStr, CString, c_char};
use std::io::{Read, Seek, Write};
use std::net::SocketAddr;
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd};
use std::sync::Arc;
use std::sync::atomic::Ordering;
use std::time::Duration;

use azsdp::conn::Role as EngineRole;
use azsdp::fabric::shm::{ParkedEndpoint, ShmEndpoint};
use serde::{Deserialize, Serialize};

use crate::conn::Conn;
use crate::endpoint::AnyEndpoint;
use crate::log::{debug, info, warning};
use crate::next_image::{self, Target};
use crate::sock::{Role, Sock};
use crate::{fdtable, real};

/// The environment variable naming the record's descriptor.
const VAR: &str = "AZSDP_PARKED";

/// How long an exec waits for a connection to be quiet enough to park
/// (the peer reading what we advertised); after that it moves onto TCP.
const PARK_WAIT: Duration = Duration::from_secs(2);

#[derive(Debug, Default, Serialize, Deserialize)]
struct Record {
    conns: Vec<ParkedConn>,
}

#[derive(Debug, Serialize, Deserialize)]
struct ParkedConn {
    /// The program's descriptors naming the connection.
    fds: Vec<i32>,
    family: i32,
    server: bool,
    local: SocketAddr,
    peer: SocketAddr,
    rcvtimeo: Option<Duration>,
    sndtimeo: Option<Duration>,
    linger_abort: bool,
    engine: Vec<u8>,
    endpoint: ParkedEndpoint,
}

/// A memfd the next image inherits (closed as it takes the record up),
/// holding `bytes`.
fn record_file(bytes: &[u8]) -> std::io::Result<OwnedFd> {
    // SAFETY: memfd_create with a static name; the descriptor is ours.
    let fd = unsafe { libc::memfd_create(c"azsdp-parked".as_ptr(), 0) };
    if fd < 0 {
        return Err(std::io::Error::last_os_error());
    }
    // SAFETY: a fresh descriptor nothing else owns.
    let mut f = std::fs::File::from(unsafe { OwnedFd::from_raw_fd(fd) });
    f.write_all(bytes)?;
    f.rewind()?;
    Ok(OwnedFd::from(f))
}

/// Run `exec` (the real call, given the environment it is to pass) with
/// every connection of this process made ready for it: parked for the
/// new image if that runs the shim, moved onto TCP otherwise. If `exec`
/// returns (it failed), the parked connections go on here.
///
/// # Safety
/// `envp` is null or a valid NULL-terminated environment array.
pub unsafe fn exec(
    target: Target<'_>,
    envp: *const *const c_char,
    exec: impl FnOnce(*const *const c_char) -> libc::c_int,
) -> libc::c_int {
    // SAFETY: the caller's environment array.
    let env = unsafe { next_image::entries(envp) };
    let mut exec = Some(exec);
    let prepared = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
        park_then(target, &env, |new_envp| {
            let run = exec.take().expect("run once");
            run(new_envp)
        })
    }));
    match prepared {
        Ok(Some(r)) => r,
        // Nothing to park, or an internal error: the connections move
        // onto TCP as before any exec.
        _ => {
            let _keep = real::KeepErrno::new();
            let _ = std::panic::catch_unwind(crate::switch::before_exec);
            drop(_keep);
            match exec.take() {
                Some(run) => run(envp),
                // It ran and failed (errno is its own).
                None => -1,
            }
        }
    }
}

/// Park what can be parked and run `exec` with the record in its
/// environment; `None` (nothing ran) when nothing was parked.
fn park_then(
    target: Target<'_>,
    env: &[&CStr],
    exec: impl FnOnce(*const *const c_char) -> libc::c_int,
) -> Option<libc::c_int> {
    if let Err(why) = next_image::runs_shim(target, env) {
        debug!(
            "exec: connections move to their TCP sockets: the new program would not run azsdp ({why})"
        );
        return None;
    }
    let candidates: Vec<(Arc<Sock>, Arc<Conn>, Vec<i32>)> =
        crate::switch::connections_on_descriptors(&[])
            .into_iter()
            .filter(|(_, fds)| !fds.is_empty())
            // On a standard stream the new program may well use stdio, whose
            // writes and reads libc makes without passing through the shim:
            // such a connection moves onto TCP, where stdio works.
            .filter(|(_, fds)| !fds.iter().any(|&fd| (0..=2).contains(&fd)))
            .filter_map(|(sock, fds)| {
                let c = sock.conn()?;
                // One still joining keeps what went over TCP in this
                // image's memory: it moves onto TCP instead.
                let parkable = c.joining_now().is_none();
                (parkable && (c.driver.is_mine() || c.driver.claim())).then_some((sock, c, fds))
            })
            .collect();
    let mut holds = Vec::new();
    let mut inherit: Vec<OwnedFd> = Vec::new();
    let mut record = Record::default();
    let mut parked: Vec<Arc<Sock>> = Vec::new();
    for (sock, c, fds) in &candidates {
        match c
            .driver
            .park(PARK_WAIT, |e| e.shm().and_then(ShmEndpoint::park))
        {
            Ok(p) => {
                let (engine, (endpoint, fds_to_pass)) = (p.engine, p.fabric);
                holds.push(p.hold);
                inherit.extend(fds_to_pass);
                let o = sock.opts();
                record.conns.push(ParkedConn {
                    fds: fds.clone(),
                    family: sock.family,
                    server: c.role() == EngineRole::Server,
                    local: c.local,
                    peer: c.peer,
                    rcvtimeo: o.rcvtimeo,
                    sndtimeo: o.sndtimeo,
                    linger_abort: o.linger_abort,
                    engine,
                    endpoint,
                });
                parked.push(Arc::clone(sock));
            }
            Err(why) => info!(
                "{} -> {}: moves to its TCP socket for the exec: cannot park ({why}; \
                 a connection keeps its segment's descriptor only if its socket was not \
                 close-on-exec when it was upgraded, within the descriptor budget)",
                c.local, c.peer
            ),
        }
    }
    if record.conns.is_empty() {
        return None;
    }
    // The rest as before any exec (they skip the parked ones: locked
    // still, and their state is the record's).
    crate::switch::before_exec_except(&parked);
    let bytes = postcard::to_stdvec(&record).ok()?;
    let file = record_file(&bytes).ok()?;
    let entry = CString::new(format!("{VAR}={}", file.as_raw_fd())).ok()?;
    let mut new_env: Vec<*const c_char> = env
        .iter()
        .filter(|e| !e.to_bytes().starts_with(VAR.as_bytes()))
        .map(|e| e.as_ptr())
        .collect();
    new_env.push(entry.as_ptr());
    new_env.push(std::ptr::null());
    for c in &record.conns {
        info!(
            "{} -> {}: parked for the program this process execs ({} bytes of engine)",
            c.local,
            c.peer,
            c.engine.len()
        );
    }
    let r = exec(new_env.as_ptr());
    // The exec failed: everything goes on here.
    let _keep = real::KeepErrno::new();
    drop(holds);
    drop(inherit);
    drop(file);
    warning!(
        "exec failed ({}): {} parked connection(s) go on in this program",
        std::io::Error::last_os_error(),
        record.conns.len()
    );
    Some(r)
}

/// As the library loads: take up the connections the previous image of
/// this process parked for us, if it did.
pub fn take_up() {
    let Some(v) = std::env::var_os(VAR) else {
        return;
    };
    // SAFETY: the library's constructor runs before the program's `main`,
    // with no other thread of ours; the variable is ours.
    unsafe { std::env::remove_var(VAR) };
    let Some(fd) = v.to_str().and_then(|s| s.parse::<i32>().ok()) else {
        warning!("{VAR} is not a descriptor number; ignored");
        return;
    };
    // Only our record is taken (and closed): a variable set by hand must
    // not make us read, then close, a descriptor of the program's.
    let is_record = std::fs::read_link(format!("/proc/self/fd/{fd}"))
        .is_ok_and(|p| p.as_os_str() == "/memfd:azsdp-parked (deleted)");
    if !is_record {
        warning!("{VAR} names no parked record; ignored");
        return;
    }
    // SAFETY: the previous image left `fd` (the record) for us alone.
    let mut f = std::fs::File::from(unsafe { OwnedFd::from_raw_fd(fd) });
    let mut bytes = Vec::new();
    let record: Record = match f
        .read_to_end(&mut bytes)
        .map_err(|e| e.to_string())
        .and_then(|_| postcard::from_bytes(&bytes).map_err(|e| e.to_string()))
    {
        Ok(r) => r,
        Err(e) => {
            warning!("the connections the previous program parked cannot be read ({e})");
            return;
        }
    };
    drop(f);
    for pc in record.conns {
        take_up_one(pc);
    }
}

fn take_up_one(pc: ParkedConn) {
    let Some(&fd) = pc.fds.first() else { return };
    let role = if pc.server {
        EngineRole::Server
    } else {
        EngineRole::Client
    };
    let (ip, port) = if pc.server {
        (pc.peer.ip(), pc.local.port())
    } else {
        (pc.peer.ip(), pc.peer.port())
    };
    let settings = crate::hooks::settings_for(role, ip, port).unwrap_or_default();
    let resumed = ShmEndpoint::unpark(&pc.endpoint)
        .map_err(|e| e.to_string())
        .and_then(|ep| {
            Conn::resume(
                &pc.engine,
                AnyEndpoint::Shm(ep),
                fd,
                role,
                &settings,
                pc.local,
                pc.peer,
            )
            .map_err(|e| e.to_string())
        });
    let c = match resumed {
        Ok(c) => c,
        Err(e) => {
            warning!(
                "{} -> {}: cannot take up the connection the previous program parked ({e}); \
                 its peer sees it end",
                pc.local,
                pc.peer
            );
            return;
        }
    };
    // SAFETY: F_GETFL on the inherited descriptor.
    let fl = unsafe { crate::real::fcntl(fd, libc::F_GETFL, 0) };
    let sock = Sock::new(pc.family, fl >= 0 && fl & libc::O_NONBLOCK != 0);
    {
        let mut o = sock.opts.lock();
        o.rcvtimeo = pc.rcvtimeo;
        o.sndtimeo = pc.sndtimeo;
        o.linger_abort = pc.linger_abort;
    }
    sock.fds.store(pc.fds.len(), Ordering::SeqCst);
    info!(
        "{} -> {}: taken up from the program before the exec",
        pc.local, pc.peer
    );
    sock.set_role(Role::Azsdp(c));
    for &d in &pc.fds {
        fdtable::insert(d, Arc::clone(&sock));
    }
}
