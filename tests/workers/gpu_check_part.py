"""A stand-in part for the GPU acceptance's runner (tests/test_gpu_check.py): ``ok`` writes a result and exits 0,
``fail`` raises, ``hang`` prints a line and sleeps past any limit (with a child process that must die with it)."""

from __future__ import annotations

import subprocess
import sys
import time

if __name__ == "__main__":
    mode = sys.argv[1]
    if mode == "ok":
        print("all good", flush=True)
    elif mode == "fail":
        print("working...", flush=True)
        raise ValueError("the part's own error")
    elif mode == "hang":
        child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"])
        print(f"child {child.pid}", flush=True)
        time.sleep(600)
