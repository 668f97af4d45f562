"""Which objects a config may construct: an allow-list of classes by exact name, never a package prefix.

Configs get shared (experiment files, sweep recipes, the config a checkpoint carries), and a ``_target_`` is a
function call. A prefix such as ``lightning.`` admits gadgets that call whatever they are handed
(``lightning.pytorch.cli.instantiate_class`` turns ``init.class_path: os.system`` into a command), and methods
(``...ProcessRunner.run``) reach code their class never meant to expose. So:

- ``PROJECT_TARGETS`` lists every class the shipped configs and their documented alternatives construct;
  ``_target_`` must be one of them, letter for letter (no re-export paths, no methods, no functions);
- a user who wants more names each class or function in ``allowed_targets`` (the explicit opt-in). Each must be
  defined at the top level of the module its name gives (no re-export of another module's object, no method),
  outside the standard library and outside packages known to execute what they are given (``KNOWN_EXECUTORS``);
- Hydra's own node is held to the same rule: its callbacks, launcher and sweeper, the logging configs it passes
  to ``logging.config.dictConfig`` (whose ``()`` and ``class`` keys call arbitrary factories), and environment
  variables that make a child process load code.

Nothing here imports torch, Lightning or Hydra: a config is checked as text first, and only the user's own
opt-ins are imported (to check where they are defined).
"""

from __future__ import annotations

import importlib
import inspect
import sys
from collections.abc import Iterable, Iterator, Mapping, Sequence
from typing import Any

__all__ = [
    "DisallowedTargetError",
    "PROJECT_TARGETS",
    "check_hydra_node",
    "check_opt_ins",
    "check_target_name",
    "check_targets",
    "iter_targets",
]

_TORCH_OPTIMIZERS = (
    "Adadelta Adafactor Adagrad Adam Adamax AdamW ASGD LBFGS Muon NAdam RAdam RMSprop Rprop SGD SparseAdam".split()
)
_LIGHTNING_CALLBACKS = (
    "EarlyStopping ModelCheckpoint LearningRateMonitor RichProgressBar TQDMProgressBar RichModelSummary "
    "ModelSummary DeviceStatsMonitor Timer".split()
)
_LIGHTNING_LOGGERS = "TensorBoardLogger CSVLogger WandbLogger MLFlowLogger CometLogger NeptuneLogger".split()

PROJECT_TARGETS: frozenset[str] = frozenset(
    [
        "lightning.Trainer",
        "lightning.pytorch.Trainer",
        "lightning.pytorch.strategies.DDPStrategy",
        "lightning.pytorch.strategies.SingleDeviceStrategy",
        "lightning.pytorch.strategies.ModelParallelStrategy",
        "stare_lightning.trainer.FSDP2Strategy",
        "stare_lightning.trainer.SafeCheckpointIO",
        "stare_lightning.trainer.ResumableCSVLogger",
        "stare_lightning.callbacks.EntropyGuard",
        "stare_lightning.callbacks.FinalStateCheckpoint",
        "stare_lightning.callbacks.RolloutSampleDump",
        "stare_lightning.callbacks.RunSummary",
        "stare_lightning.callbacks.StepProgressBar",
        *(f"torch.optim.{name}" for name in _TORCH_OPTIMIZERS),
        *(f"lightning.pytorch.callbacks.{name}" for name in _LIGHTNING_CALLBACKS),
        *(f"lightning.pytorch.loggers.{name}" for name in _LIGHTNING_LOGGERS),
    ]
)

# Hydra's launchers and sweepers (its own and the published plugins) and what the Optuna sweeper constructs.
HYDRA_TARGETS: frozenset[str] = frozenset(
    [
        "hydra._internal.core_plugins.basic_launcher.BasicLauncher",
        "hydra._internal.core_plugins.basic_sweeper.BasicSweeper",
        "hydra_plugins.hydra_submitit_launcher.submitit_launcher.LocalLauncher",
        "hydra_plugins.hydra_submitit_launcher.submitit_launcher.SlurmLauncher",
        "hydra_plugins.hydra_joblib_launcher.joblib_launcher.JoblibLauncher",
        "hydra_plugins.hydra_optuna_sweeper.optuna_sweeper.OptunaSweeper",
        *(f"optuna.samplers.{name}" for name in "TPESampler RandomSampler GridSampler CmaEsSampler".split()),
    ]
)

# Packages whose callables evaluate, import, load or run what they are given: never a target, even by opt-in.
KNOWN_EXECUTORS: tuple[str, ...] = (
    "stare_lightning",  # its targets are PROJECT_TARGETS; the rest (process runners, the registries) is not
    "hydra",
    "omegaconf",
    "jsonargparse",
    "lightning.pytorch.cli",
    "lightning.fabric.cli",
    "torch.hub",
    "torch.package",
    "torch.jit",
    "torch.serialization",
    "torch.utils.cpp_extension",
    "torch.distributed",
    "transformers.dynamic_module_utils",
    "sympy",
    "numpy.lib.npyio",
    "pandas.io.pickle",
    "joblib",
    "dill",
    "cloudpickle",
    "setuptools",
    "pkg_resources",
    "pip",
    "IPython",
)

# dictConfig classes and factories a logging config may name (Hydra's defaults and the usual handlers).
LOGGING_CLASSES: frozenset[str] = frozenset(
    [
        "logging.StreamHandler",
        "logging.FileHandler",
        "logging.NullHandler",
        "logging.Formatter",
        "logging.handlers.RotatingFileHandler",
        "logging.handlers.TimedRotatingFileHandler",
        "logging.handlers.WatchedFileHandler",
        "rich.logging.RichHandler",
        "colorlog.ColoredFormatter",
    ]
)
_LOGGING_STREAMS = frozenset({"ext://sys.stdout", "ext://sys.stderr"})

# Environment variables that make a process (a DDP child, a launcher's job) load or run code.
_CODE_LOADING_ENV = frozenset(
    "PYTHONPATH PYTHONSTARTUP PYTHONHOME PYTHONUSERBASE PYTHONEXECUTABLE PYTHONBREAKPOINT PYTHONWARNINGS "
    "PYTHONINSPECT BASH_ENV ENV PERL5OPT NODE_OPTIONS".split()
)


class DisallowedTargetError(ValueError):
    pass


def iter_targets(node: Any, path: str = "") -> Iterator[tuple[str, Any]]:
    """(config key, value) of every ``_target_`` in a nested mapping/sequence config."""
    if isinstance(node, Mapping) or _is_dict_config(node):
        for key, value in node.items():
            child = f"{path}.{key}" if path else str(key)
            if key == "_target_":
                yield path or "<root>", value
            else:
                yield from iter_targets(value, child)
    elif (isinstance(node, Sequence) or _is_list_config(node)) and not isinstance(node, (str, bytes)):
        for index, value in enumerate(node):
            yield from iter_targets(value, f"{path}[{index}]")


def _is_dict_config(node: Any) -> bool:
    return type(node).__name__ == "DictConfig"


def _is_list_config(node: Any) -> bool:
    return type(node).__name__ == "ListConfig"


def _inside(name: str, packages: Iterable[str]) -> str | None:
    return next((p for p in packages if name == p or name.startswith(p + ".")), None)


def _importable_prefix(dotted: str) -> str | None:
    parts = dotted.split(".")
    for depth in range(len(parts) - 1, 0, -1):
        try:
            importlib.import_module(".".join(parts[:depth]))
            return ".".join(parts[:depth])
        except Exception:  # noqa: BLE001 - not a module: try a shorter prefix
            continue
    return None


def opt_in_refusal(name: str) -> str | None:
    """Why ``name`` may not be trusted by the user's ``allowed_targets``, or None when it may."""
    if not isinstance(name, str) or not name or any(not part.isidentifier() for part in name.split(".")):
        return "it is not a dotted name (package.module.Name)"
    if any(part.startswith("_") for part in name.split(".")):
        return "private names cannot be targets"
    top = name.split(".", 1)[0]
    if top in sys.stdlib_module_names or top in sys.builtin_module_names:
        return (
            f"it is in the standard library ({top}), many of whose callables run commands or import code; "
            "wrap what you need in a function or class of your own module"
        )
    executor = _inside(name, KNOWN_EXECUTORS)
    if executor is not None:
        return f"{executor} evaluates, imports or runs what it is given"
    module_name, _, attr = name.rpartition(".")
    try:
        module = importlib.import_module(module_name)
    except ModuleNotFoundError:
        parent = _importable_prefix(module_name)
        if parent is None:
            return f"no module of {name!r} can be imported"
        return (
            f"{module_name!r} is an attribute of module {parent!r}, so {attr!r} is a method or nested name: only "
            "classes and functions defined at a module's top level can be targets"
        )
    except Exception as exc:  # noqa: BLE001 - whatever importing the user's module raises
        return f"its module {module_name!r} cannot be imported ({type(exc).__name__}: {exc})"
    obj = getattr(module, attr, None)
    if obj is None:
        return f"{module_name!r} has no attribute {attr!r}"
    if not (inspect.isclass(obj) or inspect.isfunction(obj)):
        return f"it is a {type(obj).__name__}, not a class or function"
    home = f"{getattr(obj, '__module__', None)}.{getattr(obj, '__qualname__', None)}"
    if home != name:
        return f"it is {home}, re-exported: name it where it is defined (and check that it is what you want)"
    return None


def check_opt_ins(allowed: Sequence[str], where: str = "allowed_targets") -> None:
    """Refuse any ``allowed_targets`` entry that names something no config should be able to call."""
    for index, name in enumerate(allowed):
        reason = opt_in_refusal(name)
        if reason is not None:
            raise DisallowedTargetError(f"{where}[{index}]={name!r} cannot be trusted: {reason}")


def check_target_name(target: Any, key: str, allowed: Iterable[str] = (), *, builtin=PROJECT_TARGETS) -> None:
    """Raise unless ``target`` is, letter for letter, an allowed name (``allowed``: the user's checked opt-ins);
    ``key`` is the config key that holds it, for the message."""
    if isinstance(target, str) and (target in builtin or target in allowed):
        return
    what = repr(target) if isinstance(target, str) else f"a {type(target).__name__}"
    close = sorted(t for t in builtin if t.rsplit(".", 1)[-1] == str(target).rsplit(".", 1)[-1])
    hint = f" (did you mean {close[0]}?)" if close else ""
    raise DisallowedTargetError(
        f"{key}={what} is not allowed{hint}: a config may construct only the classes the project "
        "lists (stare_lightning/config/targets.py) and those named in `allowed_targets` (classes or functions "
        "defined in your own modules)"
    )


def check_targets(node: Any, allowed: Sequence[str] = (), *, where: str = "", builtin=PROJECT_TARGETS) -> None:
    """Check every ``_target_`` under ``node`` (the key named as ``where.<path>``)."""
    for key, target in iter_targets(node, where):
        check_target_name(target, f"{key}._target_", allowed, builtin=builtin)


def _check_logging(node: Any, where: str) -> None:
    """A ``logging.config.dictConfig`` mapping may name only known handler and formatter classes."""
    if isinstance(node, Mapping) or _is_dict_config(node):
        for key, value in node.items():
            path = f"{where}.{key}"
            if key in ("()", "class") and value not in LOGGING_CLASSES:
                raise DisallowedTargetError(
                    f"{path}={value!r} is not allowed: logging configs may name {sorted(LOGGING_CLASSES)}"
                )
            if isinstance(value, str) and value.startswith("ext://") and value not in _LOGGING_STREAMS:
                raise DisallowedTargetError(
                    f"{path}={value!r} is not allowed: ext:// imports by name; use {sorted(_LOGGING_STREAMS)}"
                )
            _check_logging(value, path)
    elif (isinstance(node, Sequence) or _is_list_config(node)) and not isinstance(node, (str, bytes)):
        for index, value in enumerate(node):
            _check_logging(value, f"{where}[{index}]")


def check_hydra_node(hydra: Any, allowed: Sequence[str] = ()) -> None:
    """Hydra's own config (``hydra.*``), which Hydra acts on before any of the project's code runs."""
    if not hydra:
        return
    for group in ("launcher", "sweeper"):
        check_targets(hydra.get(group), allowed, where=f"hydra.{group}", builtin=HYDRA_TARGETS)
    check_targets(hydra.get("callbacks"), allowed, where="hydra.callbacks", builtin=frozenset())
    for group in ("job_logging", "hydra_logging"):
        _check_logging(hydra.get(group), f"hydra.{group}")
    env = (hydra.get("job") or {}).get("env_set") or {}
    for name in env:
        if name in _CODE_LOADING_ENV or str(name).startswith("LD_"):
            raise DisallowedTargetError(
                f"hydra.job.env_set.{name} is not allowed: it makes the job's processes load code from where it "
                "points; set it in the environment you launch from instead"
            )
