"""Helpers shared by the model tests (imported by name: tests/ has no packages)."""

from __future__ import annotations

import torch

# Small enough that STM fills and LTM is reached within a handful of segments.
SMALL_MEMORIA = dict(
    num_wm=4, num_stm_reminded=3, num_ltm_reminded=3, stm_capacity=8, initial_lifespan=3.0, alpha=2.0, search_depth=2
)
VOCAB = 257


def segments(batch: int = 3, length: int = 12, count: int = 4, seed: int = 0) -> list[torch.Tensor]:
    """`count` random segments of one batch of streams: a list of (batch, length) int64."""
    gen = torch.Generator().manual_seed(seed)
    return list(torch.randint(0, VOCAB, (batch, length * count), generator=gen).split(length, dim=1))


def run_stream(model, segs, memory=None, **kwargs):
    """Feed segments in order, carrying memory; returns (list of outputs, final memory)."""
    outs = []
    for x in segs:
        out = model(x, memory=memory, **kwargs)
        memory = out.memory
        outs.append(out)
    return outs, memory


def losses_and_grads(model, segs):
    """Feed segments in order with a loss on each, carrying memory and backpropagating every segment:
    (stacked losses, gradients by parameter name, the last output)."""
    model.zero_grad()
    memory, losses = None, []
    for x in segs:
        out = model(x, labels=x, memory=memory)
        out.loss.backward()
        losses.append(out.loss.detach())
        memory = out.memory
    return torch.stack(losses), {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}, out


def assert_only_later_tokens_change(a, b, t: int, pos: int, later: float = 1e-6) -> None:
    """Causality of a carried memory, from the logits of a stream (`a`, per segment) and of the same
    stream with token `pos` of segment `t` changed (`b`): every earlier segment bit-identical, the
    earlier positions of segment t unchanged, the changed position itself changed, and every later
    segment changed by more than `later` (the memory carries the change forward)."""
    for i in range(t):
        torch.testing.assert_close(a[i], b[i], rtol=0, atol=0)
    torch.testing.assert_close(a[t][:, :pos], b[t][:, :pos], rtol=0, atol=1e-6)
    assert (a[t][:, pos] - b[t][:, pos]).abs().max() > 1e-4
    for i in range(t + 1, len(a)):
        assert (a[i] - b[i]).abs().max() > later, f"segment {i} ignores segment {t}"


def changed_token(segs: list[torch.Tensor], t: int, pos: int) -> list[torch.Tensor]:
    """`segs` with token `pos` of segment `t` replaced by the next one of the vocabulary."""
    changed = [s.clone() for s in segs]
    changed[t][:, pos] = (changed[t][:, pos] + 1) % VOCAB
    return changed


def assert_row_operations_keep_outputs(model, segs, memory, logits, atol: float) -> None:
    """The row contract of a carried memory: `take_rows`, `put_rows` and `cat` give every row the
    logits the whole memory gives it. `memory` is the state after some segments of 4 rows;
    `logits(model, segs, memory)` reads `segs` from it (a kind with random draws seeds them)."""
    full = logits(model, segs, memory.clone())
    rows = [2, 0]
    part = logits(model, [s[rows] for s in segs], memory.take_rows(rows))
    for a, b in zip(full, part):
        torch.testing.assert_close(a[rows], b, rtol=0, atol=atol)
    rebuilt = model.empty_memory(4)
    rebuilt.put_rows([3, 1], memory.take_rows([3, 1]))
    rebuilt.put_rows(torch.tensor([0, 2]), memory.take_rows([0, 2]))
    for a, b in zip(full, logits(model, segs, rebuilt)):
        torch.testing.assert_close(a, b, rtol=0, atol=atol)
    joined = type(memory).cat([memory.take_rows([0, 1]), memory.take_rows([2, 3])])
    for a, b in zip(full, logits(model, segs, joined)):
        torch.testing.assert_close(a, b, rtol=0, atol=atol)


def assert_a_reset_row_starts_a_fresh_stream(model, segs, logits, poison: tuple[str, ...] = (),
                                             keep_atol: float = 1e-6) -> None:
    """The reset contract of a carried memory, on 3 rows and 6 segments: after 3 segments, row 1
    is reset before the 4th; rows 0 and 2 then read exactly what they read without the reset,
    row 1 what a fresh one-row stream reads. `poison` names memory fields set to NaN in row 1
    first (a diverged step's row): nothing of it may reach a later segment."""
    reset = torch.tensor([False, True, False])
    with torch.no_grad():
        _, memory = run_stream(model, segs[:3])
        untouched = logits(model, segs[3:], memory.clone())
        for name in poison:
            getattr(memory, name)[1] = float("nan")
        outs = [model(segs[3], memory=memory, reset=reset)]
        outs += run_stream(model, segs[4:], memory=outs[0].memory)[0]
        fresh = logits(model, [s[1:2] for s in segs[3:]])
    for got, keep, new in zip([o.logits for o in outs], untouched, fresh):
        torch.testing.assert_close(got[[0, 2]], keep[[0, 2]], rtol=0, atol=keep_atol)
        torch.testing.assert_close(got[1:2], new, rtol=0, atol=1e-5)
