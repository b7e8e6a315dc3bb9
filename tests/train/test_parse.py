"""Configs by pydantic (parse.py): files, dotted overrides, unknown keys and wrong types are errors."""

from typing import Literal

import pytest
from pydantic import Field, model_validator

from memoria_ds.train.config import Number, RunConfig, Section
from memoria_ds.train.parse import ConfigError, apply_overrides, dump, load, to_dict, validate


class Inner(Section):
    lr: Number = 1e-4
    steps: int = 10
    kind: Literal["a", "b"] = "a"
    name: str | None = None


class Outer(Section):
    inner: Inner = Field(default_factory=Inner)
    flag: bool = False
    extra: dict = Field(default_factory=dict)
    tags: list[str] = Field(default_factory=list)

    @model_validator(mode="after")
    def check(self):
        if self.inner.steps < 0:
            raise ValueError("steps must be >= 0")
        return self


def test_file_then_overrides(tmp_path):
    p = tmp_path / "c.yaml"
    p.write_text("inner:\n  lr: 0.001\n  steps: 5\nflag: true\n")
    cfg = load(Outer, p, ["inner.steps=7", "inner.kind=b", "extra.x=3", "tags=[u, v]", "inner.name=null"])
    assert cfg.inner.lr == 0.001 and cfg.inner.steps == 7 and cfg.inner.kind == "b"
    assert cfg.flag is True and cfg.extra == {"x": 3} and cfg.tags == ["u", "v"] and cfg.inner.name is None


def test_entry_point_defaults_yield_to_the_file_and_the_overrides(tmp_path):
    """launch/pretrain.py's lr 2e-4 is a default: a user's YAML value (or override) wins (issue 18 item 6)."""
    p = tmp_path / "c.yaml"
    p.write_text("inner:\n  lr: 0.001\n")
    assert load(Outer, p, [], defaults=["inner.lr=2e-4", "flag=true"]).inner.lr == 0.001
    assert load(Outer, p, [], defaults=["inner.lr=2e-4", "flag=true"]).flag is True  # not in the file: applied
    assert load(Outer, p, ["inner.lr=5e-5"], defaults=["inner.lr=2e-4"]).inner.lr == 5e-5
    assert load(Outer, None, [], defaults=["inner.lr=2e-4"]).inner.lr == 2e-4


def test_scientific_notation_without_a_dot_is_a_number():
    # PyYAML (YAML 1.1) reads `3e-5` as a string; users write it that way on command lines
    assert load(Outer, None, ["inner.lr=3e-5"]).inner.lr == 3e-5


def test_int_widens_to_float_but_not_the_other_way():
    assert validate(Outer, {"inner": {"lr": 1}}).inner.lr == 1.0
    for value in (2.5, 2.0, "2", True):  # strict: nothing is coerced into an integer
        with pytest.raises(ConfigError, match=r"`inner.steps` must be an integer"):
            validate(Outer, {"inner": {"steps": value}})


@pytest.mark.parametrize(
    "overrides,message",
    [
        (["inner.lrr=1"], r"unknown setting\(s\) \['inner.lrr'\]; known under `inner`: \['kind', 'lr', 'name', 'steps'\]"),
        (["nope=1"], r"unknown setting\(s\) \['nope'\]"),
        (["flag=3"], r"`flag` must be true or false"),
        (["inner.kind=c"], r"`inner.kind` must be one of \['a', 'b'\]"),
        (["inner.lr=fast"], r"`inner.lr` must be a number"),
        (["inner.steps=-1"], r"steps must be >= 0"),
        (["inner"], r"must look like `section.key=value`"),
        (["flag.x=1"], r"`flag` must be true or false, got \{'x': 1\}"),
        (["inner=3"], r"`inner` must be a mapping of settings, got 3"),
        (["tags=x"], r"`tags` must be a list, got 'x'"),
        (["inner.name=5"], r"`inner.name` must be a string, got 5"),
    ],
)
def test_errors_name_the_problem(overrides, message):
    with pytest.raises(ConfigError, match=message):
        load(Outer, None, overrides)


def test_missing_and_malformed_files(tmp_path):
    with pytest.raises(ConfigError, match="does not exist"):
        load(Outer, tmp_path / "absent.yaml")
    bad = tmp_path / "bad.json"
    bad.write_text("{not json")
    with pytest.raises(ConfigError, match="not valid JSON"):
        load(Outer, bad)
    lst = tmp_path / "list.yaml"
    lst.write_text("- 1\n- 2\n")
    with pytest.raises(ConfigError, match="mapping at the top level"):
        load(Outer, lst)
    # YAML's multi-line report, and undecodable bytes, come out as one line that says where
    broken = tmp_path / "broken.yaml"
    broken.write_text("run_dir: [1,2\n")
    with pytest.raises(ConfigError, match=r"is not valid YAML: expected ',' or '\]', but got '<stream end>' at line 2, "
                                          r"column 1$") as e:
        load(Outer, broken)
    assert "\n" not in str(e.value)
    broken.write_bytes(b"\xff\xfe")
    with pytest.raises(ConfigError, match="is not valid YAML: 'utf-8' codec can't decode"):
        load(Outer, broken)
    with pytest.raises(ConfigError, match=r"cannot parse the value: .* at line 1, column 4$"):
        load(Outer, None, ["a.b=[1,"])


def test_dump_round_trips(tmp_path):
    cfg = load(Outer, None, ["inner.lr=0.5", "tags=[a]"])
    dump(cfg, tmp_path / "r.yaml")
    assert load(Outer, tmp_path / "r.yaml") == cfg
    assert to_dict(cfg)["inner"]["lr"] == 0.5


def test_overrides_do_not_mutate_input():
    base = {"inner": {"lr": 1.0}}
    apply_overrides(base, ["inner.lr=2"])
    assert base == {"inner": {"lr": 1.0}}


def test_pretrain_keeps_the_users_learning_rate(tmp_path):
    from memoria_ds.train.cli import parse

    p = tmp_path / "run.yaml"
    p.write_text("optim:\n  lr: 1.0e-3\n")
    base = ["model.from_scratch=true", "optim.lr=2e-4"]  # launch/pretrain.py's
    cfg = parse(["--config", str(p)], "pretrain", base)
    assert cfg.optim.lr == 1e-3 and cfg.model.from_scratch is True
    assert parse([], "pretrain", base).optim.lr == 2e-4


@pytest.mark.parametrize(
    "overrides,message",
    [
        (["optim.lrr=1"],
         r"unknown setting\(s\) \['optim.lrr'\]; known under `optim`: \['betas', 'bptt_recompute', 'bptt_segments', 'epochs'"),
        (["model.bogus=1"], r"unknown setting\(s\) \['model.bogus'\]; known under `model`"),
        (["eval.trace=1"], r"`eval.trace` must be true or false, got 1"),
        (["optim.precision=fp8"], r"`optim.precision` must be one of \['auto', 'fp32', 'bf16', 'fp16'\], got 'fp8'"),
        (["optim.betas=[0.9, x]"], r"`optim.betas.1` must be a number, got 'x'"),
        (["data.segment_length=64.5"], r"`data.segment_length` must be an integer, got 64.5"),
        (["model.settings.memoria={num_wm: x}"], r"`model.settings.memoria.num_wm` must be an integer, got 'x'"),
    ],
)
def test_every_section_of_the_run_config_refuses_what_it_cannot_use(overrides, message):
    with pytest.raises(ConfigError, match=message):
        load(RunConfig, None, overrides)


def test_run_config_round_trips_through_its_yaml(tmp_path):
    cfg = load(RunConfig, None, ["optim.lr=3e-5", "model.preset=xl", "data.sorting={num_segments: 8}",
                                 "optim.betas=[0.9, 0.95]"])
    dump(cfg, tmp_path / "config.yaml")
    again = load(RunConfig, tmp_path / "config.yaml")
    assert again == cfg and again.optim.lr == 3e-5 and again.optim.betas == [0.9, 0.95]
