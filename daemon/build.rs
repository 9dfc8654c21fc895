//! Embeds `libazsdp.so` in release builds of the `azsdp` command, so that
//! an `azsdp` installed alone (`cargo install --path daemon`) can still
//! preload it: `azsdp run` writes it out to the user's cache on first use.
//!
//! The shim is a `cdylib` of another package, which cargo cannot hand to
//! this one, so it is built here by a nested `cargo build` (as runtimes
//! that embed a WebAssembly build do), into a target directory of its own
//! beside ours, so the two builds never wait on each other's lock.
//!
//! Debug builds (tests, clippy) embed nothing: they find the shim beside
//! the executable. `AZSDP_EMBED_SHIM=0|1` overrides.

use std::path::{Path, PathBuf};
use std::process::Command;

fn main() {
    println!("cargo::rerun-if-env-changed=AZSDP_EMBED_SHIM");
    write_commit();
    println!("cargo::rerun-if-changed=build.rs");
    let out = PathBuf::from(std::env::var_os("OUT_DIR").expect("OUT_DIR"));
    let dest = out.join("libazsdp.so");
    let release = std::env::var("PROFILE").is_ok_and(|p| p == "release");
    let embed = match std::env::var("AZSDP_EMBED_SHIM").as_deref() {
        Ok("0") => false,
        Ok("1") => true,
        _ => release,
    };
    let manifest = PathBuf::from(std::env::var_os("CARGO_MANIFEST_DIR").expect("manifest dir"));
    let workspace = manifest.join("..");
    let bytes = if embed && workspace.join("shim/Cargo.toml").exists() {
        for watched in [
            "shim",
            "azsdp/src",
            "azsdp/proto",
            "azsdp/Cargo.toml",
            "Cargo.toml",
            "Cargo.lock",
        ] {
            println!(
                "cargo::rerun-if-changed={}",
                workspace.join(watched).display()
            );
        }
        build_shim(&workspace, &out, release)
    } else {
        Vec::new()
    };
    std::fs::write(&dest, &bytes).expect("write the embedded shim");
    // Named by content, so each build's shim gets a file of its own. (A
    // file, not `rustc-env`: cargo would also put that variable in the
    // environment of every program `cargo run` starts.)
    std::fs::write(out.join("libazsdp.hash"), format!("{:016x}", fnv1a(&bytes)))
        .expect("write the embedded shim's hash");
}

/// The commit this is built from (for the figures' footers), with
/// `-dirty` if the tree has changes; "unknown" outside a git checkout.
fn write_commit() {
    let out = PathBuf::from(std::env::var_os("OUT_DIR").expect("OUT_DIR"));
    let manifest = PathBuf::from(std::env::var_os("CARGO_MANIFEST_DIR").expect("manifest dir"));
    let git = |args: &[&str]| {
        Command::new("git")
            .current_dir(&manifest)
            .args(args)
            .output()
            .ok()
            .filter(|o| o.status.success())
            .map(|o| String::from_utf8_lossy(&o.stdout).trim().to_string())
    };
    let commit = match git(&["rev-parse", "--short=12", "HEAD"]) {
        Some(c) => {
            let dirty = git(&["status", "--porcelain", "--untracked-files=no"])
                .is_some_and(|s| !s.is_empty());
            if let Some(dir) = git(&["rev-parse", "--absolute-git-dir"]) {
                println!("cargo::rerun-if-changed={dir}/HEAD");
                println!("cargo::rerun-if-changed={dir}/index");
            }
            format!("{c}{}", if dirty { "-dirty" } else { "" })
        }
        None => "unknown".into(),
    };
    std::fs::write(out.join("commit"), commit).expect("write the commit");
}

/// `cargo build -p azsdp-shim` in our profile and for our target; the
/// library's bytes.
fn build_shim(workspace: &Path, out: &Path, release: bool) -> Vec<u8> {
    // OUT_DIR is <target>/[<triple>/]<profile>/build/<pkg>-<hash>/out.
    let target_dir = out
        .ancestors()
        .find(|a| a.file_name().is_some_and(|n| n == "build"))
        .and_then(Path::parent)
        .and_then(Path::parent)
        .map_or_else(|| out.join("shim-target"), |t| t.join("embedded-shim"));
    let target = std::env::var("TARGET").expect("TARGET");
    let host = std::env::var("HOST").expect("HOST");
    let cargo = std::env::var_os("CARGO").unwrap_or_else(|| "cargo".into());
    let mut cmd = Command::new(cargo);
    cmd.current_dir(workspace)
        .args(["build", "-p", "azsdp-shim", "--lib", "--target-dir"])
        .arg(&target_dir)
        // Not ours to pass on: a wrapper meant for this package (clippy's)
        // and the directory of the outer build.
        .env_remove("RUSTC_WORKSPACE_WRAPPER")
        .env_remove("CARGO_TARGET_DIR")
        .env_remove("CARGO_BUILD_TARGET_DIR")
        // Our stdout speaks to cargo: the nested build's goes to stderr.
        .stdout(std::process::Stdio::from(std::io::stderr()));
    if release {
        cmd.arg("--release");
    }
    // `azsdp` built with `verbs` embeds a shim that pairs between hosts.
    if std::env::var_os("CARGO_FEATURE_VERBS").is_some() {
        cmd.args(["--features", "verbs"]);
    }
    let mut built = target_dir.clone();
    if target != host {
        cmd.args(["--target", &target]);
        built.push(&target);
    }
    built.push(if release { "release" } else { "debug" });
    built.push("libazsdp.so");
    let status = cmd
        .status()
        .unwrap_or_else(|e| panic!("cannot run cargo to build the shim: {e}"));
    assert!(
        status.success(),
        "building the shim to embed failed ({status}); AZSDP_EMBED_SHIM=0 builds without it"
    );
    std::fs::read(&built).unwrap_or_else(|e| panic!("{}: {e}", built.display()))
}

fn fnv1a(b: &[u8]) -> u64 {
    b.iter().fold(0xcbf2_9ce4_8422_2325, |h, &x| {
        (h ^ u64::from(x)).wrapping_mul(0x0100_0000_01b3)
    })
}
