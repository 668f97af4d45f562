"""STARE-O1 in TRL's GRPO loop: ``python stare_trl.py MODEL OUTPUT_DIR`` (MODEL: a causal LM's name or directory).

The task is a toy (reward: how many digits a completion holds); the trainer is TRL's, with STARE's gate, weights and
telemetry added.
"""

import sys

from datasets import Dataset
from trl import GRPOConfig

from stare_lightning.integrations.trl import STAREGRPOTrainer, STARESettings


def digits(completions, **kwargs):
    return [float(sum(ch.isdigit() for ch in text)) for text in completions]


model, output_dir = sys.argv[1], sys.argv[2]
config = GRPOConfig(
    output_dir=output_dir,
    max_steps=2,
    per_device_train_batch_size=4,
    num_generations=4,
    max_completion_length=16,
    learning_rate=1e-5,
    bf16=False,  # TRL's default is bf16 autocast; say so explicitly where it matters
    use_cpu=True,
    logging_steps=1,
    report_to="none",
)
prompts = Dataset.from_list([{"prompt": f"Count to {n}:"} for n in range(8)])
trainer = STAREGRPOTrainer(
    model=model,
    reward_funcs=digits,
    args=config,
    train_dataset=prompts,
    # The untrained tiny model's entropy is about 4.6 nats; a target above it opens the gate from the first step.
    stare=STARESettings(variant="O1", target_entropy=5.0),
)
trainer.train()
print({k: v for k, v in trainer.state.log_history[-2].items() if k.startswith(("stare/", "entropy"))})
