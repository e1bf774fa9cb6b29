"""Sidecar configuration from the environment: good values parse, bad ones say what to fix."""

from __future__ import annotations

import pytest

from gemini_sidecar.config import ConfigError, PeerAddress, from_env, parse_peers

BASE = {
    "GEMINI_JOB": "j1",
    "GEMINI_RANK": "1",
    "GEMINI_WORLD_SIZE": "4",
    "GEMINI_AUTH_TOKEN": "0123456789abcdef-secret",
    "GEMINI_MEMORY_BUDGET_BYTES": "1073741824",
    "GEMINI_PEERS": "0=10.0.0.1:7070,2=10.0.0.3:7070",
    "GEMINI_HOLD_RANKS": "0",
    "GEMINI_SEND_TO": "2",
    "GEMINI_POD_IP": "10.0.0.2",
}


def test_a_complete_environment_parses_into_a_config():
    cfg = from_env(BASE)
    assert (cfg.job, cfg.rank, cfg.world_size) == ("j1", 1, 4)
    assert cfg.placement.peers[2] == PeerAddress("10.0.0.3", 7070)
    assert cfg.placement.hold_ranks == (0,) and cfg.placement.send_to == (2,)
    assert (cfg.bind_host, cfg.peer_port, cfg.api_port) == ("10.0.0.2", 7070, 7071)
    assert cfg.traffic_mode == "interleaved" and cfg.s3 is None
    assert cfg.check_senders  # a rank's replica only from its own address, unless turned off
    assert not from_env(dict(BASE, GEMINI_PEER_SENDER_CHECK="off")).check_senders
    assert not cfg.peer_encryption  # off unless the job asks (spec.checkpoint.peerEncryption)
    assert from_env(dict(BASE, GEMINI_PEER_ENCRYPTION="on")).peer_encryption
    assert "secret" not in repr(cfg)
    assert cfg.probe_port is None  # /healthz on the API port only, unless a probe port is set
    assert from_env(dict(BASE, GEMINI_SIDECAR_PROBE_PORT="7072")).probe_port == 7072
    with pytest.raises(ConfigError, match="GEMINI_SIDECAR_PROBE_PORT"):
        from_env(dict(BASE, GEMINI_SIDECAR_PROBE_PORT="70000"))


def test_json_peer_maps_and_s3_settings_are_accepted():
    env = dict(BASE, GEMINI_PEERS='{"0": "h0:1000", "2": "[::1]:2000"}',
               GEMINI_S3_BUCKET="ckpt", GEMINI_S3_ENDPOINT="http://127.0.0.1:9000",
               GEMINI_S3_RETAIN="5", GEMINI_TRAFFIC_MODE="immediate")
    cfg = from_env(env)
    assert cfg.placement.peers == {0: PeerAddress("h0", 1000), 2: PeerAddress("::1", 2000)}
    assert cfg.s3 is not None and (cfg.s3.bucket, cfg.s3.retain) == ("ckpt", 5)
    assert cfg.traffic_mode == "immediate"


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"GEMINI_JOB": ""}, "GEMINI_JOB is not set"),
        ({"GEMINI_RANK": "4"}, "GEMINI_RANK must be between 0 and 3"),
        ({"GEMINI_WORLD_SIZE": "four"}, "GEMINI_WORLD_SIZE must be an integer"),
        ({"GEMINI_AUTH_TOKEN": "short"}, "at least 16 characters"),
        ({"GEMINI_PEERS": "0:10.0.0.1"}, "is not rank=host:port"),
        ({"GEMINI_PEERS": "{bad json"}, "not valid JSON"),
        ({"GEMINI_SEND_TO": "3"}, "no peer address for send-to ranks [3]"),
        ({"GEMINI_HOLD_RANKS": "1"}, "cannot hold or send to itself"),
        ({"GEMINI_HOLD_RANKS": "9"}, "GEMINI_HOLD_RANKS must be between 0 and 3"),
        ({"GEMINI_TRAFFIC_MODE": "burst"}, "interleaved or immediate"),
        ({"GEMINI_PEER_SENDER_CHECK": "token"}, "GEMINI_PEER_SENDER_CHECK must be address or"),
        ({"GEMINI_PEER_ENCRYPTION": "yes"}, "GEMINI_PEER_ENCRYPTION must be on or off"),
        ({"GEMINI_MEMORY_BUDGET_BYTES": "-1"}, "GEMINI_MEMORY_BUDGET_BYTES must be >= 0"),
        ({"GEMINI_S3_BUCKET": "b", "GEMINI_S3_PART_BYTES": "1024"}, "GEMINI_S3_PART_BYTES"),
        ({"GEMINI_CHUNK_BYTES": str(128 << 20)}, "GEMINI_CHUNK_BYTES must be between 4096 and"),
    ],
)
def test_bad_settings_are_refused_with_a_message_naming_the_fix(change, message):
    with pytest.raises(ConfigError) as err:
        from_env({**BASE, **change})
    assert message in str(err.value)


def test_an_empty_peer_map_is_allowed_for_a_sidecar_that_only_serves():
    assert parse_peers("") == {}
