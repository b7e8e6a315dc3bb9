"""The `memoryless` protocol and the memory gain (`memoria_ds.eval.gain`): hand-computed values
with a model whose memory is known, and a real Memoria GPT-2 against a per-segment reference."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from known_models import CountingMemoryLM
from transformers import GPT2Config, GPT2LMHeadModel

from memoria_ds.data import ResetPolicy, TokenCorpus
from memoria_ds.eval import (EvalProtocol, MemorylessLM, evaluate_lm, expected_scored_tokens, full_protocol,
                             memory_gain, memoryless_protocol, protocol_from_name)
from memoria_ds.model import build_model

W = torch.tensor([0.3, -0.2, 0.5, 0.0, -0.4])


def toy(doc_lengths=(7, 5, 9), seed=2) -> TokenCorpus:
    rng = np.random.default_rng(seed)
    return TokenCorpus.from_token_lists([rng.integers(0, 5, n).tolist() for n in doc_lengths],
                                        metadata={"corpus": "toy", "split": "test"})


@pytest.mark.parametrize("num_streams", [1, 2, 3])
def test_memoryless_scores_every_token_with_an_empty_memory(num_streams: int) -> None:
    # CountingMemoryLM predicts softmax(k * w) with k the segments since the row's last reset:
    # without memory every segment of every stream has k = 0
    c = toy()
    t = np.asarray(c.tokens, dtype=np.int64)
    model = CountingMemoryLM(W)
    got = evaluate_lm(model, c, memoryless_protocol(4, num_streams), progress=False)
    lp = model.log_probs(0).double().numpy()
    assert got.scored_tokens == t.size - 1 == expected_scored_tokens(c, memoryless_protocol(4, num_streams))
    assert got.nll_sum == pytest.approx(-lp[t[1:]].sum(), rel=1e-6)
    assert all(bool(reset.all()) for _, reset in model.calls), "every row is reset before every segment"
    assert got.protocol["name"] == "memoryless" and got.protocol["reset"]["policy"] == "every:1"


def test_the_gain_is_the_difference_of_the_two_protocols() -> None:
    c = toy()
    t = np.asarray(c.tokens, dtype=np.int64)
    full = evaluate_lm(CountingMemoryLM(W), c, full_protocol(4, 1), progress=False)
    bare = evaluate_lm(CountingMemoryLM(W), c, protocol_from_name("memoryless", 4, 1, "document_start"),
                       progress=False)  # `reset` does not apply to `memoryless`
    # by hand: segment s of the one stream has k = s with the memory, 0 without
    with_memory = -sum(float(CountingMemoryLM(W).log_probs(j // 4).double()[t[j + 1]]) for j in range(t.size - 1))
    without = -sum(float(CountingMemoryLM(W).log_probs(0).double()[t[j + 1]]) for j in range(t.size - 1))
    gain = memory_gain([full, bare])
    assert gain.nats_per_token == pytest.approx((without - with_memory) / (t.size - 1), rel=1e-6)
    assert gain.ppl_with == full.ppl and gain.ppl_without == bare.ppl and gain.scored_tokens == t.size - 1
    assert gain.ppl_change == pytest.approx(full.ppl / bare.ppl - 1, rel=1e-9)
    assert memory_gain([bare.to_dict(), full.to_dict()]) == gain  # from the results' JSON dicts too
    assert gain.scalars() == {"nats_per_token": gain.nats_per_token, "ppl_without": bare.ppl}
    assert gain.describe().startswith(f"memory gain test: {gain.nats_per_token:+.4f} nats/token (ppl ")
    assert memory_gain([full]) is None and memory_gain([bare]) is None


def test_a_gain_over_different_tokens_is_refused() -> None:
    c = toy()
    full = evaluate_lm(CountingMemoryLM(W), c, full_protocol(4, 1), progress=False)
    fewer = evaluate_lm(CountingMemoryLM(W), c, memoryless_protocol(4, 1), max_steps=2, progress=False)
    other = evaluate_lm(CountingMemoryLM(W), c, memoryless_protocol(4, 3), progress=False)  # same count, 3 streams
    for bare in (fewer, other):
        with pytest.raises(ValueError, match="scored different tokens"):
            memory_gain([full, bare])


def test_memoryless_says_what_it_promises() -> None:
    with pytest.raises(ValueError, match="resets the memory before every segment"):
        EvalProtocol("memoryless", 16, 1, ResetPolicy(every_n_steps=2))
    with pytest.raises(ValueError, match="scores every token"):
        EvalProtocol("memoryless", 16, 1, ResetPolicy(every_n_steps=1), score_segment_first=False)
    with pytest.raises(ValueError, match="use one of full, paper, memoryless"):
        protocol_from_name("none", 16)


@pytest.fixture(scope="module")
def gpt2(tmp_path_factory):
    torch.manual_seed(0)
    cfg = GPT2Config(vocab_size=97, n_positions=64, n_embd=32, n_layer=2, n_head=4,
                     resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)
    path = tmp_path_factory.mktemp("backbone")
    backbone = GPT2LMHeadModel(cfg)
    torch.nn.init.normal_(backbone.transformer.wte.weight, std=1.0)  # peaked predictions, so that changes show
    backbone.save_pretrained(path)
    g = torch.Generator().manual_seed(1)
    docs = [torch.randint(0, 97, (n,), generator=g).tolist() for n in (50, 31, 60)]
    return path, TokenCorpus.from_token_lists(docs, metadata={"corpus": "toy", "split": "test"})


def per_segment_reference(model, tokens: torch.Tensor, seg: int) -> float:
    """Summed NLL of one stream read segment by segment, each from an empty memory."""
    total = 0.0
    with torch.no_grad():
        for lo in range(0, tokens.numel() - 1, seg):
            x = tokens[lo: lo + seg]
            targets = tokens[lo + 1: lo + seg + 1]  # the segment's last position predicts the next one's first
            logits = model(input_ids=x[None]).logits[0, : targets.numel()].double()
            total += float(torch.nn.functional.cross_entropy(logits, targets, reduction="sum"))
    return total


@pytest.mark.parametrize("preset", ["memoria", "xl"])
def test_a_real_memory_model_without_its_memory(gpt2, preset) -> None:
    path, corpus = gpt2
    settings = {"memoria": dict(num_wm=4, num_stm_reminded=4, num_ltm_reminded=4, stm_capacity=8,
                                search_depth=2)} if preset == "memoria" else {}
    model = build_model(path, preset, **settings).eval()
    torch.manual_seed(3)
    with torch.no_grad():  # a memory that matters: the memory modules' weights made large (the no-op init's are 0)
        for name, param in model.named_parameters():
            if name.startswith(("memory_blocks.", "abstractor.")) and param.dim() > 1:
                param.normal_(std=0.5)
    tokens = torch.as_tensor(np.asarray(corpus.tokens, dtype=np.int64))
    bare = evaluate_lm(model, corpus, memoryless_protocol(16, 1), progress=False)
    assert bare.nll_sum == pytest.approx(per_segment_reference(model, tokens, 16), rel=1e-5)
    full = evaluate_lm(model, corpus, full_protocol(16, 1), progress=False)
    assert abs(memory_gain([full, bare]).nats_per_token) > 1e-4, "the carried memory changes the predictions"


def test_a_model_without_memory_gains_exactly_nothing(gpt2) -> None:
    path, corpus = gpt2
    plain = MemorylessLM(GPT2LMHeadModel.from_pretrained(path)).eval()
    gain = memory_gain([evaluate_lm(plain, corpus, p, progress=False)
                        for p in (full_protocol(16, 2), memoryless_protocol(16, 2))])
    assert gain.nats_per_token == 0.0 and math.isclose(gain.ppl_with, gain.ppl_without)
