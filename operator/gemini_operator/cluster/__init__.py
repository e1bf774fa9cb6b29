"""The operator's side of the Kubernetes API: the client (`kube`, the only module that
imports `kubernetes`), the watch cache (`cache`) and the status as stored (`status_store`,
per-rank detail in a ConfigMap).

May import `core`; nothing above it (`calls`, `steps`, `runtime`).
"""
