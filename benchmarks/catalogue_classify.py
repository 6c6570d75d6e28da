"""Verdicts for the model types the sweep cannot build on their own, said for what they are rather
than counted as build failures: sub-configs that transformers builds only inside a parent model
(``blt_local_encoder`` inside ``blt``), families whose modeling code needs an optional library that
is not installed (``timm``), and configs that no auto mapping pairs with a model class."""

from __future__ import annotations

import re
from functools import cache
from typing import Any

_NEEDS = re.compile(r"requires the (\w[\w.-]*) librar")
# forwards that fail for want of an input other than token ids, in the words of their messages
_OTHER_INPUT = re.compile(
    r"specify bbox|bbox is required|`visual_feats` cannot be `none`|`context_input_ids` are passed"
    r"|`input_ids` is expected to be `none`"
)


@cache
def _sub_config_parents() -> dict[type, tuple[str, ...]]:
    """Config class -> the model types whose ``sub_configs`` name it."""
    import transformers as tf

    out: dict[type, list[str]] = {}
    for mt in tf.CONFIG_MAPPING.keys():
        try:
            cls = tf.CONFIG_MAPPING[mt]
        except Exception:  # noqa: BLE001, S112 - a config that cannot even be imported names no sub-config
            continue
        for sub in (getattr(cls, "sub_configs", None) or {}).values():
            if isinstance(sub, type) and mt not in out.setdefault(sub, []):
                out[sub].append(mt)
    return {k: tuple(v) for k, v in out.items()}


def _attribute_parents(cls: type) -> tuple[str, ...]:
    """Model types of ``cls``'s own transformers module whose default config holds a ``cls`` as an
    attribute (sub-configs that ``sub_configs`` does not list, e.g. a talker's ``text_config``)."""
    import transformers as tf

    out = []
    for mt in tf.CONFIG_MAPPING.keys():
        try:
            other = tf.CONFIG_MAPPING[mt]
        except Exception:  # noqa: BLE001, S112
            continue
        if other is cls or other.__module__ != cls.__module__:
            continue
        try:
            inst = other()
        except Exception:  # noqa: BLE001, S112 - a parent that does not build with defaults says nothing
            continue
        if any(isinstance(v, cls) for v in vars(inst).values()):
            out.append(mt)
    return tuple(out)


def parents(config_cls: type) -> tuple[str, ...]:
    """The model types that build ``config_cls`` as a part of theirs (empty if none is found)."""
    return _sub_config_parents().get(config_cls) or _attribute_parents(config_cls)


def unbuildable(model_type: str) -> dict[str, str]:
    """The verdict for a model type with no model class of its own: ``sub-config`` naming the parent
    where transformers' config classes name one, else ``no model class``."""
    import transformers as tf

    cls = tf.CONFIG_MAPPING[model_type]
    up = parents(cls)
    if up:
        names = ", ".join(f"`{p}`" for p in up)
        why = f"{cls.__name__} is built inside {names} (no model class of its own)"
        return {"status": "sub-config", "reason": why}
    return {
        "status": "no model class",
        "reason": f"no auto mapping of transformers pairs {cls.__name__} with a model class that can be "
        "imported, and no other config holds it",
    }


def missing_library(e: BaseException) -> dict[str, str] | None:
    """``needs a library`` when ``e`` is transformers' error for an optional library that is not
    installed (``... requires the timm library but it was not found``); None otherwise."""
    m = _NEEDS.search(str(e)) if isinstance(e, ImportError) else None
    if m is None:
        return None
    first = " ".join(str(e).split())[:160]
    return {"status": "needs a library", "reason": f"needs `{m.group(1)}`, not installed: {first}"}


def classify_build_error(model_type: str, e: BaseException, cls: Any) -> dict[str, str]:
    """The verdict for an exception raised while building ``model_type`` (model class ``cls``)."""
    if cls is None and type(e) is LookupError and "model class" in str(e):  # catalogue_configs.build
        return unbuildable(model_type)
    return missing_library(e) or {"status": "build failed", "reason": f"{type(e).__name__}: {str(e)[:300]}"}


def other_input(verdict: dict) -> dict:
    """``cannot run`` for a ``run failed`` verdict whose message asks for an input other than
    token ids (layout boxes, visual features, retrieved contexts, embeddings); else the verdict."""
    if verdict.get("status") == "run failed" and _OTHER_INPUT.search(verdict.get("reason", "").lower()):
        why = "needs other inputs: " + verdict["reason"]
        return {**verdict, "status": "cannot run", "reason": why}
    return verdict
