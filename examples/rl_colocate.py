"""An RL trainer and its rollout engine on one GPU, handing memory to each other every iteration.

    python examples/rl_colocate.py                  # the loop on torch_uvm_saver, phase by phase
    python examples/rl_colocate.py --compare        # the same loop on torch_memory_saver and on
                                                    # plain copies too, in one run (a benchmark)

The actor is a GPT-2 model (built from a config, ``--model`` small/medium/large/xl) trained in
float32 with Adam; the rollout engine is a second process that samples from a bfloat16 copy of
it with a KV cache. Every iteration:

    generate        the rollout samples a batch (its KV cache lives in the pausable tag "kv")
    pause_rollout   the rollout pauses "kv" (no backup: the cache is rebuilt next time) and the
                    trainer pauses "rollout_weights", which the rollout maps (it unmaps first)
    resume_trainer  the actor's weights (no backup: the "actor" snapshot holds them) and Adam's
                    state (CPU backup) come back
    restore_ref     tus.restore("ref") writes the reference weights into the live parameters,
    ref_forward     which score the batch,
    restore_actor   and tus.restore("actor") puts the actor back
    train           a few policy-gradient steps
    snapshot_actor  tus.snapshot("actor", model)
    sync_weights    the trainer resumes "rollout_weights" (the rollout maps it again) and writes
                    the new weights into it as bfloat16: the rollout sees them with no copy and
                    no message, because it maps the same memory (tus.share / tus.attach)
    pause_trainer   the trainer pauses its weights and Adam's state (backed up to the host)
    resume_rollout  the rollout resumes "kv"

Why the loop is built this way, and what the peers do instead, is in Note [The colocated loop]
below. ``generate``, ``ref_forward`` and ``train`` are the same work in every variant; the rest is
the switching overhead the comparison is about.

Needs a CUDA GPU and transformers. ``--compare`` builds torch_memory_saver from a checkout in
.peer/torch_memory_saver (``git clone https://github.com/fzyzcjy/torch_memory_saver
.peer/torch_memory_saver``; see benchmarks/_tms_peer.py) and skips it, saying why, when it cannot.
"""

# Note [The colocated loop]
# Memory on the GPU is either the trainer's (float32 weights, Adam's two moments: 3 bytes of
# state per weight byte) or the rollout's (bfloat16 weights, the KV cache), never both at once.
# - The rollout's weights are the trainer's memory, shared: the trainer owns the tag
#   "rollout_weights" and serves it (tus.share); the rollout process maps it (tus.attach) and
#   loads it into its model with assign=True. Syncing weights is a device-side cast into that
#   memory. torch_memory_saver cannot share, so its rollout holds its own weights, pauses them
#   with the KV cache and receives new ones over CUDA IPC (what verl and slime do).
# - The "actor" snapshot is taken after every training phase anyway (the reference weights are
#   written over the live parameters to score a batch), so the weights are paused without a CPU
#   backup: the snapshot is the backup, and restoring "actor" after the reference pass is what
#   brings them back. That saves a device-to-host copy of the weights per iteration. The
#   torch_memory_saver loop does the same with its own pinned copies (as slime's TensorBackuper
#   does); the plain-copy loop moves everything with `.to("cpu")`, as most code does.

from __future__ import annotations

import argparse
import functools
import importlib
import importlib.util
import json
import statistics
import sys
import time
from pathlib import Path
from typing import Any, Callable

import torch
from rl_common import (
    RolloutProcess,
    Settings,
    build_policy,
    device_free_bytes,
    generate,
    load_shared_weights,
    make_adam_state,
    move_parameters,
    prompts_for,
    rewards_of,
    token_logprobs,
    train_step,
)

PHASES = (
    "generate",
    "pause_rollout",
    "resume_trainer",
    "restore_ref",
    "ref_forward",
    "restore_actor",
    "train",
    "snapshot_actor",
    "sync_weights",
    "pause_trainer",
    "resume_rollout",
)
COMPUTE = ("generate", "ref_forward", "train")  # the same work in every variant
SWITCHING = tuple(phase for phase in PHASES if phase not in COMPUTE)
# The settings a command line sets (the flags --batch, --prompt-tokens, ...; --model aside).
NUMBER_SETTINGS = ("batch", "prompt_tokens", "new_tokens", "train_steps", "iterations", "seed")
VARIANTS = {
    "tus": "rl_colocate:TusTrainer",
    "tms": "rl_colocate_peers:TmsTrainer",
    "tms-retain": "rl_colocate_peers:TmsRetainTrainer",
    "copies": "rl_colocate_peers:CopyTrainer",
}


class TusTrainer:
    """The trainer's side on torch_uvm_saver; its rollout is :class:`TusRollout`."""

    def __init__(self, settings: Settings) -> None:
        import torch_uvm_saver as tus

        self.tus = tus
        self.settings = settings
        model = build_policy(settings)
        with tus.region("actor"):  # no backup: see Note [The colocated loop]
            move_parameters(model, "cuda")
        self.model = model.to("cuda")
        self.optimizer = torch.optim.Adam(model.parameters(), lr=settings.learning_rate)
        with tus.region("optimizer", enable_cpu_backup=True):
            make_adam_state(self.optimizer)
        self._rollout_weights, shared = self._make_rollout_weights()
        self.share = tus.share("rollout_weights", shared)
        tus.snapshot("ref", model)
        tus.snapshot("actor", model)
        self.rollout = RolloutProcess(
            "rl_colocate:TusRollout", settings=settings.as_dict(), path=self.share.path
        )
        self.pause()  # every iteration starts with the trainer paused

    def _make_rollout_weights(self):
        """A bfloat16 tensor per parameter in the tag "rollout_weights", by every name the
        rollout's model knows it by (tied weights share one)."""
        copies: dict[int, torch.Tensor] = {}
        shared: dict[str, torch.Tensor] = {}
        with self.tus.region("rollout_weights"):
            for name, parameter in self.model.named_parameters(remove_duplicate=False):
                if id(parameter) not in copies:
                    copies[id(parameter)] = torch.empty_like(parameter, dtype=torch.bfloat16)
                shared[name] = copies[id(parameter)]
        pairs = [(copies[id(p)], p) for p in self.model.parameters()]
        self._write_rollout_weights(pairs)
        return pairs, shared

    @staticmethod
    @torch.no_grad()
    def _write_rollout_weights(pairs) -> None:
        for rollout_weight, parameter in pairs:
            rollout_weight.copy_(parameter)

    def pause_rollout(self) -> None:
        self.rollout.call("pause")
        self.tus.pause("rollout_weights")  # the rollout process unmaps it first

    def resume(self) -> None:
        self.tus.resume("actor")  # contents undefined until restore("ref")
        self.tus.resume("optimizer")

    def restore_ref(self) -> None:
        self.tus.restore("ref")

    def restore_actor(self) -> None:
        self.tus.restore("actor")

    def snapshot_actor(self) -> None:
        self.tus.snapshot("actor", self.model)

    def sync_weights(self) -> None:
        self.tus.resume("rollout_weights")  # the rollout maps it again at its own addresses
        self._write_rollout_weights(self._rollout_weights)

    def pause(self) -> None:
        self.tus.pause("optimizer")
        self.tus.pause("actor")

    def resume_rollout(self) -> None:
        self.rollout.call("resume")

    def close(self) -> None:
        self.rollout.stop()
        self.share.close()


class TusRollout:
    """The rollout engine on torch_uvm_saver: weights mapped from the trainer, KV in "kv"."""

    def __init__(self, settings: dict[str, Any], path: str) -> None:
        import torch_uvm_saver as tus

        self.tus = tus
        self.settings = Settings(**settings)
        self.attachment = tus.attach(path)
        model = build_policy(self.settings, torch.bfloat16)  # its weights are replaced next
        load_shared_weights(model, self.attachment.state_dict())
        self.model = model.to("cuda").eval()

    def generate(self, iteration: int):
        prompts = prompts_for(self.settings, iteration, self.model.config.vocab_size).cuda()
        with self.tus.region("kv"):  # the KV cache and every other buffer of sampling
            sequences = generate(self.model, prompts, self.settings.new_tokens, iteration)
        return sequences.cpu().numpy()

    def pause(self) -> None:
        self.tus.pause("kv")
        torch.cuda.empty_cache()

    def resume(self) -> None:
        self.tus.resume("kv")

    def close(self) -> None:
        self.attachment.close()


def _timed(seconds: dict[str, float], name: str, action: Callable[[], Any]) -> Any:
    torch.cuda.synchronize()
    start = time.perf_counter()
    value = action()
    torch.cuda.synchronize()
    seconds[name] = time.perf_counter() - start
    return value


def _freed(seconds: dict[str, float], name: str, action: Callable[[], Any]) -> int:
    """Runs the phase `name`; returns how much device memory it gave back."""
    before = device_free_bytes()
    _timed(seconds, name, action)
    return device_free_bytes() - before


def _score_and_train(trainer, settings: Settings, tokens, seconds: dict[str, float]) -> list:
    """ref_forward, restore_actor and train; the batch's tensors die with this frame, before
    the trainer pauses."""
    model = trainer.model
    sequences = torch.from_numpy(tokens).cuda()

    def score():
        with torch.no_grad(), torch.autocast("cuda", dtype=torch.bfloat16):
            return token_logprobs(model, sequences, settings.prompt_tokens)

    reference = _timed(seconds, "ref_forward", score)
    _timed(seconds, "restore_actor", trainer.restore_actor)
    rewards = rewards_of(sequences, settings.prompt_tokens)
    advantages = rewards - rewards.mean()

    def train():
        return [
            train_step(model, trainer.optimizer, sequences, advantages, reference, settings)
            for _ in range(settings.train_steps)
        ]

    return _timed(seconds, "train", train)


def one_iteration(trainer, settings: Settings, iteration: int) -> dict[str, Any]:
    """The phases of Note [The colocated loop], each timed; what each pause freed."""
    seconds: dict[str, float] = {}
    tokens = _timed(
        seconds,
        "generate",
        functools.partial(trainer.rollout.call, "generate", iteration=iteration),
    )
    freed_rollout = _freed(seconds, "pause_rollout", trainer.pause_rollout)
    _timed(seconds, "resume_trainer", trainer.resume)
    _timed(seconds, "restore_ref", trainer.restore_ref)
    losses = _score_and_train(trainer, settings, tokens, seconds)
    _timed(seconds, "snapshot_actor", trainer.snapshot_actor)
    _timed(seconds, "sync_weights", trainer.sync_weights)

    def pause_trainer():
        trainer.pause()
        torch.cuda.empty_cache()  # what the training pass left in PyTorch's cache

    freed_trainer = _freed(seconds, "pause_trainer", pause_trainer)
    _timed(seconds, "resume_rollout", trainer.resume_rollout)
    rewards = rewards_of(torch.from_numpy(tokens), settings.prompt_tokens)
    return {
        "iteration": iteration,
        "seconds": seconds,
        "switching_s": sum(seconds[phase] for phase in SWITCHING),
        "losses": losses,
        "mean_reward": float(rewards.mean()),
        "freed_at_pause_rollout": freed_rollout,
        "freed_at_pause_trainer": freed_trainer,
    }


def run_loop(trainer, settings: Settings, say: Callable[[str], None]) -> list[dict[str, Any]]:
    records = []
    for iteration in range(settings.iterations):
        record = one_iteration(trainer, settings, iteration)
        seconds = record["seconds"]
        say(
            f"  iteration {iteration}: generate {seconds['generate'] * 1e3:.0f} ms, train "
            f"{seconds['train'] * 1e3:.0f} ms, switching {record['switching_s'] * 1e3:.0f} ms; "
            f"freed {record['freed_at_pause_rollout'] / 2**30:.2f} GiB (rollout) and "
            f"{record['freed_at_pause_trainer'] / 2**30:.2f} GiB (trainer); loss "
            f"{record['losses'][-1]:.4f}, reward {record['mean_reward']:.3f}"
        )
        records.append(record)
    return records


def summarize(records: list[dict[str, Any]], warmup: int = 1) -> dict[str, Any]:
    """Medians over the iterations after the first `warmup` ones."""
    measured = records[warmup:] or records
    phases = {p: statistics.median(r["seconds"][p] for r in measured) for p in PHASES}
    return {
        "iterations_measured": len(measured),
        "phase_median_s": phases,
        "switching_median_s": statistics.median(r["switching_s"] for r in measured),
        "compute_median_s": statistics.median(
            sum(r["seconds"][p] for p in COMPUTE) for r in measured
        ),
        "iteration_median_s": statistics.median(sum(r["seconds"].values()) for r in measured),
        "freed_at_pause_rollout": statistics.median(r["freed_at_pause_rollout"] for r in measured),
        "freed_at_pause_trainer": statistics.median(r["freed_at_pause_trainer"] for r in measured),
    }


def print_phases(summary: dict[str, Any]) -> None:
    print(f"{'phase':<16}{'median ms':>10}")
    for phase, seconds in summary["phase_median_s"].items():
        kind = "" if phase in COMPUTE else "  (switching)"
        print(f"{phase:<16}{seconds * 1e3:>10.1f}{kind}")
    print(f"{'switching':<16}{summary['switching_median_s'] * 1e3:>10.1f}")
    print(f"{'iteration':<16}{summary['iteration_median_s'] * 1e3:>10.1f}")
    print(
        f"pausing the rollout frees {summary['freed_at_pause_rollout'] / 2**30:.2f} GiB, "
        f"pausing the trainer {summary['freed_at_pause_trainer'] / 2**30:.2f} GiB"
    )


def run_variant(name: str, settings: Settings) -> dict[str, Any]:
    """Builds the variant's trainer (and its rollout process), runs the loop, closes both."""
    module_name, class_name = VARIANTS[name].split(":")
    trainer_class = getattr(importlib.import_module(module_name), class_name)

    def say(line: str) -> None:
        print(line, file=sys.stderr, flush=True)

    say(f"{name}: model {settings.model}, {settings.iterations} iterations")
    start = time.perf_counter()
    trainer = trainer_class(settings)
    setup_s = time.perf_counter() - start
    try:
        records = run_loop(trainer, settings, say)
    finally:
        trainer.close()
    return {
        "variant": name,
        "setup_s": setup_s,
        "records": records,
        "summary": summarize(records),
    }


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    defaults = Settings()
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--variant", choices=sorted(VARIANTS), default="tus")
    parser.add_argument("--compare", action="store_true", help="run every variant, one run")
    parser.add_argument("--model", choices=["tiny", "small", "medium", "large", "xl"])
    for field in NUMBER_SETTINGS:
        flag = "--" + field.replace("_", "-")
        parser.add_argument(flag, type=int, default=getattr(defaults, field))
    parser.add_argument("--json", type=Path, help="write the result here")
    parser.add_argument("--output", type=Path, help="--compare: the JSON (default under results)")
    parser.add_argument("--tms-build", choices=["auto", "force", "never"], default="auto")
    args = parser.parse_args(argv)
    args.model = args.model or defaults.model
    return args


def settings_from(args: argparse.Namespace) -> Settings:
    return Settings(**{field: getattr(args, field) for field in ("model", *NUMBER_SETTINGS)})


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if not torch.cuda.is_available():
        print("rl_colocate needs a CUDA GPU", file=sys.stderr)
        return 2
    if importlib.util.find_spec("transformers") is None:
        print("rl_colocate builds a Hugging Face GPT-2: pip install transformers", file=sys.stderr)
        return 2
    if args.compare:
        from rl_compare import compare

        return compare(args, settings_from(args))
    result = run_variant(args.variant, settings_from(args))
    if args.json:
        args.json.write_text(json.dumps(result, indent=1))
    print_phases(result["summary"])
    return 0


if __name__ == "__main__":
    sys.exit(main())
