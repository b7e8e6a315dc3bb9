"""Every kind's step captured whole (issue 48 item 1): one graph, no recompile, no host sync.

On a GPU a memory kind costs what its host side costs unless its step is captured whole
(`torch.compile(fullgraph=True)`, CUDA graphs). For every preset (and Memoria read as
self-attention slots with `engram_bias`, and `xl` with a Product-Key Memory layer):

- one forward with its loss is one graph, with no graph break (`torch._dynamo.explain`);
- compiled with `fullgraph=True` (backward through AOTAutograd), six training steps through a
  reset, padded rows and a reload of the memory compile once and compute what eager computes;
- one eager training step dispatches no operation that reads a tensor's value on the host
  (`aten._local_scalar_dense` behind `.item()`, `nonzero`, `masked_select`, boolean-mask
  indexing, `unique`: each a sync on a GPU and a data-dependent shape for a graph);
- the memory keeps its addresses: every tensor of the state is written in place, eager and
  compiled, through steps, resets, padded rows and a load (so a CUDA graph replays over it),
  and the backward still sees what the forward read (`recurrent/read_copy.py`).
"""

from __future__ import annotations

import io

import pytest
import torch
from model_helpers import segments
from torch.utils._python_dispatch import TorchDispatchMode

from memoria_ds.model.config import PRESETS
from memoria_ds.model.extended_attention import ExtendedKeyValues
from memoria_ds.model.hf_compat import ATTENTION_CACHE, self_attention_with_queries

LENGTH, BATCH = 16, 3
KINDS = [(preset, {}) for preset in PRESETS] + [
    ("memoria", {"memory_read": "self_attention", "engram_bias": 0.0}),
    # Product-Key Memory layers beside a kind (its query batch norm over the real tokens: padded rows below)
    ("xl", {"pkm_layers": [1], "pkm": {"n_keys": 8, "heads": 2, "knn": 4, "k_dim": 16}}),
    ("xl+memoria", {}), ("xl+memoria_gated", {}),  # composites (`model/composition.py`; `memorizing` is one too)
]
IDS = [p if not s else f"{p}+{'+'.join(s)}" for p, s in KINDS]
# aten ops that read a value on the host or make a shape from data
SYNCS = {"_local_scalar_dense", "nonzero", "nonzero_static", "masked_select", "unique", "_unique", "_unique2",
         "unique_consecutive", "unique_dim", "item", "is_nonzero", "equal", "repeat_interleave"}


def _model(make_model, preset, settings):
    model = make_model(preset, memory_init="random", segment_length=LENGTH, **settings).train()
    return model


def _step(model, x, memory, reset=None, mask=None):
    out = model(input_ids=x, shift_labels=torch.roll(x, -1, dims=1), memory=memory, reset=reset,
                attention_mask=mask)
    out.loss.backward()
    return out.loss.detach(), out.memory


def _warm(model, count=3):
    memory = model.empty_memory(BATCH)
    for x in segments(BATCH, LENGTH, count, seed=1):
        _, memory = _step(model, x, memory)
        memory.detach_()
    model.zero_grad(set_to_none=True)
    return memory


@pytest.mark.parametrize("preset,settings", KINDS, ids=IDS)
def test_one_forward_with_its_loss_is_one_graph(make_model, preset, settings):
    model = _model(make_model, preset, settings)
    memory = _warm(model)
    x = segments(BATCH, LENGTH, 1, seed=2)[0]

    def forward(x, memory):
        return model(input_ids=x, shift_labels=torch.roll(x, -1, dims=1), memory=memory).loss

    torch._dynamo.reset()
    explained = torch._dynamo.explain(forward)(x, memory)
    reasons = [f"{b.reason} at {b.user_stack[-1] if b.user_stack else '?'}" for b in explained.break_reasons]
    assert explained.graph_count == 1 and explained.graph_break_count == 0, "\n".join(reasons)


class _Syncs(TorchDispatchMode):
    def __init__(self) -> None:
        super().__init__()
        self.found: list[str] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = func.overloadpacket.__name__
        if name in SYNCS or (name == "index" and any(
                isinstance(i, torch.Tensor) and i.dtype == torch.bool for i in (args[1] if len(args) > 1 else ()))):
            self.found.append(str(func))
        return func(*args, **(kwargs or {}))


# Reads a kind makes only where they cost nothing: eager on CPU (never compiled, never on an
# accelerator) memorizing's reset drops the slots no row holds (`MemorizingMemory.reset`, gated by
# `memorizing.static_shapes`); with fixed shapes, as compiled or on a GPU, the same step reads nothing.
CPU_EAGER_ONLY = {p: {"aten.nonzero.default", "aten._local_scalar_dense.default"}
                  for p in ("memorizing_no_cache", "memorizing")}


@pytest.mark.parametrize("preset,settings", KINDS, ids=IDS)
def test_a_training_step_reads_nothing_back_to_the_host(make_model, preset, settings, monkeypatch):
    model = _model(make_model, preset, settings)
    memory = _warm(model)
    x = segments(BATCH, LENGTH, 1, seed=2)[0]
    reset = torch.tensor([False, True, False])
    with _Syncs() as syncs:
        _, memory = _step(model, x, memory, reset=reset)
        memory.detach_()
    assert not set(syncs.found) - CPU_EAGER_ONLY.get(preset, set()), syncs.found
    if preset in CPU_EAGER_ONLY:  # the step as a GPU or a compiled step runs it: nothing read back
        from memoria_ds.model.recurrent import memorizing

        monkeypatch.setattr(memorizing, "static_shapes", lambda device: True)
        with _Syncs() as syncs:
            _, memory = _step(model, x, memory, reset=reset)
        assert not syncs.found, syncs.found


@pytest.mark.parametrize("preset,settings", KINDS, ids=IDS)
def test_compiled_steps_compile_once_and_equal_eager(make_model, preset, settings):
    eager = _model(make_model, preset, settings)
    compiled = _model(make_model, preset, settings)
    compiled.load_state_dict(eager.state_dict())
    torch._dynamo.reset()
    compiled.compile(fullgraph=True, dynamic=False, backend="aot_eager")
    segs = segments(BATCH, LENGTH, 6, seed=3)
    padded = torch.ones(BATCH, LENGTH, dtype=torch.long)
    padded[2, LENGTH // 2:] = 0  # a stream that ends inside the segment
    # every step passes a reset mask and an attention mask, as the training loop does (`train/loop.py`)
    none, full = torch.zeros(BATCH, dtype=torch.bool), torch.ones(BATCH, LENGTH, dtype=torch.long)
    plan = [dict(), dict(), dict(reset=torch.tensor([False, True, False])), dict(reload=True),
            dict(mask=padded), dict(reset=torch.tensor([True, False, True]))]
    results = {}
    for name, model in (("eager", eager), ("compiled", compiled)):
        torch.manual_seed(0)  # the same draws (dropout, the infinity-former's sticky samples) in both runs
        memory, losses = model.empty_memory(BATCH), []
        for i, (x, how) in enumerate(zip(segs, plan)):
            if how.get("reload"):  # a checkpoint's memory, as a resume rebuilds it: new tensors, read from a file
                saved = io.BytesIO()
                torch.save(memory.state_dict(), saved)
                saved.seek(0)
                memory = type(memory).from_state_dict(torch.load(saved, weights_only=True))
            before = addresses(memory)
            ctx = torch._dynamo.config.patch(error_on_recompile=True) if name == "compiled" and i > 0 else _nothing()
            with ctx:
                loss, out = _step(model, x, memory, reset=how.get("reset", none), mask=how.get("mask", full))
            if name == "compiled":  # (eager on CPU, memorizing's memory grows while it fills: the test below)
                assert out is memory and addresses(memory) == before, (i, moved(before, addresses(memory)))
            memory.detach_()
            losses.append(loss)
        results[name] = (torch.stack(losses), {n: p.grad for n, p in model.named_parameters()})
    torch.testing.assert_close(results["compiled"][0], results["eager"][0], rtol=1e-5, atol=1e-5)
    for name, grad in results["eager"][1].items():
        got = results["compiled"][1][name]
        if grad is None:  # no path from the loss (memformer's write, whose slots are detached at each step's
            # end): AOTAutograd's backward gives every input that requires grad one, zeros here
            assert got is None or not got.any(), name
            continue
        torch.testing.assert_close(got, grad, rtol=1e-4, atol=1e-6, msg=name)


def addresses(memory) -> dict[str, int]:
    """Every tensor of a memory (nested states included) by name: its address. Memformer's slots
    carry their graph through a training step (a later segment's loss trains the write): that one
    field is a new tensor each step, by design (`memformer.MemformerKind.write`)."""
    out = {}
    for name, value, _ in memory._row_fields() if hasattr(memory, "_row_fields") else ():  # `none`: no tensor
        if isinstance(value, torch.Tensor) and not (type(memory).__name__ == "MemformerMemory" and name == "slots"):
            out[name] = value.data_ptr()
        elif hasattr(value, "_row_fields"):
            out.update({f"{name}.{k}": v for k, v in addresses(value).items()})
    return out


def moved(before: dict[str, int], after: dict[str, int]) -> list[str]:
    return [name for name in before if after.get(name) != before[name]]


@pytest.mark.parametrize("preset,settings", KINDS, ids=IDS)
def test_the_memory_keeps_its_addresses_through_steps_resets_padding_and_a_load(make_model, preset, settings,
                                                                               monkeypatch):
    """The state a CUDA graph replays over: written in place by every step (eager here; compiled in
    the test above), a reset, a padded row, and a checkpoint's memory loaded into it (`put_rows`)."""
    from memoria_ds.model.recurrent import memorizing

    monkeypatch.setattr(memorizing, "static_shapes", lambda device: True)  # as compiled or on a GPU
    model = _model(make_model, preset, settings)
    memory = model.empty_memory(BATCH)
    before = addresses(memory)
    padded = torch.ones(BATCH, LENGTH, dtype=torch.long)
    padded[0, LENGTH // 2:] = 0
    plan = [dict(), dict(), dict(reset=torch.tensor([True, False, False])), dict(mask=padded), dict(load=True),
            dict()]
    for x, how in zip(segments(BATCH, LENGTH, len(plan), seed=4), plan):
        if how.get("load"):
            saved = io.BytesIO()
            torch.save(memory.state_dict(), saved)
            saved.seek(0)
            memory.put_rows(list(range(BATCH)), type(memory).from_state_dict(torch.load(saved, weights_only=True)))
        _, out = _step(model, x, memory, reset=how.get("reset"), mask=how.get("mask"))
        out.detach_()
        assert out is memory and addresses(memory) == before, (how, moved(before, addresses(memory)))
    assert before or not model.memory_kind.carries_state


class _nothing:
    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False


@pytest.mark.parametrize("how", ["sdpa", "eager", "eager+upcast"])
def test_the_attention_that_hands_out_its_queries_computes_what_gpt2_attention_does(backbone_config, how):
    """Kinds that read a block's queries run its self-attention's steps themselves (a hook on `c_attn`
    is a graph break): the same output, keys/values handed to the cache, and `c_attn`'s queries."""
    from transformers.models.gpt2.modeling_gpt2 import GPT2Attention

    config = backbone_config.__class__.from_dict(backbone_config.to_dict())
    config._attn_implementation = how.split("+")[0]
    config.reorder_and_upcast_attn = how.endswith("upcast")
    torch.manual_seed(0)
    attn = GPT2Attention(config, layer_idx=1).train()  # train mode, dropout 0 (the tiny config's)
    B, L, M, H = 2, 5, 3, config.n_head
    hidden = torch.randn(B, L, config.n_embd)
    memory = [torch.randn(B, H, M, config.n_embd // H) for _ in range(2)]
    allowed = torch.ones(B, 1, L, M + L, dtype=torch.bool).tril(diagonal=M)
    allowed[1, :, :, 0] = False  # a cached slot of row 1 holds nothing
    additive = torch.zeros(allowed.shape).masked_fill(~allowed, torch.finfo(torch.float32).min)
    mask = allowed if how == "sdpa" else additive  # the form `self_attention_mask` gives each implementation
    want_kv, got_kv = ExtendedKeyValues(*memory, None), ExtendedKeyValues(*memory, None)
    want, _ = attn(hidden, attention_mask=mask, **{ATTENTION_CACHE: want_kv})
    got, queries = self_attention_with_queries(attn, hidden, mask, got_kv)
    torch.testing.assert_close(got, want, rtol=0, atol=0)
    for a, b in zip(got_kv.current, want_kv.current):
        torch.testing.assert_close(a, b, rtol=0, atol=0)
    q = attn.c_attn(hidden)[..., :config.n_embd].view(B, L, H, -1).transpose(1, 2)
    torch.testing.assert_close(queries, q, rtol=0, atol=0)
