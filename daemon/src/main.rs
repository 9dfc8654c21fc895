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
mod environment;
mod locate;
mod stat;

use azsdp::config::{Config, RuleInput};
use azsdp::conn::Role;

#[derive(Parser, Debug)]
#[command(
    name = "azsdp",
    version,
    about = "Asynchronous zero-copy sockets (AZ-SDP)",
    long_about = "Asynchronous zero-copy sockets (AZ-SDP) for unmodified programs: \
        `azsdp run -- PROGRAM` preloads libazsdp.so, and the program's TCP connections \
        to other programs under azsdp on this host move their data without copies.",
    after_long_help = AFTER_HELP
)]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

/// A write size for `demo`: a size that fits in memory.
fn parse_buflen(s: &str) -> Result<usize, String> {
    let n = azsdp::config::parse_size(s)?;
    usize::try_from(n)
        .ok()
        .filter(|n| (1..=1 << 30).contains(n))
        .ok_or_else(|| format!("`{s}`: from 1 byte to 1GiB"))
}

/// The environment and files, for `--help` and the manual page.
const AFTER_HELP: &str = "\
Environment:
  AZSDP_CONFIG     the configuration file (else /etc/azsdp/azsdp.toml)
  AZSDP_<KEY>      overrides the global key <key> (e.g. AZSDP_WRITE_FAULT=block)
  AZSDP_LOG        the shim's log: stderr (default), off, or a file
  AZSDP_LOG_LEVEL  error, warn (default), info, debug
  AZSDP_STAT_DIR   where the stat files live (default /dev/shm/azsdp-<euid>)
  AZSDP_SHIM       the libazsdp.so to preload
  AZSDP_DISABLE    set: the shim leaves every socket alone

Files:
  /etc/azsdp/azsdp.toml     the configuration (example: azsdp.example.toml)
  /usr/lib/azsdp/libazsdp.so, or beside azsdp, or ../lib/azsdp/ from it: the shim
  ~/.cache/azsdp/           the shim a release build embeds, written out on first use";

#[derive(Subcommand, Debug)]
enum Command {
    /// Run PROGRAM with libazsdp.so preloaded: its TCP connections to and
    /// from other programs under azsdp on this host use AZ-SDP.
    Run {
        /// Configuration file (default: AZSDP_CONFIG, else /etc/azsdp/azsdp.toml,
        /// else built-in defaults).
        #[arg(long)]
        config: Option<PathBuf>,
        /// Start the program even if the configuration or the AZSDP_*
        /// environment has problems (it then runs on plain TCP).
        #[arg(long)]
        run_anyway: bool,
        /// The program and its arguments.
        #[arg(required = true, trailing_var_arg = true, allow_hyphen_values = true)]
        program: Vec<std::ffi::OsString>,
    },
    /// Run a program pair under azsdp, then on kernel TCP, and show what
    /// moved over which path.
    Demo {
        /// Bytes to send (a size: 1000000, 64KiB, 1G).
        #[arg(long, default_value = "1GiB", value_parser = azsdp::config::parse_size)]
        bytes: u64,
        /// Bytes per write (a size).
        #[arg(long, default_value = "1MiB", value_parser = parse_buflen)]
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
        /// The short sweep (about a minute and a half on a 2-core host; the
        /// full sweep takes about six).
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
    Stat(stat::Options),
    /// Inspect the configuration.
    #[command(subcommand)]
    Config(ConfigCommand),
    /// Print a shell's completion script (e.g. `azsdp completions bash >
    /// /etc/bash_completion.d/azsdp`).
    Completions {
        #[arg(value_enum)]
        shell: clap_complete::Shell,
    },
    /// Write the manual pages (azsdp.1, azsdp-run.1, ...).
    Man {
        /// Directory to write to (default: ../share/man/man1 from this
        /// executable, where `man` looks for the programs on PATH).
        #[arg(long)]
        out: Option<PathBuf>,
    },
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
        report_problems(&e);
        ExitCode::from(2)
    })
}

/// Each problem on a line of its own, then how many.
fn report_problems(e: &azsdp::config::ConfigError) {
    for p in &e.problems {
        eprintln!("azsdp: {p}");
    }
    let n = e.problems.len();
    eprintln!(
        "azsdp: {n} problem{} in the configuration",
        if n == 1 { "" } else { "s" }
    );
}

fn run(cli: Cli) -> Result<(), ExitCode> {
    match cli.command {
        Command::Run {
            config,
            run_anyway,
            program,
        } => return Err(run_program(config, run_anyway, program)),
        Command::Stat(o) => stat::print(&o),
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
        Command::Completions { shell } => {
            let mut cmd = <Cli as clap::CommandFactory>::command();
            clap_complete::generate(shell, &mut cmd, "azsdp", &mut std::io::stdout());
        }
        Command::Man { out } => return Err(write_man_pages(out)),
        Command::Config(ConfigCommand::Check { file }) => {
            let c = load(file.as_ref())?;
            match &c.source {
                Some(p) => println!("# {}: ok, {} rule(s)", p.display(), c.rules.len()),
                None => println!("# no configuration file: the built-in defaults"),
            }
            println!("# the global settings, with any AZSDP_<KEY> overrides:");
            print!("{}", c.global.to_toml());
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
            let d = c.decide(&RuleInput {
                program: &program,
                role,
                addr,
                port,
            });
            match d.rule {
                Some(i) => println!("# rule {i} matches: the globals, overlaid by its keys"),
                None => println!("# no rule matches: the global settings"),
            }
            print!("{}", d.settings.to_toml());
        }
    }
    Ok(())
}

/// `azsdp man`: a page for the command and one for each visible
/// subcommand (`azsdp-run.1`, ...), as git and cargo have them.
fn write_man_pages(out: Option<PathBuf>) -> ExitCode {
    let dir = match out {
        Some(d) => d,
        None => match std::env::current_exe() {
            Ok(exe) => exe
                .parent()
                .unwrap_or(std::path::Path::new("/"))
                .join("../share/man/man1"),
            Err(e) => {
                eprintln!("azsdp man: {e}");
                return ExitCode::FAILURE;
            }
        },
    };
    let cmd = <Cli as clap::CommandFactory>::command();
    let write = || -> std::io::Result<usize> {
        std::fs::create_dir_all(&dir)?;
        let mut n = 0;
        let mut page = |name: String, c: clap::Command| -> std::io::Result<()> {
            let mut f = std::fs::File::create(dir.join(format!("{name}.1")))?;
            clap_mangen::Man::new(c.name(name.clone())).render(&mut f)?;
            n += 1;
            Ok(())
        };
        for sub in cmd.get_subcommands().filter(|c| !c.is_hide_set()) {
            page(format!("azsdp-{}", sub.get_name()), sub.clone())?;
        }
        page("azsdp".into(), cmd.clone())?;
        Ok(n)
    };
    match write() {
        Ok(n) => {
            let dir = dir.canonicalize().unwrap_or(dir);
            println!("{n} pages in {}", dir.display());
            ExitCode::SUCCESS
        }
        Err(e) => {
            eprintln!("azsdp man: {}: {e}", dir.display());
            ExitCode::FAILURE
        }
    }
}

/// `azsdp run`: exec the program with the shim preloaded (returns only on
/// failure).
fn run_program(
    config: Option<PathBuf>,
    run_anyway: bool,
    program: Vec<std::ffi::OsString>,
) -> ExitCode {
    use std::os::unix::process::CommandExt;
    let shim = match locate::shim() {
        Ok(s) => s,
        Err(e) => {
            eprintln!("azsdp: {e}");
            return ExitCode::from(2);
        }
    };
    let shim = shim.canonicalize().unwrap_or(shim);
    let mut cmd = std::process::Command::new(&program[0]);
    cmd.args(&program[1..]);
    // What the shim will read, checked before the program starts: a
    // mistake stops here, not as a program that silently stays on TCP.
    let problems = environment::check(config.as_deref());
    if !problems.is_empty() {
        for p in &problems {
            eprintln!("azsdp: {p}");
        }
        if !run_anyway {
            eprintln!(
                "azsdp: {} problem(s): not starting {} (--run-anyway starts it on plain TCP)",
                problems.len(),
                program[0].to_string_lossy()
            );
            return ExitCode::from(2);
        }
    }
    if let Some(c) = &config {
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
