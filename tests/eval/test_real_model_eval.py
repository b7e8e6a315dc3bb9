"""The evaluation drives the project's real models (memoria_ds.model) through Contract 2."""

from __future__ import annotations

import pytest
import torch
from transformers import GPT2LMHeadModel

from memoria_ds.data import TokenCorpus
from memoria_ds.eval import MemorylessLM, evaluate_lm, full_protocol, paper_protocol
from memoria_ds.model import build_model

SMALL_MEMORY = dict(num_wm=4, num_stm_reminded=4, num_ltm_reminded=4, stm_capacity=8, initial_lifespan=3.0,
                    search_depth=2)


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    from transformers import GPT2Config

    torch.manual_seed(0)
    cfg = GPT2Config(vocab_size=257, n_positions=256, n_embd=64, n_layer=2, n_head=4,
                     resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)
    path = tmp_path_factory.mktemp("backbone")
    GPT2LMHeadModel(cfg).save_pretrained(path)
    g = torch.Generator().manual_seed(1)
    docs = [torch.randint(0, 257, (n,), generator=g).tolist() for n in (70, 33, 90)]
    corpus = TokenCorpus.from_token_lists(docs, metadata={"corpus": "toy", "split": "test"})
    return path, corpus, MemorylessLM(GPT2LMHeadModel.from_pretrained(path))


@pytest.mark.parametrize("protocol", [paper_protocol(16), full_protocol(16, 2, "document_start")])
def test_fresh_memoria_scores_like_its_backbone(setup, protocol) -> None:
    # Bolted on with the no-op init, Memoria must not change a single logit (SPEC 2), so
    # the evaluation of the memory model and of the bare backbone agree.
    path, corpus, backbone = setup
    memoria = build_model(path, "memoria", memoria=SMALL_MEMORY)
    got = evaluate_lm(memoria, corpus, protocol, progress=False)
    ref = evaluate_lm(backbone, corpus, protocol, progress=False)
    assert got.scored_tokens == ref.scored_tokens
    assert got.nll_sum == pytest.approx(ref.nll_sum, rel=1e-5)


def test_xl_memory_is_used_and_reset(setup) -> None:
    path, corpus, backbone = setup
    xl = build_model(path, "xl")
    carried = evaluate_lm(xl, corpus, full_protocol(16, 1), progress=False)
    reset_always = evaluate_lm(xl, corpus, full_protocol(16, 1, "every:1"), progress=False)
    plain = evaluate_lm(backbone, corpus, full_protocol(16, 1), progress=False)
    assert reset_always.nll_sum == pytest.approx(plain.nll_sum, rel=1e-5), "reset before every segment = no memory"
    assert abs(carried.nll_sum - plain.nll_sum) > 1e-3, "the carried cache changes the predictions"


@pytest.mark.parametrize("preset", ["memoria", "xl"])
def test_evaluation_starts_from_a_snapshot(setup, tmp_path, preset) -> None:
    """Read a text, save its memory, score the next text from it (issue 18 item 3): the result
    equals the model fed by hand from that memory, and differs from an empty start."""
    from memoria_ds.model import load_snapshot, read, save_snapshot

    path, corpus, _ = setup
    torch.manual_seed(3)
    model = build_model(path, preset, memory_init="random", memoria=SMALL_MEMORY).eval()
    with torch.no_grad():  # a memory that visibly moves the scores (random init keeps it small)
        for name, p in model.named_parameters():
            if "memory_attention.out_proj" in name:
                p.normal_(0.0, 0.5)
    prefix = torch.randint(0, 257, (1, 48), generator=torch.Generator().manual_seed(5))
    with torch.no_grad():
        memory = read(model, prefix, segment_length=16)
    save_snapshot(tmp_path / "book.safetensors", model, memory, stream_ids=[0])

    protocol = paper_protocol(16)
    start = evaluate_lm(model, corpus, protocol, progress=False,
                        memory_for=lambda ids: load_snapshot(tmp_path / "book.safetensors", model, stream_ids=ids).memory)
    empty = evaluate_lm(model, corpus, protocol, progress=False)
    assert "started from a given memory (not an empty one)" in start.notes
    assert abs(start.nll_sum - empty.nll_sum) > 1e-3, "the snapshot's memory changed nothing"

    # by hand: the corpus as one stream of 16-token segments, scored as `paper` does (not the
    # last target of a segment), starting from the snapshot's memory, never reset
    tokens = torch.tensor(corpus.tokens.tolist())[None]  # (1, N): the one stream of `paper`
    mem, total, scored = load_snapshot(tmp_path / "book.safetensors", model).memory, 0.0, 0
    with torch.no_grad():
        for s in range(0, tokens.shape[1] - 1, 16):
            x, y = tokens[:, s:s + 16], tokens[:, s + 1:s + 17]
            out = model(input_ids=x, memory=mem)
            mem = out.memory
            n = min(y.shape[1], 15)  # `paper` never scores a segment's last target
            logp = torch.log_softmax(out.logits[0, :n].float(), -1)
            total -= float(logp.gather(1, y[0, :n, None]).sum())
            scored += n
    assert start.scored_tokens == scored
    assert start.nll_sum == pytest.approx(total, rel=1e-5)
