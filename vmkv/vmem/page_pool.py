"""Physical pages of the vmem backend: created up front or lazily up to a budget, reference counted.

A page's reference count is the number of slot positions it is mapped at (fork and prefix sharing map
one page into several slots; vAttention, Prabhu et al., ASPLOS'25, keeps physical pages in a pool and
reuses them across requests instead of freeing them).  A page whose count drops to zero goes back to
the free list (it stays created; only :meth:`PagePool.close` releases pages to the driver).
"""

from __future__ import annotations

from vmkv.vmem.driver import VMMDriver

__all__ = ["PagePool", "PagePoolExhaustedError"]


class PagePoolExhaustedError(RuntimeError):
    """All ``max_pages`` pages are in use (callers check :attr:`PagePool.num_available` first)."""


class PagePool:
    """Up to ``max_pages`` physical pages of ``driver``.

    Args:
        driver: creates and releases the pages.
        max_pages: the budget (``memory_bytes // page_size_bytes``), > 0.
        preallocate: create all pages now (keeps cuMemCreate off the step's path) instead of lazily.
    """

    def __init__(self, driver: VMMDriver, max_pages: int, preallocate: bool = False) -> None:
        if max_pages <= 0:
            raise ValueError(f"max_pages must be > 0, got {max_pages}")
        self.driver = driver
        self.max_pages = int(max_pages)
        self._free: list[int] = []
        self._refcount: dict[int, int] = {}   # page -> mappings (0 while acquired, not yet mapped)
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
        """Created pages on the free list."""
        return len(self._free)

    @property
    def num_available(self) -> int:
        """Pages :meth:`acquire` can still hand out (free list + not yet created)."""
        return len(self._free) + self.max_pages - self._num_created

    @property
    def num_in_use(self) -> int:
        return len(self._refcount)

    def acquire(self) -> int:
        """Take a page (count 0; the caller maps it and calls :meth:`incref`, or :meth:`give_back`)."""
        if self._free:
            page = self._free.pop()
        elif self._num_created < self.max_pages:
            page = self.driver.create_page()
            self._num_created += 1
        else:
            raise PagePoolExhaustedError(f"all {self.max_pages} pages are in use")
        self._refcount[page] = 0
        return page

    def give_back(self, page: int) -> None:
        """Return an acquired page that was never mapped."""
        if self._refcount.get(page) != 0:
            raise ValueError(f"page {page} is not an acquired, unmapped page")
        del self._refcount[page]
        self._free.append(page)

    def incref(self, page: int) -> int:
        self._refcount[page] += 1
        return self._refcount[page]

    def decref(self, page: int) -> int:
        """Drop one reference; at zero the page returns to the free list.  Returns the new count."""
        count = self._refcount[page] - 1
        if count < 0:
            raise AssertionError(f"page {page} reference count would go negative")
        if count == 0:
            del self._refcount[page]
            self._free.append(page)
        else:
            self._refcount[page] = count
        return count

    def refcount(self, page: int) -> int:
        return self._refcount.get(page, 0)

    def pages_in_use(self) -> dict[int, int]:
        """Copy of ``page -> reference count`` for pages in use."""
        return dict(self._refcount)

    def check_integrity(self) -> None:
        free = set(self._free)
        if len(free) != len(self._free):
            raise AssertionError(f"free list has duplicates: {len(self._free)} entries, {len(free)} distinct")
        if free & self._refcount.keys():
            raise AssertionError(f"pages both free and in use: {sorted(free & self._refcount.keys())}")
        if len(free) + len(self._refcount) != self._num_created:
            raise AssertionError(f"free {len(free)} + in use {len(self._refcount)} != created "
                                 f"{self._num_created}")

    def close(self) -> None:
        """Release every created page (all must be unmapped)."""
        if self._refcount:
            raise AssertionError(f"{len(self._refcount)} pages still in use at close")
        for page in self._free:
            self.driver.release(page)
        self._free.clear()
        self._num_created = 0
