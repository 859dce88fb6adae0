"""Diffusers on tpu, unmodified: a UNet2DModel training step and a DDPMPipeline, against
the same on the CPU."""

from __future__ import annotations

import numpy as np
import pytest
import torch

diffusers = pytest.importorskip("diffusers", reason="Diffusers is a test extra: pip install -e .[test]")


def _unet():
    torch.manual_seed(0)
    return diffusers.UNet2DModel(
        sample_size=16, in_channels=3, out_channels=3, layers_per_block=1,
        block_out_channels=(16, 32), norm_num_groups=8,
        down_block_types=("DownBlock2D", "AttnDownBlock2D"),
        up_block_types=("AttnUpBlock2D", "UpBlock2D"),
    )  # fmt: skip


def _train(device):
    """Two AdamW steps of the denoising loss; (losses, parameters after)."""
    model = _unet().to(device)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    generator = torch.Generator().manual_seed(1)
    losses = []
    for _ in range(2):
        x = torch.randn(2, 3, 16, 16, generator=generator).to(device)
        noise = torch.randn(2, 3, 16, 16, generator=generator).to(device)
        timesteps = torch.tensor([10, 500]).to(device)
        opt.zero_grad()
        loss = torch.nn.functional.mse_loss(model(x, timesteps).sample, noise)
        loss.backward()
        opt.step()
        losses.append(loss.item())
    return losses, [p.detach().cpu() for p in model.parameters()]


@pytest.mark.parametrize("mode", ["strict", "defer"])
def test_unet2d_training_steps_match_cpu(mode):
    cpu_losses, cpu_params = _train("cpu")
    with torch.tpu.set_eager_mode(mode):
        losses, params = _train("tpu")
    assert losses == pytest.approx(cpu_losses, rel=1e-5)
    # AdamW's first steps move each weight by ~lr whatever the gradient's size, so a
    # gradient's rounding shows at lr's scale.
    for a, b in zip(params, cpu_params, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-4)


def test_ddpm_pipeline_matches_cpu():
    def images(device):
        pipe = diffusers.DDPMPipeline(
            unet=_unet(), scheduler=diffusers.DDPMScheduler(num_train_timesteps=50)
        ).to(device)
        pipe.set_progress_bar_config(disable=True)
        generator = torch.Generator().manual_seed(0)  # the noise drawn on the CPU, as users do
        return pipe(batch_size=1, generator=generator, num_inference_steps=3, output_type="np").images

    np.testing.assert_allclose(images("tpu"), images("cpu"), atol=1e-5)
