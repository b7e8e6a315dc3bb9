"""Perplexity under the `paper` and `full` protocols against hand computations."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from known_models import BigramLM, CountingMemoryLM, UnigramLM

from memoria_ds.data import ResetPolicy, TokenCorpus
from memoria_ds.eval import (
    EvalProtocol,
    MemorylessLM,
    evaluate_lm,
    evaluate_protocols,
    expected_scored_tokens,
    full_protocol,
    paper_protocol,
    read_results,
    token_nll,
)

DOC_LENGTHS = [13, 7, 20, 1, 9]
V = 5


def corpus(doc_lengths=DOC_LENGTHS, vocab=V, seed=0, **meta) -> TokenCorpus:
    rng = np.random.default_rng(seed)
    docs = [rng.integers(0, vocab, n).tolist() for n in doc_lengths]
    return TokenCorpus.from_token_lists(docs, metadata={"corpus": "toy", "split": "test", **meta})


P = torch.tensor([0.1, 0.15, 0.2, 0.25, 0.3], dtype=torch.float64)


@pytest.mark.parametrize("num_streams", [1, 2, 3, 5])
@pytest.mark.parametrize("seg", [4, 6])
def test_full_protocol_unigram_equals_hand_computation(num_streams: int, seg: int) -> None:
    c = corpus()
    t = np.asarray(c.tokens, dtype=np.int64)
    result = evaluate_lm(UnigramLM(P.float()), c, full_protocol(seg, num_streams), progress=False)
    expected = -np.log(P.numpy()[t[1:]]).sum()  # every token but the first, whatever the streams
    assert result.scored_tokens == t.size - 1 == expected_scored_tokens(c, full_protocol(seg, num_streams))
    assert result.nll_sum == pytest.approx(expected, rel=1e-6)
    assert result.ppl == pytest.approx(math.exp(expected / (t.size - 1)), rel=1e-6)
    assert result.protocol["num_streams"] == num_streams and result.protocol["score_segment_first"]


@pytest.mark.parametrize("seg", [4, 6, 50, 54])
def test_paper_protocol_unigram_skips_every_segment_first_token(seg: int) -> None:
    c = corpus()
    t = np.asarray(c.tokens, dtype=np.int64)
    result = evaluate_lm(UnigramLM(P.float()), c, paper_protocol(seg), progress=False)
    scored = [j for j in range(1, t.size) if j % seg != 0]  # HF's shift: a segment's first token is never a label
    assert result.scored_tokens == len(scored) == t.size - math.ceil(t.size / seg)
    assert result.scored_tokens == expected_scored_tokens(c, paper_protocol(seg))
    assert result.nll_sum == pytest.approx(-np.log(P.numpy()[t[scored]]).sum(), rel=1e-6)
    assert result.protocol["name"] == "paper" and result.protocol["scored_per_full_segment"] == seg - 1


@pytest.mark.parametrize("protocol", [full_protocol(4, 1), full_protocol(5, 3), paper_protocol(4)])
def test_bigram_targets_are_aligned(protocol: EvalProtocol) -> None:
    c = corpus(seed=1)
    t = np.asarray(c.tokens, dtype=np.int64)
    table = torch.rand(V, V, generator=torch.Generator().manual_seed(0), dtype=torch.float64) + 0.1
    table = table / table.sum(1, keepdim=True)
    result = evaluate_lm(BigramLM(table.float()), c, protocol, progress=False)
    pairs = [(i, i + 1) for i in range(t.size - 1)]
    if not protocol.score_segment_first:
        pairs = [(i, j) for i, j in pairs if j % protocol.segment_length != 0]
    expected = -sum(math.log(table[t[i], t[j]]) for i, j in pairs)
    assert result.scored_tokens == len(pairs)
    assert result.nll_sum == pytest.approx(expected, rel=1e-6)


# Documents of 7, 5 and 9 tokens (N = 21), segments of 4: the documents start at 0, 7, 12.
# One stream: segment t starts at 4t; doc_start is set when a document began since the
# previous segment's first token: steps 0 (start), 2 (doc 1 began at 7), 3 (doc 2 at 12).
HAND_K = {
    "never": [0, 1, 2, 3, 4, 5],
    "document_start": [0, 1, 0, 0, 1, 2],
    "every:2": [0, 1, 0, 1, 0, 1],
    "document_start+every:2": [0, 1, 0, 0, 0, 1],
}


@pytest.mark.parametrize("policy", sorted(HAND_K))
def test_memory_is_carried_and_reset_per_policy(policy: str) -> None:
    c = corpus([7, 5, 9], seed=2)
    t = np.asarray(c.tokens, dtype=np.int64)
    model = CountingMemoryLM(torch.tensor([0.3, -0.2, 0.5, 0.0, -0.4]))
    result = evaluate_lm(model, c, full_protocol(4, 1, policy), progress=False)
    expected = 0.0
    for step, k in enumerate(HAND_K[policy]):
        lp = model.log_probs(k).double()
        targets = [j for j in range(4 * step + 1, 4 * step + 5) if j < t.size]
        expected -= sum(float(lp[t[j]]) for j in targets)
    assert result.scored_tokens == 20
    assert result.nll_sum == pytest.approx(expected, rel=1e-6)
    # The memory handed in at step s is exactly what step s - 1 returned.
    ks = HAND_K[policy]
    assert model.calls[0][0] is None
    for step in range(1, len(ks)):
        assert model.calls[step][0].tolist() == [ks[step - 1] + 1]
    assert result.protocol["reset"]["policy"] == policy


def test_memory_reset_is_per_row_over_several_streams() -> None:
    # N = 21 over 2 streams: [0, 11) and [11, 21); steps start at 0/4/8 and 11/15/19.
    c = corpus([7, 5, 9], seed=3)
    t = np.asarray(c.tokens, dtype=np.int64)
    model = CountingMemoryLM(torch.tensor([0.3, -0.2, 0.5, 0.0, -0.4]))
    result = evaluate_lm(model, c, full_protocol(4, 2, "document_start"), progress=False)
    k = {0: [0, 1, 0], 1: [0, 0, 1]}  # row 0: docs 0,0,1 at 0/4/8; row 1: docs 1,2,2 at 11/15/19
    starts = {0: 0, 1: 11}
    ends = {0: 11, 1: 21}
    expected = 0.0
    for row in (0, 1):
        for step in range(3):
            lp = model.log_probs(k[row][step]).double()
            positions = range(starts[row] + 4 * step, min(starts[row] + 4 * step + 4, ends[row]))
            expected -= sum(float(lp[t[p + 1]]) for p in positions if p + 1 < t.size)
    assert result.scored_tokens == 20
    assert result.nll_sum == pytest.approx(expected, rel=1e-6)
    assert [r.tolist() for _, r in model.calls] == [[True, True], [False, True], [True, False]]


def test_paper_protocol_equals_hf_label_shift(tiny_gpt2_config) -> None:
    from transformers import GPT2LMHeadModel

    hf = GPT2LMHeadModel(tiny_gpt2_config).eval()
    c = corpus([60, 45, 52], vocab=tiny_gpt2_config.vocab_size, seed=4)
    seg = 16
    t = torch.as_tensor(np.asarray(c.tokens, dtype=np.int64))
    total, count = 0.0, 0
    with torch.no_grad():
        for start in range(0, t.numel(), seg):
            chunk = t[start : start + seg][None]
            if chunk.shape[1] < 2:
                continue
            loss = hf(input_ids=chunk, labels=chunk).loss  # HF's own shift and mean
            total += float(loss) * (chunk.shape[1] - 1)
            count += chunk.shape[1] - 1
    result = evaluate_lm(MemorylessLM(hf), c, paper_protocol(seg), progress=False)
    assert result.scored_tokens == count
    assert result.nll_sum == pytest.approx(total, rel=1e-5)


def test_token_nll_in_float32_from_low_precision_logits() -> None:
    logits = torch.randn(2, 3, 7).to(torch.bfloat16)
    targets = torch.tensor([[1, -100, 6], [0, 2, -100]])
    nll, mask = token_nll(logits, targets)
    ref = -torch.log_softmax(logits.float(), -1)[mask].gather(1, targets[mask][:, None]).squeeze(1)
    assert nll.dtype == torch.float32 and torch.equal(nll, ref) and mask.sum() == 4
    with pytest.raises(ValueError, match="outside the model's vocabulary"):
        token_nll(logits, torch.tensor([[7, 0, 0], [0, 0, 0]]))


def test_character_corpus_reports_bpc_and_token_corpus_does_not() -> None:
    chars = corpus(unit="character")
    r = evaluate_lm(UnigramLM(P.float()), chars, full_protocol(8), progress=False)
    assert r.bpc == pytest.approx(r.nll_sum / r.scored_tokens / math.log(2), rel=1e-12)
    assert r.bits_per_token == pytest.approx(r.bpc)
    assert evaluate_lm(UnigramLM(P.float()), corpus(), full_protocol(8), progress=False).bpc is None


def test_results_are_json_with_protocol_and_counts(tmp_path) -> None:
    c = corpus()
    path = tmp_path / "out" / "results.json"
    results = evaluate_protocols(UnigramLM(P.float()), c, ("paper", "full"), segment_length=6,
                                 model_name="unigram", output_path=str(path), progress=False)
    back = read_results(path)
    assert [r.protocol["name"] for r in back] == ["paper", "full"]
    for r, b in zip(results, back):
        assert b == r
        assert b.model == "unigram" and b.split == "test" and b.data["num_tokens"] == c.num_tokens
        assert b.input_tokens == c.num_tokens and b.tokens_per_s > 0 and b.wall_time_s > 0
        assert {"segment_length", "num_streams", "reset", "score_segment_first"} <= set(b.protocol)
    assert back[1].scored_tokens - back[0].scored_tokens == math.ceil(c.num_tokens / 6) - 1


def test_protocols_say_what_they_promise() -> None:
    with pytest.raises(ValueError, match="one stream, no resets"):
        EvalProtocol("paper", 150, 2, ResetPolicy(), score_segment_first=False)
    with pytest.raises(ValueError, match="custom"):
        EvalProtocol("full", 150, 1, ResetPolicy(), score_segment_first=False)
    with pytest.raises(ValueError, match="multiple of 2"):
        evaluate_lm(UnigramLM(P.float()), corpus(), full_protocol(4, 3), rank=0, world_size=2, progress=False)


def test_step_limit_and_training_mode_are_honoured() -> None:
    model = UnigramLM(P.float()).train()
    r = evaluate_lm(model, corpus(), full_protocol(4), max_steps=2, progress=False)
    assert model.training and r.steps == 2 and r.scored_tokens == 8 and "stopped after 2" in r.notes[0]


@pytest.mark.parametrize("num_streams", [2, 3, 7])
def test_custom_protocol_without_segment_first_tokens_over_several_streams(num_streams: int) -> None:
    c = corpus(seed=5)
    t = np.asarray(c.tokens, dtype=np.int64)
    seg = 4
    protocol = EvalProtocol("custom", seg, num_streams, ResetPolicy(), score_segment_first=False)
    r = evaluate_lm(UnigramLM(P.float()), c, protocol, progress=False)
    n, q, rem = t.size, t.size // num_streams, t.size % num_streams
    starts = [s * q + min(s, rem) for s in range(num_streams + 1)]
    positions = [p for s in range(num_streams) for p in range(starts[s], starts[s + 1])
                 if p + 1 < n and (p - starts[s]) % seg != seg - 1]  # a segment's last position is masked
    assert r.scored_tokens == len(positions) == expected_scored_tokens(c, protocol)
    assert r.nll_sum == pytest.approx(-np.log(P.numpy()[t[np.array(positions) + 1]]).sum(), rel=1e-6)
