"""GRPO's training step: completions sampled from the policy, scored by the reward functions, packed for the loss.

Everything GRPO adds to the one recipe lives here: ``GrpoStep`` (what the recipe asks of the objective
before a run: the prompt rows, the log line, the planner's work), ``GrpoRun`` (one run's tokenizer,
reward functions, generator and figures: each micro-batch's rollout, the loss, the eval, the per-step
figures) and the rollouts themselves. The settings are ``ft_assets.objectives.grpo.GrpoSettings``
(``config.grpo``).

One micro-batch of a GRPO step is ``per_device_batch_size`` prompts; ``rollout`` samples
``num_generations`` completions of each (the group), decodes them, scores them with the run's reward
functions (``ft_assets.rewards``), turns the rewards into group-relative advantages
(``ft_assets.training.loss.group_advantages``) and packs every prompt + completion into one row the way
packed chat rows are (position ids restart at each sequence; no attention mask), with the completion
tokens as labels, each token's advantage and loss weight, and, when ``grpo.beta`` > 0, the reference's
log-probabilities (the base with the adapter disabled, no gradients). All of it is computed from the
policy before the step's update, so every micro-batch of a step is on-policy.

Rollouts are seeded from (seed, step, rank, micro-batch) (``rollout_seed``; the recipe says where each
micro-batch is, ``GrpoRun.rollout`` turns it into the seed) inside a forked RNG, so
they do not draw from the training RNG streams: a run killed and resumed from a checkpoint samples
the same completions at every step as the uninterrupted run, and ends with the same adapter.

Generators:

- ``TransformersGenerator``: ``model.generate`` on the training model itself (LoRA active, eval mode),
  left-padded, sampling the full softmax at ``temperature`` (top-k and top-p off, whatever the
  model's generation config says), which is the distribution the loss's log-probabilities are taken
  from. On CPU, the tiny test model: ~0.1 s for 16 completions of 24 tokens.
- ``VllmGenerator`` (``generation_backend: vllm``, or ``auto`` on CUDA when vllm is installed): a vLLM
  engine colocated in the training process on the same GPU (``VLLM_MEMORY_FRACTION`` of its memory),
  holding the base model; each step's adapter is written to local disk and sampled through a
  ``LoRARequest`` (a few MB a step for r=16 on a 7B model). Seeded per request. vLLM's kernels differ
  from the training forward, so its sampling distribution is close to, not equal to, the one the loss
  uses (TRL corrects for it with importance sampling; here it is not corrected), and a QLoRA run
  samples from the bf16 base. It needs a GPU, so it is written, not run, in this repository's CI.
"""

from __future__ import annotations

import hashlib
import importlib.util
import shutil
import tempfile
from contextlib import nullcontext
from dataclasses import dataclass, field
from pathlib import Path

import torch

from ft_assets import rewards as rw
from ft_assets.generation import answer_ids, stop_tokens
from ft_assets.objectives.grpo import GrpoSettings
from ft_assets.shards import IGNORE_INDEX, Prompt, PromptRows, load_prompt_rows
from ft_assets.training.config import ResolvedTraining, TrainingConfig
from ft_assets.training.loss import group_advantages, grpo_loss_sum, token_logps
from ft_assets.training.steps import Mean, StepWork

VLLM_MEMORY_FRACTION = 0.3  # of the GPU for the colocated vLLM engine (weights + KV cache); training keeps the rest
EVAL_PROMPTS = 16  # prompts per greedy generate() call of the eval


def rollout_seed(seed: int, step: int, rank: int, micro: int) -> int:
    """The sampling seed of one micro-batch's rollout: a pure function of the run's seed and where it is."""
    digest = hashlib.sha256(f"{seed}/{step}/{rank}/{micro}".encode()).digest()
    return int.from_bytes(digest[:7], "big")


@dataclass
class Sampling:
    """How completions are drawn: what the settings and the tokenizer say."""

    max_new_tokens: int
    temperature: float
    eos_ids: list[int]  # any of them ends a completion (kept as its last token)
    pad_id: int


def end_at_eos(ids: list[int], eos_ids: list[int]) -> list[int]:
    """A generated sequence up to and including its first end-of-sequence token."""
    for i, token in enumerate(ids):
        if token in eos_ids:
            return ids[: i + 1]
    return ids


class TransformersGenerator:
    """Completions from ``model.generate`` on the training model, in one left-padded batch."""

    def __init__(self, sampling: Sampling):
        self.sampling = sampling

    def generate(self, model, prompts: list[torch.Tensor], n: int, seed: int | None, step: int = 0) -> list[list[int]]:
        """``n`` completions of each prompt (prompt-major), sampled with ``seed``, or greedy when ``seed`` is None."""
        from transformers import GenerationConfig

        s = self.sampling
        device = next(model.parameters()).device
        repeated = [p for p in prompts for _ in range(n)]
        width = max(len(p) for p in repeated)
        input_ids = torch.full((len(repeated), width), s.pad_id, dtype=torch.long)
        attention_mask = torch.zeros_like(input_ids)
        for row, ids in enumerate(repeated):
            input_ids[row, width - len(ids) :] = ids
            attention_mask[row, width - len(ids) :] = 1
        config = GenerationConfig(
            max_new_tokens=s.max_new_tokens, do_sample=seed is not None, temperature=s.temperature if seed is not None else None,
            top_k=0 if seed is not None else None, top_p=1.0 if seed is not None else None, pad_token_id=s.pad_id,
            eos_token_id=s.eos_ids,
        )  # fmt: skip
        was_training = model.training
        model.eval()
        devices = [device] if device.type == "cuda" else []
        with torch.no_grad(), torch.random.fork_rng(devices=devices):
            if seed is not None:
                torch.manual_seed(seed)
            output = model.generate(
                input_ids=input_ids.to(device), attention_mask=attention_mask.to(device), generation_config=config
            )
        model.train(was_training)
        return [end_at_eos(row, s.eos_ids) for row in output[:, width:].tolist()]


class VllmGenerator:
    """Completions from a vLLM engine colocated on the training GPU, the run's adapter loaded per step (module docstring)."""

    def __init__(self, sampling: Sampling, base_model_dir: Path, max_model_len: int, lora_r: int):
        from vllm import LLM  # only on a GPU worker with vllm installed; importing it takes ~15 s

        self.sampling, self.adapters = sampling, Path(tempfile.mkdtemp(prefix="ft-vllm-adapters-"))
        self.llm = LLM(
            model=str(base_model_dir), enable_lora=True, max_lora_rank=1 << (max(lora_r, 8) - 1).bit_length(), max_loras=1,
            gpu_memory_utilization=VLLM_MEMORY_FRACTION, max_model_len=max_model_len, seed=0,
        )  # fmt: skip

    def generate(self, model, prompts: list[torch.Tensor], n: int, seed: int | None, step: int = 0) -> list[list[int]]:
        from vllm import SamplingParams
        from vllm.lora.request import LoRARequest

        s = self.sampling
        folder = self.adapters / f"step-{step}"
        shutil.rmtree(self.adapters, ignore_errors=True)
        model.save_pretrained(folder)  # the adapter alone: what vLLM loads
        params = SamplingParams(
            n=n, max_tokens=s.max_new_tokens, temperature=s.temperature if seed is not None else 0.0, top_k=-1, top_p=1.0,
            seed=seed, stop_token_ids=s.eos_ids,
        )  # fmt: skip
        requests = [{"prompt_token_ids": p.tolist()} for p in prompts]
        outputs = self.llm.generate(
            requests, params, lora_request=LoRARequest(f"step-{step}", step + 1, str(folder)), use_tqdm=False
        )
        return [self._ended(completion) for output in outputs for completion in output.outputs]

    def _ended(self, completion) -> list[int]:
        """A vLLM completion's tokens with the token it stopped at, which training must see to learn to stop."""
        ids = end_at_eos(list(completion.token_ids), self.sampling.eos_ids)
        if completion.finish_reason == "stop" and (not ids or ids[-1] not in self.sampling.eos_ids):
            ids.append(completion.stop_reason if isinstance(completion.stop_reason, int) else self.sampling.eos_ids[0])
        return ids


def make_generator(
    backend: str, sampling: Sampling, base_model_dir: Path, max_model_len: int, lora_r: int, device: torch.device
):
    """The generator a run uses: vLLM when asked (or ``auto`` on CUDA with vllm installed), else transformers."""
    has_vllm = importlib.util.find_spec("vllm") is not None
    if backend == "vllm" and not (has_vllm and device.type == "cuda"):
        raise ValueError(
            "generation_backend 'vllm' needs a CUDA GPU and `pip install vllm`; use 'transformers' or 'auto'"
        )
    if backend == "vllm" or (backend == "auto" and has_vllm and device.type == "cuda"):
        return VllmGenerator(sampling, base_model_dir, max_model_len, lora_r)
    return TransformersGenerator(sampling)


@dataclass
class RolloutFigures:
    """What the rollouts and losses of the steps since the last log line measured (on this process)."""

    rewards: list[float] = field(default_factory=list)  # every completion's total reward (NaN: no function applied)
    lengths: list[int] = field(default_factory=list)  # completion lengths, tokens
    truncated: int = 0  # completions that hit max_completion_length without ending
    kl_sum: float = 0.0  # the per-token KL to the reference, summed over completion tokens
    kl_tokens: int = 0

    def summary(self) -> dict[str, float]:
        """reward mean and std (over completions), KL per completion token, mean completion length, truncated share."""
        scored = torch.tensor([r for r in self.rewards if r == r], dtype=torch.float64)
        return {
            "reward_mean": float(scored.mean()) if len(scored) else float("nan"),
            "reward_std": float(scored.std()) if len(scored) > 1 else 0.0,
            "kl": self.kl_sum / self.kl_tokens if self.kl_tokens else 0.0,
            "completion_length": sum(self.lengths) / len(self.lengths) if self.lengths else 0.0,
            "truncated_share": self.truncated / len(self.lengths) if self.lengths else 0.0,
        }


def pack_sequences(
    prompts: list[torch.Tensor], completions: list[list[int]], n: int, advantages: torch.Tensor, loss_type: str
) -> dict:
    """Every prompt + completion back to back in one row: ``input_ids``, ``position_ids`` (restarting at each
    sequence), ``labels`` (the completion tokens), and per position the advantage of its completion and its loss
    weight ('dapo': 1, 'grpo': 1 / the completion's length), plus ``items``: what the step's loss is a mean over."""
    ids, positions, labels, token_advantages, weights = [], [], [], [], []
    for k, completion in enumerate(completions):
        prompt = prompts[k // n].tolist()
        sequence = prompt + completion
        ids += sequence
        positions += list(range(len(sequence)))
        labels += [IGNORE_INDEX] * len(prompt) + completion
        token_advantages += [0.0] * len(prompt) + [float(advantages[k])] * len(completion)
        weight = 1.0 if loss_type == "dapo" else 1.0 / len(completion)
        weights += [0.0] * len(prompt) + [weight] * len(completion)
    items = sum(map(len, completions)) if loss_type == "dapo" else len(completions)
    return {
        "input_ids": torch.tensor([ids]), "position_ids": torch.tensor([positions]), "labels": torch.tensor([labels]),
        "advantages": torch.tensor([token_advantages]), "weights": torch.tensor([weights]), "items": torch.tensor(items),
    }  # fmt: skip


def score_completions(
    tokenizer, reward_fns: list[rw.Reward], prompts: list[Prompt], completions: list[list[int]], n: int
) -> tuple[list[str], torch.Tensor]:
    """The completions decoded (a harmony reply's answer: ``generation.answer_ids``) and each one's total reward (NaN
    where no function applied), prompt-major."""
    replies = [tokenizer.decode(answer_ids(tokenizer, list(c)), skip_special_tokens=True) for c in completions]
    owners = [prompts[k // n] for k in range(len(completions))]
    scored = rw.score(reward_fns, [p.messages for p in owners], replies, [p.columns for p in owners])
    return replies, torch.tensor(rw.totals(scored), dtype=torch.float32)


def rollout(
    unwrapped,
    generator,
    tokenizer,
    reward_fns,
    batch: dict,
    settings: GrpoSettings,
    seed: int,
    step: int,
    figures: RolloutFigures,
) -> dict:
    """One micro-batch's GRPO rollout (module docstring): the packed batch the loss reads, on the CPU."""
    prompts: list[Prompt] = batch["prompts"]
    n = settings.num_generations
    completions = generator.generate(unwrapped, [p.input_ids for p in prompts], n, seed, step)
    _, rewards = score_completions(tokenizer, reward_fns, prompts, completions, n)
    packed = pack_sequences([p.input_ids for p in prompts], completions, n, group_advantages(rewards, n), settings.loss)
    if settings.beta:
        device = next(unwrapped.parameters()).device
        on_device = {name: packed[name].to(device) for name in ("input_ids", "position_ids", "labels")}
        was_training = unwrapped.training
        unwrapped.eval()
        with torch.no_grad(), unwrapped.disable_adapter():
            packed["reference_logps"] = token_logps(unwrapped, on_device, settings.temperature).cpu()
        unwrapped.train(was_training)
    figures.rewards += rewards.tolist()
    figures.lengths += [len(c) for c in completions]
    figures.truncated += sum(
        1 for c in completions if len(c) == settings.max_completion_length and c[-1] not in generator.sampling.eos_ids
    )
    return packed


class GrpoStep:
    """GRPO on prompt shards: completions sampled per prompt, scored by the run's reward functions, the policy
    pushed toward the better ones of each group, held to the base (adapter disabled) by a KL penalty."""

    def load_rows(self, shards_dir: Path, split: str, max_seq_len: int) -> PromptRows | None:
        return load_prompt_rows(shards_dir, split, max_seq_len)

    def describe_rows(self, rows: PromptRows, config: TrainingConfig) -> str:
        grpo = config.grpo
        return (
            f" (prompts; {grpo.num_generations} completions each of up to {grpo.max_completion_length} tokens, "
            f"rewards {', '.join(grpo.rewards)}, beta {grpo.beta:g}, {grpo.loss} loss)"
        )

    def work(self, config: TrainingConfig, shards: dict, resolved: ResolvedTraining) -> StepWork:
        """Every prompt of a step and its num_generations completions (at most max_completion_length tokens, planned at
        that), one micro-batch's sequences packed in one row."""
        grpo = config.grpo
        prompt = -(-shards["train_tokens"] // max(shards["train_rows"], 1))  # the mean prompt, in tokens
        sequence = prompt + grpo.max_completion_length
        group = config.per_device_batch_size * grpo.num_generations
        tokens = resolved.total_steps * resolved.rows_per_step * grpo.num_generations * sequence
        return StepWork(
            group * sequence, sequence, 1, tokens, grpo.beta > 0, grpo.max_completion_length / sequence, group
        )

    def for_run(self, config: TrainingConfig, base_model_dir: Path, model) -> GrpoRun:
        return GrpoRun(config, base_model_dir, model)


class GrpoRun:
    """One GRPO run's state: the tokenizer, the reward functions, the generator and the figures since the last log."""

    def __init__(self, config: TrainingConfig, base_model_dir: Path, model):
        from transformers import AutoTokenizer  # seconds to import; only the training process needs it

        self.settings: GrpoSettings = config.grpo
        self.seed = config.seed
        self.tokenizer = AutoTokenizer.from_pretrained(base_model_dir)
        self.rewards = rw.load_rewards(self.settings.rewards)
        pad = self.tokenizer.pad_token_id if self.tokenizer.pad_token_id is not None else self.tokenizer.eos_token_id
        # a completion ends at the tokenizer's eos or any end-of-turn id of the generation config, as eval answers do
        sampling = Sampling(
            self.settings.max_completion_length, self.settings.temperature, stop_tokens(model, self.tokenizer), pad
        )
        device = next(model.parameters()).device
        self.generator = make_generator(
            self.settings.generation_backend, sampling, base_model_dir, config.max_seq_len, config.lora_r, device
        )
        self.window = RolloutFigures()

    def rollout(self, unwrapped, batch: dict, step: int, rank: int, micro: int) -> dict[str, torch.Tensor]:
        """The micro-batch's completions, sampled with the seed of where it is (so a resumed run samples the same)."""
        seed = rollout_seed(self.seed, step, rank, micro)
        return rollout(
            unwrapped, self.generator, self.tokenizer, self.rewards, batch, self.settings, seed, step, self.window
        )

    def count(self, batch: dict[str, torch.Tensor]) -> int:
        return int(batch["items"])

    def loss_sum(self, model, unwrapped, batch: dict[str, torch.Tensor], config: TrainingConfig) -> torch.Tensor:
        logps = token_logps(model, batch, self.settings.temperature)
        reference = batch.get("reference_logps")
        completion = batch["labels"][:, 1:] != IGNORE_INDEX
        if reference is not None:
            with torch.no_grad():
                difference = reference - logps
                self.window.kl_sum += float(((difference.exp() - difference - 1) * completion).sum())
            self.window.kl_tokens += int(completion.sum())
        return grpo_loss_sum(logps, reference, batch["advantages"][:, 1:], batch["weights"][:, 1:], self.settings.beta)

    def evaluate(self, unwrapped, rows: PromptRows, config, device, rank, world, reduce) -> dict[str, float]:
        """The mean reward of greedy completions of every eval prompt (``eval_reward_mean``), and of the reference's
        (the base, adapter disabled), each process taking every world-th prompt."""
        prompts = rows.prompts[rank::world]
        sums = []
        for adapter in (True, False):
            total, count = 0.0, 0
            for start in range(0, len(prompts), EVAL_PROMPTS):
                part = prompts[start : start + EVAL_PROMPTS]
                with nullcontext() if adapter else unwrapped.disable_adapter():
                    completions = TransformersGenerator(self.generator.sampling).generate(
                        unwrapped, [p.input_ids for p in part], 1, None
                    )
                _, rewards = score_completions(self.tokenizer, self.rewards, part, completions, 1)
                scored = rewards[~rewards.isnan()]
                total, count = total + float(scored.sum()), count + len(scored)
            sums += [total, count]
        total = reduce(sums).tolist()
        return {
            "eval_reward_mean": total[0] / max(total[1], 1),
            "eval_reference_reward_mean": total[2] / max(total[3], 1),
        }

    def figures(self, mean: Mean) -> dict[str, float]:
        """Reward mean and std, KL and completion length of the rollouts since the last call, averaged over the
        processes (a collective: every rank logs at the same steps)."""
        figures, self.window = self.window.summary(), RolloutFigures()
        return dict(zip(figures, mean(list(figures.values()))))
