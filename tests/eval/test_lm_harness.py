"""lm-evaluation-harness: the `memoria_ds` model class on a tiny local task, through lm-eval itself.

The tiny models have GPT-2's real tokenizer (shipped offline) and random memory weights, so
the memory changes the scores; each check has an independent reference: a plain HF
`GPT2LMHeadModel` with the same weights, or the model called segment by segment by hand.
"""

from __future__ import annotations

import json
import math
import subprocess
import sys

import pytest
import torch

lm_eval = pytest.importorskip("lm_eval")

from memoria_ds.data import load_tokenizer  # noqa: E402
from memoria_ds.eval.lm_harness import MemoriaLM  # noqa: E402 (registers `memoria_ds`)
from memoria_ds.model import build_model  # noqa: E402

BOOKS = [
    "Alice was beginning to get very tired of sitting by her sister on the bank, and of having nothing to do: "
    "once or twice she had peeped into the book her sister was reading, but it had no pictures or conversations "
    "in it, and what is the use of a book, thought Alice, without pictures or conversations?",
    "So she was considering in her own mind (as well as she could, for the hot day made her feel very sleepy and "
    "stupid), whether the pleasure of making a daisy-chain would be worth the trouble of getting up and picking "
    "the daisies, when suddenly a White Rabbit with pink eyes ran close by her.",
]
MEMORY = {"num_wm": 2, "num_stm_reminded": 2, "num_ltm_reminded": 2, "stm_capacity": 8}


def _export(tmp_path, preset: str):
    from transformers import GPT2Config

    backbone = GPT2Config(vocab_size=50257, n_positions=64, n_embd=32, n_layer=2, n_head=2, resid_pdrop=0.0,
                          embd_pdrop=0.0, attn_pdrop=0.0)
    torch.manual_seed(0)
    extra = {"memoria": MEMORY} if preset.startswith("memoria") else {}
    model = build_model(backbone, preset, memory_init="random", segment_length=16, **extra).eval()
    with torch.no_grad():  # a memory that visibly moves the scores (random init keeps it small)
        for name, p in model.named_parameters():
            if "memory_attention.out_proj" in name:
                p.normal_(0.0, 0.5)
    path = tmp_path / preset
    model.save_pretrained(path)
    load_tokenizer("gpt2").save_pretrained(path)
    return path, model


def _by_hand(model, tokens: list[int], S: int, carry: bool = True) -> float:
    """Sum of log p(token j+1 | ...) fed segment by segment, the memory carried (or not)."""
    x = torch.tensor([tokens])
    total, memory = 0.0, None
    with torch.no_grad():
        for s in range(0, len(tokens) - 1, S):
            out = model(input_ids=x[:, s:s + S][:, : len(tokens) - 1 - s], memory=memory if carry else None)
            memory = out.memory
            y = x[0, s + 1:s + 1 + out.logits.shape[1]]
            total += float(torch.log_softmax(out.logits[0].float(), -1).gather(1, y[:, None]).sum())
    return total


class _Req:
    def __init__(self, *args):
        self.args = args


def test_rolling_loglikelihood_carries_the_memory_within_a_document_and_resets_between(tmp_path):
    path, model = _export(tmp_path, "memoria")
    lm = MemoriaLM(pretrained=str(path), device="cpu")
    assert lm.segment_length == 16  # the model's own
    tokens = [lm.eot_token_id] + lm.tok_encode(BOOKS[0])
    assert len(tokens) > 3 * 16, "the document must span several segments"
    got = lm.loglikelihood_rolling([_Req(BOOKS[0])], disable_tqdm=True)[0]
    assert got == pytest.approx(_by_hand(model, tokens, 16), abs=1e-3)
    assert abs(got - _by_hand(model, tokens, 16, carry=False)) > 1e-2, "the memory made no difference"
    # documents do not see each other: the second scores the same alone and after the first
    both = lm.loglikelihood_rolling([_Req(BOOKS[0]), _Req(BOOKS[1])], disable_tqdm=True)
    alone = lm.loglikelihood_rolling([_Req(BOOKS[1])], disable_tqdm=True)
    assert both[1] == pytest.approx(alone[0], abs=1e-6)


def test_without_memory_the_scores_equal_plain_gpt2(tmp_path):
    """`transformer` in one segment is the HF backbone: lm-eval's own `hf` scoring logic gives
    the same log-likelihoods (context + continuation, and rolling)."""
    from transformers import GPT2LMHeadModel

    path, model = _export(tmp_path, "transformer")
    lm = MemoriaLM(pretrained=str(path), device="cpu", segment_length=64)
    plain = GPT2LMHeadModel(_plain_config(model.config)).eval()
    plain.transformer.load_state_dict(model.transformer.state_dict())
    plain.lm_head.weight = plain.transformer.wte.weight
    context, continuation = "Alice was beginning to get very tired of", " sitting by her sister"
    ctx, cont = lm._encode_pair(context, continuation)
    ids = torch.tensor([ctx + cont])
    with torch.no_grad():
        logp = torch.log_softmax(plain(ids).logits[0].float(), -1)
    expected = float(sum(logp[len(ctx) - 1 + i, t] for i, t in enumerate(cont)))
    (got, greedy), = lm.loglikelihood([_Req(context, continuation)], disable_tqdm=True)
    assert got == pytest.approx(expected, abs=1e-4)
    assert greedy == all(int(logp[len(ctx) - 1 + i].argmax()) == t for i, t in enumerate(cont))


def _plain_config(config):
    from transformers import GPT2Config

    keep = ("vocab_size", "n_positions", "n_embd", "n_layer", "n_head", "layer_norm_epsilon", "activation_function")
    return GPT2Config(**{k: getattr(config, k) for k in keep}, resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)


def _task(tmp_path) -> str:
    data = tmp_path / "books.jsonl"
    data.write_text("".join(json.dumps({"text": t}) + "\n" for t in BOOKS))
    tasks = tmp_path / "tasks"
    tasks.mkdir()
    (tasks / "tiny_books.yaml").write_text(f"""task: tiny_books
dataset_path: json
dataset_kwargs:
  data_files:
    test: {data}
test_split: test
output_type: loglikelihood_rolling
doc_to_text: ""
doc_to_target: "{{{{text}}}}"
metric_list:
  - metric: word_perplexity
  - metric: byte_perplexity
  - metric: bits_per_byte
""")
    return str(tasks)


@pytest.mark.slow
def test_simple_evaluate_runs_a_local_perplexity_task(tmp_path):
    from lm_eval.tasks import TaskManager

    path, model = _export(tmp_path, "memoria")
    results = lm_eval.simple_evaluate(model="memoria_ds", model_args=f"pretrained={path},device=cpu",
                                      tasks=["tiny_books"], task_manager=TaskManager(include_path=_task(tmp_path)))
    got = results["results"]["tiny_books"]
    lm = MemoriaLM(pretrained=str(path), device="cpu")
    ll = sum(_by_hand(model, [lm.eot_token_id] + lm.tok_encode(t), 16) for t in BOOKS)
    words = sum(len(t.split()) for t in BOOKS)  # lm-eval's wikitext-style word count: whitespace split
    assert got["word_perplexity,none"] == pytest.approx(math.exp(-ll / words), rel=1e-3)


def test_command_line_registers_the_model(tmp_path):
    path, _ = _export(tmp_path, "memoria_wm")
    out = tmp_path / "out"
    proc = subprocess.run(
        [sys.executable, "-m", "memoria_ds.eval.lm_harness", "run", "--model", "memoria_ds",
         "--model_args", f"pretrained={path}", "--device", "cpu", "--tasks", "tiny_books",
         "--include_path", _task(tmp_path),
         "--output_path", str(out)],
        capture_output=True, text=True, timeout=600,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "tiny_books" in proc.stdout and "word_perplexity" in proc.stdout
    assert list(out.rglob("results_*.json")), "lm-eval wrote no results file"


def test_a_misspelt_model_argument_is_refused(tmp_path):
    path, _ = _export(tmp_path, "memoria_wm")
    with pytest.raises(TypeError, match="segment_lenght"):
        MemoriaLM.create_from_arg_string(f"pretrained={path},segment_lenght=16", {"device": "cpu"})
    with pytest.raises(ValueError, match="segment_length 999 must be in"):
        MemoriaLM(pretrained=str(path), device="cpu", segment_length=999)
