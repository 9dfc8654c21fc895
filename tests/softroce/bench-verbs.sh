#!/bin/bash
# Inside the guest: azsdp over verbs next to rsockets and kernel TCP, in one
# run, between the two rxe devices of the wire topology (topo-wire.sh).
#
#   bench-verbs.sh DIR [RUNS] [MTU]
#                                DIR: azsdp, libazsdp.so and azsdp-ttcp built
#                                with the verbs feature (tests/softroce/bench
#                                builds them and boots the guest)
#
# The same program, azsdp-ttcp, runs under azsdp in each mode (the
# configurations of `azsdp bench`, plus `fabric = "verbs"`), under rsockets'
# preload (librspreload.so, with rsocket-std.so before it so that a Rust
# std program's sockets are taken), and plain (kernel TCP over the same
# veth). rsockets' own rstream runs as its best case. Each figure is the
# median of RUNS runs (default 5), the stacks taking turns run by run; each
# row's rxe packet counts (all its runs) show which path it took. Emulated
# RDMA is slow and TCP over the veth is not: only the ratios between the
# RDMA rows mean something (docs/benchmarks.md).
set -u
dir=$1; runs=${2:-5}; MTU=${3:-1500}
ttcp=$dir/azsdp-ttcp; azsdp=$dir/azsdp
here=$(cd "$(dirname "$0")" && pwd)
. "$here/topo-wire.sh" > /dev/null
work=$(mktemp -d)
gcc -shared -fPIC -O2 -o "$work/rsocket-std.so" "$here/rsocket-std.c" -ldl || exit 1
rspreload=$(ls /usr/lib/*/rsocket/librspreload.so 2>/dev/null | head -1)
sent() { rdma statistic show link "$1/1" 2>/dev/null | grep -o 'sent_pkts [0-9]*' | awk '{print $2}'; }

modes="tcp rsockets bsdp zsdp azsdp-bow azsdp-cow azsdp-cow-zc azsdp-cow-whole azsdp-cow-ahead azsdp-cow-device"
config() {
    case $1 in
        bsdp) echo 'zcopy_threshold = "1024GiB"' ;;
        zsdp) printf 'async = false\nzcopy_threshold = 4096\n' ;;
        azsdp-bow) printf 'write_fault = "block"\nzcopy_threshold = 4096\n' ;;
        azsdp-cow) printf 'write_fault = "copy"\nzcopy_threshold = 4096\n' ;;
        # (each GET one READ, however long: what rdma_read_piece gains)
        azsdp-cow-whole) printf 'write_fault = "copy"\nzcopy_threshold = 4096\nrdma_read_piece = 0\n' ;;
        # (every receive zero-copy, never reading ahead: what read_ahead =
        # "auto", the default, gains or costs)
        azsdp-cow-zc) printf 'write_fault = "copy"\nzcopy_threshold = 4096\nread_ahead = 0\n' ;;
        # (always reading up to 1 MiB ahead of the receives)
        azsdp-cow-ahead) printf 'write_fault = "copy"\nzcopy_threshold = 4096\nread_ahead = "1MiB"\n' ;;
        # (the lock words changed by the NICs' atomics, rxe's own through
        # the device, every receive zero-copy: against azsdp-cow-zc, what
        # rdma_lock = "auto" saves by taking them by message)
        azsdp-cow-device) printf 'write_fault = "copy"\nzcopy_threshold = 4096\nread_ahead = 0\nrdma_lock = "device"\n' ;;
    esac
    printf 'fabric = "verbs"\npair_timeout = "5s"\n'
}
for m in bsdp zsdp azsdp-bow azsdp-cow azsdp-cow-zc azsdp-cow-whole azsdp-cow-ahead azsdp-cow-device; do config $m > "$work/$m.toml"; done

# run MODE TTCP-ARGS...: one ttcp pair; prints the transmitter's JSON.
port=7900
run() {
    local mode=$1; shift
    port=$((port + 1))
    local pre=()
    case $mode in
        tcp) ;;
        rsockets) pre=(env LD_PRELOAD="$work/rsocket-std.so $rspreload") ;;
        *) pre=(env AZSDP_LOG=/dev/null "$azsdp" run --config "$work/$mode.toml" --) ;;
    esac
    timeout 120 "${pre[@]}" "$ttcp" -r -p $port --json > /dev/null 2>&1 &
    local r=$!
    for _ in $(seq 200); do
        ss -ltn | grep -q ":$port " && break
        # (rsockets listen on the RDMA device, not the kernel's TCP table)
        [ $mode = rsockets ] && rdma res show cm_id 2>/dev/null | grep -q "src-addr.*:$port" && break
        sleep 0.05
    done
    [ $mode = rsockets ] && sleep 0.3
    timeout 120 "${pre[@]}" "$ttcp" -t $IPA -p $port --json "$@" 2>/dev/null | head -1
    wait $r 2>/dev/null
}

# median of the runs' FIELD. (The guest has no /dev/fd: no process
# substitution.)
median() { sort -g | awk '{a[NR] = $1} END {if (NR) print a[int((NR + 1) / 2)]; else print "-"}'; }
field() { grep -o "\"$1\":[0-9.]*" | cut -d: -f2; }

# sample MODE KEY FIELD TTCP-ARGS...: one run, its FIELD appended to
# vals[MODE,KEY] and the rxe packets both devices sent to pk[MODE].
declare -A vals pka pkb
sample() {
    local mode=$1 key=$2 f=$3; shift 3
    local a0 b0; a0=$(sent rxeA); b0=$(sent rxeB)
    vals[$mode,$key]+=" $(run $mode "$@" | field $f)"
    pka[$mode]=$(( ${pka[$mode]:-0} + $(sent rxeA) - a0 ))
    pkb[$mode]=$(( ${pkb[$mode]:-0} + $(sent rxeB) - b0 ))
}
med() { echo ${vals[$1,$2]} | tr ' ' '\n' | grep . | median; }

# Round after round, every stack in turn, so that the emulator's drift
# (the host's load, the guest's caches) falls on all of them alike, not
# on whichever ran last; medians over the rounds.
declare -A res pk
for r in $(seq $runs); do
    for m in $modes; do
        # (128 MiB each, ~5 s: shorter runs are mostly the emulator's noise)
        sample $m t64k gbytes_per_sec -l 65536 -n 2048
        sample $m t1m gbytes_per_sec -l 1048576 -n 128
        sample $m lat latency_us --test latency -l 64 -n 2000
    done
done
for m in $modes; do
    for k in t64k t1m lat; do res[$m,$k]=$(med $m $k); done
    pk[$m]="${pka[$m]}/${pkb[$m]}"
    echo "measured $m: 64K ${res[$m,t64k]} GB/s (runs:${vals[$m,t64k]}), 1M ${res[$m,t1m]} GB/s (runs:${vals[$m,t1m]}), 64B ${res[$m,lat]} us, rxe packets A/B ${pk[$m]}" >&2
done
# The overlap test: compute between 1 MiB sends about as long as ZSDP's
# transfer of one (the paper's point of most overlap).
zsdp=${res[zsdp,t1m]}
compute=$(awk -v g="$zsdp" 'BEGIN { if (g > 0) printf "%d", 1048576 / (g * 1e9) * 1e6; else print 0 }')
for r in $(seq $runs); do
    for m in $modes; do
        sample $m ovl gbytes_per_sec -l 1048576 -n 64 --compute-us $compute
    done
done
for m in $modes; do res[$m,ovl]=$(med $m ovl); done

# rstream, rsockets' own benchmark (blocking rsockets, its best case here).
rs() { # SIZE COUNT
    rstream -T b -S $1 -C $2 > "$work/rs.srv" 2>&1 &
    local s=$!
    sleep 0.5
    rstream -s $IPA -T b -S $1 -C $2 2>/dev/null | awk 'NR > 1 {print $0}' | tail -1
    wait $s 2>/dev/null
}
rs64=$(rs 65536 512); rs1m=$(rs 1048576 48); rs64b=$(rs 64 2000)

# What a pinned registration costs here against a copy of the same size
# (each AZ-SDP advertisement registers its pages, each zero-copy receive
# its destination; rsockets copies into buffers registered once).
regcost=$(gcc -O2 -o "$work/regcost" "$here/probes/regcost.c" -libverbs 2>&1 && "$work/regcost" rxeA 50 2>&1)

gb() { awk -v g="$1" 'BEGIN { if (g == "-" || g == "") print "-"; else printf "%.1f MB/s", g * 1000 }'; }
ratio() { awk -v a="$1" -v b="$2" 'BEGIN { if (a + 0 > 0 && b + 0 > 0) printf "%.2fx", a / b; else print "-" }'; }
echo
echo "guest kernel $(uname -r), $(nproc) vCPUs, veth MTU $MTU (rxe path MTU $(ibv_devinfo -d rxeA 2>/dev/null | awk '/active_mtu/ {print $2; exit}')), load average $(cut -d' ' -f1-3 /proc/loadavg), medians of $runs runs"
echo
echo "| stack | 64 KiB | 1 MiB | 64 B latency | overlap 1 MiB, ${compute} us compute | rxe packets A/B |"
echo "|---|---|---|---|---|---|"
for m in $modes; do
    name=$m
    case $m in
        tcp) name="kernel TCP (veth)" ;;
        rsockets) name="rsockets preload" ;;
        azsdp-cow-whole) name="azsdp azsdp-cow, one READ per GET" ;;
        azsdp-cow-zc) name="azsdp azsdp-cow, no read-ahead" ;;
        azsdp-cow-ahead) name="azsdp azsdp-cow, always read ahead 1 MiB" ;;
        azsdp-cow-device) name="azsdp azsdp-cow, no read-ahead, lock by the devices' atomics" ;;
        *) name="azsdp $m" ;;
    esac
    echo "| $name | $(gb ${res[$m,t64k]}) | $(gb ${res[$m,t1m]}) | ${res[$m,lat]} us | $(gb ${res[$m,ovl]}) | ${pk[$m]} |"
done
echo
echo "rstream (blocking): 64 KiB: ${rs64:-failed}"
echo "rstream (blocking): 1 MiB: ${rs1m:-failed}"
echo "rstream (blocking): 64 B: ${rs64b:-failed}"
echo
echo "$regcost"
echo
best() { # the better of azsdp-bow and azsdp-cow for KEY
    awk -v a="${res[azsdp-bow,$1]}" -v b="${res[azsdp-cow,$1]}" 'BEGIN { print (a + 0 > b + 0 ? a : b) }'
}
echo "AZ-SDP / rsockets, 64 KiB: $(ratio $(best t64k) ${res[rsockets,t64k]}) (goal >= 1); every receive zero-copy: $(ratio ${res[azsdp-cow-zc,t64k]} ${res[rsockets,t64k]})"
echo "AZ-SDP / rsockets, 1 MiB: $(ratio $(best t1m) ${res[rsockets,t1m]}) (goal >= 1)"
echo "AZ-SDP / ZSDP, overlap 1 MiB: $(ratio $(best ovl) ${res[zsdp,ovl]}) (goal >= 1.5)"
echo "AZ-SDP copy-on-write, READs of rdma_read_piece / one READ per GET, 1 MiB: $(ratio ${res[azsdp-cow,t1m]} ${res[azsdp-cow-whole,t1m]})"
echo "AZ-SDP copy-on-write, no read-ahead, lock by message / by the devices' atomics, 64 KiB: $(ratio ${res[azsdp-cow-zc,t64k]} ${res[azsdp-cow-device,t64k]}), 1 MiB: $(ratio ${res[azsdp-cow-zc,t1m]} ${res[azsdp-cow-device,t1m]})"
echo "AZ-SDP copy-on-write, read-ahead auto (default) / none, 64 KiB: $(ratio ${res[azsdp-cow,t64k]} ${res[azsdp-cow-zc,t64k]}), 1 MiB: $(ratio ${res[azsdp-cow,t1m]} ${res[azsdp-cow-zc,t1m]})"
echo "AZ-SDP copy-on-write, always read ahead 1 MiB / none, 64 KiB: $(ratio ${res[azsdp-cow-ahead,t64k]} ${res[azsdp-cow-zc,t64k]}), 1 MiB: $(ratio ${res[azsdp-cow-ahead,t1m]} ${res[azsdp-cow-zc,t1m]})"
rm -rf "$work"
