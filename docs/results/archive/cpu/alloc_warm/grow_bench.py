import time
from vmkv.compare.alloc_adapters import BenchConfig
from vmkv.compare.alloc_vmem import VMemAdapter
cfg = BenchConfig(model="llama3-8b", device="cpu", kv_memory_bytes=4<<30, max_num_seqs=9, max_model_len=2048, vmem_page_size_bytes=2<<20)
a = VMemAdapter(cfg, "megacache")
for i in range(8): a.admit(i, 2048)
for i in range(8): a.free(i)
ts=[]
for rep in range(40):
    a.admit(100+rep, 16)
    for n in range(32, 2048, 16):
        t0=time.perf_counter_ns(); a.grow(100+rep, n); ts.append(time.perf_counter_ns()-t0)
    a.free(100+rep)
ts.sort(); print("boundary grow (kept pages) p50 %.2f us" % (ts[len(ts)//2]/1e3))
a.close()
