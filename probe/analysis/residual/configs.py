"""Models from configs, built on the ``meta`` device: every parameter has its shape and no memory,
so :func:`probe.budget` reads a GPT-3-sized anatomy (175 billion parameters) in a few hundred MB.
"""

from __future__ import annotations

from typing import Any

from torch import nn

from probe.errors import ProbeError


def gpt3_config():
    """A GPT-3-shaped (175B) ``transformers.GPT2Config``: 96 layers, d_model 12,288, 96 heads of
    128, d_ff 49,152, vocabulary 50,257, context 2,048, embedding and unembedding untied (the
    tutorial counts them separately)."""
    tf = _transformers()
    return tf.GPT2Config(
        n_layer=96,
        n_embd=12288,
        n_head=96,
        n_inner=49152,
        vocab_size=50257,
        n_positions=2048,
        tie_word_embeddings=False,
    )


def _transformers():
    try:
        import transformers
    except ImportError:
        raise ProbeError(
            "budgets of configs need transformers; install it with `pip install -e '.[hf]'`"
        ) from None
    return transformers


def as_model(obj: Any) -> nn.Module:
    """``obj`` as a model: a module as it is; a ``transformers`` config, a config dict (with
    ``model_type``), a ``config.json`` (or its folder) or ``"gpt3"`` built on the ``meta`` device
    (shapes only, no memory). Anything else is a :class:`ProbeError`."""
    if isinstance(obj, nn.Module):
        return obj
    import json
    import os
    from pathlib import Path

    import torch

    if isinstance(obj, str) and obj.lower() == "gpt3":
        obj = gpt3_config()
    tf = _transformers()
    if isinstance(obj, (str, os.PathLike)):
        path = Path(obj)
        if path.is_dir():
            path = path / "config.json"
        if not path.is_file():
            raise ProbeError(f"no config file at {obj}; give a config.json, a model folder or 'gpt3'")
        try:
            obj = json.loads(path.read_text())
        except ValueError:
            raise ProbeError(f"{path} is not JSON; give a Hugging Face config.json") from None
    if isinstance(obj, dict):
        d = dict(obj)
        mt = d.pop("model_type", None)
        if not mt:
            raise ProbeError("the config has no model_type; give a Hugging Face config.json")
        try:
            obj = tf.AutoConfig.for_model(mt, **d)
        except ValueError as e:
            raise ProbeError(f"cannot read the config: {str(e).splitlines()[0]}") from None
    if not isinstance(obj, tf.PretrainedConfig):
        raise ProbeError(f"budget() takes a model, a config or 'gpt3', not {type(obj).__name__}")
    archs = obj.architectures or []
    auto = tf.AutoModelForCausalLM
    if getattr(obj, "is_encoder_decoder", False):
        auto = tf.AutoModelForSeq2SeqLM
    elif archs and not any(a.endswith("ForCausalLM") or a.endswith("LMHeadModel") for a in archs):
        auto = tf.AutoModel
    with torch.device("meta"):
        try:
            return auto.from_config(obj)
        except ValueError:
            return tf.AutoModel.from_config(obj)


__all__ = ["as_model", "gpt3_config"]
