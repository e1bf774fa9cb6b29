"""The executors of the training steps a decision asks for (`core.actions`): starting and
resuming training, saving before a suspend, recovering, and the job's Kueue Workload. Each
sets the job's status through the reconcile's status writer (`core.status_changes`) and hands
back a `core.outcome.Outcome` to the reconciler.

May import `calls`, `cluster` and `core`; not `runtime`.
"""
