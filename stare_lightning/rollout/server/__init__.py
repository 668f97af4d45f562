"""Rollouts on separate vLLM server processes (``rollout=server``): the stock OpenAI-compatible server generates,
and the trainer pushes its weights after every optimizer step through vLLM's weight-transfer protocol with this
package's file backend (``transfer.py``, ``transfer_engine.py``, registered by ``plugin.py``); ``launch.py``
starts and stops servers, ``auth.py`` makes every request but the health check carry the run's token."""
