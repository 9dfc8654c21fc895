//! Process-wide state of the shim, set up on first use: the configuration,
//! the program's name, the stat file and its publisher thread, and the
//! connections still finishing after `close()`.

use azsdp::sync::Lock;
use std::path::PathBuf;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU32, AtomicU64, Ordering};

use azsdp::fork_once::ForkOnceCell;
use std::time::Duration;

use azsdp::config::Config;
use azsdp::stats::StatFile;

use crate::conn::Conn;
use crate::log::{debug, error, warning};

/// `AZSDP_DISABLE` is set: the shim leaves every socket alone.
pub fn disabled() -> bool {
    static DISABLED: ForkOnceCell<bool> = ForkOnceCell::new();
    *DISABLED.get_or_init(|| std::env::var_os("AZSDP_DISABLE").is_some())
}

/// The configuration, or why it could not be loaded (then everything
/// stays on TCP).
pub fn config() -> Option<&'static Config> {
    static CONFIG: ForkOnceCell<Option<Config>> = ForkOnceCell::new();
    CONFIG
        .get_or_init(|| {
            if disabled() {
                return None;
            }
            route_messages();
            match Config::from_environment(None, std::env::vars_os()) {
                Ok(c) => {
                    debug!(
                        "configuration from {}",
                        c.source
                            .as_ref()
                            .map_or("built-in defaults".into(), |p| p.display().to_string())
                    );
                    Some(c)
                }
                Err(e) => {
                    for p in &e.problems {
                        error!("{p}");
                    }
                    error!(
                        "{} configuration problem(s): this program stays on plain TCP",
                        e.problems.len()
                    );
                    None
                }
            }
        })
        .as_ref()
}

/// The core's notes and the shim's own panics (caught at the boundary,
/// but the default hook would print them on the program's stderr) go to
/// the log.
fn route_messages() {
    azsdp::notes::set_sink(|m| warning!("{m}"));
    // The hook of this library's own copy of std: a Rust program's panics
    // go through its own.
    std::panic::set_hook(Box::new(|info| error!("internal error: {info}")));
}

/// The program as it was invoked (argv[0], so `redis-server` rather than
/// the binary it links to), else its executable's path; rules match it.
pub fn program() -> &'static str {
    static PROGRAM: ForkOnceCell<String> = ForkOnceCell::new();
    PROGRAM.get_or_init(|| {
        let argv0 = std::fs::read("/proc/self/cmdline").ok().and_then(|c| {
            let first = c.split(|b| *b == 0).next()?.to_vec();
            String::from_utf8(first).ok().filter(|s| !s.is_empty())
        });
        argv0
            .or_else(|| {
                std::fs::read_link("/proc/self/exe")
                    .ok()
                    .and_then(|p: PathBuf| p.to_str().map(str::to_string))
            })
            .unwrap_or_default()
    })
}

struct Stats {
    pid: u32,
    file: Option<Arc<StatFile>>,
}

static STATS: Lock<Option<Stats>> = Lock::new(None);

/// This process's stat file (a forked child makes its own).
pub fn stat_file() -> Option<Arc<StatFile>> {
    // (Cached: asked at every connection; the fork handlers keep it true.)
    let pid = azsdp::process::pid();
    let mut g = STATS.lock();
    if let Some(s) = g.as_ref() {
        if s.pid == pid {
            return s.file.clone();
        }
        // The parent's: keep its file (dropping it here would not remove
        // it, the pid differs) and start ours.
        if let Some(old) = g.take().and_then(|s| s.file) {
            std::mem::forget(old);
        }
    }
    let name = program().rsplit('/').next().unwrap_or("?");
    let file = match StatFile::create(&azsdp::stats::dir(), name) {
        Ok(f) => Some(Arc::new(f)),
        Err(e) => {
            warning!("no stat file ({e}): `azsdp stat` will not show this process");
            None
        }
    };
    ensure_exit_handler();
    *g = Some(Stats {
        pid,
        file: file.clone(),
    });
    start_publisher();
    file
}

/// In a forked child that inherited upgraded connections: its own stat
/// file and publisher, which also give connections it takes over a slot.
pub fn after_fork_in_child() {
    if crate::fdtable::all().iter().any(|s| s.conn().is_some()) {
        let _ = stat_file();
    }
}

/// Connections closed by the program that still finish in the background.
static CLOSING: Lock<Vec<Arc<Conn>>> = Lock::new(Vec::new());

/// (The publisher retires the finished ones: a close must not scan them
/// all, which with many connections made every close slow.)
pub fn closing(c: Arc<Conn>) {
    CLOSING.lock().push(c);
    start_publisher();
}

/// The publisher: copies live connections' counters into the stat file
/// ten times a second, retires finished background closes, and keeps
/// listeners' pairing queues moving.
pub fn start_publisher() {
    static STARTED_IN: AtomicU32 = AtomicU32::new(0);
    let pid = azsdp::process::pid();
    if STARTED_IN.load(Ordering::Relaxed) == pid {
        return;
    }
    if STARTED_IN.swap(pid, Ordering::SeqCst) == pid {
        return;
    }
    let r = azsdp::threads::spawn("azsdp-stats", || {
        loop {
            std::thread::sleep(Duration::from_millis(100));
            publish_all();
        }
    });
    if let Err(e) = r {
        debug!("no stats thread: {e}");
    }
}

pub fn publish_all() {
    let _inside = azsdp::process::Inside::enter();
    for s in crate::fdtable::all() {
        match s.role() {
            crate::sock::Role::Azsdp(c) => c.publish(),
            crate::sock::Role::Listener(l) => l.maintain(),
            _ => {}
        }
    }
    crate::pending::expire();
    azsdp::fabric::shm::bells::prune();
    // Finished connections are dropped after the lock is released: the
    // drop joins their threads, which may be waiting for a fork to end.
    let finished: Vec<Arc<Conn>> = {
        let mut v = CLOSING.lock();
        v.iter().for_each(|c| c.publish());
        let (done, live) = std::mem::take(&mut *v)
            .into_iter()
            .partition(|c| c.finished());
        *v = live;
        done
    };
    drop(finished);
}

static AT_EXIT: AtomicBool = AtomicBool::new(false);

/// At exit, let connections finish what the program sent (bounded by
/// their linger time), as the kernel would for TCP.
pub fn ensure_exit_handler() {
    if !AT_EXIT.swap(true, Ordering::SeqCst) {
        // SAFETY: registering a plain extern "C" function.
        unsafe { libc::atexit(at_exit) };
    }
}

/// Wait for the connections the program closed to finish in the
/// background (each bounded by its linger time).
pub fn join_closing() {
    let v: Vec<Arc<Conn>> = CLOSING.lock().clone();
    for c in v {
        c.join_closed();
        c.report();
    }
}

/// [`join_closing`] for the connections that other processes use too
/// (closed here, moving onto TCP for them).
pub fn join_closing_served() {
    let v: Vec<Arc<Conn>> = CLOSING.lock().clone();
    for c in v.iter().filter(|c| c.driver.serves_others()) {
        c.join_closed();
        c.report();
    }
}

/// The process ends: close every connection, as the kernel closes its
/// sockets, and wait for each to deliver what the program sent (bounded by
/// its linger time); our stat file goes with us (a forked child's is its
/// own).
extern "C" fn at_exit() {
    let _ = std::panic::catch_unwind(finish_connections);
}

fn finish_connections() {
    for s in crate::fdtable::all() {
        if let Some(c) = s.conn() {
            c.close();
        }
    }
    join_closing();
    let pid = std::process::id();
    if let Some(s) = STATS.lock().as_ref().filter(|s| s.pid == pid)
        && let Some(f) = &s.file
    {
        f.remove();
    }
}

/// The longest linger time of any connection this process made, in
/// milliseconds: what an exit may wait for them.
static LONGEST_LINGER_MS: AtomicU64 = AtomicU64::new(0);

pub fn note_linger(d: Duration) {
    LONGEST_LINGER_MS.fetch_max(d.as_millis() as u64, Ordering::Relaxed);
}

pub fn longest_linger() -> Duration {
    Duration::from_millis(LONGEST_LINGER_MS.load(Ordering::Relaxed))
}
