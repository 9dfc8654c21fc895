#!/bin/bash
# Inside the guest (run by ./check): rdma-core's and perftest's own tools on
# rxe0, then the two-device wire topology. Each part's time is printed.
here=$(dirname "$0")
fails=0
ms() { echo $(($(date +%s%N) / 1000000)); }
t=$(ms)
bash "$here/rdma-tools-check.sh" || fails=$((fails + 1))
echo "rdma tools: $(($(ms) - t)) ms"
t=$(ms)
bash "$here/wire-check.sh" || fails=$((fails + 1))
echo "wire topology: $(($(ms) - t)) ms"
exit $fails
