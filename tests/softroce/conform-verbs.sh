#!/bin/bash
# Inside the guest: the socket semantics programs rely on, over verbs.
# azsdp-sockcheck (tests/programs/sockcheck.rs: plain libc calls, checked
# against kernel TCP by the host's test suite) runs each scenario with
# both ends under `azsdp run` and `fabric = "verbs"`, the server on A's
# address and the client connecting from B (SOCKCHECK_ADDR). A scenario
# passes if both ends exit 0 and the connection ran on verbs. The known
# limits run too, and are reported, but do not fail the suite.
#   conform-verbs.sh DIR SOCKCHECK [SCENARIOS...]
set -u
dir=$1; bin=$2; shift 2
azsdp=$dir/azsdp
# The scenarios expected to behave as on TCP over verbs; each is named with
# what it covers in the host suite (tests/programs/main.rs).
scenarios=${*:-basic nonblock halfclose sigpipe readiness threads signals descriptors \
    batch-calls names eintr-waits bad-args exec exec-bare exec-l spawn system \
    fork-both-use fork-split fork-split-reader-runs fork-idle-holder close-range \
    fork-parent-serves fork-child-serves \
    exit-after-send _exit-after-send dead-peer-blocking dead-peer-epoll}
# Known limits over verbs (docs/shim.md, "Between hosts"): a pre-forked
# server's children accept connections whose RDMA side the parent's
# listener thread took (the first stays on TCP after pair_timeout, the
# listener rejects RDMA requests from then on).
known=${KNOWN-prefork}
[ $# = 0 ] || known=
if rdma link show rxeA/1 > /dev/null 2>&1; then
    IPA=${IPA:-198.51.100.1} IPB=${IPB:-198.51.100.2}
    ulimit -l unlimited
else
    . "$(dirname "$0")/topo-wire.sh" > /dev/null
fi
work=$(mktemp -d)
printf 'fabric = "verbs"\npair_timeout = "5s"\n' > "$work/verbs.toml"
export AZSDP_CONFIG=$work/verbs.toml AZSDP_LOG_LEVEL=info SOCKCHECK_ADDR=$IPA
fails=0; failed=""; port=8100; limits=""
for s in $scenarios $known; do
    is_known=no
    case " $known " in *" $s "*) is_known=yes ;; esac
    port=$((port + 2))
    t0=$(date +%s)
    AZSDP_LOG=$work/$s.srv.log timeout 120 "$azsdp" run -- "$bin" $s server $port > "$work/$s.out" 2>&1 &
    srv=$!
    for _ in $(seq 100); do [ -s "$work/$s.out" ] && break; sleep 0.1; done
    AZSDP_LOG=$work/$s.cli.log timeout 120 "$azsdp" run -- "$bin" $s client $port > "$work/$s.cli.out" 2>&1
    c=$?
    wait $srv; r=$?
    ok=no
    [ $c = 0 ] && [ $r = 0 ] && grep -q "fabric verbs" "$work/$s.cli.log" && ok=yes
    if [ $is_known = yes ]; then
        echo "--- sockcheck $s over verbs (a known limit): $([ $ok = yes ] && echo 'works now' || echo 'still fails') (client rc=$c server rc=$r, $(( $(date +%s) - t0 )) s)"
        [ $ok = yes ] || limits="$limits $s"
        continue
    fi
    echo "--- sockcheck $s over verbs: $ok (client rc=$c server rc=$r, $(( $(date +%s) - t0 )) s)"
    if [ $ok != yes ]; then
        fails=$((fails + 1)); failed="$failed $s"
        tail -n 3 "$work/$s.cli.out" "$work/$s.out" 2>/dev/null | sed 's/^/    /'
        grep -h "tcp (\|reset\|warn" "$work/$s.cli.log" "$work/$s.srv.log" 2>/dev/null | head -4 | cut -c1-200 | sed 's/^/    /'
    fi
done
echo "sockcheck over verbs: $fails failed${failed:+:$failed}${limits:+; known limits:$limits}"
rm -rf "$work"
[ $fails = 0 ]
