"""The gateway's memory limits (``platform/api/limits.py``): the defaults derived from the
machine and the pixel limit, and the start-up log lines that state them (read from a real
``retouch serve``'s log)."""

from __future__ import annotations

import platform
import subprocess
import sys
from pathlib import Path

import pytest

from retouch.functions.imaging import MAX_PIXELS
from retouch.platform.api.imagegate import BYTES_PER_PIXEL
from retouch.platform.api.limits import GatewayLimits, logged_decode_budget
from retouch.platform.api.server import ServerProcess
from retouch.platform.jobs.retention import RetentionLimits

GiB, MiB = 1 << 30, 1 << 20


def test_the_default_decode_budget_is_what_a_gateway_needs_not_a_share_of_the_machine() -> None:
    """On a 24 GB machine: two decodes at the 4096 x 4096 limit (768 MiB), within 1 GiB;
    the request-body budget stays an eighth of the memory."""
    limits = GatewayLimits.resolve(MAX_PIXELS, machine_bytes=24 * GiB)
    assert limits.decode_bytes == 2 * MAX_PIXELS * BYTES_PER_PIXEL == 768 * MiB
    assert limits.decode_bytes <= GiB
    assert limits.body_bytes == 3 * GiB
    bigger = GatewayLimits.resolve(MAX_PIXELS, machine_bytes=256 * GiB)
    assert bigger.decode_bytes == limits.decode_bytes  # more memory buys no more decodes


def test_the_default_decode_budget_follows_the_pixel_limit_within_an_eighth() -> None:
    small_images = GatewayLimits.resolve(512 * 512, machine_bytes=24 * GiB)
    assert small_images.decode_bytes == 2 * 512 * 512 * BYTES_PER_PIXEL  # 12 MiB
    small_pod = GatewayLimits.resolve(MAX_PIXELS, machine_bytes=2 * GiB)
    assert small_pod.decode_bytes == 256 * MiB == small_pod.body_bytes  # an eighth of 2 GiB


def test_settings_given_win_over_the_defaults() -> None:
    limits = GatewayLimits.resolve(
        MAX_PIXELS, decode_bytes=5 * GiB, body_bytes=7 * MiB, machine_bytes=24 * GiB
    )
    assert (limits.decode_bytes, limits.body_bytes) == (5 * GiB, 7 * MiB)
    assert limits.decode_given and limits.body_given


def test_the_log_lines_state_each_figure_and_where_it_came_from() -> None:
    caps = RetentionLimits(100, 10, 3 * GiB, 300 * MiB)
    limits = GatewayLimits.resolve(MAX_PIXELS, retention=caps, machine_bytes=24 * GiB)
    decode, body, retention = limits.log_lines()
    assert decode.startswith("decode budget 768.0 MiB (805306368 bytes): 2 decodes at the")
    assert "24.0 GiB" in decode and "--decode-memory-bytes sets it" in decode
    assert body.startswith("request-body budget 3.0 GiB (3221225472 bytes): an eighth of")
    assert retention == (
        "job retention caps: 100 live jobs (10 per tenant), 3.0 GiB retained (300.0 MiB per tenant)"
    )
    assert logged_decode_budget("noise\nINFO x: " + decode + "\nmore") == limits.decode_bytes
    given = GatewayLimits.resolve(MAX_PIXELS, decode_bytes=12345, machine_bytes=24 * GiB)
    line = given.log_lines()[0]
    assert line == "decode budget 12.1 KiB (12345 bytes): --decode-memory-bytes"
    assert logged_decode_budget(line) == 12345 and logged_decode_budget("no budget") is None


def test_a_gateway_states_the_limits_it_derived_in_its_start_up_log(tmp_path: Path) -> None:
    """A real ``retouch serve`` (autoscaled: no executor needed) with the default decode
    budget and a request-body budget given: one INFO line each, with this machine's
    figures, and the decode budget within 1 GiB."""
    given_body = 12345678
    server = ServerProcess(
        tmp_path / "data",
        env={"RETOUCH_LOG_LEVEL": "INFO"},  # the suite's default is WARNING
        extra_args=["--autoscale", "--body-memory-bytes", str(given_body)],
    )
    with server:
        log = (server.data_dir / "gateway.log").read_text()
    expected = GatewayLimits.resolve(MAX_PIXELS, body_bytes=given_body)  # as it resolved
    assert logged_decode_budget(log) == expected.decode_bytes <= GiB
    for line in expected.log_lines():
        assert f"INFO retouch.platform.api.gateway: {line}\n" in log
    assert f"request-body budget 11.8 MiB ({given_body} bytes): --body-memory-bytes\n" in log


FREES = """
import sys
from retouch.platform.api.limits import return_large_frees

def rss():
    for line in open("/proc/self/status"):
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) << 10

if sys.argv[1] == "fixed":
    return_large_frees()
before = rss()
for _ in range(3):  # a decoded image, freed, then the next one
    block = bytearray(b"\\1") * (24 << 20)
    del block
print((rss() - before) >> 20)
"""


@pytest.mark.skipif(platform.libc_ver()[0] != "glibc", reason="glibc's malloc")
def test_a_freed_image_leaves_the_process_once_the_gateway_fixes_the_mmap_threshold() -> None:
    """Three 24 MiB blocks allocated and freed in turn: by default glibc keeps one in the
    heap (its mmap threshold rose to the first block's size); with ``return_large_frees``
    (what ``retouch serve`` calls) nothing stays."""

    def kept_mib(mode: str) -> int:
        done = subprocess.run(
            [sys.executable, "-c", FREES, mode], capture_output=True, text=True, timeout=60
        )
        assert done.returncode == 0, done.stderr
        return int(done.stdout)

    assert kept_mib("default") >= 16
    assert kept_mib("fixed") <= 4
