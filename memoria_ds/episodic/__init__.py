"""MbPA++: episodic memory with sparse experience replay and local adaptation.

de Masson d'Autume, Ruder, Kong, Yogatama (2019), "Episodic Memory in Lifelong Language
Learning". The algorithm's core, with no training loop:

    memory.py    EpisodicMemory (keys, tokens, labels, task ids), write, gather, sample, state dict
    keys.py      KeyEncoder: the frozen copy of a pretrained encoder that makes the keys
    search.py    exact Euclidean K-nearest-neighbour search, ties by memory row
    replay.py    ReplaySchedule: one replay batch per `replay_every` examples seen
    adapt.py     local_adaptation and adapt_and_predict: per-example adaptation at inference

Training: for each batch, `write` its examples with their keys, train on it, and draw
`sample(memory, schedule.replay_size)` for each replay `schedule.advance(len(batch))` says
is due. Inference: `adapt_and_predict(model, memory, key_encoder(**query), query)`.
"""

from .adapt import ADAPT_L2, ADAPT_LR, ADAPT_STEPS, NEIGHBOURS, OPTIMIZERS, adapt_and_predict, local_adaptation
from .keys import KeyEncoder
from .memory import EpisodicMemory, MemoryBatch, concat, gather, sample, write
from .search import nearest
from .replay import REPLAY_EVERY, REPLAY_SIZE, ReplaySchedule

__all__ = [
    "EpisodicMemory", "MemoryBatch", "concat", "write", "gather", "sample", "nearest", "KeyEncoder", "ReplaySchedule",
    "local_adaptation", "adapt_and_predict", "NEIGHBOURS", "ADAPT_STEPS", "ADAPT_LR", "ADAPT_L2", "OPTIMIZERS",
    "REPLAY_EVERY", "REPLAY_SIZE",
]
