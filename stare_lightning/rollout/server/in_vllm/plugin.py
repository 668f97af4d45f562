"""vLLM's ``vllm.general_plugins`` entry point: registers the ``stare_lightning`` weight-transfer backend and, in a
CPU server our launcher started, lets the API server fork its engine core (``shared/engine_start.py`` says why).

vLLM calls ``register`` in each of its processes (API server, engine core, workers), possibly more than once, so
it registers only when the name is free. The backend's module is imported only when a worker creates the engine.
"""

from __future__ import annotations

import os

from stare_lightning.rollout.server.shared.engine_start import FORK_ENGINE_CORE_ENV
from stare_lightning.rollout.server.shared.transfer import BACKEND


def register() -> None:
    from vllm.distributed.weight_transfer.factory import WeightTransferEngineFactory

    if BACKEND not in WeightTransferEngineFactory._registry:  # re-registering a name raises
        WeightTransferEngineFactory.register_engine(
            BACKEND, "stare_lightning.rollout.server.in_vllm.transfer_engine", "CheckedWeightTransferEngine"
        )
    if os.environ.get(FORK_ENGINE_CORE_ENV) == "1":
        _fork_the_engine_core()


def _fork_the_engine_core() -> None:
    """The CPU platform picks ``spawn`` for vLLM's processes while it checks the engine's config; the config check is
    wrapped on this process's platform object (vLLM's class is left alone) to pick ``fork`` after it."""
    from vllm.platforms import current_platform

    if not current_platform.is_cpu() or getattr(current_platform, "_forks_the_engine_core", False):
        return
    check_and_update_config = current_platform.check_and_update_config

    def check_then_fork(vllm_config) -> None:
        check_and_update_config(vllm_config)
        os.environ["VLLM_WORKER_MULTIPROC_METHOD"] = "fork"

    current_platform.check_and_update_config = check_then_fork
    current_platform._forks_the_engine_core = True
