"""The colocated loop of rl_colocate.py built on what a user would pick instead of us.

- ``TmsTrainer`` / ``TmsRollout``: torch_memory_saver (its torch hook mode). The trainer's weights
  live in a region without backup and Adam's state in one with a CPU backup; the reference and
  actor weights are pinned host copies made once and written with ``copy_`` (as slime's
  TensorBackuper does). torch_memory_saver cannot share memory between processes, so the rollout
  holds its own bfloat16 weights in a region it pauses with the KV cache, and receives new weights
  over CUDA IPC: one bfloat16 bucket, opened and copied in (as verl and slime do).
  ``TmsRetainTrainer`` keeps its CPU backups across resumes (``retain_cpu_backup``), which spares
  a pinned allocation per pause.
- ``CopyTrainer`` / ``CopyRollout``: PyTorch alone. The trainer moves its model and Adam's state
  with ``.to("cpu")`` and back, keeps the reference and actor weights as CPU state dicts and loads
  them with ``load_state_dict``; the rollout frees its weights and empties PyTorch's cache, and
  gets new weights over CUDA IPC like the torch_memory_saver rollout.

These modules must not import torch_uvm_saver: the torch_memory_saver processes run with only
its checkout on the path.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.multiprocessing  # registers the CUDA IPC reductions the pipe pickles with
from rl_common import (
    RolloutProcess,
    Settings,
    build_policy,
    generate,
    make_adam_state,
    move_parameters,
    prompts_for,
)

__all__ = ["CopyRollout", "CopyTrainer", "TmsRetainTrainer", "TmsRollout", "TmsTrainer"]


def _load_tms(retain: bool):
    import torch_memory_saver

    if torch_memory_saver.__name__ != "torch_memory_saver" or "torch_uvm_saver" in repr(
        torch_memory_saver
    ):
        raise RuntimeError(f"expected the real torch_memory_saver, got {torch_memory_saver!r}")
    from torch_memory_saver import torch_memory_saver as tms

    tms.hook_mode = "torch"
    tms.retain_cpu_backup = retain
    return tms


@torch.no_grad()
def send_weights(model: torch.nn.Module, rollout: RolloutProcess) -> None:
    """The weights as one bfloat16 bucket over CUDA IPC; the rollout copies them into its own."""
    parameters = dict(model.named_parameters())  # a tied weight once
    bucket = torch.empty(
        sum(p.numel() for p in parameters.values()), dtype=torch.bfloat16, device="cuda"
    )
    layout, offset = [], 0
    for name, parameter in parameters.items():
        bucket[offset : offset + parameter.numel()].copy_(parameter.view(-1))
        layout.append((name, offset, parameter.numel()))
        offset += parameter.numel()
    torch.cuda.synchronize()
    rollout.call("load_weights", bucket=bucket, layout=layout)
    del bucket


class _IpcRollout:
    """The part both peer rollouts share: receiving weights into their own parameters."""

    model: torch.nn.Module
    settings: Settings

    @torch.no_grad()
    def load_weights(self, bucket: torch.Tensor, layout: list[tuple[str, int, int]]) -> None:
        parameters = dict(self.model.named_parameters())
        for name, offset, count in layout:
            target = parameters[name]
            target.copy_(bucket[offset : offset + count].view(target.shape))
        torch.cuda.synchronize()
        del bucket

    def _prompts(self, iteration: int) -> torch.Tensor:
        return prompts_for(self.settings, iteration, self.model.config.vocab_size).cuda()


class PinnedCopy:
    """A model's parameters and buffers in pinned host memory, allocated once."""

    def __init__(self, model: torch.nn.Module) -> None:
        self.tensors = dict(model.named_parameters()) | dict(model.named_buffers())
        self.host = {
            name: torch.empty(t.shape, dtype=t.dtype, pin_memory=True)
            for name, t in self.tensors.items()
        }

    @torch.no_grad()
    def take(self) -> None:
        for name, tensor in self.tensors.items():
            self.host[name].copy_(tensor, non_blocking=True)
        torch.cuda.synchronize()

    @torch.no_grad()
    def put(self) -> None:
        for name, tensor in self.tensors.items():
            tensor.copy_(self.host[name], non_blocking=True)
        torch.cuda.synchronize()


class _IpcTrainer:
    """What both peer trainers do alike: their rollout holds its own weights, freed with its KV
    cache at a pause and sent again over CUDA IPC once it has them back."""

    model: torch.nn.Module
    rollout: RolloutProcess

    def pause_rollout(self) -> None:
        self.rollout.call("pause")

    def sync_weights(self) -> None:
        self.rollout.call("resume_weights")
        send_weights(self.model, self.rollout)

    def resume_rollout(self) -> None:
        self.rollout.call("resume")

    def close(self) -> None:
        self.rollout.stop()


class TmsTrainer(_IpcTrainer):
    retain = False

    def __init__(self, settings: Settings) -> None:
        self.tms = _load_tms(self.retain)
        self.settings = settings
        model = build_policy(settings)
        with self.tms.region(tag="actor"):  # no backup: the pinned actor copy is the backup
            move_parameters(model, "cuda")
        self.model = model.to("cuda")
        self.optimizer = torch.optim.Adam(model.parameters(), lr=settings.learning_rate)
        with self.tms.region(tag="optimizer", enable_cpu_backup=True):
            make_adam_state(self.optimizer)
        self.ref, self.actor = PinnedCopy(model), PinnedCopy(model)
        self.ref.take()
        self.actor.take()
        self.rollout = RolloutProcess(
            "rl_colocate_peers:TmsRollout", settings=settings.as_dict(), retain=self.retain
        )
        send_weights(model, self.rollout)
        self.pause()

    def resume(self) -> None:
        self.tms.resume("actor")
        self.tms.resume("optimizer")

    def restore_ref(self) -> None:
        self.ref.put()

    def restore_actor(self) -> None:
        self.actor.put()

    def snapshot_actor(self) -> None:
        self.actor.take()

    def pause(self) -> None:
        self.tms.pause("optimizer")
        self.tms.pause("actor")


class TmsRetainTrainer(TmsTrainer):
    retain = True


class TmsRollout(_IpcRollout):
    def __init__(self, settings: dict[str, Any], retain: bool) -> None:
        self.tms = _load_tms(retain)
        self.settings = Settings(**settings)
        model = build_policy(self.settings, torch.bfloat16)
        with self.tms.region(tag="weights"):  # no backup: new weights arrive after a resume
            move_parameters(model, "cuda")
        self.model = model.to("cuda").eval()
        self.weights_paused = False

    def generate(self, iteration: int):
        prompts = self._prompts(iteration)
        with self.tms.region(tag="kv_cache"):
            sequences = generate(self.model, prompts, self.settings.new_tokens, iteration)
        return sequences.cpu().numpy()

    def pause(self) -> None:
        self.tms.pause("kv_cache")
        self.tms.pause("weights")
        self.weights_paused = True
        torch.cuda.empty_cache()

    def resume_weights(self) -> None:
        if self.weights_paused:
            self.tms.resume("weights")
            self.weights_paused = False

    def resume(self) -> None:
        self.tms.resume("kv_cache")


def _to(optimizer: torch.optim.Optimizer, device: str) -> None:
    for state in optimizer.state.values():
        for key, value in state.items():
            if key != "step" and torch.is_tensor(value):
                state[key] = value.to(device)


class CopyTrainer(_IpcTrainer):
    def __init__(self, settings: Settings) -> None:
        self.settings = settings
        self.model = build_policy(settings).to("cuda")
        self.optimizer = torch.optim.Adam(self.model.parameters(), lr=settings.learning_rate)
        make_adam_state(self.optimizer)
        self.ref = self._state_on_cpu()
        self.actor = self._state_on_cpu()
        self.rollout = RolloutProcess("rl_colocate_peers:CopyRollout", settings=settings.as_dict())
        send_weights(self.model, self.rollout)
        self.pause()

    def _state_on_cpu(self) -> dict[str, torch.Tensor]:
        return {name: t.to("cpu") for name, t in self.model.state_dict().items()}

    def resume(self) -> None:
        self.model.to("cuda")
        _to(self.optimizer, "cuda")

    def restore_ref(self) -> None:
        self.model.load_state_dict(self.ref)

    def restore_actor(self) -> None:
        self.model.load_state_dict(self.actor)

    def snapshot_actor(self) -> None:
        self.actor = self._state_on_cpu()

    def pause(self) -> None:
        self.model.to("cpu")
        _to(self.optimizer, "cpu")


class CopyRollout(_IpcRollout):
    def __init__(self, settings: dict[str, Any]) -> None:
        self.settings = Settings(**settings)
        self.model = build_policy(self.settings, torch.bfloat16).to("cuda").eval()
        self.shapes: dict[str, torch.Size] = {}

    def generate(self, iteration: int):
        sequences = generate(
            self.model, self._prompts(iteration), self.settings.new_tokens, iteration
        )
        return sequences.cpu().numpy()

    def pause(self) -> None:
        for name, parameter in self.model.named_parameters():
            self.shapes[name] = parameter.shape
            parameter.data = torch.empty(0, dtype=parameter.dtype, device="cuda")
        torch.cuda.empty_cache()  # the KV cache and the weights go back to the driver

    def resume_weights(self) -> None:
        for name, parameter in self.model.named_parameters():
            if name in self.shapes:
                parameter.data = torch.empty(
                    self.shapes.pop(name), dtype=parameter.dtype, device="cuda"
                )

    def resume(self) -> None:
        pass  # the KV cache is allocated again as generation goes
