"""Client side, async jobs: ``retouch jobs ls | watch | cancel``."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from retouch.functions.wire.jobs import JobEventKind
from retouch.platform.cli.common import (
    add_json,
    bar,
    client_options,
    connect,
    positive_int,
    print_table,
)


def register(sub: argparse._SubParsersAction) -> None:
    jobs = sub.add_parser("jobs", help="async jobs: list, watch, cancel")
    jobs_sub = jobs.add_subparsers(dest="jobs", required=True)
    p = client_options(jobs_sub.add_parser("ls", help="list jobs, newest first"))
    p.add_argument(
        "--status",
        choices=("queued", "running", "succeeded", "failed", "canceled"),
        default=None,
        help="only jobs in this state",
    )
    p.add_argument("--function", default=None, help="only jobs of this function")
    p.add_argument(
        "--limit", type=positive_int, default=50, help="at most this many jobs (default 50)"
    )
    add_json(p, "the jobs")
    p.set_defaults(run=_ls)
    p = client_options(jobs_sub.add_parser("watch", help="follow a job with a progress bar"))
    p.add_argument("id", help="the job's id")
    p.add_argument(
        "-o", "--output", type=Path, default=None, help="write the image here when it succeeds"
    )
    add_json(p, "the finished job's document (without its image)")
    p.set_defaults(run=_watch)
    p = client_options(jobs_sub.add_parser("cancel", help="cancel a queued or running job"))
    p.add_argument("id", help="the job's id")
    add_json(p, "the job's document")
    p.set_defaults(run=_cancel)


def _ls(args: argparse.Namespace) -> None:
    with connect(args) as client:
        jobs = client.jobs(args.status, args.function, args.limit)
    if args.json:
        print(json.dumps(jobs))
        return
    rows = []
    for job in jobs:
        detail = ""
        if job["status"] == "queued":
            detail = f"position {job.get('queue_position')}"
        elif job["status"] == "running" and job.get("progress"):
            detail = f"step {job['progress']['step']}/{job['progress']['total']}"
        elif job.get("error"):
            detail = f"{job['error']['code']}: {job['error']['message']}"
        elif job.get("result"):
            detail = (
                f"path={job['result']['path']} total={job['result']['timings']['total_ms']:.0f}ms"
            )
        rows.append([job["id"], job["status"], job["function"], job["created_at"], detail])
    print_table(["ID", "STATUS", "FUNCTION", "CREATED", "DETAIL"], rows)


def _watch(args: argparse.Namespace) -> None:
    """Follow the job's events: queue position, then a step progress bar (on stderr)."""
    tty = sys.stderr.isatty()
    end = "\r" if tty else "\n"
    with connect(args) as client:
        job = client.job(args.id)
        for event in job.events():
            data = event.data
            if event.kind is JobEventKind.QUEUED and data.get("position") is not None:
                print(f"queued, position {data['position']}", end=end, file=sys.stderr)
            elif event.kind is JobEventKind.STARTED:
                print(f"started on {data['executor']}" + " " * 20, end=end, file=sys.stderr)
            elif event.kind is JobEventKind.PROGRESS:
                eta = f" eta {data['eta_s']:.1f}s" if data.get("eta_s") is not None else ""
                line = f"{bar(data['fraction'])} {data['step']}/{data['total']}{eta}"
                print(line + " " * 10, end=end, file=sys.stderr)
        if tty:
            print(file=sys.stderr)
        job.status()
        status = job.doc["status"]
        if status != "succeeded":
            error = job.doc.get("error") or {}
            message = f": {error.get('code')}: {error.get('message')}" if error else ""
            print(json.dumps(job.doc) if args.json else f"{job.id} {status}{message}")
            sys.exit(1)
        result = job.wait()
    if args.output is not None:
        args.output.write_bytes(result.image)
    if args.json:
        doc = {**job.doc, "result": {k: v for k, v in job.doc["result"].items() if k != "image"}}
        print(json.dumps({"written": None if args.output is None else str(args.output), **doc}))
        return
    out = f" -> {args.output}" if args.output is not None else ""
    print(
        f"{job.id} succeeded{out}: {result.width}x{result.height} path={result.path} total={result.timings.total_ms:.0f}ms"
    )


def _cancel(args: argparse.Namespace) -> None:
    with connect(args) as client:
        doc = client.job(args.id).cancel()
    print(json.dumps(doc) if args.json else f"{doc['id']} {doc['status']}")
