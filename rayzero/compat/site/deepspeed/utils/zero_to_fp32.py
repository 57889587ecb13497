"""`deepspeed.utils.zero_to_fp32` (rayzero): see rayzero/compat/zero_to_fp32.py."""
from rayzero.compat.zero_to_fp32 import (  # noqa: F401
    convert_zero_checkpoint_to_fp32_state_dict,
    get_fp32_state_dict_from_zero_checkpoint,
    load_state_dict_from_zero_checkpoint,
    main,
)

if __name__ == "__main__":
    main()
