"""A processor unwrapped into the parts probe reads: its tokenizer, image processor, feature extractor.

A transformers *processor* (``LlavaProcessor``, ``WhisperProcessor``, ...) holds the tokenizer,
the image processor and the feature extractor a model was trained with; users pass it whole, or
pass one of those parts alone. Every part of probe that needs one of them asks here.
"""

from __future__ import annotations

from typing import Any

from torch import nn


def tokenizer_of(processor: Any) -> Any:
    """The tokenizer inside ``processor`` (``processor.tokenizer``), None when it holds none."""
    return getattr(processor, "tokenizer", None)


def pick_tokenizer(model: nn.Module, tokenizer: Any = None, processor: Any = None) -> Any:
    """The tokenizer to read texts with: ``tokenizer`` given, else the processor's, else the
    model's own (``model.tokenizer``: the zoo's); None when there is none."""
    for tok in (tokenizer, tokenizer_of(processor), getattr(model, "tokenizer", None)):
        if tok is not None:
            return tok
    return None


def image_processor_of(processor: Any) -> Any:
    """The image processor inside a vision-language ``processor``, or ``processor`` itself (an
    image processor given alone)."""
    return getattr(processor, "image_processor", processor)


def holds_image_processor(processor: Any) -> bool:
    """Whether ``processor`` holds an image processor (``processor.image_processor``)."""
    return bool(getattr(processor, "image_processor", None))


def feature_extractor_of(processor: Any) -> Any:
    """The feature extractor inside ``processor`` (``processor.feature_extractor``), or itself."""
    return getattr(processor, "feature_extractor", None) or processor


__all__ = [
    "feature_extractor_of",
    "holds_image_processor",
    "image_processor_of",
    "pick_tokenizer",
    "tokenizer_of",
]
