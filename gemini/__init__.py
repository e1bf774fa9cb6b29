"""GEMINI training operator: in-memory checkpoints and fast recovery for training on Kubernetes."""

__version__ = "0.1.0"
