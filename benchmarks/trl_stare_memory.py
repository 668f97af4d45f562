"""Peak memory of TRL's GRPO step alone and with STARE (stare_lightning.integrations.trl), on a CPU, where full
logits would dominate: a 2-layer Llama of width 64 with a 131,072-token vocabulary, micro-batches of 4 rows of 16
prompt and 1,024 completion tokens (fixed completions: no generation),
float32: one optimizer step (two where a generation batch spans two).

Arms, each in its own process. Reported: the RSS when training starts; the peak RSS (``ru_maxrss``) when the first
generation batch is ready, which covers TRL's no-grad passes and STARE's scoring pass and nothing after; and the
peak RSS of the whole run, which adds TRL's loss forward and backward:
- ``trl``: TRL's ``GRPOTrainer`` (its loss forward uses its fused head: no [rows, T, vocab] logits);
- ``trl_stare``: ``STAREGRPOTrainer``, whose scoring pass goes through the last hidden states (``trl_scoring``);
- ``trl_stare_full_logits``: the same trainer with the scoring pass it had before, which formed the full logits
  ``[rows, T + 1, V]`` and read them with ``token_stats_from_logits``: the reference for what is saved;
- ``trl_two_steps`` and ``trl_stare_two_steps``: two optimizer steps per generation batch (STARE's selector
  random), where TRL runs its own old log-prob pass and STARE's pass stands in for it.

    pip install -e ".[trl]"
    python benchmarks/trl_stare_memory.py                    # every arm; one JSON line each
    python benchmarks/trl_stare_memory.py --arm trl_stare    # one arm
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
os.environ.setdefault("TRL_EXPERIMENTAL_SILENCE", "1")

ARMS = ("trl", "trl_stare", "trl_stare_full_logits", "trl_two_steps", "trl_stare_two_steps")
VOCAB, WIDTH, LAYERS, PROMPT, COMPLETION, ROWS, GROUP = 131_072, 64, 2, 16, 1024, 4, 4


def _rss_mib() -> float:
    with open("/proc/self/statm") as handle:
        return int(handle.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20


def _model_and_tokenizer():
    import torch
    from tokenizers import Tokenizer, models
    from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

    config = LlamaConfig(
        vocab_size=VOCAB,
        hidden_size=WIDTH,
        intermediate_size=2 * WIDTH,
        num_hidden_layers=LAYERS,
        num_attention_heads=4,
        num_key_value_heads=4,
        max_position_embeddings=2 * (PROMPT + COMPLETION),
        pad_token_id=0,
        bos_token_id=1,
        eos_token_id=2,
        tie_word_embeddings=False,
    )
    torch.manual_seed(0)
    model = LlamaForCausalLM(config)
    words = models.WordLevel({f"t{i}": i for i in range(8)}, unk_token="t3")
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=Tokenizer(words), pad_token="t0", bos_token="t1", eos_token="t2", unk_token="t3"
    )
    return model, tokenizer


def _full_logits_trainer():
    """STAREGRPOTrainer with the scoring pass it had before: the full logits, then their statistics."""
    import torch

    from stare_lightning.algorithms.token_stats import TokenStats, token_stats_from_logits
    from stare_lightning.integrations.trl import STAREGRPOTrainer

    class FullLogits(STAREGRPOTrainer):
        @torch.no_grad()
        def _score(self, input_ids, attention_mask, width):
            parts = []
            for start in range(0, input_ids.size(0), self.args.per_device_train_batch_size):
                rows = slice(start, start + self.args.per_device_train_batch_size)
                with self.accelerator.autocast():
                    logits = self.model(
                        input_ids=input_ids[rows], attention_mask=attention_mask[rows], logits_to_keep=width + 1
                    ).logits[:, :-1]
                stats = token_stats_from_logits(
                    logits, input_ids[rows, -width:], temperature=self.temperature, with_sensitivity=True
                )
                parts.append(stats)
            names = ("logprobs", "entropy", "sum_p2", "sum_p2_logp")
            return TokenStats(**{name: torch.cat([getattr(p, name) for p in parts]) for name in names})

    return FullLogits


def run_arm(arm: str, out_dir: str) -> dict[str, float | str]:
    import torch
    from datasets import Dataset
    from trl import GRPOConfig, GRPOTrainer

    from stare_lightning.integrations.trl import STAREGRPOTrainer, STARESettings

    model, tokenizer = _model_and_tokenizer()
    two_steps = arm.endswith("two_steps")
    prompts_per_batch = ROWS * (2 if two_steps else 1) // GROUP
    generator = torch.Generator().manual_seed(1)

    def rollout(prompts, trainer):
        prompt_ids = [torch.randint(8, VOCAB, (PROMPT,), generator=generator).tolist() for _ in prompts]
        completions = [torch.randint(8, VOCAB, (COMPLETION,), generator=generator).tolist() for _ in prompts]
        return {"prompt_ids": prompt_ids, "completion_ids": completions, "logprobs": None}

    def reward(completions, **kwargs):
        return [float(i % 3) for i in range(len(completions))]

    config = GRPOConfig(
        output_dir=out_dir,
        max_steps=2 if two_steps else 1,
        learning_rate=1e-4,
        per_device_train_batch_size=ROWS,
        gradient_accumulation_steps=1,
        steps_per_generation=2 if two_steps else 1,
        num_generations=GROUP,
        max_completion_length=COMPLETION,
        beta=0.0,
        use_cpu=True,
        bf16=False,
        report_to="none",
        save_strategy="no",
        logging_steps=1,
        seed=0,
    )
    dataset = Dataset.from_list([{"prompt": "t4"}] * (8 * prompts_per_batch * GROUP))
    common = dict(model=model, reward_funcs=reward, args=config, train_dataset=dataset, processing_class=tokenizer)
    common["rollout_func"] = rollout
    if arm in ("trl", "trl_two_steps"):
        trainer = GRPOTrainer(**common)
    else:
        cls = _full_logits_trainer() if arm == "trl_stare_full_logits" else STAREGRPOTrainer
        settings = STARESettings(selector="random") if two_steps else STARESettings(target_entropy=100.0)
        trainer = cls(**common, stare=settings)
    scoring = _peak_after_first_batch(trainer)
    start_rss = _rss_mib()
    began = time.perf_counter()
    trainer.train()
    seconds = time.perf_counter() - began
    return {
        "arm": arm,
        "rss_at_start_mib": round(start_rss),
        "peak_through_scoring_mib": round(scoring[0]),
        "peak_rss_mib": round(_peak_rss_mib()),
        "train_seconds": round(seconds, 1),
    }


def _peak_rss_mib() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # KiB on Linux


def _peak_after_first_batch(trainer) -> list[float]:
    """The process's peak RSS when the first generation batch is ready: through TRL's no-grad passes and STARE's
    scoring pass, before any loss forward (the peak RSS never falls, so this is the peak of everything before)."""
    peak = [float("nan")]
    original = trainer._generate_and_score_completions

    def recorded(inputs):
        batch = original(inputs)
        if peak[0] != peak[0]:
            peak[0] = _peak_rss_mib()
        return batch

    trainer._generate_and_score_completions = recorded
    return peak


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--arm", choices=ARMS, help="one arm, in this process (default: each in its own)")
    options = parser.parse_args()
    if options.arm:
        with tempfile.TemporaryDirectory() as out_dir:
            print(json.dumps(run_arm(options.arm, out_dir)), flush=True)
        return
    for arm in ARMS:
        subprocess.run([sys.executable, __file__, "--arm", arm], check=True)


if __name__ == "__main__":
    main()
