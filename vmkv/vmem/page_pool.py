"""Physical pages of the vmem backend: created up front, or lazily up to a budget and topped up
ahead of need (:meth:`PagePool.top_up`, off the critical path).

Which pages are in use and their reference counts live in the one
:class:`~vmkv.vmem.page_table.PageTable` (:attr:`PagePool.table`).  A page's reference count is the
number of slot positions it is mapped at (fork and prefix sharing map
one page into several slots; vAttention, Prabhu et al., ASPLOS'25, keeps physical pages in a pool and
reuses them across requests instead of freeing them).  A page whose count drops to zero stays created
(until the elastic shrink, :meth:`PagePool.release_free`, or :meth:`PagePool.close` releases it to the
driver) and goes back to one of two free tiers, as the paged block pool does:

* **plain free**: no prefix-cache entry; handed out first.
* **cached free**: it still holds a unit cached in the prefix index, so a later request with that
  prefix can map it again (:meth:`revive`).  Evicted (:meth:`evict`, entry dropped) only when no
  plain page is left; the mapper picks the least recently used one.
"""

from __future__ import annotations

from vmkv.kvcache.errors import KVCacheFullError
from vmkv.kvcache.prefix import PrefixIndex
from vmkv.vmem.page_table import PageTable
from vmkv.vmem.protocol import VMMError

__all__ = ["PagePool", "PagePoolExhaustedError", "creation_out_of_memory", "out_of_memory_is_full"]


class PagePoolExhaustedError(RuntimeError):
    """All ``max_pages`` pages are in use (callers check :attr:`PagePool.num_available` first)."""


def creation_out_of_memory(driver, err: VMMError) -> bool:
    """Is ``err`` ``driver``'s page creation failing for want of memory (another process holds it)?"""
    return err.out_of_memory and err.call == driver.calls.get("create_page")


class out_of_memory_is_full:  # noqa: N801 - used as a function: ``with out_of_memory_is_full(...)``
    """A page the device (or the host file) could not create is a full cache, not a failure: the
    engine preempts (a transient :class:`KVCacheFullError` of ``num_tokens``).  The mapper undid
    the operation before the error left it.  (A class, not ``@contextmanager``: it wraps every
    page-boundary ``extend``.)"""

    __slots__ = ("driver", "num_tokens")

    def __init__(self, driver, num_tokens: int) -> None:
        self.driver, self.num_tokens = driver, num_tokens

    def __enter__(self) -> None:
        return None

    def __exit__(self, kind, e, tb) -> bool:
        if isinstance(e, VMMError) and creation_out_of_memory(self.driver, e):
            raise KVCacheFullError(self.num_tokens, 0, f"{e.call} could not create a page: {e.code}",
                                   transient=True) from e
        return False


class PagePool:
    """Up to ``max_pages`` physical pages of ``driver``.

    Args:
        driver: creates and releases the pages.
        max_pages: the budget (``memory_bytes // page_size_bytes``), > 0.
        preallocate: create all pages now (keeps cuMemCreate off the step's path) instead of lazily.
        prefix: the prefix index whose handles are pages (a new one if ``None``).
    """

    def __init__(self, driver, max_pages: int, preallocate: bool = False,
                 prefix: PrefixIndex | None = None) -> None:
        if max_pages <= 0:
            raise ValueError(f"max_pages must be > 0, got {max_pages}")
        self.driver = driver
        self.max_pages = int(max_pages)
        self.prefix = PrefixIndex() if prefix is None else prefix
        self._free: list[int] = []
        self._cached: set[int] = set()         # cached free pages (refcount 0, content kept)
        self.table = PageTable()               # pages in use: acquired (not yet mapped) or mapped
        #: pages created so far (:meth:`acquire` and :meth:`top_up`; the up-front ones not counted)
        self.num_creations = 0
        self._num_created = 0
        if preallocate:
            for _ in range(self.max_pages):
                self._free.append(driver.create_page())
                self._num_created += 1

    @property
    def num_created(self) -> int:
        return self._num_created

    @property
    def num_free(self) -> int:
        """Created pages on the plain free list."""
        return len(self._free)

    @property
    def num_plain_available(self) -> int:
        """Pages :meth:`acquire` can hand out without evicting a cached one (plain free list +
        not yet created)."""
        return len(self._free) + self.max_pages - self._num_created

    @property
    def num_available(self) -> int:
        """Pages obtainable: plain available + cached free (evictable)."""
        return self.num_plain_available + len(self._cached)

    def cached_pages(self) -> set[int]:
        """Copy of the cached free pages."""
        return set(self._cached)

    def is_cached_free(self, page: int) -> bool:
        return page in self._cached

    @property
    def num_in_use(self) -> int:
        return len(self.table)

    def acquire(self) -> int:
        """Take a plain page (in use, mapped nowhere; the caller maps it, or :meth:`give_back`).
        Never evicts a cached page: :meth:`evict` first."""
        if self._free:
            page = self._free.pop()
        elif self._num_created < self.max_pages:
            page = self.driver.create_page()
            self._num_created += 1
            self.num_creations += 1
        else:
            raise PagePoolExhaustedError(f"all {self.max_pages} pages are in use or cached "
                                         f"({len(self._cached)} cached free)")
        self.table.add(page)
        return page

    def take_free(self, num_pages: int) -> list[int]:
        """Up to ``num_pages`` plain free pages at once, in the order :meth:`acquire` would hand them
        out one by one (in use, mapped nowhere); no driver call, never a creation."""
        k = min(int(num_pages), len(self._free))
        if k <= 0:
            return []
        pages = self._free[-k:][::-1]
        del self._free[-k:]
        self.table.add_many(pages)
        return pages

    def top_up(self, num_pages: int) -> int:
        """Create up to ``num_pages`` pages onto the plain free list ahead of need, never beyond
        ``max_pages``, so the :meth:`acquire` calls that follow make no driver call (off the
        critical path: the cache calls it between steps and from ``prefetch``).  A creation that
        fails for want of memory (another process holds it) ends the top-up quietly: the critical
        path's own pressure handling (:func:`out_of_memory_is_full`) stays where it is.

        Returns:
            The number of pages created (0 when ``num_pages <= 0``, at the cap, or out of memory).
        Raises:
            VMMError: a creation failed for another reason (the pages created before it stay).
        """
        num = min(int(num_pages), self.max_pages - self._num_created)
        created = 0
        while created < num:
            try:
                page = self.driver.create_page()
            except VMMError as e:
                if creation_out_of_memory(self.driver, e):
                    break
                raise
            self._free.append(page)
            self._num_created += 1
            created += 1
        self.num_creations += created
        return created

    def give_back_many(self, pages) -> None:
        """:meth:`give_back` of each of ``pages``."""
        for p in pages:
            self.give_back(p)

    def revive(self, page: int) -> None:
        """Take cached free ``page`` to map it again (count 0, like :meth:`acquire`)."""
        if page not in self._cached:
            raise ValueError(f"page {page} is not a cached free page")
        self._cached.remove(page)
        self.table.add(page)

    def give_back(self, page: int) -> None:
        """Return an acquired (or revived) page that was never mapped."""
        if page not in self.table or self.table.refcount(page):
            raise ValueError(f"page {page} is not an acquired, unmapped page")
        self.unmapped(page)

    def unmapped(self, page: int) -> None:
        """``page``'s last mapping is gone: it becomes cached free (it holds a prefix-cache unit) or
        plain free."""
        self.table.remove(page)
        self._release_to_tier(page)

    def _release_to_tier(self, page: int) -> None:
        if self.prefix.is_cached(page):
            self._cached.add(page)
        else:
            self._free.append(page)

    def evict(self, page: int) -> None:
        """Turn cached free ``page`` plain free, dropping its prefix entry (see :meth:`forget`)."""
        if page not in self._cached:
            raise ValueError(f"page {page} is not a cached free page")
        self.forget(page)

    def forget(self, page: int) -> list[int]:
        """Drop the prefix entry holding ``page`` and its descendants (the content changes or is
        evicted); their cached free pages become plain free.  Returns the pages that lost an entry."""
        dropped = self.prefix.drop(page)
        for p in dropped:
            if p in self._cached:
                self._cached.remove(p)
                self._free.append(p)
        return dropped

    def release_free(self) -> int:
        """Release one plain free page back to the driver (elastic shrink: ``cuMemRelease``, the
        host driver's ``fallocate(PUNCH_HOLE)``); a later :meth:`acquire` creates a page again, up to
        ``max_pages``.  A plain free page is mapped nowhere and was unmapped after its fence, so no
        kernel can still read it.  Returns the page handle released.

        Raises:
            PagePoolExhaustedError: no plain free page.  VMMError: the driver's release failed (the
            page stays plain free).
        """
        if not self._free:
            raise PagePoolExhaustedError("no plain free page to release")
        page = self._free.pop()
        try:
            self.driver.release(page)
        except BaseException:
            self._free.append(page)
            raise
        self._num_created -= 1
        self.table.last_use.pop(page, None)
        return page

    def refcount(self, page: int) -> int:
        return self.table.refcount(page)

    def pages_in_use(self) -> dict[int, int]:
        """Copy of ``page -> reference count`` for pages in use."""
        return {p: len(e.slots) for p, e in self.table.entries.items()}

    def check_integrity(self) -> None:
        free = set(self._free)
        if len(free) != len(self._free):
            raise AssertionError(f"free list has duplicates: {len(self._free)} entries, {len(free)} distinct")
        in_use = self.table.entries.keys()
        for name, tier in (("plain free", free), ("cached free", self._cached)):
            if tier & in_use:
                raise AssertionError(f"pages both {name} and in use: {sorted(tier & in_use)}")
        if free & self._cached:
            raise AssertionError(f"pages both plain and cached free: {sorted(free & self._cached)}")
        if len(free) + len(self._cached) + len(in_use) != self._num_created:
            raise AssertionError(f"plain free {len(free)} + cached free {len(self._cached)} + in use "
                                 f"{len(in_use)} != created {self._num_created}")
        hashed = self.prefix.handles()
        if self._cached - hashed:
            raise AssertionError(f"cached free pages {sorted(self._cached - hashed)} have no prefix entry")
        if free & hashed:
            raise AssertionError(f"plain free pages {sorted(free & hashed)} still have a prefix entry")

    def close(self) -> None:
        """Release every created page (all must be unmapped)."""
        if len(self.table):
            raise AssertionError(f"{len(self.table)} pages still in use at close")
        self.prefix.clear()
        self._free.extend(self._cached)
        self._cached.clear()
        for page in self._free:
            self.driver.release(page)
        self._free.clear()
        self._num_created = 0
