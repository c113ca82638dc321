"""Step records kept beside a profile: what a new executor's step fit starts from."""

from __future__ import annotations

import json
from pathlib import Path

from retouch.runtime.steprecords import (
    KEPT,
    load_step_records,
    save_step_records,
    steps_path,
)


def profile(tmp_path: Path, text: str = '{"blocks": []}') -> Path:
    path = tmp_path / "abc-cpu.json"
    path.write_text(text)
    return path


def test_records_come_back_for_the_same_profile_only(tmp_path: Path) -> None:
    prof = profile(tmp_path)
    pairs = [(float(i + 1), 2.0 * (i + 1)) for i in range(KEPT + 30)]
    save_step_records(prof, pairs)
    assert steps_path(prof) == tmp_path / "abc-cpu.steps.json"
    assert load_step_records(prof) == pairs[-KEPT:]  # the latest, bounded
    prof.write_text('{"blocks": [1]}')  # re-profiled: the old steps calibrated another plan
    assert load_step_records(prof) == []


def test_a_missing_or_damaged_file_gives_no_records(tmp_path: Path) -> None:
    prof = profile(tmp_path)
    assert load_step_records(prof) == []
    steps_path(prof).write_text("{not json")
    assert load_step_records(prof) == []
    save_step_records(prof, [(10.0, 12.0), (0.0, 5.0)])  # a pair without a plan is dropped
    assert load_step_records(prof) == [(10.0, 12.0)]
    doc = json.loads(steps_path(prof).read_text())
    doc["version"] = 99
    steps_path(prof).write_text(json.dumps(doc))
    assert load_step_records(prof) == []


def test_nothing_is_written_without_a_profile(tmp_path: Path) -> None:
    missing = tmp_path / "none-cpu.json"
    save_step_records(missing, [(1.0, 1.0)])
    assert not steps_path(missing).exists()
