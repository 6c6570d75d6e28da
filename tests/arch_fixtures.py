"""Tiny random Hugging Face models for the architecture matrix, with each one's delta oracle.

Every entry says where the layers are, which module computes each attention (hooked on an eager
twin, whose attention modules return the weights they computed), and how the residual deltas
follow from the model's own modules (``out(name)``: the output of submodule ``name`` of the layer,
``out("")``: the layer's output, ``inp``: its input):

* pre-norm and parallel blocks: the sublayer module's own output;
* post-norm blocks and modules that add the residual themselves: differences of the stream the
  model itself hands on around the sublayer.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import torch  # noqa: E402
import transformers as tf  # noqa: E402

tf.logging.set_verbosity_error()

VOCAB = 96
SMALL = dict(vocab_size=VOCAB, max_position_embeddings=64)
BERT_LIKE = dict(SMALL, hidden_size=32, num_hidden_layers=2, num_attention_heads=4, intermediate_size=64)
LLAMA_LIKE = dict(SMALL, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4)


@dataclass
class Arch:
    build: Callable[[], Any]
    layers: dict[str, str]  # stack -> path of the layer list
    attn: dict[str, str]  # role -> attention module inside a layer (eager weights oracle)
    deltas: Callable[[Callable[[str], torch.Tensor], torch.Tensor], dict[str, torch.Tensor]]
    enc_dec: bool = False
    stack_roles: dict[str, tuple[str, ...]] = field(default_factory=dict)  # stack -> roles (default all)


def _seeded(cls, cfg, seed=0):
    torch.manual_seed(seed)
    return cls(cfg).eval()


def prenorm(attn="self_attn", mlp="mlp"):
    return lambda out, inp: {"self_attn": out(attn), "mlp": out(mlp)}


def postnorm(after_attn: str):
    return lambda out, inp: {"self_attn": out(after_attn) - inp, "mlp": out("") - out(after_attn)}


# sandwich norms (Gemma 2/3) and norms after each sublayer (OLMo 2): what reaches the stream is the
# normalised sublayer output
SANDWICH = prenorm("post_attention_layernorm", "post_feedforward_layernorm")
PRENORM = prenorm()


def _llama_like(model: str, config: str, deltas=PRENORM, **cfg) -> Arch:
    """A decoder laid out like Llama (``model.layers[i].self_attn``), from ``tf.<model>``/``tf.<config>``."""
    return Arch(
        lambda: _seeded(getattr(tf, model), getattr(tf, config)(**LLAMA_LIKE | cfg)),
        {"decoder": "model.layers"},
        {"self": "self_attn"},
        deltas,
    )


def _bert_like(model: str, config: str, **cfg) -> Arch:
    """A post-norm encoder laid out like BERT (``encoder.layer[i].attention.self``)."""
    return Arch(
        lambda: _seeded(getattr(tf, model), getattr(tf, config)(**BERT_LIKE | cfg)),
        {"encoder": "encoder.layer"},
        {"self": "attention.self"},
        postnorm("attention"),
    )


def _opt(pre: bool):
    cfg = tf.OPTConfig(
        **SMALL,
        hidden_size=32,
        ffn_dim=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        word_embed_proj_dim=32,
        do_layer_norm_before=pre,
    )
    return _seeded(tf.OPTForCausalLM, cfg)


def _flat(f):
    """OPT adds its MLP on a ``[b·t, d]`` view: the oracle reshapes it back."""
    return lambda out, inp: {k: v.reshape(inp.shape) for k, v in f(out, inp).items()}


ARCHS: dict[str, Arch] = {
    "opt-prenorm": Arch(
        lambda: _opt(True),
        {"decoder": "model.decoder.layers"},
        {"self": "self_attn"},
        _flat(prenorm("self_attn", "fc2")),
    ),
    "opt-postnorm": Arch(
        lambda: _opt(False),
        {"decoder": "model.decoder.layers"},
        {"self": "self_attn"},
        _flat(
            lambda out, inp: {
                "self_attn": out("self_attn_layer_norm").reshape(inp.shape) - inp,
                "mlp": out("").reshape(inp.shape) - out("self_attn_layer_norm").reshape(inp.shape),
            }
        ),
    ),
    "falcon": Arch(
        lambda: _seeded(
            tf.FalconForCausalLM,
            tf.FalconConfig(
                **SMALL,
                hidden_size=32,
                num_hidden_layers=2,
                num_attention_heads=4,
                parallel_attn=True,
                new_decoder_architecture=False,
                alibi=False,
            ),
        ),
        {"decoder": "transformer.h"},
        {"self": "self_attention"},
        prenorm("self_attention", "mlp"),
    ),
    "bloom": Arch(
        lambda: _seeded(
            tf.BloomForCausalLM, tf.BloomConfig(vocab_size=VOCAB, hidden_size=32, n_layer=2, n_head=4)
        ),
        {"decoder": "transformer.h"},
        {"self": "self_attention"},
        # BLOOM's modules add the residual handed to them: the tensor added is their last projection's
        prenorm("self_attention.dense", "mlp.dense_4h_to_h"),
    ),
    "bloom-tp2": Arch(
        lambda: _seeded(
            tf.BloomForCausalLM,
            tf.BloomConfig(
                vocab_size=VOCAB, hidden_size=32, n_layer=2, n_head=4, pretraining_tp=2, slow_but_exact=True
            ),
        ),
        {"decoder": "transformer.h"},
        {"self": "self_attention"},
        # projections summed slice by slice into zeros_like(...): the stream each module hands on
        lambda out, inp: {
            "self_attn": out("self_attention") - inp,
            "mlp": out("mlp") - out("self_attention"),
        },
    ),
    "mixtral": _llama_like(
        "MixtralForCausalLM",
        "MixtralConfig",
        num_key_value_heads=2,
        num_local_experts=4,
        num_experts_per_tok=2,
    ),
    "qwen2-moe": _llama_like(
        "Qwen2MoeForCausalLM",
        "Qwen2MoeConfig",
        num_key_value_heads=2,
        num_experts=4,
        num_experts_per_tok=2,
        moe_intermediate_size=32,
        shared_expert_intermediate_size=64,
    ),
    "mistral": _llama_like("MistralForCausalLM", "MistralConfig", num_key_value_heads=2),
    "qwen2": _llama_like("Qwen2ForCausalLM", "Qwen2Config", num_key_value_heads=2),
    "gemma": _llama_like("GemmaForCausalLM", "GemmaConfig", num_key_value_heads=1, head_dim=8),
    "gemma2": _llama_like("Gemma2ForCausalLM", "Gemma2Config", SANDWICH, num_key_value_heads=2, head_dim=8),
    "phi": _llama_like("PhiForCausalLM", "PhiConfig"),
    "gpt-bigcode": Arch(
        lambda: _seeded(
            tf.GPTBigCodeForCausalLM,
            tf.GPTBigCodeConfig(vocab_size=VOCAB, n_positions=64, n_embd=32, n_layer=2, n_head=4),
        ),
        {"decoder": "transformer.h"},
        {"self": "attn"},
        prenorm("attn", "mlp"),
    ),
    "roberta": _bert_like("RobertaModel", "RobertaConfig"),
    "distilbert": Arch(
        lambda: _seeded(
            tf.DistilBertModel,
            tf.DistilBertConfig(
                vocab_size=VOCAB, max_position_embeddings=64, dim=32, n_layers=2, n_heads=4, hidden_dim=64
            ),
        ),
        {"encoder": "transformer.layer"},
        {"self": "attention"},
        postnorm("sa_layer_norm"),
    ),
    "whisper": Arch(
        lambda: _seeded(
            tf.WhisperModel,
            tf.WhisperConfig(
                vocab_size=VOCAB,
                num_mel_bins=8,
                d_model=32,
                encoder_layers=2,
                decoder_layers=2,
                encoder_attention_heads=4,
                decoder_attention_heads=4,
                encoder_ffn_dim=64,
                decoder_ffn_dim=64,
                max_source_positions=8,
                max_target_positions=16,
                pad_token_id=0,
                decoder_start_token_id=1,
            ),
        ),
        {"encoder": "encoder.layers", "decoder": "decoder.layers"},
        {"self": "self_attn", "cross": "encoder_attn"},
        lambda out, inp: {
            "self_attn": out("self_attn"),
            "mlp": out("fc2"),
            **({"cross_attn": out("encoder_attn")} if out("encoder_attn") is not None else {}),
        },
        enc_dec=True,
        stack_roles={"encoder": ("self",), "decoder": ("self", "cross")},
    ),
    "gpt-neo": Arch(
        lambda: _seeded(
            tf.GPTNeoForCausalLM,
            tf.GPTNeoConfig(
                **SMALL,
                hidden_size=32,
                num_layers=2,
                num_heads=4,
                attention_types=[[["global", "local"], 1]],
                window_size=3,  # layer 1 attends to the last 3 tokens only
            ),
        ),
        {"decoder": "transformer.h"},
        {"self": "attn.attention"},
        prenorm("attn", "mlp"),
    ),
    "gpt-neox": Arch(
        lambda: _seeded(tf.GPTNeoXForCausalLM, tf.GPTNeoXConfig(**LLAMA_LIKE, rotary_pct=0.5)),
        {"decoder": "gpt_neox.layers"},
        {"self": "attention"},
        prenorm("attention", "mlp"),
    ),
    "codegen": Arch(
        lambda: _seeded(
            tf.CodeGenForCausalLM,
            tf.CodeGenConfig(vocab_size=VOCAB, n_positions=64, n_embd=32, n_layer=2, n_head=4, rotary_dim=4),
        ),
        {"decoder": "transformer.h"},
        {"self": "attn"},
        prenorm("attn", "mlp"),
    ),
    "stablelm": _llama_like(
        "StableLmForCausalLM",
        "StableLmConfig",
        num_key_value_heads=2,
        partial_rotary_factor=0.5,
        qk_layernorm=True,
        use_parallel_residual=True,
    ),
    "cohere": _llama_like("CohereForCausalLM", "CohereConfig", num_key_value_heads=2, pad_token_id=0),
    "phi3": _llama_like("Phi3ForCausalLM", "Phi3Config", num_key_value_heads=2, pad_token_id=0),
    "qwen3": _llama_like("Qwen3ForCausalLM", "Qwen3Config", num_key_value_heads=2, head_dim=8),
    "olmo2": _llama_like("Olmo2ForCausalLM", "Olmo2Config", SANDWICH, num_key_value_heads=2),
    "starcoder2": _llama_like("Starcoder2ForCausalLM", "Starcoder2Config", num_key_value_heads=2),
    "gemma3": _llama_like(
        "Gemma3ForCausalLM",
        "Gemma3TextConfig",
        SANDWICH,
        num_key_value_heads=2,
        head_dim=8,
        sliding_window=3,
        layer_types=["sliding_attention", "full_attention"],
    ),
    "mpt": Arch(
        lambda: _seeded(
            tf.MptForCausalLM,
            tf.MptConfig(
                vocab_size=VOCAB, d_model=32, n_heads=4, n_layers=2, expansion_ratio=2, max_seq_len=64
            ),
        ),
        {"decoder": "transformer.blocks"},
        {"self": "attn"},
        # ALiBi; the FFN adds the residual handed to it: the tensor added is its down projection
        prenorm("attn", "ffn.down_proj"),
    ),
    "electra": _bert_like("ElectraModel", "ElectraConfig", embedding_size=16),
    "xlm-roberta": _bert_like("XLMRobertaModel", "XLMRobertaConfig"),
    # block-sparse attention falls back to full attention on short texts; this is the full path
    "bigbird": _bert_like("BigBirdModel", "BigBirdConfig", attention_type="original_full"),
    "w2v2-conformer": Arch(
        lambda: _seeded(
            tf.Wav2Vec2ConformerModel,
            tf.Wav2Vec2ConformerConfig(
                hidden_size=32,
                num_hidden_layers=2,
                num_attention_heads=4,
                intermediate_size=64,
                conv_dim=(16, 16),
                conv_stride=(5, 2),
                conv_kernel=(10, 3),
                num_conv_pos_embeddings=16,
                num_conv_pos_embedding_groups=4,
                conv_depthwise_kernel_size=3,
                position_embeddings_type="rotary",
            ),
        ),
        {"encoder": "encoder.layers"},
        {"self": "self_attn"},
        # macaron: x + ffn1/2, + attention, + convolution, ln(x + ffn2/2); every sublayer that is
        # not attention counts as mlp (the last one as the stream difference around it)
        lambda out, inp: {
            "self_attn": out("self_attn"),
            "mlp": out("ffn1") * 0.5
            + out("conv_module")
            + (out("") - (inp + out("ffn1") * 0.5 + out("self_attn") + out("conv_module"))),
        },
    ),
    "jamba-hybrid": _llama_like(
        "JambaForCausalLM",
        "JambaConfig",
        prenorm("self_attn", "feed_forward"),
        num_hidden_layers=4,
        num_key_value_heads=2,
        attn_layer_period=2,
        attn_layer_offset=1,  # layers 1 and 3 attend; 0 and 2 are Mamba
        expert_layer_period=2,
        expert_layer_offset=1,
        num_experts=4,
        num_experts_per_tok=2,
        mamba_d_state=4,
        mamba_dt_rank=4,
        use_mamba_kernels=False,
    ),
}


def albert(layers: int = 3):
    """ALBERT: one layer module (``albert_layer_groups.0``) run for every layer (probe refuses it)."""
    cfg = tf.AlbertConfig(**BERT_LIKE | {"num_hidden_layers": layers}, embedding_size=16)
    return _seeded(tf.AlbertModel, cfg)


def longformer():
    """Longformer: local attention computed over sliding-window chunks (probe refuses it)."""
    return _seeded(tf.LongformerModel, tf.LongformerConfig(**BERT_LIKE, attention_window=4))


def inputs(name: str, model) -> dict[str, torch.Tensor]:
    """The forward's inputs: 2 texts of 7 tokens (Whisper: 16 mel frames -> 8 positions, 5 tokens)."""
    g = torch.Generator().manual_seed(0)
    if name == "w2v2-conformer":  # 2 clips of 400 samples -> 19 frames
        return {"input_values": torch.randn(2, 400, generator=g)}
    if name == "whisper":
        return {
            "input_features": torch.randn(2, 8, 16, generator=g),
            "decoder_input_ids": torch.randint(2, VOCAB, (2, 5), generator=g),
        }
    ids = torch.randint(3, VOCAB, (2, 7), generator=g)
    return {"input_ids": ids, "attention_mask": torch.ones_like(ids)}


def eager_twin(model):
    """The same weights on eager attention (built anew: some models read the choice at init)."""
    import copy

    twin = type(model)._from_config(copy.deepcopy(model.config), attn_implementation="eager")
    twin.load_state_dict(model.state_dict())
    assert twin.config._attn_implementation == "eager"
    return twin.eval()


# name -> (the family as the README's table names it, what the entry exercises)
ABOUT: dict[str, tuple[str, str]] = {
    "opt-prenorm": ("OPT, `do_layer_norm_before=True`", "pre-norm, MLP added on a `[b·t, d]` view"),
    "opt-postnorm": ("OPT, `do_layer_norm_before=False`", "post-norm (stream differences)"),
    "falcon": ("Falcon", "parallel attention + MLP, `mlp_output += attention_output`"),
    "bloom": ("BLOOM", "attention/MLP modules add the residual handed to them; ALiBi, `[b·h]` baddbmm"),
    "bloom-tp2": (
        "BLOOM, `pretraining_tp=2`, `slow_but_exact`",
        "projections summed slice by slice into `zeros_like`",
    ),
    "mixtral": ("Mixtral", "routed experts (top-2 of 4)"),
    "qwen2-moe": ("Qwen2-MoE", "routed experts + gated shared expert"),
    "mistral": ("Mistral", "pre-norm, GQA"),
    "qwen2": ("Qwen2", "pre-norm, GQA"),
    "gemma": ("Gemma", "pre-norm, MQA"),
    "gemma2": ("Gemma 2", "sandwich norms (normalised sublayer output added)"),
    "phi": ("Phi", "parallel attention + MLP"),
    "gpt-bigcode": ("GPT-BigCode", "pre-norm, multi-query"),
    "roberta": ("RoBERTa", "post-norm encoder; left padding vs each text alone: ≤ 1e-5 asserted"),
    "distilbert": ("DistilBERT", "post-norm encoder"),
    "whisper": ("Whisper", "encoder-decoder, self + cross attention"),
    "gpt-neo": ("GPT-Neo", "global and local (window 3) attention layers"),
    "gpt-neox": ("GPT-NeoX / Pythia", "parallel attention + MLP, partial rotary"),
    "codegen": ("CodeGen", "parallel attention + MLP, one norm"),
    "stablelm": ("StableLM", "parallel residual, qk-norm, partial rotary, GQA"),
    "cohere": ("Cohere", "parallel attention + MLP, one norm"),
    "phi3": ("Phi-3", "pre-norm, fused qkv, GQA"),
    "qwen3": ("Qwen3", "pre-norm, qk-norm, GQA"),
    "olmo2": ("OLMo 2", "norm after each sublayer (normalised output added), qk-norm"),
    "starcoder2": ("Starcoder2", "pre-norm LayerNorm, GQA"),
    "gemma3": ("Gemma 3", "sandwich norms, qk-norm, a sliding-window (3) and a global layer"),
    "mpt": ("MPT", "ALiBi; the FFN adds the residual handed to it"),
    "electra": ("ELECTRA", "post-norm encoder, embedding projection"),
    "xlm-roberta": ("XLM-R", "post-norm encoder"),
    "bigbird": ("BigBird", "post-norm encoder, `original_full` attention"),
    "w2v2-conformer": (
        "Wav2Vec2-Conformer",
        "macaron: FFN/2, attention, convolution, FFN/2 + norm (all but attention in `mlp`)",
    ),
    "jamba-hybrid": ("Jamba", "hybrid: Mamba layers 0, 2 (stream only), attention layers 1, 3, MoE"),
}
