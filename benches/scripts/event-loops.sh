#!/bin/bash
# Event-loop servers and their clients, kernel TCP and both ends under
# `azsdp run` (and, with BASE=path/to/another/azsdp, that build too), in
# turn, a fresh server per run, ROUNDS rounds:
#   redis-server / redis-benchmark -t get (-c 1, -c 1 -P 16, -c 50, -c 50 -P 16)
#   memcached -t T / memcaslap -T CT -c C -t 5s (1/1/16, 2/2/32, 4/2/32)
#   nginx with W workers (1, 2) serving 4 KiB to ab -k -c 10 -n 200000
# Prints one line per program and shape: the figures of each build, in
# the order TCP, [BASE,] this build, and the load average before and after;
# with ROUNDS > 1, then per row the median of each build and this build's
# ratio to TCP: of the medians, and the lowest and highest of a round (on
# a loaded host one round swings more than the builds differ).
#
#   benches/scripts/event-loops.sh [ROUNDS=1]
#
# Needs redis-server, redis-tools, memcached, libmemcached-tools, nginx,
# apache2-utils (ab), root (nginx's workers drop to www-data), and a
# release build (cargo build --release -p azsdp-shim -p azsdp-daemon).
set -uo pipefail
ROUNDS=${1:-1}
ROOT=$(cd "$(dirname "$0")/../.." && pwd)
AZSDP=${AZSDP:-$ROOT/target/release/azsdp}
BASE=${BASE:-}
for t in redis-server redis-benchmark memcached memcaslap nginx ab; do
  command -v $t > /dev/null || { echo "event-loops: $t is missing" >&2; exit 2; }
done
[ -x "$AZSDP" ] || { echo "event-loops: no $AZSDP (cargo build --release first)" >&2; exit 2; }
DIR=$(mktemp -d /tmp/azsdp-event-loops.XXXXXX)
trap 'rm -rf "$DIR"' EXIT
chmod 755 "$DIR"

# The prefix that runs a program under build $1 ("tcp": none).
under() { [ "$1" = tcp ] && return; echo "$1 run --"; }
port() { echo $((30000 + RANDOM % 2000)); }

redis() { # BUILD C P N
  local p; p=$(port)
  $(under "$1") redis-server --port "$p" --save '' --appendonly no > /dev/null 2>&1 &
  local s=$!
  sleep 0.4
  $(under "$1") redis-benchmark -p "$p" -t get -q -c "$2" -P "$3" -n "$4" 2> /dev/null \
    | grep -o "[0-9.]* requests per second" | head -1 | cut -d' ' -f1
  kill $s; wait $s 2> /dev/null
}

memcached_run() { # BUILD T CT C
  local p; p=$(port)
  $(under "$1") memcached -u root -t "$2" -p "$p" -U 0 -l 127.0.0.1 &
  local s=$!
  sleep 0.5
  $(under "$1") memcaslap -s "127.0.0.1:$p" -T "$3" -c "$4" -t 5s 2>&1 \
    | grep -o "TPS: [0-9]*" | tail -1 | cut -d' ' -f2
  kill $s; wait $s 2> /dev/null
}

nginx_run() { # BUILD WORKERS
  local p d; p=$(port); d=$(mktemp -d "$DIR/nginx.XXXXXX")
  mkdir -p "$d/html"; head -c 4096 /dev/urandom > "$d/html/f.bin"; chmod -R a+rX "$d"
  cat > "$d/nginx.conf" << CONF
worker_processes $2;
daemon off;
pid $d/nginx.pid;
error_log $d/error.log;
events { worker_connections 4096; }
http { access_log off; server { listen 127.0.0.1:$p; root $d/html; keepalive_requests 1000000; } }
CONF
  setsid $(under "$1") nginx -c "$d/nginx.conf" &
  local s=$!
  sleep 0.5
  $(under "$1") ab -k -q -n 200000 -c 10 "http://127.0.0.1:$p/f.bin" 2>&1 \
    | grep -o "Requests per second: *[0-9.]*" | grep -o "[0-9.]*$"
  if grep -q "failed (13" "$d/error.log"; then echo "event-loops: nginx could not read its file" >&2; fi
  kill -QUIT $s 2> /dev/null; sleep 0.3; kill -9 -- -$s 2> /dev/null; wait $s 2> /dev/null
}

builds=(tcp)
[ -n "$BASE" ] && builds+=("$BASE")
builds+=("$AZSDP")
row() { # NAME FUNCTION ARGS...
  local name=$1; shift
  local f=$1; shift
  local out="$name:"
  local b v
  # (A run that printed nothing counts 0, so that the columns stay.)
  for b in "${builds[@]}"; do v=$($f "$b" "$@"); out="$out ${v:-0}"; done
  echo "$out"
  echo "$out" >> "$DIR/rows"
}

# Per row name (in first-seen order): each build's median over the rounds,
# and this build's ratio to TCP (the medians', and the range of rounds').
medians() {
  awk -F': ' '
    !($1 in seen) { seen[$1] = 1; order[++rows] = $1 }
    { n = split($2, v, " "); k = ++count[$1]; cols[$1] = n
      for (i = 1; i <= n; i++) val[$1, i, k] = v[i]
      if (v[1] > 0) { r = v[n] / v[1]
        if (!(($1) in lo) || r < lo[$1]) lo[$1] = r
        if (!(($1) in hi) || r > hi[$1]) hi[$1] = r } }
    function median(name, col,   m, i, j, t, a) {
      m = count[name]
      for (i = 1; i <= m; i++) a[i] = val[name, col, i] + 0
      for (i = 2; i <= m; i++) for (j = i; j > 1 && a[j - 1] > a[j]; j--) {
        t = a[j]; a[j] = a[j - 1]; a[j - 1] = t }
      return (m % 2) ? a[(m + 1) / 2] : (a[m / 2] + a[m / 2 + 1]) / 2
    }
    END { for (o = 1; o <= rows; o++) { name = order[o]; n = cols[name]; out = ""
      for (i = 1; i <= n; i++) { md[i] = median(name, i); out = out sprintf(" %.0f", md[i]) }
      printf "median %s:%s (%.2fx; rounds %.2f-%.2fx)\n", name, out,
        (md[1] > 0) ? md[n] / md[1] : 0, lo[name], hi[name] } }
  ' "$DIR/rows"
}

echo "load before: $(cut -d' ' -f1-3 /proc/loadavg); builds: ${builds[*]}"
for r in $(seq 1 "$ROUNDS"); do
  echo "round $r"
  row "redis -c 1" redis 1 1 100000
  row "redis -c 1 -P 16" redis 1 16 1000000
  row "redis -c 50" redis 50 1 300000
  row "redis -c 50 -P 16" redis 50 16 3000000
  row "memcached -t 1, -T 1 -c 16" memcached_run 1 1 16
  row "memcached -t 2, -T 2 -c 32" memcached_run 2 2 32
  row "memcached -t 4, -T 2 -c 32" memcached_run 4 2 32
  row "nginx 1 worker" nginx_run 1
  row "nginx 2 workers" nginx_run 2
done
[ "$ROUNDS" -gt 1 ] && medians
echo "load after: $(cut -d' ' -f1-3 /proc/loadavg)"
