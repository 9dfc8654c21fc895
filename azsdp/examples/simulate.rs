//! Run the AZ-SDP protocol engine in deterministic simulation.
//!
//! ```text
//! cargo run --release -p azsdp --example simulate -- --seeds 1000
//! cargo run --release -p azsdp --example simulate -- --seed 42 --verbose
//! ```
//!
//! Each seed is a random scenario (settings, sizes from 1 B to 4 MiB, random
//! alignment, touches of in-flight buffers, delays, peer deaths, garbage)
//! whose invariants are checked; a failing seed is printed and replays
//! exactly with `--seed`.

use clap::Parser;

use azsdp::conn::Counters;
use azsdp::sim::{SimReport, run_seed, run_seeds};

#[derive(Parser, Debug)]
#[command(about = "Run the AZ-SDP engine in deterministic simulation")]
struct Args {
    /// Number of seeds to run.
    #[arg(long, default_value_t = 1000)]
    seeds: u64,
    /// First seed.
    #[arg(long, default_value_t = 0)]
    first: u64,
    /// Run (and print) this one seed only.
    #[arg(long)]
    seed: Option<u64>,
    /// Print one seed's run: scenario, bytes per path, GETs, faults, COWs.
    #[arg(long)]
    verbose: bool,
    /// With --verbose: also print the message trace.
    #[arg(long)]
    trace: bool,
    /// Worker threads (default: available cores).
    #[arg(long)]
    threads: Option<usize>,
}

fn print_counters(side: usize, c: &Counters) {
    println!(
        "  side {side}: sent bsdp {} B, async zero-copy {} B, sync zero-copy {} B | received bsdp {} B, zero-copy {} B",
        c.bytes_sent_bsdp,
        c.bytes_sent_async,
        c.bytes_sent_sync,
        c.bytes_recv_bsdp,
        c.bytes_recv_zcopy
    );
    println!(
        "          GETs {} ({} B), armed receives {}, faults send {} recv {} spurious {}, COW copies {} ({} B) lost {}, fallbacks {} recoveries {}",
        c.gets,
        c.get_bytes,
        c.armed_recvs,
        c.send_faults,
        c.recv_faults,
        c.spurious_faults,
        c.cow_copies,
        c.cow_bytes,
        c.cow_lost,
        c.fallbacks,
        c.recoveries
    );
}

fn print_report(r: &SimReport, trace: bool) {
    let sc = &r.scenario;
    println!(
        "seed {}: {}",
        r.seed,
        if r.passed() { "ok" } else { "FAILED" }
    );
    println!(
        "  injection {:?}; directions {}; pages {:?}; simulated time {:?}; {} events",
        sc.injection,
        sc.apps.len(),
        sc.page,
        r.sim_time,
        r.events
    );
    for (i, e) in sc.engine.iter().enumerate() {
        println!(
            "  side {i}: async {} fault policy {:?} recv-protect {:?} threshold {} max_outstanding {} caps {:?}",
            e.async_zcopy,
            e.write_fault,
            e.recv_protect,
            e.zcopy_threshold,
            e.max_outstanding,
            e.caps
        );
    }
    println!("  end states: {:?} / {:?}", r.states[0], r.states[1]);
    print_counters(0, &r.counters[0]);
    print_counters(1, &r.counters[1]);
    for v in &r.violations {
        println!("  violation: {v}");
    }
    if trace {
        for line in &r.trace {
            println!("    {line}");
        }
    }
}

fn main() {
    let args = Args::parse();
    if let Some(seed) = args.seed {
        let r = run_seed(seed, args.trace);
        print_report(&r, args.trace);
        println!("1 seeds, {} failures", usize::from(!r.passed()));
        std::process::exit(i32::from(!r.passed()));
    }
    let threads = args
        .threads
        .unwrap_or_else(|| std::thread::available_parallelism().map_or(1, |n| n.get()));
    let summary = run_seeds(args.first, args.seeds, threads);
    let (n, failures) = (summary.seeds, &summary.failures);
    for f in failures {
        println!(
            "seed {} FAILED: {}",
            f.seed,
            f.violations.first().map_or("", |s| s.as_str())
        );
        println!(
            "  replay: cargo run --release -p azsdp --example simulate -- --seed {} --verbose --trace",
            f.seed
        );
    }
    if args.verbose {
        let t = &summary.totals;
        println!(
            "all seeds: {} injected failures, {} aborted; {} sends, {} recvs; {} B by BSDP, {} B by AZ-SDP, {} B by ZSDP; {} GETs; {} faults; {} copy-on-writes ({} lost races); {} fallbacks, {} recoveries; {} cancels",
            summary.injected,
            summary.aborted,
            t.sends,
            t.recvs,
            t.bytes_sent_bsdp,
            t.bytes_sent_async,
            t.bytes_sent_sync,
            t.gets,
            t.send_faults + t.recv_faults,
            t.cow_copies,
            t.cow_lost,
            t.fallbacks,
            t.recoveries,
            t.cancels_sent
        );
        println!(
            "  {} connections joined from TCP ({} B sent and {} B taken there first); {} switched to TCP",
            summary.joined, t.tcp_sent_before_join, t.tcp_received_before_join, summary.switched
        );
        let f = &summary.forks;
        println!(
            "  {} forks handed a side to a child: {} adopted by it ({} of those exec'd and took it up again), {} taken back by the parent after the grace, {} moved onto TCP for it",
            f.forked, f.adopted, f.child_execs, f.taken_back, f.moved_for_child
        );
        println!(
            "  {} parents killed while running a side for their child, {} of those heirs carried on over TCP",
            f.heirs, f.heirs_carried_on
        );
        let shown = failures.first().map_or(args.first, |f| f.seed);
        print_report(&run_seed(shown, false), false);
    }
    println!("{n} seeds, {} failures", failures.len());
    std::process::exit(i32::from(!failures.is_empty()));
}
