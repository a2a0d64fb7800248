"""Head-to-head comparisons of the paged and vmem KV backends (``vmkv compare``, ``vmkv bench``).

Modules: ``workloads`` (seeded requests), ``metrics`` (TTFT/TPOT/ITL/E2E, throughput, goodput),
``alloc_sim`` (GPU-free allocator arithmetic), ``engine_bench`` + ``engine_worker`` (the engine on both
backends, one fresh process each), ``bench_cli`` (load client for OpenAI-compatible servers),
``report`` (tables, JSON, markdown, plots), ``kernel_bench`` (kernel microbenchmarks).
Nothing here imports torch.cuda or the engine at import time.
"""
