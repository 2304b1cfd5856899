"""d9d: a hackable, modular distributed LLM-training framework on PyTorch."""

__version__ = "0.1.0"
