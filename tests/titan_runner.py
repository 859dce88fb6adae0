"""TorchTitan's own entry point (``torchtitan.train.main``) on the CPU with gloo: the
reference run of tests/test_torchtitan.py.

Run like ``python -m torchtitan.train`` (under torchrun, the same arguments), with
``TORCH_DEVICE_BACKEND_AUTOLOAD=0`` so that ``import torch`` does not load torchtpu.
TorchTitan itself cannot be that reference unmodified (docs/ecosystem.md, TorchTitan);
three things are replaced here, nothing else:

- the device: on a machine without an accelerator TorchTitan picks "cuda" (``torch.
  _utils._get_available_device_type() or "cuda"``) and fails in ``torch.cuda.
  set_device``. Here it finds "cpu", and a device module for it: ``torch.cpu``, and the
  queries TorchTitan's metrics make, answered with nothing (its memory line reads
  -0.00GiB).
- FlexAttention: TorchTitan calls ``torch.compile(flex_attention)`` and a compiled
  ``create_block_mask``, and torch refuses FlexAttention's backward on the CPU, compiled
  or not (``_validate_device``). Here both are torch's eager ones, whose dense
  implementation has a backward, with that check taken out.
- FSDP2's gradient reduction: once TorchTitan sets a gradient divide factor, FSDP2
  reduce-scatters with ``PREMUL_SUM``, which gloo does not have. Here it sums and divides
  after (``force_sum_reduction_for_comms``), the same arithmetic.
"""

from __future__ import annotations

import os
import sys
import traceback
import types


def _cpu_device_module() -> types.ModuleType:
    import torch

    module = types.ModuleType("titan_runner_cpu")
    module.__dict__.update({k: v for k, v in vars(torch.cpu).items() if not k.startswith("__")})
    props = types.SimpleNamespace(name="cpu", total_memory=1 << 40)
    module.set_device = lambda device: None
    module.device_count = lambda: 1
    module.current_device = lambda: 0
    module.get_device_name = lambda device=None: "cpu"
    module.get_device_properties = lambda device=None: props
    module.reset_peak_memory_stats = lambda device=None: None
    module.empty_cache = lambda: None
    module.memory_stats = lambda device=None: {}
    module.synchronize = lambda device=None: None
    return module


def patch_device() -> None:
    """Before TorchTitan is imported: its ``tools.utils`` picks the device at import."""
    if os.environ.get("TORCH_DEVICE_BACKEND_AUTOLOAD") != "0":
        raise SystemExit("titan_runner: TORCH_DEVICE_BACKEND_AUTOLOAD=0 (the CPU, not tpu)")
    import torch._utils

    cpu = _cpu_device_module()
    get_module = torch._utils._get_device_module
    torch._utils._get_available_device_type = lambda: "cpu"
    torch._utils._get_device_module = lambda device_type=None: (
        cpu if device_type == "cpu" else get_module(device_type)
    )


def patch_reference() -> None:
    import torchtitan.tools.utils as titan_utils

    assert titan_utils.device_type == "cpu", "torchtitan was imported before patch_device()"

    from torch.nn.attention import flex_attention as flex
    from torchtitan.models.common import attention

    # torch's eager flex_attention (its dense implementation, through the backend
    # "eager"), which refuses CPU inputs that require grad by this check alone: the
    # dense implementation has a backward
    flex._validate_device = lambda query, key, value: None
    attention.FlexAttention._compiled_flex_attn = flex.flex_attention
    attention._compiled_create_block_mask = flex.create_block_mask

    from torch.distributed.fsdp._fully_shard import _fsdp_collectives

    factors = _fsdp_collectives._get_gradient_divide_factors

    def sum_then_divide(rs_group, ar_group, dtype, device_type="", factor=None, force_sum=False):
        return factors(rs_group, ar_group, dtype, device_type, factor, True)

    _fsdp_collectives._get_gradient_divide_factors = sum_then_divide


#: The exit code when TorchTitan does not import (tests/test_torchtitan.py skips then).
IMPORT_FAILED = 77


def main() -> None:
    patch_device()
    try:
        import torchtitan.models.llama3.config_registry  # noqa: F401
        from torchtitan.train import main as titan_main
    except Exception:  # triton absent beside torch 2.13.0's CPU build, a dependency missing
        traceback.print_exc()
        sys.exit(IMPORT_FAILED)
    patch_reference()
    sys.argv = ["torchtitan.train", *sys.argv[1:]]
    titan_main()


if __name__ == "__main__":
    main()
