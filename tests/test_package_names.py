"""The project's top-level packages must not shadow another installed distribution's modules.

transformers >= 5.25 depends on Hugging Face's `kernels` distribution and imports it; while our
kernel library was the top-level package `kernels`, the editable install shadowed it and every
import of transformers' image processors failed (`cannot import name 'CUDAProperties' from
'kernels'`)."""

from __future__ import annotations

import importlib.metadata
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def _top_level_packages() -> list[str]:
    """The `include` patterns of [tool.setuptools.packages.find] in pyproject.toml, without `*`."""
    text = (ROOT / "pyproject.toml").read_text()
    found = re.search(r"\[tool\.setuptools\.packages\.find\]\s*include = \[([^\]]*)\]", text)
    assert found, "pyproject.toml lists no packages"
    return [name.strip().strip('"').rstrip("*") for name in found.group(1).split(",")]


def test_no_installed_distribution_provides_our_top_level_names() -> None:
    names = _top_level_packages()
    assert "appliance_kernels" in names
    owners = importlib.metadata.packages_distributions()
    for name in names:
        others = set(owners.get(name, [])) - {"appliance"}
        assert not others, f"top-level package {name!r} is also provided by {sorted(others)}"


def test_transformers_image_processing_imports() -> None:
    """The import that broke: transformers' hub-kernels integration imports `kernels`."""
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import (  # noqa: F401
        Qwen2VLImageProcessorPil,
    )
