"""The operator's pure part: the spec, views of what was observed, the decision of a
reconcile (`decide`) and its actions, rendering of the job's children, conditions, events,
status records and the status.

Values in, values out: no I/O (no Kubernetes client, kopf, sockets, HTTP), no clock (the time
is an argument), no threads. Imports only the standard library, `gemini` (the shared pure
domain and contracts) and other `core` modules.
"""
