"""scripts/carry_model.py: a bundled model cut into carry parts and rebuilt where kvarn.eval.models finds it."""

from __future__ import annotations

import importlib.util
import pathlib
import random

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]


@pytest.fixture
def carry(monkeypatch):
    spec = importlib.util.spec_from_file_location("carry_model", ROOT / "scripts" / "carry_model.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _fake_model(tmp_path, monkeypatch, sizes):
    """A bundled model whose GGUF is split over packages ``fakemodel_partN`` installed in a temporary site."""
    from kvarn.eval import models

    site = tmp_path / "site"
    rng = random.Random(0)
    packages, modules, files, blobs = [], [], [], []
    for i, size in enumerate(sizes, 1):
        module = f"fakemodel_part{i}"
        (site / module / "data").mkdir(parents=True)
        (site / module / "__init__.py").write_text("")
        blob = rng.randbytes(size)
        (site / module / "data" / f"part{i:02d}.bin").write_bytes(blob)
        info = site / f"{module}-1.{i}.dist-info"
        info.mkdir()
        (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: fakemodel-part{i}\nVersion: 1.{i}\n")
        packages.append(f"fakemodel-part{i}")
        modules.append(module)
        files.append(f"data/part{i:02d}.bin")
        blobs.append(blob)
    monkeypatch.syspath_prepend(str(site))
    importlib.invalidate_caches()
    spec = models.BundledModel("fake", "a fake model", tuple(packages), tuple(modules), tuple(files))
    monkeypatch.setitem(models.BUNDLED_MODELS, "fake", spec)
    return blobs


def test_parts_rebuild_the_packages_in_any_order(carry, tmp_path, monkeypatch):
    pytest.importorskip("gguf")
    from kvarn.eval import models

    blobs = _fake_model(tmp_path, monkeypatch, [2500, 1800, 700])
    parts = carry.pack("fake", tmp_path / "out", part_bytes=1000)
    assert [p.name for p in parts] == ["00", "01", "02", "03", "04"]
    assert [(p / "blob").stat().st_size for p in parts] == [1000, 1000, 1000, 1000, 1000]
    assert sorted(q.name for q in (parts[0] / "site").iterdir()) == [
        "fakemodel_part1",
        "fakemodel_part1-1.1.dist-info",
        "fakemodel_part2",
        "fakemodel_part2-1.2.dist-info",
        "fakemodel_part3",
        "fakemodel_part3-1.3.dist-info",
        "gguf",
        *sorted(q.name for q in (parts[0] / "site").glob("gguf-*.dist-info")),
    ]
    dest = tmp_path / "dest"
    order = [parts[3], parts[1], parts[0], parts[4]]
    assert [carry.assemble(p, dest) for p in order] == [None] * 4  # part 02 missing
    site = carry.assemble(parts[2], dest)
    assert site == dest / "site" and not (dest / "blobs").exists()
    rebuilt = [(site / f"fakemodel_part{i}" / "data" / f"part{i:02d}.bin").read_bytes() for i in (1, 2, 3)]
    assert rebuilt == blobs
    monkeypatch.syspath_prepend(str(site))  # the rebuilt packages shadow the originals, as on the GPU machine
    importlib.invalidate_caches()
    assert models.gguf_parts("fake")[0].is_relative_to(site)


def test_a_damaged_part_is_refused(carry, tmp_path, monkeypatch):
    pytest.importorskip("gguf")
    _fake_model(tmp_path, monkeypatch, [1500])
    parts = carry.pack("fake", tmp_path / "out", part_bytes=1000)
    damaged = bytearray((parts[1] / "blob").read_bytes())
    damaged[7] ^= 1
    (parts[1] / "blob").write_bytes(bytes(damaged))
    carry.assemble(parts[0], tmp_path / "dest")
    with pytest.raises(ValueError, match="do not match"):
        carry.assemble(parts[1], tmp_path / "dest")
