"""Pre-training data: documents -> one packed token stream -> each rank's share of every step.

What is unusual here:

- The default corpus, `python_stdlib`, is embedded: it is the `.py` files of the running
  interpreter's standard library (`sysconfig.get_paths()["stdlib"]`), minus `site-packages`,
  `dist-packages` and test folders (any path component named `test` or `tests`, and
  `idlelib/idle_test`), indexed in sorted relative POSIX path order, one file per document, read as
  UTF-8 with errors="replace". It is real text nobody here wrote, it exists offline on every
  machine, and it is deterministic for a given interpreter (~730 files, ~12 MB on CPython 3.11).

- Sources: a source is a list of documents with a stable index. Local corpora are files, read by
  extension: .jsonl / .json (JSON lines, or a .json array, of records with a text field), .txt (one
  document per file), each optionally compressed (.gz, .zst); .parquet and .arrow (a text column);
  and `datasets.save_to_disk` folders (their .arrow shards, in state.json order). A folder is read
  recursively in sorted relative path order. `c4` streams allenai/c4 through `datasets`; `c4_test`
  is the reference framework's local sample (tests/assets/c4_test/data.json, JSON lines).

- Shuffling: with training.shuffle_documents (default: wherever the source has random access),
  epoch e reads the documents in the order of a pseudo-random permutation of their indices seeded
  by (training.seed, e): a Feistel network over the index domain (`_Permutation`), computed per
  index in O(1) time and memory, the same on every rank and layout. Sources read as streams
  (compressed JSON lines, parquet, `huggingface`, `c4`) have no random access and keep their stored
  order.

- Packing: each document is tokenized as [BOS] + text + [EOS], the documents are concatenated
  into one global token stream, and the stream is cut into consecutive non-overlapping windows
  of seq_len + 1 tokens. Window k is global sample k (inputs = w[:-1], labels = w[1:]). At the
  end of the source the stream goes on with the next epoch's first document, without dropping the
  tokens carried over the boundary.

- Ownership: optimizer step s consumes global samples [s*G, (s+1)*G), G = global batch size.
  Data-parallel rank r of D owns the contiguous block [s*G + r*G/D, s*G + (r+1)*G/D), read in
  order and cut into micro-batches of local_batch_size. The samples of a step are thus the same
  for every D and every gradient-accumulation split, so runs of different layouts compare step
  by step. With a text source every rank tokenizes the whole stream and skips the windows it does
  not own: simple and deterministic, and cheap at this scale (sentencepiece encodes ~1.5M tokens/s
  per rank). At scale, pre-tokenize: `training.dataset = "tokens"` reads a token folder written by
  scripts/pretokenize.py (torchtitan/components/token_file.py), memory-mapped; a rank reads the
  tokens of its own windows only and skips the others by document lengths (docs.idx), without
  reading their tokens.

- Token folders: the same documents (each stored as encode_document frames it, empty ones as no
  tokens, so the indices are the text source's), the same permutation and the same packing code
  (`_TokenStream` consumes token lists from either source), hence the same samples, order and
  resumable state as the text pipeline on the corpus it was written from. By default its documents
  are shuffled where the text pipeline would shuffle that corpus (recorded in its meta.json).

- Resumable state, independent of the layout: the dataset's state names a position in the
  global stream (the next global sample, the epoch, the position of the document in the epoch's
  order, the token offset in that document and any carried tokens) and the order itself (the
  shuffle seed, or none, and the number of documents), not a rank's progress. At the end of its
  block in a step, a rank's state_dict() first reads ahead to the step boundary, so at step
  boundaries every rank holds the same state, and it can be loaded under another data-parallel
  degree: each rank then skips to its own block of the next step. A state saved mid-step resumes
  exactly, for the layout it was saved under. seq_len and the global batch size define what a
  global sample is, so a state only loads with the values it was saved with. States of version 1
  (before shuffling) load as states of the stored order.

- Worker processes (training.data_workers = W > 0, text sources): the documents of an epoch are
  read and tokenized in W forked processes, in chunks of 16 consecutive positions of the epoch's
  order dealt to the workers in turn, and come back in order. Cutting windows stays in the trainer
  process, so the samples, their order and the state are those of W = 0. Workers ignore the
  scheduler's signals (the trainer stops on them and shuts the workers down) and end with their
  trainer. Batches are pinned for CUDA (build_dataloader's pin_memory).

- Empty documents (and null texts) are skipped (no BOS/EOS pair for them), but they keep their
  document index.
"""

from torchtitan.components.data.loader import PackedDataset, build_dataloader
from torchtitan.components.data.packing import encode_document
from torchtitan.components.data.sources import build_source, stdlib_files

__all__ = ["PackedDataset", "build_dataloader", "build_source", "encode_document", "stdlib_files"]
