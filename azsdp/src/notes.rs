//! Where the core's rare messages go ("no userfaultfd: zero-copy sends are
//! synchronous", "no reactor: ...").
//!
//! Nowhere until someone says: the core runs inside other people's
//! programs (preloaded), whose stderr may be a log file, a closed pipe or
//! a file under `RLIMIT_FSIZE=0`, where an unasked-for line is at best
//! noise and at worst a SIGPIPE or SIGXFSZ. The shim routes them to its
//! log (`AZSDP_LOG`), the `azsdp` command to its stderr.

use crate::sync::RwLock;

static SINK: RwLock<Option<fn(&str)>> = RwLock::new(None);

/// Send every later note to `sink`.
pub fn set_sink(sink: fn(&str)) {
    *SINK.write() = Some(sink);
}

/// Say `msg` through the sink, if there is one.
pub fn note(msg: &str) {
    let sink = *SINK.read();
    if let Some(sink) = sink {
        sink(msg);
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::atomic::{AtomicU32, Ordering};

    static HEARD: AtomicU32 = AtomicU32::new(0);

    fn count(msg: &str) {
        assert_eq!(msg, "hello");
        HEARD.fetch_add(1, Ordering::SeqCst);
    }

    #[test]
    fn notes_reach_the_sink_once_one_is_set() {
        set_sink(count);
        note("hello");
        assert_eq!(HEARD.load(Ordering::SeqCst), 1);
    }
}
