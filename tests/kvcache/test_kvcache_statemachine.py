"""Stateful property test of the KV-cache contract (hypothesis ``RuleBasedStateMachine``).

Random interleavings of allocate / extend / write / fork / free / step run against every backend
configuration, next to a plain-Python shadow of what each live sequence must read back.

Prefix caching is checked the way a model would use it: the K/V of a prompt position ``p`` is a
deterministic function of the prompt's tokens ``0..p`` (and the layer), as it is for a real
decoder.  So whichever earlier sequence a prefix-cache hit came from, the hit positions must hold
exactly that data, and a hit is only legal if some sequence wrote that token prefix before.
Positions past the prompt, and sequences without token ids, get fresh random data.

Hash collisions: half the runs start with the unit hash replaced by a constant, and the
``weaken_hash`` rule does the same in the middle of a run, so every lookup lands in a bucket that
also holds other prompts' units.  A hit is still only
legal for a prefix some sequence wrote, and every gathered K/V must equal the shadow's.  The
constant replaces :func:`vmkv.kvcache.hashing.hash_unit_bytes`, the function ``unit_keys`` calls
for every unit; each test asserts that the weak hash was called and that the caches' prefix
indexes counted collisions (``PrefixIndex.num_collisions``: a run under the constant hash ends
with a probe that must make exactly one), so the injection cannot silently stop reaching the code
again (it replaced ``prefix.hash_unit``, which nothing has called since 4e9d407, until issue 25).
"""

from __future__ import annotations

import dataclasses
import hashlib
import math
from dataclasses import dataclass

import pytest
import torch
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import (
    RuleBasedStateMachine,
    initialize,
    invariant,
    precondition,
    rule,
    run_state_machine_as_test,
)

from kvcache_cases import (
    CASES,
    SPEC,
    Case,
    allocate_capacity,
    check_usage,
    one_torch_thread,
    pool_tokens,
)
from vmem_helpers import checked_drivers  # noqa: F401 - autouse: vmem drivers validate every call
from vmkv import KVCacheFullError, StepSeq
from vmkv.kernels.reference import attention_one_seq_ref
from vmkv.kvcache import hashing as hashing_mod
from vmkv.vmem.elastic import RELEASE_PAGES_PER_CALL, SHRINK_BAND
from checked_driver import CheckedDriver

STRONG_HASH = hashing_mod.hash_unit_bytes

#: per test: calls of :func:`weak_hash`, collisions the caches' prefix indexes met (the rules'
#: and :meth:`KVCacheMachine.probe_collision`'s), and the probes run
INJECTED = {"weak_hash_calls": 0, "index_collisions": 0, "probes": 0}


def weak_hash(parent_hash: bytes, num_tokens: int, packed, extra: bytes) -> bytes:
    """No hash at all: every unit of every prompt collides with every other (the signature of
    :func:`vmkv.kvcache.hashing.hash_unit_bytes`)."""
    INJECTED["weak_hash_calls"] += 1
    return bytes(hashing_mod.HASH_BYTES)


def set_unit_hash(fn) -> None:
    """Make ``unit_keys`` (hence every prefix lookup and registration) hash units with ``fn``."""
    hashing_mod.hash_unit_bytes = fn

NUM_HEADS = 4 * SPEC.num_kv_heads
VOCAB = 4  # tiny vocabulary so prompts share prefixes

# smaller budgets than the contract suite, so the cache is often full
SM_LIMITS = {
    "paged-b4": dict(max_num_seqs=5, max_model_len=32, capacity_tokens=64),
    "paged-b16": dict(max_num_seqs=5, max_model_len=48, capacity_tokens=96),
    "vmem-megacache": dict(max_num_seqs=5, max_model_len=48, capacity_tokens=96),
    "vmem-per_layer": dict(max_num_seqs=4, max_model_len=128, capacity_tokens=256),
    "vmem-lookahead": dict(max_num_seqs=5, max_model_len=48, capacity_tokens=96),
}

SM_SETTINGS = settings(max_examples=30, stateful_step_count=30, deadline=None, database=None,
                       suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])


@pytest.fixture(autouse=True, scope="module")
def _one_thread():
    with one_torch_thread():
        yield


@dataclass
class Shadow:
    """What one live sequence must read back."""

    seq_len: int
    prompt: tuple | None
    k: torch.Tensor          # [num_layers, max_model_len, H, D]
    v: torch.Tensor
    written: torch.Tensor    # bool [num_layers, max_model_len]

    def copy(self) -> "Shadow":
        return Shadow(self.seq_len, self.prompt, self.k.clone(), self.v.clone(), self.written.clone())

    def leading_written(self) -> int:
        """Positions ``0..c-1`` hold K/V in every layer (what ``num_computed_tokens`` may claim)."""
        all_layers = self.written[:, :self.seq_len].all(dim=0)
        missing = (~all_layers).nonzero()
        return int(missing[0]) if missing.numel() else self.seq_len


class KVCacheMachine(RuleBasedStateMachine):
    case: Case

    def __init__(self) -> None:
        super().__init__()
        case = self.case
        if case.backend == "vmem":   # elastic shrink at once, down to a two-page reserve
            reserve = 2 * case.options["page_size_bytes"]
            case = dataclasses.replace(case, options={**case.options, "kv_shrink_grace_s": 0,
                                                      "kv_reserve_bytes": reserve})
        self.cache = case.make(**SM_LIMITS[self.case.name])
        # vmem runs on a CheckedDriver (the checked_drivers fixture): driver misuse raises VMMError
        assert self.case.backend != "vmem" or isinstance(self.cache.driver, CheckedDriver)
        u = self.cache.usage()
        self.unit = u.unit_tokens
        self.free0 = u.free_tokens
        self.pool0 = pool_tokens(self.cache)
        self.mml = self.cache.max_model_len
        self.seqs: dict[int, Shadow] = {}
        self.next_id = 0
        self.gen = torch.Generator().manual_seed(0)
        base_gen = torch.Generator().manual_seed(1)
        self.bases = [tuple(torch.randint(0, VOCAB, (self.mml,), generator=base_gen).tolist())
                      for _ in range(2)]
        self.written_prefixes: set[tuple] = set()
        self.prompts_seen: list[tuple] = []
        self._det: dict[tuple, tuple[torch.Tensor, torch.Tensor]] = {}
        set_unit_hash(STRONG_HASH)

    # ------------------------------------------------------------------ data
    def det_kv(self, prefix: tuple, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
        """K/V ``[H, D]`` of the last token of ``prefix`` in ``layer``, as a model would compute."""
        key = (prefix, layer)
        if key not in self._det:
            seed = int.from_bytes(hashlib.blake2b(repr(key).encode(), digest_size=7).digest(), "little")
            g = torch.Generator().manual_seed(seed)
            kv = torch.randn(2, SPEC.num_kv_heads, SPEC.head_dim, generator=g) + 2.0
            self._det[key] = (kv[0], kv[1])
        return self._det[key]

    def kv_for(self, sh: Shadow, layer: int, start: int, n: int) -> tuple[torch.Tensor, torch.Tensor]:
        shape = (n, SPEC.num_kv_heads, SPEC.head_dim)
        k = torch.randn(shape, generator=self.gen) - 2.0
        v = torch.randn(shape, generator=self.gen) + 1.0
        if sh.prompt is not None:
            for p in range(start, min(start + n, len(sh.prompt))):
                k[p - start], v[p - start] = self.det_kv(sh.prompt[:p + 1], layer)
        return k, v

    def record(self, sh: Shadow, layer: int, start: int, k: torch.Tensor, v: torch.Tensor) -> None:
        n = k.shape[0]
        sh.k[layer, start:start + n] = k
        sh.v[layer, start:start + n] = v
        sh.written[layer, start:start + n] = True
        if sh.prompt is not None and layer == SPEC.num_layers - 1:
            for p in range(start, min(start + n, len(sh.prompt))):
                if bool(sh.written[:, p].all()):
                    self.written_prefixes.add(sh.prompt[:p + 1])

    def new_shadow(self, n: int, prompt) -> Shadow:
        shape = (SPEC.num_layers, self.mml, SPEC.num_kv_heads, SPEC.head_dim)
        return Shadow(n, prompt, torch.zeros(shape), torch.zeros(shape),
                      torch.zeros(SPEC.num_layers, self.mml, dtype=torch.bool))

    def pick(self, data, pred=lambda s: True) -> int:
        return data.draw(st.sampled_from(sorted(s for s, sh in self.seqs.items() if pred(sh))))

    def expect_unchanged(self, usage_before) -> None:
        assert self.cache.usage() == usage_before, "a failing operation changed usage()"
        self.check_all()

    # ------------------------------------------------------------------ rules
    def can_add(self) -> bool:
        return len(self.seqs) < self.cache.max_num_seqs

    @precondition(can_add)
    @rule(data=st.data())
    def allocate(self, data) -> None:
        longer_than_unit = st.integers(min(self.mml, self.unit + 1), self.mml)
        n = data.draw(st.one_of(st.integers(1, 8), st.integers(1, self.mml), longer_than_unit),
                      label="num_tokens")
        prompt = None
        kind = data.draw(st.sampled_from(["none", "base", "seen"]), label="token_ids")
        if kind == "seen" and self.prompts_seen:   # an earlier prompt again: the prefix-cache case
            prompt = data.draw(st.sampled_from(self.prompts_seen), label="prompt")
            n = len(prompt)
        elif kind != "none":
            b = data.draw(st.integers(0, 1), label="base")
            d = data.draw(st.one_of(st.just(n), st.integers(0, n)), label="diverge_at")
            prompt = self.bases[b][:d] + self.bases[1 - b][d:n]
            self.prompts_seen.append(prompt)
        sid = self.next_id
        self.next_id += 1
        could = self.cache.can_allocate(n)
        before = self.cache.usage()
        try:
            hit = self.cache.allocate(sid, n, token_ids=None if prompt is None else list(prompt))
        except KVCacheFullError as err:
            assert not could, f"can_allocate({n}) was True but allocate raised {err}"
            assert prompt is not None or before.free_tokens < n
            assert 0 <= err.available_tokens < err.needed_tokens
            assert not self.cache.has_seq(sid)
            self.expect_unchanged(before)
            return
        assert could or prompt is not None, f"can_allocate({n}) was False but allocate succeeded"
        assert 0 <= hit < n
        sh = self.new_shadow(n, prompt)
        if prompt is None or self.unit == 0:
            assert hit == 0
        if hit:
            assert hit % self.unit == 0, (hit, self.unit)
            for p in range(hit):
                assert prompt[:p + 1] in self.written_prefixes, f"hit of {hit} tokens never written"
            for layer in range(SPEC.num_layers):
                k, v = self.kv_for(sh, layer, 0, hit)
                kg, vg = self.cache.gather(sid, layer)
                assert torch.equal(kg[:hit], k) and torch.equal(vg[:hit], v), "prefix hit holds wrong K/V"
                self.record(sh, layer, 0, k, v)
        self.seqs[sid] = sh
        if prompt is not None and data.draw(st.booleans(), label="prefill_now"):
            self.run_step([StepSeq(sid, hit, n - hit)])   # as an engine does right away

    @precondition(lambda self: any(sh.seq_len < self.mml for sh in self.seqs.values()))
    @rule(data=st.data())
    def extend(self, data) -> None:
        sid = self.pick(data, lambda sh: sh.seq_len < self.mml)
        sh = self.seqs[sid]
        k = data.draw(st.integers(1, min(self.mml - sh.seq_len, 20)), label="more")
        before = self.cache.usage()
        try:
            self.cache.extend(sid, k)
        except KVCacheFullError as err:
            assert 0 <= err.available_tokens < err.needed_tokens
            self.expect_unchanged(before)
            return
        sh.seq_len += k

    @precondition(lambda self: self.seqs)
    @rule(data=st.data())
    def write(self, data) -> None:
        sid = self.pick(data)
        sh = self.seqs[sid]
        # a prompt's K/V is written front to back, as an engine does
        hi = min(sh.leading_written(), sh.seq_len - 1) if sh.prompt is not None else sh.seq_len - 1
        start = data.draw(st.integers(0, hi), label="start")
        n = data.draw(st.integers(1, sh.seq_len - start), label="n")
        for layer in range(SPEC.num_layers):
            k, v = self.kv_for(sh, layer, start, n)
            before = self.cache.usage()
            try:
                self.cache.write(sid, layer, start, k, v)
            except KVCacheFullError:  # a copy-on-write copy found no memory
                self.expect_unchanged(before)
                return
            self.record(sh, layer, start, k, v)

    @precondition(lambda self: self.seqs and self.can_add())
    @rule(data=st.data())
    def fork(self, data) -> None:
        parent = self.pick(data)
        child = self.next_id
        self.next_id += 1
        before = self.cache.usage()
        try:
            self.cache.fork(parent, child)
        except KVCacheFullError:
            assert not self.cache.has_seq(child)
            self.expect_unchanged(before)
            return
        self.seqs[child] = self.seqs[parent].copy()

    @precondition(lambda self: self.seqs)
    @rule(data=st.data())
    def free(self, data) -> None:
        sid = self.pick(data)
        # written=False (a failed forward) drops the prefix units it registered: never a wrong hit
        self.cache.free(sid, written=data.draw(st.booleans(), label="written"))
        del self.seqs[sid]
        assert not self.cache.has_seq(sid)

    @precondition(lambda self: self.seqs)
    @rule(data=st.data())
    def step(self, data) -> None:
        ids = data.draw(st.lists(st.sampled_from(sorted(self.seqs)), min_size=1, max_size=3,
                                 unique=True), label="batch")
        batch = []
        for sid in ids:
            sh = self.seqs[sid]
            c = data.draw(st.integers(0, min(sh.leading_written(), sh.seq_len - 1)), label="computed")
            n = data.draw(st.integers(1, sh.seq_len - c), label="new")
            batch.append(StepSeq(sid, c, n))
        self.run_step(batch)

    @rule(data=st.data())
    def prefetch_admission(self, data) -> None:
        """The hint of the next admissions (earlier prompts: prefix hits): changes no sequence and no
        usage figure but the mapped bytes; later hits still hold what was written (allocate checks)."""
        prompts = data.draw(st.lists(st.sampled_from(self.prompts_seen), max_size=3), label="upcoming") \
            if self.prompts_seen else []
        before = self.cache.usage()
        lens = {sid: self.cache.seq_len(sid) for sid in self.seqs}
        self.cache.prefetch_admission([len(p) for p in prompts], [list(p) for p in prompts],
                                      [None] * len(prompts))
        after = self.cache.usage()
        assert {sid: self.cache.seq_len(sid) for sid in self.seqs} == lens
        assert (after.used_tokens, after.allocated_bytes, after.prefix_query_tokens) == \
            (before.used_tokens, before.allocated_bytes, before.prefix_query_tokens)

    @precondition(lambda self: self.case.backend == "vmem" and self.cache.mapper.num_idle_pages() > 1)
    @rule()
    def release_idle(self) -> None:
        """Elastic shrink (grace 0, two-page reserve; ``vmkv.vmem.elastic``): with no window, the
        high-water mark is what live sequences claim now; idle pages beyond it (plus half the
        hysteresis band) and the reserve go back to the driver once the created pages exceed it plus
        the whole band, at most RELEASE_PAGES_PER_CALL while sequences are live, and nothing while
        requests wait.  Live sequences keep their K/V (the invariant gathers it), cached prefixes whose
        pages went are misses afterwards (``allocate`` checks every hit against what was written); the
        reserve is made of plain free pages while sequences are live, of any idle pages while none is."""
        cache = self.cache
        mapper, page, elastic = cache.mapper, cache.page_size_bytes, cache.elastic
        claimed, topped = mapper.num_allocated_pages(), elastic.num_topped_up_pages
        created = mapper.pool.num_created
        free_before = cache.usage().free_tokens
        live = bool(len(cache.seqs))
        assert cache.release_idle(num_waiting=1) == 0          # requests waiting: nothing goes
        released = cache.release_idle()
        assert released % page == 0
        after_top_up = created + elastic.num_topped_up_pages - topped
        # learned: pages released while live and created again stay on top of the reserve
        band, reserve = SHRINK_BAND, elastic.reserve_pages + elastic.learned_pages
        if after_top_up <= claimed * (1 + band) + reserve:
            assert released == 0
        else:
            # host driver: no fence is ever pending, so everything the rule allows goes
            keep = math.ceil(claimed * (1 + band / 2)) + reserve
            want = after_top_up - keep
            assert released // page == (min(want, RELEASE_PAGES_PER_CALL) if live else want)
        assert mapper.pool.num_created == after_top_up - released // page
        if live:
            assert mapper.pool.num_free >= 2 or mapper.pool.num_created == mapper.pool.max_pages
        else:
            assert mapper.num_idle_pages() >= 2
        assert mapper.num_allocated_pages() == claimed
        assert cache.usage().free_tokens == free_before

    @precondition(lambda self: self.case.backend == "vmem")
    @rule(data=st.data())
    def prefetch_and_top_up(self, data) -> None:
        """The engine's calls while a forward runs: ``prefetch`` of live sequences (pages mapped
        unclaimed), then the top-up of the reserve (plain free pages created, never past the cap):
        no sequence or usage figure changes but mapped and created bytes, and afterwards the
        two-page reserve is idle unless the cap is reached."""
        ids = data.draw(st.lists(st.sampled_from(sorted(self.seqs)), max_size=3, unique=True),
                        label="seqs") if self.seqs else []
        num_tokens = data.draw(st.integers(1, 2 * self.mml), label="num_tokens")
        mapper = self.cache.mapper
        before, created = self.cache.usage(), mapper.pool.num_created
        lens = {sid: self.cache.seq_len(sid) for sid in self.seqs}
        self.cache.prefetch(ids, num_tokens)
        after = self.cache.usage()
        assert {sid: self.cache.seq_len(sid) for sid in self.seqs} == lens
        assert (after.used_tokens, after.allocated_bytes, after.free_tokens) == \
            (before.used_tokens, before.allocated_bytes, before.free_tokens)
        assert created <= mapper.pool.num_created <= mapper.pool.max_pages
        assert mapper.num_idle_pages() >= 2 or mapper.pool.num_created == mapper.pool.max_pages

    def run_step(self, batch: list[StepSeq]) -> None:
        """prepare + write_kv on every layer + attention of layer 0, checked against the shadow."""
        ids = [e.seq_id for e in batch]
        before = self.cache.usage()
        try:
            meta = self.cache.prepare(batch)
        except KVCacheFullError:
            self.expect_unchanged(before)
            return
        assert meta.seq_ids == ids
        assert meta.positions.tolist() == [p for e in batch
                                           for p in range(e.num_computed_tokens,
                                                          e.num_computed_tokens + e.num_new_tokens)]
        for layer in range(SPEC.num_layers):
            parts = [self.kv_for(self.seqs[e.seq_id], layer, e.num_computed_tokens, e.num_new_tokens)
                     for e in batch]
            self.cache.write_kv(layer, torch.cat([k for k, _ in parts]), torch.cat([v for _, v in parts]),
                                meta)
            for e, (k, v) in zip(batch, parts):
                self.record(self.seqs[e.seq_id], layer, e.num_computed_tokens, k, v)
        # attention of layer 0 over the shadow K/V
        q = torch.randn(meta.num_tokens, NUM_HEADS, SPEC.head_dim, generator=self.gen)
        out = self.cache.attention(0, q, meta)
        start = 0
        for e in batch:
            sh = self.seqs[e.seq_id]
            end = e.num_computed_tokens + e.num_new_tokens
            ref = attention_one_seq_ref(q[start:start + e.num_new_tokens], sh.k[0, :end], sh.v[0, :end],
                                        e.num_computed_tokens, SPEC.head_dim ** -0.5)
            torch.testing.assert_close(out[start:start + e.num_new_tokens], ref, rtol=1e-5, atol=1e-5)
            start += e.num_new_tokens

    @initialize(weak=st.booleans())
    def choose_hash(self, weak: bool) -> None:
        set_unit_hash(weak_hash if weak else STRONG_HASH)

    @precondition(lambda self: hashing_mod.hash_unit_bytes is STRONG_HASH)
    @rule()
    def weaken_hash(self) -> None:
        """Inject hash collisions from now on: units cached so far keep their strong hashes,
        new lookups and registrations use a constant hash."""
        set_unit_hash(weak_hash)

    # ------------------------------------------------------------------ invariants
    @invariant()
    def check_all(self) -> None:
        self.cache.check_integrity()
        for sid, sh in self.seqs.items():
            assert self.cache.seq_len(sid) == sh.seq_len
            for layer in range(SPEC.num_layers):
                k, v = self.cache.gather(sid, layer)
                assert k.shape[0] == sh.seq_len
                mask = sh.written[layer, :sh.seq_len]
                if not torch.equal(k[mask], sh.k[layer, :sh.seq_len][mask]) or \
                        not torch.equal(v[mask], sh.v[layer, :sh.seq_len][mask]):
                    bad = [p for p in range(sh.seq_len) if mask[p] and not (
                        torch.equal(k[p], sh.k[layer, p]) and torch.equal(v[p], sh.v[layer, p]))]
                    raise AssertionError(f"seq {sid} layer {layer}: wrong K/V at positions {bad}")
        check_usage(self.cache, {s: sh.seq_len for s, sh in self.seqs.items()}, shared=True)

    def probe_collision(self) -> None:
        """Did the injection fire: under the constant hash a prompt never seen lands in the bucket
        of the one cached just before it, so its lookup counts exactly one collision and hits
        nothing (tokens ``VOCAB`` and ``VOCAB + 1``: no rule ever draws them)."""
        n = min(self.mml, 2 * self.unit + 1)
        if self.unit == 0 or n - 1 < self.unit:
            return
        first = 20_000
        assert self.cache.allocate(first, n, token_ids=[VOCAB] * n) == 0
        meta = self.cache.prepare([StepSeq(first, 0, n)])
        for layer in range(SPEC.num_layers):
            k, v = torch.randn(2, n, SPEC.num_kv_heads, SPEC.head_dim, generator=self.gen)
            self.cache.write_kv(layer, k, v, meta)
        self.cache.free(first)
        before = self.cache.prefix.num_collisions
        assert self.cache.allocate(first + 1, n, token_ids=[VOCAB + 1] * n) == 0
        assert self.cache.prefix.num_collisions == before + 1, "the constant hash made no collision"
        self.cache.free(first + 1)
        INJECTED["probes"] += 1

    def teardown(self) -> None:
        try:
            for sid in list(self.seqs):
                self.cache.free(sid)
                del self.seqs[sid]
            u = check_usage(self.cache, {})
            assert u.free_tokens == self.free0, (u, self.free0)
            self.cache.check_integrity()
            if hashing_mod.hash_unit_bytes is weak_hash:
                self.probe_collision()
            ids = allocate_capacity(self.cache, self.pool0, first_id=10_000)
            assert not self.cache.can_allocate(1)
            for sid in ids:
                self.cache.free(sid)
            self.cache.check_integrity()
        finally:
            INJECTED["index_collisions"] += self.cache.prefix.num_collisions
            set_unit_hash(STRONG_HASH)
            self.cache.close()


@pytest.mark.parametrize("case", CASES, ids=[c.name for c in CASES])
def test_kvcache_state_machine(case):
    machine = type(f"KVCacheMachine_{case.name.replace('-', '_')}", (KVCacheMachine,), {"case": case})
    INJECTED.update(weak_hash_calls=0, index_collisions=0, probes=0)
    try:
        run_state_machine_as_test(machine, settings=SM_SETTINGS)
    finally:
        set_unit_hash(STRONG_HASH)
    # did the injection fire: the weak hash reached unit_keys, and lookups met colliding entries
    assert INJECTED["weak_hash_calls"] > 0, "weak_hash was never called: the collision injection " \
        "patches a function the prefix index no longer calls"
    assert INJECTED["probes"] > 0 and INJECTED["index_collisions"] >= INJECTED["probes"], \
        f"no hash collision met in {case.name}: {INJECTED}"
