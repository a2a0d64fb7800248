#!/bin/bash
# Issue 12, the allocator peers again after the vmem claim-path work (862f2a7, 9004c04), the reserve kept
# created ahead of need (c210173) and the vmem-prefetch variant (9450e1d): the vmem GPU tests in the
# background while run.sh builds the peers, then one alloc_peers invocation with vmem, vmem-prefetch,
# vAttention and kvcached alternating.  With the device tool: carry `.peers` (holding tree/ = a `git archive`
# with COMMIT, the kvcached sdist, vattention/ and vattention.commit) and run
# `cd .peers/tree && bash docs/results/h200/issue12/alloc_peers/run4.sh`.
set -u
O=${OUT:-/tmp/out}; mkdir -p $O /tmp/o4
ln -sfn ../paged vmkv/paged; ln -sfn ../kernels vmkv/kernels; ln -sfn ../compare vmkv/compare
T=${TESTS:-"tests/test_vmem_cuda.py tests/test_vmem_elastic.py tests/test_vmem_pressure_cuda.py tests/test_vmem_topup.py tests/test_vmem_prefix_cuda.py tests/test_cuda_graphs.py"}
{ echo "# commit $(cat COMMIT)"; echo "\$ python3 -m pytest -q -p no:cacheprovider -rfEs $T"
  PYTHONPATH=$PWD timeout 170 python3 -m pytest -q -p no:cacheprovider -rfEs $T 2>&1 | tail -12; } > /tmp/o4/pytest_gpu.log 2>&1 &
OUT=/tmp/o4 ORDER=${ORDER:-vmem,vmem-prefetch,vattention,kvcached,vmem-prefetch,vmem} DEADLINE_S=${DEADLINE_S:-150} \
  BENCH_S=${BENCH_S:-170} bash docs/results/h200/issue12/alloc_peers/run.sh
wait
cat /tmp/o4/pytest_gpu.log
tar czf $O/results_run4.tgz -C /tmp/o4 .
