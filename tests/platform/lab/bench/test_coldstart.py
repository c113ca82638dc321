"""``bench coldstart``'s two sides read the same bytes: the load counts until every weight
was read from the files, which on a CPU stay memory-mapped after the loader returns."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from retouch.functions.demo.models import ensure_demo_model
from retouch.platform.lab.bench.coldstart import run_coldstart_bench, touch, weight_files
from retouch.runtime.models import load_pipeline


def mapped_rss(files: list[Path]) -> int:
    """Bytes of ``files`` resident in this process's memory maps (/proc/self/smaps)."""
    names = {str(p.resolve()) for p in files}
    total, current = 0, False
    for line in Path("/proc/self/smaps").read_text().splitlines():
        head = line.split()
        if len(head) >= 6 and "-" in head[0]:
            current = head[-1] in names
        elif current and line.startswith("Rss:"):
            total += int(head[1]) * 1024
    return total


def test_touch_reads_every_weight_of_a_lazily_mapped_load(models_dir: Path) -> None:
    folder = ensure_demo_model("retouch:tiny-sd", models_dir)
    files = [p for p in weight_files(folder) if p.suffix == ".safetensors"]
    size = sum(p.stat().st_size for p in files)
    pipe = load_pipeline(folder, "sd-inpaint", torch.device("cpu"))
    touch(pipe)
    mapped = mapped_rss(files)
    # memory-mapped weights are all resident once touched (or the loader copied them: none)
    assert mapped >= 0.9 * size or mapped == 0


def test_the_bench_reports_both_caches_for_the_same_bytes(models_dir: Path) -> None:
    rows = run_coldstart_bench("retouch:tiny-sd", models_dir, torch.device("cpu"), rounds=1)
    assert [r["cache"] for r in rows] == ["cold", "warm"]
    for row in rows:
        assert row["weight_bytes"] > 0 and row["raw_read_s"] > 0 and row["load_s"] > 0
        # the ratio of the two times reported (each rounded on its own: a 4 ms read to 0.1 ms)
        ratio = row["raw_read_s"] / row["load_s"]
        assert row["load_vs_raw_read"] == pytest.approx(ratio, rel=0.05, abs=0.002)
