"""One zoo architecture (`Arch`): how to build its tiny model and a batch of inputs.

Nothing is downloaded: each model is built from its config with random weights (fixed
seed), and each batch is random token ids, images or audio with labels, so the model
returns a loss. The table of architectures is ``torchtpu.zoo.ARCHS``.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from dataclasses import dataclass

import torch

VOCAB = 96
BATCH = 2
SEQ = 8
IMAGE = 32
SEED = 0


@dataclass(frozen=True, eq=False)  # hashed by identity: the checks cache per architecture
class Arch:
    """One architecture: how to build its tiny model and a batch for it."""

    name: str
    family: str  # "decoder", "encoder", "encoder-decoder", "vision", "audio", "multimodal"
    model_class: str  # a class name in ``transformers``
    config_class: str
    config: dict
    inputs: Callable[[object, torch.Generator], dict]  # -> keyword arguments, with labels
    # generate() is compared (causal LMs, encoder-decoders): greedy, with the default
    # cache and with cache_implementation="static" unless ``no_static_cache`` says why not.
    generate: bool = False
    no_static_cache: str = ""

    def build_config(self):
        import transformers

        config = getattr(transformers, self.config_class)(**self.config)
        for part in _parts(config):
            _disable_randomness(part)
            _special_tokens_in_vocabulary(part)
        return config

    def build(self):
        """The model on the CPU in eval mode, with the zoo's fixed seed."""
        import transformers

        config = self.build_config()
        torch.manual_seed(SEED)
        model = getattr(transformers, self.model_class)(config)
        return model.eval()

    def batch(self, config=None):
        """The inputs on the CPU; the same every call."""
        generator = torch.Generator().manual_seed(SEED + 1)
        return self.inputs(config or self.build_config(), generator)


# Dropout, layer drop, SpecAugment masking and mixture-of-experts router jitter draw
# random numbers in training mode; tpu and CPU generators differ, so the training
# comparison runs with all of them off.
_RANDOM_CONFIG = re.compile(r"drop|mask_time_prob|mask_feature_prob|jitter")


def _parts(config) -> list:
    """The config and those nested in it (a multimodal model's text and vision)."""
    nested = [getattr(config, name, None) for name in ("text_config", "vision_config")]
    return [config] + [part for part in nested if hasattr(part, "to_dict")]


def _disable_randomness(config) -> None:
    for key, value in list(vars(config).items()):
        if not _RANDOM_CONFIG.search(key):
            continue
        if isinstance(value, float):
            setattr(config, key, 0.0)
        elif isinstance(value, (list, tuple)) and all(isinstance(v, float) for v in value):
            setattr(config, key, [0.0] * len(value))  # per stage (CvT's drop path)


def _special_tokens_in_vocabulary(config) -> None:
    # The defaults are ids of the full-size vocabulary; the tiny one has VOCAB tokens.
    vocab = getattr(config, "vocab_size", None)
    for i, name in enumerate(("pad_token_id", "bos_token_id", "eos_token_id")):
        value = getattr(config, name, None)
        if vocab and isinstance(value, int) and value >= vocab:
            setattr(config, name, i)


# ---- input builders -------------------------------------------------------------------


def _ids(generator, vocab=VOCAB, low=3, shape=(BATCH, SEQ)):
    # Token ids from 3 up: 0-2 are often pad / bos / eos.
    return torch.randint(low, vocab, shape, generator=generator)


def causal_lm_inputs(config, generator):
    ids = _ids(generator, config.vocab_size)
    mask = torch.ones_like(ids)
    mask[1, :2] = 0  # left padding in the second row exercises the attention mask
    return {"input_ids": ids, "attention_mask": mask, "labels": ids}


def masked_lm_inputs(config, generator):
    ids = _ids(generator, config.vocab_size)
    mask = torch.ones_like(ids)
    mask[1, -2:] = 0  # right padding
    labels = torch.full_like(ids, -100)
    labels[:, 1::3] = ids[:, 1::3]  # loss on a few positions; -100 is ignored
    return {"input_ids": ids, "attention_mask": mask, "labels": labels}


def seq2seq_inputs(config, generator, target_length=SEQ - 2):
    vocab = getattr(config, "vocab_size", None) or config.src_vocab_size
    ids = _ids(generator, vocab)
    labels = _ids(generator, getattr(config, "tgt_vocab_size", vocab), shape=(BATCH, target_length))
    return {"input_ids": ids, "attention_mask": torch.ones_like(ids), "labels": labels}


def image_inputs(config, generator, size=IMAGE):
    pixels = torch.randn(BATCH, 3, size, size, generator=generator)
    labels = torch.randint(0, config.num_labels, (BATCH,), generator=generator)
    return {"pixel_values": pixels, "labels": labels}


def ctc_inputs(config, generator):
    audio = torch.randn(BATCH, 400, generator=generator)
    labels = torch.randint(1, config.vocab_size, (BATCH, 3), generator=generator)
    return {"input_values": audio, "labels": labels}


def whisper_inputs(config, generator):
    frames = 2 * config.max_source_positions
    features = torch.randn(BATCH, config.num_mel_bins, frames, generator=generator)
    labels = _ids(generator, config.vocab_size, shape=(BATCH, SEQ - 2))
    return {"input_features": features, "labels": labels}


def image_text_inputs(config, generator, padding=True):
    text = config.text_config
    ids = _ids(generator, text.vocab_size, shape=(BATCH, SEQ))
    size = config.vision_config.image_size
    pixels = torch.randn(BATCH, 3, size, size, generator=generator)
    batch = {"input_ids": ids, "pixel_values": pixels, "return_loss": True}
    if padding:
        mask = torch.ones_like(ids)
        mask[1, -2:] = 0
        batch["attention_mask"] = mask
    return batch


def filterbank_inputs(config, generator, frames=16):
    """Log-mel filterbank frames (Speech2Text)."""
    width = config.input_feat_per_channel * config.input_channels
    features = torch.randn(BATCH, frames, width, generator=generator)
    labels = _ids(generator, config.vocab_size, shape=(BATCH, SEQ - 2))
    mask = torch.ones(BATCH, frames, dtype=torch.long)
    return {"input_features": features, "attention_mask": mask, "labels": labels}


def waveform_seq2seq_inputs(config, generator, samples=1600):
    """Raw audio into an encoder-decoder (Moonshine)."""
    audio = torch.randn(BATCH, samples, generator=generator)
    labels = _ids(generator, config.vocab_size, shape=(BATCH, SEQ - 2))
    return {"input_values": audio, "labels": labels}


def spectrogram_inputs(config, generator):
    """A spectrogram classified as a whole (Audio Spectrogram Transformer)."""
    features = torch.randn(BATCH, config.max_length, config.num_mel_bins, generator=generator)
    labels = torch.randint(0, config.num_labels, (BATCH,), generator=generator)
    return {"input_values": features, "labels": labels}


def image_tokens_inputs(config, generator):
    """A vision-language LM's prompt (Llava): image placeholder tokens, then text."""
    text = config.text_config
    ids = _ids(generator, text.vocab_size - 1, shape=(BATCH, SEQ))  # not the image token
    image = torch.full((BATCH, config.image_seq_length), config.image_token_id)
    ids = torch.cat([image, ids], dim=1)
    size = config.vision_config.image_size
    pixels = torch.randn(BATCH, 3, size, size, generator=generator)
    return {
        "input_ids": ids,
        "attention_mask": torch.ones_like(ids),
        "pixel_values": pixels,
        "labels": ids,
    }
