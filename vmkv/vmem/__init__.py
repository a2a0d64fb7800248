"""vmem backend: virtually contiguous KV slots backed by pages mapped on demand (vAttention-style).

Importing this package never imports cuda-python; only :class:`~vmkv.vmem.driver.CudaDriver` does.
"""

from vmkv.vmem.cache import SlotsExhaustedError, VMemKVCache
from vmkv.vmem.driver import CudaDriver, HostDriver, VMMDriver, VMMError, get_driver
from vmkv.vmem.layout import MegacacheLayout, PerLayerLayout, make_layout

__all__ = [
    "VMemKVCache", "SlotsExhaustedError", "VMMError", "VMMDriver", "HostDriver", "CudaDriver",
    "get_driver", "MegacacheLayout", "PerLayerLayout", "make_layout",
]
