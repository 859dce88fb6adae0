"""A wider sweep: timm models and Diffusers blocks on tpu against the CPU.

``python -m torchtpu.zoo.libraries --out docs/models.md`` builds each model of
``TIMM`` (``timm.create_model(name, pretrained=False)``: timm's ``test_*`` models and
small variants of its families, on small images) and ``DIFFUSERS`` (UNets, autoencoders
and transformers from tiny configs that, together, use every down, mid and up block
type Diffusers' ``get_down_block``/``get_mid_block``/``get_up_block`` build), on the CPU
with a fixed seed, copies it to tpu, and compares:

- **forward**: the eval-mode output;
- **train**: the train-mode output, the loss (cross-entropy for timm's classifiers, the
  mean squared error to a random target for Diffusers' models), every parameter's
  gradient after ``loss.backward()`` and every buffer (batch norms' running statistics).

Each runs in each eager mode of ``--modes`` (Strict and DeferAndFuse unless told). The
report goes between the markers ``BEGIN`` and ``END`` of ``--out``: the rest of the
file (the Transformers zoo's report, ``python -m torchtpu.zoo``) is kept, and ``python
-m torchtpu.zoo`` keeps this block when it rewrites the file (``keep_block``).
``--library``, ``--only`` and ``--limit`` narrow the run; ``--update`` reruns them and
keeps the other results of the last run (the ``.json`` written next to ``--out``:
another mode's too), ``--resume`` runs only the models that have no results yet,
``--rewrite`` writes the block again from that ``.json``.

timm and Diffusers (and torchvision, which timm imports where it can) are imported
only when a model is built or the report lists Diffusers' block types: this module
imports without them.
"""

from __future__ import annotations

import argparse
import copy
import dataclasses
import json
import os
import re
import sys
import time
import traceback
import warnings
from collections.abc import Callable
from dataclasses import dataclass

import torch

import torchtpu
from torchtpu.zoo.check import Outcome, _compare

BEGIN = "<!-- libraries: begin -->"
END = "<!-- libraries: end -->"
CHECKS = ("forward", "train")
MODES = ("strict", "defer")
BATCH = 2
SEED = 0
_CPU_FAILS = ("building it on the CPU fails", "the CPU run fails too")
FLOAT64_SAME = 1e-8  # float64 runs closer than this (relative) compute the same function

# -- the models ---------------------------------------------------------------------------------


@dataclass(frozen=True, eq=False)
class Entry:
    """One model: how to build it on the CPU, its inputs and its training loss."""

    name: str
    library: str  # "timm" or "diffusers"
    build: Callable[[], torch.nn.Module]
    # -> (keyword arguments of forward(), the loss's target), CPU tensors
    inputs: Callable[[torch.Generator], tuple[dict, torch.Tensor]]
    output: Callable[[object], torch.Tensor]  # the tensor compared, from forward()'s result
    loss: Callable[[torch.Tensor, torch.Tensor], torch.Tensor]
    covers: str = ""  # what the model is there for (the report's second column)


# timm: (name, image size, extra keyword arguments of create_model, what it covers)
_TIMM: list[tuple[str, int, dict, str]] = [
    # timm's own test models: every family in miniature
    ("test_resnet", 64, {}, "ResNet basic blocks"),
    ("test_byobnet", 64, {}, "BYOB: bottleneck, self-attention-free blocks"),
    ("test_efficientnet", 64, {}, "EfficientNet/MobileNetV3 blocks, BatchNormAct2d"),
    ("test_efficientnet_gn", 64, {}, "EfficientNet with GroupNorm"),
    ("test_efficientnet_ln", 64, {}, "EfficientNet with LayerNorm2d"),
    ("test_efficientnet_evos", 64, {}, "EfficientNet with EvoNorm"),
    ("test_convnext", 64, {}, "ConvNeXt"),
    ("test_convnext2", 64, {}, "ConvNeXt, conv MLP"),
    ("test_convnext3", 64, {}, "ConvNeXt, other norms"),
    ("test_nfnet", 64, {}, "NFNet: scaled weight standardization"),
    ("test_vit", 64, {"img_size": 64}, "ViT"),
    ("test_vit2", 64, {"img_size": 64}, "ViT variant"),
    ("test_vit3", 64, {"img_size": 64}, "ViT variant"),
    ("test_vit4", 64, {"img_size": 64}, "ViT variant"),
    ("test_vit_relpos", 64, {"img_size": 64}, "ViT, relative position bias"),
    ("test_coatnet", 64, {"img_size": 64}, "CoAtNet: MBConv + relative attention"),
    ("test_maxvit", 64, {"img_size": 64}, "MaxViT: block and grid attention"),
    ("test_mambaout", 64, {}, "MambaOut: gated CNN"),
    # small variants of other families
    ("resnet10t", 64, {}, "ResNet-D, tiered stem"),
    ("mobilenetv3_small_050", 64, {}, "MobileNetV3, hard-swish, squeeze-excite"),
    ("lcnet_050", 64, {}, "PP-LCNet"),
    ("ghostnet_050", 64, {}, "GhostNet"),
    ("mnasnet_small", 64, {}, "MnasNet"),
    ("regnetx_002", 64, {}, "RegNetX: grouped convolutions"),
    ("convnext_atto", 64, {}, "ConvNeXt atto"),
    ("densenet121", 64, {}, "DenseNet: concatenated features"),
    ("dla46_c", 64, {}, "DLA: tree aggregation"),
    ("deit_tiny_distilled_patch16_224", 64, {"img_size": 64}, "DeiT with distillation token"),
    (
        "swin_tiny_patch4_window7_224",
        64,
        {
            "img_size": 64,
            "window_size": 4,
            "embed_dim": 32,
            "depths": (1, 1, 1, 1),
            "num_heads": (1, 2, 4, 8),
        },
        "Swin: shifted windows",
    ),
    ("mixer_s32_224", 64, {"img_size": 64}, "MLP-Mixer"),
    ("gmlp_ti16_224", 64, {"img_size": 64}, "gMLP: spatial gating"),
    ("resmlp_12_224", 64, {"img_size": 64}, "ResMLP: affine norms"),
    ("poolformer_s12", 64, {}, "PoolFormer (MetaFormer)"),
    ("levit_128s", 64, {"img_size": 64}, "LeViT: attention with biases, BatchNorm linears"),
    ("pvt_v2_b0", 64, {}, "PVTv2: spatial-reduction attention"),
    ("mobilevit_xxs", 64, {}, "MobileViT: unfolded patches"),
    ("edgenext_xx_small", 64, {}, "EdgeNeXt: split depthwise transposed attention"),
    ("xcit_nano_12_p16_224", 64, {"img_size": 64, "depth": 2}, "XCiT: cross-covariance"),
    ("convit_tiny", 64, {"img_size": 64, "depth": 2}, "ConViT: gated positional attention"),
    ("eva02_tiny_patch14_224", 56, {"img_size": 56, "depth": 2}, "EVA-02: rotary embeddings"),
    ("efficientformerv2_s0", 64, {"img_size": 64}, "EfficientFormerV2"),
    ("fastvit_t8", 64, {}, "FastViT: reparameterizable blocks"),
]


def _timm_build(name: str, options: dict):
    def build():
        import timm

        torch.manual_seed(SEED)
        return timm.create_model(name, pretrained=False, num_classes=10, **options)

    return build


def _timm_inputs(size: int):
    def inputs(generator):
        x = torch.randn(BATCH, 3, size, size, generator=generator)
        return {"x": x}, torch.randint(0, 10, (BATCH,), generator=generator)

    return inputs


def _mse(output, target):
    return torch.nn.functional.mse_loss(output, target)


def _cross_entropy(output, target):
    return torch.nn.functional.cross_entropy(output, target)


def _sample(output):
    return output.sample if hasattr(output, "sample") else output[0]


TIMM: list[Entry] = [
    Entry(
        name,
        "timm",
        _timm_build(name, options),
        _timm_inputs(size),
        lambda out: out,
        _cross_entropy,
        f"{covers}; {size}x{size}",
    )
    for name, size, options, covers in _TIMM
]


# -- Diffusers ----------------------------------------------------------------------------------


def _diffusers_build(class_name: str, config: dict):
    def build():
        import diffusers

        torch.manual_seed(SEED)
        return getattr(diffusers, class_name)(**config)

    return build


def _unet_inputs(channels: int, size: int, context: tuple[int, int] | None = None, **extra):
    """A noisy sample, timesteps, the cross-attention context; the target noise."""

    def inputs(generator):
        sample = torch.randn(BATCH, channels, size, size, generator=generator)
        kwargs = {"sample": sample, "timestep": torch.tensor([10, 500])}
        if context:
            kwargs["encoder_hidden_states"] = torch.randn(BATCH, *context, generator=generator)
        for key, make in extra.items():
            kwargs[key] = make(generator)
        return kwargs, torch.randn(sample.shape, generator=generator)

    return inputs


def _image_inputs(channels: int, size: int):
    def inputs(generator):
        sample = torch.randn(BATCH, channels, size, size, generator=generator)
        return {"sample": sample}, torch.randn(sample.shape, generator=generator)

    return inputs


_UNET2D = dict(
    sample_size=16,
    in_channels=3,
    out_channels=3,
    layers_per_block=1,
    block_out_channels=(16, 32),
    norm_num_groups=8,
    attention_head_dim=8,
)
_UNET2D_CONDITION = dict(
    sample_size=8,
    in_channels=4,
    out_channels=4,
    layers_per_block=1,
    block_out_channels=(16, 32),
    norm_num_groups=8,
    cross_attention_dim=16,
    attention_head_dim=8,
)
_AUTOENCODER = dict(
    in_channels=3,
    out_channels=3,
    block_out_channels=(16, 32),
    layers_per_block=1,
    latent_channels=4,
    norm_num_groups=8,
    sample_size=16,
)


def _diffusers(name, class_name, config, inputs, covers="", output=_sample):
    return Entry(
        name, "diffusers", _diffusers_build(class_name, config), inputs, output, _mse, covers
    )


DIFFUSERS: list[Entry] = [
    _diffusers(
        "UNet2DModel (attention)",
        "UNet2DModel",
        dict(
            _UNET2D,
            down_block_types=("DownBlock2D", "AttnDownBlock2D"),
            up_block_types=("AttnUpBlock2D", "UpBlock2D"),
            mid_block_type="UNetMidBlock2D",
        ),
        _unet_inputs(3, 16),
        "DDPM's UNet",
    ),
    _diffusers(
        "UNet2DModel (resnet sampling)",
        "UNet2DModel",
        dict(
            _UNET2D,
            down_block_types=("ResnetDownsampleBlock2D", "ResnetDownsampleBlock2D"),
            up_block_types=("ResnetUpsampleBlock2D", "ResnetUpsampleBlock2D"),
            resnet_time_scale_shift="scale_shift",
            time_embedding_type="learned",
            num_train_timesteps=1000,
        ),
        _unet_inputs(3, 16),
        "scale-shift time conditioning, learned time embedding",
    ),
    _diffusers(
        "UNet2DModel (skip, NCSN++)",
        "UNet2DModel",
        dict(
            _UNET2D,
            down_block_types=("SkipDownBlock2D", "AttnSkipDownBlock2D"),
            up_block_types=("AttnSkipUpBlock2D", "SkipUpBlock2D"),
            block_out_channels=(32, 64),
            norm_num_groups=8,
            time_embedding_type="fourier",
            resnet_time_scale_shift="scale_shift",
        ),
        _unet_inputs(3, 16),
        "FIR up/downsampling (upfirdn2d), Fourier time embedding",
    ),
    _diffusers(
        "UNet2DModel (class-conditional)",
        "UNet2DModel",
        dict(
            _UNET2D,
            down_block_types=("DownBlock2D", "AttnDownBlock2D"),
            up_block_types=("AttnUpBlock2D", "UpBlock2D"),
            num_class_embeds=5,
            class_embed_type=None,
            downsample_type="resnet",
            upsample_type="resnet",
        ),
        _unet_inputs(3, 16, class_labels=lambda g: torch.tensor([1, 3])),
        "class embeddings, ResNet down/upsamplers",
    ),
    _diffusers(
        "UNet2DConditionModel (cross-attention)",
        "UNet2DConditionModel",
        dict(
            _UNET2D_CONDITION,
            down_block_types=("CrossAttnDownBlock2D", "DownBlock2D"),
            up_block_types=("UpBlock2D", "CrossAttnUpBlock2D"),
            mid_block_type="UNetMidBlock2DCrossAttn",
        ),
        _unet_inputs(4, 8, context=(5, 16)),
        "Stable Diffusion's UNet",
    ),
    _diffusers(
        "UNet2DConditionModel (simple cross-attention)",
        "UNet2DConditionModel",
        dict(
            _UNET2D_CONDITION,
            down_block_types=("ResnetDownsampleBlock2D", "SimpleCrossAttnDownBlock2D"),
            up_block_types=("SimpleCrossAttnUpBlock2D", "ResnetUpsampleBlock2D"),
            mid_block_type="UNetMidBlock2DSimpleCrossAttn",
            resnet_time_scale_shift="scale_shift",
            encoder_hid_dim=16,
            encoder_hid_dim_type="text_proj",
        ),
        _unet_inputs(4, 8, context=(5, 16)),
        "UnCLIP/DeepFloyd IF's UNet",
    ),
    _diffusers(
        "UNet2DConditionModel (k-upscaler)",
        "UNet2DConditionModel",
        dict(
            _UNET2D_CONDITION,
            # K blocks norm groups of 32 channels; smaller configs (two levels, one layer
            # a block, or 32 channels throughout) fail on the CPU too
            down_block_types=("KDownBlock2D", "KCrossAttnDownBlock2D", "KCrossAttnDownBlock2D"),
            up_block_types=("KCrossAttnUpBlock2D", "KCrossAttnUpBlock2D", "KUpBlock2D"),
            block_out_channels=(32, 64, 64),
            layers_per_block=2,
            mid_block_type=None,
            act_fn="gelu",
            time_embedding_type="fourier",
            time_embedding_act_fn="gelu",
            timestep_post_act="gelu",
            resnet_time_scale_shift="scale_shift",
            conv_in_kernel=1,
            conv_out_kernel=1,
            time_cond_proj_dim=16,
            norm_num_groups=None,
        ),
        _unet_inputs(
            4, 8, context=(5, 16), timestep_cond=lambda g: torch.randn(BATCH, 16, generator=g)
        ),
        "Stable Diffusion's x2 latent upscaler: K blocks",
    ),
    _diffusers(
        "AutoencoderKL",
        "AutoencoderKL",
        dict(
            _AUTOENCODER,
            down_block_types=("DownEncoderBlock2D", "DownEncoderBlock2D"),
            up_block_types=("UpDecoderBlock2D", "UpDecoderBlock2D"),
        ),
        _image_inputs(3, 16),
        "Stable Diffusion's VAE (posterior mode)",
    ),
    _diffusers(
        "AutoencoderKL (attention blocks)",
        "AutoencoderKL",
        dict(
            _AUTOENCODER,
            down_block_types=("DownEncoderBlock2D", "AttnDownEncoderBlock2D"),
            up_block_types=("AttnUpDecoderBlock2D", "UpDecoderBlock2D"),
        ),
        _image_inputs(3, 16),
        "VAE with attention in the encoder and decoder",
    ),
    _diffusers(
        "VQModel",
        "VQModel",
        dict(
            _AUTOENCODER,
            down_block_types=("DownEncoderBlock2D", "DownEncoderBlock2D"),
            up_block_types=("UpDecoderBlock2D", "UpDecoderBlock2D"),
            num_vq_embeddings=32,
            vq_embed_dim=4,
        ),
        _image_inputs(3, 16),
        "vector quantization: nearest code, straight-through",
    ),
    _diffusers(
        "AutoencoderTiny",
        "AutoencoderTiny",
        dict(
            encoder_block_out_channels=(16, 16),
            decoder_block_out_channels=(16, 16),
            num_encoder_blocks=(1, 1),
            num_decoder_blocks=(1, 1),
            latent_channels=4,
        ),
        _image_inputs(3, 16),
        "TAESD",
    ),
    _diffusers(
        "Transformer2DModel",
        "Transformer2DModel",
        dict(
            num_attention_heads=2,
            attention_head_dim=8,
            in_channels=16,
            num_layers=1,
            cross_attention_dim=16,
            norm_num_groups=8,
        ),
        lambda g: (
            {
                "hidden_states": torch.randn(BATCH, 16, 8, 8, generator=g),
                "encoder_hidden_states": torch.randn(BATCH, 5, 16, generator=g),
            },
            torch.randn(BATCH, 16, 8, 8, generator=g),
        ),
        "continuous input, self- and cross-attention",
    ),
    _diffusers(
        "DiTTransformer2DModel",
        "DiTTransformer2DModel",
        dict(
            num_attention_heads=2,
            attention_head_dim=8,
            in_channels=4,
            out_channels=8,
            num_layers=2,
            sample_size=8,
            patch_size=2,
            num_embeds_ada_norm=1000,
        ),
        lambda g: (
            {
                "hidden_states": torch.randn(BATCH, 4, 8, 8, generator=g),
                "timestep": torch.tensor([10, 500]),
                "class_labels": torch.tensor([1, 7]),
            },
            torch.randn(BATCH, 8, 8, 8, generator=g),
        ),
        "DiT: adaLN-Zero, patches",
    ),
    _diffusers(
        "SD3Transformer2DModel",
        "SD3Transformer2DModel",
        dict(
            sample_size=8,
            patch_size=2,
            in_channels=4,
            num_layers=2,
            attention_head_dim=8,
            num_attention_heads=2,
            joint_attention_dim=16,
            caption_projection_dim=16,
            pooled_projection_dim=16,
            out_channels=4,
            pos_embed_max_size=16,
        ),
        lambda g: (
            {
                "hidden_states": torch.randn(BATCH, 4, 8, 8, generator=g),
                "encoder_hidden_states": torch.randn(BATCH, 5, 16, generator=g),
                "pooled_projections": torch.randn(BATCH, 16, generator=g),
                "timestep": torch.tensor([10, 500]),
            },
            torch.randn(BATCH, 4, 8, 8, generator=g),
        ),
        "MMDiT: joint attention",
    ),
    _diffusers(
        "FluxTransformer2DModel",
        "FluxTransformer2DModel",
        dict(
            patch_size=1,
            in_channels=8,
            num_layers=1,
            num_single_layers=1,
            attention_head_dim=16,
            num_attention_heads=2,
            joint_attention_dim=16,
            pooled_projection_dim=16,
            axes_dims_rope=(4, 4, 8),
        ),
        lambda g: (
            {
                "hidden_states": torch.randn(BATCH, 16, 8, generator=g),
                "encoder_hidden_states": torch.randn(BATCH, 5, 16, generator=g),
                "pooled_projections": torch.randn(BATCH, 16, generator=g),
                "timestep": torch.tensor([0.1, 0.5]),
                "img_ids": torch.stack(
                    torch.meshgrid(
                        torch.zeros(1), torch.arange(4.0), torch.arange(4.0), indexing="ij"
                    ),
                    -1,
                ).reshape(16, 3),
                "txt_ids": torch.zeros(5, 3),
            },
            torch.randn(BATCH, 16, 8, generator=g),
        ),
        "Flux: rotary embeddings, single- and double-stream blocks",
    ),
]

ENTRIES: list[Entry] = TIMM + DIFFUSERS
BY_NAME: dict[str, Entry] = {e.name: e for e in ENTRIES}

# -- the checks ---------------------------------------------------------------------------------


def _no_randomness(model: torch.nn.Module) -> torch.nn.Module:
    """Dropout and drop-path off: tpu's and the CPU's generators differ."""
    for module in model.modules():
        if isinstance(module, torch.nn.modules.dropout._DropoutNd):
            module.p = 0.0
        # timm's drop-path and head dropout; Diffusers' label dropout (DiT's classes)
        for attribute in ("drop_prob", "drop_path_prob", "drop_rate", "dropout_prob"):
            if isinstance(getattr(module, attribute, None), float):
                setattr(module, attribute, 0.0)
    return model


def _batch(entry: Entry, device: str, dtype=None):
    kwargs, target = entry.inputs(torch.Generator().manual_seed(SEED + 1))

    def move(t):
        if dtype is not None and t.is_floating_point():
            t = t.to(dtype)
        return t.to(device)

    return {k: move(v) for k, v in kwargs.items()}, move(target)


def _forward(entry: Entry, model, device: str, dtype=None) -> dict:
    model = copy.deepcopy(model).to(device).eval()
    if dtype is not None:
        model = model.to(dtype)
    kwargs, _ = _batch(entry, device, dtype)
    with torch.no_grad():
        return {"output": entry.output(model(**kwargs)).detach()}


def _train(entry: Entry, model, device: str, dtype=None) -> dict:
    model = copy.deepcopy(model).to(device).train()
    if dtype is not None:
        model = model.to(dtype)
    kwargs, target = _batch(entry, device, dtype)
    output = entry.output(model(**kwargs))
    loss = entry.loss(output, target)
    loss.backward()
    result = {"loss": loss.detach(), "output": output.detach()}
    result.update({f"grad {n}": p.grad for n, p in model.named_parameters() if p.grad is not None})
    result.update({f"buffer {n}": b.detach() for n, b in model.named_buffers()})
    return result


def _cpu(result: dict) -> dict:
    for name, value in result.items():
        if value.device.type != "tpu":
            raise AssertionError(f"{name} is on {value.device}, not tpu")
    return {name: value.cpu() for name, value in result.items()}


# The Diffusers blocks each model built (the classes of unet_2d_blocks among its
# modules), by model name; written to the .json with the outcomes.
BLOCKS: dict[str, list[str]] = {}
_BLOCKS_MODULE = "diffusers.models.unets.unet_2d_blocks"


def _blocks_of(model: torch.nn.Module) -> list[str]:
    names = [type(m).__name__ for m in model.modules() if type(m).__module__ == _BLOCKS_MODULE]
    return list(dict.fromkeys(names))


@dataclass
class LibraryOutcome(Outcome):
    # Where float32 differs beyond the tolerance: the same check run in float64 on tpu
    # and on the CPU, the largest difference of a tensor relative to its largest
    # magnitude. Tiny, it says tpu computes the same function, and float32's rounding
    # decided the difference: near a ReLU's kink an input a few ulps off can flip the
    # mask (timm's DenseNet: one of 81,920 elements, its gradient then carried back).
    float64_rel: float | None = None


def run(entry: Entry, checks=CHECKS, modes=MODES) -> list[Outcome]:
    """Every check of one model in every mode; a crash is an outcome, not an exception."""
    outcomes = [LibraryOutcome(entry.name, check, mode) for check in checks for mode in modes]
    try:
        model = _no_randomness(entry.build())
        if entry.library == "diffusers":
            BLOCKS[entry.name] = _blocks_of(model)
    except Exception as error:  # noqa: BLE001 - a broken entry of the table, not tpu's
        for o in outcomes:
            o.reason = f"{_CPU_FAILS[0]}: {_crash_reason(error)}"
        return outcomes
    expected = {}
    for check in checks:
        try:
            expected[check] = (_forward if check == "forward" else _train)(entry, model, "cpu")
        except Exception as error:  # noqa: BLE001
            expected[check] = error
    for outcome in outcomes:
        want = expected[outcome.check]
        if isinstance(want, Exception):
            outcome.reason = f"{_CPU_FAILS[1]}: {_crash_reason(want)}"
            continue
        torchtpu.reset_metrics()
        start = time.perf_counter()
        try:
            with torchtpu.set_eager_mode(outcome.mode):
                if outcome.check == "forward":
                    actual = _cpu(_forward(entry, model, "tpu"))
                else:
                    actual = _cpu(_train(entry, model, "tpu"))
        except Exception as error:  # noqa: BLE001 - the report records any failure
            outcome.crashed = True
            outcome.reason = _crash_reason(error)
        else:
            _compare(outcome, actual, want)
            if outcome.check == "train" and not outcome.passed and actual.keys() == want.keys():
                # Note [Judged against float64] in torchtpu/zoo/check.py
                _compare(outcome, actual, want, _train(entry, model, "cpu", torch.float64))
            if not outcome.passed and actual.keys() == want.keys():
                outcome.float64_rel = _float64_rel(entry, model, outcome)
        outcome.seconds = time.perf_counter() - start
        outcome.fallbacks = dict(torchtpu.metrics().get("fallback", {}))
    return outcomes


def _float64_rel(entry: Entry, model, outcome: Outcome) -> float | None:
    """The check in float64 on tpu and on the CPU: the largest relative difference."""
    check = _forward if outcome.check == "forward" else _train
    try:
        with torchtpu.set_eager_mode(outcome.mode):
            actual = _cpu(check(entry, model, "tpu", torch.float64))
        want = check(entry, model, "cpu", torch.float64)
    except Exception:  # noqa: BLE001 - float64 is extra evidence, not the check
        return None
    worst = 0.0
    for name, value in want.items():
        if value.is_floating_point() and value.numel() and name in actual:
            scale = max(value.abs().max().item(), 1e-30)
            worst = max(worst, (actual[name] - value).abs().max().item() / scale)
    return worst


def _first_line(text) -> str:
    lines = [line.strip() for line in str(text).strip().splitlines() if line.strip()]
    return (lines[0] if lines else "")[:200]


def _crash_reason(error: Exception) -> str:
    """The exception's type and first line, and the innermost frame of torchtpu, timm or
    Diffusers that raised it."""
    frames = [
        f
        for f in traceback.extract_tb(error.__traceback__)
        if any(part in f.filename for part in ("torchtpu", "timm", "diffusers"))
    ]
    where = ""
    if frames:
        path = frames[-1].filename.split("site-packages/")[-1].split("src/")[-1]
        where = f" at {path}:{frames[-1].lineno}"
    return f"{type(error).__name__}: {_first_line(error)}{where}"


# -- the report ---------------------------------------------------------------------------------


def _cell(outcome: Outcome | None) -> str:
    if outcome is None:
        return "not run"
    if _failed(outcome):
        return "**FAIL** " + _escape(outcome.reason.split(" at ")[0][:120])
    if outcome.passed:
        return f"pass {outcome.max_abs_diff:.1e}"
    if outcome.max_abs_diff is None:  # outputs or gradients missing on one side
        return "**MISMATCH** " + _escape(outcome.reason[:120])
    rel = getattr(outcome, "float64_rel", None)
    return f"**MISMATCH** {outcome.max_abs_diff:.1e}" + (
        f" (float64: {rel:.0e} relative)" if rel is not None else ""
    )


def _failed(outcome: Outcome) -> bool:
    """Crashed on tpu, or could not run (the CPU side fails: the cell says so)."""
    return outcome.crashed or outcome.reason.startswith(_CPU_FAILS)


def _float64_note(outcome: Outcome) -> str:
    rel = getattr(outcome, "float64_rel", None)
    if rel is None:
        return ""
    verdict = (
        "the same function; float32's rounding made the difference"
        if rel < FLOAT64_SAME
        else "**a real difference**"
    )
    return f". In float64, tpu and the CPU differ by {rel:.1e} of the magnitude: {verdict}"


def _escape(text: str) -> str:
    return text.replace("|", "\\|").replace("\n", " ")


def _versions() -> str:
    found = []
    for module in ("timm", "diffusers", "torch"):
        try:
            found.append(f"{module} {__import__(module).__version__}")
        except Exception:  # noqa: BLE001 - a library that does not import here
            found.append(f"{module} not importable")
    return ", ".join(found)


def _block_types() -> dict[str, list[str]]:
    """Diffusers' down, mid and up block types, as its builder functions name them."""
    import inspect

    from diffusers.models.unets import unet_2d_blocks

    found = {}
    for kind in ("down", "mid", "up"):
        source = inspect.getsource(getattr(unet_2d_blocks, f"get_{kind}_block"))
        found[kind] = list(dict.fromkeys(re.findall(rf'{kind}_block_type == "(\w+)"', source)))
    return found


def report(outcomes: list[Outcome], seconds: float, commands: list[str]) -> str:
    by_key = {(o.arch, o.check, o.mode): o for o in outcomes}
    cols = [(c, m) for c in CHECKS for m in MODES]
    cols = [col for col in cols if any((o.check, o.mode) == col for o in outcomes)]
    command = "`, then `".join(commands)
    lines = [
        BEGIN,
        "",
        "# timm and Diffusers: a wider sweep",
        "",
        f"Generated by `{command}` ({_versions()}, {seconds / 60:.1f} minutes on the CPU "
        "backend of a 2-core machine with JAX's persistent compilation cache on, as by "
        "default: a run whose programs are not in it yet compiles for about 2.5 times as long; "
        "run with the torch 2.14.1 venv, the one where torchvision and timm import; each eager "
        "mode in a process of its own). Each model (`src/torchtpu/zoo/libraries.py`) is "
        "built on the CPU with a fixed seed and random weights (timm's with "
        "`timm.create_model(name, pretrained=False, num_classes=10)`, Diffusers' from a "
        "tiny config), dropout and drop-path off, and copied to tpu; a batch of 2. "
        "**forward** compares the eval-mode output; **train** the train-mode output, the "
        "loss (cross-entropy for timm, the mean squared error to a random target for "
        "Diffusers), every parameter's gradient after `loss.backward()` and every buffer "
        "(batch norms' running statistics). A value passes within 1e-4 (forward) or 1e-3 "
        "(train) of the largest magnitude of the CPU's tensor, plus 1e-4; a gradient "
        "beyond that passes if it is no farther from the CPU's float64 gradient than "
        "twice the CPU's float32 one is (Note [Judged against float64] in "
        "`src/torchtpu/zoo/check.py`). Each cell: `pass` and the largest absolute "
        "difference, **MISMATCH** and that difference, or **FAIL** and the exception. A "
        "mismatch is rerun in float64 on tpu and on the CPU, and its cell gives their largest "
        "difference relative to the tensor's magnitude: tiny, tpu computes the same function "
        "and float32's rounding made the difference (near a ReLU's kink, an input a few ulps "
        "off flips the mask, and that element's gradient is carried back or not).",
        "",
        "## Summary",
        "",
    ]
    fallback_ops = sorted({op for o in outcomes for op in o.fallbacks})
    for library, title in (("timm", "timm"), ("diffusers", "Diffusers")):
        names = [e.name for e in ENTRIES if e.library == library]
        ran = [o for o in outcomes if o.arch in names]
        models = sorted({o.arch for o in ran})
        clean = sum(all(o.passed for o in ran if o.arch == name) for name in models)
        lines.append(
            f"- {title}: {len(models)} models, {len(ran)} checks; every check passing: "
            f"{clean}/{len(models)}"
        )
    explained = [
        o
        for o in outcomes
        if not o.passed and not _failed(o) and (getattr(o, "float64_rel", None) or 1) < FLOAT64_SAME
    ]
    if explained:
        lines.append(
            f"- Mismatches that match the CPU in float64 (float32 rounding): {len(explained)} "
            f"({', '.join(sorted({f'{o.arch} {o.check}' for o in explained}))})"
        )
    lines += [f"- Ops that ran on the CPU fallback: {', '.join(fallback_ops) or 'none'}", ""]
    lines += ["| library | check | models | pass | MISMATCH | FAIL |", "|---|---|---|---|---|---|"]
    for library, title in (("timm", "timm"), ("diffusers", "Diffusers")):
        names = {e.name for e in ENTRIES if e.library == library}
        for check, mode in cols:
            ran = [o for o in outcomes if o.arch in names and (o.check, o.mode) == (check, mode)]
            if not ran:
                continue
            passed = sum(o.passed for o in ran)
            failed = sum(_failed(o) for o in ran)
            lines.append(
                f"| {title} | {check} ({mode}) | {len(ran)} | {passed} | "
                f"{len(ran) - passed - failed} | {failed} |"
            )
    header = " | ".join(f"{c} ({m})" for c, m in cols)
    for library, title, what in (
        ("timm", "timm", "covers; image size"),
        ("diffusers", "Diffusers", "what it is"),
    ):
        entries = [
            e for e in ENTRIES if e.library == library and any(o.arch == e.name for o in outcomes)
        ]
        if not entries:
            continue
        lines += [
            "",
            f"## {title}",
            "",
            f"| model | {what} | {header} |",
            "|---" * (len(cols) + 2) + "|",
        ]
        for e in entries:
            cells = " | ".join(_cell(by_key.get((e.name, c, m))) for c, m in cols)
            blocks = BLOCKS.get(e.name)
            covers = e.covers + (f": {', '.join(blocks)}" if blocks else "")
            lines.append(f"| {e.name} | {_escape(covers)} | {cells} |")
    if any(e.library == "diffusers" for e in ENTRIES if any(o.arch == e.name for o in outcomes)):
        lines += ["", "### Diffusers block types", ""]
        try:
            types = _block_types()
        except Exception as error:  # noqa: BLE001 - Diffusers does not import here
            lines.append(f"Not listed: {_crash_reason(error)}")
        else:
            ran = {o.arch for o in outcomes}
            for kind, names in types.items():
                covered = []
                for block in names:
                    where = [
                        e.name
                        for e in DIFFUSERS
                        if block in BLOCKS.get(e.name, ()) and e.name in ran
                    ]
                    covered.append(
                        f"{block} ({'; '.join(where)})" if where else f"{block} (**not run**)"
                    )
                lines.append(f"- {kind}: " + ", ".join(covered))
    problems = [o for o in outcomes if not o.passed]
    lines += ["", "## Failures and mismatches", ""]
    lines += [
        f"- **{o.arch}** {o.check} ({o.mode}): {_escape(o.reason)}" + _float64_note(o)
        for o in problems
    ] or ["None."]
    fallbacks = [o for o in outcomes if o.fallbacks]
    lines += ["", "## CPU fallbacks", ""]
    lines += [
        f"- {o.arch} {o.check} ({o.mode}): "
        + ", ".join(f"{op} ×{n}" for op, n in sorted(o.fallbacks.items()))
        for o in fallbacks
    ] or ["None: every op ran on tpu."]
    return "\n".join(lines + ["", END]) + "\n"


# -- the file -----------------------------------------------------------------------------------


def split_block(text: str) -> tuple[str, str]:
    """``text`` without this report's block, and the block (with its markers; "" if none)."""
    start, end = text.find(BEGIN), text.find(END)
    if start < 0 or end < start:
        return text, ""
    end += len(END)
    block = text[start:end] + "\n"
    rest = text[:start].rstrip("\n") + "\n" + text[end:].lstrip("\n")
    return rest.rstrip("\n") + "\n", block


def keep_block(path: str, text: str) -> str:
    """``text`` with the block of ``path``'s current contents appended (for
    ``python -m torchtpu.zoo``, which rewrites the whole file)."""
    if not os.path.exists(path):
        return text
    with open(path) as f:
        _, block = split_block(f.read())
    return text if not block else text.rstrip("\n") + "\n\n" + block


def write_block(path: str, block: str) -> None:
    """Replace this report's block of ``path`` (or append it), keeping the rest."""
    text = ""
    if os.path.exists(path):
        with open(path) as f:
            text = f.read()
    rest, _ = split_block(text)
    with open(path, "w") as f:
        f.write((rest.rstrip("\n") + "\n\n" if rest.strip() else "") + block)


def _results_path(out: str) -> str:
    return out.rsplit(".", 1)[0] + ".libraries.json"


def _load(path: str) -> dict:
    """The last run's results: outcomes, seconds, commands (and the blocks seen)."""
    if not os.path.exists(path):
        return {"outcomes": [], "seconds": 0.0, "commands": []}
    with open(path) as f:
        data = json.load(f)
    BLOCKS.update(data.get("blocks", {}))
    data["outcomes"] = [LibraryOutcome(**o) for o in data["outcomes"]]
    return data


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m torchtpu.zoo.libraries", description=__doc__.split("\n\n")[0]
    )
    parser.add_argument("--out", help="the Markdown file whose block to write (default: stdout)")
    parser.add_argument("--library", choices=("timm", "diffusers"), help="only this library")
    parser.add_argument("--only", help="comma-separated model names (or parts of them)")
    parser.add_argument("--limit", type=int, help="at most this many models of each library")
    parser.add_argument(
        "--modes",
        default=",".join(MODES),
        help="comma-separated eager modes (default: %(default)s)",
    )
    parser.add_argument("--checks", default=",".join(CHECKS), help="comma-separated checks")
    parser.add_argument(
        "--update",
        action="store_true",
        help="rerun the selected models' checks in --modes and keep the other results of "
        "the last run (the .json next to --out)",
    )
    parser.add_argument(
        "--resume",
        action="store_true",
        help="as --update, skipping the models the last run has results for in --modes",
    )
    parser.add_argument("--list", action="store_true", help="list the models and exit")
    parser.add_argument(
        "--rewrite", action="store_true", help="rewrite --out's block from the .json; run nothing"
    )
    args = parser.parse_args(argv)
    if args.rewrite and args.out:
        last = _load(_results_path(args.out))
        _write(
            args.out, _results_path(args.out), last["outcomes"], last["seconds"], last["commands"]
        )
        return 0
    checks, modes = args.checks.split(","), args.modes.split(",")
    selected = [e for e in ENTRIES if not args.library or e.library == args.library]
    if args.only:
        parts = [p.strip() for p in args.only.split(",")]
        selected = [e for e in selected if any(p == e.name or p in e.name for p in parts)]
    if args.limit:
        selected = [
            e
            for e in selected
            if [x for x in selected if x.library == e.library].index(e) < args.limit
        ]
    results = _results_path(args.out) if args.out else None
    last = _load(results) if (args.update or args.resume) and results else _load("")
    if args.resume:
        done = {(o.arch, o.mode) for o in last["outcomes"]}
        selected = [e for e in selected if any((e.name, m) not in done for m in modes)]
    if args.list:
        print("\n".join(f"{e.library}\t{e.name}" for e in selected))
        return 0
    argv = list(sys.argv[1:] if argv is None else argv)
    command = os.environ.get(_COMMAND) or " ".join(["python -m torchtpu.zoo.libraries", *argv])
    if len(modes) > 1 and args.out:
        return _mode_by_mode(argv, modes, command, fresh=not (args.update or args.resume))
    commands = [c for c in last.get("commands", []) if c != command] + [command]
    rerun = {(e.name, c, m) for e in selected for c in checks for m in modes}
    kept = [o for o in last["outcomes"] if (o.arch, o.check, o.mode) not in rerun]

    warnings.simplefilter("ignore")  # fallbacks are counted in the report instead
    outcomes: list[Outcome] = []
    start = time.perf_counter()
    for entry in selected:
        for outcome in run(entry, checks, modes):
            outcomes.append(outcome)
            status = (
                "pass"
                if outcome.passed
                else f"{'FAIL' if _failed(outcome) else 'MISMATCH'} {outcome.reason}"
            )
            print(
                f"{entry.library} {entry.name} {outcome.check} {outcome.mode}: {status} "
                f"[{outcome.seconds:.1f}s]",
                file=sys.stderr,
                flush=True,
            )
        if args.out:  # after each model: a long run's progress is kept
            seconds = last.get("seconds", 0.0) + time.perf_counter() - start
            _write(args.out, results, kept + outcomes, seconds, commands)
    if not args.out:
        print(report(outcomes, time.perf_counter() - start, commands))
    return 0


_COMMAND = "TORCHTPU_ZOO_LIBRARIES_COMMAND"


def _mode_by_mode(argv: list[str], modes: list[str], command: str, fresh: bool) -> int:
    """Each eager mode in a process of its own, the later ones with ``--update``: one
    process compiling both modes' programs for every model (thousands of XLA:CPU
    executables) ran out of memory maps (``vm.max_map_count``, 65,530) and died."""
    import subprocess

    env = dict(os.environ, **{_COMMAND: command})
    for i, mode in enumerate(modes):
        child = [sys.executable, "-m", "torchtpu.zoo.libraries", *argv, "--modes", mode]
        if i > 0 and fresh:
            child.append("--update")
        returncode = subprocess.run(child, env=env).returncode
        if returncode:
            return returncode
    return 0


def _write(out, results, outcomes, seconds, commands) -> None:
    order = {e.name: i for i, e in enumerate(ENTRIES)}
    outcomes = sorted(outcomes, key=lambda o: order.get(o.arch, len(order)))
    write_block(out, report(outcomes, seconds, commands))
    with open(results, "w") as f:
        data = {
            "seconds": seconds,
            "commands": commands,
            "blocks": BLOCKS,
            "outcomes": [dataclasses.asdict(o) for o in outcomes],
        }
        json.dump(data, f, indent=0)


if __name__ == "__main__":
    sys.exit(main())
