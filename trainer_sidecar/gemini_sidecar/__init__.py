"""Checkpoint sidecar, trainer library and launcher."""
