"""Client side, functions: ``retouch deploy | ls | rm | invoke``."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from retouch.functions.knobs import words
from retouch.functions.wire.invoke import InvokeResult
from retouch.platform.api.client import Job, read_spec_file
from retouch.platform.cli.common import (
    UsageError,
    add_json,
    bar,
    client_options,
    connect,
    existing_file,
    local_input,
    non_negative_float,
    non_negative_int,
    positive_int,
    print_table,
    unit_interval,
)


def register(sub: argparse._SubParsersAction) -> None:
    p = client_options(sub.add_parser("deploy", help="deploy a function from a TOML spec"))
    p.add_argument("spec", type=existing_file, help="the function's TOML spec")
    p.add_argument(
        "--no-wait", action="store_true", help="return once stored, before executors load it"
    )
    p.add_argument(
        "--wait",
        choices=("baked", "ready"),
        default="baked",
        help="baked (default): until every template is baked, so first edits are mask-aware; "
        "ready: once executors have loaded it",
    )
    add_json(p, "the function's document")
    p.set_defaults(run=_deploy)

    p = client_options(sub.add_parser("ls", help="list functions"))
    add_json(p, "the functions' documents")
    p.set_defaults(run=_ls)

    p = client_options(sub.add_parser("rm", help="delete a function"))
    p.add_argument("name", help="the function's name")
    add_json(p, "the answer")
    p.set_defaults(run=_rm)

    p = client_options(sub.add_parser("invoke", help="edit a template: paint the masked region"))
    p.add_argument("name", help="the function's name")
    what = p.add_mutually_exclusive_group(required=True)
    what.add_argument("--template", help="the template to edit (its id in the spec)")
    what.add_argument(
        "--image",
        type=existing_file,
        help="or an image file to edit (the function's resolution): its first edit runs in "
        "full, later ones mask-aware",
    )
    p.add_argument(
        "--mask", type=existing_file, required=True, help="mask image file, nonzero = edit"
    )
    p.add_argument("--prompt", required=True, help="what to paint in the masked region")
    p.add_argument("--negative-prompt", default=None, help="what the edit steers away from")
    p.add_argument(
        "--seed", type=non_negative_int, default=None, help="noise seed (default: a random one)"
    )
    p.add_argument(
        "--steps",
        "--num-inference-steps",
        type=positive_int,
        default=None,
        help="denoising steps (default: the spec's)",
    )
    p.add_argument(
        "--guidance",
        "--guidance-scale",
        type=non_negative_float,
        default=None,
        help="guidance scale (default: the spec's)",
    )
    p.add_argument(
        "--strength",
        type=unit_interval,
        default=None,
        help="how far the masked region may move from the image, in (0, 1] (default 1)",
    )
    p.add_argument(
        "--scheduler",
        default=None,
        help="one of the schedulers the function allows (default: its own)",
    )
    p.add_argument(
        "--padding-mask-crop",
        type=non_negative_int,
        default=None,
        help="edit only a crop around the mask, padded by this many pixels, and paste it back",
    )
    p.add_argument(
        "-n",
        "--num-images-per-prompt",
        type=positive_int,
        default=1,
        help="images of this request, seeds seed, seed+1, ...; written as OUTPUT-0, "
        "OUTPUT-1, ... (default 1: OUTPUT)",
    )
    p.add_argument(
        "--format",
        choices=("png", "webp", "raw"),
        default="png",
        help="output image encoding (default png)",
    )
    p.add_argument(
        "-o",
        "--output",
        type=Path,
        default=Path("out.png"),
        help="where to write the image (default ./out.png)",
    )
    p.add_argument(
        "--async",
        dest="as_job",
        action="store_true",
        help="submit a job and print only its id (JID=$(retouch invoke ... --async); then "
        "retouch jobs watch $JID); its status goes to stderr",
    )
    p.add_argument("--webhook", default=None, help="with --async: URL told about the job")
    p.add_argument(
        "--webhook-events",
        type=words,
        default=None,
        help="with --webhook: started,progress,completed (default completed)",
    )
    add_json(p, "the job document (--async) or the result without its image")
    p.set_defaults(run=_invoke)


def _deploy(args: argparse.Namespace) -> None:
    spec, images = local_input(lambda: read_spec_file(args.spec))
    with connect(args) as client:
        doc = client.deploy(spec, images, wait=not args.no_wait)
        baking = ""
        if not args.no_wait and args.wait == "baked" and doc["status"] == "ready":
            tty = sys.stderr.isatty()

            def progress(baked: int, total: int) -> None:
                line = f"baking templates {bar(baked / max(1, total))} {baked}/{total}"
                print(line, end="\r" if tty else "\n", file=sys.stderr)

            doc = client.wait_baked(doc["name"], on_progress=progress)
            if tty:
                print(file=sys.stderr)
            states = [t["state"] for t in doc["templates"].values()]
            baking = f", {states.count('baked')}/{len(states)} templates baked"
    if args.json:
        print(json.dumps(doc))
    else:
        field = f", field {doc['error_field']}" if doc.get("error_field") else ""
        error = f" ({doc['error']}{field})" if doc.get("error") else ""
        print(f"{doc['name']}: {doc['status']}{baking}{error}")
    if doc["status"] == "failed":
        sys.exit(1)


def _ls(args: argparse.Namespace) -> None:
    with connect(args) as client:
        functions = client.list()
        executors = [
            {"name": e["name"], "adapters": (e.get("state") or {}).get("adapters", [])}
            for e in client.executors()["executors"]
        ]
    if args.json:
        print(json.dumps(functions))
        return
    rows = []
    for f in functions:
        templates = ", ".join(f"{name} ({t['state']})" for name, t in f["templates"].items())
        adapters = ", ".join(f"{a['name']}@{a['scale']:g}" for a in f.get("adapters", ())) or "-"
        rows.append(
            [f["name"], f["status"], f["family"], f["model"], f["dtype"], adapters, templates]
        )
    print_table(["NAME", "STATUS", "FAMILY", "MODEL", "DTYPE", "ADAPTERS", "TEMPLATES"], rows)
    resident = [(e["name"], e["adapters"]) for e in executors if e["adapters"]]
    if resident:
        print()
        print_table(
            ["EXECUTOR", "RESIDENT ADAPTER SETS (least recently used first)"],
            [[name, ", ".join(sets)] for name, sets in resident],
        )


def _rm(args: argparse.Namespace) -> None:
    with connect(args) as client:
        doc = client.delete(args.name)
    print(json.dumps(doc) if args.json else f"deleted {args.name}")


def _invoke(args: argparse.Namespace) -> None:
    try:
        mask = args.mask.read_bytes()
    except OSError as exc:
        raise UsageError(f"--mask: cannot read {args.mask}: {exc.strerror}") from exc
    options = {
        "steps": args.steps,
        "guidance": args.guidance,
        "format": args.format,
        "negative_prompt": args.negative_prompt,
        "strength": args.strength,
        "padding_mask_crop": args.padding_mask_crop,
        "scheduler": args.scheduler,
    }
    if args.image is not None:
        try:
            options["image"] = args.image.read_bytes()
        except OSError as exc:
            raise UsageError(f"--image: cannot read {args.image}: {exc.strerror}") from exc
    if not args.as_job and args.webhook is not None:
        raise UsageError("--webhook needs --async")
    if args.as_job and args.num_images_per_prompt != 1:
        raise UsageError("--num-images-per-prompt: a job makes one image (submit one per seed)")
    if args.as_job:
        options |= {"webhook": args.webhook, "webhook_events": args.webhook_events}
    given = {k: v for k, v in options.items() if v is not None}
    with connect(args) as client:
        if args.as_job:
            job = client.submit(args.name, args.template, mask, args.prompt, args.seed, **given)
        else:
            results = client.invoke_images(
                args.name, args.template, mask, args.prompt, args.seed,
                args.num_images_per_prompt, **given,
            )  # fmt: skip
    if args.as_job:
        _print_submitted(job, args.json)
        return
    for i, result in enumerate(results):
        output = args.output if len(results) == 1 else _numbered(args.output, i)
        _print_result(output, result, args.json)


def _numbered(path: Path, i: int) -> Path:
    """``out.png`` → ``out-0.png``: where image ``i`` of several is written."""
    return path.with_name(f"{path.stem}-{i}{path.suffix}")


def _print_submitted(result: Job, as_json: bool) -> None:
    if as_json:
        print(json.dumps(result.doc))
        return
    position = result.doc.get("queue_position")
    where = f" (queue position {position})" if position is not None else ""
    print(result.id)  # alone on stdout: a script captures it
    print(f"{result.doc['status']}{where}", file=sys.stderr)


def _print_result(output: Path, result: InvokeResult, as_json: bool) -> None:
    output.write_bytes(result.image)  # already encoded in the requested format
    if as_json:
        doc = {k: v for k, v in result.to_wire().items() if k != "image"}
        print(json.dumps({"output": str(output), **doc}))
        return
    t = result.timings
    print(
        f"{output}: {result.width}x{result.height} seed={result.seed} mask_ratio={result.mask_ratio:.3f} path={result.path} executor={result.executor} total={t.total_ms:.0f}ms run={t.run_ms:.0f}ms queue={t.queue_ms:.0f}ms"
    )
