"""Kubernetes operator (kopf) for GeminiJob.

Its folders are its layers, each importing only those below it (pyproject.toml's
import-linter contracts hold them to it):

- `runtime`: the process: kopf handlers, the work queue, the reconciler, leader election,
  metrics, main;
- `steps`: the executors of the training steps a decision asks for (start, resume, suspend
  save, recovery, Kueue Workloads);
- `calls`: calls to and from the job's workers (sidecars, launchers) and what they need:
  tokens, placement delivery, the poller, the hint server, background calls;
- `cluster`: the Kubernetes API: the client, the watch cache, the stored status;
- `core`: the pure part: spec, views of what was observed, the decision, rendering,
  conditions, events, records, status. No I/O, clock or threads.
"""
