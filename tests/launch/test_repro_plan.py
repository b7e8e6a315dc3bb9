"""The planner behind launch/repro/*.sh: the paper's settings, valid commands for every topology,
the batch split, the ZeRO choice, footprints and steps against the real objects."""

from __future__ import annotations

import ast
import io
import json
import re
import shlex
from contextlib import redirect_stdout
from pathlib import Path

import pytest

from memoria_ds.repro import footprint as fp
from memoria_ds.repro.cost import estimate_cost, flops_per_token, schedule
from memoria_ds.repro.experiments import ENTRY_BASE_OVERRIDES, EXPERIMENTS, PRETRAIN, TABLES, select
from memoria_ds.repro.plan import main as plan_main
from memoria_ds.repro.plan import plan_run
from memoria_ds.repro.topology import Topology, split_batch
from memoria_ds.memory import MemoriaConfig, MemoryState
from memoria_ds.train.cli import parse as parse_training_args
from memoria_ds.train.config import RunConfig
from memoria_ds.train.parse import load

from repro_helpers import ROOT, check, run


def plan(*args: str) -> tuple[int, str]:
    out = io.StringIO()
    with redirect_stdout(out):
        code = plan_main(list(args))
    return code, out.getvalue()


def printed_commands(report: str) -> list[list[str]]:
    return [shlex.split(line.split("command   ", 1)[1]) for line in report.splitlines()
            if line.startswith("  command   ")]


# ------------------------------------------------------------------------------ the paper's settings

def test_tables_hold_the_papers_numbers():
    t5 = {c.row: c.paper for c in TABLES["table5"].cells}
    assert t5 == {"GPT-2": 20.498, "Memoria GPT-2": 18.986, "GPT-2 Large": 15.332, "Memoria GPT-2 Large": 13.227,
                  "GPT-2 XL": 15.254, "Memoria GPT-2 XL": 13.241}
    t1 = {(c.row, c.column): c.paper for c in TABLES["table1"].cells}
    assert t1[("Memoria Transformer", "enwik8 BPC")] == 1.16 and t1[("Transformer-XL", "PG-19 PPL")] == 29.945
    t4 = {(c.row, c.column): c.paper for c in TABLES["table4"].cells}
    assert [t4[("Memoria Transformer", f"{n} segments of 1024")] for n in (4, 8, 16, 32)] == [82.27, 74.08, 66.58, 63.42]
    assert [t4[("Transformer-XL", f"{n} segments of 1024")] for n in (4, 8, 16, 32)] == [68.86, 40.09, 35.06, 33.87]
    # Table 7's "+ Long-term Memory" at 4-32 segments is Table 4's Memoria run: trained once
    t7 = {c.column: c.experiment for c in TABLES["table7"].cells if c.row == "+ Long-term Memory"}
    assert t7["4 segments of 1024"] == "sorting/L1024-n4-memoria" in TABLES["table4"].experiment_ids()
    assert {len(TABLES[t].experiment_ids()) for t in TABLES} == {6, 15, 5, 30, 48, 20}
    t3 = {(c.row, c.column): (c.paper, c.paper_std, c.split, c.metric) for c in TABLES["table3"].cells}
    assert t3[("Memoria RoBERTa [512]", "Test F1")] == (96.51, 0.02, "test", "f1")
    assert t3[("Longformer [4096]", "Validation Acc")] == (78.33 + 1.36, 0.03, "validation", "accuracy")
    assert all(c.experiment is not None for t in ("table1", "table2", "table4") for c in TABLES[t].cells)


def test_experiments_resolve_to_the_papers_settings():
    cfgs = {i: load(RunConfig, e.config, [*ENTRY_BASE_OVERRIDES[e.entry_point], *e.overrides])
            for i, e in EXPERIMENTS.items()}
    ft = cfgs["finetune/wikitext103-L150-gpt2-xl-memoria"]
    assert (ft.model.from_scratch, ft.model.backbone, ft.optim.lr, ft.optim.precision) == (False, "gpt2-xl", 5e-5, "bf16")
    assert (ft.data.segment_length, ft.data.reset, ft.optim.epochs, ft.optim.warmup_ratio) == (150, "every:500", 3, 0.06)
    assert ft.eval.protocols == ["paper", "full", "memoryless"] and ft.eval.split == "test"
    assert cfgs["scratch/wikitext103-L150-memoria"].optim.lr == 2e-4
    assert cfgs["scratch/wikitext103-L150-xl"].optim.lr == 1e-4  # Appendix B.2
    seg50 = cfgs["scratch/wikitext103-L50-memoria"]
    assert seg50.optim.lr == 1e-4 and seg50.data.segment_length == 50
    assert {k: seg50.model.settings["memoria"][k] for k in ("num_wm", "num_stm_reminded", "stm_capacity")} == \
        {"num_wm": 16, "num_stm_reminded": 16, "stm_capacity": 128}
    e8 = cfgs["scratch/enwik8-L512-memoria"]
    assert (e8.data.segment_length, e8.optim.epochs, e8.data.reset) == (512, 20, "every:1500")
    assert e8.model.settings["memoria"]["num_wm"] == 170 and e8.model.settings["memoria"]["stm_capacity"] == 1360
    s = cfgs["sorting/L512-n16-memoria"]
    assert (s.optim.lr, s.optim.epochs, s.optim.micro_batch_size) == (2e-4, 5, 32)
    assert s.data.sorting_settings["num_train"] == 80_000
    assert s.model.settings["memoria"] == {"num_wm": 64, "num_stm_reminded": 128, "num_ltm_reminded": 320,
                                           "stm_capacity": 256, "initial_lifespan": 5.0, "alpha": 8.0, "search_depth": 10}
    assert (s.model.settings["n_layer"], s.model.settings["n_head"], s.model.settings["n_embd"]) == (5, 4, 512)


def test_entry_base_overrides_match_launch_pretrain():
    tree = ast.parse((ROOT / PRETRAIN).read_text())
    call = next(n for n in ast.walk(tree) if isinstance(n, ast.Call) and getattr(n.func, "id", "") == "main")
    base = next(k.value for k in call.keywords if k.arg == "base_overrides")
    assert ast.literal_eval(base) == ENTRY_BASE_OVERRIDES[PRETRAIN]


def test_select_filters_and_explains():
    assert [e.id for e in select("table5", {"size": ["gpt2-xl"], "model": ["memoria"]})] == \
        ["finetune/wikitext103-L150-gpt2-xl-memoria"]
    assert len(select("table4", {"segment_length": ["1024"]})) == 16  # 4 models x 4 segment counts
    assert len(select("table4", entries=["sorting/L256-*"])) == 16
    with pytest.raises(ValueError, match="no `size` choice"):
        select("table1", {"size": ["gpt2"]})
    with pytest.raises(ValueError, match=r"unknown segments \['5'\]; available: \['4', '8', '16', '32', '47'\]"):
        select("table7", {"segments": ["5"]})


# ------------------------------------------------------------------------------ dry runs

@pytest.fixture
def hostfile(tmp_path):
    path = tmp_path / "hosts"
    path.write_text("# two nodes\ngpu-a slots=4\ngpu-b slots=4\n")
    return path


@pytest.mark.parametrize("topology", ["single-gpu", "node", "multinode", "multinode-no-ssh"])
def test_dry_run_prints_valid_commands_for_every_table(topology, hostfile, tmp_path):
    flags = {"single-gpu": [], "node": ["--topology", "node", "--gpus", "4"],
             "multinode": ["--topology", "multinode", "--hostfile", str(hostfile)],
             "multinode-no-ssh": ["--topology", "multinode", "--hostfile", str(hostfile), "--launcher", "no-ssh",
                                  "--node-rank", "1"]}[topology]
    world = {"single-gpu": 1, "node": 4}.get(topology, 8)
    root = tmp_path / "runs"
    for table in TABLES:
        code, report = plan("--table", table, "--run-root", str(root), *flags)
        assert code == 0, report
        commands = printed_commands(report)
        assert len(commands) == len(TABLES[table].experiment_ids())
        for argv, eid in zip(commands, TABLES[table].experiment_ids()):
            e = EXPERIMENTS[eid]
            assert Path(argv[0]).name == "deepspeed"
            script = next(i for i, a in enumerate(argv) if a.endswith(".py"))
            launcher, script_path, args = argv[1:script], argv[script], argv[script + 1:]
            if topology in ("single-gpu", "node"):
                assert launcher[:2] == ["--num_gpus", str(world)]
            else:
                assert launcher[:4] == ["--hostfile", str(hostfile), "--master_addr", "gpu-a"]
                assert ("--no_ssh" in launcher) == (topology == "multinode-no-ssh")
                if topology == "multinode-no-ssh":
                    assert launcher[launcher.index("--node_rank") + 1] == "1"
            assert script_path == e.entry_point and (ROOT / script_path).is_file()
            cfg = parse_training_args(args, "", ENTRY_BASE_OVERRIDES[e.entry_point])  # what the run will read
            assert cfg.run_dir == str(root / eid)
            assert cfg.optim.micro_batch_size * cfg.optim.grad_accum * world == e.batch
            assert (ROOT / cfg.deepspeed).is_file()
        assert "GPU-hours in all" in report.splitlines()[-1]
    assert not root.exists()  # a dry run writes nothing


def test_dry_run_reports_batch_memory_steps_and_cost():
    code, report = plan("--table", "table5", "--sizes", "gpt2", "--models", "memoria", "--topology", "node",
                        "--gpus", "2", "--micro-batch", "2")
    assert code == 0
    assert "8 streams (memory rows) = 2 ranks x 4 (micro-batch 2 x accumulation 2)" in report
    assert "optim.grad_accum: 2" in report and "model.backbone:" not in report  # gpt2 is the default backbone
    assert "158,767,104 parameters (backbone 124,439,808 + memory modules 34,327,296)" in report
    assert "engram state 4 rows x" in report and f"C = {MemoriaConfig().capacity} slots" in report
    assert "3 epochs x" in report and "approximate:" in report
    assert "GPU-hours on A100 80GB" in report


def test_dry_run_refuses_a_batch_that_does_not_split(capsys):
    assert plan("--table", "table2", "--topology", "node", "--gpus", "16")[0] == 2
    err = capsys.readouterr().err
    assert "8 streams cannot be split over 16 ranks" in err and "[1, 2, 4, 8] ranks" in err


def test_commands_mode_records_each_run_and_skips_finished_ones(tmp_path):
    root = tmp_path / "runs"
    args = ["--table", "table7", "--segments", "4", "--models", "memoria_wm", "--run-root", str(root), "--print",
            "commands", "--", "optim.lr=1e-4"]
    code, out = plan(*args)
    assert code == 0
    (line,) = out.splitlines()
    log, command = line.split("\t")
    run_dir = root / "sorting" / "L1024-n4-memoria_wm"
    assert Path(log) == run_dir / "launch.log" and command.endswith("optim.lr=1e-4")  # passed through, last
    record = json.loads((run_dir / "repro.json").read_text())
    assert record["experiment"] == "sorting/L1024-n4-memoria_wm" and record["scale"] == "paper"
    assert record["tables"] == ["table7"] and record["command"] == command
    (run_dir / "summary.json").write_text("{}")
    assert plan(*args) == (0, "")
    assert plan(*args, "--rerun")[1].count("\t") == 1


def test_split_batch():
    assert split_batch(32, 8).overrides() == ["optim.micro_batch_size=4", "optim.grad_accum=1"]
    assert split_batch(8, 2, micro_cap=2).overrides() == ["optim.micro_batch_size=2", "optim.grad_accum=2"]
    with pytest.raises(ValueError, match="cannot be split over 3 ranks"):
        split_batch(8, 3)


def test_topology_errors(tmp_path):
    with pytest.raises(ValueError, match="needs --hostfile"):
        Topology("multinode")
    bad = tmp_path / "hosts"
    bad.write_text("node1 4\n")
    with pytest.raises(ValueError, match="expected `HOST slots=N`"):
        Topology("multinode", hostfile=str(bad))
    with pytest.raises(ValueError, match="slurm/MPI launchers do not set RANK"):
        Topology("single-gpu", launcher="slurm")


# ------------------------------------------------------------------------------ estimates against the real objects

def test_parameter_count_and_engram_bytes_match_the_real_objects(tiny_gpt2_config):
    from memoria_ds.model import MemoriaGPT2Config, build_model

    config = MemoriaGPT2Config.from_backbone(tiny_gpt2_config, "memoria", memoria={"num_wm": 4, "num_stm_reminded": 4,
                                             "num_ltm_reminded": 4, "stm_capacity": 16})
    model = build_model(tiny_gpt2_config, "memoria", memoria=config.memoria)
    counted = fp.count_parameters(config)
    assert counted["total"] == sum(p.numel() for p in model.parameters())
    assert counted["backbone"] == sum(p.numel() for p in model.transformer.parameters())
    row = fp.engram_bytes_per_row(config, segment_length=16)
    state = MemoryState.empty(MemoriaConfig.from_dict(config.memoria), batch_size=1, dim=config.n_embd)
    real = sum(t.numel() * t.element_size() for t in state.tensors().values())
    assert row["vectors"] + row["counts"] + row["slots"] == real - 16  # step + evictions: 16 bytes per row
    assert row["previous_segment"] == 16 * (config.n_embd * 4 + 1)  # fp32 hidden states + mask


def test_planned_model_is_the_model_the_training_builds(tmp_path):
    """The planner resolves the model from the run configuration alone; the training builds it."""
    from transformers import GPT2Config, GPT2LMHeadModel

    from memoria_ds.train.build import build_run_model

    GPT2LMHeadModel(GPT2Config(n_layer=2, n_embd=32, n_head=2, n_positions=64)).save_pretrained(tmp_path / "bb")
    tiny = ["model.settings.memoria={num_wm: 4, num_stm_reminded: 4, num_ltm_reminded: 4, stm_capacity: 8}"]
    for overrides, vocab in (
        (["model.from_scratch=true", "model.settings.n_layer=2", "model.settings.n_embd=32", "model.settings.n_head=2",
          "data.segment_length=16", *tiny], 50257),
        (["model.from_scratch=true", "model.preset=xl", "data.corpus=sorting", "model.settings.n_layer=1",
          "model.settings.n_embd=16", "model.settings.n_head=2"], 21),
        ([f"model.backbone={tmp_path / 'bb'}", "model.preset=memoria_wm_stm", "data.segment_length=32", *tiny], None),
    ):
        cfg = load(RunConfig, None, overrides)
        planned = fp.model_config(cfg)
        built = build_run_model(cfg, vocab)
        bookkeeping = {"use_cache", "architectures", "transformers_version", "_name_or_path", "dtype"}
        assert {k: v for k, v in planned.to_dict().items() if k not in bookkeeping} == \
            {k: v for k, v in built.config.to_dict().items() if k not in bookkeeping}
        assert fp.count_parameters(planned)["total"] == sum(p.numel() for p in built.parameters())


def test_model_states_follow_the_zero_partitioning():
    """DeepSpeed's estimators (per GPU, 1,000 parameters on 4 GPUs, largest layer 100): 16-bit
    weights 2 bytes whole, 18 bytes over the ranks; ZeRO-3 adds its largest layer (4 bytes per
    parameter) and partitions the weights too; offload moves the partitioned part to CPU."""
    from memoria_ds.train.engine import zero_model_state_bytes as states

    assert states(1000, 100, 1, False, gpus_per_node=4) == {"gpu": 4000 + 16000 / 4, "cpu": 0.0}
    assert states(1000, 100, 2, False, gpus_per_node=4)["gpu"] == 2000 + 18000 // 4
    assert states(1000, 100, 2, True, gpus_per_node=4)["gpu"] == 2000
    assert states(1000, 100, 3, False, gpus_per_node=4)["gpu"] == 400 + 18000 // 4
    assert states(1000, 100, 3, True, gpus_per_node=4)["gpu"] == 400
    assert states(1000, 100, 3, True, gpus_per_node=4)["cpu"] > 0
    with pytest.raises(ValueError, match="no estimate for ZeRO stage 1 with offload"):
        states(1000, 100, 1, True, gpus_per_node=4)


def test_largest_layer_is_counted_by_hand(tiny_gpt2_config):
    """ZeRO-3 gathers its largest layer whole: for the 64-wide, 257-symbol model that is an MLP's
    c_fc (64 x 256 + 256 = 16,640), not the embedding (257 x 64 = 16,448); at GPT-2's 50,257
    tokens it is the embedding."""
    from memoria_ds.model import MemoriaGPT2Config

    config = MemoriaGPT2Config.from_backbone(tiny_gpt2_config, "memoria")
    assert fp.count_parameters(config)["largest_layer"] == 64 * 256 + 256
    wide = MemoriaGPT2Config.from_backbone(tiny_gpt2_config.__class__(**{**tiny_gpt2_config.to_dict(),
                                                                          "vocab_size": 50257}), "memoria")
    assert fp.count_parameters(wide)["largest_layer"] == 50257 * 64


def test_zero_choice_follows_the_gpu_memory():
    cfg = load(RunConfig, EXPERIMENTS["finetune/wikitext103-L150-gpt2-xl-memoria"].config, ["model.backbone=gpt2-xl"])
    assert fp.choose_zero(cfg, 1, 80).zero == "1"  # ~2.1B parameters x 16 bytes fit one A100 80GB
    small = fp.choose_zero(cfg, 1, 24)
    assert small.zero == "2-offload" and small.total < 0.85 * 24 * fp.GIB
    assert fp.ds_config_for("1", 1) == "ds_configs/single_gpu.json"
    with pytest.raises(ValueError, match="no ZeRO choice fits 4 GiB"):
        fp.choose_zero(cfg, 1, 4)


def test_steps_match_the_training_streams():
    from memoria_ds.data import ExampleStreams, TokenStreams
    from memoria_ds.train.build import load_corpora

    cfg = load(RunConfig, None, ["data.corpus=bundled", "data.segment_length=64", "optim.micro_batch_size=3",
                                 "optim.epochs=2", "eval.split=validation", "eval.protocols=[paper, full]"])
    sched = schedule(cfg, world_size=1)
    corpora = load_corpora(cfg.data, ("train", "validation"), rank=0)
    streams = TokenStreams(corpora["train"], num_streams=3, segment_length=64, tail="drop")
    assert sched.steps_per_epoch == streams.steps_per_epoch and sched.total_steps == 2 * streams.steps_per_epoch
    n_val = corpora["validation"].num_tokens
    assert sched.eval_steps == 2 * -(-n_val // 64)  # paper and full: one stream each, every segment
    assert "exact" in sched.source

    s = load(RunConfig, None, ["data.corpus=sorting", "data.segment_length=32", "optim.micro_batch_size=4",
                               "data.sorting={num_segments: 3, num_train: 10, num_test: 6}"])
    ssched = schedule(s, world_size=1)
    data = load_corpora(s.data, ("train",), rank=0)["train"]
    real = ExampleStreams(data, batch_size=4, segment_length=32, drop_last=True)
    assert ssched.steps_per_epoch == real.steps_per_epoch == 2 * 3
    assert ssched.eval_steps == 2 * 3  # 6 test examples in batches of 4, 3 segments each
    both = load(RunConfig, None, ["data.corpus=sorting", "data.segment_length=32", "optim.micro_batch_size=4",
                                  "data.sorting={num_segments: 3, num_train: 10, num_test: 6}",
                                  "eval.protocols=[full, memoryless]"])
    assert schedule(both, world_size=1).eval_steps == 2 * 2 * 3  # read twice: with and without the memory


def test_a_pkm_layer_costs_the_value_rows_a_token_reads_not_its_table():
    """GPT-2 small with the paper's PKM layer in block 6 (replacing its MLP): by hand, the table is
    512^2 x 768 = 201.3M values of which a token reads 4 x 32 rows; the k x k candidate sums."""
    base = ["data.segment_length=100", "optim.micro_batch_size=8", "optim.max_steps=10", "eval.at_end=false"]
    plain = fp.model_config(load(RunConfig, None, ["model.preset=transformer", *base]))
    cfg = load(RunConfig, None, ["model.preset=transformer", "model.settings={pkm_layers: [6]}", *base])
    config = fp.model_config(cfg)
    params = fp.count_parameters(config)["total"]
    untouched = (512 * 512 - 4 * 32) * 768
    assert flops_per_token(config, params, 100) == 6 * (params - untouched) + 12 * 12 * 768 * 50 + 3 * 4 * 32 * 32
    # the paper's point: far more parameters, fewer FLOPs than the MLP it replaces (2 x 768 x 3072 weights)
    plain_params = fp.count_parameters(plain)["total"]
    assert params - plain_params == 512 * 512 * 768 + (768 * 4 * 256 + 4 * 256) + 4 * 2 * 512 * 128 + 2 * 4 * 256 - (2 * 768 * 3072 + 3072 + 768)
    assert flops_per_token(config, params, 100) < flops_per_token(plain, plain_params, 100)

    from memoria_ds.train.activation_memory import activation_bytes

    s, b, h = 100, 8, 768
    pkm = 2 * (2 * h + 4 * (256 * 2 + 2 * 512 + 32 * 32 + 2 * 32)) + 8 * 4 * 32  # per token, by the stated parts
    assert activation_bytes(config, b, s) == activation_bytes(plain, b, s) + s * b * pkm - 19 * s * b * h


def test_cost_is_the_stated_formula():
    cfg = load(RunConfig, None, ["model.preset=transformer", "data.segment_length=100", "optim.micro_batch_size=8",
                                 "optim.max_steps=1000", "eval.at_end=false"])
    config = fp.model_config(cfg)
    params = fp.count_parameters(config)["total"]
    assert flops_per_token(config, params, 100) == 6 * params + 12 * 12 * 768 * 50
    sched = schedule(cfg, world_size=1)
    cost = estimate_cost(config, params, sched, cfg, world_size=1, num_nodes=1, zero_stage=1, offload=False)
    from memoria_ds.repro import cost as c

    compute = flops_per_token(config, params, 100) * 800 / (c.A100_BF16_PEAK * c.MFU)
    latency = 12 * c.BLOCK_LATENCY_S + c.OPTIMIZER_STEP_S
    assert cost.step_s == pytest.approx(compute + latency) and cost.comms_s == 0
    assert cost.gpu_hours == pytest.approx(1000 * cost.step_s / 3600)
    two = estimate_cost(config, params, schedule(cfg, world_size=2), cfg, world_size=2, num_nodes=2, zero_stage=1,
                        offload=False)
    assert two.comms_s == pytest.approx(4 * params / c.INTER_NODE_BYTES_S)


# ------------------------------------------------------------------------------ the shell scripts

def test_table_script_dry_run_echoes_the_planner_and_prints_commands(tmp_path):
    proc = check(run(["bash", "launch/repro/table7.sh", "--mode", "dry-run", "--topology", "node", "--gpus", "2",
                      "--segments", "4", "--models", "memoria", "--run-root", str(tmp_path), "--", "log.every=7"]))
    assert proc.stdout.startswith("+ ") and "memoria_ds.repro.plan --print report --table table7" in proc.stdout
    (argv,) = printed_commands(proc.stdout)
    assert argv[:3] == ["deepspeed", "--num_gpus", "2"] and argv[-1] == "log.every=7"
    bad = run(["bash", "launch/repro/table7.sh", "--mode", "bogus"])
    assert bad.returncode == 2 and "--mode must be run, dry-run or smoke" in bad.stderr


def test_every_launcher_is_strict_and_thin():
    for script in sorted((ROOT / "launch" / "repro").glob("*.sh")) + [ROOT / "launch/slurm/repro.sbatch"]:
        text = script.read_text()
        assert "set -euo pipefail" in text, script
        assert "&>" not in text, script
    assert all('"$@"' in (ROOT / f"launch/repro/table{t}.sh").read_text() for t in (1, 2, 4, 5, 7))
    assert "tee -a" in (ROOT / "launch/repro/common.sh").read_text()


def test_the_table_launchers_help_shows_their_modes():
    """`table5.sh --help` lists its own `--mode` before the planner's flags (issue 18 item 6)."""
    import os
    import subprocess
    import sys

    env = dict(os.environ, PYTHON=sys.executable)
    out = subprocess.run(["bash", str(ROOT / "launch" / "repro" / "table5.sh"), "--help"], capture_output=True,
                         text=True, env=env, timeout=120)
    assert out.returncode == 0, out.stderr
    assert "--mode dry-run" in out.stdout and "--mode smoke" in out.stdout and "--topology" in out.stdout
    assert out.stdout.index("--mode run") < out.stdout.index("usage:")


# ------------------------------------------------------------------------------ the docs' estimates

def documented_estimates() -> tuple[dict[str, tuple[int, int]], tuple[int, int], tuple[int, int]]:
    """docs/reproduction.md's estimates table: ({table: (runs, GPU-hours)}, (Table 7's runs shared
    with Table 4, their GPU-hours), (GPU-hours in all, runs in all))."""
    text = (ROOT / "docs" / "reproduction.md").read_text()
    section = text.split("### Estimates (A100 80GB", 1)[1].split("\n## ", 1)[0]
    rows = {f"table{t}": (int(n), int(h)) for t, n, h in re.findall(r"^\| (\d) \| (\d+) \| (\d+)", section, re.M)}
    shared = re.search(r"\((\d+) runs, (\d+) GPU-hours, shared with Table 4\)", section)
    total = re.search(r"About (\d+) GPU-hours for all (\d+) runs", section)
    assert shared and total, "the estimates section lost its shared-runs note or its total line"
    return rows, (int(shared[1]), int(shared[2])), (int(total[1]), int(total[2]))


def test_the_estimates_table_counts_every_run_the_planner_prints():
    """The docs' runs and GPU-hours per table are the planner's (paper scale, one GPU per run):
    a table that gains runs (the baselines' rows) fails here until the docs say so."""
    rows, shared, total = documented_estimates()
    assert set(rows) == set(TABLES), "one row per table"
    hours: dict[str, float] = {}
    per_table = {}
    for name in TABLES:
        runs = select(name)
        for e in runs:
            if e.id not in hours:
                r = plan_run(e, topology=Topology("single-gpu"), run_root=Path("runs/repro"), smoke=False, zero="auto",
                             gpu_memory_gib=80.0, global_batch=None, micro_batch=None, passthrough=[], count=False)
                hours[e.id] = r.cost.gpu_hours
        per_table[name] = (len(runs), round(sum(hours[e.id] for e in runs)))
    assert per_table == rows
    both = set(TABLES["table4"].experiment_ids()) & set(TABLES["table7"].experiment_ids())
    assert shared == (len(both), round(sum(hours[i] for i in both)))
    assert total == (round(sum(hours.values())), len(hours))


# ------------------------------------------------------------------------------ Table 3

def test_table3_runs_have_the_authors_settings():
    cfgs = {i: load(RunConfig, e.config, [*ENTRY_BASE_OVERRIDES[e.entry_point], *e.overrides])
            for i, e in EXPERIMENTS.items() if i.startswith("classify/")}
    assert len(cfgs) == 30 and TABLES["table3"].experiment_ids() == list(cfgs)  # 6 models x 5 seeds
    mem = cfgs["classify/hyperpartisan-memoria_roberta/seed44"]
    assert (mem.model.backbone, mem.model.preset, mem.seed, mem.data.path) == \
        ("roberta-base", "memoria_authors", 44, "hyperpartisan")
    assert (mem.data.segment_length, mem.data.max_segments, mem.optim.bptt_segments) == (512, 8, 8)
    assert (mem.optim.lr, mem.optim.warmup_ratio, mem.optim.schedule, mem.optim.grad_clip, mem.optim.epochs,
            mem.optim.micro_batch_size, mem.optim.weight_decay) == (3e-5, 0.0, "constant", 0.0, 20, 8, 0.0)
    assert mem.data.tokenizer == "roberta-base"  # a pretrained classifier reads its own tokenizer's ids
    assert (mem.eval.split, mem.eval.protocols) == ("validation", ["full", "memoryless"])
    long = cfgs["classify/hyperpartisan-longformer/seed42"]
    assert (long.model.backbone, long.model.preset, long.data.segment_length, long.data.max_segments,
            long.optim.bptt_segments) == ("allenai/longformer-base-4096", "backbone", 4096, 1, 1)
    bert = cfgs["classify/hyperpartisan-bert/seed46"]
    assert (bert.model.backbone, bert.data.segment_length, bert.data.max_segments) == ("bert-base-uncased", 512, 1)
    assert all(EXPERIMENTS[i].eval_splits == ("test",) for i in cfgs)
    assert [e.id for e in select("table3", {"model": ["bigbird"], "seed": ["43"]})] == \
        ["classify/hyperpartisan-bigbird/seed43"]


def test_table3_dry_run_on_two_nodes_of_four(hostfile):
    """The whole table resolves on 2 x 4 GPUs: one document per rank, the test evaluation after each run,
    steps from Hyperpartisan's 516 training articles, and a cost for every run."""
    code, report = plan("--table", "table3", "--topology", "multinode", "--hostfile", str(hostfile))
    assert code == 0, report
    assert len(printed_commands(report)) == 30
    thens = [line for line in report.splitlines() if line.startswith("  then      ")]
    assert len(thens) == 30 and all(line.endswith("eval.split=test") and "launch/evaluate.py" in line for line in thens)
    assert report.count("8 streams (memory rows) = 8 ranks x 1 (micro-batch 1 x accumulation 1)") == 30
    assert "20 epochs x 65 = 1,300 optimiser steps" in report  # ceil(516 / 8) batches, one step each
    assert "Hyperpartisan, Longformer's splits" in report
    mem = report.split("classify/hyperpartisan-memoria_roberta/seed42", 1)[1]
    assert "memory modules 0" not in mem.split("\n\n")[0] and "engram state 1 rows x" in mem
    assert "30 runs," in report.splitlines()[-1] and "GPU-hours in all" in report.splitlines()[-1]


def test_encoder_parameters_and_engrams_match_the_real_models():
    """The planner's counts are the built models' (meta device) for a Memoria encoder and Longformer."""
    from transformers import LongformerConfig

    from memoria_ds.model.encoder import build_encoder_model
    from memoria_ds.model.encoder.config import encoder_config
    from memoria_ds.model.encoder.memory import EncoderMemory
    from memoria_ds.repro import encoder_estimates as enc
    from transformers import BertConfig

    small = dict(vocab_size=100, hidden_size=32, num_hidden_layers=4, num_attention_heads=2, intermediate_size=64,
                 num_labels=2)
    config = encoder_config(BertConfig(**small), "memoria_authors", memoria={"num_wm": 4, "num_stm_reminded": 4,
                                                                              "num_ltm_reminded": 4, "stm_capacity": 8})
    model = build_encoder_model(config)
    counts = enc.count_parameters(config)
    assert counts["total"] == sum(p.numel() for p in model.parameters())
    assert counts["memory"] == sum(p.numel() for m in model.memory_modules() for p in m.parameters()) > 0
    state = EncoderMemory.empty(config.memoria_config, 1, 32).state
    row = enc.engram_row(config)
    assert row["vectors"] == state.vectors.numel() * 4 and row["capacity"] == config.memoria_config.capacity
    plain = LongformerConfig(max_position_embeddings=66, attention_window=[8] * 4, **small)
    assert enc.count_parameters(plain)["total"] == sum(p.numel() for p in build_encoder_model(plain, "backbone")
                                                       .parameters())
    assert enc.attended_keys(plain, 64) == 9 and enc.attended_keys(config, 64) == 64
    assert enc.engram_row(plain) == {"capacity": 0}
