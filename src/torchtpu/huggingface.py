"""Transformers beside torchtpu: where its checks take torchtpu's "tpu" for Google's.

Nothing here imports Transformers: `install` (run when torchtpu registers the device)
corrects its checks when it is imported, or at once if it already is.

Note [Transformers' flex_attention check]
    Transformers 5.x answers ``is_torch_flex_attn_available()`` with "not on a tpu
    host": ``torch.accelerator.current_accelerator()`` must not be "tpu", because
    Google's ``torch_tpu`` refuses flex_attention's tpu tensors. torchtpu registers
    "tpu" as soon as torch is imported, so with torchtpu installed Transformers turned
    flex_attention off everywhere: ``attn_implementation="flex_attention"`` raised "PyTorch
    Flex Attention is not supported on TPU." for tpu and CPU models alike, and
    ``masking_utils`` built no block masks (it imports ``BlockMask`` only when the
    check passes at its import). torchtpu's flex_attention runs on tpu tensors
    (docs/attention.md), so the check also passes where the "tpu" is torchtpu's: the
    function is replaced in ``transformers.utils.import_utils`` right after that module
    runs (a finder on ``sys.meta_path`` waits for it), before the modules that import
    it by name; if Transformers was imported before torch, in every ``transformers``
    module that already holds it.
"""

from __future__ import annotations

import importlib.abc
import importlib.util
import sys

_CHECKS = "transformers.utils.import_utils"


def install() -> None:
    """Correct Transformers' checks now if it is imported, else when it is."""
    module = sys.modules.get(_CHECKS)
    if module is not None:
        _correct(module)
    elif not any(isinstance(finder, _WhenImported) for finder in sys.meta_path):
        sys.meta_path.insert(0, _WhenImported())


class _WhenImported(importlib.abc.MetaPathFinder):
    """Finds nothing itself: it has the import system find Transformers' checks module
    and corrects the module once it has run."""

    def find_spec(self, name, path=None, target=None):
        if name != _CHECKS:
            return None
        sys.meta_path.remove(self)  # its job is done once, and find_spec below must not find it
        spec = importlib.util.find_spec(name)
        if spec is None or spec.loader is None or not hasattr(spec.loader, "exec_module"):
            return spec
        run = spec.loader.exec_module

        def exec_module(module):
            run(module)
            _correct(module)

        spec.loader.exec_module = exec_module
        return spec


def _correct(checks) -> None:
    """Note [Transformers' flex_attention check]"""
    original = getattr(checks, "is_torch_flex_attn_available", None)
    if original is None or getattr(original, "torchtpu", False):
        return

    def is_torch_flex_attn_available() -> bool:
        # This runs only where torchtpu registered "tpu": a tpu accelerator is torchtpu's.
        return original() or checks.is_torch_available()

    is_torch_flex_attn_available.torchtpu = True
    is_torch_flex_attn_available.__doc__ = original.__doc__
    for name, module in list(sys.modules.items()):
        if (
            name.startswith("transformers")
            and vars(module).get("is_torch_flex_attn_available") is original
        ):
            module.is_torch_flex_attn_available = is_torch_flex_attn_available
