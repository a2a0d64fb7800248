#!/bin/bash
# Issue 11 item 6 on the lent H200: `vmkv compare kernels` with the FlashInfer peer (B=256, ctx 1K/2K/4K,
# Llama-3-8B heads 32/8/128, bf16), then `vmkv compare step` (eager) on both backends.
# The device copy holds the wheels (flashinfer-python 0.6.0, apache-tvm-ffi) in .whl/ and the committed tree
# (git archive of COMMIT) in .whl/src; run from the repository root there: bash .whl/src/run.sh
set -u
export PYTHONUNBUFFERED=1
W=$PWD/.whl
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site "$W"/*.whl || exit 1
cd "$W/src" || exit 1
ln -sfn ../paged vmkv/paged; ln -sfn ../kernels vmkv/kernels; ln -sfn ../compare vmkv/compare
export PYTHONPATH=$PWD:/tmp/site
O=${OUT:-/tmp/out}; R=/tmp/res; mkdir -p "$O" $R/kernels_flashinfer $R/step_eager
C=$(cat COMMIT); T0=$(date +%s)
{ echo "commit: $C"; date -u; nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader
  nvcc --version | tail -2
  python3 -c "import torch, triton, flashinfer; print('torch', torch.__version__, 'triton', triton.__version__, 'flashinfer', flashinfer.__version__)"
} > $R/env.txt 2>&1
cp $R/env.txt $R/kernels_flashinfer/; cp $R/env.txt $R/step_eager/
# FlashInfer JIT-compiles its modules on first use: two processes compile them ahead, while the kernel bench
# times its own variants (GPU-bound do_bench timings; the FlashInfer variants wait for the compiled modules)
FI=${FI_BACKEND:-fa2}
python3 -m vmkv.compare.kernel_bench_peers --kind prefill --flashinfer-backend $FI > $R/kernels_flashinfer/jit_prefill.log 2>&1 &
python3 -m vmkv.compare.kernel_bench_peers --kind decode --flashinfer-backend $FI > $R/kernels_flashinfer/jit_decode.log 2>&1 &
K="python3 -m vmkv.cli compare kernels --batches 256 --contexts 1024,2048,4096 --prefill-contexts 4096 --block-sizes 16 --flex-points none --dtype bf16 --num-heads 32 --num-kv-heads 8 --head-dim 128 --flashinfer-backend $FI --out /tmp/k"
{ echo "# commit $C"; echo "\$ $K"; } > $R/kernels_flashinfer/command.txt
timeout ${KERNEL_S:-110} $K > $R/kernels_flashinfer/kernels.log 2>&1
echo "kernels rc=$? at $(( $(date +%s) - T0 )) s"
wait
cp /tmp/k/kernel_bench.* $R/kernels_flashinfer/ 2>/dev/null
S="python3 -m vmkv.cli compare step --backends paged,vmem --model llama3-8b --batch-sizes 1,64,256 --context-lens 1024,2048 --enforce-eager --out /tmp/s"
{ echo "# commit $C"; echo "\$ $S"; } > $R/step_eager/command.txt
timeout ${STEP_S:-190} $S > $R/step_eager/step.log 2>&1
echo "step rc=$? at $(( $(date +%s) - T0 )) s"
cp /tmp/s/step_bench.* $R/step_eager/ 2>/dev/null; cp -r /tmp/s/raw $R/step_eager/ 2>/dev/null
# the tree travels without .git: name the commit in the JSON
# (report.environment() walks up to whatever .git the device copy has, so overwrite what it found)
for f in $R/kernels_flashinfer/kernel_bench.json $R/step_eager/step_bench.json; do
  [ -f "$f" ] && python3 -c "import json,sys; p=sys.argv[1]; r=json.load(open(p)); e=r.setdefault('environment',{}); e.update(git_commit=sys.argv[2], git_dirty=None, git_note='the device tree was git archive of this commit (no .git); git_commit set by run.sh'); json.dump(r,open(p,'w'),indent=1)" "$f" "$C"
done
sed -i -E "s/^Commit [0-9a-fNone]+,/Commit $C,/" $R/step_eager/step_bench.md 2>/dev/null
tar czf "$O/results.tgz" -C $R .
cp $R/env.txt "$O/"; cp $R/kernels_flashinfer/kernel_bench.md "$O/" 2>/dev/null; cp $R/step_eager/step_bench.md "$O/" 2>/dev/null
cat $R/env.txt; tail -n 3 $R/kernels_flashinfer/jit_*.log; grep -iE "peer|error|failed" $R/kernels_flashinfer/kernels.log | head -20
cat $R/kernels_flashinfer/kernel_bench.md 2>/dev/null | head -30; tail -25 $R/step_eager/step.log
