"""Evaluation: named protocols (`paper`, `full`, `memoryless`), token-weighted NLL, PPL / BPC, the memory's
gain, sorting accuracy.

See docs/data.md for the protocols and what each one scores.
"""

from memoria_ds.eval.adapters import MemorylessLM
from memoria_ds.eval.perplexity import evaluate_lm, evaluate_protocols, expected_scored_tokens
from memoria_ds.eval.gain import MemoryGain, memory_gain, part_gains
from memoria_ds.eval.protocols import (EvalProtocol, forget_protocol, full_protocol, memoryless_protocol,
                                      paper_protocol, protocol_from_name)
from memoria_ds.eval.result import EvalResult, read_results, write_results
from memoria_ds.eval.scoring import all_reduce_sums, call_model, token_nll
from memoria_ds.eval.sorting import evaluate_sorting

__all__ = [
    "EvalProtocol", "EvalResult", "MemoryGain", "MemorylessLM", "all_reduce_sums", "call_model", "evaluate_lm",
    "evaluate_protocols", "evaluate_sorting", "expected_scored_tokens", "forget_protocol", "full_protocol", "memory_gain",
    "part_gains",
    "memoryless_protocol", "paper_protocol", "protocol_from_name", "read_results", "token_nll", "write_results",
]
