//! A random scenario from a seed: engine settings for both sides, fabric
//! timing, application behaviour and the faults to inject.

use std::time::Duration;

use super::rng::Rng;
use crate::conn::{
    Capabilities, EngineConfig, FaultPolicy, LockRegion, OpError, RecvProtect, Role,
};
use crate::fabric::sim::SimFabricParams;

/// What goes wrong in this run.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Injection {
    None,
    /// Side dies at the given simulated time.
    Kill {
        side: usize,
        at: Duration,
    },
    /// Side's process stops (SIGSTOP) for a while, longer than the peer timeout.
    Stall {
        side: usize,
        at: Duration,
        dur: Duration,
    },
    /// Side's `nth` outgoing message is replaced by garbage.
    Garbage {
        side: usize,
        nth: u64,
    },
    /// Side's `nth` SRC_AVAIL lies about its address or key.
    Lie {
        side: usize,
        nth: u64,
    },
}

impl Injection {
    /// Does this injection end the connection abnormally (so completeness
    /// is not expected)?
    pub fn is_fatal(&self) -> bool {
        !matches!(self, Injection::None)
    }
}

/// Application behaviour for one direction of the stream.
#[derive(Clone, Debug)]
pub struct AppSpec {
    pub messages: u32,
    pub max_len: u64,
    /// Probability that the sender rewrites part of its buffer right after send().
    pub p_touch_send: f64,
    /// Probability that the receiver writes into its buffer before reading it.
    pub p_touch_recv: f64,
    pub p_nonblocking: f64,
    pub p_peek: f64,
    pub p_waitall: f64,
    /// Probability of reusing buffer 0 (the paper's benchmarks reuse one buffer).
    pub p_reuse: f64,
    /// Compute time between operations.
    pub max_compute: Duration,
    /// Probability that a blocking call is interrupted (a signal: EINTR or a
    /// short count), at a random instant within 200 us.
    pub p_cancel: f64,
    /// Probability that the sender frees (or unmaps) its buffer right after
    /// send() returned: in-flight pages must be finished or copied first.
    pub p_free: f64,
}

#[derive(Clone, Debug)]
pub struct Scenario {
    pub seed: u64,
    pub page: [u64; 2],
    pub engine: [EngineConfig; 2],
    pub fabric: SimFabricParams,
    /// Direction 0 is side 0 -> side 1; direction 1 (if any) the reverse.
    pub apps: Vec<AppSpec>,
    pub injection: Injection,
    /// Per-side delay before the progress engine reacts to fabric events.
    pub skew: [(u64, u64); 2],
    /// Probabilities that a host operation fails (registration, arm, copy).
    pub p_prepare_fail: f64,
    pub p_arm_fail: f64,
    pub p_copy_fail: f64,
    /// Buffers in each side's pool: (capacity, protectable).
    pub buffers: [Vec<(u64, bool)>; 2],
    pub time_limit: Duration,
    /// A side leaves the fabric for the TCP connection beneath at this
    /// time (its process execs a program without the shim, say).
    pub switch: Option<(usize, Duration)>,
    /// A side's process `exec`s a program that runs the shim at this
    /// time: its calls stop, its engine parks when quiet and the new
    /// image takes it up after a pause.
    pub exec: Option<(usize, Duration)>,
    /// The connection begins on TCP, and each side's sending direction
    /// joins the fabric at this time (`None`: only when it ends its stream).
    pub join: Option<[Option<Duration>; 2]>,
    /// With `join`: when the listener's side (side 1) allows the client
    /// to join, or (`None`) forbids it (a forked listener: all stays TCP).
    pub allow: Option<Duration>,
    /// A side's process forks and hands the connection to its child (a
    /// fork-per-connection server).
    pub fork: Option<Fork>,
}

/// A fork that hands a side to the child: at `at`, the process settles
/// what is in flight and forks; the application goes on in the child,
/// whose first call comes `child_after` the fork (past the one-second
/// grace on a busy host, sometimes), and the parent closes its copy
/// `parent_after` the fork.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Fork {
    pub side: usize,
    pub at: Duration,
    pub child_after: Duration,
    pub parent_after: Duration,
    /// The parent is killed this long after the fork: while it runs the
    /// side for a child that has not called yet, the child is its heir.
    pub parent_dies: Option<Duration>,
    /// A child that adopted the side execs a program that runs the shim
    /// this long after its first call (sshd's re-exec per connection): its
    /// engine parks once quiet and the parent has closed its copy.
    pub child_execs: Option<Duration>,
}

impl Scenario {
    pub fn from_seed(seed: u64) -> Scenario {
        let mut r = Rng::new(seed);
        let page = [page_size(&mut r), page_size(&mut r)];
        let fabric = SimFabricParams {
            msg_latency: (r.range(200, 2_000), r.range(2_000, 20_000)),
            op_latency: (r.range(500, 3_000), r.range(3_000, 30_000)),
            bytes_per_us: r.range(500, 12_000),
            ring_capacity: r.range(2, 64) as usize,
            death_detect: Duration::from_micros(r.range(10, 2_000)),
            lock_slots: r.range(1, 16) as u16,
            // Set from the scenario's host failures below.
            p_register_fail: 0.0,
            // Half the seeds' failed registrations are the locked-memory
            // limit (by parity: the scenario's other draws stay as they were).
            register_error: if seed.is_multiple_of(2) {
                OpError::PinLimit
            } else {
                OpError::Local
            },
            p_pool_fail: 0.0,
            p_departure_unknown: 0.25,
        };
        let join = join_of(seed);
        let mut engine = [
            engine_config(&mut r, Role::Client, page[0], fabric.lock_slots),
            engine_config(&mut r, Role::Server, page[1], fabric.lock_slots),
        ];
        let fork = fork_of(seed);
        for e in &mut engine {
            e.joins_from_tcp = join.is_some();
            if fork.is_some() {
                // A side frozen by a fork is silent for up to the grace (a
                // second): a peer that closed waits longer than that for
                // its data to be taken, as the shim's default (30 s) does.
                e.linger = Duration::from_secs(5);
            }
        }
        let bidirectional = r.chance(0.4);
        let mut apps = vec![app_spec(&mut r)];
        if bidirectional {
            apps.push(app_spec(&mut r));
        }
        let injection = match r.below(20) {
            0..=1 => Injection::Kill {
                side: r.below(2) as usize,
                at: Duration::from_micros(r.range(1, 20_000)),
            },
            2 => Injection::Stall {
                side: r.below(2) as usize,
                at: Duration::from_micros(r.range(1, 5_000)),
                dur: Duration::from_millis(200),
            },
            3 => Injection::Garbage {
                side: r.below(2) as usize,
                nth: r.range(0, 40),
            },
            4 => Injection::Lie {
                side: r.below(2) as usize,
                nth: r.range(0, 4),
            },
            _ => Injection::None,
        };
        let host_failures = r.chance(0.2);
        let mut buffers = [Vec::new(), Vec::new()];
        for b in &mut buffers {
            for _ in 0..r.range(2, 6) {
                let cap = *r.pick(&[4 << 10, 64 << 10, 1 << 20, (4 << 20) + 8192]);
                b.push((cap, r.chance(0.85)));
            }
        }
        Scenario {
            seed,
            page,
            engine,
            fabric,
            apps,
            injection,
            skew: [(0, r.range(0, 20_000)), (0, r.range(0, 20_000))],
            p_prepare_fail: if host_failures { 0.05 } else { 0.0 },
            p_arm_fail: if host_failures { 0.05 } else { 0.0 },
            p_copy_fail: if host_failures { 0.05 } else { 0.0 },
            buffers,
            time_limit: Duration::from_secs(30),
            switch: switch_of(seed),
            exec: exec_of(seed),
            join,
            allow: allow_of(seed),
            fork,
        }
    }
}

/// One seed in five of those with no switch, exec or join forks a side
/// and hands it to the child (a stream of its own, as for [`switch_of`]).
fn fork_of(seed: u64) -> Option<Fork> {
    if switch_of(seed).is_some() || exec_of(seed).is_some() || join_of(seed).is_some() {
        return None;
    }
    let mut r = Rng::new(seed ^ 0xf0a4_c41d);
    r.chance(1.0 / 5.0).then(|| {
        // Either side of the grace, and now and then right at it.
        let after = |r: &mut Rng| match r.below(4) {
            0 => Duration::from_micros(r.range(0, 1_000)),
            1 => Duration::from_micros(r.range(900_000, 1_100_000)),
            _ => Duration::from_micros(r.range(0, 2_000_000)),
        };
        let mut f = Fork {
            side: r.below(2) as usize,
            at: Duration::from_micros(r.range(1, 20_000)),
            child_after: after(&mut r),
            parent_after: after(&mut r),
            parent_dies: None,
            child_execs: None,
        };
        parent_dies(seed, &mut f);
        child_execs(seed, &mut f);
        f
    })
}

/// One fork in two has the child exec once it adopted the side (a
/// stream of its own, so that the forks' other draws stay as they were):
/// mostly soon, while the parent may still hold its copy (the park waits
/// for its close), sometimes after that.
fn child_execs(seed: u64, f: &mut Fork) {
    let mut r = Rng::new(seed ^ 0xc41d_e8ec);
    if !r.chance(1.0 / 2.0) {
        return;
    }
    f.child_execs = Some(match r.below(4) {
        0 => {
            f.parent_after.saturating_sub(f.child_after) + Duration::from_micros(r.range(1, 5_000))
        }
        _ => Duration::from_micros(r.range(0, 20_000)),
    });
}

/// One fork in three kills the parent (a stream of its own, so that the
/// forks' other draws stay as they were): mostly while it runs the side
/// for a child that has not called yet, its heir (past the grace, which
/// it waited out, before the child's call and its own close); otherwise
/// at any time.
fn parent_dies(seed: u64, f: &mut Fork) {
    let mut r = Rng::new(seed ^ 0x4e1f_dead);
    if !r.chance(1.0 / 3.0) {
        return;
    }
    if !r.chance(0.8) {
        f.parent_dies = Some(Duration::from_micros(r.range(0, 2_000_000)));
        return;
    }
    let grace = 1_000_000;
    let dies = grace + r.range(1_000, 500_000);
    f.child_after = Duration::from_micros(dies + r.range(1_000, 500_000));
    f.parent_after = f.parent_after.max(Duration::from_micros(dies + 1));
    f.parent_dies = Some(Duration::from_micros(dies));
}

/// One seed in six switches to TCP, at a random time, from a random side
/// (drawn from a stream of its own, so the rest of the scenario of a seed
/// stays what it was before switching existed).
fn switch_of(seed: u64) -> Option<(usize, Duration)> {
    let mut r = Rng::new(seed ^ 0x5717_c4ed);
    r.chance(1.0 / 6.0).then(|| {
        let side = r.below(2) as usize;
        (side, Duration::from_micros(r.range(1, 20_000)))
    })
}

/// One seed in five `exec`s a program that takes the connection up
/// (a stream of its own, as for [`switch_of`]; never in a run that also
/// switches).
fn exec_of(seed: u64) -> Option<(usize, Duration)> {
    if switch_of(seed).is_some() {
        return None;
    }
    let mut r = Rng::new(seed ^ 0xe8ec_0a11);
    r.chance(1.0 / 5.0).then(|| {
        let side = r.below(2) as usize;
        (side, Duration::from_micros(r.range(1, 20_000)))
    })
}

/// One seed in four begins on TCP and joins the fabric, each side at a
/// random time of its own (one side in eight only when it ends its
/// stream), with any of the other events (a stream of its own, as for
/// [`switch_of`]).
fn join_of(seed: u64) -> Option<[Option<Duration>; 2]> {
    let mut r = Rng::new(seed ^ 0x701e_7cb0);
    if !r.chance(0.25) {
        return None;
    }
    let mut at = || (!r.chance(0.125)).then(|| Duration::from_micros(r.range(0, 20_000)));
    Some([at(), at()])
}

/// When the listener allows the join (one seed in eight of the joining
/// ones, never: it forbids it).
fn allow_of(seed: u64) -> Option<Duration> {
    let mut r = Rng::new(seed ^ 0xa110_3ed0);
    (!r.chance(0.125)).then(|| Duration::from_micros(r.range(0, 5_000)))
}

fn page_size(r: &mut Rng) -> u64 {
    *r.pick(&[4096, 4096, 4096, 16384])
}

fn engine_config(r: &mut Rng, role: Role, page: u64, slots: u16) -> EngineConfig {
    let mut caps = Capabilities::ALL;
    caps.protect_send = r.chance(0.9);
    caps.arm_recv = r.chance(0.85);
    caps.cas = r.chance(0.9);
    caps.zcopy_source = r.chance(0.95);
    caps.zcopy_sink = r.chance(0.95);
    let mut c = EngineConfig::new(
        role,
        caps,
        LockRegion {
            addr: 0,
            key: 0,
            slots,
        },
    );
    c.page_size = page as u32;
    c.zcopy_threshold = *r.pick(&[1, 1024, 4096, 64 << 10, 1 << 20]);
    c.async_zcopy = r.chance(0.75);
    c.write_fault = if r.chance(0.5) {
        FaultPolicy::Copy
    } else {
        FaultPolicy::Block
    };
    c.block_escalate = Duration::from_micros(*r.pick(&[0, 100, 1_000, 5_000]));
    c.recv_protect = *r.pick(&[RecvProtect::Off, RecvProtect::On, RecvProtect::Auto]);
    c.recv_protect_min = *r.pick(&[4096, 64 << 10, 256 << 10]);
    c.read_ahead = *r.pick(&[0, 0, 64 << 10, 1 << 20, 16 << 20]);
    // (No draw of its own: seeds the tests name keep their scenarios.
    // 64 KiB makes epochs short enough for the gauge to switch often.)
    c.read_ahead_auto = c.read_ahead == 64 << 10;
    c.max_outstanding = r.range(1, 16) as u16;
    c.max_avail_len = *r.pick(&[page as u32, 64 << 10, 1 << 20, 8 << 20]);
    c.fallback_faults = *r.pick(&[0, 1, 2, 4, 8]);
    c.fallback_window = r.range(1, 16) as u32;
    c.fallback_recover = *r.pick(&[0, 1, 4, 16]);
    c.sndbuf = *r.pick(&[4096, 16 << 10, 64 << 10, 1 << 20]);
    c.rx_credits = r.range(1, 32) as u16;
    c.slot_size = *r.pick(&[256, 4096, 16 << 10, 64 << 10]);
    c.peer_timeout = Duration::from_millis(50);
    c.keepalive = Duration::from_millis(10);
    c.linger = Duration::from_millis(500);
    c
}

fn app_spec(r: &mut Rng) -> AppSpec {
    AppSpec {
        messages: r.range(1, 24) as u32,
        max_len: *r.pick(&[64, 8 << 10, 256 << 10, 4 << 20]),
        p_touch_send: *r.pick(&[0.0, 0.2, 0.6, 1.0]),
        p_touch_recv: *r.pick(&[0.0, 0.2, 0.6]),
        p_nonblocking: *r.pick(&[0.0, 0.1, 0.5]),
        p_peek: *r.pick(&[0.0, 0.05, 0.2]),
        p_waitall: *r.pick(&[0.0, 0.3]),
        p_reuse: *r.pick(&[0.0, 0.5, 0.9]),
        max_compute: Duration::from_micros(*r.pick(&[0, 10, 200, 2_000])),
        p_cancel: *r.pick(&[0.0, 0.0, 0.1, 0.3]),
        p_free: *r.pick(&[0.0, 0.0, 0.1, 0.5]),
    }
}
