//! Which descriptors are sockets the shim looks after.
//!
//! Every `read`, `write`, `close` and `poll` of the program passes through
//! the shim, nearly all of them on descriptors it does not care about. A
//! flat array of one flag per descriptor answers "ours?" with one relaxed
//! load and no lock; only descriptors flagged there are looked up in the
//! map. Several descriptors (dup, fork) may name one [`Sock`].

use azsdp::sync::RwLock;
use std::collections::BTreeMap;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};

use crate::sock::Sock;

const FAST: usize = 1 << 16;

static FLAGS: [AtomicBool; FAST] = [const { AtomicBool::new(false) }; FAST];
static MAP: RwLock<BTreeMap<i32, Arc<Sock>>> = RwLock::new(BTreeMap::new());

fn flagged(fd: i32) -> bool {
    match usize::try_from(fd) {
        Ok(i) if i < FAST => FLAGS[i].load(Ordering::Relaxed),
        Ok(_) => true,
        Err(_) => false,
    }
}

fn set_flag(fd: i32, on: bool) {
    if let Ok(i) = usize::try_from(fd)
        && i < FAST
    {
        FLAGS[i].store(on, Ordering::Relaxed);
    }
}

/// The socket behind `fd`, if the shim tracks it.
pub fn get(fd: i32) -> Option<Arc<Sock>> {
    if !flagged(fd) {
        return None;
    }
    MAP.read().get(&fd).cloned()
}

/// Track `fd` as `sock` (replacing whatever it named: the kernel reused it).
pub fn insert(fd: i32, sock: Arc<Sock>) -> Option<Arc<Sock>> {
    let mut m = MAP.write();
    let old = m.insert(fd, sock);
    set_flag(fd, true);
    old
}

/// Stop tracking `fd`; returns what it named.
pub fn remove(fd: i32) -> Option<Arc<Sock>> {
    if !flagged(fd) {
        return None;
    }
    let mut m = MAP.write();
    set_flag(fd, false);
    m.remove(&fd)
}

/// Every tracked descriptor and its socket.
pub fn entries() -> Vec<(i32, Arc<Sock>)> {
    MAP.read()
        .iter()
        .map(|(fd, s)| (*fd, Arc::clone(s)))
        .collect()
}

/// Every tracked socket (each once), for exit and stats.
pub fn all() -> Vec<Arc<Sock>> {
    let mut v: Vec<Arc<Sock>> = MAP.read().values().cloned().collect();
    v.sort_unstable_by_key(|s| Arc::as_ptr(s) as usize);
    v.dedup_by(|a, b| Arc::ptr_eq(a, b));
    v
}
