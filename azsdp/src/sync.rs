//! The only locks azsdp code takes.
//!
//! Memory hooks (`free`, `munmap`, `madvise`, ...) run inside any
//! allocation, including ours: a thread that holds a lock and allocates can
//! re-enter azsdp from a hook, which may then want the very lock it holds
//! (a freeze seen at about 130 connections), or another lock whose holder
//! waits for this one. So a thread holding any of these locks counts as
//! inside azsdp ([`Inside`]) until it lets go, and the hooks let it pass:
//! memory azsdp frees is azsdp's own, never an application buffer with
//! pages in flight.
//!
//! Poisoning is ignored: a panic elsewhere (caught at the FFI boundary)
//! must not wedge every later call.
//!
//! A test (`tests/lock_discipline.rs`) fails if a bare `std::sync` lock
//! appears anywhere else in the core or the shim.
//!
//! **Fork.** A lock held by another thread when the program calls `fork()`
//! would stay held for ever in the child, where that thread does not
//! exist (a forked child hung in `close()` on a lock the stats thread held).
//! So a fork is a barrier ([`raise_fork_barrier`]): from then on a thread
//! that holds none of these locks cannot take one (it waits for the fork to
//! be over), threads that hold some finish and let go (our locks are never
//! held across a sleep), and the forking thread goes on only once no other
//! thread holds any. The child starts with every lock free. Memory hooks
//! are not held back ([`in_memory_hook`]): they run inside the allocator,
//! whose own fork handler would wait for them; the fork handler settles
//! everything in flight first, after which they need no lock at all.

use std::cell::Cell;
use std::ops::{Deref, DerefMut};
use std::sync::atomic::{AtomicI32, AtomicUsize, Ordering};

use crate::process::Inside;

/// The thread raising the fork barrier (0: none).
static FORKER: AtomicI32 = AtomicI32::new(0);
/// Threads that hold at least one lock now, counted in shards (one per
/// thread, assigned in turn), so that threads taking locks at once do not
/// bounce one cache line between CPUs: in a two-worker memcached the one
/// counter cost 5% of the server's time. The fork barrier sums them.
static HELD: [Shard; SHARDS] = [const { Shard(AtomicUsize::new(0)) }; SHARDS];
const SHARDS: usize = 16;
/// The next shard a thread takes.
static NEXT_SHARD: AtomicUsize = AtomicUsize::new(0);

#[repr(align(64))]
struct Shard(AtomicUsize);

thread_local! {
    /// Locks this thread holds.
    static DEPTH: Cell<u32> = const { Cell::new(0) };
    /// This thread runs a memory hook (the barrier lets it through).
    static IN_HOOK: Cell<u32> = const { Cell::new(0) };
    /// This thread's shard of [`HELD`] (`usize::MAX`: none yet). Constant
    /// and without a destructor, so readable for the thread's whole life:
    /// [`enter`] and [`leave`] always find the same one.
    static SHARD: Cell<usize> = const { Cell::new(usize::MAX) };
}

fn my_shard() -> &'static AtomicUsize {
    let i = SHARD
        .try_with(|s| {
            if s.get() == usize::MAX {
                s.set(NEXT_SHARD.fetch_add(1, Ordering::Relaxed) % SHARDS);
            }
            s.get()
        })
        .unwrap_or(0);
    &HELD[i].0
}

fn holders() -> usize {
    HELD.iter().map(|s| s.0.load(Ordering::SeqCst)).sum()
}

/// The calling thread's kernel id (a system call: not for hot paths).
pub fn tid() -> i32 {
    // SAFETY: gettid has no arguments and cannot fail.
    unsafe { libc::gettid() }
}

/// Count a lock as held by this thread, waiting first if a fork is under
/// way and this thread holds none. (A thread is counted once, at its
/// first lock: a fork barrier waits for it until it holds none.)
fn enter() {
    let depth = DEPTH.try_with(Cell::get).unwrap_or(0);
    if depth == 0 {
        let hooked = IN_HOOK.try_with(Cell::get).unwrap_or(0) > 0;
        let held = my_shard();
        loop {
            held.fetch_add(1, Ordering::SeqCst);
            let f = FORKER.load(Ordering::SeqCst);
            if f == 0 || hooked || f == tid() {
                break;
            }
            // A fork is under way and would copy this lock held: wait it out.
            held.fetch_sub(1, Ordering::SeqCst);
            while FORKER.load(Ordering::SeqCst) == f {
                crate::futex::wait_i32(&FORKER, f, std::time::Duration::from_millis(1));
            }
        }
    }
    let _ = DEPTH.try_with(|d| d.set(depth + 1));
}

fn leave() {
    let depth = DEPTH.try_with(Cell::get).unwrap_or(0);
    let _ = DEPTH.try_with(|d| d.set(depth.saturating_sub(1)));
    if depth == 1 {
        my_shard().fetch_sub(1, Ordering::SeqCst);
    }
}

/// How many of these locks the calling thread holds. Nothing may wait for
/// another thread (join, condition) while this is not zero: that thread
/// may be held back by a fork barrier which waits for this one.
pub fn held_here() -> u32 {
    DEPTH.try_with(Cell::get).unwrap_or(0)
}

/// `fork()` is about to copy this process: keep every lock of ours free
/// in the copy (see the module docs). Returns once no other thread holds
/// one; the forking thread may take them itself meanwhile.
pub fn raise_fork_barrier() {
    FORKER.store(tid(), Ordering::SeqCst);
    let mine = usize::from(DEPTH.try_with(Cell::get).unwrap_or(0) > 0);
    while holders() > mine {
        std::thread::yield_now();
    }
}

/// The fork is over (in the parent, or in the child, where the forking
/// thread is the only one): locks may be taken again.
pub fn lower_fork_barrier() {
    FORKER.store(0, Ordering::SeqCst);
    crate::futex::wake_all_i32(&FORKER);
}

/// Run `f` as part of a memory hook: locks it takes are not held back by a
/// fork barrier.
pub fn in_memory_hook<R>(f: impl FnOnce() -> R) -> R {
    struct Out;
    impl Drop for Out {
        fn drop(&mut self) {
            let _ = IN_HOOK.try_with(|h| h.set(h.get().saturating_sub(1)));
        }
    }
    let _ = IN_HOOK.try_with(|h| h.set(h.get() + 1));
    let _out = Out;
    f()
}

/// A mutex whose holder counts as inside azsdp.
#[derive(Debug, Default)]
pub struct Lock<T> {
    m: std::sync::Mutex<T>,
}

/// Counts one held lock of ours (see [`raise_fork_barrier`]) while it
/// lives; dropped after the lock is released (declared last).
#[derive(Debug)]
struct Counted;

impl Counted {
    fn new() -> Counted {
        enter();
        Counted
    }
}

impl Drop for Counted {
    fn drop(&mut self) {
        leave();
    }
}

/// A held [`Lock`]. The guard is released before the thread leaves
/// "inside" and stops counting it (field order).
#[derive(Debug)]
pub struct LockGuard<'a, T> {
    guard: std::sync::MutexGuard<'a, T>,
    _inside: Inside,
    _counted: Counted,
}

impl<T> Lock<T> {
    pub const fn new(v: T) -> Lock<T> {
        Lock {
            m: std::sync::Mutex::new(v),
        }
    }

    pub fn lock(&self) -> LockGuard<'_, T> {
        let counted = Counted::new();
        let inside = Inside::enter();
        LockGuard {
            guard: self.m.lock().unwrap_or_else(|e| e.into_inner()),
            _inside: inside,
            _counted: counted,
        }
    }

    /// The lock if nobody holds it now.
    pub fn try_lock(&self) -> Option<LockGuard<'_, T>> {
        let counted = Counted::new();
        let inside = Inside::enter();
        let guard = match self.m.try_lock() {
            Ok(g) => g,
            Err(std::sync::TryLockError::Poisoned(e)) => e.into_inner(),
            Err(std::sync::TryLockError::WouldBlock) => return None,
        };
        Some(LockGuard {
            guard,
            _inside: inside,
            _counted: counted,
        })
    }

    pub fn into_inner(self) -> T {
        self.m.into_inner().unwrap_or_else(|e| e.into_inner())
    }
}

impl<T> Deref for LockGuard<'_, T> {
    type Target = T;
    fn deref(&self) -> &T {
        &self.guard
    }
}

impl<T> DerefMut for LockGuard<'_, T> {
    fn deref_mut(&mut self) -> &mut T {
        &mut self.guard
    }
}

/// A reader-writer lock whose holders count as inside azsdp.
#[derive(Debug, Default)]
pub struct RwLock<T> {
    l: std::sync::RwLock<T>,
}

/// A [`RwLock`] held for reading.
#[derive(Debug)]
pub struct ReadGuard<'a, T> {
    guard: std::sync::RwLockReadGuard<'a, T>,
    _inside: Inside,
    _counted: Counted,
}

/// A [`RwLock`] held for writing.
#[derive(Debug)]
pub struct WriteGuard<'a, T> {
    guard: std::sync::RwLockWriteGuard<'a, T>,
    _inside: Inside,
    _counted: Counted,
}

impl<T> RwLock<T> {
    pub const fn new(v: T) -> RwLock<T> {
        RwLock {
            l: std::sync::RwLock::new(v),
        }
    }

    pub fn read(&self) -> ReadGuard<'_, T> {
        let counted = Counted::new();
        let inside = Inside::enter();
        ReadGuard {
            guard: self.l.read().unwrap_or_else(|e| e.into_inner()),
            _inside: inside,
            _counted: counted,
        }
    }

    pub fn write(&self) -> WriteGuard<'_, T> {
        let counted = Counted::new();
        let inside = Inside::enter();
        WriteGuard {
            guard: self.l.write().unwrap_or_else(|e| e.into_inner()),
            _inside: inside,
            _counted: counted,
        }
    }
}

impl<T> Deref for ReadGuard<'_, T> {
    type Target = T;
    fn deref(&self) -> &T {
        &self.guard
    }
}

impl<T> Deref for WriteGuard<'_, T> {
    type Target = T;
    fn deref(&self) -> &T {
        &self.guard
    }
}

impl<T> DerefMut for WriteGuard<'_, T> {
    fn deref_mut(&mut self) -> &mut T {
        &mut self.guard
    }
}

/// One in a static count while it lives (a count that fast paths read
/// without a lock).
#[derive(Debug)]
pub struct Counting(&'static AtomicUsize);

impl Counting {
    pub fn new(count: &'static AtomicUsize) -> Counting {
        count.fetch_add(1, Ordering::SeqCst);
        Counting(count)
    }
}

impl Drop for Counting {
    fn drop(&mut self) {
        self.0.fetch_sub(1, Ordering::SeqCst);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// While a fork barrier is up, a thread that holds none of our locks
    /// waits to take one; one already holding a lock goes on; the forker
    /// goes on once the others let go.
    #[test]
    fn a_fork_barrier_waits_for_holders_and_holds_back_newcomers() {
        use std::sync::Arc;
        use std::sync::atomic::AtomicBool;
        let a = Arc::new(Lock::new(0u32));
        let b = Arc::new(Lock::new(0u32));
        // A holder that takes a second lock while the barrier is up.
        let (ga, gb) = (Arc::clone(&a), Arc::clone(&b));
        let holding = Arc::new(AtomicBool::new(false));
        let h2 = Arc::clone(&holding);
        let holder = std::thread::spawn(move || {
            let _x = ga.lock();
            h2.store(true, Ordering::SeqCst);
            std::thread::sleep(std::time::Duration::from_millis(100));
            *gb.lock() += 1;
        });
        while !holding.load(Ordering::SeqCst) {
            std::thread::yield_now();
        }
        let t0 = std::time::Instant::now();
        raise_fork_barrier();
        assert!(
            t0.elapsed() >= std::time::Duration::from_millis(50),
            "waited for the holder"
        );
        holder.join().unwrap();
        // A newcomer waits until the barrier is lowered.
        let took = Arc::new(AtomicBool::new(false));
        let (gt, gb2) = (Arc::clone(&took), Arc::clone(&b));
        let newcomer = std::thread::spawn(move || {
            *gb2.lock() += 1;
            gt.store(true, Ordering::SeqCst);
        });
        std::thread::sleep(std::time::Duration::from_millis(50));
        assert!(!took.load(Ordering::SeqCst), "held back");
        // The forker itself may lock.
        *a.lock() += 1;
        lower_fork_barrier();
        newcomer.join().unwrap();
        assert!(took.load(Ordering::SeqCst));
        assert_eq!(*b.lock(), 2);
    }

    #[test]
    fn holders_are_inside_and_leave_when_they_let_go() {
        let l = Lock::new(1);
        assert!(!crate::process::inside());
        {
            let mut g = l.lock();
            *g += 1;
            assert!(crate::process::inside());
            assert!(l.try_lock().is_none());
        }
        assert!(!crate::process::inside());
        let r = RwLock::new(5);
        {
            let a = r.read();
            let b = r.read();
            assert_eq!(*a + *b, 10);
            assert!(crate::process::inside());
        }
        *r.write() = 6;
        assert!(!crate::process::inside());
        assert_eq!(*r.read(), 6);
        assert_eq!(l.into_inner(), 2);
    }
}
