"""Break-test findings: ``unit_keys`` must read bytes / bytearray token ids one id per item (and an
iterator in one pass), as it did before it packed them with ``array('q')``, which takes a bytes
initializer as raw int64 values; and ``write()`` over a unit that holds a prefix-cache entry drops the
entry on both backends, so a later hit never reads the new bytes as the cached prompt's K/V (paged kept
it and served the overwritten bytes as the cached prompt's)."""

from __future__ import annotations

import pytest
import torch

from vmkv import KVCacheSpec
from vmkv.kvcache import create_kv_cache
from vmkv.kvcache.hashing import hash_unit, unit_keys, ROOT_HASH, extra_key_digest

SPEC = KVCacheSpec(num_layers=2, num_kv_heads=2, head_dim=32, dtype=torch.float32)
BACKENDS = [("vmem", dict(driver="host", page_size_bytes=8192)), ("paged", dict(block_size=8))]


@pytest.mark.parametrize("backend,kw", BACKENDS, ids=[b for b, _ in BACKENDS])
def test_overwriting_a_hit_unit_never_serves_the_new_bytes_as_the_cached_prompt(backend, kw):
    c = create_kv_cache(backend, SPEC, max_num_seqs=3, max_model_len=48, memory_bytes=64 * 8192, **kw)
    try:
        assert c.unit_tokens == 8
        ids = list(range(24))
        g = torch.Generator().manual_seed(0)
        orig = [(torch.randn(24, 2, 32, generator=g), torch.randn(24, 2, 32, generator=g)) for _ in range(2)]
        c.allocate(0, 24, ids)
        for layer in range(2):
            c.write(0, layer, 0, *orig[layer])
        c.free(0)                                   # its units stay cached
        hit = c.allocate(1, 13, ids[:13])
        assert hit == 8
        for layer in range(2):
            c.write(1, layer, hit, orig[layer][0][hit:13], orig[layer][1][hit:13])
            c.write(1, layer, 0, torch.zeros(13, 2, 32), torch.zeros(13, 2, 32))   # over the hit unit
        hit2 = c.allocate(2, 24, ids)
        for layer in range(2):
            k, v = c.gather(2, layer)
            assert torch.equal(k[:hit2], orig[layer][0][:hit2]) and torch.equal(v[:hit2], orig[layer][1][:hit2])
            k1, _ = c.gather(1, layer)
            assert torch.count_nonzero(k1) == 0
        c.check_integrity()
    finally:
        c.close()


@pytest.mark.parametrize("ids", [b"\x01\x02\x03\x04\x05\x06\x07\x08", bytearray(b"\x01\x02\x03\x04"),
                                 b"\x07" * 5])
def test_unit_keys_reads_bytes_one_id_per_item(ids):
    keys = unit_keys(ids, 2)
    assert [k.token_ids for k in keys] == [tuple(ids[i:i + 2]) for i in range(0, len(ids) // 2 * 2, 2)]
    extra = extra_key_digest(None)
    parent = ROOT_HASH
    for k in keys:
        parent = hash_unit(parent, k.token_ids, extra)
        assert k.hash == parent
    assert keys == unit_keys(list(ids), 2)


def test_unit_keys_takes_an_iterator_in_one_pass():
    assert unit_keys(iter([1, 2, 1.0, 3]), 2) == unit_keys([1, 2, 1, 3], 2)
