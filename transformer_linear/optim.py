"""Optimizer-side master weights for FP8 primary weights (``tl.quantized_model_init``).

A layer built under ``tl.quantized_model_init`` holds its weight only quantized (a ``QuantizedWeight``
Parameter, about 1 byte an element for FP8 recipes). :class:`MasterWeights` keeps the high-precision
copy a stock optimizer steps, outside the model, as Transformer Engine's ``FusedAdam(master_weights=True)``
does inside its optimizer:

```python
masters = tl.optim.MasterWeights(model)                       # fp32 masters of the FP8 weights
opt = torch.optim.AdamW(masters.parameters(), lr=1e-3)        # masters + the model's other parameters
masters.attach(opt)
for batch in data:
    loss_fn(model(batch)).backward()
    opt.step(); opt.zero_grad()
```

``attach`` registers four hooks on the optimizer: before ``step`` each FP8 weight's gradient (in the
weight's dtype) becomes its master's gradient (the tensor is handed over, not copied); after ``step`` each
FP8 weight is quantized again from its updated master, in place; ``state_dict`` carries the masters
(under ``"master_weights"``, in the order of :meth:`MasterWeights.parameters`) and ``load_state_dict``
restores them and requantizes. The optimizer is unchanged otherwise (its state is keyed by the masters).

What it costs: the master (4 bytes an element in fp32) lives beside the FP8 weight (1 byte, plus the
columnwise copy where the recipe keeps one), so one process holds about what it holds with a
high-precision Parameter and a cast per forward; what leaves the model is the high-precision weight, so
the model's own bytes (what a forward reads, what inference or a frozen copy keeps, what would be
gathered) are the FP8 ones, and the masters can be kept on another device or sharded with the optimizer.
The step adds one quantize pass per weight (instead of one per forward).
"""

from __future__ import annotations

from typing import Any, Iterator, Optional

import torch
from torch import Tensor, nn

from transformer_linear.modules.quantized_init import QuantizedWeight, high_precision_weight

__all__ = ["MasterWeights"]

_STATE_KEY = "master_weights"


class MasterWeights:
    """High-precision master copies of ``model``'s FP8 weights, for a stock ``torch.optim`` optimizer.

    Args:
        model: the model whose ``QuantizedWeight`` Parameters get masters (built under
            ``tl.quantized_model_init``).
        dtype: the masters' dtype; None: each weight's own (fp32 for a model built in fp32).

    Raises:
        TypeError: ``model`` not an ``nn.Module`` or ``dtype`` not a floating dtype.
        ValueError: ``model`` has no FP8 weight.
    """

    def __init__(self, model: nn.Module, dtype: Optional[torch.dtype] = None) -> None:
        if not isinstance(model, nn.Module):
            raise TypeError(f"MasterWeights: 'model' must be an nn.Module, got {type(model).__name__}")
        if dtype is not None and (not isinstance(dtype, torch.dtype) or not dtype.is_floating_point):
            raise TypeError(f"MasterWeights: 'dtype' must be a floating torch.dtype or None, got {dtype!r}")
        self._weights: list[QuantizedWeight] = []
        self._masters: list[nn.Parameter] = []
        self._params: list[Tensor] = []
        seen: set[int] = set()
        layers = {id(m.weight): m for m in model.modules() if isinstance(getattr(m, "weight", None), QuantizedWeight)}
        for p in model.parameters():
            if id(p) in seen:
                continue
            seen.add(id(p))
            if isinstance(p, QuantizedWeight):
                # The preserved initial weight where the layer kept one (then freed), else the dequantized one.
                hp = high_precision_weight(layers[id(p)]) if id(p) in layers else p.dequantize()
                master = nn.Parameter(hp.to(dtype or p.dtype).clone(), requires_grad=p.requires_grad)
                self._weights.append(p)
                self._masters.append(master)
                self._params.append(master)
            else:
                self._params.append(p)
        if not self._weights:
            raise ValueError("MasterWeights: 'model' has no FP8 weight (build it under tl.quantized_model_init)")

    def parameters(self) -> list[Tensor]:
        """What the optimizer steps: each FP8 weight's master in its place, the other parameters as they are."""
        return list(self._params)

    def masters(self) -> Iterator[tuple[QuantizedWeight, nn.Parameter]]:
        """(FP8 weight, its master) pairs."""
        return zip(self._weights, self._masters)

    def master_of(self, weight: Tensor) -> nn.Parameter:
        """The master of the FP8 Parameter ``weight``.

        Raises:
            KeyError: ``weight`` is not one of the model's FP8 weights.
        """
        for w, m in self.masters():
            if w is weight:
                return m
        raise KeyError("MasterWeights.master_of: 'weight' is not an FP8 weight of this model")

    def grads_to_masters(self) -> None:
        """Hand each FP8 weight's gradient to its master (accumulating onto a master gradient already there)."""
        for weight, master in self.masters():
            grad = weight.grad
            if grad is None:
                continue
            grad = grad.to(master.dtype)
            master.grad = grad if master.grad is None else master.grad + grad
            weight.grad = None

    def requantize(self) -> None:
        """Quantize each FP8 weight again from its master, in place."""
        with torch.no_grad():
            for weight, master in self.masters():
                weight.quantize_(master.detach().to(weight.dtype))

    def copy_from_model(self) -> None:
        """Reset the masters to the model's dequantized weights (after loading only the model's state)."""
        with torch.no_grad():
            for weight, master in self.masters():
                master.copy_(weight.dequantize(master.dtype))

    def attach(self, optimizer: torch.optim.Optimizer) -> "MasterWeights":
        """Hook ``optimizer`` (built over :meth:`parameters`) so that its steps and state go through the masters.

        Returns:
            self.

        Raises:
            TypeError: ``optimizer`` not a ``torch.optim.Optimizer``.
            ValueError: ``optimizer`` does not step every master.
        """
        if not isinstance(optimizer, torch.optim.Optimizer):
            raise TypeError(f"MasterWeights.attach: 'optimizer' must be a torch.optim.Optimizer, got {optimizer!r}")
        stepped = {id(p) for group in optimizer.param_groups for p in group["params"]}
        if any(id(m) not in stepped for m in self._masters):
            raise ValueError(
                "MasterWeights.attach: 'optimizer' does not step every master; build it over masters.parameters()"
            )
        self.handles = [
            optimizer.register_step_pre_hook(lambda opt, args, kwargs: self.grads_to_masters()),
            optimizer.register_step_post_hook(lambda opt, args, kwargs: self.requantize()),
            optimizer.register_state_dict_post_hook(self._save),
            optimizer.register_load_state_dict_pre_hook(self._load),
        ]
        return self

    def _save(self, optimizer: torch.optim.Optimizer, state_dict: dict[str, Any]) -> dict[str, Any]:
        state_dict[_STATE_KEY] = [m.detach() for m in self._masters]
        return state_dict

    def _load(self, optimizer: torch.optim.Optimizer, state_dict: dict[str, Any]) -> dict[str, Any]:
        saved = state_dict.get(_STATE_KEY)
        if saved is None:
            return state_dict
        if len(saved) != len(self._masters):
            raise ValueError(
                f"MasterWeights: the optimizer state holds {len(saved)} master weights, this model has "
                f"{len(self._masters)}"
            )
        with torch.no_grad():
            for master, value in zip(self._masters, saved):
                master.copy_(value)
        self.requantize()
        state_dict = dict(state_dict)
        del state_dict[_STATE_KEY]
        return state_dict
