"""Inputs for the catalogue's image and vision-language families, made from each model's own
(shrunk) config: ``pixel_values`` at the config's image size and channel count, a pixel mask
where the forward takes one, Qwen2-VL's flattened patches with their ``image_grid_thw``, and,
for a vision-language model, random text ids with one block of image tokens (the config's image
token id) per row, as many as the model makes of one image. Used by ``benchmarks/catalogue.py``
and ``tests/test_catalogue.py``; the check itself is ``catalogue_check.check_model``.

``image_inputs(model)`` returns the keyword tensors (None where the forward takes no pixels);
``not_image(cls)`` says in words what a forward that takes no pixels and no ids takes instead.

The number of image tokens is the model's own: the count a config states (``image_seq_length``,
``mm_tokens_per_image``, ...) or, failing that, the patch grid; where the forward then says
"Image features and image tokens do not match, tokens: n, features: m" (the message of
transformers' ``get_placeholder_mask``), the text is rebuilt with ``m`` image tokens and run again.
Where a forward refuses 4-d pixels, one image per row as ``[batch, 1, C, H, W]`` is tried.
"""

from __future__ import annotations

import inspect
import re
from typing import Any

import torch

# what a forward takes instead of ids or pixels, in words (the first found names the reason)
_OTHER = (
    ("input_features", "audio features"),
    ("input_values", "an audio waveform"),
    ("audio_values", "an audio waveform"),
    ("pixel_values_videos", "video frames"),
    ("past_values", "a time series"),
    ("hidden_states", "hidden states of a parent model"),
    ("inputs_embeds", "embeddings"),
)
_MISMATCH = re.compile(r"tokens do not match[^\d]*tokens: (\d+), features:? (\d+)", re.I)
_COUNT_KEYS = (
    "image_seq_length",
    "mm_tokens_per_image",
    "num_image_tokens",
    "image_token_count",
    "num_query_tokens",  # BLIP-2, InstructBLIP: the Q-Former's queries stand for the image
    "latent_query_num",  # Kosmos-2's image queries
)
_IMAGE_TOKEN_KEYS = ("image_token_id", "image_token_index", "image_token")
BATCH = 2  # a vision-language text batch: the second row padded at its end
DEFAULT_SIZE = (64, 96)  # pixels where the config names no image size (DETR, convolutional backbones)


def forward_params(obj: Any) -> list[str]:
    """The forward's parameter names (``self`` left out) of a model or model class."""
    try:
        return [n for n in inspect.signature(obj.forward).parameters if n != "self"]
    except Exception:  # noqa: BLE001 - a dummy class of a missing library (torchaudio) raises ImportError
        return []


def not_image(cls: Any) -> str:
    """Why a forward that takes neither ``input_ids`` nor ``pixel_values`` is not run: what it takes."""
    params = forward_params(cls)
    for key, words in _OTHER:
        if key in params:
            return f"{cls.__name__}.forward takes {key} ({words}), not token ids or pixels"
    first = ", ".join(params[:3]) or "nothing named"
    return f"{cls.__name__}.forward takes {first}, not token ids or pixels"


def takes_pixels(cls: Any) -> bool:
    """Whether the forward takes ``pixel_values`` (or Qwen-VL towers' flattened patches + grid)."""
    params = forward_params(cls)
    return "pixel_values" in params or ("hidden_states" in params and "grid_thw" in params)


def _configs(cfg: Any) -> list[Any]:
    """``cfg`` and its vision-side sub-configs, the vision ones first."""
    out = []
    for name in ("vision_config", "vision_encoder_config", "encoder", "backbone_config", "image_config"):
        sub = getattr(cfg, name, None)
        if sub is not None and hasattr(sub, "to_dict"):
            out.append(sub)
    return out + [cfg]


def _first(cfgs: list[Any], *names: str) -> Any:
    for c in cfgs:
        for n in names:
            v = getattr(c, n, None)
            if v is not None and not isinstance(v, bool):
                return v
    return None


def _pair(v: Any) -> tuple[int, int] | None:
    if isinstance(v, int):
        return v, v
    if isinstance(v, (list, tuple)) and len(v) == 2 and all(isinstance(x, int) for x in v):
        return int(v[0]), int(v[1])
    if isinstance(v, dict):
        if "height" in v and "width" in v:
            return int(v["height"]), int(v["width"])
        if "shortest_edge" in v:
            return int(v["shortest_edge"]), int(v["shortest_edge"])
    return None


def image_size(cfg: Any) -> tuple[int, int]:
    """``(height, width)`` in pixels: the config's image size, else :data:`DEFAULT_SIZE`."""
    cfgs = _configs(cfg)
    return _pair(_first(cfgs, "image_size", "img_size", "input_size", "crop_size")) or DEFAULT_SIZE


def channels(cfg: Any) -> int:
    """The channel count of the pixels (the config's ``num_channels``/``in_channels``, else 3)."""
    v = _first(_configs(cfg), "num_channels", "in_channels", "in_chans", "image_channels")
    return v if isinstance(v, int) and 0 < v <= 4 else 3


def _text_config(cfg: Any) -> Any:
    try:
        return cfg.get_text_config()
    except (ValueError, AttributeError):
        return cfg


def special_ids(cfg: Any) -> dict[str, int]:
    """The config's (and its text config's) special token ids by name."""
    out: dict[str, int] = {}
    for c in (cfg, _text_config(cfg)):
        for k, v in c.to_dict().items():
            if ("token_id" in k or "token_index" in k) and isinstance(v, int) and not isinstance(v, bool):
                out.setdefault(k, v)
    return out


def image_token(cfg: Any) -> int | None:
    """The id that marks an image position in the text (``image_token_id``/``_index``), or None."""
    for c in (cfg, _text_config(cfg)):
        for k in _IMAGE_TOKEN_KEYS:
            v = getattr(c, k, None)
            if isinstance(v, int) and not isinstance(v, bool):
                return v
    return None


def _vocab(cfg: Any) -> int:
    v = getattr(_text_config(cfg), "vocab_size", None) or getattr(cfg, "vocab_size", None) or 256
    return max(8, min(int(v), 512))


def _text_ids(cfg: Any, n: int, g: torch.Generator) -> torch.Tensor:
    """``[BATCH, n]`` random ids below the vocabulary, none of them a special token."""
    banned = set(special_ids(cfg).values())
    pool = torch.tensor([i for i in range(4, _vocab(cfg)) if i not in banned])
    return pool[torch.randint(len(pool), (BATCH, n), generator=g)]


def _guess_count(cfg: Any, grid: tuple[int, int]) -> int:
    """Image tokens for one image: the count the config states, else the patch grid's size."""
    for c in (cfg, _text_config(cfg)):
        for k in _COUNT_KEYS:
            v = getattr(c, k, None)
            if isinstance(v, int) and v > 0:
                return v
    return max(1, grid[0] * grid[1])


def _pixels(cfg: Any, batch: int, g: torch.Generator, five_d: int = 0) -> torch.Tensor:
    h, w = image_size(cfg)
    shape = (batch, five_d, channels(cfg), h, w) if five_d else (batch, channels(cfg), h, w)
    return torch.randn(*shape, generator=g)


def _patch(cfg: Any) -> int:
    p = _first(_configs(cfg), "patch_size")
    p = _pair(p)
    return p[0] if p else 16


def _qwen_patches(cfg: Any, n_images: int, g: torch.Generator) -> tuple[torch.Tensor, torch.Tensor, int]:
    """Qwen2-VL-style flattened patches ``[n·t·h·w, C·tp·p·p]``, ``image_grid_thw`` and the image
    tokens per image (``t·h·w / merge²``): a 4 × 6 grid of merged patches' halves (non-square)."""
    cfgs = _configs(cfg)
    merge = _first(cfgs, "spatial_merge_size", "merge_size") or 1
    tp = _first(cfgs, "temporal_patch_size") or 1
    p = _patch(cfg)
    gh, gw = 2 * merge, 3 * merge
    dim = channels(cfg) * tp * p * p
    x = torch.randn(n_images * gh * gw, dim, generator=g)
    thw = torch.tensor([[1, gh, gw]] * n_images)
    return x, thw, gh * gw // (merge * merge)


def image_inputs(
    model: Any,
    seed: int = 1,
    n_image_tokens: int | None = None,
    five_d: int = 0,
    sizes: bool = False,
) -> dict | None:
    """Keyword inputs that run ``model`` on one random image per row (see the module docstring):
    ``n_image_tokens`` image tokens per row, pixels ``[batch, five_d, C, H, W]`` where ``five_d``
    (one image, or LLaVA-NeXT's crops of it), and ``image_sizes`` where ``sizes``."""
    cfg = model.config
    params = forward_params(model)
    g = torch.Generator().manual_seed(seed)
    if "pixel_values" not in params:
        if "hidden_states" in params and "grid_thw" in params:  # Qwen-VL vision towers
            x, thw, _ = _qwen_patches(cfg, 1, g)
            return {"hidden_states": x, "grid_thw": thw}
        return None
    token = image_token(cfg) if "input_ids" in params else None
    text = "input_ids" in params
    batch = BATCH if text else 1
    out: dict[str, Any] = {}
    per_image = None
    grid_key = next((k for k in ("image_grid_thw", "grid_thw") if k in params), None)
    if grid_key:  # Qwen2-VL-style: flattened patches and their grid (the tower alone: grid_thw)
        out["pixel_values"], out[grid_key], per_image = _qwen_patches(cfg, batch, g)
    elif "spatial_shapes" in params:  # SigLIP 2 (NaFlex): patches [batch, n, C·p·p] and their grid
        n = _first(_configs(cfg), "num_patches") or 256
        side = int(n**0.5)
        p = _patch(cfg)
        out["pixel_values"] = torch.randn(batch, side * side, channels(cfg) * p * p, generator=g)
        out["pixel_attention_mask"] = torch.ones(batch, side * side, dtype=torch.long)
        out["spatial_shapes"] = torch.tensor([[side, side]] * batch)
    else:
        out["pixel_values"] = _pixels(cfg, batch, g, five_d)
    h, w = image_size(cfg)
    if "pixel_mask" in params:
        out["pixel_mask"] = torch.ones(batch, h, w, dtype=torch.long)
    if "pixel_attention_mask" in params and out["pixel_values"].dim() == 5:
        out["pixel_attention_mask"] = torch.ones(batch, 1, h, w, dtype=torch.bool)
    if "image_sizes" in params and sizes:
        out["image_sizes"] = torch.tensor([[h, w]] * batch)
    if "noise" in params:  # ViT-MAE masks the patches its noise ranks: the same noise for every run
        n = (h // _patch(cfg)) * (w // _patch(cfg))
        out["noise"] = torch.rand(batch, n, generator=g)
    if "decoder_input_ids" in params:  # vision encoder-decoders: a text for the decoder
        out["decoder_input_ids"] = _text_ids(cfg, 6, g)[:batch]
    if not text:
        return out
    n = 0
    marked = "image_embeds_position_mask" in params  # Kosmos-2: image positions by a mask, not an id
    if token is not None or marked:
        p = _patch(cfg)
        n = n_image_tokens or per_image or _guess_count(cfg, (h // p, w // p))
    before, after = 3, 5
    ids = _text_ids(cfg, before + n + after, g)
    if token is not None:
        ids[:, before : before + n] = token
        start = special_ids(cfg).get("vision_start_token_id")
        if start is not None:
            ids[:, before - 1] = start  # Qwen-VL's rotary positions look for it ahead of an image
    out["input_ids"] = ids
    mask = torch.ones_like(ids)
    mask[1, -2:] = 0  # the second row padded after the image and three words
    if "attention_mask" in params:
        out["attention_mask"] = mask
    if "mm_token_type_ids" in params and token is not None:
        out["mm_token_type_ids"] = (ids == token).int()
    if marked:  # Kosmos-2: where the image goes
        out["image_embeds_position_mask"] = torch.zeros_like(ids)
        out["image_embeds_position_mask"][:, before : before + n] = 1
    if "qformer_input_ids" in params:  # InstructBLIP: the instruction the Q-Former reads as well
        out["qformer_input_ids"] = ids[:, :8].clone()
        if "qformer_attention_mask" in params:
            out["qformer_attention_mask"] = torch.ones_like(out["qformer_input_ids"])
    return out


def fitted_inputs(model: Any, seed: int = 1) -> dict | None:
    """:func:`image_inputs`, adjusted until the model's forward (without probe) takes them: the
    image token count the model reports, 5-d pixels, ``image_sizes``; the last try's inputs if none
    runs (the check then reports that forward's own failure)."""
    params = forward_params(model)
    state: dict[str, Any] = {"n_image_tokens": None, "five_d": 0, "sizes": False}
    tried: list = []
    for _ in range(6):
        inputs = image_inputs(model, seed, **state)
        if inputs is None:
            return None
        tried.append(dict(state))
        try:
            with torch.no_grad():
                model(**inputs)
            return inputs
        except Exception as e:  # noqa: BLE001 - the model's own complaint decides the next try
            msg = f"{type(e).__name__}: {e}"
        m = _MISMATCH.search(msg)
        counts = _counts(model, int(m.group(2))) if m and "input_ids" in inputs else []
        fresh = [n for n in counts if {**state, "n_image_tokens": n} not in tried]
        if fresh:  # the features' count, or (Mistral 3 counts elements) it over the text width
            state["n_image_tokens"] = fresh[0]
        elif _CROPS.search(msg) and state["sizes"]:  # LLaVA-NeXT: the crops its image_sizes ask for
            state["five_d"] = int(_CROPS.search(msg).group(1))
        elif not state["five_d"] and _FIVE_D.search(msg):
            state["five_d"] = 1
        elif not state["sizes"] and "image_sizes" in params and ("image_sizes" in msg or "NoneType" in msg):
            state["sizes"] = True
        else:
            return inputs
        if state in tried:
            return inputs
    return inputs


def _counts(model: Any, features: int) -> list[int]:
    """Image tokens per row that a mismatch message's feature count may stand for: the count over
    the batch, and (a message that counts elements) over the batch and the text width."""
    width = getattr(_text_config(model.config), "hidden_size", None)
    out = [features // BATCH] if features % BATCH == 0 else []
    if isinstance(width, int) and features % (BATCH * width) == 0:
        out.append(features // (BATCH * width))
    return out


_CROPS = re.compile(r"split_sizes=\[(\d+)")
_FIVE_D = re.compile(r"expected 5, got 4|5-?d|five-dimensional|\(batch_size, num_images", re.I)


def describe(inputs: dict) -> str:
    """The inputs in one line: each tensor's name and shape (``pixel_values [1, 3, 224, 224]``)."""
    return ", ".join(f"{k} {list(v.shape)}" for k, v in inputs.items() if isinstance(v, torch.Tensor))


def check_family(model: Any) -> dict:
    """``catalogue_check.check_model`` on the inputs this module makes where the forward takes pixels
    (``inputs`` names their shapes); a vision-language model whose forward refuses them is checked on
    text ids instead (``inputs`` is ``text only``, ``image_failed`` the forward's complaint)."""
    import catalogue_audio as A
    import catalogue_check as C

    audio_failed = None
    if A.takes_audio(type(model)):  # audio families: a spectrogram or a waveform (catalogue_audio.py)
        inputs, failed = A.audio_inputs(model)
        if inputs is None:
            return {"status": "run failed", "reason": f"no audio input made from the config runs: {failed}"}
    elif A.takes_audio_text(type(model)):  # audio-language models: audio tokens in the text
        inputs, audio_failed = A.audio_text_inputs(model)
        if inputs is None:
            text = C.check_model(model)
            if text["status"] in ("run failed", "cannot run"):
                return {**text, "reason": f"{text['reason']}; with audio: {audio_failed}"}
            return {**text, "inputs": "text only", "image_failed": audio_failed}
    else:
        inputs = fitted_inputs(model) if takes_pixels(type(model)) else None
    try:
        res = C.check_model(model, inputs)
    except Exception as e:  # noqa: BLE001 - the failure is the verdict
        res = C.run_failure(e, model, inputs)
    if inputs is None:
        return res
    res["inputs"] = describe(inputs)
    if res["status"] in ("run failed", "cannot run") and "input_ids" in forward_params(model):
        text = C.check_model(model)
        if text["status"] not in ("run failed", "cannot run"):
            res = {**text, "inputs": "text only", "image_failed": res["reason"]}
    return res
