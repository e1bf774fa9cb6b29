"""The control contract between the operator, the checkpoint sidecar and the launcher (stdlib
only), one module per job; import from the module, this package re-exports nothing:

- ``paths``: the APIs' paths and the ordering rules their servers require of callers;
- ``strict``: strict JSON (``parse_json``) and the typed field reads every message uses;
- ``messages``: the error answer, health, notify, the placement (``Peers``), the profile;
- ``inventory``: a sidecar's inventory and the relay of many (``/inventories``);
- ``transfers``: fetch, fetch-replicas, persist, commit, restore and a running transfer;
- ``launcher``: the launcher's status and restart, the parked epoch, the failure hint;
- ``files``: the heartbeat and parked-marker files in the shared memory volume;
- ``auth``: the job and control tokens, and who may make which call;
- ``client``: ``ControlClient`` (HTTP with one deadline a call, bounded answers) and
  ``ControlError``.

All but ``files`` and ``client`` do no I/O and import no network, thread or clock module;
``files`` no network or thread module (pyproject's import contracts).
"""
