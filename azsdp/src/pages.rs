//! Page arithmetic (from `azsdp-proto`) and this host's page size.

pub use azsdp_proto::pages::*;

/// This host's page size (read once).
pub fn system_page_size() -> u64 {
    // Not a OnceLock: one caught mid-initialisation by a fork would block
    // the child forever; racing first readers just both ask.
    static PAGE: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(0);
    let p = PAGE.load(std::sync::atomic::Ordering::Relaxed);
    if p != 0 {
        return p;
    }
    let p = nix::unistd::sysconf(nix::unistd::SysconfVar::PAGE_SIZE)
        .ok()
        .flatten()
        .map_or(4096, |v| v as u64);
    PAGE.store(p, std::sync::atomic::Ordering::Relaxed);
    p
}
