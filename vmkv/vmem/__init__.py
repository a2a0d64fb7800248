"""vmem backend: virtually contiguous KV slots backed by pages mapped on demand (vAttention-style).

The names load lazily (a module ``__getattr__``), so :mod:`vmkv.vmem.options` imports without torch.
Importing this package never imports cuda-python; only making a :class:`CudaDriver` does.
"""

import importlib

_NAMES = {
    "VMemKVCache": "vmkv.vmem.cache", "SlotsExhaustedError": "vmkv.vmem.cache",
    "CudaDriver": "vmkv.vmem.cuda_driver", "VMMDriver": "vmkv.vmem.driver", "VMMError": "vmkv.vmem.protocol",
    "get_driver": "vmkv.vmem.backing", "HostDriver": "vmkv.vmem.host_driver",
    "MegacacheLayout": "vmkv.vmem.layout", "PerLayerLayout": "vmkv.vmem.layout",
    "make_layout": "vmkv.vmem.layout", "VMemOptions": "vmkv.vmem.options",
}

__all__ = sorted(_NAMES)


def __getattr__(name: str):
    if name in _NAMES:
        return getattr(importlib.import_module(_NAMES[name]), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
