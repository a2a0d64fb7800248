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

**Spans** (:meth:`create_span`): ``n`` pages created as one physical allocation (one ``cuMemCreate``
of ``n`` pages, so mapping them costs one ``cuMemMap`` and one ``cuMemSetAccess`` instead of ``n`` of
each: ``driver.py``).  Each page of a span has its own id (negative, never a driver handle), entry,
claims and prefix entry, but the driver maps, unmaps and releases a span only whole, so a span lives
exactly as long as its one mapping: it is created for a run of fresh pages of one slot, mapped once,
and released (:meth:`release_span`) when the mapper unmaps it.  A span's pages are never mapped in a
second slot (never shared) and never sit on a free tier.  **Ready spans** (:meth:`top_up_spans`) are
spans of :attr:`PagePool.ready_span_pages` created ahead of need, off the critical path, for the grows
that take one (:meth:`take_ready_span`); they hold no page id until taken, count as available, and
are released first when single pages need the room (:meth:`make_room`).
"""

from __future__ import annotations

from vmkv.kvcache.errors import KVCacheFullError
from vmkv.kvcache.prefix import PrefixIndex
from vmkv.vmem.page_table import PageTable
from vmkv.vmem.protocol import VMMError

__all__ = ["PagePool", "PagePoolExhaustedError", "Span", "creation_out_of_memory", "out_of_memory_is_full"]


class Span:
    """Pages created as one physical allocation (module docstring, "Spans").

    Attributes:
        handle: the driver's handle of the allocation (``create_page(num_pages=len(pages))``).
        pages: the page ids, in the order they are mapped (consecutive units of one reservation).
    """

    __slots__ = ("handle", "pages")

    def __init__(self, handle: int, pages: tuple[int, ...]) -> None:
        self.handle, self.pages = handle, pages

    def __len__(self) -> int:
        return len(self.pages)


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
        self.span_of: dict[int, Span] = {}     # page of a span -> its span (module docstring)
        self._next_span_page = -1              # span pages get ids -1, -2, ... (never reused)
        self.num_spans_created = 0
        #: size of the spans kept ready (created, mapped nowhere) for grows; 0: none (the mapper sets it)
        self.ready_span_pages = 0
        self._ready_spans: list[int] = []      # driver handles of ready spans of ready_span_pages
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
        """Pages obtainable: plain available + cached free (evictable) + ready spans' (released to
        make room when single pages are needed: :meth:`make_room`)."""
        return self.num_plain_available + len(self._cached) + self.num_ready_span_pages

    @property
    def num_ready_span_pages(self) -> int:
        """Pages in ready spans (created ahead of need for grows, mapped nowhere)."""
        return len(self._ready_spans) * self.ready_span_pages

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
        if not self._free and self._num_created >= self.max_pages and self._ready_spans:
            self.release_ready_span()           # at the cap: a ready span's memory becomes room
        if self._free:
            page = self._free.pop()
        elif self._num_created < self.max_pages:
            page = self.driver.create_page()
            self._num_created += 1
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
        return created

    def create_span(self, num_pages: int) -> list[int]:
        """Create ``num_pages`` (>= 2) pages as one physical allocation (a :class:`Span`), within
        ``max_pages``; they are in use and mapped nowhere, and the caller maps them whole at
        consecutive units of one slot's reservation (or gives them back, :meth:`give_back_many`).

        Returns:
            The span's page ids, in mapping order.
        Raises:
            PagePoolExhaustedError: fewer than ``num_pages`` pages left to create under the cap.
            VMMError: the creation failed (out of memory: :func:`creation_out_of_memory`).
        """
        n = int(num_pages)
        if n < 2:
            raise ValueError(f"a span has at least 2 pages, got {num_pages}")
        if self._num_created + n > self.max_pages:
            raise PagePoolExhaustedError(f"a span of {n} pages exceeds the cap: {self._num_created} of "
                                         f"{self.max_pages} pages created")
        handle = self.driver.create_page(num_pages=n)
        pages = self._adopt_span(handle, n)
        self._num_created += n
        self.num_spans_created += 1
        return pages

    def take_ready_span(self) -> list[int] | None:
        """A ready span's pages (in use, mapped nowhere, as :meth:`create_span` gives them), or None
        when none is ready; no driver call."""
        if not self._ready_spans:
            return None
        return self._adopt_span(self._ready_spans.pop(), self.ready_span_pages)

    def top_up_spans(self, num_spans: int) -> int:
        """Create up to ``num_spans`` ready spans of :attr:`ready_span_pages` within the cap, off the
        critical path (a grow that takes one pays only the map and the access call).  Out of memory
        ends it quietly.  Returns pages created.
        Raises VMMError: a creation failed for another reason."""
        n, created = self.ready_span_pages, 0
        if n < 2:
            return 0
        for _ in range(max(0, int(num_spans))):
            if self._num_created + n > self.max_pages:
                break
            try:
                handle = self.driver.create_page(num_pages=n)
            except VMMError as e:
                if creation_out_of_memory(self.driver, e):
                    break
                raise
            self._ready_spans.append(handle)
            self._num_created += n
            self.num_spans_created += 1
            created += n
        return created

    @property
    def num_ready_spans(self) -> int:
        return len(self._ready_spans)

    def release_ready_span(self) -> int:
        """Release one ready span to the driver; returns its pages (0 when none is ready).
        Raises VMMError: the release failed (the span stays ready)."""
        if not self._ready_spans:
            return 0
        handle = self._ready_spans[-1]
        self.driver.release(handle, num_pages=self.ready_span_pages)
        self._ready_spans.pop()
        self._num_created -= self.ready_span_pages
        return self.ready_span_pages

    def make_room(self, num_pages: int) -> None:
        """Release ready spans until ``num_pages`` pages are plain available or none is left (before
        reclaiming: a ready span is mapped nowhere and holds no cached unit)."""
        while self._ready_spans and self.num_plain_available < num_pages:
            self.release_ready_span()

    def _adopt_span(self, handle: int, n: int) -> list[int]:
        start = self._next_span_page
        pages = tuple(range(start, start - n, -1))
        self._next_span_page = start - n
        span = Span(handle, pages)
        for p in pages:
            self.span_of[p] = span
        self.table.add_many(pages)
        return list(pages)

    def release_span(self, span: Span) -> None:
        """Release ``span`` to the driver: every page of it is in use and mapped nowhere (the mapper
        unmapped it whole, after its fence).  Prefix entries of its pages (and their descendants)
        are dropped: a later lookup misses, never reads a stale page.

        Raises:
            VMMError: the driver's release failed (nothing changed).
        """
        for p in span.pages:
            if self.table.refcount(p) or p not in self.table:
                raise ValueError(f"span page {p} is mapped or not in use")
        self.driver.release(span.handle, num_pages=len(span))
        for p in span.pages:
            if self.prefix.is_cached(p):
                self.forget(p)
            self.table.remove(p)
            self.table.last_use.pop(p, None)
            del self.span_of[p]
        self._num_created -= len(span)

    def give_back_many(self, pages) -> None:
        """:meth:`give_back` of each of ``pages`` (acquired or revived, never mapped); a span among
        them (all its pages) is released, once, whichever of its pages comes first."""
        released: set[int] = set()          # pages of the spans released here (no longer in span_of)
        for p in pages:
            if p in released:
                continue
            span = self.span_of.get(p)
            if span is None:
                self.give_back(p)
            else:
                self.release_span(span)
                released.update(span.pages)

    def revive(self, page: int) -> None:
        """Take cached free ``page`` to map it again (count 0, like :meth:`acquire`)."""
        if page not in self._cached:
            raise ValueError(f"page {page} is not a cached free page")
        self._cached.remove(page)
        self.table.add(page)

    def give_back(self, page: int) -> None:
        """Return an acquired (or revived) page that was never mapped (a span's: :meth:`give_back_many`)."""
        if page in self.span_of:
            raise ValueError(f"page {page} belongs to a span: give the span back whole (give_back_many)")
        if page not in self.table or self.table.refcount(page):
            raise ValueError(f"page {page} is not an acquired, unmapped page")
        self.unmapped(page)

    def unmapped(self, page: int) -> None:
        """``page``'s last mapping is gone: it becomes cached free (it holds a prefix-cache unit) or
        plain free (a span's pages go back whole: :meth:`release_span`)."""
        assert page not in self.span_of, f"page {page} belongs to a span (released whole)"
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
        ready = self.num_ready_span_pages
        if len(free) + len(self._cached) + len(in_use) + ready != self._num_created:
            raise AssertionError(f"plain free {len(free)} + cached free {len(self._cached)} + in use "
                                 f"{len(in_use)} + ready spans {ready} != created {self._num_created}")
        spans = {id(s): s for s in self.span_of.values()}
        if sum(len(s) for s in spans.values()) != len(self.span_of):
            raise AssertionError(f"{len(self.span_of)} span pages, the spans hold "
                                 f"{sum(len(s) for s in spans.values())}")
        for span in spans.values():
            if any(self.span_of.get(p) is not span for p in span.pages):
                raise AssertionError(f"span {span.handle}: its pages {span.pages} do not all name it")
        if (free | self._cached) & self.span_of.keys():
            raise AssertionError(f"span pages on a free tier: {sorted((free | self._cached) & self.span_of.keys())}")
        if self.span_of.keys() - in_use:
            raise AssertionError(f"span pages not in use: {sorted(self.span_of.keys() - in_use)}")
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
        while self._ready_spans:
            self.release_ready_span()
        self._free.extend(self._cached)
        self._cached.clear()
        for page in self._free:
            self.driver.release(page)
        self._free.clear()
        self._num_created = 0
