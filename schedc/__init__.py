"""schedc: a declarative schedule compiler and executor for data-parallel GPT-2 training."""

__version__ = "0.1.0"
