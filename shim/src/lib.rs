//! `libazsdp.so`, the preload library.
//!
//! Symbol interposition of the socket, readiness, descriptor and memory calls
//! comes with the shim issue; until then the library only reports its version
//! so that `azsdp run` can check what it preloads.

use std::ffi::c_char;

/// NUL-terminated version string of this library.
#[unsafe(no_mangle)]
pub extern "C" fn azsdp_shim_version() -> *const c_char {
    concat!(env!("CARGO_PKG_VERSION"), "\0").as_ptr().cast()
}
