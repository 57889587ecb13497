"""`deepspeed.utils` (rayzero): DeepSpeed's logger, `zero_to_fp32`; parallelism groups refused."""
import logging

from rayzero.compat.refused import PARALLELISM, RefusedModule, refused

logger = logging.getLogger("DeepSpeed")


def log_dist(message, ranks=None, level=logging.INFO):
    """Log on the listed ranks (all when None or [-1]), as DeepSpeed's `log_dist`."""
    import torch.distributed as dist

    rank = dist.get_rank() if dist.is_initialized() else 0
    if ranks is None or -1 in ranks or rank in ranks:
        logger.log(level, "[Rank %d] %s", rank, message)


groups = RefusedModule("deepspeed.utils.groups", PARALLELISM)
set_z3_leaf_modules = refused("deepspeed.utils.set_z3_leaf_modules",
                              "ZeRO-3 leaf modules (mixture-of-experts layers gathered whole) are not implemented")
