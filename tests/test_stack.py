"""The pinned production stack: one consistent NVIDIA triple, named the same way everywhere."""

import csv
import re
import subprocess
from pathlib import Path

from pipeline import stack

ROOT = Path(__file__).resolve().parent.parent
COMPAT = ROOT / "tests" / "data" / "trtllm-stack-compat.csv"
IMAGE_RE = re.compile(r"tritonserver:(\d\d\.\d\d)-trtllm-python-py3")


def compat_rows() -> dict[str, dict[str, str]]:
    lines = [line for line in COMPAT.read_text().splitlines() if line and not line.startswith("#")]
    return {row["triton_release"]: row for row in csv.DictReader(lines)}


def test_pinned_triple_is_one_nvidia_release():
    row = compat_rows()[stack.TRITON_CONTAINER_TAG]
    assert row["ngc_tag"] == stack.TRITON_IMAGE
    # NVIDIA's compatibility matrix and the backend's Dockerfile on the release branch agree with the pin
    assert (row["tensorrt_llm"], row["tensorrt"]) == (stack.TRTLLM_VERSION, stack.TENSORRT_VERSION)
    assert (row["backend_dockerfile_trtllm"], row["backend_dockerfile_trt"]) == (stack.TRTLLM_VERSION, stack.TENSORRT_VERSION)


def test_the_old_pin_would_fail_the_check():
    """25.12 ships TensorRT-LLM 1.1.0 / TensorRT 10.13.3.9: the table tells it apart from the pin."""
    row = compat_rows()["25.12"]
    assert (row["tensorrt_llm"], row["tensorrt"]) != (stack.TRTLLM_VERSION, stack.TENSORRT_VERSION)


def test_every_tracked_file_names_the_pinned_image_only():
    files = subprocess.run(["git", "ls-files"], cwd=ROOT, capture_output=True, text=True, check=True).stdout.split()
    wrong = []
    for name in files:
        path = ROOT / name
        if name.startswith("tests/data/") or path.suffix not in {".py", ".md", ".yaml", ".sh", ".txt", ""} or not path.is_file():
            continue
        for tag in IMAGE_RE.findall(path.read_text(errors="replace")):
            if tag != stack.TRITON_CONTAINER_TAG:
                wrong.append(f"{name}: {tag}")
    assert not wrong, f"images other than {stack.TRITON_IMAGE}: {wrong}"
