"""kvq: offline weight / KV-cache quantization and verification for LLMs."""

__version__ = "0.1.0"
