"""epcomm: expert-parallel dispatch and combine for Mixture-of-Experts models.

    buffer = epcomm.ElasticBuffer(group, num_max_tokens_per_rank=4096, hidden=7168, num_topk=8)
    recv_x, recv_topk_idx, recv_topk_weights, handle, event = buffer.dispatch(
        x, topk_idx=topk_idx, topk_weights=topk_weights, num_experts=256)
    combined_x, combined_topk_weights, event = buffer.combine(expert_out, handle)

`ElasticBuffer` has DeepEP V2's interface; `Buffer` is epcomm's own (one shape per buffer),
which `ElasticBuffer` runs on.
"""
from .buffer import Buffer
from .elastic import (ElasticBuffer, get_logical_domain_size, get_physical_domain_size,
                      topk_idx_t)
from .errors import EPError, EPTimeoutError
from .events import EventHandle, EventOverlap
from .handle import EPHandle
from . import autograd, ops  # (ops registers the torch.ops.epcomm custom ops)

__all__ = ["Buffer", "ElasticBuffer", "EPHandle", "EventOverlap", "EventHandle", "EPError",
           "EPTimeoutError", "topk_idx_t", "get_physical_domain_size", "get_logical_domain_size"]
__version__ = "0.1.0"
