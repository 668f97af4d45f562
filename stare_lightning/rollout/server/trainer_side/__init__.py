"""The trainer's side of ``rollout=server``: code that runs in the trainer's processes (``launch.py`` starts and
stops servers, ``connect.py`` reaches them, ``engine.py`` is the ``RolloutEngine``, ``client.py`` and ``http.py`` talk
to one server, ``net_push.py`` sends weights over the network, ``placement.py`` picks the transfer)."""
