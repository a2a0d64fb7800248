#!/bin/bash
set -u
export PYTHONUNBUFFERED=1
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site ../.whl/*.whl || exit 1
ln -sfn ../paged vmkv/paged; ln -sfn ../kernels vmkv/kernels; ln -sfn ../compare vmkv/compare
export PYTHONPATH=/tmp/site:$PWD
O=${OUT:-/tmp/out}; mkdir -p "$O"; C=$(cat COMMIT)
CMD="python3 -m vmkv.cli compare colocate --backend vmem --bursts 2 --burst-prompts 128 --input-len 1536..3072 --output-len 128 --max-num-seqs 256 --kv-shrink-grace-s 2 --idle-s 5 --weights-gib 17 --out /tmp/colo"
{ echo "# commit $C"; echo "\$ $CMD"; } > "$O/colocate_vmem.log"
timeout 150 $CMD 2>&1 | tee -a "$O/colocate_vmem.log" | tail -12
cp /tmp/colo/colocate.json "$O/colocate_vmem.json"; cp /tmp/colo/memory.png "$O/colocate_vmem.png"
