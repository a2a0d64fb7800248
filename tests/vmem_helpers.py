"""Helpers the vmem test files share (test_vmem_cache.py, test_vmem_batching.py, test_vmem_cuda.py,
test_vmem_layout.py, test_vmem_pressure_cuda.py).

Each file keeps its own ``SPEC`` (host fp32 or CUDA bf16); the helpers take it as an argument.
A test module that imports :func:`checked_drivers` gets every driver a cache makes for itself
wrapped in the checked driver (``tests/checked_driver.py``) (production uses the thin driver).
"""

from __future__ import annotations

import importlib
import math
import random
from collections.abc import Callable

import pytest
import torch

from vmkv import KVCacheFullError, KVCacheSpec
from vmkv.vmem import backing as vmem_backing
from checked_driver import CheckedDriver
from vmkv.vmem.backing import get_driver


@pytest.fixture(autouse=True)
def checked_drivers(monkeypatch):
    """Autouse where imported: a cache made with ``driver="auto"|"host"|"cuda"`` gets its driver
    wrapped in :class:`CheckedDriver` (every call validated, a mapping table to check against)."""
    monkeypatch.setattr(vmem_backing, "get_driver", lambda *a, **kw: CheckedDriver(get_driver(*a, **kw)))


def random_kv(spec: KVCacheSpec, n: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Seeded random K and V, each ``[n, num_kv_heads, head_dim]`` of ``spec.dtype`` on ``spec.device``
    (drawn in float32 with a generator on that device, then cast)."""
    g = torch.Generator(device=spec.device).manual_seed(seed)
    shape = (n, spec.num_kv_heads, spec.head_dim)
    return (torch.randn(shape, generator=g, device=spec.device).to(spec.dtype),
            torch.randn(shape, generator=g, device=spec.device).to(spec.dtype))


def prompt_values(spec: KVCacheSpec, prompt, layer: int) -> torch.Tensor:
    """K of each prompt position, ``float32 [len(prompt), num_kv_heads, head_dim]``: a function of the
    tokens up to it (and the layer), as in a decoder, so a prefix hit can be checked against the K/V
    any request with that prefix wrote (the fuzzers write V = -K)."""
    out, h = [], 0
    for t in prompt:
        h = (h * 31 + t + 1) % 9973
        out.append(float(h) + 0.25 * layer)
    return torch.tensor(out).view(-1, 1, 1).expand(len(prompt), spec.num_kv_heads, spec.head_dim).clone()


def write_all(c, spec: KVCacheSpec, seq: int, start: int, n: int, seed: int) -> dict:
    """Write random K/V at positions ``[start, start + n)`` of every layer of ``seq`` with ``c.write``;
    returns ``{layer: (k, v)}`` as written."""
    out = {}
    for layer in range(spec.num_layers):
        k, v = random_kv(spec, n, seed * 100 + layer)
        c.write(seq, layer, start, k, v)
        out[layer] = (k, v)
    return out


def random_op(c, rng: random.Random, tokens: dict[int, list[int]], next_id: int,
              prefixes: list[list[int]], max_len: int, write_range: Callable[[int, int, int], None],
              new_token: Callable[[], int], check_can_allocate: bool = False) -> int | None:
    """One seeded random allocate / extend / fork / free on ``c`` (allocate and extend twice as likely).

    ``tokens`` maps each live sequence to its token ids and is updated in place; ``write_range(seq,
    start, end)`` writes K/V of the new positions (after ``tokens`` is updated); ``new_token()`` gives
    an appended token id.  A ``KVCacheFullError`` propagates (the caller checks state is unchanged);
    with ``check_can_allocate`` an allocate refused after ``can_allocate`` said yes fails the test.
    Returns the next unused sequence id, or None when the drawn extend would pass ``max_len`` and
    nothing was done (callers skip the rest of that iteration).
    """
    op = rng.choice(["alloc", "alloc", "extend", "extend", "fork", "free"])
    live = list(tokens)
    ut = c.unit_tokens
    if op == "alloc" or not live:
        n = rng.randint(1, 4 * ut)
        ids = (rng.choice(prefixes) + [rng.randrange(50) for _ in range(n)])[:n]
        fits = c.can_allocate(n) if check_can_allocate else True
        try:
            hit = c.allocate(next_id, n, ids)
        except KVCacheFullError:
            assert not (check_can_allocate and fits), "can_allocate said yes, allocate refused"
            raise
        assert hit % ut == 0 and hit < n
        tokens[next_id] = ids
        write_range(next_id, hit, n)
        return next_id + 1
    if op == "extend":
        seq = rng.choice(live)
        k = rng.randint(1, ut + 2)
        if len(tokens[seq]) + k > max_len:
            return None
        old = len(tokens[seq])
        c.extend(seq, k)
        tokens[seq] = tokens[seq] + [new_token() for _ in range(k)]
        write_range(seq, old, old + k)
        return next_id
    if op == "fork":
        parent = rng.choice(live)
        c.fork(parent, next_id)
        tokens[next_id] = list(tokens[parent])
        return next_id + 1
    seq = rng.choice(live)
    c.free(seq)
    del tokens[seq]
    return next_id


# ---------------------------------------------------------------------------- kernel launch pointers
#: every Triton kernel that receives a cache view: (module, attribute)
KERNELS = (("vmkv.kernels.write_kv", "_write_kv_kernel"),
           ("vmkv.kernels.decode_attention", "_decode_split_kernel"),
           ("vmkv.kernels.decode_attention", "_decode_reduce_kernel"),
           ("vmkv.kernels.prefill_attention", "_prefill_kernel"))


class _CheckedKernel:
    """Stands in for a jitted kernel: before each launch, checks every tensor argument's ``data_ptr``
    against ``driver``'s mapping table the way Triton's launcher checks it with
    ``cuPointerGetAttribute`` (an address in a reserved but unmapped page is refused with the
    launcher's own message), records it, then launches the real kernel."""

    def __init__(self, kernel, name: str, driver, launches: list) -> None:
        self.kernel, self.name, self.driver, self.launches = kernel, name, driver, launches

    def __getitem__(self, grid):
        launch = self.kernel[grid]

        def run(*args, **kwargs):
            for i, arg in enumerate(list(args) + list(kwargs.values())):
                if isinstance(arg, torch.Tensor) and arg.data_ptr():
                    state = self.driver.page_state(arg.data_ptr())
                    self.launches.append((self.name, i, state))
                    if state not in ("outside", "mapped", "guard"):
                        raise ValueError(f"Pointer argument (at {i}) cannot be accessed from Triton "
                                         f"(cpu tensor?) [{self.name}: {arg.data_ptr():#x} is {state}]")
            return launch(*args, **kwargs)
        return run


def check_launch_pointers(monkeypatch, driver, force_triton: bool = True) -> list:
    """Route every launch of :data:`KERNELS` through :class:`_CheckedKernel` for ``driver``; with
    ``force_triton`` the ``"auto"`` dispatch of ``vmkv.kernels.ops`` picks Triton on CPU too (the
    interpreter, ``TRITON_INTERPRET=1``), so ``write_kv`` launches a kernel there as on CUDA.

    Returns:
        The list every checked launch appends ``(kernel, argument index, page state)`` to.
    """
    from vmkv.kernels import _checks, ops

    launches: list = []
    for module_name, attr in KERNELS:
        module = importlib.import_module(module_name)
        monkeypatch.setattr(module, attr, _CheckedKernel(getattr(module, attr), attr, driver, launches))
    if force_triton:
        pick = ops._pick

        def _pick(impl, device, dtype, extra=(), fits=True, **kwargs):
            if impl == "auto" and fits and _checks.triton_can_run(device) and dtype in _checks.KERNEL_DTYPES:
                return "triton"
            return pick(impl, device, dtype, extra, fits, **kwargs)
        monkeypatch.setattr(ops, "_pick", _pick)
    return launches


class ShrinkModel:
    """Brute force of :class:`vmkv.vmem.elastic.ShrinkWindow`: every observation since the queue was last
    empty kept in a list, the high-water mark a max over it (the shrink-policy and reserve-fuzz tests
    check the window against it)."""

    def __init__(self, reserve: int, grace: float, band: float) -> None:
        self.reserve, self.grace, self.band = reserve, grace, band
        self.obs: list[tuple[float, int]] = []
        self.since: float | None = None

    def hwm(self, now: float) -> int:
        return max((v for t, v in self.obs if t >= now - self.grace), default=0)

    def allowed(self, now: float, created: int, claimed: int, waiting: int = 0, extra: int = 0) -> int:
        """Pages the window may release at ``now`` (``extra``: learned pages kept on top)."""
        if not 0.0 <= self.grace < math.inf:
            return 0
        if waiting:
            self.obs, self.since = [], None
            return 0
        self.obs.append((now, claimed))
        if self.since is None:
            self.since = now
        if now - self.since < self.grace:
            return 0
        hwm, keep = self.hwm(now), self.reserve + extra
        if created <= hwm * (1 + self.band) + keep:
            return 0
        return max(0, created - math.ceil(hwm * (1 + self.band / 2)) - keep)
