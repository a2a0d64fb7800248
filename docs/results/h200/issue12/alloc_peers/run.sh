#!/bin/bash
# Issue 12 item 5 on the H200: build the peers into /tmp and run `python3 -m vmkv.compare.alloc_peers`.
#
# Runs from a tree of the measured commit (a `git archive` with a COMMIT file) whose parent folder holds the
# peers' sources, never committed: kvcached-*.tar.gz (the PyPI sdist, `pip download --no-deps --no-binary
# :all: kvcached`), vattention/ (the vattention/ folder of github.com/microsoft/vattention) and
# vattention.commit. With the device tool: carry `.peers` and run `cd .peers/tree && bash
# docs/results/h200/issue12/alloc_peers/run.sh`.
set -u
export PYTHONUNBUFFERED=1
P=$(cd .. && pwd)
O=${OUT:-/tmp/out}; mkdir -p "$O"
ln -sfn ../paged vmkv/paged; ln -sfn ../kernels vmkv/kernels; ln -sfn ../compare vmkv/compare
C=$(cat COMMIT 2>/dev/null || echo unknown)
V=$(cat "$P/vattention.commit" 2>/dev/null || echo unknown)
{ echo "commit: $C"; date -u; nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader
  nvcc --version | tail -2; gcc --version | head -1
  python3 -c "import torch; print('torch', torch.__version__, 'cuda', torch.version.cuda)"; } > "$O/env.txt" 2>&1

# builds: both at once, sm_90 only, libcuda from the toolkit's stubs at link time
export TORCH_CUDA_ARCH_LIST=9.0 MAX_JOBS=16
CUDA_HOME=${CUDA_HOME:-/usr/local/cuda}
export LIBRARY_PATH=$CUDA_HOME/lib64/stubs:/usr/local/nvidia/lib64:${LIBRARY_PATH:-}
TORCH_INC=$(python3 -c 'import torch, os; print(os.path.join(os.path.dirname(torch.__file__), "include"))')
PIP="python3 -m pip install -v --no-build-isolation --no-deps --no-index"
build_kvcached() {
  rm -rf /tmp/kvc /tmp/peers/kvcached && mkdir -p /tmp/kvc && tar xzf "$P"/kvcached-*.tar.gz -C /tmp/kvc &&
    time $PIP --target /tmp/peers/kvcached /tmp/kvc/kvcached-*
}
build_vattention() {   # its setup.py asserts LIBTORCH_PATH exists and adds it to the include path
  rm -rf /tmp/peers/vattention && (cd /tmp/vattn && time LIBTORCH_PATH=$TORCH_INC $PIP --target /tmp/peers/vattention .)
}
rm -rf /tmp/vattn && cp -r "$P/vattention" /tmp/vattn
build_kvcached > "$O/build_kvcached.log" 2>&1 &
build_vattention > "$O/build_vattention.log" 2>&1 &
wait
export PYTHONPATH=$PWD:/tmp/peers/kvcached:/tmp/peers/vattention
vcheck() {   # the shapes init_kvcache returns (vattention.cu builds them from a dangling IntArrayRef)
  timeout 90 python3 -c "
import torch, vattention
torch.empty(1, device='cuda')
t = vattention.init_kvcache(32, 8, 128, 65, 2048, 0, torch.bfloat16, 2 << 20, False)
shapes = [tuple(x.shape) for x in t]
assert shapes == [(65, 2048, 8, 128)] * 64, shapes[:2]
print('vattention ok', shapes[0])"
}
if ! vcheck >> "$O/build_vattention.log" 2>&1; then
  echo "== check failed: rebuild with 'at::IntArrayRef shape;' -> 'std::vector<int64_t> shape;'" >> "$O/build_vattention.log"
  sed -i 's/at::IntArrayRef shape;/std::vector<int64_t> shape;/' /tmp/vattn/vattention.cu
  build_vattention >> "$O/build_vattention.log" 2>&1
  vcheck >> "$O/build_vattention.log" 2>&1 || echo "== vattention unusable" >> "$O/build_vattention.log"
fi
python3 -c "import kvcached, kvcached.vmm_ops; print('kvcached ok', kvcached.__version__)" >> "$O/build_kvcached.log" 2>&1
tail -3 "$O/build_kvcached.log" "$O/build_vattention.log"

ORDER=${ORDER:-vmem,vattention,kvcached,vmem-per_layer,vattention-megacache,kvcached-sync,kvcached,vattention,vmem}
CMD="python3 -m vmkv.compare.alloc_peers --out $O --allocators $ORDER --deadline-s ${DEADLINE_S:-120} --worker-timeout-s 60 --commit $C"
CMD="$CMD --peer-source vattention=github.com/microsoft/vattention@$V --peer-source kvcached=PyPI-sdist-$(ls "$P" | sed -n 's/^kvcached-\(.*\)\.tar\.gz$/\1/p')"
echo "\$ $CMD" > "$O/run.log"
timeout ${BENCH_S:-240} $CMD 2>&1 | tee -a "$O/run.log" | tail -45
