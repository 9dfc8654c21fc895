//! Loop bells: a bell of its own for each event loop that sleeps, so that
//! a peer's message for one of its connections wakes that loop and no
//! other thread.
//!
//! The process's bell is one socket: a ring on it wakes whichever thread
//! watches the reactor's set, and when that is not the loop the connection
//! belongs to (memcached's four workers, each in its own `epoll_wait`),
//! that thread turns the reactor and wakes the loop in turn: two wake-ups
//! in series per message, where TCP makes one. So a loop that sleeps
//! ([`LoopBell`], made by the shim for an epoll set) has a datagram socket
//! pair: the set watches the reading end, and each peer process gets the
//! writing end once, as mail on its bell ([`IntroKind::LoopBell`]). A side
//! whose loop sleeps says in the segment which loop bell to ring (its
//! `route`); the peer rings it there if it holds that bell, and the
//! process's bell otherwise.
//!
//! Trust: a peer holds only writing ends, as it does of the process's bell
//! (it cannot read what others rang). What a peer passes us is kept only
//! if it is a Unix datagram socket, a few per peer process, and rung with
//! `MSG_DONTWAIT` alone: a hostile one can only waste its own rings.
//!
//! [`IntroKind::LoopBell`]: crate::pairing::IntroKind::LoopBell

use std::os::fd::{AsFd, AsRawFd, BorrowedFd, OwnedFd};
use std::sync::atomic::{AtomicU32, Ordering};
use std::sync::{Arc, Weak};

use crate::sync::Lock;

/// Loop bells kept per peer process, per user other than ours and root,
/// and in all: beyond them a bell passed is closed at once (its loop is
/// rung on the process's bell), so that no peer can fill our descriptor
/// table with them.
const KEPT_PER_PEER: usize = 16;
const KEPT_PER_OTHER_USER: usize = 64;
const KEPT: usize = 1024;

/// Ids of this process's loop bells (never 0: 0 routes to the process's
/// bell).
static NEXT_ID: AtomicU32 = AtomicU32::new(1);

/// This process's loop bells: id, writing end, and the peer processes
/// (their shared pidfds) that hold it.
struct Ours {
    id: u32,
    write: Arc<OwnedFd>,
    given: Vec<Weak<OwnedFd>>,
}

static OURS: Lock<Vec<Ours>> = Lock::new(Vec::new());

/// A loop bell a peer process gave us.
struct Theirs {
    /// The peer's shared pidfd.
    peer: Weak<OwnedFd>,
    uid: u32,
    id: u32,
    write: Arc<OwnedFd>,
}

impl Theirs {
    fn of(&self, peer: &Arc<OwnedFd>) -> bool {
        is(&self.peer, peer)
    }
}

static THEIRS: Lock<Vec<Theirs>> = Lock::new(Vec::new());

/// The reading end of one event loop's bell, and its id.
#[derive(Debug)]
pub struct LoopBell {
    id: u32,
    read: OwnedFd,
    /// The process that made it (a forked child's copy is its parent's).
    pid: u32,
    /// Edges and sleeps since the rings were last taken (see [`Self::rang`]).
    edges: AtomicU32,
    sleeps: AtomicU32,
}

/// Rings are taken once per this many edges of the bell, or sleeps of its
/// loop (see [`LoopBell::rang`]).
const TAKE_EVERY_EDGES: u32 = 16;
const TAKE_EVERY_SLEEPS: u32 = 64;

impl LoopBell {
    pub fn new() -> std::io::Result<LoopBell> {
        use nix::sys::socket::{AddressFamily, SockFlag, SockType, socketpair};
        let (read, write) = socketpair(
            AddressFamily::Unix,
            SockType::Datagram,
            None,
            SockFlag::SOCK_CLOEXEC | SockFlag::SOCK_NONBLOCK,
        )
        .map_err(std::io::Error::from)?;
        let id = NEXT_ID.fetch_add(1, Ordering::Relaxed).max(1);
        OURS.lock().push(Ours {
            id,
            write: Arc::new(write),
            given: Vec::new(),
        });
        Ok(LoopBell {
            id,
            read,
            pid: crate::process::pid(),
            edges: AtomicU32::new(0),
            sleeps: AtomicU32::new(0),
        })
    }

    pub fn id(&self) -> u32 {
        self.id
    }

    /// Made by this process (not inherited through a fork)?
    pub fn made_here(&self) -> bool {
        self.pid == crate::process::pid()
    }

    /// The descriptor the loop's set watches, edge-triggered: every ring
    /// is an edge of its own (epoll queues the watch again at each
    /// arrival), so the rings need not be taken for the next to wake the
    /// loop, only before they fill the bell (a ring that finds it full
    /// goes to the process's bell instead).
    pub fn fd(&self) -> BorrowedFd<'_> {
        self.read.as_fd()
    }

    /// The set saw the bell's edge: the rings are taken now and then, not
    /// at each (a system call per wake-up was 9% of a memcached worker).
    pub fn rang(&self) {
        if self.edges.fetch_add(1, Ordering::Relaxed) + 1 >= TAKE_EVERY_EDGES {
            self.drain();
        }
    }

    /// The loop goes to sleep: now and then, the rings are taken, so that
    /// a bell whose rings all went to the process's bell (it was full)
    /// does not stay full.
    pub fn sleeps(&self) {
        if self.sleeps.fetch_add(1, Ordering::Relaxed) + 1 >= TAKE_EVERY_SLEEPS {
            self.drain();
        }
    }

    /// Take every ring that came (the rings say nothing more than that
    /// something came: the loop looks at each of its connections), a
    /// batch per system call.
    pub fn drain(&self) {
        self.edges.store(0, Ordering::Relaxed);
        self.sleeps.store(0, Ordering::Relaxed);
        const BATCH: usize = 32;
        let mut bufs = [[0u8; 8]; BATCH];
        let mut iov: [libc::iovec; BATCH] = std::array::from_fn(|_| libc::iovec {
            iov_base: std::ptr::null_mut(),
            iov_len: 0,
        });
        for (v, b) in iov.iter_mut().zip(bufs.iter_mut()) {
            v.iov_base = b.as_mut_ptr().cast();
            v.iov_len = b.len();
        }
        // SAFETY: all-zero is a valid mmsghdr (null pointers, zero lengths).
        let mut msgs: [libc::mmsghdr; BATCH] = unsafe { std::mem::zeroed() };
        for (m, v) in msgs.iter_mut().zip(iov.iter_mut()) {
            m.msg_hdr.msg_iov = v;
            m.msg_hdr.msg_iovlen = 1;
        }
        loop {
            // SAFETY: a non-blocking receive into our own buffers, each
            // header naming one of them (no control buffer: descriptors
            // sent along are closed by the kernel). By system call: the
            // preload shim's `recvmmsg` is its hook.
            let n = unsafe {
                libc::syscall(
                    libc::SYS_recvmmsg,
                    self.read.as_raw_fd(),
                    msgs.as_mut_ptr(),
                    BATCH as libc::c_uint,
                    libc::MSG_DONTWAIT,
                    std::ptr::null_mut::<libc::timespec>(),
                )
            };
            if n < BATCH as libc::c_long {
                return;
            }
        }
    }
}

impl Drop for LoopBell {
    fn drop(&mut self) {
        if self.made_here() {
            OURS.lock().retain(|o| o.id != self.id);
        }
    }
}

/// What [`to_give`] found.
pub(super) enum Giving {
    /// `peer` holds it already.
    Held,
    /// Pass it on: it counts as held from now on.
    Give(Arc<OwnedFd>),
    /// No loop bell of ours has that id (any more).
    Unknown,
}

/// Does `peer` (its shared pidfd) hold our loop bell `id`, or is it to be
/// given it now?
pub(super) fn to_give(id: u32, peer: &Arc<OwnedFd>) -> Giving {
    let mut ours = OURS.lock();
    let Some(o) = ours.iter_mut().find(|o| o.id == id) else {
        return Giving::Unknown;
    };
    o.given.retain(|p| p.strong_count() > 0);
    if o.given.iter().any(|p| is(p, peer)) {
        return Giving::Held;
    }
    o.given.push(Arc::downgrade(peer));
    Giving::Give(Arc::clone(&o.write))
}

/// Does `p` name the process of `peer`'s shared pidfd?
fn is(p: &Weak<OwnedFd>, peer: &Arc<OwnedFd>) -> bool {
    std::ptr::eq(p.as_ptr(), Arc::as_ptr(peer))
}

/// `peer` could not be given loop bell `id` after all (the mail did not go).
pub(super) fn not_given(id: u32, peer: &Arc<OwnedFd>) {
    if let Some(o) = OURS.lock().iter_mut().find(|o| o.id == id) {
        o.given.retain(|p| !is(p, peer));
    }
}

/// Keep loop bell `id` that `peer`'s process (of user `uid`) gave us, if
/// it is a Unix datagram socket and within the bounds above.
pub(super) fn take(peer: &Arc<OwnedFd>, uid: u32, id: u32, fd: OwnedFd) {
    if id == 0 || !is_unix_datagram(fd.as_fd()) {
        return;
    }
    let mut theirs = THEIRS.lock();
    theirs.retain(|t| t.peer.strong_count() > 0);
    if let Some(t) = theirs.iter_mut().find(|t| t.of(peer) && t.id == id) {
        t.write = Arc::new(fd);
        return;
    }
    let other = uid != 0 && uid != nix::unistd::geteuid().as_raw();
    if theirs.len() >= KEPT
        || theirs.iter().filter(|t| t.of(peer)).count() >= KEPT_PER_PEER
        || (other && theirs.iter().filter(|t| t.uid == uid).count() >= KEPT_PER_OTHER_USER)
    {
        return;
    }
    theirs.push(Theirs {
        peer: Arc::downgrade(peer),
        uid,
        id,
        write: Arc::new(fd),
    });
}

/// Ring `peer`'s loop bell `id`: `false` if we hold none such, it is full,
/// or it is gone (then it is forgotten), and the caller rings the
/// process's bell.
pub(super) fn ring(peer: &Arc<OwnedFd>, id: u32, token: u64) -> bool {
    let Some(fd) = THEIRS
        .lock()
        .iter()
        .find(|t| t.id == id && t.of(peer))
        .map(|t| Arc::clone(&t.write))
    else {
        return false;
    };
    match crate::driver::reactor::send_ring(fd.as_fd(), token) {
        Ok(()) => true,
        // (Full: the loop takes its rings now and then.)
        Err(e) if e.raw_os_error() == Some(libc::EAGAIN) => false,
        Err(_) => {
            THEIRS.lock().retain(|t| !(t.id == id && t.of(peer)));
            false
        }
    }
}

fn is_unix_datagram(fd: BorrowedFd<'_>) -> bool {
    use nix::sys::socket::{SockType, UnixAddr, getsockname, getsockopt, sockopt};
    getsockopt(&fd, sockopt::SockType) == Ok(SockType::Datagram)
        && getsockname::<UnixAddr>(fd.as_raw_fd()).is_ok()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn pidfd() -> Arc<OwnedFd> {
        // Any descriptor stands for a peer process here.
        Arc::new(std::fs::File::open("/dev/null").unwrap().into())
    }

    #[test]
    fn a_loop_bell_is_given_once_per_peer_and_rings_its_loop() {
        let bell = LoopBell::new().unwrap();
        let (a, b) = (pidfd(), pidfd());
        let Giving::Give(w) = to_give(bell.id(), &a) else {
            panic!("first time for a");
        };
        assert!(matches!(to_give(bell.id(), &a), Giving::Held), "a holds it");
        assert!(
            matches!(to_give(bell.id(), &b), Giving::Give(_)),
            "b did not hold it"
        );
        not_given(bell.id(), &a);
        assert!(
            matches!(to_give(bell.id(), &a), Giving::Give(_)),
            "not given after all: to give again"
        );
        assert!(matches!(
            to_give(bell.id() + 1_000_000, &b),
            Giving::Unknown
        ));
        // The peer's side: it keeps the writing end and rings it.
        let dup = w.try_clone().unwrap();
        take(&b, 0, bell.id(), dup);
        assert!(ring(&b, bell.id(), 7));
        let readable = || {
            let mut pfd = libc::pollfd {
                fd: bell.fd().as_raw_fd(),
                events: libc::POLLIN,
                revents: 0,
            };
            // SAFETY: a poll of our own pollfd, without waiting.
            unsafe { libc::poll(&mut pfd, 1, 0) == 1 }
        };
        assert!(readable(), "the loop hears it");
        bell.drain();
        assert!(!readable(), "drained");
        assert!(!ring(&a, bell.id(), 7), "a was given nothing");
        // A full bell sends its rings to the process's bell, and is kept.
        let mut rung = 0;
        while ring(&b, bell.id(), 7) {
            rung += 1;
            assert!(rung < 1 << 20, "never full");
        }
        assert!(rung > TAKE_EVERY_EDGES as usize, "holds {rung} rings");
        bell.drain();
        assert!(ring(&b, bell.id(), 7), "taken: rung there again");
        drop(bell);
        drop(w);
        assert!(!ring(&b, 0, 7));
    }

    #[test]
    fn what_a_peer_passes_is_kept_only_if_a_datagram_socket_and_bounded() {
        let p = pidfd();
        let file: OwnedFd = std::fs::File::open("/dev/null").unwrap().into();
        take(&p, 0, 5, file);
        assert!(!ring(&p, 5, 1), "a file is not kept");
        let mut kept = Vec::new();
        let mut give = |peer: &Arc<OwnedFd>, uid: u32, id: u32| {
            let b = LoopBell::new().unwrap();
            take(
                peer,
                uid,
                id,
                match to_give(b.id(), peer) {
                    Giving::Give(w) => w.try_clone().unwrap(),
                    _ => panic!("a new bell is to give"),
                },
            );
            kept.push(b);
        };
        for id in 1..=(KEPT_PER_PEER as u32 + 10) {
            give(&p, 0, id);
        }
        let held = |peer: &Arc<OwnedFd>| THEIRS.lock().iter().filter(|t| t.of(peer)).count();
        assert_eq!(held(&p), KEPT_PER_PEER, "per peer process");
        // Another user's processes, together.
        let stranger = nix::unistd::geteuid().as_raw() + 4242;
        let others: Vec<Arc<OwnedFd>> = (0..8).map(|_| pidfd()).collect();
        for q in &others {
            for id in 1..=KEPT_PER_PEER as u32 {
                give(q, stranger, id);
            }
        }
        let n: usize = others.iter().map(held).sum();
        assert_eq!(n, KEPT_PER_OTHER_USER, "per other user");
        // A bell whose loop is gone is forgotten at its first ring.
        let id = 1;
        drop(kept);
        assert!(!ring(&p, id, 1));
        assert!(!ring(&p, id, 1));
    }
}
