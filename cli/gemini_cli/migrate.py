"""`gemini migrate FILE`: GeminiJob manifests from gemini.io/v1alpha1 to v1beta1.

v1alpha1's `spec.template` held the trainer container's fields; v1beta1's is a pod template
(metadata + a PodSpec with a container named `trainer`). Both versions are served and read
each other's objects, so running jobs need nothing; this rewrites the manifests you keep.
Other documents pass through unchanged. YAML comments are not kept.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any

import yaml

from gemini_cli import COMMANDS
from gemini_operator.core import naming
from gemini_operator.core.pod_template import from_v1alpha1

OLD_API_VERSION = f"{naming.GROUP}/v1alpha1"


def register(subparsers: Any) -> None:
    parser = subparsers.add_parser("migrate", help=COMMANDS["migrate"].help,
                                   description=__doc__)
    parser.add_argument("file", help="a YAML file of manifests, or - for standard input")
    parser.set_defaults(func=run)


def migrated(doc: Any) -> Any:
    """One manifest: a v1alpha1 GeminiJob as v1beta1, anything else unchanged."""
    if not isinstance(doc, dict) or doc.get("kind") != naming.KIND or (
            doc.get("apiVersion") != OLD_API_VERSION):
        return doc
    out = dict(doc, apiVersion=naming.API_VERSION)
    spec = dict(out.get("spec") or {})
    if isinstance(spec.get("template"), dict):
        spec["template"] = from_v1alpha1(spec["template"])
    out["spec"] = spec
    return out


def run(args: argparse.Namespace) -> int:
    text = sys.stdin.read() if args.file == "-" else Path(args.file).read_text(encoding="utf-8")
    try:
        docs = list(yaml.safe_load_all(text))
    except yaml.YAMLError as err:
        print(f"gemini migrate: {args.file} is not YAML: {err}", file=sys.stderr)
        return 2
    yaml.safe_dump_all([migrated(d) for d in docs if d is not None], sys.stdout,
                       sort_keys=False)
    return 0
