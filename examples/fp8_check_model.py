"""A model factory for ``transformer-linear compare --model examples.fp8_check_model:build``.

Run it from the repository root (the current directory is on the import
path). The factory returns ``(model, make_batch, loss_fn)``:

- ``make_batch(step)`` returns the model's positional inputs for that step
  (a tensor or a tuple) and must be deterministic, so every run sees the
  same data;
- ``loss_fn(output, *inputs)`` returns a scalar tensor.

Returning only the model is fine too: then describe synthetic inputs with
``--input-shape 16,32,64`` (and ``--input-dtype long --vocab N`` for ids).
"""

import torch
import torch.nn.functional as F
from torch import nn

D_MODEL, SEQ, CLASSES, BATCH = 64, 32, 10, 16


class SequenceClassifier(nn.Module):
    """A transformer encoder layer and a linear head over the mean of the sequence."""

    def __init__(self) -> None:
        super().__init__()
        self.encoder = nn.TransformerEncoderLayer(D_MODEL, nhead=4, dim_feedforward=128, dropout=0.0, batch_first=True)
        self.head = nn.Linear(D_MODEL, CLASSES)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.encoder(x).mean(dim=1))


def build():
    torch.manual_seed(0)
    model = SequenceClassifier()
    # The labels come from a fixed random "teacher", so the task is learnable.
    teacher = torch.randn(D_MODEL, CLASSES, generator=torch.Generator().manual_seed(1))

    def make_batch(step: int) -> torch.Tensor:
        return torch.randn(BATCH, SEQ, D_MODEL, generator=torch.Generator().manual_seed(step))

    def loss_fn(logits: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        labels = (x.mean(dim=1) @ teacher.to(x.device)).argmax(dim=-1)
        return F.cross_entropy(logits.float(), labels)

    return model, make_batch, loss_fn
