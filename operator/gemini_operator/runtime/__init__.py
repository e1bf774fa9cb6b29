"""The operator process: kopf handlers, the work queue, the reconciler that runs a decision's
actions through the steps (with the status writer, the placement deliveries and the job's
children beside it; `wiring` builds them all once), leader election, metrics, and `main`,
which builds and runs it.

The top layer: may import every other layer; none imports it.
"""
