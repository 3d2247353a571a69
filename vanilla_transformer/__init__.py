"""vanilla-transformer: the Transformer of "Attention Is All You Need" for the Hugging Face ecosystem."""

__version__ = "0.1.0"
