//! `libazsdp.so`, the preload library: unmodified socket programs on AZ-SDP.
//!
//! The program's TCP sockets stay real kernel sockets. A listener under
//! azsdp registers for pairing ([`listener`]); a client under azsdp that
//! finds the registration pairs with it inside `connect()` ([`connect`]),
//! and both move their byte stream to an AZ-SDP engine on the shm fabric
//! ([`conn`]). Everything else (another host, a peer not under azsdp, a
//! rule, any failure) stays plain TCP, with the reason in `azsdp stat`.
//!
//! Modules: [`real`] finds libc's own functions; [`hooks`] are the
//! interposed ones; [`fdtable`] and [`sock`] track the sockets; [`ready`]
//! and [`epoll`] emulate readiness of upgraded sockets; [`switch`] moves a
//! connection onto its TCP socket (before an exec); [`runtime`] holds
//! the configuration, the stat file and exit handling; [`log`] is the log.
//! See `docs/shim.md`.

mod conn;
mod connect;
mod endpoint;
mod epoll;
mod exec_park;
mod fdtable;
mod hooks;
mod join;
mod listener;
mod log;
mod net;
mod next_image;
mod pending;
mod ready;
mod real;
mod runtime;
mod signals;
mod sock;
mod switch;
mod user_mem;
#[cfg(feature = "verbs")]
mod verbs_pairing;

use std::ffi::c_char;

/// Runs when the library is loaded, before the program's `main`: what the
/// process starts with that later changes are told from.
extern "C" fn on_load() {
    let _ = std::panic::catch_unwind(azsdp::sandbox::note_start);
    // Connections the program before an exec parked for this one.
    if !runtime::disabled() {
        let _ = std::panic::catch_unwind(exec_park::take_up);
    }
}

#[used]
#[unsafe(link_section = ".init_array")]
static ON_LOAD: extern "C" fn() = on_load;

/// NUL-terminated version string of this library.
#[unsafe(no_mangle)]
pub extern "C" fn azsdp_shim_version() -> *const c_char {
    concat!(env!("CARGO_PKG_VERSION"), "\0").as_ptr().cast()
}
