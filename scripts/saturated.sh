#!/usr/bin/env bash
# The timing-sensitive tests (ranks as processes, peers killed or stopped, the store, the rxd
# provider) once more with every core kept busy by a spinning loop: their deadlines count time
# without progress, so a slow but live peer must never fail them. Run by `make test`.
set -euo pipefail
cd "$(dirname "$0")/.."
CARGO=${CARGO:-cargo}
tests=(bootstrap fabric_multiproc fabric_rxd_burst ep_normal_host ep_normal_host_multiproc
       ep_ll_host_multiproc ep_hier_host ep_peer_errors_multiproc proxy_fabric proxy_multiproc)
# Both packages: the multi-process tests that run the ep-bench binary are ep-bench's.
args=(-p fabric-ep -p ep-bench)
for t in "${tests[@]}"; do args+=(--test "$t"); done
# Built before the load starts, so the load falls on the tests alone.
$CARGO test --no-run "${args[@]}" >/dev/null 2>&1 || $CARGO test --no-run "${args[@]}"
pids=()
stop() { for p in "${pids[@]}"; do kill "$p" 2>/dev/null || true; done; }
trap stop EXIT
n=$(nproc)
for _ in $(seq 1 "$n"); do
  (while :; do :; done) &
  pids+=($!)
done
echo "saturated: $n busy loops on $n cores"
set +e
$CARGO test "${args[@]}" -- --test-threads=1 >/tmp/fep-saturated.log 2>&1
rc=$?
set -e
grep -E "^test result|FAILED|panicked" /tmp/fep-saturated.log || true
[ "$rc" -eq 0 ] || echo "saturated: a test failed under load (log: /tmp/fep-saturated.log)" >&2
exit "$rc"
