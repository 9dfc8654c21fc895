# Sourced by the scripts that measure `azsdp-echo` servers (scale.sh,
# pair-costs.sh, phase-costs.sh); they set ROOT (the tree) and BIN (the
# build's directory).

# The common start of measuring script NAME with N connections at once:
# perf (if the third argument says so) and the build's binaries present,
# a descriptor limit of N + 1000 (each process holds N connections and a
# few descriptors of its own), the log level, and a scratch directory DIR,
# removed on exit.
prepare() { # NAME N [perf]
  local b want hard
  if [ "${3:-}" = perf ] && ! command -v perf > /dev/null; then
    echo "$1: perf is missing" >&2
    exit 2
  fi
  for b in azsdp azsdp-echo; do
    [ -x "$BIN/$b" ] || { echo "$1: no $BIN/$b (cargo build --release first)" >&2; exit 2; }
  done
  want=$(($2 + 1000))
  hard=$(ulimit -Hn)
  if [ "$hard" != unlimited ] && [ "$hard" -lt "$want" ]; then
    echo "$1: $2 connections need $want descriptors; the hard limit is $hard" >&2
    exit 2
  fi
  ulimit -n "$want"
  export AZSDP_LOG_LEVEL=${AZSDP_LOG_LEVEL:-warn}
  DIR=$(mktemp -d "/tmp/azsdp-$1.XXXXXX")
  trap 'rm -rf "$DIR"' EXIT
}

# Start `azsdp-echo SHAPE` (SHAPE serve-prefork: 4 workers), on kernel
# TCP for MODE tcp or under `azsdp run` for az, on a port below Linux's
# ephemeral range (the client's connections take those); wait until it
# is ready, and make one connection, so that what a process makes once
# is not counted. Sets PRE (the prefix that runs a program the same
# way), PORT and SERVER (the server's pid).
start_echo() { # MODE SHAPE
  local extra='' i
  PRE=''
  PORT=$((20000 + RANDOM % 9000))
  [ "$1" = az ] && PRE="$BIN/azsdp run --"
  [ "$2" = serve-prefork ] && extra=4
  $PRE "$BIN/azsdp-echo" "$2" "$PORT" $extra > "$DIR/srv.out" 2> "$DIR/srv.err" &
  SERVER=$!
  for i in $(seq 50); do grep -q ready "$DIR/srv.out" 2> /dev/null && break; sleep 0.1; done
  $PRE "$BIN/azsdp-echo" send "$PORT" 1000 > /dev/null
}

# `azsdp-echo many N 1024` under `perf record -a PERF-ARGS`, into
# $DIR/perf.data, against a fresh `azsdp-echo SHAPE` (MODE as start_echo's),
# stopped after; sets SRV (the server's pids, comma-separated: a
# pre-forking server's master and its workers). Fails, saying why, if the
# client did.
record_many() { # MODE SHAPE N PERF-ARGS...
  local mode=$1 shape=$2 n=$3
  shift 3
  start_echo "$mode" "$shape"
  SRV=$(pgrep -f "azsdp-echo $shape $PORT" | paste -sd,)
  perf record -q -a "$@" -o "$DIR/perf.data" -- \
    $PRE "$BIN/azsdp-echo" many "$PORT" "$n" 1024 > "$DIR/cli.out" 2> /dev/null
  pkill -f "azsdp-echo $shape $PORT"
  wait 2> /dev/null
  grep -q '"ok":true' "$DIR/cli.out" || { echo "$mode: the client failed: $(cat "$DIR/cli.out")"; return 1; }
}
