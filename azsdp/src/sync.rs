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

use std::ops::{Deref, DerefMut};

use crate::process::Inside;

/// A mutex whose holder counts as inside azsdp.
#[derive(Debug, Default)]
pub struct Lock<T> {
    m: std::sync::Mutex<T>,
}

/// A held [`Lock`]. The guard is released before the thread leaves
/// "inside" (field order).
#[derive(Debug)]
pub struct LockGuard<'a, T> {
    guard: std::sync::MutexGuard<'a, T>,
    _inside: Inside,
}

impl<T> Lock<T> {
    pub const fn new(v: T) -> Lock<T> {
        Lock {
            m: std::sync::Mutex::new(v),
        }
    }

    pub fn lock(&self) -> LockGuard<'_, T> {
        let inside = Inside::enter();
        LockGuard {
            guard: self.m.lock().unwrap_or_else(|e| e.into_inner()),
            _inside: inside,
        }
    }

    /// The lock if nobody holds it now.
    pub fn try_lock(&self) -> Option<LockGuard<'_, T>> {
        let inside = Inside::enter();
        let guard = match self.m.try_lock() {
            Ok(g) => g,
            Err(std::sync::TryLockError::Poisoned(e)) => e.into_inner(),
            Err(std::sync::TryLockError::WouldBlock) => return None,
        };
        Some(LockGuard {
            guard,
            _inside: inside,
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
}

/// A [`RwLock`] held for writing.
#[derive(Debug)]
pub struct WriteGuard<'a, T> {
    guard: std::sync::RwLockWriteGuard<'a, T>,
    _inside: Inside,
}

impl<T> RwLock<T> {
    pub const fn new(v: T) -> RwLock<T> {
        RwLock {
            l: std::sync::RwLock::new(v),
        }
    }

    pub fn read(&self) -> ReadGuard<'_, T> {
        let inside = Inside::enter();
        ReadGuard {
            guard: self.l.read().unwrap_or_else(|e| e.into_inner()),
            _inside: inside,
        }
    }

    pub fn write(&self) -> WriteGuard<'_, T> {
        let inside = Inside::enter();
        WriteGuard {
            guard: self.l.write().unwrap_or_else(|e| e.into_inner()),
            _inside: inside,
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

#[cfg(test)]
mod tests {
    use super::*;

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
