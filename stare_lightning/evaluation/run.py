"""``python -m stare_lightning evaluate``: a model over a list of benchmarks, as the paper reports them.

The model is a ``fit`` checkpoint (``ckpt_path=``, exported to ``<output_dir>/model`` first), or the model
group's model (``model=tiny``, ``model=smollm2``, ``model=hf model.name_or_path=<dir or hub id>``). Each
validation file is a benchmark (``data.val_files``; a record's ``metadata.data_source`` names its
benchmark when set, else the file's stem), sampled with the rollout group's validation settings or its
own (``data.val_sets``). Generation runs through the same validation loop as ``fit`` (vLLM where
installed, else HF; sharded over the trainer's ranks, each problem seeded by its id, so the numbers do
not depend on the number of ranks). Writes, in ``output_dir``: ``samples.jsonl`` (every sample),
``results.json`` (``{benchmark: {n, num_problems, avg@n, avg@n_ci95, pass@k, maj@n, ...}, "average": ...}``)
and ``results.md``. Run again on the same directory, it keeps the benchmarks already evaluated with the
same sampling settings and evaluates only the others.
"""

from __future__ import annotations

import json
from dataclasses import asdict
from pathlib import Path

from stare_lightning import collector
from stare_lightning.evaluation.report import all_results, markdown_table
from stare_lightning.evaluation.samples import SampleRecorder
from stare_lightning.run_config import RunConfig

RESULTS, SAMPLES, TABLE = "results.json", "samples.jsonl", "results.md"


def evaluate(cfg: RunConfig) -> dict:
    """Evaluate and write the three files; returns the results."""
    import lightning

    from stare_lightning.data.datamodule import PromptDataModule
    from stare_lightning.train import ignore_expected_warnings

    ignore_expected_warnings()
    lightning.seed_everything(cfg.seed, workers=True, verbose=False)
    out = Path(cfg.output_dir)
    datamodule = PromptDataModule(cfg.data, tokenizer=None)
    datamodule.load_records()  # bad data fails here, before any model is prepared
    names = datamodule.val_benchmarks()
    if not names:
        raise ValueError("evaluate needs validation records: give data.val_files=[...] (each file is a benchmark)")
    sampling = _sampling_as_kept(cfg, names)
    done, kept = _finished(out, sampling)
    todo = [name for name in names if name not in done]
    samples = kept + _run(cfg, datamodule, todo) if todo else kept
    results = all_results(samples, cfg.validation.pass_k, names)
    for name in names:
        results[name]["sampling"] = sampling[name]
    if _is_rank_zero():
        _write(out, samples, results)
    return results


def _sampling_as_kept(cfg: RunConfig, names: list[str]) -> dict[str, dict]:
    """Each benchmark's sampling settings as JSON holds them (tuples become lists), so that they compare equal to
    what results.json kept."""
    from stare_lightning.data.benchmarks import benchmark_sampling

    sampling = benchmark_sampling(cfg.rollout, cfg.data.val_sets, names)
    return json.loads(json.dumps({name: asdict(params) for name, params in sampling.items()}))


def _run(cfg: RunConfig, datamodule, todo: list[str]) -> list[dict]:
    """Generate and score the benchmarks in ``todo``; every rank returns every rank's samples."""
    from stare_lightning.tools import build_tool_from_config
    from stare_lightning.train import build_module

    datamodule.val_records = [r for r in datamodule.val_records if r.metadata["data_source"] in todo]
    tool = build_tool_from_config(cfg.tools)  # a missing or broken sandbox fails before the model
    model_dir = _model_dir(cfg, datamodule, tool)
    module = build_module(cfg, model_dir, datamodule, tool)
    recorder = SampleRecorder(todo)
    trainer = _validation_trainer(cfg, recorder)
    collector.freeze_setup()
    try:
        trainer.validate(module, datamodule=datamodule, verbose=False)
    finally:
        if tool is not None:
            tool.close()
    return recorder.samples


def _validation_trainer(cfg: RunConfig, recorder: SampleRecorder):
    """The trainer group's Trainer, without checkpoints, progress bar or logger, its samples kept by ``recorder``."""
    from stare_lightning.config.instantiate import safe_instantiate

    settings = {**dict(cfg.trainer), "enable_checkpointing": False, "enable_progress_bar": False}
    return safe_instantiate(
        settings,
        callbacks=[recorder],
        logger=False,
        extra_allowed=cfg.allowed_targets,
        where="trainer",
        _convert_="all",
    )


def _model_dir(cfg: RunConfig, datamodule, tool) -> Path:
    """The HF directory to evaluate: the exported checkpoint, or the model group's model."""
    from stare_lightning.train import prepare_model

    if cfg.ckpt_path:
        from stare_lightning.models.export import export_checkpoint

        return export_checkpoint(cfg.ckpt_path, Path(cfg.output_dir) / "model")
    return prepare_model(cfg, datamodule, tool)


def _finished(out: Path, sampling: dict) -> tuple[set[str], list[dict]]:
    """Benchmarks already in ``out`` with the same sampling settings, and their samples."""
    results_file, samples_file = out / RESULTS, out / SAMPLES
    if not (results_file.is_file() and samples_file.is_file()):
        return set(), []
    previous = json.loads(results_file.read_text())
    done = {name for name, params in sampling.items() if previous.get(name, {}).get("sampling") == params}
    with samples_file.open() as handle:
        kept = [record for record in map(json.loads, handle) if record["benchmark"] in done]
    if done:
        print(f"[evaluate] keeping the results of {sorted(done)} from {results_file}")
    return done, kept


def _write(out: Path, samples: list[dict], results: dict) -> None:
    out.mkdir(parents=True, exist_ok=True)
    with (out / SAMPLES).open("w") as handle:
        for record in samples:
            handle.write(json.dumps(record) + "\n")
    (out / RESULTS).write_text(json.dumps(results, indent=2) + "\n")
    table = markdown_table(results)
    (out / TABLE).write_text(table)
    print(table, end="")


def _is_rank_zero() -> bool:
    from stare_lightning.distributed import rank

    return rank() == 0
