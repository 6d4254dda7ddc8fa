"""A stand-in for DeepEP's `deep_ep` module, over epcomm.

    import epcomm.deep_ep; epcomm.deep_ep.install()   # then `import deep_ep` resolves here

or, without touching `sys.modules`, `from epcomm import deep_ep` where the code says
`import deep_ep`. It exposes what DeepEP's users import: `Buffer` (V1, normal mode),
`ElasticBuffer` and `EPHandle` (V2), `EventOverlap`, `EventHandle`, `Config`, `topk_idx_t`,
`get_physical_domain_size`, `get_logical_domain_size`, and the submodules `deep_ep.buffers`
(`legacy`, `elastic`) and `deep_ep.utils` (`event`, `envs`) with the same names.
"""
from __future__ import annotations

import sys
import types

from ..elastic import (ElasticBuffer, get_logical_domain_size, get_physical_domain_size,
                       topk_idx_t)
from ..events import EventHandle, EventOverlap
from ..handle import EPHandle
from ..legacy import Buffer, Config

__all__ = ["Buffer", "ElasticBuffer", "EPHandle", "EventOverlap", "EventHandle", "Config",
           "topk_idx_t", "get_physical_domain_size", "get_logical_domain_size", "install"]
__version__ = "2.1.0"  # the DeepEP interface this module stands in for


def _module(name: str, **names) -> types.ModuleType:
    module = types.ModuleType(name)
    module.__dict__.update(names)
    return module


_legacy = _module(f"{__name__}.buffers.legacy", Buffer=Buffer, Config=Config,
                  EventOverlap=EventOverlap, topk_idx_t=topk_idx_t)
_elastic = _module(f"{__name__}.buffers.elastic", ElasticBuffer=ElasticBuffer, EPHandle=EPHandle,
                   EventOverlap=EventOverlap, topk_idx_t=topk_idx_t)
_event = _module(f"{__name__}.utils.event", EventOverlap=EventOverlap, EventHandle=EventHandle)
_envs = _module(f"{__name__}.utils.envs", get_physical_domain_size=get_physical_domain_size,
                get_logical_domain_size=get_logical_domain_size)
buffers = _module(f"{__name__}.buffers", legacy=_legacy, elastic=_elastic)
utils = _module(f"{__name__}.utils", event=_event, envs=_envs, EventOverlap=EventOverlap)
_SUBMODULES = {"buffers": buffers, "buffers.legacy": _legacy, "buffers.elastic": _elastic,
               "utils": utils, "utils.event": _event, "utils.envs": _envs}


def install(name: str = "deep_ep") -> types.ModuleType:
    """Make `import deep_ep` (and `deep_ep.buffers.*`, `deep_ep.utils.*`) resolve to this
    module from now on in this process; returns it. Raises `RuntimeError` if another module is
    already imported under `name` (a real DeepEP), rather than replacing it."""
    this = sys.modules[__name__]
    present = sys.modules.get(name)
    if present is not None and present is not this:
        raise RuntimeError(f"a module {name!r} is already imported ({present!r}); "
                           "install the stand-in before anything imports DeepEP")
    sys.modules[name] = this
    for suffix, module in _SUBMODULES.items():
        sys.modules[f"{name}.{suffix}"] = module
    return this
