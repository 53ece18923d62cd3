"""The models and data ``transformer-linear compare`` runs on.

A :class:`Workload` bundles a model with ``make_batch(step)`` (deterministic
positional inputs) and ``loss_fn(output, *inputs)``. It comes from the
built-in GPT, from an importable factory (``--model pkg.module:factory``)
or from a Hugging Face ``transformers`` causal LM (``--hf``), with inputs
that are synthetic or read from a file (``--data``).
"""

from __future__ import annotations

import contextlib
import importlib
import os
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Iterator, Optional

import torch
from torch import nn

from transformer_linear.numerics.model import lm_loss

__all__ = [
    "Workload",
    "byte_tokenize",
    "hf_workload",
    "load_token_ids",
    "parse_shape",
    "synthetic_batches",
    "token_batches",
    "user_workload",
]

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16, "long": torch.long}


@dataclass(frozen=True)
class Workload:
    """A model, its batches and its loss.

    Attributes:
        model: the model (left unchanged by the comparison).
        make_batch: ``step -> inputs`` (a tensor or tuple), deterministic.
        loss_fn: ``loss_fn(output, *inputs) -> scalar tensor``; None uses
            ``tl.numerics``' default (the output's ``.loss``, else half its mean square).
        description: one line for reports.
    """

    model: nn.Module
    make_batch: Callable[[int], Any]
    loss_fn: Optional[Callable[..., torch.Tensor]]
    description: str

    def __post_init__(self) -> None:
        if not isinstance(self.model, nn.Module):
            raise TypeError(f"Workload: 'model' must be an nn.Module, got {type(self.model).__name__}")
        for name in ("make_batch", "loss_fn"):
            value = getattr(self, name)
            if value is not None and not callable(value):
                raise TypeError(f"Workload: '{name}' must be callable, got {type(value).__name__}")


def parse_shape(text: str) -> tuple[int, ...]:
    """``"8,128"`` -> ``(8, 128)``; every size positive."""
    try:
        shape = tuple(int(s) for s in text.split(","))
    except ValueError:
        shape = ()
    if not shape or any(s < 1 for s in shape):
        raise ValueError(f"--input-shape: expected positive integers separated by commas (e.g. 8,128), got {text!r}")
    return shape


def synthetic_batches(
    shape: tuple[int, ...], dtype: str = "float32", vocab: Optional[int] = None, seed: int = 0
) -> Callable[[int], torch.Tensor]:
    """``make_batch(step)``: standard-normal floats, or uniform token ids below ``vocab`` for ``dtype="long"``."""
    if dtype not in _DTYPES:
        raise ValueError(f"--input-dtype: expected one of {', '.join(_DTYPES)}, got {dtype!r}")
    if dtype == "long" and (vocab is None or vocab < 1):
        raise ValueError("--input-dtype long needs --vocab N (token ids are drawn below N)")

    def make_batch(step: int) -> torch.Tensor:
        gen = torch.Generator().manual_seed(seed * 1_000_003 + step)
        if dtype == "long":
            return torch.randint(vocab, shape, generator=gen)
        return torch.randn(shape, generator=gen).to(_DTYPES[dtype])

    return make_batch


@contextlib.contextmanager
def _cwd_importable() -> Iterator[None]:
    """Make the current directory importable while the user's factory is imported and called.

    It goes last on ``sys.path`` (installed packages keep precedence: run from
    a source checkout, the checkout's ``transformer_linear`` must not shadow
    the installed, built one) and comes off again afterwards, so neither this
    process nor the processes it spawns keep it.
    """
    cwd = os.getcwd()
    added = cwd not in sys.path
    if added:
        sys.path.append(cwd)
    try:
        yield
    finally:
        if added and cwd in sys.path:
            sys.path.remove(cwd)


def _import_factory(spec: str) -> Callable[[], Any]:
    module_name, sep, attr = spec.partition(":")
    if not sep or not module_name or not attr:
        raise ValueError(f"--model: expected 'package.module:factory', got {spec!r}")
    try:
        module = importlib.import_module(module_name)
    except Exception as e:  # any failure of the user's module is reported on one line
        raise ValueError(f"--model: cannot import {module_name!r}: {type(e).__name__}: {e}") from e
    factory = module
    for part in attr.split("."):
        factory = getattr(factory, part, None)
        if factory is None:
            raise ValueError(f"--model: module {module_name!r} has no attribute {attr!r}")
    if not callable(factory):
        raise ValueError(f"--model: {spec!r} is not callable")
    return factory


def user_workload(
    spec: str,
    input_shape: Optional[tuple[int, ...]] = None,
    input_dtype: str = "float32",
    vocab: Optional[int] = None,
    seed: int = 0,
) -> Workload:
    """Call the factory named by ``spec`` (``pkg.module:factory``) and wrap what it returns.

    The factory returns ``model``, ``(model, make_batch)`` or
    ``(model, make_batch, loss_fn)``; without ``make_batch``,
    ``input_shape`` (and ``input_dtype``, ``vocab``) describe synthetic inputs.
    """
    with _cwd_importable():
        factory = _import_factory(spec)
        try:
            result = factory()
        except Exception as e:  # the user's code: report it on one line (--traceback shows it all)
            raise ValueError(f"--model: {spec}() raised {type(e).__name__}: {e}") from e
    parts = result if isinstance(result, tuple) else (result,)
    if not 1 <= len(parts) <= 3 or not isinstance(parts[0], nn.Module):
        raise ValueError(
            f"--model: {spec} must return model, (model, make_batch) or (model, make_batch, loss_fn) with model an "
            f"nn.Module; got {type(result).__name__}"
            + (f" of {len(parts)}" if isinstance(result, tuple) else "")
        )
    model, make_batch, loss_fn = (*parts, None, None)[:3]
    if make_batch is None:
        if input_shape is None:
            raise ValueError(f"--model: {spec} returns no make_batch; describe the inputs with --input-shape")
        make_batch = synthetic_batches(input_shape, input_dtype, vocab, seed)
    return Workload(model, _checked_batches(make_batch, spec), loss_fn, f"{spec} ({type(model).__name__})")


def _checked_batches(make_batch: Callable[[int], Any], spec: str) -> Callable[[int], Any]:
    """The factory's ``make_batch``, with a ValueError naming the factory where a batch is None (a
    ``make_batch`` that forgot its return), rather than an AttributeError deep in the model."""

    def checked(step: int) -> Any:
        batch = make_batch(step)
        if batch is None:
            raise ValueError(
                f"--model: the make_batch of {spec} returned None for step {step}; it must return the model's "
                "inputs (a tensor or a tuple)"
            )
        return batch

    return checked


def byte_tokenize(text: str, vocab_size: int) -> torch.Tensor:
    """The offline fallback tokenizer: UTF-8 bytes, folded below ``vocab_size``."""
    ids = torch.tensor(list(text.encode("utf-8")), dtype=torch.long)
    return ids % vocab_size


def load_token_ids(path: str | Path, vocab_size: int, tokenize: Optional[Callable[[str], list[int]]] = None) -> torch.Tensor:
    """Token ids from a text file (tokenized with ``tokenize``, else bytes) or a ``.pt``/``.npy`` integer tensor.

    Returns:
        int64 ids of shape (n,) or (rows, seq).

    Raises:
        ValueError: a missing or empty file, non-integer data, more than 2
            dimensions, or ids outside ``[0, vocab_size)``.
    """
    path = Path(path)
    if not path.is_file():
        raise ValueError(f"--data: no such file: {path}")
    if path.suffix in (".pt", ".npy"):
        if path.suffix == ".npy":
            import numpy as np

            ids = torch.from_numpy(np.load(path, allow_pickle=False))
        else:
            ids = torch.load(path, map_location="cpu", weights_only=True)
        if not isinstance(ids, torch.Tensor) or ids.is_floating_point() or ids.is_complex() or ids.dtype == torch.bool:
            raise ValueError(f"--data: {path} must hold an integer tensor of token ids, got {getattr(ids, 'dtype', type(ids).__name__)}")
        if ids.dim() not in (1, 2):
            raise ValueError(f"--data: {path} must hold token ids of shape (n,) or (rows, seq), got {list(ids.shape)}")
        ids = ids.long()
    else:
        text = path.read_text(encoding="utf-8", errors="replace")
        ids = torch.tensor(tokenize(text), dtype=torch.long) if tokenize else byte_tokenize(text, vocab_size)
    if ids.numel() == 0:
        raise ValueError(f"--data: {path} holds no tokens")
    if int(ids.min()) < 0 or int(ids.max()) >= vocab_size:
        raise ValueError(f"--data: token ids must lie in [0, {vocab_size}) (the model's vocabulary), got [{int(ids.min())}, {int(ids.max())}]")
    return ids


def token_batches(ids: torch.Tensor, batch_size: int, seq_len: int) -> Callable[[int], torch.Tensor]:
    """``make_batch(step)``: (batch_size, seq_len) windows of ``ids``, cycling through the data.

    A 1-D stream is cut into windows of ``seq_len``; 2-D ids are used row by
    row and must be at least ``seq_len`` long.
    """
    if ids.dim() == 1:
        if ids.numel() < seq_len:
            raise ValueError(f"--data: {ids.numel()} tokens are fewer than one sequence of {seq_len}")
        rows = ids[: ids.numel() // seq_len * seq_len].view(-1, seq_len)
    else:
        if ids.shape[1] < seq_len:
            raise ValueError(f"--data: rows of {ids.shape[1]} tokens are shorter than the sequence length {seq_len}")
        rows = ids[:, :seq_len]

    def make_batch(step: int) -> torch.Tensor:
        index = (torch.arange(batch_size) + step * batch_size) % rows.shape[0]
        return rows[index].clone()

    return make_batch


def _hf_loss(output: Any, input_ids: torch.Tensor) -> torch.Tensor:
    return lm_loss(output.logits, input_ids)


def _tokenizer(transformers: Any, name_or_path: str) -> Optional[Callable[[str], list[int]]]:
    """The model's tokenizer's ``encode``, or None when none loads (or it is empty, as one built from a bare config)."""
    try:
        tokenizer = transformers.AutoTokenizer.from_pretrained(name_or_path)
        works = len(tokenizer.encode("Hello, world")) > 0
    except (OSError, ValueError, KeyError, TypeError, AttributeError):
        return None
    return tokenizer.encode if works else None


def _looks_like_a_path(name: str) -> bool:
    """A hub name is ``name`` or ``owner/name``; anything else with a separator, or starting with . or ~, is a path."""
    return name.startswith((".", "~", os.sep)) or name.count("/") > 1 or name.endswith("/") or os.sep != "/" and os.sep in name


def hf_workload(
    name_or_path: str,
    random_init: bool,
    batch_size: int,
    seq_len: int,
    data: Optional[str] = None,
    seed: int = 0,
) -> Workload:
    """A ``transformers`` causal LM (config/checkpoint directory, or a hub name when online) and its batches.

    Text data is tokenized with the model's tokenizer when one loads from
    ``name_or_path``; otherwise (offline, config-only directories) with
    :func:`byte_tokenize`. Without data, token ids are uniform random.
    """
    try:
        import transformers
    except ImportError as e:
        raise ValueError("--hf needs the transformers package: pip install 'transformer_linear[hf]'") from e
    transformers.logging.set_verbosity_error()
    if not Path(name_or_path).exists() and _looks_like_a_path(name_or_path):
        raise ValueError(f"--hf: no such directory: {name_or_path}")
    try:
        config = transformers.AutoConfig.from_pretrained(name_or_path)
        if random_init:
            torch.manual_seed(seed)
            model = transformers.AutoModelForCausalLM.from_config(config)
        else:
            model = transformers.AutoModelForCausalLM.from_pretrained(name_or_path)
    except (OSError, ValueError, KeyError) as e:
        first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise ValueError(f"--hf: cannot load a causal LM from {name_or_path!r}: {first}") from e
    model.config.use_cache = False
    vocab = model.config.vocab_size
    max_len = getattr(model.config, "max_position_embeddings", None) or getattr(model.config, "n_positions", None)
    if max_len is not None and seq_len > max_len:
        raise ValueError(f"--input-shape: sequence length {seq_len} exceeds the model's maximum {max_len}")
    source = "random token ids"
    if data is None:
        make_batch = synthetic_batches((batch_size, seq_len), "long", vocab, seed)
    else:
        tokenize = _tokenizer(transformers, name_or_path) if not data.endswith((".pt", ".npy")) else None
        if data.endswith((".pt", ".npy")):
            source = data
        elif tokenize is None:
            source = f"{data} (no tokenizer found: UTF-8 bytes as ids)"
        else:
            source = f"{data} (tokenizer of {name_or_path})"
        make_batch = token_batches(load_token_ids(data, vocab, tokenize), batch_size, seq_len)
    init = "random init" if random_init else "pretrained"
    desc = f"{type(model).__name__} from {name_or_path} ({init}); data: {source}"
    return Workload(model, make_batch, _hf_loss, desc)

