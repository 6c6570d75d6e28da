"""Interventions on any model probe can capture: head and sublayer ablation, activation patching.

Also what the model's own weights and values say per head: importance (``importance.py``),
attention knockout (``knockout.py``), the anatomy (``anatomy*.py``: which module plays which
role), head writes and composition (``writes.py``, ``composition.py``), contributions and token
mixing (``values.py``, ``contrib.py``, ``mixing.py``, ``alti.py``, ``zeroing.py``) and circuits
(``circuit/``).

The edits go where probe finds them (:mod:`probe.intervene.locate`): a head's slice of its
attention's output-projection input, a sublayer's output on the residual stream. The model runs
its own code on its own attention path; nothing is forced onto eager attention.
"""

from probe.intervene.ablate import Ablation
from probe.intervene.alti import alti
from probe.intervene.composition import Composition, composition
from probe.intervene.context import Intervention, ablate, intervene, knockout
from probe.intervene.contrib import contributions
from probe.intervene.importance import HeadImportance, head_importance
from probe.intervene.knockout import Knockout
from probe.intervene.mixing import TokenMixing
from probe.intervene.patch import Patching, patch
from probe.intervene.writes import HeadWrites, head_writes
from probe.intervene.zeroing import value_zeroing

__all__ = [
    "intervene",
    "Intervention",
    "ablate",
    "Ablation",
    "patch",
    "Patching",
    "head_importance",
    "HeadImportance",
    "knockout",
    "Knockout",
    "head_writes",
    "HeadWrites",
    "composition",
    "Composition",
    "contributions",
    "alti",
    "value_zeroing",
    "TokenMixing",
]
