#!/bin/bash
# Inside the guest: real programs under `azsdp run`, both ends, paired over
# verbs between the two devices of the wire topology (topo-wire.sh) by the
# rule `fabric = "verbs"` (both addresses are the guest's own). Each run
# checks the bytes (sha256), that both devices' sent_pkts rose (the stream
# crossed the veth, not loopback or shm), and that azsdp's log says the
# connection ran on verbs.
#   shim-check.sh DIR [MIB]     (DIR holds `azsdp` and `libazsdp.so`, built
#                                with the `verbs` feature)
set -u
dir=$1; mib=${2:-64}
azsdp=$dir/azsdp
# (The topology may be up already: guest-check.sh runs verbs-check.sh first.)
if rdma link show rxeA/1 > /dev/null 2>&1; then
    IPA=${IPA:-198.51.100.1} IPB=${IPB:-198.51.100.2}
    ulimit -l unlimited
else
    . "$(dirname "$0")/topo-wire.sh" > /dev/null
fi
sent() { rdma statistic show link "$1/1" 2>/dev/null | grep -o 'sent_pkts [0-9]*' | awk '{print $2}'; }
# Does rxeA offer registration on demand to RDMA READs of RC queue pairs
# (rxe from 6.17)? Then a receiver either registers its destinations on
# demand (FABRIC `verbs...-odp`) or its log says why not (rxe fails the
# endpoint's check of it: it places a READ's bytes wrong).
odp=$(ibv_devinfo -d rxeA -v 2>/dev/null | awk '/rc_odp_caps/ { f = 1; next } /_odp_caps/ { f = 0 } f && /SUPPORT_READ/ { print "yes"; exit }')
echo "registration on demand for READs offered: ${odp:-no}"
odp_said() { # LOG: on demand used, or why not said, where offered
    [ "$odp" != yes ] && return 0
    grep -q '"fabric": *"verbs[-a-z]*-odp"' "$work/stat.json" 2>/dev/null \
        || grep -q "offers registration on demand, but it is not used" "$1"
}
work=$(mktemp -d)
cat > "$work/verbs.toml" <<EOF
fabric = "verbs"
# Emulated RDMA is slow to connect.
pair_timeout = "5s"
EOF
cat > "$work/tcp-only.toml" <<EOF
fabric = "shm"
EOF
export AZSDP_LOG_LEVEL=info
fails=0; port=7700

# check NAME OK DETAIL: print and count.
check() {
    echo "--- $1: $2 ($3)"
    [ "$2" = yes ] || fails=$((fails + 1))
}

head -c $((mib << 20)) /dev/urandom > "$work/in"
want=$(sha256sum < "$work/in" | cut -d' ' -f1)

# socat one way: a file from B to a server on A, in BUF-byte reads and
# writes; `azsdp stat --json` is sampled while it runs.
socat_run() { # CONFIG-FOR-SERVER CONFIG-FOR-CLIENT BUF [plain: server not under azsdp]
    port=$((port + 1))
    rm -f "$work/out" "$work/srv.log" "$work/cli.log" "$work/stat.json"
    local run=("$azsdp" run --)
    [ "${4:-}" = plain ] && run=()
    AZSDP_CONFIG=$1 AZSDP_LOG=$work/srv.log timeout 300 "${run[@]}" \
        socat -u -b $3 TCP-LISTEN:$port,bind=$IPA,reuseaddr OPEN:"$work/out",creat,trunc &
    srv=$!
    for _ in $(seq 100); do ss -ltn | grep -q ":$port " && break; sleep 0.1; done
    AZSDP_CONFIG=$2 AZSDP_LOG=$work/cli.log timeout 300 "$azsdp" run -- \
        socat -u -b $3 OPEN:"$work/in" TCP:$IPA:$port,bind=$IPB &
    cli=$!
    while kill -0 $cli 2>/dev/null; do
        "$azsdp" stat --json > "$work/stat.now" 2>/dev/null \
            && grep -q '"fabric": *"verbs[-a-z]*"' "$work/stat.now" && cat "$work/stat.now" >> "$work/stat.json"
        sleep 0.5
    done
    wait $cli; c=$?
    wait $srv; s=$?
    got=$(sha256sum < "$work/out" 2>/dev/null | cut -d' ' -f1)
    [ $c = 0 ] && [ $s = 0 ] && [ "$got" = "$want" ]
}

# sent BYTES-KIND: bytes the client's close report says went that way.
sent_by() { grep -ho "sent azsdp [0-9]* zsdp [0-9]* bsdp [0-9]*" "$work/cli.log" | head -1 \
    | awk -v k=$1 '{ if (k == "azsdp") print $3; else if (k == "zsdp") print $5; else print $7 }'; }

# 8 KiB reads and writes (socat's default: the copy path, BSDP), then
# 1 MiB (zero-copy: most of it AZ-SDP, the peer's RDMA READs).
for buf in 8192 1048576; do
    t0=$(date +%s.%N); a0=$(sent rxeA); b0=$(sent rxeB)
    socat_run "$work/verbs.toml" "$work/verbs.toml" $buf; r=$?
    a1=$(sent rxeA); b1=$(sent rxeB)
    t=$(echo "$(date +%s.%N) - $t0" | bc)
    zc=$(( $(sent_by azsdp) + $(sent_by zsdp) ))
    ok=no
    [ $r = 0 ] && [ "${a1:-0}" -gt "${a0:-0}" ] && [ "${b1:-0}" -gt $(( ${b0:-0} + 1000 )) ] \
        && grep -q "fabric verbs" "$work/cli.log" && grep -q "fabric verbs" "$work/srv.log" \
        && [ -s "$work/stat.json" ] && ok=yes
    odp_said "$work/srv.log" || ok=no
    [ $buf -gt 65536 ] && [ $zc -lt $(( (mib << 20) / 2 )) ] && ok=no
    check "socat ${mib} MiB B->A over verbs, ${buf}-byte buffers" $ok \
        "${t%???????} s, zero-copy $zc bytes, sent_pkts rxeA +$(( ${a1:-0} - ${a0:-0} )) rxeB +$(( ${b1:-0} - ${b0:-0} ))"
    grep -h "fabric verbs\|tcp (\|sent azsdp\|on demand" "$work/srv.log" "$work/cli.log" | sed 's/^ */    /' | cut -c1-220 | head -6
    grep -o '"fabric": *"verbs[-a-z]*"' "$work/stat.json" 2>/dev/null | sort -u | sed 's/^/    azsdp stat: /'
    [ $ok = yes ] || { tail -n 5 "$work/srv.log" "$work/cli.log" | sed 's/^/    /'; }
done

# iperf3, the README's example (a control connection and a data
# connection, both paired), 1 MiB writes: most bytes zero-copy.
port=$((port + 1))
rm -f "$work/srv.log" "$work/cli.log"
AZSDP_CONFIG=$work/verbs.toml AZSDP_LOG=$work/srv.log timeout 120 "$azsdp" run -- \
    iperf3 -s -1 -B $IPA -p $port > "$work/iperf.srv" 2>&1 &
srv=$!
for _ in $(seq 100); do ss -ltn | grep -q ":$port " && break; sleep 0.1; done
t0=$(date +%s.%N); a0=$(sent rxeA); b0=$(sent rxeB)
AZSDP_CONFIG=$work/verbs.toml AZSDP_LOG=$work/cli.log timeout 120 "$azsdp" run -- \
    iperf3 -c $IPA -B $IPB -p $port -n ${mib}M -l 1M > "$work/iperf.cli" 2>&1
c=$?; wait $srv; s=$?
a1=$(sent rxeA); b1=$(sent rxeB)
t=$(echo "$(date +%s.%N) - $t0" | bc)
zc=$(grep -ho "sent azsdp [0-9]* zsdp [0-9]*" "$work/cli.log" | awk '{n += $3 + $5} END {print n + 0}')
conns=$(grep -c "fabric verbs" "$work/cli.log")
ok=no
[ $c = 0 ] && [ $s = 0 ] && [ "$conns" -ge 2 ] && [ "$zc" -ge $(( (mib << 20) / 2 )) ] \
    && [ "${a1:-0}" -gt "${a0:-0}" ] && [ "${b1:-0}" -gt "${b0:-0}" ] && ok=yes
check "iperf3 -n ${mib}M -l 1M over verbs" $ok \
    "${t%???????} s, $conns connections on verbs, zero-copy $zc bytes, $(grep -h 'sender$' "$work/iperf.cli" | awk '{print $7, $8}')"
[ $ok = yes ] || tail -n 5 "$work/iperf.cli" "$work/cli.log" "$work/srv.log" | sed 's/^/    /'

# redis-server and redis-benchmark (its source address is B's: the wire
# topology routes A's address from B's), replies checked by redis itself.
port=$((port + 1))
rm -f "$work/srv.log" "$work/cli.log"
AZSDP_CONFIG=$work/verbs.toml AZSDP_LOG=$work/srv.log timeout 120 "$azsdp" run -- \
    redis-server --bind $IPA --port $port --protected-mode no --save '' --appendonly no > /dev/null 2>&1 &
srv=$!
for _ in $(seq 100); do ss -ltn | grep -q ":$port " && break; sleep 0.1; done
t0=$(date +%s.%N)
AZSDP_CONFIG=$work/verbs.toml AZSDP_LOG=$work/cli.log timeout 100 "$azsdp" run -- \
    redis-benchmark -h $IPA -p $port -c 4 -n 2000 -t set,get -d 4096 -q > "$work/bench.out" 2>&1
c=$?
t=$(echo "$(date +%s.%N) - $t0" | bc)
conns=$(grep -c "fabric verbs" "$work/srv.log")
AZSDP_LOG=/dev/null "$azsdp" run -- redis-cli -h $IPA -p $port shutdown nosave > /dev/null 2>&1
kill $srv 2>/dev/null; wait $srv 2>/dev/null
ok=no
[ $c = 0 ] && [ "$conns" -ge 4 ] && tr '\r' '\n' < "$work/bench.out" | grep -q "GET: [0-9.]* requests per second" && ok=yes
check "redis-benchmark -c 4 -n 2000 -d 4096 against redis-server over verbs" $ok \
    "${t%???????} s, $conns connections on verbs; $(tr '\r' '\n' < "$work/bench.out" | grep -o "[A-Z]*: [0-9.]* requests per second, p50=[0-9.]* msec" | tr '\n' ' ')"
[ $ok = yes ] || tail -n 5 "$work/bench.out" "$work/cli.log" "$work/srv.log" | sed 's/^/    /'

# Fallbacks: the client stays on TCP, says why, and the bytes arrive.
# A server not under azsdp (rdma_cm finds no listener: the peer's RDMA
# stack rejects), one under azsdp that keeps to shm, and (last) a client
# host without an RDMA device.
fallback() { # NAME SERVER-CONFIG WANT-REASON [plain]
    socat_run "$2" "$work/verbs.toml" 65536 ${4:-}; r=$?
    why=$(grep -ho 'tcp ([a-z-]*)' "$work/cli.log" | head -1)
    ok=no
    [ $r = 0 ] && [ "$why" = "tcp ($3)" ] && ok=yes
    check "$1 stays on TCP" $ok "${why:-no reason logged}, sha256 $([ $r = 0 ] && echo equal || echo DIFFERENT)"
}
fallback "socat to a server not under azsdp" "$work/tcp-only.toml" peer-not-azsdp plain
fallback "socat to a server keeping to shm" "$work/tcp-only.toml" peer-not-azsdp
rdma link delete rxeA; rdma link delete rxeB
fallback "socat from a host without an RDMA device" "$work/verbs.toml" no-rdma-device

rm -rf "$work"
[ $fails = 0 ]
