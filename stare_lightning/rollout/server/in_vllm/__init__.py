"""Code that runs inside each vLLM server process: ``plugin.py`` (vLLM's entry point) registers the weight-transfer
backend (``transfer_engine.py``, with ``net_receive.py`` for the network), and ``auth.py`` is the token guard before
every route (with ``adapter_check.py`` before the adapter routes). Nothing here imports the trainer's side."""
