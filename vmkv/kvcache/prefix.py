"""Prefix caching shared by both backends: unit keys, chained hashes and the verified index.

A *unit* (a paged block, or the pages at one page index of a vmem slot) that holds the K/V of
``unit_tokens`` prompt tokens is identified by the chained hash ``sha256(parent hash, token ids of
the unit, extra key)`` (vLLM's automatic prefix caching, Kwon et al., SOSP'23, section 4.4; 256-bit
sha256 as vLLM uses since v0.10.2).  The hash is only the lookup key: a hash alone is never
trusted.  Every cached unit keeps its token ids, its encoded extra key and its parent entry, and
:meth:`PrefixIndex.match` accepts a hit only if the unit's tokens and extra key equal the request's
and its parent is the entry the request matched one unit earlier, so a hit at unit ``i`` proves
that the whole prefix ``0..i`` is identical.  A hit that fails the check is a miss; two units
whose hashes collide simply live side by side in one bucket.

The index deals in opaque, hashable *handles* (a block id; a page handle) and never in tensors.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Hashable, Sequence

from vmkv.kvcache.hashing import (HASH_BYTES, ROOT_HASH, UnitKey, encode_extra_key, extra_key_digest, hash_unit,
                                  unit_keys)

__all__ = ["HASH_BYTES", "ROOT_HASH", "UnitKey", "PrefixEntry", "PrefixLookup", "PrefixChain",
           "PrefixIndex", "encode_extra_key", "extra_key_digest", "hash_unit", "unit_keys"]


# ---------------------------------------------------------------------------------------- the index
class PrefixEntry:
    """One cached unit: its key, its parent entry (``None`` for a first unit), its depth (unit
    index in the prompt) and the backend's handles that hold its K/V."""

    __slots__ = ("key", "parent", "depth", "handles", "children", "alive")

    def __init__(self, key: UnitKey, parent: "PrefixEntry | None", handles: tuple) -> None:
        self.key = key
        self.parent = parent
        self.depth = 0 if parent is None else parent.depth + 1
        self.handles = handles
        self.children: list[PrefixEntry] = []
        self.alive = True

    def __repr__(self) -> str:
        return f"PrefixEntry({self.key.hash[:6].hex()}, depth {self.depth}, handles {self.handles})"


@dataclass(frozen=True)
class PrefixLookup:
    """What :meth:`PrefixIndex.lookup` found for one request.

    Attributes:
        num_tokens: the request's prompt tokens.
        unit_tokens: tokens per unit.
        keys: keys of every full unit of the prompt (registered later, as their K/V is written).
        hits: verified cached entries of the leading units, at most ``(num_tokens - 1) //
            unit_tokens`` (the last prompt token is always computed).
    """

    num_tokens: int
    unit_tokens: int
    keys: list[UnitKey]
    hits: list[PrefixEntry]

    @property
    def hit_tokens(self) -> int:
        return len(self.hits) * self.unit_tokens


class PrefixIndex:
    """Verified prefix cache: chained hash -> entries, handle -> entry, and lookup statistics.

    One index serves one cache.  A bucket holds every entry of one hash (normally one; more only
    after a hash collision).  At most one entry exists per (parent, token ids, extra key): a second
    registration of the same content returns the existing entry.  Dropping an entry (its handle is
    evicted or overwritten) drops its descendants too: without their parent they can never be
    matched again.
    """

    def __init__(self) -> None:
        self._buckets: dict[bytes, list[PrefixEntry]] = {}
        self._by_handle: dict[Hashable, PrefixEntry] = {}
        self._num_entries = 0
        #: prompt tokens looked up / found, counted once per successful allocate (:meth:`record`)
        self.num_query_tokens = 0
        self.num_hit_tokens = 0
        #: lookups whose hash matched an entry whose tokens, extra key or parent did not
        self.num_collisions = 0

    def __len__(self) -> int:
        return self._num_entries

    # ------------------------------------------------------------------ lookup
    def lookup(self, token_ids: Sequence[int], unit_tokens: int,
               extra_key: Hashable = None) -> PrefixLookup:
        """Keys of ``token_ids``'s full units and the verified hits among its leading units.

        Changes no entry and no query/hit count (call :meth:`record` once the allocation succeeded;
        only :attr:`num_collisions` counts here).
        """
        keys = unit_keys(token_ids, unit_tokens, extra_key)
        hits = self.match(keys[:(len(token_ids) - 1) // unit_tokens])
        return PrefixLookup(len(token_ids), unit_tokens, keys, hits)

    def match(self, keys: Sequence[UnitKey]) -> list[PrefixEntry]:
        """Entries of the longest run of leading ``keys`` that are cached and verified: same hash,
        same token ids, same extra key, and the parent is the entry matched for the previous key."""
        hits: list[PrefixEntry] = []
        parent = None
        for key in keys:
            bucket = self._buckets.get(key.hash)
            if not bucket:
                break
            found = self._find(bucket, key, parent)
            if found is None:
                self.num_collisions += 1
                break
            hits.append(found)
            parent = found
        return hits

    @staticmethod
    def _find(bucket: list[PrefixEntry], key: UnitKey, parent: PrefixEntry | None) -> PrefixEntry | None:
        for e in bucket:
            if e.parent is parent and e.key.token_ids == key.token_ids and e.key.extra == key.extra:
                return e
        return None

    def record(self, lookup: PrefixLookup) -> None:
        """Count one lookup in the statistics (once per successful allocate)."""
        self.num_query_tokens += lookup.num_tokens
        self.num_hit_tokens += lookup.hit_tokens

    # ------------------------------------------------------------------ registration
    def register(self, key: UnitKey, parent: PrefixEntry | None, handles: tuple) -> PrefixEntry | None:
        """Cache the unit ``key`` (whose prefix is ``parent``'s) as held by ``handles``.

        Returns:
            The entry now caching that content: the new one, or an existing one with the same
            parent, token ids and extra key (then ``handles`` stay uncached).  ``None`` if
            nothing can be cached: ``parent`` was dropped (the chain is broken), or a handle
            already caches other content.
        """
        if parent is not None and not parent.alive:
            return None
        bucket = self._buckets.get(key.hash)
        same = self._find(bucket, key, parent) if bucket else None
        held = [self._by_handle.get(h) for h in handles]
        if any(e is not None for e in held):
            return same if same is not None and all(e is same for e in held) else None
        if same is not None:
            return same
        entry = PrefixEntry(key, parent, tuple(handles))
        self._buckets.setdefault(key.hash, []).append(entry)
        for h in entry.handles:
            self._by_handle[h] = entry
        if parent is not None:
            parent.children.append(entry)
        self._num_entries += 1
        return entry

    # ------------------------------------------------------------------ queries, removal
    def entry_of(self, handle: Hashable) -> PrefixEntry | None:
        return self._by_handle.get(handle)

    def is_cached(self, handle: Hashable) -> bool:
        return handle in self._by_handle

    def handles(self) -> set:
        """Every handle holding a cached unit."""
        return set(self._by_handle)

    def drop(self, handle: Hashable) -> list:
        """Forget the entry holding ``handle`` and all its descendants (their content changes or
        is freed).  Returns every handle that lost its entry (``[]`` if ``handle`` had none)."""
        entry = self._by_handle.get(handle)
        if entry is None:
            return []
        if entry.parent is not None and entry.parent.alive:
            entry.parent.children.remove(entry)
        dropped: list = []
        stack = [entry]
        while stack:
            e = stack.pop()
            e.alive = False
            bucket = self._buckets[e.key.hash]
            bucket.remove(e)
            if not bucket:
                del self._buckets[e.key.hash]
            for h in e.handles:
                del self._by_handle[h]
            dropped += e.handles
            self._num_entries -= 1
            stack += e.children
            e.children = []
        return dropped

    def clear(self) -> int:
        """Forget every entry (statistics stay).  Returns how many were dropped."""
        n = self._num_entries
        for bucket in self._buckets.values():
            for e in bucket:
                e.alive = False
                e.children = []
        self._buckets.clear()
        self._by_handle.clear()
        self._num_entries = 0
        return n

    def check_integrity(self) -> None:
        """Raise ``AssertionError`` naming the numbers if buckets, handles and links disagree."""
        count = 0
        for h, bucket in self._buckets.items():
            if not bucket:
                raise AssertionError(f"empty prefix bucket {h[:6].hex()}")
            for e in bucket:
                count += 1
                if not e.alive or e.key.hash != h:
                    raise AssertionError(f"{e} in bucket {h[:6].hex()}: alive {e.alive}")
                if e.parent is not None and (not e.parent.alive or e not in e.parent.children):
                    raise AssertionError(f"{e}: parent {e.parent} dropped or not linked")
                for handle in e.handles:
                    if self._by_handle.get(handle) is not e:
                        raise AssertionError(f"handle {handle} of {e} maps to "
                                             f"{self._by_handle.get(handle)!r}")
        if count != self._num_entries:
            raise AssertionError(f"prefix index: {count} entries in buckets, {self._num_entries} counted")
        total = sum(len(e.handles) for b in self._buckets.values() for e in b)
        if total != len(self._by_handle):
            raise AssertionError(f"prefix index: {total} handles in entries, {len(self._by_handle)} mapped")


class PrefixChain:
    """One sequence's prefix-cache registration state: its prompt's unit keys, how many leading
    units are cached (``num_hits`` found at allocate, then registered by this sequence) and the
    entry of the last one.

    Args:
        keys: the prompt's unit keys (:attr:`PrefixLookup.keys`).
        hits: the entries found at allocate (:attr:`PrefixLookup.hits`).
    """

    __slots__ = ("keys", "tail", "num_hits", "num_registered", "broken")

    def __init__(self, keys: Sequence[UnitKey] = (), hits: Sequence[PrefixEntry] = ()) -> None:
        self.keys = keys
        self.tail: PrefixEntry | None = hits[-1] if hits else None
        self.num_hits = len(hits)
        self.num_registered = len(hits)
        self.broken = False

    @property
    def done(self) -> bool:
        """Nothing left to register (every unit is, or the chain broke)."""
        return self.broken or self.num_registered >= len(self.keys)

    @property
    def own_units(self) -> range:
        """Units this sequence registered (after its hits): their K/V came from its own steps."""
        return range(self.num_hits, self.num_registered)

    def copy(self) -> "PrefixChain":
        c = PrefixChain(self.keys)
        c.tail, c.num_hits, c.num_registered, c.broken = (self.tail, self.num_hits,
                                                          self.num_registered, self.broken)
        return c

    def register_upto(self, num_units: int,
                      register: Callable[[UnitKey, PrefixEntry | None, int], PrefixEntry | None]) -> None:
        """Register units ``[num_registered, num_units)`` in order through
        ``register(key, parent, unit index)`` (a backend hook around :meth:`PrefixIndex.register`);
        stops for good when a registration returns ``None`` (the chain is broken)."""
        end = min(num_units, len(self.keys))
        while not self.broken and self.num_registered < end:
            entry = register(self.keys[self.num_registered], self.tail, self.num_registered)
            if entry is None:
                self.broken = True
                return
            self.tail = entry
            self.num_registered += 1
