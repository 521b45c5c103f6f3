"""Runner metrics: replays and padding per graph, eager steps by reason, capture time and memory;
rendered as a dict (``runner.stats()``) or in the Prometheus text format."""

from __future__ import annotations


class RunnerStats:
    """Counters kept as flat lists indexed by graph id, so a step costs two list increments."""

    def __init__(self, table, backend: str):
        self.table, self.backend = table, backend
        n = len(table.graphs)
        self.replays = [0] * n
        self.padding = [0] * n  # padding tokens summed over replays
        self.eager_steps: dict[str, int] = {}
        self.capture: dict = {}

    def replayed(self, gid: int, pad: int) -> None:
        self.replays[gid] += 1
        self.padding[gid] += pad

    def eager(self, route, gid: int) -> None:
        if gid >= 0:  # the table has a graph for it, but this runner did not capture it
            reason = f"{self.table.graphs[gid].mode.name.lower()}_not_captured"
        else:
            reason = route.why.label
        self.eager_steps[reason] = self.eager_steps.get(reason, 0) + 1

    def eager_because(self, reason: str) -> None:
        self.eager_steps[reason] = self.eager_steps.get(reason, 0) + 1

    def captured(self, summary: dict) -> None:
        self.capture = dict(summary)

    def as_dict(self) -> dict:
        graphs = self.table.graphs
        per_graph = [
            {
                "id": g.id,
                "mode": g.mode.name,
                "num_tokens": g.key.num_tokens,
                "num_active_loras": g.key.num_active_loras,
                "num_ubatches": g.key.num_ubatches,
                "replays": self.replays[g.id],
                "padding_tokens": self.padding[g.id],
            }
            for g in graphs
            if self.replays[g.id]
        ]
        by_mode: dict[str, int] = {}
        for g in graphs:
            by_mode[g.mode.name] = by_mode.get(g.mode.name, 0) + self.replays[g.id]
        return {
            "fingerprint": self.table.fingerprint,
            "plan": self.table.settings.name,
            "backend": self.backend,
            "replays": sum(self.replays),
            "replays_by_mode": by_mode,
            "padding_tokens": sum(self.padding),
            "eager_steps": dict(self.eager_steps),
            "graphs": per_graph,
            "capture": dict(self.capture),
        }


def _esc(v) -> str:
    return str(v).replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n")


def render_prometheus(stats: dict, prefix: str = "graphplan") -> str:
    """Prometheus text exposition (version 0.0.4) of ``runner.stats()``."""
    lines: list[str] = []

    def metric(name, kind, help_, samples):
        lines.append(f"# HELP {prefix}_{name} {help_}")
        lines.append(f"# TYPE {prefix}_{name} {kind}")
        for labels, value in samples:
            lab = ",".join(f'{k}="{_esc(v)}"' for k, v in labels.items())
            lines.append(f"{prefix}_{name}{{{lab}}} {value}" if lab else f"{prefix}_{name} {value}")

    metric(
        "plan_info",
        "gauge",
        "Loaded plan and its fingerprint.",
        [
            (
                {
                    "plan": stats["plan"],
                    "fingerprint": stats["fingerprint"],
                    "backend": stats["backend"],
                },
                1,
            )
        ],
    )

    def graph(g):  # a graph entry may name its plan (a server's totals over several plans)
        return {
            **({"fingerprint": g["fingerprint"]} if "fingerprint" in g else {}),
            "graph": g["id"],
            "mode": g["mode"],
            "num_tokens": g["num_tokens"],
        }

    metric(
        "graph_replays_total",
        "counter",
        "Replays per captured graph.",
        [(graph(g), g["replays"]) for g in stats["graphs"]],
    )
    metric(
        "graph_padding_tokens_total",
        "counter",
        "Padding tokens run per graph.",
        [(graph(g), g["padding_tokens"]) for g in stats["graphs"]],
    )
    metric(
        "eager_steps_total",
        "counter",
        "Steps run eagerly, by reason.",
        [({"reason": r}, n) for r, n in sorted(stats["eager_steps"].items())],
    )
    cap = stats.get("capture") or {}
    metric(
        "capture_seconds", "gauge", "Time spent capturing graphs.", [({}, cap.get("seconds", 0))]
    )
    metric(
        "capture_bytes",
        "gauge",
        "Device memory the captured graphs took.",
        [({}, cap.get("bytes", 0))],
    )
    metric("captured_graphs", "gauge", "Graphs captured.", [({}, cap.get("graphs", 0))])
    comp = stats.get("compile")  # the compiled path (runtime/compiled/model.py)
    if comp:
        lab = {"backend": comp["backend"]}
        metric(
            "model_compiles_total",
            "counter",
            "Compilations of the compiled model.",
            [(lab, comp["compiles"])],
        )
        metric(
            "model_recompiles_total",
            "counter",
            "Compilations after the compile warm-up (0 when the token dimension is dynamic).",
            [(lab, comp["recompiles"])],
        )
        metric(
            "model_compile_seconds",
            "gauge",
            "Time the compile warm-up took.",
            [(lab, round(comp["seconds"], 3))],
        )
    od = stats.get("on_demand")
    if od:  # on-demand capture: what start took, what first use took, what still waits
        metric(
            "graphs_captured",
            "gauge",
            "Graphs captured, at start or on first use.",
            [
                ({"when": "start"}, od["captured_at_start"]),
                ({"when": "on_demand"}, od["captured_on_demand"]),
            ],
        )
        metric(
            "graphs_pending", "gauge", "Graphs queued for on-demand capture.", [({}, od["pending"])]
        )
        metric(
            "graphs_not_captured",
            "gauge",
            "Graphs not captured yet (not used so far).",
            [({}, od["not_captured"])],
        )
        metric(
            "graphs_eager_forever",
            "gauge",
            "Graphs whose on-demand capture failed.",
            [({}, len(od["eager_forever"]))],
        )
    return "\n".join(lines) + "\n"
