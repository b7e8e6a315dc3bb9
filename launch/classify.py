"""Classify long documents with a Memoria BERT / RoBERTa, segment by segment: the same loop as the language models.

    deepspeed launch/classify.py --deepspeed ds_configs/zero2.json \
        data.files='{train: [train.jsonl], validation: [dev.jsonl], test: [test.jsonl]}'

Labelled documents (`text` and `label` columns, or `data.text_field` / `data.label_field`) from
local files (`data.files`) or a hub dataset (`data.path`); each is read in segments of
`data.segment_length` tokens (at most `data.max_segments`), the memory carried across a
document's segments and reset at the next. The summary and the evaluate command give accuracy
and macro-F1 at each document's last segment, with and without the memory (docs/encoders.md).

Defaults differ from fine-tuning a language model where the task does: `model.task:
classification`, `data.corpus: documents`, RoBERTa-base, segments of 512 tokens, the paper's, and
one optimiser step per batch of documents (`optim.bptt_segments=8` = `data.max_segments`: the
authors' loop; one step per segment does not learn evidence that lies in one segment, docs/encoders.md).
"""

import project_env  # noqa: F401  (first: runs this script under the project's .venv when needed)

from memoria_ds.train.cli import CLASSIFY_OVERRIDES, main

if __name__ == "__main__":
    main(description=__doc__.splitlines()[0], base_overrides=CLASSIFY_OVERRIDES)
