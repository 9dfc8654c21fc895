#!/bin/bash
# apache2 prefork (workers as www-data) serving a 64 KiB file to ab without
# keep-alive: kernel TCP and both ends under `azsdp run`, in turn, ROUNDS
# rounds of ab -n N -c 20, each against a fresh server. Prints each round,
# the medians, their ratio and the load average before and after.
#
#   benches/scripts/apache2-ab.sh [N=20000] [ROUNDS=8] [PORT=18080]
#
# Needs apache2 and apache2-utils (ab), root (apache2 drops to www-data),
# and a release build (cargo build --release -p azsdp-shim -p azsdp-daemon).
set -euo pipefail
N=${1:-20000}
ROUNDS=${2:-8}
PORT=${3:-18080}
ROOT=$(cd "$(dirname "$0")/../.." && pwd)
AZSDP=${AZSDP:-$ROOT/target/release/azsdp}
for t in /usr/sbin/apache2 ab python3 curl; do
  command -v $t > /dev/null || { echo "apache2-ab: $t is missing" >&2; exit 2; }
done
[ -x "$AZSDP" ] || { echo "apache2-ab: no $AZSDP (cargo build --release first)" >&2; exit 2; }
DIR=$(mktemp -d /tmp/azsdp-apache2-ab.XXXXXX)
trap 'pkill -TERM -f "apache2 -f $DIR" 2>/dev/null || true; rm -rf "$DIR"' EXIT
mkdir -p "$DIR/html"
head -c 65536 /dev/urandom > "$DIR/html/small.bin"
chmod -R a+rX "$DIR"
cat > "$DIR/apache2.conf" <<CONF
ServerRoot /usr/lib/apache2
ServerName localhost
LoadModule mpm_prefork_module modules/mod_mpm_prefork.so
LoadModule authz_core_module modules/mod_authz_core.so
User www-data
Group www-data
PidFile $DIR/apache2.pid
ErrorLog $DIR/error.log
Mutex file:$DIR
Listen 127.0.0.1:$PORT
DocumentRoot $DIR/html
StartServers 4
MinSpareServers 4
MaxSpareServers 8
MaxRequestWorkers 32
KeepAlive On
<Directory $DIR/html>
  Require all granted
</Directory>
CONF
export AZSDP_LOG_LEVEL=warn
URL=http://127.0.0.1:$PORT/small.bin
# One round: a fresh server, then ab; prints requests/s.
run() {
  local pre=("$@")
  # (apache2's SIGTERM shutdown signals its process group: its own one.)
  setsid "${pre[@]}" /usr/sbin/apache2 -f "$DIR/apache2.conf" -DFOREGROUND > /dev/null 2>&1 &
  for _ in $(seq 100); do curl -s -o /dev/null "$URL" && break; sleep 0.1; done
  "${pre[@]}" ab -q -n "$N" -c 20 "$URL" 2>&1 | awk '/Requests per second/ {print $4}'
  kill -TERM "$(cat "$DIR/apache2.pid")" 2>/dev/null || true
  for _ in $(seq 100); do pgrep -f "apache2 -f $DIR" > /dev/null || break; sleep 0.1; done
}
echo "load before: $(cut -d' ' -f1-3 /proc/loadavg)"
tcp=(); az=()
for r in $(seq "$ROUNDS"); do
  t=$(run env); a=$(run "$AZSDP" run --)
  tcp+=("$t"); az+=("$a")
  echo "round $r: kernel TCP $t, azsdp $a requests/s"
done
echo "load after: $(cut -d' ' -f1-3 /proc/loadavg)"
python3 - "${tcp[*]}" "${az[*]}" <<'PY'
import statistics, sys
t = [float(x) for x in sys.argv[1].split()]
a = [float(x) for x in sys.argv[2].split()]
mt, ma = statistics.median(t), statistics.median(a)
print(f"median: kernel TCP {mt:.0f}, azsdp {ma:.0f} requests/s ({ma / mt:.2f}x)")
PY
