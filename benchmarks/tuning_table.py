"""Writes a GPU's shipped tuning table (``fuselm/ops/tuning/<gpu>.json``) from benchmark results' ``autotune_picks``.

    python benchmarks/tuning_table.py benchmarks/results/e2e-h200.json benchmarks/results/decode-h200.json

Every results file must come from the same GPU model. A later file's pick for a (kernel, key) replaces an earlier
one's; a pick that was itself read from a table (``from_table``) never replaces a timed one. ``--skip FILE:KERNEL``
leaves a kernel's picks in one file out (e.g. from a run whose version of that kernel was not the shipped one). The
table lists, per pick, the file it came from; fuselm reads it at the first tuning of each key
(``fuselm.ops._common._from_table``). ``--update`` starts from the GPU's shipped table instead of an empty one (its
picks keep their sources), so one new run's timed picks replace only the keys it tuned:

    python benchmarks/tuning_table.py --update benchmarks/results/tune-decode-h200.json

A table may also hold ``settings``: launch settings measured on that GPU by A/B runs, not by an autotuner (e.g.
``dependent_max_rows``, or ``dependent_max_rows.decode_attention`` for one op's kernel, each ``{"value", "source"}``),
written by hand from those runs' results. Every rewrite keeps the shipped table's settings.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from fuselm.ops._common import tuning_table_path


def merged_picks(paths: list[str], skip: set[tuple[str, str]],
                 table: dict | None = None) -> tuple[str, list[dict], dict]:
    """(the GPU, the merged picks with their source file, the versions each file was measured under), starting from
    ``table`` (a shipped table's contents) when given."""
    gpus, picks, versions = set(), {}, {}
    if table is not None:
        gpus.add(table["gpu"])
        versions.update(table["measured_with"])
        picks.update({(pick["kernel"], json.dumps(pick["key"])): pick for pick in table["picks"]})
    for path in paths:
        results = json.loads(Path(path).read_text())
        gpus.add(results["gpu"])
        versions[path] = {name: results.get(name) for name in ("torch", "triton", "date", "fuselm_commit")}
        for pick in results.get("autotune_picks", []):
            entry = (pick["kernel"], json.dumps(pick["key"]))
            if (path, pick["kernel"]) in skip or (pick.get("from_table") and entry in picks):
                continue
            picks[entry] = {"kernel": pick["kernel"], "key": pick["key"], "config": pick["config"], "source": path}
    if len(gpus) != 1:
        raise SystemExit(f"the results files come from {len(gpus)} GPU models ({sorted(gpus)}); give one model's")
    return gpus.pop(), sorted(picks.values(), key=lambda p: (p["kernel"], json.dumps(p["key"]))), versions


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("results", nargs="+", help="benchmark results JSON files with autotune_picks")
    parser.add_argument("--skip", action="append", default=[], metavar="FILE:KERNEL",
                        help="leave out this kernel's picks in this file (repeatable)")
    parser.add_argument("--update", action="store_true",
                        help="start from the GPU's shipped table: the results replace only the keys they tuned")
    args = parser.parse_args()
    table = None
    if args.update:
        gpu = json.loads(Path(args.results[0]).read_text())["gpu"]
        if not tuning_table_path(gpu).is_file():
            raise SystemExit(f"--update: no shipped table for {gpu} ({tuning_table_path(gpu)})")
        table = json.loads(tuning_table_path(gpu).read_text())
    gpu, picks, versions = merged_picks(args.results, {tuple(item.rsplit(":", 1)) for item in args.skip}, table)
    out = tuning_table_path(gpu)
    settings = json.loads(out.read_text()).get("settings") if out.is_file() else None
    written = {"gpu": gpu, "measured_with": versions, **({"settings": settings} if settings else {}), "picks": picks}
    out.write_text(json.dumps(written, indent=1) + "\n")
    print(f"{len(picks)} picks for {gpu} -> {out}")


if __name__ == "__main__":
    main()
