"""The paper's experiments as runs of the one training entry point, and the paper's numbers.

An `Experiment` is one training run: an entry point (`launch/finetune.py` or
`launch/pretrain.py`), a run configuration of `launch/repro/configs/` with the paper's
settings, the overrides that make this run what it is (model, corpus, sizes), and the
overrides that scale it down to a CPU smoke run (stand-in data, a tiny model, a few steps).
Its `id` is also its run directory under the launcher's `--run-root`, so a run shared by
two tables (Table 4's Memoria at segment 1024 is Table 7's "+ Long-term Memory") is
trained once.

A `Table` is the paper's table: one `Cell` per number, with the experiment that
reproduces it (None where the paper's model is not part of this project).

Where the paper is silent, the choice and its reason are in docs/reproduction.md.
"""

from __future__ import annotations

import fnmatch
from dataclasses import dataclass, field
from typing import Iterable

from ..memory import MemoriaConfig
from ..train.cli import CLASSIFY_OVERRIDES

CONFIGS = "launch/repro/configs"
FINETUNE = "launch/finetune.py"
PRETRAIN = "launch/pretrain.py"
CLASSIFY = "launch/classify.py"
EVALUATE = "launch/evaluate.py"
# What each entry point adds before the command line's overrides (as the launch scripts do).
ENTRY_BASE_OVERRIDES = {
    FINETUNE: [], PRETRAIN: ["model.from_scratch=true", "optim.lr=2e-4"],
    CLASSIFY: CLASSIFY_OVERRIDES,
}

# Overrides shared by every smoke run: a few steps on CPU, quiet logs, a short evaluation.
# `{standins}` is replaced by the stand-in data directory (memoria_ds.repro.standins).
SMOKE_COMMON = (
    "optim.max_steps=3", "optim.precision=fp32", "log.every=1", "log.tensorboard=false", "log.progress=false",
    "checkpoint.every=0", "eval.max_steps=2",
)
SMOKE_TINY_MODEL = ("model.settings.n_layer=2", "model.settings.n_embd=32", "model.settings.n_head=2")
SMOKE_LM_BATCH = 2
SMOKE_SORTING_BATCH = 4


@dataclass(frozen=True)
class Experiment:
    """One training run of the paper.

    Attributes:
        id: `family/name`, also the run directory under the launcher's run root.
        entry_point: the training script.
        config: the run configuration (YAML) with the family's paper settings.
        overrides: dotted overrides that make this run (applied after the YAML).
        batch: the paper's global batch (token streams = memory rows).
        tags: attributes the launchers filter on (`model`, `size`, `corpus`,
            `segment_length`, `segments`).
        smoke: overrides applied after `overrides` for a smoke run.
        smoke_batch: the global batch of a smoke run.
        standins: the stand-in data a smoke run needs (memoria_ds.repro.standins).
        eval_splits: splits the evaluate command scores after training (`launch/evaluate.py RUN
            eval.split=S`), beside the split the training evaluates at its end.
    """

    id: str
    entry_point: str
    config: str
    overrides: tuple[str, ...]
    batch: int
    tags: dict[str, str] = field(default_factory=dict)
    smoke: tuple[str, ...] = ()
    smoke_batch: int = SMOKE_LM_BATCH
    standins: tuple[str, ...] = ()
    eval_splits: tuple[str, ...] = ()

    def __hash__(self) -> int:
        return hash(self.id)


@dataclass(frozen=True)
class Cell:
    """One number of a paper table.

    Attributes:
        row: the paper's row label (the model).
        column: the paper's column label (data set, segment length, number of segments).
        paper: the paper's number (PPL, BPC, or accuracy in percent).
        metric: `ppl`, `bpc`, `accuracy` or `f1` (macro-F1; both collected as percentages).
        experiment: the id of the run that reproduces it; None if the model is not implemented.
            With `seeds`, the id shared by the runs of those seeds (`<experiment>/seed<s>`).
        split: the split the number is of (None: the split the run evaluated).
        seeds: the seeds whose runs are averaged (the paper's "average of five runs"); () = one run.
        paper_std: the paper's spread beside its number, as printed (None: none printed).
    """

    row: str
    column: str
    paper: float
    metric: str
    experiment: str | None
    split: str | None = None
    seeds: tuple[int, ...] = ()
    paper_std: float | None = None

    def run_ids(self) -> list[str]:
        """The ids of the runs this number comes from."""
        if self.experiment is None:
            return []
        return [seeded_id(self.experiment, s) for s in self.seeds] or [self.experiment]


@dataclass(frozen=True)
class Table:
    """A paper table: its cells and how the paper measured them."""

    name: str
    title: str
    cells: tuple[Cell, ...]
    paper_protocol: str
    our_protocols: tuple[str, ...]

    def experiment_ids(self) -> list[str]:
        """The runs this table needs, in the table's order, each once."""
        return list(dict.fromkeys(i for c in self.cells for i in c.run_ids()))


def seeded_id(experiment: str, seed: int) -> str:
    """The id (and run directory) of one seed's run of `experiment`."""
    return f"{experiment}/seed{seed}"


# ------------------------------------------------------------------------------ experiments

def _memoria(num: int, stm_capacity: int) -> tuple[str, ...]:
    """Overrides for the LM memory sizes (N_wm = K_stm = K_ltm = num)."""
    return (f"model.settings.memoria.num_wm={num}", f"model.settings.memoria.num_stm_reminded={num}",
            f"model.settings.memoria.num_ltm_reminded={num}", f"model.settings.memoria.stm_capacity={stm_capacity}")


def sorting_memory(segment_length: int) -> str:
    """The paper's sorting-task memory (Appendix B.1, sizes in proportion to the segment) as one override."""
    m = MemoriaConfig.for_segment_length(segment_length)
    return ("model.settings.memoria={" + f"num_wm: {m.num_wm}, num_stm_reminded: {m.num_stm_reminded}, "
            f"num_ltm_reminded: {m.num_ltm_reminded}, stm_capacity: {m.stm_capacity}, "
            f"initial_lifespan: {m.initial_lifespan}, alpha: {m.alpha}, search_depth: {m.search_depth}" + "}")


GPT2_SIZES = {"gpt2": "GPT-2", "gpt2-large": "GPT-2 Large", "gpt2-xl": "GPT-2 XL"}


def _finetune(size: str, model: str) -> Experiment:
    preset = "memoria" if model == "memoria" else "transformer"
    return Experiment(
        id=f"finetune/wikitext103-L150-{size}-{model}", entry_point=FINETUNE,
        config=f"{CONFIGS}/finetune_wikitext103.yaml",
        overrides=(f"model.backbone={size}", f"model.preset={preset}"),
        batch=8, tags={"size": size, "model": model, "corpus": "wikitext103", "segment_length": "150"},
        smoke=("model.backbone={standins}/gpt2-tiny", "data.path={standins}/wikitext103", "data.segment_length=32",
               *_memoria(4, 16)),
        standins=("gpt2-tiny", "wikitext103"),
    )


LM_SMOKE_DATA = {
    "wikitext103": ("data.path={standins}/wikitext103",),
    "pg19": ("data.path={standins}/pg19",),
    "enwik8": ("data.path={standins}/enwik8/enwik8", "data.loader.num_test_bytes=4096"),
}


def _scratch(corpus: str, segment_length: int, model: str) -> Experiment:
    """Tables 1 and 2: GPT-2 small shape from scratch."""
    enwik8 = corpus == "enwik8"
    overrides = [f"model.preset={model}"]
    if not enwik8:
        overrides.append(f"data.corpus={corpus}")
    # Appendix B.2: 2e-4 by default; 1e-4 for Transformer-XL on WikiText-103, for the
    # infinity-former on PG-19 and for both Memoria and Transformer-XL at segment length 50.
    slow = ((corpus == "wikitext103" and model == "xl") or (corpus == "pg19" and model == "infinity")
            or (segment_length == 50 and model in ("xl", "memoria")))
    overrides.append(f"optim.lr={'1.0e-4' if slow else '2.0e-4'}")
    smoke_segment = {150: 32, 50: 16, 512: 64}[segment_length]
    if segment_length == 50:
        overrides += ["data.segment_length=50", *_memoria(16, 128)]
    return Experiment(
        id=f"scratch/{corpus}-L{segment_length}-{model}", entry_point=PRETRAIN,
        config=f"{CONFIGS}/{'enwik8_scratch' if enwik8 else 'lm_scratch'}.yaml", overrides=tuple(overrides),
        batch=8, tags={"corpus": corpus, "model": model, "segment_length": str(segment_length)},
        smoke=(*SMOKE_TINY_MODEL, *LM_SMOKE_DATA[corpus], f"data.segment_length={smoke_segment}",
               *(_memoria(2, 8) if segment_length == 50 else _memoria(4, 16))),
        standins=(corpus,),
    )


def _sorting(segment_length: int, segments: int, model: str) -> Experiment:
    """Tables 4 and 7: the sorting task, 5 layers x 4 heads x 512 wide, batch 32."""
    small = segment_length // 16  # smoke: 256 / 512 / 1024 -> 16 / 32 / 64
    return Experiment(
        id=f"sorting/L{segment_length}-n{segments}-{model}", entry_point=PRETRAIN,
        config=f"{CONFIGS}/sorting.yaml",
        overrides=(f"model.preset={model}", f"data.segment_length={segment_length}",
                   f"data.sorting.num_segments={segments}", sorting_memory(segment_length)),
        batch=32, tags={"model": model, "segment_length": str(segment_length), "segments": str(segments)},
        smoke=(*SMOKE_TINY_MODEL, f"data.segment_length={small}", sorting_memory(small), "data.sorting.num_train=8",
               "data.sorting.num_validation=0", "data.sorting.num_test=8", f"optim.max_steps={segments}"),
        smoke_batch=SMOKE_SORTING_BATCH,
    )


# Table 3: the classifiers, each as (label, backbone, preset, segment length, segments read); the
# backbones are the authors' (`train_classification.py --model ...`), 12-layer base models.
HYPERPARTISAN_MODELS: dict[str, tuple[str, str, str, int, int]] = {
    "bert": ("BERT [512]", "bert-base-uncased", "backbone", 512, 1),
    "roberta": ("RoBERTa [512]", "roberta-base", "backbone", 512, 1),
    "bigbird": ("Bigbird [4096]", "google/bigbird-roberta-base", "backbone", 4096, 1),
    "longformer": ("Longformer [4096]", "allenai/longformer-base-4096", "backbone", 4096, 1),
    "memoria_bert": ("Memoria BERT [512]", "bert-base-uncased", "memoria_authors", 512, 8),
    "memoria_roberta": ("Memoria RoBERTa [512]", "roberta-base", "memoria_authors", 512, 8),
}
# Smoke stand-ins of the backbones (memoria_ds.repro.standins) and the lengths scaled down by 16 / 64.
_SMOKE_BACKBONE = {"bert-base-uncased": "bert-tiny", "roberta-base": "roberta-tiny",
                   "google/bigbird-roberta-base": "bigbird-tiny", "allenai/longformer-base-4096": "longformer-tiny"}
HYPERPARTISAN_SEEDS = (42, 43, 44, 45, 46)  # five runs; 42 is the authors' default seed


def _classify(model: str, seed: int) -> Experiment:
    """Table 3: a classifier fine-tuned on Hyperpartisan (Longformer's splits), one seed."""
    _, backbone, preset, length, segments = HYPERPARTISAN_MODELS[model]
    standin = _SMOKE_BACKBONE[backbone]
    smoke_length = 64 if segments == 1 and length > 512 else 32
    return Experiment(
        id=seeded_id(f"classify/hyperpartisan-{model}", seed), entry_point=CLASSIFY,
        config=f"{CONFIGS}/hyperpartisan.yaml",
        overrides=(f"model.backbone={backbone}", f"model.preset={preset}", f"data.segment_length={length}",
                   f"data.max_segments={segments}", f"optim.bptt_segments={segments}", f"seed={seed}"),
        batch=8, tags={"model": model, "seed": str(seed), "segment_length": str(length)},
        smoke=(f"model.backbone={{standins}}/{standin}", "data.path={standins}/hyperpartisan",
               f"data.segment_length={smoke_length}", "model.settings.memoria={num_wm: 4, num_stm_reminded: 4, "
               "num_ltm_reminded: 4, stm_capacity: 8}" if preset != "backbone" else "model.settings={}"),
        smoke_batch=2, standins=(standin, "hyperpartisan"), eval_splits=("test",),
    )


# The memory baselines of Tables 1, 2 and 4 (presets; docs/baselines.md).
BASELINES = ("xl", "compressive", "infinity")


def _all_experiments() -> dict[str, Experiment]:
    out: list[Experiment] = []
    out += [_finetune(size, model) for size in GPT2_SIZES for model in ("transformer", "memoria")]
    out += [_scratch(c, 512 if c == "enwik8" else 150, m) for c in ("wikitext103", "pg19", "enwik8")
            for m in ("transformer", *BASELINES, "memoria")]
    out += [_scratch("wikitext103", 50, m) for m in ("transformer", *BASELINES, "memoria")]
    out += [_sorting(s, n, m) for s in (256, 512, 1024) for n in (4, 8, 16, 32) for m in (*BASELINES, "memoria")]
    out += [_sorting(1024, n, m) for n in (4, 8, 16, 32, 47)
            for m in ("transformer", "memoria_wm", "memoria_wm_stm", "memoria")]
    out += [_classify(m, seed) for m in HYPERPARTISAN_MODELS for seed in HYPERPARTISAN_SEEDS]
    return {e.id: e for e in out}  # Table 7's Memoria at n <= 32 is Table 4's run (same id)


EXPERIMENTS: dict[str, Experiment] = _all_experiments()


# ------------------------------------------------------------------------------ paper tables

_LM_PAPER = ("test split; one stream, memory carried through the whole split, no resets; each segment's "
             "first token not scored (149 of 150 tokens; enwik8 511 of 512 characters): the authors' evaluation")
_SORT_PAPER = "test examples; accuracy over the 20 answer symbols, teacher forcing; memory reset per example"


def _table5() -> Table:
    cells = []
    paper = {"gpt2": (20.498, 18.986), "gpt2-large": (15.332, 13.227), "gpt2-xl": (15.254, 13.241)}
    for size, label in GPT2_SIZES.items():
        plain, mem = paper[size]
        cells.append(Cell(label, "WikiText-103 PPL", plain, "ppl", f"finetune/wikitext103-L150-{size}-transformer"))
        cells.append(Cell(f"Memoria {label}", "WikiText-103 PPL", mem, "ppl", f"finetune/wikitext103-L150-{size}-memoria"))
    return Table("table5", "Table 5: fine-tuning pretrained GPT-2 on WikiText-103 (segment 150)", tuple(cells),
                 _LM_PAPER, ("paper", "full"))


def _table1() -> Table:
    rows = {  # model -> (WikiText-103 PPL, PG-19 PPL, enwik8 BPC)
        ("Transformer", "transformer"): (26.755, 31.631, 1.28),
        ("Transformer-XL", "xl"): (24.543, 29.945, 1.19),
        ("Compressive Transformer", "compressive"): (24.794, 29.603, 1.16),
        ("infinity-former", "infinity"): (24.685, 29.154, 1.21),
        ("Memoria Transformer", "memoria"): (23.471, 29.149, 1.16),
    }
    cols = (("WikiText-103 PPL", "wikitext103-L150", "ppl"), ("PG-19 PPL", "pg19-L150", "ppl"),
            ("enwik8 BPC", "enwik8-L512", "bpc"))
    cells = [Cell(label, col, num, metric, f"scratch/{run}-{model}" if model else None)
             for (label, model), nums in rows.items() for (col, run, metric), num in zip(cols, nums)]
    return Table("table1", "Table 1: language modelling from scratch (GPT-2 small shape; segment 150, enwik8 512)",
                 tuple(cells), _LM_PAPER, ("paper", "full"))


def _table2() -> Table:
    rows = (("Transformer", "transformer", 39.287), ("Transformer-XL [50]", "xl", 31.459),
            ("Compressive Transformer [50]", "compressive", 31.644), ("infinity-former [50]", "infinity", 31.790),
            ("Memoria Transformer [48]", "memoria", 30.007))
    cells = [Cell(label, "WikiText-103 PPL (segment 50)", num, "ppl",
                  f"scratch/wikitext103-L50-{model}" if model else None) for label, model, num in rows]
    return Table("table2", "Table 2: WikiText-103 with segment length 50", tuple(cells), _LM_PAPER, ("paper", "full"))


def _table4() -> Table:
    paper = {  # model -> segments -> (256, 512, 1024)
        ("Transformer-XL", "xl"): {4: (74.66, 60.46, 68.86), 8: (36.24, 37.41, 40.09), 16: (32.75, 34.59, 35.06),
                                   32: (32.24, 32.76, 33.87)},
        ("Compressive Transformer", "compressive"): {4: (64.38, 64.57, 79.51), 8: (56.88, 49.58, 71.84),
                                            16: (35.57, 37.69, 44.03), 32: (32.68, 33.15, 35.07)},
        ("infinity-former", "infinity"): {4: (84.49, 83.75, 84.28), 8: (70.21, 75.55, 74.34), 16: (53.61, 53.61, 47.31),
                                    32: (34.36, 36.41, 39.71)},
        ("Memoria Transformer", "memoria"): {4: (80.42, 80.99, 82.27), 8: (70.84, 74.47, 74.08),
                                             16: (63.99, 64.50, 66.58), 32: (50.08, 56.48, 63.42)},
    }
    cells = [Cell(label, f"{n} segments of {s}", num, "accuracy", f"sorting/L{s}-n{n}-{model}" if model else None)
             for (label, model), by_n in paper.items() for n, nums in by_n.items()
             for s, num in zip((256, 512, 1024), nums)]
    return Table("table4", "Table 4: sorting accuracy (%)", tuple(cells), _SORT_PAPER, ("sorting",))


def _table7() -> Table:
    paper = {
        ("Transformer", "transformer"): (36.19, 33.79, 31.69, 29.94, 19.04),
        ("+ Working Memory", "memoria_wm"): (79.69, 70.85, 62.21, 52.01, 34.32),
        ("+ Short-term Memory", "memoria_wm_stm"): (82.66, 76.20, 66.37, 58.75, 54.87),
        ("+ Long-term Memory", "memoria"): (82.27, 74.08, 66.58, 63.42, 63.26),
    }
    cells = [Cell(label, f"{n} segments of 1024", num, "accuracy", f"sorting/L1024-n{n}-{model}")
             for (label, model), nums in paper.items() for n, num in zip((4, 8, 16, 32, 47), nums)]
    return Table("table7", "Table 7: memory ablations on sorting, segment 1024 (%)", tuple(cells), _SORT_PAPER,
                 ("sorting",))


_CLS_PAPER = ("Hyperpartisan (Longformer's splits: train 516, validation 64, test 65 articles; 51 of the test "
              "articles are also training articles); macro-F1 and accuracy, mean and spread of five runs, each at its "
              "last checkpoint after 20 epochs; segmented models predict from the document's last segment")


def _table3() -> Table:
    paper = {  # model -> (validation F1, validation acc, test F1, test acc), each (mean, std as printed)
        "bert": ((76.61, 0.04), (78.75, 0.03), (91.67, 0.01), (93.05, 0.01)),
        "roberta": ((82.96, 0.02), (84.06, 0.02), (95.24, 0.02), (95.38, 0.02)),
        "bigbird": ((81.22, 0.02), (82.81, 0.02), (93.24, 0.01), (93.54, 0.01)),
        "longformer": ((78.33, 0.03), (79.69, 0.03), (94.56, 0.01), (94.77, 0.01)),
        "memoria_bert": ((78.24, 0.04), (80.00, 0.04), (94.59, 0.02), (94.77, 0.02)),
        "memoria_roberta": ((86.39, 0.01), (87.19, 0.01), (96.51, 0.02), (96.62, 0.02)),
    }
    cols = (("Validation F1", "validation", "f1"), ("Validation Acc", "validation", "accuracy"),
            ("Test F1", "test", "f1"), ("Test Acc", "test", "accuracy"))
    cells = [Cell(HYPERPARTISAN_MODELS[model][0], col, mean, metric, f"classify/hyperpartisan-{model}", split=split,
                  seeds=HYPERPARTISAN_SEEDS, paper_std=std)
             for model, nums in paper.items() for (col, split, metric), (mean, std) in zip(cols, nums)]
    return Table("table3", "Table 3: Hyperpartisan classification (macro-F1 and accuracy, %)", tuple(cells),
                 _CLS_PAPER, ("classification_full", "classification_memoryless"))


TABLES: dict[str, Table] = {t.name: t for t in (_table5(), _table1(), _table2(), _table3(), _table4(), _table7())}
# Tags the launchers filter on, and their flags.
FILTERS = {"model": "--models", "size": "--sizes", "corpus": "--corpora", "segment_length": "--segment-lengths",
           "segments": "--segments", "seed": "--seeds"}


def select(table: str, filters: dict[str, Iterable[str]] | None = None, entries: Iterable[str] = ()) -> list[Experiment]:
    """The experiments of `table`, narrowed by tag values and by id globs.

    Args:
        table: `table1`, `table2`, `table3`, `table4`, `table5` or `table7`.
        filters: tag -> accepted values, e.g. `{"model": ["memoria"], "size": ["gpt2-xl"]}`.
        entries: glob patterns on the experiment id (`*L1024-n4*`); any one may match.

    Raises:
        ValueError: an unknown table, a filter the table has no such choice for, or a
            selection that leaves nothing, each naming what is available.
    """
    if table not in TABLES:
        raise ValueError(f"unknown table {table!r}; choose from {sorted(TABLES)}")
    chosen = [EXPERIMENTS[i] for i in TABLES[table].experiment_ids()]
    for tag, values in (filters or {}).items():
        values = [str(v) for v in values]
        available = sorted({e.tags[tag] for e in chosen if tag in e.tags}, key=_natural)
        if not available:
            raise ValueError(f"{table} has no `{tag}` choice (its runs differ by "
                             f"{sorted({k for e in chosen for k in e.tags if len({x.tags.get(k) for x in chosen}) > 1})})")
        unknown = [v for v in values if v not in available]
        if unknown:
            raise ValueError(f"{table}: unknown {tag} {unknown}; available: {available}")
        chosen = [e for e in chosen if e.tags.get(tag) in values]
    patterns = list(entries)
    if patterns:
        chosen = [e for e in chosen if any(fnmatch.fnmatch(e.id, p) for p in patterns)]
    if not chosen:
        raise ValueError(f"the selection leaves no run of {table}; its runs: {TABLES[table].experiment_ids()}")
    return chosen


def _natural(v: str) -> tuple:
    return (0, int(v), "") if v.isdigit() else (1, 0, v)


__all__ = ["CLASSIFY", "Cell", "ENTRY_BASE_OVERRIDES", "EVALUATE", "EXPERIMENTS", "Experiment", "FILTERS", "GPT2_SIZES",
           "HYPERPARTISAN_MODELS", "HYPERPARTISAN_SEEDS", "TABLES", "Table", "seeded_id", "select", "sorting_memory"]
