"""PyTorch Lightning's Trainer on tpu (torchtpu.lightning), against the same fit on CPU."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import warnings

import pytest
import torch

import torchtpu

L = pytest.importorskip("lightning", reason="Lightning is a test extra: pip install -e .[test]")
torchtpu_lightning = pytest.importorskip("torchtpu.lightning")


class _Regressor(L.LightningModule):
    def __init__(self):
        super().__init__()
        self.net = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 1))
        self.dtypes = set()  # of the first layer's outputs, seen in training steps

    def training_step(self, batch, index):
        x, y = batch
        hidden = self.net[0](x)
        self.dtypes.add(hidden.dtype)
        loss = torch.nn.functional.mse_loss(self.net[2](self.net[1](hidden)).float(), y)
        self.log("loss", loss)
        return loss

    def validation_step(self, batch, index):
        x, y = batch
        self.log("val_loss", torch.nn.functional.mse_loss(self.net(x), y))

    def predict_step(self, batch, index):
        return self.net(batch[0])

    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters(), lr=0.01)


def _fit(accelerator, precision="32-true"):
    torch.manual_seed(0)
    x, y = torch.randn(64, 8), torch.randn(64, 1)
    loader = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(x, y), batch_size=16)
    model = _Regressor()
    trainer = L.Trainer(
        accelerator=accelerator, devices=1, max_epochs=2, precision=precision, logger=False,
        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
    )  # fmt: skip
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # Lightning's advice (num_workers, logging)
        trainer.fit(model, loader, loader)
        model.val_loss = trainer.callback_metrics["val_loss"].item()
        predictions = torch.cat(trainer.predict(model, loader))
    return trainer, model, predictions


def _assert_same_fit(tpu_run, cpu_run, **tolerance):
    (_, tpu_model, tpu_predictions), (_, cpu_model, cpu_predictions) = tpu_run, cpu_run
    for a, b in zip(tpu_model.parameters(), cpu_model.parameters(), strict=True):
        torch.testing.assert_close(a.detach().cpu(), b.detach(), **tolerance)
    assert tpu_predictions.device.type == "cpu"  # Lightning moves outputs back, as from cuda
    torch.testing.assert_close(tpu_predictions, cpu_predictions, **tolerance)


@pytest.mark.parametrize("mode", ["strict", "defer"])
@pytest.mark.parametrize("how", ["name", "object"])
def test_fit_on_tpu_matches_cpu(mode, how):
    cpu_run = _fit("cpu")
    accelerator = "torchtpu" if how == "name" else torchtpu_lightning.TPUAccelerator()
    torchtpu.reset_metrics()
    with torch.tpu.set_eager_mode(mode):
        tpu_run = _fit(accelerator)
    trainer = tpu_run[0]
    assert isinstance(trainer.accelerator, torchtpu_lightning.TPUAccelerator)
    assert trainer.strategy.root_device == torch.device("tpu", 0)  # no strategy passed
    assert sum(torchtpu.metrics()["ops"].values()) > 0
    assert not torchtpu.metrics().get("fallback")
    _assert_same_fit(tpu_run, cpu_run)
    assert tpu_run[1].val_loss == pytest.approx(cpu_run[1].val_loss, rel=1e-5)


def test_bf16_mixed_autocasts_on_tpu():
    # Lightning makes its mixed-precision plugin for "cuda" on any accelerator but the
    # CPU; on tpu the forward must run under autocast("tpu"), as on the CPU run.
    cpu_run = _fit("cpu", "bf16-mixed")
    tpu_run = _fit("torchtpu", "bf16-mixed")
    assert tpu_run[1].dtypes == cpu_run[1].dtypes == {torch.bfloat16}
    _assert_same_fit(tpu_run, cpu_run, atol=2e-2, rtol=2e-2)


def test_a_device_beyond_the_process_is_a_clear_error():
    with pytest.raises(ValueError, match=r"devices=\[3\].*tpu device"):
        L.Trainer(accelerator="torchtpu", devices=[3], logger=False)


_DDP_FIT = r"""
import json, os, sys
import torch
import lightning as L
import torchtpu.lightning  # noqa: F401


class Regressor(L.LightningModule):
    def __init__(self):
        super().__init__()
        self.net = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 1))

    def training_step(self, batch, index):
        x, y = batch
        return torch.nn.functional.mse_loss(self.net(x), y)

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.05)


accelerator, out = sys.argv[1], sys.argv[2]
torch.manual_seed(0)
x, y = torch.randn(64, 8), torch.randn(64, 1)
loader = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(x, y), batch_size=8)
model = Regressor()
trainer = L.Trainer(accelerator=accelerator, devices=2, max_epochs=2, logger=False,
                    enable_checkpointing=False, enable_progress_bar=False,
                    enable_model_summary=False)
trainer.fit(model, loader)
if trainer.global_rank == 0:
    with open(out, "w") as f:
        json.dump({"strategy": type(trainer.strategy).__name__,
                   "backend": torch.distributed.get_backend() if torch.distributed.is_initialized() else None,
                   "device": str(trainer.strategy.root_device),
                   "params": [p.detach().cpu().flatten().tolist() for p in model.parameters()]}, f)
"""


def test_two_devices_train_with_ddp_as_on_cpu(tmp_path):
    # Lightning launches the second process itself (its script launcher runs this
    # script again); no strategy is passed. Against Lightning's DDP on the CPU (gloo).
    script = tmp_path / "fit.py"
    script.write_text(_DDP_FIT)
    env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
    env["PYTHONPATH"] = os.pathsep.join([os.path.join(os.path.dirname(__file__), "..", "src"), env.get("PYTHONPATH", "")])
    got = {}
    for accelerator in ("cpu", "torchtpu"):
        out = tmp_path / f"{accelerator}.json"
        run = subprocess.run(
            [sys.executable, str(script), accelerator, str(out)],
            env=env, cwd=tmp_path, capture_output=True, text=True, timeout=300,
        )  # fmt: skip
        assert run.returncode == 0, (run.stdout + run.stderr)[-4000:]
        got[accelerator] = json.loads(out.read_text())
    tpu, cpu = got["torchtpu"], got["cpu"]
    assert (tpu["strategy"], tpu["backend"], tpu["device"]) == ("DDPStrategy", "tpu", "tpu:0")
    assert cpu["backend"] == "gloo"
    for a, b in zip(tpu["params"], cpu["params"], strict=True):
        torch.testing.assert_close(torch.tensor(a), torch.tensor(b), rtol=1e-5, atol=1e-6)
