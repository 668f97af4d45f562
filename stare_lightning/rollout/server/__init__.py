"""Rollouts on separate vLLM server processes (``rollout=server``): the stock OpenAI-compatible server generates, and
the trainer pushes its weights after every optimizer step through vLLM's weight-transfer protocol.

The code is split by the process it runs in: ``trainer_side/`` runs in the trainer (start, reach and drive the
servers: the ``RolloutEngine``, the client, the launcher, the network push), ``in_vllm/`` runs inside each vLLM server
process (the plugin vLLM loads, the weight-transfer backend, the token guard, the network receive), and ``shared/``
holds what both sides speak (the chunk wire formats, the network group, the credential's rules). ``in_vllm/`` imports
nothing of ``trainer_side/`` (tests/test_import_layers.py)."""
