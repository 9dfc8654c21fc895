//! Where the pieces `azsdp` runs are: `libazsdp.so` and the benchmark
//! programs, wherever `azsdp` was built or installed.
//!
//! The shim is looked for in this order:
//! 1. `AZSDP_SHIM`;
//! 2. beside the executable (a cargo target directory);
//! 3. `../lib/azsdp/` from it (a package: `/usr/bin/azsdp`,
//!    `/usr/lib/azsdp/libazsdp.so`);
//! 4. the copy embedded in a release build, written out once to the user's
//!    cache (`$XDG_CACHE_HOME/azsdp`, else `~/.cache/azsdp`), in a
//!    directory only the user can write, under a name that says its
//!    content, so a newer `azsdp` never runs an older shim;
//! 5. under `cargo run` of a debug build, built on the spot.

use std::io::Write as _;
use std::os::unix::fs::{
    DirBuilderExt as _, MetadataExt as _, OpenOptionsExt as _, PermissionsExt as _,
};
use std::path::{Path, PathBuf};

/// The shim built with this executable (empty in debug builds).
static EMBEDDED: &[u8] = include_bytes!(concat!(env!("OUT_DIR"), "/libazsdp.so"));

/// `libazsdp.so`, or why there is none.
pub fn shim() -> Result<PathBuf, String> {
    if let Some(p) = std::env::var_os("AZSDP_SHIM") {
        let p = PathBuf::from(p);
        return if p.is_file() {
            Ok(p)
        } else {
            Err(format!("AZSDP_SHIM={}: no such file", p.display()))
        };
    }
    let exe = std::env::current_exe().map_err(|e| format!("cannot find our executable: {e}"))?;
    let dir = exe.parent().unwrap_or(Path::new("/"));
    let beside = || {
        [
            dir.join("libazsdp.so"),
            dir.join("../lib/azsdp/libazsdp.so"),
        ]
        .into_iter()
        .find(|p| p.is_file())
    };
    if let Some(p) = beside() {
        return Ok(p);
    }
    if !EMBEDDED.is_empty() {
        return extract();
    }
    build_sibling_for_cargo_run(dir, &["-p", "azsdp-shim"]);
    beside().ok_or_else(|| {
        format!(
            "cannot find libazsdp.so beside {} or in ../lib/azsdp/, and this build embeds none \
             (install a release build: cargo install --path daemon; or set AZSDP_SHIM)",
            exe.display()
        )
    })
}

/// A benchmark program (`azsdp-ttcp`, `azsdp-echo`): beside the
/// executable (both `cargo install` and the package put it there), else
/// on PATH, else (under `cargo run`) built on the spot.
pub fn program(name: &str) -> Result<PathBuf, String> {
    let exe = std::env::current_exe().map_err(|e| format!("cannot find our executable: {e}"))?;
    let dir = exe.parent().unwrap_or(Path::new("/"));
    let beside = dir.join(name);
    if beside.is_file() {
        return Ok(beside);
    }
    if let Some(p) = on_path(name) {
        return Ok(p);
    }
    build_sibling_for_cargo_run(dir, &["-p", "azsdp-daemon", "--bin", name]);
    if beside.is_file() {
        return Ok(beside);
    }
    Err(format!(
        "{name} not found beside {} or on PATH (it installs with azsdp)",
        exe.display()
    ))
}

/// `name` in a directory of PATH (daemons' sbin directories too, which a
/// user's PATH may leave out).
pub fn on_path(name: &str) -> Option<PathBuf> {
    let path = std::env::var_os("PATH").unwrap_or_default();
    std::env::split_paths(&path)
        .chain(["/usr/sbin".into(), "/sbin".into()])
        .map(|d| d.join(name))
        .find(|c| c.is_file())
}

/// The user's cache directory for azsdp, made (0700) if missing, and
/// checked: ours, a real directory, writable by nobody else.
fn cache_dir() -> Result<PathBuf, String> {
    let dir = std::env::var_os("XDG_CACHE_HOME")
        .filter(|d| Path::new(d).is_absolute())
        .map(PathBuf::from)
        .or_else(|| std::env::var_os("HOME").map(|h| PathBuf::from(h).join(".cache")))
        .map_or_else(
            || std::env::temp_dir().join(format!("azsdp-{}", euid())),
            |cache| cache.join("azsdp"),
        );
    std::fs::DirBuilder::new()
        .recursive(true)
        .mode(0o700)
        .create(&dir)
        .map_err(|e| format!("{}: {e}", dir.display()))?;
    let m = std::fs::symlink_metadata(&dir).map_err(|e| format!("{}: {e}", dir.display()))?;
    if !m.is_dir() || m.uid() != euid() || m.mode() & 0o022 != 0 {
        return Err(format!(
            "{}: not a directory of ours that only we can write; not used",
            dir.display()
        ));
    }
    Ok(dir)
}

fn euid() -> u32 {
    // SAFETY: geteuid(2) cannot fail.
    unsafe { libc::geteuid() }
}

/// Write the embedded shim to the cache (once per content) and name it.
fn extract() -> Result<PathBuf, String> {
    let dir = cache_dir().map_err(|e| format!("cannot write out the embedded shim: {e}"))?;
    let name = format!(
        "libazsdp-{}-{}.so",
        env!("CARGO_PKG_VERSION"),
        include_str!(concat!(env!("OUT_DIR"), "/libazsdp.hash"))
    );
    let path = dir.join(&name);
    if let Ok(m) = std::fs::symlink_metadata(&path)
        && m.is_file()
        && m.uid() == euid()
        && m.len() == EMBEDDED.len() as u64
    {
        return Ok(path);
    }
    // A file of our own, then renamed into place: a concurrent `azsdp run`
    // sees the whole library or none.
    let tmp = dir.join(format!(".{name}.{}", std::process::id()));
    let written = std::fs::OpenOptions::new()
        .write(true)
        .create_new(true)
        .mode(0o755)
        .custom_flags(libc::O_NOFOLLOW)
        .open(&tmp)
        .and_then(|mut f| {
            f.write_all(EMBEDDED)?;
            f.set_permissions(std::fs::Permissions::from_mode(0o755))
        })
        .and_then(|()| std::fs::rename(&tmp, &path));
    if let Err(e) = written {
        let _ = std::fs::remove_file(&tmp);
        return Err(format!("cannot write {}: {e}", path.display()));
    }
    Ok(path)
}

/// Under `cargo run`, a sibling artifact (libazsdp.so, azsdp-ttcp) may not
/// be built yet (cargo builds only the binary it runs): build it with
/// `cargo build TARGET_ARGS`, in our profile, into our directory `dir`.
fn build_sibling_for_cargo_run(dir: &Path, target_args: &[&str]) {
    let (Some(cargo), Some(manifest)) = (
        std::env::var_os("CARGO"),
        std::env::var_os("CARGO_MANIFEST_DIR"),
    ) else {
        return;
    };
    let workspace = PathBuf::from(manifest).join("..");
    if !workspace.join("shim/Cargo.toml").exists() {
        return;
    }
    let release = dir.file_name().is_some_and(|n| n == "release");
    eprintln!("azsdp: building (cargo build {})", target_args.join(" "));
    let _ = std::process::Command::new(cargo)
        .current_dir(&workspace)
        .args(["build", "-q"])
        .args(target_args)
        .args(release.then_some("--release"))
        .status();
}
