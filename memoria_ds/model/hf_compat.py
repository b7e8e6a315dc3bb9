"""The names transformers gives the decode cache, which changed in 5.24.

transformers 5.23 calls it `past_key_values` everywhere; 5.24 renames it `cache` in every
`ModelOutput`, in `GPT2Attention.forward` and in what `generate()` passes to `forward`
(the old name is a deprecated alias until 5.40). memoria_ds reads the installed version's
own classes once, here, and uses the name they use.
"""

from __future__ import annotations

import inspect

from transformers.modeling_outputs import CausalLMOutputWithPast
from transformers.models.gpt2.modeling_gpt2 import GPT2Attention

OUTPUT_CACHE = "cache" if "cache" in CausalLMOutputWithPast.__dataclass_fields__ else "past_key_values"
ATTENTION_CACHE = "cache" if "cache" in inspect.signature(GPT2Attention.forward).parameters else "past_key_values"

__all__ = ["ATTENTION_CACHE", "OUTPUT_CACHE"]
