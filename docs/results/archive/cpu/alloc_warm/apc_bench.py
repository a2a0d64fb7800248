"""Admission and free of 100 distinct 2048-token prompts with prefix caching on (each prompt's 128
units hashed and looked up, then registered on free), one backend per process: `python apc_bench.py
paged|vmem` (vmem on the host driver with 2 MiB pages; paged 16-token blocks)."""
import random
import sys
import time

from vmkv.compare.shapes import get_shape
from vmkv.kvcache import create_kv_cache

spec = get_shape("llama3-8b").spec(None, "cpu")
backend = sys.argv[1]
extra = {"driver": "host", "page_size_bytes": 2 << 20} if backend == "vmem" else {}
c = create_kv_cache(backend, spec, max_num_seqs=256, max_model_len=2048, memory_bytes=12 << 30,
                    enable_prefix_caching=True, **extra)
rng = random.Random(0)
prompts = [[rng.randrange(32000) for _ in range(2048)] for _ in range(100)]
ta, tf = [], []
for r in range(100):
    t0 = time.perf_counter_ns()
    c.allocate(3000 + r, 2048, prompts[r])
    t1 = time.perf_counter_ns()
    c.free(3000 + r)
    t2 = time.perf_counter_ns()
    ta.append((t1 - t0) / 1e3)
    tf.append((t2 - t1) / 1e3)
ta.sort()
tf.sort()
print(backend, "prefix-caching admission p50 %.1f us, free p50 %.1f us" % (ta[50], tf[50]))
c.close()
