"""The config-reloader of a Prometheus that runs on the host (gemini_local.monitoring):
`python -m gemini_local.promreload --kubeconfig K --namespace N --prometheus P --state-dir D
--config FILE --url URL`.

It does what the prometheus-config-reloader sidecar and the pod's volumes do in a cluster:
every `--interval` seconds it reads the operator's output for Prometheus `P` (the Secret
prometheus-P, the ConfigMaps prometheus-P-rulefiles-N, the Secrets prometheus-P-tls-assets-N),
writes the files under D/etc-prometheus (the pod's /etc/prometheus) and the configuration,
rewritten for the host (gemini_local.promconfig), to FILE, and POSTs URL/-/reload. After the
first successful reload it writes D/applied. Polling, not a watch: a few small reads a second.
"""

from __future__ import annotations

import argparse
import base64
import hashlib
import json
import os
import shutil
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from kubernetes import client, config

from gemini_local import promconfig

Files = dict[str, bytes]


@dataclass(frozen=True)
class Generated:
    """What the operator generated for one Prometheus, as the pod would see it."""

    config: str  # the configuration, as generated (before host_config)
    rules: dict[str, Files]  # rulefiles ConfigMap name -> file name -> content
    certs: Files  # the TLS assets Secrets' files (in the pod: /etc/prometheus/certs)

    def digest(self) -> str:
        blob = json.dumps([self.config, {cm: {k: v.hex() for k, v in files.items()}
                                         for cm, files in self.rules.items()},
                           {k: v.hex() for k, v in self.certs.items()}], sort_keys=True)
        return hashlib.sha256(blob.encode()).hexdigest()


def read_generated(core: client.CoreV1Api, namespace: str, prometheus: str) -> Generated | None:
    """The operator's output for `prometheus`; None until its configuration Secret exists."""
    prefix = f"prometheus-{prometheus}"
    try:
        secret = core.read_namespaced_secret(prefix, namespace)
    except client.ApiException as err:
        if err.status == 404:
            return None
        raise
    text = promconfig.decode(base64.b64decode((secret.data or {})[promconfig.CONFIG_KEY]))
    maps = core.list_namespaced_config_map(namespace,
                                           label_selector=f"prometheus-name={prometheus}")
    rules = {_name(cm): {k: v.encode() for k, v in (cm.data or {}).items()}
             for cm in maps.items if _name(cm).startswith(f"{prefix}-rulefiles-")}
    certs: Files = {}
    for s in core.list_namespaced_secret(namespace).items:
        if _name(s).startswith(f"{prefix}-tls-assets"):
            certs.update({k: base64.b64decode(v) for k, v in (s.data or {}).items()})
    return Generated(text, rules, certs)


def _name(obj: client.V1ConfigMap | client.V1Secret) -> str:
    return str(obj.metadata.name) if obj.metadata and obj.metadata.name else ""


def write_files(generated: Generated, etc_dir: Path) -> None:
    """The rule files and certificates where the rewritten configuration names them; files
    the operator no longer generates are removed."""
    for folder, files in [*((promconfig.rule_dir(etc_dir, cm), f)
                            for cm, f in generated.rules.items()),
                          (promconfig.certs_dir(etc_dir), generated.certs)]:
        _replace_folder(folder, files)
    rules = etc_dir / "rules"
    for stale in (rules.iterdir() if rules.exists() else ()):
        if stale.name not in generated.rules:
            shutil.rmtree(stale)


def _replace_folder(folder: Path, files: Mapping[str, bytes]) -> None:
    fresh = folder.with_name(folder.name + ".new")
    shutil.rmtree(fresh, ignore_errors=True)
    fresh.mkdir(parents=True)
    for name, content in files.items():
        (fresh / name).write_bytes(content)
    shutil.rmtree(folder, ignore_errors=True)
    fresh.rename(folder)


def reload(url: str) -> str | None:
    """POST `url`/-/reload; None when Prometheus took the configuration, else why not."""
    request = urllib.request.Request(url + "/-/reload", method="POST")
    try:
        with urllib.request.urlopen(request, timeout=30):
            return None
    except urllib.error.HTTPError as err:
        return f"{err.code}: {err.read().decode(errors='replace').strip()}"
    except (urllib.error.URLError, OSError) as err:
        return str(err)


def apply(generated: Generated, args: argparse.Namespace) -> str | None:
    """Write `generated` for the host and reload Prometheus; None on success, else why not."""
    etc_dir = args.state_dir / "etc-prometheus"
    try:
        text = promconfig.host_config(generated.config, args.kubeconfig, etc_dir,
                                      promconfig.pod_variables(args.prometheus))
    except (promconfig.ConfigError, ValueError) as err:
        return f"cannot rewrite the generated configuration: {err}"
    write_files(generated, etc_dir)
    fresh = args.config.with_name(args.config.name + ".new")
    fresh.write_text(text)
    os.replace(fresh, args.config)
    return reload(args.url)


def run(args: argparse.Namespace) -> None:
    core = client.CoreV1Api(config.new_client_from_config(str(args.kubeconfig)))
    applied, failure = "", ""
    while True:
        try:
            generated = read_generated(core, args.namespace, args.prometheus)
        except (client.ApiException, OSError, EOFError, KeyError, ValueError) as err:
            generated, failure = None, _say(f"reading the operator's output: {err}", failure)
        if generated is not None and generated.digest() != applied:
            error = apply(generated, args)
            if error is None:
                applied, failure = generated.digest(), ""
                (args.state_dir / "applied").write_text(applied + "\n")
                print(f"loaded configuration {applied[:12]}", flush=True)
            else:
                failure = _say(f"reload failed (retrying): {error}", failure)
        time.sleep(args.interval)


def _say(message: str, last: str) -> str:
    """Print `message` unless it repeats the last one; return it."""
    if message != last:
        print(message, file=sys.stderr, flush=True)
    return message


def parse(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m gemini_local.promreload")
    parser.add_argument("--kubeconfig", type=Path, required=True)
    parser.add_argument("--namespace", required=True)
    parser.add_argument("--prometheus", required=True, help="the Prometheus resource's name")
    parser.add_argument("--state-dir", type=Path, required=True)
    parser.add_argument("--config", type=Path, required=True, help="Prometheus' config file")
    parser.add_argument("--url", required=True, help="Prometheus, e.g. http://127.0.0.1:9090")
    parser.add_argument("--interval", type=float, default=0.5)
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> Any:
    run(parse(sys.argv[1:] if argv is None else argv))


if __name__ == "__main__":
    main()
