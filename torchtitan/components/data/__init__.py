"""Pre-training data: documents -> packed token streams -> each rank's share of every step.

The modules, in the order data flows through them:

- compression.py: a file's bytes, plain, gzip or zstd, in chunks or lines; where a corrupt one fails.
- formats.py: local files, one reader per format (JSON lines/arrays, .txt, each plain, .gz or .zst;
  parquet; Arrow; save_to_disk folders), and a file or folder of them as a source of documents.
- sources.py: every source by name: the embedded python_stdlib corpus, local files, Hugging Face
  datasets streamed through `datasets`, c4 and c4_test. A source is a list of documents with a
  stable index; with random access it can be shuffled. (Token folders: token_file.py, beside.)
- shuffle.py: the per-epoch document order, a seeded permutation computed per index in O(1) (files
  read as streams permute their file order and blocks of documents with it: formats.FilesSource).
- packing.py: documents framed as [BOS] + text + [EOS], concatenated into one token stream per
  source and cut into windows of seq_len + 1 tokens; the stream's position (epoch, document,
  token offset) is what a checkpoint saves.
- workers.py: documents read and tokenized in forked processes (training.data_workers), in order.
- mixing.py: several sources with weights (training.dataset_mix): which source each global sample
  comes from, a deterministic schedule whose counts are the sources' own positions.
- loader.py: ownership and state. Optimizer step s consumes global samples [s*G, (s+1)*G), G =
  global batch size; data-parallel rank r of D owns the contiguous block [s*G + r*G/D, s*G +
  (r+1)*G/D), cut into micro-batches of local_batch_size. The samples of a step are thus the same
  for every D and every gradient-accumulation split. Every rank walks every source's stream and
  skips the windows it does not own (a token folder by document lengths alone, without reading
  tokens). At the end of its block a rank's state_dict() reads ahead to the step boundary, so at
  step boundaries every rank holds the same state and it loads under another data-parallel degree;
  a state saved mid-step resumes exactly for the layout it was saved under. seq_len and the global
  batch size define what a global sample is, so a state only loads with the values it was saved
  with. States of version 1 (before shuffling) load as states of the stored order, and version 2
  (before mixtures) as one source.
"""

from torchtitan.components.data.loader import PackedDataset, build_dataloader
from torchtitan.components.data.packing import encode_document
from torchtitan.components.data.sources import build_source, stdlib_files

__all__ = ["PackedDataset", "build_dataloader", "build_source", "encode_document", "stdlib_files"]
