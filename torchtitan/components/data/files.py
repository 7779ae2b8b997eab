"""A file or a folder of local data files (any format of formats.py), or a `datasets` save_to_disk
folder, as a source of documents: read whole in stored order, by index where every file has random
access, or in units (its files, or pieces of them) for the lanes of components/data/lanes.py."""

import bisect
import itertools
import json
import logging
import os
from collections.abc import Callable, Iterator
from pathlib import Path

from torchtitan.components.data.formats import SUPPORTED, file_format, open_file
from torchtitan.config.errors import UserError

logger = logging.getLogger(__name__)


def _save_to_disk_files(folder: Path) -> list[Path] | None:
    """The .arrow shards of a `datasets` save_to_disk folder, in its state.json order (a DatasetDict
    folder: those of its train split); None if `folder` is not such a folder."""
    splits_file = folder / "dataset_dict.json"
    if splits_file.is_file():
        try:
            splits = json.loads(splits_file.read_text())["splits"]
        except (ValueError, KeyError, TypeError) as e:
            raise UserError(
                f"cannot read {splits_file} ({type(e).__name__}: {e}): not a datasets DatasetDict folder"
            ) from None
        if "train" not in splits:
            raise UserError(
                f"{folder} is a datasets DatasetDict folder without a train split (its splits: {', '.join(splits)}); "
                "set training.dataset_path to the folder of the split to train on"
            )
        files = _save_to_disk_files(folder / "train")
        if files is None:
            raise UserError(f"{folder / 'train'} is not a datasets save_to_disk folder (no state.json)")
        return files
    state_file = folder / "state.json"
    if not (state_file.is_file() and (folder / "dataset_info.json").is_file()):
        return None
    try:
        names = [entry["filename"] for entry in json.loads(state_file.read_text())["_data_files"]]
    except (ValueError, KeyError, TypeError) as e:
        raise UserError(
            f"cannot read {state_file} ({type(e).__name__}: {e}): not a datasets save_to_disk folder"
        ) from None
    files = [folder / name for name in names]
    missing = [f.name for f in files if not f.is_file()]
    if missing:
        raise UserError(f"datasets folder {folder} lists data files that are missing: {', '.join(missing[:3])}")
    return files


def _is_ignored(name: str) -> bool:
    """Files a folder of data may hold besides data: hidden files, README.md and the like, licenses."""
    upper = name.upper()
    return name.startswith(".") or upper.endswith(".MD") or upper.startswith(("LICENSE", "COPYING", "NOTICE"))


class FilesSource:
    """Local data: a file, or a folder of files read recursively in sorted relative path order (hidden
    files and folders, *.md and LICENSE files are ignored; any other file must be data), or a
    `datasets` save_to_disk folder."""

    def __init__(
        self,
        path: str,
        text_field: str = "text",
        name: str = "local",
        include: Callable[[str], bool] | None = None,
        skip_corrupt: bool = False,
        check_all: bool = True,
    ):
        self.name, self.text_field = name, text_field
        # training.skip_corrupt_files: a file that fails past its start is read no further (a document
        # read by index: taken as empty), with a warning and a running count, instead of stopping the run.
        self.skip_corrupt = skip_corrupt
        self.skipped: dict[Path, int] = {}  # file -> how many times it failed (its rest, or documents read by index)
        root = Path(path)
        self.root = root
        if not root.exists():
            raise UserError(
                f"dataset_path {root} does not exist; set training.dataset_path to a data file ({SUPPORTED}) "
                "or a folder of them"
            )
        if root.is_dir():
            entries = self._walk(root, include)
            if not entries:
                raise UserError(f"dataset folder {root} is empty: it holds no data files (supported: {SUPPORTED})")
        else:
            fmt = file_format(root.name)
            if fmt is None:
                raise UserError(
                    f"dataset_path {root} has unsupported extension {root.suffix!r}; supported: {SUPPORTED}, "
                    "or a folder of such files"
                )
            entries = [(root, *fmt)]
        self.paths = [p for p, _, _ in entries]
        self._entries = entries
        self._readers: list = [None] * len(entries)
        # Random access by kind: .txt files and Arrow (JSON lines and parquet are read as streams).
        self.random_access = all(ext in (".txt", ".arrow") for _, ext, _ in entries)
        # Opening a file checks it (its header, footer or first record). `check_all`: every file now, so that
        # a bad one is refused before training (run_train.sh's preflight, and data-parallel rank 0); else only
        # the first, and each other file when a lane first reads it: a rank reads nothing of the files of
        # other ranks' lanes, not even their footers.
        for i in range(len(entries) if check_all else 1):
            self.file(i)
        self._ends: list[int] | None = None
        self._learned: dict[tuple[int, int, int], int] = {}  # documents per unit, counted by reading
        self._by_name: dict[str, int] | None = None  # a file's index by its layout name
        self._sizes: list[int | None] = [None] * len(self.paths)
        self._layout: tuple[int, dict | None] | None = None  # (counts it was built from, layout())

    @staticmethod
    def _walk(root: Path, include) -> list[tuple[Path, str, str | None]]:
        found, unknown = [], []  # found: (sort key, entry)
        for dirpath, dirnames, filenames in os.walk(root):
            folder = Path(dirpath)
            rel = folder.relative_to(root).as_posix()
            arrow_files = _save_to_disk_files(folder)
            if arrow_files is not None:
                dirnames[:] = []
                found.extend(((f"{rel}/", i), (f, ".arrow", None)) for i, f in enumerate(arrow_files))
                continue
            dirnames[:] = [d for d in dirnames if not d.startswith(".")]
            for name in filenames:
                if _is_ignored(name) or (include is not None and not include(name)):
                    continue
                fmt = file_format(name)
                if fmt is None:
                    unknown.append(folder / name)
                else:
                    found.append((((folder / name).relative_to(root).as_posix(), 0), (folder / name, *fmt)))
        if unknown:
            unknown.sort()
            shown = ", ".join(str(p.relative_to(root)) for p in unknown[:3])
            more = f" and {len(unknown) - 3} more" if len(unknown) > 3 else ""
            raise UserError(
                f"dataset folder {root} holds files of unsupported types: {shown}{more}; supported: {SUPPORTED} "
                "(hidden files, *.md and LICENSE files are ignored). Move the other files out, or set "
                "training.dataset_path to a file or a subfolder"
            )
        return [entry for _, entry in sorted(found, key=lambda item: item[0])]

    def file(self, i: int):
        """The reader of file i, opened (and checked) on first use."""
        if self._readers[i] is None:
            self._readers[i] = open_file(*self._entries[i], self.text_field)
        return self._readers[i]

    def units(self, target: int) -> list[tuple[int, int, int]]:
        """The source cut into units (file, piece, pieces) of which there are about `target`: one per
        file, or with fewer files than `target` each file in as many pieces as it splits into."""
        files = len(self.paths)
        if files >= target:
            return [(i, 0, 1) for i in range(files)]
        k = -(-target // files)
        units = [(i, j, n) for i in range(files) for n in [self.file(i).max_pieces(k)] for j in range(n)]
        # Data states of version 4 cut JSON lines into byte ranges even where one held no line.
        self.units_differ_from_v4 = any(getattr(self.file(i), "pieces_dropped", False) for i in range(files))
        return units

    def unit_count(self, unit: tuple[int, int, int]) -> int | None:
        """The unit's number of documents: known without reading it (parquet, Arrow), or counted when it
        was read (or loaded with a saved layout); None if not known yet."""
        learned = self._learned.get(unit)
        return learned if learned is not None else self.file(unit[0]).known_count(unit[1], unit[2])

    def unit_texts(self, unit: tuple[int, int, int], start: int):
        """The texts of the unit from its document `start`; returns its number of documents, which is
        remembered (and saved with the position) when it was not known."""
        known = self.unit_count(unit)
        n = yield from self._texts(unit, start)
        if known is None:
            self._learned[unit] = n
        return n

    def documents(self, start: int) -> Iterator[str]:
        """The documents in stored order from position `start`, files before it skipped by their counts
        where known."""
        for i in range(len(self.paths)):
            known = self.unit_count((i, 0, 1))
            if known is not None and known <= start:
                start -= known  # a file before the position: skipped without reading it
                continue
            n = yield from self.unit_texts((i, 0, 1), start)
            start = max(0, start - n)

    def _texts(self, unit: tuple[int, int, int], start: int):
        """The texts of a unit from its document `start`; returns the unit's document count. With
        skip_corrupt, a unit that fails ends there: its count is the documents before the failure."""
        i = unit[0]
        texts = self.file(i).texts(start, unit[1], unit[2])
        if not self.skip_corrupt:
            return (yield from texts)
        read = 0
        while True:
            try:
                text = next(texts)
            except StopIteration as end:
                return end.value
            except UserError as e:
                self._skip(i, e, f"the rest of it, after document {start + read}")
                return start + read
            read += 1
            yield text

    def _skip(self, i: int, error: UserError, what: str):
        path = self.paths[i]
        self.skipped[path] = self.skipped.get(path, 0) + 1
        logger.warning(
            "training.skip_corrupt_files: skipping %s of %s (%s); skipped so far: %d document(s) or "
            "file rest(s) in %d file(s)",
            what,
            path,
            error,
            sum(self.skipped.values()),
            len(self.skipped),
        )

    def layout(self) -> dict | None:
        """Documents per unit of the units counted so far by reading them, with the file's size: saved
        with the data position, so that a resume skips those units without reading them. Built again
        only when a count was added (a worker asks after every window)."""
        if self._layout is None or self._layout[0] != len(self._learned):
            learned = {self._unit_key(unit): [n, self._size(unit[0])] for unit, n in self._learned.items()}
            self._layout = (len(self._learned), {"unit_documents": learned} if learned else None)
        return self._layout[1]

    def _size(self, i: int) -> int:
        size = self._sizes[i]
        if size is None:
            size = self._sizes[i] = self.paths[i].stat().st_size
        return size

    def load_layout(self, layout: dict):
        """Take the counts of a saved layout for the units of files still there with the same size."""
        if self._by_name is None:
            self._by_name = {self._relative(i): i for i in range(len(self.paths))}
        for key, (n, size) in layout.get("unit_documents", {}).items():
            name, _, piece = key.rpartition("#")
            i = self._by_name.get(name)
            if i is None:  # the file is gone
                continue
            j, _, pieces = piece.partition("/")
            unit = (i, int(j), int(pieces))
            if unit not in self._learned and size == self._size(i):
                self._learned[unit] = n

    def _unit_key(self, unit: tuple[int, int, int]) -> str:
        return f"{self._relative(unit[0])}#{unit[1]}/{unit[2]}"

    def _relative(self, i: int) -> str:
        return self.paths[i].relative_to(self.root).as_posix() if self.root.is_dir() else self.paths[i].name

    def _file_ends(self) -> list[int]:
        if self._ends is None:
            self._ends = list(itertools.accumulate(self.file(i).count() for i in range(len(self.paths))))
        return self._ends

    def num_documents(self) -> int:
        return self._file_ends()[-1]

    def document(self, index: int) -> str:
        ends = self._file_ends()
        k = bisect.bisect_right(ends, index)
        try:
            return self.file(k).text(index - (ends[k - 1] if k else 0))
        except UserError as e:
            if not self.skip_corrupt:
                raise
            self._skip(k, e, f"document {index - (ends[k - 1] if k else 0)} (read as empty)")
            return ""
