"""PyTorch Lightning on tpu, through Lightning's accelerator registry.

    import torchtpu.lightning  # registers the accelerator "torchtpu"
    trainer = L.Trainer(accelerator="torchtpu", devices=1)
    # or: L.Trainer(accelerator=torchtpu.lightning.TPUAccelerator(), devices=1)

In Lightning the name "tpu" is PyTorch/XLA's (its XLAAccelerator, chosen by name before
anything is asked of the registry), and ``accelerator="auto"`` only picks Lightning's
own accelerators: so the name is "torchtpu". Importing this module registers the
accelerator with each Lightning that is installed (the ``lightning`` package's
``lightning.pytorch`` and the standalone ``pytorch_lightning``); `TPUAccelerator` is the
class for ``lightning.pytorch`` when it is installed, else for ``pytorch_lightning``.
``precision="bf16-mixed"`` runs the forward under ``torch.autocast("tpu")``.

Note [Lightning's strategy for a new accelerator]
    Lightning 2.x picks the strategy before it asks the accelerator anything: for one
    device of an accelerator it does not know, ``SingleDeviceStrategy(device="cpu")``,
    with a mixed-precision plugin made for "cuda" (``_AcceleratorConnector.
    _choose_strategy`` and ``_check_and_init_precision``). The accelerator's
    ``setup(trainer)`` hook runs before the strategy moves the model and the optimizer
    state to its device, so that is where a CPU root device becomes the tpu device the
    accelerator was given, and the precision plugin's autocast device becomes "tpu".
    Several devices choose DDP: one process per device, each computing on its tpu:0
    (`get_parallel_devices`), the gradients all-reduced by the "tpu" process group.
"""

from __future__ import annotations

import importlib
from typing import Any

import torch

__all__ = ["TPUAccelerator"]

NAME = "torchtpu"


def _parse_devices(devices: Any) -> list[int]:
    """Device indices from Trainer's ``devices``: a count, -1 for all, a list, "0,1".

    Several devices are several processes, one device each (Lightning launches them;
    Note [One device per launched process] in device.py): their count is not checked
    here, where asking JAX would start it in this process, which then could not join
    the others."""
    if isinstance(devices, str):
        text = devices.strip()
        devices = [int(d) for d in text.split(",") if d.strip()] if "," in text else int(text)
    if isinstance(devices, int):
        if devices > 1:
            return list(range(devices))
        devices = list(range(torch.tpu.device_count())) if devices == -1 else list(range(devices))
    devices = list(devices)
    if len(devices) > 1:
        return devices
    count = torch.tpu.device_count()
    if not devices or not 0 <= devices[0] < count:
        raise ValueError(
            f"Trainer(accelerator={NAME!r}, devices={devices!r}): this process has "
            f"{count} tpu device(s) (tpu:0 .. tpu:{count - 1})"
        )
    return devices


def _define(lightning_pytorch) -> type:
    """The accelerator class of one Lightning (``lightning.pytorch`` or
    ``pytorch_lightning``), whose base classes it derives from."""
    Accelerator = lightning_pytorch.accelerators.Accelerator
    SingleDeviceStrategy = lightning_pytorch.strategies.SingleDeviceStrategy
    DDPStrategy = lightning_pytorch.strategies.DDPStrategy
    MixedPrecision = lightning_pytorch.plugins.precision.MixedPrecision

    class TPUAccelerator(Accelerator):
        """Lightning's accelerator for torchtpu's "tpu" devices."""

        def setup_device(self, device: torch.device) -> None:
            if device.type == "tpu":
                torch.tpu.set_device(device)

        def setup(self, trainer) -> None:
            strategy = trainer.strategy
            if type(strategy) is SingleDeviceStrategy and strategy.root_device.type != "tpu":
                device = _chosen_device(trainer)
                strategy._root_device = device  # where Lightning 2.x keeps it
                self.setup_device(device)
            precision = strategy.precision_plugin
            if isinstance(precision, MixedPrecision) and precision.device != "tpu":
                precision.device = "tpu"
            if isinstance(strategy, DDPStrategy):
                # Lightning's DDPStrategy wraps the model under torch.cuda.stream(...)
                # whenever it has device ids; DDP needs none for a module on one device
                # (Lightning moves each batch itself), so it is given none.
                strategy.determine_ddp_device_ids = lambda: None

        def teardown(self) -> None:
            pass

        def get_device_stats(self, device) -> dict[str, Any]:
            return torch.tpu.memory_stats(device)

        @staticmethod
        def parse_devices(devices: Any) -> list[int]:
            return _parse_devices(devices)

        @staticmethod
        def get_parallel_devices(devices: list[int]) -> list[torch.device]:
            if len(devices) > 1:  # one process each, whose device is its tpu:0
                return [torch.device("tpu", 0)] * len(devices)
            return [torch.device("tpu", i) for i in devices]

        @staticmethod
        def auto_device_count() -> int:
            return torch.tpu.device_count()

        @staticmethod
        def is_available() -> bool:
            return torch.tpu.is_available()

        @staticmethod
        def name() -> str:
            return NAME

        @classmethod
        def register_accelerators(cls, accelerator_registry) -> None:
            accelerator_registry.register(
                NAME, cls, description="torchtpu: tpu tensors through JAX", override=True
            )

    TPUAccelerator.__module__ = __name__
    return TPUAccelerator


def _chosen_device(trainer) -> torch.device:
    """The device Trainer's ``devices`` named (``get_parallel_devices``' one device),
    which Lightning 2.x keeps on its accelerator connector."""
    chosen = getattr(trainer._accelerator_connector, "_parallel_devices", None)
    if chosen and isinstance(chosen[0], torch.device) and chosen[0].type == "tpu":
        return chosen[0]
    return torch.device("tpu", torch.tpu.current_device())


def _register() -> type | None:
    """Register the accelerator with every installed Lightning; the class of the first."""
    first = None
    for name in ("lightning.pytorch", "pytorch_lightning"):
        try:
            module = importlib.import_module(name)
        except ImportError:
            continue
        cls = _define(module)
        cls.register_accelerators(module.accelerators.AcceleratorRegistry)
        first = first or cls
    return first


TPUAccelerator = _register()
if TPUAccelerator is None:
    raise ImportError(
        "torchtpu.lightning needs PyTorch Lightning: pip install lightning (or pytorch-lightning)"
    )
