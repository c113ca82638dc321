"""Deploy, invoke, delete and restart against a real ``retouch serve`` over HTTP."""

from __future__ import annotations

import io
from pathlib import Path

import httpx
from PIL import Image

from retouch.functions.demo.images import mask_of_ratio
from retouch.platform.api.client import Client
from retouch.platform.api.server import ServerProcess


def test_deploy_invoke_delete_restart(
    server: ServerProcess,
    data_dir: Path,
    admin: Client,
    invoker: Client,
    examples: Path,
    tokens: dict[str, str],
    shared_dir: Path,
) -> None:
    for name in ("tiny-sd", "tiny-flux"):
        doc = admin.deploy_file(examples / f"{name}.toml")
        assert doc["status"] == "ready", doc
        assert doc["name"] == name
        assert {s["state"] for s in doc["templates"].values()} <= {
            "unbaked",
            "queued",
            "baking",
            "baked",
        }
        assert all((s["width"], s["height"]) == (128, 128) for s in doc["templates"].values())
    assert sorted(f["name"] for f in admin.list()) == ["tiny-flux", "tiny-sd"]

    for function, template in (("tiny-sd", "street"), ("tiny-flux", "shirt")):
        for i, (shape, ratio) in enumerate(
            (("rect", 0.1), ("ellipse", 0.3), ("blob", 0.5), ("rect", 1.0))
        ):
            mask = mask_of_ratio((128, 128), ratio, shape, seed=i)
            result = invoker.invoke(function, template, mask, "a red door", seed=i, steps=3)
            image = Image.open(io.BytesIO(result.image))
            assert image.format == "PNG" and image.size == (128, 128)
            assert result.path in ("stock", "maskaware")  # mask-aware once the bake is done
            assert abs(result.mask_ratio - mask.mean()) < 1e-6
            assert result.timings.total_ms >= result.timings.run_ms > 0
            assert result.executor.startswith("exec-")

    assert admin.delete("tiny-sd") == {"deleted": "tiny-sd"}
    assert [f["name"] for f in admin.list()] == ["tiny-flux"]

    # Closing executors leave their steps beside the profile (runtime/steprecords) ...
    for kept in (shared_dir / "profiles").glob("*.steps.json"):
        kept.unlink()  # (left by other tests' servers: this one's must write its own)
    server.stop()
    assert list((shared_dir / "profiles").glob("*.steps.json"))
    with (
        ServerProcess(data_dir, env=tokens) as restarted,
        Client(restarted.url, tokens["RETOUCH_ADMIN_TOKEN"]) as again,
    ):
        assert again.wait_ready("tiny-flux")["status"] == "ready"
        assert [f["name"] for f in again.list()] == ["tiny-flux"]
        # ... and the restarted ones start their step fit from them, before any invocation.
        executors = httpx.get(
            f"{restarted.url}/v1/executors",
            headers={"authorization": f"Bearer {tokens['RETOUCH_ADMIN_TOKEN']}"},
        ).json()["executors"]
        assert max(e["state"]["engine"]["step_fit_prior"] for e in executors) > 0, executors
        mask = mask_of_ratio((128, 128), 0.2, "ellipse", seed=3)
        result = again.invoke("tiny-flux", "mug", mask, "a blue mug", steps=2, format="webp")
        assert Image.open(io.BytesIO(result.image)).format == "WEBP"
        gone = httpx.get(
            f"{restarted.url}/v1/functions/tiny-sd",
            headers={"authorization": f"Bearer {tokens['RETOUCH_ADMIN_TOKEN']}"},
        )
        assert gone.status_code == 404
        assert gone.json()["error"]["code"] == "function_not_found"
