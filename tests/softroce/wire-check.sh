#!/bin/bash
# Inside the guest: the two-device wire topology (topo-wire.sh) carries
# rdma_cm traffic between 198.51.100.1 (rxeA) and 198.51.100.2 (rxeB), and
# both devices' counters show it crossed the veth (it did not collapse onto
# one device's loopback).
set -u
. "$(dirname "$0")/topo-wire.sh"
sent() { rdma statistic show link "$1/1" 2>/dev/null | grep -o 'sent_pkts [0-9]*' | awk '{print $2}'; }
a0=$(sent rxeA); b0=$(sent rxeB)
timeout 60 rping -s -a "$IPA" -C 50 > /tmp/wire.srv 2>&1 &
srv=$!
for _ in $(seq 50); do rdma res show cm_id 2>/dev/null | grep -q LISTEN && break; sleep 0.1; done
timeout 60 rping -c -a "$IPA" -I "$IPB" -C 50 -v > /tmp/wire.cli 2>&1
c=$?
wait $srv
s=$?
a1=$(sent rxeA); b1=$(sent rxeB)
echo "--- wire rping: client rc=$c server rc=$s; sent_pkts rxeA ${a0:-?}->${a1:-?} rxeB ${b0:-?}->${b1:-?}"
tail -n 1 /tmp/wire.cli
[ "$c" = 0 ] && [ "$s" = 0 ] && [ "${a1:-0}" -gt "${a0:-0}" ] && [ "${b1:-0}" -gt "${b0:-0}" ]
