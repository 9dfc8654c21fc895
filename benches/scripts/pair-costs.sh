#!/bin/bash
# What a connection costs beyond its process's CPU: context switches per
# connection, by thread, and runs of the kernel's Unix garbage collector
# (a kworker each, queued by closes of Unix sockets while one is in flight
# anywhere on the host), over `azsdp-echo many N 1024` against one server
# SHAPE, kernel TCP and both ends under `azsdp run` in turn, a fresh
# server each. (Issue 30, item 5; docs/benchmarks.md, "Ten thousand
# connections at once, by server shape".)
#
#   benches/scripts/pair-costs.sh [N=2000] [SHAPE=serve]
#
# SHAPE: serve (one epoll loop), serve-threads, serve-prefork (4 workers).
# Needs perf (the sched and workqueue tracepoints: root), a release build
# (cargo build --release -p azsdp-shim -p azsdp-daemon --bins) and a hard
# descriptor limit above N + 1000. BIN picks another build's directory.
set -uo pipefail
N=${1:-2000}
SHAPE=${2:-serve}
ROOT=$(cd "$(dirname "$0")/../.." && pwd)
BIN=${BIN:-$ROOT/target/release}
# shellcheck source=echo-server.sh
. "$ROOT/benches/scripts/echo-server.sh"
prepare pair-costs "$N" perf

run() { # MODE: prints the per-connection counts
  record_many "$1" "$SHAPE" "$N" -e sched:sched_switch -e workqueue:workqueue_execute_start || return
  # Switches away from each thread, by process (the server's, the
  # client's, the host's) and thread name; the garbage collector's runs.
  perf script -i "$DIR/perf.data" -F comm,pid,event,trace 2> /dev/null | awk -v srv="$SRV" -v n="$N" -v mode="$1" '
    BEGIN { split(srv, s, ","); for (i in s) server[s[i]] = 1 }
    /workqueue_execute_start/ { if ($0 ~ /__unix_gc/) gc++; next }
    /sched_switch/ {
      split($2, p, "/"); name = $1
      if (name == "swapper") next
      if (name ~ /^kworker/) name = "kworker"
      who = (p[1] in server) ? "server" : (name ~ /^azsdp/) ? "client" : "host"
      c[who " " name]++
    }
    END {
      printf "%-4s %-32s %6.2f\n", mode, "__unix_gc runs", gc / n
      for (k in c) if (c[k] / n >= 0.05) printf "%-4s %-32s %6.2f\n", mode, "switches: " k, c[k] / n
    }' | sort -k2
}

before=$(cut -d' ' -f1-3 /proc/loadavg)
echo "# $N connections at once against azsdp-echo $SHAPE; per connection:"
run tcp
run az
echo "# load $before -> $(cut -d' ' -f1-3 /proc/loadavg)"
