"""What the trainer and the vLLM servers both speak: the chunk files' wire format (``transfer.py``), the network
chunks' (``net_wire.py``), the two-process group they push over (``net_group.py``) and the credential's rules
(``token.py``)."""
