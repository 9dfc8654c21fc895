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
//! A loop that is awake needs no ring: it looks at its connections
//! before it sleeps again. So each loop bell comes with a page that
//! counts the loop's threads asleep on it ([`Sleepers`]), mapped
//! read-only by the peers that hold the bell, and a peer rings only a
//! loop that sleeps. (Without it a loop woken by one connection was rung
//! again by each of its other connections that had a message meanwhile:
//! nginx's workers rang ab's loop 0.61 times a request, where ab entered
//! `epoll_pwait` 0.24 times.) The page also numbers the loop's sleeps, and a peer
//! process rings a loop with one sleeper once per sleep: its first ring
//! wakes it, and what comes after, the loop sees before it sleeps again.
//! The order that keeps this free of lost wake-ups, as the doorbell's
//! arming is: a loop counts itself asleep, then looks at each connection;
//! a peer posts, then reads the count.
//!
//! Trust: a peer holds only writing ends, as it does of the process's bell
//! (it cannot read what others rang), and a page sealed against writes
//! (`F_SEAL_FUTURE_WRITE`: it cannot say a loop is awake that sleeps).
//! What a peer passes us is kept only if it is a Unix datagram socket, a
//! few per peer process, and rung with `MSG_DONTWAIT` alone: a hostile one
//! can only waste its own rings; its page is read only if sealed against
//! shrinking (no SIGBUS), and it can only keep its own loop from being
//! rung.
//!
//! [`IntroKind::LoopBell`]: crate::pairing::IntroKind::LoopBell

use std::os::fd::{AsFd, AsRawFd, BorrowedFd, OwnedFd};
use std::sync::atomic::{AtomicU32, AtomicU64, Ordering};
use std::sync::{Arc, Weak};

use memmap2::{Mmap, MmapMut, MmapOptions};

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

/// This process's loop bells: id, writing end, sleepers' page, and the
/// peer processes (their shared pidfds) that hold it.
struct Ours {
    id: u32,
    write: Arc<OwnedFd>,
    page: Option<Arc<OwnedFd>>,
    given: Vec<Weak<OwnedFd>>,
}

/// The length of a sleepers' page (the count is its first word, the
/// number of the last sleep its second).
const PAGE_LEN: usize = 4096;

/// The count and the sleep number in a sleepers' page.
///
/// # Safety
/// `page` must point at a mapping of at least [`PAGE_LEN`] bytes, page
/// aligned, that outlives the returned references.
unsafe fn words<'a>(page: *const u8) -> (&'a AtomicU32, &'a AtomicU32) {
    // SAFETY: in bounds and aligned per the caller; any bit pattern is a
    // valid AtomicU32.
    unsafe {
        (
            &*page.cast::<AtomicU32>(),
            &*page.add(4).cast::<AtomicU32>(),
        )
    }
}

/// How many threads sleep on a loop bell, and how many sleeps began: the
/// first words of a page the loop shares with its peers (see the module's
/// doc).
#[derive(Debug)]
pub struct Sleepers {
    map: MmapMut,
}

impl Sleepers {
    /// A fresh page and its memfd, sealed so that only this mapping
    /// writes it.
    fn new() -> std::io::Result<(Arc<Sleepers>, OwnedFd)> {
        use nix::fcntl::SealFlag;
        let (fd, map) = super::sealed::create(
            c"azsdp-loop",
            PAGE_LEN,
            SealFlag::F_SEAL_SHRINK
                | SealFlag::F_SEAL_GROW
                | SealFlag::F_SEAL_FUTURE_WRITE
                | SealFlag::F_SEAL_SEAL,
        )?;
        Ok((Arc::new(Sleepers { map }), fd))
    }

    fn count(&self) -> &AtomicU32 {
        // SAFETY: the mapping is PAGE_LEN bytes, page-aligned, and lives
        // as long as self.
        unsafe { words(self.map.as_ptr()) }.0
    }

    /// A thread of the loop is about to look at its connections and
    /// sleep: counted asleep until the guard drops (once it woke).
    pub fn asleep(self: &Arc<Self>) -> Asleep {
        // SAFETY: as in `count`.
        let (count, sleeps) = unsafe { words(self.map.as_ptr()) };
        sleeps.fetch_add(1, Ordering::SeqCst);
        count.fetch_add(1, Ordering::SeqCst);
        // Before the looks at the connections that follow (see the
        // module's doc; pairs with the fence in `wake_peer`).
        std::sync::atomic::fence(Ordering::SeqCst);
        Asleep(Arc::clone(self))
    }
}

/// One thread counted asleep on a loop bell (see [`Sleepers::asleep`]).
#[derive(Debug)]
pub struct Asleep(Arc<Sleepers>);

impl Drop for Asleep {
    fn drop(&mut self) {
        self.0.count().fetch_sub(1, Ordering::Release);
    }
}

static OURS: Lock<Vec<Ours>> = Lock::new(Vec::new());

/// A loop bell a peer process gave us.
struct Theirs {
    /// The peer's shared pidfd.
    peer: Weak<OwnedFd>,
    uid: u32,
    id: u32,
    /// Replaced whole when the peer gives the bell again.
    bell: Arc<TheirBell>,
}

/// What [`ring`] needs of a peer's loop bell, taken out of [`THEIRS`]
/// with one clone.
struct TheirBell {
    write: OwnedFd,
    /// Its loop's sleepers' page, mapped read-only (`None`: it gave none
    /// we could map: its loop is rung whether or not it sleeps).
    sleepers: Option<Mmap>,
    /// The sleep this process last rang it for ([`RUNG`] and its number;
    /// 0: none).
    rung: AtomicU64,
}

/// Marks [`Theirs::rung`] as set.
const RUNG: u64 = 1 << 32;

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
    /// Its loop's sleepers (`None`: no page could be made; peers then
    /// ring it whether or not it sleeps).
    sleepers: Option<Arc<Sleepers>>,
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
        let (sleepers, page) = match Sleepers::new() {
            Ok((s, page)) => (Some(s), Some(Arc::new(page))),
            Err(_) => (None, None),
        };
        OURS.lock().push(Ours {
            id,
            write: Arc::new(write),
            page,
            given: Vec::new(),
        });
        Ok(LoopBell {
            id,
            read,
            sleepers,
            pid: crate::process::pid(),
            edges: AtomicU32::new(0),
            sleeps: AtomicU32::new(0),
        })
    }

    pub fn id(&self) -> u32 {
        self.id
    }

    /// Count the calling thread asleep on this bell until the guard
    /// drops (see [`Sleepers::asleep`]); `None` if peers ring it anyway.
    /// A forked child's copy counts on its parent's page: the bell's
    /// edges wake whichever of them sleeps in the set they share.
    pub fn asleep(&self) -> Option<Asleep> {
        self.sleepers.as_ref().map(Sleepers::asleep)
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
    /// Pass on its writing end and its sleepers' page: it counts as held
    /// from now on.
    Give(Arc<OwnedFd>, Option<Arc<OwnedFd>>),
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
    Giving::Give(Arc::clone(&o.write), o.page.clone())
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
/// it is a Unix datagram socket and within the bounds above, with its
/// sleepers' `page` if that is one we can read safely.
pub(super) fn take(peer: &Arc<OwnedFd>, uid: u32, id: u32, fd: OwnedFd, page: Option<OwnedFd>) {
    if id == 0 || !is_unix_datagram(fd.as_fd()) {
        return;
    }
    let bell = Arc::new(TheirBell {
        write: fd,
        sleepers: page.and_then(map_sleepers),
        rung: AtomicU64::new(0),
    });
    let mut theirs = THEIRS.lock();
    theirs.retain(|t| t.peer.strong_count() > 0);
    if let Some(t) = theirs.iter_mut().find(|t| t.of(peer) && t.id == id) {
        t.bell = bell;
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
        bell,
    });
}

/// A peer's sleepers' page, mapped read-only: only a memfd sealed against
/// shrinking (a file cut under our mapping would raise SIGBUS at a read),
/// at least a page long.
fn map_sleepers(fd: OwnedFd) -> Option<Mmap> {
    use nix::fcntl::{FcntlArg, SealFlag, fcntl};
    let seals = SealFlag::from_bits_truncate(fcntl(&fd, FcntlArg::F_GET_SEALS).ok()?);
    if !seals.contains(SealFlag::F_SEAL_SHRINK) {
        return None;
    }
    let file = std::fs::File::from(fd);
    if file.metadata().ok()?.len() < PAGE_LEN as u64 {
        return None;
    }
    // SAFETY: a read-only shared mapping of a memfd that cannot shrink
    // below PAGE_LEN; only its first word is read, by an atomic load (any
    // value the peer wrote is a valid count).
    unsafe { MmapOptions::new().len(PAGE_LEN).map(&file) }.ok()
}

/// What [`ring`] did.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum Rang {
    /// Rung.
    Yes,
    /// Not rung: no thread of the loop sleeps, or its one sleeper was
    /// rung by this process already (it looks before it sleeps again).
    Awake,
    /// We hold no such bell, it is full, or it is gone (then it is
    /// forgotten): the caller rings the process's bell.
    No,
}

/// Ring `peer`'s loop bell `id` if its loop sleeps. The caller has
/// published its message and fenced (see the module's doc).
pub(super) fn ring(peer: &Arc<OwnedFd>, id: u32, token: u64) -> Rang {
    let found = THEIRS
        .lock()
        .iter()
        .find(|t| t.id == id && t.of(peer))
        .map(|t| Arc::clone(&t.bell));
    let Some(bell) = found else {
        return Rang::No;
    };
    let mut sleep = None;
    if let Some(page) = bell.sleepers.as_ref() {
        // SAFETY: the mapping is PAGE_LEN bytes and page-aligned (see
        // `map_sleepers`) and lives while `bell` does.
        let (count, sleeps) = unsafe { words(page.as_ptr()) };
        match count.load(Ordering::SeqCst) {
            0 => return Rang::Awake,
            // One sleeper, rung for this sleep already: our ring is in
            // its bell (several sleepers: each may need a ring).
            1 => {
                let now = RUNG | u64::from(sleeps.load(Ordering::SeqCst));
                if bell.rung.load(Ordering::Relaxed) == now {
                    return Rang::Awake;
                }
                sleep = Some(now);
            }
            _ => {}
        }
    }
    match crate::driver::reactor::send_ring(bell.write.as_fd(), token) {
        Ok(()) => {
            if let Some(now) = sleep {
                bell.rung.store(now, Ordering::Relaxed);
            }
            Rang::Yes
        }
        // (Full: the loop takes its rings now and then.)
        Err(e) if e.raw_os_error() == Some(libc::EAGAIN) => Rang::No,
        Err(_) => {
            THEIRS.lock().retain(|t| !(t.id == id && t.of(peer)));
            Rang::No
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
        let Giving::Give(w, page) = to_give(bell.id(), &a) else {
            panic!("first time for a");
        };
        assert!(matches!(to_give(bell.id(), &a), Giving::Held), "a holds it");
        assert!(
            matches!(to_give(bell.id(), &b), Giving::Give(..)),
            "b did not hold it"
        );
        not_given(bell.id(), &a);
        assert!(
            matches!(to_give(bell.id(), &a), Giving::Give(..)),
            "not given after all: to give again"
        );
        assert!(matches!(
            to_give(bell.id() + 1_000_000, &b),
            Giving::Unknown
        ));
        // The peer's side: it keeps the writing end and the sleepers'
        // page, and rings the loop while it sleeps.
        let dup = w.try_clone().unwrap();
        let page = page.expect("a sleepers' page").try_clone().unwrap();
        take(&b, 0, bell.id(), dup, Some(page));
        let _asleep = bell.asleep().expect("counted");
        let readable = || {
            let mut pfd = libc::pollfd {
                fd: bell.fd().as_raw_fd(),
                events: libc::POLLIN,
                revents: 0,
            };
            // SAFETY: a poll of our own pollfd, without waiting.
            unsafe { libc::poll(&mut pfd, 1, 0) == 1 }
        };
        assert_eq!(ring(&b, bell.id(), 7), Rang::Yes);
        assert!(readable(), "the loop hears it");
        bell.drain();
        assert!(!readable(), "drained");
        assert_eq!(ring(&a, bell.id(), 7), Rang::No, "a was given nothing");
        // A full bell sends its rings to the process's bell, and is kept
        // (two sleepers: every ring goes).
        let _also = bell.asleep().expect("counted");
        let mut rung = 0;
        while ring(&b, bell.id(), 7) == Rang::Yes {
            rung += 1;
            assert!(rung < 1 << 20, "never full");
        }
        assert!(rung > TAKE_EVERY_EDGES as usize, "holds {rung} rings");
        bell.drain();
        assert_eq!(ring(&b, bell.id(), 7), Rang::Yes, "taken: rung there again");
        drop((_asleep, _also));
        drop(bell);
        drop(w);
        assert_eq!(ring(&b, 0, 7), Rang::No);
    }

    #[test]
    fn what_a_peer_passes_is_kept_only_if_a_datagram_socket_and_bounded() {
        let p = pidfd();
        let file: OwnedFd = std::fs::File::open("/dev/null").unwrap().into();
        take(&p, 0, 5, file, None);
        assert_eq!(ring(&p, 5, 1), Rang::No, "a file is not kept");
        let mut kept = Vec::new();
        let mut give = |peer: &Arc<OwnedFd>, uid: u32, id: u32| {
            let b = LoopBell::new().unwrap();
            take(
                peer,
                uid,
                id,
                match to_give(b.id(), peer) {
                    Giving::Give(w, _) => w.try_clone().unwrap(),
                    _ => panic!("a new bell is to give"),
                },
                None,
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
        // A bell whose loop is gone is forgotten at the first ring that
        // finds it gone (a child another test forks holds a copy of its
        // socket until it execs, so that may take a moment).
        let id = 1;
        drop(kept);
        let deadline = std::time::Instant::now() + std::time::Duration::from_secs(10);
        while ring(&p, id, 1) == Rang::Yes {
            assert!(
                std::time::Instant::now() < deadline,
                "rung long after its loop went"
            );
            std::thread::sleep(std::time::Duration::from_millis(1));
        }
        assert_eq!(ring(&p, id, 1), Rang::No);
    }

    #[test]
    fn a_loop_is_rung_only_while_it_sleeps_and_no_peer_can_say_otherwise() {
        let bell = LoopBell::new().unwrap();
        let peer = pidfd();
        let Giving::Give(w, page) = to_give(bell.id(), &peer) else {
            panic!("a new bell is to give");
        };
        let page = page.expect("a sleepers' page");
        take(
            &peer,
            0,
            bell.id(),
            w.try_clone().unwrap(),
            Some(page.try_clone().unwrap()),
        );
        assert_eq!(ring(&peer, bell.id(), 1), Rang::Awake, "awake: no ring");
        // One sleeper: rung once per sleep.
        let one = bell.asleep().expect("counted");
        assert_eq!(ring(&peer, bell.id(), 1), Rang::Yes, "asleep: rung");
        assert_eq!(ring(&peer, bell.id(), 2), Rang::Awake, "rung already");
        drop(one);
        let one = bell.asleep().expect("counted");
        assert_eq!(ring(&peer, bell.id(), 1), Rang::Yes, "the next sleep");
        // Several sleepers: each ring goes (each may wake one of them).
        let two = bell.asleep().expect("counted");
        assert_eq!(ring(&peer, bell.id(), 1), Rang::Yes, "two sleep");
        assert_eq!(ring(&peer, bell.id(), 1), Rang::Yes, "two sleep");
        drop(one);
        assert_eq!(ring(&peer, bell.id(), 1), Rang::Yes, "one still sleeps");
        drop(two);
        assert_eq!(ring(&peer, bell.id(), 1), Rang::Awake);
        // The page is the loop's alone to write: a peer can neither write
        // it nor map it writable.
        let mut f = std::fs::File::from(page.try_clone().unwrap());
        use std::io::Write;
        assert!(f.write_all(&[0xff; 4]).is_err(), "written by a peer");
        // SAFETY: an attempt to map the page writable, expected to fail.
        let writable = unsafe { MmapOptions::new().len(PAGE_LEN).map_mut(&f) };
        assert!(writable.is_err(), "mapped writable by a peer");
        // A page that could shrink under the mapping is not read: its
        // loop is rung whatever it says.
        let loose =
            nix::sys::memfd::memfd_create(c"loose", nix::sys::memfd::MFdFlags::empty()).unwrap();
        std::fs::File::from(loose.try_clone().unwrap())
            .set_len(PAGE_LEN as u64)
            .unwrap();
        take(&peer, 0, bell.id(), w.try_clone().unwrap(), Some(loose));
        assert_eq!(ring(&peer, bell.id(), 1), Rang::Yes, "unsealed: rung");
    }
}
