//! Connections moving from the fabric onto their TCP socket
//! (docs/protocol.md §8a), and the program's descriptor after.
//!
//! A connection leaves the fabric when this process is about to `exec`
//! (the new image may not run the shim, and could not take the engine's
//! state if it did), or when the peer asks (its process is about to
//! `exec`). Both sides then write what the other has not consumed to TCP,
//! and from there on the descriptor is a plain TCP socket to the program:
//! its calls, `poll` and `epoll` go to the kernel.

use std::sync::Arc;
use std::time::Duration;

use azsdp::driver::threaded::Handed;
use azsdp::stats::TcpReason;

use crate::conn::{Conn, TcpConn};
use crate::log::{info, warning};
use crate::sock::{Role, Sock};
use crate::{epoll, fdtable};

/// `c`, upgraded on `sock`, left the fabric: make the descriptor plain TCP
/// (idempotent). The TCP connection's counter, for the caller's call.
pub fn moved(sock: &Arc<Sock>, c: &Arc<Conn>) -> Option<Arc<TcpConn>> {
    // A connection with nothing joined either way stays, rather than
    // moves: a fork, here or at the peer, ended the join (`before_fork`).
    let unjoined = c.joining_now().is_some()
        && !c.driver.tx_joined()
        && c.driver.rx_route() == azsdp::conn::RxRoute::Tcp { left: None };
    let reason = if unjoined {
        TcpReason::Forked
    } else {
        TcpReason::Switched
    };
    let server = c.role() == azsdp::conn::Role::Server;
    let t = TcpConn::new(Some(c.local), Some(c.peer), reason, server);
    if sock.replace_conn(c, Role::Tcp(Arc::clone(&t))) {
        epoll::release(sock);
        c.switched();
        if reason == TcpReason::Forked {
            info!(
                "{} -> {}: tcp (forked): a fork shared it before it joined the fabric",
                c.local, c.peer
            );
        } else {
            info!("{} -> {}: moved to its TCP socket", c.local, c.peer);
        }
    }
    match sock.role() {
        Role::Tcp(t) => Some(t),
        _ => None,
    }
}

/// The connection on `sock` if this process drives it; `None` (and the
/// descriptor made plain) once it moved onto its TCP socket, or when
/// another process runs it and this one, sharing it after a fork, has had
/// it moved there (a sandboxed process always does: it starts no thread).
pub fn driven_here(sock: &Arc<Sock>) -> Option<Arc<Conn>> {
    let c = sock.conn()?;
    if c.driver.on_tcp() {
        moved(sock, &c);
        return None;
    }
    Some(c)
}

/// How long an `exec` waits for its connections to move.
const EXEC_WAIT: Duration = Duration::from_secs(10);
/// How long a call on a connection that must move onto TCP first (one a
/// fork shares while it joins the fabric) waits for the move.
pub const LEAVE_WAIT: Duration = EXEC_WAIT;

/// This process is about to `exec`: move every connection it runs onto its
/// TCP socket (what the peer has not consumed is written there, and the
/// new image reads the rest of the peer's stream from it, whether it runs
/// the shim or not); let connections the program closed finish first.
///
/// A connection a fork left unclaimed moves only if a descriptor of it
/// survives the exec (inetd-style servers pass the socket as stdin); one
/// whose descriptors all close on exec stays with the process that uses it.
pub fn before_exec() {
    before_exec_except(&[]);
}

/// [`before_exec`] for every connection but those in `parked` (carried
/// to the new image instead: see `crate::exec_park`).
pub fn before_exec_except(parked: &[Arc<Sock>]) {
    // Pairs under way: the new image would not know of them.
    crate::pending::give_up_all(TcpReason::Switched);
    for (sock, fds) in connections_on_descriptors(&[]) {
        if parked.iter().any(|p| Arc::ptr_eq(p, &sock)) {
            continue;
        }
        let survives = !fds.is_empty();
        let Some(c) = sock.conn() else { continue };
        let ours = c.driver.is_mine() || (survives && c.driver.claim());
        if ours {
            leave_or_reset(&sock, &c, "exec");
        } else if survives && (c.driver.on_tcp() || c.driver.ask_runner_to_leave()) {
            // Served by another process after a fork: the new image will
            // not be, so that process moves it onto TCP.
            moved(&sock, &c);
        } else if !survives {
            c.driver.not_held_after_exec();
        }
    }
    crate::runtime::join_closing();
}

/// This process is about to start a program (`posix_spawn`, `system`,
/// `popen`) that inherits the descriptors that do not close on exec, and
/// `dup_sources` (the spawn's file actions give them new numbers): move
/// every connection on those onto its TCP socket, whoever runs it, since
/// the new program may use it without the shim. The others stay.
pub fn before_spawn(dup_sources: &[libc::c_int]) {
    for (sock, fds) in connections_on_descriptors(dup_sources) {
        if !fds.is_empty() {
            move_whoever_runs_it(&sock, "spawning a program");
        }
    }
}

/// This process is about to fork: a connection still joining the fabric
/// with nothing joined either way goes onto its TCP socket now, with no
/// SWITCH, so that both processes inherit a plain descriptor (a server
/// that forks right after `accept()`, as PostgreSQL's and inetd's do, has
/// not let its client join yet). One that joined in part moves later, at
/// the first call on it (`hooks::data`).
pub fn before_fork() {
    for sock in fdtable::all() {
        let Some(c) = sock.conn() else { continue };
        if c.joining_now().is_some() && c.driver.stay_on_tcp_now() {
            moved(&sock, &c);
        }
    }
}

/// This process is about to change its user or group: the peer could not
/// read a process of another user (nor it the peer), and a forked child
/// that drops root before it uses a connection (privilege-separated
/// servers) could not take it over. So every connection on its
/// descriptors moves onto its TCP socket first, while the process is
/// still who it was; connections it makes afterwards upgrade as the new
/// user.
pub fn before_identity_change() {
    for sock in fdtable::all() {
        move_whoever_runs_it(&sock, "a change of user");
    }
    azsdp::driver::delegation::leave_family();
}

/// Move the connection on `sock` onto its TCP socket: this process runs it
/// (or takes it, if a fork left it unclaimed), or asks the process that
/// runs it.
fn move_whoever_runs_it(sock: &Arc<Sock>, what: &str) {
    let Some(c) = sock.conn() else { return };
    if c.driver.is_mine() || c.driver.claim() {
        leave_or_reset(sock, &c, what);
    } else if c.driver.on_tcp() || c.driver.ask_runner_to_leave() {
        // Run by a process that shares it after a fork, which moved it.
        moved(sock, &c);
    }
}

/// Each upgraded connection on this process's descriptors, once, with
/// those of its descriptors that survive an exec (or are in `extra`).
pub fn connections_on_descriptors(extra: &[libc::c_int]) -> Vec<(Arc<Sock>, Vec<libc::c_int>)> {
    let mut seen: Vec<(Arc<Sock>, Vec<libc::c_int>)> = Vec::new();
    for (fd, sock) in fdtable::entries() {
        if sock.conn().is_none() {
            continue;
        }
        // SAFETY: F_GETFD on a descriptor the table tracks.
        let survives = extra.contains(&fd)
            || unsafe { crate::real::fcntl(fd, libc::F_GETFD, 0) } & libc::FD_CLOEXEC == 0;
        let i = match seen.iter().position(|(s, _)| Arc::ptr_eq(s, &sock)) {
            Some(i) => i,
            None => {
                seen.push((sock, Vec::new()));
                seen.len() - 1
            }
        };
        if survives {
            seen[i].1.push(fd);
        }
    }
    seen
}

/// Move `c` (this process runs it) onto its TCP socket before `what`; if
/// that cannot be done, reset it rather than let bytes go astray.
fn leave_or_reset(sock: &Arc<Sock>, c: &Arc<Conn>, what: &str) {
    if c.driver.leave_fabric(EXEC_WAIT) {
        moved(sock, c);
    } else {
        warning!(
            "{} -> {}: could not move to TCP before {what} ({:?}); reset",
            c.local,
            c.peer,
            c.driver.state()
        );
        c.beneath.reset();
    }
}

/// The program leaves by `_exit`, which runs no exit handler, but whose
/// sockets the kernel would still close and deliver: connections this
/// process serves for others after a fork move onto their TCP socket
/// first (see `azsdp::driver::delegation`), then every connection it runs
/// that no fork copied is closed and finishes what the program sent, as
/// at `exit()`. Without this the peer would find pages advertised by a
/// process that is gone, and reset.
///
/// `_exit` may be called from a signal handler that interrupted a thread
/// holding one of our locks: the finishing runs on a thread of its own,
/// and the exit goes on without it after the longest linger time (and a
/// second).
pub fn before_exit_without_handlers() {
    // The hand-over to the processes this one serves runs here, on the
    // exiting thread, as it always has.
    hand_over();
    // In a sandbox every connection is on TCP already, and a filter may
    // kill the thread that tries to start one.
    if azsdp::sandbox::restricted() {
        return;
    }
    let (done, finished) = std::sync::mpsc::sync_channel::<()>(1);
    let work = move || {
        finish_own();
        let _ = done.send(());
    };
    if azsdp::threads::spawn("azsdp-exit", work).is_ok() {
        let bound = crate::runtime::longest_linger() + EXIT_SLACK;
        let _ = finished.recv_timeout(bound);
    }
}

/// What an `_exit` waits beyond the longest linger time.
const EXIT_SLACK: Duration = Duration::from_secs(1);

fn hand_over() {
    for sock in fdtable::all() {
        let Some(c) = sock.conn() else { continue };
        if c.driver.serves_others() {
            match c.driver.hand_to_others(EXEC_WAIT) {
                Handed::Moved => {
                    moved(&sock, &c);
                }
                Handed::Ended => {}
                Handed::Failed => warning!(
                    "{} -> {}: could not move to TCP before exit ({:?}); reset",
                    c.local,
                    c.peer,
                    c.driver.state()
                ),
            }
        }
    }
    crate::runtime::join_closing_served();
}

fn finish_own() {
    // Only the connections whose engine is here and that no fork copied:
    // the kernel closes a socket when its last descriptor goes, and a
    // process forked with one may still use it (it carries on as after a
    // runner's death, docs/shim.md "Fork and exec"); a guest's copy, or a
    // forked child's it never used, is the running process's.
    // (`is_mine` first: `on_tcp` would claim a copy this process never
    // used, taking it from the process that runs it.)
    let (shared, own): (Vec<Arc<Conn>>, Vec<Arc<Conn>>) = fdtable::all()
        .iter()
        .filter_map(|s| s.conn())
        .filter(|c| c.driver.is_mine() && !c.driver.on_tcp())
        .partition(|c| c.driver.shared_by_fork());
    for c in &own {
        c.close();
    }
    crate::runtime::join_closing();
    // What the shared ones this process ran did is still said.
    for c in &shared {
        c.report();
    }
}

/// The program is about to install a seccomp filter, which allows the
/// calls it makes, not ours (threads, `process_vm_readv`, `/proc` reads):
/// move every connection on its descriptors onto its TCP socket first,
/// the ones this process runs and the ones it shares after a fork with the
/// process that runs them. From then on its sockets are the kernel's.
pub fn before_sandbox() {
    for sock in fdtable::all() {
        let Some(c) = sock.conn() else { continue };
        let mine = c.driver.is_mine();
        if mine {
            leave_or_reset(&sock, &c, "a seccomp sandbox");
        } else if c.driver.on_tcp() || c.driver.ask_runner_to_leave() {
            moved(&sock, &c);
        }
    }
    azsdp::driver::delegation::leave_family();
}
