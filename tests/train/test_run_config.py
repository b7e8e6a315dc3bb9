"""RunConfig: the run's own cross-field checks fail at load time, before any data or model work."""

import pytest

from memoria_ds.train.config import RunConfig
from memoria_ds.train.parse import ConfigError, load


@pytest.mark.parametrize(
    "overrides,message",
    [
        (["model.preset=memorio"], r"unknown preset 'memorio'; known: \[.*'memoria', 'memoria_fast'"),
        (["model.settings.memoria={num_wm: 0}"], r"`model.settings.memoria.num_wm` \(0\) must be at least 1"),
        (["model.settings.memoria={stm_capacity: 10}"], r"`model.settings.memoria.stm_capacity`.*at least.*num_stm_reminded"),
        (["model.settings.memoria={num_wn: 4}"], r"`model.settings.memoria.num_wn` is an unknown Memoria setting; known: "),
        (["data.corpus=/data/my.txt"], r"unknown `data.corpus` '/data/my.txt'.*data.corpus=files"),
        (["data.corpus=wikitext"], r"choose from \['bundled', 'enwik8', 'pg19', 'wikitext103', 'documents', 'files', 'sorting'\]"),
        (["data.corpus=files"], r"needs `data.files`"),
        (["model.settings.n_layers=1"], r"unknown `model.settings` key\(s\) 'n_layers' \(did you mean 'n_layer'\?\)"),
        (["model.settings={n_embd: 30, n_head: 4}"], r"`model.settings.n_head` \(4\) must divide `n_embd` \(30\)"),
        (["log.every=0"], r"`log.every` \(0\) must be at least 1"),
        (["optim.lr=.inf"], r"`optim.lr` \(inf\) must be a finite number"),
        (["optim.lr=.nan"], r"`optim.lr` \(nan\) must be a finite number"),
        (["optim.grad_clip=.nan"], r"`optim.grad_clip` \(nan\) must be a finite number"),
        (["optim.memory_delay_steps=-1"], r"`optim.memory_delay_steps` \(-1\) must be >= 0"),
        (["eval.every=-5"], r"`eval.every` \(-5\) and `eval.num_streams` \(0\) must be >= 0"),
        (["eval.max_steps=0"], r"`eval.max_steps` \(0\) must be at least 1"),
        (["optim.max_steps=0"], r"`optim.max_steps` \(0\) must be at least 1, or null"),
        (["data.corpus=sorting", "data.sorting={num_segments: 0}"], r"`data.sorting.num_segments` \(0\) must be an"),
        (["data.corpus=sorting", "data.sorting={num_train: 0}"], r"`data.sorting.num_train` \(0\) must be an integer >= 1"),
        (["data.corpus=sorting", "data.sorting={num_test: -1}"], r"`data.sorting.num_test` \(-1\) must be an integer >= 0"),
        (["data.corpus=sorting", "data.sorting={seed: 1.5}"], r"`data.sorting.seed` \(1.5\) must be an integer >= 0"),
        (["data.corpus=sorting", "data.segment_length=4", "data.sorting={num_segments: 5}"],
         r"`data.sorting.num_segments` \(5\) segments of 4 cannot hold the 20-symbol answer"),
        (["data.corpus=sorting", "data.sorting={num_validation: 0}"], r"`data.sorting.num_validation` is 0: nothing to"),
        (["eval.split=valid"], r"`eval.split` 'valid' is not a split of `data.corpus: bundled` \(it has \['test', 'train', "),
        (["data.corpus=files", "data.files={train: [a.txt]}"], r"`eval.split` 'validation' is not a split of `data.corpus: "
         r"files` \(it has \['train'\]\)"),
        (["optim.max_steps=-5", "optim.memory_delay_steps=3"], r"`optim.max_steps` \(-5\) must be at least 1"),
        (["eval.protocols=[]"], r"`eval.protocols` is empty: name `full`, `paper` and/or `memoryless`, or set "
         r"`eval.at_end=false`"),
        (["eval.protocols=[full, nope]"], r"unknown eval protocol\(s\) \['nope'\]; use any of `full`, `paper`, `memoryless`"),
        (["eval.protocols=[full, memoryless, full]"], r"`eval.protocols` \['full', 'memoryless', 'full'\] names a "
         r"protocol twice"),
        (["eval.protocols=[]", "eval.at_end=false", "eval.every=5"], r"`eval.protocols` is empty"),
        (["model.from_scratch=true", "data.segment_length=300", "model.settings={n_positions: 256}"],
         r"`data.segment_length` \(300\) exceeds the model's positions \(`model.settings.n_positions` = 256\)"),
        (["model.from_scratch=true", "data.segment_length=2048"], r"exceeds the model's positions .* = 1024"),
        (["model.compile=fast"], r"`model.compile` must be null \(eager\) or one of \['default', 'reduce-overhead'"),
        (["model.compile=default", "model.gradient_checkpointing=true"],
         r"`model.compile` and `model.gradient_checkpointing` together are not supported"),
        (["model.compile=default", "model.settings.memory_compile=default"],
         r"`model.compile` already compiles the memory engine .* remove `model.settings.memory_compile`"),
        (["model.from_scratch=true", "model.preset=xl", "data.segment_length=200", "model.settings={n_positions: 256}"],
         r"exceeds the model's positions \(`model.settings.n_positions` = 256\) \(`xl` with `xl_positions: alternate`"),
        (["model.from_scratch=true", "model.preset=compressive", "data.segment_length=200",
          "model.settings={n_positions: 256}"], r"\(`compressive` with `xl_positions: alternate` puts the cached segment"),
        (["lora.enabled=true", "lora.alpha=0"], r"`lora.alpha` \(0\) must be above 0"),
        (["lora.enabled=true", "lora.dropout=1.5"], r"`lora.dropout` \(1.5\) must be in \[0, 1\)"),
        (["data.num_proc=0"], r"`data.num_proc` \(0\) must be at least 1, or null"),
        (["optim.bptt_segments=0"], r"`optim.bptt_segments` \(0\) must be at least 1"),
        (["data.corpus=sorting", "optim.bptt_segments=2"], r"sorting task's input segments have no targets"),
    ],
)
def test_mistakes_are_caught_when_the_config_loads(overrides, message):
    with pytest.raises(ConfigError, match=message):
        load(RunConfig, None, overrides)


@pytest.mark.parametrize(
    "overrides,preset,memoria",
    [
        ([], "memoria", {}),
        (["model.preset=transformer"], "transformer", {}),
        (["model.preset=memoria_fast", "model.settings.memoria={num_wm: 16, num_stm_reminded: 16, stm_capacity: 128}"],
         "memoria_fast", {"num_wm": 16, "num_stm_reminded": 16, "stm_capacity": 128}),
        (["data.corpus=sorting"], "memoria", {}),
        (["data.corpus=sorting", "data.sorting={num_segments: 1, num_validation: 0}", "eval.split=test"], "memoria", {}),
        (["data.corpus=files", "data.files={train: [a.txt]}", "eval.at_end=false"], "memoria", {}),
        (["data.corpus=files", "data.files={train: [a.txt], dev: [b.txt]}", "eval.split=dev"], "memoria", {}),
        (["eval.protocols=[]", "eval.at_end=false"], "memoria", {}),  # training without evaluation
        (["optim.max_steps=1"], "memoria", {}),  # no delay: any length
        # a delay as long as the run is not refused: the run caps it (test_records.py)
        (["optim.max_steps=2", "optim.memory_delay_steps=40"], "memoria", {}),
    ],
)
def test_valid_settings_load_unchanged(overrides, preset, memoria):
    # the early check validates the merged settings without writing them back
    cfg = load(RunConfig, None, overrides)
    assert cfg.model.preset == preset and cfg.model.settings.get("memoria", {}) == memoria


def test_compiling_does_not_change_what_a_checkpoint_resumes_into():
    """`model.compile` is how the model runs: a compiled run's checkpoint resumes eagerly and
    back, and checkpoints made before the field existed keep their fingerprint."""
    from memoria_ds.train.checkpoints.resume import fingerprint

    eager, compiled = load(RunConfig, None, []), load(RunConfig, None, ["model.compile=reduce-overhead"])
    assert fingerprint(compiled) == fingerprint(eager)
    assert fingerprint(load(RunConfig, None, ["model.preset=xl"]))["model"] != fingerprint(eager)["model"]


def test_the_default_run_keeps_the_fingerprint_its_checkpoints_were_saved_with():
    """A field added to the model or data sections must leave existing checkpoints resumable: the
    default configuration's hashes are those of the code before `model.task`, `data.label_field`
    and `data.max_segments` existed (commit 138ee56). A new field that changes them needs the same
    care (`checkpoints/resume.py: fingerprint`)."""
    from memoria_ds.train.checkpoints.resume import fingerprint

    assert fingerprint(RunConfig()) == {"model": "034179feb6d58d10", "data": "e2e9ee3c7a2b38b4"}
    classify = load(RunConfig, None, ["model.task=classification", "model.backbone=bert", "model.from_scratch=true",
                                      "data.corpus=documents", "data.files={train: [a.jsonl], validation: [b.jsonl]}",
                                      "model.settings={max_position_embeddings: 514}"])
    other = load(RunConfig, None, ["model.task=classification", "model.backbone=bert", "model.from_scratch=true",
                                   "data.corpus=documents", "data.files={train: [a.jsonl], validation: [b.jsonl]}",
                                   "model.settings={max_position_embeddings: 514}", "data.max_segments=4"])
    assert fingerprint(classify)["data"] != fingerprint(other)["data"]  # where it acts, it counts


CLASSIFY = ["model.task=classification", "model.backbone=bert", "model.from_scratch=true",
            "data.corpus=documents", "data.files={train: [a.jsonl], validation: [b.jsonl]}",
            "model.settings={max_position_embeddings: 514}"]


@pytest.mark.parametrize("extra,says", [
    (["data.corpus=bundled"], "set both `model.task: classification` and `data.corpus: documents`"),
    (["model.preset=xl"], "unknown `model.preset` 'xl' for `model.task: classification`"),
    (["optim.bptt_segments=2", "optim.bptt_recompute=true"], "set `optim.bptt_recompute=false`"),
    (["eval.protocols=[full, memoryless_memoria]"], "a classifier is evaluated `full`"),
    (["eval.knn_lm.enabled=true"], "set `eval.knn_lm.enabled=false`"),
    (["model.settings={n_layer: 2}"], "unknown `model.settings` key(s) ['n_layer'] for a Memoria encoder"),
    (["model.backbone=gpt2-medium"], "`model.backbone` 'gpt2-medium' with `model.from_scratch`"),
    (["model.backbone=gpt2"], "a GPT-2 classifier is HF's GPT2ForSequenceClassification without a memory"),
    (["model.backbone=gpt2", "model.preset=backbone", "model.settings={num_wm: 4}"],
     "unknown `model.settings` key(s) ['num_wm'] for a GPT-2 classifier"),
    (["data.segment_length=600"], "needs max_position_embeddings of at least 602"),
    (["eval.split=test"], "`eval.split` 'test' is not among the documents' splits"),
    (["data.max_segments=0"], "`data.max_segments` (0) must be at least 1"),
])
def test_a_bad_classification_setting_is_refused_when_the_config_loads(extra, says):
    with pytest.raises(ConfigError) as e:
        load(RunConfig, None, [*CLASSIFY, *extra])
    assert says in str(e.value), str(e.value)


def test_a_classifier_may_step_once_per_batch_of_documents_and_only_it_aggregates():
    cfg = load(RunConfig, None, [*CLASSIFY, "optim.bptt_segments=8", "eval.aggregate=mean", "model.preset=backbone"])
    assert cfg.optim.bptt_segments == cfg.data.max_segments == 8 and cfg.eval.aggregate == "mean"
    with pytest.raises(ConfigError) as e:
        load(RunConfig, None, ["eval.aggregate=mean"])
    assert "leave it `last`" in str(e.value)


def test_a_classifier_without_a_validation_split_has_checkpoints_that_can_be_checked():
    """A checkpoint's memories are checked against the model its run configuration builds (resume and evaluate
    do this): a classifier's documents with only `train` and `test` (and `eval.split=test`) must build; the
    default `eval.split` (validation) made every such checkpoint unusable (found running the long-documents task)."""
    from memoria_ds.train.checkpoints.shards import saved_model_config
    from memoria_ds.train.parse import to_dict

    cfg = load(RunConfig, None, [*CLASSIFY, "data.files={train: [a.jsonl], test: [c.jsonl]}", "eval.split=test",
                                 "model.preset=backbone"])
    built = saved_model_config({"meta": {"config": to_dict(cfg)}})
    assert built.use_memory is False and built.model_type == "memoria_bert"


def test_reading_documents_in_order_is_part_of_the_data_fingerprint():
    """`data.in_order` changes what a classifier's streams read (a resume across it is refused); at its
    default it leaves the hash of checkpoints made before it existed."""
    from memoria_ds.train.checkpoints.resume import fingerprint

    base = ["model.task=classification", "model.backbone=bert", "model.from_scratch=true", "data.corpus=documents",
            "data.files={train: [a.jsonl], validation: [b.jsonl]}", "model.settings={max_position_embeddings: 514}"]
    shuffled, in_order = load(RunConfig, None, base), load(RunConfig, None, [*base, "data.in_order=true"])
    assert fingerprint(shuffled)["data"] != fingerprint(in_order)["data"]
