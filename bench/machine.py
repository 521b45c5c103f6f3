"""What a CPU benchmark ran on, for the results it records."""

from __future__ import annotations

import os
import platform
import subprocess


def machine(load: bool = True) -> str:
    """CPU model, core count, Python and OS (and the 1-minute load average: these machines are
    shared, and a loaded one runs everything 2-4x slower)."""
    try:
        out = subprocess.run(["lscpu"], capture_output=True, text=True, check=True).stdout
        model = next(
            line.split(":", 1)[1].strip()
            for line in out.splitlines()
            if line.startswith("Model name")
        )
    except (OSError, subprocess.CalledProcessError, StopIteration):
        model = platform.processor() or "unknown CPU"
    text = (
        f"{model}, {os.cpu_count()} CPUs, Python {platform.python_version()}, {platform.system()}"
    )
    if load and hasattr(os, "getloadavg"):
        text += f"; 1-minute load average {os.getloadavg()[0]:.1f} when the run began"
    return text
