#!/bin/bash
# The H200 runs issues 11 and 12 still need, in priority order, one device call per PART (each under the
# 600 s limit; about 30 device-minutes in all). Written on 2026-12-01 by a session that had no device.
#
# From the repository root of a clean checkout of the commit to measure (committed, nothing modified):
#   git rev-parse --short HEAD > COMMIT
#   run(command="PART=1 bash docs/results/h200/next_session.sh", carry=["COMMIT", ".peers", ".whl"])
# .peers (PART=3 only): kvcached-0.1.6.tar.gz (the PyPI sdist), vattention/ (the vattention/ folder of
#   github.com/microsoft/vattention at ef3fff25) and vattention.commit (issue12/alloc_peers/run.sh).
# .whl (PART=4 only): the server's wheels (fastapi, starlette, pydantic, pydantic_core, uvicorn,
#   annotated-types, typing-inspection, opentelemetry-api, annotated-doc; device README).
# Everything lands under $OUT/partN/; copy it to docs/results/h200/issue11|issue12/ with the commit.
#
# PART=1 issue 11: the graph-workspace fix on the GPU (its regression test), then the two offline workloads
#   on both backends with the full-budget warm-up (--warmup-fill-budget: it crashed before the fix) and
#   async scheduling. vmem's `alloc %` column is its critical-path allocation share (target <= 1%).
# PART=2 issue 11 shared-prefix (both backends), then issue 12's shrink off/on on vmem (the 128..512
#   workload, --kv-shrink-grace-s inf beside the default, alternating): "shrinking costs no throughput".
# PART=3 issue 12 allocator peers, run 5 (vmem's counting warm paths 99a6d9a and parked slots cd27a92:
#   warm admission 0.12-0.19 ms at run 4 against vAttention's 0.018): issue12/alloc_peers/run4.sh.
# PART=6 issue 12 spans: PART=1's offline workloads with --max-span-bytes 256MiB (paged beside vmem).
# PART=4 issue 12 co-location long enough that a burst needs more KV than a static split gives (3 bursts
#   of 192 prompts), both backends with client timings.
set -u
export PYTHONUNBUFFERED=1
ln -sfn ../paged vmkv/paged; ln -sfn ../kernels vmkv/kernels; ln -sfn ../compare vmkv/compare
export PYTHONPATH=$PWD VMKV_GIT_COMMIT=$(cat COMMIT)
# results gather in /tmp/res/partN and come back as one tarball (the device returns at most 8 files,
# 2 folders down) plus progress.txt
PART=${PART:-1}; O=/tmp/res/part$PART; mkdir -p $O ${OUT:-/tmp/out}; T0=$(date +%s)
say() { echo "$* at $(( $(date +%s) - T0 )) s" | tee -a $O/progress.txt; }
E="python3 -m vmkv.cli compare engine --model llama3-8b --dtype bf16 --num-requests 256 --input-len 512..2048 --request-rate inf --max-num-seqs 256 --max-num-batched-tokens 8192 --memory-gib 64 --seed 0"
engine() {   # $1: name, $2: timeout (s), rest: flags
  local n=$1 t=$2; shift 2
  mkdir -p $O/$n; { echo "# commit $VMKV_GIT_COMMIT"; echo "\$ $E $*"; } > $O/$n/command.txt
  timeout $t $E "$@" --out /tmp/$n > $O/$n/engine.log 2>&1; say "$n rc=$?"
  cp /tmp/$n/results.json /tmp/$n/summary.md $O/$n/ 2>/dev/null; mkdir -p $O/$n/raw; cp /tmp/$n/raw/*.log $O/$n/raw/ 2>/dev/null
  grep -E "^\| offline \|" $O/$n/summary.md | cut -c1-160 | head -2
}
case $PART in
1)
  { echo "# commit $VMKV_GIT_COMMIT"
    timeout 110 python3 -m pytest -q -p no:cacheprovider -rfEs tests/test_cuda_graphs.py tests/test_kernel_variants_gpu.py 2>&1 | tail -6; } > $O/pytest_gpu.log
  say "pytest"; tail -2 $O/pytest_gpu.log
  engine out256 220 --backends paged,vmem --output-len 256 --timeout-s 95 --async-scheduling --warmup-fill-budget
  engine out128_512 220 --backends paged,vmem --output-len 128..512 --timeout-s 95 --async-scheduling --warmup-fill-budget
  ;;
2)
  engine shared_prefix 230 --backends paged,vmem --workload shared-prefix --shared-prefix-len 1024 --num-prefixes 4 \
    --num-requests 128 --input-len 1280..2048 --output-len 64..256 --timeout-s 95 --async-scheduling --warmup-fill-budget
  for N in off1 on1 off2; do
    A=""; case $N in off*) A="--kv-shrink-grace-s inf" ;; esac
    engine shrink_$N 105 --backends vmem --output-len 128..512 --timeout-s 90 --async-scheduling --warmup-fill-budget $A
  done
  ;;
3)
  rm -rf /tmp/pp && mkdir -p /tmp/pp/tree && cp -r .peers/. /tmp/pp/
  tar --exclude=./.peers --exclude=./.whl -cf - . | tar -xf - -C /tmp/pp/tree
  (cd /tmp/pp/tree && OUT=$O DEADLINE_S=150 BENCH_S=170 timeout 560 bash docs/results/h200/issue12/alloc_peers/run4.sh) > $O/run5.log 2>&1
  say "alloc_peers rc=$?"; tail -12 $O/run5.log
  ;;
6)  # issue 12 spans (max_span_bytes): the offline workload with spans on vmem, paged beside it
  engine out256_span 220 --backends paged,vmem --output-len 256 --timeout-s 95 --async-scheduling --warmup-fill-budget \
    --max-span-bytes 256MiB
  engine out128_512_span 220 --backends vmem --output-len 128..512 --timeout-s 95 --async-scheduling --warmup-fill-budget \
    --max-span-bytes 256MiB
  ;;
5)  # the rest of PART=2's shrink alternation (off1 on1 off2 there): on2 off3 on3
  for N in on2 off3 on3; do
    A=""; case $N in off*) A="--kv-shrink-grace-s inf" ;; esac
    engine shrink_$N 105 --backends vmem --output-len 128..512 --timeout-s 90 --async-scheduling --warmup-fill-budget $A
  done
  ;;
4)
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
  export PYTHONPATH=/tmp/site:$PWD
  for B in vmem paged; do
    C="python3 -m vmkv.cli compare colocate --backend $B --bursts 3 --burst-prompts 192 --input-len 1536..3072 --output-len 128 --max-num-seqs 256 --kv-shrink-grace-s 2 --idle-s 6 --weights-gib 17 --out /tmp/colo_$B"
    { echo "# commit $VMKV_GIT_COMMIT"; echo "\$ $C"; } > $O/colocate_$B.log
    timeout 270 $C >> $O/colocate_$B.log 2>&1; say "colocate $B rc=$?"; tail -8 $O/colocate_$B.log
    cp /tmp/colo_$B/colocate.json $O/colocate_$B.json; cp /tmp/colo_$B/memory.png $O/colocate_$B.png
  done
  ;;
esac
say "done"
tar czf ${OUT:-/tmp/out}/part$PART.tgz -C /tmp/res part$PART; cp $O/progress.txt ${OUT:-/tmp/out}/progress_part$PART.txt
