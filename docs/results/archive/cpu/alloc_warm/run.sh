#!/bin/bash
# vmem's warm admission and free before (7589b50) and after (99a6d9a) the counting warm paths, on this
# machine's CPU with the host driver and 2 MiB pages (the H200's page size, so the page counts match),
# alternating the two trees three times. Each tree is a `git worktree` with the package links
# (vmkv/paged, vmkv/kernels, vmkv/compare); run from the repository root:
#   bash docs/results/cpu/alloc_warm/run.sh /tmp/base /tmp/new OUTDIR
set -u
OUTDIR=$(realpath $3)
A="--allocators vmem --model llama3-8b --device cpu --kv-memory 6GiB --num-seqs 64 --final-len 384..640 --idle-s 0.2 --vmem-page-size 2MiB"
for i in 1 2 3; do for t in base new; do d=$1; [ $t = new ] && d=$2
  (cd $d && echo "# $(git rev-parse --short HEAD): python -m vmkv.compare.alloc_peers $A" > $OUTDIR/${t}_$i.command.txt &&
   PYTHONPATH=$d timeout 600 python -m vmkv.compare.alloc_peers --out /tmp/aw_$t$i $A --commit $(git rev-parse --short HEAD) > $OUTDIR/${t}_$i.log 2>&1)
  cp /tmp/aw_$t$i/alloc_peers.json $OUTDIR/${t}_$i.json
done; done
