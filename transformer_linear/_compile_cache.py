"""torch.compile's on-disk caches, keyed on this package's code as well.

AOT autograd's and Inductor's caches key a compiled graph on the Dynamo
graph, where a ``tl.Linear`` is one ``linear_fwd`` call. Its backward graph
comes from this package's autograd formula (linear_ops.py), which the key
does not see: after an upgrade that changes the backward (an op gaining an
argument, say), a cached backward graph would call the ops the old way and
fail ("missing value for argument ..."). So the package adds a digest of its
Python sources to ``torch.compiler.config.cache_key_tag`` when imported,
after whatever tag is set already: graphs compiled with one version of the
package are never reused by another.
"""

from __future__ import annotations

import hashlib
import importlib
from pathlib import Path

__all__ = ["source_digest", "tag_compile_caches"]

_PACKAGE = Path(__file__).resolve().parent


def source_digest(root: Path) -> str:
    """A short digest of the names and contents of the ``*.py`` files under ``root``."""
    h = hashlib.sha256()
    for path in sorted(root.rglob("*.py")):
        h.update(path.relative_to(root).as_posix().encode())
        h.update(path.read_bytes())
    return h.hexdigest()[:16]


def tag_compile_caches(root: Path = _PACKAGE) -> str:
    """Add the digest of the sources under ``root`` (the package) to torch.compile's cache key tag,
    once; returns the tag ("" on a torch without the setting, whose caches do not take a tag)."""
    try:
        config = importlib.import_module("torch.compiler.config")
    except ImportError:
        return ""
    if not hasattr(config, "cache_key_tag"):
        return ""
    mark = f"transformer_linear-{source_digest(root)}"
    tag = config.cache_key_tag
    if mark not in tag.split(";"):
        tag = f"{tag};{mark}" if tag else mark
        config.cache_key_tag = tag
    return tag
