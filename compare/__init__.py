"""Head-to-head comparisons of the paged and vmem KV backends (``vmkv compare``, ``vmkv bench``).

Modules: ``workloads`` (seeded requests), ``metrics`` (TTFT/TPOT/ITL/E2E, throughput, goodput),
``shapes`` (named model shapes), ``alloc_sim`` + ``alloc_cli`` (GPU-free allocator arithmetic,
``vmkv compare alloc``), ``engine_bench`` + ``engine_worker`` + ``engine_report`` (the engine on both
backends, one fresh process each, ``vmkv compare engine``), ``bench_cli`` (``vmkv bench serve``, a load
client for OpenAI-compatible servers), ``report`` (environment, JSON, tables, markdown, plots),
``kernel_bench`` + ``kernel_bench_peers`` (kernel microbenchmarks with FlashInfer as an optional peer,
``vmkv compare kernels``), ``step_bench`` + ``step_worker`` (decode step vs its bandwidth floor,
``vmkv compare step``), ``worker_proc`` (one fresh process per worker run), ``colocate`` (two servers on one
GPU, ``vmkv compare colocate``), ``alloc_peers`` + ``alloc_trace`` + ``alloc_adapters`` + ``alloc_vmem`` /
``alloc_vattention`` / ``alloc_kvcached`` (vmem vs vAttention and kvcached page mapping: runner and report, seeded
trace, adapter base and registry, one adapter per peer; run as ``python -m vmkv.compare.alloc_peers``),
``cli`` (the dispatcher).
Nothing here imports torch.cuda or the engine at import time.
"""
