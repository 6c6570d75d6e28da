"""Tiny configs for every model type of the installed ``transformers``: a generic shrink (small
hidden size, two layers, four heads, a small vocabulary) plus per-family overrides where the
generic shrink does not build or does not run.

``tiny_config(model_type)`` returns the shrunk config; ``model_class(config)`` the class that
runs it on token ids; ``build(model_type)`` the seeded model in eval mode on the default
attention implementation. Used by ``benchmarks/catalogue.py`` and ``tests/test_catalogue.py``.
"""

from __future__ import annotations

import copy
import re
from typing import Any

import torch
from catalogue_overrides import CLASSES, FFN, HEAD_DIM, HEADS, HIDDEN, KV_HEADS, LAYERS, OVERRIDES, VOCAB

_HIDDEN = (
    "hidden_size",
    "d_model",
    "n_embd",
    "dim",
    "embed_dim",
    "n_embed",
    "model_dim",
    "d_embed",
    "hidden_size_global",  # BLT's byte encoder/decoder: the width of the global (patch) transformer
)
_EMBED = ("embedding_size", "word_embed_proj_dim", "embedding_dim")
# widths a vision tower's projector hands to the text model (or a joint space): the text width
_OUT_HIDDEN = (
    "projection_dim",
    "proj_dim",
    "out_hidden_size",
    "text_hidden_size",
    "projector_hidden_size",
    "projection_size",
    "vision_output_dim",
    "projector_output_dim",
    "image_text_hidden_size",
)
_LAYERS = (
    "num_hidden_layers",
    "n_layer",
    "num_layers",
    "n_layers",
    "encoder_layers",
    "decoder_layers",
    "num_decoder_layers",
    "num_encoder_layers",
    "decoder_num_layers",
    "encoder_num_layers",
    "depth",  # vision towers (Qwen2-VL, GLM-4V, ...)
)
_HEADS = (
    "num_attention_heads",
    "n_head",
    "n_heads",
    "num_heads",
    "encoder_attention_heads",
    "decoder_attention_heads",
    "num_decoder_attention_heads",
    "encoder_num_attention_heads",
    "decoder_num_attention_heads",
)
_KV = ("num_key_value_heads", "n_kv_heads", "num_kv_heads", "multi_query_group_num")
_FFN = (
    "intermediate_size",
    "ffn_dim",
    "encoder_ffn_dim",
    "decoder_ffn_dim",
    "d_ff",
    "n_inner",
    "hidden_dim",
    "ffn_hidden_size",
    "encoder_ffn_embed_dim",
    "decoder_ffn_embed_dim",
    "d_inner",
    "dim_feedforward",
    "moe_intermediate_size",
    "shared_expert_intermediate_size",
)
_HEAD_DIM = ("head_dim", "d_kv", "d_head", "attention_head_dim", "kv_channels")
_EXPERTS = ("num_experts", "num_local_experts", "n_routed_experts", "moe_num_experts")
_PER_TYPE = ("layer_types", "block_types", "layers_block_type", "attention_types_per_layer")
_SMALL = {
    "num_experts_per_tok": 2,
    "moe_k": 2,
    "moe_topk": 2,
    "top_k": 2,
    "n_shared_experts": 1,
    "kv_lora_rank": 16,
    "q_lora_rank": 16,
    "qk_rope_head_dim": 8,
    "qk_nope_head_dim": 8,
    "v_head_dim": 16,
    "n_group": 1,
    "topk_group": 1,
    "num_shared_experts": 1,
    "first_k_dense_replace": 1,
    # state-space and linear-attention layers of hybrids: the reference (non-kernel) paths are slow
    "mamba_chunk_size": 8,
    "chunk_size": 8,
    "mamba_d_state": 16,
    "state_size": 16,
    "ssm_state_size": 16,
    "d_state": 16,
    "mamba_n_heads": 8,
    "mamba_d_head": 16,
    "mamba_n_groups": 1,
    "n_groups": 1,
    "linear_num_key_heads": 2,
    "linear_num_value_heads": 4,
    "linear_key_head_dim": 16,
    "linear_value_head_dim": 16,
    "time_step_rank": 8,
    "max_window_layers": LAYERS,
}


def _uniq_types(types: list, n: int) -> list:
    seen: list = []
    for t in types:
        if t not in seen:
            seen.append(t)
    out = list(seen)
    while len(out) < n:
        out.append(seen[len(out) % len(seen)])
    return out


def _sections(old: list[int], total: int) -> list[int]:
    """``old`` scaled to sum to ``total``, each at least 1."""
    out = [max(1, round(x * total / sum(old))) for x in old]
    out[-1] += total - sum(out)
    return out


def _shrink_kwargs(cls: Any, base: Any, depth: int = 0) -> dict[str, Any]:
    """Keyword arguments that shrink ``base`` (an instance of config class ``cls``)."""
    d = base.to_dict() if hasattr(base, "to_dict") else dict(base)
    kw: dict[str, Any] = {}

    def put(keys, value, cond=lambda v: isinstance(v, int) and not isinstance(v, bool)):
        for k in keys:
            if k in d and d[k] is not None and cond(d[k]):
                kw[k] = value

    put(_HIDDEN, HIDDEN)
    put(_EMBED, 32)
    put(_OUT_HIDDEN, HIDDEN)
    old_layers = next((d[k] for k in _LAYERS if isinstance(d.get(k), int)), None)
    n_layers = LAYERS
    for k in _PER_TYPE:
        if isinstance(d.get(k), list) and d[k]:
            n_layers = max(n_layers, len(set(map(str, d[k]))))
    put(_LAYERS, n_layers, lambda v: isinstance(v, int) and v > 0)
    put(_HEADS, HEADS, lambda v: isinstance(v, int) and v > 0)
    put(_KV, KV_HEADS, lambda v: isinstance(v, int) and v > 1)
    put(_FFN, FFN, lambda v: isinstance(v, int) and v > 0)
    put(_HEAD_DIM, HEAD_DIM, lambda v: isinstance(v, int) and v > 0)
    put(_EXPERTS, 4, lambda v: isinstance(v, int) and v > 4)
    if isinstance(d.get("qk_rope_head_dim"), int) and "head_dim" in d:
        kw["head_dim"] = min(d["qk_rope_head_dim"], _SMALL["qk_rope_head_dim"])  # MLA: rotary width
        put(_KV, HEADS, lambda v: isinstance(v, int) and v > 1)  # MLA: one latent kv per head
    for k, v in _SMALL.items():
        put([k], v, lambda old, v=v: isinstance(old, int) and not isinstance(old, bool) and old > v)
    for k, v in d.items():  # vocab_size, vocab_size_per_layer_input (Gemma 3n/4), ...
        if "vocab_size" in k and (v is None and k == "vocab_size" or isinstance(v, int) and v > VOCAB):
            kw[k] = VOCAB
    vocab = kw.get("vocab_size", d.get("vocab_size"))
    if isinstance(vocab, int):
        for i, (k, v) in enumerate(sorted(d.items())):
            if k.endswith("_token_id") and isinstance(v, int) and v >= vocab:
                kw[k] = vocab - 1 - (i % 16)
    for k, v in d.items():
        if k in _PER_TYPE and isinstance(v, list) and v:
            kw[k] = _uniq_types(v, n_layers)
        elif (
            isinstance(v, list)
            and old_layers
            and len(v) == old_layers
            and old_layers > n_layers
            and k not in kw
        ):
            kw[k] = v[:n_layers]
    _respect_validators(d, kw, n_layers)
    if depth < 3:
        _shrink_sub_configs(cls, base, kw, depth)
    if not isinstance(vocab, int):
        _special_ids_in_text_vocab(d, kw)
    return kw


def _special_ids_in_text_vocab(d: dict, kw: dict[str, Any]) -> None:
    """A composite config's own special ids (LLaVA's ``image_token_index`` 32000) moved into its
    shrunk text config's vocabulary, where the image tokens of its inputs are looked up (in place)."""
    text = kw.get("text_config")
    vocab = text.get("vocab_size") if isinstance(text, dict) else None
    if not isinstance(vocab, int):
        return
    for i, (k, v) in enumerate(sorted(d.items())):
        special = k.endswith(("_token_id", "_token_index"))
        if special and isinstance(v, int) and not isinstance(v, bool) and v >= vocab and k not in kw:
            kw[k] = vocab - 1 - (i % 16)


def _respect_validators(d: dict, kw: dict[str, Any], n_layers: int) -> None:
    """Shrink what the config validators tie to the sizes shrunk above (in place in ``kw``)."""
    if d.get("head_dim", 0) is None and "num_attention_heads" in kw:
        kw["head_dim"] = HEAD_DIM  # None means hidden/heads, which some modeling code does not work out
    for k in _KV:
        if k in d and d[k] is None and "num_attention_heads" in kw:
            kw[k] = HEADS  # None means one kv head per query head
    rope = d.get("rope_parameters") or d.get("rope_scaling")
    rotary = kw.get("qk_rope_head_dim", kw.get("head_dim"))  # MLA (HunYuan V4): the rotary part
    if isinstance(rope, dict) and isinstance(rope.get("mrope_section"), list) and rotary:
        # multimodal rotary (Qwen2-VL, GLM-4V): the sections split head_dim·partial/2 rotary pairs
        part = d.get("partial_rotary_factor") or 1.0
        kw["rope_parameters" if "rope_parameters" in d else "rope_scaling"] = {
            **rope,
            "mrope_section": _sections(rope["mrope_section"], int(rotary * part) // 2),
        }
    if isinstance(d.get("out_features"), list) and isinstance(d.get("stage_names"), list):
        # backbones: the stages named for the full depth do not exist in the shrunk one: the last stage
        kw["out_features"], kw["out_indices"] = None, None
    if isinstance(d.get("initializer_range"), float):
        kw["initializer_range"] = 0.1  # peakier random patterns than 0.02: a stronger check


def _shrink_sub_configs(cls: Any, base: Any, kw: dict[str, Any], depth: int) -> None:
    """Shrunk sub-configs (text, vision, audio, ...) into ``kw``, with their own family's overrides."""
    for name in getattr(cls, "sub_configs", None) or {}:
        sub = getattr(base, name, None)
        if sub is None or not hasattr(sub, "to_dict"):
            continue
        small = _shrink_kwargs(type(sub), sub, depth + 1)
        small.update(copy.deepcopy(OVERRIDES.get(getattr(sub, "model_type", None), {})))
        if set(small) - {"initializer_range"}:  # a sub-config left as it is stays the default object
            full = sub.to_dict()
            if any(k in small for k in _LAYERS):
                full.pop("per_layer_config", None)  # keyed by full-depth layer indices: rebuilt from the rest
            kw[name] = {**full, **small}


def tiny_config(model_type: str) -> Any:
    """The shrunk config of ``model_type``."""
    import transformers as tf

    cls = tf.CONFIG_MAPPING[model_type]
    base = cls()
    kw = _shrink_kwargs(cls, base)
    for k, v in copy.deepcopy(OVERRIDES.get(model_type, {})).items():
        # a dict for a sub-config is laid over its shrunk dict (LLaVA-style vision_config sizes)
        sub = kw.get(k) if k.endswith("_config") else None
        kw[k] = {**sub, **v} if isinstance(sub, dict) and isinstance(v, dict) else v
    for _ in range(6):  # a validator that ties one size to another: set it as the message says, again
        try:
            cfg = cls(**kw)
            break
        except Exception as e:  # noqa: BLE001 - huggingface_hub's StrictDataclass*ValidationError
            if "ValidationError" not in type(e).__name__ or not _follow_validator(kw, base, str(e)):
                raise
    _mrope(cfg)
    for k in ("use_cache", "tie_word_embeddings"):
        if hasattr(cfg, k) and k == "use_cache":
            cfg.use_cache = False
    return cfg


_TIED = re.compile(r"`?([\w.]+)`? \((\d+)\) must (?:equal|match) (?:the backbone )?`?([\w.]+)[^(]*\((\d+)\)")
_TIED_BARE = re.compile(r"\b(\w+) must (?:equal|match) (\w+)\b")


def _follow_validator(kw: dict[str, Any], base: Any, msg: str) -> bool:
    """Set the size a config validator ties to another (``\\`a.b\\` (512) must equal \\`c\\` (64)``,
    ``adapter_in_dim must match hidden_size``) in ``kw``, nested where the name is; False if the
    message is not of that form or names nothing that ``kw`` or ``base`` holds."""
    m, bare = _TIED.search(msg), _TIED_BARE.search(msg)
    if not (m or bare):
        return False
    full = base.to_dict()
    path = (m.group(1) if m else bare.group(1)).split(".")
    target = kw
    for part in path[:-1]:  # `head_config.audio_hidden_size`: into the sub-config's dict
        if not isinstance(target.get(part), dict):
            if target is not kw or not isinstance(full.get(part), dict):
                return False
            target[part] = dict(full[part])
        target = target[part]
    if len(path) == 1 and path[0] not in kw and path[0] not in full:
        target = _holder(kw, full, path[0])  # a bare name: the sub-config that holds it
        if target is None:
            return False
    if m:
        value = int(m.group(4))
    else:
        value = target.get(bare.group(2), kw.get(bare.group(2), full.get(bare.group(2))))
    if not isinstance(value, int) or target.get(path[-1]) == value:
        return False
    target[path[-1]] = value
    return True


def _holder(kw: dict[str, Any], full: dict[str, Any], name: str) -> dict[str, Any] | None:
    """The sub-config dict in ``kw`` that holds ``name`` (copied in from ``full`` if need be)."""
    for key, sub in full.items():
        if isinstance(sub, dict) and name in sub:
            if not isinstance(kw.get(key), dict):
                kw[key] = dict(sub)
            return kw[key]
    return None


def _mrope(cfg: Any) -> None:
    """Multimodal rotary sections (Qwen2-VL, GLM-4V, ...) that fit the tiny head, set where the
    modeling code reads them (its default sections fit the full-size head)."""
    import inspect
    import sys

    # the model's module, or its text model's (GLM-4.6V runs GLM-4V's text model)
    try:
        text = cfg.get_text_config()
    except ValueError:  # MusicGen: a text encoder and a decoder, neither "the" text config
        return
    classes = {model_class(cfg), model_class(text) if text is not cfg else None}
    modules = [sys.modules.get(c.__module__) for c in classes if c is not None]
    sources = [inspect.getsource(m) for m in modules if m is not None]  # None: a dummy class
    if not any("mrope_section" in src for src in sources):
        return
    # the modeling code's own default sections (ERNIE 4.5 VL: [22, 22, 20], its h and w equal)
    found = [re.search(r"mrope_section\", \[(\d+), (\d+), (\d+)\]\)", src) for src in sources]
    default = next(([int(x) for x in m.groups()] for m in found if m), [16, 24, 24])
    for c in {id(cfg): cfg, id(text): text}.values():
        rope = getattr(c, "rope_parameters", None)
        if not isinstance(rope, dict) or not rope or any(isinstance(v, dict) for v in rope.values()):
            # {} or {layer type: parameters}: no multimodal sections to split (Cohere Compass)
            continue
        head = getattr(c, "head_dim", None) or c.hidden_size // c.num_attention_heads
        total = (
            int(head * (rope.get("partial_rotary_factor") or getattr(c, "partial_rotary_factor", 1.0))) // 2
        )
        c.rope_parameters = {
            **rope,
            "mrope_section": _sections(rope.get("mrope_section") or default, total),
        }


def model_class(config: Any) -> Any:
    """The class that runs ``config`` on token ids: the base model, else a causal or masked LM, else
    ``<Name>Model``, else a task head of another auto mapping; None if there is none."""
    import transformers as tf

    if getattr(config, "model_type", None) in CLASSES:
        return getattr(tf, CLASSES[config.model_type])
    for mapping in ("MODEL_MAPPING", "MODEL_FOR_CAUSAL_LM_MAPPING", "MODEL_FOR_MASKED_LM_MAPPING"):
        try:
            cls = getattr(tf, mapping)[type(config)]
            return cls[0] if isinstance(cls, (tuple, list)) else cls  # Funnel: (FunnelModel, FunnelBaseModel)
        except (KeyError, ValueError, AttributeError):
            continue
    # sub-models that no auto mapping lists (AlignTextConfig -> AlignTextModel)
    name = type(config).__name__
    if name.endswith("Config"):
        try:
            return getattr(tf, name[: -len("Config")] + "Model")
        except (AttributeError, ImportError):
            pass
    return _task_class(config)


def _task_class(config: Any) -> Any:
    """The class of a task head that the auto mappings pair with ``config`` (ColPali: retrieval,
    EoMT: segmentation), one that takes ``input_ids`` first; None if no mapping lists it."""
    import inspect

    import transformers as tf
    from transformers.models.auto import modeling_auto

    names: list[str] = []
    for mapping in sorted(dir(modeling_auto)):
        if mapping.startswith("MODEL_FOR_") and mapping.endswith("_MAPPING_NAMES"):
            name = getattr(modeling_auto, mapping).get(getattr(config, "model_type", None))
            if isinstance(name, str) and name not in names:
                names.append(name)
    classes = []
    for name in names:
        try:
            classes.append(getattr(tf, name))
        except (AttributeError, ImportError):
            continue
    text = [c for c in classes if "input_ids" in inspect.signature(c.forward).parameters]
    return (text or classes or [None])[0]


def build(model_type: str, seed: int = 0) -> Any:
    """The seeded tiny model of ``model_type`` in eval mode (default attention implementation)."""
    cfg = tiny_config(model_type)
    cls = model_class(cfg)
    if cls is None:
        raise LookupError(f"no base or causal-LM model class for {model_type}")
    torch.manual_seed(seed)
    model = cls(cfg).eval()
    if hasattr(model, "set_default_language") and getattr(cfg, "languages", None):
        model.set_default_language(cfg.languages[0])  # X-MOD: one adapter per language, chosen by hand
    return model
