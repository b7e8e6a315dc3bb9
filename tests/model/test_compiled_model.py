"""The whole model compiled (`model.compile()`, what training's `model.compile` does).

Backbone, memory attention, abstractor and memory engine trace as one graph per forward
(`fullgraph=True` raises on any graph break), from a fresh memory (`memory=None`) through
resets, and compute what the eager model computes: the same losses, gradients and memory.
"""

from __future__ import annotations

import pytest
import torch
from model_helpers import segments

from memoria_ds.memory.state import vector_digest


def _stream(model, segs, resets):
    """Train-style calls: shift_labels, a reset mask per segment, backward per segment."""
    memory, losses = None, []
    for x, reset in zip(segs, resets):
        out = model(input_ids=x, shift_labels=torch.roll(x, -1, dims=1), memory=memory, reset=reset)
        out.loss.backward()
        losses.append(out.loss.detach())
        memory = out.memory
    return torch.stack(losses), memory


def _tensors(tree, prefix=""):
    """The tensors of a nested state dict, by dotted name."""
    if isinstance(tree, torch.Tensor):
        return {prefix: tree}
    if isinstance(tree, dict):
        return {k: v for key, sub in tree.items() for k, v in _tensors(sub, f"{prefix}.{key}").items()}
    return {}


@pytest.mark.parametrize("preset", ["memoria", "xl"])
def test_the_whole_model_compiles_as_one_graph_and_computes_what_the_eager_model_does(make_model, preset):
    eager = make_model(preset, memory_init="random").train()  # dropout 0: the same arithmetic in both
    compiled = make_model(preset, memory_init="random").train()
    compiled.load_state_dict(eager.state_dict())
    compiled.compile(fullgraph=True, dynamic=False)  # a graph break is an error
    segs = segments(count=6)
    resets = [None, None, torch.tensor([False, True, False]), None, torch.tensor([True, False, False]), None]

    losses_e, mem_e = _stream(eager, segs, resets)
    losses_c, mem_c = _stream(compiled, segs, resets)

    torch.testing.assert_close(losses_c, losses_e, rtol=1e-5, atol=1e-5)
    for (name, p), q in zip(eager.named_parameters(), compiled.parameters()):
        torch.testing.assert_close(q.grad, p.grad, rtol=1e-4, atol=1e-6, msg=name)
    # the memory carried out of the last segment: integers and flags exactly, floats closely;
    # the digest is a function of each engram's exact bits, so it is checked against its vectors
    saved_c, saved_e = _tensors(mem_c.state_dict()), _tensors(mem_e.state_dict())
    digests = saved_c.pop(".state.digest", None), saved_e.pop(".state.digest", None)
    torch.testing.assert_close(saved_c, saved_e, rtol=1e-5, atol=1e-5)
    if preset == "memoria":
        assert torch.equal(digests[0], vector_digest(mem_c.state.vectors))
        assert int((mem_e.state.kind == 3).sum()) > 0  # the long-term memory was reached


def test_the_memory_settings_are_parsed_when_the_model_is_built(make_model):
    """A compiled forward cannot trace the settings' dataclass parsing: it must be done already."""
    model = make_model("memoria")
    kind = model.__dict__.get("_memory_kind")
    assert kind is not None and kind.settings is kind._parsed[1]
    model.config.memoria = dict(model.config.memoria, num_wm=5)  # a changed setting is parsed again
    assert model.memory_kind.settings.num_wm == 5


def test_a_memory_made_outside_the_graph_is_marked_static_and_computes_the_same(make_model):
    # CUDA graph trees capture in-place updates of an input only at a static address (an
    # H200 run skipped the graphs: "mutated inputs"); a memory made eagerly (`empty_memory`,
    # a resumed checkpoint) is marked, and the compiled model computes the same from it
    from memoria_ds.model.recurrent.memoria import MemoriaMemory

    torch._dynamo.reset()  # the tests above spent most of the forward's recompile limit (8)
    eager = make_model("memoria", memory_init="random").train()
    compiled = make_model("memoria", memory_init="random").train()
    compiled.load_state_dict(eager.state_dict())
    compiled.compile(fullgraph=True, dynamic=False)
    segs = segments(count=3)
    start = eager.empty_memory(3)
    resumed = MemoriaMemory.from_state_dict(start.state_dict())
    for memory in (start, resumed):
        tensors = [memory.prev_hidden, memory.prev_mask, *memory.state.tensors().values()]
        assert all(getattr(t, "_dynamo_static_input_type", None) for t in tensors)

    def run(model, memory):
        losses = []
        for x in segs:
            out = model(input_ids=x, shift_labels=torch.roll(x, -1, dims=1), memory=memory)
            out.loss.backward()
            losses.append(out.loss.detach())
            memory = out.memory
        return torch.stack(losses), memory

    losses_e, mem_e = run(eager, eager.empty_memory(3))
    losses_c, mem_c = run(compiled, resumed)
    torch.testing.assert_close(losses_c, losses_e, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(mem_c.state.lifespan, mem_e.state.lifespan, rtol=1e-5, atol=1e-5)
    assert torch.equal(mem_c.state.counts, mem_e.state.counts)
