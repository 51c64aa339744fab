"""A bundled model's GGUF cut into folders small enough for the GPU machine's ``run`` carry, and put back there.

``run`` carries at most 64 MiB of ignored files a call, and a carried file is gone again in the next call that
does not carry it; a file the command writes outside the checkout stays while the machine is warm. So each
call carries one part and copies it out, and the last one rebuilds the model's packages where
:mod:`kvarn.eval.models` finds them (``kvarn report --model NAME`` then converts it as it does here)::

    python scripts/carry_model.py pack qwen2.5-coder-0.5b         # .carry/qwen2.5-coder-0.5b/00, 01, ...

prints one ``run`` per part (carry ``.carry/NAME/NN``, command ``python scripts/carry_model.py assemble
.carry/NAME/NN``), back to back: the machine is given back after 30 idle seconds. The last part prints the
``PYTHONPATH`` to export. Part 00 carries the manifest, ``gguf`` and each package's metadata.
"""

from __future__ import annotations

import argparse
import hashlib
import importlib.util
import json
import pathlib
import re
import shutil
import sys

ROOT = pathlib.Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from kvarn.eval.models import BUNDLED_MODELS, gguf_parts  # noqa: E402

PART_MIB = 54
"""Bytes of model a part carries, in MiB: the 64 MiB a call carries also hold the checkout's tracked files (about
4 MiB) and, in part 00, about 2 MiB of packages."""
DEST = pathlib.Path("/root/kvarn-carry")


def _dist_info(package: str) -> pathlib.Path | None:
    """The installed ``*.dist-info`` folder of ``package`` (for its version on the other side), or None."""
    import importlib.metadata

    try:
        site = pathlib.Path(importlib.metadata.distribution(package).locate_file(""))
    except importlib.metadata.PackageNotFoundError:
        return None
    wanted = _normal(package)
    found = [d for d in site.glob("*.dist-info") if _normal(d.name[: -len(".dist-info")].rsplit("-", 1)[0]) == wanted]
    return found[0] if found else None


def _normal(name: str) -> str:
    return re.sub(r"[-_.]+", "_", name).lower()


def _package_dir(module: str) -> pathlib.Path:
    spec = importlib.util.find_spec(module)
    if spec is None or not spec.submodule_search_locations:
        raise ModuleNotFoundError(f"package {module!r} is not installed")
    return pathlib.Path(next(iter(spec.submodule_search_locations)))


def pack(name: str, out: pathlib.Path, part_bytes: int) -> list[pathlib.Path]:
    """Write ``out/name/NN`` folders (each a ``blob`` of at most ``part_bytes``); their paths."""
    spec = BUNDLED_MODELS[name]
    files = gguf_parts(name)
    folder = out / name
    shutil.rmtree(folder, ignore_errors=True)
    digest = hashlib.sha256()
    entries = []
    for package, module, rel, path in zip(spec.packages, spec.modules, spec.files, files, strict=True):
        entries.append({"package": package, "module": module, "file": rel, "size": path.stat().st_size})
    parts: list[pathlib.Path] = []
    blob, left = None, 0
    for chunk in (c for path in files for c in _chunks(path)):
        digest.update(chunk)
        while chunk:
            if blob is None:
                parts.append(folder / f"{len(parts):02d}")
                parts[-1].mkdir(parents=True)
                blob, left = (parts[-1] / "blob").open("wb"), part_bytes
            take, chunk = chunk[:left], chunk[left:]
            blob.write(take)
            left -= len(take)
            if not left:
                blob.close()
                blob = None
    if blob is not None:
        blob.close()
    site = parts[0] / "site"
    gguf = _package_dir("gguf")
    shutil.copytree(gguf, site / "gguf", ignore=shutil.ignore_patterns("__pycache__"))
    for package, module in [("gguf", None), *zip(spec.packages, spec.modules, strict=True)]:
        info = _dist_info(package)
        if info is not None:
            shutil.copytree(info, site / info.name)
        if module is not None:
            (site / module).mkdir()
            (site / module / "__init__.py").write_text("")  # located by kvarn, never imported
    manifest = {"name": name, "parts": len(parts), "sha256": digest.hexdigest(), "files": entries}
    (parts[0] / "manifest.json").write_text(json.dumps(manifest, indent=1) + "\n")
    return parts


def assemble(part: pathlib.Path, dest: pathlib.Path) -> pathlib.Path | None:
    """Copy one carried part under ``dest``; once every part is there, rebuild the packages in ``dest/site``."""
    dest.mkdir(parents=True, exist_ok=True)
    if (part / "manifest.json").is_file():
        shutil.copy(part / "manifest.json", dest / "manifest.json")
        shutil.rmtree(dest / "site", ignore_errors=True)
        shutil.copytree(part / "site", dest / "site")
    (dest / "blobs").mkdir(exist_ok=True)
    shutil.copy(part / "blob", dest / "blobs" / part.name)
    if not (dest / "manifest.json").is_file():
        return None
    manifest = json.loads((dest / "manifest.json").read_text())
    blobs = [dest / "blobs" / f"{i:02d}" for i in range(manifest["parts"])]
    if not all(b.is_file() for b in blobs):
        return None
    digest = hashlib.sha256()
    stream = (chunk for b in blobs for chunk in _chunks(b))
    pending = b""
    for entry in manifest["files"]:
        target = dest / "site" / entry["module"] / entry["file"]
        target.parent.mkdir(parents=True, exist_ok=True)
        need = entry["size"]
        with target.open("wb") as out:
            while need:
                if not pending:
                    pending = next(stream)
                take, pending = pending[:need], pending[need:]
                out.write(take)
                digest.update(take)
                need -= len(take)
    if digest.hexdigest() != manifest["sha256"]:
        raise ValueError(f"{manifest['name']}: the rebuilt files do not match the packed ones (sha256)")
    shutil.rmtree(dest / "blobs")
    return dest / "site"


def _chunks(path: pathlib.Path):
    with path.open("rb") as f:
        while chunk := f.read(1 << 20):
            yield chunk


def main(argv: list[str]) -> int:
    p = argparse.ArgumentParser(prog="carry_model.py", description=__doc__.split("\n\n")[0])
    sub = p.add_subparsers(dest="cmd", required=True)
    a = sub.add_parser("pack", help="cut a bundled model into carry folders")
    a.add_argument("name", choices=sorted(BUNDLED_MODELS))
    a.add_argument("--out", type=pathlib.Path, default=ROOT / ".carry")
    a.add_argument("--part-mib", type=float, default=PART_MIB)
    b = sub.add_parser("assemble", help="on the GPU machine: take in one carried part")
    b.add_argument("part", type=pathlib.Path)
    b.add_argument("--into", type=pathlib.Path, default=None, help=f"default {DEST}/NAME")
    args = p.parse_args(argv)
    if args.cmd == "pack":
        parts = pack(args.name, args.out, int(args.part_mib * (1 << 20)))
        for part in parts:
            rel = part.relative_to(ROOT) if part.is_relative_to(ROOT) else part
            print(f"run: carry ['{rel}'], command: python scripts/carry_model.py assemble {rel}")
        return 0
    name = args.part.parent.name
    site = assemble(args.part, args.into or DEST / name)
    if site is None:
        print(f"{name}: part {args.part.name} taken in; more to come")
    else:
        print(f"{name}: ready; export PYTHONPATH=$PYTHONPATH:{site} and run kvarn report --model {name}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
