"""Calls between the operator and a job's workers: the sidecars' and launchers' control API
(`sidecars`, `worker_calls`), the job's tokens, placement delivery, the poller that reads
the workers every few seconds, the hint server launchers call, and calls run off the
reconcile path (`background`).

May import `cluster` and `core`; nothing above it (`steps`, `runtime`).
"""
