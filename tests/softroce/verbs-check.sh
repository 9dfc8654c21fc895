#!/bin/bash
# Inside the guest: the engine over the verbs fabric between the two
# devices of the wire topology (topo-wire.sh), one run per mode, every
# stream checked byte by byte by the receiving process, and both devices'
# sent_pkts must rise in each run (it crossed the veth).
#   verbs-check.sh BIN [MIB] [MODES...]
set -u
bin=$1; mib=${2:-8}; shift 2 2>/dev/null || shift $#
# (`armed`: receive-side protection, the receiver's receives returning
# before their data lands. On 6.1 (no UFFDIO_MOVE) they run synchronously.
# On 6.12 the engine arms a receive's middle pages before it registers its
# head and tail: UFFDIO_MOVE of a huge page with a pinned page never
# returns there.)
# (`copy-msg` takes the copy-on-write lock by message, as on a device
# without atomics; `memlock-tx` and `memlock-rx` run both ends without
# CAP_IPC_LOCK, the sender's or the receiver's locked-memory limit lowered
# once connected.)
# (`remap`: the receiver replaces its buffer's pages under the same
# addresses every few receives (munmap and mmap there, or mmap over it),
# with azsdp's memory hooks called as the shim calls them: registrations
# kept for the old pages must not take the new receives' bytes.)
# (`ahead`: copy-on-write with the receiver reading up to 1 MiB ahead of
# its receives.)
# (Where the device offers registration on demand for READs (rxe on
# 6.17), every mode but `copy-pinned` registers receive destinations on
# demand, and the receiver checks that it did: `memlock-rx` then bounces
# nothing, and `remap`'s kept registrations follow the new pages.
# `copy-pinned` is `copy` with them pinned. rxe offers it but places a
# READ's bytes wrong unless they land whole pages at offset 0, which the
# endpoint's check finds (it then pins): `odp-aligned` sends and receives
# whole pages only, at a path MTU of 4096 (veth MTU 9000), and registers
# on demand without the check, to run the rest of that path, under the
# receiver's lowered locked-memory limit and with its buffer remapped, as
# in `memlock-rx` and `remap`; `odp-armed` the same sizes with armed
# receives.)
modes=${*:-bsdp zsdp block copy copy-pinned odp-aligned odp-armed copy-msg memlock-tx memlock-rx armed remap ahead}
. "$(dirname "$0")/topo-wire.sh" > /dev/null
sent() { rdma statistic show link "$1/1" 2>/dev/null | grep -o 'sent_pkts [0-9]*' | awk '{print $2}'; }
# rxe's retransmissions (a requester's) and duplicates (a responder's),
# both devices: 0 on an in-order wire (topo-wire.sh keeps it in order).
retries() { cat /sys/class/infiniband/rxe[AB]/ports/1/hw_counters/{completer_retry_err,duplicate_request} 2>/dev/null | awk '{n += $1} END {print n + 0}'; }
fails=0; port=7600
mtu() { # MTU: both veth ends, and wait for rxe's path MTU to follow
    ip link set vethA mtu $1; ip link set vethB mtu $1
    local want=1024; [ $1 -ge 4200 ] && want=4096
    for _ in $(seq 50); do
        ibv_devinfo -d rxeA 2>/dev/null | grep -q "active_mtu:.*$want" && return
        sleep 0.1
    done
}
for mode in $modes; do
    port=$((port + 1))
    case $mode in odp-*) mtu 9000 ;; *) mtu ${MTU:-1500} ;; esac
    t0=$(date +%s.%N)
    a0=$(sent rxeA); b0=$(sent rxeB); r0=$(retries)
    pre=()
    case $mode in memlock-*|odp-aligned) pre=(setpriv --bounding-set -ipc_lock) ;; esac
    timeout 300 "${pre[@]}" "$bin" server "$IPA" $port $mode 7 $mib > /tmp/v.srv 2>&1 &
    srv=$!
    for _ in $(seq 100); do grep -q listening /tmp/v.srv 2>/dev/null && break; sleep 0.1; done
    timeout 300 "${pre[@]}" "$bin" client "$IPA" $port $mode 7 $mib "$IPB" > /tmp/v.cli 2>&1
    c=$?
    wait $srv; s=$?
    a1=$(sent rxeA); b1=$(sent rxeB)
    t=$(echo "$(date +%s.%N) - $t0" | bc)
    ok=no
    [ $c = 0 ] && [ $s = 0 ] && [ "${a1:-0}" -gt "${a0:-0}" ] && [ "${b1:-0}" -gt "${b0:-0}" ] && ok=yes
    echo "--- verbs $mode ${mib} MiB: $ok (client rc=$c server rc=$s, ${t%???????} s, sent_pkts rxeA +$(( ${a1:-0} - ${a0:-0} )) rxeB +$(( ${b1:-0} - ${b0:-0} )), rxe retransmissions and duplicates +$(( $(retries) - r0 )))"
    grep -h "received\|sent \|copy-on-write lock\|locked-memory\|destinations\|on demand" /tmp/v.srv /tmp/v.cli | sed "s/^/    /"
    if [ $ok != yes ]; then fails=$((fails + 1)); sed 's/^/    server: /' /tmp/v.srv | tail -5; sed 's/^/    client: /' /tmp/v.cli | tail -5; fi
done
mtu ${MTU:-1500}
# A peer killed mid-stream, on either side: the survivor's call fails
# (ECONNRESET: the dead side's bytes died with it) within a bound, from
# rdma_cm's DISCONNECTED or a failed completion, and never hangs.
for victim in server client; do
    port=$((port + 1))
    t0=$(date +%s)
    timeout 120 "$bin" server "$IPA" $port zsdp 9 1024 > /tmp/k.srv 2>&1 &
    srv=$!
    for _ in $(seq 100); do grep -q listening /tmp/k.srv 2>/dev/null && break; sleep 0.1; done
    timeout 120 "$bin" client "$IPA" $port zsdp 9 1024 "$IPB" > /tmp/k.cli 2>&1 &
    cli=$!
    sleep 3
    # (The program, not the timeout around it.)
    if [ $victim = server ]; then pkill -9 -P $srv; survivor=$cli; else pkill -9 -P $cli; survivor=$srv; fi
    # A survivor still there after 60 s is stuck (a hang seen twice under
    # load): say where each of its threads waits before the timeout ends it.
    for _ in $(seq 600); do kill -0 $survivor 2>/dev/null || break; sleep 0.1; done
    if kill -0 $survivor 2>/dev/null; then
        for pid in $(pgrep -P $survivor); do
            for task in /proc/$pid/task/*; do
                echo "    stuck: thread $(cat $task/comm) waits in $(cat $task/wchan 2>/dev/null):"
                sed 's/^/        /' $task/stack 2>/dev/null | head -12
            done
        done
    fi
    wait $survivor; rc=$?
    if [ $victim = server ]; then wait $srv; else wait $cli; fi
    t=$(( $(date +%s) - t0 ))
    ok=no
    [ $rc != 0 ] && [ $rc != 124 ] && ok=yes
    echo "--- verbs $victim killed mid-stream: $ok (survivor rc=$rc, ${t} s)"
    grep -h "azsdp-verbs-check:" /tmp/k.srv /tmp/k.cli | sed 's/^/    /'
    [ $ok = yes ] || fails=$((fails + 1))
done
[ $fails = 0 ]
