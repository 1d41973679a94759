"""Carry results over a change of code that moves no number: give their manifests the new code hash and re-key
the cached runs, so that neither the book's note nor a later recomputation treats them as another code's.

    python tools/restamp.py /path/to/old/checkout toy,toy_kfac    # after tools/study_check.py printed "equal"

For each study named, every results folder of it (``results/<scale>/<study>``, ``results/custom/*-<study>-*``)
whose manifest holds the old checkout's code hash gets the current one; every cached run under ``.cache/`` whose
key holds the old hash of the study's module, or of a module it depends on, gets the new one (the file is
rewritten under its new key). Nothing else changes; the script prints what it did, and each results folder it
leaves with another code than the current one. The old hashes are taken with the old checkout's ``DEPENDS``.
"""

import ast
import functools
import json
import sys
from pathlib import Path

import torch

from smp_book import pipeline
from smp_book.pipeline import CACHE, RESULTS, STUDIES, code_hash, config_key, rests_on


@functools.cache
def old_depends(old_root: Path) -> dict[str, tuple[str, ...]]:
    """``DEPENDS`` as the checkout ``old_root`` declares it (its one top-level assignment, read, not run)."""
    tree = ast.parse((old_root / "smp_book" / "pipeline.py").read_text())
    values = [node.value for node in tree.body
              if isinstance(node, ast.AnnAssign) and getattr(node.target, "id", None) == "DEPENDS"
              or isinstance(node, ast.Assign) and any(getattr(t, "id", None) == "DEPENDS" for t in node.targets)]
    if len(values) != 1:
        raise SystemExit(f"{old_root}/smp_book/pipeline.py: expected one top-level DEPENDS = {{...}}, "
                         f"found {len(values)}")
    return ast.literal_eval(values[0])


def old_code_hash(module: str, old_root: Path) -> str:
    """:func:`~smp_book.pipeline.code_hash` of ``module`` in the checkout ``old_root``, with that checkout's
    ``DEPENDS`` (a module whose imports changed rests on other files there)."""
    current, pipeline.DEPENDS = pipeline.DEPENDS, old_depends(old_root)
    try:
        return code_hash.__wrapped__(module, old_root)
    finally:
        pipeline.DEPENDS = current


def main(old_root: Path, studies: list[str]) -> None:
    if unknown := [s for s in studies if s not in STUDIES]:
        raise SystemExit(f"studies: unknown {unknown}; known: {', '.join(STUDIES)}")
    modules = {f"smp_book.{name}" for s in studies for name in rests_on(STUDIES[s])}
    moved = {old_code_hash(m, old_root): code_hash(m) for m in sorted(modules)}
    moved = {old: new for old, new in moved.items() if old != new}
    for study in studies:
        old, new = old_code_hash(STUDIES[study], old_root), code_hash(STUDIES[study])
        for folder in [*RESULTS.glob(f"*/{study}"), *RESULTS.glob(f"custom/*-{study}-*")]:
            path = folder / "manifest.json"
            manifest = json.loads(path.read_text()) if path.exists() else {}
            if manifest.get("code") == old and old != new:
                path.write_text(json.dumps({**manifest, "code": new}, indent=2, default=str))
                print(f"{folder.relative_to(RESULTS.parent)}: code {old} -> {new}")
            elif manifest.get("code") != new:
                print(f"{folder.relative_to(RESULTS.parent)}: left as it was (code {manifest.get('code')}, neither "
                      f"the old checkout's {old} nor the current {new})")
    for path in sorted(CACHE.rglob("*.pt")):
        payload = torch.load(path, map_location="cpu", weights_only=False)
        key = payload.get("config") if isinstance(payload, dict) else None
        if not isinstance(key, dict) or key.get("code") not in moved:
            continue
        key = {**key, "code": moved[key["code"]]}
        target = path.with_name(f"{config_key(key)}.pt")
        if target.exists():
            raise SystemExit(f"{target} exists already: left {path} as it was")
        torch.save({**payload, "config": key}, target)
        path.unlink()
        print(f"{path.relative_to(CACHE.parent)} -> {target.name}")


if __name__ == "__main__":
    if len(sys.argv) != 3:
        raise SystemExit(__doc__)
    main(Path(sys.argv[1]), sys.argv[2].split(","))
