"""Shared test set-up: keep every cache the tests write out of the user's home directory."""

from __future__ import annotations

import os

import pytest


@pytest.fixture(scope="session", autouse=True)
def _isolated_probe_cache(tmp_path_factory):
    """Point $PROBE_CACHE_DIR (where the translator is trained on first use) at a temp dir."""
    old = os.environ.get("PROBE_CACHE_DIR")
    os.environ["PROBE_CACHE_DIR"] = str(tmp_path_factory.mktemp("probe-cache"))
    yield
    if old is None:
        os.environ.pop("PROBE_CACHE_DIR", None)
    else:
        os.environ["PROBE_CACHE_DIR"] = old
