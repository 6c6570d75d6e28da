"""Layers kept as parallel per-sublayer lists (XLM, Flaubert): grouped by index into layers.

Some models keep a layer's parts in separate ``nn.ModuleList``\\ s of one length under one parent
(``attentions``, ``layer_norm1``, ``ffns``, ``layer_norm2``) and run element ``i`` of each in
turn inside the parent's own loop. Layer ``i`` is then every list's element ``i`` and the ops the
parent runs between them: it starts when the first of them is entered and ends when an element of
another index is entered (its input is the layer's output) or the parent returns (its output is
the last layer's: a model that computes more after its loop, a final norm, would have it counted
in the last layer). Lists are grouped only when at
least one holds only norms (no weight matrix, no children) and another holds sublayers: an
encoder's and a decoder's layer lists of one length under one parent are never a group.
"""

from __future__ import annotations

from dataclasses import dataclass

from torch import nn


@dataclass(frozen=True)
class Group:
    """Parallel lists under one parent: ``name`` (the first list's path) and their ``paths``."""

    name: str
    paths: tuple[str, ...]
    length: int


def _is_norm(m: nn.Module) -> bool:
    return next(m.children(), None) is None and all(p.dim() < 2 for p in m.parameters())


def _has_parameters(module: nn.Module) -> bool:
    """``next(module.parameters(), None) is not None``, without its generators."""
    seen: set[int] = set()
    todo = [module]
    while todo:
        m = todo.pop()
        if id(m) in seen:
            continue
        seen.add(id(m))
        if any(p is not None for p in m._parameters.values()):
            return True
        todo.extend(c for c in m._modules.values() if c is not None)
    return False


def parallel_lists(model: nn.Module) -> dict[int, tuple[Group, int, int]]:
    """Each element of grouped parallel lists (by ``id``) -> ``(group, list number, index)``."""
    found: dict[int, tuple[Group, int, int]] = {}
    for name, parent in model.named_modules():
        if not any(isinstance(c, nn.ModuleList) for c in parent._modules.values()):
            continue  # most modules hold no list: skip named_children's generator
        lists = [(n, c) for n, c in parent.named_children() if isinstance(c, nn.ModuleList) and len(c)]
        by_len: dict[int, list[tuple[str, nn.ModuleList]]] = {}
        for n, c in lists:
            by_len.setdefault(len(c), []).append((n, c))
        for length, same in by_len.items():
            norms = [all(_is_norm(e) for e in c) for _, c in same]
            if len(same) < 2 or not any(norms) or all(norms):
                continue
            paths = tuple(f"{name}.{n}" if name else n for n, _ in same)
            group = Group(paths[0], paths, length)
            for k, (_, c) in enumerate(same):
                for i, e in enumerate(c):
                    found.setdefault(id(e), (group, k, i))
    return found


def list_elements(
    model: nn.Module,
) -> tuple[dict[int, tuple[str, int]], dict[str, int], dict[int, tuple[nn.Module, str, int]]]:
    """The model's lists: each element of an ``nn.ModuleList`` or one-type ``nn.Sequential``
    (by id) -> ``(the list's name, its index)``; each list's length; and each child of an element
    (by id; one with parameters that is no element of its own) -> ``(the element, its list, its
    index)``, for elements whose ``forward`` the model calls directly (SqueezeBERT's
    ``layer.forward(...)``), which no hook sees: their layer starts with a child's call."""
    container_of: dict[int, tuple[str, int]] = {}
    container_len: dict[str, int] = {}
    for n, m in model.named_modules():
        homogeneous = isinstance(m, nn.Sequential) and len({type(c) for c in m}) == 1
        if isinstance(m, nn.ModuleList) or homogeneous:
            container_len.setdefault(n, len(m))
            for i, child in enumerate(m.children()):
                container_of.setdefault(id(child), (n, i))
    element_of: dict[int, tuple[nn.Module, str, int]] = {}
    for m in model.modules():
        if id(m) in container_of and not isinstance(m, (nn.ModuleList, nn.ModuleDict)):
            for child in m.children():
                # not a list element of its own, nor a rotary table or a dropout
                if id(child) not in container_of and _has_parameters(child):
                    element_of.setdefault(id(child), (m, *container_of[id(m)]))
    return container_of, container_len, element_of
