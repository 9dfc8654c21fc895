//! The `azsdp` command.
//!
//! - `azsdp run [--config FILE] -- PROGRAM ARGS...` runs a program with
//!   `libazsdp.so` preloaded;
//! - `azsdp stat [--json]` lists the host's live azsdp connections, from
//!   the per-process stat files (no daemon);
//! - `azsdp config check|show` validates a configuration and shows what it
//!   decides for a connection.

use std::net::IpAddr;
use std::path::PathBuf;
use std::process::ExitCode;

use clap::{Parser, Subcommand, ValueEnum};

mod bench;
mod demo;
mod stat;

use azsdp::config::{Config, Connection, Settings};
use azsdp::conn::Role;

#[derive(Parser, Debug)]
#[command(
    name = "azsdp",
    version,
    about = "Asynchronous zero-copy sockets (AZ-SDP)"
)]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(Subcommand, Debug)]
enum Command {
    /// Run PROGRAM with libazsdp.so preloaded: its TCP connections to and
    /// from other programs under azsdp on this host use AZ-SDP.
    Run {
        /// Configuration file (default: AZSDP_CONFIG, else /etc/azsdp/azsdp.toml,
        /// else built-in defaults).
        #[arg(long)]
        config: Option<PathBuf>,
        /// The program and its arguments.
        #[arg(required = true, trailing_var_arg = true, allow_hyphen_values = true)]
        program: Vec<std::ffi::OsString>,
    },
    /// Run a program pair under azsdp, then on kernel TCP, and show what
    /// moved over which path.
    Demo {
        /// Bytes to send.
        #[arg(long, default_value_t = 1 << 30)]
        bytes: u64,
        /// Bytes per write.
        #[arg(long, default_value_t = 1 << 20)]
        buflen: usize,
        /// Rewrite the buffer before each write (AZ-SDP's worst case: the
        /// write faults on pages still in flight).
        #[arg(long)]
        touch: bool,
    },
    /// One side of the demo pair (an ordinary blocking-socket program).
    #[command(hide = true)]
    DemoPeer {
        #[arg(long)]
        listen: Option<u16>,
        #[arg(long)]
        connect: Option<u16>,
        #[arg(long)]
        bytes: u64,
        #[arg(long)]
        buflen: usize,
        #[arg(long)]
        touch: bool,
    },
    /// Run azsdp-ttcp pairs under every mode (kernel TCP, BSDP, ZSDP,
    /// AZ-SDP block- and copy-on-write); write results.csv and summary.md.
    Bench {
        /// The short sweep (a few minutes).
        #[arg(long)]
        quick: bool,
        /// Output directory.
        #[arg(long, default_value = "azsdp-bench")]
        out: PathBuf,
        /// The configuration the `azsdp` series runs with (one `azsdp tune`
        /// wrote); without it, the built-in defaults.
        #[arg(long)]
        config: Option<PathBuf>,
    },
    /// Measure where zero-copy beats copying and which write-fault policy
    /// wins on this host; write them as a configuration file.
    Tune {
        /// The configuration file to write.
        #[arg(long, default_value = "azsdp-tuned.toml")]
        out: PathBuf,
    },
    /// List live azsdp connections on this host.
    Stat {
        /// One JSON object per connection, in an array.
        #[arg(long)]
        json: bool,
    },
    /// Inspect the configuration.
    #[command(subcommand)]
    Config(ConfigCommand),
}

#[derive(Subcommand, Debug)]
enum ConfigCommand {
    /// Validate a configuration (FILE, else AZSDP_CONFIG, else /etc/azsdp/azsdp.toml,
    /// plus AZSDP_<KEY> overrides) and print the global settings.
    Check {
        /// Configuration file.
        file: Option<PathBuf>,
    },
    /// Show the settings a connection would get, and which rule decided them.
    Show {
        /// Configuration file (default as for `check`).
        #[arg(long)]
        config: Option<PathBuf>,
        /// Program name or path.
        #[arg(long)]
        program: String,
        #[arg(long, value_enum)]
        role: RoleArg,
        /// Peer address.
        #[arg(long)]
        addr: IpAddr,
        /// Listening port.
        #[arg(long)]
        port: u16,
    },
}

#[derive(Clone, Copy, Debug, ValueEnum)]
enum RoleArg {
    Server,
    Client,
}

fn load(file: Option<&PathBuf>) -> Result<Config, ExitCode> {
    Config::from_environment(file.map(PathBuf::as_path), std::env::vars_os()).map_err(|e| {
        eprintln!("azsdp: {e}");
        ExitCode::from(2)
    })
}

fn print_settings(s: &Settings) {
    println!("use              = {:?}", s.use_);
    println!("zcopy_threshold  = {}", s.zcopy_threshold);
    println!("async            = {}", s.async_);
    println!("write_fault      = {:?}", s.write_fault);
    println!("block_escalate   = {:?}", s.block_escalate);
    println!("recv_protect     = {:?}", s.recv_protect);
    println!("recv_protect_min = {}", s.recv_protect_min);
    println!("max_outstanding  = {}", s.max_outstanding);
    println!("max_avail        = {}", s.max_avail);
    println!(
        "fallback         = {} faults / {} sends, recover after {}",
        s.fallback_faults, s.fallback_window, s.fallback_recover
    );
    println!(
        "bsdp             = buffer {}, slot {}, credits {}",
        s.bsdp_buffer, s.bsdp_slot, s.bsdp_credits
    );
    println!("poll             = {:?}", s.poll);
    println!(
        "timeouts         = peer {:?}, keepalive {:?}, linger {:?}",
        s.peer_timeout, s.keepalive, s.linger
    );
}

fn run(cli: Cli) -> Result<(), ExitCode> {
    match cli.command {
        Command::Run { config, program } => return Err(run_program(config, program)),
        Command::Stat { json } => stat::print(json),
        Command::Bench { quick, out, config } => return Err(bench::run(quick, out, config)),
        Command::Tune { out } => return Err(bench::tune(out)),
        Command::Demo {
            bytes,
            buflen,
            touch,
        } => return Err(demo::demo(bytes, buflen.max(1), touch)),
        Command::DemoPeer {
            listen,
            connect,
            bytes,
            buflen,
            touch,
        } => return Err(demo::peer(listen, connect, bytes, buflen.max(1), touch)),
        Command::Config(ConfigCommand::Check { file }) => {
            let c = load(file.as_ref())?;
            match &c.source {
                Some(p) => println!("{}: ok, {} rule(s)", p.display(), c.rules.len()),
                None => println!("no configuration file: built-in defaults"),
            }
            print_settings(&c.global);
        }
        Command::Config(ConfigCommand::Show {
            config,
            program,
            role,
            addr,
            port,
        }) => {
            let c = load(config.as_ref())?;
            let role = match role {
                RoleArg::Server => Role::Server,
                RoleArg::Client => Role::Client,
            };
            let d = c.decide(&Connection {
                program: &program,
                role,
                addr,
                port,
            });
            match d.rule {
                Some(i) => println!("rule {i} matches"),
                None => println!("no rule matches: global settings"),
            }
            print_settings(&d.settings);
        }
    }
    Ok(())
}

/// Where libazsdp.so is: AZSDP_SHIM, else next to this executable (a cargo
/// target directory), else ../lib/azsdp/ from it (an installation).
pub(crate) fn find_shim() -> Option<PathBuf> {
    if let Some(p) = std::env::var_os("AZSDP_SHIM") {
        return Some(PathBuf::from(p));
    }
    let exe = std::env::current_exe().ok()?;
    let dir = exe.parent()?;
    let found = || {
        [
            dir.join("libazsdp.so"),
            dir.join("../lib/azsdp/libazsdp.so"),
        ]
        .into_iter()
        .find(|p| p.exists())
    };
    found().or_else(|| {
        build_sibling_for_cargo_run(dir, &["-p", "azsdp-shim"]);
        found()
    })
}

/// Under `cargo run`, a sibling artifact (libazsdp.so, azsdp-ttcp) may not
/// be built yet (cargo builds only the package it runs): build it with
/// `cargo build TARGET_ARGS`, in our profile, into our directory `dir`.
pub(crate) fn build_sibling_for_cargo_run(dir: &std::path::Path, target_args: &[&str]) {
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

/// `azsdp run`: exec the program with the shim preloaded (returns only on
/// failure).
fn run_program(config: Option<PathBuf>, program: Vec<std::ffi::OsString>) -> ExitCode {
    use std::os::unix::process::CommandExt;
    let Some(shim) = find_shim() else {
        eprintln!(
            "azsdp: cannot find libazsdp.so (build it with `cargo build --release`, or set AZSDP_SHIM)"
        );
        return ExitCode::from(2);
    };
    let shim = shim.canonicalize().unwrap_or(shim);
    let mut cmd = std::process::Command::new(&program[0]);
    cmd.args(&program[1..]);
    if let Some(c) = &config {
        // A bad file is reported here and by the shim, which then keeps
        // the program on plain TCP: the program runs either way.
        if let Err(e) = Config::load(c) {
            eprintln!("azsdp: {e}; the program runs on plain TCP");
        }
        cmd.env("AZSDP_CONFIG", c.canonicalize().unwrap_or(c.clone()));
    }
    let mut preload = shim.into_os_string();
    if let Some(old) = std::env::var_os("LD_PRELOAD").filter(|o| !o.is_empty()) {
        preload.push(":");
        preload.push(old);
    }
    cmd.env("LD_PRELOAD", preload);
    let e = cmd.exec();
    eprintln!("azsdp: cannot run {}: {e}", program[0].to_string_lossy());
    ExitCode::from(127)
}

fn main() -> ExitCode {
    // A closed stdout ends us quietly, as it ends `ls` in `ls | head`
    // (Rust ignores SIGPIPE, and printing to the closed pipe would panic).
    // SAFETY: installing the default disposition; no handler runs.
    unsafe { libc::signal(libc::SIGPIPE, libc::SIG_DFL) };
    azsdp::notes::set_sink(|m| eprintln!("azsdp: {m}"));
    match run(Cli::parse()) {
        Ok(()) => ExitCode::SUCCESS,
        Err(code) => code,
    }
}
