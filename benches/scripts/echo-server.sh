# Sourced by the scripts that measure `azsdp-echo` servers (scale.sh,
# pair-costs.sh, phase-costs.sh); they set BIN (the build's directory) and DIR (a
# scratch directory).

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
