//! `azsdp stat`: the host's live azsdp connections.

use azsdp::conn::Role;
use azsdp::stats::{ConnStat, dirs_to_read, read_dirs};
use serde_json::json;

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

fn to_json(c: &ConnStat) -> serde_json::Value {
    json!({
        "pid": c.pid,
        "program": c.program,
        "role": role(c.role),
        "local": c.local.to_string(),
        "peer": c.peer.to_string(),
        "peer_pid": c.peer_pid,
        "path": c.path.name(),
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
    })
}

pub fn print(json: bool) {
    let rows = read_dirs(&dirs_to_read());
    if json {
        let v: Vec<_> = rows.iter().map(to_json).collect();
        println!("{}", serde_json::Value::Array(v));
        return;
    }
    if rows.is_empty() {
        println!("no azsdp connections");
        return;
    }
    println!(
        "{:>7} {:<14} {:<6} {:<22} {:<22} {:>7} {:<6} {:<15} {:>9} {:>9} {:>9} {:>9} {:>9} {:>5} {:>7} {:>6} {:>5}",
        "PID",
        "PROGRAM",
        "ROLE",
        "LOCAL",
        "PEER",
        "PEERPID",
        "PATH",
        "WHY",
        "TX-AZSDP",
        "TX-ZSDP",
        "TX-BSDP",
        "TX-TCP",
        "RX",
        "AVAIL",
        "GETS",
        "FAULTS",
        "COWS"
    );
    for c in &rows {
        let why = c
            .tcp_reason
            .map(|r| r.name())
            .or(c.zcopy_fallback)
            .unwrap_or("-");
        println!(
            "{:>7} {:<14} {:<6} {:<22} {:<22} {:>7} {:<6} {:<15} {:>9} {:>9} {:>9} {:>9} {:>9} {:>5} {:>7} {:>6} {:>5}",
            c.pid,
            c.program.chars().take(14).collect::<String>(),
            role(c.role),
            c.local.to_string(),
            c.peer.to_string(),
            c.peer_pid,
            c.path.name(),
            why,
            human(c.sent_async),
            human(c.sent_sync),
            human(c.sent_bsdp),
            human(c.sent_tcp),
            human(c.recv_zcopy + c.recv_bsdp + c.recv_tcp),
            c.avails_outstanding,
            c.gets,
            c.send_faults + c.recv_faults,
            c.cow_copies,
        );
    }
}
