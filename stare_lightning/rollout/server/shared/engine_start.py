"""The launcher's switch for how a CPU server starts its engine core, read by the plugin inside the server.

vLLM's CPU platform starts the engine-core process by ``spawn``: a fresh interpreter that imports vLLM again, about
10 s of CPU and of wall time at every server start. A CPU server of ours runs one worker, inside the engine core, and
its API server has run no tensor operation when it starts that process, so a fork is safe there and costs almost
nothing. The launcher sets this variable for CPU servers only (GPU servers start as vLLM decides: CUDA cannot be
forked once initialized); ``in_vllm/plugin.py`` then lets the engine core fork.
"""

FORK_ENGINE_CORE_ENV = "STARE_LIGHTNING_FORK_ENGINE_CORE"
