"""launch/evaluate.py (issue 18 item 1): a saved model scored without training, one process or under the launcher."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys

import pytest
import torch
from transformers import GPT2Config, GPT2LMHeadModel

from memoria_ds.eval import read_results

from .launch_util import ROOT, check, free_port, run_training

EVALUATE = str(ROOT / "launch" / "evaluate.py")


def evaluate(*args: str, ranks: int = 1) -> subprocess.CompletedProcess:
    env = dict(os.environ, DS_ACCELERATOR="cpu", OMP_NUM_THREADS="1", HF_HUB_OFFLINE="1", HF_DATASETS_OFFLINE="1",
               PYTHONUNBUFFERED="1")
    for key in ("RANK", "LOCAL_RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT", "MEMORIA_DS_FAULT"):
        env.pop(key, None)
    if ranks == 1:
        cmd = [sys.executable, EVALUATE, *args]
    else:
        cmd = [shutil.which("deepspeed") or str(ROOT / ".venv" / "bin" / "deepspeed"), "--num_gpus", str(ranks),
               "--master_port", str(free_port()), EVALUATE, *args]
    return subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)


def test_a_run_is_scored_as_its_training_scored_it_on_one_or_two_ranks(tmp_path):
    run = tmp_path / "run"
    proc = check(run_training(run, "checkpoint.export=true", "eval.protocols=[full, paper, memoryless]",
                              "eval.max_steps=null"))
    trained = {r.protocol["name"]: r for r in map(read_results, sorted((run / "eval").glob("step_*.json")))
               for r in r}
    # the memory gain: memoryless minus full, in the summary and on the terminal
    gain = json.loads((run / "summary.json").read_text())["memory_gain"]
    assert gain["nats_per_token"] == trained["memoryless"].nll - trained["full"].nll != 0.0
    assert gain["scored_tokens"] == trained["full"].scored_tokens == trained["memoryless"].scored_tokens
    assert f"memory gain validation: {gain['nats_per_token']:+.4f} nats/token" in proc.stdout
    # the export's model card gives the run's settings and these numbers
    card = (run / "export" / "README.md").read_text()
    assert card.startswith("---\nlibrary_name: transformers") and "memory settings:" in card
    for name, r in trained.items():
        assert f"| validation | `{name}` | ppl {r.ppl:.3f} | {r.scored_tokens} |" in card
    assert f"worth to this model: memory gain validation: {gain['nats_per_token']:+.4f} nats/token" in card
    # a fresh process loads it with trust_remote_code=True, without importing memoria_ds first
    code = ("import sys, torch; from transformers import AutoModelForCausalLM; "
            f"m = AutoModelForCausalLM.from_pretrained({str(run / 'export')!r}, trust_remote_code=True); "
            "print(type(m).__name__, m(input_ids=torch.zeros(1, 4, dtype=torch.long)).logits.shape[-1])")
    loaded = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300,
                            env=dict(os.environ, HF_HUB_OFFLINE="1"), cwd=tmp_path)
    assert loaded.returncode == 0 and loaded.stdout.split()[-2:] == ["MemoriaGPT2LMHeadModel", "50257"], loaded.stderr
    proc = check(evaluate(str(run), "eval.protocols=[full, paper, memoryless]", "eval.trace=true"))
    assert "eval validation [full]: ppl" in proc.stdout and "results:" in proc.stdout
    assert f"memory gain validation: {gain['nats_per_token']:+.4f} nats/token" in proc.stdout
    for name in ("full", "paper", "memoryless"):
        (mine,) = read_results(run / "eval" / f"validation_{name}.json")
        assert mine.scored_tokens == trained[name].scored_tokens
        assert abs(mine.nll - trained[name].nll) < 1e-5, (name, mine.nll, trained[name].nll)
    assert (run / "eval" / "memory_validation_paper.safetensors").is_file()
    assert len((run / "eval" / "trace_validation_paper.jsonl").read_text().splitlines()) > 1

    # under the deepspeed launcher on 2 ranks: the full protocol's streams split over ranks, same totals
    # (2 streams where the run has 1: results named for those settings, the same on 1 and 2 ranks)
    out = tmp_path / "two"
    check(evaluate(str(run), "eval.protocols=[full]", "eval.num_streams=2", "--out", str(out), ranks=2))
    check(evaluate(str(run), "eval.protocols=[full]", "eval.num_streams=2", "--out", str(tmp_path / "one")))
    (named,) = [p.name for p in out.glob("validation_full*.json")]
    assert named.startswith("validation_full.num_streams-"), named
    (two,), (one,) = read_results(out / named), read_results(tmp_path / "one" / named)
    assert two.world_size == 2 and one.world_size == 1 and two.scored_tokens == one.scored_tokens
    assert abs(two.nll - one.nll) < 1e-5
    # `model.compile` applies to evaluation too (the whole model as compiled graphs): the same numbers
    proc = check(evaluate(str(run), "eval.protocols=[full]", "eval.num_streams=2", "model.compile=default", "--out",
                          str(tmp_path / "compiled")))
    assert "compiled in place (torch.compile, mode=default)" in proc.stdout
    (compiled,) = read_results(tmp_path / "compiled" / named)
    assert compiled.scored_tokens == one.scored_tokens and abs(compiled.nll - one.nll) < 1e-4, (compiled.nll, one.nll)


@pytest.mark.slow
def test_a_plain_causal_lm_is_scored_without_memory(tmp_path):
    torch.manual_seed(0)
    plain = tmp_path / "gpt2"
    GPT2LMHeadModel(GPT2Config(n_layer=1, n_embd=16, n_head=2, n_positions=64)).save_pretrained(plain)
    proc = check(evaluate(str(plain), "data.corpus=bundled", "data.segment_length=16", "eval.protocols=[paper]",
                          "eval.max_steps=4", "--out", str(tmp_path / "out")))
    (result,) = read_results(tmp_path / "out" / "validation_paper.json")
    assert result.scored_tokens == 4 * 15 and "eval validation [paper]" in proc.stdout
    assert json.loads((tmp_path / "out" / "validation_paper.json").read_text())


def test_mistakes_stop_before_any_work(tmp_path):
    for args, says in [
        ([str(tmp_path / "missing")], "does not exist"),
        ([str(tmp_path)], "neither a run directory"),
        ([str(ROOT / "launch"), "eval.protocols=[nope]"], "neither a run directory"),
    ]:
        proc = evaluate(*args)
        assert proc.returncode == 2 and says in proc.stderr, proc.stderr[-2000:]
    torch.manual_seed(0)
    plain = tmp_path / "plain"
    GPT2LMHeadModel(GPT2Config(n_layer=1, n_embd=16, n_head=2, n_positions=64)).save_pretrained(plain)
    (tmp_path / "file").write_text("x")
    for args, says in [
        ([str(plain), "eval.split=valid"], "`eval.split` 'valid' is not a split of `data.corpus: bundled`"),
        ([str(plain), "--out", str(tmp_path / "file")], "is a file; give a folder for the results"),
    ]:
        proc = evaluate(*args)
        assert proc.returncode == 2 and says in proc.stderr, proc.stderr[-2000:]
    run = tmp_path / "run"
    (run).mkdir()
    (run / "config.yaml").write_text("seed: 0\n")
    proc = evaluate(str(run))
    assert proc.returncode == 2 and "with neither an export/ nor a complete checkpoint" in proc.stderr

    # a saved model that cannot load is named before any data work, in one line
    torch.manual_seed(0)
    saved = tmp_path / "saved"
    GPT2LMHeadModel(GPT2Config(n_layer=1, n_embd=16, n_head=2, n_positions=64)).save_pretrained(saved)
    weights = saved / "model.safetensors"
    whole, config = weights.read_bytes(), (saved / "config.json").read_text()
    for damage, says in [
        (lambda: weights.write_bytes(whole[:-100]), "model.safetensors is not a complete safetensors file"),
        (lambda: weights.write_bytes(b"\x00" * 64), "model.safetensors is not a complete safetensors file"),
        (lambda: weights.unlink(), "holds no weights"),
        (lambda: (saved / "config.json").write_text(config[:-20]), "config.json cannot be read as JSON"),
    ]:
        weights.write_bytes(whole)
        (saved / "config.json").write_text(config)
        damage()
        proc = evaluate(str(saved), "data.corpus=bundled", "--out", str(tmp_path / "never"))
        assert proc.returncode == 2 and says in proc.stderr and "Traceback" not in proc.stderr, proc.stderr[-2000:]
        assert len([line for line in proc.stderr.splitlines() if line.strip()]) == 1, proc.stderr
        assert not (tmp_path / "never").exists()


def _poisoned(snapshot, how):
    """A copy of `snapshot` with all-NaN engrams, an engram kind of 99, or its memory given as a list."""
    from memoria_ds.safe_io import load_tree, save_tree

    tree = load_tree(snapshot)
    state = tree["memory"]["state"]
    if how == "nan":
        state["vectors"].fill_(float("nan"))
    elif how == "kind":
        state["kind"][0, 0] = 99
    else:
        tree["memory"] = [tree["memory"]]
    path = snapshot.with_name(f"{how}.safetensors")
    save_tree(tree, path)
    return path


@pytest.mark.slow
def test_evaluation_from_a_memory_snapshot(tmp_path):
    """`--memory SNAPSHOT`: the streams start from a saved memory (issue 18 item 3); another
    model's snapshot, a missing file, or a model without memory stop with exit 2."""
    from memoria_ds.model import build_model, read, save_snapshot

    torch.manual_seed(0)
    backbone = GPT2Config(vocab_size=50257, n_layer=1, n_embd=16, n_head=2, n_positions=64)
    memory = {"num_wm": 2, "num_stm_reminded": 2, "num_ltm_reminded": 2, "stm_capacity": 8}
    model = build_model(backbone, "memoria", memory_init="random", memoria=memory).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "memory_attention.out_proj" in name:
                p.normal_(0.0, 0.5)  # a memory that visibly moves the scores
        snap = save_snapshot(tmp_path / "book.safetensors", model,
                             read(model, torch.randint(0, 50257, (1, 48)), segment_length=16))
    model.save_pretrained(tmp_path / "model")
    common = ["data.corpus=bundled", "data.segment_length=16", "eval.protocols=[paper]", "eval.max_steps=4"]
    check(evaluate(str(tmp_path / "model"), *common, "--out", str(tmp_path / "empty")))
    proc = check(evaluate(str(tmp_path / "model"), "--memory", str(snap), *common, "--out", str(tmp_path / "snap")))
    assert "eval validation [paper]" in proc.stdout
    (empty,), (started,) = (read_results(tmp_path / d / "validation_paper.json") for d in ("empty", "snap"))
    assert "started from a given memory (not an empty one)" in started.notes
    assert started.scored_tokens == empty.scored_tokens and abs(started.nll - empty.nll) > 1e-4

    other = build_model(backbone, "memoria", memory_init="random", memoria=memory)
    other.save_pretrained(tmp_path / "other")
    for model_dir, snapshot, says in [
        (tmp_path / "other", snap, "holds the memory of another model"),
        (tmp_path / "model", tmp_path / "missing.safetensors", "no such snapshot file"),
        (tmp_path / "model", tmp_path / "model" / "config.json", "is not a memoria_ds state file"),
        (tmp_path / "model", _poisoned(snap, "nan"), "non-finite values in `state.vectors`"),
        (tmp_path / "model", _poisoned(snap, "kind"), "`kind` holds values outside 0..3"),
        (tmp_path / "model", _poisoned(snap, "list"), "its field(s) memory are not what save_snapshot writes"),
    ]:
        proc = evaluate(str(model_dir), "--memory", str(snapshot), *common, "--out", str(tmp_path / "x"))
        assert proc.returncode == 2 and says in proc.stderr, proc.stderr[-2000:]
    GPT2LMHeadModel(backbone).save_pretrained(tmp_path / "plain")
    proc = evaluate(str(tmp_path / "plain"), "--memory", str(snap), *common, "--out", str(tmp_path / "x"))
    assert proc.returncode == 2 and "has no memory to start from" in proc.stderr, proc.stderr[-2000:]


def test_push_checks_the_export_and_dry_runs(tmp_path):
    """launch/push.py: the export is checked before any network; --dry-run lists the files."""
    from memoria_ds.model import build_model

    push = str(ROOT / "launch" / "push.py")
    torch.manual_seed(0)
    model = build_model(GPT2Config(n_layer=1, n_embd=16, n_head=2, n_positions=64), "memoria",
                        memoria={"num_wm": 2, "num_stm_reminded": 2, "num_ltm_reminded": 2, "stm_capacity": 8})
    run = tmp_path / "run"
    (run / "export").mkdir(parents=True)
    (run / "config.yaml").write_text("seed: 0\n")
    model.save_pretrained(run / "export")
    env = dict(os.environ, HF_HUB_OFFLINE="1")

    def call(*args):
        return subprocess.run([sys.executable, push, *args], capture_output=True, text=True, timeout=300, env=env)

    proc = call(str(run), "me/model", "--dry-run")
    assert proc.returncode == 2 and "missing README.md" in proc.stderr, proc.stderr  # no model card yet
    (run / "export" / "README.md").write_text("---\nlibrary_name: transformers\n---\n# card\n")
    proc = call(str(run), "me/model", "--dry-run")
    assert proc.returncode == 0, proc.stderr
    assert "https://huggingface.co/me/model" in proc.stdout and "model.safetensors" in proc.stdout
    assert "config.json" in proc.stdout and "README.md" in proc.stdout
    for args, says in [((str(tmp_path / "nope"), "me/model"), "does not exist"),
                       ((str(run), "not-a-repo"), "must look like `owner/name`"),
                       ((str(tmp_path), "me/model"), "is not a memoria_ds export")]:
        proc = call(*args, "--dry-run")
        assert proc.returncode == 2 and says in proc.stderr, proc.stderr
    weights = run / "export" / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[:-64])  # a damaged export is not uploaded
    proc = call(str(run), "me/model", "--dry-run")
    assert proc.returncode == 2 and "model.safetensors is not a complete safetensors file" in proc.stderr, proc.stderr


@pytest.mark.slow
def test_a_sharded_model_with_a_shard_missing_is_named(tmp_path):
    from memoria_ds.train.parse import ConfigError
    from memoria_ds.train.saved_model import check_saved_model

    torch.manual_seed(0)
    GPT2LMHeadModel(GPT2Config(n_layer=2, n_embd=16, n_head=2, n_positions=64)).save_pretrained(
        tmp_path, max_shard_size="20KB")
    shards = sorted(tmp_path.glob("model-*.safetensors"))
    assert len(shards) > 1 and (tmp_path / "model.safetensors.index.json").is_file()
    check_saved_model(tmp_path)  # whole: no error
    shards[-1].unlink()
    with pytest.raises(ConfigError, match=f"missing the weight file\\(s\\) \\['{shards[-1].name}'\\]"):
        check_saved_model(tmp_path)


@pytest.mark.slow
def test_knn_lm_with_the_training_text_in_training_and_in_evaluate_on_one_or_two_ranks(tmp_path):
    """`eval.knn_lm.train_datastore=true`: the training loop and launch/evaluate.py both search the
    training split's datastore; two ranks build the same one and score as one process does."""
    run = tmp_path / "run"
    knn = ["eval.knn_lm.enabled=true", "eval.knn_lm.k=16", "eval.knn_lm.train_datastore=true",
           "eval.knn_lm.train_max_entries=300", "eval.protocols=[full]", "eval.num_streams=2"]
    check(run_training(run, "checkpoint.export=true", *knn))
    (trained,) = read_results(sorted((run / "eval").glob("step_*.json"))[-1])
    assert trained.knn_lm["datastore"] == "stream+shared" and trained.knn_lm["shared_entries"] == 300
    assert trained.nll != trained.knn_lm["lm_nll"]
    outs = {ranks: tmp_path / f"eval{ranks}" for ranks in (1, 2)}
    for ranks, out in outs.items():
        check(evaluate(str(run), *knn, "--out", str(out), ranks=ranks))
    (one,), (two,) = (read_results(out / "validation_full.json") for out in outs.values())
    assert one.knn_lm["shared_entries"] == two.knn_lm["shared_entries"] == 300 and two.world_size == 2
    assert abs(one.nll - two.nll) < 1e-5 and abs(one.nll - trained.nll) < 1e-5
