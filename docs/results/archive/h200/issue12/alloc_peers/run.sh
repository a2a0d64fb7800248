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
build_kvcached() {   # $1: target folder; $2: 1 to guard PageAllocator's start-up print (see kvcheck)
  local src=/tmp/kvc$2
  rm -rf $src "$1" && mkdir -p $src && tar xzf "$P"/kvcached-*.tar.gz -C $src && cd $src/kvcached-* &&
    if [ "$2" = 1 ]; then sed -i 's/^  std::cout << "Init C++ PageAllocator: "/  if (std::getenv("KVCACHED_PRINT_INIT")) std::cout << "Init C++ PageAllocator: "/' csrc/page_allocator.cpp; grep -n KVCACHED_PRINT_INIT csrc/page_allocator.cpp; fi &&
    time $PIP --target "$1" .
}
build_vattention() {   # its setup.py asserts LIBTORCH_PATH exists and adds it to the include path
  rm -rf /tmp/peers/vattention && (cd /tmp/vattn && time LIBTORCH_PATH=$TORCH_INC $PIP --target /tmp/peers/vattention .)
}
BUILD=${BUILD:-"kvcached vattention"}
rm -rf /tmp/vattn && cp -r "$P/vattention" /tmp/vattn
case " $BUILD " in *" kvcached "*)
  build_kvcached /tmp/peers/kvcached 0 > "$O/build_kvcached.log" 2>&1 &
  build_kvcached /tmp/peers/kvcached-guarded 1 > /tmp/build_kvcached_guarded.log 2>&1 & ;; esac
case " $BUILD " in *" vattention "*) build_vattention > "$O/build_vattention.log" 2>&1 & ;; esac
wait
KVC=/tmp/peers/kvcached
export PYTHONPATH=$PWD:/tmp/peers/vattention
vcheck() {   # the shapes init_kvcache returns (vattention.cu builds them from a dangling IntArrayRef)
  timeout 90 python3 -c "
import torch, vattention
torch.empty(1, device='cuda')
t = vattention.init_kvcache(32, 8, 128, 65, 2048, 0, torch.bfloat16, 2 << 20, False)
shapes = [tuple(x.shape) for x in t]
assert shapes == [(65, 2048, 8, 128)] * 64, shapes[:2]
print('vattention ok', shapes[0])"
}
kvcheck() {   # $1: kvcached install; a manager built as in kvcached's own tests, 128 blocks in and out
  PYTHONPATH=$PYTHONPATH:$1 PYTHONFAULTHANDLER=1 timeout 90 python3 -c "
import torch; torch.empty(1, device='cuda')
import kvcached
from kvcached.integration.vllm import interfaces as kvi
from kvcached.kv_cache_manager import KVCacheManager
print('libstdc++ mapped:', sorted({l.split()[-1] for l in open('/proc/self/maps') if 'libstdc++' in l}), flush=True)
kvi.init_kvcached(tp_rank=0, world_size=1, is_worker=True, async_sched=False)
kvi.alloc_kv_cache(kvcache_shape=(2, 10240, 16, 8, 128), block_size=16, dtype=torch.bfloat16, device='cuda:0', num_layers=32)
m = KVCacheManager(num_blocks=10240, block_size=16, cell_size=2048, num_layers=32, world_size=1)
ids = m.alloc(128); m.free(ids)
print('kvcached ok', kvcached.__version__, flush=True)
m.shutdown(); kvi.shutdown_kvcached()"
}
case " $BUILD " in *" vattention "*)
  if ! vcheck >> "$O/build_vattention.log" 2>&1; then
    echo "== check failed: rebuild with 'at::IntArrayRef shape;' -> 'std::vector<int64_t> shape;'" >> "$O/build_vattention.log"
    sed -i 's/at::IntArrayRef shape;/std::vector<int64_t> shape;/' /tmp/vattn/vattention.cu
    build_vattention >> "$O/build_vattention.log" 2>&1
    vcheck >> "$O/build_vattention.log" 2>&1 || echo "== vattention unusable" >> "$O/build_vattention.log"
  fi ;; esac
case " $BUILD " in *" kvcached "*)
  if ! kvcheck $KVC >> "$O/build_kvcached.log" 2>&1; then
    { echo "== kvcheck failed (exit above); libstdc++ of the extension and std::cout exporters:"
      ldd $KVC/kvcached/_C*.so | grep -i 'stdc\|torch\|c10'
      for f in $TORCH_INC/../lib/*.so*; do n=$(nm -D --defined-only "$f" 2>/dev/null | grep -c ' _ZSt4cout$'); [ "$n" != 0 ] && echo "exports std::cout: $f"; done
      echo "== the same with PageAllocator's start-up print guarded (std::cout << int64 at page_allocator.cpp:139)"
      tail -3 /tmp/build_kvcached_guarded.log; } >> "$O/build_kvcached.log" 2>&1
    KVC=/tmp/peers/kvcached-guarded
    kvcheck $KVC >> "$O/build_kvcached.log" 2>&1 || echo "== kvcached unusable" >> "$O/build_kvcached.log"
  fi ;; esac
export PYTHONPATH=$PYTHONPATH:$KVC
tail -4 "$O"/build_*.log

ORDER=${ORDER:-vmem,vattention,kvcached,vmem-per_layer,vattention-megacache,kvcached-sync,kvcached,vattention,vmem}
CMD="python3 -m vmkv.compare.alloc_peers --out $O --allocators $ORDER --deadline-s ${DEADLINE_S:-120} --worker-timeout-s 60 --commit $C"
CMD="$CMD --peer-source vattention=github.com/microsoft/vattention@$V --peer-source kvcached=PyPI-sdist-$(ls "$P" | sed -n 's/^kvcached-\(.*\)\.tar\.gz$/\1/p')$([ $KVC = /tmp/peers/kvcached ] || echo -startup-print-guarded)"
export PYTHONFAULTHANDLER=1
echo "\$ $CMD" > "$O/run.log"
timeout ${BENCH_S:-240} $CMD 2>&1 | tee -a "$O/run.log" | tail -45
