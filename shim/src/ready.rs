//! Readiness of upgraded sockets in `poll`, `ppoll`, `select`, `pselect`.
//!
//! An upgraded socket's kernel TCP socket is idle: its readiness is the
//! engine's. A thread that waits on a mix of upgraded and other
//! descriptors sleeps in the kernel on the others plus an eventfd of its
//! own ([`Wakeup`]), which it lists with each of those connections
//! ([`crate::epoll::Watchers`]); a connection whose engine took something
//! in writes the eventfds of the threads listed with it. A thread arms and
//! lists its wakeup before it looks at the engines, so a notification
//! between the look and the sleep is not lost.
//!
//! `unsafe` here: the program's `pollfd` arrays and fd_sets.

use azsdp::sync::Lock;
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd};
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU32, AtomicUsize, Ordering};
use std::time::{Duration, Instant};

use azsdp::conn::Readiness;
use libc::{POLLERR, POLLHUP, POLLIN, POLLOUT, POLLRDHUP, c_int, c_short, pollfd};

use crate::real;

/// A sleeping thread's (or epoll set's) eventfd, or, for a thread that
/// sleeps on one connection alone, a futex word ([`my_quiet_wakeup`]).
pub struct Wakeup {
    efd: Option<OwnedFd>,
    /// Bumped by every kick of a futex wakeup.
    word: AtomicU32,
    asleep: AtomicBool,
    /// Asleep, and counting on the reactor's watch of the process's bell
    /// (see [`any_reliant`]).
    reliant: AtomicBool,
    /// Written since the last disarm (set after the write, so a disarm
    /// that sees it reads what was written; one that misses it leaves the
    /// count for the next, which wakes once for nothing).
    rung: AtomicBool,
}

impl Wakeup {
    pub fn new() -> Option<Arc<Wakeup>> {
        // SAFETY: eventfd(2); we own the result.
        let fd = unsafe { libc::eventfd(0, libc::EFD_NONBLOCK | libc::EFD_CLOEXEC) };
        if fd < 0 {
            return None;
        }
        // SAFETY: a fresh descriptor, owned from here.
        let efd = unsafe { OwnedFd::from_raw_fd(fd) };
        Some(Self::listed(Some(efd)))
    }

    /// A wakeup that holds no descriptor: its sleeper waits on
    /// [`Wakeup::word`] (a futex), never in a kernel set.
    fn quiet() -> Arc<Wakeup> {
        Self::listed(None)
    }

    fn listed(efd: Option<OwnedFd>) -> Arc<Wakeup> {
        let w = Arc::new(Wakeup {
            efd,
            word: AtomicU32::new(0),
            asleep: AtomicBool::new(false),
            reliant: AtomicBool::new(false),
            rung: AtomicBool::new(false),
        });
        SLEEPERS.lock().push(Arc::downgrade(&w));
        w
    }

    /// The eventfd (-1 for a futex wakeup, which no kernel set holds).
    pub fn fd(&self) -> c_int {
        self.efd.as_ref().map_or(-1, AsRawFd::as_raw_fd)
    }

    /// A futex wakeup's word: read it before the last look, then sleep
    /// while it holds that value ([`azsdp::futex::wait`]).
    pub fn word(&self) -> &AtomicU32 {
        &self.word
    }

    /// About to look, then sleep: notifications from now on wake us.
    pub fn arm(&self) {
        self.arm_alone();
        // Only the reactor sees data arrive while we sleep: connections it
        // left on standby (the application was just calling) go back to
        // its watch.
        azsdp::driver::standby::end();
    }

    /// [`Wakeup::arm`] for a sleep on one connection outside its calls:
    /// the reactor's standby of that connection ends by itself within
    /// milliseconds (no call is in it), and every other stays as it is
    /// (ending them all at each of ten thousand threads' waits requeued
    /// ten thousand connections each time).
    pub fn arm_alone(&self) {
        self.arm_self_rung();
        if !self.reliant.swap(true, Ordering::SeqCst) {
            RELIANT.fetch_add(1, Ordering::SeqCst);
        }
    }

    /// About to sleep where every connection watched rings the sleeper's
    /// own bell (an epoll set's loop bell): notifications wake it, and it
    /// needs nobody to watch the process's bell for it.
    pub fn arm_self_rung(&self) {
        if !self.asleep.swap(true, Ordering::SeqCst) {
            ARMED.fetch_add(1, Ordering::SeqCst);
        }
    }

    /// Awake again: drop what notifications came (errno untouched: this
    /// runs right after the call whose error is the program's).
    pub fn disarm(&self) {
        let _keep = real::KeepErrno::new();
        if self.asleep.swap(false, Ordering::SeqCst) {
            ARMED.fetch_sub(1, Ordering::SeqCst);
        }
        if self.reliant.swap(false, Ordering::SeqCst) {
            RELIANT.fetch_sub(1, Ordering::SeqCst);
        }
        if self.rung.swap(false, Ordering::SeqCst) && self.efd.is_some() {
            let mut v = 0u64;
            // SAFETY: read of 8 bytes into our own u64 (non-blocking eventfd).
            unsafe { real::read(self.fd(), (&raw mut v).cast(), 8) };
        }
    }

    /// Ring even if nobody is armed: a thread may sleep in a kernel set
    /// that holds this eventfd without having armed it.
    pub fn kick(&self) {
        let _keep = real::KeepErrno::new();
        if self.efd.is_none() {
            self.word.fetch_add(1, Ordering::SeqCst);
            azsdp::futex::wake_all(&self.word);
            return;
        }
        let one = 1u64;
        // SAFETY: write of 8 bytes from our own u64.
        unsafe { real::write(self.fd(), (&raw const one).cast(), 8) };
        self.rung.store(true, Ordering::SeqCst);
    }

    /// Wake the thread if it is armed (asleep, or about to be). Every ring
    /// writes: one skipped because `rung` read true could follow a disarm
    /// that had just drained the count, and the sleeper would not wake.
    pub fn ring(&self) {
        if self.asleep.load(Ordering::SeqCst) {
            self.kick();
        }
    }
}

static SLEEPERS: Lock<Vec<std::sync::Weak<Wakeup>>> = Lock::new(Vec::new());
/// Wakeups armed now. Engines notify after every turn that moved what
/// waiters look at (readiness, and a joining connection's route); with no
/// one asleep that is one load, not a lock. (A sleeper counts
/// itself before it looks at the engines, so it sees any change whose
/// notification found the count at zero.)
static ARMED: AtomicUsize = AtomicUsize::new(0);

/// Armed wakeups that count on the reactor's watch of the process's bell
/// (all but epoll sets whose connections ring their loop bell).
static RELIANT: AtomicUsize = AtomicUsize::new(0);

/// Do any threads sleep (or are about to) waiting for readiness that only
/// the reactor's watch of the process's bell would see come?
pub fn any_reliant() -> bool {
    RELIANT.load(Ordering::SeqCst) != 0
}

/// Readiness of any upgraded socket may have changed (one moved back
/// into the kernel's sets): every armed sleeper looks again. A change of
/// one connection wakes only its own ([`crate::epoll::Watchers`]).
pub fn notify() {
    if ARMED.load(Ordering::SeqCst) == 0 {
        return;
    }
    let mut v = SLEEPERS.lock();
    v.retain(|w| match w.upgrade() {
        Some(w) => {
            w.ring();
            true
        }
        None => false,
    });
}

/// A thread's wakeup, listed with connections until dropped: their changes
/// ring it.
pub struct Listening {
    wake: Option<Arc<Wakeup>>,
    lists: Vec<Arc<crate::epoll::Watchers>>,
}

impl Listening {
    pub fn new(wake: Option<&Arc<Wakeup>>) -> Listening {
        Listening {
            wake: wake.cloned(),
            lists: Vec::new(),
        }
    }

    /// Listed with the connection that `watchers` are of.
    pub fn add(&mut self, watchers: &Arc<crate::epoll::Watchers>) {
        if let Some(w) = &self.wake {
            watchers.listen(w);
            self.lists.push(Arc::clone(watchers));
        }
    }
}

impl Drop for Listening {
    fn drop(&mut self) {
        if let Some(w) = &self.wake {
            for l in &self.lists {
                l.unlisten(w);
            }
        }
    }
}

thread_local! {
    static MINE: std::cell::OnceCell<Option<Arc<Wakeup>>> = const { std::cell::OnceCell::new() };
    static MINE_QUIET: std::cell::OnceCell<Arc<Wakeup>> = const { std::cell::OnceCell::new() };
}

/// This thread's eventfd wakeup, for sleeps in a kernel set.
pub fn my_wakeup() -> Option<Arc<Wakeup>> {
    MINE.try_with(|m| m.get_or_init(Wakeup::new).clone())
        .ok()
        .flatten()
}

/// This thread's futex wakeup, for sleeps on one connection: it holds no
/// descriptor, so that ten thousand threads each blocked on its own
/// connection hold ten thousand descriptors, not twenty.
pub fn my_quiet_wakeup() -> Option<Arc<Wakeup>> {
    MINE_QUIET
        .try_with(|m| m.get_or_init(Wakeup::quiet).clone())
        .ok()
}

/// `poll` bits for an engine's readiness.
pub fn poll_bits(r: &Readiness, wanted: c_short) -> c_short {
    let mut b = 0;
    if r.readable {
        b |= POLLIN | (wanted & libc::POLLRDNORM);
    }
    if r.writable {
        b |= POLLOUT | (wanted & libc::POLLWRNORM);
    }
    if r.read_hangup {
        b |= wanted & POLLRDHUP;
    }
    if r.hangup {
        b |= POLLHUP;
    }
    if r.error {
        b |= POLLERR;
    }
    // POLLHUP and POLLERR are reported whether asked for or not.
    b & (wanted | POLLHUP | POLLERR)
}

/// Arrays this short pass any descriptor limit a program runs under.
const FEW_FDS: usize = 64;

/// First sleep between looks, a safety net under the notifications; it
/// doubles while nothing comes, up to [`LONGEST_SLICE`], so that ten
/// thousand idle threads do not keep the host's CPUs busy.
const SLICE: Duration = Duration::from_millis(100);
const LONGEST_SLICE: Duration = Duration::from_secs(1);
/// How often a wait over a socket whose pair is under way looks for the
/// listener's answer.
const PAIRING_SLICE: Duration = Duration::from_millis(2);

/// `poll`/`ppoll` over the program's `fds`; `None` if none of them is
/// upgraded (the caller asks the kernel, which then checks everything
/// itself). `timeout` `None` waits for ever. Returns what `poll` returns
/// (errno set on -1). Arguments the kernel would refuse get its error:
/// `n` above the descriptor limit is EINVAL, an array the kernel cannot
/// read or write all of is EFAULT; nothing is read before that is known.
///
/// # Safety
/// None beyond the call's: `fds` is only reached through the kernel.
pub unsafe fn poll(
    fds: *mut pollfd,
    n: usize,
    timeout: Option<Duration>,
    mask: *const libc::sigset_t,
) -> Option<c_int> {
    if !(crate::pending::any() || azsdp::process::active()) || azsdp::sandbox::marked() {
        // No upgraded socket in this process (a sandboxed one's all moved
        // onto TCP): nothing to look at.
        return None;
    }
    // The kernel's bound (`RLIMIT_NOFILE`), asked only for arrays that
    // could pass it: a system call on every poll cost event loops more
    // than the poll itself.
    if n > FEW_FDS && n as u64 > crate::user_mem::fd_limit() {
        real::set_errno(libc::EINVAL);
        return Some(-1);
    }
    let mut copy = match crate::user_mem::read(fds, n) {
        Ok(v) => v,
        Err(e) => {
            real::set_errno(e);
            return Some(-1);
        }
    };
    let (conns, pairing) = resolve(&copy);
    if conns.iter().all(Option::is_none) && !pairing.contains(&true) {
        return None;
    }
    let r = poll_upgraded(&mut copy, &conns, &pairing, timeout, mask);
    if r >= 0
        && let Err(e) = crate::user_mem::write(fds, &copy)
    {
        real::set_errno(e);
        return Some(-1);
    }
    Some(r)
}

/// The connection each entry's descriptor is (if upgraded), and whether
/// its pair is under way: a pair completes here if it can, and one that
/// cannot yet keeps the wait ours, so that it sees the pair complete (a
/// thread asleep in the kernel on the socket alone would miss the bytes
/// that come over the fabric from then on).
fn resolve(fds: &[pollfd]) -> (Vec<Option<Arc<crate::conn::Conn>>>, Vec<bool>) {
    let mut pairing = vec![false; fds.len()];
    let conns = fds
        .iter()
        .zip(pairing.iter_mut())
        .map(|(p, pairing)| {
            let s = crate::fdtable::get(p.fd)?;
            if let crate::sock::Role::Pairing(pp) = s.role() {
                if let Some(c) = pp.try_complete(&s, p.fd) {
                    return Some(c);
                }
                if matches!(s.role(), crate::sock::Role::Pairing(_)) {
                    *pairing = true;
                    return None;
                }
                // Decided by another thread's call meanwhile: what it
                // became (a connection left to the kernel alone would
                // never see what comes on the fabric).
            }
            crate::switch::driven_here(&s)
        })
        .collect();
    (conns, pairing)
}

fn poll_upgraded(
    fds: &mut [pollfd],
    conns: &[Option<Arc<crate::conn::Conn>>],
    pairing: &[bool],
    timeout: Option<Duration>,
    mask: *const libc::sigset_t,
) -> c_int {
    let deadline = timeout.map(|t| Instant::now() + t);
    let window = SignalWindow::open();
    let mask = window.wait_mask(mask);
    let wake = my_wakeup();
    // The kernel's part: every entry, with upgraded ones disabled (fd -1),
    // plus our eventfd at the end.
    let mut kernel: Vec<pollfd> = fds
        .iter()
        .zip(conns)
        .map(|(p, c)| pollfd {
            fd: if c.is_some() { -1 } else { p.fd },
            events: p.events,
            revents: 0,
        })
        .collect();
    if let Some(w) = &wake {
        kernel.push(pollfd {
            fd: w.fd(),
            events: POLLIN,
            revents: 0,
        });
    }
    let mut listening = Listening::new(wake.as_ref());
    for c in conns.iter().flatten() {
        listening.add(&c.watchers);
    }
    let mut conns = conns.to_vec();
    let mut pairing = pairing.to_vec();
    let mut slice = SLICE;
    loop {
        // A pair that completed meanwhile (another thread's call): its
        // connection's readiness from now on.
        for ((p, c), pairing) in fds.iter().zip(conns.iter_mut()).zip(pairing.iter_mut()) {
            if *pairing && c.is_none() {
                let Some(s) = crate::fdtable::get(p.fd) else {
                    *pairing = false;
                    continue;
                };
                match s.role() {
                    crate::sock::Role::Azsdp(x) => {
                        listening.add(&x.watchers);
                        *c = Some(x);
                    }
                    crate::sock::Role::Pairing(pp) => {
                        match pp.try_complete(&s, p.fd) {
                            Some(x) => *c = Some(x),
                            None if matches!(s.role(), crate::sock::Role::Pairing(_)) => continue,
                            // Decided by another thread's call meanwhile.
                            None => *c = crate::switch::driven_here(&s),
                        }
                        if let Some(x) = c.as_ref() {
                            listening.add(&x.watchers);
                        }
                    }
                    _ => {}
                }
                *pairing = false;
            }
        }
        // A connection that moved onto its TCP socket meanwhile is the
        // kernel's to answer from now on (never a readiness of ours that
        // its socket would not confirm: ssh treats EAGAIN after a
        // readable poll as fatal).
        for ((p, c), k) in fds.iter().zip(conns.iter_mut()).zip(kernel.iter_mut()) {
            if c.as_ref().is_some_and(|c| c.driver.on_tcp()) {
                if let Some(s) = crate::fdtable::get(p.fd) {
                    crate::switch::driven_here(&s);
                }
                *c = None;
                k.fd = p.fd;
            }
        }
        // A connection still joining the fabric: its TCP socket's part
        // wakes us too (only that part, or a ready socket would spin us).
        for ((p, c), k) in fds.iter().zip(&conns).zip(kernel.iter_mut()) {
            if let Some(c) = c {
                let events = c.joining_now().map_or(0, |j| j.tcp_events(c)) & p.events;
                k.fd = if events != 0 { p.fd } else { -1 };
                k.events = events;
            }
        }
        if let Some(w) = &wake {
            w.arm();
        }
        let mut ready = 0;
        for ((p, c), k) in fds.iter_mut().zip(&conns).zip(kernel.iter_mut()) {
            if let Some(c) = c {
                p.revents = poll_bits(&c.readiness_on(p.fd), p.events);
                k.revents = 0;
                if p.revents != 0 {
                    ready += 1;
                }
            }
        }
        if conns.iter().flatten().any(|c| c.driver.on_tcp()) {
            // It moved while we looked: look again.
            continue;
        }
        let left = deadline.map(|d| d.saturating_duration_since(Instant::now()));
        let wait = if ready > 0 {
            Duration::ZERO
        } else {
            left.map_or(slice, |l| l.min(slice))
        };
        slice = (slice * 2).min(LONGEST_SLICE);
        // (While a pair is under way, look for its completion often.)
        let wait = if pairing.contains(&true) {
            wait.min(PAIRING_SLICE)
        } else {
            wait
        };
        let ts = timespec_of(wait);
        let with_wake = if wait.is_zero() {
            kernel.len() - usize::from(wake.is_some())
        } else {
            kernel.len()
        };
        // SAFETY: our own array; the caller's signal mask, if any.
        let r = unsafe { real::ppoll(kernel.as_mut_ptr(), with_wake as libc::nfds_t, &ts, mask) };
        if let Some(w) = &wake {
            w.disarm();
        }
        if r < 0 {
            return -1;
        }
        for ((p, c), k) in fds.iter_mut().zip(&conns).zip(&kernel) {
            if c.is_none() {
                p.revents = k.revents;
                if k.revents != 0 {
                    ready += 1;
                }
            }
        }
        if ready > 0 || left.is_some_and(|l| l.is_zero()) {
            return ready;
        }
    }
}

/// A `poll`-style timeout in milliseconds (negative: none).
pub fn ms_timeout(ms: c_int) -> Option<Duration> {
    (ms >= 0).then(|| Duration::from_millis(ms as u64))
}

/// `t` in whole milliseconds for a kernel wait, rounded up (a wait that
/// ends early would spin).
pub fn ms_rounded_up(t: Duration) -> c_int {
    t.as_micros().div_ceil(1000).min(i32::MAX as u128) as c_int
}

/// `t` as a kernel `timespec`.
pub fn timespec_of(t: Duration) -> libc::timespec {
    libc::timespec {
        tv_sec: t.as_secs().min(i64::MAX as u64) as libc::time_t,
        tv_nsec: t.subsec_nanos() as libc::c_long,
    }
}

/// A `ppoll`/`pselect`/`epoll_pwait2`-style timeout (null: none), read
/// through the kernel: EFAULT if unreadable, EINVAL if not a valid time.
pub fn ts_timeout(ts: *const libc::timespec) -> Result<Option<Duration>, c_int> {
    if ts.is_null() {
        return Ok(None);
    }
    let [t] = crate::user_mem::read(ts, 1)?[..] else {
        return Err(libc::EFAULT);
    };
    if t.tv_sec < 0 || !(0..1_000_000_000).contains(&t.tv_nsec) {
        return Err(libc::EINVAL);
    }
    Ok(Some(Duration::new(t.tv_sec as u64, t.tv_nsec as u32)))
}

/// A `select` timeout (null: none), read through the kernel. As Linux
/// does, microseconds past a second carry into the seconds; a negative
/// part is EINVAL.
pub fn tv_timeout(tv: *const libc::timeval) -> Result<Option<Duration>, c_int> {
    if tv.is_null() {
        return Ok(None);
    }
    let [t] = crate::user_mem::read(tv, 1)?[..] else {
        return Err(libc::EFAULT);
    };
    if t.tv_sec < 0 || t.tv_usec < 0 {
        return Err(libc::EINVAL);
    }
    let (sec, usec) = (t.tv_sec as u64, t.tv_usec as u64);
    Ok(Some(
        Duration::from_secs(sec.saturating_add(usec / 1_000_000))
            + Duration::from_micros(usec % 1_000_000),
    ))
}

/// While a waiting call runs our code, asynchronous signals stay pending;
/// the kernel waits install the program's mask for their duration (as
/// `ppoll`/`epoll_pwait` do atomically), so a signal that comes at any
/// moment of the call ends it with EINTR, as it would the real call. (With
/// signals open, one that came between our kernel waits was handled and
/// interrupted nothing: redis on SIGTERM waited for its next event.)
pub struct SignalWindow {
    old: libc::sigset_t,
}

impl SignalWindow {
    pub fn open() -> SignalWindow {
        // SAFETY: sigset_t is plain data; the calls fill our own sets and
        // change only the calling thread's mask.
        unsafe {
            let mut set: libc::sigset_t = std::mem::zeroed();
            let mut old: libc::sigset_t = std::mem::zeroed();
            azsdp::threads::async_signals(&mut set);
            libc::pthread_sigmask(libc::SIG_BLOCK, &set, &mut old);
            SignalWindow { old }
        }
    }

    /// The mask for the kernel wait: the program's own (`mask`, for the
    /// calls that take one), else the one it had when the call began.
    pub fn wait_mask(&self, mask: *const libc::sigset_t) -> *const libc::sigset_t {
        if mask.is_null() { &self.old } else { mask }
    }

    /// The mask the thread had when the call began.
    pub fn program_mask(&self) -> &libc::sigset_t {
        &self.old
    }

    /// Let the pending signals the program does not block run their
    /// handlers now, then keep the window shut again.
    pub fn deliver(&self) {
        let _keep = real::KeepErrno::new();
        // SAFETY: switching the thread's own mask to its own saved one and
        // back (pending signals are delivered in between).
        unsafe {
            let mut shut: libc::sigset_t = std::mem::zeroed();
            libc::pthread_sigmask(libc::SIG_SETMASK, &self.old, &mut shut);
            libc::pthread_sigmask(libc::SIG_SETMASK, &shut, std::ptr::null_mut());
        }
    }
}

impl Drop for SignalWindow {
    fn drop(&mut self) {
        let _keep = real::KeepErrno::new();
        // SAFETY: restoring the thread's own mask.
        unsafe { libc::pthread_sigmask(libc::SIG_SETMASK, &self.old, std::ptr::null_mut()) };
    }
}

/// The kernel's descriptor table size (`FDSize` in /proc/self/status):
/// `select` looks at no more bits than that, whatever `nfds` says.
fn fd_table_size() -> usize {
    std::fs::read_to_string("/proc/self/status")
        .ok()
        .and_then(|s| {
            s.lines()
                .find_map(|l| l.strip_prefix("FDSize:"))
                .and_then(|v| v.trim().parse().ok())
        })
        .unwrap_or(libc::FD_SETSIZE)
}

/// The program's three fd_sets, copied through the kernel, for `nfds` bits.
pub struct Sets {
    nfds: c_int,
    sets: [Option<Vec<u64>>; 3],
}

impl Sets {
    /// `Err(errno)` as `select` would fail: EINVAL for a negative `nfds`,
    /// EFAULT for a set the kernel cannot read.
    pub fn read(nfds: c_int, ptrs: [*mut libc::fd_set; 3]) -> Result<Sets, c_int> {
        if nfds < 0 {
            return Err(libc::EINVAL);
        }
        let nfds = (nfds as usize).min(fd_table_size()) as c_int;
        let words = (nfds as usize).div_ceil(64);
        let mut sets = [None, None, None];
        for (s, p) in sets.iter_mut().zip(ptrs) {
            if !p.is_null() {
                *s = Some(crate::user_mem::read(p.cast::<u64>().cast_const(), words)?);
            }
        }
        Ok(Sets { nfds, sets })
    }

    fn has(&self, which: usize, fd: c_int) -> bool {
        self.sets[which]
            .as_ref()
            .is_some_and(|s| s[fd as usize / 64] >> (fd % 64) & 1 != 0)
    }

    /// Does any descriptor in the sets belong to an upgraded socket?
    pub fn involve_upgraded(&self) -> bool {
        (0..self.nfds).any(|fd| {
            (0..3).any(|w| self.has(w, fd))
                && crate::fdtable::get(fd).is_some_and(|s| {
                    s.conn().is_some() || matches!(s.role(), crate::sock::Role::Pairing(_))
                })
        })
    }
}

/// `select`/`pselect` through [`poll`], over `sets` read with
/// [`Sets::read`]; the results are written back to the program's `ptrs`.
pub fn select(
    sets: &Sets,
    ptrs: [*mut libc::fd_set; 3],
    timeout: Option<Duration>,
    mask: *const libc::sigset_t,
) -> c_int {
    let mut fds = Vec::new();
    for fd in 0..sets.nfds {
        let (rr, ww, ee) = (sets.has(0, fd), sets.has(1, fd), sets.has(2, fd));
        if rr || ww || ee {
            let mut events = 0;
            if rr {
                events |= POLLIN;
            }
            if ww {
                events |= POLLOUT;
            }
            if ee {
                events |= libc::POLLPRI;
            }
            fds.push(pollfd {
                fd,
                events,
                revents: 0,
            });
        }
    }
    let (conns, pairing) = resolve(&fds);
    let n = if conns.iter().any(Option::is_some) || pairing.contains(&true) {
        poll_upgraded(&mut fds, &conns, &pairing, timeout, mask)
    } else {
        // The upgraded socket is gone meanwhile: the kernel answers all.
        let ts = timeout.map(timespec_of);
        let tsp = ts
            .as_ref()
            .map_or(std::ptr::null(), |t| t as *const libc::timespec);
        // SAFETY: our own array; the caller's signal mask, if any.
        unsafe { real::ppoll(fds.as_mut_ptr(), fds.len() as libc::nfds_t, tsp, mask) }
    };
    if n < 0 {
        return -1;
    }
    if fds.iter().any(|p| p.revents & libc::POLLNVAL != 0) {
        real::set_errno(libc::EBADF);
        return -1;
    }
    let words = (sets.nfds as usize).div_ceil(64);
    let mut out: [Vec<u64>; 3] = [vec![0; words], vec![0; words], vec![0; words]];
    let mut count = 0;
    for p in &fds {
        let set =
            |out: &mut [Vec<u64>; 3], w: usize| out[w][p.fd as usize / 64] |= 1 << (p.fd % 64);
        if p.revents & (POLLIN | POLLHUP | POLLERR) != 0 && p.events & POLLIN != 0 {
            set(&mut out, 0);
            count += 1;
        }
        if p.revents & (POLLOUT | POLLERR) != 0 && p.events & POLLOUT != 0 {
            set(&mut out, 1);
            count += 1;
        }
        if p.revents & libc::POLLPRI != 0 && p.events & libc::POLLPRI != 0 {
            set(&mut out, 2);
            count += 1;
        }
    }
    for (o, p) in out.iter().zip(ptrs) {
        if !p.is_null()
            && let Err(e) = crate::user_mem::write(p.cast::<u64>(), o)
        {
            real::set_errno(e);
            return -1;
        }
    }
    count
}
