"""memoria_ds: the Memoria memory architecture (Park & Bak, ICML 2024) for GPT-2 at scale."""

__version__ = "0.1.0"
