"""Pure Schedule -> Schedule lowering passes, applied in order by ``schedules.registry``."""

from megatron_bfpp.passes.communication import add_communication
from megatron_bfpp.passes.eviction import add_eviction, bpipe_max_stored
from megatron_bfpp.passes.grad_sync import add_grad_sync
from megatron_bfpp.passes.overlap import fuse_overlapped, overlap_pairs

__all__ = [
    "add_communication",
    "add_eviction",
    "add_grad_sync",
    "bpipe_max_stored",
    "fuse_overlapped",
    "overlap_pairs",
]
