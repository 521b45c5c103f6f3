"""Calibrate graphplan's memory model for the tiny Llama on this GPU and save the profile.

    plan compile plans/tiny-llama.yaml -o table.json
    python examples/calibrate_memory.py --table table.json -o profile.json
    plan compile plans/tiny-llama.yaml --memory --profile profile.json
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from tiny_llama import TinyLlama, TinyLlamaConfig, static_inputs  # noqa: E402

from graphplan.runtime import GraphplanError, load_table  # noqa: E402
from graphplan.runtime.calibrate import calibrate_memory  # noqa: E402


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--table", required=True)
    p.add_argument("-o", "--output", required=True, help="profile JSON to write (atomically)")
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    a = p.parse_args(argv)
    try:
        table = load_table(a.table)
        cfg = TinyLlamaConfig(num_cache_rows=table.max_num_seqs)
        dtype = torch.bfloat16 if a.device.startswith("cuda") else torch.float32
        model = TinyLlama(cfg, seed=0, device=a.device, dtype=dtype)
        prof = calibrate_memory(model, table, static_inputs(model), path=a.output)
    except (GraphplanError, ValueError) as e:
        print(f"calibrate_memory: {e}", file=sys.stderr)
        return 1
    print(f"{a.output}: {prof['per_graph_bytes'] / 2**20:.2f} MiB per graph + "
          f"{prof['per_token_bytes'] / 1024:.1f} KiB per token on {prof['device']} "
          f"(samples {prof['samples']})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
