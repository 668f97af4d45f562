"""PromptDataModule: config checks, rank sharding, left truncation, chat templates, exact resume."""

from __future__ import annotations

import json
from types import SimpleNamespace

import pytest

from stare_lightning.data import DataConfig, PromptDataModule

CHAT_TEMPLATE = (
    "{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}\n{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>{% endif %}"
)


def char_tokenizer(chat_template=None):
    """A character-level tokenizer that prepends <bos>, like the built-in tiny model's."""
    import string

    from tokenizers import Regex, Tokenizer, models, pre_tokenizers, processors
    from transformers import PreTrainedTokenizerFast

    vocab = {"<pad>": 0, "<bos>": 1, "<eos>": 2, "<unk>": 3}
    for c in string.printable:
        vocab.setdefault(c, len(vocab))
    backend = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    backend.pre_tokenizer = pre_tokenizers.Split(Regex(r"[\s\S]"), behavior="isolated")
    backend.post_processor = processors.TemplateProcessing(single="<bos> $A", special_tokens=[("<bos>", 1)])
    tok = PreTrainedTokenizerFast(
        tokenizer_object=backend, bos_token="<bos>", eos_token="<eos>", pad_token="<pad>", unk_token="<unk>"
    )
    if chat_template:
        tok.chat_template = chat_template
    return tok


@pytest.fixture(scope="module")
def tok():
    return char_tokenizer()


def make_dm(tok, rank=None, world_size=None, **cfg):
    cfg.setdefault("train_size", 100)
    cfg.setdefault("prompts_per_step", 4)
    dm = PromptDataModule(DataConfig(**cfg), tok, rank=rank, world_size=world_size)
    dm.setup("fit")
    return dm


def ids(batch):
    return [item["id"] for item in batch]


# -- config ----------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "kwargs, pattern",
    [
        ({"task": "sudoku"}, r"data\.task='sudoku' is not allowed: choose one of \['arithmetic', 'countdown', null\]"),
        ({"train_files": ["a.jsonl"]}, "set data.task=null"),
        ({"task": None}, "train_files must list"),
        ({"prompt_style": "chat"}, r"data\.prompt_style='chat' is not allowed: choose one of \['plain', 'instruct'\]"),
        ({"prompts_per_step": 0}, r"data\.prompts_per_step=0 is out of range: must be an integer >= 1"),
        ({"train_size": True}, r"data\.train_size=True is not allowed: must be an integer >= 1"),
        ({"task_kwargs": {"num_number": 4}}, r"unknown keys \['num_number'\] for task 'countdown'"),
        ({"task_kwargs": {"num_numbers": 9}}, r"num_numbers must be in 2\.\.5"),
        ({"default_verifier": "nope"}, "data.default_verifier: unknown verifier 'nope'; known verifiers: countdown"),
        ({"user_verifiers": ["os:system"]}, "standard library"),
        (
            {"task": None, "train_files": ["x.jsonl"], "columns": {"question": "q"}},
            r"unknown schema keys \['question'\]",
        ),
        ({"task": None, "train_files": ["x.jsonl", ""]}, r"data\.train_files\[1\]='' is not allowed"),
        ({"val_split": ""}, r"data\.val_split='' is not allowed: must be a non-empty string"),
    ],
)
def test_config_errors(kwargs, pattern):
    with pytest.raises(ValueError, match=pattern):
        DataConfig(**kwargs)


def test_config_as_omegaconf_structured_config():
    from omegaconf import OmegaConf

    base = OmegaConf.structured(DataConfig)
    merged = OmegaConf.merge(base, {"task_kwargs": {"num_numbers": 4}, "prompts_per_step": 8})
    cfg = OmegaConf.to_object(merged)
    assert isinstance(cfg, DataConfig) and cfg.task_kwargs == {"num_numbers": 4} and cfg.global_batch_size(2) == 16


# -- sharding and truncation -----------------------------------------------------------------------


def test_two_ranks_get_disjoint_slices_of_every_global_batch(tok):
    dms = [make_dm(tok, rank=r, world_size=2) for r in range(2)]
    single = make_dm(tok, prompts_per_step=8)  # one rank holding the whole global batch
    streams = [iter(dm.train_dataloader()) for dm in dms]
    whole = iter(single.train_dataloader())
    epoch_ids = []
    for step in range(30):  # 100 records / 8 per global batch = 12 steps per epoch: crosses two epochs
        b0, b1 = next(streams[0]), next(streams[1])
        assert len(b0) == len(b1) == 4
        assert not set(ids(b0)) & set(ids(b1))
        assert ids(b0) + ids(b1) == ids(next(whole))
        if step < 12:
            epoch_ids += ids(b0) + ids(b1)
    assert len(set(epoch_ids)) == 96  # an epoch visits distinct records
    item = b0[0]
    assert set(item) == {"id", "prompt_ids", "prompt_text", "answer", "verifier", "metadata"}
    assert item["verifier"] == "countdown" and item["prompt_ids"][0] == 1  # <bos>
    decoded = tok.decode(item["prompt_ids"], skip_special_tokens=True)
    assert decoded.replace(" ", "") == item["prompt_text"].replace(" ", "")


def test_more_prompts_are_disjoint_across_ranks_and_reproducible(tok):
    dms = [make_dm(tok, rank=r, world_size=3, train_size=30) for r in range(3)]
    draws = [ids(dm.more_prompts(4, step=7, attempt=1)) for dm in dms]
    assert all(len(d) == 4 for d in draws)
    assert len(set().union(*draws)) == 12, "ranks must not share a prompt within an attempt"
    again = make_dm(tok, rank=1, world_size=3, train_size=30)  # a resumed run: no state, same draw
    assert ids(again.more_prompts(4, step=7, attempt=1)) == draws[1]
    assert ids(dms[1].more_prompts(4, step=7, attempt=2)) != draws[1]
    assert ids(dms[1].more_prompts(4, step=8, attempt=1)) != draws[1]
    # Fewer records than count x world: equal, smaller, still disjoint shares.
    small = [
        ids(make_dm(tok, rank=r, world_size=3, train_size=8, prompts_per_step=2).more_prompts(4, step=0, attempt=1))
        for r in range(3)
    ]
    assert [len(d) for d in small] == [2, 2, 2] and len(set().union(*small)) == 6


def test_epochs_are_reshuffled(tok):
    dm = make_dm(tok, train_size=8, prompts_per_step=8)
    stream = iter(dm.train_dataloader())
    first, second = ids(next(stream)), ids(next(stream))
    assert sorted(first) == sorted(second) and first != second


def test_left_truncation_keeps_the_end(tok):
    full = make_dm(tok, max_prompt_length=64)
    with pytest.warns(UserWarning, match="left-truncated"):  # once, when setup checks the first prompt
        short = make_dm(tok, max_prompt_length=5)
    b_short = next(iter(short.train_dataloader()))
    b_full = next(iter(full.train_dataloader()))
    for a, b in zip(b_full, b_short):
        assert len(a["prompt_ids"]) > 5 and b["prompt_ids"] == a["prompt_ids"][-5:]
        assert b["prompt_text"] == a["prompt_text"]  # the text is the rendered prompt, before truncation


def test_val_loader_shards_without_duplicates(tok):
    per_rank = [make_dm(tok, rank=r, world_size=3, val_size=10, val_batch_size=2) for r in range(3)]
    batches = [list(dm.val_dataloader()) for dm in per_rank]
    assert [len(b) for b in batches] == [2, 2, 2]  # ceil(ceil(10 / 3) / 2): same count on every rank
    seen = [i for rank_batches in batches for batch in rank_batches for i in ids(batch)]
    assert len(seen) == len(set(seen)) == 10
    assert sorted(seen) == sorted(r.id for r in per_rank[0].val_records)
    assert all(1 <= len(batch) <= 2 for rank_batches in batches for batch in rank_batches)
    assert len(per_rank[0].val_dataloader()) == 2


def test_chat_template_for_instruct_records():
    tok = char_tokenizer(CHAT_TEMPLATE)
    dm = make_dm(tok, prompt_style="instruct", max_prompt_length=4000)
    item = next(iter(dm.train_dataloader()))[0]
    assert item["prompt_text"].startswith("<|user|>Using the numbers") and item["prompt_text"].endswith("<|assistant|>")
    assert item["prompt_ids"][0] != 1  # the template output is tokenised without adding <bos>
    with pytest.raises(ValueError, match="no chat template"):
        make_dm(char_tokenizer(), prompt_style="instruct")


def test_plain_prompt_from_files_is_wrapped_only_for_instruct(tmp_path):
    path = tmp_path / "p.jsonl"
    path.write_text("\n".join(json.dumps({"id": f"q{i}", "prompt": f"Q{i}?", "answer": str(i)}) for i in range(6)))
    common = dict(task=None, train_files=[str(path)], default_verifier="numeric", val_size=2, prompts_per_step=2)
    chat_tok = char_tokenizer(CHAT_TEMPLATE)
    plain = make_dm(chat_tok, **common)
    assert next(iter(plain.train_dataloader()))[0]["prompt_text"].startswith("Q")
    wrapped = make_dm(chat_tok, prompt_style="instruct", **common)
    assert next(iter(wrapped.train_dataloader()))[0]["prompt_text"].startswith("<|user|>Q")
    # val_size records are held out of the training files, deterministically
    assert len(plain.train_records) == 4 and len(plain.val_records) == 2
    assert {r.id for r in plain.val_records} == {r.id for r in wrapped.val_records}
    assert not {r.id for r in plain.val_records} & {r.id for r in plain.train_records}
    assert make_dm(chat_tok, **{**common, "val_size": 0}).val_dataloader() == []


def test_too_few_records_for_a_global_batch(tok):
    with pytest.raises(ValueError, match="cannot fill one global batch of 32"):
        make_dm(tok, rank=0, world_size=4, train_size=20, prompts_per_step=8)


def test_dataloader_workers_keep_the_order(tok):
    serial = iter(make_dm(tok).train_dataloader())
    parallel = iter(make_dm(tok, num_workers=2).train_dataloader())
    for _ in range(6):
        assert ids(next(serial)) == ids(next(parallel))


# -- resume ----------------------------------------------------------------------------------------


def consume(dm, stream, k):
    """Take k batches the way Lightning does: the loader runs one batch ahead of the counted ones."""
    dm.trainer = SimpleNamespace(training=True, world_size=dm.world_size, global_rank=dm.rank)
    seen = []
    pending = next(stream)
    for _ in range(k):
        batch, pending = pending, next(stream)  # prefetch
        seen.append(ids(dm.on_after_batch_transfer(batch, 0)))
    dm.trainer.training = False  # validation batches are not counted
    dm.on_after_batch_transfer(pending, 0)
    return seen


@pytest.mark.parametrize("k", [3, 14])  # 14 crosses an epoch boundary (12 global batches per epoch)
def test_resume_from_state_dict_continues_exactly(tok, k):
    for rank in range(2):
        straight = make_dm(tok, rank=rank, world_size=2)
        reference = consume(straight, iter(straight.train_dataloader()), k + 5)

        first = make_dm(tok, rank=rank, world_size=2)
        assert consume(first, iter(first.train_dataloader()), k) == reference[:k]
        state = first.state_dict()
        assert state["batches_consumed"] == k

        resumed = make_dm(tok, rank=rank, world_size=2)
        resumed.load_state_dict(state)
        assert consume(resumed, iter(resumed.train_dataloader()), 5) == reference[k:]


def test_resume_through_a_lightning_checkpoint(tok, tmp_path):
    import lightning as L
    import torch

    class Recorder(L.LightningModule):
        def __init__(self):
            super().__init__()
            self.automatic_optimization = False
            self.w = torch.nn.Parameter(torch.zeros(1))
            self.seen = []

        def training_step(self, batch, batch_idx):
            self.seen.append(ids(batch))
            opt = self.optimizers()
            opt.zero_grad()
            self.manual_backward((self.w - 1).pow(2).sum())
            opt.step()

        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=0.1)

    def fit(max_steps, ckpt_path=None):
        trainer = L.Trainer(
            max_steps=max_steps,
            accelerator="cpu",
            devices=1,
            logger=False,
            enable_checkpointing=False,
            enable_progress_bar=False,
            enable_model_summary=False,
            num_sanity_val_steps=0,
            limit_val_batches=0,
        )
        model, dm = Recorder(), PromptDataModule(DataConfig(train_size=40, prompts_per_step=4), tok)
        trainer.fit(model, datamodule=dm, ckpt_path=ckpt_path)
        return trainer, model, dm

    _, straight, _ = fit(7)
    trainer, first, dm = fit(3)
    assert dm.batches_consumed == 3 and first.seen == straight.seen[:3]
    trainer.save_checkpoint(tmp_path / "step3.ckpt")
    _, resumed, dm2 = fit(7, ckpt_path=tmp_path / "step3.ckpt")
    assert resumed.seen == straight.seen[3:]
    assert dm2.batches_consumed == 7
