"""The model zoo: small Hugging Face Transformers models that must run on tpu as on CPU.

Each entry names an architecture and builds, without downloading anything, a tiny
randomly initialized model (2 layers, hidden size 32-64, small vocabulary, fixed
seed) and a batch of inputs that includes labels, so the model returns a loss.
``tests/models`` and the report (``python -m torchtpu.zoo --out docs/models.md``)
both read this table; ``torchtpu.zoo.check`` runs the comparisons.

Needs the ``models`` extra (``pip install "torchtpu[models]"``).
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
    inputs: Callable[[object], dict]  # config -> keyword arguments (CPU tensors), with labels
    generate: bool = False  # a causal LM: greedy generate() is compared too

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


# Dropout, layer drop and SpecAugment masking draw random numbers in training mode;
# tpu and CPU generators differ, so the training comparison runs with all of them off.
_RANDOM_CONFIG = re.compile(r"drop|mask_time_prob|mask_feature_prob")


def _parts(config) -> list:
    """The config and those nested in it (a multimodal model's text and vision)."""
    nested = [getattr(config, name, None) for name in ("text_config", "vision_config")]
    return [config] + [part for part in nested if hasattr(part, "to_dict")]


def _disable_randomness(config) -> None:
    for key, value in list(vars(config).items()):
        if _RANDOM_CONFIG.search(key) and isinstance(value, float):
            setattr(config, key, 0.0)


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


def seq2seq_inputs(config, generator):
    ids = _ids(generator, config.vocab_size)
    labels = _ids(generator, config.vocab_size, shape=(BATCH, SEQ - 2))
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


# ---- configs --------------------------------------------------------------------------

_LLAMA_LIKE = dict(
    vocab_size=VOCAB,
    hidden_size=32,
    intermediate_size=64,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=64,
)
_BERT_LIKE = dict(
    vocab_size=VOCAB,
    hidden_size=32,
    num_hidden_layers=2,
    num_attention_heads=4,
    intermediate_size=64,
    max_position_embeddings=64,
)
_BART_LIKE = dict(
    vocab_size=VOCAB,
    d_model=32,
    encoder_layers=2,
    decoder_layers=2,
    encoder_attention_heads=4,
    decoder_attention_heads=4,
    encoder_ffn_dim=64,
    decoder_ffn_dim=64,
    max_position_embeddings=64,
    pad_token_id=1,
    bos_token_id=0,
    eos_token_id=2,
    decoder_start_token_id=2,
)
_VISION_LIKE = dict(
    image_size=IMAGE,
    patch_size=8,
    num_channels=3,
    hidden_size=32,
    num_hidden_layers=2,
    num_attention_heads=4,
    intermediate_size=64,
    num_labels=5,
)
_MOE = dict(num_local_experts=4, num_experts_per_tok=2)


def _decoder(name, model_class, config_class, config):
    return Arch(name, "decoder", model_class, config_class, config, causal_lm_inputs, True)


def _encoder(name, model_class, config_class, config):
    return Arch(name, "encoder", model_class, config_class, config, masked_lm_inputs)


def _seq2seq(name, model_class, config_class, config, inputs=seq2seq_inputs):
    return Arch(name, "encoder-decoder", model_class, config_class, config, inputs)


def _vision(name, model_class, config_class, config):
    return Arch(name, "vision", model_class, config_class, config, image_inputs)


# wav2vec2 and HuBERT share their architecture: a convolutional feature encoder, then
# a transformer, trained with CTC.
_CTC_AUDIO = dict(
    vocab_size=16,
    hidden_size=32,
    num_hidden_layers=2,
    num_attention_heads=4,
    intermediate_size=64,
    conv_dim=(16, 16),
    conv_stride=(5, 4),
    conv_kernel=(10, 4),
    num_conv_pos_embeddings=8,
    num_conv_pos_embedding_groups=4,
    ctc_loss_reduction="mean",
)

ARCHS: list[Arch] = [
    # ---- decoder-only language models ----
    _decoder(
        "gpt2",
        "GPT2LMHeadModel",
        "GPT2Config",
        dict(vocab_size=VOCAB, n_embd=32, n_layer=2, n_head=4, n_positions=64),
    ),
    _decoder(
        "gpt_neox",
        "GPTNeoXForCausalLM",
        "GPTNeoXConfig",
        dict(_LLAMA_LIKE, num_key_value_heads=None),
    ),
    _decoder("llama", "LlamaForCausalLM", "LlamaConfig", _LLAMA_LIKE),
    _decoder("mistral", "MistralForCausalLM", "MistralConfig", dict(_LLAMA_LIKE, sliding_window=4)),
    _decoder("mixtral", "MixtralForCausalLM", "MixtralConfig", dict(_LLAMA_LIKE, **_MOE)),
    _decoder("qwen2", "Qwen2ForCausalLM", "Qwen2Config", _LLAMA_LIKE),
    _decoder("qwen3", "Qwen3ForCausalLM", "Qwen3Config", dict(_LLAMA_LIKE, head_dim=8)),
    _decoder(
        "qwen3_moe",
        "Qwen3MoeForCausalLM",
        "Qwen3MoeConfig",
        dict(
            _LLAMA_LIKE, head_dim=8, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32
        ),
    ),
    _decoder("gemma", "GemmaForCausalLM", "GemmaConfig", dict(_LLAMA_LIKE, head_dim=8)),
    _decoder(
        "gemma2",
        "Gemma2ForCausalLM",
        "Gemma2Config",
        dict(_LLAMA_LIKE, head_dim=8, sliding_window=4),
    ),
    _decoder(
        "gemma3",
        "Gemma3ForCausalLM",
        "Gemma3TextConfig",
        dict(_LLAMA_LIKE, head_dim=8, sliding_window=4),
    ),
    _decoder("phi", "PhiForCausalLM", "PhiConfig", dict(_LLAMA_LIKE, num_key_value_heads=None)),
    _decoder("phi3", "Phi3ForCausalLM", "Phi3Config", dict(_LLAMA_LIKE, pad_token_id=0)),
    _decoder(
        "opt",
        "OPTForCausalLM",
        "OPTConfig",
        dict(
            vocab_size=VOCAB,
            hidden_size=32,
            ffn_dim=64,
            num_hidden_layers=2,
            num_attention_heads=4,
            max_position_embeddings=64,
            word_embed_proj_dim=32,
        ),
    ),
    _decoder(
        "bloom",
        "BloomForCausalLM",
        "BloomConfig",
        dict(vocab_size=VOCAB, hidden_size=32, n_layer=2, n_head=4),
    ),
    _decoder(
        "falcon",
        "FalconForCausalLM",
        "FalconConfig",
        dict(vocab_size=VOCAB, hidden_size=32, num_hidden_layers=2, num_attention_heads=4),
    ),
    _decoder(
        "gptj",
        "GPTJForCausalLM",
        "GPTJConfig",
        dict(vocab_size=VOCAB, n_embd=32, n_layer=2, n_head=4, n_positions=64, rotary_dim=4),
    ),
    _decoder(
        "gpt_neo",
        "GPTNeoForCausalLM",
        "GPTNeoConfig",
        dict(
            vocab_size=VOCAB,
            hidden_size=32,
            num_layers=2,
            num_heads=4,
            max_position_embeddings=64,
            attention_types=[[["global", "local"], 1]],
            window_size=4,
        ),
    ),
    _decoder(
        "codegen",
        "CodeGenForCausalLM",
        "CodeGenConfig",
        dict(vocab_size=VOCAB, n_embd=32, n_layer=2, n_head=4, n_positions=64, rotary_dim=4),
    ),
    _decoder(
        "stablelm",
        "StableLmForCausalLM",
        "StableLmConfig",
        dict(_LLAMA_LIKE, num_key_value_heads=4),
    ),
    _decoder("olmo", "OlmoForCausalLM", "OlmoConfig", _LLAMA_LIKE),
    _decoder("olmo2", "Olmo2ForCausalLM", "Olmo2Config", _LLAMA_LIKE),
    _decoder("granite", "GraniteForCausalLM", "GraniteConfig", _LLAMA_LIKE),
    _decoder("cohere", "CohereForCausalLM", "CohereConfig", _LLAMA_LIKE),
    _decoder("starcoder2", "Starcoder2ForCausalLM", "Starcoder2Config", _LLAMA_LIKE),
    _decoder(
        "gpt_bigcode",
        "GPTBigCodeForCausalLM",
        "GPTBigCodeConfig",
        dict(vocab_size=VOCAB, n_embd=32, n_layer=2, n_head=4, n_positions=64),
    ),
    # ---- encoders ----
    _encoder("bert", "BertForMaskedLM", "BertConfig", _BERT_LIKE),
    _encoder("roberta", "RobertaForMaskedLM", "RobertaConfig", dict(_BERT_LIKE, pad_token_id=1)),
    _encoder(
        "xlm_roberta", "XLMRobertaForMaskedLM", "XLMRobertaConfig", dict(_BERT_LIKE, pad_token_id=1)
    ),
    _encoder(
        "distilbert",
        "DistilBertForMaskedLM",
        "DistilBertConfig",
        dict(
            vocab_size=VOCAB,
            dim=32,
            n_layers=2,
            n_heads=4,
            hidden_dim=64,
            max_position_embeddings=64,
        ),
    ),
    _encoder("albert", "AlbertForMaskedLM", "AlbertConfig", dict(_BERT_LIKE, embedding_size=16)),
    _encoder("electra", "ElectraForMaskedLM", "ElectraConfig", dict(_BERT_LIKE, embedding_size=16)),
    _encoder(
        "deberta",
        "DebertaForMaskedLM",
        "DebertaConfig",
        dict(_BERT_LIKE, relative_attention=True, pos_att_type=["c2p", "p2c"]),
    ),
    _encoder(
        "deberta_v2",
        "DebertaV2ForMaskedLM",
        "DebertaV2Config",
        dict(_BERT_LIKE, relative_attention=True, pos_att_type=["c2p", "p2c"], position_buckets=8),
    ),
    _encoder("mpnet", "MPNetForMaskedLM", "MPNetConfig", _BERT_LIKE),
    _encoder(
        "convbert", "ConvBertForMaskedLM", "ConvBertConfig", dict(_BERT_LIKE, embedding_size=32)
    ),
    _encoder(
        "modernbert",
        "ModernBertForMaskedLM",
        "ModernBertConfig",
        dict(_BERT_LIKE, global_attn_every_n_layers=2, local_attention=4, pad_token_id=0),
    ),
    # ---- encoder-decoders ----
    _seq2seq(
        "t5",
        "T5ForConditionalGeneration",
        "T5Config",
        dict(
            vocab_size=VOCAB,
            d_model=32,
            d_kv=8,
            d_ff=64,
            num_layers=2,
            num_heads=4,
            relative_attention_num_buckets=8,
            decoder_start_token_id=0,
        ),
    ),
    _seq2seq("bart", "BartForConditionalGeneration", "BartConfig", _BART_LIKE),
    _seq2seq("mbart", "MBartForConditionalGeneration", "MBartConfig", _BART_LIKE),
    _seq2seq("marian", "MarianMTModel", "MarianConfig", dict(_BART_LIKE, decoder_vocab_size=VOCAB)),
    _seq2seq("pegasus", "PegasusForConditionalGeneration", "PegasusConfig", _BART_LIKE),
    # ---- vision ----
    _vision("vit", "ViTForImageClassification", "ViTConfig", _VISION_LIKE),
    _vision("deit", "DeiTForImageClassification", "DeiTConfig", _VISION_LIKE),
    _vision("beit", "BeitForImageClassification", "BeitConfig", _VISION_LIKE),
    _vision(
        "dinov2",
        "Dinov2ForImageClassification",
        "Dinov2Config",
        dict(_VISION_LIKE, mlp_ratio=2),
    ),
    _vision(
        "swin",
        "SwinForImageClassification",
        "SwinConfig",
        dict(
            image_size=IMAGE,
            patch_size=2,
            embed_dim=16,
            depths=[1, 1],
            num_heads=[2, 4],
            window_size=4,
            num_labels=5,
        ),
    ),
    _vision(
        "convnext",
        "ConvNextForImageClassification",
        "ConvNextConfig",
        dict(num_stages=2, hidden_sizes=[16, 32], depths=[1, 1], num_labels=5, image_size=IMAGE),
    ),
    _vision(
        "resnet",
        "ResNetForImageClassification",
        "ResNetConfig",
        dict(embedding_size=16, hidden_sizes=[16, 32], depths=[1, 1], num_labels=5),
    ),
    _vision(
        "convnextv2",
        "ConvNextV2ForImageClassification",
        "ConvNextV2Config",
        dict(num_stages=2, hidden_sizes=[16, 32], depths=[1, 1], num_labels=5, image_size=IMAGE),
    ),
    _vision(
        "regnet",
        "RegNetForImageClassification",
        "RegNetConfig",
        dict(embedding_size=16, hidden_sizes=[16, 32], depths=[1, 1], groups_width=8, num_labels=5),
    ),
    # ---- audio ----
    Arch(
        "wav2vec2",
        "audio",
        "Wav2Vec2ForCTC",
        "Wav2Vec2Config",
        _CTC_AUDIO,
        ctc_inputs,
    ),
    Arch(
        "hubert",
        "audio",
        "HubertForCTC",
        "HubertConfig",
        _CTC_AUDIO,
        ctc_inputs,
    ),
    Arch(
        "whisper",
        "audio",
        "WhisperForConditionalGeneration",
        "WhisperConfig",
        dict(
            _BART_LIKE,
            num_mel_bins=8,
            max_source_positions=16,
            max_target_positions=32,
            decoder_start_token_id=3,
            suppress_tokens=None,
            begin_suppress_tokens=None,
        ),
        whisper_inputs,
    ),
    # ---- multimodal ----
    Arch(
        "clip",
        "multimodal",
        "CLIPModel",
        "CLIPConfig",
        dict(
            text_config=dict(_BERT_LIKE, projection_dim=16),
            vision_config=dict(_VISION_LIKE, projection_dim=16),
            projection_dim=16,
        ),
        image_text_inputs,
    ),
    Arch(
        "siglip",
        "multimodal",
        "SiglipModel",
        "SiglipConfig",
        dict(text_config=dict(_BERT_LIKE), vision_config=dict(_VISION_LIKE)),
        lambda config, generator: image_text_inputs(config, generator, padding=False),
    ),
]

BY_NAME: dict[str, Arch] = {arch.name: arch for arch in ARCHS}

# The default test run (CI): one architecture per family, chosen to cover distinct
# runtime paths -- KV-cache generation, mixture-of-experts routing (histc, grouped
# matmuls), relative attention buckets, patch embeddings, CTC loss and weight norm.
# ``TORCHTPU_ZOO=full`` runs every architecture.
DEFAULT = ("llama", "mixtral", "bert", "t5", "vit", "wav2vec2")
