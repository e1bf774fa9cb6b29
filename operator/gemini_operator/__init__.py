"""Kubernetes operator (kopf) for GeminiJob."""
