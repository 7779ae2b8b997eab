"""Sources of documents: the embedded python_stdlib corpus, local files, Hugging Face datasets, c4.

A source is a list of documents with a stable index. `documents(start)` yields the texts of
documents start, start + 1, ... in stored order to the end of the source; resuming calls it with
the saved index. A source with `random_access` also has `num_documents()` and `document(i)`, which
shuffling needs.

The default corpus, `python_stdlib`, is embedded: it is the `.py` files of the running
interpreter's standard library (`sysconfig.get_paths()["stdlib"]`), minus `site-packages`,
`dist-packages` and test folders (any path component named `test` or `tests`, and
`idlelib/idle_test`), indexed in sorted relative POSIX path order, one file per document, read as
UTF-8 with errors="replace". It is real text nobody here wrote, it exists offline on every
machine, and it is deterministic for a given interpreter (~730 files, ~12 MB on CPython 3.11).
`c4` streams allenai/c4 through `datasets`; `c4_test` is the reference framework's local sample
(tests/assets/c4_test/data.json, JSON lines).
"""

import functools
import os
import socket
import sysconfig
import urllib.parse
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

from torchtitan.components.data.compression import INSTALL_DATA, read_text
from torchtitan.components.data.files import FilesSource
from torchtitan.config.errors import UserError
from torchtitan.config.training_sections import Training

C4_HUB = "allenai/c4"
C4_TEST_PATH = "tests/assets/c4_test"


def stdlib_root() -> Path:
    return Path(sysconfig.get_paths()["stdlib"])


def _is_excluded_stdlib_dir(rel_dir: str) -> bool:
    parts = rel_dir.split("/")
    if parts[-1] in ("site-packages", "dist-packages", "test", "tests"):
        return True
    return rel_dir == "idlelib/idle_test"


@functools.lru_cache(maxsize=1)
def _stdlib_files() -> tuple[Path, ...]:
    root = stdlib_root()
    found = []
    for dirpath, dirnames, filenames in os.walk(root):
        rel_dir = Path(dirpath).relative_to(root).as_posix()
        # Prune in place so os.walk never descends into excluded folders.
        dirnames[:] = [d for d in dirnames if not _is_excluded_stdlib_dir(d if rel_dir == "." else f"{rel_dir}/{d}")]
        found.extend(Path(dirpath) / f for f in filenames if f.endswith(".py"))
    return tuple(sorted(found, key=lambda p: p.relative_to(root).as_posix()))


def stdlib_files() -> list[Path]:
    """The documents of the python_stdlib corpus, in stored (index) order (computed once)."""
    return list(_stdlib_files())


class StdlibSource:
    name = "python_stdlib"
    random_access = True

    def __init__(self):
        self.files = _stdlib_files()
        if not self.files:
            raise UserError(
                f"dataset python_stdlib is empty: no .py files under {stdlib_root()}; "
                "set training.dataset = 'local' and training.dataset_path to your own data"
            )

    def documents(self, start: int) -> Iterator[str]:
        for path in self.files[start:]:
            yield read_text(path)

    def num_documents(self) -> int:
        return len(self.files)

    def document(self, index: int) -> str:
        return read_text(self.files[index])


class HuggingFaceSource:
    name = "huggingface"
    random_access = False

    def __init__(
        self,
        path: str,
        text_field: str = "text",
        config_name: str | None = None,
        name: str = "huggingface",
        hint: str = "",
    ):
        self.name, self.text_field = name, text_field
        try:
            import datasets
        except ImportError:
            raise UserError(
                f"training.dataset = '{name}' needs the datasets package: pip install datasets (or "
                f"{INSTALL_DATA}), or use dataset = 'local' with your own files{hint}"
            ) from None
        self.path = path
        kwargs: dict[str, Any] = {"name": config_name} if config_name else {}
        what = f"{path!r}" + (f" (config {config_name!r})" if config_name else "")
        try:
            self.dataset = datasets.load_dataset(path, split="train", streaming=True, **kwargs)
        except Exception as e:  # the library raises many types for a bad name, path, split or network
            raise UserError(
                f"could not load huggingface dataset {what}, split 'train': {type(e).__name__}: {e}; "
                f"check training.dataset_path{hint}"
            ) from None

        # datasets' own resumable positions (IterableDataset.state_dict, datasets >= 2.18), per unit: the
        # state that reads the unit from its start, and (document index, state that resumes at it) of the
        # last document read, or of a loaded layout. Without state_dict a resume skips from the start.
        self._resumable = hasattr(self.dataset, "state_dict")
        self._positions: dict[tuple[int, int], tuple[int, dict]] = {}
        self._learned: dict[tuple[int, int], int] = {}  # documents per unit, counted by reading

    def units(self, target: int) -> list[tuple[int, int]]:
        """Unit (i, n) is the stream split i of n by datasets.distributed.split_dataset_by_node: with n
        the dataset's number of shards (files), shard i; for a stream that does not say, n = target, and
        a split is every n-th row of a full read."""
        n = getattr(self.dataset, "n_shards", None) or target
        return [(i, n) for i in range(n)]

    def unit_count(self, unit: tuple[int, int]) -> int | None:
        return self._learned.get(unit)

    def _open_unit(self, unit: tuple[int, int]):
        """A new stream of the unit (two lanes may read one unit at once), and its starting state."""
        from datasets.distributed import split_dataset_by_node

        stream = split_dataset_by_node(self.dataset, rank=unit[0], world_size=unit[1])
        return stream, stream.state_dict() if self._resumable else None

    def layout(self) -> dict | None:
        """Where datasets resumes each unit at its last document read, and the units' counts: saved with
        the data position, so that a resume starts there (datasets skips whole shards) instead of
        reading every document before it."""
        layout: dict[str, dict] = {}
        if self._positions:
            layout["hf_states"] = {f"{i}/{n}": [index, state] for (i, n), (index, state) in self._positions.items()}
        if self._learned:
            layout["unit_documents"] = {f"{i}/{n}": count for (i, n), count in self._learned.items()}
        return layout or None

    def load_layout(self, layout: dict):
        # A loaded position replaces the one held: it is the newer (a data worker's, sent with its window).
        for key, (index, state) in layout.get("hf_states", {}).items():
            if self._resumable:
                self._positions[_unit(key)] = (index, state)
        for key, count in layout.get("unit_documents", {}).items():
            self._learned.setdefault(_unit(key), count)

    def documents(self, start: int) -> Iterator[str]:
        yield from self.unit_texts((0, 1), start)

    def unit_texts(self, unit: tuple[int, int], start: int):
        """The texts of the unit from its document `start`; returns its number of documents. A stream
        cannot seek: from a saved datasets position at or before `start` it skips the rest, else it skips
        from the unit's first row."""
        stream, initial = self._open_unit(unit)
        saved = self._positions.get(unit)
        index = 0
        if initial is not None:
            index, state = saved if saved and saved[0] <= start else (0, initial)
            stream.load_state_dict(state)
        rows = iter(stream)
        field = self.text_field
        while True:
            before = stream.state_dict() if initial is not None else None
            try:
                row = next(rows, None)
            except Exception as e:  # the library and its readers raise many types for a bad file or network
                message = " ".join(str(e).split())
                raise UserError(
                    f"huggingface dataset {self.path!r}: reading up to document {index} failed ({type(e).__name__}: "
                    f"{message}); its data is corrupt or could not be fetched: fix or remove that file, or check "
                    "the network"
                ) from None
            if row is None:
                self._learned[unit] = index
                return index
            if index < start:
                index += 1
                continue
            if before is not None:
                self._positions[unit] = (index, before)
            if field not in row:
                raise UserError(
                    f"huggingface dataset {self.path!r} row {index} has no {field!r} column "
                    f"(columns: {', '.join(sorted(row))}); set training.dataset_text_field to the text column"
                )
            text = row[field]
            if text is not None and not isinstance(text, str):
                raise UserError(
                    f"huggingface dataset {self.path!r} row {index}: {field!r} is a {type(text).__name__}, "
                    "not a string; set training.dataset_text_field to the text column"
                )
            yield text or ""
            index += 1


# --- the reference schema's names: c4, c4_test --------------------------------------------------


def _unit(key: str) -> tuple[int, int]:
    """The unit (i, n) that a layout's key "i/n" names."""
    i, n = key.split("/")
    return int(i), int(n)


def _offline_alternatives() -> str:
    alternatives = [
        "training.dataset = 'python_stdlib' (embedded)",
        "training.dataset = 'local' with training.dataset_path = your files (.jsonl, .json, .txt, their .gz/.zst, "
        ".parquet, Arrow; C4's own en/c4-train.*.json.gz shards work too)",
    ]
    if Path(C4_TEST_PATH).is_dir():
        alternatives.append(f"training.dataset = 'c4_test' (the sample at {C4_TEST_PATH})")
    return "; offline alternatives: " + "; ".join(alternatives)


def _hub_unreachable() -> str | None:
    """Why the Hugging Face Hub cannot be reached from here, found in well under a second (the datasets
    library retries for about half a minute first); None if it may be reachable."""
    for var in ("HF_HUB_OFFLINE", "HF_DATASETS_OFFLINE"):
        if os.environ.get(var, "").upper() in ("1", "ON", "YES", "TRUE"):
            return f"{var} is set"
    endpoint = os.environ.get("HF_ENDPOINT", "https://huggingface.co")
    host = urllib.parse.urlparse(endpoint).hostname or endpoint
    try:
        socket.getaddrinfo(host, 443)
    except OSError as e:
        return f"{host} cannot be resolved ({e.strerror or e}): no network here?"
    return None


def _c4_local_include(folder: Path) -> tuple[Path, Callable[[str], bool] | None]:
    """A local copy of allenai/c4: its English training shards (en/c4-train.*.json.gz) when the folder
    is a clone of the repository (or its en/ folder); otherwise the folder is read as local data."""
    en = folder / "en" if (folder / "en").is_dir() else folder
    if any(name.startswith("c4-train.") for name in os.listdir(en)):
        return en, lambda name: name.startswith("c4-train.")
    return folder, None


def _c4_source(cfg: Training, check_all: bool):
    path = cfg.dataset_path or C4_HUB
    if os.path.exists(path):
        root, include = _c4_local_include(Path(path)) if os.path.isdir(path) else (Path(path), None)
        return FilesSource(
            str(root),
            cfg.dataset_text_field,
            name="c4",
            include=include,
            skip_corrupt=cfg.skip_corrupt_files,
            check_all=check_all,
        )
    hint = _offline_alternatives()
    try:
        import datasets  # noqa: F401
    except ImportError:
        raise UserError(
            f"training.dataset = 'c4' streams {path} from the Hugging Face Hub through the datasets package, which "
            f"is not installed: pip install datasets (or {INSTALL_DATA}) on a machine with network access{hint}"
        ) from None
    reason = _hub_unreachable()
    if reason:
        raise UserError(
            f"training.dataset = 'c4' streams {path} from the Hugging Face Hub, which cannot be reached: {reason}{hint}"
        )
    return HuggingFaceSource(path, cfg.dataset_text_field, config_name="en", name="c4", hint=hint)


def _c4_test_source(cfg: Training, check_all: bool):
    path = cfg.dataset_path or C4_TEST_PATH
    if not os.path.exists(path):
        raise UserError(
            f"training.dataset = 'c4_test' reads the reference torchtitan's C4 sample from {path} (a folder holding "
            f'data.json, one {{"text": ...}} object per line), relative to the working directory {os.getcwd()}, '
            "and it is not there: copy tests/assets/c4_test from a checkout of https://github.com/pytorch/torchtitan "
            f"to {path}, or set training.dataset_path to where it is; or train on training.dataset = 'python_stdlib' "
            "(embedded) or 'local' files"
        )
    return FilesSource(
        path, cfg.dataset_text_field, name="c4_test", skip_corrupt=cfg.skip_corrupt_files, check_all=check_all
    )


def build_source(cfg: Training, check_all: bool = True):
    """The source named by the config and whether to shuffle it, checked now: every rank fails the same
    way at start (and run_train.sh's preflight before launch). `check_all`: open and check every file of
    local data now (else the first, and the others when read). Which dataset names take a dataset_path
    is the config validator's rule (torchtitan/config/rules.py)."""
    if cfg.dataset == "python_stdlib":
        source = StdlibSource()
    elif cfg.dataset == "local" and cfg.dataset_path:
        source = FilesSource(
            cfg.dataset_path, cfg.dataset_text_field, skip_corrupt=cfg.skip_corrupt_files, check_all=check_all
        )
    elif cfg.dataset == "huggingface" and cfg.dataset_path:
        source = HuggingFaceSource(cfg.dataset_path, cfg.dataset_text_field)
    elif cfg.dataset == "c4":
        source = _c4_source(cfg, check_all)
    elif cfg.dataset == "c4_test":
        source = _c4_test_source(cfg, check_all)
    else:
        raise ValueError(f"unvalidated data config: dataset {cfg.dataset!r}, dataset_path {cfg.dataset_path!r}")
    # Every source shuffles its units and, in each lane, its documents (lanes.py). A datasets stream reads
    # in the order datasets gives unless asked (the reference framework's order for c4).
    default = not isinstance(source, HuggingFaceSource)
    shuffle = default if cfg.shuffle_documents is None else cfg.shuffle_documents
    # Finding one non-empty document is enough: a source too small for one sequence is caught
    # when its first epoch ends.
    where = f" at {cfg.dataset_path}" if cfg.dataset_path else ""
    try:
        found = any(text for text in source.documents(0))
    except UserError:
        raise
    except Exception as e:  # a streamed dataset: the network, the library
        if not isinstance(source, HuggingFaceSource):
            raise
        hint = _offline_alternatives() if cfg.dataset == "c4" else ""
        raise UserError(
            f"could not read the first document of dataset {cfg.dataset}{where}: {type(e).__name__}: {e}{hint}"
        ) from None
    if not found:
        raise UserError(f"dataset {cfg.dataset}{where} is empty: it has no non-empty document")
    return source, shuffle
