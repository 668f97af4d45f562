"""STARE in a hand-written GRPO loop: ``python stare_loop.py MODEL CHECKPOINT`` (MODEL: a causal LM's name or
directory; CHECKPOINT: where the last step's model, optimizer and STARE state are saved).

Each step samples a group of completions per prompt, scores them (a toy reward: how many digits a completion holds),
turns the rewards into group advantages, asks STARE for this step's token weights and trains on the weighted
policy-gradient loss. One optimizer step per batch, on-policy: the PPO ratio is 1, so the clipped surrogate's
gradient is the one below.
"""

import sys

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from stare_lightning.integrations.pytorch import STARE, STARESettings

GROUP, NEW_TOKENS, TEMPERATURE = 4, 16, 1.0
tokenizer = AutoTokenizer.from_pretrained(sys.argv[1])
model = AutoModelForCausalLM.from_pretrained(sys.argv[1], dtype=torch.float32)
optimizer = torch.optim.AdamW(model.parameters(), lr=1e-5)
stare = STARE(STARESettings(variant="C2", target_entropy=0.3), group_size=GROUP)

for step, prompt in enumerate(["Count to 5:", "Count to 9:"]):
    prompt_ids = tokenizer(prompt, return_tensors="pt").input_ids.repeat(GROUP, 1)
    with torch.no_grad():
        ids = model.generate(prompt_ids, do_sample=True, temperature=TEMPERATURE, max_new_tokens=NEW_TOKENS,
                             min_new_tokens=NEW_TOKENS, pad_token_id=tokenizer.pad_token_id)  # fmt: skip
    tokens = ids[:, prompt_ids.shape[1] :]
    mask = torch.ones_like(tokens, dtype=torch.bool)
    texts = tokenizer.batch_decode(tokens, skip_special_tokens=True)
    rewards = torch.tensor([float(sum(ch.isdigit() for ch in text)) for text in texts])
    advantages = (rewards - rewards.mean()) / (rewards.std() + 1e-6)

    logits = model(ids).logits[:, prompt_ids.shape[1] - 1 : -1] / TEMPERATURE
    logprobs = torch.log_softmax(logits.float(), -1).gather(-1, tokens[..., None])[..., 0]
    result = stare.step(advantages, mask, logits=logits.detach(), tokens=tokens)  # once per step, before the loss
    loss = -(result.weights * advantages[:, None] * logprobs)[mask].mean()
    optimizer.zero_grad()
    loss.backward()
    optimizer.step()
    print(step, {k: round(v, 4) for k, v in result.metrics.items() if k.startswith("stare/")})

# STARE's state (gate, W, M, last entropy) belongs in the checkpoint: stare.load_state_dict(...) on resume.
torch.save({"model": model.state_dict(), "optimizer": optimizer.state_dict(), "stare": stare.state_dict()}, sys.argv[2])
