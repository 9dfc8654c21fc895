#!/bin/bash
# Inside the guest (run by ./check): rdma-core's and perftest's own tools on
# rxe0, the two-device wire topology, then azsdp's verbs fabric across it
# (when the test program BIN is given), then real programs under azsdp
# over it (when DIR, holding azsdp and the shim built with verbs, is).
# Each part's time is printed.
#   guest-check.sh [BIN [DIR]]
here=$(dirname "$0")
fails=0
echo "guest kernel $(uname -r)"
ms() { echo $(($(date +%s%N) / 1000000)); }
t=$(ms)
bash "$here/rdma-tools-check.sh" || fails=$((fails + 1))
echo "rdma tools: $(($(ms) - t)) ms"
t=$(ms)
bash "$here/wire-check.sh" || fails=$((fails + 1))
echo "wire topology: $(($(ms) - t)) ms"
if [ -n "${1:-}" ]; then
    t=$(ms)
    bash "$here/verbs-check.sh" "$1" 16 || fails=$((fails + 1))
    echo "verbs fabric: $(($(ms) - t)) ms"
fi
if [ -n "${2:-}" ]; then
    t=$(ms)
    bash "$here/shim-check.sh" "$2" 64 || fails=$((fails + 1))
    echo "programs under azsdp over verbs: $(($(ms) - t)) ms"
    t=$(ms)
    bash "$here/conform-verbs.sh" "$2" "$2/azsdp-sockcheck" || fails=$((fails + 1))
    echo "socket semantics over verbs (sockcheck): $(($(ms) - t)) ms"
fi
exit $fails
