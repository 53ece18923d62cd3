"""A small GPT-style language model and the synthetic data it learns from.

Shipped with the package so that ``python -m transformer_linear compare``
runs anywhere without downloads. Every projection is an ``nn.Linear`` so
``convert_to_fp8`` swaps them all.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn


@dataclass(frozen=True)
class GPTConfig:
    """Size of the built-in model.

    Attributes:
        vocab_size: number of token ids.
        seq_len: context length.
        d_model: embedding width (a multiple of n_heads).
        n_heads: attention heads.
        n_layers: transformer blocks.
    """

    vocab_size: int = 64
    seq_len: int = 32
    d_model: int = 64
    n_heads: int = 4
    n_layers: int = 2

    def __post_init__(self) -> None:
        for name in ("vocab_size", "seq_len", "d_model", "n_heads", "n_layers"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"GPTConfig.{name} must be a positive integer, got {value!r}")
        if self.d_model % self.n_heads:
            raise ValueError(f"GPTConfig.d_model ({self.d_model}) must be a multiple of n_heads ({self.n_heads})")

    @classmethod
    def named(cls, size: str) -> "GPTConfig":
        """``tiny`` (tests), ``small`` (the CLI default) or ``medium``."""
        sizes = {
            "tiny": cls(vocab_size=32, seq_len=16, d_model=32, n_heads=2, n_layers=1),
            "small": cls(),
            "medium": cls(vocab_size=128, seq_len=64, d_model=128, n_heads=4, n_layers=4),
        }
        if size not in sizes:
            raise ValueError(f"unknown model size {size!r}; expected one of {sorted(sizes)}")
        return sizes[size]


class _Block(nn.Module):
    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        self.n_heads = cfg.n_heads
        self.ln1 = nn.LayerNorm(cfg.d_model)
        self.qkv = nn.Linear(cfg.d_model, 3 * cfg.d_model)
        self.proj = nn.Linear(cfg.d_model, cfg.d_model)
        self.ln2 = nn.LayerNorm(cfg.d_model)
        self.fc1 = nn.Linear(cfg.d_model, 4 * cfg.d_model)
        self.fc2 = nn.Linear(4 * cfg.d_model, cfg.d_model)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, c = x.shape
        q, k, v = self.qkv(self.ln1(x)).split(c, dim=-1)
        heads = lambda z: z.view(b, t, self.n_heads, c // self.n_heads).transpose(1, 2)  # noqa: E731
        attn = F.scaled_dot_product_attention(heads(q), heads(k), heads(v), is_causal=True)
        x = x + self.proj(attn.transpose(1, 2).reshape(b, t, c))
        return x + self.fc2(F.gelu(self.fc1(self.ln2(x))))


class TinyGPT(nn.Module):
    """Decoder-only transformer: token + position embeddings, pre-norm blocks, linear head."""

    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        self.cfg = cfg
        self.tok = nn.Embedding(cfg.vocab_size, cfg.d_model)
        self.pos = nn.Embedding(cfg.seq_len, cfg.d_model)
        self.blocks = nn.ModuleList(_Block(cfg) for _ in range(cfg.n_layers))
        self.ln_f = nn.LayerNorm(cfg.d_model)
        self.head = nn.Linear(cfg.d_model, cfg.vocab_size)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        """Logits of shape (batch, seq, vocab) for int64 tokens of shape (batch, seq)."""
        if tokens.dim() != 2 or tokens.dtype != torch.long:
            raise ValueError(f"TinyGPT expects int64 tokens of shape (batch, seq), got {tokens.dtype} {tuple(tokens.shape)}")
        if tokens.shape[1] > self.cfg.seq_len:
            raise ValueError(f"sequence length {tokens.shape[1]} exceeds the model's {self.cfg.seq_len}")
        pos = torch.arange(tokens.shape[1], device=tokens.device)
        x = self.tok(tokens) + self.pos(pos)
        for block in self.blocks:
            x = block(x)
        return self.head(self.ln_f(x))


def lm_loss(logits: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
    """Next-token cross-entropy."""
    return F.cross_entropy(logits[:, :-1].flatten(0, 1).float(), tokens[:, 1:].flatten())


class SyntheticText:
    """Token sequences from a fixed random bigram model with a few strong transitions.

    Deterministic for a seed; the model can learn it, so the loss falls well
    below log(vocab) in a few hundred steps.
    """

    def __init__(self, cfg: GPTConfig, seed: int = 0) -> None:
        self.cfg = cfg
        gen = torch.Generator().manual_seed(seed)
        logits = torch.randn(cfg.vocab_size, cfg.vocab_size, generator=gen) * 3.0
        self.transition = torch.softmax(logits, dim=-1)
        self._gen = torch.Generator().manual_seed(seed + 1)

    def batch(self, batch_size: int) -> torch.Tensor:
        """int64 tokens of shape (batch_size, seq_len)."""
        tokens = torch.empty(batch_size, self.cfg.seq_len, dtype=torch.long)
        tokens[:, 0] = torch.randint(self.cfg.vocab_size, (batch_size,), generator=self._gen)
        for t in range(1, self.cfg.seq_len):
            tokens[:, t] = torch.multinomial(self.transition[tokens[:, t - 1]], 1, generator=self._gen).squeeze(1)
        return tokens

    @property
    def entropy_floor(self) -> float:
        """Mean entropy of the transitions: the best achievable loss (nats)."""
        p = self.transition
        return float(-(p * p.clamp_min(1e-30).log()).sum(-1).mean())

    @property
    def uniform_loss(self) -> float:
        """Loss of a model that knows nothing: log(vocab)."""
        return math.log(self.cfg.vocab_size)
