"""Every config group composes, validates and instantiates; bad values fail early with the key's name."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
from omegaconf import OmegaConf

from stare_lightning.cli import compose, config_dir, prepare_config
from stare_lightning.config.instantiate import DisallowedTargetError, instantiate_collection, safe_instantiate

CONF = Path(config_dir())
GROUPS = ["model", "data", "algorithm", "rollout", "tools", "trainer", "callbacks", "logger", "experiment", "debug"]


def compose_run(tmp_path, overrides=()):
    return prepare_config(compose([f"output_dir={tmp_path}", *overrides]))


def group_options():
    for group in GROUPS:
        for path in sorted((CONF / group).glob("*.yaml")):
            yield group, path.stem


@pytest.mark.parametrize("group,option", list(group_options()))
def test_every_group_option_composes_and_validates(tmp_path, group, option):
    overrides = [f"{group}={option}"]
    if group == "logger":
        overrides = [f"logger=[{option}]"]
    if (group, option) == ("model", "hf"):
        overrides.append("model.name_or_path=/some/local/dir")
    if (group, option) == ("data", "files") or (group == "experiment" and option.startswith("paper_")):
        overrides.append("data.train_files=[/some/train.jsonl]")
    cfg, run = compose_run(tmp_path, overrides)
    assert run.output_dir == str(tmp_path.resolve())
    assert OmegaConf.select(cfg, group) is not None or group in ("experiment", "debug")


@pytest.mark.parametrize("option", sorted(p.stem for p in (CONF / "algorithm").glob("*.yaml")))
def test_algorithm_names_match_files(tmp_path, option):
    _, run = compose_run(tmp_path, [f"algorithm={option}"])
    assert run.algorithm.name == option
    assert run.algorithm.stare.enabled == option.startswith("stare_")


@pytest.mark.parametrize("option", sorted(p.stem for p in (CONF / "trainer").glob("*.yaml")))
def test_trainer_instantiates(tmp_path, option):
    # fp16 is refused on CPUs (tests/test_trainer_loss_scale.py); the rest of fsdp_fp16 is instantiated here.
    gpu_only = ["trainer.strategy.param_dtype=bfloat16"] if option == "fsdp_fp16" else []
    _, run = compose_run(
        tmp_path,
        [
            f"trainer={option}",
            "trainer.accelerator=cpu",
            "trainer.devices=1",
            "trainer.precision=32-true",
            "logger=[csv]",
            *gpu_only,
        ],
    )
    trainer_cfg = dict(run.trainer)
    if option.startswith(
        "fsdp"
    ):  # ModelParallelStrategy needs torch.distributed set up at construction: check the target only
        trainer_cfg.pop("strategy")
    if option == "ddp":
        trainer_cfg["devices"] = 1
    trainer = safe_instantiate(trainer_cfg, logger=False, enable_checkpointing=False)
    assert trainer.max_steps == run.trainer["max_steps"]


@pytest.mark.parametrize("callbacks", sorted(p.stem for p in (CONF / "callbacks").glob("*.yaml")))
def test_callbacks_and_loggers_instantiate(tmp_path, callbacks):
    _, run = compose_run(tmp_path, [f"callbacks={callbacks}", "logger=[csv,tensorboard]"])
    made = instantiate_collection(run.callbacks, where="callbacks")
    assert len(made) == len([v for v in run.callbacks.values() if v is not None])
    loggers = instantiate_collection(run.logger, where="logger")
    assert {type(lg).__name__ for lg in loggers} == {"ResumableCSVLogger", "TensorBoardLogger"}


def test_default_is_the_offline_stare_run(tmp_path):
    _, run = compose_run(tmp_path)
    assert run.model.name_or_path == "tiny" and run.model.cold_start is not None
    assert run.data.task == "countdown"
    assert run.algorithm.stare.enabled and run.algorithm.stare.variant == "O1"
    assert run.trainer["accelerator"] == "cpu"


@pytest.mark.parametrize(
    "recipe, model",
    [("paper_1p5b_long_cot", "deepseek-ai/DeepSeek-R1-Distill-Qwen-1.5B"), ("paper_8b_long_cot", "Qwen/Qwen3-8B-Base")],
)
def test_long_cot_recipes_keep_the_paper_setting_and_switch_the_memory_levers_on(tmp_path, recipe, model):
    _, short = compose_run(tmp_path, ["experiment=paper_7b_short_cot", "data.train_files=[/x.parquet]"])
    _, run = compose_run(tmp_path, [f"experiment={recipe}", "data.train_files=[/x.parquet]"])
    assert run.model.name_or_path == model and run.algorithm == short.algorithm and run.optim.lr == short.optim.lr
    assert run.rollout.max_new_tokens == 16384 and run.rollout.enable_sleep_mode and run.model.gradient_checkpointing
    assert run.forward.micro_batch_tokens >= run.rollout.max_new_tokens  # a whole response fits one micro-batch
    assert run.forward.packed_sequences and run.forward.fused_lm_head and not run.telemetry.same_batch_entropy


def test_tool_recipe_inherits_the_paper_setting_and_adds_the_interpreter(tmp_path):
    _, short = compose_run(tmp_path, ["experiment=paper_7b_short_cot", "data.train_files=[/x.parquet]"])
    _, run = compose_run(tmp_path, ["experiment=paper_7b_tir", "data.train_files=[/x.parquet]"])
    assert run.tools.name == "python" and run.tools.format == "code_block" and run.tools.isolation == "bubblewrap"
    assert run.algorithm == short.algorithm and run.optim.lr == short.optim.lr and run.rollout.n == short.rollout.n
    assert run.rollout.max_turns >= 1 and run.forward.micro_batch_tokens >= run.rollout.max_new_tokens
    service = ["tools.isolation=sandbox_fusion", "tools.sandbox_fusion_url=http://sandbox:8080"]
    _, fusion = compose_run(tmp_path, ["experiment=paper_7b_tir", "data.train_files=[/x.parquet]", *service])
    assert fusion.tools.tool_options()["sandbox_fusion_url"] == "http://sandbox:8080"


@pytest.mark.parametrize(
    "overrides, message",
    [
        (["rollout.max_turns=3"], "rollout.max_turns=3 does nothing with tools=none"),
        (["model.cold_start.tool_traces=true"], "model.cold_start.tool_traces=true needs a tool"),
        (["tools=calculator", "rollout.max_turns=0"], "rollout.max_turns=0 is out of range"),
    ],
)
def test_tool_settings_without_a_tool_are_refused(tmp_path, overrides, message):
    with pytest.raises(ValueError, match=message.replace(".", r"\.")):
        compose_run(tmp_path, overrides)


def test_paper_recipe_matches_the_method_doc(tmp_path):
    _, run = compose_run(tmp_path, ["experiment=paper_7b_short_cot", "data.train_files=[/x.parquet]"])
    alg = run.algorithm
    loss = alg.policy_loss
    assert (loss.clip_eps_low, loss.clip_eps_high, loss.dual_clip_c) == (0.2, 0.28, 10.0)
    assert alg.update.loss_agg == "token-mean" and alg.kl.coef == 0 and alg.entropy_bonus.coef == 0
    assert alg.collection.dynamic_sampling and alg.collection.max_generation_batches == 10
    assert (alg.stare.top_ratio, alg.stare.w, alg.stare.m, alg.stare.target_entropy) == (0.1, 1.1, 0.9, 0.3)
    assert run.optim.lr == 1e-6 and run.data.prompts_per_step == 64 and run.rollout.n == 8
    assert run.data.max_prompt_length == 1024 and run.rollout.max_new_tokens == 3072
    assert run.rollout.val_n == 32 and run.rollout.val_top_p == 0.7 and run.trainer["val_check_interval"] == 10


@pytest.mark.parametrize(
    "override,needle",
    [
        ("algorithm.stare.variant=O3", "variant"),
        ("algorithm.stare.top_ratio=1.5", "top_ratio"),
        ("algorithm.update.loss_agg=sum", "loss_agg"),
        ("rollout.backend=sglang", "rollout.backend"),
        ("rollout.top_p=0", "rollout.top_p"),
        ("optim.schedule=linear", "optim.schedule"),
        ("model.dtype=int8", "model.dtype"),
        ("algorithm.stare.w=-1", "w"),
        ("rollout.n=abc", "rollout.n"),
        ("rollout.n=1", "rollout.n=1"),
        ("rollout.top_k=-1", "rollout.top_k=-1"),
        ("algorithm.mismatch.correction=geometric", "algorithm.mismatch.correction='geometric'"),
        ("algorithm.mismatch.cap=0", "algorithm.mismatch.cap=0.0"),
        ("optim.min_lr_ratio=2", "optim.min_lr_ratio=2.0"),
        ("model.cold_start.batch_size=0", "model.cold_start.batch_size=0"),
        ("validation.pass_k=[0]", "validation.pass_k[0]=0"),
        ("rollout.enable_sleep_mode=true", "rollout.enable_sleep_mode=true does nothing here"),  # trainer=cpu
        ("algorithm.stare.gate_aggregation=median", "algorithm.stare.gate_aggregation='median'"),
    ],
)
def test_bad_values_name_the_key(tmp_path, override, needle):
    with pytest.raises(Exception) as info:
        compose_run(tmp_path, [override])
    assert needle in str(info.value)


@pytest.mark.parametrize(
    "overrides, message",
    [
        (["forward.fused_lm_head=true"], "telemetry.same_batch_entropy=true compares the full logits"),
        (["forward.packed_sequences=maybe"], "forward.packed_sequences"),
    ],
)
def test_forward_layouts_are_refused_where_they_cannot_apply(tmp_path, overrides, message):
    with pytest.raises(Exception, match=message):
        compose_run(tmp_path, overrides)
    layout = compose_run(tmp_path, ["forward.fused_lm_head=true", "telemetry.same_batch_entropy=false",
                                    "forward.packed_sequences=true"])[1].forward.layout()  # fmt: skip
    assert layout.packed and layout.fused_head
    sharded = ["forward.fused_lm_head=true", "telemetry.same_batch_entropy=false", "trainer=fsdp"]
    assert compose_run(tmp_path, sharded)[1].forward.layout().fused_head  # FSDP2: tests/test_fsdp.py


def test_unknown_key_is_rejected(tmp_path):
    with pytest.raises(Exception) as info:
        compose_run(tmp_path, ["+algorithm.stare.wieght=2.0"])
    assert "wieght" in str(info.value)
    with pytest.raises(Exception) as info:  # moved to algorithm.mismatch.correction
        compose_run(tmp_path, ["+rollout.mismatch_correction=token"])
    assert "mismatch_correction" in str(info.value)


def test_mismatch_correction_is_an_algorithm_setting(tmp_path):
    _, run = compose_run(
        tmp_path,
        ["algorithm.mismatch.correction=sequence", "algorithm.mismatch.mode=mask", "algorithm.mismatch.cap=3.0"],
    )
    alg = run.algorithm
    assert (alg.mismatch.correction, alg.mismatch.mode, alg.mismatch.cap) == ("sequence", "mask", 3.0)
    assert alg.mismatch.enabled


def test_one_table_of_subcommands():
    from stare_lightning import cli

    text = cli.usage()
    for name, (target, help_line) in cli.SUBCOMMANDS.items():
        assert f"  {name}" in text and help_line in text
        assert target.startswith("stare_lightning.") and ":" in target
    with pytest.raises(ValueError, match="unknown subcommand 'train'"):
        cli.run("train", OmegaConf.create({}))


def test_allow_list_refuses_arbitrary_targets(tmp_path, monkeypatch):
    with pytest.raises(DisallowedTargetError, match="os.system"):
        safe_instantiate({"_target_": "os.system", "command": "true"})
    with pytest.raises(DisallowedTargetError, match=r"callbacks.evil"):
        instantiate_collection({"evil": {"_target_": "subprocess.call", "args": ["true"]}}, where="callbacks")
    # A nested target is checked too, and a user can trust a class of their own explicitly, by name.
    (tmp_path / "own_targets.py").write_text(
        "class Box:\n    def __init__(self, inner=None):\n        self.inner = inner\n"
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    nested = {"_target_": "own_targets.Box", "inner": {"_target_": "lightning.pytorch.callbacks.Timer"}}
    with pytest.raises(DisallowedTargetError, match=r"<root>._target_='own_targets.Box' is not allowed"):
        safe_instantiate(nested)
    box = safe_instantiate(nested, extra_allowed=["own_targets.Box"])
    assert type(box).__name__ == "Box" and type(box.inner).__name__ == "Timer"
    nested["inner"]["_target_"] = "lightning.pytorch.cli.instantiate_class"
    with pytest.raises(DisallowedTargetError, match=r"inner._target_='lightning.pytorch.cli.instantiate_class'"):
        safe_instantiate(nested, extra_allowed=["own_targets.Box"])


@pytest.mark.parametrize(
    "target",
    [
        "lightning.pytorch.cli.instantiate_class",  # calls whatever class_path names
        "stare_lightning.tools.sandbox_process.ProcessRunner.run",  # a method, called with its own self
        "hydra.utils.instantiate",
        "stare_lightning.config.instantiate.importlib.import_module",  # a path through a module attribute
        "stare_lightning.rewards.pool.os.system",
        "lightning.pytorch.trainer.trainer.os.system",
        "lightning.pytorch.callbacks.early_stopping.EarlyStopping",  # an allowed class, by another path
        "lightning.pytorch.callbacks.EarlyStopping.__init__.__globals__",
        "stare_lightning.config.instantiate.__builtins__",
    ],
)
def test_only_listed_names_are_targets(target):
    """Each of these starts with a package prefix the project once allowed; none is on the list."""
    with pytest.raises(DisallowedTargetError, match=re.escape(f"_target_={target!r} is not allowed")):
        safe_instantiate({"_target_": target})


@pytest.mark.parametrize(
    "name, reason",
    [
        ("os.system", "standard library (os)"),
        ("builtins.eval", "standard library (builtins)"),
        ("lightning.pytorch.cli.instantiate_class", "lightning.pytorch.cli evaluates, imports or runs"),
        ("hydra.utils.instantiate", "hydra evaluates"),
        ("stare_lightning.tools.sandbox_process.ProcessRunner", "stare_lightning evaluates"),
        ("sympy.sympify", "sympy evaluates"),
        ("torch.hub.load", "torch.hub evaluates"),
        ("lightning.pytorch.callbacks.EarlyStopping", "is lightning.pytorch.callbacks.early_stopping.EarlyStopping"),
        ("transformers.AutoModelForCausalLM.from_pretrained", "is a method or nested name"),
        ("own_optins._private", "private names"),
        ("own_optins.os", "a module, not a class or function"),
        ("own_optins.CONSTANT", "a int, not a class or function"),
    ],
)
def test_an_opt_in_must_name_something_defined_in_the_users_own_module(name, reason, tmp_path, monkeypatch):
    from stare_lightning.config.targets import check_opt_ins

    (tmp_path / "own_optins.py").write_text("import os\nCONSTANT = 3\n\ndef _private():\n    pass\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    with pytest.raises(DisallowedTargetError, match=re.escape(reason)):
        check_opt_ins([name])


def test_every_shipped_target_is_listed_and_every_listed_target_is_a_class():
    import inspect

    from hydra.utils import get_class

    from stare_lightning.config.targets import PROJECT_TARGETS

    shipped = {
        line.split("_target_:", 1)[1].split("#", 1)[0].strip()
        for path in Path(config_dir()).rglob("*.yaml")
        for line in path.read_text().splitlines()
        if "_target_:" in line and not line.lstrip().startswith("#")
    }
    assert len(shipped) > 10 and shipped <= PROJECT_TARGETS, shipped - PROJECT_TARGETS
    for target in PROJECT_TARGETS:
        module = target.rsplit(".", 1)[0]
        if module.startswith(("lightning.pytorch.loggers", "torch.optim")) and target.endswith(("Muon", "Adafactor")):
            continue  # newer torch releases only
        try:
            assert inspect.isclass(get_class(target)), target
        except ImportError:  # an optional logger's package (wandb, comet, neptune) is not installed
            continue


@pytest.mark.parametrize(
    "call, message",
    [
        (lambda c: c.choice("a.b", "x", ("y", None)), r"^a\.b='x' is not allowed: choose one of \['y', null\]$"),
        (lambda c: c.flag("a.b", 1), r"^a\.b=1 is not allowed: must be true or false$"),
        (lambda c: c.text("a.b", ""), r"^a\.b='' is not allowed: must be a non-empty string$"),
        (
            lambda c: c.number("a.b", 1.5, low=0.0, high=1.0),
            r"^a\.b=1\.5 is out of range: must be a number in \[0\.0, 1\.0\]$",
        ),
        (
            lambda c: c.number("a.b", 1.0, high=1.0, high_open=True),
            r"^a\.b=1\.0 is out of range: must be a number < 1\.0$",
        ),
        (
            lambda c: c.number("a.b", 0, low=0, low_open=True, integer=True),
            r"^a\.b=0 is out of range: must be an integer > 0$",
        ),
        (lambda c: c.number("a.b", 2.0, low=1, integer=True), r"^a\.b=2\.0 is not allowed: must be an integer >= 1$"),
        (lambda c: c.number("a.b", True, low=0), r"^a\.b=True is not allowed"),
        (lambda c: c.number("a.b", "1"), r"^a\.b='1' is not allowed: must be a finite number$"),
        (lambda c: c.number("a.b", float("nan"), allow_inf=True), r"^a\.b=nan is not allowed"),
        (lambda c: c.number("a.b", float("inf"), low=0.0), r"^a\.b=inf is not allowed: must be a number >= 0\.0$"),
    ],
)
def test_checks_name_the_key_the_value_and_what_is_allowed(call, message):
    from stare_lightning.config import checks

    with pytest.raises(ValueError, match=message):
        call(checks)


def test_checks_accept_good_values():
    from stare_lightning.config import checks

    checks.choice("a", None, ("x", None))
    checks.flag("a", False)
    checks.number("a", float("inf"), low=0.0, allow_inf=True)
    checks.number("a", 1, low=1, integer=True)
    checks.number("a", 1, low=0.0, high=1.0)  # an int where a float belongs is fine
