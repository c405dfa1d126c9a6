#!/usr/bin/env bash
# Device run 2 (ninth session), one H200 machine (16 CPU cores), host backend only. Direct vs
# DeepEP's hierarchy with the network rate-capped (ep-bench --emulate-network-gbps: each rank's
# writes to other nodes held to that many GB/s; proxy::Throttled), the node's link uncapped (shm):
# where the NIC is the bottleneck, which routing wins. Network = tcp;ofi_rxm, node = shm, fp8,
# 512 tokens per rank, hidden 7168, top-8 of 256, every result checked.
set -u
B=$PWD/gpu-bundle
export LD_LIBRARY_PATH="$B/lib${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}" PATH=$B/bin:$PATH
L=$OUT/logs; mkdir -p "$L"
S=$L/summary.txt
say() { echo "== $(date +%T) $*" | tee -a "$S"; }
say "start $(head -1 $B/MANIFEST); $(nproc) CPUs"
h() {  # log-name args...
  local n=$1; shift
  local t0=$SECONDS
  timeout 240 $B/bin/ep-bench --backend host --mode normal --fp8 --hierarchy --iters 10 \
    --provider "tcp;ofi_rxm" --intranode-provider shm --tokens 512 "$@" >"$L/hier-$n.log" 2>"$L/hier-$n.err"
  say "ep-bench --hierarchy $* rc=$? ($((SECONDS - t0)) s)"
  grep -E "^normal|^internode|error|Error" "$L/hier-$n.log" "$L/hier-$n.err" | sed 's|^.*/logs/||' | cut -c1-400 | tee -a "$S"
}
for cap in 1.0 0.4 0.2 0.1 0.05; do
  h 8-2x4-cap$cap --ranks 8 --ranks-per-node 4 --emulate-network-gbps $cap
done
for cap in 0.4 0.1 0.05; do
  h 16-2x8-cap$cap --ranks 16 --ranks-per-node 8 --emulate-network-gbps $cap
done
cd "$OUT" && tar czf logs.tgz logs && rm -f logs/*.log logs/*.err
