"""Inputs for the catalogue's audio families, made from each model's own (shrunk) config:
``input_features`` (a log-mel spectrogram, ``[batch, mel bins, frames]`` or ``[batch, frames, mel
bins]``) at a length the config accepts (Whisper-style encoders want exactly ``2 ·
max_source_positions`` frames), ``input_values`` waveforms long enough for the convolution
feature extractor (its kernels and strides, or a codec's down-sampling ratios, give the samples
that make 16 frames), an attention mask over the input with the second row padded at its end
where the forward takes one, and random ``decoder_input_ids`` for an encoder-decoder. Used by
``tests/catalogue_inputs.check_family`` (the sweep and ``tests/test_catalogue.py``).

``takes_audio(cls)`` says whether a forward's main input is audio; ``audio_inputs(model)`` returns
the keyword tensors that the model's forward (without probe) runs on: the candidates are tried
in turn (the config's own length first) and the first that runs is kept; None when none runs
(the last candidate's failure is then the verdict's reason, through ``audio_failure``).
"""

from __future__ import annotations

import inspect
import math
from typing import Any

import torch

# the keyword that carries the audio, in the order the forward's parameters are looked up
AUDIO_KEYS = ("input_features", "input_values", "audio_values", "audio_mel", "audio_input_features")
MASK_KEYS = (
    "attention_mask",
    "input_features_mask",
    "audio_mel_mask",
    "padding_mask",
    "audio_attention_mask",
)
_MEL = (
    "num_mel_bins",
    "feature_size",
    "input_feat_per_channel",
    "n_mel_bins",
    "input_feat_size",
    "n_mels",
    "num_chroma",  # MusicGen-Melody: a chromagram [batch, frames, 12]
    "input_dim",  # Granite Speech: stacked mel frames
)
_SUBS = ("audio_config", "encoder_config", "encoder", "audio_encoder_config", "speech_config")
BATCH, FRAMES, T_DEC = 2, 16, 6


def _params(obj: Any) -> list[str]:
    try:
        return [n for n in inspect.signature(obj.forward).parameters if n != "self"]
    except Exception:  # noqa: BLE001 - a dummy class of a missing library
        return []


def audio_key(cls: Any) -> str | None:
    """The forward's audio input (``input_features``, ``input_values``, ...), or None."""
    params = _params(cls)
    return next((k for k in AUDIO_KEYS if k in params), None)


def takes_audio(cls: Any) -> bool:
    """Whether ``cls``'s forward is run on audio: it takes an audio input and no token ids or
    pixels (an audio-language model that also reads text is run on its text)."""
    params = _params(cls)
    return audio_key(cls) is not None and "input_ids" not in params and "pixel_values" not in params


def _configs(cfg: Any, depth: int = 0) -> list[Any]:
    """``cfg``'s audio-side sub-configs (two levels deep), then ``cfg`` itself."""
    out = []
    for name in _SUBS if depth < 2 else ():
        sub = getattr(cfg, name, None)
        if sub is not None and sub is not cfg and hasattr(sub, "to_dict"):
            out += _configs(sub, depth + 1)
    return out + [cfg]


def _first(cfgs: list[Any], *names: str) -> Any:
    for c in cfgs:
        for n in names:
            v = getattr(c, n, None)
            if v is not None and not isinstance(v, bool):
                return v
    return None


def _conv_length(n: int, kernels: list[int], strides: list[int]) -> int:
    for k, s in zip(kernels, strides, strict=False):
        n = (n - k) // s + 1
    return n


def _samples(cfgs: list[Any]) -> list[int]:
    """Waveform lengths to try: those that make :data:`FRAMES` frames of the convolution feature
    extractor (its kernels and strides) or 4 of a codec's down-sampling, then fixed lengths."""
    out = []
    kernels, strides = _first(cfgs, "conv_kernel"), _first(cfgs, "conv_stride")
    if isinstance(kernels, (list, tuple)) and isinstance(strides, (list, tuple)):
        n = sum(kernels)
        while _conv_length(n, list(kernels), list(strides)) < FRAMES:
            n += math.prod(strides)
        out.append(n)
    ratios = _first(cfgs, "downsampling_ratios", "upsampling_ratios")
    if isinstance(ratios, (list, tuple)) and ratios:
        out.append(math.prod(ratios) * 4)  # a codec's frames are long (320 to 3200 samples): 4 of them
    hop = _first(cfgs, "hop_length", "samples_per_token")
    if isinstance(hop, int) and hop > 0:
        out.append(hop * FRAMES)
    return list(dict.fromkeys(out + [3200, 16000]))


def _frames(cfgs: list[Any]) -> list[int]:
    """Spectrogram lengths to try: the length a Whisper-style encoder's positions fix (``2 ·
    max_source_positions``, or an AST's ``max_length``), then 8 · :data:`FRAMES` (a conformer's
    8-fold subsampling leaves 16 positions), then 64."""
    out = []
    src = _first(cfgs, "max_source_positions")
    if isinstance(src, int) and src <= 512:
        out.append(2 * src)
    window = _first(cfgs, "n_window")  # Qwen3-ASR: whole windows of 2 · n_window frames
    if isinstance(window, int) and window <= 256:
        out.append(2 * window)
    length = _first(cfgs, "max_length", "spec_size")
    if isinstance(length, int) and length <= 1024:
        out.append(length)
    return list(dict.fromkeys(out + [8 * FRAMES, 64]))


def candidates(model: Any) -> list[dict[str, Any]]:
    """The audio layouts to try for ``model``, best guess first: each ``{"key", "shape", "time"}``
    (``time`` the index of the time axis, where a mask goes)."""
    cfgs = _configs(model.config)
    key = audio_key(type(model))
    enc = getattr(model, "encoder", None)  # a speech encoder-decoder: what its encoder reads
    if getattr(enc, "main_input_name", None) in AUDIO_KEYS and enc.main_input_name in _params(model):
        key = enc.main_input_name
    mel = _first(cfgs, *_MEL)
    mel = mel if isinstance(mel, int) and 0 < mel <= 512 else 80
    if (
        key == "input_values"
        and _first(cfgs, "max_length", "num_mel_bins")
        and not _first(cfgs, "conv_kernel")
    ):
        # a spectrogram under the name input_values (AST): [batch, frames, mel bins]
        out = [{"key": key, "shape": (BATCH, t, mel), "time": 1} for t in _frames(cfgs)]
    else:
        out = []
    if key in ("input_values", "audio_values"):
        channels = _first(cfgs, "audio_channels")
        for n in _samples(cfgs):
            out.append({"key": key, "shape": (BATCH, n), "time": 1})
            c = channels if isinstance(channels, int) else 1
            out.append({"key": key, "shape": (BATCH, c, n), "time": 2})
    else:
        # wav2vec2-BERT (two frames) and Fun-ASR (seven) stack frames: the width of their input
        stack = _first(cfgs, "num_stacked_frames")
        width = _first(cfgs, "feature_projection_input_dim") or (
            stack * mel if isinstance(stack, int) else None
        )
        for t in _frames(cfgs):
            out.append({"key": key, "shape": (BATCH, mel, t), "time": 2})
            out.append({"key": key, "shape": (BATCH, t, mel), "time": 1})
            # stacked frames ([batch, frames, k · mel bins]) and one channel ([batch, 1, frames, mel])
            for w in dict.fromkeys([width, 2 * mel, 4 * mel]):
                if isinstance(w, int):
                    out.append({"key": key, "shape": (BATCH, t, w), "time": 1})
            out.append({"key": key, "shape": (BATCH, 1, t, mel), "time": 2})
    return out


def _vocab(cfg: Any) -> int:
    for c in [cfg, *(getattr(cfg, n, None) for n in ("decoder", "text_config", "decoder_config"))]:
        v = getattr(c, "vocab_size", None) if c is not None else None
        if isinstance(v, int) and v > 0:
            return max(8, min(v, 512))
    return 256


def _make(model: Any, cand: dict[str, Any], mask: bool, seed: int) -> dict[str, Any]:
    """The keyword tensors of one candidate: the audio, a mask (``mask``), decoder ids."""
    g = torch.Generator().manual_seed(seed)
    params = _params(model)
    shape = cand["shape"]
    out: dict[str, Any] = {cand["key"]: torch.randn(*shape, generator=g)}
    if mask:
        key = next((k for k in MASK_KEYS if k in params), None)
        t = shape[cand["time"]]
        m = torch.ones(BATCH, t, dtype=torch.long)
        m[1, t - t // 4 :] = 0
        if key is not None:
            out[key] = m.bool() if "mel_mask" in key else m
    if "chunk_sample_lengths" in params:  # dots.ocr-3's audio tower: one chunk per row, whole
        hop = _first(_configs(model.config), "hop_length") or 160
        out["chunk_sample_lengths"] = torch.full((BATCH,), shape[cand["time"]] * hop)
    if "decoder_input_ids" in params:
        hi = _vocab(model.config)
        out["decoder_input_ids"] = torch.randint(4, hi, (BATCH, T_DEC), generator=g)
    return out


def _runs(model: Any, inputs: dict) -> str | None:
    """None where ``model``'s forward runs on ``inputs`` (without probe), else its failure."""
    try:
        with torch.no_grad():
            model(**inputs)
        return None
    except Exception as e:  # noqa: BLE001 - the model's own complaint: try the next candidate
        return f"{type(e).__name__}: {str(e)[:300]}"


def audio_inputs(model: Any, seed: int = 1) -> tuple[dict | None, str]:
    """``(inputs, failure)``: keyword inputs that ``model``'s forward runs on (a mask where it takes
    one and runs with it), or ``(None, the first candidate's failure)`` when none runs."""
    first = ""
    masked = any(k in _params(model) for k in MASK_KEYS)
    for cand in candidates(model):
        for mask in (True, False) if masked else (False,):
            inputs = _make(model, cand, mask, seed)
            failed = _runs(model, inputs)
            if failed is None:
                return inputs, ""
            first = first or failed
    return None, first


# audio-language models: the audio's positions in the text are marked with this id
_AUDIO_TOKEN_KEYS = ("audio_token_id", "audio_token_index", "audio_token")
_AUDIO_MASKS = ("input_features_mask", "feature_attention_mask", "audio_attention_mask", "padding_mask")


def takes_audio_text(cls: Any) -> bool:
    """Whether ``cls``'s forward reads token ids and audio, and no pixels: an audio-language
    model (Qwen2-Audio, Voxtral), a speech translator (Seamless M4T), a joint audio-text tower (CLAP)."""
    params = _params(cls)
    return audio_key(cls) is not None and "input_ids" in params and "pixel_values" not in params


def audio_token(cfg: Any) -> int | None:
    """The id that marks an audio position in the text, or None (the model places no audio in its text)."""
    import catalogue_inputs as I

    for c in (cfg, I._text_config(cfg)):
        for k in _AUDIO_TOKEN_KEYS:
            v = getattr(c, k, None)
            if isinstance(v, int) and not isinstance(v, bool):
                return v
    return None


def _text(model: Any, n: int, seed: int) -> dict[str, Any]:
    """Random ids ``[2, n + 8]`` with ``n`` audio tokens after the third (where the config has an
    audio token), the second row padded after its last three words."""
    import catalogue_inputs as I

    g = torch.Generator().manual_seed(seed + 1)
    token = audio_token(model.config)
    before, after = 3, 5
    ids = I._text_ids(model.config, before + (n if token is not None else 0) + after, g)
    if token is not None:
        ids[:, before : before + n] = token
    out: dict[str, Any] = {"input_ids": ids}
    if "attention_mask" in _params(model):
        mask = torch.ones_like(ids)
        mask[1, -2:] = 0
        out["attention_mask"] = mask
    return out


def audio_text_inputs(model: Any, seed: int = 1) -> tuple[dict | None, str]:
    """``(inputs, failure)``: one audio per row (the layouts of :func:`candidates`, a mask of ones
    where the forward takes one for the audio) and a text with as many audio tokens as the forward
    reports audio features (its "tokens do not match, tokens: n, features: m"), or, for a forward
    that reads ids or audio but not both, the audio alone (as :func:`audio_inputs` makes it);
    ``(None, the first failure)`` where no combination runs."""
    import catalogue_inputs as I

    params = _params(model)
    first = ""
    key = next((k for k in _AUDIO_MASKS if k in params), None)
    for cand in candidates(model)[:8]:
        g = torch.Generator().manual_seed(seed)
        wave = torch.randn(*cand["shape"], generator=g)
        # with a mask of ones over the audio's frames, then without (Granite Speech's mask is over
        # its projected features, not the frames)
        for masked in (True, False) if key is not None else (False,):
            audio: dict[str, Any] = {cand["key"]: wave}
            if masked:
                audio[key] = torch.ones(BATCH, cand["shape"][cand["time"]], dtype=torch.long)
            n, tried = 8, set()
            while n not in tried and len(tried) < 4:
                tried.add(n)
                inputs = {**_text(model, n, seed), **audio}
                if "decoder_input_ids" in params:
                    inputs["decoder_input_ids"] = inputs["input_ids"][:, :T_DEC].clone()
                failed = _runs(model, inputs)
                if failed is None:
                    return inputs, ""
                first = first or failed
                m = I._MISMATCH.search(failed)
                counts = I._counts(model, int(m.group(2))) if m else []
                if not counts:
                    break
                n = counts[0]
        # a forward that reads ids or audio, not both (Seamless M4T's encoder, Pop2Piano): audio alone
        alone = _make(model, cand, "attention_mask" in params, seed)
        failed = _runs(model, alone)
        if failed is None:
            return alone, ""
    return None, first
