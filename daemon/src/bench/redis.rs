//! A real event loop: `azsdp bench`'s "redis" section, when redis is
//! installed.
//!
//! redis-server runs one thread in `epoll_wait` over non-blocking sockets,
//! as memcached, nginx and node do: the shape of program that azsdp must
//! serve at least as fast as TCP. redis-benchmark (GET) drives it in four
//! shapes (one client or fifty, pipelined 16 deep or not), on kernel TCP
//! and under azsdp as configured, in turn, several rounds each, in one
//! run; the median of each is reported with the ratio.

use std::path::{Path, PathBuf};
use std::process::{Child, Stdio};
use std::time::{Duration, Instant};

/// (clients, pipeline depth) of each shape.
pub const SHAPES: [(u64, u64); 4] = [(1, 1), (1, 16), (50, 1), (50, 16)];

/// The median requests per second of each shape: (tcp, azsdp).
pub type Rates = Vec<((u64, u64), Option<f64>, Option<f64>)>;

/// How to run redis in one mode.
pub struct Runner<'a> {
    pub server: &'a Path,
    pub benchmark: &'a Path,
    /// The `azsdp` command and the configuration file, or `None` for TCP.
    pub azsdp: Option<(&'a Path, PathBuf)>,
    pub log: PathBuf,
}

/// redis-server and redis-benchmark, if both are installed.
pub fn programs() -> Option<(PathBuf, PathBuf)> {
    Some((
        crate::locate::on_path("redis-server")?,
        crate::locate::on_path("redis-benchmark")?,
    ))
}

impl Runner<'_> {
    /// GET requests per second of one redis-benchmark run against a fresh
    /// server.
    pub fn rate(&self, (clients, pipeline): (u64, u64), requests: u64) -> Result<f64, String> {
        let (mut server, port) = self.server()?;
        let _stop = Stop(&mut server);
        let mut b = super::preloaded(self.azsdp.as_ref(), self.benchmark, &self.log)
            .args(["-h", "127.0.0.1", "-p", &port, "-t", "get", "--csv"])
            .args(["-n", &requests.to_string(), "-c", &clients.to_string()])
            .args(["-P", &pipeline.to_string()])
            .spawn()
            .map_err(|e| format!("start redis-benchmark: {e}"))?;
        let out = super::wait_child(&mut b, Duration::from_secs(120))?;
        parse_csv(&out).ok_or_else(|| format!("no GET rate in redis-benchmark's output: {out:?}"))
    }

    /// A redis-server listening, and its port. The port is one the kernel
    /// just picked as free; another program may take it before the server
    /// binds it (the bench's own clients use the same range), so a server
    /// that exits at once is started again on another.
    fn server(&self) -> Result<(Child, String), String> {
        for _ in 0..5 {
            let port = std::net::TcpListener::bind(("127.0.0.1", 0))
                .and_then(|l| l.local_addr())
                .map(|a| a.port())
                .map_err(|e| format!("no free port: {e}"))?;
            let mut server = super::preloaded(self.azsdp.as_ref(), self.server, &self.log)
                .args([
                    "--port",
                    &port.to_string(),
                    "--bind",
                    "127.0.0.1",
                    "--save",
                    "",
                ])
                .args(["--appendonly", "no", "--daemonize", "no"])
                .stdout(Stdio::null())
                .spawn()
                .map_err(|e| format!("start redis-server: {e}"))?;
            let deadline = Instant::now() + Duration::from_secs(20);
            while Instant::now() < deadline {
                if super::wait_listening(port, Duration::from_millis(100)) {
                    return Ok((server, port.to_string()));
                }
                if server.try_wait().ok().flatten().is_some() {
                    break;
                }
            }
            let _ = server.kill();
            let _ = server.wait();
        }
        Err("redis-server did not listen (5 tries)".into())
    }
}

/// Kills the server when the measurement ends, however it ends.
struct Stop<'a>(&'a mut Child);

impl Drop for Stop<'_> {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

/// The GET rate in `redis-benchmark --csv` output (`"GET","12345.67",...`).
fn parse_csv(out: &str) -> Option<f64> {
    out.lines()
        .find_map(|l| l.strip_prefix("\"GET\","))
        .and_then(|rest| rest.split(',').next())
        .and_then(|v| v.trim_matches('"').parse().ok())
        .filter(|v: &f64| v.is_finite() && *v > 0.0)
}

/// Requests of one run of `shape`: about a second or two on this kind of
/// host, more for a full run.
pub fn requests((clients, pipeline): (u64, u64), quick: bool) -> u64 {
    let base = if quick { 20_000 } else { 100_000 };
    base * if pipeline > 1 { 8 } else { 1 } * if clients > 1 { 2 } else { 1 }
}

/// The median of `v` (sorted in place); `None` if empty.
pub fn median(v: &mut [f64]) -> Option<f64> {
    v.sort_by(f64::total_cmp);
    v.get(v.len() / 2).copied()
}

/// The section of the summary.
pub fn table(rates: &Rates, started: Instant) -> String {
    use std::fmt::Write as _;
    let mut s = String::new();
    let _ = writeln!(
        s,
        "\n## redis (an epoll event loop)\n\nredis-server and redis-benchmark `-t get`, both \
         under azsdp as configured, against kernel TCP, in turn in one run (medians, \
         requests/s; {:.0} s).\n",
        started.elapsed().as_secs_f64()
    );
    let _ = writeln!(
        s,
        "| clients | pipeline | kernel TCP | azsdp | azsdp / TCP |"
    );
    let _ = writeln!(s, "|---|---|---|---|---|");
    let f = |v: Option<f64>| v.map_or("failed".to_string(), |v| format!("{v:.0}"));
    for &((c, p), t, a) in rates {
        let ratio = match (t, a) {
            (Some(t), Some(a)) => format!("{:.2}", a / t),
            _ => "-".into(),
        };
        let _ = writeln!(s, "| {c} | {p} | {} | {} | {ratio} |", f(t), f(a));
    }
    s
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_get_rate_is_read_from_csv_and_nothing_else_passes() {
        let out = "\"test\",\"rps\",\"avg_latency_ms\"\n\"GET\",\"12345.68\",\"0.071\"\n";
        assert_eq!(parse_csv(out), Some(12345.68));
        assert_eq!(parse_csv("\"SET\",\"1.0\"\n"), None);
        assert_eq!(parse_csv("\"GET\",\"nan\"\n"), None);
        assert_eq!(parse_csv("\"GET\",\"0\"\n"), None);
        assert_eq!(parse_csv(""), None);
    }

    #[test]
    fn the_median_is_the_middle_run() {
        assert_eq!(median(&mut [3.0, 1.0, 2.0]), Some(2.0));
        assert_eq!(median(&mut []), None);
    }
}
