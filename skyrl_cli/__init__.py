"""skyrl: declarative post-training of LLMs from one TOML recipe."""

__version__ = "0.1.0"
