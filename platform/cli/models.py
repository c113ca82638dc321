"""``retouch models fingerprint | verify | catalogue``: model folders on the machine that
holds them. ``verify`` is what an init container runs after copying weights from object
storage (exit 1 and one line when the copy is not the model the deploy names);
``catalogue`` writes the file a gateway without the weights checks deploys against."""

from __future__ import annotations

import argparse
import re
import sys
from pathlib import Path

from retouch.platform.cli.common import UsageError, local_input

HEX = re.compile(r"[0-9a-f]{64}")


def register(sub: argparse._SubParsersAction) -> None:
    models = sub.add_parser("models", help="fingerprint, verify and catalogue model folders")
    models_sub = models.add_subparsers(dest="models", required=True)
    fingerprint = models_sub.add_parser(
        "fingerprint", help="print a model folder's fingerprint (the template cache key's)"
    )
    fingerprint.add_argument("folder", type=Path, help="a diffusers folder or checkpoint file")
    fingerprint.set_defaults(run=_fingerprint)
    verify = models_sub.add_parser(
        "verify", help="exit 1 with one line unless a model folder has the given fingerprint"
    )
    verify.add_argument("folder", type=Path, help="a diffusers folder or checkpoint file")
    verify.add_argument("--fingerprint", required=True, help="the expected fingerprint (hex)")
    verify.set_defaults(run=_verify)
    catalogue = models_sub.add_parser(
        "catalogue", help="write the model catalogue of model folders (for --model-catalogue)"
    )
    catalogue.add_argument("folders", nargs="+", help="diffusers folders or cached hub ids")
    catalogue.add_argument("-o", "--output", type=Path, required=True, help="the JSON file")
    catalogue.add_argument("--variant", default=None, help="the weight variant (e.g. fp16)")
    catalogue.set_defaults(run=_catalogue)


def _model_path(folder: Path) -> Path:
    """``folder`` once it is seen to exist (an absent folder must not hash to a value)."""
    if not folder.exists():
        raise UsageError(f"no such model folder or file: {folder}")
    return folder.resolve()


def _fingerprint(args: argparse.Namespace) -> None:
    from retouch.runtime.fingerprint import model_fingerprint

    print(model_fingerprint(_model_path(args.folder)))


def _verify(args: argparse.Namespace) -> None:
    from retouch.runtime.fingerprint import model_fingerprint

    expected = args.fingerprint.strip().lower()
    if not HEX.fullmatch(expected):
        raise UsageError(f"--fingerprint must be 64 hex digits, got {args.fingerprint!r}")
    if not args.folder.exists():
        _fail(f"{args.folder}: no such model folder or file")
    actual = model_fingerprint(args.folder.resolve())
    if actual != expected:
        _fail(f"{args.folder}: fingerprint {actual} differs from the expected {expected}")


def _fail(message: str) -> None:
    print(f"error: {message}", file=sys.stderr)
    sys.exit(1)


def _catalogue(args: argparse.Namespace) -> None:
    from retouch.platform.state.catalogue import ModelCatalogue, catalogue_entry

    entries = [local_input(lambda m=m: catalogue_entry(m, args.variant)) for m in args.folders]
    args.output.write_text(ModelCatalogue({e.model: e for e in entries}).dumps())
    for entry in entries:
        print(f"{entry.model}  {entry.family}  {entry.bytes / 1e9:.2f} GB  {entry.fingerprint}")
