//! `azsdp stat`: the host's live azsdp connections, as `ss` and
//! `vma_stats` show theirs: filters, a wide form with every counter, JSON,
//! and `--watch` with rates over each interval.

use std::collections::HashMap;
use std::io::IsTerminal as _;
use std::net::SocketAddr;
use std::time::{Duration, Instant};

use azsdp::conn::{COPY_REASONS, CopyReason, Role};
use azsdp::stats::{ConnStat, dirs_to_read, read_dirs};
use serde_json::json;

/// What to show, from the command line.
#[derive(Clone, Debug, Default, clap::Args)]
pub struct Options {
    /// One JSON object per connection, in an array (with --watch, one
    /// array per line).
    #[arg(long)]
    pub json: bool,
    /// Every counter, and whole program names.
    #[arg(short, long)]
    pub wide: bool,
    /// Only this process's connections.
    #[arg(short, long)]
    pub pid: Option<u32>,
    /// Only connections with this port at either end.
    #[arg(long)]
    pub port: Option<u16>,
    /// Only connections on this path.
    #[arg(long, value_parser = PATHS)]
    pub path: Option<String>,
    /// Print again every SECONDS (default 1), with each connection's send
    /// and receive rates over the interval.
    #[arg(long, value_name = "SECONDS", num_args = 0..=1, default_missing_value = "1",
          value_parser = parse_interval)]
    pub watch: Option<Duration>,
}

/// `stat --watch`'s interval: seconds, from 0.1 to a day.
fn parse_interval(s: &str) -> Result<Duration, String> {
    let secs: f64 = s
        .parse()
        .map_err(|_| format!("`{s}` is not a number of seconds"))?;
    if !(0.1..=86400.0).contains(&secs) {
        return Err(format!("`{s}`: from 0.1 to 86400 seconds"));
    }
    Ok(Duration::from_secs_f64(secs))
}

/// The paths a connection can be on, as `--path` takes them.
pub const PATHS: [&str; 4] = ["tcp", "bsdp", "zsdp", "azsdp"];

fn role(r: Role) -> &'static str {
    match r {
        Role::Client => "client",
        Role::Server => "server",
    }
}

/// Bytes in a short human form.
fn human(n: u64) -> String {
    const UNITS: [&str; 5] = ["B", "KiB", "MiB", "GiB", "TiB"];
    let mut v = n as f64;
    let mut u = 0;
    while v >= 1024.0 && u + 1 < UNITS.len() {
        v /= 1024.0;
        u += 1;
    }
    if u == 0 {
        format!("{n}B")
    } else {
        format!("{v:.1}{}", UNITS[u])
    }
}

fn peer_pid(c: &ConnStat) -> String {
    if c.peer_pid == 0 {
        "-".into()
    } else {
        c.peer_pid.to_string()
    }
}

fn sent(c: &ConnStat) -> u64 {
    c.sent_async + c.sent_sync + c.sent_bsdp + c.sent_tcp
}

fn received(c: &ConnStat) -> u64 {
    c.recv_zcopy + c.recv_bsdp + c.recv_tcp
}

/// One connection, named across samples.
type Key = (u32, SocketAddr, SocketAddr);

fn key(c: &ConnStat) -> Key {
    (c.pid, c.local, c.peer)
}

/// Bytes a second sent and received since the previous sample.
#[derive(Clone, Copy, Debug)]
struct Rates {
    tx: f64,
    rx: f64,
}

fn to_json(c: &ConnStat, rates: Option<Rates>) -> serde_json::Value {
    let mut v = json!({
        "pid": c.pid,
        "program": c.program,
        "role": role(c.role),
        "local": c.local.to_string(),
        "peer": c.peer.to_string(),
        "peer_pid": (c.peer_pid != 0).then_some(c.peer_pid),
        "path": c.path.name(),
        "fabric": c.fabric,
        "tcp_reason": c.tcp_reason.map(|r| r.name()),
        "zcopy_fallback": c.zcopy_fallback,
        "bytes": {
            "sent": {
                "azsdp": c.sent_async,
                "zsdp": c.sent_sync,
                "bsdp": c.sent_bsdp,
                "tcp": c.sent_tcp,
            },
            "received": {
                "zcopy": c.recv_zcopy,
                "bsdp": c.recv_bsdp,
                "tcp": c.recv_tcp,
            },
        },
        "src_avails_outstanding": c.avails_outstanding,
        "src_avails_sent": c.avails_sent,
        "gets": c.gets,
        "get_bytes": c.get_bytes,
        "send_faults": c.send_faults,
        "recv_faults": c.recv_faults,
        "cow_copies": c.cow_copies,
        "cow_lost": c.cow_lost,
        "fallbacks": c.fallbacks,
        "armed_recvs": c.armed_recvs,
        "rung": c.rung,
        "copied": copied_json(c),
    });
    if let Some(r) = rates {
        v["rates"] = json!({ "sent_bytes_per_s": r.tx, "received_bytes_per_s": r.rx });
    }
    v
}

/// Bytes sent by copy, by reason, and the kind of memory copied for want
/// of protection.
fn copied_json(c: &ConnStat) -> serde_json::Value {
    let mut m = serde_json::Map::new();
    for r in CopyReason::ALL {
        m.insert(r.name().to_string(), json!(c.copied(r)));
    }
    m.insert(
        "memory_kind".into(),
        json!(c.copied_memory.map(|k| k.name())),
    );
    serde_json::Value::Object(m)
}

/// The connections `o` selects, in a stable order.
fn select(o: &Options) -> Vec<ConnStat> {
    let mut rows: Vec<ConnStat> = read_dirs(&dirs_to_read())
        .into_iter()
        .filter(|c| matches(c, o))
        .collect();
    rows.sort_by_key(|c| (c.pid, c.local, c.peer));
    rows
}

/// Does `c` pass `o`'s filters?
fn matches(c: &ConnStat, o: &Options) -> bool {
    o.pid.is_none_or(|p| c.pid == p)
        && o.port
            .is_none_or(|p| c.local.port() == p || c.peer.port() == p)
        && o.path.as_deref().is_none_or(|p| c.path.name() == p)
}

/// The wide table's columns of bytes sent by copy, in [`CopyReason::ALL`]'s
/// order.
const COPY_COLUMNS: [&str; COPY_REASONS] = [
    "CP-SMALL",
    "CP-EDGES",
    "CP-MEMORY",
    "CP-FAULTS",
    "CP-NONBLOCK",
    "CP-NO-ZC",
    "CP-PREPFAIL",
    "CP-PEERGONE",
];

/// A table: a header and rows of cells, each column as wide as its widest
/// cell; numbers right-aligned.
fn table(header: &[&str], rows: &[Vec<String>], right_from: usize) -> String {
    let mut width: Vec<usize> = header.iter().map(|h| h.len()).collect();
    for r in rows {
        for (w, cell) in width.iter_mut().zip(r) {
            *w = (*w).max(cell.chars().count());
        }
    }
    let line = |cells: Vec<&str>| -> String {
        let mut s = String::new();
        for (i, (cell, w)) in cells.iter().zip(&width).enumerate() {
            if i > 0 {
                s.push(' ');
            }
            if i >= right_from {
                s.push_str(&format!("{cell:>w$}"));
            } else {
                s.push_str(&format!("{cell:<w$}"));
            }
        }
        s.trim_end().to_string() + "\n"
    };
    let mut out = line(header.to_vec());
    for r in rows {
        out.push_str(&line(r.iter().map(String::as_str).collect()));
    }
    out
}

fn render(rows: &[ConnStat], o: &Options, rates: &HashMap<Key, Rates>) -> String {
    let why = |c: &ConnStat| -> String {
        c.tcp_reason
            .map(|r| r.name())
            .or(c.zcopy_fallback)
            .unwrap_or("-")
            .to_string()
    };
    let rate = |c: &ConnStat, f: fn(&Rates) -> f64| -> String {
        rates
            .get(&key(c))
            .map_or("-".into(), |r| format!("{}/s", human(f(r) as u64)))
    };
    let mut header = vec![
        "PID", "PROGRAM", "ROLE", "LOCAL", "PEER", "PATH", "FABRIC", "WHY", "PEERPID",
    ];
    let watching = o.watch.is_some();
    let right_from = 8;
    if o.wide {
        header.extend([
            "TX-AZSDP",
            "TX-ZSDP",
            "TX-BSDP",
            "TX-TCP",
            "RX-ZCOPY",
            "RX-BSDP",
            "RX-TCP",
            "AVAIL",
            "AVAILS",
            "GETS",
            "GET-BYTES",
            "S-FAULTS",
            "R-FAULTS",
            "COWS",
            "COW-LOST",
            "FALLBACKS",
            "ARMED",
        ]);
        header.extend(COPY_COLUMNS);
        header.push("CP-KIND");
    } else {
        header.extend([
            "TX-AZSDP", "TX-ZSDP", "TX-BSDP", "COPY-WHY", "TX-TCP", "RX", "AVAIL", "GETS",
            "FAULTS", "COWS",
        ]);
    }
    if watching {
        header.extend(["TX/S", "RX/S"]);
    }
    let rows: Vec<Vec<String>> = rows
        .iter()
        .map(|c| {
            let program = if o.wide {
                c.program.clone()
            } else {
                c.program.chars().take(14).collect()
            };
            let mut r = vec![
                c.pid.to_string(),
                program,
                role(c.role).to_string(),
                c.local.to_string(),
                c.peer.to_string(),
                c.path.name().to_string(),
                c.fabric.unwrap_or("-").to_string(),
                why(c),
                peer_pid(c),
                human(c.sent_async),
                human(c.sent_sync),
                human(c.sent_bsdp),
            ];
            if !o.wide {
                r.push(c.main_copy_reason().unwrap_or_else(|| "-".into()));
            }
            r.push(human(c.sent_tcp));
            if o.wide {
                r.extend([
                    human(c.recv_zcopy),
                    human(c.recv_bsdp),
                    human(c.recv_tcp),
                    c.avails_outstanding.to_string(),
                    c.avails_sent.to_string(),
                    c.gets.to_string(),
                    human(c.get_bytes),
                    c.send_faults.to_string(),
                    c.recv_faults.to_string(),
                    c.cow_copies.to_string(),
                    c.cow_lost.to_string(),
                    c.fallbacks.to_string(),
                    c.armed_recvs.to_string(),
                ]);
                r.extend(CopyReason::ALL.iter().map(|why| human(c.copied(*why))));
                r.push(c.copied_memory.map_or("-", |k| k.name()).to_string());
            } else {
                r.extend([
                    human(received(c)),
                    c.avails_outstanding.to_string(),
                    c.gets.to_string(),
                    (c.send_faults + c.recv_faults).to_string(),
                    c.cow_copies.to_string(),
                ]);
            }
            if watching {
                r.push(rate(c, |r| r.tx));
                r.push(rate(c, |r| r.rx));
            }
            r
        })
        .collect();
    table(&header, &rows, right_from)
}

/// Print once, or every `o.watch` until interrupted.
pub fn print(o: &Options) {
    let Some(every) = o.watch else {
        let rows = select(o);
        if o.json {
            let v: Vec<_> = rows.iter().map(|c| to_json(c, None)).collect();
            println!("{}", serde_json::Value::Array(v));
        } else if rows.is_empty() {
            println!(
                "no azsdp connections{}",
                if filtered(o) { " match" } else { "" }
            );
        } else {
            print!("{}", render(&rows, o, &HashMap::new()));
        }
        return;
    };
    let clear = !o.json && std::io::stdout().is_terminal();
    let mut before: HashMap<Key, (u64, u64)> = HashMap::new();
    let mut at = Instant::now();
    loop {
        let rows = select(o);
        let now = Instant::now();
        let secs = now.duration_since(at).as_secs_f64().max(1e-3);
        let rates: HashMap<Key, Rates> = rows
            .iter()
            .filter_map(|c| {
                let (tx0, rx0) = before.get(&key(c))?;
                Some((
                    key(c),
                    Rates {
                        tx: sent(c).saturating_sub(*tx0) as f64 / secs,
                        rx: received(c).saturating_sub(*rx0) as f64 / secs,
                    },
                ))
            })
            .collect();
        if o.json {
            // One array per interval, one line each (JSON lines).
            let v: Vec<_> = rows
                .iter()
                .map(|c| to_json(c, rates.get(&key(c)).copied()))
                .collect();
            println!("{}", serde_json::Value::Array(v));
        } else {
            if clear {
                print!("\x1b[H\x1b[2J");
            }
            println!(
                "azsdp stat: {} connection(s), every {:.1}s (Ctrl-C ends)",
                rows.len(),
                every.as_secs_f64()
            );
            print!("{}", render(&rows, o, &rates));
            println!();
        }
        before = rows
            .iter()
            .map(|c| (key(c), (sent(c), received(c))))
            .collect();
        at = now;
        std::thread::sleep(every);
    }
}

fn filtered(o: &Options) -> bool {
    o.pid.is_some() || o.port.is_some() || o.path.is_some()
}

#[cfg(test)]
mod tests {
    use super::*;
    use azsdp::stats::{ConnPath, TcpReason};

    fn conn(pid: u32, local: &str, peer: &str, path: ConnPath, peer_pid: u32) -> ConnStat {
        ConnStat {
            pid,
            program: "a-program-with-a-long-name".into(),
            role: Role::Client,
            local: local.parse().unwrap(),
            peer: peer.parse().unwrap(),
            peer_pid,
            path,
            fabric: (path != ConnPath::Tcp).then_some("shm"),
            tcp_reason: (path == ConnPath::Tcp).then_some(TcpReason::PeerNotAzsdp),
            zcopy_fallback: None,
            sent_tcp: 0,
            recv_tcp: 0,
            sent_bsdp: 1 << 20,
            sent_async: 0,
            sent_sync: 0,
            recv_bsdp: 0,
            recv_zcopy: 3 << 30,
            avails_outstanding: 0,
            avails_sent: 0,
            gets: 7,
            get_bytes: 0,
            send_faults: 1,
            recv_faults: 2,
            cow_copies: 0,
            cow_lost: 0,
            fallbacks: 0,
            armed_recvs: 0,
            rung: 0,
            copied: {
                let mut c = [0; COPY_REASONS];
                c[CopyReason::Small.index()] = 1000;
                c[CopyReason::Memory.index()] = (1 << 20) - 1000;
                c
            },
            copied_memory: Some(azsdp::conn::Unprotectable::File),
            opened_ms: 0,
        }
    }

    #[test]
    fn filters_select_by_pid_port_and_path() {
        let a = conn(10, "127.0.0.1:5000", "127.0.0.1:6000", ConnPath::Azsdp, 11);
        let b = conn(11, "127.0.0.1:6000", "127.0.0.1:5000", ConnPath::Tcp, 0);
        let o = |f: fn(&mut Options)| {
            let mut o = Options::default();
            f(&mut o);
            o
        };
        assert!(matches(&a, &Options::default()));
        assert!(matches(&a, &o(|o| o.pid = Some(10))) && !matches(&b, &o(|o| o.pid = Some(10))));
        assert!(
            matches(&a, &o(|o| o.port = Some(6000))) && matches(&b, &o(|o| o.port = Some(6000)))
        );
        assert!(!matches(&a, &o(|o| o.port = Some(7000))));
        let tcp = o(|o| o.path = Some("tcp".into()));
        assert!(!matches(&a, &tcp) && matches(&b, &tcp));
    }

    #[test]
    fn tables_say_dash_for_unknown_peers_and_wide_shows_everything() {
        let rows = [
            conn(10, "127.0.0.1:5000", "127.0.0.1:6000", ConnPath::Azsdp, 11),
            conn(12, "127.0.0.1:7000", "10.0.0.1:80", ConnPath::Tcp, 0),
        ];
        let narrow = render(&rows, &Options::default(), &HashMap::new());
        let lines: Vec<&str> = narrow.lines().collect();
        assert_eq!(lines.len(), 3, "{narrow}");
        let col = |line: &str, name: &str| -> String {
            let i = lines[0].split_whitespace().position(|h| h == name).unwrap();
            line.split_whitespace().nth(i).unwrap().to_string()
        };
        assert_eq!(col(lines[1], "PEERPID"), "11");
        assert_eq!(col(lines[2], "PEERPID"), "-");
        assert_eq!(col(lines[2], "WHY"), "peer-not-azsdp");
        assert_eq!(col(lines[1], "RX"), "3.0GiB");
        assert_eq!(col(lines[1], "COPY-WHY"), "memory:file-mapping");
        assert!(narrow.contains("a-program-with") && !narrow.contains("long-name"));
        let wide = render(
            &rows,
            &Options {
                wide: true,
                ..Options::default()
            },
            &HashMap::new(),
        );
        for h in [
            "R-FAULTS",
            "COW-LOST",
            "FALLBACKS",
            "ARMED",
            "GET-BYTES",
            "CP-MEMORY",
            "CP-KIND",
        ] {
            assert!(wide.lines().next().unwrap().contains(h), "{h}: {wide}");
        }
        assert!(wide.contains("a-program-with-a-long-name"));
        let mut rates = HashMap::new();
        rates.insert(
            key(&rows[0]),
            Rates {
                tx: 2048.0,
                rx: 0.0,
            },
        );
        let watched = render(
            &rows,
            &Options {
                watch: Some(Duration::from_secs(1)),
                ..Options::default()
            },
            &rates,
        );
        assert!(watched.contains("2.0KiB/s"), "{watched}");
        let json = to_json(&rows[1], None);
        assert!(json["peer_pid"].is_null(), "{json}");
    }
}
