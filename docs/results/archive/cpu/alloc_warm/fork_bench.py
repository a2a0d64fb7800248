import time, random
from vmkv.kvcache import backend_options_class, create_kv_cache
from vmkv.compare.alloc_adapters import BenchConfig
from vmkv.compare.alloc_vmem import VMemAdapter
cfg = BenchConfig(model="llama3-8b", device="cpu", kv_memory_bytes=12<<30, max_num_seqs=256, max_model_len=2048, vmem_page_size_bytes=2<<20)
a = VMemAdapter(cfg, "megacache"); c = a.cache
rng = random.Random(0)
for i in range(200): c.allocate(i, rng.randint(16, 200))
for i in range(200): c.free(i)
c.allocate(1000, 2048)
ts = []
for r in range(50):
    t0 = time.perf_counter_ns(); c.fork(1000, 2000 + r); ts.append((time.perf_counter_ns() - t0) / 1e3)
    c.free(2000 + r)
ts.sort(); print("fork of 2048 tokens with 200 free slots keeping pages: p50 %.1f us" % ts[len(ts)//2])
c.close()
