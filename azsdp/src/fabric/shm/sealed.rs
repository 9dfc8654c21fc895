//! Shared memory the peer may map but never resize: a memfd of a fixed
//! length, mapped here first, then sealed (a segment, a loop's sleepers'
//! page).
//!
//! `unsafe` here: mapping the fresh memfd.

use std::ffi::CStr;
use std::os::fd::OwnedFd;

use memmap2::{MmapMut, MmapOptions};
use nix::fcntl::{FcntlArg, SealFlag, fcntl};
use nix::sys::memfd::{MFdFlags, memfd_create};

/// A new memfd called `name` of `len` bytes, mapped shared and writable
/// here, then sealed with `seals` (mapped before: `F_SEAL_FUTURE_WRITE`
/// forbids writable mappings made after it, not this one).
pub(super) fn create(
    name: &CStr,
    len: usize,
    seals: SealFlag,
) -> std::io::Result<(OwnedFd, MmapMut)> {
    // (One descriptor, sized as a `File` and handed back as an `OwnedFd`:
    // no duplicate to make and close per pair.)
    let file = std::fs::File::from(memfd_create(
        name,
        MFdFlags::MFD_CLOEXEC | MFdFlags::MFD_ALLOW_SEALING,
    )?);
    crate::file_size::set_len(&file, len as u64)?;
    // SAFETY: a fresh memfd of `len` bytes, mapped shared; nobody else has
    // it yet.
    let map = unsafe { MmapOptions::new().len(len).map_mut(&file)? };
    fcntl(&file, FcntlArg::F_ADD_SEALS(seals))?;
    Ok((OwnedFd::from(file), map))
}
