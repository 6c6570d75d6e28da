"""The safetensors cache: key names, metadata, the lazy reader and the streaming writer.

``format.py`` (the key scheme), ``cache.py`` (the lazy ``Cache`` with its mixins ``queries.py`` and
``kept.py``), ``axes.py`` and ``pictures.py`` (what a pattern's axes and stacks are),
``selection.py`` (the layers and heads kept), ``validate.py`` (a file checked before it is read),
``writer.py`` (the sinks), ``display.py`` (the notebook summary), ``viewers.py`` (BertViz and
CircuitsVis inputs) and ``perf/`` (what makes it fast, no stored value changed).

May import torch, safetensors and probe.errors / probe.files only; never imports capture or analysis.
"""

from probe.cache.cache import Cache, load
from probe.cache.format import FORMAT_VERSION, KEY_NAMES, STACKS, key

__all__ = ["Cache", "load", "key", "FORMAT_VERSION", "KEY_NAMES", "STACKS"]
