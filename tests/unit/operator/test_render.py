"""Rendered children: names, labels, the native sidecar, shared memory, env, owner references."""

from __future__ import annotations

import base64

from gemini.control.signing import control_public_key
from gemini_operator.core import children, naming, render
from gemini_operator.core.spec import parse_spec
from tests.unit.operator.builders import make_job

JOB = render.JobRef("train", "ml", "uid-1")
CONFIG = render.RenderConfig()


def _pod(builder=None, rank=2, attempt=3, assignment=None):
    spec = parse_spec((builder or make_job()).spec(), "gemini:side")
    return render.worker_pod(JOB, spec, rank, attempt, CONFIG, assignment)


def _env(container):
    return {e["name"]: e.get("value", e.get("valueFrom")) for e in container["env"]}


def test_worker_pod_is_named_and_labelled_by_rank_and_attempt():
    pod = _pod()
    assert pod["metadata"]["name"] == "train-worker-2"
    labels = pod["metadata"]["labels"]
    assert labels[naming.LABEL_JOB] == "train"
    assert labels[naming.LABEL_RANK] == "2"
    assert labels[naming.LABEL_RESTART_ATTEMPT] == "3"
    assert pod["spec"]["hostname"] == "train-worker-2" and pod["spec"]["subdomain"] == "train"


def test_worker_pod_is_owned_by_the_job():
    (owner,) = _pod()["metadata"]["ownerReferences"]
    assert owner == {"apiVersion": "gemini.io/v1beta1", "kind": "GeminiJob", "name": "train",
                     "uid": "uid-1", "controller": True, "blockOwnerDeletion": True}


def test_trainer_runs_the_user_command_under_the_launcher():
    pod = _pod(make_job().set("template.args", ["--lr", "0.1"]))
    (trainer,) = pod["spec"]["containers"]
    assert trainer["command"] == ["gemini", "launch", "--", "python", "train.py"]
    assert trainer["args"] == ["--lr", "0.1"]
    # without in-process restarts the launcher exits with a failed process (container restart)
    (trainer,) = _pod(make_job().set("failurePolicy.inProcessRestart", False))["spec"][
        "containers"]
    assert trainer["command"][:4] == ["gemini", "launch", "--exit-on-failure", "--"]
    assert pod["spec"]["restartPolicy"] == "OnFailure"


def test_sidecar_is_a_native_sidecar_sharing_a_memory_volume():
    pod = _pod(make_job().set("checkpoint.memoryBudgetPerNode", "2Gi"))
    (sidecar,) = pod["spec"]["initContainers"]
    (trainer,) = pod["spec"]["containers"]
    assert sidecar["restartPolicy"] == "Always"
    assert sidecar["command"] == ["gemini", "sidecar"]
    (volume,) = pod["spec"]["volumes"]
    assert volume["emptyDir"] == {"medium": "Memory", "sizeLimit": str(2 << 30)}
    for container in (sidecar, trainer):
        (mount,) = container["volumeMounts"]
        assert mount["name"] == volume["name"]
        assert _env(container)["GEMINI_SHM_DIR"] == mount["mountPath"]
    assert _env(sidecar)["GEMINI_MEMORY_BUDGET_BYTES"] == str(2 << 30)


def test_env_carries_rank_world_rendezvous_and_the_token_from_the_secret():
    pod = _pod()
    trainer_env = _env(pod["spec"]["containers"][0])
    sidecar_env = _env(pod["spec"]["initContainers"][0])
    for env in (trainer_env, sidecar_env):
        assert env["GEMINI_JOB"] == "train" and env["GEMINI_RANK"] == "2"
        assert env["GEMINI_WORLD_SIZE"] == "4"
        assert env["GEMINI_AUTH_TOKEN"] == {"secretKeyRef": {"name": "train-peer-auth",
                                                             "key": "token"}}
        assert env["GEMINI_POD_IP"] == {"fieldRef": {"fieldPath": "status.podIP"}}
        # the public key of the operator's signatures, not the control token; not optional
        assert env["GEMINI_CONTROL_PUBLIC_KEY"] == {"secretKeyRef": {
            "name": "train-peer-auth", "key": "control-public-key"}}
    assert trainer_env["MASTER_ADDR"] == "train-worker-0.train.ml.svc.cluster.local"
    assert trainer_env["RANK"] == "2" and trainer_env["WORLD_SIZE"] == "4"
    assert trainer_env["PET_NNODES"] == "4"


def test_several_processes_per_node_leave_rank_to_the_launcher():
    env = _env(_pod(make_job().set("numProcPerNode", 8))["spec"]["containers"][0])
    assert "RANK" not in env and env["PET_NPROC_PER_NODE"] == "8"


def test_user_env_follows_the_operator_env():
    pod = _pod(make_job().set("template.env", [{"name": "LR", "value": "0.1"}]))
    names = [e["name"] for e in pod["spec"]["containers"][0]["env"]]
    assert names[-1] == "LR" and names.index("GEMINI_RANK") < names.index("LR")


def test_one_worker_or_spare_placeholder_per_node():
    (term,) = _pod()["spec"]["affinity"]["podAntiAffinity"][
        "requiredDuringSchedulingIgnoredDuringExecution"]
    assert term["topologyKey"] == "kubernetes.io/hostname"
    assert term["labelSelector"] == {
        "matchLabels": {naming.LABEL_JOB: "train"},
        "matchExpressions": [{"key": naming.LABEL_ROLE, "operator": "In",
                              "values": [naming.ROLE_WORKER, naming.ROLE_SPARE]}]}


def test_placement_assignment_goes_into_the_sidecar_env():
    assignment = render.PeerAssignment((1,), (3,), {1: "a:7070", 3: "b:7070"})
    env = _env(_pod(assignment=assignment)["spec"]["initContainers"][0])
    assert env["GEMINI_PEERS"] == "1=a:7070,3=b:7070"
    assert env["GEMINI_HOLD_RANKS"] == "1" and env["GEMINI_SEND_TO"] == "3"
    assert "GEMINI_PEERS" not in _env(_pod()["spec"]["initContainers"][0])


def test_peer_encryption_reaches_the_sidecar():
    sidecar_env = [_env(_pod(builder)["spec"]["initContainers"][0]) for builder in (
        make_job(), make_job().set("checkpoint.peerEncryption", True))]
    assert [env["GEMINI_PEER_ENCRYPTION"] for env in sidecar_env] == ["off", "on"]


def test_persistence_settings_and_credentials_reach_the_sidecar():
    builder = make_job().set("persistence", {"bucketURI": "s3://ckpt/run", "keep": 4,
                                             "endpoint": "http://s3:80",
                                             "credentialsSecretRef": {"name": "creds"}})
    env = _env(_pod(builder)["spec"]["initContainers"][0])
    assert env["GEMINI_S3_BUCKET"] == "ckpt" and env["GEMINI_S3_PREFIX"] == "run"
    assert env["GEMINI_S3_RETAIN"] == "4" and env["GEMINI_S3_ENDPOINT"] == "http://s3:80"
    assert env["GEMINI_S3_ACCESS_KEY"] == {"secretKeyRef": {"name": "creds",
                                                            "key": "AWS_ACCESS_KEY_ID"}}


def test_headless_service_publishes_not_ready_workers():
    service = children.headless_service(JOB, CONFIG)
    assert service["metadata"]["name"] == "train"
    assert service["spec"]["clusterIP"] == "None"
    assert service["spec"]["publishNotReadyAddresses"] is True
    assert service["spec"]["selector"] == naming.worker_selector("train")


def test_peer_secret_holds_the_job_token_and_only_the_public_key_of_the_control_token():
    secret = children.peer_secret(JOB, "s3cr3t-token-0123456789", "c0ntrol-token-0123456789")
    assert secret["metadata"]["name"] == "train-peer-auth"
    values = {k: base64.b64decode(v).decode() for k, v in secret["data"].items()}
    assert values == {"token": "s3cr3t-token-0123456789",
                      "control-public-key": control_public_key("c0ntrol-token-0123456789")}
    assert "c0ntrol-token-0123456789" not in str(secret)
    assert secret["metadata"]["ownerReferences"][0]["uid"] == "uid-1"
    kept = children.control_secret(JOB, "c0ntrol-token-0123456789")
    assert kept["metadata"]["name"] == "train-control"
    assert base64.b64decode(kept["data"]["token"]).decode() == "c0ntrol-token-0123456789"


def test_the_warm_standby_is_asked_of_the_launcher_unless_the_policy_turns_it_off():
    def trainer_env(builder):
        trainer = next(c for c in _pod(builder)["spec"]["containers"] if c["name"] == "trainer")
        return _env(trainer)

    assert trainer_env(make_job())["GEMINI_LAUNCHER_STANDBY"] == "1"
    assert "GEMINI_LAUNCHER_STANDBY" not in trainer_env(
        make_job().set("failurePolicy.warmStandby", False))


def test_in_process_restarts_are_on_unless_the_policy_turns_them_off():
    def trainer_env(builder):
        trainer = next(c for c in _pod(builder)["spec"]["containers"] if c["name"] == "trainer")
        return _env(trainer)

    assert trainer_env(make_job())["GEMINI_LAUNCHER_IN_PROCESS"] == "1"
    assert trainer_env(make_job().set("failurePolicy.inProcessRestart", False))[
        "GEMINI_LAUNCHER_IN_PROCESS"] == "0"


def test_launchers_are_told_the_hint_url_only_when_the_operator_serves_hints():
    def trainer_env(config):
        spec = parse_spec(make_job().spec(), "gemini:side")
        pod = render.worker_pod(JOB, spec, 1, 0, config)
        trainer = next(c for c in pod["spec"]["containers"] if c["name"] == "trainer")
        return _env(trainer)

    assert "GEMINI_OPERATOR_HINT_URL" not in trainer_env(CONFIG)
    served = render.RenderConfig(hint_url="http://gemini-operator-hints.gemini-system.svc:8090")
    env = trainer_env(served)
    assert env["GEMINI_OPERATOR_HINT_URL"] == served.hint_url
    # what the launcher names itself with in the hint
    assert {"GEMINI_JOB", "GEMINI_NAMESPACE", "GEMINI_JOB_UID", "GEMINI_RANK",
            "GEMINI_AUTH_TOKEN"} <= set(env)
