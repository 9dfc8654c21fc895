//! What a connection costs: `azsdp bench`'s "connections" section.
//!
//! `azsdp-echo` (an epoll echo server and blocking clients, plain socket
//! code) runs on kernel TCP and under azsdp as configured: a client holds N
//! connections at once, each checked end to end (connect time, close time,
//! and the memory, threads and descriptors each costs the client), then
//! makes M connections one after another (the time per connection,
//! connect, a 1 KiB exchange and close). Then the N at once again, end to
//! end, against each server shape real servers take: one epoll loop, a
//! thread per connection, and pre-forked epoll workers.

use std::io::{BufRead, BufReader};
use std::path::{Path, PathBuf};
use std::process::{Child, Command};
use std::time::Duration;

/// The figures of one mode.
#[derive(Clone, Copy, Debug, Default)]
pub struct Scale {
    pub connect_us: f64,
    pub connect_p99_us: f64,
    pub close_us: f64,
    pub rss_kb_per_conn: f64,
    pub threads_per_conn: f64,
    pub fds_per_conn: f64,
    /// One connection of the one-after-another run, end to end.
    pub cycle_us: f64,
    /// The N at once, end to end (connect all, an echo on each, close
    /// all), by server shape ([`SHAPES`]).
    pub at_once_ms: [f64; 3],
}

/// The server shapes: `azsdp-echo` mode and its arguments after the port,
/// what to call it, and its test name in `results.csv`.
pub const SHAPES: [(&str, &[&str], &str, &str); 3] = [
    ("serve", &[], "epoll server", "at-once-epoll"),
    (
        "serve-threads",
        &[],
        "thread-per-connection server",
        "at-once-threads",
    ),
    (
        "serve-prefork",
        &["4"],
        "4 pre-forked epoll workers",
        "at-once-prefork",
    ),
];

/// How to run `azsdp-echo` in one mode.
pub struct Runner<'a> {
    pub echo: &'a Path,
    /// The `azsdp` command and the configuration file, or `None` for TCP.
    pub azsdp: Option<(&'a Path, PathBuf)>,
    pub log: PathBuf,
}

impl Runner<'_> {
    fn command(&self, args: &[&str]) -> Command {
        let mut c = super::preloaded(self.azsdp.as_ref(), self.echo, &self.log);
        // (Thousands of connections: a debug line each would be the cost.)
        c.args(args).env("AZSDP_LOG_LEVEL", "warn");
        c
    }

    fn report(&self, args: &[&str]) -> Result<serde_json::Value, String> {
        let mut c = self
            .command(args)
            .spawn()
            .map_err(|e| format!("azsdp-echo {args:?}: {e}"))?;
        let out = super::wait_child(&mut c, Duration::from_secs(600))
            .map_err(|e| format!("azsdp-echo {args:?}: {e}"))?;
        serde_json::from_str(out.trim()).map_err(|e| format!("azsdp-echo {args:?}: {e}: {out}"))
    }
}

struct Server(Child);

impl Drop for Server {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

/// `azsdp-echo MODE PORT ARGS` on a free port, once it says it is ready.
fn start_server(r: &Runner<'_>, mode: &str, args: &[&str]) -> Result<(Server, String), String> {
    let port = std::net::TcpListener::bind(("127.0.0.1", 0))
        .and_then(|l| l.local_addr())
        .map(|a| a.port().to_string())
        .map_err(|e| format!("no free port: {e}"))?;
    let mut child = r
        .command(&[&[mode, port.as_str()], args].concat())
        .spawn()
        .map_err(|e| format!("azsdp-echo {mode}: {e}"))?;
    let stdout = child.stdout.take();
    let server = Server(child);
    let mut line = String::new();
    if let Some(o) = stdout {
        let _ = BufReader::new(o).read_line(&mut line);
    }
    if !line.starts_with("ready") {
        return Err(format!("the echo server ({mode}) did not start"));
    }
    Ok((server, port))
}

fn quantile(v: &serde_json::Value, key: &str, i: usize) -> f64 {
    v[key][i].as_f64().unwrap_or(0.0)
}

/// Measure one mode: `at_once` connections held together, `in_turn` one
/// after another.
pub fn measure(r: &Runner<'_>, at_once: usize, in_turn: usize) -> Result<Scale, String> {
    let (server, port) = start_server(r, SHAPES[0].0, SHAPES[0].1)?;
    r.report(&["send", &port, "1000"])?;
    let many = r.report(&["many", &port, &at_once.to_string(), "4096"])?;
    let cycle = r.report(&["cycle", &port, &in_turn.to_string(), "1024"])?;
    drop(server);
    let n = |v: &serde_json::Value, k: &str| v[k].as_f64().unwrap_or(0.0);
    let mut at_once_ms = [n(&many, "total_ms"), 0.0, 0.0];
    for (i, (mode, args, _, _)) in SHAPES.iter().enumerate().skip(1) {
        let (server, port) = start_server(r, mode, args)?;
        r.report(&["send", &port, "1000"])?;
        at_once_ms[i] = n(
            &r.report(&["many", &port, &at_once.to_string(), "4096"])?,
            "total_ms",
        );
        drop(server);
    }
    Ok(Scale {
        at_once_ms,
        connect_us: quantile(&many, "connect_us", 0),
        connect_p99_us: quantile(&many, "connect_us", 1),
        close_us: quantile(&many, "close_us", 0),
        rss_kb_per_conn: n(&many, "rss_kb_per_conn"),
        threads_per_conn: n(&many, "threads_per_conn"),
        fds_per_conn: n(&many, "fds_per_conn"),
        cycle_us: n(&cycle, "total_ms") * 1e3 / in_turn.max(1) as f64,
    })
}

/// The summary's section: both modes side by side.
pub fn table(tcp: Option<Scale>, azsdp: Option<Scale>, at_once: usize, in_turn: usize) -> String {
    use std::fmt::Write as _;
    let mut s = String::new();
    let _ = writeln!(
        s,
        "\n## Connections\n\n{at_once} connections held at once, each checked end to end \
         (connect, close: medians; the rest per connection, in the client), then \
         {in_turn} one after another (connect, a 1 KiB echo, close).\n"
    );
    let _ = writeln!(s, "| | kernel TCP | azsdp | ratio |");
    let _ = writeln!(s, "|---|---|---|---|");
    let (t, a) = (tcp.unwrap_or_default(), azsdp.unwrap_or_default());
    let mut rows: Vec<(String, f64, f64, &str)> = [
        ("connect (median)", t.connect_us, a.connect_us, "us"),
        ("connect (p99)", t.connect_p99_us, a.connect_p99_us, "us"),
        ("close (median)", t.close_us, a.close_us, "us"),
        (
            "RSS per connection",
            t.rss_kb_per_conn,
            a.rss_kb_per_conn,
            "KiB",
        ),
        (
            "threads per connection",
            t.threads_per_conn,
            a.threads_per_conn,
            "",
        ),
        (
            "descriptors per connection",
            t.fds_per_conn,
            a.fds_per_conn,
            "",
        ),
        ("one connection, in turn", t.cycle_us, a.cycle_us, "us"),
    ]
    .into_iter()
    .map(|(w, tv, av, u)| (w.to_string(), tv, av, u))
    .collect();
    for (i, (_, _, name, _)) in SHAPES.iter().enumerate() {
        rows.push((
            format!("{at_once} at once, end to end: {name}"),
            t.at_once_ms[i],
            a.at_once_ms[i],
            "ms",
        ));
    }
    for (what, tv, av, unit) in rows {
        let cell = |v: f64, have: bool| {
            if have {
                format!("{v:.1} {unit}").trim().to_string()
            } else {
                "-".into()
            }
        };
        let ratio = if tcp.is_some() && azsdp.is_some() && tv > 0.0 {
            format!("{:.2}x", av / tv)
        } else {
            "-".into()
        };
        let _ = writeln!(
            s,
            "| {what} | {} | {} | {ratio} |",
            cell(tv, tcp.is_some()),
            cell(av, azsdp.is_some())
        );
    }
    s
}
