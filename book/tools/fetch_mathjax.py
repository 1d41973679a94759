"""Put a local copy of MathJax 3 under ``book/static/mathjax`` so that the book reads offline.

The copy comes from the npm registry with the ordinary client (``npm pack mathjax@VERSION``); the
tarball is checked against a pinned SHA-512 before anything is unpacked. Only what the built pages
use is kept: the ``tex-chtml.js`` component, the TeX extensions it may autoload, the CHTML web fonts,
the menu and accessibility components it loads on demand, and the licence.

Usage (from anywhere; idempotent, and offline once the copy is there)::

    python book/tools/fetch_mathjax.py            # fetch if missing or of another version
    python book/tools/fetch_mathjax.py --force    # fetch again
    python book/tools/fetch_mathjax.py --check    # exit 1 if the copy is missing or stale

The destination is git-ignored: every fresh clone fetches it once (about 6 MB on disk).
"""

from __future__ import annotations

import argparse
import base64
import hashlib
import json
import shutil
import subprocess
import sys
import tarfile
import tempfile
from pathlib import Path

VERSION = "3.2.2"
# `npm view mathjax@3.2.2 dist.integrity`
INTEGRITY = (
    "sha512-Bt+SSVU8eBG27zChVewOicYs7Xsdt40qm4+UpHyX7k0/O9NliPc+x77k1/FEsPsjKPZGJvtRZM1vO+geW0OhGw=="
)
# Paths inside the tarball's ``package/es5/`` folder that are copied (a folder means all of it).
KEEP = (
    "tex-chtml.js",
    "input/tex/extensions",
    "output/chtml/fonts/woff-v2",
    "ui",
    "a11y",
    "sre",
)
ROOT = Path(__file__).resolve().parents[2]
DEST = ROOT / "book" / "static" / "mathjax"
STAMP = ".mathjax-version"


def is_current(dest: Path) -> bool:
    """True when ``dest`` holds a complete copy of MathJax ``VERSION``."""
    stamp = dest / STAMP
    return (
        (dest / "tex-chtml.js").is_file()
        and stamp.is_file()
        and stamp.read_text().strip() == VERSION
    )


def sri_sha512(path: Path) -> str:
    """Subresource-integrity string (as npm writes it) of a file."""
    digest = hashlib.sha512(path.read_bytes()).digest()
    return "sha512-" + base64.b64encode(digest).decode()


def npm_pack(workdir: Path) -> Path:
    """Download the pinned MathJax tarball into ``workdir`` with ``npm pack``."""
    npm = shutil.which("npm")
    if npm is None:
        sys.exit(
            "fetch_mathjax: `npm` is not installed. Install Node.js with npm (Debian: "
            "`apt-get install -y npm`) and run this script again."
        )
    done = subprocess.run(
        [npm, "pack", f"mathjax@{VERSION}", "--json", "--silent"],
        cwd=workdir,
        capture_output=True,
        text=True,
    )
    if done.returncode != 0:
        sys.exit(f"fetch_mathjax: `npm pack mathjax@{VERSION}` failed:\n{done.stderr.strip()}")
    filename = json.loads(done.stdout)[0]["filename"]
    return workdir / filename


def unpack(tarball: Path, dest: Path) -> int:
    """Copy the ``KEEP`` members of the tarball into ``dest``; return the number of files."""
    prefix = "package/es5/"
    count = 0
    staging = dest.with_name(dest.name + ".partial")
    shutil.rmtree(staging, ignore_errors=True)
    staging.mkdir(parents=True)
    with tarfile.open(tarball, "r:gz") as tar:
        for member in tar.getmembers():
            if not member.isfile():
                continue
            name = member.name
            if name == "package/LICENSE":
                rel = "LICENSE"
            elif name.startswith(prefix):
                rel = name[len(prefix) :]
                if not any(rel == k or rel.startswith(k + "/") for k in KEEP):
                    continue
            else:
                continue
            if rel.startswith("/") or ".." in Path(rel).parts:
                raise RuntimeError(f"unsafe path in tarball: {name}")
            target = staging / rel
            target.parent.mkdir(parents=True, exist_ok=True)
            with tar.extractfile(member) as src, open(target, "wb") as dst:
                shutil.copyfileobj(src, dst)
            count += 1
    (staging / STAMP).write_text(VERSION + "\n")
    shutil.rmtree(dest, ignore_errors=True)
    staging.rename(dest)
    return count


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dest", type=Path, default=DEST, help=f"default: {DEST}")
    parser.add_argument("--force", action="store_true", help="fetch even if a copy is there")
    parser.add_argument("--check", action="store_true", help="only check; exit 1 if missing")
    args = parser.parse_args(argv)
    dest = args.dest.resolve()

    if args.check:
        ok = is_current(dest)
        print(f"fetch_mathjax: {dest} {'holds' if ok else 'lacks'} MathJax {VERSION}")
        return 0 if ok else 1
    if is_current(dest) and not args.force:
        print(f"fetch_mathjax: MathJax {VERSION} already in {dest}")
        return 0

    with tempfile.TemporaryDirectory() as tmp:
        tarball = npm_pack(Path(tmp))
        got = sri_sha512(tarball)
        if got != INTEGRITY:
            sys.exit(f"fetch_mathjax: integrity mismatch for {tarball.name}: {got} != {INTEGRITY}")
        count = unpack(tarball, dest)
    size = sum(p.stat().st_size for p in dest.rglob("*") if p.is_file())
    print(f"fetch_mathjax: MathJax {VERSION}: {count} files, {size / 1e6:.1f} MB in {dest}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
