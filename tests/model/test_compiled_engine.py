"""A model whose memory engine is compiled (`memory_compile`) trains and remembers as the eager one."""

from __future__ import annotations

import pytest
import torch
from model_helpers import run_stream, segments


def test_memory_compile_gives_the_eager_models_logits_memory_and_gradients(make_model):
    eager = make_model("memoria", memory_init="random").train()
    compiled = make_model("memoria", memory_init="random", memory_compile="default").train()
    compiled.load_state_dict(eager.state_dict())
    segs = segments(count=5)
    breaks = sum(torch._dynamo.utils.counters["graph_break"].values())
    outs_e, mem_e = run_stream(eager, segs, labels=None)
    outs_c, mem_c = run_stream(compiled, segs, labels=None)
    for i, (a, b) in enumerate(zip(outs_e, outs_c)):
        torch.testing.assert_close(b.logits, a.logits, rtol=1e-4, atol=1e-4, msg=f"segment {i}")
    assert torch.equal(mem_c.state.kind, mem_e.state.kind) and torch.equal(mem_c.state.uid, mem_e.state.uid)
    torch.testing.assert_close(mem_c.state.lifespan, mem_e.state.lifespan, rtol=1e-5, atol=1e-5)
    assert int(mem_e.state.step.min()) == 4 and int((mem_e.state.kind == 3).sum()) > 0  # the LTM was reached
    # the gradient through the working memory (the abstractor's) is the same
    outs_e[-1].logits.float().square().mean().backward()
    outs_c[-1].logits.float().square().mean().backward()
    for (name, p), q in zip(eager.named_parameters(), compiled.parameters()):
        if p.grad is not None:
            torch.testing.assert_close(q.grad, p.grad, rtol=1e-4, atol=1e-5, msg=name)
    kind = compiled.memory_kind
    assert kind.engine.compiled and kind.engine.fell_back is None
    assert sum(torch._dynamo.utils.counters["graph_break"].values()) == breaks, "the engine broke its graph"


def test_an_unknown_compile_mode_is_refused(make_model):
    with pytest.raises(Exception, match="`memory_compile` must be None or one of"):
        make_model("memoria", memory_compile="fastest")
