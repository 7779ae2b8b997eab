"""Async saves (async_mode = "async"): the state is copied to host memory before training continues and
the files are written by a background thread over a separate gloo group; every step the ranks agree
(a one-element all-reduce) whether all writes are done, and only then publish. A new save first
waits for the previous one, so saves never overlap.
"""

import logging
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from typing import cast

import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed import ProcessGroup
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.staging import AsyncStager
from torch.distributed.checkpoint.state_dict_saver import AsyncSaveResponse

from torchtitan.components import watchdog
from torchtitan.components.checkpoint.folders import CheckpointFolder
from torchtitan.components.checkpoint.storage import describe_failure, write_checksums

logger = logging.getLogger(__name__)


class AsyncSaves:
    def __init__(self, async_mode: str, folder: CheckpointFolder, keep_latest_k: int):
        self.folder, self.keep_latest_k = folder, keep_latest_k
        self.pending: tuple[Future, int] | None = None  # an async save not yet published: (future, step)
        self.executor: ThreadPoolExecutor | None = None  # background checksums
        self.pg: ProcessGroup | None = None
        self.stager: AsyncStager | None = None
        if folder.peers.distributed:
            # Background writes use their own gloo group, so they never interleave with training collectives.
            # Every rank is a member of a group of all ranks, so this is a ProcessGroup (not NON_GROUP_MEMBER).
            self.pg = cast(ProcessGroup, dist.new_group(backend="gloo"))
        if async_mode == "async_with_pinned_mem":
            from torch.distributed.checkpoint.staging import DefaultStager, StagingOptions

            self.stager = DefaultStager(StagingOptions(True, False, False, False))

    def start(self, state: dict, step: int, write_side_files: Callable[[], None]):
        """Stage `state` and write it in the background into step's partial folder, with the files
        `write_side_files` writes there now. Call wait() first: one save at a time."""
        partial = self.folder.partial(step)
        error = None
        upload: Future | None = None
        try:
            result = dcp.async_save(
                state,
                checkpoint_id=partial,
                process_group=self.pg,
                async_stager=self.stager,
                no_dist=not self.folder.peers.distributed,
            )
            upload = result.upload_completion if isinstance(result, AsyncSaveResponse) else result
            write_side_files()
        except (OSError, CheckpointException) as e:
            error = describe_failure(e)
        self.folder.agree_or_abandon(error, step)
        assert upload is not None  # agree_or_abandon returned: every rank's save started, this one's too
        # Checksums are computed in the background too, once this rank's files are written.
        self.executor = self.executor or ThreadPoolExecutor(1, thread_name_prefix="checkpoint-checksums")
        self.pending = (self.executor.submit(self._finish_writing, upload, partial), step)
        # The background writes are bounded by comm.checkpoint_timeout_seconds too (components/watchdog.py).
        watchdog.in_background("checkpoint", f"writing checkpoint step-{step} in the background", self.pending[0].done)

    def _finish_writing(self, upload: Future, partial: str):
        upload.result()
        write_checksums(partial, self.folder.peers.rank)

    def maybe_publish(self):
        """Publish a finished save once every rank's writes are done."""
        if self.pending is None:
            return
        future, _ = self.pending
        if self.folder.peers.all_true(future.done()):
            self._finish_pending(self.pending)

    def wait(self):
        """Block until a pending save is written and published."""
        if self.pending is not None:
            self._finish_pending(self.pending)

    def _finish_pending(self, pending: tuple[Future, int]):
        future, step = pending
        self.pending = None
        error = None
        try:
            future.result()
        except (OSError, CheckpointException) as e:
            error = describe_failure(e)
        self.folder.agree_or_abandon(error, step)
        self.folder.publish(step, self.keep_latest_k)
        logger.info(f"published checkpoint {self.folder.step(step)}")

    def close(self):
        self.wait()
        if self.stager is not None:
            self.stager.close()
        if self.executor is not None:
            self.executor.shutdown()
