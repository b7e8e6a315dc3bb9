"""ResetPolicy: parsing, and which rows it resets."""

from __future__ import annotations

import pytest
import torch

from memoria_ds.data import ResetPolicy, StreamBatch


def batch(doc_start: list[bool], step: int, global_step: int | None = None) -> StreamBatch:
    b = len(doc_start)
    return StreamBatch(
        input_ids=torch.zeros(b, 3, dtype=torch.long), targets=torch.zeros(b, 3, dtype=torch.long),
        attention_mask=torch.ones(b, 3, dtype=torch.long), doc_start=torch.tensor(doc_start),
        doc_start_pos=torch.full((b,), -1), stream_ids=torch.arange(b), epoch=0, step=step,
        global_step=step if global_step is None else global_step,
    )


@pytest.mark.parametrize("spec", ["never", "document_start", "every:500", "document_start+every:3"])
def test_parse_describe_round_trip(spec: str) -> None:
    assert ResetPolicy.parse(spec).describe() == spec


def test_bad_specs_are_refused_with_the_options() -> None:
    with pytest.raises(ValueError, match="document_start"):
        ResetPolicy.parse("at_doc")
    with pytest.raises(ValueError, match=">= 1"):
        ResetPolicy(every_n_steps=0)
    # the user's words: the period is at least 1, and "no periodic reset" is written `never`
    for spec in ("every:0", "document_start+every:00"):
        with pytest.raises(ValueError, match=r"at least 1 \(for no periodic reset, write `never`\)"):
            ResetPolicy.parse(spec)


def test_the_config_names_the_key_of_a_bad_reset_policy() -> None:
    from memoria_ds.train.config import RunConfig
    from memoria_ds.train.parse import ConfigError, load

    for key in ("data.reset", "eval.reset"):
        with pytest.raises(ConfigError, match=f"`{key}`: 'every:0'.*write `never`"):
            load(RunConfig, None, [f"{key}=every:0"])


def test_reset_masks() -> None:
    flags = [True, False, True, False]
    never, doc = ResetPolicy(), ResetPolicy(at_document_start=True)
    every3, both = ResetPolicy(every_n_steps=3), ResetPolicy(True, 3)
    assert never.reset_mask(batch(flags, 4)).tolist() == [False] * 4
    assert doc.reset_mask(batch(flags, 4)).tolist() == flags
    assert every3.reset_mask(batch(flags, 4)).tolist() == [False] * 4
    assert every3.reset_mask(batch(flags, 6)).tolist() == [True] * 4
    assert both.reset_mask(batch(flags, 4)).tolist() == flags
    assert both.reset_mask(batch(flags, 6)).tolist() == [True] * 4
    # Every policy resets every row at an epoch's first step.
    assert never.reset_mask(batch([False] * 4, 0, global_step=10)).tolist() == [True] * 4
    # A caller's own step counter replaces the batch's.
    assert every3.reset_mask(batch(flags, 4), step=9).tolist() == [True] * 4
