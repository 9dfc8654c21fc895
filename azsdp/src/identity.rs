//! Who is at the other end of a Unix socket, as the kernel says, pinned.
//!
//! Every decision about a peer (may we pair, whose memory do GETs read,
//! who runs the peer side after a fork) rests on an identity the kernel
//! vouches for, never on bytes the peer wrote. A message that carries an
//! identity ([`send`]) has two control messages:
//!
//! - `SCM_CREDENTIALS`: pid, uid and gid, which the kernel checks at
//!   `sendmsg` (a process can only send its own, without CAP_SYS_ADMIN /
//!   CAP_SETUID);
//! - `SCM_RIGHTS`, whose first descriptor is a pidfd of the sender.
//!
//! The receiver ([`recv`]) checks that the pidfd names the process the
//! credentials name. At `sendmsg` the sender was alive with that pid, and
//! no two live processes share a pid, so a pidfd that names that pid names
//! the sender: from then on the pidfd pins it, and a pid it reads memory
//! from is the verified one ([`PeerId::alive`] after the read proves the
//! pid was not reused meanwhile).
//!
//! `unsafe` here: the `pidfd_open`, `pidfd_getfd` and `pidfd_send_signal`
//! system calls.

use std::io::IoSlice;
use std::os::fd::{AsFd, AsRawFd, BorrowedFd, FromRawFd, OwnedFd, RawFd};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Weak};
use std::time::Duration;

use crate::sync::Lock;

use nix::sys::socket::{ControlMessage, MsgFlags, UnixCredentials, sendmsg, setsockopt, sockopt};

/// Most descriptors one identity message carries after the pidfd.
pub const MAX_FDS: usize = 3;

/// A peer process, verified by the kernel and pinned by a pidfd. Every
/// connection to one process shares one pidfd ([`PeerId::pidfd_shared`]):
/// ten thousand connections to one peer hold one descriptor for it.
/// A clone pins the same pidfd.
#[derive(Clone, Debug)]
pub struct PeerId {
    pid: u32,
    uid: u32,
    gid: u32,
    pin: Arc<Pin>,
}

/// A process's pidfd, shared by every connection to it, and when one of
/// them last found the process alive.
#[derive(Debug)]
struct Pin {
    fd: Arc<OwnedFd>,
    /// The time ([`since_epoch`]) of the last check that found the
    /// process alive (0: none yet); `u64::MAX` once one found it gone.
    seen_alive: AtomicU64,
}

/// [`Pin::seen_alive`] of a process that has exited (for good).
const EXITED: u64 = u64::MAX;

impl Pin {
    fn new(fd: OwnedFd) -> Arc<Pin> {
        Arc::new(Pin {
            fd: Arc::new(fd),
            seen_alive: AtomicU64::new(0),
        })
    }
}

/// The clock of [`Pin::seen_alive`] (at least 1: 0 means "never").
fn since_epoch() -> u64 {
    crate::monotonic::now_ns().max(1)
}

/// The pidfds of the peers this process knows (by pid), for sharing.
static PIDFDS: Lock<Vec<(u32, Weak<Pin>)>> = Lock::new(Vec::new());

/// One pidfd per live process: `fresh` names `pid` (verified); if a pidfd
/// of ours already pins `pid` and it is still alive, that process is this
/// one (a live process's pid names no other), and its pidfd is shared.
fn shared_pidfd(pid: u32, fresh: OwnedFd) -> Arc<Pin> {
    let mut known = PIDFDS.lock();
    known.retain(|(_, w)| w.strong_count() > 0);
    if let Some(have) = known
        .iter()
        .filter(|(p, _)| *p == pid)
        .find_map(|(_, w)| w.upgrade())
        .filter(|pin| !pidfd_exited(pin.fd.as_fd()))
    {
        return have;
    }
    let pin = Pin::new(fresh);
    known.retain(|(p, _)| *p != pid);
    known.push((pid, Arc::downgrade(&pin)));
    pin
}

impl PeerId {
    /// The pinned process itself (for a process's view of itself).
    pub fn this_process() -> std::io::Result<PeerId> {
        let pid = std::process::id();
        Ok(PeerId {
            pid,
            uid: nix::unistd::geteuid().as_raw(),
            gid: nix::unistd::getegid().as_raw(),
            pin: Pin::new(pidfd_open(pid)?),
        })
    }

    pub fn pid(&self) -> u32 {
        self.pid
    }

    pub fn uid(&self) -> u32 {
        self.uid
    }

    pub fn gid(&self) -> u32 {
        self.gid
    }

    pub fn pidfd(&self) -> BorrowedFd<'_> {
        self.pin.fd.as_fd()
    }

    /// The pidfd, shared with every other connection to this process (it
    /// polls readable once the process has exited).
    pub fn pidfd_shared(&self) -> Arc<OwnedFd> {
        Arc::clone(&self.pin.fd)
    }

    /// Is `other` the same process? (Both pin one pidfd while either
    /// lives: a live pid is shared, [`shared_pidfd`].)
    pub fn same_process(&self, other: &PeerId) -> bool {
        Arc::ptr_eq(&self.pin, &other.pin)
    }

    /// Has the pinned process not exited? (A pidfd polls readable once it
    /// has; until then its pid cannot name another process.)
    pub fn alive(&self) -> bool {
        let alive = !pidfd_exited(self.pin.fd.as_fd());
        let seen = if alive { since_epoch() } else { EXITED };
        // (The largest: an exit, once seen, is never written over.)
        self.pin.seen_alive.fetch_max(seen, Ordering::Relaxed);
        alive
    }

    /// [`Self::alive`], or `true` without asking the kernel if a check
    /// through any connection to this process found it alive within
    /// `within`: fifty connections to one peer process ask once, not
    /// fifty times (that was a third of a busy event loop's system calls).
    /// Only for "is it worth waiting on?": a read of the peer's memory
    /// proves its pid with [`Self::alive`] itself.
    pub fn alive_lately(&self, within: Duration) -> bool {
        match self.pin.seen_alive.load(Ordering::Relaxed) {
            EXITED => false,
            0 => self.alive(),
            seen if since_epoch().saturating_sub(seen) < within.as_nanos() as u64 => true,
            _ => self.alive(),
        }
    }
}

/// Why an identity message was refused.
#[derive(Debug, thiserror::Error)]
pub enum IdentityError {
    #[error("{0}")]
    Io(#[from] std::io::Error),
    #[error("the socket closed")]
    Closed,
    #[error("the message carries no kernel credentials")]
    NoCredentials,
    #[error("the message carries no pidfd")]
    NoPidfd,
    #[error("the message's descriptors were truncated")]
    Truncated,
    #[error("the message carries {0} descriptors, at most {max} expected", max = 1 + MAX_FDS)]
    TooManyDescriptors(usize),
    #[error("the pidfd names pid {got:?}, the credentials pid {creds}")]
    PidfdMismatch { creds: u32, got: Option<i64> },
    #[error("the sender is not visible in this pid namespace")]
    Invisible,
    #[error("the message has {got} bytes, expected {want}")]
    Length { got: usize, want: usize },
}

fn os_err(e: nix::Error) -> std::io::Error {
    std::io::Error::from_raw_os_error(e as i32)
}

/// Have the kernel attach the sender's credentials to every message `sock`
/// receives (for [`recv_with_credentials`]).
pub fn pass_credentials(sock: BorrowedFd<'_>) -> std::io::Result<()> {
    setsockopt(&sock, sockopt::PassCred, &true).map_err(os_err)
}

/// A pidfd for `pid`.
pub fn pidfd_open(pid: u32) -> std::io::Result<OwnedFd> {
    let pid = i32::try_from(pid).map_err(|_| std::io::Error::from_raw_os_error(libc::ESRCH))?;
    // SAFETY: plain system call with integer arguments.
    let fd = unsafe { libc::syscall(libc::SYS_pidfd_open, pid, 0) };
    if fd < 0 {
        return Err(std::io::Error::last_os_error());
    }
    // SAFETY: the kernel returned a new descriptor that nothing else owns.
    Ok(unsafe { OwnedFd::from_raw_fd(fd as RawFd) })
}

/// A copy of descriptor `fd` of the process behind `pidfd`. The kernel
/// allows it only to a process that may ptrace that one
/// (`PTRACE_MODE_ATTACH_REALCREDS`, the check `process_vm_readv` makes).
/// What the descriptor is, is the other process's word: check it.
pub fn pidfd_getfd(pidfd: BorrowedFd<'_>, fd: u32) -> std::io::Result<OwnedFd> {
    let fd = i32::try_from(fd).map_err(|_| std::io::Error::from_raw_os_error(libc::EBADF))?;
    // SAFETY: plain system call with integer arguments.
    let got = unsafe { libc::syscall(libc::SYS_pidfd_getfd, pidfd.as_raw_fd(), fd, 0) };
    if got < 0 {
        return Err(std::io::Error::last_os_error());
    }
    // SAFETY: the kernel returned a new descriptor (close-on-exec) that
    // nothing else owns.
    Ok(unsafe { OwnedFd::from_raw_fd(got as RawFd) })
}

/// Has the process behind pidfd `fd` exited?
pub fn pidfd_exited(fd: BorrowedFd<'_>) -> bool {
    let got = crate::poll_fd::poll_fd(fd, libc::POLLIN, Some(std::time::Duration::ZERO));
    got & (libc::POLLIN | libc::POLLHUP | libc::POLLERR | libc::POLLNVAL) != 0
}

/// The pid a pidfd names, in our pid namespace (`-1`: it has exited),
/// or `None` if `fd` is not a pidfd.
fn pidfd_pid(fd: BorrowedFd<'_>) -> Option<i64> {
    // A pidfd accepts signal 0 (success, EPERM or ESRCH); anything else
    // refuses it with EBADF or EINVAL.
    // SAFETY: plain system call; a null siginfo is allowed.
    let r = unsafe {
        libc::syscall(
            libc::SYS_pidfd_send_signal,
            fd.as_raw_fd(),
            0,
            std::ptr::null::<libc::siginfo_t>(),
            0,
        )
    };
    if r != 0 {
        let e = std::io::Error::last_os_error().raw_os_error();
        if !matches!(e, Some(libc::EPERM) | Some(libc::ESRCH)) {
            return None;
        }
    }
    // Else (a kernel before 6.13, a process that exited or that our pid
    // namespace cannot see: rare) its fdinfo says which.
    if let Ok(pid) = pidfd_info_pid(fd) {
        return Some(pid);
    }
    fdinfo_pid(fd)
}

/// The `Pid:` a descriptor's fdinfo shows (a pidfd's: -1 once exited).
fn fdinfo_pid(fd: BorrowedFd<'_>) -> Option<i64> {
    let info = std::fs::read_to_string(format!("/proc/self/fdinfo/{}", fd.as_raw_fd())).ok()?;
    info.lines()
        .find_map(|l| l.strip_prefix("Pid:"))
        .and_then(|v| v.trim().parse().ok())
}

/// `struct pidfd_info` as Linux 6.13 made it (`PIDFD_INFO_SIZE_VER0`, 64
/// bytes); later kernels fill no more than the size given.
#[repr(C)]
#[derive(Default)]
struct PidfdInfo {
    mask: u64,
    cgroupid: u64,
    pid: u32,
    tgid: u32,
    ppid: u32,
    ruid: u32,
    rgid: u32,
    euid: u32,
    egid: u32,
    suid: u32,
    sgid: u32,
    fsuid: u32,
    fsgid: u32,
    exit_code: i32,
}

/// `PIDFD_GET_INFO`: `_IOWR(0xFF, 11, struct pidfd_info)`.
const PIDFD_GET_INFO: libc::c_ulong =
    (3 << 30) | ((std::mem::size_of::<PidfdInfo>() as libc::c_ulong) << 16) | (0xFF << 8) | 11;
/// `PIDFD_INFO_PID`: ask for the pid fields.
const PIDFD_INFO_PID: u64 = 1;

/// The pid of pidfd `fd`'s process in our namespace, by one ioctl (where a
/// read of its fdinfo takes seven system calls); the errno on failure.
fn pidfd_info_pid(fd: BorrowedFd<'_>) -> Result<i64, i32> {
    let mut info = PidfdInfo {
        mask: PIDFD_INFO_PID,
        ..PidfdInfo::default()
    };
    // SAFETY: PIDFD_GET_INFO reads and writes a `struct pidfd_info` of the
    // size its request number names, which is `info`'s.
    let r = unsafe {
        crate::own_ioctl::ioctl(fd.as_raw_fd(), PIDFD_GET_INFO, (&raw mut info) as usize)
    };
    if r != 0 {
        return Err(std::io::Error::last_os_error()
            .raw_os_error()
            .unwrap_or(libc::EINVAL));
    }
    if info.mask & PIDFD_INFO_PID == 0 {
        return Err(libc::EINVAL);
    }
    Ok(i64::from(info.tgid))
}

/// The credentials we send: the effective uid and gid, which the kernel
/// accepts as ours and records as the owner of the sockets we create (what
/// the peer compares them with).
fn own_credentials(pid: u32) -> UnixCredentials {
    UnixCredentials::from(libc::ucred {
        pid: pid as libc::pid_t,
        uid: nix::unistd::geteuid().as_raw(),
        gid: nix::unistd::getegid().as_raw(),
    })
}

/// This process's own pidfd, opened once per process (`pid`: ours now; a
/// forked child's copy of its parent's names the parent, and is replaced).
/// Every identity message carries it: opened per message, it was two
/// system calls of every pairing.
fn own_pidfd(pid: u32) -> std::io::Result<Arc<OwnedFd>> {
    static OWN: Lock<Option<(u32, Arc<OwnedFd>)>> = Lock::new(None);
    let mut own = OWN.lock();
    if let Some((p, fd)) = own.as_ref()
        && *p == pid
    {
        return Ok(Arc::clone(fd));
    }
    let fd = Arc::new(pidfd_open(pid)?);
    *own = Some((pid, Arc::clone(&fd)));
    Ok(fd)
}

/// Send `bytes` as one message with this process's identity and `fds`.
/// The whole message goes in one `sendmsg` (refused if it would not).
pub fn send(sock: BorrowedFd<'_>, bytes: &[u8], fds: &[BorrowedFd<'_>]) -> std::io::Result<()> {
    send_flags(sock, bytes, fds, MsgFlags::empty())
}

/// [`send`], but never blocking (EAGAIN if the socket has no room).
pub fn send_nonblocking(
    sock: BorrowedFd<'_>,
    bytes: &[u8],
    fds: &[BorrowedFd<'_>],
) -> std::io::Result<()> {
    send_flags(sock, bytes, fds, MsgFlags::MSG_DONTWAIT)
}

fn send_flags(
    sock: BorrowedFd<'_>,
    bytes: &[u8],
    fds: &[BorrowedFd<'_>],
    flags: MsgFlags,
) -> std::io::Result<()> {
    assert!(fds.len() <= MAX_FDS, "at most {MAX_FDS} descriptors");
    let pid = std::process::id();
    let me = own_pidfd(pid)?;
    let mut raw = vec![me.as_raw_fd()];
    raw.extend(fds.iter().map(|f| f.as_raw_fd()));
    let creds = own_credentials(pid);
    let cmsgs = [
        ControlMessage::ScmCredentials(&creds),
        ControlMessage::ScmRights(&raw),
    ];
    let iov = [IoSlice::new(bytes)];
    let n = sendmsg::<()>(
        sock.as_raw_fd(),
        &iov,
        &cmsgs,
        flags | MsgFlags::MSG_NOSIGNAL,
        None,
    )
    .map_err(os_err)?;
    if n != bytes.len() {
        return Err(std::io::Error::other("identity message sent in part"));
    }
    Ok(())
}

/// One received identity message.
#[derive(Debug)]
pub struct Received {
    /// The verified, pinned sender.
    pub peer: PeerId,
    /// The descriptors it passed after its pidfd, in order.
    pub fds: Vec<OwnedFd>,
}

/// Receive one message of exactly `buf.len()` bytes carrying an identity.
/// With `nonblocking`, `Err(WouldBlock)` when none is queued. Descriptors of
/// a refused message are closed.
pub fn recv(
    sock: BorrowedFd<'_>,
    buf: &mut [u8],
    nonblocking: bool,
) -> Result<Received, IdentityError> {
    setsockopt(&sock, sockopt::PassCred, &true).map_err(os_err)?;
    recv_with_credentials(sock, buf, nonblocking)
}

/// [`recv`] on a socket that has `SO_PASSCRED` set already (see
/// [`pass_credentials`]): one system call per message.
pub fn recv_with_credentials(
    sock: BorrowedFd<'_>,
    buf: &mut [u8],
    nonblocking: bool,
) -> Result<Received, IdentityError> {
    let mut flags = 0;
    if nonblocking {
        flags |= libc::MSG_DONTWAIT;
    }
    // Every descriptor the message brought is owned from here: any refusal
    // below closes them all.
    let got = crate::scm::recv(sock.as_raw_fd(), buf, flags)?;
    verify(got, buf.len())
}

/// [`recv_with_credentials`] (non-blocking) of up to `bufs.len()` messages
/// in one system call: each one's verdict, in order. `Err` only for the
/// call (`WouldBlock`: none was queued).
pub fn recv_batch_with_credentials<const N: usize>(
    sock: BorrowedFd<'_>,
    bufs: &mut [[u8; N]],
) -> std::io::Result<Vec<Result<Received, IdentityError>>> {
    let got = crate::scm::recv_batch(sock.as_raw_fd(), bufs, libc::MSG_DONTWAIT)?;
    Ok(got.into_iter().map(|r| verify(r, N)).collect())
}

/// The sender of a received message of `want` bytes, as the kernel vouches
/// for it (see the module's doc); the message's other descriptors.
fn verify(got: crate::scm::Received, want: usize) -> Result<Received, IdentityError> {
    let crate::scm::Received {
        bytes: n,
        creds,
        mut fds,
        truncated,
    } = got;
    if n == 0 && fds.is_empty() {
        return Err(IdentityError::Closed);
    }
    if truncated {
        return Err(IdentityError::Truncated);
    }
    if fds.len() > 1 + MAX_FDS {
        return Err(IdentityError::TooManyDescriptors(fds.len()));
    }
    if n != want {
        // A stream socket may split a message only if the sender did;
        // ours never do. Either way the message is not ours.
        return Err(IdentityError::Length { got: n, want });
    }
    let creds = creds.ok_or(IdentityError::NoCredentials)?;
    if fds.is_empty() {
        return Err(IdentityError::NoPidfd);
    }
    let pidfd = fds.remove(0);
    let pid = u32::try_from(creds.pid).map_err(|_| IdentityError::Invisible)?;
    if pid == 0 {
        return Err(IdentityError::Invisible);
    }
    match pidfd_pid(pidfd.as_fd()) {
        Some(p) if p == i64::from(pid) => {}
        got => return Err(IdentityError::PidfdMismatch { creds: pid, got }),
    }
    Ok(Received {
        peer: PeerId {
            pid,
            uid: creds.uid,
            gid: creds.gid,
            pin: shared_pidfd(pid, pidfd),
        },
        fds,
    })
}

impl PeerId {
    /// The peer a parked endpoint named, taken up by the next image of
    /// this process with the pidfd it kept: it must still name `pid`
    /// (exited or not: a peer that died meanwhile is reported as gone).
    pub fn resumed(pid: u32, uid: u32, gid: u32, pidfd: OwnedFd) -> std::io::Result<PeerId> {
        match pidfd_pid(pidfd.as_fd()) {
            Some(p) if p == i64::from(pid) || p == -1 => Ok(PeerId {
                pid,
                uid,
                gid,
                pin: shared_pidfd(pid, pidfd),
            }),
            _ => Err(std::io::Error::other(format!(
                "the kept pidfd does not name pid {pid}"
            ))),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::os::unix::net::UnixDatagram;

    /// `PIDFD_GET_INFO` names the pid its fdinfo names, for a live
    /// process; a reaped one is -1 either way; a descriptor that is not a
    /// pidfd is none.
    #[test]
    fn a_pidfd_names_its_pid_by_ioctl_as_its_fdinfo_does() {
        let fdinfo = fdinfo_pid;
        let own = pidfd_open(std::process::id()).expect("pidfd_open");
        assert_eq!(fdinfo(own.as_fd()), Some(i64::from(std::process::id())));
        assert_eq!(pidfd_pid(own.as_fd()), fdinfo(own.as_fd()));
        // (Linux 6.13 and later answer by ioctl.)
        match pidfd_info_pid(own.as_fd()) {
            Ok(pid) => assert_eq!(pid, i64::from(std::process::id())),
            Err(e) => assert!(matches!(e, libc::ENOTTY | libc::EINVAL), "errno {e}"),
        }
        let mut child = std::process::Command::new("true").spawn().expect("spawn");
        let theirs = pidfd_open(child.id()).expect("pidfd_open");
        child.wait().expect("wait");
        assert_eq!(fdinfo(theirs.as_fd()), Some(-1));
        assert_eq!(pidfd_pid(theirs.as_fd()), Some(-1));
        let file = std::fs::File::open("/dev/null").unwrap();
        assert_eq!(pidfd_pid(file.as_fd()), None);
    }

    fn pair() -> (
        std::os::unix::net::UnixStream,
        std::os::unix::net::UnixStream,
    ) {
        let (a, b) = crate::scm::seqpacket_pair();
        (a.into(), b.into())
    }

    /// Every connection to one process shares one liveness check per
    /// window: what one found, the others take without asking; an exit
    /// is seen at once by a plain `alive`, and by `alive_lately` once the
    /// window has passed.
    #[test]
    fn connections_to_one_process_share_its_liveness_check() {
        let mut child = std::process::Command::new("sleep")
            .arg("60")
            .spawn()
            .unwrap();
        let pid = child.id();
        let me = (
            nix::unistd::geteuid().as_raw(),
            nix::unistd::getegid().as_raw(),
        );
        let a = PeerId::resumed(pid, me.0, me.1, pidfd_open(pid).unwrap()).unwrap();
        let b = PeerId::resumed(pid, me.0, me.1, pidfd_open(pid).unwrap()).unwrap();
        assert!(Arc::ptr_eq(&a.pidfd_shared(), &b.pidfd_shared()));
        assert!(a.alive());
        child.kill().unwrap();
        child.wait().unwrap();
        // b never asked, but a did just now.
        assert!(b.alive_lately(Duration::from_secs(3600)));
        assert!(!b.alive_lately(Duration::ZERO));
        assert!(!a.alive());
        assert!(!a.alive_lately(Duration::from_secs(3600)));
    }

    #[test]
    fn a_message_names_its_sender_and_carries_descriptors() {
        let (a, b) = pair();
        let (x, _y) = UnixDatagram::pair().unwrap();
        send(a.as_fd(), b"hello", &[x.as_fd()]).unwrap();
        let mut buf = [0u8; 5];
        let r = recv(b.as_fd(), &mut buf, false).unwrap();
        assert_eq!(&buf, b"hello");
        assert_eq!(r.peer.pid(), std::process::id());
        assert_eq!(r.peer.uid(), nix::unistd::geteuid().as_raw());
        assert!(r.peer.alive());
        assert_eq!(r.fds.len(), 1);
    }

    #[test]
    fn a_message_without_credentials_or_with_a_foreign_pidfd_is_refused() {
        let (a, b) = pair();
        let mut buf = [0u8; 3];
        // Plain bytes: no identity.
        nix::unistd::write(&a, b"abc").unwrap();
        assert!(matches!(
            recv(b.as_fd(), &mut buf, false),
            Err(IdentityError::NoPidfd | IdentityError::NoCredentials)
        ));
        // Our credentials, with a pidfd of another process (pid 1), or
        // with a descriptor that is no pidfd at all.
        let send_with = |fd: RawFd| {
            let creds = own_credentials(std::process::id());
            let raw = [fd];
            let cmsgs = [
                ControlMessage::ScmCredentials(&creds),
                ControlMessage::ScmRights(&raw),
            ];
            sendmsg::<()>(
                a.as_raw_fd(),
                &[IoSlice::new(b"abc")],
                &cmsgs,
                MsgFlags::empty(),
                None,
            )
            .unwrap();
        };
        let other = pidfd_open(1).unwrap();
        send_with(other.as_raw_fd());
        assert!(matches!(
            recv(b.as_fd(), &mut buf, false),
            Err(IdentityError::PidfdMismatch { .. })
        ));
        let (x, _y) = UnixDatagram::pair().unwrap();
        send_with(x.as_raw_fd());
        assert!(matches!(
            recv(b.as_fd(), &mut buf, false),
            Err(IdentityError::PidfdMismatch { got: None, .. })
        ));
        // Wrong length, then nothing queued, then the peer gone.
        send(a.as_fd(), b"toolong", &[]).unwrap();
        assert!(matches!(
            recv(b.as_fd(), &mut buf, false),
            Err(IdentityError::Length { .. } | IdentityError::Truncated)
        ));
        assert!(matches!(
            recv(b.as_fd(), &mut buf, true),
            Err(IdentityError::Io(e)) if e.kind() == std::io::ErrorKind::WouldBlock
        ));
        drop(a);
        assert!(matches!(
            recv(b.as_fd(), &mut buf, false),
            Err(IdentityError::Closed)
        ));
    }

    #[test]
    fn a_refused_message_closes_every_descriptor_it_brought() {
        let (a, b) = pair();
        let (x, _y) = UnixDatagram::pair().unwrap();
        let me = std::fs::read_link(format!("/proc/self/fd/{}", x.as_raw_fd())).unwrap();
        let copies = || {
            std::fs::read_dir("/proc/self/fd")
                .unwrap()
                .flatten()
                .filter(|e| std::fs::read_link(e.path()).is_ok_and(|l| l == me))
                .count()
        };
        let pidfd = pidfd_open(std::process::id()).unwrap();
        let creds = own_credentials(std::process::id());
        let mut buf = [0u8; 3];
        // One descriptor more than the buffer was made for, then many;
        // with a good and a bad length.
        for (n, len) in [(1 + MAX_FDS + 1, 3), (64, 3), (2, 2), (253, 9)] {
            let mut raw = vec![pidfd.as_raw_fd()];
            raw.resize(n, x.as_raw_fd());
            let cmsgs = [
                ControlMessage::ScmCredentials(&creds),
                ControlMessage::ScmRights(&raw),
            ];
            sendmsg::<()>(
                a.as_raw_fd(),
                &[IoSlice::new(&[7u8; 9][..len])],
                &cmsgs,
                MsgFlags::empty(),
                None,
            )
            .unwrap();
            assert!(recv(b.as_fd(), &mut buf, false).is_err());
            assert_eq!(copies(), 1, "{n} descriptors, {len} bytes");
        }
    }

    #[test]
    fn a_dead_process_is_seen_dead() {
        let child = std::process::Command::new("true").spawn().unwrap();
        let fd = pidfd_open(child.id()).unwrap();
        let mut child = child;
        child.wait().unwrap();
        assert!(pidfd_exited(fd.as_fd()));
    }
}
