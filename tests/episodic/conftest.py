"""Fixtures for the MbPA++ tests (tiny models built from configs, never downloaded)."""

from __future__ import annotations

import pytest
import torch
from episodic_helpers import tiny_bert_config
from transformers import BertForSequenceClassification


@pytest.fixture
def tiny_classifier() -> BertForSequenceClassification:
    """A tiny 3-class BERT classifier with weights large enough for visible adaptation."""
    torch.manual_seed(0)
    return BertForSequenceClassification(tiny_bert_config(initializer_range=0.2))
