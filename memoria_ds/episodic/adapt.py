"""Local adaptation: MbPA++'s inference (de Masson d'Autume et al. 2019).

For a test example x with key u, MbPA++ retrieves the K stored examples N(x) nearest to u,
starts from the trained weights theta and takes L gradient steps on

    L_LA(theta~) = (1/K) sum_{(x', y') in N(x)} CE(f_theta~(x'), y') + lambda * ||theta~ - theta||_2^2,

predicts x with f_theta~, and throws theta~ away: the next test example starts from theta
again. Defaults and their sources:

* K = 32 neighbours, L = 30 steps: the paper, as the survey (shared/papers) reports it
  ("K = 32 and L = 30"). Daikon-Sun/EM-in-LLL's port uses L = 20 (`settings.py`).
* lambda = 1e-3: the paper (the survey: "lambda_l = 0.001"); both public ports use 1e-3.
* lr = 1e-3: h3lio5/episodic-lifelong-learning (`MbPAplusplus.py`: "1e-3 or 5e-3");
  Daikon-Sun/EM-in-LLL uses 2e-3.
* Optimiser: plain gradient descent, theta~ <- theta~ - lr * grad: the paper describes L
  gradient-based local adaptation updates of the objective above and, as far as could be
  checked (through the survey and the ports; the paper's own text was not at hand), names
  no adaptive optimiser for them; verify against the paper before quoting this. The ports
  differ: h3lio5 uses AdamW (weight decay 0, i.e. Adam), Daikon-Sun SGD with momentum 0.9.
  Both are available: `optimizer="adam"`, or `optimizer="sgd", momentum=0.9`; each matches
  `torch.optim.Adam` / `torch.optim.SGD` step for step.

Dropout is off while adapting and predicting (the model is put in eval mode for the call and
its modes restored after): the adapted weights are then a deterministic function of (theta,
N(x)), so a prediction is reproducible and the lambda -> infinity limit is exactly the base
prediction. Daikon-Sun's port does the same by loading its test model with zero dropout.

The live module is never written. The adapted weights are fresh clones of the parameters,
run through `torch.func.functional_call`; theta itself is read (detached, never written), so
the base weights are unchanged bit for bit by construction and no `.grad` is touched. (A
port that "saves" theta with a reference to the live tensors and adapts those in place gets
an L2 pull of exactly zero.)

Shapes: K neighbours, T tokens, B query rows, C classes, Q queries (adapt_and_predict).
"""

from __future__ import annotations

import math
from collections.abc import Iterator, Mapping
from contextlib import contextmanager

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.func import functional_call

from .memory import EpisodicMemory, MemoryBatch, gather
from .search import nearest

NEIGHBOURS = 32  # K (paper)
ADAPT_STEPS = 30  # L (paper)
ADAPT_LR = 1e-3  # h3lio5 port
ADAPT_L2 = 1e-3  # lambda (paper)
OPTIMIZERS = ("sgd", "adam")

Batch = MemoryBatch | Mapping[str, Tensor]


def local_adaptation(
    model: nn.Module,
    neighbours: Batch,
    query: Batch,
    *,
    steps: int = ADAPT_STEPS,
    lr: float = ADAPT_LR,
    l2: float = ADAPT_L2,
    optimizer: str = "sgd",
    momentum: float = 0.0,
    betas: tuple[float, float] = (0.9, 0.999),
    eps: float = 1e-8,
) -> Tensor:
    """Adapt a copy of the weights to `neighbours`, then predict `query` with it.

    Args:
        model: a `transformers` sequence classifier (called with `input_ids`, `attention_mask`;
            reads `.logits`), single-label. Parameters with `requires_grad=False` stay fixed.
        neighbours: `input_ids` (K, T), `attention_mask` (K, T), `labels` (K,): a `MemoryBatch`
            (e.g. `gather(memory, rows)`) or a mapping with those keys.
        query: `input_ids` (B, T), `attention_mask` (B, T) of the examples to predict (all with
            the same adapted weights); a `MemoryBatch` or a mapping.
        steps: L gradient steps (0: the base model's prediction).
        lr: step size.
        l2: lambda, the weight of `||theta~ - theta||^2` (summed over adapted parameters).
        optimizer: "sgd" (plain gradient descent unless `momentum`) or "adam".
        momentum: SGD momentum (`torch.optim.SGD` semantics, no dampening).
        betas, eps: Adam's (`torch.optim.Adam` semantics, no weight decay).

    Returns:
        (B, C) logits of the query under the adapted weights, detached.

    Raises:
        ValueError: bad settings, a model that is not a single-label classifier, or batches
            missing an entry.
    """
    _check_settings(model, steps, lr, l2, optimizer, momentum)
    device = next(model.parameters()).device
    nb = {k: v.to(device) for k, v in _entries(neighbours, ("input_ids", "attention_mask", "labels")).items()}
    q = {k: v.to(device) for k, v in _entries(query, ("input_ids", "attention_mask")).items()}
    labels = nb.pop("labels")

    with _eval_mode(model), torch.inference_mode(False), torch.enable_grad():
        base = {n: p.detach() for n, p in model.named_parameters() if p.requires_grad}  # theta: read only
        theta = {n: p.clone().requires_grad_(True) for n, p in base.items()}  # theta~: fresh storage
        slots: dict[str, dict[str, Tensor]] = {n: {} for n in theta}  # optimiser state per parameter
        for t in range(1, steps + 1):
            logits = functional_call(model, theta, args=(), kwargs=nb).logits  # (K, C)
            loss = F.cross_entropy(logits.float(), labels)
            if l2:
                loss = loss + l2 * sum(((theta[n] - base[n]) ** 2).sum() for n in theta)
            grads = torch.autograd.grad(loss, list(theta.values()), allow_unused=True)
            with torch.no_grad():
                for (name, p), g in zip(theta.items(), grads):
                    if g is None:  # unreached by the loss (only possible with l2 = 0): torch.optim skips it too
                        continue
                    if optimizer == "sgd":
                        _sgd(p, g, slots[name], lr, momentum)
                    else:
                        _adam(p, g, slots[name], t, lr, betas, eps)
        with torch.no_grad():
            return functional_call(model, theta, args=(), kwargs=q).logits.detach()  # (B, C)


def adapt_and_predict(
    model: nn.Module,
    memory: EpisodicMemory,
    query_keys: Tensor,
    query: Batch,
    *,
    k: int = NEIGHBOURS,
    **settings: object,
) -> Tensor:
    """MbPA++ inference for a batch: each query adapted separately on its own K neighbours.

    One batched search for all queries, then one `local_adaptation` per query (correctness
    first: the adapted weights of one query never reach another's prediction).

    Args:
        model: the trained sequence classifier (left unchanged).
        memory: the episodic memory (N >= 1).
        query_keys: (Q, D) the queries' keys from the frozen `KeyEncoder`.
        query: `input_ids` (Q, T), `attention_mask` (Q, T); a `MemoryBatch` or a mapping.
        k: neighbours per query (clamped to the memory's size).
        **settings: `local_adaptation`'s keyword arguments (steps, lr, l2, optimizer, ...).

    Returns:
        (Q, C) logits, row q predicted with the weights adapted to query q's neighbours.
    """
    q = _entries(query, ("input_ids", "attention_mask"))
    if q["input_ids"].shape[0] != query_keys.shape[0]:
        raise ValueError(f"{query_keys.shape[0]} query keys for {q['input_ids'].shape[0]} query examples")
    rows, _ = nearest(memory, query_keys, k)  # (Q, K)
    out = [
        local_adaptation(model, gather(memory, rows[i]),
                         {"input_ids": q["input_ids"][i : i + 1], "attention_mask": q["attention_mask"][i : i + 1]},
                         **settings)  # (1, C)
        for i in range(rows.shape[0])
    ]
    return torch.cat(out) if out else torch.zeros(0, model.config.num_labels)


# --------------------------------------------------------------------- optimiser steps (in place on theta~)
def _sgd(p: Tensor, g: Tensor, slot: dict[str, Tensor], lr: float, momentum: float) -> None:
    if momentum:
        buf = slot.get("momentum")
        buf = slot.setdefault("momentum", g.clone()) if buf is None else buf.mul_(momentum).add_(g)
        g = buf
    p.add_(g, alpha=-lr)


def _adam(p: Tensor, g: Tensor, slot: dict[str, Tensor], t: int, lr: float, betas: tuple[float, float],
          eps: float) -> None:
    beta1, beta2 = betas
    m = slot.setdefault("exp_avg", torch.zeros_like(p))
    v = slot.setdefault("exp_avg_sq", torch.zeros_like(p))
    m.lerp_(g, 1 - beta1)
    v.mul_(beta2).addcmul_(g, g, value=1 - beta2)
    denom = (v.sqrt() / math.sqrt(1 - beta2**t)).add_(eps)
    p.addcdiv_(m, denom, value=-lr / (1 - beta1**t))


# --------------------------------------------------------------------- helpers
def _check_settings(model: nn.Module, steps: int, lr: float, l2: float, optimizer: str, momentum: float) -> None:
    if not isinstance(steps, int) or steps < 0:
        raise ValueError(f"`steps` must be an int >= 0, got {steps!r}")
    if not lr > 0 or not l2 >= 0:
        raise ValueError(f"need lr > 0 and l2 >= 0, got lr={lr}, l2={l2}")
    if optimizer not in OPTIMIZERS:
        raise ValueError(f"`optimizer` must be one of {OPTIMIZERS}, got {optimizer!r}")
    if not 0.0 <= momentum < 1.0 or (momentum and optimizer != "sgd"):
        raise ValueError(f"`momentum` must lie in [0, 1) and goes with optimizer='sgd', got {momentum}")
    config = getattr(model, "config", None)
    problem = getattr(config, "problem_type", None)
    if config is None or problem not in (None, "single_label_classification") or config.num_labels < 2:
        raise ValueError(
            f"local adaptation needs a single-label sequence classifier (config.num_labels >= 2, problem_type "
            f"single_label_classification or unset), got problem_type={problem!r}, "
            f"num_labels={getattr(config, 'num_labels', None)}"
        )


def _entries(batch: Batch, names: tuple[str, ...]) -> dict[str, Tensor]:
    if isinstance(batch, MemoryBatch):
        batch = batch.model_inputs()
    missing = [n for n in names if n not in batch]
    if missing:
        raise ValueError(f"batch is missing {missing}; it needs {list(names)}")
    return {n: batch[n] for n in names}


@contextmanager
def _eval_mode(model: nn.Module) -> Iterator[None]:
    """Eval mode for the block, then every submodule's own mode back."""
    modes = [(m, m.training) for m in model.modules()]
    model.eval()
    try:
        yield
    finally:
        for m, training in modes:
            m.training = training


__all__ = ["local_adaptation", "adapt_and_predict", "NEIGHBOURS", "ADAPT_STEPS", "ADAPT_LR", "ADAPT_L2", "OPTIMIZERS"]
