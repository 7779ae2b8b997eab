"""Pre-training data: documents -> packed token streams -> each rank's share of every step.

The modules, in the order data flows through them:

- compression.py: a file's bytes, plain, gzip or zstd, in chunks or lines; where a corrupt one fails.
- formats.py: local files, one reader per format (JSON lines/arrays, .txt, each plain, .gz or .zst;
  parquet; Arrow), each also in pieces.
- files.py: a file or folder of them (or a save_to_disk folder) as a source of documents, whole or
  in units.
- sources.py: every source by name: the embedded python_stdlib corpus, local files, Hugging Face
  datasets streamed through `datasets`, c4 and c4_test. A source is a list of documents with a
  stable index, read whole (documents(start)) or in units.
- token_folder.py: pre-tokenized corpora (scripts/pretokenize.py writes them): a folder of token ids
  and document offsets, read by memory map as a source of token documents.
- shuffle.py: seeded permutations computed per index in O(1).
- lanes.py: the split that lets each rank read only its share. Sample position p of every step is
  lane p; each source is cut into units (files, pieces of files, ranges of documents) dealt to the
  lanes, a new deal each epoch; a lane reads its units' documents, shuffled within the lane, and
  lanes that share a unit read different parts of it.
- packing.py: documents framed as [BOS] + text + [EOS], concatenated into one token stream per
  lane and source and cut into windows of seq_len + 1 tokens; the stream's position (epoch,
  document, token offset) is what a checkpoint saves.
- mixing.py: several sources with weights (training.dataset_mix): which source each global sample
  comes from, a fixed periodic schedule, so each lane knows its own.
- workers.py: lanes read in forked processes (training.data_workers), in the trainer's order.
- loader.py: the lanes of a rank and their state. Optimizer step s consumes global samples [s*G,
  (s+1)*G), G = global batch size; sample s*G + p is lane p's sample s; data-parallel rank r of D
  owns lanes [r*G/D, (r+1)*G/D), cut into micro-batches of local_batch_size. The samples of a step
  are thus the same for every D and every gradient-accumulation split, and a rank reads only its
  lanes' data. The state holds every lane's position (gathered from the ranks), so a state saved
  at a step boundary loads under another data-parallel degree; one saved mid-step resumes exactly
  for the layout it was saved under. seq_len and the global batch size define what a sample and a
  lane are, so a state only loads with the values it was saved with. States of versions 1-3 (one
  stream per source) are refused with the fix.
"""

from torchtitan.components.data.loader import PackedDataset, build_dataloader
from torchtitan.components.data.packing import encode_document
from torchtitan.components.data.sources import build_source, stdlib_files

__all__ = ["PackedDataset", "build_dataloader", "build_source", "encode_document", "stdlib_files"]
