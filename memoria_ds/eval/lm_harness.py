"""lm-evaluation-harness: a model class, `memoria_ds`, whose scoring carries the memory.

    python -m memoria_ds.eval.lm_harness --model memoria_ds --model_args pretrained=DIR,segment_length=150 \\
        --tasks wikitext

    import lm_eval, memoria_ds.eval.lm_harness  # the import registers `memoria_ds`
    lm_eval.simple_evaluate(model="memoria_ds", model_args="pretrained=DIR", tasks=["wikitext"])

The first form is lm-eval's own command line (`lm-eval run ...`, every option of it) with
this model registered first: lm-eval only knows the models its own package imports, so a
bare `lm_eval --model memoria_ds` cannot find a third-party class.

What the harness asks for, with the memory:

- `loglikelihood_rolling` (perplexity tasks): the document, after one prefix token, is fed
  segment by segment (`segment_length` tokens, the model's own by default) with the memory
  carried from each segment to the next, and every token is scored once, as the `full`
  protocol does. Each document starts from an empty memory: documents never see each other.
- `loglikelihood` (multiple choice): context + continuation fed the same way (a long
  context goes through the memory); the continuation's tokens are scored.
- `generate_until`: `generate()` with the memory (the prompt's complete segments through
  memory, decoding in the last one), greedy, cut at the first stop string.

One request at a time (a memory row per document); any device. Needs `pip install
lm_eval` (memoria_ds[lm_eval]).
"""

from __future__ import annotations

import importlib
import sys
from typing import Any

import torch
import torch.nn.functional as F
from lm_eval.api.model import TemplateLM
from lm_eval.api.registry import register_model
from tqdm.auto import tqdm

DTYPES = {"auto": None, "float32": torch.float32, "fp32": torch.float32, "bfloat16": torch.bfloat16,
          "bf16": torch.bfloat16, "float16": torch.float16, "fp16": torch.float16}


def _flag(value: Any) -> bool:
    return value if isinstance(value, bool) else str(value).lower() in ("1", "true", "yes")


@register_model("memoria_ds")
class MemoriaLM(TemplateLM):
    """A Memoria GPT-2 export (or any model memoria_ds builds) for lm-eval.

    Args (lm-eval's `--model_args`, comma separated):
        pretrained: the export directory (`<run_dir>/export`) or a hub id.
        segment_length: tokens per memory step (default: the model's `segment_length`,
            else its positions per segment).
        device: `cpu`, `cuda`, `cuda:1`, ... (default: CUDA if available).
        dtype: `auto` (as saved), `float32`, `bfloat16`, `float16`.
        tokenizer: a tokenizer name or path (default: the export's own).
        trust_remote_code: load through the export's bundled code instead of memoria_ds.
        max_gen_toks: the longest generation (`generate_until`).
        batch_size / max_batch_size: lm-eval's own; requests are scored one at a time (a
            memory row per document). Any other argument is refused (a misspelt one too).
    """

    def __init__(self, pretrained: str, segment_length: int | None = None, device: str | None = None,
                 dtype: str = "auto", tokenizer: str | None = None, trust_remote_code: bool = False,
                 max_gen_toks: int = 256, batch_size: Any = 1, max_batch_size: Any = None) -> None:
        super().__init__()
        from transformers import AutoModelForCausalLM, AutoTokenizer

        importlib.import_module("memoria_ds.model")  # registers the architecture with the Auto classes

        if str(dtype) not in DTYPES:
            raise ValueError(f"dtype {dtype!r}: use one of {sorted(DTYPES)}")
        self._device = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
        self.model = AutoModelForCausalLM.from_pretrained(
            pretrained, dtype=DTYPES[str(dtype)] or "auto", trust_remote_code=_flag(trust_remote_code)
        ).to(self._device).eval()
        if not hasattr(self.model, "memory_kind"):
            raise ValueError(f"{pretrained} is not a memoria_ds model ({type(self.model).__name__}); "
                             f"score it with lm-eval's `--model hf`")
        self.tokenizer = AutoTokenizer.from_pretrained(tokenizer or pretrained)
        cfg = self.model.config
        self.segment_length = int(segment_length or cfg.segment_length or cfg.positions_per_segment)
        if not 1 <= self.segment_length <= cfg.positions_per_segment:
            raise ValueError(f"segment_length {self.segment_length} must be in [1, {cfg.positions_per_segment}] "
                             f"(the model's positions per segment)")
        self.max_gen_toks = int(max_gen_toks)

    # ------------------------------------------------------------------ what TemplateLM needs
    @property
    def eot_token_id(self) -> int:
        return self.tokenizer.eos_token_id

    @property
    def device(self) -> torch.device:
        return self._device

    def tok_encode(self, string: str, add_special_tokens: bool | None = None, **kwargs: Any) -> list[int]:
        return self.tokenizer.encode(string, add_special_tokens=bool(add_special_tokens))

    def tok_decode(self, tokens: list[int]) -> str:
        return self.tokenizer.decode(tokens)

    @torch.no_grad()
    def score(self, tokens: list[int], first: int) -> tuple[float, bool]:
        """log p(tokens[first:] | tokens[:first]) through the memory, and whether greedy decoding
        would produce them; `tokens` is fed in segments from an empty memory.

        Target j (the token at j + 1) is scored when j + 1 >= first; `first` >= 1.
        """
        ids = torch.tensor([tokens], dtype=torch.long, device=self._device)  # (1, T)
        inputs, targets = ids[:, :-1], ids[:, 1:]  # (1, T - 1): position j predicts token j + 1
        total, greedy, memory = 0.0, True, None
        S = self.segment_length
        for start in range(0, inputs.shape[1], S):
            out = self.model(input_ids=inputs[:, start:start + S], memory=memory)
            memory = out.memory
            logp = F.log_softmax(out.logits.float(), dim=-1)[0]  # (L, V)
            y = targets[0, start:start + S]  # (L,)
            keep = torch.arange(start + 1, start + 1 + y.shape[0], device=y.device) >= first
            if keep.any():
                total += float(logp.gather(1, y[:, None])[:, 0][keep].sum())
                greedy = greedy and bool((logp.argmax(dim=-1) == y)[keep].all())
        return total, greedy

    def _loglikelihood_tokens(self, requests, disable_tqdm: bool = False, **kwargs: Any) -> list[tuple[float, bool]]:
        out = []
        for _, context, continuation in tqdm(requests, disable=disable_tqdm or self.rank != 0,
                                             desc="memoria_ds loglikelihood"):
            out.append(self.score(list(context) + list(continuation), first=len(context)))
        return out

    def loglikelihood_rolling(self, requests, disable_tqdm: bool = False) -> list[float]:
        out = []
        for (string,) in tqdm([r.args for r in requests], disable=disable_tqdm or self.rank != 0,
                              desc="memoria_ds rolling"):
            out.append(self.score([self.prefix_token_id] + self.tok_encode(string), first=1)[0])
        return out

    @torch.no_grad()
    def generate_until(self, requests, disable_tqdm: bool = False) -> list[str]:
        out = []
        for context, gen_kwargs in tqdm([r.args for r in requests], disable=disable_tqdm or self.rank != 0,
                                        desc="memoria_ds generate"):
            kwargs = dict(gen_kwargs)
            until = kwargs.pop("until", None) or [self.tok_decode([self.eot_token_id])]
            until = [until] if isinstance(until, str) else list(until)
            max_new = int(kwargs.pop("max_gen_toks", self.max_gen_toks))
            prompt = self.tok_encode(context) or [self.prefix_token_id]
            S = self.segment_length
            tail = len(prompt) - ((len(prompt) - 1) // S) * S  # the prompt's tokens in the decoding segment
            max_new = max(1, min(max_new, self.model.config.positions_per_segment - tail))
            ids = torch.tensor([prompt], dtype=torch.long, device=self._device)
            seq = self.model.generate(ids, segment_length=S, max_new_tokens=max_new, do_sample=False,
                                      pad_token_id=self.eot_token_id)
            text = self.tok_decode(seq[0, len(prompt):].tolist())
            for stop in until:
                text = text.split(stop)[0]
            out.append(text)
        return out


def main(argv: list[str] | None = None) -> None:
    """lm-eval's command line, with `memoria_ds` registered."""
    from lm_eval.__main__ import cli_evaluate

    if argv is not None:
        sys.argv = [sys.argv[0], *argv]
    cli_evaluate()


if __name__ == "__main__":
    main()
