#!/bin/bash
# Where a connection's CPU goes, by phase and thread: `azsdp-echo many N
# 1024` against one server SHAPE, with a pause between its connect phase
# and its echo phase (ECHO_PAUSE_MS), kernel TCP and both ends under
# `azsdp run` in turn, a fresh server each. `perf record -a -e cpu-clock`
# samples every CPU; a sample counts for the phase its time falls in (the
# client's main thread sleeps through the pause, which marks it; what the
# server does in the pause is its share of the connect phase, accepts
# that lag behind the connects) and for its process (server, client) and
# thread. Prints microseconds of CPU per connection. (Issue 30, item 5;
# docs/benchmarks.md, "Ten thousand connections at once, by server shape".)
#
#   benches/scripts/phase-costs.sh [N=3000] [SHAPE=serve]
#
# SHAPE: serve (one epoll loop), serve-threads, serve-prefork (4 workers).
# Needs perf (root), a release build (cargo build --release -p azsdp-shim
# -p azsdp-daemon --bins) and a hard descriptor limit above N + 1000. BIN
# picks another build's directory.
set -uo pipefail
N=${1:-3000}
SHAPE=${2:-serve}
ROOT=$(cd "$(dirname "$0")/../.." && pwd)
BIN=${BIN:-$ROOT/target/release}
# shellcheck source=echo-server.sh
. "$ROOT/benches/scripts/echo-server.sh"
prepare phase-costs "$N" perf
HZ=4000

run() { # MODE: prints the per-connection CPU by phase, process and thread
  ECHO_PAUSE_MS=1500 record_many "$1" "$SHAPE" "$N" -e cpu-clock -F $HZ || return
  perf script -i "$DIR/perf.data" -F comm,pid,tid,time 2> /dev/null > "$DIR/samples"
  python3 - "$DIR/samples" "$SRV" "$N" "$1" "$HZ" << 'PY'
import collections, re, sys
path, srv, n, mode, hz = sys.argv[1], set(sys.argv[2].split(",")), int(sys.argv[3]), sys.argv[4], int(sys.argv[5])
rows = []
for line in open(path):
    m = re.match(r"\s*(.+?)\s+(\d+)/(\d+)\s+([\d.]+):", line)
    if m:
        rows.append((m.group(1), m.group(2), m.group(3), float(m.group(4))))
rows = [r for r in rows if r[0] != "swapper"]
# The client's main thread: the busiest thread named azsdp-echo outside
# the server; its longest silence is the pause.
busy = collections.Counter(r[2] for r in rows if r[0] == "azsdp-echo" and r[1] not in srv)
if not busy:
    print(f"{mode}: no client samples"); sys.exit()
main = busy.most_common(1)[0][0]
ts = sorted(r[3] for r in rows if r[2] == main)
gap, at = max((b - a, a) for a, b in zip(ts, ts[1:]))
end = at + gap
us = 1e6 / hz / n
cells = collections.Counter()
for comm, pid, tid, t in rows:
    who = "server" if pid in srv else ("client" if comm.startswith("azsdp") else "host")
    if comm.startswith("kworker"):
        comm = "kworker"
    if who == "client" and tid == main:
        comm = "main"
    elif who == "server" and pid == tid and comm == "azsdp-echo":
        comm = "main" if len(srv) == 1 else "processes"
    elif who == "server" and comm == "azsdp-echo":
        comm = "threads"
    phase = "connect" if t <= at or (t < end and who == "server") else ("pause" if t < end else "echo+close")
    cells[(phase, who, comm)] += 1
    cells[(phase, who, "all")] += 1
for phase in ("connect", "echo+close"):
    for who in ("client", "server", "host"):
        for (p, w, comm), c in sorted(cells.items()):
            if p == phase and w == who and c * us >= 1.0:
                print(f"{mode:<4} {phase:<10} {who:<6} {comm:<20} {c * us:7.1f}")
PY
}

before=$(cut -d' ' -f1-3 /proc/loadavg)
echo "# $N connections at once against azsdp-echo $SHAPE; CPU us per connection:"
echo "# mode phase      process thread                    us"
run tcp
run az
echo "# load $before -> $(cut -d' ' -f1-3 /proc/loadavg)"
