#!/usr/bin/env bash
# Device runs of issues 23 and 24 (H200, through the device tool, with .whl/ carried: the wheels of
# fastapi, pydantic, uvicorn, pyzmq, msgspec, gguf, openai and their dependencies for Python 3.12).
#   PARTS=tests,alloc,shrink,sweep bash docs/results/h200/issue23/run.sh COMMIT
# tests: the GPU-marked tests of the vmem, KV-cache and engine suites; alloc: vmem's allocator trace
# (python -m vmkv.compare.alloc_peers) at 2 MiB and 32 MiB pages, with and without prefetch;
# shrink (issue 24 item 1): vmem's elastic shrink online, against itself with shrinking off and paged, at
# 24 req/s in one invocation; sweep (issue 24 items 2-3): the request-rate sweep at the paper's KV
# budget (~1.9 GiB at max_model_len 2048) of paged, vmem and the static reservations, one invocation.
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
M="--model llama3-8b --dtype bf16 --max-num-seqs 256 --max-num-batched-tokens 8192 --slo ttft:1000,tpot:50 --warmup-fill-budget --seed 0"
case ",$PARTS," in *,shrink,*)
  timeout 300 python3 -m vmkv.cli compare engine --backends paged,vmem,vmem@kv_shrink_grace_s=inf $M \
    --num-requests 400 --request-rate 24 --input-len sharegpt-in --output-len 64..512 --memory-gib 64 \
    --timeout-s 90 --out $R/shrink24 2>&1 | tee $R/shrink24.log | tail -25 ;; esac
case ",$PARTS," in *,sweep,*)
  timeout 480 python3 -m vmkv.cli compare engine --backends paged,vmem,paged+max,paged+oracle $M \
    --num-requests 40 --input-len lognormal:98,1.0,4,1024 --output-len lognormal:205,1.0,4,1024 \
    --request-rate 2,6 --max-model-len 2048 --memory-gib 1.9 --timeout-s 45 --out $R/sweep-1.9gib \
    2>&1 | tee $R/sweep.log | tail -40 ;; esac
cd $OUT && tar czf issue23.tgz r && rm -rf r
