//! What the whole process shares: the live connections, so that memory
//! hooks and `fork()` can settle in-flight pages without knowing which
//! connection holds them.
//!
//! The preload shim calls the `before_*` / `after_*` functions from its
//! interposed `free`, `realloc`, `munmap`, `mremap` and `madvise`: in-flight
//! pages are finished or copied aside (copy-on-write) before they vanish or
//! lose their protection (`MADV_DONTNEED` silently drops write protection;
//! `mremap` drops the userfaultfd registration). Their fast path is one
//! atomic load when no connection holds memory, and a size check: only
//! ranges holding a whole page can hold protected or armed pages.
//!
//! Fork: a `pthread_atfork` handler settles everything in flight first
//! (sends finished or copied aside, armed receives landed) and stops new
//! arms until the fork is over: protection does not cross a fork (the
//! child's mappings are not registered with our userfaultfd), MAP_SHARED
//! pages would be written by the child unguarded, and staging pages shared
//! with a child could no longer be moved. The child starts clean: it
//! inherits no protection, and its copies of the parent's connections are
//! inert (calls fail, nothing is torn down on the parent's behalf).
//!
//! `unsafe` here: registering the atfork handlers, and the registry's lock,
//! which the fork handlers hold across `fork()` without a guard (a std
//! mutex held by a thread that does not exist in the child would stay
//! locked there forever).

use std::cell::UnsafeCell;
use std::ops::Range;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::{Arc, Weak};

/// A live connection driver, as the process-wide hooks see it.
pub trait Participant: Send + Sync {
    /// Does anything in flight hold pages of `range`?
    fn holds(&self, range: &Range<u64>) -> bool;
    /// Settle everything in flight on `range` (wait, or copy aside), and
    /// return once nothing holds it any more.
    fn evacuate(&self, range: Range<u64>);
    /// `range` is gone (unmapped or moved): drop state kept for it.
    fn forget(&self, range: Range<u64>);
    /// A fork is about to happen (`true`) or is over in the parent (`false`):
    /// while it is pending, receives are not armed.
    fn set_forking(&self, forking: bool);
    /// Freeze the connection for the fork and hold its lock until the
    /// returned value is dropped (after `fork()`, in parent and child), so
    /// the child's copy is consistent and unlocked.
    fn hold_for_fork(self: Arc<Self>) -> Box<dyn std::any::Any>;
    /// Process `pid` holds the connection's descriptor now: a child just
    /// forked with it (noted by the parent as `fork()` returns, and by
    /// the child itself).
    fn forked_holder(&self, pid: u32);
}

/// Where a participant holds pages, readable without its lock and without
/// allocating: memory hooks run inside allocators (jemalloc purges with
/// `madvise`), where taking a driver's lock or calling `malloc` could
/// deadlock or re-enter. The driver updates it under its own lock.
#[derive(Debug)]
pub struct HeldBounds {
    lo: std::sync::atomic::AtomicU64,
    hi: std::sync::atomic::AtomicU64,
}

impl Default for HeldBounds {
    fn default() -> Self {
        HeldBounds {
            lo: std::sync::atomic::AtomicU64::new(u64::MAX),
            hi: std::sync::atomic::AtomicU64::new(0),
        }
    }
}

impl Drop for HeldBounds {
    fn drop(&mut self) {
        self.set(None);
    }
}

/// Participants whose bounds are not empty: memory hooks return at once,
/// without the registry's lock, when none holds anything (always the case
/// while a fork is under way, after its handler settled everything).
static HOLDING: AtomicUsize = AtomicUsize::new(0);

impl HeldBounds {
    /// Record the covering range of what is held now (`None`: nothing).
    /// Widened before the pages are held and narrowed after they are
    /// released, by the driver's lock holder; a reader may see a range too
    /// wide, never one missing a held page.
    pub fn set(&self, r: Option<Range<u64>>) {
        let (lo, hi) = r.map_or((u64::MAX, 0), |r| (r.start, r.end));
        let was = self.holds_any();
        if lo < hi && !was {
            HOLDING.fetch_add(1, Ordering::SeqCst);
        }
        self.lo.store(lo, Ordering::SeqCst);
        self.hi.store(hi, Ordering::SeqCst);
        if lo >= hi && was {
            HOLDING.fetch_sub(1, Ordering::SeqCst);
        }
    }

    fn holds_any(&self) -> bool {
        self.lo.load(Ordering::SeqCst) < self.hi.load(Ordering::SeqCst)
    }

    fn may_overlap(&self, r: &Range<u64>) -> bool {
        let lo = self.lo.load(Ordering::SeqCst);
        let hi = self.hi.load(Ordering::SeqCst);
        lo < hi && r.start < hi && lo < r.end
    }
}

type Entry = (Weak<dyn Participant>, Arc<HeldBounds>);

/// The live participants, behind a lock the fork handlers can hold and
/// release from different handlers (and release in the child).
struct Registry {
    busy: AtomicBool,
    list: UnsafeCell<Vec<Entry>>,
}

// SAFETY: `list` is only accessed while `busy` is held (see `with`).
unsafe impl Sync for Registry {}

impl Registry {
    fn acquire(&self) {
        while self
            .busy
            .compare_exchange_weak(false, true, Ordering::Acquire, Ordering::Relaxed)
            .is_err()
        {
            std::thread::yield_now();
        }
    }

    fn release(&self) {
        self.busy.store(false, Ordering::Release);
    }

    /// Run `f` on the list, under the lock. `f` must not call back into
    /// the registry. The thread counts as inside azsdp meanwhile: an
    /// allocation in `f` (the list growing, a dead entry's memory freed)
    /// re-enters the memory hooks, which would otherwise take this very
    /// lock again and spin for ever.
    fn with<R>(&self, f: impl FnOnce(&mut Vec<Entry>) -> R) -> R {
        let _inside = Inside::enter();
        self.acquire();
        // SAFETY: we hold `busy`, so no one else has a reference to the list.
        let r = f(unsafe { &mut *self.list.get() });
        self.release();
        r
    }
}

static LIVE: Registry = Registry {
    busy: AtomicBool::new(false),
    list: UnsafeCell::new(Vec::new()),
};
/// Registered participants (a hint for the fast path; never under-counts
/// a live one).
static COUNT: AtomicUsize = AtomicUsize::new(0);
/// Participants not dropped yet (see [`Alive`]): [`COUNT`] keeps dropped
/// ones until a sweep, which a worker that paired a connection once may
/// never make.
static ALIVE: AtomicUsize = AtomicUsize::new(0);

/// A participant's place in [`active`]'s count: held by it, given back
/// when it drops.
#[derive(Debug)]
pub struct Alive {
    _counted: crate::sync::Counting,
}

impl Alive {
    pub fn count() -> Alive {
        Alive {
            _counted: crate::sync::Counting::new(&ALIVE),
        }
    }
}
/// How many entries the last sweep of dead ones left.
static SWEPT_LEN: AtomicUsize = AtomicUsize::new(0);
static ATFORK: crate::fork_once::ForkOnce = crate::fork_once::ForkOnce::new();

fn live() -> Vec<Arc<dyn Participant>> {
    LIVE.with(|l| l.iter().filter_map(|(w, _)| w.upgrade()).collect())
}

/// Participants that may hold pages of `range`, found without allocating
/// (at most `N` per call; `visit` gets each).
fn for_each_holding(range: &Range<u64>, mut visit: impl FnMut(&Arc<dyn Participant>)) {
    const N: usize = 16;
    let mut from = 0;
    loop {
        let mut found: [Option<Arc<dyn Participant>>; N] = Default::default();
        let mut n = 0;
        let mut more = false;
        LIVE.with(|l| {
            for (i, (w, b)) in l.iter().enumerate().skip(from) {
                if b.may_overlap(range) {
                    if n == N {
                        from = i;
                        more = true;
                        break;
                    }
                    found[n] = w.upgrade();
                    n += 1;
                }
            }
        });
        for p in found.iter().flatten() {
            visit(p);
        }
        if !more {
            return;
        }
    }
}

/// This process's id, cached (glibc's `getpid` is a system call, and the
/// drivers ask on every call); the fork handler forgets it in a child.
static PID: std::sync::atomic::AtomicU32 = std::sync::atomic::AtomicU32::new(0);

/// The id of the calling process.
pub fn pid() -> u32 {
    let p = PID.load(Ordering::Relaxed);
    if p != 0 {
        return p;
    }
    ensure_atfork();
    let p = raw_pid();
    PID.store(p, Ordering::Relaxed);
    p
}

/// `getpid()`, uncached (for code [`pid`] itself relies on).
pub fn raw_pid() -> u32 {
    std::process::id()
}

/// Install the fork handlers (once per process).
pub(crate) fn ensure_atfork() {
    ATFORK.call(|| {
        // SAFETY: the handlers are plain extern "C" functions with static
        // lifetime; pthread_atfork only records them.
        unsafe { libc::pthread_atfork(Some(fork_prepare), Some(fork_parent), Some(fork_child)) };
    });
}

thread_local! {
    /// Locks of process-wide state held by the forking thread across
    /// `fork()`, so that the child never inherits one held by a thread
    /// that does not exist there (it would block on it forever).
    static HELD_OVER_FORK: std::cell::RefCell<Vec<Box<dyn std::any::Any>>> =
        const { std::cell::RefCell::new(Vec::new()) };
}

/// Make a connection visible to the memory hooks and to fork handling (it
/// leaves by itself when dropped; [`active`] counts it by its [`Alive`]).
pub fn register(p: Weak<dyn Participant>, held: Arc<HeldBounds>) {
    ensure_atfork();
    // Entries of dropped participants are freed here, in an ordinary
    // call, never in a memory hook; only once the list has doubled since
    // the last sweep, so that a sweep's cost is spread over the
    // registrations that made it due (a sweep per registration was
    // quadratic in the connections held).
    let dead = LIVE.with(|l| {
        let mut dead = Vec::new();
        if l.len() >= 2 * SWEPT_LEN.load(Ordering::Relaxed).max(8) {
            let keep;
            (keep, dead) = std::mem::take(l)
                .into_iter()
                .partition(|(w, _)| w.strong_count() > 0);
            *l = keep;
            SWEPT_LEN.store(l.len(), Ordering::Relaxed);
        }
        l.push((p, held));
        COUNT.store(l.len(), Ordering::SeqCst);
        dead
    });
    let _inside = Inside::enter();
    drop(dead);
}

thread_local! {
    /// How many reasons this thread has to count as inside azsdp (a lock
    /// of ours held, a driver turned): memory it frees is azsdp's own, and
    /// asking a driver would deadlock. A count, so that guards may be let
    /// go in any order.
    static INSIDE: std::cell::Cell<u32> = const { std::cell::Cell::new(0) };
}

/// Marks the current thread as inside azsdp while it lives.
#[derive(Debug)]
pub struct Inside {
    _not_send: std::marker::PhantomData<*const ()>,
}

impl Inside {
    pub fn enter() -> Inside {
        let _ = INSIDE.try_with(|c| c.set(c.get() + 1));
        Inside {
            _not_send: std::marker::PhantomData,
        }
    }
}

impl Drop for Inside {
    fn drop(&mut self) {
        let _ = INSIDE.try_with(|c| c.set(c.get().saturating_sub(1)));
    }
}

/// Is the current thread inside azsdp (so hooks must let it pass)?
pub fn inside() -> bool {
    INSIDE.try_with(|c| c.get() > 0).unwrap_or(true)
}

/// Settle whatever holds `range`. Cheap when nothing can.
fn settle(range: Range<u64>) {
    if HOLDING.load(Ordering::SeqCst) == 0 || range.is_empty() || inside() {
        return;
    }
    // Protected and armed pages are whole pages inside one buffer: a range
    // without a whole page cannot hold one.
    let p = crate::pages::system_page_size();
    if range.start.next_multiple_of(p) + p > range.end {
        return;
    }
    crate::sync::in_memory_hook(|| {
        for_each_holding(&range, |c| {
            if c.holds(&range) {
                c.evacuate(range.clone());
            }
        })
    });
}

/// Does any connection exist? (Callers skip their own work, e.g. the
/// readiness hooks' look at our sockets, when not.)
pub fn active() -> bool {
    ALIVE.load(Ordering::Relaxed) > 0
}

/// Would [`before_free`] or [`before_realloc`] do anything now? Only while
/// some connection holds pages, or a cache watches for released memory.
/// (The hooks skip `malloc_usable_size` when not: a server that frees a
/// chunk per request paid 4% of its time for it.)
pub fn releases_matter() -> bool {
    HOLDING.load(Ordering::SeqCst) > 0 || crate::released_memory::watching()
}

/// Before `free(ptr)` of a chunk with `usable` bytes (`malloc_usable_size`).
pub fn before_free(ptr: u64, usable: u64) {
    let range = ptr..ptr.saturating_add(usable);
    crate::released_memory::record(range.clone());
    settle(range);
}

/// Before `realloc(ptr, _)` of a chunk with `usable` bytes: it may move the
/// data (and free the old chunk) or shrink in place.
pub fn before_realloc(ptr: u64, usable: u64) {
    let range = ptr..ptr.saturating_add(usable);
    crate::released_memory::record(range.clone());
    settle(range);
}

/// Before `munmap(addr, len)`.
pub fn before_unmap(addr: u64, len: u64) {
    settle(addr..addr.saturating_add(len));
}

/// After a successful `munmap(addr, len)`.
pub fn after_unmap(addr: u64, len: u64) {
    crate::memory_map::changed(addr..addr.saturating_add(len));
    crate::released_memory::record(addr..addr.saturating_add(len));
    forget(addr..addr.saturating_add(len));
}

/// After a successful `mmap(.., flags, ..)` at `addr` (or `shmat`): the
/// memory map changed, and shared anonymous memory made here belongs to
/// this process alone (until it forks), so it may be protected.
pub fn after_mmap(addr: u64, flags: i32) {
    // (Over other mappings: `after_mmap_over` says which range changed.)
    crate::memory_map::added();
    // (A mapping placed over others is recorded by `after_mmap_over`.)
    let shared_anon = libc::MAP_SHARED | libc::MAP_ANONYMOUS;
    if flags & shared_anon == shared_anon {
        crate::sync::in_memory_hook(|| crate::memory_map::note_process_private(addr));
    }
}

/// After a successful `mmap(addr, len, .., MAP_FIXED, ..)`: whatever was
/// mapped at `[addr, addr+len)` is gone.
pub fn after_mmap_over(addr: u64, len: u64) {
    crate::memory_map::changed(addr..addr.saturating_add(len));
    crate::released_memory::record(addr..addr.saturating_add(len));
}

/// Before `mremap(old, old_len, ..)`: the old range may move or shrink,
/// and its userfaultfd registration does not follow it.
pub fn before_remap(old: u64, old_len: u64) {
    settle(old..old.saturating_add(old_len));
}

/// After a successful `mremap`: the old range is no longer what it was.
pub fn after_remap(old: u64, old_len: u64) {
    crate::memory_map::changed(old..old.saturating_add(old_len));
    crate::released_memory::record(old..old.saturating_add(old_len));
    forget(old..old.saturating_add(old_len));
}

/// Does `madvise(advice)` drop or replace page contents (and with them
/// write protection and armed state)?
pub fn advice_discards(advice: i32) -> bool {
    matches!(
        advice,
        libc::MADV_DONTNEED
            | libc::MADV_FREE
            | libc::MADV_REMOVE
            | libc::MADV_DONTFORK
            | libc::MADV_WIPEONFORK
    )
}

/// Before `madvise(addr, len, advice)`.
pub fn before_madvise(addr: u64, len: u64, advice: i32) {
    if advice_discards(advice) {
        crate::released_memory::record(addr..addr.saturating_add(len));
        settle(addr..addr.saturating_add(len));
    }
}

fn forget(range: Range<u64>) {
    if HOLDING.load(Ordering::SeqCst) == 0 || inside() {
        return;
    }
    // Only state of held pages needs dropping here; cached registrations
    // are checked by the protector when next used.
    crate::sync::in_memory_hook(|| for_each_holding(&range, |c| c.forget(range.clone())));
}

/// Settle everything in every connection, with arms stopped, so nothing is
/// protected or armed when the address space is copied.
pub fn quiesce_for_fork() {
    if COUNT.load(Ordering::SeqCst) == 0 {
        return;
    }
    for c in live() {
        c.set_forking(true);
        c.evacuate(0..u64::MAX);
    }
}

extern "C" fn fork_prepare() {
    // From here no other thread starts a critical section of ours (and the
    // ones running end), so the child inherits none of our locks held.
    crate::sync::raise_fork_barrier();
    // Never unwind into libc.
    let _ = std::panic::catch_unwind(quiesce_for_fork);
    // The child maps the process's shared memory too from now on.
    let _ = std::panic::catch_unwind(crate::memory_map::forget_process_private);
    // Held across fork(): released by the parent and child handlers.
    // Drivers first (their code takes the memory-map lock inside theirs).
    let _ = std::panic::catch_unwind(|| {
        let mut guards: Vec<Box<dyn std::any::Any>> =
            live().into_iter().map(|c| c.hold_for_fork()).collect();
        guards.extend(crate::memory_map::fork_guards());
        guards.extend(crate::protect::fork_guards());
        guards.extend(crate::driver::reactor::fork_guards());
        let _ = HELD_OVER_FORK.try_with(|h| h.borrow_mut().extend(guards));
    });
    LIVE.acquire();
}

/// Release what `fork_prepare` held (in the parent, or in the child where
/// the forking thread is the only one).
fn release_held() {
    let _ = HELD_OVER_FORK.try_with(|h| h.borrow_mut().clear());
}

extern "C" fn fork_parent() {
    release_held();
    LIVE.release();
    crate::sync::lower_fork_barrier();
    let _ = std::panic::catch_unwind(|| {
        for c in live() {
            c.set_forking(false);
        }
    });
}

extern "C" fn fork_child() {
    PID.store(0, Ordering::SeqCst);
    // This handler runs, so the registration took effect before the fork
    // (glibc serialises the two), whatever state the parent's flag was in.
    ATFORK.mark_done();
    // The child is single-threaded: no one else can hold the lock here.
    release_held();
    LIVE.release();
    crate::sync::lower_fork_barrier();
    // Connections see they are in a child by their owner's pid; the
    // processes that share them learn that this one holds them too.
    let _ = std::panic::catch_unwind(|| forked_holder(pid()));
}

/// Process `child` was just forked from this one (or is this one, in the
/// child): it holds every connection's descriptor this process held, so a
/// runner's close must not end them while it lives. The parent calls this
/// as `fork()` returns, before the program can close anything; the child
/// calls it too (forks the shim's hook did not see).
pub fn forked_holder(child: u32) {
    if COUNT.load(Ordering::SeqCst) == 0 {
        return;
    }
    for c in live() {
        c.forked_holder(child);
    }
}
