"""`deepspeed.runtime.zero.partition_parameters` (rayzero): the names transformers reaches for."""
import torch

from rayzero.compat.accelerator import get_accelerator  # noqa: F401
from rayzero.compat.zero import GatheredParameters, Init, register_external_parameter  # noqa: F401
from rayzero.compat.zero import _unwrapped_tensor_constructor as zero_wrapper_for_fp_tensor_constructor  # noqa: F401

_orig_torch_arange = torch.arange
