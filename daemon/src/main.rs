//! The `azsdp` command.
//!
//! Today: `azsdp config check` and `azsdp config show`, to validate a
//! configuration and see what it decides for a connection. `azsdp run` and
//! `azsdp stat` arrive with the preload shim.

use std::net::IpAddr;
use std::path::PathBuf;
use std::process::ExitCode;

use clap::{Parser, Subcommand, ValueEnum};

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
    Config::from_environment(file.map(PathBuf::as_path), std::env::vars()).map_err(|e| {
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

fn main() -> ExitCode {
    match run(Cli::parse()) {
        Ok(()) => ExitCode::SUCCESS,
        Err(code) => code,
    }
}
