#!/usr/bin/env bash
# Device runs of issues 23 and 24 (H200, through the device tool, with .whl/ carried: the wheels of
# fastapi, pydantic, uvicorn, pyzmq, msgspec, gguf, openai and their dependencies for Python 3.12).
#   PARTS=tests,alloc bash docs/results/h200/issue23/run.sh COMMIT
# tests: the GPU-marked tests of the vmem, KV-cache and engine suites; alloc: vmem's allocator trace
# (python -m vmkv.compare.alloc_peers) at 2 MiB and 32 MiB pages, with and without prefetch.
set -o pipefail
C=$1; PARTS=${PARTS:-tests,alloc}
export PYTHONUNBUFFERED=1
python3 -V; nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl || exit 1
for d in compare paged kernels; do ln -sfn ../$d vmkv/$d; done
export PYTHONPATH=/tmp/site:$PWD VMKV_GIT_COMMIT=$C
R=$OUT/r; mkdir -p $R
case ",$PARTS," in *,tests,*)
  timeout 330 python3 -m pytest -q -p no:cacheprovider -m gpu -k "vmem or graph or kvcache or prefix or engine or async" \
    tests/ 2>&1 | tee $R/gpu_tests.log | tail -15 ;; esac
case ",$PARTS," in *,alloc,*)
  timeout 240 python3 -m vmkv.compare.alloc_peers --out $R/alloc_peers --commit $C \
    --allocators vmem,vmem-32MiB,vmem-prefetch,vmem-32MiB-prefetch,vmem-per_layer,vmem-prealloc \
    2>&1 | tee $R/alloc_peers.log | tail -40 ;; esac
cd $OUT && tar czf issue23.tgz r && rm -rf r
