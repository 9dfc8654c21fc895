//! Words a connection's side shares with the processes forked from the one
//! that made it: whether one of them asked the runner to move the
//! connection onto its TCP socket, and whether it has. (A queue pair stays
//! with its process; the others use the connection through it, or, once it
//! moved, through the kernel's socket: `driver::delegation`.)

use std::sync::atomic::{AtomicU32, Ordering};

use crate::driver::delegation::SharedPages;

#[derive(Default)]
struct Words {
    leave: AtomicU32,
    left: AtomicU32,
}

/// A page of `MAP_SHARED` anonymous memory (inherited by every fork).
pub struct ForkWords(SharedPages<Words>);

impl std::fmt::Debug for ForkWords {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ForkWords")
            .field("leave_requested", &self.leave_requested())
            .field("has_left", &self.has_left())
            .finish()
    }
}

impl ForkWords {
    pub fn new() -> std::io::Result<ForkWords> {
        SharedPages::new().map(ForkWords)
    }

    pub fn request_leave(&self) {
        self.0.get().leave.store(1, Ordering::Release);
    }

    pub fn leave_requested(&self) -> bool {
        self.0.get().leave.load(Ordering::Acquire) != 0
    }

    pub fn mark_left(&self) {
        let w = &self.0.get().left;
        w.store(1, Ordering::Release);
        crate::futex::wake_all(w);
    }

    pub fn has_left(&self) -> bool {
        self.0.get().left.load(Ordering::Acquire) != 0
    }
}

/// One flag shared with the processes forked from the one that made it (a
/// listener's: "a forked copy accepts on this socket").
pub struct SharedFlag(SharedPages<AtomicU32>);

impl std::fmt::Debug for SharedFlag {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_tuple("SharedFlag").field(&self.is_set()).finish()
    }
}

impl SharedFlag {
    pub fn new() -> std::io::Result<SharedFlag> {
        SharedPages::new().map(SharedFlag)
    }

    pub fn set(&self) {
        self.0.get().store(1, Ordering::Release);
    }

    pub fn is_set(&self) -> bool {
        self.0.get().load(Ordering::Acquire) != 0
    }
}
