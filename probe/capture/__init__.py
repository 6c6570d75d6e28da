"""Capture: run a model once and record the attention it computed and its residual stream.

May import torch and :mod:`probe.cache`; nothing downstream (analysis, report) imports it.
"""

from probe.capture.engine.trace import Trace, capture, trace
from probe.capture.patterns import sdpa_weights

__all__ = ["capture", "trace", "Trace", "sdpa_weights"]
