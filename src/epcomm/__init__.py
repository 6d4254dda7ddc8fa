"""epcomm: expert-parallel dispatch and combine for Mixture-of-Experts models.

    buffer = epcomm.Buffer(group, num_max_tokens_per_rank=4096, hidden=7168, num_topk=8)
    recv_x, recv_topk_idx, recv_topk_weights, handle, event = buffer.dispatch(
        x, topk_idx, topk_weights, num_experts=256)
    combined_x, combined_topk_weights, event = buffer.combine(expert_out, handle)
"""
from .buffer import Buffer
from .errors import EPError, EPTimeoutError
from .events import EventOverlap
from .handle import EPHandle

__all__ = ["Buffer", "EPHandle", "EventOverlap", "EPError", "EPTimeoutError"]
__version__ = "0.1.0"
