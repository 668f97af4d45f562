"""Supervised cold start of the built-in tiny model, so RL starts from a policy that sometimes succeeds.

A random 2-layer model never samples a correct countdown expression, and a group with all-zero rewards
carries no advantage. A short supervised pass on one random correct solution per prompt gives a policy
with non-trivial accuracy and entropy left to lose, the regime the STARE paper studies.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from stare_lightning.console import PROGRESS_EVERY_S, minutes

# Tokens a warm-up step of the tiny model gets through per second on an idle 2-core CPU: the default warm-up (400
# steps of 64 countdown examples of about 21 tokens each) took about 1.2 minutes there. A guide for the announced
# duration only: the progress lines measure the real speed.
TOKENS_PER_SECOND = 7800


def expected_seconds(examples: Sequence[tuple[str, str]], *, steps: int, batch_size: int) -> float:
    """About how long ``supervised_fine_tune`` takes on an idle 2-core CPU with the character-level tiny model (a
    token per character, plus BOS and EOS)."""
    mean_tokens = sum(len(prompt) + len(completion) + 2 for prompt, completion in examples) / max(len(examples), 1)
    return steps * batch_size * mean_tokens / TOKENS_PER_SECOND


def cold_start_key(settings: dict) -> str:
    return hashlib.sha256(json.dumps(settings, sort_keys=True, default=str).encode()).hexdigest()[:12]


def _encode(tokenizer, examples: Sequence[tuple[str, str]]) -> list[tuple[list[int], int]]:
    """Token ids of prompt + completion + EOS, and where the completion starts."""
    encoded = []
    for prompt, completion in examples:
        prompt_ids = tokenizer(prompt).input_ids
        completion_ids = tokenizer(completion, add_special_tokens=False).input_ids + [tokenizer.eos_token_id]
        encoded.append((prompt_ids + completion_ids, len(prompt_ids)))
    return encoded


def _batch(encoded: list[tuple[list[int], int]], pad_id: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    width = max(len(ids) for ids, _ in encoded)
    input_ids = torch.full((len(encoded), width), pad_id, dtype=torch.long)
    attention = torch.zeros_like(input_ids)
    labels = torch.full_like(input_ids, -100)
    for row, (ids, start) in enumerate(encoded):
        input_ids[row, : len(ids)] = torch.tensor(ids)
        attention[row, : len(ids)] = 1
        labels[row, start : len(ids)] = torch.tensor(ids[start:])  # loss on the completion only
    return input_ids, attention, labels


def supervised_fine_tune(
    base_dir: str | Path,
    out_dir: str | Path,
    examples: Sequence[tuple[str, str]],
    *,
    steps: int,
    batch_size: int,
    lr: float,
    seed: int,
    report_every_s: float = PROGRESS_EVERY_S,
) -> Path:
    """Train ``base_dir`` on ``examples`` (prompt, completion) and save the result atomically to ``out_dir``; a
    progress line at least every ``report_every_s`` seconds (0: none)."""
    out_dir = Path(out_dir)
    torch.manual_seed(seed)
    tokenizer = AutoTokenizer.from_pretrained(base_dir)
    model = AutoModelForCausalLM.from_pretrained(base_dir, dtype=torch.float32)
    model.train()
    encoded = _encode(tokenizer, examples)
    optimizer = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.0)
    schedule = torch.optim.lr_scheduler.LambdaLR(
        optimizer, lambda s: min(1.0, (s + 1) / 50) * max(0.1, 1 - s / max(steps, 1))
    )
    generator = torch.Generator().manual_seed(seed)
    started = last_report = time.perf_counter()
    for step in range(steps):
        rows = torch.randint(len(encoded), (batch_size,), generator=generator).tolist()
        input_ids, attention, labels = _batch([encoded[r] for r in rows], tokenizer.pad_token_id)
        loss = model(input_ids=input_ids, attention_mask=attention, labels=labels).loss
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        schedule.step()
        now = time.perf_counter()
        if report_every_s and (now - last_report >= report_every_s or step + 1 == steps):
            last_report, spent = now, now - started
            left = spent / (step + 1) * (steps - step - 1)
            print(
                f"[cold start] step {step + 1}/{steps}, loss {loss.item():.3f}, {minutes(spent)} so far"
                + (f", about {minutes(left)} to go" if left else ""),
                flush=True,
            )
    staging = Path(tempfile.mkdtemp(prefix=out_dir.name + ".", dir=out_dir.parent))
    model.save_pretrained(staging)
    tokenizer.save_pretrained(staging)
    _publish(staging, out_dir)
    return out_dir


def _publish(staging: Path, out_dir: Path) -> None:
    """Move a finished directory into place; if another process won the race, keep theirs."""
    try:
        os.rename(staging, out_dir)
    except OSError:
        shutil.rmtree(staging, ignore_errors=True)
        if not out_dir.is_dir():
            raise
