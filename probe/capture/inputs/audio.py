"""Sound as inputs: waveforms (1-D numpy arrays or tensors with ``sampling_rate=``) and sound files,
turned into the model's keyword tensors by the user's processor (a transformers feature extractor,
or a processor holding one: ``processor.feature_extractor``), the way users already call it.

Files are read with ``soundfile`` (libsndfile: WAV, FLAC, OGG, MP3, ...) and mixed down to one
channel; a waveform at another rate than the processor's is resampled with
``scipy.signal.resample_poly`` (a polyphase filter at the exact rational ratio). Both are the
optional extra ``probe[audio]``. Without a processor, raw waveforms go to a model that takes them
as they are (``input_values``: wav2vec2, HuBERT, WavLM), unnormalised. Every failure is one line:
an unreadable or empty file, a missing rate, rates that differ with nothing to resample to, a
processor that fails on the sound or is not the model's.

The sound modality's entry (:func:`probe.capture.inputs.sound.prepare_audio`) builds the forward
from these pieces. The metadata records what each position's time span is computed from
(:mod:`probe.capture.positions.frames` reads it after the forward): ``audio_key``
(``input_features`` or ``input_values``), ``audio_shape``, ``sampling_rate``, ``feature_hop``
(input samples per feature frame; 1 for raw samples) and, for waveforms, ``audio`` (names) and
``audio_samples`` (each one's length).
"""

from __future__ import annotations

import inspect
import math
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import Tensor, nn

from probe.capture.inputs.prepared import accepts, model_name
from probe.capture.inputs.processors import feature_extractor_of, holds_image_processor
from probe.capture.inputs.spectrogram import spectrograms
from probe.errors import ProbeError

SUFFIXES = {".wav", ".flac", ".ogg", ".oga", ".opus", ".mp3", ".aiff", ".aif", ".au", ".w64", ".caf"}
AUDIO_KEYS = ("input_features", "input_values")
INSTALL = "pip install 'probe[audio]' (soundfile, scipy)"


def _is_wave(x: Any, files: bool, tensors: bool) -> bool:
    if isinstance(x, (str, Path)):
        return files and Path(x).suffix.lower() in SUFFIXES
    if isinstance(x, np.ndarray):
        return x.ndim == 1 and x.dtype.kind == "f"
    return tensors and isinstance(x, Tensor) and x.dim() == 1 and x.is_floating_point()


def is_audio(inputs: Any, files: bool = True, tensors: bool = True) -> bool:
    """Whether ``inputs`` is sound: a 1-D float numpy array or tensor (unless ``tensors=False``: a
    float tensor may as well be a model's float input), a sound file path (unless ``files=False``:
    a string may as well be a text), or a non-empty list of them."""
    items = inputs if isinstance(inputs, (list, tuple)) else [inputs]
    return bool(items) and all(_is_wave(x, files, tensors) for x in items)


def routes_here(inputs: Any, processor: Any, sampling_rate: Any) -> bool:
    """Whether :func:`probe.capture` takes ``inputs`` as sound: an audio model's keyword dict, a
    1-D float numpy array, anything with ``sampling_rate=``, sound files or tensors with
    ``processor=``."""
    if sampling_rate is not None or audio_dict(inputs) or is_audio(inputs, files=False, tensors=False):
        return True
    return processor is not None and is_audio(inputs)


def is_sound_processor(processor: Any) -> bool:
    """Whether ``processor`` reads sound only: a feature extractor (or a processor holding one)
    with a ``sampling_rate`` and no image processor."""
    fe = feature_extractor_of(processor)
    rate = getattr(fe, "sampling_rate", None)
    pictures = holds_image_processor(processor) or getattr(fe, "image_mean", None) is not None
    return isinstance(rate, int) and not isinstance(rate, bool) and not pictures


def not_sound(inputs: Any) -> str:
    """What in ``inputs`` is not sound (:func:`is_audio`), said for a one-line error."""
    if isinstance(inputs, (list, tuple)) and not inputs:
        return f"an empty {type(inputs).__name__}: give at least one waveform or sound file"
    items = inputs if isinstance(inputs, (list, tuple)) else [inputs]
    i, x = next(((i, x) for i, x in enumerate(items) if not _is_wave(x, True, True)), (0, items[0]))
    where = f"item {i} of the {type(inputs).__name__} is " if isinstance(inputs, (list, tuple)) else "got "
    if isinstance(x, (str, Path)):
        return f"{where}{str(x)!r}, not a sound file ({', '.join(sorted(SUFFIXES))})"
    if isinstance(x, (np.ndarray, Tensor)):
        kind = str(x.dtype).replace("torch.", "")
        if x.ndim == 1:  # integer samples: 16-bit PCM as scipy.io.wavfile reads it
            return (
                f"{where}a 1-D {kind} array: give the samples as floats in [-1, 1] (x / 32768 for 16-bit PCM)"
            )
        return (
            f"{where}a {kind} array of shape {list(x.shape)}: give each waveform as a 1-D array of "
            "samples (x.mean(0) mixes [channels, samples] into one), or a list of them"
        )
    return f"{where}of type {type(x).__name__}"


def audio_dict(inputs: Any) -> bool:
    """Whether ``inputs`` is a dict of an audio model's keyword tensors (``input_features`` or
    ``input_values`` among its keys)."""
    return isinstance(inputs, Mapping) and any(k in inputs for k in AUDIO_KEYS)


def _why(e: BaseException) -> str:
    msg = str(e).strip()
    return msg.splitlines()[0] if msg else type(e).__name__


def read_sound(path: str | Path, i: int = 0) -> tuple[np.ndarray, int]:
    """``(samples, rate)`` of a sound file: float32, channels averaged into one."""
    path = Path(path)
    if path.is_dir():
        raise ProbeError(f"audio {i}: {str(path)!r} is a directory; give a sound file inside it")
    if not path.is_file():
        raise ProbeError(f"audio {i}: no such file {str(path)!r}")
    try:
        import soundfile
    except ImportError:
        raise ProbeError(f"reading sound files needs soundfile: {INSTALL}") from None
    try:
        data, rate = soundfile.read(str(path), dtype="float32", always_2d=True)
    except Exception as e:  # libsndfile's errors come as several types; the message says what
        raise ProbeError(f"audio {i}: cannot read {str(path)!r} as sound ({_why(e)})") from None
    if data.shape[0] == 0:
        raise ProbeError(f"audio {i}: {str(path)!r} holds no samples")
    return data.mean(axis=1).astype(np.float32), int(rate)


def resample(x: np.ndarray, rate: int, to: int) -> np.ndarray:
    """``x`` at ``rate`` Hz resampled to ``to`` Hz (``scipy.signal.resample_poly`` at the exact
    ratio ``to / rate``, reduced by their greatest common divisor)."""
    if rate == to:
        return x
    try:
        from scipy.signal import resample_poly
    except ImportError:
        raise ProbeError(f"resampling {rate} Hz to {to} Hz needs scipy: {INSTALL}") from None
    g = math.gcd(rate, to)
    return resample_poly(x, to // g, rate // g).astype(np.float32)


def parse_rate(sampling_rate: Any) -> int | None:
    """``sampling_rate=`` as an integer number of Hz (None when not given); a one-line error
    for anything that is not a positive whole number."""
    if sampling_rate is None:
        return None
    if (
        isinstance(sampling_rate, bool)
        or not isinstance(sampling_rate, (int, float, np.integer, np.floating))
        or not float(sampling_rate).is_integer()
        or sampling_rate <= 0
    ):
        raise ProbeError(f"sampling_rate={sampling_rate!r}: give the rate in Hz as a positive integer")
    return int(sampling_rate)


def load_sounds(inputs: Any, sampling_rate: Any = None) -> tuple[list[np.ndarray], list[int], list[str]]:
    """``(waves, rates, names)`` of ``inputs`` (see :func:`is_audio`): files read at their own
    rate, arrays at ``sampling_rate`` (required for them), each checked to hold samples."""
    rate = parse_rate(sampling_rate)
    items = list(inputs) if isinstance(inputs, (list, tuple)) else [inputs]
    waves, rates, names = [], [], []
    for i, x in enumerate(items):
        if isinstance(x, (str, Path)):
            w, r = read_sound(x, i)
            names.append(Path(x).name)
        else:
            if rate is None:
                raise ProbeError(
                    f"audio {i} is an array: give sampling_rate= (its rate in Hz), or a sound file"
                )
            w = x.detach().float().cpu().numpy() if isinstance(x, Tensor) else np.asarray(x, np.float32)
            r = rate
            names.append(f"audio {i}")
        if w.size == 0:
            raise ProbeError(f"audio {i}: an empty waveform; give at least one sample")
        if not np.isfinite(w).all():
            raise ProbeError(f"audio {i}: the waveform holds NaN or infinite samples")
        waves.append(w.astype(np.float32))
        rates.append(r)
    return waves, rates, names


def processor_rate(processor: Any) -> int:
    """The sampling rate ``processor`` expects (its feature extractor's ``sampling_rate``)."""
    rate = getattr(feature_extractor_of(processor), "sampling_rate", None)
    if not isinstance(rate, int) or rate <= 0:
        raise ProbeError(
            f"processor= ({type(processor).__name__}) has no sampling_rate: give the model's audio "
            "feature extractor (or its processor)"
        )
    return rate


def feature_hop(processor: Any, key: str) -> int | None:
    """Input samples per frame of ``key``: 1 for raw ``input_values``; the feature extractor's
    ``hop_length`` for ``input_features`` (None when it does not say)."""
    if key == "input_values":
        return 1
    hop = getattr(feature_extractor_of(processor), "hop_length", None) if processor is not None else None
    return hop if isinstance(hop, int) and hop > 0 else None


def extract(processor: Any, waves: list[np.ndarray], rate: int) -> dict[str, Any]:
    """``feature_extractor(waves, sampling_rate=rate, return_tensors="pt")`` (several waveforms
    padded to the longest where the extractor does not pad itself), its failure in one line."""
    fe = feature_extractor_of(processor)
    if not callable(fe):
        raise ProbeError(f"processor= should be a transformers feature extractor, not {type(fe).__name__}")
    kwargs: dict[str, Any] = {"sampling_rate": rate, "return_tensors": "pt"}
    try:
        pad = inspect.signature(fe.__call__).parameters.get("padding")
    except (TypeError, ValueError):
        pad = None
    if len(waves) > 1 and pad is not None and pad.default in (False, None):
        kwargs["padding"] = "longest"
    try:
        out = fe(waves if len(waves) > 1 else waves[0], **kwargs)
    except Exception as e:  # the extractor is the user's library: say what failed and the way out
        raise ProbeError(
            f"the processor {type(fe).__name__} failed on the audio ({_why(e)}); give the processor "
            "that belongs to the model"
        ) from None
    if not isinstance(out, Mapping) or not any(k in out for k in AUDIO_KEYS):
        raise ProbeError(f"the processor {type(fe).__name__} returned no input_features or input_values")
    return dict(out)


def _check_not_cut(processor: Any, kwargs: Mapping, waves: list[np.ndarray], rate: int) -> None:
    """Refuse sound longer than the features hold: Whisper's extractor cuts every waveform at its
    window (30 s), and the rest would go unheard while the cache said it was there."""
    x, hop = kwargs.get("input_features"), feature_hop(processor, "input_features")
    if not isinstance(x, Tensor) or x.dim() != 3 or hop is None:
        return
    frames = max(x.shape[1], x.shape[2])  # the time axis is the longer one once sound is cut
    for i, w in enumerate(waves):
        if len(w) // hop > frames + 1:
            held = frames * hop / rate
            raise ProbeError(
                f"audio {i} is {len(w) / rate:.2f} s but {type(feature_extractor_of(processor)).__name__} "
                f"keeps {held:.2f} s of it (its window); give at most {held:.2f} s per input (split "
                "longer audio)"
            )


def sound_inputs(
    model: nn.Module, inputs: Any, processor: Any, sampling_rate: Any
) -> tuple[dict[str, Any], dict[str, Any]]:
    """``(keyword tensors, metadata)`` for sound ``inputs``: through ``processor`` at its rate
    (resampled where needed), or raw as ``input_values`` for a model that takes them."""
    name = model_name(model)
    waves, rates, names = load_sounds(inputs, sampling_rate)
    if processor is not None:
        rate = processor_rate(processor)
        waves = [resample(w, r, rate) for w, r in zip(waves, rates, strict=True)]
        kwargs = extract(processor, waves, rate)
        made = next(k for k in AUDIO_KEYS if k in kwargs)
        if not accepts(model, made):
            raise ProbeError(
                f"the processor {type(feature_extractor_of(processor)).__name__} makes {made}, which "
                f"{name}'s forward does not take; give the processor that belongs to the model"
            )
        _check_not_cut(processor, kwargs, waves, rate)
    else:
        if not accepts(model, "input_values"):
            raise ProbeError(
                f"{name} takes no raw waveform (input_values): give processor= (its feature "
                "extractor) to turn the audio into its input features"
            )
        rate = rates[0]
        if any(r != rate for r in rates):
            raise ProbeError(
                f"the audio comes at {', '.join(f'{r} Hz' for r in rates)}: without processor= "
                "probe does not resample; give processor= (the model's feature extractor) or one rate"
            )
        if sampling_rate is not None and rate != parse_rate(sampling_rate):
            raise ProbeError(
                f"the file is at {rate} Hz but sampling_rate={sampling_rate}: without processor= probe "
                "does not resample; give processor= (the model's feature extractor)"
            )
        T = max(len(w) for w in waves)
        x = torch.zeros(len(waves), T)
        mask = torch.zeros(len(waves), T, dtype=torch.long)
        for i, w in enumerate(waves):
            x[i, : len(w)] = torch.from_numpy(w)
            mask[i, : len(w)] = 1
        kwargs = {"input_values": x}
        if len(waves) > 1 and accepts(model, "attention_mask"):
            kwargs["attention_mask"] = mask
    meta = {"audio": names, "audio_samples": [len(w) for w in waves], "sampling_rate": rate}
    if processor is None:
        meta["audio_note"] = "raw waveforms given as input_values, unnormalised (no processor)"
    return kwargs, meta


def audio_metadata(
    kwargs: Mapping, processor: Any = None, sampling_rate: Any = None, model: nn.Module | None = None
) -> dict[str, Any]:
    """What the cache records of an audio model's keyword inputs (see the module docstring)."""
    key = next((k for k in AUDIO_KEYS if isinstance(kwargs.get(k), Tensor)), None)
    if key is None:
        return {}
    meta: dict[str, Any] = {"audio_key": key, "audio_shape": list(kwargs[key].shape)}
    rate = processor_rate(processor) if processor is not None else parse_rate(sampling_rate)
    hop = feature_hop(processor, key)
    if rate is not None:
        meta["sampling_rate"] = rate
    if hop is not None:
        meta["feature_hop"] = hop
    meta.update(spectrograms(kwargs, _mel_counts(model) if model is not None else set(), rate, hop))
    return meta


MEL_KEYS = ("num_mel_bins", "input_feat_per_channel", "n_mels")


def _mel_counts(model: nn.Module) -> set[int]:
    """The feature channel counts the model's config (or one of its sub-configs: an audio-language
    model's audio encoder) declares: Whisper's ``num_mel_bins``, Speech2Text's
    ``input_feat_per_channel``; empty when it declares none."""
    cfg = getattr(model, "config", None)
    found: set[int] = set()
    seen: set[int] = set()
    todo = [cfg]
    while todo:
        c = todo.pop()
        if c is None or id(c) in seen:
            continue
        seen.add(id(c))
        for k in MEL_KEYS:
            v = getattr(c, k, None)
            if isinstance(v, int) and v > 0:
                found.add(v)
        for k in dir(c) if hasattr(c, "to_dict") else ():
            if k.endswith("_config") and not k.startswith("_"):
                sub = getattr(c, k, None)
                if hasattr(sub, "to_dict"):
                    todo.append(sub)
    return found


def check_channels(model: nn.Module, kwargs: Mapping) -> None:
    """Features whose channel count the model's config does not declare (80 mel bins for a model
    of 128): refused in one line, before the forward fails inside a convolution. Only the config
    decides: a model's first ``Conv1d`` may be a conformer block's depthwise convolution, not a
    front end fed the features (Parakeet), so the modules are not read for it."""
    x = kwargs.get("input_features")
    if not isinstance(x, Tensor) or x.dim() != 3:
        return
    want = _mel_counts(model)
    # a multiple passes: several frames stacked into one feature vector (FunASR's 7 x 80)
    if want and not any(d % v == 0 for d in x.shape[1:] for v in want):
        n = " or ".join(str(v) for v in sorted(want))
        raise ProbeError(
            f"the input features have {x.shape[1]} channels but {model_name(model)} takes {n} "
            "(its config's mel bins); give the processor that belongs to the model"
        )


__all__ = [
    "AUDIO_KEYS",
    "audio_dict",
    "audio_metadata",
    "check_channels",
    "extract",
    "is_audio",
    "is_sound_processor",
    "load_sounds",
    "parse_rate",
    "not_sound",
    "processor_rate",
    "read_sound",
    "resample",
    "routes_here",
    "sound_inputs",
]
