"""A data file's bytes (torchtitan/components/data/compression.py): a gzip or zstd file that is
corrupt, truncated or not compressed at all fails with one UserError naming the file, and a format
whose optional package is missing names the package to install."""

import sys

import pytest

from torchtitan.config.errors import UserError

from helpers.data import make_loader, random_docs, take, write_gz, write_parquet, write_zst


@pytest.mark.parametrize("kind", ["gz truncated", "gz not gzip", "zst truncated", "zst corrupt"])
def test_corrupt_or_truncated_compressed_file(tmp_path, kind):
    docs = random_docs(300, seed=14, lo=30, hi=60)  # ~14k tokens: the test reads them all
    ext = kind.split()[0]
    path = (write_gz if ext == "gz" else write_zst)(tmp_path / f"d.jsonl.{ext}", docs)
    data = path.read_bytes()
    if kind.endswith("truncated"):
        path.write_bytes(data[: len(data) * 3 // 4])
    elif kind == "gz not gzip":
        path.write_bytes(b"plain text, not gzip\n")
    else:
        path.write_bytes(data[:20] + bytes(b ^ 0x55 for b in data[20:200]) + data[200:])
    kind_name = "gzip" if ext == "gz" else "zstd"
    with pytest.raises(UserError, match=rf"d.jsonl.{ext} is not a readable {kind_name} file .*corrupt or truncated"):
        take(iter(make_loader(path, 16, 4)), 400)


@pytest.mark.parametrize(
    "module,name,writer", [("zstandard", "d.jsonl.zst", write_zst), ("pyarrow", "d.parquet", write_parquet)]
)
def test_missing_optional_package(tmp_path, monkeypatch, module, name, writer):
    path = writer(tmp_path / name, ["a", "b"])
    monkeypatch.setitem(sys.modules, module, None)
    with pytest.raises(UserError, match=rf"{name}.* needs the {module} package: pip install {module}"):
        make_loader(path, 8, 2)
