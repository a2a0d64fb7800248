import time, random
from vmkv.kvcache import create_kv_cache
from vmkv.compare.shapes import get_shape
spec = get_shape("llama3-8b").spec(None, "cpu")
for backend, extra in (("paged", {}), ("vmem", {"driver": "host", "page_size_bytes": 2 << 20})):
    c = create_kv_cache(backend, spec, max_num_seqs=256, max_model_len=2048, memory_bytes=12 << 30,
                        enable_prefix_caching=False, **extra)
    rng = random.Random(0)
    for i in range(200): c.allocate(i, rng.randint(16, 200))
    for i in range(200): c.free(i)
    c.allocate(1000, 2048)
    res = {}
    for name in ("warm admit", "free", "fork"):
        res[name] = []
    for r in range(50):
        t0 = time.perf_counter_ns(); c.allocate(3000 + r, 2048); t1 = time.perf_counter_ns(); c.free(3000 + r)
        t2 = time.perf_counter_ns(); c.fork(1000, 2000 + r); t3 = time.perf_counter_ns(); c.free(2000 + r)
        res["warm admit"].append((t1 - t0) / 1e3); res["free"].append((t2 - t1) / 1e3); res["fork"].append((t3 - t2) / 1e3)
    print(backend, {k: round(sorted(v)[len(v)//2], 1) for k, v in res.items()})
    c.close()
