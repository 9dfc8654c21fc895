//! `azsdp bench`: `azsdp-ttcp` pairs under each mode, swept over sizes and
//! parameters; `results.csv`, `summary.md` and the figures (see [`plots`])
//! in the output directory.
//!
//! Each mode is a generated configuration file, run with `azsdp run
//! --config`; kernel TCP runs the same program without the shim. The
//! single-copy `memcpy` bandwidth is measured in the same run as the
//! physical limit of a one-copy transfer. A sixth series, `azsdp`, runs
//! what a user gets: the built-in defaults, or a configuration `azsdp tune`
//! wrote, compared at every size with the best of the five modes.

mod conns;
mod plots;
mod progress;
mod redis;
mod report;

use std::borrow::Cow;

use progress::Progress;
use std::fmt::Write as _;
use std::io::Write as _;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, ExitCode, Stdio};
use std::time::{Duration, Instant};

/// A mode: its name and the configuration that selects it (`None`: TCP).
#[derive(Clone, Debug)]
struct Mode {
    name: &'static str,
    config: Option<Cow<'static, str>>,
}

const MODES: [Mode; 5] = [
    Mode {
        name: "tcp",
        config: None,
    },
    Mode {
        name: "bsdp",
        config: Some(Cow::Borrowed("zcopy_threshold = \"1024GiB\"\n")),
    },
    Mode {
        name: "zsdp",
        config: Some(Cow::Borrowed("async = false\nzcopy_threshold = 4096\n")),
    },
    Mode {
        name: "azsdp-bow",
        config: Some(Cow::Borrowed(
            "write_fault = \"block\"\nzcopy_threshold = 4096\n",
        )),
    },
    Mode {
        name: "azsdp-cow",
        config: Some(Cow::Borrowed(
            "write_fault = \"copy\"\nzcopy_threshold = 4096\n",
        )),
    },
];

/// Which figure of a run's transmitter reports is the result.
#[derive(Clone, Copy, Debug)]
enum Pick {
    FirstLatency,
    WorstLatency,
    FirstRate,
    TotalRate,
}

/// One measurement, as a row of results.csv.
#[derive(Clone, Debug)]
struct Row {
    test: &'static str,
    mode: &'static str,
    size: u64,
    parameter: u64,
    value: f64,
    unit: &'static str,
}

/// (test, mode, size) of a median's runs.
type SampleKey = (&'static str, &'static str, u64);

struct Bench {
    ttcp: PathBuf,
    exe: PathBuf,
    out: PathBuf,
    port: u16,
    rows: Vec<Row>,
    /// The runs behind each median, sorted.
    samples: Vec<(SampleKey, Vec<f64>)>,
    csv: std::fs::File,
    failures: usize,
    progress: Progress,
}

/// Wait until something listens on `port` (without connecting to it).
fn wait_listening(port: u16, t: Duration) -> bool {
    let deadline = Instant::now() + t;
    let hex = format!(":{port:04X}");
    while Instant::now() < deadline {
        for f in ["/proc/net/tcp", "/proc/net/tcp6"] {
            let text = std::fs::read_to_string(f).unwrap_or_default();
            if text.lines().any(|l| {
                let c: Vec<&str> = l.split_whitespace().collect();
                c.len() > 3 && c[1].ends_with(&hex) && c[3] == "0A"
            }) {
                return true;
            }
        }
        std::thread::sleep(Duration::from_millis(2));
    }
    false
}

fn wait_child(c: &mut Child, t: Duration) -> Result<String, String> {
    let deadline = Instant::now() + t;
    loop {
        if let Some(st) = c.try_wait().map_err(|e| e.to_string())? {
            let mut out = String::new();
            if let Some(o) = c.stdout.as_mut() {
                let _ = std::io::Read::read_to_string(o, &mut out);
            }
            return if st.success() {
                Ok(out)
            } else {
                Err(format!("exited with {st}"))
            };
        }
        if Instant::now() >= deadline {
            let _ = c.kill();
            let _ = c.wait();
            return Err(format!("took longer than {t:?}"));
        }
        std::thread::sleep(Duration::from_millis(2));
    }
}

/// `program` on kernel TCP (`azsdp` `None`), or under `azsdp run` with the
/// configuration file given; the shim logs to `log`, stdout is piped.
fn preloaded(azsdp: Option<&(&Path, PathBuf)>, program: &Path, log: &Path) -> Command {
    let mut c = match azsdp {
        None => Command::new(program),
        Some((exe, config)) => {
            let mut c = Command::new(exe);
            c.arg("run")
                .arg("--config")
                .arg(config)
                .arg("--")
                .arg(program);
            c
        }
    };
    c.env("AZSDP_LOG", log)
        .env("AZSDP_LOG_LEVEL", "debug")
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::null());
    c
}

impl Bench {
    fn command(&self, mode: &Mode, args: &[String]) -> Command {
        let config = self.out.join(format!("{}.toml", mode.name));
        let azsdp = mode.config.as_ref().map(|_| (self.exe.as_path(), config));
        let mut c = preloaded(azsdp.as_ref(), &self.ttcp, &self.log_of(mode));
        c.args(args);
        c
    }

    /// redis-benchmark against redis-server in each shape, TCP and azsdp
    /// as configured in turn (`rounds` each); nothing if redis is missing.
    fn redis(&mut self, quick: bool) -> Option<redis::Rates> {
        if !self
            .progress
            .step("redis: redis-benchmark GET, tcp and azsdp")
        {
            return None;
        }
        let Some((server, benchmark)) = redis::programs() else {
            self.progress
                .say("redis: skipped (install redis-server and redis-tools)");
            return None;
        };
        let rounds = if quick { 3 } else { 5 };
        let exe = self.exe.clone();
        let runners = ["tcp", "azsdp"].map(|mode| redis::Runner {
            server: &server,
            benchmark: &benchmark,
            azsdp: (mode == "azsdp").then(|| (exe.as_path(), self.out.join("azsdp.toml"))),
            log: self.out.join(format!("redis-{mode}.log")),
        });
        let mut rates = Vec::new();
        for shape in redis::SHAPES {
            let mut got = [Vec::new(), Vec::new()];
            for _ in 0..rounds {
                for (i, r) in runners.iter().enumerate() {
                    match r.rate(shape, redis::requests(shape, quick)) {
                        Ok(v) => got[i].push(v),
                        Err(e) => {
                            self.failures += 1;
                            eprintln!(
                                "azsdp bench: redis {shape:?} under {}: {e} (the shim's log: {})",
                                ["tcp", "azsdp"][i],
                                r.log.display()
                            );
                        }
                    }
                }
            }
            let [t, a] = got.map(|mut v| redis::median(&mut v));
            for (mode, v) in [("tcp", t), ("azsdp", a)] {
                if let Some(value) = v {
                    self.record(Row {
                        test: "redis",
                        mode,
                        size: shape.0,
                        parameter: shape.1,
                        value,
                        unit: "req/s",
                    });
                }
            }
            rates.push((shape, t, a));
        }
        Some(rates)
    }

    /// One ttcp pair: the receiver serving `clients`, `senders` transmitter
    /// processes with `args`. The transmitters' JSON reports.
    fn pair(
        &mut self,
        mode: &Mode,
        clients: usize,
        senders: usize,
        args: &[String],
    ) -> Result<Vec<serde_json::Value>, String> {
        // A port nobody uses now (the kernel's pick), for this pair.
        self.port = std::net::TcpListener::bind(("127.0.0.1", 0))
            .and_then(|l| l.local_addr())
            .map(|a| a.port())
            .map_err(|e| format!("no free port: {e}"))?;
        let port = self.port.to_string();
        let r_args: Vec<String> = [
            "-r",
            "-p",
            &port,
            "--clients",
            &clients.to_string(),
            "--json",
        ]
        .iter()
        .map(|s| s.to_string())
        .collect();
        let mut r = self
            .command(mode, &r_args)
            .spawn()
            .map_err(|e| format!("start ttcp -r: {e}"))?;
        if !wait_listening(self.port, Duration::from_secs(10)) {
            let _ = r.kill();
            return Err("the receiver did not listen".into());
        }
        let mut t_args: Vec<String> = ["-t", "127.0.0.1", "-p", &port, "--json"]
            .iter()
            .map(|s| s.to_string())
            .collect();
        t_args.extend_from_slice(args);
        let mut ts = Vec::new();
        for _ in 0..senders {
            ts.push(
                self.command(mode, &t_args)
                    .spawn()
                    .map_err(|e| format!("start ttcp -t: {e}"))?,
            );
        }
        let mut reports = Vec::new();
        for mut t in ts {
            let out = wait_child(&mut t, Duration::from_secs(120))?;
            for line in out.lines() {
                let v: serde_json::Value =
                    serde_json::from_str(line).map_err(|e| format!("ttcp output: {e}"))?;
                reports.push(v);
            }
        }
        wait_child(&mut r, Duration::from_secs(30))?;
        Ok(reports)
    }

    /// The reports of a run, or `None` (said, and counted) if it failed.
    fn ok(
        &mut self,
        what: &str,
        mode: &Mode,
        r: Result<Vec<serde_json::Value>, String>,
    ) -> Option<Vec<serde_json::Value>> {
        match r {
            Ok(v) => Some(v),
            Err(e) => {
                self.failures += 1;
                eprintln!(
                    "azsdp bench: {what} under {}: {e} (the shim's log: {})",
                    mode.name,
                    self.log_of(mode).display()
                );
                None
            }
        }
    }

    fn record(&mut self, row: Row) {
        let _ = writeln!(
            self.csv,
            "{},{},{},{},{:.6},{}",
            row.test, row.mode, row.size, row.parameter, row.value, row.unit
        );
        self.rows.push(row);
    }

    fn get(&self, test: &str, mode: &str, size: u64, parameter: u64) -> Option<f64> {
        self.rows
            .iter()
            .find(|r| {
                r.test == test && r.mode == mode && r.size == size && r.parameter == parameter
            })
            .map(|r| r.value)
    }
}

fn num(v: &serde_json::Value, key: &str) -> f64 {
    v[key].as_f64().unwrap_or(0.0)
}

/// Iterations for `size` bytes so a run moves about `budget` bytes.
fn count_for(size: u64, budget: u64, min: u64, max: u64) -> u64 {
    (budget / size.max(1)).clamp(min, max)
}

/// Single-copy memcpy bandwidth at `size`, GB/s (best of a few rounds):
/// `hot` copies between one pair of buffers (as a ttcp that reuses its
/// buffer sees them, caches warm); otherwise each copy goes between fresh
/// buffers of a 256 MiB area, beyond the caches.
fn memcpy_gbps(size: usize, hot: bool) -> f64 {
    let area = if hot { size } else { (256 << 20).max(size) };
    let src = vec![1u8; area];
    let mut dst = vec![0u8; area];
    let slots = area / size.max(1);
    let mut best = f64::MAX;
    for _ in 0..5 {
        let reps = ((256 << 20) / size.max(1)).max(1);
        let t0 = Instant::now();
        for i in 0..reps {
            let at = (i % slots) * size;
            dst[at..at + size].copy_from_slice(&src[at..at + size]);
            std::hint::black_box(&mut dst);
        }
        best = best.min(t0.elapsed().as_secs_f64() / reps as f64);
    }
    size as f64 / best / 1e9
}

/// Find the programs, write the mode configurations, open results.csv.
fn setup(out: &Path, modes: &[Mode]) -> Result<Bench, ExitCode> {
    let exe = std::env::current_exe().map_err(|e| {
        eprintln!("azsdp: {e}");
        ExitCode::FAILURE
    })?;
    let found = crate::locate::shim().and_then(|_| crate::locate::program("azsdp-ttcp"));
    let ttcp = found.map_err(|e| {
        eprintln!("azsdp: {e}");
        ExitCode::from(2)
    })?;
    std::fs::create_dir_all(out).map_err(|e| {
        eprintln!("azsdp: {}: {e}", out.display());
        ExitCode::FAILURE
    })?;
    for m in modes {
        if let Some(cfg) = &m.config {
            if let Err(e) = azsdp::config::Config::parse(cfg, m.name) {
                eprintln!("azsdp: the {} configuration is wrong: {e}", m.name);
                return Err(ExitCode::FAILURE);
            }
            let _ = std::fs::write(out.join(format!("{}.toml", m.name)), cfg.as_bytes());
        }
        let _ = std::fs::remove_file(out.join(format!("{}.log", m.name)));
    }
    let mut csv = std::fs::File::create(out.join("results.csv")).map_err(|e| {
        eprintln!("azsdp: results.csv: {e}");
        ExitCode::FAILURE
    })?;
    let _ = writeln!(csv, "test,mode,size,parameter,value,unit");
    Ok(Bench {
        ttcp,
        exe,
        out: out.to_path_buf(),
        port: 0,
        rows: Vec::new(),
        samples: Vec::new(),
        csv,
        failures: 0,
        progress: Progress::counting("azsdp"),
    })
}

impl Bench {
    /// Throughput of `size`-byte sends under each of `modes` (with `extra`
    /// ttcp options), the median of `rounds` taken in turns, recorded as
    /// `test`; per mode, `None` if its runs failed.
    fn throughput(
        &mut self,
        (test, modes): (&'static str, &[Mode]),
        (size, parameter): (u64, u64),
        extra: &[String],
        budget: u64,
        rounds: usize,
    ) -> Vec<Option<f64>> {
        let mut args = vec![
            "-l".to_string(),
            size.to_string(),
            "-n".into(),
            count_for(size, budget, 64, 1 << 20).to_string(),
        ];
        args.extend_from_slice(extra);
        self.throughput_round_robin((test, modes), (size, parameter), &args, rounds);
        modes
            .iter()
            .map(|m| self.get(test, m.name, size, parameter))
            .collect()
    }

    /// Run a pair (`who`: receiver connections, transmitter processes) and
    /// record `pick` of its reports as `what` at `at` (size, parameter).
    fn measure(
        &mut self,
        what: (&'static str, &Mode),
        who: (usize, usize),
        at: (u64, u64),
        args: &[String],
        pick: Pick,
    ) {
        if let Some((value, unit)) = self.sample(what, who, args, pick) {
            self.record(Row {
                test: what.0,
                mode: what.1.name,
                size: at.0,
                parameter: at.1,
                value,
                unit,
            });
        }
    }

    /// One run's figure and its unit; `None` (said, and counted) if the
    /// run failed.
    fn sample(
        &mut self,
        (test, mode): (&'static str, &Mode),
        who: (usize, usize),
        args: &[String],
        pick: Pick,
    ) -> Option<(f64, &'static str)> {
        let label = format!("{test} {} {}", mode.name, args.join(" "));
        if !self.progress.step(&label) {
            return None;
        }
        let r = self.pair(mode, who.0, who.1, args);
        let v = self.ok(test, mode, r)?;
        Some(match pick {
            Pick::FirstLatency => (v.first().map_or(0.0, |v| num(v, "latency_us")), "us"),
            Pick::WorstLatency => (
                v.iter().map(|v| num(v, "latency_us")).fold(0.0, f64::max),
                "us",
            ),
            Pick::FirstRate => (v.first().map_or(0.0, |v| num(v, "gbytes_per_sec")), "GB/s"),
            Pick::TotalRate => (v.iter().map(|v| num(v, "gbytes_per_sec")).sum(), "GB/s"),
        })
    }

    /// Throughput at `size` in every mode, compared size by size: the modes
    /// take turns for `rounds` rounds (the host's noise drifts over
    /// minutes, and would otherwise favour whichever ran in a quiet one),
    /// and each records its median.
    fn throughput_round_robin(
        &mut self,
        (test, modes): (&'static str, &[Mode]),
        (size, parameter): (u64, u64),
        args: &[String],
        rounds: usize,
    ) {
        let mut got: Vec<Vec<f64>> = vec![Vec::new(); modes.len()];
        for round in 0..rounds {
            // Each round starts with a different mode: no mode always runs
            // right after the same one.
            for k in 0..modes.len() {
                let i = (round + k) % modes.len();
                if let Some((v, _)) = self.sample((test, &modes[i]), (1, 1), args, Pick::FirstRate)
                {
                    got[i].push(v);
                }
            }
        }
        for (m, mut values) in modes.iter().zip(got) {
            if values.is_empty() {
                continue;
            }
            values.sort_by(f64::total_cmp);
            let median = values[values.len() / 2];
            self.samples.push(((test, m.name, size), values));
            self.record(Row {
                test,
                mode: m.name,
                size,
                parameter,
                value: median,
                unit: "GB/s",
            });
        }
    }

    /// Every connection of each azsdp mode must have been upgraded.
    /// What a connection costs on kernel TCP and under azsdp as
    /// configured (see [`conns`]); recorded, and returned for the summary.
    fn connections(
        &mut self,
        at_once: usize,
        in_turn: usize,
    ) -> (Option<conns::Scale>, Option<conns::Scale>) {
        if !self.progress.step(&format!(
            "connections: {at_once} at once, {in_turn} in turn, tcp and azsdp"
        )) {
            return (None, None);
        }
        let echo = match crate::locate::program("azsdp-echo") {
            Ok(p) => p,
            Err(e) => {
                eprintln!("azsdp bench: {e}");
                self.failures += 1;
                return (None, None);
            }
        };
        let exe = self.exe.clone();
        let mut out = [None, None];
        for (i, mode) in ["tcp", "azsdp"].into_iter().enumerate() {
            let runner = conns::Runner {
                echo: &echo,
                azsdp: (mode == "azsdp").then(|| (exe.as_path(), self.out.join("azsdp.toml"))),
                log: self.out.join(format!("connections-{mode}.log")),
            };
            match conns::measure(&runner, at_once, in_turn) {
                Ok(v) => {
                    let shapes = conns::SHAPES
                        .iter()
                        .zip(v.at_once_ms)
                        .map(|(shape, ms)| (shape.3, ms, "ms"));
                    for (test, value, unit) in [
                        ("connect", v.connect_us, "us"),
                        ("connect-p99", v.connect_p99_us, "us"),
                        ("close", v.close_us, "us"),
                        ("rss-per-connection", v.rss_kb_per_conn, "KiB"),
                        ("threads-per-connection", v.threads_per_conn, "threads"),
                        ("fds-per-connection", v.fds_per_conn, "fds"),
                        ("connection-in-turn", v.cycle_us, "us"),
                    ]
                    .into_iter()
                    .chain(shapes)
                    {
                        self.record(Row {
                            test,
                            mode,
                            size: at_once as u64,
                            parameter: in_turn as u64,
                            value,
                            unit,
                        });
                    }
                    out[i] = Some(v);
                }
                Err(e) => {
                    self.failures += 1;
                    eprintln!("azsdp bench: connections under {mode}: {e}");
                }
            }
        }
        (out[0], out[1])
    }

    /// The shim's log of the runs under `mode`.
    fn log_of(&self, mode: &Mode) -> PathBuf {
        self.out.join(format!("{}.log", mode.name))
    }

    fn check_upgraded(&mut self, modes: &[Mode]) {
        for m in modes.iter().filter(|m| m.config.is_some()) {
            let log = std::fs::read_to_string(self.log_of(m)).unwrap_or_default();
            let upgraded = log.matches(": azsdp (fabric ").count();
            let tcp = log
                .lines()
                .filter(|l| l.contains("plain TCP") || l.contains(": tcp ("))
                .count();
            if upgraded == 0 || tcp > 0 {
                self.failures += 1;
                eprintln!(
                    "azsdp: under {} {upgraded} connection(s) were upgraded and {tcp} stayed on TCP (see {})",
                    m.name,
                    self.log_of(m).display()
                );
            }
        }
    }
}

/// The series run as users run azsdp: `config` (a file `azsdp tune`
/// wrote) or, without one, the built-in defaults.
fn as_configured(config: Option<&Path>) -> Result<(Mode, String), ExitCode> {
    let Some(path) = config else {
        return Ok((
            Mode {
                name: "azsdp",
                config: Some(Cow::Borrowed("# the built-in defaults\n")),
            },
            "the built-in defaults".into(),
        ));
    };
    let text = std::fs::read_to_string(path).map_err(|e| {
        eprintln!("azsdp bench: {}: {e}", path.display());
        ExitCode::FAILURE
    })?;
    Ok((
        Mode {
            name: "azsdp",
            config: Some(Cow::Owned(text)),
        },
        path.display().to_string(),
    ))
}

/// Every measurement of a bench run, in order (a counting pass only
/// counts them); the connection-cost results.
fn schedule(
    b: &mut Bench,
    modes: &[Mode],
    quick: bool,
    budget: u64,
) -> (Option<conns::Scale>, Option<conns::Scale>, Option<String>) {
    let lat_sizes = if quick {
        vec![64, 4096, 65536, 1 << 20]
    } else {
        [vec![1], pow(2, 20, 2)].concat()
    };
    let tput_sizes = if quick {
        vec![64, 4096, 65536, 1 << 20, 4 << 20]
    } else {
        [vec![1], pow(2, 22, 2)].concat()
    };
    let sv = |v: &[&str]| v.iter().map(|x| x.to_string()).collect::<Vec<String>>();
    // Long enough that a scheduling hiccup of a few milliseconds does not
    // decide the comparison (64 MiB at 4 GB/s is 16 ms).
    let tput_budget = budget * if quick { 4 } else { 2 };
    for &size in &tput_sizes {
        let n = count_for(size, tput_budget, 64, 1 << 20);
        let args = sv(&["-l", &size.to_string(), "-n", &n.to_string()]);
        b.throughput_round_robin(("throughput", modes), (size, 0), &args, 5);
    }
    b.progress.say("throughput done");
    for m in modes {
        for &size in &lat_sizes {
            let n = count_for(size, budget / 8, 20, if quick { 2000 } else { 10000 });
            let args = sv(&[
                "--test",
                "latency",
                "-l",
                &size.to_string(),
                "-n",
                &n.to_string(),
            ]);
            b.measure(("latency", m), (1, 1), (size, 0), &args, Pick::FirstLatency);
        }
        let computes: &[u64] = if quick {
            &[0, 100, 150, 200, 400]
        } else {
            &[0, 50, 100, 150, 200, 300, 400]
        };
        for &size in &[65536u64, 1 << 20] {
            for &us in computes {
                let n = count_for(size, budget / 4, 32, 4096);
                let args = sv(&[
                    "-l",
                    &size.to_string(),
                    "-n",
                    &n.to_string(),
                    "--compute-us",
                    &us.to_string(),
                ]);
                b.measure(("overlap", m), (1, 1), (size, us), &args, Pick::FirstRate);
            }
        }
        let windows: &[u64] = if quick {
            &[1, 8, 64]
        } else {
            &[1, 2, 4, 8, 16, 32, 64]
        };
        let mb = 1u64 << 20;
        for &w in windows {
            let n = count_for(mb, budget / 2, 32, 4096);
            let args = sv(&[
                "-l",
                &mb.to_string(),
                "-n",
                &n.to_string(),
                "--touch-window",
                &w.to_string(),
            ]);
            b.measure(("page-faults", m), (1, 1), (mb, w), &args, Pick::FirstRate);
        }
        // Hot-spot: 4 clients ping-pong 64 B against one server (the worst).
        let n = if quick { "1000" } else { "5000" };
        let args = sv(&["--test", "latency", "-l", "64", "-n", n]);
        b.measure(("hot-spot", m), (4, 4), (64, 4), &args, Pick::WorstLatency);
        let streams: &[u64] = if quick { &[1, 4] } else { &[1, 2, 4, 8] };
        for &st in streams {
            let n = (count_for(mb, budget, 64, 4096) / st).max(8);
            let args = sv(&[
                "-l",
                &mb.to_string(),
                "-n",
                &n.to_string(),
                "--streams",
                &st.to_string(),
            ]);
            b.measure(
                ("multi-stream", m),
                (st as usize, 1),
                (mb, st),
                &args,
                Pick::FirstRate,
            );
        }
        for (test, kind) in [("fan-in", "throughput"), ("fan-out", "source")] {
            let n = (count_for(mb, budget, 64, 4096) / 4).max(8);
            let args = sv(&["--test", kind, "-l", &mb.to_string(), "-n", &n.to_string()]);
            b.measure((test, m), (4, 4), (mb, 4), &args, Pick::TotalRate);
        }
        b.progress.say(&format!("{} done", m.name));
    }
    if !b.progress.is_counting() {
        b.check_upgraded(modes);
    }
    let (at_once, in_turn) = connection_counts(quick);
    let scale = b.connections(at_once, in_turn);
    let started = Instant::now();
    let redis = b.redis(quick).map(|r| redis::table(&r, started));
    (scale.0, scale.1, redis)
}

/// Connections held at once and made in turn for the cost table.
fn connection_counts(quick: bool) -> (usize, usize) {
    if quick { (200, 1000) } else { (1000, 10000) }
}

/// Powers of two from 2^from to 2^to, every `step`th.
fn pow(from: u32, to: u32, step: usize) -> Vec<u64> {
    (from..=to).step_by(step).map(|e| 1u64 << e).collect()
}

pub fn run(quick: bool, out: PathBuf, config: Option<PathBuf>) -> ExitCode {
    let (configured, configured_from) = match as_configured(config.as_deref()) {
        Ok(m) => m,
        Err(code) => return code,
    };
    let mut modes = MODES.to_vec();
    modes.push(configured);
    let mut b = match setup(&out, &modes) {
        Ok(b) => b,
        Err(code) => return code,
    };
    let t0 = Instant::now();
    let load_at_start = load_average();
    let budget: u64 = if quick { 64 << 20 } else { 512 << 20 };

    let memcpy_1m = memcpy_gbps(1 << 20, true);
    let memcpy_cold = memcpy_gbps(1 << 20, false);
    for (parameter, value) in [(0, memcpy_1m), (1, memcpy_cold)] {
        b.record(Row {
            test: "memcpy",
            mode: "memcpy",
            size: 1 << 20,
            parameter,
            value,
            unit: "GB/s",
        });
    }

    // Counted first (nothing runs), so that progress can say how far.
    b.progress = Progress::counting("azsdp bench");
    schedule(&mut b, &modes, quick, budget);
    b.progress = Progress::start("azsdp bench", b.progress.runs());
    let scale = schedule(&mut b, &modes, quick, budget);
    b.progress.finish();
    let (at_once, in_turn) = connection_counts(quick);
    let names: Vec<&str> = modes.iter().map(|m| m.name).collect();
    let ctx = plots::Context {
        footer: footer(quick, &configured_from),
        ranges: b
            .samples
            .iter()
            .filter_map(|((t, m, z), v)| {
                Some((
                    (t.to_string(), m.to_string(), *z),
                    (*v.first()?, *v.last()?),
                ))
            })
            .collect(),
    };
    let figures = match plots::draw(&out, &b.rows, &names, &ctx) {
        Ok(f) => f,
        Err(e) => {
            eprintln!("azsdp bench: figures: {e}");
            b.failures += 1;
            Vec::new()
        }
    };
    let mut summary = summarize(
        &b,
        (memcpy_1m, memcpy_cold),
        (quick, &configured_from),
        t0.elapsed(),
        (load_at_start, load_average()),
    );
    summary += &conns::table(scale.0, scale.1, at_once, in_turn);
    summary += scale.2.as_deref().unwrap_or_default();
    if !figures.is_empty() {
        let _ = writeln!(summary, "\n## Figures\n");
        for f in &figures {
            let name = f.file_name().unwrap_or_default().to_string_lossy();
            let _ = writeln!(summary, "![{name}]({name})");
        }
    }
    let _ = std::fs::write(out.join("summary.md"), &summary);
    if let Err(e) = report::write(&out, &summary) {
        eprintln!("azsdp bench: report.html: {e}");
        b.failures += 1;
    }
    println!("{summary}");
    println!(
        "results: {} (figures and summary: {})",
        out.join("results.csv").display(),
        out.join("report.html").display()
    );
    if b.failures > 0 {
        eprintln!(
            "azsdp bench: {} measurement(s) failed (logs in {})",
            b.failures,
            out.display()
        );
        return ExitCode::FAILURE;
    }
    let _ = std::io::stdout().flush();
    ExitCode::SUCCESS
}

/// Is `a` at least `k` times `b` (both measured)?
fn at_least(a: Option<f64>, b: Option<f64>, k: f64) -> Option<bool> {
    Some(a? >= k * b?)
}

/// "met", "missed (what)", or "not measured".
fn verdict(checks: &[(&str, Option<bool>)]) -> String {
    if checks.iter().any(|(_, c)| c.is_none()) {
        return "not measured".into();
    }
    let missed: Vec<&str> = checks
        .iter()
        .filter(|(_, c)| *c == Some(false))
        .map(|(what, _)| *what)
        .collect();
    if missed.is_empty() {
        "**met**".into()
    } else {
        format!("**missed** ({})", missed.join(", "))
    }
}

/// Where, when and how a run was made: host, kernel, cores, date, the
/// build's commit, the configuration of the `azsdp` series, quick or full.
fn footer(quick: bool, configured_from: &str) -> String {
    let read = |p: &str| std::fs::read_to_string(p).map(|s| s.trim().to_string());
    let host = read("/proc/sys/kernel/hostname").unwrap_or_else(|_| "?".into());
    let kernel = read("/proc/sys/kernel/osrelease").unwrap_or_else(|_| "?".into());
    let cores = std::thread::available_parallelism().map_or(1, |n| n.get());
    let now = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_secs());
    format!(
        "{host}, Linux {kernel}, {cores} cores | {} | azsdp {} ({}) | azsdp series: {configured_from} | {} run",
        utc(now),
        env!("CARGO_PKG_VERSION"),
        include_str!(concat!(env!("OUT_DIR"), "/commit")).trim(),
        if quick { "quick" } else { "full" }
    )
}

/// `secs` since the epoch as "YYYY-MM-DD HH:MM UTC" (civil from days).
fn utc(secs: u64) -> String {
    let days = (secs / 86400) as i64;
    let (h, m) = ((secs % 86400) / 3600, (secs % 3600) / 60);
    let z = days + 719_468;
    let era = z.div_euclid(146_097);
    let doe = z.rem_euclid(146_097);
    let yoe = (doe - doe / 1460 + doe / 36_524 - doe / 146_096) / 365;
    let doy = doe - (365 * yoe + yoe / 4 - yoe / 100);
    let mp = (5 * doy + 2) / 153;
    let d = doy - (153 * mp + 2) / 5 + 1;
    let mo = if mp < 10 { mp + 3 } else { mp - 9 };
    let y = yoe + era * 400 + i64::from(mo <= 2);
    format!("{y:04}-{mo:02}-{d:02} {h:02}:{m:02} UTC")
}

/// The host's 1-minute load average.
fn load_average() -> f64 {
    std::fs::read_to_string("/proc/loadavg")
        .ok()
        .and_then(|l| l.split_whitespace().next()?.parse().ok())
        .unwrap_or(0.0)
}

fn ratio(a: Option<f64>, b: Option<f64>) -> String {
    match (a, b) {
        (Some(a), Some(b)) if b > 0.0 => format!("{:.2}x", a / b),
        _ => "n/a".into(),
    }
}

/// The better of block- and copy-on-write at one point: its mode and
/// figure (higher or lower is better, as `higher` says).
fn best_azsdp_at(
    b: &Bench,
    test: &str,
    size: u64,
    parameter: u64,
    higher: bool,
) -> Option<(&'static str, f64)> {
    let v = ["azsdp-bow", "azsdp-cow"]
        .into_iter()
        .filter_map(|m| Some((m, b.get(test, m, size, parameter)?)));
    if higher {
        v.max_by(|x, y| x.1.total_cmp(&y.1))
    } else {
        v.min_by(|x, y| x.1.total_cmp(&y.1))
    }
}

fn best_azsdp(b: &Bench, test: &str, size: u64, parameter: u64, higher: bool) -> Option<f64> {
    best_azsdp_at(b, test, size, parameter, higher).map(|(_, v)| v)
}

fn best_azsdp_mode(
    b: &Bench,
    test: &str,
    size: u64,
    parameter: u64,
    higher: bool,
) -> Option<&'static str> {
    best_azsdp_at(b, test, size, parameter, higher).map(|(m, _)| m)
}

fn summarize(
    b: &Bench,
    memcpy: (f64, f64),
    (quick, configured_from): (bool, &str),
    took: Duration,
    load: (f64, f64),
) -> String {
    let (memcpy_1m, memcpy_cold) = memcpy;
    let mut s = String::new();
    let _ = writeln!(s, "# azsdp bench{}\n", if quick { " --quick" } else { "" });
    let _ = writeln!(
        s,
        "Ran in {:.0} s on this host. AZ-SDP is the better of block- and copy-on-write.\n",
        took.as_secs_f64()
    );
    let mb = 1u64 << 20;
    // How much the host's noise moved kernel TCP's own runs.
    let spread = |mode: &str, size: u64| -> Option<(f64, f64, f64)> {
        let v = &b
            .samples
            .iter()
            .find(|((t, m, z), _)| *t == "throughput" && *m == mode && *z == size)?
            .1;
        Some((*v.first()?, v[v.len() / 2], *v.last()?))
    };
    let tcp_spread = spread("tcp", mb).map(|(lo, med, hi)| (hi - lo) / med.max(1e-9));
    let cores = std::thread::available_parallelism().map_or(1, |n| n.get()) as f64;
    // Judged on the load before the run: the bench's own pairs load the
    // host while it runs (the end's figure is shown, not judged).
    let busy_load = load.0 > 0.5 * cores;
    let noisy = tcp_spread.is_some_and(|sp| sp > 0.25);
    let _ = writeln!(
        s,
        "Load average {:.2} at the start, {:.2} at the end ({cores} cores); kernel TCP's 1 MiB runs spread {}.\n",
        load.0,
        load.1,
        tcp_spread.map_or("-".into(), |sp| format!("{:.0}%", sp * 100.0)),
    );
    if busy_load || noisy {
        let _ = writeln!(
            s,
            "> **Warning: the host was too busy to judge the targets** ({}). The ratios below \
             compare runs that the host's load moved; run again on a quiet host.\n",
            [
                busy_load.then_some("load average above half the cores at the start"),
                noisy.then_some("kernel TCP's own runs spread more than 25%"),
            ]
            .into_iter()
            .flatten()
            .collect::<Vec<_>>()
            .join(", ")
        );
    }
    let _ = writeln!(
        s,
        "| headline | azsdp | vs kernel TCP | vs ZSDP | target | verdict |"
    );
    let _ = writeln!(s, "|---|---|---|---|---|---|");
    let shown_range = |mode: &str, size: u64| {
        spread(mode, size).map_or(String::new(), |(lo, _, hi)| format!(" [{lo:.2}-{hi:.2}]"))
    };
    let t_az = best_azsdp(b, "throughput", mb, 0, true);
    let t_tcp = b.get("throughput", "tcp", mb, 0);
    let _ = writeln!(
        s,
        "| throughput 1 MiB | {:.2} GB/s{} ({} of memcpy {memcpy_1m:.1} GB/s with warm caches, {} of {memcpy_cold:.1} GB/s cold) | {} (TCP {:.2}{}) | {} | >= 2.5x TCP, >= 0.6x memcpy | {} |",
        t_az.unwrap_or(0.0),
        best_azsdp_mode(b, "throughput", mb, 0, true).map_or(String::new(), |m| shown_range(m, mb)),
        ratio(t_az, Some(memcpy_1m)),
        ratio(t_az, Some(memcpy_cold)),
        ratio(t_az, t_tcp),
        t_tcp.unwrap_or(0.0),
        shown_range("tcp", mb),
        ratio(t_az, b.get("throughput", "zsdp", mb, 0)),
        verdict(&[
            ("2.5x TCP", at_least(t_az, t_tcp, 2.5)),
            // Against a copy of data not in the caches, as a transfer's
            // is (the warm figure is shown beside it).
            ("0.6x cold memcpy", at_least(t_az, Some(memcpy_cold), 0.6)),
        ]),
    );
    let l_az = best_azsdp(b, "latency", 64, 0, false);
    let l_tcp = b.get("latency", "tcp", 64, 0);
    let _ = writeln!(
        s,
        "| latency 64 B | {:.2} µs | {} | {} | <= 0.2x TCP | {} |",
        l_az.unwrap_or(0.0),
        ratio(l_az, l_tcp),
        ratio(l_az, b.get("latency", "zsdp", 64, 0)),
        verdict(&[("0.2x TCP", at_least(l_tcp, l_az, 5.0))]),
    );
    // The paper's point of most overlap: compute about as long as ZSDP's
    // transfer of the message (measured here, with no compute).
    let transfer_us = b
        .get("overlap", "zsdp", mb, 0)
        .filter(|r| *r > 0.0)
        .map_or(100.0, |r| mb as f64 / r / 1e3);
    let compute = b
        .rows
        .iter()
        .filter(|r| r.test == "overlap" && r.size == mb && r.parameter > 0)
        .map(|r| r.parameter)
        .min_by_key(|&c| (c as f64 - transfer_us).abs() as u64)
        .unwrap_or(400);
    let o_az = best_azsdp(b, "overlap", mb, compute, true);
    let (o_tcp, o_zsdp) = (
        b.get("overlap", "tcp", mb, compute),
        b.get("overlap", "zsdp", mb, compute),
    );
    let _ = writeln!(
        s,
        "| overlap 1 MiB, {compute} µs compute (ZSDP's transfer: {transfer_us:.0} µs) | {:.2} GB/s | {} | {} | >= 1.4x TCP, >= 1.6x ZSDP | {} |",
        o_az.unwrap_or(0.0),
        ratio(o_az, o_tcp),
        ratio(o_az, o_zsdp),
        verdict(&[
            ("1.4x TCP", at_least(o_az, o_tcp, 1.4)),
            ("1.6x ZSDP", at_least(o_az, o_zsdp, 1.6)),
        ]),
    );
    let _ = writeln!(s, "\n## Throughput (GB/s) by size\n");
    let names: Vec<&str> = MODES.iter().map(|m| m.name).chain(["azsdp"]).collect();
    let _ = writeln!(s, "| size | {} |", names.join(" | "));
    let _ = writeln!(s, "|---|{}", "---|".repeat(names.len()));
    let mut sizes: Vec<u64> = b
        .rows
        .iter()
        .filter(|r| r.test == "throughput")
        .map(|r| r.size)
        .collect();
    sizes.sort_unstable();
    sizes.dedup();
    for &size in &sizes {
        let cells: Vec<String> = names
            .iter()
            .map(|m| {
                b.get("throughput", m, size, 0)
                    .map_or("-".into(), |v| format!("{v:.2}"))
            })
            .collect();
        let _ = writeln!(s, "| {size} | {} |", cells.join(" | "));
    }
    let _ = writeln!(
        s,
        "\n## azsdp as configured ({configured_from}) against the best mode\n\n\
         Target: within 10% of the best of the five modes at every size, or above it.\n"
    );
    let _ = writeln!(
        s,
        "Each figure is the median of the runs, with their range in brackets. \
         *within noise*: below 90%, but the ranges of the two overlap (azsdp \
         takes the path of some mode at every size, copied below its threshold, \
         zero-copy above; the best of five is then partly the luckiest of \
         several runs of one path).\n"
    );
    let _ = writeln!(s, "| size | best mode | azsdp | ratio | |");
    let _ = writeln!(s, "|---|---|---|---|---|");
    let mut missed = 0;
    let range = |mode: &str, size: u64| {
        b.samples
            .iter()
            .find(|((t, m, z), _)| *t == "throughput" && *m == mode && *z == size)
            .and_then(|(_, v)| Some((*v.first()?, *v.last()?)))
    };
    let shown = |v: f64, r: Option<(f64, f64)>| match r {
        Some((lo, hi)) => format!("{v:.2} [{lo:.2}-{hi:.2}]"),
        None => format!("{v:.2}"),
    };
    for &size in &sizes {
        let best = MODES
            .iter()
            .filter_map(|m| Some((m.name, b.get("throughput", m.name, size, 0)?)))
            .max_by(|x, y| x.1.total_cmp(&y.1));
        let (Some((best_mode, best)), Some(az)) = (best, b.get("throughput", "azsdp", size, 0))
        else {
            continue;
        };
        let (best_range, az_range) = (range(best_mode, size), range("azsdp", size));
        let verdict = if az >= 0.9 * best {
            "ok"
        } else if let (Some((best_lo, _)), Some((_, az_hi))) = (best_range, az_range)
            && az_hi >= best_lo
        {
            "within noise"
        } else {
            missed += 1;
            "missed"
        };
        let _ = writeln!(
            s,
            "| {size} | {best_mode} {} | {} | {} | {verdict} |",
            shown(best, best_range),
            shown(az, az_range),
            ratio(Some(az), Some(best)),
        );
    }
    let _ = writeln!(
        s,
        "\n{}",
        if missed == 0 {
            "Within 10% of the best mode, or within the noise, at every size.".to_string()
        } else {
            format!("More than 10% below the best mode at {missed} size(s).")
        }
    );
    s
}

/// The smallest size from which zero-copy wins at every larger size too (a
/// lone win below a loss is noise, not a crossover); `None` if it never
/// wins at the largest size. `wins`: (size, zero-copy won), by size.
fn crossover(wins: &[(u64, bool)]) -> Option<u64> {
    match wins.iter().rposition(|&(_, won)| !won) {
        None => wins.first().map(|w| w.0),
        Some(i) => wins.get(i + 1).map(|w| w.0),
    }
}

/// `azsdp tune`: measure this host's crossovers and write them as a
/// configuration `azsdp run --config` accepts.
/// What `tune` measured: the throughput lines, the crossover size, and
/// (block, copy) on write faults, (unarmed, armed) receives, in GB/s.
struct TuneResults {
    lines: Vec<String>,
    threshold: Option<u64>,
    fault: (f64, f64),
    recv_protect: (f64, f64),
}

/// `tune`'s measurements, in order (a counting pass only counts them).
fn tune_runs(b: &mut Bench, modes: &[Mode]) -> TuneResults {
    let budget = 128 << 20;
    // Where zero-copy starts to beat the copy through the rings.
    let sizes: Vec<u64> = (12..=21).map(|e| 1u64 << e).collect();
    let mut lines = Vec::new();
    let mut wins = Vec::new();
    for &size in &sizes {
        let v = b.throughput(("tune-threshold", &modes[..3]), (size, 0), &[], budget, 3);
        let zc = v[1..].iter().flatten().copied().fold(0.0, f64::max);
        if let Some(bsdp) = v[0] {
            lines.push(format!(
                "#   {size:>8} B: bsdp {bsdp:.2} GB/s, zero-copy {zc:.2} GB/s"
            ));
            wins.push((size, zc > bsdp));
        }
    }
    let threshold = crossover(&wins);
    // Copy-on-write against block-on-write when the program rewrites its
    // buffer every 8 sends, at 1 MiB.
    let touch = vec!["--touch-window".to_string(), "8".to_string()];
    let v = b.throughput(
        ("tune-fault", &modes[1..3]),
        (1 << 20, 8),
        &touch,
        budget,
        3,
    );
    let fault = (v[0].unwrap_or(0.0), v[1].unwrap_or(0.0));
    // Receive-side protection: recv() may return before its data landed,
    // which pays only where GETs complete after the call could return.
    let v = b.throughput(
        ("tune-recv-protect", &[modes[1].clone(), modes[3].clone()]),
        (1 << 20, 0),
        &[],
        budget,
        3,
    );
    let recv_protect = (v[0].unwrap_or(0.0), v[1].unwrap_or(0.0));
    TuneResults {
        lines,
        threshold,
        fault,
        recv_protect,
    }
}

pub fn tune(out_file: PathBuf) -> ExitCode {
    let dir = std::env::temp_dir().join(format!("azsdp-tune-{}", std::process::id()));
    // BSDP and AZ-SDP block- and copy-on-write, as `azsdp bench` runs them,
    // and block-on-write with receive-side protection on.
    let armed = Mode {
        name: "azsdp-bow-armed",
        config: Some(Cow::Borrowed(
            "write_fault = \"block\"\nzcopy_threshold = 4096\nrecv_protect = \"on\"\n",
        )),
    };
    let modes = [MODES[1].clone(), MODES[3].clone(), MODES[4].clone(), armed];
    let mut b = match setup(&dir, &modes) {
        Ok(b) => b,
        Err(code) => return code,
    };
    b.progress = Progress::counting("azsdp tune");
    tune_runs(&mut b, &modes);
    b.progress = Progress::start("azsdp tune", b.progress.runs());
    let t = tune_runs(&mut b, &modes);
    b.progress.finish();
    let (lines, threshold, (bow, cow), (unarmed, armed)) =
        (t.lines, t.threshold, t.fault, t.recv_protect);
    b.check_upgraded(&modes);
    if b.failures > 0 {
        eprintln!(
            "azsdp tune: {} measurement(s) failed; nothing written (logs in {})",
            b.failures,
            dir.display()
        );
        return ExitCode::FAILURE;
    }
    let threshold = threshold.unwrap_or(u64::from(u32::MAX));
    let policy = if cow >= bow { "copy" } else { "block" };
    let mut text = String::new();
    let _ = writeln!(
        text,
        "# Written by `azsdp tune` on this host; use with `azsdp run --config FILE`."
    );
    let _ = writeln!(text, "#\n# Throughput by send size (same run):");
    for l in &lines {
        let _ = writeln!(text, "{l}");
    }
    let _ = writeln!(
        text,
        "# Zero-copy first beats the copy through the rings at {threshold} B."
    );
    let _ = writeln!(text, "zcopy_threshold = {threshold}");
    let _ = writeln!(
        text,
        "\n# A program rewriting its 1 MiB buffer every 8 sends: block-on-write {bow:.2} GB/s,\n# copy-on-write {cow:.2} GB/s."
    );
    let _ = writeln!(text, "write_fault = \"{policy}\"");
    let _ = writeln!(
        text,
        "\n# Receive-side protection at 1 MiB, block-on-write: off {unarmed:.2} GB/s, on {armed:.2} GB/s."
    );
    let _ = writeln!(
        text,
        "recv_protect = \"{}\"",
        if armed > unarmed * 1.05 { "on" } else { "off" }
    );
    if let Err(e) = azsdp::config::Config::parse(&text, "tune") {
        eprintln!("azsdp tune: wrote an invalid configuration: {e}");
        return ExitCode::FAILURE;
    }
    if let Err(e) = std::fs::write(&out_file, &text) {
        eprintln!("azsdp tune: {}: {e}", out_file.display());
        return ExitCode::FAILURE;
    }
    let _ = std::fs::remove_dir_all(&dir);
    print!("{text}");
    println!("# written to {}", out_file.display());
    ExitCode::SUCCESS
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn dates_are_civil() {
        assert_eq!(utc(0), "1970-01-01 00:00 UTC");
        assert_eq!(utc(1_795_450_000), "2026-11-23 16:06 UTC");
        assert_eq!(utc(951_782_400), "2000-02-29 00:00 UTC");
    }

    #[test]
    fn the_crossover_is_where_zero_copy_wins_for_good() {
        let w = |v: &[(u64, bool)]| crossover(v);
        assert_eq!(w(&[(4, false), (8, true), (16, true)]), Some(8));
        assert_eq!(
            w(&[(4, true), (8, false), (16, true), (32, true)]),
            Some(16)
        );
        assert_eq!(w(&[(4, true), (8, true)]), Some(4));
        assert_eq!(w(&[(4, true), (8, false)]), None);
        assert_eq!(w(&[]), None);
    }
}
