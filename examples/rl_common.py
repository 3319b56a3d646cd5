"""What every variant of the colocated RL loop shares: the policy's maths and the rollout process.

Not an example on its own; ``rl_colocate.py`` is. Nothing here imports torch_uvm_saver or
torch_memory_saver: the peers' processes must not load our library, and the variants differ only
in how memory moves, never in what is computed. Given the same seed every variant samples the same
tokens and takes the same training steps, which is how the comparison checks that it compares
like with like (the losses must agree).

The rollout engine runs in a second process (``RolloutProcess``). The trainer drives it with
synchronous calls over a pipe: ``call("generate", seed=3)`` runs ``engine.generate(seed=3)`` there
and returns its result, or raises ``RuntimeError`` with the rollout's traceback.
"""

from __future__ import annotations

import importlib
import multiprocessing
import traceback
from dataclasses import asdict, dataclass
from typing import Any

import torch

__all__ = [
    "MODELS",
    "RolloutProcess",
    "Settings",
    "build_policy",
    "device_free_bytes",
    "generate",
    "load_shared_weights",
    "make_adam_state",
    "move_parameters",
    "named_weights",
    "prompts_for",
    "rewards_of",
    "token_logprobs",
    "train_step",
]

# GPT-2 shapes (layers, heads, width), built from a config: no download, random weights.
MODELS = {
    "tiny": (2, 2, 128),
    "small": (12, 12, 768),
    "medium": (24, 16, 1024),
    "large": (36, 20, 1280),
    "xl": (48, 25, 1600),
}


@dataclass
class Settings:
    model: str = "medium"
    batch: int = 16
    prompt_tokens: int = 64
    new_tokens: int = 128
    train_steps: int = 2
    iterations: int = 5
    learning_rate: float = 1e-5
    kl_coefficient: float = 0.05
    seed: int = 0

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


def build_policy(settings: Settings, dtype: torch.dtype = torch.float32) -> torch.nn.Module:
    """The GPT-2 policy on the host, weights seeded so every variant starts from the same ones."""
    from transformers import GPT2Config, GPT2LMHeadModel

    layers, heads, width = MODELS[settings.model]
    # No dropout, as RL fine-tuning runs: the rollout, the reference pass and the training steps
    # then see the same function, and every variant computes the same numbers.
    config = GPT2Config(
        n_layer=layers, n_head=heads, n_embd=width, resid_pdrop=0, embd_pdrop=0, attn_pdrop=0
    )
    torch.manual_seed(settings.seed)
    return GPT2LMHeadModel(config).to(dtype)


def named_weights(model: torch.nn.Module) -> dict[str, torch.nn.Parameter]:
    """Every parameter by every name it has: GPT-2 ties ``lm_head.weight`` to the token
    embedding, and a receiving side that assigns by name needs both names."""
    return dict(model.named_parameters(remove_duplicate=False))


def make_adam_state(optimizer: torch.optim.Optimizer) -> None:
    """Adam's state, made now (zeros, as its first step would): the caller decides which memory
    it lands in by where it calls this."""
    for group in optimizer.param_groups:
        for parameter in group["params"]:
            optimizer.state[parameter] = {
                "step": torch.tensor(0.0),
                "exp_avg": torch.zeros_like(parameter, memory_format=torch.preserve_format),
                "exp_avg_sq": torch.zeros_like(parameter, memory_format=torch.preserve_format),
            }


def prompts_for(settings: Settings, iteration: int, vocab: int) -> torch.Tensor:
    generator = torch.Generator().manual_seed(settings.seed * 1000 + iteration)
    return torch.randint(0, vocab, (settings.batch, settings.prompt_tokens), generator=generator)


@torch.no_grad()
def generate(model: torch.nn.Module, prompts: torch.Tensor, new_tokens: int, seed: int):
    """Samples `new_tokens` tokens after `prompts` with the model's KV cache (allocated by the
    model as it goes, in whatever memory the caller routes allocations to)."""
    sampler = torch.Generator(device=prompts.device).manual_seed(seed)
    output = model(input_ids=prompts, use_cache=True)
    tokens = [prompts]
    for _ in range(new_tokens):
        probabilities = torch.softmax(output.logits[:, -1, :].float(), dim=-1)
        following = torch.multinomial(probabilities, 1, generator=sampler)
        tokens.append(following)
        output = model(input_ids=following, past_key_values=output.past_key_values, use_cache=True)
    return torch.cat(tokens, dim=1)


def token_logprobs(model: torch.nn.Module, sequences: torch.Tensor, prompt_tokens: int):
    """Log-probabilities the model gives each generated token (float32, batch x new tokens)."""
    logits = model(input_ids=sequences).logits[:, prompt_tokens - 1 : -1]
    chosen = sequences[:, prompt_tokens:, None]
    return torch.log_softmax(logits.float(), dim=-1).gather(-1, chosen).squeeze(-1)


def rewards_of(sequences: torch.Tensor, prompt_tokens: int) -> torch.Tensor:
    """A stand-in reward the policy can learn: the share of even token ids it generated."""
    generated = sequences[:, prompt_tokens:]
    return (generated % 2 == 0).float().mean(dim=1)


def train_step(model, optimizer, sequences, advantages, reference, settings: Settings) -> float:
    """One policy-gradient step with a KL penalty to the reference policy; returns the loss."""
    with torch.autocast("cuda", dtype=torch.bfloat16):
        logprobs = token_logprobs(model, sequences, settings.prompt_tokens)
    policy_loss = -(advantages[:, None] * logprobs).mean()
    loss = policy_loss + settings.kl_coefficient * (logprobs - reference).mean()
    loss.backward()
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    return loss.item()


def device_free_bytes() -> int:
    """Free memory of the whole GPU (every process's use counted), after queued work is done."""
    torch.cuda.synchronize()
    return torch.cuda.mem_get_info()[0]


def _serve(connection, engine_path: str, arguments: dict[str, Any]) -> None:
    module_name, class_name = engine_path.split(":")
    try:
        engine = getattr(importlib.import_module(module_name), class_name)(**arguments)
        connection.send(("ok", None))
    except BaseException:
        connection.send(("error", traceback.format_exc()))
        return
    while True:
        try:
            method, keywords = connection.recv()
        except EOFError:  # the trainer is gone
            break
        if method == "stop":
            connection.send(("ok", None))
            break
        try:
            result = getattr(engine, method)(**keywords)
            if torch.cuda.is_initialized():
                torch.cuda.synchronize()  # the trainer times the call: the work is done in it
            connection.send(("ok", result))
        except BaseException:
            connection.send(("error", traceback.format_exc()))
    close = getattr(engine, "close", None)
    if close is not None:
        close()


class RolloutProcess:
    """The rollout engine ``engine_path`` ("module:Class") in a spawned process.

    A spawned process starts clean (no CUDA state from the trainer) with the trainer's
    environment and ``sys.path``, so a module next to this one can be named.
    """

    def __init__(self, engine_path: str, timeout_s: float = 600.0, **arguments: Any) -> None:
        context = multiprocessing.get_context("spawn")
        self._connection, theirs = context.Pipe()
        self._timeout_s = timeout_s
        self._process = context.Process(
            target=_serve, args=(theirs, engine_path, arguments), name="rollout", daemon=True
        )
        self._process.start()
        theirs.close()
        self._answer("start")

    def _answer(self, method: str) -> Any:
        if not self._connection.poll(self._timeout_s):
            raise RuntimeError(f"rollout: {method} did not answer within {self._timeout_s} s")
        status, payload = self._connection.recv()
        if status != "ok":
            raise RuntimeError(f"rollout: {method} failed:\n{payload}")
        return payload

    def call(self, method: str, **keywords: Any) -> Any:
        self._connection.send((method, keywords))
        return self._answer(method)

    def stop(self) -> None:
        if self._process.is_alive():
            try:
                self._connection.send(("stop", {}))
                self._answer("stop")
            except (OSError, RuntimeError, EOFError):
                pass
            self._process.join(timeout=30)
        if self._process.is_alive():
            self._process.kill()
            self._process.join()


def move_parameters(model: torch.nn.Module, device: str, dtype: torch.dtype | None = None) -> None:
    """Moves only the parameters (each tied one once), so that the caller's allocation context
    (a region, a pool) holds the weights and nothing else; buffers follow with ``model.to``."""
    for parameter in model.parameters():
        parameter.data = parameter.data.to(device=device, dtype=dtype)


def load_shared_weights(model: torch.nn.Module, weights: dict[str, torch.Tensor]) -> None:
    """Points the model's parameters at `weights` (no copy); refuses a mismatch by name."""
    missing, unexpected = model.load_state_dict(weights, strict=False, assign=True)
    buffers = {name for name, _ in model.named_buffers()}
    if unexpected or set(missing) - buffers:
        raise ValueError(f"shared weights do not fit: missing {missing}, unexpected {unexpected}")
