"""vLLM's ``vllm.general_plugins`` entry point: registers the ``stare_lightning`` weight-transfer backend.

vLLM calls ``register`` in each of its processes (API server, engine core, workers), possibly more than once, so
it registers only when the name is free. The backend's module is imported only when a worker creates the engine.
"""

from __future__ import annotations

from stare_lightning.rollout.server.shared.transfer import BACKEND


def register() -> None:
    from vllm.distributed.weight_transfer.factory import WeightTransferEngineFactory

    if BACKEND not in WeightTransferEngineFactory._registry:  # re-registering a name raises
        WeightTransferEngineFactory.register_engine(
            BACKEND, "stare_lightning.rollout.server.in_vllm.transfer_engine", "CheckedWeightTransferEngine"
        )
