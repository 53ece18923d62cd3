"""torch.compile's on-disk caches are keyed on the package's sources (transformer_linear/_compile_cache.py)."""

import shutil
from pathlib import Path

import pytest
import torch

import transformer_linear as tl
from transformer_linear._compile_cache import source_digest, tag_compile_caches


@pytest.fixture
def restored_tag():
    tag = torch.compiler.config.cache_key_tag
    yield
    torch.compiler.config.cache_key_tag = tag


def test_import_tags_the_caches_with_the_package_digest():
    package = Path(tl.__file__).parent
    marks = torch.compiler.config.cache_key_tag.split(";")
    assert marks.count(f"transformer_linear-{source_digest(package)}") == 1


def test_tagging_keeps_the_users_tag_and_does_not_repeat(restored_tag):
    torch.compiler.config.cache_key_tag = "my-run"
    tag = tag_compile_caches()
    assert tag.startswith("my-run;transformer_linear-") and tag_compile_caches() == tag
    assert torch.compiler.config.cache_key_tag == tag


def test_a_changed_source_changes_the_tag(tmp_path, restored_tag):
    """Another version of the package (here: one file changed) keys its compiled graphs differently."""
    package = Path(tl.__file__).parent
    copy = tmp_path / "transformer_linear"
    shutil.copytree(package, copy, ignore=shutil.ignore_patterns("*.so", "__pycache__"))
    assert source_digest(copy) == source_digest(package)
    linear_ops = copy / "modules" / "linear_ops.py"
    linear_ops.write_text(linear_ops.read_text() + "\n# a changed backward\n")
    assert source_digest(copy) != source_digest(package)
    torch.compiler.config.cache_key_tag = ""
    assert tag_compile_caches(copy) == f"transformer_linear-{source_digest(copy)}"
