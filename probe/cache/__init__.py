"""The safetensors cache: key names, metadata, the lazy reader and the streaming writer.

May import torch, safetensors and probe.errors / probe.files only; never imports capture or analysis.
"""

from probe.cache.cache import Cache, load
from probe.cache.format import FORMAT_VERSION, KEY_NAMES, STACKS, key

__all__ = ["Cache", "load", "key", "FORMAT_VERSION", "KEY_NAMES", "STACKS"]
