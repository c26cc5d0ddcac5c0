"""The wheel installs only `tritonmoe`, with kernels/ and comm/ as tritonmoe.kernels / .comm."""

from __future__ import annotations

import os
import pathlib
import subprocess
import sys
import zipfile

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]


@pytest.mark.slow
def test_wheel_installs_only_tritonmoe(tmp_path):
    wheel_dir = tmp_path / "wheels"
    build = subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q", "-w", str(wheel_dir), str(ROOT)],
        capture_output=True, text=True, timeout=300,
    )
    assert build.returncode == 0, build.stderr[-3000:]
    (wheel,) = wheel_dir.glob("tritonmoe-*.whl")
    names = zipfile.ZipFile(wheel).namelist()
    tops = {n.split("/")[0] for n in names}
    assert tops == {"tritonmoe", next(t for t in tops if t.endswith(".dist-info"))}, tops
    for mod in ("kernels/__init__.py", "comm/__init__.py", "reference.py", "layer.py", "plan/engine.py",
                "sim/data/cpu_gloo.json", "py.typed", "inference/offload.py", "custom_ops.py", "hf.py", "meta.py"):
        assert f"tritonmoe/{mod}" in names
    dist_info = next(t for t in tops if t.endswith(".dist-info"))
    assert any(n.startswith(dist_info) and n.endswith("/LICENSE") for n in names), names
    # Optional dependencies stay optional: NVML (bench telemetry), matplotlib (plots) and the test
    # tools are extras, never requirements of the library.
    metadata = zipfile.ZipFile(wheel).read(f"{dist_info}/METADATA").decode()
    hard = [line.split(":", 1)[1].strip() for line in metadata.splitlines()
            if line.startswith("Requires-Dist:") and "extra ==" not in line]
    assert sorted(r.split(">")[0].split(";")[0].strip() for r in hard) == ["torch", "triton"], hard
    assert 'nvidia-ml-py; extra == "bench"' in metadata and 'matplotlib; extra == "plot"' in metadata

    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True, timeout=300)
    py = venv / "bin" / "python"
    inst = subprocess.run(
        [str(py), "-m", "pip", "install", "--no-deps", "--no-index", "-q", str(wheel)],
        capture_output=True, text=True, timeout=300,
    )
    assert inst.returncode == 0, inst.stderr[-3000:]
    site = pathlib.Path(
        subprocess.run([str(py), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                       capture_output=True, text=True, check=True).stdout.strip()
    )
    assert not (site / "kernels").exists() and not (site / "comm").exists()
    assert (site / "tritonmoe" / "kernels" / "__init__.py").exists()
    # torch is not reinstalled: the fresh venv borrows the running interpreter's torch by path
    # (a path line in a .pth file does not run that directory's own .pth files, so an editable
    # install of tritonmoe there stays invisible).
    import torch

    (site / "_borrowed_torch.pth").write_text(str(pathlib.Path(torch.__file__).parents[1]) + "\n")
    code = (
        "import tritonmoe, tritonmoe.kernels, tritonmoe.comm, tritonmoe.reference; "
        "print(tritonmoe.__file__); print(tritonmoe.kernels.__file__); print(tritonmoe.comm.__file__)"
    )
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    run = subprocess.run([str(py), "-c", code], capture_output=True, text=True, cwd=tmp_path, env=env, timeout=300)
    assert run.returncode == 0, run.stderr[-3000:]
    for line in run.stdout.split():
        assert line.startswith(str(site)), run.stdout
