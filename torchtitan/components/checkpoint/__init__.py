"""Checkpoints that never lose a run: exact resume, resharding to any layout, crash safety; and model
weights in and out as Hugging Face folders.

Each module imports only those above it in this list:
- storage.py: a checkpoint's files and their names; reading them without trusting them (format,
  completeness, checksums, an allow-list unpickler for DCP's .metadata). Files only.
- folders.py: the checkpoint folder all ranks share: publishing, setting aside, purging.
- resume.py: which checkpoint a run continues from (preflight_checkpoint, choose_checkpoint).
- hf.py: Hugging Face folders (config.json + safetensors).
- weights.py: model weights of step-N folders outside training, and conversions to/from hf.py's folders.
- hf_sharded.py: Hugging Face weights in and out of a parallelized model, on every rank at once.
- state.py: what a checkpoint holds of a live run, and how it is written.
- load.py: loading a checkpoint or Hugging Face weights into a live run.
- async_save.py: saves written in the background.
- manager.py: CheckpointManager, the trainer's one handle on all of the above.
"""

from torchtitan.components.checkpoint.hf import (
    HF_CONFIG,
    HFFolder,
    check_hf_folder,
    load_hf,
    meta_shapes,
    read_hf_config,
    save_hf,
)
from torchtitan.components.checkpoint.hf_sharded import load_hf_into, peak_rss, restart_peak_rss, save_hf_sharded
from torchtitan.components.checkpoint.manager import CheckpointManager
from torchtitan.components.checkpoint.resume import preflight_checkpoint
from torchtitan.components.checkpoint.storage import (
    STATE_FILE,
    check_writable,
    complete_checkpoints,
    read_metadata,
    read_train_state,
    verify_checkpoint,
)
from torchtitan.components.checkpoint.weights import (
    dcp_model_name,
    dcp_to_hf,
    hf_to_dcp,
    read_dcp_model,
    write_dcp_model,
)

__all__ = [
    "HF_CONFIG",
    "STATE_FILE",
    "CheckpointManager",
    "HFFolder",
    "check_hf_folder",
    "check_writable",
    "complete_checkpoints",
    "dcp_model_name",
    "dcp_to_hf",
    "hf_to_dcp",
    "load_hf",
    "load_hf_into",
    "meta_shapes",
    "peak_rss",
    "preflight_checkpoint",
    "read_dcp_model",
    "read_hf_config",
    "read_metadata",
    "read_train_state",
    "restart_peak_rss",
    "save_hf",
    "save_hf_sharded",
    "verify_checkpoint",
    "write_dcp_model",
]
