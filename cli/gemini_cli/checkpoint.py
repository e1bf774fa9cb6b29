"""`gemini checkpoint adopt-legacy`: copy a checkpoint of the legacy S3 layout
(`<prefix>/<job>/step-<v>/`, before namespace and uid were in the key) into one GeminiJob's
own directory (`<prefix>/<namespace>/<job>/<uid>/`), after checking it.

The legacy layout cannot tell whose a checkpoint is, so no job ever restores from it by
itself, nor deletes it by retention: this command is the explicit opt-in. It runs with the
user's S3 credentials (AWS_ACCESS_KEY_ID, AWS_SECRET_ACCESS_KEY, AWS_REGION or any other
source boto3 reads), never the operator's.
"""

from __future__ import annotations

import argparse
import re
from typing import Any

from gemini_cli import COMMANDS

_BUCKET_URI = re.compile(r"^s3://([a-z0-9][a-z0-9.-]{1,61}[a-z0-9])(?:/(\S*))?$")
DEFAULT_PREFIX = "gemini"  # as the operator renders GEMINI_S3_PREFIX for a URI without one


def register(subparsers: Any) -> None:
    parser = subparsers.add_parser("checkpoint", help=COMMANDS["checkpoint"].help)
    verbs = parser.add_subparsers(dest="verb", metavar="VERB")
    verbs.required = True
    adopt = verbs.add_parser(
        "adopt-legacy",
        help="copy a legacy checkpoint into a GeminiJob's own S3 directory, after checking it",
        description=(
            "Checks the legacy step's commit marker (job name, step, world size) and every "
            "rank's object against it, copies the objects to <prefix>/<namespace>/<job>/<uid>/"
            "step-<v>/, checks the copies and writes the job's own commit marker. The job "
            "then restores it like its own step (its next resume or S3 recovery); each "
            "shard's CRC-32 is checked as it is restored. Get the uid with: kubectl get "
            "geminijob NAME -n NAMESPACE -o jsonpath='{.metadata.uid}'."),
    )
    adopt.add_argument("--bucket-uri", required=True,
                       help="the job's spec.persistence.bucketURI, s3://bucket/prefix")
    adopt.add_argument("--endpoint", default=None,
                       help="the job's spec.persistence.endpoint (default: AWS)")
    adopt.add_argument("--namespace", required=True, help="the GeminiJob's namespace")
    adopt.add_argument("--job", required=True, help="the GeminiJob's name")
    adopt.add_argument("--uid", required=True, help="the GeminiJob's metadata.uid")
    adopt.add_argument("--world-size", type=int, required=True,
                       help="the GeminiJob's number of nodes (the legacy step must match)")
    adopt.add_argument("--from-job", default=None,
                       help="the job name of the legacy checkpoint (default: --job)")
    adopt.add_argument("--step", type=int, default=None,
                       help="the legacy step to copy (default: the newest committed one)")
    adopt.set_defaults(func=run_adopt)


def run_adopt(args: argparse.Namespace) -> int:
    from boto3.exceptions import Boto3Error
    from botocore.exceptions import BotoCoreError, ClientError

    from gemini_cli import CliError
    from gemini_sidecar.s3 import S3Error

    try:
        key = _adopt(args)
    except (S3Error, ValueError) as err:
        raise CliError(f"not adopted: {err}") from err
    except (BotoCoreError, ClientError, Boto3Error) as err:
        raise CliError(f"not adopted, S3 request failed: {err}") from err
    print(f"adopted: committed s3://{args.bucket_uri[5:].split('/')[0]}/{key}")
    return 0


def _adopt(args: argparse.Namespace) -> str:
    from gemini_sidecar import s3
    from gemini_sidecar.config import S3Settings

    match = _BUCKET_URI.match(args.bucket_uri)
    if match is None:
        raise ValueError(f"--bucket-uri {args.bucket_uri!r} is not s3://bucket/prefix")
    bucket, prefix = match.group(1), (match.group(2) or "").strip("/") or DEFAULT_PREFIX
    store = s3.open_store(S3Settings(bucket=bucket, prefix=prefix, endpoint_url=args.endpoint,
                                     region=_region()))
    legacy_name = args.from_job or args.job
    target = s3.JobIdentity(args.namespace, args.job, args.uid)
    step = args.step if args.step is not None else _newest_legacy(store, legacy_name)
    return s3.adopt_legacy(store, legacy_name, step, target, args.world_size)


def _newest_legacy(store: Any, name: str) -> int:
    from gemini_sidecar.s3 import S3Error, legacy_committed_steps, legacy_prefix

    steps = legacy_committed_steps(store, name)
    if not steps:
        raise S3Error(f"no committed legacy step under s3://{store.bucket}/"
                      f"{legacy_prefix(store, name)}")
    return steps[-1]


def _region() -> str:
    import os

    return os.environ.get("AWS_REGION") or os.environ.get("AWS_DEFAULT_REGION") or "us-east-1"
