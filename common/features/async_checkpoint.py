"""Asynchronous checkpoints (`--async_checkpointing`): at a checkpoint step the loop waits only while the training
state is copied to host memory (pinned where CUDA is there); a background thread writes it into the same
`checkpoints/.tmp-step_N` folder a blocking save uses, in accelerate's `save_state` layout (`load_state` resumes it),
and publishes it as a blocking save does: every file fsynced, checksummed, the completion marker, the rename, the
pruning. Until then the folder is a leftover no resume picks, so a kill at any moment leaves the newest complete
checkpoint to resume from, as with blocking saves.

What the loop blocks for, per engine:
- one process and DDP: `get_state_dict` of the model and the optimizer's `state_dict()` copied to host memory, and the
  small files (scheduler, RNG, dataloader position, registered objects, run.json) written at once; the weights and
  optimizer files are written in the background with accelerate's own `save`.
- FSDP2 (sharded state dict): each rank's shards copied to host memory by torch's `dcp.async_save`, which writes them
  into accelerate's DCP folders in the background, over gloo groups of its own (the training's collectives keep the
  default group).
- DeepSpeed, FSDP1 and FSDP2 with full state dicts: refused in one line (DeepSpeed's engine writes its partitions
  itself and has no staging API; the others are not staged here).

The processes agree without a collective in the background: each one's thread writes `.written-rank_N` into the folder
once its part is on disk; the main process's thread waits for all of them, then publishes. At most one save is in
flight: the next save, a stop, the end of the loop and the end of the run wait for it (`wait_for_checkpoint`), and a
write that failed (a full disk) stops the run there with one line, on every rank.
"""

from __future__ import annotations

import argparse
import os
import shutil
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import torch
from accelerate import Accelerator
from accelerate.checkpointing import save_accelerator_state, save_custom_state
from accelerate.logging import get_logger
from accelerate.utils import DistributedType, broadcast_object_list, gather_object, save
from accelerate.utils.constants import OPTIMIZER_NAME, SAFE_WEIGHTS_NAME, WEIGHTS_NAME

from common.checkpoint import CheckpointExtras, complete_checkpoints, publish
from common.errors import fail, fail_on_every_rank
from common.metrics import count_rows
from common.paths import CHECKPOINT_DIR, LEFTOVER_PREFIX, METRICS_FILE
from common.upstream import (prepared_dataloaders_and_registered_objects, prepared_models,
                             prepared_optimizers_and_schedulers, save_state_pre_hooks)

logger = get_logger(__name__)

# Tests: seconds the background writer sleeps before each large file, so that a kill lands inside the write.
WRITE_DELAY_ENV = "ASYNC_CHECKPOINT_TEST_DELAY_S"
WRITTEN, FAILED = ".written-rank_", ".failed-rank_"  # each process's part is on disk / could not be written


def add_async_checkpoint_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--async_checkpointing", action="store_true",
                        help="Write checkpoints in a background thread: the loop waits only while the training state "
                             "is copied to host memory (one more copy of it there). Not with DeepSpeed.")


def save_in_background(args: argparse.Namespace, accelerator: Accelerator) -> BackgroundCheckpoints | None:
    """`CheckpointExtras.save` for --async_checkpointing (None without it); one line, before any heavy work, for an
    engine whose state is not staged here."""
    if not args.async_checkpointing:
        return None
    if accelerator.distributed_type == DistributedType.DEEPSPEED:
        fail("--async_checkpointing does not work with DeepSpeed (its engine writes its own partitions and offers no "
             "copy to stage): drop the flag, or train with DDP or FSDP2")
    if accelerator.distributed_type == DistributedType.FSDP:
        plugin = accelerator.state.fsdp_plugin
        if plugin.fsdp_version != 2 or "SHARDED" not in str(plugin.state_dict_type):
            fail("--async_checkpointing needs FSDP2 with fsdp_state_dict_type: SHARDED_STATE_DICT (as "
                 "accelerate_configs/fsdp2.yaml sets): drop the flag, or change the config")
    return BackgroundCheckpoints(accelerator)


def wait_for_checkpoint(extras: CheckpointExtras) -> None:
    """Collective: return once the checkpoint being written in the background is published; one line if it failed."""
    if isinstance(extras.save, BackgroundCheckpoints):
        extras.save.wait()


@dataclass
class InFlight:
    """One save being written in the background."""
    path: str
    partial: str
    step: int
    extras: CheckpointExtras
    written: threading.Event = field(default_factory=threading.Event)  # this process's part is on disk (or failed)
    cancelled: threading.Event = field(default_factory=threading.Event)  # another process failed: do not publish
    write_error: BaseException | None = None
    publish_error: BaseException | None = None
    thread: threading.Thread | None = None


class BackgroundCheckpoints:
    """`save_checkpoint`'s replacement (`CheckpointExtras.save`): same arguments, same result, at most one in flight."""

    def __init__(self, accelerator: Accelerator) -> None:
        from torch.distributed.checkpoint.staging import DefaultStager, StagingOptions

        self.accelerator = accelerator
        # Synchronous copies into buffers kept from one save to the next (pinned where CUDA is there).
        self.stager = DefaultStager(StagingOptions(torch.cuda.is_available(), False, False, False))
        self.groups: list | None = None  # FSDP2: gloo groups for the background writes, one per DCP folder
        self.in_flight: InFlight | None = None

    def __call__(self, accelerator: Accelerator, output_dir: str, step: int, save_total_limit: int | None,
                 extras: CheckpointExtras) -> str | None:
        self.wait()
        root = os.path.join(output_dir, CHECKPOINT_DIR)
        path, partial = os.path.join(root, f"step_{step}"), os.path.join(root, f"{LEFTOVER_PREFIX}step_{step}")
        if extras.can_save and not extras.can_save(accelerator, f"checkpoint {path}"):
            return None
        if accelerator.is_main_process:
            shutil.rmtree(partial, ignore_errors=True)
        accelerator.wait_for_everyone()
        try:
            write_large_files = self.stage(partial, extras.kwargs(loading=False).get("safe_serialization", True))
            if accelerator.is_main_process and extras.write:
                extras.write(partial)
        except Exception as exc:
            if extras.explain_failed_save:
                extras.explain_failed_save(exc, partial, step)
            raise
        marker = {"step": step, "metrics_rows": count_rows(os.path.join(output_dir, METRICS_FILE))}
        save = InFlight(path, partial, step, extras)
        save.thread = threading.Thread(target=self.write, args=(save, write_large_files, marker, save_total_limit),
                                       name=f"checkpoint-step_{step}", daemon=True)
        save.thread.start()
        self.in_flight = save
        return path

    def stage(self, partial: str, safe_serialization: bool) -> Callable[[], None]:
        """Copy this process's large states to host memory and write the small files now; returns what writes the
        large ones (in the background)."""
        accelerator = self.accelerator
        models = prepared_models(accelerator)
        optimizers, schedulers = prepared_optimizers_and_schedulers(accelerator)
        dataloaders, registered = prepared_dataloaders_and_registered_objects(accelerator)
        on_each_node = accelerator.project_configuration.save_on_each_node
        os.makedirs(partial, exist_ok=True)
        if accelerator.distributed_type == DistributedType.FSDP:
            weights, write = [], self.stage_sharded(partial, models, optimizers)
        else:
            weights = [accelerator.get_state_dict(model, unwrap=False) for model in models]
        for hook in save_state_pre_hooks(accelerator):  # LoRA keeps the adapter, streaming writes its position
            hook(models, weights, partial)
        if accelerator.distributed_type != DistributedType.FSDP:
            writes = accelerator.is_local_main_process if on_each_node else accelerator.is_main_process
            staged = self.stager.stage({"weights": weights, "optimizers": [o.state_dict() for o in optimizers]}) \
                if writes else {"weights": [], "optimizers": []}
            write = lambda: write_states(partial, staged, on_each_node, safe_serialization)  # noqa: E731
        save_accelerator_state(partial, [], [], schedulers, dataloaders, accelerator.process_index, accelerator.step,
                               accelerator.scaler, save_on_each_node=on_each_node,
                               safe_serialization=safe_serialization)
        for i, obj in enumerate(registered):
            save_custom_state(obj, partial, i, save_on_each_node=on_each_node)
        return write

    def stage_sharded(self, partial: str, models: list, optimizers: list) -> Callable[[], None]:
        """FSDP2: `dcp.async_save` of each rank's shards into accelerate's folders (`pytorch_model_fsdp_N`,
        `optimizer_N`, keys "model" and "optimizer"); it stages them before returning."""
        import torch.distributed as dist
        import torch.distributed.checkpoint as dcp
        from torch.distributed.checkpoint.state_dict import get_model_state_dict, get_optimizer_state_dict

        if self.groups is None:  # collective: every rank saves at the same step
            self.groups = [dist.new_group(backend="gloo") for _ in range(2 * len(models))]
        futures, groups = [], iter(self.groups)
        for i, (model, optimizer) in enumerate(zip(models, optimizers)):
            for folder, state in ((f"pytorch_model_fsdp_{i}", {"model": get_model_state_dict(model)}),
                                  (f"{OPTIMIZER_NAME}_{i}", {"optimizer": get_optimizer_state_dict(model, optimizer)})):
                futures.append(dcp.async_save(state, storage_writer=dcp.FileSystemWriter(os.path.join(partial, folder)),
                                              process_group=next(groups), async_stager=self.stager))

        def write() -> None:
            delay()
            for future in futures:
                future.result()
        return write

    def write(self, save: InFlight, write_large_files: Callable[[], None], marker: dict,
              save_total_limit: int | None) -> None:
        """The background thread: this process's large files, then (main process) the publication."""
        accelerator, rank = self.accelerator, self.accelerator.process_index
        try:
            write_large_files()
            mark(save.partial, f"{WRITTEN}{rank}")
        except BaseException as exc:  # noqa: BLE001 - reported by `wait`, on every rank
            save.write_error = exc
            mark(save.partial, f"{FAILED}{rank}", missing_ok=True)
        finally:
            save.written.set()
        if not accelerator.is_main_process or save.write_error is not None:
            return
        try:
            if all_written(save, accelerator.num_processes):
                files = save.extras.record_files(None, save.partial) if save.extras.record_files else None
                publish(save.partial, save.path, {**marker, "files": files} if files is not None else marker,
                        save_total_limit)
        except BaseException as exc:  # noqa: BLE001
            save.publish_error = exc

    def wait(self) -> None:
        """Collective: the save in flight is published on return; a failed one stops the run with one line."""
        save, self.in_flight = self.in_flight, None
        if save is None:
            return
        accelerator = self.accelerator
        save.written.wait()
        mine = describe(save.write_error)
        failed = next(filter(None, gather_object([mine]) if accelerator.num_processes > 1 else [mine]), None)
        if failed:
            save.cancelled.set()  # the main process's thread stops waiting for the parts
        save.thread.join()
        if accelerator.is_main_process and failed is None:
            failed = describe(save.publish_error)
        if accelerator.num_processes > 1:
            failed = broadcast_object_list([failed])[0]
        if failed is None:
            logger.info(f"Saved checkpoint {save.path}")
            return
        error = save.write_error or save.publish_error
        if error is not None and save.extras.explain_failed_save:  # a full disk: its own line, the partial removed
            save.extras.explain_failed_save(error, save.partial, save.step)
        output_dir = os.path.dirname(os.path.dirname(save.path))
        intact = complete_checkpoints(output_dir)
        fail_on_every_rank(accelerator, f"checkpoint {save.path} could not be written in the background ({failed}); "
                           f"{intact[-1] + ' is intact' if intact else 'there is no earlier checkpoint'}: rerun with "
                           "--resume_from_checkpoint auto")

    def settle(self) -> tuple[str, int] | None:
        """This process alone, when the run stops on another error: let the save in flight finish; its partial
        folder and step when it was not published (None: nothing in flight, or published)."""
        save, self.in_flight = self.in_flight, None
        if save is None:
            return None
        save.thread.join()
        return (save.partial, save.step) if os.path.isdir(save.partial) or not os.path.isdir(save.path) else None


def write_states(partial: str, staged: dict, on_each_node: bool, safe_serialization: bool) -> None:
    """The weights and optimizer files `save_state` writes (accelerate 1.15's names), from the staged copies."""
    for i, state in enumerate(staged["weights"]):
        name = WEIGHTS_NAME if not safe_serialization else SAFE_WEIGHTS_NAME
        delay()
        save(state, os.path.join(partial, name.replace(".", f"_{i}.") if i else name), save_on_each_node=on_each_node,
             safe_serialization=safe_serialization)
    for i, state in enumerate(staged["optimizers"]):
        delay()
        save(state, os.path.join(partial, f"{OPTIMIZER_NAME}_{i}.bin" if i else f"{OPTIMIZER_NAME}.bin"),
             save_on_each_node=on_each_node)


def all_written(save: InFlight, processes: int) -> bool:
    """Main process, in the background: wait until every process has marked its part written (True), or one failed
    or `wait` cancelled (False); the marks are removed, so they are never part of a checkpoint."""
    expected = {f"{WRITTEN}{rank}" for rank in range(processes)}
    while not save.cancelled.is_set():
        names = set(os.listdir(save.partial))
        if any(name.startswith(FAILED) for name in names):
            return False
        if expected <= names:
            for name in expected:
                os.remove(os.path.join(save.partial, name))
            return True
        time.sleep(0.01)
    return False


def mark(partial: str, name: str, missing_ok: bool = False) -> None:
    try:
        open(os.path.join(partial, name), "w").close()
    except OSError:
        if not missing_ok:
            raise


def describe(error: BaseException | None) -> str | None:
    """An error as one line: its type and the first line of its message."""
    if error is None:
        return None
    lines = str(error).strip().splitlines()
    return f"{type(error).__name__}: {lines[0]}" if lines else type(error).__name__


def delay() -> None:
    seconds = float(os.environ.get(WRITE_DELAY_ENV, "0"))
    if seconds:
        time.sleep(seconds)
