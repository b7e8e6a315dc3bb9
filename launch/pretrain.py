"""Train Memoria GPT-2 (or a baseline) from scratch: the same loop with `model.from_scratch=true`.

    deepspeed launch/pretrain.py --deepspeed ds_configs/zero2.json data.corpus=wikitext103 model.backbone=gpt2

Defaults differ from fine-tuning only where the paper's do: learning rate 2e-4.
"""

import project_env  # noqa: F401  (first: runs this script under the project's .venv when needed)

from memoria_ds.train.cli import main

if __name__ == "__main__":
    main(description=__doc__.splitlines()[0], base_overrides=["model.from_scratch=true", "optim.lr=2e-4"])
