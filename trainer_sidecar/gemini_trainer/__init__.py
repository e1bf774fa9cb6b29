"""Trainer integration: snapshot/restore library, shared-memory slots and the launcher."""
