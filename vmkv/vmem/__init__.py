"""vmem backend: virtually contiguous KV slots backed by pages mapped on demand (vAttention-style).

Importing this package never imports cuda-python; only making a :class:`CudaDriver` does.
"""

from vmkv.vmem.cache import SlotsExhaustedError, VMemKVCache
from vmkv.vmem.cuda_driver import CudaDriver
from vmkv.vmem.driver import VMMDriver, VMMError, get_driver
from vmkv.vmem.host_driver import HostDriver
from vmkv.vmem.layout import MegacacheLayout, PerLayerLayout, make_layout

__all__ = [
    "VMemKVCache", "SlotsExhaustedError", "VMMError", "VMMDriver", "HostDriver", "CudaDriver",
    "get_driver", "MegacacheLayout", "PerLayerLayout", "make_layout",
]
