#!/bin/bash
# N connections held at once (issue 30, item 5), in three server shapes:
# `azsdp-echo serve` (one epoll loop), `serve-threads` (a thread per
# connection) and `serve-prefork 4` (pre-forked workers), each against
# `azsdp-echo many PORT N 1024` (connect all, echo 1 KiB on each, close
# all). Kernel TCP and both ends under `azsdp run` in turn, a fresh server
# per run, ROUNDS rounds. Prints per run the phases (ms), the CPU seconds
# of the client and of the server (the listening process; pre-forked
# workers are not counted), then per shape the ratio of the median totals
# and the load average before and after.
#
#   benches/scripts/scale.sh [N=10000] [ROUNDS=2]
#
# SHAPES (default: all three) picks some, e.g. SHAPES=serve-threads.
# Needs a release build (cargo build --release -p azsdp-shim
# -p azsdp-daemon --bins) and a hard descriptor limit above N + 1000.
set -uo pipefail
N=${1:-10000}
ROUNDS=${2:-2}
ROOT=$(cd "$(dirname "$0")/../.." && pwd)
BIN=${BIN:-$ROOT/target/release}
# shellcheck source=echo-server.sh
. "$ROOT/benches/scripts/echo-server.sh"
prepare scale "$N"

# CPU seconds (user + system) of process $1 so far.
cpu() { awk -v hz="$(getconf CLK_TCK)" '{printf "%.2f", ($14 + $15) / hz}' "/proc/$1/stat"; }

run() { # MODE SHAPE: prints "total connect exchange close client_cpu server_cpu"
  start_echo "$1" "$2"
  local s=$SERVER s0 s1
  s0=$(cpu $s)
  # The client's CPU: its subshell's children times (bash's `times`).
  local cc
  cc=$( (
    $PRE "$BIN/azsdp-echo" many "$PORT" "$N" 1024 > "$DIR/cli.out" 2> "$DIR/cli.err"
    times
  ) | tail -1 | awk '{
    split($1, u, /[ms]/); split($2, k, /[ms]/)
    printf "%.2f", u[1] * 60 + u[2] + k[1] * 60 + k[2]
  }')
  s1=$(cpu $s)
  kill $s 2> /dev/null; wait $s 2> /dev/null
  pkill -f "azsdp-echo $2 $PORT" 2> /dev/null
  python3 - "$DIR/cli.out" "$cc" "$s0" "$s1" << 'PY'
import json, sys
try:
    j = json.load(open(sys.argv[1]))
except Exception:
    print("failed"); sys.exit()
if not j.get("ok"):
    print("failed"); sys.exit()
print(j["total_ms"], j["connect_all_ms"], j["exchange_all_ms"], j["close_all_ms"],
      sys.argv[2], "%.2f" % (float(sys.argv[4]) - float(sys.argv[3])))
PY
}

median() { sort -n | awk '{v[NR]=$1} END {print (NR % 2) ? v[(NR+1)/2] : (v[NR/2] + v[NR/2+1]) / 2}'; }

echo "# $N at once; per run: total connect exchange close (ms), client and server CPU (s)"
for shape in ${SHAPES:-serve serve-threads serve-prefork}; do
  before=$(cut -d' ' -f1-3 /proc/loadavg)
  : > "$DIR/tcp"; : > "$DIR/az"
  for r in $(seq "$ROUNDS"); do
    for mode in tcp az; do
      line=$(run $mode $shape)
      echo "$shape $mode $line"
      echo "$line" | cut -d' ' -f1 >> "$DIR/$mode"
    done
  done
  t=$(median < "$DIR/tcp"); a=$(median < "$DIR/az")
  echo "$shape: median total tcp $t ms, azsdp $a ms, azsdp/tcp $(echo "$a / $t" | bc -l | cut -c1-4)x; load $before -> $(cut -d' ' -f1-3 /proc/loadavg)"
done
