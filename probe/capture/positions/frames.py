"""What time each position of an audio model's encoder stands for, in seconds.

An audio encoder runs over frames: Whisper's log-mel features (one frame per ``hop_length``
samples of the feature extractor) shortened by its second convolution's stride 2; wav2vec2,
HuBERT and WavLM cut the raw samples with a stack of strided convolutions (5, 2, 2, 2, 2, 2, 2:
320 samples). The spans are read off the module the same way for any model: the chain of
``Conv1d`` layers the audio input goes through first (the first taking the input's channels,
then each taking the previous one's outputs, in the order the model holds them; a grouped
convolution, a positional one, ends it), the longest start of that chain whose output length
(the convolution arithmetic on the input's length) is the stack's self-attention length. The
product of its strides is the input frames per position, times the feature hop over the
sampling rate the seconds per position (``hop``): position ``i`` spans ``offset + i * hop`` to
``offset + (i + 1) * hop`` with ``offset`` 0 (the convention of openai-whisper's timestamps, 50
positions per second from 0 s; a wav2vec2 position starts where its receptive field does). The
receptive field (``receptive_field``: first input frame of position 0 and width, in input
frames) is recorded beside it. A length no start of the chain gives gets no frames: a
``positions_note`` says so, rather than guess.
"""

from __future__ import annotations

from typing import Any

from torch import nn

from probe.capture.calls import LayerRecord


def conv_chain(model: nn.Module, channels: int) -> list[tuple[str, nn.Conv1d]]:
    """The ``Conv1d`` front end taking ``channels`` input channels (see the module docstring)."""
    chain: list[tuple[str, nn.Conv1d]] = []
    for name, m in model.named_modules():
        if not isinstance(m, nn.Conv1d):
            continue
        want = chain[-1][1].out_channels if chain else channels
        if m.in_channels != want or m.groups != 1:
            if chain:
                break
            continue
        chain.append((name, m))
    return chain


def _pad(conv: nn.Conv1d) -> int | None:
    p = conv.padding
    if isinstance(p, str):  # "same" keeps the length at stride 1 only; "valid" is no padding
        return None if p == "same" else 0
    return int(p[0])


def out_length(length: int, conv: nn.Conv1d) -> int:
    """The output length of ``conv`` on ``length`` input frames (torch's arithmetic)."""
    pad = _pad(conv)
    if pad is None:
        return length
    k, s, d = conv.kernel_size[0], conv.stride[0], conv.dilation[0]
    return (length + 2 * pad - d * (k - 1) - 1) // s + 1


def lengths(length: int, chain: list[tuple[str, nn.Conv1d]]) -> list[int]:
    """The length after each convolution of ``chain``, starting from ``length``."""
    out = [length]
    for _name, conv in chain:
        out.append(out_length(out[-1], conv))
    return out


def receptive(chain: list[tuple[str, nn.Conv1d]]) -> tuple[int, int, int]:
    """``(stride, first, width)`` of ``chain`` in input frames: position ``i`` reads input frames
    ``first + i * stride`` to ``first + i * stride + width`` (padding makes ``first`` negative)."""
    stride, first, width = 1, 0, 1
    for _name, conv in chain:
        first -= (_pad(conv) or 0) * stride
        width += (conv.kernel_size[0] - 1) * conv.dilation[0] * stride
        stride *= conv.stride[0]
    return stride, first, width


def decimals(hop: float) -> int:
    """Decimals that tell positions ``hop`` seconds apart: at least 2, at most 5."""
    for d in range(2, 6):
        if abs(round(hop, d) - hop) < 1e-9:
            return d
    return 5


def frame_labels(frames: dict[str, Any]) -> list[str]:
    """Each position's label: its start, ``0.46 s``, or ``frame i`` where the rate is unknown."""
    n, hop = frames["count"], frames.get("hop")
    if hop is None:
        return [f"frame {i}" for i in range(n)]
    d = decimals(hop)
    return [f"{frames['offset'] + i * hop:.{d}f} s" for i in range(n)]


def span(frames: dict[str, Any], i: int) -> tuple[float, float]:
    """``(start, end)`` in seconds of position ``i`` of a stack's ``frames``."""
    start = frames["offset"] + i * frames["hop"]
    return start, start + frames["hop"]


def _audio_positions(meta: dict[str, Any], chain, count: int, batch: int) -> list[int]:
    """Per input, how many positions hold its audio (the rest is the padding of a batch, or of
    Whisper's 30 s window): its samples (or its mask's) through the feature hop and the chain."""
    samples = meta.get("audio_samples")
    hop = meta.get("feature_hop")
    if samples is None or hop is None:
        return [count] * batch
    return [max(1, min(count, lengths(max(1, n // hop), chain)[-1])) for n in samples]


def frames_for(
    model: nn.Module, meta: dict[str, Any], length: int
) -> tuple[dict[str, Any], list[str]] | None:
    """``(frames, chain module paths)`` for a stack of ``length`` positions over the audio input
    described by ``meta`` (``audio_shape``, ``audio_key``, ``feature_hop``, ``sampling_rate``),
    None when no start of the model's convolution chain gives that length."""
    shape = meta["audio_shape"]
    if meta.get("audio_key") == "input_values" or len(shape) == 2:
        axes = [(1, shape[-1])]
    else:  # [batch, features, time] (Whisper) or [batch, time, features] (Speech2Text)
        axes = [(shape[1], shape[2]), (shape[2], shape[1])]
    for channels, T in axes:
        chain = conv_chain(model, channels)
        lens = lengths(T, chain)
        fits = [k for k in range(1, len(lens)) if lens[k] == length]
        if not fits:
            continue
        chain = chain[: fits[-1]]
        stride, first, width = receptive(chain)
        rate, fhop = meta.get("sampling_rate"), meta.get("feature_hop")
        seconds = fhop / rate if rate and fhop else None
        frames = {
            "hop": stride * seconds if seconds else None,
            "offset": 0.0,
            "count": length,
            "stride": stride,
            "receptive_field": [first, width],
            "feature_hop": fhop,
            "sampling_rate": rate,
            "audio": _audio_positions(meta, chain, length, shape[0]),
        }
        return frames, [name for name, _ in chain]
    return None


def frame_positions(
    meta: dict[str, Any], model: nn.Module, records: list[LayerRecord], stack_of: dict[str, str]
) -> dict[str, dict[str, Any]]:
    """Per stack whose self-attention runs over the audio's frames, ``{"kinds": ["frame", ...],
    "frames": {...}}`` (see the module docstring); the first such stack's labels (``0.46 s``)
    become the cache's tokens when the input had none. Where no stack fits, ``positions_note``."""
    found: dict[str, dict[str, Any]] = {}
    seen: set[int] = set()
    for r in records:
        s = stack_of[r.container]
        for role, _h, shape, _impl, _causal in r.patterns:
            if role != "self" or s in found or shape[2] != shape[3]:
                continue
            seen.add(shape[3])
            got = frames_for(model, meta, shape[3])
            if got is not None:
                frames, convs = got
                found[s] = {"kinds": ["frame"] * shape[3], "frames": {**frames, "convolutions": convs}}
    batch = meta["audio_shape"][0]
    if found:
        frames = next(iter(found.values()))["frames"]
        if "tokens" not in meta:
            meta["tokens"] = [frame_labels(frames) for _ in range(batch)]
    else:
        lens = ", ".join(map(str, sorted(seen))) or "none"
        meta["positions_note"] = (
            f"probe could not tell which time each position stands for: no self-attention length "
            f"({lens}) is the output of the model's convolution front end on the "
            f"{meta['audio_shape'][-1]} input frames"
        )
    return found


__all__ = [
    "conv_chain",
    "decimals",
    "frame_labels",
    "frame_positions",
    "frames_for",
    "lengths",
    "out_length",
    "receptive",
    "span",
]
