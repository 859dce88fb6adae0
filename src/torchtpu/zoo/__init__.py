"""The model zoo: small Hugging Face Transformers models that must run on tpu as on CPU.

Each entry names an architecture and builds, without downloading anything, a tiny
randomly initialized model (2 layers, hidden size 16-64, small vocabulary, fixed
seed) and a batch of inputs that includes labels, so the model returns a loss
(`torchtpu.zoo.arch`). ``tests/models`` and the report
(``python -m torchtpu.zoo --out docs/models.md``) both read this table;
``torchtpu.zoo.check`` runs the comparisons.

Architectures Transformers ships that are left out, and why, are listed at the end
(`LEFT_OUT`). Needs the ``models`` extra (``pip install "torchtpu[models]"``).
"""

from __future__ import annotations

from torchtpu.zoo.arch import (
    BATCH,
    IMAGE,
    SEQ,
    VOCAB,
    Arch,
    causal_lm_inputs,
    ctc_inputs,
    filterbank_inputs,
    image_inputs,
    image_text_inputs,
    image_tokens_inputs,
    masked_lm_inputs,
    seq2seq_inputs,
    spectrogram_inputs,
    waveform_seq2seq_inputs,
    whisper_inputs,
)

__all__ = ["ARCHS", "BATCH", "BY_NAME", "DEFAULT", "DEFAULT_EXTRA", "IMAGE", "SEQ", "VOCAB", "Arch"]

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
_T5_LIKE = dict(
    vocab_size=VOCAB,
    d_model=32,
    d_kv=8,
    d_ff=64,
    num_layers=2,
    num_heads=4,
    relative_attention_num_buckets=8,
    decoder_start_token_id=0,
)
_XLM_LIKE = dict(vocab_size=VOCAB, emb_dim=32, n_layers=2, n_heads=4, max_position_embeddings=64)
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
_SWIN_LIKE = dict(
    image_size=IMAGE,
    patch_size=2,
    embed_dim=16,
    depths=[1, 1],
    num_heads=[2, 4],
    window_size=4,
    num_labels=5,
)
# Hierarchical vision transformers with spatially reduced attention.
_PVT_LIKE = dict(
    num_encoder_blocks=2,
    depths=[1, 1],
    sr_ratios=[2, 1],
    hidden_sizes=[16, 32],
    patch_sizes=[7, 3],
    strides=[4, 2],
    num_attention_heads=[1, 2],
    mlp_ratios=[2, 2],
    num_labels=5,
)
_MOE = dict(num_local_experts=4, num_experts_per_tok=2)
_EXPERTS = dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32)
# Multi-head latent attention (DeepSeek, MiniCPM3): keys and values from a low-rank
# latent; every head has its own key (no grouped-query sharing).
_MLA = dict(
    _LLAMA_LIKE,
    num_key_value_heads=4,
    kv_lora_rank=16,
    q_lora_rank=16,
    qk_nope_head_dim=8,
    qk_rope_head_dim=8,
    v_head_dim=8,
)
_DEEPSEEK = dict(
    _MLA,
    n_routed_experts=4,
    num_experts_per_tok=2,
    moe_intermediate_size=32,
    n_shared_experts=1,
    first_k_dense_replace=1,  # layer 0 dense, layer 1 mixture-of-experts
    n_group=1,
    topk_group=1,
)
# A Mamba2 mixer (chunked selective scan) in hybrid models.
_MAMBA2_MIXER = dict(
    mamba_n_heads=4, mamba_d_head=8, mamba_n_groups=1, mamba_d_state=8, mamba_chunk_size=4
)


def _decoder(name, model_class, config_class, config, **options):
    return Arch(
        name, "decoder", model_class, config_class, config, causal_lm_inputs, True, **options
    )


def _encoder(name, model_class, config_class, config):
    return Arch(name, "encoder", model_class, config_class, config, masked_lm_inputs)


def _seq2seq(name, model_class, config_class, config, inputs=seq2seq_inputs, **options):
    return Arch(name, "encoder-decoder", model_class, config_class, config, inputs, True, **options)


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
    _decoder(
        "qwen2_moe",
        "Qwen2MoeForCausalLM",
        "Qwen2MoeConfig",
        dict(_LLAMA_LIKE, **_EXPERTS, shared_expert_intermediate_size=32),
    ),
    _decoder("olmoe", "OlmoeForCausalLM", "OlmoeConfig", dict(_LLAMA_LIKE, **_EXPERTS)),
    _decoder("olmo3", "Olmo3ForCausalLM", "Olmo3Config", dict(_LLAMA_LIKE, sliding_window=4)),
    _decoder("granitemoe", "GraniteMoeForCausalLM", "GraniteMoeConfig", dict(_LLAMA_LIKE, **_MOE)),
    _decoder("cohere2", "Cohere2ForCausalLM", "Cohere2Config", dict(_LLAMA_LIKE, sliding_window=4)),
    _decoder("nemotron", "NemotronForCausalLM", "NemotronConfig", dict(_LLAMA_LIKE, head_dim=8)),
    _decoder(
        "persimmon",
        "PersimmonForCausalLM",
        "PersimmonConfig",
        dict(_LLAMA_LIKE, num_key_value_heads=None),
    ),
    _decoder(
        "mpt",
        "MptForCausalLM",
        "MptConfig",
        dict(
            vocab_size=VOCAB, d_model=32, n_heads=4, n_layers=2, expansion_ratio=2, max_seq_len=64
        ),
    ),
    _decoder("biogpt", "BioGptForCausalLM", "BioGptConfig", _BERT_LIKE),
    _decoder(
        "xglm",
        "XGLMForCausalLM",
        "XGLMConfig",
        dict(
            vocab_size=VOCAB,
            d_model=32,
            ffn_dim=64,
            num_layers=2,
            attention_heads=4,
            max_position_embeddings=64,
        ),
    ),
    _decoder(
        "ctrl",
        "CTRLLMHeadModel",
        "CTRLConfig",
        dict(vocab_size=VOCAB, n_positions=64, n_embd=32, dff=64, n_layer=2, n_head=4),
    ),
    _decoder("phimoe", "PhimoeForCausalLM", "PhimoeConfig", dict(_LLAMA_LIKE, **_MOE)),
    _decoder(
        "jetmoe",
        "JetMoeForCausalLM",
        "JetMoeConfig",
        dict(
            vocab_size=VOCAB,
            hidden_size=32,
            num_hidden_layers=2,
            num_key_value_heads=2,
            kv_channels=8,
            intermediate_size=64,
            max_position_embeddings=64,
            **_MOE,
        ),
    ),
    _decoder(
        "dbrx",
        "DbrxForCausalLM",
        "DbrxConfig",
        dict(
            vocab_size=VOCAB,
            d_model=32,
            n_heads=4,
            n_layers=2,
            max_seq_len=64,
            attn_config=dict(kv_n_heads=2, rope_theta=10000.0, clip_qkv=8.0),
            ffn_config=dict(ffn_hidden_size=64, moe_num_experts=4, moe_top_k=2),
        ),
    ),
    _decoder("deepseek_v3", "DeepseekV3ForCausalLM", "DeepseekV3Config", _DEEPSEEK),
    _decoder("minicpm3", "MiniCPM3ForCausalLM", "MiniCPM3Config", _MLA),
    _decoder(
        "gpt_oss",
        "GptOssForCausalLM",
        "GptOssConfig",
        dict(_LLAMA_LIKE, head_dim=8, sliding_window=4, **_MOE),
    ),
    _decoder("bitnet", "BitNetForCausalLM", "BitNetConfig", _LLAMA_LIKE),
    _decoder("diffllama", "DiffLlamaForCausalLM", "DiffLlamaConfig", dict(_LLAMA_LIKE, head_dim=8)),
    _decoder(
        "modernbert_decoder",
        "ModernBertDecoderForCausalLM",
        "ModernBertDecoderConfig",
        dict(_BERT_LIKE, local_attention=4),
    ),
    _decoder(
        "xlnet",
        "XLNetLMHeadModel",
        "XLNetConfig",
        dict(vocab_size=VOCAB, d_model=32, n_layer=2, n_head=4, d_inner=64),
    ),
    # ---- state-space and hybrid decoders: recurrent state, no KV cache of their own ----
    _decoder(
        "mamba",
        "MambaForCausalLM",
        "MambaConfig",
        dict(vocab_size=VOCAB, hidden_size=32, state_size=8, num_hidden_layers=2),
    ),
    _decoder(
        "mamba2",
        "Mamba2ForCausalLM",
        "Mamba2Config",
        dict(
            vocab_size=VOCAB,
            hidden_size=32,
            num_heads=4,
            head_dim=16,
            state_size=8,
            num_hidden_layers=2,
            n_groups=1,
            chunk_size=4,
        ),
    ),
    _decoder(
        "recurrent_gemma",
        "RecurrentGemmaForCausalLM",
        "RecurrentGemmaConfig",
        dict(
            vocab_size=VOCAB,
            hidden_size=32,
            intermediate_size=64,
            num_hidden_layers=3,  # recurrent, recurrent, attention
            num_attention_heads=4,
            num_key_value_heads=2,
            lru_width=32,
            attention_window_size=4,
        ),
    ),
    _decoder(
        "jamba",
        "JambaForCausalLM",
        "JambaConfig",
        dict(
            _LLAMA_LIKE,
            num_experts=4,
            num_experts_per_tok=2,
            expert_layer_period=2,
            expert_layer_offset=1,
            attn_layer_period=2,
            attn_layer_offset=1,
            mamba_d_state=8,
            mamba_dt_rank=4,
        ),
    ),
    _decoder(
        "bamba",
        "BambaForCausalLM",
        "BambaConfig",
        dict(_LLAMA_LIKE, **_MAMBA2_MIXER, attn_layer_indices=[1], mamba_expand=1),
    ),
    _decoder(
        "falcon_h1",
        "FalconH1ForCausalLM",
        "FalconH1Config",
        dict(_LLAMA_LIKE, mamba_d_ssm=32, **_MAMBA2_MIXER),
    ),
    _decoder(
        "lfm2",
        "Lfm2ForCausalLM",
        "Lfm2Config",
        dict(_LLAMA_LIKE, layer_types=["conv", "full_attention"]),
    ),
    _decoder(
        "rwkv",
        "RwkvForCausalLM",
        "RwkvConfig",
        dict(
            vocab_size=VOCAB,
            context_length=64,
            hidden_size=32,
            num_hidden_layers=2,
            attention_hidden_size=32,
            intermediate_size=64,
        ),
    ),
    _decoder(
        "qwen3_next",
        "Qwen3NextForCausalLM",
        "Qwen3NextConfig",
        dict(
            _LLAMA_LIKE,
            **_EXPERTS,
            head_dim=8,
            linear_key_head_dim=8,
            linear_value_head_dim=8,
            linear_num_key_heads=2,
            linear_num_value_heads=4,
            shared_expert_intermediate_size=32,
            layer_types=["linear_attention", "full_attention"],
        ),
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
    _encoder(
        "big_bird",
        "BigBirdForMaskedLM",
        "BigBirdConfig",
        dict(_BERT_LIKE, attention_type="original_full"),  # block-sparse needs long inputs
    ),
    _encoder(
        "rembert",
        "RemBertForMaskedLM",
        "RemBertConfig",
        dict(_BERT_LIKE, input_embedding_size=16, output_embedding_size=16),
    ),
    _encoder(
        "roformer", "RoFormerForMaskedLM", "RoFormerConfig", dict(_BERT_LIKE, embedding_size=32)
    ),
    _encoder(
        "xlm_roberta_xl",
        "XLMRobertaXLForMaskedLM",
        "XLMRobertaXLConfig",
        dict(_BERT_LIKE, pad_token_id=1),
    ),
    _encoder(
        "mobilebert",
        "MobileBertForMaskedLM",
        "MobileBertConfig",
        dict(_BERT_LIKE, embedding_size=16, intra_bottleneck_size=16, num_feedforward_networks=2),
    ),
    _encoder(
        "funnel",
        "FunnelForMaskedLM",
        "FunnelConfig",
        dict(
            vocab_size=VOCAB,
            block_sizes=[1, 1],
            num_decoder_layers=1,
            d_model=32,
            n_head=4,
            d_head=8,
            d_inner=64,
        ),
    ),
    _encoder(
        "fnet",  # token mixing by a 2-d FFT instead of attention
        "FNetForMaskedLM",
        "FNetConfig",
        dict(
            vocab_size=VOCAB,
            hidden_size=32,
            num_hidden_layers=2,
            intermediate_size=64,
            max_position_embeddings=64,
        ),
    ),
    _encoder(
        "squeezebert",  # grouped 1x1 convolutions instead of linear layers
        "SqueezeBertForMaskedLM",
        "SqueezeBertConfig",
        dict(
            _BERT_LIKE,
            embedding_size=32,
            q_groups=2,
            k_groups=2,
            v_groups=2,
            post_attention_groups=2,
            intermediate_groups=2,
            output_groups=2,
        ),
    ),
    _encoder(
        "nystromformer",
        "NystromformerForMaskedLM",
        "NystromformerConfig",
        # As many landmarks as tokens: the exact-softmax path (with fewer, its
        # landmark attention cannot take an attention mask).
        dict(_BERT_LIKE, num_landmarks=SEQ, segment_means_seq_len=SEQ),
    ),
    _encoder(
        "esm",
        "EsmForMaskedLM",
        "EsmConfig",
        dict(_BERT_LIKE, pad_token_id=1, mask_token_id=2, position_embedding_type="rotary"),
    ),
    _encoder(
        "longformer",
        "LongformerForMaskedLM",
        "LongformerConfig",
        dict(_BERT_LIKE, pad_token_id=1, attention_window=4),
    ),
    _encoder(
        "xmod",
        "XmodForMaskedLM",
        "XmodConfig",
        dict(_BERT_LIKE, pad_token_id=1, languages=["en_XX"], default_language="en_XX"),
    ),
    _encoder("nomic_bert", "NomicBertForMaskedLM", "NomicBertConfig", dict(_BERT_LIKE, head_dim=8)),
    _encoder(
        "eurobert", "EuroBertForMaskedLM", "EuroBertConfig", dict(_LLAMA_LIKE, mask_token_id=2)
    ),
    _encoder("xlm", "XLMWithLMHeadModel", "XLMConfig", _XLM_LIKE),
    # ---- encoder-decoders ----
    _seq2seq("t5", "T5ForConditionalGeneration", "T5Config", _T5_LIKE),
    _seq2seq("bart", "BartForConditionalGeneration", "BartConfig", _BART_LIKE),
    _seq2seq("mbart", "MBartForConditionalGeneration", "MBartConfig", _BART_LIKE),
    _seq2seq("marian", "MarianMTModel", "MarianConfig", dict(_BART_LIKE, decoder_vocab_size=VOCAB)),
    _seq2seq("pegasus", "PegasusForConditionalGeneration", "PegasusConfig", _BART_LIKE),
    _seq2seq("mt5", "MT5ForConditionalGeneration", "MT5Config", _T5_LIKE),
    _seq2seq("umt5", "UMT5ForConditionalGeneration", "UMT5Config", _T5_LIKE),
    _seq2seq(
        "longt5",
        "LongT5ForConditionalGeneration",
        "LongT5Config",
        dict(_T5_LIKE, local_radius=2, global_block_size=4),
    ),
    _seq2seq(
        "switch_transformers",
        "SwitchTransformersForConditionalGeneration",
        "SwitchTransformersConfig",
        dict(
            _T5_LIKE,
            num_experts=4,
            expert_capacity=8,
            num_decoder_layers=2,  # its default is 12, whatever num_layers says
            num_sparse_encoder_layers=1,
            num_sparse_decoder_layers=1,
        ),
    ),
    _seq2seq(
        "led",
        "LEDForConditionalGeneration",
        "LEDConfig",
        dict(
            _BART_LIKE,
            max_encoder_position_embeddings=64,
            max_decoder_position_embeddings=64,
            attention_window=4,
        ),
    ),
    _seq2seq("blenderbot", "BlenderbotForConditionalGeneration", "BlenderbotConfig", _BART_LIKE),
    _seq2seq("m2m_100", "M2M100ForConditionalGeneration", "M2M100Config", _BART_LIKE),
    _seq2seq(
        "fsmt",
        "FSMTForConditionalGeneration",
        "FSMTConfig",
        dict(
            {k: v for k, v in _BART_LIKE.items() if k != "vocab_size"},
            langs=["en", "de"],
            src_vocab_size=VOCAB,
            tgt_vocab_size=VOCAB,
        ),
        # FSMT takes the decoder's inputs from the labels unshifted: as long as the inputs
        lambda config, generator: seq2seq_inputs(config, generator, target_length=SEQ),
    ),
    _seq2seq(
        "prophetnet",
        "ProphetNetForConditionalGeneration",
        "ProphetNetConfig",
        dict(
            vocab_size=VOCAB,
            hidden_size=32,
            encoder_ffn_dim=64,
            num_encoder_layers=2,
            num_encoder_attention_heads=4,
            decoder_ffn_dim=64,
            num_decoder_layers=2,
            num_decoder_attention_heads=4,
            max_position_embeddings=64,
            ngram=2,
            num_buckets=8,
            relative_max_distance=16,
            decoder_start_token_id=0,
        ),
        no_static_cache="Transformers' ProphetNet cannot decode with a static cache (the CPU "
        "raises too)",
    ),
    _seq2seq(
        "bigbird_pegasus",
        "BigBirdPegasusForConditionalGeneration",
        "BigBirdPegasusConfig",
        dict(_BART_LIKE, attention_type="original_full"),
    ),
    _seq2seq(
        "pegasus_x",
        "PegasusXForConditionalGeneration",
        "PegasusXConfig",
        dict(_BART_LIKE, num_global_tokens=4, block_size=4),
    ),
    _seq2seq(
        "nllb_moe",
        "NllbMoeForConditionalGeneration",
        "NllbMoeConfig",
        dict(
            _BART_LIKE,
            num_experts=4,
            expert_capacity=8,
            encoder_sparse_step=2,
            decoder_sparse_step=2,
        ),
    ),
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
    _vision("swin", "SwinForImageClassification", "SwinConfig", _SWIN_LIKE),
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
    _vision(
        "swinv2",
        "Swinv2ForImageClassification",
        "Swinv2Config",
        dict(_SWIN_LIKE),
    ),
    _vision(
        "cvt",
        "CvtForImageClassification",
        "CvtConfig",
        # depth[i] > i: Transformers indexes stage i's drop-path rates by i
        dict(embed_dim=[16, 32, 48], num_heads=[1, 2, 3], depth=[1, 2, 3], num_labels=5),
    ),
    _vision(
        "efficientnet",
        "EfficientNetForImageClassification",
        "EfficientNetConfig",
        dict(
            image_size=IMAGE,
            width_coefficient=0.25,
            depth_coefficient=0.25,
            hidden_dim=320,
            num_labels=5,
        ),
    ),
    _vision(
        "focalnet",
        "FocalNetForImageClassification",
        "FocalNetConfig",
        dict(
            image_size=IMAGE,
            patch_size=4,
            embed_dim=16,
            depths=[1, 1],
            focal_levels=[2, 2],
            focal_windows=[3, 3],
            num_labels=5,
        ),
    ),
    _vision(
        "levit",
        "LevitForImageClassification",
        "LevitConfig",
        dict(
            image_size=IMAGE,
            hidden_sizes=[16, 32, 48],
            num_attention_heads=[1, 2, 3],
            depths=[1, 1, 1],
            key_dim=[8, 8, 8],
            patch_size=16,
            num_labels=5,
        ),
    ),
    _vision(
        "mobilenet_v2",
        "MobileNetV2ForImageClassification",
        "MobileNetV2Config",
        dict(image_size=IMAGE, depth_multiplier=0.25, num_labels=5),
    ),
    _vision(
        "mobilevit",
        "MobileViTForImageClassification",
        "MobileViTConfig",
        dict(
            image_size=IMAGE,
            hidden_sizes=[16, 24, 32],
            neck_hidden_sizes=[8, 8, 16, 16, 24, 32, 64],
            num_attention_heads=2,
            num_labels=5,
        ),
    ),
    _vision(
        "pvt_v2",
        "PvtV2ForImageClassification",
        "PvtV2Config",
        dict(_PVT_LIKE, image_size=IMAGE),
    ),
    _vision("segformer", "SegformerForImageClassification", "SegformerConfig", _PVT_LIKE),
    _vision(
        "hiera",
        "HieraForImageClassification",
        "HieraConfig",
        dict(
            image_size=[IMAGE, IMAGE],
            patch_size=[3, 3],
            patch_stride=[2, 2],
            patch_padding=[1, 1],
            embed_dim=8,
            depths=[1, 1],
            num_heads=[1, 2],
            query_stride=[2, 2],
            masked_unit_size=[4, 4],
            num_query_pool=1,
            num_labels=5,
        ),
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
        generate=True,
    ),
    Arch(
        "wavlm",
        "audio",
        "WavLMForCTC",
        "WavLMConfig",
        dict(_CTC_AUDIO, num_buckets=16, max_bucket_distance=32),
        ctc_inputs,
    ),
    Arch(
        "sew_d",
        "audio",
        "SEWDForCTC",
        "SEWDConfig",
        dict(_CTC_AUDIO, squeeze_factor=2, max_position_embeddings=64, position_buckets=8),
        ctc_inputs,
    ),
    Arch(
        "data2vec_audio",
        "audio",
        "Data2VecAudioForCTC",
        "Data2VecAudioConfig",
        dict(_CTC_AUDIO, conv_pos_kernel_size=5, num_conv_pos_embeddings=5),
        ctc_inputs,
    ),
    Arch(
        "wav2vec2_conformer",
        "audio",
        "Wav2Vec2ConformerForCTC",
        "Wav2Vec2ConformerConfig",
        dict(_CTC_AUDIO, position_embeddings_type="relative", conv_depthwise_kernel_size=3),
        ctc_inputs,
    ),
    Arch(
        "audio_spectrogram_transformer",
        "audio",
        "ASTForAudioClassification",
        "ASTConfig",
        dict(
            hidden_size=32,
            num_hidden_layers=2,
            num_attention_heads=4,
            intermediate_size=64,
            patch_size=8,
            frequency_stride=8,
            time_stride=8,
            max_length=32,
            num_mel_bins=16,
            num_labels=5,
        ),
        spectrogram_inputs,
    ),
    Arch(
        "speech_to_text",
        "audio",
        "Speech2TextForConditionalGeneration",
        "Speech2TextConfig",
        dict(
            _BART_LIKE,
            max_source_positions=64,
            max_target_positions=64,
            num_conv_layers=2,
            conv_kernel_sizes=[5, 5],
            conv_channels=16,
            input_feat_per_channel=8,
            input_channels=1,
        ),
        filterbank_inputs,
        generate=True,
    ),
    Arch(
        "moonshine",
        "audio",
        "MoonshineForConditionalGeneration",
        "MoonshineConfig",
        dict(
            vocab_size=VOCAB,
            hidden_size=32,
            intermediate_size=64,
            encoder_num_hidden_layers=2,
            decoder_num_hidden_layers=2,
            encoder_num_attention_heads=4,
            decoder_num_attention_heads=4,
            max_position_embeddings=64,
            decoder_start_token_id=1,
            pad_token_id=0,
            bos_token_id=1,
            eos_token_id=2,
        ),
        waveform_seq2seq_inputs,
        generate=True,
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
    Arch(
        "owlvit",
        "multimodal",
        "OwlViTModel",
        "OwlViTConfig",
        dict(
            text_config=dict(_BERT_LIKE, max_position_embeddings=16),
            vision_config=_VISION_LIKE,
            projection_dim=16,
        ),
        image_text_inputs,
    ),
    Arch(
        "blip",
        "multimodal",
        "BlipModel",
        "BlipConfig",
        dict(text_config=_BERT_LIKE, vision_config=_VISION_LIKE, projection_dim=16),
        image_text_inputs,
    ),
    Arch(
        "chinese_clip",
        "multimodal",
        "ChineseCLIPModel",
        "ChineseCLIPConfig",
        dict(text_config=_BERT_LIKE, vision_config=_VISION_LIKE, projection_dim=16),
        image_text_inputs,
    ),
    Arch(
        "llava",  # a CLIP vision tower projected into a Llama's token embeddings
        "multimodal",
        "LlavaForConditionalGeneration",
        "LlavaConfig",
        dict(
            text_config=dict(_LLAMA_LIKE, model_type="llama"),
            vision_config=dict(_VISION_LIKE, model_type="clip_vision_model"),
            image_token_index=VOCAB - 1,
            image_seq_length=(IMAGE // 8) ** 2,
            vision_feature_layer=-1,
        ),
        image_tokens_inputs,
        generate=True,
    ),
]

BY_NAME: dict[str, Arch] = {arch.name: arch for arch in ARCHS}

# The default test run (CI): one architecture per family, chosen to cover distinct
# runtime paths -- KV-cache generation (a causal LM's and an encoder-decoder's),
# mixture-of-experts routing (histc, grouped matmuls), relative attention buckets,
# patch embeddings, CTC loss and weight norm -- in every eager check and mode. The
# checks named in DEFAULT_EXTRA run only for the architectures listed there (each
# costs a compile of its own; XLM's compiled forward reads a value inside its graph).
# ``TORCHTPU_ZOO=full`` runs every architecture in every column.
DEFAULT = ("llama", "mixtral", "bert", "t5", "vit", "wav2vec2")
DEFAULT_EXTRA = {"generate_static": ("llama",), "compile": ("llama", "mixtral", "vit", "xlm")}
